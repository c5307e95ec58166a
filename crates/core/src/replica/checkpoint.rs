//! Checkpoints: every CP_INTERVAL instances a node snapshots its state, persists it, and
//! sends a signed vote for its Merkle root. Q matching votes make it stable: the log below
//! is garbage-collected and the signatures become the proof that view changes and state
//! transfer carry. A node whose own root differs from the stable one has diverged (a disk
//! or memory fault, or a bug): it says so and repairs itself by state transfer.

use super::{CheckpointJob, CheckpointReady, Event, Outputs, Persist, Reject, Replica};
use crate::crypto::Digest;
use crate::exec::Chunked;
use crate::ids::MemberIndex;
use crate::message::{checkpoint_statement, CheckpointVote, Message, Seq, StableProof};
use crate::service::Service;
use crate::wal::Record;

/// Checkpoints a node may have out for serialization at once; execution waits at the
/// next checkpoint instance past that.
pub(super) const PENDING_CHECKPOINTS_MAX: usize = 2;

impl<S: Service> Replica<S> {
    pub(super) fn take_checkpoint(&mut self, seq: Seq, out: &mut Outputs) {
        let membership = self.exec.membership().digest();
        // An epoch's last checkpoint stays inline: the switch to the next epoch waits for
        // it, and it is rare.
        if self.cfg.options.background_checkpoints && !self.epoch_ended() {
            if let Some(state) = self.exec.freeze() {
                debug_assert_eq!(state.executed(), seq);
                self.pending_checkpoints.insert(seq, membership);
                out.checkpoints.push(CheckpointJob {
                    seq,
                    epoch: self.epoch(),
                    generation: self.state_generation,
                    state,
                    chunk_bytes: self.cfg.options.chunk_bytes,
                });
                return;
            }
        }
        let chunked = Chunked::from_pieces(self.exec.pieces(), self.cfg.options.chunk_bytes);
        self.checkpoint_taken(seq, membership, chunked, out);
    }

    pub(super) fn on_checkpoint_ready(&mut self, ready: CheckpointReady, out: &mut Outputs) {
        // Frozen in another epoch or from a state since replaced: not this node's state.
        if ready.epoch != self.epoch() || ready.generation != self.state_generation {
            return;
        }
        // Pending ones below the stable checkpoint were dropped when it was installed.
        let Some(membership) = self.pending_checkpoints.remove(&ready.seq) else {
            return;
        };
        let chunked = if self.cfg.quorums.mutation() == Some(crate::quorum::Mutation::UnfrozenCheckpoint) {
            Chunked::from_pieces(self.exec.pieces(), self.cfg.options.chunk_bytes)
        } else {
            ready.chunked
        };
        self.checkpoint_taken(ready.seq, membership, chunked, out);
        // Execution may have waited for this one (PENDING_CHECKPOINTS_MAX).
        self.maybe_execute(out);
    }

    /// Persists our checkpoint at `seq` and votes for it (the vote waits for the
    /// snapshot to be durable).
    fn checkpoint_taken(&mut self, seq: Seq, membership: Digest, chunked: Chunked, out: &mut Outputs) {
        let root = chunked.root;
        out.persist.push(Persist::Snapshot { seq, chunked: chunked.clone() });
        out.events.push(Event::Checkpoint { seq, root });
        let sig = self.secrets.signing.sign(&checkpoint_statement(seq, &root, &membership, self.signer_name()));
        if self.exec_certified(seq) {
            self.broadcast_durable(Message::Checkpoint(CheckpointVote { seq, root, membership, sig }), out);
        }
        if seq > self.stable.seq {
            self.own_checkpoints.insert(seq, chunked);
            self.checkpoint_votes.entry(seq).or_default().insert(self.id, (root, membership, sig));
            self.maybe_stable(seq, out);
        } else if seq == self.stable.seq {
            // Re-executed up to a checkpoint already proven stable (recovery): compare.
            self.compare_with_stable(chunked, out);
        }
    }

    pub(super) fn on_checkpoint(
        &mut self,
        from: MemberIndex,
        vote: CheckpointVote,
        checked: bool,
        out: &mut Outputs,
    ) -> Result<(), Reject> {
        let interval = self.cfg.options.checkpoint_interval;
        // Votes far above our window still matter (they reveal that we lag), but only on
        // interval boundaries and within a bounded horizon.
        let horizon = self.stable.seq + 4 * self.cfg.options.log_max();
        if vote.seq <= self.stable.seq {
            return Err(Reject::Late { seq: vote.seq, stable: self.stable.seq });
        }
        let epoch_end = self.epoch_end() == Some(vote.seq);
        if vote.seq > horizon || !(vote.seq.is_multiple_of(interval) || epoch_end) {
            return Err(Reject::OutOfWindow { seq: vote.seq, low: self.stable.seq, high: horizon });
        }
        if !checked && !super::verify::checkpoint_signed(&self.keys, super::signer_name(from), &vote) {
            return Err(Reject::BadSignature { signer: super::signer_name(from) });
        }
        self.checkpoint_votes.entry(vote.seq).or_default().entry(from).or_insert((
            vote.root,
            vote.membership,
            vote.sig,
        ));
        self.maybe_stable(vote.seq, out);
        Ok(())
    }

    pub(super) fn maybe_stable(&mut self, seq: Seq, out: &mut Outputs) {
        if !self.exec_certified(seq) {
            // Separated execution: the log above the certified execution checkpoint is
            // what lagging execution nodes are served from (replica/separated.rs).
            return;
        }
        let Some(votes) = self.checkpoint_votes.get(&seq) else {
            return;
        };
        let mut claims: Vec<(Digest, Digest)> = votes.values().map(|(r, m, _)| (*r, *m)).collect();
        claims.sort_unstable();
        claims.dedup();
        for (root, membership) in claims {
            let sigs: Vec<_> = votes
                .iter()
                .filter(|(_, (r, m, _))| (*r, *m) == (root, membership))
                .map(|(&n, (_, _, s))| (super::signer_name(n), *s))
                .collect();
            if sigs.len() >= self.quorum() {
                self.install_stable(StableProof { seq, root, membership, sigs }, out);
                return;
            }
        }
    }

    /// Adopts a proven stable checkpoint: garbage-collects below it, and brings this
    /// node's state to it if it lags or diverged.
    pub(super) fn install_stable(&mut self, proof: StableProof, out: &mut Outputs) {
        if proof.seq <= self.stable.seq {
            return;
        }
        // Slightly behind with every value in hand (the usual case when a peer's STATUS
        // answer races our own execution): execute instead of transferring state.
        let executed = self.exec.executed();
        if self.transfer.is_none()
            && executed < proof.seq
            && executed.next().through(proof.seq).all(|s| self.log.get(&s).is_some_and(|x| x.decided_value.is_some()))
        {
            self.maybe_execute(out);
            if proof.seq <= self.stable.seq {
                return;
            }
        }
        let seq = proof.seq;
        // Ours at `seq`, if still being serialized, is compared when it is done; ours
        // below it are moot (the driver may skip them, and execution need not wait).
        let waited = self.pending_checkpoints.len() >= PENDING_CHECKPOINTS_MAX;
        self.pending_checkpoints = self.pending_checkpoints.split_off(&seq);
        out.events.push(Event::Stable { seq, root: proof.root });
        self.stable = proof;
        self.persist(Record::Stable(self.stable.clone()), out);
        self.log = self.log.split_off(&(seq + 1));
        self.awaiting = self.awaiting.split_off(&(seq + 1));
        self.prune_bodies();
        for answers in &mut self.value_answers {
            *answers = answers.split_off(&(seq + 1));
        }
        self.checkpoint_votes = self.checkpoint_votes.split_off(&(seq + 1));
        let mut own = self.own_checkpoints.split_off(&seq);
        let at_stable = own.remove(&seq);
        let below = std::mem::replace(&mut self.own_checkpoints, own);
        // What a transfer may take chunks from: our last stable state and our newest
        // checkpoint below the new one.
        let held = |stable: Option<Chunked>| stable.into_iter().chain(below.into_values().next_back()).collect();
        self.floor = self.floor.max(seq);
        self.next_propose = self.next_propose.max(seq + 1);
        if self.exec.executed() >= seq {
            match at_stable {
                Some(chunked) => self.compare_with_stable(chunked, out),
                None if self.pending_checkpoints.contains_key(&seq) => {}
                None => {
                    let held = held(self.stable_chunks.take());
                    self.start_transfer(held, out)
                }
            }
        } else {
            // Behind: the values up to `seq` are gone from everyone's log; fetch the state.
            let held = held(self.stable_chunks.take());
            self.start_transfer(held, out);
        }
        // The snapshot at `seq` is durable (ours, persisted before our vote), will be
        // (ours, still being serialized) or will be replaced by the transferred one. The
        // log below `seq` is not needed: Q nodes hold the state at `seq` durably, and a
        // node that crashes before its own snapshot is written fetches it from them.
        out.persist.push(Persist::Compact { records: self.durable_records(), snapshots_from: seq });
        if waited && self.pending_checkpoints.len() < PENDING_CHECKPOINTS_MAX {
            self.maybe_execute(out);
        }
    }

    /// Checkpoint votes can be lost, and a checkpoint that never becomes stable closes the
    /// window for good (no view change can fix that): resend ours until it is stable.
    pub(super) fn retransmit_checkpoint_votes(&self, out: &mut Outputs) {
        for (&seq, votes) in &self.checkpoint_votes {
            if !self.exec_certified(seq) {
                // Separated: not before execution is certified there (separated.rs).
                continue;
            }
            if let Some((root, membership, sig)) = votes.get(&self.id) {
                let vote = CheckpointVote { seq, root: *root, membership: *membership, sig: *sig };
                // Gated like the first sending: the snapshot written a step ago may not be
                // durable yet, and a vote whose snapshot a crash loses can make a stable
                // checkpoint nobody holds (the simulator's crashes before a sync found it:
                // every node then waited for a state transfer no one could serve).
                self.broadcast_durable(Message::Checkpoint(vote), out);
            }
        }
    }

    fn compare_with_stable(&mut self, chunked: Chunked, out: &mut Outputs) {
        if chunked.root == self.stable.root {
            self.stable_chunks = Some(chunked);
        } else {
            out.events.push(Event::Divergence { seq: self.stable.seq, local: chunked.root, stable: self.stable.root });
            self.stable_chunks = None;
            // Only the diverging chunks need fetching.
            self.start_transfer(vec![chunked], out);
        }
    }
}
