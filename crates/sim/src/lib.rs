//! Keel's deterministic simulator: the real protocol cores under seeded faults, with
//! checkers for agreement, validity, exactly-once, linearizability, liveness after
//! healing, spurious view changes and checkpoint roots.
//!
//! It is a library too: [`run_seed`] runs any [`Workload`] (a [`keel_core::service::Service`]
//! plus client operations and an optional history checker) under the same faults.

pub mod byzantine;
pub mod disk;
pub mod linearizability;
pub mod workload;
pub mod world;

pub use byzantine::Behaviours;
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

/// What a caught panic said (a failed invariant's message).
pub(crate) fn panic_message(panic: Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into())
}
