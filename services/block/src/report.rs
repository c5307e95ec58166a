//! What a block node reports of itself: its metrics (appended to the node's `/metrics`)
//! and its lines in `keel status`.

use crate::front::{FrontStats, ACK_BUCKETS};
use crate::local::Local;
use crate::recovery::Recovery;
use keel::ServiceReport;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, PoisonError};

pub struct BlockReport {
    pub local: Arc<Local>,
    pub front: Arc<FrontStats>,
    pub recovery: Arc<Recovery>,
}

fn counter(out: &mut String, name: &str, help: &str, v: &AtomicU64) {
    let _ = write!(
        out,
        "# HELP keel_block_{name} {help}.\n# TYPE keel_block_{name} counter\nkeel_block_{name}_total {}\n",
        v.load(Ordering::Relaxed)
    );
}

fn gauge(out: &mut String, name: &str, help: &str, v: u64) {
    let _ = write!(out, "# HELP keel_block_{name} {help}.\n# TYPE keel_block_{name} gauge\nkeel_block_{name} {v}\n");
}

impl ServiceReport for BlockReport {
    fn metrics(&self) -> String {
        let mut out = String::new();
        let l = &self.local.stats;
        counter(&mut out, "prepares", "PrepareData logged and acknowledged", &l.prepares);
        counter(
            &mut out,
            "prepares_forwarded",
            "PrepareData passed on to the next node of its chain",
            &l.prepares_forwarded,
        );
        counter(
            &mut out,
            "prepares_refused",
            "PrepareData refused (malformed, over a bound, reserve full, old epoch)",
            &l.prepares_refused,
        );
        counter(&mut out, "writes_complete", "Writes executed with their data here (COMPLETE)", &l.writes_complete);
        counter(
            &mut out,
            "writes_incomplete",
            "Writes executed without their data here (INCOMPLETE)",
            &l.writes_incomplete,
        );
        let plane = &self.front.plane;
        counter(
            &mut out,
            "plane_dropped",
            "Node-plane messages from peers dropped (malformed, over a bound, or answering nothing asked)",
            &plane.dropped,
        );
        counter(
            &mut out,
            "plane_batches",
            "Node-plane messages sent carrying several PrepareData or answers",
            &plane.batches,
        );
        counter(&mut out, "plane_batched", "PrepareData and answers sent in such batches", &plane.batched);
        counter(&mut out, "store_errors", "I/O errors of the block data files", &l.store_errors);
        counter(
            &mut out,
            "epochs_ended_idle",
            "Front ends' epochs ended after a quiet minute (their PrepareData dropped)",
            &l.epochs_ended_idle,
        );
        counter(
            &mut out,
            "restored_from_prepared",
            "Blocks stored from PrepareData after a restore skipped their write",
            &l.restored_from_prepared,
        );
        let (reserved, limit) = self.local.reserve();
        gauge(&mut out, "reserve_blocks", "Blocks held outside their preferred set", reserved);
        gauge(&mut out, "reserve_limit_blocks", "Most blocks the reserve storage may hold", limit);
        gauge(
            &mut out,
            "prepared_bytes",
            "PrepareData bytes waiting for their WriteData",
            self.local.prepared_bytes() as u64,
        );
        let f = &self.front;
        gauge(&mut out, "nbd_connections", "NBD connections open", f.connections.load(Ordering::Relaxed) as u64);
        counter(
            &mut out,
            "nbd_refused_connections",
            "NBD connections closed at once (over the bound)",
            &f.refused_connections,
        );
        counter(&mut out, "nbd_malformed", "Malformed NBD handshakes and requests", &f.malformed);
        counter(
            &mut out,
            "nbd_tls_refused",
            "NBD connections refused for TLS (options before STARTTLS, or no client certificate the cluster CA signed)",
            &f.tls_refused,
        );
        counter(&mut out, "nbd_reads", "NBD reads", &f.reads);
        counter(&mut out, "nbd_writes", "NBD writes", &f.writes);
        counter(&mut out, "nbd_errors", "NBD requests answered with an error", &f.errors);
        counter(
            &mut out,
            "writes_fenced",
            "Writes refused as of an ended epoch (an idle front end's), renewed and retried",
            &f.writes_fenced,
        );
        counter(&mut out, "local_blocks", "Blocks read from this node's own copy", &f.local_blocks);
        counter(&mut out, "fetched_blocks", "Blocks read from a peer", &f.fetched_blocks);
        counter(
            &mut out,
            "reads_waited",
            "Reads that found no node serving a block at its version, and asked again after a pause",
            &f.reads_waited,
        );
        counter(
            &mut out,
            "bad_local_blocks",
            "Blocks of this node whose bytes did not match their agreed hash",
            &f.bad_local_blocks,
        );
        let _ = write!(
            out,
            "# HELP keel_block_bad_blocks Blocks a peer sent whose bytes did not match their agreed hash.\n# TYPE keel_block_bad_blocks counter\n"
        );
        for (node, n) in f.bad_by_node.lock().unwrap_or_else(PoisonError::into_inner).iter() {
            let _ = writeln!(out, "keel_block_bad_blocks_total{{node=\"{node}\"}} {n}");
        }
        let _ = write!(
            out,
            "# HELP keel_block_prepare_ack_seconds How long each node took to acknowledge this front end's PrepareData.\n# TYPE keel_block_prepare_ack_seconds histogram\n"
        );
        for (node, h) in f.prepare_acks.snapshot() {
            let mut below = 0u64;
            for (le, n) in ACK_BUCKETS.iter().zip(h.buckets) {
                below += n;
                let _ = writeln!(out, "keel_block_prepare_ack_seconds_bucket{{node=\"{node}\",le=\"{le}\"}} {below}");
            }
            let count: u64 = h.buckets.iter().sum();
            let _ = writeln!(out, "keel_block_prepare_ack_seconds_bucket{{node=\"{node}\",le=\"+Inf\"}} {count}");
            let _ = writeln!(out, "keel_block_prepare_ack_seconds_sum{{node=\"{node}\"}} {}", h.sum_seconds);
            let _ = writeln!(out, "keel_block_prepare_ack_seconds_count{{node=\"{node}\"}} {count}");
        }
        let r = &self.recovery;
        gauge(
            &mut out,
            "incomplete_blocks",
            "Preferred blocks not held at their agreed version (recovery phase 2 left)",
            r.incomplete.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "reserve_reclaimed_bytes",
            "Bytes of disk given back by punching out stripes that hold nothing here",
            &r.reclaimed_bytes,
        );
        counter(&mut out, "recovery_scans", "Passes of recovery phase 2 over the preferred blocks", &r.scans);
        counter(
            &mut out,
            "recovery_regions_scanned",
            "Regions recovery phase 2 looked at block by block (complete regions not written since are skipped)",
            &r.regions_scanned,
        );
        counter(&mut out, "repaired_blocks", "Blocks re-replicated by recovery phase 2", &r.repaired);
        counter(&mut out, "repaired_bytes", "Bytes re-replicated by recovery phase 2", &r.repaired_bytes);
        counter(
            &mut out,
            "reserve_prepares",
            "PrepareData this front end sent to reserve storage (a preferred node suspected or late)",
            &self.front.reserve_prepares,
        );
        gauge(
            &mut out,
            "suspected_nodes",
            "Nodes this front end does not wait for now (timed out lately)",
            self.front.suspects.count() as u64,
        );
        counter(
            &mut out,
            "reserve_collected",
            "Reserve blocks dropped once their preferred nodes held them",
            &r.reserve_collected,
        );
        out
    }

    fn status(&self) -> Vec<String> {
        let r = &self.recovery;
        let (reserved, limit) = self.local.reserve();
        let incomplete = r.incomplete.load(Ordering::Relaxed);
        let phase = match (r.scans.load(Ordering::Relaxed), incomplete) {
            (0, _) => "phase 2 not scanned yet",
            (_, 0) => "phase 2 done",
            _ => "phase 2 running",
        };
        let mut lines = vec![format!(
            "block: {} INCOMPLETE preferred blocks ({phase}), {} re-replicated; reserve {reserved}/{limit} blocks; {} NBD connections",
            incomplete,
            r.repaired.load(Ordering::Relaxed),
            load(&self.front.connections),
        )];
        let bad = self.front.bad_by_node.lock().unwrap_or_else(PoisonError::into_inner);
        if !bad.is_empty() {
            let list: Vec<String> = bad.iter().map(|(n, c)| format!("node {n}: {c}")).collect();
            lines.push(format!("block: peers sent blocks that do not match the agreed hash ({})", list.join(", ")));
        }
        let own = self.front.bad_local_blocks.load(Ordering::Relaxed);
        if own > 0 {
            lines.push(format!("block: {own} blocks of this node's own copy did not match the agreed hash"));
        }
        lines
    }
}

fn load(v: &AtomicUsize) -> usize {
    v.load(Ordering::Relaxed)
}
