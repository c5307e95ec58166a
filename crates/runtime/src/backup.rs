//! `keel admin backup` and `keel init --restore`: a cluster's newest certified checkpoint
//! fetched over the network into a file, and read back.
//!
//! The fetch is `keel_core::backup` (the certificate checked against the membership the
//! administrator follows, every chunk against the certified root) driven over the
//! administrator's client connections (its side channel), the only client identity
//! nodes serve checkpoints to. The file holds the certificate, the membership that signed it, and
//! the chunks; reading it back checks the chunks against the root again, so a file
//! damaged at rest is refused rather than restored.
//!
//! ```text
//!   "KEELBAK1" | u32 LE header length | header (postcard) | per chunk: u32 LE length, bytes
//! ```

use crate::client::{KeelClient, SideChannel};
use crate::node::now_ms;
use keel_core::backup::{Certifiers, CheckpointFetch, Fetched};
use keel_core::chunk::Chunked;
use keel_core::membership::Membership;
use keel_core::message::{proof_signed, session_id, Message, NodeId, Seq, StableProof};
use serde::{Deserialize, Serialize};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const MAGIC: &[u8; 8] = b"KEELBAK1";
/// A header is a certificate and a membership: far below this.
const HEADER_MAX: u32 = 16 << 20;
/// A chunk is at most a few times the average chunk size; anything near this is damage.
const CHUNK_MAX: u32 = 64 << 20;
/// How long an unanswered request waits before it is asked again (elsewhere).
const RETRY_MS: u64 = 500;

/// What a backup file says about itself.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct BackupHeader {
    /// The service whose state it holds (cluster nodes' `service`).
    pub service: String,
    /// The checkpoint's certificate: its instance, root and signatures.
    pub proof: StableProof,
    /// The membership the state belongs to (its keys check the certificate).
    pub membership: Membership,
    /// Whether the execution nodes of a cluster with stages apart signed it (their keys
    /// are not in the membership: the signatures cannot be checked from the file).
    pub by_executors: bool,
    /// The state's length in bytes and its chunk count.
    pub len: u64,
    pub chunks: u32,
    /// When the backup was taken (ms since the Unix epoch).
    pub taken_ms: u64,
}

/// A backup read back: its header and the checkpoint's state.
#[derive(Debug)]
pub struct Backup {
    pub header: BackupHeader,
    pub state: Chunked,
}

impl Backup {
    /// The service's own bytes and the instance the state was taken after.
    ///
    /// # Errors
    /// If the state is not an executor snapshot.
    pub fn service_state(&self) -> Result<(Seq, Vec<u8>), BackupError> {
        let bytes = self.state.to_bytes().map_err(|e| BackupError::Damaged(e.to_string()))?;
        let (seq, service) = keel_core::exec::snapshot_service_state(&bytes)
            .map_err(|e| BackupError::Damaged(format!("the state is not a Keel snapshot: {}", e.0)))?;
        Ok((seq, service.to_vec()))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum BackupError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("not a Keel backup: {0}")]
    NotABackup(String),
    #[error("the backup is damaged: {0}")]
    Damaged(String),
    #[error("{0}")]
    Client(String),
    #[error(
        "no node served a certified checkpoint within {after:?}{}",
        if *.checkpointless { ": none has one yet (a cluster takes its first after checkpoint_interval instances; write more, or wait)" } else { "" }
    )]
    Timeout { after: Duration, checkpointless: bool },
}

/// Progress of a fetch, for a progress bar: the checkpoint and (chunks held, in all).
#[derive(Clone, Copy, Debug)]
pub struct FetchProgress {
    pub seq: Seq,
    pub held: usize,
    pub total: usize,
}

/// How long one barrier may take to be ordered.
const BARRIER_TIMEOUT: Duration = Duration::from_secs(10);

/// Fetches the newest certified checkpoint of the cluster `client` reaches (the
/// administrator's client: nodes serve checkpoints to no one else), within `timeout`.
/// `membership`: the one the client's files name (`setup.membership`); `epochs_dir`:
/// where its followed epoch certificates are kept. `certifiers`: who signs checkpoints
/// (with stages apart, the execution nodes).
///
/// With `barrier_interval` (the cluster's `checkpoint_interval`) the backup holds every
/// write acknowledged before the call: it orders a barrier (an empty administrative
/// operation, which changes nothing) and takes only a checkpoint whose state executed
/// it; until one is certified it keeps ordering barriers, one at a time, so an idle
/// cluster reaches its next checkpoint in a second or so rather than never.
///
/// # Errors
/// The client's side channel already taken, a barrier not ordered, or no checkpoint
/// within the timeout.
pub async fn fetch(
    client: &KeelClient,
    membership: Membership,
    epochs_dir: Option<&Path>,
    certifiers: Certifiers,
    barrier_interval: Option<u64>,
    timeout: Duration,
    mut progress: impl FnMut(FetchProgress),
) -> Result<Fetched, BackupError> {
    let SideChannel { send: outbox, receive: mut inbox } =
        client.side_channel().ok_or_else(|| BackupError::Client("the client's side channel is taken".into()))?;
    let session = session_id(client.id(), 0);
    let mut core = CheckpointFetch::new(session, membership, certifiers, RETRY_MS);
    // The epochs this cluster's clients followed before (checked like any others).
    if let Some(certs) = epochs_dir.and_then(crate::epochs::load) {
        let _ = core.on_message(now_ms(), NodeId(0), Message::EpochCerts(certs));
    }
    // Ordered (and answered) before anything is fetched: every write acknowledged
    // before this call precedes it. Then more of them, in the background, to bring the
    // next checkpoint.
    let _pusher = match barrier_interval {
        Some(interval) => {
            client
                .invoke(Vec::new(), BARRIER_TIMEOUT)
                .await
                .map_err(|e| BackupError::Client(format!("the cluster did not order the backup's barrier: {e}")))?;
            core = core.with_barrier(session, client.first_seq());
            let pusher = client.clone();
            Some(AbortOnDrop(tokio::spawn(async move {
                for _ in 0..=interval {
                    if pusher.invoke(Vec::new(), BARRIER_TIMEOUT).await.is_err() {
                        return;
                    }
                }
            })))
        }
        None => None,
    };
    let send = |msgs: Vec<(NodeId, Message)>| {
        for m in msgs {
            // Full: the request is asked again on the next retry.
            let _ = outbox.try_send(m);
        }
    };
    let deadline = Instant::now() + timeout;
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    loop {
        tokio::select! {
            _ = tick.tick() => {
                if Instant::now() >= deadline {
                    let checkpointless = core.progress().is_none() && !core.passed_over();
                    return Err(BackupError::Timeout { after: timeout, checkpointless });
                }
                send(core.on_tick(now_ms()));
            }
            Some((from, msg)) = inbox.recv() => {
                match core.on_message(now_ms(), from, msg) {
                    Ok(msgs) => send(msgs),
                    // Counted (`Fetched::refused`); a lying node is one of many.
                    Err(why) => tracing::debug!(node = from.0, ?why, "backup: answer refused"),
                }
            }
        }
        if let Some((seq, held, total)) = core.progress() {
            progress(FetchProgress { seq, held, total });
        }
        if let Some(done) = core.finished() {
            return Ok(done);
        }
    }
}

/// Aborts the task when dropped (the barrier pusher stops with the fetch).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Writes `fetched` (of `service`) to `path`: a temporary file beside it, fsynced, then
/// renamed, so `path` is never half a backup.
///
/// # Errors
/// The file cannot be written.
pub fn write(path: &Path, service: &str, fetched: &Fetched, by_executors: bool) -> Result<BackupHeader, BackupError> {
    let header = BackupHeader {
        service: service.into(),
        proof: fetched.proof.clone(),
        membership: fetched.membership.clone(),
        by_executors,
        len: fetched.state.len(),
        chunks: fetched.state.leaves.len() as u32,
        taken_ms: crate::node::now_ms(),
    };
    let io = |p: &Path| {
        let path = p.to_path_buf();
        move |source| BackupError::Io { path, source }
    };
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.partial"));
    let result = (|| {
        // The service's data: readable by its owner only, like the keys.
        use std::os::unix::fs::OpenOptionsExt as _;
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .map_err(io(&tmp))?;
        let mut w = std::io::BufWriter::new(file);
        let head = postcard::to_allocvec(&header).map_err(|e| BackupError::Damaged(e.to_string()))?;
        w.write_all(MAGIC).map_err(io(&tmp))?;
        w.write_all(&(head.len() as u32).to_le_bytes()).map_err(io(&tmp))?;
        w.write_all(&head).map_err(io(&tmp))?;
        for (_, chunk) in fetched.state.chunks() {
            let chunk = chunk.map_err(|e| BackupError::Damaged(e.to_string()))?;
            w.write_all(&(chunk.len() as u32).to_le_bytes()).map_err(io(&tmp))?;
            w.write_all(&chunk).map_err(io(&tmp))?;
        }
        let file = w.into_inner().map_err(|e| BackupError::Io { path: tmp.clone(), source: e.into_error() })?;
        file.sync_all().map_err(io(&tmp))?;
        std::fs::rename(&tmp, path).map_err(io(path))?;
        // The rename is durable once the directory is.
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
        std::fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io(dir))?;
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map(|()| header)
}

/// Reads a backup file back, checking every chunk against the certified root and, where
/// the file holds the signers' keys, the certificate's signatures.
///
/// # Errors
/// The file cannot be read, is not a backup, or is damaged.
pub fn read(path: &Path) -> Result<Backup, BackupError> {
    let io = |source| BackupError::Io { path: path.to_path_buf(), source };
    let mut r = std::io::BufReader::new(std::fs::File::open(path).map_err(io)?);
    let mut magic = [0u8; 8];
    r.read_exact(&mut magic).map_err(|_| BackupError::NotABackup("too short".into()))?;
    if &magic != MAGIC {
        return Err(BackupError::NotABackup(format!("{} does not start like one", path.display())));
    }
    let read_len = |r: &mut std::io::BufReader<std::fs::File>, max: u32, what: &str| -> Result<u32, BackupError> {
        let mut len = [0u8; 4];
        r.read_exact(&mut len).map_err(|_| BackupError::Damaged(format!("cut short before the {what}")))?;
        let len = u32::from_le_bytes(len);
        if len > max {
            return Err(BackupError::Damaged(format!("a {what} of {len} bytes")));
        }
        Ok(len)
    };
    let head_len = read_len(&mut r, HEADER_MAX, "header")?;
    let mut head = vec![0u8; head_len as usize];
    r.read_exact(&mut head).map_err(|_| BackupError::Damaged("cut short in the header".into()))?;
    let header: BackupHeader =
        postcard::from_bytes(&head).map_err(|e| BackupError::Damaged(format!("the header: {e}")))?;
    let mut chunks = Vec::with_capacity(header.chunks.min(1 << 20) as usize);
    for i in 0..header.chunks {
        let len = read_len(&mut r, CHUNK_MAX, "chunk")?;
        let mut chunk = vec![0u8; len as usize];
        r.read_exact(&mut chunk).map_err(|_| BackupError::Damaged(format!("cut short in chunk {i}")))?;
        chunks.push(chunk);
    }
    if r.read(&mut [0u8; 1]).map_err(io)? != 0 {
        return Err(BackupError::Damaged("bytes after the last chunk".into()));
    }
    let state = Chunked::from_chunks(chunks);
    if state.root != header.proof.root || state.len() != header.len {
        return Err(BackupError::Damaged("the state does not match the certified root".into()));
    }
    if !header.by_executors {
        let m = &header.membership;
        let quorum = m.quorums().map_err(|e| BackupError::Damaged(e.to_string()))?.order_quorum();
        let keys = keel_core::crypto::NodeKeys::new(&m.keys());
        // The first checkpoint of an epoch is signed by the epoch before; any other, by
        // the membership it names.
        let signers = m.previous.as_deref().filter(|_| header.proof.seq == m.since);
        let signed = match signers {
            Some(prev) => prev.quorums().is_ok_and(|q| {
                proof_signed(&keel_core::crypto::NodeKeys::new(&prev.keys()), q.order_quorum(), &header.proof)
            }),
            None => proof_signed(&keys, quorum, &header.proof),
        };
        if !signed {
            return Err(BackupError::Damaged("the certificate's signatures do not check out".into()));
        }
    }
    Ok(Backup { header, state })
}
