//! Shared by the multi-process test binaries: a local cluster of real `keel node`
//! processes (killed by handle, never by name) and small client helpers.
#![allow(dead_code)] // each test binary uses its own subset

use keel_kv::{KvRequest, KvResponse};
use keel_runtime::client::KeelClient;
use keel_runtime::config::ClientFile;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub const KEEL: &str = env!("CARGO_BIN_EXE_keel");
pub const OP_TIMEOUT: Duration = Duration::from_secs(20);

pub struct Cluster {
    dir: tempfile::TempDir,
    nodes: Vec<Option<Child>>,
}

impl Cluster {
    pub fn init(u: u32, r: u32) -> Cluster {
        Cluster::init_with(u, r, |_| None)
    }

    /// `keel init`, then the `key = value` line `extra(i)` set in node i's file before it
    /// starts.
    pub fn init_with(u: u32, r: u32, extra: impl Fn(usize) -> Option<&'static str>) -> Cluster {
        Cluster::init_configured(u, r, "", extra)
    }

    /// As [`Cluster::init_with`], with `cluster_extra` appended to cluster.toml.
    pub fn init_configured(
        u: u32,
        r: u32,
        cluster_extra: &str,
        extra: impl Fn(usize) -> Option<&'static str>,
    ) -> Cluster {
        Cluster::init_full(u, r, &[], cluster_extra, extra)
    }

    /// A cluster with separated execution (`keel init --layout separated-exec`): order
    /// nodes `0..2u + r + 1`, then `2u + 1` execution nodes.
    pub fn init_separated(u: u32, r: u32) -> Cluster {
        Cluster::init_full(u, r, &["--layout", "separated-exec"], "", |_| None)
    }

    /// A cluster with every stage apart (`keel init --layout separated`): order nodes
    /// `0..2u + r + 1`, then `2u + 1` execution nodes, then `2u + r + 1` RQ nodes.
    pub fn init_stages_apart(u: u32, r: u32) -> Cluster {
        Cluster::init_full(u, r, &["--layout", "separated"], "", |_| None)
    }

    /// A cluster of service `service` (`keel init --service`).
    pub fn init_service(service: &'static str, u: u32, r: u32) -> Cluster {
        Cluster::init_full(u, r, &["--service", service], "", |_| None)
    }

    /// As [`Cluster::init_service`], with `tail` (TOML tables) appended to every node
    /// file before the nodes start (`[front_end.options]`).
    pub fn init_service_with(service: &'static str, u: u32, r: u32, tail: &'static str) -> Cluster {
        Cluster::init_full(u, r, &["--service", service], "", move |_| Some(tail))
    }

    /// A cluster made by `keel init` with these arguments (`--service block --size 64M`).
    pub fn init_args(u: u32, r: u32, args: &[&str]) -> Cluster {
        Cluster::init_full(u, r, args, "", |_| None)
    }

    /// A cluster whose requests are authenticated with `auth` (`keel init --auth`).
    pub fn init_auth(u: u32, r: u32, auth: &str) -> Cluster {
        Cluster::init_full(u, r, &["--auth", auth], "", |_| None)
    }

    /// `keel init` with `init_args`, `cluster_extra` appended to cluster.toml, and
    /// `extra(i)` (a `key = value` line, or tables) in node i's file; then every node.
    pub fn init_full(
        u: u32,
        r: u32,
        init_args: &[&str],
        cluster_extra: &str,
        extra: impl Fn(usize) -> Option<&'static str>,
    ) -> Cluster {
        let dir = tempfile::tempdir().expect("tempdir");
        let status = Command::new(KEEL)
            .args(["init", "--dir"])
            .arg(dir.path())
            .args(["--u", &u.to_string(), "--r", &r.to_string(), "--clients", "8"])
            .args(init_args)
            .stdout(Stdio::null())
            .status()
            .expect("keel init runs");
        assert!(status.success());
        if !cluster_extra.is_empty() {
            let file = dir.path().join("cluster.toml");
            let text = std::fs::read_to_string(&file).expect("cluster file");
            std::fs::write(&file, format!("{text}\n{cluster_extra}\n")).expect("cluster file written");
        }
        let n = keel_runtime::provision::node_dirs(dir.path()).len();
        let mut c = Cluster { dir, nodes: (0..n).map(|_| None).collect() };
        for i in 0..n {
            if let Some(line) = extra(i).filter(|l| l.starts_with('[')) {
                let file = c.path().join(format!("node-{i}/node.toml"));
                let text = std::fs::read_to_string(&file).expect("node file");
                std::fs::write(&file, format!("{text}\n{line}\n")).expect("node file written");
            } else if let Some(line) = extra(i) {
                let file = c.path().join(format!("node-{i}/node.toml"));
                let text = std::fs::read_to_string(&file).expect("node file");
                // Replaces the setting `keel init` wrote, if any.
                let key = line.split('=').next().expect("key").trim();
                let kept: Vec<&str> =
                    text.lines().filter(|l| l.split('=').next().map(str::trim) != Some(key)).collect();
                // Before the first table (`[front_end]`), or the line would belong to it.
                let at = kept.iter().position(|l| l.starts_with('[')).unwrap_or(kept.len());
                let (top, tables) = kept.split_at(at);
                std::fs::write(&file, format!("{}\n{line}\n{}\n", top.join("\n"), tables.join("\n")))
                    .expect("node file written");
            }
            c.start(i);
        }
        c
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Makes room for node `i` (one `keel admin add-node` created) so it can be started.
    pub fn add_slot(&mut self, i: usize) {
        while self.nodes.len() <= i {
            self.nodes.push(None);
        }
    }

    /// Whether node `i`'s process ended by itself, and how.
    pub fn exited(&mut self, i: usize) -> Option<std::process::ExitStatus> {
        let status = self.nodes[i].as_mut()?.try_wait().expect("try_wait")?;
        self.nodes[i] = None;
        Some(status)
    }

    /// Node `i`'s /status, if it answers.
    pub fn status(&self, i: usize) -> Option<keel_runtime::metrics::Status> {
        let setup = keel_runtime::config::NodeFile::load(&self.path().join(format!("node-{i}/node.toml"))).ok()?;
        keel_runtime::metrics::fetch_status(setup.metrics, Duration::from_secs(1)).ok()
    }

    /// Runs `keel admin ARGS --dir DIR`; its standard output, or its error.
    pub fn admin(&self, args: &[&str]) -> Result<String, String> {
        let out =
            Command::new(KEEL).arg("admin").args(args).arg("--dir").arg(self.path()).output().expect("keel admin runs");
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).to_string())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).to_string())
        }
    }

    pub fn start(&mut self, i: usize) {
        self.start_with(i, &[]);
    }

    /// Starts node `i` with extra `keel node` arguments (`--rejoin`).
    pub fn start_with(&mut self, i: usize, args: &[&str]) {
        assert!(self.nodes[i].is_none());
        let ndir = self.path().join(format!("node-{i}"));
        let log = std::fs::OpenOptions::new().create(true).append(true).open(ndir.join("node.log")).expect("log");
        let child = Command::new(KEEL)
            .args(["node", "--config"])
            .arg(ndir.join("node.toml"))
            .args(args)
            .env("RUST_LOG", "info")
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("node starts");
        self.nodes[i] = Some(child);
    }

    /// Node `i`'s process id (for a client-side test that kills it itself).
    pub fn pid(&self, i: usize) -> u32 {
        self.nodes[i].as_ref().expect("node runs").id()
    }

    /// Every node's front end address (`[front_end]` in its file), by node.
    pub fn front_ends(&self) -> Vec<std::net::SocketAddr> {
        (0..self.nodes.len())
            .filter_map(|i| {
                let setup = keel_runtime::config::NodeFile::load(&self.path().join(format!("node-{i}/node.toml")));
                setup.expect("node file").front_end.map(|fe| fe.listen)
            })
            .collect()
    }

    /// Nodes in the cluster.
    pub fn n(&self) -> usize {
        self.nodes.len()
    }

    /// kill -9 of every node at once.
    pub fn kill_all(&mut self) {
        for i in 0..self.nodes.len() {
            self.kill(i);
        }
    }

    pub fn start_all(&mut self) {
        for i in 0..self.nodes.len() {
            self.start(i);
        }
    }

    /// kill -9.
    pub fn kill(&mut self, i: usize) {
        if let Some(mut c) = self.nodes[i].take() {
            c.kill().expect("SIGKILL");
            c.wait().expect("reaped");
        }
    }

    pub fn client(&self, id: u64) -> KeelClient {
        self.client_retransmitting_after(id, keel_runtime::config::CLIENT_RETRANSMIT_MS)
    }

    /// A client that waits `ms` for results before retransmitting (or ordering a read).
    pub fn client_retransmitting_after(&self, id: u64, ms: u64) -> KeelClient {
        let mut setup = ClientFile::load(&self.path().join(format!("client-{id}/client.toml"))).expect("client file");
        setup.retransmit_ms = ms;
        KeelClient::connect(setup).expect("client connects")
    }

    /// The node's Prometheus text (plain HTTP GET on loopback).
    pub fn metrics(&self, i: usize) -> String {
        use std::io::{Read, Write};
        let text = std::fs::read_to_string(self.path().join(format!("node-{i}/node.toml"))).expect("node file");
        let line = text.lines().find(|l| l.starts_with("metrics")).expect("metrics address");
        let addr = line.split('"').nth(1).expect("quoted");
        // A node just (re)started may not listen yet, more so on a loaded host.
        let started = std::time::Instant::now();
        let mut s = loop {
            match std::net::TcpStream::connect(addr) {
                Ok(s) => break s,
                Err(e) if started.elapsed() < Duration::from_secs(10) => {
                    eprintln!("metrics endpoint {addr}: {e}; retrying");
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => panic!("metrics endpoint {addr}: {e}"),
            }
        };
        s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").expect("request");
        let mut body = String::new();
        s.read_to_string(&mut body).expect("response");
        body
    }

    pub fn log(&self, i: usize) -> String {
        std::fs::read_to_string(self.path().join(format!("node-{i}/node.log"))).unwrap_or_default()
    }
}

/// Lines of each node's log a failing test prints.
const LOG_TAIL_LINES: usize = 30;

impl Drop for Cluster {
    fn drop(&mut self) {
        self.kill_all();
        // A failing test's cluster directory is deleted with it: show what the nodes said
        // (a liveness failure that shows up once in many runs needs this to be diagnosed).
        if std::thread::panicking() {
            for i in 0..self.nodes.len() {
                let log = self.log(i);
                let lines: Vec<&str> = log.lines().collect();
                eprintln!("--- node {i}: last {} lines of its log ---", LOG_TAIL_LINES.min(lines.len()));
                for line in &lines[lines.len().saturating_sub(LOG_TAIL_LINES)..] {
                    eprintln!("{line}");
                }
            }
        }
    }
}

/// The value of the first sample of `name` in Prometheus text (0 if absent).
pub fn metric(metrics: &str, name: &str) -> u64 {
    metrics
        .lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// Writers that record every acknowledged write, until `stop` is set.
pub fn start_writers(
    cluster: &Cluster,
    clients: u64,
    stop: std::sync::Arc<std::sync::Mutex<bool>>,
    acked: std::sync::Arc<std::sync::Mutex<Vec<(String, String)>>>,
) -> Vec<tokio::task::JoinHandle<u64>> {
    (0..clients)
        .map(|i| {
            let c = cluster.client(1000 + i);
            let stop = stop.clone();
            let acked = acked.clone();
            tokio::spawn(async move {
                let mut n = 0u64;
                while !*stop.lock().expect("lock") {
                    let (k, v) = (format!("c{i}-{n}"), format!("v{n}"));
                    // A timeout is allowed (no acknowledgement, nothing to check);
                    // an acknowledged write must survive.
                    if put(&c, &k, &v).await.is_ok() {
                        acked.lock().expect("lock").push((k, v));
                    }
                    n += 1;
                }
                n
            })
        })
        .collect()
}

/// Reads every acknowledged write back (client 1007), failing on the first one lost.
pub async fn check_all(cluster: &Cluster, acked: &[(String, String)]) {
    let c = cluster.client(1007);
    for (k, v) in acked {
        assert_eq!(get(&c, k).await.as_deref(), Some(v.as_str()), "acknowledged write {k} lost");
    }
}

pub async fn put(c: &KeelClient, k: &str, v: &str) -> Result<(), String> {
    let req = KvRequest::Put { key: k.into(), value: v.into() };
    match c.invoke(req.encode(), OP_TIMEOUT).await.map_err(|e| e.to_string())? {
        bytes if KvResponse::decode(&bytes) == Ok(KvResponse::Done) => Ok(()),
        other => Err(format!("unexpected put result {other:?}")),
    }
}

pub async fn get(c: &KeelClient, k: &str) -> Option<String> {
    let bytes = c.invoke(KvRequest::Get { key: k.into() }.encode(), OP_TIMEOUT).await.expect("get answers");
    match KvResponse::decode(&bytes).expect("decodes") {
        KvResponse::Value(v) => v.map(|v| String::from_utf8_lossy(&v).to_string()),
        other => panic!("unexpected get result {other:?}"),
    }
}

/// A read-only get with `consistency` (not ordered unless its answers disagree or none
/// come in time).
pub async fn read_only(c: &KeelClient, k: &str, consistency: keel_core::message::ReadConsistency) -> Option<String> {
    let op = KvRequest::Get { key: k.into() }.encode();
    let bytes = c.invoke_read_only(op, consistency, OP_TIMEOUT).await.expect("read answers");
    match KvResponse::decode(&bytes).expect("decodes") {
        KvResponse::Value(v) => v.map(|v| String::from_utf8_lossy(&v).to_string()),
        other => panic!("unexpected get result {other:?}"),
    }
}

/// Reads "ctr" for `duration`, alternately linearizable and by read index, while client
/// `writer` writes increasing counters to it, asserting that no read returns a value
/// older than the last write acknowledged before the read began. Returns the reads and
/// writes done.
pub async fn reads_never_stale_under_writes(
    cluster: &Cluster,
    reader: &KeelClient,
    writer: u64,
    duration: Duration,
) -> (u64, u64) {
    use keel_core::message::ReadConsistency::{Index, Linearizable};
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
    let acked = std::sync::Arc::new(AtomicU64::new(0));
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let w = {
        let (acked, stop) = (acked.clone(), stop.clone());
        let c = cluster.client(writer);
        tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(SeqCst) {
                n += 1;
                put(&c, "ctr", &n.to_string()).await.expect("put");
                acked.store(n, SeqCst);
            }
            n
        })
    };
    let started = std::time::Instant::now();
    let mut reads = 0;
    while started.elapsed() < duration {
        let how = if reads % 2 == 0 { Linearizable } else { Index };
        let floor = acked.load(SeqCst);
        let got: u64 = read_only(reader, "ctr", how).await.map_or(0, |v| v.parse().expect("counter"));
        assert!(got >= floor, "stale {how:?} read: {got} after {floor} was acknowledged");
        reads += 1;
    }
    stop.store(true, SeqCst);
    (reads, w.await.expect("writer"))
}

/// A `keel kv watch` holding client identity `id` of the cluster in `dir`, once its lock
/// names it (kill it by the handle when done).
pub fn identity_holder(dir: &Path, id: u64) -> Child {
    let holder = Command::new(KEEL)
        .args(["kv", "--client", &id.to_string(), "--dir"])
        .arg(dir)
        .args(["watch", "held"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("keel kv watch starts");
    let lock = dir.join(format!("client-{id}/LOCK"));
    let started = std::time::Instant::now();
    while std::fs::read_to_string(&lock).map_or(true, |t| !t.contains(&holder.id().to_string())) {
        assert!(started.elapsed() < Duration::from_secs(10), "the watcher never took identity {id}");
        std::thread::sleep(Duration::from_millis(50));
    }
    holder
}
