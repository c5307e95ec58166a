//! `keel sim`: many seeds of the simulator, a summary line, and a replay hint for any
//! seed that breaks a property.

mod attacks;

use clap::Args;
use keel_core::config::{Auth, Options};
use keel_core::quorum::{Mutation, Quorums};
use keel_sim::{Behaviours, DriverMutation, FaultCounts, FaultSet, SeedReport, SimOptions};
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

#[derive(Args, Debug, Clone)]
pub struct SimArgs {
    /// The service whose simulator model runs: its workload and linearizability check
    /// (kv; the others are not modelled yet).
    #[arg(long, default_value = "kv")]
    service: String,
    /// How many seeds to run (seeds 1..=N, or S..S+N with --seed).
    #[arg(long, default_value_t = 100)]
    seeds: u64,
    /// Run from this seed (with --seeds 1, exactly this seed, printing its trace).
    #[arg(long)]
    seed: Option<u64>,
    /// Failures tolerated while staying up.
    #[arg(long, default_value_t = 1)]
    u: u32,
    /// Of those, arbitrary (Byzantine) ones tolerated while staying right.
    #[arg(long, default_value_t = 1)]
    r: u32,
    /// none | crash | network | byzantine | all (or a comma list).
    #[arg(long, default_value = "all")]
    faults: String,
    /// Events in each seed's fault phase (default 60000; with --report attacks 20000 per
    /// order node, long enough for every node to lead once under its leader rotation).
    #[arg(long)]
    steps: Option<u64>,
    /// Simulated clients (default 16; with --report attacks 4). Sixteen clients over
    /// 60000 events complete about 330 operations per (1, 1) seed under every fault,
    /// against about 60 with 4 over 20000 (issue #21: a rare interleaving, such as a read
    /// racing a write some nodes have not executed, needs many operations to show).
    #[arg(long)]
    clients: Option<usize>,
    /// Switch on a deliberate bug to show the checkers catch it:
    /// quorum-minus-one | skip-write | unverified-view-change-proof | read-without-wait |
    /// index-without-quorum | serializable-without-wait | one-endorsement | one-push-copy |
    /// unverified-epoch-certs | unfrozen-checkpoint | unchecked-body | one-commit-notice |
    /// one-exec-hash | one-reply | no-epoch-end-checkpoint | rq-stays-in-epoch | propose-before-view-durable |
    /// wiped-node-votes | exec-checkpoint-on-r-plus-one | epochless-statements | unverified-epoch-replies |
    /// restore-without-time (with --tick-ms) |
    /// blind-endorser-routing (a throughput bug: --report attacks catches it) |
    /// skip-barrier-sync (the simulator's driver: no sync at a durability barrier).
    #[arg(long)]
    mutate: Option<String>,
    /// Request authentication: rq-mac | mac | sig | none (default: rq-mac when r > 0,
    /// else mac).
    #[arg(long, value_parser = crate::parse_auth)]
    auth: Option<Auth>,
    /// Execution threads per simulated node (Options::exec_workers). Outcomes must not
    /// depend on it: the same seeds give the same trace_hash with 1 and with 4.
    #[arg(long, default_value_t = 1)]
    exec_workers: usize,
    /// Worker threads (seeds run independently; results are printed in seed order).
    #[arg(long, default_value_t = 2)]
    threads: usize,
    /// Print one line per seed.
    #[arg(long)]
    verbose: bool,
    /// An administrator adds and removes nodes while the faults run (two spare nodes).
    #[arg(long)]
    reconfig: bool,
    /// Rotate the primary after this long (simulated ms) in a view, whatever its speed
    /// (Options::leader_rotate_ms, Aardvark's regular view changes). Default 0 (off);
    /// with --report attacks 400, so that every node leads and view changes happen.
    #[arg(long)]
    rotate_leader_ms: Option<u64>,
    /// Agreed-time ticks every this many simulated ms (Options::tick_ms; 0: off): idle
    /// primaries propose empty instances, KV drops watch leases (of three ticks) at
    /// ticks, and checkpoint agreement checks every node ticked alike.
    #[arg(long, default_value_t = 0)]
    tick_ms: u64,
    /// Stage placement (UpRight's request quorum, order and execution stages): co-located (every node runs RQ, order and
    /// execution), separated (2u + r + 1 RQ nodes and 2u + 1 execution nodes besides
    /// the order nodes), or one stage apart: separated-exec, separated-rq.
    #[arg(long, default_value = "co-located", value_parser = crate::cluster::LAYOUTS)]
    layout: String,
    /// Pin the Byzantine order node and what it does, instead of the seed choosing:
    /// NODE:BEHAVIOUR[+BEHAVIOUR...] (e.g. 1:forge-endorsements), or `none` for no
    /// Byzantine node (a faulty client still runs under --faults byzantine). Behaviours:
    /// equivocate, corrupt, replay, forge-view-change, silent-primary, junk, rush-reads,
    /// slow-primary, forge-endorsements, forge-epoch-certs, withhold-bodies,
    /// conflicting-votes, hide-certs, pick-new-view, wrong-checkpoints, censor-client, wrong-replies. With
    /// --report attacks: only that behaviour, only at that node.
    #[arg(long, value_parser = parse_pin)]
    byzantine: Option<Pin>,
    /// `attacks`: throughput under attack (Aardvark). For each Byzantine behaviour, every
    /// seed runs with one order node doing only that, at each position in turn, and
    /// once with no Byzantine node; Byzantine faults only (--faults is ignored). Prints
    /// operations and operations per simulated second with and without per behaviour,
    /// and fails if any run keeps less than half of either against its seed's run
    /// without. --mutate applies to both runs of a seed.
    #[arg(long, value_parser = ["attacks"])]
    report: Option<String>,
}

/// `--byzantine`: which order nodes lie, and how.
#[derive(Clone, Debug)]
pub struct Pin {
    nodes: Vec<keel_core::message::NodeId>,
    behaviours: Behaviours,
    /// As given, for the replay line.
    text: String,
}

fn parse_pin(text: &str) -> Result<Pin, String> {
    if text == "none" {
        return Ok(Pin { nodes: Vec::new(), behaviours: Behaviours::default(), text: text.into() });
    }
    let (node, names) = text.split_once(':').ok_or("expected NODE:BEHAVIOUR[+BEHAVIOUR...] or none")?;
    let node = node.parse().map_err(|_| format!("{node:?} is not a node index"))?;
    let mut behaviours = Behaviours::default();
    for name in names.split('+') {
        behaviours = behaviours
            .with(name)
            .ok_or_else(|| format!("unknown behaviour {name:?}; known: {}", Behaviours::NAMES.join(", ")))?;
    }
    Ok(Pin { nodes: vec![node], behaviours, text: text.into() })
}

/// Runs `jobs` on `threads` workers; reports come back in job order. `done` sees each
/// as it finishes.
fn run_jobs(
    jobs: &[SimOptions],
    threads: usize,
    run_seed: fn(&SimOptions) -> SeedReport,
    done: impl Fn(&SeedReport) + Sync,
) -> Vec<SeedReport> {
    let next = AtomicU64::new(0);
    let reports: Mutex<Vec<(usize, SeedReport)>> = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..threads.max(1) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed) as usize;
                let Some(job) = jobs.get(i) else { break };
                let report = run_seed(job);
                done(&report);
                reports.lock().unwrap_or_else(|p| p.into_inner()).push((i, report));
            });
        }
    });
    let mut reports = reports.into_inner().unwrap_or_else(|p| p.into_inner());
    reports.sort_by_key(|(i, _)| *i);
    reports.into_iter().map(|(_, r)| r).collect()
}

pub fn run(mut args: SimArgs) -> ExitCode {
    let order_nodes = Quorums::new(args.u, args.r).map_or(0, |q| q.order_nodes() as u64);
    args.steps = args.steps.or(Some(if args.report.is_some() { 20_000 * order_nodes } else { 60_000 }));
    args.clients = args.clients.or(Some(if args.report.is_some() { 4 } else { 16 }));
    args.rotate_leader_ms = args.rotate_leader_ms.or(Some(if args.report.is_some() { attacks::ROTATE_MS } else { 0 }));
    let clients = args.clients.unwrap_or_default();
    let steps = args.steps.unwrap_or_default();
    let Some(faults) = FaultSet::parse(&args.faults) else {
        eprintln!("error: --faults must be none, crash, network, byzantine or all (got {:?})", args.faults);
        return ExitCode::from(2);
    };
    if let Err(e) = Quorums::new(args.u, args.r) {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    let model = match crate::services::sim_model(&args.service) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    // A core mutation (keel-core's quorum.rs) or a driver one (keel-sim's mutation.rs).
    let (mutation, driver_mutation) = match args.mutate.as_deref() {
        None => (None, None),
        Some(name) => match (Mutation::from_name(name), DriverMutation::from_name(name)) {
            (Some(m), _) => (Some(m), None),
            (None, Some(d)) => (None, Some(d)),
            (None, None) => {
                let core = Mutation::ALL.iter().map(|m| m.name());
                let known: Vec<_> = core.chain(DriverMutation::ALL.iter().map(|m| m.name())).collect();
                eprintln!("error: unknown mutation {name:?}; known: {}", known.join(", "));
                return ExitCode::from(2);
            }
        },
    };
    if args.mutate.is_some() && !cfg!(feature = "mutations") {
        // A production build has no mutations (keel-core's `mutations` feature).
        eprintln!(
            "error: --mutate: this keel was built without the checker mutations; build it with \
             `cargo build --release -p keel-cli --features mutations` (scripts/test does)"
        );
        return ExitCode::from(2);
    }
    let auth = args.auth;
    let (separated, rq_separated) = crate::cluster::layout_stages(&args.layout);
    if crate::services::fixed_cluster(&args.service) && (separated || rq_separated || args.reconfig) {
        eprintln!(
            "error: the {} service runs on a fixed, co-located cluster: no --layout apart, no --reconfig",
            args.service
        );
        return ExitCode::from(2);
    }
    if rq_separated && auth.is_some_and(|a| a != keel_core::config::Auth::RqMac) {
        eprintln!("error: --layout {} needs --auth rq-mac (RQ nodes endorse requests)", args.layout);
        return ExitCode::from(2);
    }

    let first = args.seed.unwrap_or(1);
    let seeds: Vec<u64> = (first..first + args.seeds).collect();
    let make = |seed| SimOptions {
        steps,
        clients,
        mutation,
        driver_mutation,
        auth,
        reconfig: args.reconfig,
        separated,
        rq_separated,
        byzantine: args.byzantine.as_ref().map(|p| (p.nodes.clone(), p.behaviours.clone())),
        options: Options {
            exec_workers: args.exec_workers,
            leader_rotate_ms: args.rotate_leader_ms.unwrap_or_default(),
            tick_ms: args.tick_ms,
            ..Options::test_min()
        },
        ..SimOptions::new(seed, args.u, args.r, faults)
    };
    if let Err(e) = make(0).options.validate() {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    let n = Quorums::new(args.u, args.r).map_or(0, |q| q.order_nodes());
    if let Some(pin) = args.byzantine.as_ref().filter(|p| p.nodes.iter().any(|&i| i.0 as usize >= n)) {
        eprintln!("error: --byzantine {}: there are {n} order nodes (0..{n})", pin.text);
        return ExitCode::from(2);
    }
    if args.report.is_some() {
        return attacks::run(&args, &seeds, make, model);
    }
    let started = std::time::Instant::now();
    let jobs: Vec<SimOptions> = seeds.iter().map(|&seed| make(seed)).collect();
    // Seeds done and violations so far, on a terminal only (stdout keeps the summary).
    let bar = indicatif::ProgressBar::new(jobs.len() as u64).with_style(
        indicatif::ProgressStyle::with_template("seeds [{bar:30}] {pos}/{len} {msg} ({elapsed}, about {eta} left)")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let violated = AtomicU64::new(0);
    let reports = run_jobs(&jobs, args.threads, model, |report| {
        if !report.violations.is_empty() {
            let v = violated.fetch_add(1, Ordering::Relaxed) + 1;
            bar.set_message(format!("{v} with violations"));
        }
        bar.inc(1);
        if args.verbose {
            let line = format!(
                "seed {}: steps {} ops {} ({} simulated ms) view-changes {} transfers {} executed {} {}",
                report.seed,
                report.steps,
                report.ops_completed,
                report.fault_phase_ms,
                report.view_changes,
                report.state_transfers,
                report.max_executed,
                if report.violations.is_empty() { "ok" } else { "VIOLATION" }
            );
            // Above the bar on a terminal; a plain line otherwise.
            bar.suspend(|| eprintln!("{line}"));
        }
    });

    bar.finish_and_clear();
    let mut totals = FaultCounts::default();
    let (mut total_steps, mut ops, mut vcs, mut transfers, mut rejected) = (0, 0, 0, 0, 0);
    let (mut reads_unordered, mut reads_ordered, mut slow_primary) = (0, 0, 0);
    let (mut pushes, mut push_gaps, mut ticks) = (0, 0, 0);
    let (mut transfer_chunks, mut transfer_reused) = (0, 0);
    let (mut checkpoints_background, mut checkpoints_lost) = (0, 0);
    let (mut ops_by_digest, mut ops_fetched) = (0, 0);
    let mut trace = blake3::Hasher::new();
    let mut failed = Vec::new();
    for r in &reports {
        totals.add(&r.faults);
        total_steps += r.steps;
        ops += r.ops_completed;
        reads_unordered += r.reads_unordered;
        slow_primary += r.slow_primary_suspicions;
        pushes += r.pushes_delivered;
        push_gaps += r.push_gaps;
        ticks += r.ticks;
        reads_ordered += r.reads_ordered;
        vcs += r.view_changes;
        transfers += r.state_transfers;
        transfer_chunks += r.transfer_chunks;
        transfer_reused += r.transfer_chunks_reused;
        checkpoints_background += r.checkpoints_background;
        checkpoints_lost += r.checkpoints_lost;
        ops_by_digest += r.ops_by_digest;
        ops_fetched += r.ops_fetched;
        rejected += r.rejected;
        trace.update(&r.seed.to_le_bytes());
        trace.update(&r.trace_hash.to_le_bytes());
        if !r.violations.is_empty() {
            failed.push(r);
        }
    }
    if args.verbose {
        let mut by: std::collections::BTreeMap<&str, u64> = Default::default();
        for r in &reports {
            for (k, v) in &r.rejected_by {
                *by.entry(k).or_default() += v;
            }
        }
        for (k, v) in by {
            eprintln!("rejected {k}: {v}");
        }
    }
    for r in &failed {
        for v in &r.violations {
            println!("seed {}: VIOLATION {} at {} ms: {}", r.seed, v.property, v.at, v.detail);
        }
        if args.seeds == 1 || failed.len() <= 3 {
            println!("  last trace lines of seed {}:", r.seed);
            for line in &r.trace_tail {
                println!("    {line}");
            }
        }
        println!(
            "  replay: keel sim --seeds 1 --seed {} --u {} --r {} --faults {} --steps {} --clients {}{}",
            r.seed,
            args.u,
            args.r,
            args.faults,
            steps,
            clients,
            args.mutate.as_ref().map(|m| format!(" --mutate {m}")).unwrap_or_default()
                + &args.auth.map(|a| format!(" --auth {}", a.name())).unwrap_or_default()
                + if args.reconfig { " --reconfig" } else { "" }
                + &args.byzantine.as_ref().map(|p| format!(" --byzantine {}", p.text)).unwrap_or_default()
                + &if args.layout == "co-located" { String::new() } else { format!(" --layout {}", args.layout) }
                + &if args.exec_workers == 1 {
                    String::new()
                } else {
                    format!(" --exec-workers {}", args.exec_workers)
                }
                + &match args.rotate_leader_ms {
                    Some(ms) if ms > 0 => format!(" --rotate-leader-ms {ms}"),
                    _ => String::new(),
                }
                + &if args.tick_ms > 0 { format!(" --tick-ms {}", args.tick_ms) } else { String::new() }
        );
    }
    let l = &totals.lies;
    println!(
        "faults: crashes={} total_outages={} restarts={} torn_writes={} partitions={} dropped={} duplicated={} delayed={} skewed_clocks={} byzantine_nodes={} admin_ops={} epochs={} epoch_switch_crashes={} wipes={} rejoined={} crashes_before_sync={} gone={} clock_jumps={} stragglers={} crashes_during_rejoin={} equivocations={} corruptions={} replays={} forged_view_changes={} silenced={} junk_frames={} rushed_reads={} index_lies={} slowed_proposals={} forged_endorsements={} forged_epoch_certs={} withheld_bodies={} conflicting_votes={} hidden_certs={} picked_new_views={} short_new_views={} wrong_checkpoint_votes={} false_transfers={} censored={} old_epoch_replays={} wrong_replies={} latent_turned={} inconsistent_macs={} exec_lies={} rq_lies={}",
        totals.crashes, totals.total_outages, totals.restarts, totals.torn_writes, totals.partitions, totals.dropped,
        totals.duplicated, totals.delayed, totals.skewed_clocks, totals.byzantine_nodes, totals.admin_ops, totals.epochs, totals.epoch_switch_crashes, totals.wipes, totals.rejoined, totals.crashes_before_sync, totals.gone, totals.clock_jumps, totals.stragglers, totals.crashes_during_rejoin,
        l.equivocations, l.corruptions,
        l.replays, l.forged_view_changes, l.silenced, l.junk_frames, l.rushed_reads, l.index_lies, l.slowed_proposals,
        l.forged_endorsements, l.forged_epoch_certs, l.withheld_bodies, l.conflicting_votes, l.hidden_certs,
        l.picked_new_views, l.short_new_views, l.wrong_checkpoint_votes, l.false_transfers, l.censored, l.old_epoch_replays,
        l.wrong_replies, totals.latent_turned, totals.inconsistent_macs, totals.exec_lies, totals.rq_lies
    );
    println!(
        "work: ops_completed={ops} reads_unordered={reads_unordered} reads_ordered={reads_ordered} view_changes={vcs} slow_primary_suspicions={slow_primary} state_transfers={transfers} transfer_chunks={transfer_chunks} transfer_chunks_held={transfer_reused} background_checkpoints={checkpoints_background} (lost to crashes {checkpoints_lost}) ops_by_digest={ops_by_digest} ops_fetched={ops_fetched} rejected_inputs={rejected} pushes={pushes} push_gaps={push_gaps} ticks={ticks} elapsed={:.1}s (u={}, r={}, faults={}, options={})",
        started.elapsed().as_secs_f64(),
        args.u,
        args.r,
        args.faults,
        match make(0).options {
            o if o == Options::test_min() => "test_min".to_string(),
            o if o == (Options { exec_workers: o.exec_workers, ..Options::test_min() }) => {
                format!("test_min+exec_workers={}", o.exec_workers)
            }
            o if o == (Options { tick_ms: o.tick_ms, ..Options::test_min() }) => {
                format!("test_min+tick_ms={}", o.tick_ms)
            }
            _ => "custom".to_string(),
        }
    );
    let mut properties: Vec<&str> = failed.iter().flat_map(|r| r.violations.iter().map(|v| v.property)).collect();
    properties.sort_unstable();
    properties.dedup();
    if let Some(m) = args.mutate.as_deref() {
        if failed.is_empty() {
            println!("mutation {m} was NOT caught");
        } else {
            println!("mutation {m} caught: violated {}", properties.join(", "));
        }
    }
    let h = trace.finalize();
    println!(
        "seeds={} violations={} steps={} faults_injected={} trace_hash={}",
        reports.len(),
        failed.len(),
        total_steps,
        totals.total(),
        &h.to_hex()[..16]
    );
    if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
