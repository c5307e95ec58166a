//! Every message Keel nodes and clients exchange, and the statements they sign.
//!
//! Requests travel once, inside PROPOSE; WRITE and ACCEPT carry only the value's digest
//! (BFT-SMaRt §II-C1). Signed statements (WRITE votes, checkpoint votes, view changes,
//! new views) are the evidence a view change forwards; everything else relies on the
//! authenticated channel the transport provides (TLS between nodes, MAC authenticators
//! for client requests).

use crate::crypto::{Digest, Hasher, Mac, Sig};
use serde::{Deserialize, Serialize};
use std::sync::{Arc, OnceLock};

pub use crate::ids::{
    owner_of, session_id, session_of, ClientId, MemberIndex, NodeId, Seq, View, SESSIONS_MAX, SESSION_SHIFT,
};

/// The operation bytes of a request, with their digest computed at most once.
///
/// A node hashes an operation when it checks the client's MAC, when it checks the copy in
/// a PROPOSE, for the value digest, the agreed seed and the execution event: for 1 KiB
/// operations that hashing was the largest CPU cost of a node. The bytes are immutable
/// (no `DerefMut`), so the cached digest always belongs to them. Clones share the bytes
/// and the caches: a request is copied into the batch, the PROPOSE to every peer, the
/// log record, the slot and the decided value, and copying 1 KiB each time was ~10% of
/// a node's CPU.
#[derive(Clone, Default)]
pub struct Payload(Arc<PayloadInner>);

#[derive(Default)]
struct PayloadInner {
    bytes: Vec<u8>,
    digest: OnceLock<Digest>,
    /// The request statement over these bytes, with the client and sequence number it
    /// was computed for: checked on every use, as those fields can change.
    statement: OnceLock<(ClientId, u64, Digest)>,
}

impl Payload {
    /// `Digest::of` the bytes.
    pub fn digest(&self) -> Digest {
        *self.0.digest.get_or_init(|| Digest::of(&self.0.bytes))
    }
}

impl Payload {
    /// Bytes taken for the operation with digest `digest` without hashing them: only the
    /// simulator's mutation `unchecked-body` does this (a fetched operation trusted to be
    /// the one asked for), to show that the check it skips is needed.
    pub(crate) fn claiming_digest(bytes: Vec<u8>, digest: Digest) -> Payload {
        let p = Payload::from(bytes);
        let _ = p.0.digest.set(digest);
        p
    }
}

impl From<Vec<u8>> for Payload {
    fn from(bytes: Vec<u8>) -> Payload {
        Payload(Arc::new(PayloadInner { bytes, digest: OnceLock::new(), statement: OnceLock::new() }))
    }
}

impl std::ops::Deref for Payload {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.0.bytes
    }
}

impl PartialEq for Payload {
    fn eq(&self, other: &Payload) -> bool {
        self.0.bytes == other.0.bytes
    }
}

impl Eq for Payload {}

impl std::fmt::Debug for Payload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} bytes", self.0.bytes.len())
    }
}

impl Serialize for Payload {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        serde_bytes::serialize(&self.0.bytes, s)
    }
}

impl<'de> Deserialize<'de> for Payload {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Payload, D::Error> {
        serde_bytes::deserialize::<Vec<u8>, D>(d).map(Payload::from)
    }
}

/// A client operation, as the client sends it to the order nodes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    pub client: ClientId,
    /// Per-client sequence number, starting at 1 and increasing by one per operation.
    pub seq: u64,
    pub op: Payload,
    /// One MAC per order node over [`Request::statement`]; entry `i` is checked by node `i`.
    /// Empty with `auth = none`, and inside a PROPOSE with `auth = rq-mac`.
    pub auth: Vec<Mac>,
    /// `auth = rq-mac`, inside a PROPOSE only: the nodes that vouch for the request (a
    /// matrix signature, UpRight §4.1). Empty as the client sends it.
    pub endorsements: Vec<Endorsement>,
    /// `auth = sig`: the client's Ed25519 signature over [`Request::statement`].
    pub sig: Option<Sig>,
}

/// [`Request::statement`] from its parts: what a request named by its operation's digest
/// ([`RequestDigest`]) is judged by, without the operation's bytes.
pub fn request_statement(client: ClientId, seq: u64, op: &Digest) -> Digest {
    Hasher::new("keel/request").u64(client.0).u64(seq).digest(op).finish()
}

/// Node `node`'s word that a client sent a request: one MAC per order node over
/// [`endorse_statement`], entry `j` keyed for node `j`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endorsement {
    pub node: NodeId,
    pub macs: Vec<Mac>,
}

/// What node `node`'s endorsement MACs cover. Domain-separated from the client's
/// [`Request::statement`], so an endorsement can never pass for a client's authenticator.
pub fn endorse_statement(node: NodeId, request: &Digest) -> Digest {
    Hasher::new("keel/endorse").u64(node.0 as u64).digest(request).finish()
}

impl Request {
    /// A request as a client builds it, before its MAC authenticator.
    pub fn new(client: ClientId, seq: u64, op: Payload) -> Request {
        Request { client, seq, op, auth: Vec::new(), endorsements: Vec::new(), sig: None }
    }

    /// What the MAC authenticator covers and what the value digest includes: the client,
    /// its sequence number and the operation's (cached) digest.
    pub fn statement(&self) -> Digest {
        if let Some((c, s, d)) = self.op.0.statement.get() {
            if (*c, *s) == (self.client, self.seq) {
                return *d;
            }
        }
        let d = request_statement(self.client, self.seq, &self.op.digest());
        let _ = self.op.0.statement.set((self.client, self.seq, d));
        d
    }

    /// Bytes this request adds to a batch, for the byte bound.
    pub fn size(&self) -> usize {
        self.op.len()
            + self.auth.len() * 16
            + self.endorsements.iter().map(|e| e.macs.len() * 16 + 8).sum::<usize>()
            + if self.sig.is_some() { 64 } else { 0 }
            + 24
    }
}

pub use crate::quorum::ReadConsistency;

impl ReadConsistency {
    /// Stable numbers for statements and names (the wire uses the variant index).
    pub fn code(self) -> u64 {
        match self {
            ReadConsistency::Serializable => 0,
            ReadConsistency::Linearizable => 1,
            ReadConsistency::Index => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ReadConsistency::Serializable => "serializable",
            ReadConsistency::Linearizable => "linearizable",
            ReadConsistency::Index => "index",
        }
    }
}

/// A read-only operation: sent to every node, executed against its state without
/// ordering, never cached; a client that cannot gather enough matching answers orders the
/// operation instead (PBFT's read-only optimisation, UpRight §3.1).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Read {
    pub client: ClientId,
    /// From the session's own sequence (reads and ordered requests share it).
    pub seq: u64,
    pub consistency: ReadConsistency,
    /// The session's last ordered request the answer must reflect (0: none).
    pub after: u64,
    pub op: Payload,
    /// One MAC per order node over [`Read::statement`].
    pub auth: Vec<Mac>,
}

impl Read {
    /// Domain-separated from [`Request::statement`]: a read's authenticator cannot get
    /// the same bytes ordered.
    pub fn statement(&self) -> Digest {
        Hasher::new("keel/read")
            .u64(self.client.0)
            .u64(self.seq)
            .u64(self.consistency.code())
            .u64(self.after)
            .digest(&self.op.digest())
            .finish()
    }
}

/// What one consensus instance decides: a batch of requests and the agreed time.
/// A value with no requests and time 0 is the null value a new view fills gaps with.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Value {
    /// The primary's clock (ms) when it proposed; backups check it (UpRight §3.1).
    pub time: u64,
    pub requests: Vec<Request>,
}

impl Value {
    pub fn null() -> Value {
        Value { time: 0, requests: Vec::new() }
    }

    /// Covers everything execution sees (time, clients, sequence numbers, operations),
    /// not the MAC authenticators, which only gate admission.
    pub fn digest(&self) -> Digest {
        value_digest(self.time, self.requests.iter().map(Request::statement))
    }

    /// Bytes its requests take, for the batch bound.
    pub fn size(&self) -> usize {
        self.requests.iter().map(Request::size).sum()
    }

    /// The agreed pseudo-random seed of instance `seq`: derived from the decided value so
    /// that every backup can check it and no primary can choose it freely.
    pub fn seed(&self, seq: Seq) -> u64 {
        Hasher::new("keel/seed").u64(seq.0).digest(&self.digest()).finish().prefix_u64()
    }
}

fn value_digest(time: u64, statements: impl ExactSizeIterator<Item = Digest>) -> Digest {
    let mut h = Hasher::new("keel/value");
    h.u64(time).u64(statements.len() as u64);
    for s in statements {
        h.digest(&s);
    }
    h.finish()
}

/// Operations up to this size travel inside a PROPOSE even with request digests on: a
/// digest (32 bytes) and the fetch it may cost would not save anything (UpRight §4.1 uses
/// the same 64-byte bar).
pub const DIGEST_MIN: usize = 64;

/// A [`Value`] as PROPOSE carries it. With request digests (`auth = rq-mac`, UpRight §4.1
/// "Request digest"), an operation over [`DIGEST_MIN`] bytes travels as its digest: the
/// nodes that endorsed the request hold its bytes, so the primary does not send every
/// large request to every backup. A backup expands the proposal into the value before it
/// votes (replica/bodies.rs), so every vote still implies the node holds (and has logged)
/// every byte it voted for. [`Proposal::digest`] equals the expanded value's digest.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Proposal {
    pub time: u64,
    pub requests: Vec<Proposed>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Proposed {
    Full(Request),
    Digest(RequestDigest),
}

/// A proposed request without its operation's bytes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestDigest {
    pub client: ClientId,
    pub seq: u64,
    /// `Digest::of` the operation's bytes.
    pub op: Digest,
    /// As in [`Request::endorsements`]: who vouches for it, and so who holds the bytes.
    pub endorsements: Vec<Endorsement>,
}

impl Proposed {
    pub fn client(&self) -> ClientId {
        match self {
            Proposed::Full(r) => r.client,
            Proposed::Digest(d) => d.client,
        }
    }

    pub fn seq(&self) -> u64 {
        match self {
            Proposed::Full(r) => r.seq,
            Proposed::Digest(d) => d.seq,
        }
    }

    pub fn statement(&self) -> Digest {
        match self {
            Proposed::Full(r) => r.statement(),
            Proposed::Digest(d) => request_statement(d.client, d.seq, &d.op),
        }
    }

    pub fn endorsements(&self) -> &[Endorsement] {
        match self {
            Proposed::Full(r) => &r.endorsements,
            Proposed::Digest(d) => &d.endorsements,
        }
    }

    /// Bytes this request adds to a batch, for the byte bound: an operation sent by
    /// digest counts its digest, not its bytes (the expanded value is bounded again).
    pub fn size(&self) -> usize {
        match self {
            Proposed::Full(r) => r.size(),
            Proposed::Digest(d) => 32 + d.endorsements.iter().map(|e| e.macs.len() * 16 + 8).sum::<usize>() + 24,
        }
    }

    /// The request, if it travels with its operation.
    pub fn full(&self) -> Option<&Request> {
        match self {
            Proposed::Full(r) => Some(r),
            Proposed::Digest(_) => None,
        }
    }

    /// The digest of the operation's bytes.
    pub fn op_digest(&self) -> Digest {
        match self {
            Proposed::Full(r) => r.op.digest(),
            Proposed::Digest(d) => d.op,
        }
    }
}

impl Proposal {
    /// The digest of the value this proposal expands to.
    pub fn digest(&self) -> Digest {
        value_digest(self.time, self.requests.iter().map(Proposed::statement))
    }

    /// `value` with the operations over [`DIGEST_MIN`] bytes sent as digests.
    pub fn with_digests(value: &Value) -> Proposal {
        let requests = value
            .requests
            .iter()
            .map(|r| {
                if r.op.len() > DIGEST_MIN {
                    Proposed::Digest(RequestDigest {
                        client: r.client,
                        seq: r.seq,
                        op: r.op.digest(),
                        endorsements: r.endorsements.clone(),
                    })
                } else {
                    Proposed::Full(r.clone())
                }
            })
            .collect();
        Proposal { time: value.time, requests }
    }

    /// Whether some operation travels as a digest.
    pub fn has_digests(&self) -> bool {
        self.requests.iter().any(|p| matches!(p, Proposed::Digest(_)))
    }

    /// The value, given the bytes of every operation sent as a digest (`bodies[i]` for
    /// request `i`; entries of full requests are ignored). `None` if one is missing or
    /// does not hash to its digest.
    pub fn expand(self, bodies: &[Option<Payload>]) -> Option<Value> {
        let mut requests = Vec::with_capacity(self.requests.len());
        for (i, p) in self.requests.into_iter().enumerate() {
            requests.push(match p {
                Proposed::Full(r) => r,
                Proposed::Digest(d) => {
                    let op = bodies.get(i)?.clone()?;
                    if op.digest() != d.op {
                        return None;
                    }
                    Request {
                        client: d.client,
                        seq: d.seq,
                        op,
                        auth: Vec::new(),
                        endorsements: d.endorsements,
                        sig: None,
                    }
                }
            });
        }
        Some(Value { time: self.time, requests })
    }
}

impl From<Value> for Proposal {
    /// Every operation in full.
    fn from(value: Value) -> Proposal {
        Proposal { time: value.time, requests: value.requests.into_iter().map(Proposed::Full).collect() }
    }
}

/// A node's answer to a client.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reply {
    /// The session this answers (several share one connection).
    pub client: ClientId,
    /// The node's current view, so clients can track the primary.
    pub view: View,
    /// The client sequence number this answers.
    pub seq: u64,
    pub body: ReplyBody,
    /// The node's membership epoch: a client that knows an older one asks for the
    /// certificates of the change ([`Message::EpochQuery`]).
    pub epoch: u64,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReplyBody {
    Full(#[serde(with = "serde_bytes")] Vec<u8>),
    /// The digest of the full result: every node but the designated one sends only this.
    Hash(Digest),
    /// Answer to a [`Read`] the service cannot run without ordering: order it instead.
    NotReadOnly,
    /// The result has this many bytes, more than `codec::OP_BYTES_MAX`: no frame
    /// may carry it, so every node says so instead (the client fails the operation with a
    /// clear error once r + 1 agree, rather than waiting out its timeout).
    TooLarge(u64),
}

impl ReplyBody {
    pub fn result_digest(&self) -> Digest {
        match self {
            ReplyBody::Full(bytes) => result_digest(bytes),
            ReplyBody::Hash(d) => *d,
            ReplyBody::NotReadOnly => Hasher::new("keel/not-read-only").finish(),
            ReplyBody::TooLarge(len) => Hasher::new("keel/too-large").u64(*len).finish(),
        }
    }
}

pub fn result_digest(bytes: &[u8]) -> Digest {
    Hasher::new("keel/result").bytes(bytes).finish()
}

/// A WRITE vote: "in `view`, instance `seq` should decide the value with `digest`".
/// Signed, because Q of them make a prepared certificate that view changes forward.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Write {
    pub view: View,
    pub seq: Seq,
    pub digest: Digest,
    pub sig: Sig,
}

/// `epoch` is the digest of the membership the vote is cast in ([`Membership::digest`],
/// which covers the epoch number): every signed statement of the order protocol names its
/// epoch, so a member cannot replay one from an earlier epoch whose signers kept their
/// index and key (issue #21, defect 1; each epoch restarts at view 0).
///
/// [`Membership::digest`]: crate::membership::Membership::digest
pub fn write_statement(epoch: &Digest, view: View, seq: Seq, digest: &Digest, node: MemberIndex) -> Digest {
    Hasher::new("keel/write").digest(epoch).u64(view.0).u64(seq.0).digest(digest).u64(node.0 as u64).finish()
}

/// A checkpoint vote: "after executing `seq`, my state's Merkle root is `root`, and
/// the membership in that state has digest `membership`".
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointVote {
    pub seq: Seq,
    pub root: Digest,
    pub membership: Digest,
    pub sig: Sig,
}

/// The membership digest is redundant for correct nodes (the root covers the state, which
/// holds the membership) but lets a proof vouch for the membership without the state: a
/// node or client that missed an epoch change learns the new members from the proof of
/// the epoch's last checkpoint ([`EpochCert`]).
pub fn checkpoint_statement(seq: Seq, root: &Digest, membership: &Digest, node: NodeId) -> Digest {
    Hasher::new("keel/checkpoint").u64(seq.0).digest(root).digest(membership).u64(node.0 as u64).finish()
}

/// Q signed checkpoint votes for the same (seq, root, membership): proof that the state
/// at `seq` is the one correct nodes hold. `seq = 0` is the genesis state and needs no
/// signatures.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StableProof {
    pub seq: Seq,
    pub root: Digest,
    pub membership: Digest,
    pub sigs: Vec<(NodeId, Sig)>,
}

/// `p` carries `quorum` distinct valid signatures, by nodes with `keys`, on its
/// (seq, root, membership).
pub fn proof_signed(keys: &crate::crypto::NodeKeys, quorum: usize, p: &StableProof) -> bool {
    let mut signers = std::collections::BTreeSet::new();
    for (node, sig) in &p.sigs {
        if !keys.verify(node.0, &checkpoint_statement(p.seq, &p.root, &p.membership, *node), sig) {
            return false;
        }
        signers.insert(*node);
    }
    signers.len() >= quorum
}

impl StableProof {
    pub fn genesis() -> StableProof {
        StableProof { seq: Seq(0), root: Digest::default(), membership: Digest::default(), sigs: Vec::new() }
    }
}

/// How a node or client that knows epoch `e`'s membership learns epoch `e + 1`'s: the
/// proof, by epoch e's quorum, of the checkpoint at the last instance of e, and the
/// membership whose digest it signs (which names e's membership as `previous` and the
/// checkpoint as `since`). A chain of them spans several epochs (replica/epoch.rs).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct EpochCert {
    pub proof: StableProof,
    pub next: crate::membership::Membership,
}

/// A prepared certificate: the value a node prepared for `seq` in `view`, and (in BFT
/// mode) the Q signed WRITE votes that prepared it. In CFT mode `writes` is empty and the
/// certificate is the node's own accepted value (Paxos' accepted proposal).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cert {
    pub view: View,
    pub seq: Seq,
    pub value: Value,
    pub writes: Vec<(MemberIndex, Sig)>,
}

impl Cert {
    pub fn digest(&self) -> Digest {
        self.value.digest()
    }

    /// What a view change carries of this certificate: the digest instead of the value.
    pub fn proof(&self) -> CertProof {
        CertProof { view: self.view, seq: self.seq, digest: self.digest(), writes: self.writes.clone() }
    }
}

/// A prepared certificate by digest, as VIEW-CHANGE and NEW-VIEW carry it (PBFT §4.4:
/// view-change messages name requests by digest). The WRITE signatures cover the digest,
/// so nothing is lost in BFT mode; the body is fetched from a node that holds it
/// (`FetchValue`). Carrying bodies made a view change as large as the whole log above
/// the stable checkpoint, over the frame limit under 1 KiB load, and no view change
/// could then complete.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CertProof {
    pub view: View,
    pub seq: Seq,
    pub digest: Digest,
    pub writes: Vec<(MemberIndex, Sig)>,
}

/// A node's commitment to leave every view below `view` (BFT-SMaRt's STOPDATA), carrying
/// its stable checkpoint and its prepared certificates above it (by digest). Signed, so
/// the new primary can forward it inside NEW-VIEW as proof.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ViewChange {
    pub view: View,
    pub from: MemberIndex,
    pub stable: StableProof,
    pub certs: Vec<CertProof>,
    pub sig: Sig,
}

impl ViewChange {
    /// What the sender signs in the membership with digest `epoch` (see
    /// [`write_statement`]).
    pub fn statement(&self, epoch: &Digest) -> Digest {
        // The signature covers a canonical encoding of every other field.
        let body = postcard::to_allocvec(&(self.view, self.from, &self.stable, &self.certs)).unwrap_or_default();
        Hasher::new("keel/view-change").digest(epoch).bytes(&body).finish()
    }
}

/// The new primary's announcement of `view`, with the Q view changes it is built from.
/// Every node recomputes what must be re-proposed from `view_changes`, so NEW-VIEW is
/// self-certifying and any node may relay it to a peer that missed it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NewView {
    pub view: View,
    pub view_changes: Vec<ViewChange>,
    pub sig: Sig,
}

impl NewView {
    /// What the primary signs in the membership with digest `epoch` (see
    /// [`write_statement`]).
    pub fn statement(&self, epoch: &Digest) -> Digest {
        let mut h = Hasher::new("keel/new-view");
        h.digest(epoch).u64(self.view.0).u64(self.view_changes.len() as u64);
        for vc in &self.view_changes {
            h.digest(&vc.statement(epoch));
        }
        h.finish()
    }
}

/// Everything on the wire. Node-to-node and client-to-node share one codec.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Message {
    /// Client → node.
    Request(Request),
    /// Node → client.
    Reply(Reply),
    /// Backup → primary: a request whose timer expired once (BFT-SMaRt §II-C1).
    Forward(Request),
    /// Primary → all: instance `seq` of `view` should decide `value` (large operations
    /// possibly by digest, [`Proposal`]).
    Propose {
        view: View,
        seq: Seq,
        value: Proposal,
    },
    /// All → all (BFT only).
    Write(Write),
    /// All → all: decided on Q matching.
    Accept {
        view: View,
        seq: Seq,
        digest: Digest,
    },
    /// All → all, every CP_INTERVAL instances.
    Checkpoint(CheckpointVote),
    /// All → all: "I suspect the primary and want to move to `view`".
    Stop {
        view: View,
    },
    /// All → primary of `view`.
    ViewChange(ViewChange),
    /// Primary of `view` → all; also relayed to a peer that lags behind.
    NewView(NewView),
    /// All → all, periodically: lets lagging peers be noticed and helped.
    Status {
        view: View,
        executed: Seq,
        stable: Seq,
    },
    /// Answer to a lagging peer: a stable checkpoint it should transfer.
    StableCert(StableProof),
    /// Answer to a lagging peer: a decided value it missed.
    Decided {
        seq: Seq,
        value: Value,
    },
    /// State transfer: the chunk hashes of the checkpoint at `seq`.
    FetchManifest {
        seq: Seq,
    },
    Manifest {
        seq: Seq,
        len: u64,
        chunks: Vec<Digest>,
    },
    /// State transfer: one chunk of the checkpoint at `seq`.
    FetchChunk {
        seq: Seq,
        index: u32,
    },
    Chunk {
        seq: Seq,
        index: u32,
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
    },
    /// After a NEW-VIEW: "send me the value with `digest` for instance `seq`" (the view
    /// change named it by digest and this node does not hold it).
    FetchValue {
        seq: Seq,
        digest: Digest,
    },
    /// The answer: taken only if it hashes to a digest the asker is waiting for.
    ValueBody {
        seq: Seq,
        value: Value,
    },
    /// Client → node: a read-only operation (last, so earlier variants keep their tags).
    Read(Read),
    /// Node → all, for read index: "how far have you voted to accept?" `round` pairs the
    /// answers with the question; every read that arrived before it waits on it.
    IndexProbe {
        round: u64,
    },
    /// The answer: the highest instance this node sent ACCEPT for or knows decided.
    IndexAck {
        round: u64,
        accepted: Seq,
    },
    /// Node → primary (first receipt) or all (a repeat, a request timer): `auth = rq-mac`'s
    /// endorsement of a client request by the sending node (UpRight §4.1). The request
    /// keeps the client's authenticator, so a receiver can also check its own entry.
    Endorse {
        request: Request,
        macs: Vec<Mac>,
    },
    /// Node → client: push event `seq` for `client` (UpRight §3.1), resent until acked.
    /// `epoch` is the sender's membership epoch when it sent (or resent) the event: a
    /// client counts an event only from an epoch it has verified, as it does replies
    /// (issue #21 defect 3: a later epoch may tolerate more liars than the client's).
    Push {
        client: ClientId,
        seq: u64,
        epoch: u64,
        #[serde(with = "serde_bytes")]
        event: Vec<u8>,
    },
    /// Client → node: "I have every push event up to `upto` (or gave up on it)".
    PushAck {
        client: ClientId,
        upto: u64,
    },
    /// Answer to a node (or client) of an earlier epoch: how the membership changed
    /// since, one certificate per epoch, oldest first.
    EpochCerts(Vec<EpochCert>),
    /// Client (session `client`) → node: "I know epoch `epoch`; how did the membership
    /// change since?" The answer goes to that session.
    EpochQuery {
        client: ClientId,
        epoch: u64,
    },
    /// Node → a node that endorsed the requests: "send me the operations of these
    /// requests of instance `seq`" (by client and operation digest), which a PROPOSE
    /// named by digest and this node does not hold.
    FetchBodies {
        seq: Seq,
        wanted: Vec<(ClientId, Digest)>,
    },
    /// The answer: taken only where an operation hashes to a digest the asker awaits.
    Bodies {
        seq: Seq,
        ops: Vec<Payload>,
    },
    /// Node → primary, with request digests: [`Message::Endorse`] of a request over
    /// [`DIGEST_MIN`] bytes without its bytes, which the primary holds from the client.
    EndorseDigest {
        client: ClientId,
        seq: u64,
        op: Digest,
        macs: Vec<Mac>,
    },
    /// Node → all: "I lost my disk; how far did you get?" (replica/rejoin.rs).
    Rejoin,
    /// The answer: the highest view the sender installed or committed to, and the
    /// highest instance it executed.
    RejoinInfo {
        committed: View,
        executed: Seq,
    },
    /// Service node → service node, unordered (the node plane, ARCHITECTURE §9): bytes a
    /// service's nodes exchange beside the protocol (Gnothi's block data, a storage
    /// ring). The drivers hand it to the service's plane, never to a protocol core; the
    /// transport authenticated the sender, the receiving service checks the bytes.
    Plane {
        #[serde(with = "serde_bytes")]
        payload: Vec<u8>,
    },
}

impl Message {
    /// Short name for metrics and traces.
    pub fn kind(&self) -> &'static str {
        match self {
            Message::Request(_) => "request",
            Message::Reply(_) => "reply",
            Message::Read(_) => "read",
            Message::Forward(_) => "forward",
            Message::Propose { .. } => "propose",
            Message::Write(_) => "write",
            Message::Accept { .. } => "accept",
            Message::Checkpoint(_) => "checkpoint",
            Message::Stop { .. } => "stop",
            Message::ViewChange(_) => "view-change",
            Message::NewView(_) => "new-view",
            Message::Status { .. } => "status",
            Message::StableCert(_) => "stable-cert",
            Message::Decided { .. } => "decided",
            Message::FetchManifest { .. } => "fetch-manifest",
            Message::Manifest { .. } => "manifest",
            Message::FetchChunk { .. } => "fetch-chunk",
            Message::Chunk { .. } => "chunk",
            Message::FetchValue { .. } => "fetch-value",
            Message::ValueBody { .. } => "value-body",
            Message::IndexProbe { .. } => "index-probe",
            Message::IndexAck { .. } => "index-ack",
            Message::Endorse { .. } => "endorse",
            Message::EpochCerts(_) => "epoch-certs",
            Message::EpochQuery { .. } => "epoch-query",
            Message::Plane { .. } => "plane",
            Message::Push { .. } => "push",
            Message::PushAck { .. } => "push-ack",
            Message::FetchBodies { .. } => "fetch-bodies",
            Message::Bodies { .. } => "bodies",
            Message::EndorseDigest { .. } => "endorse-digest",
            Message::Rejoin => "rejoin",
            Message::RejoinInfo { .. } => "rejoin-info",
        }
    }
}

#[cfg(test)]
mod payload_tests {
    use super::*;

    #[test]
    fn payload_digest_is_cached_per_bytes_and_the_encoding_is_a_byte_string() {
        let p = Payload::from(b"operation".to_vec());
        let warm = p.clone();
        assert_eq!(warm.digest(), Digest::of(b"operation"));
        // A cached and an uncached copy are equal; a different payload differs in digest.
        assert_eq!(p, warm);
        assert_ne!(Payload::from(b"other".to_vec()).digest(), warm.digest());
        // The same postcard bytes as a serde_bytes Vec<u8>.
        let as_vec = postcard::to_allocvec(&serde_bytes::ByteBuf::from(b"operation".to_vec())).expect("encodes");
        assert_eq!(postcard::to_allocvec(&p).expect("encodes"), as_vec);
        let back: Payload = postcard::from_bytes(&as_vec).expect("decodes");
        assert_eq!(back.digest(), p.digest());
        // The statement binds client, sequence number and operation.
        let req = |client, seq, op: &[u8]| Request::new(client, seq, op.to_vec().into());
        let base = req(ClientId(1), 1, b"a").statement();
        assert_ne!(base, req(ClientId(2), 1, b"a").statement());
        assert_ne!(base, req(ClientId(1), 2, b"a").statement());
        assert_ne!(base, req(ClientId(1), 1, b"b").statement());
        // A cached statement is not reused once the client or sequence number changed.
        let mut r = req(ClientId(1), 1, b"a");
        assert_eq!(r.statement(), base);
        r.seq = 2;
        assert_eq!(r.statement(), req(ClientId(1), 2, b"a").statement());
        r.client = ClientId(2);
        assert_eq!(r.statement(), req(ClientId(2), 2, b"a").statement());
    }
}
