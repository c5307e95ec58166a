//! Keel embedded in one process: two BFT clusters of four nodes side by side, each with
//! a service written here, serving clients, stopping, and starting again from their data.

use keel_core::service::{ExecCtx, RestoreError, Service};
use keel_runtime::config::{free_ports, InitOptions};
use keel_runtime::embed::{load, provision, NodeBuilder, NodeEvent, NodeHandle, Provisioned};
use keel_runtime::node::NodeError;
use keel_runtime::storage::{FsyncPolicy, StorageError};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(20);

/// `set K V` stores and answers `ok`; `get K` answers the value or `none`. Counts ticks.
#[derive(Default)]
struct Registers {
    map: BTreeMap<String, String>,
    ticks: u64,
}

impl Service for Registers {
    fn execute(&mut self, request: &[u8], _ctx: &ExecCtx) -> Vec<u8> {
        let text = String::from_utf8_lossy(request);
        let words: Vec<&str> = text.split(' ').collect();
        match words[..] {
            ["set", k, v] => {
                self.map.insert(k.into(), v.into());
                b"ok".to_vec()
            }
            ["get", k] => self.map.get(k).map_or(b"none".to_vec(), |v| v.clone().into_bytes()),
            ["ticks"] => self.ticks.to_string().into_bytes(),
            _ => b"bad request".to_vec(),
        }
    }

    fn on_tick(&mut self, _ctx: &ExecCtx) {
        self.ticks += 1;
    }

    fn snapshot(&self) -> Vec<u8> {
        postcard::to_allocvec(&(&self.map, self.ticks)).unwrap_or_default()
    }

    fn restore(&mut self, snapshot: &[u8]) -> Result<(), RestoreError> {
        (self.map, self.ticks) = postcard::from_bytes(snapshot).map_err(|e| RestoreError(e.to_string()))?;
        Ok(())
    }
}

/// A (1, 1) cluster of four nodes and five client identities (one per node, one spare).
fn provisioned(dir: &Path) -> Provisioned {
    let n = 4;
    let options = InitOptions {
        service: "registers".into(),
        u: 1,
        r: 1,
        host: "127.0.0.1".into(),
        base_port: free_ports(2 * n).expect("free ports"),
        clients: n + 1,
        fsync: FsyncPolicy::Batch,
        auth: None,
        checkpoint_interval: None,
        tick_ms: Some(100),
        request_digests: None,
        separated: false,
        rq_separated: false,
    };
    provision(dir, &options).expect("provision")
}

async fn start(cluster: &Provisioned) -> Vec<NodeHandle> {
    let mut nodes = Vec::new();
    for (i, setup) in cluster.nodes.iter().enumerate() {
        let node = NodeBuilder::new(setup.clone(), Registers::default)
            .client(cluster.clients[i].clone())
            .start()
            .await
            .expect("node starts");
        nodes.push(node);
    }
    nodes
}

async fn invoke(node: &NodeHandle, op: &str) -> String {
    let client = node.client().expect("the node's client");
    let reply = client.invoke(op.as_bytes().to_vec(), TIMEOUT).await.expect("an answer");
    String::from_utf8(reply).expect("text")
}

async fn shutdown(nodes: Vec<NodeHandle>) {
    for node in nodes {
        node.shutdown().await.expect("a clean shutdown");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_clusters_run_in_one_process_and_restart_from_their_data() {
    let (dir_a, dir_b) = (tempfile::tempdir().expect("tempdir"), tempfile::tempdir().expect("tempdir"));
    let (a, b) = (provisioned(dir_a.path()), provisioned(dir_b.path()));
    let nodes_a = start(&a).await;
    let nodes_b = start(&b).await;
    let mut events = nodes_a[1].events();

    // The same key in each: the clusters share a process and nothing else.
    assert_eq!(invoke(&nodes_a[0], "set x from-a").await, "ok");
    assert_eq!(invoke(&nodes_b[2], "set x from-b").await, "ok");
    assert_eq!(invoke(&nodes_a[3], "get x").await, "from-a");
    assert_eq!(invoke(&nodes_b[1], "get x").await, "from-b");
    assert!(nodes_a.iter().all(|n| n.status().executed >= 2), "every node executed both");

    // Ticks every 100 ms while idle: node 1 runs them and says so.
    let ticked = tokio::time::timeout(TIMEOUT, async {
        loop {
            if let Ok(NodeEvent::Ticked { .. }) = events.recv().await {
                return;
            }
        }
    })
    .await;
    assert!(ticked.is_ok(), "a tick within 20 s");
    let ticks: u64 = invoke(&nodes_a[2], "ticks").await.parse().expect("a count");
    assert!(ticks >= 1);

    // Cluster A stops cleanly and starts again, in this process, from its directories
    // (its ports and files released): the state is back, and it serves.
    let executed = nodes_a[0].status().executed;
    shutdown(nodes_a).await;
    assert_eq!(invoke(&nodes_b[0], "get x").await, "from-b", "B keeps serving");
    let again = load(dir_a.path()).expect("load");
    let nodes_a = start(&again).await;
    assert!(nodes_a[0].status().executed >= executed, "recovered to where it stopped");
    assert_eq!(invoke(&nodes_a[1], "get x").await, "from-a");
    assert_eq!(invoke(&nodes_a[2], "set y after-restart").await, "ok");
    assert_eq!(invoke(&nodes_a[0], "get y").await, "after-restart");
    shutdown(nodes_a).await;
    shutdown(nodes_b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_started_twice_is_refused_without_touching_the_first_and_can_start_again_once_stopped() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cluster = provisioned(dir.path());
    let first = NodeBuilder::new(cluster.nodes[0].clone(), Registers::default).start().await.expect("starts");
    // The same node again (its data directory and port): refused before it reads a byte.
    let twice = NodeBuilder::new(cluster.nodes[0].clone(), Registers::default).start().await;
    match twice {
        Err(NodeError::Storage(StorageError::Locked { .. })) => {}
        Err(e) => panic!("expected the data directory to be locked, got: {e}"),
        Ok(_) => panic!("a second node on one data directory started"),
    }
    first.shutdown().await.expect("a clean shutdown");
    // Released (directory and port): it starts again in this process.
    let again = NodeBuilder::new(cluster.nodes[0].clone(), Registers::default).start().await.expect("starts again");
    again.shutdown().await.expect("a clean shutdown");
}
