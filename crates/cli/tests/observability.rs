//! What a monitoring system meets on a node's metrics port: `/metrics` parsed by the
//! Prometheus project's own parsers (prometheus_client from PyPI, installed by
//! `scripts/install-test-clients`) in both formats, with the right content types;
//! `/health`; `/ready` turning 503 when the node can no longer reach a quorum. A block
//! cluster, so the service's own metrics (`NodeBuilder::report`) are parsed too.

mod support;

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};
use support::Cluster;

/// (status code, content type, body) of GET `path` with `accept`; a port that does not
/// listen yet (a node starting) is retried for 30 s.
fn get(addr: &str, path: &str, accept: &str) -> (u16, String, String) {
    let started = Instant::now();
    let mut s = loop {
        match std::net::TcpStream::connect(addr) {
            Ok(s) => break s,
            Err(e) if started.elapsed() < Duration::from_secs(30) => {
                eprintln!("{addr}: {e}; retrying");
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => panic!("metrics port {addr}: {e}"),
        }
    };
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    write!(s, "GET {path} HTTP/1.0\r\nHost: keel\r\nAccept: {accept}\r\n\r\n").expect("request");
    let mut raw = String::new();
    s.read_to_string(&mut raw).expect("response");
    let (head, body) = raw.split_once("\r\n\r\n").expect("headers end");
    let code = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).expect("status code");
    let ctype = head
        .lines()
        .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-type:").map(|v| v.trim().to_string()))
        .unwrap_or_default();
    (code, ctype, body.to_string())
}

fn metrics_addr(c: &Cluster, i: usize) -> String {
    let text = std::fs::read_to_string(c.path().join(format!("node-{i}/node.toml"))).expect("node file");
    let line = text.lines().find(|l| l.starts_with("metrics")).expect("metrics address");
    line.split('"').nth(1).expect("quoted").to_string()
}

/// Runs the Prometheus parser on `text`; Ok(summary) or Err(the parser's complaint).
fn parse(kind: &str, text: &str, dir: &std::path::Path) -> Result<String, String> {
    let file = dir.join(format!("metrics-{kind}.txt"));
    std::fs::write(&file, text).expect("written");
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/clients/parse_metrics.py");
    let out = Command::new("python3").arg(script).arg(kind).arg(&file).output().expect("python3 runs");
    let said = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        Ok(said)
    } else {
        Err(said)
    }
}

#[test]
fn metrics_parse_with_prometheus_parsers_and_ready_follows_the_quorum() {
    let mut c = Cluster::init_args(1, 1, &["--service", "block", "--size", "16M"]);
    let addr = metrics_addr(&c, 0);
    let started = Instant::now();
    loop {
        let (code, _, body) = get(&addr, "/ready", "*/*");
        if code == 200 {
            assert!(body.starts_with("ready"), "{body}");
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(60), "never ready: {body}");
        std::thread::sleep(Duration::from_millis(200));
    }
    // Some block traffic first, so the service's counters are not all zero.
    let front = c.front_ends()[0];
    let out = Command::new("qemu-io")
        .args(["-f", "raw", &format!("nbd://{front}"), "-c", "write -P 0x11 0 65536", "-c", "read -P 0x11 0 65536"])
        .output()
        .expect("qemu-io runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    let (code, ctype, om) =
        get(&addr, "/metrics", "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1");
    assert_eq!(code, 200);
    assert_eq!(ctype, "application/openmetrics-text; version=1.0.0; charset=utf-8");
    let summary = parse("openmetrics", &om, c.path())
        .unwrap_or_else(|e| panic!("OpenMetrics parser refused /metrics: {e}\n{om}"));
    eprintln!("openmetrics: {summary}");
    for name in [
        "keel_decided_total",
        "process_cpu_seconds_total",
        "process_resident_memory_bytes",
        "keel_block_nbd_writes_total",
        "keel_block_incomplete_blocks",
        // Per node that acknowledged the write's PrepareData: a histogram.
        "keel_block_prepare_ack_seconds_bucket{",
        // The front end's in-process client: the library's latency histogram.
        "keel_client_invoke_seconds_bucket{",
    ] {
        assert!(om.lines().any(|l| l.starts_with(name)), "{name} missing");
    }
    let (code, ctype, text) = get(&addr, "/metrics", "text/plain");
    assert_eq!(code, 200);
    assert_eq!(ctype, "text/plain; version=0.0.4; charset=utf-8");
    assert!(!text.contains("# EOF"));
    parse("prometheus", &text, c.path())
        .unwrap_or_else(|e| panic!("Prometheus text parser refused /metrics: {e}\n{text}"));
    // The checks can fail: the same text without its "# EOF", or with a sample whose
    // value is not a number, is refused.
    let cut = om.trim_end().trim_end_matches("# EOF");
    assert!(parse("openmetrics", cut, c.path()).is_err(), "a missing # EOF must be refused");
    let broken = om.replacen("keel_decided_total ", "keel_decided_total x", 1);
    assert!(parse("openmetrics", &broken, c.path()).is_err(), "a bad sample must be refused");
    let broken = text.replacen("keel_decided_total ", "keel_decided_total{oops ", 1);
    assert!(parse("prometheus", &broken, c.path()).is_err(), "a bad label set must be refused");

    let (code, _, body) = get(&addr, "/health", "*/*");
    assert_eq!((code, body.as_str()), (200, "ok\n"));

    // Two of four nodes gone: node 0 can no longer reach a quorum of 3.
    c.kill(2);
    c.kill(3);
    let started = Instant::now();
    loop {
        let (code, _, body) = get(&addr, "/ready", "*/*");
        if code == 503 {
            assert!(body.contains("quorum"), "{body}");
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(30), "still ready without a quorum: {body}");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(get(&addr, "/health", "*/*").0, 200, "alive, though not ready");
    // A log file is plain text: no terminal colour codes.
    let log = c.log(0);
    assert!(log.contains("node started"), "{log}");
    assert!(!log.contains('\u{1b}'), "ANSI escape codes in a log file");
}
