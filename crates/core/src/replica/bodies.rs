//! Request digests (UpRight §4.1 "Request digest"; `auth = rq-mac` with
//! `request_digests`): the primary proposes operations over `DIGEST_MIN` bytes by
//! digest ([`crate::message::DIGEST_MIN`]), and a backup gathers the bytes before it votes.
//!
//! ```text
//!   client ──Request──► u + r + 1 nodes: each holds it and endorses it
//!   primary ──PROPOSE, large operations as digests──► all
//!   backup:  every operation held (it endorsed them, or holds them on hearsay)? vote
//!            else park the proposal ──FETCH-BODIES──► an endorser (the next one on each retry)
//!            ◄──BODIES── each operation taken only if it hashes to a digest awaited
//! ```
//!
//! Why before the vote: a vote must keep meaning that the voter holds, and has logged,
//! the value it voted for. Then a decision implies `u + 1` correct nodes hold every byte
//! (as without digests), view changes, catch-up and recovery work on whole values
//! unchanged, and execution never waits for a fetch. The saving is where UpRight puts it:
//! the primary sends each large operation to no one. Under rq-mac a client sends to
//! `u + r + 1` nodes starting at the primary, so those hold the bytes and vote at once;
//! only the other `u` fetch, each from an endorser other than the primary when it can.
//!
//! Where the bytes come from: the client's request while it is pending here, an
//! endorsement held on hearsay, or a value in the instance's log slot (a node that voted
//! for it keeps it until the next stable checkpoint; below that, a laggard transfers
//! state). An endorsement proposes only with `u + 1` endorsers valid for each backup, so
//! at least one correct endorser holds each operation.

use super::{Outputs, Reject, Replica};
use crate::config::Auth;
use crate::crypto::Digest;
use crate::ids::{MemberIndex, NodeRange};
use crate::message::{ClientId, Message, NodeId, Payload, Proposal, Proposed, Seq, Value, View};
use crate::service::Service;

/// A PROPOSE this node cannot vote for yet: some operations sent by digest are missing.
pub(super) struct Parked {
    view: View,
    digest: Digest,
    proposal: Proposal,
    /// Per request of `proposal`: the bytes of an operation sent by digest, once here.
    bodies: Vec<Option<Payload>>,
    /// Whom to ask, in turn (fixed when parked, so no node is asked twice in a row).
    order: Vec<NodeId>,
    /// FETCH-BODIES sent so far, and to whom and when the last one went.
    asked: usize,
    asked_node: Option<NodeId>,
    asked_at: u64,
}

/// Retries of one fetch back off up to this many doublings of the retry period, so a
/// proposal nobody can complete (a faulty primary's) costs little until a view change.
const RETRY_DOUBLINGS_MAX: u32 = 4;

/// Operation bytes one peer may pull per retry period, in batches' worth.
const BODY_BUDGET_BATCHES: usize = 4;

/// The operations of `wanted` that `lookup` finds, within one peer's byte budget
/// (`budget`: when its period began, bytes sent it since): a batch at most per answer,
/// [`BODY_BUDGET_BATCHES`] per retry period `period`. Shared by order nodes and RQ nodes
/// (rq_node.rs), which answer FETCH-BODIES alike.
pub(crate) fn budgeted_bodies(
    options: &crate::config::Options,
    budget: &mut (u64, usize),
    (now, period): (u64, u64),
    mut wanted: Vec<(ClientId, Digest)>,
    lookup: impl Fn(ClientId, &Digest) -> Option<Payload>,
) -> Vec<Payload> {
    let batch = options.batch_bytes_max + crate::codec::OP_BYTES_MAX;
    let (since, spent) = budget;
    if now >= *since + period {
        (*since, *spent) = (now, 0);
    }
    let mut left = (BODY_BUDGET_BATCHES * batch).saturating_sub(*spent).min(batch);
    wanted.sort_unstable();
    wanted.dedup();
    let mut ops = Vec::new();
    for (client, op) in wanted {
        if let Some(body) = lookup(client, &op) {
            if body.len() > left {
                break;
            }
            left -= body.len();
            *spent += body.len();
            ops.push(body);
        }
    }
    ops
}

impl Parked {
    fn missing(&self) -> impl Iterator<Item = (usize, &crate::message::RequestDigest)> {
        self.proposal.requests.iter().enumerate().filter_map(|(i, p)| match p {
            Proposed::Digest(d) if self.bodies[i].is_none() => Some((i, d)),
            _ => None,
        })
    }

    fn complete(&self) -> bool {
        self.missing().next().is_none()
    }

    /// Fills every awaited position whose digest `op` has: how many (`None` if no
    /// position of the proposal has that digest).
    fn fill(&mut self, op: &Payload, trust: bool) -> Option<usize> {
        let digest = op.digest();
        let (mut matched, mut filled) = (false, 0);
        for (i, p) in self.proposal.requests.iter().enumerate() {
            if let Proposed::Digest(d) = p {
                if d.op == digest {
                    matched = true;
                    if self.bodies[i].is_none() {
                        self.bodies[i] = Some(op.clone());
                        filled += 1;
                    }
                } else if trust && self.bodies[i].is_none() {
                    // Mutation `unchecked-body`: the answer is taken for what was asked.
                    self.bodies[i] = Some(Payload::claiming_digest(op.to_vec(), d.op));
                    return Some(1);
                }
            }
        }
        matched.then_some(filled)
    }
}

impl<S: Service> Replica<S> {
    /// The digest of the proposal parked for (`view`, `seq`), if there is one.
    pub(super) fn parked_digest(&self, view: View, seq: Seq) -> Option<Digest> {
        self.parked.get(&seq).filter(|p| p.view == view).map(|p| p.digest)
    }

    /// The value, if this node holds every operation `proposal` sent by digest; otherwise
    /// parks it and asks an endorser for the rest.
    pub(super) fn expand_or_park(
        &mut self,
        view: View,
        seq: Seq,
        proposal: Proposal,
        digest: Digest,
        out: &mut Outputs,
    ) -> Result<Option<Value>, Reject> {
        if !proposal.has_digests() {
            return Ok(proposal.expand(&[]));
        }
        if proposal.requests.iter().any(|p| matches!(p, Proposed::Digest(_)) && p.endorsements().is_empty()) {
            return Err(Reject::BadBatch("an operation by digest that nobody endorsed"));
        }
        let bodies: Vec<Option<Payload>> = proposal
            .requests
            .iter()
            .map(|p| match p {
                Proposed::Full(_) => None,
                Proposed::Digest(d) => self.held_body(seq, d.client, &d.op),
            })
            .collect();
        let missing = proposal
            .requests
            .iter()
            .zip(&bodies)
            .filter(|(p, b)| matches!(p, Proposed::Digest(_)) && b.is_none())
            .map(|(p, _)| p);
        let order = self.fetch_order(view, seq, missing);
        let parked = Parked { view, digest, proposal, bodies, order, asked: 0, asked_node: None, asked_at: self.now };
        if parked.complete() {
            return parked.proposal.expand(&parked.bodies).map(Some).ok_or(Reject::BadBatch("unexpandable"));
        }
        self.parked.insert(seq, parked);
        self.fetch_bodies(seq, out);
        Ok(None)
    }

    /// Whom a node asks for the operations of instance `seq` it lacks: their endorsers
    /// (they hold them), other than the primary, starting at one that depends on the node
    /// and the instance (so one endorser does not serve every fetching node); then the
    /// primary (which holds them all, but is the node digests spare); then every other
    /// endorsing node; then everyone else.
    fn fetch_order<'a>(&self, view: View, seq: Seq, missing: impl Iterator<Item = &'a Proposed>) -> Vec<NodeId> {
        let (me, n, primary) = (self.signer_name(), self.cfg.n(), super::signer_name(self.cfg.primary(view)));
        let mut order: Vec<NodeId> = missing.flat_map(|p| p.endorsements().iter().map(|e| e.node)).collect();
        // Endorsers hold the bytes: order nodes when co-located, else the RQ nodes.
        let endorsers = self.cfg.endorsers();
        order.retain(|&x| x != me && x != primary && endorsers.contains(&x));
        order.sort_unstable();
        order.dedup();
        let rotate = (me.0 as usize).wrapping_add(seq.0 as usize) % order.len().max(1);
        order.rotate_left(rotate);
        if primary != me {
            order.push(primary);
        }
        // Co-located, the endorsers are the order nodes: each node once.
        for x in endorsers.chain(NodeRange::first(n)) {
            if x != me && !order.contains(&x) {
                order.push(x);
            }
        }
        order
    }

    /// The bytes of `client`'s operation with digest `op`, if this node holds them.
    fn held_body(&self, seq: Seq, client: ClientId, op: &Digest) -> Option<Payload> {
        if let Some(p) = self.pending.get(&client).filter(|p| p.req.op.digest() == *op) {
            return Some(p.req.op.clone());
        }
        if let Some(body) = self.hearsay.body(client, op) {
            return Some(body);
        }
        let slot = self.log.get(&seq)?;
        slot.values()
            .flat_map(|v| &v.requests)
            .find(|r| r.client == client && r.op.digest() == *op)
            .map(|r| r.op.clone())
    }

    /// How long a fetch may go unanswered before the next node is asked (doubling with
    /// each retry, up to [`RETRY_DOUBLINGS_MAX`]), and how often a node answers one
    /// peer's question about one instance.
    fn body_retry_ms(&self) -> u64 {
        (self.cfg.options.retransmit_ms / 5).max(1)
    }

    /// Asks the next node in turn for the operations `seq`'s parked proposal lacks.
    fn fetch_bodies(&mut self, seq: Seq, out: &mut Outputs) {
        let Some(p) = self.parked.get_mut(&seq) else {
            return;
        };
        let wanted: Vec<(ClientId, Digest)> = p.missing().map(|(_, d)| (d.client, d.op)).collect();
        let Some(&peer) = p.order.get(p.asked % p.order.len().max(1)) else {
            return;
        };
        p.asked += 1;
        p.asked_node = Some(peer);
        p.asked_at = self.now;
        out.send.push((self.peer_of(peer), Message::FetchBodies { seq, wanted }));
    }

    /// On every tick: takes operations that reached this node meanwhile (a client's late
    /// copy, hearsay), and asks again for those a fetch did not bring in time.
    pub(super) fn refetch_bodies(&mut self, out: &mut Outputs) {
        let retry = self.body_retry_ms();
        let due: Vec<Seq> = self
            .parked
            .iter()
            .filter(|(_, p)| {
                let doublings = (p.asked.saturating_sub(1) as u32).min(RETRY_DOUBLINGS_MAX);
                self.now >= p.asked_at + (retry << doublings)
            })
            .map(|(&seq, _)| seq)
            .collect();
        for seq in due {
            let found: Vec<Payload> = self.parked.get(&seq).map_or_else(Vec::new, |p| {
                p.missing().filter_map(|(_, d)| self.held_body(seq, d.client, &d.op)).collect()
            });
            if let Some(p) = self.parked.get_mut(&seq) {
                for op in &found {
                    p.fill(op, false);
                }
            }
            if !self.complete_or_reject(seq, out) {
                self.fetch_bodies(seq, out);
            }
        }
    }

    /// A peer lacks operations of instance `seq`: send those we hold (the PROPOSE may not
    /// have reached this node yet, so its pending requests count as well as the
    /// instance's values). A small question can pull a batch's bytes, so a peer gets one
    /// answer, empty or not, per instance per retry period, only for instances near what
    /// this node executed, and at most [`BODY_BUDGET_BATCHES`] batches' bytes per retry
    /// period in all: about what honest fetching of the proposals in flight needs.
    pub(super) fn on_fetch_bodies(
        &mut self,
        from: MemberIndex,
        seq: Seq,
        wanted: Vec<(ClientId, Digest)>,
        out: &mut Outputs,
    ) -> Result<(), Reject> {
        if self.cfg.auth != Auth::RqMac {
            return Err(Reject::WrongPeer);
        }
        if wanted.len() > self.cfg.options.batch_count_max {
            return Err(Reject::BadBatch("more operations asked for than a batch holds"));
        }
        let near = self.exec.executed() + 2 * self.cfg.options.window;
        if seq <= self.stable.seq || seq > self.high_water().min(near) {
            // Stable here (the asker will learn it by STATUS), or beyond what this node
            // has reached: nothing to answer, and nothing wrong with asking.
            return Ok(());
        }
        let period = self.body_retry_ms();
        if self.body_answers[from.index()].get(&seq).is_some_and(|at| self.now < at + period) {
            return Err(Reject::Busy("operations fetched again within a retry period"));
        }
        self.body_answers[from.index()].insert(seq, self.now);
        let mut budget = self.body_budget[from.index()];
        let lookup = |client, op: &Digest| self.held_body(seq, client, op);
        let ops = budgeted_bodies(&self.cfg.options, &mut budget, (self.now, period), wanted, lookup);
        self.body_budget[from.index()] = budget;
        if !ops.is_empty() {
            out.send.push((self.member(from), Message::Bodies { seq, ops }));
        }
        Ok(())
    }

    /// Operations for a parked proposal: each fills the positions whose digest it has.
    /// One that fits no position is the asked node's fault only if it is that node's
    /// answer (others may answer an earlier question about the instance): the next node
    /// is asked at once.
    pub(super) fn on_bodies(
        &mut self,
        from: NodeId,
        seq: Seq,
        ops: Vec<Payload>,
        out: &mut Outputs,
    ) -> Result<(), Reject> {
        let trust = self.cfg.quorums.mutation() == Some(crate::quorum::Mutation::UncheckedBody);
        // Unasked, or a second node answering the same question: nothing to do.
        let Some(p) = self.parked.get_mut(&seq) else {
            return Ok(());
        };
        let (mut stray, mut count) = (false, 0);
        for op in &ops {
            match p.fill(op, trust) {
                Some(filled) => count += filled,
                None => stray = true,
            }
        }
        let asked = p.asked_node == Some(from);
        let blame = stray && asked;
        if count > 0 {
            out.events.push(super::Event::OperationsFetched { seq, count });
        }
        // The node asked answered and something is still missing: it holds no more (or
        // lied), so the next one is asked now rather than after a retry period. With RQ
        // nodes apart each holds only its clients' operations of a batch.
        if !self.complete_or_reject(seq, out) && asked {
            self.fetch_bodies(seq, out);
        }
        if blame {
            return Err(Reject::BadProof("an operation that matches no digest of the proposal"));
        }
        Ok(())
    }

    /// `client`'s request was just admitted: it may be one a parked proposal awaits (the
    /// PROPOSE overtook the client's own copy).
    pub(super) fn fill_parked(&mut self, client: ClientId, out: &mut Outputs) {
        let Some(op) = self.pending.get(&client).map(|p| p.req.op.clone()) else {
            return;
        };
        let digest = op.digest();
        let filled: Vec<Seq> = self
            .parked
            .iter_mut()
            .filter(|(_, p)| p.missing().any(|(_, d)| d.client == client && d.op == digest))
            .map(|(&seq, p)| {
                p.fill(&op, false);
                seq
            })
            .collect();
        for seq in filled {
            self.complete_or_reject(seq, out);
        }
    }

    /// Completes `seq`'s parked proposal if every operation is here (false if not); a
    /// proposal that then fails its checks is the primary's fault.
    fn complete_or_reject(&mut self, seq: Seq, out: &mut Outputs) -> bool {
        let Some(view) = self.parked.get(&seq).filter(|p| p.complete()).map(|p| p.view) else {
            return false;
        };
        if let Err(reason) = self.complete_parked(seq, out) {
            let from = self.member(self.cfg.primary(view));
            out.events.push(super::Event::Rejected { from, kind: "propose", reason });
        }
        true
    }

    /// Votes for a parked proposal once it has every operation, if its view is still the
    /// one this node takes part in.
    fn complete_parked(&mut self, seq: Seq, out: &mut Outputs) -> Result<(), Reject> {
        let Some(p) = self.parked.remove(&seq) else {
            return Ok(());
        };
        if p.view != self.view || self.vc_target.is_some() || seq <= self.stable.seq {
            return Ok(());
        }
        if self.log.get(&seq).is_some_and(|s| s.view == p.view && s.value.is_some()) {
            return Ok(());
        }
        let value = p.proposal.expand(&p.bodies).ok_or(Reject::BadBatch("unexpandable"))?;
        super::normal::check_batch_bytes(&self.cfg.options, &value)?;
        self.accept_proposal(seq, value, out);
        Ok(())
    }

    /// Drops what a view change or a stable checkpoint made moot.
    pub(super) fn prune_bodies(&mut self) {
        let (view, stable, high) = (self.view, self.stable.seq, self.high_water());
        let changing = self.vc_target.is_some();
        self.parked.retain(|&seq, p| p.view == view && !changing && seq > stable);
        for answers in &mut self.body_answers {
            answers.retain(|&seq, _| seq > stable && seq <= high);
        }
    }

    pub(super) fn parked_len(&self) -> usize {
        self.parked.len()
    }
}
