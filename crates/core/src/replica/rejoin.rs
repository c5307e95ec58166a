//! A node that lost its disk comes back as a *rejoining* node (issue #21, defect 4;
//! UpRight §3.2: nodes may lose volatile state, and a node whose disk was wiped has lost
//! everything it promised).
//!
//! Whatever it voted for before the wipe, others still count: its ACCEPTs and WRITEs sit
//! in their slots, its VIEW-CHANGEs in NEW-VIEWs. Voting again at once could vote twice
//! for one (view, instance) and decide two values (CFT, n = 3: a value decided by {A, W},
//! W wiped, A down: W and B would re-propose null). So a rejoining node casts no vote —
//! no WRITE, ACCEPT, VIEW-CHANGE, NEW-VIEW, PROPOSE, read index or read answer — until
//! both hold:
//!
//! 1. **Every instance it may have voted for is stable.** It asks the others (REJOIN) how
//!    far they executed. Its own last stable checkpoint before the wipe had Q signers;
//!    Q answers from *other* nodes share r + 1 nodes with them, one of them correct,
//!    which executed at least that far: the highest answer `E` is at least the old stable
//!    checkpoint, and a node votes only within `log_max` instances above its stable
//!    checkpoint. Once this node's stable checkpoint reaches `E + log_max`, nothing it
//!    forgot is above it: no view change needs its old certificates.
//! 2. **It acts in no view below one it committed to.** Any view it voted or sent a
//!    VIEW-CHANGE in had Q VIEW-CHANGE senders; by the same intersection some correct
//!    answer reports at least that view (its view or view-change target): it waits for
//!    a view at least the highest answer `V`.
//!
//! A Byzantine answer can only make the bounds higher (the node stays out longer: a
//! liveness cost within `u`, since the wiped node is itself down until it is back); it
//! cannot make them lower than a correct node's. The state of rejoining is durable
//! (`Record::Rejoining`), so a crash while rejoining does not end it.

use super::{Event, Outputs, Reject, Replica};
use crate::ids::MemberIndex;
use crate::message::{Message, NodeId, Seq, View};
use crate::service::Service;
use crate::wal::Record;
use std::collections::BTreeMap;

/// What a rejoining node knows of the bounds it waits for.
#[derive(Clone, Debug, Default)]
pub(super) struct Rejoin {
    /// Answers so far: (view committed to, instances executed), one per other node.
    reports: BTreeMap<MemberIndex, (View, Seq)>,
    /// Once Q others answered: the highest view and executed instance they reported.
    pub(super) bounds: Option<(View, Seq)>,
}

impl Rejoin {
    pub(super) fn with_bounds(bounds: Option<(View, Seq)>) -> Rejoin {
        Rejoin { reports: BTreeMap::new(), bounds }
    }
}

impl<S: Service> Replica<S> {
    /// A node whose data directory is gone (wiped, or a replaced disk) in a cluster that
    /// already ran: it starts empty, like a node restarting with nothing on disk, but casts
    /// no vote until it has caught up past everything it may have voted for (module doc).
    /// The driver persists `out` first: rejoining survives a crash.
    ///
    /// # Errors
    /// Never for an empty state; the signature is [`Replica::recover`]'s.
    pub fn rejoin(
        cfg: crate::config::ClusterConfig,
        id: NodeId,
        secrets: super::NodeSecrets,
        service: S,
        now: u64,
        out: &mut Outputs,
    ) -> Result<Replica<S>, crate::service::RestoreError> {
        if cfg.quorums.mutation() == Some(crate::quorum::Mutation::WipedNodeVotes) {
            // The behaviour before issue #21: an empty node is a new one.
            return Replica::recover(cfg, id, secrets, service, super::Durable::default(), now, out);
        }
        let durable = super::Durable { snapshots: Vec::new(), records: vec![Record::Rejoining { bounds: None }] };
        let r = Replica::recover(cfg, id, secrets, service, durable, now, out)?;
        r.persist(Record::Rejoining { bounds: None }, out);
        r.ask_rejoin(out);
        Ok(r)
    }

    /// Whether this node is rejoining after losing its disk (it casts no votes).
    pub fn rejoining(&self) -> bool {
        self.rejoin.is_some()
    }

    /// The bounds a rejoining node waits for (view, executed), once known.
    pub fn rejoin_bounds(&self) -> Option<(View, Seq)> {
        self.rejoin.as_ref().and_then(|r| r.bounds)
    }

    /// Rejoining: ask every other node how far it got (each retransmission period until
    /// Q answered).
    pub(super) fn ask_rejoin(&self, out: &mut Outputs) {
        if self.rejoin.as_ref().is_some_and(|r| r.bounds.is_none()) {
            self.broadcast(Message::Rejoin, out);
        }
    }

    /// A peer lost its disk: tell it the highest view this node committed to and how far
    /// it executed. A node rejoining itself knows neither and stays silent.
    pub(super) fn on_rejoin(&mut self, from: MemberIndex, out: &mut Outputs) -> Result<(), Reject> {
        if self.rejoin.is_some() {
            return Ok(());
        }
        let committed = self.vc_target.unwrap_or(self.view).max(self.view);
        let executed = self.exec.executed();
        out.send.push((self.member(from), Message::RejoinInfo { committed, executed }));
        Ok(())
    }

    pub(super) fn on_rejoin_info(
        &mut self,
        from: MemberIndex,
        committed: View,
        executed: Seq,
        out: &mut Outputs,
    ) -> Result<(), Reject> {
        let quorum = self.quorum();
        let Some(rejoin) = self.rejoin.as_mut() else { return Ok(()) };
        if rejoin.bounds.is_some() {
            return Ok(());
        }
        rejoin.reports.insert(from, (committed, executed));
        if rejoin.reports.len() < quorum {
            return Ok(());
        }
        let view = rejoin.reports.values().map(|(v, _)| *v).max().unwrap_or_default();
        let executed = rejoin.reports.values().map(|(_, e)| *e).max().unwrap_or(Seq(0));
        rejoin.bounds = Some((view, executed));
        self.persist(Record::Rejoining { bounds: Some((view, executed)) }, out);
        out.events.push(Event::RejoinBounds { view, executed });
        Ok(())
    }

    /// Called at the end of every step of a rejoining node: drops the votes the step
    /// produced, and ends rejoining once both bounds are passed.
    pub(super) fn rejoin_filter(&mut self, out: &mut Outputs) {
        let Some(rejoin) = &self.rejoin else { return };
        for queue in [&mut out.send, &mut out.send_after_persist] {
            queue.retain(|(_, m)| !is_vote(m));
        }
        let Some((view, executed)) = rejoin.bounds else { return };
        if self.view >= view && self.stable.seq >= executed + self.cfg.options.log_max() {
            self.rejoin = None;
            self.persist(Record::Rejoined, out);
            out.events.push(Event::Rejoined { view: self.view, stable: self.stable.seq });
        }
    }
}

/// What a rejoining node must not send: its votes, and read indices (they report what
/// it accepted). Reads it refuses when they arrive (`Replica::on_message`).
fn is_vote(m: &Message) -> bool {
    match m {
        Message::Propose { .. }
        | Message::Write(_)
        | Message::Accept { .. }
        | Message::ViewChange(_)
        | Message::IndexAck { .. } => true,
        // Its own NEW-VIEW as a primary (relays of others' would be harmless: they prove
        // themselves; they are dropped too, to keep the rule simple).
        Message::NewView(_) => true,
        _ => false,
    }
}
