//! Persistence bookkeeping of a [`super::TestNet`]: what each step asked to persist, and
//! what a node finds on its disk when it restarts. The harness syncs at once, so all a
//! step asked for is durable before its `send_after_persist` messages leave.

use crate::ids::NodeId;
use crate::message::Message;
use crate::replica::{Durable, Outputs, Persist};
use crate::step::Event;
use crate::wal::Record;

/// What one step of an order node asked to persist (kept by an instrumented network).
pub(crate) struct StepRecord {
    /// The node's stable id.
    pub(crate) node: NodeId,
    /// Whether the step decided an instance.
    pub(crate) decided: bool,
    pub(crate) persist: Vec<Persist>,
    pub(crate) lazy: Vec<Record>,
    /// Replies the step sent (all of them wait for its records).
    pub(crate) replies: usize,
}

impl StepRecord {
    pub(crate) fn of(node: NodeId, out: &Outputs) -> StepRecord {
        StepRecord {
            node,
            decided: out.events.iter().any(|e| matches!(e, Event::Decided { .. })),
            persist: out.persist.clone(),
            lazy: out.persist_lazy.clone(),
            replies: out.send_after_persist.iter().filter(|(_, m)| matches!(m, Message::Reply(_))).count(),
        }
    }

    /// What the driver persists when the node starts its next epoch (not a step).
    pub(crate) fn epoch_switch(node: NodeId, persist: Vec<Persist>) -> StepRecord {
        StepRecord { node, decided: false, persist, lazy: Vec::new(), replies: 0 }
    }
}

/// What node `n` holds on disk after `steps`: every record and snapshot they asked to
/// persist, as compactions left it.
pub(crate) fn durable(steps: &[StepRecord], n: NodeId) -> Durable {
    let mut d = Durable::default();
    for s in steps.iter().filter(|s| s.node == n) {
        for p in &s.persist {
            match p {
                Persist::Record(r) => d.records.push(r.clone()),
                Persist::Snapshot { seq, chunked } => d.snapshots.push((*seq, chunked.clone())),
                Persist::Compact { records, snapshots_from } => {
                    d.records = records.clone();
                    d.snapshots.retain(|(seq, _)| seq >= snapshots_from);
                }
            }
        }
        d.records.extend(s.lazy.iter().cloned());
    }
    d
}
