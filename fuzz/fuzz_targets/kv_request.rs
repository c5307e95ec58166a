//! Proves that the KV service never panics on any request bytes a client can get ordered
//! (`Service::execute` answers garbage with a `KvResponse::Error`), that every reply it
//! produces decodes as a `KvResponse`, that executing a request that decodes is the same
//! as applying it, that snapshots restore to an equal state, and that neither
//! `KvRequest::decode`, `KvResponse::decode` nor `restore` panics on arbitrary bytes (a
//! failed restore leaves the state unchanged).
#![no_main]

use keel_core::ids::{ClientId, Seq};
use keel_core::service::{ExecCtx, Service};
use keel_kv::{Kv, KvRequest, KvResponse};
use libfuzzer_sys::fuzz_target;

fn ctx(seq: u64) -> ExecCtx {
    ExecCtx::new(Seq(seq), seq * 7, seq.wrapping_mul(0x9e37_79b9_7f4a_7c15), ClientId(1))
}

fuzz_target!(|data: &[u8]| {
    let _ = KvResponse::decode(data);

    // The whole input as one request.
    let mut kv = Kv::new();
    let decoded = KvRequest::decode(data);
    let reply = kv.execute(data, &ctx(1));
    let response = KvResponse::decode(&reply).expect("every reply decodes");
    match decoded {
        Ok(req) => assert_eq!(response, Kv::new().apply(req), "execute is apply on a decoded request"),
        Err(_) => assert!(matches!(response, KvResponse::Error(_)), "garbage gets an error"),
    }

    // The input as a sequence of requests, each prefixed with a one-byte length.
    let mut kv = Kv::new();
    let mut rest = data;
    let mut seq = 1;
    while let Some((&len, tail)) = rest.split_first() {
        let (op, tail) = tail.split_at(usize::from(len).min(tail.len()));
        rest = tail;
        let reply = kv.execute(op, &ctx(seq));
        KvResponse::decode(&reply).expect("every reply decodes");
        seq += 1;
    }
    let snap = kv.snapshot();
    let mut copy = Kv::new();
    copy.restore(&snap).expect("a snapshot restores");
    assert_eq!(copy, kv, "restore(snapshot) gives an equal state");
    assert_eq!(copy.snapshot(), snap, "snapshots are deterministic");

    // Arbitrary bytes as a snapshot.
    let before = kv.clone();
    if kv.restore(data).is_err() {
        assert_eq!(kv, before, "a failed restore changes nothing");
    }
});
