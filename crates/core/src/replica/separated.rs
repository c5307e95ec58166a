//! The order node's side of separated execution (UpRight §4.2, ARCHITECTURE §5).
//!
//! ```text
//!   order node ── decided value, in order (commit notice) ──► execution nodes (r + 1 matching)
//!   execution node ── signed checkpoint hash every CP_INTERVAL ──► order nodes
//!   order node: votes for its order checkpoint at k·CP only once u + 1 matching hashes
//!               certified execution at or past k·CP, so its window (stable + 2·CP)
//!               never runs more than two intervals past certified execution
//!   lagging execution node ── STATUS ──► order node ── certified checkpoint + commits since
//! ```
//!
//! An order node of a separated cluster runs the order state only (the last request of
//! each client and the membership: UpRight's small order checkpoint), so its own
//! checkpoints never mention the service. Execution nodes cannot agree on their
//! checkpoints among themselves; the order nodes do it for them by refusing to run more
//! than two intervals ahead of the newest execution checkpoint that `u + 1` execution
//! nodes vouch for (one correct among them computed it, and one correct among them stays
//! up to serve it: `Quorums::exec_checkpoint_quorum`). And an order node votes for its order checkpoint (so that it can
//! become stable, its log be collected and lagging order nodes be sent to it) only once
//! the execution checkpoint at or above it is certified (UpRight's garbage-collection
//! rule). A stable order proof then carries `Q` votes, at least one from a correct node
//! that saw execution certified that far, whichever way a node learns it (its own
//! votes, a peer's certificate, a NEW-VIEW): every value a lagging execution node may
//! still need lies above a certified execution checkpoint, in the logs of the order
//! nodes, or it fetches that checkpoint's state from its peers.

use super::{Outputs, Peer, Reject, Replica};
use crate::crypto::{Digest, NodeKeys, Sig};
use crate::message::{CheckpointVote, Message, NodeId, Seq, StableProof, Value};
use crate::service::Service;
use std::collections::BTreeMap;

/// What an order node knows of the execution stage.
pub(super) struct ExecStage {
    /// Execution checkpoint votes above `stable.seq`: seq → execution node → (root,
    /// membership, sig). One per node per checkpoint instance; instances at most two
    /// intervals past this node's executed instance.
    votes: BTreeMap<Seq, BTreeMap<NodeId, (Digest, Digest, Sig)>>,
    /// The newest execution checkpoint with `r + 1` matching signed hashes.
    pub(super) stable: Option<StableProof>,
    /// Per execution node (index from the first execution id): when it was last helped.
    helped_at: Vec<u64>,
    /// The execution nodes' keys, to check their signatures. Apart from the replica's own
    /// (order nodes only), so an execution node's signature can never count toward an
    /// order proof.
    keys: NodeKeys,
}

impl ExecStage {
    pub(super) fn new(cfg: &crate::config::ClusterConfig) -> ExecStage {
        let executors = if cfg.separated() { cfg.executors().len() } else { 0 };
        ExecStage { votes: BTreeMap::new(), stable: None, helped_at: vec![0; executors], keys: cfg.exec_keys() }
    }

    pub(super) fn stable_seq(&self) -> Seq {
        self.stable.as_ref().map_or(Seq(0), |p| p.seq)
    }

    pub(super) fn status(&self) -> String {
        format!(" exec-stable {}", self.stable_seq())
    }

    pub(super) fn len(&self) -> usize {
        self.votes.values().map(BTreeMap::len).sum::<usize>()
    }
}

/// A decided value as execution nodes get it: the requests without their client MACs,
/// endorsements and signatures. Execution nodes take a value on `r + 1` matching commit
/// notices, not on those, and the value's digest does not cover them (it hashes the
/// time and each request's statement), so the notice keeps the digest and loses most of
/// its bytes (with rq-mac, a request's endorsements are `u + r + 1` authenticators of a
/// MAC per node each). Operations are shared, not copied.
fn commit_form(value: &Value) -> Value {
    let requests = value
        .requests
        .iter()
        .map(|r| crate::message::Request {
            client: r.client,
            seq: r.seq,
            op: r.op.clone(),
            auth: Vec::new(),
            endorsements: Vec::new(),
            sig: None,
        })
        .collect();
    Value { time: value.time, requests }
}

/// `proof` carries `quorum` distinct valid signatures of execution nodes only.
pub fn exec_proof_valid(
    cfg: &crate::config::ClusterConfig,
    keys: &NodeKeys,
    quorum: usize,
    proof: &StableProof,
) -> bool {
    let executors = cfg.executors();
    proof.sigs.iter().all(|(node, _)| executors.contains(node)) && crate::message::proof_signed(keys, quorum, proof)
}

impl<S: Service> Replica<S> {
    /// Whether `from` is an execution node of a separated cluster.
    pub(super) fn is_exec_peer(&self, from: NodeId) -> bool {
        self.cfg.separated() && self.cfg.executors().contains(&from)
    }

    // UpRight's gate (§4.2: no ordering past (k + 1)·CP before execution checkpoint k
    // is certified) needs no check of its own here: the order window is the stable
    // order checkpoint plus two intervals, and an order checkpoint becomes stable only
    // with Q votes, each cast after its node saw execution certified that far
    // (`exec_certified`). So ordering never runs more than two intervals past a
    // certified execution checkpoint (one interval looser than the paper's rule, which
    // leaves execution a whole interval to checkpoint in without stalling ordering).

    /// Whether execution nodes checkpoint at `seq`: every interval, and where an epoch
    /// ends (this one's end once executed, or the instance it started after). The order
    /// checkpoint there ends the epoch, and no order node votes for it before execution is
    /// certified that far (`exec_certified`): execution nodes that checkpointed only
    /// every interval would wait for instances the epoch never orders.
    fn exec_checkpoint_at(&self, seq: Seq) -> bool {
        seq.is_multiple_of(self.cfg.options.checkpoint_interval)
            || self.epoch_end() == Some(seq)
            || seq == self.cfg.membership.since
    }

    /// The certified execution checkpoint the next epoch's node starts with: at or past
    /// this epoch's end, since this node voted for the order checkpoint there.
    pub(super) fn exec_stable(&self) -> Option<StableProof> {
        self.exec_stage.stable.clone()
    }

    /// Whether this node may vote for (and install from its own votes) an order
    /// checkpoint at `seq`: when separated, only once execution is certified that far.
    /// Always when co-located.
    pub(super) fn exec_certified(&self, seq: Seq) -> bool {
        !self.cfg.separated() || seq <= self.exec_stage.stable_seq()
    }

    /// After executing instance `seq` of the order state: its value goes to every
    /// execution node, once it is a decision this node can no longer lose.
    pub(super) fn send_commit(&mut self, seq: Seq, value: &Value, out: &mut Outputs) {
        let notice = Message::Decided { seq, value: commit_form(value) };
        for node in self.cfg.executors() {
            out.send_after_persist.push((Peer::Node(node), notice.clone()));
        }
    }

    /// Messages an execution node may send an order node: its checkpoint votes and its
    /// STATUS. Anything else is the wrong peer.
    pub(super) fn on_exec_message(&mut self, from: NodeId, msg: Message, out: &mut Outputs) -> Result<(), Reject> {
        match msg {
            Message::Checkpoint(vote) => self.on_exec_checkpoint(from, vote, out),
            Message::Status { executed, stable, .. } => {
                self.help_executor(from, executed, stable, out);
                Ok(())
            }
            Message::StableCert(proof) => self.on_exec_stable_cert(proof, out),
            // An execution node's read index (exec_node.rs `on_read`).
            Message::IndexProbe { round } => self.on_index_probe(Peer::Node(from), round, out),
            _ => Err(Reject::WrongPeer),
        }
    }

    fn on_exec_checkpoint(&mut self, from: NodeId, vote: CheckpointVote, out: &mut Outputs) -> Result<(), Reject> {
        let stable = self.exec_stage.stable_seq();
        if vote.seq <= stable {
            return Err(Reject::Late { seq: vote.seq, stable });
        }
        // Execution runs behind this node's order state, never past the gate; and a
        // certification far below what this node executed is of no use to it (it
        // caught up by a peer's proof): the votes kept per execution node stay within
        // two windows, whatever a lying execution node sends.
        let log_max = self.cfg.options.log_max();
        let executed = self.exec.executed();
        let (low, high) = (stable.max(executed.saturating_sub(log_max)), executed.max(stable) + log_max);
        if !self.exec_checkpoint_at(vote.seq) || vote.seq <= low || vote.seq > high {
            return Err(Reject::OutOfWindow { seq: vote.seq, low, high });
        }
        self.exec_stage.votes.retain(|s, _| *s > low);
        if self.exec_stage.votes.get(&vote.seq).is_some_and(|v| v.contains_key(&from)) {
            // Its first vote for this instance counts; resends (every retransmission
            // period) cost no signature check.
            return Ok(());
        }
        let statement = crate::message::checkpoint_statement(vote.seq, &vote.root, &vote.membership, from);
        if !self.exec_stage.keys.verify(from.0, &statement, &vote.sig) {
            return Err(Reject::BadSignature { signer: from });
        }
        let votes = self.exec_stage.votes.entry(vote.seq).or_default();
        votes.entry(from).or_insert((vote.root, vote.membership, vote.sig));
        let need = self.cfg.quorums.exec_checkpoint_quorum();
        let mut tally: BTreeMap<(Digest, Digest), Vec<(NodeId, Sig)>> = BTreeMap::new();
        for (node, (root, membership, sig)) in votes.iter() {
            tally.entry((*root, *membership)).or_default().push((*node, *sig));
        }
        let Some(((root, membership), sigs)) = tally.into_iter().find(|(_, s)| s.len() >= need) else {
            return Ok(());
        };
        let proof = StableProof { seq: vote.seq, root, membership, sigs };
        self.adopt_exec_stable(proof.clone(), out);
        // Execution nodes learn which of their checkpoints is certified (to serve it to
        // laggards, or to find they diverged) from the order nodes: once this node's
        // record of it is durable (`adopt_exec_stable`).
        for node in self.cfg.executors() {
            out.send_after_persist.push((Peer::Node(node), Message::StableCert(proof.clone())));
        }
        Ok(())
    }

    /// An execution node passes on the certificate of the newest certified execution
    /// checkpoint (every retransmission period). An order node that missed the votes
    /// (down, or the votes lost while the execution nodes moved on by a state transfer,
    /// which leaves them no vote of their own to resend) learns it so; without it, it
    /// never votes for its order checkpoints again and, once enough order nodes are in
    /// that state, ordering stops at the window's end (the simulator found this at
    /// (2, 1)). `u + 1` execution nodes' signatures make it as good as votes counted here.
    fn on_exec_stable_cert(&mut self, proof: StableProof, out: &mut Outputs) -> Result<(), Reject> {
        if proof.seq <= self.exec_stage.stable_seq() {
            return Ok(());
        }
        if !self.exec_checkpoint_at(proof.seq) {
            return Err(Reject::BadProof("an execution checkpoint off the interval"));
        }
        let quorum = self.cfg.quorums.exec_checkpoint_quorum();
        if !exec_proof_valid(&self.cfg, &self.exec_stage.keys, quorum, &proof) {
            return Err(Reject::BadProof("execution checkpoint certificate"));
        }
        self.adopt_exec_stable(proof, out);
        Ok(())
    }

    /// `proof` certifies an execution checkpoint past the one this node knew: kept (on
    /// disk, before this node tells an execution node of it: an execution node collects
    /// its older snapshots on the certificate, and keeps no record of it itself, so an
    /// order node that forgot it in a crash would point a restarted execution node and
    /// its lagging peers at an older checkpoint nobody holds any more — the simulator
    /// found this at (1, 0) with execution apart, seed 857 of 1000), and this node's order checkpoint votes held back until execution got
    /// that far go out.
    fn adopt_exec_stable(&mut self, proof: StableProof, out: &mut Outputs) {
        self.persist(crate::wal::Record::ExecStable(proof.clone()), out);
        let previous = self.exec_stage.stable_seq();
        let seq = proof.seq;
        self.exec_stage.stable = Some(proof);
        self.exec_stage.votes.retain(|s, _| *s > seq);
        // This node's order checkpoint votes held back until now go out, and order
        // checkpoints up to here may become stable: the newest with a quorum.
        let waiting: Vec<Seq> = self.checkpoint_votes.range(previous + 1..=seq).map(|(s, _)| *s).rev().collect();
        for &s in &waiting {
            if let Some((root, membership, sig)) = self.checkpoint_votes.get(&s).and_then(|v| v.get(&self.id)) {
                let vote = CheckpointVote { seq: s, root: *root, membership: *membership, sig: *sig };
                self.broadcast_durable(Message::Checkpoint(vote), out);
            }
        }
        for s in waiting {
            self.maybe_stable(s, out);
            if self.stable.seq >= s {
                break;
            }
        }
    }

    /// What an order node keeps across a restart for the execution stage: the certified
    /// execution checkpoint, so that after a restart of every node it still knows how far
    /// its log may be collected and which state lagging execution nodes must fetch.
    pub(super) fn exec_records(&self) -> Vec<crate::wal::Record> {
        self.exec_stage.stable.iter().map(|p| crate::wal::Record::ExecStable(p.clone())).collect()
    }

    /// Recovery: an `ExecStable` record.
    pub(super) fn recover_exec_stable(&mut self, proof: StableProof) {
        if proof.seq > self.exec_stage.stable_seq() {
            self.exec_stage.stable = Some(proof);
        }
    }

    /// An execution node whose STATUS says it executed `executed` and knows the certified
    /// checkpoint `stable` gets the newest certified execution checkpoint if it does not
    /// know it, and the commits after what it executed that this node still holds (UpRight §4.2, "If an execution node falls
    /// behind").
    fn help_executor(&mut self, from: NodeId, executed: Seq, stable: Seq, out: &mut Outputs) {
        // `from` is an execution node (`is_exec_peer`): always in range.
        let Some(index) = self.cfg.executors().offset(from) else { return };
        if self.now < self.exec_stage.helped_at[index] + self.cfg.options.status_ms / 2 {
            return;
        }
        let peer = Peer::Node(from);
        let mut helped = false;
        if let Some(proof) = &self.exec_stage.stable {
            // Behind it: to fetch the state if the commits in between are gone, or to
            // keep its snapshot and collect older ones (the certificate sent when it was
            // certified may have been lost).
            if proof.seq > stable {
                // Gated as in `on_exec_checkpoint`: adopted from a peer's certificate in
                // an earlier step, its record may not be durable yet.
                out.send_after_persist.push((peer, Message::StableCert(proof.clone())));
                helped = true;
            }
        }
        // `executed` is the peer's word: never past what this node executed itself.
        let last = self.exec.executed().min(executed.saturating_add(self.cfg.options.catch_up_values_max));
        for seq in executed.saturating_add(1).through(last) {
            // The log holds every decided value above the certified execution checkpoint.
            let value = self.log.get(&seq).and_then(|s| s.decided_value.as_ref());
            let Some(value) = value else { break };
            out.send_after_persist.push((peer, Message::Decided { seq, value: commit_form(value) }));
            helped = true;
        }
        if helped {
            self.exec_stage.helped_at[index] = self.now;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::{ClientId, Endorsement, Request};

    #[test]
    fn a_commit_notice_keeps_the_value_digest_without_the_authenticators() {
        let mut r = Request::new(ClientId(7), 3, b"op".to_vec().into());
        r.auth = vec![[1; 16]; 4];
        r.endorsements = vec![Endorsement { node: NodeId(1), macs: vec![[2; 16]; 4] }; 3];
        r.sig = Some(crate::crypto::Sig([3; 64]));
        let value = Value { time: 9, requests: vec![r] };
        let notice = commit_form(&value);
        assert_eq!(notice.digest(), value.digest());
        let bytes = |v: &Value| crate::codec::encode(&Message::Decided { seq: Seq(1), value: v.clone() }).len();
        assert!(bytes(&notice) * 4 < bytes(&value), "{} vs {} bytes", bytes(&notice), bytes(&value));
        assert!(notice.requests[0].auth.is_empty() && notice.requests[0].endorsements.is_empty());
    }
}
