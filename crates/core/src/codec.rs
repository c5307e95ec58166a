//! The wire encoding: one version byte, then the message in postcard (varint, compact).
//!
//! Decoding never panics and never allocates much more than the frame it reads: the frame
//! is bounded by [`FRAME_MAX`], byte strings are copied only after their bytes were seen,
//! and serde caps speculative preallocation for sequences. After decoding, [`check_shape`]
//! enforces the per-field bounds below, so handlers see only messages whose counts fit the
//! protocol (a batch is never larger than `REQUESTS_PER_VALUE_MAX`, and so on).

use crate::message::{CertProof, Message, NewView, Proposal, Proposed, Read, Request, StableProof, Value, ViewChange};
use crate::quorum::NODES_MAX;

/// The current wire format. A node drops frames of any other version.
pub const WIRE_VERSION: u8 = 13;
/// The largest frame any node or client accepts.
pub const FRAME_MAX: usize = 16 << 20;
/// The largest operation (and result) a client may send.
pub const OP_BYTES_MAX: usize = 1 << 20;
/// Largest node-plane message ([`crate::message::Message::Plane`]).
pub const PLANE_BYTES_MAX: usize = 4 << 20;
/// The most requests one value (batch) may hold.
pub const REQUESTS_PER_VALUE_MAX: usize = 4096;
/// The most prepared certificates one view change may carry: one per instance of the
/// log above the stable checkpoint, so `Options::validate` keeps `log_max` within it.
pub const CERTS_PER_VIEW_CHANGE_MAX: usize = 4096;
/// The most chunks a checkpoint may have.
pub const CHUNKS_MAX: usize = 1 << 18;
/// Epoch certificates in one message (and kept by a node: older epochs are forgotten).
pub const EPOCH_CERTS_MAX: usize = 64;
/// The largest chunk of a checkpoint.
pub const CHUNK_BYTES_MAX: usize = 1 << 20;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("empty frame")]
    Empty,
    #[error("frame of {len} bytes exceeds the {max}-byte limit")]
    TooLarge { len: usize, max: usize },
    #[error("wire version {got}, expected {expected}")]
    Version { got: u8, expected: u8 },
    #[error("malformed message: {0}")]
    Malformed(String),
    #[error("{bytes} trailing bytes after the message")]
    Trailing { bytes: usize },
    #[error("{field} has {got} entries, limit {max}")]
    Bound { field: &'static str, got: usize, max: usize },
}

pub fn encode(msg: &Message) -> Vec<u8> {
    encode_after(&[], msg)
}

/// `prefix` followed by the encoded message, in one buffer (a transport's header goes
/// in front without copying the message).
pub fn encode_after(prefix: &[u8], msg: &Message) -> Vec<u8> {
    let mut out = Vec::with_capacity(prefix.len() + 64);
    out.extend_from_slice(prefix);
    out.push(WIRE_VERSION);
    // Serializing these plain data types into a Vec cannot fail.
    postcard::to_extend(msg, out).unwrap_or_default()
}

pub fn decode(frame: &[u8]) -> Result<Message, DecodeError> {
    let (&version, body) = frame.split_first().ok_or(DecodeError::Empty)?;
    if frame.len() > FRAME_MAX {
        return Err(DecodeError::TooLarge { len: frame.len(), max: FRAME_MAX });
    }
    if version != WIRE_VERSION {
        return Err(DecodeError::Version { got: version, expected: WIRE_VERSION });
    }
    let (msg, rest): (Message, &[u8]) =
        postcard::take_from_bytes(body).map_err(|e| DecodeError::Malformed(e.to_string()))?;
    if !rest.is_empty() {
        return Err(DecodeError::Trailing { bytes: rest.len() });
    }
    check_shape(&msg)?;
    Ok(msg)
}

fn bound(field: &'static str, got: usize, max: usize) -> Result<(), DecodeError> {
    if got > max {
        Err(DecodeError::Bound { field, got, max })
    } else {
        Ok(())
    }
}

fn check_request(r: &Request) -> Result<(), DecodeError> {
    bound("request.op", r.op.len(), OP_BYTES_MAX)?;
    bound("request.auth", r.auth.len(), NODES_MAX)?;
    bound("request.endorsements", r.endorsements.len(), NODES_MAX)?;
    r.endorsements.iter().try_for_each(|e| bound("endorsement.macs", e.macs.len(), NODES_MAX))
}

fn check_read(r: &Read) -> Result<(), DecodeError> {
    bound("read.op", r.op.len(), OP_BYTES_MAX)?;
    bound("read.auth", r.auth.len(), NODES_MAX)
}

fn check_value(v: &Value) -> Result<(), DecodeError> {
    bound("value.requests", v.requests.len(), REQUESTS_PER_VALUE_MAX)?;
    v.requests.iter().try_for_each(check_request)
}

fn check_proposal(p: &Proposal) -> Result<(), DecodeError> {
    bound("proposal.requests", p.requests.len(), REQUESTS_PER_VALUE_MAX)?;
    p.requests.iter().try_for_each(|r| match r {
        Proposed::Full(r) => check_request(r),
        Proposed::Digest(d) => {
            bound("request.endorsements", d.endorsements.len(), NODES_MAX)?;
            d.endorsements.iter().try_for_each(|e| bound("endorsement.macs", e.macs.len(), NODES_MAX))
        }
    })
}

fn check_stable(p: &StableProof) -> Result<(), DecodeError> {
    bound("stable.sigs", p.sigs.len(), NODES_MAX)
}

fn check_membership(m: &crate::membership::Membership) -> Result<(), DecodeError> {
    bound("membership.members", m.members.len(), NODES_MAX)?;
    m.members.iter().try_for_each(|x| bound("member.addr", x.addr.len(), crate::membership::ADDR_MAX))?;
    m.previous.as_deref().map_or(Ok(()), check_membership)
}

fn check_cert(c: &CertProof) -> Result<(), DecodeError> {
    bound("cert.writes", c.writes.len(), NODES_MAX)
}

fn check_view_change(vc: &ViewChange) -> Result<(), DecodeError> {
    check_stable(&vc.stable)?;
    bound("view_change.certs", vc.certs.len(), CERTS_PER_VIEW_CHANGE_MAX)?;
    vc.certs.iter().try_for_each(check_cert)
}

fn check_new_view(nv: &NewView) -> Result<(), DecodeError> {
    bound("new_view.view_changes", nv.view_changes.len(), NODES_MAX)?;
    nv.view_changes.iter().try_for_each(check_view_change)
}

/// What a node sends for `result`: the bytes if `full` (this node is the designated
/// replier, or the result is small), else their digest; the size alone if the result
/// exceeds [`OP_BYTES_MAX`], the bound on what a reply may carry.
pub fn reply_body(result: Vec<u8>, full: bool) -> crate::message::ReplyBody {
    use crate::message::ReplyBody;
    if result.len() > OP_BYTES_MAX {
        ReplyBody::TooLarge(result.len() as u64)
    } else if full {
        ReplyBody::Full(result)
    } else {
        ReplyBody::Hash(crate::message::result_digest(&result))
    }
}

/// Bounds every count in a decoded message.
pub fn check_shape(msg: &Message) -> Result<(), DecodeError> {
    match msg {
        Message::Request(r) | Message::Forward(r) => check_request(r),
        Message::Endorse { request, macs } => {
            check_request(request)?;
            bound("endorse.macs", macs.len(), NODES_MAX)
        }
        Message::Read(r) => check_read(r),
        Message::Reply(r) => match &r.body {
            crate::message::ReplyBody::Full(b) => bound("reply.body", b.len(), OP_BYTES_MAX),
            crate::message::ReplyBody::Hash(_)
            | crate::message::ReplyBody::NotReadOnly
            | crate::message::ReplyBody::TooLarge(_) => Ok(()),
        },
        Message::Propose { value, .. } => check_proposal(value),
        Message::Decided { value, .. } | Message::ValueBody { value, .. } => check_value(value),
        Message::EndorseDigest { macs, .. } => bound("endorse.macs", macs.len(), NODES_MAX),
        Message::FetchBodies { wanted, .. } => bound("fetch_bodies.wanted", wanted.len(), REQUESTS_PER_VALUE_MAX),
        Message::Bodies { ops, .. } => {
            bound("bodies.ops", ops.len(), REQUESTS_PER_VALUE_MAX)?;
            ops.iter().try_for_each(|op| bound("bodies.op", op.len(), OP_BYTES_MAX))
        }
        Message::ViewChange(vc) => check_view_change(vc),
        Message::NewView(nv) => check_new_view(nv),
        Message::StableCert(p) => check_stable(p),
        Message::EpochCerts(certs) => {
            bound("epoch_certs", certs.len(), EPOCH_CERTS_MAX)?;
            certs.iter().try_for_each(|c| {
                check_stable(&c.proof)?;
                check_membership(&c.next)
            })
        }
        Message::Manifest { chunks, .. } => bound("manifest.chunks", chunks.len(), CHUNKS_MAX),
        Message::Push { event, .. } => bound("push.event", event.len(), OP_BYTES_MAX),
        Message::Chunk { data, .. } => bound("chunk.data", data.len(), CHUNK_BYTES_MAX),
        Message::Plane { payload } => bound("plane.payload", payload.len(), PLANE_BYTES_MAX),
        Message::Write(_)
        | Message::Accept { .. }
        | Message::Checkpoint(_)
        | Message::Stop { .. }
        | Message::Status { .. }
        | Message::IndexProbe { .. }
        | Message::IndexAck { .. }
        | Message::PushAck { .. }
        | Message::FetchManifest { .. }
        | Message::FetchChunk { .. }
        | Message::FetchValue { .. }
        | Message::EpochQuery { .. }
        | Message::Rejoin
        | Message::RejoinInfo { .. } => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::crypto::{Digest, Sig};
    use crate::message::*;
    use proptest::prelude::*;

    fn arb_bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
        proptest::collection::vec(any::<u8>(), 0..max)
    }

    fn arb_digest() -> impl Strategy<Value = Digest> {
        any::<[u8; 32]>().prop_map(Digest)
    }

    fn arb_sig() -> impl Strategy<Value = Sig> {
        (any::<[u8; 32]>(), any::<[u8; 32]>()).prop_map(|(a, b)| {
            let mut s = [0u8; 64];
            s[..32].copy_from_slice(&a);
            s[32..].copy_from_slice(&b);
            Sig(s)
        })
    }

    fn arb_request() -> impl Strategy<Value = Request> {
        let endorsement = (any::<u32>(), proptest::collection::vec(any::<[u8; 16]>(), 0..5))
            .prop_map(|(node, macs)| Endorsement { node: NodeId(node), macs });
        (
            any::<u64>(),
            any::<u64>(),
            arb_bytes(100),
            proptest::collection::vec(any::<[u8; 16]>(), 0..5),
            proptest::collection::vec(endorsement, 0..3),
            proptest::option::of(arb_sig()),
        )
            .prop_map(|(client, seq, op, auth, endorsements, sig)| Request {
                auth,
                endorsements,
                sig,
                ..Request::new(ClientId(client), seq, op.into())
            })
    }

    fn arb_value() -> impl Strategy<Value = Value> {
        (any::<u64>(), proptest::collection::vec(arb_request(), 0..4))
            .prop_map(|(time, requests)| Value { time, requests })
    }

    fn arb_stable() -> impl Strategy<Value = StableProof> {
        (any::<u64>(), arb_digest(), proptest::collection::vec((any::<u32>().prop_map(NodeId), arb_sig()), 0..4))
            .prop_map(|(seq, root, sigs)| StableProof { seq: Seq(seq), root, membership: Digest([3; 32]), sigs })
    }

    fn arb_view_change() -> impl Strategy<Value = ViewChange> {
        let cert = (
            any::<u64>(),
            any::<u64>(),
            arb_digest(),
            proptest::collection::vec((any::<u32>().prop_map(MemberIndex), arb_sig()), 0..4),
        )
            .prop_map(|(view, seq, digest, writes)| CertProof {
                view: View(view),
                seq: Seq(seq),
                digest,
                writes,
            });
        (any::<u64>(), any::<u32>(), arb_stable(), proptest::collection::vec(cert, 0..3), arb_sig()).prop_map(
            |(view, from, stable, certs, sig)| ViewChange {
                view: View(view),
                from: MemberIndex(from),
                stable,
                certs,
                sig,
            },
        )
    }

    fn arb_message() -> impl Strategy<Value = Message> {
        prop_oneof![
            arb_request().prop_map(Message::Request),
            arb_request().prop_map(Message::Forward),
            (arb_request(), proptest::collection::vec(any::<[u8; 16]>(), 0..5))
                .prop_map(|(request, macs)| Message::Endorse { request, macs }),
            (any::<u64>(), any::<u64>(), any::<u64>(), arb_bytes(64)).prop_map(|(client, seq, epoch, event)| {
                Message::Push { client: ClientId(client), seq, epoch, event }
            }),
            (any::<u64>(), any::<u64>()).prop_map(|(client, upto)| Message::PushAck { client: ClientId(client), upto }),
            (arb_request(), 0..3u8, any::<u64>()).prop_map(|(r, c, after)| Message::Read(Read {
                client: r.client,
                seq: r.seq,
                consistency: match c {
                    0 => ReadConsistency::Serializable,
                    1 => ReadConsistency::Linearizable,
                    _ => ReadConsistency::Index,
                },
                after,
                op: r.op,
                auth: r.auth
            })),
            (
                any::<u64>(),
                any::<u64>(),
                any::<u64>(),
                prop_oneof![
                    arb_bytes(64).prop_map(ReplyBody::Full),
                    arb_digest().prop_map(ReplyBody::Hash),
                    Just(ReplyBody::NotReadOnly),
                    any::<u64>().prop_map(ReplyBody::TooLarge)
                ]
            )
                .prop_map(|(client, view, seq, body)| Message::Reply(Reply {
                    client: ClientId(client),
                    view: View(view),
                    seq,
                    body,
                    epoch: view / 3
                })),
            (any::<u64>(), any::<u64>(), arb_value(), any::<bool>()).prop_map(|(view, seq, value, digests)| {
                let value = if digests { Proposal::with_digests(&value) } else { value.into() };
                Message::Propose { view: View(view), seq: Seq(seq), value }
            }),
            (any::<u64>(), any::<u64>(), arb_digest(), proptest::collection::vec(any::<[u8; 16]>(), 0..5))
                .prop_map(|(client, seq, op, macs)| Message::EndorseDigest { client: ClientId(client), seq, op, macs }),
            (any::<u64>(), proptest::collection::vec((any::<u64>().prop_map(ClientId), arb_digest()), 0..4))
                .prop_map(|(seq, wanted)| Message::FetchBodies { seq: Seq(seq), wanted }),
            (any::<u64>(), proptest::collection::vec(arb_bytes(100), 0..4)).prop_map(|(seq, ops)| {
                Message::Bodies { seq: Seq(seq), ops: ops.into_iter().map(Payload::from).collect() }
            }),
            (any::<u64>(), any::<u64>(), arb_digest(), arb_sig()).prop_map(|(view, seq, digest, sig)| Message::Write(
                Write { view: View(view), seq: Seq(seq), digest, sig }
            )),
            (any::<u64>(), any::<u64>(), arb_digest()).prop_map(|(view, seq, digest)| Message::Accept {
                view: View(view),
                seq: Seq(seq),
                digest
            }),
            (any::<u64>(), arb_digest(), arb_sig()).prop_map(|(seq, root, sig)| {
                Message::Checkpoint(CheckpointVote { seq: Seq(seq), root, membership: root, sig })
            }),
            any::<u64>().prop_map(|view| Message::Stop { view: View(view) }),
            arb_view_change().prop_map(Message::ViewChange),
            (any::<u64>(), proptest::collection::vec(arb_view_change(), 0..3), arb_sig()).prop_map(
                |(view, view_changes, sig)| Message::NewView(NewView { view: View(view), view_changes, sig })
            ),
            (any::<u64>(), any::<u64>(), any::<u64>()).prop_map(|(view, executed, stable)| {
                Message::Status { view: View(view), executed: Seq(executed), stable: Seq(stable) }
            }),
            arb_stable().prop_map(Message::StableCert),
            (any::<u64>(), arb_value()).prop_map(|(seq, value)| Message::Decided { seq: Seq(seq), value }),
            any::<u64>().prop_map(|seq| Message::FetchManifest { seq: Seq(seq) }),
            (any::<u64>(), any::<u64>(), proptest::collection::vec(arb_digest(), 0..4))
                .prop_map(|(seq, len, chunks)| Message::Manifest { seq: Seq(seq), len, chunks }),
            (any::<u64>(), any::<u32>()).prop_map(|(seq, index)| Message::FetchChunk { seq: Seq(seq), index }),
            (any::<u64>(), any::<u32>(), arb_bytes(128)).prop_map(|(seq, index, data)| Message::Chunk {
                seq: Seq(seq),
                index,
                data
            }),
            (any::<u64>(), arb_digest()).prop_map(|(seq, digest)| Message::FetchValue { seq: Seq(seq), digest }),
            (any::<u64>(), arb_value()).prop_map(|(seq, value)| Message::ValueBody { seq: Seq(seq), value }),
            any::<u64>().prop_map(|round| Message::IndexProbe { round }),
            (any::<u64>(), any::<u64>())
                .prop_map(|(round, accepted)| Message::IndexAck { round, accepted: Seq(accepted) }),
            arb_bytes(256).prop_map(|payload| Message::Plane { payload }),
        ]
    }

    proptest! {
        #[test]
        fn encode_decode_round_trips(msg in arb_message()) {
            let bytes = encode(&msg);
            prop_assert_eq!(decode(&bytes), Ok(msg));
        }

        #[test]
        fn decode_never_panics_on_garbage(bytes in arb_bytes(512)) {
            let _ = decode(&bytes);
        }

        #[test]
        fn truncation_is_an_error(msg in arb_message(), cut in any::<prop::sample::Index>()) {
            let bytes = encode(&msg);
            let at = cut.index(bytes.len());
            // Every strict prefix fails cleanly (postcard has no optional trailing fields).
            prop_assert!(decode(&bytes[..at]).is_err());
        }
    }

    #[test]
    fn rejects_wrong_version_trailing_bytes_and_oversize() {
        let mut bytes = encode(&Message::Stop { view: View(3) });
        let other = WIRE_VERSION.wrapping_add(1);
        bytes[0] = other;
        assert_eq!(decode(&bytes), Err(DecodeError::Version { got: other, expected: WIRE_VERSION }));
        let mut bytes = encode(&Message::Stop { view: View(3) });
        bytes.push(0);
        assert_eq!(decode(&bytes), Err(DecodeError::Trailing { bytes: 1 }));
        let big = vec![WIRE_VERSION; FRAME_MAX + 1];
        assert!(matches!(decode(&big), Err(DecodeError::TooLarge { .. })));
        assert_eq!(decode(&[]), Err(DecodeError::Empty));
    }

    #[test]
    fn a_lying_length_does_not_allocate_it() {
        // A Chunk claiming 2^40 data bytes in a 16-byte frame must fail without allocating.
        let mut bytes = vec![WIRE_VERSION];
        bytes.push(16); // variant index of Chunk
        bytes.extend([1, 1]); // seq = 1, index = 1
        bytes.extend([0x80, 0x80, 0x80, 0x80, 0x80, 0x80, 0x20]); // varint 2^40
        assert!(matches!(decode(&bytes), Err(DecodeError::Malformed(_))));
    }

    #[test]
    fn oversized_batches_are_bounded() {
        let req = Request::new(ClientId(1), 1, Vec::new().into());
        let value = Value { time: 0, requests: vec![req; REQUESTS_PER_VALUE_MAX + 1] };
        let bytes = encode(&Message::Propose { view: View(0), seq: Seq(1), value: value.clone().into() });
        assert!(matches!(decode(&bytes), Err(DecodeError::Bound { field: "proposal.requests", .. })));
        let bytes = encode(&Message::Decided { seq: Seq(1), value });
        assert!(matches!(decode(&bytes), Err(DecodeError::Bound { field: "value.requests", .. })));
        let wanted = vec![(ClientId(1), Digest::default()); REQUESTS_PER_VALUE_MAX + 1];
        let bytes = encode(&Message::FetchBodies { seq: Seq(1), wanted });
        assert!(matches!(decode(&bytes), Err(DecodeError::Bound { field: "fetch_bodies.wanted", .. })));
        let bytes = encode(&Message::Plane { payload: vec![0; PLANE_BYTES_MAX + 1] });
        assert!(matches!(decode(&bytes), Err(DecodeError::Bound { field: "plane.payload", .. })));
        assert!(decode(&encode(&Message::Plane { payload: vec![0; PLANE_BYTES_MAX] })).is_ok());
    }

    #[test]
    fn a_proposal_with_digests_is_small_and_keeps_the_value_digest() {
        let op = |i: u8, len: usize| Payload::from(vec![i; len]);
        let value = Value {
            time: 7,
            requests: (0..10)
                .map(|i| Request::new(ClientId(i as u64), 1, op(i, if i == 0 { 10 } else { 1024 })))
                .collect(),
        };
        let proposal = Proposal::with_digests(&value);
        assert_eq!(proposal.digest(), value.digest());
        // The 10-byte operation stays inline; the nine 1 KiB ones become digests.
        assert!(matches!(proposal.requests[0], Proposed::Full(_)));
        assert!(proposal.requests[1..].iter().all(|p| matches!(p, Proposed::Digest(_))));
        let full = encode(&Message::Propose { view: View(0), seq: Seq(1), value: value.clone().into() }).len();
        let small = encode(&Message::Propose { view: View(0), seq: Seq(1), value: proposal.clone() }).len();
        assert!(full > 9 * 1024 && small < 1024, "full {full} bytes, with digests {small}");
        // Expanding needs every body, each hashing to its digest.
        let mut bodies: Vec<Option<Payload>> = value.requests.iter().map(|r| Some(r.op.clone())).collect();
        assert_eq!(proposal.clone().expand(&bodies), Some(value.clone()));
        bodies[3] = None;
        assert_eq!(proposal.clone().expand(&bodies), None);
        bodies[3] = Some(op(9, 1024));
        assert_eq!(proposal.expand(&bodies), None);
    }
}
