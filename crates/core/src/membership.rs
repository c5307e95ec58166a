//! Who the order nodes are, and how an administrator changes that (BFT-SMaRt §II-C3).
//!
//! A membership is numbered by its **epoch**. Epoch 0 is the cluster file's. An
//! administrator holding the cluster's admin key (created by `keel init`) signs an
//! [`AdminOp`] naming the epoch it applies to; it travels as a request of the reserved
//! client [`ADMIN_CLIENT`], is ordered like any request, and is verified and applied by
//! the executor, so every correct node applies the same changes at the same instance.
//! The instance that applied a change ends its epoch: nodes checkpoint right there, and
//! once that checkpoint is stable under the old membership they continue with the new
//! one (replica/epoch.rs).
//!
//! Nodes have a **stable id** (a node's name in certificates and `node.toml`) and, within
//! an epoch, an **index**: its position in [`Membership::members`], which is the
//! `NodeId` the protocol core uses. Removing a node shifts the indices of those after
//! it; stable ids never change.

use crate::crypto::{Digest, Hasher, MacKey, PublicKey, Sig, SigningKey};
use crate::ids::{ClientId, MemberIndex, NodeId, Seq};
use crate::quorum::{QuorumError, Quorums, NODES_MAX};
use serde::{Deserialize, Serialize};

/// The client identity administrative operations arrive from. Just below the identities
/// reserved for endorsements, so no `keel init` client gets it; its MAC keys derive like
/// any client's (the admin tool holds the node secrets), and with `auth = sig` its key is
/// the admin key.
pub const ADMIN_CLIENT: ClientId = ClientId(crate::ids::ENDORSER_OWNER_BASE.0 - 1);

/// Longest address a member may carry (it is gossiped in every membership).
pub const ADDR_MAX: usize = 256;

/// One order node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// Stable id: never reused, never renumbered.
    pub id: u32,
    /// Its Ed25519 public key (signatures on votes, checkpoints, view changes).
    pub key: PublicKey,
    /// Where peers and clients reach it (`host:port`); empty in the simulator.
    pub addr: String,
}

/// The order nodes of one epoch and the faults they tolerate.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Membership {
    pub epoch: u64,
    pub u: u32,
    pub r: u32,
    /// In index order.
    pub members: Vec<Member>,
    /// The last instance of the previous epoch (0 for epoch 0): this epoch's first
    /// stable checkpoint, proven by the previous membership.
    pub since: Seq,
    /// The highest stable id ever given out (ids are never reused).
    pub highest_id: u32,
    /// The membership of the epoch before (its own `previous` cleared), whose quorum
    /// proved the checkpoint at `since`: a node of this epoch checks that proof with it.
    pub previous: Option<Box<Membership>>,
}

/// What an administrator asks for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Change {
    /// A new node, with a stable id no member had before.
    Add(Member),
    /// A member leaves (by stable id).
    Remove(u32),
    /// Tolerate different faults with the same nodes.
    Faults { u: u32, r: u32 },
}

/// A signed change to epoch `epoch`'s membership.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AdminOp {
    pub epoch: u64,
    pub change: Change,
    pub sig: Sig,
}

/// Why an administrative operation was refused. Every correct node refuses the same
/// operations (they depend on agreed state only), and the admin gets the reason back.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum AdminError {
    #[error("the operation does not decode")]
    Malformed,
    #[error("this cluster was created without an admin key")]
    NoAdminKey,
    #[error("another membership change was decided in the same instance; retry in the new epoch")]
    ChangeInProgress,
    #[error("the admin signature is invalid")]
    BadSignature,
    #[error("the operation is for epoch {got}, the cluster is at epoch {current}")]
    WrongEpoch { current: u64, got: u64 },
    #[error("node {0} is already a member, or was one")]
    IdTaken(u32),
    #[error("node {0} is not a member")]
    NotMember(u32),
    #[error("address longer than {ADDR_MAX} bytes")]
    AddrTooLong,
    #[error("{0}")]
    Quorums(String),
    #[error("address {addr} is node {member}'s")]
    AddrTaken { addr: String, member: u32 },
}

/// The admin's answer: the membership the change produced, or why there is none.
pub type AdminResult = Result<Membership, AdminError>;

/// An admin answer as the reply carries it.
pub fn encode_result(result: &AdminResult) -> Vec<u8> {
    postcard::to_allocvec(result).unwrap_or_default()
}

/// An admin answer from reply bytes; `None` if they are not one.
pub fn decode_result(bytes: &[u8]) -> Option<AdminResult> {
    postcard::from_bytes(bytes).ok()
}

impl Change {
    fn statement(&self, epoch: u64) -> Digest {
        let body = postcard::to_allocvec(self).unwrap_or_default();
        Hasher::new("keel/admin-op").u64(epoch).bytes(&body).finish()
    }
}

impl AdminOp {
    pub fn sign(key: &SigningKey, epoch: u64, change: Change) -> AdminOp {
        let sig = key.sign(&change.statement(epoch));
        AdminOp { epoch, change, sig }
    }

    pub fn encode(&self) -> Vec<u8> {
        postcard::to_allocvec(self).unwrap_or_default()
    }

    pub fn decode(bytes: &[u8]) -> Result<AdminOp, AdminError> {
        postcard::from_bytes(bytes).map_err(|_| AdminError::Malformed)
    }

    pub fn verify(&self, admin: &PublicKey) -> bool {
        admin.verify(&self.change.statement(self.epoch), &self.sig)
    }
}

impl Membership {
    /// Epoch 0: nodes `0..keys.len()` with stable id = index.
    pub fn genesis(u: u32, r: u32, keys: &[PublicKey], addrs: &[String]) -> Membership {
        let members = keys
            .iter()
            .enumerate()
            .map(|(i, k)| Member { id: i as u32, key: *k, addr: addrs.get(i).cloned().unwrap_or_default() })
            .collect();
        Membership {
            epoch: 0,
            u,
            r,
            members,
            since: Seq(0),
            highest_id: keys.len().saturating_sub(1) as u32,
            previous: None,
        }
    }

    pub fn n(&self) -> usize {
        self.members.len()
    }

    /// What checkpoint votes sign about the membership (`message::checkpoint_statement`).
    pub fn digest(&self) -> Digest {
        Hasher::new("keel/membership").bytes(&postcard::to_allocvec(self).unwrap_or_default()).finish()
    }

    pub fn quorums(&self) -> Result<Quorums, QuorumError> {
        Quorums::with_nodes(self.u, self.r, self.members.len())
    }

    pub fn keys(&self) -> Vec<PublicKey> {
        self.members.iter().map(|m| m.key).collect()
    }

    /// The index of the member with stable id `id` in this epoch.
    pub fn index_of(&self, id: NodeId) -> Option<MemberIndex> {
        self.members.iter().position(|m| m.id == id.0).map(|i| MemberIndex(i as u32))
    }

    /// The stable id of the member at index `i`.
    pub fn id_of(&self, i: MemberIndex) -> Option<NodeId> {
        self.members.get(i.index()).map(|m| NodeId(m.id))
    }

    /// The membership after `op`, decided at instance `seq`, or why it is refused. A
    /// function of agreed state only: every correct node gets the same answer.
    pub fn apply(&self, op: &AdminOp, admin: &PublicKey, seq: Seq) -> AdminResult {
        if !op.verify(admin) {
            return Err(AdminError::BadSignature);
        }
        if op.epoch != self.epoch {
            return Err(AdminError::WrongEpoch { current: self.epoch, got: op.epoch });
        }
        let previous = Some(Box::new(Membership { previous: None, ..self.clone() }));
        let mut next = Membership { epoch: self.epoch + 1, since: seq, previous, ..self.clone() };
        match &op.change {
            Change::Add(m) => {
                // Ids are never reused: a removed node's old messages and certificates
                // must not speak for a newcomer.
                if m.id <= self.highest_id {
                    return Err(AdminError::IdTaken(m.id));
                }
                if m.id as usize >= NODES_MAX {
                    // Client authenticators have one entry per stable id.
                    return Err(AdminError::Quorums(format!("stable ids end at {}", NODES_MAX - 1)));
                }
                if m.addr.len() > ADDR_MAX {
                    return Err(AdminError::AddrTooLong);
                }
                // Two members at one address: one of them would never be reached.
                if let Some(x) = self.members.iter().find(|x| !m.addr.is_empty() && x.addr == m.addr) {
                    return Err(AdminError::AddrTaken { addr: m.addr.clone(), member: x.id });
                }
                if next.members.len() >= NODES_MAX {
                    return Err(AdminError::Quorums(format!("at most {NODES_MAX} nodes")));
                }
                next.members.push(m.clone());
                next.highest_id = m.id;
            }
            Change::Remove(id) => {
                let Some(i) = self.index_of(NodeId(*id)) else {
                    return Err(AdminError::NotMember(*id));
                };
                next.members.remove(i.index());
            }
            Change::Faults { u, r } => {
                next.u = *u;
                next.r = *r;
            }
        }
        next.quorums().map_err(|e| AdminError::Quorums(e.to_string()))?;
        Ok(next)
    }
}

/// `auth = rq-mac`: the key the holder of `signing` shares with each member of
/// `membership` (index order) for endorsements: the same key MACs its endorsements for
/// that member and checks that member's for it ([`crate::keys::endorse_key`]).
pub fn endorse_keys(signing: &SigningKey, membership: &Membership) -> Vec<MacKey> {
    membership.members.iter().map(|m| crate::keys::endorse_key(signing, &m.key)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(n: u32) -> Vec<PublicKey> {
        (0..n).map(|i| SigningKey::from_seed([i as u8 + 1; 32]).public()).collect()
    }

    fn admin() -> SigningKey {
        SigningKey::from_seed([99; 32])
    }

    fn member(id: u32) -> Member {
        Member { id, key: SigningKey::from_seed([id as u8 + 1; 32]).public(), addr: format!("127.0.0.1:{}", 7000 + id) }
    }

    #[test]
    fn add_then_remove_renumbers_indices_but_not_ids() {
        let g = Membership::genesis(1, 1, &keys(4), &[]);
        let a = admin();
        let add = AdminOp::sign(&a, 0, Change::Add(member(4)));
        let m1 = g.apply(&add, &a.public(), Seq(10)).expect("add");
        assert_eq!((m1.epoch, m1.n(), m1.since), (1, 5, Seq(10)));
        assert_eq!(m1.quorums().map(|q| q.order_quorum()), Ok(4));
        let rm = AdminOp::sign(&a, 1, Change::Remove(1));
        let m2 = m1.apply(&rm, &a.public(), Seq(20)).expect("remove");
        assert_eq!(m2.members.iter().map(|m| m.id).collect::<Vec<_>>(), vec![0, 2, 3, 4]);
        assert_eq!((m2.index_of(NodeId(4)), m2.id_of(MemberIndex(1))), (Some(MemberIndex(3)), Some(NodeId(2))));
        // Only one epoch back is kept: memberships do not grow with history.
        assert_eq!(m2.previous.as_ref().map(|p| (p.epoch, p.n(), p.previous.is_none())), Some((1, 5, true)));
    }

    #[test]
    fn refuses_forged_stale_reused_and_unsafe_changes() {
        let g = Membership::genesis(1, 1, &keys(4), &[]);
        let a = admin();
        let forged = AdminOp::sign(&SigningKey::from_seed([7; 32]), 0, Change::Remove(3));
        assert_eq!(g.apply(&forged, &a.public(), Seq(1)), Err(AdminError::BadSignature));
        let stale = AdminOp::sign(&a, 5, Change::Remove(3));
        assert_eq!(g.apply(&stale, &a.public(), Seq(1)), Err(AdminError::WrongEpoch { current: 0, got: 5 }));
        let mut twin = member(7);
        twin.addr = "10.0.0.1:7000".into();
        let g_addr = Membership {
            members: {
                let mut m = g.members.clone();
                m[1].addr = twin.addr.clone();
                m
            },
            ..g.clone()
        };
        let same_addr = AdminOp::sign(&a, 0, Change::Add(twin.clone()));
        assert_eq!(
            g_addr.apply(&same_addr, &a.public(), Seq(1)),
            Err(AdminError::AddrTaken { addr: twin.addr.clone(), member: g.members[1].id })
        );
        let reuse = AdminOp::sign(&a, 0, Change::Add(member(2)));
        assert_eq!(g.apply(&reuse, &a.public(), Seq(1)), Err(AdminError::IdTaken(2)));
        // An id once used and removed stays taken.
        let old = AdminOp::sign(&a, 0, Change::Add(member(5)));
        let after_removal = Membership { highest_id: 6, ..g.clone() };
        assert_eq!(after_removal.apply(&old, &a.public(), Seq(1)), Err(AdminError::IdTaken(5)));
        // Four nodes cannot lose one and still tolerate u = r = 1.
        let shrink = AdminOp::sign(&a, 0, Change::Remove(0));
        assert!(matches!(g.apply(&shrink, &a.public(), Seq(1)), Err(AdminError::Quorums(_))));
        let more = AdminOp::sign(&a, 0, Change::Faults { u: 2, r: 1 });
        assert!(matches!(g.apply(&more, &a.public(), Seq(1)), Err(AdminError::Quorums(_))));
        let fewer = AdminOp::sign(&a, 0, Change::Faults { u: 1, r: 0 });
        assert_eq!(g.apply(&fewer, &a.public(), Seq(1)).map(|m| (m.u, m.r)), Ok((1, 0)));
        let mut tampered = AdminOp::sign(&a, 0, Change::Remove(3));
        tampered.change = Change::Remove(2);
        assert_eq!(g.apply(&tampered, &a.public(), Seq(1)), Err(AdminError::BadSignature));
    }

    #[test]
    fn operations_round_trip_and_garbage_is_malformed() {
        let op = AdminOp::sign(&admin(), 3, Change::Faults { u: 2, r: 1 });
        assert_eq!(AdminOp::decode(&op.encode()), Ok(op));
        assert_eq!(AdminOp::decode(&[0xff, 0xff, 0xff]), Err(AdminError::Malformed));
    }
}
