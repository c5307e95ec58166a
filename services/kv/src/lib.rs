//! A small deterministic key-value service: put, get, delete, compare-and-set.
//!
//! Requests and responses are postcard-encoded [`KvRequest`] / [`KvResponse`]. A request
//! that does not decode gets a [`KvResponse::Error`]: deterministic, so every replica
//! answers the same and none crashes on a client's garbage.

use keel_core::service::{ExecCtx, RestoreError, Service};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum KvRequest {
    Get { key: Vec<u8> },
    Put { key: Vec<u8>, value: Vec<u8> },
    Delete { key: Vec<u8> },
    /// Sets `new` iff the current value equals `expected` (None: the key is absent).
    Cas { key: Vec<u8>, expected: Option<Vec<u8>>, new: Vec<u8> },
    /// Up to `limit` entries whose key starts with `prefix`, in key order.
    Scan { prefix: Vec<u8>, limit: u32 },
}

/// The most entries one scan returns.
pub const SCAN_LIMIT_MAX: u32 = 10_000;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum KvResponse {
    Value(Option<Vec<u8>>),
    Done,
    Swapped(bool),
    Entries(Vec<(Vec<u8>, Vec<u8>)>),
    Error(String),
}

impl KvRequest {
    pub fn encode(&self) -> Vec<u8> {
        postcard::to_allocvec(self).unwrap_or_default()
    }

    pub fn decode(bytes: &[u8]) -> Result<KvRequest, postcard::Error> {
        postcard::from_bytes(bytes)
    }

    pub fn key(&self) -> &[u8] {
        match self {
            KvRequest::Get { key } | KvRequest::Put { key, .. } | KvRequest::Delete { key } | KvRequest::Cas { key, .. } => key,
            KvRequest::Scan { prefix, .. } => prefix,
        }
    }
}

impl KvResponse {
    pub fn encode(&self) -> Vec<u8> {
        postcard::to_allocvec(self).unwrap_or_default()
    }

    pub fn decode(bytes: &[u8]) -> Result<KvResponse, postcard::Error> {
        postcard::from_bytes(bytes)
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Kv {
    map: BTreeMap<Vec<u8>, Vec<u8>>,
}

impl Kv {
    pub fn new() -> Kv {
        Kv::default()
    }

    pub fn get(&self, key: &[u8]) -> Option<&[u8]> {
        self.map.get(key).map(Vec::as_slice)
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn apply(&mut self, req: KvRequest) -> KvResponse {
        match req {
            KvRequest::Get { key } => KvResponse::Value(self.map.get(&key).cloned()),
            KvRequest::Put { key, value } => {
                self.map.insert(key, value);
                KvResponse::Done
            }
            KvRequest::Delete { key } => {
                self.map.remove(&key);
                KvResponse::Done
            }
            KvRequest::Cas { key, expected, new } => {
                let swapped = self.map.get(&key) == expected.as_ref();
                if swapped {
                    self.map.insert(key, new);
                }
                KvResponse::Swapped(swapped)
            }
            KvRequest::Scan { prefix, limit } => {
                let entries = self
                    .map
                    .range(prefix.clone()..)
                    .take_while(|(k, _)| k.starts_with(&prefix))
                    .take(limit.min(SCAN_LIMIT_MAX) as usize)
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect();
                KvResponse::Entries(entries)
            }
        }
    }
}

impl Service for Kv {
    fn execute(&mut self, request: &[u8], _ctx: &ExecCtx) -> Vec<u8> {
        let response = match KvRequest::decode(request) {
            Ok(req) => self.apply(req),
            Err(e) => KvResponse::Error(format!("malformed request: {e}")),
        };
        response.encode()
    }

    fn snapshot(&self) -> Vec<u8> {
        // BTreeMap iterates in key order: equal maps give equal bytes.
        postcard::to_allocvec(&self.map).unwrap_or_default()
    }

    fn restore(&mut self, snapshot: &[u8]) -> Result<(), RestoreError> {
        self.map = postcard::from_bytes(snapshot).map_err(|e| RestoreError(format!("kv snapshot: {e}")))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx() -> ExecCtx {
        ExecCtx { seq: 1, time: 0, seed: 0, client: 1 }
    }

    fn run(kv: &mut Kv, req: KvRequest) -> KvResponse {
        KvResponse::decode(&kv.execute(&req.encode(), &ctx())).expect("decodes")
    }

    #[test]
    fn operations() {
        let mut kv = Kv::new();
        let k = b"k".to_vec();
        assert_eq!(run(&mut kv, KvRequest::Get { key: k.clone() }), KvResponse::Value(None));
        assert_eq!(run(&mut kv, KvRequest::Cas { key: k.clone(), expected: None, new: b"1".to_vec() }), KvResponse::Swapped(true));
        assert_eq!(run(&mut kv, KvRequest::Cas { key: k.clone(), expected: None, new: b"2".to_vec() }), KvResponse::Swapped(false));
        assert_eq!(run(&mut kv, KvRequest::Put { key: k.clone(), value: b"3".to_vec() }), KvResponse::Done);
        assert_eq!(run(&mut kv, KvRequest::Get { key: k.clone() }), KvResponse::Value(Some(b"3".to_vec())));
        assert_eq!(run(&mut kv, KvRequest::Delete { key: k.clone() }), KvResponse::Done);
        assert_eq!(run(&mut kv, KvRequest::Get { key: k }), KvResponse::Value(None));
    }

    #[test]
    fn scan_returns_a_bounded_prefix_range_in_order() {
        let mut kv = Kv::new();
        for k in ["a1", "b2", "b1", "b3", "c1"] {
            kv.apply(KvRequest::Put { key: k.into(), value: k.into() });
        }
        let r = run(&mut kv, KvRequest::Scan { prefix: b"b".to_vec(), limit: 2 });
        assert_eq!(r, KvResponse::Entries(vec![(b"b1".to_vec(), b"b1".to_vec()), (b"b2".to_vec(), b"b2".to_vec())]));
        let r = run(&mut kv, KvRequest::Scan { prefix: b"z".to_vec(), limit: 9 });
        assert_eq!(r, KvResponse::Entries(vec![]));
    }

    #[test]
    fn garbage_gets_an_error_not_a_panic() {
        let mut kv = Kv::new();
        let r = KvResponse::decode(&kv.execute(&[0xff, 0xff, 0xff], &ctx())).expect("decodes");
        assert!(matches!(r, KvResponse::Error(_)));
        assert!(kv.is_empty());
    }

    #[test]
    fn snapshot_round_trips_and_is_deterministic() {
        let mut a = Kv::new();
        let mut b = Kv::new();
        for i in 0..20u8 {
            a.apply(KvRequest::Put { key: vec![i], value: vec![i; 3] });
            b.apply(KvRequest::Put { key: vec![19 - i], value: vec![19 - i; 3] });
        }
        assert_eq!(a.snapshot(), b.snapshot());
        let mut c = Kv::new();
        c.restore(&a.snapshot()).expect("restores");
        assert_eq!(c, a);
        assert!(c.restore(&[1, 2, 3, 0xff]).is_err());
    }
}

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

    #[test]
    fn replies_with_the_requested_size_and_bounds_it() {
        let ctx = ExecCtx { seq: 1, time: 0, seed: 0, client: 1 };
        let mut s = Null;
        assert_eq!(s.execute(&Null::request(0, 0), &ctx).len(), 0);
        assert_eq!(s.execute(&Null::request(1024, 1024), &ctx).len(), 1024);
        assert_eq!(Null::request(1024, 1024).len(), 1024);
        assert_eq!(s.execute(&u32::MAX.to_le_bytes(), &ctx).len(), NULL_REPLY_MAX as usize);
    }
}
