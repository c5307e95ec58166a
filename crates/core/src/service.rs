//! The interface between Keel and a replicated application (ARCHITECTURE §9).
//!
//! A service must be deterministic: the same requests with the same contexts, from the
//! same snapshot, produce the same replies and the same next snapshot on every node. It
//! must use `ctx.time` and `ctx.seed` instead of the local clock and randomness.
//!
//! # Parallel execution (CBASE)
//!
//! By default a service executes one request at a time through `&mut self`, in decided
//! order. A service may opt into the parallelizer (Reference: CBASE, Kotla & Dahlin,
//! DSN 2004) with two methods:
//!
//! - [`Service::conflicts`] declares what a request may read and write ([`Conflicts`]);
//! - [`Service::concurrent`] hands out a [`ConcurrentService`], a `&self` entry point
//!   that worker threads call at the same time, with the service's own locks inside.
//!
//! The executor then builds a dependency graph over the decided requests and runs every
//! request once all earlier requests it conflicts with are done. Conflicting requests
//! therefore run in decided order, the others in any order or at once, and the outcome
//! must be the one sequential execution gives. That holds if the service keeps this
//! contract, which the executor cannot check (the property tests in `services/kv` show
//! how to test it, and that an under-declaring service is caught):
//!
//! 1. `conflicts(op)` depends on the request bytes only, never on the state: it is asked
//!    before earlier requests ran. A request whose footprint depends on the state (read a
//!    pointer, follow it) declares everything it might touch, or [`Conflicts::Everything`].
//! 2. Two requests whose declarations do not conflict commute: either order, or both at
//!    once, gives the same replies and the same state.
//! 3. `ConcurrentService::execute_shared(op, ctx)` has the reply and effect of
//!    `Service::execute(op, ctx)`, and is atomic with respect to concurrent calls.
//!
//! Locks in the service only make concurrent access memory-safe; isolation between
//! requests comes from the dependency graph.

use crate::chunk::Piece;
use crate::message::{ClientId, Seq};
use std::io::Read;
use std::sync::{Arc, Mutex};

/// What execution tells the service about the request it runs, and where the request's
/// push events go ([`ExecCtx::push`]).
#[derive(Clone, Debug)]
pub struct ExecCtx {
    /// The consensus instance that decided the request.
    pub seq: Seq,
    /// Agreed time (ms): the primary's proposal, made monotonic across instances.
    pub time: u64,
    /// Agreed pseudo-random seed of the instance, mixed with the request's position.
    pub seed: u64,
    pub client: ClientId,
    pushes: PushSink,
}

/// A push event a request produced: `event` for client `client`.
pub type Push = (ClientId, Vec<u8>);

/// The push events of one request, collected while it runs (possibly on a worker thread).
#[derive(Clone, Debug, Default)]
struct PushSink(Arc<Mutex<Vec<Push>>>);

impl ExecCtx {
    pub fn new(seq: Seq, time: u64, seed: u64, client: ClientId) -> ExecCtx {
        ExecCtx { seq, time, seed, client, pushes: PushSink::default() }
    }

    /// Sends `event` to `client`, unsolicited (UpRight §3.1: watches, notifications).
    /// Every node numbers a client's events in decided order, so nodes agree on event n;
    /// the client accepts an event once r + 1 nodes sent it, in order, and learns of any
    /// it lost (a gap) instead of waiting for it: delivery is best effort. Like the reply,
    /// this must depend on the request and the state only.
    pub fn push(&self, client: ClientId, event: Vec<u8>) {
        if let Ok(mut p) = self.pushes.0.lock() {
            p.push((client, event));
        }
    }

    /// The events pushed so far, in push order (the executor collects them).
    pub fn take_pushes(&self) -> Vec<Push> {
        self.pushes.0.lock().map(|mut p| std::mem::take(&mut *p)).unwrap_or_default()
    }
}

/// Equal agreed fields (pushes are output, not context).
impl PartialEq for ExecCtx {
    fn eq(&self, o: &ExecCtx) -> bool {
        (self.seq, self.time, self.seed, self.client) == (o.seq, o.time, o.seed, o.client)
    }
}

impl Eq for ExecCtx {}

/// What a read-only execution tells the service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadCtx {
    pub client: ClientId,
    /// The last instance executed into the state the read sees.
    pub executed: Seq,
    /// Agreed time of that instance.
    pub time: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("snapshot cannot be restored: {0}")]
pub struct RestoreError(pub String);

/// A service snapshot's first four bytes: its format, so that a build meeting another
/// build's snapshot (an old data directory, a backup) refuses it by name instead of
/// misreading it. Bump a service's format whenever its snapshot layout changes.
pub fn format_stamp(format: u32) -> Vec<u8> {
    format.to_le_bytes().to_vec()
}

/// The snapshot after its format stamp, if the stamp is `format`; `service` names the
/// service in the error.
pub fn strip_format_stamp<'a>(snapshot: &'a [u8], service: &str, format: u32) -> Result<&'a [u8], RestoreError> {
    let Some((stamp, rest)) = snapshot.split_first_chunk::<4>() else {
        return Err(RestoreError(format!("{service} snapshot of {} bytes has no format stamp", snapshot.len())));
    };
    match u32::from_le_bytes(*stamp) {
        f if f == format => Ok(rest),
        f => Err(RestoreError(format!(
            "{service} snapshot of format {f}; this build reads format {format} (another build's data directory or \
             backup)"
        ))),
    }
}

/// Reads the front of a snapshot streamed from `state` (`len` bytes in all) until
/// `decode` takes a value from what was read: `decode` returns None while it needs more
/// bytes, else the value and how many bytes it used. Returns the value, the bytes read
/// past it (the start of what follows) and how many bytes the value took. Reads grow by
/// doubling, so a head spanning many chunks costs linear time.
///
/// # Errors
/// `decode`'s, a read that fails, or a stream that ends before `decode` is satisfied.
pub fn read_front<T>(
    state: &mut dyn std::io::Read,
    len: u64,
    mut decode: impl FnMut(&[u8]) -> Result<Option<(T, usize)>, RestoreError>,
) -> Result<(T, Vec<u8>, usize), RestoreError> {
    let mut front: Vec<u8> = Vec::new();
    let mut step = 4096usize;
    loop {
        let want = (len - front.len() as u64).min(step as u64) as usize;
        let read = std::io::Read::take(&mut *state, want as u64)
            .read_to_end(&mut front)
            .map_err(|e| RestoreError(format!("snapshot read: {e}")))?;
        if let Some((value, used)) = decode(&front)? {
            let rest = front.split_off(used.min(front.len()));
            return Ok((value, rest, used));
        }
        if read < want || front.len() as u64 >= len {
            return Err(RestoreError(format!("snapshot of {len} bytes cut short at {} in its head", front.len())));
        }
        step = step.saturating_mul(2);
    }
}

/// A `T` taken from the front of `bytes` with what follows it, or None if the bytes end
/// before it does (more may make it decode): the step [`read_front`]'s `decode` repeats.
///
/// # Errors
/// Bytes that are no `T`, whatever follows.
pub fn take_front<T: serde::de::DeserializeOwned>(bytes: &[u8]) -> Result<Option<(T, &[u8])>, postcard::Error> {
    match postcard::take_from_bytes::<T>(bytes) {
        Ok(taken) => Ok(Some(taken)),
        Err(postcard::Error::DeserializeUnexpectedEnd) => Ok(None),
        Err(e) => Err(e),
    }
}

/// A piece of service state a request reads or writes, named by the service.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Item {
    /// Exactly this key.
    Key(Vec<u8>),
    /// Every key that starts with these bytes, present or not (the empty prefix: every
    /// key). A range read such as a scan declares its prefix, so it conflicts with a write
    /// that would add, change or remove a key in its range.
    Prefix(Vec<u8>),
}

impl Item {
    /// Whether some key belongs to both items.
    pub fn overlaps(&self, other: &Item) -> bool {
        match (self, other) {
            (Item::Key(a), Item::Key(b)) => a == b,
            (Item::Key(k), Item::Prefix(p)) | (Item::Prefix(p), Item::Key(k)) => k.starts_with(p),
            (Item::Prefix(a), Item::Prefix(b)) => a.starts_with(b) || b.starts_with(a),
        }
    }
}

/// What a request may read and write: its footprint for the parallelizer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Conflicts {
    /// Conflicts with every other request: it runs alone, after every earlier request and
    /// before every later one. The default, and always a correct answer.
    Everything,
    /// The request reads at most `reads` and writes at most `writes`. Two requests
    /// conflict iff a write item of one overlaps a read or write item of the other.
    Items { reads: Vec<Item>, writes: Vec<Item> },
}

impl Conflicts {
    /// Touches no state (a request answered from its bytes alone, such as an error).
    pub fn none() -> Conflicts {
        Conflicts::Items { reads: Vec::new(), writes: Vec::new() }
    }

    pub fn read(item: Item) -> Conflicts {
        Conflicts::Items { reads: vec![item], writes: Vec::new() }
    }

    pub fn write(item: Item) -> Conflicts {
        Conflicts::Items { reads: Vec::new(), writes: vec![item] }
    }

    /// Whether the two requests must run in decided order. This is the definition the
    /// executor's dependency graph implements (without comparing every pair).
    pub fn conflicts_with(&self, other: &Conflicts) -> bool {
        match (self, other) {
            (Conflicts::Everything, _) | (_, Conflicts::Everything) => true,
            (Conflicts::Items { reads: ra, writes: wa }, Conflicts::Items { reads: rb, writes: wb }) => {
                let any = |xs: &[Item], ys: &[Item]| xs.iter().any(|x| ys.iter().any(|y| x.overlaps(y)));
                any(wa, rb) || any(wa, wb) || any(ra, wb)
            }
        }
    }
}

/// The concurrent entry point of a service that opts into parallel execution. Worker
/// threads call it at the same time for requests whose declarations do not conflict.
pub trait ConcurrentService: Send + Sync {
    /// Runs one ordered request; the same reply and effect as [`Service::execute`].
    ///
    /// Must be atomic with respect to concurrent calls (a request never observes half of
    /// another); the service's own locks provide that.
    fn execute_shared(&self, request: &[u8], ctx: &ExecCtx) -> Vec<u8>;
}

/// A service state as it was when [`Service::freeze`] took it.
pub trait Frozen: Send {
    /// Exactly the bytes [`Service::snapshot`] returned at the moment of the freeze.
    fn snapshot(self: Box<Self>) -> Vec<u8>;

    /// The same bytes as pieces, as [`Service::pieces`] returned them at the freeze.
    fn pieces(self: Box<Self>) -> Vec<Arc<Piece>> {
        vec![Piece::new(self.snapshot())]
    }
}

pub trait Service {
    /// Runs one ordered request and returns the reply bytes.
    fn execute(&mut self, request: &[u8], ctx: &ExecCtx) -> Vec<u8>;

    /// What the request may read and write. Asked only if [`Service::concurrent`] returns
    /// a handle, once per fresh request, in decided order, before earlier requests ran:
    /// the answer must depend on `request` alone. A request that does not decode still
    /// gets an answer (for example [`Conflicts::none`] if it is answered with an error
    /// without touching the state).
    fn conflicts(&self, _request: &[u8]) -> Conflicts {
        Conflicts::Everything
    }

    /// Opts into parallel execution: a handle onto this service's state (usually an
    /// `Arc` the service itself holds) whose calls run concurrently. The executor asks for
    /// it at the start of every run of batches and drops its clones when the run ends;
    /// between runs it uses `&mut self` (execute, snapshot, restore). None (the default):
    /// requests run one at a time through [`Service::execute`].
    fn concurrent(&self) -> Option<Arc<dyn ConcurrentService>> {
        None
    }

    /// Answers a read-only request from the current state, without changing it (PBFT's
    /// read-only optimisation, ARCHITECTURE §7). Nodes run it at different points of the
    /// decided sequence, so the answer must depend on the request and the state only (not
    /// on `ctx.executed`), or matching answers from equal states would differ.
    ///
    /// None: this request is not read-only (or the service has no read-only path, the
    /// default); the client then orders it like any other request. A service must answer
    /// exactly what [`Service::execute`] would reply in the same state, and may answer only
    /// for requests whose execution changes nothing.
    fn execute_read_only(&self, _request: &[u8], _ctx: &ReadCtx) -> Option<Vec<u8>> {
        None
    }

    /// Runs at an agreed-time tick (the cluster option `tick_ms`, 0 by default): on every
    /// node at the same point of the decided sequence, before the requests of the instance
    /// whose agreed time `ctx.time` first reached a multiple of `tick_ms` (the primary
    /// proposes an empty instance when no request came for `tick_ms`, so ticks come
    /// without clients). One call per crossing, however many multiples the time skipped:
    /// judge elapsed time by `ctx.time`, never by counting calls. `ctx.client` is
    /// [`crate::ids::TICK_CLIENT`]; events pushed here reach their clients as a request's
    /// do. Deterministic like [`Service::execute`]. Default: nothing.
    fn on_tick(&mut self, _ctx: &ExecCtx) {}

    /// A deterministic serialization of the whole state: equal states give equal bytes.
    fn snapshot(&self) -> Vec<u8>;

    /// [`Service::snapshot`]'s bytes split into pieces, each cut into chunks on its own
    /// (`chunk.rs`). A service whose state is large can return, for parts of the state
    /// that did not change since its last call, the very pieces it returned then: they
    /// are not serialized, cut or hashed again. The split must be a function of the state
    /// alone (every node must cut an equal state into equal chunks). Default: one piece.
    fn pieces(&self) -> Vec<Arc<Piece>> {
        vec![Piece::new(self.snapshot())]
    }

    /// A copy of the state for a checkpoint, cheap to take now and serialized later on
    /// another thread (UpRight §3.2's copy-on-write checkpoints): the protocol thread
    /// pauses for the copy, not for the serialization. Later requests must not change
    /// what the copy serializes to. None (the default): the checkpoint calls
    /// [`Service::snapshot`] on the protocol thread.
    fn freeze(&self) -> Option<Box<dyn Frozen>> {
        None
    }

    /// Replaces the state with a snapshot taken by [`Service::snapshot`] on some node.
    ///
    /// # Errors
    /// If the bytes are not a snapshot of this service; the state is then unchanged.
    fn restore(&mut self, snapshot: &[u8]) -> Result<(), RestoreError>;

    /// [`Service::restore`] from a stream of the snapshot's `len` bytes (a checkpoint's
    /// chunks read one at a time: `Chunked::reader`). A service with a large state
    /// rebuilds it as the bytes go by, holding a chunk of the snapshot at a time instead
    /// of all of it. The default reads the snapshot whole and calls `restore`.
    ///
    /// # Errors
    /// As [`Service::restore`]; and a read of `state` that fails (a stored chunk that
    /// cannot be read back). A service that streams checks what it can before it
    /// changes anything (the head, the lengths), but a read failing half-way may leave its
    /// state partly replaced: callers stop the node then (`Replica::recover`), or read
    /// from memory, where reads cannot fail (a state transfer's fetched chunks).
    fn restore_from(&mut self, state: &mut dyn std::io::Read, len: u64) -> Result<(), RestoreError> {
        let mut bytes = Vec::new();
        std::io::Read::take(state, len)
            .read_to_end(&mut bytes)
            .map_err(|e| RestoreError(format!("snapshot read: {e}")))?;
        if bytes.len() as u64 != len {
            return Err(RestoreError(format!("snapshot of {len} bytes cut short at {}", bytes.len())));
        }
        self.restore(&bytes)
    }
}

/// The service an order node of a separated cluster runs (ARCHITECTURE §2, UpRight
/// §4.2): it executes nothing, so the node's state and checkpoints hold the order state
/// alone (each client's last ordered request and the membership: UpRight's small order
/// checkpoint). The execution nodes run the real service.
#[derive(Debug, Default)]
pub struct OrderState;

impl Service for OrderState {
    fn execute(&mut self, _request: &[u8], _ctx: &ExecCtx) -> Vec<u8> {
        Vec::new()
    }

    fn snapshot(&self) -> Vec<u8> {
        Vec::new()
    }

    fn restore(&mut self, snapshot: &[u8]) -> Result<(), RestoreError> {
        if snapshot.is_empty() {
            Ok(())
        } else {
            Err(RestoreError(format!("order-state snapshot of {} bytes: it holds none", snapshot.len())))
        }
    }
}
