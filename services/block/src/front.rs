//! The NBD server a block node serves: fixed newstyle handshake, then READ, WRITE,
//! FLUSH, TRIM, WRITE_ZEROES and DISC, with requests of a connection served
//! concurrently and replied to as they finish (NBD matches replies by cookie).
//!
//! A write (Gnothi §3.2): the front end cuts it into whole blocks per stripe, sends the
//! data as PrepareData to the blocks' u + r + 1 preferred nodes (itself directly when it
//! is one), and once u + r + 1 nodes logged it durably orders a WriteData naming the
//! blocks' hashes; in full mode (G') the data goes through agreement instead. A partial
//! block is read, patched and written on the condition that nobody wrote it meanwhile.
//! A read (Gaios, §3.3, made Byzantine-safe): the blocks' agreed versions and hashes
//! come from a read-index quorum read, the data from this node where it holds that
//! version and from a preferred peer otherwise, and every block is checked against its
//! agreed hash: a peer whose bytes do not match is reported and another one asked.
//!
//! Every reply implies durability (PrepareData fsynced on u + r + 1 nodes and the
//! WriteData in the WAL, by the node's fsync policy), so FLUSH and FUA wait for nothing
//! and CAN_MULTI_CONN holds: what one connection's write completed, any connection on any
//! node reads.

use crate::check::{self, Copy};
use crate::geometry::runs;
use crate::local::{Local, Prepare, OLD_EPOCH};
use crate::meta::{Command, Hash, Meta, Reply, META_BLOCKS_MAX};
use crate::nbd::{self, Cmd};
use crate::plane::{Peers, FETCH_BYTES_MAX};
use keel::{FrontEnd, KeelClient, NodeId, ReadConsistency};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, Semaphore};
use tokio_rustls::TlsAcceptor;

/// How a cluster replicates block data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Gnothi: data to u + r + 1 preferred nodes off the ordering path.
    Gnothi,
    /// G': data through agreement to every node (the paper's full-replication baseline).
    Full,
}

impl Mode {
    pub fn parse(s: &str) -> Option<Mode> {
        match s {
            "gnothi" => Some(Mode::Gnothi),
            "full" => Some(Mode::Full),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Mode::Gnothi => "gnothi",
            Mode::Full => "full",
        }
    }
}

/// Connections a node serves at once; more are closed and counted.
pub const CONNECTIONS_MAX: usize = 256;
/// Requests of one connection in flight at once (the reader waits beyond that).
const IN_FLIGHT: usize = 64;
/// Writes in flight across the node's connections.
const WRITES_IN_FLIGHT: usize = 1024;
/// KiB of READ and WRITE data a node holds for its NBD clients at once (payloads read,
/// replies not yet sent): past it, the connections' readers wait, so what clients send
/// cannot grow a node's memory beyond this (256 MiB).
const BYTES_IN_FLIGHT_KIB: usize = 256 << 10;
/// Bytes of full-mode data one WriteData carries (a request is at most 1 MiB).
const FULL_BYTES_MAX: u64 = 512 << 10;
/// How long the preferred nodes get to acknowledge a PrepareData before the others are
/// asked too (reserve storage).
const PREFERRED_WAIT: Duration = Duration::from_secs(1);
/// Once every node was asked, how long the write waits without any answer before it
/// gives up (a node that is down never answers; one that is up answers within this).
const SILENT_WAIT: Duration = Duration::from_secs(5);
/// How long a peer gets to answer a fetch before the next one is asked.
const FETCH_WAIT: Duration = Duration::from_secs(2);
/// Tries of a write the cluster keeps fencing (each renews the epoch first): more than
/// one fails only if epochs end faster than a write is ordered.
const FENCED_RETRIES: usize = 3;
const HANDSHAKE_WITHIN: Duration = Duration::from_secs(10);
/// A read that found no node serving a block at its agreed version asks again after
/// this pause, doubled each time up to the most (`read_blocks`).
const NOWHERE_PAUSE_MIN: Duration = Duration::from_millis(10);
const NOWHERE_PAUSE_MAX: Duration = Duration::from_millis(500);

/// What went wrong with a block operation, as the NBD client sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpError {
    /// EIO: the cluster did not answer, or no node holds the data.
    Io(String),
    /// ENOSPC: the reserve storage of the nodes that could take the data is full.
    NoSpace(String),
    /// The cluster ended this front end's epoch (nodes refused its PrepareData): renew
    /// and retry. EIO if it ever reaches a client.
    Fenced,
}

impl OpError {
    fn errno(&self) -> u32 {
        match self {
            OpError::Io(_) => nbd::EIO,
            OpError::NoSpace(_) => nbd::ENOSPC,
            OpError::Fenced => nbd::EIO,
        }
    }
}

/// Counters of the front end (`keel block status`, the node's log).
#[derive(Default)]
pub struct FrontStats {
    pub connections: AtomicUsize,
    pub refused_connections: AtomicU64,
    pub malformed: AtomicU64,
    pub reads: AtomicU64,
    pub writes: AtomicU64,
    pub errors: AtomicU64,
    /// Blocks read from this node / fetched from a peer.
    pub local_blocks: AtomicU64,
    pub fetched_blocks: AtomicU64,
    /// Blocks a peer sent that did not match the agreed hash at the version it claimed.
    pub bad_blocks: AtomicU64,
    /// Blocks this node held that did not match (a disk that lies, or a torn write).
    pub bad_local_blocks: AtomicU64,
    /// Reads that found no node serving a block at its version and asked again.
    pub reads_waited: AtomicU64,
    /// Writes fenced because the cluster had ended this front end's epoch (it was idle),
    /// each renewed and tried again.
    pub writes_fenced: AtomicU64,
    /// Bad blocks by the node that sent them.
    pub bad_by_node: std::sync::Mutex<std::collections::BTreeMap<NodeId, u64>>,
    /// NBD connections refused for TLS: options before STARTTLS on a port that requires
    /// it, or a TLS handshake that failed (no client certificate the cluster CA signed).
    pub tls_refused: AtomicU64,
    /// The node plane's traffic ([`Peers`]).
    pub plane: Arc<crate::plane::PlaneStats>,
    /// PrepareData sent to a node outside the blocks' preferred set (reserve storage),
    /// because a preferred node was suspected or late.
    pub reserve_prepares: AtomicU64,
    /// Nodes this front end does not wait for now (they timed out lately).
    pub suspects: Suspects,
    /// How long each node took to acknowledge this front end's PrepareData.
    pub prepare_acks: AckTimes,
}

/// Acknowledgement times of PrepareData by the node that acknowledged, as a histogram:
/// a write waits for the slowest of its copies, so this shows which node slows writes
/// (a recovering one, a slow disk). One histogram per member, fixed when the front end
/// starts, of atomic counters: recording is on every write's path, so it takes no lock.
#[derive(Default)]
pub struct AckTimes(Vec<(NodeId, AckHistogram)>);

/// Upper bounds of [`AckTimes`]' buckets, in seconds (the last bucket is unbounded).
pub const ACK_BUCKETS: [f64; 10] = [0.000_25, 0.000_5, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25];

#[derive(Default)]
pub struct AckHistogram {
    /// Per bucket of [`ACK_BUCKETS`] (not cumulative), then the unbounded one.
    buckets: [AtomicU64; ACK_BUCKETS.len() + 1],
    sum_nanos: AtomicU64,
}

/// A copy of one node's [`AckHistogram`] at one moment.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AckCounts {
    /// Per bucket of [`ACK_BUCKETS`] (not cumulative), then the unbounded one.
    pub buckets: [u64; ACK_BUCKETS.len() + 1],
    pub sum_seconds: f64,
}

impl AckTimes {
    /// A histogram for each of `nodes`; acknowledgements from any other node are not kept
    /// (a front end asks only members).
    pub fn new(nodes: &[NodeId]) -> AckTimes {
        AckTimes(nodes.iter().map(|n| (*n, AckHistogram::default())).collect())
    }

    pub fn record(&self, node: NodeId, took: std::time::Duration) {
        let Some((_, h)) = self.0.iter().find(|(n, _)| *n == node) else { return };
        let s = took.as_secs_f64();
        let bucket = ACK_BUCKETS.iter().position(|&le| s <= le).unwrap_or(ACK_BUCKETS.len());
        h.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        h.sum_nanos.fetch_add(u64::try_from(took.as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    /// Each node's counts, in member order; a node that never acknowledged is left out.
    pub fn snapshot(&self) -> Vec<(NodeId, AckCounts)> {
        self.0
            .iter()
            .map(|(n, h)| {
                let buckets = std::array::from_fn(|i| h.buckets[i].load(Ordering::Relaxed));
                let sum_seconds = h.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
                (*n, AckCounts { buckets, sum_seconds })
            })
            .filter(|(_, c)| c.buckets.iter().any(|&b| b > 0))
            .collect()
    }
}

impl FrontStats {
    /// Node `node` sent block `block` with bytes that do not match version `version`'s
    /// agreed hash: counted, logged, and the block is read elsewhere.
    pub fn bad_block(&self, node: NodeId, block: u64, version: u64) {
        self.bad_blocks.fetch_add(1, Ordering::Relaxed);
        *self.bad_by_node.lock().unwrap_or_else(PoisonError::into_inner).entry(node).or_default() += 1;
        tracing::warn!(
            node = node.0,
            block,
            version,
            "node sent block data that does not match its agreed hash; reading it elsewhere"
        );
    }
}

/// One node's block front end: the cluster client, the node's data, its peers.
pub struct Blocks {
    pub client: KeelClient,
    pub local: Arc<Local>,
    pub meta: Arc<RwLock<Meta>>,
    pub peers: Arc<Peers>,
    /// Member stable ids by index (slices are by index).
    pub members: Vec<NodeId>,
    pub mode: Mode,
    pub op_timeout: Duration,
    /// This front end's epoch and the last seq it numbered a write with in it. Each
    /// epoch's writes are numbered from 1 (the nodes' record of executed writes counts
    /// on it, `executed.rs`), so the two change together, under one lock.
    numbering: std::sync::Mutex<(u64, u64)>,
    /// A write was given up on: the next one begins a new epoch first.
    fence: std::sync::atomic::AtomicBool,
    writes: Semaphore,
    /// `BYTES_IN_FLIGHT_KIB` permits, one per KiB of request or reply data held.
    bytes: Arc<Semaphore>,
    pub stats: Arc<FrontStats>,
}

/// Member indices that timed out lately, and when. A suspicion lapses after a minute
/// (the node gets the benefit of the doubt again) or when the node answers in time.
#[derive(Default)]
pub struct Suspects(std::sync::Mutex<std::collections::HashMap<u32, std::time::Instant>>);

impl Suspects {
    const LAPSE: Duration = Duration::from_secs(60);

    fn set(&self, index: u32, suspect: bool) {
        let mut s = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        if suspect {
            s.insert(index, std::time::Instant::now());
        } else {
            s.remove(&index);
        }
    }

    fn suspected(&self, index: u32) -> bool {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).get(&index).is_some_and(|t| t.elapsed() < Self::LAPSE)
    }

    /// How many nodes are suspected now.
    pub fn count(&self) -> usize {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).values().filter(|t| t.elapsed() < Self::LAPSE).count()
    }
}

impl Blocks {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        client: KeelClient,
        local: Arc<Local>,
        meta: Arc<RwLock<Meta>>,
        peers: Arc<Peers>,
        members: Vec<NodeId>,
        mode: Mode,
        stats: Arc<FrontStats>,
    ) -> Arc<Blocks> {
        Arc::new(Blocks {
            client,
            local,
            meta,
            peers,
            members,
            mode,
            op_timeout: Duration::from_secs(30),
            numbering: std::sync::Mutex::new((0, 0)),
            fence: std::sync::atomic::AtomicBool::new(false),
            writes: Semaphore::new(WRITES_IN_FLIGHT),
            bytes: Arc::new(Semaphore::new(BYTES_IN_FLIGHT_KIB)),
            stats,
        })
    }

    fn size(&self) -> u64 {
        self.local.geometry().size()
    }

    fn suspect(&self, index: u32, now_suspect: bool) {
        self.stats.suspects.set(index, now_suspect);
    }

    fn suspected(&self, index: u32) -> bool {
        self.stats.suspects.suspected(index)
    }

    /// Orders a new epoch for this front end (Gnothi's "new epoch"): PrepareData it left
    /// behind before a restart is garbage everywhere from now on, and the older epochs'
    /// writes are refused if they are ordered later. Retries until the cluster answers;
    /// writes wait for it.
    pub async fn begin(&self) {
        self.renew(None).await
    }

    /// Moves on from epoch `after` (see `Command::NewEpoch`): after a failed write, whose
    /// WriteData may still be ordered later, or when the cluster fenced a write because
    /// it had ended the epoch (the front end was idle, `meta::EPOCH_IDLE_MS`).
    async fn renew(&self, after: Option<u64>) {
        let command = Command::NewEpoch { owner: self.local.node().0, after }.encode();
        loop {
            match self.client.invoke(command.clone(), self.op_timeout).await.map(|r| Reply::decode(&r)) {
                Ok(Ok(Reply::Epoch(e))) => {
                    // Renewals of writes fenced together may answer out of order.
                    let mut n = self.numbering();
                    if e > n.0 {
                        *n = (e, 0);
                    }
                    return;
                }
                other => {
                    tracing::warn!(?other, "block front end: no new epoch yet; retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        }
    }

    fn numbering(&self) -> std::sync::MutexGuard<'_, (u64, u64)> {
        self.numbering.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The epoch and seq of a new write.
    fn number(&self) -> (u64, u64) {
        let mut n = self.numbering();
        n.1 += 1;
        *n
    }

    async fn invoke(&self, command: &Command) -> Result<Reply, OpError> {
        let bytes =
            self.client.invoke(command.encode(), self.op_timeout).await.map_err(|e| OpError::Io(e.to_string()))?;
        Reply::decode(&bytes).map_err(|e| OpError::Io(format!("bad reply: {e}")))
    }

    /// The agreed (version, hash) of `count` blocks from `first`, read at a read index.
    async fn meta(&self, first: u64, count: u64) -> Result<Vec<(u64, Hash)>, OpError> {
        let mut out = Vec::with_capacity(count as usize);
        let mut b = first;
        while b < first + count {
            let n = (first + count - b).min(u64::from(META_BLOCKS_MAX)) as u32;
            let op = Command::Meta { first: b, count: n }.encode();
            let bytes = self
                .client
                .invoke_read_only(op, ReadConsistency::Index, self.op_timeout)
                .await
                .map_err(|e| OpError::Io(e.to_string()))?;
            match Reply::decode(&bytes) {
                Ok(Reply::Meta(m)) if m.len() == n as usize => out.extend(m),
                other => return Err(OpError::Io(format!("metadata read: {other:?}"))),
            }
            b += u64::from(n);
        }
        Ok(out)
    }

    /// Reads `len` bytes at `offset` (in range).
    pub async fn read(&self, offset: u64, len: u64) -> Result<Vec<u8>, OpError> {
        if len == 0 {
            return Ok(Vec::new());
        }
        let bs = u64::from(self.local.geometry().block_size);
        let (first, end) = (offset / bs, (offset + len).div_ceil(bs));
        let data = self.read_blocks(first, end - first).await?;
        let skip = (offset - first * bs) as usize;
        Ok(data[skip..skip + len as usize].to_vec())
    }

    /// `base:allocation` for `len` bytes at `offset` (in range, not empty): extents of
    /// (length, flags), consecutive from `offset`, each a run of blocks that all read as
    /// zeros (a hole: no node holds data for them) or all hold data. From the same
    /// linearizable metadata read as a READ, so a block a completed write filled is
    /// never reported as zeros (a copy tool would skip it). At most
    /// [`META_BLOCKS_MAX`] blocks are described, which the protocol allows (the client
    /// asks again from where the answer ends); with `one`, a single extent.
    pub async fn extents(&self, offset: u64, len: u32, one: bool) -> Result<Vec<(u32, u32)>, OpError> {
        let bs = u64::from(self.local.geometry().block_size);
        let end = offset + u64::from(len);
        let first = offset / bs;
        let count = (end.div_ceil(bs) - first).min(u64::from(META_BLOCKS_MAX));
        let meta = self.meta(first, count).await?;
        let zero = self.meta.read().unwrap_or_else(PoisonError::into_inner).zero();
        let mut extents: Vec<(u32, u32)> = Vec::new();
        for (k, (_, hash)) in meta.iter().enumerate() {
            let b = first + k as u64;
            let from = (b * bs).max(offset);
            let to = ((b + 1) * bs).min(end);
            let flags = if *hash == zero { nbd::STATE_HOLE | nbd::STATE_ZERO } else { 0 };
            // Within `len`, so the sum fits a u32.
            let length = (to - from) as u32;
            match extents.last_mut() {
                Some(last) if last.1 == flags => last.0 += length,
                Some(_) if one => break,
                _ => extents.push((length, flags)),
            }
        }
        Ok(extents)
    }

    /// Whole blocks, each checked against the agreed hash. A block whose holders all
    /// have a newer version than the metadata read said is read again (a write
    /// completed meanwhile); three times at most. A block no node serves at its version
    /// is asked for again after a pause, until the operation's timeout: a holder may be
    /// restarting, or not have executed the write yet (it holds the PrepareData) — the
    /// simulator's model meets this at (1, 0), one holder down and the other behind — and
    /// a disk that waits a moment is better than one that answers EIO.
    async fn read_blocks(&self, first: u64, count: u64) -> Result<Vec<u8>, OpError> {
        let bs = self.local.geometry().bs();
        let mut out = vec![0u8; count as usize * bs];
        let mut todo: Vec<u64> = (first..first + count).collect();
        let deadline = tokio::time::Instant::now() + self.op_timeout;
        let mut pause = NOWHERE_PAUSE_MIN;
        let mut changed = 0;
        loop {
            let meta = self.meta(first, count).await?;
            let zero = self.meta.read().unwrap_or_else(PoisonError::into_inner).zero();
            let want = |b: u64| meta[(b - first) as usize];
            todo.retain(|&b| want(b).1 != zero);
            for &b in &todo {
                // Zeros where nothing is to be read; the rest is overwritten below.
                out[(b - first) as usize * bs..][..bs].fill(0);
            }
            // This node first.
            let mut missing = Vec::new();
            for run in runs(todo.iter().copied(), u64::MAX) {
                let (data, held) = self.local.read(run.0, run.1).map_err(|e| OpError::Io(e.to_string()))?;
                for k in 0..run.1 {
                    let b = run.0 + k;
                    let d = &data[k as usize * bs..][..bs];
                    match check::judge(want(b), held[k as usize], d) {
                        Copy::Good => {
                            out[(b - first) as usize * bs..][..bs].copy_from_slice(d);
                            self.stats.local_blocks.fetch_add(1, Ordering::Relaxed);
                        }
                        verdict => {
                            if verdict == Copy::Wrong {
                                self.stats.bad_local_blocks.fetch_add(1, Ordering::Relaxed);
                                tracing::warn!(
                                    block = b,
                                    version = want(b).0,
                                    "this node's copy of the block does not match its agreed hash"
                                );
                            }
                            missing.push(b);
                        }
                    }
                }
            }
            // Then peers, preferred first.
            let mut newer = Vec::new();
            let mut nowhere = Vec::new();
            for run in runs(missing.iter().copied(), u64::MAX) {
                let into = &mut out[(run.0 - first) as usize * bs..][..run.1 as usize * bs];
                let got = self.fetch_run(run.0, run.1, &want, Some(into)).await;
                for (k, result) in got.into_iter().enumerate() {
                    let b = run.0 + k as u64;
                    match result {
                        Found::Data => {
                            self.stats.fetched_blocks.fetch_add(1, Ordering::Relaxed);
                        }
                        Found::Newer => newer.push(b),
                        Found::Nowhere => nowhere.push(b),
                    }
                }
            }
            if newer.is_empty() && nowhere.is_empty() {
                return Ok(out);
            }
            if !newer.is_empty() {
                changed += 1;
                if changed == 3 {
                    return Err(OpError::Io(format!("blocks from {first} kept changing while read")));
                }
            }
            if let Some(&b) = nowhere.first() {
                if tokio::time::Instant::now() + pause > deadline {
                    return Err(OpError::Io(format!("no node holds block {b} at version {}", want(b).0)));
                }
                self.stats.reads_waited.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(NOWHERE_PAUSE_MAX);
            }
            todo = newer;
            todo.extend(nowhere);
            todo.sort_unstable();
        }
    }

    /// Fetches blocks `first..first + count` from peers, preferred ones first, checking
    /// each block; a block this node is preferred for is kept (read repair). Good copies
    /// go into `into` (`count` blocks long) when given; recovery gives none, since it
    /// only stores what it fetches.
    pub async fn fetch_run(
        &self,
        first: u64,
        count: u64,
        want: &impl Fn(u64) -> (u64, Hash),
        mut into: Option<&mut [u8]>,
    ) -> Vec<Found> {
        let g = self.local.geometry();
        let bs = g.bs();
        let mut found: Vec<Option<Found>> = vec![None; count as usize];
        let mut newer = vec![false; count as usize];
        let me = self.local.index();
        let mut candidates: Vec<u32> = g
            .preferred(first)
            .chain((0..g.nodes).filter(|i| !g.is_preferred(first, *i)))
            .filter(|&i| i != me && (i as usize) < self.members.len())
            .collect();
        // Nodes that timed out lately go last (stable: the preferred order otherwise).
        candidates.sort_by_key(|&i| self.suspected(i));
        let per_fetch = (FETCH_BYTES_MAX / u64::from(g.block_size)).max(1);
        for index in candidates {
            let node = self.members[index as usize];
            let mut at = 0u64;
            while at < count {
                let n = (count - at).min(per_fetch);
                if found[at as usize..(at + n) as usize].iter().all(Option::is_some) {
                    at += n;
                    continue;
                }
                let (id, rx) = self.peers.fetch(node, first + at, n as u32);
                let answer = tokio::time::timeout(FETCH_WAIT, rx).await;
                self.peers.forget_fetch(node, id);
                let Ok(Ok((versions, data))) = answer else {
                    self.suspect(index, true);
                    break;
                };
                self.suspect(index, false);
                if versions.len() as u64 != n || data.len() != n as usize * bs {
                    break;
                }
                let mut keep = Vec::new();
                for k in 0..n {
                    let i = (at + k) as usize;
                    if found[i].is_some() {
                        continue;
                    }
                    let b = first + at + k;
                    let v = want(b).0;
                    let d = &data[k as usize * bs..][..bs];
                    match check::judge(want(b), versions[k as usize], d) {
                        Copy::Good => {
                            if let Some(out) = into.as_deref_mut() {
                                out[i * bs..][..bs].copy_from_slice(d);
                            }
                            found[i] = Some(Found::Data);
                            if g.is_preferred(b, me) {
                                keep.push((b, v));
                            }
                        }
                        Copy::Wrong => self.stats.bad_block(node, b, v),
                        Copy::Newer => newer[i] = true,
                        Copy::Older => {}
                    }
                }
                // Runs of consecutive blocks are consecutive in `data`: each is stored
                // as one.
                let mut k = 0;
                while k < keep.len() {
                    let start = k;
                    while k + 1 < keep.len() && keep[k + 1].0 == keep[k].0 + 1 {
                        k += 1;
                    }
                    k += 1;
                    let (b, i) = (keep[start].0, (keep[start].0 - first - at) as usize);
                    let versions: Vec<u64> = keep[start..k].iter().map(|&(_, v)| v).collect();
                    let _ = self.local.store_fetched(b, &versions, &data[i * bs..(i + versions.len()) * bs]);
                }
                at += n;
            }
            if found.iter().all(Option::is_some) {
                break;
            }
        }
        found.into_iter().zip(newer).map(|(f, n)| f.unwrap_or(if n { Found::Newer } else { Found::Nowhere })).collect()
    }

    /// Writes `data` at `offset` (in range).
    pub async fn write(&self, offset: u64, data: &[u8]) -> Result<(), OpError> {
        let g = self.local.geometry();
        let bs = u64::from(g.block_size);
        let end = offset + data.len() as u64;
        let mut pieces = Vec::new();
        let mut at = offset;
        while at < end {
            let b = at / bs;
            let in_block = at % bs;
            if in_block != 0 || end - at < bs {
                let n = (bs - in_block).min(end - at);
                let slice = &data[(at - offset) as usize..][..n as usize];
                pieces.push(Piece::Partial { block: b, at: in_block as usize, bytes: slice });
                at += n;
            } else {
                let whole = (end - at) / bs;
                let stop = g.stripe_end(b, b + whole);
                let stop = if self.mode == Mode::Full { stop.min(b + (FULL_BYTES_MAX / bs).max(1)) } else { stop };
                let n = (stop - b) * bs;
                pieces.push(Piece::Whole { first: b, bytes: &data[(at - offset) as usize..][..n as usize] });
                at += n;
            }
        }
        let results = futures_join(pieces.into_iter().map(|p| self.write_piece(p))).await;
        results.into_iter().collect()
    }

    async fn write_piece(&self, piece: Piece<'_>) -> Result<(), OpError> {
        match piece {
            Piece::Whole { first, bytes } => match self.write_blocks(first, bytes.to_vec(), None).await? {
                Reply::Written { .. } => Ok(()),
                other => Err(OpError::Io(format!("write: {other:?}"))),
            },
            Piece::Partial { block, at, bytes } => self.patch(block, at, bytes).await,
        }
    }

    /// Read-modify-write of part of one block, retried if another write got there first.
    async fn patch(&self, block: u64, at: usize, bytes: &[u8]) -> Result<(), OpError> {
        for _ in 0..16 {
            let (version, _) = self.meta(block, 1).await?[0];
            let mut data = self.read_blocks(block, 1).await?;
            data[at..at + bytes.len()].copy_from_slice(bytes);
            match self.write_blocks(block, data, Some(version)).await? {
                Reply::Written { .. } => return Ok(()),
                Reply::Moved { .. } => continue,
                other => return Err(OpError::Io(format!("write: {other:?}"))),
            }
        }
        Err(OpError::Io(format!("block {block} kept changing under a partial write")))
    }

    /// Writes whole blocks from `first`, in one stripe. A write the cluster fenced (its
    /// epoch ended while it was on its way: nothing changed) is tried again in the
    /// renewed epoch, a few times.
    async fn write_blocks(&self, first: u64, data: Vec<u8>, expect: Option<u64>) -> Result<Reply, OpError> {
        let bs = self.local.geometry().bs();
        let hashes: Vec<Hash> = data.chunks_exact(bs).map(|d| *blake3::hash(d).as_bytes()).collect();
        let _permit = self.writes.acquire().await.map_err(|_| OpError::Io("stopping".into()))?;
        let owner = self.local.node();
        // Taken by each try and given back by a fenced one.
        let mut data = Some(data);
        for _ in 0..FENCED_RETRIES {
            if self.fence.swap(false, Ordering::AcqRel) {
                let epoch = self.numbering().0;
                self.renew(Some(epoch)).await;
            }
            let (epoch, seq) = self.number();
            let hashes = hashes.clone();
            let command = match self.mode {
                Mode::Full => Command::Write { owner: owner.0, epoch, seq, first, hashes, expect, data: data.take() },
                Mode::Gnothi => {
                    let bytes = data.take().unwrap_or_default();
                    let prepare = Prepare { owner, epoch, seq, first, hashes: hashes.clone(), data: bytes };
                    let prepared = self.prepare(&prepare).await;
                    data = Some(prepare.data);
                    match prepared {
                        Ok(()) => {}
                        Err(OpError::Fenced) => {
                            self.stats.writes_fenced.fetch_add(1, Ordering::Relaxed);
                            self.renew(Some(epoch)).await;
                            continue;
                        }
                        Err(e) => {
                            // The nodes that took the PrepareData hold it for a WriteData
                            // that will never come; only the epoch's end drops it. The
                            // next write begins a new epoch (as after a failed order).
                            self.fence.store(true, Ordering::Release);
                            return Err(e);
                        }
                    }
                    Command::Write { owner: owner.0, epoch, seq, first, hashes, expect, data: None }
                }
            };
            match self.invoke(&command).await {
                Ok(Reply::Fenced) => {
                    self.stats.writes_fenced.fetch_add(1, Ordering::Relaxed);
                    self.renew(Some(epoch)).await;
                    if let Command::Write { data: Some(d), .. } = command {
                        data = Some(d);
                    }
                }
                Ok(reply) => return Ok(reply),
                Err(e) => {
                    // Given up on, the write may still be ordered later. The next write
                    // first begins a new epoch, which fences it: ordered after the epoch
                    // it is refused, and the nodes drop its PrepareData.
                    self.fence.store(true, Ordering::Release);
                    return Err(e);
                }
            }
        }
        Err(OpError::Io(format!("the write's epoch ended before it was ordered, {FENCED_RETRIES} times")))
    }

    /// Gnothi §3.2 steps 1-3: the PrepareData durably on u + r + 1 nodes, the blocks'
    /// preferred nodes first and the others (reserve storage) once those are late.
    async fn prepare(&self, prepare: &Prepare) -> Result<(), OpError> {
        let g = self.local.geometry();
        let need = g.copies as usize;
        let me = self.local.index();
        let preferred: Vec<u32> = g.preferred(prepare.first).collect();
        let others: Vec<u32> = (0..g.nodes).filter(|i| !preferred.contains(i)).collect();
        let (tx, mut rx) = mpsc::channel::<(u32, Result<(), String>)>(g.nodes as usize);
        let mut asked = BTreeSet::new();
        let ask = |index: u32, asked: &mut BTreeSet<u32>| {
            asked.insert(index);
            if !preferred.contains(&index) {
                self.stats.reserve_prepares.fetch_add(1, Ordering::Relaxed);
            }
            let tx = tx.clone();
            if index == me {
                let (local, p) = (self.local.clone(), prepare.clone());
                tokio::spawn(async move {
                    let r = local.prepare(p).await.map_err(|e| e.to_string());
                    let _ = tx.send((index, r)).await;
                });
            } else if let Some(&node) = self.members.get(index as usize) {
                let rx = self.peers.prepare(node, prepare);
                tokio::spawn(async move {
                    let r = rx.await.unwrap_or_else(|_| Err("not sent".into()));
                    let _ = tx.send((index, r)).await;
                });
            }
        };
        // Every preferred node, and for each one that timed out lately a reserve node now:
        // this node directly, the others down one chain (this node sends the data once).
        let lately_down = preferred.iter().filter(|&&i| self.suspected(i)).count();
        let first: Vec<u32> =
            preferred.iter().chain(others.iter().filter(|&&i| !self.suspected(i)).take(lately_down)).copied().collect();
        if first.contains(&me) {
            ask(me, &mut asked);
        }
        // Nodes that timed out lately go last in the chain, so they cannot break it for
        // the others.
        let mut chain: Vec<u32> =
            first.iter().copied().filter(|&i| i != me && (i as usize) < self.members.len()).collect();
        chain.sort_by_key(|&i| self.suspected(i));
        let chain_ids: Vec<NodeId> = chain.iter().map(|&i| self.members[i as usize]).collect();
        for (&index, rx) in chain.iter().zip(self.peers.prepare_chain(&chain_ids, prepare)) {
            asked.insert(index);
            if !preferred.contains(&index) {
                self.stats.reserve_prepares.fetch_add(1, Ordering::Relaxed);
            }
            let tx = tx.clone();
            tokio::spawn(async move {
                let r = rx.await.unwrap_or_else(|_| Err("not sent".into()));
                let _ = tx.send((index, r)).await;
            });
        }
        let mut acked = 0usize;
        let mut answered = 0usize;
        let asked_at = tokio::time::Instant::now();
        let mut full = false;
        let mut ended = false;
        let mut last_error = String::new();
        let deadline = tokio::time::Instant::now() + self.op_timeout;
        let widen_at = tokio::time::Instant::now() + PREFERRED_WAIT;
        let mut widened = false;
        let mut heard = tokio::time::Instant::now();
        let mut heard_from = BTreeSet::new();
        while acked < need {
            let now = tokio::time::Instant::now();
            if now >= deadline {
                break;
            }
            let until = if widened { deadline.min(heard + SILENT_WAIT) } else { widen_at };
            match tokio::time::timeout_at(until, rx.recv()).await {
                Ok(Some((i, Ok(())))) => {
                    acked += 1;
                    answered += 1;
                    heard_from.insert(i);
                    heard = tokio::time::Instant::now();
                    if let Some(&node) = self.members.get(i as usize) {
                        self.stats.prepare_acks.record(node, heard - asked_at);
                    }
                    if heard < widen_at {
                        self.suspect(i, false);
                    }
                }
                Ok(Some((i, Err(e)))) => {
                    answered += 1;
                    heard_from.insert(i);
                    heard = tokio::time::Instant::now();
                    if heard < widen_at {
                        self.suspect(i, false);
                    }
                    full |= e.contains("reserve");
                    ended |= e.contains(OLD_EPOCH);
                    last_error = format!("node index {i}: {e}");
                    if !widened {
                        widened = true;
                        for &o in &others {
                            if !asked.contains(&o) {
                                ask(o, &mut asked);
                            }
                        }
                    }
                }
                Ok(None) => break,
                Err(_) if !widened => {
                    widened = true;
                    heard = tokio::time::Instant::now();
                    for &i in asked.iter().filter(|i| !heard_from.contains(i)) {
                        self.suspect(i, true);
                        // The chain may have broken before it: straight to it now.
                        if let Some(&node) = self.members.get(i as usize).filter(|_| i != me) {
                            self.peers.resend(node, prepare);
                        }
                    }
                    for &o in &others {
                        if !asked.contains(&o) {
                            ask(o, &mut asked);
                        }
                    }
                }
                Err(_) => break,
            }
            if widened && answered == asked.len() && acked < need {
                break;
            }
        }
        // A suspected node asked alongside a reserve one usually answers after the write
        // has its copies. Its answer is still awaited until `widen_at`: one in time shows
        // it is back (and stops the reserve copies), a later one that it is slow.
        let (late, done): (Vec<u32>, Vec<u32>) = asked
            .into_iter()
            .partition(|&i| self.suspected(i) && !heard_from.contains(&i) && tokio::time::Instant::now() < widen_at);
        for i in done {
            if let Some(&node) = self.members.get(i as usize) {
                self.peers.forget_prepare(node, prepare.epoch, prepare.seq);
            }
        }
        if !late.is_empty() {
            let late: Vec<(u32, NodeId)> =
                late.into_iter().filter_map(|i| self.members.get(i as usize).map(|&node| (i, node))).collect();
            let (stats, peers, epoch, seq) = (self.stats.clone(), self.peers.clone(), prepare.epoch, prepare.seq);
            tokio::spawn(async move {
                // Any answer of a late node's own (its waiter stays until the loop
                // ends, so none is made up here) shows that it is back.
                while let Ok(Some((i, _))) = tokio::time::timeout_at(widen_at, rx.recv()).await {
                    if late.iter().any(|&(j, _)| j == i) {
                        stats.suspects.set(i, false);
                    }
                }
                for (_, node) in late {
                    peers.forget_prepare(node, epoch, seq);
                }
            });
        }
        if acked >= need {
            Ok(())
        } else if ended {
            Err(OpError::Fenced)
        } else if full {
            Err(OpError::NoSpace(format!("PrepareData on {acked} of {need} nodes: {last_error}")))
        } else {
            Err(OpError::Io(format!("PrepareData on {acked} of {need} nodes: {last_error}")))
        }
    }

    /// Zeros `len` bytes at `offset` (in range): whole blocks by one agreed command
    /// without data, the partial ends by writes of zeros.
    pub async fn zero(&self, offset: u64, len: u64) -> Result<(), OpError> {
        let bs = u64::from(self.local.geometry().block_size);
        let end = offset + len;
        let (first_whole, end_whole) = (offset.div_ceil(bs), end / bs);
        if first_whole >= end_whole {
            return self.write(offset, &vec![0u8; len as usize]).await;
        }
        if offset < first_whole * bs {
            self.write(offset, &vec![0u8; (first_whole * bs - offset) as usize]).await?;
        }
        match self.invoke(&Command::Zero { first: first_whole, count: end_whole - first_whole }).await? {
            Reply::Written { .. } => {}
            other => return Err(OpError::Io(format!("zero: {other:?}"))),
        }
        if end > end_whole * bs {
            self.write(end_whole * bs, &vec![0u8; (end - end_whole * bs) as usize]).await?;
        }
        Ok(())
    }
}

/// What a fetch found for one block.
#[derive(Clone, Debug)]
pub enum Found {
    /// A good copy: in the caller's buffer, if it gave one.
    Data,
    /// Every holder has a newer version: read the metadata again.
    Newer,
    Nowhere,
}

impl Found {
    pub fn is_data(&self) -> bool {
        matches!(self, Found::Data)
    }

    pub fn is_nowhere(&self) -> bool {
        matches!(self, Found::Nowhere)
    }
}

enum Piece<'a> {
    Whole { first: u64, bytes: &'a [u8] },
    Partial { block: u64, at: usize, bytes: &'a [u8] },
}

/// Awaits every future, concurrently, in order of the results.
async fn futures_join<F: std::future::Future>(futures: impl Iterator<Item = F>) -> Vec<F::Output> {
    let mut pinned: Vec<_> = futures.map(Box::pin).collect();
    let mut out: Vec<Option<F::Output>> = (0..pinned.len()).map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (i, f) in pinned.iter_mut().enumerate() {
            if out[i].is_none() {
                match f.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => out[i] = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    out.into_iter().flatten().collect()
}

/// Keel client sessions a block front end wants: operations in flight at once.
pub const CLIENT_SESSIONS: usize = 64;

/// Serves NBD on `listener` until the node stops: the node's plane carries PrepareData
/// and fetches, its client identity the agreed commands.
#[allow(clippy::too_many_arguments)]
pub async fn serve(
    mut front: FrontEnd,
    listener: TcpListener,
    local: Arc<Local>,
    meta: Arc<RwLock<Meta>>,
    members: Vec<NodeId>,
    mode: Mode,
    stats: Arc<FrontStats>,
    recovery: Arc<crate::recovery::Recovery>,
    tls: Option<TlsAcceptor>,
) {
    let (Some(mut plane), Some(client)) = (front.take_plane(), front.client().cloned()) else {
        tracing::error!("the block front end needs the node's plane and a client identity");
        return;
    };
    let peers = Peers::new(local.node(), plane.sender(), stats.plane.clone());
    let blocks = Blocks::new(client, local, meta, peers, members, mode, stats);
    {
        let (peers, local) = (blocks.peers.clone(), blocks.local.clone());
        tokio::spawn(async move {
            while let Some((from, bytes)) = plane.recv().await {
                peers.handle(&local, from, &bytes);
            }
        });
    }
    tokio::spawn(recovery.run(blocks.clone()));
    tokio::select! {
        _ = front.stopped() => return,
        _ = blocks.begin() => {}
    }
    tracing::info!(node = blocks.local.node().0, mode = blocks.mode.name(), "block front end ready");
    loop {
        tokio::select! {
            _ = front.stopped() => return,
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                if blocks.stats.connections.load(Ordering::Relaxed) >= CONNECTIONS_MAX {
                    blocks.stats.refused_connections.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                let _ = stream.set_nodelay(true);
                let (blocks, tls) = (blocks.clone(), tls.clone());
                tokio::spawn(async move {
                    blocks.stats.connections.fetch_add(1, Ordering::Relaxed);
                    if let Err(e) = connection(stream, &blocks, tls).await {
                        tracing::debug!(error = %e, "NBD connection ended");
                    }
                    blocks.stats.connections.fetch_sub(1, Ordering::Relaxed);
                });
            }
        }
    }
}

#[derive(Debug, thiserror::Error)]
enum ConnError {
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Protocol(String),
    #[error("the handshake took too long")]
    Slow,
    #[error("TLS handshake: {0}")]
    Tls(String),
}

/// What option haggling settled for the transmission phase.
#[derive(Clone, Copy, Debug, Default)]
struct Wire {
    /// NBD_OPT_STRUCTURED_REPLY was acknowledged: READ answers in chunks.
    structured: bool,
    /// The id `base:allocation` was given by the last NBD_OPT_SET_META_CONTEXT, if it
    /// selected it: NBD_CMD_BLOCK_STATUS may be sent.
    allocation: Option<u32>,
}

/// The id this server gives `base:allocation` (its only context).
const ALLOCATION_ID: u32 = 1;

/// Flags of the export as the transmission phase offers it. Zeroing is always fast (it
/// is metadata only: no node writes zeros), so NBD_FLAG_SEND_FAST_ZERO is honest; a READ
/// is always one chunk, so NBD_CMD_FLAG_DF is honoured once chunks are negotiated.
fn transmission_flags(wire: Wire) -> u16 {
    let df = if wire.structured { nbd::TF_SEND_DF } else { 0 };
    nbd::TF_HAS_FLAGS
        | nbd::TF_SEND_FLUSH
        | nbd::TF_SEND_FUA
        | nbd::TF_SEND_TRIM
        | nbd::TF_SEND_WRITE_ZEROES
        | nbd::TF_SEND_FAST_ZERO
        | nbd::TF_CAN_MULTI_CONN
        | df
}

/// The replies to NBD_OPT_LIST_META_CONTEXT (`set` false) or NBD_OPT_SET_META_CONTEXT,
/// and for SET the id `base:allocation` now has, if it was selected. Queries of other
/// namespaces are ignored, as the protocol asks; `base:` lists the namespace's one
/// context.
fn meta_contexts(option: u32, data: &[u8], wire: Wire) -> (Vec<u8>, Option<u32>) {
    let set = option == nbd::OPT_SET_META_CONTEXT;
    let refuse = |why: &str| (nbd::option_reply(option, nbd::REP_ERR_INVALID, why.as_bytes()), None);
    if !wire.structured {
        return refuse("negotiate NBD_OPT_STRUCTURED_REPLY first");
    }
    let (name, queries) = match nbd::decode_meta_context(data) {
        Ok(d) => d,
        Err(e) => return refuse(&e.to_string()),
    };
    if !known_export(&name) {
        return (nbd::option_reply(option, nbd::REP_ERR_UNKNOWN, b"this server has one export: the default one"), None);
    }
    let selected = if set {
        queries.iter().any(|q| q == nbd::CONTEXT_ALLOCATION)
    } else {
        queries.is_empty() || queries.iter().any(|q| q == nbd::CONTEXT_ALLOCATION || q == "base:")
    };
    let mut reply = Vec::new();
    if selected {
        // LIST gives ids of 0, as the protocol asks.
        let id = if set { ALLOCATION_ID } else { 0 };
        reply = nbd::option_reply(option, nbd::REP_META_CONTEXT, &nbd::meta_context(id, nbd::CONTEXT_ALLOCATION));
    }
    reply.extend(nbd::option_reply(option, nbd::REP_ACK, &[]));
    (reply, (set && selected).then_some(ALLOCATION_ID))
}

/// The one export's name: the default (empty) name, and "keel" as an alias.
fn known_export(name: &[u8]) -> bool {
    name.is_empty() || name == b"keel"
}

/// Where option haggling left a connection.
enum Haggled {
    /// The client chose the export: transmission begins.
    Go(Wire),
    /// The client aborted, or TLS was required and it asked for the export without it
    /// (no reply is possible then).
    End,
    /// The client asked for TLS and was told yes: the handshake comes next.
    StartTls,
}

/// The stream once negotiated, plain or in TLS.
enum Negotiated {
    Plain(TcpStream, Wire),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>, Wire),
}

async fn connection(stream: TcpStream, blocks: &Arc<Blocks>, tls: Option<TlsAcceptor>) -> Result<(), ConnError> {
    let negotiated = match tokio::time::timeout(HANDSHAKE_WITHIN, negotiate(stream, blocks, tls)).await {
        Ok(Ok(Some(n))) => n,
        Ok(Ok(None)) => return Ok(()),
        Ok(Err(e)) => {
            if !matches!(e, ConnError::Tls(_)) {
                blocks.stats.malformed.fetch_add(1, Ordering::Relaxed);
            }
            return Err(e);
        }
        Err(_) => return Err(ConnError::Slow),
    };
    match negotiated {
        Negotiated::Plain(stream, wire) => {
            let (rd, wr) = stream.into_split();
            transmission(rd, wr, blocks, wire).await
        }
        Negotiated::Tls(stream, wire) => {
            let (rd, wr) = tokio::io::split(*stream);
            transmission(rd, wr, blocks, wire).await
        }
    }
}

/// The greeting and option haggling, with TLS first if the port requires it; None if
/// the client went away without choosing the export.
async fn negotiate(
    mut stream: TcpStream,
    blocks: &Arc<Blocks>,
    tls: Option<TlsAcceptor>,
) -> Result<Option<Negotiated>, ConnError> {
    stream.write_all(&nbd::greeting()).await?;
    let client_flags = stream.read_u32().await?;
    if client_flags & !(nbd::CLIENT_FIXED_NEWSTYLE | nbd::CLIENT_NO_ZEROES) != 0
        || client_flags & nbd::CLIENT_FIXED_NEWSTYLE == 0
    {
        return Err(ConnError::Protocol(format!("client flags {client_flags:#x}")));
    }
    let no_zeroes = client_flags & nbd::CLIENT_NO_ZEROES != 0;
    let Some(acceptor) = tls else {
        return Ok(match haggle(&mut stream, blocks, no_zeroes, TlsState::Off, &mut false).await? {
            Haggled::Go(wire) => Some(Negotiated::Plain(stream, wire)),
            Haggled::End | Haggled::StartTls => None,
        });
    };
    // A connection's TLS refusals count once, whether options before STARTTLS or a
    // failed handshake, or both.
    let mut refused = false;
    match haggle(&mut stream, blocks, no_zeroes, TlsState::Required, &mut refused).await? {
        Haggled::StartTls => {}
        Haggled::Go(_) | Haggled::End => return Ok(None),
    }
    let mut stream = match acceptor.accept(stream).await {
        Ok(s) => s,
        Err(e) => {
            // No client certificate the cluster CA signed, or no TLS at all.
            if !refused {
                blocks.stats.tls_refused.fetch_add(1, Ordering::Relaxed);
            }
            return Err(ConnError::Tls(e.to_string()));
        }
    };
    Ok(match haggle(&mut stream, blocks, no_zeroes, TlsState::On, &mut refused).await? {
        Haggled::Go(wire) => Some(Negotiated::Tls(Box::new(stream), wire)),
        Haggled::End | Haggled::StartTls => None,
    })
}

/// TLS on this connection: not offered, required but not yet begun, or on.
#[derive(Clone, Copy, PartialEq, Eq)]
enum TlsState {
    Off,
    Required,
    On,
}

/// Option haggling (fixed newstyle), until the client chooses the export, aborts, or
/// (while TLS is required and not yet on) is told to begin TLS. `refused` says whether
/// this connection's TLS refusal was counted already.
async fn haggle<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    blocks: &Arc<Blocks>,
    no_zeroes: bool,
    tls: TlsState,
    refused: &mut bool,
) -> Result<Haggled, ConnError> {
    let size = blocks.size();
    let bs = blocks.local.geometry().block_size;
    // Starts afresh after STARTTLS, as the protocol asks (nothing is negotiated before
    // it here anyway: a port that requires TLS refuses every other option first).
    let mut wire = Wire::default();
    loop {
        // The last reply, all of it, before waiting for the client (a TLS stream may
        // hold back what the socket did not take).
        stream.flush().await?;
        let mut header = [0u8; 16];
        stream.read_exact(&mut header).await?;
        let (option, len) = nbd::decode_option(&header).map_err(|e| ConnError::Protocol(e.to_string()))?;
        if len > nbd::OPTION_DATA_MAX {
            return Err(ConnError::Protocol(format!("option data of {len} bytes")));
        }
        let mut data = vec![0u8; len as usize];
        stream.read_exact(&mut data).await?;
        if tls == TlsState::Required && !matches!(option, nbd::OPT_STARTTLS | nbd::OPT_ABORT) {
            if !*refused {
                *refused = true;
                blocks.stats.tls_refused.fetch_add(1, Ordering::Relaxed);
            }
            if option == nbd::OPT_EXPORT_NAME {
                // This option has no error reply: the NBD protocol says to disconnect.
                return Ok(Haggled::End);
            }
            stream.write_all(&nbd::option_reply(option, nbd::REP_ERR_TLS_REQD, b"this port requires TLS")).await?;
            continue;
        }
        match option {
            nbd::OPT_EXPORT_NAME => {
                if !known_export(&data) {
                    return Err(ConnError::Protocol("unknown export".into()));
                }
                stream.write_all(&size.to_be_bytes()).await?;
                stream.write_all(&transmission_flags(wire).to_be_bytes()).await?;
                if !no_zeroes {
                    stream.write_all(&[0u8; 124]).await?;
                }
                stream.flush().await?;
                return Ok(Haggled::Go(wire));
            }
            nbd::OPT_ABORT => {
                let _ = stream.write_all(&nbd::option_reply(option, nbd::REP_ACK, &[])).await;
                return Ok(Haggled::End);
            }
            nbd::OPT_LIST => {
                let reply = if data.is_empty() {
                    let mut r = nbd::option_reply(option, nbd::REP_SERVER, &nbd::server_entry(""));
                    r.extend(nbd::option_reply(option, nbd::REP_ACK, &[]));
                    r
                } else {
                    nbd::option_reply(option, nbd::REP_ERR_INVALID, b"NBD_OPT_LIST takes no data")
                };
                stream.write_all(&reply).await?;
            }
            nbd::OPT_INFO | nbd::OPT_GO => {
                let (reply, ok) = match nbd::decode_go(&data) {
                    Err(e) => (nbd::option_reply(option, nbd::REP_ERR_INVALID, e.to_string().as_bytes()), false),
                    Ok((name, _)) if !known_export(&name) => (
                        nbd::option_reply(option, nbd::REP_ERR_UNKNOWN, b"this server has one export: the default one"),
                        false,
                    ),
                    Ok((_, infos)) => {
                        let mut r =
                            nbd::option_reply(option, nbd::REP_INFO, &nbd::info_export(size, transmission_flags(wire)));
                        if infos.contains(&nbd::INFO_BLOCK_SIZE) {
                            r.extend(nbd::option_reply(
                                option,
                                nbd::REP_INFO,
                                &nbd::info_block_size(1, bs, nbd::PAYLOAD_MAX),
                            ));
                        }
                        if infos.contains(&nbd::INFO_DESCRIPTION) {
                            let text =
                                format!("Keel block store ({}), node {}", blocks.mode.name(), blocks.local.node());
                            r.extend(nbd::option_reply(
                                option,
                                nbd::REP_INFO,
                                &nbd::info_text(nbd::INFO_DESCRIPTION, &text),
                            ));
                        }
                        r.extend(nbd::option_reply(option, nbd::REP_ACK, &[]));
                        (r, true)
                    }
                };
                let go = option == nbd::OPT_GO && ok;
                stream.write_all(&reply).await?;
                if go {
                    stream.flush().await?;
                    return Ok(Haggled::Go(wire));
                }
            }
            nbd::OPT_STARTTLS => {
                let (reply, why): (u32, &[u8]) = match tls {
                    TlsState::Off => (nbd::REP_ERR_POLICY, b"TLS is not offered on this port"),
                    TlsState::On => (nbd::REP_ERR_INVALID, b"TLS is on already"),
                    TlsState::Required if !data.is_empty() => (nbd::REP_ERR_INVALID, b"NBD_OPT_STARTTLS takes no data"),
                    TlsState::Required => (nbd::REP_ACK, b""),
                };
                stream.write_all(&nbd::option_reply(option, reply, why)).await?;
                if reply == nbd::REP_ACK {
                    stream.flush().await?;
                    return Ok(Haggled::StartTls);
                }
            }
            nbd::OPT_STRUCTURED_REPLY => {
                let reply = if !data.is_empty() {
                    nbd::option_reply(option, nbd::REP_ERR_INVALID, b"NBD_OPT_STRUCTURED_REPLY takes no data")
                } else if wire.structured {
                    nbd::option_reply(option, nbd::REP_ERR_INVALID, b"structured replies are on already")
                } else {
                    wire.structured = true;
                    nbd::option_reply(option, nbd::REP_ACK, &[])
                };
                stream.write_all(&reply).await?;
            }
            nbd::OPT_LIST_META_CONTEXT | nbd::OPT_SET_META_CONTEXT => {
                let (reply, allocation) = meta_contexts(option, &data, wire);
                if option == nbd::OPT_SET_META_CONTEXT {
                    // Replaces what an earlier one selected, even when it fails.
                    wire.allocation = allocation;
                }
                stream.write_all(&reply).await?;
            }
            other => {
                stream.write_all(&nbd::option_reply(other, nbd::REP_ERR_UNSUP, &[])).await?;
            }
        }
    }
}

/// Bytes of replies one connection's writer gathers before it writes them out.
const REPLY_GATHER_BYTES: usize = 256 << 10;

/// The transmission phase: a reader that parses requests and runs each as a task, and
/// a writer that sends the replies as they finish.
async fn transmission<R, W>(mut rd: R, wr: W, blocks: &Arc<Blocks>, wire: Wire) -> Result<(), ConnError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin + Send + 'static,
{
    // Each reply travels with the byte budget its request took, released once written.
    let (reply_tx, mut reply_rx) = mpsc::channel::<(Vec<u8>, tokio::sync::OwnedSemaphorePermit)>(IN_FLIGHT);
    let writer = tokio::spawn(async move {
        // Replies that finished together leave together: whatever else is queued when
        // one is taken joins it in one buffer and one flush, so a burst of small reads
        // costs one socket write (and one TLS flush) rather than one per reply. The
        // client waits for each reply, so nothing waits for more to come.
        let mut wr = tokio::io::BufWriter::with_capacity(REPLY_GATHER_BYTES, wr);
        let mut budgets = Vec::new();
        while let Some(mut next) = reply_rx.recv().await {
            let mut written = Ok(());
            loop {
                let (bytes, budget) = next;
                budgets.push(budget);
                if let Err(e) = wr.write_all(&bytes).await {
                    written = Err(e);
                    break;
                }
                if wr.buffer().len() >= REPLY_GATHER_BYTES / 2 {
                    break;
                }
                match reply_rx.try_recv() {
                    Ok(more) => next = more,
                    Err(_) => break,
                }
            }
            // Flushed too: a TLS stream may hold back what the socket did not take.
            if written.is_ok() {
                written = wr.flush().await;
            }
            // The budget covers a reply's bytes until they have left.
            budgets.clear();
            if written.is_err() {
                return;
            }
        }
        let _ = wr.shutdown().await;
    });
    let slots = Arc::new(Semaphore::new(IN_FLIGHT));
    let size = blocks.size();
    let result = loop {
        let mut header = [0u8; nbd::REQUEST_LEN];
        if let Err(e) = rd.read_exact(&mut header).await {
            break if e.kind() == std::io::ErrorKind::UnexpectedEof { Ok(()) } else { Err(e.into()) };
        }
        let request = match nbd::decode_request(&header) {
            Ok(r) => r,
            Err(e) => {
                blocks.stats.malformed.fetch_add(1, Ordering::Relaxed);
                break Err(ConnError::Protocol(e.to_string()));
            }
        };
        let mut payload = Vec::new();
        if request.cmd == Cmd::Write && request.length > nbd::PAYLOAD_MAX {
            blocks.stats.malformed.fetch_add(1, Ordering::Relaxed);
            break Err(ConnError::Protocol(format!("a write of {} bytes", request.length)));
        }
        // The data this request will hold (a write's payload, a read's reply), taken
        // from the node's budget before any of it is read or allocated.
        let holds = matches!(request.cmd, Cmd::Read | Cmd::Write) && request.length <= nbd::PAYLOAD_MAX;
        let kib = if holds { (request.length as usize).div_ceil(1024).max(1) } else { 1 };
        let Ok(budget) = blocks.bytes.clone().acquire_many_owned(kib as u32).await else { break Ok(()) };
        if request.cmd == Cmd::Write {
            payload = vec![0u8; request.length as usize];
            if let Err(e) = rd.read_exact(&mut payload).await {
                // Disconnected mid-write: nothing of it was sent to the cluster.
                break Err(e.into());
            }
        }
        if request.cmd == Cmd::Disc {
            break Ok(());
        }
        let Ok(permit) = slots.clone().acquire_owned().await else { break Ok(()) };
        let (blocks, tx) = (blocks.clone(), reply_tx.clone());
        tokio::spawn(async move {
            let reply = run(&blocks, request, payload, size, wire).await;
            let _ = tx.send((reply, budget)).await;
            drop(permit);
        });
    };
    // Let the requests in flight finish and their replies go out (DISC, or EOF).
    let _ = slots.acquire_many(IN_FLIGHT as u32).await;
    drop(reply_tx);
    let _ = writer.await;
    result
}

/// What a request that succeeded answers besides "done".
enum Answer {
    Done,
    Data(Vec<u8>),
    Extents(Vec<(u32, u32)>),
}

/// Runs one request and returns its reply's bytes: simple replies, but a READ's and a
/// BLOCK_STATUS's in structured chunks once the client negotiated them (a READ must not
/// get a simple reply then, not even an error).
async fn run(blocks: &Blocks, r: nbd::Request, payload: Vec<u8>, size: u64, wire: Wire) -> Vec<u8> {
    let in_range = r.offset.checked_add(u64::from(r.length)).is_some_and(|end| end <= size);
    let outcome: Result<Answer, u32> = match r.cmd {
        Cmd::Read if r.length > nbd::PAYLOAD_MAX || !in_range => Err(nbd::EINVAL),
        Cmd::Write | Cmd::WriteZeroes | Cmd::Trim if !in_range => Err(nbd::ENOSPC),
        Cmd::BlockStatus if wire.allocation.is_none() => {
            // No context was selected: the protocol forbids the command.
            blocks.stats.malformed.fetch_add(1, Ordering::Relaxed);
            Err(nbd::EINVAL)
        }
        Cmd::BlockStatus if r.length == 0 || !in_range => Err(nbd::EINVAL),
        Cmd::Read => {
            blocks.stats.reads.fetch_add(1, Ordering::Relaxed);
            blocks.read(r.offset, u64::from(r.length)).await.map(Answer::Data).map_err(|e| report(blocks, &r, &e))
        }
        Cmd::BlockStatus => {
            let one = r.flags & nbd::CMD_FLAG_REQ_ONE != 0;
            blocks.extents(r.offset, r.length, one).await.map(Answer::Extents).map_err(|e| report(blocks, &r, &e))
        }
        Cmd::Write => {
            blocks.stats.writes.fetch_add(1, Ordering::Relaxed);
            blocks.write(r.offset, &payload).await.map(|()| Answer::Done).map_err(|e| report(blocks, &r, &e))
        }
        // A fast zero too: zeroing is metadata only, never slower than writing zeros.
        Cmd::WriteZeroes | Cmd::Trim => {
            blocks.zero(r.offset, u64::from(r.length)).await.map(|()| Answer::Done).map_err(|e| report(blocks, &r, &e))
        }
        // Every completed write is durable already.
        Cmd::Flush => Ok(Answer::Done),
        Cmd::Disc => Ok(Answer::Done),
        Cmd::Cache | Cmd::Other(_) => {
            blocks.stats.malformed.fetch_add(1, Ordering::Relaxed);
            Err(nbd::EINVAL)
        }
    };
    let chunked = wire.structured && matches!(r.cmd, Cmd::Read | Cmd::BlockStatus);
    match outcome {
        Ok(Answer::Done) => nbd::simple_reply(r.cookie, 0).to_vec(),
        Ok(Answer::Data(d)) if chunked => nbd::read_chunk(r.cookie, r.offset, &d),
        Ok(Answer::Data(d)) => {
            let mut out = Vec::with_capacity(16 + d.len());
            out.extend_from_slice(&nbd::simple_reply(r.cookie, 0));
            out.extend_from_slice(&d);
            out
        }
        Ok(Answer::Extents(e)) => nbd::block_status_chunk(r.cookie, wire.allocation.unwrap_or(ALLOCATION_ID), &e),
        Err(errno) if chunked => nbd::error_chunk(r.cookie, errno),
        Err(errno) => nbd::simple_reply(r.cookie, errno).to_vec(),
    }
}

fn report(blocks: &Blocks, r: &nbd::Request, e: &OpError) -> u32 {
    blocks.stats.errors.fetch_add(1, Ordering::Relaxed);
    tracing::warn!(cmd = ?r.cmd, offset = r.offset, length = r.length, error = ?e, "NBD request failed");
    e.errno()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each acknowledgement lands in its node's bucket (bounds inclusive, the last one
    /// unbounded) and its sum; a node that never answered, or is no member, shows nothing.
    #[test]
    fn ack_times_count_per_node_and_bucket() {
        let acks = AckTimes::new(&[NodeId(1), NodeId(2), NodeId(3)]);
        acks.record(NodeId(1), Duration::from_micros(250));
        acks.record(NodeId(1), Duration::from_millis(3));
        acks.record(NodeId(2), Duration::from_secs(1));
        acks.record(NodeId(9), Duration::from_millis(1));
        let snap = acks.snapshot();
        assert_eq!(snap.iter().map(|(n, _)| *n).collect::<Vec<_>>(), vec![NodeId(1), NodeId(2)]);
        let mut one = [0u64; ACK_BUCKETS.len() + 1];
        one[0] = 1; // 250 µs: the first bound is inclusive
        one[4] = 1; // 3 ms: in (2 ms, 5 ms]
        assert_eq!(snap[0].1.buckets, one);
        assert!((snap[0].1.sum_seconds - 0.003_25).abs() < 1e-9);
        assert_eq!(snap[1].1.buckets[ACK_BUCKETS.len()], 1);
    }
}
