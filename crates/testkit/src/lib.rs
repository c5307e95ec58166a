//! What a Keel service must prove before it runs replicated: the **Service conformance
//! suite** ([`Conformance`]).
//!
//! Replication is only as correct as the service is deterministic: every node runs the
//! same decided requests and must reach the same replies and the same state, checkpoints
//! must restore to exactly the state they were taken from, a read answered without
//! ordering must equal what ordering it would reply, parallel execution must give what
//! sequential execution gives, and ticks must fall alike. The simulator checks all of
//! that for KV under faults; this suite checks it for any service, in milliseconds, from
//! the service's own test suite:
//!
//! ```
//! use keel_core::service::{ExecCtx, RestoreError, Service};
//! use keel_testkit::Conformance;
//! use rand::Rng;
//!
//! /// Adds the request's number to a total; replies with the total.
//! #[derive(Default)]
//! struct Total(u64);
//!
//! impl Service for Total {
//!     fn execute(&mut self, request: &[u8], _ctx: &ExecCtx) -> Vec<u8> {
//!         self.0 += request.first().copied().unwrap_or(0) as u64;
//!         self.0.to_le_bytes().to_vec()
//!     }
//!     fn snapshot(&self) -> Vec<u8> {
//!         self.0.to_le_bytes().to_vec()
//!     }
//!     fn restore(&mut self, s: &[u8]) -> Result<(), RestoreError> {
//!         self.0 = u64::from_le_bytes(s.try_into().map_err(|_| RestoreError("8 bytes".into()))?);
//!         Ok(())
//!     }
//! }
//!
//! Conformance::new(Total::default)
//!     .workload(|rng, _client| vec![rng.gen_range(0..10)])
//!     .tick_ms(100)
//!     .run()
//!     .expect("conforms");
//! ```
//!
//! Every check drives the service through Keel's own executor ([`Executor`]), the code
//! path the nodes run, with the contexts they would give it. A failure names the check,
//! the instance and what differed.

use keel_core::exec::{Executor, Outcome, Schedule};
use keel_core::ids::ClientId;
use keel_core::message::{Request, Seq, Value};
use keel_core::service::{ReadCtx, Service};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A conformance check that failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Failure {
    /// Two copies of the service given the same requests, contexts and ticks differ.
    #[error("not deterministic: at instance {seq}, {what}")]
    Nondeterministic { seq: u64, what: String },
    /// A snapshot does not restore to the state it was taken from, or a restored copy
    /// goes on differently.
    #[error("snapshot round trip: at instance {seq}, {what}")]
    Snapshot { seq: u64, what: String },
    /// `execute_read_only` answered differently from `execute`, or the request changed
    /// the state.
    #[error("read-only answer: at instance {seq}, request {request:?}: {what}")]
    ReadOnly { seq: u64, request: String, what: String },
    /// Parallel execution under the service's conflict declarations differs from
    /// sequential execution.
    #[error("conflict declarations: schedule {schedule}, at instance {seq}: {what}")]
    Conflicts { schedule: String, seq: u64, what: String },
    /// `pieces` or `freeze` do not give `snapshot`'s bytes.
    #[error("snapshot pieces or freeze: at instance {seq}, {what}")]
    Pieces { seq: u64, what: String },
}

type Generator = Box<dyn FnMut(&mut ChaCha8Rng, u64) -> Vec<u8>>;

/// The suite for the service `make` builds ([`Conformance::run`]).
pub struct Conformance<S, F: Fn() -> S> {
    make: F,
    workload: Option<Generator>,
    instances: u64,
    batch: usize,
    clients: u64,
    seed: u64,
    tick_ms: u64,
}

/// One run's decided values: what the nodes would execute.
struct Run {
    values: Vec<Value>,
}

impl<S: Service, F: Fn() -> S> Conformance<S, F> {
    /// `make` builds an empty service, as a node does at start.
    pub fn new(make: F) -> Conformance<S, F> {
        Conformance { make, workload: None, instances: 200, batch: 4, clients: 5, seed: 1, tick_ms: 0 }
    }

    /// The requests to run: `generate(rng, client)` returns client `client`'s next
    /// request. Give it every kind of request the service takes, including ones that
    /// fail, and keep the key space small so requests meet.
    pub fn workload(mut self, generate: impl FnMut(&mut ChaCha8Rng, u64) -> Vec<u8> + 'static) -> Self {
        self.workload = Some(Box::new(generate));
        self
    }

    /// Decided instances per run (default 200), of up to `batch` requests (default 4).
    pub fn instances(mut self, instances: u64, batch: usize) -> Self {
        self.instances = instances.max(1);
        self.batch = batch.max(1);
        self
    }

    /// The random seed of the workload and of the times (default 1).
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Agreed-time ticks every `tick_ms` (0, the default: none), as a cluster
    /// configured so runs them; some instances are then empty, as an idle primary's are.
    pub fn tick_ms(mut self, tick_ms: u64) -> Self {
        self.tick_ms = tick_ms;
        self
    }

    /// Runs every check; the first failure ends the run.
    ///
    /// # Errors
    /// The [`Failure`] found.
    ///
    /// # Panics
    /// If no workload was given.
    pub fn run(mut self) -> Result<(), Failure> {
        let run = self.decided_values();
        self.deterministic(&run)?;
        self.snapshots_round_trip(&run)?;
        self.read_only_equals_execute(&run)?;
        self.conflicts_honoured(&run)?;
        Ok(())
    }

    fn executor(&self, schedule: Schedule) -> Executor<S> {
        let mut e = Executor::with_schedule((self.make)(), schedule);
        e.set_tick_ms(self.tick_ms);
        e
    }

    /// Values as the primary would propose them: agreed time moving forward by a few ms
    /// to more than a tick, each client with one request in flight (its sequence numbers
    /// in order), now and then an empty value (a tick's) and a duplicate.
    fn decided_values(&mut self) -> Run {
        let mut generate = self.workload.take().expect("Conformance::workload: the requests to run");
        let mut rng = ChaCha8Rng::seed_from_u64(self.seed);
        let mut seqs = vec![0u64; self.clients as usize];
        let mut time = 1_000;
        let mut values = Vec::new();
        let mut last: Option<Request> = None;
        for _ in 0..self.instances {
            time += if self.tick_ms > 0 { rng.gen_range(0..=self.tick_ms * 3 / 2) } else { rng.gen_range(0..20) };
            let mut requests = Vec::new();
            if self.tick_ms == 0 || rng.gen_ratio(4, 5) {
                let count = rng.gen_range(1..=self.batch.min(self.clients as usize));
                let mut clients: Vec<u64> = (0..self.clients).collect();
                for _ in 0..count {
                    let c = clients.remove(rng.gen_range(0..clients.len()));
                    seqs[c as usize] += 1;
                    let client = 1000 + c;
                    requests.push(Request::new(ClientId(client), seqs[c as usize], generate(&mut rng, client).into()));
                }
                if let Some(dup) = last.take().filter(|d| !requests.iter().any(|r| r.client == d.client)) {
                    if rng.gen_ratio(1, 10) {
                        // A retransmission decided again: answered from the reply cache.
                        requests.push(dup);
                    }
                }
                last = requests.first().cloned();
            }
            values.push(Value { time, requests });
        }
        Run { values }
    }

    /// Two copies, the same values: the same replies, pushes, ticks and state after
    /// every instance.
    fn deterministic(&self, run: &Run) -> Result<(), Failure> {
        let (mut a, mut b) = (self.executor(Schedule::Sequential), self.executor(Schedule::Sequential));
        for (value, seq) in run.values.iter().zip(1..) {
            let (oa, ob) = (a.execute(Seq(seq), value), b.execute(Seq(seq), value));
            if let Some(what) = differ(&oa, &ob) {
                return Err(Failure::Nondeterministic { seq, what });
            }
            let (ta, tb) = (a.take_ticks(), b.take_ticks());
            if ta != tb {
                return Err(Failure::Nondeterministic { seq, what: format!("ticks {ta:?} against {tb:?}") });
            }
            if a.service().snapshot() != b.service().snapshot() {
                return Err(Failure::Nondeterministic { seq, what: "the two copies' snapshots differ".into() });
            }
        }
        Ok(())
    }

    /// At every instance: the snapshot restores into a fresh copy with equal bytes; its
    /// pieces and a freeze taken then give those bytes; and at a few points the restored
    /// copy runs the rest of the values exactly as the original does.
    fn snapshots_round_trip(&self, run: &Run) -> Result<(), Failure> {
        let mut e = self.executor(Schedule::Sequential);
        let forks: Vec<u64> = [1, run.values.len() as u64 / 3, run.values.len() as u64 * 2 / 3].into();
        let mut restored: Vec<(u64, Executor<S>)> = Vec::new();
        for (value, seq) in run.values.iter().zip(1..) {
            let outcomes = e.execute(Seq(seq), value);
            let ticks = e.take_ticks();
            for (at, copy) in restored.iter_mut() {
                let theirs = copy.execute(Seq(seq), value);
                if let Some(what) = differ(&outcomes, &theirs) {
                    return Err(Failure::Snapshot { seq, what: format!("a copy restored at {at}: {what}") });
                }
                if copy.take_ticks() != ticks {
                    return Err(Failure::Snapshot { seq, what: format!("a copy restored at {at} ticks elsewhere") });
                }
            }
            let bytes = e.service().snapshot();
            let mut fresh = (self.make)();
            if let Err(err) = fresh.restore(&bytes) {
                return Err(Failure::Snapshot { seq, what: format!("its own snapshot does not restore: {err}") });
            }
            if fresh.snapshot() != bytes {
                return Err(Failure::Snapshot { seq, what: "restored, it snapshots to other bytes".into() });
            }
            let joined = match keel_core::chunk::join(&e.service().pieces()) {
                Ok(joined) => joined,
                Err(err) => return Err(Failure::Pieces { seq, what: format!("pieces() unreadable: {err}") }),
            };
            if joined != bytes {
                return Err(Failure::Pieces { seq, what: "pieces() joined are not snapshot()".into() });
            }
            // A freeze is the state at the freeze: a copy freezes, runs on, then serializes.
            let mut scratch = self.executor(Schedule::Sequential);
            let _ = scratch.restore(&e.snapshot());
            if let Some(frozen) = scratch.service().freeze() {
                if let Some(next) = run.values.get(seq as usize) {
                    let _ = scratch.execute(Seq(seq + 1), next);
                }
                if frozen.snapshot() != bytes {
                    let what = "a freeze serializes to other bytes than snapshot() gave at the freeze".into();
                    return Err(Failure::Pieces { seq, what });
                }
            }
            if forks.contains(&seq) {
                let mut copy = self.executor(Schedule::Sequential);
                if let Err(err) = copy.restore(&e.snapshot()) {
                    return Err(Failure::Snapshot {
                        seq,
                        what: format!("the executor snapshot does not restore: {err}"),
                    });
                }
                restored.push((seq, copy));
            }
        }
        Ok(())
    }

    /// Wherever the service answers a request read-only, ordering that request in the
    /// same state replies the same, and changes nothing.
    fn read_only_equals_execute(&self, run: &Run) -> Result<(), Failure> {
        let mut e = self.executor(Schedule::Sequential);
        let probes: Vec<&Request> = run.values.iter().flat_map(|v| v.requests.iter()).take(64).collect();
        for (value, seq) in run.values.iter().zip(1..) {
            e.execute(Seq(seq), value);
            e.take_ticks();
            if seq % 5 != 0 {
                continue;
            }
            let state = e.snapshot();
            for probe in &probes {
                let ctx = ReadCtx { client: probe.client, executed: Seq(seq), time: e.time() };
                let Some(answer) = e.service().execute_read_only(&probe.op, &ctx) else { continue };
                let mut scratch = self.executor(Schedule::Sequential);
                let _ = scratch.restore(&state);
                let before = scratch.service().snapshot();
                // A fresh client, so the reply cache has nothing to say.
                let ordered = Request::new(ClientId(9_999), 1, probe.op.clone());
                let out = scratch.execute(Seq(seq + 1), &Value { time: e.time(), requests: vec![ordered] });
                let request = String::from_utf8_lossy(&probe.op).into_owned();
                if out.first().map(|o| &o.result) != Some(&answer) {
                    return Err(Failure::ReadOnly {
                        seq,
                        request,
                        what: format!("read-only {answer:?}, ordered {:?}", out.first().map(|o| &o.result)),
                    });
                }
                if scratch.service().snapshot() != before {
                    return Err(Failure::ReadOnly { seq, request, what: "ordered, it changed the state".into() });
                }
            }
        }
        Ok(())
    }

    /// A service that declares conflicts (and hands out a concurrent handle) gives, run
    /// in any order its declarations allow, what sequential execution gives. Without
    /// ticks: a run of values that holds a tick executes sequentially (the tick is a
    /// barrier), so with them few runs would take the parallel path at all.
    fn conflicts_honoured(&self, run: &Run) -> Result<(), Failure> {
        let executor = |schedule| Executor::with_schedule((self.make)(), schedule);
        if executor(Schedule::Sequential).service().concurrent().is_none() {
            return Ok(());
        }
        let mut expected = executor(Schedule::Sequential);
        let outcomes: Vec<Vec<Outcome>> =
            run.values.iter().zip(1..).map(|(v, seq)| expected.execute(Seq(seq), v)).collect();
        for schedule in (1..=4).map(|seed| Schedule::Shuffled { seed }).chain([Schedule::Pool { workers: 4 }]) {
            for per_call in [3, 16] {
                let mut e = executor(schedule);
                let mut seq = 1;
                for chunk in run.values.chunks(per_call) {
                    let refs: Vec<&Value> = chunk.iter().collect();
                    for (got, want) in e.execute_many(Seq(seq), &refs).iter().zip(&outcomes[seq as usize - 1..]) {
                        if let Some(what) = differ(want, got) {
                            return Err(Failure::Conflicts { schedule: format!("{schedule:?}"), seq, what });
                        }
                        seq += 1;
                    }
                }
                if e.service().snapshot() != expected.service().snapshot() {
                    let schedule = format!("{schedule:?}, {per_call} values per run");
                    return Err(Failure::Conflicts { schedule, seq, what: "the final states differ".into() });
                }
            }
        }
        Ok(())
    }
}

/// What differs between two instances' outcomes, if anything.
fn differ(a: &[Outcome], b: &[Outcome]) -> Option<String> {
    if a.len() != b.len() {
        return Some(format!("{} outcomes against {}", a.len(), b.len()));
    }
    for (x, y) in a.iter().zip(b) {
        if x.result != y.result {
            return Some(format!(
                "client {} request {}: reply {:?} against {:?}",
                x.client,
                x.seq,
                String::from_utf8_lossy(&x.result),
                String::from_utf8_lossy(&y.result)
            ));
        }
        if x.pushes != y.pushes {
            return Some(format!("client {} request {}: push events differ", x.client, x.seq));
        }
    }
    None
}
