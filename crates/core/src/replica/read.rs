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
//!
//! A read waits here at most until it is answered, replaced by the session's next read,
//! or `request_timeout_ms` passed (its client orders it by then); at most one per
//! session and `clients_max` in all, so a client cannot make a node hold more.

use super::{Outputs, Peer, Reject, Replica};
use crate::message::{ClientId, Message, Read, ReadConsistency, Reply, ReplyBody, Seq};
use crate::quorum::Mutation;
use crate::service::{ReadCtx, Service};

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
}

impl<S: Service> Replica<S> {
    pub(super) fn on_read(&mut self, from: Peer, read: Read, out: &mut Outputs) -> Result<(), Reject> {
        // Reads come from their client only (nodes forward requests, never reads).
        if !matches!(from, Peer::Client(_)) {
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
            ReadConsistency::Serializable => Until::ClientExecuted(read.after),
            ReadConsistency::Linearizable if self.cfg.quorums.mutation() == Some(Mutation::ReadWithoutWait) => {
                Until::Executed(0)
            }
            ReadConsistency::Linearizable => Until::Executed(self.accepted_high()),
        };
        let waiting = WaitingRead { read, until, since: self.now };
        if self.ready_for(waiting.read.client, until) {
            self.answer(waiting.read, out);
        } else {
            self.reads.insert(waiting.read.client, waiting);
        }
        Ok(())
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
        let ctx = ReadCtx { client: read.client, executed: self.exec.executed(), time: self.exec.time() };
        let body = match self.exec.service().execute_read_only(&read.op, &ctx) {
            None => ReplyBody::NotReadOnly,
            Some(result) => self.reply_body(read.client, read.seq, result),
        };
        let reply = Reply { client: read.client, view: self.view, seq: read.seq, body };
        // Gated like an ordered reply: the state may hold instances this node decided
        // with its own vote counted before that vote was durable (with one node, the only
        // vote). Answering first could show a write that a crash then loses. The
        // simulator's single-node sweep caught exactly that.
        out.send_after_persist.push((Peer::Client(read.client), Message::Reply(reply)));
    }
}
