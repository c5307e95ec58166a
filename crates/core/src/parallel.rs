//! The parallelizer (Reference: CBASE, Kotla & Dahlin, DSN 2004): a dependency graph over
//! decided requests, and the worker pool that runs it.
//!
//! ```text
//!   decided order: r1 put a, r2 get b, r3 get a, r4 put b, r5 scan "" (reads every key)
//!
//!       r1 ─────► r3               r1 and r2 start at once; r3 waits for the write it
//!        └─────────────► r5        reads, r4 for the read it overwrites; r5 for the last
//!       r2 ─────► r4 ─────┘        writers of a and b. r3 and r5 only read: no edge.
//! ```
//!
//! Invariants:
//! - every edge points from an earlier request to a later one, so the graph is acyclic
//!   and a run always completes;
//! - if two requests conflict ([`Conflicts::conflicts_with`]) or come from the same
//!   client, the later one is reachable from the earlier one (tested against the pairwise
//!   definition below);
//! - a job starts only after every predecessor finished, so conflicting requests run in
//!   decided order and see each other's effects as sequential execution would.
//!
//! The graph is built without comparing all pairs. Per item (key or prefix) it keeps the
//! last writer and the readers since that write: a reader waits for the writers of every
//! overlapping item, a writer for their writers and readers. A write to an item clears
//! only that item's readers; any later request that overlaps those readers' item finds
//! this writer there, which already waits for them, so the order holds transitively.
//!
//! This is the one place in `keel-core` that starts threads. It keeps the core
//! deterministic: which thread runs a request, and when, cannot change any reply or state
//! as long as the service keeps the contract in [`crate::service`].

use crate::message::ClientId;
use crate::service::{ConcurrentService, Conflicts, ExecCtx, Item};
use std::any::Any;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap};
use std::ops::Bound;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

/// Most jobs in one graph: indexes are `u32`.
pub const JOBS_MAX: usize = u32::MAX as usize - 1;

/// One fresh request: what a worker needs to run it.
#[derive(Clone, Debug)]
pub(crate) struct Job {
    pub op: Vec<u8>,
    pub ctx: ExecCtx,
}

/// The dependency graph of one run of requests, ready to execute.
#[derive(Debug, Default)]
pub(crate) struct Graph {
    jobs: Vec<Job>,
    /// Predecessors of each job that have not finished (at build time: all of them).
    deps: Vec<u32>,
    /// Jobs that wait for each job.
    dependents: Vec<Vec<u32>>,
}

impl Graph {
    pub fn len(&self) -> usize {
        self.jobs.len()
    }

    /// Direct predecessors → successors, for tests.
    #[cfg(test)]
    pub fn dependents(&self) -> &[Vec<u32>] {
        &self.dependents
    }

    fn ready(&self) -> impl Iterator<Item = u32> + '_ {
        self.deps.iter().enumerate().filter(|(_, &d)| d == 0).map(|(j, _)| j as u32)
    }

    /// Runs every job on the calling thread. `pick(n)` chooses which of the `n` ready jobs
    /// runs next (an index below `n`): any choice gives a valid (topological) order.
    pub fn run_inline(mut self, service: &dyn ConcurrentService, mut pick: impl FnMut(usize) -> usize) -> Vec<Vec<u8>> {
        let mut results: Vec<Option<Vec<u8>>> = vec![None; self.jobs.len()];
        let mut ready: Vec<u32> = self.ready().collect();
        while !ready.is_empty() {
            let j = ready.swap_remove(pick(ready.len()) % ready.len()) as usize;
            let job = &self.jobs[j];
            results[j] = Some(service.execute_shared(&job.op, &job.ctx));
            for &d in &self.dependents[j] {
                self.deps[d as usize] -= 1;
                if self.deps[d as usize] == 0 {
                    ready.push(d);
                }
            }
        }
        collect(results)
    }
}

/// Every job has run by the time a run returns: a missing result is a scheduler bug.
fn collect(results: Vec<Option<Vec<u8>>>) -> Vec<Vec<u8>> {
    results
        .into_iter()
        .enumerate()
        .map(|(j, r)| {
            assert!(r.is_some(), "job {j} never ran: the dependency graph has a cycle or the scheduler lost it");
            r.unwrap_or_default()
        })
        .collect()
}

/// Who touched one item since the graph last ordered everything.
#[derive(Debug, Default)]
struct Access {
    /// The last job that wrote the item.
    writer: Option<u32>,
    /// Jobs that read the item after `writer`.
    readers: Vec<u32>,
}

/// Builds a [`Graph`] from requests pushed in decided order.
#[derive(Debug, Default)]
pub(crate) struct GraphBuilder {
    graph: Graph,
    /// Items declared as [`Item::Key`].
    keys: BTreeMap<Vec<u8>, Access>,
    /// Items declared as [`Item::Prefix`].
    prefixes: BTreeMap<Vec<u8>, Access>,
    /// The last job that declared [`Conflicts::Everything`]: every later job waits for it.
    barrier: Option<u32>,
    /// Jobs since `barrier`: the next `Everything` job waits for all of them.
    since_barrier: Vec<u32>,
    /// Each client's last job: a client's requests run in its order.
    last_of_client: BTreeMap<ClientId, u32>,
    /// `edge_mark[p] == n + 1` iff the edge p → n exists (no duplicate edges).
    edge_mark: Vec<u32>,
}

impl GraphBuilder {
    pub fn new() -> GraphBuilder {
        GraphBuilder::default()
    }

    /// Adds the next request in decided order and returns its job index.
    ///
    /// # Panics
    /// Past [`JOBS_MAX`] jobs (batches are far smaller).
    pub fn push(&mut self, client: ClientId, conflicts: &Conflicts, job: Job) -> u32 {
        assert!(self.graph.jobs.len() < JOBS_MAX, "graph holds at most JOBS_MAX jobs");
        let n = self.graph.jobs.len() as u32;
        self.graph.jobs.push(job);
        self.graph.deps.push(0);
        self.graph.dependents.push(Vec::new());
        self.edge_mark.push(0);

        let mut preds: Vec<u32> = Vec::new();
        if let Some(p) = self.last_of_client.insert(client, n) {
            preds.push(p);
        }
        match conflicts {
            Conflicts::Everything => {
                preds.extend(self.barrier);
                preds.append(&mut self.since_barrier);
                // Everything before is ordered before this job, and everything after will
                // wait for it: the per-item history can start over.
                self.keys.clear();
                self.prefixes.clear();
                self.barrier = Some(n);
            }
            Conflicts::Items { reads, writes } => {
                preds.extend(self.barrier);
                for item in reads {
                    self.overlapping(item, |a| preds.extend(a.writer));
                }
                for item in writes {
                    // The readers since the last write already wait for that writer.
                    self.overlapping(item, |a| {
                        if a.readers.is_empty() {
                            preds.extend(a.writer);
                        } else {
                            preds.extend_from_slice(&a.readers);
                        }
                    });
                }
                for item in writes {
                    let a = self.entry(item);
                    a.writer = Some(n);
                    a.readers.clear();
                }
                for item in reads {
                    let a = self.entry(item);
                    if a.writer != Some(n) && a.readers.last() != Some(&n) {
                        a.readers.push(n);
                    }
                }
                self.since_barrier.push(n);
            }
        }
        for p in preds {
            self.add_edge(p, n);
        }
        n
    }

    pub fn finish(self) -> Graph {
        self.graph
    }

    fn add_edge(&mut self, from: u32, to: u32) {
        assert!(from < to, "edges follow decided order: {from} -> {to}");
        let mark = &mut self.edge_mark[from as usize];
        if *mark == to + 1 {
            return;
        }
        *mark = to + 1;
        self.graph.dependents[from as usize].push(to);
        self.graph.deps[to as usize] += 1;
    }

    fn entry(&mut self, item: &Item) -> &mut Access {
        match item {
            Item::Key(k) => self.keys.entry(k.clone()).or_default(),
            Item::Prefix(p) => self.prefixes.entry(p.clone()).or_default(),
        }
    }

    /// Calls `f` on the history of every recorded item that overlaps `item`.
    fn overlapping(&self, item: &Item, mut f: impl FnMut(&Access)) {
        match item {
            Item::Key(k) => {
                if let Some(a) = self.keys.get(k.as_slice()) {
                    f(a);
                }
                self.prefixes_of(k, true, &mut f);
            }
            Item::Prefix(p) => {
                for (_, a) in with_prefix(&self.keys, p) {
                    f(a);
                }
                for (_, a) in with_prefix(&self.prefixes, p) {
                    f(a);
                }
                self.prefixes_of(p, false, &mut f);
            }
        }
    }

    /// Calls `f` on every recorded prefix item that is a prefix of `k`: proper prefixes
    /// only, or also `k` itself if `inclusive`. Looks up each candidate length, or scans
    /// the prefix items if there are fewer of them than lengths.
    fn prefixes_of(&self, k: &[u8], inclusive: bool, f: &mut impl FnMut(&Access)) {
        let lengths = k.len() + usize::from(inclusive);
        if self.prefixes.len() < lengths {
            for (p, a) in &self.prefixes {
                if k.starts_with(p) && (inclusive || p.len() < k.len()) {
                    f(a);
                }
            }
        } else {
            for len in 0..lengths {
                if let Some(a) = self.prefixes.get(&k[..len]) {
                    f(a);
                }
            }
        }
    }
}

/// The entries of `map` whose key starts with `prefix`, in key order.
fn with_prefix<'a, V>(
    map: &'a BTreeMap<Vec<u8>, V>,
    prefix: &'a [u8],
) -> impl Iterator<Item = (&'a Vec<u8>, &'a V)> + 'a {
    map.range::<[u8], _>((Bound::Included(prefix), Bound::Unbounded)).take_while(move |(k, _)| k.starts_with(prefix))
}

/// A small seeded generator (SplitMix64) for [`crate::exec::Schedule::Shuffled`]: the core
/// draws no ambient randomness.
#[derive(Clone, Debug)]
pub(crate) struct SplitMix(u64);

impl SplitMix {
    pub fn new(seed: u64) -> SplitMix {
        SplitMix(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform enough below `n` (n > 0) for schedule exploration.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// What a finished job produced: its reply, or the panic the service raised.
type JobResult = Result<Vec<u8>, Box<dyn Any + Send>>;

/// The immutable part of a run, shared with the workers.
struct RunData {
    service: Arc<dyn ConcurrentService>,
    jobs: Vec<Job>,
    dependents: Vec<Vec<u32>>,
}

/// The scheduling state of the run in progress, under [`Shared::state`].
struct Run {
    data: Arc<RunData>,
    /// Unfinished predecessors per job.
    deps: Vec<u32>,
    /// Jobs whose predecessors all finished, lowest (earliest decided) first: the
    /// critical path is usually the decided order.
    ready: BinaryHeap<Reverse<u32>>,
    results: Vec<Option<Vec<u8>>>,
    finished: usize,
    /// Jobs taken by a thread and not reported yet.
    running: usize,
    /// The first panic a service raised; no new job starts once it is set.
    panic: Option<Box<dyn Any + Send>>,
}

impl Run {
    fn over(&self) -> bool {
        self.finished == self.results.len() || (self.panic.is_some() && self.running == 0)
    }
}

/// Waking a thread costs a syscall and, on a busy host, a context switch, so only as
/// many threads are woken as there are jobs nobody awake will take. Never waking is
/// still correct: the thread that makes jobs ready takes one itself and keeps going while
/// any are ready, so a ready job never waits with every thread asleep.
struct State {
    run: Option<Run>,
    /// Helpers waiting on [`Shared::work`].
    idle_helpers: usize,
    /// The caller of [`Pool::run`] waits on [`Shared::done`].
    caller_waiting: bool,
    shutdown: bool,
}

impl State {
    /// Takes the next ready job of the current run, if any may start.
    fn take(&mut self) -> Option<(Arc<RunData>, u32)> {
        let run = self.run.as_mut()?;
        if run.panic.is_some() {
            return None;
        }
        let Reverse(j) = run.ready.pop()?;
        run.running += 1;
        Some((run.data.clone(), j))
    }

    /// Records a finished job and releases its dependents. Returns how many released jobs
    /// the reporting thread leaves to others (it takes one itself).
    fn complete(&mut self, j: u32, result: JobResult) -> usize {
        let Some(run) = self.run.as_mut() else {
            unreachable!("a job completes only while its run is installed");
        };
        run.running -= 1;
        match result {
            Ok(reply) => {
                assert!(run.results[j as usize].is_none(), "job {j} ran twice");
                run.results[j as usize] = Some(reply);
                run.finished += 1;
                let mut released: usize = 0;
                for &d in &run.data.dependents[j as usize] {
                    run.deps[d as usize] -= 1;
                    if run.deps[d as usize] == 0 {
                        run.ready.push(Reverse(d));
                        released += 1;
                    }
                }
                released.saturating_sub(1)
            }
            Err(panic) => {
                run.panic.get_or_insert(panic);
                0
            }
        }
    }
}

struct Shared {
    state: Mutex<State>,
    /// Helpers wait here for jobs.
    work: Condvar,
    /// The caller waits here for jobs or the end of its run.
    done: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic never happens while the lock is held (service code runs outside it),
        // so a poisoned lock still holds consistent state.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn wait_helper<'a>(&self, mut st: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        st.idle_helpers += 1;
        let mut st = self.work.wait(st).unwrap_or_else(PoisonError::into_inner);
        st.idle_helpers -= 1;
        st
    }

    fn wait_caller<'a>(&self, mut st: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        st.caller_waiting = true;
        let mut st = self.done.wait(st).unwrap_or_else(PoisonError::into_inner);
        st.caller_waiting = false;
        st
    }

    /// Wakes helpers for `extra` jobs no awake thread will take, and the caller if jobs
    /// remain beyond the idle helpers or its run is over.
    fn wake(&self, st: &State, extra: usize) {
        let helpers = extra.min(st.idle_helpers);
        for _ in 0..helpers {
            self.work.notify_one();
        }
        if st.caller_waiting && (extra > helpers || st.run.as_ref().is_some_and(Run::over)) {
            self.done.notify_one();
        }
    }

    /// Runs job `j` outside the lock and reports it; returns the guard again.
    fn work<'a>(&'a self, st: MutexGuard<'a, State>, data: Arc<RunData>, j: u32) -> MutexGuard<'a, State> {
        drop(st);
        let job = &data.jobs[j as usize];
        let result = catch_unwind(AssertUnwindSafe(|| data.service.execute_shared(&job.op, &job.ctx)));
        // Drop the handle before reporting: once the last job is reported, no worker holds
        // a clone of the service (the contract of `Service::concurrent`).
        drop(data);
        let mut st = self.lock();
        let extra = st.complete(j, result);
        self.wake(&st, extra);
        st
    }
}

/// A fixed set of helper threads that, together with the calling thread, execute the
/// jobs of one [`Graph`] at a time. Threads start once and park between runs.
pub(crate) struct Pool {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl Pool {
    /// Starts up to `helpers` threads. If the OS refuses a thread the pool runs with the
    /// ones it got (with none, the caller executes every job itself): slower, never wrong.
    pub fn new(helpers: usize) -> Pool {
        let state = State { run: None, idle_helpers: 0, caller_waiting: false, shutdown: false };
        let shared = Arc::new(Shared { state: Mutex::new(state), work: Condvar::new(), done: Condvar::new() });
        let mut threads = Vec::with_capacity(helpers);
        for i in 0..helpers {
            let s = shared.clone();
            match std::thread::Builder::new().name(format!("keel-exec-{i}")).spawn(move || helper(&s)) {
                Ok(t) => threads.push(t),
                Err(_) => break,
            }
        }
        Pool { shared, threads }
    }

    /// Helper threads running (the caller of [`Pool::run`] works too).
    pub fn helpers(&self) -> usize {
        self.threads.len()
    }

    /// Executes every job of `graph` and returns the replies by job index.
    ///
    /// # Panics
    /// Re-raises the first panic of the service (as sequential execution would), after the
    /// jobs already running have finished.
    pub fn run(&self, graph: Graph, service: Arc<dyn ConcurrentService>) -> Vec<Vec<u8>> {
        if graph.len() == 0 {
            return Vec::new();
        }
        let ready: BinaryHeap<Reverse<u32>> = graph.ready().map(Reverse).collect();
        let extra = ready.len().saturating_sub(1);
        let n = graph.len();
        let run = Run {
            data: Arc::new(RunData { service, jobs: graph.jobs, dependents: graph.dependents }),
            deps: graph.deps,
            ready,
            results: vec![None; n],
            finished: 0,
            running: 0,
            panic: None,
        };
        let mut st = self.shared.lock();
        assert!(st.run.is_none(), "one run at a time");
        st.run = Some(run);
        self.shared.wake(&st, extra);
        loop {
            if st.run.as_ref().is_some_and(Run::over) {
                break;
            }
            st = match st.take() {
                Some((data, j)) => self.shared.work(st, data, j),
                None => self.shared.wait_caller(st),
            };
        }
        let run = st.run.take();
        drop(st);
        let Some(run) = run else { unreachable!("the caller's run stays installed until it takes it") };
        if let Some(panic) = run.panic {
            resume_unwind(panic);
        }
        collect(run.results)
    }
}

fn helper(shared: &Shared) {
    let mut st = shared.lock();
    while !st.shutdown {
        st = match st.take() {
            Some((data, j)) => shared.work(st, data, j),
            None => shared.wait_helper(st),
        };
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.lock().shutdown = true;
        self.shared.work.notify_all();
        for t in self.threads.drain(..) {
            // A helper never panics (service panics are caught and handed to the caller).
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::Seq;
    use proptest::prelude::*;

    fn job() -> Job {
        Job { op: Vec::new(), ctx: ExecCtx::new(Seq(1), 0, 0, ClientId(0)) }
    }

    fn key(k: &str) -> Item {
        Item::Key(k.as_bytes().to_vec())
    }

    fn prefix(p: &str) -> Item {
        Item::Prefix(p.as_bytes().to_vec())
    }

    /// Builds the graph of `footprints` (client i for request i unless given) and returns
    /// its edges as (from, to) pairs, sorted.
    fn edges(footprints: &[(ClientId, Conflicts)]) -> Vec<(u32, u32)> {
        let mut b = GraphBuilder::new();
        for (client, c) in footprints {
            b.push(*client, c, job());
        }
        let g = b.finish();
        let mut e: Vec<(u32, u32)> =
            g.dependents().iter().enumerate().flat_map(|(f, ts)| ts.iter().map(move |&t| (f as u32, t))).collect();
        e.sort_unstable();
        e
    }

    #[test]
    fn reads_share_writes_order() {
        let e = edges(&[
            (ClientId(1), Conflicts::write(key("a"))),
            (ClientId(2), Conflicts::read(key("a"))),
            (ClientId(3), Conflicts::read(key("a"))),
            (ClientId(4), Conflicts::write(key("a"))),
            (ClientId(5), Conflicts::read(key("b"))),
        ]);
        assert_eq!(e, vec![(0, 1), (0, 2), (1, 3), (2, 3)]);
    }

    #[test]
    fn prefixes_conflict_with_the_keys_and_prefixes_they_cover() {
        let e = edges(&[
            (ClientId(1), Conflicts::write(key("a/1"))),
            (ClientId(2), Conflicts::write(key("b/1"))),
            (ClientId(3), Conflicts::read(prefix("a/"))),
            (ClientId(4), Conflicts::write(key("a/2"))),
            (ClientId(5), Conflicts::write(prefix("a"))),
            (ClientId(6), Conflicts::read(key("b/1"))),
            (ClientId(7), Conflicts::read(prefix(""))),
        ]);
        // 2 reads a/* after 0 wrote a/1; 3 writes a/2 after 2 read a/*; 4 writes a* after
        // the last writers and readers of a/1, a/2 and a/*; 5 reads b/1 after 1; 6 reads
        // everything after the last writers of a/1, a/2, b/1 and a*.
        assert_eq!(e, vec![(0, 2), (0, 4), (0, 6), (1, 5), (1, 6), (2, 3), (2, 4), (3, 4), (3, 6), (4, 6)]);
    }

    #[test]
    fn everything_is_a_barrier_and_clients_keep_their_order() {
        let e = edges(&[
            (ClientId(1), Conflicts::read(key("a"))),
            (ClientId(2), Conflicts::read(key("b"))),
            (ClientId(3), Conflicts::Everything),
            (ClientId(4), Conflicts::none()),
            (ClientId(4), Conflicts::none()),
        ]);
        assert_eq!(e, vec![(0, 2), (1, 2), (2, 3), (2, 4), (3, 4)]);
    }

    /// An arbitrary footprint over a small alphabet, so overlaps are frequent.
    fn footprint() -> impl Strategy<Value = (ClientId, Conflicts)> {
        let item = prop_oneof![
            4 => proptest::collection::vec(0u8..3, 0..3).prop_map(Item::Key),
            1 => proptest::collection::vec(0u8..3, 0..2).prop_map(Item::Prefix),
        ];
        let items = proptest::collection::vec(item, 0..3);
        let conflicts = prop_oneof![
            12 => (items.clone(), items).prop_map(|(reads, writes)| Conflicts::Items { reads, writes }),
            1 => Just(Conflicts::Everything),
        ];
        ((0u64..6).prop_map(ClientId), conflicts)
    }

    proptest! {
        /// The graph orders exactly what must be ordered: every conflicting or same-client
        /// pair is connected by a path (safety), and every edge joins such a pair or leads
        /// from/to an `Everything` job (no needless serialization).
        #[test]
        fn graph_orders_every_conflicting_pair(fs in proptest::collection::vec(footprint(), 0..40)) {
            let e = edges(&fs);
            let n = fs.len();
            // reach[i][j]: j is reachable from i. Edges go forward, so one pass in reverse
            // topological order suffices.
            let mut reach = vec![vec![false; n]; n];
            for i in (0..n).rev() {
                for &(f, t) in e.iter().filter(|(f, _)| *f as usize == i) {
                    reach[f as usize][t as usize] = true;
                    let row = reach[t as usize].clone();
                    for (j, r) in row.into_iter().enumerate() {
                        reach[i][j] |= r;
                    }
                }
            }
            for j in 0..n {
                for i in 0..j {
                    let must = fs[i].0 == fs[j].0 || fs[i].1.conflicts_with(&fs[j].1);
                    if must {
                        prop_assert!(reach[i][j], "{i} -> {j} must be ordered: {:?} / {:?}", fs[i], fs[j]);
                    }
                }
            }
            for &(f, t) in &e {
                let (a, b) = (&fs[f as usize], &fs[t as usize]);
                prop_assert!(a.0 == b.0 || a.1.conflicts_with(&b.1), "needless edge {f} -> {t}: {a:?} / {b:?}");
            }
        }
    }
}
