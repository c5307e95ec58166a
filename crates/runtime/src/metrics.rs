//! Observability, on a local port per node: `/metrics` (OpenMetrics text, or the
//! Prometheus text format when the client asks for `text/plain`), a JSON `/status`,
//! `/health` (the process answers) and `/ready` (the node can take part in agreement).

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
    /// The checkpoint of the latest divergence (0: none yet).
    pub last_divergence: Gauge,
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
    /// Checkpoint bytes that left memory once their snapshot was durable.
    pub snapshot_released: Counter,
    /// Checkpoint chunks that could not be read back from the snapshot packs.
    pub snapshot_unreadable: Counter,
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

/// A client's own view of its operations (the library's, so every program using
/// [`KeelClient`](crate::client::KeelClient) has it): latency from `invoke` to result, by
/// kind (`ordered`, `read`), and failures by reason (`timeout`, `too_large`). A node that
/// runs front ends appends its in-process client's to `/metrics`.
pub struct ClientMetrics {
    registry: Registry,
    pub(crate) latency: Family<KindLabels, Histogram>,
    pub(crate) failures: Family<KindLabels, Counter>,
    /// `latency`'s two series looked up once: a lookup by label allocates and hashes,
    /// and this runs once per operation (1.6 % of a benchmark client's CPU).
    ordered: std::sync::OnceLock<Histogram>,
    read: std::sync::OnceLock<Histogram>,
}

impl ClientMetrics {
    pub(crate) fn new() -> ClientMetrics {
        let mut registry = Registry::with_prefix("keel_client");
        // 100 µs to ~52 s, doubling.
        let latency = Family::<KindLabels, Histogram>::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.0001, 2.0, 20))
        });
        let failures = Family::<KindLabels, Counter>::default();
        registry.register("invoke_seconds", "Operation latency seen by this client, invoke to result", latency.clone());
        registry.register("invoke_failures", "Operations that ended without a result, by reason", failures.clone());
        ClientMetrics { registry, latency, failures, ordered: Default::default(), read: Default::default() }
    }

    pub(crate) fn observe(&self, kind: &str, seconds: f64) {
        let series = match kind {
            "ordered" => &self.ordered,
            "read" => &self.read,
            _ => return self.latency.get_or_create(&KindLabels { kind: kind.into() }).observe(seconds),
        };
        series.get_or_init(|| self.latency.get_or_create(&KindLabels { kind: kind.into() }).clone()).observe(seconds);
    }

    pub(crate) fn failed(&self, reason: &str) {
        self.failures.get_or_create(&KindLabels { kind: reason.into() }).inc();
    }

    /// Operations that completed with a result, of `kind` (`ordered` or `read`).
    pub fn completed(&self, kind: &str) -> u64 {
        let text = self.render();
        let name = format!("keel_client_invoke_seconds_count{{kind=\"{kind}\"}} ");
        text.lines().find_map(|l| l.strip_prefix(name.as_str())?.trim().parse().ok()).unwrap_or(0)
    }

    /// OpenMetrics text of these families, without the closing `# EOF`.
    pub fn render(&self) -> String {
        let mut text = String::new();
        let _ = encode(&mut text, &self.registry);
        text.trim_end().trim_end_matches("# EOF").trim_end().to_string()
    }
}

/// What `/status` (and `keel status`) shows.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Status {
    pub node: u32,
    pub view: keel_core::ids::View,
    pub primary: u32,
    pub view_change_to: Option<keel_core::ids::View>,
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
    /// Order nodes that must take part for agreement to progress (0: not published yet).
    #[serde(default)]
    pub quorum: u64,
    /// What the service reports of itself (`ServiceReport::status`), one line each.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub service: Vec<String>,
    /// Times this node's own checkpoint differed from the certified one (its state went
    /// wrong and was repaired by state transfer), and the latest such checkpoint.
    #[serde(default)]
    pub divergences: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diverged_at: Option<u64>,
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
    /// The node's in-process client's figures, once it has one (front ends).
    pub(crate) client: Mutex<Option<Arc<ClientMetrics>>>,
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
            last_divergence: Gauge::default(),
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
            snapshot_released: Counter::default(),
            snapshot_unreadable: Counter::default(),
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
            "diverged_at_checkpoint",
            "The checkpoint of the latest divergence (0: none)",
            m.last_divergence.clone(),
        );
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
        r.register(
            "snapshot_released_bytes",
            "Checkpoint bytes dropped from memory once their snapshot was durable (read back from disk when needed)",
            m.snapshot_released.clone(),
        );
        r.register(
            "snapshot_unreadable",
            "Checkpoint reads back from the snapshot packs that failed or did not match their digest",
            m.snapshot_unreadable.clone(),
        );
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
    // Without its "# EOF" and the line end before it: every family appended below starts
    // with a line end of its own (a blank line is an error to OpenMetrics parsers).
    let text = text.trim_end().trim_end_matches("# EOF").trim_end().to_string();
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
    process_metrics(&mut out);
    if let Some(c) = shared.client.lock().ok().and_then(|c| c.clone()) {
        let text = c.render();
        if !text.is_empty() {
            out.push('\n');
            out.push_str(&text);
        }
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

/// The process's own figures under the names every Prometheus client library uses
/// (`process_*`), read from `/proc/self`; on a system without it, none.
fn process_metrics(out: &mut String) {
    // /proc reports CPU times in USER_HZ ticks, 100 a second on every Linux port.
    const TICKS_PER_SECOND: f64 = 100.0;
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else { return };
    // The fields after the command name, which may itself hold spaces and parentheses.
    let fields: Vec<&str> =
        stat.rsplit_once(')').map(|(_, rest)| rest.split_whitespace().collect()).unwrap_or_default();
    let field = |n: usize| fields.get(n - 3).and_then(|v| v.parse::<f64>().ok());
    let mut family = |name: &str, kind: &str, help: &str, sample: String| {
        let _ = write!(out, "\n# HELP {name} {help}.\n# TYPE {name} {kind}\n{sample}");
    };
    if let (Some(utime), Some(stime)) = (field(14), field(15)) {
        let secs = (utime + stime) / TICKS_PER_SECOND;
        family(
            "process_cpu_seconds",
            "counter",
            "Total user and system CPU time spent in seconds",
            format!("process_cpu_seconds_total {secs}"),
        );
    }
    if let Some(vsize) = field(23) {
        family(
            "process_virtual_memory_bytes",
            "gauge",
            "Virtual memory size in bytes",
            format!("process_virtual_memory_bytes {vsize}"),
        );
    }
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib = |key: &str| {
        status
            .lines()
            .find(|l| l.starts_with(key))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
    };
    if let Some(rss) = kib("VmRSS:") {
        family(
            "process_resident_memory_bytes",
            "gauge",
            "Resident memory size in bytes",
            format!("process_resident_memory_bytes {}", rss * 1024),
        );
    }
    if let Some(hwm) = kib("VmHWM:") {
        family(
            "process_resident_memory_max_bytes",
            "gauge",
            "Peak resident memory size in bytes",
            format!("process_resident_memory_max_bytes {}", hwm * 1024),
        );
    }
    if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
        family(
            "process_open_fds",
            "gauge",
            "Number of open file descriptors",
            format!("process_open_fds {}", fds.count()),
        );
    }
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap_or_default();
    if let Some(max) = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .and_then(|l| l.split_whitespace().nth(3))
        .and_then(|v| v.parse::<u64>().ok())
    {
        family("process_max_fds", "gauge", "Maximum number of open file descriptors", format!("process_max_fds {max}"));
    }
    let boot = std::fs::read_to_string("/proc/stat").ok().and_then(|s| {
        s.lines().find(|l| l.starts_with("btime ")).and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
    });
    if let (Some(boot), Some(start)) = (boot, field(22)) {
        let at = boot + start / TICKS_PER_SECOND;
        family(
            "process_start_time_seconds",
            "gauge",
            "Start time of the process since the Unix epoch in seconds",
            format!("process_start_time_seconds {at}"),
        );
    }
}

/// OpenMetrics text as the Prometheus text format (0.0.4): no `# EOF` or `# UNIT`
/// lines, and a counter's metadata under its sample's name (`x_total`), as that format
/// names counters.
pub(crate) fn prometheus_text(open_metrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = open_metrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(open_metrics.len());
    for line in open_metrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = line
            .strip_prefix("# HELP ")
            .map(|r| ("# HELP ", r))
            .or_else(|| line.strip_prefix("# TYPE ").map(|r| ("# TYPE ", r)));
        match meta {
            Some((tag, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                if counters.contains(name) {
                    let _ = writeln!(out, "{tag}{name}_total {tail}");
                } else {
                    let _ = writeln!(out, "{line}");
                }
            }
            None => {
                let _ = writeln!(out, "{line}");
            }
        }
    }
    out
}

/// Whether the node can take part in agreement now: it published a status, is not in a
/// view change or a state transfer, and is connected to enough nodes to form a quorum.
fn readiness(st: &Status) -> Result<String, String> {
    if st.quorum == 0 {
        return Err("starting".into());
    }
    if let Some(v) = st.view_change_to {
        return Err(format!("changing to view {v}"));
    }
    if let Some((have, total)) = st.transfer {
        return Err(format!("state transfer: {have}/{total} chunks"));
    }
    if st.peers_connected + 1 < st.quorum {
        return Err(format!(
            "connected to {} of the {} other nodes a quorum of {} needs",
            st.peers_connected,
            st.quorum - 1,
            st.quorum
        ));
    }
    Ok(format!("ready: view {}, executed {}", st.view, st.executed))
}

/// Serves `/metrics`, `/status`, `/health` and `/ready` on `addr` until the process ends.
///
/// # Errors
/// If the address cannot be bound.
pub async fn serve(
    addr: SocketAddr,
    registry: Registry,
    transport: Arc<TransportStats>,
) -> std::io::Result<Arc<Shared>> {
    let shared = Arc::new(Shared {
        registry,
        status: Mutex::new(Status::default()),
        transport,
        report: Mutex::new(None),
        client: Mutex::new(None),
    });
    let app =
        Router::new()
            .route(
                "/metrics",
                get(|State(s): State<Arc<Shared>>, headers: axum::http::HeaderMap| async move {
                    let accept = headers.get(axum::http::header::ACCEPT).and_then(|v| v.to_str().ok()).unwrap_or("");
                    // OpenMetrics unless the client asks for the older text format only.
                    if accept.contains("text/plain") && !accept.contains("application/openmetrics-text") {
                        (
                            [(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
                            prometheus_text(&render(&s)),
                        )
                    } else {
                        (
                            [(
                                axum::http::header::CONTENT_TYPE,
                                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                            )],
                            render(&s),
                        )
                    }
                }),
            )
            .route("/health", get(|| async { "ok\n" }))
            .route(
                "/ready",
                get(|State(s): State<Arc<Shared>>| async move {
                    match readiness(&s.full_status()) {
                        Ok(why) => (axum::http::StatusCode::OK, format!("{why}\n")),
                        Err(why) => (axum::http::StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {why}\n")),
                    }
                }),
            )
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prometheus_variant_drops_eof_and_names_counters_by_their_samples() {
        let om = "# HELP keel_x Things.\n# TYPE keel_x counter\nkeel_x_total 3\n# HELP keel_g A gauge.\n# TYPE keel_g gauge\nkeel_g 1\n# EOF\n";
        let text = prometheus_text(om);
        assert_eq!(text, "# HELP keel_x_total Things.\n# TYPE keel_x_total counter\nkeel_x_total 3\n# HELP keel_g A gauge.\n# TYPE keel_g gauge\nkeel_g 1\n");
    }

    #[test]
    fn ready_only_with_a_quorum_and_no_view_change_or_transfer() {
        let mut st = Status { quorum: 3, peers: 3, peers_connected: 2, ..Status::default() };
        assert!(readiness(&st).is_ok());
        st.peers_connected = 1;
        assert!(readiness(&st).unwrap_err().contains("quorum of 3"));
        st.peers_connected = 3;
        st.view_change_to = Some(keel_core::ids::View(2));
        assert!(readiness(&st).is_err());
        st.view_change_to = None;
        st.transfer = Some((1, 9));
        assert!(readiness(&st).is_err());
        assert!(readiness(&Status::default()).is_err(), "nothing published yet");
    }

    #[test]
    fn process_metrics_are_read_from_proc() {
        let mut out = String::new();
        process_metrics(&mut out);
        for name in [
            "process_cpu_seconds_total ",
            "process_resident_memory_bytes ",
            "process_open_fds ",
            "process_max_fds ",
            "process_start_time_seconds ",
        ] {
            let line = out.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("{name} missing:\n{out}"));
            let value: f64 = line[name.len()..].parse().expect("a number");
            assert!(value >= 0.0);
        }
        let rss: f64 = out
            .lines()
            .find_map(|l| l.strip_prefix("process_resident_memory_bytes "))
            .and_then(|v| v.parse().ok())
            .expect("rss");
        assert!(rss > 1e6, "a test process holds more than 1 MB: {rss}");
    }
}
