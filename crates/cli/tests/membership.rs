//! Membership changes across real processes (issue #5 item 2; with stages apart, #4):
//! `keel admin add-node` and `remove-node` against a cluster under load, with the primary crashed while a change
//! is being ordered. No acknowledged write may be lost, every live node must end in the
//! same epoch with the same members, and clients must keep working.

mod support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::{get, put, Cluster};

/// Waits until every node in `live` reports epoch `epoch` with `members`, and they agree
/// on the last executed instance within a few (they are under load).
async fn wait_for_epoch(cluster: &Cluster, live: &[usize], epoch: u64, members: &[u32]) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let statuses: Vec<_> = live.iter().map(|&i| cluster.status(i)).collect();
        let agreed = statuses.iter().all(|s| s.as_ref().is_some_and(|s| s.epoch == epoch && s.members == members));
        if agreed {
            let executed: Vec<u64> = statuses.iter().flatten().map(|s| s.executed).collect();
            let (lo, hi) = (executed.iter().min().copied().unwrap_or(0), executed.iter().max().copied().unwrap_or(0));
            if hi - lo <= 64 {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "nodes {live:?} did not reach epoch {epoch} with {members:?}: {:?}",
            statuses.iter().map(|s| s.as_ref().map(|s| (s.epoch, s.members.clone(), s.executed))).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until the RQ nodes `rq` (which execute nothing) endorse for epoch `epoch` with
/// `members`.
async fn wait_for_rq_nodes(cluster: &Cluster, rq: &[usize], epoch: u64, members: &[u32]) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let statuses: Vec<_> = rq.iter().map(|&i| cluster.status(i).map(|s| (s.epoch, s.members))).collect();
        if statuses.iter().all(|s| s.as_ref().is_some_and(|(e, m)| *e == epoch && m == members)) {
            return;
        }
        assert!(Instant::now() < deadline, "RQ nodes {rq:?} did not follow epoch {epoch}: {statuses:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `log` without the terminal colour sequences tracing writes (`ESC [ ... m`).
fn plain(log: &str) -> String {
    let mut out = String::with_capacity(log.len());
    let mut chars = log.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            chars.by_ref().find(|&c| c == 'm');
        } else {
            out.push(c);
        }
    }
    out
}

/// Writers putting keys under load, each acknowledged write recorded with the phase
/// of the test it was acknowledged in.
struct Writers {
    stop: Arc<AtomicBool>,
    acked: Arc<Mutex<Acked>>,
    phase: Arc<Mutex<&'static str>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Writers {
    fn start(cluster: &Cluster, count: u64) -> Writers {
        let (stop, acked, phase) = (Arc::new(AtomicBool::new(false)), Arc::default(), Arc::new(Mutex::new("before")));
        let tasks = (0..count)
            .map(|w| {
                let client = cluster.client(1000 + w);
                let (stop, acked, phase): (Arc<AtomicBool>, Arc<Mutex<Acked>>, _) =
                    (Arc::clone(&stop), Arc::clone(&acked), Arc::clone(&phase));
                tokio::spawn(async move {
                    let mut i = 0;
                    while !stop.load(Ordering::Relaxed) {
                        i += 1;
                        let (k, v) = (format!("w{w}/{i}"), format!("v{i}"));
                        // A write that fails (timeout) may or may not have happened: not counted.
                        if put(&client, &k, &v).await.is_ok() {
                            let p = *phase.lock().expect("phase");
                            acked.lock().expect("acked").push((k, v, p));
                        }
                    }
                })
            })
            .collect();
        Writers { stop, acked, phase, tasks }
    }

    fn enter(&self, name: &'static str) {
        *self.phase.lock().expect("phase") = name;
    }

    /// Lets the writers run in phase `name` until more than [`PHASE_WRITES`] of their
    /// writes were acknowledged in it, for at least a second. Clients keep working if that
    /// happens within [`PHASE_TIMEOUT`]: progress, not a rate (an epoch that opens with a
    /// view change, for one, pauses writes for a retransmission period or two).
    async fn run(&self, name: &'static str) {
        self.enter(name);
        let started = Instant::now();
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let count = self.acked.lock().expect("acked").iter().filter(|(_, _, p)| *p == name).count();
            if count > PHASE_WRITES && started.elapsed() >= Duration::from_secs(1) {
                println!("phase {name:?}: {count} writes acknowledged in {:?}", started.elapsed());
                return;
            }
            assert!(
                started.elapsed() < PHASE_TIMEOUT,
                "only {count} writes acknowledged in phase {name:?} in {PHASE_TIMEOUT:?}: clients stopped working"
            );
        }
    }

    /// Stops the writers; every write acknowledged.
    async fn finish(self) -> Acked {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            t.await.expect("writer");
        }
        let acked = self.acked.lock().expect("acked").clone();
        let per_phase: Vec<(&str, usize)> = ["before", "adding", "epoch 1", "removing", "epoch 2"]
            .into_iter()
            .map(|p| (p, acked.iter().filter(|(_, _, q)| *q == p).count()))
            .collect();
        println!("writes acknowledged per phase: {per_phase:?}");
        acked
    }
}

const PHASE_WRITES: usize = 20;
const PHASE_TIMEOUT: Duration = Duration::from_secs(20);

/// (key, value, phase it was acknowledged in)
type Acked = Vec<(String, String, &'static str)>;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_are_added_and_removed_under_load_and_no_acknowledged_write_is_lost() {
    let mut cluster = Cluster::init(1, 1);
    let load = Writers::start(&cluster, 4);
    load.run("before").await;

    // Add node 4 while the primary (node 0) crashes during the change.
    load.enter("adding");
    let dir = cluster.path().to_path_buf();
    let adder = tokio::task::spawn_blocking(move || {
        std::process::Command::new(support::KEEL)
            .args(["admin", "add-node", "--dir"])
            .arg(&dir)
            .output()
            .expect("keel admin runs")
    });
    tokio::time::sleep(Duration::from_millis(30)).await;
    cluster.kill(0);
    let out = adder.await.expect("joined");
    assert!(out.status.success(), "add-node failed: {}", String::from_utf8_lossy(&out.stderr));
    let said = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(said.contains("node 4 added: epoch 1 with nodes [0, 1, 2, 3, 4]"), "{said}");
    cluster.add_slot(4);
    cluster.start(4);
    cluster.start(0);
    wait_for_epoch(&cluster, &[0, 1, 2, 3, 4], 1, &[0, 1, 2, 3, 4]).await;
    assert!(cluster.status(4).is_some_and(|s| s.executed > 0), "the new node executes");
    load.run("epoch 1").await;

    // Remove node 1 under load: it stops by itself.
    load.enter("removing");
    let said = cluster.admin(&["remove-node", "1"]).expect("remove-node");
    assert!(said.contains("node 1 removed: epoch 2 with nodes [0, 2, 3, 4]"), "{said}");
    let deadline = Instant::now() + Duration::from_secs(20);
    let exit = loop {
        if let Some(status) = cluster.exited(1) {
            break status;
        }
        assert!(Instant::now() < deadline, "node 1 did not stop after its removal");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(exit.success(), "a removed node stops cleanly: {exit:?}");
    assert!(cluster.log(1).contains("removed from the cluster"));
    wait_for_epoch(&cluster, &[0, 2, 3, 4], 2, &[0, 2, 3, 4]).await;
    // Issue #25: `keel status` reports the removed node and does not fail for it, and
    // `keel admin members` shows the membership the nodes are in.
    let status = std::process::Command::new(support::KEEL).arg("status").env("KEEL_DIR", cluster.path()).output();
    let status = status.expect("keel status runs");
    let table = String::from_utf8_lossy(&status.stdout).to_string();
    assert!(status.status.success(), "status fails after a removal:\n{table}");
    assert!(
        table.lines().any(|l| l.starts_with("1\t") && l.contains("removed (was removed from the cluster in epoch 2)")),
        "{table}"
    );
    let members = cluster.admin(&["members"]).expect("admin members");
    assert!(members.starts_with("epoch 2: members 0 2 3 4 (quorum "), "{members}");
    assert!(members.lines().any(|l| l.starts_with("1\tno\t") && l.contains("removed")), "{members}");
    // Clients keep the certificates they followed beside the cluster file: a client
    // started now begins in epoch 2 (its first request goes to the members, not to the
    // removed node), one without the file in epoch 0.
    assert!(cluster.path().join("epochs").exists(), "no epoch certificates kept");
    assert_eq!(cluster.client(1005).epoch(), 2);
    std::fs::rename(cluster.path().join("epochs"), cluster.path().join("epochs.aside")).expect("moved");
    assert_eq!(cluster.client(1006).epoch(), 0);
    std::fs::write(cluster.path().join("epochs"), b"garbage").expect("written");
    assert_eq!(cluster.client(1006).epoch(), 0, "a file that does not decode is ignored");
    std::fs::rename(cluster.path().join("epochs.aside"), cluster.path().join("epochs")).expect("moved back");
    // An address a member uses is refused before anything is written or asked.
    let taken = cluster.path().join("node-0/node.toml");
    let taken = keel_runtime::config::NodeFile::load(&taken).expect("node 0's file").listen.to_string();
    let refused = cluster.admin(&["add-node", "--listen", &taken]).expect_err("node 0's address is refused");
    assert!(refused.contains(&format!("--listen {taken} is already node 0's listen address")), "{refused}");
    assert!(!cluster.path().join("node-5").exists(), "a refused add-node leaves no directory");

    load.run("epoch 2").await;
    let acked = load.finish().await;
    // Every acknowledged write reads back, through a client that knows only epoch 0.
    let reader = cluster.client(1004);
    for (k, v, _) in &acked {
        assert_eq!(get(&reader, k).await.as_deref(), Some(v.as_str()), "acknowledged write {k} lost");
    }
    println!("{} writes acknowledged across two membership changes, all read back", acked.len());

    // A backup by an administrator whose files know only epoch 0 (the followed
    // certificates moved aside): it learns epochs 1 and 2 from the nodes, checks the
    // checkpoint against epoch 2's members, and restores into a new cluster.
    std::fs::rename(cluster.path().join("epochs"), cluster.path().join("epochs.aside")).expect("moved");
    let file = cluster.path().join("after-two-changes.keel");
    let said = cluster.admin(&["backup", "--out", file.to_str().expect("utf-8")]).expect("backup");
    assert!(said.contains("(epoch 2,"), "{said}");
    cluster.kill_all();
    let restored = Cluster::init_args(1, 1, &["--restore", file.to_str().expect("utf-8")]);
    let reader = restored.client(1004);
    for (k, v, _) in &acked {
        assert_eq!(get(&reader, k).await.as_deref(), Some(v.as_str()), "write {k} not in the restored cluster");
    }
}

/// Membership changes with every stage apart (`keel init --layout separated`, u = r = 1:
/// order nodes 0..4, execution nodes 4..7, RQ nodes 7..11). Order nodes are added and
/// removed; execution nodes follow by executing the change, RQ nodes by asking the order
/// nodes for epoch certificates. An execution node killed -9 during the removal restarts
/// from its snapshot and follows; an RQ node restarted after the changes keeps its epoch.
/// No acknowledged write may be lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_stages_apart_order_nodes_are_added_and_removed_and_the_stages_follow() {
    const EXEC: [usize; 3] = [4, 5, 6];
    const RQ: [usize; 4] = [7, 8, 9, 10];
    let mut cluster = Cluster::init_stages_apart(1, 1);
    let load = Writers::start(&cluster, 3);
    load.run("before").await;

    // Add an order node: it gets the first id above every stage node's.
    load.enter("adding");
    let said = cluster.admin(&["add-node"]).expect("add-node");
    assert!(said.contains("node 11 added: epoch 1 with nodes [0, 1, 2, 3, 11]"), "{said}");
    cluster.add_slot(11);
    cluster.start(11);
    let executing: Vec<usize> = [0, 1, 2, 3, 11].into_iter().chain(EXEC).collect();
    wait_for_epoch(&cluster, &executing, 1, &[0, 1, 2, 3, 11]).await;
    wait_for_rq_nodes(&cluster, &RQ, 1, &[0, 1, 2, 3, 11]).await;
    load.run("epoch 1").await;

    // Remove node 1, which moves the indices of nodes 2, 3 and 11 (RQ nodes' endorsements
    // name order nodes by index), with execution node 4 killed -9 meanwhile.
    load.enter("removing");
    cluster.kill(4);
    let said = cluster.admin(&["remove-node", "1"]).expect("remove-node");
    assert!(said.contains("node 1 removed: epoch 2 with nodes [0, 2, 3, 11]"), "{said}");
    let deadline = Instant::now() + Duration::from_secs(20);
    while cluster.exited(1).is_none() {
        assert!(Instant::now() < deadline, "node 1 did not stop after its removal");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    cluster.start(4);
    let executing: Vec<usize> = [0, 2, 3, 11].into_iter().chain(EXEC).collect();
    wait_for_epoch(&cluster, &executing, 2, &[0, 2, 3, 11]).await;
    wait_for_rq_nodes(&cluster, &RQ, 2, &[0, 2, 3, 11]).await;
    // The execution node restarted from a snapshot (its state, and the membership in it).
    let restarted = plain(&cluster.log(4)).lines().rfind(|l| l.contains("execution node started")).map(String::from);
    let from_snapshot = restarted.as_deref().and_then(|l| l.split("executed=").nth(1)).map(|v| v.trim() != "0");
    assert_eq!(from_snapshot, Some(true), "{restarted:?}");
    // An RQ node keeps the certificates it followed, and restarts in their epoch.
    assert!(cluster.path().join("node-8/data/epochs").exists(), "RQ node 8 kept no epoch certificates");
    cluster.kill(8);
    cluster.start(8);
    wait_for_rq_nodes(&cluster, &[8], 2, &[0, 2, 3, 11]).await;
    let started = plain(&cluster.log(8)).lines().rfind(|l| l.contains("RQ node started")).map(String::from);
    assert!(started.as_deref().is_some_and(|l| l.contains("epoch=2")), "{started:?}");
    load.run("epoch 2").await;

    let acked = load.finish().await;
    let rq_log = cluster.log(7);
    assert!(rq_log.contains("RQ node follows a new membership epoch"), "RQ node 7 never followed");
    let reader = cluster.client(1004);
    for (k, v, _) in &acked {
        assert_eq!(get(&reader, k).await.as_deref(), Some(v.as_str()), "acknowledged write {k} lost");
    }
    println!("{} writes acknowledged across two membership changes with stages apart, all read back", acked.len());
}
