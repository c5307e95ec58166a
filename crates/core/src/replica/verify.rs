//! The verify stage (BFT-SMaRt §III): signature checks that depend on keys alone, so a
//! driver can run them before the protocol task, on other threads, and pass the message
//! in as [`Input::Checked`](super::Input::Checked).
//!
//! Only what is both hot and stateless is covered: the WRITE votes (Q-1 per instance in
//! BFT mode), checkpoint votes, and with `auth = sig` the client signatures of a
//! PROPOSE's requests (one batch verification per proposal). A message the stage cannot vouch for (another kind, a
//! bad signature, an unknown sender) goes in as a plain `Input::Message`, and the
//! protocol task checks, rejects and counts it exactly as without the stage. Each check
//! here is the one the protocol task makes, with the same statement and key.

use crate::config::Auth;
use crate::crypto::{ClientKeys, Digest, NodeKeys};
use crate::ids::MemberIndex;
use crate::message::{
    checkpoint_statement, owner_of, write_statement, CheckpointVote, Message, NodeId, Proposed, Request, Write,
};

/// Node `from`'s signature on its WRITE vote. The one check, for the stage and the
/// protocol task alike.
pub(super) fn write_signed(keys: &NodeKeys, epoch: &Digest, from: MemberIndex, w: &Write) -> bool {
    keys.verify(from.0, &write_statement(epoch, w.view, w.seq, &w.digest, from), &w.sig)
}

/// Node `from`'s signature on its checkpoint vote (`from`: its signer name,
/// [`super::signer_name`]).
pub(super) fn checkpoint_signed(keys: &NodeKeys, from: NodeId, v: &CheckpointVote) -> bool {
    keys.verify(from.0, &checkpoint_statement(v.seq, &v.root, &v.membership, from), &v.sig)
}

/// `auth = sig`: every request carries its client's valid signature (checked as one
/// batch).
pub(super) fn requests_signed<'a>(keys: &ClientKeys, requests: impl IntoIterator<Item = &'a Request>) -> bool {
    let mut items = Vec::new();
    for r in requests {
        let Some(sig) = r.sig else {
            return false;
        };
        items.push((owner_of(r.client), r.statement(), sig));
    }
    keys.verify_batch(&items)
}

#[derive(Clone, Debug)]
pub struct Verifier {
    /// The node this verifier works for: its own messages never arrive from the network.
    id: MemberIndex,
    /// The stable ids of the epoch's members, by index: the one translation the stage
    /// makes, as the replica's `on_message` does.
    members: Vec<NodeId>,
    keys: NodeKeys,
    /// The digest of the membership the node runs (statements name it).
    epoch: Digest,
    auth: Auth,
    client_keys: ClientKeys,
}

impl Verifier {
    pub(super) fn new(
        (id, members): (MemberIndex, Vec<NodeId>),
        keys: NodeKeys,
        epoch: Digest,
        auth: Auth,
        client_keys: ClientKeys,
    ) -> Verifier {
        Verifier { id, members, keys, epoch, auth, client_keys }
    }

    /// Whether `msg` from the member with stable id `from` carries a valid signature of a
    /// kind the protocol task may then skip checking. False means "not vouched for", not
    /// "invalid" (a node that is no member of the epoch is not vouched for).
    pub fn check(&self, from: NodeId, msg: &Message) -> bool {
        let Some(from) = self.members.iter().position(|m| *m == from).map(|i| MemberIndex(i as u32)) else {
            return false;
        };
        if from == self.id {
            return false;
        }
        match msg {
            Message::Write(w) => write_signed(&self.keys, &self.epoch, from, w),
            Message::Checkpoint(v) => checkpoint_signed(&self.keys, super::signer_name(from), v),
            Message::Propose { value, .. } if self.auth == Auth::Sig => {
                let full: Option<Vec<&Request>> = value.requests.iter().map(Proposed::full).collect();
                full.is_some_and(|requests| !requests.is_empty() && requests_signed(&self.client_keys, requests))
            }
            _ => false,
        }
    }
}
