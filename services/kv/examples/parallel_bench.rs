//! Microbenchmark of the CBASE parallelizer (not a test): executes a KV workload through
//! `Executor` as the replica does (one `execute` per decided batch) with a configurable
//! CPU cost per request, a share of requests that all conflict (writes to one hot key;
//! the rest write distinct keys), and 1, 2, 4 workers. Prints requests per second and the
//! speedup over one worker, and checks every configuration ends in the same snapshot.
//!
//! ```text
//! cargo run --release -p keel-kv --example parallel_bench -- \
//!     [--cost-us 0,10,100] [--conflict 0,10,100] [--workers 1,2,4] [--batch 64] [--requests 20000] [--repeat 3]
//! ```
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
use keel_core::message::{Request, Value};
use keel_core::service::{ConcurrentService, Conflicts, ExecCtx, RestoreError, Service};
use keel_kv::{Kv, KvRequest};
use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

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

/// KV plus `iters` rounds of work per request, on both execution paths.
struct Costly {
    kv: Kv,
    iters: u64,
}

struct CostlyHandle {
    inner: Arc<dyn ConcurrentService>,
    iters: u64,
}

impl ConcurrentService for CostlyHandle {
    fn execute_shared(&self, request: &[u8], ctx: &ExecCtx) -> Vec<u8> {
        burn(self.iters);
        self.inner.execute_shared(request, ctx)
    }
}

impl Service for Costly {
    fn execute(&mut self, request: &[u8], ctx: &ExecCtx) -> Vec<u8> {
        burn(self.iters);
        self.kv.execute(request, ctx)
    }
    fn conflicts(&self, request: &[u8]) -> Conflicts {
        self.kv.conflicts(request)
    }
    fn concurrent(&self) -> Option<Arc<dyn ConcurrentService>> {
        Some(Arc::new(CostlyHandle { inner: self.kv.concurrent()?, iters: self.iters }))
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
            Request::new(i % clients + 1, i / clients + 1, op.into())
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

/// Executes `values` with `workers`; returns (requests/s, cores used, snapshot digest).
fn measure(values: &[Value], requests: usize, iters: u64, workers: usize) -> (f64, Option<f64>, Digest) {
    let mut e = Executor::with_workers(Costly { kv: Kv::new(), iters }, workers);
    let cpu = cpu_seconds();
    let t = Instant::now();
    for (i, v) in values.iter().enumerate() {
        e.execute(i as u64 + 1, v);
    }
    let wall = t.elapsed().as_secs_f64();
    // /proc counts in 10 ms ticks: shorter runs would print noise.
    let cores = cpu.zip(cpu_seconds()).filter(|_| wall >= 0.2).map(|(a, b)| (b - a) / wall);
    (requests as f64 / wall, cores, Digest::of(&e.snapshot()))
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
    let costs = list(&args, "--cost-us", &[0, 10, 100])?;
    let conflicts = list(&args, "--conflict", &[0, 10, 100])?;
    let workers = list(&args, "--workers", &[1, 2, 4])?;
    let batch = list(&args, "--batch", &[64])?.first().copied().unwrap_or(64).max(1) as usize;
    let requests = list(&args, "--requests", &[20_000])?.first().copied().unwrap_or(20_000) as usize;
    let repeat = list(&args, "--repeat", &[3])?.first().copied().unwrap_or(3).max(1);

    let per_us = calibrate();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    println!(
        "# {requests} puts per cell, batches of {batch}, best of {repeat}, {cores} cores available; \
         1 us of cost = {per_us:.0} rounds; cell: ops/s (speedup over the first column, cores used)"
    );
    print!("{:>8} {:>9}", "cost_us", "conflict%");
    for w in &workers {
        print!(" {:>26}", format!("workers={w}"));
    }
    println!();
    for &cost in &costs {
        let iters = (cost as f64 * per_us) as u64;
        for &pct in &conflicts {
            let values = workload(requests, batch, pct);
            print!("{cost:>8} {pct:>9}");
            let mut base = None;
            let mut reference: Option<Digest> = None;
            for &w in &workers {
                let mut best: Option<(f64, Option<f64>)> = None;
                for _ in 0..repeat {
                    let (rate, used, digest) = measure(&values, requests, iters, w as usize);
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
                std::io::Write::flush(&mut std::io::stdout()).map_err(|e| e.to_string())?;
            }
            println!();
        }
    }
    Ok(())
}
