//! Keel inside a program: start a node from a configuration and a service factory and
//! hold a handle to it: its status, its events, an in-process client, its front ends,
//! and a shutdown that waits for the disk. Several nodes, of one cluster or of several,
//! run in one process, each on a thread and runtime of its own, as a `keel node` process
//! would (so stopping one closes its sockets, ends its tasks and lets go of its files, and
//! it can start again from its data directory in the same process).
//!
//! ```text
//!  NodeBuilder::new(setup, make_service)      setup: NodeSetup (files: NodeFile::load;
//!      .client(client_setup)                         a local cluster: provision())
//!      .front_end(|fe| async move { ... })    a listener of the service's own, say
//!      .start().await  ──►  NodeHandle { status(), events(), client(), shutdown() }
//! ```
//!
//! A front end runs on the node's runtime once the node serves: it takes connections in
//! its own protocol (ZooKeeper's, NBD's, HTTP) and submits ordered and read-only
//! operations, and receives push events, through the node's client identity
//! ([`FrontEnd::client`]). That client speaks to every node of the cluster like any
//! other client, so what a front end answers needs r + 1 matching replies: a front end
//! on a faulty node can lie only to its own connections.

use crate::client::KeelClient;
use crate::config::{ClientFile, ClientSetup, ConfigFileError, NodeFile, NodeSetup};
use crate::metrics::{Metrics, Shared, Status};
use crate::node::{run_controlled, NodeError};
use crate::provision::{init, node_dirs, InitOptions};
use keel_core::message::{NodeId, Seq, View};
use keel_core::service::Service;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use tokio::sync::{broadcast, mpsc, oneshot, watch};

/// Events kept for a subscriber that is behind; it then loses the oldest
/// ([`broadcast::error::RecvError::Lagged`]).
pub const EVENTS_QUEUE: usize = 1024;

/// What happened to a node, as its handle's subscribers see it ([`NodeHandle::events`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NodeEvent {
    /// The node installed a view (a new primary).
    ViewInstalled { view: View },
    /// A membership change ended the epoch at instance `seq`; `next` follows.
    EpochEnded { next: u64, seq: Seq },
    /// The node caught up by state transfer to the checkpoint at `seq`.
    StateTransferDone { seq: Seq },
    /// The service ran an agreed-time tick before instance `seq`.
    Ticked { seq: Seq, time: u64 },
}

/// The driver's end of a handle: when to stop, and whom to tell that the node serves.
/// A `keel node` process has neither ([`Control::none`]).
pub struct Control {
    stop: Option<watch::Receiver<bool>>,
    serving: Option<oneshot::Sender<Serving>>,
    plane: Option<PlaneWire>,
}

/// Node-plane messages queued each way: a service that does not keep up with its peers
/// loses the newest (counted), it does not make its node buffer without bound.
pub const PLANE_QUEUE: usize = 1024;
/// Bytes of inbound node-plane messages waiting for the service, from all peers together
/// and from any one: a count bound alone would let peers pin 1024 messages of 4 MiB
/// (4 GiB); the share per peer keeps one peer, a Byzantine one say, from filling the
/// queue that correct peers need. Beyond either, a message is dropped ("full").
pub const PLANE_INBOX_BYTES: usize = 256 << 20;
pub const PLANE_PEER_BYTES: usize = 64 << 20;

/// What waits in a plane's inbound queue, in bytes: in all, and by sender.
#[derive(Default)]
struct Backlog {
    total: usize,
    by_peer: std::collections::BTreeMap<NodeId, usize>,
}

impl Backlog {
    /// Takes `len` bytes from `from` if both bounds allow.
    fn admit(&mut self, from: NodeId, len: usize) -> bool {
        let peer = self.by_peer.get(&from).copied().unwrap_or(0);
        if self.total + len > PLANE_INBOX_BYTES || peer + len > PLANE_PEER_BYTES {
            return false;
        }
        self.total += len;
        self.by_peer.insert(from, peer + len);
        true
    }

    /// The service took `len` bytes from `from` (or they were never queued).
    fn release(&mut self, from: NodeId, len: usize) {
        self.total = self.total.saturating_sub(len);
        if let Some(peer) = self.by_peer.get_mut(&from) {
            *peer = peer.saturating_sub(len);
            if *peer == 0 {
                self.by_peer.remove(&from);
            }
        }
    }
}

type SharedBacklog = Arc<std::sync::Mutex<Backlog>>;

/// Why a node-plane message was not queued.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlaneError {
    #[error("the node's plane queue is full")]
    Full,
    #[error("{len} bytes: a node-plane message holds at most {max}")]
    TooLarge { len: usize, max: usize },
    #[error("the node stopped")]
    Stopped,
}

/// A service's end of its node's plane: unordered messages to and from the service's
/// other nodes, by stable id, over the nodes' authenticated TLS connections. Nothing here
/// is agreed: what a peer sends is what one node claims, to be checked by the service
/// (against a digest the cluster ordered, say) before it is believed.
pub struct NodePlane {
    node: NodeId,
    out: mpsc::Sender<(NodeId, Vec<u8>)>,
    inbox: mpsc::Receiver<(NodeId, Vec<u8>)>,
    backlog: SharedBacklog,
}

impl NodePlane {
    /// This node's stable id.
    pub fn node(&self) -> NodeId {
        self.node
    }

    /// Queues `payload` for node `to` ([`PlaneSender::send`]).
    ///
    /// # Errors
    /// As [`PlaneSender::send`].
    pub fn send(&self, to: NodeId, payload: Vec<u8>) -> Result<(), PlaneError> {
        self.sender().send(to, payload)
    }

    /// A handle that sends on this plane from another task.
    pub fn sender(&self) -> PlaneSender {
        PlaneSender { out: self.out.clone() }
    }

    /// The next message a trusted peer sent and the service's check accepted: (from,
    /// payload). None once the node stopped.
    pub async fn recv(&mut self) -> Option<(NodeId, Vec<u8>)> {
        let (from, payload) = self.inbox.recv().await?;
        if let Ok(mut b) = self.backlog.lock() {
            b.release(from, payload.len());
        }
        Some((from, payload))
    }
}

/// Sends on a node's plane ([`NodePlane::sender`]); clones share the queue.
#[derive(Clone)]
pub struct PlaneSender {
    out: mpsc::Sender<(NodeId, Vec<u8>)>,
}

impl PlaneSender {
    /// A sender whose messages go to the returned receiver as (to, payload) instead of
    /// to peers: for a service's tests of what it sends, or an embedder that carries
    /// the messages itself.
    pub fn channel(capacity: usize) -> (PlaneSender, mpsc::Receiver<(NodeId, Vec<u8>)>) {
        let (out, rx) = mpsc::channel(capacity.max(1));
        (PlaneSender { out }, rx)
    }

    /// Queues `payload` for node `to`. Best effort: a message to a node that is down or
    /// not a peer is dropped (and counted by the sender, `keel_plane_rejected_total`).
    ///
    /// # Errors
    /// A full queue, a payload over [`keel_core::codec::PLANE_BYTES_MAX`], or a node that
    /// stopped.
    pub fn send(&self, to: NodeId, payload: Vec<u8>) -> Result<(), PlaneError> {
        let max = keel_core::codec::PLANE_BYTES_MAX;
        if payload.len() > max {
            return Err(PlaneError::TooLarge { len: payload.len(), max });
        }
        self.out.try_send((to, payload)).map_err(|e| match e {
            mpsc::error::TrySendError::Full(_) => PlaneError::Full,
            mpsc::error::TrySendError::Closed(_) => PlaneError::Stopped,
        })
    }
}

/// The driver's end of a node's plane.
struct PlaneWire {
    inbox: mpsc::Sender<(NodeId, Vec<u8>)>,
    out: mpsc::Receiver<(NodeId, Vec<u8>)>,
    check: PlaneCheck,
    backlog: SharedBacklog,
}

/// The driver's inbound end of a node's plane ([`Control::take_plane`]).
pub(crate) struct PlaneIn(Option<(PlaneQueue, PlaneCheck, SharedBacklog)>);

/// A node plane's queue of (peer, payload): to the service inbound, from it outbound.
type PlaneQueue = mpsc::Sender<(NodeId, Vec<u8>)>;

impl PlaneIn {
    /// Takes a node-plane message from `from`, which the transport authenticated as that
    /// node: delivered to the service's plane only if `from` is a peer this node trusts
    /// now (`trusted`: a member of its epoch, or a stage node of the cluster) and the
    /// service's own check accepts the bytes. Everything else is dropped and counted by
    /// why (`keel_plane_rejected_total`).
    pub(crate) fn deliver(&self, from: NodeId, trusted: bool, payload: Vec<u8>, m: &Metrics) {
        let reason = match &self.0 {
            None => "no-plane",
            Some(_) if !trusted => "untrusted",
            Some((_, check, _)) if !check(from, &payload) => "refused",
            Some((inbox, _, backlog)) => {
                let len = payload.len();
                let admitted = backlog.lock().map(|mut b| b.admit(from, len)).unwrap_or(false);
                if !admitted {
                    "full"
                } else if inbox.try_send((from, payload)).is_ok() {
                    m.plane_delivered.inc();
                    return;
                } else {
                    if let Ok(mut b) = backlog.lock() {
                        b.release(from, len);
                    }
                    "full"
                }
            }
        };
        tracing::debug!(from = from.0, reason, "node-plane message rejected");
        m.plane_rejected.get_or_create(&crate::metrics::KindLabels { kind: reason.into() }).inc();
    }
}

/// The driver's outbound end of a node's plane ([`Control::take_plane`]).
pub(crate) struct PlaneOut(Option<mpsc::Receiver<(NodeId, Vec<u8>)>>);

impl PlaneOut {
    /// The next message the service asked to send: (to, payload). Pending forever for a
    /// node without a plane, or once the service let go of it.
    pub(crate) async fn next(&mut self) -> (NodeId, Vec<u8>) {
        if let Some(out) = self.0.as_mut() {
            if let Some(msg) = out.recv().await {
                return msg;
            }
            self.0 = None;
        }
        std::future::pending().await
    }
}

/// The service's check of a node-plane message: (from, payload) -> accept.
type PlaneCheck = Box<dyn Fn(NodeId, &[u8]) -> bool + Send + Sync>;

/// What the driver hands to the handle once it serves.
struct Serving {
    shared: Arc<Shared>,
    events: broadcast::Sender<NodeEvent>,
}

impl Control {
    /// Never stops, tells no one.
    pub fn none() -> Control {
        Control { stop: None, serving: None, plane: None }
    }

    /// Stops (gracefully: what it handed to its log made durable) once `stop` turns true
    /// or its sender is dropped: how `keel node` answers SIGTERM.
    pub fn stop_on(stop: watch::Receiver<bool>) -> Control {
        Control { stop: Some(stop), serving: None, plane: None }
    }

    /// The node listens and has recovered: its status and events go to the handle.
    pub(crate) fn started(&mut self, shared: &Arc<Shared>, m: &Metrics) {
        if let Some(tx) = self.serving.take() {
            let _ = tx.send(Serving { shared: shared.clone(), events: m.events.clone() });
        }
    }

    /// The node plane's two ends for the driver's loop: what arrives (checked and queued
    /// while a step runs) and what the service sends (an arm of the loop's select).
    pub(crate) fn take_plane(&mut self) -> (PlaneIn, PlaneOut) {
        match self.plane.take() {
            Some(PlaneWire { inbox, out, check, backlog }) => {
                (PlaneIn(Some((inbox, check, backlog))), PlaneOut(Some(out)))
            }
            None => (PlaneIn(None), PlaneOut(None)),
        }
    }

    /// Resolves when the handle asked the node to stop, or was dropped.
    pub(crate) async fn stopped(&mut self) {
        let Some(stop) = self.stop.as_mut() else {
            return std::future::pending().await;
        };
        loop {
            if *stop.borrow_and_update() {
                return;
            }
            if stop.changed().await.is_err() {
                return;
            }
        }
    }
}

/// What a front end gets: the node it runs on and a client into the cluster.
pub struct FrontEnd {
    pub node: NodeId,
    /// Where the node listens for its peers and clients, and serves `/metrics`: what a
    /// front end may tell its own clients about the node (coord's `/zookeeper/config`).
    pub listen: std::net::SocketAddr,
    pub metrics: std::net::SocketAddr,
    /// The node's data directory: a front end may keep unreplicated, node-local data
    /// under it (in a directory of its own name; the node's files are `data/*`).
    pub data_dir: PathBuf,
    client: Option<KeelClient>,
    stop: watch::Receiver<bool>,
    plane: Arc<std::sync::Mutex<Option<NodePlane>>>,
}

impl FrontEnd {
    /// The node's plane ([`NodeBuilder::node_plane`]), to the first task that asks.
    pub fn take_plane(&self) -> Option<NodePlane> {
        self.plane.lock().ok().and_then(|mut p| p.take())
    }

    /// The node's client identity ([`NodeBuilder::client`]); None if it has none.
    pub fn client(&self) -> Option<&KeelClient> {
        self.client.as_ref()
    }

    /// Resolves when the node is stopping: a front end closes its listener and returns.
    /// (When the node has stopped, its runtime ends every task still running.)
    pub async fn stopped(&mut self) {
        loop {
            if *self.stop.borrow_and_update() {
                return;
            }
            if self.stop.changed().await.is_err() {
                return;
            }
        }
    }
}

type FrontEndTask = Box<dyn FnOnce(FrontEnd) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send>;

/// Starts a node in this process ([`NodeBuilder::start`]).
pub struct NodeBuilder<S> {
    setup: NodeSetup,
    make: Box<dyn Fn() -> S + Send>,
    client: Option<ClientSetup>,
    client_sessions: usize,
    front_ends: Vec<FrontEndTask>,
    plane: Option<PlaneCheck>,
    report: Option<Arc<dyn crate::metrics::ServiceReport>>,
}

impl<S: Service + Send + 'static> NodeBuilder<S> {
    /// A node as `setup` describes it; `make` builds an empty service (at the start, and
    /// again for each membership epoch, which restores it from a checkpoint).
    pub fn new(setup: NodeSetup, make: impl Fn() -> S + Send + 'static) -> NodeBuilder<S> {
        NodeBuilder {
            setup,
            make: Box::new(make),
            client: None,
            client_sessions: 1,
            front_ends: Vec::new(),
            plane: None,
            report: None,
        }
    }

    /// The node `node.toml` at `path` describes (as `keel node --config` runs it).
    ///
    /// # Errors
    /// If a file is missing or invalid.
    pub fn from_file(path: &Path, make: impl Fn() -> S + Send + 'static) -> Result<NodeBuilder<S>, ConfigFileError> {
        Ok(NodeBuilder::new(NodeFile::load(path)?, make))
    }

    /// The client identity of this node's front ends and of [`NodeHandle::client`].
    /// Each node needs an identity of its own: two clients sharing one would reuse each
    /// other's sequence numbers.
    pub fn client(mut self, setup: ClientSetup) -> NodeBuilder<S> {
        self.client = Some(setup);
        self
    }

    /// How many operations the node's client may have in flight at once (its sessions;
    /// 1 by default): a front end serving many connections wants more.
    pub fn client_sessions(mut self, sessions: usize) -> NodeBuilder<S> {
        self.client_sessions = sessions;
        self
    }

    /// Opens the node plane ([`NodePlane`], [`FrontEnd::take_plane`]): node-plane
    /// messages from a trusted peer reach the service if `check(from, payload)` accepts
    /// them. Without a plane every such message is dropped (and counted).
    pub fn node_plane(mut self, check: impl Fn(NodeId, &[u8]) -> bool + Send + Sync + 'static) -> NodeBuilder<S> {
        self.plane = Some(Box::new(check));
        self
    }

    /// Runs `front_end` on the node's runtime once the node serves.
    pub fn front_end<F, Fut>(mut self, front_end: F) -> NodeBuilder<S>
    where
        F: FnOnce(FrontEnd) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        self.front_ends.push(Box::new(move |fe| Box::pin(front_end(fe))));
        self
    }

    /// The service's own figures, shown with the node's in `/metrics` and `/status`.
    pub fn report(mut self, report: Arc<dyn crate::metrics::ServiceReport>) -> NodeBuilder<S> {
        self.report = Some(report);
        self
    }

    /// Starts the node on a thread of its own and returns once it serves (it recovered
    /// from its data directory and listens).
    ///
    /// # Errors
    /// What `keel node` would fail with: storage, recovery, TLS, a port in use, a node
    /// that is no longer a member; and a client identity whose files are wrong.
    pub async fn start(self) -> Result<NodeHandle, NodeError> {
        let NodeBuilder { setup, make, client, client_sessions, front_ends, plane, report } = self;
        let id = setup.id;
        let (wire, plane) = match plane {
            Some(check) => {
                let (in_tx, in_rx) = mpsc::channel(PLANE_QUEUE);
                let (out_tx, out_rx) = mpsc::channel(PLANE_QUEUE);
                let backlog = SharedBacklog::default();
                let wire = PlaneWire { inbox: in_tx, out: out_rx, check, backlog: backlog.clone() };
                (Some(wire), Some(NodePlane { node: id, out: out_tx, inbox: in_rx, backlog }))
            }
            None => (None, None),
        };
        let plane = Arc::new(std::sync::Mutex::new(plane));
        let (stop_tx, stop_rx) = watch::channel(false);
        let (serving_tx, serving_rx) = oneshot::channel::<Serving>();
        let (ready_tx, ready_rx) = oneshot::channel::<Result<Ready, NodeError>>();
        let (done_tx, done_rx) = oneshot::channel();
        let threads = setup.threads;
        let data_dir = setup.data_dir.clone();
        let node_addrs = (setup.listen, setup.metrics);
        let control = Control { stop: Some(stop_rx.clone()), serving: Some(serving_tx), plane: wire };
        let thread = std::thread::Builder::new()
            .name(format!("keel-node-{id}"))
            .spawn(move || {
                let built = match threads {
                    0 => tokio::runtime::Builder::new_current_thread().enable_all().build(),
                    n => tokio::runtime::Builder::new_multi_thread().worker_threads(n).enable_all().build(),
                };
                let runtime = match built {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = ready_tx.send(Err(NodeError::Runtime(e.to_string())));
                        return;
                    }
                };
                let serve = async move {
                    // Once the node serves: its client, then the front ends.
                    let Ok(serving) = serving_rx.await else { return };
                    if let (Some(r), Ok(mut slot)) = (report, serving.shared.report.lock()) {
                        *slot = Some(r);
                    }
                    let client = match client.map(|c| KeelClient::connect_sessions(c, client_sessions)).transpose() {
                        Ok(c) => c,
                        Err(e) => {
                            let _ = ready_tx.send(Err(NodeError::Client(e.to_string())));
                            return;
                        }
                    };
                    if let (Some(c), Ok(mut slot)) = (&client, serving.shared.client.lock()) {
                        *slot = Some(c.metrics());
                    }
                    for task in front_ends {
                        let fe = FrontEnd {
                            node: id,
                            listen: node_addrs.0,
                            metrics: node_addrs.1,
                            data_dir: data_dir.clone(),
                            client: client.clone(),
                            stop: stop_rx.clone(),
                            plane: plane.clone(),
                        };
                        tokio::spawn(task(fe));
                    }
                    let _ = ready_tx.send(Ok(Ready { serving, client }));
                };
                let result = runtime.block_on(async move {
                    let (result, ()) = tokio::join!(run_controlled(setup, make, control), serve);
                    result
                });
                // Dropping the runtime ends the node's tasks and closes its sockets.
                drop(runtime);
                let _ = done_tx.send(result);
            })
            .map_err(|e| NodeError::Runtime(e.to_string()))?;
        let mut handle = NodeHandle { id, stop: stop_tx, done: Some(done_rx), thread: Some(thread), ready: None };
        match ready_rx.await {
            Ok(Ok(ready)) => {
                handle.ready = Some(ready);
                Ok(handle)
            }
            Ok(Err(e)) => {
                let _ = handle.stop.send(true);
                let _ = handle.wait().await;
                Err(e)
            }
            // The node ended before it served: its error says why.
            Err(_) => match handle.wait().await {
                Err(e) => Err(e),
                Ok(()) => Err(NodeError::Runtime("the node stopped before it served".into())),
            },
        }
    }
}

/// What a started node offers its handle.
struct Ready {
    serving: Serving,
    client: Option<KeelClient>,
}

/// A node running in this process. Dropping the handle stops the node without waiting;
/// [`NodeHandle::shutdown`] waits until what it decided is on disk.
pub struct NodeHandle {
    id: NodeId,
    stop: watch::Sender<bool>,
    done: Option<oneshot::Receiver<Result<(), NodeError>>>,
    thread: Option<std::thread::JoinHandle<()>>,
    /// Set once the node serves (always, for a handle `start` returned).
    ready: Option<Ready>,
}

impl NodeHandle {
    pub fn id(&self) -> NodeId {
        self.id
    }

    /// What `/status` shows: view, executed and stable instances, peers, epoch.
    pub fn status(&self) -> Status {
        self.ready.as_ref().map(|r| r.serving.shared.full_status()).unwrap_or_default()
    }

    /// The node's Prometheus text, as its `/metrics` endpoint serves it.
    pub fn metrics(&self) -> String {
        self.ready.as_ref().map(|r| crate::metrics::render(&r.serving.shared)).unwrap_or_default()
    }

    /// Events from now on.
    pub fn events(&self) -> broadcast::Receiver<NodeEvent> {
        match &self.ready {
            Some(r) => r.serving.events.subscribe(),
            None => broadcast::channel(1).1,
        }
    }

    /// A client into the cluster with the node's client identity (a clone: all share its
    /// connections). None if the node was started without one ([`NodeBuilder::client`]).
    pub fn client(&self) -> Option<KeelClient> {
        self.ready.as_ref().and_then(|r| r.client.clone())
    }

    /// Stops the node: it steps no more input, everything it handed to its log is made
    /// durable, and its thread ends (sockets closed, files released).
    ///
    /// # Errors
    /// A storage failure while draining the log, or one that had already stopped it.
    pub async fn shutdown(mut self) -> Result<(), NodeError> {
        let _ = self.stop.send(true);
        self.wait().await
    }

    /// Waits until the node ends by itself: a storage failure, or a membership change
    /// that removed it.
    ///
    /// # Errors
    /// What stopped it.
    pub async fn stopped(mut self) -> Result<(), NodeError> {
        self.wait().await
    }

    /// Runs until `stop` resolves (then shuts down as [`NodeHandle::shutdown`] does) or
    /// the node ends by itself, whichever comes first: how `keel node` hosts a service
    /// with a front end.
    ///
    /// # Errors
    /// What stopped the node, or a storage failure while draining its log.
    pub async fn run_until(mut self, stop: impl Future<Output = ()>) -> Result<(), NodeError> {
        let mut stop = std::pin::pin!(stop);
        let ended = match self.done.as_mut() {
            Some(done) => tokio::select! {
                result = done => Some(result),
                () = &mut stop => None,
            },
            None => None,
        };
        match ended {
            Some(result) => {
                self.done = None;
                if let Some(thread) = self.thread.take() {
                    let _ = tokio::task::spawn_blocking(move || thread.join()).await;
                }
                result.unwrap_or_else(|_| Err(NodeError::Runtime("the node's thread panicked".into())))
            }
            None => {
                let _ = self.stop.send(true);
                self.wait().await
            }
        }
    }

    async fn wait(&mut self) -> Result<(), NodeError> {
        let result = match self.done.take() {
            Some(done) => done.await.unwrap_or_else(|_| Err(NodeError::Runtime("the node's thread panicked".into()))),
            None => Ok(()),
        };
        if let Some(thread) = self.thread.take() {
            // It has sent its result: all that is left is to return.
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
        result
    }
}

impl Drop for NodeHandle {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

/// A local cluster's configuration, provisioned (keys, certificates, data directories) in
/// a directory as `keel init` does, and loaded back: each node's setup and the clients'.
pub struct Provisioned {
    pub dir: PathBuf,
    /// By node id: order nodes, then execution and RQ nodes when stages run apart.
    pub nodes: Vec<NodeSetup>,
    /// client-1000, client-1001, ... as `InitOptions::clients` asked.
    pub clients: Vec<ClientSetup>,
}

/// Provisions a cluster into `dir` (which must not hold one) and loads it.
///
/// # Errors
/// Invalid options, or a file that cannot be written.
pub fn provision(dir: &Path, options: &InitOptions) -> Result<Provisioned, ConfigFileError> {
    init(dir, options)?;
    load(dir)
}

/// Loads a cluster directory made by [`provision`] or `keel init`.
///
/// # Errors
/// A file missing or invalid.
pub fn load(dir: &Path) -> Result<Provisioned, ConfigFileError> {
    let nodes = node_dirs(dir).into_values().map(|d| NodeFile::load(&d.join("node.toml"))).collect::<Result<_, _>>()?;
    let mut clients = Vec::new();
    let entries = std::fs::read_dir(dir).map_err(|source| ConfigFileError::Io { path: dir.into(), source })?;
    let mut client_dirs: Vec<(u64, PathBuf)> = entries
        .flatten()
        .filter_map(|e| {
            let id = e.file_name().to_string_lossy().strip_prefix("client-")?.parse().ok()?;
            Some((id, e.path()))
        })
        .collect();
    client_dirs.sort();
    for (_, d) in client_dirs {
        clients.push(ClientFile::load(&d.join("client.toml"))?);
    }
    Ok(Provisioned { dir: dir.into(), nodes, clients })
}

#[cfg(test)]
mod backlog_tests {
    use super::*;

    /// One peer cannot take more than its share, all together not more than the total,
    /// and what the service takes is free again.
    #[test]
    fn the_plane_backlog_bounds_bytes_per_peer_and_in_all() {
        let mut b = Backlog::default();
        let mib = 1 << 20;
        for _ in 0..16 {
            assert!(b.admit(NodeId(1), 4 * mib));
        }
        assert!(!b.admit(NodeId(1), 1), "peer 1 holds its 64 MiB share");
        for peer in 2..5 {
            for _ in 0..16 {
                assert!(b.admit(NodeId(peer), 4 * mib));
            }
        }
        assert_eq!(b.total, PLANE_INBOX_BYTES);
        assert!(!b.admit(NodeId(5), 1), "256 MiB queued in all");
        b.release(NodeId(3), 4 * mib);
        assert!(b.admit(NodeId(5), 4 * mib), "room again once the service took a message");
        assert!(!b.admit(NodeId(1), 1));
        for _ in 0..16 {
            b.release(NodeId(1), 4 * mib);
        }
        assert!(!b.by_peer.contains_key(&NodeId(1)), "a peer with nothing queued is forgotten");
    }
}
