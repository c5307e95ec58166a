//! Write-ahead log records and their on-disk framing.
//!
//! A node persists a record BEFORE it sends the message the record justifies: the
//! accepted proposal before its CFT ACCEPT (in BFT, a vote horizon covering the instance
//! before its WRITE), the prepared certificate before its ACCEPT, its view-change
//! commitment before the VIEW-CHANGE, and a decision before any reply. So a node that crashes and recovers never contradicts what it said (UpRight §4.2:
//! safe even if every node crashes at once).
//!
//! Framing of one record: `len: u32 LE | crc32c(segment LE ++ payload): u32 LE | payload
//! (postcard)`. Recovery reads records until the first one that is short or fails its
//! checksum (a torn last write) and reports where the valid prefix ends, so the tail can
//! be truncated. The checksum covers the number of the segment the record was written to,
//! so that a recycled segment file's old records fail it and read as the end of the log.

use crate::crypto::Digest;
use crate::message::{Cert, EpochCert, NewView, Seq, StableProof, Value, View};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Record {
    /// The node installed `view`; instances up to `floor` were settled by its NEW-VIEW.
    View { view: View, floor: Seq },
    /// The node sent VIEW-CHANGE for `view`: it may never act in a lower view again.
    ViewChangeSent { view: View },
    /// The node accepted this proposal for `seq` in `view` (and voted for it).
    Accepted { view: View, seq: Seq, value: Value },
    /// The node prepared this certificate (BFT) and sent ACCEPT for it.
    Prepared(Cert),
    /// Instance `seq` decided the value with `digest`.
    Decided { seq: Seq, digest: Digest },
    /// The body of a decided value learned from peers rather than voted on.
    DecidedValue { seq: Seq, value: Value },
    /// The newest stable checkpoint the node knows a proof for.
    Stable(StableProof),
    /// The node runs the epoch the last certificate leads to (first record of a log
    /// compacted in an epoch above 0; replica/epoch.rs).
    Epoch(Vec<EpochCert>),
    /// Separated execution: the newest execution checkpoint certified by `r + 1`
    /// execution nodes (replica/separated.rs). Kept so that after a restart of every
    /// node the order nodes still know which state the execution nodes agreed on.
    ExecStable(StableProof),
    /// The node lost its disk and rejoins (replica/rejoin.rs): it casts no vote until it
    /// passes `bounds` (the view it waits for, the executed instance its stable
    /// checkpoint must pass by `log_max`), unknown until Q others answered.
    Rejoining { bounds: Option<(View, Seq)> },
    /// Rejoining is over: the node votes again.
    Rejoined,
    /// The NEW-VIEW that installed the view of the `View` record that follows: the node's
    /// proof of its view, which it relays to peers in lower views (replica/catch_up.rs),
    /// after a restart too. Written just before that record, in the same batch, so that
    /// a durable `View` record has its proof durable (a log is read up to its first torn
    /// record), and kept by every compaction. Bounded like the NEW-VIEW frame it was
    /// sent in: `ClusterConfig` validation keeps Q view changes of `log_max` certificates
    /// within `FRAME_MAX` (= [`RECORD_BYTES_MAX`]).
    NewView(NewView),
    /// BFT: the node may have sent WRITEs in `view` for instances up to `seq`, and for no
    /// instance above it (replica/normal.rs, "vote horizon"). Written, and durable, before
    /// the first WRITE it covers, so that the Accepted record behind each WRITE need not
    /// be: a node that recovers abstains in `view` up to `seq`, where it may have voted
    /// for a proposal it no longer remembers.
    VoteHorizon { view: View, seq: Seq },
}

impl Record {
    /// The instance this record belongs to, for garbage collection.
    pub fn seq(&self) -> Option<Seq> {
        match self {
            Record::Accepted { seq, .. } | Record::Decided { seq, .. } | Record::DecidedValue { seq, .. } => Some(*seq),
            Record::Prepared(c) => Some(c.seq),
            Record::View { .. }
            | Record::ViewChangeSent { .. }
            | Record::Stable(_)
            | Record::Epoch(_)
            | Record::ExecStable(_)
            | Record::Rejoining { .. }
            | Record::Rejoined
            | Record::NewView(_)
            | Record::VoteHorizon { .. } => None,
        }
    }
}

/// The version of everything a node keeps on disk: the records' encoding and meaning
/// (the statements and digests they hold) and the snapshot layout. Bump it with any
/// change to them: a node refuses a data directory of another version instead of
/// misreading it (session 3 changed request digests without one, and recovered nodes
/// silently dropped decisions whose digests no longer matched).
pub const STORAGE_FORMAT: u32 = 10;

const HEADER: usize = 8;
/// A record larger than this is corruption, not data (it would not fit a frame either).
pub const RECORD_BYTES_MAX: usize = crate::codec::FRAME_MAX;

/// `record` framed for segment 0 (logs that are never recycled).
pub fn encode_record(record: &Record) -> Vec<u8> {
    encode_record_in(record, 0)
}

/// `record` framed for the segment numbered `segment`.
pub fn encode_record_in(record: &Record, segment: u64) -> Vec<u8> {
    let payload = postcard::to_allocvec(record).unwrap_or_default();
    let mut out = Vec::with_capacity(HEADER + payload.len());
    frame_in(&mut out, &payload, segment);
    out
}

/// Appends `payload` to `out` in this log's framing, for the segment numbered `segment`:
/// the one frame format of every recycled log a node keeps (the WAL's records, and
/// services' own logs of opaque payloads, such as the block service's PrepareData).
pub fn frame_in(out: &mut Vec<u8>, payload: &[u8], segment: u64) {
    out.extend((payload.len() as u32).to_le_bytes());
    out.extend(checksum(segment, payload).to_le_bytes());
    out.extend(payload);
}

fn checksum(segment: u64, payload: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(&segment.to_le_bytes()), payload)
}

/// The records of a log, and the length of its valid prefix.
#[derive(Debug, PartialEq, Eq)]
pub struct Decoded {
    pub records: Vec<Record>,
    /// Bytes that hold whole, checksummed records; anything after is a torn tail.
    pub valid_len: usize,
    /// Why reading stopped before the end, if it did.
    pub tail: Option<TailError>,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TailError {
    #[error("truncated record at offset {offset}")]
    Truncated { offset: usize },
    #[error("checksum mismatch at offset {offset}")]
    Checksum { offset: usize },
    #[error("record of {len} bytes at offset {offset} exceeds the limit")]
    TooLarge { offset: usize, len: usize },
    #[error("undecodable record at offset {offset}")]
    Malformed { offset: usize },
}

/// The records of a log written as segment 0.
pub fn decode_log(bytes: &[u8]) -> Decoded {
    decode_segment(bytes, 0)
}

/// The records of the segment numbered `segment`: a record framed for another segment
/// ends the valid prefix like a torn one.
pub fn decode_segment(bytes: &[u8], segment: u64) -> Decoded {
    let frames = unframe(bytes, segment, RECORD_BYTES_MAX);
    let mut records = Vec::with_capacity(frames.payloads.len());
    for &(offset, payload) in &frames.payloads {
        // The whole payload must be one record: bytes left over mean the record is not
        // what was written (found by the decode_wal fuzz target).
        match postcard::take_from_bytes::<Record>(payload) {
            Ok((r, [])) => records.push(r),
            Ok(_) | Err(_) => {
                return Decoded { records, valid_len: offset, tail: Some(TailError::Malformed { offset }) }
            }
        }
    }
    Decoded { records, valid_len: frames.valid_len, tail: frames.tail }
}

/// The whole frames at the start of a segment's bytes.
#[derive(Debug, PartialEq, Eq)]
pub struct Frames<'a> {
    /// Each frame's offset and payload, in order.
    pub payloads: Vec<(usize, &'a [u8])>,
    /// Bytes that hold whole, checksummed frames; anything after is a torn tail (or what
    /// a recycled file held before).
    pub valid_len: usize,
    /// Why reading stopped before the end, if it did.
    pub tail: Option<TailError>,
}

/// The payloads framed by [`frame_in`] for the segment numbered `segment` at the start
/// of `bytes`, up to the first frame that is short, longer than `max`, or fails its
/// checksum (a torn write, or a frame of another segment).
pub fn unframe(bytes: &[u8], segment: u64, max: usize) -> Frames<'_> {
    let mut payloads = Vec::new();
    let mut offset = 0;
    let tail = loop {
        let rest = &bytes[offset..];
        if rest.is_empty() {
            break None;
        }
        if rest.len() < HEADER {
            break Some(TailError::Truncated { offset });
        }
        let len = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        let crc = u32::from_le_bytes([rest[4], rest[5], rest[6], rest[7]]);
        if len > max {
            break Some(TailError::TooLarge { offset, len });
        }
        let Some(payload) = rest.get(HEADER..HEADER + len) else {
            break Some(TailError::Truncated { offset });
        };
        if checksum(segment, payload) != crc {
            break Some(TailError::Checksum { offset });
        }
        payloads.push((offset, payload));
        offset += HEADER + len;
    };
    Frames { payloads, valid_len: offset, tail }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Vec<Record> {
        vec![
            Record::View { view: View(3), floor: Seq(0) },
            Record::Accepted { view: View(3), seq: Seq(9), value: Value::null() },
            Record::Decided { seq: Seq(9), digest: Value::null().digest() },
        ]
    }

    #[test]
    fn round_trip() {
        let bytes: Vec<u8> = sample().iter().flat_map(encode_record).collect();
        let d = decode_log(&bytes);
        assert_eq!(d.records, sample());
        assert_eq!(d.valid_len, bytes.len());
        assert_eq!(d.tail, None);
    }

    #[test]
    fn a_view_record_with_its_new_view_round_trips() {
        let proof = NewView { view: View(3), view_changes: Vec::new(), sig: crate::crypto::Sig([7; 64]) };
        let records = vec![Record::NewView(proof), Record::View { view: View(3), floor: Seq(0) }];
        let bytes: Vec<u8> = records.iter().flat_map(encode_record).collect();
        assert_eq!(decode_log(&bytes).records, records);
        assert_eq!(records[0].seq(), None, "not garbage-collected with the instances");
    }

    #[test]
    fn every_torn_tail_is_cut_at_the_last_whole_record() {
        let bytes: Vec<u8> = sample().iter().flat_map(encode_record).collect();
        let whole = encode_record(&sample()[0]).len() + encode_record(&sample()[1]).len();
        for cut in whole + 1..bytes.len() {
            let d = decode_log(&bytes[..cut]);
            assert_eq!(d.records, sample()[..2].to_vec());
            assert_eq!(d.valid_len, whole);
            assert!(matches!(d.tail, Some(TailError::Truncated { .. })));
        }
    }

    #[test]
    fn a_flipped_bit_stops_reading_there() {
        let mut bytes: Vec<u8> = sample().iter().flat_map(encode_record).collect();
        let first = encode_record(&sample()[0]).len();
        bytes[first + 10] ^= 0x40;
        let d = decode_log(&bytes);
        assert_eq!(d.records, sample()[..1].to_vec());
        assert_eq!(d.tail, Some(TailError::Checksum { offset: first }));
    }

    #[test]
    fn a_checksummed_record_with_trailing_bytes_is_malformed() {
        // Minimized by cargo-fuzz: ViewChangeSent { view: View(1) } plus a stray byte, with a
        // correct CRC over all three payload bytes.
        let payload = [0x01, 0x01, 0x06];
        let mut bytes = vec![0x03, 0x00, 0x00, 0x00];
        bytes.extend(checksum(0, &payload).to_le_bytes());
        bytes.extend(payload);
        let d = decode_log(&bytes);
        assert!(d.records.is_empty());
        assert_eq!(d.valid_len, 0);
        assert_eq!(d.tail, Some(TailError::Malformed { offset: 0 }));
    }

    #[test]
    fn records_of_another_segment_end_the_log() {
        // A recycled segment file: the new segment's records, then the old one's.
        let mut bytes: Vec<u8> = sample()[..1].iter().flat_map(|r| encode_record_in(r, 9)).collect();
        let new_len = bytes.len();
        bytes.extend(sample()[1..].iter().flat_map(|r| encode_record_in(r, 4)));
        let d = decode_segment(&bytes, 9);
        assert_eq!(d.records, sample()[..1].to_vec());
        assert_eq!(d.valid_len, new_len);
        assert_eq!(d.tail, Some(TailError::Checksum { offset: new_len }));
        assert_eq!(decode_segment(&bytes, 4).records, Vec::<Record>::new());
    }

    #[test]
    fn a_huge_length_is_rejected_without_allocating() {
        let mut bytes = vec![0xff, 0xff, 0xff, 0x7f, 0, 0, 0, 0];
        bytes.extend([1, 2, 3]);
        assert!(matches!(decode_log(&bytes).tail, Some(TailError::TooLarge { .. })));
    }
}
