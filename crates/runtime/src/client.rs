//! The client library: connect from a client file, invoke operations, get results that
//! r + 1 nodes vouch for.

use crate::config::ClientSetup;
use crate::node::now_ms;
use crate::tls::{self, PeerId, TlsError};
use crate::transport::{dial_loop, offer, TransportStats, SEND_QUEUE_MAX};
use keel_core::client::{Client, ClientError};
use keel_core::codec;
use keel_core::message::{Message, NodeId, Reply};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc;
use tokio_rustls::TlsConnector;

/// Retransmit an unanswered request to every node after this long.
const RETRANSMIT_MS: u64 = 500;
/// Replies queued from all nodes.
const REPLY_QUEUE_MAX: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum InvokeError {
    #[error("no result within {0:?}")]
    Timeout(Duration),
    #[error("{0}")]
    Client(#[from] ClientError),
    #[error("connection setup: {0}")]
    Tls(#[from] TlsError),
}

pub struct KeelClient {
    core: Client,
    nodes: Vec<mpsc::Sender<Vec<u8>>>,
    replies: mpsc::Receiver<(NodeId, Reply)>,
    pub stats: Arc<TransportStats>,
}

impl KeelClient {
    /// Connects (in the background, with retries) to every node of the cluster.
    ///
    /// # Errors
    /// A bad certificate or key in the client files.
    pub fn connect(setup: ClientSetup) -> Result<KeelClient, InvokeError> {
        let connector = TlsConnector::from(tls::client_config(&setup.ca_pem, &setup.credentials)?);
        let stats = Arc::new(TransportStats::default());
        let (reply_tx, replies) = mpsc::channel(REPLY_QUEUE_MAX);
        let mut nodes = Vec::new();
        for (j, addr) in setup.nodes.iter().enumerate() {
            let (tx, rx) = mpsc::channel(SEND_QUEUE_MAX);
            nodes.push(tx);
            let reply_tx = reply_tx.clone();
            let undecodable = stats.clone();
            let connected = Arc::new(std::sync::atomic::AtomicU64::new(0));
            tokio::spawn(dial_loop(*addr, PeerId::Node(j as NodeId), connector.clone(), rx, stats.clone(), connected, move |frame| {
                match codec::decode(&frame) {
                    Ok(Message::Reply(r)) => {
                        let _ = reply_tx.try_send((j as NodeId, r));
                    }
                    _ => TransportStats::bump(&undecodable.undecodable, 1),
                }
            }));
        }
        // Sequence numbers continue above any this client id used before (a restarted
        // process): the executor ignores sequence numbers it has already passed.
        let first_seq = SystemTime::now().duration_since(UNIX_EPOCH).map_or(1, |d| d.as_micros() as u64);
        let core = Client::new(setup.id, setup.quorums, setup.mac_keys, RETRANSMIT_MS, first_seq);
        Ok(KeelClient { core, nodes, replies, stats })
    }

    pub fn id(&self) -> u64 {
        self.core.id()
    }

    /// Runs one operation through the replicated service.
    ///
    /// # Errors
    /// `Timeout` if r + 1 matching results did not arrive in time (the operation may still
    /// execute later); `Client` for an operation over the size bound.
    pub async fn invoke(&mut self, op: Vec<u8>, timeout: Duration) -> Result<Vec<u8>, InvokeError> {
        let deadline = Instant::now() + timeout;
        while self.replies.try_recv().is_ok() {}
        let msgs = self.core.invoke(now_ms(), op)?;
        self.send(msgs);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                self.core.abandon();
                return Err(InvokeError::Timeout(timeout));
            }
            let wait = left.min(Duration::from_millis(RETRANSMIT_MS / 2));
            match tokio::time::timeout(wait, self.replies.recv()).await {
                Ok(Some((from, reply))) => {
                    if let Some(result) = self.core.on_reply(from, reply) {
                        return Ok(result);
                    }
                }
                Ok(None) => {}
                Err(_) => {
                    let msgs = self.core.on_tick(now_ms());
                    self.send(msgs);
                }
            }
        }
    }

    fn send(&self, msgs: Vec<(NodeId, Message)>) {
        for (n, m) in msgs {
            if let Some(tx) = self.nodes.get(n as usize) {
                offer(tx, codec::encode(&m), &self.stats);
            }
        }
    }
}

/// A blocking wrapper for simple programs: owns a small runtime.
pub struct BlockingClient {
    runtime: tokio::runtime::Runtime,
    inner: KeelClient,
}

impl BlockingClient {
    /// # Errors
    /// As [`KeelClient::connect`], or if the runtime cannot start.
    pub fn connect(setup: ClientSetup) -> Result<BlockingClient, InvokeError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .map_err(|e| InvokeError::Tls(TlsError::Pem(format!("runtime: {e}"))))?;
        let inner = runtime.block_on(async { KeelClient::connect(setup) })?;
        Ok(BlockingClient { runtime, inner })
    }

    /// # Errors
    /// As [`KeelClient::invoke`].
    pub fn invoke(&mut self, op: Vec<u8>, timeout: Duration) -> Result<Vec<u8>, InvokeError> {
        self.runtime.block_on(self.inner.invoke(op, timeout))
    }
}
