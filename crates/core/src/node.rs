//! What every sans-IO node of Keel is, whatever stages it runs (issue #22): a core that
//! a driver steps ([`Node::step`]), that says where it stands ([`Node::status`]) and that
//! decides itself how a message from another node is admitted ([`Node::admit`]).
//!
//! The three cores: `replica::Replica` (the order stage; co-located, all three stages),
//! `exec_node::ExecNode` (execution apart) and `rq_node::RqNode` (the request quorum
//! apart), each implementing the trait in its own module: the stages depend on this
//! vocabulary, never the other way. The runtime's drivers and the
//! simulator both admit node messages through [`Node::admit`], which decides in which
//! epoch a node's message counts. Every core's inputs and outputs name nodes by stable id
//! (a stage node apart by `config::stage_node` of it); only the order core counts votes
//! by an index (`MemberIndex`), and translates itself where a message comes in and where
//! one goes out (replica/mod.rs `on_message`, `member`).

use crate::config::{stage_node, ClusterConfig};
use crate::ids::{NodeId, Seq, View};
use crate::message::Message;
use crate::step::{Input, Outputs, Peer};

/// Where a node stands: what `/status` and the simulator's reports show.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeStatus {
    /// The view it is in (execution nodes follow none: 0).
    pub view: View,
    /// The view it is changing to, if a view change is under way.
    pub view_change_to: Option<View>,
    pub executed: Seq,
    pub stable: Seq,
    /// (chunks held, chunks in all) while a state transfer runs.
    pub transfer: Option<(usize, usize)>,
    /// Nodes it exchanges messages with (members and stage nodes, not itself).
    pub peers: usize,
}

/// What a driver does with a message another node sent ([`Node::admit`]).
pub enum Admit {
    /// Step the core with it.
    Step(Input),
    /// Do not step: send this answer back to the sender (by its stable id).
    Answer(Message),
    /// Drop it: a node this one does not count now.
    Drop,
}

/// A sans-IO node: the runtime and the simulator drive any of them the same way.
pub trait Node {
    /// Steps one input at `now` (ms of the injected clock).
    fn step(&mut self, now: u64, input: Input, out: &mut Outputs);

    /// The configuration of the membership epoch the node is in.
    fn config(&self) -> &ClusterConfig;

    fn status(&self) -> NodeStatus;

    /// How the message `msg` from node `from` (its stable id, which the transport
    /// authenticated) is admitted, its frame tagged with the sender's epoch `epoch`.
    /// `checked`: the runtime's verify stage already checked its signatures.
    fn admit(&self, from: NodeId, epoch: u64, msg: Message, checked: bool) -> Admit;
}

/// Admission at a node of a stage apart (execution or RQ): other stage nodes by their
/// stage names, order nodes by stable id; a read-index answer counts only from the
/// epoch the node is in (a quorum's index is that epoch's).
pub(crate) fn admit_at_stage_node(cfg: &ClusterConfig, from: NodeId, epoch: u64, msg: Message) -> Admit {
    if is_stage_id(cfg, from) {
        return Admit::Step(Input::Message { from: Peer::Node(stage_node(from.0)), msg });
    }
    if matches!(msg, Message::IndexAck { .. }) && epoch != cfg.epoch() {
        return Admit::Drop;
    }
    Admit::Step(Input::Message { from: Peer::Node(from), msg })
}

/// Whether `id` is an execution or RQ node's stable id.
pub(crate) fn is_stage_id(cfg: &ClusterConfig, id: NodeId) -> bool {
    cfg.exec_ids().contains(&id.0) || cfg.rq_ids().contains(&id.0)
}
