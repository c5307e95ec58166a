//! Deliberate bugs in the simulator's driver side: what [`crate::world::World`] does with
//! a node's outputs, where the core's own deliberate bugs
//! ([`keel_core::quorum::Mutation`]) break the core. They show that the checkers catch a
//! driver that breaks the core's contract, as the runtime's driver could. `keel sim
//! --mutate` takes the names of both; a build without the `mutations` feature has
//! neither ([`crate::SimOptions::driver_mutation`] is then always None).

/// A deliberate bug in how the simulator drives a node, used only to prove that the
/// checkers can fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DriverMutation {
    /// At a durability barrier (`Outputs::barrier`, the two at an epoch's end) the driver
    /// steps `Input::Drained` without syncing: what the node wrote before and at the
    /// barrier stays pending, as any unsynced write, until a later sync covers it, and a
    /// crash before then loses it (the old epoch's last records, the new epoch's log).
    SkipBarrierSync,
}

impl DriverMutation {
    pub const ALL: [DriverMutation; 1] = [DriverMutation::SkipBarrierSync];

    pub fn name(self) -> &'static str {
        match self {
            DriverMutation::SkipBarrierSync => "skip-barrier-sync",
        }
    }

    pub fn from_name(name: &str) -> Option<DriverMutation> {
        DriverMutation::ALL.into_iter().find(|m| m.name() == name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use keel_core::quorum::Mutation;

    #[test]
    fn names_round_trip_and_differ_from_the_core_mutations() {
        for m in DriverMutation::ALL {
            assert_eq!(DriverMutation::from_name(m.name()), Some(m));
            assert_eq!(Mutation::from_name(m.name()), None, "{} names a core mutation too", m.name());
        }
    }
}
