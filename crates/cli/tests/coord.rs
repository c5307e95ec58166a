//! coord with real ZooKeeper clients nobody here wrote: kazoo (PyPI), the Apache
//! ZooKeeper Java client and zkCli, and Apache Curator's recipes (Maven Central), against
//! `keel node` processes.
//! `scripts/install-test-clients` installs them (scripts/test runs it first); without
//! them these tests fail and say so, they never skip.

mod support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use support::Cluster;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn clients_dir() -> PathBuf {
    repo().join("services/coord/tests/clients")
}

fn classpath() -> String {
    let file = repo().join("target/zk-clients/classpath.txt");
    std::fs::read_to_string(&file)
        .unwrap_or_else(|e| panic!("{}: {e}; run scripts/install-test-clients first", file.display()))
        .trim()
        .to_string()
}

/// A four-letter word's answer from a front end.
fn four_letter(addr: SocketAddr, word: &str) -> Option<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    s.write_all(word.as_bytes()).ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    Some(out)
}

/// A coord cluster (u = r = 1) whose front ends all answer.
fn coord_cluster() -> (Cluster, Vec<SocketAddr>) {
    ready(Cluster::init_service("coord", 1, 1))
}

/// The same, with reads answered from each node's own state (`reads = "local"`).
fn coord_cluster_local_reads() -> (Cluster, Vec<SocketAddr>) {
    ready(Cluster::init_service_with("coord", 1, 1, "[front_end.options]\nreads = \"local\""))
}

fn ready(c: Cluster) -> (Cluster, Vec<SocketAddr>) {
    let fronts = c.front_ends();
    assert_eq!(fronts.len(), 4, "a front end per node");
    let started = Instant::now();
    for addr in &fronts {
        while four_letter(*addr, "ruok").as_deref() != Some("imok") {
            assert!(started.elapsed() < Duration::from_secs(60), "front end {addr} never answered ruok");
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    (c, fronts)
}

fn hosts(fronts: &[SocketAddr]) -> String {
    fronts.iter().map(|a| a.to_string()).collect::<Vec<_>>().join(",")
}

fn run(cmd: &mut Command, what: &str, limit: Duration) -> String {
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap_or_else(|e| panic!("{what}: {e}"));
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            let mut out = String::new();
            let mut err = String::new();
            child.stdout.take().map(|mut o| o.read_to_string(&mut out));
            child.stderr.take().map(|mut e| e.read_to_string(&mut err));
            assert!(status.success(), "{what} failed ({status}):\n{out}\n{err}");
            return out;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn kazoo_basics_watches_acls_and_recipes_survive_a_kill_of_the_clients_node() {
    let (c, fronts) = coord_cluster();
    let out = run(
        Command::new("python3")
            .arg(clients_dir().join("kazoo_scenarios.py"))
            .arg(hosts(&fronts))
            .arg(c.pid(0).to_string()),
        "kazoo scenarios",
        Duration::from_secs(240),
    );
    println!("{out}");
    assert!(out.contains("recipes ok across a kill -9 of the client's node"), "{out}");
    assert!(out.contains("all kazoo scenarios passed"), "{out}");
}

#[test]
fn the_java_client_covers_every_operation_and_moves_its_session_and_watches() {
    java_scenarios(coord_cluster());
}

#[test]
fn the_java_client_scenarios_pass_with_local_reads_too() {
    java_scenarios(coord_cluster_local_reads());
}

fn java_scenarios((c, fronts): (Cluster, Vec<SocketAddr>)) {
    let out = java_program(&c, &fronts, "ZkScenarios", Duration::from_secs(240));
    assert!(out.contains("all Java client scenarios passed"), "{out}");
}

/// Compiles `services/coord/tests/clients/{class}.java` against the Maven classpath and
/// runs it with the cluster's client addresses and its nodes' process ids; its output.
fn java_program(c: &Cluster, fronts: &[SocketAddr], class: &str, limit: Duration) -> String {
    let classes = tempfile::tempdir().expect("tempdir");
    let cp = classpath();
    run(
        Command::new("javac")
            .arg("-d")
            .arg(classes.path())
            .args(["-cp", &cp])
            .arg(clients_dir().join(format!("{class}.java"))),
        "javac",
        Duration::from_secs(120),
    );
    let pids: Vec<String> = (0..4).map(|i| c.pid(i).to_string()).collect();
    let out = run(
        Command::new("java")
            .args(["-cp", &format!("{}:{cp}", classes.path().display())])
            .arg(class)
            .arg(hosts(fronts))
            .arg(pids.join(",")),
        class,
        limit,
    );
    println!("{out}");
    out
}

/// Curator's recipes (leader latch, mutex, semaphore, atomic long, double barrier,
/// caches, persistent node, transactions, its ensemble tracker following
/// /zookeeper/config) with node 0 killed -9 while four clients contend. Before session
/// 30 a watch event could reach a client ahead of the reply to the read that set its
/// watch, and the client dropped it: recipes hung or missed a deletion.
#[test]
fn curator_recipes_stay_right_across_a_kill_of_a_node() {
    let (c, fronts) = coord_cluster();
    let out = java_program(&c, &fronts, "CuratorScenarios", Duration::from_secs(300));
    assert!(out.contains("lock, semaphore and atomic long ok across a kill -9"), "{out}");
    assert!(out.contains("all Curator scenarios passed"), "{out}");
}

#[test]
fn zkcli_runs_a_scripted_session() {
    let (c, fronts) = coord_cluster();
    // `keel status` says where clients connect.
    let status = Command::new(support::KEEL).args(["status", "--dir"]).arg(c.path()).output().expect("keel status");
    let status = String::from_utf8_lossy(&status.stdout);
    for (i, addr) in fronts.iter().enumerate() {
        assert!(status.contains(&format!("node {i} serves coord clients on {addr}")), "{status}");
    }
    let script = "create /cli hello\ncreate -s /cli/s- x\ncreate -e /cli/e y\nls /cli\nset /cli world\nget /cli\n\
                  addauth digest bob:pw\ncreate /cli/sec z auth:bob:pw:cdrwa\ngetAcl /cli/sec\ndelete /cli/nothere\n\
                  getEphemerals /cli\nsync /cli\nwhoami\ndeleteall /cli\nls /\nls /zookeeper\nquit\n";
    let mut child = Command::new("java")
        .args(["-cp", &classpath(), "org.apache.zookeeper.ZooKeeperMain", "-server", &fronts[2].to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("zkCli starts");
    child.stdin.take().expect("stdin").write_all(script.as_bytes()).expect("script written");
    let out = child.wait_with_output().expect("zkCli ends");
    let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    // What zkCli printed (its answers go to stdout, "Created ..." and errors to stderr).
    let expected = [
        "Created /cli\n",
        "Created /cli/s-0000000000",
        "Created /cli/e",
        "[e, s-0000000000]",
        "world",
        "Created /cli/sec",
        "'digest,'bob:",
        ": cdrwa",
        "Node does not exist: /cli/nothere",
        "[/cli/e]",
        "Sync is OK",
        "digest: bob",
        "[zookeeper]",
        "[config, quota]",
    ];
    for want in expected {
        assert!(text.contains(want), "zkCli did not print {want:?}; it printed:\n{text}");
    }
    assert!(out.status.success(), "zkCli exit status {}", out.status);
}

/// Frames with a length, for raw protocol checks.
fn framed(body: &[u8]) -> Vec<u8> {
    let mut f = (body.len() as u32).to_be_bytes().to_vec();
    f.extend_from_slice(body);
    f
}

fn connect_body() -> Vec<u8> {
    let mut w = Vec::new();
    w.extend_from_slice(&0i32.to_be_bytes()); // protocol version
    w.extend_from_slice(&0i64.to_be_bytes()); // last zxid seen
    w.extend_from_slice(&10_000i32.to_be_bytes()); // timeout
    w.extend_from_slice(&0i64.to_be_bytes()); // session 0: a new one
    w.extend_from_slice(&16i32.to_be_bytes());
    w.extend_from_slice(&[0u8; 16]);
    w
}

fn read_frame(s: &mut TcpStream) -> Vec<u8> {
    let mut len = [0u8; 4];
    s.read_exact(&mut len).expect("a frame length");
    let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut body).expect("a frame");
    body
}

/// `keel admin add-node` on a coord cluster gives the new node a front end of its own
/// (a port and a client identity): ZooKeeper clients connected to it create nodes the
/// others see, and the other way round.
#[test]
fn an_added_node_serves_zookeeper_clients_on_a_front_end_of_its_own() {
    let (mut c, fronts) = coord_cluster();
    let said = c.admin(&["add-node"]).expect("add-node");
    assert!(said.contains("its clients' port (the service's front end): "), "{said}");
    c.add_slot(4);
    c.start(4);
    let all = c.front_ends();
    assert_eq!(all.len(), 5, "the new node has a front end");
    let added = all[4];
    assert!(!fronts.contains(&added), "a port of its own");
    let started = Instant::now();
    while four_letter(added, "ruok").as_deref() != Some("imok") {
        assert!(started.elapsed() < Duration::from_secs(60), "the added node's front end never answered");
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut on_new = RawClient::connect(added, 10_000);
    assert_eq!(on_new.create_ephemeral("/from-the-new-node"), 0);
    let mut on_old = RawClient::connect(fronts[1], 10_000);
    assert_eq!(on_old.exists("/from-the-new-node"), 0, "seen from an old node");
    assert_eq!(on_old.create_ephemeral("/from-an-old-node"), 0);
    assert_eq!(on_new.exists("/from-an-old-node"), 0, "seen from the new node");
    drop((on_new, on_old));

    // /zookeeper/config lists the five client ports, as the Java client's own parser
    // (ConfigUtils.getClientConfigStr, what updateServerList takes) reads it.
    let expected = |fronts: &[SocketAddr]| fronts.iter().map(|a| a.to_string()).collect::<Vec<_>>();
    let mut watcher = RawClient::connect(fronts[1], 30_000);
    let started = Instant::now();
    while watcher.config_servers() != expected(&all) {
        assert!(started.elapsed() < Duration::from_secs(20), "config: {:?}", watcher.config_servers());
        std::thread::sleep(Duration::from_millis(200));
    }
    let parsed = java_client_config(&fronts[2..3]);
    for a in &all {
        assert!(parsed.contains(&a.to_string()), "the Java client's parse lists {a}: {parsed}");
    }
    // Removed, node 4 stops announcing: it leaves the list.
    let said = c.admin(&["remove-node", "4"]).expect("remove-node");
    assert!(said.contains("node 4 removed"), "{said}");
    let started = Instant::now();
    while watcher.config_servers() != expected(&fronts) {
        watcher.ping();
        assert!(
            started.elapsed() < Duration::from_secs(40),
            "config after the removal: {:?}",
            watcher.config_servers()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// `/zookeeper/config` as the Java client's ConfigUtils reads it ("version hosts").
fn java_client_config(fronts: &[SocketAddr]) -> String {
    let classes = tempfile::tempdir().expect("tempdir");
    let cp = classpath();
    run(
        Command::new("javac").arg("-d").arg(classes.path()).args(["-cp", &cp]).arg(clients_dir().join("ZkConfig.java")),
        "javac",
        Duration::from_secs(120),
    );
    let out = run(
        Command::new("java")
            .args(["-cp", &format!("{}:{cp}", classes.path().display())])
            .arg("ZkConfig")
            .arg(hosts(fronts)),
        "ZkConfig",
        Duration::from_secs(60),
    );
    out.lines().find_map(|l| l.strip_prefix("client-config: ")).unwrap_or_else(|| panic!("{out}")).to_string()
}

/// `max_client_cnxns` (ZooKeeper's per-address limit): with 5, a sixth connection from
/// the same address is closed at once and counted; once one of the five closes, a new
/// one is kept again.
#[test]
fn connections_beyond_the_per_address_limit_are_refused() {
    let (_c, fronts) =
        ready(Cluster::init_service_with("coord", 1, 1, "[front_end.options]\nmax_client_cnxns = \"5\""));
    let front = fronts[0];
    // Open means: the server neither closed it nor sent anything within a moment.
    let kept = |s: &mut TcpStream| {
        s.set_read_timeout(Some(Duration::from_millis(500))).expect("timeout");
        let mut b = [0u8; 1];
        matches!(s.read(&mut b), Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut))
    };
    let mut open: Vec<TcpStream> = (0..5).map(|_| TcpStream::connect(front).expect("connect")).collect();
    for s in &mut open {
        assert!(kept(s), "one of the first five was closed");
    }
    let mut sixth = TcpStream::connect(front).expect("connect");
    assert!(!kept(&mut sixth), "a sixth connection from one address is closed");
    let stat = four_letter(fronts[1], "ruok");
    assert_eq!(stat.as_deref(), Some("imok"), "other nodes are not affected");
    drop(open.pop());
    std::thread::sleep(Duration::from_millis(300));
    // Four of five open: a four-letter word gets through, and counts the refusal.
    let mntr = four_letter(front, "mntr").unwrap_or_default();
    assert!(mntr.contains("zk_refused_connections\t1\n"), "{mntr}");
    let mut again = TcpStream::connect(front).expect("connect");
    assert!(kept(&mut again), "a connection is kept again once one closed");
}

#[test]
fn bad_input_gets_an_error_or_a_closed_connection_and_is_counted() {
    let (_c, fronts) = coord_cluster();
    let addr = fronts[1];
    let closed = |mut s: TcpStream| {
        s.set_read_timeout(Some(Duration::from_secs(20))).expect("timeout");
        let mut buf = [0u8; 64];
        matches!(s.read(&mut buf), Ok(0) | Err(_))
    };
    // An oversized length: closed before anything is allocated.
    let mut s = TcpStream::connect(addr).expect("connects");
    s.write_all(&0x7fff_fff0u32.to_be_bytes()).expect("written");
    assert!(closed(s), "an oversized frame closes the connection");
    // A connect request cut short.
    let mut s = TcpStream::connect(addr).expect("connects");
    s.write_all(&framed(&[0, 0, 0, 0, 1])).expect("written");
    assert!(closed(s), "a malformed handshake closes the connection");
    // After a good handshake: an unknown opcode gets UNIMPLEMENTED and the connection
    // stays; a malformed request closes it.
    let mut s = TcpStream::connect(addr).expect("connects");
    s.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
    s.write_all(&framed(&connect_body())).expect("written");
    let response = read_frame(&mut s);
    assert!(response.len() >= 4 + 4 + 8 + 4 + 16, "a ConnectResponse: {response:?}");
    let mut unknown = 7i32.to_be_bytes().to_vec();
    unknown.extend_from_slice(&16i32.to_be_bytes()); // reconfig: not implemented here
    s.write_all(&framed(&unknown)).expect("written");
    let reply = read_frame(&mut s);
    assert_eq!(&reply[0..4], &7i32.to_be_bytes(), "the reply names the request's xid");
    assert_eq!(&reply[12..16], &(-6i32).to_be_bytes(), "UNIMPLEMENTED");
    let mut ping = (-2i32).to_be_bytes().to_vec();
    ping.extend_from_slice(&11i32.to_be_bytes());
    s.write_all(&framed(&ping)).expect("written");
    assert_eq!(&read_frame(&mut s)[0..4], &(-2i32).to_be_bytes(), "the connection still answers");
    let mut bad = 8i32.to_be_bytes().to_vec();
    bad.extend_from_slice(&4i32.to_be_bytes()); // getData with a path length past the frame
    bad.extend_from_slice(&1000i32.to_be_bytes());
    s.write_all(&framed(&bad)).expect("written");
    assert!(closed(s), "a malformed request closes the connection");
    let mntr = four_letter(addr, "mntr").expect("mntr");
    let dropped: u64 = mntr
        .lines()
        .find_map(|l| l.strip_prefix("zk_malformed_dropped\t"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("mntr: {mntr}"));
    assert_eq!(dropped, 3, "each bad input counted: {mntr}");
    // The other front ends and clients are undisturbed.
    for a in &fronts {
        assert_eq!(four_letter(*a, "ruok").as_deref(), Some("imok"));
    }
    let envi = four_letter(addr, "envi").expect("envi");
    assert!(envi.contains("zookeeper.version=3.9.5"), "{envi}");
    // A connection that never sends its handshake is closed after 10 s, and counted.
    let silent = TcpStream::connect(addr).expect("connects");
    assert!(closed(silent), "a connection without a handshake is closed");
    let mntr = four_letter(addr, "mntr").expect("mntr");
    assert!(mntr.contains("zk_refused_connections\t1\n"), "{mntr}");
    // The other words operators' tools send: srvr and stat (version, zxid, mode), conf
    // (the client port), cons and stat's client list (a live session by its id).
    // (Asking for 60 s also checks the clamp to ZooKeeper's default maximum, 40 s.)
    let client = RawClient::connect(addr, 60_000);
    let sid = format!("sid=0x{:x},", client.session);
    let listed = |word: &str| {
        // The front end lists a connection just after its handshake answer went out.
        (0..40).find_map(|_| {
            let text = four_letter(addr, word).expect(word);
            if text.contains(&sid) {
                return Some(text);
            }
            std::thread::sleep(Duration::from_millis(50));
            None
        })
    };
    let stat = listed("stat").unwrap_or_else(|| panic!("stat never listed {sid}"));
    assert!(stat.contains("Clients:\n"), "{stat}");
    assert!(listed("cons").is_some(), "cons never listed {sid}");
    let srvr = four_letter(addr, "srvr").expect("srvr");
    for want in ["Zookeeper version: 3.9.5", "\nZxid: 0x", "\nMode: ", "\nConnections: 1\n"] {
        assert!(srvr.contains(want), "srvr lacks {want:?}: {srvr}");
    }
    let conf = four_letter(addr, "conf").expect("conf");
    assert!(conf.contains(&format!("clientPort={}\n", addr.port())), "{conf}");
    // check (opcode 13) on its own, outside a multi: a version compare, nothing else.
    let mut client = client;
    let check = |c: &mut RawClient, path: &str, version: i32| {
        let mut w = keel_coord::jute::Writer::new();
        w.string(path).int(version);
        c.request(13, &w.into_bytes()).0
    };
    assert_eq!(check(&mut client, "/zookeeper", 0), 0, "check at the node's version");
    assert_eq!(check(&mut client, "/zookeeper", 5), -103, "check at another version: BADVERSION");
    assert_eq!(check(&mut client, "/nothere", 0), -101, "check of a missing node: NONODE");
    drop(client);
    // A frame too short for a request header, and an auth packet cut short: each closes
    // its connection and is counted.
    for body in [vec![0, 0, 0, 9], [(-4i32).to_be_bytes(), 100i32.to_be_bytes()].concat()] {
        let mut c = RawClient::connect(addr, 10_000);
        c.stream.write_all(&framed(&body)).expect("written");
        assert!(closed(c.stream), "{body:?} closes the connection");
    }
    let mntr = four_letter(addr, "mntr").expect("mntr");
    assert!(mntr.contains("zk_malformed_dropped\t5\n"), "two more bad inputs counted: {mntr}");
}

/// A ZooKeeper client made of bytes: the handshake and requests, one at a time.
struct RawClient {
    stream: TcpStream,
    xid: i32,
    session: i64,
    password: Vec<u8>,
    /// The zxid in the last reply's header.
    zxid: i64,
}

impl RawClient {
    fn connect(addr: SocketAddr, timeout_ms: i32) -> RawClient {
        RawClient::attach(addr, timeout_ms, 0, &[0; 16]).expect("a session")
    }

    /// The handshake for session `session` (0: a new one); None if the session expired.
    fn attach(addr: SocketAddr, timeout_ms: i32, session: i64, password: &[u8]) -> Option<RawClient> {
        use keel_coord::jute::{Reader, Writer};
        let mut stream = TcpStream::connect(addr).expect("connects");
        stream.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
        let mut w = Writer::new();
        w.int(0).long(0).int(timeout_ms).long(session).buffer(password).bool(false);
        stream.write_all(&framed(&w.into_bytes())).expect("written");
        let response = read_frame(&mut stream);
        let mut r = Reader::new(&response);
        let (_version, negotiated, session) = (r.int().ok()?, r.int().ok()?, r.long().ok()?);
        let password = r.buffer().ok()?;
        if negotiated == 0 {
            return None;
        }
        assert_eq!(negotiated, timeout_ms.clamp(4_000, 40_000), "negotiated timeout");
        Some(RawClient { stream, xid: 0, session, password, zxid: 0 })
    }

    /// Sends one request; its reply's error code and body (watch events skipped).
    fn request(&mut self, opcode: i32, body: &[u8]) -> (i32, Vec<u8>) {
        self.xid += 1;
        let mut frame = self.xid.to_be_bytes().to_vec();
        frame.extend_from_slice(&opcode.to_be_bytes());
        frame.extend_from_slice(body);
        self.stream.write_all(&framed(&frame)).expect("written");
        loop {
            let reply = read_frame(&mut self.stream);
            let xid = i32::from_be_bytes(reply[0..4].try_into().expect("xid"));
            if xid == -1 {
                continue;
            }
            assert_eq!(xid, self.xid, "replies in request order");
            self.zxid = i64::from_be_bytes(reply[4..12].try_into().expect("zxid"));
            return (i32::from_be_bytes(reply[12..16].try_into().expect("err")), reply[16..].to_vec());
        }
    }

    fn create_ephemeral(&mut self, path: &str) -> i32 {
        self.create(path, 1).0
    }

    /// A persistent node: the error code and the reply body.
    fn create_persistent(&mut self, path: &str) -> (i32, Vec<u8>) {
        self.create(path, 0)
    }

    fn create(&mut self, path: &str, flags: i32) -> (i32, Vec<u8>) {
        use keel_coord::jute::Writer;
        use keel_coord::proto::Acl;
        let mut w = Writer::new();
        w.string(path).buffer(b"");
        Acl::write_all(&Acl::open(), &mut w);
        w.int(flags);
        self.request(1, &w.into_bytes())
    }

    /// The client addresses `/zookeeper/config` lists (the part after `;` of each
    /// `server.N=` line), in its order.
    fn config_servers(&mut self) -> Vec<String> {
        use keel_coord::jute::{Reader, Writer};
        let mut w = Writer::new();
        w.string("/zookeeper/config").bool(false);
        let (e, body) = self.request(4, &w.into_bytes());
        assert_eq!(e, 0, "getData /zookeeper/config");
        let data = Reader::new(&body).buffer().expect("data");
        String::from_utf8_lossy(&data)
            .lines()
            .filter(|l| l.starts_with("server."))
            .filter_map(|l| l.split_once(';').map(|(_, client)| client.to_string()))
            .collect()
    }

    fn exists(&mut self, path: &str) -> i32 {
        use keel_coord::jute::Writer;
        let mut w = Writer::new();
        w.string(path).bool(false);
        self.request(3, &w.into_bytes()).0
    }

    fn ping(&mut self) {
        let mut frame = (-2i32).to_be_bytes().to_vec();
        frame.extend_from_slice(&11i32.to_be_bytes());
        self.stream.write_all(&framed(&frame)).expect("written");
        loop {
            let reply = read_frame(&mut self.stream);
            if i32::from_be_bytes(reply[0..4].try_into().expect("xid")) == -2 {
                return;
            }
        }
    }
}

#[test]
fn a_silent_client_loses_its_session_and_ephemerals_at_agreed_time_a_pinging_one_keeps_them() {
    let (_c, fronts) = coord_cluster();
    let mut silent = RawClient::connect(fronts[0], 4_000);
    let mut alive = RawClient::connect(fronts[3], 4_000);
    assert_eq!(silent.create_ephemeral("/silent"), 0);
    assert_eq!(alive.create_ephemeral("/alive"), 0);
    // Three timeouts: the silent one is gone whatever the tick phase, the other pings.
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(10) {
        alive.ping();
        std::thread::sleep(Duration::from_millis(1_000));
    }
    assert_eq!(alive.exists("/silent"), -101, "the silent session's ephemeral is gone (NONODE)");
    assert_eq!(alive.exists("/alive"), 0, "the pinging session keeps its ephemeral");
    // The silent client's connection was closed for it.
    silent.stream.set_read_timeout(Some(Duration::from_secs(5))).expect("timeout");
    let mut buf = [0u8; 16];
    assert!(matches!(silent.stream.read(&mut buf), Ok(0) | Err(_)), "the expired session's connection is closed");
}

#[test]
fn a_client_that_never_reads_its_replies_is_closed_and_counted_and_others_go_on() {
    use keel_coord::jute::Writer;
    use keel_coord::proto::Acl;
    let (_c, fronts) = coord_cluster();
    let addr = fronts[2];
    let mut writer = RawClient::connect(addr, 4_000);
    let mut w = Writer::new();
    w.string("/big").buffer(&vec![7u8; 100 * 1024]);
    Acl::write_all(&Acl::open(), &mut w);
    w.int(0);
    assert_eq!(writer.request(1, &w.into_bytes()).0, 0, "created /big");
    // Asks for /big over and over and never reads an answer.
    let mut deaf = RawClient::connect(addr, 4_000);
    let mut get = Writer::new();
    get.string("/big").bool(false);
    let get = get.into_bytes();
    deaf.stream.set_write_timeout(Some(Duration::from_secs(2))).expect("timeout");
    for xid in 1..=400i32 {
        let mut frame = xid.to_be_bytes().to_vec();
        frame.extend_from_slice(&4i32.to_be_bytes());
        frame.extend_from_slice(&get);
        if deaf.stream.write_all(&framed(&frame)).is_err() {
            break; // its own send buffer is full too: enough
        }
    }
    let started = Instant::now();
    loop {
        let mntr = four_letter(addr, "mntr").expect("mntr");
        let stalled = mntr.lines().find_map(|l| l.strip_prefix("zk_stalled_dropped\t")).map(str::trim);
        if stalled == Some("1") {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(60), "the deaf client was never dropped:\n{mntr}");
        // The other client on the same front end is served meanwhile.
        writer.ping();
        std::thread::sleep(Duration::from_millis(500));
    }
    assert_eq!(writer.exists("/big"), 0, "the other client is still served");
}

/// An Apache ZooKeeper server (standalone, fsync on), started by the test from the same
/// Maven jar as the client, stopped by its handle.
struct ZooKeeperServer {
    child: std::process::Child,
    addr: SocketAddr,
    _dir: tempfile::TempDir,
}

impl ZooKeeperServer {
    fn start() -> ZooKeeperServer {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = keel_runtime::provision::free_ports(1).expect("a free port");
        let config = dir.path().join("zoo.cfg");
        std::fs::write(
            &config,
            format!(
                "tickTime=2000\ndataDir={}\nclientPort={port}\nclientPortAddress=127.0.0.1\n\
                 admin.enableServer=false\n4lw.commands.whitelist=*\nextendedTypesEnabled=true\n",
                dir.path().join("data").display()
            ),
        )
        .expect("zoo.cfg");
        let log = std::fs::File::create(dir.path().join("server.log")).expect("log");
        let child = Command::new("java")
            .args(["-cp", &classpath(), "org.apache.zookeeper.server.ZooKeeperServerMain"])
            .arg(&config)
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("ZooKeeper starts");
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("address");
        let started = Instant::now();
        while four_letter(addr, "ruok").as_deref() != Some("imok") {
            assert!(started.elapsed() < Duration::from_secs(60), "ZooKeeper did not start");
            std::thread::sleep(Duration::from_millis(200));
        }
        ZooKeeperServer { child, addr, _dir: dir }
    }
}

impl Drop for ZooKeeperServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn differential(keel: &str, zk: SocketAddr, extra: &[&str]) -> std::process::Output {
    Command::new("python3")
        .arg(clients_dir().join("differential.py"))
        .args([keel, &zk.to_string()])
        .args(extra)
        .output()
        .expect("differential.py runs")
}

#[test]
fn the_same_operations_give_the_same_results_and_events_as_apache_zookeeper() {
    let zk = ZooKeeperServer::start();
    let (_c, fronts) = coord_cluster();
    let keel = format!("{},{}", fronts[0], fronts[1]);
    for seed in ["11", "12"] {
        let out = differential(&keel, zk.addr, &["--ops", "2500", "--seed", seed]);
        let text = String::from_utf8_lossy(&out.stdout);
        println!("{text}{}", String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "seed {seed}: results differ from ZooKeeper's:\n{text}");
        assert!(text.contains(": 0 mismatches"), "{text}");
    }
    // The comparison can fail: a result changed on purpose is caught.
    let out = differential(&keel, zk.addr, &["--ops", "600", "--seed", "13", "--plant"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success() && text.contains("MISMATCH"), "a planted difference went unnoticed:\n{text}");
}

#[test]
fn a_pipelining_client_gets_replies_in_order_and_each_read_sees_the_writes_before_it() {
    pipelining(coord_cluster());
}

#[test]
fn with_local_reads_a_pipelining_client_still_reads_its_own_writes() {
    pipelining(coord_cluster_local_reads());
}

fn pipelining((_c, fronts): (Cluster, Vec<SocketAddr>)) {
    use keel_coord::jute::{Reader, Writer};
    use keel_coord::proto::Acl;
    let mut client = RawClient::connect(fronts[1], 10_000);
    let mut requests = Vec::new();
    // create /pipe; then 40 x (setData /pipe i; getData /pipe), all sent before any reply.
    let mut w = Writer::new();
    w.string("/pipe").buffer(b"start");
    Acl::write_all(&Acl::open(), &mut w);
    w.int(0);
    // (opcode, body, for a read: the data it must see)
    requests.push((1i32, w.into_bytes(), None));
    let get = || {
        let mut get = Writer::new();
        get.string("/pipe").bool(false);
        get.into_bytes()
    };
    for i in 0..40 {
        let mut set = Writer::new();
        set.string("/pipe").buffer(format!("v{i}").as_bytes()).int(-1);
        requests.push((5, set.into_bytes(), None));
        requests.push((4, get(), Some(format!("v{i}").into_bytes())));
    }
    // Then runs of reads with a write behind them: with quorum reads the reads ride in
    // the write's command, before it, and must not see it.
    let mut last = b"v39".to_vec();
    for i in 0..20 {
        let now = format!("w{i}").into_bytes();
        let mut set = Writer::new();
        set.string("/pipe").buffer(&now).int(-1);
        requests.push((4, get(), Some(last.clone())));
        requests.push((4, get(), Some(last.clone())));
        requests.push((5, set.into_bytes(), None));
        requests.push((4, get(), Some(now.clone())));
        last = now;
    }
    // Then 200 KiB and three reads of it: with quorum reads they ride in the write's
    // command, and the third, for which its 512 KiB reply budget has no room, goes again
    // alone, in its turn.
    let big = vec![b'B'; 200 * 1024];
    let mut set = Writer::new();
    set.string("/pipe").buffer(&big).int(-1);
    requests.push((5, set.into_bytes(), None));
    for _ in 0..3 {
        requests.push((4, get(), Some(big.clone())));
    }
    // And three reads of it before a write: the third has no room, so the cluster holds
    // back the write after it too, and the front end sends both again, in order. (The
    // 64 exists fill a batch of their own, so the three start the next run, with the
    // write behind them.)
    for _ in 0..64 {
        let mut exists = Writer::new();
        exists.string("/pipe").bool(false);
        requests.push((3, exists.into_bytes(), None));
    }
    for _ in 0..3 {
        requests.push((4, get(), Some(big.clone())));
    }
    let mut set = Writer::new();
    set.string("/pipe").buffer(b"after").int(-1);
    requests.push((5, set.into_bytes(), None));
    requests.push((4, get(), Some(b"after".to_vec())));
    for (i, (opcode, body, _)) in requests.iter().enumerate() {
        let mut frame = (i as i32 + 1).to_be_bytes().to_vec();
        frame.extend_from_slice(&opcode.to_be_bytes());
        frame.extend_from_slice(body);
        client.stream.write_all(&framed(&frame)).expect("written");
    }
    for (i, (_, _, expect)) in requests.iter().enumerate() {
        let reply = read_frame(&mut client.stream);
        let xid = i32::from_be_bytes(reply[0..4].try_into().expect("xid"));
        assert_eq!(xid, i as i32 + 1, "replies in request order");
        assert_eq!(&reply[12..16], &0i32.to_be_bytes(), "request {xid} failed");
        if let Some(expect) = expect {
            let data = Reader::new(&reply[16..]).buffer().expect("data");
            assert!(
                data == *expect,
                "request {xid}: the read sees the last write before it and no later one ({} bytes)",
                data.len()
            );
        }
    }
}

/// `keel coord-shim` on a free port for the cluster in `dir`, stopped with its handle.
struct Shim {
    child: std::process::Child,
    addr: SocketAddr,
}

impl Shim {
    fn start(dir: &std::path::Path) -> Shim {
        let port = keel_runtime::provision::free_ports(1).expect("a free port");
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("address");
        let child = Command::new(support::KEEL)
            .args(["coord-shim", "--dir"])
            .arg(dir)
            .args(["--listen", &addr.to_string()])
            .stderr(Stdio::null())
            .spawn()
            .expect("coord-shim starts");
        let started = Instant::now();
        while four_letter(addr, "ruok").as_deref() != Some("imok") {
            assert!(started.elapsed() < Duration::from_secs(30), "coord-shim never answered");
            std::thread::sleep(Duration::from_millis(100));
        }
        Shim { child, addr }
    }
}

impl Drop for Shim {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn through_coord_shim_kazoo_works_and_keeps_working_when_a_node_dies() {
    let (mut c, fronts) = coord_cluster();
    let shim = Shim::start(c.path());
    // The shim names itself as the only server: a client that follows the config
    // (Curator's ensemble tracker) stays behind the shim instead of moving to one node.
    let read_config = format!(
        "from kazoo.client import KazooClient as K; z = K('{}'); z.start(); \
         print(z.get('/zookeeper/config')[0].decode()); z.stop()",
        shim.addr
    );
    let config = run(Command::new("python3").args(["-c", &read_config]), "config read", Duration::from_secs(60));
    let servers: Vec<&str> = config.lines().filter(|l| l.starts_with("server.")).collect();
    assert_eq!(servers.len(), 1, "{config}");
    assert!(servers[0].ends_with(&format!(";{}", shim.addr)), "{config}");
    assert!(fronts.iter().all(|f| !config.contains(&f.to_string())), "{config}");
    let kazoo = |what: &str| {
        let out = run(
            Command::new("python3").arg(clients_dir().join("kazoo_scenarios.py")).arg(shim.addr.to_string()),
            what,
            Duration::from_secs(240),
        );
        assert!(out.contains("all kazoo scenarios passed"), "{out}");
    };
    kazoo("kazoo through the shim");
    let mntr = four_letter(shim.addr, "mntr").expect("mntr");
    assert!(mntr.contains("zk_server_state\tkeel"), "{mntr}");
    // A node (the first primary) dies: the shim's client needs only the others.
    c.kill(0);
    kazoo("kazoo through the shim with node 0 down");
}

#[test]
fn a_total_outage_longer_than_the_session_timeout_loses_no_session_or_data() {
    let (mut c, fronts) = coord_cluster();
    let mut client = RawClient::connect(fronts[0], 6_000);
    assert_eq!(client.create_ephemeral("/survivor"), 0);
    let (session, password) = (client.session, client.password.clone());
    drop(client);
    // Every node killed at once, down for longer than the session's timeout.
    c.kill_all();
    std::thread::sleep(Duration::from_secs(9));
    c.start_all();
    let (_c, fronts) = ready(c);
    // The client comes back within a timeout of the cluster's return: it keeps its session
    // and its ephemeral (ZooKeeper gives sessions a new timeout when a leader is elected).
    let mut back = RawClient::attach(fronts[2], 6_000, session, &password).expect("the session survived the outage");
    assert_eq!(back.exists("/survivor"), 0, "its ephemeral is still there");
}

/// A session's password is a secret of the client and the front ends it connected
/// through (no node can attach a session it was not shown): each move hands the client a
/// new one, and the old one stops attaching once the client has spoken through its new
/// front end; until then (its ConnectResponse may have been lost) the old one still works.
#[test]
fn each_move_gives_the_client_a_new_password_and_retires_the_old_once_it_spoke() {
    let (_c, fronts) = coord_cluster();
    let mut first = RawClient::connect(fronts[0], 6_000);
    assert_eq!(first.create_ephemeral("/moving"), 0);
    let (session, p0) = (first.session, first.password.clone());
    drop(first);
    let mut second = RawClient::attach(fronts[1], 6_000, session, &p0).expect("moved with its password");
    let p1 = second.password.clone();
    assert_eq!(p1.len(), 16);
    assert_ne!(p1, p0, "a move hands out a new password");
    assert_eq!(second.exists("/moving"), 0, "the client spoke through its new front end");
    // That front end touches the session within a second: the move is confirmed.
    std::thread::sleep(Duration::from_secs(4));
    assert!(RawClient::attach(fronts[2], 6_000, session, &p0).is_none(), "the old password no longer attaches");
    let third = RawClient::attach(fronts[2], 6_000, session, &p1).expect("the current password attaches");
    let p2 = third.password.clone();
    drop(third);
    // A move whose ConnectResponse the client never read: it comes back with the
    // password it holds.
    let lost = RawClient::attach(fronts[3], 6_000, session, &p2).expect("moved again");
    drop(lost);
    let mut back = RawClient::attach(fronts[0], 6_000, session, &p2).expect("the unconfirmed move left p2 good");
    assert_eq!(back.exists("/moving"), 0, "its ephemeral lived through every move");
}

/// A lying node's front end knows every session id and sees every ordered command; to
/// the service a front end is a client identity, so one of the cluster's client
/// identities plays it here, over the same TLS connections. It cannot attach a session
/// it was not shown the password of, and its touches keep nothing alive: the
/// ephemeral of a client that left goes within a few of its timeouts.
#[test]
fn a_lying_front_end_can_neither_take_a_session_nor_keep_it_alive() {
    use keel_coord::coord::{Command as Zk, Reply};
    use keel_coord::session_key::SessionSecret;
    use keel_runtime::client::BlockingClient;
    use keel_runtime::config::ClientFile;
    let (c, fronts) = coord_cluster();
    let mut victim = RawClient::connect(fronts[0], 4_000);
    assert_eq!(victim.create_ephemeral("/held"), 0);
    let session = victim.session;
    let liar_id = 1002;
    let setup = ClientFile::load(&c.path().join(format!("client-{liar_id}/client.toml"))).expect("client file");
    let mut liar = BlockingClient::connect(setup).expect("the liar connects");
    let mut call = |command: Zk| {
        let reply = liar.invoke(command.encode(), Duration::from_secs(30)).expect("ordered");
        Reply::decode(&reply).expect("a coord reply")
    };
    let next = SessionSecret::random().verifier();
    let proof = SessionSecret::random().prove(session, liar_id, &next);
    let forged = Zk::Attach { session, proof, next, timeout: 40_000, ip: "10.6.6.6".into() };
    assert_eq!(call(forged), Reply::Refused { err: keel_coord::proto::err::SESSION_EXPIRED });
    // The client goes away; the liar keeps telling the cluster it hears from it.
    drop(victim);
    let mut watcher = RawClient::connect(fronts[1], 20_000);
    let left = Instant::now();
    while watcher.exists("/held") == 0 {
        assert!(call(Zk::Touch { sessions: vec![session] }) == Reply::Done);
        // Its front end touches it for one timeout after its last frame, then it expires
        // a timeout later at the next tick: about 8 s.
        assert!(left.elapsed() < Duration::from_secs(30), "the ephemeral outlived its client while a liar touched it");
        std::thread::sleep(Duration::from_millis(300));
    }
    eprintln!("the ephemeral went {:?} after its client left", left.elapsed());
}

/// A node whose data tree silently goes wrong (`[faults] lose_request_after_ms`: one
/// request executed as if it were not there) is found out at the next checkpoint (its
/// root differs from the certified one), says so in its log, its metrics and `keel
/// status`, and repairs itself by state transfer; clients go on being served, and its
/// later checkpoints agree again.
#[test]
fn a_node_whose_data_tree_goes_wrong_is_detected_and_repaired_by_state_transfer() {
    let faulty = 2;
    let c = Cluster::init_full(1, 1, &["--service", "coord", "--checkpoint-interval", "64"], "", |i| {
        (i == faulty).then_some("[faults]\nlose_request_after_ms = 3000")
    });
    let (c, fronts) = ready(c);
    let mut client = RawClient::connect(fronts[0], 10_000);
    let divergences = |c: &Cluster| c.status(faulty).map_or(0, |s| s.divergences);
    let started = Instant::now();
    let mut created = 0;
    // Writes until the lost one shows at a checkpoint (past 3 s, then up to 64 more
    // instances).
    while divergences(&c) == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "no divergence reported; node {faulty}:\n{}",
            c.log(faulty)
        );
        let (err, _) = client.create_persistent(&format!("/d{created}"));
        assert_eq!(err, 0, "create /d{created}");
        created += 1;
    }
    let log = c.log(faulty);
    assert!(log.contains("fault injection: this request is lost"), "{log}");
    assert!(log.contains("this node's state diverged: its checkpoint"), "{log}");
    // Repaired: it transfers the certified state, then checkpoints like the others.
    let repaired = Instant::now();
    while !c.log(faulty).contains("state transfer done") {
        assert!(repaired.elapsed() < Duration::from_secs(30), "no repair; node {faulty}:\n{}", c.log(faulty));
        std::thread::sleep(Duration::from_millis(100));
    }
    let at = c.status(faulty).and_then(|s| s.diverged_at).expect("the checkpoint is reported");
    for i in 0..200 {
        assert_eq!(client.create_persistent(&format!("/after{i}")).0, 0);
    }
    let later = Instant::now();
    while c.status(faulty).map_or(0, |s| s.stable) < at + 128 {
        assert!(later.elapsed() < Duration::from_secs(30), "node {faulty} stopped checkpointing");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(divergences(&c), 1, "its checkpoints after the repair agree with the certified ones");
    assert!(support::metric(&c.metrics(faulty), "keel_divergences_total") == 1);
    let status = Command::new(support::KEEL).arg("status").env("KEEL_DIR", c.path()).output().expect("keel status");
    let table = String::from_utf8_lossy(&status.stdout);
    assert!(
        table.lines().any(|l| l.starts_with(&format!("{faulty}\t"))
            && l.contains(&format!("its state diverged at checkpoint {at} and was repaired"))),
        "{table}"
    );
    // Every create is there, read through the faulty node's own front end.
    let mut reader = RawClient::connect(fronts[faulty], 10_000);
    for i in 0..created {
        assert_eq!(reader.exists(&format!("/d{i}")), 0, "/d{i}");
    }
}

/// A coord cluster backed up and restored into a new one (`keel admin backup`, `keel
/// init --restore`): the znodes are there, read through the new cluster's front ends,
/// and `/zookeeper/config` lists the new cluster's client ports.
#[test]
fn a_coord_backup_restores_into_a_new_cluster() {
    let (mut old, fronts) = coord_cluster();
    let mut client = RawClient::connect(fronts[0], 10_000);
    for i in 0..20 {
        assert_eq!(client.create_persistent(&format!("/kept{i}")).0, 0);
    }
    drop(client);
    let files = tempfile::tempdir().expect("tempdir");
    let file = files.path().join("coord.keel");
    let said = old.admin(&["backup", "--out", file.to_str().expect("utf-8")]).expect("backup");
    assert!(said.contains("backed up the coord state"), "{said}");
    old.kill_all();
    let (new, fronts) = ready(Cluster::init_args(1, 1, &["--restore", file.to_str().expect("utf-8")]));
    let mut reader = RawClient::connect(fronts[3], 10_000);
    for i in 0..20 {
        assert_eq!(reader.exists(&format!("/kept{i}")), 0, "/kept{i} restored");
    }
    assert_eq!(reader.create_persistent("/new").0, 0, "the restored cluster takes writes");
    let expected: Vec<String> = fronts.iter().map(|a| a.to_string()).collect();
    let started = Instant::now();
    while reader.config_servers() != expected {
        reader.ping();
        assert!(started.elapsed() < Duration::from_secs(40), "config: {:?}", reader.config_servers());
        std::thread::sleep(Duration::from_millis(500));
    }
    drop(new);
}

#[test]
fn a_request_too_large_for_one_command_gets_badarguments_and_the_connection_stays() {
    use keel_coord::jute::Writer;
    use keel_coord::proto::Acl;
    let (_c, fronts) = coord_cluster();
    let mut c = RawClient::connect(fronts[0], 10_000);
    let create = |c: &mut RawClient, path: &str, len: usize| {
        let mut w = Writer::new();
        w.string(path).buffer(&vec![7u8; len]);
        Acl::write_all(&Acl::open(), &mut w);
        w.int(0);
        c.request(1, &w.into_bytes()).0
    };
    // Under ZooKeeper's frame limit (1 MiB + 1 KiB) all three, but the last two do not
    // fit Keel's 1 MiB bound on an operation once wrapped in a command.
    assert_eq!(create(&mut c, "/fits", 1_048_000), 0, "a 1,048,000-byte node");
    assert_eq!(create(&mut c, "/over", 1_048_560), -8, "BADARGUMENTS");
    assert_eq!(create(&mut c, "/over", 1_048_576), -8, "BADARGUMENTS");
    assert_eq!(c.create_persistent("/after").0, 0, "the connection goes on");
    let mntr = four_letter(fronts[0], "mntr").expect("mntr");
    assert!(mntr.contains("zk_too_large_requests\t2\n"), "{mntr}");
}

/// Opens a connection and sends a ConnectRequest for a new session by a client that has
/// seen `last_zxid_seen`.
fn handshake(addr: SocketAddr, last_zxid_seen: i64) -> TcpStream {
    use keel_coord::jute::Writer;
    let mut stream = TcpStream::connect(addr).expect("connects");
    let mut w = Writer::new();
    w.int(0).long(last_zxid_seen).int(10_000).long(0).buffer(&[0; 16]).bool(false);
    stream.write_all(&framed(&w.into_bytes())).expect("written");
    stream
}

/// A frame, or None once the connection closed (or `limit` passed without one).
fn frame_within(s: &mut TcpStream, limit: Duration) -> Option<Vec<u8>> {
    s.set_read_timeout(Some(limit)).expect("timeout");
    let mut len = [0u8; 4];
    s.read_exact(&mut len).ok()?;
    let mut body = vec![0u8; u32::from_be_bytes(len) as usize];
    s.read_exact(&mut body).ok()?;
    Some(body)
}

/// Whether the other end closed the connection within `limit` without sending anything
/// (false if it sent bytes, or stayed open and silent).
fn closed_within(s: &mut TcpStream, limit: Duration) -> bool {
    s.set_read_timeout(Some(limit)).expect("timeout");
    let mut byte = [0u8; 1];
    matches!(s.read(&mut byte), Ok(0))
}

/// The ConnectResponse carries ZooKeeper's fields (protocol version 0, the negotiated
/// timeout, a session id, a 16-byte password, readOnly false); a client that has seen a
/// later zxid than the node holds (with `reads = "local"`) gets its response only once
/// the node caught up, or a closed connection; an auth packet of an unknown scheme gets
/// AUTH_FAILED and the connection closes, as ZooKeeper does.
#[test]
fn the_handshake_waits_for_a_client_ahead_of_the_node_and_a_failed_auth_closes_the_connection() {
    use keel_coord::jute::{Reader, Writer};
    let (_c, fronts) = coord_cluster_local_reads();
    let mut writer = RawClient::connect(fronts[1], 10_000);
    assert_eq!(writer.create_persistent("/seen").0, 0);
    let seen = writer.zxid;
    assert!(seen > 0, "a create reports its zxid");

    // Every field of the response, as a Java client reads it.
    let mut plain = handshake(fronts[0], seen);
    let response = frame_within(&mut plain, Duration::from_secs(30)).expect("a ConnectResponse");
    let mut r = Reader::new(&response);
    assert_eq!(r.int().expect("protocolVersion"), 0);
    assert_eq!(r.int().expect("timeOut"), 10_000);
    assert_ne!(r.long().expect("sessionId"), 0);
    assert_eq!(r.buffer().expect("passwd").len(), 16);
    assert!(!r.bool().expect("readOnly"), "never a read-only server");
    assert_eq!(r.remaining(), 0, "nothing after readOnly");

    // Ahead of everyone by the new session's own transaction and two more: no answer
    // until they happened.
    assert_eq!(writer.create_persistent("/mark").0, 0);
    let mut ahead = handshake(fronts[0], writer.zxid + 3);
    assert!(frame_within(&mut ahead, Duration::from_millis(1_500)).is_none(), "answered before catching up");
    assert_eq!(writer.create_persistent("/one").0, 0);
    assert_eq!(writer.create_persistent("/two").0, 0);
    let response = frame_within(&mut ahead, Duration::from_secs(30)).expect("answered once caught up");
    let mut r = Reader::new(&response);
    assert_eq!((r.int().expect("version"), r.int().expect("timeout")), (0, 10_000), "a session");
    // Far ahead (a client of another cluster, or a lie): closed once the wait times out.
    let mut lost = handshake(fronts[0], seen + 1_000_000);
    assert!(closed_within(&mut lost, Duration::from_secs(30)), "closed without a session");

    // Auth: digest works and the connection stays; an unknown scheme fails and closes.
    let mut c = RawClient::connect(fronts[0], 10_000);
    let auth = |c: &mut RawClient, scheme: &str| -> Option<i32> {
        let mut w = Writer::new();
        w.int(-4).int(100).int(0).string(scheme).buffer(b"user:secret");
        c.stream.write_all(&framed(&w.into_bytes())).expect("written");
        let reply = frame_within(&mut c.stream, Duration::from_secs(30))?;
        assert_eq!(i32::from_be_bytes(reply[0..4].try_into().expect("xid")), -4, "the auth xid");
        Some(i32::from_be_bytes(reply[12..16].try_into().expect("err")))
    };
    assert_eq!(auth(&mut c, "digest"), Some(0));
    assert_eq!(c.exists("/seen"), 0, "the connection goes on after a good auth");
    assert_eq!(auth(&mut c, "kerberos-ish"), Some(-115), "AUTH_FAILED");
    // At once: a silent connection is closed anyway after the session timeout (10 s).
    assert!(closed_within(&mut c.stream, Duration::from_secs(3)), "closed after AUTH_FAILED");
}

/// With quorum reads (the default) nothing a node holds is read by the client, so a
/// client that has seen more than the node is answered at once.
#[test]
fn with_quorum_reads_a_client_ahead_of_the_node_is_answered_at_once() {
    let (_c, fronts) = coord_cluster();
    let mut ahead = handshake(fronts[0], 1_000_000);
    let response = frame_within(&mut ahead, Duration::from_secs(30)).expect("a ConnectResponse");
    assert_eq!(i32::from_be_bytes(response[4..8].try_into().expect("timeout")), 10_000, "a session");
}
