//! The check for serializable read-only KV gets (ARCHITECTURE §7): an answer must come
//! from the state after some prefix of the decided sequence that includes every ordered
//! operation the reader completed before it began.
//!
//! The simulator does not know the decided order of KV operations, only real time, so
//! the check uses what real time implies (puts write values never written before, so a
//! value names its write):
//! - the value was written by an operation invoked before the read returned (or is the
//!   absent value of a fresh key or of a delete);
//! - it is not older than what the reader itself knew: if the reader's last ordered
//!   operation on the key before the read wrote or read value `y`, the answer is not a
//!   value whose write completed before `y`'s write began (that write precedes `y`'s in
//!   every decided order), nor absent unless some delete of the key could follow `y`.
//!
//! Weaker than the full property (it does not pin down one prefix for all keys), but it
//! fails on exactly the bug that matters: a node answering before it executed the
//! reader's own writes.

use keel_core::message::ReadConsistency;
use keel_kv::{KvRequest, KvResponse};
use keel_sim::HistoryEntry;
use std::collections::HashMap;

/// When the operation that wrote a value was invoked, and when it returned (None: never
/// acknowledged, so it may have taken effect at any later time).
#[derive(Clone, Copy, Debug)]
struct Written {
    invoke: u64,
    ret: Option<u64>,
}

fn decode(h: &HistoryEntry) -> Option<(KvRequest, Option<(u64, KvResponse)>)> {
    let req = KvRequest::decode(&h.op).ok()?;
    let ret = match &h.ret {
        Some((t, bytes)) => Some((*t, KvResponse::decode(bytes).ok()?)),
        None => None,
    };
    Some((req, ret))
}

/// Checks every serializable get of `history`; `Err` describes the first bad answer.
pub fn check_serializable_reads(history: &[HistoryEntry]) -> Result<(), String> {
    let ops: Vec<_> = history.iter().map(|h| (h, decode(h))).collect();
    // Who wrote each value, and the deletes per key.
    let mut writes: HashMap<Vec<u8>, Written> = HashMap::new();
    let mut deletes: HashMap<Vec<u8>, Vec<Written>> = HashMap::new();
    for (h, op) in &ops {
        let Some((req, ret)) = op else { continue };
        let w = Written { invoke: h.invoke, ret: ret.as_ref().map(|(t, _)| *t) };
        match (req, ret.as_ref().map(|(_, r)| r)) {
            (KvRequest::Put { value, .. }, _) => {
                writes.insert(value.clone(), w);
            }
            (KvRequest::Cas { new, .. }, None | Some(KvResponse::Swapped(true))) => {
                writes.insert(new.clone(), w);
            }
            (KvRequest::Delete { key }, _) => deletes.entry(key.clone()).or_default().push(w),
            _ => {}
        }
    }
    for (i, (h, op)) in ops.iter().enumerate() {
        if h.read != Some(ReadConsistency::Serializable) {
            continue;
        }
        let Some((KvRequest::Get { key }, Some((ret_at, KvResponse::Value(got))))) = op else { continue };
        let name = String::from_utf8_lossy(key);
        if let Some(v) = got {
            match writes.get(v) {
                Some(w) if w.invoke < *ret_at => {}
                _ => {
                    return Err(format!(
                        "serializable get of {name:?} by client {} returned {:?}, never written before it returned",
                        h.client,
                        String::from_utf8_lossy(v)
                    ))
                }
            }
        }
        // The reader's last ordered operation on the key that completed before the read.
        let known = ops[..i]
            .iter()
            .filter(|(o, _)| o.client == h.client && o.read.is_none())
            .filter_map(|(o, op)| match op {
                Some((req, Some((t, resp)))) if *t <= h.invoke => Some((o, req, *t, resp)),
                _ => None,
            })
            .filter(|(_, req, _, _)| req_key(req) == Some(key.as_slice()))
            .max_by_key(|(_, _, t, _)| *t);
        let Some((_, req, _, resp)) = known else { continue };
        let seen = match (req, resp) {
            (KvRequest::Put { value, .. }, KvResponse::Done) => Some(value.clone()),
            (KvRequest::Cas { new, .. }, KvResponse::Swapped(true)) => Some(new.clone()),
            (KvRequest::Get { .. }, KvResponse::Value(v)) => v.clone(),
            _ => None,
        };
        let Some(seen) = seen else { continue };
        let Some(seen_write) = writes.get(&seen).copied() else { continue };
        let older = |w: &Written| w.ret.is_some_and(|t| t < seen_write.invoke);
        let stale = match got {
            Some(v) => writes.get(v).is_some_and(older),
            None => deletes.get(key).is_none_or(|ds| ds.iter().all(|d| older(d) || d.invoke >= *ret_at)),
        };
        if stale {
            let got = got.as_ref().map(|v| String::from_utf8_lossy(v).to_string());
            return Err(format!(
                "serializable get of {name:?} by client {} returned {got:?}, older than {:?} it had written or read \
                 before it began",
                h.client,
                String::from_utf8_lossy(&seen)
            ));
        }
    }
    Ok(())
}

fn req_key(req: &KvRequest) -> Option<&[u8]> {
    match req {
        KvRequest::Get { key }
        | KvRequest::Put { key, .. }
        | KvRequest::Delete { key }
        | KvRequest::Cas { key, .. } => Some(key),
        KvRequest::Scan { .. } | KvRequest::ScanPage { .. } | KvRequest::Watch { .. } | KvRequest::Unwatch { .. } => {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(client: u64, req: KvRequest, invoke: u64, ret: Option<(u64, KvResponse)>) -> HistoryEntry {
        HistoryEntry { client, op: req.encode(), invoke, ret: ret.map(|(t, r)| (t, r.encode())), read: None }
    }

    fn put(client: u64, v: &str, invoke: u64, ret: u64) -> HistoryEntry {
        entry(client, KvRequest::Put { key: b"k".to_vec(), value: v.into() }, invoke, Some((ret, KvResponse::Done)))
    }

    fn ser_get(client: u64, got: Option<&str>, invoke: u64, ret: u64) -> HistoryEntry {
        let mut e = entry(
            client,
            KvRequest::Get { key: b"k".to_vec() },
            invoke,
            Some((ret, KvResponse::Value(got.map(|g| g.as_bytes().to_vec())))),
        );
        e.read = Some(ReadConsistency::Serializable);
        e
    }

    #[test]
    fn a_reader_must_see_its_own_writes_but_not_necessarily_others() {
        // Client 1 writes a then b; client 2 writes c afterwards.
        let base = vec![put(1, "a", 0, 1), put(1, "b", 2, 3), put(2, "c", 4, 5)];
        // Client 1 reading b (its own) or c (newer): fine. Client 3, which wrote and read
        // nothing, reading a: fine for serializable (stale, but some prefix).
        for ok in [ser_get(1, Some("b"), 6, 7), ser_get(1, Some("c"), 6, 7), ser_get(3, Some("a"), 6, 7)] {
            let mut h = base.clone();
            h.push(ok);
            assert_eq!(check_serializable_reads(&h), Ok(()));
        }
        // Client 1 reading a after writing b: stale. Client 2 reading b after writing c:
        // stale. Absent with no delete: stale. A value nobody wrote: invented.
        for bad in [
            ser_get(1, Some("a"), 6, 7),
            ser_get(2, Some("b"), 6, 7),
            ser_get(1, None, 6, 7),
            ser_get(1, Some("z"), 6, 7),
        ] {
            let mut h = base.clone();
            h.push(bad.clone());
            assert!(check_serializable_reads(&h).is_err(), "{bad:?}");
        }
        // Reading a value whose write was still in flight: allowed (it may be decided).
        let mut h = base.clone();
        h.push(put(4, "d", 6, 20));
        h.push(ser_get(1, Some("d"), 7, 8));
        assert_eq!(check_serializable_reads(&h), Ok(()));
        // A value written only after the read returned: from the future.
        let mut h = base;
        h.push(ser_get(1, Some("e"), 6, 7));
        h.push(put(4, "e", 8, 9));
        assert!(check_serializable_reads(&h).is_err());
    }
}
