//! Connections that the task owning them drives itself: no reader or writer task per
//! connection and no channel in between (the client's dispatcher; issue #26).
//!
//! With [`crate::transport::dial_loop`] a reply crossed three tasks (the connection's
//! reader, the dispatcher, the caller) and a request two (the dispatcher, the
//! connection's writer), each hop a channel push and a wake-up. A benchmark client with
//! one operation in flight paid about eight task runs per operation for it, and the load
//! generator took 43 % of a core for 7.7k ops/s (BFT 0/0, 64 clients). Here the owner
//! polls every connection from its own task: a frame it sends is appended to the
//! connection's buffer and written when the owner calls [`Links::poll_write`] (before it
//! sleeps), and frames that arrive come out of [`Links::poll_frames`].
//!
//! Otherwise as `dial_loop`: reconnection with backoff, the peer's identity checked,
//! bounded send buffers (frames beyond are dropped and counted), an oversized frame
//! closes the connection, and a [`LinkState`] says whether a link is up and why not.

use crate::tls::PeerId;
use crate::transport::{connect, LinkState, TransportStats, BACKOFF_MAX, BACKOFF_MIN, SEND_QUEUE_MAX};
use keel_core::codec::FRAME_MAX;
use keel_core::message::NodeId;
use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

/// Bytes queued for one connection at most; a frame beyond is dropped and counted, as
/// is a frame beyond [`SEND_QUEUE_MAX`] of them. (A link that is down keeps what was
/// queued for when it is back, as `dial_loop`'s queue did.)
const OUT_MAX: usize = 4 * FRAME_MAX;
/// Bytes read from one connection per poll before the other connections get their turn.
const READ_BUDGET: usize = 256 << 10;
/// The read buffer's size, and how much free room a read asks for (a TLS record holds at
/// most 16 KiB). It grows for a larger frame, to at most `FRAME_MAX + 4` plus this.
const READ_ROOM: usize = 16 << 10;

type Dialing = Pin<Box<dyn Future<Output = io::Result<TlsStream<TcpStream>>> + Send>>;

enum Conn {
    Dialing(Dialing),
    Up(Box<TlsStream<TcpStream>>),
    /// Backing off before the next attempt.
    Waiting(Pin<Box<tokio::time::Sleep>>),
}

/// One connection's buffers.
#[derive(Default)]
struct Buffers {
    /// Length-prefixed frames; `out[written..]` is not written yet.
    out: Vec<u8>,
    written: usize,
    /// Frames in `out` (for the bound).
    out_frames: usize,
    /// Written to the TLS stream since its last flush.
    unflushed: bool,
    /// Bytes read: `input[start..end]` is the start of a frame not complete yet.
    input: Vec<u8>,
    start: usize,
    end: usize,
}

impl Buffers {
    /// Queues a frame; false if the buffer is full (the frame is dropped).
    fn queue(&mut self, frame: &[u8]) -> bool {
        if self.out_frames >= SEND_QUEUE_MAX || self.out.len() - self.written + frame.len() + 4 > OUT_MAX {
            return false;
        }
        self.out.extend_from_slice(&(frame.len() as u32).to_be_bytes());
        self.out.extend_from_slice(frame);
        self.out_frames += 1;
        true
    }

    /// Writes what is queued as far as the socket takes it, then flushes. Pending writes
    /// leave the task registered for the socket's writability.
    fn write(&mut self, s: &mut TlsStream<TcpStream>, cx: &mut Context<'_>) -> io::Result<()> {
        while self.written < self.out.len() {
            match Pin::new(&mut *s).poll_write(cx, &self.out[self.written..]) {
                Poll::Pending => break,
                Poll::Ready(Ok(0)) => return Err(io::ErrorKind::WriteZero.into()),
                Poll::Ready(Ok(n)) => {
                    self.written += n;
                    self.unflushed = true;
                }
                Poll::Ready(Err(e)) => return Err(e),
            }
        }
        if self.written == self.out.len() {
            self.out.clear();
            self.written = 0;
            self.out_frames = 0;
        } else if self.written > self.out.len() / 2 {
            // Keep the buffer from growing behind a socket that is always a little behind.
            self.out.drain(..self.written);
            self.written = 0;
        }
        if self.unflushed {
            match Pin::new(&mut *s).poll_flush(cx) {
                Poll::Pending => {}
                Poll::Ready(Ok(())) => self.unflushed = false,
                Poll::Ready(Err(e)) => return Err(e),
            }
        }
        Ok(())
    }

    /// Reads what the socket has (up to [`READ_BUDGET`]) and appends every whole frame to
    /// `frames`. `Ok(true)` if the budget ran out with more to read.
    ///
    /// # Errors
    /// The connection failed or ended, or a frame is over [`FRAME_MAX`] (the peer
    /// misbehaves); the message says which.
    fn read(
        &mut self,
        s: &mut TlsStream<TcpStream>,
        cx: &mut Context<'_>,
        from: NodeId,
        stats: &TransportStats,
        frames: &mut Vec<(NodeId, Vec<u8>)>,
    ) -> Result<bool, String> {
        let mut budget = READ_BUDGET;
        loop {
            self.make_room();
            let mut rb = ReadBuf::new(&mut self.input[self.end..]);
            match Pin::new(&mut *s).poll_read(cx, &mut rb) {
                Poll::Pending => return Ok(false),
                Poll::Ready(Err(e)) => return Err(format!("connection lost: {e}")),
                Poll::Ready(Ok(())) => {
                    let n = rb.filled().len();
                    if n == 0 {
                        return Err("connection closed by the peer".into());
                    }
                    self.end += n;
                    self.take_frames(from, stats, frames)?;
                    budget = budget.saturating_sub(n);
                    if budget == 0 {
                        return Ok(true);
                    }
                }
            }
        }
    }

    /// Free room after `end` (at least a quarter of [`READ_ROOM`]), moving a partial frame
    /// to the front or growing the buffer. It holds at most one partial frame:
    /// `take_frames` took the whole ones (and made room for the rest of a large one).
    fn make_room(&mut self) {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
            // Give back what one large frame made it grow to.
            if self.input.len() > 4 * READ_ROOM {
                self.input = Vec::new();
            }
        }
        if self.input.len() - self.end >= READ_ROOM / 4 {
            return;
        }
        if self.start > 0 {
            self.input.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        if self.input.len() - self.end < READ_ROOM / 4 {
            self.input.resize(self.end + READ_ROOM, 0);
        }
    }

    fn take_frames(
        &mut self,
        from: NodeId,
        stats: &TransportStats,
        frames: &mut Vec<(NodeId, Vec<u8>)>,
    ) -> Result<(), String> {
        loop {
            let whole = &self.input[self.start..self.end];
            let Some(len) = whole.first_chunk::<4>().map(|l| u32::from_be_bytes(*l) as usize) else {
                return Ok(());
            };
            if len > FRAME_MAX {
                TransportStats::bump(&stats.oversized, 1);
                return Err(format!("frame of {len} bytes exceeds {FRAME_MAX}"));
            }
            let Some(frame) = whole.get(4..4 + len) else {
                // Room for the whole frame at once, rather than growing a read at a time.
                if self.input.len() - self.start < 4 + len {
                    self.input.copy_within(self.start..self.end, 0);
                    self.end -= self.start;
                    self.start = 0;
                    self.input.resize(4 + len + READ_ROOM, 0);
                }
                return Ok(());
            };
            frames.push((from, frame.to_vec()));
            TransportStats::bump(&stats.frames_in, 1);
            TransportStats::bump(&stats.bytes_in, len as u64 + 4);
            self.start += 4 + len;
        }
    }

    /// A connection ended: what was half written or half read belongs to it.
    fn reset(&mut self) {
        self.out.clear();
        self.written = 0;
        self.out_frames = 0;
        self.unflushed = false;
        self.start = 0;
        self.end = 0;
        self.input = Vec::new();
    }
}

struct Link {
    addr: SocketAddr,
    who: PeerId,
    conn: Conn,
    state: Arc<LinkState>,
    backoff: Duration,
    bufs: Buffers,
}

impl Link {
    /// Drives the connection (dialling, backing off, writing, reading); the task is
    /// registered for whatever it waits on. True if it stopped reading with more to read
    /// (the caller polls again soon).
    fn poll(
        &mut self,
        cx: &mut Context<'_>,
        id: NodeId,
        connector: &TlsConnector,
        stats: &TransportStats,
        frames: &mut Vec<(NodeId, Vec<u8>)>,
    ) -> bool {
        loop {
            match &mut self.conn {
                Conn::Waiting(sleep) => {
                    if sleep.as_mut().poll(cx).is_pending() {
                        return false;
                    }
                    self.conn = dial(self.addr, self.who, connector);
                }
                Conn::Dialing(dialing) => match dialing.as_mut().poll(cx) {
                    Poll::Pending => return false,
                    Poll::Ready(Err(e)) => {
                        if self.state.set_trouble(format!("{}: {e}", self.addr)) {
                            tracing::info!(role = "client", peer = %self.who.name(), addr = %self.addr, "cannot reach {}: {e} (retrying)", self.who.name());
                        }
                        self.conn = Conn::Waiting(Box::pin(tokio::time::sleep(self.backoff)));
                        self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
                    }
                    Poll::Ready(Ok(stream)) => {
                        self.backoff = BACKOFF_MIN;
                        TransportStats::bump(&stats.connects, 1);
                        self.state.up();
                        tracing::info!(role = "client", peer = %self.who.name(), addr = %self.addr, "connected to {}", self.who.name());
                        // What was queued while the link was down goes out now.
                        self.conn = Conn::Up(Box::new(stream));
                    }
                },
                Conn::Up(stream) => {
                    let done = self
                        .bufs
                        .write(stream, cx)
                        .map_err(|e| format!("connection lost: {e}"))
                        .and_then(|()| self.bufs.read(stream, cx, id, stats, frames));
                    match done {
                        Ok(more) => return more,
                        Err(why) => {
                            let why = format!("{}: {why}", self.addr);
                            tracing::info!(role = "client", peer = %self.who.name(), "lost {}: {why}", self.who.name());
                            self.state.lost(why);
                            self.bufs.reset();
                            self.conn = Conn::Waiting(Box::pin(tokio::time::sleep(BACKOFF_MIN)));
                        }
                    }
                }
            }
        }
    }
}

fn dial(addr: SocketAddr, who: PeerId, connector: &TlsConnector) -> Conn {
    let connector = connector.clone();
    Conn::Dialing(Box::pin(async move { connect(addr, who, &connector).await }))
}

/// Connections to nodes, by stable id, driven by the task that owns this.
pub struct Links {
    links: BTreeMap<NodeId, Link>,
    connector: TlsConnector,
    stats: Arc<TransportStats>,
}

impl Links {
    pub fn new(connector: TlsConnector, stats: Arc<TransportStats>) -> Links {
        Links { links: BTreeMap::new(), connector, stats }
    }

    pub fn contains(&self, id: NodeId) -> bool {
        self.links.contains_key(&id)
    }

    /// Keeps a connection to `who` at `addr` from the next poll on (reconnecting with
    /// backoff while the owner polls). A second call for `id` changes nothing.
    pub fn add(&mut self, id: NodeId, who: PeerId, addr: SocketAddr) {
        if self.links.contains_key(&id) {
            return;
        }
        let link = Link {
            addr,
            who,
            conn: dial(addr, who, &self.connector),
            state: Arc::new(LinkState::new("client")),
            backoff: BACKOFF_MIN,
            bufs: Buffers::default(),
        };
        self.links.insert(id, link);
    }

    /// Each link's state, by node.
    pub fn states(&self) -> impl Iterator<Item = (NodeId, &LinkState)> {
        self.links.iter().map(|(id, l)| (*id, l.state.as_ref()))
    }

    /// Queues `frame` for node `id`, written at the next [`Links::poll_write`] or
    /// [`Links::poll_frames`]. Dropped and counted if that connection's buffer is full;
    /// ignored for a node without a link.
    pub fn send(&mut self, id: NodeId, frame: &[u8]) {
        let Some(link) = self.links.get_mut(&id) else {
            return;
        };
        if link.bufs.queue(frame) {
            TransportStats::bump(&self.stats.frames_out, 1);
            TransportStats::bump(&self.stats.bytes_out, frame.len() as u64 + 4);
        } else {
            TransportStats::bump(&self.stats.send_queue_full, 1);
        }
    }

    /// Writes what is queued on every connection that is up, as far as the sockets take
    /// it now; the rest goes when they can take more (the task is woken for it).
    pub fn poll_write(&mut self, cx: &mut Context<'_>) {
        for link in self.links.values_mut() {
            if let Conn::Up(stream) = &mut link.conn {
                if link.bufs.written < link.bufs.out.len() || link.bufs.unflushed {
                    // A failed write shows again on the next read, which handles it.
                    let _ = link.bufs.write(stream, cx);
                }
            }
        }
    }

    /// Drives every connection: dials, backs off, writes, reads. Ready with the frames
    /// that arrived (from every connection that had some), Pending with the task
    /// registered for everything it waits on if none did.
    pub fn poll_frames(&mut self, cx: &mut Context<'_>) -> Poll<Vec<(NodeId, Vec<u8>)>> {
        let mut frames = Vec::new();
        let mut more = false;
        for (id, link) in &mut self.links {
            more |= link.poll(cx, *id, &self.connector, &self.stats, &mut frames);
        }
        if more {
            // A connection still has bytes to read: poll again soon.
            cx.waker().wake_by_ref();
        }
        if frames.is_empty() {
            Poll::Pending
        } else {
            Poll::Ready(frames)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{ClientFile, NodeFile};
    use crate::provision::{init, InitOptions};
    use crate::tls;
    use crate::transport::{accept_loop, read_frame, Accepted};
    use keel_core::ids::ClientId;
    use std::sync::atomic::Ordering;
    use tokio::io::AsyncWriteExt;
    use tokio::sync::mpsc;
    use tokio_rustls::TlsAcceptor;

    fn framed(frame: &[u8]) -> Vec<u8> {
        [(frame.len() as u32).to_be_bytes().as_slice(), frame].concat()
    }

    /// A stand-in for node 0 (its certificate and port) handing over each connection,
    /// and `Links` with a link to it, as client 1000.
    async fn node0() -> (tempfile::TempDir, mpsc::Receiver<Accepted>, Links, Arc<TransportStats>, SocketAddr) {
        let dir = tempfile::tempdir().expect("tempdir");
        init(dir.path(), &InitOptions::local("kv", 1, 1).expect("options")).expect("init");
        let node = NodeFile::load(&dir.path().join("node-0/node.toml")).expect("node 0");
        let acceptor = TlsAcceptor::from(tls::server_config(&node.ca_pem, &node.credentials).expect("tls"));
        let listener = tokio::net::TcpListener::bind(node.listen).await.expect("node 0's port");
        let (conn_tx, conns) = mpsc::channel::<Accepted>(4);
        tokio::spawn(accept_loop(listener, acceptor, Arc::new(TransportStats::default()), move |a| {
            let _ = conn_tx.try_send(a);
        }));
        let setup = ClientFile::load(&dir.path().join("client-1000/client.toml")).expect("client file");
        let connector = TlsConnector::from(tls::client_config(&setup.ca_pem, &setup.credentials).expect("tls"));
        let stats = Arc::new(TransportStats::default());
        (dir, conns, Links::new(connector, stats.clone()), stats, node.listen)
    }

    /// Polls `links` (writing and reading) until `n` frames arrived.
    async fn frames(links: &mut Links, n: usize) -> Vec<Vec<u8>> {
        let mut got = Vec::new();
        let wait = async {
            while got.len() < n {
                let more = std::future::poll_fn(|cx| links.poll_frames(cx)).await;
                got.extend(more.into_iter().map(|(from, f)| {
                    assert_eq!(from, NodeId(0));
                    f
                }));
            }
        };
        tokio::time::timeout(Duration::from_secs(10), wait).await.expect("frames in time");
        got
    }

    /// Polls `links` in the background of `f` (so it dials and writes) and returns f's result.
    async fn polling<T>(links: &mut Links, f: impl Future<Output = T>) -> T {
        tokio::pin!(f);
        let polled = async {
            loop {
                let _ = std::future::poll_fn(|cx| links.poll_frames(cx)).await;
            }
        };
        tokio::select! {
            t = &mut f => t,
            () = polled => unreachable!("polling never ends"),
        }
    }

    /// A frame queued before the connection is up goes out once it is; frames back arrive
    /// whole and in order however the bytes are split (one large frame across many TLS
    /// records); a connection the peer closes is reported down and dialled again, and
    /// the new one carries frames both ways.
    #[tokio::test]
    async fn frames_cross_whole_and_in_order_and_a_lost_connection_is_dialled_again() {
        let (_dir, mut conns, mut links, stats, addr) = node0().await;
        links.add(NodeId(0), PeerId::Node(NodeId(0)), addr);
        links.send(NodeId(0), b"early");
        let conn = polling(&mut links, async { conns.recv().await.expect("dialled") }).await;
        assert_eq!(conn.peer, PeerId::Client(ClientId(1000)));
        let (mut r, mut w) = tokio::io::split(conn.stream);
        let first = polling(&mut links, read_frame(&mut r)).await.expect("read").expect("a frame");
        assert_eq!(first, b"early");
        assert!(links.states().all(|(_, s)| s.connected()));

        // Many small frames in one write: they straddle the read buffer's end.
        let burst: Vec<Vec<u8>> =
            (0..50_000u32).map(|i| i.to_le_bytes()[..(i % 4 + 1) as usize].repeat((i % 3 + 1) as usize)).collect();
        w.write_all(&burst.iter().flat_map(|f| framed(f)).collect::<Vec<u8>>()).await.expect("sent");
        w.flush().await.expect("flushed");
        assert!(frames(&mut links, burst.len()).await == burst, "the burst arrives whole and in order");
        let large: Vec<u8> = (0..300_000u32).map(|i| i as u8).collect();
        let mut bytes = [framed(b"one"), framed(b"two"), framed(&large), framed(b"")].concat();
        // Split mid-length and mid-frame.
        let tail = bytes.split_off(5);
        w.write_all(&bytes).await.expect("sent");
        w.flush().await.expect("flushed");
        tokio::time::sleep(Duration::from_millis(20)).await;
        w.write_all(&tail).await.expect("sent");
        w.flush().await.expect("flushed");
        let got = frames(&mut links, 4).await;
        assert_eq!(got, vec![b"one".to_vec(), b"two".to_vec(), large, Vec::new()]);
        assert_eq!(stats.frames_in.load(Ordering::Relaxed), burst.len() as u64 + 4);

        drop((r, w));
        let down = async {
            loop {
                let _ = std::future::poll_fn(|cx| links.poll_frames(cx)).await;
            }
        };
        let _ = tokio::time::timeout(Duration::from_millis(200), down).await;
        let again = polling(&mut links, async { conns.recv().await.expect("dialled again") }).await;
        assert_eq!(stats.connects.load(Ordering::Relaxed), 2);
        let (mut r, mut w) = tokio::io::split(again.stream);
        links.send(NodeId(0), b"later");
        let got = polling(&mut links, read_frame(&mut r)).await.expect("read").expect("a frame");
        assert_eq!(got, b"later");
        w.write_all(&framed(b"back")).await.expect("sent");
        w.flush().await.expect("flushed");
        assert_eq!(frames(&mut links, 1).await, vec![b"back".to_vec()]);
    }

    /// A frame longer than FRAME_MAX closes the connection (counted, reported) before
    /// anything is allocated for it; the link comes back.
    #[tokio::test]
    async fn an_oversized_frame_closes_the_connection() {
        let (_dir, mut conns, mut links, stats, addr) = node0().await;
        links.add(NodeId(0), PeerId::Node(NodeId(0)), addr);
        let conn = polling(&mut links, async { conns.recv().await.expect("dialled") }).await;
        let (_r, mut w) = tokio::io::split(conn.stream);
        w.write_all(&((FRAME_MAX + 1) as u32).to_be_bytes()).await.expect("sent");
        w.flush().await.expect("flushed");
        let closed = async {
            while stats.oversized.load(Ordering::Relaxed) == 0 {
                let _ =
                    tokio::time::timeout(Duration::from_millis(10), std::future::poll_fn(|cx| links.poll_frames(cx)))
                        .await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), closed).await.expect("refused in time");
        let (_, state) = links.states().next().expect("the link");
        assert!(state.trouble().is_some_and(|why| why.contains("exceeds")), "{:?}", state.trouble());
        let _again = polling(&mut links, async { conns.recv().await.expect("dialled again") }).await;
    }

    /// A link's queue holds at most SEND_QUEUE_MAX frames; the rest are dropped and
    /// counted, and nothing goes to a node without a link.
    #[tokio::test]
    async fn a_full_queue_drops_and_counts() {
        let (_dir, _conns, mut links, stats, _addr) = node0().await;
        // Never dialled: the address is a closed port, so nothing is written.
        links.add(NodeId(0), PeerId::Node(NodeId(0)), "127.0.0.1:9".parse().expect("addr"));
        for _ in 0..SEND_QUEUE_MAX + 3 {
            links.send(NodeId(0), b"x");
        }
        links.send(NodeId(7), b"nobody");
        assert_eq!(stats.send_queue_full.load(Ordering::Relaxed), 3);
        assert_eq!(stats.frames_out.load(Ordering::Relaxed), SEND_QUEUE_MAX as u64);
    }
}
