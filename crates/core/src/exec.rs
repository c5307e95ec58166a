//! Execution: runs decided values in order against the service, keeps the last reply of
//! every client (exactly-once), and produces checkpoints.
//!
//! Invariants:
//! - values execute in sequence order, each exactly once (`executed` only grows, or jumps
//!   to a checkpoint restored by state transfer);
//! - a request `(client, seq)` runs at most once: a request whose `seq` is not above the
//!   client's last executed `seq` is answered from the reply cache, never re-executed;
//! - agreed time never goes backwards (`time = max(time, value.time)`);
//! - whatever the [`Schedule`], replies, the reply cache, the `ExecCtx` of every request
//!   and the next snapshot equal those of sequential execution. Parallel schedules decide
//!   freshness, contexts and cache updates on the calling thread in decided order; only
//!   the service calls run out of order, as the dependency graph allows
//!   (see [`crate::parallel`]);
//! - between calls no request is running, so snapshots and restores see a quiet service
//!   (checkpoints are taken between batches).

pub use crate::chunk::{chunk_bounds, leaf_digest, merkle_root, Chunked, Piece, CHUNK_AVG_MAX, CHUNK_AVG_MIN};
use crate::crypto::{Hasher, PublicKey};
use crate::membership::{AdminError, AdminOp, AdminResult, Membership, ADMIN_CLIENT};
use crate::message::{owner_of, ClientId, Request, Seq, Value};
use crate::parallel::{GraphBuilder, Job, Pool, SplitMix};
use crate::service::{read_front, take_front, ExecCtx, RestoreError, Service};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Arc;

/// The reply cache entry of one client.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct LastReply {
    seq: u64,
    #[serde(with = "serde_bytes")]
    result: Vec<u8>,
}

/// What a request's execution produced, for the reply path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    pub client: ClientId,
    pub seq: u64,
    pub result: Vec<u8>,
    /// False when this was a duplicate answered from the cache.
    pub fresh: bool,
    /// The push events it produced, numbered per client in decided order.
    pub pushes: Vec<PushEvent>,
}

/// An agreed-time tick the service ran ([`Service::on_tick`]) before instance `seq`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tick {
    pub seq: Seq,
    /// Agreed time: the instance's, the first to reach a multiple of `tick_ms`.
    pub time: u64,
    pub pushes: Vec<PushEvent>,
}

/// A push event with the number every node gives it: a client's events are numbered
/// 1, 2, ... in the order execution produced them (UpRight §3.1).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PushEvent {
    pub client: ClientId,
    pub seq: u64,
    pub event: Vec<u8>,
}

/// How the executor runs the requests of a service that opts into parallel execution
/// ([`Service::concurrent`]). A service that does not opt in always runs sequentially.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// One request after another through `Service::execute`, in decided order.
    Sequential,
    /// A dependency graph per call, run by `workers` threads: the caller plus
    /// `workers - 1` pool threads, started on first use and parked between calls.
    Pool { workers: usize },
    /// A dependency graph per call, run on the caller's thread in a random order the graph
    /// allows (seeded, so reproducible). A testing aid: it explores the orders a pool
    /// could produce deterministically, so a wrong conflict declaration shows up as a
    /// difference from `Sequential` instead of as a rare race.
    Shuffled { seed: u64 },
}

impl Schedule {
    /// `workers` as configured ([`crate::config::Options::exec_workers`]): 1 (or 0) is
    /// the sequential path, exactly as without a parallelizer.
    pub fn from_workers(workers: usize) -> Schedule {
        if workers <= 1 {
            Schedule::Sequential
        } else {
            Schedule::Pool { workers }
        }
    }
}

pub struct Executor<S> {
    /// None only once [`Executor::take_service`] handed it on, to the next epoch's
    /// executor: the husk left is dropped, never used.
    service: Option<S>,
    /// Last executed instance.
    executed: Seq,
    /// Agreed time of the last executed instance.
    time: u64,
    clients: BTreeMap<ClientId, LastReply>,
    /// The last push event number per client (part of the checkpointed state, so a node
    /// that transfers state numbers the next events as everyone else does).
    push_seqs: BTreeMap<ClientId, u64>,
    /// The order nodes, as administrative operations left them (replicated state: part
    /// of every snapshot, so a node that transfers state learns the membership too).
    membership: Membership,
    /// Who may sign administrative operations (configuration, not state).
    admin: Option<PublicKey>,
    /// Execution and RQ nodes of their own (0: co-located): a change of (u, r) they cannot
    /// serve is refused.
    stages: (usize, usize),
    schedule: Schedule,
    /// `Schedule::Pool`: started by the first call that has a concurrent handle, so a
    /// service that never opts in never starts a thread.
    pool: Option<Pool>,
    /// `Schedule::Shuffled`: picks among ready jobs; advances across calls.
    shuffle: SplitMix,
    /// Agreed-time ticks ([`crate::config::Options::tick_ms`]; 0: off).
    tick_ms: u64,
    /// Ticks run since the caller last took them ([`Executor::take_ticks`]).
    ticks: Vec<Tick>,
    /// `Mutation::RestoreWithoutTime`: a checker test's deliberate bug.
    restore_without_time: bool,
}

/// An executor's state at a checkpoint, frozen ([`Executor::freeze`]).
pub struct FrozenExecutor {
    head: SnapshotHead,
    service: Box<dyn crate::service::Frozen>,
}

impl FrozenExecutor {
    /// The pieces [`Executor::pieces`] returned when the state was frozen.
    pub fn pieces(self) -> Vec<Arc<Piece>> {
        self.head.with_service(self.service.pieces())
    }

    pub fn executed(&self) -> Seq {
        self.head.executed
    }
}

/// Everything of a snapshot but the service state. Postcard writes a nested struct as
/// its fields in order, so `SnapshotBody` has the bytes it had with these fields inline.
#[derive(Serialize, Deserialize)]
struct SnapshotHead {
    executed: Seq,
    time: u64,
    clients: BTreeMap<ClientId, LastReply>,
    push_seqs: BTreeMap<ClientId, u64>,
    membership: Membership,
}

impl SnapshotHead {
    /// The snapshot's pieces: the head first, with the length of the service's bytes
    /// after it, then the service's own pieces. Concatenated they are the postcard bytes
    /// of [`SnapshotBody`], which `restore` reads in one go.
    fn with_service(self, service: Vec<Arc<Piece>>) -> Vec<Arc<Piece>> {
        let service_len: usize = service.iter().map(|p| p.len()).sum();
        std::iter::once(Piece::new(self.encode(service_len))).chain(service).collect()
    }

    /// The head's bytes, ending in the length of the service's bytes that follow.
    fn encode(&self, service_len: usize) -> Vec<u8> {
        let head = postcard::to_allocvec(self).unwrap_or_default();
        // A byte string's length prefix is a varint, as a u64's is.
        postcard::to_extend(&(service_len as u64), head).unwrap_or_default()
    }
}

/// An executor snapshot: the head, then the service's bytes as one byte string. Read
/// with the service state borrowed, not copied: a restore of a large state holds the
/// snapshot bytes and the rebuilt state, not a third copy in between.
#[derive(Serialize, Deserialize)]
struct SnapshotBody<'a> {
    head: SnapshotHead,
    #[serde(borrow)]
    service: &'a [u8],
}

/// How a request of a parallel run is answered, decided in decided order.
enum Answer {
    /// Executes as job `j`.
    Fresh(u32),
    /// A duplicate of job `j` of the same run: gets its reply.
    Copy(u32),
    /// A duplicate of the client's cached request.
    Cached(Vec<u8>),
    /// A duplicate of an older request whose reply is gone: empty, as sequentially.
    Empty,
}

impl<S: Service> Executor<S> {
    /// An executor that runs requests one at a time ([`Schedule::Sequential`]).
    pub fn new(service: S) -> Executor<S> {
        Executor::with_schedule(service, Schedule::Sequential)
    }

    /// An executor with `workers` threads for a service that opts in (see
    /// [`Schedule::from_workers`]).
    pub fn with_workers(service: S, workers: usize) -> Executor<S> {
        Executor::with_schedule(service, Schedule::from_workers(workers))
    }

    pub fn with_schedule(service: S, schedule: Schedule) -> Executor<S> {
        let seed = match schedule {
            Schedule::Shuffled { seed } => seed,
            _ => 0,
        };
        Executor {
            service: Some(service),
            executed: Seq(0),
            time: 0,
            clients: BTreeMap::new(),
            push_seqs: BTreeMap::new(),
            membership: Membership::default(),
            admin: None,
            stages: (0, 0),
            schedule,
            pool: None,
            shuffle: SplitMix::new(seed),
            tick_ms: 0,
            ticks: Vec::new(),
            restore_without_time: false,
        }
    }

    /// Runs [`Service::on_tick`] where agreed time crosses a multiple of `tick_ms` (0:
    /// never). Configuration, like the membership: set before executing anything.
    pub fn set_tick_ms(&mut self, tick_ms: u64) {
        self.tick_ms = tick_ms;
    }

    /// Switches on the checker mutation that concerns the executor, if `mutation` is it.
    pub fn set_mutation(&mut self, mutation: Option<crate::quorum::Mutation>) {
        self.restore_without_time = mutation == Some(crate::quorum::Mutation::RestoreWithoutTime);
    }

    /// The ticks run since the last call, with their push events numbered like a
    /// request's.
    pub fn take_ticks(&mut self) -> Vec<Tick> {
        std::mem::take(&mut self.ticks)
    }

    /// Whether an instance of agreed time `time` ticks after one of time `before`: time
    /// crossed a multiple of `tick_ms`. A function of decided values only, so every node
    /// ticks at the same instance (the snapshot carries `time`, so a node that restored
    /// one does too).
    fn ticks(&self, before: u64, time: u64) -> bool {
        self.tick_ms > 0 && time / self.tick_ms > before / self.tick_ms
    }

    /// Advances agreed time to `value`'s and runs the tick it crosses, if any.
    fn advance_time(&mut self, seq: Seq, value: &Value) {
        let before = self.time;
        self.time = self.time.max(value.time);
        if self.ticks(before, self.time) {
            let ctx = ExecCtx::new(seq, self.time, value.seed(seq), crate::ids::TICK_CLIENT);
            self.svc_mut().on_tick(&ctx);
            let pushes = self.number(ctx.take_pushes());
            self.ticks.push(Tick { seq, time: self.time, pushes });
        }
    }

    /// Agreed time of the last executed instance.
    pub fn time(&self) -> u64 {
        self.time
    }

    pub fn executed(&self) -> Seq {
        self.executed
    }

    pub fn service(&self) -> &S {
        self.svc()
    }

    fn svc(&self) -> &S {
        self.service.as_ref().expect("the service was handed to the next epoch's executor")
    }

    fn svc_mut(&mut self) -> &mut S {
        self.service.as_mut().expect("the service was handed to the next epoch's executor")
    }

    /// The service, for the next membership epoch's executor (replica/epoch.rs): the
    /// service goes on across epochs and that executor restores the epoch's last stable
    /// state into it. This executor must not be used afterwards.
    pub fn take_service(&mut self) -> S {
        self.service.take().expect("the service was handed on once")
    }

    pub fn schedule(&self) -> Schedule {
        self.schedule
    }

    /// Pool threads started so far (0 until a parallel run happened).
    pub fn pool_threads(&self) -> usize {
        self.pool.as_ref().map_or(0, Pool::helpers)
    }

    /// The cached reply for `(client, seq)`, if that is the client's last executed request.
    pub fn cached(&self, client: ClientId, seq: u64) -> Option<&[u8]> {
        self.clients.get(&client).filter(|l| l.seq == seq).map(|l| l.result.as_slice())
    }

    /// The membership as of the last executed instance.
    pub fn membership(&self) -> &Membership {
        &self.membership
    }

    /// Sets the starting membership and the admin key (a node's configuration, before
    /// it executes or restores anything).
    pub fn set_membership(&mut self, membership: Membership, admin: Option<PublicKey>) {
        self.membership = membership;
        self.admin = admin;
    }

    /// How many execution and RQ nodes run apart (0: co-located): a membership must
    /// tolerate no more than they can (`2u + 1` and `2u + r + 1` of them).
    pub fn set_stages(&mut self, exec: usize, rq: usize) {
        self.stages = (exec, rq);
    }

    /// The client's last executed sequence number.
    pub fn last_seq(&self, client: ClientId) -> u64 {
        self.clients.get(&client).map_or(0, |l| l.seq)
    }

    /// Executes instance `seq`, which must directly follow the last executed one.
    ///
    /// # Panics
    /// If `seq != executed + 1`: the caller orders execution.
    pub fn execute(&mut self, seq: Seq, value: &Value) -> Vec<Outcome> {
        self.execute_many(seq, &[value]).into_iter().next().unwrap_or_default()
    }

    /// Executes instances `first, first + 1, ...` (one per value) as one run: under a
    /// parallel schedule one dependency graph spans all of them, so a later batch's
    /// requests need not wait for an earlier batch's unrelated ones. Returns the outcomes
    /// per value. A checkpoint must not fall inside the run: the caller splits runs there.
    ///
    /// # Panics
    /// If `first != executed + 1`: the caller orders execution. If the service panics.
    pub fn execute_many(&mut self, first: Seq, values: &[&Value]) -> Vec<Vec<Outcome>> {
        assert_eq!(first, self.executed + 1, "values execute in order");
        if values.is_empty() {
            return Vec::new();
        }
        // An administrative operation changes the membership between two requests: a
        // barrier, so such runs go one request after another.
        let admin = values.iter().any(|v| v.requests.iter().any(|r| owner_of(r.client) == ADMIN_CLIENT));
        // A tick runs through `&mut self` between two instances: a barrier too.
        let mut time = self.time;
        let tick = values.iter().any(|v| {
            let before = time;
            time = time.max(v.time);
            self.ticks(before, time)
        });
        let handle = match self.schedule {
            _ if admin || tick => None,
            Schedule::Sequential => None,
            Schedule::Pool { .. } | Schedule::Shuffled { .. } => self.svc().concurrent(),
        };
        let out = match handle {
            None => values.iter().zip(first.onward()).map(|(value, seq)| self.execute_sequential(seq, value)).collect(),
            Some(handle) => self.execute_graph(first, values, handle),
        };
        self.executed = first + values.len() as u64 - 1;
        out
    }

    fn execute_sequential(&mut self, seq: Seq, value: &Value) -> Vec<Outcome> {
        self.advance_time(seq, value);
        let seed = value.seed(seq);
        let mut out = Vec::with_capacity(value.requests.len());
        for (index, req) in value.requests.iter().enumerate() {
            out.push(self.execute_request(seq, seed, index as u64, req));
        }
        out
    }

    fn execute_request(&mut self, seq: Seq, seed: u64, index: u64, req: &Request) -> Outcome {
        let last = self.last_seq(req.client);
        if req.seq <= last {
            let result = self.cached(req.client, req.seq).map(<[u8]>::to_vec).unwrap_or_default();
            return Outcome { client: req.client, seq: req.seq, result, fresh: false, pushes: Vec::new() };
        }
        if owner_of(req.client) == ADMIN_CLIENT {
            let result = crate::membership::encode_result(&self.administer(seq, &req.op));
            self.clients.insert(req.client, LastReply { seq: req.seq, result: result.clone() });
            return Outcome { client: req.client, seq: req.seq, result, fresh: true, pushes: Vec::new() };
        }
        let ctx = request_ctx(seq, self.time, seed, index, req.client);
        let result = self.svc_mut().execute(&req.op, &ctx);
        self.clients.insert(req.client, LastReply { seq: req.seq, result: result.clone() });
        let pushes = self.number(ctx.take_pushes());
        Outcome { client: req.client, seq: req.seq, result, fresh: true, pushes }
    }

    /// Applies an administrative operation decided in instance `seq` (membership.rs).
    /// The first change of an instance ends the epoch there; a second one in the same
    /// instance is refused, so an epoch change is always exactly one step.
    fn administer(&mut self, seq: Seq, op: &[u8]) -> AdminResult {
        let Some(admin) = self.admin else {
            return Err(AdminError::NoAdminKey);
        };
        let op = AdminOp::decode(op)?;
        if self.membership.since == seq {
            return Err(AdminError::ChangeInProgress);
        }
        let next = self.membership.apply(&op, &admin, seq)?;
        let quorums = next.quorums().map_err(|e| AdminError::Quorums(e.to_string()))?;
        let (exec, rq) = self.stages;
        if (exec > 0 || rq > 0) && next.r > self.membership.r {
            // Execution and RQ nodes still in the old epoch would believe r_old + 1 of
            // their peers (checkpoint certificates, amplified endorsements), which the
            // new r no longer makes safe: they learn the change only after the fact.
            return Err(AdminError::Quorums(format!(
                "r cannot grow from {} to {} while execution or RQ nodes run apart",
                self.membership.r, next.r
            )));
        }
        if exec > 0 && exec < quorums.execution_nodes_min() || rq > 0 && rq < quorums.rq_nodes_min() {
            return Err(AdminError::Quorums(format!(
                "(u, r) = ({}, {}) needs {} execution and {} RQ nodes; the cluster has {exec} and {rq} apart",
                next.u,
                next.r,
                quorums.execution_nodes_min(),
                quorums.rq_nodes_min()
            )));
        }
        self.membership = next.clone();
        Ok(next)
    }

    /// Numbers one request's push events, continuing each client's sequence. Called in
    /// decided order on every path, so every node gives event n the same number.
    fn number(&mut self, pushes: Vec<crate::service::Push>) -> Vec<PushEvent> {
        pushes
            .into_iter()
            .map(|(client, event)| {
                let seq = self.push_seqs.entry(client).or_insert(0);
                *seq += 1;
                PushEvent { client, seq: *seq, event }
            })
            .collect()
    }

    /// The parallel path: decide every request's fate and context in decided order (as
    /// `execute_sequential` would), build the graph, run it, then fill in replies and the
    /// reply cache in decided order.
    fn execute_graph(
        &mut self,
        first: Seq,
        values: &[&Value],
        handle: std::sync::Arc<dyn crate::service::ConcurrentService>,
    ) -> Vec<Vec<Outcome>> {
        let mut graph = GraphBuilder::new();
        // Each client's latest request so far in decided order, and the job that runs it
        // (None: it ran before this call and its reply is in the cache).
        let mut latest: BTreeMap<ClientId, (u64, Option<u32>)> = BTreeMap::new();
        let mut plan: Vec<Vec<Answer>> = Vec::with_capacity(values.len());
        let mut sinks: Vec<ExecCtx> = Vec::new();
        for (value, seq) in values.iter().zip(first.onward()) {
            // No tick falls in a run that takes this path (`execute_many`).
            self.time = self.time.max(value.time);
            let seed = value.seed(seq);
            let mut answers = Vec::with_capacity(value.requests.len());
            for (index, req) in value.requests.iter().enumerate() {
                let (last, job) = latest.get(&req.client).copied().unwrap_or((self.last_seq(req.client), None));
                let answer = if req.seq > last {
                    let ctx = request_ctx(seq, self.time, seed, index as u64, req.client);
                    let conflicts = self.svc().conflicts(&req.op);
                    // A clone shares the job's push sink: its events are read back below.
                    sinks.push(ctx.clone());
                    let j = graph.push(req.client, &conflicts, Job { op: req.op.to_vec(), ctx });
                    debug_assert_eq!(j as usize + 1, sinks.len(), "jobs are numbered in push order");
                    latest.insert(req.client, (req.seq, Some(j)));
                    Answer::Fresh(j)
                } else if req.seq < last {
                    Answer::Empty
                } else {
                    match job {
                        Some(j) => Answer::Copy(j),
                        None => {
                            Answer::Cached(self.cached(req.client, req.seq).map(<[u8]>::to_vec).unwrap_or_default())
                        }
                    }
                };
                answers.push(answer);
            }
            plan.push(answers);
        }
        let graph = graph.finish();
        let results = match self.schedule {
            Schedule::Shuffled { .. } => {
                let shuffle = &mut self.shuffle;
                graph.run_inline(handle.as_ref(), |n| shuffle.below(n))
            }
            Schedule::Pool { workers } => {
                self.pool.get_or_insert_with(|| Pool::new(workers.saturating_sub(1))).run(graph, handle)
            }
            Schedule::Sequential => unreachable!("the sequential schedule never builds a graph"),
        };
        values
            .iter()
            .zip(plan)
            .map(|(value, answers)| {
                value
                    .requests
                    .iter()
                    .zip(answers)
                    .map(|(req, answer)| {
                        let (result, fresh, pushes) = match answer {
                            Answer::Fresh(j) => {
                                let pushes = self.number(sinks[j as usize].take_pushes());
                                (results[j as usize].clone(), true, pushes)
                            }
                            Answer::Copy(j) => (results[j as usize].clone(), false, Vec::new()),
                            Answer::Cached(result) => (result, false, Vec::new()),
                            Answer::Empty => (Vec::new(), false, Vec::new()),
                        };
                        if fresh {
                            self.clients.insert(req.client, LastReply { seq: req.seq, result: result.clone() });
                        }
                        Outcome { client: req.client, seq: req.seq, result, fresh, pushes }
                    })
                    .collect()
            })
            .collect()
    }

    /// Service state, reply cache and position, deterministically serialized, as the
    /// pieces a checkpoint cuts into chunks (`chunk.rs`).
    pub fn pieces(&self) -> Vec<Arc<Piece>> {
        self.head().with_service(self.svc().pieces())
    }

    /// [`Executor::pieces`] in one buffer.
    ///
    /// The service's part is [`Service::snapshot`], not its pieces joined: pieces may have
    /// left memory (`chunk.rs`), and the service holds its state in memory regardless.
    pub fn snapshot(&self) -> Vec<u8> {
        let service = self.svc().snapshot();
        let mut bytes = self.head().encode(service.len());
        bytes.extend_from_slice(&service);
        bytes
    }

    /// The same state as [`Executor::snapshot`], copied cheaply now and serialized by
    /// [`FrozenExecutor::pieces`] later, on any thread; None if the service cannot
    /// freeze ([`Service::freeze`]).
    pub fn freeze(&self) -> Option<FrozenExecutor> {
        let service = self.svc().freeze()?;
        Some(FrozenExecutor { head: self.head(), service })
    }

    /// Everything of a snapshot but the service state. The reply cache is copied: one
    /// entry per client, small beside the service state.
    fn head(&self) -> SnapshotHead {
        SnapshotHead {
            executed: self.executed,
            time: self.time,
            clients: self.clients.clone(),
            push_seqs: self.push_seqs.clone(),
            membership: self.membership.clone(),
        }
    }

    /// Replaces everything with a snapshot (from state transfer or local recovery).
    ///
    /// # Errors
    /// If the bytes do not decode; the executor is unchanged then.
    pub fn restore(&mut self, bytes: &[u8]) -> Result<Seq, RestoreError> {
        let body: SnapshotBody =
            postcard::from_bytes(bytes).map_err(|e| RestoreError(format!("executor snapshot: {e}")))?;
        self.svc_mut().restore(body.service)?;
        Ok(self.take_head(body.head))
    }

    /// [`Executor::restore`] from a checkpoint's chunks, read one at a time: the service
    /// rebuilds its state as they go by ([`Service::restore_from`]), so a restore of a
    /// large state does not first join the snapshot in memory.
    ///
    /// # Errors
    /// As [`Executor::restore`]; and a chunk that cannot be read back, which may leave the
    /// service's state partly replaced ([`Service::restore_from`]).
    pub fn restore_chunked(&mut self, chunked: &Chunked) -> Result<Seq, RestoreError> {
        let len = chunked.len();
        let mut reader = chunked.reader();
        // The head, then the service bytes' length prefix (SnapshotBody's layout).
        let ((head, service_len), rest, used) = read_front(&mut reader, len, |front| {
            let bad = |e: postcard::Error| RestoreError(format!("executor snapshot: {e}"));
            let Some((head, after)) = take_front::<SnapshotHead>(front).map_err(bad)? else { return Ok(None) };
            let Some((service_len, tail)) = take_front::<u64>(after).map_err(bad)? else { return Ok(None) };
            Ok(Some(((head, service_len), front.len() - tail.len())))
        })?;
        if (used as u64).checked_add(service_len) != Some(len) {
            return Err(RestoreError(format!(
                "executor snapshot of {len} bytes: a head of {used} and a service state of {service_len}"
            )));
        }
        let mut service = std::io::Read::chain(rest.as_slice(), reader);
        self.svc_mut().restore_from(&mut service, service_len)?;
        Ok(self.take_head(head))
    }

    /// Everything but the service from a snapshot's head; the instance it was taken after.
    fn take_head(&mut self, head: SnapshotHead) -> Seq {
        let SnapshotHead { executed, time, clients, push_seqs, membership } = head;
        self.executed = executed;
        self.time = if self.restore_without_time { 0 } else { time };
        self.clients = clients;
        self.push_seqs = push_seqs;
        self.membership = membership;
        executed
    }
}

/// The service's own bytes in an executor snapshot, and the instance it was taken after.
/// A backup restored into a new cluster (`keel init --restore`) keeps the service's
/// state and nothing of the old cluster's: not its clients' reply cache (the new
/// cluster's clients are others), its time or its membership.
///
/// # Errors
/// If the bytes are not an executor snapshot.
pub fn snapshot_service_state(bytes: &[u8]) -> Result<(Seq, &[u8]), RestoreError> {
    let body: SnapshotBody =
        postcard::from_bytes(bytes).map_err(|e| RestoreError(format!("executor snapshot: {e}")))?;
    Ok((body.head.executed, body.service))
}

/// The membership recorded in an executor snapshot, read from the head alone: the
/// chunks are joined only until the head decodes (a recovering node asks this of its
/// checkpoints above the stable one, which may hold a large state).
pub fn snapshot_membership(chunked: &Chunked) -> Option<Membership> {
    snapshot_head(chunked).map(|head| head.membership)
}

/// The highest request sequence number of `client` (a session) an executor snapshot
/// holds a reply for: whether the state includes that client's request. `keel admin
/// backup` takes a checkpoint that includes the barrier it ordered (backup.rs).
pub fn snapshot_client_seq(chunked: &Chunked, client: ClientId) -> Option<u64> {
    snapshot_head(chunked).map(|head| head.clients.get(&client).map_or(0, |r| r.seq))
}

/// An executor snapshot's head, read alone: the chunks are read only until it decodes.
fn snapshot_head(chunked: &Chunked) -> Option<SnapshotHead> {
    let front = read_front(&mut chunked.reader(), chunked.len(), |front| {
        let taken = take_front::<SnapshotHead>(front).map_err(|e| RestoreError(e.to_string()))?;
        Ok(taken.map(|(head, tail)| (head, front.len() - tail.len())))
    });
    front.ok().map(|(head, _, _)| head)
}

/// The context of the request at `index` in instance `seq`: a function of agreed values
/// only, whichever thread runs it.
fn request_ctx(seq: Seq, time: u64, seed: u64, index: u64, client: ClientId) -> ExecCtx {
    ExecCtx::new(seq, time, Hasher::new("keel/request-seed").u64(seed).u64(index).finish().prefix_u64(), client)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::{ConcurrentService, Conflicts, Item};
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::{Arc, Condvar, Mutex};
    use std::time::Duration;

    /// Appends every request to a log; replies with the log length.
    #[derive(Default)]
    struct Log(Vec<Vec<u8>>);
    impl Service for Log {
        fn execute(&mut self, request: &[u8], _ctx: &ExecCtx) -> Vec<u8> {
            self.0.push(request.to_vec());
            (self.0.len() as u64).to_le_bytes().to_vec()
        }
        fn snapshot(&self) -> Vec<u8> {
            postcard::to_allocvec(&self.0).unwrap_or_default()
        }
        fn restore(&mut self, s: &[u8]) -> Result<(), RestoreError> {
            self.0 = postcard::from_bytes(s).map_err(|e| RestoreError(e.to_string()))?;
            Ok(())
        }
    }

    fn req(client: u64, seq: u64, op: &[u8]) -> Request {
        Request::new(ClientId(client), seq, op.to_vec().into())
    }

    #[test]
    fn duplicates_are_answered_from_the_cache_not_re_executed() {
        let mut e = Executor::new(Log::default());
        let v = Value { time: 5, requests: vec![req(1, 1, b"a"), req(1, 1, b"a"), req(2, 1, b"b")] };
        let out = e.execute(Seq(1), &v);
        assert_eq!(out.iter().map(|o| o.fresh).collect::<Vec<_>>(), vec![true, false, true]);
        assert_eq!(out[0].result, out[1].result);
        assert_eq!(e.service().0.len(), 2);
        let out = e.execute(Seq(2), &Value { time: 1, requests: vec![req(1, 1, b"a")] });
        assert!(!out[0].fresh);
        assert_eq!(e.service().0.len(), 2);
    }

    #[test]
    #[should_panic(expected = "values execute in order")]
    fn out_of_order_execution_is_a_programming_error() {
        let mut e = Executor::new(Log::default());
        e.execute(Seq(2), &Value::null());
    }

    #[test]
    fn the_membership_reads_back_from_a_snapshot_without_the_service() {
        let mut e = Executor::new(Log::default());
        let keys = [crate::crypto::SigningKey::from_seed([1; 32]).public()];
        let m = Membership::genesis(0, 0, &keys, &["127.0.0.1:1".into()]);
        e.set_membership(m.clone(), None);
        e.execute(Seq(1), &Value { time: 1, requests: vec![req(1, 1, b"x")] });
        // A head that spans several chunks, and service bytes after it that are not read.
        let chunked = Chunked::from_pieces(e.pieces(), CHUNK_AVG_MIN);
        assert_eq!(snapshot_membership(&chunked), Some(m.clone()));
        let mut bytes = e.snapshot();
        bytes.extend(std::iter::repeat_n(7u8, 5000));
        let many = Chunked::from_chunks(bytes.chunks(3).map(<[u8]>::to_vec).collect());
        assert_eq!(snapshot_membership(&many), Some(m));
        assert_eq!(snapshot_membership(&Chunked::new(b"junk".to_vec(), CHUNK_AVG_MIN)), None);
        assert_eq!(snapshot_membership(&Chunked::new(Vec::new(), CHUNK_AVG_MIN)), None);
    }

    #[test]
    fn snapshot_restores_state_cache_and_position() {
        let mut a = Executor::new(Log::default());
        a.execute(Seq(1), &Value { time: 9, requests: vec![req(7, 1, b"x")] });
        let snap = a.snapshot();
        let mut b = Executor::new(Log::default());
        assert_eq!(b.restore(&snap), Ok(Seq(1)));
        assert_eq!(b.snapshot(), snap);
        assert_eq!(b.cached(ClientId(7), 1), a.cached(ClientId(7), 1));
        assert!(b.restore(b"junk").is_err());
        assert_eq!(b.snapshot(), snap, "a failed restore changes nothing");
    }

    #[test]
    fn a_snapshot_streamed_from_its_chunks_restores_what_its_bytes_do() {
        let mut a = Executor::new(Log::default());
        let big = vec![5u8; 9000];
        a.execute(Seq(1), &Value { time: 9, requests: vec![req(7, 1, b"x"), req(8, 1, &big)] });
        a.execute(Seq(2), &Value { time: 11, requests: vec![req(7, 2, b"y")] });
        let snap = a.snapshot();
        // Chunks of 3 bytes: the head and the service bytes' length prefix span many.
        for chunked in [
            Chunked::from_pieces(a.pieces(), CHUNK_AVG_MIN),
            Chunked::from_chunks(snap.chunks(3).map(<[u8]>::to_vec).collect()),
        ] {
            let mut b = Executor::new(Log::default());
            assert_eq!(b.restore_chunked(&chunked), Ok(Seq(2)));
            assert_eq!(b.snapshot(), snap);
            assert_eq!(b.cached(ClientId(8), 1), a.cached(ClientId(8), 1));
        }
        // A length that does not add up (a byte more, which `restore` would ignore, or
        // less), a cut, junk: refused, nothing changed.
        let mut b = Executor::new(Log::default());
        b.execute(Seq(1), &Value { time: 1, requests: vec![req(1, 1, b"kept")] });
        let before = b.snapshot();
        let mut longer = snap.clone();
        longer.push(0);
        for bad in [longer, snap[..snap.len() - 1].to_vec(), snap[..10].to_vec(), b"junk".to_vec(), Vec::new()] {
            let e = b.restore_chunked(&Chunked::new(bad, CHUNK_AVG_MIN)).expect_err("refused");
            assert_eq!(b.snapshot(), before, "a failed restore changes nothing ({e})");
        }
    }

    /// Per-key logs behind a lock: op = key byte, then the bytes to append. Declares a
    /// write of its key, so requests on different keys may run at once. Tracks how many
    /// requests run on each key at once, to show conflicting ones never overlap.
    #[derive(Default)]
    struct Cells(Arc<CellsState>);
    #[derive(Default)]
    struct CellsState {
        logs: Mutex<BTreeMap<u8, Vec<Vec<u8>>>>,
        active: Mutex<BTreeMap<u8, u32>>,
        overlaps: AtomicU32,
    }
    impl ConcurrentService for CellsState {
        fn execute_shared(&self, op: &[u8], ctx: &ExecCtx) -> Vec<u8> {
            let Some((&key, rest)) = op.split_first() else {
                return b"empty".to_vec();
            };
            {
                let mut active = self.active.lock().expect("lock");
                let a = active.entry(key).or_default();
                *a += 1;
                if *a > 1 {
                    self.overlaps.fetch_add(1, Ordering::Relaxed);
                }
            }
            std::thread::yield_now();
            let mut reply = {
                let mut logs = self.logs.lock().expect("lock");
                let log = logs.entry(key).or_default();
                log.push(rest.to_vec());
                (log.len() as u64).to_le_bytes().to_vec()
            };
            reply.extend(ctx.seq.0.to_le_bytes());
            reply.extend(ctx.time.to_le_bytes());
            reply.extend(ctx.seed.to_le_bytes());
            *self.active.lock().expect("lock").entry(key).or_default() -= 1;
            reply
        }
    }
    impl Service for Cells {
        fn execute(&mut self, op: &[u8], ctx: &ExecCtx) -> Vec<u8> {
            self.0.execute_shared(op, ctx)
        }
        fn conflicts(&self, op: &[u8]) -> Conflicts {
            match op.first() {
                Some(&k) => Conflicts::write(Item::Key(vec![k])),
                None => Conflicts::none(),
            }
        }
        fn concurrent(&self) -> Option<Arc<dyn ConcurrentService>> {
            Some(self.0.clone())
        }
        /// A tick writes key 0, so it must fall between the same requests on every path.
        fn on_tick(&mut self, ctx: &ExecCtx) {
            self.0.logs.lock().expect("lock").entry(0).or_default().push(format!("tick {}", ctx.time).into_bytes());
        }
        fn snapshot(&self) -> Vec<u8> {
            postcard::to_allocvec(&*self.0.logs.lock().expect("lock")).unwrap_or_default()
        }
        fn restore(&mut self, s: &[u8]) -> Result<(), RestoreError> {
            *self.0.logs.lock().expect("lock") = postcard::from_bytes(s).map_err(|e| RestoreError(e.to_string()))?;
            Ok(())
        }
    }

    /// Two values over a few keys with duplicates: (client, seq, op).
    fn cells_workload() -> Vec<Value> {
        let mut values = Vec::new();
        let mut n = 0u8;
        for v in 0..6u64 {
            // A duplicate of client 1's last request of the previous value (from the cache,
            // or from the same run when values share a call).
            let mut requests = vec![req(1, v * 3, b"\x00old")];
            for i in 0..12u64 {
                n = n.wrapping_add(1);
                let client = 1 + (i % 5);
                let seq = 1 + v * 3 + i / 5;
                requests.push(req(client, seq, &[n % 3, n]));
            }
            requests.push(req(1, 3 + v * 3, b"\x00dup")); // duplicate of this value's last
            requests.push(req(2, 1 + v * 3, b"\x00dup")); // older than the last: empty reply
            values.push(Value { time: 10 - v, requests });
        }
        values
    }

    fn run_all(e: &mut Executor<Cells>, values: &[Value], per_call: usize) -> Vec<Vec<Outcome>> {
        let mut out = Vec::new();
        for chunk in values.chunks(per_call) {
            let refs: Vec<&Value> = chunk.iter().collect();
            out.extend(e.execute_many(e.executed() + 1, &refs));
        }
        out
    }

    #[test]
    fn parallel_schedules_equal_sequential_execution() {
        let values = cells_workload();
        let mut seq = Executor::new(Cells::default());
        let expected = run_all(&mut seq, &values, 1);
        assert!(expected.iter().flatten().any(|o| !o.fresh), "the workload has duplicates");
        for schedule in [Schedule::Pool { workers: 1 }, Schedule::Pool { workers: 4 }, Schedule::Shuffled { seed: 3 }] {
            for per_call in [1, 2, 6] {
                let mut e = Executor::with_schedule(Cells::default(), schedule);
                assert_eq!(run_all(&mut e, &values, per_call), expected, "{schedule:?}, {per_call} values per call");
                assert_eq!(e.snapshot(), seq.snapshot(), "{schedule:?}, {per_call} values per call");
                assert_eq!(e.service().0.overlaps.load(Ordering::Relaxed), 0, "conflicting requests overlapped");
            }
        }
    }

    #[test]
    fn ticks_fall_between_the_same_requests_on_every_schedule() {
        // Agreed time 0, 30, 60, ...: ticks every 50 ms fall inside runs of values (60
        // crosses 50, 120 crosses 100, 150 reaches 150).
        let values: Vec<Value> =
            cells_workload().into_iter().zip(0..).map(|(v, i)| Value { time: i * 30, ..v }).collect();
        let ticking = |schedule| {
            let mut e = Executor::with_schedule(Cells::default(), schedule);
            e.set_tick_ms(50);
            e
        };
        let mut seq = ticking(Schedule::Sequential);
        let expected = run_all(&mut seq, &values, 1);
        let key0 = seq.service().0.logs.lock().expect("lock").get(&0).cloned().unwrap_or_default();
        let ticks: Vec<&[u8]> = key0.iter().map(Vec::as_slice).filter(|e| e.starts_with(b"tick")).collect();
        assert_eq!(ticks, vec![&b"tick 60"[..], b"tick 120", b"tick 150"], "times 0, 30, ..., 150 cross 50, 100, 150");
        for schedule in [Schedule::Pool { workers: 4 }, Schedule::Shuffled { seed: 3 }] {
            for per_call in [2, 6] {
                let mut e = ticking(schedule);
                assert_eq!(run_all(&mut e, &values, per_call), expected, "{schedule:?}, {per_call} values per call");
                assert_eq!(e.snapshot(), seq.snapshot(), "{schedule:?}, {per_call} values per call");
            }
        }
    }

    /// Counts ticks and pushes an event to client 9 at each.
    #[derive(Default)]
    struct Ticker(Vec<Vec<u8>>);
    impl Service for Ticker {
        fn execute(&mut self, request: &[u8], _ctx: &ExecCtx) -> Vec<u8> {
            self.0.push(request.to_vec());
            Vec::new()
        }
        fn on_tick(&mut self, ctx: &ExecCtx) {
            assert_eq!(ctx.client, crate::ids::TICK_CLIENT);
            self.0.push(format!("tick {}", ctx.time).into_bytes());
            ctx.push(ClientId(9), b"ticked".to_vec());
        }
        fn snapshot(&self) -> Vec<u8> {
            postcard::to_allocvec(&self.0).unwrap_or_default()
        }
        fn restore(&mut self, s: &[u8]) -> Result<(), RestoreError> {
            self.0 = postcard::from_bytes(s).map_err(|e| RestoreError(e.to_string()))?;
            Ok(())
        }
    }

    #[test]
    fn a_tick_runs_once_per_crossing_before_the_instances_requests_and_its_pushes_are_numbered() {
        let mut e = Executor::new(Ticker::default());
        e.set_tick_ms(50);
        for (seq, time) in [(1, 5), (2, 40), (3, 170), (4, 180), (5, 0), (6, 200)] {
            e.execute(Seq(seq), &Value { time, requests: vec![req(1, seq, format!("op{seq}").as_bytes())] });
        }
        let log: Vec<String> = e.service().0.iter().map(|b| String::from_utf8_lossy(b).into_owned()).collect();
        // 40 -> 170 skips two multiples: one tick. Time 0 (a null value's) keeps 180.
        assert_eq!(log, ["op1", "op2", "tick 170", "op3", "op4", "op5", "tick 200", "op6"]);
        let ticks = e.take_ticks();
        assert_eq!(ticks.iter().map(|t| (t.seq, t.time)).collect::<Vec<_>>(), vec![(Seq(3), 170), (Seq(6), 200)]);
        let pushes: Vec<(ClientId, u64)> =
            ticks.iter().flat_map(|t| t.pushes.iter().map(|p| (p.client, p.seq))).collect();
        assert_eq!(pushes, vec![(ClientId(9), 1), (ClientId(9), 2)]);
        assert!(e.take_ticks().is_empty(), "taken once");
        // A restored executor keeps the agreed time, so it ticks where the others do.
        let mut b = Executor::new(Ticker::default());
        b.set_tick_ms(50);
        b.restore(&e.snapshot()).expect("restore");
        e.execute(Seq(7), &Value { time: 240, requests: Vec::new() });
        b.execute(Seq(7), &Value { time: 240, requests: Vec::new() });
        assert_eq!(b.snapshot(), e.snapshot());
        assert_eq!(e.service().0.len(), 8, "200 -> 240 crosses nothing");
    }

    /// Requests that rendezvous: each waits (up to 10 s) until both arrived. Only truly
    /// concurrent execution lets both see the other.
    #[derive(Default)]
    struct MeetState {
        arrived: Mutex<u32>,
        cv: Condvar,
    }
    impl ConcurrentService for MeetState {
        fn execute_shared(&self, _op: &[u8], _ctx: &ExecCtx) -> Vec<u8> {
            let mut arrived = self.arrived.lock().expect("lock");
            *arrived += 1;
            self.cv.notify_all();
            let (arrived, _) = self.cv.wait_timeout_while(arrived, Duration::from_secs(10), |a| *a < 2).expect("lock");
            if *arrived >= 2 {
                b"met".to_vec()
            } else {
                b"alone".to_vec()
            }
        }
    }
    /// A service that is nothing but its concurrent entry point, stateless between runs.
    struct Shared<C>(Arc<C>);
    impl<C: ConcurrentService + 'static> Service for Shared<C> {
        fn execute(&mut self, op: &[u8], ctx: &ExecCtx) -> Vec<u8> {
            self.0.execute_shared(op, ctx)
        }
        fn conflicts(&self, _op: &[u8]) -> Conflicts {
            Conflicts::none()
        }
        fn concurrent(&self) -> Option<Arc<dyn ConcurrentService>> {
            Some(self.0.clone())
        }
        fn snapshot(&self) -> Vec<u8> {
            Vec::new()
        }
        fn restore(&mut self, _s: &[u8]) -> Result<(), RestoreError> {
            Ok(())
        }
    }

    #[test]
    fn the_pool_runs_independent_requests_at_the_same_time() {
        let mut e = Executor::with_workers(Shared(Arc::<MeetState>::default()), 2);
        let out = e.execute(Seq(1), &Value { time: 0, requests: vec![req(1, 1, b"a"), req(2, 1, b"b")] });
        assert_eq!(out.iter().map(|o| o.result.as_slice()).collect::<Vec<_>>(), vec![b"met".as_slice(), b"met"]);
        assert_eq!(e.pool_threads(), 1);
    }

    #[test]
    fn a_service_that_does_not_opt_in_runs_sequentially_without_threads() {
        let mut e = Executor::with_workers(Log::default(), 4);
        let v = Value { time: 5, requests: vec![req(1, 1, b"a"), req(2, 1, b"b"), req(1, 1, b"a")] };
        let out = e.execute(Seq(1), &v);
        let mut s = Executor::new(Log::default());
        assert_eq!(out, s.execute(Seq(1), &v));
        assert_eq!(e.snapshot(), s.snapshot());
        assert_eq!(e.pool_threads(), 0);
    }

    #[test]
    fn workers_one_is_the_sequential_schedule() {
        assert_eq!(Schedule::from_workers(1), Schedule::Sequential);
        assert_eq!(Schedule::from_workers(0), Schedule::Sequential);
        assert_eq!(Schedule::from_workers(3), Schedule::Pool { workers: 3 });
    }

    struct BoomState;
    impl ConcurrentService for BoomState {
        fn execute_shared(&self, op: &[u8], _ctx: &ExecCtx) -> Vec<u8> {
            assert!(op != b"boom", "service bug");
            op.to_vec()
        }
    }

    #[test]
    #[should_panic(expected = "service bug")]
    fn a_service_panic_on_a_worker_reaches_the_caller() {
        let mut e = Executor::with_workers(Shared(Arc::new(BoomState)), 3);
        let requests = (1..=20).map(|c| req(c, 1, if c == 7 { b"boom" } else { b"ok" })).collect();
        e.execute(Seq(1), &Value { time: 0, requests });
    }
}
