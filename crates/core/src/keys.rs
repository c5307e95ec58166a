//! The keys a node derives from its secrets: MAC keys shared with clients (per owner,
//! then per session) and, under `auth = rq-mac`, endorsement keys shared with peers.

use crate::crypto::{MacKey, SigningKey};
use crate::ids::{owner_of, session_of, ClientId};

/// Secrets of one node.
#[derive(Clone)]
pub struct NodeSecrets {
    pub signing: SigningKey,
    /// Root of the per-client MAC keys this node checks.
    pub mac_secret: [u8; 32],
}

impl NodeSecrets {
    pub fn new(signing: SigningKey, mac_secret: [u8; 32]) -> NodeSecrets {
        NodeSecrets { signing, mac_secret }
    }
}

/// The endorsement key the holder of `signing` shares with the holder of `peer`
/// ([`SigningKey::shared_key`]). A peer whose key is unusable gets a key derived from
/// this node's own secret, which nobody else can produce a MAC with.
pub fn endorse_key(signing: &SigningKey, peer: &crate::crypto::PublicKey) -> MacKey {
    signing.shared_key(peer, "keel 2026 endorsement").unwrap_or_else(|| signing.private_key("keel 2026 no endorsement"))
}

/// The MAC key client `client` shares with the node holding `mac_secret`. A session's
/// key derives from its owner's, so a client file (which holds the owner's keys) can
/// open sessions without new provisioning, and only the owner can.
pub fn client_mac_key(mac_secret: &[u8; 32], client: ClientId) -> MacKey {
    let owner = owner_of(client);
    let key = MacKey(*blake3::keyed_hash(mac_secret, &owner.0.to_le_bytes()).as_bytes());
    session_mac_key(&key, session_of(client))
}

/// The MAC key of session `session` from its owner's key (session 0 uses the owner's).
pub fn session_mac_key(owner_key: &MacKey, session: u64) -> MacKey {
    if session == 0 {
        return *owner_key;
    }
    let mut input = b"keel/session".to_vec();
    input.extend_from_slice(&session.to_le_bytes());
    MacKey(*blake3::keyed_hash(&owner_key.0, &input).as_bytes())
}
