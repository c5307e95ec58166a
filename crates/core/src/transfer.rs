//! Fetching a checkpoint's state from peers (BFT-SMaRt §II-C2): the manifest (chunk
//! digests) must hash to a root the asker already trusts, and every chunk must match its
//! digest, so any peer may serve any part. Different chunks go to different peers in
//! parallel, a throttle bounds the rate, and chunks the node already holds are reused.
//!
//! Sans-IO and shared by the order nodes (replica/catch_up.rs) and the execution nodes
//! of a separated cluster (exec_node.rs); each decides which peers serve it.

use crate::crypto::Digest;
use crate::exec::{leaf_digest, merkle_root, Chunked, Executor};
use crate::message::{Message, NodeId, Seq, StableProof};
use crate::service::Service;
use crate::step::{Event, Outputs, Peer, Persist, Reject};
use std::collections::BTreeMap;

/// Chunk requests outstanding at once during a state transfer.
const TRANSFER_INFLIGHT_MAX: usize = 16;

/// A state transfer in progress toward the checkpoint `seq` with Merkle root `root`.
#[derive(Debug)]
pub struct Transfer {
    seq: Seq,
    root: Digest,
    /// Snapshot length and chunk digests, once a manifest matching `root` arrived.
    manifest: Option<(u64, Vec<Digest>)>,
    chunks: Vec<Option<Vec<u8>>>,
    /// Chunk index → (peer asked, when).
    requested: BTreeMap<u32, (NodeId, u64)>,
    /// Rotates chunk requests over the peers.
    next_peer: usize,
    /// Chunks below this index are all here (where the next request scan starts).
    first_missing: usize,
    /// Chunks fetched for an earlier manifest, by digest, until this one's manifest
    /// says which of them it repeats.
    spare: BTreeMap<Digest, Vec<u8>>,
    /// Snapshots this node held when the transfer started (an older stable checkpoint,
    /// its own diverging one), kept until the manifest says which chunks they supply.
    /// Any source is safe: each chunk is checked against the manifest's digest.
    held: Vec<Chunked>,
    /// Chunks filled from `spare` or from this node's own snapshots, not fetched.
    reused: usize,
    /// Throttle (`Options::transfer_rate_bytes`): bytes that may be requested now, and
    /// when the allowance was last topped up.
    allowance: u64,
    topped_up_at: u64,
}

impl Transfer {
    /// A transfer toward (`seq`, `root`). It keeps what `previous` (the transfer it
    /// replaces) fetched: peers serve only their newest checkpoint, so a transfer slower
    /// than the checkpoints would otherwise start from zero each time and might never
    /// finish; chunks are content-defined, so most recur. `first_peer` spreads the first
    /// requests of different nodes over different peers.
    pub(crate) fn new(
        seq: Seq,
        root: Digest,
        previous: Option<Transfer>,
        held: Vec<Chunked>,
        now: u64,
        first_peer: usize,
    ) -> Transfer {
        let (spare, mut older) = previous.map(Transfer::into_reusable).unwrap_or_default();
        older.extend(held);
        Transfer {
            seq,
            root,
            manifest: None,
            chunks: Vec::new(),
            requested: BTreeMap::new(),
            next_peer: first_peer,
            first_missing: 0,
            spare,
            held: older,
            reused: 0,
            allowance: 0,
            topped_up_at: now,
        }
    }

    pub fn seq(&self) -> Seq {
        self.seq
    }

    /// (chunks held, chunks total).
    pub fn progress(&self) -> (usize, usize) {
        (self.chunks.iter().filter(|c| c.is_some()).count(), self.chunks.len())
    }

    /// Whether the manifest is still to come (ask every peer for it again).
    pub(crate) fn awaits_manifest(&self) -> bool {
        self.manifest.is_none()
    }

    /// What the next transfer may reuse of this one: the chunks it holds, by digest,
    /// and the snapshots it was given.
    fn into_reusable(self) -> (BTreeMap<Digest, Vec<u8>>, Vec<Chunked>) {
        let mut fetched = self.spare;
        if let Some((_, leaves)) = self.manifest {
            fetched.extend(leaves.into_iter().zip(self.chunks).filter_map(|(d, c)| Some((d, c?))));
        }
        (fetched, self.held)
    }

    /// Takes the manifest if it is for this transfer and matches its root. Chunks this
    /// node already holds need no fetching: those of the transfer this one replaced, those
    /// it was given, and those of `own` (its current snapshots: a node that recovered from
    /// disk and fell behind keeps most of its state's chunks).
    pub(crate) fn on_manifest<'a>(
        &mut self,
        seq: Seq,
        len: u64,
        leaves: Vec<Digest>,
        own: impl Iterator<Item = &'a Chunked>,
    ) -> Result<(), Reject> {
        if seq != self.seq || self.manifest.is_some() {
            return Ok(());
        }
        // The root binds the length, the chunk count and every chunk digest.
        if merkle_root(len, &leaves) != self.root {
            return Err(Reject::BadProof("manifest does not match the stable root"));
        }
        self.chunks = vec![None; leaves.len()];
        let spare = std::mem::take(&mut self.spare);
        let held = std::mem::take(&mut self.held);
        let mut sources: Vec<&Chunked> = held.iter().collect();
        for c in own {
            sources.push(c);
        }
        // Where each held chunk is; read only if the manifest wants it. A held chunk
        // that left memory and cannot be read back is fetched like any missing one.
        let own: BTreeMap<&Digest, (&Chunked, u32)> = sources
            .into_iter()
            .flat_map(|c| c.leaves.iter().enumerate().map(move |(i, d)| (d, (c, i as u32))))
            .collect();
        for (slot, digest) in self.chunks.iter_mut().zip(&leaves) {
            let data = match spare.get(digest) {
                Some(data) => Some(data.clone()),
                None => own.get(digest).and_then(|(c, i)| c.chunk(*i).ok().flatten()).map(|d| d.to_vec()),
            };
            if let Some(data) = data {
                *slot = Some(data);
                self.reused += 1;
            }
        }
        self.manifest = Some((len, leaves));
        Ok(())
    }

    /// Takes a chunk if it matches its digest in the manifest (a chunk that does not is
    /// asked of someone else at the next request).
    pub(crate) fn on_chunk(&mut self, seq: Seq, index: u32, data: Vec<u8>) -> Result<(), Reject> {
        if seq != self.seq {
            return Ok(());
        }
        let Some((_, leaves)) = &self.manifest else {
            return Ok(());
        };
        let Some(expected) = leaves.get(index as usize) else {
            return Err(Reject::BadProof("chunk index outside the manifest"));
        };
        self.requested.remove(&index);
        if leaf_digest(&data) != *expected {
            return Err(Reject::BadProof("chunk does not match its digest"));
        }
        self.chunks[index as usize] = Some(data);
        Ok(())
    }

    /// Asks `peers` for missing chunks: up to `TRANSFER_INFLIGHT_MAX` at once, and with a
    /// throttle of `rate` bytes per second (0: none) only as many bytes as it allowed
    /// since the last top-up (at most one window's worth saved up, so an idle spell does
    /// not turn into a burst).
    pub(crate) fn request_chunks(
        &mut self,
        peers: &[NodeId],
        now: u64,
        rate: u64,
        chunk_bytes: u64,
        send: &mut Vec<(Peer, Message)>,
    ) {
        if self.manifest.is_none() || peers.is_empty() {
            return;
        }
        if rate > 0 {
            let earned = rate.saturating_mul(now.saturating_sub(self.topped_up_at)) / 1000;
            if earned > 0 {
                self.allowance = (self.allowance + earned).min(chunk_bytes * TRANSFER_INFLIGHT_MAX as u64);
                self.topped_up_at = now;
            }
        }
        while self.chunks.get(self.first_missing).is_some_and(Option::is_some) {
            self.first_missing += 1;
        }
        for index in self.first_missing as u32..self.chunks.len() as u32 {
            if self.requested.len() >= TRANSFER_INFLIGHT_MAX || (rate > 0 && self.allowance < chunk_bytes) {
                break;
            }
            if self.chunks[index as usize].is_some() || self.requested.contains_key(&index) {
                continue;
            }
            if rate > 0 {
                self.allowance -= chunk_bytes;
            }
            // Different chunks from different peers, in parallel.
            let peer = peers[self.next_peer % peers.len()];
            self.next_peer = self.next_peer.wrapping_add(1);
            self.requested.insert(index, (peer, now));
            send.push((Peer::Node(peer), Message::FetchChunk { seq: self.seq, index }));
        }
    }

    /// Forgets chunk requests older than `timeout`, to be asked again elsewhere.
    pub(crate) fn expire(&mut self, now: u64, timeout: u64) {
        self.requested.retain(|_, (_, at)| now < *at + timeout);
    }

    pub(crate) fn complete(&self) -> bool {
        self.manifest.is_some() && self.chunks.iter().all(Option::is_some)
    }

    /// Installs the transferred state, once complete, into `exec`: persists it as the
    /// snapshot at its instance and reports it; returns its chunks (to serve peers).
    ///
    /// # Panics
    /// If the state does not restore. The root was certified by a quorum that holds a
    /// correct node, so a correct node produced these bytes: failing to restore them is a
    /// bug in the service's snapshot code.
    pub(crate) fn install<S: Service>(self, exec: &mut Executor<S>, out: &mut Outputs) -> Chunked {
        let (seq, chunks, reused) = (self.seq, self.chunks.len(), self.reused);
        let chunked = self.into_chunked();
        // Fetched chunks, all in memory: reading them cannot fail, and they are read one
        // at a time, not joined beside the state they rebuild.
        match exec.restore_chunked(&chunked) {
            Ok(executed) if executed == seq => {}
            other => panic!("state transfer to {seq}: snapshot does not restore: {other:?}"),
        }
        out.persist.push(Persist::Snapshot { seq, chunked: chunked.clone() });
        out.events.push(Event::StateTransferDone { seq, chunks, reused });
        chunked
    }
}

impl Transfer {
    /// The fetched state, once complete, as its verified chunks.
    ///
    /// # Panics
    /// If the transfer is not complete.
    pub(crate) fn into_chunked(self) -> Chunked {
        assert!(self.complete(), "a transfer finishes once every chunk is here");
        let root = self.root;
        let chunked = Chunked::from_chunks(self.chunks.into_iter().flatten().collect());
        assert_eq!(chunked.root, root, "verified chunks reassemble to the root");
        chunked
    }
}

/// The answer to a peer's `FetchManifest { seq }` from a node whose newest certified
/// checkpoint is `stable`, with its chunks when it holds them: the manifest, or the
/// newer certificate if the peer asks for an older one (peers serve only their newest).
pub(crate) fn manifest_for(stable: &StableProof, held: Option<&Chunked>, seq: Seq) -> Option<Message> {
    match held {
        Some(c) if stable.seq == seq => Some(Message::Manifest { seq, len: c.len(), chunks: c.leaves.clone() }),
        _ if stable.seq > seq => Some(Message::StableCert(stable.clone())),
        _ => None,
    }
}

/// Answers a peer's `FetchChunk { seq, index }`, as [`manifest_for`]. A chunk that left
/// memory and cannot be read back goes unanswered (the asker asks another peer) and is
/// reported.
pub(crate) fn answer_chunk(
    stable: &StableProof,
    held: Option<&Chunked>,
    seq: Seq,
    index: u32,
    to: Peer,
    out: &mut Outputs,
) {
    let answer = match held {
        Some(c) if stable.seq == seq => match c.chunk(index) {
            Ok(data) => data.map(|data| Message::Chunk { seq, index, data: data.to_vec() }),
            Err(e) => {
                out.events.push(Event::SnapshotUnreadable { why: format!("serving the checkpoint at {seq}: {e}") });
                None
            }
        },
        _ if stable.seq > seq => Some(Message::StableCert(stable.clone())),
        _ => None,
    };
    if let Some(answer) = answer {
        out.send.push((to, answer));
    }
}
