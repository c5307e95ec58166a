//! What a sans-IO node of Keel steps in, whatever stage it runs: who a message is from
//! ([`Peer`]), what it is given ([`Input`]), what it asks its driver to do ([`Outputs`],
//! [`Persist`], [`CheckpointJob`]), what it reports ([`Event`]) and why it dropped an
//! input ([`Reject`]). Order, execution and RQ nodes (`replica`, `exec_node`, `rq_node`)
//! and the modules they share (`transfer`, `read_wait`) depend on this vocabulary, not on
//! each other (issue #22).

use crate::crypto::Digest;
use crate::exec::{Chunked, FrozenExecutor};
use crate::message::{ClientId, Message, NodeId, Seq, View};
use crate::wal::Record;

/// Who a message came from or goes to. The transport authenticates it. A node is named
/// by its stable id (`NodeId`), in every core's inputs and outputs, whatever its index in
/// a membership epoch; a node of a stage apart by `config::stage_node` of its stable id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Peer {
    Node(NodeId),
    Client(ClientId),
}

pub enum Input {
    Message {
        from: Peer,
        msg: Message,
    },
    /// A message from node `from` (its stable id) whose signature the driver's verify
    /// stage found valid (the replica's `Verifier::check` returned true for exactly this
    /// sender and message): the node skips that one signature check and validates
    /// everything else as for `Message`.
    Checked {
        from: NodeId,
        msg: Message,
    },
    /// Time passed; timers are checked against `now`.
    Tick,
    /// A checkpoint the driver serialized off the protocol thread ([`CheckpointJob`]).
    CheckpointReady(CheckpointReady),
    /// The durability barrier the node asked for ([`Outputs::barrier`]) is passed:
    /// everything it persisted is durable and every message it gated is sent. Stepped
    /// once per barrier, and only then.
    Drained,
}

/// Something the driver must make durable, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Persist {
    Record(Record),
    /// Store the snapshot of the checkpoint at `seq` durably and atomically, beside the
    /// ones already stored. Its chunks come along (the bytes are shared with the
    /// checkpoint kept in memory, not copied), so a driver can store only the chunks it
    /// does not hold yet.
    Snapshot {
        seq: Seq,
        chunked: Chunked,
    },
    /// Garbage collection at a stable checkpoint: atomically replace the whole log with
    /// `records` and delete the snapshots below `snapshots_from`. The snapshot at the
    /// stable checkpoint is kept, so a node that restarts can still serve it to laggards.
    Compact {
        records: Vec<Record>,
        snapshots_from: Seq,
    },
}

/// Everything one step asks the driver to do.
#[derive(Default, Debug)]
pub struct Outputs {
    /// Persist these, in order.
    pub persist: Vec<Persist>,
    /// Append these after `persist`, but nothing waits for them: gated messages wait
    /// only for `persist`, and no sync is needed on their account (a later one covers
    /// them). A `Decided` record is one: a decision is durable as the Q persisted votes
    /// that made it, so losing the record costs a catch-up from peers, never the decision.
    pub persist_lazy: Vec<Record>,
    /// Send now.
    pub send: Vec<(Peer, Message)>,
    /// Send only once every `persist` entry (not `persist_lazy`) of this step and of
    /// earlier steps is durable: votes, view changes and replies reflect persisted state. Order among
    /// the entries of one step does not matter.
    pub send_after_persist: Vec<(Peer, Message)>,
    /// Observations for metrics, logs and the simulator's checkers.
    pub events: Vec<Event>,
    /// Checkpoints to serialize off the protocol thread: run each
    /// ([`CheckpointJob::run`]) and step the result in as [`Input::CheckpointReady`], in
    /// any order, whenever done. A crash loses them (recovery takes them again).
    pub checkpoints: Vec<CheckpointJob>,
    /// A durability barrier: carry out these outputs as usual, then step the node with
    /// nothing but [`Input::Drained`], and that only once every `persist` entry of this
    /// step and of earlier ones is durable and every gated message sent (handed to the
    /// network). Other inputs wait (or are lost, as the network may lose them); a node
    /// stepped with one at a barrier drops it. What the node does at the barrier is its
    /// own business: drivers honour every barrier alike (the end of a membership epoch
    /// is one, replica/epoch.rs). `persist_lazy` is not waited for.
    pub barrier: bool,
}

impl Outputs {
    pub fn is_empty(&self) -> bool {
        self.persist.is_empty()
            && self.persist_lazy.is_empty()
            && self.send.is_empty()
            && self.send_after_persist.is_empty()
            && self.events.is_empty()
            && self.checkpoints.is_empty()
            && !self.barrier
    }

    pub fn clear(&mut self) {
        self.persist.clear();
        self.persist_lazy.clear();
        self.send.clear();
        self.send_after_persist.clear();
        self.events.clear();
        self.checkpoints.clear();
        self.barrier = false;
    }
}

/// One request executed on this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExecutedRequest {
    pub client: ClientId,
    pub seq: u64,
    /// Digest of the operation, so checkers can tie it to what the client submitted.
    pub op: Digest,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    Decided {
        seq: Seq,
        digest: Digest,
    },
    /// The primary of `view` executed `rate` requests per window against a best of
    /// `best`: this node asks to replace it (leadership.rs).
    SlowPrimary {
        view: View,
        rate: u64,
        best: u64,
    },
    /// A read-only operation was answered without ordering.
    ReadAnswered {
        consistency: crate::message::ReadConsistency,
    },
    /// The service ran an agreed-time tick (`Service::on_tick`) at agreed time `time`,
    /// before instance `seq`'s requests.
    Ticked {
        seq: Seq,
        time: u64,
    },
    /// Instance `seq` ran; `requests` lists those executed for the first time.
    Executed {
        seq: Seq,
        requests: Vec<ExecutedRequest>,
    },
    /// Rejoining after a lost disk: Q others answered; the node waits for `view` and for
    /// its stable checkpoint to pass `executed` by `log_max` (replica/rejoin.rs).
    RejoinBounds {
        view: View,
        executed: Seq,
    },
    /// Rejoining is over: the node votes again.
    Rejoined {
        view: View,
        stable: Seq,
    },
    ViewInstalled {
        view: View,
    },
    ViewChangeStarted {
        view: View,
    },
    Checkpoint {
        seq: Seq,
        root: Digest,
    },
    Stable {
        seq: Seq,
        root: Digest,
    },
    /// `count` push events for `client` were dropped unsent or unacknowledged: its
    /// queue was full (push.rs).
    PushDropped {
        client: ClientId,
        count: u64,
    },
    /// This node's state at `seq` differs from the stable one: it repairs itself.
    Divergence {
        seq: Seq,
        local: Digest,
        stable: Digest,
    },
    /// A state transfer to the stable checkpoint at `seq`; `replacing`: the checkpoint an
    /// unfinished transfer was fetching, given up because a newer one became stable (peers
    /// serve only their newest; the chunks fetched are kept).
    StateTransferStarted {
        seq: Seq,
        replacing: Option<Seq>,
    },
    /// This node's epoch is over: instance `seq` applied a membership change and the
    /// checkpoint there is stable. The next epoch is `epoch`; the node goes on to it
    /// itself, past a durability barrier ([`Outputs::barrier`], replica/epoch.rs).
    EpochEnded {
        epoch: u64,
        seq: Seq,
    },
    /// The node runs membership epoch `epoch` now, as index `index` (its id in the
    /// outputs from here on): the driver follows the new members and their keys.
    EpochStarted {
        epoch: u64,
        index: crate::ids::MemberIndex,
    },
    /// Membership epoch `epoch` leaves this node out: it is retired, helping the old
    /// epoch's members end it, until its driver stops it (replica/epoch.rs).
    Removed {
        epoch: u64,
    },
    /// The state at `seq` is installed: `chunks` in all, `reused` of them already held
    /// (from a transfer this one replaced, or this node's own snapshots).
    StateTransferDone {
        seq: Seq,
        chunks: usize,
        reused: usize,
    },
    /// Bytes of a checkpoint that had left memory could not be read back (a damaged
    /// disk): the chunk was not served or reused, or the stable state not restored.
    SnapshotUnreadable {
        why: String,
    },
    /// Operations of a proposal sent by digest arrived from a peer that held them
    /// (bodies.rs): `count` filled for instance `seq`.
    OperationsFetched {
        seq: Seq,
        count: usize,
    },
    /// Input dropped, with the reason (counted by the driver).
    Rejected {
        from: Peer,
        kind: &'static str,
        reason: Reject,
    },
}

/// Why an input was dropped. Every one is counted; none crashes the node.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Reject {
    #[error("message for view {got}, current view {current}")]
    StaleView { current: View, got: View },
    #[error("node index {from} is not the primary of view {view}")]
    NotPrimary { from: crate::ids::MemberIndex, view: View },
    #[error("instance {seq} outside window ({low}, {high}]")]
    OutOfWindow { seq: Seq, low: Seq, high: Seq },
    #[error("a different value was already proposed for instance {seq} in view {view}")]
    Equivocation { view: View, seq: Seq },
    #[error("invalid signature from node {signer}")]
    BadSignature { signer: NodeId },
    #[error("request from client {client} failed authentication (MAC or signature)")]
    BadMac { client: ClientId },
    #[error("endorsement from node {node} has an invalid MAC")]
    BadEndorsement { node: NodeId },
    #[error("proposal time {time} outside tolerance of local clock {now}")]
    BadTime { time: u64, now: u64 },
    #[error("batch violates a bound: {0}")]
    BadBatch(&'static str),
    #[error("unknown node {0}")]
    UnknownNode(NodeId),
    #[error("message kind not accepted from this peer")]
    WrongPeer,
    #[error("invalid proof: {0}")]
    BadProof(&'static str),
    #[error("node is busy: {0}")]
    Busy(&'static str),
    /// A valid message that arrived after it stopped mattering (a vote for an instance
    /// below the stable checkpoint). Dropped without being counted as bad input.
    #[error("late message for instance {seq} at or below the stable checkpoint {stable}")]
    Late { seq: Seq, stable: Seq },
}

/// A client connection may speak only for its own sessions, and only for the first
/// `SESSIONS_MAX` of them; identities reserved for nodes speak for no one.
pub(crate) fn check_session(from: Peer, client: ClientId) -> Result<(), Reject> {
    if let Peer::Client(c) = from {
        if crate::message::owner_of(client) != c {
            return Err(Reject::WrongPeer);
        }
    }
    if crate::message::owner_of(client) >= crate::ids::ENDORSER_OWNER_BASE {
        return Err(Reject::WrongPeer);
    }
    if crate::message::session_of(client) >= crate::message::SESSIONS_MAX {
        return Err(Reject::Busy("session number above SESSIONS_MAX"));
    }
    Ok(())
}

/// A checkpoint to serialize, chunk and hash off the protocol thread: the state as it
/// was at `seq`, frozen copy-on-write ([`crate::service::Service::freeze`]), so the node executes on
/// meanwhile (UpRight §3.2).
pub struct CheckpointJob {
    pub(crate) seq: Seq,
    pub(crate) epoch: u64,
    pub(crate) generation: u64,
    pub(crate) state: FrozenExecutor,
    pub(crate) chunk_bytes: usize,
}

impl CheckpointJob {
    pub fn seq(&self) -> Seq {
        self.seq
    }

    /// The expensive part: serialize the frozen state, cut it into chunks, hash them.
    pub fn run(self) -> CheckpointReady {
        let chunked = Chunked::from_pieces(self.state.pieces(), self.chunk_bytes);
        CheckpointReady { seq: self.seq, epoch: self.epoch, generation: self.generation, chunked }
    }
}

impl std::fmt::Debug for CheckpointJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckpointJob").field("seq", &self.seq).field("epoch", &self.epoch).finish_non_exhaustive()
    }
}

/// A [`CheckpointJob`]'s result, for [`Input::CheckpointReady`].
pub struct CheckpointReady {
    pub(crate) seq: Seq,
    pub(crate) epoch: u64,
    pub(crate) generation: u64,
    pub(crate) chunked: Chunked,
}

impl CheckpointReady {
    pub fn seq(&self) -> Seq {
        self.seq
    }
}
