//! Gnothi's recovery phase 2 (§3.4.2) and reserve collection (§3.4), as a background
//! task of every node's front end.
//!
//! Phase 1 (the metadata) is the platform's: a restarted node replays its WAL, and one
//! that fell behind or lost its disk takes a checkpoint by state transfer; the node
//! serves reads and writes as soon as that ends. Phase 2 then walks this node's
//! preferred blocks and fetches those it does not hold at their agreed version from
//! peers, each checked against the agreed hash (a peer that sends wrong bytes is
//! reported and another one asked), throttled to `recovery_mbps`. A node whose disk was
//! wiped rebuilds all its slices this way.
//!
//! Reserve collection: a block this node holds outside its preferred set is dropped
//! once every preferred node says it holds the agreed version (at most r of them lie,
//! so u + 1 correct copies remain); a copy of a newer version stored since stays. It is
//! paced (`COLLECT_PACE`). The disk space of a stripe that then holds nothing here is
//! given back by a hole punch later (`reclaim`), slowly while the cluster is busy: a
//! punch holds the store lock for milliseconds.

use crate::front::Blocks;
use crate::geometry::runs;
use crate::meta::{Hash, REGION_BLOCKS};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

/// Blocks fetched per round trip.
const RUN_BLOCKS: u64 = 256;
/// Pause between scans when there is nothing to do.
const IDLE: Duration = Duration::from_secs(1);
/// While reads or writes run, the least time between two stripes punched out.
const RECLAIM_BUSY_GAP: Duration = Duration::from_secs(1);
/// Reserve collection rests this many times as long as it spent dropping blocks, so it
/// takes at most 1 / (1 + COLLECT_PACE) of the store's time.
const COLLECT_PACE: u32 = 9;

/// Phase 2's progress, shown in `keel status` and the metrics.
#[derive(Default)]
pub struct Recovery {
    /// The throttle (MB/s of block data fetched; 0: none).
    pub mbps: u64,
    /// Preferred blocks this node does not hold at their agreed version (last scan).
    pub incomplete: AtomicU64,
    /// Blocks re-replicated, and their bytes.
    pub repaired: AtomicU64,
    pub repaired_bytes: AtomicU64,
    /// Blocks no peer could supply in the last scan (retried at the next).
    pub unavailable: AtomicU64,
    /// Reserve blocks dropped because their preferred nodes hold them.
    pub reserve_collected: AtomicU64,
    /// Bytes of disk given back by punching out stripes that hold nothing here.
    pub reclaimed_bytes: AtomicU64,
    /// 1 + `Local::released` when the last whole reclaim pass began (0: none yet, so
    /// the first pass after a start looks at every stripe).
    reclaimed_at: AtomicU64,
    /// Whether the last scan found nothing to re-replicate.
    pub complete: AtomicBool,
    /// Scans finished (`incomplete` means something once there was one).
    pub scans: AtomicU64,
    /// Regions a scan looked at block by block (the others were complete and unwritten
    /// since).
    pub regions_scanned: AtomicU64,
}

impl Recovery {
    pub fn new(mbps: u64) -> Arc<Recovery> {
        Arc::new(Recovery { mbps, ..Recovery::default() })
    }

    /// Runs until the front end's runtime ends.
    pub async fn run(self: Arc<Self>, blocks: Arc<Blocks>) {
        let mut was_complete = true;
        let mut clean = Vec::new();
        loop {
            let started = Instant::now();
            let fetched = self.phase2(&blocks, &mut clean).await;
            let complete = self.incomplete.load(Ordering::Relaxed) == 0;
            self.complete.store(complete, Ordering::Relaxed);
            if complete && !was_complete {
                tracing::info!(
                    node = blocks.local.node().0,
                    "recovery phase 2 done: every preferred block held at its agreed version"
                );
            } else if !complete && was_complete {
                tracing::info!(
                    node = blocks.local.node().0,
                    incomplete = self.incomplete.load(Ordering::Relaxed),
                    "recovery phase 2: re-replicating INCOMPLETE preferred blocks"
                );
            }
            was_complete = complete;
            self.collect_reserve(&blocks).await;
            self.reclaim(&blocks).await;
            if fetched == 0 {
                tokio::time::sleep(IDLE.saturating_sub(started.elapsed())).await;
            }
        }
    }

    /// One pass over the preferred blocks; returns the blocks fetched. `clean` holds,
    /// per region, the gap it had when a pass last found it complete: such a region is
    /// skipped while its gap stays (a preferred block becomes INCOMPLETE only by a write
    /// that left it without data here, or a restore: `Local::gap_of`), so a pass over a
    /// large export costs a look at each region's gap, however much is written into it
    /// with its data.
    async fn phase2(&self, blocks: &Blocks, clean: &mut Vec<Option<u64>>) -> u64 {
        let g = blocks.local.geometry();
        let me = blocks.local.index();
        let bs = u64::from(g.block_size);
        let mut incomplete = 0u64;
        let mut unavailable = 0u64;
        let mut fetched = 0u64;
        let throttle_start = Instant::now();
        let mut region = 0u64;
        clean.resize(g.blocks.div_ceil(REGION_BLOCKS as u64) as usize, None);
        while region < g.blocks {
            let end = (region + REGION_BLOCKS as u64).min(g.blocks);
            let index = (region / REGION_BLOCKS as u64) as usize;
            let stamp = blocks.local.gap_of(index);
            if clean[index] == Some(stamp) {
                region = end;
                continue;
            }
            self.regions_scanned.fetch_add(1, Ordering::Relaxed);
            // Read before the metadata: a write after this gap moves it, so the region is
            // not taken for complete on a view older than the gap says.
            let (want, zero) = self.meta_of(blocks, region, end);
            let missing: Vec<u64> = (region..end)
                .filter(|&b| {
                    let (v, h) = want[(b - region) as usize];
                    g.is_preferred(b, me) && h != zero && blocks.local.store().held(b) != v
                })
                .collect();
            incomplete += missing.len() as u64;
            let mut left = missing.len() as u64;
            for (first, count) in runs(missing.iter().copied(), RUN_BLOCKS) {
                let lookup = |b: u64| want[(b - region) as usize];
                let found = blocks.fetch_run(first, count, &lookup, None).await;
                let got = found.iter().filter(|f| f.is_data()).count() as u64;
                unavailable += found.iter().filter(|f| f.is_nowhere()).count() as u64;
                fetched += got;
                incomplete -= got;
                left -= got;
                self.repaired.fetch_add(got, Ordering::Relaxed);
                self.repaired_bytes.fetch_add(got * bs, Ordering::Relaxed);
                if self.mbps > 0 {
                    // Hold the average rate of this pass to the throttle.
                    let due = Duration::from_secs_f64((fetched * bs) as f64 / (self.mbps as f64 * 1e6));
                    if let Some(wait) = due.checked_sub(throttle_start.elapsed()) {
                        tokio::time::sleep(wait).await;
                    }
                }
            }
            clean[index] = (left == 0).then_some(stamp);
            region = end;
            // A region's metadata is a scan of the store (0.5 ms or more for 4,096
            // blocks), and the task shares the node's thread: a pass over every region
            // after a restart held the node off its peers and clients for 1.4 s at 4M
            // blocks. Each region is a turn of its own.
            tokio::task::yield_now().await;
        }
        self.incomplete.store(incomplete, Ordering::Relaxed);
        self.unavailable.store(unavailable, Ordering::Relaxed);
        self.scans.fetch_add(1, Ordering::Relaxed);
        fetched
    }

    fn meta_of(&self, blocks: &Blocks, first: u64, end: u64) -> (Vec<(u64, Hash)>, Hash) {
        let meta = blocks.meta.read().unwrap_or_else(PoisonError::into_inner);
        (meta.get_run(first, end - first), meta.zero())
    }

    /// Drops reserve blocks whose preferred nodes all hold the agreed version.
    ///
    /// Each preferred node is asked once per stripe, for the span from its first to its
    /// last block held here: random writes leave reserve copies one or two blocks apart,
    /// and a question per run of consecutive blocks was thousands of round trips per
    /// pass on the links that carry PrepareData (session 45).
    async fn collect_reserve(&self, blocks: &Blocks) {
        let g = blocks.local.geometry();
        let me = blocks.local.index();
        if blocks.local.reserve().0 == 0 {
            return;
        }
        let mut region = 0u64;
        while region < g.blocks {
            let end = (region + REGION_BLOCKS as u64).min(g.blocks);
            // The region's metadata is read (a scan of the store) only if it holds
            // reserve copies here; after that, a turn of its own, as in phase 2.
            let mut want: Option<Vec<(u64, Hash)>> = None;
            let mut stripe = region;
            while stripe < end {
                let stop = g.stripe_end(stripe, end);
                let (from, to) = (stripe, stop);
                stripe = stop;
                if g.is_preferred(from, me) {
                    continue;
                }
                let store = blocks.local.store();
                let Some(first) = (from..to).find(|&b| store.held(b) != 0) else { continue };
                let Some(last) = (first..to).rev().find(|&b| store.held(b) != 0) else { continue };
                let count = last + 1 - first;
                if want.is_none() {
                    want = Some(self.meta_of(blocks, region, end).0);
                    tokio::task::yield_now().await;
                }
                let Some(want) = want.as_ref() else { continue };
                let agreed = |b: u64| want[(b - region) as usize].0;
                let mut confirmed = vec![0u32; count as usize];
                for index in g.preferred(first) {
                    let Some(&node) = blocks.members.get(index as usize) else { continue };
                    let (id, rx) = blocks.peers.held(node, first, count as u32);
                    let answer = tokio::time::timeout(Duration::from_secs(2), rx).await;
                    blocks.peers.forget_held(node, id);
                    let Ok(Ok(versions)) = answer else { continue };
                    if versions.len() as u64 != count {
                        continue;
                    }
                    for (k, v) in versions.iter().enumerate() {
                        if *v == agreed(first + k as u64) {
                            confirmed[k] += 1;
                        }
                    }
                }
                let versions: Vec<u64> = (first..=last)
                    .zip(&confirmed)
                    .map(|(b, &c)| if c >= g.copies && store.held(b) != 0 { agreed(b) } else { 0 })
                    .collect();
                if versions.iter().all(|&v| v == 0) {
                    continue;
                }
                let started = Instant::now();
                let dropped = blocks.local.collect_reserve(first, &versions);
                self.reserve_collected.fetch_add(dropped, Ordering::Relaxed);
                // Paced: a drop holds the store lock that this node's writes and reads
                // wait for, and collection is never urgent.
                tokio::time::sleep(started.elapsed() * COLLECT_PACE).await;
            }
            region = end;
        }
    }

    /// Punches out, in the stripes outside this node's preferred set, what reserve copies
    /// released by `collect_reserve` or by a later write left on disk: a stripe that holds
    /// nothing here whole, and long released runs around the copies one still holds
    /// (`Local::reclaim_stripe`). While reads or writes run, at most one stripe per
    /// `RECLAIM_BUSY_GAP`: a punch holds the store lock for milliseconds, and the space
    /// can wait.
    async fn reclaim(&self, blocks: &Blocks) {
        let g = blocks.local.geometry();
        // Nothing released since the last whole pass: nothing new to give back.
        let mark = blocks.local.released().wrapping_add(1);
        if self.reclaimed_at.load(Ordering::Relaxed) == mark {
            return;
        }
        let mut b = 0u64;
        while b < g.blocks {
            let stripe = b;
            b = g.stripe_end(stripe, g.blocks);
            let started = Instant::now();
            match blocks.local.reclaim_stripe(stripe) {
                Ok(0) => {}
                Ok(punched) => {
                    self.reclaimed_bytes.fetch_add(punched * g.bs() as u64, Ordering::Relaxed);
                    // Busy means reads or writes ran during the rest after a punch: the
                    // punch itself holds them up, so what moves during it says nothing.
                    let rest = started.elapsed() * COLLECT_PACE;
                    let seen = foreground(blocks);
                    tokio::time::sleep(rest).await;
                    if foreground(blocks) != seen {
                        tokio::time::sleep(RECLAIM_BUSY_GAP.saturating_sub(rest)).await;
                    }
                }
                Err(e) => {
                    tracing::warn!(first = stripe, error = %e, "giving back a stripe's released disk space failed");
                    return;
                }
            }
        }
        self.reclaimed_at.store(mark, Ordering::Relaxed);
    }
}

/// A count that moves whenever this node serves a read or a write, or takes part in one
/// (every write is ordered on every node).
fn foreground(blocks: &Blocks) -> u64 {
    let (l, f) = (&blocks.local.stats, &blocks.stats);
    [&l.prepares, &l.writes_complete, &l.writes_incomplete, &f.reads, &f.writes]
        .iter()
        .map(|c| c.load(Ordering::Relaxed))
        .fold(0u64, u64::wrapping_add)
}
