//! Checkpoints of the data tree are incremental (tree.rs, keel-core `segments.rs`): a
//! checkpoint reuses the pieces of segments whose paths were not written since the last
//! one. Reuse must give exactly the pieces of the same state cut afresh, or two nodes
//! with equal trees and different histories would sign different roots.

use keel_coord::coord::{Command, Reply};
use keel_coord::proto::{op, Acl, Request};
use keel_coord::session_key::SessionSecret;
use keel_coord::Coord;
use keel_core::chunk::join;
use keel_core::ids::{ClientId, Seq};
use keel_core::service::{ExecCtx, Service};
use proptest::prelude::*;
use std::sync::Arc;

const FRONT_END: u64 = 2000 << 10;
/// Small segments, so that a tree of a few dozen znodes spans many.
const SEGMENT: usize = 96;

const PATHS: [&str; 12] = ["/a", "/a/b", "/a/c", "/a/b/x", "/d", "/d/e", "/d/e/f", "/d/g", "/q", "/q/n", "/z", "/z/y"];

#[derive(Clone, Debug)]
enum Step {
    Create { path: usize, flags: i32, len: usize },
    Delete { path: usize },
    Set { path: usize, len: usize },
    SetAcl { path: usize },
    Multi(Vec<Step>),
    Close,
    Tick { ms: u64 },
    Checkpoint,
}

fn leaf() -> impl Strategy<Value = Step> {
    let path = 0..PATHS.len();
    prop_oneof![
        4 => (path.clone(), prop::sample::select(vec![0, 1, 2, 3, 4, 5]), 0..200usize)
            .prop_map(|(path, flags, len)| Step::Create { path, flags, len }),
        2 => path.clone().prop_map(|path| Step::Delete { path }),
        3 => (path.clone(), 0..300usize).prop_map(|(path, len)| Step::Set { path, len }),
        1 => path.prop_map(|path| Step::SetAcl { path }),
    ]
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        10 => leaf(),
        3 => prop::collection::vec(leaf(), 1..5).prop_map(Step::Multi),
        1 => Just(Step::Close),
        1 => (500..9_000u64).prop_map(|ms| Step::Tick { ms }),
        3 => Just(Step::Checkpoint),
    ]
}

fn request(step: &Step, seq: u64) -> Request {
    match step {
        Step::Create { path, flags, len } => {
            let opcode = match flags {
                4 => op::CREATE_CONTAINER,
                5 => op::CREATE_TTL,
                _ => op::CREATE,
            };
            let ttl = if *flags == 5 { 3_000 } else { -1 };
            let data = vec![seq as u8; *len];
            Request::Create { opcode, path: PATHS[*path].into(), data, acl: Acl::open(), flags: *flags, ttl }
        }
        Step::Delete { path } => Request::Delete { path: PATHS[*path].into(), version: -1 },
        Step::Set { path, len } => {
            Request::SetData { path: PATHS[*path].into(), data: vec![seq as u8; *len], version: -1 }
        }
        Step::SetAcl { path } => Request::SetAcl { path: PATHS[*path].into(), acl: Acl::open(), version: -1 },
        Step::Multi(ops) => Request::Multi(ops.iter().map(|o| request(o, seq)).collect()),
        Step::Close | Step::Tick { .. } | Step::Checkpoint => Request::Sync { path: "/".into() },
    }
}

struct Driver {
    coord: Coord,
    seq: u64,
    time: u64,
    session: i64,
}

impl Driver {
    fn run(&mut self, command: Command) -> Reply {
        self.seq += 1;
        let ctx = ExecCtx::new(Seq(self.seq), self.time, self.seq * 7919, ClientId(FRONT_END));
        Reply::decode(&self.coord.execute(&command.encode(), &ctx)).expect("a reply the service wrote")
    }

    fn connect(&mut self) {
        let verifier = SessionSecret::from_bytes([1; 16]).verifier();
        if let Reply::Session { id, .. } =
            self.run(Command::Connect { timeout: 6_000, ip: "127.0.0.1".into(), pinned: false, verifier })
        {
            self.session = id;
        }
    }

    fn step(&mut self, step: &Step) {
        match step {
            Step::Close => {
                self.run(Command::Close { session: self.session });
                self.connect();
            }
            Step::Tick { ms } => {
                self.time += ms;
                self.seq += 1;
                self.coord.on_tick(&ExecCtx::new(Seq(self.seq), self.time, self.seq, keel_core::ids::TICK_CLIENT));
                self.connect();
            }
            Step::Checkpoint => {}
            other => {
                let request = request(other, self.seq);
                self.run(Command::Op { session: self.session, request });
            }
        }
    }
}

/// The pieces of the same state read back into a service that has cached nothing.
fn cut_afresh(coord: &Coord) -> Vec<Vec<u8>> {
    let mut fresh = Coord::with_segment_target(SEGMENT);
    fresh.restore(&coord.snapshot()).expect("a snapshot restores");
    fresh.pieces().iter().map(|p| p.bytes().expect("in memory").to_vec()).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Across creates (every kind), deletes, writes, multis that succeed and that roll
    /// back, closed sessions and ticks that expire nodes and sessions, each checkpoint's
    /// pieces join to the snapshot and equal the pieces of the same state cut afresh.
    #[test]
    fn incremental_pieces_equal_pieces_cut_afresh(steps in prop::collection::vec(step(), 1..80)) {
        let mut d = Driver { coord: Coord::with_segment_target(SEGMENT), seq: 0, time: 1_000, session: 0 };
        d.connect();
        let mut previous: Vec<Arc<keel_core::chunk::Piece>> = Vec::new();
        for step in steps.iter().chain([&Step::Checkpoint]) {
            d.step(step);
            if matches!(step, Step::Checkpoint) {
                let pieces = d.coord.pieces();
                prop_assert_eq!(join(&pieces).expect("in memory"), d.coord.snapshot());
                let shape: Vec<Vec<u8>> = pieces.iter().map(|p| p.bytes().expect("in memory").to_vec()).collect();
                prop_assert_eq!(shape, cut_afresh(&d.coord));
                previous = pieces;
            }
        }
        // Checkpoints in a row with nothing written in between reuse every segment.
        let again = d.coord.pieces();
        prop_assert!(again.iter().skip(1).take(again.len().saturating_sub(2)).all(|p| previous.iter().any(|q| Arc::ptr_eq(p, q))));
    }
}

#[test]
fn a_large_tree_reuses_what_was_not_written() {
    let mut d = Driver { coord: Coord::with_segment_target(SEGMENT), seq: 0, time: 1_000, session: 0 };
    d.connect();
    for i in 0..200 {
        let request = Request::Create {
            opcode: op::CREATE,
            path: format!("/n{i:03}"),
            data: vec![1; 40],
            acl: Acl::open(),
            flags: 0,
            ttl: -1,
        };
        d.run(Command::Op { session: d.session, request });
    }
    let before = d.coord.pieces();
    assert!(before.len() > 40, "{} pieces", before.len());
    d.run(Command::Op {
        session: d.session,
        request: Request::SetData { path: "/n100".into(), data: vec![2; 40], version: -1 },
    });
    let after = d.coord.pieces();
    let kept = after.iter().filter(|p| before.iter().any(|q| Arc::ptr_eq(p, q))).count();
    // The head (stamp, count) and the tail (sessions, zxid) are rebuilt; of the
    // segments, the written one (and perhaps its neighbour, until cuts agree again).
    assert!(kept + 4 >= after.len(), "kept {kept} of {}", after.len());
    let shape: Vec<Vec<u8>> = after.iter().map(|p| p.bytes().expect("in memory").to_vec()).collect();
    assert_eq!(shape, cut_afresh(&d.coord));
}
