//! Epochs: how a node leaves one membership and starts the next (BFT-SMaRt §II-C3).
//!
//! ```text
//!   epoch e:   ... instance s executes an admin op ──► membership e+1 (in the state)
//!              no execution, no proposal past s; checkpoint at s (off the interval)
//!              Q_e matching votes, which sign the digest of membership e+1: s stable
//!              ──► Event::EpochEnded, and a durability barrier (Outputs::barrier)
//!   driver:    makes everything of epoch e durable and sends what it gated, then
//!              steps Input::Drained
//!   node:      advance_epoch(): becomes epoch e+1's (same secrets and service, the
//!              index of its stable id in e+1, the snapshot at s as its state, view 0):
//!              Event::EpochStarted, a WAL that starts with the epoch's certificates,
//!              and a second barrier, so that WAL is durable before its next step
//!              (or it retires: Event::Removed)
//!   driver:    follows the new members and keys; Input::Drained once the WAL is durable
//!   epoch e+1: the proof at s is in epoch e's terms: the `previous` membership checks it
//! ```
//!
//! Why this is safe: execution is sequential, so no correct node executes (or replies
//! for) an instance above s in epoch e; instances above s that epoch e decided anyway are
//! forgotten with it, and their clients retransmit into e+1, where the reply cache keeps
//! execution exactly-once. Every correct node ends epoch e with the same state at s,
//! because s is a checkpoint made stable by Q_e. Messages carry no epoch: the driver keeps
//! epochs apart (it tags what a node sends with the node's epoch) and passes across
//! epochs only what certifies itself (`EpochCerts`).
//!
//! A node that missed the end of its epoch (down, partitioned, or slow) cannot finish it
//! from peers that moved on, so peers answer its STATUS with their **epoch certificates**
//! (the driver asks [`Replica::epoch_certs_after`]): per epoch, the stable proof of its
//! last checkpoint and the membership that proof signs. The laggard checks each against
//! the membership it already trusts and jumps to the newest epoch as a **joiner**: a node
//! that holds no state (`has_base` false) takes no part in ordering until it installed a
//! stable checkpoint of the new epoch, which peers offer it as they offer any laggard. A
//! node the admin adds starts the same way, with the membership from the admin's reply.

use super::{Event, Outputs, Persist, Replica};
use crate::codec::EPOCH_CERTS_MAX;
use crate::message::{EpochCert, Seq};
use crate::service::Service;

impl<S: Service> Replica<S> {
    /// Whether the executed state already belongs to a later epoch than this node runs.
    pub fn epoch_ended(&self) -> bool {
        self.exec.membership().epoch > self.cfg.membership.epoch
    }

    /// The last instance of this epoch, once execution reached it.
    pub(super) fn epoch_end(&self) -> Option<Seq> {
        self.epoch_ended().then(|| self.exec.membership().since)
    }

    /// A node that joined in this epoch holds no state until it installs a stable
    /// checkpoint of the epoch; it takes no part in ordering before that.
    pub(super) fn has_base(&self) -> bool {
        self.stable.seq >= self.cfg.membership.since
    }

    /// Whether this node is jumping epochs on certificates (the test network counts
    /// jumps as the epoch ends).
    #[cfg(test)]
    pub(crate) fn jumped(&self) -> bool {
        self.jump.is_some()
    }

    /// The certificates a node of `epoch` needs to reach this node's epoch.
    pub fn epoch_certs_after(&self, epoch: u64) -> Vec<EpochCert> {
        crate::epoch_cert::certs_after(&self.epoch_certs, epoch)
    }

    /// Reports, once, that this epoch is over for this node: the checkpoint at its last
    /// instance is stable and is this node's state.
    pub(super) fn check_epoch_end(&mut self, out: &mut Outputs) {
        let Some(end) = self.epoch_end() else {
            return;
        };
        if self.epoch_reported
            || self.stable.seq != end
            || self.exec.executed() != end
            || self.transfer.is_some()
            || self.stable_chunks.is_none()
        {
            return;
        }
        self.end_epoch(self.exec.membership().epoch, end, out);
    }

    /// Reports the end of this node's epoch and asks for the barrier the next epoch
    /// starts behind: everything the old epoch persisted durable and its gated messages
    /// sent (its votes and replies reflect state the new epoch's log no longer holds).
    fn end_epoch(&mut self, epoch: u64, seq: Seq, out: &mut Outputs) {
        self.epoch_reported = true;
        out.events.push(Event::EpochEnded { epoch, seq });
        self.hold_barrier(out);
    }

    /// Certificates of later epochs ([`crate::epoch_cert::follow_certs`]): valid ones
    /// make this node leave its epoch, to join the newest as a node without state.
    pub(super) fn on_epoch_certs(&mut self, certs: Vec<EpochCert>, out: &mut Outputs) -> Result<(), super::Reject> {
        let (at, chain) = crate::epoch_cert::follow_certs(&self.cfg.membership, certs, self.cfg.quorums.mutation())
            .map_err(|_| super::Reject::BadProof("epoch certificates do not follow this node's membership"))?;
        if chain.is_empty() || self.epoch_reported {
            return Ok(());
        }
        // A node that executed this epoch to its end (it recovered, or its checkpoint
        // votes were lost) holds the state the first certificate proves: it ends the
        // epoch normally, with that proof, and keeps its state. Jumping would throw away
        // a copy of the state the next epoch starts from.
        let first = &chain[0].proof;
        if self.epoch_end() == Some(first.seq) && self.exec.executed() == first.seq {
            self.install_stable(first.clone(), out);
            self.check_epoch_end(out);
            if self.epoch_reported {
                return Ok(());
            }
        }
        self.jump = Some(chain);
        self.end_epoch(at.epoch, at.since, out);
        Ok(())
    }

    /// A node the new membership left out stays a while to help its old epoch's members
    /// end the epoch: it resends its checkpoint vote and answers STATUS (with the stable
    /// proof), manifests and chunks, and nothing else. Without it, a member short of one
    /// vote for the last checkpoint (the removed node's, lost) waits forever.
    pub(super) fn retire(&mut self) {
        self.retired = true;
    }

    pub(super) fn step_retired(&mut self, input: super::Input, out: &mut Outputs) {
        use crate::message::Message;
        let (from, msg) = match input {
            super::Input::Tick => {
                if self.retransmit_timeout.fire(self.now) {
                    self.retransmit_checkpoint_votes(out);
                }
                return;
            }
            super::Input::Message { from: from @ super::Peer::Node(_), msg } => (from, msg),
            super::Input::Checked { from, msg } => (super::Peer::Node(from), msg),
            // Its epoch's last checkpoint was taken inline; later ones are moot.
            super::Input::Message { .. } | super::Input::CheckpointReady(_) | super::Input::Drained => return,
        };
        let Some(from) = self.index_of(from).filter(|&i| i != self.id) else {
            return;
        };
        let _ = match msg {
            Message::Status { view, executed, stable } => self.on_status(from, view, executed, stable, out),
            Message::FetchManifest { seq } => self.on_fetch_manifest(self.member(from), seq, out),
            Message::FetchChunk { seq, index } => self.on_fetch_chunk(self.member(from), seq, index, out),
            _ => Ok(()),
        };
    }

    /// The certificate of the epoch this node just started, to every RQ node: they
    /// endorse for its members once they follow it (rq_node.rs).
    pub(super) fn announce_epoch_to_rq_nodes(&mut self, out: &mut Outputs) {
        let certs = self.epoch_certs_after(self.epoch().saturating_sub(1));
        if certs.is_empty() {
            return;
        }
        for rq in self.cfg.endorsers() {
            out.send.push((super::Peer::Node(rq), crate::message::Message::EpochCerts(certs.clone())));
        }
    }

    /// A pending request as the next epoch's node takes it over: with RQ nodes apart,
    /// with the RQ endorsements it was admitted on (order nodes cannot check a client's
    /// MACs then, so the request alone would wait for its client to retransmit).
    fn carry(&self, p: &super::Pending) -> crate::message::Request {
        let mut req = p.req.clone();
        if self.cfg.rq_separated() {
            let endorsements =
                p.endorsers.iter().map(|(&node, macs)| crate::message::Endorsement { node, macs: macs.clone() });
            req.endorsements = endorsements.collect();
        }
        req
    }

    /// Admits the requests carried over from the previous epoch, as if their clients had
    /// sent them again (each is checked again: MAC, session, freshness; with RQ nodes
    /// apart, each RQ endorsement, which stays valid for a node whose index did not move).
    pub(super) fn readmit_carried(&mut self, out: &mut Outputs) {
        for req in std::mem::take(&mut self.carried) {
            if self.cfg.rq_separated() {
                // As if this node relayed them to itself: charged to it.
                let _ = self.on_relayed(self.id, req, out);
                continue;
            }
            // Only what this node can authenticate itself (a request it held on others'
            // endorsements comes back with them, from its client): a failed check would
            // count against an honest client.
            if self.check_mac(&req).is_err() {
                continue;
            }
            let owner = crate::message::owner_of(req.client);
            let _ = self.on_request(super::Peer::Client(owner), req, out);
        }
    }

    /// At the barrier [`Replica::end_epoch`] asked for (everything the old epoch
    /// persisted is durable and its gated messages are sent): the node becomes the next
    /// epoch's, in place. Same secrets, the index its stable id has in the new
    /// membership, view 0, and the same service (its state replaced: see
    /// [`Replica::next_epoch`]). After a normal end its state is the stable checkpoint at
    /// the epoch's last instance; after a jump it holds nothing and fetches the new
    /// epoch's state. Its new log (the WAL replaced by the new epoch's records) goes out
    /// behind a second barrier: the node takes no other step before that log is durable.
    /// Not merely queued: a primary's PROPOSE leaves before its record is durable, and
    /// recovery closes proposals in a view only if the log says the node was in it; a
    /// node that crashed before the new epoch's log was durable would recover in the old
    /// epoch, start the new one afresh and could propose twice in view 0.
    ///
    /// A node the new membership leaves out retires instead ([`Event::Removed`]).
    pub(super) fn advance_epoch(&mut self, out: &mut Outputs) {
        assert!(self.epoch_reported, "advance_epoch before EpochEnded");
        let epoch = match &self.jump {
            Some(chain) => chain.last().expect("a non-empty chain").next.epoch,
            None => self.exec.membership().epoch,
        };
        match self.next_epoch() {
            Some((next, persist, events)) => {
                *self = next;
                out.persist.extend(persist);
                out.events.extend(events);
                out.events.push(Event::EpochStarted { epoch, index: self.id });
                self.hold_barrier(out);
            }
            None => {
                self.retire();
                out.events.push(Event::Removed { epoch });
            }
        }
    }

    /// The node of the next epoch and what it must make durable (see
    /// [`Replica::advance_epoch`]); None if the next membership leaves this node out.
    ///
    /// The service goes on: this node's is handed to the next one, whose executor
    /// restores the stable checkpoint that ended the epoch into it (the state it holds
    /// already, since this node executed up to there). A jumping node restores nothing
    /// yet: the state its service still holds is never read (a node without its
    /// epoch's base executes, checkpoints and answers nothing: `has_base`) and is
    /// replaced by the state transfer that gives it the base. So the core needs no
    /// second, empty service, which would need a factory in every constructor or a
    /// `Service` method every service would have to implement.
    fn next_epoch(&mut self) -> Option<(Replica<S>, Vec<Persist>, Vec<Event>)> {
        let mut certs = self.epoch_certs.clone();
        let (next, base) = match &self.jump {
            Some(chain) => {
                certs.extend(chain.iter().cloned());
                (chain.last().expect("a non-empty chain").next.clone(), None)
            }
            None => {
                let next = self.exec.membership().clone();
                certs.push(EpochCert { proof: self.stable.clone(), next: next.clone() });
                (next, self.stable_chunks.clone())
            }
        };
        if certs.len() > EPOCH_CERTS_MAX {
            certs.drain(..certs.len() - EPOCH_CERTS_MAX);
        }
        let since = next.since;
        // None: the next membership leaves this node out.
        next.index_of(self.stable_id)?;
        let cfg = self.cfg.next_epoch(next).expect("memberships from the executor or certificates have valid quorums");
        let mut r = Replica::new(cfg, self.stable_id, self.secrets.clone(), self.exec.take_service());
        r.now = self.now;
        if self.rejoin.is_some() {
            // Views restart at 0 in the new epoch, and this node may have voted in it
            // before losing its disk: it asks for the new epoch's bounds again.
            r.rejoin = Some(super::rejoin::Rejoin::default());
        }
        r.epoch_certs = certs;
        // Separated execution: how far execution is certified carries over (execution
        // nodes serve that state to laggards, and the new order window starts from it).
        if let Some(proof) = self.exec_stable() {
            r.recover_exec_stable(proof);
        }
        // The stable checkpoint's bytes may have left memory; if they cannot be read
        // back, the node goes on without a base, as a jumping one, and fetches it.
        let mut events = Vec::new();
        let base = base.and_then(|chunks| match chunks.to_bytes() {
            Ok(bytes) => Some((chunks, bytes)),
            Err(e) => {
                let why = format!("the stable checkpoint at {since}, to start the next epoch on: {e}");
                events.push(Event::SnapshotUnreadable { why });
                None
            }
        });
        if let Some((chunks, bytes)) = base {
            match r.exec.restore(&bytes) {
                Ok(executed) if executed == since => {}
                other => panic!("the stable snapshot at {since} does not restore: {other:?}"),
            }
            r.stable = self.stable.clone();
            r.stable_chunks = Some(chunks);
            r.floor = since;
            r.next_propose = since + 1;
        }
        // Requests this node admitted that the old epoch did not execute (proposed past its
        // end, or not proposed): admitted again, so the new primary can order them without
        // waiting for their clients to retransmit.
        if r.has_base() {
            r.carried = self.pending.values().map(|p| self.carry(p)).collect();
        }
        r.announce_epoch = r.cfg.rq_separated();
        // A jumping node keeps no snapshot: all it has is older than the new epoch.
        let snapshots_from = if r.stable_chunks.is_some() { since } else { Seq::MAX };
        let persist = vec![Persist::Compact { records: r.durable_records(), snapshots_from }];
        Some((r, persist, events))
    }
}
