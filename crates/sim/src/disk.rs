//! A simulated disk that loses what was not synced and can tear the last write.
//!
//! Writes queue as pending operations; a sync (completing after a seeded delay) makes a
//! prefix of them durable. A crash drops every pending operation, except that the first
//! pending append may land partially (a torn write), which recovery must detect by its
//! checksum and cut off.

use keel_core::exec::Chunked;
use keel_core::ids::Seq;
use keel_core::replica::Persist;
use keel_core::wal::{decode_log, encode_record, Record};
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeMap;

#[derive(Debug, Clone)]
enum Op {
    Append(Vec<u8>),
    Snapshot(Seq, Chunked),
    Replace { wal: Vec<u8>, snapshots_from: Seq },
}

#[derive(Debug, Default)]
pub struct SimDisk {
    wal: Vec<u8>,
    snapshots: BTreeMap<Seq, Chunked>,
    /// Unsynced operations with their ids.
    pending: Vec<(u64, Op)>,
    next_op: u64,
    /// Id of the last operation queued by [`SimDisk::write`] (not lazy).
    last_eager: u64,
    /// Torn writes that happened, for the report.
    pub torn: u64,
}

impl SimDisk {
    /// Queues a persist request; returns the id a sync must reach to cover it.
    pub fn write(&mut self, p: &Persist) -> u64 {
        let op = match p {
            Persist::Record(r) => Op::Append(encode_record(r)),
            Persist::Snapshot { seq, chunked } => Op::Snapshot(*seq, chunked.clone()),
            Persist::Compact { records, snapshots_from } => {
                Op::Replace { wal: records.iter().flat_map(encode_record).collect(), snapshots_from: *snapshots_from }
            }
        };
        self.next_op += 1;
        self.pending.push((self.next_op, op));
        self.last_eager = self.next_op;
        self.next_op
    }

    /// Queues a record that nothing waits for (`Outputs::persist_lazy`): it becomes
    /// durable only when a later sync covers it, and a crash before that loses it.
    pub fn write_lazy(&mut self, r: &Record) {
        self.next_op += 1;
        self.pending.push((self.next_op, Op::Append(encode_record(r))));
    }

    /// Id of the last queued operation (0 if none ever).
    pub fn last_op(&self) -> u64 {
        self.next_op
    }

    /// Whether an operation that gated messages must wait for is not yet durable.
    pub fn has_pending_eager(&self) -> bool {
        self.pending.iter().any(|(id, _)| *id <= self.last_eager)
    }

    /// Makes every operation up to `upto` durable, in order.
    pub fn sync(&mut self, upto: u64) {
        let split = self.pending.iter().position(|(id, _)| *id > upto).unwrap_or(self.pending.len());
        for (_, op) in self.pending.drain(..split) {
            match op {
                Op::Append(bytes) => self.wal.extend(bytes),
                Op::Snapshot(seq, bytes) => {
                    self.snapshots.insert(seq, bytes);
                }
                Op::Replace { wal, snapshots_from } => {
                    self.wal = wal;
                    self.snapshots = self.snapshots.split_off(&snapshots_from);
                }
            }
        }
    }

    /// Power loss: pending operations vanish; the first pending append may be torn.
    pub fn crash(&mut self, rng: &mut ChaCha8Rng, tear: bool) {
        if tear {
            if let Some((_, Op::Append(bytes))) = self.pending.first() {
                if bytes.len() > 1 {
                    let cut = rng.gen_range(1..bytes.len());
                    let mut partial = bytes[..cut].to_vec();
                    if rng.gen_bool(0.5) {
                        let i = rng.gen_range(0..partial.len());
                        partial[i] ^= 0x5a;
                    }
                    self.wal.extend(partial);
                    self.torn += 1;
                }
            }
        }
        self.pending.clear();
    }

    /// What a restarting node reads: the snapshot and the log's whole records. The torn
    /// tail is truncated, as the runtime does at start.
    pub fn recover(&mut self) -> (Vec<(Seq, Chunked)>, Vec<Record>) {
        let decoded = decode_log(&self.wal);
        self.wal.truncate(decoded.valid_len);
        (self.snapshots.iter().map(|(s, c)| (*s, c.clone())).collect(), decoded.records)
    }

    /// Snapshots held, for the bound check.
    pub fn snapshot_count(&self) -> usize {
        self.snapshots.len()
    }

    /// The checkpoints whose snapshots are held (for reports).
    pub fn snapshot_seqs(&self) -> Vec<Seq> {
        self.snapshots.keys().copied().collect()
    }

    pub fn wal_len(&self) -> usize {
        self.wal.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_core::exec::Chunked;
    use keel_core::ids::View;
    use rand::SeedableRng;

    fn rec(view: u64) -> Persist {
        Persist::Record(Record::View { view: View(view), floor: Seq(0) })
    }

    #[test]
    fn unsynced_writes_are_lost_and_torn_tails_cut() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let mut d = SimDisk::default();
        let a = d.write(&rec(1));
        d.sync(a);
        d.write(&rec(2));
        d.crash(&mut rng, true);
        assert_eq!(d.torn, 1);
        let (_, records) = d.recover();
        assert_eq!(records, vec![Record::View { view: View(1), floor: Seq(0) }]);
        let b = d.write(&rec(3));
        d.sync(b);
        let (_, records) = d.recover();
        assert_eq!(records.len(), 2, "appends after the cut are readable");
    }

    #[test]
    fn replace_and_snapshot_take_effect_at_sync() {
        let mut d = SimDisk::default();
        d.write(&rec(1));
        d.write(&Persist::Snapshot { seq: Seq(8), chunked: Chunked::new(vec![7], 256) });
        d.write(&Persist::Snapshot { seq: Seq(16), chunked: Chunked::new(vec![8], 256) });
        let c = d.write(&Persist::Compact {
            records: vec![Record::View { view: View(9), floor: Seq(0) }],
            snapshots_from: Seq(16),
        });
        assert_eq!(d.recover(), (vec![], vec![]));
        d.sync(c);
        assert_eq!(
            d.recover(),
            (vec![(Seq(16), Chunked::new(vec![8], 256))], vec![Record::View { view: View(9), floor: Seq(0) }])
        );
    }
}
