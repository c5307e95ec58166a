//! Keel's deterministic simulator: the real protocol cores under seeded faults, with
//! checkers for agreement, validity, exactly-once, linearizability, liveness after
//! healing, spurious view changes and checkpoint roots.
//!
//! It is a library too: [`run_seed`] runs any [`Workload`] (a [`keel_core::service::Service`]
//! plus client operations and an optional history checker) under the same faults.

pub mod byzantine;
pub mod disk;
pub mod linearizability;
pub mod mutation;
pub mod workload;
pub mod world;

pub use byzantine::Behaviours;
pub use mutation::DriverMutation;
pub use workload::{HistoryEntry, NodeStart, Workload};
pub use world::{FaultCounts, FaultSet, SeedReport, SimOptions, Violation};

use std::panic::{catch_unwind, AssertUnwindSafe};

/// Runs one seed. A panic inside a core (a failed invariant) is reported as a violation
/// with the panic message, so a failing seed is always printed and replayable.
pub fn run_seed<W: Workload>(opts: &SimOptions, workload: W) -> SeedReport {
    let o = opts.clone();
    match catch_unwind(AssertUnwindSafe(move || world::World::new(o, workload).run())) {
        Ok(report) => report,
        Err(panic) => {
            let msg = panic_message(panic);
            SeedReport {
                seed: opts.seed,
                violations: vec![Violation { property: "invariant", detail: msg, at: 0 }],
                ..SeedReport::default()
            }
        }
    }
}

/// For tests that show the checkers catch a deliberate bug under a service's workload:
/// runs `run` (the service's seed runner) with `mutation` under all faults at (u, r) for
/// seeds `1..=seeds` and returns the properties the first seed with a violation
/// violated (empty if none did).
pub fn first_violation(
    run: fn(&SimOptions) -> SeedReport,
    mutation: keel_core::quorum::Mutation,
    u: u32,
    r: u32,
    seeds: u64,
) -> Vec<&'static str> {
    let all = FaultSet { crash: true, network: true, byzantine: true };
    for seed in 1..=seeds {
        let report = run(&SimOptions { mutation: Some(mutation), ..SimOptions::new(seed, u, r, all) });
        if !report.violations.is_empty() {
            eprintln!("{mutation:?}: seed {seed} violated {:?}", report.violations);
            return report.violations.iter().map(|v| v.property).collect();
        }
    }
    Vec::new()
}

/// What a caught panic said (a failed invariant's message).
pub(crate) fn panic_message(panic: Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into())
}
