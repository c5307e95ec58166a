//! coord's front end on a connection's bytes, as a client could send them: the first
//! four bytes are a four-letter word or a frame length, the first frame a
//! ConnectRequest, every later frame a request (`front::incoming`). Nothing panics or
//! allocates past the frame limit; a frame length outside the limit is refused before
//! any body is read; whatever the front end would send to the cluster fits in one
//! command, and each such request runs on a session without a panic.
#![no_main]

use keel_coord::coord::{Command, Reply};
use keel_coord::front::{frame_len, incoming, Incoming};
use keel_coord::proto::{ConnectRequest, MAX_BUFFER};
use keel_coord::Coord;
use keel_core::ids::{ClientId, Seq};
use keel_core::service::{ExecCtx, Service};
use libfuzzer_sys::fuzz_target;

const FRONT_END: u64 = 2000 << 10;

fn ctx(seq: u64) -> ExecCtx {
    ExecCtx::new(Seq(seq), 1_000 + seq, seq.wrapping_mul(0x9e37_79b9_7f4a_7c15), ClientId(FRONT_END))
}

/// The next frame's body, or None when the stream ends or the length is refused.
fn next_frame<'a>(stream: &mut &'a [u8]) -> Option<&'a [u8]> {
    let (prefix, rest) = stream.split_first_chunk::<4>()?;
    let len = match frame_len(*prefix) {
        Ok(len) => len,
        Err(_) => {
            let announced = i32::from_be_bytes(*prefix);
            assert!(announced < 0 || announced as usize > MAX_BUFFER + 1024, "a length within the limit refused");
            return None;
        }
    };
    let body = rest.get(..len)?;
    *stream = &rest[len..];
    Some(body)
}

fuzz_target!(|data: &[u8]| {
    let mut stream = data;
    let Some(first) = next_frame(&mut stream) else { return };
    if ConnectRequest::parse(first).is_err() {
        return; // the front end closes the connection
    }
    let mut coord = Coord::new();
    let session = match Reply::decode(&coord.execute(
        &Command::Connect { timeout: 10_000, ip: "10.0.0.1".into(), pinned: false, verifier: [0; 32] }.encode(),
        &ctx(1),
    )) {
        Some(Reply::Session { id, .. }) => id,
        other => panic!("no session: {other:?}"),
    };
    let mut seq = 2;
    while let Some(body) = next_frame(&mut stream) {
        match incoming(session, body) {
            Incoming::Malformed(_) => return,
            Incoming::Request(_, request, size) => {
                assert_eq!(size, body.len());
                let command = Command::Ops { session, requests: vec![request] }.encode();
                assert!(command.len() <= keel_core::codec::OP_BYTES_MAX, "a request sent that no command carries");
                Reply::decode(&coord.execute(&command, &ctx(seq))).expect("every reply decodes");
                seq += 1;
            }
            Incoming::Close(_) => return,
            Incoming::Ping | Incoming::Auth(..) | Incoming::Unimplemented(_) | Incoming::TooLarge(_) => {}
        }
    }
});
