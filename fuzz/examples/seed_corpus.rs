//! Writes seed corpora for every fuzz target, so the fuzzers start from valid inputs:
//! `cargo +nightly run --manifest-path fuzz/Cargo.toml --example seed_corpus -- fuzz/corpus`
//!
//! The `replica_input` seeds are scenarios that drive node 0 through the normal case up
//! to a stable checkpoint, view changes (to a backup and back to node 0), catch-up and
//! state transfer; each is run while it is built and asserted to reach its state. Every
//! frame they send and every message node 0 emits also seeds `decode_message`, and every
//! WAL record node 0 persists seeds `decode_wal`.

use keel_core::codec;
use keel_core::crypto::{Digest, Sig};
use keel_core::ids::{ClientId, MemberIndex, NodeId, Seq, View};
use keel_core::message::{
    checkpoint_statement, write_statement, Cert, CheckpointVote, Message, NewView, Reply, ReplyBody, Request,
    StableProof, Value, ViewChange, Write,
};
use keel_core::wal::{self, Record};
use keel_fuzz::{config, placeholder, secrets, synthetic_checkpoint, Harness, Script, FIX, SYNTHETIC_ROOT};
use keel_kv::{KvRequest, KvResponse};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

const CHUNK_BYTES: usize = 256; // Options::test_min().chunk_bytes

fn put(client: u64, seq: u64) -> Request {
    let op = KvRequest::Put { key: vec![client as u8], value: format!("v{seq}").into_bytes() }.encode();
    Request::new(ClientId(client), seq, op.into())
}

fn is_write(m: &Message) -> bool {
    matches!(m, Message::Write(_))
}

fn is_accept(m: &Message) -> bool {
    matches!(m, Message::Accept { .. })
}

fn is_checkpoint(m: &Message) -> bool {
    matches!(m, Message::Checkpoint(_))
}

/// Nodes 1 and 2 agree with node 0 on its latest vote: the instance decides.
fn agree(s: &mut Script) {
    s.echo(1, 0, is_write);
    s.echo(2, 0, is_write);
    s.echo(1, 0, is_accept);
    s.echo(2, 0, is_accept);
}

/// A client request, proposed by node 0 (the primary of view 0) and decided.
fn request_decided(s: &mut Script, client: u64, seq: u64) {
    let before = s.h.replica.executed();
    s.send(FIX, 1, &Message::Request(put(client, seq)));
    agree(s);
    assert_eq!(s.h.replica.executed(), before + 1, "request {client}/{seq} executed");
}

fn sign_vc(vc: &mut ViewChange) {
    vc.sig = secrets()[vc.from.0 as usize].signing.sign(&vc.statement(&membership()));
}

fn genesis() -> StableProof {
    StableProof::genesis()
}

/// The digest checkpoint votes sign for the (unchanged) membership.
fn membership() -> Digest {
    config(&secrets()).membership.digest()
}

fn stable_proof(seq: u64, root: Digest, signers: &[u32]) -> StableProof {
    let keys = secrets();
    let m = membership();
    let sigs = signers
        .iter()
        .map(|&n| (NodeId(n), keys[n as usize].signing.sign(&checkpoint_statement(Seq(seq), &root, &m, NodeId(n)))))
        .collect();
    StableProof { seq: Seq(seq), root, membership: m, sigs }
}

/// Normal case: nine requests decided and executed, a stable checkpoint at 8, then
/// retransmissions, reads, status gossip and state-transfer requests served.
fn normal_case() -> Script {
    let mut s = Script::new();
    s.tick(1);
    for client in 1..=9u64 {
        request_decided(&mut s, client, 1);
        if client == 8 {
            s.echo(1, 0, is_checkpoint);
            s.echo(2, 0, is_checkpoint);
            assert_eq!(s.h.replica.stable_seq(), Seq(8), "checkpoint 8 stable");
        }
    }
    // A retransmission answered from the reply cache, and a read.
    s.send(FIX, 1, &Message::Request(put(3, 1)));
    let get = Request::new(ClientId(3), 2, KvRequest::Get { key: vec![3] }.encode().into());
    s.send(FIX, 1, &Message::Request(get));
    agree(&mut s);
    // A lagging peer asks for help; node 0 serves the checkpoint.
    s.send(3, 60, &Message::Status { view: View(0), executed: Seq(2), stable: Seq(0) });
    s.send(3, 0, &Message::FetchManifest { seq: Seq(8) });
    s.send(3, 0, &Message::FetchChunk { seq: Seq(8), index: 0 });
    s.send(3, 0, &Message::FetchChunk { seq: Seq(4), index: 1 });
    // Time passes: retransmissions and status.
    s.tick(200);
    assert_eq!(s.h.replica.executed(), Seq(10));
    s
}

/// Node 0 prepared a value, peers suspect node 0, view 1 (primary: node 1) is installed
/// with a NEW-VIEW that re-proposes it, then node 1 proposes more.
fn view_change_to_backup() -> Script {
    let mut s = Script::new();
    s.tick(1);
    request_decided(&mut s, 1, 1);
    s.send(FIX, 1, &Message::Request(put(2, 1)));
    s.echo(1, 0, is_write);
    s.echo(2, 0, is_write); // prepared, not decided
    s.send(1, 5, &Message::Stop { view: View(1) });
    s.send(2, 0, &Message::Stop { view: View(1) });
    assert_eq!(s.h.replica.in_view_change(), Some(View(1)), "node 0 joined the view change");
    let own =
        s.h.sent
            .iter()
            .rev()
            .find_map(|m| match m {
                Message::ViewChange(vc) => Some(vc.clone()),
                _ => None,
            })
            .expect("node 0 sent VIEW-CHANGE");
    let mut vcs = vec![own.clone()];
    for from in [1, 2] {
        let mut vc = own.clone();
        vc.from = MemberIndex(from);
        sign_vc(&mut vc);
        vcs.push(vc);
    }
    let mut nv = NewView { view: View(1), view_changes: vcs, sig: Sig([0; 64]) };
    nv.sig = secrets()[1].signing.sign(&nv.statement(&membership()));
    s.send(1, 1, &Message::NewView(nv));
    assert_eq!(s.h.replica.view(), View(1), "view 1 installed");
    agree(&mut s);
    assert_eq!(s.h.replica.executed(), Seq(2), "the re-proposed value decided");
    // Node 1, the new primary, proposes (FIX sets MACs and moves the time to the clock).
    let value = Value { time: 2000, requests: vec![put(3, 1), put(4, 1)] };
    s.send(FIX | 1, 1, &Message::Propose { view: View(1), seq: Seq(3), value: value.into() });
    agree(&mut s);
    assert_eq!(s.h.replica.executed(), Seq(3));
    // A request reaches node 0, which is now a backup: it times out and is forwarded.
    s.send(FIX, 1, &Message::Request(put(5, 1)));
    s.send(FIX | 2, 0, &Message::Forward(put(6, 1)));
    s.tick(0x80 + 7); // 512 ms: past the request timeout
    s
}

/// Peers suspect the primaries up to view 4, whose primary is node 0 again: node 0
/// collects VIEW-CHANGEs, builds and installs the NEW-VIEW and proposes in view 4.
fn view_change_to_self() -> Script {
    let mut s = Script::new();
    s.tick(1);
    request_decided(&mut s, 1, 1);
    for from in [1, 2, 3] {
        s.send(from, 1, &Message::Stop { view: View(4) });
    }
    assert_eq!(s.h.replica.in_view_change(), Some(View(4)));
    let keys = secrets();
    // Node 1 reports a certificate for instance 2 prepared in view 0.
    let value = Value { time: 3, requests: vec![put(7, 1)] };
    for from in [1, 2] {
        let certs = if from == 1 {
            let value = value.clone();
            let digest = value.digest();
            let writes = (1..=3u32)
                .map(|n| {
                    (
                        MemberIndex(n),
                        keys[n as usize].signing.sign(&write_statement(
                            &membership(),
                            View(0),
                            Seq(2),
                            &digest,
                            MemberIndex(n),
                        )),
                    )
                })
                .collect();
            vec![Cert { view: View(0), seq: Seq(2), value, writes }.proof()]
        } else {
            vec![]
        };
        let mut vc = ViewChange { view: View(4), from: MemberIndex(from), stable: genesis(), certs, sig: Sig([0; 64]) };
        sign_vc(&mut vc);
        s.send(from as u8, 1, &Message::ViewChange(vc));
    }
    assert_eq!(s.h.replica.view(), View(4), "node 0 installed its own NEW-VIEW");
    // View changes name certificates by digest: node 0 asked a holder for the body of
    // instance 2's re-proposal, and votes once it arrives.
    assert!(
        s.h.sent.iter().any(|m| matches!(m, Message::FetchValue { seq: Seq(2), .. })),
        "node 0 asked for the body it lacks"
    );
    s.send(1, 1, &Message::ValueBody { seq: Seq(2), value });
    agree(&mut s);
    request_decided(&mut s, 2, 1);
    assert!(s.h.replica.executed() >= Seq(2));
    // A peer that missed the view asks for it.
    s.send(3, 60, &Message::Status { view: View(0), executed: Seq(0), stable: Seq(0) });
    s
}

/// Node 0 learns of a stable checkpoint far ahead and transfers the state (explicit
/// signatures, no FIX), then goes on proposing.
fn state_transfer() -> Script {
    let mut s = Script::new();
    s.tick(1);
    let c = synthetic_checkpoint(Seq(16), CHUNK_BYTES);
    s.send(1, 1, &Message::StableCert(stable_proof(16, c.root, &[1, 2, 3])));
    assert!(s.h.replica.transferring());
    s.send(2, 1, &Message::Manifest { seq: Seq(16), len: c.len(), chunks: c.leaves.clone() });
    for index in 0..c.leaves.len() as u32 {
        let data = c.chunk(index).expect("in memory").expect("chunk").to_vec();
        s.send(1 + (index % 3) as u8, 0, &Message::Chunk { seq: Seq(16), index, data });
    }
    assert!(!s.h.replica.transferring());
    assert_eq!(s.h.replica.executed(), Seq(16));
    request_decided(&mut s, 1, 1);
    s
}

/// The same transfer through FIX placeholders: checkpoint votes whose root is the
/// synthetic one, then MANIFEST and CHUNK filled in by the harness.
fn state_transfer_fixed() -> Script {
    let mut s = Script::new();
    s.tick(1);
    for from in [1u8, 2, 3] {
        let vote = CheckpointVote {
            seq: Seq(8),
            root: placeholder(SYNTHETIC_ROOT),
            membership: membership(),
            sig: Sig([0; 64]),
        };
        s.send(FIX | from, 1, &Message::Checkpoint(vote));
    }
    assert_eq!(s.h.replica.stable_seq(), Seq(8));
    s.send(FIX | 1, 1, &Message::Manifest { seq: Seq(8), len: 0, chunks: vec![] });
    for index in 0..4 {
        s.send(FIX | 2, 0, &Message::Chunk { seq: Seq(8), index, data: vec![] });
    }
    assert_eq!(s.h.replica.executed(), Seq(8));
    let proof = StableProof {
        seq: Seq(16),
        root: placeholder(SYNTHETIC_ROOT),
        membership: membership(),
        sigs: (1..=3).map(|n| (NodeId(n), Sig([0; 64]))).collect(),
    };
    s.send(FIX | 3, 1, &Message::StableCert(proof));
    s.send(FIX | 1, 1, &Message::Manifest { seq: Seq(16), len: 0, chunks: vec![] });
    for index in 0..4 {
        s.send(FIX | 3, 0, &Message::Chunk { seq: Seq(16), index, data: vec![] });
    }
    assert_eq!(s.h.replica.executed(), Seq(16));
    s
}

/// Catch-up by decided values (r + 1 matching claims), and votes that arrive out of order.
fn catch_up() -> Script {
    let mut s = Script::new();
    s.tick(1);
    let value = Value { time: 5, requests: vec![put(1, 1)] };
    s.send(1, 5, &Message::Decided { seq: Seq(1), value: value.clone() });
    s.send(2, 0, &Message::Decided { seq: Seq(1), value });
    assert_eq!(s.h.replica.executed(), Seq(1), "decided by r + 1 claims");
    // Votes for an instance node 0 has not seen a proposal for.
    let v2 = Value { time: 6, requests: vec![put(2, 1)] };
    let d2 = v2.digest();
    let keys = secrets();
    for from in [1u32, 2, 3] {
        let sig =
            keys[from as usize].signing.sign(&write_statement(&membership(), View(0), Seq(2), &d2, MemberIndex(from)));
        s.send(from as u8, 0, &Message::Write(Write { view: View(0), seq: Seq(2), digest: d2, sig }));
        s.send(from as u8, 0, &Message::Accept { view: View(0), seq: Seq(2), digest: d2 });
    }
    s.send(3, 0, &Message::Decided { seq: Seq(2), value: v2 });
    assert_eq!(s.h.replica.executed(), Seq(2), "decided by accepts, body from a claim");
    s.send(1, 100, &Message::Status { view: View(3), executed: Seq(9), stable: Seq(8) });
    s.send(2, 0, &Message::Stop { view: View(2) });
    s.tick(0xff);
    s.tick(0xff);
    s
}

/// A sample of every message kind, including ones a fuzzer would rarely assemble.
fn sample_messages() -> Vec<Message> {
    let keys = secrets();
    let req = put(9, 3);
    let value = Value { time: 42, requests: vec![req.clone(), put(10, 1)] };
    let digest = value.digest();
    let cert = Cert {
        view: View(1),
        seq: Seq(3),
        value: value.clone(),
        writes: (0..3u32)
            .map(|n| {
                (
                    MemberIndex(n),
                    keys[n as usize].signing.sign(&write_statement(
                        &membership(),
                        View(1),
                        Seq(3),
                        &digest,
                        MemberIndex(n),
                    )),
                )
            })
            .collect(),
    };
    let mut vc = ViewChange {
        view: View(2),
        from: MemberIndex(1),
        stable: stable_proof(8, Digest::of(b"root"), &[0, 1, 2]),
        certs: vec![cert.proof()],
        sig: Sig([0; 64]),
    };
    sign_vc(&mut vc);
    let mut nv = NewView { view: View(2), view_changes: vec![vc.clone()], sig: Sig([0; 64]) };
    nv.sig = keys[2].signing.sign(&nv.statement(&membership()));
    vec![
        Message::Request(req.clone()),
        Message::Forward(req),
        Message::Reply(Reply {
            client: ClientId(9),
            view: View(1),
            seq: 3,
            body: ReplyBody::Full(KvResponse::Done.encode()),
            epoch: 0,
        }),
        Message::Reply(Reply {
            client: ClientId(9),
            view: View(1),
            seq: 3,
            body: ReplyBody::Hash(Digest::of(b"x")),
            epoch: 0,
        }),
        Message::Propose { view: View(1), seq: Seq(3), value: value.clone().into() },
        Message::Write(Write {
            view: View(1),
            seq: Seq(3),
            digest,
            sig: keys[1].signing.sign(&write_statement(&membership(), View(1), Seq(3), &digest, MemberIndex(1))),
        }),
        Message::Accept { view: View(1), seq: Seq(3), digest },
        Message::Checkpoint(CheckpointVote {
            seq: Seq(8),
            root: Digest::of(b"root"),
            membership: Digest::of(b"m"),
            sig: Sig([7; 64]),
        }),
        Message::Stop { view: View(5) },
        Message::ViewChange(vc),
        Message::NewView(nv),
        Message::Status { view: View(1), executed: Seq(300), stable: Seq(256) },
        Message::StableCert(stable_proof(8, Digest::of(b"root"), &[1, 2, 3])),
        Message::Decided { seq: Seq(3), value },
        Message::FetchManifest { seq: Seq(8) },
        Message::Manifest { seq: Seq(8), len: 130, chunks: vec![Digest::of(b"a"), Digest::of(b"b"), Digest::of(b"c")] },
        Message::FetchChunk { seq: Seq(8), index: 2 },
        Message::Chunk { seq: Seq(8), index: 2, data: vec![1, 2, 3] },
        Message::FetchValue { seq: Seq(3), digest },
        Message::ValueBody { seq: Seq(3), value: Value { time: 42, requests: vec![put(11, 1)] } },
    ]
}

fn sample_records() -> Vec<Record> {
    let value = Value { time: 42, requests: vec![put(1, 1)] };
    vec![
        Record::NewView(NewView { view: View(3), view_changes: Vec::new(), sig: Sig([0; 64]) }),
        Record::View { view: View(3), floor: Seq(2) },
        Record::ViewChangeSent { view: View(4) },
        Record::Accepted { view: View(3), seq: Seq(9), value: value.clone() },
        Record::Prepared(Cert {
            view: View(3),
            seq: Seq(9),
            value: value.clone(),
            writes: vec![(MemberIndex(1), Sig([1; 64]))],
        }),
        Record::Decided { seq: Seq(9), digest: value.digest() },
        Record::DecidedValue { seq: Seq(9), value },
        Record::Stable(stable_proof(8, Digest::of(b"root"), &[1, 2, 3])),
    ]
}

struct Corpus {
    root: PathBuf,
    seen: BTreeSet<Vec<u8>>,
    counts: Vec<(String, usize)>,
}

impl Corpus {
    fn add(&mut self, target: &str, bytes: &[u8]) {
        let mut key = target.as_bytes().to_vec();
        key.push(0);
        key.extend(bytes);
        if !self.seen.insert(key) {
            return;
        }
        let dir = self.root.join(target);
        std::fs::create_dir_all(&dir).expect("create corpus dir");
        // FNV-1a names: stable across runs, so re-seeding overwrites instead of piling up.
        let hash =
            bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
        std::fs::write(dir.join(format!("seed-{hash:016x}")), bytes).expect("write seed");
        match self.counts.iter_mut().find(|(t, _)| t == target) {
            Some((_, n)) => *n += 1,
            None => self.counts.push((target.to_string(), 1)),
        }
    }
}

fn main() {
    let root = std::env::args().nth(1).unwrap_or_else(|| "corpus".to_string());
    let mut corpus = Corpus { root: Path::new(&root).to_path_buf(), seen: BTreeSet::new(), counts: Vec::new() };

    // replica_input: the scenarios, whose traffic also seeds the decoders.
    type Scenario = (&'static str, fn() -> Script);
    let scenarios: Vec<Scenario> = vec![
        ("normal_case", normal_case),
        ("view_change_to_backup", view_change_to_backup),
        ("view_change_to_self", view_change_to_self),
        ("state_transfer", state_transfer),
        ("state_transfer_fixed", state_transfer_fixed),
        ("catch_up", catch_up),
    ];
    for (name, build) in scenarios {
        let s = build();
        // The seed must replay to the same state from its bytes alone.
        let mut replay = Harness::new();
        Harness::run(&s.bytes);
        let mut rest = &s.bytes[..];
        while rest.len() >= 4 {
            let len = usize::from(u16::from_le_bytes([rest[2], rest[3]]));
            replay.apply(rest[0], rest[1], &rest[4..4 + len]);
            rest = &rest[4 + len..];
        }
        assert_eq!(replay.replica.executed(), s.h.replica.executed(), "{name} replays");
        assert_eq!(replay.replica.view(), s.h.replica.view(), "{name} replays");
        corpus.add("replica_input", &s.bytes);
        let trace = s.h.trace.as_ref().expect("scripts trace");
        for m in &trace.messages {
            corpus.add("decode_message", &codec::encode(m));
        }
        let log: Vec<u8> = trace.records.iter().flat_map(wal::encode_record).collect();
        corpus.add("decode_wal", &log);
        let mut rest = &s.bytes[..];
        while rest.len() >= 4 {
            let len = usize::from(u16::from_le_bytes([rest[2], rest[3]]));
            let frame = &rest[4..4 + len];
            if codec::decode(frame).is_ok() {
                corpus.add("decode_message", frame);
            }
            rest = &rest[4 + len..];
        }
        eprintln!(
            "{name}: {} bytes, view {}, executed {}, stable {}",
            s.bytes.len(),
            s.h.replica.view(),
            s.h.replica.executed(),
            s.h.replica.stable_seq()
        );
    }

    // decode_message: every kind, and a replica_input seed of each sent by each sender.
    let samples = sample_messages();
    let mut all_kinds = Vec::new();
    for m in &samples {
        let frame = codec::encode(m);
        corpus.add("decode_message", &frame);
        for sender in 0..4u8 {
            all_kinds.extend(keel_fuzz::record(sender, 1, &frame));
            all_kinds.extend(keel_fuzz::record(FIX | sender, 0, &frame));
        }
    }
    corpus.add("replica_input", &all_kinds);

    // decode_wal: each record alone, all of them, and a torn tail.
    let records = sample_records();
    let mut log = Vec::new();
    for r in &records {
        let bytes = wal::encode_record(r);
        corpus.add("decode_wal", &bytes);
        log.extend(bytes);
    }
    corpus.add("decode_wal", &log);
    corpus.add("decode_wal", &log[..log.len() - 5]);

    // kv_request: each request and response, and a length-prefixed sequence.
    let requests = [
        KvRequest::Get { key: b"k".to_vec() },
        KvRequest::Put { key: b"k".to_vec(), value: b"value".to_vec() },
        KvRequest::Delete { key: b"k".to_vec() },
        KvRequest::Cas { key: b"k".to_vec(), expected: None, new: b"1".to_vec() },
        KvRequest::Cas { key: b"k".to_vec(), expected: Some(b"1".to_vec()), new: b"2".to_vec() },
    ];
    let mut seq = Vec::new();
    for r in &requests {
        let bytes = r.encode();
        corpus.add("kv_request", &bytes);
        seq.push(bytes.len() as u8);
        seq.extend(bytes);
    }
    corpus.add("kv_request", &seq);
    for r in [
        KvResponse::Value(Some(b"v".to_vec())),
        KvResponse::Value(None),
        KvResponse::Done,
        KvResponse::Swapped(true),
        KvResponse::Error("e".into()),
    ] {
        corpus.add("kv_request", &r.encode());
    }

    // zk_request: an opcode pick, then records as a ZooKeeper client frames them.
    {
        use keel_coord::jute::Writer;
        use keel_coord::proto::Acl;
        let mut create = Writer::new();
        create.string("/a").buffer(b"v");
        Acl::write_all(&Acl::open(), &mut create);
        create.int(0);
        corpus.add("zk_request", &[&[0u8][..], &create.into_bytes()].concat()); // opcode 1: create
        let mut get = Writer::new();
        get.string("/a").bool(true);
        corpus.add("zk_request", &[&[3u8][..], &get.into_bytes()].concat()); // opcode 4: getData
        let mut multi = Writer::new();
        multi.int(13).bool(false).int(-1).string("/a").int(0).int(-1).bool(true).int(-1);
        corpus.add("zk_request", &[&[11u8][..], &multi.into_bytes()].concat()); // opcode 14: multi

        // zk_frames: a connection as a client writes it (ConnectRequest, then requests:
        // a create, a ping, an auth packet, an unknown opcode, closeSession).
        let framed = |body: &[u8]| [&(body.len() as u32).to_be_bytes()[..], body].concat();
        let mut connect = Writer::new();
        connect.int(0).long(0).int(10_000).long(0).buffer(&[0; 16]).bool(false);
        let mut create = Writer::new();
        create.int(1).int(1).string("/a").buffer(b"v");
        Acl::write_all(&Acl::open(), &mut create);
        create.int(0);
        let mut ping = Writer::new();
        ping.int(-2).int(11);
        let mut auth = Writer::new();
        auth.int(-4).int(100).int(0).string("digest").buffer(b"u:p");
        let mut unknown = Writer::new();
        unknown.int(2).int(99);
        let mut close = Writer::new();
        close.int(3).int(-11);
        let stream: Vec<u8> = [connect, create, ping, auth, unknown, close]
            .into_iter()
            .flat_map(|w| framed(&w.into_bytes()))
            .collect();
        corpus.add("zk_frames", &stream);
    }
    for (target, n) in &corpus.counts {
        eprintln!("{target}: {n} seeds in {}", corpus.root.join(target).display());
    }
}
