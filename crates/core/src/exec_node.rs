//! An execution node of a cluster with separated execution (UpRight §4.2, ARCHITECTURE
//! §2 and §5), as a sans-IO state machine.
//!
//! ```text
//!   order nodes ── Decided(seq, value) ──► r + 1 matching digests and the body: execute
//!   executed ──► replies to clients (designated node in full, the others a digest)
//!   every CP_INTERVAL ──► snapshot (durable) ──► signed hash to every order node
//!   every STATUS period ──► STATUS to order nodes: they answer a laggard with the newest
//!                           certified execution checkpoint and the commits after it
//!   certified checkpoint above what this node can reach ──► state transfer from peers
//! ```
//!
//! An execution node takes part in no agreement: what it executes, the order nodes
//! decided, and it believes a decision on `r + 1` matching commit notices (one from a
//! correct order node). Execution nodes cannot agree on a checkpoint among themselves;
//! order nodes certify one once `r + 1` matching signed hashes arrived, and refuse to
//! order far past it (replica/separated.rs). A node whose own checkpoint differs from a
//! certified one has diverged and fetches the certified state from its peers.
//!
//! Node ids: order nodes by their stable ids, execution nodes by
//! [`crate::config::stage_node`] of theirs ([`ClusterConfig::executors`]).
//!
//! Membership changes: an execution node executes the administrator's operation at the
//! same instance as the order nodes, so it knows each instance's epoch. It takes commit
//! notices from the members of the epoch of the instance it executes next, follows the
//! executed membership (its quorums too), and checkpoints where an epoch ends: the order
//! nodes end an epoch only once execution is certified that far (replica/separated.rs).
//! Its votes go to the members of the epoch and of the one before, whose removed members
//! may still be needed to end it.

use crate::config::{stage_id, ClusterConfig};
use crate::crypto::{Digest, NodeKeys, SigningKey};
use crate::exec::{Chunked, Executor};
use crate::message::{
    checkpoint_statement, owner_of, CheckpointVote, ClientId, Message, NodeId, Read, ReadConsistency, Reply, ReplyBody,
    Request, Seq, StableProof, Value, View,
};
use crate::quorum::Mutation;
use crate::read_wait::{ReadWaits, Until};
use crate::replica::PushQueues;
use crate::service::{ReadCtx, RestoreError, Service};
use crate::step::{check_session, Event, ExecutedRequest, Input, Outputs, Peer, Persist, Reject};
use crate::timeout::Timeout;
use crate::transfer::Transfer;
use std::collections::BTreeMap;

/// Results at most this long go out in full from every execution node, as from order
/// nodes when co-located.
const REPLY_INLINE_MAX: usize = crate::replica::REPLY_INLINE_MAX;

/// Commit notices for one instance: the first digest each order node named, and the
/// bodies by digest (one per distinct digest, at most one per order node).
#[derive(Default)]
struct Notices {
    by_node: BTreeMap<NodeId, Digest>,
    bodies: BTreeMap<Digest, Value>,
}

impl Notices {
    /// The digest of the value `need` order nodes agree on, once its body is here.
    fn decided(&self, need: usize) -> Option<Digest> {
        let mut counts: BTreeMap<&Digest, usize> = BTreeMap::new();
        for d in self.by_node.values() {
            *counts.entry(d).or_default() += 1;
        }
        counts.into_iter().find(|(d, c)| *c >= need && self.bodies.contains_key(*d)).map(|(d, _)| *d)
    }
}

pub struct ExecNode<S> {
    cfg: ClusterConfig,
    id: NodeId,
    signing: SigningKey,
    /// The execution nodes' keys (certificates of execution checkpoints).
    keys: NodeKeys,
    now: u64,
    exec: Executor<S>,
    /// Commit notices above the executed instance (bounded: see `on_commit`).
    notices: BTreeMap<Seq, Notices>,
    /// The newest execution checkpoint certified by `r + 1` matching signed hashes, as an
    /// order node forwarded it (genesis until then).
    stable: StableProof,
    /// The snapshot at `stable.seq` when this node holds it (served to peers).
    stable_chunks: Option<Chunked>,
    /// This node's checkpoints above `stable.seq`.
    own: BTreeMap<Seq, Chunked>,
    /// This node's votes for its checkpoints at or above the certified one, resent each
    /// retransmission period: the order nodes need `r + 1` matching ones at one instance,
    /// and a restarted order node learns where execution stands from them.
    votes: BTreeMap<Seq, CheckpointVote>,
    transfer: Option<Transfer>,
    /// Push events not yet acknowledged (replica/push.rs): execution nodes push, as
    /// co-located order nodes do.
    pushes: PushQueues,
    /// The executed instance at the last STATUS period: a node that has not moved while
    /// behind the certified checkpoint fetches it.
    executed_at_status: Seq,
    /// STATUS to the order nodes and peers, and the check for being stuck behind.
    status_timeout: Timeout,
    /// The retransmission round: pushes, checkpoint votes and certificates, fetches.
    retransmit_timeout: Timeout,
    /// Read-only operations waiting, and read-index probe rounds to the order nodes.
    reads: ReadWaits,
}

/// Own checkpoints kept above the certified one. The gate keeps execution within two
/// intervals of it; one more covers a certificate still on its way.
const OWN_KEPT: usize = 3;

impl<S: Service> crate::node::Node for ExecNode<S> {
    fn step(&mut self, now: u64, input: Input, out: &mut Outputs) {
        ExecNode::step(self, now, input, out)
    }

    fn config(&self) -> &ClusterConfig {
        ExecNode::config(self)
    }

    fn status(&self) -> crate::node::NodeStatus {
        let cfg = self.config();
        crate::node::NodeStatus {
            view: View(0),
            view_change_to: None,
            executed: self.executed(),
            stable: self.stable_seq(),
            transfer: self.transfer_progress(),
            peers: cfg.n() + cfg.exec_ids().len() - 1,
        }
    }

    fn admit(&self, from: NodeId, epoch: u64, msg: Message, _checked: bool) -> crate::node::Admit {
        crate::node::admit_at_stage_node(self.config(), from, epoch, msg)
    }
}

impl<S: Service> ExecNode<S> {
    /// A fresh execution node `id` (one of [`ClusterConfig::executors`]) with an empty state.
    ///
    /// # Panics
    /// If the configuration does not separate execution, `id` is not an execution node,
    /// or `signing` is not its key: a deployment error, found at start.
    pub fn new(cfg: ClusterConfig, id: NodeId, signing: SigningKey, service: S) -> ExecNode<S> {
        assert!(cfg.separated() && cfg.executors().contains(&id), "node {id} is not an execution node");
        let index = cfg.executors().offset(id).expect("an execution node of this configuration");
        assert_eq!(cfg.stages.executors[index], signing.public(), "signing key does not match the configuration");
        let mut exec = Executor::with_workers(service, cfg.options.exec_workers);
        exec.set_membership(cfg.membership.clone(), cfg.admin_key);
        exec.set_stages(cfg.stages.executors.len(), cfg.stages.rq.len());
        exec.set_tick_ms(cfg.options.tick_ms);
        exec.set_mutation(cfg.quorums.mutation());
        let (status_timeout, retransmit_timeout) =
            (Timeout::every(cfg.options.status_ms), Timeout::every(cfg.options.retransmit_ms));
        ExecNode {
            keys: cfg.exec_keys(),
            cfg,
            id,
            signing,
            now: 0,
            exec,
            notices: BTreeMap::new(),
            stable: StableProof::genesis(),
            stable_chunks: None,
            own: BTreeMap::new(),
            votes: BTreeMap::new(),
            transfer: None,
            pushes: PushQueues::default(),
            executed_at_status: Seq(0),
            reads: ReadWaits::default(),
            status_timeout,
            retransmit_timeout,
        }
    }

    /// Restarts from the newest of the snapshots this node persisted; the rest it learns
    /// from order nodes (commits) and peers (state transfer). `records` holds the
    /// certificate of the checkpoint it last collected its older snapshots on
    /// (`collect_snapshots`).
    ///
    /// # Errors
    /// If the snapshot does not restore.
    pub fn recover(
        cfg: ClusterConfig,
        id: NodeId,
        signing: SigningKey,
        service: S,
        mut snapshots: Vec<(Seq, Chunked)>,
        records: &[crate::wal::Record],
    ) -> Result<ExecNode<S>, RestoreError> {
        let mut node = ExecNode::new(cfg, id, signing, service);
        snapshots.sort_by_key(|(seq, _)| *seq);
        if let Some((seq, chunked)) = snapshots.last() {
            let executed =
                node.exec.restore_chunked(chunked).map_err(|e| RestoreError(format!("snapshot at {seq}: {}", e.0)))?;
            if executed != *seq {
                return Err(RestoreError(format!("snapshot filed under {seq} holds the state at {executed}")));
            }
            node.follow_membership()?;
        }
        // Every snapshot kept (the disk holds those at or above the certified checkpoint
        // this node knew), with a vote for each: after a restart the certified one may be
        // an older one, and a lagging peer needs it served.
        let first = snapshots.len().saturating_sub(OWN_KEPT);
        for (seq, chunked) in snapshots.into_iter().skip(first) {
            node.vote(seq, &chunked);
            node.own.insert(seq, chunked);
        }
        // The certificate it collected its older snapshots on, if it still holds that
        // state: it serves it and tells order nodes and peers of it again (on_tick), so
        // a lagging peer is not pointed at an older checkpoint nobody holds after the
        // order nodes that kept the certificate are gone (issue #21, defect 6). Its own
        // durable record, so not checked again (the membership may have moved since).
        let cert = records.iter().rev().find_map(|r| match r {
            crate::wal::Record::ExecStable(proof) => Some(proof),
            _ => None,
        });
        if let Some(proof) = cert {
            if let Some(chunked) = node.own.get(&proof.seq).filter(|c| c.root == proof.root) {
                node.stable_chunks = Some(chunked.clone());
                node.stable = proof.clone();
                node.own.retain(|s, _| *s > proof.seq);
                node.votes.retain(|s, _| *s >= proof.seq);
            }
        }
        Ok(node)
    }

    pub fn id(&self) -> NodeId {
        self.id
    }
    pub fn executed(&self) -> Seq {
        self.exec.executed()
    }
    pub fn stable_seq(&self) -> Seq {
        self.stable.seq
    }
    pub fn service(&self) -> &S {
        self.exec.service()
    }
    pub fn transferring(&self) -> bool {
        self.transfer.is_some()
    }
    /// (chunks held, chunks total) of a state transfer in progress.
    pub fn transfer_progress(&self) -> Option<(usize, usize)> {
        self.transfer.as_ref().map(Transfer::progress)
    }
    pub fn config(&self) -> &ClusterConfig {
        &self.cfg
    }

    pub fn status_line(&self) -> String {
        format!(
            "e{} exec {} stable {} notices {:?}..{:?} own {:?}{}",
            stage_id(self.id).unwrap_or(self.id.0),
            self.exec.executed(),
            self.stable.seq,
            self.notices.keys().next(),
            self.notices.keys().next_back(),
            self.own.keys().collect::<Vec<_>>(),
            self.transfer.as_ref().map(|t| format!(" transfer {:?}", t.progress())).unwrap_or_default()
        )
    }

    pub fn step(&mut self, now: u64, input: Input, out: &mut Outputs) {
        self.now = self.now.max(now);
        match input {
            Input::Tick => self.on_tick(out),
            Input::Message { from, msg } => self.on_message(from, msg, out),
            // No verify stage runs for an execution node; a checked message is a message.
            Input::Checked { from, msg } => self.on_message(Peer::Node(from), msg, out),
            // Checkpoints are taken inline here.
            Input::CheckpointReady(_) => {}
            // It never asks for a durability barrier.
            Input::Drained => {}
        }
        self.invariants();
    }

    /// Whether `node` is an order node of this node's epoch (by stable id).
    fn is_order_node(&self, node: NodeId) -> bool {
        self.cfg.membership.index_of(node).is_some()
    }

    /// Whether `node` is an order node of this epoch or of the one before, which may still
    /// be ending (a removed member among them).
    fn is_recent_order_node(&self, node: NodeId) -> bool {
        self.is_order_node(node) || self.cfg.membership.previous.as_ref().is_some_and(|p| p.index_of(node).is_some())
    }

    /// The order nodes of this epoch, by stable id.
    fn order_nodes(&self) -> Vec<NodeId> {
        self.cfg.membership.members.iter().map(|m| NodeId(m.id)).collect()
    }

    /// The order nodes of this epoch and of the one before: where checkpoint votes,
    /// certificates and STATUS go. The previous epoch's members end it only once they
    /// saw execution certified at its last instance, the removed ones included.
    fn recent_order_nodes(&self) -> Vec<NodeId> {
        let mut ids = self.order_nodes();
        if let Some(p) = &self.cfg.membership.previous {
            let gone: Vec<NodeId> = p.members.iter().map(|m| NodeId(m.id)).filter(|id| !ids.contains(id)).collect();
            ids.extend(gone);
        }
        ids
    }

    /// After executing (or restoring) a state of a later epoch: that epoch's membership
    /// and quorums from now on, and commit notices only from its members.
    ///
    /// # Errors
    /// If that membership tolerates no (u, r): never one the executor applied (it checks),
    /// so only a snapshot from this node's disk that is not what it wrote.
    fn follow_membership(&mut self) -> Result<(), RestoreError> {
        let next = self.exec.membership();
        if next.epoch == self.cfg.epoch() {
            return Ok(());
        }
        self.cfg =
            self.cfg.next_epoch(next.clone()).map_err(|e| RestoreError(format!("snapshot's membership: {e}")))?;
        let members = &self.cfg.membership;
        for notices in self.notices.values_mut() {
            notices.by_node.retain(|n, _| members.index_of(*n).is_some());
            let named: std::collections::BTreeSet<Digest> = notices.by_node.values().copied().collect();
            notices.bodies.retain(|d, _| named.contains(d));
        }
        self.reads = ReadWaits::default();
        Ok(())
    }

    fn is_peer(&self, node: NodeId) -> bool {
        node != self.id && self.cfg.executors().contains(&node)
    }

    fn on_message(&mut self, from: Peer, msg: Message, out: &mut Outputs) {
        let kind = msg.kind();
        let result = match (from, msg) {
            (Peer::Client(c), Message::Request(req)) => self.on_request(c, req, out),
            (Peer::Client(c), Message::Read(read)) => self.on_read(c, read, out),
            (Peer::Node(n), Message::IndexAck { round, accepted }) if self.is_order_node(n) => {
                self.reads.ack(n, round, accepted);
                self.finish_index_rounds(out);
                Ok(())
            }
            (Peer::Client(c), Message::PushAck { client, upto }) => {
                if owner_of(client) == c {
                    self.pushes.ack(client, upto);
                    Ok(())
                } else {
                    Err(Reject::WrongPeer)
                }
            }
            (Peer::Node(n), Message::Decided { seq, value }) if self.is_order_node(n) => {
                self.on_commit(n, seq, value, out)
            }
            // A member of the next epoch this node has not executed into yet (order nodes
            // resend what it misses on its STATUS), or of the last one ending.
            (Peer::Node(n), Message::Decided { .. }) if stage_id(n).is_none() => Ok(()),
            (Peer::Node(n), Message::StableCert(proof)) if self.is_recent_order_node(n) || self.is_peer(n) => {
                self.on_stable_cert(proof, out)
            }
            (Peer::Node(n), Message::FetchManifest { seq }) if self.is_peer(n) => {
                self.on_fetch_manifest(from, seq, out)
            }
            (Peer::Node(n), Message::FetchChunk { seq, index }) if self.is_peer(n) => {
                self.on_fetch_chunk(from, seq, index, out)
            }
            // The administrator's backup (backup.rs) fetches a checkpoint as a peer would.
            (Peer::Client(c), Message::FetchManifest { seq }) if owner_of(c) == crate::membership::ADMIN_CLIENT => {
                self.on_fetch_manifest(from, seq, out)
            }
            (Peer::Client(c), Message::FetchChunk { seq, index }) if owner_of(c) == crate::membership::ADMIN_CLIENT => {
                self.on_fetch_chunk(from, seq, index, out)
            }
            (Peer::Node(n), Message::Manifest { seq, len, chunks }) if self.is_peer(n) => {
                self.on_manifest(seq, len, chunks, out)
            }
            (Peer::Node(n), Message::Chunk { seq, index, data }) if self.is_peer(n) => {
                self.on_chunk(seq, index, data, out)
            }
            (_, _) => Err(Reject::WrongPeer),
        };
        match result {
            Ok(()) | Err(Reject::Late { .. }) => {}
            Err(reason) => out.events.push(Event::Rejected { from, kind, reason }),
        }
    }

    /// A client that missed its reply retransmits to execution nodes too: answered in
    /// full from the reply cache. Anything else waits for the order nodes.
    fn on_request(&mut self, from: ClientId, req: Request, out: &mut Outputs) -> Result<(), Reject> {
        if owner_of(req.client) != from {
            return Err(Reject::WrongPeer);
        }
        if let Some(result) = self.exec.cached(req.client, req.seq) {
            let body = crate::codec::reply_body(result.to_vec(), true);
            let reply = Reply { client: req.client, view: View(0), seq: req.seq, body, epoch: self.cfg.epoch() };
            out.send.push((Peer::Client(req.client), Message::Reply(reply)));
        }
        Ok(())
    }

    /// A commit notice: order node `from` says instance `seq` decided `value`.
    fn on_commit(&mut self, from: NodeId, seq: Seq, value: Value, out: &mut Outputs) -> Result<(), Reject> {
        let executed = self.exec.executed();
        if seq <= executed {
            return Err(Reject::Late { seq, stable: executed });
        }
        // Order nodes run at most two intervals past the certified execution checkpoint
        // (replica/separated.rs), so a correct one never sends farther ahead than this.
        // A node more than an interval behind the certified checkpoint fetches it, so
        // notices below it are no use. A Byzantine order node can fill the window, one
        // body per instance: `log_max` of them at most.
        let (low, high) = self.notice_window();
        if seq <= low || seq > high {
            return Err(Reject::OutOfWindow { seq, low, high });
        }
        crate::replica::check_batch_bytes(&self.cfg.options, &value)?;
        let digest = value.digest();
        let notices = self.notices.entry(seq).or_default();
        if notices.by_node.contains_key(&from) {
            return Ok(());
        }
        notices.by_node.insert(from, digest);
        notices.bodies.entry(digest).or_insert(value);
        self.maybe_execute(out);
        Ok(())
    }

    /// The instances whose commit notices this node keeps: (low, high].
    fn notice_window(&self) -> (Seq, Seq) {
        let low = if self.far_behind() { self.stable.seq } else { self.exec.executed() };
        (low, low + self.cfg.options.log_max())
    }

    /// More than an interval behind the certified checkpoint: it fetches that state.
    fn far_behind(&self) -> bool {
        self.stable.seq > self.exec.executed() + self.cfg.options.checkpoint_interval
    }

    /// Executes what became decided, in order, and checkpoints every interval.
    fn maybe_execute(&mut self, out: &mut Outputs) {
        if self.transfer.is_some() {
            return;
        }
        let interval = self.cfg.options.checkpoint_interval;
        loop {
            // This epoch's: notices come from its members only (`follow_membership`).
            let need = self.cfg.quorums.commit_quorum();
            let seq = self.exec.executed() + 1;
            let Some(digest) = self.notices.get(&seq).and_then(|n| n.decided(need)) else {
                break;
            };
            // Taken, not cloned (a batch of requests): the notices for `seq` are done.
            let Some(value) = self.notices.remove(&seq).and_then(|mut n| n.bodies.remove(&digest)) else {
                break;
            };
            let ops: Vec<Digest> = value.requests.iter().map(|r| r.op.digest()).collect();
            let outcomes = self.exec.execute(seq, &value);
            let mut executed = Vec::new();
            for (o, op) in outcomes.into_iter().zip(ops) {
                if !o.fresh {
                    continue;
                }
                executed.push(ExecutedRequest { client: o.client, seq: o.seq, op });
                let body = self.reply_body(o.client, o.seq, o.result);
                let reply = Reply { client: o.client, view: View(0), seq: o.seq, body, epoch: self.cfg.epoch() };
                out.send.push((Peer::Client(o.client), Message::Reply(reply)));
                // Nothing to wait for: a restarted execution node executes the same
                // decided values again and numbers the same events alike.
                self.pushes.push(&o.pushes, self.cfg.epoch(), &mut out.send, &mut out.events);
            }
            for tick in self.exec.take_ticks() {
                self.pushes.push(&tick.pushes, self.cfg.epoch(), &mut out.send, &mut out.events);
                out.events.push(Event::Ticked { seq: tick.seq, time: tick.time });
            }
            out.events.push(Event::Executed { seq, requests: executed });
            let epoch_ended = self.exec.membership().epoch > self.cfg.epoch();
            if epoch_ended {
                // The executor applied it, so it has valid quorums.
                self.follow_membership().unwrap_or_else(|e| unreachable!("{e}"));
            }
            let at_epoch_end = epoch_ended && self.cfg.quorums.mutation() != Some(Mutation::NoEpochEndCheckpoint);
            if seq.is_multiple_of(interval) || at_epoch_end {
                self.take_checkpoint(seq, out);
            }
        }
        self.answer_reads(out);
    }

    /// Large results in full from one designated execution node, a digest from the others
    /// (the client computes the same designated node).
    fn reply_body(&self, client: ClientId, seq: u64, result: Vec<u8>) -> ReplyBody {
        let executors = self.cfg.executors();
        let designated = executors.at((client.0.wrapping_add(seq) % executors.len().max(1) as u64) as usize);
        let full = designated == self.id || result.len() <= REPLY_INLINE_MAX;
        crate::codec::reply_body(result, full)
    }

    /// Snapshot (durable before the vote leaves), then a signed hash to every order node.
    fn take_checkpoint(&mut self, seq: Seq, out: &mut Outputs) {
        let chunked = Chunked::from_pieces(self.exec.pieces(), self.cfg.options.chunk_bytes);
        let root = chunked.root;
        let membership = self.exec.membership().digest();
        out.persist.push(Persist::Snapshot { seq, chunked: chunked.clone() });
        out.events.push(Event::Checkpoint { seq, root });
        let vote = self.vote_with(seq, root, membership);
        for node in self.recent_order_nodes() {
            out.send_after_persist.push((Peer::Node(node), Message::Checkpoint(vote.clone())));
        }
        if seq == self.stable.seq {
            self.compare_with_stable(chunked, out);
        } else if seq > self.stable.seq {
            self.own.insert(seq, chunked);
            while self.own.len() > OWN_KEPT {
                self.own.pop_first();
            }
        }
    }

    /// Signs and keeps this node's vote for its checkpoint at `seq`.
    fn vote_with(&mut self, seq: Seq, root: Digest, membership: Digest) -> CheckpointVote {
        let sig = self.signing.sign(&checkpoint_statement(seq, &root, &membership, self.id));
        let vote = CheckpointVote { seq, root, membership, sig };
        self.votes.insert(seq, vote.clone());
        while self.votes.len() > OWN_KEPT + 1 {
            self.votes.pop_first();
        }
        vote
    }

    /// A vote for a snapshot this node holds (recovered from its disk).
    fn vote(&mut self, seq: Seq, chunked: &Chunked) {
        if let Some(m) = crate::exec::snapshot_membership(chunked) {
            self.vote_with(seq, chunked.root, m.digest());
        }
    }

    /// A certified execution checkpoint, forwarded by an order node (or a peer).
    fn on_stable_cert(&mut self, proof: StableProof, out: &mut Outputs) -> Result<(), Reject> {
        if proof.seq <= self.stable.seq {
            return Ok(());
        }
        let quorum = self.cfg.quorums.exec_checkpoint_quorum();
        if !crate::replica::exec_proof_valid(&self.cfg, &self.keys, quorum, &proof) {
            return Err(Reject::BadProof("execution checkpoint not certified by u + 1 execution nodes"));
        }
        self.stable = proof;
        self.stable_chunks = None;
        let seq = self.stable.seq;
        self.votes.retain(|s, _| *s >= seq);
        if let Some(own) = self.own.remove(&seq) {
            self.own.retain(|s, _| *s > seq);
            self.compare_with_stable(own, out);
            return Ok(());
        }
        self.own.retain(|s, _| *s > seq);
        // Behind the certified checkpoint with no way to execute up to it (the order
        // nodes no longer keep the commits in between), or more than an interval behind
        // it (commits come a few dozen per STATUS period: a node that missed a lot under
        // load would never catch up). A transfer toward an older one moves to this one
        // (peers serve only their newest), keeping the chunks it has.
        let executed = self.exec.executed();
        let need = self.cfg.quorums.commit_quorum();
        let next_decided = self.notices.get(&(executed + 1)).is_some_and(|n| n.decided(need).is_some());
        if self.far_behind() {
            // Notices below the certified checkpoint are no use now (`notice_window`).
            self.notices.retain(|s, _| *s > seq);
        }
        if self.transfer.is_some() || (seq > executed && (!next_decided || self.far_behind())) {
            self.start_transfer(Vec::new(), out);
        }
        Ok(())
    }

    /// Our own snapshot at the certified instance: equal, it is what we serve; different,
    /// this node diverged (a fault) and fetches the certified state.
    fn compare_with_stable(&mut self, chunked: Chunked, out: &mut Outputs) {
        if chunked.root == self.stable.root {
            self.stable_chunks = Some(chunked);
            self.collect_snapshots(out);
        } else {
            out.events.push(Event::Divergence { seq: self.stable.seq, local: chunked.root, stable: self.stable.root });
            self.start_transfer(vec![chunked], out);
        }
    }

    fn start_transfer(&mut self, held: Vec<Chunked>, out: &mut Outputs) {
        let seq = self.stable.seq;
        if self.transfer.as_ref().is_some_and(|t| t.seq() == seq) {
            return;
        }
        let previous = self.transfer.take();
        let replacing = previous.as_ref().map(|t| t.seq());
        let first_peer = self.cfg.executors().offset(self.id).unwrap_or(0);
        self.transfer = Some(Transfer::new(seq, self.stable.root, previous, held, self.now, first_peer));
        out.events.push(Event::StateTransferStarted { seq, replacing });
        self.to_peers(Message::FetchManifest { seq }, out);
    }

    fn peers(&self) -> Vec<NodeId> {
        self.cfg.executors().filter(|n| *n != self.id).collect()
    }

    fn to_peers(&self, msg: Message, out: &mut Outputs) {
        for n in self.peers() {
            out.send.push((Peer::Node(n), msg.clone()));
        }
    }

    fn on_fetch_manifest(&mut self, from: Peer, seq: Seq, out: &mut Outputs) -> Result<(), Reject> {
        if let Some(answer) = crate::transfer::manifest_for(&self.stable, self.stable_chunks.as_ref(), seq) {
            out.send.push((from, answer));
        }
        Ok(())
    }

    fn on_fetch_chunk(&mut self, from: Peer, seq: Seq, index: u32, out: &mut Outputs) -> Result<(), Reject> {
        crate::transfer::answer_chunk(&self.stable, self.stable_chunks.as_ref(), seq, index, from, out);
        Ok(())
    }

    fn on_manifest(&mut self, seq: Seq, len: u64, leaves: Vec<Digest>, out: &mut Outputs) -> Result<(), Reject> {
        let Some(t) = self.transfer.as_mut() else {
            return Ok(());
        };
        t.on_manifest(seq, len, leaves, self.own.values())?;
        self.request_chunks(out);
        self.maybe_finish_transfer(out);
        Ok(())
    }

    fn on_chunk(&mut self, seq: Seq, index: u32, data: Vec<u8>, out: &mut Outputs) -> Result<(), Reject> {
        let Some(t) = self.transfer.as_mut() else {
            return Ok(());
        };
        let taken = t.on_chunk(seq, index, data);
        self.request_chunks(out);
        self.maybe_finish_transfer(out);
        taken
    }

    fn request_chunks(&mut self, out: &mut Outputs) {
        let peers = self.peers();
        let (rate, chunk_bytes) = (self.cfg.options.transfer_rate_bytes, self.cfg.options.chunk_bytes as u64);
        if let Some(t) = self.transfer.as_mut() {
            t.request_chunks(&peers, self.now, rate, chunk_bytes, &mut out.send);
        }
    }

    fn maybe_finish_transfer(&mut self, out: &mut Outputs) {
        if !self.transfer.as_ref().is_some_and(Transfer::complete) {
            return;
        }
        let Some(t) = self.transfer.take() else { return };
        let seq = t.seq();
        // u + 1 execution nodes signed the root (a correct one among them).
        self.stable_chunks = Some(t.install(&mut self.exec, out));
        // A state u + 1 execution nodes certified, one correct among them: as `install`,
        // which panics on a certified state that does not restore.
        self.follow_membership().unwrap_or_else(|e| unreachable!("certified state: {e}"));
        self.own.retain(|s, _| *s > seq);
        self.notices.retain(|s, _| *s > seq);
        self.collect_snapshots(out);
        self.maybe_execute(out);
    }

    /// Snapshots below the certified checkpoint are never needed again: this node
    /// restarts from the certified one or a later one of its own, and keeps the
    /// certificate with them (`recover`).
    fn collect_snapshots(&self, out: &mut Outputs) {
        let records = vec![crate::wal::Record::ExecStable(self.stable.clone())];
        out.persist.push(Persist::Compact { records, snapshots_from: self.stable.seq });
    }

    fn on_tick(&mut self, out: &mut Outputs) {
        if self.cfg.options.transfer_rate_bytes > 0 {
            self.request_chunks(out);
        }
        self.reads.expire(self.now, self.cfg.options.request_timeout_ms);
        if let Some((round, answered)) = self.reads.round_to_resend(self.now, self.cfg.options.retransmit_ms) {
            for node in self.order_nodes().into_iter().filter(|n| !answered.contains(n)) {
                out.send.push((Peer::Node(node), Message::IndexProbe { round }));
            }
        }
        if self.retransmit_timeout.fire(self.now) {
            self.pushes.resend(self.cfg.epoch(), &mut out.send);
            if self.stable.seq > Seq(0) {
                // For an order node that missed the votes (replica/separated.rs
                // `on_exec_stable_cert`), and for a peer that restarted empty after
                // every order node it knows of was removed: it fetches this state from
                // the peers and learns the membership from it.
                for node in self.recent_order_nodes().into_iter().chain(self.peers()) {
                    out.send.push((Peer::Node(node), Message::StableCert(self.stable.clone())));
                }
            }
            let recent = self.recent_order_nodes();
            for vote in self.votes.values() {
                for &node in &recent {
                    // Gated: a vote whose snapshot is still being written waits for it.
                    out.send_after_persist.push((Peer::Node(node), Message::Checkpoint(vote.clone())));
                }
            }
            if let Some(t) = self.transfer.as_mut() {
                if t.awaits_manifest() {
                    let seq = t.seq();
                    self.to_peers(Message::FetchManifest { seq }, out);
                } else {
                    t.expire(self.now, self.cfg.options.retransmit_ms);
                    self.request_chunks(out);
                }
            }
        }
        if self.status_timeout.fire(self.now) {
            let executed = self.exec.executed();
            if self.stable.seq > executed && executed == self.executed_at_status && self.transfer.is_none() {
                // Stuck behind the certified checkpoint: the commits in between are gone.
                self.start_transfer(Vec::new(), out);
            }
            self.executed_at_status = executed;
            let status = Message::Status { view: View(0), executed: self.exec.executed(), stable: self.stable.seq };
            for node in self.recent_order_nodes() {
                out.send.push((Peer::Node(node), status.clone()));
            }
        }
    }

    /// A read-only operation (ARCHITECTURE §7). Execution nodes vote in no agreement, so
    /// where an order node answers a linearizable read once it executed all it voted to
    /// accept (replica/read.rs), an execution node first asks a quorum of order nodes how
    /// far they voted (a read index, the same probe round), and answers once it executed
    /// that far: a completed write was accepted by `u + 1` correct order nodes, any quorum
    /// includes one, so the index is at or past it, and `r + 1` matching answers include
    /// a correct node's. A read index is the same, sent to `r + 1` execution nodes only.
    /// A serializable read waits for the reader's last ordered request. The client's
    /// own connection authenticates it (as for requests here: an execution node checks
    /// no client MACs).
    fn on_read(&mut self, from: ClientId, read: Read, out: &mut Outputs) -> Result<(), Reject> {
        check_session(Peer::Client(from), read.client)?;
        if !self.reads.is_new(&read, self.cfg.options.clients_max)? {
            return Ok(());
        }
        let mutation = self.cfg.quorums.mutation();
        let until = match read.consistency {
            ReadConsistency::Serializable if mutation == Some(Mutation::SerializableWithoutWait) => {
                Until::ClientExecuted(0)
            }
            ReadConsistency::Serializable => Until::ClientExecuted(read.after),
            ReadConsistency::Linearizable if mutation == Some(Mutation::ReadWithoutWait) => Until::Executed(Seq(0)),
            ReadConsistency::Linearizable | ReadConsistency::Index => {
                let (until, started) = self.reads.index_wait(self.now, None);
                if let Some(round) = started {
                    self.probe(round, out);
                }
                until
            }
        };
        if self.ready_for(read.client, until) {
            self.answer(read, out);
        } else {
            self.reads.wait(read, until, self.now);
        }
        Ok(())
    }

    fn probe(&self, round: u64, out: &mut Outputs) {
        for node in self.order_nodes() {
            out.send.push((Peer::Node(node), Message::IndexProbe { round }));
        }
    }

    fn finish_index_rounds(&mut self, out: &mut Outputs) {
        let (completed, started) = self.reads.finish_rounds(self.cfg.quorums.index_quorum(), self.now, None);
        for round in started {
            self.probe(round, out);
        }
        if completed {
            self.answer_reads(out);
        }
    }

    fn ready_for(&self, client: ClientId, until: Until) -> bool {
        self.transfer.is_none()
            && match until {
                Until::ClientExecuted(seq) => self.exec.last_seq(client) >= seq,
                Until::Executed(seq) => self.exec.executed() >= seq,
                Until::Round(_) | Until::NextRound => false,
            }
    }

    fn answer_reads(&mut self, out: &mut Outputs) {
        let mut reads = std::mem::take(&mut self.reads);
        let ready = reads.take_ready(|client, until| self.ready_for(client, until));
        self.reads = reads;
        for read in ready {
            self.answer(read, out);
        }
    }

    fn answer(&self, read: Read, out: &mut Outputs) {
        out.events.push(Event::ReadAnswered { consistency: read.consistency });
        let ctx = ReadCtx { client: read.client, executed: self.exec.executed(), time: self.exec.time() };
        let body = match self.exec.service().execute_read_only(&read.op, &ctx) {
            None => ReplyBody::NotReadOnly,
            // Only the r + 1 nodes asked answer a read index, all needed: each in full.
            Some(result) if read.consistency == ReadConsistency::Index => crate::codec::reply_body(result, true),
            Some(result) => self.reply_body(read.client, read.seq, result),
        };
        let reply = Reply { client: read.client, view: View(0), seq: read.seq, body, epoch: self.cfg.epoch() };
        // As ordered replies: what it executed was decided and durable at the order nodes.
        out.send.push((Peer::Client(read.client), Message::Reply(reply)));
    }

    /// Checked after every step; cheap.
    pub fn invariants(&self) {
        assert!(self.reads.len() <= self.cfg.options.clients_max, "waiting reads are bounded");
        let executed = self.exec.executed();
        let (_, high) = self.notice_window();
        assert!(
            self.notices.keys().all(|s| *s > executed && *s <= high),
            "commit notices lie in the window above the executed instance"
        );
        assert!(self.notices.len() as u64 <= self.cfg.options.log_max(), "commit notices are bounded");
        assert!(self.own.len() <= OWN_KEPT, "own checkpoints kept are bounded");
        assert!(
            self.pushes.events() <= crate::replica::PUSH_EVENTS_MAX
                && self.pushes.bytes() <= crate::replica::PUSH_BYTES_MAX,
            "push queues are bounded"
        );
        assert!(
            self.notices.values().all(|n| n.by_node.len() <= self.cfg.n() && n.bodies.len() <= self.cfg.n()),
            "one notice and one body per order node and instance"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::client::Client;
    use crate::config::{stage_node, Auth, Options};
    use crate::crypto::PublicKey;
    use crate::quorum::{Mutation, Quorums};
    use crate::replica::{client_mac_key, Replica};
    use crate::service::OrderState;
    use crate::test_net::TestNet;

    use crate::replica::tests::{secrets, Log};

    /// u = r = 1: order nodes 0..4, execution nodes 4..7.
    fn config(mutation: Option<Mutation>) -> ClusterConfig {
        let q = Quorums::new(1, 1).expect("valid").with_mutation(mutation);
        let keys: Vec<PublicKey> = (0..4).map(|i| secrets(i).signing.public()).collect();
        let exec_keys: Vec<PublicKey> = (4..7).map(|i| secrets(i).signing.public()).collect();
        let options = Options { background_checkpoints: false, ..Options::test_min() };
        ClusterConfig::new(q, keys, options)
            .expect("valid")
            .with_auth(Auth::Mac)
            .with_executors(exec_keys)
            .expect("2u + 1 execution nodes")
    }

    fn client(cfg: &ClusterConfig, id: u64) -> Client {
        let keys = (0..cfg.n() as u32).map(|i| client_mac_key(&secrets(i).mac_secret, ClientId(id))).collect();
        Client::new(ClientId(id), cfg.quorums, keys, 100, 1).with_auth(cfg.auth).with_executors(cfg.exec_ids().into())
    }

    /// (u, r) = (1, 0): order nodes 0..3, execution nodes 3..6.
    fn config_cft() -> ClusterConfig {
        let q = Quorums::new(1, 0).expect("valid");
        let keys: Vec<PublicKey> = (0..3).map(|i| secrets(i).signing.public()).collect();
        let exec_keys: Vec<PublicKey> = (3..6).map(|i| secrets(i).signing.public()).collect();
        let options = Options { background_checkpoints: false, ..Options::test_min() };
        ClusterConfig::new(q, keys, options).expect("valid").with_executors(exec_keys).expect("2u + 1 execution nodes")
    }

    /// Order nodes and execution nodes on a lossless network (`test_net.rs`; stable ids
    /// 0..n and n..n + e: `config` gives 0..4 and 4..7).
    type Net = TestNet<OrderState, ExecNode<Log>>;

    impl Net {
        fn new(cfg: &ClusterConfig) -> Net {
            let n = cfg.n() as u32;
            let all = n + cfg.stages.executors.len() as u32;
            let order = (0..n).map(|i| Replica::new(cfg.clone(), NodeId(i), secrets(i), OrderState));
            let exec = (n..all).map(|i| ExecNode::new(cfg.clone(), stage_node(i), secrets(i).signing, Log::default()));
            TestNet::of(order.collect(), exec.collect())
        }

        /// Invokes `op` and returns its result, ticking until it arrives.
        fn call(&mut self, c: &mut Client, now: &mut u64, op: &[u8]) -> Vec<u8> {
            let msgs = c.invoke(*now, op.to_vec()).expect("idle");
            self.send(c.id(), msgs, *now);
            for _ in 0..200 {
                for (n, _, r) in std::mem::take(&mut self.replies) {
                    if let Some(result) = c.on_reply(n, r) {
                        return result;
                    }
                }
                *now += 50;
                let msgs = c.on_tick(*now);
                self.send(c.id(), msgs, *now);
                self.tick(*now);
            }
            panic!("no result for {op:?}; {}", self.status());
        }

        fn status(&self) -> String {
            let order = self.nodes.iter().map(Replica::status_line);
            let exec = self.stage.iter().map(ExecNode::status_line);
            order.chain(exec).collect::<Vec<_>>().join("\n")
        }
    }

    fn value(ops: &[&[u8]]) -> Value {
        let cfg = config(None);
        let requests = ops
            .iter()
            .enumerate()
            .map(|(i, op)| {
                let mut c = client(&cfg, 10 + i as u64);
                match c.invoke(0, op.to_vec()).expect("idle").remove(0).1 {
                    Message::Request(r) => r,
                    other => panic!("expected a request, got {other:?}"),
                }
            })
            .collect();
        Value { time: 1, requests }
    }

    #[cfg(feature = "mutations")] // used by mutation tests only
    fn executed_events(out: &Outputs) -> usize {
        out.events.iter().filter(|e| matches!(e, Event::Executed { .. })).count()
    }

    #[test]
    fn an_order_node_that_missed_the_votes_learns_the_certificate_from_an_execution_node() {
        let cfg = config(None);
        let interval = cfg.options.checkpoint_interval;
        let mut order = Replica::new(cfg.clone(), NodeId(1), secrets(1), OrderState);
        let (root, membership) = (Digest([7; 32]), Digest([8; 32]));
        // Execution node `node` (stable id) signs under its stage name; order node 0 too.
        let sign = |node: NodeId| {
            let name = if node >= NodeId(4) { stage_node(node.0) } else { node };
            let statement = checkpoint_statement(Seq(interval), &root, &membership, name);
            (name, secrets(node.0).signing.sign(&statement))
        };
        let cert = |sigs: Vec<(NodeId, crate::crypto::Sig)>| {
            Message::StableCert(StableProof { seq: Seq(interval), root, membership, sigs })
        };
        let mut out = Outputs::default();
        // r = 1: one execution node's signature is no certificate, nor are order nodes'.
        for bad in
            [vec![sign(NodeId(4))], vec![sign(NodeId(4)), sign(NodeId(0))], vec![sign(NodeId(4)), sign(NodeId(4))]]
        {
            order.step(0, Input::Message { from: Peer::Node(stage_node(5)), msg: cert(bad) }, &mut out);
            assert_eq!(order.exec_stable_seq(), Seq(0));
        }
        let msg = cert(vec![sign(NodeId(4)), sign(NodeId(6))]);
        order.step(0, Input::Message { from: Peer::Node(stage_node(5)), msg }, &mut out);
        assert_eq!(order.exec_stable_seq(), Seq(interval), "u + 1 execution nodes signed it");
        let durable = |p: &crate::replica::Persist| matches!(p, crate::replica::Persist::Record(crate::wal::Record::ExecStable(p)) if p.seq == Seq(interval));
        assert!(out.persist.iter().any(durable), "kept durably, before execution nodes hear of it");
    }

    #[test]
    fn execution_nodes_execute_and_answer_while_order_nodes_keep_only_the_order_state() {
        let cfg = config(None);
        let mut net = Net::new(&cfg);
        let mut c = client(&cfg, 7);
        let mut now = 10;
        for i in 1..=20u8 {
            assert_eq!(net.call(&mut c, &mut now, &[i]), vec![i], "request {i}");
        }
        let ops: Vec<Vec<u8>> = (1..=20u8).map(|i| vec![i]).collect();
        for e in &net.stage {
            assert_eq!(e.service().0, ops, "node {}", e.id());
        }
        for o in &net.nodes {
            assert!(o.executed() >= Seq(1));
        }
        // Only execution nodes answered.
        assert!(net.replies.iter().all(|(n, _, _)| cfg.executors().contains(n)));
        // 20 instances or fewer, interval 8: the order nodes certified an execution
        // checkpoint (and the gate let them go on).
        assert!(net.nodes.iter().all(|o| o.exec_stable_seq() >= Seq(8)), "{}", net.status());
    }

    #[cfg(feature = "mutations")]
    #[test]
    fn a_value_executes_on_r_plus_one_matching_commit_notices_only() {
        let cfg = config(None);
        let mut e = ExecNode::new(cfg.clone(), stage_node(4), secrets(4).signing, Log::default());
        let (a, b) = (value(&[b"a"]), value(&[b"b"]));
        let commit = |e: &mut ExecNode<Log>, from: NodeId, v: &Value| {
            let mut out = Outputs::default();
            let msg = Message::Decided { seq: Seq(1), value: v.clone() };
            e.step(1, Input::Message { from: Peer::Node(from), msg }, &mut out);
            out
        };
        assert_eq!(executed_events(&commit(&mut e, NodeId(0), &a)), 0, "one notice is one order node's word");
        assert_eq!(executed_events(&commit(&mut e, NodeId(1), &b)), 0, "two notices that differ decide nothing");
        assert_eq!(executed_events(&commit(&mut e, NodeId(0), &b)), 0, "an order node's first notice counts");
        // Not an order node: an execution peer cannot vouch for a decision.
        let out = commit(&mut e, stage_node(5), &a);
        assert_eq!(executed_events(&out), 0);
        assert!(out.events.iter().any(|ev| matches!(ev, Event::Rejected { reason: Reject::WrongPeer, .. })));
        // Nor a node that is no member of this epoch (one a later epoch may add).
        assert_eq!(executed_events(&commit(&mut e, NodeId(9), &a)), 0);
        let out = commit(&mut e, NodeId(2), &a);
        assert_eq!(executed_events(&out), 1, "r + 1 = 2 matching");
        assert_eq!(e.service().0, vec![b"a".to_vec()]);
        // Replies: the request's result, to its client.
        assert!(out.send.iter().any(|(to, m)| *to == Peer::Client(ClientId(10)) && matches!(m, Message::Reply(_))));

        // The mutation that believes one notice executes a lie at once.
        let cfg = config(Some(Mutation::OneCommitNotice));
        let mut e = ExecNode::new(cfg, stage_node(4), secrets(4).signing, Log::default());
        assert_eq!(executed_events(&commit(&mut e, NodeId(0), &b)), 1);
    }

    #[test]
    /// With execution down no execution checkpoint is certified, so no order node votes
    /// for its order checkpoints, none becomes stable, and the window stops ordering two
    /// intervals in; execution back, it all resumes. (Fails if order nodes vote before
    /// execution is certified: their checkpoints become stable and ordering runs on.)
    fn order_nodes_wait_for_execution_checkpoints_two_intervals_back() {
        let cfg = config(None);
        let mut net = Net::new(&cfg);
        let mut c = client(&cfg, 7);
        let mut now = 10;
        // Execution nodes down: ordering goes on up to log_max = 16 instances past the
        // certified (genesis) execution checkpoint, then stops.
        for n in 4..7 {
            net.down.insert(NodeId(n));
        }
        let mut sent = 0u8;
        let mut stuck = false;
        for i in 1..=40u8 {
            let msgs = c.invoke(now, vec![i]).expect("idle");
            net.send(c.id(), msgs, now);
            sent = i;
            // No execution node answers: move on to the next request after a while
            // (abandon), as a client that gives up would.
            for _ in 0..4 {
                now += 50;
                net.tick(now);
            }
            c.abandon();
            if net.nodes[0].executed() >= Seq(cfg.options.log_max()) && i as u64 > cfg.options.log_max() + 4 {
                stuck = true;
                break;
            }
        }
        assert!(stuck, "{}", net.status());
        assert_eq!(net.nodes.iter().map(|o| o.executed()).max(), Some(Seq(cfg.options.log_max())), "{}", net.status());
        // Execution comes back: it catches up from the order nodes' commits, certifies
        // its checkpoints and ordering resumes.
        for n in 4..7 {
            net.down.remove(&NodeId(n));
        }
        for _ in 0..40 {
            now += 50;
            net.tick(now);
        }
        assert!(net.stage.iter().all(|e| e.executed() >= Seq(cfg.options.log_max())), "{}", net.status());
        assert_eq!(net.call(&mut c, &mut now, b"after"), vec![(net.stage[0].service().0.len()) as u8]);
        assert!(sent > 16);
    }

    #[test]
    fn a_lagging_execution_node_fetches_the_certified_state_from_its_peers() {
        let cfg = config(None);
        let mut net = Net::new(&cfg);
        let mut c = client(&cfg, 7);
        let mut now = 10;
        net.down.insert(NodeId(6));
        for i in 1..=40u8 {
            net.call(&mut c, &mut now, &[i]);
        }
        net.down.remove(&NodeId(6));
        for _ in 0..40 {
            now += 50;
            net.tick(now);
        }
        let transferred =
            net.events.iter().any(|(n, e)| *n == NodeId(6) && matches!(e, Event::StateTransferDone { .. }));
        assert!(transferred, "the commits it missed are gone: it transfers; {}", net.status());
        net.call(&mut c, &mut now, b"last");
        assert_eq!(net.stage[2].service().0, net.stage[0].service().0, "{}", net.status());
        assert_eq!(net.stage[2].executed(), net.stage[0].executed());
    }

    /// Issue #21 defect 6, at (u, r) = (1, 0): two execution nodes are down for a while,
    /// the third executes alone; then it is lost for good (one fault, within u) and the
    /// two come back. They must find either the commits they missed or a certified state
    /// someone still holds. With `r + 1 = 1` hash certifying (the paper's quorum, and
    /// Keel's before), the lone node's checkpoints were certified, the order nodes
    /// collected their logs, and the two were stuck for good: this test then ends in
    /// "no result". With `u + 1 = 2`, ordering waits two intervals in for a second
    /// holder, keeping the commits, and the two catch up from them.
    #[test]
    fn a_certified_execution_checkpoint_stays_fetchable_when_one_of_its_signers_is_lost() {
        let cfg = config_cft();
        let mut net = Net::new(&cfg);
        let mut c = client(&cfg, 7);
        let mut now = 10;
        net.down.insert(NodeId(4));
        net.down.insert(NodeId(5));
        for i in 1..=40u8 {
            let msgs = c.invoke(now, vec![i]).expect("idle");
            net.send(c.id(), msgs, now);
            for _ in 0..4 {
                now += 50;
                net.tick(now);
            }
            for (n, _, r) in std::mem::take(&mut net.replies) {
                c.on_reply(n, r);
            }
            c.abandon();
        }
        let ordered = net.nodes[0].executed();
        assert!(
            ordered >= Seq(cfg.options.log_max()),
            "ordering ran while one execution node executed: {}",
            net.status()
        );
        assert_eq!(net.stage[0].executed(), ordered, "{}", net.status());
        // The lone executor is lost; the other two are back.
        net.down.insert(NodeId(3));
        net.down.remove(&NodeId(4));
        net.down.remove(&NodeId(5));
        for _ in 0..60 {
            now += 50;
            net.tick(now);
        }
        let result = net.call(&mut c, &mut now, b"after");
        assert_eq!(result, vec![net.stage[1].service().0.len() as u8], "{}", net.status());
        assert_eq!(net.stage[1].service().0, net.stage[2].service().0, "{}", net.status());
        assert!(net.stage[1].executed() > ordered, "{}", net.status());
    }

    /// A value holding an administrator's operation, signed with the test admin key.
    fn admin_value(epoch: u64, change: crate::membership::Change, seq: u64) -> Value {
        let admin = crate::crypto::SigningKey::from_seed([99; 32]);
        let op = crate::membership::AdminOp::sign(&admin, epoch, change);
        let req = Request::new(crate::membership::ADMIN_CLIENT, seq, op.encode().into());
        Value { time: 1, requests: vec![req] }
    }

    #[cfg(feature = "mutations")] // used by mutation tests only
    /// Where this step sent its checkpoint vote for instance `seq`.
    fn voted_at(out: &Outputs, seq: Seq) -> Vec<NodeId> {
        let votes = out.send_after_persist.iter().filter_map(|(to, m)| match (to, m) {
            (Peer::Node(n), Message::Checkpoint(v)) if v.seq == seq => Some(*n),
            _ => None,
        });
        votes.collect()
    }

    #[cfg(feature = "mutations")]
    #[test]
    fn an_execution_node_follows_a_membership_change_it_executes_and_checkpoints_where_the_epoch_ends() {
        use crate::membership::{Change, Member};
        let admin = crate::crypto::SigningKey::from_seed([99; 32]);
        let cfg = config(None).with_admin_key(admin.public());
        assert_eq!(cfg.membership.highest_id, 6, "the execution nodes' ids are given out");
        let mut e = ExecNode::new(cfg.clone(), stage_node(4), secrets(4).signing, Log::default());
        let commit = |e: &mut ExecNode<Log>, from: NodeId, seq: Seq, v: &Value| {
            let mut out = Outputs::default();
            e.step(
                1,
                Input::Message { from: Peer::Node(from), msg: Message::Decided { seq, value: v.clone() } },
                &mut out,
            );
            out
        };
        // Instance 3 (off the checkpoint interval) adds order node 9 and removes nothing.
        let (a, b) = (value(&[b"a"]), value(&[b"b"]));
        commit(&mut e, NodeId(0), Seq(1), &a);
        commit(&mut e, NodeId(1), Seq(1), &a);
        commit(&mut e, NodeId(0), Seq(2), &b);
        commit(&mut e, NodeId(1), Seq(2), &b);
        let add =
            admin_value(0, Change::Add(Member { id: 9, key: secrets(9).signing.public(), addr: String::new() }), 1);
        commit(&mut e, NodeId(0), Seq(3), &add);
        let out = commit(&mut e, NodeId(2), Seq(3), &add);
        assert_eq!(e.executed(), Seq(3));
        assert_eq!(e.config().epoch(), 1, "it follows the membership it executed");
        assert_eq!(e.config().n(), 5);
        assert!(
            out.events.iter().any(|ev| matches!(ev, Event::Checkpoint { seq: Seq(3), .. })),
            "checkpoint at the end"
        );
        assert_eq!(
            voted_at(&out, Seq(3)),
            [0, 1, 2, 3, 9].map(NodeId).to_vec(),
            "its vote goes to the members of both epochs"
        );
        // The new member's notice counts now; one notice alone still decides nothing.
        let c = value(&[b"c"]);
        assert_eq!(executed_events(&commit(&mut e, NodeId(9), Seq(4), &c)), 0);
        assert_eq!(executed_events(&commit(&mut e, NodeId(3), Seq(4), &c)), 1, "r + 1 members of epoch 1");
        // Instance 5 removes node 1, whose notice for instance 6 came first: dropped at the
        // switch, so node 0's alone decides nothing. The vote at 5 still reaches node 1.
        let remove = admin_value(1, Change::Remove(1), 2);
        let d = value(&[b"d"]);
        commit(&mut e, NodeId(1), Seq(6), &d);
        commit(&mut e, NodeId(0), Seq(5), &remove);
        let out = commit(&mut e, NodeId(9), Seq(5), &remove);
        assert_eq!((e.executed(), e.config().epoch()), (Seq(5), 2));
        assert_eq!(
            voted_at(&out, Seq(5)),
            [0, 2, 3, 9, 1].map(NodeId).to_vec(),
            "the removed member ends epoch 1 too: it gets the vote"
        );
        assert_eq!(
            executed_events(&commit(&mut e, NodeId(0), Seq(6), &d)),
            0,
            "a removed node's notice no longer counts"
        );
        assert_eq!(executed_events(&commit(&mut e, NodeId(1), Seq(6), &d)), 0, "nor one it sends now");
        assert_eq!(executed_events(&commit(&mut e, NodeId(2), Seq(6), &d)), 1);

        // The mutation that checkpoints only every interval leaves the epoch's end bare.
        let cfg = config(Some(Mutation::NoEpochEndCheckpoint)).with_admin_key(admin.public());
        let mut e = ExecNode::new(cfg, stage_node(4), secrets(4).signing, Log::default());
        commit(&mut e, NodeId(0), Seq(1), &add);
        let out = commit(&mut e, NodeId(1), Seq(1), &add);
        assert_eq!(e.config().epoch(), 1);
        assert!(!out.events.iter().any(|ev| matches!(ev, Event::Checkpoint { .. })));
    }

    /// What the execution nodes of a cluster of `order` order and `exec` execution nodes
    /// at `quorums` answer the administrator who asks for `change`.
    fn admin_answer(
        quorums: Quorums,
        (order, exec): (u32, u32),
        change: crate::membership::Change,
    ) -> Option<crate::membership::AdminResult> {
        let admin = crate::crypto::SigningKey::from_seed([99; 32]);
        let keys: Vec<PublicKey> = (0..order).map(|i| secrets(i).signing.public()).collect();
        let exec_keys: Vec<PublicKey> = (order..order + exec).map(|i| secrets(i).signing.public()).collect();
        let cfg = ClusterConfig::new(quorums, keys, Options { background_checkpoints: false, ..Options::test_min() })
            .expect("valid")
            .with_auth(Auth::Mac)
            .with_executors(exec_keys)
            .expect("2u + 1 execution nodes")
            .with_admin_key(admin.public());
        // The node that sends the (long) answer in full: `(client + seq) mod e`.
        let id = order + ((crate::membership::ADMIN_CLIENT.0 + 1) % exec as u64) as u32;
        let mut e = ExecNode::new(cfg, stage_node(id), secrets(id).signing, Log::default());
        let v = admin_value(0, change, 1);
        let mut out = Outputs::default();
        for from in [0, 1] {
            let msg = Message::Decided { seq: Seq(1), value: v.clone() };
            e.step(1, Input::Message { from: Peer::Node(NodeId(from)), msg }, &mut out);
        }
        assert_eq!(e.executed(), Seq(1));
        out.send.iter().find_map(|(_, m)| match m {
            Message::Reply(r) => match &r.body {
                ReplyBody::Full(bytes) => crate::membership::decode_result(bytes),
                _ => None,
            },
            _ => None,
        })
    }

    #[test]
    fn a_change_of_faults_that_the_stages_apart_cannot_serve_is_refused() {
        use crate::membership::{AdminError, Change};
        let refused = |answer: &Option<crate::membership::AdminResult>, why: &str| matches!(answer, Some(Err(AdminError::Quorums(w))) if w.contains(why));
        // Six order nodes at (1, 1), which could run (2, 1), and three execution nodes:
        // (2, 1) needs 2u + 1 = 5 of them.
        let q = Quorums::with_nodes(1, 1, 6).expect("valid");
        let answer = admin_answer(q, (6, 3), Change::Faults { u: 2, r: 1 });
        assert!(refused(&answer, "execution"), "{answer:?}");
        // Seven order nodes and five execution nodes at (2, 1) could run (2, 2), but r may
        // not grow while stages run apart: a node that has not executed the change would
        // still believe r_old + 1 peers.
        let q = Quorums::with_nodes(2, 1, 7).expect("valid");
        let answer = admin_answer(q, (7, 5), Change::Faults { u: 2, r: 2 });
        assert!(refused(&answer, "r cannot grow"), "{answer:?}");
        // Fewer faults are fine.
        let answer = admin_answer(q, (7, 5), Change::Faults { u: 2, r: 0 });
        assert!(matches!(answer, Some(Ok(ref m)) if m.r == 0 && m.epoch == 1), "{answer:?}");
    }

    #[test]
    fn a_restarted_execution_node_keeps_the_certificate_it_collected_its_snapshots_on() {
        let cfg = config(None);
        let interval = cfg.options.checkpoint_interval;
        let mut e = ExecNode::new(cfg.clone(), stage_node(4), secrets(4).signing, Log::default());
        let mut out = Outputs::default();
        for seq in 1..=interval {
            let v = value(&[&[seq as u8]]);
            for from in [0, 1] {
                let msg = Message::Decided { seq: Seq(seq), value: v.clone() };
                e.step(1, Input::Message { from: Peer::Node(NodeId(from)), msg }, &mut out);
            }
        }
        assert_eq!(e.executed(), Seq(interval));
        let snapshots: Vec<(Seq, Chunked)> = out
            .persist
            .iter()
            .filter_map(|p| match p {
                Persist::Snapshot { seq, chunked } => Some((*seq, chunked.clone())),
                _ => None,
            })
            .collect();
        let root = snapshots.iter().find(|(s, _)| *s == Seq(interval)).map(|(_, c)| c.root).expect("a snapshot");
        let membership = cfg.membership.digest();
        let sign = |node: NodeId| {
            let statement = checkpoint_statement(Seq(interval), &root, &membership, stage_node(node.0));
            (stage_node(node.0), secrets(node.0).signing.sign(&statement))
        };
        let proof = StableProof { seq: Seq(interval), root, membership, sigs: vec![sign(NodeId(5)), sign(NodeId(6))] };
        let mut out = Outputs::default();
        e.step(2, Input::Message { from: Peer::Node(NodeId(0)), msg: Message::StableCert(proof) }, &mut out);
        assert_eq!(e.stable_seq(), Seq(interval));
        // It collects its older snapshots on the certificate, and keeps the certificate.
        let records = out
            .persist
            .iter()
            .find_map(|p| match p {
                Persist::Compact { records, snapshots_from } if *snapshots_from == Seq(interval) => {
                    Some(records.clone())
                }
                _ => None,
            })
            .expect("older snapshots collected");
        assert!(matches!(&records[..], [crate::wal::Record::ExecStable(p)] if p.seq == Seq(interval)), "{records:?}");
        // Restarted, it knows the certificate again without an order node telling it, and
        // tells the order nodes and its peers.
        let mut e = ExecNode::recover(cfg, stage_node(4), secrets(4).signing, Log::default(), snapshots, &records)
            .expect("recovers");
        assert_eq!(e.stable_seq(), Seq(interval), "the certificate was lost in the restart");
        let mut out = Outputs::default();
        e.step(10_000, Input::Tick, &mut out);
        let told: Vec<NodeId> = out
            .send
            .iter()
            .filter_map(|(to, m)| match (to, m) {
                (Peer::Node(n), Message::StableCert(p)) if p.seq == Seq(interval) => Some(*n),
                _ => None,
            })
            .collect();
        assert!(told.contains(&NodeId(0)) && told.contains(&stage_node(5)), "{told:?}");
    }

    #[test]
    fn one_lying_execution_node_cannot_certify_a_checkpoint() {
        let cfg = config(None);
        let mut o = Replica::new(cfg.clone(), NodeId(0), secrets(0), OrderState);
        let vote = |node: u32, root: Digest| {
            let membership = cfg.membership.digest();
            let sig = secrets(node).signing.sign(&checkpoint_statement(Seq(8), &root, &membership, stage_node(node)));
            Message::Checkpoint(CheckpointVote { seq: Seq(8), root, membership, sig })
        };
        let step = |o: &mut Replica<OrderState>, from: NodeId, msg: Message| {
            let mut out = Outputs::default();
            o.step(1, Input::Message { from: Peer::Node(stage_node(from.0)), msg }, &mut out);
            out
        };
        let (good, bad) = (Digest::of(b"good"), Digest::of(b"bad"));
        step(&mut o, NodeId(4), vote(4, bad));
        step(&mut o, NodeId(5), vote(5, good));
        assert_eq!(o.exec_stable_seq(), Seq(0), "two different roots certify nothing");
        // A vote signed by another execution node's key is not node 6's.
        let out = step(&mut o, NodeId(6), vote(4, bad));
        assert!(out.events.iter().any(|e| matches!(e, Event::Rejected { reason: Reject::BadSignature { .. }, .. })));
        assert_eq!(o.exec_stable_seq(), Seq(0));
        let out = step(&mut o, NodeId(6), vote(6, good));
        assert_eq!(o.exec_stable_seq(), Seq(8), "u + 1 = 2 matching");
        // Every execution node hears of it, once the record of it is durable (an execution
        // node collects older snapshots on it).
        let certs = |q: &[(Peer, Message)]| {
            q.iter().filter(|(_, m)| matches!(m, Message::StableCert(p) if p.root == good)).count()
        };
        assert_eq!((certs(&out.send), certs(&out.send_after_persist)), (0, 3));
    }
}
