//! The replicated coordination service: ZooKeeper's data tree, sessions and watches as a
//! deterministic Keel service (UpRight §5).
//!
//! Every node runs the same decided commands, so every zxid, time, sequence number,
//! session id and expiry is a function of the decided sequence: zxids count the
//! transactions, times are agreed time, session ids come from the agreed seed, and
//! sessions expire at agreed-time ticks. Watches are replicated too: a watch is
//! registered by an ordered read, and a change fires it on every node at the same
//! point, as a push event to the front end that holds the session (UpRight §3.1), which
//! the front end forwards once r + 1 nodes sent it.

use crate::jute::Writer;
use crate::proto::{err, event, op, perm, Acl, Request, Stat, CONFIG_PATH, MAX_BUFFER};
use crate::session_key::{self, Verifier};
use crate::tree::{split, validate, Kind, Tree, ZNode};
use keel_core::chunk::Piece;
use keel_core::ids::{owner_of, ClientId};
use keel_core::service::{format_stamp, strip_format_stamp, ExecCtx, ReadCtx, RestoreError, Service};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, RwLock};
use tokio::sync::watch;

/// Bounds on a session's timeout (ms): ZooKeeper's defaults for tickTime 2000
/// (2 and 20 ticks).
pub const SESSION_TIMEOUT_MIN: i32 = 4_000;
pub const SESSION_TIMEOUT_MAX: i32 = 40_000;
/// Most sessions the service keeps; a connect beyond it is refused.
pub const SESSIONS_MAX: usize = 100_000;
/// A batch's replies stay within this many bytes: a read whose reply would take them
/// past it (unless it is the first) is answered `Refused { err: RETRY_ALONE }` and sent
/// again alone, so a batch's result stays within Keel's 1 MiB bound whatever the data
/// read. The same holds for the reads that end a session's `Command::Ops`.
pub const BATCH_REPLY_MAX: usize = 512 * 1024;
/// Not a ZooKeeper code: "send this request again, alone" (see `BATCH_REPLY_MAX`).
pub const RETRY_ALONE: i32 = i32::MIN + 1;

/// The reply bytes a batch has used so far, and whether it refused a read already.
#[derive(Default)]
struct BatchRoom {
    used: usize,
    closed: bool,
}

impl BatchRoom {
    fn size(reply: &Reply) -> usize {
        match reply {
            Reply::Op { body, .. } => body.len() + 16,
            Reply::Ops(r) => r.iter().map(BatchRoom::size).sum(),
            _ => 16,
        }
    }

    /// Counts a reply that is given whatever its size (a write's: it took effect).
    fn count(&mut self, reply: Reply) -> Reply {
        self.used += BatchRoom::size(&reply);
        reply
    }

    /// A read's reply if it fits in what is left (the first always does: alone it would
    /// be the same size), else `RETRY_ALONE`. Checked on the reply itself, not on the
    /// room before it, so one large read cannot take a batch past Keel's bound. Once one
    /// read is refused every later one is too, even a small one that would fit: a
    /// session's refused read is answered later, alone, from a newer state, and a read
    /// of the same session after it must not be answered from an older one here.
    fn fit(&mut self, reply: Reply) -> Reply {
        let size = BatchRoom::size(&reply);
        if self.closed || (self.used > 0 && self.used + size > BATCH_REPLY_MAX) {
            self.closed = true;
            return Reply::Refused { err: RETRY_ALONE };
        }
        self.used += size;
        reply
    }
}

/// A gap in agreed time this long between two steps means the cluster could not order
/// anything (no quorum, a long view change): with ticks every 500 ms an idle cluster
/// still orders one instance per tick.
pub const OUTAGE_MS: u64 = 3_000;
/// A front end not heard from for this long (agreed time) leaves `/zookeeper/config`:
/// its node was removed or is down. Front ends announce every 5 s.
pub const SERVER_EXPIRE_MS: u64 = 20_000;
/// The longest address a front end may announce.
const SERVER_ADDR_MAX: usize = 64;
/// Entries `/zookeeper/config` may hold: one per node a cluster can have. Any client
/// identity can send `Announce`, so the list is bounded (a full list refuses new ids;
/// its entries expire unless announced again).
pub const SERVERS_MAX: usize = keel_core::quorum::NODES_MAX;
/// Most watches one session may hold (each registration is replicated state).
pub const WATCHES_PER_SESSION_MAX: usize = 100_000;

/// What a front end asks of the service.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    /// A new session for a client at `ip` asking for `timeout` ms, whose password (a
    /// secret the front end drew; see `session_key`) has the public key `verifier`. A
    /// `pinned` session stays with the client identity that made it (`keel
    /// coord-shim`): no other may attach it, even with its password.
    Connect { timeout: i32, ip: String, pinned: bool, verifier: Verifier },
    /// A client reconnecting (to this front end) with its session's id and password:
    /// `proof` is the password's signature of (session, this front end's identity,
    /// `next`), the verifier of the new password the client is handed.
    Attach {
        session: i64,
        #[serde(with = "serde_bytes")]
        proof: Vec<u8>,
        next: Verifier,
        timeout: i32,
        ip: String,
    },
    /// The sessions whose clients this front end heard from lately: they live on.
    Touch { sessions: Vec<i64> },
    /// closeSession.
    Close { session: i64 },
    /// An auth packet.
    Auth { session: i64, scheme: String, auth: Vec<u8> },
    /// Any other request of a session.
    Op { session: i64, request: Request },
    /// Requests of one session in its order, executed one after another in one step
    /// (a pipelining client's writes): one reply each, as if sent one by one.
    Ops { session: i64, requests: Vec<Request> },
    /// Commands of different sessions that a front end gathered while earlier ones were
    /// in flight, executed in order in one step (group commit): one reply each. A batch
    /// inside a batch is refused.
    Batch(Vec<Command>),
    /// A node's front end: "node `node`'s ZooKeeper clients connect to `addr`; the node
    /// itself listens on `peer_port` and serves metrics on `metrics_port` (the same
    /// host)" (sent every few seconds), listed in `/zookeeper/config` while the
    /// announcements keep coming ([`SERVER_EXPIRE_MS`]).
    Announce { node: u32, addr: String, peer_port: u16, metrics_port: u16 },
}

impl Command {
    pub fn encode(&self) -> Vec<u8> {
        postcard::to_allocvec(self).unwrap_or_default()
    }

    /// # Errors
    /// If the bytes are not a command.
    pub fn decode(bytes: &[u8]) -> Result<Command, postcard::Error> {
        postcard::from_bytes(bytes)
    }
}

/// What the service answers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reply {
    /// A request's reply header fields and its response record (jute).
    Op {
        zxid: i64,
        err: i32,
        /// Bytes (see `Request::Create`'s data).
        #[serde(with = "serde_bytes")]
        body: Vec<u8>,
    },
    /// A session the client may use (Connect, Attach). Its password is the front
    /// end's secret: the service never knows it.
    Session {
        id: i64,
        timeout: i32,
        zxid: i64,
    },
    /// A command refused as a whole (the session is unknown, expired, moved).
    Refused {
        err: i32,
    },
    Done,
    /// The replies of `Command::Ops`, in order (each a `Reply::Op`).
    Ops(Vec<Reply>),
    /// The replies of `Command::Batch`, in order.
    Batch(Vec<Reply>),
}

impl Reply {
    pub fn decode(bytes: &[u8]) -> Option<Reply> {
        postcard::from_bytes(bytes).ok()
    }

    /// The bytes the service answers with. Sized up front: a batch of reads grew its
    /// buffer a dozen times, each a copy of everything before.
    pub fn encode(&self) -> Vec<u8> {
        postcard::to_extend(self, Vec::with_capacity(self.size_hint())).unwrap_or_default()
    }

    /// About the bytes `encode` takes (a little over: postcard's lengths are varints).
    fn size_hint(&self) -> usize {
        match self {
            Reply::Op { body, .. } => body.len() + 16,
            Reply::Ops(r) | Reply::Batch(r) => 8 + r.iter().map(Reply::size_hint).sum::<usize>(),
            _ => 16,
        }
    }
}

/// What the service pushes to a front end.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Push {
    /// A watch of `session` fired.
    Watch { session: i64, zxid: i64, kind: i32, path: String },
    /// The session expired (or was closed elsewhere): its connection ends.
    Expired { session: i64 },
}

impl Push {
    pub fn decode(bytes: &[u8]) -> Option<Push> {
        postcard::from_bytes(bytes).ok()
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Session {
    timeout: i32,
    /// The public key of the password the client holds (`session_key`).
    verifier: Verifier,
    /// The next password's, while a move is not yet confirmed: the client may not have
    /// received it, so the old one still attaches until the new front end has heard
    /// from the client (its touch confirms).
    pending: Option<Verifier>,
    /// Agreed time past which the session expires at the next tick.
    deadline: u64,
    /// The front end holding it: its client identity, and where its pushes go.
    owner: ClientId,
    push_to: ClientId,
    /// Authenticated ids: (scheme, id); the client's ip is always there.
    auth: Vec<(String, String)>,
    ephemerals: BTreeSet<String>,
    /// Only its creator's identity may hold it (`Command::Connect`).
    pinned: bool,
}

/// Which table a watch is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Table {
    /// One-shot data and exist watches (ZooKeeper's server keeps both in one table).
    Data,
    /// One-shot child watches.
    Child,
    Persistent,
    Recursive,
}

/// Watches: path -> sessions, per table. Serializes as its four tables.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "StoredWatches")]
struct Watches {
    data: BTreeMap<String, BTreeSet<i64>>,
    child: BTreeMap<String, BTreeSet<i64>>,
    persistent: BTreeMap<String, BTreeSet<i64>>,
    recursive: BTreeMap<String, BTreeSet<i64>>,
    /// Each session's watches, derived from the tables: counting a session's watches
    /// (at every watched read) and dropping them (at its end) walked every table, a
    /// cost in the number of watches of all sessions.
    #[serde(skip)]
    owned: BTreeMap<i64, BTreeSet<(Table, String)>>,
}

/// What watches are read back from: the tables, each session's index still to build.
#[derive(Deserialize)]
struct StoredWatches {
    data: BTreeMap<String, BTreeSet<i64>>,
    child: BTreeMap<String, BTreeSet<i64>>,
    persistent: BTreeMap<String, BTreeSet<i64>>,
    recursive: BTreeMap<String, BTreeSet<i64>>,
}

impl From<StoredWatches> for Watches {
    fn from(w: StoredWatches) -> Watches {
        let mut owned: BTreeMap<i64, BTreeSet<(Table, String)>> = BTreeMap::new();
        let tables = [
            (Table::Data, &w.data),
            (Table::Child, &w.child),
            (Table::Persistent, &w.persistent),
            (Table::Recursive, &w.recursive),
        ];
        for (table, entries) in tables {
            for (path, sessions) in entries {
                for s in sessions {
                    owned.entry(*s).or_default().insert((table, path.clone()));
                }
            }
        }
        Watches { data: w.data, child: w.child, persistent: w.persistent, recursive: w.recursive, owned }
    }
}

impl Watches {
    fn table(&self, table: Table) -> &BTreeMap<String, BTreeSet<i64>> {
        match table {
            Table::Data => &self.data,
            Table::Child => &self.child,
            Table::Persistent => &self.persistent,
            Table::Recursive => &self.recursive,
        }
    }

    fn table_mut(&mut self, table: Table) -> &mut BTreeMap<String, BTreeSet<i64>> {
        match table {
            Table::Data => &mut self.data,
            Table::Child => &mut self.child,
            Table::Persistent => &mut self.persistent,
            Table::Recursive => &mut self.recursive,
        }
    }

    /// Registers a watch; false if the session already holds [`WATCHES_PER_SESSION_MAX`]
    /// others (each is replicated state, and a client could send them without end).
    fn add(&mut self, table: Table, path: &str, session: i64) -> bool {
        if self.has(table, path, session) {
            return true;
        }
        if self.count(session) >= WATCHES_PER_SESSION_MAX {
            return false;
        }
        self.table_mut(table).entry(path.to_string()).or_default().insert(session);
        self.owned.entry(session).or_default().insert((table, path.to_string()));
        true
    }

    /// Removes and returns the sessions watching `path` in `table` (a one-shot firing).
    fn take(&mut self, table: Table, path: &str) -> BTreeSet<i64> {
        let sessions = self.table_mut(table).remove(path).unwrap_or_default();
        for s in &sessions {
            self.disown(*s, table, path);
        }
        sessions
    }

    fn peek(&self, table: Table, path: &str) -> BTreeSet<i64> {
        self.table(table).get(path).cloned().unwrap_or_default()
    }

    fn has(&self, table: Table, path: &str, session: i64) -> bool {
        self.table(table).get(path).is_some_and(|s| s.contains(&session))
    }

    /// Removes one session's watch; whether it had one.
    fn remove(&mut self, table: Table, path: &str, session: i64) -> bool {
        let t = self.table_mut(table);
        let Some(sessions) = t.get_mut(path) else { return false };
        let removed = sessions.remove(&session);
        if sessions.is_empty() {
            t.remove(path);
        }
        if removed {
            self.disown(session, table, path);
        }
        removed
    }

    fn disown(&mut self, session: i64, table: Table, path: &str) {
        if let Some(own) = self.owned.get_mut(&session) {
            own.remove(&(table, path.to_string()));
            if own.is_empty() {
                self.owned.remove(&session);
            }
        }
    }

    fn count(&self, session: i64) -> usize {
        self.owned.get(&session).map_or(0, BTreeSet::len)
    }

    fn drop_session(&mut self, session: i64) {
        for (table, path) in self.owned.remove(&session).unwrap_or_default() {
            let t = self.table_mut(table);
            if let Some(sessions) = t.get_mut(&path) {
                sessions.remove(&session);
                if sessions.is_empty() {
                    t.remove(&path);
                }
            }
        }
    }
}

/// The snapshot's format (`format_stamp`): bump it whenever `State`'s layout changes.
/// 1: session 32's, the first stamped (sessions keep password verifiers since session 31).
/// 2: session 43's, znodes without their child names (rebuilt from the paths).
const SNAPSHOT_FORMAT: u32 = 2;

/// The coordination service's replicated state.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
struct State {
    tree: Tree,
    sessions: BTreeMap<i64, Session>,
    watches: Watches,
    /// The last transaction's id.
    zxid: i64,
    /// Containers and TTL nodes: what ticks look at.
    expiring: BTreeSet<String>,
    /// Agreed time of the last command or tick (to see the cluster was down).
    last_time: u64,
    /// Pushes of the command running now (collected, then sent in order).
    #[serde(skip)]
    out: Vec<(ClientId, Push)>,
    /// The front ends that announced themselves, by node: `/zookeeper/config`.
    servers: BTreeMap<u32, Server>,
}

/// A node's ZooKeeper client port, as its front end announced it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Server {
    addr: String,
    /// ZooKeeper's quorum and election ports have no Keel counterpart; the node's own
    /// peer and metrics ports stand in (clients read only the client address, but
    /// ZooKeeper's parser wants two distinct ports there).
    peer_port: u16,
    metrics_port: u16,
    /// The front end's client identity: only it may change the entry while it is
    /// fresh, so one faulty node cannot replace another's address (it can only claim an
    /// id no front end announces, which clients then fail to reach).
    owner: ClientId,
    /// Agreed time of its last announcement.
    seen: u64,
}

/// A write's outcome inside a transaction: the response record, or an error code.
type OpResult = Result<Vec<u8>, i32>;

/// One change, for the watches it fires.
enum Change {
    Created(String),
    Deleted(String),
    Data(String),
}

impl State {
    fn session_for(&self, session: i64, client: ClientId) -> Result<&Session, i32> {
        match self.sessions.get(&session) {
            None => Err(err::SESSION_EXPIRED),
            Some(s) if s.owner != owner_of(client) => Err(err::SESSION_MOVED),
            Some(s) => Ok(s),
        }
    }

    /// After an outage every session gets a whole timeout again, as ZooKeeper's do when
    /// a leader is elected: clients could not reach the cluster to heartbeat, and
    /// expiring them all at the first tick would delete every ephemeral (every lock
    /// and leader) of clients that are alive. Depends on agreed times only.
    fn resume(&mut self, ctx: &ExecCtx) {
        if self.last_time > 0 && ctx.time.saturating_sub(self.last_time) >= OUTAGE_MS {
            for s in self.sessions.values_mut() {
                s.deadline = s.deadline.max(ctx.time + s.timeout as u64);
            }
            // Nor did front ends reach it: their entries start afresh too.
            for s in self.servers.values_mut() {
                s.seen = s.seen.max(ctx.time);
            }
        }
        self.last_time = self.last_time.max(ctx.time);
    }

    fn run(&mut self, command: Command, ctx: &ExecCtx) -> Reply {
        self.run_within(command, ctx, &mut BatchRoom::default())
    }

    /// Runs `command`; a `Command::Ops`'s replies take their room from `room` (the
    /// batch it came in, so the batch's result stays within its budget too).
    fn run_within(&mut self, command: Command, ctx: &ExecCtx, room: &mut BatchRoom) -> Reply {
        self.resume(ctx);
        match command {
            Command::Connect { timeout, ip, pinned, verifier } => self.connect(timeout, ip, pinned, verifier, ctx),
            Command::Attach { session, proof, next, timeout, ip } => {
                let Some(s) = self.sessions.get_mut(&session) else {
                    return Reply::Refused { err: err::SESSION_EXPIRED };
                };
                let owner = owner_of(ctx.client);
                let proves = |v: &Verifier| session_key::verify(v, session, owner.0, &next, &proof);
                let with_pending = s.pending.as_ref().is_some_and(proves);
                if !with_pending && !proves(&s.verifier) {
                    // ZooKeeper answers a wrong password as an expired session.
                    return Reply::Refused { err: err::SESSION_EXPIRED };
                }
                if s.pinned && s.owner != owner {
                    return Reply::Refused { err: err::SESSION_MOVED };
                }
                if let Some(received) = s.pending.filter(|_| with_pending) {
                    // The client received the last move's password: the one before is
                    // gone for good.
                    s.verifier = received;
                }
                s.pending = Some(next);
                let old = s.push_to;
                s.owner = owner;
                s.push_to = ctx.client;
                s.timeout = timeout.clamp(SESSION_TIMEOUT_MIN, SESSION_TIMEOUT_MAX);
                s.deadline = ctx.time + s.timeout as u64;
                if let Some(ip_auth) = s.auth.iter_mut().find(|(scheme, _)| scheme == "ip") {
                    ip_auth.1 = ip;
                }
                let reply = Reply::Session { id: session, timeout: s.timeout, zxid: self.zxid };
                // The front end that held it before lets its connection go.
                if old != ctx.client {
                    self.out.push((old, Push::Expired { session }));
                }
                reply
            }
            Command::Touch { sessions } => {
                let owner = owner_of(ctx.client);
                for id in sessions {
                    if let Some(s) = self.sessions.get_mut(&id).filter(|s| s.owner == owner) {
                        s.deadline = ctx.time + s.timeout as u64;
                        // A front end touches only sessions whose client spoke after
                        // the handshake: it has the new password, the old one retires.
                        if let Some(next) = s.pending.take() {
                            s.verifier = next;
                        }
                    }
                }
                Reply::Done
            }
            Command::Close { session } => match self.session_for(session, ctx.client) {
                Err(e) => Reply::Refused { err: e },
                Ok(_) => {
                    self.zxid += 1;
                    self.end_session(session, ctx);
                    Reply::Op { zxid: self.zxid, err: err::OK, body: Vec::new() }
                }
            },
            Command::Auth { session, scheme, auth } => {
                if let Err(e) = self.session_for(session, ctx.client) {
                    return Reply::Refused { err: e };
                }
                let id = match (scheme.as_str(), std::str::from_utf8(&auth)) {
                    ("digest", Ok(text)) if text.contains(':') => digest_id(text),
                    _ => return Reply::Op { zxid: 0, err: err::AUTH_FAILED, body: Vec::new() },
                };
                if let Some(s) = self.sessions.get_mut(&session) {
                    if !s.auth.iter().any(|(sc, i)| sc == "digest" && *i == id) {
                        s.auth.push(("digest".into(), id));
                    }
                }
                Reply::Op { zxid: 0, err: err::OK, body: Vec::new() }
            }
            Command::Op { session, request } => {
                if let Err(e) = self.session_for(session, ctx.client) {
                    return Reply::Op { zxid: 0, err: e, body: Vec::new() };
                }
                self.ordered_op(session, request, ctx)
            }
            Command::Batch(commands) => {
                let mut room = BatchRoom::default();
                Reply::Batch(
                    commands
                        .into_iter()
                        .map(|c| match c {
                            Command::Batch(_) => Reply::Refused { err: err::BAD_ARGUMENTS },
                            // Past the reply budget a read is not answered here: the
                            // front end sends it again alone (a write always runs).
                            Command::Op { ref request, .. } if !request.writes() => room.fit(self.run(c, ctx)),
                            c @ Command::Ops { .. } => self.run_within(c, ctx, &mut room),
                            c => room.count(self.run(c, ctx)),
                        })
                        .collect(),
                )
            }
            Command::Ops { session, requests } => {
                if let Err(e) = self.session_for(session, ctx.client) {
                    return Reply::Op { zxid: 0, err: e, body: Vec::new() };
                }
                // A front end sends a session's writes with the reads around them
                // (executed here in order, so each read sees exactly the writes before
                // it). A read past the reply budget is refused, and so is everything
                // after it, unexecuted: the front end sends the rest again, in order,
                // after this command (a write run here after a refused read would
                // reorder the session).
                let mut refused = false;
                Reply::Ops(
                    requests
                        .into_iter()
                        .map(|r| {
                            if refused {
                                return Reply::Refused { err: RETRY_ALONE };
                            }
                            let reply = match r.writes() {
                                true => room.count(self.ordered_op(session, r, ctx)),
                                false => room.fit(self.ordered_op(session, r, ctx)),
                            };
                            refused = matches!(reply, Reply::Refused { err: RETRY_ALONE });
                            reply
                        })
                        .collect(),
                )
            }
            Command::Announce { node, addr, peer_port, metrics_port } => self.announce(
                node,
                Server { addr, peer_port, metrics_port, owner: owner_of(ctx.client), seen: ctx.time },
                ctx,
            ),
        }
    }

    /// [`Coord::op`] at its place in the decided order. The reply of a request that
    /// writes or sets a watch names the zxid it was executed at, failures and watched
    /// reads included (ZooKeeper's reply header carries the last transaction the server
    /// applied). A front end orders a session's watch events among its replies by it:
    /// the event of a change made after a watched read comes after that read's reply,
    /// or the client drops it (it registers the watcher only when the reply arrives).
    /// Plain reads keep zxid 0: they are also answered read-only, where nodes at
    /// different zxids must give equal bytes for equal data.
    fn ordered_op(&mut self, session: i64, request: Request, ctx: &ExecCtx) -> Reply {
        let writes = request.writes();
        match self.op(session, request, ctx) {
            Reply::Op { zxid: 0, err, body } if writes => Reply::Op { zxid: self.zxid, err, body },
            reply => reply,
        }
    }

    /// A front end's announcement ([`Command::Announce`]).
    fn announce(&mut self, node: u32, server: Server, ctx: &ExecCtx) -> Reply {
        let ports = [server.peer_port, server.metrics_port];
        if server.addr.len() > SERVER_ADDR_MAX
            || server.addr.parse::<std::net::SocketAddr>().is_err()
            || ports.contains(&0)
            || server.peer_port == server.metrics_port
        {
            return Reply::Refused { err: err::BAD_ARGUMENTS };
        }
        if !self.servers.contains_key(&node) && self.servers.len() >= SERVERS_MAX {
            return Reply::Refused { err: err::BAD_ARGUMENTS };
        }
        let changed = match self.servers.get_mut(&node) {
            Some(s) if s.owner != server.owner && s.seen + SERVER_EXPIRE_MS > ctx.time => {
                return Reply::Refused { err: err::NO_AUTH };
            }
            Some(s)
                if s.owner == server.owner
                    && (&s.addr, s.peer_port, s.metrics_port)
                        == (&server.addr, server.peer_port, server.metrics_port) =>
            {
                s.seen = ctx.time;
                false
            }
            _ => {
                self.servers.insert(node, server);
                true
            }
        };
        if changed {
            self.write_config(ctx);
        }
        Reply::Done
    }

    /// Rewrites `/zookeeper/config` from the announced front ends, as a ZooKeeper
    /// ensemble's dynamic configuration: `server.<id>=<host>:<peer port>:<metrics
    /// port>:participant;<client host>:<client port>` per node, then `version=<zxid,
    /// hex>`. One transaction; its data watches fire.
    fn write_config(&mut self, ctx: &ExecCtx) {
        self.zxid += 1;
        let mut text = String::new();
        for (node, s) in &self.servers {
            let host = host_of(&s.addr);
            text.push_str(&format!("server.{node}={host}:{}:{}:participant;{}\n", s.peer_port, s.metrics_port, s.addr));
        }
        text.push_str(&format!("version={:x}", self.zxid));
        let zxid = self.zxid;
        if let Some(node) = self.tree.get_mut(CONFIG_PATH) {
            node.data = text.into_bytes();
            node.stat.version = node.stat.version.wrapping_add(1);
            node.stat.mzxid = zxid;
            node.stat.mtime = ctx.time as i64;
            node.stat.data_length = node.data.len() as i32;
            self.fire(Change::Data(CONFIG_PATH.into()), ctx);
        }
    }

    fn connect(&mut self, timeout: i32, ip: String, pinned: bool, verifier: Verifier, ctx: &ExecCtx) -> Reply {
        if self.sessions.len() >= SESSIONS_MAX {
            return Reply::Refused { err: err::SYSTEM_ERROR };
        }
        // From the agreed seed: every node derives the same id; positive and non-zero
        // (0 asks for a new session on the wire).
        let mut n = 0u64;
        let id = loop {
            let h = blake3::hash(&[ctx.seed.to_le_bytes(), n.to_le_bytes()].concat());
            let mut b = [0u8; 8];
            b.copy_from_slice(&h.as_bytes()[..8]);
            let id = (u64::from_le_bytes(b) >> 1) as i64;
            if id != 0 && !self.sessions.contains_key(&id) {
                break id;
            }
            n += 1;
        };
        let timeout = timeout.clamp(SESSION_TIMEOUT_MIN, SESSION_TIMEOUT_MAX);
        self.zxid += 1;
        self.sessions.insert(
            id,
            Session {
                timeout,
                verifier,
                pending: None,
                deadline: ctx.time + timeout as u64,
                owner: owner_of(ctx.client),
                push_to: ctx.client,
                auth: vec![("ip".into(), ip)],
                ephemerals: BTreeSet::new(),
                pinned,
            },
        );
        Reply::Session { id, timeout, zxid: self.zxid }
    }

    /// Ends a session: its ephemerals go (their watches fire), its watches go, its front
    /// end is told. Part of the current transaction (`self.zxid`).
    fn end_session(&mut self, session: i64, ctx: &ExecCtx) {
        let Some(s) = self.sessions.remove(&session) else { return };
        self.watches.drop_session(session);
        for path in s.ephemerals.iter().rev() {
            if self.tree.remove(path, self.zxid).is_some() {
                self.fire(Change::Deleted(path.clone()), ctx);
            }
        }
        self.out.push((s.push_to, Push::Expired { session }));
    }

    fn op(&mut self, session: i64, request: Request, ctx: &ExecCtx) -> Reply {
        match request {
            Request::Multi(ops) => self.multi(session, ops, ctx),
            Request::MultiRead(ops) => self.multi_read(session, ops),
            Request::Exists { ref path, watch: true } | Request::GetData { ref path, watch: true } => {
                let path = path.clone();
                let answer = self.read(session, request.clone());
                // exists registers on a missing node too; getData only on one that is.
                let registers = matches!(request, Request::Exists { .. }) || answer.is_ok();
                // Past the session's bound the read is answered unwatched (as before
                // session 43; the bound now holds for addWatch and setWatches too).
                if registers && validate(&path, false).is_ok() {
                    self.watches.add(Table::Data, &path, session);
                }
                read_reply(answer)
            }
            Request::GetChildren { ref path, watch: true, .. } => {
                let path = path.clone();
                let answer = self.read(session, request);
                if answer.is_ok() {
                    self.watches.add(Table::Child, &path, session);
                }
                read_reply(answer)
            }
            Request::Sync { path } => {
                let mut w = Writer::new();
                w.string(&path);
                Reply::Op { zxid: self.zxid, err: err::OK, body: w.into_bytes() }
            }
            Request::SetWatches { relative_zxid, data, exist, child, persistent, recursive } => {
                self.set_watches(session, relative_zxid, data, exist, child, persistent, recursive, ctx);
                Reply::Op { zxid: self.zxid, err: err::OK, body: Vec::new() }
            }
            Request::AddWatch { path, mode } => {
                if let Err(e) = validate(&path, false) {
                    return Reply::Op { zxid: 0, err: e, body: Vec::new() };
                }
                let table = match mode {
                    0 => Table::Persistent,
                    1 => Table::Recursive,
                    _ => return Reply::Op { zxid: 0, err: err::BAD_ARGUMENTS, body: Vec::new() },
                };
                if !self.watches.add(table, &path, session) {
                    return Reply::Op { zxid: 0, err: err::QUOTA_EXCEEDED, body: Vec::new() };
                }
                // ZooKeeper answers addWatch with an ErrorResponse(0) record.
                Reply::Op { zxid: self.zxid, err: err::OK, body: 0i32.to_be_bytes().to_vec() }
            }
            Request::RemoveWatches { path, kind } => {
                let tables: &[Table] = match kind {
                    1 => &[Table::Child],
                    2 => &[Table::Data],
                    3 => &[Table::Child, Table::Data, Table::Persistent, Table::Recursive],
                    4 => &[Table::Persistent],
                    5 => &[Table::Recursive],
                    _ => return Reply::Op { zxid: 0, err: err::BAD_ARGUMENTS, body: Vec::new() },
                };
                let mut removed = false;
                for table in tables {
                    removed |= self.watches.remove(*table, &path, session);
                }
                let e = if removed { err::OK } else { err::NO_WATCHER };
                Reply::Op { zxid: self.zxid, err: e, body: Vec::new() }
            }
            write @ (Request::Create { .. }
            | Request::Delete { .. }
            | Request::SetData { .. }
            | Request::SetAcl { .. }
            | Request::Check { .. }) => {
                let zxid = self.zxid + 1;
                let mut changes = Vec::new();
                let result = self.write(session, &write, zxid, ctx.time as i64, &mut changes);
                match result {
                    Ok(body) => {
                        if !changes.is_empty() || matches!(write, Request::SetAcl { .. }) {
                            self.zxid = zxid;
                        }
                        for c in changes {
                            self.fire(c, ctx);
                        }
                        Reply::Op { zxid: self.zxid, err: err::OK, body }
                    }
                    Err(e) => Reply::Op { zxid: self.zxid, err: e, body: Vec::new() },
                }
            }
            read => read_reply(self.read(session, read)),
        }
    }

    /// multiRead: each read answered on its own (no watches: a read with a watch inside
    /// a multiRead is refused by the codec).
    fn multi_read(&self, session: i64, ops: Vec<Request>) -> Reply {
        let mut w = Writer::new();
        for op in ops {
            let kind = op.opcode();
            match self.read(session, op) {
                Ok(body) => {
                    w.int(kind).bool(false).int(err::OK);
                    w.0.extend(body);
                }
                Err(e) => {
                    w.int(op::ERROR).bool(false).int(e).int(e);
                }
            }
        }
        w.int(-1).bool(true).int(-1);
        Reply::Op { zxid: 0, err: err::OK, body: w.into_bytes() }
    }

    /// A read without a watch, answered from this state without ordering.
    fn read_only(&self, session: i64, client: ClientId, request: Request) -> Option<Reply> {
        if request.writes() {
            return None;
        }
        Some(match self.session_for(session, client) {
            Err(e) => Reply::Op { zxid: 0, err: e, body: Vec::new() },
            Ok(_) => match request {
                Request::MultiRead(ops) => self.multi_read(session, ops),
                read => read_reply(self.read(session, read)),
            },
        })
    }

    /// multi: all or nothing. On failure the ops before the failing one answer OK, the
    /// failing one its error, the ones after RUNTIMEINCONSISTENCY, and nothing changed.
    fn multi(&mut self, session: i64, ops: Vec<Request>, ctx: &ExecCtx) -> Reply {
        let zxid = self.zxid + 1;
        self.tree.begin();
        let mut changes = Vec::new();
        let mut results: Vec<OpResult> = Vec::new();
        let mut failed = None;
        for (i, op) in ops.iter().enumerate() {
            match self.write(session, op, zxid, ctx.time as i64, &mut changes) {
                Ok(body) => results.push(Ok(body)),
                Err(e) => {
                    failed = Some((i, e));
                    break;
                }
            }
        }
        let mut w = Writer::new();
        match failed {
            Some((at, e)) => {
                self.roll_back();
                for i in 0..ops.len() {
                    let code = match i.cmp(&at) {
                        std::cmp::Ordering::Less => err::OK,
                        std::cmp::Ordering::Equal => e,
                        std::cmp::Ordering::Greater => err::RUNTIME_INCONSISTENCY,
                    };
                    w.int(op::ERROR).bool(false).int(code).int(code);
                }
            }
            None => {
                self.tree.commit();
                if !ops.is_empty() {
                    self.zxid = zxid;
                }
                for (op, body) in ops.iter().zip(results) {
                    w.int(op.opcode()).bool(false).int(err::OK);
                    w.0.extend(body.unwrap_or_default());
                }
                for c in changes {
                    self.fire(c, ctx);
                }
            }
        }
        w.int(-1).bool(true).int(-1);
        Reply::Op { zxid: self.zxid, err: err::OK, body: w.into_bytes() }
    }

    /// Takes a failed multi's changes back: the tree's, then the indexes beside it
    /// (a session's ephemerals, the nodes ticks look at), which follow its nodes.
    fn roll_back(&mut self) {
        for touched in self.tree.rollback() {
            for (side, add) in [(touched.undone, false), (touched.restored, true)] {
                let Some((kind, owner)) = side else { continue };
                if owner != 0 {
                    if let Some(s) = self.sessions.get_mut(&owner) {
                        if add {
                            s.ephemerals.insert(touched.path.clone());
                        } else {
                            s.ephemerals.remove(&touched.path);
                        }
                    }
                }
                if matches!(kind, Kind::Container | Kind::Ttl(_)) {
                    if add {
                        self.expiring.insert(touched.path.clone());
                    } else {
                        self.expiring.remove(&touched.path);
                    }
                }
            }
        }
    }

    /// Applies one write as part of transaction `zxid`; the changes it made go to
    /// `changes` (watches fire once the transaction stands).
    fn write(&mut self, session: i64, request: &Request, zxid: i64, time: i64, changes: &mut Vec<Change>) -> OpResult {
        match request {
            Request::Create { opcode, path, data, acl, flags, ttl } => {
                let sequential = matches!(flags, 2 | 3 | 6);
                validate(path, sequential)?;
                if path == "/" {
                    return Err(err::NODE_EXISTS);
                }
                if data.len() > MAX_BUFFER {
                    return Err(err::BAD_ARGUMENTS);
                }
                let kind = match (flags, *opcode) {
                    (0 | 2, op::CREATE | op::CREATE2) => Kind::Persistent,
                    (1 | 3, op::CREATE | op::CREATE2) => Kind::Ephemeral,
                    (4, op::CREATE_CONTAINER) => Kind::Container,
                    (5 | 6, op::CREATE_TTL) if *ttl > 0 => Kind::Ttl(*ttl),
                    _ => return Err(err::BAD_ARGUMENTS),
                };
                // ZooKeeper's order of checks (PrepRequestProcessor): the ACL given, the
                // parent, the right to create under it, the name, the parent's kind.
                let acl = self.fix_acl(session, acl)?;
                let (parent_path, _) = split(path);
                let parent = self.tree.get(parent_path).ok_or(err::NO_NODE)?;
                self.check_acl(session, &parent.acl, perm::CREATE)?;
                let path = if sequential { format!("{path}{:010}", parent.stat.cversion) } else { path.clone() };
                if self.tree.get(&path).is_some() {
                    return Err(err::NODE_EXISTS);
                }
                if parent.stat.ephemeral_owner != 0 {
                    return Err(err::NO_CHILDREN_FOR_EPHEMERALS);
                }
                let owner = if kind == Kind::Ephemeral { session } else { 0 };
                self.tree.insert(&path, ZNode::new(data.clone(), acl, kind, owner, zxid, time), zxid);
                if kind == Kind::Ephemeral {
                    if let Some(s) = self.sessions.get_mut(&session) {
                        s.ephemerals.insert(path.clone());
                    }
                }
                if matches!(kind, Kind::Container | Kind::Ttl(_)) {
                    self.expiring.insert(path.clone());
                }
                let mut w = Writer::new();
                w.string(&path);
                if *opcode != op::CREATE {
                    self.tree.get(&path).map(ZNode::wire_stat).unwrap_or_default().write(&mut w);
                }
                changes.push(Change::Created(path));
                Ok(w.into_bytes())
            }
            Request::Delete { path, version } => {
                validate(path, false)?;
                if path == "/" || path == "/zookeeper" || path.starts_with("/zookeeper/") {
                    return Err(err::BAD_ARGUMENTS);
                }
                // The right to delete under the parent is checked before the node is
                // looked up, as ZooKeeper does.
                let parent = self.tree.get(split(path).0).ok_or(err::NO_NODE)?;
                self.check_acl(session, &parent.acl, perm::DELETE)?;
                let node = self.tree.get(path).ok_or(err::NO_NODE)?;
                if *version != -1 && *version != node.stat.version {
                    return Err(err::BAD_VERSION);
                }
                if !node.children.is_empty() {
                    return Err(err::NOT_EMPTY);
                }
                self.delete(path, zxid);
                changes.push(Change::Deleted(path.clone()));
                Ok(Vec::new())
            }
            Request::SetData { path, data, version } => {
                validate(path, false)?;
                if data.len() > MAX_BUFFER {
                    return Err(err::BAD_ARGUMENTS);
                }
                let node = self.tree.get(path).ok_or(err::NO_NODE)?;
                self.check_acl(session, &node.acl, perm::WRITE)?;
                if *version != -1 && *version != node.stat.version {
                    return Err(err::BAD_VERSION);
                }
                let node = self.tree.get_mut(path).ok_or(err::NO_NODE)?;
                node.data = data.clone();
                // Versions are Java ints: they wrap (a client's 2^31 writes must not
                // panic a node built with overflow checks).
                node.stat.version = node.stat.version.wrapping_add(1);
                node.stat.mzxid = zxid;
                node.stat.mtime = time;
                node.stat.data_length = data.len() as i32;
                let mut w = Writer::new();
                node.wire_stat().write(&mut w);
                changes.push(Change::Data(path.clone()));
                Ok(w.into_bytes())
            }
            Request::SetAcl { path, acl, version } => {
                validate(path, false)?;
                let acl = self.fix_acl(session, acl)?;
                let node = self.tree.get(path).ok_or(err::NO_NODE)?;
                self.check_acl(session, &node.acl, perm::ADMIN)?;
                if *version != -1 && *version != node.stat.aversion {
                    return Err(err::BAD_VERSION);
                }
                let node = self.tree.get_mut(path).ok_or(err::NO_NODE)?;
                node.acl = acl;
                node.stat.aversion = node.stat.aversion.wrapping_add(1);
                let mut w = Writer::new();
                node.wire_stat().write(&mut w);
                Ok(w.into_bytes())
            }
            Request::Check { path, version } => {
                validate(path, false)?;
                let node = self.tree.get(path).ok_or(err::NO_NODE)?;
                self.check_acl(session, &node.acl, perm::READ)?;
                if *version != -1 && *version != node.stat.version {
                    return Err(err::BAD_VERSION);
                }
                Ok(Vec::new())
            }
            _ => Err(err::BAD_ARGUMENTS),
        }
    }

    fn delete(&mut self, path: &str, zxid: i64) {
        if let Some(node) = self.tree.remove(path, zxid) {
            if node.stat.ephemeral_owner != 0 {
                if let Some(s) = self.sessions.get_mut(&node.stat.ephemeral_owner) {
                    s.ephemerals.remove(path);
                }
            }
            self.expiring.remove(path);
        }
    }

    /// Answers a read from the state (no watch registered here).
    fn read(&self, session: i64, request: Request) -> OpResult {
        let mut w = Writer::new();
        match request {
            Request::Exists { path, .. } => {
                validate(&path, false)?;
                let node = self.tree.get(&path).ok_or(err::NO_NODE)?;
                self.check_acl(session, &node.acl, perm::READ)?;
                node.wire_stat().write(&mut w);
            }
            Request::GetData { path, .. } => {
                validate(&path, false)?;
                let node = self.tree.get(&path).ok_or(err::NO_NODE)?;
                self.check_acl(session, &node.acl, perm::READ)?;
                // The whole answer at once: a 1 KiB value grew the buffer five times.
                w.0.reserve(4 + node.data.len() + Stat::BYTES);
                w.buffer(&node.data);
                node.wire_stat().write(&mut w);
            }
            Request::GetChildren { path, two, .. } => {
                validate(&path, false)?;
                let node = self.tree.get(&path).ok_or(err::NO_NODE)?;
                self.check_acl(session, &node.acl, perm::READ)?;
                let names: Vec<String> = node.children.iter().cloned().collect();
                w.strings(&names);
                if two {
                    node.wire_stat().write(&mut w);
                }
            }
            Request::GetAcl { path } => {
                validate(&path, false)?;
                let node = self.tree.get(&path).ok_or(err::NO_NODE)?;
                self.check_acl(session, &node.acl, perm::READ | perm::ADMIN)?;
                // Without ADMIN, digest ids are shown without their hash (as ZooKeeper).
                if self.check_acl(session, &node.acl, perm::ADMIN).is_ok() {
                    Acl::write_all(&node.acl, &mut w);
                } else {
                    let masked: Vec<Acl> = node
                        .acl
                        .iter()
                        .map(|a| match a.scheme.as_str() {
                            "digest" => {
                                Acl { id: format!("{}:x", a.id.split(':').next().unwrap_or_default()), ..a.clone() }
                            }
                            _ => a.clone(),
                        })
                        .collect();
                    Acl::write_all(&masked, &mut w);
                }
                node.wire_stat().write(&mut w);
            }
            Request::GetAllChildrenNumber { path } => {
                validate(&path, false)?;
                let node = self.tree.get(&path).ok_or(err::NO_NODE)?;
                self.check_acl(session, &node.acl, perm::READ)?;
                w.int(self.tree.descendants(&path) as i32);
            }
            Request::GetEphemerals { prefix } => {
                let mine: Vec<String> = self
                    .sessions
                    .get(&session)
                    .map(|s| {
                        // An empty prefix or "/" means all (ZooKeeper's rule).
                        let all = prefix.trim().is_empty() || prefix.trim() == "/";
                        s.ephemerals.iter().filter(|p| all || p.starts_with(&prefix)).cloned().collect()
                    })
                    .unwrap_or_default();
                w.strings(&mine);
            }
            Request::CheckWatches { path, kind } => {
                let has = |table| self.watches.has(table, &path, session);
                let found = match kind {
                    1 => has(Table::Child),
                    2 => has(Table::Data),
                    3 => has(Table::Child) || has(Table::Data) || has(Table::Persistent) || has(Table::Recursive),
                    4 => has(Table::Persistent),
                    5 => has(Table::Recursive),
                    _ => return Err(err::BAD_ARGUMENTS),
                };
                if !found {
                    return Err(err::NO_WATCHER);
                }
            }
            Request::WhoAmI => {
                let auth = self.sessions.get(&session).map(|s| s.auth.clone()).unwrap_or_default();
                w.int(auth.len() as i32);
                // ClientInfo: the scheme and the user's name (a digest id's user part).
                for (scheme, id) in auth {
                    let user = if scheme == "digest" { id.split(':').next().unwrap_or_default() } else { &id };
                    w.string(&scheme).string(user);
                }
            }
            _ => return Err(err::BAD_ARGUMENTS),
        }
        Ok(w.into_bytes())
    }

    /// Whether the session holds `wanted` (any of its bits) by `acl` (`checkACL`).
    fn check_acl(&self, session: i64, acl: &[Acl], wanted: i32) -> Result<(), i32> {
        if acl.is_empty() {
            return Ok(());
        }
        let auth = self.sessions.get(&session).map(|s| s.auth.as_slice()).unwrap_or_default();
        let allowed = acl.iter().filter(|a| a.perms & wanted != 0).any(|a| match a.scheme.as_str() {
            "world" => a.id == "anyone",
            "ip" => auth.iter().any(|(s, ip)| s == "ip" && ip_matches(&a.id, ip)),
            scheme => auth.iter().any(|(s, id)| s == scheme && *id == a.id),
        });
        if allowed {
            Ok(())
        } else {
            Err(err::NO_AUTH)
        }
    }

    /// Checks an ACL a client gave and expands `auth` to the session's authenticated ids.
    fn fix_acl(&self, session: i64, acl: &[Acl]) -> Result<Vec<Acl>, i32> {
        if acl.is_empty() {
            return Err(err::INVALID_ACL);
        }
        let mut out = Vec::new();
        for a in acl {
            if a.perms & !perm::ALL != 0 {
                return Err(err::INVALID_ACL);
            }
            match a.scheme.as_str() {
                "world" if a.id == "anyone" => out.push(a.clone()),
                "digest" if a.id.split(':').count() == 2 => out.push(a.clone()),
                "ip" if valid_ip_acl(&a.id) => out.push(a.clone()),
                "auth" => {
                    let ids: Vec<&(String, String)> = self
                        .sessions
                        .get(&session)
                        .map(|s| s.auth.iter().filter(|(scheme, _)| scheme != "ip").collect())
                        .unwrap_or_default();
                    if ids.is_empty() {
                        return Err(err::INVALID_ACL);
                    }
                    for (scheme, id) in ids {
                        out.push(Acl { perms: a.perms, scheme: scheme.clone(), id: id.clone() });
                    }
                }
                _ => return Err(err::INVALID_ACL),
            }
        }
        out.sort();
        out.dedup();
        Ok(out)
    }

    /// Fires the watches `change` triggers, as ZooKeeper's WatchManager does: one-shot
    /// ones are consumed; each session hears of each event once.
    fn fire(&mut self, change: Change, _ctx: &ExecCtx) {
        let zxid = self.zxid;
        let mut events: BTreeMap<(i64, i32, String), ()> = BTreeMap::new();
        let mut add = |sessions: BTreeSet<i64>, kind: i32, path: &str| {
            for s in sessions {
                events.insert((s, kind, path.to_string()), ());
            }
        };
        let (kind, path) = match &change {
            Change::Created(p) => (event::NODE_CREATED, p.clone()),
            Change::Deleted(p) => (event::NODE_DELETED, p.clone()),
            Change::Data(p) => (event::NODE_DATA_CHANGED, p.clone()),
        };
        add(self.watches.take(Table::Data, &path), kind, &path);
        add(self.watches.peek(Table::Persistent, &path), kind, &path);
        let mut ancestor = path.clone();
        loop {
            add(self.watches.peek(Table::Recursive, &ancestor), kind, &path);
            if ancestor == "/" {
                break;
            }
            ancestor = split(&ancestor).0.to_string();
        }
        if !matches!(change, Change::Data(_)) {
            if matches!(change, Change::Deleted(_)) {
                add(self.watches.take(Table::Child, &path), event::NODE_DELETED, &path);
            }
            if path != "/" {
                let parent = split(&path).0.to_string();
                add(self.watches.take(Table::Child, &parent), event::NODE_CHILDREN_CHANGED, &parent);
                add(self.watches.peek(Table::Persistent, &parent), event::NODE_CHILDREN_CHANGED, &parent);
            }
        }
        for ((session, kind, path), ()) in events {
            if let Some(s) = self.sessions.get(&session) {
                self.out.push((s.push_to, Push::Watch { session, zxid, kind, path }));
            }
        }
    }

    /// setWatches after a reconnect: what changed since the client's last zxid fires
    /// now, the rest is registered (up to the session's bound on watches; the request
    /// has no per-path answer, so those past it go unregistered, as a watched read's
    /// does).
    #[allow(clippy::too_many_arguments)]
    fn set_watches(
        &mut self,
        session: i64,
        rel: i64,
        data: Vec<String>,
        exist: Vec<String>,
        child: Vec<String>,
        persistent: Vec<String>,
        recursive: Vec<String>,
        _ctx: &ExecCtx,
    ) {
        let Some(push_to) = self.sessions.get(&session).map(|s| s.push_to) else { return };
        let zxid = self.zxid;
        let fire = |out: &mut Vec<(ClientId, Push)>, kind: i32, path: &str| {
            out.push((push_to, Push::Watch { session, zxid, kind, path: path.to_string() }));
        };
        for path in data.into_iter().filter(|p| validate(p, false).is_ok()) {
            match self.tree.get(&path) {
                None => fire(&mut self.out, event::NODE_DELETED, &path),
                Some(n) if n.stat.mzxid > rel => fire(&mut self.out, event::NODE_DATA_CHANGED, &path),
                Some(_) => {
                    self.watches.add(Table::Data, &path, session);
                }
            }
        }
        for path in exist.into_iter().filter(|p| validate(p, false).is_ok()) {
            match self.tree.get(&path) {
                Some(_) => fire(&mut self.out, event::NODE_CREATED, &path),
                None => {
                    self.watches.add(Table::Data, &path, session);
                }
            }
        }
        for path in child.into_iter().filter(|p| validate(p, false).is_ok()) {
            match self.tree.get(&path) {
                None => fire(&mut self.out, event::NODE_DELETED, &path),
                Some(n) if n.stat.pzxid > rel => fire(&mut self.out, event::NODE_CHILDREN_CHANGED, &path),
                Some(_) => {
                    self.watches.add(Table::Child, &path, session);
                }
            }
        }
        for path in persistent.into_iter().filter(|p| validate(p, false).is_ok()) {
            self.watches.add(Table::Persistent, &path, session);
        }
        for path in recursive.into_iter().filter(|p| validate(p, false).is_ok()) {
            self.watches.add(Table::Recursive, &path, session);
        }
    }

    /// At a tick: expired sessions end; empty containers and stale TTL nodes go.
    fn expire(&mut self, ctx: &ExecCtx) {
        self.resume(ctx);
        let before = self.servers.len();
        self.servers.retain(|_, s| s.seen + SERVER_EXPIRE_MS > ctx.time);
        if self.servers.len() != before {
            self.write_config(ctx);
        }
        let expired: Vec<i64> =
            self.sessions.iter().filter(|(_, s)| s.deadline <= ctx.time).map(|(id, _)| *id).collect();
        for session in expired {
            self.zxid += 1;
            self.end_session(session, ctx);
        }
        let gone: Vec<String> = self
            .expiring
            .iter()
            .filter(|p| match self.tree.get(p.as_str()) {
                None => true,
                Some(n) if !n.children.is_empty() => false,
                Some(n) => match n.kind {
                    Kind::Container => n.stat.cversion > 0,
                    Kind::Ttl(ttl) => n.stat.mtime.saturating_add(ttl) < ctx.time as i64,
                    _ => true,
                },
            })
            .cloned()
            .collect();
        for path in gone {
            if self.tree.get(&path).is_some() {
                self.zxid += 1;
                self.delete(&path, self.zxid);
                self.fire(Change::Deleted(path), ctx);
            } else {
                self.expiring.remove(&path);
            }
        }
    }

    fn flush(&mut self, ctx: &ExecCtx) {
        for (to, push) in self.out.drain(..) {
            ctx.push(to, postcard::to_allocvec(&push).unwrap_or_default());
        }
    }
}

/// `host` of `host:port` (IPv6 keeps its brackets); the address was parsed before.
fn host_of(addr: &str) -> &str {
    addr.rsplit_once(':').map_or(addr, |(h, _)| h)
}

fn read_reply(answer: OpResult) -> Reply {
    match answer {
        Ok(body) => Reply::Op { zxid: 0, err: err::OK, body },
        Err(e) => Reply::Op { zxid: 0, err: e, body: Vec::new() },
    }
}

/// The digest scheme's id for "user:password": "user:" + base64(sha1("user:password")).
pub fn digest_id(user_password: &str) -> String {
    use base64::Engine;
    use sha1::Digest;
    let user = user_password.split(':').next().unwrap_or_default();
    let hash = sha1::Sha1::digest(user_password.as_bytes());
    format!("{user}:{}", base64::engine::general_purpose::STANDARD.encode(hash))
}

/// An `ip` ACL id: an address, optionally with /bits.
fn valid_ip_acl(id: &str) -> bool {
    let (addr, bits) = id.split_once('/').map_or((id, None), |(a, b)| (a, Some(b)));
    match addr.parse::<std::net::IpAddr>() {
        Ok(a) => bits.is_none_or(|b| b.parse::<u8>().is_ok_and(|b| b <= if a.is_ipv4() { 32 } else { 128 })),
        Err(_) => false,
    }
}

/// Whether client address `ip` falls in the `ip` ACL id `acl` ("10.0.0.0/8" or exact).
fn ip_matches(acl: &str, ip: &str) -> bool {
    let (addr, bits) = acl.split_once('/').map_or((acl, None), |(a, b)| (a, b.parse::<u32>().ok()));
    match (addr.parse::<std::net::IpAddr>(), ip.parse::<std::net::IpAddr>()) {
        (Ok(std::net::IpAddr::V4(a)), Ok(std::net::IpAddr::V4(b))) => {
            let bits = bits.unwrap_or(32).min(32);
            let mask = if bits == 0 { 0 } else { u32::MAX << (32 - bits) };
            u32::from(a) & mask == u32::from(b) & mask
        }
        (Ok(std::net::IpAddr::V6(a)), Ok(std::net::IpAddr::V6(b))) => {
            let bits = bits.unwrap_or(128).min(128);
            let mask = if bits == 0 { 0 } else { u128::MAX << (128 - bits) };
            u128::from(a) & mask == u128::from(b) & mask
        }
        _ => false,
    }
}

/// The service: the replicated state behind a lock, so that the node's front end can
/// read it in place ([`LocalView`], `reads = local`) while the executor runs commands.
/// The executor is the only writer; a front end only reads.
#[derive(Debug, Default)]
pub struct Coord {
    state: Arc<RwLock<State>>,
    /// The last transaction the state holds, for readers waiting to see their writes.
    zxid: Arc<watch::Sender<i64>>,
}

/// A deep copy: a clone does not share the state (tests compare before and after).
impl Clone for Coord {
    fn clone(&self) -> Coord {
        let state = self.read().clone();
        let zxid = state.zxid;
        Coord { state: Arc::new(RwLock::new(state)), zxid: Arc::new(watch::Sender::new(zxid)) }
    }
}

impl PartialEq for Coord {
    fn eq(&self, other: &Coord) -> bool {
        *self.read() == *other.read()
    }
}

impl Eq for Coord {}

impl Coord {
    pub fn new() -> Coord {
        Coord::default()
    }

    /// A service whose checkpoints track changes in segments of about `bytes` bytes
    /// (tests and the simulator, whose trees are small). Segment boundaries enter the
    /// checkpoint root: every node of a cluster must use the same.
    pub fn with_segment_target(bytes: usize) -> Coord {
        let coord = Coord::default();
        coord.write().tree.set_segment_target(bytes);
        coord
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, State> {
        self.state.write().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Tells waiting readers how far the state is.
    fn published(&self) {
        let zxid = self.read().zxid;
        self.zxid.send_replace(zxid);
    }

    /// The last transaction's id (for tests and status).
    pub fn zxid(&self) -> i64 {
        self.read().zxid
    }

    /// The number of live sessions.
    pub fn sessions(&self) -> usize {
        self.read().sessions.len()
    }

    /// A digest of the replicated state (for divergence checks and tests).
    pub fn digest(&self) -> [u8; 32] {
        *blake3::hash(&self.snapshot()).as_bytes()
    }
}

/// A node's own state, read in place by its front end (`reads = local`: ZooKeeper's
/// sequentially consistent reads, answered by the node the client is connected to).
#[derive(Debug, Default)]
pub struct LocalView {
    coord: Coord,
}

/// Clones share the state (unlike `Coord`'s clones, which copy it).
impl Clone for LocalView {
    fn clone(&self) -> LocalView {
        LocalView { coord: self.service() }
    }
}

impl LocalView {
    pub fn new() -> LocalView {
        LocalView::default()
    }

    /// A service over this view's state: what the node's service factory returns (the
    /// node builds one at the start and one per membership epoch, each restored from a
    /// checkpoint into the same state).
    pub fn service(&self) -> Coord {
        Coord { state: self.coord.state.clone(), zxid: self.coord.zxid.clone() }
    }

    /// Whether `coord` is a service over this view's state.
    pub fn views(&self, coord: &Coord) -> bool {
        Arc::ptr_eq(&self.coord.state, &coord.state)
    }

    /// Waits until the state holds transaction `zxid` (the client's own last write, or
    /// the last zxid it saw before it reconnected); false if it did not come in time.
    pub async fn wait_for(&self, zxid: i64, timeout: std::time::Duration) -> bool {
        let mut seen = self.coord.zxid.subscribe();
        tokio::time::timeout(timeout, seen.wait_for(|z| *z >= zxid)).await.is_ok_and(|r| r.is_ok())
    }

    /// The last transaction the state holds.
    pub fn zxid(&self) -> i64 {
        *self.coord.zxid.borrow()
    }

    /// Answers a read (without a watch) from the state as it is now, as the node would
    /// answer it read-only; None for a request that is not such a read.
    pub fn read(&self, session: i64, client: ClientId, request: Request) -> Option<Reply> {
        self.coord.read().read_only(session, client, request)
    }
}

impl Service for Coord {
    fn execute(&mut self, request: &[u8], ctx: &ExecCtx) -> Vec<u8> {
        let reply = {
            let mut state = self.write();
            let reply = match postcard::from_bytes::<Command>(request) {
                Ok(command) => state.run(command, ctx),
                Err(_) => Reply::Op { zxid: 0, err: err::MARSHALLING_ERROR, body: Vec::new() },
            };
            state.flush(ctx);
            reply
        };
        self.published();
        reply.encode()
    }

    /// Reads without a watch. `execute` answers them alike and changes nothing.
    fn execute_read_only(&self, request: &[u8], ctx: &ReadCtx) -> Option<Vec<u8>> {
        let state = self.read();
        match postcard::from_bytes::<Command>(request).ok()? {
            Command::Op { session, request } => state.read_only(session, ctx.client, request).map(|r| r.encode()),
            // Reads of several sessions gathered by a front end: answered here only if
            // every one is a read, as `execute` would answer the same batch.
            Command::Batch(commands) => {
                let mut room = BatchRoom::default();
                let mut replies = Vec::with_capacity(commands.len());
                for c in commands {
                    let Command::Op { session, request } = c else { return None };
                    if request.writes() {
                        return None;
                    }
                    replies.push(room.fit(state.read_only(session, ctx.client, request)?));
                }
                Some(Reply::Batch(replies).encode())
            }
            _ => None,
        }
    }

    fn on_tick(&mut self, ctx: &ExecCtx) {
        {
            let mut state = self.write();
            state.expire(ctx);
            state.flush(ctx);
        }
        self.published();
    }

    fn snapshot(&self) -> Vec<u8> {
        postcard::to_extend(&*self.read(), format_stamp(SNAPSHOT_FORMAT)).unwrap_or_default()
    }

    /// [`Service::snapshot`]'s bytes, the tree in segments that are reused while none of
    /// their paths is written (tree.rs): `State` serializes its tree first, as a map (a
    /// length, then the entries), then the other fields in order.
    fn pieces(&self) -> Vec<Arc<Piece>> {
        let mut state = self.write();
        let mut head = format_stamp(SNAPSHOT_FORMAT);
        head = postcard::to_extend(&state.tree.len(), head).unwrap_or_default();
        let mut pieces = vec![Piece::new(head)];
        pieces.extend(state.tree.pieces());
        let rest = (&state.sessions, &state.watches, &state.zxid, &state.expiring, &state.last_time, &state.servers);
        pieces.push(Piece::new(postcard::to_allocvec(&rest).unwrap_or_default()));
        pieces
    }

    fn restore(&mut self, snapshot: &[u8]) -> Result<(), RestoreError> {
        let snapshot = strip_format_stamp(snapshot, "coord", SNAPSHOT_FORMAT)?;
        let mut restored: State = postcard::from_bytes(snapshot).map_err(|e| RestoreError(e.to_string()))?;
        let mut state = self.write();
        restored.tree.set_segment_target(state.tree.segment_target());
        *state = restored;
        drop(state);
        self.published();
        Ok(())
    }
}

#[cfg(test)]
mod multi_tests {
    use super::*;
    use keel_core::ids::Seq;
    use proptest::prelude::*;

    const FRONT_END: u64 = 2000 << 10;
    const PATHS: [&str; 8] = ["/a", "/a/b", "/a/b/c", "/d", "/d/e", "/c", "/c/x", "/t"];

    fn create(path: usize, flags: i32) -> Request {
        let opcode = match flags {
            4 => op::CREATE_CONTAINER,
            5 => op::CREATE_TTL,
            _ => op::CREATE,
        };
        let ttl = if flags == 5 { 3_000 } else { -1 };
        Request::Create { opcode, path: PATHS[path].into(), data: vec![path as u8; 3], acl: Acl::open(), flags, ttl }
    }

    fn write_op() -> impl Strategy<Value = Request> {
        let path = 0..PATHS.len();
        prop_oneof![
            4 => (path.clone(), prop::sample::select(vec![0, 1, 2, 3, 4, 5])).prop_map(|(p, f)| create(p, f)),
            2 => path.clone().prop_map(|p| Request::Delete { path: PATHS[p].into(), version: -1 }),
            2 => (path.clone(), any::<u8>())
                .prop_map(|(p, b)| Request::SetData { path: PATHS[p].into(), data: vec![b; 2], version: -1 }),
            1 => path.clone().prop_map(|p| Request::SetAcl { path: PATHS[p].into(), acl: Acl::open(), version: -1 }),
            1 => (path, -1..2i32).prop_map(|(p, v)| Request::Check { path: PATHS[p].into(), version: v }),
        ]
    }

    proptest! {
        /// A multi that fails leaves the tree, every session's ephemerals and the nodes
        /// ticks look at exactly as they were (the journal's rollback against the copy
        /// a multi used to restore), whatever the earlier ops of the multi did.
        #[test]
        fn a_failed_multi_leaves_the_state_as_it_was(
            setup in prop::collection::vec(write_op(), 0..30),
            multis in prop::collection::vec(prop::collection::vec(write_op(), 1..6), 1..12),
        ) {
            let mut state = State::default();
            let ctx = |seq: u64| ExecCtx::new(Seq(seq), 1_000 + seq, seq, ClientId(FRONT_END));
            let verifier = crate::session_key::SessionSecret::from_bytes([1; 16]).verifier();
            let Reply::Session { id: session, .. } =
                state.run(Command::Connect { timeout: 6_000, ip: "::1".into(), pinned: false, verifier }, &ctx(1))
            else {
                panic!("no session")
            };
            let mut seq = 1;
            for request in setup {
                seq += 1;
                state.run(Command::Op { session, request }, &ctx(seq));
            }
            for ops in multis {
                seq += 1;
                let before = (state.tree.clone(), state.sessions.clone(), state.expiring.clone(), state.zxid);
                state.multi(session, ops, &ctx(seq));
                if state.zxid == before.3 {
                    prop_assert!(state.tree == before.0, "the tree changed");
                    prop_assert_eq!(&state.sessions, &before.1);
                    prop_assert_eq!(&state.expiring, &before.2);
                }
                // Children are linked as the paths say (what a snapshot read back holds).
                let restored: Tree = postcard::from_bytes(&postcard::to_allocvec(&state.tree).unwrap_or_default())
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                for path in PATHS.iter().chain(["/"].iter()) {
                    let (a, b) = (state.tree.get(path), restored.get(path));
                    prop_assert_eq!(a.map(|n| &n.children), b.map(|n| &n.children), "{}", path);
                }
            }
        }
    }
}

#[cfg(test)]
mod watch_tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Op {
        Add(usize, u8, i64),
        Take(usize, u8),
        Remove(usize, u8, i64),
        Drop(i64),
    }

    const TABLES: [Table; 4] = [Table::Data, Table::Child, Table::Persistent, Table::Recursive];

    fn op() -> impl Strategy<Value = Op> {
        let (t, p, s) = (0..4usize, 0..6u8, 1..5i64);
        prop_oneof![
            5 => (t.clone(), p.clone(), s.clone()).prop_map(|(t, p, s)| Op::Add(t, p, s)),
            2 => (t.clone(), p.clone()).prop_map(|(t, p)| Op::Take(t, p)),
            2 => (t, p, s.clone()).prop_map(|(t, p, s)| Op::Remove(t, p, s)),
            1 => s.prop_map(Op::Drop),
        ]
    }

    proptest! {
        /// Each session's index follows the tables through adds, one-shot firings,
        /// removals and session ends: it equals the index rebuilt from the tables (what
        /// a snapshot read back holds), and counts what a walk of every table counts.
        #[test]
        fn the_per_session_index_follows_the_tables(ops in prop::collection::vec(op(), 1..60)) {
            let mut w = Watches::default();
            for op in ops {
                match op {
                    Op::Add(t, p, s) => {
                        w.add(TABLES[t], &format!("/p{p}"), s);
                    }
                    Op::Take(t, p) => { w.take(TABLES[t], &format!("/p{p}")); }
                    Op::Remove(t, p, s) => { w.remove(TABLES[t], &format!("/p{p}"), s); }
                    Op::Drop(s) => w.drop_session(s),
                }
                let read_back: Watches = postcard::from_bytes(&postcard::to_allocvec(&w).unwrap_or_default())
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert_eq!(&read_back.owned, &w.owned);
                for s in 1..5 {
                    let walked: usize = TABLES.iter().map(|t| w.table(*t).values().filter(|x| x.contains(&s)).count()).sum();
                    prop_assert_eq!(w.count(s), walked);
                }
                prop_assert!(TABLES.iter().all(|t| w.table(*t).values().all(|x| !x.is_empty())), "no empty entries");
            }
        }
    }
}
