//! Keel embedded in one process: two BFT clusters of four nodes side by side, each with
//! a service written here, serving clients, stopping, and starting again from their data.

use keel_core::ids::NodeId;
use keel_core::message::Message;
use keel_core::service::{ExecCtx, RestoreError, Service};
use keel_runtime::embed::{load, provision, NodeBuilder, NodeEvent, NodeHandle, Provisioned};
use keel_runtime::node::NodeError;
use keel_runtime::provision::InitOptions;
use keel_runtime::storage::StorageError;
use keel_runtime::tls::Credentials;
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
    let options = InitOptions { tick_ms: Some(100), ..InitOptions::local("registers", 1, 1).expect("options") };
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
    // The library's latency histogram saw node 0's operation, and none of node 1's.
    let seen = nodes_a[0].client().expect("client").metrics();
    assert_eq!(seen.completed("ordered"), 1, "{}", seen.render());
    assert!(
        seen.render().contains("keel_client_invoke_seconds_bucket{le=\"0.0002\",kind=\"ordered\"}"),
        "{}",
        seen.render()
    );
    assert_eq!(nodes_a[1].client().expect("client").metrics().completed("ordered"), 0);

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

/// The value of the sample `name` (with its labels) in Prometheus text, 0 if absent.
fn metric(text: &str, name: &str) -> u64 {
    text.lines().find(|l| l.starts_with(name)).and_then(|l| l.rsplit(' ').next()?.parse().ok()).unwrap_or(0)
}

/// Sends one node-plane message to `to` over a TLS connection of its own, as the node
/// whose certificate `creds` holds (issued by the cluster's CA, `ca_pem`).
async fn send_plane_as(ca_pem: &str, creds: &Credentials, to: std::net::SocketAddr, payload: &[u8]) {
    use keel_runtime::tls::{client_config, PeerId};
    use tokio::io::AsyncWriteExt;
    let connector = tokio_rustls::TlsConnector::from(client_config(ca_pem, creds).expect("tls"));
    let tcp = tokio::net::TcpStream::connect(to).await.expect("connect");
    let mut tls = connector.connect(PeerId::Node(NodeId(1)).server_name(), tcp).await.expect("handshake");
    let frame = keel_runtime::transport::node_frame(0, &Message::Plane { payload: payload.to_vec() });
    tls.write_all(&(frame.len() as u32).to_be_bytes()).await.expect("write");
    tls.write_all(&frame).await.expect("write");
    tls.flush().await.expect("flush");
    // Held open until the node read it.
    tokio::time::sleep(Duration::from_millis(300)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_plane_messages_reach_the_service_only_from_trusted_peers_and_past_its_check() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cluster = provisioned(dir.path());
    // What each node's service took off its plane.
    let (got_tx, mut got) = tokio::sync::mpsc::unbounded_channel::<(u32, u32, Vec<u8>)>();
    let mut nodes = Vec::new();
    let mut planes = Vec::new();
    for setup in &cluster.nodes {
        let got_tx = got_tx.clone();
        let (plane_tx, plane_rx) = tokio::sync::oneshot::channel();
        let node = NodeBuilder::new(setup.clone(), Registers::default)
            // The service's check: it believes only what is signed "ok:".
            .node_plane(|_from, payload| payload.starts_with(b"ok:"))
            .front_end(move |fe| async move {
                let mut plane = fe.take_plane().expect("the plane");
                let _ = plane_tx.send(plane.sender());
                while let Some((from, payload)) = plane.recv().await {
                    let _ = got_tx.send((plane.node().0, from.0, payload));
                }
            })
            .start()
            .await
            .expect("node starts");
        planes.push(plane_rx.await.expect("a sender"));
        nodes.push(node);
    }
    planes[0].send(NodeId(1), b"ok:hello".to_vec()).expect("queued");
    planes[0].send(NodeId(1), b"forged".to_vec()).expect("queued");
    planes[2].send(NodeId(1), b"ok:from two".to_vec()).expect("queued");
    let mut at_1 = Vec::new();
    while at_1.len() < 2 {
        let (node, from, payload) = tokio::time::timeout(TIMEOUT, got.recv()).await.expect("in time").expect("open");
        assert_eq!(node, 1);
        at_1.push((from, payload));
    }
    at_1.sort();
    assert_eq!(at_1, vec![(0, b"ok:hello".to_vec()), (2, b"ok:from two".to_vec())]);

    // A node the CA certified but that is no member of the cluster's epoch.
    let stranger_dir = keel_runtime::provision::new_node_dir(
        dir.path(),
        NodeId(9),
        "127.0.0.1:1".parse().expect("addr"),
        "127.0.0.1:2".parse().expect("addr"),
    )
    .expect("provisioned")
    .0;
    let read = |p: std::path::PathBuf| std::fs::read_to_string(p).expect("readable");
    let creds =
        Credentials { cert_pem: read(stranger_dir.join("node.pem")), key_pem: read(stranger_dir.join("node.key")) };
    send_plane_as(&cluster.nodes[1].ca_pem, &creds, cluster.nodes[1].listen, b"ok:let me in").await;
    let m = nodes[1].metrics();
    assert_eq!(metric(&m, "keel_plane_rejected_total{kind=\"untrusted\"}"), 1, "{m}");
    assert_eq!(metric(&m, "keel_plane_rejected_total{kind=\"refused\"}"), 1, "{m}");
    assert_eq!(metric(&m, "keel_plane_delivered_total"), 2, "{m}");
    assert!(got.try_recv().is_err(), "nothing else reached a service");
    for node in nodes {
        node.shutdown().await.expect("a clean shutdown");
    }
}

/// A service that does not read its plane cannot be made to buffer without bound: one
/// peer's messages queue up to its share (64 MiB), the rest are dropped and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_cannot_fill_a_slow_services_plane_beyond_its_byte_share() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cluster = provisioned(dir.path());
    let mut nodes = Vec::new();
    let mut planes = Vec::new();
    for setup in &cluster.nodes {
        let (plane_tx, plane_rx) = tokio::sync::oneshot::channel();
        let node = NodeBuilder::new(setup.clone(), Registers::default)
            .node_plane(|_from, _payload| true)
            .front_end(move |fe| async move {
                // Holds its plane and never reads it.
                let plane = fe.take_plane().expect("the plane");
                let _ = plane_tx.send(plane.sender());
                std::future::pending::<()>().await;
                drop(plane);
            })
            .start()
            .await
            .expect("node starts");
        planes.push(plane_rx.await.expect("a sender"));
        nodes.push(node);
    }
    let max = keel_core::codec::PLANE_BYTES_MAX;
    let share = keel_runtime::embed::PLANE_PEER_BYTES / max;
    for _ in 0..share + 4 {
        // The sender's own queue may refuse when full; the test waits for it to drain.
        while planes[0].send(NodeId(1), vec![7; max]).is_err() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let started = std::time::Instant::now();
    loop {
        let m = nodes[1].metrics();
        let (delivered, full) =
            (metric(&m, "keel_plane_delivered_total"), metric(&m, "keel_plane_rejected_total{kind=\"full\"}"));
        if delivered + full == (share + 4) as u64 {
            assert_eq!((delivered, full), (share as u64, 4), "{m}");
            break;
        }
        assert!(started.elapsed() < TIMEOUT, "not all messages arrived: {delivered} delivered, {full} full");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for node in nodes {
        node.shutdown().await.expect("a clean shutdown");
    }
}
