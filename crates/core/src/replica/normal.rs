//! Normal case: admission, batching, PROPOSE → WRITE → ACCEPT, execution, replies,
//! request timers. Reference: BFT-SMaRt §II-C1 (Mod-SMaRt normal phase), UpRight §3.1
//! (agreed time), PBFT §4.2.

use super::{Event, ExecutedRequest, Outputs, Peer, Pending, Reject, Replica};
use crate::config::Auth;
use crate::crypto::Digest;
use crate::ids::MemberIndex;
use crate::membership::ADMIN_CLIENT;
use crate::message::{
    owner_of, write_statement, Cert, ClientId, Message, Proposal, Proposed, Reply, Request, Seq, Value, View, Write,
};
use crate::service::Service;
use crate::wal::Record;
use std::collections::BTreeMap;

/// Results up to this size are sent in full by every node.
pub const REPLY_INLINE_MAX: usize = 64;

/// Decided values executed as one run at most (bounds the work of one step).
const EXEC_RUN_MAX: u64 = 64;

/// `auth = sig`: client requests whose signatures wait to be checked as one batch, at most.
pub(super) const SIGNED_BATCH_MAX: usize = 256;

impl<S: Service> Replica<S> {
    /// A client's request, or a backup's FORWARD of one (`auth = mac`).
    pub(super) fn on_request(&mut self, from: Peer, req: Request, out: &mut Outputs) -> Result<(), Reject> {
        self.check_session(from, req.client)?;
        match (self.cfg.auth, from) {
            // With rq-mac, nodes vouch for requests by endorsing them (endorse.rs).
            (Auth::RqMac, Peer::Node(_)) => return Err(Reject::WrongPeer),
            // Nodes do not lie with r = 0: a backup's FORWARD vouches for the client as
            // its MAC would, and this node's entry may be the one the client got wrong.
            (Auth::Mac, Peer::Node(_)) if !self.cfg.quorums.byzantine() => {}
            // Checked with the rest of the burst, as one batch (`check_signed_requests`).
            (Auth::Sig, Peer::Client(_)) => {
                self.unsigned.push((from, req));
                if self.unsigned.len() >= SIGNED_BATCH_MAX {
                    self.check_signed_requests(out);
                }
                return Ok(());
            }
            _ => self.check_mac(&req)?,
        }
        self.on_authentic_request(from, req, out)
    }

    /// `auth = sig`: checks the signatures of the client requests that arrived since the
    /// last call as one Ed25519 batch (about half the cost per signature of checking them
    /// one by one: the largest CPU cost of a node under sig), then one by one only if the
    /// batch fails, to reject just the bad ones. Called at the end of every step, or of a
    /// burst of steps the driver holds proposals for.
    pub(super) fn check_signed_requests(&mut self, out: &mut Outputs) {
        if self.unsigned.is_empty() {
            return;
        }
        let batch = std::mem::take(&mut self.unsigned);
        let items: Option<Vec<(ClientId, Digest, crate::crypto::Sig)>> =
            batch.iter().map(|(_, r)| r.sig.map(|sig| (owner_of(r.client), r.statement(), sig))).collect();
        let all_valid = items.is_some_and(|items| self.client_keys.verify_batch(&items));
        for (from, req) in batch {
            let result = if all_valid { Ok(()) } else { self.check_mac(&req) };
            if let Err(reason) = result.and_then(|()| self.on_authentic_request(from, req, out)) {
                out.events.push(Event::Rejected { from, kind: "request", reason });
            }
        }
    }

    /// The rest of [`Self::on_request`], for a request whose client is authenticated.
    fn on_authentic_request(&mut self, from: Peer, req: Request, out: &mut Outputs) -> Result<(), Reject> {
        let last = self.exec.last_seq(req.client);
        if req.seq <= last {
            // A retransmission of something already executed: answer from the cache,
            // in full, so a client that missed the designated reply can finish. Gated
            // like the first reply: the execution may not be durable yet. Separated:
            // the cache holds no results here, the execution nodes answer.
            let cached = self.exec.cached(req.client, req.seq).filter(|_| !self.cfg.separated());
            if let (Peer::Client(_), Some(result)) = (from, cached) {
                let body = crate::codec::reply_body(result.to_vec(), true);
                let reply = Reply { client: req.client, view: self.view, seq: req.seq, body, epoch: self.epoch() };
                out.send_after_persist.push((Peer::Client(req.client), Message::Reply(reply)));
            }
            return Ok(());
        }
        if self.cfg.rq_separated() {
            // Clients reach the order stage through the RQ nodes (rq_node.rs); here they
            // are answered from the reply cache only.
            return Ok(());
        }
        let direct = matches!(from, Peer::Client(_));
        if let Some(p) = self.pending.get_mut(&req.client) {
            let repeat = p.req.seq == req.seq && p.req.statement() == req.statement();
            let held = p.req.seq >= req.seq;
            // The client's own transmission (a retransmission, or the first one after
            // others' endorsements admitted the request): this node answers it too.
            p.direct |= repeat && direct;
            if repeat && self.cfg.auth == Auth::RqMac && self.now >= p.broadcast_at + self.cfg.options.retransmit_ms {
                // The client retransmitted: the endorsement sent to the primary may not
                // have done, so every node hears it now (UpRight §4.3); at most once per
                // retransmission period, so repeats cannot make this node flood its peers.
                self.send_endorsement(req.client, true, out);
            }
            if held {
                return Ok(());
            }
        }
        let client = req.client;
        self.admit(req, BTreeMap::new(), false, direct, out)?;
        if direct {
            self.forward_at_once(client, out);
        }
        Ok(())
    }

    /// With `r = 0` and execution co-located, a client sends a request to the primary
    /// alone (`Quorums::first_recipients`); one that reaches a backup straight from the
    /// client was meant for a primary: the client's view is old, or it blamed the primary,
    /// or it retransmitted to everyone. The backup forwards it at once instead of at its
    /// request timer, so a stale view costs the client a hop and not a timeout. Nodes do
    /// not lie with `r = 0`, so the primary takes the forward as it takes the client's
    /// copy (`on_request`). The request timer still suspects the primary if nothing comes
    /// of it.
    fn forward_at_once(&mut self, client: ClientId, out: &mut Outputs) {
        let cfg = &self.cfg;
        if cfg.quorums.byzantine() || cfg.auth == Auth::RqMac || cfg.separated() || self.is_primary() {
            return;
        }
        let to_primary = self.member(cfg.primary(self.view));
        let Some(p) = self.pending.get_mut(&client) else {
            return;
        };
        if !p.forwarded && !p.in_flight {
            p.forwarded = true;
            out.send.push((to_primary, Message::Forward(p.req.clone())));
        }
    }

    /// Primary: propose batches while the window has room (pipelining), cutting a batch
    /// when it is full or its oldest request waited `batch_delay_ms`, or at once when
    /// nothing is in flight (so a lone client sees no batching delay).
    pub(super) fn maybe_propose(&mut self, out: &mut Outputs) {
        if !self.is_primary()
            || self.transfer.is_some()
            || self.epoch_ended()
            || !self.has_base()
            || self.proposals_closed == Some(self.view)
            || self.proposals_held
            || self.rejoin.is_some()
        {
            return;
        }
        let opts = &self.cfg.options;
        let (window, count_max, bytes_max, delay) =
            (opts.window, opts.batch_count_max, opts.batch_bytes_max, opts.batch_delay_ms);
        self.next_propose = self.next_propose.max(self.floor + 1).max(self.stable.seq + 1);
        loop {
            let in_flight = self.next_propose - 1 - self.exec.executed().min(self.next_propose - 1);
            if in_flight >= window || self.next_propose > self.high_water() {
                return;
            }
            let mut candidates: Vec<&Pending> =
                self.pending.values().filter(|p| !p.in_flight && self.proposable(p)).collect();
            if candidates.is_empty() {
                if self.tick_due(in_flight) {
                    self.propose_tick(out);
                    continue;
                }
                return;
            }
            candidates.sort_by_key(|p| p.order);
            let mut batch = Vec::new();
            let mut bytes = 0;
            for p in candidates.iter() {
                // Sized as proposed: with rq-mac, endorsements replace the client's MACs.
                let r = self.proposed_form(p);
                if batch.len() == count_max || (bytes + r.size() > bytes_max && !batch.is_empty()) {
                    break;
                }
                bytes += r.size();
                batch.push(r);
            }
            let full = batch.len() == count_max || bytes >= bytes_max / 2;
            let oldest = candidates.first().map_or(self.now, |p| p.since);
            if in_flight > 0 && !full && self.now < oldest + delay {
                return;
            }
            for r in &batch {
                if let Some(p) = self.pending.get_mut(&r.client) {
                    p.in_flight = true;
                }
            }
            self.time_proposed = self.time_proposed.max(self.now);
            let value = Value { time: self.time_proposed, requests: batch };
            let seq = self.next_propose;
            self.next_propose += 1;
            let view = self.view;
            self.propose(view, seq, value, out);
        }
    }

    /// Whether the primary, with nothing to propose, owes the cluster a tick: ticks are on,
    /// nothing is in flight, and agreed time has stood still for `tick_ms`.
    fn tick_due(&self, in_flight: u64) -> bool {
        let tick_ms = self.cfg.options.tick_ms;
        tick_ms > 0 && in_flight == 0 && self.now >= self.exec.time().max(self.time_proposed) + tick_ms
    }

    /// Primary: proposes an empty value at agreed time, so that time advances (and
    /// services tick) while no client sends anything.
    fn propose_tick(&mut self, out: &mut Outputs) {
        self.time_proposed = self.time_proposed.max(self.now);
        let value = Value { time: self.time_proposed, requests: Vec::new() };
        let seq = self.next_propose;
        self.next_propose += 1;
        let view = self.view;
        self.propose(view, seq, value, out);
    }

    /// Primary: send PROPOSE at once and vote for it. The PROPOSE is not a vote, so it
    /// need not wait for the disk (backups log and vote in parallel with our fsync); the
    /// primary's own vote waits for its Accepted record like everyone's. A primary that
    /// crashes may thus have proposed what it no longer remembers, so a recovered
    /// primary never proposes in that view again (`proposals_closed`, recovery.rs).
    ///
    /// That rule needs the view itself on disk: no PROPOSE of a view leaves before this
    /// node's record of the view is durable (`view_record_durable`), or a primary that
    /// crashed while installing it would recover below it and lead it a second time.
    fn propose(&mut self, view: View, seq: Seq, value: Value, out: &mut Outputs) {
        debug_assert_ne!(self.proposals_closed, Some(view), "no fresh proposals in a view we may have forgotten");
        let propose = Message::Propose { view, seq, value: proposal_form(&self.cfg, &value) };
        let mutated = self.cfg.quorums.mutation() == Some(crate::quorum::Mutation::ProposeBeforeViewDurable);
        if self.view_record_durable || mutated {
            self.broadcast(propose, out);
        } else {
            self.broadcast_durable(propose, out);
        }
        self.accept_proposal(seq, value, out);
    }

    /// `checked`: the verify stage found the requests' client signatures valid
    /// (`auth = sig`, [`super::Verifier`]).
    pub(super) fn on_propose(
        &mut self,
        from: MemberIndex,
        view: View,
        seq: Seq,
        value: Proposal,
        checked: bool,
        out: &mut Outputs,
    ) -> Result<(), Reject> {
        if self.keep_early_proposal(from, view, seq, &value) {
            return Ok(());
        }
        self.check_current_view(view)?;
        if from != self.cfg.primary(view) {
            return Err(Reject::NotPrimary { from, view });
        }
        self.in_window(seq)?;
        if seq <= self.floor {
            return Err(Reject::OutOfWindow { seq, low: self.floor, high: self.high_water() });
        }
        let digest = value.digest();
        if let Some(slot) = self.log.get(&seq) {
            if slot.view == view {
                if let Some((_, d)) = &slot.value {
                    return if *d == digest { Ok(()) } else { Err(Reject::Equivocation { view, seq }) };
                }
            }
        }
        if let Some(d) = self.parked_digest(view, seq) {
            return if d == digest { Ok(()) } else { Err(Reject::Equivocation { view, seq }) };
        }
        self.check_batch(seq, &value, checked)?;
        // Operations sent by digest are gathered before this node votes (bodies.rs).
        if let Some(value) = self.expand_or_park(view, seq, value, digest, out)? {
            check_batch_bytes(&self.cfg.options, &value)?;
            self.accept_proposal(seq, value, out);
        }
        Ok(())
    }

    /// A PROPOSE for the view we are about to install: the new primary's first
    /// proposals leave at once while its NEW-VIEW waits for the disk, so they can arrive
    /// first. Kept (for that one view, within the window, at most `log_max`) and stepped
    /// once the view is installed, instead of waiting for a retransmission.
    fn keep_early_proposal(&mut self, from: MemberIndex, view: View, seq: Seq, value: &Proposal) -> bool {
        let next = self.vc_target.unwrap_or(self.view + 1);
        if view != next || from != self.cfg.primary(view) || self.in_window(seq).is_err() {
            return false;
        }
        self.early_proposals.retain(|_, (v, _)| *v == view);
        if self.early_proposals.len() as u64 >= self.cfg.options.log_max() && !self.early_proposals.contains_key(&seq) {
            return false;
        }
        self.early_proposals.entry(seq).or_insert_with(|| (view, value.clone()));
        true
    }

    /// Steps the proposals kept by [`Self::keep_early_proposal`] for the view just installed.
    pub(super) fn replay_early_proposals(&mut self, out: &mut Outputs) {
        let view = self.view;
        let primary = self.cfg.primary(view);
        let early = std::mem::take(&mut self.early_proposals);
        for (seq, (v, value)) in early {
            if v == view {
                if let Err(reason) = self.on_propose(primary, v, seq, value, false, out) {
                    out.events.push(Event::Rejected { from: self.member(primary), kind: "propose", reason });
                }
            }
        }
    }

    /// An empty proposal is a tick (`propose_tick`): only with ticks on, and, where this
    /// node knows the previous instance's value, not before `tick_ms` after it, so a
    /// faulty primary cannot fill instances with empty values faster than the ticks the
    /// configuration asked for. (Its time is checked below like any value's.)
    fn check_tick(&self, seq: Seq, value: &Proposal) -> Result<(), Reject> {
        let tick_ms = self.cfg.options.tick_ms;
        if tick_ms == 0 {
            return Err(Reject::BadBatch("empty batch"));
        }
        let prev = self.log.get(&(seq - 1)).and_then(|s| s.value.as_ref()).map(|v| v.0.time);
        if prev.is_some_and(|prev| prev != 0 && value.time < prev + tick_ms) {
            return Err(Reject::BadBatch("a tick sooner than tick_ms after the previous instance"));
        }
        Ok(())
    }

    fn check_batch(&mut self, seq: Seq, value: &Proposal, sigs_checked: bool) -> Result<(), Reject> {
        let opts = &self.cfg.options;
        if value.requests.is_empty() {
            self.check_tick(seq, value)?;
        }
        if value.requests.len() > opts.batch_count_max {
            return Err(Reject::BadBatch("too many requests"));
        }
        // Operations sent by digest count their digests here, their bytes once expanded
        // (`check_batch_bytes`): a parked proposal is no larger than an accepted one.
        if value.requests.iter().map(Proposed::size).sum::<usize>() > opts.batch_bytes_max + crate::codec::OP_BYTES_MAX
        {
            return Err(Reject::BadBatch("too many bytes"));
        }
        if value.has_digests() && self.cfg.auth != Auth::RqMac {
            // Only endorsers are known to hold a request's bytes.
            return Err(Reject::BadBatch("an operation by digest without auth = rq-mac"));
        }
        let mut clients: Vec<ClientId> = value.requests.iter().map(Proposed::client).collect();
        clients.sort_unstable();
        if clients.windows(2).any(|w| w[0] == w[1]) {
            return Err(Reject::BadBatch("two requests of one client"));
        }
        let tolerance = opts.clock_tolerance_ms;
        if value.time + tolerance < self.now || value.time > self.now + tolerance {
            return Err(Reject::BadTime { time: value.time, now: self.now });
        }
        // Time must not go backwards relative to the previous instance we know of.
        if let Some(prev) = self.log.get(&(seq - 1)).and_then(|s| s.value.as_ref()) {
            if prev.0.time > value.time && prev.0.time != 0 {
                return Err(Reject::BadTime { time: value.time, now: prev.0.time });
            }
        }
        if self.cfg.auth == Auth::Sig {
            // One batch verification for the requests this node did not verify when the
            // client sent them, unless the verify stage already did the whole proposal.
            if !sigs_checked {
                let unverified = value.requests.iter().filter_map(Proposed::full).filter(|r| !self.holds_verified(r));
                if !super::verify::requests_signed(&self.client_keys, unverified) {
                    return Err(Reject::BadBatch("a request without a valid client signature"));
                }
            }
            return Ok(());
        }
        for r in &value.requests {
            self.check_proposed_request(r)?;
        }
        Ok(())
    }

    pub(super) fn check_current_view(&self, view: View) -> Result<(), Reject> {
        if view != self.view || self.vc_target.is_some() {
            return Err(Reject::StaleView { current: self.vc_target.unwrap_or(self.view), got: view });
        }
        Ok(())
    }

    /// Votes for `value` in instance `seq` of the current view: the one place a node
    /// commits to a proposal (rule 1: at most one value per (view, seq), persisted first).
    pub(super) fn accept_proposal(&mut self, seq: Seq, value: Value, out: &mut Outputs) {
        if seq <= self.stable.seq {
            // Accepting one value can run execution to a checkpoint that becomes stable
            // while the caller still holds later instances below it (fetch_awaited's
            // batch of fetched bodies): those are garbage now, and a slot for them would
            // sit below the stable checkpoint (the simulator's invariant caught it).
            return;
        }
        let view = self.view;
        let digest = value.digest();
        let byzantine = self.byzantine_mode();
        let abstains = byzantine && self.abstains(view, seq);
        let slot = self.log.entry(seq).or_default();
        slot.enter_view(view);
        if self.rejoin.is_some() {
            // Rejoining after a lost disk (rejoin.rs): it may have voted otherwise here
            // before, so it does not vote, not even in its own count: a decision needs
            // Q others. The body stays, for a decision or a later NEW-VIEW naming it.
            slot.keep_earlier(view, value, digest);
            return;
        }
        if abstains {
            // Before a restart this node may have sent a WRITE here for a proposal whose
            // Accepted record it lost: voting again could sign two values for one (view,
            // seq). Like a rejoining node, it keeps the body and counts on Q others.
            slot.keep_earlier(view, value, digest);
            let abstained = self.abstained.get_or_insert((self.now, seq));
            abstained.1 = abstained.1.max(seq);
            return;
        }
        assert!(slot.value.is_none(), "one vote per (view, seq)");
        slot.value = Some((value.clone(), digest));
        slot.voted_at = self.now;
        for r in &value.requests {
            if let Some(p) = self.pending.get_mut(&r.client) {
                if p.req.seq == r.seq {
                    p.in_flight = true;
                }
            }
        }
        let accepted = Record::Accepted { view, seq, value: value.clone() };
        if byzantine {
            // The WRITE commits this node, not the Accepted record: the record goes to disk
            // with the next flush, and the WRITE waits only for a durable vote horizon
            // (one record per `window` instances), which takes an fsync off the critical
            // path of every instance.
            out.persist_lazy.push(accepted);
            self.cover_vote(view, seq, out);
        } else {
            self.persist(accepted, out);
        }
        if byzantine {
            let sig = self.secrets.signing.sign(&write_statement(&self.epoch_tag, view, seq, &digest, self.id));
            let slot = self.log.entry(seq).or_default();
            slot.writes.insert(self.id, (digest, sig));
            self.broadcast_durable(Message::Write(Write { view, seq, digest, sig }), out);
            self.maybe_prepare(seq, out);
        } else {
            // CFT: the accepted proposal is the certificate (Paxos' accepted value).
            let cert = Cert { view, seq, value, writes: Vec::new() };
            self.send_accept(seq, cert, out);
        }
    }

    /// Whether a WRITE for `seq` in `view` may repeat one sent before a restart (see
    /// `abstain`).
    fn abstains(&self, view: View, seq: Seq) -> bool {
        if self.cfg.quorums.mutation() == Some(crate::quorum::Mutation::VoteAfterRestart) {
            return false;
        }
        self.abstain.is_some_and(|(v, s)| v == view && seq <= s)
    }

    /// A node that abstains where it may have voted before a restart (`abstains`) is
    /// missing from every quorum of those instances in that view. If another node is down
    /// too, they cannot decide there, and nobody else need notice: a node that decided
    /// has nothing pending, and a node behind a peer waits to catch up, but decisions are
    /// adopted only from r + 1 matching claims (session 28's simulator run: two restarted
    /// nodes abstaining, the primary gone, one node decided; stuck). So the abstaining
    /// node asks for the next view itself once an instance it abstained on has stayed
    /// unexecuted for as long as a request waits before its primary is suspected; there
    /// it may vote again. Its STOP alone moves nobody (r + 1 are needed for the others to
    /// join), so a faulty node claiming a restart gains nothing by it.
    pub(super) fn on_abstention_timeout(&mut self, out: &mut Outputs) {
        let Some((since, high)) = self.abstained else {
            return;
        };
        if self.cfg.quorums.mutation() == Some(crate::quorum::Mutation::AbstainSilently) {
            return;
        }
        let abstaining = self.abstain.is_some_and(|(v, _)| v == self.view);
        if !abstaining || self.exec.executed() >= high {
            self.abstained = None;
            return;
        }
        if self.vc_target.is_none() && self.now >= since + 2 * self.cfg.options.request_timeout_ms {
            self.suspect(self.view.next(), out);
        }
    }

    /// BFT: makes sure a `VoteHorizon` record covers a WRITE for `seq` in `view` before it
    /// leaves. The horizon runs `window` instances ahead, so one record (joining the next
    /// flush, which the WRITE waits for through `send_after_persist`) covers that many
    /// WRITEs; between records a WRITE waits for no record of its own.
    ///
    /// Why this is safe: a node signs at most one WRITE per (view, seq) while it runs (the
    /// slot's value). Across a restart it could sign a second one only for a (view, seq)
    /// whose Accepted record was lost, and every WRITE that left was covered by a durable
    /// horizon: the recovered node abstains up to that horizon in that view (`abstains`).
    /// In later views it never voted before the restart (a vote in a view follows that
    /// view's durable `View` record, and the view recovered into is the highest one).
    fn cover_vote(&mut self, view: View, seq: Seq, out: &mut Outputs) {
        if self.vote_horizon.is_some_and(|(v, s)| v == view && seq <= s) {
            return;
        }
        let horizon = (view, seq + self.cfg.options.window);
        self.vote_horizon = Some(horizon);
        self.persist(Record::VoteHorizon { view: horizon.0, seq: horizon.1 }, out);
    }

    /// `checked`: the driver's verify stage already found the signature valid
    /// ([`super::Verifier`]).
    pub(super) fn on_write(
        &mut self,
        from: MemberIndex,
        w: Write,
        checked: bool,
        out: &mut Outputs,
    ) -> Result<(), Reject> {
        if !self.byzantine_mode() {
            return Err(Reject::WrongPeer);
        }
        self.check_current_view(w.view)?;
        self.in_window(w.seq)?;
        self.view_record_durable |= from != self.id;
        if self.log.get(&w.seq).is_some_and(|slot| slot.write_unneeded(w.view, &w.digest)) {
            // Nothing to check it for: a signature check is the largest CPU cost of a
            // backup under light load, and one of the Q-1 peer WRITEs per instance would
            // otherwise be checked after the certificate is complete.
            return Ok(());
        }
        if !checked && !super::verify::write_signed(&self.keys, &self.epoch_tag, from, &w) {
            return Err(Reject::BadSignature { signer: super::signer_name(from) });
        }
        let slot = self.log.entry(w.seq).or_default();
        slot.enter_view(w.view);
        slot.writes.entry(from).or_insert((w.digest, w.sig));
        self.maybe_prepare(w.seq, out);
        Ok(())
    }

    /// Q matching WRITEs for the value we accepted: prepared. Persist the certificate,
    /// then ACCEPT.
    fn maybe_prepare(&mut self, seq: Seq, out: &mut Outputs) {
        let q = self.quorum();
        let Some(slot) = self.log.get(&seq) else {
            return;
        };
        let Some((value, digest)) = &slot.value else {
            return;
        };
        if slot.accept_sent {
            return;
        }
        let writes: Vec<(MemberIndex, crate::crypto::Sig)> =
            slot.writes.iter().filter(|(_, (d, _))| d == digest).map(|(n, (_, s))| (*n, *s)).collect();
        if writes.len() < q {
            return;
        }
        let cert = Cert { view: slot.view, seq, value: value.clone(), writes };
        self.send_accept(seq, cert, out);
    }

    fn send_accept(&mut self, seq: Seq, cert: Cert, out: &mut Outputs) {
        let digest = cert.value.digest();
        let view = cert.view;
        if self.byzantine_mode() {
            self.persist(Record::Prepared(cert.clone()), out);
        }
        let slot = self.log.entry(seq).or_default();
        slot.accept_sent = true;
        slot.cert = Some(cert);
        slot.accepts.insert(self.id, digest);
        self.broadcast_durable(Message::Accept { view, seq, digest }, out);
        self.maybe_decide(seq, out);
    }

    pub(super) fn on_accept(
        &mut self,
        from: MemberIndex,
        view: View,
        seq: Seq,
        digest: Digest,
        out: &mut Outputs,
    ) -> Result<(), Reject> {
        self.check_current_view(view)?;
        self.in_window(seq)?;
        self.view_record_durable |= from != self.id;
        let slot = self.log.entry(seq).or_default();
        slot.enter_view(view);
        slot.accepts.entry(from).or_insert(digest);
        self.maybe_decide(seq, out);
        Ok(())
    }

    fn maybe_decide(&mut self, seq: Seq, out: &mut Outputs) {
        let q = self.quorum();
        let Some(slot) = self.log.get(&seq) else {
            return;
        };
        if let Some(d) = slot.decided {
            // Decided by others' ACCEPTs before the proposal reached us: its body is here
            // now. Without this the instance waited for catch-up or a state transfer.
            if slot.decided_value.is_none() {
                if let Some((v, _)) = slot.value.as_ref().filter(|(_, x)| *x == d) {
                    let v = v.clone();
                    self.decide(seq, d, Some(v), out);
                }
            }
            return;
        }
        let mut counts: Vec<(Digest, usize)> = Vec::new();
        for d in slot.accepts.values() {
            match counts.iter_mut().find(|(x, _)| x == d) {
                Some((_, c)) => *c += 1,
                None => counts.push((*d, 1)),
            }
        }
        let Some((digest, _)) = counts.into_iter().find(|(_, c)| *c >= q) else {
            return;
        };
        let value = slot.body(&digest).cloned();
        self.decide(seq, digest, value, out);
    }

    /// Records that `seq` decided `digest` (with the body when we have it) and executes
    /// whatever became contiguous.
    pub(super) fn decide(&mut self, seq: Seq, digest: Digest, value: Option<Value>, out: &mut Outputs) {
        let slot = self.log.entry(seq).or_default();
        if let Some(d) = slot.decided {
            assert_eq!(d, digest, "instance {seq} decided two values");
        } else {
            slot.decided = Some(digest);
            out.persist_lazy.push(Record::Decided { seq, digest });
            out.events.push(Event::Decided { seq, digest });
        }
        let slot = self.log.entry(seq).or_default();
        if slot.decided_value.is_none() {
            if let Some(v) = value {
                // Both callers pass a value found under this digest (a slot's checked
                // proposal, a claim keyed by its digest). Recomputing it here, per decided
                // batch, was ~10% of a backup's CPU at peak: checked in debug builds only.
                debug_assert_eq!(v.digest(), digest, "decided value {seq} matches its digest");
                slot.decided_value = Some(v);
            }
        }
        if let Some(c) = &slot.cert {
            assert_eq!(c.seq, seq, "certificate is filed under its own instance");
        }
        self.maybe_execute(out);
    }

    /// Executes decided values in order; replies once the decision is durable.
    pub(super) fn maybe_execute(&mut self, out: &mut Outputs) {
        if self.transfer.is_some() {
            return;
        }
        loop {
            if self.epoch_ended() {
                // Nothing past the epoch's last instance executes in this epoch.
                break;
            }
            if self.pending_checkpoints.len() >= super::checkpoint::PENDING_CHECKPOINTS_MAX {
                // Background checkpoints lag: execution may run one interval ahead of
                // the oldest, not more. Each pending one keeps the values overwritten
                // since its freeze alive, and its late vote keeps the log from being
                // collected; with no limit a node of a 1 GB state grew to 9 GB.
                break;
            }
            let first = self.exec.executed() + 1;
            let count = self.executable_run(first);
            if count == 0 {
                break;
            }
            // Borrowed, not cloned (batches of requests): `log` and `exec` are disjoint.
            let values: Vec<&Value> =
                first.until(first + count).filter_map(|seq| self.log.get(&seq)?.decided_value.as_ref()).collect();
            // What the bookkeeping below needs of each value, taken while `values` (a
            // borrow of the log) lives.
            let shapes: Vec<(Vec<Digest>, usize)> = values
                .iter()
                .map(|v| {
                    (v.requests.iter().map(|r| r.op.digest()).collect(), v.requests.iter().map(Request::size).sum())
                })
                .collect();
            let outcomes = self.exec.execute_many(first, &values);
            // Each before its instance's Executed event. Separated, the order state's
            // ticks change nothing and push nothing.
            for tick in self.exec.take_ticks() {
                self.push_events(&tick.pushes, out);
                out.events.push(Event::Ticked { seq: tick.seq, time: tick.time });
            }
            for ((seq, (ops, bytes)), outcomes) in first.onward().zip(shapes).zip(outcomes) {
                let mut executed = Vec::new();
                for (o, op) in outcomes.iter().zip(ops) {
                    // Whether the client sent this request here itself (see `Pending::direct`).
                    // With an RQ stage of its own the client reaches this node only through
                    // the RQ nodes: every order node replies, as before.
                    let mut direct = self.cfg.rq_separated();
                    if let Some(p) = self.pending.get(&o.client) {
                        direct |= p.direct && p.req.seq == o.seq;
                        if p.req.seq <= o.seq {
                            self.pending.remove(&o.client);
                        }
                    }
                    self.hearsay.forget(o.client, o.seq);
                    if !o.fresh {
                        continue;
                    }
                    executed.push(ExecutedRequest { client: o.client, seq: o.seq, op });
                    if self.cfg.separated() {
                        // The execution nodes answer; this node ran the order state only.
                        continue;
                    }
                    // A client that did not ask this node waits on the u + r + 1 it asked,
                    // and a retransmission is answered from the reply cache. But a large
                    // result comes in full from its designated node only (`reply_body`):
                    // that node answers whether asked or not, or a client whose request
                    // went elsewhere would hold matching digests and no result until it
                    // retransmitted (coord's 90/10 mix: 17k -> 0.7k ops/s, p99 600 ms).
                    let designated = o.result.len() > REPLY_INLINE_MAX && self.designated(o.client, o.seq);
                    if direct || designated {
                        let body = self.reply_body(o.client, o.seq, o.result.clone());
                        let reply = Reply { client: o.client, view: self.view, seq: o.seq, body, epoch: self.epoch() };
                        out.send_after_persist.push((Peer::Client(o.client), Message::Reply(reply)));
                    }
                    self.push_events(&o.pushes, out);
                }
                self.monitor.on_executed(executed.len(), bytes);
                out.events.push(Event::Executed { seq, requests: executed });
                if self.cfg.separated() {
                    if let Some(value) = self.log.get(&seq).and_then(|s| s.decided_value.clone()) {
                        self.send_commit(seq, &value, out);
                    }
                }
            }
            let last = self.exec.executed();
            if last.is_multiple_of(self.cfg.options.checkpoint_interval) || self.epoch_ended() {
                // The epoch's last instance is a checkpoint wherever it falls.
                self.take_checkpoint(last, out);
            }
        }
        self.answer_reads(out);
        self.maybe_propose(out);
    }

    /// How many decided values from `first` on execute as one run (CBASE: one dependency
    /// graph across batches). A run stops after a checkpoint instance (a checkpoint is
    /// taken between runs) and after a value holding an administrative operation (it may
    /// end the epoch, and nothing past an epoch's end executes in it).
    fn executable_run(&self, first: Seq) -> u64 {
        let mut count = 0;
        while let Some(value) = self.log.get(&(first + count)).and_then(|s| s.decided_value.as_ref()) {
            let seq = first + count;
            count += 1;
            let admin = value.requests.iter().any(|r| owner_of(r.client) == ADMIN_CLIENT);
            if admin || seq.is_multiple_of(self.cfg.options.checkpoint_interval) || count >= EXEC_RUN_MAX {
                break;
            }
        }
        count
    }

    /// Request timers (BFT-SMaRt §II-C1): the first expiry forwards the request to the
    /// primary, the second suspects the primary. Timers stop when the request executes
    /// and restart when a new view is installed, so steady load never trips them.
    pub(super) fn on_request_timeouts(&mut self, out: &mut Outputs) {
        if self.vc_target.is_some() || self.transfer.is_some() {
            return;
        }
        let timeout = self.cfg.options.request_timeout_ms;
        let primary = self.cfg.primary(self.view);
        let to_primary = self.member(primary);
        let mut suspect = false;
        let mut due = Vec::new();
        for p in self.pending.values() {
            let age = self.now.saturating_sub(p.since);
            if age >= 2 * timeout && self.worth_suspecting(p) {
                suspect = true;
            } else if age >= timeout && !p.forwarded {
                due.push(p.req.client);
            }
        }
        for client in due {
            let Some(p) = self.pending.get_mut(&client) else {
                continue;
            };
            p.forwarded = true;
            match self.cfg.auth {
                // Every node hears this node's endorsement, so nodes that could not
                // check the client's MAC can endorse too (endorse.rs).
                Auth::RqMac => self.send_endorsement(client, true, out),
                Auth::Mac | Auth::Sig | Auth::None if primary != self.id => {
                    out.send.push((to_primary, Message::Forward(p.req.clone())))
                }
                Auth::Mac | Auth::Sig | Auth::None => {}
            }
        }
        if suspect {
            self.suspect(self.view + 1, out);
        }
    }

    /// Resends this node's votes for instances that have not decided, so lost messages
    /// do not cost a view change.
    pub(super) fn retransmit(&mut self, out: &mut Outputs) {
        if self.vc_target.is_some() {
            return;
        }
        let view = self.view;
        let threshold = self.cfg.options.retransmit_ms;
        let primary = self.cfg.primary(view) == self.id;
        let mut msgs = Vec::new();
        let silent_after = SILENT_STATUS_PERIODS * self.cfg.options.status_ms;
        let silent: Vec<bool> =
            self.heard_at.iter().map(|h| h.is_some_and(|t| self.now > t.saturating_add(silent_after))).collect();
        for (&seq, slot) in self.log.iter_mut() {
            if slot.view != view || self.now < slot.voted_at + threshold {
                continue;
            }
            let Some((value, digest)) = &slot.value else {
                continue;
            };
            let everyone_decided = slot.decided.is_some() && slot.accepts.len() == self.cfg.node_keys.len();
            if everyone_decided {
                continue;
            }
            slot.voted_at = self.now;
            // Each peer gets only what it may still need: nothing once it reported
            // executing the instance, nor while it is silent (`heard_at`); only our
            // ACCEPT once it accepted this value (it has prepared: the proposal and our
            // WRITE are no news to it). While one node is down every slot stays short of
            // n accepts, and resending whole proposals and votes to everyone cost the
            // live nodes a large share of their throughput.
            let needs = |n: MemberIndex| self.peer_executed[n.index()] < seq && !silent[n.index()];
            let prepared = |n: MemberIndex| slot.accepts.get(&n) == Some(digest);
            let peers = MemberIndex::all(self.cfg.n()).filter(|&n| n != self.id && needs(n));
            let (behind, prepared): (Vec<MemberIndex>, Vec<MemberIndex>) = peers.partition(|&n| !prepared(n));
            if !behind.is_empty() {
                if primary {
                    msgs.push((behind.clone(), Message::Propose { view, seq, value: proposal_form(&self.cfg, value) }));
                }
                if let Some((_, sig)) = slot.writes.get(&self.id) {
                    msgs.push((behind.clone(), Message::Write(Write { view, seq, digest: *digest, sig: *sig })));
                }
            }
            if slot.accept_sent {
                msgs.push(([behind, prepared].concat(), Message::Accept { view, seq, digest: *digest }));
            }
        }
        for (peers, m) in msgs {
            // Gated like the first sending: votes leave only once their records are durable.
            out.send_after_persist.extend(peers.into_iter().map(|n| (self.member(n), m.clone())));
        }
    }
}

/// STATUS periods without a word from a peer after which it is taken for down or cut
/// off, and retransmissions to it pause until it speaks again.
const SILENT_STATUS_PERIODS: u64 = 4;

/// The whole value's bytes, once every operation is here: the bound a PROPOSE with
/// operations by digest could only partly check (`check_batch`).
pub(crate) fn check_batch_bytes(opts: &crate::config::Options, value: &Value) -> Result<(), Reject> {
    if value.size() > opts.batch_bytes_max + crate::codec::OP_BYTES_MAX {
        return Err(Reject::BadBatch("too many bytes"));
    }
    Ok(())
}

/// `value` as a PROPOSE carries it: with request digests on, large operations by digest.
pub(super) fn proposal_form(cfg: &crate::config::ClusterConfig, value: &Value) -> Proposal {
    if cfg.auth == Auth::RqMac && cfg.request_digests {
        Proposal::with_digests(value)
    } else {
        value.clone().into()
    }
}
