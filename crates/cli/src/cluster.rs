//! `keel init`, `keel node`, `keel up`: create, run one node of, and run a local cluster.

use clap::Args;
use keel_core::config::Auth;
use keel_core::ids::NodeId;
use keel_runtime::config::NodeFile;
use keel_runtime::provision::{init, InitOptions};
use keel_runtime::storage::FsyncPolicy;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::Duration;

#[derive(Args, Debug)]
pub struct InitArgs {
    /// Directory to write the cluster into.
    #[arg(long, env = "KEEL_DIR")]
    dir: PathBuf,
    /// Failures tolerated while staying up (nodes that crash or are cut off).
    #[arg(long, default_value_t = 1)]
    u: u32,
    /// Of those, how many may be arbitrary (Byzantine: lying, corrupt) while the cluster
    /// stays right; r = 0 is crash fault tolerance. Nodes: 2u + r + 1.
    #[arg(long, default_value_t = 1)]
    r: u32,
    /// Address the nodes listen on.
    #[arg(long, default_value = "127.0.0.1", conflicts_with = "hosts")]
    host: String,
    /// Nodes on several machines: one IP address per node, comma-separated (order nodes
    /// first, then execution and RQ nodes). Node i listens on the i-th; the ports are as
    /// with --host (default base port 7100). Also writes DIR/hosts/<address>/ for each
    /// machine: copy it there and run `keel node --config node-<i>/node.toml` in it.
    #[arg(long, value_delimiter = ',')]
    hosts: Vec<String>,
    /// First node port (node i listens on base + i). Default: a free range chosen at
    /// random, so two local clusters can coexist.
    #[arg(long)]
    base_port: Option<u16>,
    /// Client identities to create (client-1000, client-1001, ...).
    #[arg(long, default_value_t = 8)]
    clients: usize,
    /// batch | always | never (never: benchmarks only).
    #[arg(long, default_value = "batch")]
    fsync: String,
    /// Request authentication: rq-mac | mac | sig | none (default: rq-mac when r > 0,
    /// else mac).
    #[arg(long, value_parser = crate::parse_auth)]
    auth: Option<Auth>,
    /// A checkpoint every this many instances (default 256; written to cluster.toml).
    /// Each checkpoint copies, hashes and writes the whole state: raise it for states
    /// of many hundreds of MB.
    #[arg(long)]
    checkpoint_interval: Option<u64>,
    /// Agreed-time ticks every this many ms, 0 for none (default: the service's; kv ticks
    /// every 1000 ms to drop ended watch leases). Written to cluster.toml.
    #[arg(long)]
    tick_ms: Option<u64>,
    /// on | off: with rq-mac, operations over 64 bytes are proposed by digest and fetched
    /// from the nodes that endorsed them, so big requests cross the network once (default
    /// on with rq-mac).
    #[arg(long, value_parser = parse_on_off)]
    digests: Option<bool>,
    /// Overwrite an existing cluster directory.
    #[arg(long)]
    force: bool,
    /// kv (a replicated key-value store), coord (a ZooKeeper-compatible coordination
    /// service), block (a replicated disk behind an NBD server), null (the
    /// microbenchmark service). Default: kv, or the service of the --restore backup.
    #[arg(long)]
    service: Option<String>,
    /// Start the new cluster from a backup's state (`keel admin backup`) instead of an
    /// empty one. The file is checked (every chunk against its certified root) and its
    /// service state copied beside cluster.toml; the old cluster's clients, keys and
    /// membership are not carried over.
    #[arg(long, value_name = "FILE")]
    restore: Option<PathBuf>,
    /// Stage placement (UpRight's request quorum, order and execution stages): co-located (every node runs RQ, order and
    /// execution), separated (2u + r + 1 RQ nodes and 2u + 1 execution nodes besides the
    /// 2u + r + 1 order nodes), or one stage apart: separated-exec, separated-rq.
    #[arg(long, default_value = "co-located", value_parser = LAYOUTS)]
    layout: String,
    /// block: the export's size (K, M, G, T: powers of 1024; default 1G).
    #[arg(long, help_heading = "block service")]
    size: Option<String>,
    /// block: bytes per block, the unit of versions and placement (default 4K).
    #[arg(long, help_heading = "block service")]
    block_size: Option<String>,
    /// block: gnothi (data on u + r + 1 nodes, off the ordering path; the default) or
    /// full (data through agreement to every node: the paper's G').
    #[arg(long, help_heading = "block service")]
    mode: Option<String>,
    /// block: percent of the export a node may hold outside its preferred slices while
    /// others are down, so writes go on while a preferred node is away (default 10).
    #[arg(long, help_heading = "block service")]
    reserve: Option<String>,
    /// block: recovery phase 2's cap, MB/s of block data a recovering node fetches
    /// (default 0: none).
    #[arg(long, help_heading = "block service")]
    recovery_mbps: Option<String>,
    /// block: seconds a front end may order no write before the cluster ends its epoch
    /// and the nodes drop the PrepareData it left (default 60).
    #[arg(long, help_heading = "block service")]
    epoch_idle_s: Option<String>,
    /// block: require TLS on the NBD ports. Each node gets a certificate for its
    /// address, and DIR/nbd-client/ the CA and a client certificate, the layout of
    /// libnbd's tls-certificates= and qemu's tls-creds-x509 (clients without a
    /// certificate the cluster CA signed are refused).
    #[arg(long, help_heading = "block service")]
    nbd_tls: bool,
}

/// `[service_options]` from the service's own flags: the block store's, for `--service
/// block`; those flags with any other service are an error.
/// This machine's ephemeral port range, from which the kernel picks the local port of
/// every outgoing connection (Linux; None elsewhere or if unreadable).
fn ephemeral_ports() -> Option<(u32, u32)> {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok()?;
    let mut it = text.split_whitespace().map(|p| p.parse::<u32>().ok());
    Some((it.next()??, it.next()??))
}

/// Whether two inclusive ranges share a port.
fn overlaps(a: (u32, u32), b: (u32, u32)) -> bool {
    a.0 <= b.1 && b.0 <= a.1
}

fn service_options(a: &InitArgs) -> Result<std::collections::BTreeMap<String, String>, String> {
    let given = [
        ("size", &a.size),
        ("block_size", &a.block_size),
        ("mode", &a.mode),
        ("reserve_pct", &a.reserve),
        ("recovery_mbps", &a.recovery_mbps),
        ("epoch_idle_s", &a.epoch_idle_s),
    ];
    if a.service.as_deref() != Some("block") {
        if a.nbd_tls {
            return Err("--nbd-tls is a block service option (--service block)".into());
        }
        if let Some((name, _)) = given.iter().find(|(_, v)| v.is_some()) {
            return Err(format!(
                "--{} is a block service option (--service block)",
                name.replace('_', "-").replace("-pct", "")
            ));
        }
        return Ok(Default::default());
    }
    let mut map = keel_block::Settings::default().to_map();
    for (name, value) in given {
        if let Some(v) = value {
            map.insert(name.into(), v.clone());
        }
    }
    // Normalised and checked now, so a bad value fails here and not at `keel node`.
    let settings = keel_block::Settings::from_map(&map)?;
    let quorums = keel_core::quorum::Quorums::new(a.u, a.r).map_err(|e| e.to_string())?;
    let nodes = quorums.order_nodes() as u32;
    keel_block::Geometry::new(settings.size, settings.block_size, nodes, nodes).map_err(|e| e.to_string())?;
    Ok(settings.to_map())
}

/// The stage placements `--layout` names.
pub const LAYOUTS: [&str; 4] = ["co-located", "separated", "separated-exec", "separated-rq"];

/// Whether a layout puts (execution, RQ) on nodes of their own.
pub fn layout_stages(layout: &str) -> (bool, bool) {
    match layout {
        "separated" => (true, true),
        "separated-exec" => (true, false),
        "separated-rq" => (false, true),
        _ => (false, false),
    }
}

fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        _ => Err(format!("expected on or off, not {s:?}")),
    }
}

/// The service state in the backup `file` (checked whole), for `keel init --restore`:
/// (service, its bytes, where they came from). `service`: what --service asked for.
fn restored_state(file: &std::path::Path, service: Option<&str>) -> Result<(String, Vec<u8>, String), String> {
    let backup = keel_runtime::backup::read(file).map_err(|e| format!("--restore {}: {e}", file.display()))?;
    let h = &backup.header;
    if let Some(asked) = service.filter(|s| *s != h.service) {
        return Err(format!(
            "--restore {}: the backup holds a {} state, not {asked}; pass --service {} (or leave it out)",
            file.display(),
            h.service,
            h.service
        ));
    }
    let (seq, state) = backup.service_state().map_err(|e| format!("--restore {}: {e}", file.display()))?;
    crate::services::check_state(&h.service, &state).map_err(|e| format!("--restore {}: {e}", file.display()))?;
    let origin =
        format!("{} after instance {seq} of epoch {}, taken at {} ms", file.display(), h.membership.epoch, h.taken_ms);
    Ok((h.service.clone(), state, origin))
}

pub fn run_init(mut a: InitArgs) -> ExitCode {
    if a.dir.join("cluster.toml").exists() && !a.force {
        eprintln!("error: {} already holds a cluster (use --force to overwrite)", a.dir.display());
        return ExitCode::from(2);
    }
    let genesis = match &a.restore {
        Some(file) => match restored_state(file, a.service.as_deref()) {
            Ok((service, state, origin)) => {
                a.service = Some(service);
                Some((state, origin))
            }
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(2);
            }
        },
        None => None,
    };
    let service = a.service.clone().unwrap_or_else(|| "kv".into());
    let Some(fsync) = FsyncPolicy::parse(&a.fsync) else {
        eprintln!("error: --fsync must be batch, always or never");
        return ExitCode::from(2);
    };
    let (separated, rq_separated) = layout_stages(&a.layout);
    let quorums = match keel_core::quorum::Quorums::new(a.u, a.r) {
        Ok(q) => q,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let order = quorums.order_nodes();
    let exec = if separated { quorums.execution_nodes_min() } else { 0 };
    let rq = if rq_separated { quorums.rq_nodes_min() } else { 0 };
    let n = order + exec + rq;
    // Node ports, then as many metrics ports, then the front ends' if the service has one.
    let front_ends = crate::services::front_end(&service);
    let per_node = if front_ends { 3 } else { 2 };
    // Ports free here say nothing of other machines: a fixed default there.
    let default_port = if a.hosts.is_empty() { keel_runtime::provision::free_ports(per_node * n) } else { Some(7100) };
    let Some(base_port) = a.base_port.or(default_port) else {
        eprintln!("error: no free port range found; pass --base-port");
        return ExitCode::FAILURE;
    };
    if !crate::services::known(&service) {
        eprintln!("error: unknown --service {service:?}; this binary runs: {}", crate::services::names());
        return ExitCode::from(2);
    }
    let service_options = match service_options(&a) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    if crate::services::fixed_cluster(&service) && (separated || rq_separated) {
        eprintln!("error: the {service} service runs on co-located clusters only (no --layout)");
        return ExitCode::from(2);
    }
    let auth = a.auth;
    let tick_ms = a.tick_ms.or(crate::services::tick_ms(&service));
    let o = InitOptions {
        service,
        u: a.u,
        r: a.r,
        host: a.host,
        hosts: a.hosts,
        base_port,
        clients: a.clients,
        fsync,
        auth,
        request_digests: a.digests,
        checkpoint_interval: a.checkpoint_interval,
        tick_ms,
        separated,
        rq_separated,
        front_ends,
        service_options,
        genesis,
    };
    let provisioned = init(&a.dir, &o).map_err(|e| e.to_string()).and_then(|()| {
        if !a.nbd_tls {
            return Ok(None);
        }
        let client_dir = keel_block::tls::provision(&a.dir)?;
        // The bundles were copied before the NBD files existed.
        for (i, host) in o.hosts.iter().enumerate() {
            keel_runtime::provision::write_bundle(&a.dir, NodeId(i as u32), host).map_err(|e| e.to_string())?;
        }
        Ok(Some(client_dir))
    });
    match provisioned {
        Ok(nbd_client_dir) => {
            let mut stages = Vec::new();
            if separated || rq_separated {
                stages.push(format!("{order} order nodes"));
            }
            if separated {
                stages.push(format!("{exec} execution nodes"));
            }
            if rq_separated {
                stages.push(format!("{rq} RQ nodes"));
            }
            let layout = if stages.is_empty() { String::new() } else { format!(": {}", stages.join(", ")) };
            // Every port the cluster takes, by use (front ends are printed below), so an
            // operator can open or check them all.
            let base = base_port as usize;
            let last_port = base + per_node * n - 1;
            println!(
                "initialized a cluster of {n} nodes (u = {}, r = {}){layout} in {}, ports {base}..{last_port} \
                 (peers {}..{}, metrics {}..{})",
                a.u,
                a.r,
                a.dir.display(),
                base,
                base + n - 1,
                base + n,
                base + 2 * n - 1
            );
            if let Some((low, high)) = ephemeral_ports().filter(|r| overlaps(*r, (base as u32, last_port as u32))) {
                eprintln!(
                    "warning: ports {base_port}..{last_port} overlap this machine's ephemeral port range \
                     {low}..{high} (/proc/sys/net/ipv4/ip_local_port_range): any outgoing connection may \
                     hold one of them when a node starts, which then fails with \"Address already in use\"; \
                     a --base-port below {low} avoids it"
                );
            }
            if let Some((state, origin)) = &o.genesis {
                println!("its {} service starts from a backup's state ({} bytes): {origin}", o.service, state.len());
            }
            if !o.hosts.is_empty() {
                println!(
                    "one bundle per machine in {}: copy hosts/<address>/ to that machine and run `keel node \
                     --config node-<i>/node.toml` there (ca.key and admin.key stay here, with `keel admin`)",
                    a.dir.display()
                );
            }
            if front_ends {
                let executing = if separated { order..order + exec } else { 0..order };
                let first = base_port as usize + 2 * n + executing.start;
                println!(
                    "the {} front ends (its clients' port) listen on {}..{}",
                    o.service,
                    first,
                    first + executing.len() - 1
                );
                if o.service == "block" {
                    let s = keel_block::Settings::from_map(&o.service_options).unwrap_or_default();
                    let host = o.hosts.first().unwrap_or(&o.host);
                    let url = match &nbd_client_dir {
                        Some(certs) => {
                            let certs = std::fs::canonicalize(certs).unwrap_or_else(|_| certs.clone());
                            format!("nbds://{host}:{first}/?tls-certificates={}", certs.display())
                        }
                        None => format!("nbd://{host}:{first}"),
                    };
                    println!(
                        "block export: {} bytes in blocks of {}, mode {}; connect to any node: {url}",
                        s.size,
                        s.block_size,
                        s.mode.name(),
                    );
                }
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

#[derive(Args, Debug)]
pub struct NodeArgs {
    /// The node's node.toml.
    #[arg(long)]
    config: PathBuf,
    /// This node lost its disk: start from a data directory `keel init` did not
    /// provision (missing or empty), rejoining the cluster: it fetches the state and
    /// votes again only once caught up. Without it such a directory is refused.
    #[arg(long)]
    rejoin: bool,
}

pub fn run_node(a: NodeArgs) -> ExitCode {
    let setup = match NodeFile::load(&a.config) {
        Ok(s) => keel_runtime::config::NodeSetup { rejoin: a.rejoin, ..s },
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    if !crate::services::known(&setup.service) {
        eprintln!(
            "error: {}: unknown service {:?}; this binary runs: {}",
            a.config.display(),
            setup.service,
            crate::services::names()
        );
        return ExitCode::from(2);
    }
    let built = match setup.threads {
        0 => tokio::runtime::Builder::new_current_thread().enable_all().build(),
        n => tokio::runtime::Builder::new_multi_thread().worker_threads(n).enable_all().build(),
    };
    let runtime = match built {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    // SIGTERM (`keel up`, systemd) or Ctrl-C: stop stepping, make what the node handed
    // to its log durable, then exit 0.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let id = setup.id;
    runtime.spawn(async move {
        let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) else {
            return;
        };
        let which = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = tokio::signal::ctrl_c() => "SIGINT",
        };
        tracing::info!(node = id.0, signal = which, "stopping: making the log durable");
        eprintln!("node {id}: {which}: stopping once its log is durable");
        let _ = stop_tx.send(true);
        // Kept alive so the node sees true, not a dropped sender.
        std::future::pending::<()>().await;
    });
    match runtime.block_on(crate::services::run(setup, stop_rx)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

#[derive(Args, Debug)]
pub struct UpArgs {
    /// A directory made by `keel init`.
    #[arg(long, env = "KEEL_DIR")]
    dir: PathBuf,
    /// Start a node that exits with an error again, after 1 s, doubling up to 30 s while
    /// it keeps failing within a minute of its start (a removed node, or one stopped
    /// cleanly, stays stopped).
    #[arg(long)]
    restart: bool,
}

/// `keel up --restart`: the first wait before starting a failed node again, the longest,
/// and how long a node must run for its next failure to count as a first one.
const RESTART_BACKOFF_MIN: Duration = Duration::from_secs(1);
const RESTART_BACKOFF_MAX: Duration = Duration::from_secs(30);
const RESTART_STABLE: Duration = Duration::from_secs(60);

/// A node `keel up` runs: its directory, its process (None while it waits to restart),
/// when it started, and its consecutive quick failures.
struct Supervised {
    dir: PathBuf,
    child: Option<Child>,
    started: std::time::Instant,
    failures: u32,
    /// When to start it again (`--restart`).
    restart_at: Option<std::time::Instant>,
}

/// The node directories of a cluster, in id order.
pub fn node_dirs(dir: &Path) -> Vec<PathBuf> {
    keel_runtime::provision::node_dirs(dir).into_values().collect()
}

fn spawn_node(exe: &Path, node_dir: &Path) -> std::io::Result<Child> {
    let log = std::fs::OpenOptions::new().create(true).append(true).open(node_dir.join("node.log"))?;
    Command::new(exe)
        .arg("node")
        .arg("--config")
        .arg(node_dir.join("node.toml"))
        .env("RUST_LOG", std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()))
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
}

pub fn run_up(a: UpArgs) -> ExitCode {
    // Nodes a membership change removed stay stopped.
    let dirs: Vec<PathBuf> = node_dirs(&a.dir)
        .into_iter()
        .filter(|d| !d.join("data").join(keel_runtime::node::REMOVED_FILE).exists())
        .collect();
    if dirs.is_empty() || !a.dir.join("cluster.toml").exists() {
        eprintln!("error: {} holds no cluster; run `keel init --dir {}` first", a.dir.display(), a.dir.display());
        return ExitCode::from(2);
    }
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("error: cannot find the keel binary: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut children = Vec::new();
    for d in &dirs {
        match spawn_node(&exe, d) {
            Ok(c) => children.push(c),
            Err(e) => {
                eprintln!("error: cannot start {}: {e}", d.display());
                stop(&mut children);
                return ExitCode::FAILURE;
            }
        }
    }
    let pids: Vec<String> = children.iter().map(|c| c.id().to_string()).collect();
    println!(
        "keel: {} nodes up (pids {}); logs in {}/node-*/node.log",
        children.len(),
        pids.join(" "),
        a.dir.display()
    );
    println!("try:  keel kv --dir {} put a 1   then   keel kv --dir {} get a", a.dir.display(), a.dir.display());
    println!("Ctrl-C (or SIGTERM) stops every node gracefully; a node that dies is reported and the others run on.");
    let interrupted = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = interrupted.clone();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build();
    let _signals = runtime.as_ref().ok().map(|rt| {
        rt.spawn(async move {
            let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) else {
                return;
            };
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
            flag.store(true, std::sync::atomic::Ordering::SeqCst);
        })
    });
    let now = std::time::Instant::now();
    let mut nodes: Vec<Supervised> = dirs
        .into_iter()
        .zip(children)
        .map(|(dir, c)| Supervised { dir, child: Some(c), started: now, failures: 0, restart_at: None })
        .collect();
    let status = loop {
        if let Ok(rt) = &runtime {
            rt.block_on(async { tokio::time::sleep(Duration::from_millis(200)).await });
        }
        if interrupted.load(std::sync::atomic::Ordering::SeqCst) {
            break ExitCode::SUCCESS;
        }
        let now = std::time::Instant::now();
        for node in nodes.iter_mut().filter(|n| n.restart_at.is_some_and(|t| t <= now)) {
            node.restart_at = None;
            match spawn_node(&exe, &node.dir) {
                Ok(c) => {
                    println!("keel: restarted {} (pid {}, attempt {})", node.dir.display(), c.id(), node.failures);
                    node.child = Some(c);
                    node.started = now;
                }
                Err(e) => eprintln!("keel: cannot restart {}: {e}", node.dir.display()),
            }
        }
        let exited = nodes.iter_mut().enumerate().find_map(|(i, n)| {
            let code = n.child.as_mut()?.try_wait().ok().flatten()?;
            Some((i, code))
        });
        let Some((i, code)) = exited else {
            continue;
        };
        nodes[i].child = None;
        let running = nodes.iter().filter(|n| n.child.is_some()).count();
        let node = &mut nodes[i];
        if code.success() && node.dir.join("data").join(keel_runtime::node::REMOVED_FILE).exists() {
            // A membership change removed it: the others carry on.
            println!("keel: {} was removed from the cluster and stopped", node.dir.display());
        } else if a.restart && !code.success() {
            // Quick failures back off; a node that ran a while starts over at the minimum.
            node.failures = if node.started.elapsed() >= RESTART_STABLE { 1 } else { node.failures + 1 };
            let wait = RESTART_BACKOFF_MIN.saturating_mul(1 << (node.failures - 1).min(5)).min(RESTART_BACKOFF_MAX);
            node.restart_at = Some(now + wait);
            eprintln!(
                "keel: {} exited ({code}); restarting in {} s; {running} nodes running; see {}",
                node.dir.display(),
                wait.as_secs(),
                node.dir.join("node.log").display()
            );
        } else {
            // The cluster tolerates u failures: the others run on, and say so.
            eprintln!(
                "keel: {} exited ({code}); {running} nodes still running; see {}",
                node.dir.display(),
                node.dir.join("node.log").display()
            );
        }
        if nodes.iter().all(|n| n.child.is_none() && n.restart_at.is_none()) {
            eprintln!("keel: every node has stopped");
            break ExitCode::FAILURE;
        }
    };
    let mut children: Vec<Child> = nodes.into_iter().filter_map(|n| n.child).collect();
    stop(&mut children);
    println!("keel: stopped");
    status
}

#[derive(Args, Debug)]
pub struct StatusArgs {
    /// A directory made by `keel init`.
    #[arg(long, env = "KEEL_DIR")]
    dir: PathBuf,
    /// After the table, keep watching: a progress bar per node while it transfers state,
    /// until Ctrl-C.
    #[arg(long, conflicts_with = "output")]
    follow: bool,
    /// Output: a table (text), or one JSON object with a "nodes" array (each node's
    /// /status fields and its "state": normal, view change, state transfer, RQ node,
    /// down, removed), "front_ends" and "service" lines.
    #[arg(short, long, value_enum)]
    output: Option<StatusOutput>,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum StatusOutput {
    Text,
    Json,
}

/// One node as `keel status` found it.
enum Found {
    Up(keel_runtime::metrics::Status),
    /// Removed from the membership (the node wrote why when it stopped).
    Removed(String),
    /// No answer on its status port.
    Down(String),
}

/// Per node: view, primary, last executed and stable sequence, lag, connected peers.
pub fn run_status(a: StatusArgs) -> ExitCode {
    let dirs = node_dirs(&a.dir);
    if dirs.is_empty() {
        eprintln!("error: {} holds no cluster", a.dir.display());
        return ExitCode::from(2);
    }
    let mut rows = Vec::new();
    let mut front_ends = Vec::new();
    for d in &dirs {
        let path = d.join("node.toml");
        let setup = match NodeFile::load(&path) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(2);
            }
        };
        let removed = std::fs::read_to_string(setup.data_dir.join(keel_runtime::node::REMOVED_FILE));
        let status = match removed {
            Ok(why) => Found::Removed(why.trim().to_string()),
            Err(_) => match keel_runtime::metrics::fetch_status(setup.metrics, Duration::from_secs(2)) {
                Ok(s) => Found::Up(s),
                Err(e) => Found::Down(e.to_string()),
            },
        };
        if let Some(fe) = &setup.front_end {
            front_ends.push(format!("node {} serves {} clients on {}", setup.id, setup.service, fe.listen));
        }
        rows.push((setup.id, setup.rq_only(), status));
    }
    let up = |r: &Found| match r {
        Found::Up(s) => Some(s.clone()),
        _ => None,
    };
    let max_executed = rows.iter().filter_map(|(_, _, r)| up(r).map(|s| s.executed)).max().unwrap_or(0);
    // What each service reports of itself (block: reserve, INCOMPLETE blocks, bad copies).
    let service_lines: Vec<String> = rows
        .iter()
        .filter_map(|(id, _, r)| up(r).map(|s| (id, s)))
        .flat_map(|(id, s)| s.service.into_iter().map(move |line| format!("node {id}: {line}")))
        .collect();
    // A removed node is not a failure: only a node that should answer and does not is.
    let all_up = rows.iter().all(|(_, _, r)| !matches!(r, Found::Down(_)));
    let state = |rq_only: bool, s: &keel_runtime::metrics::Status| {
        let now = match (rq_only, s.view_change_to, s.transfer) {
            (true, _, _) => "RQ node".to_string(),
            (false, Some(t), _) => format!("changing to view {t}"),
            (false, None, Some((have, total))) => format!("state transfer {have}/{total} chunks"),
            (false, None, None) => "normal".into(),
        };
        // A node whose state went wrong (found at a checkpoint, repaired by transfer).
        match (s.divergences, s.diverged_at) {
            (0, _) | (_, None) => now,
            (1, Some(at)) => format!("{now}; its state diverged at checkpoint {at} and was repaired"),
            (n, Some(at)) => format!("{now}; its state diverged {n} times, last at checkpoint {at}, and was repaired"),
        }
    };
    if a.output == Some(StatusOutput::Json) {
        let nodes: Vec<serde_json::Value> = rows
            .iter()
            .map(|(id, rq_only, r)| match r {
                Found::Up(s) => {
                    let mut v = serde_json::to_value(s).unwrap_or_default();
                    if let Some(o) = v.as_object_mut() {
                        o.insert("state".into(), state(*rq_only, s).into());
                        o.insert("lag".into(), (max_executed - s.executed.min(max_executed)).into());
                    }
                    v
                }
                Found::Removed(why) => serde_json::json!({ "node": id, "state": "removed", "reason": why }),
                Found::Down(e) => serde_json::json!({ "node": id, "state": "down", "error": e }),
            })
            .collect();
        println!("{}", serde_json::json!({ "nodes": nodes, "front_ends": front_ends, "service": service_lines }));
        return if all_up { ExitCode::SUCCESS } else { ExitCode::FAILURE };
    }
    println!("node\tepoch\tview\tprimary\texecuted\tstable\tlag\tpeers\tstate");
    for (id, rq_only, r) in rows {
        match r {
            Found::Up(s) if rq_only => {
                // An RQ node executes nothing: it endorses requests for the order nodes.
                let primary = s.members.get(s.primary as usize).copied().unwrap_or(s.primary);
                println!(
                    "{id}\t{}\t{}\t{primary}\t-\t-\t-\t{}/{}\tRQ node",
                    s.epoch, s.view, s.peers_connected, s.peers
                );
            }
            Found::Up(s) => {
                // The primary by stable id (the index is the node's place in the epoch).
                let primary = s.members.get(s.primary as usize).copied().unwrap_or(s.primary);
                println!(
                    "{id}\t{}\t{}\t{}\t{}\t{}\t{}\t{}/{}\t{}",
                    s.epoch,
                    s.view,
                    primary,
                    s.executed,
                    s.stable,
                    max_executed - s.executed,
                    s.peers_connected,
                    s.peers,
                    state(false, &s)
                );
            }
            Found::Removed(why) => println!("{id}\t-\t-\t-\t-\t-\t-\t-\tremoved ({why})"),
            Found::Down(e) => println!("{id}\t-\t-\t-\t-\t-\t-\t-\tdown ({e})"),
        }
    }
    // The service's own ports (coord: where ZooKeeper clients connect).
    for line in front_ends.iter().chain(&service_lines) {
        println!("{line}");
    }
    if a.follow {
        follow_transfers(&dirs);
    }
    if all_up {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// Stops the nodes this process started, by their handles (never by name).
/// How long a node may take to make its log durable and exit after SIGTERM.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// Stops the nodes gracefully: SIGTERM to each (a node makes its log durable and exits),
/// then SIGKILL to any still running after [`STOP_GRACE`].
fn stop(children: &mut [Child]) {
    for c in children.iter_mut() {
        if let Ok(pid) = i32::try_from(c.id()) {
            // SAFETY: kill(2) on a child we spawned and have not reaped (its pid is ours).
            unsafe {
                libc::kill(pid, libc::SIGTERM);
            }
        }
    }
    let deadline = std::time::Instant::now() + STOP_GRACE;
    for c in children.iter_mut() {
        loop {
            match c.try_wait() {
                Ok(Some(_)) | Err(_) => break,
                Ok(None) if std::time::Instant::now() >= deadline => {
                    eprintln!("keel: node (pid {}) still running {STOP_GRACE:?} after SIGTERM: killing it", c.id());
                    let _ = c.kill();
                    let _ = c.wait();
                    break;
                }
                Ok(None) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }
}

/// `keel status --follow`: a bar per node while it fetches a checkpoint (chunks held of
/// the total, from the node's /status), redrawn twice a second until Ctrl-C.
fn follow_transfers(dirs: &[PathBuf]) {
    use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
    let nodes: Vec<(keel_core::ids::NodeId, std::net::SocketAddr)> =
        dirs.iter().filter_map(|d| NodeFile::load(&d.join("node.toml")).ok()).map(|s| (s.id, s.metrics)).collect();
    let bars = MultiProgress::new();
    let style = ProgressStyle::with_template("node {prefix}: state transfer [{bar:40}] {pos}/{len} chunks {msg}")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
    let mut shown: std::collections::BTreeMap<keel_core::ids::NodeId, ProgressBar> = std::collections::BTreeMap::new();
    eprintln!("following state transfers (Ctrl-C to stop)");
    loop {
        for (id, addr) in &nodes {
            let transfer =
                keel_runtime::metrics::fetch_status(*addr, Duration::from_secs(1)).ok().and_then(|s| s.transfer);
            match (transfer, shown.get(id)) {
                (Some((have, total)), Some(bar)) => {
                    bar.set_length(total as u64);
                    bar.set_position(have as u64);
                }
                (Some((have, total)), None) => {
                    let bar = bars.add(ProgressBar::new(total as u64).with_style(style.clone()));
                    bar.set_prefix(id.to_string());
                    bar.set_position(have as u64);
                    shown.insert(*id, bar);
                }
                (None, Some(_)) => {
                    if let Some(bar) = shown.remove(id) {
                        bar.finish_with_message("done");
                    }
                }
                (None, None) => {}
            }
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

#[cfg(test)]
mod tests {
    use super::overlaps;

    #[test]
    fn port_ranges_overlap_when_they_share_a_port() {
        assert!(overlaps((32768, 60999), (40000, 40011)));
        assert!(overlaps((32768, 60999), (32760, 32768)));
        assert!(overlaps((32768, 60999), (60999, 61010)));
        assert!(!overlaps((32768, 60999), (20000, 32767)));
        assert!(!overlaps((32768, 60999), (61000, 61011)));
    }
}
