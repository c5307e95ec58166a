//! Robust leadership (Aardvark §4.3, UpRight §4.2): a primary that stays within every
//! timeout but slows the system down is replaced.
//!
//! Request timers catch a primary that stops; they cannot catch one that delays each
//! proposal by a little less than the timeout. Every node therefore measures the
//! requests executed per window (`leader_window_ms`) while clients wait (this node held a
//! pending request at half the ticks of the window or more: a batch's replies leave its
//! clients with nothing pending for a moment, all at once), and compares the window with
//! the best windows of the last [`PEAK_VIEWS`] views. Two windows in a row below `leader_min_pct`
//! percent of the best make the node ask for the next view, as an expired request timer
//! would; the view changes once r + 1 nodes ask (join) and Q agree, as usual.
//!
//! Load changes must not look like a slow primary. A window is low only when its total
//! rate, its rate per waiting client and its request bytes are all low: fewer clients
//! lower the total but not the rate per client; more clients at saturation lower the rate
//! per client but not the total; larger requests lower both rates but not the bytes
//! (measured before bytes counted: 0 B -> 64 KiB requests at 8 x 4 cost two view
//! changes). A slow primary lowers all three. The first window of a view is not judged (it
//! carries the view change's backlog), and a window without sustained demand is neither
//! judged nor remembered.
//!
//! With `leader_rotate_ms` the primary is also rotated after that long in a view,
//! whatever its speed (Aardvark's regular view changes).

use super::{Event, Outputs, Replica};
use crate::message::View;
use crate::service::Service;
use std::collections::VecDeque;

/// Views whose best windows set the bar.
pub(super) const PEAK_VIEWS: usize = 4;

/// Windows in a row below the bar before a node asks to replace the primary.
const LOW_WINDOWS: u32 = 2;

/// A window's measurement.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Sample {
    /// Requests executed in the window.
    rate: u64,
    /// Requests executed per waiting client, in thousandths.
    per_client_milli: u64,
    /// Bytes of the requests executed (`Request::size`, never 0 per request).
    bytes: u64,
}

impl Sample {
    /// The better of two samples in each measure.
    fn max(self, o: Sample) -> Sample {
        Sample {
            rate: self.rate.max(o.rate),
            per_client_milli: self.per_client_milli.max(o.per_client_milli),
            bytes: self.bytes.max(o.bytes),
        }
    }

    /// Below `pct` percent of `bar` in every measure.
    fn below(self, bar: Sample, pct: u64) -> bool {
        self.rate * 100 < bar.rate * pct
            && self.per_client_milli * 100 < bar.per_client_milli * pct
            && self.bytes * 100 < bar.bytes * pct
    }
}

#[derive(Clone, Debug, Default)]
pub(super) struct Monitor {
    view: View,
    /// When this view was first seen here (for rotation).
    view_since: u64,
    /// Window in progress: start time, requests executed so far, ticks seen, the sum of
    /// waiting clients over those ticks, and the ticks that found somebody waiting.
    started: u64,
    executed: u64,
    executed_bytes: u64,
    ticks: u64,
    waiting_sum: u64,
    busy_ticks: u64,
    /// Complete windows in this view.
    windows: u32,
    low_streak: u32,
    /// The best window of each of the last `PEAK_VIEWS` views, current view last.
    peaks: VecDeque<(View, Sample)>,
    /// Windows still to close unjudged because this node stalled in them, and when it
    /// last ticked.
    excused: u32,
    last_tick: u64,
    /// Times this node asked to replace a slow primary (statistics).
    pub suspicions: u64,
}

impl Monitor {
    /// Requests executed for the first time (called from execution).
    pub(super) fn on_executed(&mut self, requests: usize, bytes: usize) {
        self.executed += requests as u64;
        self.executed_bytes += bytes as u64;
    }

    /// A new view starts its (empty) entry at once, so the bar ages by views even when
    /// views are too short or too slow to be remembered.
    fn enter_view(&mut self, view: View, now: u64) {
        self.view = view;
        if self.peaks.len() == PEAK_VIEWS {
            self.peaks.pop_front();
        }
        self.peaks.push_back((view, Sample::default()));
        self.view_since = now;
        self.windows = 0;
        self.low_streak = 0;
        self.restart(now);
    }

    /// Notes a tick. A gap of more than half a window since the last one means this node
    /// was not running (a checkpoint copying and hashing a large state, a long pause of
    /// the process or the host): the window in progress and the next one are not judged,
    /// though they still count toward the bar. Every node checkpoints at the same
    /// instance, so such a stall dips throughput everywhere, and that is nobody's fault,
    /// least of all the primary's. Gaps, not checkpoints, decide: under load a checkpoint
    /// falls every second or so, and excusing every window holding one switched the
    /// monitor off (the simulator's slow-primary test caught that).
    fn note_tick(&mut self, now: u64, window_ms: u64) {
        if self.last_tick > 0 && now.saturating_sub(self.last_tick) > window_ms / 2 {
            self.excused = 2;
        }
        self.last_tick = now;
    }

    /// This node's ordering window is closed: it executed up to its high-water mark and
    /// waits for a checkpoint to become stable (a large state takes a while to serialize,
    /// even in the background). Nobody orders more meanwhile, so the window in progress
    /// is not judged. Only the closed state excuses, not a checkpoint in progress: those
    /// fall every second or so under load, and excusing them would switch the monitor off.
    fn note_window_closed(&mut self) {
        self.excused = self.excused.max(1);
    }

    fn restart(&mut self, now: u64) {
        self.started = now;
        self.executed = 0;
        self.executed_bytes = 0;
        self.ticks = 0;
        self.waiting_sum = 0;
        self.busy_ticks = 0;
    }

    fn best(&self) -> Sample {
        self.peaks.iter().fold(Sample::default(), |best, (_, s)| best.max(*s))
    }

    /// Keeps `sample` as the current view's best if it is better.
    fn remember(&mut self, sample: Sample) {
        if let Some((_, peak)) = self.peaks.back_mut() {
            *peak = peak.max(sample);
        }
    }

    /// One tick with `waiting` clients waiting. Returns, when a window closes low for
    /// the `LOW_WINDOWS`th time in a row, the window and the bar it missed (and starts
    /// counting again).
    fn tick(&mut self, now: u64, waiting: usize, window_ms: u64, min_pct: u64) -> Option<(Sample, Sample)> {
        self.ticks += 1;
        self.waiting_sum += waiting as u64;
        self.busy_ticks += u64::from(waiting > 0);
        if now < self.started + window_ms {
            return None;
        }
        let sample = Sample {
            rate: self.executed,
            per_client_milli: (self.executed * 1000 * self.ticks).checked_div(self.waiting_sum).unwrap_or(0),
            bytes: self.executed_bytes,
        };
        let demand = self.ticks >= 2 && self.busy_ticks * 2 >= self.ticks;
        self.restart(now);
        self.windows += 1;
        if self.excused > 0 {
            // Not judged, but it may still set the bar (a stall only lowers a window).
            self.excused -= 1;
            if demand && self.windows > 1 {
                self.remember(sample);
            }
            return None;
        }
        if !demand {
            self.low_streak = 0;
            return None;
        }
        if self.windows == 1 {
            // The view's first window carries its view change: neither judged nor kept.
            return None;
        }
        let bar = self.best();
        if !sample.below(bar, min_pct) {
            self.low_streak = 0;
            self.remember(sample);
            return None;
        }
        self.low_streak += 1;
        if self.low_streak < LOW_WINDOWS {
            return None;
        }
        self.low_streak = 0;
        Some((sample, bar))
    }
}

impl<S: Service> Replica<S> {
    /// Measures the primary and asks for the next view when it is too slow, or when it
    /// has led for `leader_rotate_ms`. Called every tick.
    pub(super) fn watch_leadership(&mut self, out: &mut Outputs) {
        let o = &self.cfg.options;
        let (window_ms, min_pct, rotate_ms) = (o.leader_window_ms, o.leader_min_pct, o.leader_rotate_ms);
        // (A fresh node enters view 0 here too: every view has its entry in `peaks`.)
        if self.monitor.view != self.view || self.monitor.peaks.is_empty() {
            self.monitor.enter_view(self.view, self.now);
        }
        self.monitor.note_tick(self.now, window_ms);
        if self.exec.executed() >= self.high_water() {
            self.monitor.note_window_closed();
        }
        if self.vc_target.is_some() || self.transfer.is_some() {
            // Nothing is ordered meanwhile: not the primary's doing.
            self.monitor.restart(self.now);
            return;
        }
        if rotate_ms > 0 && self.now >= self.monitor.view_since + rotate_ms {
            self.suspect(self.view + 1, out);
            return;
        }
        if min_pct == 0 {
            return;
        }
        let Some((sample, bar)) = self.monitor.tick(self.now, self.pending.len(), window_ms, min_pct) else {
            return;
        };
        // The primary measures itself too (its peaks count once it is a backup again) but
        // does not ask to leave: the backups decide.
        if self.is_primary() {
            return;
        }
        self.monitor.suspicions += 1;
        out.events.push(Event::SlowPrimary { view: self.view, rate: sample.rate, best: bar.rate });
        self.suspect(self.view + 1, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A monitor in view 0, as `watch_leadership` sets one up.
    fn monitor() -> Monitor {
        let mut m = Monitor::default();
        m.enter_view(View(0), 0);
        m
    }

    /// Runs `windows` windows of 10 ticks with `waiting` clients and `per_window`
    /// requests of 100 bytes each; returns how many ended in a suspicion.
    fn run(m: &mut Monitor, now: &mut u64, windows: u32, waiting: usize, per_window: u64) -> u32 {
        run_sized(m, now, windows, waiting, per_window, 100)
    }

    fn run_sized(m: &mut Monitor, now: &mut u64, windows: u32, waiting: usize, per_window: u64, size: u64) -> u32 {
        let mut suspicions = 0;
        for _ in 0..windows {
            for t in 0..10 {
                *now += 10;
                if t == 0 {
                    m.on_executed(per_window as usize, (per_window * size) as usize);
                }
                m.note_tick(*now, 100);
                if m.tick(*now, waiting, 100, 50).is_some() {
                    suspicions += 1;
                }
            }
        }
        suspicions
    }

    #[test]
    fn a_primary_that_slows_down_is_suspected_after_two_low_windows() {
        let (mut m, mut now) = (monitor(), 0);
        assert_eq!(run(&mut m, &mut now, 5, 4, 1000), 0, "steady");
        assert_eq!(run(&mut m, &mut now, 1, 4, 100), 0, "one low window is noise");
        assert_eq!(run(&mut m, &mut now, 1, 4, 100), 1, "two in a row are not");
    }

    #[test]
    fn windows_in_which_this_node_stalled_are_not_judged() {
        let (mut m, mut now) = (monitor(), 0);
        assert_eq!(run(&mut m, &mut now, 5, 4, 1000), 0, "steady");
        // No tick for 300 ms (windows of 100): this node was busy, say checkpointing.
        now += 300;
        assert_eq!(run(&mut m, &mut now, 2, 4, 0), 0, "the stall dipped everyone's throughput");
        assert_eq!(run(&mut m, &mut now, 2, 4, 100), 1, "a slow primary after it is still caught");
        // Regular ticks excuse nothing: the same dip counts.
        let (mut m, mut now) = (monitor(), 0);
        run(&mut m, &mut now, 5, 4, 1000);
        assert_eq!(run(&mut m, &mut now, 2, 4, 0), 1);
    }

    #[test]
    fn fewer_clients_or_saturation_are_not_a_slow_primary() {
        let (mut m, mut now) = (monitor(), 0);
        run(&mut m, &mut now, 5, 8, 1000);
        // A quarter of the clients: a quarter of the total, same rate per client.
        assert_eq!(run(&mut m, &mut now, 5, 2, 250), 0);
        // Four times the clients at saturation: same total, a quarter per client.
        assert_eq!(run(&mut m, &mut now, 5, 32, 1000), 0);
        // Idle windows are not judged.
        assert_eq!(run(&mut m, &mut now, 5, 0, 0), 0);
        // Requests 100 times larger at a tenth of the rate: more bytes, not a slow primary.
        assert_eq!(run_sized(&mut m, &mut now, 5, 8, 100, 10_000), 0);
    }

    #[test]
    fn the_bar_comes_from_the_last_views_only() {
        let (mut m, mut now) = (monitor(), 0);
        run(&mut m, &mut now, 3, 4, 1000);
        // PEAK_VIEWS slower views later, the fast view no longer sets the bar.
        for v in 1..=PEAK_VIEWS as u64 {
            m.enter_view(View(v), now);
            run(&mut m, &mut now, 3, 4, 300);
        }
        assert!(m.peaks.iter().all(|(v, _)| *v >= View(1)));
        assert_eq!(m.best().rate, 300);
        assert_eq!(run(&mut m, &mut now, 3, 4, 200), 0, "200 is not below half of 300");
    }
}
