//! ZooKeeper's client protocol: opcodes, error codes and the request and response
//! records (`zookeeper.jute`, module `org.apache.zookeeper.proto`), as the wire has them.

use crate::jute::{JuteError, Reader, Writer};

/// Opcodes (`ZooDefs.OpCode`).
pub mod op {
    pub const NOTIFICATION: i32 = 0;
    pub const CREATE: i32 = 1;
    pub const DELETE: i32 = 2;
    pub const EXISTS: i32 = 3;
    pub const GET_DATA: i32 = 4;
    pub const SET_DATA: i32 = 5;
    pub const GET_ACL: i32 = 6;
    pub const SET_ACL: i32 = 7;
    pub const GET_CHILDREN: i32 = 8;
    pub const SYNC: i32 = 9;
    pub const PING: i32 = 11;
    pub const GET_CHILDREN2: i32 = 12;
    pub const CHECK: i32 = 13;
    pub const MULTI: i32 = 14;
    pub const CREATE2: i32 = 15;
    pub const CHECK_WATCHES: i32 = 17;
    pub const REMOVE_WATCHES: i32 = 18;
    pub const CREATE_CONTAINER: i32 = 19;
    pub const CREATE_TTL: i32 = 21;
    pub const MULTI_READ: i32 = 22;
    pub const AUTH: i32 = 100;
    pub const SET_WATCHES: i32 = 101;
    pub const GET_EPHEMERALS: i32 = 103;
    pub const GET_ALL_CHILDREN_NUMBER: i32 = 104;
    pub const SET_WATCHES2: i32 = 105;
    pub const ADD_WATCH: i32 = 106;
    pub const WHO_AM_I: i32 = 107;
    pub const CLOSE_SESSION: i32 = -11;
    pub const ERROR: i32 = -1;
}

/// Reserved xids.
pub mod xid {
    pub const NOTIFICATION: i32 = -1;
    pub const PING: i32 = -2;
    pub const AUTH: i32 = -4;
    pub const SET_WATCHES: i32 = -8;
}

/// Error codes (`KeeperException.Code`).
pub mod err {
    pub const OK: i32 = 0;
    pub const SYSTEM_ERROR: i32 = -1;
    pub const RUNTIME_INCONSISTENCY: i32 = -2;
    pub const MARSHALLING_ERROR: i32 = -5;
    pub const UNIMPLEMENTED: i32 = -6;
    pub const OPERATION_TIMEOUT: i32 = -7;
    pub const BAD_ARGUMENTS: i32 = -8;
    pub const UNKNOWN_SESSION: i32 = -12;
    pub const NO_NODE: i32 = -101;
    pub const NO_AUTH: i32 = -102;
    pub const BAD_VERSION: i32 = -103;
    pub const NO_CHILDREN_FOR_EPHEMERALS: i32 = -108;
    pub const NODE_EXISTS: i32 = -110;
    pub const NOT_EMPTY: i32 = -111;
    pub const SESSION_EXPIRED: i32 = -112;
    pub const INVALID_ACL: i32 = -114;
    pub const AUTH_FAILED: i32 = -115;
    pub const SESSION_MOVED: i32 = -118;
    pub const NO_WATCHER: i32 = -121;
    /// A limit reached: here, a session's watches (`WATCHES_PER_SESSION_MAX`).
    pub const QUOTA_EXCEEDED: i32 = -125;
}

/// Watch event types (`Watcher.Event.EventType`).
pub mod event {
    pub const NODE_CREATED: i32 = 1;
    pub const NODE_DELETED: i32 = 2;
    pub const NODE_DATA_CHANGED: i32 = 3;
    pub const NODE_CHILDREN_CHANGED: i32 = 4;
    /// `Watcher.Event.KeeperState.SyncConnected`, the state of every event we send.
    pub const SYNC_CONNECTED: i32 = 3;
}

/// ACL permissions (`ZooDefs.Perms`).
pub mod perm {
    pub const READ: i32 = 1;
    pub const WRITE: i32 = 2;
    pub const CREATE: i32 = 4;
    pub const DELETE: i32 = 8;
    pub const ADMIN: i32 = 16;
    pub const ALL: i32 = 31;
}

/// `jute.maxbuffer`'s default: the largest frame and znode payload.
pub const MAX_BUFFER: usize = 1024 * 1024;

/// The znode holding the ensemble's dynamic configuration (the client addresses of
/// the front ends; `Command::Announce`).
pub const CONFIG_PATH: &str = "/zookeeper/config";

/// A node's metadata as every read returns it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Stat {
    pub czxid: i64,
    pub mzxid: i64,
    pub ctime: i64,
    pub mtime: i64,
    pub version: i32,
    pub cversion: i32,
    pub aversion: i32,
    pub ephemeral_owner: i64,
    pub data_length: i32,
    pub num_children: i32,
    pub pzxid: i64,
}

impl Stat {
    /// Bytes of a stat on the wire: six longs and five ints.
    pub const BYTES: usize = 6 * 8 + 5 * 4;

    pub fn write(&self, w: &mut Writer) {
        w.long(self.czxid).long(self.mzxid).long(self.ctime).long(self.mtime);
        w.int(self.version).int(self.cversion).int(self.aversion);
        w.long(self.ephemeral_owner).int(self.data_length).int(self.num_children).long(self.pzxid);
    }

    pub fn read(r: &mut Reader) -> Result<Stat, JuteError> {
        Ok(Stat {
            czxid: r.long()?,
            mzxid: r.long()?,
            ctime: r.long()?,
            mtime: r.long()?,
            version: r.int()?,
            cversion: r.int()?,
            aversion: r.int()?,
            ephemeral_owner: r.long()?,
            data_length: r.int()?,
            num_children: r.int()?,
            pzxid: r.long()?,
        })
    }
}

/// One access control entry: `perms` for whoever `scheme:id` names.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct Acl {
    pub perms: i32,
    pub scheme: String,
    pub id: String,
}

impl Acl {
    /// `world:anyone` with every permission (`ZooDefs.Ids.OPEN_ACL_UNSAFE`).
    pub fn open() -> Vec<Acl> {
        vec![Acl { perms: perm::ALL, scheme: "world".into(), id: "anyone".into() }]
    }

    fn read(r: &mut Reader) -> Result<Acl, JuteError> {
        Ok(Acl { perms: r.int()?, scheme: r.string()?, id: r.string()? })
    }

    pub fn write_all(acl: &[Acl], w: &mut Writer) {
        w.int(acl.len() as i32);
        for a in acl {
            w.int(a.perms).string(&a.scheme).string(&a.id);
        }
    }
}

/// A request a client sends after the handshake (its header's opcode and its record).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Request {
    /// create, create2, createContainer, createTTL: `opcode` says which response.
    Create {
        opcode: i32,
        path: String,
        // Bytes, not a sequence of u8: the same postcard encoding, copied at once rather
        // than visited byte by byte (2-3 % of a node's CPU under 1 KiB writes).
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
        acl: Vec<Acl>,
        flags: i32,
        ttl: i64,
    },
    Delete {
        path: String,
        version: i32,
    },
    Exists {
        path: String,
        watch: bool,
    },
    GetData {
        path: String,
        watch: bool,
    },
    SetData {
        path: String,
        #[serde(with = "serde_bytes")]
        data: Vec<u8>,
        version: i32,
    },
    GetAcl {
        path: String,
    },
    SetAcl {
        path: String,
        acl: Vec<Acl>,
        version: i32,
    },
    /// getChildren (`two` false) and getChildren2 (which adds the parent's Stat).
    GetChildren {
        path: String,
        watch: bool,
        two: bool,
    },
    Sync {
        path: String,
    },
    Check {
        path: String,
        version: i32,
    },
    Multi(Vec<Request>),
    MultiRead(Vec<Request>),
    GetAllChildrenNumber {
        path: String,
    },
    GetEphemerals {
        prefix: String,
    },
    /// setWatches (persistent ones empty) and setWatches2.
    SetWatches {
        relative_zxid: i64,
        data: Vec<String>,
        exist: Vec<String>,
        child: Vec<String>,
        persistent: Vec<String>,
        recursive: Vec<String>,
    },
    /// addWatch: mode 0 persistent, 1 persistent and recursive.
    AddWatch {
        path: String,
        mode: i32,
    },
    /// removeWatches: kind 1 child, 2 data, 3 any, 4 persistent, 5 persistent
    /// recursive (`Watcher.WatcherType`).
    RemoveWatches {
        path: String,
        kind: i32,
    },
    /// checkWatches: whether the session holds such a watch (NOWATCHER if not).
    CheckWatches {
        path: String,
        kind: i32,
    },
    WhoAmI,
}

impl Request {
    /// Parses the record of opcode `opcode`. `Ok(None)`: an opcode this server does not
    /// implement (answered UNIMPLEMENTED, the connection kept).
    pub fn parse(opcode: i32, r: &mut Reader) -> Result<Option<Request>, JuteError> {
        use op::*;
        let req = match opcode {
            CREATE | CREATE2 | CREATE_CONTAINER | CREATE_TTL => {
                let path = r.string()?;
                let data = r.buffer()?;
                let acl = r.vector(12, Acl::read)?;
                let flags = r.int()?;
                let ttl = if opcode == CREATE_TTL { r.long()? } else { -1 };
                Request::Create { opcode, path, data, acl, flags, ttl }
            }
            DELETE => Request::Delete { path: r.string()?, version: r.int()? },
            EXISTS => Request::Exists { path: r.string()?, watch: r.bool()? },
            GET_DATA => Request::GetData { path: r.string()?, watch: r.bool()? },
            SET_DATA => Request::SetData { path: r.string()?, data: r.buffer()?, version: r.int()? },
            GET_ACL => Request::GetAcl { path: r.string()? },
            SET_ACL => Request::SetAcl { path: r.string()?, acl: r.vector(12, Acl::read)?, version: r.int()? },
            GET_CHILDREN | GET_CHILDREN2 => {
                Request::GetChildren { path: r.string()?, watch: r.bool()?, two: opcode == GET_CHILDREN2 }
            }
            SYNC => Request::Sync { path: r.string()? },
            CHECK => Request::Check { path: r.string()?, version: r.int()? },
            MULTI | MULTI_READ => {
                let mut ops = Vec::new();
                loop {
                    let (kind, done, _err) = (r.int()?, r.bool()?, r.int()?);
                    if done {
                        break;
                    }
                    let allowed = if opcode == MULTI {
                        matches!(kind, CREATE | CREATE2 | CREATE_CONTAINER | CREATE_TTL | DELETE | SET_DATA | CHECK)
                    } else {
                        matches!(kind, GET_DATA | GET_CHILDREN)
                    };
                    if !allowed {
                        return Err(JuteError::BadLength { at: 0, len: kind });
                    }
                    match Request::parse(kind, r)? {
                        Some(op) => ops.push(op),
                        None => return Err(JuteError::BadLength { at: 0, len: kind }),
                    }
                }
                if opcode == MULTI {
                    Request::Multi(ops)
                } else {
                    Request::MultiRead(ops)
                }
            }
            GET_ALL_CHILDREN_NUMBER => Request::GetAllChildrenNumber { path: r.string()? },
            GET_EPHEMERALS => Request::GetEphemerals { prefix: r.string()? },
            SET_WATCHES | SET_WATCHES2 => {
                let relative_zxid = r.long()?;
                let (data, exist, child) = (r.strings()?, r.strings()?, r.strings()?);
                let (persistent, recursive) =
                    if opcode == SET_WATCHES2 { (r.strings()?, r.strings()?) } else { (Vec::new(), Vec::new()) };
                Request::SetWatches { relative_zxid, data, exist, child, persistent, recursive }
            }
            ADD_WATCH => Request::AddWatch { path: r.string()?, mode: r.int()? },
            REMOVE_WATCHES => Request::RemoveWatches { path: r.string()?, kind: r.int()? },
            CHECK_WATCHES => Request::CheckWatches { path: r.string()?, kind: r.int()? },
            WHO_AM_I => Request::WhoAmI,
            _ => return Ok(None),
        };
        Ok(Some(req))
    }

    /// Whether the request may change the state or register a watch: it is then ordered.
    /// The others are answered from a node's state without ordering.
    pub fn writes(&self) -> bool {
        if let Some(watch) = self.watch_flag() {
            return watch;
        }
        match self {
            Request::GetAcl { .. }
            | Request::GetAllChildrenNumber { .. }
            | Request::GetEphemerals { .. }
            | Request::CheckWatches { .. }
            | Request::WhoAmI => false,
            Request::MultiRead(ops) => ops.iter().any(Request::writes),
            _ => true,
        }
    }

    /// Whether the request reads `/zookeeper/config` (getData, as the Java client's
    /// getConfig does; or a multiRead holding one).
    pub fn reads_config(&self) -> bool {
        match self {
            Request::GetData { path, .. } => path == CONFIG_PATH,
            Request::MultiRead(ops) => ops.iter().any(Request::reads_config),
            _ => false,
        }
    }

    /// Whether the request may leave a watch for its session: after one, events may come.
    pub fn sets_watch(&self) -> bool {
        if let Some(watch) = self.watch_flag() {
            return watch;
        }
        match self {
            Request::SetWatches { .. } | Request::AddWatch { .. } => true,
            Request::MultiRead(ops) => ops.iter().any(Request::sets_watch),
            _ => false,
        }
    }

    /// A read's watch flag (exists, getData, getChildren); None for any other request.
    fn watch_flag(&self) -> Option<bool> {
        match self {
            Request::Exists { watch, .. } | Request::GetData { watch, .. } | Request::GetChildren { watch, .. } => {
                Some(*watch)
            }
            _ => None,
        }
    }

    /// Whether the reply may be large (node data, child lists): such a request is not
    /// batched with others, so that one reply stays within an operation's size bound.
    pub fn large_reply(&self) -> bool {
        matches!(
            self,
            Request::GetData { .. }
                | Request::GetChildren { .. }
                | Request::MultiRead(_)
                | Request::GetEphemerals { .. }
                | Request::GetAcl { .. }
        )
    }

    /// The opcode a multi result names for this operation.
    pub fn opcode(&self) -> i32 {
        match self {
            Request::Create { opcode, .. } => *opcode,
            Request::Delete { .. } => op::DELETE,
            Request::Exists { .. } => op::EXISTS,
            Request::GetData { .. } => op::GET_DATA,
            Request::SetData { .. } => op::SET_DATA,
            Request::GetAcl { .. } => op::GET_ACL,
            Request::SetAcl { .. } => op::SET_ACL,
            Request::GetChildren { two: false, .. } => op::GET_CHILDREN,
            Request::GetChildren { two: true, .. } => op::GET_CHILDREN2,
            Request::Sync { .. } => op::SYNC,
            Request::Check { .. } => op::CHECK,
            Request::Multi(_) => op::MULTI,
            Request::MultiRead(_) => op::MULTI_READ,
            Request::GetAllChildrenNumber { .. } => op::GET_ALL_CHILDREN_NUMBER,
            Request::GetEphemerals { .. } => op::GET_EPHEMERALS,
            Request::SetWatches { persistent, recursive, .. } if persistent.is_empty() && recursive.is_empty() => {
                op::SET_WATCHES
            }
            Request::SetWatches { .. } => op::SET_WATCHES2,
            Request::AddWatch { .. } => op::ADD_WATCH,
            Request::RemoveWatches { .. } => op::REMOVE_WATCHES,
            Request::CheckWatches { .. } => op::CHECK_WATCHES,
            Request::WhoAmI => op::WHO_AM_I,
        }
    }
}

/// The handshake's first frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectRequest {
    pub protocol_version: i32,
    pub last_zxid_seen: i64,
    pub timeout: i32,
    pub session_id: i64,
    pub password: Vec<u8>,
    pub read_only: bool,
}

impl ConnectRequest {
    pub fn parse(bytes: &[u8]) -> Result<ConnectRequest, JuteError> {
        let mut r = Reader::new(bytes);
        let mut c = ConnectRequest {
            protocol_version: r.int()?,
            last_zxid_seen: r.long()?,
            timeout: r.int()?,
            session_id: r.long()?,
            password: r.buffer()?,
            read_only: false,
        };
        // Older clients end here; newer ones add the readOnly flag.
        if r.remaining() > 0 {
            c.read_only = r.bool()?;
        }
        Ok(c)
    }
}

/// The handshake's answer. A timeout of 0 tells the client its session expired.
pub fn connect_response(timeout: i32, session_id: i64, password: &[u8]) -> Vec<u8> {
    let mut w = Writer::new();
    w.int(0).int(timeout).long(session_id).buffer(password).bool(false);
    w.into_bytes()
}

/// A reply's header.
pub fn reply_header(w: &mut Writer, xid: i32, zxid: i64, err: i32) {
    w.int(xid).long(zxid).int(err);
}

/// A watch event for the client: a frame body (header with xid -1, then WatcherEvent).
pub fn notification(zxid: i64, kind: i32, path: &str) -> Vec<u8> {
    let mut w = Writer::new();
    reply_header(&mut w, xid::NOTIFICATION, zxid, err::OK);
    w.int(kind).int(event::SYNC_CONNECTED).string(path);
    w.into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn create_body(path: &str) -> Writer {
        let mut w = Writer::new();
        w.string(path).buffer(b"v");
        Acl::write_all(&Acl::open(), &mut w);
        w.int(0);
        w
    }

    #[test]
    fn a_stat_takes_the_bytes_its_constant_says() {
        let mut w = Writer::new();
        Stat::default().write(&mut w);
        assert_eq!(w.into_bytes().len(), Stat::BYTES);
    }

    #[test]
    fn data_as_bytes_encodes_as_the_sequence_it_was() {
        // WAL records and snapshots written before data was marked as bytes decode the same.
        let req = Request::SetData { path: "/a".into(), data: vec![1, 2, 3], version: 7 };
        let as_sequence = postcard::to_allocvec(&(4u32, "/a", vec![1u8, 2, 3], 7i32)).expect("encodes");
        assert_eq!(postcard::to_allocvec(&req).expect("encodes"), as_sequence);
        assert_eq!(postcard::from_bytes::<Request>(&as_sequence).expect("decodes"), req);
    }

    #[test]
    fn a_multi_parses_until_its_done_header() {
        let mut w = Writer::new();
        w.int(op::CREATE).bool(false).int(-1);
        w.0.extend(create_body("/a").into_bytes());
        w.int(op::CHECK).bool(false).int(-1).string("/a").int(0);
        w.int(-1).bool(true).int(-1);
        let bytes = w.into_bytes();
        let req = Request::parse(op::MULTI, &mut Reader::new(&bytes)).expect("parses").expect("known");
        match req {
            Request::Multi(ops) => {
                assert_eq!(ops.len(), 2);
                assert!(matches!(&ops[0], Request::Create { path, .. } if path == "/a"));
                assert_eq!(ops[1], Request::Check { path: "/a".into(), version: 0 });
            }
            other => panic!("not a multi: {other:?}"),
        }
    }

    #[test]
    fn a_multi_with_a_read_inside_or_without_end_is_refused() {
        let mut w = Writer::new();
        w.int(op::GET_DATA).bool(false).int(-1).string("/a").bool(false);
        w.int(-1).bool(true).int(-1);
        assert!(Request::parse(op::MULTI, &mut Reader::new(&w.into_bytes())).is_err());
        let mut w = Writer::new();
        w.int(op::CHECK).bool(false).int(-1).string("/a").int(0);
        assert!(Request::parse(op::MULTI, &mut Reader::new(&w.into_bytes())).is_err());
    }

    #[test]
    fn unknown_opcodes_are_none_and_reads_without_watch_are_not_ordered() {
        assert_eq!(Request::parse(16, &mut Reader::new(&[])), Ok(None));
        assert!(!Request::GetData { path: "/".into(), watch: false }.writes());
        assert!(Request::GetData { path: "/".into(), watch: true }.writes());
        assert!(Request::Sync { path: "/".into() }.writes());
    }

    #[test]
    fn connect_requests_with_and_without_the_read_only_flag() {
        let mut w = Writer::new();
        w.int(0).long(5).int(30_000).long(0).buffer(&[0; 16]);
        let short = w.0.clone();
        let c = ConnectRequest::parse(&short).expect("old clients");
        assert_eq!((c.last_zxid_seen, c.timeout, c.read_only), (5, 30_000, false));
        w.bool(true);
        assert!(ConnectRequest::parse(&w.into_bytes()).expect("new clients").read_only);
    }
}
