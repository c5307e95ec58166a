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
    let mut ids: Vec<u64> = std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .flatten()
        .filter_map(|e| e.file_name().to_string_lossy().strip_prefix("client-")?.parse().ok())
        .collect();
    ids.sort_unstable();
    if ids.is_empty() {
        return Err(format!("{} holds no client identity (client-*); keel init makes them", dir.display()));
    }
    for &id in &ids {
        if let Ok(f) = lock(id) {
            return Ok((id, f));
        }
    }
    Err(format!(
        "all {} client identities of {} are in use by other processes; wait, or make more with keel init --clients",
        ids.len(),
        dir.display()
    ))
}
