//! Which writes of a front end's current epoch executed, so that their PrepareData can
//! be told from the PrepareData of writes still on their way.
//!
//! A front end numbers each epoch's writes from 1 and orders them nearly in that order
//! (up to `front::WRITES_IN_FLIGHT` at once), so the executed ones are "every seq up to
//! `low`" plus a few above it. A hole below them (a write the front end gave up on) ends
//! the epoch soon: the front end's next write renews it.
//!
//! Forgetting is the safe direction. A write this record does not know of only keeps its
//! PrepareData until the epoch ends, as before; a write it wrongly called executed would
//! lose a copy of data the cluster is about to order. So past [`ABOVE_MAX`] the oldest
//! entries above `low` are forgotten, never folded into `low`.

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// Most seqs remembered above `low`: four times the writes a front end has in flight.
pub const ABOVE_MAX: usize = 4096;

/// The executed writes of one front end's epoch `epoch`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Executed {
    epoch: u64,
    /// Every seq in `1..=low` executed.
    low: u64,
    /// Executed seqs above `low + 1` (so never `low + 1` itself).
    above: BTreeSet<u64>,
}

impl Executed {
    /// Nothing of `epoch` executed yet.
    pub fn new(epoch: u64) -> Executed {
        Executed { epoch, low: 0, above: BTreeSet::new() }
    }

    /// Whether write `seq` of `epoch` is known to have executed. Seq 0 is never a write
    /// (a front end numbers from 1), so it counts as executed and is refused.
    pub fn contains(&self, epoch: u64, seq: u64) -> bool {
        epoch == self.epoch && (seq <= self.low || self.above.contains(&seq))
    }

    /// Write `seq` of `epoch` executed. A newer epoch starts the record afresh; an older
    /// one is not recorded (its PrepareData goes when the epoch's end is executed).
    pub fn record(&mut self, epoch: u64, seq: u64) {
        if epoch > self.epoch {
            *self = Executed::new(epoch);
        }
        if epoch < self.epoch || seq <= self.low {
            return;
        }
        self.above.insert(seq);
        while self.above.first() == Some(&(self.low + 1)) {
            self.above.pop_first();
            self.low += 1;
        }
        while self.above.len() > ABOVE_MAX {
            self.above.pop_first();
        }
    }
}

/// Front end `owner`'s write `seq` of `epoch` executed. The agreed metadata and each
/// node's mirror of it change only through this and [`epoch_began`], so they stay the
/// same.
pub fn record(records: &mut BTreeMap<u32, Executed>, owner: u32, epoch: u64, seq: u64) {
    records.entry(owner).or_insert_with(|| Executed::new(epoch)).record(epoch, seq);
}

/// Front end `owner` began `epoch`: its record of an older epoch is of no more use (a
/// record of a later epoch, from writes ordered ahead of their epoch, stays).
pub fn epoch_began(records: &mut BTreeMap<u32, Executed>, owner: u32, epoch: u64) {
    if records.get(&owner).is_some_and(|e| e.epoch < epoch) {
        records.remove(&owner);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seqs_in_any_order_fold_into_low() {
        let mut e = Executed::new(3);
        for seq in [2, 4, 1] {
            e.record(3, seq);
        }
        assert_eq!((e.low, e.above.iter().copied().collect::<Vec<_>>()), (2, vec![4]));
        assert!(e.contains(3, 1) && e.contains(3, 2) && e.contains(3, 4));
        assert!(!e.contains(3, 3) && !e.contains(3, 5), "not executed");
        assert!(!e.contains(2, 1) && !e.contains(4, 1), "another epoch's seq 1");
        e.record(3, 3);
        assert_eq!((e.low, e.above.len()), (4, 0));
    }

    #[test]
    fn a_newer_epoch_starts_afresh_and_an_older_one_is_ignored() {
        let mut e = Executed::new(1);
        e.record(1, 1);
        e.record(2, 5);
        assert!(!e.contains(1, 1) && e.contains(2, 5) && !e.contains(2, 1));
        e.record(1, 2);
        assert_eq!(e, {
            let mut f = Executed::new(2);
            f.record(2, 5);
            f
        });
    }

    #[test]
    fn a_begun_epoch_drops_only_older_records() {
        let mut records = BTreeMap::new();
        records.insert(1, Executed::new(3));
        records.insert(2, Executed::new(5));
        epoch_began(&mut records, 1, 4);
        epoch_began(&mut records, 2, 4);
        assert_eq!(records.keys().copied().collect::<Vec<_>>(), vec![2], "owner 2's epoch 5 record stays");
    }

    #[test]
    fn past_the_cap_the_oldest_are_forgotten_not_assumed() {
        let mut e = Executed::new(1);
        // Seq 1 never executes: everything above it stays in `above`.
        for seq in 2..ABOVE_MAX as u64 + 12 {
            e.record(1, seq);
        }
        assert_eq!(e.above.len(), ABOVE_MAX);
        assert!(!e.contains(1, 1), "the hole is never taken as executed");
        assert!(!e.contains(1, 2), "forgotten: its PrepareData waits for the epoch's end");
        assert!(e.contains(1, ABOVE_MAX as u64 + 11));
    }
}
