//! What a checkpoint of a large data tree costs the protocol thread, whole against
//! incremental, and what one multi costs at that size (issue #23: "snapshots of the data
//! tree, incremental where it is large"). Prints one line per phase and checks that an
//! incremental checkpoint has the root of the same state serialized whole.
//!
//! ```text
//! cargo run --release -p keel-coord --example tree_checkpoint_cost -- [ZNODES] [DATA_BYTES]
//! ```
//!
//! The tree is `/bench/dNNNN/nNNN`: a thousand znodes per directory.

use keel_coord::coord::LocalView;
use keel_coord::coord::{Command, Reply};
use keel_coord::proto::{Acl, Request};
use keel_coord::session_key::SessionSecret;
use keel_coord::Coord;
use keel_core::exec::{Chunked, Executor};
use keel_core::ids::{ClientId, Seq};
use keel_core::service::{ExecCtx, Service};
use std::time::Instant;

const CHUNK: usize = 64 << 10;
const FRONT_END: u64 = 2000 << 10;

struct Driver {
    coord: Coord,
    seq: u64,
    session: i64,
}

impl Driver {
    fn run(&mut self, command: Command) -> Reply {
        self.seq += 1;
        let ctx = ExecCtx::new(Seq(self.seq), 1_000 + self.seq, self.seq, ClientId(FRONT_END));
        Reply::decode(&self.coord.execute(&command.encode(), &ctx)).expect("a reply the service wrote")
    }

    fn op(&mut self, request: Request) -> i32 {
        match self.run(Command::Op { session: self.session, request }) {
            Reply::Op { err, .. } => err,
            other => panic!("not an op reply: {other:?}"),
        }
    }
}

fn create(path: String, data: Vec<u8>) -> Request {
    Request::Create { opcode: 1, path, data, acl: Acl::open(), flags: 0, ttl: -1 }
}

fn set(path: String, data: Vec<u8>) -> Request {
    Request::SetData { path, data, version: -1 }
}

fn node(i: u64) -> String {
    format!("/bench/d{:04}/n{:03}", i / 1000, i % 1000)
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let znodes: u64 = args.first().and_then(|a| a.parse().ok()).unwrap_or(100_000);
    let data_bytes: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(100);
    let view = LocalView::new();
    let mut d = Driver { coord: view.service(), seq: 0, session: 0 };
    let verifier = SessionSecret::from_bytes([1; 16]).verifier();
    d.session = match d.run(Command::Connect { timeout: 30_000, ip: "127.0.0.1".into(), pinned: false, verifier }) {
        Reply::Session { id, .. } => id,
        other => panic!("no session: {other:?}"),
    };
    let t = Instant::now();
    assert_eq!(d.op(create("/bench".into(), Vec::new())), 0);
    for i in 0..znodes {
        if i % 1000 == 0 {
            assert_eq!(d.op(create(format!("/bench/d{:04}", i / 1000), Vec::new())), 0);
        }
        assert_eq!(d.op(create(node(i), vec![i as u8; data_bytes])), 0);
    }
    let build = ms(t);
    println!(
        "tree: {znodes} znodes of {data_bytes} B in {} directories, built in {build:.0} ms ({:.2} us per create)",
        znodes.div_ceil(1000),
        build * 1e3 / znodes as f64
    );

    // Watched reads: one per znode first (each registers a data watch), then the same
    // again, timed, with every watch held (a watched read counts its session's watches).
    let watched = znodes.min(100_000);
    for i in 0..watched {
        assert_eq!(d.op(Request::GetData { path: node(i), watch: true }), 0);
    }
    let t = Instant::now();
    for i in 0..1000 {
        assert_eq!(d.op(Request::GetData { path: node(i % watched), watch: true }), 0);
    }
    println!("one watched getData, {watched} watches held:  {:>9.3} ms", ms(t) / 1000.0);

    let exec = Executor::new(view.service());
    let t = Instant::now();
    let first = Chunked::from_pieces(exec.pieces(), CHUNK);
    println!("first checkpoint (everything serialized): {:>9.1} ms, {} bytes", ms(t), first.len());

    // A multi of two creates and a delete, at this size.
    let t = Instant::now();
    let rounds = 20;
    for r in 0..rounds {
        let path = format!("/bench/m{r}");
        let ops = vec![
            create(path.clone(), vec![1; 8]),
            create(format!("{path}x"), Vec::new()),
            Request::Delete { path, version: -1 },
        ];
        assert_eq!(d.op(Request::Multi(ops)), 0);
    }
    println!("one multi of three ops:                  {:>9.3} ms", ms(t) / rounds as f64);

    // Spread: every `znodes / count`-th znode, so each write lands in a different
    // segment until most are touched. Hot: `count` writes to the first 100 znodes (one
    // directory), as locks, queues and configuration concentrate writes.
    let phases = [0, znodes / 1000, znodes / 100, znodes / 10].map(|c| ("spread", c));
    for (how, count) in phases.into_iter().chain([("hot", znodes / 10)]) {
        let _ = Chunked::from_pieces(exec.pieces(), CHUNK);
        let step = (znodes / count.max(1)).max(1);
        for i in 0..count.min(znodes) {
            let target = if how == "hot" { i % 100 } else { (i * step + 7) % znodes };
            assert_eq!(d.op(set(node(target), vec![count as u8; data_bytes])), 0);
        }
        let t = Instant::now();
        let incremental = Chunked::from_pieces(exec.pieces(), CHUNK);
        let inc_ms = ms(t);
        // A tree read back from a snapshot holds no cached pieces: everything is
        // serialized.
        let mut copy = Coord::new();
        copy.restore(&exec.service().snapshot()).expect("a snapshot restores");
        let fresh = Executor::new(copy);
        let t = Instant::now();
        let whole = Chunked::from_pieces(fresh.pieces(), CHUNK);
        let whole_ms = ms(t);
        assert_eq!(incremental.root, whole.root, "incremental and whole checkpoints agree");
        println!(
            "after {count:>6} setData ({how:>6}): checkpoint {inc_ms:>8.1} ms, the same state serialized whole {whole_ms:>8.1} ms ({:.1}x)",
            whole_ms / inc_ms.max(0.001)
        );
    }
}
