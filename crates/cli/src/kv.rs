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
    #[arg(long, env = "KEEL_DIR")]
    dir: PathBuf,
    /// Which client identity to use (a client-<ID> directory). Default: the first that no
    /// other process is using.
    #[arg(long)]
    client: Option<u64>,
    /// Give up after this many seconds (1 to 86400).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    timeout: u64,
    /// How keys and values are written on the command line and printed: as text (UTF-8),
    /// or as hex or base64 for binary ones.
    #[arg(long, value_enum, default_value_t = Encoding::Text)]
    encoding: Encoding,
    /// Output: text (scan escapes tabs, newlines, backslashes and non-UTF-8 bytes as \t,
    /// \n, \\ and \xNN so that each entry is one line); json (one object: "key",
    /// "value", "entries", "ok", "swapped"); raw (get only: the value's bytes exactly, no
    /// newline, for binary values: `keel kv get K -o raw > FILE`).
    #[arg(short, long, value_enum, default_value_t = Output::Text)]
    output: Output,
    #[command(subcommand)]
    op: KvOp,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Encoding {
    Text,
    Hex,
    Base64,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Output {
    Text,
    Json,
    Raw,
}

#[derive(Subcommand, Debug)]
enum KvOp {
    /// Set KEY to VALUE (or to the contents of --file). Keys and values together may hold
    /// up to about 1 MiB.
    Put {
        /// The key (in --encoding).
        key: String,
        /// The value (in --encoding); omit it with --file.
        #[arg(required_unless_present = "file", conflicts_with = "file")]
        value: Option<String>,
        /// Read the value from this file ("-": standard input), byte for byte.
        #[arg(long)]
        file: Option<PathBuf>,
    },
    /// Print KEY's value; exit status 1 if the key is absent.
    Get {
        /// The key (in --encoding).
        key: String,
        #[command(flatten)]
        read: ReadArgs,
    },
    /// Delete KEY (no error if it was absent).
    Del {
        /// The key (in --encoding).
        key: String,
    },
    /// Set NEW if the value is EXPECTED ("-" for absent); exit status 1 if it was not.
    Cas {
        /// The key (in --encoding).
        key: String,
        /// The value the key must hold now (in --encoding), or "-" for absent.
        expected: String,
        /// The value to set (in --encoding).
        new: String,
    },
    /// Print the entries whose key starts with PREFIX, in key order ("KEY<tab>VALUE" per
    /// line). Results larger than a reply are fetched a page at a time.
    Scan {
        /// The key prefix (in --encoding; "" for every key).
        prefix: String,
        /// At most this many entries.
        #[arg(long, default_value_t = 100)]
        limit: u64,
        #[command(flatten)]
        read: ReadArgs,
    },
    /// Print every later write of a key that starts with PREFIX ("put KEY VALUE" or
    /// "del KEY", tab-separated) until Ctrl-C. If events were lost, says so and prints the
    /// prefix's current entries ("now KEY VALUE") before going on. The watch is a 60 s
    /// lease, renewed every 20 s while this runs.
    Watch {
        /// The key prefix (in --encoding).
        prefix: String,
        /// Stop after this many events.
        #[arg(long)]
        count: Option<u64>,
    },
}

/// How a get or scan reads: ordered like a write unless one of these says otherwise.
#[derive(Args, Debug, Clone, Copy)]
struct ReadArgs {
    /// Read without ordering: every node answers from its state and the result stands on
    /// a quorum of matching answers (linearizable); on a mismatch the read is ordered.
    #[arg(long)]
    read_only: bool,
    /// With --read-only: r + 1 matching answers that reflect this client session's own
    /// writes (each `keel kv` command is a new session), possibly not others' latest
    /// (serializable; cheaper, still consistent).
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

/// Key-value pairs in key order.
type Entries = Vec<(Vec<u8>, Vec<u8>)>;

/// A command-line failure: what to print and the exit status.
struct Failed(String, u8);

impl<E: std::fmt::Display> From<E> for Failed {
    fn from(e: E) -> Failed {
        Failed(format!("error: {e}"), 1)
    }
}

impl Encoding {
    fn decode(self, what: &str, s: &str) -> Result<Vec<u8>, Failed> {
        use base64::Engine;
        match self {
            Encoding::Text => Ok(s.as_bytes().to_vec()),
            Encoding::Hex => hex::decode(s).map_err(|e| Failed(format!("error: {what} is not hex: {e}"), 2)),
            Encoding::Base64 => base64::engine::general_purpose::STANDARD
                .decode(s)
                .map_err(|e| Failed(format!("error: {what} is not base64: {e}"), 2)),
        }
    }

    /// For JSON: a string in this encoding; text must be UTF-8.
    fn json(self, what: &str, b: &[u8]) -> Result<String, Failed> {
        use base64::Engine;
        match self {
            Encoding::Text => String::from_utf8(b.to_vec()).map_err(|_| {
                Failed(format!("error: a {what} is not UTF-8: use --encoding hex or --encoding base64"), 1)
            }),
            Encoding::Hex => Ok(hex::encode(b)),
            Encoding::Base64 => Ok(base64::engine::general_purpose::STANDARD.encode(b)),
        }
    }

    /// For a text line: hex or base64, or text with `\t`, `\n`, `\r`, `\\` and
    /// `\xNN` (bytes that are not UTF-8 or are control characters) escaped.
    fn line(self, b: &[u8]) -> String {
        match self {
            Encoding::Text => escape(b),
            other => other.json("", b).unwrap_or_default(),
        }
    }
}

fn escape(b: &[u8]) -> String {
    let mut out = String::with_capacity(b.len());
    for chunk in b.utf8_chunks() {
        for c in chunk.valid().chars() {
            match c {
                '\t' => out.push_str("\\t"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\\' => out.push_str("\\\\"),
                c if c.is_control() => {
                    let mut buf = [0u8; 4];
                    for byte in c.encode_utf8(&mut buf).bytes() {
                        out.push_str(&format!("\\x{byte:02x}"));
                    }
                }
                c => out.push(c),
            }
        }
        for byte in chunk.invalid() {
            out.push_str(&format!("\\x{byte:02x}"));
        }
    }
    out
}

pub fn run(a: KvArgs) -> ExitCode {
    match execute(a) {
        Ok(code) => code,
        Err(Failed(message, code)) => {
            eprintln!("{message}");
            ExitCode::from(code)
        }
    }
}

fn execute(a: KvArgs) -> Result<ExitCode, Failed> {
    let (id, _identity) = crate::identity::claim(&a.dir, a.client).map_err(|e| Failed(format!("error: {e}"), 2))?;
    let path = a.dir.join(format!("client-{id}")).join("client.toml");
    let setup = ClientFile::load(&path).map_err(|e| Failed(format!("error: {e}"), 2))?;
    let timeout = Duration::from_secs(a.timeout);
    let enc = a.encoding;
    if a.output == Output::Raw && !matches!(a.op, KvOp::Get { .. }) {
        return Err(Failed("error: -o raw is for get only".into(), 2));
    }
    let (req, read) = match a.op {
        KvOp::Watch { prefix, count } => {
            let prefix = enc.decode("the prefix", &prefix)?;
            return Ok(watch(setup, prefix, count, timeout, enc));
        }
        KvOp::Scan { prefix, limit, read } => {
            let prefix = enc.decode("the prefix", &prefix)?;
            let mut client = BlockingClient::connect(setup)?;
            let entries = scan(&mut client, prefix, limit, read.consistency(), timeout)?;
            print_entries(&entries, enc, a.output)?;
            return Ok(ExitCode::SUCCESS);
        }
        KvOp::Put { key, value, file } => {
            let key = enc.decode("the key", &key)?;
            let value = match (value, file) {
                (_, Some(path)) => read_value(&path)?,
                (Some(v), None) => enc.decode("the value", &v)?,
                (None, None) => return Err(Failed("error: give a VALUE or --file".into(), 2)),
            };
            (KvRequest::Put { key, value }, None)
        }
        KvOp::Get { key, read } => (KvRequest::Get { key: enc.decode("the key", &key)? }, read.consistency()),
        KvOp::Del { key } => (KvRequest::Delete { key: enc.decode("the key", &key)? }, None),
        KvOp::Cas { key, expected, new } => {
            let expected = if expected == "-" { None } else { Some(enc.decode("the expected value", &expected)?) };
            let req =
                KvRequest::Cas { key: enc.decode("the key", &key)?, expected, new: enc.decode("the new value", &new)? };
            (req, None)
        }
    };
    let op = req.encode();
    if op.len() > keel_core::codec::OP_BYTES_MAX {
        return Err(Failed(
            format!(
                "error: the request is {} bytes, over the {}-byte limit on one operation (keys and values together \
                 may hold about 1 MiB)",
                op.len(),
                keel_core::codec::OP_BYTES_MAX
            ),
            2,
        ));
    }
    let mut client = BlockingClient::connect(setup)?;
    let response = invoke(&mut client, op, read, timeout)?;
    let json = a.output == Output::Json;
    match response {
        KvResponse::Value(Some(v)) => match a.output {
            Output::Raw => {
                use std::io::Write;
                std::io::stdout().lock().write_all(&v)?;
            }
            Output::Json => println!("{}", serde_json::json!({ "value": enc.json("value", &v)? })),
            Output::Text if enc == Encoding::Text => {
                use std::io::Write;
                let mut out = std::io::stdout().lock();
                out.write_all(&v)?;
                out.write_all(b"\n")?;
            }
            Output::Text => println!("{}", enc.line(&v)),
        },
        KvResponse::Value(None) => {
            if json {
                println!("{}", serde_json::json!({ "value": null }));
            } else {
                eprintln!("(absent)");
            }
            return Ok(ExitCode::from(1));
        }
        KvResponse::Done if json => println!("{}", serde_json::json!({ "ok": true })),
        KvResponse::Done => println!("ok"),
        KvResponse::Swapped(swapped) => {
            if json {
                println!("{}", serde_json::json!({ "swapped": swapped }));
            } else {
                println!("{}", if swapped { "swapped" } else { "not swapped" });
            }
            if !swapped {
                return Ok(ExitCode::from(1));
            }
        }
        KvResponse::Error(e) => return Err(Failed(format!("error from the service: {e}"), 1)),
        other @ (KvResponse::Entries(_) | KvResponse::Page { .. }) => {
            return Err(Failed(format!("error: unexpected answer: {other:?}"), 1))
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The value of `put --file`: the file's bytes ("-": standard input), refused before
/// reading more than an operation may carry.
fn read_value(path: &std::path::Path) -> Result<Vec<u8>, Failed> {
    use std::io::Read;
    let limit = keel_core::codec::OP_BYTES_MAX as u64;
    let mut value = Vec::new();
    let source = path.display().to_string();
    if path.as_os_str() == "-" {
        std::io::stdin().lock().take(limit + 1).read_to_end(&mut value)?;
    } else {
        let file = std::fs::File::open(path).map_err(|e| Failed(format!("error: {source}: {e}"), 2))?;
        file.take(limit + 1).read_to_end(&mut value).map_err(|e| Failed(format!("error: {source}: {e}"), 2))?;
    }
    if value.len() as u64 > limit {
        let size = match std::fs::metadata(path) {
            Ok(m) if m.is_file() => format!("{} bytes", m.len()),
            _ => format!("more than {limit} bytes"),
        };
        return Err(Failed(
            format!("error: the value in {source} has {size}; one operation may carry at most {limit} bytes"),
            2,
        ));
    }
    Ok(value)
}

fn invoke(
    client: &mut BlockingClient,
    op: Vec<u8>,
    read: Option<ReadConsistency>,
    timeout: Duration,
) -> Result<KvResponse, Failed> {
    let bytes = match read {
        None => client.invoke(op, timeout)?,
        Some(consistency) => client.invoke_read_only(op, consistency, timeout)?,
    };
    KvResponse::decode(&bytes).map_err(|e| Failed(format!("error: undecodable result: {e}"), 1))
}

/// Up to `limit` entries with `prefix`, a page ([`KvRequest::ScanPage`]) at a time, each
/// page read as `read` says (so a scan over pages is not one snapshot: each page is).
fn scan(
    client: &mut BlockingClient,
    prefix: Vec<u8>,
    limit: u64,
    read: Option<ReadConsistency>,
    timeout: Duration,
) -> Result<Entries, Failed> {
    let mut entries = Vec::new();
    let mut after = None;
    while (entries.len() as u64) < limit {
        let page = (limit - entries.len() as u64).min(u64::from(keel_kv::SCAN_LIMIT_MAX)) as u32;
        let req = KvRequest::ScanPage { prefix: prefix.clone(), after: after.take(), limit: page };
        match invoke(client, req.encode(), read, timeout)? {
            KvResponse::Page { entries: got, more } => {
                after = got.last().map(|(k, _)| k.clone());
                entries.extend(got);
                if !more || after.is_none() {
                    break;
                }
            }
            KvResponse::Error(e) => return Err(Failed(format!("error from the service: {e}"), 1)),
            other => return Err(Failed(format!("error: unexpected answer to a scan: {other:?}"), 1)),
        }
    }
    Ok(entries)
}

fn print_entries(entries: &[(Vec<u8>, Vec<u8>)], enc: Encoding, output: Output) -> Result<(), Failed> {
    use std::io::Write;
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    if output == Output::Json {
        let list = entries
            .iter()
            .map(|(k, v)| Ok(serde_json::json!({ "key": enc.json("key", k)?, "value": enc.json("value", v)? })))
            .collect::<Result<Vec<_>, Failed>>()?;
        writeln!(out, "{}", serde_json::json!({ "entries": list }))?;
    } else {
        for (k, v) in entries {
            writeln!(out, "{}\t{}", enc.line(k), enc.line(v))?;
        }
    }
    out.flush()?;
    Ok(())
}

/// `keel kv watch`: registers the watch, then prints push events as they arrive.
fn watch(setup: ClientSetup, prefix: Vec<u8>, count: Option<u64>, timeout: Duration, enc: Encoding) -> ExitCode {
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
        eprintln!("watching {:?} (Ctrl-C to stop)", enc.line(&prefix));
        let show = |b: &[u8]| enc.line(b);
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
