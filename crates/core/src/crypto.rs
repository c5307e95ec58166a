//! Digests (BLAKE3), node signatures (Ed25519) and client MAC authenticators (keyed BLAKE3).
//!
//! Every signed or MACed byte string starts with a domain tag, so a signature made for
//! one purpose (a WRITE vote) can never be replayed as another (a checkpoint vote).

use crate::ids::ClientId;
use ed25519_dalek::{Signer, Verifier};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// A 32-byte BLAKE3 digest.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
pub struct Digest(pub [u8; 32]);

impl Digest {
    pub fn of(bytes: &[u8]) -> Digest {
        Digest(*blake3::hash(bytes).as_bytes())
    }

    /// First eight bytes as a little-endian integer (for seeds and short trace labels).
    pub fn prefix_u64(&self) -> u64 {
        let mut b = [0u8; 8];
        b.copy_from_slice(&self.0[..8]);
        u64::from_le_bytes(b)
    }
}

impl fmt::Debug for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in &self.0[..6] {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// Incremental digest with a domain tag.
///
/// The builder methods take and give `&mut self`, not `self`: a `blake3::Hasher` is about
/// 1.9 KB (its chaining-value stack), and a by-value builder moved all of it at every
/// field. Statements are hashed several times per request, and those copies were the
/// largest single item in a BFT primary's profile (session 44: memmove 16 % of its CPU).
pub struct Hasher(blake3::Hasher);

impl Hasher {
    pub fn new(domain: &str) -> Hasher {
        let mut h = Hasher(blake3::Hasher::new());
        h.0.update(&(domain.len() as u32).to_le_bytes());
        h.0.update(domain.as_bytes());
        h
    }

    pub fn u64(&mut self, v: u64) -> &mut Hasher {
        self.0.update(&v.to_le_bytes());
        self
    }

    pub fn bytes(&mut self, b: &[u8]) -> &mut Hasher {
        self.0.update(&(b.len() as u64).to_le_bytes());
        self.0.update(b);
        self
    }

    pub fn digest(&mut self, d: &Digest) -> &mut Hasher {
        self.0.update(&d.0);
        self
    }

    pub fn finish(&self) -> Digest {
        Digest(*self.0.finalize().as_bytes())
    }
}

/// An Ed25519 signature. Serialized as exactly 64 bytes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Sig(pub [u8; 64]);

impl fmt::Debug for Sig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sig:{:02x}{:02x}", self.0[0], self.0[1])
    }
}

impl Serialize for Sig {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.0)
    }
}

impl<'de> Deserialize<'de> for Sig {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Sig, D::Error> {
        let bytes: &[u8] = serde_bytes::deserialize(d)?;
        let arr: [u8; 64] =
            bytes.try_into().map_err(|_| serde::de::Error::invalid_length(bytes.len(), &"64 signature bytes"))?;
        Ok(Sig(arr))
    }
}

/// A node's signing key.
#[derive(Clone)]
pub struct SigningKey(ed25519_dalek::SigningKey);

impl SigningKey {
    pub fn from_seed(seed: [u8; 32]) -> SigningKey {
        SigningKey(ed25519_dalek::SigningKey::from_bytes(&seed))
    }

    /// The key this node shares with the holder of `peer`'s secret: X25519 of this key's
    /// scalar and `peer`'s Montgomery form (the Ed25519 keys converted, as libsodium's
    /// `crypto_sign_ed25519_*_to_curve25519` do), hashed under `context`. Either side
    /// computes it from its own secret, so nodes need no table of pairwise keys and a
    /// node added later shares keys with every member at once. `None` for a key that is
    /// not a curve point, or a low-order one (which would make the secret guessable).
    pub fn shared_key(&self, peer: &PublicKey, context: &str) -> Option<MacKey> {
        let point = ed25519_dalek::VerifyingKey::from_bytes(&peer.0).ok()?.to_montgomery();
        let shared = point.mul_clamped(self.0.to_scalar_bytes()).to_bytes();
        if shared == [0; 32] {
            return None;
        }
        let mut h = blake3::Hasher::new_derive_key(context);
        h.update(&shared);
        Some(MacKey(*h.finalize().as_bytes()))
    }

    /// A MAC key only the holder of this signing key can compute, under `context`.
    pub fn private_key(&self, context: &str) -> MacKey {
        MacKey(blake3::derive_key(context, &self.0.to_bytes()))
    }

    pub fn public(&self) -> PublicKey {
        PublicKey(self.0.verifying_key().to_bytes())
    }

    pub fn sign(&self, statement: &Digest) -> Sig {
        Sig(self.0.sign(&statement.0).to_bytes())
    }
}

/// A node's public key, as the cluster configuration lists it.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, Deserialize)]
pub struct PublicKey(pub [u8; 32]);

impl PublicKey {
    /// Checks `sig` over `statement`. A malformed key or signature is just "invalid".
    pub fn verify(&self, statement: &Digest, sig: &Sig) -> bool {
        let Ok(key) = ed25519_dalek::VerifyingKey::from_bytes(&self.0) else {
            return false;
        };
        let sig = ed25519_dalek::Signature::from_bytes(&sig.0);
        key.verify(&statement.0, &sig).is_ok()
    }
}

/// The cluster's node keys, decompressed once: parsing a key is a point decompression,
/// a sizeable part of each verification when done per call.
#[derive(Clone, Debug)]
pub struct NodeKeys {
    /// The node id of the first key.
    first: u32,
    keys: Vec<Option<ed25519_dalek::VerifyingKey>>,
}

impl NodeKeys {
    /// Keys of nodes `0..keys.len()`.
    pub fn new(keys: &[PublicKey]) -> NodeKeys {
        NodeKeys::starting_at(0, keys)
    }

    /// Keys of nodes `first..first + keys.len()`.
    pub fn starting_at(first: u32, keys: &[PublicKey]) -> NodeKeys {
        NodeKeys { first, keys: keys.iter().map(|k| ed25519_dalek::VerifyingKey::from_bytes(&k.0).ok()).collect() }
    }

    /// Checks node `node`'s `sig` over `statement`; an unknown node, a malformed key or a
    /// malformed signature is just "invalid".
    pub fn verify(&self, node: u32, statement: &Digest, sig: &Sig) -> bool {
        let Some(Some(key)) = node.checked_sub(self.first).and_then(|i| self.keys.get(i as usize)) else {
            return false;
        };
        key.verify(&statement.0, &ed25519_dalek::Signature::from_bytes(&sig.0)).is_ok()
    }
}

/// `auth = sig`: client identities' public keys, decompressed once.
#[derive(Clone, Debug, Default)]
pub struct ClientKeys(std::collections::BTreeMap<ClientId, ed25519_dalek::VerifyingKey>);

impl ClientKeys {
    /// Keys that do not parse are left out (their owner cannot authenticate).
    pub fn new(keys: &std::collections::BTreeMap<ClientId, PublicKey>) -> ClientKeys {
        ClientKeys(
            keys.iter()
                .filter_map(|(id, k)| ed25519_dalek::VerifyingKey::from_bytes(&k.0).ok().map(|v| (*id, v)))
                .collect(),
        )
    }

    /// Checks many signatures at once (Ed25519 batch verification: about half the cost
    /// per signature of checking them one by one). True only if every one is valid and
    /// every owner known. Batch verification is cofactored, so it accepts every signature
    /// single verification accepts (and may accept some crafted ones it rejects); nodes
    /// check client signatures with this rule only, also one at a time, so that no
    /// grouping of requests makes two nodes disagree about one.
    pub fn verify_batch(&self, items: &[(ClientId, Digest, Sig)]) -> bool {
        if items.is_empty() {
            return true;
        }
        let mut keys = Vec::with_capacity(items.len());
        for (owner, _, _) in items {
            match self.0.get(owner) {
                Some(k) => keys.push(*k),
                None => return false,
            }
        }
        let messages: Vec<&[u8]> = items.iter().map(|(_, d, _)| &d.0[..]).collect();
        let sigs: Vec<ed25519_dalek::Signature> =
            items.iter().map(|(_, _, s)| ed25519_dalek::Signature::from_bytes(&s.0)).collect();
        ed25519_dalek::verify_batch(&messages, &sigs, &keys).is_ok()
    }
}

/// One entry of a client's MAC authenticator: a truncated keyed BLAKE3.
pub type Mac = [u8; 16];

/// A symmetric key shared by one client and one node.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct MacKey(pub [u8; 32]);

impl fmt::Debug for MacKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("MacKey(..)")
    }
}

impl MacKey {
    pub fn mac(&self, statement: &Digest) -> Mac {
        let full = blake3::keyed_hash(&self.0, &statement.0);
        let mut mac = [0u8; 16];
        mac.copy_from_slice(&full.as_bytes()[..16]);
        mac
    }

    /// Constant-time comparison, so a client cannot learn a MAC byte by byte.
    pub fn verify(&self, statement: &Digest, mac: &Mac) -> bool {
        let expect = self.mac(statement);
        expect.iter().zip(mac.iter()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_bind_statement_and_key() {
        let k = SigningKey::from_seed([7; 32]);
        let other = SigningKey::from_seed([8; 32]);
        let s = Hasher::new("test").u64(1).finish();
        let t = Hasher::new("test").u64(2).finish();
        let sig = k.sign(&s);
        assert!(k.public().verify(&s, &sig));
        assert!(!k.public().verify(&t, &sig));
        assert!(!other.public().verify(&s, &sig));
        let mut bad = sig;
        bad.0[10] ^= 1;
        assert!(!k.public().verify(&s, &bad));
        // Parsed once, same answers; unknown nodes are invalid.
        let keys = NodeKeys::new(&[other.public(), k.public()]);
        assert!(keys.verify(1, &s, &sig));
        assert!(!keys.verify(0, &s, &sig));
        assert!(!keys.verify(1, &t, &sig));
        assert!(!keys.verify(2, &s, &sig));
    }

    #[test]
    fn domains_separate_digests() {
        assert_ne!(Hasher::new("a").u64(1).finish(), Hasher::new("b").u64(1).finish());
        // Length-prefixed fields: ("ab","c") differs from ("a","bc").
        assert_ne!(
            Hasher::new("x").bytes(b"ab").bytes(b"c").finish(),
            Hasher::new("x").bytes(b"a").bytes(b"bc").finish()
        );
    }

    #[test]
    fn macs_verify_only_with_the_right_key() {
        let s = Digest::of(b"request");
        let k1 = MacKey([1; 32]);
        let k2 = MacKey([2; 32]);
        let m = k1.mac(&s);
        assert!(k1.verify(&s, &m));
        assert!(!k2.verify(&s, &m));
        assert!(!k1.verify(&Digest::of(b"other"), &m));
    }
}
