//! coord under the simulator: its checks pass under every fault class at (1, 1) and
//! (1, 0), the runs exercise what the checks judge, and each check is shown able to fail.

use keel_coord_sim::{run_coord_seed_with_stats, Stats};
use keel_sim::{FaultSet, SeedReport, SimOptions};

fn faults(s: &str) -> FaultSet {
    FaultSet::parse(s).expect("known fault set")
}

fn assert_clean(r: &SeedReport) {
    r.assert_clean();
}

#[test]
fn every_fault_class_passes_and_the_runs_exercise_the_checks() {
    let mut total = Stats::default();
    for f in ["none", "crash", "network", "byzantine", "all"] {
        for (u, r) in [(1, 1), (1, 0)] {
            // Progress per configuration, over both seeds: one seed can draw a harsh fault
            // schedule (all (1,1) seed 2 completed 20 operations through 33 view changes
            // once who replies changed, and 48-56 before; over 30 seeds the totals were
            // 1,356 and 1,397), and liveness after the faults is the liveness checker's.
            let mut ops = 0;
            for seed in 1..=2 {
                let (report, stats) = run_coord_seed_with_stats(&SimOptions::new(seed, u, r, faults(f)));
                eprintln!(
                    "{f} ({u},{r}) seed {seed}: {} ops, {} ms, {} ticks, {stats:?}",
                    report.ops_completed, report.fault_phase_ms, report.ticks
                );
                assert_clean(&report);
                assert!(report.ops_completed >= 10, "{f} ({u},{r}) seed {seed}: {} ops", report.ops_completed);
                ops += report.ops_completed;
                total.sessions += stats.sessions;
                total.expired += stats.expired;
                total.closed += stats.closed;
                total.register_ops += stats.register_ops;
                total.sequential += stats.sequential;
                total.ephemerals += stats.ephemerals;
                total.reads_after_end += stats.reads_after_end;
                total.pair_ops += stats.pair_ops;
                total.failed_multis += stats.failed_multis;
                total.conditional_sets += stats.conditional_sets;
                total.versioned_ops += stats.versioned_ops;
                total.acl_ops += stats.acl_ops;
                total.no_auth += stats.no_auth;
                total.bad_versions += stats.bad_versions;
                total.one_shot_watches += stats.one_shot_watches;
                total.persistent_watches += stats.persistent_watches;
                total.watch_events += stats.watch_events;
                total.push_gaps += stats.push_gaps;
                total.events_against_changes += stats.events_against_changes;
                total.events_at_unknown_zxids += stats.events_at_unknown_zxids;
                total.one_shot_events += stats.one_shot_events;
                total.owed_events += stats.owed_events;
                total.liar_attempts += stats.liar_attempts;
                total.moves += stats.moves;
            }
            assert!(ops > 60, "{f} ({u},{r}): {ops} ops over both seeds");
        }
    }
    eprintln!("all runs: {total:?}");
    assert!(total.register_ops > 1_000, "{total:?}");
    assert!(total.sequential > 50 && total.ephemerals > 50, "{total:?}");
    assert!(total.expired > 0 && total.closed > 0, "sessions both expire and close: {total:?}");
    assert!(total.reads_after_end > 10, "ephemerals are read after their session ended: {total:?}");
    assert!(total.pair_ops > 500 && total.failed_multis > 50, "multis and multiReads are judged: {total:?}");
    assert!(total.conditional_sets > 100, "sets at a version are judged: {total:?}");
    assert!(
        total.versioned_ops > 300 && total.bad_versions > 20,
        "single sets and deletes at a version, some refused, are judged: {total:?}"
    );
    assert!(total.acl_ops > 200 && total.no_auth > 50, "ops on /acl, some refused, are judged: {total:?}");
    assert!(
        total.one_shot_watches > 300 && total.persistent_watches > 30,
        "one-shot and persistent watches are set: {total:?}"
    );
    assert!(total.watch_events > 300 && total.one_shot_events > 100, "watch events come and are matched: {total:?}");
    assert!(total.events_against_changes > 200, "events are judged against the changes that made them: {total:?}");
    assert!(total.events_at_unknown_zxids > 0, "events of expiries are judged: {total:?}");
    assert!(total.owed_events > 100, "events owed are looked for: {total:?}");
    assert!(total.liar_attempts > 200 && total.moves > 20, "sessions move and a liar tries to take them: {total:?}");
}

/// Deliberately broken services, each run by every node alike (so the nodes agree and
/// only the history checks can tell), and one that expires sessions by each node's own
/// clock (which only agreement on the state can tell).
mod broken {
    use super::*;
    use keel_coord::coord::{Command, Push, Reply};
    use keel_coord::jute::{Reader, Writer};
    use keel_coord::proto::{err, event, op, Request, Stat};
    use keel_coord::session_key::{self, SessionSecret, Verifier};
    use keel_coord::Coord;
    use keel_coord_sim::{is_liar, persistent_session, with_ticks, CoordWorkload};
    use keel_core::client::Pushed;
    use keel_core::ids::{owner_of, ClientId};
    use keel_core::message::ReadConsistency;
    use keel_core::service::{ExecCtx, ReadCtx, RestoreError, Service};
    use keel_sim::{run_seed, HistoryEntry, Workload};
    use rand_chacha::ChaCha8Rng;
    use std::collections::{BTreeMap, BTreeSet};
    use std::sync::atomic::{AtomicU64, Ordering};

    #[derive(Clone, Copy)]
    enum Bug {
        /// setData answers OK and changes nothing.
        LostSetData,
        /// delete answers OK and changes nothing.
        LostDelete,
        /// Every sequential create answers the same name.
        SameSequentialName,
        /// closeSession answers OK and keeps the session (and its ephemerals).
        CloseKeepsSession,
        /// Ticks see the node's own clock: each node's runs ahead by a different amount.
        LocalClockExpiry,
        /// A multi runs its ops one by one: those before a failing one stay applied.
        MultiKeepsWhatWorked,
        /// A multi of two ops applies only the first (and answers as if both applied).
        MultiDropsItsLastOp,
        /// setData inside a multi ignores the version it names.
        VersionIgnored,
        /// A single setData ignores the version it names.
        SingleVersionIgnored,
        /// A setData of /acl runs as if its session had authenticated as alice.
        AclIgnored,
        /// A one-shot data watch that fired stays set: every later change of its path by
        /// a single write fires it again.
        OneShotStaysSet,
        /// NODE_DATA_CHANGED events say NODE_CREATED.
        WrongKind,
        /// Events on `/pN` name `/p(N+1)`.
        WrongPath,
        /// A watching getData of a znode whose last change is the latest transaction
        /// fires at once, for that change (which the read saw).
        FiresBeforeTheChange,
        /// Each client's watch events go out in pairs, the second of a pair first.
        OutOfOrder,
        /// Every watch event goes out twice.
        EventTwice,
        /// Watch events of every fourth zxid are never sent (by any node: no gap).
        EventLost,
        /// Watch events go to the next client, not to the session's.
        WrongClient,
        /// Events of persistent watches whose zxid is a multiple of four are never sent.
        PersistentEventLost,
        /// addWatch of a znode whose last change is the latest transaction fires at
        /// once, for that change (made before the watch was set).
        PersistentFiresBeforeTheChange,
        /// addWatch answers a zxid one ahead of the one it ran at.
        AddWatchZxidAhead,
        /// A watching getData or exists answers a zxid one ahead of the one it ran at.
        WatchedReadZxidAhead,
        /// Events fired at ticks (by expiries) say NODE_DATA_CHANGED of `/p0`.
        ExpiryEventWrongPath,
        /// An attach takes the session whatever its proof (as when every node knew the
        /// password).
        AttachWithoutProof,
        /// A password stays good after a later one was confirmed: a front end the
        /// client left can follow it.
        RetiredPasswordKept,
    }

    /// The one key the password bugs put in the real service, so it accepts what they
    /// decide to let through.
    fn master() -> SessionSecret {
        SessionSecret::from_bytes([0x4d; 16])
    }

    /// Gives each service instance (each node, each restart) a different clock offset.
    static INSTANCES: AtomicU64 = AtomicU64::new(0);

    struct Broken {
        coord: Coord,
        bug: Bug,
        skew: u64,
        /// OneShotStaysSet: the one-shot data watches that fired, by path: (session,
        /// where its pushes go).
        fired: BTreeMap<String, BTreeSet<(i64, ClientId)>>,
        /// OutOfOrder: each client's event held back until its next one.
        held: BTreeMap<ClientId, Vec<u8>>,
        /// RetiredPasswordKept: every verifier each session had.
        verifiers: BTreeMap<i64, Vec<Verifier>>,
    }

    impl Service for Broken {
        fn execute(&mut self, request: &[u8], ctx: &ExecCtx) -> Vec<u8> {
            if self.watch_bug() {
                let local = ExecCtx::new(ctx.seq, ctx.time, ctx.seed, ctx.client);
                let zxid_before = self.coord.zxid();
                let reply = self.coord.execute(request, &local);
                let mut pushes = local.take_pushes();
                self.after(request, &reply, zxid_before, &local, &mut pushes);
                self.send(pushes, ctx);
                return reply;
            }
            if matches!(self.bug, Bug::AttachWithoutProof | Bug::RetiredPasswordKept) {
                return self.password_bug(request, ctx);
            }
            let command = Command::decode(request);
            if let (Bug::AclIgnored, Ok(Command::Op { session, request: Request::SetData { path, .. } })) =
                (self.bug, &command)
            {
                if path == "/acl" {
                    let alice =
                        Command::Auth { session: *session, scheme: "digest".into(), auth: b"alice:secret".to_vec() };
                    self.coord.execute(&alice.encode(), ctx);
                }
            }
            // The bugs that answer without running the command skip its session's
            // checks too; they spare the lying client, whose lies the sessions check
            // would catch first, so each stays the bug its test names.
            let liar = is_liar((owner_of(ctx.client)).0);
            match (self.bug, &command) {
                (_, _) if liar => {}
                (Bug::LostSetData, Ok(Command::Op { request: Request::SetData { .. }, .. })) => {
                    let mut w = Writer::new();
                    keel_coord::proto::Stat::default().write(&mut w);
                    return postcard_reply(Reply::Op { zxid: 0, err: err::OK, body: w.into_bytes() });
                }
                (Bug::AddWatchZxidAhead, Ok(Command::Op { request: Request::AddWatch { .. }, .. }))
                | (
                    Bug::WatchedReadZxidAhead,
                    Ok(Command::Op {
                        request: Request::GetData { watch: true, .. } | Request::Exists { watch: true, .. },
                        ..
                    }),
                ) => {
                    let reply = self.coord.execute(request, ctx);
                    return match Reply::decode(&reply) {
                        Some(Reply::Op { zxid, err: err::OK, body }) => {
                            postcard_reply(Reply::Op { zxid: zxid + 1, err: err::OK, body })
                        }
                        _ => reply,
                    };
                }
                (Bug::LostDelete, Ok(Command::Op { request: Request::Delete { .. }, .. })) => {
                    return postcard_reply(Reply::Op { zxid: 0, err: err::OK, body: Vec::new() });
                }
                (Bug::CloseKeepsSession, Ok(Command::Close { .. })) => {
                    return postcard_reply(Reply::Op { zxid: 0, err: err::OK, body: Vec::new() });
                }
                (Bug::VersionIgnored, Ok(Command::Op { session, request: Request::Multi(ops) })) => {
                    let ops = ops
                        .iter()
                        .map(|r| match r {
                            Request::SetData { path, data, .. } => {
                                Request::SetData { path: path.clone(), data: data.clone(), version: -1 }
                            }
                            other => other.clone(),
                        })
                        .collect();
                    let any = Command::Op { session: *session, request: Request::Multi(ops) };
                    return self.coord.execute(&any.encode(), ctx);
                }
                (
                    Bug::SingleVersionIgnored,
                    Ok(Command::Op { session, request: Request::SetData { path, data, version: 0.. } }),
                ) => {
                    let request = Request::SetData { path: path.clone(), data: data.clone(), version: -1 };
                    return self.coord.execute(&Command::Op { session: *session, request }.encode(), ctx);
                }
                (Bug::MultiKeepsWhatWorked, Ok(Command::Op { session, request: Request::Multi(ops) })) => {
                    return self.one_by_one(*session, ops, ctx);
                }
                (Bug::MultiDropsItsLastOp, Ok(Command::Op { session, request: Request::Multi(ops) }))
                    if ops.len() == 2 =>
                {
                    let first = Command::Op { session: *session, request: Request::Multi(ops[..1].to_vec()) };
                    let reply = self.coord.execute(&first.encode(), ctx);
                    // Answered as a multi of both: the first op's result twice.
                    return match Reply::decode(&reply) {
                        Some(Reply::Op { zxid, err: err::OK, body }) => {
                            let end = body.len() - 9;
                            let mut both = body[..end].to_vec();
                            both.extend_from_slice(&body[..end]);
                            both.extend_from_slice(&body[end..]);
                            postcard_reply(Reply::Op { zxid, err: err::OK, body: both })
                        }
                        _ => reply,
                    };
                }
                _ => {}
            }
            let reply = self.coord.execute(request, ctx);
            match (self.bug, command) {
                (Bug::SameSequentialName, Ok(Command::Op { request: Request::Create { flags: 2, .. }, .. })) => {
                    match Reply::decode(&reply) {
                        Some(Reply::Op { zxid, err: err::OK, .. }) => {
                            let mut w = Writer::new();
                            w.string("/q/n-0000000000");
                            postcard_reply(Reply::Op { zxid, err: err::OK, body: w.into_bytes() })
                        }
                        _ => reply,
                    }
                }
                _ => reply,
            }
        }

        fn execute_read_only(&self, request: &[u8], ctx: &ReadCtx) -> Option<Vec<u8>> {
            self.coord.execute_read_only(request, ctx)
        }

        fn on_tick(&mut self, ctx: &ExecCtx) {
            if self.watch_bug() {
                let local = ExecCtx::new(ctx.seq, ctx.time, ctx.seed, ctx.client);
                self.coord.on_tick(&local);
                let mut pushes = local.take_pushes();
                if let Bug::ExpiryEventWrongPath = self.bug {
                    for (_, bytes) in pushes.iter_mut() {
                        if let Some(Push::Watch { session, zxid, .. }) = Push::decode(bytes) {
                            let path = "/p0".to_string();
                            *bytes =
                                postcard_push(&Push::Watch { session, zxid, kind: event::NODE_DATA_CHANGED, path });
                        }
                    }
                }
                self.send(pushes, ctx);
                return;
            }
            if let Bug::LocalClockExpiry = self.bug {
                let local = ExecCtx::new(ctx.seq, ctx.time + self.skew, ctx.seed, ctx.client);
                self.coord.on_tick(&local);
                for (to, event) in local.take_pushes() {
                    ctx.push(to, event);
                }
                return;
            }
            self.coord.on_tick(ctx);
        }

        fn snapshot(&self) -> Vec<u8> {
            self.coord.snapshot()
        }

        fn restore(&mut self, snapshot: &[u8]) -> Result<(), RestoreError> {
            self.coord.restore(snapshot)
        }
    }

    impl Broken {
        /// The password bugs: the service holds only the master key; an attach is
        /// signed by it when the bug lets it through.
        fn password_bug(&mut self, request: &[u8], ctx: &ExecCtx) -> Vec<u8> {
            let command = match Command::decode(request) {
                Ok(Command::Connect { timeout, ip, pinned, verifier }) => {
                    let reply = self.coord.execute(
                        &Command::Connect { timeout, ip: ip.clone(), pinned, verifier: master().verifier() }.encode(),
                        ctx,
                    );
                    if let Some(Reply::Session { id, .. }) = Reply::decode(&reply) {
                        self.verifiers.insert(id, vec![verifier]);
                    }
                    return reply;
                }
                Ok(Command::Attach { session, proof, next, timeout, ip }) => {
                    let owner = owner_of(ctx.client);
                    let known = self
                        .verifiers
                        .get(&session)
                        .is_some_and(|vs| vs.iter().any(|v| session_key::verify(v, session, owner.0, &next, &proof)));
                    let through = matches!(self.bug, Bug::AttachWithoutProof) || known;
                    let next_master = master().verifier();
                    let proof = if through { master().prove(session, owner.0, &next_master) } else { Vec::new() };
                    let reply = self
                        .coord
                        .execute(&Command::Attach { session, proof, next: next_master, timeout, ip }.encode(), ctx);
                    if through {
                        self.verifiers.entry(session).or_default().push(next);
                    }
                    return reply;
                }
                _ => request,
            };
            self.coord.execute(command, ctx)
        }

        fn watch_bug(&self) -> bool {
            matches!(
                self.bug,
                Bug::OneShotStaysSet
                    | Bug::WrongKind
                    | Bug::WrongPath
                    | Bug::FiresBeforeTheChange
                    | Bug::OutOfOrder
                    | Bug::EventTwice
                    | Bug::EventLost
                    | Bug::WrongClient
                    | Bug::PersistentEventLost
                    | Bug::PersistentFiresBeforeTheChange
                    | Bug::ExpiryEventWrongPath
            )
        }

        /// The watch bugs that add events: what `request` (run in `ctx`, answered
        /// `reply`; the state's zxid was `zxid_before`) fires that coord would not.
        fn after(
            &mut self,
            request: &[u8],
            reply: &[u8],
            zxid_before: i64,
            ctx: &ExecCtx,
            pushes: &mut Vec<(ClientId, Vec<u8>)>,
        ) {
            // A session's pushes go to its own client, the one that connected it.
            let client = ctx.client;
            let (Ok(Command::Op { session, request }), Some(Reply::Op { zxid, err: err::OK, body })) =
                (Command::decode(request), Reply::decode(reply))
            else {
                return;
            };
            match (self.bug, request) {
                (Bug::OneShotStaysSet, request) => {
                    for (to, bytes) in pushes.iter() {
                        if let Some(Push::Watch { session, kind, path, .. }) = Push::decode(bytes) {
                            let data =
                                matches!(kind, event::NODE_CREATED | event::NODE_DELETED | event::NODE_DATA_CHANGED);
                            if data && !persistent_session(session) {
                                self.fired.entry(path).or_default().insert((session, *to));
                            }
                        }
                    }
                    let (kind, path) = match request {
                        Request::SetData { path, .. } => (event::NODE_DATA_CHANGED, path),
                        Request::Delete { path, .. } => (event::NODE_DELETED, path),
                        _ => return,
                    };
                    // Fired again, unless coord fired it this time anyway.
                    for (s, to) in self.fired.get(&path).cloned().unwrap_or_default() {
                        let again = Push::Watch { session: s, zxid, kind, path: path.clone() };
                        let fresh = postcard_push(&again);
                        let fired_now = pushes.iter().any(|(_, b)| {
                            matches!(Push::decode(b), Some(Push::Watch { session, path: p, .. }) if session == s && p == path)
                        });
                        if !fired_now {
                            pushes.push((to, fresh));
                        }
                    }
                }
                (Bug::PersistentFiresBeforeTheChange, Request::AddWatch { path, mode: 0 }) => {
                    let exists = Command::Op { session, request: Request::Exists { path: path.clone(), watch: false } };
                    // A read: it changes nothing.
                    let Some(Reply::Op { err: err::OK, body, .. }) =
                        Reply::decode(&self.coord.execute(&exists.encode(), ctx))
                    else {
                        return;
                    };
                    let Ok(stat) = Stat::read(&mut Reader::new(&body)) else { return };
                    if stat.mzxid == zxid {
                        let kind =
                            if stat.czxid == stat.mzxid { event::NODE_CREATED } else { event::NODE_DATA_CHANGED };
                        pushes.push((client, postcard_push(&Push::Watch { session, zxid, kind, path })));
                    }
                }
                (Bug::FiresBeforeTheChange, Request::GetData { path, watch: true }) => {
                    let mut r = Reader::new(&body);
                    let Ok(stat) = r.buffer().and_then(|_| Stat::read(&mut r)) else { return };
                    if stat.mzxid == zxid_before {
                        let kind =
                            if stat.czxid == stat.mzxid { event::NODE_CREATED } else { event::NODE_DATA_CHANGED };
                        let early = Push::Watch { session, zxid: stat.mzxid, kind, path };
                        pushes.push((client, postcard_push(&early)));
                    }
                }
                _ => {}
            }
        }

        /// Sends `pushes`, as the watch bugs change them.
        fn send(&mut self, pushes: Vec<(ClientId, Vec<u8>)>, ctx: &ExecCtx) {
            for (to, bytes) in pushes {
                let Some(Push::Watch { session, zxid, kind, path }) = Push::decode(&bytes) else {
                    ctx.push(to, bytes);
                    continue;
                };
                match self.bug {
                    Bug::WrongKind if kind == event::NODE_DATA_CHANGED => {
                        let wrong = Push::Watch { session, zxid, kind: event::NODE_CREATED, path };
                        ctx.push(to, postcard_push(&wrong));
                    }
                    Bug::WrongPath if path.starts_with("/p") => {
                        let n: u32 = path[2..].parse().unwrap_or(0);
                        let wrong = Push::Watch { session, zxid, kind, path: format!("/p{}", (n + 1) % 3) };
                        ctx.push(to, postcard_push(&wrong));
                    }
                    Bug::OutOfOrder => match self.held.remove(&to) {
                        Some(first) => {
                            ctx.push(to, bytes);
                            ctx.push(to, first);
                        }
                        None => {
                            self.held.insert(to, bytes);
                        }
                    },
                    Bug::EventTwice => {
                        ctx.push(to, bytes.clone());
                        ctx.push(to, bytes);
                    }
                    Bug::EventLost if zxid % 4 == 0 => {}
                    Bug::PersistentEventLost if zxid % 4 == 0 && persistent_session(session) => {}
                    // The simulator's four clients are 1000..=1003.
                    Bug::WrongClient if (1000..1004).contains(&to.0) => {
                        ctx.push(ClientId(1000 + (to.0 - 999) % 4), bytes)
                    }
                    _ => ctx.push(to, bytes),
                }
            }
        }

        /// A multi's ops as single ops: what worked stays when a later one fails.
        fn one_by_one(&mut self, session: i64, ops: &[Request], ctx: &ExecCtx) -> Vec<u8> {
            let mut w = Writer::new();
            let (mut zxid, mut failed) = (0, false);
            for request in ops {
                if failed {
                    w.int(op::ERROR).bool(false).int(err::RUNTIME_INCONSISTENCY).int(err::RUNTIME_INCONSISTENCY);
                    continue;
                }
                // Each op alone, as a multi of one (a check exists only inside a multi).
                let single = Command::Op { session, request: Request::Multi(vec![request.clone()]) };
                let Some(Reply::Op { zxid: z, err: err::OK, body }) =
                    Reply::decode(&self.coord.execute(&single.encode(), ctx))
                else {
                    failed = true;
                    continue;
                };
                let mut r = keel_coord::jute::Reader::new(&body);
                let (_, _, e) = (r.int().unwrap_or(0), r.bool().unwrap_or(true), r.int().unwrap_or(err::OK));
                if e == err::OK {
                    zxid = z;
                    // Its result entry, without the multi's end marker.
                    w.0.extend_from_slice(&body[..body.len() - 9]);
                } else {
                    failed = true;
                    w.int(op::ERROR).bool(false).int(e).int(e);
                }
            }
            w.int(-1).bool(true).int(-1);
            postcard_reply(Reply::Op { zxid, err: err::OK, body: w.into_bytes() })
        }
    }

    fn postcard_reply(reply: Reply) -> Vec<u8> {
        reply.encode()
    }

    fn postcard_push(push: &Push) -> Vec<u8> {
        postcard::to_allocvec(push).unwrap_or_default()
    }

    struct BrokenWorkload {
        inner: CoordWorkload,
        bug: Bug,
    }

    impl Workload for BrokenWorkload {
        type Service = Broken;

        fn service(&self) -> Broken {
            let n = INSTANCES.fetch_add(1, Ordering::Relaxed);
            Broken {
                coord: Coord::new(),
                bug: self.bug,
                skew: (n % 5) * 2_500,
                fired: BTreeMap::new(),
                held: BTreeMap::new(),
                verifiers: BTreeMap::new(),
            }
        }

        fn next_op(&mut self, rng: &mut ChaCha8Rng, client: u64) -> Vec<u8> {
            self.inner.next_op(rng, client)
        }

        fn unobserved_op(&self) -> Option<Vec<u8>> {
            self.inner.unobserved_op()
        }

        fn read_mode(&mut self, rng: &mut ChaCha8Rng, op: &[u8]) -> Option<ReadConsistency> {
            self.inner.read_mode(rng, op)
        }

        fn observe(&mut self, client: u64, op: &[u8], result: &[u8]) {
            self.inner.observe(client, op, result);
        }

        fn on_push(&mut self, client: u64, at: u64, pushed: &Pushed) {
            self.inner.on_push(client, at, pushed);
        }

        fn check_history(&self, history: &[HistoryEntry]) -> Result<(), String> {
            self.inner.check_history(history)
        }
    }

    /// The violations of the first seeds (fault-free, (1, 1)) with `bug` until one shows.
    fn caught(bug: Bug, faults_: &str) -> Vec<keel_sim::Violation> {
        for seed in 1..=10 {
            let o = with_ticks(&SimOptions::new(seed, 1, 1, faults(faults_)));
            let r = run_seed(&o, BrokenWorkload { inner: CoordWorkload::new(), bug });
            if !r.violations.is_empty() {
                return r.violations;
            }
        }
        Vec::new()
    }

    fn says(found: &[keel_sim::Violation], what: &str) -> bool {
        found.iter().any(|v| v.detail.contains(what))
    }

    #[test]
    fn a_lost_set_data_breaks_linearizability() {
        let found = caught(Bug::LostSetData, "none");
        assert!(says(&found, "has no linearization"), "{found:?}");
    }

    #[test]
    fn a_lost_delete_breaks_linearizability() {
        let found = caught(Bug::LostDelete, "none");
        assert!(says(&found, "has no linearization"), "{found:?}");
    }

    #[test]
    fn a_sequential_name_given_twice_is_caught() {
        let found = caught(Bug::SameSequentialName, "none");
        assert!(says(&found, "given out twice"), "{found:?}");
    }

    #[test]
    fn ephemerals_that_outlive_a_closed_session_are_caught() {
        let found = caught(Bug::CloseKeepsSession, "none");
        assert!(says(&found, "after its session's end was known"), "{found:?}");
    }

    #[test]
    fn a_multi_that_keeps_what_worked_before_it_failed_is_caught() {
        let found = caught(Bug::MultiKeepsWhatWorked, "none");
        assert!(says(&found, "the value of a multi that failed"), "{found:?}");
    }

    #[test]
    fn a_multi_applied_in_part_is_caught() {
        let found = caught(Bug::MultiDropsItsLastOp, "none");
        // Seen by a multiRead, or by the next multi's answer.
        assert!(says(&found, "found /x and /y apart") || says(&found, "no all-or-nothing multi"), "{found:?}");
    }

    #[test]
    fn a_set_that_ignores_its_version_is_caught() {
        let found = caught(Bug::VersionIgnored, "none");
        assert!(says(&found, "the pair /x, /y has no linearization"), "{found:?}");
    }

    #[test]
    fn a_single_set_that_ignores_its_version_is_caught() {
        let found = caught(Bug::SingleVersionIgnored, "none");
        assert!(
            says(&found, "znode /v0 has no linearization") || says(&found, "znode /v1 has no linearization"),
            "{found:?}"
        );
    }

    #[test]
    fn a_write_its_acl_forbids_is_caught() {
        let found = caught(Bug::AclIgnored, "none");
        assert!(says(&found, "ACL: a setData of /acl"), "{found:?}");
    }

    #[test]
    fn a_one_shot_watch_that_fires_twice_is_caught() {
        let found = caught(Bug::OneShotStaysSet, "none");
        assert!(says(&found, "a one-shot watch fired twice"), "{found:?}");
    }

    #[test]
    fn an_event_of_the_wrong_kind_is_caught() {
        let found = caught(Bug::WrongKind, "none");
        assert!(says(&found, "but that transaction made"), "{found:?}");
    }

    #[test]
    fn an_event_for_the_wrong_path_is_caught() {
        let found = caught(Bug::WrongPath, "none");
        assert!(says(&found, "but that transaction made"), "{found:?}");
    }

    #[test]
    fn an_event_for_a_change_the_watching_read_saw_is_caught() {
        let found = caught(Bug::FiresBeforeTheChange, "none");
        assert!(says(&found, "or for a change made before it was set"), "{found:?}");
    }

    #[test]
    fn events_out_of_zxid_order_are_caught() {
        let found = caught(Bug::OutOfOrder, "none");
        assert!(says(&found, "got a watch event at zxid"), "{found:?}");
    }

    #[test]
    fn an_event_delivered_twice_is_caught() {
        let found = caught(Bug::EventTwice, "none");
        assert!(says(&found, "zxid") && says(&found, "twice"), "{found:?}");
        assert!(!says(&found, "fired twice"), "{found:?}");
    }

    #[test]
    fn an_event_never_sent_is_caught() {
        let found = caught(Bug::EventLost, "none");
        assert!(says(&found, "but no event came") || says(&found, "but none came"), "{found:?}");
    }

    #[test]
    fn an_event_of_a_persistent_watch_never_sent_is_caught() {
        let found = caught(Bug::PersistentEventLost, "none");
        assert!(says(&found, "but none came"), "{found:?}");
    }

    #[test]
    fn a_persistent_watch_firing_for_a_change_before_it_was_set_is_caught() {
        let found = caught(Bug::PersistentFiresBeforeTheChange, "none");
        assert!(says(&found, "for no addWatch it made before"), "{found:?}");
    }

    #[test]
    fn an_expiry_event_for_the_wrong_path_is_caught() {
        // Sessions expire only when the run lasts: under network faults.
        let found = caught(Bug::ExpiryEventWrongPath, "network");
        // Seen as an event no change explains, or as two alike (two watches' events
        // renamed to one path).
        assert!(
            says(&found, "neither an op without an answer nor a session's end") || says(&found, "twice"),
            "{found:?}"
        );
    }

    #[test]
    fn an_event_sent_to_another_client_is_caught() {
        let found = caught(Bug::WrongClient, "none");
        assert!(says(&found, "got an event of session"), "{found:?}");
    }

    #[test]
    fn an_add_watch_that_answers_a_later_zxid_is_caught() {
        let found = caught(Bug::AddWatchZxidAhead, "none");
        // Seen against the zxids around it, or as an event before the watch it claims.
        assert!(
            says(&found, "its answer's zxids and those of the ops before and after it disagree")
                || says(&found, "for no addWatch it made before"),
            "{found:?}"
        );
    }

    #[test]
    fn a_watching_read_that_answers_a_later_zxid_is_caught() {
        let found = caught(Bug::WatchedReadZxidAhead, "none");
        assert!(says(&found, "its answer's zxids and those of the ops before and after it disagree"), "{found:?}");
    }

    #[test]
    fn a_session_attached_without_its_password_is_caught() {
        let found = caught(Bug::AttachWithoutProof, "none");
        assert!(says(&found, "whose password it was never given"), "{found:?}");
    }

    #[test]
    fn a_password_that_outlives_the_move_that_replaced_it_is_caught() {
        let found = caught(Bug::RetiredPasswordKept, "none");
        assert!(says(&found, "whose password it was never given"), "{found:?}");
    }

    #[test]
    fn expiry_by_a_nodes_own_clock_makes_the_nodes_disagree() {
        let found = caught(Bug::LocalClockExpiry, "none");
        // Their states differ at the next checkpoint.
        assert!(found.iter().any(|v| matches!(v.property, "checkpoint-roots" | "agreement")), "{found:?}");
    }
}
