//! Client identities of a `keel init` directory, claimed by the processes that use them.

use keel_runtime::lockfile::LockError;
use std::path::Path;

/// The client identity this process uses, locked for as long as it runs (kept open):
/// `--client N` if free, else the first free one. Two processes of one identity would
/// reuse each other's sequence numbers, and one's operations would time out.
pub fn claim(dir: &Path, wanted: Option<u64>) -> Result<(u64, std::fs::File), String> {
    let lock = |id: u64| keel_runtime::lockfile::try_lock(&dir.join(format!("client-{id}")).join("LOCK"));
    if let Some(id) = wanted {
        return match lock(id) {
            Ok(f) => Ok((id, f)),
            Err(LockError::Held { holder }) => Err(format!(
                "client identity {id} is in use by another process ({holder}); leave out --client and \
                 a free one is picked"
            )),
            Err(LockError::Io(e)) => Err(format!("client-{id}: {e}")),
        };
    }
    claim_many(dir, 1)?.pop().ok_or_else(|| format!("{}: no client identity claimed", dir.display()))
}

/// `count` client identities no other process is using, the lowest first, each locked
/// for as long as its file is kept (`keel bench`: one per benchmark client).
pub fn claim_many(dir: &Path, count: usize) -> Result<Vec<(u64, std::fs::File)>, String> {
    let lock = |id: u64| keel_runtime::lockfile::try_lock(&dir.join(format!("client-{id}")).join("LOCK"));
    let mut ids: Vec<u64> = std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().strip_prefix("client-")?.parse().ok())
        .collect();
    ids.sort_unstable();
    if ids.is_empty() {
        return Err(format!("{} holds no client identity (client-*); keel init makes them", dir.display()));
    }
    let mut claimed = Vec::with_capacity(count);
    for &id in &ids {
        if claimed.len() == count {
            break;
        }
        if let Ok(f) = lock(id) {
            claimed.push((id, f));
        }
    }
    if claimed.len() < count {
        return Err(format!(
            "{count} client identities needed, {} of the {} in {} are free (the others are in use by other \
             processes); wait, or make more with keel init --clients",
            claimed.len(),
            ids.len(),
            dir.display()
        ));
    }
    Ok(claimed)
}
