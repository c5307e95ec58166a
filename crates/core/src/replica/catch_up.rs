//! Bringing a lagging node back: STATUS gossip, NEW-VIEW relay, decided values, and state
//! transfer of a stable checkpoint (BFT-SMaRt §II-C2). The state carries no view: a
//! laggard learns the current one from the NEW-VIEW that peers in a higher view relay
//! when its STATUS reports a lower one, and installs it during or after the transfer.
//!
//! A laggard learns nothing on one peer's word: a NEW-VIEW proves itself, a stable
//! checkpoint carries Q signatures, a chunk must match the Merkle root, and a decided value
//! needs r + 1 matching claims (one of them from a correct node).

use super::{Event, Outputs, Peer, Reject, Replica};
use crate::crypto::Digest;
use crate::exec::Chunked;
use crate::ids::MemberIndex;
use crate::message::{Message, NodeId, Seq, StableProof, Value, View};
use crate::service::Service;
use crate::wal::Record;

pub use crate::transfer::Transfer;

impl<S: Service> Replica<S> {
    pub(super) fn on_status(
        &mut self,
        from: MemberIndex,
        view: View,
        executed: Seq,
        stable: Seq,
        out: &mut Outputs,
    ) -> Result<(), Reject> {
        self.peer_executed[from.0 as usize] = executed;
        let gap = self.cfg.options.status_ms / 2;
        if self.now < self.helped_at[from.0 as usize] + gap {
            return Ok(());
        }
        let peer = self.member(from);
        let mut helped = false;
        if view < self.view {
            // A peer in a lower view gets the proof of ours, beside whatever else it needs:
            // catching up by decided values or by state transfer, it ends in our view
            // without another view change. Every view above 0 has its NEW-VIEW here, a
            // restarted node's included (`Record::NewView`).
            if let Some(nv) = &self.new_view {
                // Gated: the primary of that view relays its own NEW-VIEW only once its
                // record of the view is durable (see `view_record_durable`).
                out.send_after_persist.push((peer, Message::NewView(nv.clone())));
                helped = true;
            }
        }
        // A peer behind our stable checkpoint gets its proof: to fetch the state if it
        // executed less, or to make its own checkpoint stable if it lacks votes (say, the
        // last vote it needs was from a node that has since left the membership).
        if self.stable.seq > executed || self.stable.seq > stable {
            out.send.push((peer, Message::StableCert(self.stable.clone())));
            helped = true;
        } else if self.exec.executed() > executed {
            let last = self.exec.executed().min(executed + self.cfg.options.catch_up_values_max);
            for seq in executed.next().through(last) {
                if let Some(value) = self.log.get(&seq).and_then(|s| s.decided_value.clone()) {
                    // Gated: we may vouch only for decisions we can no longer lose.
                    out.send_after_persist.push((peer, Message::Decided { seq, value }));
                    helped = true;
                }
            }
        }
        if helped {
            self.helped_at[from.0 as usize] = self.now;
        }
        Ok(())
    }

    pub(super) fn on_stable_cert(
        &mut self,
        _from: MemberIndex,
        proof: StableProof,
        out: &mut Outputs,
    ) -> Result<(), Reject> {
        if proof.seq <= self.stable.seq {
            return Ok(());
        }
        self.validate_stable_proof(&proof)?;
        self.install_stable(proof, out);
        Ok(())
    }

    pub(super) fn on_decided(
        &mut self,
        from: MemberIndex,
        seq: Seq,
        value: Value,
        out: &mut Outputs,
    ) -> Result<(), Reject> {
        if seq <= self.exec.executed() {
            return Ok(());
        }
        self.in_window(seq)?;
        if value.requests.len() > self.cfg.options.batch_count_max {
            return Err(Reject::BadBatch("too many requests"));
        }
        let digest = value.digest();
        let weak = self.cfg.quorums.weak_quorum();
        let n = self.cfg.n();
        let slot = self.log.entry(seq).or_default();
        match slot.decided {
            Some(d) if d == digest => {
                if slot.decided_value.is_none() {
                    slot.decided_value = Some(value.clone());
                    self.persist(Record::DecidedValue { seq, value }, out);
                    self.maybe_execute(out);
                }
                return Ok(());
            }
            Some(_) => return Err(Reject::BadProof("decided claim contradicts a known decision")),
            None => {}
        }
        slot.claims.insert(from, digest);
        if slot.claimed_values.len() < n {
            slot.claimed_values.entry(digest).or_insert(value);
        }
        // Forget bodies nobody claims any more (a peer may change its claim).
        let claimed: Vec<Digest> = slot.claims.values().copied().collect();
        slot.claimed_values.retain(|d, _| claimed.contains(d));
        if slot.claims.values().filter(|d| **d == digest).count() >= weak {
            if let Some(value) = slot.claimed_values.get(&digest).cloned() {
                self.persist(Record::DecidedValue { seq, value: value.clone() }, out);
                self.decide(seq, digest, Some(value), out);
            }
        }
        Ok(())
    }

    /// Starts (or restarts) fetching the stable checkpoint's state from peers.
    ///
    /// A restart keeps what the previous transfer fetched: peers serve only their newest
    /// stable checkpoint, so a transfer slower than the checkpoints would otherwise start
    /// from zero each time and might never finish. Chunks are content-defined, so most of
    /// them recur in the newer checkpoint (exec.rs `Chunked`).
    pub(super) fn start_transfer(&mut self, held: Vec<Chunked>, out: &mut Outputs) {
        let seq = self.stable.seq;
        if self.transfer.as_ref().is_some_and(|t| t.seq() == seq) {
            return;
        }
        let previous = self.transfer.take();
        let replacing = previous.as_ref().map(|t| t.seq());
        self.transfer = Some(Transfer::new(seq, self.stable.root, previous, held, self.now, self.id.0 as usize));
        out.events.push(Event::StateTransferStarted { seq, replacing });
        self.broadcast(Message::FetchManifest { seq }, out);
    }

    pub(super) fn on_fetch_manifest(&mut self, from: Peer, seq: Seq, out: &mut Outputs) -> Result<(), Reject> {
        if let Some(answer) = crate::transfer::manifest_for(&self.stable, self.stable_chunks.as_ref(), seq) {
            out.send.push((from, answer));
        }
        Ok(())
    }

    pub(super) fn on_fetch_chunk(&mut self, from: Peer, seq: Seq, index: u32, out: &mut Outputs) -> Result<(), Reject> {
        crate::transfer::answer_chunk(&self.stable, self.stable_chunks.as_ref(), seq, index, from, out);
        Ok(())
    }

    pub(super) fn on_manifest(
        &mut self,
        _from: MemberIndex,
        seq: Seq,
        len: u64,
        leaves: Vec<Digest>,
        out: &mut Outputs,
    ) -> Result<(), Reject> {
        let Some(t) = self.transfer.as_mut() else {
            return Ok(());
        };
        t.on_manifest(seq, len, leaves, self.stable_chunks.iter().chain(self.own_checkpoints.values()))?;
        self.request_chunks(out);
        self.maybe_finish_transfer(out);
        Ok(())
    }

    pub(super) fn on_chunk(
        &mut self,
        _from: MemberIndex,
        seq: Seq,
        index: u32,
        data: Vec<u8>,
        out: &mut Outputs,
    ) -> Result<(), Reject> {
        let Some(t) = self.transfer.as_mut() else {
            return Ok(());
        };
        let taken = t.on_chunk(seq, index, data);
        // Asks again (elsewhere) for a chunk that did not match.
        self.request_chunks(out);
        self.maybe_finish_transfer(out);
        taken
    }

    /// Asks peers for missing chunks, within the throttle (transfer.rs).
    pub(super) fn request_chunks(&mut self, out: &mut Outputs) {
        let peers: Vec<NodeId> = self.others().map(|i| self.member_id(i)).collect();
        let (rate, chunk_bytes) = (self.cfg.options.transfer_rate_bytes, self.cfg.options.chunk_bytes as u64);
        if let Some(t) = self.transfer.as_mut() {
            t.request_chunks(&peers, self.now, rate, chunk_bytes, &mut out.send);
        }
    }

    /// Re-asks for the manifest or for chunks a peer did not deliver in time.
    pub(super) fn on_transfer_timeout(&mut self, out: &mut Outputs) {
        let timeout = self.cfg.options.retransmit_ms;
        let now = self.now;
        let Some(t) = self.transfer.as_mut() else {
            return;
        };
        if t.awaits_manifest() {
            let seq = t.seq();
            self.broadcast(Message::FetchManifest { seq }, out);
            return;
        }
        t.expire(now, timeout);
        self.request_chunks(out);
    }

    fn maybe_finish_transfer(&mut self, out: &mut Outputs) {
        if !self.transfer.as_ref().is_some_and(Transfer::complete) {
            return;
        }
        let Some(t) = self.transfer.take() else { return };
        let seq = t.seq();
        // Q nodes signed the root (a correct one among them).
        self.stable_chunks = Some(t.install(&mut self.exec, out));
        self.own_checkpoints = self.own_checkpoints.split_off(&(seq + 1));
        // Checkpoints frozen from the replaced state are void; execution takes them anew.
        self.state_generation += 1;
        self.pending_checkpoints.clear();
        let exec = &self.exec;
        self.pending.retain(|c, p| p.req.seq > exec.last_seq(*c));
        self.maybe_execute(out);
    }
}
