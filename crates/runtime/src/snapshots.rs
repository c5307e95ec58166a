//! Checkpoint snapshots stored as content-addressed chunks: a checkpoint writes only the
//! chunks no kept snapshot already holds.
//!
//! ```text
//!   DIR/snap/0000000000000256.snap   the manifest of the checkpoint at 256: every
//!                                    chunk's digest and place
//!   DIR/snap/0000000000000007.pack   chunks, in packs numbered in the order written
//! ```
//!
//! A checkpoint's chunks are content-defined (`keel_core::exec::Chunked`), so a state in
//! which a few keys changed shares most chunks with the previous checkpoint; writing the
//! whole state each time cost ~4 s per checkpoint at 1 GB on the WAL thread, every vote
//! waiting behind it. Now the new chunks go to one pack file (one fsync), then the
//! manifest is written atomically; a snapshot exists once its manifest does.
//!
//! Space: a pack is deleted when no kept manifest refers to it. A pack that the newest
//! snapshot uses for less than half of its bytes has its live chunks copied forward into
//! the new pack, so the packs of a steady workload hold at most about twice the state.
//!
//! Memory: once a snapshot is durable its pieces' bytes leave memory (`Chunked::spill`):
//! each chunk keeps a handle on its place in a pack (`PackChunk`) and is read back, and
//! checked against its digest, only to be served to a peer or restored. A pack that a
//! live handle refers to stays on disk even when no kept manifest does (an older stable
//! checkpoint a state transfer still reuses chunks from); it goes at the first retirement
//! after the last handle is dropped.
//!
//! Integrity: a manifest carries a CRC32C; each chunk is checked against its BLAKE3 digest
//! when read, and the whole against the Merkle root. A snapshot that fails any check is
//! skipped at open (with a warning): the replica then starts from an older one or fetches
//! the state from peers, which is always possible below a stable checkpoint.

use crate::storage::{fsync_dir, io_err, write_atomic, StorageError};
use keel_core::chunk::StoredChunk;
use keel_core::crypto::Digest;
use keel_core::exec::{leaf_digest, Chunked};
use keel_core::message::Seq;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Weak};

/// A pack is rewritten forward once the newest snapshot uses less than this share of it.
const PACK_LIVE_MIN_PCT: u64 = 50;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Loc {
    pack: u64,
    offset: u64,
    len: u32,
}

#[derive(Debug, Serialize, Deserialize)]
struct Manifest {
    len: u64,
    root: Digest,
    chunks: Vec<(Digest, Loc)>,
}

/// Snapshots read back at open: (checkpoint instance, bytes), oldest first.
pub type Snapshots = Vec<(Seq, Chunked)>;

/// What writing one snapshot cost, for statistics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SnapshotWrite {
    pub chunks: u64,
    /// Chunks already stored (by an earlier snapshot, or earlier in this one).
    pub reused: u64,
    /// Bytes written to the new pack, including chunks copied forward.
    pub bytes_written: u64,
    /// Bytes of the snapshot's pieces that left memory once it was durable.
    pub released: u64,
}

impl SnapshotWrite {
    pub fn add(&mut self, o: SnapshotWrite) {
        self.chunks += o.chunks;
        self.reused += o.reused;
        self.bytes_written += o.bytes_written;
        self.released += o.released;
    }
}

/// An open pack file; while any handle lives, the pack stays on disk.
#[derive(Debug)]
struct PackFile {
    id: u64,
    file: File,
}

/// A chunk's place in a pack: what a piece that left memory reads its bytes back from.
struct PackChunk {
    pack: Arc<PackFile>,
    offset: u64,
    len: u32,
}

impl PackChunk {
    /// The chunk's bytes into `buf` (resized to fit): a check of every chunk at start
    /// reuses one buffer instead of allocating and faulting in fresh pages per chunk.
    fn read_into(&self, buf: &mut Vec<u8>) -> std::io::Result<()> {
        buf.resize(self.len as usize, 0);
        self.pack
            .file
            .read_exact_at(buf, self.offset)
            .map_err(|e| std::io::Error::new(e.kind(), format!("pack {} at {}: {e}", self.pack.id, self.offset)))
    }
}

impl StoredChunk for PackChunk {
    fn read(&self) -> std::io::Result<Vec<u8>> {
        let mut bytes = Vec::new();
        self.read_into(&mut bytes)?;
        Ok(bytes)
    }
}

pub struct SnapshotStore {
    dir: PathBuf,
    /// Where each stored chunk is (its first copy among the kept packs' chunks that the
    /// newest manifest uses, or any copy).
    index: HashMap<Digest, Loc>,
    /// Pack → its size in bytes.
    packs: BTreeMap<u64, u64>,
    /// The number of the next pack. Never reused, so a manifest's places stay valid
    /// even when a snapshot at the same instance is written again (after a divergence).
    next_pack: u64,
    /// Kept snapshots: seq → the packs its manifest refers to.
    manifests: BTreeMap<Seq, Vec<u64>>,
    /// Packs that pieces out of memory may read from; kept while a handle lives.
    handles: BTreeMap<u64, Weak<PackFile>>,
}

fn manifest_path(dir: &Path, seq: Seq) -> PathBuf {
    dir.join(format!("{seq:016}.snap"))
}

fn pack_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("{id:016}.pack"))
}

/// The number a snapshot (its instance) or a pack file is named by.
fn parse_name(name: &str, suffix: &str) -> Option<u64> {
    name.strip_suffix(suffix).and_then(|s| s.parse::<u64>().ok())
}

impl SnapshotStore {
    /// Reads every readable snapshot under `dir` (oldest first) and removes what no
    /// snapshot refers to (temp files, orphan packs).
    pub fn open(dir: &Path) -> Result<(SnapshotStore, Snapshots), StorageError> {
        let mut store = SnapshotStore {
            dir: dir.to_path_buf(),
            index: HashMap::new(),
            packs: BTreeMap::new(),
            next_pack: 0,
            manifests: BTreeMap::new(),
            handles: BTreeMap::new(),
        };
        let mut manifests = Vec::new();
        for entry in fs::read_dir(dir).map_err(io_err("read", dir))? {
            let entry = entry.map_err(io_err("read", dir))?;
            let name = entry.file_name().to_string_lossy().to_string();
            if let Some(seq) = parse_name(&name, ".snap") {
                manifests.push(Seq(seq));
            } else if let Some(pack) = parse_name(&name, ".pack") {
                let len = entry.metadata().map_err(io_err("stat", &entry.path()))?.len();
                store.packs.insert(pack, len);
            } else if name.ends_with(".tmp") {
                // A write a crash interrupted: garbage.
                let _ = fs::remove_file(entry.path());
            }
        }
        manifests.sort_unstable();
        store.next_pack = store.packs.keys().next_back().map_or(0, |p| p + 1);
        let mut snapshots = Vec::new();
        for seq in manifests {
            match store.load(seq) {
                Ok((chunked, manifest)) => {
                    let mut packs: Vec<u64> = manifest.chunks.iter().map(|(_, l)| l.pack).collect();
                    packs.sort_unstable();
                    packs.dedup();
                    for (d, l) in manifest.chunks {
                        store.index.insert(d, l);
                    }
                    store.manifests.insert(seq, packs);
                    snapshots.push((seq, chunked));
                }
                Err(why) => {
                    tracing::warn!(seq = seq.0, %why, "snapshot unreadable: skipped (the node fetches state from peers if it needs it)");
                    let _ = fs::remove_file(manifest_path(dir, seq));
                }
            }
        }
        let used: std::collections::BTreeSet<u64> = store.manifests.values().flatten().copied().collect();
        for pack in store.packs.keys().copied().filter(|p| !used.contains(p)).collect::<Vec<_>>() {
            store.packs.remove(&pack);
            let _ = fs::remove_file(pack_path(dir, pack));
        }
        Ok((store, snapshots))
    }

    /// A snapshot's chunks, each and the root checked; they stay on disk (the snapshot
    /// read back holds handles on its packs, not its bytes).
    fn load(&mut self, seq: Seq) -> Result<(Chunked, Manifest), String> {
        let path = manifest_path(&self.dir, seq);
        let raw = fs::read(&path).map_err(|e| format!("read {}: {e}", path.display()))?;
        if raw.len() < 4 {
            return Err("manifest too short".into());
        }
        let (crc, body) = raw.split_at(4);
        if u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]]) != crc32c::crc32c(body) {
            return Err("manifest checksum mismatch".into());
        }
        let manifest: Manifest = postcard::from_bytes(body).map_err(|e| format!("manifest: {e}"))?;
        let mut chunks: Vec<(Digest, usize, Arc<dyn StoredChunk>)> = Vec::with_capacity(manifest.chunks.len());
        let mut chunk = Vec::new();
        for (digest, loc) in &manifest.chunks {
            let place = self.place(*loc).map_err(|e| format!("open pack {}: {e}", loc.pack))?;
            place.read_into(&mut chunk).map_err(|e| e.to_string())?;
            if leaf_digest(&chunk) != *digest {
                return Err(format!("chunk at {} of pack {} does not match its digest", loc.offset, loc.pack));
            }
            chunks.push((*digest, chunk.len(), place));
        }
        let chunked = Chunked::from_stored(chunks);
        if chunked.len() != manifest.len || chunked.root != manifest.root {
            return Err("chunks do not make up the snapshot's root".into());
        }
        Ok((chunked, manifest))
    }

    /// A handle on the chunk at `loc`, opening its pack if no handle is open.
    fn place(&mut self, loc: Loc) -> std::io::Result<Arc<PackChunk>> {
        let pack = match self.handles.get(&loc.pack).and_then(Weak::upgrade) {
            Some(pack) => pack,
            None => {
                let pack = Arc::new(PackFile { id: loc.pack, file: File::open(pack_path(&self.dir, loc.pack))? });
                self.handles.insert(loc.pack, Arc::downgrade(&pack));
                pack
            }
        };
        Ok(Arc::new(PackChunk { pack, offset: loc.offset, len: loc.len }))
    }

    /// Stores the snapshot of the checkpoint at `seq` durably: its new chunks in one pack
    /// (fsynced), then the manifest (atomically). Then its pieces' bytes leave memory.
    pub fn write(&mut self, seq: Seq, chunked: &Chunked) -> Result<SnapshotWrite, StorageError> {
        // Written again (a state transfer to a checkpoint we also took): the new manifest
        // replaces the old one; chunks of the old that it reuses stay where they are.
        self.manifests.remove(&seq);
        // Packs the new snapshot would use too little of are copied forward.
        let mut live: BTreeMap<u64, u64> = BTreeMap::new();
        let mut seen = std::collections::HashSet::new();
        for (i, d) in chunked.leaves.iter().enumerate() {
            if let (Some(l), true) = (self.index.get(d), seen.insert(*d)) {
                *live.entry(l.pack).or_default() += chunked.chunk_len(i as u32).unwrap_or(0) as u64;
            }
        }
        let sparse = |pack: u64| {
            let size = self.packs.get(&pack).copied().unwrap_or(0);
            live.get(&pack).copied().unwrap_or(0) * 100 < size * PACK_LIVE_MIN_PCT
        };
        let mut stats = SnapshotWrite::default();
        let mut entries = Vec::with_capacity(chunked.leaves.len());
        let mut fresh: HashMap<Digest, Loc> = HashMap::new();
        let id = self.next_pack;
        let tmp = self.dir.join(format!("{id:016}.pack.tmp"));
        let mut pack: Option<BufWriter<File>> = None;
        let mut offset = 0u64;
        for (i, d) in chunked.leaves.iter().enumerate() {
            stats.chunks += 1;
            let kept = fresh.get(d).or_else(|| self.index.get(d).filter(|l| !sparse(l.pack))).copied();
            let loc = match kept {
                Some(l) => {
                    stats.reused += 1;
                    l
                }
                None => {
                    // Only a chunk no kept pack holds is read: a piece out of memory is
                    // in a pack its handle keeps, so its chunks are found above unless
                    // their pack is being copied forward.
                    let data = chunked
                        .chunk(i as u32)
                        .map_err(|e| io_err("read back", &tmp)(std::io::Error::other(e)))?
                        .ok_or_else(|| io_err("read back", &tmp)(std::io::Error::other("chunk index out of range")))?;
                    let w = match &mut pack {
                        Some(w) => w,
                        None => pack.insert(BufWriter::with_capacity(
                            1 << 20,
                            File::create(&tmp).map_err(io_err("create", &tmp))?,
                        )),
                    };
                    w.write_all(&data).map_err(io_err("write", &tmp))?;
                    let l = Loc { pack: id, offset, len: data.len() as u32 };
                    offset += data.len() as u64;
                    stats.bytes_written += data.len() as u64;
                    fresh.insert(*d, l);
                    l
                }
            };
            entries.push((*d, loc));
        }
        if let Some(w) = pack {
            let f = w.into_inner().map_err(|e| io_err("write", &tmp)(e.into_error()))?;
            f.sync_all().map_err(io_err("fsync", &tmp))?;
            let path = pack_path(&self.dir, id);
            fs::rename(&tmp, &path).map_err(io_err("rename", &path))?;
            fsync_dir(&self.dir)?;
            self.packs.insert(id, offset);
            self.next_pack += 1;
        }
        let manifest = Manifest { len: chunked.len(), root: chunked.root, chunks: entries };
        let body = postcard::to_allocvec(&manifest).map_err(|e| StorageError::Io {
            what: "encode manifest",
            path: manifest_path(&self.dir, seq),
            source: std::io::Error::other(e),
        })?;
        let mut raw = crc32c::crc32c(&body).to_le_bytes().to_vec();
        raw.extend_from_slice(&body);
        write_atomic(&self.dir, &format!("{seq:016}.snap"), &raw)?;
        let mut packs: Vec<u64> = manifest.chunks.iter().map(|(_, l)| l.pack).collect();
        packs.sort_unstable();
        packs.dedup();
        // The index follows the newest copies, so sparse packs stop being referenced.
        for (d, l) in &manifest.chunks {
            self.index.insert(*d, *l);
        }
        self.manifests.insert(seq, packs);
        stats.released = self.release(chunked, &manifest);
        Ok(stats)
    }

    /// Lets `chunked`'s pieces (shared with the core and the service) drop their bytes:
    /// each chunk now reads from its place in `manifest`. A pack that cannot be opened
    /// keeps its pieces in memory, as before.
    fn release(&mut self, chunked: &Chunked, manifest: &Manifest) -> u64 {
        let mut places: HashMap<Digest, Arc<dyn StoredChunk>> = HashMap::with_capacity(manifest.chunks.len());
        for (d, loc) in &manifest.chunks {
            match self.place(*loc) {
                Ok(place) => {
                    places.insert(*d, place);
                }
                Err(e) => tracing::warn!(pack = loc.pack, %e, "pack not reopened: its chunks stay in memory"),
            }
        }
        chunked.spill(&|d| places.get(d).cloned()) as u64
    }

    /// Drops the snapshots below `from`; returns the files that are now garbage
    /// (their manifests, and packs no kept manifest refers to) for the caller to delete.
    pub fn retire_below(&mut self, from: Seq) -> Vec<PathBuf> {
        let old: Vec<Seq> = self.manifests.range(..from).map(|(s, _)| *s).collect();
        let mut garbage: Vec<PathBuf> = old.iter().map(|s| manifest_path(&self.dir, *s)).collect();
        for s in old {
            self.manifests.remove(&s);
        }
        garbage.extend(self.unreferenced_packs());
        garbage
    }

    /// Packs neither a kept manifest nor a piece out of memory refers to, removed from
    /// the index and the pack list.
    fn unreferenced_packs(&mut self) -> Vec<PathBuf> {
        self.handles.retain(|_, h| h.strong_count() > 0);
        let used: std::collections::BTreeSet<u64> =
            self.manifests.values().flatten().copied().chain(self.handles.keys().copied()).collect();
        let dead: Vec<u64> = self.packs.keys().copied().filter(|p| !used.contains(p)).collect();
        for p in &dead {
            self.packs.remove(p);
        }
        self.index.retain(|_, l| used.contains(&l.pack));
        dead.iter().map(|p| pack_path(&self.dir, *p)).collect()
    }

    /// Bytes held in packs (for tests and statistics).
    pub fn pack_bytes(&self) -> u64 {
        self.packs.values().sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn noise(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    /// What was read back, as bytes, with a check that each kept the root it was
    /// written under.
    fn as_bytes(back: Snapshots) -> Vec<(u64, Vec<u8>)> {
        back.into_iter().map(|(s, c)| (s.0, c.to_bytes().expect("readable"))).collect()
    }

    fn chunked(bytes: Vec<u8>) -> Chunked {
        Chunked::new(bytes, 1024)
    }

    #[test]
    fn a_checkpoint_writes_only_the_chunks_it_changed_and_reads_back_whole() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut store, none) = SnapshotStore::open(dir.path()).expect("open");
        assert!(none.is_empty());
        let first = noise(200_000, 1);
        let w = store.write(Seq(8), &chunked(first.clone())).expect("write");
        assert_eq!((w.reused, w.bytes_written), (0, 200_000));
        // Change 100 bytes in the middle: a few chunks around them are new.
        let mut second = first.clone();
        second[100_000..100_100].copy_from_slice(&noise(100, 2));
        let w = store.write(Seq(16), &chunked(second.clone())).expect("write");
        assert!(w.reused + 4 >= w.chunks, "{w:?}");
        assert!(w.bytes_written < 10_000, "{w:?}");
        drop(store);
        let (store, back) = SnapshotStore::open(dir.path()).expect("reopen");
        let back = as_bytes(back);
        assert_eq!(back, vec![(8, first), (16, second)]);
        assert!(store.pack_bytes() < 210_000);
    }

    #[test]
    fn retired_snapshots_free_their_packs_and_sparse_packs_are_copied_forward() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut store, _) = SnapshotStore::open(dir.path()).expect("open");
        let first = noise(100_000, 1);
        store.write(Seq(8), &chunked(first.clone())).expect("write");
        // Mostly new bytes: the first pack is sparse for this snapshot, so its few live
        // chunks are copied forward and, once 8 is retired, the first pack is garbage.
        let mut second = noise(100_000, 3);
        second[..10_000].copy_from_slice(&first[..10_000]);
        let w = store.write(Seq(16), &chunked(second.clone())).expect("write");
        assert_eq!(w.bytes_written, 100_000, "{w:?}");
        let garbage = store.retire_below(Seq(16));
        assert!(garbage.contains(&manifest_path(dir.path(), Seq(8))));
        assert!(garbage.contains(&pack_path(dir.path(), 0)), "the first pack");
        for g in garbage {
            fs::remove_file(g).expect("remove");
        }
        let (_, back) = SnapshotStore::open(dir.path()).expect("reopen");
        let back = as_bytes(back);
        assert_eq!(back, vec![(16, second)]);
    }

    #[test]
    fn a_damaged_snapshot_is_skipped_not_trusted() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut store, _) = SnapshotStore::open(dir.path()).expect("open");
        let a = noise(50_000, 1);
        let b = noise(50_000, 2);
        store.write(Seq(8), &chunked(a.clone())).expect("write");
        store.write(Seq(16), &chunked(b)).expect("write");
        // Flip a byte of the second pack: snapshot 16 fails its chunk digest.
        let p = pack_path(dir.path(), 1);
        let mut bytes = fs::read(&p).expect("read");
        bytes[123] ^= 0x40;
        fs::write(&p, bytes).expect("write");
        let (_, back) = SnapshotStore::open(dir.path()).expect("reopen");
        let back = as_bytes(back);
        assert_eq!(back, vec![(8, a)]);
    }

    #[test]
    fn a_snapshot_written_again_at_the_same_instance_reads_back_as_the_new_one() {
        // A node that diverged stores the transferred snapshot at the instance of its
        // own: the new one reuses chunks of the old, whose pack must stay readable.
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut store, _) = SnapshotStore::open(dir.path()).expect("open");
        let own = noise(100_000, 1);
        let mut stable = own.clone();
        stable[50_000..50_050].copy_from_slice(&noise(50, 9));
        store.write(Seq(8), &chunked(own)).expect("write");
        let w = store.write(Seq(8), &chunked(stable.clone())).expect("write");
        assert!(w.reused > 0, "{w:?}");
        drop(store);
        let (_, back) = SnapshotStore::open(dir.path()).expect("reopen");
        let back = as_bytes(back);
        assert_eq!(back, vec![(8, stable)]);
    }
    #[test]
    fn a_durable_snapshot_leaves_memory_and_reads_back_from_its_pack() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut store, _) = SnapshotStore::open(dir.path()).expect("open");
        let bytes = noise(100_000, 1);
        let c = chunked(bytes.clone());
        let w = store.write(Seq(8), &c).expect("write");
        assert_eq!((w.released, c.memory_bytes()), (100_000, 0));
        assert_eq!(c.to_bytes().expect("readable"), bytes);
        let third = c.chunk(3).expect("readable").expect("a chunk");
        assert_eq!(leaf_digest(&third), c.leaves[3]);
        // Read back at start, a snapshot is handles on its packs, not bytes.
        drop(store);
        let (_, back) = SnapshotStore::open(dir.path()).expect("reopen");
        assert_eq!(back[0].1.memory_bytes(), 0);
        assert_eq!(as_bytes(back), vec![(8, bytes)]);
        // A pack damaged after it was written: the chunk is refused, not served wrong.
        let p = pack_path(dir.path(), 0);
        let mut raw = fs::read(&p).expect("read");
        raw[10] ^= 1;
        fs::write(&p, raw).expect("write");
        let e = c.chunk(0).err().expect("a damaged chunk is refused");
        assert!(e.why.contains("digest"), "{e}");
    }

    #[test]
    fn a_pack_a_piece_still_reads_from_outlives_its_manifest_and_copies_forward_repoint() {
        use keel_core::chunk::Piece;
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut store, _) = SnapshotStore::open(dir.path()).expect("open");
        // The old stable checkpoint, still held (a transfer reuses its chunks).
        let old = chunked(noise(100_000, 1));
        store.write(Seq(8), &old).expect("write");
        store.write(Seq(16), &chunked(noise(100_000, 2))).expect("write");
        let garbage = store.retire_below(Seq(16));
        assert_eq!(garbage, vec![manifest_path(dir.path(), Seq(8))], "pack 0 is still read from");
        fs::remove_file(&garbage[0]).expect("remove");
        assert_eq!(old.to_bytes().expect("readable"), noise(100_000, 1));
        drop(old);
        store.write(Seq(24), &chunked(noise(100, 3))).expect("write");
        let garbage = store.retire_below(Seq(24));
        assert!(garbage.contains(&pack_path(dir.path(), 0)), "no handle left on pack 0: {garbage:?}");
        assert!(garbage.contains(&pack_path(dir.path(), 1)));

        // A piece the service hands back at every checkpoint, in a pack a newer snapshot
        // uses too little of: its chunks are copied forward (read back to do so) and the
        // piece reads from the new pack, so the old one can go.
        let kept = Piece::new(noise(10_000, 4));
        let first = Chunked::from_pieces(vec![kept.clone(), Piece::new(noise(90_000, 5))], 1024);
        store.write(Seq(32), &first).expect("write");
        assert!(!kept.in_memory());
        drop(first);
        let second = Chunked::from_pieces(vec![kept.clone(), Piece::new(noise(90_000, 6))], 1024);
        let w = store.write(Seq(40), &second).expect("write");
        assert_eq!(w.bytes_written, 100_000, "the kept piece was copied forward: {w:?}");
        let garbage = store.retire_below(Seq(40));
        for g in &garbage {
            let _ = fs::remove_file(g);
        }
        let first_pack = pack_path(dir.path(), 3);
        assert!(garbage.contains(&first_pack), "{garbage:?}");
        assert!(!first_pack.exists());
        assert_eq!(kept.bytes().expect("read from the new pack").as_slice(), noise(10_000, 4).as_slice());
        assert_eq!(second.to_bytes().expect("readable").len(), 100_000);
    }
}
