//! The configuration files a node and a client load: their formats, their checks, and
//! what they load into. Writing them (`keel init`, nodes added) is [`crate::provision`]'s.
//!
//! ```text
//!   DIR/cluster.toml        u, r, every node's address and public key (identical everywhere)
//!   DIR/ca.pem, ca.key      the cluster CA (the key stays with the administrator)
//!   DIR/node-<i>/node.toml  per-node options; node.pem/.key (TLS); secrets.toml; data/
//!   DIR/client-<id>/client.toml, client.pem/.key (TLS), MAC keys inside client.toml
//! ```

use crate::storage::FsyncPolicy;
use crate::tls::{Credentials, TlsError};
use keel_core::config::{Auth, ClusterConfig, ConfigError, Options};
use keel_core::crypto::{MacKey, PublicKey, SigningKey};
use keel_core::membership::Membership;
use keel_core::message::{ClientId, NodeId};
use keel_core::quorum::{QuorumError, Quorums};
use keel_core::replica::NodeSecrets;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum ConfigFileError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{0}")]
    Quorum(#[from] QuorumError),
    #[error("{0}")]
    Config(#[from] ConfigError),
    #[error("{0}")]
    Tls(#[from] TlsError),
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

pub(crate) fn read(path: &Path) -> Result<String, ConfigFileError> {
    fs::read_to_string(path).map_err(|source| ConfigFileError::Io { path: path.to_path_buf(), source })
}

pub(crate) fn write(path: &Path, text: &str) -> Result<(), ConfigFileError> {
    fs::write(path, text).map_err(|source| ConfigFileError::Io { path: path.to_path_buf(), source })
}

/// Writes a file only its owner may read (0600): private keys, and the node and client
/// files that hold signing seeds and MAC keys. Created so from the start, never world-
/// readable in between.
///
/// # Errors
/// The file cannot be written.
pub fn write_secret(path: &Path, text: impl AsRef<[u8]>) -> Result<(), ConfigFileError> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let io = |source| ConfigFileError::Io { path: path.to_path_buf(), source };
    let mut f = fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(path).map_err(io)?;
    // An existing file keeps its mode when opened: set it.
    use std::os::unix::fs::PermissionsExt as _;
    f.set_permissions(fs::Permissions::from_mode(0o600)).map_err(io)?;
    f.write_all(text.as_ref()).map_err(io)
}

pub(crate) fn parse<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T, ConfigFileError> {
    toml::from_str(&read(path)?)
        .map_err(|e| ConfigFileError::Parse { path: path.to_path_buf(), message: e.to_string() })
}

pub(crate) fn hex32(path: &Path, field: &str, s: &str) -> Result<[u8; 32], ConfigFileError> {
    let bytes =
        hex::decode(s).map_err(|e| ConfigFileError::Invalid { path: path.into(), message: format!("{field}: {e}") })?;
    bytes
        .try_into()
        .map_err(|_| ConfigFileError::Invalid { path: path.into(), message: format!("{field}: expected 32 bytes") })
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeEntry {
    pub id: NodeId,
    pub addr: SocketAddr,
    /// Ed25519 public key, hex.
    pub public_key: String,
}

/// What every node and client of one cluster shares.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterFile {
    pub u: u32,
    pub r: u32,
    pub nodes: Vec<NodeEntry>,
    /// Robust leadership; every node of a cluster must use the same values.
    #[serde(default, skip_serializing_if = "LeadershipFile::is_empty")]
    pub leadership: LeadershipFile,
    /// Request authentication: rq-mac | mac | none (ARCHITECTURE §4). Unset: rq-mac when
    /// r > 0, mac otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<String>,
    /// `auth = rq-mac`: propose operations over 64 bytes by digest, their bytes fetched
    /// from the nodes that endorsed them (UpRight §4.1). Unset: on with rq-mac.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_digests: Option<bool>,
    /// Each client identity's Ed25519 public key, hex, by id (checked with auth = sig).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub client_keys: BTreeMap<String, String>,
    /// The administrator's Ed25519 public key, hex: membership changes must be signed
    /// with it (`keel admin`). Unset: the membership cannot change.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admin_key: Option<String>,
    /// A checkpoint every this many instances (unset: 256). Every node of a cluster must
    /// use the same value. Each checkpoint serializes, hashes and writes the whole state,
    /// so clusters with large states checkpoint less often; the log above the stable
    /// checkpoint holds up to twice this many instances.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_interval: Option<u64>,
    /// Agreed-time ticks every this many ms (unset or 0: none): the service's `on_tick`
    /// runs at agreed time even when no client sends anything (session expiry, leases),
    /// and an idle primary proposes an empty instance to keep time going. Every node of a
    /// cluster must use the same value; `keel init` writes the service's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tick_ms: Option<u64>,
    /// Stage placement (ARCHITECTURE §2, UpRight §4.2): empty (the default), every node
    /// in `nodes` orders and executes; otherwise these nodes execute and the others only
    /// order (their ids follow the order nodes', in order). At least u + r + 1. Membership
    /// changes move order nodes only; execution nodes follow them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub executors: Vec<NodeEntry>,
    /// Stage placement (ARCHITECTURE §2, UpRight §4.1): empty (the default), the order
    /// nodes endorse client requests; otherwise these nodes are the request quorum (ids
    /// after the execution nodes', in order). At least 2u + r + 1; needs auth = rq-mac.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rq_nodes: Vec<NodeEntry>,
    /// The service's own settings, which every node must share (a block store's size and
    /// block size, say): given to the service as they are; `keel init` writes them.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub service_options: BTreeMap<String, String>,
    /// The service state the cluster started from instead of an empty one (`keel init
    /// --restore`, from a `keel admin backup`). Unset: an empty service.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub genesis: Option<GenesisFile>,
}

/// `[genesis]` in cluster.toml: a file beside it holding the service's state, and the
/// state's digest. Every node must start from the same bytes (their checkpoints would
/// disagree otherwise): a node whose copy does not match refuses to start.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GenesisFile {
    /// The file, relative to cluster.toml's directory.
    pub file: String,
    /// [`genesis_digest`] of its bytes, hex.
    pub digest: String,
    /// Where the state came from (the backup's cluster and instance), for the operator.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub origin: String,
}

/// The file `keel init --restore` writes the service state to, beside cluster.toml.
pub const GENESIS_STATE_FILE: &str = "genesis.state";

/// The digest `[genesis]` records of a genesis state.
pub fn genesis_digest(state: &[u8]) -> keel_core::crypto::Digest {
    keel_core::crypto::Hasher::new("keel/genesis-state").bytes(state).finish()
}

impl ClusterFile {
    /// Where the genesis state `[genesis]` names is (cluster.toml at `path`), and its
    /// digest; None for an empty one. Nothing is read yet: tools that load every node's
    /// files (`keel status`) need not read and hash a state of many MB each time.
    ///
    /// # Errors
    /// The digest is not 64 hex digits.
    pub fn genesis_state(&self, path: &Path) -> Result<Option<GenesisState>, ConfigFileError> {
        let Some(g) = &self.genesis else { return Ok(None) };
        let file = path.parent().unwrap_or(Path::new(".")).join(&g.file);
        Ok(Some(GenesisState { file, digest: hex32(path, "genesis.digest", &g.digest)? }))
    }
}

/// A genesis state on disk ([`ClusterFile::genesis_state`]), read by [`GenesisState::load`].
#[derive(Clone, Debug)]
pub struct GenesisState {
    pub file: PathBuf,
    digest: [u8; 32],
}

impl GenesisState {
    /// The state's bytes, checked against the digest cluster.toml records.
    ///
    /// # Errors
    /// The file is missing or does not match the digest.
    pub fn load(&self) -> Result<Arc<[u8]>, ConfigFileError> {
        let bytes = fs::read(&self.file).map_err(|source| ConfigFileError::Io { path: self.file.clone(), source })?;
        if genesis_digest(&bytes).0 != self.digest {
            return Err(ConfigFileError::Invalid {
                path: self.file.clone(),
                message: "does not match [genesis] digest in cluster.toml: every node must start from the same state"
                    .into(),
            });
        }
        Ok(bytes.into())
    }
}

/// `[leadership]` in cluster.toml (Aardvark, UpRight §4.2). Unset fields keep the
/// production defaults (`Options::production`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeadershipFile {
    /// Replace a primary after two windows below this percentage of the best window of
    /// the last few views (0: never).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_pct: Option<u64>,
    /// Length of a throughput window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window_ms: Option<u64>,
    /// Rotate the primary after this long in one view (0: never).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rotate_ms: Option<u64>,
}

impl LeadershipFile {
    pub fn is_empty(&self) -> bool {
        *self == LeadershipFile::default()
    }
}

impl ClusterFile {
    pub fn load(path: &Path) -> Result<ClusterFile, ConfigFileError> {
        parse(path)
    }

    /// The request authentication this cluster uses.
    pub fn auth(&self, path: &Path) -> Result<Auth, ConfigFileError> {
        let quorums = Quorums::new(self.u, self.r)?;
        match &self.auth {
            None => Ok(Auth::default_for(&quorums)),
            Some(name) => Auth::from_name(name).ok_or_else(|| ConfigFileError::Invalid {
                path: path.into(),
                message: format!("auth must be one of {}, not {name:?}", Auth::NAMES.join(", ")),
            }),
        }
    }

    /// The protocol configuration; node ids must be 0..N in order.
    pub fn cluster_config(&self, path: &Path, mut options: Options) -> Result<ClusterConfig, ConfigFileError> {
        let l = &self.leadership;
        options.leader_min_pct = l.min_pct.unwrap_or(options.leader_min_pct);
        options.leader_window_ms = l.window_ms.unwrap_or(options.leader_window_ms);
        options.leader_rotate_ms = l.rotate_ms.unwrap_or(options.leader_rotate_ms);
        options.checkpoint_interval = self.checkpoint_interval.unwrap_or(options.checkpoint_interval);
        options.tick_ms = self.tick_ms.unwrap_or(options.tick_ms);
        let quorums = Quorums::new(self.u, self.r)?;
        let mut keys = Vec::with_capacity(self.nodes.len());
        for (i, n) in self.nodes.iter().enumerate() {
            if n.id.0 as usize != i {
                return Err(ConfigFileError::Invalid {
                    path: path.into(),
                    message: format!("node ids must be 0..N in order; entry {i} has id {}", n.id),
                });
            }
            keys.push(PublicKey(hex32(path, "public_key", &n.public_key)?));
        }
        let auth = self.auth(path)?;
        let mut client_keys = BTreeMap::new();
        for (id, key) in &self.client_keys {
            let id: ClientId = id.parse().map_err(|_| ConfigFileError::Invalid {
                path: path.into(),
                message: format!("client_keys: {id:?} is not a client id"),
            })?;
            client_keys.insert(id, PublicKey(hex32(path, "client_keys", key)?));
        }
        if auth == Auth::Sig && client_keys.is_empty() {
            return Err(ConfigFileError::Invalid {
                path: path.into(),
                message: "auth = sig needs [client_keys]; `keel init` writes them".into(),
            });
        }
        let addrs: Vec<String> = self.nodes.iter().map(|n| n.addr.to_string()).collect();
        let mut cfg = ClusterConfig::new(quorums, keys, options)?
            .with_auth(auth)
            .with_client_keys(client_keys)
            .with_addrs(&addrs);
        if let Some(on) = self.request_digests {
            cfg = cfg.with_request_digests(on)?;
        }
        if let Some(key) = &self.admin_key {
            cfg = cfg.with_admin_key(PublicKey(hex32(path, "admin_key", key)?));
        }
        if !self.executors.is_empty() {
            let mut keys = Vec::with_capacity(self.executors.len());
            for (i, e) in self.executors.iter().enumerate() {
                let want = NodeId((self.nodes.len() + i) as u32);
                if e.id != want {
                    return Err(ConfigFileError::Invalid {
                        path: path.into(),
                        message: format!("executor ids must follow the order nodes' ({want}, ...); found {}", e.id),
                    });
                }
                keys.push(PublicKey(hex32(path, "executors.public_key", &e.public_key)?));
            }
            cfg = cfg.with_executors(keys)?;
        }
        if !self.rq_nodes.is_empty() {
            let mut keys = Vec::with_capacity(self.rq_nodes.len());
            for (i, q) in self.rq_nodes.iter().enumerate() {
                let want = NodeId((self.nodes.len() + self.executors.len() + i) as u32);
                if q.id != want {
                    return Err(ConfigFileError::Invalid {
                        path: path.into(),
                        message: format!(
                            "RQ node ids must follow the order and execution nodes' ({want}, ...); found {}",
                            q.id
                        ),
                    });
                }
                keys.push(PublicKey(hex32(path, "rq_nodes.public_key", &q.public_key)?));
            }
            cfg = cfg.with_rq_nodes(keys)?;
        }
        Ok(cfg)
    }

    /// The execution nodes' ids and addresses (empty: co-located).
    pub fn executor_addrs(&self) -> Vec<(NodeId, SocketAddr)> {
        self.executors.iter().map(|e| (e.id, e.addr)).collect()
    }

    /// The RQ nodes' ids and addresses (empty: the order nodes endorse).
    pub fn rq_addrs(&self) -> Vec<(NodeId, SocketAddr)> {
        self.rq_nodes.iter().map(|q| (q.id, q.addr)).collect()
    }
}

/// Where `keel admin add-node` leaves the membership a new node joins (beside its
/// node.toml): the epoch the admin's change started, from the cluster's reply.
pub const JOIN_FILE: &str = "membership.toml";

/// The membership in a node directory's join file, if it has one.
pub fn load_join_file(node_dir: &Path) -> Result<Option<Membership>, ConfigFileError> {
    let path = node_dir.join(JOIN_FILE);
    if !path.exists() {
        return Ok(None);
    }
    parse(&path).map(Some)
}

/// Writes a join file.
pub fn write_join_file(node_dir: &Path, membership: &Membership) -> Result<(), ConfigFileError> {
    let text = toml::to_string(membership)
        .map_err(|e| ConfigFileError::Invalid { path: node_dir.into(), message: format!("membership: {e}") })?;
    write(&node_dir.join(JOIN_FILE), &text)
}

/// One node's own file.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeFile {
    pub id: NodeId,
    pub listen: SocketAddr,
    /// HTTP address of /metrics and /status.
    pub metrics: SocketAddr,
    /// The replicated service: kv | null (the microbenchmark service).
    #[serde(default = "default_service")]
    pub service: String,
    /// batch | always | never
    pub fsync: String,
    /// Runtime worker threads; 0 (the default) runs every task on the main thread
    /// (the WAL thread is separate either way). With several nodes and clients sharing
    /// a few cores, one thread per node means fewer cross-thread wake-ups: on a 2-core
    /// host it cut single-client p50 from ~1.1-1.3 ms to ~1.0 ms (fsync never).
    #[serde(default)]
    pub threads: usize,
    /// Threads of the verify stage, which checks the signatures of peers' WRITE and
    /// checkpoint votes before the protocol task (one thread per peer connection, so
    /// each peer's messages keep their order). 0 (the default): the protocol task checks
    /// them itself. On the 2-core host, with four nodes and the load generator sharing
    /// it, one stage thread per node cost ~4% (BFT 0/0 at 32x32: 55.4k and 53.7k ops/s
    /// without, 52.3k and 51.7k with); it is for hosts with cores to spare.
    #[serde(default)]
    pub verify_threads: usize,
    /// State transfer throttle: KiB per second this node asks its peers for while it
    /// catches up (0, the default: no limit).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub transfer_rate_kib: u64,
    /// Serialize and hash checkpoints on a thread of their own, from a copy-on-write
    /// freeze of the state, instead of on the protocol task (`Options::
    /// background_checkpoints`; off by default).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub background_checkpoints: bool,
    /// Paths relative to the node file's directory.
    pub data_dir: PathBuf,
    pub cluster: PathBuf,
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Ed25519 signing seed, hex.
    pub signing_seed: String,
    /// Root of the per-client MAC keys, hex.
    pub mac_secret: String,
    /// Fault injection for tests; never set in a deployment.
    #[serde(default, skip_serializing_if = "FaultsFile::is_empty")]
    pub faults: FaultsFile,
    /// The service's own client port on this node (coord's ZooKeeper port).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub front_end: Option<FrontEndFile>,
}

/// `[front_end]` in node.toml: a port the service answers its own protocol on, and the
/// client identity it reaches the cluster with (a directory of its own: two front ends
/// sharing an identity would reuse each other's sequence numbers).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FrontEndFile {
    pub listen: SocketAddr,
    /// The front end's client file, relative to the node file's directory.
    pub client: PathBuf,
    /// Settings of the service's front end, which it checks (coord: `reads = "local"`
    /// or `"quorum"`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub options: BTreeMap<String, String>,
}

/// A node's front end, loaded: where it listens and who it is to the cluster.
#[derive(Clone)]
pub struct FrontEndSetup {
    pub listen: SocketAddr,
    pub client: ClientSetup,
    pub options: BTreeMap<String, String>,
    /// The node file's directory, which paths among `options` are relative to.
    pub dir: PathBuf,
}

/// `[faults]` in node.toml: makes this node misbehave in ways a test needs and a
/// correct node never does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultsFile {
    /// While primary, send every PROPOSE this late (a slow primary that stays within
    /// the request timers)...
    #[serde(default)]
    pub slow_propose_ms: u64,
    /// ...starting this long after the node started.
    #[serde(default)]
    pub slow_after_ms: u64,
    /// This long after the node started, it loses one request from its state (executes
    /// it as if it were not there): a silently corrupted state, which the next checkpoint
    /// must reveal and state transfer repair (0: never). For tests.
    #[serde(default)]
    pub lose_request_after_ms: u64,
}

impl FaultsFile {
    pub fn is_empty(&self) -> bool {
        *self == FaultsFile::default()
    }
}

/// Most verify-stage threads a node file may ask for.
pub const VERIFY_THREADS_MAX: usize = 64;

/// Everything a node process needs, loaded and checked.
#[derive(Clone)]
pub struct NodeSetup {
    pub id: NodeId,
    pub listen: SocketAddr,
    pub metrics: SocketAddr,
    pub service: String,
    pub fsync: FsyncPolicy,
    pub threads: usize,
    pub verify_threads: usize,
    pub faults: FaultsFile,
    pub data_dir: PathBuf,
    /// Epoch 0's configuration (cluster.toml).
    pub cluster: ClusterConfig,
    /// The membership a node added later joins (its join file); `None` for the nodes
    /// `keel init` created.
    pub joined: Option<Membership>,
    pub ca_pem: String,
    pub credentials: Credentials,
    pub secrets: NodeSecrets,
    /// Separated execution: every execution node's id and address (empty: co-located).
    pub executors: Vec<(NodeId, SocketAddr)>,
    /// A separate RQ stage: every RQ node's id and address (empty: the order nodes).
    pub rq_nodes: Vec<(NodeId, SocketAddr)>,
    /// The operator said this node lost its disk (`keel node --rejoin`): a data
    /// directory that `keel init` did not provision is then rejoined from; without it,
    /// such a directory is refused (it may be a typo in `data_dir`, or a mount missing).
    pub rejoin: bool,
    /// The service's own client port and identity (`[front_end]`), if it has one.
    pub front_end: Option<FrontEndSetup>,
    /// cluster.toml's `[service_options]`: settings every node of the service shares.
    pub service_options: BTreeMap<String, String>,
    /// The state the service starts from (cluster.toml's `[genesis]`, read and checked
    /// against its digest when the node starts); None: an empty service.
    pub genesis: Option<GenesisState>,
}

impl NodeSetup {
    /// Whether this node is an execution node of a separated cluster.
    pub fn executes_only(&self) -> bool {
        self.cluster.exec_ids().contains(&self.id.0)
    }

    /// Whether this node is an RQ node of a separate RQ stage.
    pub fn rq_only(&self) -> bool {
        self.cluster.rq_ids().contains(&self.id.0)
    }
}

impl NodeFile {
    /// Rewrites the node file at `path` with `edit` applied (still 0600): for provisioning
    /// that a service adds after `keel init` (the block service's NBD TLS files).
    ///
    /// # Errors
    /// The file cannot be read, parsed or written.
    pub fn edit(path: &Path, edit: impl FnOnce(&mut NodeFile)) -> Result<(), ConfigFileError> {
        let mut f = NodeFile::read(path)?;
        edit(&mut f);
        write_secret(path, toml::to_string(&f).unwrap_or_default())
    }

    /// The node file at `path` as written, nothing it names loaded ([`NodeFile::load`]).
    ///
    /// # Errors
    /// The file cannot be read or parsed.
    pub fn read(path: &Path) -> Result<NodeFile, ConfigFileError> {
        parse(path)
    }

    pub fn load(path: &Path) -> Result<NodeSetup, ConfigFileError> {
        let f: NodeFile = parse(path)?;
        let base = path.parent().unwrap_or(Path::new("."));
        let cluster_path = base.join(&f.cluster);
        let cluster_file = ClusterFile::load(&cluster_path)?;
        let options = Options {
            transfer_rate_bytes: f.transfer_rate_kib.saturating_mul(1024),
            background_checkpoints: f.background_checkpoints,
            ..Options::production()
        };
        let cluster = cluster_file.cluster_config(&cluster_path, options)?;
        let fsync = FsyncPolicy::parse(&f.fsync).ok_or_else(|| ConfigFileError::Invalid {
            path: path.into(),
            message: format!("fsync must be batch, always or never, not {:?}", f.fsync),
        })?;
        if f.verify_threads > VERIFY_THREADS_MAX {
            return Err(ConfigFileError::Invalid {
                path: path.into(),
                message: format!("verify_threads is at most {VERIFY_THREADS_MAX}, not {}", f.verify_threads),
            });
        }
        let joined = load_join_file(base)?;
        let secrets = NodeSecrets::new(
            SigningKey::from_seed(hex32(path, "signing_seed", &f.signing_seed)?),
            hex32(path, "mac_secret", &f.mac_secret)?,
        );
        let membership = joined.as_ref().unwrap_or(&cluster.membership);
        let (executors, rq_nodes) = (cluster.exec_ids(), cluster.rq_ids());
        let listed = if executors.contains(&f.id.0) {
            cluster.stages.executors.get((f.id.0 - executors.start) as usize).copied()
        } else if rq_nodes.contains(&f.id.0) {
            cluster.stages.rq.get((f.id.0 - rq_nodes.start) as usize).copied()
        } else {
            membership.index_of(f.id).map(|i| membership.members[i.index()].key)
        };
        if listed != Some(secrets.signing.public()) {
            return Err(ConfigFileError::Invalid {
                path: path.into(),
                message: format!("signing key does not match node {} in the cluster (or join) file", f.id),
            });
        }
        let front_end = match &f.front_end {
            Some(fe) => Some(FrontEndSetup {
                listen: fe.listen,
                client: ClientFile::load(&base.join(&fe.client))?,
                options: fe.options.clone(),
                dir: base.to_path_buf(),
            }),
            None => None,
        };
        Ok(NodeSetup {
            front_end,
            id: f.id,
            listen: f.listen,
            metrics: f.metrics,
            service: f.service,
            fsync,
            threads: f.threads,
            verify_threads: f.verify_threads,
            faults: f.faults,
            data_dir: base.join(&f.data_dir),
            cluster,
            joined,
            ca_pem: read(&base.join(&f.ca))?,
            credentials: Credentials { cert_pem: read(&base.join(&f.cert))?, key_pem: read(&base.join(&f.key))? },
            secrets,
            executors: cluster_file.executor_addrs(),
            rq_nodes: cluster_file.rq_addrs(),
            rejoin: false,
            service_options: cluster_file.service_options.clone(),
            genesis: cluster_file.genesis_state(&cluster_path)?,
        })
    }
}

/// A client's file.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientFile {
    pub id: ClientId,
    pub cluster: PathBuf,
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
    /// The MAC key shared with each node, hex, by node id.
    pub mac_keys: Vec<String>,
    /// Ed25519 signing seed, hex (auth = sig).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signing_seed: Option<String>,
}

#[derive(Clone)]
pub struct ClientSetup {
    pub id: ClientId,
    pub quorums: Quorums,
    /// Epoch 0's membership (with the node keys the client checks epoch certificates
    /// against, and the addresses it connects to).
    pub membership: Membership,
    pub auth: Auth,
    pub ca_pem: String,
    pub credentials: Credentials,
    pub mac_keys: Vec<MacKey>,
    pub signing: Option<SigningKey>,
    /// How long an operation waits for its result before the client retransmits it to
    /// every node, or orders a read-only operation that got no matching answers.
    pub retransmit_ms: u64,
    /// Separated execution: the execution nodes' ids and addresses, which answer (empty:
    /// the order nodes answer).
    pub executors: Vec<(NodeId, SocketAddr)>,
    /// A separate RQ stage: the RQ nodes' ids and addresses, which take requests (empty:
    /// the order nodes take them).
    pub rq_nodes: Vec<(NodeId, SocketAddr)>,
    /// Where the client keeps the epoch certificates it followed (the cluster file's
    /// directory), so the next process using it starts in the newest epoch; None: kept
    /// nowhere.
    pub epochs_dir: Option<PathBuf>,
}

/// [`ClientSetup::retransmit_ms`] unless the application sets another.
pub const CLIENT_RETRANSMIT_MS: u64 = 500;

impl ClientFile {
    pub fn load(path: &Path) -> Result<ClientSetup, ConfigFileError> {
        let f: ClientFile = parse(path)?;
        let base = path.parent().unwrap_or(Path::new("."));
        let cluster_path = base.join(&f.cluster);
        let cluster = ClusterFile::load(&cluster_path)?;
        let quorums = Quorums::new(cluster.u, cluster.r)?;
        let membership = cluster.cluster_config(&cluster_path, Options::production())?.membership;
        if f.mac_keys.len() < cluster.nodes.len() {
            return Err(ConfigFileError::Invalid { path: path.into(), message: "one MAC key per node".into() });
        }
        let mac_keys = f.mac_keys.iter().map(|k| hex32(path, "mac_keys", k).map(MacKey)).collect::<Result<_, _>>()?;
        let signing = match &f.signing_seed {
            Some(seed) => Some(SigningKey::from_seed(hex32(path, "signing_seed", seed)?)),
            None => None,
        };
        let auth = cluster.auth(&cluster_path)?;
        if auth == Auth::Sig && signing.is_none() {
            return Err(ConfigFileError::Invalid {
                path: path.into(),
                message: "auth = sig needs signing_seed; `keel init` writes it".into(),
            });
        }
        Ok(ClientSetup {
            id: f.id,
            quorums,
            membership,
            auth,
            ca_pem: read(&base.join(&f.ca))?,
            credentials: Credentials { cert_pem: read(&base.join(&f.cert))?, key_pem: read(&base.join(&f.key))? },
            mac_keys,
            signing,
            retransmit_ms: CLIENT_RETRANSMIT_MS,
            executors: cluster.executor_addrs(),
            rq_nodes: cluster.rq_addrs(),
            epochs_dir: cluster_path.parent().map(Path::to_path_buf),
        })
    }
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

fn default_service() -> String {
    "kv".into()
}

pub fn first_client_id() -> ClientId {
    ClientId(1000)
}
