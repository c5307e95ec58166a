//! Byzantine behaviours for up to r nodes.
//!
//! A Byzantine node runs the correct replica underneath (so it keeps pace and knows what
//! to lie about) and rewrites what it sends. It holds its own signing key, so it can sign
//! any lie; it cannot sign for others or impersonate another peer on the channel.

use keel_core::crypto::{Digest, Mac, MacKey, Sig, SigningKey};
use keel_core::membership::{Member, Membership};
use keel_core::message::{
    checkpoint_statement, endorse_statement, write_statement, CertProof, CheckpointVote, Endorsement, EpochCert,
    Message, NewView, NodeId, Proposal, Proposed, Reply, ReplyBody, Request, StableProof, Value, ViewChange, Write,
};
use keel_core::replica::Peer;
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use std::collections::{BTreeMap, VecDeque};

/// Messages a Byzantine node remembers for replays.
const REPLAY_BUFFER_MAX: usize = 128;
/// Replays right after an epoch change that pick a message of an earlier epoch.
const EARLIER_REPLAYS: u32 = 64;
/// Instances the new epoch votes on before a node replays what it held of the earlier one.
const EARLIER_AFTER: u64 = 2;
/// VIEW-CHANGEs and NEW-VIEWs of the current epoch kept apart from the replay buffer.
const VIEW_STATEMENTS_MAX: usize = 16;
/// Forged values a Byzantine node keeps so it can serve them when asked.
const FORGED_KEPT_MAX: usize = 64;

/// Simulated time from which a slow primary holds its proposals back.
pub const SLOW_FROM_MS: u64 = 800;

#[derive(Debug, Clone, Default)]
pub struct Behaviours {
    /// As primary, propose a different value to odd-numbered nodes and vote for both.
    pub equivocate: bool,
    /// Corrupt digests, signatures, roots and replies at random.
    pub corrupt: bool,
    /// Resend old messages (its own and ones it received) to random nodes.
    pub replay: bool,
    /// Lie in view changes: forged certificates and stable proofs; junk STOPs and NEW-VIEWs.
    pub forge_view_change: bool,
    /// Send nothing while primary (a silent primary).
    pub silent_primary: bool,
    /// Send random bytes.
    pub junk: bool,
    /// As primary, from `SLOW_FROM_MS` on, hold every PROPOSE for a quarter of the request
    /// timeout: within every timer, yet a fraction of the throughput (Aardvark's slow
    /// primary, turning slow once the cluster has seen what it can do).
    pub slow_primary: bool,
    /// Answer read-only requests at once from whatever state it has (a stale answer,
    /// matching what lagging correct nodes would say), without waiting as correct nodes do.
    pub rush_reads: bool,
    /// `auth = rq-mac`: endorsements whose MACs are wrong for some nodes, endorsements of
    /// requests no client sent, and (as primary) such requests proposed with its own
    /// endorsement alone.
    pub forge_endorsements: bool,
    /// Lie about the membership: epoch certificates, to nodes and clients, for a next
    /// epoch of its own making (itself and nodes it holds the keys of, tolerating no
    /// fault), signed by itself and with made-up signatures for the others.
    pub forge_epoch_certs: bool,
    /// Request digests: asked for the operations of a proposal, answer nothing or
    /// operations altered by one byte.
    pub withhold_bodies: bool,
}

impl Behaviours {
    /// Every behaviour's name, as `names` gives them and [`Behaviours::only`] takes them.
    pub const NAMES: [&'static str; 11] = [
        "equivocate",
        "corrupt",
        "replay",
        "forge-view-change",
        "silent-primary",
        "junk",
        "rush-reads",
        "slow-primary",
        "forge-endorsements",
        "forge-epoch-certs",
        "withhold-bodies",
    ];

    /// The behaviour named `name` alone (one of [`Behaviours::NAMES`]).
    pub fn only(name: &str) -> Option<Behaviours> {
        let mut b = Behaviours::default();
        let on = match name {
            "equivocate" => &mut b.equivocate,
            "corrupt" => &mut b.corrupt,
            "replay" => &mut b.replay,
            "forge-view-change" => &mut b.forge_view_change,
            "silent-primary" => &mut b.silent_primary,
            "junk" => &mut b.junk,
            "rush-reads" => &mut b.rush_reads,
            "slow-primary" => &mut b.slow_primary,
            "forge-endorsements" => &mut b.forge_endorsements,
            "forge-epoch-certs" => &mut b.forge_epoch_certs,
            "withhold-bodies" => &mut b.withhold_bodies,
            _ => return None,
        };
        *on = true;
        Some(b)
    }

    pub fn random(rng: &mut ChaCha8Rng) -> Behaviours {
        loop {
            let b = Behaviours {
                equivocate: rng.gen_bool(0.5),
                corrupt: rng.gen_bool(0.4),
                replay: rng.gen_bool(0.4),
                forge_view_change: rng.gen_bool(0.5),
                silent_primary: rng.gen_bool(0.3),
                junk: rng.gen_bool(0.4),
                rush_reads: rng.gen_bool(0.5),
                slow_primary: rng.gen_bool(0.3),
                forge_endorsements: rng.gen_bool(0.5),
                forge_epoch_certs: rng.gen_bool(0.5),
                withhold_bodies: rng.gen_bool(0.5),
            };
            if b.equivocate
                || b.corrupt
                || b.replay
                || b.forge_view_change
                || b.silent_primary
                || b.junk
                || b.rush_reads
                || b.slow_primary
                || b.forge_endorsements
                || b.forge_epoch_certs
                || b.withhold_bodies
            {
                return b;
            }
        }
    }

    pub fn names(&self) -> Vec<&'static str> {
        let mut v = Vec::new();
        for (on, name) in [
            (self.equivocate, "equivocate"),
            (self.corrupt, "corrupt"),
            (self.replay, "replay"),
            (self.forge_view_change, "forge-view-change"),
            (self.silent_primary, "silent-primary"),
            (self.junk, "junk"),
            (self.rush_reads, "rush-reads"),
            (self.slow_primary, "slow-primary"),
            (self.forge_endorsements, "forge-endorsements"),
            (self.forge_epoch_certs, "forge-epoch-certs"),
            (self.withhold_bodies, "withhold-bodies"),
        ] {
            if on {
                v.push(name);
            }
        }
        v
    }
}

/// Counts of lies told, for the report.
#[derive(Debug, Clone, Default)]
pub struct LieCounts {
    pub equivocations: u64,
    pub corruptions: u64,
    pub replays: u64,
    pub forged_view_changes: u64,
    pub silenced: u64,
    pub junk_frames: u64,
    pub rushed_reads: u64,
    /// Read-index answers that named an index too low (to make reads stale) or too high
    /// (to stall them).
    pub index_lies: u64,
    /// PROPOSEs a slow primary held back.
    pub slowed_proposals: u64,
    /// Endorsements with wrong MACs or of made-up requests, and proposals carrying those.
    pub forged_endorsements: u64,
    /// Epoch certificates for a membership of its own making.
    pub forged_epoch_certs: u64,
    /// Operations asked for and withheld or altered.
    pub withheld_bodies: u64,
}

impl LieCounts {
    pub fn add(&mut self, o: &LieCounts) {
        self.equivocations += o.equivocations;
        self.corruptions += o.corruptions;
        self.replays += o.replays;
        self.forged_view_changes += o.forged_view_changes;
        self.silenced += o.silenced;
        self.junk_frames += o.junk_frames;
        self.rushed_reads += o.rushed_reads;
        self.index_lies += o.index_lies;
        self.slowed_proposals += o.slowed_proposals;
        self.forged_endorsements += o.forged_endorsements;
        self.forged_epoch_certs += o.forged_epoch_certs;
        self.withheld_bodies += o.withheld_bodies;
    }

    pub fn total(&self) -> u64 {
        self.equivocations
            + self.corruptions
            + self.replays
            + self.forged_view_changes
            + self.silenced
            + self.junk_frames
            + self.rushed_reads
            + self.index_lies
            + self.slowed_proposals
            + self.forged_endorsements
            + self.forged_epoch_certs
            + self.withheld_bodies
    }
}

pub struct Byzantine {
    pub behaviours: Behaviours,
    me: NodeId,
    n: usize,
    quorum: usize,
    signing: SigningKey,
    history: VecDeque<Message>,
    /// (view, seq) → the alternative value told to odd-numbered nodes.
    alternatives: BTreeMap<(u64, u64), Proposal>,
    /// Bodies of the values its forged certificates name, in forging order. A forger that
    /// could not hand out the body would only stall the instance: view changes carry
    /// digests, so the new primary fetches the body from the certificate's holders.
    forged: VecDeque<(u64, Digest, Value)>,
    /// Its keys for endorsements (entry j for node j of its epoch): it can endorse
    /// anything, as itself.
    endorse_keys: Vec<MacKey>,
    /// (view, seq) → the proposal with a made-up request added, the same for every backup.
    fabricated: BTreeMap<(u64, u64), Proposal>,
    fabricated_seq: u64,
    /// With a separate RQ stage, a Byzantine RQ node it colludes with: that node's id and
    /// endorsement keys (per order node), which its made-up requests are endorsed with
    /// (an order node's own endorsement counts for nothing there).
    colluder: Option<(NodeId, Vec<MacKey>)>,
    /// The membership its replica runs (what forged certificates must seem to follow).
    membership: Option<Membership>,
    /// Messages of earlier epochs, replayed once the next epoch got going.
    earlier: EarlierEpochs,
    pub lies: LieCounts,
}

/// A replaying node's memory across epoch changes (issue #21 defect 1): signed statements
/// of an earlier epoch are what a change that keeps indices and keys must not let
/// through. The replay buffer alone rarely holds one when the epoch changes (it keeps the
/// last 128 messages, VIEW-CHANGEs and NEW-VIEWs are rare, and it fills with the new
/// epoch's traffic within a few hundred simulated ms), so the node keeps the view-change
/// statements of its epoch apart. What it held when the epoch changed it replays once the
/// new epoch has voted on [`EARLIER_AFTER`] instances: a NEW-VIEW replayed at once only
/// moves the new epoch to another view before it ordered anything (harmless), while one
/// replayed later re-opens instances the new epoch already decided. The next
/// [`EARLIER_REPLAYS`] replays then pick from it, half of them view-change statements.
#[derive(Default)]
struct EarlierEpochs {
    /// The current epoch's latest VIEW-CHANGEs and NEW-VIEWs, at most [`VIEW_STATEMENTS_MAX`].
    views: VecDeque<Message>,
    /// What the node held when its epoch last changed: replay buffer and view statements.
    held: Vec<Message>,
    held_views: Vec<Message>,
    /// The instance the current epoch started after (`Membership::since`).
    since: u64,
    /// Replays still to pick from `held` once the new epoch votes above `since + EARLIER_AFTER`.
    left: u32,
    armed: bool,
}

impl EarlierEpochs {
    /// A message the node sent or received.
    fn remember(&mut self, msg: &Message) {
        match msg {
            Message::ViewChange(_) | Message::NewView(_) => {
                if self.views.len() == VIEW_STATEMENTS_MAX {
                    self.views.pop_front();
                }
                self.views.push_back(msg.clone());
            }
            Message::Write(Write { seq, .. }) | Message::Accept { seq, .. } => {
                self.armed |= *seq > self.since + EARLIER_AFTER;
            }
            _ => {}
        }
    }

    /// The node's epoch changed to one starting after instance `since`; `history` is its
    /// replay buffer.
    fn epoch_changed(&mut self, history: &VecDeque<Message>, since: u64) {
        self.held = history.iter().cloned().collect();
        self.held_views = self.views.drain(..).collect();
        self.since = since;
        self.left = EARLIER_REPLAYS;
        self.armed = false;
    }

    /// A message of an earlier epoch to replay, while the node prefers them.
    fn pick(&mut self, rng: &mut ChaCha8Rng) -> Option<Message> {
        if !self.armed || self.left == 0 || (self.held.is_empty() && self.held_views.is_empty()) {
            return None;
        }
        self.left -= 1;
        let pool = if self.held.is_empty() || (!self.held_views.is_empty() && rng.gen_bool(0.5)) {
            &self.held_views
        } else {
            &self.held
        };
        Some(pool[rng.gen_range(0..pool.len())].clone())
    }
}

/// The client id of requests a Byzantine node makes up: no client sends them.
pub const FABRICATED_CLIENT: u64 = 424_243;

/// One outgoing frame: destination and raw bytes.
pub type Frame = (Peer, Vec<u8>);

impl Byzantine {
    pub fn new(behaviours: Behaviours, me: NodeId, n: usize, quorum: usize, signing: SigningKey) -> Byzantine {
        Byzantine {
            behaviours,
            me,
            n,
            quorum,
            signing,
            endorse_keys: Vec::new(),
            fabricated: BTreeMap::new(),
            fabricated_seq: 0,
            colluder: None,
            membership: None,
            earlier: EarlierEpochs::default(),
            history: VecDeque::new(),
            alternatives: BTreeMap::new(),
            forged: VecDeque::new(),
            lies: LieCounts::default(),
        }
    }

    /// Colludes with Byzantine RQ node `node`, whose endorsement keys are `row`.
    pub fn set_colluder(&mut self, node: NodeId, row: Vec<MacKey>) {
        self.colluder = Some((node, row));
    }

    /// The RQ node it colludes with endorses for new members now, with keys `row`.
    pub fn colluder_follows(&mut self, node: NodeId, row: &[MacKey]) {
        if let Some((id, keys)) = self.colluder.as_mut().filter(|(id, _)| *id == node) {
            debug_assert_eq!(*id, node);
            *keys = row.to_vec();
        }
    }

    /// The membership its replica runs; with a new epoch, its index and the cluster size
    /// change too.
    pub fn set_membership(&mut self, me: NodeId, quorum: usize, membership: Membership) {
        self.me = me;
        self.n = membership.n();
        self.quorum = quorum;
        self.endorse_keys = keel_core::replica::endorse_keys(&self.signing, &membership);
        if self.behaviours.replay && self.membership.as_ref().is_some_and(|m| m.epoch != membership.epoch) {
            self.earlier.epoch_changed(&self.history, membership.since);
        }
        self.membership = Some(membership);
    }

    /// The digest of the membership its replica runs, which signed statements name.
    fn epoch_tag(&self) -> Digest {
        self.membership.as_ref().map(Membership::digest).unwrap_or_default()
    }

    /// A certificate for a next epoch of this node's making: itself and three nodes whose
    /// keys it made up, tolerating nothing, so whoever followed it would trust this node
    /// alone. It can sign only as itself: the other signatures are made up too.
    fn forge_epoch_cert(&mut self, rng: &mut ChaCha8Rng) -> Option<EpochCert> {
        let current = self.membership.clone()?;
        let me = current.members.get(self.me as usize)?.clone();
        let mut members = vec![me];
        for i in 1..=3 {
            let key = SigningKey::from_seed(rng.gen()).public();
            members.push(Member { id: current.highest_id + i, key, addr: String::new() });
        }
        let since = rng.gen_range(1..10_000);
        let next = Membership {
            epoch: current.epoch + 1,
            u: 0,
            r: 0,
            since,
            highest_id: current.highest_id + 3,
            previous: Some(Box::new(Membership { previous: None, ..current })),
            members,
        };
        let root = Digest(rng.gen());
        let membership = next.digest();
        let mut sigs = vec![(self.me, self.signing.sign(&checkpoint_statement(since, &root, &membership, self.me)))];
        for n in (0..self.n as NodeId).filter(|n| *n != self.me).take(self.quorum) {
            sigs.push((n, self.random_sig(rng)));
        }
        Some(EpochCert { proof: StableProof { seq: since, root, membership, sigs }, next })
    }

    /// Remembers a message the node received, for later replay, and answers a request
    /// for the body of a value it forged (the honest replica underneath never saw it).
    pub fn observe(&mut self, from: Peer, msg: &Message) -> Vec<Frame> {
        if self.behaviours.replay {
            self.remember(msg.clone());
        }
        if let Message::FetchValue { seq, digest } = msg {
            if let Some((_, _, value)) = self.forged.iter().find(|(s, d, _)| s == seq && d == digest) {
                self.lies.forged_view_changes += 1;
                let body = Message::ValueBody { seq: *seq, value: value.clone() };
                return vec![(from, keel_core::codec::encode(&body))];
            }
        }
        Vec::new()
    }

    fn remember(&mut self, msg: Message) {
        self.earlier.remember(&msg);
        if self.history.len() == REPLAY_BUFFER_MAX {
            self.history.pop_front();
        }
        self.history.push_back(msg);
    }

    fn lied_to(to: Peer) -> bool {
        matches!(to, Peer::Node(n) if n % 2 == 1)
    }

    /// Rewrites what the honest replica wanted to send.
    pub fn transform(&mut self, rng: &mut ChaCha8Rng, is_primary: bool, outgoing: Vec<(Peer, Message)>) -> Vec<Frame> {
        let mut frames = Vec::new();
        if self.behaviours.silent_primary && is_primary {
            self.lies.silenced += outgoing.len() as u64;
            return frames;
        }
        for (to, msg) in outgoing {
            if self.behaviours.replay {
                self.remember(msg.clone());
            }
            let msg = match msg {
                Message::Bodies { seq, ops } if self.behaviours.withhold_bodies => {
                    self.lies.withheld_bodies += 1;
                    if rng.gen_bool(0.5) {
                        continue;
                    }
                    let ops = ops.iter().map(|op| [&op[..], &[0xee]].concat().into()).collect();
                    Message::Bodies { seq, ops }
                }
                msg => msg,
            };
            let msg = self.rewrite(rng, to, msg);
            frames.push((to, keel_core::codec::encode(&msg)));
        }
        if self.behaviours.replay && !self.history.is_empty() && rng.gen_bool(0.2) {
            // Draws in the order they were drawn before `earlier` (runs without epoch
            // changes replay as they did).
            let (msg, earlier) = match self.earlier.pick(rng) {
                Some(earlier) => (earlier, true),
                None => (self.history[rng.gen_range(0..self.history.len())].clone(), false),
            };
            let to = Peer::Node(rng.gen_range(0..self.n as NodeId));
            self.lies.replays += 1;
            // An earlier epoch's message goes to every node: a NEW-VIEW that moves only
            // some of them leaves the rest ordering in the view they are in.
            let to: Vec<Peer> = if earlier { (0..self.n as NodeId).map(Peer::Node).collect() } else { vec![to] };
            let frame = keel_core::codec::encode(&msg);
            frames.extend(to.into_iter().map(|to| (to, frame.clone())));
        }
        if self.behaviours.junk && rng.gen_bool(0.1) {
            let len = rng.gen_range(0..300);
            let mut bytes: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
            if rng.gen_bool(0.5) && !bytes.is_empty() {
                bytes[0] = keel_core::codec::WIRE_VERSION;
            }
            self.lies.junk_frames += 1;
            frames.push((Peer::Node(rng.gen_range(0..self.n as NodeId)), bytes));
        }
        if self.behaviours.forge_endorsements && rng.gen_bool(0.05) {
            // Vouch, to everyone, for a request no client sent.
            let request = self.fabricate();
            let macs = self.endorse(&request);
            self.lies.forged_endorsements += 1;
            let frame = keel_core::codec::encode(&Message::Endorse { request, macs });
            for n in (0..self.n as NodeId).filter(|n| *n != self.me) {
                frames.push((Peer::Node(n), frame.clone()));
            }
        }
        if self.behaviours.forge_epoch_certs && rng.gen_bool(0.03) {
            if let Some(cert) = self.forge_epoch_cert(rng) {
                self.lies.forged_epoch_certs += 1;
                let frame = keel_core::codec::encode(&Message::EpochCerts(vec![cert]));
                frames.push((Peer::Node(rng.gen_range(0..self.n as NodeId)), frame.clone()));
                // And to the clients it answers.
                let clients: Vec<Peer> =
                    frames.iter().map(|(to, _)| *to).filter(|to| matches!(to, Peer::Client(_))).collect();
                for c in clients {
                    frames.push((c, frame.clone()));
                }
            }
        }
        if self.behaviours.forge_view_change && rng.gen_bool(0.02) {
            // Ask for a far-away view and announce a NEW-VIEW nobody can have built.
            let view = rng.gen_range(1..1_000_000);
            self.lies.forged_view_changes += 1;
            for n in 0..self.n as NodeId {
                if n != self.me {
                    frames.push((Peer::Node(n), keel_core::codec::encode(&Message::Stop { view })));
                    let nv = NewView { view, view_changes: Vec::new(), sig: self.random_sig(rng) };
                    frames.push((Peer::Node(n), keel_core::codec::encode(&Message::NewView(nv))));
                }
            }
        }
        frames
    }

    fn fabricate(&mut self) -> Request {
        self.fabricated_seq += 1;
        Request::new(FABRICATED_CLIENT, self.fabricated_seq, b"made up".to_vec().into())
    }

    /// Its own, valid endorsement of `request` (its colluding RQ node's, if any).
    fn endorse(&self, request: &Request) -> Vec<Mac> {
        let (me, keys) = match &self.colluder {
            Some((id, row)) => (*id, row),
            None => (self.me, &self.endorse_keys),
        };
        let s = endorse_statement(me, &request.statement());
        keys.iter().take(self.n).map(|k| k.mac(&s)).collect()
    }

    fn random_sig(&self, rng: &mut ChaCha8Rng) -> Sig {
        let mut s = [0u8; 64];
        rng.fill(&mut s[..]);
        Sig(s)
    }

    fn rewrite(&mut self, rng: &mut ChaCha8Rng, to: Peer, msg: Message) -> Message {
        match msg {
            Message::Propose { view, seq, value } if self.behaviours.equivocate && Self::lied_to(to) => {
                let alt = self.alternatives.entry((view, seq)).or_insert_with(|| {
                    // Same requests (their MACs stay valid), other order and time: a
                    // different digest that backups accept on its own.
                    let mut requests = value.requests.clone();
                    requests.reverse();
                    Proposal { time: value.time + 1, requests }
                });
                self.lies.equivocations += 1;
                Message::Propose { view, seq, value: alt.clone() }
            }
            Message::Propose { view, seq, value } if self.behaviours.forge_endorsements && seq % 3 == 0 => {
                if self.fabricated.len() >= FORGED_KEPT_MAX {
                    self.fabricated.clear();
                }
                let value = match self.fabricated.get(&(view, seq)) {
                    Some(v) => v.clone(),
                    None => {
                        // A made-up request that only this node vouches for.
                        let mut request = self.fabricate();
                        let node = self.colluder.as_ref().map_or(self.me, |(id, _)| *id);
                        request.endorsements = vec![Endorsement { node, macs: self.endorse(&request) }];
                        let mut v = value;
                        v.requests.push(Proposed::Full(request));
                        self.fabricated.insert((view, seq), v.clone());
                        v
                    }
                };
                self.lies.forged_endorsements += 1;
                Message::Propose { view, seq, value }
            }
            Message::Endorse { request, mut macs } if self.behaviours.forge_endorsements => {
                // Wrong for some nodes: an inconsistent matrix row.
                for (i, m) in macs.iter_mut().enumerate() {
                    if i % 2 == 1 || rng.gen_bool(0.3) {
                        m[0] ^= 0xff;
                    }
                }
                self.lies.forged_endorsements += 1;
                Message::Endorse { request, macs }
            }
            Message::EndorseDigest { client, seq, op, mut macs } if self.behaviours.forge_endorsements => {
                for (i, m) in macs.iter_mut().enumerate() {
                    if i % 2 == 0 || rng.gen_bool(0.3) {
                        m[0] ^= 0xff;
                    }
                }
                self.lies.forged_endorsements += 1;
                Message::EndorseDigest { client, seq, op, macs }
            }
            Message::Write(w) if self.behaviours.equivocate && Self::lied_to(to) => {
                match self.alternatives.get(&(w.view, w.seq)) {
                    Some(alt) => {
                        let digest = alt.digest();
                        let sig =
                            self.signing.sign(&write_statement(&self.epoch_tag(), w.view, w.seq, &digest, self.me));
                        Message::Write(Write { view: w.view, seq: w.seq, digest, sig })
                    }
                    None => Message::Write(w),
                }
            }
            Message::Accept { view, seq, digest } if self.behaviours.equivocate && Self::lied_to(to) => {
                let digest = self.alternatives.get(&(view, seq)).map_or(digest, Proposal::digest);
                Message::Accept { view, seq, digest }
            }
            // Index answers too low would make reads stale if a node trusted fewer than a
            // quorum's highest; too high, they stall reads until their clients order them.
            Message::IndexAck { round, accepted } if self.behaviours.rush_reads => {
                self.lies.index_lies += 1;
                let accepted = if rng.gen_bool(0.8) { 0 } else { accepted + 1_000 };
                Message::IndexAck { round, accepted }
            }
            Message::ViewChange(vc) if self.behaviours.forge_view_change => {
                self.lies.forged_view_changes += 1;
                Message::ViewChange(self.forge_view_change(rng, vc))
            }
            msg if self.behaviours.corrupt && rng.gen_bool(0.2) => {
                self.lies.corruptions += 1;
                corrupt(rng, msg)
            }
            msg => msg,
        }
    }

    /// A view change claiming prepared certificates for made-up values in the highest
    /// possible view, with signatures that do not verify, re-signed by this node.
    fn forge_view_change(&mut self, rng: &mut ChaCha8Rng, mut vc: ViewChange) -> ViewChange {
        let base = vc.stable.seq;
        vc.certs.retain(|c| c.seq > base + 3);
        for seq in base + 1..=base + 3 {
            let forged = Request::new(424_242, rng.gen(), vec![0xde, 0xad].into());
            let value = Value { time: 0, requests: vec![forged] };
            let writes = (0..self.quorum as NodeId).map(|n| (n, self.random_sig(rng))).collect();
            let digest = value.digest();
            vc.certs.push(CertProof { view: vc.view.saturating_sub(1), seq, digest, writes });
            if self.forged.len() == FORGED_KEPT_MAX {
                self.forged.pop_front();
            }
            self.forged.push_back((seq, digest, value));
        }
        if rng.gen_bool(0.3) {
            // Also claim a stable checkpoint far ahead.
            let sigs = (0..self.quorum as NodeId).map(|n| (n, self.random_sig(rng))).collect();
            vc.stable = StableProof { seq: base + 1_000 * 8, root: Digest([7; 32]), membership: Digest([7; 32]), sigs };
            vc.certs.clear();
        }
        vc.sig = self.signing.sign(&vc.statement(&self.epoch_tag()));
        vc
    }
}

fn corrupt(rng: &mut ChaCha8Rng, msg: Message) -> Message {
    let flip = |rng: &mut ChaCha8Rng, d: &mut Digest| d.0[rng.gen_range(0..32)] ^= 1 << rng.gen_range(0..8);
    match msg {
        Message::Write(mut w) => {
            if rng.gen_bool(0.5) {
                flip(rng, &mut w.digest);
            } else {
                w.sig.0[rng.gen_range(0..64)] ^= 1;
            }
            Message::Write(w)
        }
        Message::Accept { view, seq, mut digest } => {
            flip(rng, &mut digest);
            Message::Accept { view, seq, digest }
        }
        Message::Checkpoint(mut c) => {
            flip(rng, &mut c.root);
            Message::Checkpoint(CheckpointVote { seq: c.seq, root: c.root, membership: c.membership, sig: c.sig })
        }
        Message::Push { client, seq, mut event } => {
            event.push(0xee);
            Message::Push { client, seq, event }
        }
        Message::Reply(Reply { client, view, seq, body, epoch }) => {
            let body = match body {
                ReplyBody::Full(mut b) => {
                    b.push(0xee);
                    ReplyBody::Full(b)
                }
                ReplyBody::Hash(mut d) => {
                    flip(rng, &mut d);
                    ReplyBody::Hash(d)
                }
                ReplyBody::NotReadOnly => ReplyBody::Full(vec![0xee]),
            };
            Message::Reply(Reply { client, view, seq, body, epoch })
        }
        Message::Decided { seq, mut value } => {
            // Also a commit notice to execution nodes: one request fewer is a lie an
            // execution node that believed it would execute (a different history).
            value.time = value.time.wrapping_add(1);
            value.requests.pop();
            Message::Decided { seq, value }
        }
        Message::ValueBody { seq, mut value } => {
            value.time = value.time.wrapping_add(1);
            Message::ValueBody { seq, value }
        }
        Message::Bodies { seq, ops } => {
            let ops = ops.iter().map(|op| [&op[..], &[0xee]].concat().into()).collect();
            Message::Bodies { seq, ops }
        }
        Message::FetchValue { seq, mut digest } => {
            flip(rng, &mut digest);
            Message::FetchValue { seq, digest }
        }
        Message::Chunk { seq, index, mut data } => {
            data.push(1);
            Message::Chunk { seq, index, data }
        }
        other => other,
    }
}

/// A Byzantine execution node of a separated cluster (exec_node.rs): the correct node runs
/// underneath and its messages are rewritten. Whatever it does, a client must not accept
/// a wrong result (it needs r + 1 matching replies), order nodes must not certify a
/// wrong checkpoint (r + 1 matching hashes), crash, hold more than their bounds, nor
/// stall.
pub struct ExecByzantine {
    /// Replies with a wrong result (or a wrong digest of one).
    pub wrong_replies: bool,
    /// Checkpoint hashes of a state it does not have, validly signed with its own key.
    pub wrong_checkpoints: bool,
    /// State-transfer chunks altered by a byte; certificates with a root altered.
    pub corrupt_transfers: bool,
    /// STATUS with made-up positions (up to `u64::MAX`), to make order nodes send what
    /// they do not have or overflow.
    pub bogus_status: bool,
    /// Validly signed checkpoint hashes for many instances ahead, to fill order nodes'
    /// vote tables.
    pub flood_votes: bool,
    signing: SigningKey,
    me: NodeId,
    interval: u64,
    /// Lies told.
    pub lies: u64,
}

impl ExecByzantine {
    pub fn random(rng: &mut ChaCha8Rng, me: NodeId, signing: SigningKey, interval: u64) -> ExecByzantine {
        loop {
            let b = ExecByzantine {
                wrong_replies: rng.gen_bool(0.6),
                wrong_checkpoints: rng.gen_bool(0.6),
                corrupt_transfers: rng.gen_bool(0.5),
                bogus_status: rng.gen_bool(0.4),
                flood_votes: rng.gen_bool(0.4),
                signing: signing.clone(),
                me,
                interval,
                lies: 0,
            };
            if b.wrong_replies || b.wrong_checkpoints || b.corrupt_transfers || b.bogus_status || b.flood_votes {
                return b;
            }
        }
    }

    pub fn names(&self) -> Vec<&'static str> {
        [
            (self.wrong_replies, "wrong-replies"),
            (self.wrong_checkpoints, "wrong-checkpoints"),
            (self.corrupt_transfers, "corrupt-transfers"),
            (self.bogus_status, "bogus-status"),
            (self.flood_votes, "flood-votes"),
        ]
        .into_iter()
        .filter_map(|(on, name)| on.then_some(name))
        .collect()
    }

    fn signed_vote(&self, seq: u64, root: Digest, membership: Digest) -> Message {
        let sig = self.signing.sign(&checkpoint_statement(seq, &root, &membership, self.me));
        Message::Checkpoint(CheckpointVote { seq, root, membership, sig })
    }

    pub fn transform(&mut self, rng: &mut ChaCha8Rng, outgoing: Vec<(Peer, Message)>) -> Vec<Frame> {
        let mut frames = Vec::new();
        for (to, msg) in outgoing {
            let msg = match msg {
                Message::Reply(mut reply) if self.wrong_replies => {
                    self.lies += 1;
                    reply.body = match reply.body {
                        ReplyBody::Full(mut bytes) => {
                            // A different result (trailing bytes a decoder might ignore).
                            match bytes.len() {
                                0 => bytes.push(rng.gen()),
                                len => bytes[rng.gen_range(0..len)] ^= 1 << rng.gen_range(0..8),
                            }
                            ReplyBody::Full(bytes)
                        }
                        ReplyBody::Hash(mut d) => {
                            d.0[0] ^= 1;
                            ReplyBody::Hash(d)
                        }
                        other => other,
                    };
                    Message::Reply(reply)
                }
                Message::Checkpoint(vote) if self.wrong_checkpoints || self.flood_votes => {
                    let mut root = vote.root;
                    if self.wrong_checkpoints {
                        self.lies += 1;
                        root.0[rng.gen_range(0..32)] ^= 1;
                    }
                    if self.flood_votes {
                        for k in 1..=rng.gen_range(1..=64u64) {
                            self.lies += 1;
                            let ahead =
                                self.signed_vote(vote.seq + k * self.interval, Digest(rng.gen()), vote.membership);
                            frames.push((to, keel_core::codec::encode(&ahead)));
                        }
                    }
                    self.signed_vote(vote.seq, root, vote.membership)
                }
                Message::Status { view, .. } if self.bogus_status => {
                    self.lies += 1;
                    let made_up = |rng: &mut ChaCha8Rng| if rng.gen_bool(0.3) { u64::MAX } else { rng.gen() };
                    Message::Status { view, executed: made_up(rng), stable: made_up(rng) }
                }
                Message::Chunk { seq, index, mut data } if self.corrupt_transfers => {
                    self.lies += 1;
                    data.push(0xee);
                    Message::Chunk { seq, index, data }
                }
                Message::StableCert(mut proof) if self.corrupt_transfers && !proof.sigs.is_empty() => {
                    self.lies += 1;
                    proof.root.0[0] ^= 1;
                    Message::StableCert(proof)
                }
                other => other,
            };
            frames.push((to, keel_core::codec::encode(&msg)));
        }
        frames
    }
}

/// A Byzantine RQ node of a separate RQ stage (rq_node.rs): the correct node runs
/// underneath and its messages are rewritten. Whatever it does, order nodes must not
/// order a request no client sent (they need `u + 1` valid endorsements, so at least one
/// from a correct RQ node), vote for bytes that do not match a digest, nor stall.
pub struct RqByzantine {
    /// Endorsements with MAC entries spoiled for some recipients (valid for the others).
    pub spoil_macs: bool,
    /// Endorses made-up requests of real clients (validly MACed with its own keys) to
    /// every order node and RQ peer.
    pub made_up: bool,
    /// Drops its endorsements to the primary (first receipts) and every BODIES answer.
    pub withhold: bool,
    /// Answers a FETCH-BODIES with bytes that match no digest.
    pub wrong_bodies: bool,
    me: NodeId,
    /// Its endorsement keys: per order node, then per RQ node (of the epoch its core
    /// follows, `follow`).
    row: Vec<MacKey>,
    epoch: u64,
    /// Order node ids (stable), RQ node ids, and the clients whose requests it makes up.
    order: Vec<NodeId>,
    rq: std::ops::Range<NodeId>,
    clients: Vec<u64>,
    /// Lies told.
    pub lies: u64,
}

impl RqByzantine {
    pub fn random(
        rng: &mut ChaCha8Rng,
        me: NodeId,
        row: Vec<MacKey>,
        (order, rq): (std::ops::Range<NodeId>, std::ops::Range<NodeId>),
        clients: Vec<u64>,
    ) -> RqByzantine {
        loop {
            let b = RqByzantine {
                spoil_macs: rng.gen_bool(0.5),
                made_up: rng.gen_bool(0.5),
                withhold: rng.gen_bool(0.4),
                wrong_bodies: rng.gen_bool(0.4),
                me,
                row: row.clone(),
                epoch: 0,
                order: order.clone().collect(),
                rq: rq.clone(),
                clients: clients.clone(),
                lies: 0,
            };
            if b.spoil_macs || b.made_up || b.withhold || b.wrong_bodies {
                return b;
            }
        }
    }

    /// The epoch its lies are made for.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The epoch its core follows now: its lies are made for that epoch's members.
    pub fn follow(&mut self, epoch: u64, row: Vec<MacKey>, order: Vec<NodeId>) {
        (self.epoch, self.row, self.order) = (epoch, row, order);
    }

    pub fn names(&self) -> Vec<&'static str> {
        [
            (self.spoil_macs, "spoil-macs"),
            (self.made_up, "made-up-requests"),
            (self.withhold, "withhold"),
            (self.wrong_bodies, "wrong-bodies"),
        ]
        .into_iter()
        .filter_map(|(on, name)| on.then_some(name))
        .collect()
    }

    fn endorse(&self, request: &Request) -> Vec<Mac> {
        let s = endorse_statement(self.me, &request.statement());
        self.row.iter().map(|k| k.mac(&s)).collect()
    }

    pub fn transform(&mut self, rng: &mut ChaCha8Rng, outgoing: Vec<(Peer, Message)>) -> Vec<Frame> {
        let mut frames = Vec::new();
        for (to, msg) in outgoing {
            let msg = match msg {
                Message::Endorse { request, .. } if self.withhold && request.endorsements.is_empty() => {
                    // A first receipt (to the primary only): never sent.
                    self.lies += 1;
                    continue;
                }
                Message::Endorse { request, mut macs } if self.spoil_macs && !macs.is_empty() => {
                    self.lies += 1;
                    for _ in 0..rng.gen_range(1..=2) {
                        let i = rng.gen_range(0..macs.len());
                        macs[i][0] ^= 0x5a;
                    }
                    Message::Endorse { request, macs }
                }
                Message::Bodies { .. } if self.withhold => {
                    self.lies += 1;
                    continue;
                }
                Message::Bodies { seq, mut ops } if self.wrong_bodies => {
                    self.lies += 1;
                    ops = ops
                        .into_iter()
                        .map(|op| {
                            let mut bytes = op.to_vec();
                            bytes.push(0xee);
                            bytes.into()
                        })
                        .collect();
                    Message::Bodies { seq, ops }
                }
                other => other,
            };
            frames.push((to, keel_core::codec::encode(&msg)));
        }
        if self.made_up && !self.clients.is_empty() && rng.gen_bool(0.2) {
            // A request its client never sent, under a sequence number it may use next.
            self.lies += 1;
            let client = self.clients[rng.gen_range(0..self.clients.len())];
            let mut op = vec![0u8; rng.gen_range(1..200)];
            rng.fill(&mut op[..]);
            let request = Request::new(client, rng.gen_range(1..64), op.into());
            let macs = self.endorse(&request);
            let msg = keel_core::codec::encode(&Message::Endorse { request, macs });
            for to in self.order.iter().copied().chain(self.rq.clone()).filter(|&n| n != self.me) {
                frames.push((Peer::Node(to), msg.clone()));
            }
        }
        frames
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_behaviour_can_be_pinned_alone_by_its_name() {
        for name in Behaviours::NAMES {
            let b = Behaviours::only(name).expect("a known name");
            assert_eq!(b.names(), vec![name]);
        }
        assert!(Behaviours::only("lie").is_none());
        // NAMES lists them all: every field set names every name.
        let mut rng = <ChaCha8Rng as rand::SeedableRng>::seed_from_u64(1);
        let mut seen: Vec<&str> = (0..200).flat_map(|_| Behaviours::random(&mut rng).names()).collect();
        seen.sort_unstable();
        seen.dedup();
        let mut all = Behaviours::NAMES.to_vec();
        all.sort_unstable();
        assert_eq!(seen, all);
    }
}
