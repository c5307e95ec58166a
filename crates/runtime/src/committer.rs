//! The WAL thread: group commit off the protocol task.
//!
//! ```text
//!  protocol task ──► Job { records, lazy, gated messages } ──► bounded queue
//!  WAL thread: take every queued job, write them all, ONE fsync, then release the
//!              gated messages of all of them (votes, replies, view changes)
//! ```
//!
//! The protocol task never waits for the disk: while one fsync runs it keeps stepping
//! inputs, and everything those steps persist joins the next fsync. Jobs are handled in
//! order, so a gated message is released only once every record persisted before it (in
//! its own job and in earlier ones) is durable — the contract of
//! `Outputs::send_after_persist`. A storage failure stops the node: a node that cannot
//! persist must not answer.
//!
//! Snapshots go to a second thread (`keel-snap`). A snapshot is the whole state, and
//! writing one of hundreds of MB took seconds on the WAL thread, where every vote of
//! every instance waited for it. Now only its own job's messages wait (the checkpoint
//! vote, sent once the snapshot is durable); later jobs are released as their records
//! are, possibly before it. That is safe because nothing but the vote speaks for the
//! snapshot: until it is durable the log still holds every record it summarizes, and a
//! compaction, which drops those records, first waits for every snapshot submitted
//! before it.

use crate::storage::{Storage, StorageError};
use crate::transport::{offer, TransportStats};
use keel_core::codec;
use keel_core::message::Message;
use keel_core::replica::Persist;
use keel_core::wal::Record;
use prometheus_client::metrics::histogram::Histogram;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;

/// Jobs queued for the WAL thread. Each flush of the protocol task is one job, and the
/// thread takes all queued jobs per fsync, so the queue is short unless the disk stalls;
/// then the protocol task waits here (backpressure) instead of buffering without bound.
const JOBS_MAX: usize = 256;

/// Snapshot writes and deferred releases queued for the snapshot thread. Each snapshot
/// is the whole state (shared, not copied), so a disk that cannot keep up with the
/// checkpoints makes the WAL thread wait here rather than hold many of them.
const SNAP_JOBS_MAX: usize = 4;

/// A gated message with the queue of the connection it goes to.
/// A message to send once its records are durable: the queue, the message, and for a
/// node the sender's membership epoch (the frame's tag, transport::node_frame).
pub type Gated = (mpsc::Sender<Vec<u8>>, Message, Option<u64>);

struct Job {
    persist: Vec<Persist>,
    lazy: Vec<Record>,
    gated: Vec<Gated>,
}

/// The protocol task's end.
pub struct Committer {
    jobs: SyncSender<Job>,
    submitted: u64,
    done: Arc<AtomicU64>,
    /// Set by the thread when storage failed; the node must stop.
    failed: mpsc::Receiver<StorageError>,
}

impl Committer {
    /// Starts the WAL thread, which owns `storage` from now on.
    ///
    /// # Errors
    /// If the thread cannot be spawned.
    pub fn start(storage: Storage, stats: Arc<TransportStats>, fsync_seconds: Histogram) -> std::io::Result<Committer> {
        let (jobs, rx) = sync_channel(JOBS_MAX);
        let done = Arc::new(AtomicU64::new(0));
        let (fail_tx, failed) = mpsc::channel(2);
        let snap =
            SnapWriter::start(storage.snapshot_dir().to_path_buf(), done.clone(), stats.clone(), fail_tx.clone())?;
        let thread_done = done.clone();
        std::thread::Builder::new().name("keel-wal".into()).spawn(move || {
            if let Err(e) = run(storage, snap, rx, &thread_done, &stats, &fsync_seconds) {
                let _ = fail_tx.try_send(e);
            }
        })?;
        Ok(Committer { jobs, submitted: 0, done, failed })
    }

    /// Whether every job handed over so far is durable and released.
    pub fn idle(&self) -> bool {
        self.done.load(Ordering::Acquire) == self.submitted
    }

    /// Hands over one flush. `gated` messages are sent once `persist` and everything
    /// submitted before is durable; `lazy` records are written but waited for by nobody.
    ///
    /// # Errors
    /// The storage error that stopped the WAL thread.
    pub fn submit(&mut self, persist: Vec<Persist>, lazy: Vec<Record>, gated: Vec<Gated>) -> Result<(), StorageError> {
        let job = Job { persist, lazy, gated };
        match self.jobs.try_send(job) {
            Ok(()) => {}
            // The disk is behind: wait for it rather than queue without bound.
            Err(TrySendError::Full(job)) => {
                let multi = tokio::runtime::Handle::try_current()
                    .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
                let sent =
                    if multi { tokio::task::block_in_place(|| self.jobs.send(job)) } else { self.jobs.send(job) };
                if sent.is_err() {
                    return Err(self.failure());
                }
            }
            Err(TrySendError::Disconnected(_)) => return Err(self.failure()),
        }
        self.submitted += 1;
        Ok(())
    }

    /// Resolves when the WAL thread has failed.
    pub async fn failed(&mut self) -> StorageError {
        match self.failed.recv().await {
            Some(e) => e,
            None => std::future::pending().await,
        }
    }

    fn failure(&mut self) -> StorageError {
        self.failed.try_recv().unwrap_or(StorageError::Stopped)
    }
}

/// Sends a gated message's frame to its connection.
fn release(gated: Vec<Gated>, stats: &TransportStats) {
    for (tx, msg, epoch) in gated {
        let frame = match epoch {
            Some(epoch) => crate::transport::node_frame(epoch, &msg),
            None => codec::encode(&msg),
        };
        offer(&tx, frame, stats);
    }
}

enum SnapJob {
    Write {
        seq: u64,
        bytes: Arc<Vec<u8>>,
    },
    /// A job's gated messages, released once the snapshots queued before are durable.
    Release(Vec<Gated>),
}

/// The WAL thread's handle on the snapshot thread.
struct SnapWriter {
    tx: SyncSender<SnapJob>,
    submitted: u64,
    /// Snapshots written so far, and a wake-up for a compaction waiting on them.
    written: Arc<(Mutex<u64>, Condvar)>,
    failed: Arc<AtomicBool>,
}

impl SnapWriter {
    fn start(
        dir: PathBuf,
        done: Arc<AtomicU64>,
        stats: Arc<TransportStats>,
        fail_tx: mpsc::Sender<StorageError>,
    ) -> std::io::Result<SnapWriter> {
        let (tx, rx) = sync_channel::<SnapJob>(SNAP_JOBS_MAX);
        let written = Arc::new((Mutex::new(0u64), Condvar::new()));
        let failed = Arc::new(AtomicBool::new(false));
        let (w, f) = (written.clone(), failed.clone());
        std::thread::Builder::new().name("keel-snap".into()).spawn(move || {
            while let Ok(job) = rx.recv() {
                match job {
                    SnapJob::Write { seq, bytes } => {
                        if let Err(e) = crate::storage::write_snapshot(&dir, seq, &bytes) {
                            f.store(true, Ordering::Release);
                            w.1.notify_all();
                            let _ = fail_tx.try_send(e);
                            return;
                        }
                        let (count, wake) = &*w;
                        *count.lock().unwrap_or_else(|p| p.into_inner()) += 1;
                        wake.notify_all();
                    }
                    SnapJob::Release(gated) => {
                        release(gated, &stats);
                        done.fetch_add(1, Ordering::Release);
                    }
                }
            }
        })?;
        Ok(SnapWriter { tx, submitted: 0, written, failed })
    }

    fn send(&self, job: SnapJob) -> Result<(), StorageError> {
        self.tx.send(job).map_err(|_| StorageError::Stopped)
    }

    fn write(&mut self, seq: u64, bytes: Arc<Vec<u8>>) -> Result<(), StorageError> {
        self.send(SnapJob::Write { seq, bytes })?;
        self.submitted += 1;
        Ok(())
    }

    /// Waits until every snapshot submitted so far is durable.
    fn wait(&self) -> Result<(), StorageError> {
        let (count, wake) = &*self.written;
        let mut written = count.lock().unwrap_or_else(|p| p.into_inner());
        while *written < self.submitted {
            if self.failed.load(Ordering::Acquire) {
                return Err(StorageError::Stopped);
            }
            written = wake.wait_timeout(written, Duration::from_millis(100)).unwrap_or_else(|p| p.into_inner()).0;
        }
        Ok(())
    }
}

fn run(
    mut storage: Storage,
    mut snap: SnapWriter,
    rx: Receiver<Job>,
    done: &AtomicU64,
    stats: &TransportStats,
    fsync_seconds: &Histogram,
) -> Result<(), StorageError> {
    while let Ok(first) = rx.recv() {
        let mut jobs = vec![first];
        while let Ok(more) = rx.try_recv() {
            jobs.push(more);
        }
        let eager = jobs.iter().any(|j| j.persist.iter().any(|p| matches!(p, Persist::Record(_))));
        // Per job: whether its messages wait for a snapshot.
        let mut deferred = Vec::with_capacity(jobs.len());
        for j in &mut jobs {
            let mut snapshot = false;
            for p in std::mem::take(&mut j.persist) {
                match p {
                    Persist::Snapshot { seq, bytes } => {
                        snap.write(seq, bytes)?;
                        snapshot = true;
                    }
                    Persist::Compact { .. } => {
                        // It drops the records that earlier snapshots summarize.
                        snap.wait()?;
                        storage.write(std::slice::from_ref(&p))?;
                    }
                    Persist::Record(_) => storage.write(std::slice::from_ref(&p))?,
                }
            }
            storage.append_lazy(&j.lazy)?;
            deferred.push(snapshot);
        }
        if eager {
            let took = storage.sync()?;
            if !took.is_zero() {
                fsync_seconds.observe(took.as_secs_f64());
            }
        }
        let mut released = 0;
        for (j, snapshot) in jobs.into_iter().zip(deferred) {
            if snapshot {
                // Behind its snapshot on the snapshot thread, which counts it done.
                snap.send(SnapJob::Release(j.gated))?;
            } else {
                release(j.gated, stats);
                released += 1;
            }
        }
        done.fetch_add(released, Ordering::Release);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::FsyncPolicy;
    use keel_core::replica::Durable;

    fn view(v: u64) -> Record {
        Record::View { view: v, floor: 0 }
    }

    fn views(d: &Durable) -> Vec<u64> {
        d.records.iter().filter_map(|r| if let Record::View { view, .. } = r { Some(*view) } else { None }).collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn gated_messages_follow_their_records_in_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (storage, _) = Storage::open(dir.path(), FsyncPolicy::Batch).expect("open");
        let stats = Arc::new(TransportStats::default());
        let mut c = Committer::start(storage, stats, Histogram::new([0.001].into_iter())).expect("start");
        let (tx, mut rx) = mpsc::channel(16);
        let a = Message::Stop { view: 1 };
        let b = Message::Stop { view: 2 };
        c.submit(vec![Persist::Record(view(1))], vec![view(2)], vec![(tx.clone(), a.clone(), None)]).expect("submit");
        // No record of its own, but it must not overtake the first job's.
        c.submit(Vec::new(), Vec::new(), vec![(tx, b.clone(), None)]).expect("submit");
        let first = rx.recv().await.expect("released");
        let second = rx.recv().await.expect("released");
        assert_eq!(codec::decode(&first).expect("decodes"), a);
        assert_eq!(codec::decode(&second).expect("decodes"), b);
        while !c.idle() {
            tokio::task::yield_now().await;
        }
        // Released means written (and, for the eager record, synced) first.
        let (_, durable) = Storage::open(dir.path(), FsyncPolicy::Batch).expect("reopen");
        assert_eq!(views(&durable), vec![1, 2], "eager and lazy records both written, in order");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_checkpoint_vote_waits_for_its_snapshot_and_a_compaction_for_every_snapshot() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (storage, _) = Storage::open(dir.path(), FsyncPolicy::Batch).expect("open");
        let snap_dir = storage.snapshot_dir().to_path_buf();
        let stats = Arc::new(TransportStats::default());
        let mut c = Committer::start(storage, stats, Histogram::new([0.001].into_iter())).expect("start");
        let (tx, mut rx) = mpsc::channel(16);
        // 64 MiB: long enough to write that the next job's message could overtake it.
        let bytes = Arc::new(vec![7u8; 64 << 20]);
        let vote = Message::Stop { view: 1 };
        let other = Message::Stop { view: 2 };
        c.submit(
            vec![Persist::Record(view(1)), Persist::Snapshot { seq: 8, bytes: bytes.clone() }],
            Vec::new(),
            vec![(tx.clone(), vote.clone(), None)],
        )
        .expect("submit");
        c.submit(vec![Persist::Record(view(2))], Vec::new(), vec![(tx.clone(), other.clone(), None)]).expect("submit");
        let mut got = Vec::new();
        for _ in 0..2 {
            let frame = rx.recv().await.expect("released");
            let msg = codec::decode(&frame).expect("decodes");
            if msg == vote {
                // Released means the snapshot is durable and complete.
                let on_disk = std::fs::read(snap_dir.join(format!("{:016}.snap", 8))).expect("snapshot written");
                assert_eq!(on_disk.len(), bytes.len());
            }
            got.push(msg);
        }
        assert!(got.contains(&vote) && got.contains(&other), "{got:?}");
        // A compaction right behind a snapshot (a state transfer's install) waits for it.
        let big = Arc::new(vec![9u8; 32 << 20]);
        c.submit(
            vec![
                Persist::Snapshot { seq: 16, bytes: big.clone() },
                Persist::Compact { records: vec![view(3)], snapshots_from: 16 },
            ],
            Vec::new(),
            vec![(tx, Message::Stop { view: 3 }, None)],
        )
        .expect("submit");
        // The compacted log must never exist without the snapshot it relies on: a crash
        // in between would lose both the records and the state they summarize.
        let wal_dir = dir.path().join("wal");
        let compacted = || {
            std::fs::read_dir(&wal_dir)
                .expect("wal dir")
                .filter_map(Result::ok)
                .any(|e| e.file_name().to_string_lossy().ends_with(".base.log"))
        };
        while !compacted() {
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
        assert!(snap_dir.join(format!("{:016}.snap", 16)).exists(), "compacted before the snapshot was durable");
        rx.recv().await.expect("released");
        while !c.idle() {
            tokio::task::yield_now().await;
        }
        let (_, durable) = Storage::open(dir.path(), FsyncPolicy::Batch).expect("reopen");
        assert_eq!(views(&durable), vec![3], "the log is the compacted one");
        let newest = durable.snapshots.iter().map(|(s, b)| (*s, b.len())).max();
        assert_eq!(newest, Some((16, big.len())), "the snapshot the compaction kept is whole");
    }
}
