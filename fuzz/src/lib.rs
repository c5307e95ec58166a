//! Shared harness of the Keel fuzz targets and of the seed-corpus generator.
//!
//! The `replica_input` target drives node 0 of a real u = 1, r = 1 cluster (N = 4, Q = 3,
//! test_min options, the KV service) with whatever its peers send. An input is a sequence
//! of records:
//!
//! ```text
//! record   := selector:u8  delta:u8  len:u16 (LE)  frame[len]   (the last one may be cut short)
//! selector := bits 0-1  sender: 0 = a client, 1..=3 = Peer::Node(1..=3)
//!             bit  2    FIX:  make authenticators valid (see below)
//!             bit  3    ECHO: `frame[0]` picks a message node 0 sent earlier (most recent
//!                             first); it is delivered back as if `sender` had sent it,
//!                             re-signed by `sender` where it carries the sender's signature
//!             bits 4-7  client id for a client sender (0: the `client` of a Request)
//! delta    := time advance before the record: d < 128: d ms, else (d - 127) * 64 ms;
//!             a non-zero delta also delivers Input::Tick
//! frame    := a wire frame (`codec::decode`); frames that do not decode are dropped
//!             exactly as the transport would drop them
//! ```
//!
//! Plain frames exercise the replica exactly as a network peer can. Without help,
//! though, a fuzzer cannot produce Ed25519 signatures, client MACs or BLAKE3 digests, so
//! it would never get past the first signature check. The harness holds every node's
//! secrets, so two opt-in helpers let it reach deep states:
//!
//! - ECHO replays node 0's own votes as a peer's (a WRITE, ACCEPT, checkpoint vote or
//!   VIEW-CHANGE re-signed by the sender): peers that agree with node 0, which is how
//!   instances decide, checkpoints become stable and views change.
//! - FIX sets every client MAC to a valid one (clients are untrusted, any of them may
//!   send anything), moves a PROPOSE's time near the clock, re-signs every signature
//!   attributed to nodes 1..=3 (never node 0's: node 0 is the correct node under test),
//!   replaces a digest whose bytes 1..32 are zero by one node 0 has emitted (byte 0 picks
//!   which; 0xff picks the root of a synthetic checkpoint for the message's `seq`), and
//!   fills MANIFEST/CHUNK for a synthetic checkpoint (the state of a cluster that
//!   executed only null values), so state transfer can complete.
//!
//! FIX can make all three peers sign anything, more than the r = 1 Byzantine nodes the
//! configuration tolerates. The replica must still never panic on such input (its
//! assertions are about its own state), but a crash that needs two or more forged
//! signers is triaged as outside the fault model.
//!
//! Besides "no panic", every step checks that each message node 0 emits passes the wire
//! codec (peers would otherwise drop it) and that each WAL record it persists reads back.

use keel_core::codec;
use keel_core::config::{ClusterConfig, Options};
use keel_core::crypto::{Digest, Sig, SigningKey};
use keel_core::exec::{Chunked, Executor};
use keel_core::ids::{MemberIndex, View};
use keel_core::message::{
    checkpoint_statement, write_statement, ClientId, Message, NodeId, Proposed, Request, Seq, StableProof, Value,
    ViewChange,
};
use keel_core::quorum::Quorums;
use keel_core::replica::{client_mac_key, Event, Input, NodeSecrets, Outputs, Peer, Persist, Replica};
use keel_core::wal;
use keel_kv::Kv;
use std::collections::BTreeMap;

/// Order nodes of the u = 1, r = 1 cluster.
pub const N: usize = 4;
/// The node under test.
pub const ME: NodeId = NodeId(0);

pub const SENDER_MASK: u8 = 0b0000_0011;
pub const FIX: u8 = 0b0000_0100;
pub const ECHO: u8 = 0b0000_1000;

/// Messages node 0 sent that ECHO can pick from.

/// The fuzzed cluster is epoch 0, whose members' stable ids are their indices: the
/// index a stable id `node` has there.
fn as_index(node: NodeId) -> MemberIndex {
    MemberIndex(node.0)
}

/// The stable id of the member at index `i` of the fuzzed cluster ([`as_index`]).
fn as_id(i: MemberIndex) -> NodeId {
    NodeId(i.0)
}
const HISTORY: usize = 64;
/// Digests node 0 emitted that FIX can substitute.
const DIGESTS: usize = 64;
/// Synthetic checkpoints are built for instances up to here (cost bound).
const SYNTHETIC_SEQ_MAX: Seq = Seq(1024);
/// The digest byte that selects the synthetic checkpoint root.
pub const SYNTHETIC_ROOT: u8 = 0xff;

/// The deterministic secrets of the four nodes.
pub fn secrets() -> Vec<NodeSecrets> {
    (0..N as u8).map(|i| NodeSecrets::new(SigningKey::from_seed([0xa0 + i; 32]), [0xc0 + i; 32])).collect()
}

/// The cluster configuration, built the way the simulator builds it.
pub fn config(secrets: &[NodeSecrets]) -> ClusterConfig {
    let quorums = Quorums::new(1, 1).expect("valid (u, r)");
    let keys = secrets.iter().map(|s| s.signing.public()).collect();
    // auth = mac: the harness authenticates the requests it proposes with the target
    // node's client MAC entry (rq-mac endorsements are the simulator's to exercise).
    ClusterConfig::new(quorums, keys, Options::test_min())
        .expect("valid config")
        .with_auth(keel_core::config::Auth::Mac)
}

/// The time a delta byte advances the clock by (ms).
pub fn delta_ms(d: u8) -> u64 {
    if d < 0x80 {
        u64::from(d)
    } else {
        u64::from(d - 0x7f) * 64
    }
}

/// One encoded input record.
pub fn record(selector: u8, delta: u8, frame: &[u8]) -> Vec<u8> {
    let len = u16::try_from(frame.len()).expect("frame fits a record");
    let mut out = vec![selector, delta];
    out.extend(len.to_le_bytes());
    out.extend(frame);
    out
}

/// A digest FIX replaces: bytes 1..32 zero, byte 0 selects.
pub fn placeholder(k: u8) -> Digest {
    let mut d = [0u8; 32];
    d[0] = k;
    Digest(d)
}

/// The checkpoint at `seq` of a cluster that executed only null values.
pub fn synthetic_checkpoint(seq: Seq, chunk_bytes: usize) -> Chunked {
    let mut e = Executor::new(Kv::new());
    // The membership is part of the state, as on the nodes.
    e.set_membership(config(&secrets()).membership, None);
    for s in Seq(1).through(seq) {
        e.execute(s, &Value::null());
    }
    Chunked::from_pieces(e.pieces(), chunk_bytes)
}

pub struct Harness {
    pub replica: Replica<Kv>,
    pub secrets: Vec<NodeSecrets>,
    pub cfg: ClusterConfig,
    pub now: u64,
    /// Messages node 0 sent, oldest first (consecutive duplicates of a broadcast once).
    pub sent: Vec<Message>,
    /// Digests node 0 emitted, oldest first.
    pub digests: Vec<Digest>,
    /// Everything node 0 emitted in the last step.
    pub out: Outputs,
    /// When set, everything node 0 emits is also collected here (for seed generation).
    pub trace: Option<Trace>,
    synthetic: BTreeMap<Seq, Chunked>,
}

/// Everything node 0 emitted over a run.
#[derive(Default, Debug)]
pub struct Trace {
    pub messages: Vec<Message>,
    pub records: Vec<wal::Record>,
}

impl Default for Harness {
    fn default() -> Self {
        Harness::new()
    }
}

impl Harness {
    pub fn new() -> Harness {
        let secrets = secrets();
        let cfg = config(&secrets);
        let replica = Replica::new(cfg.clone(), ME, secrets[ME.0 as usize].clone(), Kv::new());
        Harness {
            replica,
            secrets,
            cfg,
            now: 0,
            sent: Vec::new(),
            digests: Vec::new(),
            out: Outputs::default(),
            trace: None,
            synthetic: BTreeMap::new(),
        }
    }

    /// Runs a whole fuzz input.
    pub fn run(data: &[u8]) {
        let mut h = Harness::new();
        let mut rest = data;
        while rest.len() >= 2 {
            let (selector, delta) = (rest[0], rest[1]);
            let len = if rest.len() >= 4 { usize::from(u16::from_le_bytes([rest[2], rest[3]])) } else { 0 };
            let start = rest.len().min(4);
            let end = rest.len().min(start + len);
            let frame = &rest[start..end];
            rest = &rest[end..];
            h.apply(selector, delta, frame);
        }
    }

    /// Applies one record.
    pub fn apply(&mut self, selector: u8, delta: u8, frame: &[u8]) {
        if delta != 0 {
            self.now += delta_ms(delta);
            self.step(Input::Tick);
        }
        let sender = selector & SENDER_MASK;
        let msg = if selector & ECHO != 0 {
            if self.sent.is_empty() {
                return;
            }
            let back = usize::from(frame.first().copied().unwrap_or(0)) % self.sent.len();
            let msg = self.sent[self.sent.len() - 1 - back].clone();
            if sender == 0 {
                msg
            } else {
                self.reattribute(msg, NodeId(u32::from(sender)))
            }
        } else {
            match codec::decode(frame) {
                Ok(msg) => msg,
                Err(_) => return,
            }
        };
        let msg = if selector & FIX != 0 { self.fix(msg, sender) } else { msg };
        let from = if sender == 0 {
            let id = ClientId(u64::from(selector >> 4));
            match &msg {
                Message::Request(r) if id == ClientId(0) => Peer::Client(r.client),
                _ => Peer::Client(id),
            }
        } else {
            Peer::Node(NodeId(u32::from(sender)))
        };
        self.step(Input::Message { from, msg });
    }

    /// Steps node 0 and checks and records what it emitted.
    pub fn step(&mut self, input: Input) {
        self.out.clear();
        self.replica.step(self.now, input, &mut self.out);
        let out = std::mem::take(&mut self.out);
        for (to, msg) in out.send.iter().chain(&out.send_after_persist) {
            let bytes = codec::encode(msg);
            let back = codec::decode(&bytes);
            assert!(
                back.as_ref() == Ok(msg),
                "node 0 sent a {} to {to:?} that peers cannot decode: {:?}",
                msg.kind(),
                back.err()
            );
            self.note_digests(msg);
            if let Some(t) = &mut self.trace {
                t.messages.push(msg.clone());
            }
            if self.sent.last() != Some(msg) {
                if self.sent.len() == HISTORY {
                    self.sent.remove(0);
                }
                self.sent.push(msg.clone());
            }
        }
        for p in &out.persist {
            let records: &[wal::Record] = match p {
                Persist::Record(r) => std::slice::from_ref(r),
                Persist::Compact { records, .. } => records,
                Persist::Snapshot { .. } => &[],
            };
            let bytes: Vec<u8> = records.iter().flat_map(wal::encode_record).collect();
            let log = wal::decode_log(&bytes);
            assert_eq!(log.tail, None, "a persisted record does not read back");
            assert_eq!(log.records, records, "persisted records read back as written");
            if let Some(t) = &mut self.trace {
                t.records.extend_from_slice(records);
            }
        }
        for e in &out.events {
            match e {
                Event::Decided { digest, .. } => self.note(*digest),
                Event::Checkpoint { root, .. } | Event::Stable { root, .. } => self.note(*root),
                _ => {}
            }
        }
        let mut out = out;
        let jobs = std::mem::take(&mut out.checkpoints);
        self.out = out;
        // Checkpoints serialized "in the background" come back at once.
        for job in jobs {
            self.step(Input::CheckpointReady(job.run()));
        }
    }

    fn note(&mut self, d: Digest) {
        if self.digests.contains(&d) {
            return;
        }
        if self.digests.len() == DIGESTS {
            self.digests.remove(0);
        }
        self.digests.push(d);
    }

    fn note_digests(&mut self, msg: &Message) {
        match msg {
            Message::Propose { value, .. } => self.note(value.digest()),
            Message::Decided { value, .. } | Message::ValueBody { value, .. } => self.note(value.digest()),
            Message::Write(w) => self.note(w.digest),
            Message::Accept { digest, .. } => self.note(*digest),
            Message::Checkpoint(v) => self.note(v.root),
            Message::StableCert(p) => self.note(p.root),
            _ => {}
        }
    }

    fn key(&self, node: NodeId) -> &SigningKey {
        &self.secrets[node.index()].signing
    }

    /// `node`'s WRITE signature over (`view`, `seq`, `digest`) in this cluster's epoch.
    fn sign_write(&self, node: NodeId, view: View, seq: Seq, digest: &Digest) -> Sig {
        self.key(node).sign(&write_statement(&self.cfg.membership.digest(), view, seq, digest, as_index(node)))
    }

    /// Whether FIX may forge `node`'s signatures: peers only, never the node under test.
    fn forgeable(node: NodeId) -> bool {
        (1..N as u32).contains(&node.0)
    }

    /// Node 0's own message as if `node` had sent it.
    fn reattribute(&self, msg: Message, node: NodeId) -> Message {
        match msg {
            Message::Write(mut w) => {
                w.sig = self.sign_write(node, w.view, w.seq, &w.digest);
                Message::Write(w)
            }
            Message::Checkpoint(mut v) => {
                v.sig = self.key(node).sign(&checkpoint_statement(v.seq, &v.root, &v.membership, node));
                Message::Checkpoint(v)
            }
            Message::ViewChange(mut vc) => {
                vc.from = as_index(node);
                vc.sig = self.key(node).sign(&vc.statement(&self.cfg.membership.digest()));
                Message::ViewChange(vc)
            }
            other => other,
        }
    }

    fn synthetic(&mut self, seq: Seq) -> Option<&Chunked> {
        let interval = self.cfg.options.checkpoint_interval;
        if seq == Seq(0) || seq > SYNTHETIC_SEQ_MAX || !seq.is_multiple_of(interval) {
            return None;
        }
        let chunk_bytes = self.cfg.options.chunk_bytes;
        Some(self.synthetic.entry(seq).or_insert_with(|| synthetic_checkpoint(seq, chunk_bytes)))
    }

    fn subst(&mut self, d: Digest, seq: Option<Seq>) -> Digest {
        if d.0[1..].iter().any(|&b| b != 0) {
            return d;
        }
        if d.0[0] == SYNTHETIC_ROOT {
            if let Some(c) = seq.and_then(|s| self.synthetic(s)) {
                return c.root;
            }
        }
        if self.digests.is_empty() {
            return d;
        }
        self.digests[usize::from(d.0[0]) % self.digests.len()]
    }

    fn fix_request(&self, r: &mut Request) {
        let mac = client_mac_key(&self.secrets[ME.0 as usize].mac_secret, r.client).mac(&r.statement());
        match r.auth.first_mut() {
            Some(m) => *m = mac,
            None => r.auth.push(mac),
        }
    }

    fn fix_stable(&mut self, p: &mut StableProof) {
        p.root = self.subst(p.root, Some(p.seq));
        for (node, sig) in &mut p.sigs {
            if Self::forgeable(*node) {
                *sig = self.key(*node).sign(&checkpoint_statement(p.seq, &p.root, &p.membership, *node));
            }
        }
    }

    fn fix_view_change(&mut self, vc: &mut ViewChange) {
        self.fix_stable(&mut vc.stable);
        for cert in &mut vc.certs {
            let digest = cert.digest;
            for (node, sig) in &mut cert.writes {
                if Self::forgeable(as_id(*node)) {
                    *sig = self.sign_write(as_id(*node), cert.view, cert.seq, &digest);
                }
            }
        }
        if Self::forgeable(as_id(vc.from)) {
            vc.sig = self.key(as_id(vc.from)).sign(&vc.statement(&self.cfg.membership.digest()));
        }
    }

    /// Makes authenticators valid (see the module doc).
    fn fix(&mut self, msg: Message, sender: u8) -> Message {
        let sender = NodeId(u32::from(sender));
        match msg {
            Message::Request(mut r) => {
                self.fix_request(&mut r);
                Message::Request(r)
            }
            Message::Forward(mut r) => {
                self.fix_request(&mut r);
                Message::Forward(r)
            }
            Message::Propose { view, seq, mut value } => {
                value.time = (self.now + value.time % 4001).saturating_sub(2000);
                for p in &mut value.requests {
                    if let Proposed::Full(r) = p {
                        self.fix_request(r);
                    }
                }
                Message::Propose { view, seq, value }
            }
            Message::Write(mut w) => {
                w.digest = self.subst(w.digest, None);
                if Self::forgeable(sender) {
                    w.sig = self.sign_write(sender, w.view, w.seq, &w.digest);
                }
                Message::Write(w)
            }
            Message::Accept { view, seq, digest } => {
                let digest = self.subst(digest, None);
                Message::Accept { view, seq, digest }
            }
            Message::Checkpoint(mut v) => {
                v.root = self.subst(v.root, Some(v.seq));
                if Self::forgeable(sender) {
                    v.sig = self.key(sender).sign(&checkpoint_statement(v.seq, &v.root, &v.membership, sender));
                }
                Message::Checkpoint(v)
            }
            Message::ViewChange(mut vc) => {
                self.fix_view_change(&mut vc);
                Message::ViewChange(vc)
            }
            Message::NewView(mut nv) => {
                for vc in &mut nv.view_changes {
                    self.fix_view_change(vc);
                }
                let primary = self.cfg.primary(nv.view);
                if Self::forgeable(as_id(primary)) {
                    nv.sig = self.key(as_id(primary)).sign(&nv.statement(&self.cfg.membership.digest()));
                }
                Message::NewView(nv)
            }
            Message::StableCert(mut p) => {
                self.fix_stable(&mut p);
                Message::StableCert(p)
            }
            Message::Manifest { seq, len, chunks } => match self.synthetic(seq) {
                Some(c) => Message::Manifest { seq, len: c.len(), chunks: c.leaves.clone() },
                None => Message::Manifest { seq, len, chunks },
            },
            Message::Chunk { seq, index, data } => {
                let real = self.synthetic(seq).and_then(|c| c.chunk(index).ok().flatten()).map(|c| c.to_vec());
                Message::Chunk { seq, index, data: real.unwrap_or(data) }
            }
            other => other,
        }
    }
}

/// Builds a `replica_input` seed while running it, so a generator can look at what node 0
/// did (and assert that the seed reaches the state it is meant to).
pub struct Script {
    pub h: Harness,
    pub bytes: Vec<u8>,
}

impl Default for Script {
    fn default() -> Self {
        Script::new()
    }
}

impl Script {
    pub fn new() -> Script {
        let mut h = Harness::new();
        h.trace = Some(Trace::default());
        Script { h, bytes: Vec::new() }
    }

    /// A wire message from `sender` (0: a client), after `delta`.
    pub fn send(&mut self, selector: u8, delta: u8, msg: &Message) {
        let frame = codec::encode(msg);
        self.raw(selector, delta, &frame);
    }

    /// Any record.
    pub fn raw(&mut self, selector: u8, delta: u8, frame: &[u8]) {
        self.bytes.extend(record(selector, delta, frame));
        self.h.apply(selector, delta, frame);
    }

    /// Echoes the most recent message node 0 sent that matches `pred`, as `sender`'s.
    pub fn echo(&mut self, sender: u8, delta: u8, pred: impl Fn(&Message) -> bool) {
        let back = self.h.sent.iter().rev().position(pred).expect("node 0 sent a matching message");
        let back = u8::try_from(back).expect("within the history");
        self.raw(ECHO | (sender & SENDER_MASK), delta, &[back]);
    }

    /// Advances time and ticks, with an empty (dropped) frame.
    pub fn tick(&mut self, delta: u8) {
        self.raw(FIX, delta, &[]);
    }
}
