//! One owner at a time: an advisory lock on a file (`flock`, std's `File::try_lock`)
//! that names its holder. A node's data directory is locked so (storage.rs), and so is a
//! client identity a CLI process uses (two processes of one identity would reuse each
//! other's sequence numbers). The kernel releases the lock when the holder exits,
//! however it exits.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::Path;

/// Someone else holds the lock.
#[derive(Debug)]
pub enum LockError {
    /// Held by another process (or another open file of this one): who, as it wrote it.
    Held {
        holder: String,
    },
    Io(io::Error),
}

/// Takes the lock on `path` (created if missing) and writes "pid N" into it; keep the
/// returned file open for as long as the lock must be held.
///
/// # Errors
/// [`LockError::Held`] if another open file holds it; I/O errors.
pub fn try_lock(path: &Path) -> Result<File, LockError> {
    let mut file =
        OpenOptions::new().create(true).truncate(false).read(true).write(true).open(path).map_err(LockError::Io)?;
    match file.try_lock() {
        Ok(()) => {
            file.set_len(0).map_err(LockError::Io)?;
            write!(file, "pid {}", std::process::id()).map_err(LockError::Io)?;
            Ok(file)
        }
        Err(fs::TryLockError::WouldBlock) => {
            let holder = fs::read_to_string(path).unwrap_or_default();
            Err(LockError::Held { holder: if holder.is_empty() { "pid unknown".into() } else { holder } })
        }
        Err(fs::TryLockError::Error(e)) => Err(LockError::Io(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_taker_is_told_who_holds_it_until_it_is_released() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("LOCK");
        let held = try_lock(&path).expect("free");
        match try_lock(&path) {
            Err(LockError::Held { holder }) => assert_eq!(holder, format!("pid {}", std::process::id())),
            other => panic!("expected Held, got {other:?}"),
        }
        drop(held);
        assert!(try_lock(&path).is_ok(), "released with its file");
    }
}
