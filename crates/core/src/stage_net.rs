//! A lossless in-memory network of order nodes and stage nodes apart (RQ or execution
//! nodes), for the stage nodes' unit tests (`rq_node.rs`, `exec_node.rs`; the
//! simulator adds faults). Nodes are named as the network names them: order nodes by
//! their stable ids, which are their indices in epoch 0, stage nodes by their own ids
//! after them; a core names a stage node by its stage name (`config::stage_node`), so
//! both directions are translated here. Persistence is instant.

use crate::config::{stage_id, stage_node};
use crate::ids::NodeRange;
use crate::message::{ClientId, Message, NodeId, Proposed, Reply};
use crate::node::Node;
use crate::replica::Replica;
use crate::service::Service;
use crate::step::{Event, Input, Outputs, Peer};
use std::collections::VecDeque;

pub(crate) struct StageNet<S, N> {
    pub(crate) order: Vec<Replica<S>>,
    pub(crate) stage: Vec<N>,
    /// Down nodes (by stable id) take no steps; what is sent to them is lost.
    pub(crate) down: Vec<bool>,
    pub(crate) queue: VecDeque<(Peer, Peer, Message)>,
    pub(crate) replies: Vec<(NodeId, Reply)>,
    pub(crate) events: Vec<(NodeId, Event)>,
    /// Every message delivered to a node, as (from, to, kind).
    pub(crate) seen: Vec<(Peer, NodeId, &'static str)>,
    /// The requests of every PROPOSE delivered, as proposed.
    pub(crate) proposed: Vec<Proposed>,
}

impl<S: Service, N: Node> StageNet<S, N> {
    pub(crate) fn of(order: Vec<Replica<S>>, stage: Vec<N>) -> StageNet<S, N> {
        let all = order.len() + stage.len();
        StageNet {
            order,
            stage,
            down: vec![false; all],
            queue: VecDeque::new(),
            replies: Vec::new(),
            events: Vec::new(),
            seen: Vec::new(),
            proposed: Vec::new(),
        }
    }

    /// Steps node `n` (stable id) unless it is down, and queues what it sent.
    pub(crate) fn step(&mut self, n: NodeId, now: u64, input: Input) {
        if self.down[n.0 as usize] {
            return;
        }
        let mut out = Outputs::default();
        match n.0 as usize {
            i if i < self.order.len() => self.order[i].step(now, input, &mut out),
            i => self.stage[i - self.order.len()].step(now, input, &mut out),
        }
        for (to, m) in out.send.into_iter().chain(out.send_after_persist) {
            let to = match to {
                Peer::Node(t) => Peer::Node(NodeId(stage_id(t).unwrap_or(t.0))),
                client => client,
            };
            self.queue.push_back((Peer::Node(n), to, m));
        }
        self.events.extend(out.events.into_iter().map(|e| (n, e)));
    }

    /// Delivers everything queued, and what that sends, until the network is quiet.
    pub(crate) fn run(&mut self, now: u64) {
        while let Some((from, to, msg)) = self.queue.pop_front() {
            match to {
                Peer::Node(n) => {
                    self.seen.push((from, n, msg.kind()));
                    if let Message::Propose { value, .. } = &msg {
                        self.proposed.extend(value.requests.iter().cloned());
                    }
                    let from = match from {
                        Peer::Node(f) if f.0 as usize >= self.order.len() => Peer::Node(stage_node(f.0)),
                        other => other,
                    };
                    self.step(n, now, Input::Message { from, msg });
                }
                Peer::Client(_) => {
                    if let (Peer::Node(n), Message::Reply(r)) = (from, msg) {
                        self.replies.push((n, r));
                    }
                }
            }
        }
    }

    /// Ticks every node at `now`, then runs the network.
    pub(crate) fn tick(&mut self, now: u64) {
        for n in NodeRange::first(self.down.len()) {
            self.step(NodeId(n.0), now, Input::Tick);
        }
        self.run(now);
    }

    /// Client `from`'s messages to the nodes, then runs the network.
    pub(crate) fn send(&mut self, from: ClientId, msgs: Vec<(NodeId, Message)>, now: u64) {
        for (n, m) in msgs {
            self.queue.push_back((Peer::Client(from), Peer::Node(n), m));
        }
        self.run(now);
    }
}
