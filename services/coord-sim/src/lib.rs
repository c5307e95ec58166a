//! coord under Keel's simulator (issue #23): a ZooKeeper workload run by the simulator's
//! clients against the coordination service on every simulated node, under every fault
//! the simulator injects, and the checks its histories must pass.
//!
//! The workload: each client opens a session (`Connect`; the id comes back in the reply,
//! which the workload observes), then creates, overwrites, deletes and reads a few persistent
//! znodes, creates sequential znodes under one parent and ephemeral znodes of its own,
//! reads other clients' ephemerals, uses multi and multiRead on a pair of znodes (below),
//! and now and then closes its session. Sessions are
//! touched only to confirm a move (below), so they also expire at agreed-time ticks,
//! and their ephemerals go with them. Now and then a client moves its session (attaches
//! it again with a new password, as a client does when its node dies), and one client
//! in eight ([`is_liar`]) is a lying front end: a quarter of its ops try to take, touch,
//! write through or close other clients' sessions (`sessions.rs`).
//!
//! Watches: a third of the sessions ([`persistent_session`], by id) first set persistent
//! watches with addWatch (on `/q` and on one `/p` path) and a persistent-recursive one
//! on `/e`, and no one-shot watch; the others set one-shot watches on half their
//! getData and exists (of `/pN`, `/vN`, `/acl` and other clients' ephemerals, so an
//! event also comes when an ephemeral's session closes or expires) and by getChildren of
//! `/q` and `/e`. (Kept apart because a session hears one event per kind and path per
//! transaction, whichever of its watches fired.) The simulator hands the workload each
//! client's push stream ([`Workload::on_push`]): the events r + 1 nodes sent alike, in
//! decided order, and the gaps where some were lost.
//!
//! The checks:
//! - **Persistent znodes are linearizable registers.** A create is a compare-and-set
//!   from absent (OK or NODEEXISTS), a setData or delete (version -1) that succeeded a
//!   write (of a value, or of absence), one that answered NONODE a read of absence, a
//!   getData a read; judged per path by the simulator's Wing-Gong checker. (A successful
//!   setData or delete is not also taken to assert the znode was there: weaker than
//!   ZooKeeper's semantics, never a false alarm.)
//! - **Single ops at a version.** `/v0` and `/v1` are created once and never deleted, so
//!   version k is the k-th value written there (values are unique): a setData at the
//!   version a client last read is a compare-and-set from the value it read, BADVERSION
//!   a failed one. Deletes of the other paths name the version last read half the time:
//!   one that succeeded is a write of absence, one that answered BADVERSION did nothing
//!   (a version can come back after a delete and a create, so it says nothing of the
//!   value).
//! - **Sequential names** are distinct and follow real time: a create that returned
//!   before another was invoked has the smaller suffix.
//! - **A multi is all or nothing.** `/x` and `/y` are written only by multis that set
//!   both to one value (created together, set together — half the time at the version
//!   the client last read, a compare-and-set — and sometimes by a multi that sets both
//!   and then fails a version check). Every multiRead of the two must find them equal
//!   (data and version) or both absent, never a failed multi's value, and the pair, read
//!   that way, must be a linearizable register. A failed multi's reply must say where it failed:
//!   OK before, the error at, RUNTIMEINCONSISTENCY after.
//! - **ACLs are enforced.** A third of the clients authenticate (digest) as `alice`, a
//!   third as `mallory`, the rest not at all. `/acl` is created with `digest:alice` ALL
//!   and `world:anyone` READ: a setData there must succeed only for a session that
//!   authenticated as alice before it (NOAUTH otherwise), and a getData must never
//!   answer NOAUTH. `/acl` is also a linearizable register (a refused set changes
//!   nothing).
//! - **Sessions stay with their client**: every lie about another client's session is
//!   refused (even with a password the client used before and a move retired, or an
//!   honest attach replayed), and no client is told its own session moved.
//! - **Ephemerals end with their session**: once a client learned its session ended (its
//!   close answered, or a request refused with SESSION_EXPIRED), no read invoked later
//!   finds that session's ephemerals.
//! - **Watches** (`watches.rs` says what each rests on). The zxid R of the state a
//!   watching request ran on is bounded: at least every zxid answered (by any op:
//!   writes, failed writes, sessions, watching reads, addWatch) before it was invoked
//!   and its stat's mzxid and pzxid, at most every zxid answered by an op invoked after
//!   it returned (less one for a transaction); addWatch and the (ordered) watching
//!   reads answer their R, which must lie within those bounds. A transaction the history knows is an answered
//!   op that changed the state, with the reply's zxid. Then:
//!   - *in order, once, to the right client*: a client's events come in zxid order,
//!     none twice, none of another client's session;
//!   - *for a real change*: an event at the zxid of a known transaction names a change it
//!     made (NODE_CREATED or NODE_DELETED of a path, NODE_CHILDREN_CHANGED of its
//!     parent, NODE_DATA_CHANGED of a set path; a closeSession's deletes of `/e/*`);
//!     one at another zxid names a change that an op without an answer or a session's
//!     end (a close or an expiry: deletes of `/e/*`) may make;
//!   - *set before, one-shot fires once*: each one-shot event is matched to its own
//!     watch of that session, class (data or child) and path that may have been set
//!     (R may lie) after the previous such event and before the change; a persistent
//!     session's event needs an addWatch covering it with R before the change;
//!   - *owed events come*: for a watch surely set and a known transaction ordered after
//!     it (zxid above R's bound) that fires it, if the client's stream later holds an
//!     event past that zxid with no gap and no end of the session before it, then the
//!     event is there (a one-shot watch: an event of its kind and path after R and no
//!     later than that change; persistent: exactly that change's event). Events owed by
//!     expiries are not looked for: the history does not know their zxids.
//!
//! The simulator itself checks agreement, validity, exactly-once, checkpoint and push
//! agreement; a node whose state diverged (a service that expires by local time, say)
//! shows there.

mod sessions;
mod watches;

pub use sessions::is_liar;

use keel_coord::coord::digest_id;
use keel_coord::coord::{Command, Reply};
use keel_coord::jute::Reader;
use keel_coord::proto::{err, op, perm, Acl, Request, Stat};
use keel_coord::Coord;
use keel_core::client::Pushed;
use keel_core::message::ReadConsistency;
use keel_sim::linearizability::{check_kv, KvOp, KvRet, Operation, Verdict};
use keel_sim::{run_seed, HistoryEntry, SeedReport, SimOptions, Workload};
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

/// Runs the coord workload for one seed, with agreed-time ticks every 500 ms (coord's
/// own setting) unless the options set others.
pub fn run_coord_seed(opts: &SimOptions) -> SeedReport {
    run_coord_seed_with_stats(opts).0
}

/// [`run_coord_seed`], with what the history held (so a test can see the run was not
/// vacuous).
pub fn run_coord_seed_with_stats(opts: &SimOptions) -> (SeedReport, Stats) {
    let stats = Arc::new(Mutex::new(Stats::default()));
    let workload = CoordWorkload { stats: stats.clone(), ..CoordWorkload::new() };
    let report = run_seed(&with_ticks(opts), workload);
    let stats = stats.lock().map(|s| s.clone()).unwrap_or_default();
    (report, stats)
}

/// What a run's history held.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub sessions: u64,
    /// Sessions whose client learned they expired, and ones it closed.
    pub expired: u64,
    pub closed: u64,
    /// Persistent-znode operations judged for linearizability.
    pub register_ops: u64,
    pub sequential: u64,
    pub ephemerals: u64,
    /// Reads of an ephemeral invoked after its session's end was known.
    pub reads_after_end: u64,
    /// Multis and multiReads on the pair judged, and failed multis among them.
    pub pair_ops: u64,
    pub failed_multis: u64,
    /// Multis that set the pair at the version read (judged as compare-and-set).
    pub conditional_sets: u64,
    /// Ops on `/acl` judged against its ACL, and those refused with NOAUTH.
    pub acl_ops: u64,
    pub no_auth: u64,
    /// Single setData and delete ops that named a version, and those refused with
    /// BADVERSION.
    pub versioned_ops: u64,
    pub bad_versions: u64,
    /// Watches set: one-shot ones by reads that answered (so they registered), and
    /// persistent and recursive ones by addWatch.
    pub one_shot_watches: u64,
    pub persistent_watches: u64,
    /// Watch events clients accepted, and gaps in their push streams.
    pub watch_events: u64,
    pub push_gaps: u64,
    /// Events whose zxid is a transaction the history knows, judged against its changes;
    /// the others, judged against what ops without an answer and expiries may change.
    pub events_against_changes: u64,
    pub events_at_unknown_zxids: u64,
    /// Events matched to the one-shot watch that fired them.
    pub one_shot_events: u64,
    /// Watches whose event was owed and found (a later change, the push stream intact
    /// past it).
    pub owed_events: u64,
    /// The lying front end's attempts on other clients' sessions (all refused), and
    /// clients' moves of their own (attaches with a new password).
    pub liar_attempts: u64,
    pub moves: u64,
}

/// coord's tick when the options have none: sessions expire at ticks.
pub const TICK_MS: u64 = 500;

/// `opts` with coord's tick if it has none.
pub fn with_ticks(opts: &SimOptions) -> SimOptions {
    opts.ticking(TICK_MS)
}

/// Persistent znodes: a few hot paths.
const PATHS: u32 = 3;
/// The znode whose ACL lets only alice write (and anyone read).
const ACL_PATH: &str = "/acl";
/// What alice and mallory authenticate with.
const ALICE: &str = "alice:secret";
const MALLORY: &str = "mallory:guess";

/// Who client `client` authenticates as, if anyone.
fn identity_of(client: u64) -> Option<&'static str> {
    match client % 3 {
        0 => Some(ALICE),
        1 => Some(MALLORY),
        _ => None,
    }
}

/// `/acl`'s ACL.
fn acl_path_acl() -> Vec<Acl> {
    vec![
        Acl { perms: perm::ALL, scheme: "digest".into(), id: digest_id(ALICE) },
        Acl { perms: perm::READ, scheme: "world".into(), id: "anyone".into() },
    ]
}

/// Persistent znodes never deleted: setData at a version is a compare-and-set there.
const VERSIONED: [&str; 2] = ["/v0", "/v1"];
/// Session timeout asked for (agreed ms): several expire within a run.
const SESSION_TIMEOUT: i32 = 6_000;
/// State expansions the linearizability search may use per path.
const LINEARIZABILITY_BUDGET: u64 = 5_000_000;

/// The pair only multis write.
const PAIR: [&str; 2] = ["/x", "/y"];
/// A version no znode reaches in a run: the check that makes a multi fail.
const NEVER_VERSION: i32 = 1_000_000_000;

const SEQUENTIAL: i32 = 2;
const EPHEMERAL: i32 = 1;

/// The workload ([`CoordWorkload::new`]).
#[derive(Default)]
pub struct CoordWorkload {
    /// Each client's open session, as its `Connect` answered.
    sessions: BTreeMap<u64, i64>,
    /// Parents known to exist (a create answered OK or NODEEXISTS): `/q` and `/e`
    /// (never deleted) before their sequential and ephemeral children.
    created: BTreeSet<String>,
    /// Ephemerals some client created, for others to read.
    ephemerals: Vec<String>,
    counter: u64,
    /// The pair as each client last read it: its value and version.
    seen: BTreeMap<u64, (Vec<u8>, i32)>,
    /// Clients whose current session authenticated (or was answered for it).
    authed: BTreeSet<u64>,
    /// Single znodes as each client last read them: (client, path) → value, version.
    seen_single: BTreeMap<(u64, String), (Vec<u8>, i32)>,
    /// A conditional set's new value (of the pair or of a `VERSIONED` znode) → the value
    /// it expects to replace
    /// (values are unique and versions rise by one per set, so "at version k" is "holds
    /// the value read at version k").
    expected: BTreeMap<Vec<u8>, Vec<u8>>,
    /// Each client's addWatch requests issued for its current session (a session with
    /// persistent watches, [`persistent_session`], sets them first).
    added: BTreeMap<u64, usize>,
    /// What each client's core delivered of its push stream, in order.
    pushes: BTreeMap<u64, Vec<(u64, Pushed)>>,
    /// Passwords, moves and what the lying front end saw (`sessions.rs`).
    keys: sessions::Keys,
    /// Filled in by [`Workload::check_history`].
    stats: Arc<Mutex<Stats>>,
}

/// Sessions that watch with addWatch (persistent on `/q` and on one `/p` path,
/// persistent-recursive on `/e`) and set no one-shot watch; the others set only one-shot
/// watches. Kept apart because coord sends one event per session, kind and path for a
/// transaction, whichever watches it fired: a session with both kinds on one path could
/// not tell which one an event used up. Decided by the id, so the check knows it too.
pub fn persistent_session(session: i64) -> bool {
    session.rem_euclid(3) == 0
}

/// The addWatch requests a persistent session makes, in order: (mode, path).
pub(crate) fn persistent_watches_of(session: i64) -> [(i32, String); 3] {
    [(0, "/q".to_string()), (0, format!("/p{}", session.rem_euclid(PATHS as i64))), (1, "/e".to_string())]
}

impl CoordWorkload {
    pub fn new() -> CoordWorkload {
        CoordWorkload::default()
    }

    fn fresh(&mut self, client: u64) -> Vec<u8> {
        self.counter += 1;
        format!("{client}.{}", self.counter).into_bytes()
    }
}

fn create(path: &str, data: Vec<u8>, flags: i32) -> Request {
    Request::Create { opcode: op::CREATE, path: path.into(), data, acl: Acl::open(), flags, ttl: -1 }
}

impl CoordWorkload {
    /// A multi or multiRead on the pair: created together first, then read together,
    /// set together (half the time on the version this client last read), or set
    /// together by a multi whose last op fails.
    fn pair_op(&mut self, rng: &mut ChaCha8Rng, client: u64) -> Request {
        let both = |f: &dyn Fn(&str) -> Request| PAIR.iter().map(|p| f(p)).collect::<Vec<_>>();
        if !self.created.contains(PAIR[0]) {
            let v = self.fresh(client);
            return Request::Multi(both(&|p| create(p, v.clone(), 0)));
        }
        match rng.gen_range(0..10) {
            0..=3 => Request::MultiRead(both(&|p| Request::GetData { path: p.into(), watch: false })),
            4..=7 => {
                let v = self.fresh(client);
                let version = match self.seen.get(&client) {
                    Some((old, version)) if rng.gen_bool(0.5) => {
                        self.expected.insert(v.clone(), old.clone());
                        *version
                    }
                    _ => -1,
                };
                Request::Multi(both(&|p| Request::SetData { path: p.into(), data: v.clone(), version }))
            }
            _ => {
                let v = self.fresh(client);
                let mut ops = both(&|p| Request::SetData { path: p.into(), data: v.clone(), version: -1 });
                ops.push(Request::Check { path: PAIR[0].into(), version: NEVER_VERSION });
                Request::Multi(ops)
            }
        }
    }
}

impl CoordWorkload {
    /// An op on a `VERSIONED` znode: created first, then read, set at the version this
    /// client last read, or set at any version.
    fn versioned_op(&mut self, rng: &mut ChaCha8Rng, client: u64, watch: bool) -> Request {
        let path = VERSIONED[rng.gen_range(0..VERSIONED.len())];
        if !self.created.contains(path) {
            return create(path, self.fresh(client), 0);
        }
        let seen = self.seen_single.get(&(client, path.to_string())).cloned();
        match (rng.gen_range(0..10), seen) {
            (0..=3, _) | (4..=8, None) => Request::GetData { path: path.into(), watch },
            (4..=8, Some((old, version))) => {
                let data = self.fresh(client);
                self.expected.insert(data.clone(), old);
                Request::SetData { path: path.into(), data, version }
            }
            _ => Request::SetData { path: path.into(), data: self.fresh(client), version: -1 },
        }
    }
}

/// Data tree checkpoint segment size in simulations (keel-core's SEGMENT_TARGET in
/// production).
const SEGMENT_BYTES: usize = 256;

impl Workload for CoordWorkload {
    type Service = Coord;

    fn service(&self) -> Coord {
        // Small segments: the simulated trees are small, and checkpoints should reuse
        // and re-cut segments under every fault, as they do at scale.
        Coord::with_segment_target(SEGMENT_BYTES)
    }

    fn unobserved_op(&self) -> Option<Vec<u8>> {
        // A session nobody uses: whether it opens changes no checked path.
        Some(
            Command::Connect { timeout: SESSION_TIMEOUT, ip: "10.9.9.9".into(), pinned: false, verifier: [0; 32] }
                .encode(),
        )
    }

    fn next_op(&mut self, rng: &mut ChaCha8Rng, client: u64) -> Vec<u8> {
        let Some(&session) = self.sessions.get(&client) else {
            return Command::Connect {
                timeout: SESSION_TIMEOUT,
                ip: format!("10.0.0.{}", client % 250),
                pinned: false,
                verifier: self.keys.connect(rng, client),
            }
            .encode();
        };
        if let Some(identity) = identity_of(client).filter(|_| !self.authed.contains(&client)) {
            return Command::Auth { session, scheme: "digest".into(), auth: identity.as_bytes().to_vec() }.encode();
        }
        let watches = persistent_session(session);
        let added = self.added.entry(client).or_default();
        if watches && *added < 3 {
            let (mode, path) = persistent_watches_of(session)[*added].clone();
            *added += 1;
            return Command::Op { session, request: Request::AddWatch { path, mode } }.encode();
        }
        let value = self.fresh(client);
        if let Some(command) = self.keys.lie(rng, client, &self.sessions, value) {
            return command.encode();
        }
        if let Some(command) = self.keys.move_op(rng, client, session) {
            return command.encode();
        }
        // One-shot watches, on half the reads that can set one.
        let watch = !watches && rng.gen_bool(0.5);
        match rng.gen_range(0..100) {
            0..=14 => return Command::Op { session, request: self.pair_op(rng, client) }.encode(),
            15..=24 => return Command::Op { session, request: self.versioned_op(rng, client, watch) }.encode(),
            25..=30 => {
                let request = if !self.created.contains(ACL_PATH) {
                    Request::Create {
                        opcode: op::CREATE,
                        path: ACL_PATH.into(),
                        data: self.fresh(client),
                        acl: acl_path_acl(),
                        flags: 0,
                        ttl: -1,
                    }
                } else if rng.gen_bool(0.5) {
                    Request::SetData { path: ACL_PATH.into(), data: self.fresh(client), version: -1 }
                } else {
                    Request::GetData { path: ACL_PATH.into(), watch }
                };
                return Command::Op { session, request }.encode();
            }
            // Child watches on the parents of sequential and ephemeral znodes.
            31..=36 if !watches => {
                let path = if rng.gen_bool(0.5) { "/q" } else { "/e" };
                if self.created.contains(path) {
                    let request = Request::GetChildren { path: path.into(), watch: true, two: false };
                    return Command::Op { session, request }.encode();
                }
            }
            _ => {}
        }
        let path = format!("/p{}", rng.gen_range(0..PATHS));
        let request = match rng.gen_range(0..100) {
            0..=26 => Request::GetData { path, watch },
            27..=41 => create(&path, self.fresh(client), 0),
            42..=56 => Request::SetData { path, data: self.fresh(client), version: -1 },
            57..=59 => {
                // Half the time at the version this client last read there.
                let version = match self.seen_single.get(&(client, path.clone())) {
                    Some((_, version)) if rng.gen_bool(0.5) => *version,
                    _ => -1,
                };
                Request::Delete { path, version }
            }
            60..=71 if self.created.contains("/q") => create("/q/n-", self.fresh(client), SEQUENTIAL),
            60..=71 => create("/q", Vec::new(), 0),
            72..=81 if self.created.contains("/e") => {
                self.counter += 1;
                create(&format!("/e/{client}-{}", self.counter), Vec::new(), EPHEMERAL)
            }
            72..=81 => create("/e", Vec::new(), 0),
            82..=96 if !self.ephemerals.is_empty() => {
                let path = self.ephemerals[rng.gen_range(0..self.ephemerals.len())].clone();
                Request::Exists { path, watch }
            }
            82..=96 => Request::GetData { path, watch },
            _ => return Command::Close { session }.encode(),
        };
        Command::Op { session, request }.encode()
    }

    /// getData, exists and multiRead go ordered, read-only linearizable or by read index;
    /// a read that sets a watch is ordered (it changes the state).
    fn read_mode(&mut self, rng: &mut ChaCha8Rng, op: &[u8]) -> Option<ReadConsistency> {
        let Ok(Command::Op {
            request:
                Request::GetData { watch: false, .. } | Request::Exists { watch: false, .. } | Request::MultiRead(_),
            ..
        }) = Command::decode(op)
        else {
            return None;
        };
        match rng.gen_range(0..3) {
            0 => None,
            1 => Some(ReadConsistency::Linearizable),
            _ => Some(ReadConsistency::Index),
        }
    }

    fn observe(&mut self, client: u64, op: &[u8], result: &[u8]) {
        let (Ok(command), Some(reply)) = (Command::decode(op), Reply::decode(result)) else { return };
        if !self.keys.observe(client, &command, &reply) {
            return;
        }
        match (command, reply) {
            (Command::Connect { .. }, Reply::Session { id, .. }) => {
                self.sessions.insert(client, id);
                self.authed.remove(&client);
                self.added.remove(&client);
            }
            (Command::Close { .. }, _) => {
                self.sessions.remove(&client);
            }
            (_, Reply::Refused { err: e } | Reply::Op { err: e, .. })
                if e == err::SESSION_EXPIRED || e == err::SESSION_MOVED =>
            {
                self.sessions.remove(&client);
            }
            // Answered: authenticated, or refused and not asked again (the check judges).
            (Command::Auth { .. }, _) => {
                self.authed.insert(client);
            }
            (Command::Op { request: Request::GetData { path, .. }, .. }, Reply::Op { err: e, body, .. }) => {
                let mut r = Reader::new(&body);
                match (e, r.buffer(), Stat::read(&mut r)) {
                    (err::OK, Ok(data), Ok(stat)) => {
                        self.seen_single.insert((client, path), (data, stat.version));
                    }
                    _ => {
                        self.seen_single.remove(&(client, path));
                    }
                }
            }
            (Command::Op { request: Request::MultiRead(ops), .. }, Reply::Op { err: err::OK, body, .. }) => {
                if let Ok([(err::OK, Some(x)), (err::OK, Some(_))]) = multi_results(&body, &ops).as_deref() {
                    self.seen.insert(client, x.clone());
                }
            }
            // The pair exists once a multi creating it answered (done, or it was there).
            (Command::Op { request: Request::Multi(ops), .. }, Reply::Op { err: err::OK, body, .. })
                if matches!(ops.first(), Some(Request::Create { .. })) =>
            {
                if let Ok(results) = multi_results(&body, &ops) {
                    if results.iter().all(|(e, _)| *e == err::OK) || results[0].0 == err::NODE_EXISTS {
                        self.created.insert(PAIR[0].to_string());
                    }
                }
            }
            (Command::Op { request: Request::Create { path, flags, .. }, .. }, Reply::Op { err: e, body, .. }) => {
                match (flags, e) {
                    (0, err::OK | err::NODE_EXISTS) => {
                        self.created.insert(path);
                    }
                    (EPHEMERAL, err::OK) => {
                        if let Ok(name) = Reader::new(&body).string() {
                            self.ephemerals.push(name);
                        }
                    }
                    _ => {}
                }
            }
            _ => {}
        }
    }

    fn on_push(&mut self, client: u64, at: u64, pushed: &Pushed) {
        self.pushes.entry(client).or_default().push((at, pushed.clone()));
    }

    fn check_history(&self, history: &[HistoryEntry]) -> Result<(), String> {
        let mut stats = Stats::default();
        for h in history {
            if let (Command::Connect { .. }, Some((_, Reply::Session { .. }))) = decoded(h)? {
                stats.sessions += 1;
            }
        }
        (stats.liar_attempts, stats.moves) = sessions::check(history)?;
        (stats.register_ops, stats.versioned_ops, stats.bad_versions) = check_registers(history, &self.expected)?;
        (stats.acl_ops, stats.no_auth) = check_acl(history)?;
        (stats.pair_ops, stats.failed_multis, stats.conditional_sets) = check_pair(history, &self.expected)?;
        stats.sequential = check_sequential(history)?;
        check_ephemerals(history, &mut stats)?;
        watches::check(history, &self.pushes, &mut stats)?;
        if let Ok(mut s) = self.stats.lock() {
            *s = stats;
        }
        Ok(())
    }
}

/// What one history entry is, decoded.
pub(crate) fn decoded(h: &HistoryEntry) -> Result<(Command, Option<(u64, Reply)>), String> {
    let command = Command::decode(&h.op).map_err(|e| format!("history holds an undecodable command: {e}"))?;
    let ret = match &h.ret {
        None => None,
        Some((t, bytes)) => Some((*t, Reply::decode(bytes).ok_or("history holds an undecodable reply")?)),
    };
    Ok((command, ret))
}

/// Persistent znodes as linearizable registers (see the module comment); `expected`:
/// each conditional set's value → the value it expects to replace. Returns (ops judged,
/// versioned ops, those refused with BADVERSION).
fn check_registers(history: &[HistoryEntry], expected: &BTreeMap<Vec<u8>, Vec<u8>>) -> Result<(u64, u64, u64), String> {
    let mut ops = Vec::new();
    let (mut versioned, mut bad_versions) = (0, 0);
    for h in history {
        let (command, ret) = decoded(h)?;
        let Command::Op { request, .. } = command else { continue };
        let at_version =
            matches!(request, Request::SetData { version: 0.., .. } | Request::Delete { version: 0.., .. });
        if at_version {
            versioned += 1;
            if let Some((_, Reply::Op { err: err::BAD_VERSION, .. })) = &ret {
                bad_versions += 1;
            }
        }
        let (path, kv) = match request {
            Request::Create { path, data, flags: 0, .. } => {
                (path.clone(), KvOp::Cas { key: path.into_bytes(), expected: None, new: data })
            }
            Request::SetData { path, data, version: 0.. } => {
                let Some(old) = expected.get(&data) else {
                    return Err(format!("{path}: a setData at a version the workload has no record of"));
                };
                (path.clone(), KvOp::Cas { key: path.into_bytes(), expected: Some(old.clone()), new: data })
            }
            Request::SetData { path, data, .. } => (path.clone(), KvOp::Put { key: path.into_bytes(), value: data }),
            Request::GetData { path, .. } => (path.clone(), KvOp::Get { key: path.into_bytes() }),
            Request::Delete { path, .. } => (path.clone(), KvOp::Delete { key: path.into_bytes() }),
            _ => continue,
        };
        let ret = match ret {
            None => None,
            Some((t, Reply::Op { err: e, body, .. })) => {
                let r = match (&kv, e) {
                    // Refused with its session gone: it did nothing.
                    (_, err::SESSION_EXPIRED | err::SESSION_MOVED) => continue,
                    (KvOp::Cas { .. }, err::OK) => KvRet::Swapped(true),
                    // A create that found the znode, a set at a version that found another.
                    (KvOp::Cas { expected: None, .. }, err::NODE_EXISTS) => KvRet::Swapped(false),
                    (KvOp::Cas { expected: Some(_), .. }, err::BAD_VERSION) => KvRet::Swapped(false),
                    // A delete at a version that found another did nothing, and says
                    // nothing of the value (see the module comment).
                    (KvOp::Delete { .. }, err::BAD_VERSION) if at_version => continue,
                    // Refused by the ACL: nothing changed (check_acl judges the refusal).
                    (KvOp::Put { .. }, err::NO_AUTH) => continue,
                    (KvOp::Put { .. } | KvOp::Delete { .. }, err::OK) => KvRet::Done,
                    // A setData or delete that found no node observed it absent: a read.
                    (KvOp::Put { .. } | KvOp::Delete { .. }, err::NO_NODE) => {
                        let key = path.into_bytes();
                        let op = Operation {
                            client: h.client,
                            op: KvOp::Get { key },
                            invoke: h.invoke,
                            ret: Some((t, KvRet::Value(None))),
                        };
                        ops.push(op);
                        continue;
                    }
                    (KvOp::Get { .. }, err::OK) => {
                        KvRet::Value(Some(Reader::new(&body).buffer().map_err(|e| format!("getData {path}: {e}"))?))
                    }
                    (KvOp::Get { .. }, err::NO_NODE) => KvRet::Value(None),
                    (_, e) => return Err(format!("{path}: unexpected error {e}")),
                };
                Some((t, r))
            }
            Some((_, Reply::Refused { .. })) => continue,
            Some((_, other)) => return Err(format!("{path}: not an op reply: {other:?}")),
        };
        ops.push(Operation { client: h.client, op: kv, invoke: h.invoke, ret });
    }
    match check_kv(&ops, LINEARIZABILITY_BUDGET) {
        Verdict::Linearizable => Ok((ops.len() as u64, versioned, bad_versions)),
        Verdict::Violation { key, explanation } => {
            Err(format!("znode {} has no linearization:\n{explanation}", String::from_utf8_lossy(&key)))
        }
        Verdict::Unknown { key } => {
            Err(format!("linearizability search exceeded its budget on {}", String::from_utf8_lossy(&key)))
        }
    }
}

/// `/acl`'s ACL is enforced (see the module comment). Returns (ops judged, NOAUTHs).
fn check_acl(history: &[HistoryEntry]) -> Result<(u64, u64), String> {
    /// One authentication of a session.
    struct Auth {
        invoked: u64,
        /// None: no answer came.
        returned: Option<u64>,
        identity: String,
        ok: bool,
    }
    // Per session, in history order.
    let mut auths: BTreeMap<i64, Vec<Auth>> = BTreeMap::new();
    for h in history {
        if let (Command::Auth { session, auth, .. }, ret) = decoded(h)? {
            auths.entry(session).or_default().push(Auth {
                invoked: h.invoke,
                returned: ret.as_ref().map(|(t, _)| *t),
                identity: String::from_utf8_lossy(&auth).into_owned(),
                ok: matches!(ret, Some((_, Reply::Op { err: err::OK, .. }))),
            });
        }
    }
    let (mut judged, mut refused) = (0, 0);
    for h in history {
        let (Command::Op { session, request }, Some((_, Reply::Op { err: e, .. }))) = decoded(h)? else { continue };
        let write = match &request {
            Request::SetData { path, .. } if path == ACL_PATH => true,
            Request::GetData { path, .. } if path == ACL_PATH => false,
            _ => continue,
        };
        // Alice, as far as the session's authentications before this op say; unknown
        // while one of them has no answer.
        let before: Vec<&Auth> = auths.get(&session).into_iter().flatten().filter(|a| a.invoked < h.invoke).collect();
        if before.iter().any(|a| a.returned.is_none_or(|t| t > h.invoke)) {
            continue;
        }
        let alice = before.iter().any(|a| a.ok && a.identity == ALICE);
        judged += 1;
        if e == err::NO_AUTH {
            refused += 1;
        }
        let wrong = match (write, alice, e) {
            (_, _, err::SESSION_EXPIRED | err::SESSION_MOVED | err::NO_NODE) => false,
            (true, true, e) => e != err::OK,
            (true, false, e) => e != err::NO_AUTH,
            (false, _, e) => e != err::OK,
        };
        if wrong {
            let who = if alice { "authenticated as alice" } else { "not authenticated as alice" };
            let what = if write { "setData" } else { "getData" };
            return Err(format!(
                "ACL: a {what} of {ACL_PATH} invoked at {} ms by client {}'s session, {who}, answered {e}",
                h.invoke, h.client
            ));
        }
    }
    Ok((judged, refused))
}

/// Sequential names are distinct and ordered as the creates were in real time.
fn check_sequential(history: &[HistoryEntry]) -> Result<u64, String> {
    // (invoked, returned, name)
    let mut made: Vec<(u64, u64, String)> = Vec::new();
    for h in history {
        let (command, ret) = decoded(h)?;
        let (
            Command::Op { request: Request::Create { flags: SEQUENTIAL, .. }, .. },
            Some((t, Reply::Op { err: err::OK, body, .. })),
        ) = (command, ret)
        else {
            continue;
        };
        let name = Reader::new(&body).string().map_err(|e| format!("sequential create's name: {e}"))?;
        made.push((h.invoke, t, name));
    }
    let mut names = BTreeSet::new();
    for (_, _, name) in &made {
        if !names.insert(name.clone()) {
            return Err(format!("sequential name {name} given out twice"));
        }
    }
    for a in &made {
        for b in &made {
            // Same width (%010d): names compare as their numbers do.
            if a.1 < b.0 && a.2 >= b.2 {
                return Err(format!("{} returned before {} was asked for, yet is not smaller", a.2, b.2));
            }
        }
    }
    Ok(made.len() as u64)
}

/// No read invoked after a client learned its session ended finds its ephemerals.
fn check_ephemerals(history: &[HistoryEntry], stats: &mut Stats) -> Result<(), String> {
    // Per client, in history order: (ephemeral names of its current session), and when
    // each session's end became known.
    let mut open: BTreeMap<u64, Vec<String>> = BTreeMap::new();
    // Ephemeral name -> time its session's end was known.
    let mut ended: BTreeMap<String, u64> = BTreeMap::new();
    let mut by_client: BTreeMap<u64, Vec<&HistoryEntry>> = BTreeMap::new();
    for h in history {
        by_client.entry(h.client).or_default().push(h);
    }
    for (client, entries) in by_client {
        // The client's current session (the liar's refused lies end none of its own).
        let mut current = None;
        for h in entries {
            let (command, ret) = decoded(h)?;
            let Some((t, reply)) = ret else { continue };
            if let (Command::Connect { .. }, Reply::Session { id, .. }) = (&command, &reply) {
                current = Some(*id);
            }
            if sessions::target(&command).is_some_and(|s| Some(s) != current) {
                continue;
            }
            let session_over = match (&command, &reply) {
                (Command::Close { .. }, Reply::Op { err: err::OK, .. }) => {
                    stats.closed += 1;
                    true
                }
                (_, Reply::Refused { err: e } | Reply::Op { err: e, .. }) if *e == err::SESSION_EXPIRED => {
                    stats.expired += 1;
                    true
                }
                _ => false,
            };
            if session_over {
                for name in open.remove(&client).unwrap_or_default() {
                    ended.insert(name, t);
                }
                continue;
            }
            if let (
                Command::Op { request: Request::Create { flags: EPHEMERAL, .. }, .. },
                Reply::Op { err: err::OK, body, .. },
            ) = (&command, &reply)
            {
                if let Ok(name) = Reader::new(body).string() {
                    stats.ephemerals += 1;
                    open.entry(client).or_default().push(name);
                }
            }
        }
    }
    for h in history {
        let (command, ret) = decoded(h)?;
        let (Command::Op { request: Request::Exists { path, .. }, .. }, Some((_, Reply::Op { err: e, .. }))) =
            (command, ret)
        else {
            continue;
        };
        if let Some(&gone) = ended.get(&path) {
            if h.invoke > gone {
                stats.reads_after_end += 1;
            }
            if h.invoke > gone && e == err::OK {
                return Err(format!(
                    "{path} still existed for a read invoked at {} ms, after its session's end was known at {gone} ms",
                    h.invoke
                ));
            }
        }
    }
    Ok(())
}

/// One op's result inside a multi or multiRead: its error code and, for a getData that
/// succeeded, the data and its version.
pub(crate) type OpResult = (i32, Option<(Vec<u8>, i32)>);

/// A multi's or multiRead's results, one per op.
pub(crate) fn multi_results(body: &[u8], ops: &[Request]) -> Result<Vec<OpResult>, String> {
    let mut r = Reader::new(body);
    let bad = |e: keel_coord::jute::JuteError| format!("multi reply: {e}");
    let mut out = Vec::with_capacity(ops.len());
    for request in ops {
        let (kind, done, e) = (r.int().map_err(bad)?, r.bool().map_err(bad)?, r.int().map_err(bad)?);
        if done {
            return Err(format!("multi reply ends after {} of {} results", out.len(), ops.len()));
        }
        if kind == op::ERROR {
            r.int().map_err(bad)?;
            out.push((e, None));
            continue;
        }
        let data = match request {
            Request::GetData { .. } => {
                let data = r.buffer().map_err(bad)?;
                Some((data, Stat::read(&mut r).map_err(bad)?.version))
            }
            Request::SetData { .. } => {
                Stat::read(&mut r).map_err(bad)?;
                None
            }
            Request::Create { .. } => {
                r.string().map_err(bad)?;
                None
            }
            _ => None,
        };
        out.push((e, data));
    }
    Ok(out)
}

/// The pair (see the module comment): multiReads find both znodes equal and never a
/// failed multi's value, failed multis say where they failed, and the pair is a
/// linearizable register, a conditional set being a compare-and-set from the value read
/// with the version it names (`expected`). Returns (ops judged, failed multis,
/// conditional sets).
fn check_pair(history: &[HistoryEntry], expected: &BTreeMap<Vec<u8>, Vec<u8>>) -> Result<(u64, u64, u64), String> {
    let key = b"/x+/y".to_vec();
    let mut failed_values = BTreeSet::new();
    let mut reads = Vec::new();
    let mut ops = Vec::new();
    let (mut failed, mut conditional) = (0, 0);
    for h in history {
        let (Command::Op { request: request @ (Request::Multi(_) | Request::MultiRead(_)), .. }, ret) = decoded(h)?
        else {
            continue;
        };
        let (Request::Multi(list) | Request::MultiRead(list)) = &request else { continue };
        let results = match &ret {
            Some((t, Reply::Op { err: err::OK, body, .. })) => Some((*t, multi_results(body, list)?)),
            Some((_, Reply::Op { err: err::SESSION_EXPIRED | err::SESSION_MOVED, .. } | Reply::Refused { .. })) => {
                continue
            }
            Some((_, other)) => return Err(format!("a multi answered {other:?}")),
            None => None,
        };
        let codes = |rs: &[OpResult]| rs.iter().map(|(e, _)| *e).collect::<Vec<_>>();
        let (kv, ret) = match (list.as_slice(), results) {
            // Create both.
            ([Request::Create { data, .. }, _], results) => {
                let cas = KvOp::Cas { key: key.clone(), expected: None, new: data.clone() };
                match results.as_ref().map(|(t, rs)| (*t, codes(rs))) {
                    None => (cas, None),
                    Some((t, c)) if c == [err::OK, err::OK] => (cas, Some((t, KvRet::Swapped(true)))),
                    Some((t, c)) if c == [err::NODE_EXISTS, err::RUNTIME_INCONSISTENCY] => {
                        (cas, Some((t, KvRet::Swapped(false))))
                    }
                    Some((_, c)) => {
                        return Err(format!("creating the pair answered {c:?}: no all-or-nothing multi answers that"))
                    }
                }
            }
            // Set both, then fail: nothing may change.
            ([Request::SetData { data, .. }, _, Request::Check { .. }], results) => {
                failed_values.insert(data.clone());
                if let Some((_, rs)) = results {
                    let c = codes(&rs);
                    let expected = [err::OK, err::OK, err::BAD_VERSION];
                    let absent = [err::NO_NODE, err::RUNTIME_INCONSISTENCY, err::RUNTIME_INCONSISTENCY];
                    if c != expected && c != absent {
                        return Err(format!("a multi failing at its version check answered {c:?}"));
                    }
                    failed += 1;
                }
                continue;
            }
            // Set both at the version read: swapped, or found another version.
            ([Request::SetData { data, version, .. }, _], results) if *version >= 0 => {
                let old = expected.get(data).ok_or("a conditional set the workload has no record of")?;
                let cas = KvOp::Cas { key: key.clone(), expected: Some(old.clone()), new: data.clone() };
                conditional += 1;
                match results.as_ref().map(|(t, rs)| (*t, codes(rs))) {
                    None => (cas, None),
                    Some((t, c)) if c == [err::OK, err::OK] => (cas, Some((t, KvRet::Swapped(true)))),
                    Some((t, c)) if c == [err::BAD_VERSION, err::RUNTIME_INCONSISTENCY] => {
                        (cas, Some((t, KvRet::Swapped(false))))
                    }
                    Some((_, c)) => {
                        return Err(format!(
                            "setting the pair at version {version} answered {c:?}: no all-or-nothing multi answers that"
                        ))
                    }
                }
            }
            // Set both.
            ([Request::SetData { data, .. }, _], results) => {
                let put = KvOp::Put { key: key.clone(), value: data.clone() };
                match results.as_ref().map(|(t, rs)| (*t, codes(rs))) {
                    None => (put, None),
                    Some((t, c)) if c == [err::OK, err::OK] => (put, Some((t, KvRet::Done))),
                    // The pair not there yet: a read of its absence.
                    Some((t, c)) if c == [err::NO_NODE, err::RUNTIME_INCONSISTENCY] => {
                        (KvOp::Get { key: key.clone() }, Some((t, KvRet::Value(None))))
                    }
                    Some((_, c)) => {
                        return Err(format!("setting the pair answered {c:?}: no all-or-nothing multi answers that"))
                    }
                }
            }
            // Read both.
            ([Request::GetData { .. }, Request::GetData { .. }], Some((t, rs))) => {
                let value = match rs.as_slice() {
                    // Created together and set together: the same data and version.
                    [(err::OK, Some(x)), (err::OK, Some(y))] if x == y => Some(x.0.clone()),
                    [(err::NO_NODE, _), (err::NO_NODE, _)] => None,
                    other => {
                        return Err(format!(
                            "a multiRead invoked at {} ms found /x and /y apart: {other:?} (a multi applied in part)",
                            h.invoke
                        ))
                    }
                };
                reads.push((h.invoke, value.clone()));
                (KvOp::Get { key: key.clone() }, Some((t, KvRet::Value(value))))
            }
            _ => continue,
        };
        ops.push(Operation { client: h.client, op: kv, invoke: h.invoke, ret });
    }
    if let Some((at, v)) = reads.iter().find(|(_, v)| v.as_ref().is_some_and(|v| failed_values.contains(v))) {
        return Err(format!(
            "a multiRead invoked at {at} ms found {:?}, the value of a multi that failed",
            String::from_utf8_lossy(v.as_deref().unwrap_or_default())
        ));
    }
    match check_kv(&ops, LINEARIZABILITY_BUDGET) {
        Verdict::Linearizable => Ok((ops.len() as u64, failed, conditional)),
        Verdict::Violation { explanation, .. } => Err(format!("the pair /x, /y has no linearization:\n{explanation}")),
        Verdict::Unknown { .. } => Err("linearizability search exceeded its budget on the pair".into()),
    }
}
