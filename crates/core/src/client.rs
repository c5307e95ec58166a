//! The client side of the protocol, sans-IO: request ids, MAC authenticators,
//! retransmission, reply voting and view tracking.
//!
//! A request goes to every order node (`auth = mac`). The client accepts a result once
//! r + 1 nodes vouch for the same result digest and it holds the full result matching it:
//! one designated node sends the full reply, the others only its digest. A retransmission
//! makes every node answer in full from its reply cache.

use crate::crypto::{Digest, MacKey};
use crate::message::{ClientId, Message, NodeId, Reply, ReplyBody, Request, View};
use crate::quorum::Quorums;
use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClientError {
    #[error("an operation is already in flight (one outstanding request per client)")]
    Busy,
    #[error("operation of {len} bytes exceeds the {max}-byte limit")]
    TooLarge { len: usize, max: usize },
}

/// One in-flight operation.
#[derive(Debug)]
struct Inflight {
    request: Request,
    /// When it was last (re)sent.
    sent_at: u64,
    /// Per node: the result digest it vouched for, and the full result if it sent one.
    replies: BTreeMap<NodeId, (Digest, Option<Vec<u8>>)>,
}

pub struct Client {
    id: ClientId,
    quorums: Quorums,
    /// MAC key shared with each order node, by node id.
    keys: Vec<MacKey>,
    /// Last sequence number used.
    seq: u64,
    /// Highest view that r + 1 nodes reported: some correct node is in it.
    view: View,
    retransmit_ms: u64,
    inflight: Option<Inflight>,
}

impl Client {
    /// `first_seq` lets a restarted client continue above sequence numbers it used before.
    pub fn new(id: ClientId, quorums: Quorums, keys: Vec<MacKey>, retransmit_ms: u64, first_seq: u64) -> Client {
        assert_eq!(keys.len(), quorums.order_nodes(), "one MAC key per order node");
        Client { id, quorums, keys, seq: first_seq.saturating_sub(1), view: 0, retransmit_ms, inflight: None }
    }

    pub fn id(&self) -> ClientId {
        self.id
    }

    pub fn view(&self) -> View {
        self.view
    }

    pub fn busy(&self) -> bool {
        self.inflight.is_some()
    }

    /// The sequence number of the in-flight operation.
    pub fn inflight_seq(&self) -> Option<u64> {
        self.inflight.as_ref().map(|i| i.request.seq)
    }

    /// Starts an operation: returns the messages to send (one per order node).
    ///
    /// # Errors
    /// `Busy` while another operation is in flight; `TooLarge` above the op bound.
    pub fn invoke(&mut self, now: u64, op: Vec<u8>) -> Result<Vec<(NodeId, Message)>, ClientError> {
        if self.inflight.is_some() {
            return Err(ClientError::Busy);
        }
        if op.len() > crate::codec::OP_BYTES_MAX {
            return Err(ClientError::TooLarge { len: op.len(), max: crate::codec::OP_BYTES_MAX });
        }
        self.seq += 1;
        let mut request = Request { client: self.id, seq: self.seq, op: op.into(), auth: Vec::new() };
        let statement = request.statement();
        request.auth = self.keys.iter().map(|k| k.mac(&statement)).collect();
        let msgs = self.to_all(&request);
        self.inflight = Some(Inflight { request, sent_at: now, replies: BTreeMap::new() });
        Ok(msgs)
    }

    fn to_all(&self, request: &Request) -> Vec<(NodeId, Message)> {
        (0..self.keys.len() as NodeId).map(|n| (n, Message::Request(request.clone()))).collect()
    }

    /// A reply from node `from`. Returns the result once r + 1 nodes agree on it.
    pub fn on_reply(&mut self, from: NodeId, reply: Reply) -> Option<Vec<u8>> {
        if from as usize >= self.keys.len() {
            return None;
        }
        let inflight = self.inflight.as_mut()?;
        if reply.seq != inflight.request.seq || reply.client != self.id {
            return None;
        }
        let digest = reply.body.result_digest();
        let full = match reply.body {
            ReplyBody::Full(bytes) => Some(bytes),
            ReplyBody::Hash(_) => None,
        };
        // A node's latest reply replaces its earlier one (a full reply after a hash).
        inflight.replies.insert(from, (digest, full));
        let need = self.quorums.reply_quorum();
        let agreeing: Vec<NodeId> =
            inflight.replies.iter().filter(|(_, (d, _))| *d == digest).map(|(n, _)| *n).collect();
        if agreeing.len() < need {
            return None;
        }
        let result =
            inflight.replies.values().find(|(d, f)| *d == digest && f.is_some()).and_then(|(_, f)| f.clone())?;
        self.note_view(reply.view);
        self.inflight = None;
        Some(result)
    }

    fn note_view(&mut self, view: View) {
        self.view = self.view.max(view);
    }

    /// Gives up on the in-flight operation (the caller timed out). It may still execute;
    /// the next operation uses a higher sequence number, so it cannot be confused with it.
    pub fn abandon(&mut self) {
        self.inflight = None;
    }

    /// Retransmits the in-flight request to every node when no result arrived in time.
    pub fn on_tick(&mut self, now: u64) -> Vec<(NodeId, Message)> {
        let Some(inflight) = &self.inflight else {
            return Vec::new();
        };
        if now < inflight.sent_at + self.retransmit_ms {
            return Vec::new();
        }
        let request = inflight.request.clone();
        if let Some(i) = self.inflight.as_mut() {
            i.sent_at = now;
        }
        self.to_all(&request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::result_digest;

    fn client(u: u32, r: u32) -> Client {
        let q = Quorums::new(u, r).expect("valid");
        let keys = (0..q.order_nodes()).map(|i| MacKey([i as u8; 32])).collect();
        Client::new(9, q, keys, 100, 1)
    }

    fn reply(seq: u64, body: ReplyBody) -> Reply {
        Reply { client: 9, view: 0, seq, body }
    }

    #[test]
    fn needs_r_plus_one_matching_with_one_full_body() {
        let mut c = client(1, 1);
        let msgs = c.invoke(0, b"op".to_vec()).expect("idle");
        assert_eq!(msgs.len(), 4);
        let Message::Request(req) = &msgs[0].1 else { panic!("request") };
        assert_eq!(req.auth.len(), 4);
        let h = result_digest(b"ok");
        assert_eq!(c.on_reply(1, reply(1, ReplyBody::Hash(h))), None);
        assert_eq!(c.on_reply(2, reply(1, ReplyBody::Hash(h))), None, "two hashes but no body");
        assert_eq!(c.on_reply(3, reply(1, ReplyBody::Full(b"ok".to_vec()))), Some(b"ok".to_vec()));
        assert!(!c.busy());
    }

    #[test]
    fn a_single_lying_node_cannot_decide_the_result() {
        let mut c = client(1, 1);
        c.invoke(0, b"op".to_vec()).expect("idle");
        assert_eq!(c.on_reply(0, reply(1, ReplyBody::Full(b"lie".to_vec()))), None);
        assert_eq!(c.on_reply(0, reply(1, ReplyBody::Full(b"lie".to_vec()))), None, "repeats do not count twice");
        assert_eq!(c.on_reply(1, reply(1, ReplyBody::Hash(result_digest(b"ok")))), None);
        assert_eq!(c.on_reply(2, reply(1, ReplyBody::Full(b"ok".to_vec()))), Some(b"ok".to_vec()));
    }

    #[test]
    fn cft_accepts_one_full_reply_and_ignores_stale_ones() {
        let mut c = client(1, 0);
        c.invoke(0, b"a".to_vec()).expect("idle");
        assert_eq!(c.invoke(0, b"b".to_vec()), Err(ClientError::Busy));
        assert_eq!(c.on_reply(0, reply(7, ReplyBody::Full(b"x".to_vec()))), None, "wrong seq");
        let other = Reply { client: 10, ..reply(1, ReplyBody::Full(b"x".to_vec())) };
        assert_eq!(c.on_reply(0, other), None, "another session's reply");
        assert_eq!(c.on_reply(0, reply(1, ReplyBody::Full(b"x".to_vec()))), Some(b"x".to_vec()));
    }

    #[test]
    fn retransmits_after_the_timeout_only() {
        let mut c = client(1, 1);
        c.invoke(0, b"op".to_vec()).expect("idle");
        assert!(c.on_tick(50).is_empty());
        assert_eq!(c.on_tick(100).len(), 4);
        assert!(c.on_tick(150).is_empty());
    }
}
