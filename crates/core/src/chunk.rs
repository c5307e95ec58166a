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

use crate::crypto::{Digest, Hasher};
use std::sync::{Arc, OnceLock};

/// A run of snapshot bytes that is cut into chunks on its own.
pub struct Piece {
    bytes: Vec<u8>,
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

impl Piece {
    pub fn new(bytes: Vec<u8>) -> Arc<Piece> {
        Arc::new(Piece { bytes, cut: OnceLock::new() })
    }

    /// One whole chunk (fetched in a state transfer, or read back from disk): its
    /// boundaries are the ones the snapshot was made with.
    fn chunk(bytes: Vec<u8>) -> Arc<Piece> {
        let cut = Cut { avg: None, ends: vec![bytes.len()], leaves: vec![leaf_digest(&bytes)] };
        Arc::new(Piece { bytes, cut: OnceLock::from(cut) })
    }

    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The chunk ends and digests for chunks of `avg` bytes on average: kept from the
    /// first call (the size is a cluster setting, so it does not change under a piece).
    fn cut(&self, avg: usize) -> (Vec<usize>, Vec<Digest>) {
        let cut = self.cut.get_or_init(|| cut_bytes(&self.bytes, avg));
        if cut.avg.is_some_and(|a| a != avg) {
            let fresh = cut_bytes(&self.bytes, avg);
            return (fresh.ends, fresh.leaves);
        }
        (cut.ends.clone(), cut.leaves.clone())
    }
}

impl std::fmt::Debug for Piece {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Piece({} bytes)", self.bytes.len())
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

/// A checkpoint split into content-defined chunks with a Merkle root over them.
#[derive(Clone, Debug)]
pub struct Chunked {
    /// Shared with the persist request, the state-transfer server and (for pieces a
    /// service keeps) the service: a snapshot is the whole state, never copied per use.
    pieces: Vec<Arc<Piece>>,
    /// Per chunk: its piece and its byte range there.
    spans: Vec<(u32, std::ops::Range<usize>)>,
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
    /// As [`Chunked::new`].
    pub fn from_pieces(pieces: Vec<Arc<Piece>>, avg_chunk: usize) -> Chunked {
        assert!((CHUNK_AVG_MIN..=CHUNK_AVG_MAX).contains(&avg_chunk), "chunk size {avg_chunk} out of range");
        let mut spans = Vec::new();
        let mut leaves = Vec::new();
        for (p, piece) in pieces.iter().enumerate() {
            let (ends, digests) = piece.cut(avg_chunk);
            spans.extend((0..ends.len()).map(|i| (p as u32, span(&ends, i))));
            leaves.extend(digests);
        }
        let len = pieces.iter().map(|p| p.len() as u64).sum();
        let root = merkle_root(len, &leaves);
        Chunked { pieces, spans, leaves, root, len }
    }

    /// A snapshot from its chunks in order (fetched from peers, or read back from disk):
    /// the boundaries are the chunks', so the root is the one they were made under.
    pub fn from_chunks(chunks: Vec<Vec<u8>>) -> Chunked {
        let pieces: Vec<Arc<Piece>> = chunks.into_iter().map(Piece::chunk).collect();
        let spans = pieces.iter().enumerate().map(|(p, piece)| (p as u32, 0..piece.len())).collect();
        let leaves: Vec<Digest> = pieces.iter().flat_map(|p| p.cut(CHUNK_AVG_MIN).1).collect();
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

    pub fn chunk(&self, index: u32) -> Option<&[u8]> {
        let (p, range) = self.spans.get(index as usize)?;
        Some(&self.pieces[*p as usize].bytes()[range.clone()])
    }

    /// Every chunk with its digest.
    pub fn chunks(&self) -> impl Iterator<Item = (&Digest, &[u8])> {
        self.leaves.iter().zip(&self.spans).map(|(d, (p, range))| (d, &self.pieces[*p as usize].bytes()[range.clone()]))
    }

    /// The snapshot's bytes in one buffer (a copy: for restoring, which is rare).
    pub fn to_bytes(&self) -> Vec<u8> {
        join(&self.pieces)
    }
}

/// Pieces' bytes concatenated into one buffer, sized up front.
pub fn join(pieces: &[Arc<Piece>]) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(pieces.iter().map(|p| p.len()).sum());
    for p in pieces {
        bytes.extend_from_slice(p.bytes());
    }
    bytes
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
            let mut bytes = a.to_bytes();
            bytes[i] ^= 1;
            assert_ne!(Chunked::new(bytes, 256).root, a.root, "byte {i}");
        }
        let mut longer = a.to_bytes();
        longer.push(0);
        assert_ne!(Chunked::new(longer, 256).root, a.root);
        assert_eq!(merkle_root(a.len(), &a.leaves), a.root);
        assert_eq!(a.chunk(a.leaves.len() as u32), None);
    }

    #[test]
    fn chunks_cover_the_bytes_within_their_bounds() {
        for (len, avg) in [(0, 256), (100, 256), (70_000, 256), (300_000, 4096)] {
            let bytes = noise(len, len as u64 + 7);
            let c = Chunked::new(bytes.clone(), avg);
            let (min, max) = chunk_bounds(avg);
            let joined: Vec<u8> = c.chunks().flat_map(|(_, d)| d.iter().copied()).collect();
            assert_eq!(joined, bytes);
            assert_eq!(c.to_bytes(), bytes);
            let count = c.leaves.len();
            for (i, (digest, data)) in c.chunks().enumerate() {
                assert!(data.len() <= max && (data.len() >= min || i + 1 == count), "chunk {i}: {} bytes", data.len());
                assert_eq!(leaf_digest(data), *digest);
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
        assert_eq!(pieces.to_bytes(), joined.to_bytes());
        assert_ne!(pieces.root, joined.root, "piece boundaries are chunk boundaries");
        // A piece's chunks are its own cut: the first piece alone has the same leaves.
        let alone = Chunked::new(x, 256);
        assert_eq!(pieces.leaves[..alone.leaves.len()], alone.leaves[..]);
        // What a transfer or a restart rebuilds from the chunks has the same root.
        let rebuilt = Chunked::from_chunks(pieces.chunks().map(|(_, c)| c.to_vec()).collect());
        assert_eq!(rebuilt.root, pieces.root);
        assert_eq!(rebuilt.leaves, pieces.leaves);
        assert_eq!(rebuilt.to_bytes(), pieces.to_bytes());
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
}
