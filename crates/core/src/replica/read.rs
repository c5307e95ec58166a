//! Read-only requests (PBFT's read-only optimisation, UpRight §3.1, ARCHITECTURE §7):
//! executed against this node's state without ordering, answered once the state is far
//! enough along for the consistency the client asked for.
//!
//! - **Serializable**: once this node executed the session's ordered request `after` (the
//!   reader's last write). r + 1 matching answers then come from some prefix of the
//!   decided sequence that includes the reader's writes.
//! - **Linearizable**: once this node executed every instance it had voted to accept
//!   (sent ACCEPT for, or learned decided) when the read arrived. A completed write was
//!   accepted by Q nodes, u + 1 of them correct; any Q answers include one of those, so
//!   Q matching answers reflect every write completed before the read began
//!   ([`crate::quorum::Quorums::read_quorum`]). The state the answer comes from holds
//!   only decided instances, executed and made durable here before the answer left: a
//!   point inside the read.
//! - **Read index** (Gaios; ARCHITECTURE §7): sent to r + 1 nodes only. The node asks
//!   every node how far it voted to accept ([`Message::IndexProbe`]), after the read
//!   arrived; the highest of Q answers (its own included) is the index, and the node
//!   answers once it executed that far. A completed write was accepted by u + 1 correct
//!   nodes, any Q answers include one of them, and that node's votes only grow, so the
//!   index is at or past the write. r + 1 matching answers include a correct node's, so
//!   they reflect it too. One probe round serves every read that arrived before it left.
//!
//!   Raft and Gaios take the index from the leader, after it confirmed with a quorum
//!   that it still leads. With r > 0 a Byzantine primary could name a stale index, so
//!   Keel takes it from the quorum's own votes: the same one round trip, no trust in the
//!   primary, and it works during a view change. A Byzantine node can name an index too
//!   high: the read then waits until its client gives up and orders it (liveness, not
//!   safety; the highest is needed, since the one correct voter may be alone).
//!
//! The waiting itself (one read per session, probe rounds) is crate::read_wait's, shared
//! with execution nodes.

use super::{Outputs, Peer, Reject, Replica};
use crate::ids::MemberIndex;
use crate::message::{ClientId, Message, NodeId, Read, ReadConsistency, Reply, ReplyBody, Seq};
use crate::quorum::Mutation;
use crate::read_wait::Until;
use crate::service::{ReadCtx, Service};

impl<S: Service> Replica<S> {
    pub(super) fn on_read(&mut self, from: Peer, read: Read, out: &mut Outputs) -> Result<(), Reject> {
        // Reads come from their client only (nodes forward requests, never reads).
        // With separated execution this node holds no service state: reads go to the
        // execution nodes (which ask this node for a read index: `on_index_probe`).
        if !matches!(from, Peer::Client(_)) || self.cfg.separated() {
            return Err(Reject::WrongPeer);
        }
        // A node that joined this epoch holds no state of it until it installed the
        // epoch's base: what its service holds (nothing, or the state of the epoch it
        // jumped from: the service goes on across epochs, epoch.rs) answers nothing.
        if !self.has_base() {
            return Err(Reject::Busy("no state of this epoch yet"));
        }
        self.check_session(from, read.client)?;
        self.check_authenticator(read.client, &read.statement(), &read.auth)?;
        if !self.reads.is_new(&read, self.cfg.options.clients_max)? {
            // A retransmission of the read already waiting (or an older one): it is
            // answered when ready.
            return Ok(());
        }
        let until = match read.consistency {
            ReadConsistency::Serializable if self.cfg.quorums.mutation() == Some(Mutation::SerializableWithoutWait) => {
                Until::ClientExecuted(0)
            }
            ReadConsistency::Serializable => Until::ClientExecuted(read.after),
            ReadConsistency::Linearizable if self.cfg.quorums.mutation() == Some(Mutation::ReadWithoutWait) => {
                Until::Executed(Seq(0))
            }
            ReadConsistency::Linearizable => Until::Executed(self.accepted_high()),
            ReadConsistency::Index => {
                let (until, started) = self.reads.index_wait(self.now, Some(self.own_index()));
                if let Some(round) = started {
                    self.broadcast(Message::IndexProbe { round }, out);
                }
                until
            }
        };
        if self.ready_for(read.client, until) {
            self.answer(read, out);
        } else {
            self.reads.wait(read, until, self.now);
        }
        // With an index quorum of one the round completed as it started.
        self.finish_index_round(out);
        Ok(())
    }

    /// This node's own answer to its probe rounds.
    fn own_index(&self) -> (NodeId, Seq) {
        (self.member_id(self.id), self.accepted_high())
    }

    /// A peer asks how far this node voted to accept. Answered at once: what it reports
    /// was made durable before this node sent the ACCEPTs it counts (or is a decision or
    /// checkpoint it holds), and reporting too high costs only a wait.
    pub(super) fn on_index_probe(&mut self, from: Peer, round: u64, out: &mut Outputs) -> Result<(), Reject> {
        out.send.push((from, Message::IndexAck { round, accepted: self.accepted_high() }));
        Ok(())
    }

    pub(super) fn on_index_ack(
        &mut self,
        from: MemberIndex,
        round: u64,
        accepted: Seq,
        out: &mut Outputs,
    ) -> Result<(), Reject> {
        // An answer to a round that completed or was dropped changes nothing.
        self.reads.ack(self.member_id(from), round, accepted);
        self.finish_index_round(out);
        Ok(())
    }

    /// Completes the round in flight once a quorum answered: its reads wait for the
    /// highest answer; then starts the next round if reads wait for it.
    fn finish_index_round(&mut self, out: &mut Outputs) {
        let own = self.own_index();
        let (completed, started) = self.reads.finish_rounds(self.cfg.quorums.index_quorum(), self.now, Some(own));
        for round in started {
            self.broadcast(Message::IndexProbe { round }, out);
        }
        if completed {
            self.answer_reads(out);
        }
    }

    /// Re-sends the probe of a round still short of its quorum to the nodes that did not
    /// answer; drops it once no read waits for it any more.
    pub(super) fn retransmit_index_probe(&mut self, out: &mut Outputs) {
        let Some((round, answered)) = self.reads.round_to_resend(self.now, self.cfg.options.retransmit_ms) else {
            return;
        };
        for i in MemberIndex::all(self.cfg.n()) {
            let node = self.member_id(i);
            if !answered.contains(&node) {
                out.send.push((Peer::Node(node), Message::IndexProbe { round }));
            }
        }
    }

    /// The highest instance this node voted to accept (sending ACCEPT files a
    /// certificate, kept across views) or knows decided, or the stable checkpoint
    /// (everything below it was decided).
    fn accepted_high(&self) -> Seq {
        let voted = self
            .log
            .iter()
            .rev()
            .find(|(_, slot)| slot.cert.is_some() || slot.decided.is_some())
            .map_or(Seq(0), |(seq, _)| *seq);
        voted.max(self.stable.seq).max(self.exec.executed())
    }

    fn ready_for(&self, client: ClientId, until: Until) -> bool {
        if self.transfer.is_some() {
            return false;
        }
        match until {
            Until::ClientExecuted(seq) => self.exec.last_seq(client) >= seq,
            Until::Executed(seq) => self.exec.executed() >= seq,
            Until::Round(_) | Until::NextRound => false,
        }
    }

    /// Answers every waiting read whose condition now holds. Called after execution.
    pub(super) fn answer_reads(&mut self, out: &mut Outputs) {
        let mut reads = std::mem::take(&mut self.reads);
        let ready = reads.take_ready(|client, until| self.ready_for(client, until));
        self.reads = reads;
        for read in ready {
            self.answer(read, out);
        }
    }

    /// Drops reads that waited longer than a request timeout: their clients have ordered
    /// them by now.
    pub(super) fn expire_reads(&mut self) {
        self.reads.expire(self.now, self.cfg.options.request_timeout_ms);
    }

    fn answer(&self, read: Read, out: &mut Outputs) {
        out.events.push(super::Event::ReadAnswered { consistency: read.consistency });
        let ctx = ReadCtx { client: read.client, executed: self.exec.executed(), time: self.exec.time() };
        let body = match self.exec.service().execute_read_only(&read.op, &ctx) {
            None => ReplyBody::NotReadOnly,
            // Only the r + 1 nodes asked answer a read index, all needed: each in full.
            Some(result) if read.consistency == ReadConsistency::Index => crate::codec::reply_body(result, true),
            Some(result) => self.reply_body(read.client, read.seq, result),
        };
        let reply = Reply { client: read.client, view: self.view, seq: read.seq, body, epoch: self.epoch() };
        // Gated like an ordered reply: the state may hold instances this node decided
        // with its own vote counted before that vote was durable (with one node, the only
        // vote). Answering first could show a write that a crash then loses. The
        // simulator's single-node sweep caught exactly that.
        out.send_after_persist.push((Peer::Client(read.client), Message::Reply(reply)));
    }
}
