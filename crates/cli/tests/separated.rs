//! Multi-process tests of separated execution (UpRight §4.2, `keel init --layout
//! separated-exec`): real `keel node` processes on loopback, four order nodes and three
//! execution nodes at u = r = 1, kill -9. Every node is a child the test holds and kills
//! by handle.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod support;
use support::{get, metric, put, read_only, reads_never_stale_under_writes, start_writers, Cluster};

/// Order nodes are 0..4, execution nodes 4..7 at u = r = 1.
const ORDER: usize = 4;

async fn progress(cluster: &Cluster, what: &str) {
    let c = cluster.client(1006);
    let started = Instant::now();
    put(&c, &format!("probe-{what}"), "x").await.unwrap_or_else(|e| panic!("no progress {what}: {e}"));
    eprintln!("progress {what}: {:?}", started.elapsed());
}

/// Waits until execution node `i` executed at least `seq`.
async fn executed_at_least(cluster: &Cluster, i: usize, seq: u64, within: Duration) -> u64 {
    let started = Instant::now();
    loop {
        let executed = cluster.status(i).map_or(0, |s| s.executed);
        if executed >= seq {
            return executed;
        }
        assert!(started.elapsed() < within, "node {i} executed only {executed} of {seq} within {within:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn separated_execution_survives_kill_9_of_execution_and_order_nodes_and_loses_no_write() {
    let mut cluster = Cluster::init_separated(1, 1);
    assert_eq!(cluster.n(), 7);
    progress(&cluster, "at start").await;
    let stop = Arc::new(Mutex::new(false));
    let acked = Arc::new(Mutex::new(Vec::new()));
    let writers = start_writers(&cluster, 3, stop.clone(), acked.clone());
    tokio::time::sleep(Duration::from_millis(1000)).await;
    // An execution node down: the other two (r + 1) still answer.
    cluster.kill(ORDER);
    progress(&cluster, "with execution node 4 down").await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    cluster.start(ORDER);
    // The order primary down: a view change among the order nodes; execution goes on.
    cluster.kill(0);
    progress(&cluster, "with order primary 0 down").await;
    cluster.start(0);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    *stop.lock().expect("lock") = true;
    for w in writers {
        w.await.expect("writer");
    }
    let acked = acked.lock().expect("lock").clone();
    eprintln!("{} writes acknowledged", acked.len());
    assert!(acked.len() > 100, "too little progress: {}", acked.len());

    // The restarted execution node catches up (commits from the order nodes, or the
    // certified state from its peers) ...
    let others = cluster.status(ORDER + 1).expect("node 5 answers").executed;
    let caught_up = executed_at_least(&cluster, ORDER, others, Duration::from_secs(30)).await;
    eprintln!("execution node 4 at {caught_up} (node 5 was at {others})");
    // ... and order nodes certified execution checkpoints (interval 256) and collected.
    let stable = cluster.status(ORDER + 2).expect("node 6 answers").stable;
    assert!(stable > 0, "no execution checkpoint certified");
    for i in 0..ORDER {
        assert!(cluster.status(i).expect("order node answers").stable > 0, "order node {i} never collected");
    }
    // With another execution node down, the restarted one is needed for r + 1 matching
    // replies: every acknowledged write is there.
    cluster.kill(ORDER + 1);
    let c = cluster.client(1007);
    for (k, v) in &acked {
        assert_eq!(get(&c, k).await.as_deref(), Some(v.as_str()), "acknowledged write {k} lost");
    }
    // Order nodes keep the order state only: their snapshots are small beside an
    // execution node's (3 x hundreds of 12-byte values and keys).
    let snapshot_bytes = |i: usize| -> u64 {
        let dir = cluster.path().join(format!("node-{i}/data"));
        walk(&dir).into_iter().filter(|(p, _)| p.contains("snap")).map(|(_, len)| len).sum()
    };
    let (order, exec) = (snapshot_bytes(1), snapshot_bytes(6));
    eprintln!("snapshot bytes: order node 1 {order}, execution node 6 {exec}");
    assert!(exec > 0 && order * 10 < exec, "order snapshots hold the order state only: {order} vs {exec} bytes");
}

/// Every file under `dir` with its length.
fn walk(dir: &std::path::Path) -> Vec<(String, u64)> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            files.extend(walk(&path));
        } else if let Ok(meta) = entry.metadata() {
            files.push((path.to_string_lossy().to_string(), meta.len()));
        }
    }
    files
}

/// rq-mac sends a request first to u + r + 1 order nodes chosen by who answered lately;
/// separated, order nodes never answer, so the client sends to all of them: with a
/// backup down, puts do not wait for the 500 ms retransmission.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_separated_execution_and_an_order_backup_down_requests_do_not_wait_for_a_retransmission() {
    let mut cluster = Cluster::init_separated(1, 1);
    let c = cluster.client(1000);
    put(&c, "ready", "1").await.expect("cluster up");
    cluster.kill(2);
    let mut lat = Vec::new();
    for i in 0..100 {
        let started = Instant::now();
        put(&c, &format!("k{i}"), "v").await.expect("put acknowledged");
        lat.push(started.elapsed());
    }
    lat.sort();
    let (p50, p99) = (lat[lat.len() / 2], lat[lat.len() * 99 / 100]);
    eprintln!("put p50/p99 with order node 2 down: {p50:?}/{p99:?}");
    assert!(p99 < Duration::from_millis(400), "puts waited for retransmissions: p99 {p99:?}");
}

/// Read-only reads with execution apart (ARCHITECTURE §7): answered by execution nodes
/// without ordering; a linearizable read or a read index waits for an index from a
/// quorum of order nodes, a serializable one for the reader's last write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_separated_execution_read_only_reads_are_answered_by_execution_nodes_without_ordering() {
    use keel_core::message::ReadConsistency::{Index, Linearizable, Serializable};
    let mut cluster = Cluster::init_separated(1, 1);
    let writer = cluster.client(1000);
    // Answers that do not come within 5 s would be ordered instead (a loaded host).
    let reader = cluster.client_retransmitting_after(1001, 5_000);
    put(&writer, "k", "v1").await.expect("put");
    assert_eq!(read_only(&reader, "k", Linearizable).await.as_deref(), Some("v1"));
    put(&writer, "k", "v2").await.expect("put");
    assert_eq!(read_only(&writer, "k", Serializable).await.as_deref(), Some("v2"), "reads its own write");
    let big = "b".repeat(1000);
    put(&writer, "big", &big).await.expect("put");
    // Every execution node executed the three puts (a put completes at r + 1 = 2).
    let executed = |c: &Cluster| {
        (ORDER..ORDER + 3).map(|i| metric(&c.metrics(i), "keel_executed_requests_total")).collect::<Vec<_>>()
    };
    let started = Instant::now();
    while executed(&cluster) != [3; 3] && started.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let before = executed(&cluster);
    assert_eq!(before, [3; 3]);
    for _ in 0..30 {
        assert_eq!(read_only(&reader, "k", Linearizable).await.as_deref(), Some("v2"));
        assert_eq!(read_only(&reader, "k", Serializable).await.as_deref(), Some("v2"));
        assert_eq!(read_only(&reader, "k", Index).await.as_deref(), Some("v2"));
        assert_eq!(read_only(&reader, "big", Linearizable).await.as_deref(), Some(big.as_str()));
        assert_eq!(read_only(&reader, "big", Index).await.as_deref(), Some(big.as_str()));
    }
    assert_eq!(executed(&cluster), before, "read-only reads were ordered");
    let answered = |cluster: &Cluster, kind: &str| -> u64 {
        let name = format!("keel_reads_answered_total{{kind=\"{kind}\"}}");
        (ORDER..ORDER + 3).filter_map(|i| cluster.status(i).map(|_| metric(&cluster.metrics(i), &name))).sum()
    };
    // A read index goes to r + 1 = 2 execution nodes; the others go to all three, of
    // which r + 1 suffice.
    assert!(answered(&cluster, "index") >= 120, "read-index answers: {}", answered(&cluster, "index"));
    assert!(answered(&cluster, "linearizable") >= 120, "linearizable answers: {}", answered(&cluster, "linearizable"));
    assert!(answered(&cluster, "serializable") >= 60, "serializable answers: {}", answered(&cluster, "serializable"));

    // Under concurrent writes, a linearizable read (or read index) never returns a value
    // older than the last write acknowledged before it began.
    let (checked, writes) = reads_never_stale_under_writes(&cluster, &reader, 1002, Duration::from_secs(3)).await;
    eprintln!("{checked} linearizable and read-index reads under {writes} concurrent writes");
    assert!(checked > 20 && writes > 20, "{checked} reads, {writes} writes");

    // With an execution node down, r + 1 = 2 still answer a linearizable read.
    cluster.kill(ORDER + 2);
    let before = answered(&cluster, "linearizable");
    for _ in 0..10 {
        assert!(read_only(&reader, "k", Linearizable).await.is_some());
    }
    assert!(answered(&cluster, "linearizable") >= before + 20, "answered without the node down");
}
