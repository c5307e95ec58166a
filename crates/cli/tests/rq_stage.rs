//! Multi-process tests of a request-quorum stage on nodes of its own (UpRight §4.1,
//! `keel init --layout separated`): real `keel node` processes on loopback, u = r = 1:
//! order nodes 0..4, execution nodes 4..7, RQ nodes 7..11; kill -9. Every node is a
//! child the test holds and kills by handle.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod support;
use support::{get, metric, put, start_writers, Cluster};

const ORDER: usize = 4;
const EXEC: usize = 3;
/// The first RQ node: clients start at RQ position `id mod 4`, so client 1000 sends to
/// RQ nodes 7, 8 and 9 first.
const RQ: usize = ORDER + EXEC;

async fn progress(cluster: &Cluster, what: &str) {
    let c = cluster.client(1006);
    let started = Instant::now();
    put(&c, &format!("probe-{what}"), "x").await.unwrap_or_else(|e| panic!("no progress {what}: {e}"));
    eprintln!("progress {what}: {:?}", started.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_every_stage_apart_writes_survive_kill_9_of_rq_order_and_execution_nodes() {
    let mut cluster = Cluster::init_stages_apart(1, 1);
    assert_eq!(cluster.n(), ORDER + EXEC + ORDER);
    progress(&cluster, "at start").await;
    let stop = Arc::new(Mutex::new(false));
    let acked = Arc::new(Mutex::new(Vec::new()));
    let writers = start_writers(&cluster, 3, stop.clone(), acked.clone());
    tokio::time::sleep(Duration::from_millis(1000)).await;
    // An RQ node down: u + r + 1 = 3 others still endorse every request.
    cluster.kill(RQ);
    progress(&cluster, "with RQ node 7 down").await;
    // A large value: proposed by digest, its bytes fetched by backups from RQ nodes.
    let c = cluster.client(1005);
    let big = "b".repeat(4096);
    put(&c, "big", &big).await.expect("a 4 KiB put with an RQ node down");
    tokio::time::sleep(Duration::from_millis(1000)).await;
    cluster.start(RQ);
    // The order primary down: a view change, which RQ nodes learn by STATUS.
    cluster.kill(0);
    progress(&cluster, "with order primary 0 down").await;
    cluster.start(0);
    // An execution node down.
    cluster.kill(ORDER);
    progress(&cluster, "with execution node 4 down").await;
    tokio::time::sleep(Duration::from_millis(1000)).await;
    *stop.lock().expect("lock") = true;
    for w in writers {
        w.await.expect("writer");
    }
    let acked = acked.lock().expect("lock").clone();
    eprintln!("{} writes acknowledged", acked.len());
    assert!(acked.len() > 100, "too little progress: {}", acked.len());
    let c = cluster.client(1007);
    for (k, v) in &acked {
        assert_eq!(get(&c, k).await.as_deref(), Some(v.as_str()), "acknowledged write {k} lost");
    }
    assert_eq!(get(&c, "big").await.as_deref(), Some(big.as_str()));
    // Backups fetched operation bytes (from RQ nodes: order nodes never hold a client's
    // request unless an RQ node sent it), and RQ nodes served them.
    let fetched: u64 = (1..ORDER).map(|i| metric(&cluster.metrics(i), "keel_operations_fetched_total")).sum();
    assert!(fetched > 0, "no backup fetched operation bytes");
    // An RQ node keeps nothing on disk.
    let files = std::fs::read_dir(cluster.path().join(format!("node-{}/data", RQ + 1)))
        .expect("data dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|f| !matches!(f.as_str(), "node.pid" | "node.log"))
        .collect::<Vec<_>>();
    assert!(files.is_empty(), "an RQ node wrote {files:?}");
}

/// RQ nodes never answer clients: a client whose first u + r + 1 include a dead RQ node
/// pays one retransmission, then sends to every RQ node for a while (rq_node.rs,
/// client.rs `RQ_ALL_OPS`), so the node being down costs a few operations, not each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_rq_node_down_costs_a_few_retransmissions_not_one_per_request() {
    let mut cluster = Cluster::init_stages_apart(1, 1);
    let c = cluster.client(1000);
    put(&c, "ready", "1").await.expect("cluster up");
    cluster.kill(RQ);
    let mut lat = Vec::new();
    for i in 0..200 {
        let started = Instant::now();
        put(&c, &format!("k{i}"), "v").await.expect("put acknowledged");
        lat.push(started.elapsed());
    }
    let slow = lat.iter().filter(|d| **d >= Duration::from_millis(400)).count();
    lat.sort();
    eprintln!("puts with RQ node 7 down: p50 {:?}, p90 {:?}, {slow} of 200 slow", lat[100], lat[180]);
    // The first, and probes after 64 and 128 more operations (3 in a quiet run); a
    // client that sent each request to its first u + r + 1 would have 200.
    assert!(slow <= 5, "{slow} of 200 puts waited for a retransmission");
    assert!(lat[180] < Duration::from_millis(100), "p90 {:?}", lat[180]);
}
