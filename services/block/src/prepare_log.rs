//! The PrepareData log (Gnothi §3.1: a replica "logs it to disk" before it acknowledges
//! a PrepareData). A node acknowledges a PrepareData only once the record is fsynced
//! here, so an acknowledged write's data is on u + r + 1 disks before its WriteData is
//! ordered; after a crash, the records are read back and the WAL's replay of the
//! WriteData finds its data again.
//!
//! Records go to numbered segment files (one per checkpoint generation) on a thread of
//! their own that fsyncs once per batch (group commit). A segment is deleted once every
//! record in it is dead: discarded, or consumed by a write whose data file a later
//! checkpoint synced (`Local::checkpoint`).

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc as std_mpsc;
use tokio::sync::oneshot;

/// Largest record read back: a PrepareData holds at most a node-plane message.
const RECORD_MAX: usize = keel::core::codec::PLANE_BYTES_MAX + 4096;

enum Job {
    Append { segment: u64, records: Vec<Vec<u8>>, done: oneshot::Sender<io::Result<()>> },
    Delete { segment: u64 },
}

/// Records read back at open: (segment, record), oldest first.
pub type Records = Vec<(u64, Vec<u8>)>;

pub struct PrepareLog {
    /// None once dropped (the writer sees the queue close and ends).
    jobs: Option<std_mpsc::Sender<Job>>,
    writer: Option<std::thread::JoinHandle<()>>,
}

impl Drop for PrepareLog {
    /// Waits for the writer to finish what was queued (a segment's deletion, an append),
    /// so that a log opened again on the same directory right after (a node restarted
    /// in the same process: the simulator, an embedder) never has a file vanish under
    /// it or deleted after it read it.
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
    }
}

impl PrepareLog {
    /// Opens the log in `dir` and returns it with every intact record found, by segment
    /// (oldest first). A torn record ends its segment (a crash mid-append); what came
    /// before it is kept.
    ///
    /// # Errors
    /// The directory cannot be created or read.
    pub fn open(dir: &Path, sync: bool) -> io::Result<(PrepareLog, Records)> {
        std::fs::create_dir_all(dir)?;
        let mut segments: Vec<u64> = std::fs::read_dir(dir)?
            .filter_map(|e| e.ok()?.file_name().to_str()?.strip_suffix(".log")?.parse().ok())
            .collect();
        segments.sort_unstable();
        let mut records = Vec::new();
        for s in segments {
            let mut bytes = Vec::new();
            File::open(segment_path(dir, s))?.read_to_end(&mut bytes)?;
            let mut at = 0;
            while at + 8 <= bytes.len() {
                let len = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap_or_default()) as usize;
                let crc = u32::from_le_bytes(bytes[at + 4..at + 8].try_into().unwrap_or_default());
                let Some(body) = bytes.get(at + 8..at + 8 + len).filter(|_| len <= RECORD_MAX) else { break };
                if crc32c::crc32c(body) != crc {
                    tracing::warn!(segment = s, offset = at, "PrepareData log: a torn record ends the segment");
                    break;
                }
                records.push((s, body.to_vec()));
                at += 8 + len;
            }
        }
        let (jobs, rx) = std_mpsc::channel();
        let dir = dir.to_path_buf();
        let writer = std::thread::Builder::new().name("prepare-log".into()).spawn(move || writer(&dir, sync, &rx))?;
        Ok((PrepareLog { jobs: Some(jobs), writer: Some(writer) }, records))
    }

    /// Appends `records` to `segment`, in order; resolves once they are durable
    /// (fsynced, unless the node runs with fsync = never).
    pub async fn append(&self, segment: u64, records: Vec<Vec<u8>>) -> io::Result<()> {
        let (done, rx) = oneshot::channel();
        let jobs = self.jobs.as_ref().ok_or_else(stopped)?;
        jobs.send(Job::Append { segment, records, done }).map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())?
    }

    /// Deletes `segment` (every record in it is dead).
    pub fn delete(&self, segment: u64) {
        if let Some(jobs) = &self.jobs {
            let _ = jobs.send(Job::Delete { segment });
        }
    }
}

fn stopped() -> io::Error {
    io::Error::other("the PrepareData log's writer stopped")
}

fn segment_path(dir: &Path, segment: u64) -> PathBuf {
    dir.join(format!("{segment:012}.log"))
}

/// Most bytes the writer keeps allocated for framing between batches.
const BUFFER_KEPT: usize = 8 << 20;

fn writer(dir: &Path, sync: bool, jobs: &std_mpsc::Receiver<Job>) {
    let mut open: Option<(u64, File)> = None;
    let mut framed = Framed::default();
    while let Ok(first) = jobs.recv() {
        let mut batch = vec![first];
        while let Ok(more) = jobs.try_recv() {
            batch.push(more);
        }
        let mut waiting = Vec::new();
        let mut failed: Option<io::ErrorKind> = None;
        for job in batch {
            match job {
                Job::Delete { segment } => {
                    note(&mut failed, framed.write_out(dir, &mut open));
                    if open.as_ref().is_some_and(|(s, _)| *s == segment) {
                        open = None;
                    }
                    let _ = std::fs::remove_file(segment_path(dir, segment));
                }
                Job::Append { segment, records, done } => {
                    if framed.segment.is_some_and(|s| s != segment) {
                        note(&mut failed, framed.write_out(dir, &mut open));
                    }
                    framed.push(segment, &records);
                    waiting.push(done);
                }
            }
        }
        note(&mut failed, framed.write_out(dir, &mut open));
        if !waiting.is_empty() && failed.is_none() && sync {
            if let Some((_, f)) = &open {
                note(&mut failed, f.sync_data());
            }
        }
        if framed.bytes.capacity() > BUFFER_KEPT {
            framed.bytes = Vec::new();
        }
        for done in waiting {
            let _ = done.send(match failed {
                None => Ok(()),
                Some(kind) => Err(io::Error::new(kind, "PrepareData log write failed")),
            });
        }
    }
}

/// Keeps the kind of `r`'s error, if any: every append of the batch fails with it.
fn note(failed: &mut Option<io::ErrorKind>, r: io::Result<()>) {
    if let Err(e) = r {
        *failed = Some(e.kind());
    }
}

/// Records framed for one segment, written with one call: a batch costs one write, not
/// one per record.
#[derive(Default)]
struct Framed {
    segment: Option<u64>,
    bytes: Vec<u8>,
}

impl Framed {
    fn push(&mut self, segment: u64, records: &[Vec<u8>]) {
        self.segment = Some(segment);
        for record in records {
            self.bytes.extend_from_slice(&(record.len() as u32).to_le_bytes());
            self.bytes.extend_from_slice(&crc32c::crc32c(record).to_le_bytes());
            self.bytes.extend_from_slice(record);
        }
    }

    /// Writes what is framed to its segment's file; a switch of segment syncs the one
    /// left first.
    fn write_out(&mut self, dir: &Path, open: &mut Option<(u64, File)>) -> io::Result<()> {
        let Some(segment) = self.segment.take() else { return Ok(()) };
        let result = (|| {
            if open.as_ref().is_none_or(|(s, _)| *s != segment) {
                if let Some((_, old)) = open.take() {
                    old.sync_data()?;
                }
                let f = OpenOptions::new().create(true).append(true).open(segment_path(dir, segment))?;
                *open = Some((segment, f));
            }
            let Some((_, f)) = open.as_mut() else { return Err(stopped()) };
            f.write_all(&self.bytes)
        })();
        self.bytes.clear();
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn records_come_back_in_order_and_a_torn_tail_is_cut() {
        let dir = tempfile::tempdir().expect("tempdir");
        {
            let (log, old) = PrepareLog::open(dir.path(), true).expect("opens");
            assert!(old.is_empty());
            log.append(1, vec![b"one".to_vec(), b"two".to_vec()]).await.expect("appends");
            // Queued together, often one batch of the writer: each segment's records in order.
            let (a, b) = tokio::join!(
                log.append(2, vec![b"three".to_vec()]),
                log.append(3, vec![b"four".to_vec(), b"4".to_vec()])
            );
            a.and(b).expect("appends");
            log.delete(3);
            log.append(2, vec![b"five".to_vec()]).await.expect("appends");
        }
        // A crash in the middle of an append leaves half a record.
        let mut f = OpenOptions::new().append(true).open(segment_path(dir.path(), 2)).expect("opens");
        f.write_all(&[200, 0, 0, 0, 1, 2, 3, 4, 9]).expect("writes");
        let (_, records) = PrepareLog::open(dir.path(), true).expect("reopens");
        let got: Vec<(u64, &[u8])> = records.iter().map(|(s, r)| (*s, r.as_slice())).collect();
        assert_eq!(got, vec![(1, &b"one"[..]), (1, b"two"), (2, b"three"), (2, b"five")]);
    }
}
