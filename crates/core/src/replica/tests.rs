//! Handler-level tests: build a node, feed it one input, check the outputs exactly; and a
//! lossless in-memory cluster for whole-protocol paths. The simulator covers faults.

use super::*;
use crate::client::Client;
use crate::config::{Auth, Options};
use crate::crypto::{PublicKey, Sig, SigningKey};
use crate::ids::NodeRange;
use crate::message::{
    checkpoint_statement, endorse_statement, write_statement, CertProof, CheckpointVote, Endorsement, Proposed, Read,
    ReadConsistency, ReplyBody, Write,
};
use crate::quorum::Quorums;
use crate::service::{ExecCtx, Frozen, RestoreError, Service};
use crate::test_net::TestNet;
use crate::wal::Record;

/// Appends requests; replies with the count so far.
#[derive(Default, Clone)]
pub(crate) struct Log(pub(crate) Vec<Vec<u8>>);

impl Service for Log {
    fn execute(&mut self, request: &[u8], _ctx: &ExecCtx) -> Vec<u8> {
        self.0.push(request.to_vec());
        if request.starts_with(b"big") {
            // Over REPLY_INLINE_MAX: in full from the designated node only.
            return vec![self.0.len() as u8; 100];
        }
        vec![self.0.len() as u8]
    }
    /// "count" is read-only: the number of requests so far.
    fn execute_read_only(&self, request: &[u8], _ctx: &crate::service::ReadCtx) -> Option<Vec<u8>> {
        (request == b"count").then(|| vec![self.0.len() as u8])
    }
    /// With ticks on (`Options::tick_ms`), each tick appends `tick <agreed time>`.
    fn on_tick(&mut self, ctx: &ExecCtx) {
        self.0.push(format!("tick {}", ctx.time).into_bytes());
    }
    fn snapshot(&self) -> Vec<u8> {
        postcard::to_allocvec(&self.0).unwrap_or_default()
    }
    fn restore(&mut self, s: &[u8]) -> Result<(), RestoreError> {
        self.0 = postcard::from_bytes(s).map_err(|e| RestoreError(e.to_string()))?;
        Ok(())
    }
    /// A clone is a true copy. Used only where a test turns `background_checkpoints` on.
    fn freeze(&self) -> Option<Box<dyn Frozen>> {
        Some(Box::new(self.clone()))
    }
}

impl Frozen for Log {
    fn snapshot(self: Box<Self>) -> Vec<u8> {
        Service::snapshot(&*self)
    }
}

/// The digest of `config(1, 1)`'s membership, which the statements of its nodes name.
fn tag() -> crate::crypto::Digest {
    config(1, 1).membership.digest()
}

pub(crate) fn secrets(i: u32) -> NodeSecrets {
    NodeSecrets::new(SigningKey::from_seed([i as u8 + 1; 32]), [i as u8 + 100; 32])
}

/// `auth = mac`: the client's request goes straight into proposals, which most tests
/// here are about. `auth = rq-mac` has its own tests (`config_rq`).
pub(super) fn config(u: u32, r: u32) -> ClusterConfig {
    config_rq(u, r).with_auth(Auth::Mac)
}

pub(super) fn config_rq(u: u32, r: u32) -> ClusterConfig {
    let q = Quorums::new(u, r).expect("valid");
    let keys: Vec<PublicKey> = (0..q.order_nodes() as u32).map(|i| secrets(i).signing.public()).collect();
    // Checkpoints inline, so handler tests see a checkpoint's outputs in the step that
    // takes it; `background_checkpoints_*` tests turn it on.
    let options = Options { background_checkpoints: false, ..Options::test_min() };
    ClusterConfig::new(q, keys, options).expect("valid")
}

pub(super) fn node(cfg: &ClusterConfig, i: u32) -> Replica<Log> {
    Replica::new(cfg.clone(), NodeId(i), secrets(i), Log::default())
}

pub(super) fn client(cfg: &ClusterConfig, id: u64) -> Client {
    let keys = (0..cfg.n() as u32).map(|i| client_mac_key(&secrets(i).mac_secret, ClientId(id))).collect();
    Client::new(ClientId(id), cfg.quorums, keys, 100, 1).with_auth(cfg.auth)
}

pub(super) fn request(cfg: &ClusterConfig, id: u64, op: &[u8]) -> Request {
    let mut c = client(cfg, id);
    match c.invoke(0, op.to_vec()).expect("idle").remove(0).1 {
        Message::Request(r) => r,
        other => panic!("expected a request, got {other:?}"),
    }
}

pub(super) fn step_tick(r: &mut Replica<Log>, now: u64) -> Outputs {
    let mut out = Outputs::default();
    r.step(now, Input::Tick, &mut out);
    out
}

pub(super) fn step(r: &mut Replica<Log>, now: u64, from: Peer, msg: Message) -> Outputs {
    let mut out = Outputs::default();
    r.step(now, Input::Message { from, msg }, &mut out);
    out
}

pub(super) fn rejected(out: &Outputs) -> Vec<Reject> {
    out.events
        .iter()
        .filter_map(|e| match e {
            Event::Rejected { reason, .. } => Some(reason.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn primary_proposes_at_once_and_votes_once_persisted() {
    let cfg = config(1, 1);
    let mut p = node(&cfg, 0);
    let req = request(&cfg, 7, b"op");
    let out = step(&mut p, 10, Peer::Client(ClientId(7)), Message::Request(req.clone()));
    let value = Value { time: 10, requests: vec![req] };
    // The vote horizon is waited for, the Accepted record joins the flush.
    let horizon = Record::VoteHorizon { view: View(0), seq: Seq(1) + cfg.options.window };
    assert_eq!(out.persist, vec![Persist::Record(horizon)]);
    assert_eq!(out.persist_lazy, vec![Record::Accepted { view: View(0), seq: Seq(1), value: value.clone() }]);
    // PROPOSE is not a vote: it leaves now, in parallel with the primary's fsync.
    assert_eq!(out.send.len(), 3);
    assert!(out
        .send
        .iter()
        .all(|(_, m)| *m == Message::Propose { view: View(0), seq: Seq(1), value: value.clone().into() }));
    // The primary's vote (WRITE) waits for its vote horizon.
    assert!(out.send_after_persist.iter().all(|(_, m)| matches!(m, Message::Write(_))));
    let writes: Vec<_> = out.send_after_persist.iter().filter(|(_, m)| matches!(m, Message::Write(_))).collect();
    assert_eq!(writes.len(), 3);
    let Message::Write(w) = &writes[0].1 else { unreachable!() };
    assert_eq!((w.view, w.seq, w.digest), (View(0), Seq(1), value.digest()));
    assert!(cfg.node_keys[0].verify(&write_statement(&tag(), View(0), Seq(1), &value.digest(), MemberIndex(0)), &w.sig));
}

#[test]
fn backup_rejects_bad_proposals_and_votes_once() {
    let cfg = config(1, 1);
    let mut b = node(&cfg, 1);
    let req = request(&cfg, 7, b"op");
    let value = Value { time: 10, requests: vec![req.clone()] };
    let propose = |v: &Value| Message::Propose { view: View(0), seq: Seq(1), value: v.clone().into() };

    let out = step(&mut b, 10, Peer::Node(NodeId(2)), propose(&value));
    assert_eq!(rejected(&out), vec![Reject::NotPrimary { from: MemberIndex(2), view: View(0) }]);

    let mut forged = req.clone();
    forged.op = b"other".to_vec().into();
    let out = step(&mut b, 10, Peer::Node(NodeId(0)), propose(&Value { time: 10, requests: vec![forged] }));
    assert_eq!(rejected(&out), vec![Reject::BadMac { client: ClientId(7) }]);

    let out = step(&mut b, 10, Peer::Node(NodeId(0)), propose(&Value { time: 10_000, requests: vec![req.clone()] }));
    assert_eq!(rejected(&out), vec![Reject::BadTime { time: 10_000, now: 10 }]);

    let out = step(&mut b, 10, Peer::Node(NodeId(0)), propose(&value));
    assert!(rejected(&out).is_empty());
    assert_eq!(
        out.persist,
        vec![Persist::Record(Record::VoteHorizon { view: View(0), seq: Seq(1) + cfg.options.window })]
    );
    assert_eq!(out.persist_lazy, vec![Record::Accepted { view: View(0), seq: Seq(1), value: value.clone() }]);
    assert_eq!(out.send_after_persist.len(), 3, "one WRITE to each other node");

    // The primary equivocates: a second, different value for the same (view, seq).
    let other = Value { time: 11, requests: vec![req] };
    let out = step(&mut b, 10, Peer::Node(NodeId(0)), propose(&other));
    assert_eq!(rejected(&out), vec![Reject::Equivocation { view: View(0), seq: Seq(1) }]);
    assert!(out.send_after_persist.is_empty());
}

fn with_ticks(mut cfg: ClusterConfig, tick_ms: u64) -> ClusterConfig {
    cfg.options.tick_ms = tick_ms;
    cfg
}

#[test]
fn an_idle_cluster_ticks_at_agreed_time_on_every_node_alike() {
    let cfg = with_ticks(config(1, 1), 50);
    let mut net = Net::new(&cfg);
    for now in (0..=1_000).step_by(5) {
        net.tick(now);
    }
    let log = |net: &Net, n: usize| net.nodes[n].exec.service().0.clone();
    let ticks: Vec<u64> = log(&net, 0)
        .iter()
        .map(|e| String::from_utf8_lossy(e).strip_prefix("tick ").and_then(|t| t.parse().ok()).expect("only ticks"))
        .collect();
    // One tick per 50 ms of agreed time, each a new multiple of tick_ms.
    assert!(ticks.len() >= 18, "{ticks:?}");
    assert!(ticks.windows(2).all(|w| w[1] / 50 > w[0] / 50), "{ticks:?}");
    for n in 1..4 {
        assert_eq!(log(&net, n), log(&net, 0), "node {n} ticked at other points");
    }
    // A request still goes through between ticks, and lands after them.
    let mut c = client(&cfg, 7);
    net.submit(&mut c, 1_001, b"op");
    assert_eq!(log(&net, 0).last().map(Vec::as_slice), Some(&b"op"[..]));
    assert_eq!(log(&net, 3), log(&net, 0));
}

#[test]
fn without_ticks_an_idle_cluster_decides_nothing_and_an_empty_proposal_is_refused() {
    let cfg = config(1, 1);
    let mut net = Net::new(&cfg);
    for now in (0..=500).step_by(5) {
        net.tick(now);
    }
    assert_eq!(net.nodes[0].exec.executed(), Seq(0));
    let mut b = node(&cfg, 1);
    let tick = Message::Propose { view: View(0), seq: Seq(1), value: Value { time: 10, requests: Vec::new() }.into() };
    let out = step(&mut b, 10, Peer::Node(NodeId(0)), tick);
    assert_eq!(rejected(&out), vec![Reject::BadBatch("empty batch")]);
}

#[test]
fn a_backup_refuses_a_tick_sooner_than_tick_ms_after_the_previous_instance() {
    let cfg = with_ticks(config(1, 1), 50);
    let mut b = node(&cfg, 1);
    let propose =
        |seq, time| Message::Propose { view: View(0), seq, value: Value { time, requests: Vec::new() }.into() };
    assert!(rejected(&step(&mut b, 100, Peer::Node(NodeId(0)), propose(Seq(1), 100))).is_empty());
    let out = step(&mut b, 120, Peer::Node(NodeId(0)), propose(Seq(2), 120));
    assert_eq!(rejected(&out), vec![Reject::BadBatch("a tick sooner than tick_ms after the previous instance")]);
    assert!(rejected(&step(&mut b, 150, Peer::Node(NodeId(0)), propose(Seq(2), 150))).is_empty());
}

#[test]
fn writes_with_bad_signatures_do_not_count() {
    let cfg = config(1, 1);
    let mut b = node(&cfg, 1);
    let d = Value::null().digest();
    let sig = secrets(3).signing.sign(&write_statement(&tag(), View(0), Seq(1), &d, MemberIndex(3)));
    // Node 2 presents node 3's signature: bound to the signer, so rejected.
    let out =
        step(&mut b, 0, Peer::Node(NodeId(2)), Message::Write(Write { view: View(0), seq: Seq(1), digest: d, sig }));
    assert_eq!(rejected(&out), vec![Reject::BadSignature { signer: NodeId(2) }]);
    let out = step(
        &mut b,
        0,
        Peer::Node(NodeId(3)),
        Message::Write(Write { view: View(0), seq: Seq(1), digest: d, sig: Sig([0; 64]) }),
    );
    assert_eq!(rejected(&out), vec![Reject::BadSignature { signer: NodeId(3) }]);
}

#[test]
fn writes_a_node_no_longer_needs_are_not_checked() {
    let cfg = config(1, 1);
    let mut b = node(&cfg, 1);
    let value = Value { time: 10, requests: vec![request(&cfg, 7, b"op")] };
    let d = value.digest();
    let write = |from: u32, digest: Digest| {
        let sig = secrets(from).signing.sign(&write_statement(&tag(), View(0), Seq(1), &digest, MemberIndex(from)));
        Message::Write(Write { view: View(0), seq: Seq(1), digest, sig })
    };
    let bad = |digest: Digest| Message::Write(Write { view: View(0), seq: Seq(1), digest, sig: Sig([0; 64]) });
    step(
        &mut b,
        10,
        Peer::Node(NodeId(0)),
        Message::Propose { view: View(0), seq: Seq(1), value: value.clone().into() },
    );
    // A WRITE for another value than the accepted one can never count: not checked.
    let other = Value::null().digest();
    assert!(rejected(&step(&mut b, 10, Peer::Node(NodeId(3)), bad(other))).is_empty());
    // Before the certificate is complete a WRITE for our value is checked...
    assert_eq!(
        rejected(&step(&mut b, 10, Peer::Node(NodeId(3)), bad(d))),
        vec![Reject::BadSignature { signer: NodeId(3) }]
    );
    step(&mut b, 10, Peer::Node(NodeId(0)), write(0, d));
    let out = step(&mut b, 10, Peer::Node(NodeId(2)), write(2, d));
    let accepts = out.send_after_persist.iter().filter(|(_, m)| matches!(m, Message::Accept { .. })).count();
    assert_eq!(accepts, 3, "prepared with its own, node 0's and node 2's WRITE");
    // ...and after it, nothing it brings is looked at.
    let out = step(&mut b, 10, Peer::Node(NodeId(3)), bad(d));
    assert!(rejected(&out).is_empty() && out.is_empty(), "{out:?}");
}

fn read(cfg: &ClusterConfig, id: u64, op: &[u8], consistency: ReadConsistency) -> Read {
    let mut c = client(cfg, id);
    match c.invoke_read_only(0, op.to_vec(), consistency).expect("idle").remove(0).1 {
        Message::Read(r) => r,
        other => panic!("expected a read, got {other:?}"),
    }
}

#[cfg(feature = "mutations")] // used by mutation tests only
/// The bodies of the durability-gated replies to `client` (ordered replies and read
/// answers both wait for the step's records).
fn replies_to(out: &Outputs, client: u64) -> Vec<ReplyBody> {
    out.send_after_persist
        .iter()
        .filter_map(|(to, m)| match m {
            Message::Reply(r) if *to == Peer::Client(ClientId(client)) => Some(r.body.clone()),
            _ => None,
        })
        .collect()
}

fn read_replies(out: &Outputs) -> Vec<ReplyBody> {
    out.send
        .iter()
        .chain(&out.send_after_persist)
        .filter_map(|(_, m)| match m {
            Message::Reply(r) => Some(r.body.clone()),
            _ => None,
        })
        .collect()
}

#[cfg(feature = "mutations")]
#[test]
fn a_linearizable_read_waits_until_what_the_node_accepted_has_executed() {
    let cfg = config(1, 1);
    let mut b = node(&cfg, 1);
    let value = Value { time: 10, requests: vec![request(&cfg, 7, b"a")] };
    let d = value.digest();
    step(&mut b, 10, Peer::Node(NodeId(0)), Message::Propose { view: View(0), seq: Seq(1), value: value.into() });
    for n in [0, 2] {
        let sig = secrets(n).signing.sign(&write_statement(&tag(), View(0), Seq(1), &d, MemberIndex(n)));
        step(&mut b, 10, Peer::Node(NodeId(n)), Message::Write(Write { view: View(0), seq: Seq(1), digest: d, sig }));
    }
    // Prepared (it sent ACCEPT for instance 1), not decided: a linearizable read waits...
    let lin = read(&cfg, 9, b"count", ReadConsistency::Linearizable);
    assert!(read_replies(&step(&mut b, 10, Peer::Client(ClientId(9)), Message::Read(lin.clone()))).is_empty());
    assert!(read_replies(&step(&mut b, 10, Peer::Client(ClientId(9)), Message::Read(lin))).is_empty(), "a repeat too");
    // ...while a serializable read of a session without writes is answered at once.
    let ser = read(&cfg, 11, b"count", ReadConsistency::Serializable);
    assert_eq!(
        read_replies(&step(&mut b, 10, Peer::Client(ClientId(11)), Message::Read(ser))),
        vec![ReplyBody::Full(vec![0])]
    );
    step(&mut b, 10, Peer::Node(NodeId(0)), Message::Accept { view: View(0), seq: Seq(1), digest: d });
    let out = step(&mut b, 10, Peer::Node(NodeId(2)), Message::Accept { view: View(0), seq: Seq(1), digest: d });
    assert_eq!(b.executed(), Seq(1));
    assert_eq!(replies_to(&out, 9), vec![ReplyBody::Full(vec![1])], "answered once instance 1 executed, reflecting it");

    // The deliberate bug the simulator must catch: answer at once.
    let mut cfg_bug = cfg.clone();
    cfg_bug.quorums = cfg.quorums.with_mutation(Some(crate::quorum::Mutation::ReadWithoutWait));
    let mut m = node(&cfg_bug, 1);
    let value = Value { time: 10, requests: vec![request(&cfg, 7, b"a")] };
    step(&mut m, 10, Peer::Node(NodeId(0)), Message::Propose { view: View(0), seq: Seq(1), value: value.into() });
    let lin = read(&cfg, 9, b"count", ReadConsistency::Linearizable);
    assert_eq!(
        read_replies(&step(&mut m, 10, Peer::Client(ClientId(9)), Message::Read(lin))),
        vec![ReplyBody::Full(vec![0])]
    );
}

#[test]
fn a_serializable_read_waits_for_the_sessions_last_write_and_bad_reads_are_rejected() {
    let cfg = config(1, 0);
    let mut p = node(&cfg, 0);
    let mut ser = read(&cfg, 9, b"count", ReadConsistency::Serializable);
    // A session whose last write (seq 5) this node has not executed: waits.
    ser.after = 5;
    let statement = ser.statement();
    ser.auth = (0..3).map(|i| client_mac_key(&secrets(i).mac_secret, ClientId(9)).mac(&statement)).collect();
    assert!(read_replies(&step(&mut p, 10, Peer::Client(ClientId(9)), Message::Read(ser.clone()))).is_empty());
    // Execute the session's request 5 (CFT, node 0 primary: one more ACCEPT decides).
    let mut req = request(&cfg, 9, b"w");
    req.seq = 5;
    let statement = req.statement();
    req.auth = (0..3).map(|i| client_mac_key(&secrets(i).mac_secret, ClientId(9)).mac(&statement)).collect();
    step(&mut p, 10, Peer::Client(ClientId(9)), Message::Request(req));
    let digest = p.log[&Seq(1)].value.as_ref().map(|(_, d)| *d).expect("proposed");
    let out = step(&mut p, 10, Peer::Node(NodeId(1)), Message::Accept { view: View(0), seq: Seq(1), digest });
    assert_eq!(read_replies(&out).first(), Some(&ReplyBody::Full(vec![1])), "the read sees the session's write");

    // Not read-only for the service: the node says so.
    let put = read(&cfg, 9, b"put", ReadConsistency::Serializable);
    assert_eq!(
        read_replies(&step(&mut p, 10, Peer::Client(ClientId(9)), Message::Read(put.clone()))),
        vec![ReplyBody::NotReadOnly]
    );
    // Another client's read, a read from a node, a bad MAC: rejected.
    assert_eq!(
        rejected(&step(&mut p, 10, Peer::Client(ClientId(8)), Message::Read(put.clone()))),
        vec![Reject::WrongPeer]
    );
    assert_eq!(rejected(&step(&mut p, 10, Peer::Node(NodeId(1)), Message::Read(put.clone()))), vec![Reject::WrongPeer]);
    let mut forged = put;
    forged.after = 0;
    forged.seq += 1;
    assert_eq!(
        rejected(&step(&mut p, 10, Peer::Client(ClientId(9)), Message::Read(forged))),
        vec![Reject::BadMac { client: ClientId(9) }]
    );
}

#[cfg(feature = "mutations")] // used by mutation tests only
fn probes(out: &Outputs) -> Vec<(Peer, u64)> {
    out.send
        .iter()
        .filter_map(|(to, m)| match m {
            Message::IndexProbe { round } => Some((*to, *round)),
            _ => None,
        })
        .collect()
}

#[cfg(feature = "mutations")]
#[test]
fn a_read_index_is_the_highest_vote_of_a_quorum_and_the_read_waits_for_it() {
    let cfg = config(1, 0);
    // Node 0 leads view 0: proposing instance 1 is its vote for it. Node 2 missed it.
    let mut primary = node(&cfg, 0);
    let mut req = request(&cfg, 7, b"a");
    req.seq = 1;
    step(&mut primary, 10, Peer::Client(ClientId(7)), Message::Request(req));
    let (value, digest) = primary.log[&Seq(1)].value.clone().expect("proposed");

    let mut lagging = node(&cfg, 2);
    let out = step(
        &mut lagging,
        20,
        Peer::Client(ClientId(9)),
        Message::Read(read(&cfg, 9, b"count", ReadConsistency::Index)),
    );
    assert!(read_replies(&out).is_empty(), "not answered before a quorum said how far it voted");
    let sent = probes(&out);
    assert_eq!(sent.len(), 2, "the probe goes to both other nodes: {sent:?}");
    let round = sent[0].1;
    // A second read arriving meanwhile must wait for a round that leaves after it.
    let out = step(
        &mut lagging,
        21,
        Peer::Client(ClientId(11)),
        Message::Read(read(&cfg, 11, b"count", ReadConsistency::Index)),
    );
    assert!(probes(&out).is_empty(), "one round in flight at a time");

    // The primary voted for instance 1: it says so.
    let ack = step(&mut primary, 22, Peer::Node(NodeId(2)), Message::IndexProbe { round });
    let Some((Peer::Node(NodeId(2)), Message::IndexAck { round: r, accepted })) = ack.send.first().cloned() else {
        panic!("expected an index ack, got {ack:?}")
    };
    assert_eq!((r, accepted), (round, Seq(1)));
    // Its answer completes the round (Q = 2 with node 2's own): index 1, not executed
    // here, so no answer yet; the next round leaves for the second read.
    let out = step(&mut lagging, 23, Peer::Node(NodeId(0)), Message::IndexAck { round, accepted });
    assert!(read_replies(&out).is_empty(), "waits for instance 1");
    let next = probes(&out);
    assert_eq!(next.len(), 2);
    assert!(next[0].1 > round, "a fresh round number");
    // A late or unknown round's answer changes nothing.
    assert!(read_replies(&step(
        &mut lagging,
        23,
        Peer::Node(NodeId(1)),
        Message::IndexAck { round, accepted: Seq(9) }
    ))
    .is_empty());
    // Instance 1 reaches node 2 and decides: the first read is answered, reflecting it.
    step(&mut lagging, 24, Peer::Node(NodeId(0)), Message::Propose { view: View(0), seq: Seq(1), value: value.into() });
    let out = step(&mut lagging, 24, Peer::Node(NodeId(0)), Message::Accept { view: View(0), seq: Seq(1), digest });
    assert_eq!(lagging.executed(), Seq(1));
    assert_eq!(replies_to(&out, 9), vec![ReplyBody::Full(vec![1])]);
    // The second read's round completes on the next answer and is answered at once.
    let out = step(&mut lagging, 25, Peer::Node(NodeId(1)), Message::IndexAck { round: next[0].1, accepted: Seq(0) });
    assert_eq!(read_replies(&out), vec![ReplyBody::Full(vec![1])]);

    // The deliberate bug the simulator must catch: the node's own votes as the index.
    let mut cfg_bug = cfg.clone();
    cfg_bug.quorums = cfg.quorums.with_mutation(Some(crate::quorum::Mutation::IndexWithoutQuorum));
    let mut m = node(&cfg_bug, 2);
    let out =
        step(&mut m, 20, Peer::Client(ClientId(9)), Message::Read(read(&cfg, 9, b"count", ReadConsistency::Index)));
    assert_eq!(read_replies(&out), vec![ReplyBody::Full(vec![0])], "stale: answered before instance 1");
}

#[test]
fn messages_from_unknown_nodes_and_wrong_peers_are_rejected() {
    let cfg = config(1, 1);
    let mut b = node(&cfg, 1);
    let out = step(&mut b, 0, Peer::Node(NodeId(9)), Message::Stop { view: View(1) });
    assert_eq!(rejected(&out), vec![Reject::UnknownNode(NodeId(9))]);
    let out = step(&mut b, 0, Peer::Client(ClientId(5)), Message::Stop { view: View(1) });
    assert_eq!(rejected(&out), vec![Reject::WrongPeer]);
    let req = request(&cfg, 7, b"op");
    let out = step(&mut b, 0, Peer::Client(ClientId(8)), Message::Request(req));
    assert_eq!(rejected(&out), vec![Reject::WrongPeer], "a client may only send its own requests");
}

/// A lossless cluster of order nodes (`test_net.rs`), instrumented: what each step
/// persisted is kept, so a node can restart from its own disk.
pub(super) type Net = TestNet<Log>;

impl Net {
    pub(super) fn new(cfg: &ClusterConfig) -> Net {
        TestNet::of((0..cfg.n() as u32).map(|i| node(cfg, i)).collect(), Vec::new()).instrumented()
    }

    /// Crashes node `n` (its memory and undelivered messages to it are lost) and restarts
    /// it from [`TestNet::durable`].
    pub(super) fn restart(&mut self, n: NodeId, now: u64) {
        self.restart_with(n, secrets(n.0), Log::default(), now);
    }
}

#[test]
fn four_nodes_decide_execute_and_answer() {
    let cfg = config(1, 1);
    let mut net = Net::new(&cfg);
    let mut c = client(&cfg, 7);
    for i in 1..=3u8 {
        net.submit(&mut c, 10 * i as u64, &[i]);
        assert_eq!(net.result(&mut c), Some(vec![i]), "request {i}");
    }
    for n in &net.nodes {
        assert_eq!(n.executed(), Seq(3));
        assert_eq!(n.service().0, vec![vec![1], vec![2], vec![3]]);
    }
}

/// A client sends to u + r + 1 nodes and only they reply, but a large result comes in
/// full from its designated node alone: that node replies whether the client asked it or
/// not. For one of these four clients the designated node of its first request is the
/// node it did not ask; without that rule its result never came (only digests) until a
/// retransmission.
#[test]
fn a_large_result_comes_in_full_from_its_designated_node_even_unasked() {
    let cfg = config(1, 1);
    let mut net = Net::new(&cfg);
    let mut unasked_designated = 0;
    for id in 7..11 {
        let mut c = client(&cfg, id);
        let sent = c.invoke(0, b"big".to_vec()).expect("idle");
        let seq = match &sent[0].1 {
            Message::Request(r) => r.seq,
            m => panic!("a request, not {m:?}"),
        };
        let designated = NodeId(((id + seq) % 4) as u32);
        if !sent.iter().any(|(n, _)| *n == designated) {
            unasked_designated += 1;
        }
        for (n, m) in sent {
            net.post(Peer::Client(ClientId(id)), n, m);
        }
        net.run(0);
        let result = net.result(&mut c);
        assert_eq!(result.map(|r| r.len()), Some(100), "client {id}: the full result, without a retransmission");
    }
    assert!(unasked_designated > 0, "some client's designated node was one it did not ask");
}

/// Client 7's first operation completes; node 0, the primary, crashes; its second
/// completes in view 1 on the others. `retransmit`: the client's retransmissions are
/// sent (else only what its first transmission reached counts).
fn crashed_primary_is_replaced(cfg: &ClusterConfig, retransmit: bool) -> Net {
    let mut net = Net::new(cfg);
    let mut c = client(cfg, 7);
    net.submit(&mut c, 0, b"a");
    assert!(net.result(&mut c).is_some());
    net.down.insert(NodeId(0));
    net.submit(&mut c, 10, b"b");
    assert_eq!(net.result(&mut c), None);
    let timeout = cfg.options.request_timeout_ms;
    let mut now = 10;
    let mut result = None;
    while result.is_none() && now < 10 * timeout {
        now += 5;
        if retransmit {
            let retransmitted = c.on_tick(now);
            net.send(c.id(), retransmitted, now);
        }
        net.tick(now);
        result = net.result(&mut c);
    }
    assert_eq!(result, Some(vec![2]));
    assert!(net.nodes.iter().skip(1).all(|n| n.view() == View(1)));
    net
}

#[test]
fn a_crashed_primary_is_replaced_and_pending_requests_complete() {
    // u + r + 1 nodes got the request: the backups' timers alone replace the primary.
    let net = crashed_primary_is_replaced(&config(1, 1), false);
    let installed = net.events.iter().filter(|(_, e)| *e == Event::ViewInstalled { view: View(1) }).count();
    assert_eq!(installed, 3);
}

/// With r = 0 a client asks the primary alone (`Quorums::first_recipients`). A request
/// that reaches a backup straight from the client (its view is old, or it blamed the
/// primary) is forwarded at once, not at the backup's request timer: without that the
/// operation below completes only after `request_timeout_ms`.
#[test]
fn with_r_0_a_request_goes_to_the_primary_alone_and_a_backup_forwards_one_at_once() {
    let cfg = config(1, 0);
    let mut net = Net::new(&cfg);
    let mut c = client(&cfg, 7);
    let sent = c.invoke(0, b"a".to_vec()).expect("idle");
    assert_eq!(sent.iter().map(|(n, _)| *n).collect::<Vec<_>>(), [NodeId(0)], "the primary alone");
    for (n, m) in sent {
        net.post(Peer::Client(ClientId(7)), n, m);
    }
    net.run(0);
    assert_eq!(net.result(&mut c), Some(vec![1]), "one reply suffices");

    // The same client's next request, sent to a backup only (as after a view change the
    // client has not heard of): done without any timer running.
    let sent = c.invoke(1, b"b".to_vec()).expect("idle");
    let (_, msg) = sent.into_iter().next().expect("a request");
    net.post(Peer::Client(ClientId(7)), NodeId(1), msg);
    net.run(1);
    assert_eq!(net.result(&mut c), Some(vec![2]), "the backup forwarded it and replied once it executed");

    // With r > 0 a backup does not: it waits for its request timer (the client sends
    // to u + r + 1 there, among them the primary).
    let cfg = config(1, 1);
    let mut b = node(&cfg, 1);
    let out = step(&mut b, 0, Peer::Client(ClientId(7)), Message::Request(request(&cfg, 7, b"a")));
    assert!(!out.send.iter().any(|(_, m)| matches!(m, Message::Forward(_))), "no forward at r = 1");
}

/// With r = 0 the client's request reached the crashed primary only; its retransmission
/// brings the backups in, whose request timers replace the primary.
#[test]
fn with_r_0_a_crashed_primary_is_replaced_and_the_request_completes() {
    crashed_primary_is_replaced(&config(1, 0), true);
}

#[test]
fn with_rotation_the_primary_changes_on_schedule_and_requests_keep_completing() {
    let mut cfg = config(1, 1);
    cfg.options.leader_rotate_ms = 1_000;
    let mut net = Net::new(&cfg);
    let mut c = client(&cfg, 7);
    let mut now = 0;
    let mut done = 0;
    while now < 3_500 {
        if !c.busy() {
            net.submit(&mut c, now, b"op");
        }
        now += 5;
        net.tick(now);
        if net.result(&mut c).is_some() {
            done += 1;
        }
    }
    // Views 1, 2 and 3 by 3.5 s (each after a second of the previous one, plus the view
    // change itself), with every node in the same view and work done throughout.
    let views: Vec<View> = net.nodes.iter().map(|n| n.view()).collect();
    assert!(views.iter().all(|&v| v == views[0]) && views[0] == View(3), "views {views:?}");
    assert!(done > 100, "only {done} requests completed");
    // Without rotation nobody moves.
    let mut net = Net::new(&config(1, 1));
    for t in 1..700 {
        net.tick(t * 5);
    }
    assert!(net.nodes.iter().all(|n| n.view() == View(0)));
}

#[test]
fn a_recovered_node_keeps_its_vote() {
    // Rule 1 across a crash: a backup that accepted a value for (view, seq) and restarts
    // from its log must refuse a different value for the same (view, seq).
    let cfg = config(1, 1);
    let mut b = node(&cfg, 1);
    let req = request(&cfg, 7, b"op");
    let value = Value { time: 10, requests: vec![req.clone()] };
    let out =
        step(&mut b, 10, Peer::Node(NodeId(0)), Message::Propose { view: View(0), seq: Seq(1), value: value.into() });
    // The flush the WRITE waited for (its vote horizon) took the Accepted record along.
    // (When that record is lost, the horizon keeps the node from voting: safety_tests.rs.)
    let records: Vec<Record> = out
        .persist
        .into_iter()
        .filter_map(|p| match p {
            Persist::Record(r) => Some(r),
            _ => None,
        })
        .chain(out.persist_lazy)
        .collect();
    let mut out = Outputs::default();
    let mut b = Replica::recover(
        cfg.clone(),
        NodeId(1),
        secrets(1),
        Log::default(),
        Durable { snapshots: vec![], records },
        20,
        &mut out,
    )
    .expect("recovers");
    let other = Value { time: 11, requests: vec![req] };
    let out =
        step(&mut b, 20, Peer::Node(NodeId(0)), Message::Propose { view: View(0), seq: Seq(1), value: other.into() });
    assert_eq!(rejected(&out), vec![Reject::Equivocation { view: View(0), seq: Seq(1) }]);
}

#[test]
fn new_view_keeps_the_highest_certificate_and_fills_gaps_with_null() {
    let value = |time| Value { time, requests: vec![] };
    let cert = |view, seq, time| {
        Cert { view: View(view), seq, value: value(time), writes: vec![(MemberIndex(2), Sig([0; 64]))] }.proof()
    };
    let stable = StableProof::genesis();
    let vc = |from, certs| ViewChange { view: View(5), from, stable: stable.clone(), certs, sig: Sig([0; 64]) };
    let d = view_change::decide_new_view(&[
        vc(MemberIndex(0), vec![cert(1, Seq(1), 100), cert(1, Seq(3), 300)]),
        vc(MemberIndex(1), vec![cert(2, Seq(1), 111)]),
        vc(MemberIndex(2), vec![]),
    ]);
    assert_eq!(d.values.len(), 3);
    assert_eq!(d.values[&Seq(1)].digest, value(111).digest(), "highest view wins");
    assert_eq!(d.values[&Seq(2)].digest, Value::null().digest(), "gap filled with null");
    assert!(d.values[&Seq(2)].holders.is_empty(), "null needs no body");
    assert_eq!(d.values[&Seq(3)].digest, value(300).digest());
    // Holders: the node that named the certificate, then its writers.
    assert_eq!(d.values[&Seq(1)].holders, [1, 2].map(MemberIndex).to_vec());
    assert_eq!(d.values[&Seq(3)].holders, [0, 2].map(MemberIndex).to_vec());
}

#[test]
fn forged_view_change_certificates_are_rejected() {
    let cfg = config(1, 1);
    // Node 1 is the primary of view 1.
    let mut p = node(&cfg, 1);
    let forged = CertProof {
        view: View(0),
        seq: Seq(1),
        digest: Value::null().digest(),
        writes: MemberIndex::all(3).map(|n| (n, Sig([1; 64]))).collect(),
    };
    let mut vc = ViewChange {
        view: View(1),
        from: MemberIndex(2),
        stable: StableProof::genesis(),
        certs: vec![forged],
        sig: Sig([0; 64]),
    };
    vc.sig = secrets(2).signing.sign(&vc.statement(&tag()));
    let out = step(&mut p, 0, Peer::Node(NodeId(2)), Message::ViewChange(vc));
    assert_eq!(rejected(&out), vec![Reject::BadSignature { signer: NodeId(0) }]);
}

#[test]
fn a_healed_partitioned_former_primary_learns_the_new_view() {
    let cfg = config(1, 1);
    let mut net = Net::new(&cfg);
    let mut c = client(&cfg, 7);
    net.submit(&mut c, 0, b"a");
    assert!(net.result(&mut c).is_some());
    // Partition node 0 (the primary) away: it keeps its state and clock, hears nothing.
    net.down.insert(NodeId(0));
    net.submit(&mut c, 10, b"b");
    let mut now = 10;
    while net.nodes[1].view() == View(0) && now < 20_000 {
        now += 5;
        net.tick(now);
    }
    assert_eq!(net.nodes[1].view(), View(1));
    assert_eq!(net.result(&mut c), Some(vec![2]));
    // Meanwhile the isolated node only suspected, never committed to a view change.
    assert_eq!(net.nodes[0].view(), View(0));
    // Heal: STATUS gossip brings it the NEW-VIEW; it installs view 1 and catches up.
    net.down.remove(&NodeId(0));
    for _ in 0..100 {
        now += 5;
        net.tick(now);
    }
    assert_eq!(net.nodes[0].view(), View(1), "{}", net.nodes[0].status_line());
    assert_eq!(net.nodes[0].executed(), net.nodes[1].executed());
    assert!(net.events.iter().any(|(n, e)| *n == NodeId(0) && *e == Event::ViewInstalled { view: View(1) }));
}

#[test]
fn a_node_whose_checkpoint_differs_reports_divergence_and_repairs() {
    let cfg = config(1, 1);
    let mut net = Net::new(&cfg);
    let mut c = client(&cfg, 7);
    // Corrupt node 3's state before the first checkpoint (as a disk or memory fault would).
    net.nodes[3].exec.restore(&Executor::new(Log(vec![b"garbage".to_vec()])).snapshot()).expect("restore");
    let interval = cfg.options.checkpoint_interval;
    let mut now = 0;
    for i in 0..interval {
        now += 10;
        net.submit(&mut c, now, &[i as u8]);
        assert!(net.result(&mut c).is_some());
    }
    for _ in 0..200 {
        now += 5;
        net.tick(now);
    }
    let divergence = net.events.iter().find_map(|(n, e)| match e {
        Event::Divergence { seq, .. } if *n == NodeId(3) => Some(*seq),
        _ => None,
    });
    assert_eq!(divergence, Some(Seq(interval)), "node 3 reports the divergent checkpoint");
    assert!(net.events.iter().any(|(n, e)| *n == NodeId(3) && matches!(e, Event::StateTransferDone { .. })));
    assert_eq!(net.nodes[3].service().0, net.nodes[0].service().0, "repaired by state transfer");
}

#[test]
fn a_recovered_primary_never_proposes_in_its_old_view_and_the_others_follow_its_stop() {
    // CFT (n = 3): the PROPOSE leaves before the primary's Accepted record is durable. If
    // the primary crashes before the fsync and came back proposing something else for
    // the same (view, seq), two same-view certificates could meet in a view change.
    let cfg = config(1, 0);
    let mut p = node(&cfg, 0);
    let out = step(&mut p, 10, Peer::Client(ClientId(7)), Message::Request(request(&cfg, 7, b"x")));
    assert!(out.send.iter().any(|(_, m)| matches!(m, Message::Propose { .. })), "sent before durable");
    // Crash before the sync: nothing of that step survives.
    let mut out = Outputs::default();
    let mut p = Replica::recover(cfg.clone(), NodeId(0), secrets(0), Log::default(), Durable::default(), 20, &mut out)
        .expect("recover");
    assert_eq!(p.view(), View(0));
    let stops: Vec<_> = out.send.iter().filter(|(_, m)| *m == Message::Stop { view: View(1) }).collect();
    assert_eq!(stops.len(), 2, "asks both peers to leave view 0");
    let out = step(&mut p, 30, Peer::Client(ClientId(8)), Message::Request(request(&cfg, 8, b"y")));
    let proposes = out.send.iter().chain(&out.send_after_persist).filter(|(_, m)| matches!(m, Message::Propose { .. }));
    assert_eq!(proposes.count(), 0, "no fresh proposal in a view it may have forgotten");
    assert!(out.persist.is_empty(), "and no vote");
    // A backup follows the primary's own STOP at once, where it would otherwise wait for
    // r + 1 STOPs (with r = 1: a STOP from one backup alone is not enough).
    let bft = config(1, 1);
    let mut b = node(&bft, 1);
    let out = step(&mut b, 30, Peer::Node(NodeId(2)), Message::Stop { view: View(1) });
    assert!(out.send.is_empty());
    let mut b = node(&bft, 1);
    let out = step(&mut b, 30, Peer::Node(NodeId(0)), Message::Stop { view: View(1) });
    assert!(out.send.iter().any(|(_, m)| *m == Message::Stop { view: View(1) }));
}

#[test]
fn the_decided_record_is_lazy_so_the_reply_waits_for_no_fsync_of_its_own() {
    // Q ACCEPTs each left after their sender's vote was durable: the decision is durable
    // already. The step that learns it persists nothing a reply must wait for.
    let cfg = config(1, 1);
    let mut net = Net::new(&cfg);
    let mut c = client(&cfg, 7);
    net.submit(&mut c, 0, b"a");
    assert!(net.result(&mut c).is_some());
    let decide_steps: Vec<_> = net.steps.iter().filter(|s| s.decided).collect();
    assert_eq!(decide_steps.len(), 4, "every node decided once");
    for s in decide_steps {
        assert!(s.persist.is_empty(), "node {}: nothing eager in the deciding step", s.node);
        assert!(s.lazy.iter().any(|r| matches!(r, Record::Decided { seq: Seq(1), .. })));
        // The client sent its request to u + r + 1 = 3 nodes from the primary on; they
        // reply, the fourth only to a retransmission.
        if s.node < NodeId(3) {
            assert!(s.replies > 0, "node {} replied in that step", s.node);
        } else {
            assert_eq!(s.replies, 0, "node {} was not asked, so it does not reply", s.node);
        }
    }
}

#[test]
fn sessions_share_their_owners_connection_and_keys_but_nobody_elses() {
    use crate::message::{owner_of, session_id, session_of, SESSIONS_MAX};
    let cfg = config(1, 1);
    let owner = 7;
    let s3 = session_id(ClientId(owner), 3);
    assert_eq!((owner_of(s3), session_of(s3)), (ClientId(owner), 3));
    assert_eq!(session_id(ClientId(owner), 0), ClientId(owner), "session 0 is the identity itself");
    // The key a node derives for a session equals the one its owner derives from the
    // owner key in its client file; sessions' keys differ.
    let node_side = client_mac_key(&secrets(0).mac_secret, s3);
    assert!(node_side == session_mac_key(&client_mac_key(&secrets(0).mac_secret, ClientId(owner)), 3));
    assert!(node_side != client_mac_key(&secrets(0).mac_secret, session_id(ClientId(owner), 4)));
    // The owner's connection may carry the session's request; another client's may not.
    let mut p = node(&cfg, 0);
    let req = request(&cfg, s3.0, b"op");
    let out = step(&mut p, 0, Peer::Client(ClientId(8)), Message::Request(req.clone()));
    assert_eq!(rejected(&out), vec![Reject::WrongPeer]);
    let out = step(&mut p, 0, Peer::Client(ClientId(owner)), Message::Request(req));
    assert!(rejected(&out).is_empty());
    assert!(out.send.iter().any(|(_, m)| matches!(m, Message::Propose { .. })));
    // Session numbers are bounded.
    let too_many = request(&cfg, (session_id(ClientId(owner), SESSIONS_MAX)).0, b"op");
    let out = step(&mut p, 0, Peer::Client(ClientId(owner)), Message::Request(too_many));
    assert_eq!(rejected(&out), vec![Reject::Busy("session number above SESSIONS_MAX")]);
}

#[test]
fn a_held_burst_of_requests_is_proposed_as_one_batch() {
    let cfg = config(1, 1);
    // Three: below the test options' batch_count_max (4), so no batch is full.
    let reqs: Vec<Request> = (0..3).map(|c| request(&cfg, 10 + c, b"op")).collect();
    let proposals = |out: &Outputs| -> Vec<usize> {
        out.send
            .iter()
            .filter(|(to, _)| *to == Peer::Node(NodeId(1)))
            .filter_map(|(_, m)| if let Message::Propose { value, .. } = m { Some(value.requests.len()) } else { None })
            .collect()
    };
    // Stepped one by one, an idle primary proposes the first request alone.
    let mut p = node(&cfg, 0);
    let mut out = Outputs::default();
    for r in &reqs {
        p.step(10, Input::Message { from: Peer::Client(r.client), msg: Message::Request(r.clone()) }, &mut out);
    }
    assert_eq!(proposals(&out), vec![1]);
    // Held, the burst becomes one batch when released, and nothing leaves before.
    let mut p = node(&cfg, 0);
    let mut out = Outputs::default();
    p.hold_proposals();
    for r in &reqs {
        p.step(10, Input::Message { from: Peer::Client(r.client), msg: Message::Request(r.clone()) }, &mut out);
    }
    assert!(proposals(&out).is_empty());
    p.release_proposals(10, &mut out);
    assert_eq!(proposals(&out), vec![3]);
}

#[test]
fn the_verify_stage_vouches_only_for_valid_signatures_of_their_sender() {
    let cfg = config(1, 1);
    let b = node(&cfg, 1);
    let v = b.verifier();
    let d = Value::null().digest();
    let write = |signer: u32, seq| {
        Message::Write(Write {
            view: View(0),
            seq,
            digest: d,
            sig: secrets(signer).signing.sign(&write_statement(&tag(), View(0), seq, &d, MemberIndex(signer))),
        })
    };
    assert!(v.check(NodeId(3), &write(3, Seq(1))));
    assert!(!v.check(NodeId(2), &write(3, Seq(1))), "another node's signature");
    assert!(!v.check(NodeId(1), &write(1, Seq(1))), "our own id never arrives from the network");
    assert!(!v.check(NodeId(7), &write(3, Seq(1))), "unknown node");
    let Message::Write(mut forged) = write(3, Seq(1)) else { unreachable!() };
    forged.seq = Seq(2);
    assert!(!v.check(NodeId(3), &Message::Write(forged)), "signature over other fields");
    let root = Digest::of(b"state");
    let membership = Digest::of(b"members");
    let sig = secrets(2).signing.sign(&checkpoint_statement(Seq(8), &root, &membership, NodeId(2)));
    let vote = CheckpointVote { seq: Seq(8), root, membership, sig };
    assert!(v.check(NodeId(2), &Message::Checkpoint(vote.clone())));
    assert!(!v.check(NodeId(3), &Message::Checkpoint(vote)));
    assert!(!v.check(NodeId(2), &Message::Stop { view: View(1) }), "kinds it does not cover");
}

#[test]
fn a_checked_input_is_handled_like_the_same_message_verified_inline() {
    let cfg = config(1, 1);
    let req = request(&cfg, 7, b"op");
    let value = Value { time: 10, requests: vec![req] };
    let d = value.digest();
    let run = |checked: bool| {
        let mut b = node(&cfg, 1);
        let mut out = Outputs::default();
        b.step(
            10,
            Input::Message {
                from: Peer::Node(NodeId(0)),
                msg: Message::Propose { view: View(0), seq: Seq(1), value: value.clone().into() },
            },
            &mut out,
        );
        for signer in [0u32, 2] {
            let msg = Message::Write(Write {
                view: View(0),
                seq: Seq(1),
                digest: d,
                sig: secrets(signer).signing.sign(&write_statement(&tag(), View(0), Seq(1), &d, MemberIndex(signer))),
            });
            let input = if checked {
                Input::Checked { from: NodeId(signer), msg }
            } else {
                Input::Message { from: Peer::Node(NodeId(signer)), msg }
            };
            b.step(10, input, &mut out);
        }
        out
    };
    let (inline, staged) = (run(false), run(true));
    assert_eq!(inline.persist, staged.persist);
    assert_eq!(inline.send_after_persist, staged.send_after_persist);
    // Prepared (Q = 3 writes with its own): a certificate was persisted and ACCEPT sent.
    assert!(staged.persist.iter().any(|p| matches!(p, Persist::Record(Record::Prepared(_)))));
    assert!(staged.send_after_persist.iter().any(|(_, m)| matches!(m, Message::Accept { .. })));
}

#[test]
fn a_decision_learned_before_its_proposal_executes_when_the_proposal_arrives() {
    // CFT, n = 3, Q = 2: nodes 0 and 2 ACCEPT before node 1 sees the PROPOSE.
    let cfg = config(1, 0);
    let mut b = node(&cfg, 1);
    let value = Value { time: 10, requests: vec![request(&cfg, 7, b"op")] };
    let d = value.digest();
    let mut out = Outputs::default();
    for from in [0u32, 2] {
        b.step(
            10,
            Input::Message {
                from: Peer::Node(NodeId(from)),
                msg: Message::Accept { view: View(0), seq: Seq(1), digest: d },
            },
            &mut out,
        );
    }
    assert!(out.events.iter().any(|e| matches!(e, Event::Decided { seq: Seq(1), .. })));
    assert_eq!(b.executed(), Seq(0), "decided, but the body is missing");
    b.step(
        10,
        Input::Message {
            from: Peer::Node(NodeId(0)),
            msg: Message::Propose { view: View(0), seq: Seq(1), value: value.into() },
        },
        &mut out,
    );
    assert_eq!(b.executed(), Seq(1), "the proposal brings the body: execute at once");
}

/// A NEW-VIEW for view 1 (BFT, n = 4) built from the view changes of nodes 0, 1 and 2,
/// each naming `value` as prepared for instance 1 in view 0 with valid WRITE signatures.
fn new_view_naming(value: &Value) -> NewView {
    let d = value.digest();
    let writes: Vec<(MemberIndex, Sig)> = MemberIndex::all(3)
        .map(|n| (n, secrets(n.0).signing.sign(&write_statement(&tag(), View(0), Seq(1), &d, n))))
        .collect();
    let cert = CertProof { view: View(0), seq: Seq(1), digest: d, writes };
    let stable = StableProof::genesis();
    let view_changes = (0..3u32)
        .map(|from| {
            let mut vc = ViewChange {
                view: View(1),
                from: MemberIndex(from),
                stable: stable.clone(),
                certs: vec![cert.clone()],
                sig: Sig([0; 64]),
            };
            vc.sig = secrets(from).signing.sign(&vc.statement(&tag()));
            vc
        })
        .collect();
    let mut nv = NewView { view: View(1), view_changes, sig: Sig([0; 64]) };
    nv.sig = secrets(1).signing.sign(&nv.statement(&tag()));
    nv
}

fn writes_for(out: &Outputs, view: u64, seq: Seq) -> usize {
    let view = View(view);
    out.send_after_persist
        .iter()
        .filter(|(_, m)| matches!(m, Message::Write(w) if w.view == view && w.seq == seq))
        .count()
}

#[test]
fn a_re_proposal_named_by_digest_is_fetched_from_its_holders_before_the_vote() {
    let cfg = config(1, 1);
    let value = Value { time: 10, requests: vec![request(&cfg, 7, b"op")] };
    let nv = new_view_naming(&value);
    // Node 3 never saw the proposal: it cannot vote for a digest it has no body for.
    let mut b = node(&cfg, 3);
    let out = step(&mut b, 20, Peer::Node(NodeId(1)), Message::NewView(nv));
    assert_eq!(b.view(), View(1));
    assert_eq!(writes_for(&out, 1, Seq(1)), 0, "no vote without the body");
    let fetch = Message::FetchValue { seq: Seq(1), digest: value.digest() };
    // Holders 0, 1, 2 (who named it); node 3 starts at (3 + seq 1) mod 3 = holder 1, so
    // that not every node asks holder 0.
    assert_eq!(out.send, vec![(Peer::Node(NodeId(1)), fetch.clone())], "asks a node that named it");
    // Unanswered: the next retransmission asks the next holder.
    let mut out = Outputs::default();
    b.step(20 + cfg.options.retransmit_ms, Input::Tick, &mut out);
    assert!(out.send.contains(&(Peer::Node(NodeId(2)), fetch)));
    // A body that does not hash to the named digest is rejected and changes nothing.
    let wrong = Value { time: 11, requests: value.requests.clone() };
    let out = step(&mut b, 30, Peer::Node(NodeId(0)), Message::ValueBody { seq: Seq(1), value: wrong });
    assert!(matches!(rejected(&out)[..], [Reject::BadProof(_)]));
    assert_eq!(writes_for(&out, 1, Seq(1)), 0);
    // The right body: persisted, then voted for in the new view.
    let out = step(&mut b, 30, Peer::Node(NodeId(0)), Message::ValueBody { seq: Seq(1), value: value.clone() });
    assert!(rejected(&out).is_empty());
    assert_eq!(
        out.persist,
        vec![Persist::Record(Record::VoteHorizon { view: View(1), seq: Seq(1) + cfg.options.window })]
    );
    assert_eq!(out.persist_lazy, vec![Record::Accepted { view: View(1), seq: Seq(1), value: value.clone() }]);
    assert_eq!(writes_for(&out, 1, Seq(1)), 3);
    // A second answer is ignored, and nothing is fetched any more.
    let out = step(&mut b, 30, Peer::Node(NodeId(1)), Message::ValueBody { seq: Seq(1), value });
    assert!(rejected(&out).is_empty() && out.persist.is_empty());
    let mut out = Outputs::default();
    b.step(40 + 2 * cfg.options.retransmit_ms, Input::Tick, &mut out);
    assert!(!out.send.iter().any(|(_, m)| matches!(m, Message::FetchValue { .. })));
}

#[test]
fn a_node_that_wrote_without_preparing_keeps_the_body_for_the_next_view_and_serves_it() {
    let cfg = config(1, 1);
    let value = Value { time: 10, requests: vec![request(&cfg, 7, b"op")] };
    // Node 3 accepted (wrote for) the value in view 0 but never saw Q WRITEs: no certificate.
    let mut b = node(&cfg, 3);
    let out = step(
        &mut b,
        10,
        Peer::Node(NodeId(0)),
        Message::Propose { view: View(0), seq: Seq(1), value: value.clone().into() },
    );
    assert_eq!(writes_for(&out, 0, Seq(1)), 3);
    let out = step(&mut b, 20, Peer::Node(NodeId(1)), Message::NewView(new_view_naming(&value)));
    assert_eq!(writes_for(&out, 1, Seq(1)), 3, "votes at once from its earlier-view proposal");
    assert!(!out.send.iter().any(|(_, m)| matches!(m, Message::FetchValue { .. })));
    // And serves the body to a peer that lacks it; not a body with another digest.
    let fetch = Message::FetchValue { seq: Seq(1), digest: value.digest() };
    let out = step(&mut b, 20, Peer::Node(NodeId(2)), fetch.clone());
    assert_eq!(out.send, vec![(Peer::Node(NodeId(2)), Message::ValueBody { seq: Seq(1), value: value.clone() })]);
    let out =
        step(&mut b, 20, Peer::Node(NodeId(2)), Message::FetchValue { seq: Seq(1), digest: Value::null().digest() });
    assert!(out.send.is_empty());
    // A small question pulls a whole batch: once per instance and period per peer.
    let out = step(&mut b, 21, Peer::Node(NodeId(2)), fetch.clone());
    assert!(out.send.is_empty());
    assert!(matches!(rejected(&out)[..], [Reject::Busy(_)]));
    let out = step(&mut b, 21, Peer::Node(NodeId(0)), fetch.clone());
    assert_eq!(out.send.len(), 1, "another peer is answered");
    let out = step(&mut b, 20 + cfg.options.retransmit_ms, Peer::Node(NodeId(2)), fetch);
    assert_eq!(out.send, vec![(Peer::Node(NodeId(2)), Message::ValueBody { seq: Seq(1), value })]);
}

#[test]
fn a_null_re_proposal_does_not_push_a_real_body_out_of_the_earlier_views() {
    // Node 3 accepts A in view 0, null in view 1 (a gap), B in view 2; then the NEW-VIEW
    // of view 3 names A again. Two earlier bodies are kept: null must not be one of them,
    // or A is gone (found in review).
    let cfg = config(1, 1);
    let a = Value { time: 10, requests: vec![request(&cfg, 7, b"a")] };
    let bv = Value { time: 11, requests: vec![request(&cfg, 8, b"b")] };
    let stable = StableProof::genesis();
    // NEW-VIEW(view) from nodes 0..3, each naming the given (seq, digest) as prepared in view 0.
    let new_view = |view: u64, certs: &[(Seq, Digest)]| {
        let certs: Vec<CertProof> = certs
            .iter()
            .map(|&(seq, digest)| {
                let writes = MemberIndex::all(3)
                    .map(|n| (n, secrets(n.0).signing.sign(&write_statement(&tag(), View(0), seq, &digest, n))))
                    .collect();
                CertProof { view: View(0), seq, digest, writes }
            })
            .collect();
        let view_changes = (0..3u32)
            .map(|from| {
                let mut vc = ViewChange {
                    view: View(view),
                    from: MemberIndex(from),
                    stable: stable.clone(),
                    certs: certs.clone(),
                    sig: Sig([0; 64]),
                };
                vc.sig = secrets(from).signing.sign(&vc.statement(&tag()));
                vc
            })
            .collect();
        let view = View(view);
        let mut nv = NewView { view, view_changes, sig: Sig([0; 64]) };
        nv.sig = secrets((cfg.primary(view)).0).signing.sign(&nv.statement(&tag()));
        Message::NewView(nv)
    };
    let mut b = node(&cfg, 3);
    step(&mut b, 10, Peer::Node(NodeId(0)), Message::Propose { view: View(0), seq: Seq(1), value: a.clone().into() });
    // View 1: a certificate for instance 2 only, so instance 1 is re-proposed as null.
    let out = step(&mut b, 20, Peer::Node(NodeId(1)), new_view(1, &[(Seq(2), Value::null().digest())]));
    assert_eq!(writes_for(&out, 1, Seq(1)), 3, "voted for null in view 1");
    // View 2 names B for instance 1: fetched, then voted for.
    step(&mut b, 30, Peer::Node(NodeId(2)), new_view(2, &[(Seq(1), bv.digest())]));
    let out = step(&mut b, 30, Peer::Node(NodeId(0)), Message::ValueBody { seq: Seq(1), value: bv });
    assert_eq!(writes_for(&out, 2, Seq(1)), 3, "voted for B in view 2");
    // View 5 (view 3's primary is node 3 itself) names A again: node 3 still holds it.
    let out = step(&mut b, 40, Peer::Node(NodeId(1)), new_view(5, &[(Seq(1), a.digest())]));
    assert!(rejected(&out).is_empty(), "{:?}", rejected(&out));
    assert_eq!(writes_for(&out, 5, Seq(1)), 3, "votes for A from its own earlier body");
    assert!(!out.send.iter().any(|(_, m)| matches!(m, Message::FetchValue { .. })));
}

// ----- auth = rq-mac (endorse.rs) -----

/// A request of `client` whose MAC entries are valid only for the nodes in `valid`.
fn request_valid_at(cfg: &ClusterConfig, client: u64, seq: u64, op: &[u8], valid: &[u32]) -> Request {
    let mut req = Request::new(ClientId(client), seq, op.to_vec().into());
    let statement = req.statement();
    req.auth = (0..cfg.n() as u32)
        .map(|i| {
            let mac = client_mac_key(&secrets(i).mac_secret, ClientId(client)).mac(&statement);
            if valid.contains(&i) {
                mac
            } else {
                [0x5a; 16]
            }
        })
        .collect();
    req
}

fn send_to_all(net: &mut Net, req: &Request, now: u64) {
    for n in NodeRange::first(net.nodes.len()) {
        net.post(Peer::Client(req.client), n, Message::Request(req.clone()));
    }
    net.run(now);
}

fn views_started(net: &Net) -> usize {
    net.events.iter().filter(|(_, e)| matches!(e, Event::ViewChangeStarted { .. })).count()
}

fn executed_by_all(net: &Net, client: u64) -> bool {
    net.nodes.iter().all(|n| n.exec.last_seq(ClientId(client)) >= 1)
}

#[test]
fn rq_mac_proposals_carry_endorsements_instead_of_the_clients_macs() {
    let cfg = config_rq(1, 1);
    assert_eq!(cfg.auth, Auth::RqMac, "the default with r > 0");
    let mut net = Net::new(&cfg);
    let mut c = client(&cfg, 7);
    let first = c.invoke(10, b"x".to_vec()).expect("idle");
    let targets: Vec<NodeId> = first.iter().map(|(n, _)| *n).collect();
    assert_eq!(targets, [0, 1, 2].map(NodeId).to_vec(), "u + r + 1 nodes from the primary on");
    for (n, m) in first {
        net.post(Peer::Client(ClientId(7)), n, m);
    }
    net.run(10);
    assert_eq!(net.result(&mut c), Some(vec![1]));
    let proposal = net.nodes[3].log.values().find_map(|s| s.value.clone()).expect("node 3 accepted a proposal");
    let req = &proposal.0.requests[0];
    assert!(req.auth.is_empty(), "the client's authenticator stays at the RQ");
    assert_eq!(req.endorsements.len(), cfg.quorums.endorse_propose());
    assert!(net.nodes.iter().all(|n| n.executed() == Seq(1)), "node 3 never saw the client and still executed");
}

/// Client 7 sends every node a request whose MACs are valid at the primary and node 1
/// only; then client 8 sends a correct one.
fn split_mac_client(cfg: &ClusterConfig) -> (Net, Client) {
    let mut net = Net::new(cfg);
    let bad = request_valid_at(cfg, 7, 1, b"bad", &[0, 1]);
    send_to_all(&mut net, &bad, 10);
    let mut good = client(cfg, 8);
    net.submit(&mut good, 11, b"good");
    (net, good)
}

#[test]
fn a_client_whose_macs_fail_at_some_nodes_stalls_nobody_and_changes_no_view() {
    let cfg = config_rq(1, 1);
    let timeout = cfg.options.request_timeout_ms;
    // Two endorsements for client 7's request; the primary needs three.
    let (mut net, mut good) = split_mac_client(&cfg);
    assert_eq!(net.result(&mut good), Some(vec![1]), "another client's request goes through at once");
    assert!(!executed_by_all(&net, 7), "not proposable yet");
    // The first timer expiry spreads the two endorsements; nodes 2 and 3 take r + 1 = 2
    // nodes' word, endorse too, and the primary proposes.
    net.tick(10 + timeout);
    assert!(executed_by_all(&net, 7), "executed once every correct node endorsed it");
    net.tick(10 + 3 * timeout);
    assert_eq!(views_started(&net), 0, "nobody suspects the primary");
    assert!(net.nodes.iter().all(|n| n.view() == View(0)));
    let bad_macs = net
        .events
        .iter()
        .filter(|(_, e)| matches!(e, Event::Rejected { reason: Reject::BadMac { client: ClientId(7) }, .. }))
        .count();
    assert_eq!(bad_macs, 2, "nodes 2 and 3 rejected the client's own message");
}

#[test]
fn a_request_only_one_node_can_authenticate_never_executes_and_never_costs_a_view() {
    let cfg = config_rq(1, 1);
    let timeout = cfg.options.request_timeout_ms;
    let mut net = Net::new(&cfg);
    // Valid at node 1 only: one endorsement, below r + 1 = 2, so nobody else takes it up.
    let bad = request_valid_at(&cfg, 7, 1, b"bad", &[1]);
    send_to_all(&mut net, &bad, 10);
    for k in 1..=6 {
        net.tick(10 + k * timeout);
    }
    let mut good = client(&cfg, 8);
    net.submit(&mut good, 10 + 6 * timeout, b"good");
    assert_eq!(net.result(&mut good), Some(vec![1]));
    assert!(net.nodes.iter().all(|n| n.exec.last_seq(ClientId(7)) == 0), "no correct node can vouch for it");
    assert_eq!(views_started(&net), 0, "one endorsement is no reason to suspect the primary");
}

#[test]
fn a_backup_refuses_a_proposed_request_without_u_plus_one_valid_endorsements() {
    let cfg = config_rq(1, 1);
    let mut b = node(&cfg, 1);
    let req = Request::new(ClientId(424_242), 1, b"made up".to_vec().into());
    let statement = req.statement();
    let endorse = |i: u32| Endorsement {
        node: NodeId(i),
        macs: endorse_keys(&secrets(i).signing, &config_rq(1, 1).membership)
            .iter()
            .map(|k| k.mac(&endorse_statement(NodeId(i), &statement)))
            .collect(),
    };
    let propose = |endorsements: Vec<Endorsement>| Message::Propose {
        view: View(0),
        seq: Seq(1),
        value: Value { time: 10, requests: vec![Request { endorsements, ..req.clone() }] }.into(),
    };
    // The primary's own word, twice: one endorser.
    let out = step(&mut b, 10, Peer::Node(NodeId(0)), propose(vec![endorse(0), endorse(0)]));
    assert_eq!(rejected(&out), vec![Reject::BadBatch("a request without enough valid endorsements")]);
    // Two endorsers, but node 2's entry for node 1 is forged.
    let mut forged = endorse(2);
    forged.macs[1] = [0; 16];
    let out = step(&mut b, 10, Peer::Node(NodeId(0)), propose(vec![endorse(0), forged]));
    assert_eq!(rejected(&out), vec![Reject::BadBatch("a request without enough valid endorsements")]);
    // u + 1 = 2 valid endorsers: accepted (this node sends its WRITE).
    let out = step(&mut b, 10, Peer::Node(NodeId(0)), propose(vec![endorse(0), endorse(2)]));
    assert!(rejected(&out).is_empty());
    assert!(out.send_after_persist.iter().any(|(_, m)| matches!(m, Message::Write(_))));
}

#[test]
fn a_node_endorsing_made_up_requests_fills_only_its_own_share() {
    let cfg = config_rq(1, 1);
    let share = cfg.options.clients_max / cfg.n();
    let mut b = node(&cfg, 1);
    let endorse_from_3 = |client: u64| {
        let req = Request::new(ClientId(client), 1, b"junk".to_vec().into());
        let s = endorse_statement(NodeId(3), &req.statement());
        let macs = endorse_keys(&secrets(3).signing, &config_rq(1, 1).membership).iter().map(|k| k.mac(&s)).collect();
        Message::Endorse { request: req, macs }
    };
    for c in 0..share as u64 {
        assert!(rejected(&step(&mut b, 10, Peer::Node(NodeId(3)), endorse_from_3(5_000 + c))).is_empty());
    }
    let out = step(&mut b, 10, Peer::Node(NodeId(3)), endorse_from_3(9_999));
    assert_eq!(rejected(&out), vec![Reject::Busy("endorsements held for this node")]);
    assert_eq!(b.hearsay.len(), share);
    assert!(b.pending.is_empty(), "one node's word admits nothing");
    // Bytes are bounded per endorser too: node 2's share of 64 MiB in 1 MiB requests.
    let big = |client: u64| {
        let req = Request::new(ClientId(client), 1, vec![0; crate::codec::OP_BYTES_MAX].into());
        let s = endorse_statement(NodeId(2), &req.statement());
        let macs = endorse_keys(&secrets(2).signing, &config_rq(1, 1).membership).iter().map(|k| k.mac(&s)).collect();
        Message::Endorse { request: req, macs }
    };
    let mut held = 0;
    for c in 0..64 {
        if rejected(&step(&mut b, 10, Peer::Node(NodeId(2)), big(20_000 + c))).is_empty() {
            held += 1;
        }
    }
    let fit = super::endorse::HEARSAY_BYTES_MAX / 4 / (crate::codec::OP_BYTES_MAX + 24);
    assert_eq!(held, fit, "node 2 fills its byte share and no more");
    assert_eq!(b.hearsay.len(), share + fit);
    // A bad MAC is refused outright, and the hearsay expires.
    let Message::Endorse { request, mut macs } = endorse_from_3(1) else { unreachable!() };
    macs[1][0] ^= 1;
    let out = step(&mut b, 10, Peer::Node(NodeId(2)), Message::Endorse { request, macs });
    assert_eq!(rejected(&out), vec![Reject::BadEndorsement { node: NodeId(2) }]);
    step_tick(&mut b, 10 + 5 * cfg.options.request_timeout_ms);
    assert_eq!(b.hearsay.len(), 0);
}

/// The reason for rq-mac: the same client under `auth = mac` splits the backups, stalls
/// everyone behind its batch and costs a view change.
#[test]
fn with_auth_mac_the_same_client_stalls_others_until_a_view_change() {
    let cfg = config(1, 1);
    let timeout = cfg.options.request_timeout_ms;
    let (mut net, mut good) = split_mac_client(&cfg);
    assert_eq!(net.result(&mut good), None, "stuck behind the batch nodes 2 and 3 refuse");
    for k in 1..=4 {
        net.tick(10 + k * timeout);
    }
    assert!(views_started(&net) > 0, "the primary is replaced over one client's MACs");
}

// ----- auth = sig -----

fn client_signing_key(id: u64) -> SigningKey {
    SigningKey::from_seed([id as u8; 32])
}

fn config_sig(u: u32, r: u32, clients: &[u64]) -> ClusterConfig {
    let keys = clients.iter().map(|&c| (ClientId(c), client_signing_key(c).public())).collect();
    config_rq(u, r).with_auth(Auth::Sig).with_client_keys(keys)
}

#[test]
fn with_auth_sig_every_node_checks_the_clients_signature_the_same_way() {
    let cfg = config_sig(1, 1, &[7, 8]);
    let mut net = Net::new(&cfg);
    let mut c = client(&cfg, 7).with_signing_key(client_signing_key(7));
    net.submit(&mut c, 10, b"x");
    assert_eq!(net.result(&mut c), Some(vec![1]));
    let proposal = net.nodes[1].log.values().find_map(|s| s.value.clone()).expect("accepted").0;
    assert!(proposal.requests[0].auth.is_empty() && proposal.requests[0].sig.is_some(), "signed, no MACs");

    // A signature by the wrong key, and none at all: refused by a node on admission...
    let mut forged = Request::new(ClientId(8), 1, b"y".to_vec().into());
    forged.sig = Some(client_signing_key(7).sign(&forged.statement()));
    let mut n0 = node(&cfg, 0);
    let out = step(&mut n0, 10, Peer::Client(ClientId(8)), Message::Request(forged.clone()));
    assert_eq!(rejected(&out), vec![Reject::BadMac { client: ClientId(8) }]);
    // ...and by a backup in a proposal, checked as one batch, unless the verify stage
    // vouched for it.
    let mut good = Request::new(ClientId(7), 1, b"z".to_vec().into());
    good.sig = Some(client_signing_key(7).sign(&good.statement()));
    let propose = |requests: Vec<Request>| Message::Propose {
        view: View(0),
        seq: Seq(1),
        value: Value { time: 10, requests }.into(),
    };
    let mut b = node(&cfg, 1);
    let out = step(&mut b, 10, Peer::Node(NodeId(0)), propose(vec![good.clone(), forged.clone()]));
    assert_eq!(rejected(&out), vec![Reject::BadBatch("a request without a valid client signature")]);
    let verifier = b.verifier();
    assert!(!verifier.check(NodeId(0), &propose(vec![good.clone(), forged])));
    assert!(verifier.check(NodeId(0), &propose(vec![good.clone()])));
    let mut out = Outputs::default();
    b.step(10, Input::Checked { from: NodeId(0), msg: propose(vec![good]) }, &mut out);
    assert!(rejected(&out).is_empty());
    assert!(out.send_after_persist.iter().any(|(_, m)| matches!(m, Message::Write(_))), "the backup votes");
}

#[test]
fn with_auth_sig_a_burst_of_requests_is_checked_as_one_batch_and_only_bad_ones_are_refused() {
    let clients: Vec<u64> = (10..20).collect();
    let cfg = config_sig(1, 1, &clients);
    let signed = |c: u64, key: u64| {
        let mut r = Request::new(ClientId(c), 1, vec![c as u8].into());
        r.sig = Some(client_signing_key(key).sign(&r.statement()));
        r
    };
    let burst = |p: &mut Replica<Log>, requests: Vec<Request>| {
        let mut out = Outputs::default();
        p.hold_proposals();
        for r in requests {
            p.step(10, Input::Message { from: Peer::Client(r.client), msg: Message::Request(r) }, &mut out);
        }
        assert_eq!(p.unsigned.len(), 10, "held for one check at the end of the burst");
        assert!(p.pending.is_empty());
        p.release_proposals(10, &mut out);
        out
    };
    let mut p = node(&cfg, 0);
    let out = burst(&mut p, clients.iter().map(|&c| signed(c, c)).collect());
    assert!(rejected(&out).is_empty());
    assert_eq!(p.pending.len(), 10);
    // One signed by another client's key: the batch fails, and only that one is refused.
    let mut p = node(&cfg, 0);
    let out = burst(&mut p, clients.iter().map(|&c| signed(c, if c == 13 { 14 } else { c })).collect());
    assert_eq!(rejected(&out), vec![Reject::BadMac { client: ClientId(13) }]);
    assert_eq!(p.pending.len(), 9);
    assert!(!p.pending.contains_key(&ClientId(13)));
    // Outside a burst, a request is checked at the end of its own step.
    let mut p = node(&cfg, 0);
    let out = step(&mut p, 10, Peer::Client(ClientId(10)), Message::Request(signed(10, 10)));
    assert!(rejected(&out).is_empty() && p.unsigned.is_empty());
    assert!(out.send.iter().any(|(_, m)| matches!(m, Message::Propose { .. })), "proposed in the same step");
}

/// A network whose node 3 fetches state at `rate` bytes per second and holds a state
/// unlike everyone's, so it must fetch the whole state at the first stable checkpoint.
fn throttled_divergent_node_3(cfg: &ClusterConfig, rate: u64) -> Net {
    let throttled =
        ClusterConfig { options: Options { transfer_rate_bytes: rate, ..cfg.options.clone() }, ..cfg.clone() };
    let mut net = Net::new(cfg);
    net.nodes[3] = Replica::new(throttled, NodeId(3), secrets(3), Log::default());
    net.nodes[3].exec.restore(&Executor::new(Log(vec![b"garbage".to_vec()])).snapshot()).expect("restore");
    net
}

#[test]
fn a_throttled_state_transfer_asks_for_no_more_than_its_rate_allows() {
    let cfg = config(1, 1);
    let rate = 640; // bytes per second: two and a half average (256-byte) chunks
    let mut net = throttled_divergent_node_3(&cfg, rate);
    let mut c = client(&cfg, 7);
    let mut now = 0;
    for i in 0..cfg.options.checkpoint_interval {
        now += 10;
        net.submit(&mut c, now, &[i as u8; 200]);
        assert!(net.result(&mut c).is_some());
    }
    let started = now;
    let mut seen_started = false;
    while now < started + 60_000
        && !net.events.iter().any(|(n, e)| *n == NodeId(3) && matches!(e, Event::StateTransferDone { .. }))
    {
        now += 5;
        net.tick(now);
        if let Some((have, total)) = net.nodes[3].transfer_progress() {
            seen_started = true;
            let chunk = cfg.options.chunk_bytes as u64;
            // What the rate allows since the start, plus one window saved up.
            let allowed = rate * (now - started) / 1000 / chunk + 16;
            assert!(have as u64 <= allowed, "{have} of {total} chunks after {} ms", now - started);
        }
    }
    assert!(seen_started, "node 3 transferred state");
    let took = now - started;
    assert!(
        net.events.iter().any(|(n, e)| *n == NodeId(3) && matches!(e, Event::StateTransferDone { .. })),
        "finished"
    );
    assert_eq!(net.nodes[3].service().0, net.nodes[0].service().0);
    let bytes = net.nodes[0].exec.snapshot().len() as u64;
    assert!(took >= (bytes.saturating_sub(16 * 64)) * 1000 / rate, "{bytes} bytes in {took} ms at {rate} B/s");
}

/// How node `n`'s finished state transfers went: (seq, chunks, reused) each.
fn transfers_done(net: &Net, n: NodeId) -> Vec<(Seq, usize, usize)> {
    net.events
        .iter()
        .filter_map(|(m, e)| match e {
            Event::StateTransferDone { seq, chunks, reused } if *m == n => Some((*seq, *chunks, *reused)),
            _ => None,
        })
        .collect()
}

#[test]
fn a_transfer_restarted_on_a_newer_checkpoint_keeps_the_chunks_it_fetched() {
    // A throttled transfer outlasts a checkpoint interval; peers serve only their newest
    // stable checkpoint, so it restarts there. It must not start from zero: the state
    // it was fetching is mostly still there, and chunks are content-defined.
    let cfg = config(1, 1);
    let rate = 2_560; // bytes per second: ten average chunks
    let mut net = throttled_divergent_node_3(&cfg, rate);
    let mut c = client(&cfg, 7);
    let interval = cfg.options.checkpoint_interval;
    let mut now = 0;
    let mut x = 1u64;
    let entry = |x: &mut u64| -> Vec<u8> {
        (0..2_000)
            .map(|_| {
                *x ^= *x << 13;
                *x ^= *x >> 7;
                *x ^= *x << 17;
                *x as u8
            })
            .collect()
    };
    // Two intervals of 2 KB entries: about 32 KB, some 120 chunks, a dozen seconds at
    // the rate. Then one more interval while node 3 fetches.
    for _ in 0..2 * interval {
        now += 10;
        net.submit(&mut c, now, &entry(&mut x));
        assert!(net.result(&mut c).is_some());
    }
    while net.nodes[3].transfer_progress().is_none_or(|(have, _)| have < 20) && now < 60_000 {
        now += 5;
        net.tick(now);
    }
    for _ in 0..interval {
        now += 10;
        net.submit(&mut c, now, &entry(&mut x));
        assert!(net.result(&mut c).is_some());
    }
    let deadline = now + 120_000;
    while transfers_done(&net, NodeId(3)).is_empty() && now < deadline {
        now += 5;
        net.tick(now);
    }
    let started: Vec<Seq> = net
        .events
        .iter()
        .filter_map(|(n, e)| match e {
            Event::StateTransferStarted { seq, .. } if *n == NodeId(3) => Some(*seq),
            _ => None,
        })
        .collect();
    assert!(started.len() >= 2, "the transfer restarted on the newer checkpoint: {started:?}");
    let done = transfers_done(&net, NodeId(3));
    let &[(seq, chunks, reused)] = done.as_slice() else { panic!("one transfer finished: {done:?}") };
    assert_eq!(seq, Seq(3 * interval));
    assert!(reused >= 20, "{reused} of {chunks} chunks reused");
    assert_eq!(net.nodes[3].service().0, net.nodes[0].service().0);
}

#[test]
fn a_node_that_fell_behind_fetches_only_the_chunks_its_own_snapshot_lacks() {
    let cfg = config(1, 1);
    let mut net = Net::new(&cfg);
    let mut c = client(&cfg, 7);
    let interval = cfg.options.checkpoint_interval;
    let mut now = 0;
    let mut submit = |net: &mut Net, now: &mut u64, i: u64| {
        *now += 10;
        let body: Vec<u8> = (0..1_000u64).map(|j| (j * 7 + i * 13) as u8 ^ (j >> 3) as u8).collect();
        net.submit(&mut c, *now, &body);
        assert!(net.result(&mut c).is_some());
    };
    for i in 0..2 * interval {
        submit(&mut net, &mut now, i);
    }
    for _ in 0..100 {
        now += 5;
        net.tick(now);
    }
    assert_eq!(net.nodes[3].stable_seq(), Seq(2 * interval), "node 3 holds the second checkpoint");
    net.down.insert(NodeId(3));
    for i in 2 * interval..4 * interval {
        submit(&mut net, &mut now, i);
    }
    net.down.remove(&NodeId(3));
    for _ in 0..400 {
        now += 5;
        net.tick(now);
    }
    let done = transfers_done(&net, NodeId(3));
    let Some(&(seq, chunks, reused)) = done.last() else { panic!("node 3 transferred state") };
    assert_eq!(seq, Seq(4 * interval));
    // Half the entries are new: the other half of the chunks come from its own snapshot.
    assert!(reused * 3 >= chunks, "{reused} of {chunks} chunks reused");
    assert!(reused < chunks, "{reused} of {chunks}: the new entries were fetched");
    assert_eq!(net.nodes[3].service().0, net.nodes[0].service().0);
}

fn background(cfg: &ClusterConfig) -> ClusterConfig {
    let mut cfg = cfg.clone();
    cfg.options.background_checkpoints = true;
    cfg
}

/// Runs `ops` one at a time (each answered) and ticks until checkpoints settle.
fn run_ops(net: &mut Net, c: &mut Client, now: &mut u64, ops: std::ops::Range<u64>) {
    for i in ops {
        *now += 10;
        net.submit(c, *now, &i.to_le_bytes());
        assert!(net.result(c).is_some(), "request {i}");
    }
    for _ in 0..50 {
        *now += 5;
        net.tick(*now);
    }
}

#[test]
fn background_checkpoints_record_the_state_frozen_at_their_instance() {
    // Node 3's serializations are held back while the cluster executes past the
    // checkpoint; the root it finally votes for must be that of the state at the
    // checkpoint instance, as computed inline by a cluster that never froze.
    let inline = config(1, 1);
    let cfg = background(&inline);
    let interval = cfg.options.checkpoint_interval;
    let (mut a, mut b) = (Net::new(&inline), Net::new(&cfg));
    let (mut ca, mut cb) = (client(&inline, 7), client(&cfg, 7));
    let (mut ta, mut tb) = (0, 0);
    b.jobs_held.insert(NodeId(3));
    run_ops(&mut a, &mut ca, &mut ta, 0..interval + 3);
    run_ops(&mut b, &mut cb, &mut tb, 0..interval + 3);
    assert_eq!(b.nodes[3].executed(), Seq(interval + 3), "node 3 executed past the checkpoint");
    assert_eq!(b.nodes[3].pending_checkpoints.len(), 1, "its checkpoint is still being serialized");
    // The others' votes made the checkpoint stable meanwhile; node 3 adopted it without
    // starting a transfer (it holds the state, only its snapshot is not done).
    assert_eq!(b.nodes[3].stable_seq(), Seq(interval));
    assert!(b.nodes[3].stable_chunks.is_none());
    b.jobs_held.remove(&NodeId(3));
    b.tick(tb + 5);
    let root = |net: &Net, node: NodeId| {
        net.events.iter().find_map(|(n, e)| match e {
            Event::Checkpoint { seq, root } if *n == node && *seq == Seq(interval) => Some(*root),
            _ => None,
        })
    };
    let expected = root(&a, NodeId(3)).expect("inline checkpoint");
    for node in 0..4 {
        assert_eq!(root(&b, NodeId(node)), Some(expected), "node {node}");
    }
    assert!(b.nodes[3].pending_checkpoints.is_empty());
    assert_eq!(b.nodes[3].stable_chunks.as_ref().map(|c| c.root), Some(expected), "compared and kept");
    assert!(!b.events.iter().any(|(_, e)| matches!(e, Event::StateTransferStarted { .. } | Event::Divergence { .. })));
}

#[test]
fn a_background_checkpoint_of_a_replaced_state_is_dropped() {
    // Node 3's state is corrupt. Its checkpoints at I and 2I are held back, and so is
    // node 0's at 2I, so only I becomes stable. Node 3's checkpoint at I then reveals the
    // divergence; it transfers the state at I and re-executes to 2I, freezing 2I again.
    // Its first checkpoint at 2I, of the corrupt state, comes back after the transfer: it
    // must be dropped, not voted for.
    let cfg = background(&config(1, 1));
    let interval = cfg.options.checkpoint_interval;
    let mut net = Net::new(&cfg);
    let mut c = client(&cfg, 7);
    net.nodes[3].exec.restore(&Executor::new(Log(vec![b"garbage".to_vec()])).snapshot()).expect("restore");
    net.jobs_held.insert(NodeId(0));
    net.jobs_held.insert(NodeId(3));
    let mut now = 0;
    run_ops(&mut net, &mut c, &mut now, 0..2 * interval);
    net.release(NodeId(0), Seq(interval), now);
    assert_eq!(net.nodes[3].stable_seq(), Seq(interval));
    net.release(NodeId(3), Seq(interval), now);
    for _ in 0..100 {
        now += 5;
        net.tick(now);
    }
    assert!(net.events.iter().any(|(n, e)| *n == NodeId(3) && matches!(e, Event::StateTransferDone { .. })));
    let stale = net.jobs.iter().filter(|(n, j)| *n == NodeId(3) && j.seq() == Seq(2 * interval)).count();
    assert_eq!(stale, 2, "the checkpoint at 2I of the corrupt state and of the repaired one");
    net.release(NodeId(3), Seq(2 * interval), now);
    net.release(NodeId(3), Seq(2 * interval), now);
    net.release(NodeId(0), Seq(2 * interval), now);
    let roots = |node: NodeId| -> Vec<Digest> {
        net.events
            .iter()
            .filter_map(|(n, e)| match e {
                Event::Checkpoint { seq, root } if *n == node && *seq == Seq(2 * interval) => Some(*root),
                _ => None,
            })
            .collect()
    };
    let good = roots(NodeId(1));
    assert_eq!(good.len(), 1);
    assert_eq!(roots(NodeId(3)), good, "node 3 voted only for the repaired state's checkpoint");
    assert_eq!(net.nodes[3].stable_seq(), Seq(2 * interval));
    assert_eq!(net.nodes[3].service().0, net.nodes[0].service().0);
}

/// Node `i`'s valid endorsement of `req` (`auth = rq-mac`).
fn endorsement_of(cfg: &ClusterConfig, i: u32, req: &Request) -> Endorsement {
    let s = endorse_statement(NodeId(i), &req.statement());
    Endorsement {
        node: NodeId(i),
        macs: endorse_keys(&secrets(i).signing, &cfg.membership).iter().map(|k| k.mac(&s)).collect(),
    }
}

/// A FETCH-BODIES sent: to whom, for which instance, and what.
type Fetch = (Peer, Seq, Vec<(ClientId, Digest)>);

fn fetches(out: &Outputs) -> Vec<Fetch> {
    out.send
        .iter()
        .filter_map(|(to, m)| match m {
            Message::FetchBodies { seq, wanted } => Some((*to, *seq, wanted.clone())),
            _ => None,
        })
        .collect()
}

fn writes_sent(out: &Outputs) -> usize {
    out.send_after_persist.iter().filter(|(_, m)| matches!(m, Message::Write(_))).count()
}

#[test]
fn operations_by_digest_are_fetched_from_an_endorser_and_checked_before_the_vote() {
    let cfg = config_rq(1, 1);
    assert!(cfg.request_digests, "on by default with rq-mac");
    let big = request(&cfg, 7, &[7; 200]);
    let small = request(&cfg, 8, b"tiny");
    // Nodes 0 (the primary) and 2 got both requests from their clients; node 3 none.
    let endorsed = |r: &Request| Request {
        auth: Vec::new(),
        endorsements: vec![endorsement_of(&cfg, 0, r), endorsement_of(&cfg, 2, r)],
        ..r.clone()
    };
    let value = Value { time: 10, requests: vec![endorsed(&big), endorsed(&small)] };
    let proposal = Proposal::with_digests(&value);
    assert!(matches!(proposal.requests[0], Proposed::Digest(_)) && matches!(proposal.requests[1], Proposed::Full(_)));
    let propose = Message::Propose { view: View(0), seq: Seq(1), value: proposal.clone() };

    let mut holder = node(&cfg, 2);
    step(&mut holder, 10, Peer::Client(ClientId(7)), Message::Request(big.clone()));
    let out = step(&mut holder, 10, Peer::Node(NodeId(0)), propose.clone());
    assert!(rejected(&out).is_empty() && fetches(&out).is_empty());
    assert_eq!(writes_sent(&out), 3, "the holder votes at once");

    let mut lacking = node(&cfg, 3);
    let out = step(&mut lacking, 10, Peer::Node(NodeId(0)), propose.clone());
    assert_eq!(writes_sent(&out), 0, "no vote without every byte");
    let wanted = vec![(ClientId(7), big.op.digest())];
    assert_eq!(
        fetches(&out),
        vec![(Peer::Node(NodeId(2)), Seq(1), wanted.clone())],
        "an endorser other than the primary"
    );
    // The PROPOSE again (a retransmission) is no equivocation, and asks nothing new.
    let out = step(&mut lacking, 11, Peer::Node(NodeId(0)), propose.clone());
    assert!(rejected(&out).is_empty() && fetches(&out).is_empty());

    // The endorser answers once per retry period.
    let fetch = Message::FetchBodies { seq: Seq(1), wanted: wanted.clone() };
    let out = step(&mut holder, 12, Peer::Node(NodeId(3)), fetch.clone());
    let answer = out.send.iter().find(|(to, m)| *to == Peer::Node(NodeId(3)) && matches!(m, Message::Bodies { .. }));
    assert_eq!(answer.map(|(_, m)| m.clone()), Some(Message::Bodies { seq: Seq(1), ops: vec![big.op.clone()] }));
    let out = step(&mut holder, 13, Peer::Node(NodeId(3)), fetch);
    assert_eq!(rejected(&out), vec![Reject::Busy("operations fetched again within a retry period")]);
    // One peer pulls at most four batches' worth per retry period, however it asks.
    let op_max = vec![5u8; crate::codec::OP_BYTES_MAX];
    let mut hoard = node(&cfg, 2);
    let huge = request(&cfg, 9, &op_max);
    step(&mut hoard, 20, Peer::Client(ClientId(9)), Message::Request(huge.clone()));
    let mut pulled = 0;
    for seq in 1..=20 {
        let ask = Message::FetchBodies { seq: Seq(seq), wanted: vec![(ClientId(9), huge.op.digest())] };
        pulled += step(&mut hoard, 21, Peer::Node(NodeId(1)), ask)
            .send
            .iter()
            .filter(|(_, m)| matches!(m, Message::Bodies { .. }))
            .count();
    }
    let batch = cfg.options.batch_bytes_max + crate::codec::OP_BYTES_MAX;
    assert!(pulled > 0 && pulled * op_max.len() <= 4 * batch, "{pulled} answers of 1 MiB");

    // Altered bytes from the node asked do not pass for the operation: refused, and the
    // next node (the primary, here) is asked at once. From a node not asked they are
    // ignored (it may answer an older question about the instance).
    let forged = Message::Bodies { seq: Seq(1), ops: vec![vec![6; 200].into()] };
    let out = step(&mut lacking, 14, Peer::Node(NodeId(2)), forged.clone());
    assert_eq!(rejected(&out), vec![Reject::BadProof("an operation that matches no digest of the proposal")]);
    assert_eq!(writes_sent(&out), 0);
    assert_eq!(fetches(&out), vec![(Peer::Node(NodeId(0)), Seq(1), wanted.clone())]);
    let out = step(&mut lacking, 15, Peer::Node(NodeId(1)), forged);
    assert!(rejected(&out).is_empty() && fetches(&out).is_empty() && writes_sent(&out) == 0);
    // Unanswered: the next node after a retry period, doubled for a second retry.
    let retry = cfg.options.retransmit_ms / 5;
    assert!(fetches(&step_tick(&mut lacking, 14 + retry)).is_empty());
    let out = step_tick(&mut lacking, 14 + 2 * retry);
    assert_eq!(fetches(&out), vec![(Peer::Node(NodeId(1)), Seq(1), wanted)]);
    let out = step(
        &mut lacking,
        14 + 2 * retry,
        Peer::Node(NodeId(0)),
        Message::Bodies { seq: Seq(1), ops: vec![big.op.clone()] },
    );
    assert!(rejected(&out).is_empty());
    assert_eq!(writes_sent(&out), 3);
    let accepted = lacking.log.get(&Seq(1)).and_then(|s| s.value.clone()).map(|(v, d)| (v.requests[0].op.clone(), d));
    assert_eq!(accepted, Some((big.op.clone(), value.digest())));
}

#[test]
fn a_client_copy_that_arrives_after_the_propose_completes_it() {
    let cfg = config_rq(1, 1);
    let big = request(&cfg, 7, &[7; 100]);
    let endorsed = Request {
        auth: Vec::new(),
        endorsements: vec![endorsement_of(&cfg, 0, &big), endorsement_of(&cfg, 1, &big)],
        ..big.clone()
    };
    let proposal = Proposal::with_digests(&Value { time: 10, requests: vec![endorsed] });
    let mut b = node(&cfg, 2);
    let out = step(&mut b, 10, Peer::Node(NodeId(0)), Message::Propose { view: View(0), seq: Seq(1), value: proposal });
    assert_eq!(writes_sent(&out), 0);
    let out = step(&mut b, 11, Peer::Client(ClientId(7)), Message::Request(big));
    assert!(rejected(&out).is_empty());
    assert_eq!(writes_sent(&out), 3, "voted once the client's own copy came");
}

#[test]
fn operations_by_digest_need_rq_mac_and_an_endorser() {
    let req = request(&config(1, 1), 7, &[7; 100]);
    let proposal = Proposal::with_digests(&Value { time: 10, requests: vec![req.clone()] });
    let mut b = node(&config(1, 1), 1);
    let out = step(&mut b, 10, Peer::Node(NodeId(0)), Message::Propose { view: View(0), seq: Seq(1), value: proposal });
    assert_eq!(rejected(&out), vec![Reject::BadBatch("an operation by digest without auth = rq-mac")]);
    assert!(config(1, 1).with_request_digests(true).is_err(), "refused by the configuration too");
}

#[test]
fn with_digests_the_primary_sends_large_operations_to_no_one_and_every_node_executes_them() {
    let op = vec![9u8; 1000];
    let run = |digests: bool| {
        let cfg = config_rq(1, 1).with_request_digests(digests).expect("rq-mac");
        let mut net = Net::new(&cfg);
        let mut c = client(&cfg, 7);
        net.submit(&mut c, 10, &op);
        assert_eq!(net.result(&mut c), Some(vec![1]));
        assert!(net.nodes.iter().all(|n| n.service().0 == vec![op.clone()]), "every node executed the operation");
        let sent = |n: NodeId, kind| net.sent_bytes.get(&(n, kind)).copied().unwrap_or(0);
        let fetched: usize = (0..4).map(|n| sent(NodeId(n), "fetch-bodies")).sum();
        (sent(NodeId(0), "propose"), fetched)
    };
    let (with, fetched_with) = run(true);
    let (without, fetched_without) = run(false);
    // Three backups: the whole operation three times, or a digest three times.
    assert!(without > 3 * op.len() && 4 * with < without, "PROPOSE bytes: {without} in full, {with} by digest");
    // Only the node the client did not send to fetched (u + r + 1 = 3 got it).
    assert!(fetched_with > 0 && fetched_without == 0);
}

#[test]
fn endorsements_without_the_bytes_count_once_the_primary_holds_the_request() {
    let cfg = config_rq(1, 1);
    let big = request(&cfg, 7, &[7; 200]);
    // A backup that got the request endorses it to the primary without its bytes.
    let mut b = node(&cfg, 2);
    let out = step(&mut b, 10, Peer::Client(ClientId(7)), Message::Request(big.clone()));
    let to_primary: Vec<&Message> =
        out.send.iter().filter(|(to, _)| *to == Peer::Node(NodeId(0))).map(|(_, m)| m).collect();
    assert!(matches!(to_primary[..], [Message::EndorseDigest { client: ClientId(7), .. }]), "{to_primary:?}");
    let small = request(&cfg, 8, b"tiny");
    let out = step(&mut b, 10, Peer::Client(ClientId(8)), Message::Request(small));
    assert!(out.send.iter().any(|(to, m)| *to == Peer::Node(NodeId(0)) && matches!(m, Message::Endorse { .. })));

    // The primary hears two such endorsements before the client's own copy arrives.
    let endorse = |i: u32| {
        let e = endorsement_of(&cfg, i, &big);
        Message::EndorseDigest { client: ClientId(7), seq: big.seq, op: big.op.digest(), macs: e.macs }
    };
    let mut p = node(&cfg, 0);
    let mut forged = endorse(3);
    if let Message::EndorseDigest { macs, .. } = &mut forged {
        macs[0] = [0; 16];
    }
    assert_eq!(
        rejected(&step(&mut p, 10, Peer::Node(NodeId(3)), forged)),
        vec![Reject::BadEndorsement { node: NodeId(3) }]
    );
    for i in [1, 2] {
        let out = step(&mut p, 10, Peer::Node(NodeId(i)), endorse(i));
        assert!(rejected(&out).is_empty() && !out.send.iter().any(|(_, m)| matches!(m, Message::Propose { .. })));
    }
    // With its own, u + r + 1 = 3 endorsements: it proposes at once, by digest.
    let out = step(&mut p, 11, Peer::Client(ClientId(7)), Message::Request(big.clone()));
    let proposed = out.send.iter().find_map(|(_, m)| match m {
        Message::Propose { value, .. } => Some(value.clone()),
        _ => None,
    });
    let proposed = proposed.expect("proposed on the endorsements heard before the request");
    assert!(matches!(&proposed.requests[..], [Proposed::Digest(d)] if d.endorsements.len() == 3));
}

#[test]
fn a_node_that_heard_of_a_request_first_cannot_make_its_bytes_be_refused() {
    let cfg = config_rq(1, 1);
    let mut b = node(&cfg, 1);
    let endorse_from = |i: u32, req: &Request| {
        let macs = endorsement_of(&cfg, i, req).macs;
        Message::Endorse { request: req.clone(), macs }
    };
    // Node 3 fills its byte share of hearsay with 1 MiB requests of made-up clients...
    for c in 0..64 {
        let junk = Request::new(ClientId(30_000 + c), 1, vec![0; crate::codec::OP_BYTES_MAX].into());
        let _ = step(&mut b, 10, Peer::Node(NodeId(3)), endorse_from(3, &junk));
    }
    let full = Request::new(ClientId(40_000), 1, vec![0; crate::codec::OP_BYTES_MAX].into());
    assert_eq!(
        rejected(&step(&mut b, 10, Peer::Node(NodeId(3)), endorse_from(3, &full))),
        vec![Reject::Busy("endorsements held for this node")]
    );
    // ...then is the first to mention a real request, without its bytes (this node cannot
    // check the client's MAC: the request is not addressed to it).
    let real = request_valid_at(&cfg, 7, 1, &[7; 300], &[0, 2, 3]);
    let digest_only = Message::EndorseDigest {
        client: ClientId(7),
        seq: 1,
        op: real.op.digest(),
        macs: endorsement_of(&cfg, 3, &real).macs,
    };
    assert!(rejected(&step(&mut b, 11, Peer::Node(NodeId(3)), digest_only)).is_empty());
    assert!(b.hearsay.body(ClientId(7), &real.op.digest()).is_none());
    // Node 2's endorsement brings the bytes: charged to node 2, so they are kept, and with
    // r + 1 = 2 endorsers this node endorses the request too.
    let out = step(&mut b, 12, Peer::Node(NodeId(2)), endorse_from(2, &real));
    assert!(rejected(&out).is_empty(), "{:?}", rejected(&out));
    assert!(b.pending.get(&ClientId(7)).is_some_and(|p| p.req.op == real.op), "admitted on two endorsements");
}

/// (peer, message kind) → count of the agreement messages in `out`.
fn votes_sent(out: &Outputs) -> BTreeMap<(NodeId, &'static str), usize> {
    let mut sent = BTreeMap::new();
    for (to, msg) in out.send.iter().chain(&out.send_after_persist) {
        if let (Peer::Node(n), Message::Propose { .. } | Message::Write(_) | Message::Accept { .. }) = (to, msg) {
            *sent.entry((*n, msg.kind())).or_default() += 1;
        }
    }
    sent
}

/// A u = r = 1 network whose nodes 0-2 decided and executed three requests (at times
/// 1-3) while node 3 was down.
fn three_decided_with_node_3_down(cfg: &ClusterConfig) -> Net {
    let mut net = Net::new(cfg);
    net.down.insert(NodeId(3));
    let mut c = client(cfg, 7);
    for i in 1..=3u8 {
        net.submit(&mut c, i as u64, &[i]);
        assert_eq!(net.result(&mut c), Some(vec![i]), "request {i}");
    }
    net
}

#[test]
fn retransmissions_go_only_to_peers_that_may_still_need_them() {
    // With node 3 down no instance ever has n accepts, so every one of them is resent
    // each period; the live nodes must not be made to take them all again.
    let cfg = config(1, 1);
    let mut net = three_decided_with_node_3_down(&cfg);
    let executed = net.nodes[0].executed();
    let period = cfg.options.retransmit_ms;
    // No STATUS heard yet: nodes 1 and 2 accepted every value, so they get our ACCEPTs
    // only; node 3 gets the proposals and our WRITEs too.
    let sent = votes_sent(&step_tick(&mut net.nodes[0], 10 + period));
    let to = |n: NodeId, kind: &'static str| sent.get(&(n, kind)).copied().unwrap_or(0);
    let slots = to(NodeId(3), "propose");
    assert!(slots > 0, "{sent:?}");
    assert_eq!((to(NodeId(3), "write"), to(NodeId(3), "accept")), (slots, slots), "{sent:?}");
    for n in [1, 2] {
        assert_eq!(
            (to(NodeId(n), "propose"), to(NodeId(n), "write"), to(NodeId(n), "accept")),
            (0, 0, slots),
            "node {n}: {sent:?}"
        );
    }
    // Once nodes 1 and 2 report executing them, nothing for those instances goes to them.
    for n in [1, 2] {
        let status = Message::Status { view: View(0), executed, stable: Seq(0) };
        step(&mut net.nodes[0], 20 + period, Peer::Node(NodeId(n)), status);
    }
    let sent = votes_sent(&step_tick(&mut net.nodes[0], 20 + 2 * period));
    let to = |n: NodeId, kind: &'static str| sent.get(&(n, kind)).copied().unwrap_or(0);
    assert_eq!(
        (to(NodeId(3), "propose"), to(NodeId(3), "write"), to(NodeId(3), "accept")),
        (slots, slots, slots),
        "{sent:?}"
    );
    assert!(sent.keys().all(|(n, _)| *n == NodeId(3)), "{sent:?}");
    // A peer that reports less (it restarted) is served again.
    step(
        &mut net.nodes[0],
        30 + 2 * period,
        Peer::Node(NodeId(1)),
        Message::Status { view: View(0), executed: Seq(0), stable: Seq(0) },
    );
    let sent = votes_sent(&step_tick(&mut net.nodes[0], 30 + 3 * period));
    assert_eq!(sent.get(&(NodeId(1), "accept")).copied(), Some(slots), "{sent:?}");
}

#[test]
fn retransmissions_to_a_silent_peer_pause_until_it_speaks_again() {
    let cfg = config(1, 1);
    let mut net = three_decided_with_node_3_down(&cfg);
    // Node 3 was heard once (since gone down).
    step(
        &mut net.nodes[0],
        4,
        Peer::Node(NodeId(3)),
        Message::Status { view: View(0), executed: Seq(0), stable: Seq(0) },
    );
    let (period, status) = (cfg.options.retransmit_ms, cfg.options.status_ms);
    // Within a few STATUS periods of its last word it still gets everything.
    let soon = 10 + period.max(status);
    let sent = votes_sent(&step_tick(&mut net.nodes[0], soon));
    let slots = sent.get(&(NodeId(3), "propose")).copied().unwrap_or(0);
    assert!(slots > 0, "{sent:?}");
    // Silent for longer than SILENT_STATUS_PERIODS: nothing.
    let late = soon + 5 * status + period;
    let sent = votes_sent(&step_tick(&mut net.nodes[0], late));
    assert!(sent.keys().all(|(n, _)| *n != NodeId(3)), "{sent:?}");
    // It speaks again: served at the next period.
    step(
        &mut net.nodes[0],
        late + 1,
        Peer::Node(NodeId(3)),
        Message::Status { view: View(0), executed: Seq(0), stable: Seq(0) },
    );
    let sent = votes_sent(&step_tick(&mut net.nodes[0], late + 1 + period));
    assert_eq!(sent.get(&(NodeId(3), "propose")).copied(), Some(slots), "{sent:?}");
}
