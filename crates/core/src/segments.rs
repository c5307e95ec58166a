//! A large ordered state as snapshot pieces that follow what changed (`chunk.rs`).
//!
//! A checkpoint that serializes every entry, after which the core cuts and hashes every
//! byte, costs the size of the state (about 2 s per checkpoint per node for KV at 1 GB)
//! whatever changed. Instead a service splits its entries (in key order, the bytes
//! unchanged) into *segments* by their keys, and hands back a segment none of whose keys
//! was written since its last checkpoint as the same piece, already cut and hashed. A
//! checkpoint then costs about what was written since the last one. KV's store and
//! coord's data tree use it.
//!
//! The split must be a function of the entries alone, or two nodes with equal states
//! would sign different roots. A segment ends after an entry when, with it, the segment
//! holds at least `target / 4` bytes and a hash of the entry's key falls below
//! `entry bytes / target` (a key-defined cut, as in a prolly tree), or when it holds
//! `4 * target` bytes. Whether an entry ends a segment so depends only on the entries
//! since the segment began.
//!
//! Reuse ([`build`]): walking the previous segments in order, a segment whose key range
//! (from its first key to the next segment's first key) holds no written key, reached
//! while no segment is open, is taken as it is: from-scratch cutting would start a
//! segment at the same key and see the same entries, so it would cut the same way. In any
//! other case the range's entries are cut afresh, which resynchronizes at the next
//! key-defined cut. So the result equals cutting everything afresh, which the tests check
//! (here, and against an uncached state in each service).

use crate::chunk::Piece;
use crate::crypto::Hasher;
use serde::Serialize;
use std::borrow::Borrow;
use std::collections::BTreeSet;
use std::ops::Bound;
use std::sync::Arc;

/// The average bytes a segment covers. The core cuts each segment into chunks of its own
/// size setting, so this only sets how finely changes are tracked: a written key costs its
/// whole segment again.
pub const SEGMENT_TARGET: usize = 64 << 10;

/// How a service splits its entries: the segment size and the domain of the key hash
/// that places cuts (each service its own, so that their roots never depend on another
/// service's choice). All nodes must use the same.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Split {
    pub domain: &'static str,
    pub target: usize,
}

/// One run of entries in key order, serialized.
#[derive(Clone, Debug)]
pub struct Segment<K> {
    /// Its first key: the segment covers the keys from it to the next segment's first.
    pub first: K,
    pub piece: Arc<Piece>,
}

/// Segments as cutting opens and closes them.
pub struct Cutter<K> {
    split: Split,
    first: Option<K>,
    bytes: Vec<u8>,
    done: Vec<Segment<K>>,
}

impl<K: Clone> Cutter<K> {
    pub fn new(split: Split) -> Cutter<K> {
        Cutter { split, first: None, bytes: Vec::new(), done: Vec::new() }
    }

    /// No segment is open: the next entry starts one.
    fn fresh(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Appends one entry, `entry` in postcard (for a map: the key, then the value).
    pub fn push<Q, E>(&mut self, key: &Q, entry: &E)
    where
        Q: ?Sized + ToOwned<Owned = K> + AsRef<[u8]>,
        E: Serialize + ?Sized,
    {
        if self.fresh() {
            self.first = Some(key.to_owned());
            self.bytes.reserve(self.split.target.saturating_mul(2));
        }
        let before = self.bytes.len();
        let bytes = std::mem::take(&mut self.bytes);
        // Serializing into a Vec fails only for types postcard cannot encode (none of
        // the services' entries); an empty entry then would show as a root mismatch.
        self.bytes = postcard::to_extend(entry, bytes).unwrap_or_default();
        let entry = self.bytes.len().saturating_sub(before);
        if ends_segment(self.split, self.bytes.len(), key.as_ref(), entry) {
            self.close();
        }
    }

    fn close(&mut self) {
        if let Some(first) = self.first.take().filter(|_| !self.fresh()) {
            let mut bytes = std::mem::take(&mut self.bytes);
            // Reserved for twice the target: cached segments live as long as checkpoints
            // do, so the spare capacity would double their memory.
            bytes.shrink_to_fit();
            self.done.push(Segment { first, piece: Piece::new(bytes) });
        }
    }

    fn take(&mut self, old: &Segment<K>) {
        debug_assert!(self.fresh());
        self.done.push(old.clone());
    }

    pub fn finish(mut self) -> Vec<Segment<K>> {
        self.close();
        self.done
    }
}

/// Whether a segment that holds `len` bytes after an entry of `entry` bytes with `key`
/// ends there.
fn ends_segment(split: Split, len: usize, key: &[u8], entry: usize) -> bool {
    let target = split.target;
    if len >= target.saturating_mul(4) {
        return true;
    }
    if len < target / 4 {
        return false;
    }
    // P(cut) = entry / target: segments hold about `target` bytes whatever the entry
    // sizes. The hash is public, so a client can choose keys that cut or do not cut; that
    // only moves segment sizes within target / 4 ..= 4 x target (plus one entry), and
    // the split stays a function of the state.
    let h = Hasher::new(split.domain).bytes(key).finish().prefix_u64();
    u128::from(h) * (target as u128) < (entry as u128) << 64
}

/// The segments of a state whose entries `range` yields (in key order, for any key
/// range, as (key, entry to serialize)), given the segments of an earlier state and
/// every key written since (`None`: cut everything).
pub fn build<'a, Q, E, I>(
    split: Split,
    old: Option<&[Segment<Q::Owned>]>,
    written: &BTreeSet<Q::Owned>,
    range: impl Fn(Bound<&Q>, Bound<&Q>) -> I,
) -> Vec<Segment<Q::Owned>>
where
    Q: ?Sized + Ord + ToOwned + AsRef<[u8]> + 'a,
    Q::Owned: Ord + Clone,
    E: Serialize,
    I: Iterator<Item = (&'a Q, E)>,
{
    let mut cut = Cutter::new(split);
    let old = old.unwrap_or(&[]);
    if old.is_empty() {
        for (k, e) in range(Bound::Unbounded, Bound::Unbounded) {
            cut.push(k, &e);
        }
        return cut.finish();
    }
    for (i, seg) in old.iter().enumerate() {
        // The first segment's range starts below every key: a key inserted before the
        // old first key falls in it.
        let lo = if i == 0 { Bound::Unbounded } else { Bound::Included(seg.first.borrow()) };
        let hi = old.get(i + 1).map_or(Bound::Unbounded, |s| Bound::Excluded(s.first.borrow()));
        let clean = written.range::<Q, _>((lo, hi)).next().is_none();
        if clean && cut.fresh() {
            cut.take(seg);
            continue;
        }
        for (k, e) in range(lo, hi) {
            cut.push(k, &e);
        }
    }
    cut.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_bytes::Bytes;
    use std::collections::BTreeMap;

    type State = BTreeMap<Vec<u8>, Vec<u8>>;
    type Segment = super::Segment<Vec<u8>>;

    fn segments(target: usize, state: &State, old: Option<&[Segment]>, written: &BTreeSet<Vec<u8>>) -> Vec<Segment> {
        let split = Split { domain: "keel/test-segment", target };
        build(split, old, written, |lo, hi| {
            state.range::<[u8], _>((lo, hi)).map(|(k, v)| (k.as_slice(), (Bytes::new(k), Bytes::new(v))))
        })
    }

    fn shape(segs: &[Segment]) -> Vec<(Vec<u8>, Vec<u8>)> {
        segs.iter().map(|s| (s.first.clone(), s.piece.bytes().expect("in memory").to_vec())).collect()
    }

    fn key(i: u16) -> Vec<u8> {
        format!("key/{i:05}").into_bytes()
    }

    #[derive(Clone, Debug)]
    enum Op {
        Put(u16, usize),
        Delete(u16),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0..600u16, 0..300usize).prop_map(|(k, len)| Op::Put(k, len)),
            1 => (0..600u16).prop_map(Op::Delete),
        ]
    }

    fn apply(state: &mut State, written: &mut BTreeSet<Vec<u8>>, op: &Op) {
        match op {
            Op::Put(k, len) => {
                state.insert(key(*k), vec![*k as u8; *len]);
                written.insert(key(*k));
            }
            Op::Delete(k) => {
                state.remove(&key(*k));
                written.insert(key(*k));
            }
        }
    }

    proptest! {
        /// Reusing unchanged segments gives exactly what cutting afresh gives, across
        /// rounds of random writes (inserts before the first key and after the last
        /// included), and the bytes are the entries in key order.
        #[test]
        fn reuse_equals_cutting_afresh(rounds in proptest::collection::vec(proptest::collection::vec(op(), 0..40), 1..6)) {
            let target = 1024;
            let mut state = State::new();
            // Keys from 20 up, so writes also land below the first key (the first
            // segment's range is unbounded below).
            for i in 0..400 {
                state.insert(key(20 + i * 3 % 580), vec![7; (i as usize * 37) % 200]);
            }
            let mut prev = segments(target, &state, None, &BTreeSet::new());
            let mut reused = 0;
            for round in rounds {
                let mut written = BTreeSet::new();
                for op in &round {
                    apply(&mut state, &mut written, op);
                }
                let next = segments(target, &state, Some(&prev), &written);
                let afresh = segments(target, &state, None, &BTreeSet::new());
                prop_assert_eq!(shape(&next), shape(&afresh));
                let joined: Vec<u8> = next.iter().flat_map(|s| s.piece.bytes().expect("in memory").to_vec()).collect();
                let expected: Vec<u8> = state.iter().flat_map(|(k, v)| postcard::to_allocvec(&(Bytes::new(k), Bytes::new(v))).unwrap_or_default()).collect();
                prop_assert_eq!(joined, expected);
                reused += next.iter().filter(|s| prev.iter().any(|p| Arc::ptr_eq(&p.piece, &s.piece))).count();
                prev = next;
            }
            // Few writes leave most segments as they were.
            prop_assert!(reused > 0 || prev.len() <= 2);
        }
    }

    #[test]
    fn a_written_key_that_is_not_reported_leaves_a_stale_segment() {
        // The check above can fail: reuse without the written keys keeps old bytes.
        let target = 1024;
        let mut state: State = (0..400).map(|i| (key(i), vec![1; 100])).collect();
        let prev = segments(target, &state, None, &BTreeSet::new());
        assert!(prev.len() > 10, "{} segments", prev.len());
        state.insert(key(200), vec![2; 100]);
        let stale = segments(target, &state, Some(&prev), &BTreeSet::new());
        let afresh = segments(target, &state, None, &BTreeSet::new());
        assert_ne!(shape(&stale), shape(&afresh));
        let told = segments(target, &state, Some(&prev), &BTreeSet::from([key(200)]));
        assert_eq!(shape(&told), shape(&afresh));
        let kept = told.iter().filter(|s| prev.iter().any(|p| Arc::ptr_eq(&p.piece, &s.piece))).count();
        assert!(
            kept + 2 >= told.len(),
            "one write re-cuts its own segment (and maybe the next): {kept} of {}",
            told.len()
        );
    }

    #[test]
    fn segments_hold_about_the_target_and_never_over_four_times_it() {
        let target = 4096;
        let state: State = (0..3000u16).map(|i| (key(i), vec![0; usize::from(i % 97)])).collect();
        let segs = segments(target, &state, None, &BTreeSet::new());
        let total: usize = segs.iter().map(|s| s.piece.len()).sum();
        let avg = total / segs.len();
        assert!((target / 2..target * 2).contains(&avg), "{} segments, {avg} bytes on average", segs.len());
        assert!(segs.iter().all(|s| s.piece.len() < target * 4 + 200));
        assert!(segs[..segs.len() - 1].iter().all(|s| s.piece.len() >= target / 4));
    }
}
