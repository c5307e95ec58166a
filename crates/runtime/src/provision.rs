//! Provisioning: `keel init`, which writes a whole local cluster's worth of the files
//! [`crate::config`] loads, and what `keel admin` writes later (nodes added, host bundles,
//! the administrator's client identity). It lives in the runtime, not the CLI, because
//! embedding programs and tests provision clusters too (`keel::NodeBuilder`,
//! `InitOptions::local`).
//!
//! ```text
//!   DIR/cluster.toml        u, r, every node's address and public key (identical everywhere)
//!   DIR/ca.pem, ca.key      the cluster CA (the key stays with the administrator)
//!   DIR/node-<i>/node.toml  per-node options; node.pem/.key (TLS); secrets.toml; data/
//!   DIR/client-<id>/client.toml, client.pem/.key (TLS), MAC keys inside client.toml
//! ```

use crate::config::*;
use crate::storage::FsyncPolicy;
use crate::tls::{generate_ca, issue, Credentials, PeerId};
use keel_core::config::{Auth, ClusterConfig, Options};
use keel_core::crypto::{MacKey, PublicKey, SigningKey};
use keel_core::ids::NodeRange;
use keel_core::message::{ClientId, NodeId};
use keel_core::quorum::Quorums;
use keel_core::replica::client_mac_key;
use std::collections::BTreeMap;
use std::fs;
use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};

/// The administrator's signing seed (hex) in a `keel init` directory.
pub const ADMIN_KEY_FILE: &str = "admin.key";

/// What `keel init` writes.
pub struct InitOptions {
    pub service: String,
    pub u: u32,
    pub r: u32,
    pub host: String,
    /// One IP address per node (order nodes, then execution and RQ nodes), for nodes on
    /// different machines: node i listens on `hosts[i]`. Empty: every node on `host`.
    /// With it, `init` also writes a bundle per host (`hosts/<ip>/`: what that machine
    /// needs, and nothing secret of the others).
    pub hosts: Vec<String>,
    pub base_port: u16,
    pub clients: usize,
    pub fsync: FsyncPolicy,
    /// Written into cluster.toml when set; unset leaves the default for (u, r).
    pub auth: Option<Auth>,
    /// Written into cluster.toml when set; unset leaves the default (256).
    pub checkpoint_interval: Option<u64>,
    /// Agreed-time ticks (ms; written into cluster.toml when set, 0 or unset: none).
    pub tick_ms: Option<u64>,
    /// Written into cluster.toml when set; unset leaves the default (on with rq-mac).
    pub request_digests: Option<bool>,
    /// Separated execution: 2u + 1 execution nodes besides the 2u + r + 1 order
    /// nodes (node ids after theirs), and no administrator key.
    pub separated: bool,
    /// A separate RQ stage: 2u + r + 1 RQ nodes (ids after the execution nodes'),
    /// auth = rq-mac, and no administrator key.
    pub rq_separated: bool,
    /// A front end on every node that executes: its port (after every node's listen
    /// and metrics ports) and a client identity of its own (`node-N/front-end/`).
    pub front_ends: bool,
    /// Written into cluster.toml's `[service_options]` (settings of the service itself).
    pub service_options: BTreeMap<String, String>,
    /// The service state the cluster starts from and where it came from (`keel init
    /// --restore`: the service's bytes from a backup), written beside cluster.toml;
    /// None: an empty service.
    pub genesis: Option<(Vec<u8>, String)>,
}

impl InitOptions {
    /// A cluster of `service` on this machine (127.0.0.1, ports free now), as a test or
    /// an embedding program wants it: one client identity per node and one more, fsync
    /// batch, every other setting the default. Set fields on the result for the rest.
    ///
    /// # Errors
    /// Invalid (u, r), or no free port range.
    pub fn local(service: &str, u: u32, r: u32) -> Result<InitOptions, ConfigFileError> {
        let n = Quorums::new(u, r)?.order_nodes();
        // Room for a front end per node, whether or not the caller asks for them.
        let base_port = free_ports(3 * n).ok_or_else(|| ConfigFileError::Invalid {
            path: PathBuf::from("127.0.0.1"),
            message: format!("no {} consecutive free ports", 3 * n),
        })?;
        Ok(InitOptions {
            service: service.into(),
            u,
            r,
            host: "127.0.0.1".into(),
            hosts: Vec::new(),
            base_port,
            clients: n + 1,
            fsync: FsyncPolicy::Batch,
            auth: None,
            checkpoint_interval: None,
            tick_ms: None,
            request_digests: None,
            separated: false,
            rq_separated: false,
            front_ends: false,
            service_options: BTreeMap::new(),
            genesis: None,
        })
    }
}

/// A run of `n` consecutive ports that are free right now, below Linux's default
/// ephemeral range (32768-60999): a port there that is free at `keel init` may be taken by
/// any outgoing connection before the node binds it (a test once lost an added node's
/// port 32978 that way). Successive calls in one process start elsewhere, so clusters
/// provisioned one after the other before any of them binds get different ranges.
pub fn free_ports(n: usize) -> Option<u16> {
    const LOW: u64 = 20_000;
    const SPAN: u64 = 12_000;
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let start = (std::process::id() as u64 * 7919 + n as u64 + call * 1009) % SPAN;
    for k in 0..200u64 {
        let base = (LOW + (start + k * 97) % SPAN) as u16;
        if base as usize + n > 32_768 {
            continue;
        }
        if (0..n as u16).all(|i| TcpListener::bind((Ipv4Addr::LOCALHOST, base + i)).is_ok()) {
            return Some(base);
        }
    }
    None
}

/// Writes configs, keys and certificates for a local cluster into `dir`.
pub fn init(dir: &Path, o: &InitOptions) -> Result<(), ConfigFileError> {
    let quorums = Quorums::new(o.u, o.r)?;
    let n = quorums.order_nodes();
    // Execution nodes (separated): ids n..n + e, after the order nodes'.
    let e = if o.separated { quorums.execution_nodes_min() } else { 0 };
    // RQ nodes (a separate RQ stage): after the execution nodes'.
    let q = if o.rq_separated { quorums.rq_nodes_min() } else { 0 };
    let total = n + e + q;
    let auth = match (o.auth, o.rq_separated) {
        (None, true) => Some(Auth::RqMac),
        (auth, _) => auth,
    };
    // The checks a node applies when it loads the cluster file, before anything is
    // written (keys do not matter to them).
    let options = Options {
        checkpoint_interval: o.checkpoint_interval.unwrap_or(Options::production().checkpoint_interval),
        tick_ms: o.tick_ms.unwrap_or_default(),
        ..Options::production()
    };
    let checked = ClusterConfig::new(quorums, vec![PublicKey([0; 32]); n], options)?
        .with_auth(auth.unwrap_or(Auth::default_for(&quorums)));
    let checked = match o.request_digests {
        Some(on) => checked.with_request_digests(on)?,
        None => checked,
    };
    let checked = if o.separated { checked.with_executors(vec![PublicKey([0; 32]); e])? } else { checked };
    if o.rq_separated {
        checked.with_rq_nodes(vec![PublicKey([0; 32]); q])?;
    }
    // Every node's port and metrics port, checked before anything is written.
    let per_node = if o.front_ends { 3 } else { 2 };
    if o.base_port == 0 || o.base_port as usize + per_node * total > u16::MAX as usize + 1 {
        return Err(ConfigFileError::Invalid {
            path: dir.into(),
            message: format!(
                "base port {}: {total} nodes need {} ports (each node's, its metrics port{}), 1..=65535",
                o.base_port,
                per_node * total,
                if o.front_ends { " and its front end's" } else { "" }
            ),
        });
    }
    // The nodes that execute: the order nodes, or the execution nodes when apart.
    let executing = if o.separated { n..n + e } else { 0..n };
    if !o.hosts.is_empty() && o.hosts.len() != total {
        return Err(ConfigFileError::Invalid {
            path: dir.into(),
            message: format!("{} hosts for {total} nodes: give one address per node", o.hosts.len()),
        });
    }
    let host_of = |i: usize| o.hosts.get(i).unwrap_or(&o.host).as_str();
    for h in std::iter::once(&o.host).chain(&o.hosts) {
        if h.parse::<std::net::IpAddr>().is_err() {
            return Err(ConfigFileError::Invalid {
                path: dir.into(),
                message: format!("host {h:?} is not an IP address"),
            });
        }
    }
    fs::create_dir_all(dir).map_err(|source| ConfigFileError::Io { path: dir.into(), source })?;
    let ca = generate_ca()?;
    write(&dir.join("ca.pem"), &ca.cert_pem)?;
    write_secret(&dir.join("ca.key"), &ca.key_pem)?;
    let mut seeds = Vec::new();
    let mut nodes = Vec::new();
    for i in NodeRange::first(total) {
        let seed: [u8; 32] = random_bytes();
        let mac: [u8; 32] = random_bytes();
        let key = SigningKey::from_seed(seed);
        let addr: SocketAddr = format!("{}:{}", host_of(i.0 as usize), o.base_port + i.0 as u16)
            .parse()
            .map_err(|e| ConfigFileError::Invalid { path: dir.into(), message: format!("address: {e}") })?;
        nodes.push(NodeEntry { id: i, addr, public_key: hex::encode(key.public().0) });
        seeds.push((seed, mac));
    }
    let client_seeds: Vec<(ClientId, [u8; 32])> =
        (0..o.clients).map(|c| (ClientId(first_client_id().0 + c as u64), random_bytes())).collect();
    // Front ends' identities follow the clients', one per executing node.
    let front_seeds: Vec<(ClientId, [u8; 32])> = if o.front_ends {
        executing.clone().map(|i| (ClientId(first_client_id().0 + (o.clients + i) as u64), random_bytes())).collect()
    } else {
        Vec::new()
    };
    // The administrator's key stays in DIR (like ca.key): `keel admin` signs with it.
    let admin_seed: [u8; 32] = random_bytes();
    write_secret(&dir.join(ADMIN_KEY_FILE), hex::encode(admin_seed))?;
    let rq_nodes = nodes.split_off(n + e);
    let executors = nodes.split_off(n);
    let cluster = ClusterFile {
        admin_key: Some(hex::encode(SigningKey::from_seed(admin_seed).public().0)),
        u: o.u,
        r: o.r,
        nodes: nodes.clone(),
        executors: executors.clone(),
        rq_nodes: rq_nodes.clone(),
        leadership: LeadershipFile::default(),
        auth: auth.map(|a| a.name().to_string()),
        request_digests: o.request_digests,
        checkpoint_interval: o.checkpoint_interval,
        tick_ms: o.tick_ms.filter(|&t| t > 0),
        service_options: o.service_options.clone(),
        genesis: match &o.genesis {
            Some((state, origin)) => {
                // The service's data: as private as the keys.
                write_secret(&dir.join(GENESIS_STATE_FILE), state)?;
                Some(GenesisFile {
                    file: GENESIS_STATE_FILE.into(),
                    digest: hex::encode(genesis_digest(state).0),
                    origin: origin.clone(),
                })
            }
            None => None,
        },
        client_keys: client_seeds
            .iter()
            .chain(&front_seeds)
            .map(|(id, seed)| (id.to_string(), hex::encode(SigningKey::from_seed(*seed).public().0)))
            .collect(),
    };
    write(&dir.join("cluster.toml"), &toml::to_string(&cluster).unwrap_or_default())?;
    let fsync = match o.fsync {
        FsyncPolicy::Batch => "batch",
        FsyncPolicy::Always => "always",
        FsyncPolicy::Never => "never",
    };
    let all: Vec<NodeEntry> = nodes.iter().chain(&executors).chain(&rq_nodes).cloned().collect();
    for (i, (seed, mac)) in seeds.iter().enumerate() {
        let ndir = dir.join(format!("node-{i}"));
        if i < all.len() - rq_nodes.len() {
            provision_data(&ndir)?;
        } else {
            // RQ nodes keep nothing on disk but the epoch certificates they followed.
            fs::create_dir_all(ndir.join("data"))
                .map_err(|source| ConfigFileError::Io { path: ndir.clone(), source })?;
        }
        let creds = issue(&ca, PeerId::Node(NodeId(i as u32)))?;
        write(&ndir.join("node.pem"), &creds.cert_pem)?;
        write_secret(&ndir.join("node.key"), &creds.key_pem)?;
        let metrics: SocketAddr = format!("{}:{}", host_of(i), o.base_port as usize + total + i)
            .parse()
            .map_err(|e| ConfigFileError::Invalid { path: dir.into(), message: format!("address: {e}") })?;
        let file = NodeFile {
            id: NodeId(i as u32),
            listen: all[i].addr,
            metrics,
            service: o.service.clone(),
            fsync: fsync.into(),
            threads: 0,
            verify_threads: 0,
            transfer_rate_kib: 0,
            background_checkpoints: false,
            faults: FaultsFile::default(),
            data_dir: "data".into(),
            cluster: "../cluster.toml".into(),
            ca: "../ca.pem".into(),
            cert: "node.pem".into(),
            key: "node.key".into(),
            signing_seed: hex::encode(seed),
            mac_secret: hex::encode(mac),
            front_end: match executing.contains(&i) && o.front_ends {
                true => Some(FrontEndFile {
                    listen: format!("{}:{}", host_of(i), o.base_port as usize + 2 * total + i)
                        .parse()
                        .map_err(|e| ConfigFileError::Invalid { path: dir.into(), message: format!("address: {e}") })?,
                    client: PathBuf::from("front-end").join("client.toml"),
                    options: BTreeMap::new(),
                }),
                false => None,
            },
        };
        write_secret(&ndir.join("node.toml"), toml::to_string(&file).unwrap_or_default())?;
    }
    let client_dirs = client_seeds.into_iter().map(|(id, seed)| (dir.join(format!("client-{id}")), "..", id, seed));
    let front_dirs = front_seeds
        .into_iter()
        .zip(executing)
        .map(|((id, seed), i)| (dir.join(format!("node-{i}")).join("front-end"), "../..", id, seed));
    for (cdir, up, id, seed) in client_dirs.chain(front_dirs) {
        fs::create_dir_all(&cdir).map_err(|source| ConfigFileError::Io { path: cdir.clone(), source })?;
        let creds = issue(&ca, PeerId::Client(id))?;
        write(&cdir.join("client.pem"), &creds.cert_pem)?;
        write_secret(&cdir.join("client.key"), &creds.key_pem)?;
        let file = ClientFile {
            id,
            cluster: Path::new(up).join("cluster.toml"),
            ca: Path::new(up).join("ca.pem"),
            cert: "client.pem".into(),
            key: "client.key".into(),
            mac_keys: seeds.iter().map(|(_, mac)| hex::encode(client_mac_key(mac, id).0)).collect(),
            signing_seed: Some(hex::encode(seed)),
        };
        write_secret(&cdir.join("client.toml"), toml::to_string(&file).unwrap_or_default())?;
    }
    for (i, host) in o.hosts.iter().enumerate() {
        write_bundle(dir, NodeId(i as u32), host)?;
    }
    Ok(())
}

/// The directory `keel init` (with one address per node) and `keel admin add-node` write
/// for the machine at `host`: everything its nodes need and nothing else (no CA key, no
/// admin key, no other node's keys).
pub fn bundle_dir(dir: &Path, host: &str) -> PathBuf {
    dir.join("hosts").join(host)
}

/// Copies what node `id` needs on its machine into [`bundle_dir`]: `cluster.toml`,
/// `ca.pem` and `node-<id>/` (its files name them by relative paths, so the bundle works
/// wherever it is copied). Secrets keep their 0600 mode.
///
/// # Errors
/// The files cannot be read or written.
pub fn write_bundle(dir: &Path, id: NodeId, host: &str) -> Result<PathBuf, ConfigFileError> {
    let to = bundle_dir(dir, host);
    fs::create_dir_all(&to).map_err(|source| ConfigFileError::Io { path: to.clone(), source })?;
    for f in ["cluster.toml", "ca.pem", GENESIS_STATE_FILE] {
        if f == GENESIS_STATE_FILE && !dir.join(f).exists() {
            continue;
        }
        fs::copy(dir.join(f), to.join(f)).map_err(|source| ConfigFileError::Io { path: dir.join(f), source })?;
    }
    copy_tree(&dir.join(format!("node-{id}")), &to.join(format!("node-{id}")))?;
    Ok(to)
}

fn copy_tree(from: &Path, to: &Path) -> Result<(), ConfigFileError> {
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ConfigFileError::Io { path, source }
    };
    fs::create_dir_all(to).map_err(io(to))?;
    for entry in fs::read_dir(from).map_err(io(from))? {
        let entry = entry.map_err(io(from))?;
        let target = to.join(entry.file_name());
        if entry.file_type().map_err(io(&entry.path()))?.is_dir() {
            copy_tree(&entry.path(), &target)?;
        } else {
            // fs::copy keeps the mode: keys stay 0600.
            fs::copy(entry.path(), &target).map_err(io(&entry.path()))?;
        }
    }
    Ok(())
}

/// The `node-<id>` directories of a `keel init` directory, by stable id.
pub fn node_dirs(dir: &Path) -> BTreeMap<NodeId, PathBuf> {
    fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().to_string();
            let id = name.strip_prefix("node-")?.parse().ok()?;
            Some((id, e.path()))
        })
        .collect()
}

/// What `keel admin` needs from a `keel init` directory: a client identity for
/// [`ADMIN_CLIENT`](keel_core::membership::ADMIN_CLIENT) (its TLS certificate issued
/// from the CA on first use, its MAC keys derived from every node's secret) and the
/// admin signing key.
pub fn admin_setup(dir: &Path) -> Result<(ClientSetup, SigningKey), ConfigFileError> {
    use keel_core::membership::ADMIN_CLIENT;
    let admin =
        SigningKey::from_seed(hex32(&dir.join(ADMIN_KEY_FILE), "admin key", read(&dir.join(ADMIN_KEY_FILE))?.trim())?);
    let cluster_path = dir.join("cluster.toml");
    let cluster = ClusterFile::load(&cluster_path)?;
    let cfg = cluster.cluster_config(&cluster_path, Options::production())?;
    let adir = dir.join("admin");
    fs::create_dir_all(&adir).map_err(|source| ConfigFileError::Io { path: adir.clone(), source })?;
    if !adir.join("client.pem").exists() {
        let ca = Credentials { cert_pem: read(&dir.join("ca.pem"))?, key_pem: read(&dir.join("ca.key"))? };
        let creds = issue(&ca, PeerId::Client(ADMIN_CLIENT))?;
        write(&adir.join("client.pem"), &creds.cert_pem)?;
        write_secret(&adir.join("client.key"), &creds.key_pem)?;
    }
    // One key per stable id; ids without a node directory get a blank one.
    let dirs = node_dirs(dir);
    let top = dirs.keys().next_back().copied().unwrap_or(NodeId(0));
    let mut mac_keys = Vec::new();
    for id in 0..=top.0 {
        let key = match dirs.get(&NodeId(id)) {
            Some(d) => {
                let path = d.join("node.toml");
                let f: NodeFile = parse(&path)?;
                client_mac_key(&hex32(&path, "mac_secret", &f.mac_secret)?, ADMIN_CLIENT)
            }
            None => MacKey([0; 32]),
        };
        mac_keys.push(key);
    }
    let setup = ClientSetup {
        id: ADMIN_CLIENT,
        quorums: cfg.quorums,
        membership: cfg.membership.clone(),
        auth: cfg.auth,
        ca_pem: read(&dir.join("ca.pem"))?,
        credentials: Credentials {
            cert_pem: read(&adir.join("client.pem"))?,
            key_pem: read(&adir.join("client.key"))?,
        },
        mac_keys,
        signing: Some(admin.clone()),
        retransmit_ms: CLIENT_RETRANSMIT_MS,
        executors: cluster.executor_addrs(),
        rq_nodes: cluster.rq_addrs(),
        epochs_dir: Some(dir.to_path_buf()),
    };
    Ok((setup, admin))
}

/// Creates and stamps `ndir/data` for a node that never ran (crate::storage::provision):
/// only such a directory lets a node vote from its first step.
fn provision_data(ndir: &Path) -> Result<(), ConfigFileError> {
    let data = ndir.join("data");
    crate::storage::provision(&data)
        .map_err(|e| ConfigFileError::Invalid { path: data.clone(), message: format!("provisioning: {e}") })
}

/// Creates `node-<id>` in a `keel init` directory for a node the administrator adds:
/// keys, TLS certificate, and a node.toml like node-0's (service, fsync) listening on
/// `listen`. Returns its directory and the member to name in the admin operation; the
/// join file is written once the cluster applied the change.
pub fn new_node_dir(
    dir: &Path,
    id: NodeId,
    listen: SocketAddr,
    metrics: SocketAddr,
) -> Result<(PathBuf, keel_core::membership::Member), ConfigFileError> {
    new_node_dir_with(dir, id, listen, metrics, None)
}

/// As [`new_node_dir`], and with `front_end` Some(address) the node also gets a front end
/// there, like its template's (`[front_end.options]` included), with a client identity of
/// its own (`node-<id>/front-end/`: the next unused client id, a certificate from the CA,
/// a MAC key for every node). Under `auth = sig` that is refused: nodes check clients'
/// signatures against the keys in cluster.toml, which cannot change while they run.
///
/// # Errors
/// As [`new_node_dir`]; or `auth = sig` with a front end.
pub fn new_node_dir_with(
    dir: &Path,
    id: NodeId,
    listen: SocketAddr,
    metrics: SocketAddr,
    front_end: Option<SocketAddr>,
) -> Result<(PathBuf, keel_core::membership::Member), ConfigFileError> {
    let dirs = node_dirs(dir);
    let template_path = dirs.values().next().map(|d| d.join("node.toml")).ok_or_else(|| ConfigFileError::Invalid {
        path: dir.into(),
        message: "no node directory to take settings from".into(),
    })?;
    let template: NodeFile = parse(&template_path)?;
    let ndir = dir.join(format!("node-{id}"));
    if ndir.exists() {
        return Err(ConfigFileError::Invalid { path: ndir, message: "exists already".into() });
    }
    if front_end.is_some() {
        let cluster_path = dir.join("cluster.toml");
        if ClusterFile::load(&cluster_path)?.auth(&cluster_path)? == Auth::Sig {
            return Err(ConfigFileError::Invalid {
                path: cluster_path,
                message: "auth = sig: a new front end's client key would have to be in cluster.toml, which the \
                          running nodes read only at start"
                    .into(),
            });
        }
    }
    provision_data(&ndir)?;
    let ca = Credentials { cert_pem: read(&dir.join("ca.pem"))?, key_pem: read(&dir.join("ca.key"))? };
    let creds = issue(&ca, PeerId::Node(id))?;
    write(&ndir.join("node.pem"), &creds.cert_pem)?;
    write_secret(&ndir.join("node.key"), &creds.key_pem)?;
    let (seed, mac): ([u8; 32], [u8; 32]) = (random_bytes(), random_bytes());
    let front = match front_end {
        None => None,
        Some(addr) => {
            let client = provision_front_end(dir, &ndir, &ca, &mac)?;
            let options = template.front_end.as_ref().map(|f| f.options.clone()).unwrap_or_default();
            Some(FrontEndFile { listen: addr, client, options })
        }
    };
    let file = NodeFile {
        id,
        listen,
        metrics,
        signing_seed: hex::encode(seed),
        mac_secret: hex::encode(mac),
        faults: FaultsFile::default(),
        // Its own port and identity (the template's would clash), or none.
        front_end: front,
        ..template
    };
    write_secret(&ndir.join("node.toml"), toml::to_string(&file).unwrap_or_default())?;
    let member =
        keel_core::membership::Member { id: id.0, key: SigningKey::from_seed(seed).public(), addr: listen.to_string() };
    Ok((ndir, member))
}

/// A client identity for the front end of a node being added in `ndir`: the next client
/// id no file of `dir` uses, its certificate from the CA, and MAC keys derived from every
/// node's secret (the new node's is `new_mac`, its file not written yet). Returns the
/// client file's path relative to `ndir`.
fn provision_front_end(
    dir: &Path,
    ndir: &Path,
    ca: &Credentials,
    new_mac: &[u8; 32],
) -> Result<PathBuf, ConfigFileError> {
    let dirs = node_dirs(dir);
    let new_id = ndir
        .file_name()
        .and_then(|n| n.to_string_lossy().strip_prefix("node-")?.parse::<NodeId>().ok())
        .unwrap_or_default();
    // Every client file: `client-*` and the nodes' front ends.
    let mut files: Vec<PathBuf> = fs::read_dir(dir)
        .map_err(|source| ConfigFileError::Io { path: dir.into(), source })?
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("client-"))
        .map(|e| e.path().join("client.toml"))
        .collect();
    files.extend(dirs.values().map(|d| d.join("front-end").join("client.toml")));
    let mut top = first_client_id();
    for f in files.iter().filter(|f| f.exists()) {
        let c: ClientFile = parse(f)?;
        top = top.max(c.id);
    }
    let id = ClientId(top.0 + 1);
    let mut mac_keys = Vec::new();
    for node in 0..=dirs.keys().next_back().copied().unwrap_or(NodeId(0)).max(new_id).0 {
        let key = match dirs.get(&NodeId(node)) {
            _ if node == new_id.0 => client_mac_key(new_mac, id),
            Some(d) => {
                let path = d.join("node.toml");
                let f: NodeFile = parse(&path)?;
                client_mac_key(&hex32(&path, "mac_secret", &f.mac_secret)?, id)
            }
            None => MacKey([0; 32]),
        };
        mac_keys.push(hex::encode(key.0));
    }
    let cdir = ndir.join("front-end");
    fs::create_dir_all(&cdir).map_err(|source| ConfigFileError::Io { path: cdir.clone(), source })?;
    let creds = issue(ca, PeerId::Client(id))?;
    write(&cdir.join("client.pem"), &creds.cert_pem)?;
    write_secret(&cdir.join("client.key"), &creds.key_pem)?;
    let file = ClientFile {
        id,
        cluster: Path::new("../..").join("cluster.toml"),
        ca: Path::new("../..").join("ca.pem"),
        cert: "client.pem".into(),
        key: "client.key".into(),
        mac_keys,
        signing_seed: None,
    };
    write_secret(&cdir.join("client.toml"), toml::to_string(&file).unwrap_or_default())?;
    Ok(PathBuf::from("front-end").join("client.toml"))
}

/// Gives every client of a `keel init` directory its MAC key for node `id` (added by
/// `keel admin add-node`), the nodes' front ends included, so that a client started
/// afterwards authenticates to it too (one already running keeps its keys: the new
/// node then relies on other nodes' endorsements, `auth = rq-mac`, until the client,
/// or the node whose front end it is, restarts). Returns how many files it updated.
pub fn provision_clients(dir: &Path, id: NodeId) -> Result<usize, ConfigFileError> {
    let node_path = dir.join(format!("node-{id}/node.toml"));
    let node: NodeFile = parse(&node_path)?;
    let mac = hex32(&node_path, "mac_secret", &node.mac_secret)?;
    let mut count = 0;
    // The client directories, and the front ends' identities in the node directories
    // (a front end holding no key for a member sends it MACs that fail: the member
    // cannot endorse its requests, and counts them against it).
    for e in fs::read_dir(dir).map_err(|source| ConfigFileError::Io { path: dir.into(), source })?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let path = match name {
            n if n.starts_with("client-") => e.path().join("client.toml"),
            n if n.starts_with("node-") => e.path().join("front-end").join("client.toml"),
            _ => continue,
        };
        if !path.exists() {
            continue;
        }
        let mut f: ClientFile = parse(&path)?;
        // Entries by stable id; ids without a node stay blank.
        while f.mac_keys.len() <= id.0 as usize {
            f.mac_keys.push(hex::encode([0u8; 32]));
        }
        f.mac_keys[id.0 as usize] = hex::encode(client_mac_key(&mac, f.id).0);
        write_secret(&path, toml::to_string(&f).unwrap_or_default())?;
        count += 1;
    }
    Ok(count)
}

/// Key material from the operating system's generator (through ring, already linked
/// for TLS).
fn random_bytes() -> [u8; 32] {
    use rustls::crypto::ring::default_provider;
    let mut b = [0u8; 32];
    // The system random generator failing is not recoverable for key generation.
    default_provider().secure_random.fill(&mut b).expect("system random generator");
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_refuses_a_checkpoint_interval_nodes_would_refuse_and_writes_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let at = dir.path().join("c");
        let o = InitOptions { checkpoint_interval: Some(4096), ..init_options(1, 1) };
        assert!(init(&at, &o).is_err(), "a view change could not carry the log");
        assert!(!at.exists());
        let o = InitOptions { checkpoint_interval: None, auth: Some(Auth::Mac), request_digests: Some(true), ..o };
        assert!(init(&at, &o).is_err(), "request digests need rq-mac");
        assert!(!at.exists());
        let o = InitOptions { tick_ms: Some(1), ..init_options(1, 1) };
        assert!(init(&at, &o).is_err(), "ticks faster than 10 ms");
        assert!(!at.exists());
        let o = InitOptions { base_port: 65533, ..init_options(1, 1) };
        assert!(init(&at, &o).is_err(), "ports past 65535");
        assert!(!at.exists());
        let o = InitOptions { host: "not-an-ip".into(), ..init_options(1, 1) };
        assert!(init(&at, &o).is_err(), "a host that is no address");
        let o = InitOptions { hosts: vec!["10.0.0.1".into(); 3], ..init_options(1, 1) };
        assert!(init(&at, &o).is_err(), "three hosts for four nodes");
        let o = InitOptions {
            hosts: vec!["10.0.0.1".into(), "10.0.0.2".into(), "x".into(), "10.0.0.4".into()],
            ..init_options(1, 1)
        };
        assert!(init(&at, &o).is_err(), "a host that is no address");
        assert!(!at.exists());
    }

    /// One address per node: each node listens on its own, and each host's bundle holds
    /// its node with the shared public files and no secret of anyone else.
    #[test]
    fn nodes_on_several_hosts_get_their_addresses_and_bundles() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let at = tmp.path().join("c");
        let hosts: Vec<String> = (1..=4).map(|i| format!("10.9.8.{i}")).collect();
        init(&at, &InitOptions { hosts: hosts.clone(), ..init_options(1, 1) }).expect("init");
        for (i, host) in hosts.iter().enumerate() {
            let bundle = bundle_dir(&at, host);
            let node =
                NodeFile::load(&bundle.join(format!("node-{i}/node.toml"))).expect("the bundle's node file loads");
            assert_eq!(node.listen.ip().to_string(), *host);
            assert_eq!(node.metrics.ip().to_string(), *host);
            assert_eq!(node.cluster.n(), 4, "the cluster file came along");
            let names: Vec<String> = fs::read_dir(&bundle)
                .expect("bundle")
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into())
                .collect();
            let mut names = names;
            names.sort();
            assert_eq!(names, vec!["ca.pem".to_string(), "cluster.toml".into(), format!("node-{i}")]);
            use std::os::unix::fs::PermissionsExt;
            let mode = fs::metadata(bundle.join(format!("node-{i}/node.key"))).expect("key").permissions().mode();
            assert_eq!(mode & 0o777, 0o600, "a copied key stays private");
        }
    }

    /// A KV cluster of one client on loopback with every default.
    fn init_options(u: u32, r: u32) -> InitOptions {
        InitOptions {
            service: "kv".into(),
            u,
            r,
            host: "127.0.0.1".into(),
            hosts: Vec::new(),
            base_port: 41000,
            clients: 1,
            fsync: FsyncPolicy::Batch,
            auth: None,
            request_digests: None,
            checkpoint_interval: None,
            tick_ms: None,
            separated: false,
            rq_separated: false,
            front_ends: false,
            service_options: BTreeMap::new(),
            genesis: None,
        }
    }

    #[test]
    fn an_added_nodes_mac_key_reaches_every_client_file_front_ends_included() {
        let dir = tempfile::tempdir().expect("tempdir");
        init(dir.path(), &InitOptions { front_ends: true, clients: 2, ..init_options(1, 1) }).expect("init");
        let (_, member) = new_node_dir_with(
            dir.path(),
            NodeId(4),
            "127.0.0.1:41100".parse().expect("addr"),
            "127.0.0.1:41101".parse().expect("addr"),
            Some("127.0.0.1:41102".parse().expect("addr")),
        )
        .expect("node directory");
        assert_eq!(member.id, 4);
        // Two client directories, and the front ends of nodes 0..=3 (node 4's has its key).
        assert_eq!(provision_clients(dir.path(), NodeId(4)).expect("provisioned"), 2 + 5);
        let node4: NodeFile = parse(&dir.path().join("node-4/node.toml")).expect("node 4");
        let mac = hex32(Path::new("node-4"), "mac_secret", &node4.mac_secret).expect("mac secret");
        for file in ["client-1000/client.toml", "node-0/front-end/client.toml", "node-3/front-end/client.toml"] {
            let f: ClientFile = parse(&dir.path().join(file)).expect("client file");
            assert_eq!(f.mac_keys.len(), 5, "{file}");
            assert_eq!(f.mac_keys[4], hex::encode(client_mac_key(&mac, f.id).0), "{file} holds node 4's key");
        }
    }

    #[test]
    fn a_genesis_state_is_written_private_checked_on_load_and_carried_in_bundles() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().expect("tempdir");
        let state = b"the service's bytes".to_vec();
        let o = InitOptions {
            genesis: Some((state.clone(), "a test".into())),
            hosts: vec!["127.0.0.1".into(); 4],
            ..init_options(1, 1)
        };
        init(dir.path(), &o).expect("init");
        let file = dir.path().join(GENESIS_STATE_FILE);
        assert_eq!(fs::metadata(&file).expect("written").permissions().mode() & 0o777, 0o600);
        let load = |node_toml: &Path| {
            let setup = NodeFile::load(node_toml).expect("node file");
            setup.genesis.expect("a genesis state").load()
        };
        let node2 = dir.path().join("node-2/node.toml");
        assert_eq!(load(&node2).expect("loads").as_ref(), &state[..]);
        // The bundle for another machine carries it, and its nodes load it.
        let bundle = bundle_dir(dir.path(), "127.0.0.1");
        assert_eq!(load(&bundle.join("node-2/node.toml")).expect("loads").as_ref(), &state[..]);
        // A copy that differs is refused, naming the file.
        fs::write(&file, b"other bytes").expect("tampered");
        let err = load(&node2).expect_err("a differing copy is refused");
        assert!(err.to_string().contains("does not match [genesis] digest"), "{err}");
        fs::remove_file(&file).expect("removed");
        assert!(load(&node2).is_err(), "a missing file is an error");
        // Without a genesis state, nothing of it is written.
        let plain = tempfile::tempdir().expect("tempdir");
        init(plain.path(), &init_options(1, 1)).expect("init");
        assert!(!plain.path().join(GENESIS_STATE_FILE).exists());
        assert!(NodeFile::load(&plain.path().join("node-0/node.toml")).expect("node file").genesis.is_none());
    }

    #[test]
    fn init_separated_writes_order_and_execution_nodes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let o = InitOptions { separated: true, ..init_options(1, 1) };
        init(dir.path(), &o).expect("init");
        let mut listens = std::collections::BTreeSet::new();
        for i in 0..7 {
            let setup = NodeFile::load(&dir.path().join(format!("node-{i}/node.toml"))).expect("node loads");
            assert_eq!(setup.cluster.n(), 4, "four order nodes");
            assert_eq!(setup.cluster.exec_ids(), 4..7);
            assert_eq!(setup.executes_only(), i >= 4);
            assert_eq!(setup.executors.len(), 3);
            assert!(setup.cluster.admin_key.is_some(), "membership changes work with stages apart");
            assert_eq!(setup.cluster.membership.highest_id, 6, "no order node can be added as 4, 5 or 6");
            assert!(listens.insert(setup.listen) && listens.insert(setup.metrics), "ports are distinct");
        }
        let c = ClientFile::load(&dir.path().join("client-1000/client.toml")).expect("client loads");
        assert_eq!(c.executors.iter().map(|(id, _)| *id).collect::<Vec<_>>(), [4, 5, 6].map(NodeId).to_vec());
        // Too few execution nodes are refused.
        let cluster = dir.path().join("cluster.toml");
        let text = std::fs::read_to_string(&cluster).expect("cluster file");
        let mut f: ClusterFile = toml::from_str(&text).expect("parses");
        assert!(f.cluster_config(&cluster, Options::production()).is_ok());
        f.executors.pop();
        assert!(f.cluster_config(&cluster, Options::production()).is_err(), "2u + 1 execution nodes");
    }

    #[test]
    fn init_with_every_stage_apart_writes_order_execution_and_rq_nodes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let o = InitOptions { separated: true, rq_separated: true, ..init_options(1, 0) };
        init(dir.path(), &o).expect("init");
        // (1, 0): 3 order nodes 0..3, 3 execution nodes 3..6 (2u + 1), 3 RQ nodes 6..9.
        for i in 0..9 {
            let setup = NodeFile::load(&dir.path().join(format!("node-{i}/node.toml"))).expect("node loads");
            assert_eq!(setup.cluster.auth, Auth::RqMac, "an RQ stage apart needs rq-mac, also with r = 0");
            assert_eq!((setup.cluster.exec_ids(), setup.cluster.rq_ids()), (3..6, 6..9));
            assert_eq!((setup.executes_only(), setup.rq_only()), ((3..6).contains(&i), i >= 6));
            assert_eq!(setup.rq_nodes.len(), 3);
            assert!(setup.cluster.admin_key.is_some());
        }
        assert!(dir.path().join(ADMIN_KEY_FILE).exists());
        let c = ClientFile::load(&dir.path().join("client-1000/client.toml")).expect("client loads");
        assert_eq!(c.rq_nodes.iter().map(|(id, _)| *id).collect::<Vec<_>>(), [6, 7, 8].map(NodeId).to_vec());
        assert_eq!(c.mac_keys.len(), 9, "a MAC key for every node, RQ nodes included");
        // Too few RQ nodes, or another auth mode, are refused when the file is loaded.
        let cluster = dir.path().join("cluster.toml");
        let text = std::fs::read_to_string(&cluster).expect("cluster file");
        let mut f: ClusterFile = toml::from_str(&text).expect("parses");
        f.auth = Some("mac".into());
        assert!(f.cluster_config(&cluster, Options::production()).is_err(), "rq-mac only");
        f.auth = Some("rq-mac".into());
        assert!(f.cluster_config(&cluster, Options::production()).is_ok());
        f.rq_nodes.pop();
        assert!(f.cluster_config(&cluster, Options::production()).is_err(), "2u + r + 1 RQ nodes");
        let o = InitOptions { auth: Some(Auth::Sig), ..o };
        assert!(init(&dir.path().join("sig"), &o).is_err(), "sig with an RQ stage apart");
    }

    #[test]
    fn init_writes_a_loadable_cluster() {
        let dir = tempfile::tempdir().expect("tempdir");
        init(
            dir.path(),
            &InitOptions {
                clients: 2,
                request_digests: Some(false),
                checkpoint_interval: Some(1024),
                tick_ms: Some(250),
                ..init_options(1, 1)
            },
        )
        .expect("init");
        for i in 0..4 {
            let setup = NodeFile::load(&dir.path().join(format!("node-{i}/node.toml"))).expect("node loads");
            assert_eq!(setup.id, NodeId(i));
            assert_eq!(setup.cluster.n(), 4);
            assert_eq!(setup.cluster.options.checkpoint_interval, 1024);
            assert_eq!(setup.cluster.options.tick_ms, 250);
            assert!(!setup.cluster.request_digests, "cluster.toml turned them off");
        }
        // Keys and the files holding seeds and MAC keys: the owner's alone.
        use std::os::unix::fs::PermissionsExt as _;
        for secret in
            ["ca.key", "node-0/node.key", "node-0/node.toml", "client-1001/client.key", "client-1001/client.toml"]
        {
            let mode = fs::metadata(dir.path().join(secret)).expect("written").permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{secret}");
        }
        // A misspelt field is an error, not a silent default.
        let node_toml = dir.path().join("node-1/node.toml");
        let text = fs::read_to_string(&node_toml).expect("node file");
        fs::write(&node_toml, format!("{text}verify_thread = 4\n")).expect("written");
        let err = NodeFile::load(&node_toml).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("unknown field") && err.contains("verify_thread"), "{err}");
        fs::write(&node_toml, text).expect("restored");
        let c = ClientFile::load(&dir.path().join("client-1001/client.toml")).expect("client loads");
        assert_eq!(c.mac_keys.len(), 4);
        assert_eq!(c.id, ClientId(1001));
        // Production settings unless cluster.toml says otherwise (here the interval and ticks).
        let setup = NodeFile::load(&dir.path().join("node-0/node.toml")).expect("node loads");
        assert_eq!(setup.cluster.options, Options { checkpoint_interval: 1024, tick_ms: 250, ..Options::production() });
        assert!(setup.faults.is_empty());

        let cluster = dir.path().join("cluster.toml");
        let text = fs::read_to_string(&cluster).expect("cluster file");
        fs::write(&cluster, format!("{text}\n[leadership]\nmin_pct = 10\nrotate_ms = 60000\n")).expect("written");
        let setup = NodeFile::load(&dir.path().join("node-0/node.toml")).expect("node loads");
        let o = &setup.cluster.options;
        assert_eq!((o.leader_min_pct, o.leader_window_ms, o.leader_rotate_ms), (10, 1_000, 60_000));
        // Out of range, or a misspelt key: refused, not ignored.
        for bad in ["[leadership]\nmin_pct = 101\n", "[leadership]\nmin_percent = 10\n"] {
            fs::write(&cluster, format!("{text}\n{bad}")).expect("written");
            assert!(NodeFile::load(&dir.path().join("node-0/node.toml")).is_err(), "{bad}");
        }
    }
}
