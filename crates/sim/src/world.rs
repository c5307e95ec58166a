//! The simulated cluster: nodes, clients, network, disks and the nemesis that breaks them,
//! all driven by one seeded event queue so a seed replays the same run exactly.
//!
//! A run has two phases. In the **fault phase** clients issue operations while the nemesis
//! crashes nodes (sometimes all of them), tears writes, partitions and heals the network,
//! drops, duplicates and delays messages, and up to r nodes lie. Then everything **heals**
//! (crashed nodes restart, partitions close, the network turns reliable; Byzantine nodes
//! stay Byzantine) and every outstanding operation must complete within a bound.
//!
//! Safety properties are checked online, on every event of every correct node; the
//! history's linearizability at the end.

use crate::byzantine::{Behaviours, Byzantine, ExecByzantine, LieCounts, RqByzantine};
use crate::disk::SimDisk;
use crate::mutation::DriverMutation;
use crate::workload::{HistoryEntry, NodeStart, Workload};
use keel_core::client::{Client, Pushed};
use keel_core::codec;
use keel_core::config::{stage_id, stage_node, Auth, ClusterConfig, Options};
use keel_core::crypto::{Digest, MacKey, SigningKey};
use keel_core::exec_node::ExecNode;
use keel_core::ids::NodeRange;
use keel_core::membership::{AdminOp, Change, Member, Membership, ADMIN_CLIENT};
use keel_core::message::{
    owner_of, session_id, session_of, ClientId, Message, NodeId, Read, Reply, ReplyBody, Request, Seq, View,
};
use keel_core::node::{Admit, Node};
use keel_core::quorum::{Mutation, Quorums};
use keel_core::replica::{
    client_mac_key, endorse_key, CheckpointJob, Durable, Event, Input, NodeSecrets, Outputs, Peer, Replica,
};
use keel_core::rq_node::RqNode;
use keel_core::service::{ReadCtx, Service};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, VecDeque};

/// Which faults the nemesis injects.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultSet {
    pub crash: bool,
    pub network: bool,
    pub byzantine: bool,
}

impl FaultSet {
    pub fn parse(s: &str) -> Option<FaultSet> {
        let mut f = FaultSet::default();
        for part in s.split(',') {
            match part {
                "none" => {}
                "crash" => f.crash = true,
                "network" => f.network = true,
                "byzantine" => f.byzantine = true,
                "all" => f = FaultSet { crash: true, network: true, byzantine: true },
                _ => return None,
            }
        }
        Some(f)
    }

    pub fn any(&self) -> bool {
        self.crash || self.network || self.byzantine
    }
}

#[derive(Clone, Debug)]
pub struct SimOptions {
    pub seed: u64,
    pub u: u32,
    pub r: u32,
    pub faults: FaultSet,
    /// Events processed in the fault phase.
    pub steps: u64,
    pub clients: usize,
    pub mutation: Option<Mutation>,
    /// A deliberate bug in the simulator's driver side (mutation.rs); read through
    /// [`SimOptions::driver_mutation`], which ignores it without the `mutations` feature.
    pub driver_mutation: Option<DriverMutation>,
    /// Simulated ms after healing within which every outstanding operation must finish.
    pub liveness_ms: u64,
    pub options: Options,
    /// Pin which nodes are Byzantine and how (scenario tests); None: chosen by the seed.
    pub byzantine: Option<(Vec<NodeId>, Behaviours)>,
    /// Request authentication; None: the default for (u, r) (`Auth::default_for`).
    pub auth: Option<Auth>,
    /// Run a client whose MACs are valid for some nodes only; None: with Byzantine faults,
    /// unless `auth = mac` with r > 0.
    pub faulty_client: Option<bool>,
    /// An administrator adds and removes nodes during the fault phase (membership.rs).
    pub reconfig: bool,
    /// Separated execution (UpRight §4.2): `2u + 1` execution nodes besides the order
    /// nodes (exec_node.rs); up to r of them Byzantine under Byzantine faults.
    pub separated: bool,
    /// A separate request-quorum stage (UpRight §4.1): `2u + r + 1` RQ nodes besides the
    /// order nodes (rq_node.rs); up to r of them Byzantine under Byzantine faults. Needs
    /// `auth = rq-mac`.
    pub rq_separated: bool,
}

impl SimOptions {
    pub fn new(seed: u64, u: u32, r: u32, faults: FaultSet) -> SimOptions {
        SimOptions {
            seed,
            u,
            r,
            faults,
            steps: 20_000,
            clients: 4,
            mutation: None,
            driver_mutation: None,
            liveness_ms: 60_000,
            options: Options::test_min(),
            byzantine: None,
            auth: None,
            faulty_client: None,
            reconfig: false,
            separated: false,
            rq_separated: false,
        }
    }

    /// The driver-side bug switched on, if any: always None in a build without the
    /// `mutations` feature (as [`Quorums::mutation`] for the core's).
    pub fn driver_mutation(&self) -> Option<DriverMutation> {
        self.driver_mutation.filter(|_| cfg!(feature = "mutations"))
    }

    /// These options with agreed-time ticks every `tick_ms` if they have none: what a
    /// service whose model needs ticks (session expiry, idle epochs) runs under.
    pub fn ticking(&self, tick_ms: u64) -> SimOptions {
        let mut o = self.clone();
        if o.options.tick_ms == 0 {
            o.options.tick_ms = tick_ms;
        }
        o
    }
}

/// A property that failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Violation {
    pub property: &'static str,
    pub detail: String,
    /// Simulated time (ms) it was detected.
    pub at: u64,
}

/// Faults injected in one run.
#[derive(Clone, Debug, Default)]
pub struct FaultCounts {
    pub crashes: u64,
    pub total_outages: u64,
    pub restarts: u64,
    pub torn_writes: u64,
    pub partitions: u64,
    pub dropped: u64,
    pub duplicated: u64,
    pub delayed: u64,
    pub skewed_clocks: u64,
    pub byzantine_nodes: u64,
    /// Requests (and retransmissions) of a faulty client whose MACs were valid for some
    /// nodes only.
    pub inconsistent_macs: u64,
    /// Membership changes the administrator asked for, and those applied.
    pub admin_ops: u64,
    pub epochs: u64,
    /// Crashes of a node as its epoch ended.
    pub epoch_switch_crashes: u64,
    /// Nodes whose disk was wiped at a crash (they restart empty and rejoin), and
    /// rejoinings completed.
    pub wipes: u64,
    pub rejoined: u64,
    /// Crashes right after a step whose messages left before its records were durable.
    pub crashes_before_sync: u64,
    /// Nodes crashed for good (never restarted).
    pub gone: u64,
    /// Clocks stepped forward or back during a run.
    pub clock_jumps: u64,
    /// Nodes made stragglers for a while (every message to or from them held longer).
    pub stragglers: u64,
    /// Honest order nodes crashed while a wiped node rejoined (the multi-process test's
    /// kill -9 during recovery).
    pub crashes_during_rejoin: u64,
    /// Honest nodes that turned Byzantine once their epoch's r left room for them.
    pub latent_turned: u64,
    pub lies: LieCounts,
    /// Lies of Byzantine execution nodes (separated execution; `ExecByzantine`).
    pub exec_lies: u64,
    /// Lies of Byzantine RQ nodes (a separate RQ stage; `RqByzantine`).
    pub rq_lies: u64,
}

impl FaultCounts {
    pub fn total(&self) -> u64 {
        let l = &self.lies;
        self.crashes
            + self.restarts
            + self.torn_writes
            + self.partitions
            + self.dropped
            + self.duplicated
            + self.delayed
            + self.skewed_clocks
            + self.wipes
            + self.clock_jumps
            + self.inconsistent_macs
            + l.total()
            + self.exec_lies
            + self.rq_lies
    }

    pub fn add(&mut self, o: &FaultCounts) {
        self.crashes += o.crashes;
        self.total_outages += o.total_outages;
        self.restarts += o.restarts;
        self.torn_writes += o.torn_writes;
        self.partitions += o.partitions;
        self.dropped += o.dropped;
        self.duplicated += o.duplicated;
        self.delayed += o.delayed;
        self.skewed_clocks += o.skewed_clocks;
        self.byzantine_nodes += o.byzantine_nodes;
        self.inconsistent_macs += o.inconsistent_macs;
        self.admin_ops += o.admin_ops;
        self.epochs += o.epochs;
        self.epoch_switch_crashes += o.epoch_switch_crashes;
        self.wipes += o.wipes;
        self.latent_turned += o.latent_turned;
        self.stragglers += o.stragglers;
        self.crashes_during_rejoin += o.crashes_during_rejoin;
        self.crashes_before_sync += o.crashes_before_sync;
        self.gone += o.gone;
        self.clock_jumps += o.clock_jumps;
        self.rejoined += o.rejoined;
        self.lies.add(&o.lies);
        self.exec_lies += o.exec_lies;
        self.rq_lies += o.rq_lies;
    }
}

#[derive(Clone, Debug, Default)]
pub struct SeedReport {
    pub seed: u64,
    pub steps: u64,
    pub violations: Vec<Violation>,
    pub faults: FaultCounts,
    pub trace_hash: u64,
    pub ops_completed: u64,
    /// Read-only operations answered without ordering, and ones the client had to order.
    pub reads_unordered: u64,
    pub reads_ordered: u64,
    pub view_changes: u64,
    pub state_transfers: u64,
    /// Chunks installed by finished transfers of correct nodes, and those already held.
    pub transfer_chunks: u64,
    pub transfer_chunks_reused: u64,
    /// Checkpoints serialized in the background and handed back; and those whose node
    /// crashed first.
    pub checkpoints_background: u64,
    pub checkpoints_lost: u64,
    /// Request digests: operations correct primaries proposed by digest (counted per
    /// PROPOSE sent), and those correct backups fetched from endorsers (bodies.rs).
    pub ops_by_digest: u64,
    pub ops_fetched: u64,
    pub rejected: u64,
    /// Rejections by "message kind: reason", for diagnosis.
    pub rejected_by: BTreeMap<String, u64>,
    pub max_executed: Seq,
    /// Simulated times at which client operations completed (throughput over time).
    pub completed_at: Vec<u64>,
    /// Simulated ms the fault phase lasted (its `steps` events; then the run heals).
    pub fault_phase_ms: u64,
    /// When each view was first installed by a correct node.
    pub views_installed: BTreeMap<View, u64>,
    /// Times correct nodes asked to replace a primary for being slow (leadership.rs).
    pub slow_primary_suspicions: u64,
    /// Push events clients accepted, and gaps they were told of.
    pub pushes_delivered: u64,
    pub push_gaps: u64,
    /// Instances at which the service ran an agreed-time tick (`Options::tick_ms`).
    pub ticks: u64,
    /// The last trace lines, printed when the run failed.
    pub trace_tail: Vec<String>,
}

impl SeedReport {
    /// For tests: panics unless the run violated nothing, printing the violations and the
    /// trace's tail (the seed replays with `keel sim --seeds 1 --seed N`).
    pub fn assert_clean(&self) {
        assert!(
            self.violations.is_empty(),
            "seed {} violated {:?}\ntrace:\n{}",
            self.seed,
            self.violations,
            self.trace_tail.join("\n")
        );
    }
}

enum Ev {
    /// Node peers are stable ids; `epoch` is the sending node's (0 from clients).
    Deliver {
        to: Peer,
        from: Peer,
        frame: Vec<u8>,
        epoch: u64,
    },
    NodeTick(NodeId),
    ClientTick(usize),
    /// The faulty client sends its next request.
    FaultyClient,
    /// A group commit completes: the step's facts become durable (and are checked) and
    /// its gated messages go out.
    Sync {
        node: NodeId,
        epoch: u64,
        upto: u64,
        gated: Vec<(Peer, Message)>,
        facts: Vec<Event>,
        /// The membership epoch the node was in when it produced them.
        member_epoch: u64,
    },
    /// The administrator asks for the next membership change.
    Admin,
    /// The administrator's client core retransmits.
    AdminTick,
    Restart(NodeId),
    /// A crash the nemesis scheduled (at an epoch switch); a restart follows.
    Crash(NodeId),
    /// A crash of an order node while a wiped node rejoins; a restart follows.
    CrashDuringRejoin(NodeId),
    /// A checkpoint the node froze is serialized (only now, so a freeze that is not a
    /// true copy shows later writes) and handed back, unless the node crashed since.
    CheckpointDone {
        node: NodeId,
        epoch: u64,
        job: CheckpointJob,
    },
    Nemesis,
}

struct Scheduled {
    at: u64,
    id: u64,
    ev: Ev,
}

impl PartialEq for Scheduled {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.id) == (o.at, o.id)
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Scheduled {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.at, self.id).cmp(&(o.at, o.id))
    }
}

/// What a node (by stable id) is to the cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Member,
    /// Provisioned but not added yet.
    Spare,
    /// Removed by the administrator: stopped for good.
    Removed,
}

/// The stage a node runs (UpRight §4): fixed for its life, whether it is up or down.
/// Co-located, every node is an order node running all three stages in one core.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    Order,
    /// Separated execution: an execution node.
    Exec,
    /// A separate RQ stage: an RQ node (on disk only the epoch certificates it followed:
    /// a restart starts it afresh in that epoch).
    Rq,
}

/// The core of a node that is up: its stage's state machine.
// One per node, set at a start and never moved about: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
enum Core<S> {
    Order(Replica<S>),
    Exec(ExecNode<S>),
    Rq(RqNode),
}

struct SimNode<S> {
    stage: Stage,
    /// None while the node is down.
    core: Option<Core<S>>,
    exec_byzantine: Option<ExecByzantine>,
    /// The epoch certificates an RQ node followed: what its driver keeps on disk.
    rq_certs: Vec<keel_core::message::EpochCert>,
    rq_byzantine: Option<RqByzantine>,
    role: Role,
    /// The membership its configuration file names (the admin's reply for a node added
    /// later), used when its disk names none.
    file_membership: Option<Membership>,
    disk: SimDisk,
    /// Its disk was wiped, and it has not rejoined since: it restarts as a rejoining
    /// node while its disk is empty, and counts against the faults budget until then.
    wiped: bool,
    /// Crashed for good: never restarted, not even to heal (it counts against u).
    gone: bool,
    /// The highest membership epoch this order node (while correct) sent a message in
    /// since its disk was last wiped. Its log must name that epoch or a later one when
    /// it restarts (`restart` checks): its first step in an epoch comes after the
    /// barrier that makes the epoch's log durable (replica/epoch.rs). A node back in
    /// the old epoch would start the new one afresh and could propose twice in view 0.
    epoch_sent_max: u64,
    /// Bumped at every crash so syncs issued before it are void.
    epoch: u64,
    secrets: NodeSecrets,
    /// This node's clock minus the true time (ms).
    skew: i64,
    byzantine: Option<Byzantine>,
    /// Honest while its epoch tolerates no more Byzantine nodes than already lie; turns
    /// Byzantine with these behaviours once it runs an epoch whose r leaves room for it
    /// (`turn_byzantine`): what a raised r is for, and what clients that have not
    /// followed the change yet must not believe (issue #21 defect 3).
    latent: Option<Behaviours>,
    /// A Byzantine node that rushes reads answers from this older state of its own:
    /// (executed, snapshot), refreshed once it is `STALE_READ_LAG` instances behind.
    stale_state: Option<(Seq, Vec<u8>)>,
}

impl<S: Service> SimNode<S> {
    /// A node before its core is set: a member from the start, its clock exact, honest,
    /// its disk empty. Order nodes set their replica, role, skew and Byzantine behaviour;
    /// execution and RQ nodes their core (membership changes never move them).
    /// The membership epoch an execution or RQ node runs.
    /// The core this node runs, whichever it is, to step.
    fn core_mut(&mut self) -> Option<&mut dyn Node> {
        match self.core.as_mut()? {
            Core::Order(r) => Some(r),
            Core::Exec(e) => Some(e),
            Core::Rq(q) => Some(q),
        }
    }

    /// The core this node runs, whichever it is.
    fn core(&self) -> Option<&dyn Node> {
        match self.core.as_ref()? {
            Core::Order(r) => Some(r),
            Core::Exec(e) => Some(e),
            Core::Rq(q) => Some(q),
        }
    }

    /// The replica of an order node that is up.
    fn replica(&self) -> Option<&Replica<S>> {
        match &self.core {
            Some(Core::Order(r)) => Some(r),
            _ => None,
        }
    }

    /// The membership epoch of a node that is up (None while down).
    fn running_epoch(&self) -> Option<u64> {
        match self.core.as_ref()? {
            Core::Order(r) => Some(r.epoch()),
            Core::Exec(e) => Some(e.config().epoch()),
            Core::Rq(q) => Some(q.epoch()),
        }
    }

    fn blank(secrets: NodeSecrets) -> SimNode<S> {
        SimNode {
            stage: Stage::Order,
            core: None,
            exec_byzantine: None,
            rq_certs: Vec::new(),
            rq_byzantine: None,
            role: Role::Member,
            file_membership: None,
            disk: SimDisk::default(),
            wiped: false,
            gone: false,
            epoch_sent_max: 0,
            epoch: 0,
            secrets,
            skew: 0,
            byzantine: None,
            latent: None,
            stale_state: None,
        }
    }

    fn up(&self) -> bool {
        self.core.is_some()
    }

    fn status_line(&self) -> String {
        match &self.core {
            Some(Core::Order(r)) => r.status_line(),
            Some(Core::Exec(e)) => e.status_line(),
            Some(Core::Rq(q)) => q.status_line(),
            None => "down".into(),
        }
    }

    fn executed(&self) -> Option<Seq> {
        match self.core.as_ref()? {
            Core::Order(r) => Some(r.executed()),
            Core::Exec(e) => Some(e.executed()),
            Core::Rq(_) => None,
        }
    }
}

/// How far behind (instances) the state a read-rushing Byzantine node answers from gets.
const STALE_READ_LAG: Seq = Seq(8);

struct SimClient {
    core: Client,
    /// Index into the history of the in-flight operation.
    inflight: Option<usize>,
    /// Partition side.
    side: u8,
    /// The next push event number the client must be given (an event or a gap).
    push_next: u64,
}

const NODE_TICK_MS: u64 = 5;
/// Nodes provisioned for the administrator to add (`SimOptions::reconfig`).
const SPARES: usize = 2;
const CLIENT_TICK_MS: u64 = 10;
const TRACE_TAIL_MAX: usize = 40;
/// `KEEL_SIM_TRACE_TAIL=N` keeps the last N trace lines instead (debugging a seed).
fn trace_tail_max() -> usize {
    std::env::var("KEEL_SIM_TRACE_TAIL").ok().and_then(|v| v.parse().ok()).unwrap_or(TRACE_TAIL_MAX)
}

pub struct World<W: Workload> {
    opts: SimOptions,
    /// Epoch 0's configuration (later ones derive from it).
    cfg: ClusterConfig,
    /// Member stable ids of each epoch some node ran, in index order.
    memberships: BTreeMap<u64, Vec<u32>>,
    admin_key: SigningKey,
    /// The administrator's client core and, while one is in flight, the change.
    /// Its sessions: each a client core and, while one is in flight, the change asked.
    admin: Vec<(Client, Option<Change>)>,
    workload: W,
    rng: ChaCha8Rng,
    now: u64,
    queue: BinaryHeap<Reverse<Scheduled>>,
    next_id: u64,
    nodes: Vec<SimNode<W::Service>>,
    clients: Vec<SimClient>,
    /// Partition side of each node (all equal: no partition).
    sides: Vec<u8>,
    lossy: bool,
    /// A straggler: a node every message to or from which is held longer, until the
    /// given time (a GC pause, a slow disk, a congested link). It lags behind without
    /// being cut off, the window in which a read answered from its own state goes stale.
    straggler: Option<(Peer, u64)>,
    issuing: bool,
    /// Push events as correct nodes sent them: (client, number) → digest.
    pushes: BTreeMap<(ClientId, u64), Digest>,
    /// The faulty client's last sequence number, and its signing key (auth = sig).
    faulty_seq: u64,
    /// The faulty client's current request, and how many more times it resends it.
    faulty_repeat: Option<(Vec<u8>, u32)>,
    faulty_key: SigningKey,
    history: Vec<HistoryEntry>,
    /// (client, seq) → op digest, for validity.
    submitted: BTreeMap<(ClientId, u64), Digest>,
    // Online checkers' state.
    /// Decisions per (epoch, instance): one above an epoch's end is forgotten with the
    /// epoch (never executed), and the next epoch may decide the instance anew.
    /// What each correct node said it votes for (or, as a primary, proposes) per
    /// (membership epoch, view, instance, kind), across its crashes: rule 1 says once.
    said: BTreeMap<(NodeId, u64, View, Seq, &'static str), Digest>,
    decided: BTreeMap<(u64, Seq), Digest>,
    /// Per instance a correct node executed: the agreed time of the tick it ran before
    /// it, or None; every correct node that executes it must say the same.
    ticked_at: BTreeMap<Seq, Option<u64>>,
    /// Ticks correct nodes reported whose instance's Executed event is still to come.
    ticks_pending: BTreeMap<(NodeId, Seq), u64>,
    /// Correct nodes that sent ACCEPT per (epoch, instance, view, value), and per (epoch,
    /// instance) the lowest view where `Q - r` of them accepted one value (`check_locked`).
    accepted: BTreeMap<(u64, Seq, View, Digest), BTreeSet<NodeId>>,
    locked: BTreeMap<(u64, Seq), (View, Digest)>,
    executed_at: BTreeMap<Seq, Vec<(ClientId, u64, Digest)>>,
    fresh_at: BTreeMap<(ClientId, u64), Seq>,
    roots: BTreeMap<Seq, Digest>,
    /// Separated execution: checkpoint roots of correct execution nodes (their state is
    /// the service's, the order nodes' the order state's).
    exec_roots: BTreeMap<Seq, Digest>,
    report: SeedReport,
    trace: blake3::Hasher,
    trace_tail: VecDeque<String>,
}

/// The client of `World::faulty_client`.
const FAULTY_CLIENT: ClientId = ClientId(9_000);

/// Node-local options: even stable ids serialize checkpoints in the background, odd ones
/// inline (production's default), so every run covers both and their mix.
fn node_options(mut cfg: ClusterConfig, id: NodeId) -> ClusterConfig {
    cfg.options.background_checkpoints = cfg.options.background_checkpoints && id.0.is_multiple_of(2);
    cfg
}

fn client_id(i: usize) -> ClientId {
    ClientId(1000 + i as u64)
}

impl<W: Workload> World<W> {
    pub fn new(opts: SimOptions, workload: W) -> World<W> {
        let mut rng = ChaCha8Rng::seed_from_u64(opts.seed);
        let quorums = Quorums::new(opts.u, opts.r).expect("valid (u, r)").with_mutation(opts.mutation);
        let n = quorums.order_nodes();
        let mut roots: Vec<([u8; 32], [u8; 32])> = (0..n).map(|_| (rng.gen(), rng.gen())).collect();
        // Spare nodes the administrator may add, keyed from the seed without drawing from
        // the run's generator (so runs without reconfiguration replay as before). Every
        // node's endorsement row covers them: provisioned ahead, as `keel init` would.
        let derived = |what: &str, i: usize| *blake3::hash(format!("{what}/{}/{i}", opts.seed).as_bytes()).as_bytes();
        let spares = if opts.reconfig { SPARES } else { 0 };
        roots.extend((n..n + spares).map(|i| (derived("spare-sign", i), derived("spare-mac", i))));
        let mac_secrets: Vec<[u8; 32]> = roots.iter().map(|(_, m)| *m).collect();
        let secrets: Vec<NodeSecrets> = roots
            .iter()
            .enumerate()
            .map(|(i, (seed, _))| NodeSecrets::new(SigningKey::from_seed(*seed), mac_secrets[i]))
            .collect();
        let keys = secrets.iter().take(n).map(|s| s.signing.public()).collect();
        let cfg = ClusterConfig::new(quorums, keys, opts.options.clone()).expect("valid config");
        // Execution nodes (separated): keyed from the seed like spares. Stable ids: order
        // nodes, execution nodes, RQ nodes, then the spares (ids above every stage node's,
        // as `keel admin add-node` gives them).
        let exec_count = if opts.separated { quorums.execution_nodes_min() } else { 0 };
        let exec_secrets: Vec<NodeSecrets> = (n..n + exec_count)
            .map(|i| NodeSecrets::new(SigningKey::from_seed(derived("exec-sign", i)), derived("exec-mac", i)))
            .collect();
        let cfg = if opts.separated {
            cfg.with_executors(exec_secrets.iter().map(|s| s.signing.public()).collect()).expect("2u + 1")
        } else {
            cfg
        };
        let admin_key = SigningKey::from_seed(derived("admin", 0));
        let cfg = if opts.reconfig { cfg.with_admin_key(admin_key.public()) } else { cfg };
        let cfg = match opts.auth {
            Some(auth) => cfg.with_auth(auth),
            // RQ nodes of their own endorse requests: rq-mac, whatever (u, r).
            None if opts.rq_separated => cfg.with_auth(Auth::RqMac),
            None => cfg,
        };
        // RQ nodes (a separate RQ stage): keyed from the seed like execution nodes, after
        // them.
        let rq_first = n + exec_count;
        let rq_count = if opts.rq_separated { quorums.rq_nodes_min() } else { 0 };
        let rq_secrets: Vec<NodeSecrets> = (rq_first..rq_first + rq_count)
            .map(|i| NodeSecrets::new(SigningKey::from_seed(derived("rq-sign", i)), derived("rq-mac", i)))
            .collect();
        let cfg = if opts.rq_separated {
            cfg.with_rq_nodes(rq_secrets.iter().map(|s| s.signing.public()).collect()).expect("2u + r + 1, rq-mac")
        } else {
            cfg
        };
        // Client signing keys (auth = sig), derived from the seed without drawing from
        // the run's generator, so other auth modes replay as before.
        let client_key = |id: ClientId| {
            let mut input = opts.seed.to_le_bytes().to_vec();
            input.extend_from_slice(&id.0.to_le_bytes());
            SigningKey::from_seed(*blake3::hash(&input).as_bytes())
        };
        let client_keys =
            (0..opts.clients).map(client_id).chain([FAULTY_CLIENT]).map(|id| (id, client_key(id).public())).collect();
        let cfg = cfg.with_client_keys(client_keys);
        let mut report = SeedReport { seed: opts.seed, ..SeedReport::default() };
        let byzantine_count = if opts.faults.byzantine && opts.r > 0 { rng.gen_range(1..=opts.r as usize) } else { 0 };
        let mut byz_ids: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            byz_ids.swap(i, rng.gen_range(0..=i));
        }
        byz_ids.truncate(byzantine_count);
        let mut pinned = None;
        if let Some((ids, behaviours)) = &opts.byzantine {
            byz_ids = ids.iter().map(|i| i.index()).collect();
            pinned = Some(behaviours.clone());
        }
        let byzantine_count = byz_ids.len();
        let tolerance = opts.options.clock_tolerance_ms as i64;
        let nodes = secrets
            .into_iter()
            .enumerate()
            .map(|(i, s)| {
                let skew_max = if opts.faults.network { tolerance / 4 } else { 20 };
                let skew = rng.gen_range(-skew_max..=skew_max);
                if skew != 0 {
                    report.faults.skewed_clocks += 1;
                }
                let byzantine = byz_ids.contains(&i).then(|| {
                    let behaviours = pinned.clone().unwrap_or_else(|| Behaviours::random(&mut rng));
                    // Seeded from the run's seed without drawing from its generator.
                    let seed = u64::from_le_bytes(derived("byzantine", i)[..8].try_into().expect("8 bytes"));
                    let clients: Vec<ClientId> = (0..opts.clients).map(client_id).collect();
                    let mut b =
                        Byzantine::new(behaviours, NodeId(i as u32), n, quorums.order_quorum(), s.signing.clone())
                            .seeded(seed, &clients, opts.options.log_max());
                    b.set_membership(NodeId(i as u32), quorums.order_quorum(), cfg.membership.clone());
                    b
                });
                let (replica, role) = if i < n {
                    let start = NodeStart { node: i as u32, fresh: true, byzantine: byzantine.is_some() };
                    (
                        Some(Replica::new(
                            node_options(cfg.clone(), NodeId(i as u32)),
                            NodeId(i as u32),
                            s.clone(),
                            workload.node_service(start),
                        )),
                        Role::Member,
                    )
                } else {
                    (None, Role::Spare)
                };
                SimNode { core: replica.map(Core::Order), role, skew, byzantine, ..SimNode::blank(s) }
            })
            .collect::<Vec<_>>();
        let mut nodes = nodes;
        // A node that turns Byzantine once r is raised (issue #21 defect 3): wherever the
        // simulator raises r (membership changes, r < u, rq-mac or sig, stages together)
        // and the seed picks no Byzantine nodes itself; chosen by a generator of its own so
        // other runs replay as before. Once turned it answers every client wrongly, tagged
        // with the epoch it runs: a client that has not followed the change to that epoch
        // must not count the answer with its old quorums.
        let mut latent_rng = ChaCha8Rng::seed_from_u64(opts.seed ^ 0x6c6174);
        let raises_r = opts.reconfig
            && opts.r < opts.u
            && !opts.separated
            && !opts.rq_separated
            && opts.auth.unwrap_or(if opts.r > 0 { Auth::RqMac } else { Auth::Mac }) != Auth::Mac;
        if opts.faults.byzantine && opts.byzantine.is_none() && raises_r {
            let honest: Vec<usize> = (0..n).filter(|i| !byz_ids.contains(i)).collect();
            let i = honest[latent_rng.gen_range(0..honest.len())];
            nodes[i].latent = Behaviours::only("wrong-replies");
        }
        let spare_nodes = nodes.split_off(n);
        // Byzantine execution nodes: up to r of them, chosen by a generator of their own so
        // runs without separated execution replay as before.
        let mut exec_rng = ChaCha8Rng::seed_from_u64(opts.seed ^ 0x65786563);
        // A test that pins the Byzantine nodes pins them all (order nodes only).
        let stage_liars = opts.faults.byzantine && opts.r > 0 && opts.byzantine.is_none();
        let exec_liars = if stage_liars && exec_count > 0 { exec_rng.gen_range(1..=opts.r as usize) } else { 0 };
        for (i, s) in exec_secrets.into_iter().enumerate() {
            let id = stage_node(cfg.stages.exec_first + i as u32);
            let start = NodeStart { node: id.0, fresh: true, byzantine: false };
            let exec = ExecNode::new(cfg.clone(), id, s.signing.clone(), workload.node_service(start));
            let interval = opts.options.checkpoint_interval;
            let exec_byzantine =
                (i < exec_liars).then(|| ExecByzantine::random(&mut exec_rng, id, s.signing.clone(), interval));
            nodes.push(SimNode {
                stage: Stage::Exec,
                core: Some(Core::Exec(exec)),
                exec_byzantine,
                ..SimNode::blank(s)
            });
        }
        // Byzantine RQ nodes: up to r, from a generator of their own (replays as before).
        let mut rq_rng = ChaCha8Rng::seed_from_u64(opts.seed ^ 0x7271);
        let rq_liars = if stage_liars && rq_count > 0 { rq_rng.gen_range(1..=opts.r as usize) } else { 0 };
        let sim_clients: Vec<ClientId> = (0..opts.clients).map(client_id).collect();
        for (i, s) in rq_secrets.into_iter().enumerate() {
            let id = stage_node(cfg.stages.rq_first + i as u32);
            let rq = RqNode::new(cfg.clone(), id, s.signing.clone(), s.mac_secret);
            let row: Vec<MacKey> =
                cfg.node_keys.iter().chain(&cfg.stages.rq).map(|k| endorse_key(&s.signing, k)).collect();
            if i == 0 && rq_liars > 0 {
                // Faulty nodes collude: Byzantine order nodes endorse their made-up
                // requests as this RQ node.
                for node in nodes.iter_mut().take(n) {
                    if let Some(b) = node.byzantine.as_mut() {
                        b.set_colluder(id, row.clone());
                    }
                }
            }
            let rq_byzantine = (i < rq_liars).then(|| {
                let ranges = (NodeRange::first(n), cfg.endorsers());
                RqByzantine::random(&mut rq_rng, id, row, ranges, sim_clients.clone())
            });
            nodes.push(SimNode { stage: Stage::Rq, core: Some(Core::Rq(rq)), rq_byzantine, ..SimNode::blank(s) });
        }
        debug_assert_eq!(nodes.len(), n + exec_count + rq_count, "stage nodes at their stable ids");
        nodes.extend(spare_nodes);
        let byzantine_count = byzantine_count + exec_liars + rq_liars;
        report.faults.byzantine_nodes = byzantine_count as u64;
        let clients = (0..opts.clients)
            .map(|i| {
                let id = client_id(i);
                let keys = nodes.iter().map(|n| client_mac_key(&n.secrets.mac_secret, id)).collect();
                let core = with_stages(Client::new(id, quorums, keys, 300, 1), &cfg)
                    .with_signing_key(client_key(id))
                    .with_membership(cfg.membership.clone());
                SimClient { core, inflight: None, side: 0, push_next: 1 }
            })
            .collect();
        let sessions = if opts.reconfig { 2 } else { 0 };
        let admin = (0..sessions)
            .map(|s| {
                let id = session_id(ADMIN_CLIENT, s);
                let keys = nodes.iter().map(|n| client_mac_key(&n.secrets.mac_secret, id)).collect();
                let core = with_stages(Client::new(id, quorums, keys, 300, 1), &cfg)
                    .with_signing_key(admin_key.clone())
                    .with_membership(cfg.membership.clone());
                (core, None)
            })
            .collect();
        let mut w = World {
            memberships: BTreeMap::from([(0, (0..n as u32).collect())]),
            admin_key,
            admin,
            cfg,
            workload,
            rng,
            now: 0,
            queue: BinaryHeap::new(),
            next_id: 0,
            sides: vec![0; n + spares + exec_count + rq_count],
            nodes,
            clients,
            lossy: opts.faults.network,
            straggler: None,
            issuing: true,
            faulty_seq: 0,
            faulty_repeat: None,
            pushes: BTreeMap::new(),
            faulty_key: client_key(FAULTY_CLIENT),
            history: Vec::new(),
            submitted: BTreeMap::new(),
            said: BTreeMap::new(),
            decided: BTreeMap::new(),
            ticked_at: BTreeMap::new(),
            ticks_pending: BTreeMap::new(),
            accepted: BTreeMap::new(),
            locked: BTreeMap::new(),
            executed_at: BTreeMap::new(),
            fresh_at: BTreeMap::new(),
            roots: BTreeMap::new(),
            exec_roots: BTreeMap::new(),
            report,
            trace: blake3::Hasher::new(),
            trace_tail: VecDeque::new(),
            opts,
        };
        for i in 0..n {
            let at = w.rng.gen_range(0..NODE_TICK_MS);
            w.schedule(at, Ev::NodeTick(NodeId(i as u32)));
        }
        for i in n..n + exec_count + rq_count {
            // Offsets from the seed, not the run's generator (replays stay as they were).
            w.schedule(i as u64 % NODE_TICK_MS, Ev::NodeTick(NodeId(i as u32)));
        }
        for c in 0..w.clients.len() {
            let at = w.rng.gen_range(0..CLIENT_TICK_MS);
            w.schedule(at, Ev::ClientTick(c));
        }
        if w.opts.faults.crash || w.opts.faults.network {
            let at = w.rng.gen_range(100..600);
            w.schedule(at, Ev::Nemesis);
        }
        // `auth = mac` with r > 0 is known to stall on such a client (its PROPOSE splits
        // the backups), which is what rq-mac is for: there the faulty client runs only
        // when a test asks for it (`SimOptions::faulty_client`).
        let mac_splits = w.cfg.auth == Auth::Mac && w.cfg.quorums.byzantine();
        let faulty = w.opts.faulty_client.unwrap_or(w.opts.faults.byzantine && !mac_splits);
        if faulty && w.workload.unobserved_op().is_some() {
            let at = w.rng.gen_range(100..400);
            w.schedule(at, Ev::FaultyClient);
        }
        if w.opts.reconfig {
            let at = w.rng.gen_range(200..800);
            w.schedule(at, Ev::Admin);
        }
        w
    }

    /// A client that sends requests whose MAC entries are valid for a random subset of
    /// the nodes, never waits for answers, and moves on (UpRight §4.1's corner case). Its
    /// operation touches state no checked operation reads, so whether it executes does
    /// not matter; that it never stalls the others or replaces a primary does (the
    /// liveness checks and, for the cluster as a whole, `views_installed`).
    fn faulty_client(&mut self) {
        if !self.issuing {
            return;
        }
        let next = self.now + self.rng.gen_range(20..80);
        self.schedule(next, Ev::FaultyClient);
        let n = self.nodes.len();
        if let Some((frame, left)) = self.faulty_repeat.as_mut().filter(|(_, left)| *left > 0) {
            // It retransmits, as a client does, for long enough (often well over two
            // request timeouts) that nodes' request timers run out on the request: then
            // order nodes relay what endorsements they hold, and must still not suspect
            // a correct primary over it.
            *left -= 1;
            let frame = frame.clone();
            self.report.faults.inconsistent_macs += 1;
            for to in NodeRange::first(n) {
                self.transmit(Peer::Client(FAULTY_CLIENT), Peer::Node(to), frame.clone());
            }
            return;
        }
        let Some(op) = self.workload.unobserved_op() else {
            return;
        };
        self.faulty_seq += 1;
        let mut req = Request::new(FAULTY_CLIENT, self.faulty_seq, op.into());
        let statement = req.statement();
        let valid: Vec<bool> = (0..n).map(|_| self.rng.gen_bool(0.5)).collect();
        req.auth = self
            .nodes
            .iter()
            .zip(&valid)
            .map(|(node, ok)| {
                let mac = client_mac_key(&node.secrets.mac_secret, FAULTY_CLIENT).mac(&statement);
                if *ok {
                    mac
                } else {
                    [0xee; 16]
                }
            })
            .collect();
        if self.cfg.auth == Auth::Sig {
            // A signature every node accepts, or one every node rejects: no third way.
            let key = self.faulty_key.clone();
            req.sig = Some(if valid[0] { key.sign(&statement) } else { keel_core::crypto::Sig([0xee; 64]) });
        }
        self.report.faults.inconsistent_macs += 1;
        self.submitted.insert((req.client, req.seq), req.op.digest());
        let frame = codec::encode(&Message::Request(req));
        for to in NodeRange::first(n) {
            self.transmit(Peer::Client(FAULTY_CLIENT), Peer::Node(to), frame.clone());
        }
        // A quarter of its requests it retransmits for a while; the rest it abandons.
        let repeats = if self.rng.gen_bool(0.25) { self.rng.gen_range(10..40) } else { 0 };
        self.faulty_repeat = Some((frame, repeats));
    }

    fn schedule(&mut self, at: u64, ev: Ev) {
        self.next_id += 1;
        self.queue.push(Reverse(Scheduled { at, id: self.next_id, ev }));
    }

    fn trace_line(&mut self, line: String) {
        self.trace.update(line.as_bytes());
        if self.trace_tail.len() >= trace_tail_max() {
            self.trace_tail.pop_front();
        }
        self.trace_tail.push_back(line);
    }

    fn violation(&mut self, property: &'static str, detail: String) {
        if self.report.violations.iter().any(|v| v.property == property) {
            return;
        }
        self.trace_line(format!("{} VIOLATION {property}: {detail}", self.now));
        self.report.violations.push(Violation { property, detail, at: self.now });
    }

    fn is_correct(&self, n: NodeId) -> bool {
        let node = &self.nodes[n.index()];
        node.byzantine.is_none() && node.exec_byzantine.is_none() && node.rq_byzantine.is_none()
    }

    /// Runs both phases and the final checks.
    pub fn run(mut self) -> SeedReport {
        // Fault phase.
        while self.report.steps < self.opts.steps && self.report.violations.is_empty() {
            if !self.step_once() {
                break;
            }
        }
        // Heal.
        self.issuing = false;
        self.lossy = false;
        self.straggler = None;
        self.sides.iter_mut().for_each(|s| *s = 0);
        self.clients.iter_mut().for_each(|c| c.side = 0);
        // Clocks synchronized again: within a quarter of the tolerance, as at the start.
        let synced = self.opts.options.clock_tolerance_ms as i64 / 4;
        self.nodes.iter_mut().for_each(|n| n.skew = n.skew.clamp(-synced, synced));
        for n in 0..self.nodes.len() {
            if !self.nodes[n].up() && self.nodes[n].role == Role::Member && !self.nodes[n].gone {
                self.restart(NodeId(n as u32));
            }
        }
        let heal_at = self.now;
        self.report.fault_phase_ms = heal_at;
        self.trace_line(format!("{heal_at} heal"));
        // Liveness phase: every outstanding operation completes within the bound.
        let admin_busy = |w: &World<W>| w.admin.iter().any(|(_, c)| c.is_some());
        while self.report.violations.is_empty()
            && (self.clients.iter().any(|c| c.inflight.is_some()) || admin_busy(&self))
        {
            if self.now > heal_at + self.opts.liveness_ms || !self.step_once() {
                let mut stuck: Vec<String> = self
                    .clients
                    .iter()
                    .filter(|c| c.inflight.is_some())
                    .map(|c| format!("client {} seq {:?}", c.core.id(), c.core.inflight_seq()))
                    .collect();
                for (core, change) in self.admin.iter().filter(|(_, c)| c.is_some()) {
                    stuck.push(format!("admin {change:?} seq {:?}", core.inflight_seq()));
                }
                let nodes: Vec<String> = self
                    .nodes
                    .iter()
                    .map(|n| {
                        let liar = n.byzantine.is_some() || n.exec_byzantine.is_some() || n.rq_byzantine.is_some();
                        format!("{}{}", n.status_line(), if liar { " (byzantine)" } else { "" })
                    })
                    .collect();
                self.violation(
                    "liveness",
                    format!(
                        "{} ms after healing: {} stuck; nodes: {}",
                        self.opts.liveness_ms,
                        stuck.join(", "),
                        nodes.join("; ")
                    ),
                );
                break;
            }
        }
        if self.report.violations.is_empty() {
            if let Err(e) = self.workload.check_history(&self.history) {
                self.violation("linearizability", e);
            }
        }
        for n in &self.nodes {
            if let Some(b) = &n.byzantine {
                self.report.faults.lies.add(&b.lies);
            }
            if let Some(b) = &n.exec_byzantine {
                self.report.faults.exec_lies += b.lies;
            }
            if let Some(b) = &n.rq_byzantine {
                self.report.faults.rq_lies += b.lies;
            }
            self.report.faults.torn_writes += n.disk.torn;
        }
        for c in &self.clients {
            self.report.reads_unordered += c.core.reads_answered;
            self.report.reads_ordered += c.core.reads_ordered;
        }
        self.report.max_executed = self.nodes.iter().filter_map(SimNode::executed).max().unwrap_or(Seq(0));
        self.report.trace_hash = {
            let h = self.trace.finalize();
            let mut b = [0u8; 8];
            b.copy_from_slice(&h.as_bytes()[..8]);
            u64::from_le_bytes(b)
        };
        self.report.trace_tail = self.trace_tail.iter().cloned().collect();
        self.report
    }

    fn step_once(&mut self) -> bool {
        let Some(Reverse(s)) = self.queue.pop() else {
            return false;
        };
        self.now = s.at;
        self.report.steps += 1;
        match s.ev {
            Ev::Deliver { to, from, frame, epoch } => self.deliver(to, from, frame, epoch),
            Ev::Admin => self.admin_op(),
            Ev::NodeTick(n) => {
                self.schedule(self.now + NODE_TICK_MS, Ev::NodeTick(n));
                self.step_node(n, Input::Tick);
            }
            Ev::ClientTick(c) => {
                self.schedule(self.now + CLIENT_TICK_MS, Ev::ClientTick(c));
                self.client_tick(c);
            }
            Ev::Sync { node, epoch, upto, gated, facts, member_epoch } => {
                let sn = &mut self.nodes[node.0 as usize];
                if sn.epoch == epoch && sn.up() {
                    for e in facts {
                        self.on_event(node, e, member_epoch);
                    }
                    let sn = &mut self.nodes[node.0 as usize];
                    sn.disk.sync(upto);
                    // Snapshots kept: the stable one and those above it, within the window:
                    // one per interval, plus one off the interval where an epoch ends (its
                    // last checkpoint; nothing above it executes in that epoch).
                    let o = &self.opts.options;
                    let epoch_end = usize::from(self.opts.reconfig);
                    // An execution node learns which checkpoint is certified from the order
                    // nodes, a message later: one more.
                    let exec_late = usize::from(sn.stage == Stage::Exec);
                    let bound = (o.log_max() / o.checkpoint_interval) as usize + 1 + epoch_end + exec_late;
                    let held = sn.disk.snapshot_count();
                    if held > bound {
                        let seqs = sn.disk.snapshot_seqs();
                        let status = sn.status_line();
                        self.violation(
                            "bounded-storage",
                            format!("node {node} holds {held} snapshots {seqs:?}, bound {bound}; {status}"),
                        );
                    }
                    self.transmit_from_node(node, gated, member_epoch);
                }
            }
            Ev::Restart(n) => {
                let node = &self.nodes[n.index()];
                if !node.up() && node.role == Role::Member && !node.gone {
                    self.restart(n);
                }
            }
            Ev::AdminTick => self.admin_tick(),
            Ev::Crash(n) => {
                if self.nodes[n.index()].replica().is_some() {
                    self.trace_line(format!("{} n{n} crash at an epoch switch", self.now));
                    self.crash(n);
                    let back = self.now + self.rng.gen_range(20..600);
                    self.schedule(back, Ev::Restart(n));
                }
            }
            Ev::CrashDuringRejoin(n) => {
                let node = &self.nodes[n.index()];
                if self.issuing && node.up() && node.role == Role::Member && !node.gone && !node.wiped {
                    self.report.faults.crashes_during_rejoin += 1;
                    self.trace_line(format!("{} n{n} crashes while a wiped node rejoins", self.now));
                    self.crash(n);
                    let back = self.now + self.rng.gen_range(50..1500);
                    self.schedule(back, Ev::Restart(n));
                }
            }
            Ev::Nemesis => self.nemesis(),
            Ev::FaultyClient => self.faulty_client(),
            Ev::CheckpointDone { node, epoch, job } => {
                if self.nodes[node.0 as usize].epoch == epoch && self.nodes[node.0 as usize].replica().is_some() {
                    self.report.checkpoints_background += 1;
                    self.step_node(node, Input::CheckpointReady(job.run()));
                } else {
                    self.report.checkpoints_lost += 1;
                }
            }
        }
        true
    }

    fn node_now(&self, n: NodeId) -> u64 {
        (self.now as i64 + self.nodes[n.index()].skew).max(0) as u64
    }

    fn step_node(&mut self, n: NodeId, input: Input) {
        let now = self.node_now(n);
        let node = &mut self.nodes[n.index()];
        let stage = node.stage != Stage::Order;
        let what = match node.stage {
            Stage::Rq => "RQ node",
            Stage::Exec => "execution node",
            Stage::Order => "node",
        };
        let Some(core) = node.core_mut() else { return };
        let before = core.config().epoch();
        let mut out = Outputs::default();
        // A failed invariant is reported with the trace that led to it (a panic that
        // unwound the whole world would lose the trace), and stops the node.
        if let Err(panic) = catch_step(|| core.step(now, input, &mut out)) {
            node.core = None;
            self.violation("invariant", format!("{what} {n}: {panic}"));
            return;
        }
        if stage {
            // A stage node follows epochs inside its step: its outputs are the new one's.
            let epoch = node.running_epoch().unwrap_or(0);
            self.rq_liar_follows(n);
            self.process_outputs(n, out, epoch);
        } else {
            // An order node's epoch ends after its step's outputs (the driver switches).
            self.process_outputs(n, out, before);
        }
    }

    /// A lying RQ node whose core followed a new epoch makes its lies for the new members
    /// from now on, and so do the Byzantine order nodes that collude with it.
    fn rq_liar_follows(&mut self, n: NodeId) {
        let node = &mut self.nodes[n.index()];
        let (Some(Core::Rq(rq)), Some(liar)) = (node.core.as_ref(), node.rq_byzantine.as_mut()) else {
            return;
        };
        if rq.epoch() == liar.epoch() {
            return;
        }
        let cfg = rq.config();
        let signing = &node.secrets.signing;
        let row: Vec<MacKey> = cfg.node_keys.iter().chain(&cfg.stages.rq).map(|k| endorse_key(signing, k)).collect();
        liar.follow(cfg.epoch(), row.clone(), cfg.membership.members.iter().map(|m| NodeId(m.id)).collect());
        for b in self.nodes.iter_mut().filter_map(|x| x.byzantine.as_mut()) {
            b.colluder_follows(stage_node(n.0), &row);
        }
    }

    /// Carries out what node `n` (stable id), running membership epoch `epoch`, asked for.
    fn process_outputs(&mut self, n: NodeId, out: Outputs, epoch: u64) {
        let Outputs { persist, persist_lazy, send, send_after_persist, events, checkpoints, barrier } = out;
        for job in checkpoints {
            // Usually soon; with crashes, sometimes long enough for the others' votes to
            // make the checkpoint stable first, and for a crash to lose it.
            let delay = if self.opts.faults.crash && self.rng.gen_bool(0.1) {
                self.rng.gen_range(100..600)
            } else {
                self.rng.gen_range(0..40)
            };
            let epoch = self.nodes[n.index()].epoch;
            self.schedule(self.now + delay, Ev::CheckpointDone { node: n, epoch, job });
        }
        let ended = events.iter().any(|e| matches!(e, Event::EpochEnded { .. }));
        let installed = events.iter().any(|e| matches!(e, Event::ViewInstalled { .. }));
        // Decisions, executions (with the ticks before them) and checkpoints are facts
        // only once the step's records are durable: a node that crashes before that
        // never made them (nothing it said depended on them: replies and votes are gated
        // the same way). A tick kept while its execution was lost to a crash would be
        // taken for the tick before that instance's re-execution after the restart.
        let (facts, observations): (Vec<Event>, Vec<Event>) = events.into_iter().partition(|e| {
            matches!(
                e,
                Event::Decided { .. } | Event::Executed { .. } | Event::Ticked { .. } | Event::Checkpoint { .. }
            )
        });
        for e in observations {
            self.on_event(n, e, epoch);
        }
        let node = &mut self.nodes[n.index()];
        let wrote = !persist.is_empty();
        for p in &persist {
            node.disk.write(p);
        }
        for r in &persist_lazy {
            node.disk.write_lazy(r);
        }
        if wrote || ((!send_after_persist.is_empty() || !facts.is_empty()) && node.disk.has_pending_eager()) {
            // Group commit: one sync covers everything written so far.
            let upto = node.disk.last_op();
            let life = node.epoch;
            let latency = if self.opts.faults.crash && self.rng.gen_bool(0.1) {
                self.rng.gen_range(5..40)
            } else {
                self.rng.gen_range(0..3)
            };
            let sync = Ev::Sync { node: n, epoch: life, upto, gated: send_after_persist, facts, member_epoch: epoch };
            self.schedule(self.now + latency, sync);
        } else {
            for e in facts {
                self.on_event(n, e, epoch);
            }
            self.transmit_from_node(n, send_after_persist, epoch);
        }
        let sent_now = !send.is_empty();
        self.transmit_from_node(n, send, epoch);
        if !ended && wrote && sent_now {
            self.maybe_crash_before_sync(n, installed);
        }
        // Crashes at the switch (the window the simulator found two bugs in): at the
        // barrier the end of an epoch asks for, before the new epoch's log is written,
        // or right after the new node started.
        let crash_at_switch = ended && self.opts.faults.crash && self.issuing && self.rng.gen_bool(0.2);
        let before = crash_at_switch && self.rng.gen_bool(0.5);
        if barrier && !before {
            self.pass_barrier(n);
        }
        if crash_at_switch {
            self.report.faults.epoch_switch_crashes += 1;
            // Before: at once. After: within the new node's first steps, while what it
            // sent may not be durable yet.
            let at = if before { self.now } else { self.now + self.rng.gen_range(1..30) };
            self.schedule(at, Ev::Crash(n));
        }
    }

    /// Rule 1, checked on the wire: a correct node proposes (as primary) and votes
    /// (WRITE, ACCEPT) at most one value per (epoch, view, instance), whatever crashes or
    /// lost disks it went through. Resending the same one is fine.
    fn check_said_once(&mut self, n: NodeId, epoch: u64, m: &Message) {
        let (view, seq, digest) = match m {
            Message::Propose { view, seq, value } => (*view, *seq, value.digest()),
            Message::Write(w) => (w.view, w.seq, w.digest),
            Message::Accept { view, seq, digest } => (*view, *seq, *digest),
            _ => return,
        };
        let key = (n, epoch, view, seq, m.kind());
        match self.said.get(&key) {
            Some(d) if *d != digest => {
                let kind = m.kind();
                self.violation(
                    "vote-once",
                    format!("node {n} sent {kind} for {digest:?} and earlier {d:?} (epoch {epoch}, view {view}, instance {seq})"),
                );
            }
            Some(_) => {}
            None => {
                self.said.insert(key, digest);
            }
        }
    }

    /// View-change safety (rule 3), checked on the wire: once `Q - r` correct nodes
    /// ACCEPTed a value in view v of an epoch, every quorum of VIEW-CHANGEs holds one of
    /// them (`2Q - r - N >= 1`), so every later view of the epoch keeps that value at that
    /// instance, or a stable checkpoint above it: no correct node proposes or votes for
    /// another value there in a view above v. Agreement sees such a re-opened instance
    /// only if a node that had not decided it yet decides it anew (the nodes that did
    /// decide vote again without deciding twice); this sees the votes. Counted from the
    /// quorums as they are without a mutation.
    fn check_locked(&mut self, n: NodeId, epoch: u64, m: &Message) {
        let (view, seq, digest) = match m {
            Message::Propose { view, seq, value } => (*view, *seq, value.digest()),
            Message::Write(w) => (w.view, w.seq, w.digest),
            Message::Accept { view, seq, digest } => (*view, *seq, *digest),
            _ => return,
        };
        if let Some(&(at, locked)) = self.locked.get(&(epoch, seq)) {
            if view > at && digest != locked {
                let kind = m.kind();
                self.violation(
                    "view-change-safety",
                    format!(
                        "node {n} sent {kind} for {digest:?} in view {view}, instance {seq} (epoch {epoch}), where view {at} had {locked:?} accepted by a quorum's correct nodes"
                    ),
                );
            }
        }
        let Message::Accept { .. } = m else { return };
        let Some(q) = self.nodes[n.index()].replica().filter(|r| r.epoch() == epoch).map(|r| r.config().quorums) else {
            return;
        };
        let Ok(q) = Quorums::with_nodes(q.u(), q.r(), q.order_nodes()) else { return };
        let acceptors = self.accepted.entry((epoch, seq, view, digest)).or_default();
        acceptors.insert(n);
        if acceptors.len() >= q.order_quorum() - q.r() as usize {
            let lock = self.locked.entry((epoch, seq)).or_insert((view, digest));
            if view < lock.0 {
                *lock = (view, digest);
            }
        }
    }

    /// Node `n`'s step sent messages at once and wrote records not yet durable: the one
    /// window where a crash makes a node forget what it said. Crashes it there, now and
    /// then at any such step, and often where it installed a view as that view's primary
    /// (issue #21 defect 2: its PROPOSEs must not leave before its record of the view).
    fn maybe_crash_before_sync(&mut self, n: NodeId, installed: bool) {
        if !self.opts.faults.crash || !self.issuing {
            return;
        }
        let primary = self.nodes[n.index()].replica().is_some_and(|r| r.is_primary());
        let p = if installed && primary { 0.3 } else { 0.002 };
        if !self.rng.gen_bool(p) {
            return;
        }
        self.report.faults.crashes_before_sync += 1;
        self.trace_line(format!("{} n{n} crash before its records are durable", self.now));
        self.crash(n);
        let back = self.now + self.rng.gen_range(20..600);
        self.schedule(back, Ev::Restart(n));
    }

    /// Honours order node `n`'s durability barrier (`Outputs::barrier`) at once: every
    /// write completes now (a disk that happened to be quick), then the node is stepped
    /// with `Input::Drained`, the next thing that happens to it. The outputs of a step at
    /// a barrier are carried out the same way: written and synced at once, gated
    /// messages and facts released at once (nothing draws on the seeded generator, so a
    /// barrier costs a run no randomness), and a barrier they ask for is passed in turn.
    /// Gated messages of earlier steps whose `Sync` is scheduled already count as sent:
    /// the sync they wait for is done, and they leave when it fires, as over a slow link
    /// (a crash before then loses them, as it loses any message in flight).
    ///
    /// An epoch's end is two barriers (replica/epoch.rs): the old epoch's records
    /// durable, then the new epoch's log durable before the new node's first step.
    ///
    /// Under [`DriverMutation::SkipBarrierSync`] nothing is synced here: the node is
    /// stepped and its gated messages and facts released as if it were, while its
    /// writes stay pending until a later step's sync covers them.
    fn pass_barrier(&mut self, n: NodeId) {
        let sync = self.opts.driver_mutation() != Some(DriverMutation::SkipBarrierSync);
        loop {
            let now = self.node_now(n);
            let node = &mut self.nodes[n.index()];
            if sync {
                node.disk.sync(node.disk.last_op());
            }
            let Some(Core::Order(replica)) = node.core.as_mut() else { return };
            let mut out = Outputs::default();
            if let Err(panic) = catch_step(|| replica.step(now, Input::Drained, &mut out)) {
                node.core = None;
                self.violation("invariant", format!("node {n} at a barrier: {panic}"));
                return;
            }
            let epoch = replica.epoch();
            if !out.barrier {
                self.process_outputs(n, out, epoch);
                return;
            }
            let Outputs { persist, persist_lazy, send, send_after_persist, events, checkpoints, barrier: _ } = out;
            for p in &persist {
                node.disk.write(p);
            }
            for r in &persist_lazy {
                node.disk.write_lazy(r);
            }
            // Synced now, for the barrier: what waited for that goes too.
            if sync {
                node.disk.sync(node.disk.last_op());
            }
            for job in checkpoints {
                self.schedule(self.now, Ev::CheckpointDone { node: n, epoch: self.nodes[n.index()].epoch, job });
            }
            for e in events {
                self.on_event(n, e, epoch);
            }
            self.transmit_from_node(n, send_after_persist, epoch);
            self.transmit_from_node(n, send, epoch);
        }
    }

    /// Order node `n` went on to a new membership epoch (`Event::EpochStarted`): the
    /// checkers and its Byzantine behaviour follow it.
    fn started_epoch(&mut self, n: NodeId) {
        let node = &mut self.nodes[n.index()];
        let Some(Core::Order(replica)) = node.core.as_ref() else { return };
        let (epoch, q) = (replica.epoch(), replica.config().quorums.order_quorum());
        let ids: Vec<u32> = replica.config().membership.members.iter().map(|m| m.id).collect();
        if let Some(b) = node.byzantine.as_mut() {
            b.set_membership(NodeId(replica.index().0), q, replica.config().membership.clone());
        }
        let line = format!("{} n{n} epoch {epoch} as index {}", self.now, replica.index());
        self.trace_line(line);
        self.turn_byzantine(n);
        self.memberships.entry(epoch).or_insert(ids);
        self.report.faults.epochs = self.report.faults.epochs.max(epoch);
    }

    /// A latent liar (`SimNode::latent`) turns Byzantine if the epoch its replica runs
    /// tolerates one more Byzantine node than already lie, and the faults budget has room
    /// for it beside the nodes out (wiped). From then on `faults_change` keeps r up. It
    /// lies only in answers of the epoch it turned in and later: answers it tagged with
    /// an epoch of r = 0 would fool a client of that epoch whatever the client checks
    /// (what raising r cannot promise; README).
    fn turn_byzantine(&mut self, n: NodeId) {
        let liars = self.nodes.iter().filter(|x| x.byzantine.is_some()).count();
        let out = self.nodes.iter().filter(|x| x.wiped || x.gone).count();
        let node = &self.nodes[n.index()];
        let (Some(behaviours), Some(replica)) = (node.latent.as_ref(), node.replica()) else { return };
        let q = replica.config().quorums;
        if node.byzantine.is_some() || q.r() as usize <= liars || liars + out >= q.u() as usize {
            return;
        }
        let mut b = Byzantine::new(
            behaviours.clone(),
            NodeId(replica.index().0),
            q.order_nodes(),
            q.order_quorum(),
            node.secrets.signing.clone(),
        );
        b.set_membership(NodeId(replica.index().0), q.order_quorum(), replica.config().membership.clone());
        let epoch = replica.epoch();
        b.lie_from_epoch(epoch);
        self.nodes[n.index()].byzantine = Some(b);
        self.report.faults.byzantine_nodes += 1;
        self.report.faults.latent_turned += 1;
        self.trace_line(format!("{} n{n} turns byzantine in epoch {epoch} (r = {})", self.now, q.r()));
    }

    /// A peer as a Byzantine order node (byzantine.rs) names it: a member of membership
    /// epoch `epoch` by its index there, as the order core did before it spoke stable ids
    /// (the adversary's lies are drawn over indices: which backups to tell what, a random
    /// member); other peers as they are.
    fn liar_name(&self, epoch: u64, p: Peer) -> Peer {
        let ids = self.memberships.get(&epoch);
        match p {
            Peer::Node(id) if stage_id(id).is_none() => match ids.and_then(|ids| ids.iter().position(|x| *x == id.0)) {
                Some(i) => Peer::Node(NodeId(i as u32)),
                None => p,
            },
            _ => p,
        }
    }

    /// Where a frame a Byzantine order node addressed to `to` ([`World::liar_name`])
    /// goes: a member by its stable id in epoch `epoch`, a stage node by its stable id.
    fn liar_target(&self, epoch: u64, to: Peer) -> Option<Peer> {
        match to {
            Peer::Node(i) if stage_id(i).is_none() => {
                self.memberships.get(&epoch).and_then(|ids| ids.get(i.index())).map(|id| Peer::Node(NodeId(*id)))
            }
            _ => Some(route(to)),
        }
    }

    /// Sends what node `n` produced in membership epoch `epoch`.
    fn transmit_from_node(&mut self, n: NodeId, msgs: Vec<(Peer, Message)>, epoch: u64) {
        if msgs.is_empty() {
            return;
        }
        if self.is_correct(n) {
            let node = &mut self.nodes[n.index()];
            if node.stage == Stage::Order {
                node.epoch_sent_max = node.epoch_sent_max.max(epoch);
            }
            for (_, m) in &msgs {
                if let Message::Propose { value, .. } = m {
                    let by_digest = value.requests.iter().filter(|p| p.full().is_none()).count();
                    self.report.ops_by_digest += by_digest as u64;
                }
                if let Message::Push { client, seq, event, .. } = m {
                    self.check_push(n, *client, *seq, Digest::of(event));
                }
                self.check_said_once(n, epoch, m);
                self.check_locked(n, epoch, m);
            }
        }
        let from = Peer::Node(n);
        let is_primary = self.nodes[n.index()].replica().is_some_and(|r| r.is_primary());
        let mut msgs = msgs;
        let slow = is_primary
            && self.now >= crate::byzantine::SLOW_FROM_MS
            && self.nodes[n.index()].byzantine.as_ref().is_some_and(|b| b.behaviours.slow_primary)
            && msgs.iter().any(|(_, m)| matches!(m, Message::Propose { .. }));
        if slow {
            // Held back, but well within the request timers (Aardvark's slow primary).
            let (proposals, rest): (Vec<_>, Vec<_>) =
                msgs.into_iter().partition(|(_, m)| matches!(m, Message::Propose { .. }));
            msgs = rest;
            let hold = self.opts.options.request_timeout_ms / 4;
            for (to, m) in proposals {
                if let Some(b) = self.nodes[n.index()].byzantine.as_mut() {
                    b.lies.slowed_proposals += 1;
                }
                self.transmit_after(from, route(to), codec::encode(&m), hold, epoch);
            }
        }
        let liar = self.nodes[n.index()].byzantine.is_some();
        if liar {
            msgs = msgs.into_iter().map(|(to, m)| (self.liar_name(epoch, to), m)).collect();
        }
        let node = &mut self.nodes[n.index()];
        let frames: Vec<(Peer, Vec<u8>)> =
            match (node.byzantine.as_mut(), node.exec_byzantine.as_mut(), node.rq_byzantine.as_mut()) {
                (Some(b), _, _) => b.transform(&mut self.rng, is_primary, msgs),
                (_, Some(b), _) => b.transform(&mut self.rng, msgs),
                (_, _, Some(b)) => b.transform(&mut self.rng, msgs),
                _ => msgs.into_iter().map(|(to, m)| (to, codec::encode(&m))).collect(),
            };
        for (to, frame) in frames {
            let to = if liar { self.liar_target(epoch, to) } else { Some(route(to)) };
            if let Some(to) = to {
                self.transmit_after(from, to, frame, 0, epoch);
            }
        }
    }

    fn is_exec_id(&self, n: NodeId) -> bool {
        self.nodes.get(n.0 as usize).is_some_and(|x| x.stage == Stage::Exec)
    }

    fn side_of(&self, p: Peer) -> u8 {
        match p {
            Peer::Node(n) => self.sides.get(n.0 as usize).copied().unwrap_or(0),
            Peer::Client(c) => c.0.checked_sub(1000).and_then(|i| self.clients.get(i as usize)).map_or(0, |x| x.side),
        }
    }

    /// Sends a frame of a client (or a node speaking outside any epoch: certificates).
    fn transmit(&mut self, from: Peer, to: Peer, frame: Vec<u8>) {
        self.transmit_after(from, to, frame, 0, 0);
    }

    /// Sends `frame` `hold` ms late (plus the network's own delay and faults); `epoch` is
    /// the sending node's membership epoch.
    fn transmit_after(&mut self, from: Peer, to: Peer, frame: Vec<u8>, hold: u64, epoch: u64) {
        if from == to {
            return;
        }
        if self.side_of(from) != self.side_of(to) {
            self.report.faults.dropped += 1;
            return;
        }
        let mut copies = 1;
        let mut delay = self.rng.gen_range(1..=3);
        if self.lossy {
            if self.rng.gen_bool(0.05) {
                self.report.faults.dropped += 1;
                return;
            }
            if self.rng.gen_bool(0.03) {
                self.report.faults.duplicated += 1;
                copies = 2;
            }
            if self.rng.gen_bool(0.2) {
                self.report.faults.delayed += 1;
                delay = self.rng.gen_range(5..80);
            }
        }
        if let Some((slow, until)) = self.straggler {
            if self.now < until && (from == slow || to == slow) {
                self.report.faults.delayed += 1;
                delay += self.rng.gen_range(20..150);
            }
        }
        for i in 0..copies {
            let at = self.now + hold + delay + i * self.rng.gen_range(0..20);
            self.schedule(at, Ev::Deliver { to, from, frame: frame.clone(), epoch });
        }
    }

    fn deliver(&mut self, to: Peer, from: Peer, frame: Vec<u8>, epoch: u64) {
        {
            let mut h = blake3::Hasher::new();
            h.update(&frame);
            let tag = h.finalize();
            self.trace.update(&self.now.to_le_bytes());
            self.trace.update(&tag.as_bytes()[..8]);
        }
        let msg = match codec::decode(&frame) {
            Ok(m) => m,
            Err(_) => {
                // The runtime counts and drops these; so do we.
                self.report.rejected += 1;
                *self.report.rejected_by.entry("frame: undecodable".into()).or_default() += 1;
                return;
            }
        };
        match to {
            Peer::Node(n) => {
                // (A node id nobody has: a membership a test's deliberate bug accepted.)
                let Some(mine) = self.nodes.get(n.0 as usize).and_then(SimNode::running_epoch) else { return };
                // How the receiving core admits it (keel_core::node::Node::admit, as the
                // runtime does): within one epoch by index, stage nodes by stage names,
                // across epochs only certificates.
                let (from, msg) = match from {
                    Peer::Node(f) => {
                        let Some(core) = self.nodes[n.index()].core() else { return };
                        match core.admit(f, epoch, msg, false) {
                            Admit::Step(Input::Message { from, msg }) => (from, msg),
                            // Only the runtime's verify stage marks messages checked.
                            Admit::Step(_) | Admit::Drop => return,
                            Admit::Answer(answer) => {
                                self.transmit_after(to, Peer::Node(f), codec::encode(&answer), 0, mine);
                                return;
                            }
                        }
                    }
                    client => (client, msg),
                };
                let liar_from = self.liar_name(mine, from);
                let answers = match self.nodes[n.index()].byzantine.as_mut() {
                    Some(b) => b.observe(&mut self.rng, liar_from, &msg),
                    None => Vec::new(),
                };
                for (answer_to, frame) in answers {
                    if let Some(answer_to) = self.liar_target(mine, answer_to) {
                        self.transmit_after(to, answer_to, frame, 0, mine);
                    }
                }
                if let Message::Read(read) = &msg {
                    if let Some(reply) = self.rushed_read_answer(n, read) {
                        self.transmit(to, from, codec::encode(&Message::Reply(reply)));
                        return;
                    }
                }
                self.step_node(n, Input::Message { from, msg });
            }
            Peer::Client(c) => self.deliver_to_client(c, from, msg),
        }
    }

    /// A Byzantine node that rushes reads answers at once, in full, from an older state of
    /// its own (up to `STALE_READ_LAG` instances back): what a lagging correct node would
    /// say, had it not waited.
    fn rushed_read_answer(&mut self, n: NodeId, read: &Read) -> Option<Reply> {
        let node = &mut self.nodes[n.index()];
        let b = node.byzantine.as_mut().filter(|b| b.behaviours.rush_reads)?;
        // The field, not `replica()`: the borrows of `byzantine` and `stale_state` stay apart.
        let Some(Core::Order(replica)) = &node.core else { return None };
        let executed = replica.executed();
        if node.stale_state.as_ref().is_none_or(|(seq, _)| executed >= *seq + STALE_READ_LAG.0 || executed < *seq) {
            node.stale_state = Some((executed, replica.service().snapshot()));
        }
        let (seq, bytes) = node.stale_state.as_ref()?;
        let mut stale = self.workload.service();
        stale.restore(bytes).ok()?;
        let ctx = ReadCtx { client: read.client, executed: *seq, time: 0 };
        let body = match stale.execute_read_only(&read.op, &ctx) {
            Some(result) => ReplyBody::Full(result),
            None => ReplyBody::NotReadOnly,
        };
        b.lies.rushed_reads += 1;
        Some(Reply { client: read.client, view: replica.view(), seq: read.seq, body, epoch: replica.epoch() })
    }

    fn deliver_to_client(&mut self, c: ClientId, from: Peer, msg: Message) {
        if let (ADMIN_CLIENT, Peer::Node(node)) = (owner_of(c), from) {
            self.deliver_to_admin(session_of(c) as usize, node, msg);
            return;
        }
        // Replies to clients that do not exist (a forged request) go nowhere.
        let Some(idx) = c.0.checked_sub(1000).map(|i| i as usize).filter(|i| *i < self.clients.len()) else {
            return;
        };
        if let (Peer::Node(node), Message::Push { client, seq, epoch, event }) = (from, &msg) {
            if *client == c {
                let delivered = self.clients[idx].core.on_push(self.now, node, *epoch, *seq, event.clone());
                self.delivered_pushes(idx, delivered);
            }
            return;
        }
        if let (Peer::Node(_), Message::EpochCerts(certs)) = (from, &msg) {
            self.clients[idx].core.on_epoch_certs(certs.clone());
            let msgs = self.clients[idx].core.poll_send();
            self.client_send(idx, msgs);
            return;
        }
        let (Peer::Node(node), Message::Reply(reply)) = (from, msg) else {
            return;
        };
        let result = self.clients[idx].core.on_reply(node, reply);
        let switched = self.clients[idx].core.poll_send();
        self.client_send(idx, switched);
        let Some(result) = result else {
            // An operation that ended without a result (too large for a reply) stays in
            // the history without a return: it may or may not have taken effect.
            if self.clients[idx].core.take_failed().is_some() {
                self.clients[idx].inflight = None;
                if self.issuing {
                    self.issue(idx);
                }
            }
            return;
        };
        if let Some(h) = self.clients[idx].inflight.take() {
            let entry = &self.history[h];
            self.workload.observe(entry.client, &entry.op, &result);
            self.history[h].ret = Some((self.now, result));
            self.report.ops_completed += 1;
            self.report.completed_at.push(self.now);
        }
        if self.issuing {
            self.issue(idx);
        }
    }

    /// Push event `seq` of `client` as correct node `n` sent it: every correct node must
    /// send the same bytes under one number (numbers follow decided order).
    fn check_push(&mut self, n: NodeId, client: ClientId, seq: u64, digest: Digest) {
        match self.pushes.get(&(client, seq)) {
            Some(d) if *d != digest => self.violation(
                "push-agreement",
                format!("node {n} sent push {seq} of client {client} with different bytes than another node"),
            ),
            Some(_) => {}
            None => {
                self.pushes.insert((client, seq), digest);
            }
        }
    }

    /// What client `idx`'s core delivered of its push events: in order, each one what
    /// correct nodes sent under its number.
    fn delivered_pushes(&mut self, idx: usize, delivered: Vec<Pushed>) {
        let id = self.clients[idx].core.id();
        for p in delivered {
            let (first, last) = match &p {
                Pushed::Event { seq, event } => {
                    if self.pushes.get(&(id, *seq)) != Some(&Digest::of(event)) {
                        self.violation(
                            "push-agreement",
                            format!("client {id} accepted push {seq}, which no correct node sent"),
                        );
                    }
                    self.report.pushes_delivered += 1;
                    (*seq, *seq)
                }
                Pushed::Gap { first, last } => {
                    self.report.push_gaps += 1;
                    (*first, *last)
                }
            };
            self.workload.on_push(id.0, self.now, &p);
            let next = &mut self.clients[idx].push_next;
            if first != *next || last < first {
                let expected = *next;
                self.violation(
                    "push-order",
                    format!("client {id} got pushes {first}..={last}, expected {expected} next"),
                );
            }
            self.clients[idx].push_next = last + 1;
        }
        let acks = self.clients[idx].core.poll_send();
        self.client_send(idx, acks);
    }

    fn client_tick(&mut self, c: usize) {
        let delivered = self.clients[c].core.on_push_tick(self.now);
        self.delivered_pushes(c, delivered);
        if self.clients[c].inflight.is_none() {
            if self.issuing {
                self.issue(c);
            }
            return;
        }
        let msgs = self.clients[c].core.on_tick(self.now);
        self.client_send(c, msgs);
    }

    fn issue(&mut self, c: usize) {
        let id = self.clients[c].core.id();
        let op = self.workload.next_op(&mut self.rng, id.0);
        let read = self.workload.read_mode(&mut self.rng, &op);
        let started = match read {
            None => self.clients[c].core.invoke(self.now, op.clone()),
            Some(consistency) => self.clients[c].core.invoke_read_only(self.now, op.clone(), consistency),
        };
        let Ok(msgs) = started else {
            return;
        };
        self.history.push(HistoryEntry { client: id.0, op, invoke: self.now, ret: None, read });
        self.clients[c].inflight = Some(self.history.len() - 1);
        self.client_send(c, msgs);
    }

    /// Sends what client `c` produced; every ordered request it sends (a fresh one, or a
    /// read-only operation it had to order) is one the validity check must know.
    fn client_send(&mut self, c: usize, msgs: Vec<(NodeId, Message)>) {
        let from = Peer::Client(self.clients[c].core.id());
        for (n, m) in msgs {
            if let Message::Request(req) = &m {
                self.submitted.insert((req.client, req.seq), req.op.digest());
            }
            self.transmit(from, Peer::Node(n), codec::encode(&m));
        }
    }

    /// Online safety checks on what correct node `n` (stable id) reports in membership
    /// epoch `epoch`.
    fn on_event(&mut self, n: NodeId, e: Event, epoch: u64) {
        let correct = self.is_correct(n);
        match e {
            Event::Decided { seq, digest } => {
                self.trace_line(format!("{} n{n} decided {seq} {digest:?}", self.now));
                if !correct {
                    return;
                }
                match self.decided.get(&(epoch, seq)) {
                    Some(d) if *d != digest => {
                        let d = *d;
                        self.violation(
                            "agreement",
                            format!("instance {seq}: node {n} decided {digest:?}, another correct node {d:?}"),
                        );
                    }
                    Some(_) => {}
                    None => {
                        self.decided.insert((epoch, seq), digest);
                    }
                }
            }
            Event::EpochEnded { epoch: next, seq } => {
                self.trace_line(format!("{} n{n} epoch {epoch} ended at {seq}, next {next}", self.now));
            }
            Event::EpochStarted { .. } => self.started_epoch(n),
            Event::Removed { .. } => {
                // It stays, retired, to help the others end the epoch (epoch.rs).
                self.nodes[n.index()].role = Role::Removed;
                self.trace_line(format!("{} n{n} removed", self.now));
            }
            Event::Ticked { seq, time } => {
                if correct {
                    self.ticks_pending.insert((n, seq), time);
                }
            }
            Event::Executed { seq, requests } => {
                if !correct {
                    return;
                }
                let tick = self.ticks_pending.remove(&(n, seq));
                match self.ticked_at.get(&seq) {
                    Some(t) if *t != tick => {
                        let t = *t;
                        self.violation(
                            "tick-agreement",
                            format!("node {n} ticked at {tick:?} before instance {seq}, another correct node at {t:?}"),
                        );
                    }
                    Some(_) => {}
                    None => {
                        self.report.ticks += u64::from(tick.is_some());
                        self.ticked_at.insert(seq, tick);
                    }
                }
                let list: Vec<(ClientId, u64, Digest)> = requests.iter().map(|r| (r.client, r.seq, r.op)).collect();
                for (client, cseq, op) in &list {
                    match self.submitted.get(&(*client, *cseq)) {
                        Some(d) if d == op => {}
                        Some(_) => self.violation(
                            "validity",
                            format!("node {n} executed ({client}, {cseq}) with an operation the client never sent"),
                        ),
                        None => self.violation(
                            "validity",
                            format!("node {n} executed ({client}, {cseq}), which no client submitted"),
                        ),
                    }
                    match self.fresh_at.get(&(*client, *cseq)) {
                        Some(s) if *s != seq => {
                            let s = *s;
                            self.violation(
                                "exactly-once",
                                format!("({client}, {cseq}) executed in instance {s} and again in {seq}"),
                            );
                        }
                        _ => {
                            self.fresh_at.insert((*client, *cseq), seq);
                        }
                    }
                }
                match self.executed_at.get(&seq) {
                    Some(prev) if *prev != list => {
                        self.violation(
                            "exactly-once",
                            format!("instance {seq} executed different requests on node {n}"),
                        );
                    }
                    Some(_) => {}
                    None => {
                        self.executed_at.insert(seq, list);
                    }
                }
            }
            Event::Checkpoint { seq, root } => {
                if !correct {
                    return;
                }
                let roots = if self.is_exec_id(n) { &self.exec_roots } else { &self.roots };
                match roots.get(&seq) {
                    Some(r) if *r != root => {
                        let r = *r;
                        self.violation(
                            "checkpoint-roots",
                            format!("node {n} has root {root:?} at {seq}, another correct node {r:?}"),
                        );
                    }
                    Some(_) => {}
                    None if self.is_exec_id(n) => {
                        self.exec_roots.insert(seq, root);
                    }
                    None => {
                        self.roots.insert(seq, root);
                    }
                }
            }
            Event::Divergence { seq, local, stable } => {
                if correct {
                    self.violation(
                        "checkpoint-roots",
                        format!("node {n} diverged at {seq}: local {local:?}, stable {stable:?}"),
                    );
                }
            }
            Event::ViewChangeStarted { view } => {
                self.trace_line(format!("{} n{n} view-change -> {view}", self.now));
                if correct {
                    self.report.view_changes += 1;
                    if !self.opts.faults.any() {
                        self.violation(
                            "no-spurious-view-change",
                            format!("node {n} started a view change to {view} in a fault-free run"),
                        );
                    }
                }
            }
            Event::ViewInstalled { view } => {
                if correct {
                    self.report.views_installed.entry(view).or_insert(self.now);
                }
                self.trace_line(format!("{} n{n} installed view {view}", self.now))
            }
            Event::SlowPrimary { view, rate, best } => {
                if correct {
                    self.report.slow_primary_suspicions += 1;
                }
                self.trace_line(format!("{} n{n} primary of view {view} slow: {rate} vs {best}", self.now))
            }
            Event::RejoinBounds { view, executed } => {
                self.trace_line(format!("{} n{n} rejoining: waits for view {view}, executed {executed}", self.now));
            }
            Event::Rejoined { view, stable } => {
                self.report.faults.rejoined += 1;
                if let Some(node) = self.nodes.get_mut(n.0 as usize) {
                    node.wiped = false;
                }
                self.trace_line(format!("{} n{n} rejoined at view {view}, stable {stable}", self.now));
            }
            Event::StateTransferStarted { seq, .. } => {
                self.report.state_transfers += 1;
                self.trace_line(format!("{} n{n} state transfer to {seq}", self.now));
            }
            Event::Rejected { kind, reason, .. } => {
                self.report.rejected += 1;
                let reason = format!("{reason:?}");
                let variant = reason.split([' ', '{', '(']).next().unwrap_or_default().to_string();
                *self.report.rejected_by.entry(format!("{kind}: {variant}")).or_default() += 1;
            }
            Event::StateTransferDone { seq, chunks, reused } => {
                if correct {
                    self.report.transfer_chunks += chunks as u64;
                    self.report.transfer_chunks_reused += reused as u64;
                }
                self.trace_line(format!(
                    "{} n{n} state transfer to {seq} done: {chunks} chunks, {reused} held",
                    self.now
                ));
            }
            Event::OperationsFetched { count, .. } if correct => self.report.ops_fetched += count as u64,
            // The simulator keeps every checkpoint in memory: nothing can be unreadable.
            Event::SnapshotUnreadable { why } => self.violation("snapshot-unreadable", format!("node {n}: {why}")),
            Event::Stable { .. }
            | Event::ReadAnswered { .. }
            | Event::PushDropped { .. }
            | Event::OperationsFetched { .. } => {}
        }
    }

    fn crash(&mut self, n: NodeId) {
        let tear = self.rng.gen_bool(0.5);
        let node = &mut self.nodes[n.index()];
        if !node.up() {
            return;
        }
        if let Some(Core::Rq(rq)) = node.core.take() {
            node.rq_certs = rq.epoch_certs().to_vec();
        }
        node.epoch += 1;
        node.disk.crash(&mut self.rng, tear);
        self.report.faults.crashes += 1;
        self.trace_line(format!("{} n{n} crash", self.now));
    }

    fn restart(&mut self, n: NodeId) {
        let now = self.node_now(n);
        let node = &mut self.nodes[n.index()];
        if node.stage == Stage::Rq {
            // Nothing on disk but the epoch certificates it followed (rq_node.rs).
            let s = &node.secrets;
            let mut rq = RqNode::new(self.cfg.clone(), stage_node(n.0), s.signing.clone(), s.mac_secret);
            let followed = rq.follow(node.rq_certs.clone());
            node.core = Some(Core::Rq(rq));
            if let Err(e) = followed {
                self.violation("recovery", format!("RQ node {n} cannot follow its own certificates: {e}"));
                return;
            }
            self.report.faults.restarts += 1;
            self.trace_line(format!("{} n{n} (RQ) restart", self.now));
            return;
        }
        let (snapshots, records) = node.disk.recover();
        if node.stage == Stage::Exec {
            let signing = node.secrets.signing.clone();
            let start = NodeStart { node: (stage_node(n.0)).0, fresh: node.wiped, byzantine: false };
            match ExecNode::recover(
                self.cfg.clone(),
                stage_node(n.0),
                signing,
                self.workload.node_service(start),
                snapshots,
                &records,
            ) {
                Ok(e) => node.core = Some(Core::Exec(e)),
                Err(e) => {
                    self.violation("recovery", format!("execution node {n} cannot recover: {e}"));
                    return;
                }
            }
            self.report.faults.restarts += 1;
            self.trace_line(format!("{} n{n} (execution) restart", self.now));
            return;
        }
        let wiped = node.wiped && snapshots.is_empty() && records.is_empty();
        let durable = Durable { snapshots, records };
        let mut out = Outputs::default();
        let service =
            self.workload.node_service(NodeStart { node: n.0, fresh: wiped, byzantine: node.byzantine.is_some() });
        // The epoch its disk names, else its configuration file's.
        let cfg = match durable.membership().or_else(|| node.file_membership.clone()).map(|m| self.cfg.next_epoch(m)) {
            Some(Ok(cfg)) => cfg,
            Some(Err(e)) => {
                self.violation("recovery", format!("node {n} recovers a membership without valid quorums: {e}"));
                return;
            }
            None => self.cfg.clone(),
        };
        if cfg.membership.index_of(n).is_none() {
            self.violation("recovery", format!("node {n} restarts outside its own membership"));
            return;
        }
        let epoch = cfg.epoch();
        let said = node.epoch_sent_max;
        if !wiped && epoch < said && self.is_correct(n) {
            self.violation(
                "recovery",
                format!("node {n} recovers in epoch {epoch}, but it sent messages in epoch {said} before its crash"),
            );
        }
        let node = &mut self.nodes[n.index()];
        let cfg = node_options(cfg, n);
        let started = if wiped {
            Replica::rejoin(cfg, n, node.secrets.clone(), service, now, &mut out)
        } else {
            Replica::recover(cfg, n, node.secrets.clone(), service, durable, now, &mut out)
        };
        match started {
            Ok(r) => node.core = Some(Core::Order(r)),
            Err(e) => {
                self.violation("recovery", format!("node {n} cannot recover: {e}"));
                return;
            }
        }
        self.report.faults.restarts += 1;
        let how = if wiped { " with a wiped disk" } else { "" };
        self.trace_line(format!("{} n{n} restart in epoch {epoch}{how}", self.now));
        self.process_outputs(n, out, epoch);
    }

    /// The administrator's next membership change: add a spare node, or remove a member
    /// while more than `2u + r + 1` remain, naming the epoch its client core last
    /// learned. Sometimes a second session asks for another change at the same time: at
    /// most one of the two applies (the other names a past epoch, or shares its instance).
    fn admin_op(&mut self) {
        if !self.issuing {
            return;
        }
        let next = self.now + self.rng.gen_range(100..500);
        self.schedule(next, Ev::Admin);
        if self.admin.is_empty() || self.admin.iter().any(|(c, pending)| pending.is_some() || c.busy()) {
            return;
        }
        let m = self.admin[0].0.membership().clone();
        let sessions = if self.rng.gen_bool(0.3) { 2 } else { 1 };
        for session in 0..sessions {
            let spare = self.nodes.iter().position(|x| x.role == Role::Spare);
            let min = 2 * m.u as usize + m.r as usize + 1;
            let faults = if session == 0 && self.rng.gen_bool(0.25) { self.faults_change(&m) } else { None };
            let change = if let Some(change) = faults {
                change
            } else if m.n() > min && (spare.is_none() || session == 1 || self.rng.gen_bool(0.5)) {
                Change::Remove(m.members[self.rng.gen_range(0..m.n())].id)
            } else if let (Some(s), 0) = (spare, session) {
                Change::Add(Member { id: s as u32, key: self.nodes[s].secrets.signing.public(), addr: String::new() })
            } else {
                continue;
            };
            let op = AdminOp::sign(&self.admin_key, m.epoch, change.clone()).encode();
            let (core, pending) = &mut self.admin[session];
            let Ok(msgs) = core.invoke(self.now, op) else { continue };
            let from = core.id();
            *pending = Some(change.clone());
            self.report.faults.admin_ops += 1;
            self.trace_line(format!("{} admin/{session} {change:?} in epoch {}", self.now, m.epoch));
            self.admin_send(from, msgs);
        }
        let at = self.now + CLIENT_TICK_MS;
        self.schedule(at, Ev::AdminTick);
    }

    /// A `set-faults` change the model allows on membership `m`: the same (u, r) (an epoch
    /// change that keeps every member's index and key: what a replay of an earlier epoch's
    /// statements needs, issue #21 defect 1), or r moved within what the Byzantine members
    /// and the nodes allow, never raised while a stage runs apart (a node of it that has
    /// not seen the change would still believe r + 1 peers).
    fn faults_change(&mut self, m: &Membership) -> Option<Change> {
        // Lying nodes of any stage: r bounds each stage's liars.
        let byzantine = self
            .nodes
            .iter()
            .filter(|n| n.byzantine.is_some() || n.exec_byzantine.is_some() || n.rq_byzantine.is_some())
            .count();
        let apart = self.nodes.iter().any(|n| n.stage != Stage::Order);
        // With auth = mac (the default of a crash-tolerant cluster) a client whose MACs
        // fail at some nodes stalls a Byzantine-tolerant one until a view change (PBFT's
        // known weakness, which rq-mac removes): raising r there trades liveness under
        // the simulator's faulty client, so r grows only under rq-mac or sig.
        let weak_auth = self.cfg.auth == keel_core::config::Auth::Mac;
        let r_max = if apart || weak_auth { m.r } else { m.u.min((m.n() as u32).saturating_sub(2 * m.u + 1)) };
        // A latent liar may have turned in any epoch that had room for it: r stays up.
        let latent = self.nodes.iter().filter(|n| n.latent.is_some() && n.byzantine.is_none()).count();
        let r_min = (byzantine + if m.r as usize > byzantine { latent } else { 0 }) as u32;
        if r_min > r_max {
            return None;
        }
        let r = self.rng.gen_range(r_min..=r_max);
        // With a latent liar, raise r whenever it may: the liar turns in that epoch.
        let r = if latent > 0 { r_max } else { r };
        Some(Change::Faults { u: m.u, r })
    }

    fn admin_send(&mut self, from: ClientId, msgs: Vec<(NodeId, Message)>) {
        for (n, m) in msgs {
            if let Message::Request(req) = &m {
                self.submitted.insert((req.client, req.seq), req.op.digest());
            }
            // Sessions share their owner's connection (and its identity).
            self.transmit(Peer::Client(owner_of(from)), Peer::Node(n), codec::encode(&m));
        }
    }

    fn admin_tick(&mut self) {
        let mut busy = false;
        for session in 0..self.admin.len() {
            let (core, pending) = &mut self.admin[session];
            if pending.is_none() {
                continue;
            }
            busy = true;
            let from = core.id();
            let msgs = core.on_tick(self.now);
            self.admin_send(from, msgs);
        }
        if busy {
            let at = self.now + CLIENT_TICK_MS;
            self.schedule(at, Ev::AdminTick);
        }
    }

    fn deliver_to_admin(&mut self, session: usize, from: NodeId, msg: Message) {
        let Some((core, pending)) = self.admin.get_mut(session) else { return };
        let result = match msg {
            Message::Reply(reply) => core.on_reply(from, reply),
            Message::EpochCerts(certs) => {
                core.on_epoch_certs(certs);
                None
            }
            _ => None,
        };
        let msgs = core.poll_send();
        let id = core.id();
        let change = result.as_ref().and_then(|_| pending.take());
        self.admin_send(id, msgs);
        let (Some(bytes), Some(change)) = (result, change) else { return };
        let Some(outcome) = keel_core::membership::decode_result(&bytes) else {
            self.violation("admin", "an admin reply that does not decode".into());
            return;
        };
        self.trace_line(format!("{} admin/{session} {change:?}: {:?}", self.now, outcome.as_ref().map(|m| m.epoch)));
        let (Ok(m), Change::Add(member)) = (outcome, change) else { return };
        // The new node starts from the membership in the reply, with no state.
        let id = member.id;
        let cfg = self.cfg.next_epoch(m.clone()).expect("valid membership");
        if m.index_of(NodeId(id)).is_none() {
            return;
        }
        let byzantine = self.nodes[id as usize].byzantine.is_some();
        let service = self.workload.node_service(NodeStart { node: id, fresh: true, byzantine });
        let node = &mut self.nodes[id as usize];
        node.role = Role::Member;
        node.file_membership = Some(m.clone());
        node.core =
            Some(Core::Order(Replica::new(node_options(cfg, NodeId(id)), NodeId(id), node.secrets.clone(), service)));
        self.memberships.entry(m.epoch).or_insert_with(|| m.members.iter().map(|x| x.id).collect());
        self.schedule(self.now + 1, Ev::NodeTick(NodeId(id)));
    }

    /// Injects the next fault and schedules the one after.
    fn nemesis(&mut self) {
        if !self.issuing {
            return;
        }
        let next = self.now + self.rng.gen_range(100..700);
        self.schedule(next, Ev::Nemesis);
        let members: Vec<NodeId> =
            NodeRange::first(self.nodes.len()).filter(|i| self.nodes[i.index()].role == Role::Member).collect();
        let mut kinds = Vec::new();
        if self.opts.faults.crash {
            kinds.extend(["crash", "crash", "outage", "wipe", "gone"]);
        }
        if self.opts.faults.network {
            kinds.extend(["partition", "heal", "clock", "straggler"]);
        }
        let kind = kinds[self.rng.gen_range(0..kinds.len())];
        match kind {
            "crash" => {
                let victim = members[self.rng.gen_range(0..members.len())];
                self.crash(victim);
                let back = self.now + self.rng.gen_range(50..1500);
                self.schedule(back, Ev::Restart(victim));
            }
            "wipe" | "gone" if self.rng.gen_bool(0.5) => {
                // A node loses its disk (UpRight §3.2) and restarts empty: it rejoins
                // without voting until it caught up (replica/rejoin.rs); or it is gone
                // for good and liveness is checked without it. Either counts against u
                // until it is back, so only while the faults budget has room for it.
                let byzantine = self.nodes.iter().filter(|n| n.byzantine.is_some()).count();
                let out = self.nodes.iter().filter(|n| n.wiped || n.gone).count();
                let honest_order = |v: &NodeId| {
                    let node = &self.nodes[v.index()];
                    node.stage == Stage::Order && node.byzantine.is_none() && !node.gone
                };
                let order: Vec<NodeId> = members.iter().copied().filter(honest_order).collect();
                // Not with membership changes: a removed node that crashes at its epoch's
                // end stays down too (it is no member to restart), which with a node gone
                // for good leaves that epoch's end short of a quorum (beyond u).
                let room = byzantine + out < self.opts.u as usize && !order.is_empty();
                // With execution apart, the node gone for good may be an execution node,
                // within that stage's own u (issue #21 defect 6: a certified execution
                // checkpoint must stay fetchable without it). Drawn only when there are
                // execution nodes, so co-located runs replay as before.
                let executors: Vec<NodeId> =
                    NodeRange::first(self.nodes.len()).filter(|v| self.nodes[v.index()].stage == Stage::Exec).collect();
                if kind == "gone" && !self.opts.reconfig && !executors.is_empty() && self.rng.gen_bool(0.5) {
                    let faulty = executors
                        .iter()
                        .filter(|v| self.nodes[v.index()].exec_byzantine.is_some() || self.nodes[v.index()].gone)
                        .count();
                    let honest: Vec<NodeId> = executors
                        .iter()
                        .copied()
                        .filter(|v| self.nodes[v.index()].exec_byzantine.is_none() && !self.nodes[v.index()].gone)
                        .collect();
                    if faulty < self.opts.u as usize && !honest.is_empty() {
                        let victim = honest[self.rng.gen_range(0..honest.len())];
                        self.crash(victim);
                        self.nodes[victim.0 as usize].gone = true;
                        self.report.faults.gone += 1;
                        self.trace_line(format!("{} execution node n{victim} down for good", self.now));
                    }
                } else if room && kind == "gone" && !self.opts.reconfig {
                    let victim = order[self.rng.gen_range(0..order.len())];
                    self.crash(victim);
                    self.nodes[victim.0 as usize].gone = true;
                    self.report.faults.gone += 1;
                    self.trace_line(format!("{} n{victim} down for good", self.now));
                } else if room && kind == "wipe" {
                    let victim = order[self.rng.gen_range(0..order.len())];
                    if self.nodes[victim.0 as usize].up() {
                        self.crash(victim);
                        self.nodes[victim.0 as usize].disk = SimDisk::default();
                        self.nodes[victim.0 as usize].wiped = true;
                        self.nodes[victim.0 as usize].epoch_sent_max = 0;
                        self.report.faults.wipes += 1;
                        self.trace_line(format!("{} n{victim} disk wiped", self.now));
                        let back = self.now + self.rng.gen_range(50..1500);
                        self.schedule(back, Ev::Restart(victim));
                        // Half the time another order node crashes while this one rejoins
                        // (as in crates/cli/tests/wiped.rs): the quorum it must not
                        // complete with its empty state is then the one left.
                        let others: Vec<NodeId> = order.iter().copied().filter(|v| *v != victim).collect();
                        if !others.is_empty() && self.rng.gen_bool(0.5) {
                            let other = others[self.rng.gen_range(0..others.len())];
                            let at = back + self.rng.gen_range(0..800);
                            self.schedule(at, Ev::CrashDuringRejoin(other));
                        }
                    }
                }
            }
            "outage" if self.rng.gen_bool(0.3) => {
                // Every node at once (UpRight §4.2): nothing acknowledged may be lost.
                for &v in &members {
                    self.crash(v);
                }
                self.report.faults.total_outages += 1;
                let back = self.now + self.rng.gen_range(50..800);
                for &v in &members {
                    self.schedule(back + v.0 as u64 * 7, Ev::Restart(v));
                }
            }
            "partition" => {
                for s in self.sides.iter_mut() {
                    *s = self.rng.gen_range(0..2);
                }
                for c in self.clients.iter_mut() {
                    c.side = self.rng.gen_range(0..2);
                }
                self.report.faults.partitions += 1;
                let sides = self.sides.clone();
                self.trace_line(format!("{} partition {sides:?}", self.now));
            }
            "heal" => {
                self.sides.iter_mut().for_each(|s| *s = 0);
                self.clients.iter_mut().for_each(|c| c.side = 0);
            }
            "straggler" => {
                let victim = members[self.rng.gen_range(0..members.len())];
                let until = self.now + self.rng.gen_range(300..3000);
                self.straggler = Some((Peer::Node(victim), until));
                self.report.faults.stragglers += 1;
                self.trace_line(format!("{} n{victim} straggles until {until}", self.now));
            }
            "clock" => {
                // A node's clock jumps, forward or back, by up to twice the proposal-time
                // tolerance (NTP stepping a clock, a VM resumed): cores see time only
                // through `now`, never going back inside a node, and agreed time comes
                // from the primary's proposals, checked against each backup's clock.
                let victim = members[self.rng.gen_range(0..members.len())];
                let tolerance = self.opts.options.clock_tolerance_ms as i64;
                let jump = self.rng.gen_range(-2 * tolerance..=2 * tolerance);
                self.nodes[victim.0 as usize].skew += jump;
                self.report.faults.clock_jumps += 1;
                self.trace_line(format!("{} n{victim} clock jumps by {jump} ms", self.now));
            }
            _ => {}
        }
    }
}

/// Runs one step of a node, catching a failed invariant (a panic) as its message.
/// A client core of `cfg`'s cluster: its auth mode, and where its stages run.
fn with_stages(core: Client, cfg: &ClusterConfig) -> Client {
    let core = core.with_auth(cfg.auth);
    let core = if cfg.separated() { core.with_executors(cfg.exec_ids().into()) } else { core };
    if cfg.rq_separated() {
        core.with_rq_nodes(cfg.rq_ids().into())
    } else {
        core
    }
}

fn catch_step(step: impl FnOnce()) -> Result<(), String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(step)).map_err(crate::panic_message)
}

/// The stable id a core's output is for: every core names nodes by stable id, a node of a
/// stage apart by its stage name (`config::stage_node`).
fn route(to: Peer) -> Peer {
    match to {
        Peer::Node(name) => Peer::Node(stage_id(name).map_or(name, NodeId)),
        client => client,
    }
}
