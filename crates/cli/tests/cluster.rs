//! Multi-process tests: real `keel node` processes on loopback, TLS, files with fsync,
//! kill -9. Clients use the public client library only.
//!
//! Every node a test starts is a child it holds and kills by handle at the end (Drop),
//! never by name.

use keel_core::ids::NodeId;
use keel_core::ids::{ClientId, View};
use keel_core::message::ReadConsistency;
use keel_kv::{KvRequest, KvResponse};
use keel_runtime::client::KeelClient;
use keel_runtime::config::ClientFile;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;

mod support;
use support::{
    check_all, get, metric, put, read_only, reads_never_stale_under_writes, start_writers, Cluster, OP_TIMEOUT,
};

async fn progress_during(cluster: &Cluster, what: &str) {
    let c = cluster.client(1006);
    let started = Instant::now();
    put(&c, &format!("probe-{what}"), "x").await.unwrap_or_else(|e| panic!("no progress {what}: {e}"));
    eprintln!("progress {what}: {:?}", started.elapsed());
}

/// kill -9 a backup, bring it back, kill -9 the primary, bring it back; clients write
/// throughout. Then stop a node that was never killed, so the restarted ones are needed
/// for a quorum (they must have caught up).
async fn kill_backup_then_primary(u: u32, r: u32) {
    let mut cluster = Cluster::init(u, r);
    progress_during(&cluster, "at start").await;
    let stop = Arc::new(Mutex::new(false));
    let acked = Arc::new(Mutex::new(Vec::new()));
    let writers = start_writers(&cluster, 3, stop.clone(), acked.clone());
    let n = cluster.n();
    tokio::time::sleep(Duration::from_millis(800)).await;
    cluster.kill(1);
    progress_during(&cluster, "with backup 1 down").await;
    cluster.start(1);
    tokio::time::sleep(Duration::from_millis(800)).await;
    cluster.kill(0);
    progress_during(&cluster, "with primary 0 down").await;
    cluster.start(0);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    *stop.lock().expect("lock") = true;
    let mut ops = 0;
    for w in writers {
        ops += w.await.expect("writer");
    }
    let acked = acked.lock().expect("lock").clone();
    eprintln!("u={u} r={r}: {ops} writes attempted, {} acknowledged", acked.len());
    assert!(acked.len() > 30, "too little progress: {}", acked.len());
    cluster.kill(n - 1);
    progress_during(&cluster, "with only restarted nodes and the rest").await;
    check_all(&cluster, &acked).await;
    assert!(cluster.log(0).contains("node started"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bft_four_nodes_survive_kill_9_of_backup_and_primary() {
    kill_backup_then_primary(1, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cft_three_nodes_survive_kill_9_of_backup_and_primary() {
    kill_backup_then_primary(1, 0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn total_outage_loses_no_acknowledged_write() {
    let mut cluster = Cluster::init(1, 1);
    let stop = Arc::new(Mutex::new(false));
    let acked = Arc::new(Mutex::new(Vec::new()));
    let writers = start_writers(&cluster, 3, stop.clone(), acked.clone());
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // Every node at once, while writes are in flight.
    cluster.kill_all();
    *stop.lock().expect("lock") = true;
    cluster.start_all();
    for w in writers {
        w.await.expect("writer");
    }
    let acked = acked.lock().expect("lock").clone();
    assert!(acked.len() > 10, "too little progress: {}", acked.len());
    check_all(&cluster, &acked).await;
    progress_during(&cluster, "after the outage").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bft_total_outage_under_heavy_load_resumes_with_small_view_changes() {
    outage_under_heavy_load(1, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cft_total_outage_under_heavy_load_resumes_with_small_view_changes() {
    outage_under_heavy_load(1, 0).await;
}

/// 64 sessions of 4 KiB puts fill the log above the stable checkpoint with tens of MiB.
/// When view changes carried certificate bodies, the view change that follows a full
/// restart exceeded the 16 MiB frame limit, was dropped, and never completed (this test
/// failed with "no progress after the outage").
async fn outage_under_heavy_load(u: u32, r: u32) {
    let mut cluster = Cluster::init(u, r);
    let stop = Arc::new(Mutex::new(false));
    let acked = Arc::new(Mutex::new(Vec::new()));
    let writers = start_writers(&cluster, 2, stop.clone(), acked.clone());
    let setup = ClientFile::load(&cluster.path().join("client-1003/client.toml")).expect("client file");
    let heavy = KeelClient::connect_sessions(setup, 64).expect("connects");
    let big = "x".repeat(4096);
    let loaders: Vec<_> = (0..64)
        .map(|t| {
            let (c, stop, big) = (heavy.clone(), stop.clone(), big.clone());
            tokio::spawn(async move {
                let mut n = 0u64;
                while !*stop.lock().expect("lock") {
                    // Unacknowledged puts are fine here: this load only fills the log.
                    let _ = put(&c, &format!("heavy{t}-{}", n % 4), &big).await;
                    n += 1;
                }
                n
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(4000)).await;
    cluster.kill_all();
    *stop.lock().expect("lock") = true;
    cluster.start_all();
    let mut loaded = 0;
    for l in loaders {
        loaded += l.await.expect("loader");
    }
    for w in writers {
        w.await.expect("writer");
    }
    let acked = acked.lock().expect("lock").clone();
    eprintln!("{loaded} heavy puts attempted before the outage; {} tracked writes acknowledged", acked.len());
    assert!(loaded > 1000, "too little load to fill the log: {loaded}");
    progress_during(&cluster, "after the outage under load").await;
    check_all(&cluster, &acked).await;
    for i in 0..cluster.n() {
        let metrics = cluster.metrics(i);
        assert_eq!(metric(&metrics, "keel_oversized_frames_total"), 0, "node {i} dropped an oversized frame");
        // The view change completed everywhere: every node is past view 0, whether it
        // started the change itself or, restarting later, adopted the new view (a node
        // that did the latter counts no view change of its own; CI once saw that).
        let view = cluster.status(i).map(|s| s.view);
        assert!(
            view.is_some_and(|v| v >= View(1)),
            "node {i} is in view {view:?}, not past the outage's view:\n{metrics}"
        );
    }
    let started: u64 = (0..cluster.n()).map(|i| metric(&cluster.metrics(i), "keel_view_changes_total")).sum();
    assert!(started >= 1, "no node started a view change after the outage");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_rejected_and_the_node_keeps_serving() {
    let cluster = Cluster::init(1, 1);
    let addr = {
        let text = std::fs::read_to_string(cluster.path().join("cluster.toml")).expect("cluster file");
        let line = text.lines().find(|l| l.starts_with("addr")).expect("an addr").to_string();
        line.split('"').nth(1).expect("quoted").to_string()
    };
    progress_during(&cluster, "before").await;

    // Random bytes instead of a TLS handshake.
    let mut junk = tokio::net::TcpStream::connect(&addr).await.expect("tcp");
    let mut x: u64 = 0x9e3779b97f4a7c15;
    let bytes: Vec<u8> = (0..4096)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let _ = junk.write_all(&bytes).await;

    // Slowloris: connections that never finish a handshake.
    let mut idle = Vec::new();
    for _ in 0..20 {
        idle.push(tokio::net::TcpStream::connect(&addr).await.expect("tcp"));
    }

    // A client of another cluster (certificate from an unknown CA).
    let other = Cluster::init(1, 0);
    let mut setup = ClientFile::load(&other.path().join("client-1000/client.toml")).expect("client file");
    setup.membership =
        ClientFile::load(&cluster.path().join("client-1000/client.toml")).expect("client file").membership;
    let stranger = KeelClient::connect(setup).expect("connect");
    let refused = stranger.invoke(KvRequest::Get { key: b"a".to_vec() }.encode(), Duration::from_secs(2)).await;
    assert!(refused.is_err(), "a client with an unknown CA must get nothing");

    // A real client sending a request with a bad MAC, then an oversized frame.
    let setup = ClientFile::load(&cluster.path().join("client-1001/client.toml")).expect("client file");
    let connector = tokio_rustls::TlsConnector::from(
        keel_runtime::tls::client_config(&setup.ca_pem, &setup.credentials).expect("tls"),
    );
    let tcp = tokio::net::TcpStream::connect(&addr).await.expect("tcp");
    let mut tls =
        connector.connect(keel_runtime::tls::PeerId::Node(NodeId(0)).server_name(), tcp).await.expect("handshake");
    let forged = keel_core::message::Message::Request(keel_core::message::Request {
        client: ClientId(1001),
        seq: 1,
        op: KvRequest::Put { key: b"forged".to_vec(), value: b"x".to_vec() }.encode().into(),
        auth: vec![[0u8; 16]; 4],
        endorsements: Vec::new(),
        sig: None,
    });
    tls.write_all(&framed(&forged)).await.expect("write");
    tls.write_all(&u32::MAX.to_be_bytes()).await.expect("write");
    tls.flush().await.expect("flush");

    progress_during(&cluster, "after bad input").await;
    let c = cluster.client(1002);
    assert_eq!(get(&c, "forged").await, None, "a request with a bad MAC must not execute");
    drop(idle);

    // Each rejection is counted on node 0. Nothing orders node 0's handling of the raw
    // connection before this point (the probes above do not use it), so poll.
    let counted = |m: &str| {
        metric(m, "keel_rejected_connections_total") >= 2
            && metric(m, "keel_rejected_total{kind=\"request\"}") >= 1
            && metric(m, "keel_oversized_frames_total") >= 1
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut metrics = cluster.metrics(0);
    while !counted(&metrics) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
        metrics = cluster.metrics(0);
    }
    assert!(metric(&metrics, "keel_rejected_connections_total") >= 2, "junk + unknown CA (+ slowloris):\n{metrics}");
    assert!(metric(&metrics, "keel_rejected_total{kind=\"request\"}") >= 1, "bad MAC counted:\n{metrics}");
    assert!(metric(&metrics, "keel_oversized_frames_total") >= 1, "oversized frame counted:\n{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_identity_keeps_many_operations_in_flight_over_sessions() {
    // The public client API: one identity, 32 sessions over one connection per node,
    // 32 tasks invoking concurrently on clones of the handle; every result is the right
    // one and every acknowledged write reads back. Nodes 0 and 1 check their peers' vote
    // signatures on a verify stage (2 and 1 threads), nodes 2 and 3 on the protocol task.
    let cluster = Cluster::init_with(1, 1, |i| match i {
        0 => Some("verify_threads = 2"),
        1 => Some("verify_threads = 1"),
        _ => None,
    });
    let setup = ClientFile::load(&cluster.path().join("client-1003/client.toml")).expect("client file");
    let client = KeelClient::connect_sessions(setup, 32).expect("connects");
    let started = Instant::now();
    let tasks: Vec<_> = (0..32)
        .map(|t| {
            let c = client.clone();
            tokio::spawn(async move {
                for n in 0..20 {
                    put(&c, &format!("s{t}-{n}"), &format!("v{t}-{n}")).await.expect("put acknowledged");
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("task");
    }
    eprintln!("640 puts over 32 sessions in {:?}", started.elapsed());
    let reader = cluster.client(1004);
    for t in 0..32 {
        for n in [0, 19] {
            assert_eq!(get(&reader, &format!("s{t}-{n}")).await.as_deref(), Some(format!("v{t}-{n}").as_str()));
        }
    }
    // The stage did the checking on the nodes that have one, and none elsewhere.
    let verified = |i: usize| metric(&cluster.metrics(i), "keel_stage_verified_total");
    assert!(verified(0) > 0 && verified(1) > 0, "verify stage used: {} {}", verified(0), verified(1));
    assert_eq!(verified(2), 0);
    // A KeelClient with no session or too many is refused.
    let file = cluster.path().join("client-1005/client.toml");
    assert!(KeelClient::connect_sessions(ClientFile::load(&file).expect("client file"), 0).is_err());
    let too_many = 1 + keel_core::message::SESSIONS_MAX as usize;
    assert!(KeelClient::connect_sessions(ClientFile::load(&file).expect("client file"), too_many).is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_only_reads_skip_ordering_and_see_every_completed_write() {
    use keel_core::message::ReadConsistency::{Index, Linearizable, Serializable};
    let mut cluster = Cluster::init(1, 1);
    let writer = cluster.client(1000);
    // A read-only read that gets no matching answers within the retransmission period is
    // ordered instead. The usual 500 ms is too short a wait on a host running the other
    // tests' clusters too (this test failed 2 of 6 full runs that way in session 8);
    // what it checks is that answers that do come are never ordered.
    let reader = cluster.client_retransmitting_after(1001, 5_000);
    put(&writer, "k", "v1").await.expect("put");
    assert_eq!(read_only(&reader, "k", Linearizable).await.as_deref(), Some("v1"));
    put(&writer, "k", "v2").await.expect("put");
    assert_eq!(read_only(&writer, "k", Serializable).await.as_deref(), Some("v2"), "reads its own write");
    // A value too large to go in every answer (others send its digest).
    let big = "b".repeat(1000);
    put(&writer, "big", &big).await.expect("put");

    // Without writes, read-only reads order nothing: no node executes another request.
    let executed =
        |c: &Cluster| (0..4).map(|i| metric(&c.metrics(i), "keel_executed_requests_total")).collect::<Vec<_>>();
    // A put completes once r + 1 nodes executed it: wait for the other two.
    let started = Instant::now();
    while executed(&cluster) != [3; 4] && started.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!("every node executed the three puts {:?} after the last completed", started.elapsed());
    let before = executed(&cluster);
    assert_eq!(before, [3; 4]);
    for _ in 0..50 {
        assert_eq!(read_only(&reader, "k", Linearizable).await.as_deref(), Some("v2"));
        assert_eq!(read_only(&reader, "k", Serializable).await.as_deref(), Some("v2"));
        assert_eq!(read_only(&reader, "k", Index).await.as_deref(), Some("v2"));
        assert_eq!(read_only(&reader, "big", Index).await.as_deref(), Some(big.as_str()));
        assert_eq!(read_only(&reader, "big", Linearizable).await.as_deref(), Some(big.as_str()));
    }
    assert_eq!(executed(&cluster), before, "read-only reads were ordered");
    // Each path ran: a read index is answered by r + 1 = 2 nodes, a linearizable read by
    // at least Q = 3.
    let answered = |kind: &str| -> u64 {
        let name = format!("keel_reads_answered_total{{kind=\"{kind}\"}}");
        (0..4).map(|i| metric(&cluster.metrics(i), &name)).sum()
    };
    assert!(answered("index") >= 200, "read-index answers: {}", answered("index"));
    assert!(answered("linearizable") >= 300, "linearizable answers: {}", answered("linearizable"));

    // Under concurrent writes, a linearizable read never returns a value older than the
    // last write acknowledged before it began.
    let (reads, writes) = reads_never_stale_under_writes(&cluster, &reader, 1002, Duration::from_secs(4)).await;
    eprintln!("{reads} linearizable and read-index reads beside {writes} writes");

    // With one node down, Q answers remain: reads still complete (a read index whose r + 1
    // nodes include the dead one is ordered after the retransmission timeout).
    cluster.kill(3);
    assert_eq!(read_only(&reader, "k", Linearizable).await.as_deref(), Some("v2"));
    for _ in 0..4 {
        assert_eq!(read_only(&reader, "k", Index).await.as_deref(), Some("v2"));
    }
    // A write sent read-only is refused by the service and ordered instead.
    let put_op = KvRequest::Put { key: "k".into(), value: "v3".into() }.encode();
    let done = reader.invoke_read_only(put_op, Linearizable, OP_TIMEOUT).await.expect("ordered instead");
    assert_eq!(KvResponse::decode(&done), Ok(KvResponse::Done));
    assert_eq!(get(&reader, "k").await.as_deref(), Some("v3"));
}

/// Median and 99th percentile of `lat`.
fn p50_p99(mut lat: Vec<Duration>) -> (Duration, Duration) {
    lat.sort();
    let at = |q: f64| lat.get(((lat.len() as f64 - 1.0) * q) as usize).copied().unwrap_or_default();
    (at(0.5), at(0.99))
}

async fn put_latencies(c: &KeelClient, n: usize, tag: &str) -> Vec<Duration> {
    let mut lat = Vec::with_capacity(n);
    for i in 0..n {
        let started = Instant::now();
        put(c, &format!("{tag}-{i}"), "v").await.expect("put acknowledged");
        lat.push(started.elapsed());
    }
    lat
}

type RawConn = tokio_rustls::client::TlsStream<tokio::net::TcpStream>;

/// `msg` as it goes on the wire: a big-endian length, then the encoded message.
fn framed(msg: &keel_core::message::Message) -> Vec<u8> {
    let frame = keel_core::codec::encode(msg);
    let mut buf = (frame.len() as u32).to_be_bytes().to_vec();
    buf.extend_from_slice(&frame);
    buf
}

/// A u = r = 1 cluster, client 1000 connected, and its put p50/p99 before anything else
/// happens (the baseline a test compares against).
async fn cluster_with_quiet_baseline() -> (Cluster, KeelClient, (Duration, Duration)) {
    let cluster = Cluster::init(1, 1);
    let client = cluster.client(1000);
    put(&client, "ready", "1").await.expect("cluster up");
    let quiet = p50_p99(put_latencies(&client, 200, "quiet").await);
    (cluster, client, quiet)
}

/// Client `id`'s own TLS connection to every node, bypassing the client library (to send
/// what a faulty client would), and its setup.
async fn raw_connections(cluster: &Cluster, id: u64) -> (keel_runtime::config::ClientSetup, Vec<RawConn>) {
    let setup = ClientFile::load(&cluster.path().join(format!("client-{id}/client.toml"))).expect("client file");
    let connector = tokio_rustls::TlsConnector::from(
        keel_runtime::tls::client_config(&setup.ca_pem, &setup.credentials).expect("tls"),
    );
    let mut conns = Vec::new();
    for member in &setup.membership.members {
        let tcp = tokio::net::TcpStream::connect(&member.addr).await.expect("tcp");
        let name = keel_runtime::tls::PeerId::Node(NodeId(member.id)).server_name();
        conns.push(connector.connect(name, tcp).await.expect("handshake"));
    }
    (setup, conns)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_flooding_every_node_neither_stalls_others_nor_changes_the_leader() {
    let (cluster, victim, quiet) = cluster_with_quiet_baseline().await;

    // Client 1001 floods every node with requests whose MACs are wrong, as fast as TLS
    // carries them; each must be checked and rejected.
    let (_, conns) = raw_connections(&cluster, 1001).await;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut floods = Vec::new();
    for mut tls in conns {
        let stop = stop.clone();
        floods.push(tokio::spawn(async move {
            let mut seq = 1u64;
            let mut sent = 0u64;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                let mut buf = Vec::new();
                for _ in 0..64 {
                    let forged = keel_core::message::Message::Request(keel_core::message::Request {
                        client: ClientId(1001),
                        seq,
                        op: b"flood".to_vec().into(),
                        auth: vec![[7u8; 16]; 4],
                        endorsements: Vec::new(),
                        sig: None,
                    });
                    buf.extend_from_slice(&framed(&forged));
                    seq += 1;
                }
                if tls.write_all(&buf).await.is_err() {
                    break;
                }
                sent += 64;
            }
            sent
        }));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let flooded = p50_p99(put_latencies(&victim, 200, "flooded").await);
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut sent = 0;
    for f in floods {
        sent += f.await.expect("flooder");
    }
    let rejected: u64 = (0..4).map(|i| metric(&cluster.metrics(i), "keel_rejected_total{kind=\"request\"}")).sum();
    eprintln!(
        "victim put p50/p99: {:?}/{:?} quiet, {:?}/{:?} while another client sent {sent} forged requests \
         ({rejected} checked and rejected before the nodes dropped it)",
        quiet.0, quiet.1, flooded.0, flooded.1
    );
    // Every node checked some, then closed the flooder's connection and refuses it now.
    for i in 0..4 {
        let m = cluster.metrics(i);
        assert_eq!(metric(&m, "keel_banned_clients_total"), 1, "node {i} dropped the flooding client");
        assert!(metric(&m, "keel_rejected_total{kind=\"request\"}") >= 64, "node {i} checked before dropping it");
        assert_eq!(metric(&m, "keel_view "), 0, "node {i}: the flood changed the leader");
    }
    let again = cluster.client(1001);
    let refused = again.invoke(b"anything".to_vec(), Duration::from_secs(2)).await;
    assert!(refused.is_err(), "a banned client is refused for a while, even with valid requests");
    // The victim was never refused.
    put(&victim, "after", "1").await.expect("others are served");
}

/// Client 1001's put of `key`, with MAC entries valid for the nodes in `valid` only.
fn split_put(setup: &keel_runtime::config::ClientSetup, seq: u64, key: &str, valid: &[usize]) -> Vec<u8> {
    let op = KvRequest::Put { key: key.as_bytes().to_vec(), value: b"x".to_vec() }.encode();
    let mut req = keel_core::message::Request::new(ClientId(1001), seq, op.into());
    let statement = req.statement();
    req.auth = setup
        .mac_keys
        .iter()
        .enumerate()
        .map(|(j, k)| if valid.contains(&j) { k.mac(&statement) } else { [0x5a; 16] })
        .collect();
    framed(&keel_core::message::Message::Request(req))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_whose_macs_are_valid_for_some_nodes_only_stalls_nobody_and_changes_no_leader() {
    // The default for r > 0: auth = rq-mac.
    let (cluster, other, quiet) = cluster_with_quiet_baseline().await;

    // Client 1001 sends 30 puts valid for nodes 0 (the primary) and 1 only, then 10 valid
    // for node 1 only, one every 40 ms, to every node; fewer than the 64 bad MACs that
    // would get it banned.
    let (setup, mut conns) = raw_connections(&cluster, 1001).await;
    let sender = tokio::spawn(async move {
        for seq in 1..=40u64 {
            let frame = if seq <= 30 {
                split_put(&setup, seq, &format!("split-{seq}"), &[0, 1])
            } else {
                split_put(&setup, seq, &format!("one-{seq}"), &[1])
            };
            for c in conns.iter_mut() {
                c.write_all(&frame).await.expect("write");
            }
            tokio::time::sleep(Duration::from_millis(40)).await;
        }
        conns
    });
    let during = p50_p99(put_latencies(&other, 200, "during").await);
    let _conns = sender.await.expect("sender");
    eprintln!(
        "other client's put p50/p99: {:?}/{:?} quiet, {:?}/{:?} while client 1001 sent requests with split MACs",
        quiet.0, quiet.1, during.0, during.1
    );
    // Nobody waited for a request timer (2 s): a stalled batch would have.
    assert!(during.1 < Duration::from_secs(1), "another client stalled: p99 {:?}", during.1);
    // Valid at two nodes (r + 1): the others endorsed it on their word, so it executed.
    let mut executed = None;
    for _ in 0..50 {
        executed = get(&other, "split-30").await;
        if executed.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(executed.as_deref(), Some("x"), "a request two nodes could vouch for executed");
    // Valid at one node: nobody else can vouch for it, so it never executes, and no node
    // suspects the primary over it (the request timer's 2 s pass here).
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(get(&other, "one-40").await, None, "one node's word is not enough");
    for i in 0..4 {
        let m = cluster.metrics(i);
        assert_eq!(metric(&m, "keel_view "), 0, "node {i}: the client changed the leader");
        let bad = metric(&m, "keel_rejected_total{kind=\"request\"}");
        let expect = match i {
            0 => 10,
            1 => 0,
            _ => 40,
        };
        assert_eq!(bad, expect, "node {i} rejected the requests its MAC entry failed");
        assert_eq!(metric(&m, "keel_banned_clients_total"), 0, "node {i}");
    }
    put(&other, "after", "1").await.expect("others are served");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_auth_sig_signed_requests_are_served_and_a_bad_signature_is_refused_everywhere() {
    let cluster = Cluster::init_auth(1, 1, "sig");
    let c = cluster.client(1000);
    put(&c, "signed", "yes").await.expect("a signed put");
    assert_eq!(get(&c, "signed").await.as_deref(), Some("yes"));
    assert_eq!(read_only(&c, "signed", ReadConsistency::Linearizable).await.as_deref(), Some("yes"));
    // Client 1001 sends a put whose signature is not its own: every node refuses it.
    let (_, mut conns) = raw_connections(&cluster, 1001).await;
    let op = KvRequest::Put { key: b"forged".to_vec(), value: b"x".to_vec() }.encode();
    let mut req = keel_core::message::Request::new(ClientId(1001), 1, op.into());
    req.sig = Some(keel_core::crypto::SigningKey::from_seed([9; 32]).sign(&req.statement()));
    let frame = framed(&keel_core::message::Message::Request(req));
    // Held open until the nodes have answered: a connection closed at once may take its
    // last frame with it.
    for tls in conns.iter_mut() {
        tls.write_all(&frame).await.expect("write");
        tls.flush().await.expect("flush");
    }
    let mut refused = 0;
    for _ in 0..50 {
        refused = (0..4).map(|i| metric(&cluster.metrics(i), "keel_rejected_total{kind=\"request\"}")).sum::<u64>();
        if refused == 4 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(refused, 4, "each node checked and refused the bad signature");
    drop(conns);
    assert_eq!(get(&c, "forged").await, None);
    put(&c, "after", "1").await.expect("others are served");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watcher_gets_every_write_under_its_prefix_in_order_even_with_a_node_down() {
    watcher_gets_every_write(Cluster::init(1, 1), 2, &[0, 1, 3]).await;
}

/// Separated execution: the execution nodes (4, 5, 6) push; one of them goes down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_separated_execution_a_watcher_gets_every_write_even_with_an_execution_node_down() {
    watcher_gets_every_write(Cluster::init_separated(1, 1), 5, &[4, 6]).await;
}

/// A watcher of `w/` gets the 20 writes under it, in order, with node `down` killed
/// halfway; the pushing nodes `pushers` that stay up drop nothing.
async fn watcher_gets_every_write(mut cluster: Cluster, down: usize, pushers: &[usize]) {
    use keel_core::client::Pushed;
    use keel_kv::KvEvent;
    let watcher = cluster.client(1001);
    let mut events = watcher.push_events().expect("the receiver");
    assert!(watcher.push_events().is_none(), "taken once");
    let done = watcher.invoke(KvRequest::Watch { prefix: b"w/".to_vec(), lease_ms: 0 }.encode(), OP_TIMEOUT).await;
    assert_eq!(KvResponse::decode(&done.expect("watch registered")).ok(), Some(KvResponse::Done));
    let writer = cluster.client(1000);
    for i in 0..20 {
        put(&writer, &format!("w/{i}"), &i.to_string()).await.expect("put");
        put(&writer, &format!("other/{i}"), "x").await.expect("put");
        if i == 9 {
            // Events from here on come from the nodes left (r + 1 = 2 needed).
            cluster.kill(down);
        }
    }
    let mut got = Vec::new();
    while got.len() < 20 {
        let next = tokio::time::timeout(Duration::from_secs(10), events.recv()).await;
        match next.expect("an event within 10 s").expect("channel open") {
            (client, Pushed::Event { seq, event }) => {
                assert_eq!(client, ClientId(1001), "for the session that watches");
                assert_eq!(seq, got.len() as u64 + 1, "numbered in order, none skipped");
                got.push(KvEvent::decode(&event).expect("a KV event"));
            }
            (_, Pushed::Gap { first, last }) => panic!("events {first}..={last} lost with one node down"),
        }
    }
    let expected: Vec<KvEvent> = (0..20)
        .map(|i| KvEvent { key: format!("w/{i}").into_bytes(), value: Some(i.to_string().into_bytes()) })
        .collect();
    assert_eq!(got, expected, "every write under the prefix, nothing else, in order");
    // Acknowledged events leave the nodes' queues (none is dropped for lack of room).
    for &i in pushers {
        let m = cluster.metrics(i);
        assert!(m.contains("\nkeel_push_dropped_total "), "node {i} exports the counter");
        assert_eq!(metric(&m, "keel_push_dropped_total"), 0, "node {i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_rq_mac_and_a_backup_down_requests_do_not_wait_for_a_retransmission() {
    // rq-mac sends a request first to u + r + 1 nodes; with one of them down it would
    // complete only after the client's 500 ms retransmission to all. The client passes
    // over nodes that stopped answering (late replies included).
    let mut cluster = Cluster::init(1, 1);
    let c = cluster.client(1000);
    put(&c, "ready", "1").await.expect("cluster up");
    cluster.kill(2);
    // The client learns of the silence from one retransmission.
    put_latencies(&c, 3, "learning").await;
    let (p50, p99) = p50_p99(put_latencies(&c, 100, "one-down").await);
    eprintln!("put p50/p99 with node 2 down: {p50:?}/{p99:?}");
    assert!(p99 < Duration::from_millis(400), "puts waited for retransmissions: p99 {p99:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_requests_are_ordered_by_digest_and_every_node_gets_their_bytes() {
    // rq-mac with request digests (the default at r > 0): the client sends a request to
    // u + r + 1 = 3 of the 4 nodes, so one node holds none of it and must fetch every
    // operation the primary proposes by digest before it can vote.
    let mut cluster = Cluster::init(1, 1);
    let c = cluster.client(1000);
    let value = |i: usize| format!("{i:04}-").repeat(400); // 2,000 bytes
    for i in 0..40 {
        put(&c, &format!("big{i}"), &value(i)).await.expect("put");
    }
    let fetched = |cluster: &Cluster| -> Vec<u64> {
        (0..4).map(|i| metric(&cluster.metrics(i), "keel_operations_fetched_total")).collect()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while fetched(&cluster).iter().sum::<u64>() < 20 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Mostly node 3: the client starts at the primary and passes over nodes that were
    // slow to answer, which now and then puts the fetching node among the three.
    let counts = fetched(&cluster);
    eprintln!("operations fetched per node: {counts:?}");
    assert!(counts.iter().sum::<u64>() >= 20, "operations fetched by nodes the client did not send them to");
    // With a node down, deciding needs the vote of the node that fetches.
    cluster.kill(2);
    let started = Instant::now();
    for i in 40..60 {
        put(&c, &format!("big{i}"), &value(i)).await.expect("put with node 2 down");
    }
    eprintln!("20 puts with node 2 down: {:?}", started.elapsed());
    let started = Instant::now();
    // A linearizable read needs Q = 3 matching answers, here from nodes 0, 1 and 3, so
    // node 3's state must hold every operation's bytes. The answer comes in full from one
    // designated node; the client, which saw node 2 stop answering, never lets that be
    // node 2, so no read is ordered: the executed counters stay put.
    let executed = |c: &Cluster| [0, 1, 3].map(|i| metric(&c.metrics(i), "keel_executed_requests_total"));
    let settled = Instant::now();
    while executed(&cluster) != [60; 3] && settled.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(executed(&cluster), [60; 3]);
    for i in 0..60 {
        let got = read_only(&c, &format!("big{i}"), ReadConsistency::Linearizable).await;
        assert_eq!(got, Some(value(i)), "big{i}");
    }
    eprintln!("60 linearizable reads: {:?}", started.elapsed());
    assert_eq!(executed(&cluster), [60; 3], "a read was ordered");
    for i in [0, 1, 3] {
        let m = cluster.metrics(i);
        assert!(!m.contains("kind=\"bodies\""), "node {i} rejected operations it was sent");
        assert_eq!(metric(&m, "keel_view_changes_total"), 0, "node {i}: fetching cost a view change");
    }
}

/// A service name the binary does not run is refused, by `keel init` and by `keel node`
/// (which used to run KV for any unknown name), before anything starts.
/// Agreed-time ticks (kv asks `keel init` for one a second): an idle cluster keeps
/// deciding empty instances and every node runs the ticks, co-located and with the
/// stages apart (order nodes tick their order state, execution nodes the service).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_kv_cluster_ticks_on_every_node() {
    for cluster in [Cluster::init(1, 1), Cluster::init_stages_apart(1, 1)] {
        let text = std::fs::read_to_string(cluster.path().join("cluster.toml")).expect("cluster file");
        assert!(text.contains("tick_ms = 1000"), "{text}");
        // RQ nodes execute nothing: the order (0-3) and execution (4-6) nodes tick.
        let ticking = if cluster.n() > 4 { 7 } else { 4 };
        let started = std::time::Instant::now();
        for i in 0..ticking {
            loop {
                let ticks = metric(&cluster.metrics(i), "keel_ticks_total");
                if ticks >= 3 {
                    break;
                }
                assert!(started.elapsed() < Duration::from_secs(20), "node {i} ran {ticks} ticks in 20 s");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
}

/// `keel node` started twice with one configuration (issue #25: it used to cut the
/// live WAL's tail before its port bind failed): the second is refused before it reads
/// the data directory, and the first keeps serving with its log intact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_started_twice_is_refused_and_the_first_keeps_serving() {
    let cluster = Cluster::init(1, 1);
    let c = cluster.client(1000);
    put(&c, "k", "before").await.expect("put");
    let wal = cluster.path().join("node-0/data/wal");
    let size = |dir: &std::path::Path| -> u64 {
        std::fs::read_dir(dir).expect("wal").flatten().map(|e| e.metadata().map_or(0, |m| m.len())).sum()
    };
    let before = size(&wal);
    let second = std::process::Command::new(support::KEEL)
        .args(["node", "--config"])
        .arg(cluster.path().join("node-0/node.toml"))
        .output()
        .expect("keel node runs");
    assert!(!second.status.success());
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(err.contains("in use by another node (pid "), "names the holder: {err}");
    assert!(size(&wal) >= before, "the second node cut the live WAL");
    put(&c, "k", "after").await.expect("put");
    assert_eq!(get(&c, "k").await.as_deref(), Some("after"));
    assert!(cluster.status(0).is_some_and(|s| s.executed >= 2), "node 0 still executes");
}

/// Damage in the middle of a node's last WAL segment: the node cuts the segment at the
/// last whole record and says so, with byte counts (issue #25: it used to drop 27 KB
/// without a word), then catches up from the others and serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wal_cut_at_damage_is_logged_with_its_byte_counts() {
    let mut cluster = Cluster::init(1, 1);
    let c = cluster.client(1000);
    for i in 0..30 {
        put(&c, &format!("k{i}"), "v").await.expect("put");
    }
    cluster.kill(3);
    let wal = cluster.path().join("node-3/data/wal");
    let mut segments: Vec<std::path::PathBuf> =
        std::fs::read_dir(&wal).expect("wal").flatten().map(|e| e.path()).collect();
    segments.sort();
    let last = segments.last().expect("a segment").clone();
    let mut bytes = std::fs::read(&last).expect("segment");
    let len = bytes.len();
    assert!(len > 1000, "the puts are in the log ({len} bytes)");
    bytes[len / 2..len / 2 + 16].fill(0xff);
    std::fs::write(&last, &bytes).expect("damaged");
    cluster.start(3);
    for i in 30..40 {
        put(&c, &format!("k{i}"), "v").await.expect("put");
    }
    // The node says it at start; on a loaded host the start may lag the puts.
    let started = Instant::now();
    let line = loop {
        let log = cluster.log(3);
        if let Some(l) = log.lines().find(|l| l.contains("bytes after the last whole record")) {
            break l.to_string();
        }
        assert!(started.elapsed() < Duration::from_secs(20), "no warning in node 3's log:\n{log}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(line.contains("WARNING") && line.contains("cut "), "{line}");
    assert!(cluster.exited(3).is_none(), "node 3 runs on");
}

/// `keel init` (u = r = 1) and `keel up ARGS` on it, its output in `up.log`, and a client.
fn keel_up(args: &[&str]) -> (tempfile::TempDir, std::process::Child, std::path::PathBuf, KeelClient) {
    use std::process::{Command, Stdio};
    let dir = tempfile::tempdir().expect("tempdir");
    let init = Command::new(support::KEEL)
        .args(["init", "--u", "1", "--r", "1", "--clients", "2", "--dir"])
        .arg(dir.path())
        .stdout(Stdio::null())
        .status()
        .expect("keel init");
    assert!(init.success());
    let up_log = dir.path().join("up.log");
    let log = std::fs::File::create(&up_log).expect("log");
    let up = Command::new(support::KEEL)
        .arg("up")
        .args(args)
        .arg("--dir")
        .arg(dir.path())
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        .spawn()
        .expect("keel up");
    let client_setup = ClientFile::load(&dir.path().join("client-1000/client.toml")).expect("client");
    let c = KeelClient::connect(client_setup).expect("client");
    (dir, up, up_log, c)
}

/// SIGTERM to `keel up`; its exit status once it stopped its nodes.
async fn stop_keel_up(up: &mut std::process::Child) -> std::process::ExitStatus {
    // SAFETY: kill(2) on the keel up process this test started.
    unsafe {
        libc::kill(up.id() as i32, libc::SIGTERM);
    }
    let started = Instant::now();
    loop {
        if let Some(code) = up.try_wait().expect("keel up") {
            return code;
        }
        assert!(started.elapsed() < Duration::from_secs(20), "keel up did not stop");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// `keel up` supervises (issue #25: one node's death used to stop the whole cluster): a
/// node killed with SIGKILL is reported and the others keep serving; SIGTERM to `keel
/// up` stops every node gracefully (each makes its log durable and says so) and it
/// exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keel_up_reports_a_dead_node_keeps_the_others_and_stops_them_gracefully() {
    let (dir, mut up, up_log, c) = keel_up(&[]);
    put(&c, "a", "1").await.expect("put with every node up");
    let pid_of = |i: usize| -> i32 {
        let text = std::fs::read_to_string(dir.path().join(format!("node-{i}/data/node.pid"))).expect("pid file");
        text.trim().parse().expect("a pid")
    };
    // SAFETY: kill(2) on a process this test started (through keel up).
    unsafe {
        libc::kill(pid_of(2), libc::SIGKILL);
    }
    put(&c, "b", "2").await.expect("put with node 2 dead");
    assert_eq!(get(&c, "b").await.as_deref(), Some("2"));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(up.try_wait().expect("keel up").is_none(), "keel up runs on");
    let said = std::fs::read_to_string(&up_log).unwrap_or_default();
    assert!(said.contains("node-2 exited") && said.contains("3 nodes still running"), "{said}");

    let code = stop_keel_up(&mut up).await;
    assert!(code.success(), "{code}");
    for i in [0, 1, 3] {
        let log = std::fs::read_to_string(dir.path().join(format!("node-{i}/node.log"))).unwrap_or_default();
        assert!(log.contains("SIGTERM: stopping once its log is durable"), "node {i}:\n{log}");
        assert!(log.contains("node stopped"), "node {i} did not stop gracefully:\n{log}");
    }
}

/// `keel up --restart` starts a node that died again (after a second, backing off while
/// it keeps failing), and the restarted node catches up and serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keel_up_restart_brings_a_killed_node_back() {
    let (dir, mut up, up_log, c) = keel_up(&["--restart"]);
    put(&c, "a", "1").await.expect("put with every node up");
    let pid_of = |i: usize| -> Option<i32> {
        let text = std::fs::read_to_string(dir.path().join(format!("node-{i}/data/node.pid"))).ok()?;
        text.trim().parse().ok()
    };
    let first = pid_of(2).expect("node 2's pid");
    // SAFETY: kill(2) on a process this test started (through keel up).
    unsafe {
        libc::kill(first, libc::SIGKILL);
    }
    put(&c, "b", "2").await.expect("put with node 2 dead");
    let started = Instant::now();
    loop {
        let said = std::fs::read_to_string(&up_log).unwrap_or_default();
        if said.contains("restarted") && pid_of(2).is_some_and(|p| p != first) {
            assert!(said.contains("node-2 exited") && said.contains("restarting in 1 s"), "{said}");
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(20), "node 2 was not restarted:\n{said}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Back in the cluster: it executes what it missed.
    let setup = keel_runtime::config::NodeFile::load(&dir.path().join("node-2/node.toml")).expect("node file");
    let started = Instant::now();
    loop {
        put(&c, "c", "3").await.expect("put");
        let status = keel_runtime::metrics::fetch_status(setup.metrics, Duration::from_secs(1));
        if status.as_ref().is_ok_and(|s| s.executed >= 3) {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(30), "the restarted node did not catch up: {status:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let code = stop_keel_up(&mut up).await;
    assert!(code.success(), "{code}");
}

/// Concurrent `keel kv` processes (issue #25: 6 of 100 puts from 4 parallel loops failed,
/// all sharing the default identity): each process claims a free identity, so every put
/// succeeds; an identity asked for by name while in use is refused with who holds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_keel_kv_processes_each_claim_a_free_identity() {
    let cluster = Cluster::init(1, 1);
    let dir = cluster.path().to_path_buf();
    let kv = move |args: Vec<String>| {
        std::process::Command::new(support::KEEL).arg("kv").arg("--dir").arg(&dir).args(args).output().expect("keel kv")
    };
    let loops: Vec<_> = (0..4)
        .map(|l| {
            let kv = kv.clone();
            std::thread::spawn(move || {
                (0..25).filter(|i| kv(vec!["put".into(), format!("l{l}/{i}"), i.to_string()]).status.success()).count()
            })
        })
        .collect();
    let ok: usize = loops.into_iter().map(|l| l.join().expect("loop")).sum();
    assert_eq!(ok, 100, "every put of four concurrent loops succeeds");
    let got = kv(vec!["get".into(), "l3/24".into()]);
    assert_eq!(String::from_utf8_lossy(&got.stdout).trim(), "24");
    // Identity 1007 held by a watcher: asked for by name, it is refused, and says why.
    let mut watcher = support::identity_holder(cluster.path(), 1007);
    let refused = kv(vec!["--client".into(), "1007".into(), "get".into(), "x".into()]);
    let _ = watcher.kill();
    let _ = watcher.wait();
    assert_eq!(refused.status.code(), Some(2));
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(err.contains("client identity 1007 is in use by another process (pid "), "{err}");
}

#[test]
fn an_unknown_service_is_refused_by_init_and_by_node() {
    let dir = tempfile::tempdir().expect("tempdir");
    let refused = std::process::Command::new(support::KEEL)
        .args(["init", "--dir"])
        .arg(dir.path().join("zk"))
        .args(["--service", "zookeeper"])
        .output()
        .expect("keel init runs");
    assert_eq!(refused.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&refused.stderr)
        .contains("unknown --service \"zookeeper\"; this binary runs: kv, null"));
    assert!(!dir.path().join("zk").exists(), "nothing was written");

    let made = std::process::Command::new(support::KEEL)
        .args(["init", "--dir"])
        .arg(dir.path().join("c"))
        .output()
        .expect("keel init runs");
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    let node = dir.path().join("c/node-0/node.toml");
    let text = std::fs::read_to_string(&node).expect("node file");
    assert!(text.contains("service = \"kv\""), "{text}");
    std::fs::write(&node, text.replace("service = \"kv\"", "service = \"zookeeper\"")).expect("written");
    let out = std::process::Command::new(support::KEEL)
        .args(["node", "--config"])
        .arg(&node)
        .output()
        .expect("keel node runs");
    assert_eq!(out.status.code(), Some(2), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown service \"zookeeper\""));
    let wal = std::fs::read_dir(dir.path().join("c/node-0/data/wal")).expect("provisioned by init").count();
    assert_eq!(wal, 0, "the node opened nothing");
}

/// `keel init --base-port` in the machine's ephemeral port range is written as asked but
/// warned about (an outgoing connection may take a node's port before it binds); below
/// the range, and with the default ports, nothing is said.
#[test]
fn keel_init_warns_of_ports_in_the_ephemeral_range() {
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").ok().and_then(|t| {
        let mut it = t.split_whitespace().map(|p| p.parse::<u32>().ok());
        Some((it.next()??, it.next()??))
    });
    let dir = tempfile::tempdir().expect("tempdir");
    let init = |name: &str, port: Option<u32>| {
        let mut cmd = std::process::Command::new(support::KEEL);
        cmd.args(["init", "--dir"]).arg(dir.path().join(name));
        if let Some(p) = port {
            cmd.args(["--base-port", &p.to_string()]);
        }
        let out = cmd.output().expect("keel init runs");
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let warned = |err: &str| err.contains("overlap this machine's ephemeral port range");
    assert!(!warned(&init("default", None)), "the default ports are below the range");
    match range {
        Some((low, high)) if low > 1024 + 16 && high < 65_000 => {
            assert!(warned(&init("inside", Some(low + 1))), "a base port inside {low}..{high}");
            assert!(!warned(&init("below", Some(low - 16))), "a base port below {low}");
        }
        // No such file (not Linux) or an unusual range: never a warning.
        _ => assert!(!warned(&init("any", Some(40_000)))),
    }
}

/// `keel init` names every port the cluster takes, by use, and the ranges it prints are
/// the ones the node files hold.
#[test]
fn keel_init_prints_every_port_range_it_assigns() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = std::process::Command::new(support::KEEL)
        .args(["init", "--u", "1", "--r", "1", "--base-port", "25000", "--dir"])
        .arg(dir.path().join("c"))
        .output()
        .expect("keel init runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("ports 25000..25007 (peers 25000..25003, metrics 25004..25007)"), "{said}");
    let node3 = std::fs::read_to_string(dir.path().join("c/node-3/node.toml")).expect("node-3's file");
    assert!(node3.contains("127.0.0.1:25007"), "node 3's metrics port: {node3}");
    assert!(node3.contains("127.0.0.1:25003"), "node 3's peer port: {node3}");
}
