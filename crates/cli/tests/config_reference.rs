//! docs/CONFIG.md lists every field of cluster.toml, node.toml and client.toml, and
//! nothing else (issue #25 item 8). The files are built here with every field set (a
//! field added to a struct stops this from compiling until it is set here too), turned
//! into TOML, and their keys compared with the rows of the reference.

use keel_core::ids::ClientId;
use keel_core::ids::NodeId;
use keel_runtime::config::{
    ClientFile, ClusterFile, FaultsFile, FrontEndFile, GenesisFile, LeadershipFile, NodeEntry, NodeFile,
};
use std::collections::{BTreeMap, BTreeSet};

const DOC: &str = include_str!("../../../docs/CONFIG.md");

/// Maps whose entries are free-form (documented as one key, or per service below).
const FREE_FORM: [&str; 3] = ["client_keys", "service_options", "front_end.options"];

fn keys(value: &toml::Value, prefix: &str, out: &mut BTreeSet<String>) {
    let tables: Vec<&toml::Table> = match value {
        toml::Value::Table(t) => vec![t],
        toml::Value::Array(a) => a.iter().filter_map(toml::Value::as_table).collect(),
        _ => return,
    };
    for table in tables {
        for (k, v) in table {
            let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
            if !FREE_FORM.contains(&key.as_str()) {
                keys(v, &key, out);
            }
            out.insert(key);
        }
    }
}

fn of(value: Result<toml::Value, toml::ser::Error>) -> BTreeSet<String> {
    let value = value.expect("serializes");
    let mut out = BTreeSet::new();
    keys(&value, "", &mut out);
    out
}

/// The keys documented under `## <file>` (rows whose first cell is a `key`).
fn documented(doc: &str, file: &str) -> BTreeSet<String> {
    let Some(start) = doc.find(&format!("\n## {file}\n")) else { return BTreeSet::new() };
    let section = &doc[start + 4..];
    let section = &section[..section.find("\n## ").unwrap_or(section.len())];
    // The section's own table, not its `###` subsections.
    let section = &section[..section.find("\n### ").unwrap_or(section.len())];
    section.lines().filter_map(|l| l.strip_prefix("| `")?.split_once("` |").map(|(k, _)| k.to_string())).collect()
}

/// What differs between the fields and the rows: missing rows, then rows for no field.
fn differences(doc: &str, file: &str, fields: &BTreeSet<String>) -> Vec<String> {
    let rows = documented(doc, file);
    let mut out: Vec<String> = fields.difference(&rows).map(|k| format!("{file}: `{k}` is not documented")).collect();
    out.extend(rows.difference(fields).map(|k| format!("{file}: `{k}` is documented but no such field exists")));
    out
}

fn entry() -> NodeEntry {
    NodeEntry { id: NodeId(0), addr: "127.0.0.1:7100".parse().expect("addr"), public_key: "00".into() }
}

fn files() -> (ClusterFile, NodeFile, ClientFile) {
    let cluster = ClusterFile {
        u: 1,
        r: 1,
        nodes: vec![entry()],
        leadership: LeadershipFile { min_pct: Some(30), window_ms: Some(1000), rotate_ms: Some(0) },
        auth: Some("rq-mac".into()),
        request_digests: Some(true),
        client_keys: BTreeMap::from([("1000".into(), "00".into())]),
        admin_key: Some("00".into()),
        checkpoint_interval: Some(256),
        tick_ms: Some(1000),
        executors: vec![entry()],
        rq_nodes: vec![entry()],
        service_options: BTreeMap::from([("size".into(), "1G".into())]),
        genesis: Some(GenesisFile { file: "genesis.state".into(), digest: "00".into(), origin: "backup".into() }),
    };
    let node = NodeFile {
        id: NodeId(0),
        listen: "127.0.0.1:7100".parse().expect("addr"),
        metrics: "127.0.0.1:7104".parse().expect("addr"),
        service: "kv".into(),
        fsync: "batch".into(),
        threads: 1,
        verify_threads: 1,
        transfer_rate_kib: 1,
        background_checkpoints: true,
        data_dir: "data".into(),
        cluster: "../cluster.toml".into(),
        ca: "../ca.pem".into(),
        cert: "node.pem".into(),
        key: "node.key".into(),
        signing_seed: "00".into(),
        mac_secret: "00".into(),
        faults: FaultsFile { slow_propose_ms: 1, slow_after_ms: 1, lose_request_after_ms: 1 },
        front_end: Some(FrontEndFile {
            listen: "127.0.0.1:7108".parse().expect("addr"),
            client: "front-end/client.toml".into(),
            options: BTreeMap::from([("reads".into(), "local".into())]),
        }),
    };
    let client = ClientFile {
        id: ClientId(1000),
        cluster: "../cluster.toml".into(),
        ca: "../ca.pem".into(),
        cert: "client.pem".into(),
        key: "client.key".into(),
        mac_keys: vec!["00".into()],
        signing_seed: Some("00".into()),
    };
    (cluster, node, client)
}

#[test]
fn the_reference_lists_every_field_and_no_other() {
    let (cluster, node, client) = files();
    let mut gaps = differences(DOC, "cluster.toml", &of(toml::Value::try_from(&cluster)));
    gaps.extend(differences(DOC, "node.toml", &of(toml::Value::try_from(&node))));
    gaps.extend(differences(DOC, "client.toml", &of(toml::Value::try_from(&client))));
    assert!(gaps.is_empty(), "docs/CONFIG.md is out of date:\n{}", gaps.join("\n"));
}

/// The block service's settings, as `keel init --service block` writes them, each have a
/// row; so does coord's front-end option.
#[test]
fn the_reference_lists_every_service_option_init_writes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let init = std::process::Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(["init", "--service", "block", "--size", "64M", "--dir"])
        .arg(dir.path().join("c"))
        .output()
        .expect("keel init runs");
    assert!(init.status.success(), "{}", String::from_utf8_lossy(&init.stderr));
    let cluster = ClusterFile::load(&dir.path().join("c/cluster.toml")).expect("cluster file");
    assert!(!cluster.service_options.is_empty());
    for key in cluster.service_options.keys() {
        assert!(DOC.contains(&format!("| block | `{key}` |")), "service_options.{key} of block is not documented");
    }
    assert!(DOC.contains("coord: `reads = \"quorum\"`"), "coord's front-end option is not documented");
}

/// The comparison catches a field without a row and a row without a field.
#[test]
fn the_check_finds_what_is_missing_and_what_is_stale() {
    let (_, node, _) = files();
    let fields = of(toml::Value::try_from(&node));
    let without_threads = DOC.replace("| `threads` |", "| threads |");
    let gaps = differences(&without_threads, "node.toml", &fields);
    assert_eq!(gaps, vec!["node.toml: `threads` is not documented".to_string()]);
    let stale = DOC.replace("| `threads` |", "| `threads` |\n| `thread_count` | 0 | gone |\n| `x` |");
    let gaps = differences(&stale, "node.toml", &fields);
    assert!(gaps.iter().any(|g| g.contains("`thread_count` is documented but no such field exists")), "{gaps:?}");
}
