//! Byzantine behaviours for up to r nodes.
//!
//! A Byzantine node runs the correct replica underneath (so it keeps pace and knows what
//! to lie about) and rewrites what it sends. It holds its own signing key, so it can sign
//! any lie; it cannot sign for others or impersonate another peer on the channel.

use keel_core::chunk::leaf_digest;
use keel_core::crypto::{Digest, Hasher, Mac, MacKey, NodeKeys, Sig, SigningKey};
use keel_core::ids::NodeRange;
use keel_core::membership::{Member, Membership};
use keel_core::message::{
    checkpoint_statement, endorse_statement, owner_of, proof_signed, write_statement, CertProof, CheckpointVote,
    ClientId, Endorsement, EpochCert, MemberIndex, Message, NewView, NodeId, Proposal, Proposed, Reply, ReplyBody,
    Request, Seq, StableProof, Value, View, ViewChange, Write,
};
use keel_core::replica::Peer;
use rand::seq::SliceRandom;
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// Messages a Byzantine node remembers for replays (the most recent ones).
const REPLAY_BUFFER_MAX: usize = 128;
/// Besides the most recent: a uniform sample (reservoir) of the messages of each
/// membership epoch, so that replays reach back to any earlier epoch, not only as far as
/// the last `REPLAY_BUFFER_MAX` messages do.
const EPOCH_SAMPLE_MAX: usize = 32;
/// Epochs sampled; past that the oldest after the first is dropped (the first epoch and
/// the most recent ones stay).
const EPOCHS_SAMPLED_MAX: usize = 16;
/// Instances whose proposals (conflicting votes) or own re-written proposals it keeps.
const INSTANCES_KEPT_MAX: usize = 512;
/// Views whose VIEW-CHANGEs a Byzantine new primary keeps to pick from.
const VIEWS_KEPT_MAX: usize = 4;
/// Stable checkpoint proofs kept to claim an older one.
const STABLES_KEPT_MAX: usize = 16;
/// Chunks of its making it keeps to serve (those its false manifests name).
const FALSE_CHUNKS_MAX: usize = 64;
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
    /// As primary, propose a different value to one side of a split of the nodes, drawn
    /// anew per instance from the node's seed (any split with another node on each side),
    /// and vote for both, each side its own, validly signed.
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
    /// As a backup, WRITEs and ACCEPTs for another value than the one proposed (the value
    /// an equivocating primary would tell the other side, else the null value) to one
    /// side of a per-instance split: two votes for one (view, instance), each validly
    /// signed with its own key.
    pub conflicting_votes: bool,
    /// VIEW-CHANGEs, validly re-signed, that omit prepared certificates, replace some by
    /// older ones of its own, and claim an older stable checkpoint.
    pub hide_certs: bool,
    /// As new primary: NEW-VIEWs from the view changes of its choosing (the quorum naming
    /// the fewest prepared values, or a random one; its own with every certificate
    /// hidden; now and then one short of a quorum), validly signed, chosen anew for each
    /// node.
    pub pick_new_view: bool,
    /// Validly signed checkpoint votes for a root (or membership) it does not hold, and
    /// false manifests and chunks when asked for state.
    pub wrong_checkpoints: bool,
    /// Censors one client (chosen by the seed): as primary never proposes its requests,
    /// as any node drops its replies, pushes, endorsements and forwards.
    pub censor_client: bool,
    /// Every reply and push event it sends names another result (or event) than its
    /// replica's, tagged with the epoch it runs: what r + 1 matching answers are for.
    pub wrong_replies: bool,
}

impl Behaviours {
    /// Every behaviour's name, as `names` gives them and [`Behaviours::only`] takes them.
    pub const NAMES: [&'static str; 17] = [
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
        "conflicting-votes",
        "hide-certs",
        "pick-new-view",
        "wrong-checkpoints",
        "censor-client",
        "wrong-replies",
    ];

    /// The behaviour named `name` alone (one of [`Behaviours::NAMES`]).
    pub fn only(name: &str) -> Option<Behaviours> {
        Behaviours::default().with(name)
    }

    /// These behaviours and the one named `name` (one of [`Behaviours::NAMES`]).
    pub fn with(self, name: &str) -> Option<Behaviours> {
        let mut b = self;
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
            "wrong-replies" => &mut b.wrong_replies,
            "conflicting-votes" => &mut b.conflicting_votes,
            "hide-certs" => &mut b.hide_certs,
            "pick-new-view" => &mut b.pick_new_view,
            "wrong-checkpoints" => &mut b.wrong_checkpoints,
            "censor-client" => &mut b.censor_client,
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
                conflicting_votes: rng.gen_bool(0.5),
                hide_certs: rng.gen_bool(0.5),
                pick_new_view: rng.gen_bool(0.5),
                wrong_checkpoints: rng.gen_bool(0.5),
                censor_client: rng.gen_bool(0.3),
                wrong_replies: rng.gen_bool(0.4),
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
                || b.conflicting_votes
                || b.hide_certs
                || b.pick_new_view
                || b.wrong_checkpoints
                || b.censor_client
                || b.wrong_replies
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
            (self.conflicting_votes, "conflicting-votes"),
            (self.hide_certs, "hide-certs"),
            (self.pick_new_view, "pick-new-view"),
            (self.wrong_checkpoints, "wrong-checkpoints"),
            (self.censor_client, "censor-client"),
            (self.wrong_replies, "wrong-replies"),
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
    /// Validly signed WRITEs and ACCEPTs for a value other than the one it voted for.
    pub conflicting_votes: u64,
    /// Validly signed VIEW-CHANGEs that differ from its replica's: certificates omitted
    /// or older, or an older stable checkpoint.
    pub hidden_certs: u64,
    /// Validly signed NEW-VIEWs that differ from the one its replica built.
    pub picked_new_views: u64,
    /// Of those, NEW-VIEWs with one view change fewer than a quorum.
    pub short_new_views: u64,
    /// Validly signed checkpoint votes for a root or membership it does not hold.
    pub wrong_checkpoint_votes: u64,
    /// Manifests and chunks that do not match the checkpoint asked for.
    pub false_transfers: u64,
    /// Proposals stripped of the censored client's requests (or not sent), and its
    /// replies, pushes, endorsements and forwards dropped.
    pub censored: u64,
    /// Replays of a message from an earlier membership epoch.
    pub old_epoch_replays: u64,
    /// Replies and push events sent with another result or event than its replica's.
    pub wrong_replies: u64,
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
        self.conflicting_votes += o.conflicting_votes;
        self.hidden_certs += o.hidden_certs;
        self.picked_new_views += o.picked_new_views;
        self.short_new_views += o.short_new_views;
        self.wrong_checkpoint_votes += o.wrong_checkpoint_votes;
        self.false_transfers += o.false_transfers;
        self.censored += o.censored;
        self.old_epoch_replays += o.old_epoch_replays;
        self.wrong_replies += o.wrong_replies;
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
            + self.conflicting_votes
            + self.hidden_certs
            + self.picked_new_views
            + self.wrong_checkpoint_votes
            + self.false_transfers
            + self.censored
            + self.old_epoch_replays
            + self.wrong_replies
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
    alternatives: BTreeMap<(View, u64), Proposal>,
    /// Bodies of the values its forged certificates name, in forging order. A forger that
    /// could not hand out the body would only stall the instance: view changes carry
    /// digests, so the new primary fetches the body from the certificate's holders.
    forged: VecDeque<(Seq, Digest, Value)>,
    /// Its keys for endorsements (entry j for node j of its epoch): it can endorse
    /// anything, as itself.
    endorse_keys: Vec<MacKey>,
    /// (view, seq) → the proposal with a made-up request added, the same for every backup.
    fabricated: BTreeMap<(View, u64), Proposal>,
    fabricated_seq: u64,
    /// With a separate RQ stage, a Byzantine RQ node it colludes with: that node's id and
    /// endorsement keys (per order node), which its made-up requests are endorsed with
    /// (an order node's own endorsement counts for nothing there).
    colluder: Option<(NodeId, Vec<MacKey>)>,
    /// The membership its replica runs (what forged certificates must seem to follow).
    membership: Option<Membership>,
    /// Seeds the per-instance splits of the nodes (equivocation, conflicting votes).
    split_seed: u64,
    /// The client it censors (`censor_client`), by owner.
    censored: Option<ClientId>,
    /// The instances' size bound above a stable checkpoint (`Options::log_max`): the
    /// window a view change's certificates must lie in.
    log_max: u64,
    /// (view, seq) → the digest of the value an equivocating primary would tell the other
    /// side, for the proposals it received (`conflicting_votes`).
    proposed_alt: BTreeMap<(View, Seq), Digest>,
    /// (view, seq) → what it proposed to the nodes it did not equivocate to, where that is
    /// not its replica's proposal (censoring): it votes for that to them.
    told: BTreeMap<(View, Seq), Proposal>,
    /// Per membership epoch: messages seen, and a uniform sample of them (replays).
    epoch_samples: BTreeMap<u64, (u64, Vec<Message>)>,
    /// Stable checkpoint proofs of its epoch it saw (`hide_certs` claims older ones).
    stables: Vec<StableProof>,
    /// The certificates of its own earlier view changes, by instance (`hide_certs`
    /// replaces newer ones by these).
    own_certs: BTreeMap<Seq, Vec<CertProof>>,
    /// Valid VIEW-CHANGEs it received, by view then sender (`pick_new_view`).
    view_changes: BTreeMap<View, BTreeMap<NodeId, ViewChange>>,
    /// (seq, index) → a chunk of its making that its false manifests name by digest
    /// (`wrong_checkpoints`): manifest and chunks agree, and only the root gives them away.
    false_chunks: BTreeMap<(Seq, u32), Vec<u8>>,
    /// View → the NEW-VIEW of its choosing it sends most nodes (`pick_new_view`).
    picked: BTreeMap<View, NewView>,
    /// Messages of earlier epochs, replayed once the next epoch got going.
    earlier: EarlierEpochs,
    /// `wrong_replies` lies only in answers tagged with this epoch or a later one: a node
    /// that turned Byzantine when its epoch raised r (world.rs `turn_byzantine`) must
    /// not lie as a node of an epoch that tolerated no more liars (no client could tell).
    lies_from_epoch: u64,
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
    since: Seq,
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
    fn epoch_changed(&mut self, history: &VecDeque<Message>, since: Seq) {
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
            split_seed: 0,
            censored: None,
            log_max: 0,
            proposed_alt: BTreeMap::new(),
            told: BTreeMap::new(),
            epoch_samples: BTreeMap::new(),
            stables: Vec::new(),
            own_certs: BTreeMap::new(),
            view_changes: BTreeMap::new(),
            false_chunks: BTreeMap::new(),
            picked: BTreeMap::new(),
            lies_from_epoch: 0,
            lies: LieCounts::default(),
        }
    }

    /// From now on, lie in answers of `epoch` and later only (`lies_from_epoch`).
    pub fn lie_from_epoch(&mut self, epoch: u64) {
        self.lies_from_epoch = epoch;
    }

    /// What its lies are made from: `seed` (from the run's seed) draws the splits of
    /// the nodes and the client it censors among `clients`; `log_max` is the window of a
    /// view change's certificates above its stable checkpoint.
    pub fn seeded(mut self, seed: u64, clients: &[ClientId], log_max: u64) -> Byzantine {
        self.split_seed = seed;
        self.log_max = log_max;
        if !clients.is_empty() {
            self.censored = Some(owner_of(clients[(seed % clients.len() as u64) as usize]));
        }
        self
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
        if self.membership.as_ref().is_some_and(|m| m.epoch != membership.epoch) {
            // Proofs, certificates and view changes are signed for one epoch (its tag)
            // and name nodes by their index there: lies made of them are this epoch's.
            self.stables.clear();
            self.own_certs.clear();
            self.view_changes.clear();
            self.picked.clear();
            self.proposed_alt.clear();
            self.told.clear();
            self.alternatives.clear();
        }
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
        let me = current.members.get(self.me.0 as usize)?.clone();
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
            since: Seq(since),
            highest_id: current.highest_id + 3,
            previous: Some(Box::new(Membership { previous: None, ..current })),
            members,
        };
        let root = Digest(rng.gen());
        let membership = next.digest();
        let mut sigs =
            vec![(self.me, self.signing.sign(&checkpoint_statement(Seq(since), &root, &membership, self.me)))];
        for n in NodeRange::first(self.n).filter(|n| *n != self.me).take(self.quorum) {
            sigs.push((n, self.random_sig(rng)));
        }
        Some(EpochCert { proof: StableProof { seq: Seq(since), root, membership, sigs }, next })
    }

    /// The membership epoch its replica runs.
    fn epoch(&self) -> u64 {
        self.membership.as_ref().map_or(0, |m| m.epoch)
    }

    /// The primary of `view` in its membership.
    fn primary(&self, view: View) -> NodeId {
        NodeId(view.primary(self.n.max(1)).0)
    }

    /// Remembers a message the node received, for later replay, and answers a request
    /// for the body of a value it forged (the honest replica underneath never saw it).
    /// Also notes what its lies are made of: proposals, view changes, stable proofs; and
    /// answers a request for state with a made-up manifest or chunk.
    pub fn observe(&mut self, rng: &mut ChaCha8Rng, from: Peer, msg: &Message) -> Vec<Frame> {
        if self.behaviours.replay {
            self.remember(rng, msg.clone());
        }
        let sender = match from {
            Peer::Node(n) => Some(n),
            Peer::Client(_) => None,
        };
        match msg {
            Message::FetchValue { seq, digest } => {
                if let Some((_, _, value)) = self.forged.iter().find(|(s, d, _)| s == seq && d == digest) {
                    self.lies.forged_view_changes += 1;
                    let body = Message::ValueBody { seq: *seq, value: value.clone() };
                    return vec![(from, keel_core::codec::encode(&body))];
                }
            }
            Message::Propose { view, seq, value }
                if self.behaviours.conflicting_votes && sender == Some(self.primary(*view)) =>
            {
                if self.proposed_alt.len() >= INSTANCES_KEPT_MAX {
                    self.proposed_alt.pop_first();
                }
                self.proposed_alt.insert((*view, *seq), alternative(value).digest());
            }
            Message::ViewChange(vc) => {
                if self.behaviours.hide_certs {
                    self.note_stable(&vc.stable);
                }
                if self.behaviours.pick_new_view && self.primary(vc.view) == self.me && self.view_change_valid(vc) {
                    self.view_changes.entry(vc.view).or_default().insert(NodeId(vc.from.0), vc.clone());
                    while self.view_changes.len() > VIEWS_KEPT_MAX {
                        self.view_changes.pop_first();
                    }
                }
            }
            Message::NewView(nv) if self.behaviours.hide_certs => {
                for vc in &nv.view_changes {
                    self.note_stable(&vc.stable);
                }
            }
            Message::StableCert(proof) if self.behaviours.hide_certs => self.note_stable(proof),
            Message::FetchManifest { seq } if self.behaviours.wrong_checkpoints && rng.gen_bool(0.5) => {
                // A state of its making, first: a manifest of chunks it serves, which
                // cannot hash to the certified root.
                self.lies.false_transfers += 1;
                let mut chunks = Vec::new();
                let mut len = 0;
                for index in 0..rng.gen_range(1..4u32) {
                    let data: Vec<u8> = (0..rng.gen_range(1..512)).map(|_| rng.gen()).collect();
                    len += data.len() as u64;
                    chunks.push(leaf_digest(&data));
                    self.keep_false_chunk(*seq, index, data);
                }
                let manifest = Message::Manifest { seq: *seq, len, chunks };
                return vec![(from, keel_core::codec::encode(&manifest))];
            }
            Message::FetchChunk { seq, index } if self.behaviours.wrong_checkpoints => {
                // A chunk its false manifest named, else (half the time) random bytes.
                let data = match self.false_chunks.get(&(*seq, *index)) {
                    Some(data) => data.clone(),
                    None if rng.gen_bool(0.5) => (0..rng.gen_range(1..512)).map(|_| rng.gen()).collect(),
                    None => return Vec::new(),
                };
                self.lies.false_transfers += 1;
                let chunk = Message::Chunk { seq: *seq, index: *index, data };
                return vec![(from, keel_core::codec::encode(&chunk))];
            }
            _ => {}
        }
        Vec::new()
    }

    fn keep_false_chunk(&mut self, seq: Seq, index: u32, data: Vec<u8>) {
        if self.false_chunks.len() >= FALSE_CHUNKS_MAX {
            self.false_chunks.pop_first();
        }
        self.false_chunks.insert((seq, index), data);
    }

    /// Keeps `proof` if it is of this epoch and not kept yet (as a stable checkpoint to
    /// claim later, once a newer one exists). Only proofs that hold in this epoch are
    /// kept, so that a VIEW-CHANGE claiming one stays valid.
    fn note_stable(&mut self, proof: &StableProof) {
        if self.stables.iter().any(|s| s.seq == proof.seq) || !self.stable_valid(proof) {
            return;
        }
        if self.stables.len() >= STABLES_KEPT_MAX {
            self.stables.remove(0);
        }
        self.stables.push(proof.clone());
    }

    fn remember(&mut self, rng: &mut ChaCha8Rng, msg: Message) {
        self.earlier.remember(&msg);
        if self.history.len() == REPLAY_BUFFER_MAX {
            self.history.pop_front();
        }
        self.history.push_back(msg.clone());
        // Reservoir sampling: each message of the epoch stays in its sample with the same
        // chance, however long the epoch ran.
        let epoch = self.epoch();
        let (seen, sample) = self.epoch_samples.entry(epoch).or_default();
        *seen += 1;
        if sample.len() < EPOCH_SAMPLE_MAX {
            sample.push(msg);
        } else {
            let j = rng.gen_range(0..*seen) as usize;
            if j < EPOCH_SAMPLE_MAX {
                sample[j] = msg;
            }
        }
        if self.epoch_samples.len() > EPOCHS_SAMPLED_MAX {
            let second = self.epoch_samples.keys().nth(1).copied();
            if let Some(e) = second {
                self.epoch_samples.remove(&e);
            }
        }
    }

    /// A message to replay: half the time (if there was an earlier epoch) one sampled
    /// from a random earlier epoch, else one of the most recent.
    fn replay_pick(&mut self, rng: &mut ChaCha8Rng) -> Option<Message> {
        let current = self.epoch();
        let earlier: Vec<u64> =
            self.epoch_samples.iter().filter(|(e, (_, s))| **e < current && !s.is_empty()).map(|(e, _)| *e).collect();
        if !earlier.is_empty() && rng.gen_bool(0.5) {
            let sample = &self.epoch_samples.get(&earlier[rng.gen_range(0..earlier.len())])?.1;
            self.lies.old_epoch_replays += 1;
            return sample.get(rng.gen_range(0..sample.len())).cloned();
        }
        if self.history.is_empty() {
            return None;
        }
        self.history.get(rng.gen_range(0..self.history.len())).cloned()
    }

    /// Whether node `to` is on the side told the other value in instance (view, seq): a
    /// split of the nodes drawn from the node's seed anew for each instance, with at least
    /// one node other than this one on each side.
    fn lied_to(&self, view: View, seq: Seq, to: Peer) -> bool {
        let Peer::Node(to) = to else { return false };
        if to >= NodeId(64) {
            return false;
        }
        let n = self.n.min(64) as u32;
        let all = if n >= 64 { u64::MAX } else { (1u64 << n) - 1 };
        let others = all & !1u64.checked_shl(self.me.0).unwrap_or(0);
        let h = Hasher::new("keel-sim/split").u64(self.split_seed).u64(view.0).u64(seq.0).finish().prefix_u64();
        let mut side = h & others;
        if side == 0 || side == others {
            // Everyone on one side: move the lowest other node over.
            side ^= others & others.wrapping_neg();
        }
        side >> to.0 & 1 == 1
    }

    /// The digest this node votes for to `to` in (view, seq) where that is not its
    /// replica's vote, and whether it is a conflicting vote (counted as one).
    fn vote_lie(&self, view: View, seq: Seq, to: Peer, is_primary: bool) -> Option<(Digest, bool)> {
        if self.behaviours.equivocate && self.lied_to(view, seq, to) {
            if let Some(alt) = self.alternatives.get(&(view, seq.0)) {
                return Some((alt.digest(), false));
            }
        }
        if let Some(p) = self.told.get(&(view, seq)) {
            // It proposed this to everyone else (censoring): its votes follow.
            return Some((p.digest(), false));
        }
        if self.behaviours.conflicting_votes && !is_primary && self.lied_to(view, seq, to) {
            // The value a colluding equivocating primary told the other side, else the
            // null value a new view might fill the instance with.
            let alt = self.proposed_alt.get(&(view, seq)).copied().unwrap_or_else(|| Value::null().digest());
            return Some((alt, true));
        }
        None
    }

    /// Its WRITE or ACCEPT to `to` as the lies it tells need: for another value, validly
    /// signed with its own key (the channel authenticates an ACCEPT).
    fn lie_in_votes(&mut self, to: Peer, is_primary: bool, msg: Message) -> Message {
        match msg {
            Message::Write(w) => match self.vote_lie(w.view, w.seq, to, is_primary) {
                Some((digest, conflicting)) if digest != w.digest => {
                    self.lies.conflicting_votes += conflicting as u64;
                    let sig = self.signing.sign(&write_statement(
                        &self.epoch_tag(),
                        w.view,
                        w.seq,
                        &digest,
                        MemberIndex(self.me.0),
                    ));
                    Message::Write(Write { view: w.view, seq: w.seq, digest, sig })
                }
                _ => Message::Write(w),
            },
            Message::Accept { view, seq, digest } => match self.vote_lie(view, seq, to, is_primary) {
                Some((lie, conflicting)) if lie != digest => {
                    self.lies.conflicting_votes += conflicting as u64;
                    Message::Accept { view, seq, digest: lie }
                }
                _ => Message::Accept { view, seq, digest },
            },
            other => other,
        }
    }

    /// Censoring: what it sends instead of `msg` (None: nothing).
    fn censor(&mut self, msg: Message) -> Option<Message> {
        let Some(victim) = self.censored else { return Some(msg) };
        let theirs = |c: ClientId| owner_of(c) == victim;
        let dropped = match &msg {
            Message::Propose { view, seq, value } if value.requests.iter().any(|r| theirs(r.client())) => {
                self.lies.censored += 1;
                let mut kept = value.clone();
                kept.requests.retain(|r| !theirs(r.client()));
                if kept.requests.is_empty() {
                    // Nothing else to propose here: it proposes nothing (the backups'
                    // request timers are what reveal it).
                    return None;
                }
                if self.told.len() >= INSTANCES_KEPT_MAX {
                    self.told.pop_first();
                }
                self.told.insert((*view, *seq), kept.clone());
                return Some(Message::Propose { view: *view, seq: *seq, value: kept });
            }
            Message::Reply(r) => theirs(r.client),
            Message::Push { client, .. } | Message::EndorseDigest { client, .. } => theirs(*client),
            Message::Endorse { request, .. } | Message::Forward(request) => theirs(request.client),
            _ => false,
        };
        if dropped {
            self.lies.censored += 1;
            return None;
        }
        Some(msg)
    }

    /// Whether `proof` holds in its epoch, as a correct node judges it
    /// (`Replica::validate_stable_proof`).
    fn stable_valid(&self, p: &StableProof) -> bool {
        let Some(m) = &self.membership else { return false };
        if p.seq == Seq(0) {
            return p.sigs.is_empty() && p.root == Digest::default();
        }
        if p.seq < m.since {
            return false;
        }
        if p.seq == m.since {
            if let Some(prev) = &m.previous {
                let q = prev.quorums().map(|q| q.order_quorum());
                return p.membership == m.digest() && q.is_ok_and(|q| proof_signed(&NodeKeys::new(&prev.keys()), q, p));
            }
        }
        proof_signed(&NodeKeys::new(&m.keys()), self.quorum, p)
    }

    /// Whether `vc` holds in its epoch, as a correct node judges it
    /// (`Replica::validate_view_change`): only valid ones go into its NEW-VIEWs, so that
    /// those reach the nodes' decision rule instead of dying at a check.
    fn view_change_valid(&self, vc: &ViewChange) -> bool {
        let Some(m) = &self.membership else { return false };
        let (keys, tag) = (NodeKeys::new(&m.keys()), m.digest());
        if vc.from.0 as usize >= m.n() || !keys.verify(vc.from.0, &vc.statement(&tag), &vc.sig) {
            return false;
        }
        if !self.stable_valid(&vc.stable) {
            return false;
        }
        let high = vc.stable.seq.saturating_add(self.log_max);
        let mut seqs = BTreeSet::new();
        vc.certs.iter().all(|c| {
            let mut writers = BTreeSet::new();
            let signed = c.writes.iter().all(|(node, sig)| {
                writers.insert(*node);
                keys.verify(node.0, &write_statement(&tag, c.view, c.seq, &c.digest, *node), sig)
            });
            c.seq > vc.stable.seq
                && c.seq <= high
                && seqs.insert(c.seq)
                && c.view < vc.view
                && signed
                && writers.len() >= self.quorum
        })
    }

    /// Its replica's VIEW-CHANGE with what it prepared hidden, validly re-signed: an older
    /// stable checkpoint it saw in this epoch, some certificates replaced by ones of its
    /// own earlier view changes, some or all omitted.
    fn hide_certs(&mut self, rng: &mut ChaCha8Rng, vc: ViewChange) -> ViewChange {
        self.note_stable(&vc.stable);
        for c in &vc.certs {
            let kept = self.own_certs.entry(c.seq).or_default();
            if !kept.contains(c) {
                kept.push(c.clone());
            }
        }
        self.own_certs = self.own_certs.split_off(&(vc.stable.seq + 1));
        let mut lie = vc.clone();
        let older: Vec<&StableProof> = self.stables.iter().filter(|s| s.seq < vc.stable.seq).collect();
        if !older.is_empty() && rng.gen_bool(0.5) {
            let old = older[rng.gen_range(0..older.len())].clone();
            // Certificates above the claimed checkpoint's window would make it invalid.
            let high = old.seq + self.log_max;
            lie.certs.retain(|c| c.seq <= high);
            lie.stable = old;
        }
        for cert in lie.certs.iter_mut() {
            let earlier = self
                .own_certs
                .get(&cert.seq)
                .and_then(|cs| cs.iter().filter(|c| c.view < cert.view).min_by_key(|c| c.view));
            if let Some(earlier) = earlier.filter(|_| rng.gen_bool(0.5)) {
                *cert = earlier.clone();
            }
        }
        if rng.gen_bool(0.3) {
            lie.certs.clear();
        } else {
            lie.certs.retain(|_| rng.gen_bool(0.5));
        }
        if lie == vc {
            return vc;
        }
        self.lies.hidden_certs += 1;
        lie.sig = self.signing.sign(&lie.statement(&self.epoch_tag()));
        lie
    }

    /// As the primary of `nv.view`: a NEW-VIEW of valid VIEW-CHANGEs of its choosing,
    /// validly signed, instead of its replica's (the first Q that arrived).
    fn pick_new_view(&mut self, rng: &mut ChaCha8Rng, nv: NewView) -> NewView {
        let tag = self.epoch_tag();
        let mut pool = self.view_changes.get(&nv.view).cloned().unwrap_or_default();
        for vc in &nv.view_changes {
            pool.insert(NodeId(vc.from.0), vc.clone());
        }
        // Its own view change (always in): as its replica made it, with every certificate
        // hidden, or with the lower ones hidden and the highest kept, so that the instances
        // below it are re-proposed as null unless another view change names them. Each is
        // one it may sign.
        let mut own = pool.remove(&self.me);
        let mut hidden = BTreeSet::new();
        if let Some(own) = own.as_mut().filter(|v| !v.certs.is_empty()) {
            let before = own.certs.len();
            if rng.gen_bool(0.5) {
                own.certs.clear();
            } else if rng.gen_bool(0.5) {
                let top = own.certs.iter().map(|c| c.seq).max().unwrap_or(Seq(0));
                let seqs: Vec<Seq> = own.certs.iter().map(|c| c.seq).filter(|s| *s < top).collect();
                let cut = seqs.choose(rng).copied().unwrap_or(Seq(0));
                own.certs.retain(|c| c.seq > cut);
            }
            if own.certs.len() != before {
                own.sig = self.signing.sign(&own.statement(&tag));
            }
            let kept: BTreeSet<Seq> = own.certs.iter().map(|c| c.seq).collect();
            hidden = nv
                .view_changes
                .iter()
                .filter(|v| v.from.0 == self.me.0)
                .flat_map(|v| v.certs.iter().map(|c| c.seq))
                .filter(|s| !kept.contains(s))
                .collect();
        }
        let mut vcs: Vec<ViewChange> = pool.into_values().collect();
        vcs.shuffle(rng);
        if rng.gen_bool(0.5) {
            // The others naming the fewest of the prepared values it hid, then the fewest
            // prepared values at all: it omits a prepared value wherever a quorum of view
            // changes without it exists.
            vcs.sort_by_key(|v| (v.certs.iter().filter(|c| hidden.contains(&c.seq)).count(), v.certs.len()));
        }
        // Now and then one view change short of a quorum: a NEW-VIEW that only the count
        // of its senders stops (all it carries is valid and signed).
        let short = self.quorum > 1 && rng.gen_bool(0.15);
        let take = self.quorum - short as usize;
        let mut vcs: Vec<ViewChange> = own.into_iter().chain(vcs).collect();
        vcs.truncate(take);
        if vcs.len() < take {
            return nv;
        }
        vcs.sort_by_key(|v| v.from);
        let mut honest = nv.view_changes.clone();
        honest.sort_by_key(|v| v.from);
        if vcs == honest {
            return nv;
        }
        let mut picked = NewView { view: nv.view, view_changes: vcs, sig: Sig([0; 64]) };
        picked.sig = self.signing.sign(&picked.statement(&tag));
        picked
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
                self.remember(rng, msg.clone());
            }
            let msg = match msg {
                Message::Reply(mut reply) if self.behaviours.wrong_replies && reply.epoch >= self.lies_from_epoch => {
                    self.lies.wrong_replies += 1;
                    reply.body = wrong_result(rng, reply.body);
                    Message::Reply(reply)
                }
                Message::Push { client, seq, epoch, mut event }
                    if self.behaviours.wrong_replies && epoch >= self.lies_from_epoch =>
                {
                    self.lies.wrong_replies += 1;
                    event.push(0xee);
                    Message::Push { client, seq, epoch, event }
                }
                Message::Bodies { seq, ops } if self.behaviours.withhold_bodies => {
                    self.lies.withheld_bodies += 1;
                    if rng.gen_bool(0.5) {
                        continue;
                    }
                    let ops = ops.iter().map(|op| [&op[..], &[0xee]].concat().into()).collect();
                    Message::Bodies { seq, ops }
                }
                msg if self.behaviours.censor_client => match self.censor(msg) {
                    Some(msg) => msg,
                    None => continue,
                },
                msg => msg,
            };
            let msg = self.lie_in_votes(to, is_primary, msg);
            let msg = self.rewrite(rng, to, msg);
            frames.push((to, keel_core::codec::encode(&msg)));
        }
        if self.behaviours.replay && !self.history.is_empty() && rng.gen_bool(0.2) {
            if let Some(msg) = self.earlier.pick(rng) {
                // What it held when its epoch changed, once the new epoch got going
                // (`EarlierEpochs`), to every node: a NEW-VIEW that moves only some of them
                // leaves the rest ordering in the view they are in.
                self.lies.replays += 1;
                self.lies.old_epoch_replays += 1;
                let frame = keel_core::codec::encode(&msg);
                frames.extend(NodeRange::first(self.n).map(|n| (Peer::Node(n), frame.clone())));
            } else if let Some(msg) = self.replay_pick(rng) {
                let to = Peer::Node(NodeId(rng.gen_range(0..self.n as u32)));
                self.lies.replays += 1;
                frames.push((to, keel_core::codec::encode(&msg)));
            }
        }
        if self.behaviours.junk && rng.gen_bool(0.1) {
            let len = rng.gen_range(0..300);
            let mut bytes: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
            if rng.gen_bool(0.5) && !bytes.is_empty() {
                bytes[0] = keel_core::codec::WIRE_VERSION;
            }
            self.lies.junk_frames += 1;
            frames.push((Peer::Node(NodeId(rng.gen_range(0..self.n as u32))), bytes));
        }
        if self.behaviours.forge_endorsements && rng.gen_bool(0.05) {
            // Vouch, to everyone, for a request no client sent.
            let request = self.fabricate();
            let macs = self.endorse(&request);
            self.lies.forged_endorsements += 1;
            let frame = keel_core::codec::encode(&Message::Endorse { request, macs });
            for n in NodeRange::first(self.n).filter(|n| *n != self.me) {
                frames.push((Peer::Node(n), frame.clone()));
            }
        }
        if self.behaviours.forge_epoch_certs && rng.gen_bool(0.03) {
            if let Some(cert) = self.forge_epoch_cert(rng) {
                self.lies.forged_epoch_certs += 1;
                let frame = keel_core::codec::encode(&Message::EpochCerts(vec![cert]));
                frames.push((Peer::Node(NodeId(rng.gen_range(0..self.n as u32))), frame.clone()));
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
            let view = View(rng.gen_range(1..1_000_000));
            self.lies.forged_view_changes += 1;
            for n in NodeRange::first(self.n) {
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
        Request::new(ClientId(FABRICATED_CLIENT), self.fabricated_seq, b"made up".to_vec().into())
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
            Message::Propose { view, seq, value } if self.behaviours.equivocate && self.lied_to(view, seq, to) => {
                if self.alternatives.len() >= INSTANCES_KEPT_MAX && !self.alternatives.contains_key(&(view, seq.0)) {
                    self.alternatives.pop_first();
                }
                let alt = self.alternatives.entry((view, seq.0)).or_insert_with(|| alternative(&value));
                self.lies.equivocations += 1;
                Message::Propose { view, seq, value: alt.clone() }
            }
            Message::Propose { view, seq, value } if self.behaviours.forge_endorsements && seq.is_multiple_of(3) => {
                if self.fabricated.len() >= FORGED_KEPT_MAX {
                    self.fabricated.clear();
                }
                let value = match self.fabricated.get(&(view, seq.0)) {
                    Some(v) => v.clone(),
                    None => {
                        // A made-up request that only this node vouches for.
                        let mut request = self.fabricate();
                        let node = self.colluder.as_ref().map_or(self.me, |(id, _)| *id);
                        request.endorsements = vec![Endorsement { node, macs: self.endorse(&request) }];
                        let mut v = value;
                        v.requests.push(Proposed::Full(request));
                        self.fabricated.insert((view, seq.0), v.clone());
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
            // Index answers too low would make reads stale if a node trusted fewer than a
            // quorum's highest; too high, they stall reads until their clients order them.
            Message::IndexAck { round, accepted } if self.behaviours.rush_reads => {
                self.lies.index_lies += 1;
                let accepted = if rng.gen_bool(0.8) { Seq(0) } else { accepted + 1_000 };
                Message::IndexAck { round, accepted }
            }
            Message::ViewChange(vc) if self.behaviours.forge_view_change || self.behaviours.hide_certs => {
                let vc = if self.behaviours.hide_certs { self.hide_certs(rng, vc) } else { vc };
                if !self.behaviours.forge_view_change {
                    return Message::ViewChange(vc);
                }
                self.lies.forged_view_changes += 1;
                Message::ViewChange(self.forge_view_change(rng, vc))
            }
            Message::NewView(nv) if self.behaviours.pick_new_view && self.primary(nv.view) == self.me => {
                // One NEW-VIEW of its choosing for the view, the same to every node (so
                // that a quorum may install it), except that one side of a split gets
                // another, picked anew each time, half the time.
                let (view, honest) = (nv.view, nv.clone());
                let picked = if self.lied_to(view, Seq::MAX, to) && rng.gen_bool(0.5) {
                    self.pick_new_view(rng, nv)
                } else if let Some(p) = self.picked.get(&view) {
                    p.clone()
                } else {
                    let p = self.pick_new_view(rng, nv);
                    if self.picked.len() >= VIEWS_KEPT_MAX {
                        self.picked.pop_first();
                    }
                    self.picked.insert(view, p.clone());
                    p
                };
                if picked != honest {
                    self.lies.picked_new_views += 1;
                    self.lies.short_new_views += (picked.view_changes.len() < self.quorum) as u64;
                }
                Message::NewView(picked)
            }
            Message::Checkpoint(vote) if self.behaviours.wrong_checkpoints && rng.gen_bool(0.7) => {
                // A state it does not have, signed as its own: mostly another root,
                // sometimes another membership.
                let (mut root, mut membership) = (vote.root, vote.membership);
                let flipped = if rng.gen_bool(0.8) { &mut root } else { &mut membership };
                flipped.0[rng.gen_range(0..32)] ^= 1 << rng.gen_range(0..8);
                self.lies.wrong_checkpoint_votes += 1;
                let sig = self.signing.sign(&checkpoint_statement(vote.seq, &root, &membership, self.me));
                Message::Checkpoint(CheckpointVote { seq: vote.seq, root, membership, sig })
            }
            Message::Manifest { seq, mut len, mut chunks } if self.behaviours.wrong_checkpoints => {
                self.lies.false_transfers += 1;
                match chunks.len() {
                    0 => len += 1,
                    k => {
                        // One chunk replaced by one of its making, named by its digest,
                        // which it serves when asked.
                        let index = rng.gen_range(0..k);
                        let data = [&chunks[index].0[..], b"made up"].concat();
                        chunks[index] = leaf_digest(&data);
                        self.keep_false_chunk(seq, index as u32, data);
                    }
                }
                Message::Manifest { seq, len, chunks }
            }
            Message::Chunk { seq, index, mut data } if self.behaviours.wrong_checkpoints => {
                self.lies.false_transfers += 1;
                match data.len() {
                    0 => data.push(rng.gen()),
                    k => data[rng.gen_range(0..k)] ^= 1 << rng.gen_range(0..8),
                }
                Message::Chunk { seq, index, data }
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
        for seq in base.next().through(base + 3) {
            let forged = Request::new(ClientId(424_242), rng.gen(), vec![0xde, 0xad].into());
            let value = Value { time: 0, requests: vec![forged] };
            let writes = MemberIndex::all(self.quorum).map(|n| (n, self.random_sig(rng))).collect();
            let digest = value.digest();
            vc.certs.push(CertProof { view: vc.view.saturating_sub(1), seq, digest, writes });
            if self.forged.len() == FORGED_KEPT_MAX {
                self.forged.pop_front();
            }
            self.forged.push_back((seq, digest, value));
        }
        if rng.gen_bool(0.3) {
            // Also claim a stable checkpoint far ahead.
            let sigs = NodeRange::first(self.quorum).map(|n| (n, self.random_sig(rng))).collect();
            vc.stable = StableProof { seq: base + 1_000 * 8, root: Digest([7; 32]), membership: Digest([7; 32]), sigs };
            vc.certs.clear();
        }
        vc.sig = self.signing.sign(&vc.statement(&self.epoch_tag()));
        vc
    }
}

/// The value an equivocating primary tells the other side: the same requests (their
/// MACs stay valid) in another order, one ms later: a different digest that backups
/// accept on its own.
fn alternative(value: &Proposal) -> Proposal {
    let mut requests = value.requests.clone();
    requests.reverse();
    Proposal { time: value.time + 1, requests }
}

/// Another result than `body`'s, in the same form: one bit of a full result flipped (not
/// trailing bytes, which a decoder might ignore), or another hash.
fn wrong_result(rng: &mut ChaCha8Rng, body: ReplyBody) -> ReplyBody {
    match body {
        ReplyBody::Full(mut bytes) => {
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
        Message::Push { client, seq, epoch, mut event } => {
            event.push(0xee);
            Message::Push { client, seq, epoch, event }
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
                ReplyBody::TooLarge(len) => ReplyBody::TooLarge(len ^ 1),
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
/// wrong checkpoint (u + 1 matching hashes), crash, hold more than their bounds, nor
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

    fn signed_vote(&self, seq: Seq, root: Digest, membership: Digest) -> Message {
        let sig = self.signing.sign(&checkpoint_statement(seq, &root, &membership, self.me));
        Message::Checkpoint(CheckpointVote { seq, root, membership, sig })
    }

    pub fn transform(&mut self, rng: &mut ChaCha8Rng, outgoing: Vec<(Peer, Message)>) -> Vec<Frame> {
        let mut frames = Vec::new();
        for (to, msg) in outgoing {
            let msg = match msg {
                Message::Reply(mut reply) if self.wrong_replies => {
                    self.lies += 1;
                    reply.body = wrong_result(rng, reply.body);
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
                    Message::Status { view, executed: Seq(made_up(rng)), stable: Seq(made_up(rng)) }
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
    rq: NodeRange,
    clients: Vec<ClientId>,
    /// Lies told.
    pub lies: u64,
}

impl RqByzantine {
    pub fn random(
        rng: &mut ChaCha8Rng,
        me: NodeId,
        row: Vec<MacKey>,
        (order, rq): (NodeRange, NodeRange),
        clients: Vec<ClientId>,
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

    fn liar(me: NodeId, n: usize, behaviours: Behaviours) -> Byzantine {
        let keys: Vec<SigningKey> = (0..n as u8).map(|i| SigningKey::from_seed([i + 1; 32])).collect();
        let publics: Vec<_> = keys.iter().map(SigningKey::public).collect();
        let membership = Membership::genesis(1, 1, &publics, &[]);
        let mut b = Byzantine::new(behaviours, me, n, 3, keys[me.0 as usize].clone()).seeded(
            7,
            &[ClientId(1000), ClientId(1001)],
            16,
        );
        b.set_membership(me, 3, membership);
        b
    }

    #[test]
    fn splits_vary_per_instance_and_leave_another_node_on_each_side() {
        let b = liar(NodeId(2), 5, Behaviours::only("equivocate").expect("a known name"));
        let mut splits = BTreeSet::new();
        for view in 0..4 {
            for seq in 1..50 {
                let side: Vec<bool> = (0..5).map(|n| b.lied_to(View(view), Seq(seq), Peer::Node(NodeId(n)))).collect();
                assert!(!side[2], "never itself");
                let told = side.iter().filter(|s| **s).count();
                assert!((1..=3).contains(&told), "{side:?}: another node on each side");
                splits.insert(side);
            }
        }
        // Not one fixed split (odd/even before): most of the 14 possible ones occur.
        assert!(splits.len() >= 10, "{} splits", splits.len());
        assert!(!b.lied_to(View(0), Seq(1), Peer::Client(ClientId(1000))));
    }

    #[test]
    fn replays_reach_back_to_every_sampled_epoch_within_bounds() {
        let mut b = liar(NodeId(0), 4, Behaviours::only("replay").expect("a known name"));
        let mut rng = <ChaCha8Rng as rand::SeedableRng>::seed_from_u64(3);
        let base = b.membership.clone().expect("set");
        for epoch in 0..30u64 {
            b.set_membership(NodeId(0), 3, Membership { epoch, ..base.clone() });
            for i in 0..500 {
                b.remember(&mut rng, Message::Stop { view: View(epoch * 1_000 + i) });
            }
        }
        assert!(b.epoch_samples.len() <= EPOCHS_SAMPLED_MAX);
        assert!(b.epoch_samples.values().all(|(_, s)| s.len() <= EPOCH_SAMPLE_MAX));
        // The first epoch and the latest stay; a reservoir holds messages from all over
        // its epoch, not only its last ones.
        assert!(b.epoch_samples.contains_key(&0) && b.epoch_samples.contains_key(&29));
        let first = &b.epoch_samples[&0].1;
        assert!(first.iter().any(|m| matches!(m, Message::Stop { view } if *view < View(250))));
        let mut old = 0;
        for _ in 0..200 {
            if let Some(Message::Stop { view }) = b.replay_pick(&mut rng) {
                old += (view.0 / 1_000 < 29) as u64;
            }
        }
        assert!(old > 50 && b.lies.old_epoch_replays == old, "{old} replays from earlier epochs");
    }

    #[test]
    fn conflicting_votes_and_wrong_checkpoints_are_validly_signed() {
        let b = Behaviours { conflicting_votes: true, wrong_checkpoints: true, ..Behaviours::default() };
        let mut b = liar(NodeId(1), 4, b);
        let mut rng = <ChaCha8Rng as rand::SeedableRng>::seed_from_u64(5);
        let m = b.membership.clone().expect("set");
        let keys = NodeKeys::new(&m.keys());
        let tag = m.digest();
        let honest = Digest([9; 32]);
        let sig = b.signing.sign(&write_statement(&tag, View(0), Seq(4), &honest, MemberIndex(1)));
        let mut digests = BTreeSet::new();
        for to in [0, 2, 3] {
            let w = Message::Write(Write { view: View(0), seq: Seq(4), digest: honest, sig });
            let Message::Write(w) = b.lie_in_votes(Peer::Node(NodeId(to)), false, w) else { panic!("a write") };
            assert!(keys.verify(1, &write_statement(&tag, View(0), Seq(4), &w.digest, MemberIndex(1)), &w.sig));
            digests.insert(w.digest);
        }
        assert_eq!(digests.len(), 2, "two values for one (view, instance)");
        let told = [0, 2, 3].iter().filter(|&&n| b.lied_to(View(0), Seq(4), Peer::Node(NodeId(n)))).count();
        assert_eq!(b.lies.conflicting_votes, told as u64, "counted once per vote changed");
        let sig = b.signing.sign(&checkpoint_statement(Seq(8), &honest, &tag, NodeId(1)));
        let vote = CheckpointVote { seq: Seq(8), root: honest, membership: tag, sig };
        for _ in 0..20 {
            if let Message::Checkpoint(v) =
                b.rewrite(&mut rng, Peer::Node(NodeId(0)), Message::Checkpoint(vote.clone()))
            {
                assert!(keys.verify(1, &checkpoint_statement(v.seq, &v.root, &v.membership, NodeId(1)), &v.sig));
            }
        }
        assert!(b.lies.wrong_checkpoint_votes > 0);
    }
}
