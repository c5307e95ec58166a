//! Robust leadership across real processes (#4 acceptance): a primary that delays every
//! proposal, but stays within the request timers, is replaced and throughput recovers.
//! Its own test binary, so no other cluster competes for the CPU while it measures.

mod support;
use keel_runtime::client::KeelClient;
use keel_runtime::config::ClientFile;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::{metric, put, Cluster};

/// Node 0 turns slow this long after it started...
const SLOW_AFTER: Duration = Duration::from_millis(5000);
/// ...holding each PROPOSE this long: a tenth of the 2 s request timer.
const HOLD_MS: u64 = 200;

/// Operations per second completed in `[from, to)` (times since the cluster started).
fn rate(done: &[Duration], from: Duration, to: Duration) -> f64 {
    let n = done.iter().filter(|&&t| t >= from && t < to).count();
    n as f64 / to.saturating_sub(from).as_secs_f64().max(0.001)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_that_delays_every_proposal_is_replaced_and_throughput_recovers() {
    let cluster = Cluster::init_configured(1, 1, "[leadership]\nwindow_ms = 500", |i| {
        (i == 0).then_some("[faults]\nslow_propose_ms = 200\nslow_after_ms = 5000")
    });
    let t0 = Instant::now();
    let setup = ClientFile::load(&cluster.path().join("client-1000/client.toml")).expect("client file");
    let client = KeelClient::connect_sessions(setup, 8).expect("connects");
    // The first write waits for the cluster to come up.
    put(&client, "ready", "1").await.expect("cluster up");
    let done = Arc::new(Mutex::new(Vec::<Duration>::new()));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writers: Vec<_> = (0..8)
        .map(|w| {
            let (c, done, stop) = (client.clone(), done.clone(), stop.clone());
            tokio::spawn(async move {
                let mut n = 0u64;
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    put(&c, &format!("w{w}-{}", n % 64), &n.to_string()).await.expect("put acknowledged");
                    done.lock().expect("lock").push(t0.elapsed());
                    n += 1;
                }
            })
        })
        .collect();
    // Watch node 1's installed view.
    let mut replaced = None;
    while t0.elapsed() < Duration::from_secs(40) {
        if metric(&cluster.metrics(1), "keel_view ") >= 1 {
            replaced = Some(t0.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let replaced = replaced.expect("the slow primary was replaced within 40 s");
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    for w in writers {
        w.await.expect("writer");
    }
    let done = done.lock().expect("lock").clone();
    let ms = |d: Duration| d.as_millis();
    // Replaced after it turned slow, not before (nodes start a little after t0).
    assert!(replaced > SLOW_AFTER, "view changed at {} ms, before the primary turned slow", ms(replaced));
    let second = Duration::from_secs(1);
    let fast = rate(&done, Duration::from_secs(2), SLOW_AFTER);
    let slow = rate(&done, SLOW_AFTER + Duration::from_millis(300), replaced);
    let after = rate(&done, replaced + Duration::from_millis(500), replaced + 2 * second + Duration::from_millis(500));
    eprintln!(
        "puts/s: {fast:.0} before, {slow:.0} while node 0 held proposals {HOLD_MS} ms ({} ms), {after:.0} after \
         view 1 (installed at {} ms)",
        ms(replaced - SLOW_AFTER),
        ms(replaced)
    );
    assert!(slow * 3.0 < fast, "holding proposals slowed the cluster: {slow:.0} vs {fast:.0}");
    assert!(after * 2.0 > fast, "throughput recovered: {after:.0} vs {fast:.0} before");
    // The backups' throughput monitors did it, not a request timer.
    let suspicions: u64 = (1..4).map(|i| metric(&cluster.metrics(i), "keel_slow_primary_suspicions_total")).sum();
    assert!(suspicions >= 2, "r + 1 backups asked to replace the slow primary: {suspicions}");
    assert!(cluster.log(0).contains("fault injection is on"), "node 0 ran with the fault");
}
