//! KV under Keel's simulator: the workload (a few hot keys, mixed gets, puts, deletes,
//! compare-and-sets and watches) and how its histories are judged (linearizability per
//! key with the simulator's Wing-Gong checker, and the serializable-read check), plus the
//! simulator's checker suite (`tests/checkers.rs`), whose runs are KV runs.
//!
//! It lives beside the service rather than inside the simulator so that the simulator
//! depends on no service (issue #22): another service plugs in the same way, with a
//! [`Workload`] of its own.

pub mod serializable;

use keel_core::message::ReadConsistency;
use keel_kv::{Kv, KvRequest, KvResponse};
use keel_sim::linearizability::{check_kv, KvOp, KvRet, Operation, Verdict};
use keel_sim::{run_seed, HistoryEntry, SeedReport, SimOptions, Workload};
use rand::Rng;
use rand_chacha::ChaCha8Rng;

/// Runs the KV workload for one seed; with agreed-time ticks on, its watches lease
/// for three ticks, so ticks end them.
pub fn run_kv_seed(opts: &SimOptions) -> SeedReport {
    run_seed(opts, KvWorkload::new(3).with_lease_ms(3 * opts.options.tick_ms))
}

/// The KV workload: a few hot keys, mixed reads, writes, deletes and CAS, checked for
/// linearizability (Wing & Gong with memoization, per key).
pub struct KvWorkload {
    keys: u8,
    /// Each put writes a value never written before, so reads identify their write.
    counter: u64,
    /// Values recently written per key (by any client), for CAS guesses that can succeed.
    recent: Vec<Vec<Vec<u8>>>,
    /// Cold keys written so far (each once, never again).
    cold_written: u32,
    /// The lease watches ask for (0: the KV default of a minute, longer than a run).
    lease_ms: u64,
}

/// Cold keys and their value size: written once early, they make a snapshot span tens
/// of chunks that stay the same from checkpoint to checkpoint, so state transfers that
/// restart, or start from a node's own older snapshot, have chunks to reuse.
const COLD_KEYS: u32 = 24;
const COLD_VALUE_BYTES: usize = 400;

impl KvWorkload {
    pub fn new(keys: u8) -> KvWorkload {
        let keys = keys.max(1);
        KvWorkload { keys, counter: 0, recent: vec![Vec::new(); keys as usize], cold_written: 0, lease_ms: 0 }
    }

    /// Watches with leases of `lease_ms`, short enough to end within a run: with
    /// agreed-time ticks on, nodes then drop them at ticks (`Kv::on_tick`), a change of
    /// replicated state no request makes, which checkpoint agreement checks.
    pub fn with_lease_ms(self, lease_ms: u64) -> KvWorkload {
        KvWorkload { lease_ms, ..self }
    }
}

/// KV checkpoint segment size in simulations (keel_kv::SEGMENT_TARGET in production).
const SEGMENT_BYTES: usize = 512;

/// State expansions the linearizability search may use per key before giving up.
const LINEARIZABILITY_BUDGET: u64 = 5_000_000;

impl Workload for KvWorkload {
    type Service = Kv;

    fn service(&self) -> Kv {
        // Small segments: the simulated states are small, and checkpoints should reuse
        // and re-cut segments under every fault, as they do at scale.
        Kv::with_segment_target(SEGMENT_BYTES)
    }

    fn unobserved_op(&self) -> Option<Vec<u8>> {
        // Checked keys are `k` followed by one byte.
        Some(KvRequest::Put { key: b"faulty-client".to_vec(), value: b"x".to_vec() }.encode())
    }

    fn next_op(&mut self, rng: &mut ChaCha8Rng, client: u64) -> Vec<u8> {
        if self.cold_written < COLD_KEYS && rng.gen_ratio(1, 4) {
            let key = format!("cold-{}", self.cold_written).into_bytes();
            self.cold_written += 1;
            let mut value = vec![0u8; COLD_VALUE_BYTES];
            rng.fill(value.as_mut_slice());
            return KvRequest::Put { key, value }.encode();
        }
        if rng.gen_ratio(1, 50) {
            // Watches make the nodes push events, which the world checks (agreement,
            // order, gaps reported rather than skipped).
            return KvRequest::Watch { prefix: vec![b'k', rng.gen_range(0..self.keys)], lease_ms: self.lease_ms }
                .encode();
        }
        let k = rng.gen_range(0..self.keys);
        let key = vec![b'k', k];
        self.counter += 1;
        let fresh = format!("{client}.{}", self.counter).into_bytes();
        let recent = &mut self.recent[k as usize];
        let req = match rng.gen_range(0..10) {
            0..=3 => KvRequest::Get { key },
            4..=6 => KvRequest::Put { key, value: fresh.clone() },
            7 => KvRequest::Delete { key },
            _ => {
                // CAS against absent or a recent write: sometimes right, sometimes stale.
                let expected = if recent.is_empty() || rng.gen_bool(0.2) {
                    None
                } else {
                    Some(recent[rng.gen_range(0..recent.len())].clone())
                };
                KvRequest::Cas { key, expected, new: fresh.clone() }
            }
        };
        if matches!(req, KvRequest::Put { .. } | KvRequest::Cas { .. }) {
            recent.push(fresh);
            if recent.len() > 3 {
                recent.remove(0);
            }
        }
        req.encode()
    }

    /// A get goes ordered, read-only linearizable, by read index, or read-only
    /// serializable, one in four each. The first three are held to linearizability,
    /// serializable ones to `serializable::check_serializable_reads`.
    fn read_mode(&mut self, rng: &mut ChaCha8Rng, op: &[u8]) -> Option<ReadConsistency> {
        if !matches!(KvRequest::decode(op), Ok(KvRequest::Get { .. })) {
            return None;
        }
        match rng.gen_range(0..4) {
            0 => None,
            1 => Some(ReadConsistency::Linearizable),
            2 => Some(ReadConsistency::Index),
            _ => Some(ReadConsistency::Serializable),
        }
    }

    fn check_history(&self, history: &[HistoryEntry]) -> Result<(), String> {
        serializable::check_serializable_reads(history)?;
        let mut ops = Vec::with_capacity(history.len());
        for h in history.iter().filter(|h| h.read != Some(ReadConsistency::Serializable)) {
            let req = KvRequest::decode(&h.op).map_err(|e| format!("history holds an undecodable op: {e}"))?;
            let op = match req {
                KvRequest::Get { key } => KvOp::Get { key },
                KvRequest::Put { key, value } => KvOp::Put { key, value },
                KvRequest::Delete { key } => KvOp::Delete { key },
                KvRequest::Cas { key, expected, new } => KvOp::Cas { key, expected, new },
                KvRequest::Scan { .. } | KvRequest::ScanPage { .. } => {
                    return Err("the KV workload does not generate scans".into())
                }
                // Watches change no key: nothing for the linearizability check.
                KvRequest::Watch { .. } | KvRequest::Unwatch { .. } => continue,
            };
            let ret = match &h.ret {
                None => None,
                Some((t, bytes)) => {
                    let r = match KvResponse::decode(bytes).map_err(|e| format!("undecodable result: {e}"))? {
                        KvResponse::Value(v) => KvRet::Value(v),
                        KvResponse::Done => KvRet::Done,
                        KvResponse::Swapped(b) => KvRet::Swapped(b),
                        KvResponse::Entries(_) | KvResponse::Page { .. } => {
                            return Err("a scan result in a history without scans".into())
                        }
                        KvResponse::Error(e) => return Err(format!("service error in history: {e}")),
                    };
                    Some((*t, r))
                }
            };
            ops.push(Operation { client: h.client, op, invoke: h.invoke, ret });
        }
        match check_kv(&ops, LINEARIZABILITY_BUDGET) {
            Verdict::Linearizable => Ok(()),
            Verdict::Violation { key, explanation } => {
                Err(format!("key {:?} has no linearization:\n{explanation}", String::from_utf8_lossy(&key)))
            }
            Verdict::Unknown { key } => {
                Err(format!("linearizability search exceeded its budget on key {:?}", String::from_utf8_lossy(&key)))
            }
        }
    }
}
