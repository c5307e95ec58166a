//! Fetching a cluster's newest certified checkpoint from outside the cluster, as
//! `keel admin backup` does.
//!
//! The administrator's client asks the nodes that hold state for a manifest; a node whose
//! stable checkpoint is newer answers with its certificate ([`StableProof`]), which this
//! fetch checks the way a node would: enough signatures of the nodes that certify
//! checkpoints, over the membership the client follows (asking for epoch certificates
//! when the proof names a newer one). The manifest and chunks then come through the same
//! [`Transfer`] a lagging node uses, so every chunk is checked against the certified root
//! and any node may serve any part: a lying node can slow a backup down, not change it.
//! Nodes serve only their newest checkpoint; when it moves on mid-way, the fetch follows
//! it and keeps the chunks that recur.
//!
//! Sans-IO: the caller sends what the calls return and feeds back what arrives.

use crate::chunk::Chunked;
use crate::crypto::NodeKeys;
use crate::epoch_cert::follow_certs;
use crate::ids::NodeRange;
use crate::membership::Membership;
use crate::message::{proof_signed, ClientId, EpochCert, Message, NodeId, Seq, StableProof};
use crate::step::Peer;
use crate::timeout::Timeout;
use crate::transfer::Transfer;

/// Who certifies the checkpoints a backup takes.
#[derive(Clone, Debug)]
pub enum Certifiers {
    /// Every member orders and executes: the membership's order quorum signs, and the
    /// fetch follows membership changes (epoch certificates) to know the signers.
    Members,
    /// Stages apart (UpRight §4.2): the execution nodes, by stable id (`holders`, whom
    /// the fetch asks) and as they sign (`signers`, `config::stage_node` ids, whose
    /// `keys` start at the first), `quorum` (u + 1) of them.
    Executors { holders: Vec<NodeId>, signers: NodeRange, keys: Vec<crate::crypto::PublicKey>, quorum: usize },
}

/// A certified checkpoint, fetched whole.
#[derive(Debug)]
pub struct Fetched {
    pub proof: StableProof,
    /// The membership the checkpoint's state belongs to, as the client followed it.
    pub membership: Membership,
    pub state: Chunked,
    /// Answers refused on the way (from lying or confused nodes).
    pub refused: u64,
}

/// Why an answer was not taken (counted; the fetch goes on with other nodes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// A certificate without enough valid signatures of the certifiers.
    Unproven,
    /// Epoch certificates that do not follow from the membership known here.
    BadEpochCerts,
    /// A manifest or chunk that does not match the certified root.
    Mismatch,
}

/// The fetch of one checkpoint (`keel admin backup`).
#[derive(Debug)]
pub struct CheckpointFetch {
    /// The administrator's session, named in epoch queries.
    client: ClientId,
    certifiers: Certifiers,
    membership: Membership,
    /// The certificate that led to `membership` (its proof certifies the epoch's first
    /// checkpoint, which the previous membership signed).
    entered_by: Option<EpochCert>,
    /// A certificate seen but not yet checkable: it names a membership this client does
    /// not know (epoch certificates asked for).
    unknown: Option<StableProof>,
    proof: Option<StableProof>,
    transfer: Option<Transfer>,
    /// When unanswered questions are asked again (its period: how long one waits).
    ask: Timeout,
    refused: u64,
    /// Take only a state that includes this session's request with at least this
    /// sequence number ([`CheckpointFetch::with_barrier`]).
    barrier: Option<(ClientId, u64)>,
    /// A complete state that did not include the barrier: its chunks seed the next
    /// transfer (most of them recur).
    spent: Option<Chunked>,
}

impl CheckpointFetch {
    /// A fetch by the administrator's session `client`, knowing `membership`.
    /// `retry_ms`: how long an unanswered question waits before it is asked again.
    pub fn new(client: ClientId, membership: Membership, certifiers: Certifiers, retry_ms: u64) -> CheckpointFetch {
        CheckpointFetch {
            client,
            certifiers,
            membership,
            entered_by: None,
            unknown: None,
            proof: None,
            transfer: None,
            ask: Timeout::every(retry_ms.max(1)),
            refused: 0,
            barrier: None,
            spent: None,
        }
    }

    /// Takes only a checkpoint whose state includes request `seq` (or a later one) of
    /// session `client`: an operation the caller had ordered, and was answered, before
    /// it started the fetch, so the backup holds every write acknowledged before that.
    /// A checkpoint from before it is fetched, found short, and passed over.
    pub fn with_barrier(mut self, client: ClientId, seq: u64) -> CheckpointFetch {
        self.barrier = Some((client, seq));
        self
    }

    /// The stable ids of the nodes that hold checkpoints.
    pub fn holders(&self) -> Vec<NodeId> {
        match &self.certifiers {
            Certifiers::Members => self.membership.members.iter().map(|m| NodeId(m.id)).collect(),
            Certifiers::Executors { holders, .. } => holders.clone(),
        }
    }

    /// The membership followed so far.
    pub fn membership(&self) -> &Membership {
        &self.membership
    }

    /// The checkpoint being fetched and (chunks held, chunks in all; 0 in all until
    /// its manifest came).
    pub fn progress(&self) -> Option<(Seq, usize, usize)> {
        let t = self.transfer.as_ref()?;
        let (held, total) = t.progress();
        Some((t.seq(), held, total))
    }

    /// Answers refused so far (bad certificates, manifests or chunks).
    pub fn refused(&self) -> u64 {
        self.refused
    }

    /// Time passed: asks again what went unanswered (at first, every holder for its
    /// newest checkpoint: a request for the manifest of instance 0 is answered with the
    /// node's certificate once it has one).
    pub fn on_tick(&mut self, now: u64) -> Vec<(NodeId, Message)> {
        let mut send = Vec::new();
        if !self.ask.fire(now) {
            return send;
        }
        match &mut self.transfer {
            None => self.to_holders(Message::FetchManifest { seq: Seq(0) }, &mut send),
            Some(t) if t.awaits_manifest() => {
                let seq = t.seq();
                self.to_holders(Message::FetchManifest { seq }, &mut send);
            }
            Some(t) => {
                t.expire(now, self.ask.period_ms());
                self.request_chunks(now, &mut send);
            }
        }
        if self.unknown.is_some() {
            self.to_holders(Message::EpochQuery { client: self.client, epoch: self.membership.epoch }, &mut send);
        }
        send
    }

    /// An answer from node `from` (stable id).
    ///
    /// # Errors
    /// The answer was refused (counted in [`CheckpointFetch::refused`]).
    pub fn on_message(&mut self, now: u64, from: NodeId, msg: Message) -> Result<Vec<(NodeId, Message)>, Refused> {
        let mut send = Vec::new();
        let result = match msg {
            Message::StableCert(proof) => self.on_stable_cert(now, from, proof, &mut send),
            Message::EpochCerts(certs) => self.on_epoch_certs(now, certs, &mut send),
            Message::Manifest { seq, len, chunks } => match &mut self.transfer {
                Some(t) => match t.on_manifest(seq, len, chunks, std::iter::empty()) {
                    Ok(()) => {
                        self.request_chunks(now, &mut send);
                        Ok(())
                    }
                    Err(_) => Err(Refused::Mismatch),
                },
                None => Ok(()),
            },
            Message::Chunk { seq, index, data } => match &mut self.transfer {
                Some(t) => {
                    let taken = t.on_chunk(seq, index, data).map_err(|_| Refused::Mismatch);
                    self.request_chunks(now, &mut send);
                    taken
                }
                None => Ok(()),
            },
            _ => Ok(()),
        };
        if result.is_err() {
            self.refused += 1;
        }
        result.map(|()| send)
    }

    /// The checkpoint, once every chunk is here (the fetch is spent then).
    pub fn finished(&mut self) -> Option<Fetched> {
        if !self.transfer.as_ref().is_some_and(Transfer::complete) {
            return None;
        }
        let state = self.transfer.take()?.into_chunked();
        if let Some((client, seq)) = self.barrier {
            if crate::exec::snapshot_client_seq(&state, client).is_none_or(|s| s < seq) {
                // From before the barrier: wait for a newer certificate (the proof stays,
                // so nothing at or below it is taken again).
                self.spent = Some(state);
                return None;
            }
        }
        let proof = self.proof.take()?;
        Some(Fetched { proof, membership: self.membership.clone(), state, refused: self.refused })
    }

    /// Whether a complete state was passed over for lacking the barrier.
    pub fn passed_over(&self) -> bool {
        self.spent.is_some()
    }

    fn on_stable_cert(
        &mut self,
        now: u64,
        from: NodeId,
        proof: StableProof,
        send: &mut Vec<(NodeId, Message)>,
    ) -> Result<(), Refused> {
        if proof.seq == Seq(0) || self.proof.as_ref().is_some_and(|p| p.seq >= proof.seq) {
            return Ok(());
        }
        match self.certified(&proof) {
            Some(true) => {}
            Some(false) => return Err(Refused::Unproven),
            None => {
                // Names a membership not known here: ask for the epochs in between.
                self.to_holders(Message::EpochQuery { client: self.client, epoch: self.membership.epoch }, send);
                self.unknown = Some(proof);
                return Ok(());
            }
        }
        self.adopt(now, from, proof, send);
        Ok(())
    }

    /// Whether `proof` is signed by the certifiers; None when it names a membership
    /// other than the one followed (it may be a later epoch's).
    fn certified(&self, proof: &StableProof) -> Option<bool> {
        match &self.certifiers {
            Certifiers::Executors { signers, keys, quorum, .. } => {
                let keys = NodeKeys::starting_at(signers.start.0, keys);
                Some(proof.sigs.iter().all(|(n, _)| signers.contains(n)) && proof_signed(&keys, *quorum, proof))
            }
            Certifiers::Members => {
                // The epoch's first checkpoint: proven by the membership before.
                if self.entered_by.as_ref().is_some_and(|c| c.proof == *proof) {
                    return Some(true);
                }
                if proof.membership != self.membership.digest() {
                    return None;
                }
                let quorum = self.membership.quorums().ok()?.order_quorum();
                Some(proof_signed(&NodeKeys::new(&self.membership.keys()), quorum, proof))
            }
        }
    }

    fn on_epoch_certs(
        &mut self,
        now: u64,
        certs: Vec<EpochCert>,
        send: &mut Vec<(NodeId, Message)>,
    ) -> Result<(), Refused> {
        if !matches!(self.certifiers, Certifiers::Members) {
            return Ok(());
        }
        let (at, chain) = follow_certs(&self.membership, certs, None).map_err(|_| Refused::BadEpochCerts)?;
        let Some(last) = chain.last() else { return Ok(()) };
        self.entered_by = Some(last.clone());
        self.membership = at;
        // The newest epoch's first checkpoint is a backup too, if nothing newer came.
        let candidates = [self.unknown.take(), Some(last.proof.clone())];
        for proof in candidates.into_iter().flatten() {
            if self.proof.as_ref().is_some_and(|p| p.seq >= proof.seq) || proof.seq == Seq(0) {
                continue;
            }
            if self.certified(&proof) == Some(true) {
                self.adopt(now, NodeId(0), proof, send);
            }
        }
        Ok(())
    }

    /// Moves the fetch to the certified checkpoint `proof`, keeping what an older one
    /// fetched.
    fn adopt(&mut self, now: u64, from: NodeId, proof: StableProof, send: &mut Vec<(NodeId, Message)>) {
        let previous = self.transfer.take();
        let first = self.holders().iter().position(|h| *h == from).unwrap_or(0);
        let held = self.spent.take().into_iter().collect();
        self.transfer = Some(Transfer::new(proof.seq, proof.root, previous, held, now, first));
        self.to_holders(Message::FetchManifest { seq: proof.seq }, send);
        self.proof = Some(proof);
        self.ask.restart(now);
    }

    fn request_chunks(&mut self, now: u64, send: &mut Vec<(NodeId, Message)>) {
        let holders = self.holders();
        let Some(t) = self.transfer.as_mut() else { return };
        let mut out = Vec::new();
        t.request_chunks(&holders, now, 0, 0, &mut out);
        send.extend(out.into_iter().filter_map(|(peer, m)| match peer {
            Peer::Node(n) => Some((n, m)),
            Peer::Client(_) => None,
        }));
    }

    fn to_holders(&self, msg: Message, send: &mut Vec<(NodeId, Message)>) {
        for h in self.holders() {
            send.push((h, msg.clone()));
        }
    }
}
