//! block under Keel's simulator (issue #24): Gnothi's protocol run by the simulator's
//! clients against the real block service on every simulated node, under every fault the
//! simulator injects, and the checks its histories must pass.
//!
//! What is real and what is modelled:
//! - **Real**: the agreed metadata (`BlockService`, ordered and read through the
//!   simulated cores), each node's local store (`Local`: its data and held files, its
//!   PrepareData log, in a directory of its own that a restart opens again and a wipe
//!   removes), and the rule for using a served copy (`check::judge`).
//! - **Modelled** (the front end is async network code the simulator does not run): a
//!   client is a front end attached to one node. A write sends PrepareData to the block's
//!   preferred nodes that are up — some lost on the way, so blocks go INCOMPLETE, and
//!   reserve nodes asked in their place — waits for u + r + 1 acknowledgements, then
//!   orders the WriteData. A read orders nothing: it reads the metadata with a read
//!   index, then fetches the data from its own node, the preferred nodes, the others, in
//!   that order, judging each copy. Recovery phase 2 runs after every answer: each up
//!   node fetches the preferred blocks it holds at an older version than it agreed.
//!   PrepareData and fetches are not delayed or cut by the simulated network. Now and
//!   then a front end restarts between its PrepareData and its WriteData: the write is
//!   abandoned (never ordered, so not in the history), and the restarted front end
//!   orders a new epoch and numbers its writes from 1 again, as `begin` does.
//!
//! A Byzantine node (the simulator's own choice, so the fault budget holds) acknowledges
//! PrepareData it drops, and serves wrong bytes, or its stale ones, as the agreed version.
//!
//! The checks:
//! - **Blocks are linearizable registers of their data.** A write is a write of its
//!   bytes' hash, TRIM a delete, a read a read of the hash of the bytes it was *served*
//!   (not of the metadata's hash): a wrong or stale copy that a reader accepted shows as
//!   a read of a value no linearization gives.
//! - **A write's data is durable before it is acknowledged**: when its reply arrives,
//!   at least u + 1 correct nodes hold it (PrepareData logged, or the block stored at
//!   that version or a newer one); for nodes that are down, what they acknowledged
//!   since their disk was last new.
//! - **A correct node never serves wrong bytes** as a version it claims to hold.
//! - **Nothing ordered is lost**: at the end, after phase 2 has run, every block's
//!   newest agreed data is held by a correct node that is up.
//! - **An abandoned write pins nothing once its epoch ended**: at the end, no correct
//!   node that is up holds its PrepareData if its agreed state ended that epoch; its
//!   bytes can never be read either (no write of them is in the history).

pub use keel_block::check::{judge, Copy};
use keel_block::geometry::Geometry;
use keel_block::local::{Local, Prepare, Refused};
use keel_block::meta::{zero_hash, Command, Hash, Meta, Reply};
use keel_block::BlockService;
use keel_core::ids::NodeId;
use keel_core::message::ReadConsistency;
use keel_core::service::{ExecCtx, Frozen, ReadCtx, RestoreError, Service};
use keel_sim::linearizability::{check_kv, KvOp, KvRet, Operation, Verdict};
use keel_sim::{run_seed, HistoryEntry, NodeStart, SeedReport, SimOptions, Workload};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError, RwLock};

/// Bytes per block: small, so a node's store is small.
const BLOCK_SIZE: u64 = 512;
/// Two 1 MiB stripes: two slices, with different preferred sets.
const EXPORT_BYTES: u64 = 2 << 20;
/// Blocks the clients write and read: four in each slice.
const HOT: [u64; 8] = [0, 1, 2, 3, 2048, 2049, 2050, 2051];
/// A block only the faulty client touches (its requests may or may not execute).
const COLD: u64 = 4000;
/// Reserve storage, as a share of the export (the service's default).
const RESERVE: f64 = 0.10;
/// State expansions the linearizability search may use per block.
const LINEARIZABILITY_BUDGET: u64 = 5_000_000;
/// Front end ids: clear of the simulated node ids.
const OWNER_BASE: u32 = 1_000;
/// One prepared write in this many is abandoned by a restart of its front end.
const RESTART_ONE_IN: u32 = 25;
/// Most lost PrepareData kept for a late delivery.
const LATE_MAX: usize = 64;

/// A deliberate bug in the modelled front end, to show the checks can fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bug {
    /// Orders the WriteData after one acknowledgement fewer than u + r + 1.
    FewerCopies,
    /// Takes a copy at the agreed version without checking its hash.
    TrustHeldVersion,
    /// Takes the first copy it is served, whatever its version: a read served from an
    /// INCOMPLETE block.
    AnyCopy,
    /// Recovery phase 2 stores a copy at the agreed version without checking its hash.
    UncheckedRepair,
    /// The nodes drop a waiting write's PrepareData without the cluster ending its
    /// epoch first (a time bound that frees before it fences).
    DropUnfenced,
}

/// What a run's history held (so a test can see the run was not vacuous).
#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub writes: u64,
    pub writes_acked: u64,
    pub zeros: u64,
    /// Writes the front end could not prepare on enough nodes (it read instead).
    pub writes_refused: u64,
    /// PrepareData sent to a node outside the block's preferred set.
    pub reserve_prepares: u64,
    /// PrepareData lost on its way to a preferred node.
    pub prepares_lost: u64,
    pub reads: u64,
    /// Reads served data (not zeros) that the check judged.
    pub reads_of_data: u64,
    /// Copies a reader passed over as older (INCOMPLETE) on that node.
    pub older_copies: u64,
    /// Copies a Byzantine node served wrong, found by the hash check.
    pub lies_caught: u64,
    /// Reads whose data no up node held at the agreed version.
    pub unavailable: u64,
    /// Blocks recovery phase 2 fetched.
    pub repaired: u64,
    /// Restarts with a wiped disk.
    pub wiped_starts: u64,
    /// Operations the linearizability check judged.
    pub judged: u64,
    /// Writes the cluster fenced (their epoch ended at a tick: the client was idle), and
    /// the epochs clients renewed after one.
    pub writes_fenced: u64,
    pub renewals: u64,
    /// Front ends that restarted between a write's PrepareData and its WriteData.
    pub restarts: u64,
    /// PrepareData lost on its way and delivered later, and how many of those arrived
    /// after the node executed their write.
    pub late_prepares: u64,
    pub late_after_execution: u64,
}

/// The agreed-time tick of a simulated block cluster, and how long a client may order
/// nothing before its epoch ends (`meta::EPOCH_IDLE_MS`, shortened so that clients cut
/// off by a fault go idle within a run).
pub const TICK_MS: u64 = 500;
pub const IDLE_MS: u64 = 1_500;

/// Runs the block workload for one seed.
pub fn run_block_seed(opts: &SimOptions) -> SeedReport {
    run_block_seed_with_stats(opts, None).0
}

/// [`run_block_seed`] with a deliberate front-end bug, and what the history held.
pub fn run_block_seed_with_stats(opts: &SimOptions, bug: Option<Bug>) -> (SeedReport, Stats) {
    let workload = match BlockWorkload::new(opts, bug) {
        Ok(w) => w,
        Err(e) => {
            let violation = keel_sim::Violation { property: "setup", detail: e, at: 0 };
            return (
                SeedReport { seed: opts.seed, violations: vec![violation], ..SeedReport::default() },
                Stats::default(),
            );
        }
    };
    let stats = workload.stats.clone();
    let report = run_seed(&opts.ticking(TICK_MS), workload);
    let stats = stats.lock().map(|s| s.clone()).unwrap_or_default();
    (report, stats)
}

/// One simulated node as the model sees it: its local store and agreed metadata while it
/// runs.
#[derive(Default)]
struct Slot {
    local: Option<Arc<Local>>,
    meta: Option<Arc<RwLock<Meta>>>,
    /// Which start of the node the two above belong to: a service dropped later than its
    /// successor started must not clear them.
    generation: u64,
    byzantine: bool,
    /// Starts with a new disk so far: what it acknowledged before the last one is gone.
    wipes: u64,
}

struct Plane {
    dir: PathBuf,
    geometry: Geometry,
    nodes: Vec<Slot>,
}

impl Plane {
    fn up(&self, i: u32) -> Option<&Arc<Local>> {
        self.nodes.get(i as usize)?.local.as_ref()
    }
}

/// The service each simulated node runs: the real block service over the node's real
/// local store, registered with the model while the node runs.
pub struct SimBlock {
    inner: BlockService,
    node: Option<(u32, u64)>,
    plane: Arc<Mutex<Plane>>,
}

impl Drop for SimBlock {
    fn drop(&mut self) {
        let Some((node, generation)) = self.node else { return };
        let mut plane = self.plane.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(slot) = plane.nodes.get_mut(node as usize).filter(|s| s.generation == generation) {
            // The node crashed (or its epoch ended): its store stays on disk, unreachable.
            slot.local = None;
            slot.meta = None;
        }
    }
}

impl Service for SimBlock {
    fn execute(&mut self, request: &[u8], ctx: &ExecCtx) -> Vec<u8> {
        self.inner.execute(request, ctx)
    }

    fn on_tick(&mut self, ctx: &ExecCtx) {
        self.inner.on_tick(ctx)
    }

    fn execute_read_only(&self, request: &[u8], ctx: &ReadCtx) -> Option<Vec<u8>> {
        self.inner.execute_read_only(request, ctx)
    }

    fn snapshot(&self) -> Vec<u8> {
        self.inner.snapshot()
    }

    fn pieces(&self) -> Vec<Arc<keel_core::chunk::Piece>> {
        self.inner.pieces()
    }

    fn freeze(&self) -> Option<Box<dyn Frozen>> {
        self.inner.freeze()
    }

    fn restore(&mut self, snapshot: &[u8]) -> Result<(), RestoreError> {
        self.inner.restore(snapshot)
    }

    fn restore_from(&mut self, state: &mut dyn std::io::Read, len: u64) -> Result<(), RestoreError> {
        self.inner.restore_from(state, len)
    }
}

/// Why a write's PrepareData did not reach u + r + 1 nodes.
enum Unprepared {
    /// Too few nodes up or answering.
    Short,
    /// A node refused it: the cluster ended the client's epoch.
    EpochEnded,
}

/// What a client's outstanding operation is.
#[derive(Clone, Debug)]
enum Pending {
    /// With the nodes that acknowledged its PrepareData, each with its wipe count then.
    Write {
        block: u64,
        /// (owner, epoch, seq): which PrepareData it is.
        write: (u32, u64, u64),
        hash: Hash,
        acked: Vec<(u32, u64)>,
    },
    Zero,
    Read {
        block: u64,
    },
    /// A new epoch after the client's writes of this one were fenced.
    Renew {
        after: u64,
    },
    /// The new epoch of a front end that restarted and abandoned a prepared write.
    Restart {
        abandoned: (u32, u64, u64),
    },
}

/// What the model saw when an operation returned.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Outcome {
    /// A write or TRIM: its reply is in the history.
    Done,
    /// A read served these bytes' hash (None: zeros).
    Read(Option<Hash>),
    /// A read that could not be served (no up node held the version, or every holder
    /// had moved on to a newer one): not judged.
    NotServed,
}

/// An operation as it returned: its bytes, its result, what the model saw.
#[derive(Clone, Debug)]
struct Answered {
    op: Vec<u8>,
    result: Vec<u8>,
    outcome: Outcome,
}

/// The workload ([`BlockWorkload::new`]).
pub struct BlockWorkload {
    plane: Arc<Mutex<Plane>>,
    /// Removed when the run ends.
    _dir: tempfile::TempDir,
    copies: u32,
    u: u32,
    bug: Option<Bug>,
    /// The model's own choices (lost PrepareData, lies), seeded from the run's seed.
    rng: Mutex<ChaCha8Rng>,
    runtime: tokio::runtime::Runtime,
    seqs: BTreeMap<u64, u64>,
    /// Per client, the epoch it writes in (0 until the cluster fenced it once), and the
    /// epoch it must renew from before its next write.
    epochs: BTreeMap<u64, u64>,
    renew: BTreeMap<u64, u64>,
    /// Per client, a restart whose new epoch it has not been given yet.
    restart: BTreeMap<u64, (u32, u64, u64)>,
    /// Prepared writes their front end abandoned by restarting: (owner, epoch, seq).
    abandoned: Vec<(u32, u64, u64)>,
    counter: u64,
    pending: BTreeMap<u64, Pending>,
    /// Per client, each answered operation in order.
    answered: BTreeMap<u64, Vec<Answered>>,
    /// Each write's data hash → (owner, epoch, seq), for the end audit.
    writes: BTreeMap<Hash, (u32, u64, u64)>,
    /// Each acknowledged write and its version: no correct node that executed it may
    /// keep its PrepareData.
    written: Vec<((u32, u64, u64), u64)>,
    /// PrepareData lost on its way to a node, delivered later (a peer queue's backlog
    /// after a reconnection, a chain passed on late): (node, what).
    late: Vec<(u32, Prepare)>,
    violations: Mutex<Vec<String>>,
    stats: Arc<Mutex<Stats>>,
}

/// The base directory for nodes' stores: shared memory where there is some (the stores
/// fsync at checkpoints), else the temporary directory.
fn base_dir() -> PathBuf {
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    }
}

impl BlockWorkload {
    /// The workload for `opts` (its seed, u and r), with `bug` in its front end.
    ///
    /// # Errors
    /// The stores' directory or the runtime cannot be made.
    pub fn new(opts: &SimOptions, bug: Option<Bug>) -> Result<BlockWorkload, String> {
        let nodes = 2 * opts.u + opts.r + 1;
        let copies = opts.u + opts.r + 1;
        let geometry = Geometry::new(EXPORT_BYTES, BLOCK_SIZE, nodes, copies).map_err(|e| e.to_string())?;
        let dir = tempfile::Builder::new()
            .prefix("keel-block-sim-")
            .tempdir_in(base_dir())
            .map_err(|e| format!("block sim directory: {e}"))?;
        let runtime =
            tokio::runtime::Builder::new_current_thread().build().map_err(|e| format!("block sim runtime: {e}"))?;
        let plane =
            Plane { dir: dir.path().to_path_buf(), geometry, nodes: (0..nodes).map(|_| Slot::default()).collect() };
        Ok(BlockWorkload {
            plane: Arc::new(Mutex::new(plane)),
            _dir: dir,
            copies,
            u: opts.u,
            bug,
            rng: Mutex::new(ChaCha8Rng::seed_from_u64(opts.seed ^ 0x626c6f636b)),
            runtime,
            seqs: BTreeMap::new(),
            epochs: BTreeMap::new(),
            renew: BTreeMap::new(),
            restart: BTreeMap::new(),
            abandoned: Vec::new(),
            counter: 0,
            pending: BTreeMap::new(),
            answered: BTreeMap::new(),
            writes: BTreeMap::new(),
            written: Vec::new(),
            late: Vec::new(),
            violations: Mutex::default(),
            stats: Arc::default(),
        })
    }

    fn plane(&self) -> std::sync::MutexGuard<'_, Plane> {
        self.plane.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn stats(&self) -> std::sync::MutexGuard<'_, Stats> {
        self.stats.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn rng(&self) -> std::sync::MutexGuard<'_, ChaCha8Rng> {
        self.rng.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn geometry(&self) -> Geometry {
        self.plane().geometry
    }

    /// Client `client` writes in `epoch` from now on, numbering its writes from 1 as the
    /// front end does.
    fn new_epoch(&mut self, client: u64, epoch: u64) {
        self.epochs.insert(client, epoch);
        self.seqs.insert(client, 0);
    }

    /// Gnothi §3.2 steps 1-3 as the front end does them: PrepareData to the preferred
    /// nodes that are up (some lost on the way), then to the others (reserve storage),
    /// until u + r + 1 acknowledged. Returns the nodes that did (with their wipe counts),
    /// or why too few did.
    fn prepare(&mut self, prepare: &Prepare) -> Result<Vec<(u32, u64)>, Unprepared> {
        let g = self.geometry();
        let need = match self.bug {
            Some(Bug::FewerCopies) => self.copies as usize - 1,
            _ => self.copies as usize,
        };
        let preferred: Vec<u32> = g.preferred(prepare.first).collect();
        let order: Vec<u32> =
            preferred.iter().copied().chain((0..g.nodes).filter(|i| !preferred.contains(i))).collect();
        let mut acked = Vec::new();
        let mut ended = false;
        for i in order {
            if acked.len() >= need {
                break;
            }
            let (local, byzantine) = {
                let plane = self.plane();
                let Some(local) = plane.up(i) else { continue };
                (local.clone(), plane.nodes[i as usize].byzantine)
            };
            let is_preferred = preferred.contains(&i);
            if is_preferred && self.rng().gen_bool(0.15) {
                self.stats().prepares_lost += 1;
                if self.late.len() < LATE_MAX && self.rng().gen_bool(0.5) {
                    self.late.push((i, prepare.clone()));
                }
                continue;
            }
            if !is_preferred {
                self.stats().reserve_prepares += 1;
            }
            if byzantine && self.rng().gen_bool(0.5) {
                // Acknowledged, and dropped.
                acked.push(i);
                continue;
            }
            match self.runtime.block_on(local.prepare(prepare.clone())) {
                Ok(()) => acked.push(i),
                Err(Refused::OldEpoch) => ended = true,
                Err(_) => {}
            }
        }
        if acked.len() < need {
            return Err(if ended { Unprepared::EpochEnded } else { Unprepared::Short });
        }
        let plane = self.plane();
        Ok(acked.into_iter().map(|i| (i, plane.nodes[i as usize].wipes)).collect())
    }

    /// No correct node that is up holds the PrepareData of an abandoned write whose
    /// epoch its agreed state ended.
    fn audit_abandoned(&self) {
        self.each_correct_node(|i, local, meta| {
            for &(owner, epoch, seq) in &self.abandoned {
                if meta.epoch(owner) > epoch && local.has_prepared(NodeId(owner), epoch, seq) {
                    self.violation(format!(
                        "node {i} holds the PrepareData of front end {owner}'s abandoned write {seq} of epoch \
                         {epoch}, which its state ended"
                    ));
                }
            }
        });
    }

    /// Runs `f` on each correct node that is up: its index, data and agreed metadata.
    fn each_correct_node(&self, mut f: impl FnMut(usize, &Local, &Meta)) {
        let plane = self.plane();
        for (i, slot) in plane.nodes.iter().enumerate() {
            let (Some(local), Some(meta)) = (plane.up(i as u32), slot.meta.as_ref()) else { continue };
            if !slot.byzantine {
                f(i, local, &meta.read().unwrap_or_else(PoisonError::into_inner));
            }
        }
    }

    /// Delivers one PrepareData that was lost on its way, now, whatever became of its
    /// write: the node takes it, or refuses it as of an ended epoch or an executed write.
    fn deliver_late(&mut self, rng: &mut ChaCha8Rng) {
        if self.late.is_empty() {
            return;
        }
        let (i, prepare) = self.late.swap_remove(rng.gen_range(0..self.late.len()));
        let Some((local, executed)) = self.plane().nodes.get(i as usize).and_then(|slot| {
            let meta = slot.meta.as_ref()?.read().unwrap_or_else(PoisonError::into_inner);
            Some((slot.local.clone()?, meta.executed(prepare.owner.0, prepare.epoch, prepare.seq)))
        }) else {
            return;
        };
        self.stats().late_prepares += 1;
        if executed {
            self.stats().late_after_execution += 1;
        }
        let _ = self.runtime.block_on(local.prepare(prepare));
    }

    /// No correct node that is up holds the PrepareData of a write it executed.
    fn audit_executed(&self) {
        self.each_correct_node(|i, local, meta| {
            let at = meta.version();
            for &((owner, epoch, seq), version) in &self.written {
                if version <= at && local.has_prepared(NodeId(owner), epoch, seq) {
                    self.violation(format!(
                        "node {i} holds the PrepareData of front end {owner}'s write {seq} of epoch {epoch}, which \
                         it executed (version {version}; it is at {at})"
                    ));
                }
            }
        });
    }

    /// [`Bug::DropUnfenced`]: every up node drops the PrepareData of another client's
    /// write that is on its way to be ordered, though the cluster did not end its epoch.
    fn drop_unfenced(&mut self, client: u64) {
        let Some((owner, epoch)) = self.pending.iter().find_map(|(c, p)| match p {
            Pending::Write { write: (owner, epoch, _), .. } if *c != client => Some((*owner, *epoch)),
            _ => None,
        }) else {
            return;
        };
        let plane = self.plane();
        for local in plane.nodes.iter().filter_map(|n| n.local.as_ref()) {
            local.new_epoch(NodeId(owner), epoch + 1);
        }
    }

    /// Node `i`'s copy of block `b`, as it serves it: a Byzantine node now and then
    /// serves wrong bytes, or the bytes it holds, as version `claim`.
    fn served(&self, plane: &Plane, i: u32, b: u64, claim: u64) -> Option<(u64, Vec<u8>)> {
        let local = plane.up(i)?;
        let (mut data, held) = local.read(b, 1).ok()?;
        let mut held = held.first().copied()?;
        if plane.nodes[i as usize].byzantine {
            match self.rng().gen_range(0..3) {
                0 => {}
                1 => {
                    held = claim;
                    data[7] ^= 0x5a;
                }
                _ => held = claim,
            }
        }
        Some((held, data))
    }

    /// Fetches block `b` at `want` for a front end on node `home`: its own node first,
    /// then the preferred nodes, then the rest; each copy judged.
    fn fetch(&self, home: u32, b: u64, want: (u64, Hash)) -> Outcome {
        let plane = self.plane();
        let g = plane.geometry;
        let order: Vec<u32> =
            std::iter::once(home).chain(g.preferred(b)).chain(0..g.nodes).fold(Vec::new(), |mut v, i| {
                if !v.contains(&i) {
                    v.push(i);
                }
                v
            });
        let mut newer = false;
        for i in order {
            let Some((held, data)) = self.served(&plane, i, b, want.0) else { continue };
            let mut verdict = judge(want, held, &data);
            match self.bug {
                Some(Bug::TrustHeldVersion) if verdict == Copy::Wrong => verdict = Copy::Good,
                Some(Bug::AnyCopy) => verdict = Copy::Good,
                _ => {}
            }
            match verdict {
                Copy::Good => return Outcome::Read(Some(*blake3::hash(&data).as_bytes())),
                Copy::Wrong => {
                    if plane.nodes[i as usize].byzantine {
                        self.stats().lies_caught += 1;
                    } else {
                        self.violation(format!(
                            "correct node {i} served block {b} as version {} with other bytes",
                            want.0
                        ));
                    }
                }
                Copy::Older => self.stats().older_copies += 1,
                Copy::Newer => newer = true,
            }
        }
        if !newer {
            self.stats().unavailable += 1;
        }
        Outcome::NotServed
    }

    fn violation(&self, what: String) {
        self.violations.lock().unwrap_or_else(PoisonError::into_inner).push(what);
    }

    /// Recovery phase 2 on every up node: each preferred block it agreed on at a version
    /// it does not hold is fetched from the others (judged like a read) and stored.
    fn repair(&self) {
        let plane = self.plane.clone();
        let plane = plane.lock().unwrap_or_else(PoisonError::into_inner);
        let g = plane.geometry;
        let zero = zero_hash(g.bs());
        for i in 0..g.nodes {
            let (Some(local), Some(meta)) = (plane.up(i), plane.nodes[i as usize].meta.as_ref()) else { continue };
            if plane.nodes[i as usize].byzantine {
                continue;
            }
            for &b in &HOT {
                if !g.is_preferred(b, i) {
                    continue;
                }
                let want = meta.read().unwrap_or_else(PoisonError::into_inner).get(b);
                if want.0 == 0 || want.1 == zero {
                    continue;
                }
                let Ok((_, held)) = local.read(b, 1) else { continue };
                if held.first().is_some_and(|&h| h >= want.0) {
                    continue;
                }
                for j in (0..g.nodes).filter(|&j| j != i) {
                    let Some((held, data)) = self.served(&plane, j, b, want.0) else { continue };
                    let mut verdict = judge(want, held, &data);
                    if self.bug == Some(Bug::UncheckedRepair) && verdict == Copy::Wrong {
                        verdict = Copy::Good;
                    }
                    match verdict {
                        Copy::Good => {
                            if local.store_fetched(b, &[want.0], &data).is_ok() {
                                self.stats().repaired += 1;
                            }
                            break;
                        }
                        Copy::Wrong if plane.nodes[j as usize].byzantine => self.stats().lies_caught += 1,
                        Copy::Wrong => self.violation(format!(
                            "correct node {j} served block {b} as version {} with other bytes (phase 2 of node {i})",
                            want.0
                        )),
                        Copy::Older | Copy::Newer => {}
                    }
                }
            }
        }
    }
}

/// The data a client writes: unique per write, never all zeros.
fn pattern(client: u64, counter: u64) -> Vec<u8> {
    let mut data = vec![0u8; BLOCK_SIZE as usize];
    data[..8].copy_from_slice(&client.to_le_bytes());
    data[8..16].copy_from_slice(&counter.to_le_bytes());
    for (k, byte) in data.iter_mut().enumerate().skip(16) {
        *byte = (counter as u8) ^ (k as u8) ^ 0xa5;
    }
    data
}

impl BlockWorkload {
    /// A write's reply arrived: its data must be on u + 1 correct nodes, and every
    /// correct node that acknowledged it and still has the disk it had then must hold it
    /// where it is up (logged, or stored at this version or a newer one).
    fn check_durable(&self, block: u64, write: (u32, u64, u64), hash: Hash, version: u64, acked: &[(u32, u64)]) {
        let (owner, epoch, seq) = write;
        let plane = self.plane();
        let correct: Vec<&(u32, u64)> = acked.iter().filter(|(i, _)| !plane.nodes[*i as usize].byzantine).collect();
        if correct.len() < self.u as usize + 1 {
            self.violation(format!(
                "write {owner}/{seq} of block {block} acknowledged with its data on {} correct nodes; u + 1 = {} needed",
                correct.len(),
                self.u + 1
            ));
        }
        for &&(i, wipes) in &correct {
            let slot = &plane.nodes[i as usize];
            let Some(local) = slot.local.as_ref().filter(|_| slot.wipes == wipes) else { continue };
            // A newer write or TRIM of the block executed here: this version's copy may
            // be gone (a reserve copy is dropped then), and need not be kept.
            let agreed =
                slot.meta.as_ref().map_or(0, |m| m.read().unwrap_or_else(PoisonError::into_inner).get(block).0);
            if agreed > version {
                continue;
            }
            let stored = local.read(block, 1).ok().is_some_and(|(data, held)| {
                held.first()
                    .is_some_and(|&h| h > version || (h == version && judge((version, hash), h, &data) == Copy::Good))
            });
            if !stored && !local.has_prepared(NodeId(owner), epoch, seq) {
                self.violation(format!(
                    "node {i} acknowledged the PrepareData of write {owner}/{seq} (block {block} version {version}) and holds neither it nor the block"
                ));
            }
        }
    }

    /// The end: after phase 2, each block's newest agreed data is held by a correct node
    /// that is up (stored, or logged where the node has not executed the write yet).
    fn audit(&self) {
        self.repair();
        self.audit_abandoned();
        self.audit_executed();
        let plane = self.plane();
        let g = plane.geometry;
        let zero = zero_hash(g.bs());
        for &b in &HOT {
            let newest = plane
                .nodes
                .iter()
                .filter(|s| !s.byzantine && s.local.is_some())
                .filter_map(|s| s.meta.as_ref().map(|m| m.read().unwrap_or_else(PoisonError::into_inner).get(b)))
                .max_by_key(|(v, _)| *v);
            let Some(want) = newest.filter(|(v, h)| *v > 0 && *h != zero) else { continue };
            let held = plane.nodes.iter().filter(|s| !s.byzantine).filter_map(|s| s.local.as_ref()).any(|local| {
                let stored = local
                    .read(b, 1)
                    .ok()
                    .is_some_and(|(data, held)| held.first().is_some_and(|&h| judge(want, h, &data) == Copy::Good));
                stored
                    || self
                        .writes
                        .get(&want.1)
                        .is_some_and(|&(owner, epoch, seq)| local.has_prepared(NodeId(owner), epoch, seq))
            });
            if !held {
                self.violation(format!("block {b} version {}: no correct node that is up holds its data", want.0));
            }
        }
    }
}

impl Workload for BlockWorkload {
    type Service = SimBlock;

    /// The metadata alone (a Byzantine node's stale answers are computed in one).
    fn service(&self) -> SimBlock {
        let inner = BlockService::new(self.geometry()).with_idle_ms(IDLE_MS);
        SimBlock { inner, node: None, plane: self.plane.clone() }
    }

    fn node_service(&self, start: NodeStart) -> SimBlock {
        let mut plane = self.plane();
        let g = plane.geometry;
        let base = plane.dir.clone();
        let dir = base.join(format!("n{}", start.node));
        let Some(slot) = plane.nodes.get_mut(start.node as usize) else {
            drop(plane);
            self.violation(format!("node {} is not one of the block nodes", start.node));
            return self.service();
        };
        if start.fresh {
            if slot.generation > 0 {
                slot.wipes += 1;
                self.stats().wiped_starts += 1;
            }
            let _ = std::fs::remove_dir_all(&dir);
        }
        // Member index = node id: the block simulation has no membership changes.
        match Local::open(&dir, g, NodeId(start.node), start.node, RESERVE, false) {
            Ok(local) => {
                let local = Arc::new(local);
                // The node's metadata in the store a node runs, a fresh one per start (the
                // previous start's may still be open, or held by a checkpoint): rebuilt by
                // the restore and replay. Outside the node's directory, so that a wipe never
                // removes files from under a store still open; all go when the run ends.
                let meta_dir = base.join(format!("meta-n{}-{}", start.node, slot.generation + 1));
                let meta = match Meta::on_disk(g, &meta_dir) {
                    Ok(meta) => Arc::new(RwLock::new(meta)),
                    Err(e) => {
                        drop(plane);
                        self.violation(format!("node {} cannot open its metadata store: {e}", start.node));
                        return self.service();
                    }
                };
                let inner = BlockService::with_local(meta.clone(), local.clone()).with_idle_ms(IDLE_MS);
                slot.generation += 1;
                slot.local = Some(local);
                slot.meta = Some(meta);
                slot.byzantine = start.byzantine;
                let node = Some((start.node, slot.generation));
                SimBlock { inner, node, plane: self.plane.clone() }
            }
            Err(e) => {
                drop(plane);
                self.violation(format!("node {} cannot open its store: {e}", start.node));
                self.service()
            }
        }
    }

    fn unobserved_op(&self) -> Option<Vec<u8>> {
        Some(Command::Zero { first: COLD, count: 1 }.encode())
    }

    fn next_op(&mut self, rng: &mut ChaCha8Rng, client: u64) -> Vec<u8> {
        let owner = OWNER_BASE + client as u32;
        if let Some(abandoned) = self.restart.remove(&client) {
            self.pending.insert(client, Pending::Restart { abandoned });
            return Command::NewEpoch { owner, after: None }.encode();
        }
        if let Some(after) = self.renew.remove(&client) {
            self.pending.insert(client, Pending::Renew { after });
            return Command::NewEpoch { owner, after: Some(after) }.encode();
        }
        if self.bug == Some(Bug::DropUnfenced) && rng.gen_bool(0.1) {
            self.drop_unfenced(client);
        }
        if rng.gen_bool(0.2) {
            self.deliver_late(rng);
        }
        let block = HOT[rng.gen_range(0..HOT.len())];
        let roll = rng.gen_range(0..10);
        if roll < 4 {
            self.counter += 1;
            let seq = self.seqs.entry(client).or_default();
            *seq += 1;
            let seq = *seq;
            let epoch = self.epochs.get(&client).copied().unwrap_or(0);
            let data = pattern(client, self.counter);
            let hash = *blake3::hash(&data).as_bytes();
            let prepare = Prepare { owner: NodeId(owner), epoch, seq, first: block, hashes: vec![hash], data };
            self.stats().writes += 1;
            match self.prepare(&prepare) {
                Ok(_) if self.rng().gen_ratio(1, RESTART_ONE_IN) => {
                    // The front end restarts before ordering the WriteData: it begins a
                    // new epoch (and numbers its writes from 1 in it).
                    let abandoned = (owner, epoch, seq);
                    self.abandoned.push(abandoned);
                    self.stats().restarts += 1;
                    self.renew.remove(&client);
                    self.pending.insert(client, Pending::Restart { abandoned });
                    return Command::NewEpoch { owner, after: None }.encode();
                }
                Ok(acked) => {
                    self.writes.insert(hash, (owner, epoch, seq));
                    self.pending.insert(client, Pending::Write { block, write: (owner, epoch, seq), hash, acked });
                    return Command::Write {
                        owner,
                        epoch,
                        seq,
                        first: block,
                        hashes: vec![hash],
                        expect: None,
                        data: None,
                    }
                    .encode();
                }
                // The nodes know the cluster ended this client's epoch: it renews first.
                Err(Unprepared::EpochEnded) => {
                    self.renew.insert(client, epoch);
                }
                Err(Unprepared::Short) => {}
            }
            // The front end answers the writer with an error; this client reads instead.
            self.stats().writes_refused += 1;
        } else if roll < 5 {
            self.pending.insert(client, Pending::Zero);
            return Command::Zero { first: block, count: 1 }.encode();
        }
        self.pending.insert(client, Pending::Read { block });
        Command::Meta { first: block, count: 1 }.encode()
    }

    fn read_mode(&mut self, _rng: &mut ChaCha8Rng, op: &[u8]) -> Option<ReadConsistency> {
        matches!(decode_command(op), Some(Command::Meta { .. })).then_some(ReadConsistency::Index)
    }

    fn observe(&mut self, client: u64, op: &[u8], result: &[u8]) {
        let g = self.geometry();
        let reply = Reply::decode(result).ok();
        let outcome = match (self.pending.remove(&client), reply) {
            (Some(Pending::Write { block, write, hash, acked }), Some(Reply::Written { version })) => {
                self.stats().writes_acked += 1;
                self.written.push((write, version));
                self.check_durable(block, write, hash, version, &acked);
                Outcome::Done
            }
            (Some(Pending::Write { .. }), Some(Reply::Fenced)) => {
                self.stats().writes_fenced += 1;
                self.renew.insert(client, self.epochs.get(&client).copied().unwrap_or(0));
                Outcome::Done
            }
            (Some(Pending::Renew { after }), Some(Reply::Epoch(epoch))) => {
                if epoch <= after {
                    self.violation(format!("client {client} renewed epoch {after} and was given {epoch}"));
                }
                self.stats().renewals += 1;
                self.new_epoch(client, epoch);
                Outcome::Done
            }
            (Some(Pending::Renew { after }), _) => {
                self.renew.insert(client, after);
                Outcome::Done
            }
            (Some(Pending::Restart { abandoned }), Some(Reply::Epoch(epoch))) => {
                if epoch <= abandoned.1 {
                    self.violation(format!(
                        "client {client} restarted in epoch {} and was given epoch {epoch}",
                        abandoned.1
                    ));
                }
                self.new_epoch(client, epoch);
                Outcome::Done
            }
            // No epoch yet: the restarted front end asks again (`begin` retries).
            (Some(Pending::Restart { abandoned }), _) => {
                self.restart.insert(client, abandoned);
                Outcome::Done
            }
            (Some(Pending::Zero), _) => {
                self.stats().zeros += 1;
                Outcome::Done
            }
            (Some(Pending::Read { block }), Some(Reply::Meta(meta))) if meta.len() == 1 => {
                self.stats().reads += 1;
                let want = meta[0];
                if want.1 == zero_hash(g.bs()) {
                    Outcome::Read(None)
                } else {
                    let home = (client % u64::from(g.nodes)) as u32;
                    let outcome = self.fetch(home, block, want);
                    if matches!(outcome, Outcome::Read(Some(_))) {
                        self.stats().reads_of_data += 1;
                    }
                    outcome
                }
            }
            (Some(Pending::Read { .. }), _) => Outcome::NotServed,
            _ => Outcome::Done,
        };
        self.answered.entry(client).or_default().push(Answered { op: op.to_vec(), result: result.to_vec(), outcome });
        self.repair();
        // At every step, not only at the end: a kept record would often be dropped later,
        // when its epoch ends, and hide.
        self.audit_executed();
    }

    fn check_history(&self, history: &[HistoryEntry]) -> Result<(), String> {
        self.audit();
        let violations = self.violations.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(first) = violations.first() {
            return Err(format!("{first} ({} violations in all)", violations.len()));
        }
        drop(violations);
        let mut next: BTreeMap<u64, usize> = BTreeMap::new();
        let mut ops = Vec::new();
        for h in history {
            let Some(command) = decode_command(&h.op) else { continue };
            let outcome = match &h.ret {
                None => None,
                Some((at, result)) => {
                    let k = next.entry(h.client).or_default();
                    let Some(seen) = self.answered.get(&h.client).and_then(|a| a.get(*k)) else {
                        // The faulty client's answers are not observed.
                        continue;
                    };
                    *k += 1;
                    if seen.op != h.op || &seen.result != result {
                        return Err(format!("client {}: the model's record is out of step with the history", h.client));
                    }
                    Some((*at, Reply::decode(result).ok(), seen.outcome.clone()))
                }
            };
            let (kv, ret) = match (command, outcome) {
                (Command::Write { first, hashes, .. }, None) if HOT.contains(&first) => {
                    (KvOp::Put { key: first.to_le_bytes().to_vec(), value: hashes[0].to_vec() }, None)
                }
                (Command::Write { first, hashes, .. }, Some((at, Some(Reply::Written { .. }), _))) => (
                    KvOp::Put { key: first.to_le_bytes().to_vec(), value: hashes[0].to_vec() },
                    Some((at, KvRet::Done)),
                ),
                (Command::Zero { first, .. }, None) if HOT.contains(&first) => {
                    (KvOp::Delete { key: first.to_le_bytes().to_vec() }, None)
                }
                (Command::Zero { first, .. }, Some((at, Some(Reply::Written { .. }), _))) if HOT.contains(&first) => {
                    (KvOp::Delete { key: first.to_le_bytes().to_vec() }, Some((at, KvRet::Done)))
                }
                (Command::Meta { first, .. }, Some((at, _, Outcome::Read(value)))) => (
                    KvOp::Get { key: first.to_le_bytes().to_vec() },
                    Some((at, KvRet::Value(value.map(|h| h.to_vec())))),
                ),
                // Refused writes, reads not served or never answered: nothing to judge.
                _ => continue,
            };
            ops.push(Operation { client: h.client, op: kv, invoke: h.invoke, ret });
        }
        self.stats().judged += ops.len() as u64;
        match check_kv(&ops, LINEARIZABILITY_BUDGET) {
            Verdict::Linearizable => Ok(()),
            Verdict::Violation { key, explanation } => Err(format!(
                "block {} has no linearization of the data its readers were served:\n{explanation}",
                u64::from_le_bytes(key.try_into().unwrap_or_default())
            )),
            Verdict::Unknown { key } => Err(format!(
                "linearizability search exceeded its budget on block {}",
                u64::from_le_bytes(key.try_into().unwrap_or_default())
            )),
        }
    }
}

fn decode_command(bytes: &[u8]) -> Option<Command> {
    Command::decode(bytes).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_core::ids::ClientId;
    use keel_core::ids::Seq;
    use keel_sim::FaultSet;

    fn workload() -> (BlockWorkload, Vec<SimBlock>) {
        let opts = SimOptions::new(1, 1, 0, FaultSet::parse("none").expect("fault set"));
        let w = BlockWorkload::new(&opts, None).expect("workload");
        let nodes = (0..3).map(|node| w.node_service(NodeStart { node, fresh: true, byzantine: false })).collect();
        (w, nodes)
    }

    fn violations(w: &BlockWorkload) -> Vec<String> {
        w.violations.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Front end `OWNER_BASE + 9`'s write 1 of epoch 0 to block `HOT[0]`: its
    /// PrepareData and its WriteData.
    fn one_write() -> (Prepare, Command) {
        let data = pattern(9, 1);
        let hash = *blake3::hash(&data).as_bytes();
        let (owner, first) = (OWNER_BASE + 9, HOT[0]);
        let write = Command::Write { owner, epoch: 0, seq: 1, first, hashes: vec![hash], expect: None, data: None };
        (Prepare { owner: NodeId(owner), epoch: 0, seq: 1, first, hashes: vec![hash], data }, write)
    }

    /// Nodes 1 and 2 take `prepare`.
    fn prepare_on_1_and_2(w: &BlockWorkload, prepare: &Prepare) {
        for i in [1, 2] {
            let local = w.plane().up(i).cloned().expect("up");
            w.runtime.block_on(local.prepare(prepare.clone())).expect("prepared");
        }
    }

    /// Node `i`'s metadata executes `command` beside a scratch store, not its own: a
    /// node whose store never hears of what its agreed state did.
    fn execute_blind(w: &BlockWorkload, i: u32, command: &[u8], ctx: &ExecCtx) -> Option<Reply> {
        let meta = w.plane().nodes[i as usize].meta.clone().expect("meta");
        let scratch = tempfile::tempdir().expect("tempdir");
        let other = Local::open(scratch.path(), w.geometry(), NodeId(i), i, RESERVE, false).expect("opens");
        Reply::decode(&BlockService::with_local(meta, Arc::new(other)).execute(command, ctx)).ok()
    }

    #[test]
    fn the_end_audit_finds_an_abandoned_writes_prepare_data_kept_past_its_epoch() {
        let (prepare, _) = one_write();
        let owner = prepare.owner;
        let new_epoch = Command::NewEpoch { owner: owner.0, after: None }.encode();
        let ctx = ExecCtx::new(Seq(1), 1_000, 7, ClientId(1));
        // `keep`: node 1 took the PrepareData but not the epoch's end (a node that kept
        // what it should have dropped); its agreed state ended the epoch all the same.
        for keep in [false, true] {
            let (mut w, mut nodes) = workload();
            prepare_on_1_and_2(&w, &prepare);
            w.abandoned.push((owner.0, 0, 1));
            for (i, n) in nodes.iter_mut().enumerate() {
                let reply = if keep && i == 1 {
                    execute_blind(&w, 1, &new_epoch, &ctx)
                } else {
                    Reply::decode(&n.execute(&new_epoch, &ctx)).ok()
                };
                assert_eq!(reply, Some(Reply::Epoch(1)));
            }
            w.audit_abandoned();
            let v = violations(&w);
            if keep {
                assert!(v.iter().any(|v| v.starts_with("node 1 holds the PrepareData")), "{v:?}");
            } else {
                assert_eq!(v, Vec::<String>::new());
            }
        }
    }

    #[test]
    fn the_end_audit_finds_prepare_data_kept_after_its_write_executed() {
        let (prepare, write) = one_write();
        let (write, owner) = (write.encode(), prepare.owner);
        let ctx = ExecCtx::new(Seq(1), 1_000, 7, ClientId(1));
        // `keep`: node 2's metadata executes the write beside a scratch store, so its own
        // store keeps the PrepareData (a node that did not consume what it executed).
        for keep in [false, true] {
            let (mut w, mut nodes) = workload();
            prepare_on_1_and_2(&w, &prepare);
            for (i, n) in nodes.iter_mut().enumerate() {
                let reply = if keep && i == 2 {
                    execute_blind(&w, 2, &write, &ctx)
                } else {
                    Reply::decode(&n.execute(&write, &ctx)).ok()
                };
                assert_eq!(reply, Some(Reply::Written { version: 1 }));
            }
            w.written.push(((owner.0, 0, 1), 1));
            // A late copy of it is refused by a node that executed the write.
            let local = w.plane().up(0).cloned().expect("up");
            assert_eq!(w.runtime.block_on(local.prepare(prepare.clone())), Err(Refused::Executed));
            w.audit_executed();
            let v = violations(&w);
            if keep {
                assert_eq!(v.len(), 1, "{v:?}");
                assert!(v[0].starts_with("node 2 holds the PrepareData"), "{v:?}");
            } else {
                assert_eq!(v, Vec::<String>::new());
            }
        }
    }

    #[test]
    fn the_end_audit_finds_ordered_data_that_no_correct_node_holds() {
        let (prepare, write) = one_write();
        let ctx = ExecCtx::new(Seq(1), 1_000, 7, ClientId(1));

        // Its PrepareData reached no node: ordered, INCOMPLETE everywhere.
        let (w, mut nodes) = workload();
        for n in &mut nodes {
            assert_eq!(Reply::decode(&n.execute(&write.encode(), &ctx)).ok(), Some(Reply::Written { version: 1 }));
        }
        w.audit();
        let v = violations(&w);
        assert!(v.iter().any(|v| v.contains("no correct node that is up holds its data")), "{v:?}");

        // Logged on two nodes before it was ordered: held (and node 0, INCOMPLETE,
        // fetches it in phase 2) — unless both crashed before phase 2 ran.
        for crash in [false, true] {
            let (w, mut nodes) = workload();
            prepare_on_1_and_2(&w, &prepare);
            for n in &mut nodes {
                n.execute(&write.encode(), &ctx);
            }
            if crash {
                nodes.truncate(1);
            }
            w.audit();
            let v = violations(&w);
            if crash {
                assert!(v.iter().any(|v| v.contains("no correct node that is up holds its data")), "{v:?}");
            } else {
                assert_eq!(v, Vec::<String>::new());
                assert_eq!(w.stats().repaired, 1, "node 0 fetched the block it is preferred for");
            }
        }
    }
}
