//! What simulated clients do, and how their history is judged.
//!
//! The simulator is a library: an application author implements [`Workload`] for their
//! own [`Service`] and runs it under the same faults Keel's tests use (see [`crate::run_seed`]).
//! KV's workload lives with KV (`services/kv-sim`): the simulator depends on no service.

use keel_core::client::Pushed;
use keel_core::message::ReadConsistency;
use keel_core::service::Service;
use rand_chacha::ChaCha8Rng;

/// One client operation as the simulator observed it.
#[derive(Clone, Debug)]
pub struct HistoryEntry {
    pub client: u64,
    pub op: Vec<u8>,
    /// Simulated time of the invocation.
    pub invoke: u64,
    /// Simulated time and result bytes, if the client got an answer.
    pub ret: Option<(u64, Vec<u8>)>,
    /// How it was issued: ordered (None) or read-only with this consistency (the client
    /// may still have ordered it; an ordered answer satisfies every consistency).
    pub read: Option<ReadConsistency>,
}

/// Which node a service instance is for ([`Workload::node_service`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeStart {
    /// The node's stable id (its index among the simulated nodes).
    pub node: u32,
    /// Its disk is empty: a new node, or one whose disk was wiped.
    pub fresh: bool,
    /// The simulator runs it as a Byzantine node (order nodes; execution nodes that lie
    /// are not named here).
    pub byzantine: bool,
}

pub trait Workload {
    type Service: Service;

    /// A fresh service instance: a state no node holds (a Byzantine node's stale
    /// answers are computed in one), and every node's unless [`Workload::node_service`]
    /// says otherwise.
    fn service(&self) -> Self::Service;

    /// Node `start.node`'s service, each time it starts (at the beginning, at every
    /// restart, in each new epoch). A service with node-local data beside the replicated
    /// state (block's) keeps it here, by node, and loses it where `start.fresh` says the
    /// node's disk is new or was wiped. Default: [`Workload::service`].
    fn node_service(&self, _start: NodeStart) -> Self::Service {
        self.service()
    }

    /// The next operation client `client` issues.
    fn next_op(&mut self, rng: &mut ChaCha8Rng, client: u64) -> Vec<u8>;

    /// An operation on state no checked operation observes, for the faulty client whose
    /// requests may or may not execute (None: the workload has none, no faulty client).
    fn unobserved_op(&self) -> Option<Vec<u8>> {
        None
    }

    /// How `op` is issued: ordered (None, the default) or read-only with a consistency.
    /// [`Workload::check_history`] must accept what that consistency promises.
    fn read_mode(&mut self, _rng: &mut ChaCha8Rng, _op: &[u8]) -> Option<ReadConsistency> {
        None
    }

    /// Client `client`'s operation `op` returned `result` (a workload whose operations
    /// depend on earlier answers learns them here: coord's session ids). Default:
    /// nothing.
    fn observe(&mut self, _client: u64, _op: &[u8], _result: &[u8]) {}

    /// Client `client`'s core delivered `pushed` at simulated time `at`: a push event
    /// r + 1 nodes sent alike, or a gap (events lost). Called in the order the client
    /// delivers them, which is the order of their numbers (the simulator checks that,
    /// and that each event is one correct nodes sent). A workload whose service pushes
    /// (coord's watches) keeps what it needs here for [`Workload::check_history`].
    /// Default: nothing.
    fn on_push(&mut self, _client: u64, _at: u64, _pushed: &Pushed) {}

    /// Judges the complete history; `Err` names what is wrong. The default accepts any
    /// history (agreement, validity and exactly-once are still checked by the simulator).
    fn check_history(&self, _history: &[HistoryEntry]) -> Result<(), String> {
        Ok(())
    }
}
