//! KV keeps the Service contract (keel-testkit's conformance suite): deterministic,
//! snapshots that restore exactly (also split into segments and frozen), read-only
//! answers equal to ordered ones, conflict declarations that parallel execution can
//! trust, and watch leases that ticks end alike on every node.

use keel_kv::{Kv, KvRequest};
use keel_testkit::Conformance;
use rand::Rng;

fn request(rng: &mut rand_chacha::ChaCha8Rng) -> Vec<u8> {
    let key = |rng: &mut rand_chacha::ChaCha8Rng| format!("k/{}", rng.gen_range(0..12)).into_bytes();
    let value = |rng: &mut rand_chacha::ChaCha8Rng| rng.gen_range(0..1000u32).to_string().into_bytes();
    let req = match rng.gen_range(0..20) {
        0..=4 => KvRequest::Get { key: key(rng) },
        5..=9 => KvRequest::Put { key: key(rng), value: value(rng) },
        10..=11 => KvRequest::Delete { key: key(rng) },
        12..=14 => {
            let expected = rng.gen_bool(0.5).then(|| value(rng));
            KvRequest::Cas { key: key(rng), expected, new: value(rng) }
        }
        15..=16 => KvRequest::Scan { prefix: b"k/1".to_vec(), limit: rng.gen_range(0..5) },
        // Leases of a few ticks: ticks end them while the run goes on.
        17..=18 => KvRequest::Watch { prefix: b"k/".to_vec(), lease_ms: rng.gen_range(50..400) },
        _ => KvRequest::Unwatch { prefix: b"k/".to_vec() },
    };
    if rng.gen_ratio(1, 40) {
        return b"\xff not a request".to_vec();
    }
    req.encode()
}

#[test]
fn kv_passes_the_conformance_suite() {
    for seed in 1..=3 {
        Conformance::new(|| Kv::with_segment_target(256))
            .workload(|rng, _client| request(rng))
            .instances(300, 6)
            .tick_ms(100)
            .seed(seed)
            .run()
            .unwrap_or_else(|e| panic!("seed {seed}: {e}"));
    }
}
