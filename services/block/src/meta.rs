//! The replicated state: Gnothi's metadata (§3.6), what every node agrees on. Per block
//! a version (the agreed counter of writes when it was last written; 0: never written,
//! all zeros) and the BLAKE3 hash of its data, so that data read from one node can be
//! checked against what the cluster ordered (beyond Gnothi, which trusts its replicas).
//! The data itself is node-local (`store.rs`): executing a write stores it where the
//! node holds it (PrepareData arrived, or carried in the command in full mode) and
//! leaves the block INCOMPLETE on that node otherwise.

use crate::executed::{self, Executed};
use crate::geometry::Geometry;
use crate::local::{Applied, Local};
use crate::meta_store::{region_len, FrozenStore, MetaStore, Region};
pub use crate::meta_store::{Hash, REGION_BLOCKS};
#[cfg(test)]
use keel::core::chunk;
use keel::core::chunk::Piece;
use keel::core::service::{format_stamp, read_front, strip_format_stamp, take_front};
use keel::{ExecCtx, Frozen, ReadCtx, RestoreError, Service};
use keel_core::ids::NodeId;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
/// Most blocks one metadata read may ask for (its reply stays far under a reply's bound).
pub const META_BLOCKS_MAX: u32 = 8192;
/// How long (agreed time) a front end may order no write and no epoch before the cluster
/// ends its epoch at the next tick: the PrepareData it left on the nodes is garbage from
/// then on, so an absent front end pins its PrepareData (at most
/// `local::PREPARED_BYTES_PER_OWNER` per node) for about this long, not until it comes
/// back. Twice a front end's operation timeout (30 s), so a write still waiting to be
/// ordered is rarely fenced; when one is, or when a front end writes again after a
/// quiet minute, it renews its epoch with one ordered command and retries.
pub const EPOCH_IDLE_MS: u64 = 60_000;
/// The snapshot's format, its first four bytes: a snapshot of another format (an older
/// build's) is refused with a message that says so rather than misread. Format 2 (no
/// record of executed writes) is still read.
const SNAPSHOT_FORMAT: u32 = 3;

/// What the front ends send through agreement.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    /// Gnothi's WriteData: blocks `first..first + hashes.len()` get one new version and
    /// these hashes. The data is the PrepareData `(owner, epoch, seq)` where a node holds
    /// it, or `data` (full mode, G'). With `expect`, only if block `first`'s version is
    /// still that one (the read-modify-write of a partial block).
    Write {
        owner: u32,
        epoch: u64,
        seq: u64,
        first: u64,
        hashes: Vec<Hash>,
        expect: Option<u64>,
        #[serde(with = "serde_bytes")]
        data: Option<Vec<u8>>,
    },
    /// TRIM and WRITE_ZEROES: the blocks read as zeros from now on; no data moves.
    Zero { first: u64, count: u64 },
    /// Gnothi's "new epoch": the front end `owner` (re)started, so every PrepareData of
    /// its earlier epochs is garbage. Replies the new epoch. With `after`, the front end's
    /// writes of epoch `after` were fenced: if the cluster has ended that epoch already
    /// (an idle front end's, at a tick), the reply is the epoch that ended it, unused so
    /// far, and nothing changes; so writes fenced together renew once, not once each
    /// (each renewal would fence the others' retries).
    NewEpoch { owner: u32, after: Option<u64> },
    /// Read-only: the versions and hashes of `count` blocks from `first`.
    Meta { first: u64, count: u32 },
}

impl Command {
    pub fn encode(&self) -> Vec<u8> {
        postcard::to_allocvec(self).unwrap_or_default()
    }

    pub fn decode(bytes: &[u8]) -> Result<Command, postcard::Error> {
        postcard::from_bytes(bytes)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reply {
    /// The write took effect as this version.
    Written {
        version: u64,
    },
    /// `expect` did not hold: block `first` is at `version` now. Nothing changed.
    Moved {
        version: u64,
    },
    Epoch(u64),
    /// The write's epoch ended (its front end began a newer one): nothing changed.
    Fenced,
    Meta(Vec<(u64, Hash)>),
    /// The command is malformed or out of range; nothing changed.
    Invalid(String),
}

impl Reply {
    pub fn encode(&self) -> Vec<u8> {
        postcard::to_allocvec(self).unwrap_or_default()
    }

    pub fn decode(bytes: &[u8]) -> Result<Reply, postcard::Error> {
        postcard::from_bytes(bytes)
    }
}

/// The hash of a block of `block_size` zero bytes: what a never-written or zeroed block
/// holds.
pub fn zero_hash(block_size: usize) -> Hash {
    *blake3::hash(&vec![0u8; block_size]).as_bytes()
}

/// The head of a snapshot (its first piece): everything but the regions.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Head {
    geometry: Geometry,
    version: u64,
    epochs: BTreeMap<u32, u64>,
    /// Per front end whose epoch is open, the agreed time of its last write or epoch:
    /// a tick ends the epochs idle for `idle_ms` (and forgets them here).
    active: BTreeMap<u32, u64>,
    /// Per front end, which writes of its current epoch executed (whatever their reply):
    /// a node drops or refuses their PrepareData, and a second ordering of one is refused.
    executed: BTreeMap<u32, Executed>,
}

/// Format 2's head, before `executed`: read as a head whose front ends executed nothing
/// yet in their current epochs (their PrepareData waits for the epoch's end, as it did).
#[derive(Deserialize)]
struct HeadV2 {
    geometry: Geometry,
    version: u64,
    epochs: BTreeMap<u32, u64>,
    active: BTreeMap<u32, u64>,
}

impl From<HeadV2> for Head {
    fn from(h: HeadV2) -> Head {
        Head { geometry: h.geometry, version: h.version, epochs: h.epochs, active: h.active, executed: BTreeMap::new() }
    }
}

/// The agreed metadata.
pub struct Meta {
    head: Head,
    zero: Hash,
    /// Per block, its version and hash (`meta_store.rs`).
    store: MetaStore,
    /// Per region, the version of the last write or TRIM into it. Not in the snapshot:
    /// a restore stamps every region with the snapshot's version (a region's content at
    /// a version is the same on every node). Recovery phase 2 scans again only regions
    /// whose stamp moved since it found them complete.
    stamps: Vec<u64>,
    /// [`EPOCH_IDLE_MS`] unless the cluster sets another. Every node must have the same:
    /// it comes from cluster.toml, like the geometry.
    idle_ms: u64,
}

impl Meta {
    /// A fresh disk's metadata, kept in memory (tests, the simulator).
    pub fn new(geometry: Geometry) -> Meta {
        let zero = zero_hash(geometry.bs());
        Meta::with_store(geometry, MetaStore::memory(geometry, zero))
    }

    /// A fresh disk's metadata, kept in a store at `dir` (a node's: wiped here, rebuilt
    /// by the node's restore and replay).
    ///
    /// # Errors
    /// The store cannot be wiped or created.
    pub fn on_disk(geometry: Geometry, dir: &Path) -> Result<Meta, String> {
        let zero = zero_hash(geometry.bs());
        Ok(Meta::with_store(geometry, MetaStore::open(dir, geometry, zero)?))
    }

    fn with_store(geometry: Geometry, store: MetaStore) -> Meta {
        let zero = zero_hash(geometry.bs());
        let stamps = vec![0; geometry.blocks.div_ceil(REGION_BLOCKS as u64) as usize];
        let head =
            Head { geometry, version: 0, epochs: BTreeMap::new(), active: BTreeMap::new(), executed: BTreeMap::new() };
        Meta { head, zero, store, stamps, idle_ms: EPOCH_IDLE_MS }
    }

    pub fn geometry(&self) -> Geometry {
        self.head.geometry
    }

    pub fn zero(&self) -> Hash {
        self.zero
    }

    /// The last version given out.
    pub fn version(&self) -> u64 {
        self.head.version
    }

    /// Block `b`'s (version, hash); `b` must be in range.
    pub fn get(&self, b: u64) -> (u64, Hash) {
        self.store.get(b)
    }

    /// Blocks `first..first + count`'s (version, hash); they must be in range.
    pub fn get_run(&self, first: u64, count: u64) -> Vec<(u64, Hash)> {
        self.store.get_run(first, count)
    }

    /// Each region's blocks, in order.
    #[cfg(test)]
    pub(crate) fn regions(&self) -> impl Iterator<Item = Region> + '_ {
        let g = self.geometry();
        (0..g.blocks.div_ceil(REGION_BLOCKS as u64) as usize).map(move |i| {
            let run = self.store.get_run(i as u64 * REGION_BLOCKS as u64, region_len(g, i) as u64);
            Region { versions: run.iter().map(|r| r.0).collect(), hashes: run.into_iter().map(|r| r.1).collect() }
        })
    }

    /// Region `region`'s stamp: the version of the last write into it (see `stamps`).
    pub fn stamp(&self, region: usize) -> u64 {
        self.stamps.get(region).copied().unwrap_or(0)
    }

    /// Stamps the regions of blocks `first..first + count` with `version`.
    fn stamp_run(&mut self, first: u64, count: u64, version: u64) {
        let last = (first + count - 1) / REGION_BLOCKS as u64;
        for region in first / REGION_BLOCKS as u64..=last {
            self.stamps[region as usize] = version;
        }
    }

    fn in_range(&self, first: u64, count: u64) -> bool {
        count > 0 && first.checked_add(count).is_some_and(|end| end <= self.head.geometry.blocks)
    }

    /// Runs `command` at agreed time `now` on the metadata and, with `local`, on this
    /// node's data.
    fn apply(&mut self, command: Command, now: u64, local: Option<&Local>) -> Reply {
        match command {
            Command::Write { owner, epoch, seq, first, hashes, expect, data } => {
                let count = hashes.len() as u64;
                if !self.in_range(first, count) {
                    return Reply::Invalid(format!("blocks {first}+{count} outside 0..{}", self.head.geometry.blocks));
                }
                // A new epoch fenced this front end's older writes (it gave up on them).
                if epoch < self.epoch(owner) {
                    return Reply::Fenced;
                }
                // Ordered twice: its PrepareData was consumed the first time, so a second
                // version would name data no node holds.
                if self.executed(owner, epoch, seq) {
                    return Reply::Invalid(format!(
                        "write {seq} of front end {owner}'s epoch {epoch} executed already"
                    ));
                }
                self.head.active.insert(owner, now);
                executed::record(&mut self.head.executed, owner, epoch, seq);
                let size = count * u64::from(self.head.geometry.block_size);
                let reply = match (data.as_ref().map(Vec::len), expect.map(|want| (want, self.get(first).0))) {
                    (Some(len), _) if len as u64 != size => {
                        Reply::Invalid(format!("{len} data bytes for {count} blocks"))
                    }
                    (_, Some((want, now))) if want != now => Reply::Moved { version: now },
                    _ => {
                        self.head.version += 1;
                        let version = self.head.version;
                        self.stamp_run(first, count, version);
                        self.store.set_run(first, version, &hashes);
                        Reply::Written { version }
                    }
                };
                if let Some(local) = local {
                    let applied = match reply {
                        Reply::Written { version } => Some(Applied { first, hashes: &hashes, data, version }),
                        _ => None,
                    };
                    local.executed_write(NodeId(owner), epoch, seq, applied);
                }
                reply
            }
            Command::Zero { first, count } => {
                if !self.in_range(first, count) {
                    return Reply::Invalid(format!("blocks {first}+{count} outside 0..{}", self.head.geometry.blocks));
                }
                self.head.version += 1;
                let version = self.head.version;
                self.stamp_run(first, count, version);
                self.store.zero(first, count, version);
                if let Some(local) = local {
                    local.executed_zero(first, count, version);
                }
                Reply::Written { version }
            }
            Command::NewEpoch { owner, after } => {
                let e = self.head.epochs.entry(owner).or_insert(0);
                if after.is_none_or(|after| *e <= after) {
                    *e += 1;
                }
                let epoch = *e;
                self.head.active.insert(owner, now);
                executed::epoch_began(&mut self.head.executed, owner, epoch);
                if let Some(local) = local {
                    local.new_epoch(NodeId(owner), epoch);
                }
                Reply::Epoch(epoch)
            }
            Command::Meta { first, count } => self.read_meta(first, count),
        }
    }

    fn read_meta(&self, first: u64, count: u32) -> Reply {
        if count > META_BLOCKS_MAX || !self.in_range(first, u64::from(count)) {
            return Reply::Invalid(format!("metadata of blocks {first}+{count}: at most {META_BLOCKS_MAX} in range"));
        }
        Reply::Meta(self.get_run(first, u64::from(count)))
    }

    /// Every front end's last epoch.
    pub fn epochs(&self) -> impl Iterator<Item = (u32, u64)> + '_ {
        self.head.epochs.iter().map(|(&owner, &epoch)| (owner, epoch))
    }

    /// Whether write `seq` of front end `owner`'s epoch `epoch` executed, as far as the
    /// record goes (it forgets, never invents: see `executed.rs`).
    pub fn executed(&self, owner: u32, epoch: u64, seq: u64) -> bool {
        self.head.executed.get(&owner).is_some_and(|e| e.contains(epoch, seq))
    }

    /// Per front end, which writes of its current epoch executed.
    pub fn executed_writes(&self) -> impl Iterator<Item = (u32, &Executed)> + '_ {
        self.head.executed.iter().map(|(&owner, e)| (owner, e))
    }

    /// The epoch the cluster gave front end `owner` last (0: none yet).
    pub fn epoch(&self, owner: u32) -> u64 {
        self.head.epochs.get(&owner).copied().unwrap_or(0)
    }

    /// A tick at agreed time `now`: ends the epoch of every front end that ordered
    /// nothing for `idle_ms`, so the nodes drop the PrepareData it left (its later
    /// writes of that epoch are fenced, and it renews). Returns the epochs ended.
    fn end_idle_epochs(&mut self, now: u64, local: Option<&Local>) -> Vec<(u32, u64)> {
        let idle: Vec<u32> = self
            .head
            .active
            .iter()
            .filter(|&(_, &at)| now.saturating_sub(at) >= self.idle_ms)
            .map(|(&owner, _)| owner)
            .collect();
        let mut ended = Vec::with_capacity(idle.len());
        for owner in idle {
            self.head.active.remove(&owner);
            let e = self.head.epochs.entry(owner).or_insert(0);
            *e += 1;
            ended.push((owner, *e));
            executed::epoch_began(&mut self.head.executed, owner, *e);
            if let Some(local) = local {
                local.new_epoch(NodeId(owner), *e);
            }
        }
        ended
    }
}

/// Serialized regions by index, with the region's stamp and the metadata's version when
/// it was serialized: a checkpoint serializes again only the regions written since
/// (their stamp moved), on disk from the cached encoding and what was written since.
type PieceCache = Arc<Mutex<Vec<Option<Cached>>>>;

#[derive(Clone)]
struct Cached {
    stamp: u64,
    version: u64,
    piece: Arc<Piece>,
}

/// The block service one node runs. The metadata sits behind a lock shared with the
/// node's front end and its re-replication task (`BlockService::view`), which read it
/// between executions.
pub struct BlockService {
    meta: Arc<RwLock<Meta>>,
    local: Option<Arc<Local>>,
    cache: PieceCache,
}

impl BlockService {
    /// Metadata only (tests, and nodes that hold no data).
    pub fn new(geometry: Geometry) -> BlockService {
        BlockService { meta: Arc::new(RwLock::new(Meta::new(geometry))), local: None, cache: Arc::default() }
    }

    /// A node's service: `meta` shared with its front end, data in `local`.
    pub fn with_local(meta: Arc<RwLock<Meta>>, local: Arc<Local>) -> BlockService {
        BlockService { meta, local: Some(local), cache: Arc::default() }
    }

    /// Ends idle front ends' epochs after `ms` instead of [`EPOCH_IDLE_MS`] (the
    /// cluster's `epoch_idle_s`; simulations, whose runs are shorter than a minute).
    /// Every node of a cluster must be given the same.
    pub fn with_idle_ms(self, ms: u64) -> BlockService {
        self.meta.write().unwrap_or_else(PoisonError::into_inner).idle_ms = ms;
        self
    }

    pub fn view(&self) -> Arc<RwLock<Meta>> {
        self.meta.clone()
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Meta> {
        self.meta.read().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Service for BlockService {
    fn execute(&mut self, request: &[u8], ctx: &ExecCtx) -> Vec<u8> {
        let reply = match Command::decode(request) {
            Ok(command) => {
                let mut meta = self.meta.write().unwrap_or_else(PoisonError::into_inner);
                meta.apply(command, ctx.time, self.local.as_deref())
            }
            Err(e) => Reply::Invalid(format!("not a block command: {e}")),
        };
        reply.encode()
    }

    fn on_tick(&mut self, ctx: &ExecCtx) {
        let mut meta = self.meta.write().unwrap_or_else(PoisonError::into_inner);
        for (owner, epoch) in meta.end_idle_epochs(ctx.time, self.local.as_deref()) {
            tracing::info!(owner, epoch, idle_ms = meta.idle_ms, "block: an idle front end's epoch ended");
            if let Some(local) = &self.local {
                local.stats.epochs_ended_idle.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
    }

    fn execute_read_only(&self, request: &[u8], _ctx: &ReadCtx) -> Option<Vec<u8>> {
        match Command::decode(request) {
            Ok(Command::Meta { first, count }) => Some(self.read().read_meta(first, count).encode()),
            _ => None,
        }
    }

    fn snapshot(&self) -> Vec<u8> {
        self.frozen().into_fresh_bytes()
    }

    fn pieces(&self) -> Vec<Arc<Piece>> {
        self.frozen().into_pieces()
    }

    fn freeze(&self) -> Option<Box<dyn Frozen>> {
        Some(Box::new(self.frozen()))
    }

    fn restore(&mut self, snapshot: &[u8]) -> Result<(), RestoreError> {
        self.restore_from(&mut &snapshot[..], snapshot.len() as u64)
    }

    /// The regions are decoded and loaded into the store one at a time as the snapshot's
    /// chunks go by: a node's restart or state transfer holds a region of the snapshot
    /// at a time, not the whole of it beside the store it fills.
    fn restore_from(&mut self, state: &mut dyn std::io::Read, len: u64) -> Result<(), RestoreError> {
        let (head, front, used) = read_front(state, len, decode_head)?;
        // Checked before anything is allocated for it: a snapshot is bytes from elsewhere.
        if head.geometry != self.read().geometry() {
            return Err(RestoreError(format!(
                "block snapshot of geometry {:?}; this node has {:?}",
                head.geometry,
                self.read().geometry()
            )));
        }
        // Every length is checked before the store is touched: a bad snapshot changes
        // nothing.
        let geometry = head.geometry;
        let lens: Vec<usize> =
            (0..geometry.blocks.div_ceil(REGION_BLOCKS as u64) as usize).map(|i| region_len(geometry, i)).collect();
        let want: u64 = lens.iter().map(|&len| len as u64 * 40).sum();
        let rest = len - used as u64;
        if rest < want {
            return Err(RestoreError("block snapshot: regions cut short".into()));
        }
        if rest > want {
            return Err(RestoreError(format!("block snapshot: {} bytes after the regions", rest - want)));
        }
        // The PrepareData this node holds is looked at as the regions go by.
        let mut check = self.local.as_deref().map(Local::restore_check);
        // Only a read can fail from here (a stored chunk that does not read back); the
        // regions end there and the error is returned below.
        let mut failed: Option<std::io::Error> = None;
        let mut stream = std::io::Read::chain(std::io::Cursor::new(front), state);
        let mut bytes = Vec::new();
        let regions = lens.iter().enumerate().map_while(|(i, &len)| {
            bytes.resize(len * 40, 0);
            if let Err(e) = stream.read_exact(&mut bytes) {
                failed = Some(e);
                return None;
            }
            let region = Region::decode(&bytes);
            if let Some(check) = &mut check {
                check.region(i, &region);
            }
            Some(region)
        });
        let mut meta = self.meta.write().unwrap_or_else(PoisonError::into_inner);
        meta.store.restore(regions, head.version);
        if let Some(e) = failed {
            return Err(RestoreError(format!("block snapshot read: {e}; the metadata store is incomplete")));
        }
        meta.stamps = vec![head.version; lens.len()];
        meta.head = head;
        drop(meta);
        self.cache.lock().unwrap_or_else(PoisonError::into_inner).clear();
        if let Some(check) = check {
            check.finish(&self.read());
        }
        Ok(())
    }
}

/// A snapshot's head, of this format or format 2, and how many bytes it takes; None if
/// `front` ends before it does.
fn decode_head(front: &[u8]) -> Result<Option<(Head, usize)>, RestoreError> {
    if front.len() < 4 {
        return Ok(None);
    }
    let taken = if let Some(v2) = front.strip_prefix(format_stamp(2).as_slice()) {
        take_front::<HeadV2>(v2).map(|t| t.map(|(head, rest)| (head.into(), rest)))
    } else {
        take_front::<Head>(strip_format_stamp(front, "block", SNAPSHOT_FORMAT)?)
    };
    let taken = taken.map_err(|e| RestoreError(format!("block snapshot head: {e}")))?;
    Ok(taken.map(|(head, rest)| (head, front.len() - rest.len())))
}

impl BlockService {
    fn frozen(&self) -> FrozenMeta {
        let meta = self.read();
        FrozenMeta {
            head: meta.head.clone(),
            zero: meta.zero,
            store: meta.store.freeze(),
            stamps: meta.stamps.clone(),
            cache: self.cache.clone(),
            local: self.local.as_ref().map(|l| (l.clone(), l.freeze())),
        }
    }
}

/// A checkpoint's copy: the store as of the freeze (in memory the regions by reference,
/// a write after the freeze copying the region it changes; on disk a snapshot of the
/// store), serialized on the checkpoint thread.
struct FrozenMeta {
    head: Head,
    zero: Hash,
    store: FrozenStore,
    /// Each region's stamp at the freeze: a region whose cached piece has its stamp is
    /// not read again.
    stamps: Vec<u64>,
    cache: PieceCache,
    /// The node's data and the freeze generation: before the metadata of this checkpoint
    /// is written, the data it describes is made durable (`Local::checkpoint`).
    local: Option<(Arc<Local>, u64)>,
}

impl FrozenMeta {
    fn head_bytes(&self) -> Vec<u8> {
        let mut head = format_stamp(SNAPSHOT_FORMAT);
        head.extend(postcard::to_allocvec(&self.head).unwrap_or_default());
        head
    }

    /// The encoding of a never-written region of `len` blocks.
    fn untouched(&self, len: usize) -> Vec<u8> {
        Region::new(len, self.zero).encode()
    }

    fn into_pieces(self) -> Vec<Arc<Piece>> {
        if let Some((local, generation)) = &self.local {
            local.checkpoint(*generation);
        }
        let mut pieces = Vec::with_capacity(self.stamps.len() + 1);
        pieces.push(Piece::new(self.head_bytes()));
        let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        cache.resize(self.stamps.len(), None);
        // Never-written regions are encoded once per length, and share one piece.
        let mut shared: BTreeMap<usize, Arc<Piece>> = BTreeMap::new();
        let version = self.head.version;
        for (i, &stamp) in self.stamps.iter().enumerate() {
            let cached = cache[i].as_ref().filter(|c| c.stamp == stamp).map(|c| c.piece.clone());
            let piece = cached.unwrap_or_else(|| {
                // A piece that left memory is read back (and checked) to be patched; one
                // that cannot be read is scanned for instead.
                let base = cache[i].as_ref().and_then(|c| c.piece.bytes().ok().map(|bytes| (bytes, c.version)));
                let base = base.as_ref().map(|(bytes, at)| (bytes.as_slice(), *at));
                let piece = match self.store.encode_region(i, base, version) {
                    Some(bytes) => Piece::new(bytes),
                    None => {
                        let len = region_len(self.head.geometry, i);
                        shared.entry(len).or_insert_with(|| Piece::new(self.untouched(len))).clone()
                    }
                };
                // Checkpoints may encode out of order: the cache never goes back to an
                // older encoding, whose writes since the store may have forgotten.
                if cache[i].as_ref().is_none_or(|c| c.version <= version) {
                    cache[i] = Some(Cached { stamp, version, piece: piece.clone() });
                }
                piece
            });
            pieces.push(piece);
        }
        pieces
    }

    /// The snapshot's bytes, every region encoded afresh: cached pieces may have left
    /// memory once a checkpoint was durable (core `chunk.rs`).
    fn into_fresh_bytes(self) -> Vec<u8> {
        if let Some((local, generation)) = &self.local {
            local.checkpoint(*generation);
        }
        let mut out = self.head_bytes();
        for i in 0..self.stamps.len() {
            match self.store.region_bytes(i) {
                Some(bytes) => out.extend(bytes),
                None => out.extend(self.untouched(region_len(self.head.geometry, i))),
            }
        }
        out
    }
}

impl Frozen for FrozenMeta {
    fn snapshot(self: Box<Self>) -> Vec<u8> {
        self.into_fresh_bytes()
    }

    fn pieces(self: Box<Self>) -> Vec<Arc<Piece>> {
        self.into_pieces()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_core::ids::ClientId;
    use keel_core::ids::Seq;

    fn ctx(seq: u64) -> ExecCtx {
        ExecCtx::new(Seq(seq), 1_000 + seq, 7, ClientId(1))
    }

    fn run(s: &mut BlockService, c: Command) -> Reply {
        Reply::decode(&s.execute(&c.encode(), &ctx(1))).expect("reply")
    }

    /// A new write of front end 1's epoch 1 (each call numbered after the last).
    fn write(first: u64, hashes: Vec<Hash>, expect: Option<u64>) -> Command {
        thread_local!(static SEQ: std::cell::Cell<u64> = const { std::cell::Cell::new(0) });
        let seq = SEQ.with(|s| {
            s.set(s.get() + 1);
            s.get()
        });
        Command::Write { owner: 1, epoch: 1, seq, first, hashes, expect, data: None }
    }

    fn geometry() -> Geometry {
        Geometry::new(40 << 20, 4096, 4, 3).expect("valid")
    }

    #[test]
    fn writes_give_versions_and_hashes_and_zeros_reset_them() {
        let mut s = BlockService::new(geometry());
        assert_eq!(run(&mut s, write(10, vec![[1; 32], [2; 32]], None)), Reply::Written { version: 1 });
        assert_eq!(
            run(&mut s, Command::Meta { first: 9, count: 3 }),
            Reply::Meta(vec![(0, s.read().zero()), (1, [1; 32]), (1, [2; 32])])
        );
        assert_eq!(run(&mut s, Command::Zero { first: 11, count: 5 }), Reply::Written { version: 2 });
        let z = s.read().zero();
        assert_eq!(run(&mut s, Command::Meta { first: 10, count: 2 }), Reply::Meta(vec![(1, [1; 32]), (2, z)]));
    }

    #[test]
    fn a_conditional_write_applies_only_at_the_expected_version() {
        let mut s = BlockService::new(geometry());
        assert_eq!(run(&mut s, write(5, vec![[1; 32]], Some(0))), Reply::Written { version: 1 });
        assert_eq!(run(&mut s, write(5, vec![[2; 32]], Some(0))), Reply::Moved { version: 1 });
        assert_eq!(s.read().get(5), (1, [1; 32]));
        assert_eq!(run(&mut s, write(5, vec![[2; 32]], Some(1))), Reply::Written { version: 2 });
    }

    #[test]
    fn a_new_epoch_fences_the_older_epochs_writes() {
        let mut s = BlockService::new(geometry());
        assert_eq!(run(&mut s, Command::NewEpoch { owner: 1, after: None }), Reply::Epoch(1));
        assert_eq!(run(&mut s, write(5, vec![[1; 32]], None)), Reply::Written { version: 1 });
        assert_eq!(run(&mut s, Command::NewEpoch { owner: 1, after: None }), Reply::Epoch(2));
        assert_eq!(run(&mut s, write(5, vec![[2; 32]], None)), Reply::Fenced);
        assert_eq!(s.read().get(5), (1, [1; 32]));
        let newer =
            Command::Write { owner: 1, epoch: 2, seq: 9, first: 5, hashes: vec![[3; 32]], expect: None, data: None };
        assert_eq!(run(&mut s, newer), Reply::Written { version: 2 });
    }

    fn run_at(s: &mut BlockService, c: Command, time: u64) -> Reply {
        Reply::decode(&s.execute(&c.encode(), &ExecCtx::new(Seq(1), time, 7, ClientId(1)))).expect("reply")
    }

    fn tick(s: &mut BlockService, time: u64) {
        s.on_tick(&ExecCtx::new(Seq(1), time, 7, ClientId(0)));
    }

    fn write_in(epoch: u64, seq: u64) -> Command {
        Command::Write { owner: 1, epoch, seq, first: 5, hashes: vec![[seq as u8; 32]], expect: None, data: None }
    }

    #[test]
    fn a_tick_ends_the_epoch_of_a_front_end_idle_for_a_while_and_only_once() {
        let mut s = BlockService::new(geometry()).with_idle_ms(1_000);
        assert_eq!(run_at(&mut s, Command::NewEpoch { owner: 1, after: None }, 0), Reply::Epoch(1));
        assert_eq!(run_at(&mut s, write_in(1, 1), 500), Reply::Written { version: 1 });
        // Owner 2 renewed and went quiet at once; owner 1 wrote later.
        assert_eq!(run_at(&mut s, Command::NewEpoch { owner: 2, after: None }, 100), Reply::Epoch(1));
        tick(&mut s, 1_499);
        assert_eq!((s.read().epoch(1), s.read().epoch(2)), (1, 2), "owner 2 idle 1399 ms, owner 1 999 ms");
        tick(&mut s, 1_500);
        assert_eq!((s.read().epoch(1), s.read().epoch(2)), (2, 2));
        // An ended epoch is not ended again while its front end stays away.
        tick(&mut s, 60_000);
        assert_eq!((s.read().epoch(1), s.read().epoch(2)), (2, 2));
        assert_eq!(run_at(&mut s, write_in(1, 2), 60_001), Reply::Fenced);
        assert_eq!(s.read().get(5).0, 1, "a fenced write changes nothing");
    }

    #[test]
    fn writes_fenced_together_renew_their_epoch_once() {
        let mut s = BlockService::new(geometry()).with_idle_ms(1_000);
        assert_eq!(run_at(&mut s, Command::NewEpoch { owner: 1, after: None }, 0), Reply::Epoch(1));
        tick(&mut s, 1_000);
        assert_eq!(s.read().epoch(1), 2);
        // Two writes of epoch 1 fenced: each renews from 1 and both get the epoch the
        // tick began, so neither renewal fences the other's retry.
        for seq in [1, 2] {
            assert_eq!(run_at(&mut s, write_in(1, seq), 1_100), Reply::Fenced);
            let renew = Command::NewEpoch { owner: 1, after: Some(1) };
            assert_eq!(run_at(&mut s, renew, 1_200), Reply::Epoch(2));
        }
        assert_eq!(run_at(&mut s, write_in(2, 3), 1_300), Reply::Written { version: 1 });
        // A front end that gave up on a write of its current epoch moves past it.
        assert_eq!(run_at(&mut s, Command::NewEpoch { owner: 1, after: Some(2) }, 1_400), Reply::Epoch(3));
        assert_eq!(run_at(&mut s, write_in(2, 4), 1_500), Reply::Fenced);
        // The renewal counts as activity: no tick ends epoch 3 before 2,400.
        tick(&mut s, 2_399);
        assert_eq!(s.read().epoch(1), 3);
    }

    #[test]
    fn which_front_ends_are_idle_survives_a_snapshot() {
        let mut s = BlockService::new(geometry()).with_idle_ms(1_000);
        run_at(&mut s, Command::NewEpoch { owner: 1, after: None }, 0);
        run_at(&mut s, Command::NewEpoch { owner: 2, after: None }, 800);
        let mut t = BlockService::new(geometry()).with_idle_ms(1_000);
        t.restore(&s.snapshot()).expect("restores");
        tick(&mut s, 1_000);
        tick(&mut t, 1_000);
        assert_eq!((t.read().epoch(1), t.read().epoch(2)), (2, 1));
        assert_eq!(t.snapshot(), s.snapshot());
    }

    #[test]
    fn a_snapshot_of_another_format_is_refused_by_name() {
        let s = BlockService::new(geometry());
        let mut snap = s.snapshot();
        snap[0] ^= 0xff;
        let e = BlockService::new(geometry()).restore(&snap).expect_err("another format");
        assert!(e.0.contains("format"), "{e:?}");
        assert!(BlockService::new(geometry()).restore(&snap[..3]).is_err());
    }

    #[tokio::test]
    async fn a_restore_stores_what_its_prepare_data_holds_and_drops_ended_epochs() {
        let dir = tempfile::tempdir().expect("tempdir");
        let g = geometry();
        let local = Arc::new(Local::open(dir.path(), g, NodeId(0), 0, 0.1, true).expect("opens"));
        let prepared = |owner: u32, first: u64, fill: u8| {
            let data = vec![fill; 4096];
            let hashes = vec![*blake3::hash(&data).as_bytes()];
            crate::local::Prepare { owner: NodeId(owner), epoch: 1, seq: 1, first, hashes, data }
        };
        let (mine, theirs) = (prepared(2, 0, 7), prepared(3, 1, 8));
        // The same bytes for the same block, as a write not ordered yet.
        let again = crate::local::Prepare { seq: 2, ..mine.clone() };
        local.prepare(mine.clone()).await.expect("takes it");
        local.prepare(again).await.expect("takes it");
        local.prepare(theirs.clone()).await.expect("takes it");
        // The cluster ordered owner 2's write and ended owner 3's epoch 1; this node
        // executed neither: it takes the state from a peer.
        let mut cluster = BlockService::new(g);
        assert_eq!(run(&mut cluster, Command::NewEpoch { owner: 2, after: None }), Reply::Epoch(1));
        let write = Command::Write {
            owner: 2,
            epoch: 1,
            seq: 1,
            first: 0,
            hashes: mine.hashes.clone(),
            expect: None,
            data: None,
        };
        assert_eq!(run(&mut cluster, write), Reply::Written { version: 1 });
        run(&mut cluster, Command::NewEpoch { owner: 3, after: None });
        run(&mut cluster, Command::NewEpoch { owner: 3, after: None });
        let mut node = BlockService::with_local(Arc::new(RwLock::new(Meta::new(g))), local.clone());
        node.restore(&cluster.snapshot()).expect("restores");
        let (data, held) = local.read(0, 1).expect("reads");
        assert_eq!((data, held), (mine.data.clone(), vec![1]), "block 0 COMPLETE here at version 1");
        assert_eq!(local.stats.restored_from_prepared.load(std::sync::atomic::Ordering::Relaxed), 1);
        assert!(!local.has_prepared(NodeId(2), 1, 1), "consumed: the restored state executed its write");
        assert!(local.has_prepared(NodeId(2), 1, 2), "kept: a matching hash does not prove its write was ordered");
        assert_eq!(
            local.prepare(mine.clone()).await,
            Err(crate::local::Refused::Executed),
            "and a late copy is refused"
        );
        assert!(!local.has_prepared(NodeId(3), 1, 1), "its epoch ended in the restored state");
        assert_eq!(local.read(1, 1).expect("reads").1, vec![0], "block 1 was never written");
    }

    /// After a crash the held versions and the data are only as durable as the last
    /// sync made them, and the kernel may write back the held version ahead of the data:
    /// a restart repairs such a block from its logged PrepareData instead of trusting it.
    #[tokio::test]
    async fn a_restart_repairs_a_block_whose_held_version_outran_its_data() {
        let dir = tempfile::tempdir().expect("tempdir");
        let g = geometry();
        let data = vec![6u8; 4096];
        let hashes = vec![*blake3::hash(&data).as_bytes()];
        let write =
            Command::Write { owner: 2, epoch: 1, seq: 1, first: 4, hashes: hashes.clone(), expect: None, data: None };
        let snapshot = {
            let local = Arc::new(Local::open(dir.path(), g, NodeId(0), 0, 0.1, true).expect("opens"));
            let prepare =
                crate::local::Prepare { owner: NodeId(2), epoch: 1, seq: 1, first: 4, hashes, data: data.clone() };
            local.prepare(prepare).await.expect("takes it");
            let mut node = BlockService::with_local(Arc::new(RwLock::new(Meta::new(g))), local.clone());
            assert_eq!(run(&mut node, Command::NewEpoch { owner: 2, after: None }), Reply::Epoch(1));
            assert_eq!(run(&mut node, write), Reply::Written { version: 1 });
            // What a power cut can leave: the held version 1 written back, the data not.
            local.store().write(4, &[0xee; 4096], 1).expect("writes");
            node.snapshot()
        };
        let local = Arc::new(Local::open(dir.path(), g, NodeId(0), 0, 0.1, true).expect("reopens"));
        let mut node = BlockService::with_local(Arc::new(RwLock::new(Meta::new(g))), local.clone());
        node.restore(&snapshot).expect("restores");
        assert_eq!(local.read(4, 1).expect("reads"), (data, vec![1]), "repaired from the log");
        assert_eq!(local.stats.restored_from_prepared.load(std::sync::atomic::Ordering::Relaxed), 1);
    }

    /// A restart looks at its logged PrepareData as the restore streams the regions past
    /// (no read of the restored store): records that cross regions, blocks whose bytes
    /// went bad at the agreed version, a block whose held version fell behind, a record
    /// never ordered — only the blocks that lack their agreed bytes are written, and with
    /// the store on disk as a node runs it.
    #[tokio::test]
    async fn a_restart_takes_from_its_records_only_the_blocks_it_lacks_across_regions() {
        let dir = tempfile::tempdir().expect("tempdir");
        let g = geometry();
        let bs = 4096;
        let record = |seq: u64, first: u64, count: usize| {
            let data: Vec<u8> = (0..count).flat_map(|k| vec![(seq * 16 + k as u64) as u8; bs]).collect();
            let hashes = data.chunks_exact(bs).map(|d| *blake3::hash(d).as_bytes()).collect();
            crate::local::Prepare { owner: NodeId(2), epoch: 1, seq, first, hashes, data }
        };
        // Across regions 0 and 1, across regions 1 and 2, and one never ordered.
        let (a, b, c) = (record(1, 4090, 10), record(2, 8190, 4), record(3, 100, 2));
        // A retry's record of one of a's blocks, the same bytes, never ordered: the block
        // is taken once.
        let d = crate::local::Prepare {
            seq: 4,
            first: 4091,
            hashes: a.hashes[1..2].to_vec(),
            data: a.data[bs..2 * bs].to_vec(),
            ..a.clone()
        };
        let snapshot = {
            let local = Arc::new(Local::open(dir.path(), g, NodeId(0), 0, 0.1, true).expect("opens"));
            for p in [&a, &b, &c, &d] {
                local.prepare(p.clone()).await.expect("takes it");
            }
            let mut node = BlockService::with_local(Arc::new(RwLock::new(Meta::new(g))), local.clone());
            assert_eq!(run(&mut node, Command::NewEpoch { owner: 2, after: None }), Reply::Epoch(1));
            for (p, version) in [(&a, 1), (&b, 2)] {
                let w = Command::Write {
                    owner: 2,
                    epoch: 1,
                    seq: p.seq,
                    first: p.first,
                    hashes: p.hashes.clone(),
                    expect: None,
                    data: None,
                };
                assert_eq!(run(&mut node, w), Reply::Written { version });
            }
            // What a crash can leave: other bytes at the held version, and a held
            // version behind the agreed one.
            local.store().write(4091, &[0xee; 4096], 1).expect("writes");
            local.store().write(4096, &[0xee; 4096], 1).expect("writes");
            local.store().write(8193, &[0xee; 4096], 2).expect("writes");
            local.store().write(4099, &[0xee; 4096], 0).expect("writes");
            node.snapshot()
        };
        let local = Arc::new(Local::open(dir.path(), g, NodeId(0), 0, 0.1, true).expect("reopens"));
        let meta = Meta::on_disk(g, &dir.path().join("meta")).expect("opens the store");
        let mut node = BlockService::with_local(Arc::new(RwLock::new(meta)), local.clone());
        node.restore(&snapshot).expect("restores");
        assert_eq!(local.read(4090, 10).expect("reads"), (a.data.clone(), vec![1; 10]), "a repaired");
        assert_eq!(local.read(8190, 4).expect("reads"), (b.data.clone(), vec![2; 4]), "b repaired");
        assert_eq!(local.stats.restored_from_prepared.load(std::sync::atomic::Ordering::Relaxed), 4);
        assert!(!local.has_prepared(NodeId(2), 1, 1) && !local.has_prepared(NodeId(2), 1, 2), "consumed");
        assert!(local.has_prepared(NodeId(2), 1, 3) && local.has_prepared(NodeId(2), 1, 4), "never ordered: kept");
        assert_eq!(local.read(100, 2).expect("reads").1, vec![0, 0], "and not stored");
    }

    /// With a syncer, a checkpoint whose blocks are all in logged PrepareData does not
    /// wait for the data sync; one after a write whose data came through agreement (full
    /// mode, which no record holds) does. Either way the records go once a sync covered
    /// them and two checkpoints passed.
    #[tokio::test]
    async fn a_checkpoint_waits_for_the_data_sync_only_when_no_record_holds_the_data() {
        let dir = tempfile::tempdir().expect("tempdir");
        let g = geometry();
        let local = Arc::new(
            Local::open(dir.path(), g, NodeId(0), 0, 0.1, true).and_then(Local::sync_in_background).expect("opens"),
        );
        let mut node = BlockService::with_local(Arc::new(RwLock::new(Meta::new(g))), local.clone());
        assert_eq!(run(&mut node, Command::NewEpoch { owner: 2, after: None }), Reply::Epoch(1));
        let data = vec![3u8; 4096];
        let hashes = vec![*blake3::hash(&data).as_bytes()];
        let prepare = crate::local::Prepare {
            owner: NodeId(2),
            epoch: 1,
            seq: 1,
            first: 0,
            hashes: hashes.clone(),
            data: data.clone(),
        };
        local.prepare(prepare).await.expect("takes it");
        let logged =
            Command::Write { owner: 2, epoch: 1, seq: 1, first: 0, hashes: hashes.clone(), expect: None, data: None };
        assert_eq!(run(&mut node, logged), Reply::Written { version: 1 });
        assert!(!local.syncs_inline(), "every block is in a logged record");
        let full = Command::Write { owner: 2, epoch: 1, seq: 2, first: 1, hashes, expect: None, data: Some(data) };
        assert_eq!(run(&mut node, full), Reply::Written { version: 2 });
        assert!(local.syncs_inline(), "block 1's data is in no record");
        node.snapshot();
        assert!(!local.syncs_inline(), "the checkpoint that covers it synced it first");
        node.snapshot();
        node.snapshot();
        drop(node);
        drop(local);
        let local = Local::open(dir.path(), g, NodeId(0), 0, 0.1, true).expect("reopens");
        assert!(!local.has_prepared(NodeId(2), 1, 1), "released after a sync covered it");
    }

    #[tokio::test]
    async fn every_executed_write_consumes_its_prepare_data_and_runs_once() {
        let dir = tempfile::tempdir().expect("tempdir");
        let g = geometry();
        let local = Arc::new(Local::open(dir.path(), g, NodeId(0), 0, 0.1, true).expect("opens"));
        let mut node = BlockService::with_local(Arc::new(RwLock::new(Meta::new(g))), local.clone());
        let data = vec![5u8; 4096];
        let hashes = vec![*blake3::hash(&data).as_bytes()];
        let prepare = |seq| crate::local::Prepare {
            owner: NodeId(2),
            epoch: 1,
            seq,
            first: 3,
            hashes: hashes.clone(),
            data: data.clone(),
        };
        let write = |seq, expect| Command::Write {
            owner: 2,
            epoch: 1,
            seq,
            first: 3,
            hashes: hashes.clone(),
            expect,
            data: None,
        };
        for seq in 1..=3 {
            local.prepare(prepare(seq)).await.expect("takes it");
        }
        assert_eq!(run(&mut node, write(1, None)), Reply::Written { version: 1 });
        // Moved: nothing changed, but the write is done with and so is its PrepareData.
        assert_eq!(run(&mut node, write(3, Some(0))), Reply::Moved { version: 1 });
        assert!(!local.has_prepared(NodeId(2), 1, 1) && !local.has_prepared(NodeId(2), 1, 3));
        assert!(local.has_prepared(NodeId(2), 1, 2), "not executed yet");
        assert_eq!(local.prepared_bytes(), 4096);
        // Ordered again, a write would name data its nodes consumed the first time.
        assert!(matches!(run(&mut node, write(1, None)), Reply::Invalid(e) if e.contains("executed already")));
        assert_eq!(node.read().version(), 1);
        for seq in [1, 3] {
            assert_eq!(local.prepare(prepare(seq)).await, Err(crate::local::Refused::Executed));
        }
        // A new epoch begins the record afresh: its seq 1 is another write.
        assert_eq!(run(&mut node, Command::NewEpoch { owner: 2, after: None }), Reply::Epoch(1));
        assert_eq!(run(&mut node, Command::NewEpoch { owner: 2, after: None }), Reply::Epoch(2));
        let next =
            Command::Write { owner: 2, epoch: 2, seq: 1, first: 3, hashes: hashes.clone(), expect: None, data: None };
        assert_eq!(run(&mut node, next), Reply::Written { version: 2 });
        assert_eq!(local.prepared_bytes(), 0, "epoch 1's seq 2 went with its epoch");
    }

    #[test]
    fn executed_writes_survive_a_snapshot_and_format_2_is_still_read() {
        let mut s = BlockService::new(geometry());
        assert_eq!(run(&mut s, Command::NewEpoch { owner: 1, after: None }), Reply::Epoch(1));
        let w = write(7, vec![[1; 32]], None);
        assert_eq!(run(&mut s, w.clone()), Reply::Written { version: 1 });
        let mut t = BlockService::new(geometry());
        t.restore(&s.snapshot()).expect("restores");
        assert!(matches!(run(&mut t, w), Reply::Invalid(_)), "the restored state knows it executed");
        // Format 2: the head without `executed`, then the regions.
        let meta = s.read();
        let v2 = (meta.head.geometry, meta.head.version, meta.head.epochs.clone(), meta.head.active.clone());
        let mut old = format_stamp(2);
        old.extend(postcard::to_allocvec(&v2).expect("encodes"));
        let frozen = meta.store.freeze();
        for i in 0..meta.stamps.len() {
            let len = region_len(meta.head.geometry, i);
            old.extend(frozen.region_bytes(i).unwrap_or_else(|| Region::new(len, meta.zero).encode()));
        }
        let mut u = BlockService::new(geometry());
        u.restore(&old).expect("format 2 restores");
        assert_eq!((u.read().version(), u.read().get(7)), (1, (1, [1; 32])));
        assert_eq!(u.read().executed_writes().count(), 0);
    }

    #[test]
    fn out_of_range_and_garbage_change_nothing() {
        let mut s = BlockService::new(geometry());
        let blocks = geometry().blocks;
        assert!(matches!(run(&mut s, write(blocks - 1, vec![[1; 32], [1; 32]], None)), Reply::Invalid(_)));
        assert!(matches!(run(&mut s, write(u64::MAX, vec![[1; 32]], None)), Reply::Invalid(_)));
        assert!(matches!(run(&mut s, Command::Zero { first: 0, count: 0 }), Reply::Invalid(_)));
        assert!(matches!(run(&mut s, Command::Meta { first: 0, count: META_BLOCKS_MAX + 1 }), Reply::Invalid(_)));
        let bad = Command::Write {
            owner: 1,
            epoch: 1,
            seq: 1,
            first: 0,
            hashes: vec![[1; 32]],
            expect: None,
            data: Some(vec![0; 10]),
        };
        assert!(matches!(run(&mut s, bad), Reply::Invalid(_)));
        assert!(matches!(Reply::decode(&s.execute(b"\xff\xff\xff", &ctx(1))).expect("reply"), Reply::Invalid(_)));
        assert_eq!(s.read().version(), 0);
    }

    #[test]
    fn snapshots_restore_equal_and_reuse_unchanged_regions() {
        let mut s = BlockService::new(geometry());
        run(&mut s, write(3, vec![[9; 32]], None));
        run(&mut s, Command::NewEpoch { owner: 2, after: None });
        let first = s.pieces();
        run(&mut s, write(REGION_BLOCKS as u64 * 2, vec![[8; 32]], None));
        let second = s.pieces();
        assert_eq!(first.len(), second.len());
        // Region 0 and 1 unchanged: the same pieces; region 2 and the head cut again.
        assert!(Arc::ptr_eq(&first[1], &second[1]) && Arc::ptr_eq(&first[2], &second[2]));
        assert!(!Arc::ptr_eq(&first[3], &second[3]));
        let mut t = BlockService::new(geometry());
        t.restore(&s.snapshot()).expect("restores");
        assert_eq!(t.snapshot(), s.snapshot());
        assert_eq!(t.read().get(REGION_BLOCKS as u64 * 2), (2, [8; 32]));
        assert_eq!(t.read().epoch(2), 1);
        let frozen = s.freeze().expect("freezes");
        run(&mut s, write(3, vec![[7; 32]], None));
        assert_eq!(frozen.snapshot(), t.snapshot(), "a freeze serializes the state it was taken in");
    }

    /// A node's checkpoints come from its store on disk, each region patched from its last
    /// encoding with what was written since (or scanned): through writes, zeros of runs
    /// and of whole regions, and a restore in the middle, every checkpoint's bytes are
    /// those of the same commands on a store in memory.
    #[test]
    fn checkpoints_from_the_store_on_disk_equal_those_from_memory() {
        use rand::{Rng, SeedableRng};
        let g = Geometry::new(REGION_BLOCKS as u64 * 4096 * 7 / 2, 4096, 4, 3).expect("valid");
        let dir = tempfile::tempdir().expect("tempdir");
        let on_disk = |name: &str| BlockService {
            meta: Arc::new(RwLock::new(Meta::on_disk(g, &dir.path().join(name)).expect("opens"))),
            local: None,
            cache: Arc::default(),
        };
        let mut disk = on_disk("a");
        let mut mem = BlockService::new(g);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(11);
        for round in 0..12 {
            for _ in 0..40 {
                let first = rng.gen_range(0..g.blocks);
                let command = match rng.gen_range(0..8) {
                    0 => Command::Zero {
                        first: first / REGION_BLOCKS as u64 * REGION_BLOCKS as u64,
                        count: g
                            .blocks
                            .min(REGION_BLOCKS as u64)
                            .min(g.blocks - first / REGION_BLOCKS as u64 * REGION_BLOCKS as u64),
                    },
                    1 => Command::Zero { first, count: rng.gen_range(1..=(g.blocks - first).min(300)) },
                    _ => {
                        let count = rng.gen_range(1..=(g.blocks - first).min(40));
                        write(first, (0..count).map(|_| [rng.gen_range(1..9u8); 32]).collect(), None)
                    }
                };
                assert_eq!(run(&mut disk, command.clone()), run(&mut mem, command));
            }
            // A freeze encodes the state it was taken in, whatever is written after it.
            let (frozen, frozen_mem) = (disk.freeze().expect("freezes"), mem.freeze().expect("freezes"));
            let w = write(3, vec![[42; 32]], None);
            assert_eq!(run(&mut disk, w.clone()), run(&mut mem, w));
            assert_eq!(chunk::join(&frozen.pieces()).expect("in memory"), frozen_mem.snapshot(), "round {round}");
            assert_eq!(chunk::join(&disk.pieces()).expect("in memory"), mem.snapshot(), "round {round}");
            if round == 5 {
                // A restore to a state this node never had (another node's later
                // checkpoint), while a checkpoint frozen before it is still encoding:
                // what that one caches must not be patched with the new state's writes.
                let stale = disk.freeze().expect("freezes");
                for k in 0..30 {
                    run(&mut mem, write(k * 700, vec![[77; 32]], None));
                }
                disk.restore(&mem.snapshot()).expect("restores");
                drop(stale.pieces());
            }
            if round == 8 {
                // Two checkpoints encoded in the opposite order of their freezes.
                let older = disk.freeze().expect("freezes");
                let w = write(5, vec![[43; 32]], None);
                assert_eq!(run(&mut disk, w.clone()), run(&mut mem, w));
                let newer = disk.freeze().expect("freezes");
                drop(newer.pieces());
                drop(older.pieces());
            }
        }
    }

    /// Hands out a snapshot a few bytes at a time, and fails at `fail_at` if set (a
    /// stored chunk that does not read back).
    struct Trickle<'a> {
        bytes: &'a [u8],
        at: usize,
        fail_at: Option<usize>,
    }

    impl std::io::Read for Trickle<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            if self.fail_at.is_some_and(|f| self.at >= f) {
                return Err(std::io::Error::other("chunk unreadable"));
            }
            let n = buf.len().min(7 + self.at % 13).min(self.bytes.len() - self.at);
            buf[..n].copy_from_slice(&self.bytes[self.at..self.at + n]);
            self.at += n;
            Ok(n)
        }
    }

    /// A restore streamed in small reads (a region across many chunks, the head split)
    /// rebuilds what one from the whole snapshot does, in memory and on disk; a read that
    /// fails among the regions is an error, not a state cut short taken as whole.
    #[test]
    fn a_restore_streamed_in_small_reads_equals_one_from_the_bytes() {
        let g = Geometry::new(REGION_BLOCKS as u64 * 4096 * 5 / 2, 4096, 4, 3).expect("valid");
        let mut s = BlockService::new(g);
        for (k, b) in [0, 5, REGION_BLOCKS as u64 + 1, g.blocks - 1].into_iter().enumerate() {
            run(&mut s, write(b, vec![[k as u8 + 1; 32]], None));
        }
        run(&mut s, Command::NewEpoch { owner: 2, after: None });
        let snap = s.snapshot();
        let dir = tempfile::tempdir().expect("tempdir");
        let on_disk = |name: &str| BlockService {
            meta: Arc::new(RwLock::new(Meta::on_disk(g, &dir.path().join(name)).expect("opens"))),
            local: None,
            cache: Arc::default(),
        };
        for mut t in [BlockService::new(g), on_disk("a")] {
            let mut stream = Trickle { bytes: &snap, at: 0, fail_at: None };
            t.restore_from(&mut stream, snap.len() as u64).expect("restores");
            assert_eq!(t.snapshot(), snap);
            assert_eq!(t.read().get(g.blocks - 1), s.read().get(g.blocks - 1));
        }
        for mut t in [BlockService::new(g), on_disk("b")] {
            // Past the head, in the second region.
            let mut stream = Trickle { bytes: &snap, at: 0, fail_at: Some(snap.len() - REGION_BLOCKS * 40) };
            let e = t.restore_from(&mut stream, snap.len() as u64).expect_err("the read fails");
            assert!(e.0.contains("chunk unreadable"), "{e:?}");
            // In the head: refused before anything changed.
            let mut stream = Trickle { bytes: &snap, at: 0, fail_at: Some(3) };
            assert!(t.restore_from(&mut stream, snap.len() as u64).is_err());
        }
    }

    #[test]
    fn unwritten_regions_share_one_copy_until_written_and_after_a_restore() {
        // Four regions of 4,096 blocks.
        let four = || BlockService::new(Geometry::new(64 << 20, 4096, 4, 3).expect("valid"));
        let distinct = |s: &BlockService| s.read().store.distinct_regions();
        let mut s = four();
        assert_eq!(distinct(&s), 1, "one unwritten copy");
        let pieces = s.pieces();
        assert!(pieces[1..].iter().all(|p| Arc::ptr_eq(p, &pieces[1])), "encoded once");
        run(&mut s, write(3, vec![[9; 32]], None));
        assert_eq!(distinct(&s), 2, "the written region got its own copy");
        let zero = s.read().zero();
        assert_eq!(s.read().get(REGION_BLOCKS as u64 + 3), (0, zero), "the shared copy is untouched");
        let mut t = four();
        t.restore(&s.snapshot()).expect("restores");
        assert_eq!(distinct(&t), 2, "a restore shares the regions still unwritten");
        assert_eq!(t.snapshot(), s.snapshot());
        assert_eq!(t.read().get(3), (1, [9; 32]));
    }

    #[test]
    fn a_region_is_stamped_by_the_writes_into_it_and_a_restore_stamps_them_all() {
        let mut s = BlockService::new(geometry());
        let far = REGION_BLOCKS as u64 * 2;
        run(&mut s, write(3, vec![[9; 32]], None));
        run(&mut s, write(far, vec![[8; 32]], None));
        run(&mut s, Command::NewEpoch { owner: 2, after: None });
        run(&mut s, Command::Meta { first: 3, count: 1 });
        assert_eq!([s.read().stamp(0), s.read().stamp(1), s.read().stamp(2)], [1, 0, 2]);
        run(&mut s, Command::Zero { first: 5, count: 1 });
        assert_eq!([s.read().stamp(0), s.read().stamp(1), s.read().stamp(2)], [3, 0, 2]);
        let mut t = BlockService::new(geometry());
        t.restore(&s.snapshot()).expect("restores");
        assert_eq!([t.read().stamp(0), t.read().stamp(1), t.read().stamp(2)], [3, 3, 3]);
    }

    #[test]
    fn a_snapshot_of_another_shape_or_cut_short_is_refused() {
        let s = BlockService::new(geometry());
        let mut other = BlockService::new(Geometry::new(8 << 20, 4096, 4, 3).expect("valid"));
        assert!(other.restore(&s.snapshot()).is_err());
        let mut same = BlockService::new(geometry());
        let snap = s.snapshot();
        assert!(same.restore(&snap[..snap.len() - 1]).is_err());
        let mut longer = snap.clone();
        longer.push(0);
        assert!(same.restore(&longer).is_err());
    }
}
