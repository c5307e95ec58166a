//! `keel bench`: closed-loop clients against a running cluster; throughput and latency.
//!
//! Each client keeps one operation outstanding (the protocol's per-client bound); load
//! grows with the number of clients. Results are printed, never asserted: this machine
//! is shared and noisy, so compare configurations measured in one run.

use clap::Args;
use keel_kv::KvRequest;
use keel_runtime::client::KeelClient;
use keel_runtime::config::{first_client_id, ClientFile};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// A cluster directory made by `keel init` (with at least --clients client identities).
    #[arg(long)]
    dir: PathBuf,
    /// Value bytes per put.
    #[arg(long, default_value_t = 0)]
    req: usize,
    /// Concurrent clients (comma list to sweep).
    #[arg(long, default_value = "1")]
    clients: String,
    /// Seconds per step.
    #[arg(long, default_value_t = 10)]
    duration: u64,
}

struct Step {
    clients: usize,
    ops: usize,
    secs: f64,
    p50: Duration,
    p90: Duration,
    p99: Duration,
    errors: usize,
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

async fn step(dir: &std::path::Path, clients: usize, req: usize, duration: Duration) -> Result<Step, String> {
    let mut handles = Vec::new();
    let started = Instant::now();
    let end = started + duration;
    for i in 0..clients {
        let id = first_client_id() + i as u64;
        let setup = ClientFile::load(&dir.join(format!("client-{id}/client.toml"))).map_err(|e| format!("{e} (keel init --clients {clients})"))?;
        let mut c = KeelClient::connect(setup).map_err(|e| e.to_string())?;
        handles.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut errors = 0;
            let mut n = 0u64;
            // Warm-up: connections and the first round trip are not measured.
            let _ = c.invoke(KvRequest::Get { key: b"warmup".to_vec() }.encode(), Duration::from_secs(10)).await;
            while Instant::now() < end {
                let op = KvRequest::Put { key: format!("b{i}-{}", n % 1024).into_bytes(), value: vec![b'x'; req] }.encode();
                let t = Instant::now();
                match c.invoke(op, Duration::from_secs(10)).await {
                    Ok(_) => lat.push(t.elapsed()),
                    Err(_) => errors += 1,
                }
                n += 1;
            }
            (lat, errors)
        }));
    }
    let mut all = Vec::new();
    let mut errors = 0;
    for h in handles {
        let (lat, e) = h.await.map_err(|e| e.to_string())?;
        all.extend(lat);
        errors += e;
    }
    let secs = started.elapsed().as_secs_f64();
    all.sort_unstable();
    Ok(Step { clients, ops: all.len(), secs, p50: percentile(&all, 0.5), p90: percentile(&all, 0.9), p99: percentile(&all, 0.99), errors })
}

pub fn run(a: BenchArgs) -> ExitCode {
    let counts: Result<Vec<usize>, _> = a.clients.split(',').map(str::parse).collect();
    let Ok(counts) = counts else {
        eprintln!("error: --clients takes a comma list of numbers");
        return ExitCode::from(2);
    };
    let Ok(rt) = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() else {
        eprintln!("error: cannot start the runtime");
        return ExitCode::FAILURE;
    };
    println!("clients\tops/s\tp50_ms\tp90_ms\tp99_ms\terrors");
    for n in counts {
        match rt.block_on(step(&a.dir, n, a.req, Duration::from_secs(a.duration))) {
            Ok(s) => println!(
                "{}\t{:.0}\t{:.2}\t{:.2}\t{:.2}\t{}",
                s.clients,
                s.ops as f64 / s.secs,
                s.p50.as_secs_f64() * 1e3,
                s.p90.as_secs_f64() * 1e3,
                s.p99.as_secs_f64() * 1e3,
                s.errors
            ),
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}
