//! Observability: Prometheus `/metrics` and a JSON `/status` per node, on a local port.

use crate::transport::TransportStats;
use axum::extract::State;
use axum::routing::get;
use axum::Router;
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};
use std::fmt::Write;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub kind: String,
}

/// Handles the protocol task updates; the registry renders them.
#[derive(Clone)]
pub struct Metrics {
    pub decided: Counter,
    pub ticks: Counter,
    /// Node-plane messages handed to the service, and those dropped, by why.
    pub plane_delivered: Counter,
    pub plane_rejected: Family<KindLabels, Counter>,
    pub executed_requests: Counter,
    pub view_changes: Counter,
    pub state_transfers: Counter,
    /// Checkpoint chunks of finished state transfers: all of them, and those already
    /// held (not fetched).
    pub transfer_chunks: Counter,
    pub transfer_chunks_reused: Counter,
    pub divergences: Counter,
    pub slow_primary: Counter,
    pub banned_clients: Counter,
    /// Push events dropped from full queues.
    pub push_dropped: Counter,
    /// Operations proposed by digest that this node fetched from an endorser.
    pub operations_fetched: Counter,
    pub rejected: Family<KindLabels, Counter>,
    /// Read-only operations answered without ordering, by consistency.
    pub reads_answered: Family<KindLabels, Counter>,
    pub batch_size: Histogram,
    pub fsync_seconds: Histogram,
    /// Serializing, chunking and hashing one checkpoint off the protocol thread.
    pub checkpoint_seconds: Histogram,
    /// Snapshot chunks stored, those already held (not written again), and bytes written.
    pub snapshot_chunks: Counter,
    pub snapshot_chunks_reused: Counter,
    pub snapshot_bytes: Counter,
    pub view: Gauge,
    pub executed: Gauge,
    pub stable: Gauge,
    pub inbound_queue: Gauge,
    /// State transfer progress in per mille (1000 when idle or done).
    pub transfer_permille: Gauge,
    /// Membership epoch (membership changes done).
    pub epoch: Gauge,
    /// What happened to the node, for a program that embeds it (`NodeHandle::events`).
    pub events: tokio::sync::broadcast::Sender<crate::embed::NodeEvent>,
}

/// What `/status` (and `keel status`) shows.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Status {
    pub node: u32,
    pub view: u64,
    pub primary: u32,
    pub view_change_to: Option<u64>,
    pub executed: u64,
    pub stable: u64,
    pub peers_connected: u64,
    pub peers: u64,
    /// (chunks held, chunks total) while a state transfer runs.
    pub transfer: Option<(usize, usize)>,
    /// Membership epoch, and the members' stable ids in index order.
    #[serde(default)]
    pub epoch: u64,
    #[serde(default)]
    pub members: Vec<u32>,
    /// What the service reports of itself (`ServiceReport::status`), one line each.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub service: Vec<String>,
}

/// A service's own figures, shown with the node's: appended to `/metrics` and to
/// `/status` (`keel status`). Set with `NodeBuilder::report`.
pub trait ServiceReport: Send + Sync {
    /// Prometheus text: `# HELP`, `# TYPE` and samples, names prefixed `keel_`, no `# EOF`.
    fn metrics(&self) -> String;
    /// Short human lines for `keel status`.
    fn status(&self) -> Vec<String>;
}

pub struct Shared {
    registry: Registry,
    pub status: Mutex<Status>,
    pub transport: Arc<TransportStats>,
    pub(crate) report: Mutex<Option<Arc<dyn ServiceReport>>>,
}

impl Shared {
    fn report(&self) -> Option<Arc<dyn ServiceReport>> {
        self.report.lock().ok().and_then(|r| r.clone())
    }

    /// The status with the service's lines.
    pub fn full_status(&self) -> Status {
        let mut st = self.status.lock().map(|g| g.clone()).unwrap_or_default();
        if let Some(r) = self.report() {
            st.service = r.status();
        }
        st
    }
}

impl Metrics {
    pub fn new() -> (Metrics, Registry) {
        let mut r = Registry::with_prefix("keel");
        let m = Metrics {
            events: tokio::sync::broadcast::channel(crate::embed::EVENTS_QUEUE).0,
            decided: Counter::default(),
            ticks: Counter::default(),
            plane_delivered: Counter::default(),
            plane_rejected: Family::default(),
            executed_requests: Counter::default(),
            view_changes: Counter::default(),
            state_transfers: Counter::default(),
            transfer_chunks: Counter::default(),
            transfer_chunks_reused: Counter::default(),
            divergences: Counter::default(),
            slow_primary: Counter::default(),
            banned_clients: Counter::default(),
            push_dropped: Counter::default(),
            operations_fetched: Counter::default(),
            rejected: Family::default(),
            reads_answered: Family::default(),
            batch_size: Histogram::new(exponential_buckets(1.0, 2.0, 12)),
            fsync_seconds: Histogram::new(exponential_buckets(0.00005, 2.0, 16)),
            checkpoint_seconds: Histogram::new(exponential_buckets(0.0001, 2.0, 20)),
            snapshot_chunks: Counter::default(),
            snapshot_chunks_reused: Counter::default(),
            snapshot_bytes: Counter::default(),
            view: Gauge::default(),
            executed: Gauge::default(),
            stable: Gauge::default(),
            inbound_queue: Gauge::default(),
            transfer_permille: Gauge::default(),
            epoch: Gauge::default(),
        };
        r.register("decided", "Consensus instances decided", m.decided.clone());
        r.register("ticks", "Agreed-time ticks the service ran (tick_ms)", m.ticks.clone());
        r.register("plane_delivered", "Node-plane messages handed to the service", m.plane_delivered.clone());
        r.register(
            "plane_rejected",
            "Node-plane messages dropped: untrusted sender, refused by the service, full queue, no plane, unknown peer",
            m.plane_rejected.clone(),
        );
        r.register("executed_requests", "Client requests executed", m.executed_requests.clone());
        r.register("view_changes", "View changes started", m.view_changes.clone());
        r.register("state_transfers", "State transfers started", m.state_transfers.clone());
        r.register(
            "state_transfer_chunks",
            "Checkpoint chunks installed by state transfers",
            m.transfer_chunks.clone(),
        );
        r.register(
            "state_transfer_chunks_reused",
            "Checkpoint chunks a state transfer already held (from a transfer it replaced or an own snapshot)",
            m.transfer_chunks_reused.clone(),
        );
        r.register("divergences", "Local checkpoints that differed from the stable one", m.divergences.clone());
        r.register(
            "slow_primary_suspicions",
            "Times this node asked to replace a primary that kept up with its timers but not with the recent best",
            m.slow_primary.clone(),
        );
        r.register(
            "banned_clients",
            "Client connections closed for too many requests with bad MACs",
            m.banned_clients.clone(),
        );
        r.register(
            "push_dropped",
            "Push events dropped unacknowledged because a client's queue or all queues were full",
            m.push_dropped.clone(),
        );
        r.register(
            "operations_fetched",
            "Operations a PROPOSE named by digest that this node fetched from a node that endorsed them",
            m.operations_fetched.clone(),
        );
        r.register("rejected", "Inputs dropped as invalid, by message kind", m.rejected.clone());
        r.register(
            "reads_answered",
            "Read-only operations answered without ordering, by consistency",
            m.reads_answered.clone(),
        );
        r.register("batch_size", "Requests per executed batch", m.batch_size.clone());
        r.register("fsync_seconds", "Duration of each WAL fsync", m.fsync_seconds.clone());
        r.register(
            "checkpoint_seconds",
            "Serializing, chunking and hashing a checkpoint off the protocol thread",
            m.checkpoint_seconds.clone(),
        );
        r.register("snapshot_chunks", "Checkpoint snapshot chunks stored", m.snapshot_chunks.clone());
        r.register(
            "snapshot_chunks_reused",
            "Snapshot chunks already on disk from an earlier snapshot, not written again",
            m.snapshot_chunks_reused.clone(),
        );
        r.register("snapshot_bytes", "Bytes written for checkpoint snapshots", m.snapshot_bytes.clone());
        r.register("view", "Installed view", m.view.clone());
        r.register("executed", "Last executed instance", m.executed.clone());
        r.register("stable", "Stable checkpoint", m.stable.clone());
        r.register("inbound_queue", "Inputs waiting for the protocol task", m.inbound_queue.clone());
        r.register(
            "state_transfer_permille",
            "State transfer progress (1000 = idle or done)",
            m.transfer_permille.clone(),
        );
        r.register("epoch", "Membership epoch", m.epoch.clone());
        m.transfer_permille.set(1000);
        (m, r)
    }
}

pub(crate) fn render(shared: &Shared) -> String {
    let mut text = String::new();
    let _ = encode(&mut text, &shared.registry);
    // Transport counters live in plain atomics shared by many tasks; render them here.
    let t = &shared.transport;
    let text = text.trim_end().trim_end_matches("# EOF").to_string();
    let mut out = text;
    for (name, help, v) in [
        ("frames_in", "Frames received", &t.frames_in),
        ("frames_out", "Frames sent", &t.frames_out),
        ("bytes_in", "Bytes received", &t.bytes_in),
        ("bytes_out", "Bytes sent", &t.bytes_out),
        ("send_queue_full", "Frames dropped on a full send queue", &t.send_queue_full),
        ("oversized_frames", "Connections closed for an oversized frame", &t.oversized),
        ("undecodable_frames", "Frames that did not decode", &t.undecodable),
        ("rejected_connections", "Failed or unauthenticated handshakes", &t.rejected_connections),
        ("connects", "Outgoing connections established", &t.connects),
        ("stage_verified", "Node messages whose signature the verify stage checked", &t.stage_verified),
    ] {
        let _ = write!(
            out,
            "\n# HELP keel_{name} {help}.\n# TYPE keel_{name} counter\nkeel_{name}_total {}",
            v.load(Ordering::Relaxed)
        );
    }
    if let Some(r) = shared.report() {
        let text = r.metrics();
        let text = text.trim_end();
        if !text.is_empty() {
            out.push('\n');
            out.push_str(text);
        }
    }
    out.push_str("\n# EOF\n");
    out
}

/// Serves `/metrics` and `/status` on `addr` until the process ends.
///
/// # Errors
/// If the address cannot be bound.
pub async fn serve(
    addr: SocketAddr,
    registry: Registry,
    transport: Arc<TransportStats>,
) -> std::io::Result<Arc<Shared>> {
    let shared =
        Arc::new(Shared { registry, status: Mutex::new(Status::default()), transport, report: Mutex::new(None) });
    let app =
        Router::new()
            .route("/metrics", get(|State(s): State<Arc<Shared>>| async move { render(&s) }))
            .route(
                "/status",
                get(|State(s): State<Arc<Shared>>| async move {
                    serde_json::to_string(&s.full_status()).unwrap_or_default()
                }),
            )
            .with_state(shared.clone());
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok(shared)
}

/// Fetches a node's `/status` (a plain HTTP/1.0 GET on loopback).
///
/// # Errors
/// Connection failures or an unparsable answer.
pub fn fetch_status(addr: SocketAddr, timeout: std::time::Duration) -> Result<Status, String> {
    use std::io::{Read, Write as _};
    let mut s = std::net::TcpStream::connect_timeout(&addr, timeout).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(timeout)).map_err(|e| e.to_string())?;
    s.write_all(b"GET /status HTTP/1.0\r\nHost: keel\r\n\r\n").map_err(|e| e.to_string())?;
    let mut body = String::new();
    s.read_to_string(&mut body).map_err(|e| e.to_string())?;
    let json = body.split("\r\n\r\n").nth(1).ok_or("no body")?;
    serde_json::from_str(json).map_err(|e| e.to_string())
}
