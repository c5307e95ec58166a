//! `keel kv`: the KV service's command line client.

use clap::{Args, Subcommand};
use keel_core::client::Pushed;
use keel_core::message::ReadConsistency;
use keel_kv::{KvEvent, KvRequest, KvResponse};
use keel_runtime::client::{BlockingClient, KeelClient};
use keel_runtime::config::{ClientFile, ClientSetup};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct KvArgs {
    /// A cluster directory made by `keel init`.
    #[arg(long)]
    dir: PathBuf,
    /// Which client identity to use (a client-<ID> directory). Default: the first that no
    /// other process is using.
    #[arg(long)]
    client: Option<u64>,
    /// Give up after this many seconds (1 to 86400).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    timeout: u64,
    #[command(subcommand)]
    op: KvOp,
}

#[derive(Subcommand, Debug)]
enum KvOp {
    Put {
        key: String,
        value: String,
    },
    Get {
        key: String,
        #[command(flatten)]
        read: ReadArgs,
    },
    Del {
        key: String,
    },
    /// Set NEW if the value is EXPECTED ("-" for absent).
    Cas {
        key: String,
        expected: String,
        new: String,
    },
    Scan {
        prefix: String,
        #[arg(long, default_value_t = 100)]
        limit: u32,
        #[command(flatten)]
        read: ReadArgs,
    },
    /// Print every later write of a key that starts with PREFIX ("put KEY VALUE" or
    /// "del KEY", tab-separated) until Ctrl-C. If events were lost, says so and prints the
    /// prefix's current entries ("now KEY VALUE") before going on. The watch is a 60 s
    /// lease, renewed every 20 s while this runs.
    Watch {
        prefix: String,
        /// Stop after this many events.
        #[arg(long)]
        count: Option<u64>,
    },
}

/// How a get or scan reads (ARCHITECTURE §7). Default: ordered like a write.
#[derive(Args, Debug, Clone, Copy)]
struct ReadArgs {
    /// Read without ordering: every node answers from its state and the result stands on
    /// a quorum of matching answers (linearizable); on a mismatch the read is ordered.
    #[arg(long)]
    read_only: bool,
    /// With --read-only: r + 1 matching answers that reflect this client's own writes,
    /// possibly not others' latest (serializable; cheaper, still consistent).
    #[arg(long, requires = "read_only")]
    serializable: bool,
    /// Read index: r + 1 nodes each learn from a quorum how far they voted to accept,
    /// wait until they executed that far, and answer (linearizable; one node's work in
    /// CFT). On a mismatch or timeout the read is ordered.
    #[arg(long, conflicts_with = "read_only")]
    read_index: bool,
}

impl ReadArgs {
    fn consistency(self) -> Option<ReadConsistency> {
        match (self.read_only, self.serializable, self.read_index) {
            (_, _, true) => Some(ReadConsistency::Index),
            (false, _, false) => None,
            (true, false, false) => Some(ReadConsistency::Linearizable),
            (true, true, false) => Some(ReadConsistency::Serializable),
        }
    }
}

pub fn run(a: KvArgs) -> ExitCode {
    let (id, _identity) = match crate::identity::claim(&a.dir, a.client) {
        Ok(claimed) => claimed,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let path = a.dir.join(format!("client-{id}")).join("client.toml");
    let setup = match ClientFile::load(&path) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let mut read = None;
    let timeout = Duration::from_secs(a.timeout);
    let req = match a.op {
        KvOp::Watch { prefix, count } => return watch(setup, prefix.into_bytes(), count, timeout),
        KvOp::Put { key, value } => KvRequest::Put { key: key.into_bytes(), value: value.into_bytes() },
        KvOp::Get { key, read: how } => {
            read = how.consistency();
            KvRequest::Get { key: key.into_bytes() }
        }
        KvOp::Del { key } => KvRequest::Delete { key: key.into_bytes() },
        KvOp::Cas { key, expected, new } => KvRequest::Cas {
            key: key.into_bytes(),
            expected: (expected != "-").then(|| expected.into_bytes()),
            new: new.into_bytes(),
        },
        KvOp::Scan { prefix, limit, read: how } => {
            read = how.consistency();
            KvRequest::Scan { prefix: prefix.into_bytes(), limit }
        }
    };
    let mut client = match BlockingClient::connect(setup) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = match read {
        None => client.invoke(req.encode(), timeout),
        Some(consistency) => client.invoke_read_only(req.encode(), consistency, timeout),
    };
    let bytes = match result {
        Ok(b) => b,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    match KvResponse::decode(&bytes) {
        Ok(KvResponse::Value(Some(v))) => println!("{}", String::from_utf8_lossy(&v)),
        Ok(KvResponse::Value(None)) => {
            eprintln!("(absent)");
            return ExitCode::from(1);
        }
        Ok(KvResponse::Done) => println!("ok"),
        Ok(KvResponse::Swapped(true)) => println!("swapped"),
        Ok(KvResponse::Swapped(false)) => {
            println!("not swapped");
            return ExitCode::from(1);
        }
        Ok(KvResponse::Entries(entries)) => {
            for (k, v) in entries {
                println!("{}\t{}", String::from_utf8_lossy(&k), String::from_utf8_lossy(&v));
            }
        }
        Ok(KvResponse::Error(e)) => {
            eprintln!("error from the service: {e}");
            return ExitCode::FAILURE;
        }
        Err(e) => {
            eprintln!("error: undecodable result: {e}");
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}

/// `keel kv watch`: registers the watch, then prints push events as they arrive.
fn watch(setup: ClientSetup, prefix: Vec<u8>, count: Option<u64>, timeout: Duration) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        let client = match KeelClient::connect(setup) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        };
        let Some(mut events) = client.push_events() else {
            eprintln!("error: push events already taken");
            return ExitCode::FAILURE;
        };
        let watch = KvRequest::Watch { prefix: prefix.clone(), lease_ms: keel_kv::WATCH_LEASE_DEFAULT_MS }.encode();
        let registered = client.invoke(watch.clone(), timeout).await;
        match registered.map(|b| KvResponse::decode(&b)) {
            Ok(Ok(KvResponse::Done)) => {}
            Ok(Ok(KvResponse::Error(e))) => {
                eprintln!("error from the service: {e}");
                return ExitCode::FAILURE;
            }
            Ok(other) => {
                eprintln!("error: unexpected answer to the watch: {other:?}");
                return ExitCode::FAILURE;
            }
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        }
        eprintln!("watching {:?} (Ctrl-C to stop)", String::from_utf8_lossy(&prefix));
        let show = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        let mut seen = 0;
        // The watch is a lease: renewed well before it runs out.
        let mut renew = tokio::time::interval(Duration::from_millis(keel_kv::WATCH_LEASE_DEFAULT_MS / 3));
        renew.tick().await;
        while count.is_none_or(|c| seen < c) {
            let next = tokio::select! {
                e = events.recv() => e,
                _ = renew.tick() => {
                    if let Err(e) = client.invoke(watch.clone(), timeout).await {
                        eprintln!("warning: could not renew the watch: {e}");
                    }
                    continue;
                }
                _ = tokio::signal::ctrl_c() => None,
            };
            let Some((_, pushed)) = next else {
                break;
            };
            match pushed {
                Pushed::Event { event, .. } => match KvEvent::decode(&event) {
                    Ok(KvEvent { key, value: Some(v) }) => println!("put\t{}\t{}", show(&key), show(&v)),
                    Ok(KvEvent { key, value: None }) => println!("del\t{}", show(&key)),
                    Err(e) => eprintln!("warning: undecodable event: {e}"),
                },
                Pushed::Gap { first, last } => {
                    eprintln!("events {first}..={last} were lost; the current entries follow");
                    let scan = KvRequest::Scan { prefix: prefix.clone(), limit: keel_kv::SCAN_LIMIT_MAX };
                    let now = client.invoke_read_only(scan.encode(), ReadConsistency::Linearizable, timeout).await;
                    match now.map(|b| KvResponse::decode(&b)) {
                        Ok(Ok(KvResponse::Entries(entries))) => {
                            for (k, v) in entries {
                                println!("now\t{}\t{}", show(&k), show(&v));
                            }
                        }
                        other => eprintln!("warning: could not re-read the prefix: {other:?}"),
                    }
                }
            }
            seen += 1;
        }
        // Best effort: a watch left behind only costs the nodes some pushes nobody acks.
        let _ = client.invoke(KvRequest::Unwatch { prefix }.encode(), Duration::from_secs(2)).await;
        ExitCode::SUCCESS
    })
}
