//! The request quorum (RQ) stage, co-located with order: `auth = rq-mac` (UpRight §4.1
//! and §4.3 "RQ overheads", ARCHITECTURE §4).
//!
//! ```text
//!   client ──Request, MAC per node──► u + r + 1 nodes (all of them on a retransmission)
//!   node, own entry valid: hold it, endorse it (MAC per node) ──Endorse──► primary
//!                          (first receipt) or all (a repeat, a request timer)
//!   node, own entry invalid or never received: r + 1 endorsements ──► endorses too, to all
//!   primary: u + r + 1 endorsements valid for it ──► PROPOSE carries them (matrix signature)
//!   backup:  accepts a proposed request on u + 1 endorsements valid for it
//!   request timer: 1st expiry sends the endorsement to all; the 2nd suspects the primary
//!                  only if this node holds 2r + 1 endorsements
//! ```
//!
//! Why MAC authenticators need this: a client can make its entries valid for some nodes
//! and invalid for others. Checked by each backup on its own (`auth = mac`), such a
//! request splits correct nodes, stalls the batch it is in, and ends in a view change.
//! Here a node never judges a proposed request by the client's MACs but by endorsements:
//! of the primary's `u + r + 1`, at most `r` come from liars, so at least `u + 1` from
//! correct nodes are valid for every node (thresholds in `quorum.rs`).
//!
//! Liveness. A correct client's request is endorsed by every correct node that gets it
//! (all of them after a retransmission): at least `u + r + 1`. A request whose client is
//! faulty may gather fewer. Each correct node that holds `r + 1` endorsements (one from a
//! correct node, so the client did send it) endorses it as well; so once `r + 1` correct
//! nodes endorse, all do and a correct primary can propose. A node suspects the primary
//! over a request only when it holds `2r + 1` endorsements (`r + 1` correct): then the
//! primary had every reason to propose it. Below that the request waits, harmlessly, for
//! its client's next one, and nobody replaces a correct primary over it.

use super::{signer_name, Outputs, Peer, Pending, Reject, Replica};
use crate::config::Auth;
use crate::crypto::{Digest, Mac};
use crate::ids::MemberIndex;
use crate::message::{
    endorse_statement, request_statement, ClientId, Endorsement, Message, NodeId, Payload, Proposed, Request,
    DIGEST_MIN,
};
use crate::service::Service;
use std::collections::BTreeMap;

/// Endorsements of requests this node cannot authenticate itself, kept until `r + 1`
/// endorsers make it endorse them; and, with request digests, endorsements that came
/// without the operation's bytes (to the primary, which usually holds them from the
/// client), kept until the client's own copy is admitted. Keyed by the request statement
/// too, so a liar that endorses a made-up request for a client cannot shadow the real
/// one. Each entry is charged to its first endorser, and each node may hold only its
/// share of `clients_max` entries and of [`HEARSAY_BYTES_MAX`]: a lying node fills its
/// own share, never a correct node's.
pub(crate) struct Hearsay {
    entries: BTreeMap<(ClientId, Digest), Heard>,
    /// Per node that may be charged: entries and request bytes charged to it.
    charged: BTreeMap<NodeId, (usize, usize)>,
}

/// Bytes of requests held on hearsay, all endorsers together.
pub const HEARSAY_BYTES_MAX: usize = 64 << 20;

/// What an entry without the operation's bytes is charged.
const HEAD_BYTES: usize = 64;

pub(crate) struct Heard {
    seq: u64,
    /// The request, once some endorsement brought its bytes.
    pub(crate) request: Option<Request>,
    pub(crate) endorsers: BTreeMap<NodeId, Vec<Mac>>,
    /// Charged the entry, and the bytes it came with (`HEAD_BYTES` without the request).
    first: NodeId,
    first_bytes: usize,
    /// When the request's bytes came after the entry: the node that sent them, charged
    /// `late_bytes` (so a liar that opened the entry cannot make them be refused).
    payer: NodeId,
    late_bytes: usize,
    since: u64,
}

/// The nodes that may be charged for hearsay: the endorsers, and with RQ nodes apart the
/// order nodes too (their relays), named by `order` (indices at an order node, stable ids
/// at an RQ node).
pub(crate) fn hearsay_chargeable(
    cfg: &crate::config::ClusterConfig,
    order: impl Iterator<Item = NodeId>,
) -> Vec<NodeId> {
    let relays: Vec<NodeId> = if cfg.rq_separated() { order.collect() } else { Vec::new() };
    relays.into_iter().chain(cfg.endorsers()).collect()
}

/// Entries one node's endorsements (or relays) may make a node hold on hearsay: its
/// share of `clients_max` among the nodes that may be charged (at least one, so
/// `clients_max` is at least the number of endorsers: `ClusterConfig` checks).
pub(crate) fn hearsay_share(cfg: &crate::config::ClusterConfig) -> usize {
    let chargeable = cfg.endorsers().len() + if cfg.rq_separated() { cfg.n() } else { 0 };
    (cfg.options.clients_max / chargeable.max(1)).max(1)
}

/// Moves the endorsements `request` carries that `valid_for_me` accepts into `valid`:
/// none of node `me`'s own, each endorser once, and no more entries looked at than
/// there are endorsers (`cap`; each costs a MAC check).
pub(crate) fn take_valid(
    request: &mut Request,
    (me, cap): (NodeId, usize),
    valid: &mut BTreeMap<NodeId, Vec<Mac>>,
    valid_for_me: impl Fn(NodeId, &[Mac]) -> bool,
) {
    for e in std::mem::take(&mut request.endorsements).into_iter().take(cap) {
        if e.node != me && !valid.contains_key(&e.node) && valid_for_me(e.node, &e.macs) {
            valid.insert(e.node, e.macs);
        }
    }
}

impl Hearsay {
    /// Hearsay from the nodes `chargeable` (the only ones charged).
    pub(crate) fn new(chargeable: Vec<NodeId>) -> Hearsay {
        Hearsay { entries: BTreeMap::new(), charged: chargeable.into_iter().map(|n| (n, (0, 0))).collect() }
    }

    /// After a membership change: `chargeable` from now on, each within `share` entries
    /// (and its share of the bytes). Entries charged to nodes no longer chargeable go, and
    /// so do the oldest of a node over its new share: a share shrinks when nodes are
    /// added, and the bound on all entries together must hold at once.
    pub(crate) fn set_chargeable(&mut self, chargeable: Vec<NodeId>, share: usize) {
        let gone: Vec<(ClientId, Digest)> =
            self.entries.iter().filter(|(_, h)| !chargeable.contains(&h.first)).map(|(k, _)| *k).collect();
        for k in gone {
            self.take(&k);
        }
        let byte_share = HEARSAY_BYTES_MAX / chargeable.len().max(1);
        self.charged = chargeable.into_iter().map(|n| (n, self.charged.get(&n).copied().unwrap_or((0, 0)))).collect();
        let mut oldest: Vec<(u64, NodeId, (ClientId, Digest))> =
            self.entries.iter().map(|(k, h)| (h.since, h.first, *k)).collect();
        oldest.sort_unstable();
        for (_, node, key) in oldest {
            let over = self.charged.get(&node).is_some_and(|(e, b)| *e > share || *b > byte_share);
            if over {
                self.take(&key);
            }
        }
    }

    fn charged_to(&mut self, node: NodeId) -> Option<&mut (usize, usize)> {
        self.charged.get_mut(&node)
    }

    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Records endorsements (`from`'s, and those it relayed) of `client`'s request `seq`
    /// with `statement`, with its bytes if they came along; the number of endorsers now,
    /// or `None` when `from` already holds its share (or is no endorser).
    pub(crate) fn add(
        &mut self,
        from: NodeId,
        (client, seq, statement): (ClientId, u64, Digest),
        request: Option<Request>,
        endorsers: BTreeMap<NodeId, Vec<Mac>>,
        now: u64,
        share: usize,
    ) -> Option<usize> {
        let byte_share = HEARSAY_BYTES_MAX / self.charged.len().max(1);
        if let Some(h) = self.entries.get_mut(&(client, statement)) {
            if let (None, Some(r)) = (&h.request, request) {
                // The bytes, late: charged to whoever brought them.
                let more = r.size();
                let Some((_, bytes)) = self.charged.get_mut(&from) else {
                    return Some(h.endorsers.len());
                };
                if *bytes + more <= byte_share {
                    *bytes += more;
                    h.request = Some(r);
                    (h.payer, h.late_bytes) = (from, more);
                }
            }
            h.endorsers.extend(endorsers);
            return Some(h.endorsers.len());
        }
        let size = request.as_ref().map_or(HEAD_BYTES, Request::size);
        let heard =
            Heard { seq, request, endorsers, first: from, first_bytes: size, payer: from, late_bytes: 0, since: now };
        let (entries, bytes) = self.charged_to(from)?;
        if *entries >= share || *bytes + size > byte_share {
            return None;
        }
        *entries += 1;
        *bytes += size;
        let count = heard.endorsers.len();
        self.entries.insert((client, statement), heard);
        Some(count)
    }

    pub(crate) fn take(&mut self, key: &(ClientId, Digest)) -> Option<Heard> {
        let h = self.entries.remove(key)?;
        // Both were charged when the entry was made (`add`), so both are endorsers.
        if let Some((entries, bytes)) = self.charged_to(h.first) {
            *entries -= 1;
            *bytes -= h.first_bytes;
        }
        if let Some((_, bytes)) = self.charged_to(h.payer) {
            *bytes -= h.late_bytes;
        }
        Some(h)
    }

    /// Drops what is known about `client`'s requests up to `seq` (executed, or held).
    pub(crate) fn forget(&mut self, client: ClientId, seq: u64) {
        let keys: Vec<(ClientId, Digest)> = self
            .entries
            .range((client, Digest([0; 32]))..=(client, Digest([0xff; 32])))
            .filter(|(_, h)| h.seq <= seq)
            .map(|(k, _)| *k)
            .collect();
        for k in keys {
            self.take(&k);
        }
    }

    /// The bytes of `client`'s operation with digest `op`, if an entry holds them.
    pub(crate) fn body(&self, client: ClientId, op: &Digest) -> Option<Payload> {
        self.entries
            .range((client, Digest([0; 32]))..=(client, Digest([0xff; 32])))
            .filter_map(|(_, h)| h.request.as_ref().map(|r| &r.op))
            .find(|o| o.digest() == *op)
            .cloned()
    }

    pub(crate) fn expire(&mut self, before: u64) {
        let old: Vec<(ClientId, Digest)> =
            self.entries.iter().filter(|(_, h)| h.since < before).map(|(k, _)| *k).collect();
        for k in old {
            self.take(&k);
        }
    }
}

impl<S: Service> Replica<S> {
    /// This node's endorsement of the request with `statement`: one MAC per node.
    fn endorsement(&self, statement: &Digest) -> Vec<Mac> {
        let s = endorse_statement(self.signer_name(), statement);
        self.endorse_row.iter().map(|k| k.mac(&s)).collect()
    }

    /// Whether node `node`'s endorsement MACs hold a valid entry for this node. Only the
    /// endorsing stage's nodes count: the RQ nodes when they run apart, else the members.
    fn endorsed_for_me(&self, node: NodeId, statement: &Digest, macs: &[Mac]) -> bool {
        let s = endorse_statement(node, statement);
        let key = if self.cfg.rq_separated() {
            let endorsers = self.cfg.endorsers();
            endorsers.offset(node).and_then(|i| self.rq_row.get(i))
        } else {
            self.endorse_row.get(node.0 as usize)
        };
        match (key, macs.get(self.id.index())) {
            (Some(key), Some(mac)) => key.verify(&s, mac),
            _ => false,
        }
    }

    /// Holds an authenticated request (its client's MAC, or `r + 1` endorsements) as
    /// pending; with `auth = rq-mac` also endorses it and sends the endorsement to the
    /// primary, or to all when `to_all` (this node is late: others already spoke).
    /// `direct`: the request came from its client, so this node will reply to it.
    pub(super) fn admit(
        &mut self,
        req: Request,
        endorsers: BTreeMap<NodeId, Vec<Mac>>,
        to_all: bool,
        direct: bool,
        out: &mut Outputs,
    ) -> Result<(), Reject> {
        let client = req.client;
        if !self.pending.contains_key(&client) && self.pending.len() >= self.cfg.options.clients_max {
            return Err(Reject::Busy("pending requests"));
        }
        self.pending_order += 1;
        let mut pending = Pending {
            req,
            order: self.pending_order,
            since: self.now,
            forwarded: false,
            in_flight: false,
            endorsers,
            broadcast_at: 0,
            direct,
        };
        if self.cfg.auth == Auth::RqMac {
            let statement = pending.req.statement();
            // Endorsements heard before this node held the request (checked on arrival).
            if let Some(h) = self.hearsay.take(&(client, statement)) {
                for (node, macs) in h.endorsers {
                    pending.endorsers.entry(node).or_insert(macs);
                }
            }
            if !self.cfg.rq_separated() {
                let mine = self.endorsement(&statement);
                pending.endorsers.insert(self.signer_name(), mine);
            }
            self.hearsay.forget(client, pending.req.seq);
        }
        self.pending.insert(client, pending);
        if self.cfg.auth == Auth::RqMac && self.cfg.rq_separated() {
            self.fill_parked(client, out);
        } else if self.cfg.auth == Auth::RqMac {
            self.send_endorsement(client, to_all, out);
            self.fill_parked(client, out);
        }
        self.maybe_propose(out);
        Ok(())
    }

    /// Sends this node's endorsement of `client`'s pending request to the primary of the
    /// current view, or to every node. To every node it also relays the endorsements it
    /// holds from others (in the request's `endorsements`): each stays checkable by its
    /// recipients, and a node that missed one (its endorser moved on to the client's next
    /// request) can still count it.
    pub(super) fn send_endorsement(&mut self, client: ClientId, to_all: bool, out: &mut Outputs) {
        if self.cfg.rq_separated() {
            if to_all {
                self.relay_endorsements(client, out);
            }
            return;
        }
        let Some(p) = self.pending.get(&client) else {
            return;
        };
        let Some(macs) = p.endorsers.get(&self.signer_name()) else {
            return;
        };
        let primary = self.cfg.primary(self.view);
        if !to_all {
            if primary != self.id {
                // With request digests the primary is spared the bytes: it usually holds
                // them from the client (rq-mac clients start at the primary unless it
                // stopped answering them), and if it does not, the endorsement to all on
                // this node's request timer or the client's retransmission brings them.
                let msg = if self.cfg.request_digests && p.req.op.len() > DIGEST_MIN {
                    Message::EndorseDigest { client, seq: p.req.seq, op: p.req.op.digest(), macs: macs.clone() }
                } else {
                    Message::Endorse { request: p.req.clone(), macs: macs.clone() }
                };
                out.send.push((self.member(primary), msg));
            }
            return;
        }
        let relayed = p
            .endorsers
            .iter()
            .filter(|(n, _)| **n != self.signer_name())
            .map(|(&node, macs)| Endorsement { node, macs: macs.clone() })
            .collect();
        let msg = Message::Endorse { request: Request { endorsements: relayed, ..p.req.clone() }, macs: macs.clone() };
        self.broadcast(msg, out);
        if let Some(p) = self.pending.get_mut(&client) {
            p.broadcast_at = self.now;
        }
    }

    /// Node `from` endorses a client request (and may relay others' endorsements of it).
    pub(super) fn on_endorse(
        &mut self,
        from: NodeId,
        mut request: Request,
        macs: Vec<Mac>,
        out: &mut Outputs,
    ) -> Result<(), Reject> {
        if self.cfg.auth != Auth::RqMac {
            return Err(Reject::WrongPeer);
        }
        self.check_session(self.peer_of(from), request.client)?;
        let statement = request.statement();
        if !self.endorsed_for_me(from, &statement, &macs) {
            return Err(Reject::BadEndorsement { node: from });
        }
        if request.seq <= self.exec.last_seq(request.client) {
            return Ok(());
        }
        let mut valid = BTreeMap::from([(from, macs)]);
        let check = |node, macs: &[Mac]| self.endorsed_for_me(node, &statement, macs);
        take_valid(&mut request, (self.signer_name(), self.cfg.endorsers().len()), &mut valid, check);
        self.take_endorsed(from, request, statement, valid, out)
    }

    /// With RQ nodes of their own, an order node's request timer relays the RQ
    /// endorsements it holds of `client`'s pending request to every order node and RQ
    /// node, so the primary (and each backup) can count them: an order node has no
    /// endorsement of its own to give (UpRight §4.1: order nodes judge requests by RQ
    /// nodes' word only).
    fn relay_endorsements(&mut self, client: ClientId, out: &mut Outputs) {
        let Some(p) = self.pending.get_mut(&client) else {
            return;
        };
        p.broadcast_at = self.now;
        let endorsements = p.endorsers.iter().map(|(&node, macs)| Endorsement { node, macs: macs.clone() }).collect();
        let msg = Message::Forward(Request { auth: Vec::new(), endorsements, ..p.req.clone() });
        // RQ nodes too: those that could not check the client's entry endorse on r + 1
        // peers' word (rq_node.rs), so the primary gets u + r + 1 once r + 1 correct RQ
        // nodes vouch.
        for rq in self.cfg.endorsers() {
            out.send.push((Peer::Node(rq), msg.clone()));
        }
        self.broadcast(msg, out);
    }

    /// Order node `from` relays RQ endorsements of a client request (with RQ nodes of
    /// their own): each counts if valid for this node, whoever relayed it, and the
    /// relaying node is charged for what this node holds on its word (charging an
    /// endorser would let a lying relayer fill a correct endorser's share with its old
    /// endorsements, or a lying endorser block the relay by filling its own).
    pub(super) fn on_relayed(
        &mut self,
        from: MemberIndex,
        mut request: Request,
        out: &mut Outputs,
    ) -> Result<(), Reject> {
        if !self.cfg.rq_separated() {
            return Err(Reject::WrongPeer);
        }
        self.check_session(self.member(from), request.client)?;
        if request.seq <= self.exec.last_seq(request.client) {
            return Ok(());
        }
        let statement = request.statement();
        let mut valid = BTreeMap::new();
        let check = |node, macs: &[Mac]| self.endorsed_for_me(node, &statement, macs);
        take_valid(&mut request, (self.signer_name(), self.cfg.endorsers().len()), &mut valid, check);
        if valid.is_empty() {
            return Err(Reject::BadEndorsement { node: signer_name(from) });
        }
        self.take_endorsed(signer_name(from), request, statement, valid, out)
    }

    /// Counts endorsements `valid` (each checked for this node) of `request`: toward the
    /// request this node holds, or else, with this node's own entry of the client's
    /// authenticator valid, the request is admitted; failing that, `r + 1` endorsers'
    /// word admits it (hearsay charged to `charged` until then).
    fn take_endorsed(
        &mut self,
        charged: NodeId,
        request: Request,
        statement: Digest,
        valid: BTreeMap<NodeId, Vec<Mac>>,
        out: &mut Outputs,
    ) -> Result<(), Reject> {
        if let Some(p) = self.pending.get_mut(&request.client) {
            if p.req.seq > request.seq {
                return Ok(());
            }
            if p.req.seq == request.seq && p.req.statement() == statement {
                p.endorsers.extend(valid);
                self.maybe_propose(out);
                return Ok(());
            }
        }
        // Not held yet: this node's own entry of the client's authenticator decides, or
        // failing that, r + 1 nodes' word. Order nodes of a separate RQ stage take only
        // the word of RQ nodes (the client sends them no requests).
        if !self.cfg.rq_separated() && self.check_mac(&request).is_ok() {
            return self.admit(request, valid, true, false, out);
        }
        let key = (request.client, statement);
        let head = (request.client, request.seq, statement);
        match self.hearsay.add(charged, head, Some(request), valid, self.now, self.hearsay_share()) {
            None => Err(Reject::Busy("endorsements held for this node")),
            Some(count) if count >= self.cfg.quorums.endorse_amplify() => match self.hearsay.take(&key) {
                Some(Heard { request: Some(request), endorsers, .. }) => {
                    self.admit(request, endorsers, true, false, out)
                }
                _ => Ok(()),
            },
            Some(_) => Ok(()),
        }
    }

    /// Whether `node` is a request-quorum node of a separate RQ stage.
    pub(super) fn is_rq_peer(&self, node: NodeId) -> bool {
        self.cfg.rq_separated() && self.cfg.endorsers().contains(&node)
    }

    /// What an RQ node of a separate RQ stage may send an order node: endorsements, the
    /// operations a FETCH-BODIES asked it for, and EPOCH-QUERY.
    pub(super) fn on_rq_message(&mut self, from: NodeId, msg: Message, out: &mut Outputs) -> Result<(), Reject> {
        match msg {
            Message::Endorse { request, macs } => self.on_endorse(from, request, macs, out),
            Message::EndorseDigest { client, seq, op, macs } => {
                self.on_endorse_digest(from, client, seq, op, macs, out)
            }
            Message::Bodies { seq, ops } => self.on_bodies(from, seq, ops, out),
            // It follows membership changes as clients do (rq_node.rs).
            Message::EpochQuery { epoch, .. } => {
                let certs = self.epoch_certs_after(epoch);
                if !certs.is_empty() {
                    out.send.push((Peer::Node(from), Message::EpochCerts(certs)));
                }
                Ok(())
            }
            _ => Err(Reject::WrongPeer),
        }
    }

    /// Entries one node's endorsements (or relays) may make this node hold on hearsay.
    fn hearsay_share(&self) -> usize {
        hearsay_share(&self.cfg)
    }

    /// Node `from` endorses a client request without its bytes (request digests; sent to
    /// the primary on first receipt): counted toward the request this node holds, or kept
    /// on hearsay until the client's own copy is admitted.
    pub(super) fn on_endorse_digest(
        &mut self,
        from: NodeId,
        client: ClientId,
        seq: u64,
        op: Digest,
        macs: Vec<Mac>,
        out: &mut Outputs,
    ) -> Result<(), Reject> {
        if self.cfg.auth != Auth::RqMac {
            return Err(Reject::WrongPeer);
        }
        self.check_session(self.peer_of(from), client)?;
        let statement = request_statement(client, seq, &op);
        if !self.endorsed_for_me(from, &statement, &macs) {
            return Err(Reject::BadEndorsement { node: from });
        }
        if seq <= self.exec.last_seq(client) {
            return Ok(());
        }
        if let Some(p) = self.pending.get_mut(&client) {
            if p.req.seq > seq {
                return Ok(());
            }
            if p.req.seq == seq && p.req.statement() == statement {
                p.endorsers.insert(from, macs);
                self.maybe_propose(out);
                return Ok(());
            }
        }
        let endorsers = BTreeMap::from([(from, macs)]);
        match self.hearsay.add(from, (client, seq, statement), None, endorsers, self.now, self.hearsay_share()) {
            None => Err(Reject::Busy("endorsements held for this node")),
            Some(_) => Ok(()),
        }
    }

    /// Whether the primary holds enough endorsements to propose `p`.
    pub(super) fn proposable(&self, p: &Pending) -> bool {
        self.cfg.auth != Auth::RqMac || p.endorsers.len() >= self.cfg.quorums.endorse_propose()
    }

    /// Whether this node's request timer may suspect the primary over `p`.
    pub(super) fn worth_suspecting(&self, p: &Pending) -> bool {
        self.cfg.auth != Auth::RqMac || p.endorsers.len() >= self.cfg.quorums.endorse_suspect()
    }

    /// `p`'s request as the primary proposes it: with `auth = rq-mac`, the endorsements
    /// instead of the client's authenticator (the backups judge by those).
    pub(super) fn proposed_form(&self, p: &Pending) -> Request {
        if self.cfg.auth != Auth::RqMac {
            return p.req.clone();
        }
        let endorsements = p
            .endorsers
            .iter()
            .take(self.cfg.quorums.endorse_propose())
            .map(|(&node, macs)| Endorsement { node, macs: macs.clone() })
            .collect();
        Request { auth: Vec::new(), endorsements, ..p.req.clone() }
    }

    /// A backup's admission check of a proposed request.
    pub(super) fn check_proposed_request(&self, r: &Proposed) -> Result<(), Reject> {
        match (self.cfg.auth, r) {
            (Auth::None, _) => Ok(()),
            // Nodes do not lie with r = 0: the primary checked the client (or a backup it
            // trusts did), and the backup's own entry may be the one the client got wrong.
            (Auth::Mac, _) if !self.cfg.quorums.byzantine() => Ok(()),
            (Auth::Mac | Auth::Sig, Proposed::Full(r)) => self.check_mac(r),
            (Auth::Mac | Auth::Sig, Proposed::Digest(_)) => {
                Err(Reject::BadBatch("an operation by digest without auth = rq-mac"))
            }
            (Auth::RqMac, r) => self.check_endorsements(r),
        }
    }

    /// Whether this node holds `r` itself, admitted after checking its client's MAC or
    /// signature (or, with rq-mac, endorsed on r + 1 nodes' word): no need to check again.
    pub(super) fn holds_verified(&self, r: &Request) -> bool {
        self.holds_verified_statement(r.client, r.seq, &r.statement())
    }

    fn holds_verified_statement(&self, client: ClientId, seq: u64, statement: &Digest) -> bool {
        self.pending.get(&client).is_some_and(|p| {
            p.req.seq == seq
                && p.req.statement() == *statement
                && (self.cfg.auth != Auth::RqMac
                    || p.endorsers.contains_key(&self.signer_name())
                    || self.cfg.rq_separated() && p.endorsers.len() >= self.cfg.quorums.endorse_accept())
        })
    }

    fn check_endorsements(&self, r: &Proposed) -> Result<(), Reject> {
        let statement = r.statement();
        if self.holds_verified_statement(r.client(), r.seq(), &statement) {
            return Ok(());
        }
        // Each endorser once, by its position among the endorsers (a contiguous range of
        // at most NODES_MAX names); anything else is no endorser.
        let endorsers = self.cfg.endorsers();
        let mut seen = [false; crate::quorum::NODES_MAX];
        let mut valid = 0;
        for e in r.endorsements() {
            let Some(s) = endorsers.offset(e.node).and_then(|i| seen.get_mut(i)) else {
                continue;
            };
            if !*s && self.endorsed_for_me(e.node, &statement, &e.macs) {
                *s = true;
                valid += 1;
            }
        }
        if valid >= self.cfg.quorums.endorse_accept() {
            Ok(())
        } else {
            Err(Reject::BadBatch("a request without enough valid endorsements"))
        }
    }

    /// Drops hearsay older than four request timeouts: its client has long retransmitted,
    /// or gave up.
    pub(super) fn expire_hearsay(&mut self) {
        let keep = 4 * self.cfg.options.request_timeout_ms;
        self.hearsay.expire(self.now.saturating_sub(keep));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(h: &mut Hearsay, from: NodeId, client: ClientId, share: usize) -> Option<usize> {
        let statement = Digest::of(&client.0.to_le_bytes());
        h.add(from, (client, 1, statement), None, BTreeMap::from([(from, Vec::new())]), client.0, share)
    }

    #[test]
    fn a_membership_change_trims_hearsay_to_the_new_shares() {
        // Three chargeable nodes with shares of 4: node 1 fills its share, node 2 holds 2.
        let mut h = Hearsay::new(vec![NodeId(0), NodeId(1), NodeId(2)]);
        for c in 0..4 {
            assert_eq!(entry(&mut h, NodeId(1), ClientId(c), 4), Some(1));
        }
        assert_eq!(entry(&mut h, NodeId(1), ClientId(4), 4), None, "its share is full");
        entry(&mut h, NodeId(2), ClientId(10), 4);
        entry(&mut h, NodeId(2), ClientId(11), 4);
        assert_eq!(h.len(), 6);
        // Node 2 leaves and node 3 joins, and shares shrink to 3: node 2's entries go, and
        // node 1's oldest beyond 3.
        h.set_chargeable(vec![NodeId(0), NodeId(1), NodeId(3)], 3);
        assert_eq!(h.len(), 3);
        assert!(h.entries.keys().all(|(c, _)| (1..4).contains(&c.0)), "the newest of node 1's stay");
        assert_eq!(entry(&mut h, NodeId(1), ClientId(20), 3), None, "still at its share");
        assert_eq!(entry(&mut h, NodeId(3), ClientId(21), 3), Some(1), "the new node has a share");
        assert_eq!(entry(&mut h, NodeId(2), ClientId(22), 3), None, "a node no longer chargeable has none");
    }
}
