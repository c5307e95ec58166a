//! `keel bench`: closed-loop clients against a running cluster, BFT-SMaRt style.
//!
//! Each benchmark client is one client identity with one connection per node;
//! `--outstanding K` runs K sessions over it (each a protocol client with one operation
//! in flight, driven by its own task), so their frames share the connections' writes. Every step reports
//! throughput, latency percentiles, and the CPU share of every node process and of the
//! load generator itself, since everything shares one machine. The same sweep runs
//! against an unreplicated baseline (u = r = 0, one node, same code path) started for the
//! purpose, and results are given as ratios to it. Numbers are printed (and plotted),
//! never asserted.

use clap::Args;
use keel_core::message::ReadConsistency;
use keel_kv::KvRequest;
use keel_null::Null;
use keel_runtime::client::KeelClient;
use keel_runtime::config::{ClientFile, NodeFile};
use keel_runtime::provision::{init, InitOptions};
use keel_runtime::storage::FsyncPolicy;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// A cluster directory made by `keel init` (with at least as many client identities
    /// as benchmark clients: `keel init --clients N`).
    #[arg(long, env = "KEEL_DIR")]
    dir: PathBuf,
    /// Request bytes (null service) or value bytes (kv service).
    #[arg(long, default_value_t = 0)]
    req: usize,
    /// Reply bytes (null service only).
    #[arg(long, default_value_t = 0)]
    reply: u32,
    /// Concurrent clients; a comma list sweeps.
    #[arg(long, default_value = "1")]
    clients: String,
    /// Operations in flight per benchmark client (sessions sharing its connections).
    #[arg(long, default_value_t = 1)]
    outstanding: usize,
    /// Seconds per step.
    #[arg(long, default_value_t = 10)]
    duration: u64,
    /// KV service: distinct keys the puts cycle through, over all clients. The service
    /// state (and every checkpoint) holds up to keys x --req bytes.
    #[arg(long, default_value_t = 1024)]
    keys: u64,
    /// Also write the rows as CSV.
    #[arg(long)]
    csv: Option<PathBuf>,
    /// Draw latency against throughput (SVG).
    #[arg(long)]
    plot: Option<PathBuf>,
    /// Write throughput over time (TSV: wall-clock ms of each 100 ms bucket, ops/s in
    /// it), for runs with events in them (scripts/reconfig-bench).
    #[arg(long)]
    timeline: Option<PathBuf>,
    /// Threads of the load generator's runtime (1: a current-thread runtime, which costs
    /// less CPU for the same throughput; on a 2-core host, BFT 0/0 with fsync never,
    /// `--clients 32 --outstanding 32`, two runs each, alternated (2026-11-27, 065a429):
    /// 1 thread 35.5k and 31.6k ops/s at 24-25% client CPU, 2 threads 26.5k and 23.7k at
    /// 47-48%).
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Skip the unreplicated baseline.
    #[arg(long)]
    no_baseline: bool,
    /// KV service: the operation, `put` or `get` (gets read keys the warm-up wrote).
    #[arg(long, default_value = "put", value_parser = ["put", "get"])]
    op: String,
    /// How gets read: `ordered` like writes; read-only, answered by every node without
    /// ordering (`linearizable`: a quorum of matching answers; `serializable`: r + 1);
    /// or by read `index` (r + 1 nodes confirm how far a quorum accepted, then answer).
    #[arg(long, default_value = "ordered", value_parser = ["ordered", "linearizable", "serializable", "index"])]
    read: String,
}

impl BenchArgs {
    fn read_consistency(&self) -> Option<ReadConsistency> {
        match (self.op.as_str(), self.read.as_str()) {
            ("get", "linearizable") => Some(ReadConsistency::Linearizable),
            ("get", "serializable") => Some(ReadConsistency::Serializable),
            ("get", "index") => Some(ReadConsistency::Index),
            _ => None,
        }
    }
}

#[derive(Clone, Debug)]
struct Row {
    target: &'static str,
    clients: usize,
    ops_per_s: f64,
    p50_ms: f64,
    p90_ms: f64,
    p99_ms: f64,
    errors: usize,
    /// CPU % (of one core) of each node process over the step.
    node_cpu: Vec<f64>,
    client_cpu: f64,
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize].as_secs_f64() * 1e3
}

/// utime + stime of a process, in clock ticks.
fn cpu_ticks(pid: &str) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may contain spaces) start after ") ".
    let rest = stat.rsplit_once(") ")?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

const CLOCK_TICKS_PER_S: f64 = 100.0;

fn node_pids(dir: &Path) -> Vec<String> {
    crate::cluster::node_dirs(dir)
        .iter()
        .filter_map(|d| std::fs::read_to_string(d.join("data").join("node.pid")).ok())
        .map(|s| s.trim().to_string())
        .collect()
}

/// The `n`-th operation of worker `worker`. KV workers use interleaved keys so that all
/// `keys` are in use whatever the number of workers.
fn operation(service: &str, get: bool, req: usize, reply: u32, keys: u64, worker: usize, n: u64) -> Vec<u8> {
    match service {
        "null" => Null::request(req, reply),
        _ => {
            let key = format!("b{}", (worker as u64).wrapping_mul(7_919).wrapping_add(n) % keys.max(1)).into_bytes();
            if get {
                KvRequest::Get { key }.encode()
            } else {
                KvRequest::Put { key, value: vec![b'x'; req] }.encode()
            }
        }
    }
}

async fn step(dir: &Path, target: &'static str, a: &BenchArgs, service: &str, clients: usize) -> Result<Row, String> {
    // One client identity (one connection per node) per benchmark client; `outstanding`
    // sessions on it, each driven by its own task with one operation in flight.
    let sessions = a.outstanding.max(1);
    // Identities no other process uses (a `keel kv` running beside the benchmark holds
    // one): two users of one identity would reuse sequence numbers. Held for the step.
    let identities = crate::identity::claim_many(dir, clients)?;
    let mut conns = Vec::with_capacity(clients);
    for (id, _) in &identities {
        let setup = ClientFile::load(&dir.join(format!("client-{id}/client.toml"))).map_err(|e| e.to_string())?;
        conns.push(KeelClient::connect_sessions(setup, sessions).map_err(|e| e.to_string())?);
    }
    // What the step is doing, on a terminal only (stdout keeps the table).
    let bar = indicatif::ProgressBar::new(a.duration).with_style(
        indicatif::ProgressStyle::with_template("{prefix} {msg} [{bar:30}] {pos}/{len} s")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar.set_prefix(format!("{target}, {clients} clients:"));
    bar.set_message("warm-up");
    // Warm-up: connections and the first round trip of every session are not measured.
    // Gets read what the warm-up writes: every key once.
    let get = service == "kv" && a.op == "get";
    let mut warm = Vec::new();
    for (i, c) in conns.iter().enumerate() {
        for s in 0..sessions {
            let c = c.clone();
            let ops: Vec<Vec<u8>> = if get {
                let worker = i * sessions + s;
                let writers = (conns.len() * sessions) as u64;
                (0..a.keys.div_ceil(writers))
                    .map(|n| operation(service, false, a.req, a.reply, a.keys, worker, n * writers))
                    .collect()
            } else {
                vec![operation(service, false, a.req, a.reply, a.keys, 0, 0)]
            };
            warm.push(tokio::spawn(async move {
                for op in ops {
                    if c.invoke(op, Duration::from_secs(10)).await.is_err() {
                        return false;
                    }
                }
                true
            }));
        }
    }
    for w in warm {
        w.await.map_err(|e| e.to_string())?;
    }
    let pids = node_pids(dir);
    let self_pid = std::process::id().to_string();
    let before: Vec<Option<u64>> = pids.iter().map(|p| cpu_ticks(p)).collect();
    let self_before = cpu_ticks(&self_pid);
    let started = Instant::now();
    let end = started + Duration::from_secs(a.duration);
    let mut handles = Vec::new();
    let workers = conns.iter().flat_map(|c| std::iter::repeat_n(c.clone(), sessions));
    for (i, c) in workers.enumerate() {
        let (service, req, reply, keys, read) = (service.to_string(), a.req, a.reply, a.keys, a.read_consistency());
        handles.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut done_at = Vec::new();
            let mut errors = 0;
            let mut n = 0u64;
            while Instant::now() < end {
                let op = operation(&service, get, req, reply, keys, i, n);
                let t = Instant::now();
                match c.invoke_as(op, read, Duration::from_secs(10)).await {
                    Ok(_) => {
                        lat.push(t.elapsed());
                        done_at.push(keel_runtime::node::now_ms());
                    }
                    Err(_) => errors += 1,
                }
                n += 1;
            }
            (lat, errors, done_at)
        }));
    }
    bar.set_message("measuring");
    while Instant::now() < end {
        bar.set_position(started.elapsed().as_secs().min(a.duration));
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    bar.finish_and_clear();
    let mut all = Vec::new();
    let mut errors = 0;
    let mut completions = Vec::new();
    for h in handles {
        let (lat, e, done_at) = h.await.map_err(|e| e.to_string())?;
        all.extend(lat);
        errors += e;
        completions.extend(done_at);
    }
    if let Some(path) = &a.timeline {
        write_timeline(path, &completions)?;
    }
    let secs = started.elapsed().as_secs_f64();
    let cpu = |b: Option<u64>, pid: &str| match (b, cpu_ticks(pid)) {
        (Some(b), Some(a)) => (a - b) as f64 / CLOCK_TICKS_PER_S / secs * 100.0,
        _ => f64::NAN,
    };
    let node_cpu = pids.iter().zip(before).map(|(p, b)| cpu(b, p)).collect();
    let client_cpu = cpu(self_before, &self_pid);
    all.sort_unstable();
    Ok(Row {
        target,
        clients,
        ops_per_s: all.len() as f64 / secs,
        p50_ms: percentile(&all, 0.5),
        p90_ms: percentile(&all, 0.9),
        p99_ms: percentile(&all, 0.99),
        errors,
        node_cpu,
        client_cpu,
    })
}

/// Completions per 100 ms bucket, as ops/s, with each bucket's wall-clock start.
fn write_timeline(path: &Path, completions: &[u64]) -> Result<(), String> {
    const BUCKET_MS: u64 = 100;
    let (Some(first), Some(last)) = (completions.iter().min(), completions.iter().max()) else {
        return Ok(());
    };
    let start = first - first % BUCKET_MS;
    let mut counts = vec![0u64; ((last - start) / BUCKET_MS + 1) as usize];
    for t in completions {
        counts[((t - start) / BUCKET_MS) as usize] += 1;
    }
    let mut text = String::from("unix_ms\tops_per_s\n");
    for (i, c) in counts.iter().enumerate() {
        text.push_str(&format!("{}\t{}\n", start + i as u64 * BUCKET_MS, c * 1000 / BUCKET_MS));
    }
    std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))
}

impl Row {
    /// The row's fields, in the column order of the header, for TSV and CSV alike.
    fn cells(&self) -> Vec<String> {
        let cpus: Vec<String> = self.node_cpu.iter().map(|c| format!("{c:.0}")).collect();
        vec![
            self.target.to_string(),
            self.clients.to_string(),
            format!("{:.0}", self.ops_per_s),
            format!("{:.2}", self.p50_ms),
            format!("{:.2}", self.p90_ms),
            format!("{:.2}", self.p99_ms),
            self.errors.to_string(),
            cpus.join("/"),
            format!("{:.0}", self.client_cpu),
        ]
    }
}

fn print_row(r: &Row, baseline: Option<&Row>) {
    let mut cells = r.cells();
    if let Some(b) = baseline {
        cells.push(format!("{:.2}", r.ops_per_s / b.ops_per_s.max(1e-9)));
    }
    println!("{}", cells.join("\t"));
}

/// A one-node cluster of the same service and fsync policy, for the baseline.
struct Baseline {
    dir: PathBuf,
    node: Child,
}

impl Baseline {
    fn start(service: &str, fsync: FsyncPolicy, clients: usize) -> Result<Baseline, String> {
        let dir = std::env::temp_dir().join(format!("keel-bench-baseline-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let port = keel_runtime::provision::free_ports(2).ok_or("no free port for the baseline")?;
        let o = InitOptions {
            service: service.into(),
            u: 0,
            r: 0,
            host: "127.0.0.1".into(),
            hosts: Vec::new(),
            base_port: port,
            clients,
            fsync,
            auth: None,
            request_digests: None,
            checkpoint_interval: None,
            tick_ms: None,
            separated: false,
            rq_separated: false,
            front_ends: false,
            genesis: None,
            service_options: std::collections::BTreeMap::new(),
        };
        init(&dir, &o).map_err(|e| e.to_string())?;
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let node = Command::new(exe)
            .args(["node", "--config"])
            .arg(dir.join("node-0/node.toml"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| e.to_string())?;
        Ok(Baseline { dir, node })
    }
}

impl Drop for Baseline {
    fn drop(&mut self) {
        let _ = self.node.kill();
        let _ = self.node.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn plot(path: &Path, rows: &[Row]) -> Result<(), String> {
    use plotters::prelude::*;
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let max_x = rows.iter().map(|r| r.ops_per_s).fold(1.0, f64::max) * 1.1;
    let max_y = rows.iter().map(|r| r.p50_ms).fold(0.1, f64::max) * 1.2;
    let mut chart = ChartBuilder::on(&root)
        .caption("keel bench: median latency vs throughput", ("sans-serif", 22))
        .margin(20)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..max_x, 0.0..max_y)
        .map_err(|e| e.to_string())?;
    chart.configure_mesh().x_desc("throughput (ops/s)").y_desc("p50 latency (ms)").draw().map_err(|e| e.to_string())?;
    for (target, color) in [("cluster", RED), ("baseline", BLUE)] {
        let pts: Vec<(f64, f64)> =
            rows.iter().filter(|r| r.target == target).map(|r| (r.ops_per_s, r.p50_ms)).collect();
        if pts.is_empty() {
            continue;
        }
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label(target)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 4, color.filled()))).map_err(|e| e.to_string())?;
    }
    chart.configure_series_labels().border_style(BLACK).draw().map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())
}

pub fn run(a: BenchArgs) -> ExitCode {
    let counts: Result<Vec<usize>, _> = a.clients.split(',').map(str::parse).collect();
    let Ok(counts) = counts else {
        eprintln!("error: --clients takes a comma list of numbers");
        return ExitCode::from(2);
    };
    let node0 = match NodeFile::load(&a.dir.join("node-0/node.toml")) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let service = node0.service.clone();
    let rt = match a.threads {
        // One thread: every client task shares it, as the nodes' tasks do theirs (on a
        // small host, cross-thread wake-ups cost the load generator more than they buy).
        0 | 1 => tokio::runtime::Builder::new_current_thread().enable_all().build(),
        n => tokio::runtime::Builder::new_multi_thread().worker_threads(n).enable_all().build(),
    };
    let Ok(rt) = rt else {
        eprintln!("error: cannot start the runtime");
        return ExitCode::FAILURE;
    };
    let n = crate::cluster::node_dirs(&a.dir).len();
    println!(
        "# {n} nodes, service {service}, fsync {:?}, req {} B, reply {} B, {} s per step, {} outstanding per client; cpu in % of one core (2 cores total)",
        node0.fsync, a.req, a.reply, a.duration, a.outstanding
    );
    if service == "kv" {
        let what = match (a.op.as_str(), a.read.as_str()) {
            ("get", read) => format!("gets ({read})"),
            _ => "puts".to_string(),
        };
        println!("# kv {what} over {} distinct keys (state up to {} KiB)", a.keys, a.keys * a.req as u64 / 1024);
    }
    println!("target\tclients\tops/s\tp50_ms\tp90_ms\tp99_ms\terrors\tnode_cpu%\tclient_cpu%\tratio_to_baseline");
    let mut rows = Vec::new();
    for &c in &counts {
        match rt.block_on(step(&a.dir, "cluster", &a, &service, c)) {
            Ok(r) => {
                print_row(&r, None);
                rows.push(r);
            }
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    if !a.no_baseline {
        let most = counts.iter().max().copied().unwrap_or(1);
        let baseline = match Baseline::start(&service, node0.fsync, most) {
            Ok(b) => b,
            Err(e) => {
                eprintln!("error: baseline: {e}");
                return ExitCode::FAILURE;
            }
        };
        std::thread::sleep(Duration::from_millis(500));
        for &c in &counts {
            match rt.block_on(step(&baseline.dir, "baseline", &a, &service, c)) {
                Ok(r) => rows.push(r),
                Err(e) => {
                    eprintln!("error: baseline: {e}");
                    return ExitCode::FAILURE;
                }
            }
        }
        drop(baseline);
        for r in rows.iter().filter(|r| r.target == "baseline") {
            print_row(r, None);
        }
        println!("# cluster relative to the unreplicated baseline, same clients:");
        for r in rows.iter().filter(|r| r.target == "cluster") {
            let b = rows.iter().find(|b| b.target == "baseline" && b.clients == r.clients);
            print_row(r, b);
        }
    }
    if let Some(path) = &a.csv {
        let mut text =
            String::from("target,clients,ops_per_s,p50_ms,p90_ms,p99_ms,errors,node_cpu_percent,client_cpu_percent\n");
        for r in &rows {
            text.push_str(&r.cells().join(","));
            text.push('\n');
        }
        if let Err(e) = std::fs::write(path, text) {
            eprintln!("error: {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    }
    if let Some(path) = &a.plot {
        if let Err(e) = plot(path, &rows) {
            eprintln!("error: plot: {e}");
            return ExitCode::FAILURE;
        }
        println!("# plot written to {}", path.display());
    }
    ExitCode::SUCCESS
}
