//! The protocol's deliberate bugs are caught under the coord workload too (not only
//! under KV's): a quorum one short, a read answered before the node executed what it
//! accepted, and a client (a shim) that believes one reply.
// The mutations exist only in a build that has them.
#![cfg(feature = "mutations")]

use keel_coord_sim::run_coord_seed;
use keel_core::quorum::Mutation;

fn first_violation(mutation: Mutation, u: u32, r: u32, seeds: u64) -> Vec<&'static str> {
    keel_sim::first_violation(run_coord_seed, mutation, u, r, seeds)
}

#[test]
fn a_quorum_one_short_is_caught_under_the_coord_workload() {
    let p = first_violation(Mutation::QuorumMinusOne, 1, 1, 60);
    let caught = |p: &&str| matches!(*p, "agreement" | "exactly-once" | "checkpoint-roots" | "view-change-safety");
    assert!(p.iter().any(caught), "got {p:?}");
}

#[test]
fn reads_answered_before_executing_what_was_accepted_are_caught_under_the_coord_workload() {
    let p = first_violation(Mutation::ReadWithoutWait, 1, 0, 200);
    assert!(p.contains(&"linearizability"), "got {p:?}");
}

/// A client (the shim, or a node's front end) that takes the first reply it gets: a
/// lying node's answer reaches the application. Caught by the history checks (a reply
/// that is not coord's, or one that contradicts the others).
#[test]
fn a_client_that_believes_one_reply_is_caught_under_the_coord_workload() {
    let p = first_violation(Mutation::OneReply, 1, 1, 40);
    assert!(p.contains(&"linearizability"), "got {p:?}");
}
