//! When a node's own duties fall due: retransmissions, status broadcasts, view-change
//! timeouts. Time is the `now` each `step` is given (the driver's clock in
//! milliseconds; the simulator's in simulated ones), so a [`Timeout`] is plain data and
//! two nodes stepped with the same inputs fire on the same steps.
//!
//! Before this type each duty was a hand-rolled `next_x: u64` with its own
//! `if now >= next_x { next_x = now + period; ... }`, written out at every use; the
//! comparison and the re-arming now exist once.

/// A duty due at `due_at` and, once it fired, again `period_ms` after the step that fired
/// it (not after the missed deadline: a node that was not stepped for a while does one
/// catch-up round, not one per period it slept through).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeout {
    period_ms: u64,
    due_at: u64,
}

impl Timeout {
    /// Due at the first step, then every `period_ms`.
    pub const fn every(period_ms: u64) -> Timeout {
        Timeout { period_ms, due_at: 0 }
    }

    /// Whether it is due at `now`; if it is, it is armed again for a period from `now`.
    #[must_use = "a timeout that fired must run its duty: it is not due again for a period"]
    pub fn fire(&mut self, now: u64) -> bool {
        if now < self.due_at {
            return false;
        }
        self.due_at = now.saturating_add(self.period_ms);
        true
    }

    /// Whether it is due at `now`, without firing it.
    pub fn due(&self, now: u64) -> bool {
        now >= self.due_at
    }

    /// Due a period from `now`: the duty was just done by other means.
    pub fn restart(&mut self, now: u64) {
        self.due_at = now.saturating_add(self.period_ms);
    }

    /// Due `ms` from `now`, once; after it fires, every period again (a backoff).
    pub fn arm_for(&mut self, now: u64, ms: u64) {
        self.due_at = now.saturating_add(ms);
    }

    /// When it is next due.
    pub fn due_at(&self) -> u64 {
        self.due_at
    }

    /// The period it re-arms with.
    pub fn period_ms(&self) -> u64 {
        self.period_ms
    }
}

#[cfg(test)]
mod tests {
    use super::Timeout;

    #[test]
    fn fires_at_once_then_a_period_after_each_firing() {
        let mut t = Timeout::every(10);
        assert!(t.fire(5));
        assert!(!t.fire(14), "armed for 15");
        assert!(t.fire(15));
        // Late by far: fires once and is next due a period from now, not at 35.
        assert!(t.fire(100));
        assert!(!t.fire(109));
        assert!(t.fire(110));
    }

    #[test]
    fn a_backoff_holds_once_and_the_period_returns() {
        let mut t = Timeout::every(10);
        t.arm_for(0, 40);
        assert!(!t.due(39));
        assert!(t.fire(40));
        assert_eq!(t.due_at(), 50);
        t.restart(52);
        assert!(!t.fire(61));
        assert!(t.fire(62));
    }

    #[test]
    fn time_near_the_end_of_u64_does_not_wrap() {
        let mut t = Timeout::every(10);
        assert!(t.fire(u64::MAX - 3));
        assert_eq!(t.due_at(), u64::MAX);
        assert!(!t.fire(u64::MAX - 1));
    }
}
