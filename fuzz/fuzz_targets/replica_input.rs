//! Proves that a Keel replica never panics, whatever its peers and clients send and
//! however time passes: node 0 of a real u = 1, r = 1 cluster (4 nodes, KV service) is
//! stepped with the messages encoded in the input (see the `keel_fuzz` crate doc for the
//! format), interleaved with ticks. Frames go through `codec::decode` as the transport
//! would; opt-in helpers re-sign, MAC and echo so the fuzzer reaches decided instances,
//! checkpoints, view changes and state transfer. Every step also checks the replica's
//! invariants (`Replica::step` asserts them), that each message it emits passes the
//! wire codec, and that each WAL record it persists reads back.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    keel_fuzz::Harness::run(data);
});
