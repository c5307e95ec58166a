//! block under the simulator: its checks pass under every fault class at (1, 1), (1, 0)
//! and (2, 1), the runs exercise what the checks judge, and each check is shown able to
//! fail by a deliberately broken front end.

use keel_block_sim::{run_block_seed_with_stats, Bug, Stats};
use keel_sim::{FaultSet, SimOptions};

fn faults(s: &str) -> FaultSet {
    FaultSet::parse(s).expect("known fault set")
}

fn add(total: &mut Stats, s: &Stats) {
    total.writes_acked += s.writes_acked;
    total.zeros += s.zeros;
    total.reserve_prepares += s.reserve_prepares;
    total.reads_of_data += s.reads_of_data;
    total.older_copies += s.older_copies;
    total.lies_caught += s.lies_caught;
    total.repaired += s.repaired;
    total.judged += s.judged;
    total.writes_fenced += s.writes_fenced;
    total.renewals += s.renewals;
    total.restarts += s.restarts;
    total.late_prepares += s.late_prepares;
    total.late_after_execution += s.late_after_execution;
}

#[test]
fn every_fault_class_passes_and_the_runs_exercise_the_checks() {
    let mut total = Stats::default();
    let mut runs: Vec<(&str, u32, u32, u64)> = Vec::new();
    for f in ["none", "crash", "network", "byzantine", "all"] {
        for (u, r) in [(1, 1), (1, 0)] {
            runs.extend((1..=2).map(|seed| (f, u, r, seed)));
        }
    }
    runs.extend((1..=2).map(|seed| ("all", 2, 1, seed)));
    // Operations completed per configuration, over its two seeds: a single seed of a
    // fault-heavy run may spend most of its time in view changes.
    let mut ops: std::collections::BTreeMap<(&str, u32, u32), u64> = Default::default();
    for (f, u, r, seed) in runs {
        let (report, stats) = run_block_seed_with_stats(&SimOptions::new(seed, u, r, faults(f)), None);
        eprintln!("{f} ({u},{r}) seed {seed}: {} ops, {stats:?}", report.ops_completed);
        report.assert_clean();
        *ops.entry((f, u, r)).or_default() += report.ops_completed;
        assert!(stats.judged >= report.ops_completed / 2, "{f} ({u},{r}) seed {seed}: {stats:?}");
        add(&mut total, &stats);
    }
    for ((f, u, r), n) in ops {
        assert!(n >= 40, "{f} ({u},{r}): {n} ops over two seeds");
    }
    eprintln!("all runs: {total:?}");
    assert!(total.writes_acked > 1_000 && total.reads_of_data > 1_000 && total.zeros > 200, "{total:?}");
    assert!(total.reserve_prepares > 100, "writes go to reserve storage: {total:?}");
    assert!(total.older_copies > 100, "readers meet INCOMPLETE copies: {total:?}");
    assert!(total.repaired > 100, "phase 2 re-replicates: {total:?}");
    assert!(total.lies_caught > 20, "Byzantine nodes serve wrong bytes and are caught: {total:?}");
    assert!(
        total.writes_fenced > 0 && total.renewals > 0,
        "clients cut off go idle, their epochs end at ticks, and they renew: {total:?}"
    );
    assert!(total.restarts > 20, "front ends restart between PrepareData and WriteData: {total:?}");
    assert!(
        total.late_after_execution > 20,
        "lost PrepareData arrives after its write executed (nodes must refuse it): {total:?}"
    );
}

/// The first violation `bug` causes in seeds `1..=seeds`.
fn caught(bug: Bug, f: &str, u: u32, r: u32, seeds: u64) -> String {
    for seed in 1..=seeds {
        let (report, _) = run_block_seed_with_stats(&SimOptions::new(seed, u, r, faults(f)), Some(bug));
        if let Some(v) = report.violations.first() {
            eprintln!("{bug:?} {f} ({u},{r}): seed {seed}: {}", v.detail);
            return v.detail.clone();
        }
    }
    panic!("{bug:?} {f} ({u},{r}) went unnoticed in {seeds} seeds");
}

#[test]
fn writes_ordered_on_too_few_copies_are_caught() {
    // (1, 0): one copy where u + 1 = 2 are needed, at once; (1, 1): where the Byzantine
    // node acknowledged and dropped one of the two.
    assert!(caught(Bug::FewerCopies, "none", 1, 0, 1).contains("correct nodes; u + 1 = 2 needed"));
    assert!(caught(Bug::FewerCopies, "byzantine", 1, 1, 5).contains("correct nodes; u + 1 = 2 needed"));
}

#[test]
fn reads_that_skip_the_hash_check_are_caught() {
    // A Byzantine node's wrong bytes at the agreed version, taken.
    assert!(caught(Bug::TrustHeldVersion, "byzantine", 1, 1, 5).contains("no linearization"));
}

#[test]
fn reads_served_from_incomplete_blocks_are_caught() {
    assert!(caught(Bug::AnyCopy, "none", 1, 0, 5).contains("no linearization"));
    assert!(caught(Bug::AnyCopy, "crash", 1, 1, 5).contains("no linearization"));
}

#[test]
fn a_repair_that_stores_unchecked_bytes_is_caught() {
    // The correct node that stored a Byzantine node's wrong bytes then serves them.
    assert!(caught(Bug::UncheckedRepair, "byzantine", 1, 1, 20).contains("with other bytes"));
}

#[test]
fn prepare_data_dropped_before_its_epoch_ended_is_caught() {
    // What the time bound must never do: free a waiting write's PrepareData while the
    // cluster would still order the write. Ordered, it is then held nowhere.
    assert!(caught(Bug::DropUnfenced, "none", 1, 1, 5).contains("holds neither it nor the block"));
}
