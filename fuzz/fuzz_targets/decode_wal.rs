//! Proves that write-ahead-log recovery never panics on an arbitrary (torn, corrupted)
//! log, that the valid prefix it reports lies within the input, and that the records it
//! returns are exactly what that prefix holds: re-encoding them with `encode_record`
//! reproduces `data[..valid_len]` byte for byte. So truncating the log to `valid_len` and
//! appending keeps a log whose contents are the records recovery handed to the replica.
#![no_main]

use keel_core::wal;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let decoded = wal::decode_log(data);
    assert!(
        decoded.valid_len <= data.len(),
        "valid prefix {} beyond the {} input bytes",
        decoded.valid_len,
        data.len()
    );
    let reencoded: Vec<u8> = decoded.records.iter().flat_map(wal::encode_record).collect();
    assert!(
        reencoded == data[..decoded.valid_len],
        "re-encoded records ({} bytes) differ from the valid prefix ({} bytes) of the log",
        reencoded.len(),
        decoded.valid_len
    );
    if decoded.tail.is_none() {
        assert_eq!(decoded.valid_len, data.len(), "no torn tail means the whole log is valid");
    }
});
