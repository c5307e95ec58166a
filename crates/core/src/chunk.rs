//! Checkpoints as content-defined chunks under a Merkle root.
//!
//! A snapshot is a sequence of [`Piece`]s whose bytes, concatenated, are the executor's
//! snapshot. Each piece is cut into chunks on its own (FastCDC: a rolling hash picks cut
//! points), so chunk boundaries depend on the bytes and on where pieces start, nothing
//! else. Two consequences:
//! - a write in the middle of a piece changes the chunks around it and leaves the others,
//!   shifted or not, with the same digests: a state transfer that restarts on a newer
//!   checkpoint, or a node that holds an older snapshot, fetches only the chunks it lacks
//!   (catch_up.rs);
//! - a service that hands back the same piece (the same `Arc`) at the next checkpoint,
//!   because the part of the state it covers did not change, costs neither serialization
//!   nor cutting nor hashing: the cut is computed once per piece and kept with it. That
//!   makes a checkpoint's cost follow what changed, not the size of the state.
//!
//! Every node must cut the same state the same way (the root is what checkpoint votes
//! sign), so a service's pieces must be a function of its state alone (KV: see its
//! `segments` module).
//!
//! A piece's bytes can leave memory once they are durable elsewhere ([`Chunked::spill`]:
//! the runtime hands each chunk's place in its snapshot packs). The piece keeps its cut
//! (chunk ends and digests), so a later checkpoint that reuses it still costs nothing,
//! and reads a chunk back only to serve it (a state transfer) or to restore. Without
//! that, every node held its checkpointed state twice in memory: once as the service's
//! live state and once as the pieces of its stable checkpoint (the block store's
//! metadata, KV's segments). A chunk read back is checked against its digest: a disk
//! that lies makes the read fail ([`Unreadable`]), never returns other bytes.

use crate::crypto::{Digest, Hasher};
use std::sync::{Arc, OnceLock, PoisonError, RwLock};

/// A chunk's bytes kept off memory: the runtime's is a place in a snapshot pack file,
/// which stays on disk while the handle lives.
pub trait StoredChunk: Send + Sync {
    fn read(&self) -> std::io::Result<Vec<u8>>;
}

/// A chunk whose bytes left memory could not be read back, or read back other bytes than
/// its digest says.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("checkpoint chunk {index} could not be read back: {why}")]
pub struct Unreadable {
    /// The chunk's index in its piece (or in its snapshot, from [`Chunked`]'s methods).
    pub index: usize,
    pub why: String,
}

/// Where a piece's bytes are.
enum Held {
    Memory(Arc<Vec<u8>>),
    /// One handle per chunk of the piece's cut, in order.
    Stored(Vec<Arc<dyn StoredChunk>>),
}

/// A run of snapshot bytes that is cut into chunks on its own.
pub struct Piece {
    len: usize,
    held: RwLock<Held>,
    /// The cut for one average chunk size, computed on first use.
    cut: OnceLock<Cut>,
}

struct Cut {
    /// The average chunk size it was computed for; None: given (a fetched or loaded
    /// chunk), whatever the size.
    avg: Option<usize>,
    /// Where each chunk ends (exclusive); the first starts at 0.
    ends: Vec<usize>,
    leaves: Vec<Digest>,
}

/// A chunk's bytes: shared with the piece that holds them, or read back for this use.
pub enum ChunkBytes {
    Shared(Arc<Vec<u8>>, std::ops::Range<usize>),
    Read(Vec<u8>),
}

impl std::ops::Deref for ChunkBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            ChunkBytes::Shared(bytes, range) => &bytes[range.clone()],
            ChunkBytes::Read(bytes) => bytes,
        }
    }
}

impl Piece {
    pub fn new(bytes: Vec<u8>) -> Arc<Piece> {
        Arc::new(Piece { len: bytes.len(), held: RwLock::new(Held::Memory(Arc::new(bytes))), cut: OnceLock::new() })
    }

    /// One whole chunk (fetched in a state transfer, or read back from disk): its
    /// boundaries are the ones the snapshot was made with.
    fn chunk(bytes: Vec<u8>) -> Arc<Piece> {
        let cut = Cut { avg: None, ends: vec![bytes.len()], leaves: vec![leaf_digest(&bytes)] };
        Arc::new(Piece { len: bytes.len(), held: RwLock::new(Held::Memory(Arc::new(bytes))), cut: OnceLock::from(cut) })
    }

    /// One whole chunk already stored (a snapshot loaded at start): nothing in memory.
    fn stored_chunk(digest: Digest, len: usize, place: Arc<dyn StoredChunk>) -> Arc<Piece> {
        let cut = Cut { avg: None, ends: vec![len], leaves: vec![digest] };
        Arc::new(Piece { len, held: RwLock::new(Held::Stored(vec![place])), cut: OnceLock::from(cut) })
    }

    fn held(&self) -> std::sync::RwLockReadGuard<'_, Held> {
        self.held.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// The piece's bytes: shared if in memory, read back (and checked) if stored.
    ///
    /// # Errors
    /// A stored chunk that cannot be read back or does not match its digest.
    pub fn bytes(&self) -> Result<Arc<Vec<u8>>, Unreadable> {
        let places = match &*self.held() {
            Held::Memory(bytes) => return Ok(bytes.clone()),
            Held::Stored(places) => places.clone(),
        };
        // A stored piece always has its cut (spilling needs it).
        let leaves = self.cut.get().map(|c| c.leaves.as_slice()).unwrap_or_default();
        let mut out = Vec::with_capacity(self.len);
        for (index, place) in places.iter().enumerate() {
            out.extend_from_slice(&read_back(place.as_ref(), leaves.get(index), index)?);
        }
        if out.len() != self.len {
            let why = format!("{} bytes read back, {} expected", out.len(), self.len);
            return Err(Unreadable { index: places.len(), why });
        }
        Ok(Arc::new(out))
    }

    /// Chunk `index` of this piece's cut, which spans `range` of it and has `digest`
    /// (the snapshot's, checked against what is read back).
    fn chunk_bytes(
        &self,
        index: usize,
        range: std::ops::Range<usize>,
        digest: &Digest,
    ) -> Result<ChunkBytes, Unreadable> {
        let place = match &*self.held() {
            Held::Memory(bytes) => return Ok(ChunkBytes::Shared(bytes.clone(), range)),
            Held::Stored(places) => places.get(index).cloned(),
        };
        let place = place.ok_or_else(|| Unreadable { index, why: "no such stored chunk".into() })?;
        let bytes = read_back(place.as_ref(), Some(digest), index)?;
        if bytes.len() != range.len() {
            return Err(Unreadable {
                index,
                why: format!("{} bytes read back, {} expected", bytes.len(), range.len()),
            });
        }
        Ok(ChunkBytes::Read(bytes))
    }

    /// Whether the bytes are in memory.
    pub fn in_memory(&self) -> bool {
        matches!(&*self.held(), Held::Memory(_))
    }

    /// Drops the bytes from memory if every chunk of the cut has a place (`place` by
    /// digest); a stored piece takes the new places (a chunk copied forward to another
    /// pack frees the old one). Returns the bytes released.
    fn spill(&self, place: &dyn Fn(&Digest) -> Option<Arc<dyn StoredChunk>>) -> usize {
        let Some(cut) = self.cut.get() else { return 0 };
        let Some(places) = cut.leaves.iter().map(place).collect::<Option<Vec<_>>>() else { return 0 };
        let mut held = self.held.write().unwrap_or_else(PoisonError::into_inner);
        let released = if matches!(&*held, Held::Memory(_)) { self.len } else { 0 };
        *held = Held::Stored(places);
        released
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The chunk ends and digests for chunks of `avg` bytes on average: kept from the
    /// first call (the size is a cluster setting, so it does not change under a piece).
    ///
    /// # Panics
    /// If the cut must be computed afresh from bytes that left memory and cannot be read
    /// back. Not in a running node: bytes leave memory only with the cut they were
    /// stored under, which is either given (a chunk, cut for any size) or for the
    /// cluster's chunk size, fixed for the life of the process (`Options::chunk_bytes`).
    fn cut(&self, avg: usize) -> (Vec<usize>, Vec<Digest>) {
        let bytes = || self.bytes().unwrap_or_else(|e| panic!("recutting a stored piece for another chunk size: {e}"));
        if let Some(cut) = self.cut.get() {
            if cut.avg.is_none_or(|a| a == avg) {
                return (cut.ends.clone(), cut.leaves.clone());
            }
            let fresh = cut_bytes(&bytes(), avg);
            return (fresh.ends, fresh.leaves);
        }
        let cut = self.cut.get_or_init(|| cut_bytes(&bytes(), avg));
        (cut.ends.clone(), cut.leaves.clone())
    }
}

/// A stored chunk's bytes, checked against its digest.
fn read_back(place: &dyn StoredChunk, digest: Option<&Digest>, index: usize) -> Result<Vec<u8>, Unreadable> {
    let bytes = place.read().map_err(|e| Unreadable { index, why: e.to_string() })?;
    match digest {
        Some(d) if leaf_digest(&bytes) == *d => Ok(bytes),
        Some(_) => Err(Unreadable { index, why: "the bytes read back do not match the chunk's digest".into() }),
        None => Err(Unreadable { index, why: "no digest to check it against".into() }),
    }
}

impl std::fmt::Debug for Piece {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let at = if self.in_memory() { "in memory" } else { "stored" };
        write!(f, "Piece({} bytes {at})", self.len)
    }
}

fn cut_bytes(bytes: &[u8], avg: usize) -> Cut {
    let (min, max) = chunk_bounds(avg);
    let ends: Vec<usize> =
        fastcdc::v2020::FastCDC::new(bytes, min as u32, avg as u32, max as u32).map(|c| c.offset + c.length).collect();
    let leaves = (0..ends.len()).map(|i| leaf_digest(&bytes[span(&ends, i)])).collect();
    Cut { avg: Some(avg), ends, leaves }
}

fn span(ends: &[usize], index: usize) -> std::ops::Range<usize> {
    let start = if index == 0 { 0 } else { ends[index - 1] };
    start..ends[index]
}

/// Where one chunk of a snapshot is: its piece, its index in the piece's cut, and the
/// bytes of the piece it spans.
#[derive(Clone, Debug)]
struct Span {
    piece: u32,
    index: u32,
    range: std::ops::Range<usize>,
}

/// A checkpoint split into content-defined chunks with a Merkle root over them.
#[derive(Clone, Debug)]
pub struct Chunked {
    /// Shared with the persist request, the state-transfer server and (for pieces a
    /// service keeps) the service: a snapshot is the whole state, never copied per use.
    pieces: Vec<Arc<Piece>>,
    spans: Vec<Span>,
    pub leaves: Vec<Digest>,
    pub root: Digest,
    len: u64,
}

/// Two checkpoints are equal if their roots are: the root binds every chunk and the length.
impl PartialEq for Chunked {
    fn eq(&self, other: &Chunked) -> bool {
        self.root == other.root
    }
}

impl Eq for Chunked {}

/// The chunk size bounds for an average of `avg` bytes: a quarter to four times it.
pub fn chunk_bounds(avg: usize) -> (usize, usize) {
    (avg / 4, avg.saturating_mul(4))
}

/// Smallest and largest average chunk size (`Options::chunk_bytes`) the chunker takes:
/// FastCDC's own floor, and a maximum chunk of at most `codec::CHUNK_BYTES_MAX`.
pub const CHUNK_AVG_MIN: usize = fastcdc::v2020::AVERAGE_MIN as usize;
pub const CHUNK_AVG_MAX: usize = crate::codec::CHUNK_BYTES_MAX / 4;

impl Chunked {
    /// One piece of bytes, cut afresh.
    ///
    /// # Panics
    /// If `avg_chunk` is outside `CHUNK_AVG_MIN..=CHUNK_AVG_MAX` (`Options::validate`
    /// refuses such configurations).
    pub fn new(bytes: Vec<u8>, avg_chunk: usize) -> Chunked {
        Chunked::from_pieces(vec![Piece::new(bytes)], avg_chunk)
    }

    /// A snapshot made of `pieces`, each cut on its own (pieces cut before are not cut
    /// again).
    ///
    /// # Panics
    /// As [`Chunked::new`]; and for a piece whose bytes left memory, was cut for another
    /// chunk size, and cannot be read back (see [`Piece`]'s `cut`: not in a running node).
    pub fn from_pieces(pieces: Vec<Arc<Piece>>, avg_chunk: usize) -> Chunked {
        assert!((CHUNK_AVG_MIN..=CHUNK_AVG_MAX).contains(&avg_chunk), "chunk size {avg_chunk} out of range");
        let mut spans = Vec::new();
        let mut leaves = Vec::new();
        for (p, piece) in pieces.iter().enumerate() {
            let (ends, digests) = piece.cut(avg_chunk);
            spans.extend((0..ends.len()).map(|i| Span { piece: p as u32, index: i as u32, range: span(&ends, i) }));
            leaves.extend(digests);
        }
        let len = pieces.iter().map(|p| p.len() as u64).sum();
        let root = merkle_root(len, &leaves);
        Chunked { pieces, spans, leaves, root, len }
    }

    /// A snapshot from its chunks in order (fetched from peers): the boundaries are the
    /// chunks', so the root is the one they were made under.
    pub fn from_chunks(chunks: Vec<Vec<u8>>) -> Chunked {
        Chunked::of_chunk_pieces(chunks.into_iter().map(Piece::chunk).collect())
    }

    /// A snapshot from its chunks in order, already stored (read back from disk):
    /// (digest, length, place) each. Nothing of it is in memory; the caller has checked
    /// the chunks against their digests.
    pub fn from_stored(chunks: Vec<(Digest, usize, Arc<dyn StoredChunk>)>) -> Chunked {
        Chunked::of_chunk_pieces(chunks.into_iter().map(|(d, len, place)| Piece::stored_chunk(d, len, place)).collect())
    }

    fn of_chunk_pieces(pieces: Vec<Arc<Piece>>) -> Chunked {
        let spans = pieces
            .iter()
            .enumerate()
            .map(|(p, piece)| Span { piece: p as u32, index: 0, range: 0..piece.len() })
            .collect();
        let leaves: Vec<Digest> =
            pieces.iter().flat_map(|p| p.cut.get().map(|c| c.leaves.clone()).unwrap_or_default()).collect();
        let len = pieces.iter().map(|p| p.len() as u64).sum();
        let root = merkle_root(len, &leaves);
        Chunked { pieces, spans, leaves, root, len }
    }

    /// The snapshot's length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Chunk `index`'s length (without reading it).
    pub fn chunk_len(&self, index: u32) -> Option<usize> {
        self.spans.get(index as usize).map(|s| s.range.len())
    }

    /// Chunk `index`'s bytes; None past the last chunk.
    ///
    /// # Errors
    /// A chunk whose bytes left memory and cannot be read back as they were.
    pub fn chunk(&self, index: u32) -> Result<Option<ChunkBytes>, Unreadable> {
        let (Some(s), Some(digest)) = (self.spans.get(index as usize), self.leaves.get(index as usize)) else {
            return Ok(None);
        };
        self.pieces[s.piece as usize]
            .chunk_bytes(s.index as usize, s.range.clone(), digest)
            .map(Some)
            .map_err(|e| Unreadable { index: index as usize, why: e.why })
    }

    /// Every chunk with its digest, in order.
    pub fn chunks(&self) -> impl Iterator<Item = (&Digest, Result<ChunkBytes, Unreadable>)> {
        self.leaves.iter().enumerate().map(|(i, d)| {
            (d, self.chunk(i as u32).and_then(|c| c.ok_or_else(|| Unreadable { index: i, why: "missing".into() })))
        })
    }

    /// The snapshot's bytes in one buffer (a copy: for restoring, which is rare).
    ///
    /// # Errors
    /// As [`Chunked::chunk`].
    pub fn to_bytes(&self) -> Result<Vec<u8>, Unreadable> {
        join(&self.pieces)
    }

    /// The snapshot's bytes as a stream, a chunk at a time: a restore of a large state
    /// holds one chunk of the snapshot, not all of it beside the state it rebuilds. A
    /// chunk that cannot be read back is an I/O error of the read that reaches it.
    pub fn reader(&self) -> ChunkReader<'_> {
        ChunkReader { chunked: self, next: 0, current: None, at: 0 }
    }

    /// Lets the pieces' bytes leave memory: `place` gives a chunk's stored place by
    /// digest (None: not stored, the piece stays in memory). Pieces already stored take
    /// the new places. Returns the bytes released.
    pub fn spill(&self, place: &dyn Fn(&Digest) -> Option<Arc<dyn StoredChunk>>) -> usize {
        self.pieces.iter().map(|p| p.spill(place)).sum()
    }

    /// Bytes of this snapshot held in memory (pieces shared with others count whole).
    pub fn memory_bytes(&self) -> usize {
        self.pieces.iter().filter(|p| p.in_memory()).map(|p| p.len()).sum()
    }
}

/// Pieces' bytes concatenated into one buffer, sized up front.
///
/// # Errors
/// A piece whose bytes left memory and cannot be read back as they were.
pub fn join(pieces: &[Arc<Piece>]) -> Result<Vec<u8>, Unreadable> {
    let mut bytes = Vec::with_capacity(pieces.iter().map(|p| p.len()).sum());
    for p in pieces {
        bytes.extend_from_slice(&p.bytes()?);
    }
    Ok(bytes)
}

/// [`Chunked::reader`].
pub struct ChunkReader<'a> {
    chunked: &'a Chunked,
    /// The chunk after `current`.
    next: u32,
    current: Option<ChunkBytes>,
    /// Bytes of `current` already read.
    at: usize,
}

impl std::io::Read for ChunkReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            if let Some(chunk) = &self.current {
                if self.at < chunk.len() {
                    let n = buf.len().min(chunk.len() - self.at);
                    buf[..n].copy_from_slice(&chunk[self.at..self.at + n]);
                    self.at += n;
                    return Ok(n);
                }
            }
            match self.chunked.chunk(self.next).map_err(std::io::Error::other)? {
                Some(chunk) => {
                    self.current = Some(chunk);
                    self.next += 1;
                    self.at = 0;
                }
                None => {
                    self.current = None;
                    return Ok(0);
                }
            }
        }
    }
}

/// A chunk's digest: its content only. Its place is bound by the Merkle tree, so equal
/// chunks of two snapshots share a digest wherever they sit.
pub fn leaf_digest(data: &[u8]) -> Digest {
    Hasher::new("keel/chunk").bytes(data).finish()
}

/// Binary Merkle tree over the chunk digests (an odd node is promoted), bound to the
/// total length so two snapshots that differ only in trailing bytes differ in root.
pub fn merkle_root(len: u64, leaves: &[Digest]) -> Digest {
    let mut level: Vec<Digest> = leaves.to_vec();
    while level.len() > 1 {
        level = level
            .chunks(2)
            .map(|pair| match pair {
                [l, r] => Hasher::new("keel/merkle").digest(l).digest(r).finish(),
                [one] => *one,
                _ => unreachable!("chunks(2) yields one or two"),
            })
            .collect();
    }
    let top = level.first().copied().unwrap_or_default();
    Hasher::new("keel/root").u64(len).u64(leaves.len() as u64).digest(&top).finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Bytes without structure (so the chunker cuts by its rolling hash, not by runs).
    fn noise(len: usize, mut x: u64) -> Vec<u8> {
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    #[test]
    fn merkle_root_depends_on_every_chunk_and_the_length() {
        let a = Chunked::new(noise(8192, 1), 256);
        assert!(a.leaves.len() > 8, "{} chunks", a.leaves.len());
        for i in [0, 4000, 8191] {
            let mut bytes = a.to_bytes().expect("in memory");
            bytes[i] ^= 1;
            assert_ne!(Chunked::new(bytes, 256).root, a.root, "byte {i}");
        }
        let mut longer = a.to_bytes().expect("in memory");
        longer.push(0);
        assert_ne!(Chunked::new(longer, 256).root, a.root);
        assert_eq!(merkle_root(a.len(), &a.leaves), a.root);
        assert!(a.chunk(a.leaves.len() as u32).expect("in memory").is_none());
    }

    #[test]
    fn chunks_cover_the_bytes_within_their_bounds() {
        for (len, avg) in [(0, 256), (100, 256), (70_000, 256), (300_000, 4096)] {
            let bytes = noise(len, len as u64 + 7);
            let c = Chunked::new(bytes.clone(), avg);
            let (min, max) = chunk_bounds(avg);
            let joined: Vec<u8> = c.chunks().flat_map(|(_, d)| d.expect("in memory").to_vec()).collect();
            assert_eq!(joined, bytes);
            assert_eq!(c.to_bytes().expect("in memory"), bytes);
            let count = c.leaves.len();
            for (i, (digest, data)) in c.chunks().enumerate() {
                let data = data.expect("in memory");
                assert!(data.len() <= max && (data.len() >= min || i + 1 == count), "chunk {i}: {} bytes", data.len());
                assert_eq!(leaf_digest(&data), *digest);
            }
        }
    }

    #[test]
    fn an_insertion_changes_only_the_chunks_around_it() {
        // What lets a restarted transfer reuse what it fetched: fixed-size chunks would
        // all change after the insertion point.
        let before = noise(64 << 10, 3);
        let mut after = before.clone();
        after.splice(20_000..20_000, noise(10, 9));
        let (a, b) = (Chunked::new(before, 256), Chunked::new(after, 256));
        let kept = b.leaves.iter().filter(|d| a.leaves.contains(d)).count();
        assert!(kept + 3 >= b.leaves.len(), "{kept} of {} chunks kept", b.leaves.len());
    }

    #[test]
    fn pieces_are_cut_on_their_own_and_their_chunks_rebuild_the_same_root() {
        let (x, y) = (noise(5000, 1), noise(7000, 2));
        let pieces = Chunked::from_pieces(vec![Piece::new(x.clone()), Piece::new(y.clone())], 256);
        let joined = Chunked::new([x.clone(), y].concat(), 256);
        assert_eq!(pieces.to_bytes().expect("in memory"), joined.to_bytes().expect("in memory"));
        assert_ne!(pieces.root, joined.root, "piece boundaries are chunk boundaries");
        // A piece's chunks are its own cut: the first piece alone has the same leaves.
        let alone = Chunked::new(x, 256);
        assert_eq!(pieces.leaves[..alone.leaves.len()], alone.leaves[..]);
        // What a transfer or a restart rebuilds from the chunks has the same root.
        let rebuilt = Chunked::from_chunks(pieces.chunks().map(|(_, c)| c.expect("in memory").to_vec()).collect());
        assert_eq!(rebuilt.root, pieces.root);
        assert_eq!(rebuilt.leaves, pieces.leaves);
        assert_eq!(rebuilt.to_bytes().expect("in memory"), pieces.to_bytes().expect("in memory"));
    }

    #[test]
    fn a_piece_handed_back_is_not_cut_again() {
        let piece = Piece::new(noise(9000, 5));
        let first = Chunked::from_pieces(vec![piece.clone(), Piece::new(b"head".to_vec())], 256);
        assert!(piece.cut.get().is_some(), "the cut is kept with the piece");
        let again = Chunked::from_pieces(vec![piece.clone(), Piece::new(b"head".to_vec())], 256);
        assert_eq!(again.root, first.root);
        // Another chunk size gets its own cut (not the kept one).
        let other = Chunked::from_pieces(vec![piece], 1024);
        assert_eq!(other.root, Chunked::new(noise(9000, 5), 1024).root);
    }
    /// Chunks "stored" in memory, by digest, counting reads; `corrupt` flips a byte of
    /// every read, `fail` makes reads fail.
    #[derive(Default)]
    struct Shelf {
        chunks: std::sync::Mutex<std::collections::HashMap<Digest, Vec<u8>>>,
        reads: std::sync::atomic::AtomicUsize,
        corrupt: std::sync::atomic::AtomicBool,
        fail: std::sync::atomic::AtomicBool,
    }

    struct OnShelf(Arc<Shelf>, Digest);

    impl StoredChunk for OnShelf {
        fn read(&self) -> std::io::Result<Vec<u8>> {
            use std::sync::atomic::Ordering::Relaxed;
            self.0.reads.fetch_add(1, Relaxed);
            if self.0.fail.load(Relaxed) {
                return Err(std::io::Error::other("disk gone"));
            }
            let mut bytes = self.0.chunks.lock().expect("lock")[&self.1].clone();
            if self.0.corrupt.load(Relaxed) {
                bytes[0] ^= 1;
            }
            Ok(bytes)
        }
    }

    impl Shelf {
        /// Stores every chunk of `c` (as the runtime's snapshot write does), then lets
        /// its pieces' bytes leave memory.
        fn store(self: &Arc<Self>, c: &Chunked) -> usize {
            for (d, data) in c.chunks() {
                self.chunks.lock().expect("lock").insert(*d, data.expect("in memory").to_vec());
            }
            let shelf = self.clone();
            c.spill(&move |d| {
                let held = shelf.chunks.lock().expect("lock").contains_key(d);
                held.then(|| Arc::new(OnShelf(shelf.clone(), *d)) as Arc<dyn StoredChunk>)
            })
        }

        fn reads(&self) -> usize {
            self.reads.load(std::sync::atomic::Ordering::Relaxed)
        }
    }

    #[test]
    fn spilled_pieces_read_back_the_same_chunks_and_are_reused_without_reading() {
        let (x, y) = (Piece::new(noise(9000, 1)), Piece::new(noise(7000, 2)));
        let c = Chunked::from_pieces(vec![x.clone(), y.clone()], 256);
        let (bytes, chunks): (Vec<u8>, Vec<Vec<u8>>) =
            (c.to_bytes().expect("in memory"), c.chunks().map(|(_, d)| d.expect("in memory").to_vec()).collect());
        let shelf = Arc::new(Shelf::default());
        assert_eq!(shelf.store(&c), 16_000, "both pieces released");
        assert_eq!(c.memory_bytes(), 0);
        assert!(!x.in_memory() && !y.in_memory());
        for (i, want) in chunks.iter().enumerate() {
            assert_eq!(&*c.chunk(i as u32).expect("readable").expect("a chunk"), want.as_slice(), "chunk {i}");
        }
        assert_eq!(c.to_bytes().expect("readable"), bytes);
        assert_eq!(x.bytes().expect("readable").as_slice(), &bytes[..9000]);
        // The next checkpoint hands back one piece unchanged: its cut is kept, nothing is read.
        let reads = shelf.reads();
        let next = Chunked::from_pieces(vec![x.clone(), Piece::new(b"changed".to_vec())], 256);
        assert_eq!(shelf.reads(), reads, "a reused piece is not read back");
        assert_eq!(next.leaves[..next.leaves.len() - 1], c.leaves[..next.leaves.len() - 1]);
        assert_eq!(next.memory_bytes(), 7, "only the new piece is in memory");
        // Spilling again (the next snapshot written) releases only what was in memory.
        assert_eq!(shelf.store(&next), 7);
        // A snapshot made of stored chunks (a node's start) reads back the same.
        let places: Vec<(Digest, usize, Arc<dyn StoredChunk>)> = c
            .leaves
            .iter()
            .zip(&chunks)
            .map(|(d, chunk)| (*d, chunk.len(), Arc::new(OnShelf(shelf.clone(), *d)) as Arc<dyn StoredChunk>))
            .collect();
        let loaded = Chunked::from_stored(places);
        assert_eq!(loaded.root, c.root);
        assert_eq!(loaded.memory_bytes(), 0);
        assert_eq!(loaded.to_bytes().expect("readable"), bytes);
        // Streamed, in reads that straddle chunks, the same bytes again.
        for c in [&c, &loaded] {
            let mut streamed = Vec::new();
            let mut buf = [0u8; 97];
            let mut reader = c.reader();
            loop {
                let n = std::io::Read::read(&mut reader, &mut buf).expect("readable");
                if n == 0 {
                    break;
                }
                streamed.extend_from_slice(&buf[..n]);
            }
            assert_eq!(streamed, bytes);
        }
    }

    #[test]
    fn a_stored_chunk_that_reads_back_wrong_or_not_at_all_is_unreadable_never_other_bytes() {
        let c = Chunked::from_pieces(vec![Piece::new(noise(5000, 3))], 256);
        let shelf = Arc::new(Shelf::default());
        shelf.store(&c);
        shelf.corrupt.store(true, std::sync::atomic::Ordering::Relaxed);
        let e = c.chunk(1).err().expect("a corrupt chunk is refused");
        assert!(e.why.contains("digest") && e.index == 1, "{e}");
        assert!(c.to_bytes().is_err());
        assert!(c.chunks().all(|(_, d)| d.is_err()));
        let mut streamed = Vec::new();
        let e = std::io::Read::read_to_end(&mut c.reader(), &mut streamed).expect_err("a stream through it fails");
        assert!(e.to_string().contains("digest"), "{e}");
        assert!(streamed.is_empty(), "nothing of the corrupt chunk is handed out");
        shelf.corrupt.store(false, std::sync::atomic::Ordering::Relaxed);
        shelf.fail.store(true, std::sync::atomic::Ordering::Relaxed);
        assert!(c.chunk(0).err().expect("a failed read is refused").why.contains("disk gone"));
        // Out of range is no chunk, not an error, whatever the disk does.
        assert!(c.chunk(c.leaves.len() as u32).expect("no read").is_none());
        // A piece whose chunks are not all stored stays in memory.
        let d = Chunked::from_pieces(vec![Piece::new(noise(5000, 4))], 256);
        assert_eq!(d.spill(&|_| None), 0);
        assert_eq!(d.memory_bytes(), 5000);
    }
}
