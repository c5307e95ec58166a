//! Following membership changes by their certificates (ARCHITECTURE §8): an epoch's
//! certificate is the stable checkpoint proof, signed by a quorum of the epoch before,
//! of the instance that applied the change. Nodes and clients of an earlier epoch walk a
//! chain of them to the newest membership. Apart from `membership` (what a membership
//! is) so that messages may carry memberships without the two depending on each other.

use crate::membership::Membership;
use crate::message::EpochCert;
use crate::quorum::NODES_MAX;

/// The certificates of `chain` (oldest first) that a node of `epoch` needs to reach its
/// end.
pub fn certs_after(chain: &[EpochCert], epoch: u64) -> Vec<EpochCert> {
    chain.iter().filter(|c| c.next.epoch > epoch).cloned().collect()
}

/// Why a chain of epoch certificates was not followed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CertError {
    #[error("certificate for epoch {got} does not follow epoch {current}")]
    Gap { current: u64, got: u64 },
    #[error("certificate names another previous membership or instance")]
    NotFollowing,
    #[error("certificate's proof signs another membership")]
    OtherMembership,
    #[error("certificate's proof lacks a quorum of valid signatures")]
    Unproven,
}

/// Walks certificates from `current` (oldest first; older ones are skipped): each must be
/// proven by the quorum of the membership before it. Returns the newest membership
/// reached and the certificates that led there (empty: no newer epoch), or the first
/// problem. `mutation` keeps a simulator's deliberate bug in the quorum sizes.
pub fn follow_certs(
    current: &Membership,
    certs: Vec<EpochCert>,
    mutation: Option<crate::quorum::Mutation>,
) -> Result<(Membership, Vec<EpochCert>), CertError> {
    let mut at = current.clone();
    let mut chain = Vec::new();
    for cert in certs {
        if cert.next.epoch <= at.epoch {
            continue;
        }
        if cert.next.epoch != at.epoch + 1 {
            return Err(CertError::Gap { current: at.epoch, got: cert.next.epoch });
        }
        let plain = Membership { previous: None, ..at.clone() };
        let previous = cert.next.previous.as_deref().map(Membership::digest);
        if previous != Some(plain.digest()) || cert.proof.seq != cert.next.since {
            return Err(CertError::NotFollowing);
        }
        if cert.proof.membership != cert.next.digest() {
            return Err(CertError::OtherMembership);
        }
        // Correct nodes only ever sign memberships the executor produced, which tolerate
        // their (u, r); checked anyway, so nothing downstream meets one that does not.
        if cert.next.quorums().is_err() || cert.next.members.len() > NODES_MAX {
            return Err(CertError::Unproven);
        }
        let quorum = at.quorums().map_err(|_| CertError::Unproven)?.with_mutation(mutation).order_quorum();
        let unchecked = mutation == Some(crate::quorum::Mutation::UnverifiedEpochCerts);
        if !unchecked && !crate::message::proof_signed(&crate::crypto::NodeKeys::new(&at.keys()), quorum, &cert.proof) {
            return Err(CertError::Unproven);
        }
        at = cert.next.clone();
        chain.push(cert);
    }
    Ok((at, chain))
}
