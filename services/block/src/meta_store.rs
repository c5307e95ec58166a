//! Where the agreed per-block metadata lives: block -> (version, hash), 40 bytes a block.
//!
//! A node keeps it in a log-structured key-value store on its disk (fjall, as Gnothi
//! §3.6 keeps its metadata in an LSM store), not on its heap: 40 bytes a block is 10 MiB
//! per GiB of export, 10 GiB per TiB. The store is a copy of agreed state, not a source
//! of it: the node's checkpoints and WAL make that state durable, so the store's own
//! journal is never synced, and at every start the store is wiped and rebuilt by the
//! restore and the replay the node runs anyway. A torn store is never read.
//!
//! Tests, the simulator and metadata-only services keep it in memory instead
//! (`MetaStore::memory`); both answer every question the same way, block for block
//! (`both_stores_answer_alike` below), and a checkpoint encodes both the same.
//!
//! A read that fails under a node (an I/O error, a corrupt table) stops the node: the
//! execution of an agreed write cannot be skipped or half done, and a restart rebuilds
//! the store from the snapshot and WAL.

use crate::geometry::Geometry;
use fjall::{Database, Keyspace, KeyspaceCreateOptions, OwnedWriteBatch, Readable, Snapshot};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

/// A block's data hash.
pub type Hash = [u8; 32];

/// Blocks per region: the unit of copy-on-write and of incremental checkpoints (a
/// region's piece is serialized again only after a write into it).
pub const REGION_BLOCKS: usize = 4096;

/// Entries per fjall batch when a long run is written or zeroed, so that a batch's own
/// memory stays small whatever the command's length.
const BATCH_ENTRIES: usize = 16_384;

/// One region's metadata, as a checkpoint encodes it: every version, then every hash.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Region {
    pub versions: Vec<u64>,
    pub hashes: Vec<Hash>,
}

impl Region {
    pub fn new(len: usize, zero: Hash) -> Region {
        Region { versions: vec![0; len], hashes: vec![zero; len] }
    }

    /// Whether no block of it was ever written or zeroed (every version 0).
    pub fn untouched(&self) -> bool {
        self.versions.iter().all(|&v| v == 0)
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.versions.len() * 40);
        for v in &self.versions {
            out.extend_from_slice(&v.to_le_bytes());
        }
        for h in &self.hashes {
            out.extend_from_slice(h);
        }
        out
    }

    /// A region from its encoding; `bytes` must be 40 bytes per block (the caller checks
    /// the length, the one thing an encoding can get wrong).
    pub fn decode(bytes: &[u8]) -> Region {
        let len = bytes.len() / 40;
        let (vs, hs) = bytes.split_at(len * 8);
        let versions = vs.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default())).collect();
        let hashes = hs.chunks_exact(32).map(|c| c.try_into().unwrap_or_default()).collect();
        Region { versions, hashes }
    }
}

/// The per-block metadata of one node.
pub(crate) struct MetaStore {
    geometry: Geometry,
    zero: Hash,
    kind: Kind,
}

enum Kind {
    /// Per region, its blocks; never-written regions share one copy per length, copied
    /// on their first write (`Arc::make_mut`, as the freeze relies on).
    Memory(Vec<Arc<Region>>),
    Disk(Disk),
}

/// The store on disk: one key per block ever written (its number, big-endian, so a range
/// of keys is a range of blocks), value its version (8 bytes, little-endian) and, unless
/// it is the zero hash, its hash. A block without a key is at version 0 (never written),
/// or at its region's `zeroed` version.
struct Disk {
    db: Database,
    blocks: Keyspace,
    /// Bumped at every restore, which starts a fresh keyspace (`blocks-N`): the old one
    /// goes once a checkpoint still reading it lets go.
    generation: u64,
    /// Per region, the version of the last zeroing that covered it whole (0: none). Its
    /// keys were removed then, so a TRIM of a whole disk (mkfs discards it) costs a
    /// number per region and the removal of what was written, not an entry per block.
    zeroed: Vec<u64>,
    changes: Arc<Mutex<Changes>>,
}

/// What was written since each region's last encoding, so that a checkpoint re-encodes
/// a region by patching that encoding (read back from the snapshot that holds it) with a
/// few entries, not by a scan of the region's 4,096 keys: random writes over a full
/// disk touch every region between two checkpoints, and scanning all of them halved a
/// (1, 0) cluster's 4 KiB writes (session 48).
#[derive(Default)]
pub(crate) struct Changes {
    /// The version the list starts at (the restore's): an encoding older than it was
    /// made of another state, and cannot be patched.
    from: u64,
    /// Per region, (block, version, hash) in the order executed.
    writes: BTreeMap<usize, Vec<(u64, u64, Hash)>>,
    /// Per region, the version of a change not listed (a zeroing of it whole, or a list
    /// grown past `REGION_BLOCKS`): its next encoding at or after that version scans.
    rescan: BTreeMap<usize, u64>,
}

impl Changes {
    fn wrote(&mut self, b: u64, version: u64, hash: Hash) {
        let region = (b / REGION_BLOCKS as u64) as usize;
        let list = self.writes.entry(region).or_default();
        list.push((b, version, hash));
        // A region written all over since its last encoding is as cheap to scan: the
        // list stays bounded whatever stops the checkpoints.
        if list.len() > REGION_BLOCKS {
            self.writes.remove(&region);
            self.rescan(region, version);
        }
    }

    fn rescan(&mut self, region: usize, version: u64) {
        let at = self.rescan.entry(region).or_insert(version);
        *at = (*at).max(version);
    }

    /// Region `region`'s encoding at `version` from its encoding `base` at version
    /// `since`, or `None` if the list cannot give it.
    fn patch(&self, region: usize, base: &[u8], since: u64, version: u64) -> Option<Vec<u8>> {
        if self.rescan.get(&region).is_some_and(|&at| at > since) || since > version || since < self.from {
            return None;
        }
        let len = base.len() / 40;
        let start = region as u64 * REGION_BLOCKS as u64;
        let mut out = base.to_vec();
        for &(b, v, hash) in self.writes.get(&region).into_iter().flatten() {
            if v > since && v <= version {
                let at = usize::try_from(b - start).ok().filter(|&at| at < len)?;
                out[at * 8..at * 8 + 8].copy_from_slice(&v.to_le_bytes());
                out[len * 8 + at * 32..len * 8 + at * 32 + 32].copy_from_slice(&hash);
            }
        }
        Some(out)
    }

    /// Region `region` is encoded at `version`: what that encoding holds is forgotten.
    fn encoded(&mut self, region: usize, version: u64) {
        if let Some(list) = self.writes.get_mut(&region) {
            list.retain(|&(_, v, _)| v > version);
            if list.is_empty() {
                self.writes.remove(&region);
            }
        }
        if self.rescan.get(&region).is_some_and(|&at| at <= version) {
            self.rescan.remove(&region);
        }
    }
}

/// The failure of a store that holds agreed state: the node cannot execute on, so it
/// stops; a restart rebuilds the store (see the module's comment).
fn fail(what: &str, e: &fjall::Error) -> ! {
    tracing::error!(error = %e, "block metadata store: {what} failed; the node stops (a restart rebuilds the store)");
    eprintln!("block metadata store: {what} failed: {e}; the node stops (a restart rebuilds the store)");
    std::process::exit(74)
}

fn key(b: u64) -> [u8; 8] {
    b.to_be_bytes()
}

fn value(version: u64, hash: &Hash, zero: &Hash) -> Vec<u8> {
    let mut v = version.to_le_bytes().to_vec();
    if hash != zero {
        v.extend_from_slice(hash);
    }
    v
}

/// A stored entry back: `None` if it is not one this module wrote (a corrupt store).
fn entry(key: &[u8], value: &[u8], zero: &Hash) -> Option<(u64, u64, Hash)> {
    let b = u64::from_be_bytes(key.try_into().ok()?);
    let version = u64::from_le_bytes(value.get(..8)?.try_into().ok()?);
    let hash = match value.len() {
        8 => *zero,
        40 => value[8..].try_into().ok()?,
        _ => return None,
    };
    Some((b, version, hash))
}

fn keyspace(db: &Database, generation: u64) -> fjall::Result<Keyspace> {
    // Small memtables: what they hold is on the heap, which this store exists to spare.
    db.keyspace(&format!("blocks-{generation}"), || KeyspaceCreateOptions::default().max_memtable_size(4 << 20))
}

impl MetaStore {
    /// Every block at version 0, in memory.
    pub fn memory(geometry: Geometry, zero: Hash) -> MetaStore {
        MetaStore { geometry, zero, kind: Kind::Memory(unwritten_regions(geometry, zero)) }
    }

    /// Every block at version 0, in a store at `dir`, wiped first.
    ///
    /// # Errors
    /// The directory cannot be emptied, or the store not created in it.
    pub fn open(dir: &Path, geometry: Geometry, zero: Hash) -> Result<MetaStore, String> {
        match std::fs::remove_dir_all(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("wiping {}: {e}", dir.display())),
        }
        let db = Database::builder(dir)
            .cache_size(8 << 20)
            .manual_journal_persist(true)
            .max_journaling_size(64 << 20)
            .worker_threads(1)
            .open()
            .map_err(|e| format!("opening {}: {e}", dir.display()))?;
        let blocks = keyspace(&db, 0).map_err(|e| format!("creating the block keyspace: {e}"))?;
        let zeroed = vec![0; regions(geometry)];
        let changes = Arc::default();
        Ok(MetaStore { geometry, zero, kind: Kind::Disk(Disk { db, blocks, generation: 0, zeroed, changes }) })
    }

    /// Block `b`'s (version, hash); `b` must be in range.
    pub fn get(&self, b: u64) -> (u64, Hash) {
        let region = (b / REGION_BLOCKS as u64) as usize;
        match &self.kind {
            Kind::Memory(regions) => {
                let r = &regions[region];
                let i = (b % REGION_BLOCKS as u64) as usize;
                (r.versions[i], r.hashes[i])
            }
            Kind::Disk(d) => {
                let stored = d.blocks.get(key(b)).unwrap_or_else(|e| fail("a read", &e));
                let found = stored.map(|v| entry(&key(b), &v, &self.zero).unwrap_or_else(|| corrupt(b)));
                self.or_zeroed(found, d.zeroed[region])
            }
        }
    }

    /// The (version, hash) of blocks `first..first + count` (in range): on disk one scan.
    pub fn get_run(&self, first: u64, count: u64) -> Vec<(u64, Hash)> {
        match &self.kind {
            Kind::Memory(_) => (first..first + count).map(|b| self.get(b)).collect(),
            Kind::Disk(d) => {
                let mut out: Vec<(u64, Hash)> = (first..first + count)
                    .map(|b| self.or_zeroed(None, d.zeroed[(b / REGION_BLOCKS as u64) as usize]))
                    .collect();
                for guard in d.blocks.range(key(first)..key(first + count)) {
                    let (k, v) = guard.into_inner().unwrap_or_else(|e| fail("a scan", &e));
                    let Some((b, version, hash)) = entry(&k, &v, &self.zero) else { corrupt(first) };
                    let zr = d.zeroed[(b / REGION_BLOCKS as u64) as usize];
                    out[(b - first) as usize] = self.or_zeroed(Some((b, version, hash)), zr);
                }
                out
            }
        }
    }

    /// What a block holds given its entry (if any) and its region's zeroing.
    fn or_zeroed(&self, found: Option<(u64, u64, Hash)>, zeroed: u64) -> (u64, Hash) {
        match found {
            Some((_, version, hash)) if version > zeroed => (version, hash),
            _ => (zeroed, self.zero),
        }
    }

    /// Blocks `first..first + hashes.len()` (in range) get `version` and these hashes.
    pub fn set_run(&mut self, first: u64, version: u64, hashes: &[Hash]) {
        match &mut self.kind {
            Kind::Memory(regions) => {
                for (k, h) in hashes.iter().enumerate() {
                    set_in_memory(regions, first + k as u64, version, *h);
                }
            }
            Kind::Disk(d) => {
                let entries = hashes.iter().enumerate().map(|(k, h)| (first + k as u64, value(version, h, &self.zero)));
                d.insert_all(entries);
                let mut changes = d.lock_changes();
                for (k, h) in hashes.iter().enumerate() {
                    changes.wrote(first + k as u64, version, *h);
                }
            }
        }
    }

    /// Blocks `first..first + count` (in range) read as zeros from `version` on.
    pub fn zero(&mut self, first: u64, count: u64, version: u64) {
        let zero = self.zero;
        let geometry = self.geometry;
        match &mut self.kind {
            Kind::Memory(regions) => {
                for b in first..first + count {
                    set_in_memory(regions, b, version, zero);
                }
            }
            Kind::Disk(d) => {
                let end = first + count;
                let mut b = first;
                while b < end {
                    let region = (b / REGION_BLOCKS as u64) as usize;
                    let start = region as u64 * REGION_BLOCKS as u64;
                    let region_end = start + region_len(geometry, region) as u64;
                    let stop = region_end.min(end);
                    if b == start && stop == region_end {
                        d.zero_region(region, start, region_end, version);
                        d.lock_changes().rescan(region, version);
                    } else {
                        d.insert_all((b..stop).map(|b| (b, value(version, &zero, &zero))));
                        let mut changes = d.lock_changes();
                        for b in b..stop {
                            changes.wrote(b, version, zero);
                        }
                    }
                    b = stop;
                }
            }
        }
    }

    /// How many distinct copies of regions a memory store holds (tests: unwritten ones
    /// share one).
    #[cfg(test)]
    pub fn distinct_regions(&self) -> usize {
        match &self.kind {
            Kind::Memory(regions) => {
                let mut at: Vec<*const Region> = regions.iter().map(Arc::as_ptr).collect();
                at.sort_unstable();
                at.dedup();
                at.len()
            }
            Kind::Disk(_) => 0,
        }
    }

    /// A consistent copy to encode from later: writes after it do not show in it.
    pub fn freeze(&self) -> FrozenStore {
        match &self.kind {
            Kind::Memory(regions) => FrozenStore::Memory(regions.clone()),
            Kind::Disk(d) => FrozenStore::Disk {
                snapshot: d.db.snapshot(),
                blocks: d.blocks.clone(),
                zeroed: d.zeroed.clone(),
                changes: d.changes.clone(),
                geometry: self.geometry,
                zero: self.zero,
            },
        }
    }

    /// Replaces every block's metadata with `regions`, one per region in order (their
    /// lengths checked by the caller), the state at `version`.
    pub fn restore(&mut self, regions: impl Iterator<Item = Region>, version: u64) {
        let zero = self.zero;
        let geometry = self.geometry;
        match &mut self.kind {
            Kind::Memory(stored) => {
                let mut fresh = unwritten_regions(geometry, zero);
                for (slot, decoded) in fresh.iter_mut().zip(regions) {
                    // A region still unwritten keeps sharing the fresh copy.
                    if decoded != **slot {
                        *slot = Arc::new(decoded);
                    }
                }
                *stored = fresh;
            }
            Kind::Disk(d) => {
                d.fresh_keyspace(version);
                // The keyspace is empty and the blocks come in order: one bulk load
                // writes its tables directly, without the memtable and journal a batch of
                // inserts goes through.
                let mut ingest = d.blocks.start_ingestion().unwrap_or_else(|e| fail("a restore", &e));
                for (i, region) in regions.enumerate() {
                    let start = i as u64 * REGION_BLOCKS as u64;
                    // A region zeroed whole, all at one version, is a number again.
                    let v = region.versions.first().copied().unwrap_or(0);
                    if v > 0 && region.versions.iter().all(|&w| w == v) && region.hashes.iter().all(|h| *h == zero) {
                        d.zeroed[i] = v;
                        continue;
                    }
                    for (k, (&v, h)) in region.versions.iter().zip(&region.hashes).enumerate() {
                        if v > 0 {
                            let b = start + k as u64;
                            ingest.write(key(b), value(v, h, &zero)).unwrap_or_else(|e| fail("a restore", &e));
                        }
                    }
                }
                ingest.finish().unwrap_or_else(|e| fail("a restore", &e));
            }
        }
    }
}

fn corrupt(b: u64) -> ! {
    tracing::error!(block = b, "block metadata store: an entry it did not write; the node stops");
    eprintln!("block metadata store: a corrupt entry near block {b}; the node stops (a restart rebuilds the store)");
    std::process::exit(74)
}

/// Every region of a fresh disk in memory: those of one length share one copy.
fn unwritten_regions(geometry: Geometry, zero: Hash) -> Vec<Arc<Region>> {
    let mut unwritten: std::collections::BTreeMap<usize, Arc<Region>> = Default::default();
    (0..regions(geometry))
        .map(|i| {
            let len = region_len(geometry, i);
            unwritten.entry(len).or_insert_with(|| Arc::new(Region::new(len, zero))).clone()
        })
        .collect()
}

fn regions(geometry: Geometry) -> usize {
    geometry.blocks.div_ceil(REGION_BLOCKS as u64) as usize
}

/// Blocks in region `i` (the last may be shorter).
pub(crate) fn region_len(geometry: Geometry, i: usize) -> usize {
    let start = i as u64 * REGION_BLOCKS as u64;
    (geometry.blocks - start).min(REGION_BLOCKS as u64) as usize
}

fn set_in_memory(regions: &mut [Arc<Region>], b: u64, version: u64, hash: Hash) {
    let r = Arc::make_mut(&mut regions[(b / REGION_BLOCKS as u64) as usize]);
    let i = (b % REGION_BLOCKS as u64) as usize;
    r.versions[i] = version;
    r.hashes[i] = hash;
}

impl Disk {
    fn lock_changes(&self) -> std::sync::MutexGuard<'_, Changes> {
        self.changes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn insert_all(&self, entries: impl Iterator<Item = (u64, Vec<u8>)>) {
        let mut batch: Option<OwnedWriteBatch> = None;
        for (b, v) in entries {
            let bt = batch.get_or_insert_with(|| self.db.batch());
            bt.insert(&self.blocks, key(b), v);
            if bt.len() >= BATCH_ENTRIES {
                self.commit(batch.take());
            }
        }
        self.commit(batch);
    }

    fn commit(&self, batch: Option<OwnedWriteBatch>) {
        if let Some(batch) = batch {
            batch.commit().unwrap_or_else(|e| fail("a write", &e));
        }
    }

    /// Region `region` (blocks `start..end`) zeroed whole at `version`: its keys go.
    fn zero_region(&mut self, region: usize, start: u64, end: u64, version: u64) {
        self.zeroed[region] = version;
        let mut batch: Option<OwnedWriteBatch> = None;
        for guard in self.blocks.range(key(start)..key(end)) {
            let k = guard.key().unwrap_or_else(|e| fail("a scan", &e));
            let bt = batch.get_or_insert_with(|| self.db.batch());
            bt.remove(&self.blocks, k);
            if bt.len() >= BATCH_ENTRIES {
                self.commit(batch.take());
            }
        }
        self.commit(batch);
    }

    /// Starts an empty keyspace and lets the old one go (a checkpoint still reading it
    /// keeps it until it is done).
    fn fresh_keyspace(&mut self, version: u64) {
        let next = keyspace(&self.db, self.generation + 1).unwrap_or_else(|e| fail("a new keyspace", &e));
        let old = std::mem::replace(&mut self.blocks, next);
        self.generation += 1;
        self.db.delete_keyspace(old).unwrap_or_else(|e| fail("dropping the old keyspace", &e));
        self.zeroed.iter_mut().for_each(|z| *z = 0);
        // A checkpoint frozen before keeps the old list; the new one patches only
        // encodings of the restored state or later.
        self.changes = Arc::new(Mutex::new(Changes { from: version, ..Changes::default() }));
    }
}

/// The store as it was at a freeze.
pub(crate) enum FrozenStore {
    Memory(Vec<Arc<Region>>),
    Disk {
        snapshot: Snapshot,
        blocks: Keyspace,
        zeroed: Vec<u64>,
        changes: Arc<Mutex<Changes>>,
        geometry: Geometry,
        zero: Hash,
    },
}

impl FrozenStore {
    /// Region `i`'s encoding as it was at the freeze, or `None` if no block of it was
    /// ever written or zeroed (the caller encodes that region once per length).
    pub fn region_bytes(&self, i: usize) -> Option<Vec<u8>> {
        match self {
            FrozenStore::Memory(regions) => (!regions[i].untouched()).then(|| regions[i].encode()),
            FrozenStore::Disk { snapshot, blocks, zeroed, geometry, zero, .. } => {
                let len = region_len(*geometry, i);
                let start = i as u64 * REGION_BLOCKS as u64;
                let mut region = Region { versions: vec![zeroed[i]; len], hashes: vec![*zero; len] };
                for guard in snapshot.range(blocks, key(start)..key(start + len as u64)) {
                    let (k, v) = guard.into_inner().unwrap_or_else(|e| fail("a checkpoint's scan", &e));
                    let Some((b, version, hash)) = entry(&k, &v, zero) else { corrupt(start) };
                    let at = (b - start) as usize;
                    if version > zeroed[i] {
                        region.versions[at] = version;
                        region.hashes[at] = hash;
                    }
                }
                (!region.untouched()).then(|| region.encode())
            }
        }
    }

    /// Region `i`'s encoding for a checkpoint of the freeze, which was at `version`,
    /// given the region's last encoding `base` and the version it was made at; `None` if
    /// no block of it was ever written. On disk `base` is patched with what was written
    /// between, where the store kept that list, and the region is scanned otherwise; what
    /// the list held up to `version` is forgotten then (`base` for the next checkpoint is
    /// this encoding).
    pub fn encode_region(&self, i: usize, base: Option<(&[u8], u64)>, version: u64) -> Option<Vec<u8>> {
        let FrozenStore::Disk { changes, .. } = self else { return self.region_bytes(i) };
        let patched = base.and_then(|(base, since)| {
            changes.lock().unwrap_or_else(PoisonError::into_inner).patch(i, base, since, version)
        });
        let bytes = patched.or_else(|| self.region_bytes(i));
        changes.lock().unwrap_or_else(PoisonError::into_inner).encoded(i, version);
        bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// 3.5 regions: the last one shorter, as an export's last region may be.
    fn geometry() -> Geometry {
        Geometry::new(REGION_BLOCKS as u64 * 7 / 2 * 512, 512, 4, 3).expect("valid")
    }

    fn frozen_bytes(f: &FrozenStore, g: Geometry) -> Vec<Option<Vec<u8>>> {
        (0..regions(g)).map(|i| f.region_bytes(i)).collect()
    }

    fn assert_alike(mem: &MetaStore, disk: &MetaStore, g: Geometry, rng: &mut ChaCha8Rng) {
        for b in 0..g.blocks {
            assert_eq!(mem.get(b), disk.get(b), "block {b}");
        }
        for _ in 0..20 {
            let first = rng.gen_range(0..g.blocks);
            let count = rng.gen_range(1..=(g.blocks - first).min(9_000));
            assert_eq!(mem.get_run(first, count), disk.get_run(first, count), "run {first}+{count}");
        }
        assert_eq!(frozen_bytes(&mem.freeze(), g), frozen_bytes(&disk.freeze(), g));
    }

    /// The memory store is what the simulator checks; the disk store is what a node runs.
    /// Random writes, partial and whole-region zeros, freezes read after later writes, and
    /// restores: block for block, run for run and region encoding for region encoding the
    /// same.
    #[test]
    fn both_stores_answer_alike() {
        let g = geometry();
        let zero = [0xee; 32];
        let dir = tempfile::tempdir().expect("tempdir");
        let mut mem = MetaStore::memory(g, zero);
        let mut disk = MetaStore::open(&dir.path().join("meta"), g, zero).expect("opens");
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut version = 0;
        for round in 0..6 {
            let frozen = (mem.freeze(), disk.freeze());
            let before = frozen_bytes(&frozen.0, g);
            for _ in 0..200 {
                version += 1;
                let first = rng.gen_range(0..g.blocks);
                match rng.gen_range(0..10) {
                    0 => {
                        // Whole regions (and the tail): a number per region on disk.
                        let region = rng.gen_range(0..regions(g) as u64);
                        let start = region * REGION_BLOCKS as u64;
                        let count = (g.blocks - start).min(REGION_BLOCKS as u64 * rng.gen_range(1..3));
                        mem.zero(start, count, version);
                        disk.zero(start, count, version);
                    }
                    1 => {
                        let count = rng.gen_range(1..=(g.blocks - first).min(5_000));
                        mem.zero(first, count, version);
                        disk.zero(first, count, version);
                    }
                    _ => {
                        let count = rng.gen_range(1..=(g.blocks - first).min(64));
                        let hashes: Vec<Hash> = (0..count).map(|_| [rng.gen_range(0..4u8); 32]).collect();
                        mem.set_run(first, version, &hashes);
                        disk.set_run(first, version, &hashes);
                    }
                }
            }
            assert_eq!(frozen_bytes(&frozen.0, g), before, "a memory freeze does not move");
            assert_eq!(frozen_bytes(&frozen.1, g), before, "a disk freeze does not move");
            assert_alike(&mem, &disk, g, &mut rng);
            if round % 2 == 1 {
                // Restore each from the other's encoding, with a freeze still open.
                let open = disk.freeze();
                let held = frozen_bytes(&open, g);
                let encoded: Vec<Region> = (0..regions(g))
                    .map(|i| {
                        let len = region_len(g, i);
                        mem.freeze().region_bytes(i).map_or_else(|| Region::new(len, zero), |b| Region::decode(&b))
                    })
                    .collect();
                disk.restore(encoded.clone().into_iter(), version);
                mem.restore(encoded.into_iter(), version);
                assert_eq!(frozen_bytes(&open, g), held, "a freeze outlives a restore");
                assert_alike(&mem, &disk, g, &mut rng);
            }
        }
        assert!(mem.get_run(0, g.blocks).iter().any(|&(v, _)| v > 0), "the run wrote something");
    }

    /// A whole-region zero on disk is a number and no keys, and a restore gives it back
    /// the same way: a TRIM of the whole disk does not write an entry per block.
    #[test]
    fn a_region_zeroed_whole_holds_no_keys() {
        let g = geometry();
        let zero = [0; 32];
        let dir = tempfile::tempdir().expect("tempdir");
        let mut disk = MetaStore::open(&dir.path().join("meta"), g, zero).expect("opens");
        disk.set_run(5, 1, &[[1; 32]; 10]);
        disk.zero(0, g.blocks, 2);
        let Kind::Disk(d) = &disk.kind else { unreachable!() };
        assert_eq!(d.blocks.iter().count(), 0, "no keys left");
        assert_eq!(disk.get(7), (2, zero));
        assert_eq!(disk.get(g.blocks - 1), (2, zero));
        let regions: Vec<Region> =
            (0..regions(g)).map(|i| Region::decode(&disk.freeze().region_bytes(i).expect("zeroed"))).collect();
        disk.restore(regions.into_iter(), 2);
        let Kind::Disk(d) = &disk.kind else { unreachable!() };
        assert_eq!(d.blocks.iter().count(), 0, "still none after a restore");
        assert_eq!(disk.get(7), (2, zero));
    }

    /// A reopened store starts empty: what it held is rebuilt by the node's restore.
    #[test]
    fn opening_wipes_the_store() {
        let g = geometry();
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("meta");
        let mut disk = MetaStore::open(&path, g, [0; 32]).expect("opens");
        disk.set_run(1, 3, &[[4; 32]]);
        drop(disk);
        let disk = MetaStore::open(&path, g, [0; 32]).expect("reopens");
        assert_eq!(disk.get(1), (0, [0; 32]));
    }
}
