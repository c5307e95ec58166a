//! One order + execution node as a sans-IO state machine.
//!
//! ```text
//!            Request ──► pending ──► (primary) PROPOSE(v, i, value)
//!   normal:  PROPOSE ──► WRITE(v, i, d) signed ──► Q writes: prepared ──► ACCEPT ──► Q: decided
//!            (r = 0: PROPOSE ──► ACCEPT ──► Q: decided; BFT-SMaRt CFT mode)
//!   decided values execute in order; every CP_INTERVAL a signed checkpoint vote; Q: stable
//!   request timer: 1st expiry FORWARD to primary, 2nd STOP(v+1); r+1 STOPs: join; Q: VIEW-CHANGE
//!   new primary: Q valid VIEW-CHANGEs ──► NEW-VIEW (self-certifying) ──► re-proposals
//!   laggards: STATUS gossip ──► NEW-VIEW relay, decided values (r+1 matching), state transfer
//! ```
//!
//! Safety rests on three rules, each asserted or checked where it is applied:
//! 1. A node votes (WRITE, or ACCEPT in CFT mode) for at most one value per (view, seq),
//!    and persists that vote before sending it.
//! 2. A node that sent VIEW-CHANGE(t) never acts in a view below t.
//! 3. NEW-VIEW(t) re-proposes, for every instance above the highest proven stable
//!    checkpoint, the value of the highest-view valid prepared certificate among Q view
//!    changes (or null): any value decided in an earlier view is among them, because Q
//!    nodes prepared it and two quorums share a correct node (Reference: PBFT §4.4).
//!
//! Inputs are authenticated at the channel level: `from` is who the transport proved the
//! sender to be. Anything a peer sends is validated into a [`Reject`] and dropped, never
//! asserted on.

mod ahead;
mod bodies;
mod catch_up;
mod checkpoint;
mod endorse;
pub(crate) use bodies::budgeted_bodies;
pub(crate) use endorse::{hearsay_chargeable, hearsay_share, take_valid, Hearsay};
mod epoch;
mod leadership;
mod normal;
mod push;
mod read;
mod recovery;
mod rejoin;
mod separated;
mod verify;
mod view_change;

use crate::config::ClusterConfig;
use crate::crypto::{Digest, MacKey, NodeKeys};
use crate::exec::{Chunked, Executor};
use crate::ids::{MemberIndex, NodeRange};
use crate::message::{
    Cert, ClientId, Message, NewView, NodeId, Proposal, Request, Seq, StableProof, Value, View, ViewChange,
};
use crate::service::Service;
use crate::timeout::Timeout;
use crate::wal::Record;
use std::collections::BTreeMap;

pub use catch_up::Transfer;
pub(crate) use normal::check_batch_bytes;
pub use normal::REPLY_INLINE_MAX;
pub(crate) use push::PushQueues;
pub use push::{PUSH_BYTES_MAX, PUSH_EVENTS_MAX, PUSH_EVENTS_PER_CLIENT_MAX};
pub use recovery::Durable;
pub use separated::exec_proof_valid;
pub use verify::Verifier;

pub use crate::ids::ENDORSER_OWNER_BASE;
pub use crate::keys::{client_mac_key, endorse_key, session_mac_key, NodeSecrets};
pub use crate::membership::endorse_keys;
pub(crate) use crate::step::check_session;
pub use crate::step::{CheckpointJob, CheckpointReady, Event, ExecutedRequest, Input, Outputs, Peer, Persist, Reject};

/// One consensus instance above the stable checkpoint.
#[derive(Clone, Debug, Default)]
struct Slot {
    /// The view the vote fields below belong to.
    view: View,
    /// The proposal this node accepted in `view`, with its digest.
    value: Option<(Value, Digest)>,
    /// WRITE votes received in `view`: the first per node counts.
    writes: BTreeMap<MemberIndex, (Digest, crate::crypto::Sig)>,
    /// ACCEPT votes received in `view`.
    accepts: BTreeMap<MemberIndex, Digest>,
    /// This node sent ACCEPT in `view`.
    accept_sent: bool,
    /// The highest-view prepared certificate: survives view changes.
    cert: Option<Cert>,
    /// The decided digest, once known (Q accepts, NEW-VIEW cannot change it).
    decided: Option<Digest>,
    /// The decided value, once its body is here.
    decided_value: Option<Value>,
    /// Decided claims from lagging-peer help: node → digest, and the bodies by digest.
    claims: BTreeMap<MemberIndex, Digest>,
    claimed_values: BTreeMap<Digest, Value>,
    /// When this node last voted in this slot, for retransmission.
    voted_at: u64,
    /// Non-null proposals this node accepted in earlier views, by distinct digest (newest
    /// view last, at most [`EARLIER_KEPT`]): a NEW-VIEW names re-proposals by digest, and
    /// a node that wrote for a value without preparing it has no certificate to find the
    /// body in. Keeping them lets it vote at once and answer peers' `FetchValue`.
    earlier: Vec<(View, Value, Digest)>,
}

/// Distinct earlier-view bodies a slot keeps. A correct node that wrote for a value drops
/// its body only after accepting two other non-null values for the same instance in later
/// views, i.e. after two more view changes that re-proposed different batches there and
/// failed to prepare them. If every holder of a chosen body dropped it (and, in BFT mode,
/// the only node naming it is faulty), the instance cannot decide in that view: request
/// timers move to another view, whose NEW-VIEW may choose differently. A known liveness
/// gap (docs/DESIGN-NOTES.md), not a safety one: nobody votes without the body.
const EARLIER_KEPT: usize = 2;

impl Slot {
    /// A WRITE in `view` for `digest` cannot change anything here: this node already
    /// prepared in that view, or accepted another value in it (only the accepted value's
    /// WRITEs count toward the certificate).
    fn write_unneeded(&self, view: View, digest: &Digest) -> bool {
        self.view == view && (self.accept_sent || self.value.as_ref().is_some_and(|(_, d)| d != digest))
    }

    fn enter_view(&mut self, view: View) {
        if self.view != view {
            if let Some((value, digest)) = self.value.take() {
                self.keep_earlier(self.view, value, digest);
            }
            self.view = view;
            self.writes.clear();
            self.accepts.clear();
            self.accept_sent = false;
        }
    }

    fn keep_earlier(&mut self, view: View, value: Value, digest: Digest) {
        // The null value needs no body (NEW-VIEW fills gaps with it): it must not push out
        // a real one.
        if value.requests.is_empty() {
            return;
        }
        self.earlier.retain(|(_, _, d)| *d != digest);
        self.earlier.push((view, value, digest));
        self.earlier.sort_by_key(|(v, _, _)| *v);
        if self.earlier.len() > EARLIER_KEPT {
            self.earlier.remove(0);
        }
    }

    /// Every value this node holds for the instance.
    fn values(&self) -> impl Iterator<Item = &Value> {
        let value = self.value.as_ref().map(|(v, _)| v);
        let cert = self.cert.as_ref().map(|c| &c.value);
        let earlier = self.earlier.iter().map(|(_, v, _)| v);
        value
            .into_iter()
            .chain(self.decided_value.as_ref())
            .chain(cert)
            .chain(earlier)
            .chain(self.claimed_values.values())
    }

    /// Any value with `digest` this node holds for the instance.
    fn body(&self, digest: &Digest) -> Option<&Value> {
        if let Some((v, _)) = self.value.as_ref().filter(|(_, d)| d == digest) {
            return Some(v);
        }
        if self.decided == Some(*digest) {
            if let Some(v) = &self.decided_value {
                return Some(v);
            }
        }
        if let Some(c) = self.cert.as_ref().filter(|c| c.digest() == *digest) {
            return Some(&c.value);
        }
        if let Some((_, v, _)) = self.earlier.iter().find(|(_, _, d)| d == digest) {
            return Some(v);
        }
        self.claimed_values.get(digest)
    }
}

/// A client request this node has admitted and not yet executed.
#[derive(Clone, Debug)]
struct Pending {
    req: Request,
    /// Admission order, for FIFO batching.
    order: u64,
    /// When its request timer (re)started.
    since: u64,
    forwarded: bool,
    /// Proposed in the current view (primary: do not propose again).
    in_flight: bool,
    /// `auth = rq-mac`: endorsements valid for this node, its own included (endorse.rs).
    endorsers: BTreeMap<NodeId, Vec<crate::crypto::Mac>>,
    /// When this node last sent its endorsement to every node (0: never).
    broadcast_at: u64,
    /// The client sent it to this node itself (not only others' endorsements or a
    /// forward): this node replies once it executes it. Clients send first to `u + r + 1`
    /// nodes, and to all on a retransmission, so the others send no reply nobody waits
    /// for, and any node the client is still waiting on has it set.
    direct: bool,
}

pub struct Replica<S> {
    /// The digest of `cfg.membership`, which every signed statement of this epoch names
    /// (`message::write_statement`): computed once, it is hashed into every vote.
    epoch_tag: Digest,
    cfg: ClusterConfig,
    /// `cfg.node_keys`, parsed once.
    keys: NodeKeys,
    /// This node's index in the epoch's membership: what it votes and signs as.
    id: MemberIndex,
    secrets: NodeSecrets,
    /// The injected clock at the current step.
    now: u64,

    /// The installed view: this node takes part in it unless `vc_target` is set.
    view: View,
    /// Instances up to here were settled by the NEW-VIEW of `view`: no fresh proposals.
    floor: Seq,
    /// The NEW-VIEW that installed `view`, kept to relay to laggards (None at view 0,
    /// which needs no proof). Persisted with the view (`Record::NewView`, just before
    /// `Record::View`) and restored by `recover`: a node relays it after a restart too.
    /// Changed only where `view` is: `install_new_view` and `recover`.
    new_view: Option<NewView>,
    /// Set once this node sent VIEW-CHANGE(t): it will never act in a view below t.
    vc_target: Option<View>,
    /// While a view change is on: when to give up on its primary and ask for the next.
    view_change_timeout: Timeout,
    vc_attempts: u32,
    /// Highest view this node sent STOP for.
    stop_sent: View,
    /// Highest STOP view heard from each node.
    stops: Vec<View>,
    /// Valid VIEW-CHANGEs for views above `view`, one (the highest) per node.
    view_changes: BTreeMap<MemberIndex, ViewChange>,
    /// The VIEW-CHANGE this node sent for `vc_target`, resent as is.
    own_view_change: Option<ViewChange>,
    /// Re-proposals of the installed view whose bodies this node is fetching.
    awaiting: BTreeMap<Seq, view_change::Awaited>,
    /// Per peer: instance → when its body was last sent to that peer (one answer per
    /// instance per retransmission period; instances in the window only).
    value_answers: Vec<BTreeMap<Seq, u64>>,

    log: BTreeMap<Seq, Slot>,
    /// Primary: the next instance to propose.
    next_propose: Seq,
    /// Primary: time of the last proposal (proposals never go back in time).
    time_proposed: u64,
    /// A view whose primary this node is but in which it must not propose: it recovered
    /// in that view and may have sent proposals it no longer remembers (PROPOSE goes out
    /// before its record is durable). It asks to leave the view instead.
    proposals_closed: Option<View>,
    /// Whether this node knows its own record of `view` is durable. False from installing
    /// a view as its primary until a peer votes in it: a peer can vote in view `t` only
    /// after our NEW-VIEW(t), which left gated behind the `View { t }` record. Until
    /// then PROPOSEs are gated too (issue #21, defect 2): a primary that crashed before
    /// that record was durable recovers below `t`, may lead `t` again, and must not have
    /// proposals of its first try at `t` out, or a backup keeping one as an early
    /// proposal votes for it under the second NEW-VIEW(t). True at view 0 and after a
    /// restart (the view recovered into came from its record).
    view_record_durable: bool,
    /// Set while this node rejoins after losing its disk: it casts no vote (rejoin.rs).
    rejoin: Option<rejoin::Rejoin>,
    /// BFT: the (view, instance) up to which this node's WRITEs are covered by a
    /// `VoteHorizon` record (normal.rs, `cover_vote`), so their Accepted records need not
    /// be durable before they leave.
    vote_horizon: Option<(View, Seq)>,
    /// After a restart, the horizon found on disk: in that view, up to that instance, the
    /// node may have sent WRITEs for proposals it no longer remembers, so it casts no
    /// vote there.
    abstain: Option<(View, Seq)>,
    /// When this node first abstained on an instance that is not executed yet, and the
    /// highest instance it abstained on: if they stay undecided, it asks for a view change
    /// (`on_abstention_timeout`).
    abstained: Option<(u64, Seq)>,
    /// Set while the driver steps a burst of queued inputs (`hold_proposals`): the
    /// primary proposes once at its end, so the burst's requests share one batch.
    proposals_held: bool,
    /// PROPOSEs for the view about to be installed that overtook its NEW-VIEW.
    early_proposals: BTreeMap<Seq, (View, Proposal)>,
    /// PROPOSEs of operations by digest this node gathers the bytes of (bodies.rs).
    parked: BTreeMap<Seq, bodies::Parked>,
    /// Per peer: instance → when operations were last sent to that peer for it; and the
    /// bytes sent to it since a time, for its budget (bodies.rs).
    body_answers: Vec<BTreeMap<Seq, u64>>,
    body_budget: Vec<(u64, usize)>,

    exec: Executor<S>,
    stable: StableProof,
    /// The snapshot at `stable.seq`, served to peers that transfer state.
    stable_chunks: Option<Chunked>,
    /// This node's checkpoints above `stable.seq`, awaiting a quorum.
    own_checkpoints: BTreeMap<Seq, Chunked>,
    /// Checkpoints being serialized by the driver: seq → the membership digest at it.
    pending_checkpoints: BTreeMap<Seq, Digest>,
    /// Proposals and votes just above the high-water mark (ahead.rs).
    ahead: ahead::Ahead,
    /// Bumped whenever the state is replaced (state transfer): a checkpoint frozen from
    /// the old state is stale when it comes back.
    state_generation: u64,
    /// Checkpoint votes above `stable.seq`: seq → node → (root, membership, sig).
    checkpoint_votes: BTreeMap<Seq, BTreeMap<MemberIndex, (Digest, Digest, crate::crypto::Sig)>>,

    pending: BTreeMap<ClientId, Pending>,
    pending_order: u64,
    /// `auth = rq-mac`: endorsements of requests this node could not authenticate itself,
    /// until `r + 1` make it endorse them too (endorse.rs).
    hearsay: endorse::Hearsay,
    /// `auth = rq-mac`: per node, the key this node shares with it for endorsements (both
    /// directions; [`endorse_keys`]).
    endorse_row: Vec<MacKey>,
    /// With RQ nodes of their own: per RQ node (in order), the key its endorsements for
    /// this node are MACed with.
    rq_row: Vec<MacKey>,
    /// The previous epoch's keys and quorum, which proved this epoch's base checkpoint.
    prev_keys: Option<(NodeKeys, usize)>,
    /// This node's stable id (its index is `id`; membership.rs).
    stable_id: NodeId,
    /// How the membership came to be `cfg.membership`: one certificate per epoch since
    /// epoch 0 (the newest [`crate::codec::EPOCH_CERTS_MAX`]), offered to laggards.
    epoch_certs: Vec<crate::message::EpochCert>,
    /// EpochEnded was reported (epoch.rs).
    epoch_reported: bool,
    /// This node asked for a durability barrier ([`Outputs::barrier`]) and was not
    /// stepped with [`Input::Drained`] since: it drops every other input.
    at_barrier: bool,
    /// A later epoch proven by certificates, to join without this node's state (epoch.rs).
    jump: Option<Vec<crate::message::EpochCert>>,
    /// Client requests the previous epoch left unexecuted, admitted again at this node's
    /// first step (epoch.rs).
    carried: Vec<Request>,
    /// RQ nodes apart: tell them of this epoch at the first step (epoch.rs), rather than
    /// have them wait for their next EPOCH-QUERY while clients' requests pend.
    announce_epoch: bool,
    /// Removed by a membership change: it only helps its epoch's members end it (epoch.rs).
    retired: bool,
    /// `auth = sig`: `cfg.client_keys`, parsed once.
    client_keys: crate::crypto::ClientKeys,
    /// `auth = sig`: client requests of this step (or burst) whose signatures are checked
    /// together at its end (normal.rs).
    unsigned: Vec<(Peer, Request)>,
    /// Read-only requests waiting for execution to get far enough (read.rs).
    /// Read-only operations waiting, and read-index probe rounds (read.rs).
    reads: crate::read_wait::ReadWaits,
    /// The primary's throughput, for robust leadership (leadership.rs).
    monitor: leadership::Monitor,
    /// Push events not yet acknowledged (push.rs).
    pushes: push::PushQueues,

    transfer: Option<Transfer>,
    /// Last time we helped each peer (STATUS answers are rate-limited).
    helped_at: Vec<u64>,
    /// What each peer's latest STATUS said it executed: it decided every instance up to
    /// there, so retransmitting votes for them to it is waste (normal.rs `retransmit`).
    /// The latest, not the highest: a restarted peer reports less and is served again.
    /// A peer that overstates only loses retransmissions meant for itself.
    peer_executed: Vec<Seq>,
    /// When each peer was last heard from (None: not yet). A peer silent for several
    /// STATUS periods is down or cut off: retransmitting every unacknowledged instance
    /// to it each period is work for nothing, and when it speaks again it is served
    /// again (and catches up through STATUS).
    heard_at: Vec<Option<u64>>,
    /// Separated execution: the execution checkpoints and commits (separated.rs).
    exec_stage: separated::ExecStage,
    /// STATUS to the peers (and to RQ nodes and execution nodes apart).
    status_timeout: Timeout,
    /// The retransmission round: votes, view changes, probes, fetches, pushes.
    retransmit_timeout: Timeout,
}

/// An order node's name where order nodes and the nodes of a stage apart sign side by
/// side, and where the order core keeps one table for both: endorsements
/// (`Endorsement::node`, whose MAC rows are by index when the order nodes endorse, by RQ
/// node when those do), checkpoint signatures (`StableProof::sigs`, by execution nodes
/// apart when execution is) and the nodes asked for operations (bodies.rs). It is the
/// member's index as a number, beside the stage nodes' `config::stage_node` names: the
/// values signed statements and wire formats carry, which must not change.
pub(crate) fn signer_name(i: MemberIndex) -> NodeId {
    NodeId(i.0)
}

impl<S: Service> crate::node::Node for Replica<S> {
    fn step(&mut self, now: u64, input: Input, out: &mut Outputs) {
        Replica::step(self, now, input, out)
    }

    fn config(&self) -> &ClusterConfig {
        Replica::config(self)
    }

    fn status(&self) -> crate::node::NodeStatus {
        let cfg = self.config();
        crate::node::NodeStatus {
            view: self.view(),
            view_change_to: self.in_view_change(),
            executed: self.executed(),
            stable: self.stable_seq(),
            transfer: self.transfer_progress(),
            // Stages apart: the execution and RQ nodes are peers too.
            peers: cfg.n() - 1 + cfg.exec_ids().len() + cfg.rq_ids().len(),
        }
    }

    /// A member's message is admitted only in the epoch both are in, by its stable id (the
    /// replica translates it to the member's index in `on_message`); stage nodes by their
    /// stage names whatever their epoch. Across epochs only certificates pass: taken from
    /// anyone (they prove themselves, epoch.rs), and a STATUS from an earlier epoch is
    /// answered with the certificates since.
    fn admit(&self, from: NodeId, epoch: u64, msg: Message, checked: bool) -> crate::node::Admit {
        use crate::node::Admit;
        let cfg = self.config();
        if crate::node::is_stage_id(cfg, from) {
            return Admit::Step(Input::Message { from: Peer::Node(crate::config::stage_node(from.0)), msg });
        }
        let mine = self.epoch();
        if epoch == mine {
            return match cfg.membership.index_of(from) {
                Some(_) if checked => Admit::Step(Input::Checked { from, msg }),
                Some(_) => Admit::Step(Input::Message { from: Peer::Node(from), msg }),
                None => Admit::Drop,
            };
        }
        match msg {
            // Stepped as if from the member at index 0, as when the core named peers by
            // index (its `heard_at` notes it): a certificate's sender need not be a member.
            Message::EpochCerts(_) => {
                let first = cfg.membership.id_of(MemberIndex(0)).unwrap_or_default();
                Admit::Step(Input::Message { from: Peer::Node(first), msg })
            }
            Message::Status { .. } if epoch < mine => {
                let certs = self.epoch_certs_after(epoch);
                if certs.is_empty() {
                    Admit::Drop
                } else {
                    Admit::Answer(Message::EpochCerts(certs))
                }
            }
            _ => Admit::Drop,
        }
    }
}

impl<S: Service> Replica<S> {
    /// A fresh node at view 0 with an empty state: the member with stable id
    /// `stable_id`.
    ///
    /// # Panics
    /// If `stable_id` is not a member of `cfg.membership`, or `secrets` do not hold its key.
    pub fn new(cfg: ClusterConfig, stable_id: NodeId, secrets: NodeSecrets, service: S) -> Replica<S> {
        let Some(id) = cfg.membership.index_of(stable_id) else {
            panic!("node {stable_id} is not a member of epoch {}", cfg.membership.epoch);
        };
        assert!(id.index() < cfg.n(), "node index {id} outside a cluster of {}", cfg.n());
        assert_eq!(cfg.node_keys[id.index()], secrets.signing.public(), "signing key does not match the configuration");
        let n = cfg.n();
        assert_eq!(cfg.membership.members.len(), n, "the membership names every node");
        let workers = cfg.options.exec_workers;
        let endorse_row = endorse_keys(&secrets.signing, &cfg.membership);
        let hearsay = endorse::Hearsay::new(endorse::hearsay_chargeable(&cfg, NodeRange::first(cfg.n())));
        let rq_row = cfg.stages.rq.iter().map(|k| endorse_key(&secrets.signing, k)).collect();
        let prev_keys = cfg.membership.previous.as_ref().and_then(|p| {
            let q = p.quorums().ok()?.with_mutation(cfg.quorums.mutation()).order_quorum();
            Some((NodeKeys::new(&p.keys()), q))
        });
        let mut key_map = cfg.client_keys.clone();
        if let Some(admin) = cfg.admin_key {
            key_map.insert(crate::membership::ADMIN_CLIENT, admin);
        }
        let client_keys = crate::crypto::ClientKeys::new(&key_map);
        let mut exec = Executor::with_workers(service, workers);
        exec.set_membership(cfg.membership.clone(), cfg.admin_key);
        exec.set_stages(cfg.stages.executors.len(), cfg.stages.rq.len());
        exec.set_tick_ms(cfg.options.tick_ms);
        exec.set_mutation(cfg.quorums.mutation());
        let exec_stage = separated::ExecStage::new(&cfg);
        let o = &cfg.options;
        let (view_change_timeout, status_timeout, retransmit_timeout) =
            (Timeout::every(o.view_change_timeout_ms), Timeout::every(o.status_ms), Timeout::every(o.retransmit_ms));
        Replica {
            keys: NodeKeys::new(&cfg.node_keys),
            epoch_tag: match cfg.quorums.mutation() {
                // The old statements named no epoch: one tag for all of them.
                Some(crate::quorum::Mutation::EpochlessStatements) => Digest::default(),
                _ => cfg.membership.digest(),
            },
            cfg,
            id,
            secrets,
            now: 0,
            view: View(0),
            floor: Seq(0),
            new_view: None,
            vc_target: None,
            view_change_timeout,
            vc_attempts: 0,
            stop_sent: View(0),
            stops: vec![View(0); n],
            view_changes: BTreeMap::new(),
            own_view_change: None,
            awaiting: BTreeMap::new(),
            value_answers: vec![BTreeMap::new(); n],
            log: BTreeMap::new(),
            next_propose: Seq(1),
            time_proposed: 0,
            proposals_closed: None,
            view_record_durable: true,
            rejoin: None,
            vote_horizon: None,
            abstain: None,
            abstained: None,
            proposals_held: false,
            early_proposals: BTreeMap::new(),
            parked: BTreeMap::new(),
            body_answers: vec![BTreeMap::new(); n],
            body_budget: vec![(0, 0); n],
            exec,
            stable: StableProof::genesis(),
            stable_chunks: None,
            own_checkpoints: BTreeMap::new(),
            pending_checkpoints: BTreeMap::new(),
            ahead: ahead::Ahead::default(),
            state_generation: 0,
            checkpoint_votes: BTreeMap::new(),
            pending: BTreeMap::new(),
            pending_order: 0,
            hearsay,
            endorse_row,
            rq_row,
            prev_keys,
            stable_id,
            epoch_certs: Vec::new(),
            epoch_reported: false,
            at_barrier: false,
            jump: None,
            carried: Vec::new(),
            announce_epoch: false,
            retired: false,
            client_keys,
            unsigned: Vec::new(),
            reads: crate::read_wait::ReadWaits::default(),
            monitor: leadership::Monitor::default(),
            pushes: push::PushQueues::default(),
            transfer: None,
            helped_at: vec![0; n],
            peer_executed: vec![Seq(0); n],
            heard_at: vec![None; n],
            exec_stage,
            status_timeout,
            retransmit_timeout,
        }
    }

    /// This node's index in its epoch's membership.
    pub fn index(&self) -> MemberIndex {
        self.id
    }
    /// This node's stable id.
    pub fn stable_id(&self) -> NodeId {
        self.stable_id
    }
    pub fn view(&self) -> View {
        self.view
    }
    pub fn is_primary(&self) -> bool {
        self.cfg.primary(self.view) == self.id && self.vc_target.is_none()
    }
    pub fn executed(&self) -> Seq {
        self.exec.executed()
    }
    pub fn stable_seq(&self) -> Seq {
        self.stable.seq
    }
    /// Separated execution: the newest execution checkpoint certified to this node.
    pub fn exec_stable_seq(&self) -> Seq {
        self.exec_stage.stable_seq()
    }
    pub fn service(&self) -> &S {
        self.exec.service()
    }
    /// The signature checks a driver may run before the protocol task (`Input::Checked`).
    pub fn verifier(&self) -> Verifier {
        let members = self.cfg.membership.members.iter().map(|m| NodeId(m.id)).collect();
        Verifier::new((self.id, members), self.keys.clone(), self.epoch_tag, self.cfg.auth, self.client_keys.clone())
    }

    pub fn config(&self) -> &ClusterConfig {
        &self.cfg
    }
    /// Times this node asked to replace a primary for being slow.
    pub fn slow_primary_suspicions(&self) -> u64 {
        self.monitor.suspicions
    }

    pub fn in_view_change(&self) -> Option<View> {
        self.vc_target
    }
    pub fn transferring(&self) -> bool {
        self.transfer.is_some()
    }
    /// (chunks held, chunks total) of a state transfer in progress.
    pub fn transfer_progress(&self) -> Option<(usize, usize)> {
        self.transfer.as_ref().map(Transfer::progress)
    }

    /// Advances the state machine by one input.
    pub fn step(&mut self, now: u64, input: Input, out: &mut Outputs) {
        self.now = self.now.max(now);
        if self.retired {
            self.step_retired(input, out);
            return;
        }
        if self.at_barrier {
            if let Input::Drained = input {
                self.at_barrier = false;
                if self.epoch_reported {
                    self.advance_epoch(out);
                }
            }
            return;
        }
        if self.epoch_reported {
            // Over: the driver crashed it at its barrier (or stepped it there: a bug).
            return;
        }
        if std::mem::take(&mut self.announce_epoch) {
            self.announce_epoch_to_rq_nodes(out);
        }
        if !self.carried.is_empty() {
            self.readmit_carried(out);
        }
        match input {
            Input::Tick => self.on_tick(out),
            Input::Message { from, msg } => self.on_message(from, msg, false, out),
            Input::Checked { from, msg } => self.on_message(Peer::Node(from), msg, true, out),
            Input::CheckpointReady(ready) => self.on_checkpoint_ready(ready, out),
            // Stepped at no barrier of this node's: nothing to do.
            Input::Drained => {}
        }
        if !self.proposals_held {
            self.check_signed_requests(out);
        }
        self.release_ahead(out);
        self.check_epoch_end(out);
        self.rejoin_filter(out);
        self.invariants();
    }

    /// Asks the driver for a durability barrier ([`Outputs::barrier`]) and drops
    /// every input until it is passed.
    fn hold_barrier(&mut self, out: &mut Outputs) {
        self.at_barrier = true;
        out.barrier = true;
    }

    /// The epoch this node runs.
    pub fn epoch(&self) -> u64 {
        self.cfg.membership.epoch
    }

    /// The driver is about to step several inputs that arrived together: hold proposals
    /// until [`Replica::release_proposals`]. Without it an idle primary proposes the
    /// burst's first request alone (an idle pipeline proposes at once, for latency), and
    /// where decisions are immediate (a single node) every request became an instance.
    pub fn hold_proposals(&mut self) {
        self.proposals_held = true;
    }

    /// Ends a burst: proposes what the held inputs brought.
    pub fn release_proposals(&mut self, now: u64, out: &mut Outputs) {
        self.now = self.now.max(now);
        self.proposals_held = false;
        self.check_signed_requests(out);
        self.maybe_propose(out);
        self.rejoin_filter(out);
        self.invariants();
    }

    /// Dispatches one message. Where it comes in, a member's stable id becomes its index
    /// in the epoch (`member`), the name every handler of the order protocol counts votes
    /// by; stage nodes keep their stage names, clients their ids.
    fn on_message(&mut self, from: Peer, msg: Message, checked: bool, out: &mut Outputs) {
        let member = self.index_of(from);
        if let Some(i) = member {
            self.heard_at[i.index()] = Some(self.now);
        }
        let Some((msg, checked)) = self.hold_ahead(from, msg, checked) else {
            return;
        };
        let kind = msg.kind();
        let result = match (from, member, msg) {
            // A read answer or a read index vouches for what this node accepted, which a
            // rejoining node has forgotten (rejoin.rs): the client asks others.
            (_, _, Message::Read(_) | Message::IndexProbe { .. }) if self.rejoin.is_some() => {
                Err(Reject::Busy("rejoining after a lost disk"))
            }
            (Peer::Client(c), _, Message::Request(req)) => self.on_request(Peer::Client(c), req, out),
            (Peer::Client(c), _, Message::Read(read)) => self.on_read(Peer::Client(c), read, out),
            (Peer::Client(c), _, Message::PushAck { client, upto }) => self.on_push_ack(Peer::Client(c), client, upto),
            // Self-certifying, and from a node of another epoch (whose id may name no
            // member here): taken from any node.
            (Peer::Node(_), _, Message::EpochCerts(certs)) => self.on_epoch_certs(certs, out),
            (Peer::Client(c), _, Message::EpochQuery { client, epoch }) => {
                self.check_session(Peer::Client(c), client).map(|()| {
                    let certs = self.epoch_certs_after(epoch);
                    if !certs.is_empty() {
                        out.send.push((Peer::Client(client), Message::EpochCerts(certs)));
                    }
                })
            }
            // The administrator's backup (backup.rs) fetches a checkpoint as a peer would.
            (Peer::Client(c), _, Message::FetchManifest { seq })
                if crate::message::owner_of(c) == crate::membership::ADMIN_CLIENT =>
            {
                self.on_fetch_manifest(from, seq, out)
            }
            (Peer::Client(c), _, Message::FetchChunk { seq, index })
                if crate::message::owner_of(c) == crate::membership::ADMIN_CLIENT =>
            {
                self.on_fetch_chunk(from, seq, index, out)
            }
            (Peer::Node(n), _, msg) if self.is_exec_peer(n) => self.on_exec_message(n, msg, out),
            (Peer::Node(n), _, msg) if self.is_rq_peer(n) => self.on_rq_message(n, msg, out),
            (Peer::Node(_), Some(i), Message::Forward(req)) if self.cfg.rq_separated() => self.on_relayed(i, req, out),
            (Peer::Node(n), None, msg) => Err(Reject::UnknownNode(n)).map(|_: ()| drop(msg)),
            (Peer::Node(n), Some(i), msg) if i == self.id => Err(Reject::UnknownNode(n)).map(|_: ()| drop(msg)),
            (_, Some(_), Message::Forward(req)) => self.on_request(from, req, out),
            (_, Some(i), Message::Propose { view, seq, value }) => self.on_propose(i, view, seq, value, checked, out),
            (_, Some(i), Message::Write(w)) => self.on_write(i, w, checked, out),
            (_, Some(i), Message::Accept { view, seq, digest }) => self.on_accept(i, view, seq, digest, out),
            (_, Some(i), Message::Checkpoint(vote)) => self.on_checkpoint(i, vote, checked, out),
            (_, Some(i), Message::Stop { view }) => self.on_stop(i, view, out),
            (_, Some(i), Message::ViewChange(vc)) => self.on_view_change(i, vc, out),
            (_, Some(_), Message::NewView(nv)) => self.on_new_view(nv, out),
            (_, Some(i), Message::Status { view, executed, stable }) => self.on_status(i, view, executed, stable, out),
            (_, Some(i), Message::StableCert(proof)) => self.on_stable_cert(i, proof, out),
            (_, Some(i), Message::Decided { seq, value }) => self.on_decided(i, seq, value, out),
            (_, Some(_), Message::FetchManifest { seq }) => self.on_fetch_manifest(from, seq, out),
            (_, Some(i), Message::Manifest { seq, len, chunks }) => self.on_manifest(i, seq, len, chunks, out),
            (_, Some(_), Message::FetchChunk { seq, index }) => self.on_fetch_chunk(from, seq, index, out),
            (_, Some(i), Message::Chunk { seq, index, data }) => self.on_chunk(i, seq, index, data, out),
            (_, Some(i), Message::FetchValue { seq, digest }) => self.on_fetch_value(i, seq, digest, out),
            (_, Some(_), Message::ValueBody { seq, value }) => self.on_value_body(seq, value, out),
            (_, Some(_), Message::IndexProbe { round }) => self.on_index_probe(from, round, out),
            (_, Some(i), Message::IndexAck { round, accepted }) => self.on_index_ack(i, round, accepted, out),
            (_, Some(i), Message::Endorse { request, macs }) => self.on_endorse(signer_name(i), request, macs, out),
            (_, Some(i), Message::EndorseDigest { client, seq, op, macs }) => {
                self.on_endorse_digest(signer_name(i), client, seq, op, macs, out)
            }
            (_, Some(i), Message::FetchBodies { seq, wanted }) => self.on_fetch_bodies(i, seq, wanted, out),
            (_, Some(i), Message::Bodies { seq, ops }) => self.on_bodies(signer_name(i), seq, ops, out),
            (_, Some(i), Message::Rejoin) => self.on_rejoin(i, out),
            (_, Some(i), Message::RejoinInfo { committed, executed }) => {
                self.on_rejoin_info(i, committed, executed, out)
            }
            (_, _, _) => Err(Reject::WrongPeer),
        };
        match result {
            Ok(()) | Err(Reject::Late { .. }) => {}
            Err(reason) => out.events.push(Event::Rejected { from, kind, reason }),
        }
    }

    fn on_tick(&mut self, out: &mut Outputs) {
        if self.cfg.options.transfer_rate_bytes > 0 {
            // A throttled transfer earns its allowance as time passes.
            self.request_chunks(out);
        }
        self.on_request_timeouts(out);
        self.on_abstention_timeout(out);
        self.watch_leadership(out);
        self.expire_reads();
        self.on_view_change_timeout(out);
        self.refetch_bodies(out);
        self.maybe_propose(out);
        if self.retransmit_timeout.fire(self.now) {
            self.retransmit(out);
            self.retransmit_checkpoint_votes(out);
            self.retransmit_view_change(out);
            self.retransmit_index_probe(out);
            self.fetch_awaited(out);
            self.on_transfer_timeout(out);
            self.expire_hearsay();
            self.resend_pushes(out);
            self.ask_rejoin(out);
        }
        if self.status_timeout.fire(self.now) {
            let status = Message::Status { view: self.view, executed: self.exec.executed(), stable: self.stable.seq };
            if self.cfg.rq_separated() {
                // RQ nodes learn the view from it: their first copy of a request goes to
                // the primary only (rq_node.rs).
                for rq in self.cfg.endorsers() {
                    out.send.push((Peer::Node(rq), status.clone()));
                }
            }
            self.broadcast(status, out);
        }
    }

    // ----- helpers shared by the submodules -----

    fn quorum(&self) -> usize {
        self.cfg.quorums.order_quorum()
    }

    fn byzantine_mode(&self) -> bool {
        self.cfg.quorums.byzantine() && self.cfg.quorums.mutation() != Some(crate::quorum::Mutation::SkipWrite)
    }

    /// The member at index `i` of this epoch, as outputs name it.
    ///
    /// # Panics
    /// If `i` is not an index of this epoch (callers take indices from the membership).
    fn member(&self, i: MemberIndex) -> Peer {
        Peer::Node(self.member_id(i))
    }

    /// The stable id of the member at index `i` of this epoch: what outputs name it by.
    ///
    /// # Panics
    /// If `i` is not an index of this epoch (callers take indices from the membership).
    fn member_id(&self, i: MemberIndex) -> NodeId {
        match self.cfg.membership.id_of(i) {
            Some(id) => id,
            None => panic!("member index {i} outside an epoch of {}", self.cfg.n()),
        }
    }

    /// The index in this epoch of the member `from` names (by its stable id); `None` for
    /// clients, stage nodes (their stage names are no member's id) and nodes that are not
    /// members of this epoch. The one translation of inbound node ids.
    fn index_of(&self, from: Peer) -> Option<MemberIndex> {
        match from {
            Peer::Node(n) => self.cfg.membership.index_of(n),
            Peer::Client(_) => None,
        }
    }

    /// This node's name where order nodes and stage nodes sign side by side
    /// ([`signer_name`]).
    fn signer_name(&self) -> NodeId {
        signer_name(self.id)
    }

    /// The peer a signer name ([`signer_name`]) stands for: a stage node by its stage
    /// name, an order node as [`Replica::member`] names it.
    fn peer_of(&self, name: NodeId) -> Peer {
        match crate::config::stage_id(name) {
            Some(_) => Peer::Node(name),
            None => self.member(MemberIndex(name.0)),
        }
    }

    /// The other members of this epoch, in index order.
    fn others(&self) -> impl Iterator<Item = MemberIndex> + '_ {
        MemberIndex::all(self.cfg.n()).filter(move |&i| i != self.id)
    }

    /// Sends to every other node, now.
    fn broadcast(&self, msg: Message, out: &mut Outputs) {
        fan_out(self.others().map(|i| self.member(i)), msg, &mut out.send);
    }

    /// Sends to every other node once everything persisted so far is durable.
    fn broadcast_durable(&self, msg: Message, out: &mut Outputs) {
        fan_out(self.others().map(|i| self.member(i)), msg, &mut out.send_after_persist);
    }

    fn persist(&self, record: Record, out: &mut Outputs) {
        out.persist.push(Persist::Record(record));
    }

    fn high_water(&self) -> Seq {
        self.stable.seq + self.cfg.options.log_max()
    }

    fn in_window(&self, seq: Seq) -> Result<(), Reject> {
        if seq <= self.stable.seq {
            return Err(Reject::Late { seq, stable: self.stable.seq });
        }
        if !self.has_base() {
            // Joining: no part in ordering before the epoch's base state is here.
            return Err(Reject::Late { seq, stable: self.cfg.membership.since });
        }
        if seq > self.high_water() {
            return Err(Reject::OutOfWindow { seq, low: self.stable.seq, high: self.high_water() });
        }
        Ok(())
    }

    /// The client's own authentication of `req`: its MAC entry for this node (derived on
    /// every use, not cached: a cache keyed by client id would grow with every id a
    /// Byzantine node puts in a FORWARD, and the derivation is one keyed BLAKE3), or with
    /// `auth = sig` its signature.
    fn check_mac(&self, req: &Request) -> Result<(), Reject> {
        if self.cfg.auth == crate::config::Auth::Sig {
            // The batch check's (cofactored) rule even for one signature: every node and
            // every check of the same request then reach the same answer, however the
            // requests were grouped (normal.rs `check_signed_requests`, verify.rs).
            let owner = crate::message::owner_of(req.client);
            return match &req.sig {
                Some(sig) if self.client_keys.verify_batch(&[(owner, req.statement(), *sig)]) => Ok(()),
                _ => Err(Reject::BadMac { client: req.client }),
            };
        }
        self.check_authenticator(req.client, &req.statement(), &req.auth)
    }

    /// This node's entry of a client's MAC authenticator over `statement`.
    fn check_authenticator(
        &self,
        client: ClientId,
        statement: &Digest,
        auth: &[crate::crypto::Mac],
    ) -> Result<(), Reject> {
        // Reads come over the client's own authenticated connection and are never
        // relayed: with auth = sig (and none) the channel vouches for them.
        if matches!(self.cfg.auth, crate::config::Auth::None | crate::config::Auth::Sig) {
            return Ok(());
        }
        // Entries are by stable id, not by index: a client that missed a membership
        // change still authenticates to every node it has a key for.
        let key = client_mac_key(&self.secrets.mac_secret, client);
        if auth.get(self.stable_id.index()).is_some_and(|mac| key.verify(statement, mac)) {
            Ok(())
        } else {
            Err(Reject::BadMac { client })
        }
    }

    /// A client connection may speak only for its own sessions, and only for the first
    /// `SESSIONS_MAX` of them.
    fn check_session(&self, from: Peer, client: ClientId) -> Result<(), Reject> {
        check_session(from, client)
    }

    /// A result as this node sends it: small ones in full from everyone (no wait on a
    /// slow designated node); larger ones in full from one designated node, the others
    /// send the digest (UpRight's designated replier).
    fn reply_body(&self, client: ClientId, seq: u64, result: Vec<u8>) -> crate::message::ReplyBody {
        let full = self.designated(client, seq) || result.len() <= normal::REPLY_INLINE_MAX;
        crate::codec::reply_body(result, full)
    }

    /// Whether this node sends `client`'s result for `seq` in full when it is large.
    fn designated(&self, client: ClientId, seq: u64) -> bool {
        MemberIndex((client.0.wrapping_add(seq) % self.cfg.n() as u64) as u32) == self.id
    }

    /// The records that describe this node's durable state, for log compaction.
    fn durable_records(&self) -> Vec<Record> {
        let mut records = Vec::new();
        if self.cfg.membership.epoch > 0 {
            records.push(Record::Epoch(self.epoch_certs.clone()));
        }
        records.push(Record::Stable(self.stable.clone()));
        if let Some(r) = &self.rejoin {
            records.push(Record::Rejoining { bounds: r.bounds });
        }
        if let Some(nv) = &self.new_view {
            // Before the View record, as `install_new_view` writes them.
            records.push(Record::NewView(nv.clone()));
        }
        records.push(Record::View { view: self.view, floor: self.floor });
        if let Some((view, seq)) = self.vote_horizon {
            records.push(Record::VoteHorizon { view, seq });
        }
        if let Some(t) = self.vc_target {
            records.push(Record::ViewChangeSent { view: t });
        }
        for (&seq, slot) in &self.log {
            if let Some(cert) = &slot.cert {
                records.push(Record::Prepared(cert.clone()));
            }
            for (view, value, _) in &slot.earlier {
                records.push(Record::Accepted { view: *view, seq, value: value.clone() });
            }
            if let Some((value, _)) = &slot.value {
                records.push(Record::Accepted { view: slot.view, seq, value: value.clone() });
            }
            if let (Some(digest), Some(value)) = (slot.decided, &slot.decided_value) {
                if slot.value.as_ref().map(|(_, d)| *d) != Some(digest)
                    && slot.cert.as_ref().map(Cert::digest) != Some(digest)
                {
                    // Keep the body of a value decided through catch-up.
                    records.push(Record::DecidedValue { seq, value: value.clone() });
                }
                records.push(Record::Decided { seq, digest });
            }
        }
        if self.cfg.separated() {
            records.extend(self.exec_records());
        }
        records
    }

    /// One line of internal state for diagnostics (simulator reports, `keel status`).
    pub fn status_line(&self) -> String {
        let votes: Vec<String> = self
            .checkpoint_votes
            .iter()
            .map(|(s, v)| format!("{s}:{}{}", v.len(), if v.contains_key(&self.id) { "+me" } else { "" }))
            .collect();
        let transfer = self.transfer.as_ref().map(|t| {
            let (have, total) = t.progress();
            format!(" transfer {have}/{total}")
        });
        let exec_stage = self.cfg.separated().then(|| self.exec_stage.status());
        format!(
            "n{} epoch {} view {} vc {:?} stop {} exec {} stable {} floor {} next {} log {:?}..{:?} pending {} cp-votes [{}]{}{}",
            self.id,
            self.epoch(),
            self.view,
            self.vc_target,
            self.stop_sent,
            self.exec.executed(),
            self.stable.seq,
            self.floor,
            self.next_propose,
            self.log.keys().next(),
            self.log.keys().next_back(),
            self.pending.len(),
            votes.join(" "),
            transfer.unwrap_or_default(),
            exec_stage.unwrap_or_default()
        )
    }

    /// Checked after every step (kept on in release builds, so they must stay cheap:
    /// no loop over the log, no hashing).
    pub fn invariants(&self) {
        if let Some(t) = self.vc_target {
            assert!(t > self.view, "a view-change target is above the installed view");
        }
        if let Some(nv) = &self.new_view {
            assert_eq!(nv.view, self.view, "the NEW-VIEW kept is the installed view's");
        }
        if let Some((&first, _)) = self.log.iter().next() {
            assert!(first > self.stable.seq, "the log holds only instances above the stable checkpoint");
        }
        if let Some((&last, _)) = self.log.iter().next_back() {
            assert!(last <= self.high_water(), "the log is bounded by the high-water mark");
        }
        // Cheap, structural checks only: this runs after every step. Values are stored
        // with the digest computed from them (accept_proposal, claims keyed by digest);
        // decide re-checks that in debug builds.
        assert!(self.log.len() as u64 <= self.cfg.options.log_max(), "at most log_max slots");
        assert!(self.pending.len() <= self.cfg.options.clients_max, "pending requests are bounded");
        assert!(self.hearsay.len() <= self.cfg.options.clients_max, "endorsements held on hearsay are bounded");
        assert!(
            self.pushes.events() <= push::PUSH_EVENTS_MAX && self.pushes.bytes() <= push::PUSH_BYTES_MAX,
            "push queues are bounded"
        );
        assert!(self.reads.len() <= self.cfg.options.clients_max, "waiting reads are bounded");
        assert!(self.unsigned.len() < normal::SIGNED_BATCH_MAX, "requests awaiting a signature check are bounded");
        assert!(self.view_changes.len() <= self.cfg.n(), "one view change per node");
        assert!(
            self.exec_stage.len() as u64
                <= self.cfg.executors().len() as u64
                    * (2 * self.cfg.options.log_max() / self.cfg.options.checkpoint_interval + 1),
            "execution checkpoint votes are bounded: one per execution node per interval of two windows"
        );
        assert!(
            self.ahead.len() as u64 <= 3 * self.cfg.n() as u64 * self.cfg.options.window,
            "messages held above the high-water mark are bounded"
        );
        assert!(
            self.pending_checkpoints.keys().all(|s| *s >= self.stable.seq && *s <= self.exec.executed()),
            "pending checkpoints lie between the stable checkpoint and the executed instance"
        );
        assert!(self.early_proposals.len() as u64 <= self.cfg.options.log_max(), "early proposals are bounded");
        assert!(self.awaiting.len() as u64 <= self.cfg.options.log_max(), "awaited bodies are bounded");
        assert!(self.parked_len() as u64 <= self.cfg.options.log_max(), "parked proposals are bounded");
        assert!(
            self.body_answers.iter().all(|a| a.len() as u64 <= self.cfg.options.log_max()),
            "operation answers are remembered for instances in the window only"
        );
        assert!(
            self.value_answers.iter().all(|a| a.len() as u64 <= self.cfg.options.log_max()),
            "value answers are remembered for instances in the window only"
        );
    }
}

/// One copy of `msg` per recipient, consecutive (a driver may encode such a run once),
/// the last recipient taking `msg` itself: a PROPOSE carries a whole batch, and every
/// copy of it is a deep clone.
fn fan_out(to: impl Iterator<Item = Peer>, msg: Message, queue: &mut Vec<(Peer, Message)>) {
    let mut to = to.peekable();
    while let Some(peer) = to.next() {
        if to.peek().is_none() {
            queue.push((peer, msg));
            return;
        }
        queue.push((peer, msg.clone()));
    }
}

#[cfg(test)]
mod epoch_tests;
#[cfg(test)]
mod relay_tests;
#[cfg(test)]
mod safety_tests;
#[cfg(test)]
pub(crate) mod tests;
