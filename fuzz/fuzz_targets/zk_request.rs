//! coord's ZooKeeper codec and service on arbitrary bytes: no parse panics or allocates
//! past its input (`ConnectRequest::parse`, `Request::parse` for every opcode), every
//! request that parses executes without a panic and answers a reply that decodes, the
//! state then snapshots and restores to an equal one, and arbitrary bytes as a command
//! or as a snapshot are refused cleanly (a failed restore changes nothing).
#![no_main]

use keel_coord::coord::{Command, Reply};
use keel_coord::jute::Reader;
use keel_coord::proto::{ConnectRequest, Request};
use keel_coord::Coord;
use keel_core::ids::{ClientId, Seq};
use keel_core::service::{ExecCtx, Service};
use libfuzzer_sys::fuzz_target;

/// Opcodes the first byte picks from, so every record's parser is reached.
const OPCODES: [i32; 24] =
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 14, 15, 17, 18, 19, 21, 22, 101, 103, 104, 105, 106, 107];
const FRONT_END: u64 = 2000 << 10;

fn ctx(seq: u64) -> ExecCtx {
    ExecCtx::new(Seq(seq), 1_000 + seq, seq.wrapping_mul(0x9e37_79b9_7f4a_7c15), ClientId(FRONT_END))
}

fuzz_target!(|data: &[u8]| {
    let _ = ConnectRequest::parse(data);
    let mut coord = Coord::new();
    // Arbitrary bytes as a command: an error reply, never a panic.
    Reply::decode(&coord.execute(data, &ctx(1))).expect("every reply decodes");
    let Some((&pick, body)) = data.split_first() else { return };
    let opcode = OPCODES[usize::from(pick) % OPCODES.len()];
    // The rest as a sequence of requests of a session, each record parsed in turn.
    let session = match Reply::decode(&coord.execute(
        &Command::Connect { timeout: 10_000, ip: "10.0.0.1".into(), pinned: false, verifier: [0; 32] }.encode(),
        &ctx(2),
    )) {
        Some(Reply::Session { id, .. }) => id,
        other => panic!("no session: {other:?}"),
    };
    let mut reader = Reader::new(body);
    let mut seq = 3;
    while reader.remaining() > 0 && seq < 64 {
        match Request::parse(opcode, &mut reader) {
            Ok(Some(request)) => {
                let reply = coord.execute(&Command::Op { session, request }.encode(), &ctx(seq));
                Reply::decode(&reply).expect("every reply decodes");
                seq += 1;
            }
            _ => break,
        }
    }
    let mut tick = ctx(seq);
    tick.time += 60_000;
    coord.on_tick(&tick);
    let snap = coord.snapshot();
    let mut copy = Coord::new();
    copy.restore(&snap).expect("a snapshot restores");
    assert_eq!(copy, coord, "restore(snapshot) gives an equal state");
    assert_eq!(copy.snapshot(), snap, "snapshots are deterministic");
    let before = coord.clone();
    if coord.restore(data).is_err() {
        assert_eq!(coord, before, "a failed restore changes nothing");
    }
});
