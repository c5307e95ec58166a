//! A node process: transport, storage and the replica core, wired together.
//!
//! ```text
//!  TLS readers (one task per connection: read frame, decode) ──► bounded inbound queue
//!      ──► protocol task: step the replica for every queued input (up to a batch), send
//!          what needs no disk, hand records + gated messages to the WAL thread
//!      ──► WAL thread (committer.rs): group commit, ONE fsync for every queued job,
//!          then release the gated messages
//!      ──► bounded per-peer / per-client send queues ──► TLS writers (coalesced frames)
//! ```
//!
//! The same core the simulator drives; only the clock, the disk and the network are real.
//! The loop itself is `driver.rs`'s, shared with execution and RQ nodes; this file has
//! what only an order node does around it (`OrderHost`) and the pieces every node
//! uses (peers, listener, flush, status).

use crate::clients::{Bans, Clients};
use crate::committer::{Committer, Gated};
use crate::config::{FaultsFile, NodeSetup};
use crate::driver::{drive, Env, Hosted};
use crate::embed::{Control, NodeEvent, PlaneIn};
use crate::inbound::{ClientQuota, Inbound, InboundTx};
use crate::metrics::{self, KindLabels, Metrics, Shared, Status};
use crate::storage::{FsyncPolicy, Storage, StorageError};
use crate::tls::{self, PeerId, TlsError};
use crate::transport::{
    accept_loop, dial_loop, node_frame, offer, read_frame, split_node_frame, write_frames, Accepted, LinkState,
    TransportStats, SEND_QUEUE_MAX,
};
use keel_core::codec;
use keel_core::config::stage_id;
use keel_core::ids::Seq;
use keel_core::membership::Membership;
use keel_core::message::{owner_of, Message, NodeId};
use keel_core::node::{Admit, Node};
use keel_core::replica::{CheckpointJob, CheckpointReady, Event, Input, Outputs, Peer, Reject, Replica, Verifier};
use keel_core::service::{RestoreError, Service};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::sync::RwLock;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_rustls::{TlsAcceptor, TlsConnector};

/// Written in a node's data directory when a membership change removed it.
pub const REMOVED_FILE: &str = "REMOVED";
/// How long a removed node keeps answering its old epoch's members before it stops.
const REMOVED_LINGER_MS: u64 = 3_000;

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("storage: {0}")]
    Storage(#[from] StorageError),
    #[error("tls: {0}")]
    Tls(#[from] TlsError),
    #[error("recovery: {0}")]
    Recovery(#[from] RestoreError),
    #[error("metrics endpoint on {addr}: {source}")]
    Metrics { addr: std::net::SocketAddr, source: std::io::Error },
    #[error("listen on {addr}: {source}")]
    Listen { addr: std::net::SocketAddr, source: std::io::Error },
    #[error("membership: {0}")]
    Membership(String),
    #[error("checkpoint thread: {0}")]
    Checkpoint(String),
    #[error(
        "node {node}: {} holds no data and was not provisioned by keel init. If this node lost its disk, start \
         it with --rejoin: it then fetches the state and votes again only once caught up. Otherwise check \
         data_dir in node.toml (or a disk that is not mounted)",
        dir.display()
    )]
    Unprovisioned { node: NodeId, dir: std::path::PathBuf },
    #[error("runtime: {0}")]
    Runtime(String),
    #[error("the node's client identity: {0}")]
    Client(String),
}

/// Wall-clock milliseconds: nodes' clocks must roughly agree (agreed time, UpRight §3.1).
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Runs a node until the process ends, or until a membership change removes it.
///
/// `make` builds an empty service for the node's start (the service goes on across
/// membership epochs: the next epoch's node restores into it the checkpoint that ended
/// the last).
///
/// # Errors
/// Failures to open storage, recover, bind or configure TLS; and a storage failure while
/// running (a node that cannot persist must stop rather than answer).
pub async fn run_node<S: Service + Send + 'static>(setup: NodeSetup, make: impl Fn() -> S) -> Result<(), NodeError> {
    run_controlled(setup, make, Control::none()).await
}

/// [`run_node`] until `control` says stop ([`Control::stop_on`]; `embed.rs` for a node a
/// program started), then returns once what the node handed to its log is durable.
///
/// # Errors
/// As [`run_node`].
pub async fn run_controlled<S: Service + Send + 'static>(
    setup: NodeSetup,
    make: impl Fn() -> S,
    control: Control,
) -> Result<(), NodeError> {
    // A cluster restored from a backup starts every node from the same service state
    // (cluster.toml's `[genesis]`), as if it had executed the history that led there; a
    // later checkpoint replaces it like any state. The service checks it on the way in.
    let make: Box<dyn Fn() -> S> = match &setup.genesis {
        Some(genesis) => {
            let state = genesis.load().map_err(|e| NodeError::Runtime(format!("the genesis state: {e}")))?;
            let mut first = make();
            first
                .restore(&state)
                .map_err(|e| NodeError::Runtime(format!("the genesis state does not restore: {e}")))?;
            Box::new(move || {
                let mut service = make();
                // Restored once above already: the same bytes into the same empty service.
                let _ = service.restore(&state);
                service
            })
        }
        None => Box::new(make),
    };
    if setup.faults.lose_request_after_ms > 0 {
        let at = std::time::Instant::now() + Duration::from_millis(setup.faults.lose_request_after_ms);
        let spent = Arc::new(std::sync::atomic::AtomicBool::new(false));
        tracing::warn!(
            after_ms = setup.faults.lose_request_after_ms,
            "fault injection: a request will be lost from this node's state"
        );
        return run_stage(setup, move || crate::faults::LosesRequest::new(make(), at, spent.clone()), control).await;
    }
    run_stage(setup, make, control).await
}

/// [`run_controlled`] once the service is settled: the stage `setup` names.
async fn run_stage<S: Service + Send + 'static>(
    setup: NodeSetup,
    make: impl Fn() -> S,
    control: Control,
) -> Result<(), NodeError> {
    if setup.executes_only() {
        return crate::execution::run_execution_node(setup, make(), control).await;
    }
    if setup.rq_only() {
        return crate::rq::run_rq_node(setup, control).await;
    }
    if setup.cluster.separated() {
        // An order node of a separated cluster keeps the order state only.
        return run_replica(setup, || keel_core::service::OrderState, control).await;
    }
    run_replica(setup, make, control).await
}

/// [`run_node`] for an order (and, co-located, execution) node.
async fn run_replica<S: Service + Send + 'static>(
    setup: NodeSetup,
    make: impl Fn() -> S,
    mut control: Control,
) -> Result<(), NodeError> {
    if let Ok(why) = std::fs::read_to_string(setup.data_dir.join(REMOVED_FILE)) {
        return Err(NodeError::Membership(format!("node {} {}", setup.id, why.trim())));
    }
    // How long a start takes, by part, for the log line below: a large state's restart
    // is something an operator waits for.
    let begun = Instant::now();
    let (storage, durable) = Storage::open(&setup.data_dir, setup.fsync)?;
    let storage_ms = begun.elapsed().as_millis() as u64;
    if setup.fsync == FsyncPolicy::Never {
        tracing::warn!("fsync = never: for benchmarks only; a crash can lose acknowledged writes");
        eprintln!("WARNING: node {} runs with fsync = never; a crash can lose acknowledged writes", setup.id);
    }
    let mut out = Outputs::default();
    // The epoch: the one the log's certificates lead to, else the join file's (a node an
    // administrator added), else cluster.toml's.
    let cfg = match durable.membership().or_else(|| setup.joined.clone()) {
        Some(m) if m.epoch != setup.cluster.epoch() => {
            setup.cluster.next_epoch(m).map_err(|e| NodeError::Membership(e.to_string()))?
        }
        _ => setup.cluster.clone(),
    };
    if cfg.membership.index_of(setup.id).is_none() {
        return Err(NodeError::Membership(format!(
            "node {} is not a member of epoch {} (removed?)",
            setup.id,
            cfg.epoch()
        )));
    }
    let fresh = durable.records.is_empty() && durable.snapshots.is_empty();
    if fresh && storage.unprovisioned() && !setup.rejoin {
        storage.refuse_unprovisioned()?;
        return Err(NodeError::Unprovisioned { node: setup.id, dir: setup.data_dir.clone() });
    }
    let made = Instant::now();
    let service = make();
    let service_ms = made.elapsed().as_millis() as u64;
    let recovering = Instant::now();
    let replica = if fresh && storage.unprovisioned() {
        // The data directory is gone (deleted, or a new disk): whatever this node voted
        // for before, others still count. It rejoins without voting until it caught up
        // past all of it (keel_core replica/rejoin.rs).
        tracing::warn!(
            node = setup.id.0,
            dir = %setup.data_dir.display(),
            "data directory not provisioned by keel init: rejoining as a node that lost its disk (no votes until caught up)"
        );
        eprintln!(
            "node {}: {} holds no data and was not provisioned by keel init; rejoining without voting until caught up",
            setup.id,
            setup.data_dir.display()
        );
        Replica::rejoin(cfg, setup.id, setup.secrets.clone(), service, now_ms(), &mut out)?
    } else if fresh {
        Replica::new(cfg, setup.id, setup.secrets.clone(), service)
    } else {
        Replica::recover(cfg, setup.id, setup.secrets.clone(), service, durable, now_ms(), &mut out)?
    };
    tracing::info!(
        node = setup.id.0,
        index = replica.index().0,
        epoch = replica.epoch(),
        view = replica.view().0,
        executed = replica.executed().0,
        storage_ms,
        service_ms,
        recover_ms = recovering.elapsed().as_millis() as u64,
        "node started"
    );
    let verifier = Arc::new(RwLock::new(EpochVerifier::of(&replica)));
    let threads = setup.verify_threads;
    let membership = replica.config().membership.clone();
    let mut env = Env::open(setup, &mut control, &membership, Some(storage), |in_tx, stats| {
        start_verify_stage(threads, &verifier, in_tx, stats)
    })
    .await?;
    env.out = out;
    if !env.setup.faults.is_empty() {
        tracing::warn!(faults = ?env.setup.faults, "fault injection is on: this node misbehaves on purpose");
    }
    let checkpoints = Checkpointer::start().map_err(|source| {
        NodeError::Storage(StorageError::Io {
            what: "start checkpoint thread",
            path: env.setup.data_dir.clone(),
            source,
        })
    })?;
    let m = env.m.clone();
    let host = OrderHost { replica, verifier, checkpoints, m, started: now_ms(), leaving_at: None };
    drive(host, env, control).await
}

/// An order node as the driver hosts it: the replica, and what only order nodes have —
/// the verify stage's keys, the checkpoint thread, following the replica into its next
/// epoch and the linger of a removed node.
struct OrderHost<S> {
    replica: Replica<S>,
    verifier: Arc<RwLock<EpochVerifier>>,
    checkpoints: Checkpointer,
    m: Metrics,
    /// When the node started (fault injection counts from it).
    started: u64,
    /// Set once a membership change removed this node: when it stops.
    leaving_at: Option<u64>,
}

impl<S: Service + Send + 'static> Hosted for OrderHost<S> {
    type Core = Replica<S>;
    const NAME: &'static str = "node";

    fn core(&self) -> &Replica<S> {
        &self.replica
    }

    fn core_mut(&mut self) -> &mut Replica<S> {
        &mut self.replica
    }

    fn before_flush(&mut self, env: &mut Env) -> Result<(), NodeError> {
        hold_back_proposals(&env.setup.faults, self.started, &mut env.out, &env.peers, &env.stats);
        self.checkpoints.stable.store(self.replica.stable_seq().0, Ordering::Release);
        for job in env.out.checkpoints.drain(..) {
            self.checkpoints.submit(job)?;
        }
        // The replica went on to a new membership epoch by itself (behind durability
        // barriers the driver loop honours, replica/epoch.rs): what it sends from now on
        // goes to the new members, tagged with the new epoch, and their signatures are
        // checked with the new keys.
        for e in &env.out.events {
            match e {
                Event::EpochStarted { epoch, index } => {
                    env.peers.follow(&self.replica.config().membership);
                    if let Ok(mut v) = self.verifier.write() {
                        *v = EpochVerifier::of(&self.replica);
                    }
                    tracing::info!(epoch, index = index.0, members = ?env.peers.ids, "membership epoch started");
                }
                Event::Removed { epoch } => {
                    // Remembered, so that `keel up` and a restart leave it stopped.
                    let why = format!("was removed from the cluster in epoch {epoch}");
                    let _ = std::fs::write(env.setup.data_dir.join(REMOVED_FILE), &why);
                    tracing::warn!(node = env.setup.id.0, "removed from the cluster by a membership change: stopping");
                    eprintln!("node {} was removed from the cluster: stopping", env.setup.id);
                    // It lingers, retired, so members short of its checkpoint vote get the
                    // stable proof from it (epoch.rs).
                    self.leaving_at = Some(now_ms() + REMOVED_LINGER_MS);
                }
                _ => {}
            }
        }
        Ok(())
    }

    fn begin_batch(&mut self) {
        self.replica.hold_proposals();
    }

    fn end_batch(&mut self, out: &mut Outputs) {
        self.replica.release_proposals(now_ms(), out);
    }

    async fn background(&mut self) -> Result<Input, NodeError> {
        // The thread ends only by a panic: a bug in the service's snapshot code.
        let (ready, seconds) = self
            .checkpoints
            .done
            .recv()
            .await
            .ok_or_else(|| NodeError::Checkpoint("the checkpoint thread died".into()))?;
        self.m.checkpoint_seconds.observe(seconds);
        tracing::debug!(seq = ready.seq().0, seconds, "checkpoint serialized");
        Ok(Input::CheckpointReady(ready))
    }

    fn leaving(&self, now: u64) -> bool {
        self.leaving_at.is_some_and(|t| now >= t)
    }
}

/// What every node process does first: writes its pid (for `keel bench`'s CPU per node,
/// and operators) and serves `/metrics` and `/status`.
pub(crate) async fn announce(setup: &NodeSetup) -> Result<(Arc<TransportStats>, Metrics, Arc<Shared>), NodeError> {
    let _ = std::fs::write(setup.data_dir.join("node.pid"), std::process::id().to_string());
    let stats = Arc::new(TransportStats::default());
    let (m, registry) = Metrics::new();
    let shared = metrics::serve(setup.metrics, registry, stats.clone())
        .await
        .map_err(|source| NodeError::Metrics { addr: setup.metrics, source })?;
    Ok((stats, m, shared))
}

/// Outgoing connections to every other member of `membership`, and (stages apart) to the
/// execution and RQ nodes, whose ids are their own rather than members'.
pub(crate) fn dial_peers(
    setup: &NodeSetup,
    membership: &Membership,
    stats: &Arc<TransportStats>,
) -> Result<Peers, NodeError> {
    let connector = TlsConnector::from(tls::client_config(&setup.ca_pem, &setup.credentials)?);
    let mut peers = Peers::new(setup.id.0, connector, stats.clone());
    peers.follow(membership);
    // Execution and RQ nodes never speak to each other (the bytes come with the commits).
    let executors = if setup.rq_only() { &[][..] } else { &setup.executors[..] };
    let rq_nodes = if setup.executes_only() { &[][..] } else { &setup.rq_nodes[..] };
    for (id, addr) in executors.iter().chain(rq_nodes) {
        peers.add_fixed(id.0, *addr);
    }
    Ok(peers)
}

/// Accepts connections from nodes and clients on `setup.listen`, each served by
/// [`serve_connection`] into `in_tx` (through the verify stage when there is one).
/// Returns the client bans the connections consult.
pub(crate) async fn listen(
    setup: &NodeSetup,
    in_tx: &InboundTx,
    verify: Option<VerifyQueues>,
    stats: &Arc<TransportStats>,
) -> Result<Arc<Bans>, NodeError> {
    let listener =
        TcpListener::bind(setup.listen).await.map_err(|source| NodeError::Listen { addr: setup.listen, source })?;
    let acceptor = TlsAcceptor::from(tls::server_config(&setup.ca_pem, &setup.credentials)?);
    let conn_ids = Arc::new(AtomicU64::new(0));
    let bans = Arc::new(Bans::default());
    let (accepted_bans, in_tx, stats) = (bans.clone(), in_tx.clone(), stats.clone());
    tokio::spawn(accept_loop(listener, acceptor, stats.clone(), move |acc: Accepted| {
        let conn = conn_ids.fetch_add(1, Ordering::Relaxed);
        let serve = serve_connection(acc, conn, in_tx.clone(), verify.clone(), stats.clone(), accepted_bans.clone());
        tokio::spawn(serve);
    }));
    Ok(bans)
}

/// Serializes checkpoints off the protocol task (replica/checkpoint.rs), one at a time
/// on its own thread: each holds a whole serialized state (1 GB for a 1 GB state), and
/// running them side by side on a blocking pool multiplied that (a 1 GB cluster ran out
/// of memory). Queued jobs hold only their copy-on-write freeze. At most one job per
/// checkpoint interval in the window is ever queued.
///
/// A node whose thread falls behind (four nodes on two cores) sees its checkpoints made
/// stable by the others' votes; its queued jobs below the stable checkpoint are then
/// skipped, not run. Each holds a frozen copy that keeps the values overwritten since
/// alive, and the queue of a lagging node grew until the 1 GB benchmark ran out of memory
/// (9 GB per node) before this rule.
struct Checkpointer {
    jobs: std::sync::mpsc::Sender<CheckpointJob>,
    done: mpsc::UnboundedReceiver<(CheckpointReady, f64)>,
    /// The replica's stable checkpoint, as the protocol task last saw it.
    stable: Arc<AtomicU64>,
}

impl Checkpointer {
    fn start() -> std::io::Result<Checkpointer> {
        let (jobs, rx) = std::sync::mpsc::channel::<CheckpointJob>();
        let (tx, done) = mpsc::unbounded_channel();
        let stable = Arc::new(AtomicU64::new(0));
        let seen = stable.clone();
        std::thread::Builder::new().name("keel-checkpoint".into()).spawn(move || {
            for job in rx {
                if job.seq() < Seq(seen.load(Ordering::Acquire)) {
                    continue;
                }
                let begun = Instant::now();
                let ready = job.run();
                if tx.send((ready, begun.elapsed().as_secs_f64())).is_err() {
                    return;
                }
            }
        })?;
        Ok(Checkpointer { jobs, done, stable })
    }

    fn submit(&self, job: CheckpointJob) -> Result<(), NodeError> {
        self.jobs.send(job).map_err(|_| NodeError::Checkpoint("the checkpoint thread died".into()))
    }
}

/// Waits until every job handed to the WAL thread is durable and its messages are out.
pub(crate) async fn drain(committer: &mut Committer) -> Result<(), NodeError> {
    while !committer.idle() {
        tokio::select! {
            e = committer.failed() => return Err(e.into()),
            _ = tokio::time::sleep(Duration::from_millis(1)) => {}
        }
    }
    Ok(())
}

/// The connections to the other members, by stable id, and the stable ids of the members
/// followed now. Stages apart add fixed peers (execution and RQ nodes) that are no
/// members: cores name them by [`keel_core::config::stage_node`] of their ids. Every
/// core names order nodes by stable id.
pub(crate) struct Peers {
    me: u32,
    by_id: BTreeMap<u32, PeerLink>,
    ids: Vec<u32>,
    fixed: std::collections::BTreeSet<u32>,
    epoch: u64,
    connector: TlsConnector,
    stats: Arc<TransportStats>,
}

/// One peer's send queue, the task that dials it, and whether it is connected.
struct PeerLink {
    tx: mpsc::Sender<Vec<u8>>,
    task: tokio::task::JoinHandle<()>,
    link: Arc<LinkState>,
}

impl Peers {
    pub(crate) fn new(me: u32, connector: TlsConnector, stats: Arc<TransportStats>) -> Peers {
        Peers {
            me,
            by_id: BTreeMap::new(),
            ids: Vec::new(),
            fixed: std::collections::BTreeSet::new(),
            epoch: 0,
            connector,
            stats,
        }
    }

    /// Dials node `id` at `addr` for good (an execution node, or for one the order and
    /// execution peers).
    pub(crate) fn add_fixed(&mut self, id: u32, addr: std::net::SocketAddr) {
        if id == self.me || self.by_id.contains_key(&id) {
            return;
        }
        self.fixed.insert(id);
        self.dial(id, addr);
    }

    fn dial(&mut self, id: u32, addr: std::net::SocketAddr) {
        let (tx, rx) = mpsc::channel(SEND_QUEUE_MAX);
        let link = Arc::new(LinkState::new("peer"));
        let task = tokio::spawn(dial_loop(
            addr,
            PeerId::Node(NodeId(id)),
            self.connector.clone(),
            rx,
            self.stats.clone(),
            link.clone(),
            |_| {},
        ));
        self.by_id.insert(id, PeerLink { tx, task, link });
    }

    /// Dials the members of `m` not dialled yet and stops dialling those it left out.
    pub(crate) fn follow(&mut self, m: &Membership) {
        self.ids = m.members.iter().map(|x| x.id).collect();
        self.epoch = m.epoch;
        self.dial_only(m.members.iter().collect());
    }

    /// For an execution or RQ node, whose core names order nodes by stable id: dials
    /// the members of `m` and of the epoch before it (whose removed members an execution
    /// node's checkpoint votes still reach while they end it), and tags frames with
    /// `m`'s epoch.
    pub(crate) fn follow_stage(&mut self, m: &Membership) {
        self.epoch = m.epoch;
        let previous = m.previous.iter().flat_map(|p| p.members.iter());
        let members: Vec<&keel_core::membership::Member> = m.members.iter().chain(previous).collect();
        self.ids = members.iter().map(|x| x.id).collect();
        self.dial_only(members);
    }

    /// Dials `members` not dialled yet and stops dialling other members.
    fn dial_only(&mut self, members: Vec<&keel_core::membership::Member>) {
        let gone: Vec<u32> =
            self.by_id.keys().copied().filter(|id| !self.ids.contains(id) && !self.fixed.contains(id)).collect();
        for id in gone {
            if let Some(link) = self.by_id.remove(&id) {
                link.task.abort();
            }
        }
        let new: Vec<&keel_core::membership::Member> =
            members.into_iter().filter(|x| x.id != self.me && !self.by_id.contains_key(&x.id)).collect();
        let new: Vec<(u32, String)> = new.into_iter().map(|m| (m.id, m.addr.clone())).collect();
        for (id, addr) in new {
            let Ok(addr) = addr.parse::<std::net::SocketAddr>() else {
                tracing::error!(node = id, %addr, "member without a usable address");
                continue;
            };
            self.dial(id, addr);
        }
    }

    /// The queue to the node the core calls `node`: a stage node by its stage name, an
    /// order node by its stable id.
    pub(crate) fn route(&self, node: NodeId) -> Option<&mpsc::Sender<Vec<u8>>> {
        let id = stage_id(node).unwrap_or(node.0);
        self.by_id.get(&id).map(|l| &l.tx)
    }

    /// The queue to the member with stable id `id`.
    pub(crate) fn by_id(&self, id: u32) -> Option<&mpsc::Sender<Vec<u8>>> {
        self.by_id.get(&id).map(|l| &l.tx)
    }

    /// Whether node `id` is a peer now: a member of this node's epoch, or a stage node.
    pub(crate) fn trusts(&self, id: u32) -> bool {
        self.by_id.contains_key(&id)
    }

    /// Sends a node-plane message to peer `to`; one to a node that is no peer now is
    /// dropped and counted (`keel_plane_rejected_total{kind="unknown-peer"}`).
    pub(crate) fn send_plane(&self, to: u32, payload: Vec<u8>, m: &Metrics) {
        match self.by_id(to) {
            Some(tx) => offer(tx, node_frame(self.epoch, &Message::Plane { payload }), &self.stats),
            None => {
                m.plane_rejected.get_or_create(&KindLabels { kind: "unknown-peer".into() }).inc();
            }
        }
    }

    /// The membership epoch frames are tagged with.
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch
    }

    pub(crate) fn connected(&self) -> u64 {
        self.by_id.values().filter(|l| l.link.connected()).count() as u64
    }
}

/// Encodes node messages as frames tagged with `epoch`, handing each to `each`. A run
/// of equal messages (a broadcast's copies, which `Replica::broadcast` keeps
/// consecutive) is encoded once and its bytes copied: a PROPOSE carries a whole batch.
fn node_frames(sends: Vec<(NodeId, Message)>, epoch: u64, mut each: impl FnMut(NodeId, Vec<u8>)) {
    let mut sends = sends.into_iter().peekable();
    while let Some((to, msg)) = sends.next() {
        let frame = node_frame(epoch, &msg);
        while let Some((copy_to, _)) = sends.next_if(|(_, next)| *next == msg) {
            each(copy_to, frame.clone());
        }
        each(to, frame);
    }
}

/// Fault injection (`[faults] slow_propose_ms`): sends this step's PROPOSEs late, so
/// tests can show that a primary slow within its timers is replaced.
fn hold_back_proposals(
    faults: &FaultsFile,
    started: u64,
    out: &mut Outputs,
    peers: &Peers,
    stats: &Arc<TransportStats>,
) {
    if faults.slow_propose_ms == 0 || now_ms() < started + faults.slow_after_ms {
        return;
    }
    let delay = Duration::from_millis(faults.slow_propose_ms);
    for queue in [&mut out.send, &mut out.send_after_persist] {
        let (proposals, rest): (Vec<_>, Vec<_>) =
            queue.drain(..).partition(|(to, m)| matches!((to, m), (Peer::Node(_), Message::Propose { .. })));
        *queue = rest;
        for (to, msg) in proposals {
            let Peer::Node(j) = to else { continue };
            let Some(tx) = peers.route(j).cloned() else { continue };
            let (frame, stats) = (node_frame(peers.epoch, &msg), stats.clone());
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                offer(&tx, frame, &stats);
            });
        }
    }
}

/// Updates the gauges and the `/status` snapshot of any node (every tick: cheap, no
/// locks held long).
pub(crate) fn publish<N: Node>(
    node: &N,
    id: NodeId,
    m: &Metrics,
    shared: &Shared,
    inbound: usize,
    connected: u64,
    logged: &mut u64,
) {
    let st = node.status();
    let cfg = node.config();
    m.view.set(st.view.0 as i64);
    m.epoch.set(cfg.epoch() as i64);
    m.executed.set(st.executed.0 as i64);
    m.stable.set(st.stable.0 as i64);
    m.inbound_queue.set(inbound as i64);
    m.transfer_permille.set(st.transfer.map_or(1000, |(have, total)| (have * 1000 / total.max(1)) as i64));
    match st.transfer {
        Some((have, total)) if total > 0 => {
            let tenth = (have * 10 / total) as u64;
            if tenth != *logged {
                *logged = tenth;
                tracing::info!(have, total, "state transfer: {}% of {total} chunks", have * 100 / total);
            }
        }
        _ => *logged = u64::MAX,
    }
    if let Ok(mut s) = shared.status.lock() {
        *s = Status {
            node: id.0,
            view: st.view,
            primary: (cfg.primary(st.view)).0,
            view_change_to: st.view_change_to,
            executed: st.executed.0,
            stable: st.stable.0,
            peers_connected: connected,
            peers: st.peers as u64,
            transfer: st.transfer,
            epoch: cfg.epoch(),
            members: cfg.membership.members.iter().map(|x| x.id).collect(),
            quorum: cfg.quorums.order_quorum() as u64,
            service: Vec::new(),
            divergences: m.divergences.get(),
            diverged_at: match m.last_divergence.get() {
                seq if seq > 0 => Some(seq as u64),
                _ => None,
            },
        };
    }
}

/// What handling an input needs besides the node: where answers go and what is counted.
pub(crate) struct Link<'a> {
    pub(crate) peers: &'a Peers,
    pub(crate) stats: &'a TransportStats,
    pub(crate) plane: &'a PlaneIn,
    pub(crate) m: &'a Metrics,
}

/// Steps any node with one inbound event: node messages as the node admits them
/// ([`Node::admit`]: the one place stable ids become the names a core counts by), the
/// node plane's to the service, client connections to the client table.
pub(crate) fn handle<N: Node>(node: &mut N, ev: Inbound, clients: &mut Clients, out: &mut Outputs, link: &Link) {
    match ev {
        Inbound::Input(input) => node.step(now_ms(), input, out),
        // The service's, not the protocol's: whoever sent it, in whatever epoch.
        Inbound::Node { from, msg: Message::Plane { payload }, .. } => {
            link.plane.deliver(NodeId(from), link.peers.trusts(from), payload, link.m)
        }
        Inbound::Node { from, epoch, msg, checked } => match node.admit(NodeId(from), epoch, msg, checked) {
            Admit::Step(input) => node.step(now_ms(), input, out),
            Admit::Answer(answer) => {
                if let Some(tx) = link.peers.by_id(from) {
                    offer(tx, node_frame(link.peers.epoch, &answer), link.stats);
                }
            }
            Admit::Drop => {}
        },
        Inbound::ClientUp { id, conn, tx, close } => clients.up(id, conn, tx, close),
        Inbound::ClientDown { id, conn } => clients.down(id, conn),
    }
}

/// Hands the step(s)' records to the WAL thread and sends: ungated messages now, gated
/// ones through the WAL thread once their records (and all earlier ones) are durable.
pub(crate) fn flush(
    committer: Option<&mut Committer>,
    out: &mut Outputs,
    peers: &Peers,
    clients: &mut Clients,
    stats: &TransportStats,
    m: &Metrics,
) -> Result<bool, NodeError> {
    if out.is_empty() {
        return Ok(false);
    }
    let barrier = std::mem::take(&mut out.barrier);
    let epoch = peers.epoch;
    // The queue, and for a node the epoch its frame is tagged with.
    let route = |to: Peer| -> Option<(&mpsc::Sender<Vec<u8>>, Option<u64>)> {
        match to {
            Peer::Node(j) => peers.route(j).map(|tx| (tx, Some(epoch))),
            // Sessions share their owner's connection.
            Peer::Client(c) => clients.route(owner_of(c)).map(|tx| (tx, None)),
        }
    };
    // A stage that keeps no log (an RQ node) persists nothing: nothing waits.
    let wait = !out.persist.is_empty() || committer.as_ref().is_some_and(|c| !c.idle());
    if !wait {
        // Every record persisted so far is durable: gated messages wait for nothing.
        let mut gated = std::mem::take(&mut out.send_after_persist);
        out.send.append(&mut gated);
    }
    let mut to_nodes = Vec::new();
    for (to, msg) in out.send.drain(..) {
        match to {
            Peer::Node(j) => to_nodes.push((j, msg)),
            // Sessions share their owner's connection.
            Peer::Client(c) => {
                if let Some(tx) = clients.route(owner_of(c)) {
                    offer(tx, codec::encode(&msg), stats)
                }
            }
        }
    }
    node_frames(to_nodes, epoch, |j, frame| {
        if let Some(tx) = peers.route(j) {
            offer(tx, frame, stats)
        }
    });
    if wait || !out.persist_lazy.is_empty() {
        let gated: Vec<Gated> = out
            .send_after_persist
            .drain(..)
            .filter_map(|(to, msg)| route(to).map(|(tx, epoch)| (tx.clone(), msg, epoch)))
            .collect();
        match committer {
            Some(c) => c.submit(std::mem::take(&mut out.persist), std::mem::take(&mut out.persist_lazy), gated)?,
            None => return Err(NodeError::Runtime("records to persist on a node that keeps no log".into())),
        }
    }
    record_events(out, clients, m);
    Ok(barrier)
}

/// Counts and logs the step(s)' events.
pub(crate) fn record_events(out: &mut Outputs, clients: &mut Clients, m: &Metrics) {
    for e in out.events.drain(..) {
        match e {
            Event::Rejected { from, kind, reason } => {
                m.rejected.get_or_create(&KindLabels { kind: kind.to_string() }).inc();
                tracing::debug!(?from, kind, %reason, "rejected");
                if let (Peer::Client(c), Reject::BadMac { .. }) = (from, &reason) {
                    if clients.bad_mac(owner_of(c), now_ms()) {
                        m.banned_clients.inc();
                        tracing::warn!(client = owner_of(c).0, "client sent too many requests with bad MACs: dropped");
                    }
                }
            }
            Event::Decided { .. } => {
                m.decided.inc();
            }
            Event::Ticked { seq, time } => {
                m.ticks.inc();
                let _ = m.events.send(NodeEvent::Ticked { seq, time });
            }
            Event::SlowPrimary { view, rate, best } => {
                m.slow_primary.inc();
                tracing::warn!(view = view.0, rate, best, "primary too slow: asking for the next view");
            }
            Event::ReadAnswered { consistency } => {
                m.reads_answered.get_or_create(&KindLabels { kind: consistency.name().to_string() }).inc();
            }
            Event::Executed { requests, .. } => {
                m.executed_requests.inc_by(requests.len() as u64);
                m.batch_size.observe(requests.len() as f64);
            }
            Event::ViewChangeStarted { view } => {
                m.view_changes.inc();
                tracing::info!(view = view.0, "view change started");
            }
            Event::ViewInstalled { view } => {
                let _ = m.events.send(NodeEvent::ViewInstalled { view });
                tracing::info!(view = view.0, "view installed")
            }
            Event::RejoinBounds { view, executed } => {
                tracing::warn!(view = view.0, executed = executed.0, "rejoining after a lost disk: no votes until this view and this instance plus a log window are stable")
            }
            Event::Rejoined { view, stable } => {
                tracing::warn!(view = view.0, stable = stable.0, "rejoined: voting again")
            }
            Event::StateTransferStarted { seq, replacing } => {
                m.state_transfers.inc();
                match replacing {
                    None => tracing::info!(seq = seq.0, "state transfer started"),
                    Some(old) => tracing::info!(
                        seq = seq.0,
                        old = old.0,
                        "state transfer moved on to the newer stable checkpoint {seq} (peers serve only their newest; \
                         the chunks fetched for {old} are kept)"
                    ),
                }
            }
            Event::StateTransferDone { seq, chunks, reused } => {
                let _ = m.events.send(NodeEvent::StateTransferDone { seq });
                m.transfer_chunks.inc_by(chunks as u64);
                m.transfer_chunks_reused.inc_by(reused as u64);
                tracing::info!(seq = seq.0, chunks, reused, "state transfer done");
            }
            Event::Divergence { seq, local, stable } => {
                m.divergences.inc();
                m.last_divergence.set(seq.0 as i64);
                tracing::error!(
                    seq = seq.0,
                    ?local,
                    ?stable,
                    "this node's state diverged: its checkpoint {seq} differs from the one a quorum certified; \
                     repairing by state transfer (clients are served by the others meanwhile)"
                )
            }
            Event::PushDropped { client, count } => {
                m.push_dropped.inc_by(count);
                tracing::debug!(client = client.0, count, "push events dropped: queue full");
            }
            Event::EpochEnded { epoch, seq } => {
                let _ = m.events.send(NodeEvent::EpochEnded { next: epoch, seq });
                tracing::info!(next = epoch, seq = seq.0, "membership epoch ended");
            }
            // The order host follows them (`before_flush`), which logs them.
            Event::EpochStarted { .. } | Event::Removed { .. } => {}
            Event::OperationsFetched { count, .. } => {
                m.operations_fetched.inc_by(count as u64);
            }
            Event::SnapshotUnreadable { why } => {
                m.snapshot_unreadable.inc();
                tracing::error!(%why, "checkpoint bytes could not be read back from the snapshot packs (a damaged disk?)");
            }
            Event::Checkpoint { .. } | Event::Stable { .. } => {}
        }
    }
}

/// Queues of the verify stage's threads, one per thread; peer `j` uses `j % len`.
pub(crate) type VerifyQueues = Arc<[mpsc::Sender<(u32, u64, Message)>]>;

/// What the verify stage checks against: one epoch's verifier (its keys and members).
/// The protocol task replaces it when an epoch starts; a message of another epoch passes
/// unchecked (the protocol task decides what to do with it).
struct EpochVerifier {
    epoch: u64,
    verifier: Verifier,
}

impl EpochVerifier {
    fn of<S: Service>(replica: &Replica<S>) -> EpochVerifier {
        EpochVerifier { epoch: replica.epoch(), verifier: replica.verifier() }
    }

    /// Whether the signature of `msg` from stable id `from`, sent in `epoch`, is valid.
    fn check(&self, from: u32, epoch: u64, msg: &Message) -> bool {
        epoch == self.epoch && self.verifier.check(NodeId(from), msg)
    }
}

/// Messages waiting for one verify thread; when full, the peer's reader waits
/// (backpressure onto its TCP connection), like the inbound queue itself.
const VERIFY_QUEUE_MAX: usize = 4096;

/// Starts the verify stage (BFT-SMaRt §III): `threads` OS threads that check peers'
/// vote signatures (`Verifier::check`) and hand each message on to the protocol task,
/// vouched for or not. None when `threads` is 0: the protocol task checks them.
fn start_verify_stage(
    threads: usize,
    verifier: &Arc<RwLock<EpochVerifier>>,
    in_tx: &InboundTx,
    stats: &Arc<TransportStats>,
) -> Option<VerifyQueues> {
    let mut queues = Vec::with_capacity(threads);
    for t in 0..threads {
        let (tx, mut rx) = mpsc::channel::<(u32, u64, Message)>(VERIFY_QUEUE_MAX);
        let (verifier, in_tx, stats) = (verifier.clone(), in_tx.clone(), stats.clone());
        let spawned = std::thread::Builder::new().name(format!("keel-verify-{t}")).spawn(move || {
            while let Some((from, epoch, msg)) = rx.blocking_recv() {
                let checked = verifier.read().is_ok_and(|v| v.check(from, epoch, &msg));
                if checked {
                    TransportStats::bump(&stats.stage_verified, 1);
                }
                if !in_tx.blocking_node(Inbound::Node { from, epoch, msg, checked }) {
                    return;
                }
            }
        });
        match spawned {
            Ok(_) => queues.push(tx),
            Err(e) => {
                tracing::warn!(%e, "cannot start the verify stage; the protocol task verifies");
                return None;
            }
        }
    }
    (!queues.is_empty()).then(|| queues.into())
}

/// Reads frames from one accepted connection; for clients, also writes replies back.
async fn serve_connection(
    acc: Accepted,
    conn: u64,
    in_tx: InboundTx,
    verify: Option<VerifyQueues>,
    stats: Arc<TransportStats>,
    bans: Arc<Bans>,
) {
    let from = match acc.peer {
        // Any node the CA certified: members change (membership.rs), and a frame from a
        // node that is not a member of the receiver's epoch is dropped there.
        PeerId::Node(j) if (j.0 as usize) < keel_core::quorum::NODES_MAX => Peer::Node(j),
        PeerId::Node(_) => {
            TransportStats::bump(&stats.rejected_connections, 1);
            return;
        }
        PeerId::Client(c) if bans.banned(c, now_ms()) => {
            TransportStats::bump(&stats.rejected_connections, 1);
            return;
        }
        PeerId::Client(c) => Peer::Client(c),
    };
    let (mut r, w) = tokio::io::split(acc.stream);
    let quota = ClientQuota::new();
    let close = Arc::new(tokio::sync::Notify::new());
    let mut writer = None;
    if let Peer::Client(id) = from {
        let (tx, mut rx) = mpsc::channel(SEND_QUEUE_MAX);
        if !in_tx.client(&quota, Inbound::ClientUp { id, conn, tx, close: close.clone() }).await {
            return;
        }
        let stats = stats.clone();
        writer = Some(tokio::spawn(async move {
            let _ = write_frames(w, &mut rx, &stats).await;
        }));
    }
    loop {
        let read = tokio::select! {
            read = read_frame(&mut r) => read,
            _ = close.notified() => break,
        };
        match read {
            Ok(Some(frame)) => {
                TransportStats::bump(&stats.frames_in, 1);
                TransportStats::bump(&stats.bytes_in, frame.len() as u64 + 4);
                // Node frames carry the sender's epoch before the message.
                let (epoch, body) = match from {
                    Peer::Node(_) => match split_node_frame(&frame) {
                        Some((epoch, body)) => (epoch, body),
                        None => {
                            TransportStats::bump(&stats.undecodable, 1);
                            continue;
                        }
                    },
                    Peer::Client(_) => (0, &frame[..]),
                };
                match codec::decode(body) {
                    Ok(msg) => {
                        let sent = match (from, &verify) {
                            (Peer::Node(j), Some(q)) => q[j.0 as usize % q.len()].send((j.0, epoch, msg)).await.is_ok(),
                            (Peer::Node(j), None) => {
                                in_tx.node(Inbound::Node { from: j.0, epoch, msg, checked: false }).await
                            }
                            (Peer::Client(_), _) => {
                                in_tx.client(&quota, Inbound::Input(Input::Message { from, msg })).await
                            }
                        };
                        if !sent {
                            break;
                        }
                    }
                    Err(_) => TransportStats::bump(&stats.undecodable, 1),
                }
            }
            Ok(None) => break,
            Err(e) => {
                if e.kind() == std::io::ErrorKind::InvalidData {
                    TransportStats::bump(&stats.oversized, 1);
                }
                break;
            }
        }
    }
    if let Peer::Client(id) = from {
        let _ = in_tx.client(&quota, Inbound::ClientDown { id, conn }).await;
    }
    if let Some(w) = writer {
        w.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_core::ids::{Seq, View};
    use keel_core::message::{Proposal, Proposed, Request};

    fn propose(seq: u64, ops: usize) -> Message {
        let requests = (0..ops as u64)
            .map(|c| Proposed::Full(Request::new(keel_core::message::ClientId(c), 1, vec![7u8; 64].into())))
            .collect();
        Message::Propose { view: View(0), seq: Seq(seq), value: Proposal { time: 1, requests } }
    }

    fn decoded(frame: &[u8]) -> (u64, Message) {
        let (epoch, body) = split_node_frame(frame).expect("a node frame");
        (epoch, codec::decode(body).expect("decodes"))
    }

    #[test]
    fn a_run_of_equal_messages_shares_one_encoding_and_every_other_gets_its_own() {
        let (a, b) = (propose(1, 20), propose(2, 20));
        let stop = Message::Stop { view: View(9) };
        let sends = vec![
            (NodeId(1), a.clone()),
            (NodeId(2), a.clone()),
            (NodeId(3), a.clone()),
            (NodeId(1), b.clone()),
            (NodeId(2), stop.clone()),
            (NodeId(3), a.clone()),
        ];
        let mut got = Vec::new();
        node_frames(sends, 4, |to, frame| got.push((to, frame)));
        got.sort_by_key(|(to, _)| to.0);
        let frames: Vec<(u32, u64, Message)> = got
            .iter()
            .map(|(to, f)| {
                let (epoch, msg) = decoded(f);
                (to.0, epoch, msg)
            })
            .collect();
        assert_eq!(
            frames,
            vec![(1, 4, a.clone()), (1, 4, b), (2, 4, a.clone()), (2, 4, stop), (3, 4, a.clone()), (3, 4, a)]
        );
        // The broadcast's three copies are the same bytes.
        let of = |to: u32| got.iter().find(|(t, _)| t.0 == to).map(|(_, f)| f.clone());
        assert_eq!(of(1), of(2));
        assert_eq!(of(2), of(3));
    }
}
