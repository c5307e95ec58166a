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
}

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
    /// Messages peers sent that did not decode or answered nothing asked.
    pub dropped: AtomicU64,
}

impl Peers {
    pub fn new(me: NodeId, send: PlaneSender) -> Arc<Peers> {
        Arc::new(Peers {
            me,
            send,
            acks: Mutex::default(),
            fetches: Mutex::default(),
            helds: Mutex::default(),
            next_fetch: AtomicU64::new(1),
            dropped: AtomicU64::new(0),
        })
    }

    pub fn me(&self) -> NodeId {
        self.me
    }

    /// Sends `prepare` to node `to`; the receiver resolves with its answer (or is
    /// dropped if the message could not be queued).
    pub fn prepare(&self, to: NodeId, prepare: &Prepare) -> oneshot::Receiver<PrepareAck> {
        self.prepare_chain(&[to], prepare).pop().unwrap_or_else(|| oneshot::channel().1)
    }

    /// Sends `prepare` down `chain` (to the first node, which passes it on); each node
    /// answers the owner directly. One receiver per node of the chain, in its order.
    pub fn prepare_chain(&self, chain: &[NodeId], prepare: &Prepare) -> Vec<oneshot::Receiver<PrepareAck>> {
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
            let message = Message::Prepare { prepare: prepare.clone(), then: rest.to_vec() };
            if self.send.send(first, message.encode()).is_err() {
                // Not even queued: nobody down the chain will answer.
                for &to in chain {
                    forget(&self.acks, &(to, prepare.epoch, prepare.seq));
                }
            }
        }
        receivers
    }

    /// Sends `prepare` to `to` alone, again (a node of a chain that did not answer:
    /// the chain may have broken before it); its answer goes to the waiter already there.
    pub fn resend(&self, to: NodeId, prepare: &Prepare) {
        let _ = self.send.send(to, Message::Prepare { prepare: prepare.clone(), then: Vec::new() }.encode());
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
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Handles one message from peer `from` (the plane task's loop body).
    pub fn handle(self: &Arc<Self>, local: &Arc<Local>, from: NodeId, bytes: &[u8]) {
        let Ok(message) = postcard::from_bytes::<Message>(bytes) else {
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        };
        match message {
            Message::Prepare { prepare, then } => {
                if then.len() > CHAIN_MAX {
                    self.dropped.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                // Passed on first, so the chain's fsyncs overlap. The owner a forwarded
                // PrepareData names is the forwarder's word: it only decides whose
                // budget the bytes count against here, since the data is used only if
                // it matches the hashes an ordered WriteData names.
                if let Some((&next, rest)) = then.split_first() {
                    let message = Message::Prepare { prepare: prepare.clone(), then: rest.to_vec() };
                    if self.send.send(next, message.encode()).is_ok() {
                        local.stats.prepares_forwarded.fetch_add(1, Ordering::Relaxed);
                    }
                }
                let owner = prepare.owner;
                let (local, send) = (local.clone(), self.send.clone());
                tokio::spawn(async move {
                    let (epoch, seq) = (prepare.epoch, prepare.seq);
                    let refused = local.prepare(prepare).await.err().map(|e| e.to_string());
                    let _ = send.send(owner, Message::Prepared { epoch, seq, refused }.encode());
                });
            }
            Message::Prepared { epoch, seq, refused } => {
                self.answer(&self.acks, (from, epoch, seq), refused.map_or(Ok(()), Err));
            }
            Message::Fetch { id, first, count } => {
                let g = local.geometry();
                let bytes = u64::from(count) * u64::from(g.block_size);
                let reply = if count == 0
                    || bytes > FETCH_BYTES_MAX
                    || first.checked_add(u64::from(count)).is_none_or(|e| e > g.blocks)
                {
                    self.dropped.fetch_add(1, Ordering::Relaxed);
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
                    self.dropped.fetch_add(1, Ordering::Relaxed);
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
}

/// Stops waiting under `key`.
fn forget<K: std::hash::Hash + Eq, T>(waiters: &Mutex<HashMap<K, oneshot::Sender<T>>>, key: &K) {
    waiters.lock().unwrap_or_else(PoisonError::into_inner).remove(key);
}
