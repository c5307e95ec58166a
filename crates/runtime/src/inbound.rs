//! What reaches the protocol task, and in what order (Aardvark §4.2: separate queues for
//! replica and client traffic, fairness among clients).
//!
//! Node messages and client messages wait in separate bounded queues, and the protocol
//! task takes from them in turn, so a flood of client traffic cannot delay agreement and
//! a flooding node cannot starve clients. Each client connection may have at most
//! [`CLIENT_QUEUED_MAX`] frames waiting: a client that sends faster than the node steps
//! waits on its own TCP connection (backpressure), not in front of everybody else's
//! requests. A correct client never comes close: it has one request in flight per
//! session.

use keel_core::message::ClientId;
use keel_core::replica::Input;
use std::sync::Arc;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

/// Frames one client connection may have waiting for the protocol task.
pub const CLIENT_QUEUED_MAX: usize = 256;

pub enum Inbound {
    /// A message for the protocol task (`Input::Checked` when the verify stage vouched
    /// for its signature).
    Input(Input),
    /// A message from the node with stable id `from`, sent in membership epoch `epoch`;
    /// `checked`: the verify stage vouched for its signature (for the index `from` has in
    /// that epoch). The protocol task maps it to the node's index.
    Node {
        from: u32,
        epoch: u64,
        msg: keel_core::message::Message,
        checked: bool,
    },
    ClientUp {
        id: ClientId,
        conn: u64,
        tx: mpsc::Sender<Vec<u8>>,
        /// Notified when the node drops the client (clients.rs).
        close: Arc<tokio::sync::Notify>,
    },
    ClientDown {
        id: ClientId,
        conn: u64,
    },
}

/// An inbound item and, for a client's, its place in that client's quota (given back
/// when the protocol task takes it).
struct Queued {
    ev: Inbound,
    _permit: Option<OwnedSemaphorePermit>,
}

/// The senders: connection tasks and the verify stage hold clones.
#[derive(Clone)]
pub struct InboundTx {
    nodes: mpsc::Sender<Queued>,
    clients: mpsc::Sender<Queued>,
}

/// One client connection's quota of waiting frames.
#[derive(Clone)]
pub struct ClientQuota(Arc<Semaphore>);

impl ClientQuota {
    pub fn new() -> ClientQuota {
        ClientQuota(Arc::new(Semaphore::new(CLIENT_QUEUED_MAX)))
    }
}

impl Default for ClientQuota {
    fn default() -> ClientQuota {
        ClientQuota::new()
    }
}

/// The protocol task's end.
pub struct InboundRx {
    nodes: mpsc::Receiver<Queued>,
    clients: mpsc::Receiver<Queued>,
    /// Which class goes first next time: they alternate.
    clients_first: bool,
}

/// Two queues of `capacity` items each.
pub fn channel(capacity: usize) -> (InboundTx, InboundRx) {
    let (ntx, nrx) = mpsc::channel(capacity);
    let (ctx, crx) = mpsc::channel(capacity);
    (InboundTx { nodes: ntx, clients: ctx }, InboundRx { nodes: nrx, clients: crx, clients_first: false })
}

impl InboundTx {
    /// From a node (or the verify stage). False once the protocol task is gone.
    pub async fn node(&self, ev: Inbound) -> bool {
        self.nodes.send(Queued { ev, _permit: None }).await.is_ok()
    }

    /// As [`InboundTx::node`], from a plain thread.
    pub fn blocking_node(&self, ev: Inbound) -> bool {
        self.nodes.blocking_send(Queued { ev, _permit: None }).is_ok()
    }

    /// From a client connection: waits while the connection has its quota of frames
    /// queued. False once the protocol task is gone.
    pub async fn client(&self, quota: &ClientQuota, ev: Inbound) -> bool {
        let Ok(permit) = quota.0.clone().acquire_owned().await else { return false };
        self.clients.send(Queued { ev, _permit: Some(permit) }).await.is_ok()
    }
}

impl InboundRx {
    /// The next item, taking node and client traffic in turn. None once every sender is
    /// gone.
    pub async fn recv(&mut self) -> Option<Inbound> {
        self.clients_first = !self.clients_first;
        let q = if self.clients_first {
            tokio::select! {
                biased;
                Some(q) = self.clients.recv() => q,
                Some(q) = self.nodes.recv() => q,
                else => return None,
            }
        } else {
            tokio::select! {
                biased;
                Some(q) = self.nodes.recv() => q,
                Some(q) = self.clients.recv() => q,
                else => return None,
            }
        };
        Some(q.ev)
    }

    /// An item ready now, taking node and client traffic in turn.
    pub fn try_recv(&mut self) -> Option<Inbound> {
        self.clients_first = !self.clients_first;
        let (first, second) = if self.clients_first {
            (&mut self.clients, &mut self.nodes)
        } else {
            (&mut self.nodes, &mut self.clients)
        };
        first.try_recv().or_else(|_| second.try_recv()).ok().map(|q| q.ev)
    }

    /// Items waiting.
    pub fn len(&self) -> usize {
        self.nodes.len() + self.clients.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_core::ids::NodeId;
    use keel_core::ids::View;
    use keel_core::message::Message;
    use keel_core::replica::Peer;

    fn from_client(c: ClientId) -> Inbound {
        Inbound::Input(Input::Message { from: Peer::Client(c), msg: Message::Stop { view: View(0) } })
    }

    fn sender(ev: &Inbound) -> Option<Peer> {
        match ev {
            Inbound::Input(Input::Message { from, .. }) => Some(*from),
            _ => None,
        }
    }

    #[tokio::test]
    async fn a_flooding_client_waits_on_its_quota_and_nodes_alternate_with_clients() {
        let (tx, mut rx) = channel(100_000);
        // Client 1 tries to queue 10,000 frames; it gets its quota in and then waits.
        let flooder = {
            let tx = tx.clone();
            tokio::spawn(async move {
                let quota = ClientQuota::new();
                for _ in 0..10_000 {
                    if !tx.client(&quota, from_client(ClientId(1))).await {
                        return;
                    }
                }
            })
        };
        while rx.len() < CLIENT_QUEUED_MAX {
            tokio::task::yield_now().await;
        }
        tokio::task::yield_now().await;
        assert_eq!(rx.len(), CLIENT_QUEUED_MAX, "the flood stops at the connection's quota");
        // Another client and a node each send one frame: both are taken long before the
        // flood drains.
        assert!(tx.client(&ClientQuota::new(), from_client(ClientId(2))).await);
        assert!(
            tx.node(Inbound::Input(Input::Message {
                from: Peer::Node(NodeId(3)),
                msg: Message::Stop { view: View(0) }
            }))
            .await
        );
        let mut seen = Vec::new();
        while seen.len() < 2 * CLIENT_QUEUED_MAX {
            match rx.recv().await.as_ref().and_then(sender) {
                Some(p) => seen.push(p),
                None => break,
            }
        }
        let at = |p: Peer| seen.iter().position(|s| *s == p).expect("taken");
        assert!(
            at(Peer::Node(NodeId(3))) <= 1,
            "node traffic does not queue behind clients: {}",
            at(Peer::Node(NodeId(3)))
        );
        assert!(
            at(Peer::Client(ClientId(2))) <= CLIENT_QUEUED_MAX + 2,
            "behind at most one quota of the flood: {}",
            at(Peer::Client(ClientId(2)))
        );
        flooder.abort();
    }
}
