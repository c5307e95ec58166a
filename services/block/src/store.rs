//! A node's block data (Gnothi's preferred and reserve storage, §3.1) and, per block,
//! the version the node holds (Gnothi's COMPLETE bit, §3.6, as a version: a block is
//! COMPLETE where the held version equals the agreed one).
//!
//! Both are plain files under the node's data directory: `data` (sparse, the export's
//! size) and `held` (8 bytes per block). Preferred and reserve blocks share the one data
//! file: where a block sits does not change what it costs to read, and the reserve is a
//! count of blocks held outside their preferred set (`Local`), not a region. Writes are
//! not fsynced one by one: what makes an acknowledged write durable is the fsynced
//! PrepareData log (or in full mode the WAL) until a checkpoint syncs these files
//! (`Local::checkpoint`). Whatever these files say is checked against the agreed hash on
//! every read, so a torn or stale block is found, never served.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

pub struct Store {
    data: File,
    held_file: File,
    held: Vec<AtomicU64>,
    block_size: u64,
    /// Cleared when the file system refuses to punch holes (zeros are written instead,
    /// and [`Store::has_data`] then says there is nothing to reclaim).
    holes: AtomicBool,
}

impl Store {
    /// Opens (or creates, empty) the store of `blocks` blocks of `block_size` in `dir`.
    ///
    /// # Errors
    /// The files cannot be created, read or sized.
    pub fn open(dir: &Path, blocks: u64, block_size: u32) -> io::Result<Store> {
        std::fs::create_dir_all(dir)?;
        let open =
            |name: &str| OpenOptions::new().read(true).write(true).create(true).truncate(false).open(dir.join(name));
        let data = open("data")?;
        let held_file = open("held")?;
        let block_size = u64::from(block_size);
        data.set_len(blocks * block_size)?;
        let mut bytes = vec![0u8; (blocks * 8) as usize];
        let len = held_file.metadata()?.len();
        if len > 0 {
            let have = len.min(bytes.len() as u64) as usize;
            held_file.read_exact_at(&mut bytes[..have], 0)?;
        }
        held_file.set_len(blocks * 8)?;
        let held = bytes
            .chunks_exact(8)
            .map(|c| AtomicU64::new(u64::from_le_bytes(c.try_into().unwrap_or_default())))
            .collect();
        Ok(Store { data, held_file, held, block_size, holes: AtomicBool::new(true) })
    }

    pub fn blocks(&self) -> u64 {
        self.held.len() as u64
    }

    /// The version of block `b` this node holds (0: none written here).
    pub fn held(&self, b: u64) -> u64 {
        self.held.get(b as usize).map_or(0, |h| h.load(Ordering::Acquire))
    }

    /// The data of `count` blocks from `first` and the version held of each, as read.
    /// A write racing with the read can make the two disagree; the reader's hash check
    /// finds that.
    ///
    /// # Errors
    /// An I/O error of the data file.
    pub fn read(&self, first: u64, count: u64) -> io::Result<(Vec<u8>, Vec<u64>)> {
        let versions: Vec<u64> = (first..first + count).map(|b| self.held(b)).collect();
        let mut data = vec![0u8; (count * self.block_size) as usize];
        self.data.read_exact_at(&mut data, first * self.block_size)?;
        Ok((data, versions))
    }

    /// Stores `data` (whole blocks from `first`) as `version`.
    ///
    /// # Errors
    /// An I/O error; the blocks' held versions are then unchanged.
    pub fn write(&self, first: u64, data: &[u8], version: u64) -> io::Result<()> {
        self.data.write_all_at(data, first * self.block_size)?;
        self.set_held(first, std::iter::repeat_n(version, (data.len() as u64 / self.block_size) as usize))
    }

    /// Stores `data` (whole blocks from `first`), block `first + k` as `versions[k]`:
    /// one write for the data and one for the versions, however many blocks.
    ///
    /// # Errors
    /// An I/O error; the blocks' held versions are then unchanged.
    pub fn write_each(&self, first: u64, data: &[u8], versions: &[u64]) -> io::Result<()> {
        debug_assert_eq!(data.len() as u64, versions.len() as u64 * self.block_size);
        self.data.write_all_at(data, first * self.block_size)?;
        self.set_held(first, versions.iter().copied())
    }

    /// Makes `count` blocks from `first` zeros at `version` (a hole: no data written).
    ///
    /// # Errors
    /// An I/O error.
    pub fn zero(&self, first: u64, count: u64, version: u64) -> io::Result<()> {
        self.punch(first, count)?;
        self.set_held(first, std::iter::repeat_n(version, count as usize))
    }

    /// Drops the data of blocks this node no longer needs (reserve storage collected):
    /// held version 0, a hole in the file.
    ///
    /// # Errors
    /// An I/O error.
    pub fn drop_blocks(&self, first: u64, count: u64) -> io::Result<()> {
        self.release(first, count)?;
        self.punch(first, count)
    }

    /// Whether the file has data (not a hole) anywhere in these blocks: space a punch
    /// would give back. False on a file system without holes.
    ///
    /// # Errors
    /// An I/O error other than "no data past this offset".
    pub fn has_data(&self, first: u64, count: u64) -> io::Result<bool> {
        if !self.holes.load(Ordering::Relaxed) {
            return Ok(false);
        }
        let (offset, end) = (first * self.block_size, (first + count) * self.block_size);
        // SAFETY: lseek on a descriptor this struct owns; it touches no memory of ours.
        // Every read and write here is positional, so moving the file offset is harmless.
        let at = unsafe { libc::lseek(self.data.as_raw_fd(), offset as libc::off_t, libc::SEEK_DATA) };
        if at < 0 {
            let err = io::Error::last_os_error();
            return if err.raw_os_error() == Some(libc::ENXIO) { Ok(false) } else { Err(err) };
        }
        Ok((at as u64) < end)
    }

    /// Holds no version of these blocks any more (held 0), leaving their bytes where they
    /// are until a [`Store::drop_blocks`] over them: a hole punch is a journal
    /// transaction, so the caller may punch many released blocks at once.
    ///
    /// # Errors
    /// An I/O error writing the held versions (they are 0 in memory all the same).
    pub fn release(&self, first: u64, count: u64) -> io::Result<()> {
        self.set_held(first, std::iter::repeat_n(0, count as usize))
    }

    fn punch(&self, first: u64, count: u64) -> io::Result<()> {
        let (offset, len) = ((first * self.block_size) as libc::off_t, (count * self.block_size) as libc::off_t);
        // SAFETY: fallocate on a descriptor this struct owns, with in-range arguments; it
        // touches no memory of ours.
        let rc = unsafe {
            libc::fallocate(self.data.as_raw_fd(), libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, offset, len)
        };
        if rc == 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EOPNOTSUPP) {
            return Err(err);
        }
        self.holes.store(false, Ordering::Relaxed);
        // A file system without holes: write the zeros.
        let zeros = vec![0u8; (1 << 20).min(len as usize)];
        let mut at = offset as u64;
        let end = at + len as u64;
        while at < end {
            let n = (end - at).min(zeros.len() as u64) as usize;
            self.data.write_all_at(&zeros[..n], at)?;
            at += n as u64;
        }
        Ok(())
    }

    fn set_held(&self, first: u64, versions: impl ExactSizeIterator<Item = u64>) -> io::Result<()> {
        let mut bytes = Vec::with_capacity(versions.len() * 8);
        for (b, version) in (first..).zip(versions) {
            if let Some(h) = self.held.get(b as usize) {
                h.store(version, Ordering::Release);
            }
            bytes.extend_from_slice(&version.to_le_bytes());
        }
        self.held_file.write_all_at(&bytes, first * 8)
    }

    /// Makes everything written so far durable.
    ///
    /// # Errors
    /// An fsync failed.
    pub fn sync(&self) -> io::Result<()> {
        self.data.sync_data()?;
        self.held_file.sync_data()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_zeros_and_held_versions_survive_reopening() {
        let dir = tempfile::tempdir().expect("tempdir");
        {
            let s = Store::open(dir.path(), 16, 4096).expect("opens");
            s.write(2, &vec![7u8; 8192], 5).expect("writes");
            s.zero(3, 1, 6).expect("zeros");
            s.sync().expect("syncs");
        }
        let s = Store::open(dir.path(), 16, 4096).expect("reopens");
        let (data, held) = s.read(1, 3).expect("reads");
        assert_eq!(held, vec![0, 5, 6]);
        assert!(data[..4096].iter().all(|&b| b == 0));
        assert!(data[4096..8192].iter().all(|&b| b == 7));
        assert!(data[8192..].iter().all(|&b| b == 0));
        s.drop_blocks(2, 1).expect("drops");
        assert_eq!(s.held(2), 0);
        assert!(s.read(2, 1).expect("reads").0.iter().all(|&b| b == 0));
    }
}
