//! Proves that the wire codec never panics on arbitrary bytes, and that every frame it
//! accepts is canonical up to re-encoding: `decode(encode(decode(data)?)) == decode(data)`,
//! so what a node decodes, re-encodes (relays, hashes, signs) and a peer decodes again is
//! the same message.
#![no_main]

use keel_core::codec;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(msg) = codec::decode(data) {
        let bytes = codec::encode(&msg);
        assert_eq!(codec::decode(&bytes), Ok(msg), "a decoded message must survive re-encoding");
    }
});
