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
//! With `fsync = never` there is no fsync to wait for: "durable" means written to the
//! file. A job of records only, handed over while the thread has nothing queued, is then
//! written by the protocol task itself and its messages sent at once (order holds:
//! everything before it is written already). That saves each flush a hand-off to the
//! thread and back (a channel, a futex wake and a context switch; about 5 % of a BFT
//! node's CPU at 64 clients). Snapshots and compactions, which fsync whatever the
//! policy, still go to the thread.

use crate::metrics::Metrics;
use crate::storage::{FsyncPolicy, Storage, StorageError};
use crate::transport::{offer, TransportStats};
use keel_core::codec;
use keel_core::message::Message;
use keel_core::replica::Persist;
use keel_core::wal::Record;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;

/// Jobs queued for the WAL thread. Each flush of the protocol task is one job, and the
/// thread takes all queued jobs per fsync, so the queue is short unless the disk stalls;
/// then the protocol task waits here (backpressure) instead of buffering without bound.
const JOBS_MAX: usize = 256;

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
    thread: Option<std::thread::JoinHandle<()>>,
    /// `fsync = never`: the storage (shared with the thread, which holds it only while it
    /// writes a job) and what releasing messages counts, for jobs written here.
    inline: Option<(Arc<Mutex<Storage>>, Arc<TransportStats>)>,
}

impl Committer {
    /// Starts the WAL thread, which owns `storage` from now on.
    ///
    /// # Errors
    /// If the thread cannot be spawned.
    pub fn start(storage: Storage, stats: Arc<TransportStats>, metrics: Metrics) -> std::io::Result<Committer> {
        let (jobs, rx) = sync_channel(JOBS_MAX);
        let done = Arc::new(AtomicU64::new(0));
        let (fail_tx, failed) = mpsc::channel(1);
        let thread_done = done.clone();
        let never = storage.policy() == FsyncPolicy::Never;
        let storage = Arc::new(Mutex::new(storage));
        let inline = never.then(|| (storage.clone(), stats.clone()));
        let thread = std::thread::Builder::new().name("keel-wal".into()).spawn(move || {
            if let Err(e) = run(&storage, rx, &thread_done, &stats, &metrics) {
                let _ = fail_tx.try_send(e);
            }
        })?;
        Ok(Committer { jobs, submitted: 0, done, failed, thread: Some(thread), inline })
    }

    /// Ends the WAL thread once it has written every job handed over, and waits for it:
    /// afterwards nothing of this node holds its log open (a node stopped in a process
    /// that goes on may be started again from the same directory).
    pub fn close(mut self) {
        let thread = self.thread.take();
        drop(self);
        if let Some(t) = thread {
            let _ = t.join();
        }
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
        if let Some((storage, stats)) = &self.inline {
            if self.idle() && persist.iter().all(|p| matches!(p, Persist::Record(_))) {
                // Nothing queued before it, and nothing to fsync: written here, released now.
                let mut s = storage.lock().map_err(|_| StorageError::Stopped)?;
                s.write(&persist)?;
                s.append_lazy(&lazy)?;
                drop(s);
                release(gated, stats);
                return Ok(());
            }
        }
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

fn run(
    storage: &Mutex<Storage>,
    rx: Receiver<Job>,
    done: &AtomicU64,
    stats: &TransportStats,
    m: &Metrics,
) -> Result<(), StorageError> {
    while let Ok(first) = rx.recv() {
        let mut jobs = vec![first];
        while let Ok(more) = rx.try_recv() {
            jobs.push(more);
        }
        let eager = jobs.iter().any(|j| !j.persist.is_empty());
        {
            // Held while writing only, and let go before the jobs count as done: the
            // protocol task writes inline only once they do (`Committer::submit`).
            let mut storage = storage.lock().map_err(|_| StorageError::Stopped)?;
            for j in &jobs {
                let snapshots = storage.write(&j.persist)?;
                storage.append_lazy(&j.lazy)?;
                if snapshots.chunks > 0 {
                    m.snapshot_chunks.inc_by(snapshots.chunks);
                    m.snapshot_chunks_reused.inc_by(snapshots.reused);
                    m.snapshot_bytes.inc_by(snapshots.bytes_written);
                    m.snapshot_released.inc_by(snapshots.released);
                }
            }
            if eager {
                let took = storage.sync()?;
                if !took.is_zero() {
                    m.fsync_seconds.observe(took.as_secs_f64());
                }
            }
        }
        let count = jobs.len() as u64;
        for j in jobs {
            release(j.gated, stats);
        }
        done.fetch_add(count, Ordering::Release);
    }
    // The protocol task let go (a node stopping): lazy records too are durable now.
    storage.lock().map_err(|_| StorageError::Stopped)?.sync()?;
    Ok(())
}

/// Sends messages whose records are durable.
fn release(gated: Vec<Gated>, stats: &TransportStats) {
    for (tx, msg, epoch) in gated {
        let frame = match epoch {
            Some(epoch) => crate::transport::node_frame(epoch, &msg),
            None => codec::encode(&msg),
        };
        offer(&tx, frame, stats);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_core::ids::{Seq, View};
    use keel_core::replica::Durable;

    fn view(v: u64) -> Record {
        Record::View { view: View(v), floor: Seq(0) }
    }

    fn views(d: &Durable) -> Vec<u64> {
        d.records.iter().filter_map(|r| if let Record::View { view, .. } = r { Some(view.0) } else { None }).collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn gated_messages_follow_their_records_in_order() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (storage, _) = Storage::open(dir.path(), FsyncPolicy::Batch).expect("open");
        let stats = Arc::new(TransportStats::default());
        let mut c = Committer::start(storage, stats, crate::metrics::Metrics::new().0).expect("start");
        let (tx, mut rx) = mpsc::channel(16);
        let a = Message::Stop { view: View(1) };
        let b = Message::Stop { view: View(2) };
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
        // Released means written (and, for the eager record, synced) first. Closed, the
        // WAL thread lets go of the directory.
        c.close();
        let (_, durable) = Storage::open(dir.path(), FsyncPolicy::Batch).expect("reopen");
        assert_eq!(views(&durable), vec![1, 2], "eager and lazy records both written, in order");
    }

    /// `fsync = never`: a job of records with nothing queued before it is written by the
    /// caller and its messages are out when `submit` returns; a job the thread must do
    /// (a compaction fsyncs) keeps its place, and what follows it does not overtake it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn with_fsync_never_records_are_written_inline_and_order_holds() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (storage, _) = Storage::open(dir.path(), FsyncPolicy::Never).expect("open");
        let stats = Arc::new(TransportStats::default());
        let mut c = Committer::start(storage, stats, crate::metrics::Metrics::new().0).expect("start");
        let (tx, mut rx) = mpsc::channel(16);
        let stop = |view| Message::Stop { view: View(view) };
        c.submit(vec![Persist::Record(view(1))], vec![view(2)], vec![(tx.clone(), stop(1), None)]).expect("submit");
        let inline = rx.try_recv().expect("released before submit returned");
        assert_eq!(codec::decode(&inline).expect("decodes"), stop(1));
        assert!(c.idle(), "nothing was handed to the thread");

        let compact = Persist::Compact { records: vec![view(5)], snapshots_from: Seq(0) };
        c.submit(vec![compact], Vec::new(), vec![(tx.clone(), stop(5), None)]).expect("submit");
        c.submit(vec![Persist::Record(view(6))], Vec::new(), vec![(tx, stop(6), None)]).expect("submit");
        for want in [5, 6] {
            let frame = rx.recv().await.expect("released");
            assert_eq!(codec::decode(&frame).expect("decodes"), stop(want), "in order");
        }
        while !c.idle() {
            tokio::task::yield_now().await;
        }
        c.close();
        let (_, durable) = Storage::open(dir.path(), FsyncPolicy::Never).expect("reopen");
        assert_eq!(views(&durable), vec![5, 6], "the compacted log, then the record after it");
    }
}
