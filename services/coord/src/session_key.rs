//! Session passwords no node knows, so no node can take a session its client did not
//! bring to it.
//!
//! ZooKeeper's server makes a session's password and every server knows it: a client
//! that reconnects elsewhere shows it, and the server it reaches takes the session over.
//! Replicated as state, a password would be known to every node, Byzantine ones too, and
//! one of them could attach any client's session and keep it alive after its client died
//! (holding its locks and leadership for ever), or take it from a live client. So the
//! password a client holds is a secret only the front end it connected through saw:
//! 16 random bytes (what every ZooKeeper client stores; the C client copies exactly 16),
//! from which an Ed25519 key is derived. The replicated state keeps the public key (the
//! *verifier*). To attach, a front end signs (session, its own identity, the next
//! verifier) with the key from the password the client showed it: the nodes check the
//! signature without learning the secret, and a signature replayed by another identity
//! names the wrong one.
//!
//! Each attach hands the client a new secret (ZooKeeper clients keep the password of
//! every ConnectResponse), so front ends the client used before cannot follow it: the
//! old secret stays valid only until the new front end has heard from its client after
//! the handshake (its touch confirms the move), so a client whose ConnectResponse was
//! lost can still come back with the secret it holds.

use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};

/// Bytes in a password (ZooKeeper's own length).
pub const PASSWORD_LEN: usize = 16;

/// A verifier: the public key of a session's secret.
pub type Verifier = [u8; 32];

/// A session's secret: the password its client holds.
#[derive(Clone)]
pub struct SessionSecret([u8; PASSWORD_LEN]);

impl SessionSecret {
    /// A fresh secret from the operating system's generator.
    pub fn random() -> SessionSecret {
        SessionSecret(rand::random())
    }

    /// The secret in a password a client showed; `None` if it has another length (it
    /// cannot be one of ours).
    pub fn from_password(password: &[u8]) -> Option<SessionSecret> {
        password.try_into().ok().map(SessionSecret)
    }

    /// For deterministic tests and the simulator, which draw secrets from their seed.
    pub fn from_bytes(bytes: [u8; PASSWORD_LEN]) -> SessionSecret {
        SessionSecret(bytes)
    }

    pub fn password(&self) -> Vec<u8> {
        self.0.to_vec()
    }

    fn key(&self) -> SigningKey {
        SigningKey::from_bytes(&blake3::derive_key("keel-coord session key v1", &self.0))
    }

    pub fn verifier(&self) -> Verifier {
        self.key().verifying_key().to_bytes()
    }

    /// The proof an attach by `owner` carries: a signature over what it does.
    pub fn prove(&self, session: i64, owner: u64, next: &Verifier) -> Vec<u8> {
        self.key().sign(&attach_message(session, owner, next)).to_bytes().to_vec()
    }
}

/// What an attach signs: the session, the identity taking it, the verifier it installs.
fn attach_message(session: i64, owner: u64, next: &Verifier) -> Vec<u8> {
    let mut m = Vec::with_capacity(64);
    m.extend_from_slice(b"keel-coord attach v1");
    m.extend_from_slice(&session.to_le_bytes());
    m.extend_from_slice(&owner.to_le_bytes());
    m.extend_from_slice(next);
    m
}

/// Whether `proof` shows the secret of `verifier` attaching `session` for `owner` with
/// `next`. Anything malformed is simply not a proof.
pub fn verify(verifier: &Verifier, session: i64, owner: u64, next: &Verifier, proof: &[u8]) -> bool {
    let (Ok(key), Ok(sig)) = (VerifyingKey::from_bytes(verifier), <[u8; 64]>::try_from(proof)) else {
        return false;
    };
    key.verify_strict(&attach_message(session, owner, next), &Signature::from_bytes(&sig)).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proof_holds_only_for_its_session_owner_and_next_verifier() {
        let secret = SessionSecret::from_bytes([7; PASSWORD_LEN]);
        let next = SessionSecret::from_bytes([8; PASSWORD_LEN]).verifier();
        let proof = secret.prove(42, 2000 << 10, &next);
        let v = secret.verifier();
        assert!(verify(&v, 42, 2000 << 10, &next, &proof));
        assert!(!verify(&v, 43, 2000 << 10, &next, &proof), "another session");
        assert!(!verify(&v, 42, 2001 << 10, &next, &proof), "replayed by another identity");
        assert!(!verify(&v, 42, 2000 << 10, &[9; 32], &proof), "another next verifier");
        let other = SessionSecret::from_bytes([9; PASSWORD_LEN]);
        assert!(!verify(&other.verifier(), 42, 2000 << 10, &next, &proof), "another secret");
        assert!(!verify(&v, 42, 2000 << 10, &next, &proof[..63]), "truncated");
        assert!(!verify(&[0xff; 32], 42, 2000 << 10, &next, &proof), "not a key");
    }

    #[test]
    fn passwords_are_sixteen_bytes_and_fresh_ones_differ() {
        assert!(SessionSecret::from_password(&[1; 15]).is_none());
        assert!(SessionSecret::from_password(&[1; 17]).is_none());
        let a = SessionSecret::random();
        let b = SessionSecret::random();
        assert_eq!(a.password().len(), PASSWORD_LEN);
        assert_ne!(a.password(), b.password());
        let back = SessionSecret::from_password(&a.password()).map(|s| s.verifier());
        assert_eq!(back, Some(a.verifier()));
    }
}
