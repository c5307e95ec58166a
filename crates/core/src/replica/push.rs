//! Push events (UpRight §3.1, ARCHITECTURE §7): what a service sends a client without
//! being asked, such as a watch notification.
//!
//! ```text
//!   execution ──► PushEvent(client, n, bytes), n numbered per client in decided order
//!             ──► queue (bounded) ──Push──► client, once the decision is durable
//!   every retransmit_ms: the first unacknowledged events of each queue again
//!   client ──PushAck(upto)──► node drops the events up to it
//! ```
//!
//! The channel is unreliable by design: with no bound on how long a client stays away,
//! a node cannot keep everything for it. Queues are bounded per client and in total, a
//! full queue drops its oldest event (counted, `Event::PushDropped`), and a restarted
//! node has lost its queues. The client takes event n once r + 1 nodes sent the same
//! bytes and reports the numbers nobody delivered as a gap (client.rs), which is what a
//! watcher needs to re-read the state it watches.

use super::{Event, Outputs, Peer, Reject, Replica};
use crate::exec::PushEvent;
use crate::message::{ClientId, Message};
use crate::service::Service;
use std::collections::{BTreeMap, VecDeque};

/// Events kept for one client.
pub const PUSH_EVENTS_PER_CLIENT_MAX: usize = 1024;
/// Events kept for all clients together.
pub const PUSH_EVENTS_MAX: usize = 65_536;
/// Bytes of events kept for all clients together.
pub const PUSH_BYTES_MAX: usize = 64 << 20;
/// Events of one client resent per retransmission period (the oldest first).
const RESEND_PER_CLIENT: usize = 64;

/// The push events a node keeps until their clients acknowledge them; order nodes
/// (co-located) and execution nodes (exec_node.rs) each have one.
#[derive(Default)]
pub(crate) struct PushQueues {
    queues: BTreeMap<ClientId, VecDeque<(u64, Vec<u8>)>>,
    events: usize,
    bytes: usize,
}

impl PushQueues {
    pub(crate) fn events(&self) -> usize {
        self.events
    }

    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Queues what one executed request pushed and adds its messages to `send` (the
    /// caller decides whether they wait for persistence), tagged with the sender's
    /// membership `epoch`, reporting drops in `events`.
    pub(crate) fn push(
        &mut self,
        pushed: &[PushEvent],
        epoch: u64,
        send: &mut Vec<(Peer, Message)>,
        events: &mut Vec<Event>,
    ) {
        for e in pushed {
            let dropped = self.keep(e);
            if dropped > 0 {
                events.push(Event::PushDropped { client: e.client, count: dropped });
            }
            let msg = Message::Push { client: e.client, seq: e.seq, epoch, event: e.event.clone() };
            send.push((Peer::Client(e.client), msg));
        }
    }

    /// The oldest unacknowledged events of every client, again, tagged with the epoch
    /// the sender runs now.
    pub(crate) fn resend(&self, epoch: u64, send: &mut Vec<(Peer, Message)>) {
        for (&client, q) in &self.queues {
            for (seq, event) in q.iter().take(RESEND_PER_CLIENT) {
                let msg = Message::Push { client, seq: *seq, epoch, event: event.clone() };
                send.push((Peer::Client(client), msg));
            }
        }
    }

    /// Keeps `e` for resending, dropping this client's oldest events to stay within the
    /// bounds (or `e` itself, if the client has none and the total is full). Returns how
    /// many events were dropped.
    fn keep(&mut self, e: &PushEvent) -> u64 {
        let q = self.queues.entry(e.client).or_default();
        let mut dropped = 0;
        let full = |events: usize, bytes: usize| events >= PUSH_EVENTS_MAX || bytes + e.event.len() > PUSH_BYTES_MAX;
        while q.len() >= PUSH_EVENTS_PER_CLIENT_MAX || (full(self.events, self.bytes) && !q.is_empty()) {
            if let Some((_, old)) = q.pop_front() {
                self.events -= 1;
                self.bytes -= old.len();
                dropped += 1;
            }
        }
        if full(self.events, self.bytes) {
            if q.is_empty() {
                self.queues.remove(&e.client);
            }
            return dropped + 1;
        }
        q.push_back((e.seq, e.event.clone()));
        self.events += 1;
        self.bytes += e.event.len();
        dropped
    }

    pub(crate) fn ack(&mut self, client: ClientId, upto: u64) {
        let Some(q) = self.queues.get_mut(&client) else {
            return;
        };
        while q.front().is_some_and(|(seq, _)| *seq <= upto) {
            if let Some((_, old)) = q.pop_front() {
                self.events -= 1;
                self.bytes -= old.len();
            }
        }
        if q.is_empty() {
            self.queues.remove(&client);
        }
    }
}

impl<S: Service> Replica<S> {
    /// Queues and sends what one executed request pushed; sent once the decision is
    /// durable, like the reply.
    pub(super) fn push_events(&mut self, events: &[PushEvent], out: &mut Outputs) {
        self.pushes.push(events, self.epoch(), &mut out.send_after_persist, &mut out.events);
    }

    /// A client acknowledges its events up to `upto`.
    pub(super) fn on_push_ack(&mut self, from: Peer, client: ClientId, upto: u64) -> Result<(), Reject> {
        self.check_session(from, client)?;
        self.pushes.ack(client, upto);
        Ok(())
    }

    /// Resends the oldest unacknowledged events of every client. Gated like the first
    /// send: an event is queued when its request executes, possibly before that decision
    /// is durable, and a node that crashed then could number a different event alike
    /// (the simulator caught it at u = r = 0, seed 68).
    pub(super) fn resend_pushes(&self, out: &mut Outputs) {
        self.pushes.resend(self.epoch(), &mut out.send_after_persist);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(client: ClientId, seq: u64, len: usize) -> PushEvent {
        PushEvent { client, seq, event: vec![7; len] }
    }

    #[test]
    fn a_full_queue_drops_its_oldest_events_and_acks_free_them() {
        let mut q = PushQueues::default();
        let mut dropped = 0;
        for seq in 1..=PUSH_EVENTS_PER_CLIENT_MAX as u64 + 5 {
            dropped += q.keep(&event(ClientId(1), seq, 10));
        }
        assert_eq!(dropped, 5);
        assert_eq!(q.events(), PUSH_EVENTS_PER_CLIENT_MAX);
        assert_eq!(q.queues[&ClientId(1)].front().map(|(s, _)| *s), Some(6), "the oldest went first");
        q.ack(ClientId(1), 100);
        assert_eq!(q.events(), PUSH_EVENTS_PER_CLIENT_MAX + 5 - 100);
        assert_eq!(q.bytes(), q.events() * 10);
        q.ack(ClientId(1), u64::MAX);
        assert_eq!((q.events(), q.bytes()), (0, 0));
        assert!(q.queues.is_empty(), "no empty queue is kept");
    }

    #[test]
    fn the_total_bound_holds_across_clients() {
        let mut q = PushQueues::default();
        let big = PUSH_BYTES_MAX / 4 + 1;
        for c in 0..3 {
            assert_eq!(q.keep(&event(ClientId(c), 1, big)), 0);
        }
        // Three fit; the fourth had nothing of its own to drop, so it was refused.
        assert_eq!(q.keep(&event(ClientId(3), 1, big)), 1);
        assert_eq!(q.events(), 3);
        assert!(!q.queues.contains_key(&ClientId(3)));
        assert!(q.bytes() <= PUSH_BYTES_MAX);
        // A client with events gives up its own oldest to make room.
        assert_eq!(q.keep(&event(ClientId(0), 2, big)), 1);
        assert_eq!(q.events(), 3);
    }
}
