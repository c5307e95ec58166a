//! A request-quorum (RQ) node of a separate RQ stage (UpRight §4.1, §4.3; ARCHITECTURE
//! §2, §4): it turns a client's MAC authenticator into a matrix signature the order
//! nodes can all check.
//!
//! ```text
//!   client ──Request, MAC per node──► u + r + 1 RQ nodes (all of them on a retransmission)
//!   RQ node, own entry valid: hold it, endorse it (MAC per order node and RQ peer)
//!            ──Endorse──► primary (first receipt) or all order nodes and RQ peers (a repeat)
//!   RQ node, own entry invalid: r + 1 peers' endorsements ──► endorses too, to all
//!   order node: holds a request on r + 1 endorsements; the primary proposes it with
//!               u + r + 1, a backup accepts it on u + 1 (replica/endorse.rs)
//!   order node ──FETCH-BODIES──► an endorser, for operations proposed by digest
//! ```
//!
//! `2u + r + 1` RQ nodes: with `u` of them faulty, `u + r + 1` correct ones endorse a
//! correct client's request, as many as the primary needs.
//!
//! Why an RQ node keeps nothing on disk but the epoch certificates it followed (UpRight
//! logs requests at the RQ): order nodes
//! hold every byte of a value before they vote for it (replica/bodies.rs), so a decision
//! never depends on an RQ node's memory, and a restarted RQ node starts clean, as the
//! paper's hot spares do. A request that was endorsed but not ordered when RQ nodes
//! crash is retransmitted by its client.
//!
//! Names: order nodes by their stable ids, RQ peers by [`crate::config::stage_node`] of
//! theirs. Membership changes: an RQ node asks the order nodes every STATUS period
//! whether their epoch is newer than its own (EPOCH-QUERY) and follows the epoch
//! certificates they answer with, as a client does; its endorsements carry one MAC per
//! order node of its epoch, so until it follows, nodes of the next epoch find them
//! invalid and the client's retransmission reaches them again.
//!
//! Bounds. One request per client is held (the newest, plus the one before it, whose
//! bytes order nodes may still fetch), for at most `clients_max` clients; a client's
//! next request replaces its last (a client has one operation in flight per session).
//! Endorsements of requests this node could not check itself wait in `Hearsay` (replica/endorse.rs), each
//! peer filling only its share. Entries nobody touched for four request timeouts go.

use crate::config::{stage_id, ClusterConfig};
use crate::crypto::{Digest, Mac, MacKey, SigningKey};
use crate::keys::{client_mac_key, endorse_key};
use crate::message::{endorse_statement, ClientId, Endorsement, Message, NodeId, Payload, Request, Seq, View};
use crate::replica::{budgeted_bodies, hearsay_chargeable, hearsay_share, take_valid, Hearsay};
use crate::step::{check_session, Event, Input, Outputs, Peer, Reject};
use crate::timeout::Timeout;
use std::collections::BTreeMap;

/// A client request this node endorsed.
struct Held {
    req: Request,
    /// Endorsements valid for this node, its own among them.
    endorsers: BTreeMap<NodeId, Vec<Mac>>,
    /// When this node last sent its endorsement to every node.
    broadcast_at: u64,
    /// When the client (or a peer) last spoke of it.
    touched: u64,
}

/// Operation bytes of the requests held (and the ones before them) at most: a client
/// may send operations of up to `OP_BYTES_MAX` from each of its sessions.
pub const HELD_BYTES_MAX: usize = 256 << 20;

pub struct RqNode {
    cfg: ClusterConfig,
    id: NodeId,
    signing: SigningKey,
    mac_secret: [u8; 32],
    /// Per order node (in index order) and then per RQ node (in order): the key this
    /// node's endorsements for it are MACed with, and its endorsements for this node
    /// checked.
    row: Vec<MacKey>,
    /// The view each order node (by stable id) last reported (STATUS), and the one
    /// believed from them (worked out per STATUS, not per request).
    views: BTreeMap<NodeId, View>,
    view: View,
    /// The epoch query to order nodes and RQ peers (a membership change it missed).
    query_timeout: Timeout,
    /// The epoch certificates this node followed from epoch 0 (the newest
    /// [`crate::codec::EPOCH_CERTS_MAX`]), for an RQ peer that restarted empty after
    /// every order node it knows of was removed.
    epoch_certs: Vec<crate::message::EpochCert>,
    held: BTreeMap<ClientId, Held>,
    /// Each client's request before the held one: order nodes may still fetch its bytes.
    previous: BTreeMap<ClientId, Request>,
    /// Operation bytes in `held` and `previous`, and their bound ([`HELD_BYTES_MAX`]).
    held_bytes: usize,
    held_bytes_max: usize,
    hearsay: Hearsay,
    /// Per order node (by stable id): (period start, bytes of operations sent it this
    /// period).
    body_budget: BTreeMap<NodeId, (u64, usize)>,
    now: u64,
}

impl crate::node::Node for RqNode {
    fn step(&mut self, now: u64, input: Input, out: &mut Outputs) {
        RqNode::step(self, now, input, out)
    }

    fn config(&self) -> &ClusterConfig {
        RqNode::config(self)
    }

    fn status(&self) -> crate::node::NodeStatus {
        let cfg = self.config();
        crate::node::NodeStatus {
            view: self.view(),
            view_change_to: None,
            executed: Seq(0),
            stable: Seq(0),
            transfer: None,
            peers: cfg.n() + cfg.rq_ids().len() - 1,
        }
    }

    fn admit(&self, from: NodeId, epoch: u64, msg: Message, _checked: bool) -> crate::node::Admit {
        crate::node::admit_at_stage_node(self.config(), from, epoch, msg)
    }
}

impl RqNode {
    /// RQ node `id` of `cfg` (one of [`ClusterConfig::endorsers`]), with its signing key
    /// and the secret its clients' MAC keys derive from.
    ///
    /// # Panics
    /// If `id` is not an RQ node of `cfg` or `signing` is not its key (a configuration
    /// error, caught at start-up).
    pub fn new(cfg: ClusterConfig, id: NodeId, signing: SigningKey, mac_secret: [u8; 32]) -> RqNode {
        let endorsers = cfg.endorsers();
        assert!(cfg.rq_separated() && endorsers.contains(&id), "node {id} is not an RQ node");
        assert_eq!(endorsers.offset(id).map(|i| cfg.stages.rq[i]), Some(signing.public()), "signing key mismatch");
        RqNode {
            hearsay: Hearsay::new(hearsay_chargeable(&cfg, order_ids(&cfg))),
            row: endorse_row(&cfg, &signing),
            views: BTreeMap::new(),
            view: View(0),
            query_timeout: Timeout::every(cfg.options.status_ms),
            epoch_certs: Vec::new(),
            body_budget: BTreeMap::new(),
            held: BTreeMap::new(),
            previous: BTreeMap::new(),
            held_bytes: 0,
            held_bytes_max: HELD_BYTES_MAX,
            cfg,
            id,
            signing,
            mac_secret,
            now: 0,
        }
    }

    pub fn id(&self) -> NodeId {
        self.id
    }

    /// Requests held (endorsed by this node), for metrics and tests.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    /// The view this node believes current: the highest that `r + 1` order nodes reported
    /// (so `r` liars cannot move it), 0 before anyone spoke.
    pub fn view(&self) -> View {
        self.view
    }

    pub fn status_line(&self) -> String {
        format!("rq view={} held={} hearsay={}", self.view(), self.held.len(), self.hearsay.len())
    }

    /// The membership epoch this node endorses for.
    pub fn epoch(&self) -> u64 {
        self.cfg.epoch()
    }

    /// The epoch certificates this node followed (oldest first), which its driver keeps
    /// across a restart: RQ nodes hold no other state, but one that restarted in epoch 0
    /// after every order node of epoch 0 was removed would have nobody to ask.
    pub fn epoch_certs(&self) -> &[crate::message::EpochCert] {
        &self.epoch_certs
    }

    /// Follows `certs` (as kept from [`RqNode::epoch_certs`] before a restart).
    ///
    /// # Errors
    /// If they do not follow this node's membership.
    pub fn follow(&mut self, certs: Vec<crate::message::EpochCert>) -> Result<(), Reject> {
        self.on_epoch_certs(certs, &mut Outputs::default())
    }

    pub fn config(&self) -> &ClusterConfig {
        &self.cfg
    }

    pub fn step(&mut self, now: u64, input: Input, out: &mut Outputs) {
        self.now = self.now.max(now);
        match input {
            Input::Tick => self.on_tick(out),
            Input::Message { from, msg } => self.on_message(from, msg, out),
            Input::Checked { from, msg } => self.on_message(Peer::Node(from), msg, out),
            Input::CheckpointReady(_) => {}
            // It never asks for a durability barrier.
            Input::Drained => {}
        }
        self.invariants();
    }

    fn is_peer(&self, node: NodeId) -> bool {
        node != self.id && self.cfg.endorsers().contains(&node)
    }

    /// Whether `node` is an order node of this node's epoch (by stable id).
    fn is_order_node(&self, node: NodeId) -> bool {
        self.cfg.membership.index_of(node).is_some()
    }

    fn on_message(&mut self, from: Peer, msg: Message, out: &mut Outputs) {
        let kind = msg.kind();
        let result = match (from, msg) {
            (Peer::Client(c), Message::Request(req)) => self.on_request(c, req, out),
            (Peer::Node(o), Message::Status { view, .. }) if self.is_order_node(o) => {
                self.views.insert(o, view);
                let mut views: Vec<View> = self.views.values().copied().collect();
                views.sort_unstable_by(|a, b| b.cmp(a));
                self.view = views.get(self.cfg.quorums.r() as usize).copied().unwrap_or_default();
                Ok(())
            }
            (Peer::Node(o), Message::FetchBodies { seq, wanted }) if self.is_order_node(o) => {
                self.on_fetch_bodies(o, seq, wanted, out)
            }
            (Peer::Node(p), Message::Endorse { request, macs }) if self.is_peer(p) => {
                self.on_endorse(p, request, macs, out)
            }
            (Peer::Node(o), Message::Forward(request)) if self.is_order_node(o) => self.on_relayed(o, request, out),
            // Self-certifying, from whichever order node or RQ peer answered (membership.rs).
            (Peer::Node(o), Message::EpochCerts(certs)) if stage_id(o).is_none() || self.is_peer(o) => {
                self.on_epoch_certs(certs, out)
            }
            (Peer::Node(p), Message::EpochQuery { epoch, .. }) if self.is_peer(p) => {
                let certs = crate::epoch_cert::certs_after(&self.epoch_certs, epoch);
                if !certs.is_empty() {
                    out.send.push((Peer::Node(p), Message::EpochCerts(certs)));
                }
                Ok(())
            }
            (Peer::Node(_), _) | (Peer::Client(_), _) => Err(Reject::WrongPeer),
        };
        if let Err(reason) = result {
            out.events.push(Event::Rejected { from, kind, reason });
        }
    }

    fn on_tick(&mut self, out: &mut Outputs) {
        if !self.stays_in_epoch() && self.query_timeout.fire(self.now) {
            let query = Message::EpochQuery { client: ClientId(0), epoch: self.cfg.epoch() };
            let peers: Vec<NodeId> = self.cfg.endorsers().filter(|&p| p != self.id).collect();
            for to in order_ids(&self.cfg).chain(peers) {
                out.send.push((Peer::Node(to), query.clone()));
            }
        }
        // A client retransmits every few hundred ms while its request is unordered, and
        // order nodes fetch bytes right after a proposal: four request timeouts untouched
        // means the request was ordered (and its client moved on) or abandoned.
        let before = self.now.saturating_sub(4 * self.cfg.options.request_timeout_ms);
        self.hearsay.expire(before);
        let stale: Vec<ClientId> = self.held.iter().filter(|(_, h)| h.touched < before).map(|(c, _)| *c).collect();
        for c in stale {
            self.drop_client(c);
        }
    }

    /// Certificates of later epochs (from an order node, or an RQ peer that followed
    /// them): this node endorses for the newest from now on.
    /// Endorsements it holds were made for the old members: its own are made again, its
    /// peers' are dropped (they send new ones once they follow too).
    /// The deliberate bug `rq-stays-in-epoch`: it never follows a membership change.
    fn stays_in_epoch(&self) -> bool {
        self.cfg.quorums.mutation() == Some(crate::quorum::Mutation::RqStaysInEpoch)
    }

    fn on_epoch_certs(&mut self, certs: Vec<crate::message::EpochCert>, out: &mut Outputs) -> Result<(), Reject> {
        if self.stays_in_epoch() {
            return Ok(());
        }
        let (at, chain) = crate::epoch_cert::follow_certs(&self.cfg.membership, certs, self.cfg.quorums.mutation())
            .map_err(|_| Reject::BadProof("epoch certificates do not follow this node's membership"))?;
        if chain.is_empty() {
            return Ok(());
        }
        self.cfg = self.cfg.next_epoch(at).map_err(|_| Reject::BadProof("membership without valid quorums"))?;
        self.epoch_certs.extend(chain);
        let excess = self.epoch_certs.len().saturating_sub(crate::codec::EPOCH_CERTS_MAX);
        self.epoch_certs.drain(..excess);
        self.row = endorse_row(&self.cfg, &self.signing);
        self.views.clear();
        self.view = View(0);
        self.body_budget.clear();
        let share = hearsay_share(&self.cfg);
        self.hearsay.set_chargeable(hearsay_chargeable(&self.cfg, order_ids(&self.cfg)), share);
        let clients: Vec<ClientId> = self.held.keys().copied().collect();
        for c in clients {
            let statement = self.held[&c].req.statement();
            let mine = self.endorsement(&statement);
            if let Some(h) = self.held.get_mut(&c) {
                h.endorsers = BTreeMap::from([(self.id, mine)]);
                // Its client spoke lately, so it may still be waiting: the new members
                // hear of the request now rather than at its retransmission.
                h.broadcast_at = 0;
                if h.touched + self.cfg.options.retransmit_ms >= self.now {
                    self.broadcast_endorsement(c, out);
                }
            }
        }
        Ok(())
    }

    fn drop_client(&mut self, client: ClientId) {
        self.held_bytes -= self.held.remove(&client).map_or(0, |h| h.req.op.len());
        self.drop_previous(client);
    }

    /// Forgets `client`'s request before the held one (and its bytes).
    fn drop_previous(&mut self, client: ClientId) {
        self.held_bytes -= self.previous.remove(&client).map_or(0, |r| r.op.len());
    }

    /// A client's request: endorsed if this node's entry of its authenticator is valid.
    fn on_request(&mut self, from: ClientId, req: Request, out: &mut Outputs) -> Result<(), Reject> {
        check_session(Peer::Client(from), req.client)?;
        let statement = req.statement();
        if !self.client_entry_valid(&req, &statement) {
            return Err(Reject::BadMac { client: req.client });
        }
        if let Some(h) = self.held.get_mut(&req.client) {
            if h.req.seq > req.seq || h.req.seq == req.seq && h.req.statement() != statement {
                // An older request, or another under a sequence number already endorsed:
                // a correct client sends neither.
                return Ok(());
            }
            if h.req.seq == req.seq {
                // The client retransmitted: the primary may not have received enough, so
                // every node hears it now (UpRight §4.3), at most once per period.
                h.touched = self.now;
                if self.now >= h.broadcast_at + self.cfg.options.retransmit_ms {
                    self.broadcast_endorsement(req.client, out);
                }
                return Ok(());
            }
        }
        self.endorse(req, BTreeMap::new(), false, out)
    }

    /// Holds `req` (authenticated by its client's MAC or by `r + 1` peers), endorses it,
    /// and sends the endorsement to the primary, or to everyone when `to_all`.
    fn endorse(
        &mut self,
        req: Request,
        mut endorsers: BTreeMap<NodeId, Vec<Mac>>,
        to_all: bool,
        out: &mut Outputs,
    ) -> Result<(), Reject> {
        let client = req.client;
        if !self.held.contains_key(&client) && self.held.len() >= self.cfg.options.clients_max {
            return Err(Reject::Busy("requests held by this RQ node"));
        }
        let size = req.op.len();
        if self.held_bytes + size > self.held_bytes_max {
            // Requests before the held ones go first (wanted only by a late fetch).
            let clients: Vec<ClientId> = self.previous.keys().copied().collect();
            for c in clients {
                self.drop_previous(c);
            }
            if self.held_bytes + size > self.held_bytes_max {
                return Err(Reject::Busy("request bytes held by this RQ node"));
            }
        }
        let statement = req.statement();
        if let Some(h) = self.hearsay.take(&(client, statement)) {
            for (node, macs) in h.endorsers {
                endorsers.entry(node).or_insert(macs);
            }
        }
        self.hearsay.forget(client, req.seq);
        endorsers.insert(self.id, self.endorsement(&statement));
        let held = Held { req, endorsers, broadcast_at: 0, touched: self.now };
        self.held_bytes += size;
        if let Some(old) = self.held.insert(client, held) {
            self.drop_previous(client);
            self.previous.insert(client, old.req);
        }
        if to_all {
            self.broadcast_endorsement(client, out);
        } else if let Some(h) = self.held.get(&client) {
            let primary = self.cfg.membership.id_of(self.cfg.primary(self.view()));
            let msg = Message::Endorse { request: Self::for_order(&h.req), macs: h.endorsers[&self.id].clone() };
            out.send.extend(primary.map(|p| (Peer::Node(p), msg)));
        }
        Ok(())
    }

    /// `req` as order nodes get it: without the client's authenticator, which they
    /// cannot check (the client MACs its request for the RQ nodes).
    fn for_order(req: &Request) -> Request {
        Request { auth: Vec::new(), endorsements: Vec::new(), ..req.clone() }
    }

    /// This node's endorsement of the request with `statement`: one MAC per order node,
    /// then one per RQ node.
    fn endorsement(&self, statement: &Digest) -> Vec<Mac> {
        let s = endorse_statement(self.id, statement);
        self.row.iter().map(|k| k.mac(&s)).collect()
    }

    /// Sends this node's endorsement of `client`'s held request, with the peers'
    /// endorsements it holds, to every order node and RQ peer. Peers get the client's
    /// authenticator too, so one whose entry is valid endorses at once.
    fn broadcast_endorsement(&mut self, client: ClientId, out: &mut Outputs) {
        let Some(h) = self.held.get_mut(&client) else {
            return;
        };
        h.broadcast_at = self.now;
        let relayed: Vec<Endorsement> = h
            .endorsers
            .iter()
            .filter(|(n, _)| **n != self.id)
            .map(|(&node, macs)| Endorsement { node, macs: macs.clone() })
            .collect();
        let macs = h.endorsers[&self.id].clone();
        let to_order = Message::Endorse {
            request: Request { endorsements: relayed.clone(), ..Self::for_order(&h.req) },
            macs: macs.clone(),
        };
        let to_peers = Message::Endorse { request: Request { endorsements: relayed, ..h.req.clone() }, macs };
        for o in order_ids(&self.cfg) {
            out.send.push((Peer::Node(o), to_order.clone()));
        }
        for p in self.cfg.endorsers().filter(|&p| p != self.id) {
            out.send.push((Peer::Node(p), to_peers.clone()));
        }
    }

    /// Whether node `node`'s endorsement MACs hold a valid entry for this node.
    fn endorsed_for_me(&self, node: NodeId, statement: &Digest, macs: &[Mac]) -> bool {
        let (Some(mine), Some(theirs)) = (self.cfg.rq_entry(self.id), self.cfg.rq_entry(node)) else {
            return false;
        };
        let s = endorse_statement(node, statement);
        match (self.row.get(theirs), macs.get(mine)) {
            (Some(key), Some(mac)) => key.verify(&s, mac),
            _ => false,
        }
    }

    /// RQ peer `from` endorses a request (after its client's retransmission, or on
    /// `r + 1` others' word). This node endorses it too if the client's entry for it is
    /// valid, or once `r + 1` peers vouch: then, once `r + 1` correct RQ nodes endorse a
    /// request, every correct one does, and a correct primary gets its `u + r + 1`.
    fn on_endorse(
        &mut self,
        from: NodeId,
        mut request: Request,
        macs: Vec<Mac>,
        out: &mut Outputs,
    ) -> Result<(), Reject> {
        check_session(Peer::Node(from), request.client)?;
        let statement = request.statement();
        if !self.endorsed_for_me(from, &statement, &macs) {
            return Err(Reject::BadEndorsement { node: from });
        }
        let mut valid = BTreeMap::from([(from, macs)]);
        self.take_valid(&mut request, &statement, &mut valid);
        self.on_endorsements(from, request, statement, valid, out)
    }

    /// Moves the endorsements in `request` that are valid for this node into `valid`.
    fn take_valid(&self, request: &mut Request, statement: &Digest, valid: &mut BTreeMap<NodeId, Vec<Mac>>) {
        let check = |node, macs: &[Mac]| self.endorsed_for_me(node, statement, macs);
        take_valid(request, (self.id, self.cfg.endorsers().len()), valid, check);
    }

    /// An order node's request timer relays the RQ endorsements it holds of a request
    /// (replica/endorse.rs): a request the primary could not propose (fewer than
    /// `u + r + 1` endorsements reached it) is thus heard by every RQ node, and those
    /// that could not check the client's entry endorse it on `r + 1` peers' word. Without
    /// this, a client whose MACs are valid at exactly `2r + 1 .. u + r` RQ nodes (u > r)
    /// would make backups suspect a correct primary.
    fn on_relayed(&mut self, from: NodeId, mut request: Request, out: &mut Outputs) -> Result<(), Reject> {
        check_session(Peer::Node(from), request.client)?;
        let statement = request.statement();
        let mut valid = BTreeMap::new();
        self.take_valid(&mut request, &statement, &mut valid);
        if valid.is_empty() {
            return Err(Reject::BadEndorsement { node: from });
        }
        // Charged to the relaying order node: charging an endorser would let a lying
        // relayer fill a correct endorser's share, or a lying endorser (whose share is
        // full) block the relay.
        self.on_endorsements(from, request, statement, valid, out)
    }

    /// Counts endorsements `valid` (each checked for this node) of `request`; hearsay is
    /// charged to `charged` (the peer that sent them, or the order node that relayed).
    fn on_endorsements(
        &mut self,
        charged: NodeId,
        request: Request,
        statement: Digest,
        valid: BTreeMap<NodeId, Vec<Mac>>,
        out: &mut Outputs,
    ) -> Result<(), Reject> {
        if let Some(h) = self.held.get_mut(&request.client) {
            if h.req.seq == request.seq && h.req.statement() == statement {
                // Not `touched`: only its client keeps a held request alive (a lying peer
                // or primary could otherwise keep every entry from expiring).
                h.endorsers.extend(valid);
                return Ok(());
            }
            if h.req.seq >= request.seq {
                // Older, or another request under a sequence number this node endorsed
                // already (a faulty client's): as `on_request`.
                return Ok(());
            }
        }
        if self.client_entry_valid(&request, &statement) {
            return self.endorse(request, valid, true, out);
        }
        let share = hearsay_share(&self.cfg);
        let head = (request.client, request.seq, statement);
        match self.hearsay.add(charged, head, Some(request), valid, self.now, share) {
            None => Err(Reject::Busy("endorsements held for this node")),
            Some(count) if count >= self.cfg.quorums.endorse_amplify() => {
                match self.hearsay.take(&(head.0, statement)) {
                    Some(h) => match h.request {
                        Some(request) => self.endorse(request, h.endorsers, true, out),
                        None => Ok(()),
                    },
                    None => Ok(()),
                }
            }
            Some(_) => Ok(()),
        }
    }

    /// An order node asks for operations a PROPOSE named by digest: answered from the
    /// requests held (and the one before each), within a budget per retry period.
    fn on_fetch_bodies(
        &mut self,
        from: NodeId,
        seq: Seq,
        wanted: Vec<(ClientId, Digest)>,
        out: &mut Outputs,
    ) -> Result<(), Reject> {
        if wanted.len() > self.cfg.options.batch_count_max {
            return Err(Reject::BadBatch("more operations asked for than a batch holds"));
        }
        let period = (self.cfg.options.retransmit_ms / 5).max(1);
        let mut budget = self.body_budget.get(&from).copied().unwrap_or_default();
        let lookup = |client, op: &Digest| self.body(client, op);
        let ops = budgeted_bodies(&self.cfg.options, &mut budget, (self.now, period), wanted, lookup);
        self.body_budget.insert(from, budget);
        if ops.is_empty() {
            return Ok(());
        }
        out.send.push((Peer::Node(from), Message::Bodies { seq, ops }));
        Ok(())
    }

    /// Whether the client's MAC authenticator holds a valid entry for this node (at its
    /// stable id, as clients number their entries).
    fn client_entry_valid(&self, req: &Request, statement: &Digest) -> bool {
        let key = client_mac_key(&self.mac_secret, req.client);
        let entry = stage_id(self.id).and_then(|id| req.auth.get(id as usize));
        entry.is_some_and(|mac| key.verify(statement, mac))
    }

    /// The bytes of `client`'s operation with digest `op`, if this node holds them.
    fn body(&self, client: ClientId, op: &Digest) -> Option<Payload> {
        let held = self.held.get(&client).map(|h| &h.req);
        held.into_iter()
            .chain(self.previous.get(&client))
            .map(|r| &r.op)
            .find(|o| o.digest() == *op)
            .cloned()
            .or_else(|| self.hearsay.body(client, op))
    }

    fn invariants(&self) {
        assert!(self.held.len() <= self.cfg.options.clients_max, "held requests are bounded");
        assert!(self.previous.len() <= self.held.len(), "a previous request only beside a held one");
        assert!(self.held_bytes <= self.held_bytes_max, "held request bytes are bounded");
        assert!(self.hearsay.len() <= self.cfg.options.clients_max, "hearsay is bounded");
        assert!(self.views.len() <= self.cfg.n() && self.body_budget.len() <= self.cfg.n(), "per order node");
    }
}

/// The order nodes of `cfg`'s epoch, by stable id.
fn order_ids(cfg: &ClusterConfig) -> impl Iterator<Item = NodeId> + '_ {
    cfg.membership.members.iter().map(|m| NodeId(m.id))
}

/// The keys an RQ node's endorsements are MACed with: one per order node of the epoch
/// (in index order), then one per RQ node.
fn endorse_row(cfg: &ClusterConfig, signing: &SigningKey) -> Vec<MacKey> {
    cfg.node_keys.iter().chain(&cfg.stages.rq).map(|k| endorse_key(signing, k)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::Client;
    use crate::config::{stage_node, Options};
    use crate::crypto::PublicKey;
    use crate::ids::NodeRange;
    use crate::message::{Proposed, Reply};
    use crate::quorum::{Mutation, Quorums};
    use crate::replica::tests::{secrets, Log};
    use crate::replica::Replica;
    use crate::test_net::TestNet;

    /// u = r = 1: order nodes 0..4 (executing), RQ nodes 4..8.
    fn config(mutation: Option<Mutation>) -> ClusterConfig {
        config_ur(1, 1, mutation)
    }

    /// Order nodes 0..n (executing), RQ nodes n..2n.
    fn config_ur(u: u32, r: u32, mutation: Option<Mutation>) -> ClusterConfig {
        let q = Quorums::new(u, r).expect("valid").with_mutation(mutation);
        let n = q.order_nodes() as u32;
        let keys: Vec<PublicKey> = (0..n).map(|i| secrets(i).signing.public()).collect();
        let rq_keys: Vec<PublicKey> = (n..n + q.rq_nodes_min() as u32).map(|i| secrets(i).signing.public()).collect();
        let options = Options { background_checkpoints: false, ..Options::test_min() };
        ClusterConfig::new(q, keys, options).expect("valid").with_rq_nodes(rq_keys).expect("2u + r + 1 RQ nodes")
    }

    fn client(cfg: &ClusterConfig, id: u64) -> Client {
        let keys = (0..cfg.rq_ids().end).map(|i| client_mac_key(&secrets(i).mac_secret, ClientId(id))).collect();
        Client::new(ClientId(id), cfg.quorums, keys, 100, 1).with_auth(cfg.auth).with_rq_nodes(cfg.rq_ids().into())
    }

    /// Order nodes and RQ nodes on a lossless network (`test_net.rs`).
    type Net = TestNet<Log, RqNode>;

    impl Net {
        fn new(cfg: &ClusterConfig) -> Net {
            let order = NodeRange::first(cfg.n()).map(|i| Replica::new(cfg.clone(), i, secrets(i.0), Log::default()));
            let rq = cfg
                .rq_ids()
                .map(|i| RqNode::new(cfg.clone(), stage_node(i), secrets(i).signing, secrets(i).mac_secret));
            TestNet::of(order.collect(), rq.collect())
        }

        /// Invokes `op`, ticking until its result arrives; the result and the client ticks
        /// that retransmitted.
        fn call(&mut self, c: &mut Client, now: &mut u64, op: &[u8]) -> (Vec<u8>, usize) {
            let msgs = c.invoke(*now, op.to_vec()).expect("idle");
            self.send(c.id(), msgs, *now);
            let mut retransmissions = 0;
            for _ in 0..400 {
                for (n, _, r) in std::mem::take(&mut self.replies) {
                    if let Some(result) = c.on_reply(n, r) {
                        return (result, retransmissions);
                    }
                }
                *now += 10;
                let msgs = c.on_tick(*now);
                retransmissions += usize::from(!msgs.is_empty());
                self.send(c.id(), msgs, *now);
                self.tick(*now);
            }
            panic!("no result for {op:?}; {}", self.status());
        }

        fn status(&self) -> String {
            let order = self.nodes.iter().map(Replica::status_line);
            let rq = self.stage.iter().map(RqNode::status_line);
            order.chain(rq).collect::<Vec<_>>().join("\n")
        }

        fn rejected(&self) -> Vec<(NodeId, Reject)> {
            self.events
                .iter()
                .filter_map(|(n, e)| match e {
                    Event::Rejected { reason, .. } => Some((*n, reason.clone())),
                    _ => None,
                })
                .collect()
        }

        fn views(&self) -> Vec<View> {
            self.nodes.iter().map(Replica::view).collect()
        }
    }

    #[test]
    fn a_request_reaches_the_order_stage_through_rq_endorsements_only() {
        let cfg = config(None);
        let mut net = Net::new(&cfg);
        let mut c = client(&cfg, 7);
        let mut now = 0;
        // The order nodes learn nothing from the client: it sends only to RQ nodes.
        let first = c.invoke(now, b"a".to_vec()).expect("idle");
        assert!(first.iter().all(|(n, _)| cfg.rq_ids().contains(&n.0)), "{first:?}");
        assert_eq!(first.len(), cfg.quorums.endorse_propose());
        net.send(ClientId(7), first, now);
        for _ in 0..20 {
            net.tick(now);
            now += 10;
        }
        let replies: Vec<(NodeId, ClientId, Reply)> = std::mem::take(&mut net.replies);
        let result = replies.into_iter().find_map(|(n, _, r)| c.on_reply(n, r));
        assert_eq!(result, Some(vec![1]));
        assert_eq!(c.reads_ordered, 0);
        // The proposal carries RQ endorsements, u + r + 1 of them, and no client MACs.
        let requests = net.proposed.clone();
        assert!(!requests.is_empty());
        for r in requests {
            let nodes: Vec<NodeId> = r.endorsements().iter().map(|e| e.node).collect();
            assert_eq!(nodes.len(), cfg.quorums.endorse_propose());
            assert!(nodes.iter().all(|n| cfg.endorsers().contains(n)), "{nodes:?}");
        }
        assert!(net.rejected().is_empty(), "{:?}", net.rejected());
        // A second operation, and each RQ node holds the client's latest request only.
        assert_eq!(net.call(&mut c, &mut now, b"b").0, vec![2]);
        assert!(net.stage.iter().all(|q| q.held() <= 1));
    }

    #[test]
    fn with_an_rq_node_down_one_retransmission_then_requests_go_to_every_rq_node() {
        let cfg = config(None);
        let mut net = Net::new(&cfg);
        let mut c = client(&cfg, 4); // starts at RQ position 4 % 4 = 0: node 4
        net.down.insert(NodeId(4));
        let mut now = 0;
        let (result, retransmissions) = net.call(&mut c, &mut now, b"a");
        assert_eq!((result, retransmissions), (vec![1], 1));
        for i in 2..6u8 {
            let (result, retransmissions) = net.call(&mut c, &mut now, b"x");
            assert_eq!((result, retransmissions), (vec![i], 0), "later requests go to every RQ node at once");
        }
        // Now and then it tries u + r + 1 again (and pays a retransmission while the node
        // is down), less and less often: after 64, then 128, then 256 operations.
        let mut slow = Vec::new();
        for i in 6..300 {
            if net.call(&mut c, &mut now, b"x").1 > 0 {
                slow.push(i);
            }
        }
        assert_eq!(slow, vec![66, 195], "retransmissions at the probes only");
        assert_eq!(net.views(), vec![View(0); 4], "no view change");
    }

    /// A request whose MACs are valid at RQ nodes `valid` only (the faulty client of
    /// UpRight §4.1), sent to every RQ node.
    fn inconsistent(cfg: &ClusterConfig, id: u64, seq: u64, valid: &[NodeId]) -> Vec<(NodeId, Message)> {
        let mut c = client(cfg, id);
        let mut req = Request::new(ClientId(id), seq, b"faulty".to_vec().into());
        let statement = req.statement();
        req.auth = (0..cfg.rq_ids().end)
            .map(|i| {
                let key = client_mac_key(&secrets(i).mac_secret, ClientId(id));
                if valid.contains(&NodeId(i)) {
                    key.mac(&statement)
                } else {
                    [0; 16]
                }
            })
            .collect();
        let _ = c.invoke(0, Vec::new());
        cfg.rq_ids().map(|n| (NodeId(n), Message::Request(req.clone()))).collect()
    }

    #[test]
    fn inconsistent_macs_at_r_plus_one_rq_nodes_are_amplified_and_fewer_change_no_view() {
        let cfg = config(None);
        let mut net = Net::new(&cfg);
        let mut now = 0;
        // Valid at r + 1 = 2 RQ nodes: they endorse to all, the others follow on their
        // word, and the request executes.
        net.send(ClientId(9), inconsistent(&cfg, 9, 1, &[NodeId(4), NodeId(5)]), now);
        now += cfg.options.retransmit_ms;
        net.send(ClientId(9), inconsistent(&cfg, 9, 1, &[NodeId(4), NodeId(5)]), now);
        for _ in 0..50 {
            now += 10;
            net.tick(now);
        }
        assert!(net.stage.iter().all(|q| q.held() == 1), "every RQ node endorsed it: {}", net.status());
        assert!(
            net.replies.iter().filter(|(_, _, r)| r.client == ClientId(9)).count() >= 2,
            "executed: {}",
            net.status()
        );
        // Valid at one RQ node only: nobody else endorses, nothing executes, and no order
        // node suspects the primary over it, however long it waits.
        net.replies.clear();
        for round in 0..10 {
            net.send(ClientId(10), inconsistent(&cfg, 10, 1, &[NodeId(6)]), now);
            for _ in 0..30 {
                now += 10;
                net.tick(now);
            }
            assert!(net.replies.iter().all(|(_, _, r)| r.client != ClientId(10)), "round {round}");
        }
        assert_eq!(net.views(), vec![View(0); 4], "no view change over a faulty client");
        let mut ok = client(&cfg, 11);
        assert_eq!(net.call(&mut ok, &mut now, b"ok").0, vec![2], "others are served");
    }

    #[test]
    fn with_u_above_r_rq_nodes_amplify_what_order_nodes_relay_so_no_correct_primary_is_replaced() {
        // u = 2, r = 1: the primary proposes on 4 endorsements, a backup suspects it once
        // it holds 3. A request valid at exactly 3 RQ nodes, sent once: the primary gets 3,
        // cannot propose, and relays them on its request timer; RQ nodes that could not
        // check the client's entry endorse on r + 1 = 2 peers' word, so the primary gets
        // enough before any backup's timer runs out twice.
        let cfg = config_ur(2, 1, None);
        let mut net = Net::new(&cfg);
        let mut now = 0;
        let rq: Vec<NodeId> = cfg.rq_ids().map(NodeId).collect();
        net.send(ClientId(9), inconsistent(&cfg, 9, 1, &rq[..3]), now);
        for _ in 0..300 {
            now += 10;
            net.tick(now);
        }
        assert_eq!(net.views(), vec![View(0); cfg.n()], "no view change: {}", net.status());
        assert!(
            net.replies.iter().filter(|(_, _, r)| r.client == ClientId(9)).count() >= 2,
            "executed: {}",
            net.status()
        );
    }

    #[test]
    fn a_lying_rq_node_whose_hearsay_share_is_full_cannot_block_a_relay() {
        // As above, but the third endorsement is the lying RQ node 6's (the lowest RQ id),
        // which first filled its hearsay share at every correct RQ node with made-up
        // requests. The primary relays {6, 7, 8}; charged to an endorser (6, full) the
        // relay was refused and backups suspected the correct primary. Charged to the
        // relaying order node, it is taken and amplified.
        let cfg = config_ur(2, 1, None);
        let mut net = Net::new(&cfg);
        net.down.insert(NodeId(6)); // the liar speaks through the test
        let liar = |request: &Request| -> Message {
            let s = endorse_statement(stage_node(6), &request.statement());
            let row = cfg.node_keys.iter().chain(&cfg.stages.rq);
            Message::Endorse {
                request: request.clone(),
                macs: row.map(|k| endorse_key(&secrets(6).signing, k).mac(&s)).collect(),
            }
        };
        let share = hearsay_share(&cfg);
        let mut now = 0;
        for i in 0..share as u64 {
            let made_up = Request::new(ClientId(500 + i), 1, b"made up".to_vec().into());
            for to in 7..12 {
                net.post(Peer::Node(NodeId(6)), NodeId(to), liar(&made_up));
            }
        }
        net.run(now);
        let msgs = inconsistent(&cfg, 9, 1, &[NodeId(7), NodeId(8)]);
        let Message::Request(faulty) = &msgs[0].1 else { panic!("a request") };
        let endorsed = liar(&Request { auth: Vec::new(), ..faulty.clone() });
        for to in (0..6).chain(7..12) {
            net.post(Peer::Node(NodeId(6)), NodeId(to), endorsed.clone());
        }
        net.send(ClientId(9), msgs, now);
        for _ in 0..300 {
            now += 10;
            net.tick(now);
        }
        assert_eq!(net.views(), vec![View(0); cfg.n()], "no view change: {}", net.status());
        assert!(
            net.replies.iter().filter(|(_, _, r)| r.client == ClientId(9)).count() >= 2,
            "executed: {}",
            net.status()
        );
    }

    #[test]
    fn order_nodes_take_endorsements_only_from_rq_nodes_and_only_valid_ones() {
        let cfg = config(None);
        let mut primary = Replica::new(cfg.clone(), NodeId(0), secrets(0), Log::default());
        let req = Request::new(ClientId(7), 1, b"a".to_vec().into());
        let statement = req.statement();
        // Node `i`'s endorsement (stable id; RQ nodes sign under their stage names).
        let macs_of = |i: NodeId| -> Vec<Mac> {
            let name = if i >= NodeId(4) { stage_node(i.0) } else { i };
            let s = endorse_statement(name, &statement);
            cfg.node_keys.iter().chain(&cfg.stages.rq).map(|k| endorse_key(&secrets(i.0).signing, k).mac(&s)).collect()
        };
        let mut out = Outputs::default();
        // An order node's "endorsement" (co-located style) is no RQ endorsement.
        let from_order = Message::Endorse { request: req.clone(), macs: macs_of(NodeId(1)) };
        primary.step(0, Input::Message { from: Peer::Node(NodeId(1)), msg: from_order }, &mut out);
        // An RQ node's endorsement that another RQ node's key MACed.
        let forged = Message::Endorse { request: req.clone(), macs: macs_of(NodeId(5)) };
        primary.step(0, Input::Message { from: Peer::Node(stage_node(4)), msg: forged }, &mut out);
        // A client request straight to an order node is not admitted.
        let mut c = client(&cfg, 7);
        let direct = c.invoke(0, b"a".to_vec()).expect("idle").remove(0).1;
        primary.step(0, Input::Message { from: Peer::Client(ClientId(7)), msg: direct }, &mut out);
        let rejected: Vec<Reject> = out
            .events
            .iter()
            .filter_map(|e| match e {
                Event::Rejected { reason, .. } => Some(reason.clone()),
                _ => None,
            })
            .collect();
        assert_eq!(
            rejected,
            vec![Reject::BadEndorsement { node: NodeId(1) }, Reject::BadEndorsement { node: stage_node(4) }]
        );
        assert!(out.send.iter().all(|(_, m)| !matches!(m, Message::Propose { .. })));
        assert!(primary.status_line().contains("pending 0"), "nothing held: {}", primary.status_line());
        // One RQ node's endorsement, relayed three times over, counts once.
        let mut thrice = req.clone();
        thrice.endorsements = (0..3).map(|_| Endorsement { node: stage_node(4), macs: macs_of(NodeId(4)) }).collect();
        primary.step(0, Input::Message { from: Peer::Node(NodeId(2)), msg: Message::Forward(thrice) }, &mut out);
        assert!(out.send.iter().all(|(_, m)| !matches!(m, Message::Propose { .. })));
        assert!(primary.status_line().contains("pending 0"), "one endorser is not r + 1: {}", primary.status_line());
        // u + r + 1 genuine RQ endorsements: proposed.
        for i in 4..7 {
            let msg = Message::Endorse { request: req.clone(), macs: macs_of(NodeId(i)) };
            primary.step(0, Input::Message { from: Peer::Node(stage_node(i)), msg }, &mut out);
        }
        assert!(out.send.iter().any(|(_, m)| matches!(m, Message::Propose { .. })));
    }

    #[test]
    fn large_operations_travel_by_digest_and_backups_fetch_them_from_rq_nodes() {
        let cfg = config(None);
        assert!(cfg.request_digests);
        let mut net = Net::new(&cfg);
        let mut c = client(&cfg, 7);
        let mut now = 0;
        let big = vec![7u8; 4096];
        assert_eq!(net.call(&mut c, &mut now, &big).0, vec![1]);
        assert!(net.proposed.clone().iter().any(|r| matches!(r, Proposed::Digest(_))), "proposed by digest");
        let fetched_from_rq = net
            .seen
            .iter()
            .any(|(from, _, kind)| *kind == "bodies" && matches!(from, Peer::Node(n) if cfg.rq_ids().contains(&n.0)));
        assert!(fetched_from_rq, "backups fetched the bytes from RQ nodes");
        for r in &net.nodes {
            assert_eq!(r.service().0, vec![big.clone()], "node {} executed the whole operation", r.index());
        }
    }

    #[test]
    fn an_rq_node_holds_one_request_per_client_within_clients_max() {
        let mut cfg = config(None);
        cfg.options.clients_max = 8;
        let mut rq = RqNode::new(cfg.clone(), stage_node(4), secrets(4).signing, secrets(4).mac_secret);
        let mut out = Outputs::default();
        for id in 1..=10u64 {
            let mut c = client(&cfg, id);
            for seq in 1..=3u64 {
                let (_, m) = c.invoke(seq, vec![seq as u8]).expect("idle").remove(0);
                c.abandon();
                // Its authenticator has an entry for every RQ node: delivered to node 4.
                rq.step(seq, Input::Message { from: Peer::Client(ClientId(id)), msg: m }, &mut out);
            }
        }
        assert_eq!(rq.held(), 8);
        let busy = out.events.iter().filter(|e| matches!(e, Event::Rejected { reason: Reject::Busy(_), .. })).count();
        assert!(busy > 0, "clients beyond clients_max are refused");
        // Untouched for four request timeouts: dropped, and room for others again.
        rq.step(10 * cfg.options.request_timeout_ms, Input::Tick, &mut out);
        assert_eq!(rq.held(), 0);
    }

    #[test]
    fn an_rq_node_holds_request_bytes_within_its_bound_dropping_earlier_requests_first() {
        let cfg = config(None);
        let mut rq = RqNode::new(cfg.clone(), stage_node(4), secrets(4).signing, secrets(4).mac_secret);
        rq.held_bytes_max = 1000;
        let mut clients: Vec<Client> = (1..=3).map(|id| client(&cfg, id)).collect();
        let send = |rq: &mut RqNode, c: &mut Client, len: usize, now: u64| {
            let (_, m) = c.invoke(now, vec![7; len]).expect("idle").remove(0);
            c.abandon();
            let mut out = Outputs::default();
            rq.step(now, Input::Message { from: Peer::Client(c.id()), msg: m }, &mut out);
            out.events.iter().any(|e| matches!(e, Event::Rejected { reason: Reject::Busy(_), .. }))
        };
        assert!(!send(&mut rq, &mut clients[0], 400, 1));
        // The client's next request: its first stays as the previous one (fetchable).
        assert!(!send(&mut rq, &mut clients[0], 400, 2));
        assert_eq!((rq.held(), rq.held_bytes), (1, 800));
        // Another client's 400 bytes fit once the previous request is dropped.
        assert!(!send(&mut rq, &mut clients[1], 400, 3));
        assert_eq!((rq.held(), rq.held_bytes), (2, 800), "the previous request went first");
        // 500 more do not fit at all: refused, and nothing else is dropped.
        assert!(send(&mut rq, &mut clients[2], 500, 4), "refused");
        assert_eq!((rq.held(), rq.held_bytes), (2, 800));
        assert!(!send(&mut rq, &mut clients[2], 200, 5));
        assert_eq!((rq.held(), rq.held_bytes), (3, 1000));
    }

    #[test]
    fn an_rq_node_believes_a_view_only_r_plus_one_order_nodes_report() {
        let cfg = config(None);
        let mut rq = RqNode::new(cfg.clone(), stage_node(5), secrets(5).signing, secrets(5).mac_secret);
        let mut out = Outputs::default();
        let status = |view| Message::Status { view: View(view), executed: Seq(0), stable: Seq(0) };
        rq.step(0, Input::Message { from: Peer::Node(NodeId(3)), msg: status(1_000) }, &mut out);
        assert_eq!(rq.view(), View(0), "one liar cannot move it");
        rq.step(0, Input::Message { from: Peer::Node(NodeId(1)), msg: status(2) }, &mut out);
        assert_eq!(rq.view(), View(2));
    }

    #[test]
    fn an_rq_node_asks_for_newer_epochs_and_endorses_for_the_members_of_the_one_it_follows() {
        use crate::membership::{AdminOp, Change, Member};
        use crate::message::{checkpoint_statement, EpochCert, StableProof};
        let admin = SigningKey::from_seed([99; 32]);
        let cfg = config(None).with_admin_key(admin.public());
        let me = stage_node(4);
        let mut rq = RqNode::new(cfg.clone(), me, secrets(4).signing, secrets(4).mac_secret);
        let mut out = Outputs::default();
        rq.step(0, Input::Tick, &mut out);
        let asked: Vec<NodeId> = out
            .send
            .iter()
            .filter_map(|(to, m)| match (to, m) {
                (Peer::Node(n), Message::EpochQuery { epoch: 0, .. }) => Some(*n),
                _ => None,
            })
            .collect();
        let peers = (5..8).map(stage_node);
        assert_eq!(asked, NodeRange::first(4).chain(peers).collect::<Vec<_>>(), "every STATUS period it asks everyone");
        // A request held before the change.
        let mut c = client(&cfg, 7);
        let (_, request) = c.invoke(0, b"a".to_vec()).expect("idle").remove(0);
        let Message::Request(req) = &request else { panic!("a request") };
        let statement = req.statement();
        rq.step(1, Input::Message { from: Peer::Client(ClientId(7)), msg: request.clone() }, &mut out);
        assert_eq!(rq.held(), 1);
        // Epoch 1 adds order node 12, proven by the stable checkpoint of epoch 0's members.
        let member = Member { id: 12, key: secrets(12).signing.public(), addr: String::new() };
        let next =
            cfg.membership.apply(&AdminOp::sign(&admin, 0, Change::Add(member)), &admin.public(), Seq(5)).expect("ok");
        let root = Digest([1; 32]);
        let sigs = NodeRange::first(4)
            .map(|i| (i, secrets(i.0).signing.sign(&checkpoint_statement(Seq(5), &root, &next.digest(), i))));
        let proof = StableProof { seq: Seq(5), root, membership: next.digest(), sigs: sigs.collect() };
        let mut forged = proof.clone();
        forged.sigs.truncate(1);
        let certs = |proof: StableProof| Message::EpochCerts(vec![EpochCert { proof, next: next.clone() }]);
        let mut out = Outputs::default();
        rq.step(2, Input::Message { from: Peer::Node(NodeId(1)), msg: certs(forged) }, &mut out);
        assert_eq!(rq.epoch(), 0, "one signature proves nothing");
        let mut out = Outputs::default();
        rq.step(2, Input::Message { from: Peer::Node(NodeId(1)), msg: certs(proof) }, &mut out);
        assert_eq!(rq.epoch(), 1);
        // Its client spoke lately: the new members hear of the held request at once.
        let to_new = |out: &Outputs| {
            out.send.iter().find_map(|(to, m)| match (to, m) {
                (Peer::Node(NodeId(12)), Message::Endorse { macs, .. }) => Some(macs.clone()),
                _ => None,
            })
        };
        assert!(to_new(&out).is_some(), "re-endorsed for epoch 1 when it followed");
        // The client retransmits: the held request's endorsement goes to every member of
        // epoch 1, with a MAC the new member (index 4) checks.
        let mut out = Outputs::default();
        rq.step(1_000, Input::Message { from: Peer::Client(ClientId(7)), msg: request }, &mut out);
        let macs = to_new(&out).expect("endorsed to the new member");
        assert_eq!(macs.len(), 5 + 4, "a MAC per order node of epoch 1, then per RQ node");
        let key = endorse_key(&secrets(12).signing, &secrets(4).signing.public());
        assert!(key.verify(&endorse_statement(me, &statement), &macs[4]));
        // An RQ peer that restarted empty learns the epoch from this node as well.
        let mut fresh = RqNode::new(cfg.clone(), stage_node(5), secrets(5).signing, secrets(5).mac_secret);
        let mut out = Outputs::default();
        let query = Message::EpochQuery { client: ClientId(0), epoch: 0 };
        rq.step(1_001, Input::Message { from: Peer::Node(stage_node(5)), msg: query }, &mut out);
        let (_, answer) = out.send.pop().expect("answered");
        fresh.step(1_001, Input::Message { from: Peer::Node(me), msg: answer }, &mut out);
        assert_eq!(fresh.epoch(), 1);
    }
}
