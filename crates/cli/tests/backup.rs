//! `keel admin backup` and `keel init --restore` (issue #25), with real `keel node`
//! processes on loopback: a backup taken after a spell of load, with a node down, holds
//! every write acknowledged before it started; it restores into a new cluster (other keys, other
//! ports) that serves those writes, takes new ones and survives a restart; a damaged,
//! foreign or mismatched file is refused before anything is written, and a node whose
//! copy of the restored state differs refuses to start.

use std::path::Path;
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};
use std::time::Duration;

mod support;
use support::{check_all, get, put, start_writers, Cluster, KEEL};

fn keel(args: &[&str], dir: &Path) -> Output {
    Command::new(KEEL).args(args).arg("--dir").arg(dir).output().expect("keel runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `keel init --restore FILE` into a fresh directory must fail with `needle`, leaving
/// no cluster behind.
fn restore_refused(file: &Path, extra: &[&str], needle: &str) {
    let dir = tempfile::tempdir().expect("tempdir");
    let target = dir.path().join("new");
    let mut args = vec!["init", "--restore", file.to_str().expect("utf-8 path")];
    args.extend_from_slice(extra);
    let out = keel(&args, &target);
    assert_eq!(out.status.code(), Some(2), "refused with a usage error: {}", stderr(&out));
    assert!(stderr(&out).contains(needle), "the error says {needle:?}: {}", stderr(&out));
    assert!(!target.join("cluster.toml").exists(), "nothing written for a refused restore");
}

async fn wait_for_exit(cluster: &mut Cluster, i: usize) -> Option<std::process::ExitStatus> {
    for _ in 0..100 {
        if let Some(status) = cluster.exited(i) {
            return Some(status);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_after_load_restores_into_a_new_cluster_with_every_acknowledged_write() {
    let mut old = Cluster::init_args(1, 1, &["--checkpoint-interval", "64"]);
    let stop = Arc::new(Mutex::new(false));
    let acked = Arc::new(Mutex::new(Vec::new()));
    let writers = start_writers(&old, 3, stop.clone(), acked.clone());
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // One node down: the backup needs a quorum, not everyone.
    old.kill(3);
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Every write acknowledged before the command starts must be in the file. The load
    // stops first: with writers going, a checkpoint past them comes by itself; on a
    // quiet cluster the newest checkpoint lags behind the last writes (up to 64
    // instances here), and the backup has to bring a newer one about.
    *stop.lock().expect("lock") = true;
    for w in writers {
        w.await.expect("writer");
    }
    let before: Vec<(String, String)> = acked.lock().expect("lock").clone();
    let files = tempfile::tempdir().expect("tempdir");
    let file = files.path().join("cluster.keel");
    let out = old.admin(&["backup", "--out", file.to_str().expect("utf-8"), "--timeout", "60"]);
    let out = out.expect("the backup succeeds");
    assert!(out.contains("backed up the kv state after instance"), "{out}");
    assert!(before.len() > 20, "too little load before the backup: {}", before.len());
    {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(&file).expect("backup file").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "a backup holds the service's data: owner only");
    }
    // Written after the backup finished: not in it.
    let c = old.client(1005);
    put(&c, "after-the-backup", "x").await.expect("the old cluster still serves");
    drop(c);
    old.kill_all();

    // A new cluster from the file: new CA, keys and ports.
    let mut new = Cluster::init_args(1, 1, &["--restore", file.to_str().expect("utf-8")]);
    let cluster_toml = std::fs::read_to_string(new.path().join("cluster.toml")).expect("cluster file");
    assert!(cluster_toml.contains("[genesis]"), "{cluster_toml}");
    check_all(&new, &before).await;
    let c = new.client(1006);
    assert_eq!(get(&c, "after-the-backup").await, None, "written after the backup");
    put(&c, "in-the-new-cluster", "y").await.expect("the new cluster takes writes");
    drop(c);
    // Restarted before its first checkpoint: each node starts from the restored state
    // again and replays its log on top.
    new.kill_all();
    new.start_all();
    check_all(&new, &before).await;
    let c = new.client(1006);
    assert_eq!(get(&c, "in-the-new-cluster").await.as_deref(), Some("y"));
    drop(c);

    // A node whose copy of the restored state differs refuses to start.
    new.kill(0);
    let genesis = new.path().join("genesis.state");
    let mut bytes = std::fs::read(&genesis).expect("genesis state");
    let last = bytes.len() - 1;
    bytes[last] ^= 1;
    std::fs::write(&genesis, &bytes).expect("tampered");
    new.start(0);
    let status = wait_for_exit(&mut new, 0).await.expect("node 0 exits");
    assert!(!status.success());
    assert!(new.log(0).contains("does not match [genesis] digest"), "{}", new.log(0));

    // Files that must not restore: damaged, cut short, not a backup, another service.
    let mut damaged = std::fs::read(&file).expect("backup");
    let at = damaged.len() - 3;
    damaged[at] ^= 0x40;
    let damaged_file = files.path().join("damaged.keel");
    std::fs::write(&damaged_file, &damaged).expect("written");
    restore_refused(&damaged_file, &[], "does not match the certified root");
    let short_file = files.path().join("short.keel");
    std::fs::write(&short_file, &damaged[..damaged.len() / 2]).expect("written");
    restore_refused(&short_file, &[], "cut short");
    let junk_file = files.path().join("junk.keel");
    std::fs::write(&junk_file, b"not a backup at all").expect("written");
    restore_refused(&junk_file, &[], "not a Keel backup");
    restore_refused(&file, &["--service", "coord"], "holds a kv state");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_with_its_execution_stage_apart_backs_up_and_restores_co_located() {
    let mut old = Cluster::init_args(1, 1, &["--layout", "separated-exec", "--checkpoint-interval", "64"]);
    let c = old.client(1000);
    let mut written = Vec::new();
    for i in 0..30 {
        let (k, v) = (format!("k{i}"), format!("v{i}"));
        put(&c, &k, &v).await.expect("put");
        written.push((k, v));
    }
    drop(c);
    let files = tempfile::tempdir().expect("tempdir");
    let file = files.path().join("apart.keel");
    let out = old.admin(&["backup", "--out", file.to_str().expect("utf-8")]).expect("the backup succeeds");
    // u + 1 execution nodes certify an execution checkpoint.
    assert!(out.contains("certified by 2 nodes"), "{out}");
    old.kill_all();
    let new = Cluster::init_args(1, 1, &["--restore", file.to_str().expect("utf-8")]);
    check_all(&new, &written).await;
}

#[test]
fn the_block_service_is_not_backed_up_through_checkpoints() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = keel(&["init", "--service", "block", "--size", "16M"], dir.path());
    assert!(out.status.success(), "{}", stderr(&out));
    let file = dir.path().join("b.keel");
    let out = keel(&["admin", "backup", "--out", file.to_str().expect("utf-8")], dir.path());
    assert!(!out.status.success());
    assert!(stderr(&out).contains("nbdcopy"), "says how to back a disk up instead: {}", stderr(&out));
    assert!(!file.exists());
}
