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
use crate::config::{init, node_dirs, ClientFile, ClientSetup, ConfigFileError, InitOptions, NodeFile, NodeSetup};
use crate::metrics::{Metrics, Shared, Status};
use crate::node::{run_controlled, NodeError};
use keel_core::message::{NodeId, Seq, View};
use keel_core::service::Service;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use tokio::sync::{broadcast, oneshot, watch};

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
}

/// What the driver hands to the handle once it serves.
struct Serving {
    shared: Arc<Shared>,
    events: broadcast::Sender<NodeEvent>,
}

impl Control {
    /// Never stops, tells no one.
    pub fn none() -> Control {
        Control { stop: None, serving: None }
    }

    /// The node listens and has recovered: its status and events go to the handle.
    pub(crate) fn started(&mut self, shared: &Arc<Shared>, m: &Metrics) {
        if let Some(tx) = self.serving.take() {
            let _ = tx.send(Serving { shared: shared.clone(), events: m.events.clone() });
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
    /// The node's data directory: a front end may keep unreplicated, node-local data
    /// under it (in a directory of its own name; the node's files are `data/*`).
    pub data_dir: PathBuf,
    client: Option<KeelClient>,
    stop: watch::Receiver<bool>,
}

impl FrontEnd {
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
    front_ends: Vec<FrontEndTask>,
}

impl<S: Service + Send + 'static> NodeBuilder<S> {
    /// A node as `setup` describes it; `make` builds an empty service (at the start, and
    /// again for each membership epoch, which restores it from a checkpoint).
    pub fn new(setup: NodeSetup, make: impl Fn() -> S + Send + 'static) -> NodeBuilder<S> {
        NodeBuilder { setup, make: Box::new(make), client: None, front_ends: Vec::new() }
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

    /// Runs `front_end` on the node's runtime once the node serves.
    pub fn front_end<F, Fut>(mut self, front_end: F) -> NodeBuilder<S>
    where
        F: FnOnce(FrontEnd) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        self.front_ends.push(Box::new(move |fe| Box::pin(front_end(fe))));
        self
    }

    /// Starts the node on a thread of its own and returns once it serves (it recovered
    /// from its data directory and listens).
    ///
    /// # Errors
    /// What `keel node` would fail with: storage, recovery, TLS, a port in use, a node
    /// that is no longer a member; and a client identity whose files are wrong.
    pub async fn start(self) -> Result<NodeHandle, NodeError> {
        let NodeBuilder { setup, make, client, front_ends } = self;
        let id = setup.id;
        let (stop_tx, stop_rx) = watch::channel(false);
        let (serving_tx, serving_rx) = oneshot::channel::<Serving>();
        let (ready_tx, ready_rx) = oneshot::channel::<Result<Ready, NodeError>>();
        let (done_tx, done_rx) = oneshot::channel();
        let threads = setup.threads;
        let data_dir = setup.data_dir.clone();
        let control = Control { stop: Some(stop_rx.clone()), serving: Some(serving_tx) };
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
                    let client = match client.map(KeelClient::connect).transpose() {
                        Ok(c) => c,
                        Err(e) => {
                            let _ = ready_tx.send(Err(NodeError::Client(e.to_string())));
                            return;
                        }
                    };
                    for task in front_ends {
                        let fe = FrontEnd {
                            node: id,
                            data_dir: data_dir.clone(),
                            client: client.clone(),
                            stop: stop_rx.clone(),
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
        self.ready.as_ref().and_then(|r| r.serving.shared.status.lock().ok().map(|s| s.clone())).unwrap_or_default()
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
