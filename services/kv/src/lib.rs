//! A small deterministic key-value service: put, get, delete, compare-and-set.
//!
//! Requests and responses are postcard-encoded [`KvRequest`] / [`KvResponse`]. A request
//! that does not decode gets a [`KvResponse::Error`]: deterministic, so every replica
//! answers the same and none crashes on a client's garbage.
//!
//! KV opts into parallel execution (CBASE): [`Kv::footprint`] declares the keys a request
//! reads and writes (a scan: its prefix), and the store is sharded by key hash with a lock
//! per shard, so the executor's workers run requests on different keys at once.
//! `tests/parallel.rs` runs random workloads in parallel and sequentially and compares
//! them byte for byte.
//!
//! Watches (UpRight §3.1 push events): `Watch { prefix }` makes every later write of a
//! key with that prefix push a [`KvEvent`] to the watching client (session); delivery is
//! best effort and a client learns of lost events as a gap (`keel_core::client::Pushed`),
//! after which it re-reads what it watches. The registry is replicated state, in the
//! snapshot, bounded by [`WATCHES_PER_CLIENT_MAX`] and [`WATCHES_MAX`].

pub use keel_core::segments::SEGMENT_TARGET;

use keel_core::chunk::{self, Piece};
use keel_core::message::ClientId;
use keel_core::segments::{self, Split};
use keel_core::service::{ConcurrentService, Conflicts, ExecCtx, Frozen, Item, ReadCtx, RestoreError, Service};

type Segment = segments::Segment<Vec<u8>>;
use serde::{Deserialize, Serialize};
use serde_bytes::{ByteBuf, Bytes};
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::ops::{Bound, Deref};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

// Byte strings are `serde_bytes`: the same postcard bytes as a `Vec<u8>` (length, then
// the bytes), but copied whole instead of decoded one byte at a time.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum KvRequest {
    Get {
        #[serde(with = "serde_bytes")]
        key: Vec<u8>,
    },
    Put {
        #[serde(with = "serde_bytes")]
        key: Vec<u8>,
        #[serde(with = "serde_bytes")]
        value: Vec<u8>,
    },
    Delete {
        #[serde(with = "serde_bytes")]
        key: Vec<u8>,
    },
    /// Sets `new` iff the current value equals `expected` (None: the key is absent).
    Cas {
        #[serde(with = "serde_bytes")]
        key: Vec<u8>,
        #[serde(with = "serde_bytes")]
        expected: Option<Vec<u8>>,
        #[serde(with = "serde_bytes")]
        new: Vec<u8>,
    },
    /// Up to `limit` entries whose key starts with `prefix`, in key order.
    Scan {
        #[serde(with = "serde_bytes")]
        prefix: Vec<u8>,
        limit: u32,
    },
    /// For the next `lease_ms` of agreed time (0: [`WATCH_LEASE_DEFAULT_MS`]), push a
    /// [`KvEvent`] to the requesting client for every write of a key that starts with
    /// `prefix`. Watching again renews the lease; a client that went away stops being
    /// pushed to when its lease runs out.
    Watch {
        #[serde(with = "serde_bytes")]
        prefix: Vec<u8>,
        lease_ms: u64,
    },
    /// Ends a watch (no error if there was none).
    Unwatch {
        #[serde(with = "serde_bytes")]
        prefix: Vec<u8>,
    },
    /// One page of a scan: entries whose key starts with `prefix` and comes after `after`
    /// (from the first if None), in key order, at most `limit` of them and at most
    /// [`SCAN_PAGE_BYTES`] of keys and values (always at least one entry if any is left).
    /// Answered by [`KvResponse::Page`]; the next page starts after its last key. (Last
    /// among the variants, so that older encodings keep their meaning.)
    ScanPage {
        #[serde(with = "serde_bytes")]
        prefix: Vec<u8>,
        #[serde(with = "serde_bytes")]
        after: Option<Vec<u8>>,
        limit: u32,
    },
}

/// What a watcher is told of one write: the key and its new value (None: deleted).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvEvent {
    #[serde(with = "serde_bytes")]
    pub key: Vec<u8>,
    #[serde(with = "serde_bytes")]
    pub value: Option<Vec<u8>>,
}

impl KvEvent {
    pub fn encode(&self) -> Vec<u8> {
        postcard::to_allocvec(self).unwrap_or_default()
    }

    pub fn decode(bytes: &[u8]) -> Result<KvEvent, postcard::Error> {
        postcard::from_bytes(bytes)
    }
}

/// Watches one client (session) may hold.
pub const WATCHES_PER_CLIENT_MAX: usize = 16;
/// A watch's lease when the request names none, and the longest one may ask for.
pub const WATCH_LEASE_DEFAULT_MS: u64 = 60_000;
pub const WATCH_LEASE_MAX_MS: u64 = 3_600_000;
/// Watches all clients together may hold.
pub const WATCHES_MAX: usize = 4096;

/// The most entries one scan returns.
pub const SCAN_LIMIT_MAX: u32 = 10_000;
/// The most bytes of keys and values one [`KvRequest::ScanPage`] returns (beyond its first
/// entry): well under the 1 MiB a reply may carry. A `Scan` has no such bound, and one
/// whose result exceeds a reply fails with a "result too large" error.
pub const SCAN_PAGE_BYTES: usize = 512 * 1024;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum KvResponse {
    Value(#[serde(with = "serde_bytes")] Option<Vec<u8>>),
    Done,
    Swapped(bool),
    Entries(Vec<(Vec<u8>, Vec<u8>)>),
    Error(String),
    /// A [`KvRequest::ScanPage`]'s entries; `more`: entries with the prefix follow.
    Page {
        entries: Vec<(Vec<u8>, Vec<u8>)>,
        more: bool,
    },
}

impl KvRequest {
    pub fn encode(&self) -> Vec<u8> {
        postcard::to_allocvec(self).unwrap_or_default()
    }

    pub fn decode(bytes: &[u8]) -> Result<KvRequest, postcard::Error> {
        postcard::from_bytes(bytes)
    }

    pub fn key(&self) -> &[u8] {
        match self {
            KvRequest::Get { key }
            | KvRequest::Put { key, .. }
            | KvRequest::Delete { key }
            | KvRequest::Cas { key, .. } => key,
            KvRequest::Scan { prefix, .. }
            | KvRequest::ScanPage { prefix, .. }
            | KvRequest::Watch { prefix, .. }
            | KvRequest::Unwatch { prefix } => prefix,
        }
    }
}

impl KvResponse {
    pub fn encode(&self) -> Vec<u8> {
        postcard::to_allocvec(self).unwrap_or_default()
    }

    pub fn decode(bytes: &[u8]) -> Result<KvResponse, postcard::Error> {
        postcard::from_bytes(bytes)
    }
}

/// Lock shards of the store: comfortably more than worker threads, so requests on
/// different keys rarely wait for the same lock.
pub const SHARDS: usize = 64;

/// A persistent (copy-on-write) ordered map: a clone shares every node with the
/// original and costs O(1), and a write after it copies only the path it changes. That
/// is what makes a checkpoint's copy of the state cheap ([`Service::freeze`]). Values sit
/// behind `Arc`, so the nodes a write copies hold pointers, not the values' bytes.
type Map = imbl::OrdMap<Vec<u8>, Value>;
type Value = Arc<Vec<u8>>;

/// The KV state: keys spread over [`SHARDS`] maps by a hash of the key, each behind its
/// own lock. Shared by the service and the executor's workers.
///
/// Locks make concurrent access memory-safe; isolation between requests comes from the
/// executor's dependency graph. Each request is still atomic on its own: a point
/// operation holds its key's shard lock throughout, and a scan read-locks every shard (in
/// index order; writers hold one lock at a time, so no cycle) and so sees one state.
struct Store {
    shards: Vec<RwLock<Map>>,
    /// prefix → the clients watching it.
    watches: RwLock<Watches>,
    /// Per shard: the keys written since the freeze its cached segments come from (or,
    /// with none cached, since the floor), each with the number of freezes taken before
    /// the write (segments.rs).
    written: Vec<Mutex<BTreeMap<Vec<u8>, u64>>>,
    /// About the memory `written` holds, and the most it may: past that the tracking is
    /// dropped and the next checkpoint serializes everything (a store written all over
    /// between checkpoints, or never frozen, gains little from it anyway).
    tracked: AtomicUsize,
    tracked_max: usize,
    /// Freezes taken so far; a freeze's id is the count before it.
    freezes: AtomicU64,
    /// The segments of the newest serialized freeze; shared with frozen copies, which
    /// serialize on another thread and leave their segments here.
    cache: Arc<Mutex<SegmentCache>>,
    segment_target: usize,
}

/// What the next checkpoint may reuse.
#[derive(Default)]
struct SegmentCache {
    /// (freeze id, its segments).
    segments: Option<(u64, Arc<Vec<Segment>>)>,
    /// Segments of freezes below this id are not taken: the keys written before it are no
    /// longer tracked (dropped at the bound), or the state was replaced since (restore).
    floor: u64,
}

/// The most memory (about) the written-key tracking of one store may hold.
const TRACKED_BYTES_MAX: usize = 64 << 20;

/// What tracking a written key costs, about: the key and the map entry around it.
fn tracked_bytes(key: &[u8]) -> usize {
    key.len() + 64
}

/// prefix → watching client → end of its lease (agreed time, ms).
type Watches = BTreeMap<Vec<u8>, BTreeMap<ClientId, u64>>;

/// FNV-1a: cheap and stable. The shard of a key only decides which lock guards it, never
/// an outcome, so it need not resist crafted keys (a collision costs waiting, not safety).
fn shard_of(key: &[u8]) -> usize {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in key {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    (h % SHARDS as u64) as usize
}

impl Store {
    fn new() -> Store {
        Store::with_segments(segments::SEGMENT_TARGET)
    }

    fn with_segments(segment_target: usize) -> Store {
        Store {
            shards: (0..SHARDS).map(|_| RwLock::new(Map::new())).collect(),
            watches: RwLock::default(),
            written: (0..SHARDS).map(|_| Mutex::default()).collect(),
            tracked: AtomicUsize::new(0),
            tracked_max: TRACKED_BYTES_MAX,
            freezes: AtomicU64::new(0),
            cache: Arc::default(),
            segment_target,
        }
    }

    /// Notes that `key` (in `shard`) changed: its segment is serialized again at the next
    /// checkpoint. Freezes happen between batches, never during one, so the count read
    /// here is the one the next freeze will find.
    fn wrote(&self, shard: usize, key: &[u8]) {
        let tag = self.freezes.load(Ordering::Acquire);
        let new =
            self.written[shard].lock().unwrap_or_else(PoisonError::into_inner).insert(key.to_vec(), tag).is_none();
        if new && self.tracked.fetch_add(tracked_bytes(key), Ordering::Relaxed) > self.tracked_max {
            self.forget_segments();
        }
    }

    /// A copy of the state for a checkpoint, with what its serialization may reuse: the
    /// newest cached segments and the keys written since their freeze.
    fn freeze(&self) -> FrozenKv {
        let shards = self.read_all().iter().map(|g| (**g).clone()).collect();
        let id = self.freezes.fetch_add(1, Ordering::AcqRel);
        // Every segments cache from now on is of a freeze at or above the floor: writes
        // tagged at or below it are in all of them. With none cached yet (the first
        // checkpoint, or jobs still out after a restore), this freeze cuts everything, and
        // the writes since the floor stay tracked so that whichever pending freeze is
        // serialized first can be the next one's base (dropping them here would leave a
        // node whose serializations outlast a checkpoint interval never reusing anything).
        let (base, floor) = {
            let cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
            (cache.segments.clone(), cache.floor)
        };
        let since = base.as_ref().map_or(floor, |(c, _)| *c);
        let mut written = BTreeSet::new();
        let mut tracked = 0;
        for w in &self.written {
            let mut w = w.lock().unwrap_or_else(PoisonError::into_inner);
            w.retain(|_, tag| *tag > since);
            tracked += w.keys().map(|k| tracked_bytes(k)).sum::<usize>();
            if base.is_some() {
                written.extend(w.keys().cloned());
            }
        }
        self.tracked.store(tracked, Ordering::Relaxed);
        FrozenKv {
            shards,
            watches: self.watches().clone(),
            base: base.map(|(_, segments)| segments),
            written,
            id,
            cache: self.cache.clone(),
            segment_target: self.segment_target,
        }
    }

    /// The state was replaced, or the written keys are no longer tracked: nothing cached
    /// describes the state, nor any freeze taken before now. (Called from a worker thread
    /// at the bound, it may race other writes of the same batch: they carry the floor's
    /// tag, which no later base needs.)
    fn forget_segments(&self) {
        for w in &self.written {
            w.lock().unwrap_or_else(PoisonError::into_inner).clear();
        }
        self.tracked.store(0, Ordering::Relaxed);
        let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        cache.segments = None;
        cache.floor = self.freezes.load(Ordering::Acquire);
    }

    fn watches(&self) -> RwLockReadGuard<'_, Watches> {
        self.watches.read().unwrap_or_else(PoisonError::into_inner)
    }

    /// Tells every client watching a prefix of `key` about its new value. Each watcher
    /// once per write, in client order: deterministic on every node.
    fn notify(&self, key: &[u8], value: Option<&[u8]>, ctx: Option<&ExecCtx>) {
        let Some(ctx) = ctx else {
            return;
        };
        let watches = self.watches();
        if watches.is_empty() {
            return;
        }
        // Leases are judged by agreed time, so every node pushes to the same watchers.
        let clients: std::collections::BTreeSet<ClientId> = watches
            .iter()
            .filter(|(p, _)| key.starts_with(p))
            .flat_map(|(_, c)| c.iter().filter(|(_, until)| **until > ctx.time).map(|(c, _)| *c))
            .collect();
        if clients.is_empty() {
            return;
        }
        let event = KvEvent { key: key.to_vec(), value: value.map(<[u8]>::to_vec) }.encode();
        for c in clients {
            ctx.push(c, event.clone());
        }
    }

    fn watch(&self, ctx: &ExecCtx, prefix: Vec<u8>, lease_ms: u64) -> KvResponse {
        let lease = match lease_ms {
            0 => WATCH_LEASE_DEFAULT_MS,
            l => l.min(WATCH_LEASE_MAX_MS),
        };
        let mut w = self.watches.write().unwrap_or_else(PoisonError::into_inner);
        expire(&mut w, ctx.time);
        let client = ctx.client;
        if let Some(until) = w.get_mut(&prefix).and_then(|c| c.get_mut(&client)) {
            *until = ctx.time + lease;
            return KvResponse::Done;
        }
        let total: usize = w.values().map(|c| c.len()).sum();
        let mine = w.values().filter(|c| c.contains_key(&client)).count();
        if mine >= WATCHES_PER_CLIENT_MAX || total >= WATCHES_MAX {
            return KvResponse::Error(format!(
                "too many watches ({mine} of this client, at most {WATCHES_PER_CLIENT_MAX}; {total} in all, at \
                 most {WATCHES_MAX})"
            ));
        }
        w.entry(prefix).or_default().insert(client, ctx.time + lease);
        KvResponse::Done
    }

    fn unwatch(&self, ctx: &ExecCtx, prefix: &[u8]) -> KvResponse {
        let mut w = self.watches.write().unwrap_or_else(PoisonError::into_inner);
        expire(&mut w, ctx.time);
        let client = ctx.client;
        if let Some(c) = w.get_mut(prefix) {
            c.remove(&client);
            if c.is_empty() {
                w.remove(prefix);
            }
        }
        KvResponse::Done
    }

    // A service panic never happens while a shard lock is held by this code, so a
    // poisoned lock still guards a consistent map.
    fn read(&self, shard: usize) -> RwLockReadGuard<'_, Map> {
        self.shards[shard].read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self, shard: usize) -> RwLockWriteGuard<'_, Map> {
        self.shards[shard].write().unwrap_or_else(PoisonError::into_inner)
    }

    /// Every shard, read-locked in index order.
    fn read_all(&self) -> Vec<RwLockReadGuard<'_, Map>> {
        (0..SHARDS).map(|i| self.read(i)).collect()
    }

    /// `ctx`: the ordered execution's context (watches and their events need it); None
    /// for read-only answers and direct use.
    fn apply(&self, req: KvRequest, ctx: Option<&ExecCtx>) -> KvResponse {
        match req {
            KvRequest::Get { key } => KvResponse::Value(self.read(shard_of(&key)).get(&key).map(|v| v.to_vec())),
            KvRequest::Put { key, value } => {
                self.notify(&key, Some(&value), ctx);
                let shard = shard_of(&key);
                self.wrote(shard, &key);
                self.write(shard).insert(key, Arc::new(value));
                KvResponse::Done
            }
            KvRequest::Delete { key } => {
                let shard = shard_of(&key);
                if self.write(shard).remove(&key).is_some() {
                    self.wrote(shard, &key);
                    self.notify(&key, None, ctx);
                }
                KvResponse::Done
            }
            KvRequest::Cas { key, expected, new } => {
                let shard = shard_of(&key);
                let mut map = self.write(shard);
                let swapped = map.get(&key).map(|v| v.as_slice()) == expected.as_deref();
                if swapped {
                    self.notify(&key, Some(&new), ctx);
                    self.wrote(shard, &key);
                    map.insert(key, Arc::new(new));
                }
                KvResponse::Swapped(swapped)
            }
            KvRequest::Watch { prefix, lease_ms } => match ctx {
                Some(ctx) => self.watch(ctx, prefix, lease_ms),
                None => KvResponse::Error("a watch must be ordered".into()),
            },
            KvRequest::Unwatch { prefix } => match ctx {
                Some(ctx) => self.unwatch(ctx, &prefix),
                None => KvResponse::Error("an unwatch must be ordered".into()),
            },
            KvRequest::Scan { prefix, limit } => {
                KvResponse::Entries(scan(&self.read_all(), &prefix, limit.min(SCAN_LIMIT_MAX) as usize))
            }
            KvRequest::ScanPage { prefix, after, limit } => {
                scan_page(&self.read_all(), &prefix, after.as_deref(), limit.min(SCAN_LIMIT_MAX) as usize)
            }
        }
    }
}

/// Drops watches whose lease ended by agreed time `now` (only where a request that runs
/// alone, a watch or unwatch, or a tick holds the registry: the same on every node).
fn expire(w: &mut Watches, now: u64) {
    w.retain(|_, clients| {
        clients.retain(|_, until| *until > now);
        !clients.is_empty()
    });
}

/// The first `limit` entries with `prefix` across all shards, in key order; only
/// returned entries are copied.
fn scan(shards: &[impl Deref<Target = Map>], prefix: &[u8], limit: usize) -> Vec<(Vec<u8>, Vec<u8>)> {
    merged(shards, prefix).take(limit).map(|(k, v)| (k.to_vec(), v.to_vec())).collect()
}

/// A [`KvRequest::ScanPage`]: up to `limit` entries with `prefix` after `after`, cut at
/// [`SCAN_PAGE_BYTES`] (but never empty while entries are left).
fn scan_page(shards: &[impl Deref<Target = Map>], prefix: &[u8], after: Option<&[u8]>, limit: usize) -> KvResponse {
    let lo = match after {
        // Keys before the prefix would only be skipped; a key after it ends the scan.
        Some(a) if a >= prefix => Bound::Excluded(a),
        _ => Bound::Included(prefix),
    };
    let mut matching = merged_range(shards, lo, Bound::Unbounded).take_while(|(k, _)| k.starts_with(prefix)).peekable();
    let mut entries = Vec::new();
    let mut bytes = 0;
    while let Some((k, v)) = matching.peek() {
        if entries.len() >= limit || (!entries.is_empty() && bytes + k.len() + v.len() > SCAN_PAGE_BYTES) {
            break;
        }
        bytes += k.len() + v.len();
        entries.push((k.to_vec(), v.to_vec()));
        matching.next();
    }
    KvResponse::Page { entries, more: matching.peek().is_some() }
}

/// Every entry with `prefix` across all shards, in key order, by reference: a k-way merge
/// of the shards' own ordered iterators (scans and snapshots both need the global order).
fn merged<'a>(shards: &'a [impl Deref<Target = Map>], prefix: &'a [u8]) -> impl Iterator<Item = (&'a [u8], &'a [u8])> {
    merged_range(shards, Bound::Included(prefix), Bound::Unbounded).take_while(move |(k, _)| k.starts_with(prefix))
}

/// Every entry with a key in (`lo`, `hi`) across all shards, in key order.
fn merged_range<'a>(
    shards: &'a [impl Deref<Target = Map>],
    lo: Bound<&[u8]>,
    hi: Bound<&[u8]>,
) -> impl Iterator<Item = (&'a [u8], &'a [u8])> {
    let mut iters: Vec<_> = shards.iter().map(|m| m.range::<_, [u8]>((lo, hi))).collect();
    // (key, value, shard) of each shard's next entry, smallest key first.
    type Head<'a> = Reverse<(&'a [u8], &'a [u8], usize)>;
    let mut heads: BinaryHeap<Head<'a>> = BinaryHeap::new();
    for (i, it) in iters.iter_mut().enumerate() {
        if let Some((k, v)) = it.next() {
            heads.push(Reverse((k.as_slice(), v.as_slice(), i)));
        }
    }
    std::iter::from_fn(move || {
        let Reverse((k, v, i)) = heads.pop()?;
        if let Some((nk, nv)) = iters[i].next() {
            heads.push(Reverse((nk.as_slice(), nv.as_slice(), i)));
        }
        Some((k, v))
    })
}

/// The KV service. Opts into parallel execution: it declares each request's keys
/// ([`Service::conflicts`]) and executes through `&self` on a sharded store.
pub struct Kv {
    store: Arc<Store>,
}

impl Kv {
    pub fn new() -> Kv {
        Kv { store: Arc::new(Store::new()) }
    }

    /// A store whose checkpoints track changes in segments of about `bytes` bytes
    /// (default [`SEGMENT_TARGET`]); the simulator uses small ones, so its small states
    /// span many segments. Segment boundaries are chunk boundaries, so they enter the
    /// checkpoint root: every node of a cluster must use the same size.
    pub fn with_segment_target(bytes: usize) -> Kv {
        Kv { store: Arc::new(Store::with_segments(bytes.max(1))) }
    }

    pub fn get(&self, key: &[u8]) -> Option<Vec<u8>> {
        self.store.read(shard_of(key)).get(key).map(|v| v.to_vec())
    }

    pub fn len(&self) -> usize {
        self.store.read_all().iter().map(|m| m.len()).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn apply(&self, req: KvRequest) -> KvResponse {
        self.store.apply(req, None)
    }

    /// The whole state as one ordered map (a copy).
    pub fn entries(&self) -> BTreeMap<Vec<u8>, Vec<u8>> {
        self.store.read_all().iter().flat_map(|m| m.iter().map(|(k, v)| (k.clone(), v.to_vec()))).collect()
    }

    /// What a request reads and writes, for the parallelizer:
    /// - `Get` reads its key; `Put` and `Delete` write it; `Cas` reads and writes it.
    /// - `Scan` reads its whole prefix, present keys or not: a write that adds, changes
    ///   or removes any key with the prefix changes its answer. Declaring the keys it
    ///   returned is impossible (the answer depends on the state, the declaration must
    ///   not), and `limit` does not narrow it for the same reason.
    /// - A request that does not decode touches nothing (its reply is an error computed
    ///   from its bytes), so it conflicts with nothing, and garbage from one client cannot
    ///   serialize everyone else's requests.
    pub fn footprint(req: &KvRequest) -> Conflicts {
        match req {
            KvRequest::Get { key } => Conflicts::read(Item::Key(key.clone())),
            KvRequest::Put { key, .. } | KvRequest::Delete { key } => Conflicts::write(Item::Key(key.clone())),
            KvRequest::Cas { key, .. } => {
                Conflicts::Items { reads: vec![Item::Key(key.clone())], writes: vec![Item::Key(key.clone())] }
            }
            KvRequest::Scan { prefix, .. } | KvRequest::ScanPage { prefix, .. } => {
                Conflicts::read(Item::Prefix(prefix.clone()))
            }
            // Rare, and every write reads the registry: run alone.
            KvRequest::Watch { .. } | KvRequest::Unwatch { .. } => Conflicts::Everything,
        }
    }
}

impl Default for Kv {
    fn default() -> Kv {
        Kv::new()
    }
}

/// A deep copy: the clone does not share state with the original.
impl Clone for Kv {
    fn clone(&self) -> Kv {
        let store = Store::with_segments(self.store.segment_target);
        for (i, m) in self.store.read_all().iter().enumerate() {
            *store.write(i) = (**m).clone();
        }
        *store.watches.write().unwrap_or_else(PoisonError::into_inner) = self.store.watches().clone();
        Kv { store: Arc::new(store) }
    }
}

/// Equal contents (the shard of a key is fixed, so shard-wise comparison suffices).
impl PartialEq for Kv {
    fn eq(&self, other: &Kv) -> bool {
        Arc::ptr_eq(&self.store, &other.store)
            || ((0..SHARDS).all(|i| *self.store.read(i) == *other.store.read(i))
                && *self.store.watches() == *other.store.watches())
    }
}

impl Eq for Kv {}

impl std::fmt::Debug for Kv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kv").field("map", &self.entries()).finish()
    }
}

impl ConcurrentService for Store {
    fn execute_shared(&self, request: &[u8], ctx: &ExecCtx) -> Vec<u8> {
        let response = match KvRequest::decode(request) {
            Ok(req) => self.apply(req, Some(ctx)),
            Err(e) => KvResponse::Error(format!("malformed request: {e}")),
        };
        response.encode()
    }
}

impl Service for Kv {
    fn execute(&mut self, request: &[u8], ctx: &ExecCtx) -> Vec<u8> {
        self.store.execute_shared(request, ctx)
    }

    /// With agreed-time ticks on, ended leases leave the registry at the next tick, not
    /// only when a watch or unwatch runs: a client that went away stops taking room.
    fn on_tick(&mut self, ctx: &ExecCtx) {
        expire(&mut self.store.watches.write().unwrap_or_else(PoisonError::into_inner), ctx.time);
    }

    fn conflicts(&self, request: &[u8]) -> Conflicts {
        match KvRequest::decode(request) {
            Ok(req) => Kv::footprint(&req),
            Err(_) => Conflicts::none(),
        }
    }

    fn concurrent(&self) -> Option<Arc<dyn ConcurrentService>> {
        Some(self.store.clone())
    }

    /// `Get` and `Scan` change nothing: they answer read-only, exactly as ordered.
    fn execute_read_only(&self, request: &[u8], _ctx: &ReadCtx) -> Option<Vec<u8>> {
        match KvRequest::decode(request) {
            Ok(req @ (KvRequest::Get { .. } | KvRequest::Scan { .. } | KvRequest::ScanPage { .. })) => {
                Some(self.store.apply(req, None).encode())
            }
            _ => None,
        }
    }

    fn snapshot(&self) -> Vec<u8> {
        self.store.freeze().into_fresh_bytes()
    }

    /// Serializes only the segments written since the last checkpoint (segments.rs).
    fn pieces(&self) -> Vec<Arc<Piece>> {
        self.store.freeze().into_pieces()
    }

    /// O(shards): each shard's map is persistent, so its clone shares every node.
    fn freeze(&self) -> Option<Box<dyn Frozen>> {
        Some(Box::new(self.store.freeze()))
    }

    fn restore(&mut self, snapshot: &[u8]) -> Result<(), RestoreError> {
        let (entries, rest) = postcard::take_from_bytes::<SnapshotEntries>(snapshot)
            .map_err(|e| RestoreError(format!("kv snapshot: {e}")))?;
        let entries = entries.0;
        let watches: Watches = if rest.is_empty() {
            Watches::new()
        } else {
            postcard::from_bytes(rest).map_err(|e| RestoreError(format!("kv snapshot watches: {e}")))?
        };
        let mut shards: Vec<Map> = vec![Map::new(); SHARDS];
        for (k, v) in entries {
            let k = k.into_vec();
            shards[shard_of(&k)].insert(k, Arc::new(v.into_vec()));
        }
        // In place, so a handle from `concurrent()` keeps pointing at the live state.
        for (i, m) in shards.into_iter().enumerate() {
            *self.store.write(i) = m;
        }
        *self.store.watches.write().unwrap_or_else(PoisonError::into_inner) = watches;
        self.store.forget_segments();
        Ok(())
    }
}

/// The store as a checkpoint froze it, with what its serialization may reuse.
struct FrozenKv {
    shards: Vec<Map>,
    watches: Watches,
    /// The newest cached segments when frozen, and the keys written since their freeze.
    base: Option<Arc<Vec<Segment>>>,
    written: BTreeSet<Vec<u8>>,
    /// This freeze's id: its segments are cached if no newer freeze's are.
    id: u64,
    cache: Arc<Mutex<SegmentCache>>,
    segment_target: usize,
}

impl FrozenKv {
    fn split(&self) -> Split {
        Split { domain: "keel/kv-segment", target: self.segment_target }
    }

    /// The snapshot's pieces. The bytes are a postcard `BTreeMap<Vec<u8>, Vec<u8>>` of
    /// the whole state (key order: equal maps give equal bytes whatever the shard
    /// layout), then the watch registry if there is one: the entry count, the entries in
    /// segments (segments.rs), the registry.
    fn into_pieces(self) -> Vec<Arc<Piece>> {
        let shards: Vec<&Map> = self.shards.iter().collect();
        let segments =
            segments::build(self.split(), self.base.as_deref().map(Vec::as_slice), &self.written, |lo, hi| {
                merged_range(&shards, lo, hi).map(|(k, v)| (k, (Bytes::new(k), Bytes::new(v))))
            });
        let mut pieces = Vec::with_capacity(segments.len() + 2);
        let count = shards.iter().map(|m| m.len() as u64).sum::<u64>();
        // A map's length prefix is a varint, as a u64's is.
        pieces.push(Piece::new(postcard::to_allocvec(&count).unwrap_or_default()));
        pieces.extend(segments.iter().map(|s| s.piece.clone()));
        if !self.watches.is_empty() {
            pieces.push(Piece::new(postcard::to_allocvec(&self.watches).unwrap_or_default()));
        }
        let mut cache = self.cache.lock().unwrap_or_else(PoisonError::into_inner);
        if self.id >= cache.floor && cache.segments.as_ref().is_none_or(|(have, _)| *have < self.id) {
            cache.segments = Some((self.id, Arc::new(segments)));
        }
        pieces
    }
}

impl FrozenKv {
    /// The snapshot's bytes, cut afresh: cached segments are not reused, since their
    /// bytes may have left memory once a checkpoint was durable (core `chunk.rs`).
    fn into_fresh_bytes(mut self) -> Vec<u8> {
        self.base = None;
        self.cache = Arc::default();
        chunk::join(&self.into_pieces()).expect("pieces cut afresh are in memory")
    }
}

impl Frozen for FrozenKv {
    fn snapshot(self: Box<Self>) -> Vec<u8> {
        self.into_fresh_bytes()
    }

    fn pieces(self: Box<Self>) -> Vec<Arc<Piece>> {
        self.into_pieces()
    }
}

/// Decodes what [`SortedMap`] (or an older `BTreeMap` snapshot) wrote, byte strings whole.
/// Duplicate or unsorted keys are not rejected: the last value of a key wins, as in a map.
struct SnapshotEntries(Vec<(ByteBuf, ByteBuf)>);

impl<'de> Deserialize<'de> for SnapshotEntries {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = SnapshotEntries;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a map of byte strings")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<SnapshotEntries, A::Error> {
                // Never trust a length prefix for an allocation: grow as entries arrive.
                let mut out = Vec::new();
                while let Some(entry) = map.next_entry::<ByteBuf, ByteBuf>()? {
                    out.push(entry);
                }
                Ok(SnapshotEntries(out))
            }
        }
        d.deserialize_map(Visit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_core::ids::Seq;
    use proptest::prelude::*;

    fn ctx() -> ExecCtx {
        ExecCtx::new(Seq(1), 0, 0, ClientId(1))
    }

    fn run(kv: &mut Kv, req: KvRequest) -> KvResponse {
        KvResponse::decode(&kv.execute(&req.encode(), &ctx())).expect("decodes")
    }

    #[test]
    fn operations() {
        let mut kv = Kv::new();
        let k = b"k".to_vec();
        assert_eq!(run(&mut kv, KvRequest::Get { key: k.clone() }), KvResponse::Value(None));
        assert_eq!(
            run(&mut kv, KvRequest::Cas { key: k.clone(), expected: None, new: b"1".to_vec() }),
            KvResponse::Swapped(true)
        );
        assert_eq!(
            run(&mut kv, KvRequest::Cas { key: k.clone(), expected: None, new: b"2".to_vec() }),
            KvResponse::Swapped(false)
        );
        assert_eq!(run(&mut kv, KvRequest::Put { key: k.clone(), value: b"3".to_vec() }), KvResponse::Done);
        assert_eq!(run(&mut kv, KvRequest::Get { key: k.clone() }), KvResponse::Value(Some(b"3".to_vec())));
        assert_eq!(run(&mut kv, KvRequest::Delete { key: k.clone() }), KvResponse::Done);
        assert_eq!(run(&mut kv, KvRequest::Get { key: k }), KvResponse::Value(None));
    }

    #[test]
    fn scan_returns_a_bounded_prefix_range_in_order() {
        let mut kv = Kv::new();
        for k in ["a1", "b2", "b1", "b3", "c1"] {
            kv.apply(KvRequest::Put { key: k.into(), value: k.into() });
        }
        let r = run(&mut kv, KvRequest::Scan { prefix: b"b".to_vec(), limit: 2 });
        assert_eq!(r, KvResponse::Entries(vec![(b"b1".to_vec(), b"b1".to_vec()), (b"b2".to_vec(), b"b2".to_vec())]));
        let r = run(&mut kv, KvRequest::Scan { prefix: b"z".to_vec(), limit: 9 });
        assert_eq!(r, KvResponse::Entries(vec![]));
    }

    /// Pages cut at the byte bound (never empty), and paging from each page's last key
    /// visits every entry once, in order; keys past the prefix end it.
    #[test]
    fn scan_pages_cover_a_prefix_within_the_byte_bound() {
        let mut kv = Kv::new();
        let big = vec![7u8; 200 * 1024];
        for i in 0..10u8 {
            kv.apply(KvRequest::Put { key: vec![b'p', b'0' + i], value: big.clone() });
        }
        kv.apply(KvRequest::Put { key: b"q".to_vec(), value: b"after".to_vec() });
        kv.apply(KvRequest::Put { key: b"a".to_vec(), value: b"before".to_vec() });
        let (mut after, mut seen, mut pages) = (None, Vec::new(), 0);
        loop {
            let r = run(&mut kv, KvRequest::ScanPage { prefix: b"p".to_vec(), after: after.clone(), limit: 100 });
            let KvResponse::Page { entries, more } = r else { panic!("a page: {r:?}") };
            assert!(!entries.is_empty(), "a page is never empty while entries are left");
            assert!(entries.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>() <= SCAN_PAGE_BYTES);
            after = entries.last().map(|(k, _)| k.clone());
            seen.extend(entries.into_iter().map(|(k, _)| k));
            pages += 1;
            if !more {
                break;
            }
        }
        assert_eq!(seen, (0..10u8).map(|i| vec![b'p', b'0' + i]).collect::<Vec<_>>());
        assert_eq!(pages, 5, "two 200 KiB entries per 512 KiB page");
        // One entry over the bound still comes, alone.
        kv.apply(KvRequest::Put { key: b"r".to_vec(), value: vec![1; SCAN_PAGE_BYTES + 1] });
        let r = run(&mut kv, KvRequest::ScanPage { prefix: b"r".to_vec(), after: None, limit: 5 });
        assert!(matches!(&r, KvResponse::Page { entries, more: false } if entries.len() == 1));
        // The limit cuts too, and says more follow.
        let r = run(&mut kv, KvRequest::ScanPage { prefix: Vec::new(), after: Some(b"a".to_vec()), limit: 1 });
        assert!(matches!(&r, KvResponse::Page { entries, more: true } if entries[0].0 == b"p0"), "{r:?}");
    }

    #[test]
    fn garbage_gets_an_error_not_a_panic() {
        let mut kv = Kv::new();
        let r = KvResponse::decode(&kv.execute(&[0xff, 0xff, 0xff], &ctx())).expect("decodes");
        assert!(matches!(r, KvResponse::Error(_)));
        assert!(kv.is_empty());
    }

    /// The reference: the unsharded map KV was before it opted into parallel execution.
    fn model_apply(map: &mut BTreeMap<Vec<u8>, Vec<u8>>, req: KvRequest) -> KvResponse {
        match req {
            KvRequest::Get { key } => KvResponse::Value(map.get(&key).cloned()),
            KvRequest::Put { key, value } => {
                map.insert(key, value);
                KvResponse::Done
            }
            KvRequest::Delete { key } => {
                map.remove(&key);
                KvResponse::Done
            }
            KvRequest::Cas { key, expected, new } => {
                let swapped = map.get(&key) == expected.as_ref();
                if swapped {
                    map.insert(key, new);
                }
                KvResponse::Swapped(swapped)
            }
            KvRequest::Scan { prefix, limit } => KvResponse::Entries(
                map.range(prefix.clone()..)
                    .take_while(|(k, _)| k.starts_with(&prefix))
                    .take(limit.min(SCAN_LIMIT_MAX) as usize)
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
            ),
            KvRequest::ScanPage { prefix, after, limit } => {
                // Written plainly: every matching key after `after`, then cut.
                let all: Vec<_> = map
                    .iter()
                    .filter(|(k, _)| k.starts_with(&prefix) && after.as_ref().is_none_or(|a| *k > a))
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                let limit = limit.min(SCAN_LIMIT_MAX) as usize;
                let mut n = 0;
                let mut bytes = 0;
                while n < all.len() && n < limit {
                    let size = all[n].0.len() + all[n].1.len();
                    if n > 0 && bytes + size > SCAN_PAGE_BYTES {
                        break;
                    }
                    bytes += size;
                    n += 1;
                }
                KvResponse::Page { more: n < all.len(), entries: all.into_iter().take(n).collect() }
            }
            KvRequest::Watch { .. } => KvResponse::Error("a watch must be ordered".into()),
            KvRequest::Unwatch { .. } => KvResponse::Error("an unwatch must be ordered".into()),
        }
    }

    fn exec(kv: &mut Kv, client: u64, req: KvRequest) -> (KvResponse, Vec<(u64, KvEvent)>) {
        let ctx = ExecCtx::new(Seq(1), 0, 0, ClientId(client));
        let r = KvResponse::decode(&kv.execute(&req.encode(), &ctx)).expect("decodes");
        let pushes = ctx.take_pushes().into_iter().map(|(c, e)| (c.0, KvEvent::decode(&e).expect("event"))).collect();
        (r, pushes)
    }

    #[test]
    fn watchers_are_pushed_every_write_under_their_prefix_and_survive_a_snapshot() {
        let mut kv = Kv::new();
        let put = |k: &[u8], v: &[u8]| KvRequest::Put { key: k.to_vec(), value: v.to_vec() };
        let ev = |k: &[u8], v: Option<&[u8]>| KvEvent { key: k.to_vec(), value: v.map(<[u8]>::to_vec) };
        assert_eq!(exec(&mut kv, 5, KvRequest::Watch { prefix: b"a/".to_vec(), lease_ms: 0 }).0, KvResponse::Done);
        assert_eq!(exec(&mut kv, 6, KvRequest::Watch { prefix: b"a/".to_vec(), lease_ms: 0 }).0, KvResponse::Done);
        assert_eq!(exec(&mut kv, 6, KvRequest::Watch { prefix: b"a/x".to_vec(), lease_ms: 0 }).0, KvResponse::Done);
        // One event per watcher per write, even with two matching prefixes.
        let (_, pushes) = exec(&mut kv, 9, put(b"a/x", b"1"));
        assert_eq!(pushes, vec![(5, ev(b"a/x", Some(b"1"))), (6, ev(b"a/x", Some(b"1")))]);
        assert!(exec(&mut kv, 9, put(b"b/x", b"1")).1.is_empty(), "not watched");
        // A failed CAS and deleting a missing key change nothing and push nothing.
        let cas = KvRequest::Cas { key: b"a/x".to_vec(), expected: None, new: b"2".to_vec() };
        assert!(exec(&mut kv, 9, cas).1.is_empty());
        assert!(exec(&mut kv, 9, KvRequest::Delete { key: b"a/none".to_vec() }).1.is_empty());
        // The registry is state: it survives a snapshot, and equal states compare equal.
        let mut copy = Kv::new();
        copy.restore(&kv.snapshot()).expect("restores");
        assert_eq!(copy, kv);
        let (_, pushes) = exec(&mut copy, 9, KvRequest::Delete { key: b"a/x".to_vec() });
        assert_eq!(pushes, vec![(5, ev(b"a/x", None)), (6, ev(b"a/x", None))]);
        exec(&mut copy, 5, KvRequest::Unwatch { prefix: b"a/".to_vec() });
        assert_eq!(exec(&mut copy, 9, put(b"a/y", b"3")).1, vec![(6, ev(b"a/y", Some(b"3")))]);
        assert_ne!(copy.snapshot(), kv.snapshot());
        // Bounded per client, with an error that says so.
        for i in 0..WATCHES_PER_CLIENT_MAX {
            exec(&mut kv, 7, KvRequest::Watch { prefix: vec![b'p', i as u8], lease_ms: 0 });
        }
        let (r, _) = exec(&mut kv, 7, KvRequest::Watch { prefix: b"one-more".to_vec(), lease_ms: 0 });
        assert!(matches!(r, KvResponse::Error(e) if e.contains("too many watches")));
        // A store without watches keeps the snapshot bytes of a plain map.
        // Leases end by agreed time: an expired watcher gets nothing, and renewing helps.
        let mut leased = Kv::new();
        let watch = KvRequest::Watch { prefix: b"l/".to_vec(), lease_ms: 500 }.encode();
        leased.execute(&watch, &ExecCtx::new(Seq(1), 1_000, 0, ClientId(8)));
        let put_at = |kv: &mut Kv, time: u64| {
            let ctx = ExecCtx::new(Seq(1), time, 0, ClientId(9));
            kv.execute(&put(b"l/k", b"v").encode(), &ctx);
            ctx.take_pushes().len()
        };
        assert_eq!(put_at(&mut leased, 1_400), 1, "within the lease");
        assert_eq!(put_at(&mut leased, 1_500), 0, "the lease ended");
        leased.execute(&watch, &ExecCtx::new(Seq(1), 1_600, 0, ClientId(8)));
        assert_eq!(put_at(&mut leased, 2_000), 1, "renewed");
        // An expired watch no longer counts against the bounds, and is gone after the
        // next watch or unwatch.
        leased.execute(
            &KvRequest::Unwatch { prefix: b"x".to_vec() }.encode(),
            &ExecCtx::new(Seq(1), 9_000, 0, ClientId(1)),
        );
        assert!(leased.store.watches().is_empty());
        // ...or after the next agreed-time tick, with no request at all.
        leased.execute(&watch, &ExecCtx::new(Seq(1), 10_000, 0, ClientId(8)));
        leased.on_tick(&ExecCtx::new(Seq(2), 10_400, 0, keel_core::ids::TICK_CLIENT));
        assert!(!leased.store.watches().is_empty(), "within the lease");
        leased.on_tick(&ExecCtx::new(Seq(3), 10_500, 0, keel_core::ids::TICK_CLIENT));
        assert!(leased.store.watches().is_empty(), "a tick ended the lease");
        let plain = Kv::new();
        plain.apply(put(b"k", b"v"));
        let map: BTreeMap<Vec<u8>, Vec<u8>> = BTreeMap::from([(b"k".to_vec(), b"v".to_vec())]);
        assert_eq!(plain.snapshot(), postcard::to_allocvec(&map).expect("encodes"));
    }

    fn request() -> impl Strategy<Value = KvRequest> {
        let key = proptest::collection::vec(0u8..4, 0..4);
        let value = proptest::collection::vec(any::<u8>(), 0..3);
        prop_oneof![
            key.clone().prop_map(|key| KvRequest::Get { key }),
            (key.clone(), value.clone()).prop_map(|(key, value)| KvRequest::Put { key, value }),
            key.clone().prop_map(|key| KvRequest::Delete { key }),
            (key.clone(), proptest::option::of(value.clone()), value).prop_map(|(key, expected, new)| KvRequest::Cas {
                key,
                expected,
                new
            }),
            (key.clone(), 0u32..20).prop_map(|(prefix, limit)| KvRequest::Scan { prefix, limit }),
            (key.clone(), proptest::option::of(key), 0u32..20).prop_map(|(prefix, after, limit)| KvRequest::ScanPage {
                prefix,
                after,
                limit
            }),
        ]
    }

    proptest! {
        /// The sharded store answers and ends like the single map it replaced, and its
        /// snapshot is byte for byte the single map's postcard encoding.
        #[test]
        fn sharded_store_equals_one_ordered_map(reqs in proptest::collection::vec(request(), 0..80)) {
            let kv = Kv::new();
            let mut model = BTreeMap::new();
            for req in reqs {
                prop_assert_eq!(kv.apply(req.clone()), model_apply(&mut model, req));
            }
            prop_assert_eq!(kv.entries(), model.clone());
            prop_assert_eq!(kv.snapshot(), postcard::to_allocvec(&model).expect("encodes"));
        }
    }

    proptest! {
        /// Reads answer read-only exactly as ordered and change nothing; writes are not
        /// read-only (the client orders them).
        #[test]
        fn read_only_answers_equal_ordered_ones(reqs in proptest::collection::vec(request(), 0..60)) {
            let mut kv = Kv::new();
            let rctx = ReadCtx { client: ClientId(1), executed: Seq(0), time: 0 };
            for req in reqs {
                let before = kv.snapshot();
                let read_only = kv.execute_read_only(&req.encode(), &rctx);
                prop_assert_eq!(kv.snapshot(), before, "a read-only call changes nothing");
                let ordered = kv.execute(&req.encode(), &ctx());
                match req {
                    KvRequest::Get { .. } | KvRequest::Scan { .. } | KvRequest::ScanPage { .. } => {
                        prop_assert_eq!(read_only, Some(ordered))
                    }
                    _ => prop_assert_eq!(read_only, None),
                }
            }
            prop_assert_eq!(kv.execute_read_only(b"garbage", &rctx), None);
        }
    }

    #[test]
    fn wire_format_is_postcard_with_length_prefixed_byte_strings() {
        // Pinned: serde_bytes must not change the bytes clients and snapshots already use.
        let put = KvRequest::Put { key: b"k".to_vec(), value: b"vv".to_vec() };
        assert_eq!(put.encode(), vec![1, 1, b'k', 2, b'v', b'v']);
        let cas = KvRequest::Cas { key: b"k".to_vec(), expected: Some(b"a".to_vec()), new: Vec::new() };
        assert_eq!(cas.encode(), vec![3, 1, b'k', 1, 1, b'a', 0]);
        assert_eq!(KvResponse::Value(Some(b"x".to_vec())).encode(), vec![0, 1, 1, b'x']);
        assert_eq!(KvRequest::decode(&put.encode()).expect("decodes"), put);
    }

    #[test]
    fn footprints_declare_exact_keys_and_scan_prefixes() {
        let kv = Kv::new();
        let c = |r: KvRequest| kv.conflicts(&r.encode());
        let put = |k: &str| c(KvRequest::Put { key: k.into(), value: vec![] });
        let get = |k: &str| c(KvRequest::Get { key: k.into() });
        let scan = |p: &str| c(KvRequest::Scan { prefix: p.into(), limit: 1 });
        let cas = c(KvRequest::Cas { key: b"a/1".to_vec(), expected: None, new: vec![] });
        assert!(put("a/1").conflicts_with(&get("a/1")));
        assert!(!put("a/1").conflicts_with(&get("a/2")));
        assert!(!get("a/1").conflicts_with(&get("a/1")), "reads share");
        assert!(cas.conflicts_with(&get("a/1")));
        assert!(scan("a/").conflicts_with(&put("a/9")), "a scan reads keys it has not seen yet");
        assert!(scan("").conflicts_with(&put("z")));
        assert!(!scan("a/").conflicts_with(&put("b/1")));
        assert!(!scan("a/").conflicts_with(&scan("a/")));
        assert!(c(KvRequest::Delete { key: b"a/".to_vec() }).conflicts_with(&scan("a")));
        assert_eq!(kv.conflicts(&[0xff, 0xff, 0xff]), Conflicts::none(), "garbage touches nothing");
    }

    #[test]
    fn clones_are_deep_and_restore_keeps_handles_live() {
        let mut a = Kv::new();
        a.apply(KvRequest::Put { key: b"k".to_vec(), value: b"1".to_vec() });
        let b = a.clone();
        a.apply(KvRequest::Put { key: b"k".to_vec(), value: b"2".to_vec() });
        assert_eq!(b.get(b"k"), Some(b"1".to_vec()));
        let handle = a.concurrent().expect("kv opts in");
        a.restore(&b.snapshot()).expect("restores");
        let got = handle.execute_shared(&KvRequest::Get { key: b"k".to_vec() }.encode(), &ctx());
        assert_eq!(KvResponse::decode(&got).expect("decodes"), KvResponse::Value(Some(b"1".to_vec())));
    }

    #[test]
    fn a_frozen_state_serializes_as_it_was_whatever_is_written_after() {
        let mut kv = Kv::new();
        for i in 0..2_000u32 {
            kv.apply(KvRequest::Put { key: i.to_be_bytes().to_vec(), value: vec![i as u8; 100] });
        }
        let w = ExecCtx::new(Seq(1), 10, 0, ClientId(9));
        run(&mut kv, KvRequest::Watch { prefix: vec![0], lease_ms: 0 });
        let before = kv.snapshot();
        let frozen = kv.freeze().expect("KV freezes");
        // Overwrite, delete, add in every shard, and change the watch registry.
        for i in 0..2_000u32 {
            let key = i.to_be_bytes().to_vec();
            let req = match i % 3 {
                0 => KvRequest::Put { key, value: vec![0xee; 7] },
                1 => KvRequest::Delete { key },
                _ => KvRequest::Cas { key, expected: Some(vec![i as u8; 100]), new: vec![1] },
            };
            kv.execute(&req.encode(), &w);
            kv.apply(KvRequest::Put { key: format!("new-{i}").into_bytes(), value: vec![2; 10] });
        }
        kv.execute(&KvRequest::Unwatch { prefix: vec![0] }.encode(), &w);
        let after = kv.snapshot();
        assert_ne!(after, before);
        assert_eq!(frozen.snapshot(), before, "the copy is isolated from later writes");
        assert_eq!(kv.snapshot(), after, "and serializing it changes nothing live");
    }

    #[derive(Clone, Debug)]
    enum Step {
        Put(u8, usize),
        Delete(u8),
        Cas(u8),
        /// Freeze now, serialize later.
        Freeze,
        /// Serialize the pending freeze at this index (mod their number).
        Serialize(usize),
        /// Serialize inline (`Service::pieces`).
        Inline,
        /// Replace the state with a snapshot of another store.
        Restore,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            8 => (0..200u8, 0..120usize).prop_map(|(k, len)| Step::Put(k, len)),
            2 => (0..200u8).prop_map(Step::Delete),
            1 => (0..200u8).prop_map(Step::Cas),
            2 => Just(Step::Freeze),
            2 => (0..4usize).prop_map(Step::Serialize),
            2 => Just(Step::Inline),
            1 => Just(Step::Restore),
        ]
    }

    /// Pieces as (bytes) per piece: boundaries included, since they decide the chunks.
    fn shape(pieces: &[Arc<Piece>]) -> Vec<Vec<u8>> {
        pieces.iter().map(|p| p.bytes().expect("in memory").to_vec()).collect()
    }

    proptest! {
        /// A checkpoint that reuses cached segments has exactly the pieces of the same
        /// state serialized with no cache (a deep copy), whatever the interleaving of
        /// writes, freezes serialized out of order, inline checkpoints and restores.
        #[test]
        fn incremental_pieces_equal_whole_ones(steps in proptest::collection::vec(step(), 1..80)) {
            let mut kv = Kv { store: Arc::new(Store::with_segments(512)) };
            let other = Kv::new();
            for i in 0..50u8 {
                other.apply(KvRequest::Put { key: vec![i, i], value: vec![i; 40] });
            }
            // (frozen copy, the pieces the state had when it was frozen)
            let mut pending: Vec<(FrozenKv, Vec<Vec<u8>>)> = Vec::new();
            for s in steps {
                match s {
                    Step::Put(k, len) => { kv.apply(KvRequest::Put { key: vec![k / 3, k], value: vec![k; len] }); }
                    Step::Delete(k) => { kv.apply(KvRequest::Delete { key: vec![k / 3, k] }); }
                    Step::Cas(k) => { kv.apply(KvRequest::Cas { key: vec![k / 3, k], expected: None, new: vec![1] }); }
                    Step::Freeze => {
                        let expected = shape(&kv.clone().pieces());
                        pending.push((kv.store.freeze(), expected));
                    }
                    Step::Serialize(i) if !pending.is_empty() => {
                        let (frozen, expected) = pending.remove(i % pending.len());
                        prop_assert_eq!(shape(&frozen.into_pieces()), expected);
                    }
                    Step::Serialize(_) => {}
                    Step::Inline => {
                        let expected = shape(&kv.clone().pieces());
                        prop_assert_eq!(shape(&kv.pieces()), expected);
                    }
                    Step::Restore => kv.restore(&other.snapshot()).expect("restores"),
                }
            }
        }
    }

    #[test]
    fn a_checkpoint_after_few_writes_reuses_the_other_segments() {
        let kv = Kv { store: Arc::new(Store::with_segments(512)) };
        for i in 0..2000u32 {
            kv.apply(KvRequest::Put { key: i.to_be_bytes().to_vec(), value: vec![0; 50] });
        }
        let first = kv.pieces();
        kv.apply(KvRequest::Put { key: 1000u32.to_be_bytes().to_vec(), value: vec![1; 50] });
        let second = kv.pieces();
        let kept = second.iter().filter(|p| first.iter().any(|q| Arc::ptr_eq(p, q))).count();
        assert!(first.len() > 100, "{} pieces", first.len());
        // The count piece is new each time, and the written key's segment (and perhaps
        // the next, until the cut resynchronizes).
        assert!(kept + 3 >= second.len(), "{kept} of {} pieces kept", second.len());
        assert_eq!(shape(&second), shape(&kv.clone().pieces()));
    }

    #[test]
    fn checkpoints_serialized_after_the_next_freeze_still_reuse_segments() {
        // A large state's first serializations outlast a checkpoint interval: each freeze
        // is taken while the previous one is still out (the runtime allows two). Reuse
        // must resume once one is serialized, not wait for a quiet moment forever.
        let kv = Kv { store: Arc::new(Store::with_segments(512)) };
        for i in 0..2000u32 {
            kv.apply(KvRequest::Put { key: i.to_be_bytes().to_vec(), value: vec![0; 50] });
        }
        let mut out: Vec<(FrozenKv, Vec<Vec<u8>>)> = Vec::new();
        // Every piece serialized so far (kept alive, so pointers are not reused).
        let mut seen: Vec<Arc<Piece>> = Vec::new();
        let mut reused = Vec::new();
        for round in 0..20u32 {
            kv.apply(KvRequest::Put { key: (round * 97).to_be_bytes().to_vec(), value: vec![round as u8; 50] });
            out.push((kv.store.freeze(), shape(&kv.clone().pieces())));
            if out.len() == 2 {
                let (frozen, expected) = out.remove(0);
                let pieces = frozen.into_pieces();
                assert_eq!(shape(&pieces), expected);
                reused.push(
                    pieces.iter().filter(|p| seen.iter().any(|q| Arc::ptr_eq(p, q))).count() * 100 / pieces.len(),
                );
                seen.extend(pieces);
            }
        }
        // The first two serializations have nothing to reuse (each freeze was taken with
        // nothing cached); from the third on, each takes the newest serialized one's
        // segments, all but the few written since.
        assert!(reused[2..].iter().all(|&pct| pct >= 90), "reused % per checkpoint: {reused:?}");
    }

    #[test]
    fn written_key_tracking_is_bounded_and_dropping_it_keeps_pieces_exact() {
        let mut store = Store::with_segments(512);
        store.tracked_max = 10_000;
        let kv = Kv { store: Arc::new(store) };
        let _ = kv.pieces();
        // Never frozen meanwhile: many distinct keys written, then deleted.
        for i in 0..5000u32 {
            kv.apply(KvRequest::Put { key: i.to_be_bytes().to_vec(), value: vec![1; 20] });
            let held: usize = kv.store.written.iter().map(|w| w.lock().unwrap().len()).sum();
            assert!(held * 64 <= 10_000 + 64 * 2, "{held} keys tracked after {i} writes");
        }
        for i in 0..4000u32 {
            kv.apply(KvRequest::Delete { key: i.to_be_bytes().to_vec() });
        }
        assert!(kv.store.tracked.load(Ordering::Relaxed) <= 10_000 + 68);
        assert_eq!(shape(&kv.pieces()), shape(&kv.clone().pieces()));
        kv.apply(KvRequest::Put { key: 4500u32.to_be_bytes().to_vec(), value: vec![2; 20] });
        assert_eq!(shape(&kv.pieces()), shape(&kv.clone().pieces()));
    }

    #[test]
    fn snapshot_round_trips_and_is_deterministic() {
        let a = Kv::new();
        let b = Kv::new();
        for i in 0..20u8 {
            a.apply(KvRequest::Put { key: vec![i], value: vec![i; 3] });
            b.apply(KvRequest::Put { key: vec![19 - i], value: vec![19 - i; 3] });
        }
        assert_eq!(a.snapshot(), b.snapshot());
        let mut c = Kv::new();
        c.restore(&a.snapshot()).expect("restores");
        assert_eq!(c, a);
        assert!(c.restore(&[1, 2, 3, 0xff]).is_err());
    }
}
