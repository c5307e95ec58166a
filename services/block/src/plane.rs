//! Data between a block cluster's nodes, off the ordering path, on the node plane:
//! PrepareData and its acknowledgement (Gnothi §3.2 steps 1-3), and block fetches for
//! reads of blocks this node does not hold and for re-replication (§3.3, §3.4.2).
//!
//! Nothing here is believed as sent: a PrepareData is checked against its hashes before
//! it is logged, and fetched data against the agreed metadata by whoever asked for it.
//! The sender of each message is the node the transport authenticated.

use crate::local::{Local, Prepare};
use keel::{NodeId, PlaneSender};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::mem;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use tokio::sync::oneshot;

/// Longest chain a PrepareData may still be passed along (more is refused: a peer
/// cannot make the nodes forward one message without end).
pub const CHAIN_MAX: usize = 16;

/// Most bytes of block data one fetch asks for (a reply stays inside a plane message).
pub const FETCH_BYTES_MAX: u64 = 2 << 20;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Message {
    /// Store this PrepareData, acknowledge it to its owner, and pass it on to `then[0]`
    /// with the rest of `then` (chain replication, Gnothi §3.2: the owner sends the data
    /// once, each node of the chain to the next).
    Prepare {
        prepare: Prepare,
        then: Vec<NodeId>,
    },
    /// The answer to the sender's PrepareData `(epoch, seq)`: stored durably, or why not.
    Prepared {
        epoch: u64,
        seq: u64,
        refused: Option<String>,
    },
    /// Send me the blocks `first..first + count` you hold.
    Fetch {
        id: u64,
        first: u64,
        count: u32,
    },
    /// The blocks asked for by fetch `id`, each with the version the sender says it holds
    /// (0: none). `data` is empty if the sender could not read them.
    Blocks {
        id: u64,
        first: u64,
        versions: Vec<u64>,
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
    },
    /// Which versions of blocks `first..first + count` do you hold? (reserve collection)
    Held {
        id: u64,
        first: u64,
        count: u32,
    },
    HeldVersions {
        id: u64,
        versions: Vec<u64>,
    },
    /// Several `Prepare`s at once: what concurrent writes sent to one node while the
    /// last message to it was being queued (each entry as one `Prepare`).
    Prepares(Vec<(Prepare, Vec<NodeId>)>),
    /// Several `Prepared` answers at once, to one owner.
    PreparedMany(Vec<Answer>),
}

/// One answer to a PrepareData (as in `Message::Prepared`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Answer {
    pub epoch: u64,
    pub seq: u64,
    pub refused: Option<String>,
}

/// Most entries one `Prepares` or `PreparedMany` carries (more is refused whole: each
/// entry costs the receiver a task's worth of work).
pub const BATCH_MAX: usize = 256;

/// Bytes of block data past which a batch of PrepareData is sent rather than grown: a
/// message stays well inside a plane message, and a large write goes on its own.
const BATCH_BYTES: usize = 1 << 20;

/// Most blocks one `Held` asks about.
pub const HELD_BLOCKS_MAX: u32 = 65_536;

impl Message {
    pub fn encode(&self) -> Vec<u8> {
        postcard::to_allocvec(self).unwrap_or_default()
    }
}

/// The answer to a PrepareData: stored, or refused with a reason.
pub type PrepareAck = Result<(), String>;

/// Blocks a peer sent: (versions, data).
pub type Fetched = (Vec<u64>, Vec<u8>);

/// Who waits for which answer of which peer: (peer, request id) to the waiter.
type Waiters<T> = Mutex<HashMap<(NodeId, u64), oneshot::Sender<T>>>;

/// A node's end of the plane for its front end and re-replication: sends, and routes
/// the answers back to whoever waits for them.
pub struct Peers {
    me: NodeId,
    send: PlaneSender,
    acks: Mutex<HashMap<(NodeId, u64, u64), oneshot::Sender<PrepareAck>>>,
    fetches: Waiters<Fetched>,
    helds: Waiters<Vec<u64>>,
    next_fetch: AtomicU64,
    /// PrepareData and answers waiting to go to each peer, sent together once the tasks
    /// running now had their turn ([`Peers::queue`]).
    outbox: Mutex<HashMap<NodeId, Outgoing>>,
    stats: Arc<PlaneStats>,
}

/// Counters of a node's plane traffic (`/metrics`).
#[derive(Default)]
pub struct PlaneStats {
    /// Messages peers sent that did not decode, broke a bound, or answered nothing asked.
    pub dropped: AtomicU64,
    /// Messages sent that carried several PrepareData or answers, and how many in all.
    pub batches: AtomicU64,
    pub batched: AtomicU64,
}

/// What waits to go to one peer.
#[derive(Default)]
struct Outgoing {
    prepares: Vec<(Prepare, Vec<NodeId>)>,
    /// Block data in `prepares`.
    bytes: usize,
    answers: Vec<Answer>,
    /// A flush of this peer's queue is on its way.
    flushing: bool,
}

/// One thing for a peer's queue.
enum Item {
    Prepare(Prepare, Vec<NodeId>),
    Answer(Answer),
}

impl Peers {
    pub fn new(me: NodeId, send: PlaneSender, stats: Arc<PlaneStats>) -> Arc<Peers> {
        Arc::new(Peers {
            me,
            send,
            acks: Mutex::default(),
            fetches: Mutex::default(),
            helds: Mutex::default(),
            next_fetch: AtomicU64::new(1),
            outbox: Mutex::default(),
            stats,
        })
    }

    pub fn me(&self) -> NodeId {
        self.me
    }

    /// Sends `prepare` to node `to`; the receiver resolves with its answer (or is
    /// dropped if the message could not be queued).
    pub fn prepare(self: &Arc<Self>, to: NodeId, prepare: &Prepare) -> oneshot::Receiver<PrepareAck> {
        self.prepare_chain(&[to], prepare).pop().unwrap_or_else(|| oneshot::channel().1)
    }

    /// Sends `prepare` down `chain` (to the first node, which passes it on); each node
    /// answers the owner directly. One receiver per node of the chain, in its order.
    pub fn prepare_chain(self: &Arc<Self>, chain: &[NodeId], prepare: &Prepare) -> Vec<oneshot::Receiver<PrepareAck>> {
        let mut receivers = Vec::with_capacity(chain.len());
        {
            let mut acks = self.acks.lock().unwrap_or_else(PoisonError::into_inner);
            for &to in chain {
                let (tx, rx) = oneshot::channel();
                acks.insert((to, prepare.epoch, prepare.seq), tx);
                receivers.push(rx);
            }
        }
        if let Some((&first, rest)) = chain.split_first() {
            self.queue(first, Item::Prepare(prepare.clone(), rest.to_vec()));
        }
        receivers
    }

    /// Sends `prepare` to `to` alone, again (a node of a chain that did not answer:
    /// the chain may have broken before it); its answer goes to the waiter already there.
    pub fn resend(self: &Arc<Self>, to: NodeId, prepare: &Prepare) {
        self.queue(to, Item::Prepare(prepare.clone(), Vec::new()));
    }

    /// Queues `item` for `to`. What is queued goes in one message once the tasks that
    /// can run now have run: concurrent writes' PrepareData to one node, and the answers
    /// the log's one fsync made ready together, each cost one message rather than one
    /// apiece. A batch past its bounds goes at once.
    fn queue(self: &Arc<Self>, to: NodeId, item: Item) {
        let (full, flush) = {
            let mut outbox = self.outbox.lock().unwrap_or_else(PoisonError::into_inner);
            let out = outbox.entry(to).or_default();
            let full = match &item {
                Item::Prepare(p, _) if out.prepares.len() >= BATCH_MAX || out.bytes + p.data.len() > BATCH_BYTES => {
                    Some(Outgoing {
                        prepares: mem::take(&mut out.prepares),
                        bytes: mem::take(&mut out.bytes),
                        ..Outgoing::default()
                    })
                }
                Item::Answer(_) if out.answers.len() >= BATCH_MAX => {
                    Some(Outgoing { answers: mem::take(&mut out.answers), ..Outgoing::default() })
                }
                _ => None,
            };
            match item {
                Item::Prepare(p, then) => {
                    out.bytes += p.data.len();
                    out.prepares.push((p, then));
                }
                Item::Answer(a) => out.answers.push(a),
            }
            (full, !mem::replace(&mut out.flushing, true))
        };
        if let Some(full) = full {
            self.send_out(to, full);
        }
        if flush {
            let peers = self.clone();
            tokio::spawn(async move {
                tokio::task::yield_now().await;
                let out = peers.outbox.lock().unwrap_or_else(PoisonError::into_inner).remove(&to);
                if let Some(out) = out {
                    peers.send_out(to, out);
                }
            });
        }
    }

    /// Sends what was queued for `to`: one entry as the message of its own, several as
    /// one batch. PrepareData of this node's that could not even be queued will get no
    /// answer, so their waiters are let go at once.
    fn send_out(&self, to: NodeId, out: Outgoing) {
        let Outgoing { mut prepares, mut answers, .. } = out;
        if !prepares.is_empty() {
            let owned: Vec<(u64, u64, Vec<NodeId>)> = prepares
                .iter()
                .filter(|(p, _)| p.owner == self.me)
                .map(|(p, then)| (p.epoch, p.seq, then.clone()))
                .collect();
            let message = if prepares.len() == 1 {
                let (prepare, then) = prepares.remove(0);
                Message::Prepare { prepare, then }
            } else {
                self.batched(prepares.len());
                Message::Prepares(prepares)
            };
            if self.send.send(to, message.encode()).is_err() {
                for (epoch, seq, then) in owned {
                    for node in std::iter::once(to).chain(then) {
                        forget(&self.acks, &(node, epoch, seq));
                    }
                }
            }
        }
        if !answers.is_empty() {
            let message = if answers.len() == 1 {
                let Answer { epoch, seq, refused } = answers.remove(0);
                Message::Prepared { epoch, seq, refused }
            } else {
                self.batched(answers.len());
                Message::PreparedMany(answers)
            };
            let _ = self.send.send(to, message.encode());
        }
    }

    fn batched(&self, entries: usize) {
        self.stats.batches.fetch_add(1, Ordering::Relaxed);
        self.stats.batched.fetch_add(entries as u64, Ordering::Relaxed);
    }

    /// Stops waiting for `to`'s answer to PrepareData `(epoch, seq)`.
    pub fn forget_prepare(&self, to: NodeId, epoch: u64, seq: u64) {
        forget(&self.acks, &(to, epoch, seq));
    }

    /// Asks node `to` for `count` blocks from `first`.
    pub fn fetch(&self, to: NodeId, first: u64, count: u32) -> (u64, oneshot::Receiver<Fetched>) {
        self.ask(&self.fetches, to, |id| Message::Fetch { id, first, count })
    }

    /// Asks node `to` which versions of `count` blocks from `first` it holds.
    pub fn held(&self, to: NodeId, first: u64, count: u32) -> (u64, oneshot::Receiver<Vec<u64>>) {
        self.ask(&self.helds, to, |id| Message::Held { id, first, count })
    }

    pub fn forget_held(&self, to: NodeId, id: u64) {
        forget(&self.helds, &(to, id));
    }

    pub fn forget_fetch(&self, to: NodeId, id: u64) {
        forget(&self.fetches, &(to, id));
    }

    /// Sends the request `message(id)` to `to` under a fresh id; the receiver resolves
    /// with the answer (or is dropped if the request could not be queued).
    fn ask<T>(
        &self,
        waiters: &Waiters<T>,
        to: NodeId,
        message: impl FnOnce(u64) -> Message,
    ) -> (u64, oneshot::Receiver<T>) {
        let id = self.next_fetch.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        waiters.lock().unwrap_or_else(PoisonError::into_inner).insert((to, id), tx);
        if self.send.send(to, message(id).encode()).is_err() {
            forget(waiters, &(to, id));
        }
        (id, rx)
    }

    /// Hands `answer` to whoever waits for it under `key`; one nobody asked for is
    /// counted and dropped.
    fn answer<K: std::hash::Hash + Eq, T>(&self, waiters: &Mutex<HashMap<K, oneshot::Sender<T>>>, key: K, answer: T) {
        match waiters.lock().unwrap_or_else(PoisonError::into_inner).remove(&key) {
            Some(w) => {
                let _ = w.send(answer);
            }
            None => {
                self.stats.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Handles one message from peer `from` (the plane task's loop body).
    pub fn handle(self: &Arc<Self>, local: &Arc<Local>, from: NodeId, bytes: &[u8]) {
        let Ok(message) = postcard::from_bytes::<Message>(bytes) else {
            self.stats.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        };
        match message {
            Message::Prepare { prepare, then } => self.take_prepares(local, vec![(prepare, then)]),
            Message::Prepares(entries) => {
                if entries.len() > BATCH_MAX {
                    self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                self.take_prepares(local, entries);
            }
            Message::Prepared { epoch, seq, refused } => {
                self.answer(&self.acks, (from, epoch, seq), refused.map_or(Ok(()), Err));
            }
            Message::PreparedMany(answers) => {
                if answers.len() > BATCH_MAX {
                    self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                for Answer { epoch, seq, refused } in answers {
                    self.answer(&self.acks, (from, epoch, seq), refused.map_or(Ok(()), Err));
                }
            }
            Message::Fetch { id, first, count } => {
                let g = local.geometry();
                let bytes = u64::from(count) * u64::from(g.block_size);
                let reply = if count == 0
                    || bytes > FETCH_BYTES_MAX
                    || first.checked_add(u64::from(count)).is_none_or(|e| e > g.blocks)
                {
                    self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                    Message::Blocks { id, first, versions: Vec::new(), data: Vec::new() }
                } else {
                    match local.read(first, u64::from(count)) {
                        Ok((data, versions)) => Message::Blocks { id, first, versions, data },
                        Err(_) => Message::Blocks { id, first, versions: Vec::new(), data: Vec::new() },
                    }
                };
                let _ = self.send.send(from, reply.encode());
            }
            Message::Held { id, first, count } => {
                let blocks = local.geometry().blocks;
                let versions = if count == 0
                    || count > HELD_BLOCKS_MAX
                    || first.checked_add(u64::from(count)).is_none_or(|e| e > blocks)
                {
                    self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                    Vec::new()
                } else {
                    (first..first + u64::from(count)).map(|b| local.store().held(b)).collect()
                };
                let _ = self.send.send(from, Message::HeldVersions { id, versions }.encode());
            }
            Message::HeldVersions { id, versions } => self.answer(&self.helds, (from, id), versions),
            Message::Blocks { id, versions, data, .. } => self.answer(&self.fetches, (from, id), (versions, data)),
        }
    }

    /// PrepareData a peer sent (Gnothi §3.2 steps 2-3): each passed on down its chain
    /// first, so the chain's fsyncs overlap, then all logged with one append, then each
    /// answered to its owner.
    ///
    /// The owner a forwarded PrepareData names is the forwarder's word: it only decides
    /// whose budget the bytes count against here, since the data is used only if it
    /// matches the hashes an ordered WriteData names.
    fn take_prepares(self: &Arc<Self>, local: &Arc<Local>, entries: Vec<(Prepare, Vec<NodeId>)>) {
        let mut prepares = Vec::with_capacity(entries.len());
        for (prepare, then) in entries {
            if then.len() > CHAIN_MAX {
                self.stats.dropped.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            if let Some((&next, rest)) = then.split_first() {
                self.queue(next, Item::Prepare(prepare.clone(), rest.to_vec()));
                local.stats.prepares_forwarded.fetch_add(1, Ordering::Relaxed);
            }
            prepares.push(prepare);
        }
        if prepares.is_empty() {
            return;
        }
        let (peers, local) = (self.clone(), local.clone());
        tokio::spawn(async move {
            let keys: Vec<(NodeId, u64, u64)> = prepares.iter().map(|p| (p.owner, p.epoch, p.seq)).collect();
            let answers = local.prepare_many(prepares).await;
            for ((owner, epoch, seq), answer) in keys.into_iter().zip(answers) {
                let refused = answer.err().map(|e| e.to_string());
                peers.queue(owner, Item::Answer(Answer { epoch, seq, refused }));
            }
        });
    }
}

/// Stops waiting under `key`.
fn forget<K: std::hash::Hash + Eq, T>(waiters: &Mutex<HashMap<K, oneshot::Sender<T>>>, key: &K) {
    waiters.lock().unwrap_or_else(PoisonError::into_inner).remove(key);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::Geometry;
    use std::time::Duration;
    use tokio::sync::mpsc;

    fn prepare(owner: NodeId, seq: u64, first: u64, blocks: usize) -> Prepare {
        let data = vec![seq as u8; blocks * 4096];
        let hashes = data.chunks_exact(4096).map(|d| *blake3::hash(d).as_bytes()).collect();
        Prepare { owner, epoch: 1, seq, first, hashes, data }
    }

    fn peers(me: NodeId) -> (Arc<Peers>, mpsc::Receiver<(NodeId, Vec<u8>)>) {
        let (send, rx) = PlaneSender::channel(64);
        (Peers::new(me, send, Arc::default()), rx)
    }

    /// The next message sent, decoded.
    async fn sent(rx: &mut mpsc::Receiver<(NodeId, Vec<u8>)>) -> (NodeId, Message) {
        let (to, bytes) = tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .expect("a message in time")
            .expect("the sender lives");
        (to, postcard::from_bytes(&bytes).expect("decodes"))
    }

    #[tokio::test]
    async fn concurrent_prepares_to_one_node_go_as_one_message_and_a_lone_one_as_before() {
        let (peers, mut rx) = peers(NodeId(1));
        let mut acks = Vec::new();
        for seq in 1..=5 {
            acks.extend(peers.prepare_chain(&[NodeId(2), NodeId(3)], &prepare(NodeId(1), seq, 0, 1)));
        }
        let (to, message) = sent(&mut rx).await;
        assert_eq!(to, NodeId(2));
        let Message::Prepares(entries) = message else { panic!("one batch: {message:?}") };
        let seqs: Vec<u64> = entries.iter().map(|(p, _)| p.seq).collect();
        assert_eq!(seqs, [1, 2, 3, 4, 5], "in the order they were sent");
        assert!(entries.iter().all(|(_, then)| then == &[NodeId(3)]), "each with the rest of its chain");
        assert_eq!(peers.stats.batches.load(Ordering::Relaxed), 1);
        assert_eq!(peers.stats.batched.load(Ordering::Relaxed), 5);
        // Alone, it goes as the message an older node reads too.
        let _ack = peers.prepare(NodeId(2), &prepare(NodeId(1), 6, 0, 1));
        assert!(matches!(sent(&mut rx).await, (NodeId(2), Message::Prepare { .. })));
        // The answers come back together too, each to its waiter.
        let answers = (1..=5)
            .flat_map(|seq| {
                [
                    Answer { epoch: 1, seq, refused: None },
                    Answer { epoch: 1, seq, refused: (seq == 4).then(|| "busy".to_string()) },
                ]
            })
            .collect::<Vec<_>>();
        let dir = tempfile::tempdir().expect("tempdir");
        let local = Arc::new(local(dir.path(), NodeId(1)));
        let (from_2, from_3): (Vec<_>, Vec<_>) = answers.into_iter().enumerate().partition(|(i, _)| i % 2 == 0);
        let batch = |a: Vec<(usize, Answer)>| Message::PreparedMany(a.into_iter().map(|(_, a)| a).collect()).encode();
        peers.handle(&local, NodeId(2), &batch(from_2));
        peers.handle(&local, NodeId(3), &batch(from_3));
        let mut got = Vec::new();
        for ack in acks {
            got.push(ack.await.expect("answered"));
        }
        let expected: Vec<PrepareAck> =
            (1..=5).flat_map(|seq| [Ok(()), if seq == 4 { Err("busy".to_string()) } else { Ok(()) }]).collect();
        assert_eq!(got, expected);
        assert_eq!(peers.stats.dropped.load(Ordering::Relaxed), 0);
    }

    #[tokio::test]
    async fn a_batch_stays_within_its_bounds() {
        let (peers, mut rx) = peers(NodeId(1));
        // 512 KiB each: two fill a batch, the third starts the next.
        let _acks: Vec<_> = (1..=3).map(|seq| peers.prepare(NodeId(2), &prepare(NodeId(1), seq, 0, 128))).collect();
        let Message::Prepares(first) = sent(&mut rx).await.1 else { panic!("a batch first") };
        assert_eq!(first.iter().map(|(p, _)| p.seq).collect::<Vec<_>>(), [1, 2]);
        assert!(matches!(sent(&mut rx).await.1, Message::Prepare { prepare, .. } if prepare.seq == 3));
        // Past BATCH_MAX entries, what is queued goes and a new batch begins.
        let _acks: Vec<_> = (10..10 + BATCH_MAX as u64 + 1)
            .map(|seq| peers.prepare(NodeId(2), &prepare(NodeId(1), seq, 0, 1)))
            .collect();
        let Message::Prepares(full) = sent(&mut rx).await.1 else { panic!("a batch") };
        assert_eq!(full.len(), BATCH_MAX);
        assert!(matches!(sent(&mut rx).await.1, Message::Prepare { .. }));
    }

    fn local(dir: &std::path::Path, node: NodeId) -> Local {
        let geometry = Geometry::new(4 << 20, 4096, 4, 3).expect("valid");
        Local::open(dir, geometry, node, 0, 0.1, true).expect("opens")
    }

    #[tokio::test]
    async fn a_batch_from_a_peer_is_passed_on_logged_and_answered_in_one_message() {
        let dir = tempfile::tempdir().expect("tempdir");
        let local = Arc::new(local(dir.path(), NodeId(1)));
        let (peers, mut rx) = peers(NodeId(1));
        let mut bad = prepare(NodeId(2), 3, 0, 1);
        bad.data[0] ^= 1;
        let entries = vec![
            (prepare(NodeId(2), 1, 0, 1), vec![NodeId(4)]),
            (prepare(NodeId(2), 2, 1, 1), vec![NodeId(4)]),
            (bad, vec![NodeId(4)]),
        ];
        peers.handle(&local, NodeId(2), &Message::Prepares(entries).encode());
        let mut forwarded = None;
        let mut answered = None;
        while forwarded.is_none() || answered.is_none() {
            match sent(&mut rx).await {
                (NodeId(4), Message::Prepares(e)) => forwarded = Some(e),
                (NodeId(2), Message::PreparedMany(a)) => answered = Some(a),
                other => panic!("unexpected {other:?}"),
            }
        }
        let forwarded = forwarded.unwrap_or_default();
        assert_eq!(forwarded.iter().map(|(p, then)| (p.seq, then.len())).collect::<Vec<_>>(), [(1, 0), (2, 0), (3, 0)]);
        let answered = answered.unwrap_or_default();
        assert_eq!(
            answered.iter().map(|a| (a.seq, a.refused.is_some())).collect::<Vec<_>>(),
            [(1, false), (2, false), (3, true)]
        );
        assert!(
            local.has_prepared(NodeId(2), 1, 1)
                && local.has_prepared(NodeId(2), 1, 2)
                && !local.has_prepared(NodeId(2), 1, 3)
        );
        assert_eq!(local.stats.prepares.load(Ordering::Relaxed), 2);
    }

    #[tokio::test]
    async fn batches_over_the_bound_are_dropped_whole_and_counted() {
        let dir = tempfile::tempdir().expect("tempdir");
        let local = Arc::new(local(dir.path(), NodeId(1)));
        let (peers, _rx) = peers(NodeId(1));
        let answers = vec![Answer { epoch: 1, seq: 1, refused: None }; BATCH_MAX + 1];
        peers.handle(&local, NodeId(2), &Message::PreparedMany(answers).encode());
        let entries = vec![(prepare(NodeId(2), 1, 0, 1), Vec::new()); BATCH_MAX + 1];
        peers.handle(&local, NodeId(2), &Message::Prepares(entries).encode());
        peers.handle(
            &local,
            NodeId(2),
            &Message::Prepares(vec![(prepare(NodeId(2), 1, 0, 1), vec![NodeId(3); CHAIN_MAX + 1])]).encode(),
        );
        peers.handle(&local, NodeId(2), b"\xff\xff");
        assert_eq!(peers.stats.dropped.load(Ordering::Relaxed), 4);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(local.prepared_bytes(), 0, "nothing of them was kept");
    }
}
