//! The ZooKeeper front end: a node's client port, speaking ZooKeeper's wire protocol to
//! unmodified clients and Keel's client protocol to the cluster.
//!
//! Each connection's requests run one after another, so replies leave in request order
//! (the Java client drops a connection whose replies come out of order). Writes and
//! reads that set a watch are ordered; other reads are answered by a linearizable
//! read-only quorum (`Reads::Quorum`), so what a client reads is what Q nodes agree on.
//! Watch events come as push events from the cluster, accepted once r + 1 nodes sent
//! them alike; a gap in them drops the connections (the client reconnects and
//! re-registers its watches with setWatches, which fires what it missed).
//!
//! Sessions live while their client is heard: every second the front end orders a
//! `Touch` of the sessions it heard from within their timeout; the cluster expires the
//! others at agreed-time ticks.

use crate::coord::{Command, LocalView, Push, Reply, SESSION_TIMEOUT_MAX, SESSION_TIMEOUT_MIN};
use crate::jute::{Reader, Writer};
use crate::proto::{self, err, op, xid, ConnectRequest, Request, MAX_BUFFER};
use crate::session_key::SessionSecret;
use keel::{FrontEnd, KeelClient, Pushed, ReadConsistency};
use keel_core::ids::owner_of;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};

/// Keel client sessions a front end wants (`NodeBuilder::client_sessions`): operations
/// of different connections in flight at once.
pub const CLIENT_SESSIONS: usize = 64;
/// Frames queued for one connection's writer (replies and watch events). A client that
/// does not read them loses its connection once a write has waited a session timeout,
/// not the node's memory.
const OUTBOX: usize = 64;
/// How often sessions heard from are touched (ordered): well inside the shortest
/// session timeout.
const TOUCH_EVERY: Duration = Duration::from_millis(1_000);
/// How often a node's front end announces its address (`Command::Announce`); well
/// within `coord::SERVER_EXPIRE_MS`.
const ANNOUNCE_EVERY: Duration = Duration::from_secs(5);
/// Most client connections a front end keeps open at once (ZooKeeper bounds them per
/// address, `maxClientCnxns`); more are closed at once and counted.
pub const CONNECTIONS_MAX: usize = 4_096;
/// How long a new connection may take to send its handshake.
const HANDSHAKE_WITHIN: Duration = Duration::from_secs(10);

/// How the front end answers reads without a watch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reads {
    /// A read-only quorum (Q matching answers from nodes that executed what they
    /// accepted): linearizable, and never one lying node's answer.
    Quorum,
    /// From this node's own state, once it holds the client's last write (and on
    /// reconnect the last zxid the client saw): ZooKeeper's sequentially consistent
    /// reads, at no cost to the cluster; the client trusts this node for them.
    Local,
}

#[derive(Clone, Copy, Debug)]
pub struct Options {
    pub reads: Reads,
    /// The longest an operation may wait for the cluster before the connection is
    /// dropped (the client then reconnects, maybe elsewhere).
    pub op_timeout: Duration,
    /// Connections one client address may hold open here (ZooKeeper's
    /// `maxClientCnxns`, 60 by default there and here; 0: no limit), so one host cannot
    /// take every connection.
    pub max_client_cnxns: usize,
}

/// ZooKeeper's default `maxClientCnxns`.
pub const MAX_CLIENT_CNXNS_DEFAULT: usize = 60;

impl Default for Options {
    fn default() -> Options {
        Options {
            reads: Reads::Quorum,
            op_timeout: Duration::from_secs(10),
            max_client_cnxns: MAX_CLIENT_CNXNS_DEFAULT,
        }
    }
}

impl Options {
    /// From `[front_end.options]` in node.toml: `reads = "quorum"` (the default) or
    /// `"local"`; `max_client_cnxns = N` (connections per client address, 0 for no
    /// limit). Anything else is an error, so a typo does not pass unnoticed.
    pub fn from_settings(settings: &std::collections::BTreeMap<String, String>) -> Result<Options, String> {
        let mut o = Options::default();
        for (key, value) in settings {
            match (key.as_str(), value.as_str()) {
                ("reads", "quorum") => o.reads = Reads::Quorum,
                ("reads", "local") => o.reads = Reads::Local,
                ("reads", other) => return Err(format!("coord front end: reads = {other:?}: quorum or local")),
                ("max_client_cnxns", n) => {
                    o.max_client_cnxns = n.parse().map_err(|_| {
                        format!("coord front end: max_client_cnxns = {n:?}: a number of connections, 0 for no limit")
                    })?
                }
                (other, _) => {
                    return Err(format!("coord front end: unknown option {other:?} (known: reads, max_client_cnxns)"))
                }
            }
        }
        Ok(o)
    }
}

/// Counters the four-letter words report.
#[derive(Default)]
struct Stats {
    received: AtomicU64,
    sent: AtomicU64,
    /// Connections dropped for bad input (malformed or oversized frames).
    malformed: AtomicU64,
    /// Connections closed because their client stopped reading.
    stalled: AtomicU64,
    /// Requests answered BADARGUMENTS because no command could carry them.
    too_large: AtomicU64,
    /// Connections refused because `CONNECTIONS_MAX` were open, or closed because no
    /// handshake came in time.
    refused: AtomicU64,
    /// Connections open now.
    open: std::sync::atomic::AtomicUsize,
    /// Ordered operations the group committer sent, and the commands in them.
    commits: AtomicU64,
    committed: AtomicU64,
    connections: AtomicU64,
}

/// What a connection's writer sends, in the order it receives them, except that watch
/// events wait for the replies ordered before them (`Outbox`).
enum Out {
    /// A frame with no place in the zxid order (a ping's answer, a local error).
    Frame(Vec<u8>),
    /// A reply, and the zxid its header carries.
    Reply(i64, Vec<u8>),
    /// A watch notification for the change at this zxid.
    Event(i64, Vec<u8>),
    /// The processor sent requests to the cluster: events wait for their replies.
    Busy,
    /// Their replies were all sent.
    Idle,
    /// End the connection (session expired or moved, or a gap in events).
    Close,
}

/// Bytes of queued frames a connection's writer gathers into one write.
const WRITE_COALESCE_MAX: usize = 256 * 1024;
/// What a connection's write buffer keeps between writes.
const WRITE_KEPT_MAX: usize = 64 * 1024;
/// A connection's read buffer: many small requests per receive.
const READ_BUFFER: usize = 16 * 1024;

/// Most watch events one connection holds back while its requests are out; past it the
/// connection closes and its client re-syncs (setWatches on reconnect).
const HELD_EVENTS_MAX: usize = 4096;

/// ZooKeeper's order on one connection: a watch event comes after the reply of every
/// request executed before its change (the read that set the watch above all: the
/// client registers a watcher only when that reply arrives, and drops an event for a
/// watcher it does not hold yet) and before the reply of any request executed after
/// it. Events reach a front end apart from replies (pushes, not answers), so one that
/// arrives while the connection's requests are out is held until a reply at its zxid
/// or later is written, or until every reply came back.
#[derive(Default)]
struct Outbox {
    busy: usize,
    held: std::collections::VecDeque<(i64, Vec<u8>)>,
}

impl Outbox {
    /// The frames to write now for `o`, in order; None: close the connection.
    fn next(&mut self, o: Out) -> Option<Vec<Vec<u8>>> {
        Some(match o {
            Out::Frame(frame) => vec![frame],
            Out::Event(_, frame) if self.busy == 0 => vec![frame],
            Out::Event(zxid, frame) => {
                if self.held.len() >= HELD_EVENTS_MAX {
                    return None;
                }
                self.held.push_back((zxid, frame));
                Vec::new()
            }
            Out::Reply(zxid, frame) => {
                // Events come in zxid order (a front end's pushes arrive in decided order).
                let mut frames = Vec::new();
                while self.held.front().is_some_and(|(e, _)| *e <= zxid) {
                    frames.extend(self.held.pop_front().map(|(_, f)| f));
                }
                frames.push(frame);
                frames
            }
            Out::Busy => {
                self.busy += 1;
                Vec::new()
            }
            Out::Idle => {
                self.busy = self.busy.saturating_sub(1);
                match self.busy {
                    0 => self.held.drain(..).map(|(_, f)| f).collect(),
                    _ => Vec::new(),
                }
            }
            Out::Close => return None,
        })
    }
}

struct Conn {
    peer: SocketAddr,
    out: mpsc::Sender<Out>,
    timeout: i32,
}

/// What every connection of one front end shares.
struct Shared {
    client: KeelClient,
    /// The read batcher's queue (quorum reads).
    reads: mpsc::Sender<ReadJob>,
    /// The group committer's queue.
    commits: mpsc::Sender<Commit>,
    /// Asks the push router to route every event the client has accepted so far.
    barriers: mpsc::Sender<oneshot::Sender<()>>,
    /// This node's state, for `Reads::Local` (a shim has none).
    local: Option<LocalView>,
    options: Options,
    /// "node N" or "shim", for the four-letter words.
    label: String,
    /// Sessions made here stay here (the shim's: see `Command::Connect`).
    pinned: bool,
    listen: SocketAddr,
    /// Live connections by session.
    conns: Mutex<HashMap<i64, Conn>>,
    /// Open connections by client address (`Options::max_client_cnxns`).
    per_address: Mutex<HashMap<std::net::IpAddr, usize>>,
    /// When each session's client was last heard (for touches).
    heard: Mutex<HashMap<i64, (Instant, i32)>>,
    /// The highest zxid this front end saw from the cluster.
    zxid: AtomicI64,
    stats: Stats,
}

impl Shared {
    /// Whether reads go to a quorum of the cluster (`reads()` answers them from this
    /// node only with `Reads::Local` and a local view of the state).
    fn quorum_reads(&self) -> bool {
        !(self.local.is_some() && self.options.reads == Reads::Local)
    }

    /// Counts a connection from `ip`, unless that address holds its limit already.
    fn admit_address(&self, ip: std::net::IpAddr) -> bool {
        let Ok(mut open) = self.per_address.lock() else { return true };
        let n = open.entry(ip).or_insert(0);
        if self.options.max_client_cnxns > 0 && *n >= self.options.max_client_cnxns {
            if *n == 0 {
                open.remove(&ip);
            }
            return false;
        }
        *n += 1;
        true
    }

    fn release_address(&self, ip: std::net::IpAddr) {
        if let Ok(mut open) = self.per_address.lock() {
            if let Some(n) = open.get_mut(&ip) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    open.remove(&ip);
                }
            }
        }
    }

    fn heard(&self, session: i64, timeout: i32) {
        if let Ok(mut h) = self.heard.lock() {
            h.insert(session, (Instant::now(), timeout));
        }
    }

    /// Returns once every watch event the client accepted so far is with its
    /// connection's writer. Called when replies arrive, before they are written: each
    /// node sends a change's events before the reply of any request executed after it,
    /// so the events a reply must not overtake were accepted before it.
    async fn route_accepted_events(&self) {
        let (done, routed) = oneshot::channel();
        if self.barriers.send(done).await.is_ok() {
            let _ = routed.await;
        }
    }

    fn saw(&self, zxid: i64) {
        self.zxid.fetch_max(zxid, Ordering::Relaxed);
    }

    async fn call(&self, command: &Command, read: bool) -> Option<Reply> {
        let bytes = command.encode();
        let result = if read && self.options.reads == Reads::Quorum {
            self.client.invoke_read_only(bytes, ReadConsistency::Linearizable, self.options.op_timeout).await
        } else {
            self.client.invoke(bytes, self.options.op_timeout).await
        };
        match result {
            Ok(bytes) => Reply::decode(&bytes),
            Err(e) => {
                tracing::warn!(error = %e, "coord front end: the cluster did not answer");
                None
            }
        }
    }
}

/// Serves ZooKeeper clients on `listener` until the node stops. `local` is the view of
/// the node's own state its service was built over ([`LocalView::service`]).
pub async fn serve(mut fe: FrontEnd, listener: TcpListener, options: Options, local: LocalView) {
    let Some(client) = fe.client().cloned() else {
        tracing::error!(node = fe.node.0, "coord front end without a client identity: not serving");
        return;
    };
    let role = Role::Node { id: fe.node, local, ports: (fe.listen.port(), fe.metrics.port()) };
    serve_client(client, role, listener, options, async move { fe.stopped().await }).await
}

/// Where a front end runs.
pub enum Role {
    /// On node `id`, beside its state; the node's peer and metrics ports.
    Node { id: keel::NodeId, local: LocalView, ports: (u16, u16) },
    /// In a process of the client's own (`keel coord-shim`): it holds no state, and a
    /// reply counts only once r + 1 nodes sent it alike, so no single node is trusted.
    Shim,
}

/// Serves ZooKeeper clients on `listener` through `client` until `stop` resolves: the
/// node's front end, or the shim. With [`Role::Shim`], reads are always quorum reads.
pub async fn serve_client(
    client: KeelClient,
    role: Role,
    listener: TcpListener,
    mut options: Options,
    stop: impl std::future::Future<Output = ()>,
) {
    let pinned = matches!(role, Role::Shim);
    let node = match &role {
        Role::Node { id, ports, .. } => Some((*id, *ports)),
        Role::Shim => None,
    };
    let (label, local) = match role {
        Role::Node { id, local, .. } => (format!("node {id}"), Some(local)),
        Role::Shim => {
            options.reads = Reads::Quorum;
            // A shim serves the applications of its own machine: all one address.
            options.max_client_cnxns = 0;
            ("shim".to_string(), None)
        }
    };
    let mut stop = std::pin::pin!(stop);
    let listen = listener.local_addr().unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
    let pushes = client.push_events();
    let (commits, commit_queue) = mpsc::channel(4096);
    let (reads, read_queue) = mpsc::channel(4096);
    let (barriers, barrier_queue) = mpsc::channel(4096);
    let shared = Arc::new(Shared {
        client,
        reads,
        commits,
        barriers,
        local,
        options,
        label,
        pinned,
        listen,
        conns: Mutex::new(HashMap::new()),
        per_address: Mutex::new(HashMap::new()),
        heard: Mutex::new(HashMap::new()),
        zxid: AtomicI64::new(0),
        stats: Stats::default(),
    });
    if let Some(pushes) = pushes {
        tokio::spawn(route_pushes(shared.clone(), pushes, barrier_queue));
    }
    tokio::spawn(touch(shared.clone()));
    if let Some((node, ports)) = node {
        tokio::spawn(announce(shared.clone(), node, listen, ports));
    }
    tokio::spawn(commit(shared.clone(), commit_queue));
    tokio::spawn(batch_reads(shared.clone(), read_queue));
    loop {
        let accepted = tokio::select! {
            () = &mut stop => return,
            a = listener.accept() => a,
        };
        match accepted {
            Ok((stream, peer)) => {
                if shared.stats.open.load(Ordering::Relaxed) >= CONNECTIONS_MAX {
                    shared.stats.refused.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(%peer, "ZooKeeper connection refused: {CONNECTIONS_MAX} open already");
                    continue;
                }
                if !shared.admit_address(peer.ip()) {
                    shared.stats.refused.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(
                        %peer,
                        "ZooKeeper connection refused: {} open from this address already (max_client_cnxns)",
                        shared.options.max_client_cnxns
                    );
                    continue;
                }
                let _ = stream.set_nodelay(true);
                shared.stats.connections.fetch_add(1, Ordering::Relaxed);
                shared.stats.open.fetch_add(1, Ordering::Relaxed);
                let shared = shared.clone();
                tokio::spawn(async move {
                    connection(&shared, stream, peer).await;
                    shared.stats.open.fetch_sub(1, Ordering::Relaxed);
                    shared.release_address(peer.ip());
                });
            }
            Err(e) => {
                tracing::warn!(error = %e, "coord front end: accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// Watch events and expiries from the cluster to the connections they are for. A
/// barrier is answered once every event queued before it was routed.
async fn route_pushes(
    shared: Arc<Shared>,
    mut pushes: keel::PushReceiver,
    mut barriers: mpsc::Receiver<oneshot::Sender<()>>,
) {
    loop {
        tokio::select! {
            biased;
            pushed = pushes.recv() => match pushed {
                Some((_, pushed)) => route(&shared, pushed),
                None => return,
            },
            Some(done) = barriers.recv() => {
                while let Ok((_, pushed)) = pushes.try_recv() {
                    route(&shared, pushed);
                }
                let _ = done.send(());
            }
        }
    }
}

fn route(shared: &Shared, pushed: Pushed) {
    match pushed {
        Pushed::Event { event, .. } => match Push::decode(&event) {
            Some(Push::Watch { session, zxid, kind, path }) => {
                shared.saw(zxid);
                let out = shared.conns.lock().ok().and_then(|c| c.get(&session).map(|c| c.out.clone()));
                if let Some(out) = out {
                    if out.try_send(Out::Event(zxid, proto::notification(zxid, kind, &path))).is_err() {
                        let _ = out.try_send(Out::Close);
                    }
                }
            }
            Some(Push::Expired { session }) => {
                let conn = shared.conns.lock().ok().and_then(|mut c| c.remove(&session));
                if let Some(conn) = conn {
                    let _ = conn.out.try_send(Out::Close);
                }
                if let Ok(mut h) = shared.heard.lock() {
                    h.remove(&session);
                }
            }
            None => tracing::warn!("coord front end: an event it cannot read"),
        },
        // Events were lost: every client re-syncs (reconnect, setWatches).
        Pushed::Gap { first, last } => {
            tracing::warn!(first, last, "coord front end: watch events lost; dropping connections");
            let conns: Vec<Conn> =
                shared.conns.lock().map(|mut c| c.drain().map(|(_, c)| c).collect()).unwrap_or_default();
            for conn in conns {
                let _ = conn.out.try_send(Out::Close);
            }
        }
    }
}

/// A shim's answer to `read` (one that reads `/zookeeper/config`, alone or in a
/// multiRead): the config rewritten by [`shim_config`], anything else as the cluster
/// answered. None: a body it cannot walk (left alone).
fn shim_answer(read: &Request, body: &[u8], listen: SocketAddr) -> Option<Vec<u8>> {
    let Request::MultiRead(ops) = read else { return shim_config(body, listen) };
    let mut r = Reader::new(body);
    let at = |r: &Reader| body.len() - r.remaining();
    let mut out = Vec::with_capacity(body.len());
    for request in ops {
        let header = at(&r);
        let (kind, _done, _err) = (r.int().ok()?, r.bool().ok()?, r.int().ok()?);
        let start = at(&r);
        if kind == op::ERROR {
            r.int().ok()?;
        } else {
            match request {
                Request::GetData { .. } => {
                    r.buffer().ok()?;
                    proto::Stat::read(&mut r).ok()?;
                }
                Request::GetChildren { two, .. } => {
                    r.strings().ok()?;
                    if *two {
                        proto::Stat::read(&mut r).ok()?;
                    }
                }
                _ => return None,
            }
        }
        let end = at(&r);
        out.extend_from_slice(&body[header..start]);
        match kind != op::ERROR && request.reads_config() {
            true => out.extend(shim_config(&body[start..end], listen)?),
            false => out.extend_from_slice(&body[start..end]),
        }
    }
    out.extend_from_slice(&body[at(&r)..]);
    Some(out)
}

/// A shim's answer to a read of `/zookeeper/config`: itself as the only server, with
/// the cluster's version line. The application trusts the shim, not the nodes; a client
/// that follows the config (Curator's ensemble tracker) would otherwise reconnect to the
/// nodes' own ports and read from one node, past the shim's r + 1 matching. The quorum
/// and election ports are the shim's port and the next one: ZooKeeper's parser needs two
/// distinct ports there, and no client connects to them. None: not a getData reply.
fn shim_config(body: &[u8], listen: SocketAddr) -> Option<Vec<u8>> {
    let mut r = Reader::new(body);
    let data = r.buffer().ok()?;
    let mut stat = proto::Stat::read(&mut r).ok()?;
    let text = String::from_utf8(data).ok()?;
    let version = text.lines().find(|l| l.starts_with("version=")).unwrap_or("version=0");
    let other = if listen.port() == u16::MAX { listen.port() - 1 } else { listen.port() + 1 };
    // `host:port` as ZooKeeper writes it ([v6]:port for IPv6).
    let ours = format!("server.0={listen}:{other}:participant;{listen}\n{version}");
    stat.data_length = ours.len() as i32;
    let mut w = Writer::new();
    w.buffer(ours.as_bytes());
    stat.write(&mut w);
    Some(w.into_bytes())
}

/// Orders a touch of the sessions heard from within their timeout, every second.
async fn touch(shared: Arc<Shared>) {
    let mut every = tokio::time::interval(TOUCH_EVERY);
    loop {
        every.tick().await;
        let alive: Vec<i64> = match shared.heard.lock() {
            Ok(mut h) => {
                h.retain(|_, (at, timeout)| at.elapsed() < Duration::from_millis(*timeout as u64));
                h.keys().copied().collect()
            }
            Err(_) => continue,
        };
        if !alive.is_empty() {
            let _ = shared.call(&Command::Touch { sessions: alive }, false).await;
        }
    }
}

/// Tells the cluster where this node's ZooKeeper clients connect, at once and every
/// [`ANNOUNCE_EVERY`], for `/zookeeper/config` (clients that follow it, such as
/// Curator's ensemble tracker, find nodes added later and drop removed ones).
async fn announce(shared: Arc<Shared>, node: keel::NodeId, listen: SocketAddr, (peer_port, metrics_port): (u16, u16)) {
    if listen.ip().is_unspecified() {
        tracing::warn!(%listen, "coord front end listens on every address: /zookeeper/config will not list it");
        return;
    }
    let mut every = tokio::time::interval(ANNOUNCE_EVERY);
    loop {
        every.tick().await;
        let announce = Command::Announce { node: node.0, addr: listen.to_string(), peer_port, metrics_port };
        let _ = shared.call(&announce, false).await;
    }
}

/// Reads one length-prefixed frame of at most `MAX_BUFFER` (plus a record's framing).
async fn read_frame(stream: &mut ReadHalf, len: Option<[u8; 4]>) -> Result<Vec<u8>, String> {
    let header = match len {
        Some(h) => h,
        None => {
            let mut h = [0u8; 4];
            stream.read_exact(&mut h).await.map_err(|e| e.to_string())?;
            h
        }
    };
    let mut body = vec![0u8; frame_len(header)?];
    stream.read_exact(&mut body).await.map_err(|e| e.to_string())?;
    Ok(body)
}

/// The body length a frame's 4-byte prefix announces, within ZooKeeper's limit
/// (`jute.maxbuffer` plus room for the request's other fields).
pub fn frame_len(prefix: [u8; 4]) -> Result<usize, String> {
    let len = i32::from_be_bytes(prefix);
    if len < 0 || len as usize > MAX_BUFFER + 1024 {
        return Err(format!("frame length {len} outside 0..={}", MAX_BUFFER + 1024));
    }
    Ok(len as usize)
}

/// What one frame after the handshake asks of the front end.
#[derive(Debug)]
pub enum Incoming {
    Ping,
    Close(i32),
    /// An auth packet: scheme and credentials.
    Auth(String, Vec<u8>),
    /// A request for the cluster: its xid, the request, its frame's size.
    Request(i32, Request, usize),
    /// An opcode this server does not implement: UNIMPLEMENTED, the connection stays.
    Unimplemented(i32),
    /// A request that fits ZooKeeper's frame but not one command ([`orderable`]):
    /// BADARGUMENTS, the connection stays.
    TooLarge(i32),
    /// Bytes that are not a request: the connection closes.
    Malformed(String),
}

/// Reads one frame's body (session `session`'s). Pure, so the fuzz target runs it on
/// arbitrary bytes: whatever it returns as a `Request` fits in one command.
pub fn incoming(session: i64, body: &[u8]) -> Incoming {
    let mut r = Reader::new(body);
    let (Ok(xid), Ok(opcode)) = (r.int(), r.int()) else {
        return Incoming::Malformed("a frame without a request header".into());
    };
    match opcode {
        op::PING => Incoming::Ping,
        op::CLOSE_SESSION => Incoming::Close(xid),
        op::AUTH => match (r.int(), r.string(), r.buffer()) {
            (Ok(_type), Ok(scheme), Ok(auth)) => Incoming::Auth(scheme, auth),
            _ => Incoming::Malformed("a malformed auth packet".into()),
        },
        _ => match Request::parse(opcode, &mut r) {
            Err(e) => Incoming::Malformed(e.to_string()),
            Ok(None) => Incoming::Unimplemented(xid),
            Ok(Some(request)) if !orderable(session, &request, body.len()) => Incoming::TooLarge(xid),
            Ok(Some(request)) => Incoming::Request(xid, request, body.len()),
        },
    }
}

/// A client connection's receiving half, buffered.
type ReadHalf = tokio::io::BufReader<tokio::net::tcp::OwnedReadHalf>;

fn frame(body: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(4 + body.len());
    push_frame(&mut f, body);
    f
}

/// Appends `body` to `buf` as one frame: its length, then the bytes.
fn push_frame(buf: &mut Vec<u8>, body: &[u8]) {
    buf.extend_from_slice(&(body.len() as u32).to_be_bytes());
    buf.extend_from_slice(body);
}

/// One client connection: the handshake, then requests in order.
async fn connection(shared: &Arc<Shared>, stream: TcpStream, peer: SocketAddr) {
    let shared = shared.clone();
    let (read, mut write) = stream.into_split();
    let mut read = tokio::io::BufReader::with_capacity(READ_BUFFER, read);
    let mut first = [0u8; 4];
    let handshake = async {
        read.read_exact(&mut first).await.map_err(|e| e.to_string())?;
        if four_letter_word(&shared, &first).is_some() {
            return Ok(None);
        }
        read_frame(&mut read, Some(first)).await.map(Some)
    };
    let body = match tokio::time::timeout(HANDSHAKE_WITHIN, handshake).await {
        Err(_) => {
            shared.stats.refused.fetch_add(1, Ordering::Relaxed);
            tracing::info!(%peer, "ZooKeeper connection closed: no handshake within {HANDSHAKE_WITHIN:?}");
            return;
        }
        Ok(Err(e)) if e.contains("outside") => return malformed(&shared, peer, &e),
        Ok(Err(_)) => return,
        Ok(Ok(None)) => {
            if let Some(answer) = four_letter_word(&shared, &first) {
                let _ = write.write_all(answer.as_bytes()).await;
            }
            let _ = write.shutdown().await;
            return;
        }
        Ok(Ok(Some(body))) => body,
    };
    let connect = match ConnectRequest::parse(&body) {
        Ok(c) => c,
        Err(e) => return malformed(&shared, peer, &e.to_string()),
    };
    let timeout = connect.timeout.clamp(SESSION_TIMEOUT_MIN, SESSION_TIMEOUT_MAX);
    let ip = peer.ip().to_string();
    // The password the client gets: a secret only this front end and the client see
    // (`session_key`); the cluster keeps its public key.
    let secret = SessionSecret::random();
    let command = if connect.session_id == 0 {
        Some(Command::Connect { timeout, ip, pinned: shared.pinned, verifier: secret.verifier() })
    } else {
        SessionSecret::from_password(&connect.password).map(|shown| {
            let next = secret.verifier();
            let proof = shown.prove(connect.session_id, owner_of(shared.client.id()).0, &next);
            Command::Attach { session: connect.session_id, proof, next, timeout, ip }
        })
    };
    let answer = match &command {
        Some(command) => shared.call(command, false).await,
        None => Some(Reply::Refused { err: err::SESSION_EXPIRED }), // not a password we gave
    };
    let (session, timeout, zxid) = match answer {
        Some(Reply::Session { id, timeout, zxid }) => (id, timeout, zxid),
        Some(Reply::Refused { .. }) => {
            // A timeout of 0 tells the client its session expired.
            let _ = write.write_all(&frame(&proto::connect_response(0, 0, &[0; 16]))).await;
            return;
        }
        _ => return, // the cluster did not answer: the client tries again, maybe elsewhere
    };
    // Only frames after this handshake show the client holds the new password: what
    // an earlier connection of the session here was heard saying must not confirm the
    // move (a client that reconnects to the same node and misses this response would
    // come back with a password already retired).
    if let Ok(mut h) = shared.heard.lock() {
        h.remove(&session);
    }
    shared.saw(zxid);
    // A client that saw more than this node holds reads from it only once it caught up
    // (quorum reads always reflect every completed write: nothing to wait for).
    let caught_up = match (&shared.local, shared.options.reads) {
        (Some(local), Reads::Local) => local.wait_for(connect.last_zxid_seen, shared.options.op_timeout).await,
        _ => true,
    };
    if !caught_up {
        tracing::info!(session, seen = connect.last_zxid_seen, "client has seen a later zxid than this node holds");
        return;
    }
    if write.write_all(&frame(&proto::connect_response(timeout, session, &secret.password()))).await.is_err() {
        return;
    }
    let (out, mut outbox) = mpsc::channel::<Out>(OUTBOX);
    if let Ok(mut conns) = shared.conns.lock() {
        if let Some(old) = conns.insert(session, Conn { peer, out: out.clone(), timeout }) {
            let _ = old.out.try_send(Out::Close);
        }
    }
    // Not heard yet: a session is touched only once its client spoke after the
    // handshake, which shows it received the new password (the touch retires the old
    // one; see `session_key`).
    let writer_shared = shared.clone();
    let stall = Duration::from_millis(timeout as u64);
    let writer = tokio::spawn(async move {
        let mut order = Outbox::default();
        let mut buf = Vec::new();
        'writing: while let Some(o) = outbox.recv().await {
            // Everything the connection has queued goes in one write: one syscall for a
            // run of replies instead of one per frame (on loopback a send also runs the
            // receiver's TCP path, so per-frame writes were a third of a node's CPU
            // under quorum reads).
            let (mut next, mut frames, mut open) = (Some(o), 0u64, true);
            while let Some(o) = next.take() {
                let Some(bodies) = order.next(o) else {
                    open = false;
                    break;
                };
                for body in bodies {
                    push_frame(&mut buf, &body);
                    frames += 1;
                }
                if buf.len() < WRITE_COALESCE_MAX {
                    next = outbox.try_recv().ok();
                }
            }
            if !buf.is_empty() {
                match tokio::time::timeout(stall, write.write_all(&buf)).await {
                    Ok(Ok(())) => {
                        writer_shared.stats.sent.fetch_add(frames, Ordering::Relaxed);
                    }
                    Ok(Err(_)) => break 'writing,
                    Err(_) => {
                        writer_shared.stats.stalled.fetch_add(1, Ordering::Relaxed);
                        tracing::info!(session, "ZooKeeper client does not read its replies; closing");
                        break 'writing;
                    }
                }
                buf.clear();
                // A burst of large replies should not pin its buffer for the connection's life.
                buf.shrink_to(WRITE_KEPT_MAX);
            }
            if !open {
                break;
            }
        }
        let _ = write.shutdown().await;
    });
    // Local reads see at least the session's creation (or its move here) and what the
    // client saw before.
    let floor = zxid.max(connect.last_zxid_seen);
    let reason = requests(&shared, &mut read, session, timeout, floor, &out).await;
    tracing::debug!(session, %peer, reason, "ZooKeeper connection ends");
    let _ = out.send(Out::Close).await;
    if let Ok(mut conns) = shared.conns.lock() {
        if conns.get(&session).is_some_and(|c| c.out.same_channel(&out)) {
            conns.remove(&session);
        }
    }
    let _ = writer.await;
}

fn malformed(shared: &Shared, peer: SocketAddr, why: &str) {
    shared.stats.malformed.fetch_add(1, Ordering::Relaxed);
    tracing::info!(%peer, why, "ZooKeeper connection closed: malformed input");
}

/// What the reader hands the processor, in the connection's order.
enum Item {
    /// A request for the cluster: its xid, the request, its frame's size.
    Op(i32, Request, usize),
    /// A reply the front end gives by itself (an unimplemented opcode), in its turn.
    Local(Vec<u8>),
    Close(i32),
    Auth(String, Vec<u8>),
}

/// Most requests of one connection read ahead of the one being answered.
const READ_AHEAD: usize = 256;
/// Most requests (and request bytes) in one ordered batch.
const BATCH_MAX: usize = 64;
const BATCH_BYTES_MAX: usize = 256 * 1024;

/// A connection after its handshake: a reader that parses frames (and answers pings at
/// once: their replies carry no order) and a processor that answers requests in order,
/// pipelined: consecutive writes go to the cluster as one ordered batch, executed in
/// order in one step; consecutive reads go out at once. A read waits for the writes
/// before it and a write for the reads before it, so each sees exactly what ZooKeeper's
/// in-order processing would show it. With quorum reads, the reads right after a run of
/// writes ride in the writes' ordered batch: executed after them in the same step, they
/// see them, and they are answered with them instead of a read round later. So do the
/// reads queued right before a write: executed before it, they do not see it, and they
/// cost no read round before the ordered one (session 41: 90/10 at 16 x 16, 1.23x).
async fn requests(
    shared: &Arc<Shared>,
    read: &mut ReadHalf,
    session: i64,
    timeout: i32,
    floor: i64,
    out: &mpsc::Sender<Out>,
) -> &'static str {
    let (items, mut queue) = mpsc::channel::<Item>(READ_AHEAD);
    let reader = read_requests(shared, read, session, timeout, out, items);
    let processor = async {
        let mut pending: std::collections::VecDeque<Item> = std::collections::VecDeque::new();
        // The last transaction this connection's reads must see (its own last write).
        let mut floor = floor;
        // Whether the session may hold a watch: only then can events race its replies
        // (a session that moved here may hold some until its setWatches says).
        let mut watching = false;
        loop {
            if pending.is_empty() {
                match queue.recv().await {
                    Some(item) => pending.push_back(item),
                    None => return "reader ended",
                }
            }
            while pending.len() < READ_AHEAD {
                match queue.try_recv() {
                    Ok(item) => pending.push_back(item),
                    Err(_) => break,
                }
            }
            let Some(item) = pending.pop_front() else { continue };
            match item {
                Item::Local(frame) => {
                    if out.send(Out::Frame(frame)).await.is_err() {
                        return "writer gone";
                    }
                }
                Item::Close(xid) => {
                    let zxid = match shared.call(&Command::Close { session }, false).await {
                        Some(Reply::Op { zxid, .. }) => zxid,
                        _ => shared.zxid.load(Ordering::Relaxed),
                    };
                    shared.saw(zxid);
                    let _ = out.send(Out::Frame(header(xid, zxid, err::OK))).await;
                    return "closeSession";
                }
                Item::Auth(scheme, auth) => {
                    let e = match shared.call(&Command::Auth { session, scheme, auth }, false).await {
                        Some(Reply::Op { err, .. }) | Some(Reply::Refused { err }) => err,
                        _ => return "the cluster did not answer",
                    };
                    let _ = out.send(Out::Frame(header(xid::AUTH, shared.zxid.load(Ordering::Relaxed), e))).await;
                    if e != err::OK {
                        return "authentication failed";
                    }
                }
                Item::Op(xid, request, size) => {
                    watching |= request.sets_watch();
                    // With quorum reads, reads with a write queued right behind them
                    // go in its ordered command (`leads`): one round of the cluster
                    // instead of a read round and then an ordered one.
                    let leads = !request.writes() && shared.quorum_reads() && leads_writes(&pending, size);
                    let writes = request.writes() || leads;
                    let mut run = vec![(xid, request)];
                    let mut config_reads = Vec::new();
                    let mut bytes = size;
                    // The run of requests of the same kind that follows (an ordered read
                    // with a large reply goes alone), and with quorum reads the reads
                    // around a run of writes: those before it and those after it. A
                    // read the command has no room to answer is sent again after it,
                    // with everything after it (`write_batch`).
                    let alone = request_alone(&run[0].1);
                    let tail = writes && !alone && shared.quorum_reads();
                    // Past the run's writes (reads after them end the run at the next).
                    let mut wrote = run[0].1.writes();
                    let mut reading = false;
                    while run.len() < BATCH_MAX && !alone {
                        let Some(Item::Op(_, next, size)) = pending.front() else { break };
                        let fits = bytes + size <= BATCH_BYTES_MAX;
                        let takes = match (writes, next.writes()) {
                            (false, next_writes) => !next_writes,
                            (true, true) => !reading && fits && !request_alone(next),
                            (true, false) => tail && fits,
                        };
                        if !takes {
                            break;
                        }
                        wrote |= next.writes();
                        reading |= wrote && !next.writes();
                        bytes += size;
                        if let Some(Item::Op(x, r, _)) = pending.pop_front() {
                            watching |= r.sets_watch();
                            run.push((x, r));
                        }
                    }
                    if shared.pinned {
                        config_reads.extend(run.iter().filter(|(_, r)| r.reads_config()).cloned());
                    }
                    if watching && out.send(Out::Busy).await.is_err() {
                        return "writer gone";
                    }
                    let replies = if writes {
                        write_batch(shared, session, run, floor).await
                    } else {
                        reads(shared, session, run, floor).await
                    };
                    let Some(replies) = replies else { return "the cluster did not answer" };
                    if watching {
                        shared.route_accepted_events().await;
                    }
                    for (xid, reply) in replies {
                        let Reply::Op { zxid, err, body } = reply else { return "an answer it cannot read" };
                        shared.saw(zxid);
                        floor = floor.max(zxid);
                        let zxid = if zxid > 0 { zxid } else { shared.zxid.load(Ordering::Relaxed) };
                        let mut w = Writer::new();
                        proto::reply_header(&mut w, xid, zxid, err);
                        if err == err::OK {
                            match config_reads.iter().find(|(x, _)| *x == xid) {
                                Some((_, read)) => w.0.extend(shim_answer(read, &body, shared.listen).unwrap_or(body)),
                                None => w.0.extend(body),
                            }
                        }
                        if out.send(Out::Reply(zxid, w.into_bytes())).await.is_err() {
                            return "writer gone";
                        }
                        if err == err::SESSION_EXPIRED || err == err::SESSION_MOVED {
                            return "session expired or moved";
                        }
                    }
                    if watching && out.send(Out::Idle).await.is_err() {
                        return "writer gone";
                    }
                }
            }
        }
    };
    tokio::select! {
        why = reader => why,
        why = processor => why,
    }
}

/// Whether the reads at the head of a connection's queue (the first of them being
/// handled, `first` bytes) have an ordered request right behind them that can take
/// them into its command: within one command's bounds, and not one that goes alone.
fn leads_writes(pending: &std::collections::VecDeque<Item>, first: usize) -> bool {
    let mut bytes = first;
    for (count, item) in pending.iter().enumerate() {
        let Item::Op(_, next, size) = item else { return false };
        bytes += size;
        if count + 1 >= BATCH_MAX || bytes > BATCH_BYTES_MAX {
            return false;
        }
        if next.writes() {
            return !request_alone(next);
        }
    }
    false
}

/// An ordered request that goes in a command of its own: its reply may be large and,
/// unlike a plain read's, cannot be refused for room (it set a watch or wrote).
fn request_alone(request: &Request) -> bool {
    request.writes() && request.large_reply()
}

/// Writes (and watched reads, and the reads before and after them) in order, as one
/// ordered command, through the group committer. `alone`: in a command of its own.
async fn write_batch(
    shared: &Arc<Shared>,
    session: i64,
    run: Vec<(i32, Request)>,
    floor: i64,
) -> Option<Vec<(i32, Reply)>> {
    let alone = run.iter().any(|(_, r)| request_alone(r));
    ordered(shared, session, run, floor, alone).await
}

/// One ordered command of a session's run. The cluster refuses (`RETRY_ALONE`) a read
/// its reply has no room for, and everything after it in the command, unexecuted: the
/// rest goes again, in order, once this command is answered (a read alone when no
/// write follows it, else as a command of its own, whose first request always fits).
async fn ordered(
    shared: &Arc<Shared>,
    session: i64,
    run: Vec<(i32, Request)>,
    floor: i64,
    alone: bool,
) -> Option<Vec<(i32, Reply)>> {
    // Only a read is refused for room, and what follows it with it: kept to send again
    // is everything from the first read on (nothing of a run of writes alone).
    let first_read = run.iter().position(|(_, r)| !r.writes()).unwrap_or(run.len());
    let kept = run[first_read..].to_vec();
    let (xids, requests): (Vec<i32>, Vec<Request>) = run.into_iter().unzip();
    let command = Command::Ops { session, requests };
    let bytes = command.encode().len();
    let (done, reply) = oneshot::channel();
    shared.commits.send(Commit { command, bytes, alone, done }).await.ok()?;
    match reply.await.ok()?? {
        Reply::Ops(replies) if replies.len() == xids.len() => {
            let refused = |r: &Reply| matches!(r, Reply::Refused { err: crate::coord::RETRY_ALONE });
            let first = replies.iter().position(refused).unwrap_or(replies.len());
            // A write refused before any read: not an answer this front end asked for.
            let again = kept.get(first.checked_sub(first_read)?..).unwrap_or_default().to_vec();
            let mut answers: Vec<(i32, Reply)> = xids.into_iter().zip(replies).take(first).collect();
            if again.iter().any(|(_, r)| r.writes()) {
                answers.extend(Box::pin(ordered(shared, session, again, floor, true)).await?);
            } else {
                // Reads only: nothing of this session was written after them, so each
                // sees the same writes of its own session alone.
                for read in again {
                    answers.push(reads(shared, session, vec![read], floor).await?.pop()?);
                }
            }
            Some(answers)
        }
        Reply::Op { zxid, err, body } => {
            // The batch as a whole was refused (session expired or moved).
            Some(xids.into_iter().map(|x| (x, Reply::Op { zxid, err, body: body.clone() })).collect())
        }
        _ => None,
    }
}

/// A command for the group committer, and where its reply goes.
struct Commit {
    command: Command,
    bytes: usize,
    /// Sent as a command of its own (a large reply).
    alone: bool,
    done: oneshot::Sender<Option<Reply>>,
}

/// Batches of commands in flight at once.
const COMMITS_IN_FLIGHT: usize = 4;

/// Group commit: the ordered commands of all connections, gathered into one
/// `Command::Batch` while earlier batches are in flight (at most `COMMITS_IN_FLIGHT`),
/// so the cluster orders one operation for many writes. A connection sends its next
/// command only after the reply of its last, so each session's order is kept.
async fn commit(shared: Arc<Shared>, mut queue: mpsc::Receiver<Commit>) {
    let permits = Arc::new(tokio::sync::Semaphore::new(COMMITS_IN_FLIGHT));
    let mut carried: Option<Commit> = None;
    loop {
        let Ok(permit) = permits.clone().acquire_owned().await else { return };
        let first = match carried.take() {
            Some(c) => c,
            None => match queue.recv().await {
                Some(c) => c,
                None => return,
            },
        };
        let mut batch = vec![first];
        let mut bytes = batch[0].bytes;
        while !batch[0].alone && batch.len() < BATCH_MAX * 4 {
            match queue.try_recv() {
                Ok(c) if c.alone || bytes + c.bytes > BATCH_BYTES_MAX => {
                    carried = Some(c);
                    break;
                }
                Ok(c) => {
                    bytes += c.bytes;
                    batch.push(c);
                }
                Err(_) => break,
            }
        }
        let shared = shared.clone();
        shared.stats.commits.fetch_add(1, Ordering::Relaxed);
        shared.stats.committed.fetch_add(batch.len() as u64, Ordering::Relaxed);
        tokio::spawn(async move {
            let _permit = permit;
            if batch.len() == 1 {
                let Some(c) = batch.pop() else { return };
                let _ = c.done.send(shared.call(&c.command, false).await);
                return;
            }
            let (commands, dones): (Vec<Command>, Vec<_>) = batch.into_iter().map(|c| (c.command, c.done)).unzip();
            match shared.call(&Command::Batch(commands), false).await {
                Some(Reply::Batch(replies)) if replies.len() == dones.len() => {
                    for (done, reply) in dones.into_iter().zip(replies) {
                        let _ = done.send(Some(reply));
                    }
                }
                _ => {
                    for done in dones {
                        let _ = done.send(None);
                    }
                }
            }
        });
    }
}

/// Reads, all at once; answers in their order. With local reads, from this node's
/// state once it holds transaction `floor`.
async fn reads(shared: &Arc<Shared>, session: i64, run: Vec<(i32, Request)>, floor: i64) -> Option<Vec<(i32, Reply)>> {
    if let (Some(local), Reads::Local) = (&shared.local, shared.options.reads) {
        if !local.wait_for(floor, shared.options.op_timeout).await {
            tracing::warn!(session, floor, "this node did not execute the client's last write in time");
            return None;
        }
        let me = shared.client.id();
        return run.into_iter().map(|(xid, request)| Some((xid, local.read(session, me, request)?))).collect();
    }
    // Through the read batcher, all at once; each answer awaited in order.
    let mut waiting = Vec::with_capacity(run.len());
    for (xid, request) in run {
        let (done, reply) = oneshot::channel();
        shared.reads.send(ReadJob { session, request, done }).await.ok()?;
        waiting.push((xid, reply));
    }
    let mut replies = Vec::with_capacity(waiting.len());
    for (xid, reply) in waiting {
        replies.push((xid, reply.await.ok()??));
    }
    Some(replies)
}

/// A quorum read for the read batcher, and where its reply goes.
struct ReadJob {
    session: i64,
    request: Request,
    done: oneshot::Sender<Option<Reply>>,
}

/// Read batches in flight at once.
const READS_IN_FLIGHT: usize = 8;
/// Most reads in one batch.
const READ_BATCH_MAX: usize = 64;

/// Quorum reads of all connections, gathered into one read-only `Command::Batch` while
/// earlier batches are in flight: one read-only round of the cluster for many reads. A
/// batch whose answers do not match is ordered whole by the client library (correct,
/// slower). A read the batch had no room to answer (`RETRY_ALONE`) goes again alone.
async fn batch_reads(shared: Arc<Shared>, mut queue: mpsc::Receiver<ReadJob>) {
    let permits = Arc::new(tokio::sync::Semaphore::new(READS_IN_FLIGHT));
    loop {
        let Ok(permit) = permits.clone().acquire_owned().await else { return };
        let Some(first) = queue.recv().await else { return };
        let mut batch = vec![first];
        while batch.len() < READ_BATCH_MAX {
            match queue.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        let shared = shared.clone();
        tokio::spawn(async move {
            let _permit = permit;
            if batch.len() == 1 {
                let Some(job) = batch.pop() else { return };
                let reply = shared.call(&Command::Op { session: job.session, request: job.request }, true).await;
                let _ = job.done.send(reply);
                return;
            }
            let (commands, rest): (Vec<Command>, Vec<_>) = batch
                .into_iter()
                .map(|j| {
                    (Command::Op { session: j.session, request: j.request.clone() }, (j.session, j.request, j.done))
                })
                .unzip();
            let replies = match shared.call(&Command::Batch(commands), true).await {
                Some(Reply::Batch(replies)) if replies.len() == rest.len() => replies,
                _ => {
                    for (_, _, done) in rest {
                        let _ = done.send(None);
                    }
                    return;
                }
            };
            for (reply, (session, request, done)) in replies.into_iter().zip(rest) {
                let reply = match reply {
                    Reply::Refused { err: crate::coord::RETRY_ALONE } => {
                        shared.call(&Command::Op { session, request }, true).await
                    }
                    r => Some(r),
                };
                let _ = done.send(reply);
            }
        });
    }
}

/// Whether a command can carry `request` (`wire` bytes in its frame) to the cluster: a
/// request just under ZooKeeper's 1 MiB frame limit can exceed Keel's bound on one
/// operation once wrapped. Such a request gets BADARGUMENTS and the connection stays;
/// sent, the cluster would refuse it and the client would retry it without end.
fn orderable(session: i64, request: &Request, wire: usize) -> bool {
    // A command's encoding is about the request's jute bytes (varint lengths instead of
    // four-byte ones) plus a few bytes of framing; room for a batch around it too.
    const SLACK: usize = 64;
    if wire + 64 * SLACK <= keel_core::codec::OP_BYTES_MAX {
        return true;
    }
    let command = Command::Ops { session, requests: vec![request.clone()] };
    command.encode().len() + SLACK <= keel_core::codec::OP_BYTES_MAX
}

/// Reads frames until the connection ends; returns why.
async fn read_requests(
    shared: &Shared,
    read: &mut ReadHalf,
    session: i64,
    timeout: i32,
    out: &mpsc::Sender<Out>,
    items: mpsc::Sender<Item>,
) -> &'static str {
    // The client pings every third of the timeout; silence for a whole timeout ends
    // the connection (ZooKeeper's server does the same).
    let silence = Duration::from_millis(timeout as u64);
    loop {
        let body = match tokio::time::timeout(silence, read_frame(read, None)).await {
            Err(_) => return "silent for a session timeout",
            Ok(Err(e)) if e.contains("outside") => {
                malformed(shared, shared.listen, &e);
                return "oversized frame";
            }
            Ok(Err(_)) => return "closed",
            Ok(Ok(b)) => b,
        };
        shared.stats.received.fetch_add(1, Ordering::Relaxed);
        shared.heard(session, timeout);
        let zxid = || shared.zxid.load(Ordering::Relaxed);
        let item = match incoming(session, &body) {
            Incoming::Ping => {
                if out.send(Out::Frame(header(xid::PING, zxid(), err::OK))).await.is_err() {
                    return "writer gone";
                }
                continue;
            }
            Incoming::Close(xid) => Item::Close(xid),
            Incoming::Auth(scheme, auth) => Item::Auth(scheme, auth),
            Incoming::Request(xid, request, size) => Item::Op(xid, request, size),
            Incoming::Unimplemented(xid) => Item::Local(header(xid, zxid(), err::UNIMPLEMENTED)),
            Incoming::TooLarge(xid) => {
                shared.stats.too_large.fetch_add(1, Ordering::Relaxed);
                tracing::info!(session, bytes = body.len(), "ZooKeeper request too large for one command");
                Item::Local(header(xid, zxid(), err::BAD_ARGUMENTS))
            }
            Incoming::Malformed(why) => {
                malformed(shared, shared.listen, &why);
                return "malformed input";
            }
        };
        let last = matches!(item, Item::Close(_));
        if items.send(item).await.is_err() {
            return "processor ended";
        }
        if last {
            // Nothing after closeSession counts; the processor answers it and ends.
            return std::future::pending().await;
        }
    }
}

fn header(xid: i32, zxid: i64, e: i32) -> Vec<u8> {
    let mut w = Writer::new();
    proto::reply_header(&mut w, xid, zxid, e);
    w.into_bytes()
}

/// ZooKeeper's four-letter words, sent instead of a frame length.
fn four_letter_word(shared: &Shared, first: &[u8; 4]) -> Option<String> {
    let word = std::str::from_utf8(first).ok()?;
    let s = &shared.stats;
    let conns = shared.conns.lock().map(|c| c.len()).unwrap_or(0);
    let zxid = shared.zxid.load(Ordering::Relaxed);
    let version = format!("{}-keel-{}", crate::ZOOKEEPER_VERSION, env!("CARGO_PKG_VERSION"));
    let answer = match word {
        "ruok" => "imok".to_string(),
        "srvr" | "stat" => {
            let mut text = format!(
                "Zookeeper version: {version}\nLatency min/avg/max: 0/0/0\nReceived: {}\nSent: {}\nConnections: {conns}\nOutstanding: 0\nZxid: 0x{zxid:x}\nMode: keel ({})\n",
                s.received.load(Ordering::Relaxed),
                s.sent.load(Ordering::Relaxed),
                shared.label,
            );
            if word == "stat" {
                text = format!("{text}Clients:\n{}", connection_list(shared));
            }
            text
        }
        "envi" => format!("Environment:\nzookeeper.version={version}\nhost.name={}\n", shared.listen.ip()),
        "conf" => format!(
            "clientPort={}\nclientPortAddress={}\nminSessionTimeout={SESSION_TIMEOUT_MIN}\nmaxSessionTimeout={SESSION_TIMEOUT_MAX}\nserver={}\n",
            shared.listen.port(),
            shared.listen.ip(),
            shared.label
        ),
        "mntr" => format!(
            "zk_version\t{version}\nzk_server_state\tkeel\nzk_packets_received\t{}\nzk_packets_sent\t{}\nzk_num_alive_connections\t{conns}\nzk_connections_accepted\t{}\nzk_malformed_dropped\t{}\nzk_stalled_dropped\t{}\nzk_too_large_requests\t{}\nzk_refused_connections\t{}\nzk_ordered_operations\t{}\nzk_ordered_commands\t{}\nzk_last_zxid\t{zxid}\n",
            s.received.load(Ordering::Relaxed),
            s.sent.load(Ordering::Relaxed),
            s.connections.load(Ordering::Relaxed),
            s.malformed.load(Ordering::Relaxed),
            s.stalled.load(Ordering::Relaxed),
            s.too_large.load(Ordering::Relaxed),
            s.refused.load(Ordering::Relaxed),
            s.commits.load(Ordering::Relaxed),
            s.committed.load(Ordering::Relaxed),
        ),
        "cons" => connection_list(shared),
        _ => return None,
    };
    Some(answer)
}

fn connection_list(shared: &Shared) -> String {
    let conns = shared.conns.lock().map(|c| c.iter().map(|(s, c)| (*s, c.peer, c.timeout)).collect::<Vec<_>>());
    conns
        .unwrap_or_default()
        .into_iter()
        .map(|(session, peer, timeout)| format!(" /{peer}[1](sid=0x{session:x},to={timeout})\n"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(pairs: &[(&str, &str)]) -> std::collections::BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn written(outbox: &mut Outbox, o: Out) -> Vec<String> {
        let frames = outbox.next(o).expect("stays open");
        frames.into_iter().map(|f| String::from_utf8(f).expect("text")).collect()
    }

    fn f(s: &str) -> Vec<u8> {
        s.as_bytes().to_vec()
    }

    #[test]
    fn a_watch_event_waits_for_the_replies_executed_before_its_change() {
        let mut o = Outbox::default();
        // Nothing out: an event goes at once.
        assert_eq!(written(&mut o, Out::Event(5, f("e5"))), ["e5"]);
        // A watched read is out when the change at zxid 12 fires its watch: the event
        // waits for the read's reply (executed at 11), or the client would drop it.
        assert!(written(&mut o, Out::Busy).is_empty());
        assert!(written(&mut o, Out::Event(12, f("e12"))).is_empty());
        assert!(written(&mut o, Out::Event(14, f("e14"))).is_empty());
        assert_eq!(written(&mut o, Out::Reply(11, f("r11"))), ["r11"]);
        // A reply executed at or after an event's change comes after it, as in ZooKeeper.
        assert_eq!(written(&mut o, Out::Reply(12, f("r12"))), ["e12", "r12"]);
        assert_eq!(written(&mut o, Out::Frame(f("pong"))), ["pong"]);
        assert_eq!(written(&mut o, Out::Idle), ["e14"]);
        assert_eq!(written(&mut o, Out::Event(20, f("e20"))), ["e20"]);
        // Held back without end, the connection closes (its client re-syncs).
        written(&mut o, Out::Busy);
        for z in 0..HELD_EVENTS_MAX as i64 {
            assert!(written(&mut o, Out::Event(30 + z, f("e"))).is_empty());
        }
        assert!(o.next(Out::Event(1 << 40, f("e"))).is_none());
        assert!(Outbox::default().next(Out::Close).is_none());
    }

    #[test]
    fn a_shim_names_itself_as_the_only_server_in_zookeeper_config() {
        let nodes = "server.0=127.0.0.1:21000:21004:participant;127.0.0.1:21008\n\
                     server.1=127.0.0.1:21001:21005:participant;127.0.0.1:21009\nversion=1a";
        let stat = proto::Stat { data_length: nodes.len() as i32, version: 3, ..Default::default() };
        let mut w = Writer::new();
        w.buffer(nodes.as_bytes());
        stat.write(&mut w);
        let shim: SocketAddr = "127.0.0.1:2181".parse().expect("address");
        let body = shim_config(&w.into_bytes(), shim).expect("a getData reply");
        let mut r = Reader::new(&body);
        let text = String::from_utf8(r.buffer().expect("data")).expect("text");
        let back = proto::Stat::read(&mut r).expect("stat");
        assert_eq!(text, "server.0=127.0.0.1:2181:2182:participant;127.0.0.1:2181\nversion=1a");
        assert_eq!((back.data_length, back.version), (text.len() as i32, 3));
        assert!(shim_config(b"\x00", shim).is_none(), "not a getData reply: left alone");
    }

    #[test]
    fn a_shim_rewrites_the_config_inside_a_multi_read_and_nothing_else() {
        let config = "server.0=127.0.0.1:21000:21004:participant;127.0.0.1:21008\nversion=2";
        let get = |path: &str| Request::GetData { path: path.into(), watch: false };
        let ops = vec![
            get("/a"),
            get(proto::CONFIG_PATH),
            get("/gone"),
            Request::GetChildren { path: "/".into(), watch: false, two: false },
        ];
        let mut w = Writer::new();
        w.int(op::GET_DATA).bool(false).int(err::OK).buffer(b"data of a");
        proto::Stat::default().write(&mut w);
        w.int(op::GET_DATA).bool(false).int(err::OK).buffer(config.as_bytes());
        proto::Stat { data_length: config.len() as i32, ..Default::default() }.write(&mut w);
        w.int(op::ERROR).bool(false).int(err::NO_NODE).int(err::NO_NODE);
        w.int(op::GET_CHILDREN).bool(false).int(err::OK).strings(&["a".to_string(), "zookeeper".to_string()]);
        w.int(-1).bool(true).int(-1);
        let body = w.into_bytes();
        let shim: SocketAddr = "127.0.0.1:2181".parse().expect("address");
        let read = Request::MultiRead(ops.clone());
        assert!(read.reads_config());
        let answer = shim_answer(&read, &body, shim).expect("walked");
        let mut r = Reader::new(&answer);
        let header = |r: &mut Reader| (r.int().expect("type"), r.bool().expect("done"), r.int().expect("err"));
        assert_eq!(header(&mut r), (op::GET_DATA, false, err::OK));
        assert_eq!(r.buffer().expect("data"), b"data of a");
        proto::Stat::read(&mut r).expect("stat");
        assert_eq!(header(&mut r), (op::GET_DATA, false, err::OK));
        let text = String::from_utf8(r.buffer().expect("config")).expect("text");
        assert_eq!(text, "server.0=127.0.0.1:2181:2182:participant;127.0.0.1:2181\nversion=2");
        assert_eq!(proto::Stat::read(&mut r).expect("stat").data_length, text.len() as i32);
        assert_eq!(header(&mut r), (op::ERROR, false, err::NO_NODE));
        assert_eq!(r.int().expect("error"), err::NO_NODE);
        assert_eq!(header(&mut r), (op::GET_CHILDREN, false, err::OK));
        assert_eq!(r.strings().expect("children"), ["a", "zookeeper"]);
        assert_eq!(header(&mut r), (-1, true, -1));
        assert_eq!(r.remaining(), 0);
        // A multiRead without the config is not the shim's business; a body that does
        // not walk is left alone.
        assert!(!Request::MultiRead(vec![get("/a")]).reads_config());
        assert!(shim_answer(&read, &body[..body.len() - 20], shim).is_none());
    }

    #[test]
    fn front_end_options_parse_and_refuse_what_they_do_not_know() {
        let o = Options::from_settings(&settings(&[])).expect("defaults");
        assert_eq!((o.reads, o.max_client_cnxns), (Reads::Quorum, MAX_CLIENT_CNXNS_DEFAULT));
        let o = Options::from_settings(&settings(&[("reads", "local"), ("max_client_cnxns", "0")])).expect("ok");
        assert_eq!((o.reads, o.max_client_cnxns), (Reads::Local, 0));
        for bad in [[("reads", "fast")], [("max_client_cnxns", "-1")], [("maxClientCnxns", "5")]] {
            assert!(Options::from_settings(&settings(&bad)).is_err(), "{bad:?} accepted");
        }
    }
}
