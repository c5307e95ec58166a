//! The client library: connect from a client file, invoke operations, get results that
//! r + 1 nodes vouch for.
//!
//! ```text
//!  invoke() ──► bounded call queue ──► dispatcher task: a free session takes the call
//!               (sessions: protocol clients sharing this identity's connections, each
//!                with one request in flight; message::session_id)
//!  node connections (driven by the dispatcher itself: links.rs)
//!                   ──► replies, routed to their session by Reply::client ──► result
//!                   ──► push events, gathered per session (r + 1 alike, in order, gaps
//!                       reported) ──► KeelClient::push_events()
//! ```
//!
//! A [`KeelClient`] is a cheap handle: clone it into as many tasks as you like; up to
//! `sessions` operations are in flight at once and the rest wait their turn. All
//! sessions' frames to a node share one TLS connection, so a burst of requests costs one
//! write per node rather than one per request.

use crate::config::ClientSetup;
use crate::links::Links;
use crate::metrics::ClientMetrics;
use crate::node::now_ms;
use crate::tls::{self, PeerId, TlsError};
use crate::transport::TransportStats;
use keel_core::client::{Client, ClientError, Pushed};
use keel_core::codec;
use keel_core::ids::NodeRange;
use keel_core::membership::Membership;
use keel_core::message::{session_id, session_of, ClientId, Message, NodeId, ReadConsistency, Reply, SESSIONS_MAX};
use keel_core::replica::session_mac_key;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::{mpsc, oneshot};
use tokio_rustls::TlsConnector;

/// Calls waiting for a free session.
const CALL_QUEUE_MAX: usize = 4096;
/// Push events waiting for the application (beyond it they are dropped and the
/// application is told of a gap).
const PUSH_QUEUE_MAX: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum InvokeError {
    /// No result in time; `unreachable` names each node the client had no connection to
    /// at that moment and why ("node 2 (127.0.0.1:7102: Connection refused)"), `reached`
    /// the nodes it was connected to.
    #[error("no result within {after:?}; {}", reach_summary(unreachable, reached))]
    Timeout { after: Duration, unreachable: Vec<String>, reached: Vec<NodeId> },
    #[error("{0}")]
    Client(#[from] ClientError),
    #[error("connection setup: {0}")]
    Tls(#[from] TlsError),
    #[error("sessions must be between 1 and {SESSIONS_MAX}, not {0}")]
    Sessions(usize),
    #[error("the client is shut down")]
    Closed,
}

fn reach_summary(unreachable: &[String], reached: &[NodeId]) -> String {
    let reached = reached.iter().map(|n| format!("node {n}")).collect::<Vec<_>>().join(", ");
    match (unreachable.is_empty(), reached.is_empty()) {
        (true, _) => {
            format!("connected to every node ({reached}): they did not answer in time or not enough of them agreed")
        }
        (false, true) => format!("could not reach any node: {}", unreachable.join("; ")),
        (false, false) => format!("could not reach {}; connected to {reached}", unreachable.join("; ")),
    }
}

struct Call {
    op: Vec<u8>,
    /// Some: a read-only operation with this consistency.
    read: Option<ReadConsistency>,
    timeout: Duration,
    done: Done,
}

/// Push events with the session each is for (see [`KeelClient::push_events`]).
pub type PushReceiver = mpsc::Receiver<(ClientId, Pushed)>;

/// A handle to a connected client identity. Clones share the connections and sessions.
#[derive(Clone)]
pub struct KeelClient {
    id: ClientId,
    /// The membership epoch the client's sessions are in.
    epoch: Arc<std::sync::atomic::AtomicU64>,
    metrics: Arc<ClientMetrics>,
    calls: mpsc::Sender<Call>,
    /// Push events for this identity's sessions, until someone takes them.
    pushes: Arc<std::sync::Mutex<Option<PushReceiver>>>,
    pub stats: Arc<TransportStats>,
    /// The sequence number this handle's sessions started from.
    first_seq: u64,
    /// Messages outside the request/reply exchange ([`KeelClient::side_channel`]), and
    /// whether someone took it (until then what would go there is dropped: a node
    /// cannot fill an ordinary client's memory with chunks).
    side: Arc<std::sync::Mutex<Option<SideChannel>>>,
    side_open: Arc<std::sync::atomic::AtomicBool>,
}

/// Messages to nodes by stable id, and what nodes send back outside replies and push
/// events: checkpoint certificates, manifests and chunks (served to the administrator
/// only: `keel admin backup`), and the epoch certificates this client follows. Over the
/// client's own connections: nodes route by identity, so a second connection of the
/// same identity would take the other's replies.
pub struct SideChannel {
    pub send: mpsc::Sender<(NodeId, Message)>,
    pub receive: mpsc::Receiver<(NodeId, Message)>,
}

/// Side-channel messages either way that may wait: a backup asks for 16 chunks at a
/// time, and a node flooding chunks nobody asked for fills this and no more (the rest
/// are dropped and counted; the fetch asks again elsewhere).
const SIDE_QUEUE_MAX: usize = 64;

impl KeelClient {
    /// Connects (in the background, with retries) to every node, with one session: one
    /// operation in flight at a time.
    ///
    /// # Errors
    /// A bad certificate or key in the client files.
    pub fn connect(setup: ClientSetup) -> Result<KeelClient, InvokeError> {
        KeelClient::connect_sessions(setup, 1)
    }

    /// Connects with `sessions` protocol clients, so that many operations (from clones
    /// of the handle in different tasks) can be in flight at once.
    ///
    /// # Errors
    /// A bad certificate or key in the client files, or `sessions` outside
    /// `1..=SESSIONS_MAX`.
    pub fn connect_sessions(setup: ClientSetup, sessions: usize) -> Result<KeelClient, InvokeError> {
        if sessions == 0 || sessions as u64 > SESSIONS_MAX {
            return Err(InvokeError::Sessions(sessions));
        }
        let connector = TlsConnector::from(tls::client_config(&setup.ca_pem, &setup.credentials)?);
        let stats = Arc::new(TransportStats::default());
        let (side_in_tx, side_in_rx) = mpsc::channel::<(NodeId, Message)>(SIDE_QUEUE_MAX);
        let (side_out_tx, side_out_rx) = mpsc::channel::<(NodeId, Message)>(SIDE_QUEUE_MAX);
        let side_open = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut nodes = Nodes {
            links: Links::new(connector, stats.clone()),
            side_tx: side_in_tx,
            side_open: side_open.clone(),
            stats: stats.clone(),
        };
        nodes.follow(&setup.membership);
        // Stages apart: the execution nodes answer, the RQ nodes take requests.
        for (id, addr) in setup.executors.iter().chain(&setup.rq_nodes) {
            nodes.connect(*id, *addr);
        }
        let range = |nodes: &[(NodeId, std::net::SocketAddr)]| match (nodes.first(), nodes.last()) {
            (Some((first, _)), Some((last, _))) => Some(NodeRange::from(first.0..last.0 + 1)),
            _ => None,
        };
        let (executors, rq_nodes) = (range(&setup.executors), range(&setup.rq_nodes));
        // Sequence numbers continue above any this identity used before (a restarted
        // process): the executor ignores sequence numbers it has already passed.
        let first_seq = SystemTime::now().duration_since(UNIX_EPOCH).map_or(1, |d| d.as_micros() as u64);
        let sessions: Vec<Session> = (0..sessions as u64)
            .map(|s| {
                let keys = setup.mac_keys.iter().map(|k| session_mac_key(k, s)).collect();
                Session {
                    core: {
                        let core =
                            Client::new(session_id(setup.id, s), setup.quorums, keys, setup.retransmit_ms, first_seq)
                                .with_auth(setup.auth)
                                .with_membership(setup.membership.clone());
                        let core = match &executors {
                            Some(e) => core.with_executors(e.clone()),
                            None => core,
                        };
                        let core = match &rq_nodes {
                            Some(q) => core.with_rq_nodes(q.clone()),
                            None => core,
                        };
                        match &setup.signing {
                            Some(key) => core.with_signing_key(key.clone()),
                            None => core,
                        }
                    },
                    call: None,
                    started: (Instant::now(), "ordered"),
                }
            })
            .collect();
        // Start in the newest epoch this cluster's clients followed (checked like any
        // certificates from the network; what does not follow is ignored).
        let mut sessions = sessions;
        if let Some(certs) = setup.epochs_dir.as_deref().and_then(crate::epochs::load) {
            // One at a time, oldest first: a bad one stops the walk there, and what came
            // before it still counts.
            for cert in certs {
                for s in &mut sessions {
                    s.core.on_epoch_certs(vec![cert.clone()]);
                }
            }
            if let Some(s) = sessions.first() {
                nodes.follow(s.core.membership());
            }
        }
        let epoch =
            Arc::new(std::sync::atomic::AtomicU64::new(sessions.first().map_or(0, |s| s.core.membership().epoch)));
        let (calls, call_rx) = mpsc::channel(CALL_QUEUE_MAX);
        let (push_tx, push_rx) = mpsc::channel(PUSH_QUEUE_MAX);
        let metrics = Arc::new(ClientMetrics::new());
        let dispatcher = Dispatcher {
            epoch: epoch.clone(),
            epochs_dir: setup.epochs_dir.clone(),
            metrics: metrics.clone(),
            free: (0..sessions.len()).rev().collect(),
            sessions,
            nodes,
            pushes: push_tx,
            push_overflow: std::collections::BTreeMap::new(),
            // A few ticks per retransmission period, and no coarser than 100 ms (epoch
            // queries and push gaps are checked on ticks too).
            tick: Duration::from_millis((setup.retransmit_ms / 5).clamp(1, 100)),
        };
        tokio::spawn(dispatcher.run(call_rx, side_out_rx));
        let pushes = Arc::new(std::sync::Mutex::new(Some(push_rx)));
        let side = Arc::new(std::sync::Mutex::new(Some(SideChannel { send: side_out_tx, receive: side_in_rx })));
        Ok(KeelClient { id: setup.id, epoch, metrics, calls, pushes, stats, first_seq, side, side_open })
    }

    pub fn id(&self) -> ClientId {
        self.id
    }

    /// The lowest sequence number this handle's operations carry (every session's start
    /// above any number the identity used before): a state whose reply cache holds a
    /// sequence number at least this high for one of its sessions has executed one of
    /// its operations.
    pub fn first_seq(&self) -> u64 {
        self.first_seq
    }

    /// The membership epoch this client is in: the cluster file's (0), or a later one it
    /// followed, from the nodes or from what an earlier client kept beside the cluster
    /// file.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// This client's latency histograms and failure counters (shared by every clone).
    pub fn metrics(&self) -> Arc<ClientMetrics> {
        self.metrics.clone()
    }

    /// The push events the service sends this identity's sessions (for KV: watch events),
    /// each with the session it is for, in order per session; `Pushed::Gap` where events
    /// were lost (nodes dropped them, or this receiver fell more than 4096 behind). The
    /// first call takes the receiver; later calls get None.
    pub fn push_events(&self) -> Option<PushReceiver> {
        self.pushes.lock().ok()?.take()
    }

    /// The [`SideChannel`]; the first call takes it, later calls get None.
    pub fn side_channel(&self) -> Option<SideChannel> {
        let taken = self.side.lock().ok()?.take();
        if taken.is_some() {
            self.side_open.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        taken
    }

    /// Runs one operation through the replicated service.
    ///
    /// # Errors
    /// `Timeout` if r + 1 matching results did not arrive in time (the operation may still
    /// execute later); `Client` for an operation over the size bound.
    pub async fn invoke(&self, op: Vec<u8>, timeout: Duration) -> Result<Vec<u8>, InvokeError> {
        self.invoke_as(op, None, timeout).await
    }

    /// Runs a read-only operation without ordering it (ARCHITECTURE §7): every node (or
    /// for [`ReadConsistency::Index`], r + 1 of them) answers from its state, and the
    /// result stands once enough answers match ([`ReadConsistency`]). If they do not match, or the service says `op` is not
    /// read-only, the operation is ordered instead, within the same `timeout`.
    ///
    /// # Errors
    /// As [`KeelClient::invoke`].
    pub async fn invoke_read_only(
        &self,
        op: Vec<u8>,
        consistency: ReadConsistency,
        timeout: Duration,
    ) -> Result<Vec<u8>, InvokeError> {
        self.invoke_as(op, Some(consistency), timeout).await
    }

    /// [`KeelClient::invoke`] (`read` None) or [`KeelClient::invoke_read_only`], for
    /// callers that choose per operation.
    ///
    /// # Errors
    /// As [`KeelClient::invoke`].
    pub async fn invoke_as(
        &self,
        op: Vec<u8>,
        read: Option<ReadConsistency>,
        timeout: Duration,
    ) -> Result<Vec<u8>, InvokeError> {
        let (done, result) = oneshot::channel();
        self.calls.send(Call { op, read, timeout, done }).await.map_err(|_| InvokeError::Closed)?;
        result.await.map_err(|_| InvokeError::Closed)?
    }
}

type Done = oneshot::Sender<Result<Vec<u8>, InvokeError>>;

struct Session {
    core: Client,
    /// The call in flight: where its result goes, its deadline, its timeout.
    call: Option<(Done, Instant, Duration)>,
    /// When the call in flight started, and its kind for the latency histogram.
    started: (Instant, &'static str),
}

/// Connections to the order nodes, by stable id: the members the sessions know of
/// (a membership change adds connections; membership.rs). The dispatcher drives them
/// itself ([`Links`]).
struct Nodes {
    links: Links,
    /// Where checkpoint messages go ([`SideChannel`]), once someone took it.
    side_tx: mpsc::Sender<(NodeId, Message)>,
    side_open: Arc<std::sync::atomic::AtomicBool>,
    stats: Arc<TransportStats>,
}

impl Nodes {
    /// Connects (with retries, as the dispatcher polls) to the members of `m` not
    /// connected yet.
    fn follow(&mut self, m: &Membership) {
        for member in &m.members {
            if self.links.contains(NodeId(member.id)) {
                continue;
            }
            let Ok(addr) = member.addr.parse::<std::net::SocketAddr>() else {
                tracing::warn!(node = member.id, addr = %member.addr, "member without a usable address");
                continue;
            };
            self.connect(NodeId(member.id), addr);
        }
    }

    /// The nodes not connected now, each with why, and the nodes connected.
    fn reach(&self) -> (Vec<String>, Vec<NodeId>) {
        let mut unreachable = Vec::new();
        let mut reached = Vec::new();
        for (id, link) in self.links.states() {
            match link.trouble() {
                None => reached.push(id),
                Some(why) => unreachable.push(format!("node {id} ({why})")),
            }
        }
        (unreachable, reached)
    }

    /// Connects (with retries, as the dispatcher polls) to node `j` at `addr`.
    fn connect(&mut self, j: NodeId, addr: std::net::SocketAddr) {
        self.links.add(j, PeerId::Node(j), addr);
    }

    fn send(&mut self, msgs: Vec<(NodeId, Message)>) {
        for (n, m) in msgs {
            self.links.send(n, &codec::encode(&m));
        }
    }

    /// Routes a frame from node `from`: what the dispatcher handles comes back; checkpoint
    /// messages go to the side channel if someone took it; anything else is counted.
    fn route(&self, from: NodeId, frame: &[u8]) -> Option<Message> {
        match codec::decode(frame) {
            Ok(m @ (Message::Reply(_) | Message::Push { .. } | Message::EpochCerts(_))) => Some(m),
            Ok(m @ (Message::StableCert(_) | Message::Manifest { .. } | Message::Chunk { .. })) => {
                if !self.side_open.load(std::sync::atomic::Ordering::Relaxed) {
                    // Nobody asked: a node sending these to an ordinary client.
                    TransportStats::bump(&self.stats.undecodable, 1);
                } else if self.side_tx.try_send((from, m)).is_err() {
                    TransportStats::bump(&self.stats.send_queue_full, 1);
                }
                None
            }
            _ => {
                TransportStats::bump(&self.stats.undecodable, 1);
                None
            }
        }
    }
}

struct Dispatcher {
    epoch: Arc<std::sync::atomic::AtomicU64>,
    /// Where followed epoch certificates are kept (ClientSetup::epochs_dir).
    epochs_dir: Option<std::path::PathBuf>,
    metrics: Arc<ClientMetrics>,
    sessions: Vec<Session>,
    /// Indices of sessions without a call.
    free: Vec<usize>,
    nodes: Nodes,
    pushes: mpsc::Sender<(ClientId, Pushed)>,
    /// Per session, the events dropped because the application's queue was full (first,
    /// last), reported as a gap before the next event that fits.
    push_overflow: std::collections::BTreeMap<ClientId, (u64, u64)>,
    tick: Duration,
}

impl Dispatcher {
    async fn run(mut self, mut calls: mpsc::Receiver<Call>, mut side: mpsc::Receiver<(NodeId, Message)>) {
        let mut tick = tokio::time::interval(self.tick);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
        // Calls that arrived while every session was busy.
        let mut waiting: VecDeque<Call> = VecDeque::new();
        // False once every handle is gone: finish what is in flight, then stop (which
        // closes the node connections).
        let mut open = true;
        loop {
            tokio::select! {
                call = calls.recv(), if open && waiting.len() < CALL_QUEUE_MAX => match call {
                    Some(call) => {
                        waiting.push_back(call);
                        // The rest of a burst too, so its requests share one write per node.
                        while waiting.len() < CALL_QUEUE_MAX {
                            let Ok(call) = calls.try_recv() else { break };
                            waiting.push_back(call);
                        }
                    }
                    None => open = false,
                },
                // Everything that arrived on every connection, before starting new calls.
                frames = std::future::poll_fn(|cx| self.nodes.links.poll_frames(cx)) => {
                    for (from, frame) in frames {
                        if let Some(msg) = self.nodes.route(from, &frame) {
                            self.on_message(from, msg);
                        }
                    }
                }
                _ = tick.tick() => self.on_tick(),
                Some(out) = side.recv() => self.nodes.send(vec![out]),
            }
            while let Some(i) = self.free.last().copied() {
                let Some(call) = waiting.pop_front() else {
                    break;
                };
                self.free.pop();
                self.start(i, call);
            }
            if !open && waiting.is_empty() && self.free.len() == self.sessions.len() {
                return;
            }
            // What the step queued goes out before the task sleeps again.
            std::future::poll_fn(|cx| {
                self.nodes.links.poll_write(cx);
                std::task::Poll::Ready(())
            })
            .await;
        }
    }

    fn start(&mut self, i: usize, call: Call) {
        let session = &mut self.sessions[i];
        let started = match call.read {
            None => session.core.invoke(now_ms(), call.op),
            Some(consistency) => session.core.invoke_read_only(now_ms(), call.op, consistency),
        };
        match started {
            Ok(msgs) => {
                session.started = (Instant::now(), if call.read.is_some() { "read" } else { "ordered" });
                session.call = Some((call.done, Instant::now() + call.timeout, call.timeout));
                self.nodes.send(msgs);
            }
            Err(e) => {
                let _ = call.done.send(Err(e.into()));
                self.free.push(i);
            }
        }
    }

    fn on_message(&mut self, from: NodeId, msg: Message) {
        match msg {
            Message::Reply(reply) => self.on_reply(from, reply),
            Message::EpochCerts(certs) => {
                // A fetch on the side channel follows the membership too.
                if self.nodes.side_open.load(std::sync::atomic::Ordering::Relaxed) {
                    let _ = self.nodes.side_tx.try_send((from, Message::EpochCerts(certs.clone())));
                }
                // For whichever sessions still know an older membership (each checks).
                let mut followed = None;
                for i in 0..self.sessions.len() {
                    if self.sessions[i].core.on_epoch_certs(certs.clone()) {
                        let membership = self.sessions[i].core.membership().clone();
                        tracing::info!(epoch = membership.epoch, members = ?self.sessions[i].core.members(), "membership changed");
                        self.nodes.follow(&membership);
                        self.epoch.fetch_max(membership.epoch, std::sync::atomic::Ordering::Relaxed);
                        followed = Some(i);
                    }
                    self.nodes.send(self.sessions[i].core.poll_send());
                }
                // Kept for the next process: only the chain the core followed, each
                // certificate checked.
                if let (Some(i), Some(dir)) = (followed, &self.epochs_dir) {
                    let chain = self.sessions[i].core.epoch_chain().to_vec();
                    let kept = crate::epochs::load(dir).unwrap_or_default();
                    if let Err(e) = crate::epochs::store(dir, crate::epochs::merged(chain, kept)) {
                        tracing::warn!(error = %e, dir = %dir.display(), "cannot keep the epoch certificates");
                    }
                }
            }
            Message::Push { client, seq, epoch, event } => {
                let i = session_of(client) as usize;
                let Some(session) = self.sessions.get_mut(i).filter(|s| s.core.id() == client) else {
                    return;
                };
                let delivered = session.core.on_push(now_ms(), from, epoch, seq, event);
                self.nodes.send(session.core.poll_send());
                self.hand_over(client, delivered);
            }
            _ => {}
        }
    }

    /// Passes delivered push events to the application, turning what does not fit its
    /// queue into a gap (reported before the session's next event that fits).
    fn hand_over(&mut self, client: ClientId, delivered: Vec<Pushed>) {
        for p in delivered {
            if let Some(&(first, last)) = self.push_overflow.get(&client) {
                if self.pushes.try_send((client, Pushed::Gap { first, last })).is_ok() {
                    self.push_overflow.remove(&client);
                }
            }
            let range = match &p {
                Pushed::Event { seq, .. } => (*seq, *seq),
                Pushed::Gap { first, last } => (*first, *last),
            };
            if self.push_overflow.contains_key(&client) || self.pushes.try_send((client, p)).is_err() {
                self.push_overflow.entry(client).or_insert(range).1 = range.1;
            }
        }
    }

    fn on_reply(&mut self, from: NodeId, reply: Reply) {
        let i = session_of(reply.client) as usize;
        let Some(session) = self.sessions.get_mut(i) else {
            return;
        };
        // Late replies too: the core notes which nodes answer (auth = rq-mac sends a
        // request first to nodes that do), and ignores a reply for nothing in flight.
        let outcome = match session.core.on_reply(from, reply) {
            Some(result) => Some(Ok(result)),
            None => session.core.take_failed().map(|e| Err(e.into())),
        };
        if let Some(outcome) = outcome {
            // A session is free once its call is done, and only then (a core result
            // without a call cannot happen: abandoning a call clears both).
            if let Some((done, _, _)) = session.call.take() {
                match &outcome {
                    Ok(_) => self.metrics.observe(session.started.1, session.started.0.elapsed().as_secs_f64()),
                    Err(_) => self.metrics.failed("too_large"),
                }
                let _ = done.send(outcome);
                self.free.push(i);
            }
        }
        // A read whose answers cannot match is ordered at once.
        self.nodes.send(session.core.poll_send());
    }

    fn on_tick(&mut self) {
        for i in 0..self.sessions.len() {
            let session = &mut self.sessions[i];
            let delivered = session.core.on_push_tick(now_ms());
            let client = session.core.id();
            self.nodes.send(session.core.poll_send());
            if !delivered.is_empty() {
                self.hand_over(client, delivered);
            }
        }
        let now = Instant::now();
        for (i, session) in self.sessions.iter_mut().enumerate() {
            let Some((_, deadline, timeout)) = &session.call else {
                continue;
            };
            let closed = session.call.as_ref().is_some_and(|(done, _, _)| done.is_closed());
            if now >= *deadline || closed {
                let timeout = *timeout;
                session.core.abandon();
                if let Some((done, _, _)) = session.call.take() {
                    self.metrics.failed(if closed { "abandoned" } else { "timeout" });
                    let (unreachable, reached) = self.nodes.reach();
                    let _ = done.send(Err(InvokeError::Timeout { after: timeout, unreachable, reached }));
                }
                self.free.push(i);
                continue;
            }
            let msgs = session.core.on_tick(now_ms());
            self.nodes.send(msgs);
        }
    }
}

/// A blocking wrapper for simple programs: owns a small runtime.
pub struct BlockingClient {
    runtime: tokio::runtime::Runtime,
    inner: KeelClient,
}

impl BlockingClient {
    /// # Errors
    /// As [`KeelClient::connect`], or if the runtime cannot start.
    pub fn connect(setup: ClientSetup) -> Result<BlockingClient, InvokeError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .map_err(|e| InvokeError::Tls(TlsError::Pem(format!("runtime: {e}"))))?;
        let inner = runtime.block_on(async { KeelClient::connect(setup) })?;
        Ok(BlockingClient { runtime, inner })
    }

    /// # Errors
    /// As [`KeelClient::invoke`].
    pub fn invoke(&mut self, op: Vec<u8>, timeout: Duration) -> Result<Vec<u8>, InvokeError> {
        self.runtime.block_on(self.inner.invoke(op, timeout))
    }

    /// # Errors
    /// As [`KeelClient::invoke_read_only`].
    pub fn invoke_read_only(
        &mut self,
        op: Vec<u8>,
        consistency: ReadConsistency,
        timeout: Duration,
    ) -> Result<Vec<u8>, InvokeError> {
        self.runtime.block_on(self.inner.invoke_read_only(op, consistency, timeout))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ClientFile, NodeFile};
    use crate::provision::{init, InitOptions};
    use crate::transport::{accept_loop, Accepted};
    use keel_core::ids::Seq;
    use std::sync::atomic::Ordering;
    use tokio::io::AsyncWriteExt;
    use tokio_rustls::TlsAcceptor;

    /// Checkpoint messages from a node (a stand-in for node 0, with its certificate)
    /// are dropped and counted while nobody took the side channel, so a node cannot
    /// fill an ordinary client's memory with chunks; once taken, they arrive.
    #[tokio::test]
    async fn checkpoint_messages_reach_only_a_taken_side_channel() {
        let dir = tempfile::tempdir().expect("tempdir");
        init(dir.path(), &InitOptions::local("kv", 1, 1).expect("options")).expect("init");
        let node0 = NodeFile::load(&dir.path().join("node-0/node.toml")).expect("node 0");
        let acceptor = TlsAcceptor::from(tls::server_config(&node0.ca_pem, &node0.credentials).expect("tls"));
        let listener = tokio::net::TcpListener::bind(node0.listen).await.expect("node 0's port");
        let (conn_tx, mut conns) = mpsc::channel::<Accepted>(1);
        tokio::spawn(accept_loop(listener, acceptor, Arc::new(TransportStats::default()), move |a| {
            let _ = conn_tx.try_send(a);
        }));
        let setup = ClientFile::load(&dir.path().join("client-1000/client.toml")).expect("client file");
        let client = KeelClient::connect(setup).expect("client");
        let conn = tokio::time::timeout(Duration::from_secs(10), conns.recv()).await.expect("dialled").expect("conn");
        let (_read, mut write) = tokio::io::split(conn.stream);
        let chunk = codec::encode(&Message::Chunk { seq: Seq(5), index: 0, data: vec![7; 4096] });
        let frame = [(chunk.len() as u32).to_be_bytes().as_slice(), &chunk].concat();
        write.write_all(&frame).await.expect("sent");
        write.flush().await.expect("flushed");
        let counted = async {
            while client.stats.undecodable.load(Ordering::Relaxed) == 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), counted).await.expect("dropped and counted");
        let mut side = client.side_channel().expect("the side channel");
        assert!(client.side_channel().is_none(), "taken once");
        assert!(side.receive.try_recv().is_err(), "nothing was kept for it");
        write.write_all(&frame).await.expect("sent");
        write.flush().await.expect("flushed");
        let got = tokio::time::timeout(Duration::from_secs(10), side.receive.recv()).await.expect("arrived");
        assert!(matches!(got, Some((NodeId(0), Message::Chunk { seq: Seq(5), .. }))), "{got:?}");
    }
}
