//! Read-only operations waiting for a node's execution to get far enough, and the
//! read-index probe rounds some of them wait for: the bookkeeping order nodes
//! (replica/read.rs) and execution nodes (exec_node.rs) share. Why each wait makes a
//! read's answer right is argued in replica/read.rs.
//!
//! A read waits at most until it is answered, replaced by its session's next read, or
//! `request_timeout_ms` passed (its client orders it by then); at most one per session
//! and `clients_max` in all, so a client cannot make a node hold more.

use crate::message::{ClientId, NodeId, Read, Seq};
use crate::step::Reject;
use std::collections::BTreeMap;

/// What a read waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Until {
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

#[derive(Clone, Debug)]
struct WaitingRead {
    read: Read,
    until: Until,
    since: u64,
}

#[derive(Clone, Debug)]
struct Round {
    id: u64,
    sent_at: u64,
    acks: BTreeMap<NodeId, Seq>,
}

/// Round numbers per millisecond the clock seeding leaves room for.
const ROUNDS_PER_MS: u64 = 1 << 20;

/// The reads waiting at one node and its probe round in flight (at most one).
#[derive(Clone, Debug, Default)]
pub(crate) struct ReadWaits {
    reads: BTreeMap<ClientId, WaitingRead>,
    round: Option<Round>,
    /// No round number below this is used again. Seeded from the clock when a round
    /// starts, so a restarted node does not reuse the number of a round it probed before
    /// the crash (an answer to that older probe could predate the read).
    next_round: u64,
}

impl ReadWaits {
    pub(crate) fn len(&self) -> usize {
        self.reads.len()
    }

    /// Whether `read` is new to this node (not a retransmission of the read its session
    /// has waiting, nor older).
    ///
    /// # Errors
    /// `Busy` when `clients_max` other sessions have reads waiting.
    pub(crate) fn is_new(&self, read: &Read, clients_max: usize) -> Result<bool, Reject> {
        if self.reads.get(&read.client).is_some_and(|w| w.read.seq >= read.seq) {
            return Ok(false);
        }
        if !self.reads.contains_key(&read.client) && self.reads.len() >= clients_max {
            return Err(Reject::Busy("waiting reads"));
        }
        Ok(true)
    }

    /// What a read index waits for: the round in flight has left already (it may
    /// predate the read), so the next one; else a round started now, whose number the
    /// caller probes with. `own`: this node's own answer, when it is a voter.
    pub(crate) fn index_wait(&mut self, now: u64, own: Option<(NodeId, Seq)>) -> (Until, Option<u64>) {
        if self.round.is_some() {
            return (Until::NextRound, None);
        }
        let id = self.start_round(now, own);
        (Until::Round(id), Some(id))
    }

    fn start_round(&mut self, now: u64, own: Option<(NodeId, Seq)>) -> u64 {
        let id = self.next_round.max(now.saturating_mul(ROUNDS_PER_MS));
        self.next_round = id + 1;
        self.round = Some(Round { id, sent_at: now, acks: own.into_iter().collect() });
        id
    }

    /// Makes `read` wait `until`.
    pub(crate) fn wait(&mut self, read: Read, until: Until, now: u64) {
        self.reads.insert(read.client, WaitingRead { read, until, since: now });
    }

    /// Records `from`'s answer to probe `round` (ignored unless that round is in flight).
    pub(crate) fn ack(&mut self, from: NodeId, round: u64, accepted: Seq) {
        if let Some(r) = self.round.as_mut().filter(|r| r.id == round) {
            r.acks.insert(from, accepted);
        }
    }

    /// Completes the round in flight once `quorum` answered (its reads then wait for the
    /// highest answer), and starts the next round if reads wait for it: returns whether
    /// a round completed (reads may be ready) and the numbers of the rounds started, to
    /// probe with.
    pub(crate) fn finish_rounds(&mut self, quorum: usize, now: u64, own: Option<(NodeId, Seq)>) -> (bool, Vec<u64>) {
        let mut started = Vec::new();
        let mut completed = false;
        // With a quorum of one (its own answer) a round completes as it starts.
        while let Some(round) = self.round.as_ref().filter(|r| r.acks.len() >= quorum) {
            let (id, index) = (round.id, round.acks.values().copied().max().unwrap_or(Seq(0)));
            self.round = None;
            completed = true;
            for w in self.reads.values_mut().filter(|w| w.until == Until::Round(id)) {
                w.until = Until::Executed(index);
            }
            if !self.reads.values().any(|w| w.until == Until::NextRound) {
                break;
            }
            let next = self.start_round(now, own);
            for w in self.reads.values_mut().filter(|w| w.until == Until::NextRound) {
                w.until = Until::Round(next);
            }
            started.push(next);
        }
        (completed, started)
    }

    /// The round in flight, if it is short of its quorum after `every` ms: its number and
    /// the nodes that answered (the others are asked again). Dropped once no read waits
    /// for it any more.
    pub(crate) fn round_to_resend(&mut self, now: u64, every: u64) -> Option<(u64, Vec<NodeId>)> {
        let id = self.round.as_ref()?.id;
        if !self.reads.values().any(|w| w.until == Until::Round(id) || w.until == Until::NextRound) {
            self.round = None;
            return None;
        }
        let round = self.round.as_mut().filter(|r| now >= r.sent_at + every)?;
        round.sent_at = now;
        Some((id, round.acks.keys().copied().collect()))
    }

    /// Takes the reads whose wait is over by `ready`.
    pub(crate) fn take_ready(&mut self, ready: impl Fn(ClientId, Until) -> bool) -> Vec<Read> {
        if self.reads.is_empty() {
            return Vec::new();
        }
        let clients: Vec<ClientId> = self.reads.iter().filter(|(c, w)| ready(**c, w.until)).map(|(c, _)| *c).collect();
        clients.into_iter().filter_map(|c| self.reads.remove(&c)).map(|w| w.read).collect()
    }

    /// Drops reads that waited `timeout` ms: their clients have ordered them by now.
    pub(crate) fn expire(&mut self, now: u64, timeout: u64) {
        self.reads.retain(|_, w| now < w.since + timeout);
    }
}
