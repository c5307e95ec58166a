//! Parallel execution equals sequential execution, byte for byte (issue #5, CBASE).
//!
//! Random KV workloads (few keys: most requests conflict; many keys: few do; scans over
//! prefixes; retransmitted and stale duplicates; garbage; time that goes backwards) are
//! split into random batches and random runs of batches, and executed by executors with
//! `exec_workers` 1 (the sequential path, the reference), 2 and 4, and by the shuffled
//! schedule (a random order the dependency graph allows). Replies, including each
//! request's `ExecCtx`, and the executor snapshot after every run (service state, reply
//! cache, position, agreed time) must be identical.
//!
//! Threads race only where the graph allows; whether a race shows depends on timing, so
//! the shuffled schedule is what makes a wrong declaration fail reliably. The last tests
//! plant such declarations and require this property to fail.

use keel_core::exec::{Executor, Outcome, Schedule};
use keel_core::ids::ClientId;
use keel_core::message::{Request, Value};
use keel_core::service::{ConcurrentService, Conflicts, ExecCtx, Item, RestoreError, Service};
use keel_kv::{Kv, KvRequest};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestError, TestRng, TestRunner};
use std::sync::Arc;

/// How a test variant declares a decoded request's conflicts; None: KV's own
/// [`Service::conflicts`].
type Declare = Option<fn(&KvRequest) -> Conflicts>;

/// KV whose replies end with the request's `ExecCtx`, so comparing replies compares
/// contexts too; optionally with a different conflict declaration.
struct Traced {
    kv: Kv,
    declare: Declare,
}

fn trace(mut reply: Vec<u8>, ctx: &ExecCtx) -> Vec<u8> {
    for x in [ctx.seq.0, ctx.time, ctx.seed, ctx.client.0] {
        reply.extend(x.to_le_bytes());
    }
    reply
}

struct TracedHandle(Arc<dyn ConcurrentService>);

impl ConcurrentService for TracedHandle {
    fn execute_shared(&self, request: &[u8], ctx: &ExecCtx) -> Vec<u8> {
        trace(self.0.execute_shared(request, ctx), ctx)
    }
}

impl Service for Traced {
    fn execute(&mut self, request: &[u8], ctx: &ExecCtx) -> Vec<u8> {
        trace(self.kv.execute(request, ctx), ctx)
    }
    fn conflicts(&self, request: &[u8]) -> Conflicts {
        match (self.declare, KvRequest::decode(request)) {
            (Some(declare), Ok(req)) => declare(&req),
            _ => self.kv.conflicts(request),
        }
    }
    fn concurrent(&self) -> Option<Arc<dyn ConcurrentService>> {
        Some(Arc::new(TracedHandle(self.kv.concurrent()?)))
    }
    fn snapshot(&self) -> Vec<u8> {
        self.kv.snapshot()
    }
    fn restore(&mut self, snapshot: &[u8]) -> Result<(), RestoreError> {
        self.kv.restore(snapshot)
    }
}

/// Consecutive values executed by one `execute_many` call (one dependency graph).
type Run = Vec<Value>;

#[derive(Clone, Debug)]
struct Workload {
    runs: Vec<Run>,
    shuffle_seed: u64,
}

/// One generated request before sequence numbers are assigned.
#[derive(Clone, Debug)]
struct Draw {
    client: u8,
    /// 0..=7 the next seq, 8 one ahead (a gap, allowed), 9 the last seq again (a
    /// retransmission, same op), 10 an older seq (stale).
    intent: u8,
    kind: u8,
    key: u16,
    value: u8,
    scan: u8,
}

fn key(n: u16, keys: u16) -> Vec<u8> {
    let i = n % keys;
    // Two namespaces, so prefix scans cover some keys and not others.
    vec![if i.is_multiple_of(2) { b'a' } else { b'b' }, b'/', (i / 2) as u8]
}

fn op(d: &Draw, keys: u16) -> Vec<u8> {
    let k = key(d.key, keys);
    let v = vec![b'0' + d.value % 3];
    let req = match d.kind % 14 {
        0..=2 => KvRequest::Get { key: k },
        3..=5 => KvRequest::Put { key: k, value: v },
        6 => KvRequest::Delete { key: k },
        7 | 8 => {
            let expected = if d.value % 4 == 3 { None } else { Some(vec![b'0' + (d.value / 4) % 3]) };
            KvRequest::Cas { key: k, expected, new: v }
        }
        9 | 10 => {
            let prefix = match d.scan % 4 {
                0 => Vec::new(),
                1 => k[..1].to_vec(),
                2 => k[..2].to_vec(),
                _ => k,
            };
            KvRequest::Scan { prefix, limit: u32::from(d.scan / 4) + 1 }
        }
        // Watches make later writes push events: their numbering and bytes must not
        // depend on the schedule either.
        11 | 12 => KvRequest::Watch { prefix: k[..(d.scan % 3) as usize].to_vec(), lease_ms: u64::from(d.value) },
        _ => return vec![0xff, d.value, 0xff],
    };
    req.encode()
}

#[allow(clippy::too_many_arguments)]
fn build(
    keys: u16,
    clients: u8,
    draws: Vec<Draw>,
    batches: Vec<usize>,
    per_run: Vec<usize>,
    times: Vec<u64>,
    shuffle_seed: u64,
) -> Workload {
    let mut last: Vec<(u64, Vec<u8>)> = vec![(0, Vec::new()); clients as usize];
    let mut requests = Vec::with_capacity(draws.len());
    for d in &draws {
        let c = (d.client % clients) as usize;
        let (seq, op) = match d.intent {
            0..=7 => (last[c].0 + 1, op(d, keys)),
            8 => (last[c].0 + 2, op(d, keys)),
            9 => (last[c].0, last[c].1.clone()),
            _ => (last[c].0.saturating_sub(1 + u64::from(d.value % 3)), op(d, keys)),
        };
        if seq > last[c].0 {
            last[c] = (seq, op.clone());
        }
        requests.push(Request::new(ClientId(c as u64 + 1), seq, op.into()));
    }
    let mut values = Vec::new();
    let mut rest = requests.as_slice();
    for i in 0.. {
        if rest.is_empty() {
            break;
        }
        let (batch, tail) = rest.split_at(batches[i % batches.len()].min(rest.len()));
        rest = tail;
        values.push(Value { time: times[i % times.len()], requests: batch.to_vec() });
    }
    let mut runs = Vec::new();
    let mut values = values.into_iter().peekable();
    for i in 0.. {
        if values.peek().is_none() {
            break;
        }
        runs.push(values.by_ref().take(per_run[i % per_run.len()]).collect());
    }
    Workload { runs, shuffle_seed }
}

fn workload() -> impl Strategy<Value = Workload> {
    // The conflict ratio knob: 1-2 keys make almost every write conflict, 250 almost none.
    let keys = prop_oneof![Just(1u16), Just(2), Just(8), Just(64), Just(250)];
    let draw = (any::<u8>(), 0u8..11, any::<u8>(), any::<u16>(), any::<u8>(), any::<u8>())
        .prop_map(|(client, intent, kind, key, value, scan)| Draw { client, intent, kind, key, value, scan });
    (
        keys,
        1u8..=6,
        proptest::collection::vec(draw, 0..120),
        proptest::collection::vec(1usize..=10, 1..6),
        proptest::collection::vec(1usize..=3, 1..4),
        proptest::collection::vec(0u64..50, 1..5),
        any::<u64>(),
    )
        .prop_map(|(keys, clients, draws, batches, per_run, times, seed)| {
            build(keys, clients, draws, batches, per_run, times, seed)
        })
}

/// Everything observable of one execution: outcomes per value, and the executor snapshot
/// (service state + reply cache + position + time) after each run.
#[derive(Debug, PartialEq, Eq)]
struct Observed {
    outcomes: Vec<Vec<Outcome>>,
    snapshots: Vec<Vec<u8>>,
}

fn execute(w: &Workload, declare: Declare, schedule: Schedule) -> Result<Observed, TestCaseError> {
    let make = || Executor::with_schedule(Traced { kv: Kv::new(), declare }, schedule);
    let mut e = make();
    let mut observed = Observed { outcomes: Vec::new(), snapshots: Vec::new() };
    let mut threads = 0;
    for (i, run) in w.runs.iter().enumerate() {
        let values: Vec<&Value> = run.iter().collect();
        observed.outcomes.extend(e.execute_many(e.executed() + 1, &values));
        threads = threads.max(e.pool_threads());
        let snapshot = e.snapshot();
        if i == w.runs.len() / 2 {
            // Continue from the snapshot in a new executor, as after state transfer.
            e = make();
            e.restore(&snapshot).map_err(|err| TestCaseError::fail(err.to_string()))?;
        }
        observed.snapshots.push(snapshot);
    }
    if let Schedule::Pool { workers } = schedule {
        if observed.outcomes.iter().flatten().any(|o| o.fresh) && threads != workers - 1 {
            return Err(TestCaseError::fail(format!("the pool did not run: {threads} threads")));
        }
    }
    Ok(observed)
}

/// The property: every schedule observes exactly what sequential execution observes.
fn parallel_equals_sequential(w: &Workload, declare: Declare) -> Result<(), TestCaseError> {
    let reference = execute(w, declare, Schedule::from_workers(1))?;
    prop_assert_eq!(Schedule::from_workers(1), Schedule::Sequential);
    for schedule in [Schedule::from_workers(2), Schedule::from_workers(4), Schedule::Shuffled { seed: w.shuffle_seed }]
    {
        let got = execute(w, declare, schedule)?;
        for (i, (g, r)) in got.outcomes.iter().zip(&reference.outcomes).enumerate() {
            prop_assert_eq!(g, r, "{:?}: outcomes of value {} differ", schedule, i + 1);
        }
        prop_assert_eq!(&got, &reference, "{:?}: snapshots differ", schedule);
    }
    Ok(())
}

proptest! {
    #[test]
    fn parallel_execution_equals_sequential_byte_for_byte(w in workload()) {
        parallel_equals_sequential(&w, None)?;
    }
}

/// Runs the property with a fixed seed and requires it to fail: the test can fail, and
/// would catch a service that declares `declare`.
fn assert_caught(name: &str, declare: fn(&KvRequest) -> Conflicts) {
    let config = Config { cases: 256, failure_persistence: None, max_shrink_iters: 256, ..Config::default() };
    let mut runner = TestRunner::new_with_rng(config, TestRng::deterministic_rng(RngAlgorithm::ChaCha));
    match runner.run(&workload(), |w| parallel_equals_sequential(&w, Some(declare))) {
        Err(TestError::Fail(why, w)) => eprintln!("{name} caught: {why}\nminimal workload: {w:#?}"),
        other => panic!("{name} was not caught: {other:?}"),
    }
}

#[test]
fn an_under_declared_write_is_caught() {
    // Puts and deletes declared as reads: they may now run beside reads of their key.
    assert_caught("writes declared as reads", |req| match req {
        KvRequest::Put { key, .. } | KvRequest::Delete { key } => Conflicts::read(Item::Key(key.clone())),
        other => Kv::footprint(other),
    });
}

#[test]
fn a_scan_declared_as_one_key_is_caught() {
    // A scan that declares only the key equal to its prefix misses writes below it.
    assert_caught("scan declared as its prefix key", |req| match req {
        KvRequest::Scan { prefix, .. } => Conflicts::read(Item::Key(prefix.clone())),
        other => Kv::footprint(other),
    });
}
