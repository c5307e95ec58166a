//! Length-delimited frames over TLS, with bounded queues everywhere.
//!
//! A frame is `len: u32 BE | bytes`, at most [`FRAME_MAX`]. A connection's writer drains
//! every frame already queued into one buffered write before flushing, so a burst of small
//! messages costs one syscall (frame coalescing). Send queues are bounded; when one is full
//! the message is dropped and counted: the protocol retransmits what matters, and a slow
//! or hostile peer cannot make us buffer without limit.

use crate::tls::{peer_identity, PeerId};
use keel_core::codec::FRAME_MAX;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::{TlsAcceptor, TlsConnector};

/// Frames queued for one connection.
pub const SEND_QUEUE_MAX: usize = 8192;
/// A TLS handshake that takes longer is abandoned (slowloris).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Handshakes in progress at once; connections beyond are closed at once (and counted),
/// so a flood of idle connections cannot grow memory without bound.
pub const HANDSHAKES_MAX: usize = 256;
/// Reconnection backoff bounds.
pub(crate) const BACKOFF_MIN: Duration = Duration::from_millis(50);
pub(crate) const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// Counters shared by the transport tasks (exported as metrics).
#[derive(Debug, Default)]
pub struct TransportStats {
    pub frames_in: AtomicU64,
    pub frames_out: AtomicU64,
    pub bytes_in: AtomicU64,
    pub bytes_out: AtomicU64,
    /// Frames dropped because a send queue was full.
    pub send_queue_full: AtomicU64,
    /// Frames over the size limit (connection closed).
    pub oversized: AtomicU64,
    /// Frames that did not decode.
    pub undecodable: AtomicU64,
    /// Handshakes that failed or timed out, or certificates without a Keel identity.
    pub rejected_connections: AtomicU64,
    pub connects: AtomicU64,
    /// Node messages whose signature the verify stage checked off the protocol task.
    pub stage_verified: AtomicU64,
}

impl TransportStats {
    pub fn bump(counter: &AtomicU64, by: u64) {
        counter.fetch_add(by, Ordering::Relaxed);
    }
}

/// A frame between nodes: the sender's membership epoch (8 bytes, little endian), then
/// the encoded message. Epochs are kept apart by it (replica/epoch.rs): a node counts
/// only messages of its own epoch.
pub fn node_frame(epoch: u64, msg: &keel_core::message::Message) -> Vec<u8> {
    keel_core::codec::encode_after(&epoch.to_le_bytes(), msg)
}

/// The epoch and the encoded message of a frame from a node; `None` if too short.
pub fn split_node_frame(frame: &[u8]) -> Option<(u64, &[u8])> {
    let (epoch, body) = frame.split_first_chunk::<8>()?;
    Some((u64::from_le_bytes(*epoch), body))
}

/// Reads one frame. `Ok(None)` at a clean end of stream.
///
/// # Errors
/// I/O errors, and `InvalidData` for a frame above the limit (the peer is misbehaving:
/// the caller closes the connection).
pub async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> io::Result<Option<Vec<u8>>> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_be_bytes(len) as usize;
    if len > FRAME_MAX {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("frame of {len} bytes exceeds {FRAME_MAX}")));
    }
    // Allocated only after the length passed the bound.
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf).await?;
    Ok(Some(buf))
}

/// Writes frames from `rx` until it closes or the connection fails, coalescing whatever
/// is already queued into one flush. Returns the frame that failed, if any.
pub async fn write_frames<W: AsyncWrite + Unpin>(
    w: W,
    rx: &mut mpsc::Receiver<Vec<u8>>,
    stats: &TransportStats,
) -> io::Result<()> {
    let mut w = BufWriter::with_capacity(256 << 10, w);
    while let Some(frame) = rx.recv().await {
        write_one(&mut w, &frame, stats).await?;
        while let Ok(frame) = rx.try_recv() {
            write_one(&mut w, &frame, stats).await?;
        }
        w.flush().await?;
    }
    Ok(())
}

async fn write_one<W: AsyncWrite + Unpin>(w: &mut W, frame: &[u8], stats: &TransportStats) -> io::Result<()> {
    w.write_all(&(frame.len() as u32).to_be_bytes()).await?;
    w.write_all(frame).await?;
    TransportStats::bump(&stats.frames_out, 1);
    TransportStats::bump(&stats.bytes_out, frame.len() as u64 + 4);
    Ok(())
}

/// Queues a frame, dropping it (and counting) when the queue is full.
pub fn offer(tx: &mpsc::Sender<Vec<u8>>, frame: Vec<u8>, stats: &TransportStats) {
    if tx.try_send(frame).is_err() {
        TransportStats::bump(&stats.send_queue_full, 1);
    }
}

/// What a dialled connection is doing: up or not, and why not. A node reports its peers
/// from it; a client names the nodes it could not reach when an operation times out.
#[derive(Debug)]
pub struct LinkState {
    /// Who dials, for log lines: "peer" (a node's link to another) or "client".
    role: &'static str,
    connected: AtomicU64,
    /// Why the last attempt failed or the last connection ended; None while up.
    trouble: std::sync::Mutex<Option<String>>,
}

impl LinkState {
    pub fn new(role: &'static str) -> LinkState {
        LinkState {
            role,
            connected: AtomicU64::new(0),
            trouble: std::sync::Mutex::new(Some("not connected yet".into())),
        }
    }

    pub fn connected(&self) -> bool {
        self.connected.load(Ordering::Relaxed) > 0
    }

    /// Why the link is down (None while it is up).
    pub fn trouble(&self) -> Option<String> {
        if self.connected() {
            return None;
        }
        self.trouble.lock().ok().and_then(|t| t.clone())
    }

    /// A connection is up.
    pub(crate) fn up(&self) {
        self.connected.fetch_add(1, Ordering::Relaxed);
    }

    /// The connection that was up ended, for `why`.
    pub(crate) fn lost(&self, why: String) {
        self.set_trouble(why);
        self.connected.fetch_sub(1, Ordering::Relaxed);
    }

    /// Records why the link is down; returns whether that is news (for one log line per
    /// change rather than one per retry).
    pub(crate) fn set_trouble(&self, why: String) -> bool {
        let Ok(mut t) = self.trouble.lock() else { return false };
        let news = t.as_deref() != Some(why.as_str());
        *t = Some(why);
        news
    }
}

/// Keeps a connection to `addr` (expected to be `who`) up, writing the frames of `rx` to
/// it and handing each frame read back to `on_frame`. Reconnects with backoff until `rx`
/// closes. `link` tells whether it is up and, if not, why.
pub async fn dial_loop<F>(
    addr: SocketAddr,
    who: PeerId,
    connector: TlsConnector,
    mut rx: mpsc::Receiver<Vec<u8>>,
    stats: Arc<TransportStats>,
    link: Arc<LinkState>,
    on_frame: F,
) where
    F: Fn(Vec<u8>) + Send + Sync + 'static,
{
    let on_frame = Arc::new(on_frame);
    let mut backoff = BACKOFF_MIN;
    loop {
        if rx.is_closed() {
            return;
        }
        let stream = match connect(addr, who, &connector).await {
            Ok(s) => s,
            Err(e) => {
                if link.set_trouble(format!("{addr}: {e}")) {
                    tracing::info!(role = link.role, peer = %who.name(), %addr, "cannot reach {}: {e} (retrying)", who.name());
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(BACKOFF_MAX);
                continue;
            }
        };
        backoff = BACKOFF_MIN;
        TransportStats::bump(&stats.connects, 1);
        link.up();
        tracing::info!(role = link.role, peer = %who.name(), %addr, "connected to {}", who.name());
        let (mut r, w) = tokio::io::split(stream);
        let reader_stats = stats.clone();
        let cb = on_frame.clone();
        let reader = tokio::spawn(async move {
            while let Ok(Some(frame)) = read_frame(&mut r).await {
                TransportStats::bump(&reader_stats.frames_in, 1);
                TransportStats::bump(&reader_stats.bytes_in, frame.len() as u64 + 4);
                cb(frame);
            }
        });
        let result = tokio::select! {
            r = write_frames(w, &mut rx, &stats) => r,
            _ = wait_for(reader) => Ok(()),
        };
        let why = match &result {
            Err(e) => format!("{addr}: connection lost: {e}"),
            Ok(()) => format!("{addr}: connection closed by the peer"),
        };
        link.lost(why.clone());
        if result.is_ok() && rx.is_closed() {
            return;
        }
        tracing::info!(role = link.role, peer = %who.name(), "lost {}: {why}", who.name());
        tokio::time::sleep(BACKOFF_MIN).await;
    }
}

async fn wait_for(h: tokio::task::JoinHandle<()>) {
    let _ = h.await;
}

/// Dials `addr` over TCP and TLS (each step bounded by [`HANDSHAKE_TIMEOUT`]) and checks
/// that the peer is `who`.
pub(crate) async fn connect(
    addr: SocketAddr,
    who: PeerId,
    connector: &TlsConnector,
) -> io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let tcp = tokio::time::timeout(HANDSHAKE_TIMEOUT, TcpStream::connect(addr))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))??;
    tcp.set_nodelay(true)?;
    let tls = tokio::time::timeout(HANDSHAKE_TIMEOUT, connector.connect(who.server_name(), tcp))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "handshake timed out"))??;
    // The server name check already bound the certificate to `who`; check the CN too.
    let identity = tls.get_ref().1.peer_certificates().and_then(|c| c.first()).and_then(peer_identity);
    if identity != Some(who) {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("expected {}, got {identity:?}", who.name()),
        ));
    }
    Ok(tls)
}

/// An accepted, authenticated connection.
pub struct Accepted {
    pub peer: PeerId,
    pub stream: tokio_rustls::server::TlsStream<TcpStream>,
}

/// Accepts connections forever, handing authenticated ones to `on_accept`. A connection
/// that does not complete the handshake within [`HANDSHAKE_TIMEOUT`] or presents a
/// certificate without a Keel identity is dropped and counted.
pub async fn accept_loop<F>(listener: TcpListener, acceptor: TlsAcceptor, stats: Arc<TransportStats>, on_accept: F)
where
    F: Fn(Accepted) + Send + Sync + Clone + 'static,
{
    let handshakes = Arc::new(tokio::sync::Semaphore::new(HANDSHAKES_MAX));
    loop {
        let Ok((tcp, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let Ok(permit) = handshakes.clone().try_acquire_owned() else {
            TransportStats::bump(&stats.rejected_connections, 1);
            drop(tcp);
            continue;
        };
        let acceptor = acceptor.clone();
        let stats = stats.clone();
        let on_accept = on_accept.clone();
        tokio::spawn(async move {
            let _ = tcp.set_nodelay(true);
            let handshake = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await;
            drop(permit);
            let stream = match handshake {
                Ok(Ok(s)) => s,
                _ => {
                    TransportStats::bump(&stats.rejected_connections, 1);
                    return;
                }
            };
            let peer = stream.get_ref().1.peer_certificates().and_then(|c| c.first()).and_then(peer_identity);
            match peer {
                Some(peer) => on_accept(Accepted { peer, stream }),
                None => TransportStats::bump(&stats.rejected_connections, 1),
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_core::message::Message;

    #[test]
    fn node_frames_carry_the_epoch_and_a_short_one_is_refused() {
        let msg = Message::Stop { view: keel_core::ids::View(7) };
        let frame = node_frame(3, &msg);
        let (epoch, body) = split_node_frame(&frame).expect("long enough");
        assert_eq!(epoch, 3);
        assert_eq!(keel_core::codec::decode(body), Ok(msg));
        assert_eq!(split_node_frame(&frame[..7]), None);
    }
}
