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
//! A read waits here at most until it is answered, replaced by the session's next read,
//! or `request_timeout_ms` passed (its client orders it by then); at most one per
//! session and `clients_max` in all, so a client cannot make a node hold more.

use super::{Outputs, Peer, Reject, Replica};
use crate::message::{ClientId, Message, NodeId, Read, ReadConsistency, Reply, ReplyBody, Seq};
use crate::quorum::Mutation;
use crate::service::{ReadCtx, Service};
use std::collections::BTreeMap;

/// A read waiting for this node's execution to get far enough.
#[derive(Clone, Debug)]
pub(super) struct WaitingRead {
    read: Read,
    until: Until,
    since: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Until {
    /// The session's ordered request with this number has executed.
    ClientExecuted(u64),
    /// Execution reached this instance.
    Executed(Seq),
    /// The index probe round with this number has its quorum (then `Executed(index)`).
    Round(u64),
    /// The round after the one in flight, which leaves when that one completes (a round
    /// must leave after the reads it serves arrived).
    NextRound,
}

/// Read-index probe rounds at this node: at most one in flight.
#[derive(Clone, Debug, Default)]
pub(super) struct IndexRounds {
    current: Option<Round>,
    /// No round number below this is used again. Seeded from the clock when a round
    /// starts, so a restarted node does not reuse the number of a round it probed before
    /// the crash (an answer to that older probe could predate the read).
    next: u64,
}

#[derive(Clone, Debug)]
struct Round {
    id: u64,
    sent_at: u64,
    acks: BTreeMap<NodeId, Seq>,
}

/// Round numbers per millisecond the clock seeding leaves room for.
const ROUNDS_PER_MS: u64 = 1 << 20;

impl<S: Service> Replica<S> {
    pub(super) fn on_read(&mut self, from: Peer, read: Read, out: &mut Outputs) -> Result<(), Reject> {
        // Reads come from their client only (nodes forward requests, never reads).
        // With separated execution this node holds no service state: reads go to the
        // execution nodes.
        if !matches!(from, Peer::Client(_)) || self.cfg.separated() {
            return Err(Reject::WrongPeer);
        }
        self.check_session(from, read.client)?;
        self.check_authenticator(read.client, &read.statement(), &read.auth)?;
        if self.reads.get(&read.client).is_some_and(|w| w.read.seq >= read.seq) {
            // A retransmission of the read already waiting (or an older one): it is
            // answered when ready.
            return Ok(());
        }
        if !self.reads.contains_key(&read.client) && self.reads.len() >= self.cfg.options.clients_max {
            return Err(Reject::Busy("waiting reads"));
        }
        let until = match read.consistency {
            ReadConsistency::Serializable if self.cfg.quorums.mutation() == Some(Mutation::SerializableWithoutWait) => {
                Until::ClientExecuted(0)
            }
            ReadConsistency::Serializable => Until::ClientExecuted(read.after),
            ReadConsistency::Linearizable if self.cfg.quorums.mutation() == Some(Mutation::ReadWithoutWait) => {
                Until::Executed(0)
            }
            ReadConsistency::Linearizable => Until::Executed(self.accepted_high()),
            ReadConsistency::Index if self.index.current.is_some() => Until::NextRound,
            ReadConsistency::Index => Until::Round(self.start_index_round(out)),
        };
        let waiting = WaitingRead { read, until, since: self.now };
        if self.ready_for(waiting.read.client, until) {
            self.answer(waiting.read, out);
        } else {
            self.reads.insert(waiting.read.client, waiting);
        }
        // With an index quorum of one the round completed as it started.
        self.finish_index_round(out);
        Ok(())
    }

    fn start_index_round(&mut self, out: &mut Outputs) -> u64 {
        let id = self.index.next.max(self.now.saturating_mul(ROUNDS_PER_MS));
        self.index.next = id + 1;
        let acks = BTreeMap::from([(self.id, self.accepted_high())]);
        self.index.current = Some(Round { id, sent_at: self.now, acks });
        self.broadcast(Message::IndexProbe { round: id }, out);
        id
    }

    /// A peer asks how far this node voted to accept. Answered at once: what it reports
    /// was made durable before this node sent the ACCEPTs it counts (or is a decision or
    /// checkpoint it holds), and reporting too high costs only a wait.
    pub(super) fn on_index_probe(&mut self, from: NodeId, round: u64, out: &mut Outputs) -> Result<(), Reject> {
        out.send.push((Peer::Node(from), Message::IndexAck { round, accepted: self.accepted_high() }));
        Ok(())
    }

    pub(super) fn on_index_ack(
        &mut self,
        from: NodeId,
        round: u64,
        accepted: Seq,
        out: &mut Outputs,
    ) -> Result<(), Reject> {
        // An answer to a round that completed or was dropped changes nothing.
        if let Some(r) = self.index.current.as_mut().filter(|r| r.id == round) {
            r.acks.insert(from, accepted);
            self.finish_index_round(out);
        }
        Ok(())
    }

    /// Completes the round in flight once a quorum answered: its reads wait for the
    /// highest answer; then starts the next round if reads wait for it.
    fn finish_index_round(&mut self, out: &mut Outputs) {
        let Some(round) = &self.index.current else { return };
        if round.acks.len() < self.cfg.quorums.index_quorum() {
            return;
        }
        let (id, index) = (round.id, round.acks.values().copied().max().unwrap_or(0));
        self.index.current = None;
        for w in self.reads.values_mut() {
            if w.until == Until::Round(id) {
                w.until = Until::Executed(index);
            }
        }
        if self.reads.values().any(|w| w.until == Until::NextRound) {
            let next = self.start_index_round(out);
            for w in self.reads.values_mut().filter(|w| w.until == Until::NextRound) {
                w.until = Until::Round(next);
            }
            self.finish_index_round(out);
        }
        self.answer_reads(out);
    }

    /// Re-sends the probe of a round still short of its quorum to the nodes that did not
    /// answer; drops it once no read waits for it any more.
    pub(super) fn retransmit_index_probe(&mut self, out: &mut Outputs) {
        let Some(id) = self.index.current.as_ref().map(|r| r.id) else { return };
        if !self.reads.values().any(|w| w.until == Until::Round(id) || w.until == Until::NextRound) {
            self.index.current = None;
            return;
        }
        let (now, n, every) = (self.now, self.cfg.n() as NodeId, self.cfg.options.retransmit_ms);
        let Some(round) = self.index.current.as_mut().filter(|r| now >= r.sent_at + every) else { return };
        round.sent_at = now;
        for node in (0..n).filter(|node| !round.acks.contains_key(node)) {
            out.send.push((Peer::Node(node), Message::IndexProbe { round: id }));
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
            .map_or(0, |(seq, _)| *seq);
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
        if self.reads.is_empty() {
            return;
        }
        let ready: Vec<ClientId> = self
            .reads
            .iter()
            .filter(|(client, w)| self.ready_for(**client, w.until))
            .map(|(client, _)| *client)
            .collect();
        for client in ready {
            if let Some(w) = self.reads.remove(&client) {
                self.answer(w.read, out);
            }
        }
    }

    /// Drops reads that waited longer than a request timeout: their clients have ordered
    /// them by now.
    pub(super) fn expire_reads(&mut self) {
        let timeout = self.cfg.options.request_timeout_ms;
        let now = self.now;
        self.reads.retain(|_, w| now < w.since + timeout);
    }

    fn answer(&self, read: Read, out: &mut Outputs) {
        out.events.push(super::Event::ReadAnswered { consistency: read.consistency });
        let ctx = ReadCtx { client: read.client, executed: self.exec.executed(), time: self.exec.time() };
        let body = match self.exec.service().execute_read_only(&read.op, &ctx) {
            None => ReplyBody::NotReadOnly,
            // Only the r + 1 nodes asked answer a read index, all needed: each in full.
            Some(result) if read.consistency == ReadConsistency::Index => ReplyBody::Full(result),
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
