//! The command line as an operator meets it (issue #25 items 3 and 4), against real
//! `keel node` processes: values from files and standard input, binary keys and values,
//! JSON output, paged scans, results too large for a reply, errors that name the nodes
//! a client could not reach, and `KEEL_DIR`.

mod support;

use std::io::Write;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};
use support::Cluster;

fn keel(cluster: &Cluster, args: &[&str]) -> Output {
    Command::new(support::KEEL).args(args).env("KEEL_DIR", cluster.path()).output().expect("keel runs")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Values through `--file` and standard input, byte for byte; a value over the bound
/// refused before anything is sent; binary keys in hex and base64; scan lines that stay
/// one entry per line whatever the keys hold; JSON that parses.
#[test]
fn values_and_keys_in_every_form_round_trip() {
    let cluster = Cluster::init(1, 1);
    let dir = tempfile::tempdir().expect("tempdir");

    // 900 KiB of binary data through --file, back through -o raw.
    let value: Vec<u8> = (0..900 * 1024u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    let file = dir.path().join("value.bin");
    std::fs::write(&file, &value).expect("value written");
    let put = keel(&cluster, &["kv", "--timeout", "30", "put", "big", "--file", file.to_str().expect("utf-8 path")]);
    assert!(put.status.success(), "{}", stderr(&put));
    let got = keel(&cluster, &["kv", "--timeout", "30", "-o", "raw", "get", "big"]);
    assert!(got.status.success(), "{}", stderr(&got));
    assert!(got.stdout == value, "900 KiB came back as {} bytes, not the same", got.stdout.len());

    // 10 MiB refused with what and why, and nothing written.
    let huge = dir.path().join("huge.bin");
    std::fs::write(&huge, vec![1u8; 10 << 20]).expect("huge written");
    let refused = keel(&cluster, &["kv", "put", "huge", "--file", huge.to_str().expect("utf-8 path")]);
    assert_eq!(refused.status.code(), Some(2), "{}", stderr(&refused));
    assert!(
        stderr(&refused).contains("has 10485760 bytes; one operation may carry at most 1048576 bytes"),
        "{}",
        stderr(&refused)
    );
    assert_eq!(keel(&cluster, &["kv", "get", "huge"]).status.code(), Some(1), "the refused value is absent");

    // Standard input.
    let mut child = Command::new(support::KEEL)
        .args(["kv", "put", "from-stdin", "--file", "-"])
        .env("KEEL_DIR", cluster.path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("keel kv put runs");
    child.stdin.take().expect("stdin").write_all(b"line one\nline two\n").expect("written");
    let put = child.wait_with_output().expect("put ends");
    assert!(put.status.success(), "{}", stderr(&put));
    let got = keel(&cluster, &["kv", "-o", "raw", "get", "from-stdin"]);
    assert_eq!(got.stdout, b"line one\nline two\n");

    // A key with a tab, a newline and a non-UTF-8 byte, given in hex, read in base64.
    let key = b"k\t1\n\xff";
    let put = keel(&cluster, &["kv", "--encoding", "hex", "put", &hex::encode(key), &hex::encode(b"v\tx")]);
    assert!(put.status.success(), "{}", stderr(&put));
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD;
    let got = keel(&cluster, &["kv", "--encoding", "base64", "get", &b64.encode(key)]);
    assert_eq!(stdout(&got).trim(), b64.encode(b"v\tx"));
    let bad = keel(&cluster, &["kv", "--encoding", "hex", "get", "zz"]);
    assert_eq!(bad.status.code(), Some(2));
    assert!(stderr(&bad).contains("the key is not hex"), "{}", stderr(&bad));
    // Text scan: one line per entry, tab and newline escaped.
    let scan = keel(&cluster, &["kv", "scan", "k"]);
    assert_eq!(stdout(&scan), "k\\t1\\n\\xff\tv\\tx\n");
    // JSON: text must be UTF-8 (told so otherwise); hex always works.
    let scan = keel(&cluster, &["kv", "-o", "json", "scan", "k"]);
    assert_eq!(scan.status.code(), Some(1));
    assert!(stderr(&scan).contains("is not UTF-8: use --encoding hex"), "{}", stderr(&scan));
    let scan = keel(&cluster, &["kv", "-o", "json", "--encoding", "hex", "scan", &hex::encode("k")]);
    let v: serde_json::Value = serde_json::from_str(&stdout(&scan)).expect("scan JSON parses");
    assert_eq!(v["entries"][0]["key"], hex::encode(key));
    assert_eq!(v["entries"][0]["value"], hex::encode(b"v\tx"));
    let got = keel(&cluster, &["kv", "-o", "json", "get", "from-stdin"]);
    let v: serde_json::Value = serde_json::from_str(&stdout(&got)).expect("get JSON parses");
    assert_eq!(v["value"], "line one\nline two\n");
    let absent = keel(&cluster, &["kv", "-o", "json", "get", "nothing"]);
    assert_eq!((absent.status.code(), stdout(&absent).trim()), (Some(1), r#"{"value":null}"#));

    // keel status -o json, from KEEL_DIR.
    let status = keel(&cluster, &["status", "-o", "json"]);
    assert!(status.status.success(), "{}", stderr(&status));
    let v: serde_json::Value = serde_json::from_str(&stdout(&status)).expect("status JSON parses");
    let nodes = v["nodes"].as_array().expect("nodes");
    assert_eq!(nodes.len(), 4);
    assert!(nodes.iter().all(|n| n["state"] == "normal" && n["executed"].as_u64() > Some(0)), "{v}");
}

/// A scan whose entries exceed what one reply carries comes a page at a time; a plain
/// `Scan` of them fails at once with "result too large" (issue #25: it used to wait out
/// the timeout with nothing logged).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_scans_page_and_oversized_results_fail_fast() {
    let cluster = Cluster::init(1, 1);
    // Not 1000: the `keel kv` processes below claim the first free identity, and two
    // users of one identity would reuse sequence numbers.
    let client = cluster.client(1007);
    let value = vec![b'x'; 300 * 1024];
    for i in 0..6 {
        let put = keel_kv::KvRequest::Put { key: format!("s/{i}").into_bytes(), value: value.clone() };
        client.invoke(put.encode(), support::OP_TIMEOUT).await.expect("put");
    }
    let scan = keel(&cluster, &["kv", "--timeout", "30", "scan", "s/", "--limit", "1000"]);
    assert!(scan.status.success(), "{}", stderr(&scan));
    let lines: Vec<String> = stdout(&scan).lines().map(|l| l.split('\t').next().unwrap_or("").to_string()).collect();
    assert_eq!(lines, (0..6).map(|i| format!("s/{i}")).collect::<Vec<_>>(), "1.8 MiB of entries over pages");
    // --limit still holds across pages.
    let two = keel(&cluster, &["kv", "scan", "s/", "--limit", "2"]);
    assert_eq!(stdout(&two).lines().count(), 2);

    let whole = keel_kv::KvRequest::Scan { prefix: b"s/".to_vec(), limit: 100 };
    for read in [None, Some(keel_core::message::ReadConsistency::Linearizable)] {
        let started = Instant::now();
        let err = client.invoke_as(whole.encode(), read, Duration::from_secs(20)).await.expect_err("too large");
        assert!(err.to_string().contains("more than the 1048576-byte limit on a reply; ask for less"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(10), "failed only after {:?}", started.elapsed());
    }
}

/// A client that cannot reach the cluster says which nodes it could not reach and why,
/// and which it could, within its timeout.
#[test]
fn a_cluster_that_is_down_is_named_in_the_error() {
    let mut cluster = Cluster::init(1, 1);
    cluster.kill_all();
    let started = Instant::now();
    let out = keel(&cluster, &["kv", "--timeout", "3", "get", "x"]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(started.elapsed() < Duration::from_secs(8), "took {:?}", started.elapsed());
    assert!(err.contains("no result within 3s; could not reach any node: node 0 (127.0.0.1:"), "{err}");
    for i in 0..4 {
        assert!(err.contains(&format!("node {i} (")), "node {i} not named: {err}");
    }
    assert!(err.to_lowercase().contains("connection refused"), "{err}");
    // The same with JSON logs: every log line is one JSON object.
    let out = Command::new(support::KEEL)
        .args(["--log-format", "json", "kv", "--timeout", "1", "get", "x"])
        .env("KEEL_DIR", cluster.path())
        .env("RUST_LOG", "info")
        .output()
        .expect("keel runs");
    let logs: Vec<serde_json::Value> = stderr(&out)
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).expect("a JSON log line"))
        .collect();
    assert!(
        logs.iter().any(|l| l["fields"]["message"].as_str().is_some_and(|m| m.starts_with("cannot reach node-"))),
        "{}",
        stderr(&out)
    );

    // Two of four up: too few for a result, and the error says who is missing.
    // Node 0 logs JSON: ids and positions are numbers there, not strings.
    cluster.start_with(0, &["--log-format", "json"]);
    cluster.start(1);
    let deadline = Instant::now() + Duration::from_secs(20);
    while cluster.status(0).is_none() || cluster.status(1).is_none() {
        assert!(Instant::now() < deadline, "nodes 0 and 1 did not start");
        std::thread::sleep(Duration::from_millis(100));
    }
    let log = cluster.log(0);
    let started: serde_json::Value = log
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|l| l["fields"]["message"] == "node started")
        .unwrap_or_else(|| panic!("no JSON 'node started' line in {log}"));
    for field in ["node", "index", "epoch", "view", "executed", "storage_ms", "service_ms", "recover_ms"] {
        assert!(started["fields"][field].is_u64(), "{field} is not a number: {started}");
    }
    // jemalloc's background thread runs (main.rs, `MALLOC_CONF`), so a node that goes
    // idle gives the memory it freed back to the system.
    let threads: Vec<String> = std::fs::read_dir(format!("/proc/{}/task", cluster.pid(0)))
        .expect("the node's threads")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .collect();
    assert!(threads.iter().any(|name| name.starts_with("jemalloc_bg_thd")), "{threads:?}");
    let out = keel(&cluster, &["kv", "--timeout", "3", "put", "x", "1"]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(err.contains("could not reach node 2 (") && err.contains("node 3 ("), "{err}");
    assert!(err.contains("connected to node 0, node 1"), "{err}");
}

/// `keel bench` takes identities no other process uses: beside a `keel kv watch` (which
/// holds the first free one) it runs on others without a single error, and asked for
/// more than are free it says so instead of sharing one.
#[test]
fn keel_bench_uses_only_free_client_identities() {
    let cluster = Cluster::init(1, 1);
    let mut watcher = support::identity_holder(cluster.path(), 1000);
    let bench = keel(&cluster, &["bench", "--clients", "3", "--duration", "1", "--no-baseline"]);
    let row = stdout(&bench).lines().find(|l| l.starts_with("cluster\t3\t")).map(String::from);
    let errors = row.as_deref().and_then(|r| r.split('\t').nth(6)).map(String::from);
    assert_eq!(errors.as_deref(), Some("0"), "{}{}", stdout(&bench), stderr(&bench));
    let refused = keel(&cluster, &["bench", "--clients", "8", "--duration", "1", "--no-baseline"]);
    let _ = watcher.kill();
    let _ = watcher.wait();
    assert!(!refused.status.success());
    assert!(stderr(&refused).contains("8 client identities needed, 7 of the 8"), "{}", stderr(&refused));
}
