//! The NBD wire format, fixed newstyle (the NBD protocol document, `doc/proto.md` of
//! the NetworkBlockDevice project): the handshake, option haggling, and the simple and
//! structured replies of the transmission phase, with the `base:allocation` metadata
//! context. Pure encoding and decoding, each length checked
//! before anything is allocated; `front.rs` does the I/O.

/// "NBDMAGIC", then "IHAVEOPT": the server's greeting.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Option replies start with this.
pub const REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

/// Handshake flags (server) and client flags.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
pub const CLIENT_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const CLIENT_NO_ZEROES: u32 = 1 << 1;

/// Options.
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;

/// Option reply types.
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
pub const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
pub const REP_ERR_POLICY: u32 = (1 << 31) + 2;
pub const REP_ERR_INVALID: u32 = (1 << 31) + 3;
pub const REP_ERR_TLS_REQD: u32 = (1 << 31) + 5;
pub const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;

/// Information types (NBD_OPT_INFO / NBD_OPT_GO).
pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

/// Transmission flags.
pub const TF_HAS_FLAGS: u16 = 1 << 0;
pub const TF_SEND_FLUSH: u16 = 1 << 2;
pub const TF_SEND_FUA: u16 = 1 << 3;
pub const TF_SEND_TRIM: u16 = 1 << 5;
pub const TF_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const TF_SEND_DF: u16 = 1 << 7;
pub const TF_CAN_MULTI_CONN: u16 = 1 << 8;
pub const TF_SEND_FAST_ZERO: u16 = 1 << 11;

/// Command flags.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const CMD_FLAG_DF: u16 = 1 << 2;
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

/// Structured reply flags and chunk types.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;

/// The one metadata context this server offers, and its flags: an extent that reads as
/// zeros and holds no data on any node.
pub const CONTEXT_ALLOCATION: &str = "base:allocation";
pub const STATE_HOLE: u32 = 1 << 0;
pub const STATE_ZERO: u32 = 1 << 1;

/// Errors of the transmission phase (errno values the protocol fixes).
pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const ENOTSUP: u32 = 95;
pub const ESHUTDOWN: u32 = 108;

/// Most bytes of option data a client may send (an export name is at most 4 KiB).
pub const OPTION_DATA_MAX: u32 = 64 << 10;
/// Largest READ or WRITE (the protocol's customary 32 MiB, advertised as the maximum
/// block size); a WRITE above it closes the connection, since its payload cannot be
/// skipped safely.
pub const PAYLOAD_MAX: u32 = 32 << 20;

/// Transmission commands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cmd {
    Read,
    Write,
    Disc,
    Flush,
    Trim,
    Cache,
    WriteZeroes,
    BlockStatus,
    /// A type this server does not know: answered with EINVAL.
    Other(u16),
}

impl Cmd {
    fn from_u16(t: u16) -> Cmd {
        match t {
            0 => Cmd::Read,
            1 => Cmd::Write,
            2 => Cmd::Disc,
            3 => Cmd::Flush,
            4 => Cmd::Trim,
            5 => Cmd::Cache,
            6 => Cmd::WriteZeroes,
            7 => Cmd::BlockStatus,
            other => Cmd::Other(other),
        }
    }
}

/// A request header (28 bytes); a WRITE's payload of `length` bytes follows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub cmd: Cmd,
    pub cookie: u64,
    pub offset: u64,
    pub length: u32,
}

pub const REQUEST_LEN: usize = 28;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("bad magic {0:#x}")]
    Magic(u64),
    #[error("{0}")]
    Malformed(&'static str),
}

/// Decodes a request header.
///
/// # Errors
/// A wrong magic: the stream is out of step and the connection must close.
pub fn decode_request(b: &[u8; REQUEST_LEN]) -> Result<Request, WireError> {
    let magic = u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
    if magic != REQUEST_MAGIC {
        return Err(WireError::Magic(u64::from(magic)));
    }
    Ok(Request {
        flags: u16::from_be_bytes([b[4], b[5]]),
        cmd: Cmd::from_u16(u16::from_be_bytes([b[6], b[7]])),
        cookie: u64::from_be_bytes(b[8..16].try_into().unwrap_or_default()),
        offset: u64::from_be_bytes(b[16..24].try_into().unwrap_or_default()),
        length: u32::from_be_bytes([b[24], b[25], b[26], b[27]]),
    })
}

/// Encodes a request header (tests and the benchmark's own client).
pub fn encode_request(r: &Request) -> [u8; REQUEST_LEN] {
    let t = match r.cmd {
        Cmd::Read => 0,
        Cmd::Write => 1,
        Cmd::Disc => 2,
        Cmd::Flush => 3,
        Cmd::Trim => 4,
        Cmd::Cache => 5,
        Cmd::WriteZeroes => 6,
        Cmd::BlockStatus => 7,
        Cmd::Other(t) => t,
    };
    let mut b = [0u8; REQUEST_LEN];
    b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&r.flags.to_be_bytes());
    b[6..8].copy_from_slice(&u16::to_be_bytes(t));
    b[8..16].copy_from_slice(&r.cookie.to_be_bytes());
    b[16..24].copy_from_slice(&r.offset.to_be_bytes());
    b[24..28].copy_from_slice(&r.length.to_be_bytes());
    b
}

/// A simple reply's header (16 bytes); a successful READ's data follows it.
pub fn simple_reply(cookie: u64, error: u32) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    b[4..8].copy_from_slice(&error.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b
}

/// A structured reply chunk's header (20 bytes); `length` bytes of payload follow it.
pub fn chunk_header(cookie: u64, flags: u16, kind: u16, length: u32) -> [u8; 20] {
    let mut b = [0u8; 20];
    b[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&flags.to_be_bytes());
    b[6..8].copy_from_slice(&kind.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b[16..20].copy_from_slice(&length.to_be_bytes());
    b
}

/// A READ's whole answer as one final NBD_REPLY_TYPE_OFFSET_DATA chunk (so it also
/// honours NBD_CMD_FLAG_DF). `data` is at most [`PAYLOAD_MAX`] bytes.
pub fn read_chunk(cookie: u64, offset: u64, data: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(28 + data.len());
    b.extend_from_slice(&chunk_header(cookie, REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, 8 + data.len() as u32));
    b.extend_from_slice(&offset.to_be_bytes());
    b.extend_from_slice(data);
    b
}

/// A final NBD_REPLY_TYPE_ERROR chunk, without a message.
pub fn error_chunk(cookie: u64, error: u32) -> Vec<u8> {
    let mut b = Vec::with_capacity(26);
    b.extend_from_slice(&chunk_header(cookie, REPLY_FLAG_DONE, REPLY_TYPE_ERROR, 6));
    b.extend_from_slice(&error.to_be_bytes());
    b.extend_from_slice(&0u16.to_be_bytes());
    b
}

/// A final NBD_REPLY_TYPE_BLOCK_STATUS chunk for context `id`: extents of (length,
/// flags), consecutive from the request's offset. There is at least one.
pub fn block_status_chunk(cookie: u64, id: u32, extents: &[(u32, u32)]) -> Vec<u8> {
    let len = 4 + 8 * extents.len();
    let mut b = Vec::with_capacity(20 + len);
    b.extend_from_slice(&chunk_header(cookie, REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, len as u32));
    b.extend_from_slice(&id.to_be_bytes());
    for (length, flags) in extents {
        b.extend_from_slice(&length.to_be_bytes());
        b.extend_from_slice(&flags.to_be_bytes());
    }
    b
}

/// NBD_OPT_LIST_META_CONTEXT / NBD_OPT_SET_META_CONTEXT data: the export name and the
/// queries.
///
/// # Errors
/// Lengths that do not add up to the data, or a query that is not UTF-8.
pub fn decode_meta_context(data: &[u8]) -> Result<(Vec<u8>, Vec<String>), WireError> {
    let short = WireError::Malformed("meta context option data cut short");
    let u32_at = |at: usize| -> Result<usize, WireError> {
        let b = data.get(at..at + 4).ok_or(short.clone())?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize)
    };
    let len = u32_at(0)?;
    let name = data.get(4..4 + len).ok_or(short.clone())?.to_vec();
    let mut at = 4 + len;
    let count = u32_at(at)?;
    at += 4;
    // Each query takes at least its 4-byte length: a count the data cannot hold is
    // refused before anything is allocated for it.
    if count > (data.len() - at) / 4 {
        return Err(short);
    }
    let mut queries = Vec::with_capacity(count);
    for _ in 0..count {
        let len = u32_at(at)?;
        let query = data.get(at + 4..at + 4 + len).ok_or(short.clone())?;
        queries.push(
            String::from_utf8(query.to_vec()).map_err(|_| WireError::Malformed("a meta context query is not UTF-8"))?,
        );
        at += 4 + len;
    }
    if at != data.len() {
        return Err(WireError::Malformed("meta context option data longer than its fields"));
    }
    Ok((name, queries))
}

/// NBD_REP_META_CONTEXT: a context's id and name.
pub fn meta_context(id: u32, name: &str) -> Vec<u8> {
    let mut b = Vec::with_capacity(4 + name.len());
    b.extend_from_slice(&id.to_be_bytes());
    b.extend_from_slice(name.as_bytes());
    b
}

/// The server's greeting.
pub fn greeting() -> [u8; 18] {
    let mut b = [0u8; 18];
    b[0..8].copy_from_slice(&NBDMAGIC.to_be_bytes());
    b[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    b[16..18].copy_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    b
}

/// An option's header: (option, data length).
///
/// # Errors
/// A wrong magic.
pub fn decode_option(b: &[u8; 16]) -> Result<(u32, u32), WireError> {
    let magic = u64::from_be_bytes(b[0..8].try_into().unwrap_or_default());
    if magic != IHAVEOPT {
        return Err(WireError::Magic(magic));
    }
    Ok((u32::from_be_bytes([b[8], b[9], b[10], b[11]]), u32::from_be_bytes([b[12], b[13], b[14], b[15]])))
}

/// An option reply.
pub fn option_reply(option: u32, reply: u32, data: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(20 + data.len());
    b.extend_from_slice(&REPLY_MAGIC.to_be_bytes());
    b.extend_from_slice(&option.to_be_bytes());
    b.extend_from_slice(&reply.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    b
}

/// NBD_OPT_INFO / NBD_OPT_GO data: the export name and the information types asked for.
///
/// # Errors
/// Lengths that do not add up to the data.
pub fn decode_go(data: &[u8]) -> Result<(Vec<u8>, Vec<u16>), WireError> {
    let short = WireError::Malformed("NBD_OPT_GO/INFO data cut short");
    let len = u32::from_be_bytes(data.get(0..4).ok_or(short.clone())?.try_into().unwrap_or_default()) as usize;
    let name = data.get(4..4 + len).ok_or(short.clone())?.to_vec();
    let rest = &data[4 + len..];
    let count = u16::from_be_bytes(rest.get(0..2).ok_or(short.clone())?.try_into().unwrap_or_default()) as usize;
    let infos = rest.get(2..2 + 2 * count).ok_or(short)?;
    if rest.len() != 2 + 2 * count {
        return Err(WireError::Malformed("NBD_OPT_GO/INFO data longer than its fields"));
    }
    Ok((name, infos.chunks_exact(2).map(|c| u16::from_be_bytes([c[0], c[1]])).collect()))
}

/// NBD_REP_INFO with NBD_INFO_EXPORT.
pub fn info_export(size: u64, flags: u16) -> Vec<u8> {
    let mut b = Vec::with_capacity(12);
    b.extend_from_slice(&INFO_EXPORT.to_be_bytes());
    b.extend_from_slice(&size.to_be_bytes());
    b.extend_from_slice(&flags.to_be_bytes());
    b
}

/// NBD_REP_INFO with NBD_INFO_BLOCK_SIZE.
pub fn info_block_size(min: u32, preferred: u32, max: u32) -> Vec<u8> {
    let mut b = Vec::with_capacity(14);
    b.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    b.extend_from_slice(&min.to_be_bytes());
    b.extend_from_slice(&preferred.to_be_bytes());
    b.extend_from_slice(&max.to_be_bytes());
    b
}

/// NBD_REP_INFO with NBD_INFO_NAME or NBD_INFO_DESCRIPTION.
pub fn info_text(kind: u16, text: &str) -> Vec<u8> {
    let mut b = Vec::with_capacity(2 + text.len());
    b.extend_from_slice(&kind.to_be_bytes());
    b.extend_from_slice(text.as_bytes());
    b
}

/// NBD_REP_SERVER for NBD_OPT_LIST: one export's name.
pub fn server_entry(name: &str) -> Vec<u8> {
    let mut b = Vec::with_capacity(4 + name.len());
    b.extend_from_slice(&(name.len() as u32).to_be_bytes());
    b.extend_from_slice(name.as_bytes());
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_and_a_bad_magic_is_refused() {
        let r = Request { flags: CMD_FLAG_FUA, cmd: Cmd::Write, cookie: 0xdead_beef, offset: 1 << 40, length: 4096 };
        assert_eq!(decode_request(&encode_request(&r)), Ok(r));
        let o = Request { cmd: Cmd::Other(99), ..r };
        assert_eq!(decode_request(&encode_request(&o)).map(|r| r.cmd), Ok(Cmd::Other(99)));
        let mut bad = encode_request(&r);
        bad[0] ^= 1;
        assert!(matches!(decode_request(&bad), Err(WireError::Magic(_))));
    }

    #[test]
    fn go_data_is_checked_against_its_lengths() {
        let mut d = Vec::new();
        d.extend_from_slice(&4u32.to_be_bytes());
        d.extend_from_slice(b"keel");
        d.extend_from_slice(&2u16.to_be_bytes());
        d.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        d.extend_from_slice(&INFO_NAME.to_be_bytes());
        assert_eq!(decode_go(&d), Ok((b"keel".to_vec(), vec![INFO_BLOCK_SIZE, INFO_NAME])));
        assert!(decode_go(&d[..d.len() - 1]).is_err());
        let mut long = d.clone();
        long.push(0);
        assert!(decode_go(&long).is_err());
        let mut huge = d.clone();
        huge[0..4].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(decode_go(&huge).is_err());
        assert!(decode_go(&[]).is_err());
    }

    #[test]
    fn replies_have_the_documented_layout() {
        let r = simple_reply(7, EIO);
        assert_eq!(&r[0..4], &[0x67, 0x44, 0x66, 0x98]);
        assert_eq!(&r[4..8], &[0, 0, 0, 5]);
        assert_eq!(u64::from_be_bytes(r[8..16].try_into().expect("8")), 7);
        let o = option_reply(OPT_GO, REP_ACK, &[]);
        assert_eq!(o.len(), 20);
        assert_eq!(&o[0..8], &[0x00, 0x03, 0xe8, 0x89, 0x04, 0x55, 0x65, 0xa9]);
        assert_eq!(&greeting()[0..8], b"NBDMAGIC");
        assert_eq!(&greeting()[8..16], b"IHAVEOPT");
    }

    #[test]
    fn structured_chunks_have_the_documented_layout() {
        let r = read_chunk(9, 4096, b"abc");
        assert_eq!(&r[0..4], &[0x66, 0x8e, 0x33, 0xef]);
        assert_eq!(u16::from_be_bytes([r[4], r[5]]), REPLY_FLAG_DONE);
        assert_eq!(u16::from_be_bytes([r[6], r[7]]), 1, "NBD_REPLY_TYPE_OFFSET_DATA");
        assert_eq!(u64::from_be_bytes(r[8..16].try_into().expect("8")), 9);
        assert_eq!(u32::from_be_bytes(r[16..20].try_into().expect("4")), 11, "offset and data");
        assert_eq!(u64::from_be_bytes(r[20..28].try_into().expect("8")), 4096);
        assert_eq!(&r[28..], b"abc");
        let e = error_chunk(3, EINVAL);
        assert_eq!(e.len(), 26);
        assert_eq!(u16::from_be_bytes([e[6], e[7]]), 0x8001);
        assert_eq!(u32::from_be_bytes(e[16..20].try_into().expect("4")), 6);
        assert_eq!(u32::from_be_bytes(e[20..24].try_into().expect("4")), 22);
        let s = block_status_chunk(5, 1, &[(8192, STATE_HOLE | STATE_ZERO), (4096, 0)]);
        assert_eq!(u16::from_be_bytes([s[6], s[7]]), 5, "NBD_REPLY_TYPE_BLOCK_STATUS");
        assert_eq!(u32::from_be_bytes(s[16..20].try_into().expect("4")), 4 + 16);
        let words: Vec<u32> = s[20..].chunks_exact(4).map(|c| u32::from_be_bytes(c.try_into().expect("4"))).collect();
        assert_eq!(words, vec![1, 8192, 3, 4096, 0]);
    }

    #[test]
    fn meta_context_data_is_checked_against_its_lengths() {
        let mut d = Vec::new();
        d.extend_from_slice(&0u32.to_be_bytes());
        d.extend_from_slice(&2u32.to_be_bytes());
        for q in ["base:allocation", "qemu:dirty-bitmap:x"] {
            d.extend_from_slice(&(q.len() as u32).to_be_bytes());
            d.extend_from_slice(q.as_bytes());
        }
        let want = (Vec::new(), vec!["base:allocation".to_string(), "qemu:dirty-bitmap:x".to_string()]);
        assert_eq!(decode_meta_context(&d), Ok(want));
        assert!(decode_meta_context(&d[..d.len() - 1]).is_err(), "cut short");
        let mut long = d.clone();
        long.push(0);
        assert!(decode_meta_context(&long).is_err(), "trailing bytes");
        let mut many = d.clone();
        many[4..8].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(decode_meta_context(&many).is_err(), "a count the data cannot hold");
        let mut name = d.clone();
        name[0..4].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(decode_meta_context(&name).is_err(), "a name longer than the data");
        let none = [0u8, 0, 0, 0, 0, 0, 0, 0];
        assert_eq!(decode_meta_context(&none), Ok((Vec::new(), Vec::new())));
        assert!(decode_meta_context(&[]).is_err());
    }
}
