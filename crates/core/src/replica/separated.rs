//! The order node's side of separated execution (UpRight §4.2, ARCHITECTURE §5).
//!
//! ```text
//!   order node ── decided value, in order (commit notice) ──► execution nodes (r + 1 matching)
//!   execution node ── signed checkpoint hash every CP_INTERVAL ──► order nodes
//!   order node: proposes nothing at or past (k + 2)·CP until r + 1 matching hashes for k·CP
//!   lagging execution node ── STATUS ──► order node ── certified checkpoint + commits since
//! ```
//!
//! An order node of a separated cluster runs the order state only (the last request of
//! each client and the membership: UpRight's small order checkpoint), so its own
//! checkpoints and their stability are the order stage's business and never mention
//! the service. Execution nodes cannot agree on their checkpoints among themselves; the
//! order nodes do it for them by refusing to run more than two intervals ahead of the
//! newest execution checkpoint that `r + 1` execution nodes vouch for. That bounds how
//! far execution lags and how many decided values an order node keeps for laggards.

use super::{Outputs, Peer, Reject, Replica};
use crate::crypto::{Digest, NodeKeys, Sig};
use crate::message::{CheckpointVote, Message, NodeId, Seq, StableProof, Value};
use crate::service::Service;
use std::collections::BTreeMap;

/// Decided values an order node keeps for lagging execution nodes, beyond those above
/// the newest certified execution checkpoint (`Options::log_max`) that the gate bounds.
/// Older ones are dropped; an execution node that needs them transfers state instead.
const COMMITS_KEPT_FACTOR: u64 = 2;

/// What an order node knows of the execution stage.
#[derive(Default)]
pub(super) struct ExecStage {
    /// Execution checkpoint votes above `stable.seq`: seq → execution node → (root,
    /// membership, sig). One per node per checkpoint instance; instances at most two
    /// intervals past this node's executed instance.
    votes: BTreeMap<Seq, BTreeMap<NodeId, (Digest, Digest, Sig)>>,
    /// The newest execution checkpoint with `r + 1` matching signed hashes.
    pub(super) stable: Option<StableProof>,
    /// Decided values, in order, for execution nodes that missed them.
    commits: BTreeMap<Seq, Value>,
    /// Per execution node (index from the first execution id): when it was last helped.
    helped_at: Vec<u64>,
    /// Keys of every node id, to check execution nodes' signatures.
    keys: Option<NodeKeys>,
}

impl ExecStage {
    pub(super) fn stable_seq(&self) -> Seq {
        self.stable.as_ref().map_or(0, |p| p.seq)
    }

    pub(super) fn len(&self) -> usize {
        self.commits.len() + self.votes.values().map(BTreeMap::len).sum::<usize>()
    }
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

    /// The gate (UpRight §4.2): instance `seq` may be proposed only once the execution
    /// checkpoint two intervals below it is certified. Always open when co-located.
    pub(super) fn exec_gate_open(&self, seq: Seq) -> bool {
        !self.cfg.separated() || seq <= self.exec_stage.stable_seq() + self.cfg.options.log_max()
    }

    /// After executing instance `seq` of the order state: its value goes to every
    /// execution node, once it is a decision this node can no longer lose.
    pub(super) fn send_commit(&mut self, seq: Seq, value: &Value, out: &mut Outputs) {
        for node in self.cfg.executors() {
            out.send_after_persist.push((Peer::Node(node), Message::Decided { seq, value: value.clone() }));
        }
        self.exec_stage.commits.insert(seq, value.clone());
        let keep = self.cfg.options.log_max() * COMMITS_KEPT_FACTOR;
        while self.exec_stage.commits.len() as u64 > keep {
            self.exec_stage.commits.pop_first();
        }
    }

    /// Messages an execution node may send an order node: its checkpoint votes and its
    /// STATUS. Anything else is the wrong peer.
    pub(super) fn on_exec_message(&mut self, from: NodeId, msg: Message, out: &mut Outputs) -> Result<(), Reject> {
        match msg {
            Message::Checkpoint(vote) => self.on_exec_checkpoint(from, vote, out),
            Message::Status { executed, .. } => {
                self.help_executor(from, executed, out);
                Ok(())
            }
            _ => Err(Reject::WrongPeer),
        }
    }

    fn on_exec_checkpoint(&mut self, from: NodeId, vote: CheckpointVote, out: &mut Outputs) -> Result<(), Reject> {
        let interval = self.cfg.options.checkpoint_interval;
        let stable = self.exec_stage.stable_seq();
        if vote.seq <= stable {
            return Err(Reject::Late { seq: vote.seq, stable });
        }
        // Execution runs behind this node's order state, never ahead of the gate.
        let high = self.exec.executed().max(stable) + self.cfg.options.log_max();
        if !vote.seq.is_multiple_of(interval) || vote.seq > high {
            return Err(Reject::OutOfWindow { seq: vote.seq, low: stable, high });
        }
        let statement = crate::message::checkpoint_statement(vote.seq, &vote.root, &vote.membership, from);
        if self.exec_stage.keys.is_none() {
            self.exec_stage.keys = Some(NodeKeys::new(&self.cfg.all_keys()));
        }
        let keys = self.exec_stage.keys.as_ref().expect("set just above");
        if !keys.verify(from, &statement, &vote.sig) {
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
        // Execution nodes learn which of their checkpoints is certified (to serve it to
        // laggards, or to find they diverged) from the order nodes.
        for node in self.cfg.executors() {
            out.send.push((Peer::Node(node), Message::StableCert(proof.clone())));
        }
        self.exec_stage.stable = Some(proof);
        let seq = vote.seq;
        self.exec_stage.votes.retain(|s, _| *s > seq);
        self.exec_stage.commits.retain(|s, _| *s > seq);
        Ok(())
    }

    /// A lagging execution node (its STATUS says it executed `executed`) gets the newest
    /// certified execution checkpoint if it is behind it, and the commits after what it
    /// executed that this node still keeps (UpRight §4.2, "If an execution node falls
    /// behind").
    fn help_executor(&mut self, from: NodeId, executed: Seq, out: &mut Outputs) {
        let index = (from - self.cfg.executors().start) as usize;
        let n = self.cfg.executors().len();
        if self.exec_stage.helped_at.len() != n {
            self.exec_stage.helped_at = vec![0; n];
        }
        if self.now < self.exec_stage.helped_at[index] + self.cfg.options.status_ms / 2 {
            return;
        }
        let peer = Peer::Node(from);
        let mut helped = false;
        let first_kept = self.exec_stage.commits.keys().next().copied();
        let gap = first_kept.is_none_or(|first| first > executed + 1);
        if let Some(proof) = &self.exec_stage.stable {
            if proof.seq > executed && gap {
                out.send.push((peer, Message::StableCert(proof.clone())));
                helped = true;
            }
        }
        let values = self.cfg.options.catch_up_values_max as usize;
        for (&seq, value) in self.exec_stage.commits.range(executed + 1..).take(values) {
            out.send_after_persist.push((peer, Message::Decided { seq, value: value.clone() }));
            helped = true;
        }
        if helped {
            self.exec_stage.helped_at[index] = self.now;
        }
    }
}
