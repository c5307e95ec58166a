//! Clients on a [`TestNet`]: replies kept for tests that drive a `Client` by hand, and
//! client cores the network delivers to itself (they follow epochs by certificates).
//! A client core's messages reach the nodes at once, in the step that produced them, as
//! a client's own connection would carry them.

use super::{Envelope, TestNet};
use crate::client::Client;
use crate::ids::{ClientId, NodeId};
use crate::message::Message;
use crate::node::Node;
use crate::service::Service;
use crate::step::Peer;

impl<S: Service + Default, N: Node> TestNet<S, N> {
    /// A message from node `from` reached client `c`: its core's, if it has one here,
    /// else kept in [`TestNet::replies`] (a reply; nothing else is for a bare client).
    pub(super) fn hand_to_client(&mut self, c: ClientId, from: NodeId, msg: Message) {
        if self.clients.contains_key(&c) {
            self.to_clients.push_back((c, from, msg));
        } else if let Message::Reply(r) = msg {
            self.replies.push((from, c, r));
        }
    }

    pub(super) fn deliver_to_client(&mut self, c: ClientId, from: NodeId, msg: Message, now: u64) {
        let Some(client) = self.clients.get_mut(&c) else { return };
        match msg {
            Message::Reply(r) => {
                let seq = r.seq;
                if let Some(result) = client.on_reply(from, r) {
                    self.completed.insert((c, seq), result);
                }
            }
            Message::EpochCerts(certs) => {
                client.on_epoch_certs(certs);
            }
            _ => {}
        }
        let msgs = client.poll_send();
        self.client_send(c, msgs, now);
    }

    /// Client `c`'s messages (addressed by stable id), each delivered at once.
    pub(crate) fn client_send(&mut self, c: ClientId, msgs: Vec<(NodeId, Message)>, now: u64) {
        for (to, msg) in msgs {
            self.deliver(Envelope { from: Peer::Client(c), epoch: 0, to: Peer::Node(to), msg }, now);
        }
    }

    /// Starts an ordered operation on client core `c`; its sequence number.
    pub(crate) fn invoke(&mut self, c: ClientId, op: Vec<u8>, now: u64) -> u64 {
        let client = self.clients.get_mut(&c).expect("a client core");
        let msgs = client.invoke(now, op).expect("idle");
        let seq = client.inflight_seq().expect("in flight");
        self.client_send(c, msgs, now);
        seq
    }

    /// Ticks every client core (its retransmissions go out at once).
    pub(crate) fn tick_clients(&mut self, now: u64) {
        let cs: Vec<ClientId> = self.clients.keys().copied().collect();
        for c in cs {
            let msgs = self.clients.get_mut(&c).map(|x| x.on_tick(now)).unwrap_or_default();
            self.client_send(c, msgs, now);
        }
    }

    /// `client` (driven by the test) invokes `op`; the network runs until quiet.
    pub(crate) fn submit(&mut self, client: &mut Client, now: u64, op: &[u8]) {
        let msgs = client.invoke(now, op.to_vec()).expect("idle");
        self.send(client.id(), msgs, now);
    }

    /// Hands the replies kept for `client` to it; the result, once it has one.
    pub(crate) fn result(&mut self, client: &mut Client) -> Option<Vec<u8>> {
        let mut result = None;
        for (n, c, r) in std::mem::take(&mut self.replies) {
            if c == client.id() {
                result = result.or(client.on_reply(n, r));
            }
        }
        result
    }
}
