//! The protocol's deliberate bugs are caught under the block workload too: a quorum one
//! short, and a read index answered without a quorum (block reads its metadata by read
//! index).
// The mutations exist only in a build that has them.
#![cfg(feature = "mutations")]

use keel_block_sim::run_block_seed;
use keel_core::quorum::Mutation;

fn first_violation(mutation: Mutation, u: u32, r: u32, seeds: u64) -> Vec<&'static str> {
    keel_sim::first_violation(run_block_seed, mutation, u, r, seeds)
}

#[test]
fn a_quorum_one_short_is_caught_under_the_block_workload() {
    let p = first_violation(Mutation::QuorumMinusOne, 1, 1, 60);
    let caught = |p: &&str| matches!(*p, "agreement" | "exactly-once" | "checkpoint-roots" | "view-change-safety");
    assert!(p.iter().any(caught), "got {p:?}");
}

#[test]
fn read_indexes_without_a_quorum_are_caught_under_the_block_workload() {
    let p = first_violation(Mutation::IndexWithoutQuorum, 1, 0, 200);
    assert!(p.contains(&"linearizability"), "got {p:?}");
}
