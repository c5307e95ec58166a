//! Whether a copy of a block that one node served may be used. Every reader asks here —
//! the front end (its own node's copy and its peers'), recovery phase 2 and the
//! simulator's model — so the rule exists once: the copy must be of the agreed version
//! and hash to the agreed hash (beyond Gnothi, which trusts its replicas: a node that
//! serves wrong bytes at the claimed version is caught here).

use crate::meta::Hash;

/// What a served copy is, against the agreed (version, hash) of its block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Copy {
    /// The agreed version, with the agreed bytes: use it.
    Good,
    /// Claims the agreed version but its bytes do not hash to it: the node lies, or its
    /// disk does. Report it and ask another node.
    Wrong,
    /// An older version (the node is INCOMPLETE for this block): ask another node.
    Older,
    /// A newer version than the metadata read said: a write completed meanwhile, read
    /// the metadata again.
    Newer,
}

/// Judges `data`, which a node says is block version `held`, against `want` (the agreed
/// version and hash).
pub fn judge(want: (u64, Hash), held: u64, data: &[u8]) -> Copy {
    let (version, hash) = want;
    if held < version {
        Copy::Older
    } else if held > version {
        Copy::Newer
    } else if blake3::hash(data).as_bytes() == &hash {
        Copy::Good
    } else {
        Copy::Wrong
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_agreed_version_with_the_agreed_bytes_is_good() {
        let data = [7u8; 512];
        let hash = *blake3::hash(&data).as_bytes();
        assert_eq!(judge((3, hash), 3, &data), Copy::Good);
        assert_eq!(judge((3, hash), 3, &[8u8; 512]), Copy::Wrong);
        assert_eq!(judge((3, hash), 2, &data), Copy::Older, "the right bytes under an older version are not used");
        assert_eq!(judge((3, hash), 4, &data), Copy::Newer);
    }
}
