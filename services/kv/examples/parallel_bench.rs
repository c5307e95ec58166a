//! Microbenchmark of the CBASE parallelizer (not a test): executes a KV workload through
//! `Executor` as the replica does (`execute_many` over runs of `--run` decided batches)
//! with a configurable cost per request, a share of requests that all conflict (writes to
//! one hot key; the rest write distinct keys), and 1, 2, 4 workers. Prints requests per
//! second and the speedup over one worker, checks every configuration ends in the same
//! snapshot, and with `--plot FILE` draws the speedups (SVG, one panel per conflict share).
//!
//! ```text
//! cargo run --release -p keel-kv --example parallel_bench -- \
//!     [--cost 0,10,100,fsync] [--conflict 0,10,100] [--workers 1,2,4] [--batch 64] [--run 1]
//!     [--requests 20000] [--repeat 3] [--dir /var/tmp] [--plot speedup.svg]
//! ```
//!
//! A cost is either a number (microseconds of CPU work) or `fsync`: the request writes its
//! value over the file named by its key (in a directory under `--dir`, created by the
//! first run and overwritten after) and fdatasyncs it, as a service that keeps one durable
//! file per key would. Such requests wait on the
//! disk, not the CPU, so workers can overlap them beyond the core count. Fsync rows run
//! a fifth of `--requests` (an fsync here is ~0.1-1 ms).
//!
//! Each cell is the best of `--repeat` runs (other load on the host only ever slows a
//! run down), with the CPU cores the process used on average in that run (from
//! /proc/self/stat; "?" elsewhere or for runs under 0.2 s): a speedup needs free cores,
//! and this column shows whether the host had them.
//!
//! The cost is a fixed amount of computation calibrated to N microseconds on one idle
//! core, not a sleep or a spin on the clock: a descheduled thread makes no progress, so
//! workers beyond the free cores cannot fake a speedup.

use keel_core::crypto::Digest;
use keel_core::exec::Executor;
use keel_core::ids::ClientId;
use keel_core::ids::Seq;
use keel_core::message::{Request, Value};
use keel_core::service::{ConcurrentService, Conflicts, ExecCtx, RestoreError, Service};
use keel_kv::{Kv, KvRequest};
use std::hint::black_box;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// The work each request does besides the KV operation.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Cost {
    /// Rounds of [`burn`] (calibrated microseconds of CPU).
    Cpu { us: u64, iters: u64 },
    /// Write the value to the key's file and fdatasync it.
    Fsync,
}

impl Cost {
    fn label(&self) -> String {
        match self {
            Cost::Cpu { us, .. } => format!("{us} us cpu"),
            Cost::Fsync => "fsync".to_string(),
        }
    }
}

/// Writes `request`'s value durably to a file named after its key (hex, so any key is a
/// valid file name).
fn write_durably(dir: &Path, request: &[u8]) {
    let Ok(KvRequest::Put { key, value }) = KvRequest::decode(request) else { return };
    let name: String = key.iter().map(|b| format!("{b:02x}")).collect();
    // Overwritten in place (values of one size), not recreated: creating and unlinking
    // thousands of files between runs made the disk's journal and discards the measure.
    let write = || -> std::io::Result<()> {
        let f = std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(dir.join(name))?;
        f.write_all_at(&value, 0)?;
        f.sync_data()
    };
    // A benchmark: a failing disk ends it loudly rather than measuring nothing.
    if let Err(e) = write() {
        panic!("parallel_bench: writing under {}: {e}", dir.display());
    }
}

/// Does `cost` for `request` (on whichever thread executes it).
fn spend(cost: Cost, dir: &Path, request: &[u8]) {
    match cost {
        Cost::Cpu { iters, .. } => {
            burn(iters);
        }
        Cost::Fsync => write_durably(dir, request),
    }
}

/// `iters` rounds of a multiply-xorshift mix: CPU work the optimizer cannot remove.
fn burn(iters: u64) -> u64 {
    let mut x = black_box(0x9e37_79b9_7f4a_7c15u64);
    for i in 0..iters {
        x ^= x >> 29;
        x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9).wrapping_add(i);
    }
    black_box(x)
}

/// Rounds of [`burn`] per microsecond on this machine (best of a few tries).
fn calibrate() -> f64 {
    let iters = 2_000_000;
    (0..5)
        .map(|_| {
            let t = Instant::now();
            burn(iters);
            iters as f64 / (t.elapsed().as_secs_f64() * 1e6)
        })
        .fold(0.0, f64::max)
}

/// KV plus a cost per request, on both execution paths.
struct Costly {
    kv: Kv,
    cost: Cost,
    dir: Arc<PathBuf>,
}

struct CostlyHandle {
    inner: Arc<dyn ConcurrentService>,
    cost: Cost,
    dir: Arc<PathBuf>,
}

impl ConcurrentService for CostlyHandle {
    fn execute_shared(&self, request: &[u8], ctx: &ExecCtx) -> Vec<u8> {
        spend(self.cost, &self.dir, request);
        self.inner.execute_shared(request, ctx)
    }
}

impl Service for Costly {
    fn execute(&mut self, request: &[u8], ctx: &ExecCtx) -> Vec<u8> {
        spend(self.cost, &self.dir, request);
        self.kv.execute(request, ctx)
    }
    fn conflicts(&self, request: &[u8]) -> Conflicts {
        self.kv.conflicts(request)
    }
    fn concurrent(&self) -> Option<Arc<dyn ConcurrentService>> {
        Some(Arc::new(CostlyHandle { inner: self.kv.concurrent()?, cost: self.cost, dir: self.dir.clone() }))
    }
    fn snapshot(&self) -> Vec<u8> {
        self.kv.snapshot()
    }
    fn restore(&mut self, snapshot: &[u8]) -> Result<(), RestoreError> {
        self.kv.restore(snapshot)
    }
}

/// `requests` puts in batches of `batch`; `conflict_pct` % of them (spread by a fixed
/// xorshift) write the key "hot", the rest a key of their own.
fn workload(requests: usize, batch: usize, conflict_pct: u64) -> Vec<Value> {
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let clients = 1000u64;
    let reqs: Vec<Request> = (0..requests as u64)
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let key = if x % 100 < conflict_pct { b"hot".to_vec() } else { format!("k{i}").into_bytes() };
            let op = KvRequest::Put { key, value: i.to_le_bytes().to_vec() }.encode();
            Request::new(ClientId(i % clients + 1), i / clients + 1, op.into())
        })
        .collect();
    reqs.chunks(batch).enumerate().map(|(t, c)| Value { time: t as u64, requests: c.to_vec() }).collect()
}

/// CPU seconds (user + system, all threads) this process used so far, on Linux.
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // USER_HZ is 100 on every Linux configuration that matters here.
    Some(ticks as f64 / 100.0)
}

/// Executes `values` with `workers`, `run` values per call; returns (requests/s, cores
/// used, snapshot digest).
fn measure(
    values: &[Value],
    requests: usize,
    cost: Cost,
    dir: &Path,
    workers: usize,
    run: usize,
) -> Result<(f64, Option<f64>, Digest), String> {
    // One directory for every run: after the first, each write overwrites its key's file.
    let dir = Arc::new(dir.to_path_buf());
    std::fs::create_dir_all(dir.as_path()).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mut e = Executor::with_workers(Costly { kv: Kv::new(), cost, dir: dir.clone() }, workers);
    let cpu = cpu_seconds();
    let t = Instant::now();
    let mut next = 1;
    for chunk in values.chunks(run) {
        let refs: Vec<&Value> = chunk.iter().collect();
        e.execute_many(Seq(next), &refs);
        next += refs.len() as u64;
    }
    let wall = t.elapsed().as_secs_f64();
    // /proc counts in 10 ms ticks: shorter runs would print noise.
    let cores = cpu.zip(cpu_seconds()).filter(|_| wall >= 0.2).map(|(a, b)| (b - a) / wall);
    Ok((requests as f64 / wall, cores, Digest::of(&e.snapshot())))
}

/// Parses `--cost`: numbers are microseconds of CPU, `fsync` a durable file write.
fn costs(args: &[String], per_us: f64) -> Result<Vec<Cost>, String> {
    let spec = match args.iter().position(|a| a == "--cost") {
        None => "0,10,100,fsync".to_string(),
        Some(i) => args.get(i + 1).ok_or("--cost needs a value")?.clone(),
    };
    spec.split(',')
        .map(|s| match s.trim() {
            "fsync" => Ok(Cost::Fsync),
            n => {
                let us = n.parse::<u64>().map_err(|e| format!("--cost {n:?}: {e} (a number of us, or fsync)"))?;
                Ok(Cost::Cpu { us, iters: (us as f64 * per_us) as u64 })
            }
        })
        .collect()
}

/// One measured cell: cost, conflict %, workers, ops/s.
struct Cell {
    cost: Cost,
    conflict: u64,
    workers: u64,
    rate: f64,
}

/// Speedup over the first worker count, one panel per conflict share, a line per cost.
fn plot(path: &Path, cells: &[Cell], conflicts: &[u64], workers: &[u64], cores: usize) -> Result<(), String> {
    use plotters::prelude::*;
    let root = SVGBackend::new(path, (1200, 460)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let root = root
        .titled(
            &format!("CBASE parallel execution: speedup over {} worker ({cores} cores)", workers[0]),
            ("sans-serif", 20),
        )
        .map_err(|e| e.to_string())?;
    let max_w = workers.iter().copied().max().unwrap_or(1) as f64;
    let speedup = |c: &Cell| {
        let base = cells.iter().find(|b| b.cost == c.cost && b.conflict == c.conflict && b.workers == workers[0]);
        base.map_or(1.0, |b| c.rate / b.rate)
    };
    let max_y = cells.iter().map(speedup).fold(2.0, f64::max) * 1.15;
    let mut cost_list: Vec<Cost> = Vec::new();
    for c in cells {
        if !cost_list.contains(&c.cost) {
            cost_list.push(c.cost);
        }
    }
    let panels = root.split_evenly((1, conflicts.len().max(1)));
    for (panel, &pct) in panels.iter().zip(conflicts) {
        let mut chart = ChartBuilder::on(panel)
            .caption(format!("{pct} % conflicting"), ("sans-serif", 16))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(44)
            .build_cartesian_2d(0.5..max_w + 0.5, 0.0..max_y)
            .map_err(|e| e.to_string())?;
        chart.configure_mesh().x_desc("workers").y_desc("speedup").draw().map_err(|e| e.to_string())?;
        for (i, cost) in cost_list.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            let pts: Vec<(f64, f64)> = cells
                .iter()
                .filter(|c| c.cost == *cost && c.conflict == pct)
                .map(|c| (c.workers as f64, speedup(c)))
                .collect();
            chart
                .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
                .map_err(|e| e.to_string())?
                .label(cost.label())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
            chart.draw_series(pts.into_iter().map(|p| Circle::new(p, 4, color.filled()))).map_err(|e| e.to_string())?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .border_style(BLACK)
            .draw()
            .map_err(|e| e.to_string())?;
    }
    root.present().map_err(|e| e.to_string())
}

fn list(args: &[String], name: &str, default: &[u64]) -> Result<Vec<u64>, String> {
    match args.iter().position(|a| a == name) {
        None => Ok(default.to_vec()),
        Some(i) => {
            let v = args.get(i + 1).ok_or(format!("{name} needs a value"))?;
            v.split(',').map(|s| s.trim().parse::<u64>().map_err(|e| format!("{name} {s:?}: {e}"))).collect()
        }
    }
}

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let conflicts = list(&args, "--conflict", &[0, 10, 100])?;
    let workers = list(&args, "--workers", &[1, 2, 4])?;
    let batch = list(&args, "--batch", &[64])?.first().copied().unwrap_or(64).max(1) as usize;
    let run = list(&args, "--run", &[1])?.first().copied().unwrap_or(1).max(1) as usize;
    let requests = list(&args, "--requests", &[20_000])?.first().copied().unwrap_or(20_000) as usize;
    let repeat = list(&args, "--repeat", &[3])?.first().copied().unwrap_or(3).max(1);
    let flag = |name: &str| args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map(PathBuf::from);
    let base_dir = flag("--dir").unwrap_or_else(std::env::temp_dir);
    let plot_path = flag("--plot");
    if workers.is_empty() {
        return Err("--workers needs at least one count".to_string());
    }

    let per_us = calibrate();
    let costs = costs(&args, per_us)?;
    let dir = base_dir.join(format!("keel-parallel-bench.{}", std::process::id()));
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "# batches of {batch}, {run} batch(es) per execute_many, best of {repeat}, {cores} cores available; \
         1 us of cost = {per_us:.0} rounds; fsync files under {}; cell: ops/s (speedup over the first column, cores used)",
        dir.display()
    );
    print!("{:>10} {:>9} {:>8}", "cost", "conflict%", "requests");
    for w in &workers {
        print!(" {:>26}", format!("workers={w}"));
    }
    println!();
    let mut cells = Vec::new();
    let result = (|| -> Result<(), String> {
        for &cost in &costs {
            let n = if cost == Cost::Fsync { (requests / 5).max(1) } else { requests };
            for &pct in &conflicts {
                let values = workload(n, batch, pct);
                print!("{:>10} {pct:>9} {n:>8}", cost.label());
                let mut base = None;
                let mut reference: Option<Digest> = None;
                for &w in &workers {
                    let mut best: Option<(f64, Option<f64>)> = None;
                    for _ in 0..repeat {
                        let (rate, used, digest) = measure(&values, n, cost, &dir, w as usize, run)?;
                        if *reference.get_or_insert(digest) != digest {
                            return Err(format!("workers={w} ended in a different state than workers={}", workers[0]));
                        }
                        if best.is_none_or(|(r, _)| rate > r) {
                            best = Some((rate, used));
                        }
                    }
                    let Some((rate, used)) = best else { continue };
                    let speedup = rate / *base.get_or_insert(rate);
                    let used = used.map_or("?".to_string(), |c| format!("{c:.1}"));
                    print!(" {:>26}", format!("{rate:.0} ({speedup:.2}x, {used}c)"));
                    std::io::stdout().flush().map_err(|e| e.to_string())?;
                    cells.push(Cell { cost, conflict: pct, workers: w, rate });
                }
                println!();
            }
        }
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result?;
    if let Some(path) = plot_path {
        plot(&path, &cells, &conflicts, &workers, cores)?;
        println!("# plot: {}", path.display());
    }
    Ok(())
}
