//! block's untrusted inputs on arbitrary bytes: NBD request headers, option headers,
//! NBD_OPT_GO data and meta context queries (what a client sends), node-plane messages (what a peer sends), and
//! commands and snapshots for the agreed metadata. Nothing panics or allocates past its
//! input; every command answers a reply that decodes; a snapshot that does not restore
//! leaves the state as it was.
#![no_main]

use keel_block::meta::{Command, Reply};
use keel_block::nbd;
use keel_block::plane::Message;
use keel_block::{BlockService, Geometry};
use keel_core::ids::{ClientId, Seq};
use keel_core::service::{ExecCtx, Service};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(header) = <&[u8; nbd::REQUEST_LEN]>::try_from(data.get(..nbd::REQUEST_LEN).unwrap_or(&[])) {
        if let Ok(r) = nbd::decode_request(header) {
            assert_eq!(&nbd::encode_request(&r), header, "a request header round-trips");
        }
    }
    if let Ok(header) = <&[u8; 16]>::try_from(data.get(..16).unwrap_or(&[])) {
        let _ = nbd::decode_option(header);
    }
    let _ = nbd::decode_go(data);
    if let Ok((name, queries)) = nbd::decode_meta_context(data) {
        // What decodes accounts for every byte it was given.
        assert_eq!(8 + name.len() + queries.iter().map(|q| 4 + q.len()).sum::<usize>(), data.len());
    }
    let _ = postcard::from_bytes::<Message>(data);
    let geometry = Geometry::new(8 << 20, 4096, 4, 3).expect("valid");
    let mut service = BlockService::new(geometry);
    let ctx = ExecCtx::new(Seq(1), 1_000, 7, ClientId(1000 << 10));
    Reply::decode(&service.execute(data, &ctx)).expect("every reply decodes");
    if let Ok(command) = postcard::from_bytes::<Command>(data) {
        Reply::decode(&service.execute(&command.encode(), &ctx)).expect("every reply decodes");
    }
    let before = service.snapshot();
    if service.restore(data).is_err() {
        assert_eq!(service.snapshot(), before, "a refused snapshot changes nothing");
    }
});
