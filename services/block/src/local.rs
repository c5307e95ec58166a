//! One node's unreplicated side of the block store: its data (`store.rs`), the
//! PrepareData it holds for writes not yet ordered (Gnothi §3.1's PrepareData buffer,
//! logged in `prepare_log.rs`), and the accounting of reserve storage.
//!
//! The agreed metadata (`meta.rs`) calls in here when a write executes: the node stores
//! the data if it has it (COMPLETE) and leaves the block INCOMPLETE otherwise.

use crate::executed::{self, Executed};
use crate::geometry::{runs, Geometry};
use crate::meta::{Hash, Meta, REGION_BLOCKS};
use crate::meta_store::Region;
use crate::prepare_log::{PrepareLog, RecordAt};
use crate::store::Store;
use keel::NodeId;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex, PoisonError, RwLock};

/// PrepareData one front end may have buffered on a node (Gnothi bounds each client's
/// outstanding PrepareData): more is refused until its writes are ordered.
pub const PREPARED_BYTES_PER_OWNER: usize = 256 << 20;

/// Blocks of the shortest released run [`Local::reclaim_stripe`] punches while its stripe
/// still holds reserve copies (256 KiB at 4 KiB): a punch is a journal transaction under
/// the store lock that writes wait for, and a few KiB are not worth one.
pub const RECLAIM_RUN_MIN: u64 = 64;

/// PrepareData as it travels and is logged: the data of blocks `first..` for the write
/// `(owner, epoch, seq)` of front end `owner`, with the hash of each block.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Prepare {
    pub owner: NodeId,
    pub epoch: u64,
    pub seq: u64,
    pub first: u64,
    pub hashes: Vec<Hash>,
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
}

/// A write as it executed and changed the blocks (see `Local::executed_write`).
pub struct Applied<'a> {
    pub first: u64,
    pub hashes: &'a [Hash],
    /// The data, in full mode (G'): it came through agreement.
    pub data: Option<Vec<u8>>,
    pub version: u64,
}

/// What a node answers to a PrepareData of an epoch the cluster ended: the front end
/// (which sees only the text from other nodes) renews its epoch and retries.
pub const OLD_EPOCH: &str = "a PrepareData of an epoch that ended";

/// Why a node did not take a PrepareData.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    #[error("malformed PrepareData: {0}")]
    Malformed(String),
    #[error("front end {0} has {PREPARED_BYTES_PER_OWNER} bytes of PrepareData waiting here already")]
    Busy(NodeId),
    #[error("the reserve storage is full ({0} blocks)")]
    ReserveFull(u64),
    #[error("{OLD_EPOCH}")]
    OldEpoch,
    /// Its write executed here already (it arrived late, or was sent again).
    #[error("a PrepareData of a write that executed already")]
    Executed,
    #[error("the PrepareData log failed: {0}")]
    Log(String),
}

struct Held {
    /// The PrepareData; without its data if `at` says where to read it.
    prepare: Prepare,
    /// The log segment it is recorded in.
    segment: u64,
    /// Its data's length (what it counts against its owner's allowance).
    bytes: usize,
    /// Where its record lies, for one read back at open: its data stays on disk until
    /// used (a node restarted after a burst of large writes found 818 MB logged, most of
    /// it for writes executed before its checkpoint, looked at once and let go).
    at: Option<RecordAt>,
}

impl Held {
    fn new(prepare: Prepare, segment: u64) -> Held {
        Held { bytes: prepare.data.len(), prepare, segment, at: None }
    }

    /// Its data: in memory, or read again from its record (checked to be the same
    /// PrepareData).
    fn data(&self) -> io::Result<std::borrow::Cow<'_, [u8]>> {
        let Some(at) = &self.at else { return Ok(std::borrow::Cow::Borrowed(&self.prepare.data)) };
        let read = postcard::from_bytes::<Prepare>(&at.read()?)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
        let p = &self.prepare;
        if (read.owner, read.epoch, read.seq, read.first) != (p.owner, p.epoch, p.seq, p.first)
            || read.hashes != p.hashes
            || read.data.len() != self.bytes
        {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "a PrepareData record read again differs"));
        }
        Ok(std::borrow::Cow::Owned(read.data))
    }

    /// Its data, taken (no copy of data held in memory).
    fn into_data(self) -> io::Result<Vec<u8>> {
        if self.at.is_none() {
            return Ok(self.prepare.data);
        }
        self.data().map(std::borrow::Cow::into_owned)
    }
}

#[derive(Default)]
struct Prepares {
    waiting: HashMap<(NodeId, u64, u64), Held>,
    bytes: HashMap<NodeId, usize>,
    /// Each front end's current epoch.
    epochs: HashMap<NodeId, u64>,
    /// Which writes of each front end's current epoch executed here: the agreed
    /// metadata's record (`Meta::executed`), kept here too so that a PrepareData can be
    /// checked without the metadata's lock (execution holds it while it calls in here).
    /// By the owner's stable id, as the replicated metadata keeps them.
    executed: BTreeMap<u32, Executed>,
    /// Records still needed per log segment (waiting, or consumed but not yet covered by
    /// a synced data file).
    live: BTreeMap<u64, usize>,
    /// Consumed records: (generation consumed in, segment).
    consumed: Vec<(u64, u64)>,
}

impl Prepares {
    fn release(&mut self, segment: u64) {
        if let Some(n) = self.live.get_mut(&segment) {
            *n = n.saturating_sub(1);
        }
    }

    /// Gives back `len` bytes of `owner`'s PrepareData allowance.
    fn give_back(&mut self, owner: NodeId, len: usize) {
        if let Some(b) = self.bytes.get_mut(&owner) {
            *b = b.saturating_sub(len);
        }
    }

    /// Gives back what a PrepareData of `len` bytes logged in `segment` held: its
    /// owner's bytes and its segment's count.
    fn unpin(&mut self, owner: NodeId, len: usize, segment: u64) {
        self.give_back(owner, len);
        self.release(segment);
    }

    /// Whether the cluster ended `owner`'s `epoch` (as far as this node executed).
    fn ended(&self, owner: NodeId, epoch: u64) -> bool {
        epoch < self.epochs.get(&owner).copied().unwrap_or(0)
    }

    /// Whether `owner`'s write `seq` of `epoch` executed here.
    fn executed(&self, owner: NodeId, epoch: u64, seq: u64) -> bool {
        self.executed.get(&owner.0).is_some_and(|e| e.contains(epoch, seq))
    }

    /// Why a PrepareData of `owner`'s write `(epoch, seq)` can never be used here, if so.
    fn useless(&self, owner: NodeId, epoch: u64, seq: u64) -> Option<Refused> {
        if self.ended(owner, epoch) {
            Some(Refused::OldEpoch)
        } else if self.executed(owner, epoch, seq) {
            Some(Refused::Executed)
        } else {
            None
        }
    }

    /// Takes a waiting PrepareData out, giving back its owner's bytes; its record stays
    /// counted in its segment.
    fn remove(&mut self, key: &(NodeId, u64, u64)) -> Option<Held> {
        let held = self.waiting.remove(key)?;
        self.give_back(key.0, held.bytes);
        Some(held)
    }

    /// Takes out a PrepareData whose write executed (in generation `generation`): its
    /// record stays logged until a checkpoint the node may restart from covers the
    /// write, since replaying the write may need it again.
    fn consume(&mut self, key: &(NodeId, u64, u64), generation: u64) -> Option<Held> {
        let held = self.remove(key)?;
        self.consumed.push((generation, held.segment));
        Some(held)
    }

    /// Drops front end `owner`'s PrepareData of epochs that ended: the agreed metadata
    /// refuses their WriteData from then on, so they can never be used. Nothing else is
    /// dropped — not even a PrepareData whose front end gave up on the write, since its
    /// WriteData may still be ordered later (the front end fences it with a new epoch).
    fn collect(&mut self, owner: NodeId) {
        let dead: Vec<_> = self.waiting.keys().filter(|(o, e, _)| *o == owner && self.ended(*o, *e)).copied().collect();
        for key in dead {
            if let Some(held) = self.remove(&key) {
                self.release(held.segment);
            }
        }
    }
}

/// Counters `keel status` and the metrics show.
#[derive(Default)]
pub struct Stats {
    pub prepares: AtomicU64,
    /// PrepareData passed on down a chain.
    pub prepares_forwarded: AtomicU64,
    pub prepares_refused: AtomicU64,
    pub writes_complete: AtomicU64,
    pub writes_incomplete: AtomicU64,
    pub store_errors: AtomicU64,
    /// Front ends' epochs the cluster ended because they ordered nothing for a while
    /// (`meta::EPOCH_IDLE_MS`): their PrepareData here was dropped.
    pub epochs_ended_idle: AtomicU64,
    /// Blocks stored from PrepareData after a restore (writes this node skipped
    /// executing: it took a later state instead).
    pub restored_from_prepared: AtomicU64,
}

pub struct Local {
    geometry: Geometry,
    /// This node's stable id and its index among the members (slices are by index).
    node: NodeId,
    index: u32,
    /// What a data sync needs, shared with the thread that runs syncs in the background.
    store: Arc<Store>,
    log: Arc<PrepareLog>,
    prepares: Arc<Mutex<Prepares>>,
    /// Checkpoints begun (freezes); the log segment new records go to.
    generation: Arc<AtomicU64>,
    /// 1 + the highest generation in which a write stored data no PrepareData record
    /// holds (full mode's data through agreement); 0: none. See `checkpoint`.
    unlogged: AtomicU64,
    /// Every such write of a generation below this is synced (by a checkpoint's sync
    /// before its metadata was written).
    unlogged_synced: AtomicU64,
    /// Runs data syncs off the protocol path when a checkpoint allows it (None: inline).
    syncer: Option<Syncer>,
    /// Blocks held outside their preferred set, and the most allowed.
    reserved: AtomicU64,
    reserve_max: u64,
    /// Bumped whenever reserve blocks are released, so reclaim looks again.
    released: AtomicU64,
    /// Per region, the version of the last write that left a block preferred here
    /// without its data (or failed to store it), or of the last restore: the only ways a
    /// preferred block becomes INCOMPLETE. Recovery phase 2 looks again at a region only
    /// when its gap moved, not at every write into it: a write whose data is stored here
    /// leaves nothing to repair, and reading a region's metadata is a scan of the
    /// metadata store.
    gaps: Vec<AtomicU64>,
    /// Store writes exclude reads, so a block's data and held version are read as one
    /// (a peer that sent a version with another version's bytes would look like a liar).
    io: RwLock<()>,
    pub stats: Arc<Stats>,
}

/// The thread that syncs the data files for checkpoints that need not wait for it.
struct Syncer {
    jobs: Option<std_mpsc::Sender<u64>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Local {
    /// Finishes the syncs queued (and the log releases after them) before the files can be
    /// opened again: a node restarted in the same process finds what a synchronous
    /// checkpoint would have left.
    fn drop(&mut self) {
        if let Some(mut syncer) = self.syncer.take() {
            drop(syncer.jobs.take());
            if let Some(thread) = syncer.thread.take() {
                let _ = thread.join();
            }
        }
    }
}

/// A data sync and what it lets go of: the parts of [`Local`] a sync touches, which the
/// syncer thread holds too.
#[derive(Clone)]
struct DataSync {
    store: Arc<Store>,
    log: Arc<PrepareLog>,
    prepares: Arc<Mutex<Prepares>>,
    generation: Arc<AtomicU64>,
    stats: Arc<Stats>,
}

impl DataSync {
    /// Syncs the data files (they hold every write executed before checkpoint
    /// `generation`'s freeze), then lets go of the logged PrepareData consumed two
    /// generations before, whose writes a checkpoint the node may restart from covers.
    /// Returns whether the sync succeeded.
    fn run(&self, generation: u64) -> bool {
        if let Err(e) = self.store.sync() {
            self.stats.store_errors.fetch_add(1, Ordering::Relaxed);
            tracing::error!(error = %e, "syncing the block data failed; PrepareData stays logged");
            return false;
        }
        let current = self.generation.load(Ordering::Acquire);
        let mut p = self.prepares.lock().unwrap_or_else(PoisonError::into_inner);
        let (done, keep): (Vec<_>, Vec<_>) = p.consumed.iter().partition(|(g, _)| *g + 2 <= generation);
        p.consumed = keep;
        for (_, segment) in done {
            p.release(segment);
        }
        let dead: Vec<u64> = p.live.iter().filter(|(s, n)| **n == 0 && **s < current).map(|(s, _)| *s).collect();
        for s in dead {
            p.live.remove(&s);
            self.log.delete(s);
        }
        true
    }
}

impl Local {
    /// Opens node `node`'s (member index `index`) data under `dir`, with the PrepareData
    /// its log still holds. `reserve` is the fraction of the export a node may hold
    /// outside its preferred slices; `sync` whether the log fsyncs (fsync = never: no).
    ///
    /// # Errors
    /// The files cannot be opened.
    pub fn open(
        dir: &Path,
        geometry: Geometry,
        node: NodeId,
        index: u32,
        reserve: f64,
        sync: bool,
    ) -> io::Result<Local> {
        let store = Arc::new(Store::open(dir, geometry.blocks, geometry.block_size)?);
        let mut prepares = Prepares::default();
        let (log, opened) = PrepareLog::open(&dir.join("prepare"), sync, |segment, record, at| {
            let Ok(prepare) = postcard::from_bytes::<Prepare>(record) else { return };
            let mut held = Held::new(prepare, segment);
            if at.is_some() {
                held.prepare.data = Vec::new();
                held.at = at;
            }
            *prepares.live.entry(segment).or_default() += 1;
            *prepares.bytes.entry(held.prepare.owner).or_default() += held.bytes;
            let p = &held.prepare;
            let (owner, key) = (p.owner, (p.owner, p.epoch, p.seq));
            if let Some(old) = prepares.waiting.insert(key, held) {
                // Logged twice (a retry): one copy counts, or its segment would never go.
                prepares.unpin(owner, old.bytes, old.segment);
            }
        })?;
        // New records go to a segment numbered above every one the log's files had.
        let generation = opened.next_segment.max(1);
        let reserved = (0..geometry.blocks).filter(|&b| !geometry.is_preferred(b, index) && store.held(b) != 0).count();
        let reserve_max = (geometry.blocks as f64 * reserve.clamp(0.0, 1.0)) as u64;
        Ok(Local {
            geometry,
            node,
            index,
            store,
            log: Arc::new(log),
            prepares: Arc::new(Mutex::new(prepares)),
            generation: Arc::new(AtomicU64::new(generation)),
            unlogged: AtomicU64::new(0),
            unlogged_synced: AtomicU64::new(0),
            syncer: None,
            reserved: AtomicU64::new(reserved as u64),
            reserve_max,
            released: AtomicU64::new(0),
            gaps: (0..geometry.blocks.div_ceil(REGION_BLOCKS as u64)).map(|_| AtomicU64::new(0)).collect(),
            io: RwLock::new(()),
            stats: Arc::default(),
        })
    }

    /// Runs the data syncs of checkpoints on a thread of their own where that is safe
    /// (see `checkpoint`), so that a checkpoint does not stall execution for the flush of
    /// every block written since the last one (12-36 ms measured here, session 35).
    ///
    /// # Errors
    /// The thread cannot be started.
    pub fn sync_in_background(mut self) -> io::Result<Local> {
        let sync = self.sync_parts();
        let (jobs, rx) = std_mpsc::channel::<u64>();
        let thread = std::thread::Builder::new().name("block-sync".into()).spawn(move || {
            while let Ok(mut generation) = rx.recv() {
                // Syncs queued behind one another: the last covers them all.
                while let Ok(later) = rx.try_recv() {
                    generation = later;
                }
                sync.run(generation);
            }
        })?;
        self.syncer = Some(Syncer { jobs: Some(jobs), thread: Some(thread) });
        Ok(self)
    }

    fn sync_parts(&self) -> DataSync {
        DataSync {
            store: self.store.clone(),
            log: self.log.clone(),
            prepares: self.prepares.clone(),
            generation: self.generation.clone(),
            stats: self.stats.clone(),
        }
    }

    pub fn node(&self) -> NodeId {
        self.node
    }

    pub fn index(&self) -> u32 {
        self.index
    }

    pub fn geometry(&self) -> Geometry {
        self.geometry
    }

    pub fn store(&self) -> &Store {
        &self.store
    }

    /// Blocks held outside their preferred set now, and the most allowed.
    pub fn reserve(&self) -> (u64, u64) {
        (self.reserved.load(Ordering::Relaxed), self.reserve_max)
    }

    /// PrepareData bytes waiting for their WriteData.
    pub fn prepared_bytes(&self) -> usize {
        self.lock().bytes.values().sum()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Prepares> {
        self.prepares.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The data of `count` blocks from `first` and the version held of each.
    ///
    /// # Errors
    /// An I/O error.
    pub fn read(&self, first: u64, count: u64) -> io::Result<(Vec<u8>, Vec<u64>)> {
        let _shared = self.io.read().unwrap_or_else(PoisonError::into_inner);
        self.store.read(first, count)
    }

    /// Takes a PrepareData (from this node's front end or a peer's, `owner` being the
    /// sender the transport authenticated): checks it, logs it durably, buffers it.
    /// Resolves once the node may acknowledge it.
    ///
    /// # Errors
    /// What [`Refused`] lists; nothing is kept then.
    pub async fn prepare(&self, prepare: Prepare) -> Result<(), Refused> {
        self.prepare_many(vec![prepare]).await.pop().unwrap_or_else(|| Err(Refused::Log("no answer".into())))
    }

    /// [`Local::prepare`] for several PrepareData at once, with one append to the log
    /// (one hand-off to its writer and one wake-up back, whatever their number). The
    /// answers are in the order of `prepares`; each is what `prepare` would have said.
    pub async fn prepare_many(&self, prepares: Vec<Prepare>) -> Vec<Result<(), Refused>> {
        let mut answers: Vec<Result<(), Refused>> = Vec::with_capacity(prepares.len());
        let mut checked = Vec::with_capacity(prepares.len());
        for (i, prepare) in prepares.into_iter().enumerate() {
            match self.check(&prepare) {
                Ok(()) => {
                    answers.push(Ok(()));
                    checked.push((i, prepare));
                }
                Err(why) => answers.push(Err(self.refuse(why))),
            }
        }
        if checked.is_empty() {
            return answers;
        }
        let mut logging = Vec::with_capacity(checked.len());
        let segment;
        {
            let mut p = self.lock();
            // One generation for the whole batch: the records go to one segment.
            segment = self.generation.load(Ordering::Acquire);
            for (i, prepare) in checked {
                if let Some(why) = p.useless(prepare.owner, prepare.epoch, prepare.seq) {
                    answers[i] = Err(self.refuse(why));
                    continue;
                }
                let bytes = p.bytes.get(&prepare.owner).copied().unwrap_or(0);
                if bytes + prepare.data.len() > PREPARED_BYTES_PER_OWNER {
                    answers[i] = Err(self.refuse(Refused::Busy(prepare.owner)));
                    continue;
                }
                *p.bytes.entry(prepare.owner).or_default() += prepare.data.len();
                *p.live.entry(segment).or_default() += 1;
                logging.push((i, prepare));
            }
        }
        if logging.is_empty() {
            return answers;
        }
        let records = logging.iter().map(|(_, prepare)| postcard::to_allocvec(prepare).unwrap_or_default()).collect();
        if let Err(e) = self.log.append(segment, records).await {
            let mut p = self.lock();
            for (i, prepare) in logging {
                p.unpin(prepare.owner, prepare.data.len(), segment);
                answers[i] = Err(self.refuse(Refused::Log(e.to_string())));
            }
            return answers;
        }
        let mut p = self.lock();
        for (i, prepare) in logging {
            // The epoch may have ended, or the write executed, while the record was being
            // logged: `collect` or `executed_write` ran before it was here to drop, and
            // nothing would drop it later (an absent front end's epoch ends once), so it
            // is refused now as it would have been before.
            if let Some(why) = p.useless(prepare.owner, prepare.epoch, prepare.seq) {
                p.unpin(prepare.owner, prepare.data.len(), segment);
                answers[i] = Err(self.refuse(why));
                continue;
            }
            let key = (prepare.owner, prepare.epoch, prepare.seq);
            if let Some(old) = p.waiting.insert(key, Held::new(prepare, segment)) {
                // The same write prepared twice (a retry): one copy counts.
                p.unpin(key.0, old.bytes, old.segment);
            }
            self.stats.prepares.fetch_add(1, Ordering::Relaxed);
        }
        answers
    }

    /// What can be told of a PrepareData without this node's state: its range, its
    /// size, its hashes, and room in the reserve for its blocks outside this node's
    /// preferred slices.
    fn check(&self, prepare: &Prepare) -> Result<(), Refused> {
        let count = prepare.hashes.len() as u64;
        let bs = self.geometry.bs();
        if count == 0 || prepare.first.checked_add(count).is_none_or(|end| end > self.geometry.blocks) {
            return Err(Refused::Malformed(format!("blocks {}+{count} out of range", prepare.first)));
        }
        if prepare.data.len() != count as usize * bs {
            return Err(Refused::Malformed(format!("{} bytes for {count} blocks", prepare.data.len())));
        }
        // The hashes are what the WriteData will name: data that does not match them
        // could never be used, so it is refused here rather than stored.
        if prepare.data.chunks_exact(bs).zip(&prepare.hashes).any(|(d, h)| blake3::hash(d).as_bytes() != h) {
            return Err(Refused::Malformed("data does not match its hashes".into()));
        }
        let outside = (prepare.first..prepare.first + count)
            .filter(|&b| !self.geometry.is_preferred(b, self.index))
            .count() as u64;
        if outside > 0 && self.reserved.load(Ordering::Relaxed) + outside > self.reserve_max {
            return Err(Refused::ReserveFull(self.reserve_max));
        }
        Ok(())
    }

    fn refuse(&self, why: Refused) -> Refused {
        self.stats.prepares_refused.fetch_add(1, Ordering::Relaxed);
        why
    }

    /// Whether this node holds the PrepareData of `(owner, epoch, seq)` (a retry of the
    /// write may ask).
    pub fn has_prepared(&self, owner: NodeId, epoch: u64, seq: u64) -> bool {
        self.lock().waiting.contains_key(&(owner, epoch, seq))
    }

    /// Write `(owner, epoch, seq)` executed (Gnothi §3.2 step 5). Its PrepareData here,
    /// if any, is consumed, and one arriving later is refused. If it changed the blocks
    /// (`applied`), store the data if this node has it, in the command (full mode) or as
    /// PrepareData; otherwise the blocks stay INCOMPLETE here.
    pub fn executed_write(&self, owner: NodeId, epoch: u64, seq: u64, applied: Option<Applied<'_>>) {
        let taken = {
            let mut p = self.lock();
            executed::record(&mut p.executed, owner.0, epoch, seq);
            p.consume(&(owner, epoch, seq), self.generation.load(Ordering::Acquire))
        };
        let Some(Applied { first, hashes, data, version }) = applied else { return };
        if data.is_some() {
            let generation = self.generation.load(Ordering::Acquire);
            self.unlogged.fetch_max(generation + 1, Ordering::AcqRel);
        }
        let data = data.or_else(|| {
            let h = taken.filter(|h| h.prepare.first == first && h.prepare.hashes == hashes)?;
            match h.into_data() {
                Ok(d) => Some(d),
                Err(e) => {
                    // Left INCOMPLETE here: phase 2 fetches the blocks from a holder.
                    self.stats.store_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::error!(first, error = %e, "reading a logged PrepareData back failed");
                    None
                }
            }
        });
        let count = hashes.len() as u64;
        match data {
            Some(d) => match self.write_exclusive(first, &d, version) {
                Ok(()) => {
                    self.stats.writes_complete.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => {
                    self.stats.store_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::error!(first, count, error = %e, "block data write failed: the blocks stay INCOMPLETE here");
                    self.gap(first, count, version);
                }
            },
            None => {
                self.stats.writes_incomplete.fetch_add(1, Ordering::Relaxed);
                self.gap(first, count, version);
                // Reserve copies of the blocks are stale now: free them.
                self.drop_reserve(first, count);
            }
        }
    }

    /// Blocks `first..first + count` were left at `version` without their data here:
    /// moves the gap of each region where one of them is preferred here.
    fn gap(&self, first: u64, count: u64, version: u64) {
        let end = first + count;
        let mut b = first;
        while b < end {
            let stop = self.geometry.stripe_end(b, end);
            if self.geometry.is_preferred(b, self.index) {
                let last = (stop - 1) / REGION_BLOCKS as u64;
                for region in b / REGION_BLOCKS as u64..=last {
                    if let Some(g) = self.gaps.get(region as usize) {
                        g.fetch_max(version, Ordering::AcqRel);
                    }
                }
            }
            b = stop;
        }
    }

    /// Region `region`'s gap (see `gaps`): phase 2 finds it complete again only by a
    /// look at its blocks after the gap last moved.
    pub fn gap_of(&self, region: usize) -> u64 {
        self.gaps.get(region).map_or(0, |g| g.load(Ordering::Acquire))
    }

    /// TRIM or WRITE_ZEROES executed: every node holds zeros without any data moving.
    /// Blocks outside this node's preferred set hold nothing afterwards (held 0: zeros
    /// are never fetched, so no copy is needed), which keeps the reserve count exact.
    pub fn executed_zero(&self, first: u64, count: u64, version: u64) {
        let _exclusive = self.io.write().unwrap_or_else(PoisonError::into_inner);
        let end = first + count;
        let mut b = first;
        while b < end {
            // A stripe is preferred here or not as a whole.
            let stop = self.geometry.stripe_end(b, end);
            let result = if self.geometry.is_preferred(b, self.index) {
                self.store.zero(b, stop - b, version)
            } else {
                let had = (b..stop).filter(|&x| self.store.held(x) != 0).count() as u64;
                self.unreserve(had);
                self.store.drop_blocks(b, stop - b)
            };
            if let Err(e) = result {
                self.stats.store_errors.fetch_add(1, Ordering::Relaxed);
                tracing::error!(first = b, count = stop - b, error = %e, "block zeroing failed");
            }
            b = stop;
        }
    }

    fn unreserve(&self, blocks: u64) {
        let _ = self.reserved.fetch_update(Ordering::AcqRel, Ordering::Acquire, |r| Some(r.saturating_sub(blocks)));
    }

    /// Stores a block this node re-replicated (recovery phase 2) or fetched, checked
    /// against the agreed hash by the caller.
    ///
    /// # Errors
    /// An I/O error.
    /// Blocks that a newer write reached meanwhile are left alone.
    pub fn store_fetched(&self, first: u64, versions: &[u64], data: &[u8]) -> io::Result<()> {
        let bs = self.geometry.bs();
        let count = versions.len().min(data.len() / bs);
        let older = |k: usize| self.store.held(first + k as u64) < versions[k];
        let _exclusive = self.io.write().unwrap_or_else(PoisonError::into_inner);
        // Each run of blocks held older than fetched goes in one write of its data and
        // one of its versions: phase 2 stores hundreds of blocks per fetch, and a write
        // per block held the lock (and a runtime worker) for milliseconds.
        let mut k = 0;
        while k < count {
            if !older(k) {
                k += 1;
                continue;
            }
            let start = k;
            while k < count && older(k) {
                k += 1;
            }
            let fresh = self.fresh_reserve(first + start as u64, (k - start) as u64);
            self.store.write_each(first + start as u64, &data[start * bs..k * bs], &versions[start..k])?;
            self.reserved.fetch_add(fresh, Ordering::Relaxed);
        }
        Ok(())
    }

    fn write_exclusive(&self, first: u64, data: &[u8], version: u64) -> io::Result<()> {
        let _exclusive = self.io.write().unwrap_or_else(PoisonError::into_inner);
        self.write_counted(first, data, version)
    }

    /// Writes blocks and counts those that now take reserve storage.
    fn write_counted(&self, first: u64, data: &[u8], version: u64) -> io::Result<()> {
        let count = data.len() as u64 / u64::from(self.geometry.block_size);
        let fresh = self.fresh_reserve(first, count);
        self.store.write(first, data, version)?;
        self.reserved.fetch_add(fresh, Ordering::Relaxed);
        Ok(())
    }

    /// How many of these blocks a write would newly hold outside their preferred set.
    fn fresh_reserve(&self, first: u64, count: u64) -> u64 {
        (first..first + count)
            .filter(|&b| !self.geometry.is_preferred(b, self.index) && self.store.held(b) == 0)
            .count() as u64
    }

    /// Frees reserve copies of `first..first + count` (held outside their preferred set),
    /// whatever their version.
    pub fn drop_reserve(&self, first: u64, count: u64) {
        let _exclusive = self.io.write().unwrap_or_else(PoisonError::into_inner);
        self.drop_runs(first, count, |b| self.store.held(b) != 0);
    }

    /// Frees the reserve copy of block `first + k` if it is still held at `versions[k]`
    /// (0: keep it), and returns how many went. A copy of a newer version, stored since
    /// the caller saw the preferred nodes hold this one, stays: it may be one of that
    /// version's u + r + 1 copies.
    pub fn collect_reserve(&self, first: u64, versions: &[u64]) -> u64 {
        let _exclusive = self.io.write().unwrap_or_else(PoisonError::into_inner);
        self.drop_runs(first, versions.len() as u64, |b| {
            let v = versions[(b - first) as usize];
            v != 0 && self.store.held(b) == v
        })
    }

    /// Releases the blocks outside the preferred set that `drop` picks (held version
    /// 0), and returns how many went. Their bytes stay until [`Local::reclaim_stripe`]
    /// punches out their stripe or a long run of them: a punch is a journal transaction
    /// taken under the store lock (about 3 ms for a stripe here), and one per block
    /// took a front end's writes to half their rate while a node recovered (session
    /// 45). The caller holds `io` exclusively.
    fn drop_runs(&self, first: u64, count: u64, drop: impl Fn(u64) -> bool) -> u64 {
        let outside = |b: u64| !self.geometry.is_preferred(b, self.index);
        let (end, mut b, mut dropped) = (first + count, first, 0);
        while b < end {
            if !(outside(b) && drop(b)) {
                b += 1;
                continue;
            }
            let start = b;
            while b < end && outside(b) && drop(b) {
                b += 1;
            }
            // The held versions are 0 from here even if the file says otherwise (they
            // change in memory first): the blocks no longer count as reserve.
            if let Err(e) = self.store.release(start, b - start) {
                self.stats.store_errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(first = start, count = b - start, error = %e, "freeing reserve copies failed");
            }
            self.unreserve(b - start);
            dropped += b - start;
        }
        if dropped > 0 {
            self.released.fetch_add(1, Ordering::Release);
        }
        dropped
    }

    /// A count that moves whenever reserve blocks are released (their stripes may then
    /// have space to give back).
    pub fn released(&self) -> u64 {
        self.released.load(Ordering::Acquire)
    }

    /// Gives back the disk space of released blocks in the stripe holding block `b`, if
    /// the stripe lies outside this node's preferred set: the whole stripe once it holds
    /// no block here, and before that each run of at least [`RECLAIM_RUN_MIN`] released
    /// blocks around the reserve copies it still holds (random writes leave a few live
    /// copies in many stripes, whose released neighbours would otherwise stay on disk).
    /// Only runs that still have data on disk are punched. Returns the blocks punched.
    ///
    /// # Errors
    /// An I/O error.
    pub fn reclaim_stripe(&self, b: u64) -> io::Result<u64> {
        let sb = self.geometry.stripe_blocks();
        let from = b / sb * sb;
        let to = self.geometry.stripe_end(from, u64::MAX);
        if self.geometry.is_preferred(from, self.index) {
            return Ok(0);
        }
        // Looked at first without the lock: most stripes are settled either way.
        let mut worth = Vec::new();
        for (first, count) in runs((from..to).filter(|&x| self.store.held(x) == 0), u64::MAX) {
            if (count == to - from || count >= RECLAIM_RUN_MIN) && self.store.has_data(first, count)? {
                worth.push((first, count));
            }
        }
        if worth.is_empty() {
            return Ok(0);
        }
        let _exclusive = self.io.write().unwrap_or_else(PoisonError::into_inner);
        let mut punched = 0;
        for (first, count) in worth {
            // A block stored since the look above keeps its run whole.
            if (first..first + count).all(|x| self.store.held(x) == 0) {
                self.store.drop_blocks(first, count)?;
                punched += count;
            }
        }
        Ok(punched)
    }

    /// The front end `owner` began epoch `epoch`: its earlier PrepareData is garbage.
    pub fn new_epoch(&self, owner: NodeId, epoch: u64) {
        let mut p = self.lock();
        let e = p.epochs.entry(owner).or_default();
        *e = (*e).max(epoch);
        executed::epoch_began(&mut p.executed, owner.0, epoch);
        p.collect(owner);
    }

    /// The metadata was replaced by a snapshot (state transfer or restart): the data
    /// files stay; reads check them against the new metadata. A node that took a later
    /// state instead of executing writes may hold their PrepareData: each block of it
    /// whose bytes are what the restored state agrees on is stored now, a copy here again
    /// rather than a log record nothing would read. Then the PrepareData of writes the
    /// state executed is consumed, as executing them would have (a matching hash alone
    /// does not prove a write was ordered, so only the state's record of executed writes
    /// decides), and the epochs it ended drop their PrepareData, as executing their end
    /// would have. A restart comes through here too: `open` put every record its log
    /// still holds back in waiting, including those consumed before the checkpoint it
    /// restarts from.
    ///
    /// The look at the records goes region by region as the restore decodes them
    /// ([`RestoreCheck::region`]), before [`RestoreCheck::finish`]: reading the agreed
    /// versions back from the store once restored cost a range scan per record (2 s for
    /// the 1.7M blocks a restart after a 2 GiB fill of 512-byte blocks found logged).
    pub(crate) fn restore_check(&self) -> RestoreCheck<'_> {
        let mut ranges: Vec<(u64, u64, Key)> = self
            .lock()
            .waiting
            .iter()
            .map(|(key, held)| (held.prepare.first, held.prepare.first + held.prepare.hashes.len() as u64, *key))
            .collect();
        ranges.sort_unstable();
        RestoreCheck { local: self, ranges, next: 0, active: Vec::new(), copies: Vec::new(), carried: HashMap::new() }
    }

    /// [`Local::restore_check`] over `meta` as it stands, region by region (a test's
    /// restore, which does not stream its regions past the check).
    #[cfg(test)]
    pub(crate) fn restored(&self, meta: &Meta) {
        let mut check = self.restore_check();
        for (i, region) in meta.regions().enumerate() {
            check.region(i, &region);
        }
        check.finish(meta);
    }

    /// Whether the next checkpoint must sync the data files before its metadata is
    /// written: a write not covered by an earlier such sync stored data no record holds.
    pub fn syncs_inline(&self) -> bool {
        let unlogged = self.unlogged.load(Ordering::Acquire);
        self.syncer.is_none() || unlogged > self.unlogged_synced.load(Ordering::Acquire)
    }

    /// A checkpoint froze the metadata: returns its generation; PrepareData logged from
    /// now on goes to a new segment.
    pub fn freeze(&self) -> u64 {
        self.generation.fetch_add(1, Ordering::AcqRel) + 1
    }

    /// The checkpoint of generation `generation` is being written: sync the data files
    /// (they hold every write executed before its freeze), then let go of the logged
    /// PrepareData consumed two generations before (`DataSync::run`).
    ///
    /// With a syncer, the sync runs on its thread and the checkpoint does not wait for
    /// it, unless a write before the freeze stored data that no PrepareData record holds
    /// (full mode). That is safe because what a restart from this checkpoint needs of
    /// the data files is, for each block, either in a record the log keeps until a sync
    /// covering it completed (a write's PrepareData, or a restore's copy of one), zeros
    /// (served from the agreed hash, never read), or a copy fetched from a holder,
    /// fetched again if lost. `restored` checks the bytes of blocks its records cover, so
    /// a held version the kernel wrote back ahead of its data is repaired, not trusted.
    pub fn checkpoint(&self, generation: u64) {
        if let (Some(syncer), false) = (&self.syncer, self.syncs_inline()) {
            if syncer.jobs.as_ref().is_some_and(|jobs| jobs.send(generation).is_ok()) {
                return;
            }
        }
        if self.sync_parts().run(generation) {
            self.unlogged_synced.fetch_max(generation, Ordering::AcqRel);
        }
    }
}

/// A write's key: its front end, epoch and sequence number.
type Key = (NodeId, u64, u64);

/// What a restore found in the PrepareData this node holds ([`Local::restore_check`]).
pub(crate) struct RestoreCheck<'a> {
    local: &'a Local,
    /// The records waiting at the start, as (first block, end, key), by first block.
    ranges: Vec<(u64, u64, Key)>,
    /// The next of `ranges` not yet met.
    next: usize,
    /// Records met that may reach past the regions looked at so far.
    active: Vec<(u64, u64, Key)>,
    /// Blocks to store from a record: (block, agreed version, bytes).
    copies: Vec<(u64, u64, Vec<u8>)>,
    /// The data read back of records that reach into the next region.
    carried: HashMap<Key, Vec<u8>>,
}

impl RestoreCheck<'_> {
    /// Region `index` of the restored state: each block of it a waiting record holds with
    /// the hash the state agrees on, and that this node's copy lacks (held older, or
    /// held as that version with other bytes: after a crash the held versions and the
    /// data are only as durable as the last sync made them, and the kernel may have
    /// written back one ahead of the other), is taken from the record. Regions come in
    /// order.
    pub(crate) fn region(&mut self, index: usize, region: &Region) {
        let start = index as u64 * REGION_BLOCKS as u64;
        let end = start + region.versions.len() as u64;
        while let Some(&range) = self.ranges.get(self.next).filter(|r| r.0 < end) {
            self.active.push(range);
            self.next += 1;
        }
        self.active.retain(|r| r.1 > start);
        if self.active.is_empty() {
            return;
        }
        let local = self.local;
        let bs = local.geometry.bs();
        // Two records may hold the same block (with the same bytes, if both hash to the
        // agreed hash): the first decides.
        let mut seen = vec![false; region.versions.len()];
        let active: std::collections::HashSet<Key> = self.active.iter().map(|r| r.2).collect();
        self.carried.retain(|key, _| active.contains(key));
        let p = local.lock();
        for &(first, last, key) in &self.active {
            let Some(held) = p.waiting.get(&key) else { continue };
            // Its blocks here the restored state agrees it holds.
            let agreed: Vec<(u64, u64)> = (first.max(start)..last.min(end))
                .filter_map(|b| {
                    let (i, k) = ((b - start) as usize, (b - first) as usize);
                    let version = region.versions[i];
                    let holds = version > 0 && !seen[i] && held.prepare.hashes.get(k) == Some(&region.hashes[i]);
                    holds.then_some((b, version))
                })
                .collect();
            if agreed.is_empty() {
                continue;
            }
            // Its data (read from its record for one read back at open; once for a
            // record that reaches into the next region).
            let data = match self.carried.get(&key) {
                Some(d) => std::borrow::Cow::Borrowed(d.as_slice()),
                None => match held.data() {
                    Ok(d) => d,
                    Err(e) => {
                        local.stats.store_errors.fetch_add(1, Ordering::Relaxed);
                        tracing::error!(first, error = %e, "reading a logged PrepareData back after a restore failed");
                        continue;
                    }
                },
            };
            if data.len() != held.prepare.hashes.len() * bs {
                // Checked before it was logged; a record that no longer matches is not used.
                local.stats.store_errors.fetch_add(1, Ordering::Relaxed);
                tracing::error!(first, "a logged PrepareData's data does not cover its blocks: not used");
                continue;
            }
            let ours = |b: u64| &data[(b - first) as usize * bs..(b - first + 1) as usize * bs];
            // Blocks held at the agreed version: compare their bytes, a run at a time.
            let mut compare: Vec<(u64, u64)> = Vec::new();
            for &(b, version) in &agreed {
                seen[(b - start) as usize] = true;
                let held = local.store.held(b);
                if held < version {
                    self.copies.push((b, version, ours(b).to_vec()));
                } else if held == version {
                    compare.push((b, version));
                }
            }
            // The record's bytes hash to its hashes (checked before it was logged), so
            // equal bytes are the agreed bytes: no hash of what the store holds is needed.
            for run in compare.chunk_by(|a, b| a.0 + 1 == b.0) {
                let (b0, count) = (run[0].0, run.len() as u64);
                let stored = local.read(b0, count).map(|(bytes, _)| bytes);
                for (j, &(b, version)) in run.iter().enumerate() {
                    if stored.as_ref().map_or(true, |s| &s[j * bs..(j + 1) * bs] != ours(b)) {
                        self.copies.push((b, version, ours(b).to_vec()));
                    }
                }
            }
            if last > end {
                if let std::borrow::Cow::Owned(d) = data {
                    self.carried.insert(key, d);
                }
            }
        }
    }

    /// The restore is done and `meta` is the restored state: stores the copies the
    /// regions found, consumes the records of writes `meta` executed, ends the epochs it
    /// ended.
    pub(crate) fn finish(self, meta: &Meta) {
        let local = self.local;
        // Any preferred block may be INCOMPLETE after a restore: every region is looked at.
        for g in &local.gaps {
            g.fetch_max(meta.version(), Ordering::AcqRel);
        }
        for (b, version, data) in self.copies {
            let stored = {
                let _exclusive = local.io.write().unwrap_or_else(PoisonError::into_inner);
                // A newer write may have reached the block meanwhile (phase 2's fetch).
                if local.store.held(b) <= version {
                    local.write_counted(b, &data, version)
                } else {
                    Ok(())
                }
            };
            if let Err(e) = stored {
                local.stats.store_errors.fetch_add(1, Ordering::Relaxed);
                tracing::error!(block = b, error = %e, "storing a block from its PrepareData after a restore failed");
            } else {
                local.stats.restored_from_prepared.fetch_add(1, Ordering::Relaxed);
            }
        }
        {
            let generation = local.generation.load(Ordering::Acquire);
            let mut p = local.lock();
            p.executed = meta.executed_writes().map(|(owner, e)| (owner, e.clone())).collect();
            let done: Vec<_> = p.waiting.keys().filter(|&&(o, e, s)| p.executed(o, e, s)).copied().collect();
            for key in done {
                p.consume(&key, generation);
            }
        }
        for (owner, epoch) in meta.epochs() {
            local.new_epoch(NodeId(owner), epoch);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geometry() -> Geometry {
        Geometry::new(4 << 20, 4096, 4, 3).expect("valid")
    }

    /// A node's store (member 0 of `geometry()`) in a fresh directory, with this reserve.
    fn opened(reserve: f64) -> (tempfile::TempDir, Local) {
        let dir = tempfile::tempdir().expect("tempdir");
        let local = Local::open(dir.path(), geometry(), NodeId(0), 0, reserve, true).expect("opens");
        (dir, local)
    }

    fn prepare(owner: NodeId, epoch: u64, seq: u64, first: u64, fill: u8, blocks: usize) -> Prepare {
        let data = vec![fill; blocks * 4096];
        let hashes = data.chunks_exact(4096).map(|d| *blake3::hash(d).as_bytes()).collect();
        Prepare { owner, epoch, seq, first, hashes, data }
    }

    /// Front end 2's write `seq` of epoch 1, prepared here and then executed as
    /// `version`: what a preferred or reserve node does for a write it holds.
    async fn written(local: &Local, seq: u64, first: u64, fill: u8, blocks: usize, version: u64) -> Prepare {
        let p = prepare(NodeId(2), 1, seq, first, fill, blocks);
        local.prepare(p.clone()).await.expect("takes it");
        local.executed_write(NodeId(2), 1, seq, Some(Applied { first, hashes: &p.hashes, data: None, version }));
        p
    }

    /// Phase 2 looks again only at regions where a preferred block was left without its
    /// data (or all of them after a restore): a write stored here, or one into a block
    /// preferred elsewhere, does not move a region's gap.
    #[tokio::test]
    async fn only_a_preferred_block_left_without_data_or_a_restore_moves_a_gap() {
        let g = Geometry::new(64 << 20, 4096, 4, 3).expect("valid");
        let dir = tempfile::tempdir().expect("tempdir");
        let local = Local::open(dir.path(), g, NodeId(0), 0, 0.1, true).expect("opens");
        let mine = |region: u64| {
            let start = region * REGION_BLOCKS as u64;
            (start..start + REGION_BLOCKS as u64).find(|&b| g.is_preferred(b, 0)).expect("one preferred here")
        };
        let other = (0..g.blocks).find(|&b| !g.is_preferred(b, 0)).expect("one preferred elsewhere");
        let gaps = |l: &Local| (0..4).map(|r| l.gap_of(r)).collect::<Vec<_>>();
        let p = prepare(NodeId(2), 1, 1, mine(1), 7, 1);
        local.prepare(p.clone()).await.expect("takes it");
        let applied =
            |first: u64, hashes: &'static [Hash], version| Some(Applied { first, hashes, data: None, version });
        local.executed_write(
            NodeId(2),
            1,
            1,
            Some(Applied { first: mine(1), hashes: &p.hashes, data: None, version: 1 }),
        );
        assert_eq!(gaps(&local), [0, 0, 0, 0], "stored with its data");
        local.executed_write(NodeId(2), 1, 2, applied(other, &[[1; 32]], 2));
        assert_eq!(gaps(&local), [0, 0, 0, 0], "not preferred here");
        local.executed_write(NodeId(2), 1, 3, applied(mine(2), &[[1; 32]], 3));
        assert_eq!(gaps(&local), [0, 0, 3, 0], "preferred here, no data");
        // The agreed state at version 9, as a restore installs it.
        let mut s = crate::meta::BlockService::new(g);
        for k in 0..9 {
            let zero = crate::meta::Command::Zero { first: k, count: 1 }.encode();
            keel::Service::execute(
                &mut s,
                &zero,
                &keel::ExecCtx::new(keel_core::ids::Seq(k + 1), 1, 7, keel_core::ids::ClientId(1)),
            );
        }
        local.restored(&s.view().read().expect("not poisoned"));
        assert_eq!(gaps(&local), [9, 9, 9, 9], "a restore: every region");
    }

    #[tokio::test]
    async fn a_write_with_its_prepare_is_complete_and_without_it_incomplete() {
        let (_dir, local) = opened(0.1);
        written(&local, 1, 0, 7, 2, 1).await;
        assert_eq!((local.store().held(0), local.store().held(1)), (1, 1));
        let q = prepare(NodeId(2), 1, 2, 5, 8, 1);
        local.executed_write(NodeId(2), 1, 2, Some(Applied { first: 5, hashes: &q.hashes, data: None, version: 2 }));
        assert_eq!(local.store().held(5), 0, "no PrepareData: INCOMPLETE");
        assert_eq!(local.stats.writes_incomplete.load(Ordering::Relaxed), 1);
    }

    /// The epoch ends while the PrepareData is being logged (the node executes the
    /// front end's NewEpoch, or a tick ends it, between the epoch check and the record's
    /// fsync): it is refused, not kept where no later epoch end would drop it.
    #[test]
    fn a_prepare_whose_epoch_ends_while_it_is_logged_is_refused_and_pins_nothing() {
        use std::future::Future;
        use std::task::{Context, Poll, Waker};
        let (_dir, local) = opened(0.1);
        let p = prepare(NodeId(2), 1, 1, 0, 7, 2);
        let mut logging = std::pin::pin!(local.prepare(p.clone()));
        let mut cx = Context::from_waker(Waker::noop());
        // The first poll passes the epoch check and hands the record to the log writer.
        assert!(logging.as_mut().poll(&mut cx).is_pending(), "waits for the log's fsync");
        local.new_epoch(NodeId(2), 2);
        let refused = loop {
            match logging.as_mut().poll(&mut cx) {
                Poll::Ready(r) => break r,
                Poll::Pending => std::thread::sleep(std::time::Duration::from_millis(1)),
            }
        };
        assert!(matches!(refused, Err(Refused::OldEpoch)), "{refused:?}");
        assert!(!local.has_prepared(NodeId(2), 1, 1));
        assert_eq!(local.prepared_bytes(), 0);
    }

    #[tokio::test]
    async fn the_reserve_counts_blocks_held_outside_the_preferred_set_exactly() {
        let dir = tempfile::tempdir().expect("tempdir");
        // 4 MiB: stripes 0-3 of 256 blocks; member 0 is preferred for slices 0, 2, 3.
        let local = Local::open(dir.path(), geometry(), NodeId(0), 0, 1.0, true).expect("opens");
        written(&local, 1, 256, 7, 2, 1).await;
        assert_eq!(local.reserve().0, 2);
        // Written again: still two blocks.
        let q = written(&local, 2, 256, 8, 2, 2).await;
        assert_eq!(local.reserve().0, 2);
        // Zeroing the whole disk frees them and holds nothing outside the preferred set.
        local.executed_zero(0, 1024, 3);
        assert_eq!(local.reserve().0, 0);
        assert_eq!((local.store().held(0), local.store().held(256)), (3, 0));
        // An INCOMPLETE write elsewhere drops nothing it does not hold.
        local.executed_write(
            NodeId(2),
            1,
            3,
            Some(Applied { first: 300, hashes: &q.hashes[..1], data: None, version: 4 }),
        );
        assert_eq!(local.reserve().0, 0);
        drop(local);
        let local = Local::open(dir.path(), geometry(), NodeId(0), 0, 1.0, true).expect("reopens");
        assert_eq!(local.reserve().0, 0, "recounted at the start, the same");
    }

    /// Reserve collection drops a copy only at the version the preferred nodes were seen
    /// to hold: a newer copy stored since may be one of that version's u + r + 1.
    #[tokio::test]
    async fn reserve_collection_keeps_a_copy_newer_than_the_one_confirmed() {
        let (_dir, local) = opened(1.0);
        // Blocks 256-259 are reserve here (slice 1); 258 is then written again.
        written(&local, 1, 256, 7, 4, 1).await;
        written(&local, 2, 258, 8, 1, 2).await;
        assert_eq!(local.reserve().0, 4);
        // The preferred nodes confirmed version 1 of 256, 257 and 258, nothing of 259.
        let dropped = local.collect_reserve(256, &[1, 1, 1, 0]);
        assert_eq!(dropped, 2);
        let held: Vec<u64> = (256..260).map(|b| local.store().held(b)).collect();
        assert_eq!(held, vec![0, 0, 2, 1], "version 2 of 258 and the unconfirmed 259 stay");
        assert_eq!(local.reserve().0, 2);
        // Two released blocks beside live copies are too few to punch; the stripe's
        // space comes back once it holds nothing here.
        assert!(local.store().has_data(256, 256).expect("seeks"), "released bytes stay until reclaimed");
        assert_eq!(local.reclaim_stripe(256).expect("looks"), 0, "258 and 259 are still held");
        local.collect_reserve(258, &[2, 1]);
        assert_eq!(local.reserve().0, 0);
        assert_eq!(local.reclaim_stripe(300).expect("punches"), 256, "any block of the stripe names it");
        assert!(!local.store().has_data(256, 256).expect("seeks"), "a hole now");
        assert_eq!(local.reclaim_stripe(256).expect("looks"), 0, "nothing left to give back");
        // A preferred block is never collected, whatever the caller says.
        written(&local, 3, 0, 9, 1, 3).await;
        assert_eq!(local.collect_reserve(0, &[3]), 0);
        assert_eq!(local.store().held(0), 3);
        assert_eq!(local.reclaim_stripe(0).expect("looks"), 0, "a preferred stripe is never punched");
    }

    /// A stripe that keeps a few live reserve copies gives back each long released run
    /// around them, and keeps the short ones and the live copies' bytes.
    #[tokio::test]
    async fn reclaim_gives_back_long_released_runs_beside_live_reserve_copies() {
        let (_dir, local) = opened(1.0);
        // Stripe 1 (blocks 256-511) is reserve here: 256..456 held, then released but
        // for 300 (written again: version 2) and 340..350 (not confirmed yet).
        written(&local, 1, 256, 7, 200, 1).await;
        written(&local, 2, 300, 8, 1, 2).await;
        let mut confirmed = vec![1u64; 200];
        confirmed[44] = 0; // 300: version 2 here, not confirmed
        confirmed[84..94].fill(0); // 340..350: not confirmed yet
        assert_eq!(local.collect_reserve(256, &confirmed), 189);
        // Runs: 256..300 (44, short), 301..340 (39, short), 350..512 (162, long).
        assert_eq!(local.reclaim_stripe(256).expect("punches"), 162);
        assert!(!local.store().has_data(350, 162).expect("seeks"), "the long run is a hole");
        for (first, count) in [(256, 44), (300, 1), (301, 39), (340, 10)] {
            assert!(local.store().has_data(first, count).expect("seeks"), "{first}+{count} keeps its bytes");
        }
        assert_eq!((local.store().held(300), local.store().held(345)), (2, 1), "live copies stay held");
        let (data, held) = local.read(300, 1).expect("reads");
        assert_eq!((data[..4096].to_vec(), held[0]), (vec![8u8; 4096], 2), "the live copy is intact");
        assert_eq!(local.reclaim_stripe(256).expect("looks"), 0, "nothing long left to give back");
    }

    /// Fetched blocks are stored run by run, and one a newer write reached meanwhile is
    /// left alone.
    #[test]
    fn fetched_blocks_are_stored_except_where_a_newer_version_is_held() {
        let (_dir, local) = opened(0.1);
        local.store().write(2, &[5u8; 4096], 9).expect("writes");
        let data: Vec<u8> = (0..5u8).flat_map(|k| [k + 1; 4096]).collect();
        local.store_fetched(0, &[3, 4, 5, 6, 7], &data).expect("stores");
        let held: Vec<u64> = (0..5).map(|b| local.store().held(b)).collect();
        assert_eq!(held, vec![3, 4, 9, 6, 7]);
        let (bytes, _) = local.read(0, 5).expect("reads");
        let firsts: Vec<u8> = bytes.chunks_exact(4096).map(|b| b[0]).collect();
        assert_eq!(firsts, vec![1, 2, 5, 4, 5], "block 2 kept its newer bytes");
    }

    #[tokio::test]
    async fn bad_prepares_are_refused_and_counted() {
        let (_dir, local) = opened(0.0);
        let mut wrong = prepare(NodeId(2), 1, 1, 0, 7, 1);
        wrong.data[0] ^= 1;
        assert!(matches!(local.prepare(wrong).await, Err(Refused::Malformed(_))));
        assert!(matches!(local.prepare(prepare(NodeId(2), 1, 1, 1023, 7, 2)).await, Err(Refused::Malformed(_))));
        // Block 256 is in slice 1, preferred on members 1, 2, 3: reserve for member 0,
        // which has none.
        assert!(matches!(local.prepare(prepare(NodeId(2), 1, 1, 256, 7, 1)).await, Err(Refused::ReserveFull(0))));
        local.new_epoch(NodeId(2), 3);
        assert!(matches!(local.prepare(prepare(NodeId(2), 2, 1, 0, 7, 1)).await, Err(Refused::OldEpoch)));
        assert_eq!(local.stats.prepares_refused.load(Ordering::Relaxed), 4);
        assert_eq!(local.prepared_bytes(), 0);
    }

    #[tokio::test]
    async fn prepares_survive_a_restart_until_a_later_checkpoint_covers_them() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = prepare(NodeId(2), 1, 1, 0, 7, 1);
        {
            let local = Local::open(dir.path(), geometry(), NodeId(0), 0, 0.1, true).expect("opens");
            local.prepare(p.clone()).await.expect("takes it");
            // Sent again (a retry): logged twice, counted once.
            local.prepare(p.clone()).await.expect("takes it");
        }
        let local = Local::open(dir.path(), geometry(), NodeId(0), 0, 0.1, true).expect("reopens");
        assert!(local.has_prepared(NodeId(2), 1, 1), "the log brought it back");
        assert_eq!(local.prepared_bytes(), 4096, "once, though logged twice");
        // Replayed WriteData finds it.
        local.executed_write(NodeId(2), 1, 1, Some(Applied { first: 0, hashes: &p.hashes, data: None, version: 1 }));
        assert_eq!(local.read(0, 1).expect("reads"), (p.data.clone(), vec![1]), "its data read back from the log");
        let g1 = local.freeze();
        local.checkpoint(g1);
        let g2 = local.freeze();
        local.checkpoint(g2);
        let g3 = local.freeze();
        local.checkpoint(g3);
        drop(local);
        // Done with, its file kept for the next segment (dropping the log waited for that).
        let names: Vec<String> = std::fs::read_dir(dir.path().join("prepare"))
            .expect("reads")
            .map(|e| e.expect("entry").file_name().into_string().expect("utf-8"))
            .collect();
        assert!(names.iter().all(|n| n.ends_with(".free")), "the consumed record's segment is let go: {names:?}");
        let local = Local::open(dir.path(), geometry(), NodeId(0), 0, 0.1, true).expect("reopens");
        assert!(!local.has_prepared(NodeId(2), 1, 1), "and never comes back");
    }

    /// A record read back at open keeps its data on disk until used; if its file changed
    /// meanwhile, the change is caught and the block is left INCOMPLETE (phase 2 fetches
    /// it), never stored with other bytes.
    #[tokio::test]
    async fn a_record_changed_on_disk_after_open_is_not_used() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = prepare(NodeId(2), 1, 1, 0, 7, 1);
        {
            let local = Local::open(dir.path(), geometry(), NodeId(0), 0, 0.1, true).expect("opens");
            local.prepare(p.clone()).await.expect("takes it");
        }
        let local = Local::open(dir.path(), geometry(), NodeId(0), 0, 0.1, true).expect("reopens");
        assert!(local.has_prepared(NodeId(2), 1, 1), "the log brought it back");
        let segment = std::fs::read_dir(dir.path().join("prepare"))
            .expect("reads")
            .map(|e| e.expect("entry").path())
            .find(|path| path.extension().is_some_and(|e| e == "seg"))
            .expect("a live segment");
        let f = std::fs::OpenOptions::new().write(true).open(&segment).expect("opens");
        let len = f.metadata().expect("stat").len();
        std::os::unix::fs::FileExt::write_all_at(&f, &[0xee], len - 10).expect("writes");
        local.executed_write(NodeId(2), 1, 1, Some(Applied { first: 0, hashes: &p.hashes, data: None, version: 1 }));
        assert_eq!(local.store().held(0), 0, "INCOMPLETE here");
        assert_eq!(local.stats.store_errors.load(Ordering::Relaxed), 1);
    }

    #[tokio::test]
    async fn old_epochs_are_collected_and_nothing_else() {
        let (_dir, local) = opened(0.1);
        local.prepare(prepare(NodeId(2), 1, 1, 0, 1, 1)).await.expect("takes it");
        local.prepare(prepare(NodeId(3), 1, 1, 0, 1, 1)).await.expect("takes it");
        local.new_epoch(NodeId(2), 2);
        assert!(!local.has_prepared(NodeId(2), 1, 1));
        assert!(local.has_prepared(NodeId(3), 1, 1));
        // Many later writes of the same front end: the early one may still be ordered.
        for seq in 2..10_000 {
            local.executed_write(
                NodeId(3),
                1,
                seq,
                Some(Applied { first: 1, hashes: &[[0; 32]], data: None, version: seq }),
            );
        }
        assert!(local.has_prepared(NodeId(3), 1, 1), "a PrepareData whose WriteData may come is kept");
        local.new_epoch(NodeId(3), 2);
        assert!(!local.has_prepared(NodeId(3), 1, 1));
        assert_eq!(local.prepared_bytes(), 0);
    }
}
