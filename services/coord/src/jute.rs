//! Jute, ZooKeeper's serialization (`zookeeper-jute`): big-endian integers, a length
//! before every buffer, string and vector (-1 for null), one byte per boolean.
//!
//! Everything here reads bytes a client sent, so every length is checked against what
//! is left before anything is allocated: a frame that claims more than it holds is an
//! error, never a panic or a large allocation.

use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum JuteError {
    #[error("truncated: needed {needed} more bytes at offset {at}")]
    Truncated { at: usize, needed: usize },
    #[error("negative or oversized length {len} at offset {at}")]
    BadLength { at: usize, len: i32 },
    #[error("a string that is not UTF-8 at offset {at}")]
    NotUtf8 { at: usize },
}

/// Reads jute values from a byte slice.
pub struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    pub fn new(bytes: &'a [u8]) -> Reader<'a> {
        Reader { bytes, at: 0 }
    }

    pub fn remaining(&self) -> usize {
        self.bytes.len() - self.at
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], JuteError> {
        if self.remaining() < n {
            return Err(JuteError::Truncated { at: self.at, needed: n - self.remaining() });
        }
        let s = &self.bytes[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }

    pub fn int(&mut self) -> Result<i32, JuteError> {
        let b = self.take(4)?;
        Ok(i32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    pub fn long(&mut self) -> Result<i64, JuteError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(i64::from_be_bytes(a))
    }

    pub fn bool(&mut self) -> Result<bool, JuteError> {
        Ok(self.take(1)?[0] != 0)
    }

    /// A length: -1 is null (None); any other negative, or more than is left, an error.
    fn len(&mut self, unit: usize) -> Result<Option<usize>, JuteError> {
        let at = self.at;
        let len = self.int()?;
        if len == -1 {
            return Ok(None);
        }
        if len < 0 || (len as usize).saturating_mul(unit) > self.remaining() {
            return Err(JuteError::BadLength { at, len });
        }
        Ok(Some(len as usize))
    }

    /// A buffer; null reads as empty (ZooKeeper's servers treat them alike).
    pub fn buffer(&mut self) -> Result<Vec<u8>, JuteError> {
        match self.len(1)? {
            None => Ok(Vec::new()),
            Some(n) => Ok(self.take(n)?.to_vec()),
        }
    }

    /// A string; null reads as empty.
    pub fn string(&mut self) -> Result<String, JuteError> {
        let at = self.at;
        let bytes = self.buffer()?;
        String::from_utf8(bytes).map_err(|_| JuteError::NotUtf8 { at })
    }

    /// A vector of `read`; null reads as empty. Each element takes at least `min_bytes`,
    /// which bounds the count by what is left.
    pub fn vector<T>(
        &mut self,
        min_bytes: usize,
        mut read: impl FnMut(&mut Reader<'a>) -> Result<T, JuteError>,
    ) -> Result<Vec<T>, JuteError> {
        match self.len(min_bytes.max(1))? {
            None => Ok(Vec::new()),
            Some(n) => (0..n).map(|_| read(self)).collect(),
        }
    }

    pub fn strings(&mut self) -> Result<Vec<String>, JuteError> {
        self.vector(4, Reader::string)
    }
}

/// Writes jute values.
#[derive(Default)]
pub struct Writer(pub Vec<u8>);

impl Writer {
    pub fn new() -> Writer {
        Writer(Vec::with_capacity(64))
    }

    pub fn int(&mut self, v: i32) -> &mut Writer {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }

    pub fn long(&mut self, v: i64) -> &mut Writer {
        self.0.extend_from_slice(&v.to_be_bytes());
        self
    }

    pub fn bool(&mut self, v: bool) -> &mut Writer {
        self.0.push(u8::from(v));
        self
    }

    pub fn buffer(&mut self, v: &[u8]) -> &mut Writer {
        self.int(v.len() as i32);
        self.0.extend_from_slice(v);
        self
    }

    pub fn string(&mut self, v: &str) -> &mut Writer {
        self.buffer(v.as_bytes())
    }

    pub fn strings(&mut self, v: &[String]) -> &mut Writer {
        self.int(v.len() as i32);
        for s in v {
            self.string(s);
        }
        self
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_round_trip() {
        let mut w = Writer::new();
        w.int(-7).long(1 << 40).bool(true).buffer(b"ab").string("zk").strings(&["a".into(), "bc".into()]);
        let bytes = w.into_bytes();
        let mut r = Reader::new(&bytes);
        assert_eq!(r.int(), Ok(-7));
        assert_eq!(r.long(), Ok(1 << 40));
        assert_eq!(r.bool(), Ok(true));
        assert_eq!(r.buffer(), Ok(b"ab".to_vec()));
        assert_eq!(r.string(), Ok("zk".into()));
        assert_eq!(r.strings(), Ok(vec!["a".to_string(), "bc".to_string()]));
        assert_eq!(r.remaining(), 0);
    }

    #[test]
    fn lengths_beyond_the_frame_are_errors_not_allocations() {
        let mut bytes = (i32::MAX).to_be_bytes().to_vec();
        bytes.extend_from_slice(b"abc");
        assert!(matches!(Reader::new(&bytes).buffer(), Err(JuteError::BadLength { .. })));
        // A vector of a billion strings in 8 bytes.
        let bytes = [0x3b, 0x9a, 0xca, 0, 0, 0, 0, 0];
        assert!(matches!(Reader::new(&bytes).strings(), Err(JuteError::BadLength { .. })));
        assert!(matches!(Reader::new(&(-2i32).to_be_bytes()).buffer(), Err(JuteError::BadLength { .. })));
        assert_eq!(Reader::new(&(-1i32).to_be_bytes()).buffer(), Ok(Vec::new()));
        assert!(matches!(Reader::new(&[0, 0]).int(), Err(JuteError::Truncated { .. })));
        let bad_utf8 = [0, 0, 0, 1, 0xff];
        assert!(matches!(Reader::new(&bad_utf8).string(), Err(JuteError::NotUtf8 { .. })));
    }
}
