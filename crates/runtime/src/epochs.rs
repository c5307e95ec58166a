//! Epoch certificates kept on disk, as the EPOCH-CERTS message that carried them (so
//! decoding applies the wire's bounds). An RQ node keeps the ones it followed in its data
//! directory; clients keep them beside the cluster file, so that a process started after a
//! membership change begins in the current epoch instead of sending its first request to
//! removed nodes. Nothing here is trusted: whoever loads certificates follows them from
//! the cluster file's membership, checking every quorum, and ignores what does not follow.

use keel_core::codec;
use keel_core::message::{EpochCert, Message};
use std::path::Path;

pub(crate) const FILE: &str = "epochs";

/// The certificates kept in `dir`, if any (a file that does not decode is ignored).
pub(crate) fn load(dir: &Path) -> Option<Vec<EpochCert>> {
    let bytes = std::fs::read(dir.join(FILE)).ok()?;
    match codec::decode(&bytes) {
        Ok(Message::EpochCerts(certs)) => Some(certs),
        _ => None,
    }
}

/// The chain to keep: one certificate per epoch, oldest first, this process's own
/// (`followed`, each checked) where it has one and the kept file's elsewhere (another
/// process may have followed further).
pub(crate) fn merged(followed: Vec<EpochCert>, kept: Vec<EpochCert>) -> Vec<EpochCert> {
    let mut by_epoch = std::collections::BTreeMap::new();
    for cert in followed.into_iter().chain(kept) {
        by_epoch.entry(cert.next.epoch).or_insert(cert);
    }
    by_epoch.into_values().collect()
}

/// Replaces the file in `dir` with `certs`. Several client processes may write at once:
/// each through a file of its own, renamed over the kept one (the last rename wins, and
/// every version is a whole chain).
pub(crate) fn store(dir: &Path, certs: Vec<EpochCert>) -> std::io::Result<()> {
    let tmp = dir.join(format!("{FILE}.{}.tmp", std::process::id()));
    std::fs::write(&tmp, codec::encode(&Message::EpochCerts(certs)))?;
    std::fs::rename(&tmp, dir.join(FILE))
}
