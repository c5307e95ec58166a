//! The one lossless in-memory network of the core's unit tests (issue #22): order nodes
//! (`Replica`s) and, optionally, stage nodes apart (RQ or execution nodes, any [`Node`]),
//! across membership epochs. The simulator (`crates/sim`) adds faults; this network
//! loses nothing unless a test takes a node down or cuts it off.
//!
//! Routing is the simulator's and the runtime's: every node is reached by its stable id,
//! and a message is admitted through the recipient's [`Node::admit`] with the sender's
//! stable id and epoch, so stage names, membership indices and epochs are translated by
//! the cores' own code, not here. What a core sends names its peers as it counts them (an
//! order node by its index in the sender's epoch, a stage node by its stage name; stage
//! nodes name order nodes by stable id): [`TestNet::absorb`] turns that into stable ids
//! at once, while the sender's epoch is known.
//!
//! Fault model: none. Persistence is instant (`send_after_persist` leaves with `send`);
//! background checkpoints run once the queue is empty, unless held back
//! ([`TestNet::jobs_held`]). An order node whose epoch ended starts the next one (or
//! leaves, if removed) right after the step, as the drivers do.
//!
//! Instrumentation ([`TestNet::instrumented`]) records each step's persistence (for
//! [`TestNet::durable`] and [`TestNet::restart_with`]), bytes per message kind and the
//! signed statements sent; off, the network only moves messages.

mod clients;
mod nodes;
mod persistence;

pub(crate) use nodes::Nodes;
pub(crate) use persistence::StepRecord;

use crate::client::Client;
use crate::config::stage_id;
use crate::ids::{ClientId, NodeId, Seq};
use crate::message::{Message, Proposed, Reply};
use crate::node::{Admit, Node, NodeStatus};
use crate::replica::{CheckpointJob, Durable, NodeSecrets, Replica};
use crate::service::Service;
use crate::step::{Event, Input, Outputs, Peer, Persist};
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// Deliveries one [`TestNet::deliver_all`] may make before it must be quiet: more is a
/// message storm (nodes answering each other forever), a bug to report, not to wait out.
pub(crate) const DELIVERIES_MAX: usize = 100_000;

/// A message on its way, addressed by stable ids.
struct Envelope {
    from: Peer,
    /// The sender's membership epoch when it sent it (0 from clients).
    epoch: u64,
    to: Peer,
    msg: Message,
}

pub(crate) struct TestNet<S, N = NoStage> {
    /// Order nodes by stable id. A node its epoch removed leaves; tests insert joiners.
    pub(crate) nodes: Nodes<Replica<S>>,
    /// Stage nodes apart (RQ or execution nodes) by stable id.
    pub(crate) stage: Nodes<N>,
    /// Down nodes take no steps (no ticks either); what reaches them is lost.
    pub(crate) down: BTreeSet<NodeId>,
    /// Cut-off nodes still tick, but messages between them and other nodes are lost, and
    /// so are client cores' messages to them.
    pub(crate) cut: BTreeSet<NodeId>,
    queue: VecDeque<Envelope>,
    /// Replies to clients without a client core here: (sender stable id, client, reply).
    pub(crate) replies: Vec<(NodeId, ClientId, Reply)>,
    /// Every event, with the stable id of the node that raised it.
    pub(crate) events: Vec<(NodeId, Event)>,
    /// Every message that reached a node (down or not), as (from, to, kind).
    pub(crate) seen: Vec<(Peer, NodeId, &'static str)>,
    /// The requests of every PROPOSE that reached a node, as proposed.
    pub(crate) proposed: Vec<Proposed>,
    /// Background checkpoints to run once the queue is empty.
    pub(crate) jobs: VecDeque<(NodeId, CheckpointJob)>,
    /// Nodes whose background checkpoints are held back for now ([`TestNet::release`]).
    pub(crate) jobs_held: BTreeSet<NodeId>,
    /// Nodes an epoch change removed, in order.
    pub(crate) removed: Vec<NodeId>,
    /// Nodes that jumped epochs on certificates, once per jump.
    pub(crate) jumps: Vec<NodeId>,
    /// The highest instance any node decided, per epoch.
    pub(crate) decided: BTreeMap<u64, Seq>,
    /// Client cores the network delivers to ([`TestNet::add_client`]).
    pub(crate) clients: BTreeMap<ClientId, Client>,
    /// Messages on their way to client cores: (client, sender stable id, message). Delivered
    /// once the node queue is empty.
    to_clients: VecDeque<(ClientId, NodeId, Message)>,
    /// What the client cores completed: (client, seq) → result.
    pub(crate) completed: BTreeMap<(ClientId, u64), Vec<u8>>,
    /// Whether the fields below are kept.
    instrumented: bool,
    /// What each step asked to persist.
    pub(crate) steps: Vec<StepRecord>,
    /// The largest encoded VIEW-CHANGE or NEW-VIEW sent.
    pub(crate) view_change_bytes: usize,
    /// Encoded bytes sent, by sender stable id and message kind.
    pub(crate) sent_bytes: BTreeMap<(NodeId, &'static str), usize>,
    /// Every signed statement sent (NEW-VIEW, VIEW-CHANGE, WRITE) with its sender's stable
    /// id and epoch: what a Byzantine member could replay later.
    pub(crate) signed: Vec<(NodeId, u64, Message)>,
}

impl<S: Service + Default, N: Node> TestNet<S, N> {
    /// Order nodes with stable ids 0..n (epoch 0's indices), then stage nodes with the
    /// stable ids after them (how `keel init` numbers a cluster).
    pub(crate) fn of(order: Vec<Replica<S>>, stage: Vec<N>) -> TestNet<S, N> {
        let n = order.len() as u32;
        TestNet {
            nodes: Nodes::new((0..).map(NodeId).zip(order)),
            stage: Nodes::new((n..).map(NodeId).zip(stage)),
            down: BTreeSet::new(),
            cut: BTreeSet::new(),
            queue: VecDeque::new(),
            replies: Vec::new(),
            events: Vec::new(),
            seen: Vec::new(),
            proposed: Vec::new(),
            jobs: VecDeque::new(),
            jobs_held: BTreeSet::new(),
            removed: Vec::new(),
            jumps: Vec::new(),
            decided: BTreeMap::new(),
            clients: BTreeMap::new(),
            to_clients: VecDeque::new(),
            completed: BTreeMap::new(),
            instrumented: false,
            steps: Vec::new(),
            view_change_bytes: 0,
            sent_bytes: BTreeMap::new(),
            signed: Vec::new(),
        }
    }

    /// Keeps the per-step records, byte counts and signed statements from now on.
    pub(crate) fn instrumented(mut self) -> TestNet<S, N> {
        self.instrumented = true;
        self
    }

    /// The membership epoch node `id` runs (0 for a node not here).
    fn epoch_of(&self, id: NodeId) -> u64 {
        match (self.nodes.get(&id), self.stage.get(&id)) {
            (Some(r), _) => r.epoch(),
            (None, Some(s)) => s.config().epoch(),
            (None, None) => 0,
        }
    }

    /// Steps node `id` unless it is down, and routes what it sent.
    pub(crate) fn step(&mut self, id: NodeId, now: u64, input: Input) {
        if !self.down.contains(&id) {
            self.step_node(id, now, input);
        }
    }

    /// Steps node `id`, down or not (a checkpoint the test releases), if it is here.
    fn step_node(&mut self, id: NodeId, now: u64, input: Input) {
        let mut out = Outputs::default();
        if let Some(r) = self.nodes.get_mut(&id) {
            r.step(now, input, &mut out);
        } else if let Some(s) = self.stage.get_mut(&id) {
            s.step(now, input, &mut out);
        } else {
            return;
        }
        self.absorb(id, out);
    }

    /// Takes what node `id` (stable id) output in a step: queues its messages by stable
    /// id, keeps its events and checkpoint jobs, and starts its next epoch if this one
    /// ended. Tests that step a node by hand hand its outputs here.
    pub(crate) fn absorb(&mut self, id: NodeId, out: Outputs) {
        let epoch = self.epoch_of(id);
        if self.instrumented {
            self.steps.push(StepRecord::of(id, &out));
        }
        for (to, msg) in out.send.into_iter().chain(out.send_after_persist) {
            if self.instrumented {
                self.measure(id, epoch, &msg);
            }
            // Every core names nodes by stable id, a stage node apart by its stage name.
            let to = match to {
                Peer::Node(name) => Peer::Node(stage_id(name).map_or(name, NodeId)),
                client => client,
            };
            self.queue.push_back(Envelope { from: Peer::Node(id), epoch, to, msg });
        }
        let (mut ended, barrier) = (false, out.barrier);
        for e in &out.events {
            match e {
                Event::Decided { seq, .. } => {
                    let top = self.decided.entry(epoch).or_default();
                    *top = (*top).max(*seq);
                }
                Event::EpochEnded { .. } => ended = true,
                _ => {}
            }
        }
        self.events.extend(out.events.into_iter().map(|e| (id, e)));
        self.jobs.extend(out.checkpoints.into_iter().map(|j| (id, j)));
        if ended && self.nodes.contains_key(&id) {
            assert!(barrier, "an epoch ends behind a durability barrier");
            self.next_epoch(id);
        }
    }

    fn measure(&mut self, id: NodeId, epoch: u64, msg: &Message) {
        let bytes = crate::codec::encode(msg).len();
        if matches!(msg, Message::ViewChange(_) | Message::NewView(_)) {
            self.view_change_bytes = self.view_change_bytes.max(bytes);
        }
        *self.sent_bytes.entry((id, msg.kind())).or_default() += bytes;
        if matches!(msg, Message::NewView(_) | Message::ViewChange(_) | Message::Write(_)) {
            self.signed.push((id, epoch, msg.clone()));
        }
    }

    /// Order node `id`'s epoch ended behind a durability barrier: this net's persistence
    /// is instant, so the barrier is passed at once (`Input::Drained`), and the node
    /// starts the next epoch, or leaves if removed. Its new log comes behind a second
    /// barrier, passed the same way before the node takes any other step. (Time never
    /// goes back in a replica: the 0 given with `Drained` leaves its clock as it was.)
    fn next_epoch(&mut self, id: NodeId) {
        let Some(node) = self.nodes.get_mut(&id) else { return };
        if node.jumped() {
            self.jumps.push(id);
        }
        let mut out = Outputs::default();
        node.step(0, Input::Drained, &mut out);
        if out.events.iter().any(|e| matches!(e, Event::Removed { .. })) {
            self.nodes.remove(&id);
            self.removed.push(id);
            return;
        }
        assert!(matches!(out.persist.as_slice(), [Persist::Compact { .. }]), "{:?}", out.persist);
        assert!(out.barrier, "the new epoch's log is durable before its first step");
        if self.instrumented {
            self.steps.push(StepRecord::epoch_switch(id, std::mem::take(&mut out.persist)));
        }
        let mut after = Outputs::default();
        node.step(0, Input::Drained, &mut after);
        assert!(after.is_empty(), "nothing but the barrier's end at the second Drained: {after:?}");
    }

    /// Queues `msg` from `from` (a node's stable id, tagged with its epoch, or a client)
    /// to node `to`; [`TestNet::run`] delivers it.
    pub(crate) fn post(&mut self, from: Peer, to: NodeId, msg: Message) {
        let epoch = match from {
            Peer::Node(f) => self.epoch_of(f),
            Peer::Client(_) => 0,
        };
        self.queue.push_back(Envelope { from, epoch, to: Peer::Node(to), msg });
    }

    /// Client `from`'s messages to nodes (by stable id), then runs the network.
    pub(crate) fn send(&mut self, from: ClientId, msgs: Vec<(NodeId, Message)>, now: u64) {
        for (to, msg) in msgs {
            self.post(Peer::Client(from), to, msg);
        }
        self.run(now);
    }

    /// Hands one message to its recipient as the drivers do: a node's through the
    /// recipient's `admit` (which may step it, answer for it or drop it), a client's as it
    /// is.
    fn deliver(&mut self, envelope: Envelope, now: u64) {
        let Envelope { from, epoch, to, msg } = envelope;
        let to = match (to, from) {
            (Peer::Node(to), _) => to,
            (Peer::Client(c), Peer::Node(from)) => return self.hand_to_client(c, from, msg),
            (Peer::Client(_), Peer::Client(_)) => return,
        };
        self.seen.push((from, to, msg.kind()));
        if let Message::Propose { value, .. } = &msg {
            self.proposed.extend(value.requests.iter().cloned());
        }
        if self.down.contains(&to) || self.cut.contains(&to) {
            return;
        }
        let input = match from {
            Peer::Client(_) => Input::Message { from, msg },
            Peer::Node(f) if self.cut.contains(&f) => return,
            Peer::Node(f) => match self.admit(to, f, epoch, msg) {
                Some(Admit::Step(input)) => input,
                Some(Admit::Answer(answer)) => {
                    let epoch = self.epoch_of(to);
                    self.queue.push_back(Envelope { from: Peer::Node(to), epoch, to: Peer::Node(f), msg: answer });
                    return;
                }
                Some(Admit::Drop) | None => return,
            },
        };
        self.step(to, now, input);
    }

    /// How node `to` admits `msg` from node `from` of epoch `epoch` (None: not here).
    /// Unchecked: only the runtime's verify stage checks signatures ahead of the core.
    fn admit(&self, to: NodeId, from: NodeId, epoch: u64, msg: Message) -> Option<Admit> {
        match (self.nodes.get(&to), self.stage.get(&to)) {
            (Some(r), _) => Some(r.admit(from, epoch, msg, false)),
            (None, Some(s)) => Some(s.admit(from, epoch, msg, false)),
            (None, None) => None,
        }
    }

    /// Delivers every queued message (to nodes first, then to client cores, whose answers
    /// go out at once) until the network is quiet.
    pub(crate) fn deliver_all(&mut self, now: u64) {
        for _ in 0..DELIVERIES_MAX {
            if let Some(envelope) = self.queue.pop_front() {
                self.deliver(envelope, now);
            } else if let Some((c, from, msg)) = self.to_clients.pop_front() {
                self.deliver_to_client(c, from, msg, now);
            } else {
                return;
            }
        }
        panic!("message storm: {DELIVERIES_MAX} deliveries and the network is not quiet");
    }

    /// Delivers everything, then the checkpoints not held back, until quiet.
    pub(crate) fn run(&mut self, now: u64) {
        loop {
            self.deliver_all(now);
            let Some(i) = self.jobs.iter().position(|(n, _)| !self.jobs_held.contains(n)) else { return };
            let Some((n, job)) = self.jobs.remove(i) else { return };
            self.step_node(n, now, Input::CheckpointReady(job.run()));
        }
    }

    /// Runs node `n`'s first held checkpoint at `seq`, then delivers what follows.
    pub(crate) fn release(&mut self, n: NodeId, seq: Seq, now: u64) {
        let i = self.jobs.iter().position(|(m, j)| *m == n && j.seq() == seq).expect("a held checkpoint");
        let Some((_, job)) = self.jobs.remove(i) else { return };
        self.step_node(n, now, Input::CheckpointReady(job.run()));
        self.run(now);
    }

    /// Ticks every node that is up (order nodes, then stage nodes), without delivering.
    pub(crate) fn tick_nodes(&mut self, now: u64) {
        let ids: Vec<NodeId> = self.nodes.keys().chain(self.stage.keys()).copied().collect();
        for id in ids {
            self.step(id, now, Input::Tick);
        }
    }

    /// Ticks every node that is up, then runs the network.
    pub(crate) fn tick(&mut self, now: u64) {
        self.tick_nodes(now);
        self.run(now);
    }

    /// What order node `n` holds on disk (an instrumented network only).
    pub(crate) fn durable(&self, n: NodeId) -> Durable {
        assert!(self.instrumented, "only an instrumented network keeps what steps persisted");
        persistence::durable(&self.steps, n)
    }

    /// Crashes order node `n` (its memory and the messages on their way to it are lost)
    /// and restarts it from [`TestNet::durable`] with `secrets` and an empty `service`.
    pub(crate) fn restart_with(&mut self, n: NodeId, secrets: NodeSecrets, service: S, now: u64) {
        let cfg = self.nodes[&n].config().clone();
        self.queue.retain(|e| e.to != Peer::Node(n));
        let durable = self.durable(n);
        let mut out = Outputs::default();
        let node =
            Replica::recover(cfg, n, secrets, service, durable, now, &mut out).expect("recovers from its own disk");
        self.nodes.insert(n, node);
        self.absorb(n, out);
    }
}

/// The stage of a network of order nodes only: there is no such node.
pub(crate) enum NoStage {}

impl Node for NoStage {
    fn step(&mut self, _: u64, _: Input, _: &mut Outputs) {
        match *self {}
    }
    fn config(&self) -> &crate::config::ClusterConfig {
        match *self {}
    }
    fn status(&self) -> NodeStatus {
        match *self {}
    }
    fn admit(&self, _: NodeId, _: u64, _: Message, _: bool) -> Admit {
        match *self {}
    }
}
