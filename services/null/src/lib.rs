//! The microbenchmark service (BFT-SMaRt's ThroughputLatencyServer: 0/0 ... 4096/4096):
//! requests and replies of a chosen size and no state, so a benchmark measures the
//! replication and nothing else. Its own crate, so the runtime and the simulator depend
//! on no service (issue #22).

use keel_core::service::{ExecCtx, RestoreError, Service};

/// The microbenchmark service (BFT-SMaRt's 0/0 ... 4096/4096): does nothing and answers
/// with as many bytes as the request's first four bytes ask for (little endian; a request
/// shorter than four bytes gets an empty reply). Stateless, so snapshots are empty.
#[derive(Clone, Debug, Default)]
pub struct Null;

/// The largest reply the null service produces.
pub const NULL_REPLY_MAX: u32 = 1 << 20;

impl Null {
    /// A request of `req_bytes` bytes asking for `reply_bytes` back.
    pub fn request(req_bytes: usize, reply_bytes: u32) -> Vec<u8> {
        if reply_bytes == 0 {
            return vec![0; req_bytes];
        }
        let mut op = reply_bytes.to_le_bytes().to_vec();
        op.resize(req_bytes.max(4), 0);
        op
    }
}

impl Service for Null {
    fn execute(&mut self, request: &[u8], _ctx: &ExecCtx) -> Vec<u8> {
        let n = match request.get(..4) {
            Some(b) => u32::from_le_bytes([b[0], b[1], b[2], b[3]]).min(NULL_REPLY_MAX),
            None => 0,
        };
        vec![0; n as usize]
    }

    fn snapshot(&self) -> Vec<u8> {
        Vec::new()
    }

    fn restore(&mut self, _snapshot: &[u8]) -> Result<(), RestoreError> {
        Ok(())
    }
}

#[cfg(test)]
mod null_tests {
    use super::*;
    use keel_core::ids::ClientId;
    use keel_core::ids::Seq;

    #[test]
    fn replies_with_the_requested_size_and_bounds_it() {
        let ctx = ExecCtx::new(Seq(1), 0, 0, ClientId(1));
        let mut s = Null;
        assert_eq!(s.execute(&Null::request(0, 0), &ctx).len(), 0);
        assert_eq!(s.execute(&Null::request(1024, 1024), &ctx).len(), 1024);
        assert_eq!(Null::request(1024, 1024).len(), 1024);
        assert_eq!(s.execute(&u32::MAX.to_le_bytes(), &ctx).len(), NULL_REPLY_MAX as usize);
    }
}
