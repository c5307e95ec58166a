//! block with real NBD clients nobody here wrote (qemu-io, qemu-img, nbdinfo, nbdcopy,
//! nbdfuse, fio, mkfs.ext4, fuse2fs, e2fsck from Debian; `scripts/install-test-clients`
//! installs them), against `keel node` processes. Without them these tests fail and say
//! so; they never skip.

mod support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};
use support::{metric, Cluster};

const SIZE: u64 = 64 << 20;

fn tool(name: &str) -> Command {
    let mut c = Command::new(name);
    c.stdin(Stdio::null());
    c
}

fn run(mut c: Command) -> Output {
    let out =
        c.output().unwrap_or_else(|e| panic!("{c:?}: {e} (scripts/install-test-clients installs the NBD clients)"));
    out
}

fn ok(c: Command) -> String {
    let desc = format!("{c:?}");
    let out = run(c);
    assert!(
        out.status.success(),
        "{desc} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).to_string()
}

fn url(addr: SocketAddr) -> String {
    format!("nbd://{addr}")
}

/// A block cluster (u = r = 1) of `SIZE` with these extra `keel init` arguments, once
/// every node's NBD port answers a handshake.
fn block_cluster(extra: &[&str]) -> (Cluster, Vec<SocketAddr>) {
    let size = SIZE.to_string();
    let mut args = vec!["--service", "block", "--size", &size];
    args.extend_from_slice(extra);
    let c = Cluster::init_args(1, 1, &args);
    let fronts = c.front_ends();
    assert_eq!(fronts.len(), 4, "an NBD port per node");
    for addr in &fronts {
        wait_ready(*addr);
    }
    (c, fronts)
}

/// Until `nbdinfo --size` answers (the front end serves once it has its epoch).
fn wait_ready(addr: SocketAddr) {
    wait_ready_at(addr, &url(addr));
}

fn wait_ready_at(addr: SocketAddr, url: &str) {
    let started = Instant::now();
    loop {
        let mut c = tool("nbdinfo");
        c.args(["--size", url]);
        let out = run(c);
        if out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == SIZE.to_string() {
            return;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{addr} never served NBD: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// qemu-io's transcript of `script` against `target`, with the timing lines removed.
fn qemu_io(target: &str, script: &[&str]) -> String {
    let mut c = tool("qemu-io");
    c.args(["-f", "raw", target]);
    for line in script {
        c.args(["-c", line]);
    }
    let out = run(c);
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    text.lines().filter(|l| !l.contains(" ops; ")).collect::<Vec<_>>().join("\n")
}

/// The same script's transcript against Keel and against `nbdkit memory`, the reference.
const SCRIPT: &[&str] = &[
    "write -P 0xab 0 4096",
    "read -P 0xab 0 4096",
    "write -P 0xcd 1000 100",
    "read -v 960 200",
    "write -P 0x11 65536 1048576",
    "read -P 0x11 65536 1048576",
    "write -P 0x22 1048000 8192",
    "read -v 1047990 40",
    "read -v 1056180 40",
    "discard 65536 8192",
    "read -v 65530 16",
    "write -z 131072 65536",
    "read -P 0 131072 65536",
    "write -z 200001 3000",
    "read -v 199990 30",
    "read -v 202990 30",
    "write -P 0x33 67104768 4096",
    "read -P 0x33 67104768 4096",
    "write -P 0x44 67107864 1000",
    "read -P 0x44 67107864 1000",
    "read 67108000 1000",
    "flush",
    "write -f -P 0x55 300000 4096",
    "read -P 0x55 300000 4096",
    "write -P 0x66 4096 512",
    "writev -P 0x77 8192 512 1024 2048",
    "read -v 4090 12",
    "read -v 8190 4",
    "write -P 0x88 409600 4096",
    "write -P 0x99 413696 4096",
    "read -P 0x88 409600 4096",
    "read -P 0x99 413696 4096",
];

#[test]
fn nbdinfo_shows_the_export_and_qemu_io_gives_nbdkits_transcript() {
    let (cluster, fronts) = block_cluster(&[]);
    let mut c = tool("nbdinfo");
    c.args(["--json", &url(fronts[1])]);
    let info = ok(c);
    for want in [
        format!("\"export-size\": {SIZE}"),
        "\"can_flush\": true".into(),
        "\"can_fua\": true".into(),
        "\"can_multi_conn\": true".into(),
        "\"can_trim\": true".into(),
        "\"can_zero\": true".into(),
        "\"is_read_only\": false".into(),
        "\"block_size_preferred\": 4096".into(),
        "\"can_fast_zero\": true".into(),
        "\"can_df\": true".into(),
        "\"protocol\": \"newstyle-fixed\"".into(),
    ] {
        assert!(info.contains(&want), "nbdinfo lacks {want}:\n{info}");
    }
    // NBD_OPT_LIST (then NBD_OPT_ABORT): the one export, the default name.
    let mut c = tool("nbdinfo");
    c.args(["--list", "--json", &url(fronts[3])]);
    let list = ok(c);
    assert!(list.contains("\"export-name\": \"\"") && list.contains(&format!("\"export-size\": {SIZE}")), "{list}");
    // An export name it does not serve is refused (NBD_REP_ERR_UNKNOWN).
    let mut c = tool("nbdinfo");
    c.arg(format!("{}/other", url(fronts[3])));
    assert!(!run(c).status.success(), "an unknown export must be refused");
    // The reference: nbdkit's memory plugin of the same size, on a port of our choosing.
    let port = keel_runtime::provision::free_ports(1).expect("a free port");
    let mut nbdkit = tool("nbdkit")
        .args(["-f", "-i", "127.0.0.1", "-p", &port.to_string(), "memory", &SIZE.to_string()])
        .spawn()
        .expect("nbdkit starts");
    let reference = format!("nbd://127.0.0.1:{port}");
    let started = Instant::now();
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(started.elapsed() < Duration::from_secs(10), "nbdkit never listened");
        std::thread::sleep(Duration::from_millis(50));
    }
    let want = qemu_io(&reference, SCRIPT);
    assert!(!want.contains("Pattern verification"), "the reference run failed:\n{want}");
    // Through one node; then the whole disk as another node reads it equals the reference's.
    let got = qemu_io(&url(fronts[0]), SCRIPT);
    let mut compare = tool("qemu-img");
    compare.args(["compare", "-f", "raw", "-F", "raw", &reference, &url(fronts[2])]);
    let same = run(compare);
    // Block status (base:allocation): the same map as nbdkit's, for writes, zeroes and
    // discards aligned to nbdkit's 32 KiB pages, once both disks are zeroed whole.
    let mut maps = Vec::new();
    for (target, map_from) in [(&reference, reference.clone()), (&url(fronts[1]), url(fronts[3]))] {
        let _ = qemu_io(target, &[&format!("write -z 0 {SIZE}")]);
        let out = qemu_io(target, MAP_SCRIPT);
        assert!(!out.contains("failed"), "{out}");
        let mut m = tool("nbdinfo");
        m.args(["--map", &map_from]);
        maps.push(ok(m));
    }
    let _ = nbdkit.kill();
    let _ = nbdkit.wait();
    assert_eq!(got, want, "qemu-io against Keel differs from nbdkit memory");
    assert!(
        same.status.success(),
        "the disk as node 2 reads it differs from the reference: {}",
        String::from_utf8_lossy(&same.stdout)
    );
    assert_eq!(maps[1], maps[0], "nbdinfo --map against Keel differs from nbdkit memory");
    assert!(maps[1].lines().filter(|l| l.ends_with(" data")).count() == 4, "{}", maps[1]);
    // A copy tool that reads the map skips the holes: qemu-img convert writes a sparse
    // file of the 64 MiB disk holding about 1.2 MiB, with the same bytes.
    let out = cluster.path().join("sparse.img");
    let mut convert = tool("qemu-img");
    convert.args(["convert", "-f", "raw", "-O", "raw", &url(fronts[2])]).arg(&out);
    ok(convert);
    let allocated = std::os::unix::fs::MetadataExt::blocks(&std::fs::metadata(&out).expect("converted")) * 512;
    assert!(allocated < 8 << 20, "qemu-img convert allocated {allocated} bytes: the holes were copied");
    let mut compare = tool("qemu-img");
    compare.args(["compare", "-f", "raw", "-F", "raw"]).arg(&out).arg(url(fronts[0]));
    assert!(ok(compare).contains("Images are identical"));
}

/// Writes, zeroes and discards whose ends fall on nbdkit memory's 32 KiB pages, so that
/// its map and Keel's (4 KiB blocks) must agree exactly.
const MAP_SCRIPT: &[&str] = &[
    "write -P 0xab 1M 64k",
    "write -P 0xcd 2M 128k",
    "write -z 2M 64k",
    "discard 1M 64k",
    "write -P 1 8M 64k",
    "write -P 2 9M 64k",
    "write -z 9M 64k",
    "write -P 3 63M 1M",
    "write -P 4 32M 32k",
];

/// A file of `len` pseudo-random bytes.
/// `len` bytes that only `seed` determines.
fn random_bytes(len: usize, seed: u64) -> Vec<u8> {
    let mut bytes = vec![0u8; len];
    blake3::Hasher::new().update(&seed.to_le_bytes()).finalize_xof().fill(&mut bytes);
    bytes
}

fn random_file(dir: &Path, name: &str, len: usize, seed: u64) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, random_bytes(len, seed)).expect("written");
    path
}

fn round_trips(extra: &[&str]) {
    let (c, fronts) = block_cluster(extra);
    let img = random_file(c.path(), "random.img", SIZE as usize, 7);
    let mut copy = tool("nbdcopy");
    copy.arg(&img).arg(url(fronts[1]));
    ok(copy);
    let back = c.path().join("back.img");
    let mut copy = tool("nbdcopy");
    copy.arg(url(fronts[2])).arg(&back);
    ok(copy);
    assert!(std::fs::read(&img).expect("read") == std::fs::read(&back).expect("read"), "nbdcopy round trip differs");
    let img2 = random_file(c.path(), "random2.img", SIZE as usize, 8);
    let mut convert = tool("qemu-img");
    convert.args(["convert", "-n", "-f", "raw", "-O", "raw"]).arg(&img2).arg(url(fronts[3]));
    ok(convert);
    let mut compare = tool("qemu-img");
    compare.args(["compare", "-f", "raw", "-F", "raw"]).arg(&img2).arg(url(fronts[0]));
    let out = ok(compare);
    assert!(out.contains("Images are identical"), "{out}");
}

#[test]
fn qemu_img_and_nbdcopy_round_trips_are_exact() {
    round_trips(&[]);
}

#[test]
fn full_replication_mode_round_trips_too() {
    round_trips(&["--mode", "full"]);
}

/// A FUSE mount whose daemon is a child of the test: unmounted, and the daemon waited
/// for (killed if it lingers), when dropped. Never an unbounded wait.
struct Mount {
    dir: PathBuf,
    child: Option<Child>,
}

/// Whether `dir` is a mount point now (/proc/mounts).
fn mounted(dir: &Path) -> bool {
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_path_buf());
    std::fs::read_to_string("/proc/mounts")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split_whitespace().nth(1) == Some(dir.to_string_lossy().as_ref()))
}

impl Mount {
    /// `nbdfuse DIR URL`: DIR/nbd is the export as a file.
    fn nbdfuse(dir: &Path, uri: &str) -> Mount {
        std::fs::create_dir_all(dir).expect("mountpoint");
        let child = tool("nbdfuse").arg(dir).arg(uri).spawn().expect("nbdfuse starts");
        let m = Mount { dir: dir.to_path_buf(), child: Some(child) };
        let started = Instant::now();
        while std::fs::metadata(dir.join("nbd")).map(|m| m.len()).unwrap_or(0) != SIZE {
            assert!(started.elapsed() < Duration::from_secs(20), "nbdfuse never exposed {}", dir.display());
            std::thread::sleep(Duration::from_millis(50));
        }
        m
    }

    /// `fuse2fs -f IMAGE DIR` (an ext4 file system without a kernel module), in the
    /// foreground so the test holds its process.
    fn fuse2fs(image: &Path, dir: &Path, read_only: bool) -> Mount {
        std::fs::create_dir_all(dir).expect("mountpoint");
        let child = tool("fuse2fs")
            .arg(image)
            .arg(dir)
            .args(["-f", "-o", if read_only { "fakeroot,ro" } else { "fakeroot" }])
            .spawn()
            .expect("fuse2fs starts");
        let m = Mount { dir: dir.to_path_buf(), child: Some(child) };
        let started = Instant::now();
        while !mounted(dir) {
            assert!(started.elapsed() < Duration::from_secs(20), "fuse2fs never mounted {}", dir.display());
            std::thread::sleep(Duration::from_millis(50));
        }
        m
    }

    /// Unmounts (retrying while the file system is busy, lazily at last) and reaps the
    /// daemon within 20 s.
    fn unmount(&mut self) {
        let started = Instant::now();
        while mounted(&self.dir) {
            let lazy = started.elapsed() > Duration::from_secs(10);
            let mut c = tool("fusermount");
            c.arg(if lazy { "-uz" } else { "-u" }).arg(&self.dir);
            let _ = run(c);
            if started.elapsed() > Duration::from_secs(15) {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        if let Some(mut child) = self.child.take() {
            let started = Instant::now();
            while child.try_wait().ok().flatten().is_none() {
                if started.elapsed() > Duration::from_secs(20) {
                    let _ = child.kill();
                    let _ = child.wait();
                    break;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        self.unmount();
    }
}

/// (relative path, BLAKE3 of the contents) of every file under `root`, sorted.
fn tree_sums(root: &Path) -> Vec<(String, String)> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<(String, String)>) {
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                if p.file_name().is_some_and(|n| n == "lost+found") {
                    continue;
                }
                walk(root, &p, out);
            } else if let Ok(bytes) = std::fs::read(&p) {
                let rel = p.strip_prefix(root).expect("under root").display().to_string();
                out.push((rel, blake3::hash(&bytes).to_hex().to_string()));
            }
        }
    }
    let mut out = Vec::new();
    walk(root, root, &mut out);
    out.sort();
    out
}

fn e2fsck_clean(image: &Path) {
    let mut c = tool("e2fsck");
    c.arg("-fn").arg(image);
    let out = run(c);
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "e2fsck -fn found problems:\n{text}");
}

/// Waits until node `i` finished a scan of its preferred blocks and found none
/// INCOMPLETE (recovery phase 2 done); returns the blocks it re-replicated.
/// Node `i` must first have executed what node `other` had when this was called, and
/// the scan must have begun after that.
fn wait_phase2_done(c: &Cluster, i: usize, other: usize, within: Duration) -> u64 {
    let started = Instant::now();
    let target = c.status(other).expect("the other node answers").executed;
    while c.status(i).is_none_or(|s| s.executed < target) {
        assert!(started.elapsed() < within, "node {i} never caught up to instance {target}");
        std::thread::sleep(Duration::from_millis(200));
    }
    let scans = metric(&c.metrics(i), "keel_block_recovery_scans_total");
    loop {
        let m = c.metrics(i);
        if metric(&m, "keel_block_recovery_scans_total") >= scans + 2 && m.contains("keel_block_incomplete_blocks 0") {
            return metric(&m, "keel_block_repaired_blocks_total");
        }
        assert!(
            started.elapsed() < within,
            "node {i} still has INCOMPLETE preferred blocks:\n{}",
            m.lines().filter(|l| l.contains("keel_block")).collect::<Vec<_>>().join("\n")
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

#[test]
fn ext4_over_nbdfuse_survives_a_replica_killed_mid_copy_and_a_cluster_restart() {
    let (mut c, fronts) = block_cluster(&["--reserve", "50"]);
    let nbd = c.path().join("nbd");
    let fs = c.path().join("fs");
    let source = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../services");
    let want = tree_sums(&source);
    assert!(want.len() > 20, "a tree worth copying");
    {
        let _export = Mount::nbdfuse(&nbd, &url(fronts[0]));
        let mut mkfs = tool("mkfs.ext4");
        mkfs.args(["-q", "-F", "-O", "^has_journal"]).arg(nbd.join("nbd"));
        ok(mkfs);
        let mut ext4 = Mount::fuse2fs(&nbd.join("nbd"), &fs, false);
        // Copy in the background; node 2 dies in the middle of it.
        let (src, dst) = (source.clone(), fs.clone());
        let copy = std::thread::spawn(move || {
            let mut cp = tool("cp");
            cp.arg("-r").arg(src).arg(dst);
            run(cp)
        });
        std::thread::sleep(Duration::from_millis(300));
        c.kill(2);
        let out = copy.join().expect("copy thread");
        assert!(out.status.success(), "cp failed: {}", String::from_utf8_lossy(&out.stderr));
        assert_eq!(tree_sums(&fs.join("services")), want, "the copied tree differs");
        // Node 2 may hold the PrepareData of every write of that copy (it logged them
        // before it died, and stores them when it catches up): new bytes, all written
        // while node 2 is down, are writes it surely misses.
        let late = random_file(&fs, "late.bin", 4 << 20, 11);
        assert!(std::fs::read(&late).expect("reads back") == random_bytes(4 << 20, 11), "late.bin differs");
        ext4.unmount();
        e2fsck_clean(&nbd.join("nbd"));
    }
    // Node 2 comes back and re-replicates what it missed (phase 2).
    c.start(2);
    let repaired = wait_phase2_done(&c, 2, 0, Duration::from_secs(120));
    assert!(repaired > 0, "node 2 missed writes while it was down; phase 2 re-replicated none");
    // kill -9 of the whole cluster, then everything again from disk.
    c.kill_all();
    c.start_all();
    for addr in &fronts {
        wait_ready(*addr);
    }
    let _export = Mount::nbdfuse(&nbd, &url(fronts[2]));
    e2fsck_clean(&nbd.join("nbd"));
    let _ext4 = Mount::fuse2fs(&nbd.join("nbd"), &fs, true);
    assert_eq!(tree_sums(&fs.join("services")), want, "the tree differs after the restart");
    let late = std::fs::read(fs.join("late.bin")).expect("reads");
    assert!(late == random_bytes(4 << 20, 11), "late.bin differs after the restart");
}

#[test]
fn fio_verifies_while_a_node_is_killed_and_restarted() {
    let (mut c, fronts) = block_cluster(&["--reserve", "50"]);
    let job = c.path().join("verify.fio");
    std::fs::write(
        &job,
        format!(
            "[global]\nioengine=nbd\nuri={}\nrw=randwrite\nbs=4k\nsize=8m\nverify=crc32c\nverify_fatal=1\niodepth=8\n\
             [j1]\noffset=0\n[j2]\noffset=8m\n[j3]\noffset=16m\n[j4]\nbs=64k\noffset=24m\n",
            url(fronts[0])
        ),
    )
    .expect("job file");
    let mut fio = tool("fio");
    // fio leaves its verify state files in its working directory.
    fio.current_dir(c.path()).arg(&job).stdout(Stdio::piped()).stderr(Stdio::piped());
    let child = fio.spawn().expect("fio starts");
    std::thread::sleep(Duration::from_millis(500));
    c.kill(3);
    std::thread::sleep(Duration::from_secs(2));
    c.start(3);
    let out = child.wait_with_output().expect("fio ends");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "fio failed:\n{text}");
    assert!(text.contains("err= 0") && !text.contains("verify:"), "fio reported errors:\n{text}");
    // Node 3 missed data while it was down (writes it executed INCOMPLETE) and holds
    // every preferred block now. Phase 2 copied some of them, or none: fio rewrites
    // blocks at random, so a later write whose PrepareData node 3 took may have covered
    // each one first (seen: 438 INCOMPLETE writes, 0 blocks repaired).
    let repaired = wait_phase2_done(&c, 3, 0, Duration::from_secs(120));
    let m3 = c.metrics(3);
    assert!(metric(&m3, "keel_block_writes_incomplete_total") > 0, "node 3 missed no write while it was down:\n{m3}");
    eprintln!("node 3: phase 2 repaired {repaired} blocks");
    // A second pass reads everything back through another node.
    let job2 = c.path().join("read.fio");
    let text = std::fs::read_to_string(&job)
        .expect("job")
        .replace(&url(fronts[0]), &url(fronts[3]))
        .replace("rw=randwrite", "rw=randwrite\nverify_only=1");
    std::fs::write(&job2, text).expect("job file");
    let mut fio = tool("fio");
    fio.current_dir(c.path()).arg(&job2);
    let out = ok(fio);
    assert!(!out.contains("verify:"), "{out}");
    // Every write executed, and the front end's epoch is still open (a minute idle ends
    // it): what the nodes hold now is PrepareData of executed writes, which they must
    // have consumed or refused, node 3 too (PrepareData queued for it while it was down
    // arrives late; its restart replays its log; it caught up by a state transfer).
    for i in 0..4 {
        wait_no_prepared(&c, i, Duration::from_secs(10));
    }
}

#[test]
fn flushed_writes_survive_kill_9_of_every_node() {
    let (mut c, fronts) = block_cluster(&[]);
    let script = ["write -P 0x5a 0 1048576", "write -f -P 0xa5 2097152 65536", "write -P 0x3c 4194000 5000", "flush"];
    let out = qemu_io(&url(fronts[1]), &script);
    assert!(!out.contains("failed"), "{out}");
    c.kill_all();
    c.start_all();
    for addr in &fronts {
        wait_ready(*addr);
    }
    let out = qemu_io(
        &url(fronts[3]),
        &[
            "read -P 0x5a 0 1048576",
            "read -P 0xa5 2097152 65536",
            "read -P 0x3c 4194000 5000",
            "read -P 0 4199000 1000",
        ],
    );
    assert!(!out.contains("failed") && !out.contains("Pattern verification"), "{out}");
}

#[test]
fn a_node_serving_wrong_bytes_is_reported_and_routed_around() {
    let (c, fronts) = block_cluster(&[]);
    // Block 300 is in stripe 1, preferred on nodes 1, 2, 3: node 0 reads it from node 1
    // first (the order of the preferred set).
    let offset = 300 * 4096;
    let out = qemu_io(&url(fronts[0]), &[&format!("write -P 0x42 {offset} 4096"), "flush"]);
    assert!(!out.contains("failed"), "{out}");
    // Node 0 sent that write's data once, to node 1, which passed it on down the chain
    // (chain replication); nodes 2 and 3 stored it too.
    let m1 = c.metrics(1);
    assert!(metric(&m1, "keel_block_prepares_forwarded_total") >= 1, "node 1 forwarded no PrepareData:\n{m1}");
    assert_eq!(
        metric(&c.metrics(3), "keel_block_prepares_forwarded_total"),
        0,
        "the chain's last node has nobody to pass it to"
    );
    assert!(metric(&c.metrics(3), "keel_block_prepares_total") >= 1);
    // Node 1's disk lies: its copy of block 300 changes under it (same version held).
    let data = c.path().join("node-1/data/block/data");
    let started = Instant::now();
    loop {
        let f = std::fs::File::open(&data).expect("data file");
        let mut block = vec![0u8; 4096];
        use std::os::unix::fs::FileExt;
        f.read_exact_at(&mut block, offset).expect("read");
        if block.iter().all(|&b| b == 0x42) {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "node 1 never stored block 300");
        std::thread::sleep(Duration::from_millis(100));
    }
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(&data).expect("data file");
        f.write_all_at(&[0x13; 64], offset + 100).expect("corrupted");
    }
    let out = qemu_io(&url(fronts[0]), &[&format!("read -P 0x42 {offset} 4096")]);
    assert!(
        !out.contains("failed") && !out.contains("Pattern verification"),
        "the read was not routed around node 1:\n{out}"
    );
    let m = c.metrics(0);
    assert!(m.contains("keel_block_bad_blocks_total{node=\"1\"} 1"), "node 0 did not report node 1:\n{m}");
    let status = Command::new(support::KEEL).args(["status", "--dir"]).arg(c.path()).output().expect("keel status");
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(text.contains("do not match the agreed hash (node 1: 1)"), "keel status does not say so:\n{text}");
    let block = Command::new(support::KEEL)
        .args(["block", "status", "--dir"])
        .arg(c.path())
        .output()
        .expect("keel block status");
    let text = String::from_utf8_lossy(&block.stdout);
    assert!(block.status.success(), "{text}{}", String::from_utf8_lossy(&block.stderr));
    assert!(text.contains(&format!("export: {SIZE} bytes in blocks of 4096")), "{text}");
    assert!(text.contains(&format!("node 0: nbd://{}", fronts[0])), "{text}");
    assert!(text.contains("do not match the agreed hash (node 1: 1)"), "keel block status does not say so:\n{text}");
}

#[test]
fn an_idle_front_ends_epoch_ends_and_its_next_write_renews_it() {
    let (c, fronts) = block_cluster(&["--epoch-idle-s", "2"]);
    let out = qemu_io(&url(fronts[0]), &["write -P 0x31 0 65536"]);
    assert!(!out.contains("failed"), "{out}");
    // Every front end began an epoch when it started and node 0's wrote since; two
    // quiet seconds later a tick ends all four, on every node.
    let started = Instant::now();
    loop {
        let m = c.metrics(1);
        if metric(&m, "keel_block_epochs_ended_idle_total") >= 4 {
            assert_eq!(metric(&m, "keel_block_prepared_bytes"), 0, "{m}");
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(30), "no idle epoch ended within 30 s:\n{m}");
        std::thread::sleep(Duration::from_millis(200));
    }
    // The nodes now refuse these front ends' PrepareData of the ended epoch: each
    // renews its epoch and the write goes through.
    for (i, pattern) in [(0, "0x32"), (2, "0x33")] {
        let out = qemu_io(&url(fronts[i]), &[&format!("write -P {pattern} {} 65536", (i + 1) * 65536)]);
        assert!(!out.contains("failed"), "node {i}: {out}");
        let fenced = metric(&c.metrics(i), "keel_block_writes_fenced_total");
        assert!(fenced >= 1, "node {i}'s front end wrote without being fenced ({fenced})");
    }
    let out = qemu_io(
        &url(fronts[3]),
        &["read -P 0x31 0 65536", "read -P 0x32 65536 65536", "read -P 0 131072 65536", "read -P 0x33 196608 65536"],
    );
    assert!(!out.contains("failed") && !out.contains("Pattern verification"), "{out}");
}

/// 8 MiB of `pattern` from offset 0 through `target`, 1 MiB (a stripe) at a time:
/// PrepareData for every slice, so for every node.
fn write_spread(target: &str, pattern: u8) {
    let lines: Vec<String> = (0..8).map(|i| format!("write -P {pattern:#x} {} 1048576", i << 20)).collect();
    let script: Vec<&str> = lines.iter().map(String::as_str).collect();
    let out = qemu_io(target, &script);
    assert!(!out.contains("failed"), "{out}");
}

/// Sends `signal` (`STOP`, `CONT`) to node `i`.
fn signal(c: &Cluster, i: usize, signal: &str) {
    let mut kill = tool("kill");
    kill.arg(format!("-{signal}")).arg(c.pid(i).to_string());
    ok(kill);
}

/// A node that timed out is suspected (its blocks' PrepareData also goes to reserve
/// storage at once) until it answers in time again: once it is back, writes to its
/// slices end the suspicion, and reserve copies stop. A write that has its copies
/// before the suspected node answers still waits for that answer in the background
/// (until the wait a preferred node gets), so the node need not win a race with the
/// reserve node to be trusted again; a later answer (a slow node) does not count. (A node whose process is
/// gone is not suspected: its connection is down, so a write goes around it at once.
/// A stopped process keeps its connections and answers nothing: a timeout.)
#[test]
fn a_node_back_from_a_pause_is_waited_for_again_once_it_answers_in_time() {
    let (c, fronts) = block_cluster(&["--reserve", "50"]);
    let target = url(fronts[0]);
    signal(&c, 3, "STOP");
    write_spread(&target, 0x11);
    let m = c.metrics(0);
    signal(&c, 3, "CONT");
    assert_eq!(metric(&m, "keel_block_suspected_nodes"), 1, "node 3 timed out and is suspected");
    assert!(metric(&m, "keel_block_reserve_prepares_total") > 0, "node 3's blocks went to reserve storage");
    // Within seconds (not the minute a suspicion lasts), a pass of writes goes to the
    // preferred nodes only. One pass, not the first: the writes queued while node 3
    // was stopped may still keep it busy past the wait.
    let started = Instant::now();
    loop {
        let reserve = metric(&c.metrics(0), "keel_block_reserve_prepares_total");
        write_spread(&target, 0x33);
        let m = c.metrics(0);
        if metric(&m, "keel_block_suspected_nodes") == 0 && metric(&m, "keel_block_reserve_prepares_total") == reserve {
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(30), "node 3 is back, but writes still go to reserve storage");
    }
    let out = qemu_io(&url(fronts[3]), &["read -P 0x33 0 8388608"]);
    assert!(!out.contains("failed") && !out.contains("Pattern verification"), "{out}");
}

#[test]
fn a_full_reserve_gives_writers_enospc_and_loses_nothing() {
    let (mut c, fronts) = block_cluster(&["--reserve", "0"]);
    let out = qemu_io(&url(fronts[0]), &["write -P 0x21 0 4096"]);
    assert!(!out.contains("failed"), "{out}");
    // With node 3 down, a block of stripe 1 (nodes 1, 2, 3) needs node 0's reserve,
    // which is 0 blocks.
    c.kill(3);
    let out = qemu_io(&url(fronts[0]), &[&format!("write -P 0x22 {} 4096", 300 * 4096)]);
    assert!(out.contains("No space left on device"), "{out}");
    // Membership changes would move every slice: refused, with the reason.
    let err = c.admin(&["remove-node", "3"]).expect_err("refused");
    assert!(err.contains("block service does not support membership changes"), "{err}");
    // Stripe 0 (nodes 0, 1, 2) still takes writes, and what was written reads back.
    let out = qemu_io(
        &url(fronts[0]),
        &[
            "write -P 0x23 8192 4096",
            "read -P 0x21 0 4096",
            "read -P 0x23 8192 4096",
            &format!("read -P 0 {} 4096", 300 * 4096),
        ],
    );
    assert!(!out.contains("failed") && !out.contains("Pattern verification"), "{out}");
    // Nodes 1 and 2 took the refused write's PrepareData. Its WriteData never comes, so
    // the front end's next write began a new epoch, and they dropped it.
    for i in [1, 2] {
        wait_no_prepared(&c, i, Duration::from_secs(20));
    }
}

/// Waits until node `i` holds no PrepareData.
fn wait_no_prepared(c: &Cluster, i: usize, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let m = c.metrics(i);
        let held = metric(&m, "keel_block_prepared_bytes");
        if held == 0 {
            return;
        }
        assert!(Instant::now() < deadline, "node {i} still holds {held} bytes of PrepareData:\n{m}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Reads one NBD simple reply: (error, cookie).
fn simple_reply(s: &mut TcpStream) -> (u32, u64) {
    let mut b = [0u8; 16];
    s.read_exact(&mut b).expect("reply");
    assert_eq!(&b[0..4], &[0x67, 0x44, 0x66, 0x98], "simple reply magic");
    (u32::from_be_bytes(b[4..8].try_into().expect("4")), u64::from_be_bytes(b[8..16].try_into().expect("8")))
}

/// The next structured reply chunk, which must be the reply's last: (type, cookie,
/// payload).
fn chunk(s: &mut TcpStream) -> (u16, u64, Vec<u8>) {
    let mut b = [0u8; 20];
    s.read_exact(&mut b).expect("chunk");
    assert_eq!(&b[0..4], &[0x66, 0x8e, 0x33, 0xef], "structured reply magic");
    assert_eq!(u16::from_be_bytes([b[4], b[5]]), 1, "NBD_REPLY_FLAG_DONE");
    let mut payload = vec![0u8; u32::from_be_bytes(b[16..20].try_into().expect("4")) as usize];
    s.read_exact(&mut payload).expect("payload");
    (u16::from_be_bytes([b[6], b[7]]), u64::from_be_bytes(b[8..16].try_into().expect("8")), payload)
}

/// A connection through the handshake (NBD_OPT_EXPORT_NAME, no zeroes).
fn transmission(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connects");
    s.set_read_timeout(Some(Duration::from_secs(30))).expect("timeout");
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).expect("greeting");
    s.write_all(&3u32.to_be_bytes()).expect("client flags");
    let mut opt = Vec::new();
    opt.extend_from_slice(b"IHAVEOPT");
    opt.extend_from_slice(&1u32.to_be_bytes());
    opt.extend_from_slice(&0u32.to_be_bytes());
    s.write_all(&opt).expect("export name");
    let mut export = [0u8; 10];
    s.read_exact(&mut export).expect("export");
    s
}

fn request(cmd: u16, cookie: u64, offset: u64, length: u32) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&0x2560_9513u32.to_be_bytes());
    b.extend_from_slice(&0u16.to_be_bytes());
    b.extend_from_slice(&cmd.to_be_bytes());
    b.extend_from_slice(&cookie.to_be_bytes());
    b.extend_from_slice(&offset.to_be_bytes());
    b.extend_from_slice(&length.to_be_bytes());
    b
}

/// Whether the server closed the connection (EOF on read).
fn closed(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 1];
    matches!(s.read(&mut b), Ok(0) | Err(_))
}

#[test]
fn malformed_nbd_input_gets_an_error_or_a_closed_connection_and_is_counted() {
    let (c, fronts) = block_cluster(&[]);
    let addr = fronts[1];
    // Client flags without fixed newstyle.
    let mut s = TcpStream::connect(addr).expect("connects");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).expect("greeting");
    s.write_all(&0u32.to_be_bytes()).expect("flags");
    assert!(closed(&mut s), "bad client flags must close the connection");
    // An option claiming 1 GiB of data.
    let mut s = TcpStream::connect(addr).expect("connects");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    s.read_exact(&mut greeting).expect("greeting");
    s.write_all(&1u32.to_be_bytes()).expect("flags");
    let mut opt = b"IHAVEOPT".to_vec();
    opt.extend_from_slice(&7u32.to_be_bytes());
    opt.extend_from_slice(&(1u32 << 30).to_be_bytes());
    s.write_all(&opt).expect("option");
    assert!(closed(&mut s), "an oversized option must close the connection");
    // Out of range: an error reply, and the connection stays usable.
    let mut s = transmission(addr);
    s.write_all(&request(0, 1, SIZE - 100, 4096)).expect("read past the end");
    assert_eq!(simple_reply(&mut s), (22, 1), "EINVAL for a read past the end");
    let mut w = request(1, 2, SIZE, 512);
    w.extend_from_slice(&[1u8; 512]);
    s.write_all(&w).expect("write past the end");
    assert_eq!(simple_reply(&mut s), (28, 2), "ENOSPC for a write past the end");
    s.write_all(&request(42, 3, 0, 0)).expect("unknown command");
    assert_eq!(simple_reply(&mut s), (22, 3), "EINVAL for an unknown command");
    s.write_all(&request(0, 4, 0, 16)).expect("read");
    assert_eq!(simple_reply(&mut s), (0, 4));
    let mut zeros = [1u8; 16];
    s.read_exact(&mut zeros).expect("data");
    assert_eq!(zeros, [0u8; 16]);
    // A write larger than the protocol's maximum closes the connection.
    s.write_all(&request(1, 5, 0, 64 << 20)).expect("huge write");
    assert!(closed(&mut s), "an oversized write must close the connection");
    // A bad magic closes it too.
    let mut s = transmission(addr);
    let mut bad = request(0, 6, 0, 512);
    bad[0] ^= 0xff;
    s.write_all(&bad).expect("bad magic");
    assert!(closed(&mut s), "a bad request magic must close the connection");
    // A client gone in the middle of a write's payload: none of it becomes visible.
    let mut s = transmission(addr);
    let mut w = request(1, 7, 1 << 20, 8192);
    w.extend_from_slice(&[0xaa; 4096]);
    s.write_all(&w).expect("half a write");
    drop(s);
    std::thread::sleep(Duration::from_millis(500));
    let out = qemu_io(&url(fronts[2]), &[&format!("read -P 0 {} 8192", 1 << 20)]);
    assert!(
        !out.contains("Pattern verification") && !out.contains("failed"),
        "a half-sent write became visible:\n{out}"
    );
    // A fast zero (advertised: zeroing is metadata only) is done, not refused.
    let mut s = transmission(addr);
    let mut w = request(1, 12, 2 << 20, 4096);
    w.extend_from_slice(&[0x5a; 4096]);
    s.write_all(&w).expect("write");
    assert_eq!(simple_reply(&mut s), (0, 12));
    let mut z = request(6, 13, 2 << 20, 4096);
    z[4..6].copy_from_slice(&(1u16 << 4).to_be_bytes());
    s.write_all(&z).expect("fast zero");
    assert_eq!(simple_reply(&mut s), (0, 13), "NBD_CMD_FLAG_FAST_ZERO honoured");
    s.write_all(&request(0, 14, 2 << 20, 4096)).expect("read");
    assert_eq!(simple_reply(&mut s), (0, 14));
    let mut back = [1u8; 4096];
    s.read_exact(&mut back).expect("data");
    assert!(back.iter().all(|&b| b == 0), "the fast zero left data");
    // BLOCK_STATUS without a metadata context: EINVAL, counted; the connection lives.
    s.write_all(&request(7, 8, 0, 4096)).expect("block status");
    assert_eq!(simple_reply(&mut s), (22, 8), "EINVAL for BLOCK_STATUS without a context");
    // Meta contexts before structured replies are refused; after them, a query of
    // another namespace selects nothing, and a malformed one is refused.
    let mut s = greeted(addr);
    let query = |q: &[&str]| {
        let mut d = 0u32.to_be_bytes().to_vec();
        d.extend_from_slice(&(q.len() as u32).to_be_bytes());
        for q in q {
            d.extend_from_slice(&(q.len() as u32).to_be_bytes());
            d.extend_from_slice(q.as_bytes());
        }
        d
    };
    s.write_all(&option(10, &query(&["base:allocation"]))).expect("set meta context");
    assert_eq!(option_reply(&mut s).1, (1 << 31) + 3, "NBD_REP_ERR_INVALID before structured replies");
    s.write_all(&option(8, &[])).expect("structured replies");
    assert_eq!(option_reply(&mut s).1, 1);
    s.write_all(&option(10, &query(&["x-other:thing"]))).expect("set meta context");
    assert_eq!(option_reply(&mut s).1, 1, "no context, then NBD_REP_ACK");
    let mut cut = query(&["base:allocation"]);
    cut.pop();
    s.write_all(&option(10, &cut)).expect("set meta context");
    assert_eq!(option_reply(&mut s).1, (1 << 31) + 3, "NBD_REP_ERR_INVALID for data cut short");
    s.write_all(&option(10, &query(&["base:allocation"]))).expect("set meta context");
    let (_, kind, data) = option_reply(&mut s);
    assert_eq!((kind, &data[4..]), (4, &b"base:allocation"[..]), "NBD_REP_META_CONTEXT");
    let id = u32::from_be_bytes(data[0..4].try_into().expect("4"));
    assert_eq!(option_reply(&mut s).1, 1);
    s.write_all(&option(1, &[])).expect("export name");
    let mut export = [0u8; 10];
    s.read_exact(&mut export).expect("export");
    // A structured read past the end gets an error chunk, never a simple reply; block
    // status of an unwritten range is one hole; then the connection still reads.
    s.write_all(&request(0, 9, SIZE - 100, 4096)).expect("read past the end");
    let (kind, cookie, payload) = chunk(&mut s);
    assert_eq!((kind, cookie, u32::from_be_bytes(payload[0..4].try_into().expect("4"))), (0x8001, 9, 22));
    s.write_all(&request(7, 10, 40 << 20, 1 << 20)).expect("block status");
    let (kind, cookie, payload) = chunk(&mut s);
    let words: Vec<u32> = payload.chunks_exact(4).map(|c| u32::from_be_bytes(c.try_into().expect("4"))).collect();
    assert_eq!((kind, cookie, words), (5, 10, vec![id, 1 << 20, 3]), "one extent, a hole that reads as zeros");
    s.write_all(&request(0, 11, 40 << 20, 16)).expect("read");
    let (kind, cookie, payload) = chunk(&mut s);
    assert_eq!((kind, cookie, payload.len()), (1, 11, 24), "one data chunk: offset and 16 bytes");
    assert_eq!(u64::from_be_bytes(payload[0..8].try_into().expect("8")), 40 << 20);
    let m = c.metrics(1);
    assert!(metric(&m, "keel_block_nbd_malformed_total") >= 6, "malformed input not counted:\n{m}");
    // The node is still fine.
    let out = qemu_io(&url(addr), &["write -P 0x61 0 4096", "read -P 0x61 0 4096"]);
    assert!(!out.contains("failed") && !out.contains("Pattern verification"), "{out}");
}

/// An NBD option request.
fn option(option: u32, data: &[u8]) -> Vec<u8> {
    let mut o = b"IHAVEOPT".to_vec();
    o.extend_from_slice(&option.to_be_bytes());
    o.extend_from_slice(&(data.len() as u32).to_be_bytes());
    o.extend_from_slice(data);
    o
}

/// The next option reply: (option, reply type, data).
fn option_reply(s: &mut TcpStream) -> (u32, u32, Vec<u8>) {
    let mut b = [0u8; 20];
    s.read_exact(&mut b).expect("option reply");
    assert_eq!(u64::from_be_bytes(b[0..8].try_into().expect("8")), 0x0003_e889_0455_65a9, "reply magic");
    let len = u32::from_be_bytes(b[16..20].try_into().expect("4"));
    let mut data = vec![0u8; len as usize];
    s.read_exact(&mut data).expect("reply data");
    (u32::from_be_bytes(b[8..12].try_into().expect("4")), u32::from_be_bytes(b[12..16].try_into().expect("4")), data)
}

/// A connection past the greeting, fixed newstyle without zeroes.
fn greeted(addr: SocketAddr) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connects");
    s.set_read_timeout(Some(Duration::from_secs(10))).expect("timeout");
    let mut greeting = [0u8; 18];
    s.read_exact(&mut greeting).expect("greeting");
    assert_eq!(&greeting[8..16], b"IHAVEOPT");
    s.write_all(&3u32.to_be_bytes()).expect("client flags");
    s
}

#[test]
fn nbd_over_tls_serves_clients_the_cluster_ca_certified_and_no_one_else() {
    let size = SIZE.to_string();
    let c = Cluster::init_args(1, 1, &["--service", "block", "--size", &size, "--nbd-tls"]);
    let fronts = c.front_ends();
    assert_eq!(fronts.len(), 4, "an NBD port per node");
    let certs = c.path().join("nbd-client");
    let tls = |addr: SocketAddr| format!("nbds://{addr}/?tls-certificates={}", certs.display());
    for addr in &fronts {
        wait_ready_at(*addr, &tls(*addr));
    }
    let info = ok({
        let mut i = tool("nbdinfo");
        i.arg(tls(fronts[0]));
        i
    });
    assert!(info.contains("with TLS"), "{info}");

    // Real clients over TLS: nbdcopy in and out through different nodes, qemu-io with
    // qemu's own x509 credentials on a third.
    let img = random_file(c.path(), "random.img", 4 << 20, 11);
    let mut copy = tool("nbdcopy");
    copy.arg(&img).arg(tls(fronts[1]));
    ok(copy);
    let back = c.path().join("back.img");
    let mut copy = tool("nbdcopy");
    copy.args(["--requests=4"]).arg(tls(fronts[2])).arg(&back);
    ok(copy);
    let back = std::fs::read(&back).expect("read");
    assert!(std::fs::read(&img).expect("read")[..] == back[..4 << 20], "nbdcopy over TLS differs");
    let mut q = tool("qemu-io");
    q.arg("--object")
        .arg(format!("tls-creds-x509,id=tls0,dir={},endpoint=client", certs.display()))
        .arg("--image-opts")
        .arg(format!("driver=nbd,host={},port={},tls-creds=tls0", fronts[3].ip(), fronts[3].port()))
        .args(["-c", "write -P 0x5a 8M 64k", "-c", "read -P 0x5a 8M 64k", "-c", "read -P 0 9M 4k"]);
    let out = ok(q);
    assert!(out.contains("read 65536/65536") && !out.contains("Pattern verification"), "{out}");

    // Without TLS, without a client certificate, or with one another CA signed: refused.
    let plain = run({
        let mut i = tool("nbdinfo");
        i.arg(url(fronts[0]));
        i
    });
    assert!(!plain.status.success(), "a plain client got in");
    let ca_only = c.path().join("ca-only");
    std::fs::create_dir_all(&ca_only).expect("dir");
    std::fs::copy(certs.join("ca-cert.pem"), ca_only.join("ca-cert.pem")).expect("copy");
    let other = tempfile::tempdir().expect("tempdir");
    let mut init = Command::new(support::KEEL);
    init.args(["init", "--service", "block", "--size", "1M", "--nbd-tls", "--force", "--dir"]).arg(other.path());
    ok(init);
    let foreign = c.path().join("foreign");
    std::fs::create_dir_all(&foreign).expect("dir");
    std::fs::copy(certs.join("ca-cert.pem"), foreign.join("ca-cert.pem")).expect("copy");
    for f in ["client-cert.pem", "client-key.pem"] {
        std::fs::copy(other.path().join("nbd-client").join(f), foreign.join(f)).expect("copy");
    }
    for dir in [&ca_only, &foreign] {
        let mut i = tool("nbdinfo");
        i.arg(format!("nbds://{}/?tls-certificates={}", fronts[0], dir.display()));
        let out = run(i);
        assert!(!out.status.success(), "a client with {} got in", dir.display());
    }

    // The protocol's rules, on the wire: options before STARTTLS get TLS_REQD, STARTTLS
    // with data is invalid, and NBD_OPT_EXPORT_NAME (which has no error reply) closes.
    let mut s = greeted(fronts[0]);
    s.write_all(&option(7, &[0, 0, 0, 0, 0, 0])).expect("go");
    assert_eq!(option_reply(&mut s).1, (1 << 31) + 5, "NBD_REP_ERR_TLS_REQD before TLS");
    s.write_all(&option(5, b"x")).expect("starttls with data");
    assert_eq!(option_reply(&mut s).1, (1 << 31) + 3, "NBD_REP_ERR_INVALID");
    s.write_all(&option(5, &[])).expect("starttls");
    assert_eq!(option_reply(&mut s).1, 1, "NBD_REP_ACK, then the TLS handshake");
    let mut s = greeted(fronts[0]);
    s.write_all(&option(1, &[])).expect("export name");
    assert!(closed(&mut s), "NBD_OPT_EXPORT_NAME before TLS must close the connection");
    let m = c.metrics(0);
    assert!(metric(&m, "keel_block_nbd_tls_refused_total") >= 5, "refusals not counted:\n{m}");
}
