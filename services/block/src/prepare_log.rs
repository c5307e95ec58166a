//! The PrepareData log (Gnothi §3.1: a replica "logs it to disk" before it acknowledges
//! a PrepareData). A node acknowledges a PrepareData only once the record is fsynced
//! here, so an acknowledged write's data is on u + r + 1 disks before its WriteData is
//! ordered; after a crash, the records are read back and the WAL's replay of the
//! WriteData finds its data again.
//!
//! Records go to numbered segments (one per checkpoint generation) on a thread of their
//! own that fsyncs once per batch (group commit). A segment is done with once every
//! record in it is dead: discarded, or consumed by a write whose data file a later
//! checkpoint synced (`Local::checkpoint`).
//!
//! A segment's file starts with a header naming the segment, and its records are framed
//! as the WAL's are, with a checksum that covers the segment's number
//! (`keel::core::wal::frame_in`). A segment that is done with is not deleted: its header
//! is marked free and the file waits for the next segment, which overwrites it from the
//! start, as the WAL recycles its segments. Measured here (session 36): appending to a
//! fresh file makes each fdatasync commit the file system's journal, which on ext4
//! (data=ordered) also flushes the data file's newly written blocks, and deleting a
//! segment on the writer thread took 4-11 ms; both stalled PrepareData acknowledgements
//! behind every checkpoint. A file is known by its header, never its name, so a rename
//! lost in a crash loses nothing; a reused file's old records fail the new number's
//! checksum and read as the end of the segment. Every segment number a file ever had is
//! below [`Opened::next_segment`], so no number is used twice. Files of the first format
//! (`N.log`: no header, the checksum of the record alone) are still read, and deleted
//! once done with.

use keel::core::wal::{frame_in, unframe};
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc as std_mpsc;
use std::sync::Arc;
use tokio::sync::oneshot;

/// Largest record read back: a PrepareData holds at most a node-plane message.
const RECORD_MAX: usize = keel::core::codec::PLANE_BYTES_MAX + 4096;
/// A segment file's header: magic, the segment's number, crc32c of both.
const HEADER: usize = 16;
const LIVE: &[u8; 4] = b"KPDL";
const FREE: &[u8; 4] = b"KPDF";
/// Most files kept for reuse: a node has about three segments live (records are released
/// two checkpoints after they are consumed), so one or two are done with at a time.
const POOL_MAX: usize = 4;
/// A file larger than this is deleted rather than kept for reuse (a burst of large writes
/// makes a large segment; the disk it holds is returned).
const POOL_FILE_MAX: u64 = 256 << 20;

enum Job {
    Append { segment: u64, records: Vec<Vec<u8>>, done: oneshot::Sender<io::Result<()>> },
    Delete { segment: u64 },
}

/// The length and checksum before each record's bytes (`frame_in`).
const FRAME_HEAD: usize = 8;

/// Where a record found at open lies in its segment's file, to be read again when its
/// bytes are needed. Its file is not written again while the record is live: a segment
/// found at open takes no more records, and its file is reused only once every record
/// in it is dead.
#[derive(Clone)]
pub struct RecordAt {
    file: Arc<File>,
    segment: u64,
    /// Where its frame starts.
    offset: u64,
    len: u32,
}

impl RecordAt {
    /// The record's bytes, read again and checked against its frame's checksum.
    ///
    /// # Errors
    /// An I/O error, or a frame that no longer checks (the file changed under the log).
    pub fn read(&self) -> io::Result<Vec<u8>> {
        let mut frame = vec![0u8; FRAME_HEAD + self.len as usize];
        self.file.read_exact_at(&mut frame, self.offset)?;
        match unframe(&frame, self.segment, RECORD_MAX).payloads.first() {
            Some(&(0, payload)) if payload.len() == self.len as usize => Ok(payload.to_vec()),
            _ => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("PrepareData record at {} of segment {} changed since it was read", self.offset, self.segment),
            )),
        }
    }
}

/// Reads the frames of a segment's file after its header, one at a time, handing each
/// to `each`, up to the first that is short or fails its checksum; returns where the
/// whole frames end.
fn read_frames(file: &Arc<File>, segment: u64, mut each: impl FnMut(RecordAt, &[u8])) -> io::Result<u64> {
    let mut reader = io::BufReader::with_capacity(1 << 20, &**file);
    reader.seek(io::SeekFrom::Start(HEADER as u64))?;
    let mut offset = HEADER as u64;
    let mut frame = Vec::new();
    loop {
        let mut head = [0u8; FRAME_HEAD];
        match reader.read_exact(&mut head) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => break,
            Err(e) => return Err(e),
        }
        let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]);
        if len as usize > RECORD_MAX {
            break;
        }
        frame.clear();
        frame.extend_from_slice(&head);
        frame.resize(FRAME_HEAD + len as usize, 0);
        match reader.read_exact(&mut frame[FRAME_HEAD..]) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => break,
            Err(e) => return Err(e),
        }
        let Some(&(0, payload)) = unframe(&frame, segment, RECORD_MAX).payloads.first() else { break };
        each(RecordAt { file: file.clone(), segment, offset, len }, payload);
        offset += (FRAME_HEAD + len as usize) as u64;
    }
    Ok(offset)
}

/// What [`PrepareLog::open`] found besides the records.
pub struct Opened {
    /// Above every segment number any file of the log was used for: new segments must
    /// be numbered from here, so that a reused file's old records never pass for theirs.
    pub next_segment: u64,
}

pub struct PrepareLog {
    /// None once dropped (the writer sees the queue close and ends).
    jobs: Option<std_mpsc::Sender<Job>>,
    writer: Option<std::thread::JoinHandle<()>>,
}

impl Drop for PrepareLog {
    /// Waits for the writer to finish what was queued (a segment's deletion, an append),
    /// so that a log opened again on the same directory right after (a node restarted
    /// in the same process: the simulator, an embedder) never has a file vanish under
    /// it or change after it read it.
    fn drop(&mut self) {
        drop(self.jobs.take());
        if let Some(writer) = self.writer.take() {
            let _ = writer.join();
        }
    }
}

impl PrepareLog {
    /// Opens the log in `dir` and hands every intact record found to `found`, segment by
    /// segment (oldest first), each with where it lies so that it can be read again
    /// ([`RecordAt`]; None for a file of the first format). A torn record ends its
    /// segment (a crash mid-append); what came before it is kept. Records are read one
    /// at a time: a node restarted after a burst of large writes found 818 MB of them,
    /// all read into memory at once before.
    ///
    /// # Errors
    /// The directory cannot be created or read, or a file cannot be read.
    pub fn open(
        dir: &Path,
        sync: bool,
        mut found: impl FnMut(u64, &[u8], Option<RecordAt>),
    ) -> io::Result<(PrepareLog, Opened)> {
        std::fs::create_dir_all(dir)?;
        let mut files = Segments { dir: dir.to_path_buf(), live: BTreeMap::new(), pool: Vec::new(), open: None };
        let mut next_segment = 0;
        // Live segments' files, read in segment order once all are known.
        let mut live: Vec<(u64, PathBuf, Option<File>)> = Vec::new();
        for entry in std::fs::read_dir(dir)? {
            let path = entry?.path();
            let Some((stem, ext)) = path.file_name().and_then(|n| n.to_str()).and_then(|n| n.split_once('.')) else {
                continue;
            };
            let Ok(number) = stem.parse::<u64>() else { continue };
            next_segment = next_segment.max(number.saturating_add(1));
            match ext {
                "log" => live.push((number, path, None)),
                "seg" | "free" => {
                    let mut file = File::open(&path)?;
                    let mut head = [0u8; HEADER];
                    let header = match file.read_exact(&mut head) {
                        Ok(()) => parse_header(&head),
                        Err(_) => None,
                    };
                    let Some((is_live, segment)) = header else {
                        files.keep_or_delete(path);
                        continue;
                    };
                    next_segment = next_segment.max(segment.saturating_add(1));
                    if is_live {
                        live.push((segment, path, Some(file)));
                    } else {
                        files.keep_or_delete(path);
                    }
                }
                _ => {}
            }
        }
        // Oldest first; a segment's records stay in the order they were written.
        live.sort_by_key(|(segment, _, _)| *segment);
        for (segment, path, file) in live {
            let Some(file) = file else {
                // The first format: read whole (no file of it is written any more).
                let mut bytes = Vec::new();
                File::open(&path)?.read_to_end(&mut bytes)?;
                let records = read_first_format(&bytes);
                if records.is_empty() {
                    let _ = std::fs::remove_file(&path);
                    continue;
                }
                for r in &records {
                    found(segment, r, None);
                }
                files.live.entry(segment).or_default().push(Live { path, end: None });
                continue;
            };
            let file = Arc::new(file);
            let end = read_frames(&file, segment, |at, payload| found(segment, payload, Some(at)))?;
            if end == HEADER as u64 {
                // No record of it was made durable: nothing would ever let it go.
                files.keep_or_delete(path);
                continue;
            }
            files.live.entry(segment).or_default().push(Live { path, end: Some(end) });
        }
        let (jobs, rx) = std_mpsc::channel();
        let writer = std::thread::Builder::new().name("prepare-log".into()).spawn(move || writer(files, sync, &rx))?;
        Ok((PrepareLog { jobs: Some(jobs), writer: Some(writer) }, Opened { next_segment }))
    }

    /// Appends `records` to `segment`, in order; resolves once they are durable
    /// (fsynced, unless the node runs with fsync = never).
    pub async fn append(&self, segment: u64, records: Vec<Vec<u8>>) -> io::Result<()> {
        let (done, rx) = oneshot::channel();
        let jobs = self.jobs.as_ref().ok_or_else(stopped)?;
        jobs.send(Job::Append { segment, records, done }).map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())?
    }

    /// Lets go of `segment` (every record in it is dead): its file is kept for reuse.
    pub fn delete(&self, segment: u64) {
        if let Some(jobs) = &self.jobs {
            let _ = jobs.send(Job::Delete { segment });
        }
    }
}

fn stopped() -> io::Error {
    io::Error::other("the PrepareData log's writer stopped")
}

fn header(magic: &[u8; 4], segment: u64) -> [u8; HEADER] {
    let mut h = [0u8; HEADER];
    h[..4].copy_from_slice(magic);
    h[4..12].copy_from_slice(&segment.to_le_bytes());
    let crc = crc32c::crc32c(&h[..12]);
    h[12..].copy_from_slice(&crc.to_le_bytes());
    h
}

/// (live, segment) from a header, or None if it is not one (torn, or not this log's).
fn parse_header(h: &[u8; HEADER]) -> Option<(bool, u64)> {
    let crc = u32::from_le_bytes(h[12..].try_into().ok()?);
    if crc32c::crc32c(&h[..12]) != crc {
        return None;
    }
    let segment = u64::from_le_bytes(h[4..12].try_into().ok()?);
    match &h[..4] {
        m if m == LIVE => Some((true, segment)),
        m if m == FREE => Some((false, segment)),
        _ => None,
    }
}

/// The records of a file of the first format: `len | crc32c(record) | record`, up to the
/// first torn one.
fn read_first_format(bytes: &[u8]) -> Vec<Vec<u8>> {
    let mut records = Vec::new();
    let mut at = 0;
    while at + 8 <= bytes.len() {
        let len = u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap_or_default()) as usize;
        let crc = u32::from_le_bytes(bytes[at + 4..at + 8].try_into().unwrap_or_default());
        let Some(body) = bytes.get(at + 8..at + 8 + len).filter(|_| len <= RECORD_MAX) else { break };
        if crc32c::crc32c(body) != crc {
            break;
        }
        records.push(body.to_vec());
        at += 8 + len;
    }
    records
}

/// A file holding a live segment.
struct Live {
    path: PathBuf,
    /// Where its records end (appends go there); None: a file of the first format, read
    /// but never written again.
    end: Option<u64>,
}

/// The writer's files: live segments, files free for reuse, and the one being written.
struct Segments {
    dir: PathBuf,
    /// A segment has one file; more only if a file was tampered with (all are read).
    live: BTreeMap<u64, Vec<Live>>,
    pool: Vec<PathBuf>,
    /// The segment being written, its file and where its records end.
    open: Option<(u64, File, u64)>,
}

impl Segments {
    /// Keeps `path`, whose segment is done with (or that holds none), for reuse if the
    /// pool has room and the file is not large; deletes it otherwise.
    fn keep_or_delete(&mut self, path: PathBuf) {
        let small = std::fs::metadata(&path).is_ok_and(|m| m.len() <= POOL_FILE_MAX);
        if small && self.pool.len() < POOL_MAX {
            self.pool.push(path);
        } else {
            let _ = std::fs::remove_file(path);
        }
    }

    /// Lets go of `segment`: its header is marked free (not synced: if the mark is lost
    /// in a crash, the records read back are dead ones, which `Local` recognises from
    /// the agreed metadata, as it always had to, since a deletion is not synced either).
    fn release(&mut self, segment: u64) {
        if self.open.as_ref().is_some_and(|(s, _, _)| *s == segment) {
            self.open = None;
        }
        for live in self.live.remove(&segment).unwrap_or_default() {
            if live.end.is_none() {
                let _ = std::fs::remove_file(&live.path);
                continue;
            }
            let marked = OpenOptions::new()
                .write(true)
                .open(&live.path)
                .and_then(|f| f.write_all_at(&header(FREE, segment), 0))
                .is_ok();
            let free = self.dir.join(format!("{segment:012}.free"));
            if marked && std::fs::rename(&live.path, &free).is_ok() {
                self.keep_or_delete(free);
            } else {
                let _ = std::fs::remove_file(&live.path);
            }
        }
    }

    /// Makes `segment` the one written, syncing the one left first. A new segment takes
    /// a file from the pool (or a new one) and writes its header.
    fn switch_to(&mut self, segment: u64) -> io::Result<()> {
        if self.open.as_ref().is_some_and(|(s, _, _)| *s == segment) {
            return Ok(());
        }
        if let Some((s, old, end)) = self.open.take() {
            if let Some(live) = self.live.get_mut(&s).and_then(|l| l.last_mut()) {
                live.end = Some(end);
            }
            old.sync_data()?;
        }
        if let Some(live) = self.live.get(&segment).and_then(|l| l.last()) {
            let end = live.end.ok_or_else(|| {
                io::Error::other(format!("PrepareData segment {segment} is of the first format and read-only"))
            })?;
            let f = OpenOptions::new().write(true).open(&live.path)?;
            self.open = Some((segment, f, end));
            return Ok(());
        }
        let path = self.dir.join(format!("{segment:012}.seg"));
        if let Some(free) = self.pool.pop() {
            if std::fs::rename(&free, &path).is_err() {
                let _ = std::fs::remove_file(&free);
            }
        }
        let f = OpenOptions::new().write(true).create(true).truncate(false).open(&path)?;
        f.write_all_at(&header(LIVE, segment), 0)?;
        self.live.entry(segment).or_default().push(Live { path, end: Some(HEADER as u64) });
        self.open = Some((segment, f, HEADER as u64));
        Ok(())
    }

    /// Writes what is framed where its segment's records end.
    fn write_out(&mut self, framed: &mut Framed) -> io::Result<()> {
        let Some(segment) = framed.segment.take() else { return Ok(()) };
        let result = self.switch_to(segment).and_then(|()| {
            let Some((_, f, end)) = self.open.as_mut() else { return Err(stopped()) };
            f.write_all_at(&framed.bytes, *end)?;
            *end += framed.bytes.len() as u64;
            Ok(())
        });
        framed.bytes.clear();
        result
    }

    fn sync(&self) -> io::Result<()> {
        self.open.as_ref().map_or(Ok(()), |(_, f, _)| f.sync_data())
    }
}

/// Most bytes the writer keeps allocated for framing between batches.
const BUFFER_KEPT: usize = 8 << 20;

fn writer(mut files: Segments, sync: bool, jobs: &std_mpsc::Receiver<Job>) {
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
                    note(&mut failed, files.write_out(&mut framed));
                    files.release(segment);
                }
                Job::Append { segment, records, done } => {
                    if framed.segment.is_some_and(|s| s != segment) {
                        note(&mut failed, files.write_out(&mut framed));
                    }
                    framed.push(segment, &records);
                    waiting.push(done);
                }
            }
        }
        note(&mut failed, files.write_out(&mut framed));
        if !waiting.is_empty() && failed.is_none() && sync {
            note(&mut failed, files.sync());
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
            frame_in(&mut self.bytes, record, segment);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn files(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .expect("lists")
            .map(|e| e.expect("entry").file_name().into_string().expect("utf-8"))
            .collect();
        names.sort();
        names
    }

    fn got(records: &[(u64, Vec<u8>)]) -> Vec<(u64, &[u8])> {
        records.iter().map(|(s, r)| (*s, r.as_slice())).collect()
    }

    struct Found {
        records: Vec<(u64, Vec<u8>)>,
        next_segment: u64,
    }

    /// Opens the log and returns it with its records, each read at open and read again
    /// from where it lies (the two must agree).
    fn open(dir: &Path) -> (PrepareLog, Found) {
        let mut records = Vec::new();
        let (log, opened) = PrepareLog::open(dir, true, |segment, payload, at| {
            if let Some(at) = at {
                assert_eq!(at.read().expect("reads again"), payload, "read again as read at open");
            }
            records.push((segment, payload.to_vec()));
        })
        .expect("opens");
        (log, Found { records, next_segment: opened.next_segment })
    }

    #[tokio::test]
    async fn records_come_back_in_order_and_a_torn_tail_is_cut() {
        let dir = tempfile::tempdir().expect("tempdir");
        {
            let (log, old) = open(dir.path());
            assert!(old.records.is_empty());
            log.append(1, vec![b"one".to_vec(), b"two".to_vec()]).await.expect("appends");
            // Queued together, often one batch of the writer: each segment's records in order.
            let (a, b) = tokio::join!(
                log.append(2, vec![b"three".to_vec()]),
                log.append(3, vec![b"four".to_vec(), b"4".to_vec()])
            );
            a.and(b).expect("appends");
            log.delete(3);
            // Back to a segment left for another: its records continue where they ended.
            log.append(2, vec![b"five".to_vec()]).await.expect("appends");
        }
        // A crash in the middle of an append leaves half a record.
        let mut f = OpenOptions::new().append(true).open(dir.path().join("000000000002.seg")).expect("opens");
        f.write_all(&[200, 0, 0, 0, 1, 2, 3, 4, 9]).expect("writes");
        let (_, opened) = open(dir.path());
        assert_eq!(got(&opened.records), vec![(1, &b"one"[..]), (1, b"two"), (2, b"three"), (2, b"five")]);
        assert_eq!(opened.next_segment, 4, "segment 3 was used, though it holds nothing now");
    }

    /// The point of reuse: the next segment overwrites a done-with file, and what the file
    /// held before never reads back as records, even when the new segment is shorter.
    #[tokio::test]
    async fn a_done_with_file_is_reused_and_its_old_records_never_come_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        {
            let (log, _) = open(dir.path());
            // The new segment's record has the length of the old first one, so the old
            // second and third frames follow it exactly where a next record would be.
            log.append(1, vec![vec![1; 5000], vec![2; 5000], vec![3; 5000]]).await.expect("appends");
            log.append(2, vec![b"live".to_vec()]).await.expect("appends");
            log.delete(1);
            log.append(3, vec![vec![4; 5000]]).await.expect("appends");
        }
        assert_eq!(files(dir.path()), vec!["000000000002.seg", "000000000003.seg"], "segment 1's file became 3's");
        let len = std::fs::metadata(dir.path().join("000000000003.seg")).expect("stat").len();
        assert!(len > 15_000, "overwritten in place, not truncated: {len} bytes");
        let four = vec![4u8; 5000];
        let (log, opened) = open(dir.path());
        assert_eq!(got(&opened.records), vec![(2, &b"live"[..]), (3, &four[..])]);
        assert_eq!(opened.next_segment, 4);
        log.delete(2);
        log.delete(3);
        drop(log);
        assert_eq!(files(dir.path()), vec!["000000000002.free", "000000000003.free"]);
        let (_, opened) = open(dir.path());
        assert!(opened.records.is_empty(), "free files hold no records");
        assert_eq!(opened.next_segment, 4, "numbers a free file had are not used again");
    }

    /// A crash can lose a rename (names are not synced): a file is known by its header.
    #[tokio::test]
    async fn a_file_is_known_by_its_header_not_its_name() {
        let dir = tempfile::tempdir().expect("tempdir");
        {
            let (log, _) = open(dir.path());
            log.append(7, vec![b"seven".to_vec()]).await.expect("appends");
            log.append(8, vec![b"eight".to_vec()]).await.expect("appends");
            log.delete(8);
        }
        // Segment 7's file under a free name, and segment 8's free file back under its old one.
        std::fs::rename(dir.path().join("000000000007.seg"), dir.path().join("000000000001.free")).expect("renames");
        std::fs::rename(dir.path().join("000000000008.free"), dir.path().join("000000000008.seg")).expect("renames");
        let (log, opened) = open(dir.path());
        assert_eq!(got(&opened.records), vec![(7, &b"seven"[..])]);
        assert_eq!(opened.next_segment, 9);
        log.append(9, vec![b"nine".to_vec()]).await.expect("appends");
        drop(log);
        let (_, opened) = open(dir.path());
        assert_eq!(got(&opened.records), vec![(7, &b"seven"[..]), (9, b"nine")]);
    }

    /// A segment whose header was written but none of whose records was made durable (a
    /// crash before the first fsync) holds nothing anyone would let go of: its file goes
    /// back to the pool at open instead of staying forever.
    #[tokio::test]
    async fn a_segment_with_no_record_is_not_kept_live() {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("000000000004.seg"), header(LIVE, 4)).expect("writes");
        let (log, opened) = open(dir.path());
        assert!(opened.records.is_empty());
        assert_eq!(opened.next_segment, 5);
        log.append(5, vec![b"five".to_vec()]).await.expect("appends");
        drop(log);
        assert_eq!(files(dir.path()), vec!["000000000005.seg"], "segment 4's file became 5's");
    }

    /// A node upgraded with records still in the first format's files reads them, and
    /// deletes those files once done with (they are never written again).
    #[tokio::test]
    async fn files_of_the_first_format_are_read_and_then_deleted() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut bytes = Vec::new();
        for r in [&b"old"[..], b"older"] {
            bytes.extend((r.len() as u32).to_le_bytes());
            bytes.extend(crc32c::crc32c(r).to_le_bytes());
            bytes.extend(r);
        }
        bytes.extend([9, 0, 0, 0, 1]);
        std::fs::write(dir.path().join("000000000005.log"), &bytes).expect("writes");
        let (log, opened) = open(dir.path());
        assert_eq!(got(&opened.records), vec![(5, &b"old"[..]), (5, b"older")]);
        assert_eq!(opened.next_segment, 6);
        assert!(log.append(5, vec![b"more".to_vec()]).await.is_err(), "a first-format segment is read-only");
        log.append(6, vec![b"new".to_vec()]).await.expect("appends");
        log.delete(5);
        drop(log);
        assert_eq!(files(dir.path()), vec!["000000000006.seg"]);
    }
}
