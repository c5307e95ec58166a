//! Bringing a lagging node back: STATUS gossip, NEW-VIEW relay, decided values, and state
//! transfer of a stable checkpoint (BFT-SMaRt §II-C2).
//!
//! A laggard learns nothing on one peer's word: a NEW-VIEW proves itself, a stable
//! checkpoint carries Q signatures, a chunk must match the Merkle root, and a decided value
//! needs r + 1 matching claims (one of them from a correct node).

use super::{Event, Outputs, Peer, Persist, Reject, Replica};
use crate::crypto::Digest;
use crate::exec::{leaf_digest, merkle_root, Chunked};
use crate::message::{Message, NodeId, Seq, StableProof, Value, View};
use crate::service::Service;
use crate::wal::Record;
use std::collections::BTreeMap;

/// Chunk requests outstanding at once during a state transfer.
const TRANSFER_INFLIGHT_MAX: usize = 16;

/// A state transfer in progress toward the stable checkpoint `seq`.
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
    next_peer: u32,
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
    pub fn progress(&self) -> (usize, usize) {
        (self.chunks.iter().filter(|c| c.is_some()).count(), self.chunks.len())
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
}

impl<S: Service> Replica<S> {
    pub(super) fn on_status(
        &mut self,
        from: NodeId,
        view: View,
        executed: Seq,
        stable: Seq,
        out: &mut Outputs,
    ) -> Result<(), Reject> {
        self.peer_executed[from as usize] = executed;
        let gap = self.cfg.options.status_ms / 2;
        if self.now < self.helped_at[from as usize] + gap {
            return Ok(());
        }
        let peer = Peer::Node(from);
        let mut helped = false;
        if view < self.view {
            if let Some(nv) = &self.new_view {
                out.send.push((peer, Message::NewView(nv.clone())));
                helped = true;
            }
        }
        // A peer behind our stable checkpoint gets its proof: to fetch the state if it
        // executed less, or to make its own checkpoint stable if it lacks votes (say, the
        // last vote it needs was from a node that has since left the membership).
        if self.stable.seq > executed || self.stable.seq > stable {
            out.send.push((peer, Message::StableCert(self.stable.clone())));
            helped = true;
        } else if self.exec.executed() > executed {
            let last = self.exec.executed().min(executed + self.cfg.options.catch_up_values_max);
            for seq in executed + 1..=last {
                if let Some(value) = self.log.get(&seq).and_then(|s| s.decided_value.clone()) {
                    // Gated: we may vouch only for decisions we can no longer lose.
                    out.send_after_persist.push((peer, Message::Decided { seq, value }));
                    helped = true;
                }
            }
        }
        if helped {
            self.helped_at[from as usize] = self.now;
        }
        Ok(())
    }

    pub(super) fn on_stable_cert(
        &mut self,
        _from: NodeId,
        proof: StableProof,
        out: &mut Outputs,
    ) -> Result<(), Reject> {
        if proof.seq <= self.stable.seq {
            return Ok(());
        }
        self.validate_stable_proof(&proof)?;
        self.install_stable(proof, out);
        Ok(())
    }

    pub(super) fn on_decided(&mut self, from: NodeId, seq: Seq, value: Value, out: &mut Outputs) -> Result<(), Reject> {
        if seq <= self.exec.executed() {
            return Ok(());
        }
        self.in_window(seq)?;
        if value.requests.len() > self.cfg.options.batch_count_max {
            return Err(Reject::BadBatch("too many requests"));
        }
        let digest = value.digest();
        let weak = self.cfg.quorums.weak_quorum();
        let n = self.cfg.n();
        let slot = self.log.entry(seq).or_default();
        match slot.decided {
            Some(d) if d == digest => {
                if slot.decided_value.is_none() {
                    slot.decided_value = Some(value.clone());
                    self.persist(Record::DecidedValue { seq, value }, out);
                    self.maybe_execute(out);
                }
                return Ok(());
            }
            Some(_) => return Err(Reject::BadProof("decided claim contradicts a known decision")),
            None => {}
        }
        slot.claims.insert(from, digest);
        if slot.claimed_values.len() < n {
            slot.claimed_values.entry(digest).or_insert(value);
        }
        // Forget bodies nobody claims any more (a peer may change its claim).
        let claimed: Vec<Digest> = slot.claims.values().copied().collect();
        slot.claimed_values.retain(|d, _| claimed.contains(d));
        if slot.claims.values().filter(|d| **d == digest).count() >= weak {
            if let Some(value) = slot.claimed_values.get(&digest).cloned() {
                self.persist(Record::DecidedValue { seq, value: value.clone() }, out);
                self.decide(seq, digest, Some(value), out);
            }
        }
        Ok(())
    }

    /// Starts (or restarts) fetching the stable checkpoint's state from peers.
    ///
    /// A restart keeps what the previous transfer fetched: peers serve only their newest
    /// stable checkpoint, so a transfer slower than the checkpoints would otherwise start
    /// from zero each time and might never finish. Chunks are content-defined, so most of
    /// them recur in the newer checkpoint (exec.rs `Chunked`).
    pub(super) fn start_transfer(&mut self, held: Vec<Chunked>, out: &mut Outputs) {
        let seq = self.stable.seq;
        if self.transfer.as_ref().is_some_and(|t| t.seq == seq) {
            return;
        }
        let (spare, mut older) = self.transfer.take().map(Transfer::into_reusable).unwrap_or_default();
        older.extend(held);
        let held = older;
        self.transfer = Some(Transfer {
            seq,
            root: self.stable.root,
            manifest: None,
            chunks: Vec::new(),
            requested: BTreeMap::new(),
            next_peer: self.id + 1,
            first_missing: 0,
            spare,
            held,
            reused: 0,
            allowance: 0,
            topped_up_at: self.now,
        });
        out.events.push(Event::StateTransferStarted { seq });
        self.broadcast(Message::FetchManifest { seq }, out);
    }

    pub(super) fn on_fetch_manifest(&mut self, from: NodeId, seq: Seq, out: &mut Outputs) -> Result<(), Reject> {
        let peer = Peer::Node(from);
        match &self.stable_chunks {
            Some(c) if self.stable.seq == seq => {
                out.send.push((peer, Message::Manifest { seq, len: c.len(), chunks: c.leaves.clone() }));
            }
            _ if self.stable.seq > seq => out.send.push((peer, Message::StableCert(self.stable.clone()))),
            _ => {}
        }
        Ok(())
    }

    pub(super) fn on_fetch_chunk(
        &mut self,
        from: NodeId,
        seq: Seq,
        index: u32,
        out: &mut Outputs,
    ) -> Result<(), Reject> {
        let peer = Peer::Node(from);
        match &self.stable_chunks {
            Some(c) if self.stable.seq == seq => {
                if let Some(data) = c.chunk(index) {
                    out.send.push((peer, Message::Chunk { seq, index, data: data.to_vec() }));
                }
            }
            _ if self.stable.seq > seq => out.send.push((peer, Message::StableCert(self.stable.clone()))),
            _ => {}
        }
        Ok(())
    }

    pub(super) fn on_manifest(
        &mut self,
        _from: NodeId,
        seq: Seq,
        len: u64,
        leaves: Vec<Digest>,
        out: &mut Outputs,
    ) -> Result<(), Reject> {
        let Some(t) = self.transfer.as_mut().filter(|t| t.seq == seq && t.manifest.is_none()) else {
            return Ok(());
        };
        // The root binds the length, the chunk count and every chunk digest.
        if merkle_root(len, &leaves) != t.root {
            return Err(Reject::BadProof("manifest does not match the stable root"));
        }
        t.chunks = vec![None; leaves.len()];
        // Chunks this node already holds need no fetching: those of the transfer this
        // one replaced, and those of its own snapshots (a node that recovered from disk
        // and fell behind keeps most of its state's chunks).
        let spare = std::mem::take(&mut t.spare);
        let held = std::mem::take(&mut t.held);
        let own: BTreeMap<&Digest, &[u8]> = held
            .iter()
            .chain(self.stable_chunks.iter())
            .chain(self.own_checkpoints.values())
            .flat_map(|c| c.chunks())
            .collect();
        for (slot, digest) in t.chunks.iter_mut().zip(&leaves) {
            if let Some(data) = spare.get(digest).map(Vec::as_slice).or_else(|| own.get(digest).copied()) {
                *slot = Some(data.to_vec());
                t.reused += 1;
            }
        }
        t.manifest = Some((len, leaves));
        self.request_chunks(out);
        self.maybe_finish_transfer(out);
        Ok(())
    }

    pub(super) fn on_chunk(
        &mut self,
        from: NodeId,
        seq: Seq,
        index: u32,
        data: Vec<u8>,
        out: &mut Outputs,
    ) -> Result<(), Reject> {
        let Some(t) = self.transfer.as_mut().filter(|t| t.seq == seq) else {
            return Ok(());
        };
        let Some((_, leaves)) = &t.manifest else {
            return Ok(());
        };
        let Some(expected) = leaves.get(index as usize) else {
            return Err(Reject::BadProof("chunk index outside the manifest"));
        };
        if leaf_digest(&data) != *expected {
            // Ask someone else for it.
            t.requested.remove(&index);
            self.request_chunks(out);
            return Err(Reject::BadProof("chunk does not match its digest"));
        }
        let _ = from;
        t.chunks[index as usize] = Some(data);
        t.requested.remove(&index);
        self.request_chunks(out);
        self.maybe_finish_transfer(out);
        Ok(())
    }

    /// Asks peers for missing chunks: up to `TRANSFER_INFLIGHT_MAX` at once, and with a
    /// throttle only as many bytes as its rate allowed since the last top-up (at most one
    /// window's worth saved up, so an idle spell does not turn into a burst).
    pub(super) fn request_chunks(&mut self, out: &mut Outputs) {
        let n = self.cfg.n() as u32;
        let me = self.id;
        let now = self.now;
        let (rate, chunk_bytes) = (self.cfg.options.transfer_rate_bytes, self.cfg.options.chunk_bytes as u64);
        let Some(t) = self.transfer.as_mut() else {
            return;
        };
        if t.manifest.is_none() || n < 2 {
            return;
        }
        if rate > 0 {
            let earned = rate.saturating_mul(now.saturating_sub(t.topped_up_at)) / 1000;
            if earned > 0 {
                t.allowance = (t.allowance + earned).min(chunk_bytes * TRANSFER_INFLIGHT_MAX as u64);
                t.topped_up_at = now;
            }
        }
        while t.chunks.get(t.first_missing).is_some_and(Option::is_some) {
            t.first_missing += 1;
        }
        for index in t.first_missing as u32..t.chunks.len() as u32 {
            if t.requested.len() >= TRANSFER_INFLIGHT_MAX || (rate > 0 && t.allowance < chunk_bytes) {
                break;
            }
            if t.chunks[index as usize].is_some() || t.requested.contains_key(&index) {
                continue;
            }
            if rate > 0 {
                t.allowance -= chunk_bytes;
            }
            // Different chunks from different peers, in parallel.
            let mut peer = t.next_peer % n;
            if peer == me {
                peer = (peer + 1) % n;
            }
            t.next_peer = peer + 1;
            t.requested.insert(index, (peer, now));
            out.send.push((Peer::Node(peer), Message::FetchChunk { seq: t.seq, index }));
        }
    }

    /// Re-asks for the manifest or for chunks a peer did not deliver in time.
    pub(super) fn on_transfer_timeout(&mut self, out: &mut Outputs) {
        let timeout = self.cfg.options.retransmit_ms;
        let now = self.now;
        let Some(t) = self.transfer.as_mut() else {
            return;
        };
        if t.manifest.is_none() {
            let seq = t.seq;
            self.broadcast(Message::FetchManifest { seq }, out);
            return;
        }
        t.requested.retain(|_, (_, at)| now < *at + timeout);
        self.request_chunks(out);
    }

    fn maybe_finish_transfer(&mut self, out: &mut Outputs) {
        let Some(t) = &self.transfer else { return };
        if t.manifest.is_none() || t.chunks.iter().any(Option::is_none) {
            return;
        }
        let Some(t) = self.transfer.take() else { return };
        let (seq, chunks, reused) = (t.seq, t.chunks.len(), t.reused);
        let chunked = Chunked::from_chunks(t.chunks.into_iter().flatten().collect());
        assert_eq!(chunked.root, t.root, "verified chunks reassemble to the root");
        match self.exec.restore(&chunked.to_bytes()) {
            Ok(executed) if executed == seq => {}
            // Q nodes signed this root, so a correct node produced these bytes; failing
            // to restore them is a bug in the service's snapshot code.
            other => panic!("state transfer to {seq}: snapshot does not restore: {other:?}"),
        }
        out.persist.push(Persist::Snapshot { seq, chunked: chunked.clone() });
        out.events.push(Event::StateTransferDone { seq, chunks, reused });
        self.stable_chunks = Some(chunked);
        self.own_checkpoints = self.own_checkpoints.split_off(&(seq + 1));
        // Checkpoints frozen from the replaced state are void; execution takes them anew.
        self.state_generation += 1;
        self.pending_checkpoints.clear();
        let exec = &self.exec;
        self.pending.retain(|c, p| p.req.seq > exec.last_seq(*c));
        self.maybe_execute(out);
    }
}
