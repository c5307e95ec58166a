//! Execution: runs decided values in order against the service, keeps the last reply of
//! every client (exactly-once), and produces checkpoints.
//!
//! Invariants:
//! - values execute in sequence order, each exactly once (`executed` only grows by one,
//!   or jumps to a checkpoint restored by state transfer);
//! - a request `(client, seq)` runs at most once: a request whose `seq` is not above the
//!   client's last executed `seq` is answered from the reply cache, never re-executed;
//! - agreed time never goes backwards (`time = max(time, value.time)`).

use crate::crypto::{Digest, Hasher};
use crate::message::{ClientId, Request, Seq, Value};
use crate::service::{ExecCtx, RestoreError, Service};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// The reply cache entry of one client.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct LastReply {
    seq: u64,
    #[serde(with = "serde_bytes")]
    result: Vec<u8>,
}

/// What a request's execution produced, for the reply path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    pub client: ClientId,
    pub seq: u64,
    pub result: Vec<u8>,
    /// False when this was a duplicate answered from the cache.
    pub fresh: bool,
}

pub struct Executor<S> {
    service: S,
    /// Last executed instance.
    executed: Seq,
    /// Agreed time of the last executed instance.
    time: u64,
    clients: BTreeMap<ClientId, LastReply>,
}

#[derive(Serialize, Deserialize)]
struct SnapshotBody {
    executed: Seq,
    time: u64,
    clients: BTreeMap<ClientId, LastReply>,
    #[serde(with = "serde_bytes")]
    service: Vec<u8>,
}

impl<S: Service> Executor<S> {
    pub fn new(service: S) -> Executor<S> {
        Executor { service, executed: 0, time: 0, clients: BTreeMap::new() }
    }

    pub fn executed(&self) -> Seq {
        self.executed
    }

    pub fn service(&self) -> &S {
        &self.service
    }

    /// The cached reply for `(client, seq)`, if that is the client's last executed request.
    pub fn cached(&self, client: ClientId, seq: u64) -> Option<&[u8]> {
        self.clients.get(&client).filter(|l| l.seq == seq).map(|l| l.result.as_slice())
    }

    /// The client's last executed sequence number.
    pub fn last_seq(&self, client: ClientId) -> u64 {
        self.clients.get(&client).map_or(0, |l| l.seq)
    }

    /// Executes instance `seq`, which must directly follow the last executed one.
    ///
    /// # Panics
    /// If `seq != executed + 1`: the caller orders execution.
    pub fn execute(&mut self, seq: Seq, value: &Value) -> Vec<Outcome> {
        assert_eq!(seq, self.executed + 1, "values execute in order");
        self.time = self.time.max(value.time);
        let seed = value.seed(seq);
        let mut out = Vec::with_capacity(value.requests.len());
        for (index, req) in value.requests.iter().enumerate() {
            out.push(self.execute_request(seq, seed, index as u64, req));
        }
        self.executed = seq;
        out
    }

    fn execute_request(&mut self, seq: Seq, seed: u64, index: u64, req: &Request) -> Outcome {
        let last = self.last_seq(req.client);
        if req.seq <= last {
            let result = self.cached(req.client, req.seq).map(<[u8]>::to_vec).unwrap_or_default();
            return Outcome { client: req.client, seq: req.seq, result, fresh: false };
        }
        let ctx = ExecCtx {
            seq,
            time: self.time,
            seed: Hasher::new("keel/request-seed").u64(seed).u64(index).finish().prefix_u64(),
            client: req.client,
        };
        let result = self.service.execute(&req.op, &ctx);
        self.clients.insert(req.client, LastReply { seq: req.seq, result: result.clone() });
        Outcome { client: req.client, seq: req.seq, result, fresh: true }
    }

    /// Service state, reply cache and position, deterministically serialized.
    pub fn snapshot(&self) -> Vec<u8> {
        let body = SnapshotBody {
            executed: self.executed,
            time: self.time,
            clients: self.clients.clone(),
            service: self.service.snapshot(),
        };
        postcard::to_allocvec(&body).unwrap_or_default()
    }

    /// Replaces everything with a snapshot (from state transfer or local recovery).
    ///
    /// # Errors
    /// If the bytes do not decode; the executor is unchanged then.
    pub fn restore(&mut self, bytes: &[u8]) -> Result<Seq, RestoreError> {
        let body: SnapshotBody =
            postcard::from_bytes(bytes).map_err(|e| RestoreError(format!("executor snapshot: {e}")))?;
        self.service.restore(&body.service)?;
        self.executed = body.executed;
        self.time = body.time;
        self.clients = body.clients;
        Ok(body.executed)
    }
}

/// A checkpoint split into fixed-size chunks with a Merkle root over them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Chunked {
    pub bytes: Vec<u8>,
    pub chunk_bytes: usize,
    pub leaves: Vec<Digest>,
    pub root: Digest,
}

impl Chunked {
    pub fn new(bytes: Vec<u8>, chunk_bytes: usize) -> Chunked {
        let leaves: Vec<Digest> =
            bytes.chunks(chunk_bytes).enumerate().map(|(i, c)| leaf_digest(i as u32, c)).collect();
        let root = merkle_root(bytes.len() as u64, &leaves);
        Chunked { bytes, chunk_bytes, leaves, root }
    }

    pub fn chunk(&self, index: u32) -> Option<&[u8]> {
        self.bytes.chunks(self.chunk_bytes).nth(index as usize)
    }
}

pub fn leaf_digest(index: u32, data: &[u8]) -> Digest {
    Hasher::new("keel/chunk").u64(index as u64).bytes(data).finish()
}

/// Binary Merkle tree over the chunk digests (an odd node is promoted), bound to the
/// total length so two snapshots that differ only in trailing bytes differ in root.
pub fn merkle_root(len: u64, leaves: &[Digest]) -> Digest {
    let mut level: Vec<Digest> = leaves.to_vec();
    while level.len() > 1 {
        level = level
            .chunks(2)
            .map(|pair| match pair {
                [l, r] => Hasher::new("keel/merkle").digest(l).digest(r).finish(),
                [one] => *one,
                _ => unreachable!("chunks(2) yields one or two"),
            })
            .collect();
    }
    let top = level.first().copied().unwrap_or_default();
    Hasher::new("keel/root").u64(len).u64(leaves.len() as u64).digest(&top).finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Appends every request to a log; replies with the log length.
    #[derive(Default)]
    struct Log(Vec<Vec<u8>>);
    impl Service for Log {
        fn execute(&mut self, request: &[u8], _ctx: &ExecCtx) -> Vec<u8> {
            self.0.push(request.to_vec());
            (self.0.len() as u64).to_le_bytes().to_vec()
        }
        fn snapshot(&self) -> Vec<u8> {
            postcard::to_allocvec(&self.0).unwrap_or_default()
        }
        fn restore(&mut self, s: &[u8]) -> Result<(), RestoreError> {
            self.0 = postcard::from_bytes(s).map_err(|e| RestoreError(e.to_string()))?;
            Ok(())
        }
    }

    fn req(client: u64, seq: u64, op: &[u8]) -> Request {
        Request { client, seq, op: op.to_vec(), auth: vec![] }
    }

    #[test]
    fn duplicates_are_answered_from_the_cache_not_re_executed() {
        let mut e = Executor::new(Log::default());
        let v = Value { time: 5, requests: vec![req(1, 1, b"a"), req(1, 1, b"a"), req(2, 1, b"b")] };
        let out = e.execute(1, &v);
        assert_eq!(out.iter().map(|o| o.fresh).collect::<Vec<_>>(), vec![true, false, true]);
        assert_eq!(out[0].result, out[1].result);
        assert_eq!(e.service().0.len(), 2);
        let out = e.execute(2, &Value { time: 1, requests: vec![req(1, 1, b"a")] });
        assert!(!out[0].fresh);
        assert_eq!(e.service().0.len(), 2);
    }

    #[test]
    #[should_panic(expected = "values execute in order")]
    fn out_of_order_execution_is_a_programming_error() {
        let mut e = Executor::new(Log::default());
        e.execute(2, &Value::null());
    }

    #[test]
    fn snapshot_restores_state_cache_and_position() {
        let mut a = Executor::new(Log::default());
        a.execute(1, &Value { time: 9, requests: vec![req(7, 1, b"x")] });
        let snap = a.snapshot();
        let mut b = Executor::new(Log::default());
        assert_eq!(b.restore(&snap), Ok(1));
        assert_eq!(b.snapshot(), snap);
        assert_eq!(b.cached(7, 1), a.cached(7, 1));
        assert!(b.restore(b"junk").is_err());
        assert_eq!(b.snapshot(), snap, "a failed restore changes nothing");
    }

    #[test]
    fn merkle_root_depends_on_every_chunk_and_the_length() {
        let a = Chunked::new((0..200u8).collect(), 64);
        assert_eq!(a.leaves.len(), 4);
        let mut bytes = a.bytes.clone();
        bytes[150] ^= 1;
        assert_ne!(Chunked::new(bytes, 64).root, a.root);
        let mut longer = a.bytes.clone();
        longer.push(0);
        assert_ne!(Chunked::new(longer, 64).root, a.root);
        assert_eq!(a.chunk(3).map(<[u8]>::len), Some(8));
        assert_eq!(merkle_root(a.bytes.len() as u64, &a.leaves), a.root);
    }
}
