//! Every threshold Keel uses, computed from (u, r) in this one place.
//!
//! Fault model (UpRight §2): the system stays **up** while at most `u` nodes are faulty
//! and **right** while at most `r` of those are Byzantine (commission faults), `r <= u`.
//! Any number of nodes may crash and recover; a node counts as faulty only while down.
//!
//! ```text
//!   order nodes     N >= 2u + r + 1    (N = 2u + r + 1 unless reconfiguration added more)
//!   order quorum    Q = ceil((N + r + 1) / 2)
//!                                      = u + r + 1 at N = 2u + r + 1
//!                                      two quorums share 2Q - N >= r + 1 nodes >= 1 correct
//!                                      live with u down: N - u >= Q
//!   weak quorum     r + 1              contains at least one correct node
//!   reply quorum    r + 1              matching replies a client accepts
//! ```
//!
//! `r = 0` is the crash-tolerant (Paxos-class) configuration; `u = r = f` is classic PBFT
//! with `N = 3f + 1` and `Q = 2f + 1`. Reference: UpRight §2 and §4.3, ARCHITECTURE §2.
//!
//! No other module may write a threshold as a literal: they ask a [`Quorums`].

use serde::{Deserialize, Serialize};

/// The largest cluster the wire format and node bitsets are sized for.
pub const NODES_MAX: usize = 64;

/// A deliberate bug, used only to prove that the simulator's checkers can fail.
/// Production configurations carry `None`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Mutation {
    /// Decide and prepare on one vote fewer than the order quorum.
    QuorumMinusOne,
    /// In BFT mode, accept straight after PROPOSE as if `r = 0` (no WRITE phase).
    SkipWrite,
    /// Trust the prepared certificates inside view-change messages without checking
    /// their signatures.
    UnverifiedViewChangeProof,
    /// Answer a linearizable read at once, without first executing what this node voted
    /// to accept.
    ReadWithoutWait,
    /// Take a read index from this node's own votes instead of the highest of a quorum's.
    IndexWithoutQuorum,
    /// Answer a serializable read at once, without first executing the reader's writes.
    SerializableWithoutWait,
    /// `auth = rq-mac`: accept a proposed request on a single valid endorsement.
    OneEndorsement,
    /// The client accepts a push event on one node's copy.
    OnePushCopy,
    /// Nodes and clients follow epoch certificates without checking their signatures.
    UnverifiedEpochCerts,
    /// A checkpoint serialized in the background records the state as it is when the
    /// serialization ends, not as it was frozen at the checkpoint instance (what a
    /// service whose `freeze` is not a true copy would do).
    UnfrozenCheckpoint,
    /// Request digests: an operation a peer sends for a parked proposal is taken for the
    /// one asked for, without checking that it hashes to the proposal's digest.
    UncheckedBody,
    /// Separated execution: an execution node executes a value on one order node's commit
    /// notice instead of `r + 1` matching ones.
    OneCommitNotice,
    /// Separated execution: order nodes certify an execution checkpoint on one execution
    /// node's hash.
    OneExecHash,
    /// The client accepts a result on one reply.
    OneReply,
    /// Separated execution: execution nodes checkpoint only every interval, not where a
    /// membership epoch ends, so order nodes wait for an execution checkpoint there that
    /// never comes (exec_node.rs).
    NoEpochEndCheckpoint,
    /// RQ nodes apart: they never follow a newer epoch (neither ask for one nor take the
    /// certificates they are sent), and keep endorsing for the members of the first
    /// (rq_node.rs).
    RqStaysInEpoch,
    /// A new primary sends its PROPOSEs before its record of the view is durable (issue
    /// #21 defect 2): after a crash in that window it can lead the view twice.
    ProposeBeforeViewDurable,
    /// A node that lost its disk votes at once, as if the cluster were new (issue #21
    /// defect 4): it may vote twice in one (view, instance).
    WipedNodeVotes,
    /// Signed order statements (WRITE, VIEW-CHANGE, NEW-VIEW) name no epoch (every epoch
    /// hashes the same all-zero tag), and stable proofs from before the epoch's base
    /// checkpoint are judged like this epoch's (issue #21 defect 1): a member can replay
    /// an earlier epoch's statements after a change that kept signers' indices and keys.
    EpochlessStatements,
    /// The client counts replies tagged with an epoch it has not verified, with the
    /// quorums of the epoch it knows, and keeps counting removed members' replies (issue
    /// #21 defect 3): after r is raised, one lying node's reply can complete an operation.
    UnverifiedEpochReplies,
    /// `auth = rq-mac`: the client ignores blame and sends first transmissions from the
    /// primary on to the first `u + r + 1` nodes that replied lately (issue #21 defect 5):
    /// a node that replies but spoils its endorsements costs every operation it is sent
    /// a retransmission timeout. Caught by `keel sim --report attacks`, not a checker.
    BlindEndorserRouting,
    /// Separated execution: order nodes certify an execution checkpoint on `r + 1`
    /// matching hashes (the paper's quorum; issue #21 defect 6): when `r < u`, losing
    /// the one correct signer leaves lagging execution nodes neither state nor commits.
    ExecCheckpointOnRPlusOne,
    /// An executor that restores a snapshot (state transfer, recovery) starts agreed time
    /// over instead of taking the snapshot's: its next instance runs an agreed-time tick
    /// the other nodes do not run (`Options::tick_ms`).
    RestoreWithoutTime,
    /// BFT: a node that restarted votes again in the view it recovered into, ignoring
    /// the vote horizon on its disk: where its Accepted record was lost (it is not waited
    /// for), it can sign WRITEs for two values of one (view, seq).
    VoteAfterRestart,
    /// BFT: a node that abstains where it may have voted before a restart never asks for
    /// a view change on its own: with another node down, instances it abstains on can
    /// stay undecided for good (the liveness failure of session 28's first vote horizon).
    AbstainSilently,
}

impl Mutation {
    pub const ALL: [Mutation; 25] = [
        Mutation::QuorumMinusOne,
        Mutation::SkipWrite,
        Mutation::UnverifiedViewChangeProof,
        Mutation::ReadWithoutWait,
        Mutation::IndexWithoutQuorum,
        Mutation::SerializableWithoutWait,
        Mutation::OneEndorsement,
        Mutation::OnePushCopy,
        Mutation::UnverifiedEpochCerts,
        Mutation::UnfrozenCheckpoint,
        Mutation::UncheckedBody,
        Mutation::OneCommitNotice,
        Mutation::OneExecHash,
        Mutation::OneReply,
        Mutation::NoEpochEndCheckpoint,
        Mutation::RqStaysInEpoch,
        Mutation::ProposeBeforeViewDurable,
        Mutation::WipedNodeVotes,
        Mutation::EpochlessStatements,
        Mutation::UnverifiedEpochReplies,
        Mutation::BlindEndorserRouting,
        Mutation::ExecCheckpointOnRPlusOne,
        Mutation::RestoreWithoutTime,
        Mutation::VoteAfterRestart,
        Mutation::AbstainSilently,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Mutation::QuorumMinusOne => "quorum-minus-one",
            Mutation::SkipWrite => "skip-write",
            Mutation::UnverifiedViewChangeProof => "unverified-view-change-proof",
            Mutation::ReadWithoutWait => "read-without-wait",
            Mutation::IndexWithoutQuorum => "index-without-quorum",
            Mutation::SerializableWithoutWait => "serializable-without-wait",
            Mutation::OneEndorsement => "one-endorsement",
            Mutation::OnePushCopy => "one-push-copy",
            Mutation::UnverifiedEpochCerts => "unverified-epoch-certs",
            Mutation::UnfrozenCheckpoint => "unfrozen-checkpoint",
            Mutation::UncheckedBody => "unchecked-body",
            Mutation::OneCommitNotice => "one-commit-notice",
            Mutation::OneExecHash => "one-exec-hash",
            Mutation::OneReply => "one-reply",
            Mutation::NoEpochEndCheckpoint => "no-epoch-end-checkpoint",
            Mutation::RqStaysInEpoch => "rq-stays-in-epoch",
            Mutation::ProposeBeforeViewDurable => "propose-before-view-durable",
            Mutation::WipedNodeVotes => "wiped-node-votes",
            Mutation::EpochlessStatements => "epochless-statements",
            Mutation::UnverifiedEpochReplies => "unverified-epoch-replies",
            Mutation::BlindEndorserRouting => "blind-endorser-routing",
            Mutation::ExecCheckpointOnRPlusOne => "exec-checkpoint-on-r-plus-one",
            Mutation::RestoreWithoutTime => "restore-without-time",
            Mutation::VoteAfterRestart => "vote-after-restart",
            Mutation::AbstainSilently => "abstain-silently",
        }
    }

    pub fn from_name(name: &str) -> Option<Mutation> {
        Mutation::ALL.into_iter().find(|m| m.name() == name)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QuorumError {
    #[error("r = {r} exceeds u = {u}: Byzantine faults are a subset of all faults tolerated")]
    RExceedsU { u: u32, r: u32 },
    #[error("u = {u}, r = {r} needs {n} nodes, more than the {max} supported")]
    TooManyNodes { u: u32, r: u32, n: usize, max: usize },
    #[error("{n} nodes cannot tolerate u = {u}, r = {r}: that needs at least {min}")]
    TooFewNodes { u: u32, r: u32, n: usize, min: usize },
}

/// Thresholds for one (u, r) configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Quorums {
    u: u32,
    r: u32,
    /// Order nodes; `2u + r + 1` unless a reconfiguration added more.
    n: u32,
    /// Always None in a build without the `mutations` feature (the checker mutations
    /// exist only for the simulator and tests); kept in every build so the encoding
    /// does not depend on the feature.
    #[cfg_attr(not(feature = "mutations"), allow(dead_code))]
    mutation: Option<Mutation>,
}

impl Quorums {
    /// The smallest cluster for (u, r): `2u + r + 1` nodes.
    pub fn new(u: u32, r: u32) -> Result<Quorums, QuorumError> {
        Quorums::with_nodes(u, r, 2 * u as usize + r as usize + 1)
    }

    /// `n` nodes tolerating (u, r): what a membership change produces (BFT-SMaRt
    /// §II-C3). More nodes than `2u + r + 1` raise the order quorum so that two quorums
    /// still share `r + 1` nodes; `n - u` nodes still form one.
    pub fn with_nodes(u: u32, r: u32, n: usize) -> Result<Quorums, QuorumError> {
        if r > u {
            return Err(QuorumError::RExceedsU { u, r });
        }
        let min = 2 * u as usize + r as usize + 1;
        if n > NODES_MAX || min > NODES_MAX {
            return Err(QuorumError::TooManyNodes { u, r, n: n.max(min), max: NODES_MAX });
        }
        if n < min {
            return Err(QuorumError::TooFewNodes { u, r, n, min });
        }
        Ok(Quorums { u, r, n: n as u32, mutation: None })
    }

    /// The same thresholds with a deliberate bug switched on (the simulator's and the
    /// tests' checker mutations). Only a build with the `mutations` feature has them: in
    /// any other (a production build) this keeps None, [`Quorums::mutation`] is None
    /// whatever was asked, and the compiler removes every mutated branch.
    pub fn with_mutation(mut self, mutation: Option<Mutation>) -> Quorums {
        if cfg!(feature = "mutations") {
            self.mutation = mutation;
        }
        self
    }

    /// The deliberate bug switched on, if any: always None without the `mutations`
    /// feature.
    #[inline]
    pub fn mutation(&self) -> Option<Mutation> {
        #[cfg(feature = "mutations")]
        return self.mutation;
        #[cfg(not(feature = "mutations"))]
        None
    }

    pub fn u(&self) -> u32 {
        self.u
    }

    pub fn r(&self) -> u32 {
        self.r
    }

    /// Whether commission faults are tolerated, which switches on the WRITE phase and
    /// signed prepared certificates (BFT-SMaRt: CFT mode when false).
    pub fn byzantine(&self) -> bool {
        self.r > 0
    }

    /// Order (agreement) nodes: `2u + r + 1`, or more after a reconfiguration.
    pub fn order_nodes(&self) -> usize {
        self.n as usize
    }

    /// Votes that decide, prepare, make a checkpoint stable, or start a view:
    /// `ceil((N + r + 1) / 2)`, which is `u + r + 1` for `N = 2u + r + 1`.
    pub fn order_quorum(&self) -> usize {
        let q = (self.n as usize + self.r as usize + 2) / 2;
        match self.mutation() {
            Some(Mutation::QuorumMinusOne) => q.saturating_sub(1).max(1),
            _ => q,
        }
    }

    /// Votes that include at least one correct node: `r + 1`. Enough to join a view
    /// change or to trust a fact a peer reports (a decided batch, a higher view).
    pub fn weak_quorum(&self) -> usize {
        self.r as usize + 1
    }

    /// Matching replies a client needs: `r + 1`.
    pub fn reply_quorum(&self) -> usize {
        match self.mutation() {
            Some(Mutation::OneReply) => 1,
            _ => self.r as usize + 1,
        }
    }

    /// Matching copies of a push event a client needs: `r + 1`, as for replies.
    pub fn push_quorum(&self) -> usize {
        match self.mutation() {
            Some(Mutation::OnePushCopy) => 1,
            _ => self.r as usize + 1,
        }
    }

    /// Matching read-only answers a client needs (ARCHITECTURE §7). Serializable: `r + 1`,
    /// at least one from a correct node that executed the reader's last write.
    /// Linearizable: `Q`. A write that completed was accepted by Q nodes, at least
    /// `Q - r = u + 1` of them correct, and each correct node answers a linearizable read
    /// only after executing everything it had accepted; any `Q` answers include one of
    /// those (`Q + u + 1 - N = 1`), so Q matching answers reflect the write.
    /// Read index: `r + 1` (one correct node among them waited for the index, see
    /// [`Quorums::index_quorum`]).
    pub fn read_quorum(&self, consistency: ReadConsistency) -> usize {
        match consistency {
            ReadConsistency::Serializable | ReadConsistency::Index => self.reply_quorum(),
            ReadConsistency::Linearizable => self.order_quorum(),
        }
    }

    /// Answers to an index probe a node needs before it takes the highest as its read
    /// index: `Q`. By the argument of [`Quorums::read_quorum`] any Q answers include a
    /// correct node that accepted a completed write, and answers are taken after the
    /// read arrived, so the highest is at or past that write. Fewer (say, its own vote
    /// alone) can all come from nodes that never saw it.
    pub fn index_quorum(&self) -> usize {
        match self.mutation() {
            Some(Mutation::IndexWithoutQuorum) => 1,
            _ => self.order_quorum(),
        }
    }

    /// `auth = rq-mac` (UpRight §3, §4.1): endorsements valid for the primary before it
    /// proposes a request: `u + r + 1`. At most `r` come from lying nodes, so at least
    /// `u + 1` are from correct nodes, whose entries are valid for every node.
    pub fn endorse_propose(&self) -> usize {
        self.u as usize + self.r as usize + 1
    }

    /// Nodes a client's first transmission of an ordered request goes to when execution
    /// is co-located and the nodes themselves authenticate requests (`auth` other than
    /// rq-mac, whose endorsers [`Quorums::endorse_propose`] counts): the nodes that reply.
    ///
    /// With `r > 0`, `u + r + 1`: `u` may be down and `r` lie, and `r + 1` replies still
    /// match. With `r = 0`, one: the primary. One reply suffices, and nothing is ordered
    /// without the primary anyway, so a second recipient would only send a second reply
    /// (at n = 3 a third of the client traffic of the cluster and of the client). What a
    /// second copy did for failover, a backup now does by forwarding a request it gets
    /// from the client at once (the client took it for the primary: its view is old, or
    /// it blamed the primary), and a crashed primary costs the client one retransmission
    /// period before the backups hear of the request, as with ZooKeeper's or Raft's
    /// clients.
    pub fn first_recipients(&self) -> usize {
        match self.byzantine() {
            true => self.u as usize + self.r as usize + 1,
            false => 1,
        }
    }

    /// Endorsements valid for a backup before it accepts a proposed request: `u + 1`
    /// (at least one from a correct node, since `u >= r`; the primary's `u + r + 1`
    /// guarantee that many).
    pub fn endorse_accept(&self) -> usize {
        match self.mutation() {
            Some(Mutation::OneEndorsement) => 1,
            _ => self.u as usize + 1,
        }
    }

    /// Endorsements from other nodes that make a node endorse a request whose client
    /// MAC it could not check itself: `r + 1`, one of them from a correct node that did.
    pub fn endorse_amplify(&self) -> usize {
        self.r as usize + 1
    }

    /// Endorsements a node must hold before its request timer may suspect the primary:
    /// `2r + 1`, so `r + 1` come from correct nodes, every correct node amplifies, and a
    /// correct primary ends up with `u + r + 1`. Fewer can be the doing of a client whose
    /// MACs are valid for a few nodes only, which is no reason to replace the primary.
    pub fn endorse_suspect(&self) -> usize {
        2 * self.r as usize + 1
    }

    /// Execution nodes when execution is separated: `2u + 1` (issue #21 defect 6; the
    /// paper's `u + r + 1`, UpRight §4.3, is the same when `r = u` and one or more
    /// fewer otherwise). With `u` of them down the other `u + 1` still certify a
    /// checkpoint ([`Quorums::exec_checkpoint_quorum`]) and `r + 1` of them answer a
    /// client. Keel co-locates execution on all order nodes by default.
    pub fn execution_nodes_min(&self) -> usize {
        2 * self.u as usize + 1
    }

    /// Request-quorum nodes when RQ is its own stage: `2u + r + 1` (UpRight §4.3), so
    /// the primary can always gather `u + r + 1` endorsements with `u` down.
    pub fn rq_nodes_min(&self) -> usize {
        2 * self.u as usize + self.r as usize + 1
    }

    /// Matching commit notices from order nodes on which an execution node executes a
    /// value (UpRight §4.2): `r + 1`, one of them from a correct order node, which sends
    /// only what its order quorum decided.
    pub fn commit_quorum(&self) -> usize {
        match self.mutation() {
            Some(Mutation::OneCommitNotice) => 1,
            _ => self.r as usize + 1,
        }
    }

    /// Matching execution checkpoint hashes that certify an execution checkpoint: `u + 1`
    /// (issue #21 defect 6). Once one is certified, order nodes collect the commits
    /// below it, so a lagging execution node can only fetch the state from a node that
    /// holds it. Of any `u + 1` signers at most `u` are faulty — lying (at most `r <= u`,
    /// so one correct node computed that state) or down for good — so one correct
    /// holder stays to serve it whatever the faults within `u`. The paper's `r + 1`
    /// ("a quorum of matching hashes", UpRight §4.2) is enough for the hash to be right
    /// but, when `r < u`, not for it to stay fetchable: the one correct signer may be
    /// the node that is lost.
    pub fn exec_checkpoint_quorum(&self) -> usize {
        match self.mutation() {
            Some(Mutation::OneExecHash) => 1,
            Some(Mutation::ExecCheckpointOnRPlusOne) => self.r as usize + 1,
            _ => self.u as usize + 1,
        }
    }
}

/// How strong a read-only answer must be (ARCHITECTURE §7).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReadConsistency {
    /// r + 1 matching answers from nodes that executed the session's last ordered request:
    /// the state of some prefix of the decided sequence that includes the reader's own
    /// writes, possibly missing writes of others that already completed.
    Serializable,
    /// Q matching answers, each from a node that first executed every instance it had
    /// voted to accept when the read arrived: reflects every write completed before the
    /// read began (see `replica::read`).
    Linearizable,
    /// Read index (Gaios, ARCHITECTURE §7): sent to r + 1 chosen nodes only. Each asks
    /// every node how far it has voted to accept, takes the highest of a quorum's
    /// answers as the index, and answers once it executed that far; r + 1 matching
    /// answers are linearizable (see `replica::read`). Last, so the earlier variants
    /// keep their tags.
    Index,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(u: u32, r: u32) -> Quorums {
        Quorums::new(u, r).expect("valid")
    }

    #[test]
    fn cft_is_a_majority_of_2u_plus_1() {
        let t = q(1, 0);
        assert_eq!(t.order_nodes(), 3);
        assert_eq!(t.order_quorum(), 2);
        assert_eq!(t.weak_quorum(), 1);
        assert_eq!(t.reply_quorum(), 1);
        assert!(!t.byzantine());
        let t = q(2, 0);
        assert_eq!((t.order_nodes(), t.order_quorum()), (5, 3));
    }

    #[test]
    fn u_equals_r_is_pbft() {
        for f in 1..=4u32 {
            let t = q(f, f);
            assert_eq!(t.order_nodes(), 3 * f as usize + 1);
            assert_eq!(t.order_quorum(), 2 * f as usize + 1);
            assert_eq!(t.weak_quorum(), f as usize + 1);
            assert!(t.byzantine());
        }
    }

    #[test]
    fn u_greater_than_r() {
        let t = q(2, 1);
        assert_eq!(t.order_nodes(), 6);
        assert_eq!(t.order_quorum(), 4);
        assert_eq!(t.weak_quorum(), 2);
        assert_eq!(t.execution_nodes_min(), 5);
        assert_eq!(t.rq_nodes_min(), 6);
        assert_eq!((t.commit_quorum(), t.exec_checkpoint_quorum()), (2, 3));
    }

    /// Separated execution: `2u + 1` execution nodes stay live with `u` down (`u + 1`
    /// left to certify, `r + 1` of them to answer), right with `r` lying (`r + 1`
    /// matching include a correct one), and a certified checkpoint keeps a correct,
    /// live holder whatever `u` faults (lying or down) strike its signers.
    #[test]
    fn execution_stage_is_live_and_right() {
        for u in 0..=10u32 {
            for r in 0..=u {
                let t = q(u, r);
                let ne = t.execution_nodes_min();
                assert!(ne >= (u + r + 1) as usize, "at least the paper's");
                assert!(ne - u as usize >= t.exec_checkpoint_quorum());
                assert!(ne - u as usize >= t.reply_quorum());
                assert!(t.commit_quorum() > r as usize && t.exec_checkpoint_quorum() > r as usize);
                assert!(t.exec_checkpoint_quorum() > u as usize, "one signer neither lying nor down");
                // Order nodes that stay up can always send r + 1 commit notices.
                assert!(t.order_nodes() - u as usize >= t.commit_quorum());
            }
        }
    }

    #[test]
    fn unreplicated_baseline() {
        let t = q(0, 0);
        assert_eq!((t.order_nodes(), t.order_quorum()), (1, 1));
    }

    /// The properties the protocols rely on, for every supported (u, r).
    #[test]
    fn intersection_and_liveness_hold_for_all_configurations() {
        for u in 0..=10u32 {
            for r in 0..=u {
                let t = q(u, r);
                let (n, qq) = (t.order_nodes(), t.order_quorum());
                // Live with u nodes down.
                assert!(n - u as usize >= qq);
                // Two quorums share at least r + 1 nodes: at least one correct.
                assert!(2 * qq - n > r as usize);
                // A quorum holds at least u + 1 correct nodes, which is >= r + 1.
                assert!(qq - r as usize >= t.weak_quorum());
            }
        }
    }

    /// Clusters grown by reconfiguration keep both properties.
    #[test]
    fn larger_clusters_keep_intersection_and_liveness() {
        for u in 0..=6u32 {
            for r in 0..=u {
                let min = (2 * u + r + 1) as usize;
                assert_eq!(Quorums::with_nodes(u, r, min), Quorums::new(u, r));
                for n in min..=min + 6 {
                    let t = Quorums::with_nodes(u, r, n).expect("valid");
                    let qq = t.order_quorum();
                    assert!(n - u as usize >= qq, "live: n {n} u {u} r {r} q {qq}");
                    assert!(2 * qq - n > r as usize, "intersect: n {n} u {u} r {r} q {qq}");
                    assert!(qq - r as usize >= t.weak_quorum());
                    assert!(t.endorse_propose() <= n - u as usize);
                }
            }
        }
        assert_eq!(Quorums::with_nodes(1, 1, 5).map(|t| t.order_quorum()), Ok(4));
        assert_eq!(Quorums::with_nodes(1, 0, 4).map(|t| t.order_quorum()), Ok(3));
        assert_eq!(Quorums::with_nodes(1, 1, 3), Err(QuorumError::TooFewNodes { u: 1, r: 1, n: 3, min: 4 }));
    }

    #[test]
    fn rejects_r_above_u_and_oversized_clusters() {
        assert_eq!(Quorums::new(1, 2), Err(QuorumError::RExceedsU { u: 1, r: 2 }));
        assert!(matches!(Quorums::new(40, 0), Err(QuorumError::TooManyNodes { .. })));
    }

    #[cfg(feature = "mutations")]
    #[test]
    fn mutation_weakens_only_the_order_quorum() {
        let t = q(1, 1).with_mutation(Some(Mutation::QuorumMinusOne));
        assert_eq!(t.order_quorum(), 2);
        assert_eq!(t.weak_quorum(), 2);
        for m in Mutation::ALL {
            assert_eq!(Mutation::from_name(m.name()), Some(m));
        }
    }
}
