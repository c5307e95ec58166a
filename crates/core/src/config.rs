//! Cluster configuration (identical on every node) and protocol options.
//!
//! Every bound a Byzantine peer could otherwise push on is named here with a `_max`
//! suffix and checked before anything is buffered.

use crate::crypto::{NodeKeys, PublicKey};
use crate::ids::{MemberIndex, NodeRange};
use crate::membership::Membership;
use crate::message::{ClientId, NodeId, View};
use crate::quorum::{QuorumError, Quorums};
use std::collections::BTreeMap;

/// What every node of one cluster agrees on.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    pub quorums: Quorums,
    /// Public key of each order node, indexed by node id.
    pub node_keys: Vec<PublicKey>,
    pub options: Options,
    /// How client requests are authenticated (ARCHITECTURE §4).
    pub auth: Auth,
    /// `auth = rq-mac`: the primary proposes operations over `DIGEST_MIN` bytes by digest
    /// and backups fetch them from their endorsers (UpRight §4.1 "Request digest";
    /// replica/bodies.rs). On by default with rq-mac; meaningless (off) otherwise.
    pub request_digests: bool,
    /// `auth = sig`: each client identity's Ed25519 public key (sessions use their
    /// owner's).
    pub client_keys: BTreeMap<ClientId, PublicKey>,
    /// The epoch this configuration runs: `quorums` and `node_keys` are its.
    pub membership: Membership,
    /// The key administrative operations must be signed with (membership.rs); `None`:
    /// the membership cannot change.
    pub admin_key: Option<PublicKey>,
    /// Which nodes execute (ARCHITECTURE §2, UpRight §4.2).
    pub stages: Stages,
}

/// The protocol cores' name for a node of a stage apart (an execution or RQ node of its
/// own): `STAGE_BASE` plus its stable id. Every core calls order nodes by their stable ids
/// (below [`crate::quorum::NODES_MAX`]); the order core counts their votes by index
/// (`MemberIndex`), which it keeps to itself.
///
/// Kept, though stable ids alone would now tell the nodes apart, because stage names are
/// values on the wire and in signatures: an execution node signs its checkpoint votes
/// (`checkpoint_statement`, `StableProof::sigs`, checked with `exec_keys`, which start at
/// the first execution node's stage name) and an RQ node its endorsements
/// (`endorse_statement`, `Endorsement::node`) under its stage name. Removing them changes
/// those values (issue #22, "What is left of #22" item 4).
pub const STAGE_BASE: NodeId = NodeId(1 << 16);

/// The core name of the stage node with stable id `id`.
pub fn stage_node(id: u32) -> NodeId {
    NodeId(STAGE_BASE.0 + id)
}

/// The stable id of stage node `node`, or `None` if `node` names an order node.
pub fn stage_id(node: NodeId) -> Option<u32> {
    node.0.checked_sub(STAGE_BASE.0)
}

/// Where the execution and request-quorum stages run. Order nodes are the members;
/// separate execution nodes have the stable ids after the genesis members', then separate
/// RQ nodes after those (`keel init` numbers them so). Membership changes add order
/// nodes with ids above all of them and never move a stage node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stages {
    /// Empty: every order node also executes (co-located, the default). Otherwise the
    /// public keys of separate execution nodes, stable ids `exec_first..` (exec_node.rs).
    /// Order nodes then keep only the order state and send each decided value to them
    /// (UpRight §4.2).
    pub executors: Vec<PublicKey>,
    pub exec_first: u32,
    /// Empty: every order node is also an RQ node (`auth = rq-mac` co-located,
    /// replica/endorse.rs). Otherwise the public keys of separate request-quorum nodes
    /// (rq_node.rs), stable ids `rq_first..`: clients send them their requests, and order
    /// nodes take a request only on their endorsements (UpRight §4.1).
    pub rq: Vec<PublicKey>,
    pub rq_first: u32,
}

/// Request authentication (ARCHITECTURE §4, UpRight §4.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Auth {
    /// The client MACs its request for every node; each node that finds its entry valid
    /// endorses the request with its own MAC authenticator for the order nodes (a matrix
    /// signature). The primary proposes a request with `u + r + 1` endorsements valid for
    /// itself and backups accept it on `u + 1` valid for them, so a client whose MACs are
    /// valid for some nodes only cannot make correct nodes disagree (replica/endorse.rs).
    RqMac,
    /// PBFT-style: the client MACs its request for every node, each node checks its own
    /// entry in every proposed request. With `r > 0` a client whose entries disagree can
    /// stall a batch until a view change; with `r = 0` backups trust the primary's check.
    Mac,
    /// Aardvark-style: the client signs its request (Ed25519) and every node checks the
    /// same signature, so nodes cannot disagree about it; backups check a proposal's
    /// signatures as one batch, on the verify stage when there is one.
    Sig,
    /// No client authentication beyond the TLS channel (trusted clients).
    None,
}

impl Auth {
    pub const NAMES: [&'static str; 4] = ["rq-mac", "mac", "sig", "none"];

    /// The default of ARCHITECTURE §4: `rq-mac` when nodes may lie, `mac` otherwise.
    pub fn default_for(quorums: &Quorums) -> Auth {
        if quorums.byzantine() {
            Auth::RqMac
        } else {
            Auth::Mac
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Auth::RqMac => "rq-mac",
            Auth::Mac => "mac",
            Auth::Sig => "sig",
            Auth::None => "none",
        }
    }

    pub fn from_name(name: &str) -> Option<Auth> {
        match name {
            "rq-mac" => Some(Auth::RqMac),
            "mac" => Some(Auth::Mac),
            "sig" => Some(Auth::Sig),
            "none" => Some(Auth::None),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("{got} node keys for a configuration that needs {expected}")]
    NodeCount { expected: usize, got: usize },
    #[error("option {name} = {value} is invalid: {why}")]
    Option { name: &'static str, value: u64, why: &'static str },
    #[error("{got} execution nodes, but (u, r) needs at least {min} (2u + 1)")]
    ExecutionNodes { min: usize, got: usize },
    #[error("{order} order and {exec} execution nodes exceed the {max} node ids supported")]
    TooManyNodes { order: usize, exec: usize, max: usize },
    #[error("{got} request-quorum nodes, but (u, r) needs at least {min} (2u + r + 1)")]
    RqNodes { min: usize, got: usize },
    #[error("request-quorum nodes of their own need auth = rq-mac (they endorse requests for the order nodes)")]
    RqNeedsRqMac,
}

/// Endorsements of requests a node cannot check itself are held in shares of
/// `clients_max`, one per node that may be charged (replica/endorse.rs `Hearsay`): at
/// least one entry each.
fn clients_for(options: &Options, nodes: usize) -> Result<(), ConfigError> {
    if options.clients_max < nodes {
        return Err(ConfigError::Option {
            name: "clients_max",
            value: options.clients_max as u64,
            why: "fewer than the nodes that endorse requests",
        });
    }
    Ok(())
}

/// The encoded size of a prepared certificate's proof at most, with `q` signatures: view,
/// seq, digest, and (node, signature) pairs, with room for varint lengths.
fn cert_proof_bytes_max(q: u64) -> u64 {
    64 + q * 72
}

impl ClusterConfig {
    pub fn new(quorums: Quorums, node_keys: Vec<PublicKey>, options: Options) -> Result<ClusterConfig, ConfigError> {
        if node_keys.len() != quorums.order_nodes() {
            return Err(ConfigError::NodeCount { expected: quorums.order_nodes(), got: node_keys.len() });
        }
        options.validate()?;
        clients_for(&options, quorums.order_nodes())?;
        let q = quorums.order_quorum() as u64;
        if q * options.log_max() * cert_proof_bytes_max(q) > crate::codec::FRAME_MAX as u64 {
            // A NEW-VIEW holds Q view changes of up to log_max certificates each.
            return Err(ConfigError::Option {
                name: "checkpoint_interval",
                value: options.checkpoint_interval,
                why: "too large for this many nodes: a NEW-VIEW would not fit a frame",
            });
        }
        Ok(ClusterConfig {
            auth: Auth::default_for(&quorums),
            request_digests: Auth::default_for(&quorums) == Auth::RqMac,
            client_keys: BTreeMap::new(),
            membership: Membership::genesis(quorums.u(), quorums.r(), &node_keys, &[]),
            admin_key: None,
            stages: Stages::default(),
            quorums,
            node_keys,
            options,
        })
    }

    /// Sets the authentication mode; request digests follow it (on with rq-mac).
    pub fn with_auth(mut self, auth: Auth) -> ClusterConfig {
        self.auth = auth;
        self.request_digests = auth == Auth::RqMac;
        self
    }

    /// Request digests on or off; they need `auth = rq-mac` (only endorsers are known to
    /// hold a request's bytes), so with another mode this is an error.
    pub fn with_request_digests(mut self, on: bool) -> Result<ClusterConfig, ConfigError> {
        if on && self.auth != Auth::RqMac {
            return Err(ConfigError::Option { name: "request_digests", value: 1, why: "needs auth = rq-mac" });
        }
        self.request_digests = on;
        Ok(self)
    }

    /// The client public keys `auth = sig` checks requests against.
    pub fn with_client_keys(mut self, keys: BTreeMap<ClientId, PublicKey>) -> ClusterConfig {
        self.client_keys = keys;
        self
    }

    /// Administrative operations signed with `key` may change the membership.
    pub fn with_admin_key(mut self, key: PublicKey) -> ClusterConfig {
        self.admin_key = Some(key);
        self
    }

    /// Separates execution: `keys` are the execution nodes', with the stable ids after the
    /// highest given out so far (the genesis members'), which the membership then counts
    /// as given out: an administrator can never add an order node under one of them.
    ///
    /// # Errors
    /// Fewer than `2u + 1` of them, or more node ids than supported.
    pub fn with_executors(mut self, keys: Vec<PublicKey>) -> Result<ClusterConfig, ConfigError> {
        let min = self.quorums.execution_nodes_min();
        if keys.len() < min {
            return Err(ConfigError::ExecutionNodes { min, got: keys.len() });
        }
        if self.membership.highest_id as usize + 1 + keys.len() > crate::quorum::NODES_MAX {
            return Err(ConfigError::TooManyNodes { order: self.n(), exec: keys.len(), max: crate::quorum::NODES_MAX });
        }
        if self.rq_separated() {
            // RQ node ids follow the execution nodes': set those first.
            return Err(ConfigError::Option { name: "executors", value: 0, why: "must be set before the RQ nodes" });
        }
        self.stages.exec_first = self.take_ids(keys.len());
        self.stages.executors = keys;
        Ok(self)
    }

    /// The next `count` stable ids, counted as given out from now on.
    fn take_ids(&mut self, count: usize) -> u32 {
        let first = self.membership.highest_id + 1;
        self.membership.highest_id += count as u32;
        first
    }

    /// Separates the request-quorum stage: `keys` are the RQ nodes' (stable ids after the
    /// execution nodes'). Set it after the authentication mode and the executors.
    ///
    /// # Errors
    /// Fewer than `2u + r + 1` of them, an auth mode other than rq-mac, or more node ids
    /// than supported.
    pub fn with_rq_nodes(mut self, keys: Vec<PublicKey>) -> Result<ClusterConfig, ConfigError> {
        let min = self.quorums.rq_nodes_min();
        if keys.len() < min {
            return Err(ConfigError::RqNodes { min, got: keys.len() });
        }
        if self.auth != Auth::RqMac {
            return Err(ConfigError::RqNeedsRqMac);
        }
        clients_for(&self.options, self.n() + keys.len())?;
        let (order, exec) = (self.n(), self.stages.executors.len());
        if self.membership.highest_id as usize + 1 + keys.len() > crate::quorum::NODES_MAX {
            return Err(ConfigError::TooManyNodes { order, exec: exec + keys.len(), max: crate::quorum::NODES_MAX });
        }
        self.stages.rq_first = self.take_ids(keys.len());
        self.stages.rq = keys;
        Ok(self)
    }

    /// Whether execution runs on its own nodes (not on the order nodes).
    pub fn separated(&self) -> bool {
        !self.stages.executors.is_empty()
    }

    /// Whether the request-quorum stage runs on its own nodes (not on the order nodes).
    pub fn rq_separated(&self) -> bool {
        !self.stages.rq.is_empty()
    }

    /// The nodes that endorse client requests (`auth = rq-mac`): the RQ nodes when
    /// separated, the order nodes otherwise.
    pub fn endorsers(&self) -> NodeRange {
        if self.rq_separated() {
            NodeRange::new(stage_node(self.stages.rq_first), self.stages.rq.len())
        } else {
            NodeRange::first(self.n())
        }
    }

    /// The stable ids of the RQ nodes (what clients and the network call them); empty
    /// when the order nodes endorse.
    pub fn rq_ids(&self) -> std::ops::Range<u32> {
        self.stages.rq_first..self.stages.rq_first + self.stages.rq.len() as u32
    }

    /// The stable ids of the execution nodes; empty when the order nodes execute.
    pub fn exec_ids(&self) -> std::ops::Range<u32> {
        self.stages.exec_first..self.stages.exec_first + self.stages.executors.len() as u32
    }

    /// Entries of an endorsement's MAC authenticator: one per order node (by id), then,
    /// with RQ nodes of their own, one per RQ node (in order), for RQ peers that could not
    /// check the client's entry themselves (rq_node.rs).
    pub fn endorsement_width(&self) -> usize {
        self.n() + self.stages.rq.len()
    }

    /// The position of RQ node `node`'s entry in an endorsement's MAC authenticator.
    pub fn rq_entry(&self, node: NodeId) -> Option<usize> {
        let r = self.endorsers();
        r.offset(node).filter(|_| self.rq_separated()).map(|i| self.n() + i)
    }

    /// The nodes that execute and answer clients: the execution nodes when separated,
    /// the order nodes otherwise.
    pub fn executors(&self) -> NodeRange {
        if self.separated() {
            NodeRange::new(stage_node(self.stages.exec_first), self.stages.executors.len())
        } else {
            NodeRange::first(self.n())
        }
    }

    /// The execution nodes' keys, for checking their checkpoint votes and certificates.
    pub fn exec_keys(&self) -> NodeKeys {
        NodeKeys::starting_at((self.executors().start).0, &self.stages.executors)
    }

    /// Node addresses for the genesis membership (index order), which members gossip.
    pub fn with_addrs(mut self, addrs: &[String]) -> ClusterConfig {
        for (m, a) in self.membership.members.iter_mut().zip(addrs) {
            m.addr = a.clone();
        }
        self
    }

    /// The configuration of epoch `next.epoch` (a node of this cluster that restarts in a
    /// later epoch, or joins one): same options, auth
    /// and keys; quorums from the new (u, r, n) with the same deliberate bug, if any.
    ///
    /// # Errors
    /// If `next` cannot tolerate its (u, r) (the executor never produces such a one).
    pub fn next_epoch(&self, next: Membership) -> Result<ClusterConfig, QuorumError> {
        let quorums = next.quorums()?.with_mutation(self.quorums.mutation());
        Ok(ClusterConfig {
            quorums,
            node_keys: next.keys(),
            options: self.options.clone(),
            auth: self.auth,
            request_digests: self.request_digests,
            client_keys: self.client_keys.clone(),
            membership: next,
            admin_key: self.admin_key,
            stages: self.stages.clone(),
        })
    }

    pub fn epoch(&self) -> u64 {
        self.membership.epoch
    }

    pub fn n(&self) -> usize {
        self.node_keys.len()
    }

    pub fn primary(&self, view: View) -> MemberIndex {
        view.primary(self.n())
    }
}

/// Protocol knobs. Times are milliseconds of the injected clock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Options {
    /// Most requests in one value (batch).
    pub batch_count_max: usize,
    /// Most request bytes in one value.
    pub batch_bytes_max: usize,
    /// How long the primary may hold a partial batch while instances are in flight.
    pub batch_delay_ms: u64,
    /// Instances in flight at once (pipelining window W).
    pub window: u64,
    /// A checkpoint every this many instances.
    pub checkpoint_interval: u64,
    /// First expiry forwards a pending request to the primary; the second suspects it.
    pub request_timeout_ms: u64,
    /// How long a view change may take before the next view is tried (doubles each time).
    pub view_change_timeout_ms: u64,
    /// Resend our own votes for instances that have not decided after this long.
    pub retransmit_ms: u64,
    /// Period of STATUS gossip that lets lagging nodes be noticed.
    pub status_ms: u64,
    /// How far a proposal's time may be from a backup's clock (UpRight §3.1's Δ).
    pub clock_tolerance_ms: u64,
    /// Average bytes per checkpoint chunk (the Merkle leaves; content-defined, from a
    /// quarter to four times this).
    pub chunk_bytes: usize,
    /// Distinct clients whose pending requests a node tracks.
    pub clients_max: usize,
    /// Decided values sent to a lagging peer per STATUS.
    pub catch_up_values_max: u64,
    /// Threads that execute requests of a service that opts into parallel execution
    /// (CBASE, `Service::concurrent`): the protocol thread plus `exec_workers - 1` pool
    /// threads. 1 is sequential execution exactly. Per node in effect: outcomes do not
    /// depend on it, so nodes may differ.
    pub exec_workers: usize,
    /// Robust leadership (Aardvark, UpRight §4.2): the primary's throughput is measured
    /// over windows of this length while clients wait...
    pub leader_window_ms: u64,
    /// ...and a node asks to replace it after two windows in a row below this percentage
    /// of the best seen in the last few views (0: never).
    pub leader_min_pct: u64,
    /// Rotate the primary after this long in one view even if it keeps up (0: never).
    pub leader_rotate_ms: u64,
    /// State transfer: at most this many bytes per second requested from peers (0: no
    /// limit). A node-local choice (BFT-SMaRt §II-C2's throttle): it trades how soon a
    /// recovering node is back against the load it puts on the peers serving it.
    pub transfer_rate_bytes: u64,
    /// Serialize and hash checkpoints off the protocol thread, from a copy-on-write
    /// freeze of the state (`Service::freeze`; services that cannot freeze checkpoint
    /// inline regardless). Node-local: the checkpoint's bytes are the same either way.
    /// Off in production for now: on the 2-core host (four nodes sharing it) the
    /// serialization competes with the protocol tasks and a 1 GB cluster ran slower with
    /// it (DESIGN-NOTES, "Copy-on-write checkpoints"); it is for hosts with a core to
    /// spare. The simulator runs half its nodes each way.
    pub background_checkpoints: bool,
    /// Agreed-time ticks (0: off). When no request came for this long, the primary
    /// proposes an empty value at agreed time, so agreed time advances without clients;
    /// every node runs [`crate::service::Service::on_tick`] where agreed time crosses a
    /// multiple of it (session expiry, leases). Part of the cluster's configuration: every
    /// node must agree on it, as on the service.
    pub tick_ms: u64,
}

/// Most execution threads per node.
pub const EXEC_WORKERS_MAX: usize = 256;
/// Bounds of [`Options::tick_ms`]: below the floor, empty tick instances would crowd out
/// requests (each costs a consensus round); above it, a tick an hour is no clock.
pub const TICK_MS_MIN: u64 = 10;
pub const TICK_MS_MAX: u64 = 3_600_000;

impl Options {
    /// Settings for real deployments.
    pub fn production() -> Options {
        Options {
            batch_count_max: 1024,
            batch_bytes_max: 1 << 20,
            batch_delay_ms: 1,
            window: 32,
            checkpoint_interval: 256,
            request_timeout_ms: 2_000,
            view_change_timeout_ms: 4_000,
            retransmit_ms: 500,
            status_ms: 500,
            clock_tolerance_ms: 5_000,
            chunk_bytes: 64 << 10,
            clients_max: 100_000,
            catch_up_values_max: 64,
            // Sequential until measured otherwise: parallel_bench on the 2-core host ran
            // KV-sized requests (~0.6 us) at 0.41x with 4 workers (the path costs ~0.7 us
            // per request); it pays from ~10 us of work per request (1.5-1.9x).
            exec_workers: 1,
            leader_window_ms: 1_000,
            leader_min_pct: 30,
            leader_rotate_ms: 0,
            transfer_rate_bytes: 0,
            background_checkpoints: false,
            tick_ms: 0,
        }
    }

    /// Tiny bounds so the simulator hits window limits, checkpoint GC and multi-chunk
    /// state transfer in short runs.
    pub fn test_min() -> Options {
        Options {
            batch_count_max: 4,
            batch_bytes_max: 4 << 10,
            batch_delay_ms: 2,
            window: 4,
            checkpoint_interval: 8,
            request_timeout_ms: 400,
            view_change_timeout_ms: 800,
            retransmit_ms: 150,
            status_ms: 100,
            clock_tolerance_ms: 2_000,
            // The chunker's floor: simulated snapshots of a few KB still span many chunks.
            chunk_bytes: 256,
            clients_max: 64,
            catch_up_values_max: 8,
            // Sequential: the simulator's runs stay single-threaded (`keel sim
            // --exec-workers` exercises the parallel path).
            exec_workers: 1,
            leader_window_ms: 200,
            leader_min_pct: 30,
            leader_rotate_ms: 0,
            transfer_rate_bytes: 0,
            background_checkpoints: true,
            tick_ms: 0,
        }
    }

    /// Instances a node keeps above its stable checkpoint: the high-water mark.
    pub fn log_max(&self) -> u64 {
        2 * self.checkpoint_interval
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let err = |name, value: u64, why| Err(ConfigError::Option { name, value, why });
        if self.batch_count_max == 0 || self.batch_count_max > crate::codec::REQUESTS_PER_VALUE_MAX {
            return err("batch_count_max", self.batch_count_max as u64, "must be 1..=4096");
        }
        if self.window == 0 || self.window > self.checkpoint_interval {
            return err("window", self.window, "must be 1..=checkpoint_interval so a checkpoint can always complete");
        }
        if self.checkpoint_interval == 0 {
            return err("checkpoint_interval", 0, "must be positive");
        }
        if self.log_max() > crate::codec::CERTS_PER_VIEW_CHANGE_MAX as u64 {
            // A view change carries a certificate per instance of the log, which holds up
            // to twice the interval: a larger one could make view changes undeliverable.
            return err("checkpoint_interval", self.checkpoint_interval, "must be at most 2048");
        }
        if self.request_timeout_ms == 0 || self.view_change_timeout_ms == 0 {
            return err("request_timeout_ms", self.request_timeout_ms, "timeouts must be positive");
        }
        if !(crate::chunk::CHUNK_AVG_MIN..=crate::chunk::CHUNK_AVG_MAX).contains(&self.chunk_bytes) {
            return err("chunk_bytes", self.chunk_bytes as u64, "must be 256..=256 KiB (chunks reach four times it)");
        }
        if self.batch_bytes_max + 64 * 1024 > crate::codec::FRAME_MAX / 4 {
            return err("batch_bytes_max", self.batch_bytes_max as u64, "batches must fit a frame with room to spare");
        }
        if self.leader_min_pct > 100 {
            return err("leader_min_pct", self.leader_min_pct, "a percentage: 0..=100");
        }
        if self.leader_min_pct > 0 && self.leader_window_ms == 0 {
            return err("leader_window_ms", 0, "must be positive while leader_min_pct is");
        }
        if self.exec_workers == 0 || self.exec_workers > EXEC_WORKERS_MAX {
            return err("exec_workers", self.exec_workers as u64, "must be 1..=256");
        }
        if self.tick_ms > 0 && (self.tick_ms < TICK_MS_MIN || self.tick_ms > TICK_MS_MAX) {
            return err("tick_ms", self.tick_ms, "must be 0 (off) or 10..=3600000");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_are_valid() {
        assert_eq!(Options::production().validate(), Ok(()));
        assert_eq!(Options::test_min().validate(), Ok(()));
    }

    #[test]
    fn checkpoint_intervals_whose_view_changes_would_not_fit_are_rejected() {
        let with = |interval| Options { checkpoint_interval: interval, ..Options::production() };
        assert!(with(2048).validate().is_ok());
        assert!(with(2049).validate().is_err(), "more certificates than a view change may carry");
        let keys = |n| vec![PublicKey([0; 32]); n];
        let q = |u, r| Quorums::new(u, r).expect("quorums");
        assert!(ClusterConfig::new(q(1, 1), keys(4), with(2048)).is_ok());
        // At (4, 3), n = 12 and Q = 8: a NEW-VIEW of 8 view changes of up to 4096
        // certificates with 8 signatures each may exceed 16 MiB.
        assert!(ClusterConfig::new(q(4, 3), keys(12), with(2048)).is_err());
        assert!(ClusterConfig::new(q(4, 3), keys(12), with(256)).is_ok());
    }

    #[test]
    fn window_larger_than_checkpoint_interval_is_rejected() {
        let o = Options { window: 9, ..Options::test_min() };
        assert!(matches!(o.validate(), Err(ConfigError::Option { name: "window", value: 9, .. })));
    }
}
