//! Proposals and votes for instances just above this node's high-water mark.
//!
//! A checkpoint becomes stable at each node when it has Q matching votes, and those
//! arrive in a different order everywhere: the primary may see its window open, and
//! propose past the old high-water mark, a moment before a backup does. Rejecting those
//! messages cost a retransmission period per checkpoint (they are resent only every
//! `retransmit_ms`); with checkpoints serialized in the background the window stays
//! closed longer and the race is common. So a node holds them, bounded, and steps them
//! in once its own stable checkpoint moves.

use super::{Outputs, Peer, Replica};
use crate::ids::MemberIndex;
use crate::message::{Message, Seq};
use crate::service::Service;
use std::collections::BTreeMap;

/// (sender, kind, instance) → the message and whether the verify stage checked it. At
/// most one per key, and instances within one `window` above the high-water mark: at most
/// `n × 3 × window` entries.
#[derive(Default)]
pub(super) struct Ahead {
    held: BTreeMap<(MemberIndex, &'static str, Seq), (Message, bool)>,
}

impl Ahead {
    pub(super) fn len(&self) -> usize {
        self.held.len()
    }
}

/// The instance of a message the window applies to, for the kinds worth holding.
fn instance(msg: &Message) -> Option<Seq> {
    match msg {
        Message::Propose { seq, .. } | Message::Accept { seq, .. } => Some(*seq),
        Message::Write(w) => Some(w.seq),
        _ => None,
    }
}

impl<S: Service> Replica<S> {
    /// Holds `msg` if it is a proposal or vote for an instance just above the high-water
    /// mark; gives it back otherwise.
    pub(super) fn hold_ahead(&mut self, from: Peer, msg: Message, checked: bool) -> Option<(Message, bool)> {
        let (Some(n), Some(seq)) = (self.index_of(from), instance(&msg)) else {
            return Some((msg, checked));
        };
        let high = self.high_water();
        if n == self.id || seq <= high || seq > high + self.cfg.options.window || !self.has_base() {
            return Some((msg, checked));
        }
        self.ahead.held.entry((n, msg.kind(), seq)).or_insert((msg, checked));
        None
    }

    /// Steps in what [`Replica::hold_ahead`] held and the window now covers.
    pub(super) fn release_ahead(&mut self, out: &mut Outputs) {
        let high = self.high_water();
        if self.ahead.held.keys().all(|(_, _, seq)| *seq > high) {
            return;
        }
        let (now, later): (BTreeMap<_, _>, BTreeMap<_, _>) =
            std::mem::take(&mut self.ahead.held).into_iter().partition(|((_, _, seq), _)| *seq <= high);
        self.ahead.held = later;
        for ((n, _, _), (msg, checked)) in now {
            self.on_message(self.member(n), msg, checked, out);
        }
    }
}
