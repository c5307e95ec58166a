//! Linearizability checker for key-value histories.
//!
//! A history is linearizable if there is a total order of its operations that
//! (a) respects real-time order (if `A` returned before `B` was invoked, `A`
//! comes first) and (b) is a legal sequential execution of the model: every
//! completed operation returns what the model returns at that point.
//!
//! # Algorithm
//!
//! The search is the Wing & Gong algorithm (Wing & Gong, "Testing and
//! verifying concurrent objects", JPDC 1993) with Lowe's memoization (Lowe,
//! "Testing for linearizability", CCPE 2017), the formulation Knossos and
//! Porcupine use:
//!
//! * Every operation contributes a *call* entry at its invoke time and a
//!   *return* entry at its return time, sorted by time into a doubly linked
//!   list.
//! * The operations that may be linearized next (the *candidates*) are those
//!   whose call entry comes before the first return entry: nothing still
//!   unlinearized returned before they were invoked. A depth-first search
//!   tries each candidate whose result matches the model; linearizing one
//!   removes ("lifts") its two entries, and backtracking restores them in
//!   O(1) (dancing links). When no candidate is left to try, the op of the
//!   first return entry cannot be placed after this prefix, so the search
//!   backtracks.
//! * Lowe's memoization: what can follow a prefix depends only on the *set*
//!   of operations linearized and the resulting model state, not on their
//!   order. A hash set of (bitset of linearized operations, state) prunes
//!   every configuration already explored, turning the factorial blow-up of
//!   plain backtracking into one bounded by the number of distinct
//!   configurations.
//!
//! With ~20 concurrent clients that bound is still far too large for a
//! register, mostly because blind writes can be ordered in many ways that are
//! only refuted much later. Three sound reductions (each keeps at least one
//! linearization if any exists, and depends only on the configuration, so it
//! composes with the memoization) make the search practical:
//!
//! * **Forced reads.** A candidate that writes nothing (a Get, a failed CAS)
//!   and matches the current state is linearized immediately, with no
//!   alternatives: moving it forward to this point in any linearization
//!   changes no state and violates no real-time order.
//! * **Value supply.** While the key does not hold `x`, an op that needs `x`
//!   (a Get that returned `x`, a CAS that succeeded expecting `x`) can only be
//!   served by a remaining op that can set `x` and was invoked before the
//!   needing op returned. A move after which some needed value has no such
//!   producer left is refuted at once, instead of when the needing op comes
//!   due with everything explored in between wasted.
//! * **Pending ops only where observed**; see below.
//!
//! # P-compositionality
//!
//! Every operation touches exactly one key and keys are independent registers,
//! so the history is linearizable iff each per-key sub-history is
//! (linearizability is local: Herlihy & Wing 1990; "P-compositionality",
//! Horn & Kroening 2015). Each key is checked separately, which keeps bitsets
//! small and makes the search space a sum over keys instead of a product. The
//! model state per key is `Option<Vec<u8>>` (`None` = absent); every distinct
//! value of a key is interned to a `u32`, so states compare and hash as
//! integers.
//!
//! # Pending operations
//!
//! An operation with `ret == None` never completed: the client cannot know
//! whether it took effect. So it may take effect at any point after its
//! invocation (its return time is +infinity) or not at all, and its result,
//! never observed, is not checked; its effect is still the model's (a pending
//! CAS swaps iff the state matches). Concretely:
//!
//! * A pending op has a call entry but no return entry, so it is a candidate
//!   from its invocation on and never blocks anything.
//! * The search succeeds as soon as every *completed* op is linearized; the
//!   pending ops left over did not take effect. (Taking effect after
//!   everything else would be indistinguishable, as nothing observes it.)
//! * A pending Get has neither effect nor observed result: it is dropped.
//! * A pending op is tried only if it changes the state and another candidate
//!   could observe the new state right after it. Any linearization can be
//!   rewritten into one where that holds (see `KeyHistory::expand`), and
//!   otherwise every pending op would be a candidate at every step for the
//!   rest of the history, doubling the configurations per pending op.
//!
//! # Details
//!
//! Ties: `A` precedes `B` only if `A`'s return time is strictly less than
//! `B`'s invoke time, so call entries sort before return entries at equal
//! times, which makes a return at `t` and an invoke at `t` concurrent.
//!
//! `step_budget` bounds the number of moves (op applications) tried per key,
//! so a pathological history yields [`Verdict::Unknown`] instead of hanging.
//! Memory is proportional to the configurations explored (so also bounded by
//! the budget), at a few words each: the memoized bitsets are stored without
//! their all-ones prefix and all-zeros suffix.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::hash::{BuildHasherDefault, Hasher};

/// A key-value operation as invoked by a client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvOp {
    Get {
        key: Vec<u8>,
    },
    Put {
        key: Vec<u8>,
        value: Vec<u8>,
    },
    Delete {
        key: Vec<u8>,
    },
    /// Compare-and-set: succeeds iff the current value equals `expected` (None = key absent), then sets `new`.
    Cas {
        key: Vec<u8>,
        expected: Option<Vec<u8>>,
        new: Vec<u8>,
    },
}

impl KvOp {
    fn key(&self) -> &[u8] {
        match self {
            KvOp::Get { key } | KvOp::Put { key, .. } | KvOp::Delete { key } | KvOp::Cas { key, .. } => key,
        }
    }
}

/// The result a client observed for a [`KvOp`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvRet {
    /// Result of Get.
    Value(Option<Vec<u8>>),
    /// Result of Put and Delete.
    Done,
    /// Result of Cas: whether it took effect.
    Swapped(bool),
}

/// One entry of a client-observed history.
#[derive(Clone, Debug)]
pub struct Operation {
    pub client: u64,
    pub op: KvOp,
    /// Logical time the client invoked the operation.
    pub invoke: u64,
    /// Logical time and result when the client received the answer; None if it never completed
    /// (it may or may not have taken effect: treat its return time as +infinity and its result as unconstrained).
    pub ret: Option<(u64, KvRet)>,
}

/// Outcome of [`check_kv`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Linearizable,
    /// The key whose sub-history has no linearization, and a short human-readable explanation
    /// (e.g. the ops of that key, sorted by invoke time, at most ~20 lines).
    Violation {
        key: Vec<u8>,
        explanation: String,
    },
    /// The search exceeded `step_budget` state expansions on some key; no verdict.
    Unknown {
        key: Vec<u8>,
    },
}

/// Checks the whole history; the initial state of every key is absent (None).
///
/// Keys are checked independently, in byte order. A violation on any key is
/// reported even if another key ran out of budget (a violation is a definite
/// answer); otherwise the first key that ran out of budget is reported as
/// [`Verdict::Unknown`].
#[must_use]
pub fn check_kv(history: &[Operation], step_budget: u64) -> Verdict {
    let mut by_key: BTreeMap<&[u8], Vec<&Operation>> = BTreeMap::new();
    for op in history {
        by_key.entry(op.op.key()).or_default().push(op);
    }
    let mut unknown = None;
    for (key, ops) in by_key {
        match KeyHistory::new(key, &ops).search(step_budget) {
            Search::Linearizable => {}
            Search::Violation(explanation) => return Verdict::Violation { key: key.to_vec(), explanation },
            Search::OutOfBudget => {
                unknown.get_or_insert_with(|| key.to_vec());
            }
        }
    }
    match unknown {
        Some(key) => Verdict::Unknown { key },
        None => Verdict::Linearizable,
    }
}

/// Per-key model state: `None` = absent, `Some(id)` = the interned value `id`.
type State = Option<u32>;

/// An operation compiled against the per-key model, with values interned.
#[derive(Clone, Copy, Debug)]
enum Step {
    /// A completed Get that observed this state.
    Read(State),
    /// Put (`Some`) or Delete (`None`), completed or pending; always returns Done.
    Write(State),
    /// Compare-and-set; `swapped` is the observed outcome, `None` if pending.
    Cas { expected: State, new: u32, swapped: Option<bool> },
    /// A completed operation whose result has the wrong shape for its kind
    /// (e.g. a Get that returned `Done`): no model step can produce it.
    Impossible,
}

impl Step {
    /// Whether this op writes nothing and its observed result matches `state`
    /// (a completed Get, or a completed CAS that observed `false`).
    fn is_matching_read(self, state: State) -> bool {
        match self {
            Step::Read(seen) => seen == state,
            Step::Cas { expected, swapped: Some(false), .. } => state != expected,
            _ => false,
        }
    }

    /// The state this op must observe, if it needs one specific state: a
    /// completed Get's result, or a successful CAS's expectation.
    fn needs(self) -> Option<State> {
        match self {
            Step::Read(seen) => Some(seen),
            Step::Cas { expected, swapped: Some(true), .. } => Some(expected),
            _ => None,
        }
    }

    /// The state this op may change the key to: Put/Delete always, a CAS
    /// unless it was observed to fail or sets the value it expects (which
    /// could only "produce" a state that is already there).
    fn may_produce(self) -> Option<State> {
        match self {
            Step::Write(next) => Some(next),
            Step::Cas { expected, new, swapped: Some(true) | None } if expected != Some(new) => Some(Some(new)),
            _ => None,
        }
    }

    /// Applies the step to `state`; `None` if the observed result contradicts the model.
    fn apply(self, state: State) -> Option<State> {
        match self {
            Step::Read(seen) => (seen == state).then_some(state),
            Step::Write(next) => Some(next),
            Step::Cas { expected, new, swapped } => {
                let swaps = state == expected;
                if swapped.is_some_and(|s| s != swaps) {
                    return None;
                }
                Some(if swaps { Some(new) } else { state })
            }
            Step::Impossible => None,
        }
    }
}

/// Interns the distinct values of one key.
#[derive(Default)]
struct Interner<'a> {
    ids: HashMap<&'a [u8], u32>,
    values: Vec<&'a [u8]>,
}

impl<'a> Interner<'a> {
    fn id(&mut self, value: &'a [u8]) -> u32 {
        *self.ids.entry(value).or_insert_with(|| {
            self.values.push(value);
            // More than u32::MAX distinct values cannot be held in memory alongside the history.
            u32::try_from(self.values.len() - 1).expect("fewer than 2^32 distinct values per key")
        })
    }

    fn state(&mut self, value: Option<&'a Vec<u8>>) -> State {
        value.map(|v| self.id(v))
    }
}

/// Sentinel for "no entry" in the linked list.
const NIL: usize = usize::MAX;
/// Index of the list head sentinel.
const HEAD: usize = 0;

/// `FxHash` (as used in rustc): cache keys are several words long and `SipHash`
/// over them would dominate the search. Inputs are not adversarial.
#[derive(Default)]
struct FxHasher(u64);

impl FxHasher {
    fn add(&mut self, word: u64) {
        self.0 = (self.0.rotate_left(5) ^ word).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

impl Hasher for FxHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut word = [0u8; 8];
            word[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(word));
        }
    }

    fn write_u64(&mut self, i: u64) {
        self.add(i);
    }

    fn write_usize(&mut self, i: usize) {
        self.add(i as u64);
    }

    fn finish(&self) -> u64 {
        // The multiply only carries entropy upwards, but the hash table picks
        // buckets by the low bits: without this final mix, keys that differ
        // only in the high bits of their last word all share a bucket.
        let mut h = self.0;
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
        h ^= h >> 33;
        h
    }
}

type FxBuild = BuildHasherDefault<FxHasher>;

/// Result of searching one key.
enum Search {
    Linearizable,
    Violation(String),
    OutOfBudget,
}

/// The call/return entries of one key's ops, sorted by time, as a doubly
/// linked list whose entries can be removed and restored in O(1).
struct EntryList {
    next: Vec<usize>,
    prev: Vec<usize>,
    /// For each entry: the op it belongs to, and whether it is the op's call.
    entry_op: Vec<usize>,
    entry_is_call: Vec<bool>,
    /// For each op: its call entry and its return entry (`NIL` if pending).
    call_entry: Vec<usize>,
    ret_entry: Vec<usize>,
}

impl EntryList {
    fn new(ops: &[&Operation]) -> Self {
        // (time, 0 = call / 1 = return, op): calls sort before returns at equal
        // times, which makes a return at t and an invoke at t concurrent.
        let mut events: Vec<(u64, u8, usize)> = Vec::with_capacity(2 * ops.len());
        for (i, o) in ops.iter().enumerate() {
            events.push((o.invoke, 0, i));
            if let Some((t, _)) = o.ret {
                // A return before the invoke is malformed input; clamping keeps the
                // call entry ahead of its own return, which the search relies on.
                events.push((t.max(o.invoke), 1, i));
            }
        }
        events.sort_unstable();

        // Entry 0 is the head sentinel; events[k] is entry k + 1.
        let len = events.len() + 1;
        let mut list = EntryList {
            next: (1..=len).map(|i| if i == len { NIL } else { i }).collect(),
            prev: (0..len).map(|i| i.checked_sub(1).unwrap_or(NIL)).collect(),
            entry_op: Vec::with_capacity(len),
            entry_is_call: Vec::with_capacity(len),
            call_entry: vec![NIL; ops.len()],
            ret_entry: vec![NIL; ops.len()],
        };
        list.entry_op.push(NIL);
        list.entry_is_call.push(false);
        for (k, &(_, kind, op)) in events.iter().enumerate() {
            list.entry_op.push(op);
            list.entry_is_call.push(kind == 0);
            if kind == 0 {
                list.call_entry[op] = k + 1;
            } else {
                list.ret_entry[op] = k + 1;
            }
        }
        list
    }

    /// The op of `entry` if it is a call entry, i.e. still a candidate when
    /// reached by a scan from the head; `None` at a return entry or the end.
    fn call_at(&self, entry: usize) -> Option<usize> {
        (entry != NIL && self.entry_is_call[entry]).then(|| self.entry_op[entry])
    }

    fn unlink(&mut self, e: usize) {
        let (p, n) = (self.prev[e], self.next[e]);
        self.next[p] = n;
        if n != NIL {
            self.prev[n] = p;
        }
    }

    /// Re-inserts `e` where it was; valid because entries are restored in the
    /// reverse order they were removed (dancing links).
    fn relink(&mut self, e: usize) {
        let (p, n) = (self.prev[e], self.next[e]);
        self.next[p] = e;
        if n != NIL {
            self.prev[n] = e;
        }
    }

    /// Removes a linearized op's entries.
    fn lift(&mut self, op: usize) {
        self.unlink(self.call_entry[op]);
        if self.ret_entry[op] != NIL {
            self.unlink(self.ret_entry[op]);
        }
    }

    /// Undoes the most recent `lift`, which must have been of `op`.
    fn unlift(&mut self, op: usize) {
        if self.ret_entry[op] != NIL {
            self.relink(self.ret_entry[op]);
        }
        self.relink(self.call_entry[op]);
    }
}

/// The set of linearized ops of one key, and its compact memoization key.
///
/// Completed ops are numbered in invoke order, so a set reached by the search
/// is "all ops up to roughly now, plus some of the ops in flight": its words
/// are all ones, then a few mixed words around the current time, then all
/// zeros. The memoization key stores only the mixed words and where they start
/// (an exact encoding, not a hash), so a cache entry costs a few words however
/// long the history is. Pending ops are numbered after all completed ops and
/// get their own words, which are stored in full (there are few of them), so
/// an early pending op that never takes effect does not keep every later word
/// "mixed".
#[derive(Clone)]
struct LinearizedSet {
    words: Vec<u64>,
    /// Words `0..completed_words` hold completed ops; the rest hold pending ops.
    completed_words: usize,
    n_completed: usize,
}

impl LinearizedSet {
    fn new(n_completed: usize, n_pending: usize) -> Self {
        let completed_words = n_completed.div_ceil(64);
        LinearizedSet { words: vec![0; completed_words + n_pending.div_ceil(64)], completed_words, n_completed }
    }

    fn position(&self, op: usize) -> (usize, u64) {
        let bit = if op < self.n_completed { op } else { self.completed_words * 64 + (op - self.n_completed) };
        (bit / 64, 1 << (bit % 64))
    }

    fn insert(&mut self, op: usize) {
        let (w, mask) = self.position(op);
        self.words[w] |= mask;
    }

    fn remove(&mut self, op: usize) {
        let (w, mask) = self.position(op);
        self.words[w] &= !mask;
    }

    fn contains(&self, op: usize) -> bool {
        let (w, mask) = self.position(op);
        self.words[w] & mask != 0
    }

    /// Writes the memoization key of (this set, `state`) into `out`:
    /// `[state, lo, pending words.., completed words lo..hi]`, where the
    /// completed words before `lo` are all ones and from `hi` on all zeros.
    fn memo_key(&self, state: State, out: &mut Vec<u64>) {
        let (completed, pending) = self.words.split_at(self.completed_words);
        let lo = completed.iter().position(|&w| w != !0).unwrap_or(completed.len());
        let hi = completed.iter().rposition(|&w| w != 0).map_or(lo, |i| (i + 1).max(lo));
        out.clear();
        out.push(state.map_or(0, |v| u64::from(v) + 1));
        out.push(lo as u64);
        out.extend_from_slice(pending);
        out.extend_from_slice(&completed[lo..hi]);
    }
}

/// Index of a state in per-state tables: 0 for absent, `v + 1` for value `v`.
fn code(state: State) -> usize {
    state.map_or(0, |v| v as usize + 1)
}

/// Look-ahead on the flow of values, used to prune moves early.
///
/// An unlinearized op that needs the key to hold `x` (a Get that returned
/// `x`, a CAS that succeeded expecting `x`) is a *consumer* of `x`; an
/// unlinearized op that may install `x` is a *producer* of `x`. When the key
/// does not hold `x`, every consumer of `x` needs some producer of `x` to be
/// linearized before it, which requires that producer to have been invoked
/// no later than the consumer returned. A CAS producer moreover needs the
/// key to hold its expected value `e` right before it: either it does now,
/// or some other unlinearized producer of `e` must be invoked no later than
/// the CAS returned (one level of this is checked, not whole chains). A
/// configuration is dead if some consumer of a value the key does not hold
/// has no such producer.
///
/// This matters a lot: without it, linearizing a write too early is only
/// detected when some read of the overwritten value comes due, and the whole
/// search space in between is explored in vain; with it the mistake is
/// caught at the very next state change. The check depends only on the
/// configuration, so it is compatible with memoization.
struct Supply {
    /// Per state code: consumers as (return time, op), sorted.
    consumers: Vec<Vec<(u64, usize)>>,
    /// Per state code: producers, sorted by invoke time.
    producers: Vec<Vec<Producer>>,
    /// Per state code: every list entry before the cursor is linearized.
    consumer_cursor: Vec<usize>,
    producer_cursor: Vec<usize>,
    /// Per op: its (state code, position) in a consumer / producer list.
    consumer_slot: Vec<Option<(usize, usize)>>,
    producer_slot: Vec<Option<(usize, usize)>>,
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Producer {
    invoke: u64,
    op: usize,
    /// For a CAS: the state code it expects and its return time (`u64::MAX`
    /// if pending).
    expects: Option<(usize, u64)>,
}

impl Supply {
    fn new(ops: &[&Operation], steps: &[Step], n_codes: usize) -> Self {
        let mut consumers = vec![Vec::new(); n_codes];
        let mut producers = vec![Vec::new(); n_codes];
        for (op, (o, step)) in ops.iter().zip(steps).enumerate() {
            if let (Some(needed), Some((ret, _))) = (step.needs(), &o.ret) {
                consumers[code(needed)].push((*ret, op));
            }
            if let Some(produced) = step.may_produce() {
                let expects = match *step {
                    Step::Cas { expected, .. } => Some((code(expected), o.ret.as_ref().map_or(u64::MAX, |r| r.0))),
                    _ => None,
                };
                producers[code(produced)].push(Producer { invoke: o.invoke, op, expects });
            }
        }
        let mut consumer_slot = vec![None; ops.len()];
        for (c, list) in consumers.iter_mut().enumerate() {
            list.sort_unstable();
            for (pos, &(_, op)) in list.iter().enumerate() {
                consumer_slot[op] = Some((c, pos));
            }
        }
        let mut producer_slot = vec![None; ops.len()];
        for (c, list) in producers.iter_mut().enumerate() {
            list.sort_unstable();
            for (pos, p) in list.iter().enumerate() {
                producer_slot[p.op] = Some((c, pos));
            }
        }
        Supply {
            consumer_cursor: vec![0; n_codes],
            producer_cursor: vec![0; n_codes],
            consumers,
            producers,
            consumer_slot,
            producer_slot,
        }
    }

    /// Checks that the unlinearized consumers of state `c` can still be served,
    /// given that the key holds `state` (not `c`) after the ops in `set`; on
    /// failure returns the consumer that cannot.
    fn check(&mut self, c: usize, state: usize, set: &LinearizedSet) -> Result<(), usize> {
        let (consumers, cursor) = (&self.consumers[c], &mut self.consumer_cursor[c]);
        while consumers.get(*cursor).is_some_and(|&(_, op)| set.contains(op)) {
            *cursor += 1;
        }
        let producers = &self.producers[c];
        let cursor = &mut self.producer_cursor[c];
        while producers.get(*cursor).is_some_and(|p| set.contains(p.op)) {
            *cursor += 1;
        }
        self.check_from(c, state, set, false)
    }

    /// Like `check`, for an arbitrary set (scanning from the start, without
    /// touching the cursors, which track the search's current set).
    fn check_fresh(&self, c: usize, state: usize, set: &LinearizedSet) -> Result<(), usize> {
        self.check_from(c, state, set, true)
    }

    fn check_from(&self, c: usize, state: usize, set: &LinearizedSet, fresh: bool) -> Result<(), usize> {
        let Some(&(deadline, consumer)) = self.consumers[c][Self::start_of(&self.consumer_cursor, c, fresh)..]
            .iter()
            .find(|&&(_, op)| !set.contains(op))
        else {
            return Ok(());
        };
        let served = self.producers[c][Self::start_of(&self.producer_cursor, c, fresh)..]
            .iter()
            .take_while(|p| p.invoke <= deadline)
            .any(|p| !set.contains(p.op) && self.can_fire(p, deadline, state, set, fresh));
        if served {
            Ok(())
        } else {
            Err(consumer)
        }
    }

    /// Whether the unlinearized producer `p` can still install its value in
    /// time for a consumer returning at `needed_by`: a CAS needs its expected
    /// state now, or from another producer invoked before both it and the
    /// consumer returned.
    fn can_fire(&self, p: &Producer, needed_by: u64, state: usize, set: &LinearizedSet, fresh: bool) -> bool {
        let Some((e, ret)) = p.expects else {
            return true;
        };
        let deadline = ret.min(needed_by);
        e == state
            || self.producers[e][Self::start_of(&self.producer_cursor, e, fresh)..]
                .iter()
                .take_while(|q| q.invoke <= deadline)
                .any(|q| q.op != p.op && !set.contains(q.op))
    }

    /// Where to start scanning list `c`: its cursor, or 0 for an arbitrary set.
    fn start_of(cursors: &[usize], c: usize, fresh: bool) -> usize {
        if fresh {
            0
        } else {
            cursors[c]
        }
    }

    /// Restores the cursor invariant after `op` left the linearized set.
    fn unlinearized(&mut self, op: usize) {
        if let Some((c, pos)) = self.consumer_slot[op] {
            self.consumer_cursor[c] = self.consumer_cursor[c].min(pos);
        }
        if let Some((c, pos)) = self.producer_slot[op] {
            self.producer_cursor[c] = self.producer_cursor[c].min(pos);
        }
    }
}

/// Buffers reused across `KeyHistory::expand` calls.
#[derive(Default)]
struct Scratch {
    /// Pending candidates, as (op, state after it).
    pending: Vec<(usize, State)>,
    wanted: Vec<State>,
}

/// The sub-history of one key, compiled for the search.
struct KeyHistory<'a> {
    key: &'a [u8],
    /// Completed ops in invoke order, then pending ops in invoke order.
    ops: Vec<&'a Operation>,
    n_completed: usize,
    /// Pending Gets, which are dropped (no effect, no observed result).
    dropped_pending_reads: usize,
    steps: Vec<Step>,
    values: Vec<&'a [u8]>,
    list: EntryList,
    supply: Supply,
}

impl<'a> KeyHistory<'a> {
    fn new(key: &'a [u8], history: &[&'a Operation]) -> Self {
        let mut ops: Vec<&Operation> =
            history.iter().copied().filter(|o| o.ret.is_some() || !matches!(o.op, KvOp::Get { .. })).collect();
        let dropped_pending_reads = history.len() - ops.len();
        ops.sort_by_key(|o| (o.ret.is_none(), o.invoke, o.ret.as_ref().map(|r| r.0)));
        let n_completed = ops.iter().filter(|o| o.ret.is_some()).count();

        let mut interner = Interner::default();
        let steps: Vec<Step> = ops
            .iter()
            .map(|o| match (&o.op, &o.ret) {
                (KvOp::Get { .. }, Some((_, KvRet::Value(v)))) => Step::Read(interner.state(v.as_ref())),
                (KvOp::Put { value, .. }, None | Some((_, KvRet::Done))) => Step::Write(Some(interner.id(value))),
                (KvOp::Delete { .. }, None | Some((_, KvRet::Done))) => Step::Write(None),
                (KvOp::Cas { expected, new, .. }, None | Some((_, KvRet::Swapped(_)))) => Step::Cas {
                    expected: interner.state(expected.as_ref()),
                    new: interner.id(new),
                    swapped: match o.ret {
                        Some((_, KvRet::Swapped(s))) => Some(s),
                        _ => None,
                    },
                },
                _ => Step::Impossible,
            })
            .collect();

        KeyHistory {
            key,
            list: EntryList::new(&ops),
            supply: Supply::new(&ops, &steps, interner.values.len() + 1),
            n_completed,
            dropped_pending_reads,
            steps,
            values: interner.values,
            ops,
        }
    }

    /// A candidate op that reads without writing and whose observed result
    /// matches `state`, if any. Such an op can be linearized right now without
    /// losing any solution: every op that must precede it is already
    /// linearized (it is a candidate), and moving it forward from wherever a
    /// solution places it changes no state, since it writes nothing.
    fn forced_read(&self, state: State) -> Option<usize> {
        let mut entry = self.list.next[HEAD];
        while let Some(op) = self.list.call_at(entry) {
            if self.steps[op].is_matching_read(state) {
                return Some(op);
            }
            entry = self.list.next[entry];
        }
        None
    }

    /// Wing & Gong search with Lowe's memoization; see the module docs.
    fn search(mut self, step_budget: u64) -> Search {
        /// A configuration on the current search path: its candidate moves are
        /// `moves[start..]` up to the next node's `start`; `next` is the first
        /// one not tried yet.
        struct Node {
            start: usize,
            next: usize,
        }

        let mut set = LinearizedSet::new(self.n_completed, self.ops.len() - self.n_completed);

        // The key starts absent, so every other value's consumers must be
        // servable from the start (this is where reads of values nobody wrote
        // are caught, without any search).
        for c in 1..=self.values.len() {
            if let Err(consumer) = self.supply.check(c, code(None), &set) {
                let why = format!(
                    "it needs the key to be {}, but nothing that could make it so was invoked before it returned",
                    self.fmt_state(self.steps[consumer].needs().flatten()),
                );
                return Search::Violation(self.explain(&set, None, Some((consumer, why))));
            }
        }

        let mut cache: HashSet<Box<[u64]>, FxBuild> = HashSet::default();
        let mut key = Vec::new();
        // Candidate moves (op, state after it) of every node on the path.
        let mut moves: Vec<(usize, State)> = Vec::new();
        let mut nodes: Vec<Node> = Vec::new();
        // Linearized ops in order, each with the state before it.
        let mut path: Vec<(usize, State)> = Vec::new();
        let mut scratch = Scratch::default();
        let mut state: State = None;
        let mut unlinearized_completed = self.n_completed;
        let mut best = (0, set.clone(), state);
        let mut steps_taken = 0u64;

        loop {
            if unlinearized_completed == 0 {
                // Pending ops not linearized by now simply never took effect.
                return Search::Linearizable;
            }
            let start = moves.len();
            self.expand((&set, state), &mut moves, &mut scratch);
            nodes.push(Node { start, next: start });

            // Take the next untried move, backtracking while there is none.
            loop {
                let Some(node) = nodes.last_mut() else {
                    return Search::Violation(self.explain(&best.1, best.2, None));
                };
                if node.next == moves.len() {
                    moves.truncate(node.start);
                    nodes.pop();
                    if let Some((op, prev_state)) = path.pop() {
                        state = prev_state;
                        set.remove(op);
                        self.supply.unlinearized(op);
                        self.list.unlift(op);
                        if op < self.n_completed {
                            unlinearized_completed += 1;
                        }
                    }
                    continue;
                }
                let (op, new_state) = moves[node.next];
                node.next += 1;
                steps_taken += 1;
                if steps_taken > step_budget {
                    return Search::OutOfBudget;
                }
                set.insert(op);
                if !self.supply_holds(op, (state, new_state), &set) {
                    set.remove(op);
                    self.supply.unlinearized(op);
                    continue;
                }
                set.memo_key(new_state, &mut key);
                if cache.contains(key.as_slice()) {
                    // Already explored from there (it cannot be on the current
                    // path, whose sets are strict subsets), and it failed.
                    set.remove(op);
                    self.supply.unlinearized(op);
                    continue;
                }
                cache.insert(key.as_slice().into());
                path.push((op, state));
                state = new_state;
                self.list.lift(op);
                if op < self.n_completed {
                    unlinearized_completed -= 1;
                }
                if path.len() > best.0 {
                    best = (path.len(), set.clone(), state);
                }
                break;
            }
        }
    }

    /// Appends the moves from the current configuration (set of linearized
    /// ops, implicit in the entry list, and `state`) to `moves`, as (op,
    /// state after it), in the order to try them.
    ///
    /// The candidates are the calls before the first return entry. These
    /// rules prune them, each keeping at least one linearization if any
    /// exists:
    ///
    /// * If a candidate writes nothing and its result matches
    ///   (`forced_read`), it is the only move.
    /// * Completed candidates whose result does not match are dropped.
    /// * If a candidate needs a state that nothing can still produce in time
    ///   (see `Supply`), there are no moves at all.
    /// * A pending op is a move only if it changes the state and some other
    ///   candidate could observe the change right after it: one that needs
    ///   the new value (a Get of it, a CAS expecting it), or a CAS that failed
    ///   expecting the current value. Any linearization can be rewritten to
    ///   satisfy this: a pending op that changes nothing can be dropped; so
    ///   can one followed by a blind write, or by nothing (its value is never
    ///   seen); one followed by a Get or failed CAS that also matches without
    ///   it can be swapped with that op (a pending op precedes nothing in real
    ///   time). Repeating this leaves every pending op right before an op
    ///   that observes it, and that op is a candidate already.
    fn expand(
        &mut self,
        (set, state): (&LinearizedSet, State),
        moves: &mut Vec<(usize, State)>,
        scratch: &mut Scratch,
    ) {
        if let Some(op) = self.forced_read(state) {
            moves.push((op, state));
            return;
        }
        let Scratch { pending, wanted } = scratch;
        pending.clear();
        wanted.clear();
        let moves_start = moves.len();
        // `wanted`: the states some candidate could observe right after a
        // pending op; `any_change_wanted`: whether any change from `state`
        // would do (for a CAS that failed expecting `state`).
        let mut any_change_wanted = false;
        let mut entry = self.list.next[HEAD];
        while let Some(op) = self.list.call_at(entry) {
            entry = self.list.next[entry];
            let step = self.steps[op];
            match step {
                Step::Read(x) | Step::Cas { expected: x, swapped: Some(true) | None, .. } => {
                    if !wanted.contains(&x) {
                        wanted.push(x);
                    }
                }
                Step::Cas { expected, swapped: Some(false), .. } => {
                    any_change_wanted |= expected == state;
                }
                Step::Write(_) | Step::Impossible => {}
            }
            let Some(next) = step.apply(state) else {
                continue;
            };
            if op < self.n_completed {
                moves.push((op, next));
            } else if next != state {
                pending.push((op, next));
            }
        }
        // A candidate waiting for a state the key does not hold, and that no
        // op can still produce in time, makes this configuration dead.
        let now = code(state);
        for &x in wanted.iter() {
            if x != state && self.supply.check(code(x), now, set).is_err() {
                moves.truncate(moves_start);
                return;
            }
        }
        // Pending ops go last: they are never required, and taking one early
        // mostly just clobbers state that others need.
        moves.extend(pending.iter().filter(|&&(_, next)| any_change_wanted || wanted.contains(&next)));
    }

    /// After linearizing `op` (already in `set`), which took the key from
    /// `before` to `after`: can every remaining consumer still be served? Only
    /// the states the move may have cut off need rechecking: the one it left,
    /// and the one it could have produced but did not (a pending CAS that
    /// failed). Consumers starved indirectly, through a CAS that can no longer
    /// fire, are caught by `expand` once they are candidates.
    fn supply_holds(&mut self, op: usize, (before, after): (State, State), set: &LinearizedSet) -> bool {
        let now = code(after);
        if before != after && self.supply.check(code(before), now, set).is_err() {
            return false;
        }
        match self.steps[op].may_produce() {
            Some(produced) if produced != after => self.supply.check(code(produced), now, set).is_ok(),
            _ => true,
        }
    }

    /// Describes a violation: the deepest partial linearization the search
    /// found, and a window of the key's ops around the op it could not get
    /// past. `culprit` names that op and the reason when the violation was
    /// found before searching; otherwise it is the earliest-returning
    /// completed op outside the partial linearization.
    fn explain(&self, best: &LinearizedSet, best_state: State, culprit: Option<(usize, String)>) -> String {
        // Ops listed at most, keeping the whole explanation within ~20 lines.
        const WINDOW: usize = 12;
        let n = self.ops.len();
        let searched = culprit.is_none();
        let (blocking, why, starved) = match culprit {
            Some((op, why)) => (Some(op), Some(why), None),
            None => match (0..self.n_completed)
                .filter(|&i| !best.contains(i))
                .filter_map(|i| Some(((self.ops[i].ret.as_ref()?.0, self.ops[i].invoke), i)))
                .min()
            {
                Some((_, op)) => {
                    let (why, starved) = self.why_blocked(op, best, best_state);
                    (Some(op), Some(why), starved)
                }
                None => (None, None, None),
            },
        };

        // List the ops around the blocking op, and around the op it would
        // starve if that is elsewhere, by invoke time.
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by_key(|&i| (self.ops[i].invoke, self.ops[i].ret.is_none(), i));
        let focus: Vec<usize> =
            [blocking, starved].into_iter().flatten().filter_map(|op| order.iter().position(|&i| i == op)).collect();
        let per_focus = WINDOW / focus.len().max(1);
        let mut ranges: Vec<(usize, usize)> = Vec::new();
        for center in if focus.is_empty() { vec![0] } else { focus } {
            let end = (center.saturating_sub(per_focus / 2) + per_focus).min(n);
            ranges.push((end.saturating_sub(per_focus), end));
        }
        ranges.sort_unstable();
        ranges.dedup_by(|next, prev| {
            let overlap = next.0 <= prev.1;
            if overlap {
                prev.1 = prev.1.max(next.1);
            }
            overlap
        });

        // Writing to a String cannot fail, hence the ignored results.
        let mut s = String::new();
        let _ = write!(
            s,
            "no linearization for key {} ({} ops: {} completed, {} pending",
            fmt_bytes(self.key),
            n + self.dropped_pending_reads,
            self.n_completed,
            n - self.n_completed + self.dropped_pending_reads,
        );
        if self.dropped_pending_reads > 0 {
            let _ = write!(s, "; {} pending gets ignored", self.dropped_pending_reads);
        }
        let _ = writeln!(s, ")");
        if searched {
            let best_len = (0..n).filter(|&i| best.contains(i)).count();
            let _ = writeln!(
                s,
                "deepest partial linearization found: {best_len} ops, leaving the key {}",
                self.fmt_state(best_state)
            );
        }
        if let Some(b) = blocking {
            let _ = writeln!(s, "cannot linearize next: {}", fmt_op(self.ops[b]));
        }
        if let Some(why) = why {
            let _ = writeln!(s, "  because {why}");
        }
        let _ = writeln!(s, "ops by invoke time ('!' = that op, '?' = op it would starve, '*' = linearized):");
        let mut listed_to = 0;
        for &(start, end) in &ranges {
            if start > listed_to {
                let _ = writeln!(s, "  ... ({} ops)", start - listed_to);
            }
            listed_to = end;
            for &i in &order[start..end] {
                let mark = if Some(i) == blocking {
                    '!'
                } else if Some(i) == starved {
                    '?'
                } else if searched && best.contains(i) {
                    '*'
                } else {
                    ' '
                };
                let _ = writeln!(s, "{mark} {}", fmt_op(self.ops[i]));
            }
        }
        if listed_to < n {
            let _ = writeln!(s, "  ... ({} ops)", n - listed_to);
        }
        s
    }

    /// Why `op` cannot follow the partial linearization `set` (which left the
    /// key `state`), and the op that would be starved, if that is the reason.
    fn why_blocked(&self, op: usize, set: &LinearizedSet, state: State) -> (String, Option<usize>) {
        let now = code(state);
        let starving = |c: State| format!("nothing could make the key {} again in time for", self.fmt_state(c));
        // Perhaps the partial linearization already starves some op.
        for c in (0..=self.values.len()).filter(|&c| c != now) {
            if let Err(consumer) = self.supply.check_fresh(c, now, set) {
                let needed = self.steps[consumer].needs().flatten();
                return (format!("{}: {}", starving(needed), fmt_op(self.ops[consumer])), Some(consumer));
            }
        }
        match self.steps[op].apply(state) {
            Some(_) => match self.starved_by(op, set, state) {
                Some((c, consumer)) => {
                    (format!("after it {}: {}", starving(c), fmt_op(self.ops[consumer])), Some(consumer))
                }
                None => ("every order of the ops before it was tried and led to a dead end".to_string(), None),
            },
            None => {
                let mismatch = format!("its result does not match the key being {}", self.fmt_state(state));
                // The candidates whose results match (`op` is one of those
                // with the earliest return, so they were invoked before it).
                let deadline = self.ops[op].ret.as_ref().map_or(u64::MAX, |r| r.0);
                let changers = (0..self.ops.len()).filter(|&m| {
                    !set.contains(m) && self.ops[m].invoke <= deadline && self.steps[m].apply(state).is_some()
                });
                for m in changers {
                    if let Some((c, consumer)) = self.starved_by(m, set, state) {
                        let why = format!(
                            "{mismatch}, and changing it (e.g. by {}) means {}: {}",
                            fmt_op(self.ops[m]),
                            starving(c),
                            fmt_op(self.ops[consumer]),
                        );
                        return (why, Some(consumer));
                    }
                }
                (mismatch, None)
            }
        }
    }

    /// Whether linearizing `m` after `set` (which left the key `state`)
    /// starves an op: the state that op needs, and the op.
    fn starved_by(&self, m: usize, set: &LinearizedSet, state: State) -> Option<(State, usize)> {
        let after = self.steps[m].apply(state)?;
        let mut with_m = set.clone();
        with_m.insert(m);
        // The state it leaves, and the one it could have produced but did not.
        let cut_off = [Some(state), self.steps[m].may_produce()];
        cut_off.into_iter().flatten().filter(|&c| c != after).find_map(|c| {
            let consumer = self.supply.check_fresh(code(c), code(after), &with_m).err()?;
            Some((c, consumer))
        })
    }

    fn fmt_state(&self, state: State) -> String {
        match state {
            None => "absent".to_string(),
            Some(id) => self.fmt_value(id),
        }
    }

    fn fmt_value(&self, id: u32) -> String {
        usize::try_from(id)
            .ok()
            .and_then(|i| self.values.get(i))
            .map_or_else(|| format!("<value #{id}>"), |v| fmt_bytes(v))
    }
}

/// Renders bytes as a quoted string if they are printable UTF-8, else as hex.
fn fmt_bytes(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(s) if s.chars().all(|c| !c.is_control()) => format!("{s:?}"),
        _ => {
            let mut hex = String::from("0x");
            for b in bytes {
                let _ = write!(hex, "{b:02x}");
            }
            hex
        }
    }
}

fn fmt_opt(value: Option<&[u8]>) -> String {
    value.map_or_else(|| "absent".to_string(), fmt_bytes)
}

/// One line per op: `[invoke, return] client: op -> result`.
fn fmt_op(o: &Operation) -> String {
    let op = match &o.op {
        KvOp::Get { .. } => "get".to_string(),
        KvOp::Put { value, .. } => format!("put {}", fmt_bytes(value)),
        KvOp::Delete { .. } => "delete".to_string(),
        KvOp::Cas { expected, new, .. } => {
            format!("cas {} -> {}", fmt_opt(expected.as_deref()), fmt_bytes(new))
        }
    };
    let (ret_time, result) = match &o.ret {
        None => ("inf".to_string(), "pending".to_string()),
        Some((t, r)) => (
            t.to_string(),
            match r {
                KvRet::Value(v) => fmt_opt(v.as_deref()),
                KvRet::Done => "done".to_string(),
                KvRet::Swapped(b) => format!("swapped={b}"),
            },
        ),
    };
    format!("[{:>6}, {:>6}] client {}: {} => {}", o.invoke, ret_time, o.client, op, result)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    const BUDGET: u64 = 10_000_000;

    fn b(s: &str) -> Vec<u8> {
        s.as_bytes().to_vec()
    }

    fn get(key: &str) -> KvOp {
        KvOp::Get { key: b(key) }
    }

    fn put(key: &str, value: &str) -> KvOp {
        KvOp::Put { key: b(key), value: b(value) }
    }

    fn delete(key: &str) -> KvOp {
        KvOp::Delete { key: b(key) }
    }

    fn cas(key: &str, expected: Option<&str>, new: &str) -> KvOp {
        KvOp::Cas { key: b(key), expected: expected.map(b), new: b(new) }
    }

    fn val(v: Option<&str>) -> KvRet {
        KvRet::Value(v.map(b))
    }

    fn done(client: u64, op: KvOp, invoke: u64, ret: u64, result: KvRet) -> Operation {
        Operation { client, op, invoke, ret: Some((ret, result)) }
    }

    fn pending(client: u64, op: KvOp, invoke: u64) -> Operation {
        Operation { client, op, invoke, ret: None }
    }

    fn check(history: &[Operation]) -> Verdict {
        check_kv(history, BUDGET)
    }

    /// Asserts a violation on `key` and returns its explanation.
    fn assert_violation(history: &[Operation], key: &str) -> String {
        match check(history) {
            Verdict::Violation { key: k, explanation } => {
                assert_eq!(k, b(key), "{explanation}");
                explanation
            }
            other => panic!("expected a violation on {key:?}, got {other:?}"),
        }
    }

    #[test]
    fn empty_history_is_linearizable() {
        assert_eq!(check(&[]), Verdict::Linearizable);
        assert_eq!(check_kv(&[], 0), Verdict::Linearizable);
    }

    #[test]
    fn sequential_history_is_linearizable() {
        let h = [
            done(1, get("x"), 0, 1, val(None)),
            done(1, put("x", "a"), 2, 3, KvRet::Done),
            done(2, get("x"), 4, 5, val(Some("a"))),
            done(2, cas("x", Some("a"), "b"), 6, 7, KvRet::Swapped(true)),
            done(1, cas("x", Some("a"), "c"), 8, 9, KvRet::Swapped(false)),
            done(1, get("x"), 10, 11, val(Some("b"))),
            done(2, delete("x"), 12, 13, KvRet::Done),
            done(2, get("x"), 14, 15, val(None)),
            done(1, cas("x", None, "d"), 16, 17, KvRet::Swapped(true)),
            done(1, get("x"), 18, 19, val(Some("d"))),
        ];
        assert_eq!(check(&h), Verdict::Linearizable);
    }

    #[test]
    fn concurrent_overlapping_put_get_is_linearizable() {
        // The put overlaps all three reads, so it can fall between the first
        // (old value) and the second (new value).
        let h = [
            done(1, put("x", "a"), 0, 10, KvRet::Done),
            done(2, get("x"), 1, 3, val(None)),
            done(3, get("x"), 4, 6, val(Some("a"))),
            done(2, get("x"), 7, 9, val(Some("a"))),
        ];
        assert_eq!(check(&h), Verdict::Linearizable);
        // Two overlapping puts may take effect in either order.
        let h = [
            done(1, put("x", "a"), 0, 5, KvRet::Done),
            done(2, put("x", "b"), 1, 6, KvRet::Done),
            done(3, get("x"), 7, 8, val(Some("a"))),
        ];
        assert_eq!(check(&h), Verdict::Linearizable);
    }

    #[test]
    fn reads_cannot_flip_back_during_a_put() {
        // Once a read saw the new value, a later read cannot see the old one.
        let h = [
            done(1, put("x", "a"), 0, 10, KvRet::Done),
            done(2, get("x"), 1, 3, val(Some("a"))),
            done(3, get("x"), 4, 6, val(None)),
        ];
        assert_violation(&h, "x");
    }

    #[test]
    fn stale_read_after_completed_write_is_violation() {
        let h = [
            done(1, put("x", "a"), 0, 1, KvRet::Done),
            done(1, put("x", "b"), 2, 3, KvRet::Done),
            done(2, get("x"), 4, 5, val(Some("a"))),
        ];
        let explanation = assert_violation(&h, "x");
        assert!(explanation.contains("key \"x\""), "{explanation}");
        assert!(explanation.contains("! [     2,      3] client 1: put \"b\" => done"), "{explanation}");
        assert!(explanation.contains("? [     4,      5] client 2: get => \"a\""), "{explanation}");
        assert!(explanation.lines().count() <= 20, "{explanation}");
    }

    #[test]
    fn lost_cas_is_violation() {
        // Sequential: the second CAS must see "1", not "0".
        let h = [
            done(1, put("x", "0"), 0, 1, KvRet::Done),
            done(1, cas("x", Some("0"), "1"), 2, 3, KvRet::Swapped(true)),
            done(2, cas("x", Some("0"), "2"), 4, 5, KvRet::Swapped(true)),
        ];
        assert_violation(&h, "x");
        // Concurrent: still only one of them can win.
        let h = [
            done(1, put("x", "0"), 0, 1, KvRet::Done),
            done(1, cas("x", Some("0"), "1"), 2, 5, KvRet::Swapped(true)),
            done(2, cas("x", Some("0"), "2"), 3, 6, KvRet::Swapped(true)),
        ];
        assert_violation(&h, "x");
        // One winner and one loser is fine, in either order.
        let h = [
            done(1, put("x", "0"), 0, 1, KvRet::Done),
            done(1, cas("x", Some("0"), "1"), 2, 5, KvRet::Swapped(false)),
            done(2, cas("x", Some("0"), "2"), 3, 6, KvRet::Swapped(true)),
            done(3, get("x"), 7, 8, val(Some("2"))),
        ];
        assert_eq!(check(&h), Verdict::Linearizable);
    }

    #[test]
    fn pending_put_explains_later_read() {
        let h = [
            done(1, put("x", "a"), 0, 1, KvRet::Done),
            pending(2, put("x", "b"), 2),
            done(3, get("x"), 10, 11, val(Some("b"))),
            done(3, get("x"), 12, 13, val(Some("b"))),
        ];
        assert_eq!(check(&h), Verdict::Linearizable);
    }

    #[test]
    fn pending_put_not_needed() {
        let h = [
            done(1, put("x", "a"), 0, 1, KvRet::Done),
            pending(2, put("x", "b"), 2),
            pending(3, get("x"), 3),
            done(4, get("x"), 10, 11, val(Some("a"))),
            done(4, get("x"), 12, 13, val(Some("a"))),
        ];
        assert_eq!(check(&h), Verdict::Linearizable);
        // A history of only pending ops constrains nothing.
        let h = [pending(1, put("x", "a"), 0), pending(2, delete("x"), 0)];
        assert_eq!(check(&h), Verdict::Linearizable);
    }

    #[test]
    fn pending_op_takes_effect_after_its_invoke_and_at_most_once() {
        // The read returned before the pending put was invoked.
        let h = [done(1, get("x"), 0, 1, val(Some("b"))), pending(2, put("x", "b"), 2)];
        assert_violation(&h, "x");
        // "b" cannot reappear after being overwritten.
        let h = [
            pending(2, put("x", "b"), 0),
            done(1, get("x"), 1, 2, val(Some("b"))),
            done(1, put("x", "a"), 3, 4, KvRet::Done),
            done(1, get("x"), 5, 6, val(Some("b"))),
        ];
        assert_violation(&h, "x");
    }

    #[test]
    fn pending_cas_result_is_unconstrained_but_effect_is_deterministic() {
        // A pending CAS whose expectation holds may install its value...
        let h = [
            done(1, put("x", "a"), 0, 1, KvRet::Done),
            pending(2, cas("x", Some("a"), "b"), 2),
            done(1, get("x"), 3, 4, val(Some("b"))),
        ];
        assert_eq!(check(&h), Verdict::Linearizable);
        // ...one whose expectation never holds cannot...
        let h = [
            done(1, put("x", "a"), 0, 1, KvRet::Done),
            pending(2, cas("x", Some("z"), "b"), 2),
            done(1, get("x"), 3, 4, val(Some("b"))),
        ];
        assert_violation(&h, "x");
        // ...and one that "sets" the value it expects changes nothing.
        let h = [
            done(1, put("x", "a"), 0, 1, KvRet::Done),
            pending(2, cas("x", Some("b"), "b"), 2),
            pending(3, cas("x", Some("b"), "b"), 2),
            done(1, get("x"), 3, 4, val(Some("b"))),
        ];
        assert_violation(&h, "x");
    }

    #[test]
    fn chains_of_pending_ops() {
        // Two pending ops must both take effect, in order, for the read.
        let h = [
            pending(1, put("x", "a"), 0),
            pending(2, cas("x", Some("a"), "b"), 1),
            done(3, get("x"), 2, 3, val(Some("b"))),
            done(3, get("x"), 4, 5, val(Some("b"))),
        ];
        assert_eq!(check(&h), Verdict::Linearizable);
        // Not if the first one was invoked after the read returned.
        let h = [
            pending(2, cas("x", Some("a"), "b"), 1),
            done(3, get("x"), 2, 3, val(Some("b"))),
            pending(1, put("x", "a"), 4),
        ];
        assert_violation(&h, "x");
        // A pending delete can make a failed CAS's observation hold.
        let h = [
            done(1, put("x", "a"), 0, 1, KvRet::Done),
            pending(2, delete("x"), 2),
            done(3, cas("x", Some("a"), "c"), 3, 4, KvRet::Swapped(false)),
            done(3, get("x"), 5, 6, val(None)),
        ];
        assert_eq!(check(&h), Verdict::Linearizable);
    }

    #[test]
    fn read_of_never_written_value_is_violation() {
        let h = [done(1, put("x", "a"), 0, 5, KvRet::Done), done(2, get("x"), 1, 6, val(Some("zzz")))];
        let explanation = assert_violation(&h, "x");
        assert!(explanation.contains("\"zzz\""), "{explanation}");
    }

    #[test]
    fn multiple_keys_only_one_violated() {
        let h = [
            done(1, put("x", "a"), 0, 1, KvRet::Done),
            done(2, put("y", "a"), 0, 1, KvRet::Done),
            done(3, put("z", "a"), 0, 1, KvRet::Done),
            done(1, put("y", "b"), 2, 3, KvRet::Done),
            done(2, get("x"), 2, 3, val(Some("a"))),
            done(3, get("z"), 2, 3, val(Some("a"))),
            done(1, get("y"), 4, 5, val(Some("a"))), // stale
            done(2, get("x"), 4, 5, val(Some("a"))),
            done(3, delete("z"), 4, 5, KvRet::Done),
        ];
        let explanation = assert_violation(&h, "y");
        assert!(explanation.contains("key \"y\""), "{explanation}");
    }

    #[test]
    fn ties_are_concurrent() {
        // The put returns at 5 and the read is invoked at 5: concurrent, so the
        // read may come first.
        let h = [done(1, put("x", "a"), 0, 5, KvRet::Done), done(2, get("x"), 5, 6, val(None))];
        assert_eq!(check(&h), Verdict::Linearizable);
        // Strictly before: the read must see the put.
        let h = [done(1, put("x", "a"), 0, 4, KvRet::Done), done(2, get("x"), 5, 6, val(None))];
        assert_violation(&h, "x");
    }

    #[test]
    fn zero_length_intervals() {
        let h = [
            done(1, put("x", "a"), 3, 3, KvRet::Done),
            done(1, get("x"), 4, 4, val(Some("a"))),
            done(2, put("x", "b"), 5, 5, KvRet::Done),
            done(2, get("x"), 5, 5, val(Some("a"))), // concurrent with the put at 5
            done(1, get("x"), 6, 6, val(Some("b"))),
        ];
        assert_eq!(check(&h), Verdict::Linearizable);
        let h = [
            done(1, put("x", "a"), 3, 3, KvRet::Done),
            done(2, put("x", "b"), 4, 4, KvRet::Done),
            done(1, get("x"), 5, 5, val(Some("a"))),
        ];
        assert_violation(&h, "x");
    }

    #[test]
    fn result_of_the_wrong_kind_is_violation() {
        let h = [done(1, get("x"), 0, 1, KvRet::Done)];
        assert_violation(&h, "x");
        let h = [done(1, put("x", "a"), 0, 1, KvRet::Swapped(true))];
        assert_violation(&h, "x");
    }

    #[test]
    fn return_before_invoke_is_treated_as_instantaneous() {
        let h = [done(1, put("x", "a"), 5, 2, KvRet::Done), done(2, get("x"), 6, 7, val(Some("a")))];
        assert_eq!(check(&h), Verdict::Linearizable);
    }

    #[test]
    fn budget_one_returns_unknown() {
        let h = [
            done(1, put("x", "a"), 0, 10, KvRet::Done),
            done(2, put("x", "b"), 1, 11, KvRet::Done),
            done(3, get("x"), 2, 12, val(Some("a"))),
            done(4, cas("x", Some("a"), "c"), 3, 13, KvRet::Swapped(true)),
            done(5, get("x"), 14, 15, val(Some("c"))),
        ];
        assert_eq!(check_kv(&h, 1), Verdict::Unknown { key: b("x") });
        assert_eq!(check(&h), Verdict::Linearizable);
    }

    #[test]
    fn violation_beats_unknown_on_another_key() {
        // Key "a" needs several steps; key "b" is refuted without search.
        let mut h: Vec<Operation> = (0..10).map(|c| done(c, put("a", &format!("v{c}")), 0, 100, KvRet::Done)).collect();
        h.push(done(1, get("b"), 0, 1, val(Some("never"))));
        assert!(matches!(check_kv(&h, 3), Verdict::Violation { key, .. } if key == b("b")));
        h.pop();
        assert_eq!(check_kv(&h, 3), Verdict::Unknown { key: b("a") });
    }

    /// Deterministic xorshift64 PRNG, so the randomized tests need no crates.
    struct XorShift(u64);

    impl XorShift {
        fn new(seed: u64) -> Self {
            XorShift(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
        }

        fn next(&mut self) -> u64 {
            let mut x = self.0;
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            self.0 = x;
            x
        }

        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    struct Shape {
        ops: usize,
        clients: usize,
        keys: u64,
        /// Values are drawn from this many; a large number makes them unique.
        values: u64,
        /// A client's op stays pending with probability 1/crash_odds at each
        /// of its two steps (before and after taking effect).
        crash_odds: u64,
    }

    /// A random history that is linearizable by construction: clients invoke
    /// ops, each takes effect atomically on a sequential model at some point
    /// between its invoke and its return, and time advances by 0 or 1 per
    /// event (so ties occur). Clients sometimes "crash", leaving their op
    /// pending either before or after it took effect.
    fn random_history(seed: u64, shape: &Shape) -> Vec<Operation> {
        #[derive(Clone)]
        enum Client {
            Idle,
            Invoked(usize),
            Applied(usize, KvRet),
        }
        let mut rng = XorShift::new(seed);
        let mut model: HashMap<Vec<u8>, Vec<u8>> = HashMap::new();
        let mut clients = vec![Client::Idle; shape.clients];
        let mut history: Vec<Operation> = Vec::new();
        let mut time = 0u64;
        loop {
            let busy = clients.iter().any(|c| !matches!(c, Client::Idle));
            if history.len() >= shape.ops && !busy {
                return history;
            }
            time += rng.below(2);
            let c = rng.below(shape.clients as u64) as usize;
            match clients[c].clone() {
                Client::Idle if history.len() < shape.ops => {
                    let key = format!("k{}", rng.below(shape.keys)).into_bytes();
                    let value = format!("v{}", rng.below(shape.values)).into_bytes();
                    let op = match rng.below(20) {
                        0..=7 => KvOp::Get { key },
                        8..=12 => KvOp::Put { key, value },
                        13..=14 => KvOp::Delete { key },
                        _ => {
                            let expected = match rng.below(3) {
                                // Often expect the current value so swaps succeed.
                                0 | 1 => model.get(&key).cloned(),
                                _ => Some(format!("v{}", rng.below(shape.values)).into_bytes()),
                            };
                            KvOp::Cas { key, expected, new: value }
                        }
                    };
                    clients[c] = Client::Invoked(history.len());
                    history.push(Operation { client: c as u64, op, invoke: time, ret: None });
                }
                Client::Idle => {}
                Client::Invoked(i) => {
                    if rng.below(shape.crash_odds) == 0 {
                        clients[c] = Client::Idle; // never took effect
                        continue;
                    }
                    let ret = match &history[i].op {
                        KvOp::Get { key } => KvRet::Value(model.get(key).cloned()),
                        KvOp::Put { key, value } => {
                            model.insert(key.clone(), value.clone());
                            KvRet::Done
                        }
                        KvOp::Delete { key } => {
                            model.remove(key);
                            KvRet::Done
                        }
                        KvOp::Cas { key, expected, new } => {
                            let swapped = model.get(key) == expected.as_ref();
                            if swapped {
                                model.insert(key.clone(), new.clone());
                            }
                            KvRet::Swapped(swapped)
                        }
                    };
                    clients[c] = Client::Applied(i, ret);
                }
                Client::Applied(i, ret) => {
                    if rng.below(shape.crash_odds) != 0 {
                        history[i].ret = Some((time, ret));
                    } // else: it took effect, but the answer was lost
                    clients[c] = Client::Idle;
                }
            }
        }
    }

    fn completed_reads(history: &[Operation]) -> Vec<usize> {
        (0..history.len()).filter(|&i| matches!(history[i].op, KvOp::Get { .. }) && history[i].ret.is_some()).collect()
    }

    /// Replaces a random completed Get's result with a value nobody wrote;
    /// returns its key.
    fn corrupt_to_unwritten(history: &mut [Operation], seed: u64) -> Vec<u8> {
        let reads = completed_reads(history);
        let i = reads[XorShift::new(seed).below(reads.len() as u64) as usize];
        if let Some((_, r)) = &mut history[i].ret {
            *r = KvRet::Value(Some(b"never-written".to_vec()));
        }
        history[i].op.key().to_vec()
    }

    /// Makes a random completed Get return a value that was definitely
    /// overwritten before it was invoked: the value of a completed Put that
    /// is the only op ever writing it, and that returned before some other
    /// completed state change was invoked that itself returned before the Get
    /// was invoked. Returns the key, or `None` if no read qualifies.
    fn corrupt_to_stale(history: &mut [Operation], seed: u64) -> Option<Vec<u8>> {
        let mut writes: HashMap<(Vec<u8>, Vec<u8>), usize> = HashMap::new();
        for o in history.iter() {
            if let KvOp::Put { key, value: v } | KvOp::Cas { key, new: v, .. } = &o.op {
                *writes.entry((key.clone(), v.clone())).or_default() += 1;
            }
        }
        let ret_time = |o: &Operation| o.ret.as_ref().map(|r| r.0);
        let changes_state = |o: &Operation| match (&o.op, &o.ret) {
            (KvOp::Put { .. } | KvOp::Delete { .. }, Some(_)) => true,
            (KvOp::Cas { .. }, Some((_, r))) => *r == KvRet::Swapped(true),
            _ => false,
        };
        let mut reads = completed_reads(history);
        let mut rng = XorShift::new(seed);
        while !reads.is_empty() {
            let r = reads.swap_remove(rng.below(reads.len() as u64) as usize);
            let key = history[r].op.key().to_vec();
            let r_invoke = history[r].invoke;
            let same_key = history.iter().filter(|o| o.op.key() == key);
            // The latest invoke of a state change that returned before the read.
            let Some(horizon) = same_key
                .clone()
                .filter(|o| changes_state(o) && ret_time(o).is_some_and(|t| t < r_invoke))
                .map(|o| o.invoke)
                .max()
            else {
                continue;
            };
            let stale = same_key
                .filter_map(|w| match (&w.op, ret_time(w)) {
                    (KvOp::Put { value, .. }, Some(t)) if t < horizon => Some((t, value)),
                    _ => None,
                })
                .filter(|(_, value)| writes[&(key.clone(), value.to_vec())] == 1)
                .max()
                .map(|(_, value)| value.clone());
            if let Some(value) = stale {
                let t = ret_time(&history[r])?;
                history[r].ret = Some((t, KvRet::Value(Some(value))));
                return Some(key);
            }
        }
        None
    }

    fn assert_violation_on(history: &[Operation], key: &[u8], what: &str) -> Duration {
        let started = Instant::now();
        let verdict = check(history);
        let elapsed = started.elapsed();
        match verdict {
            Verdict::Violation { key: k, .. } => assert_eq!(k, key, "{what}"),
            other => panic!("{what}: expected a violation, got {other:?}"),
        }
        elapsed
    }

    #[test]
    fn randomized_histories_are_linearizable_until_corrupted() {
        for seed in 1..=60 {
            let shape = Shape {
                ops: 300,
                clients: 1 + (seed as usize % 20),
                keys: 1 + seed % 5,
                values: [2, 4, 16, 1_000_000][seed as usize % 4],
                crash_odds: 30,
            };
            let h = random_history(seed, &shape);
            assert_eq!(check(&h), Verdict::Linearizable, "seed {seed}");

            let mut unwritten = h.clone();
            let key = corrupt_to_unwritten(&mut unwritten, seed);
            assert_violation_on(&unwritten, &key, &format!("seed {seed}, unwritten"));

            if shape.values == 1_000_000 {
                let mut stale = h;
                let key = corrupt_to_stale(&mut stale, seed).expect("some read can be made stale");
                assert_violation_on(&stale, &key, &format!("seed {seed}, stale"));
            }
        }
    }

    /// The size the simulator produces: ~5,000 ops, 20 clients, a few pending.
    /// Run with `--nocapture` to see the timings.
    #[test]
    fn randomized_5000_op_histories() {
        for (keys, values, seed) in [(1, 4, 7), (1, 1_000_000, 8), (5, 16, 9), (20, 1_000_000, 10)] {
            let shape = Shape { ops: 5_000, clients: 20, keys, values, crash_odds: 500 };
            let h = random_history(seed, &shape);
            let pending = h.iter().filter(|o| o.ret.is_none()).count();
            let started = Instant::now();
            assert_eq!(check(&h), Verdict::Linearizable);
            let linearizable = started.elapsed();

            let mut unwritten = h.clone();
            let key = corrupt_to_unwritten(&mut unwritten, seed);
            let unwritten = assert_violation_on(&unwritten, &key, "unwritten");

            // Stale reads can only be planted for sure when values are unique.
            let mut stale = h.clone();
            let stale = match corrupt_to_stale(&mut stale, seed) {
                Some(key) => format!("{:?}", assert_violation_on(&stale, &key, "stale")),
                None => "n/a".to_string(),
            };
            println!(
                "{} ops, {keys} keys, {values} values, 20 clients, {pending} pending: \
                 linearizable in {linearizable:?}; unwritten read refuted in {unwritten:?}; \
                 stale read refuted in {stale}",
                h.len()
            );
        }
    }

    #[test]
    fn explanation_is_short_on_large_histories() {
        let shape = Shape { ops: 2_000, clients: 10, keys: 1, values: 1_000_000, crash_odds: 200 };
        let h = random_history(3, &shape);
        let mut unwritten = h.clone();
        corrupt_to_unwritten(&mut unwritten, 3);
        let mut stale = h;
        corrupt_to_stale(&mut stale, 3).expect("some read can be made stale");
        for (history, needle) in [(unwritten, "never-written"), (stale, "? [")] {
            match check(&history) {
                Verdict::Violation { explanation, .. } => {
                    let lines = explanation.lines().count();
                    assert!(lines <= 20, "{lines} lines:\n{explanation}");
                    assert!(explanation.contains(needle), "{explanation}");
                }
                other => panic!("expected a violation, got {other:?}"),
            }
        }
    }

    /// Applies `op` to the plain model: (result, new state).
    fn model_step(op: &KvOp, state: &Option<Vec<u8>>) -> (KvRet, Option<Vec<u8>>) {
        match op {
            KvOp::Get { .. } => (KvRet::Value(state.clone()), state.clone()),
            KvOp::Put { value, .. } => (KvRet::Done, Some(value.clone())),
            KvOp::Delete { .. } => (KvRet::Done, None),
            KvOp::Cas { expected, new, .. } => {
                let swapped = state == expected;
                let next = if swapped { Some(new.clone()) } else { state.clone() };
                (KvRet::Swapped(swapped), next)
            }
        }
    }

    /// Reference checker: plain Wing & Gong search over all minimal ops, with
    /// Lowe's memoization and none of the reductions, per key (at most 64
    /// ops per key).
    fn reference(history: &[Operation]) -> bool {
        fn search(
            ops: &[&Operation],
            done: u64,
            state: Option<Vec<u8>>,
            seen: &mut HashSet<(u64, Option<Vec<u8>>)>,
        ) -> bool {
            let open = |i: usize| done & (1 << i) == 0;
            if (0..ops.len()).all(|i| !open(i) || ops[i].ret.is_none()) {
                return true;
            }
            for i in (0..ops.len()).filter(|&i| open(i)) {
                let blocked =
                    (0..ops.len()).any(|j| open(j) && ops[j].ret.as_ref().is_some_and(|(t, _)| *t < ops[i].invoke));
                if blocked {
                    continue;
                }
                let (result, next) = model_step(&ops[i].op, &state);
                if ops[i].ret.as_ref().is_some_and(|(_, r)| *r != result) {
                    continue;
                }
                let done = done | 1 << i;
                if seen.insert((done, next.clone())) && search(ops, done, next, seen) {
                    return true;
                }
            }
            false
        }
        let mut by_key: BTreeMap<&[u8], Vec<&Operation>> = BTreeMap::new();
        for o in history {
            by_key.entry(o.op.key()).or_default().push(o);
        }
        by_key.values().all(|ops| {
            assert!(ops.len() <= 64);
            search(ops, 0, None, &mut HashSet::new())
        })
    }

    /// Exhaustive checker for tiny histories: every subset of the pending ops
    /// in every order consistent with real time, no memoization.
    fn brute_force(history: &[Operation]) -> bool {
        fn go(history: &[Operation], used: &mut [bool], state: &mut HashMap<Vec<u8>, Vec<u8>>) -> bool {
            let left: Vec<usize> = (0..history.len()).filter(|&i| !used[i]).collect();
            if left.iter().all(|&i| history[i].ret.is_none()) {
                return true;
            }
            for &i in &left {
                let blocked =
                    left.iter().any(|&j| history[j].ret.as_ref().is_some_and(|(t, _)| *t < history[i].invoke));
                if blocked {
                    continue;
                }
                let key = history[i].op.key().to_vec();
                let before = state.get(&key).cloned();
                let (result, after) = model_step(&history[i].op, &before);
                if history[i].ret.as_ref().is_some_and(|(_, r)| *r != result) {
                    continue;
                }
                let set = |state: &mut HashMap<Vec<u8>, Vec<u8>>, v: Option<Vec<u8>>| match v {
                    Some(v) => state.insert(key.clone(), v),
                    None => state.remove(&key),
                };
                set(state, after);
                used[i] = true;
                let found = go(history, used, state);
                used[i] = false;
                set(state, before);
                if found {
                    return true;
                }
            }
            false
        }
        go(history, &mut vec![false; history.len()], &mut HashMap::new())
    }

    /// Perturbs results and times so that many histories become
    /// non-linearizable, in all sorts of ways.
    fn mutate(history: &mut [Operation], values: u64, rng: &mut XorShift) {
        for o in history.iter_mut() {
            if rng.below(4) == 0 {
                if let Some((t, r)) = &mut o.ret {
                    match r {
                        KvRet::Value(v) => {
                            *v = match rng.below(values + 1) {
                                0 => None,
                                n => Some(format!("v{}", n - 1).into_bytes()),
                            }
                        }
                        KvRet::Swapped(s) => *s = !*s,
                        KvRet::Done => *t += rng.below(3),
                    }
                }
            }
            if rng.below(5) == 0 {
                o.invoke = o.invoke.saturating_sub(rng.below(3));
            }
            if rng.below(30) == 0 {
                o.ret = None;
            }
        }
    }

    #[test]
    fn agrees_with_brute_force_on_small_histories() {
        let mut violations = 0;
        for seed in 1..=4_000u64 {
            let shape = Shape {
                ops: 3 + (seed as usize % 5),
                clients: 1 + (seed as usize % 4),
                keys: 1 + seed % 2,
                values: 2,
                crash_odds: 6,
            };
            let mut h = random_history(seed, &shape);
            mutate(&mut h, shape.values, &mut XorShift::new(seed ^ 0xabcdef));
            let expected = brute_force(&h);
            let verdict = check(&h);
            assert_eq!(verdict == Verdict::Linearizable, expected, "seed {seed}: {verdict:?}\n{h:#?}");
            violations += usize::from(!expected);
        }
        // The mutations must produce a good mix of both verdicts.
        assert!(violations > 800, "only {violations} violations");
    }

    #[test]
    fn agrees_with_plain_search_on_medium_histories() {
        let mut violations = 0;
        for seed in 1..=1_500u64 {
            let values = 2 + seed % 3;
            let shape = Shape {
                ops: 12 + (seed as usize % 29),
                clients: 2 + (seed as usize % 5),
                keys: 1 + seed % 2,
                values,
                crash_odds: 10,
            };
            let mut h = random_history(seed, &shape);
            let mut rng = XorShift::new(seed ^ 0x5eed);
            // Keep a quarter linearizable, so that deep successful searches
            // are compared too.
            if seed % 4 != 0 {
                mutate(&mut h, values, &mut rng);
            }
            let expected = reference(&h);
            let verdict = check(&h);
            assert_eq!(verdict == Verdict::Linearizable, expected, "seed {seed}: {verdict:?}\n{h:#?}");
            violations += usize::from(!expected);
        }
        assert!(violations > 300, "only {violations} violations");
    }
}
