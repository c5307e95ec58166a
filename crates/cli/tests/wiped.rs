//! A node loses its disk while the cluster runs under load (issue #21, defect 4): its data
//! directory is deleted and the node restarted. It must rejoin without voting until it has
//! caught up past everything it may have voted for, and no acknowledged write may be lost,
//! even when another node is killed -9 while it rejoins. Real `keel node` processes on
//! loopback, TLS, fsync; every process is a child the test kills by handle.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod support;
use support::{check_all, put, start_writers, Cluster};

async fn wait_for_log(cluster: &Cluster, i: usize, needle: &str, limit: Duration) -> bool {
    let started = Instant::now();
    while started.elapsed() < limit {
        if cluster.log(i).contains(needle) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

async fn wiped_disk_under_load(u: u32, r: u32) {
    let mut cluster = Cluster::init(u, r);
    let n = cluster.n();
    let stop = Arc::new(Mutex::new(false));
    let acked = Arc::new(Mutex::new(Vec::new()));
    let writers = start_writers(&cluster, 3, stop.clone(), acked.clone());
    tokio::time::sleep(Duration::from_millis(1000)).await;
    // Node 1 loses its disk: killed, its data directory deleted, started again.
    cluster.kill(1);
    let data = cluster.path().join("node-1/data");
    std::fs::remove_dir_all(&data).expect("delete the data directory");
    // Without --rejoin the node refuses the directory (it could be a missing mount), and
    // leaves it as it found it: unprovisioned.
    let refused = std::process::Command::new(support::KEEL)
        .args(["node", "--config"])
        .arg(cluster.path().join("node-1/node.toml"))
        .output()
        .expect("keel node runs");
    assert!(!refused.status.success());
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(err.contains("was not provisioned by keel init") && err.contains("--rejoin"), "{err}");
    assert!(!data.join("FORMAT").exists(), "a refused start must not stamp the directory");
    cluster.start_with(1, &["--rejoin"]);
    assert!(
        wait_for_log(&cluster, 1, "rejoining", Duration::from_secs(10)).await,
        "node 1 did not start as a rejoining node"
    );
    // Another node dies while node 1 rejoins, and comes back.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let other = n - 1;
    cluster.kill(other);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    cluster.start(other);
    // Under load the cluster soon passes node 1's bounds: it votes again.
    assert!(
        wait_for_log(&cluster, 1, "rejoined", Duration::from_secs(90)).await,
        "node 1 never rejoined; its log:\n{}",
        cluster.log(1)
    );
    *stop.lock().expect("lock") = true;
    let mut ops = 0;
    for w in writers {
        ops += w.await.expect("writer");
    }
    let acked = acked.lock().expect("lock").clone();
    eprintln!("u={u} r={r}: {ops} writes attempted, {} acknowledged", acked.len());
    assert!(acked.len() > 30, "too little progress: {}", acked.len());
    // Node 0, never wiped, goes down: the rejoined node is needed for every quorum now.
    cluster.kill(0);
    let c = cluster.client(1006);
    put(&c, "after", "x").await.expect("progress with the rejoined node in the quorum");
    check_all(&cluster, &acked).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cft_a_node_whose_disk_is_wiped_rejoins_and_no_acknowledged_write_is_lost() {
    wiped_disk_under_load(1, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bft_a_node_whose_disk_is_wiped_rejoins_and_no_acknowledged_write_is_lost() {
    wiped_disk_under_load(1, 1).await;
}
