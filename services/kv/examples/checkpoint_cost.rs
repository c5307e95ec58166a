//! What a checkpoint costs the protocol thread, inline versus copy-on-write, on a KV
//! state of a given size (issue #5: checkpoints of a 1 GB state stopped every node for
//! seconds). Prints one line per phase; it checks that the frozen copy serializes to
//! the same root as the inline checkpoint, and incremental checkpoints to the same root
//! as whole ones.
//!
//! ```text
//! cargo run --release -p keel-kv --example checkpoint_cost -- [STATE_MB] [VALUE_BYTES]
//! ```
//!
//! - inline: `Executor::snapshot` + chunking and hashing, all on the protocol thread;
//! - freeze: what the protocol thread does with background checkpoints;
//! - serialize: the same work as inline, done by the checkpoint thread from the frozen
//!   copy while the state keeps changing;
//! - writes after a freeze: the copy-on-write cost paid by the next writes (the first
//!   write to each B-tree node copies it), against as many writes before the freeze;
//! - incremental checkpoints (KV's segments): after 0, 0.1 %, 1 % and 10 % of the keys
//!   were rewritten, against serializing the same state whole; their roots must agree.

use keel_core::exec::{Chunked, Executor};
use keel_kv::{Kv, KvRequest};
use std::time::Instant;

const CHUNK: usize = 64 << 10;

fn put(kv: &Kv, key: u64, value_bytes: usize, salt: u8) {
    kv.apply(KvRequest::Put { key: format!("key-{key:08}").into_bytes(), value: vec![salt ^ key as u8; value_bytes] });
}

/// Rewrites every tenth key (offset `phase`): touches every B-tree leaf of the state.
fn rewrite(kv: &Kv, keys: u64, phase: u64, value_bytes: usize) -> f64 {
    let t = Instant::now();
    for i in 0..keys / 10 {
        put(kv, i * 10 + phase, value_bytes, 1);
    }
    t.elapsed().as_secs_f64() * 1e3
}

/// Rewrites `count` keys spread over the state (every `keys / count`-th, offset `phase`).
fn rewrite_some(kv: &Kv, keys: u64, count: u64, phase: u64, value_bytes: usize) {
    let step = (keys / count.max(1)).max(1);
    for i in 0..count.min(keys) {
        put(kv, (i * step + phase) % keys, value_bytes, 2);
    }
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let state_mb: u64 = args.first().and_then(|a| a.parse().ok()).unwrap_or(256);
    let value_bytes: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(16 << 10);
    let keys = state_mb * (1 << 20) / value_bytes as u64;
    let kv = Kv::new();
    for i in 0..keys {
        put(&kv, i, value_bytes, 0);
    }
    println!("state: {keys} keys of {value_bytes} B ({state_mb} MiB)");
    let plain = rewrite(&kv, keys, 1, value_bytes);
    let exec = Executor::new(kv);

    let t = Instant::now();
    let inline = Chunked::from_pieces(exec.pieces(), CHUNK);
    println!("first checkpoint, inline (everything serialized): {:>9.1} ms", ms(t));

    let t = Instant::now();
    let frozen = exec.freeze().expect("KV freezes");
    println!("freeze (protocol thread):                         {:>9.3} ms", ms(t));

    // The state moves on while the copy waits to be serialized.
    let cow = rewrite(exec.service(), keys, 2, value_bytes);
    println!(
        "{} writes after the freeze:                    {cow:>9.1} ms (the same number before it: {plain:.1} ms)",
        keys / 10
    );

    let t = Instant::now();
    let background = Chunked::from_pieces(frozen.pieces(), CHUNK);
    println!("frozen copy serialized (nothing written between): {:>9.1} ms", ms(t));
    assert_eq!(background.root, inline.root, "the frozen copy is the state at the freeze");

    // Incremental checkpoints after some writes, against serializing the same state afresh
    // (a copy has no cached segments). The roots must agree.
    for count in [0, keys / 1000, keys / 100, keys / 10] {
        let exec = Executor::new(exec.service().clone());
        let _ = Chunked::from_pieces(exec.pieces(), CHUNK);
        rewrite_some(exec.service(), keys, count, 3, value_bytes);
        let t = Instant::now();
        let incremental = Chunked::from_pieces(exec.pieces(), CHUNK);
        let inc_ms = ms(t);
        let fresh = Executor::new(exec.service().clone());
        let t = Instant::now();
        let whole = Chunked::from_pieces(fresh.pieces(), CHUNK);
        let whole_ms = ms(t);
        assert_eq!(incremental.root, whole.root, "incremental and whole checkpoints agree");
        println!(
            "after {count:>6} writes: incremental checkpoint {inc_ms:>8.1} ms, the same state serialized whole {whole_ms:>8.1} ms ({:.1}x)",
            whole_ms / inc_ms.max(0.001)
        );
    }
}
