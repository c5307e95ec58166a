//! Identities and positions: nodes, clients and their sessions, views and instances.
//! The lowest layer every other module names things with.
//!
//! Nodes, clients, views and instances are newtypes, not aliases of integers: a view
//! passed where an instance is expected (both count up from 0, both travel in every
//! vote), or a client id where a node's, compiles no more. They serialize as the bare
//! integer (`serde(transparent)`), print as it, and hash into statements as it, so wire
//! formats, logs, signatures and the simulator's traces are what they were.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::ops::{Add, AddAssign, Sub};

/// Debug and Display of a newtype as its bare number, so logs, traces and error
/// messages read as they did when these were integers.
macro_rules! bare_fmt {
    ($name:ident) => {
        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&self.0, f)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }
    };
}

/// A newtype over an unsigned integer that serializes and prints as the bare number.
macro_rules! number {
    ($(#[$meta:meta])* $name:ident($inner:ty)) => {
        $(#[$meta])*
        #[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub $inner);

        bare_fmt!($name);

        impl From<$name> for $inner {
            fn from(x: $name) -> $inner {
                x.0
            }
        }

        /// `x + n`: `n` steps later.
        impl Add<$inner> for $name {
            type Output = $name;
            fn add(self, n: $inner) -> $name {
                $name(self.0 + n)
            }
        }

        impl AddAssign<$inner> for $name {
            fn add_assign(&mut self, n: $inner) {
                self.0 += n;
            }
        }

        /// `x - n`: `n` steps earlier.
        impl Sub<$inner> for $name {
            type Output = $name;
            fn sub(self, n: $inner) -> $name {
                $name(self.0 - n)
            }
        }

        /// `a - b`: how many steps `b` is behind `a`.
        impl Sub<$name> for $name {
            type Output = $inner;
            fn sub(self, b: $name) -> $inner {
                self.0 - b.0
            }
        }

        impl $name {
            pub const MAX: $name = $name(<$inner>::MAX);

            /// The one after this.
            pub fn next(self) -> $name {
                $name(self.0 + 1)
            }

            pub fn saturating_sub(self, n: $inner) -> $name {
                $name(self.0.saturating_sub(n))
            }

            pub fn saturating_add(self, n: $inner) -> $name {
                $name(self.0.saturating_add(n))
            }

            pub fn checked_sub(self, n: $inner) -> Option<$name> {
                self.0.checked_sub(n).map($name)
            }

            /// Steps from `earlier` up to this, 0 if `earlier` is not earlier.
            pub fn since(self, earlier: $name) -> $inner {
                self.0.saturating_sub(earlier.0)
            }
        }
    };
}

/// A node's stable id: what the transport authenticates (certificate `node-N`), what
/// clients, stage nodes, drivers and every core's inputs and outputs call it by, in every
/// membership epoch. An order core counts votes by [`MemberIndex`] instead, and
/// translates at its boundary (`Membership::index_of` / `id_of`). A stage node apart is
/// named by `config::stage_node` of its stable id.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct NodeId(pub u32);

impl NodeId {
    /// As an index into per-node tables.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// An order node's position in its epoch's membership (`0..N`): what votes, quorums,
/// certificates' signers and the primary's rotation are counted by. The same node has
/// another index in another epoch, so nothing outside the order core's vote counting
/// names a node by it.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct MemberIndex(pub u32);

impl MemberIndex {
    /// As an index into per-member tables.
    pub fn index(self) -> usize {
        self.0 as usize
    }

    /// The members of an epoch of `n`: indices `0..n`.
    pub fn all(n: usize) -> impl DoubleEndedIterator<Item = MemberIndex> + ExactSizeIterator + Clone {
        (0..n as u32).map(MemberIndex)
    }
}

bare_fmt!(MemberIndex);

/// Consecutive node names, as `Range` is for integers (and, like it, an iterator): the
/// order nodes of an epoch (`NodeRange::first(n)`) or the nodes of a stage apart. Not
/// `Copy`, as `Range` is not: an iterator copied by accident would be iterated twice.
#[derive(Clone, PartialEq, Eq, Debug, Default)]
pub struct NodeRange {
    pub start: NodeId,
    pub end: NodeId,
}

impl NodeRange {
    /// `len` nodes from `start` on.
    pub fn new(start: NodeId, len: usize) -> NodeRange {
        NodeRange { start, end: NodeId(start.0 + len as u32) }
    }

    /// The order nodes of an epoch of `n`: indices `0..n`.
    pub fn first(n: usize) -> NodeRange {
        NodeRange::new(NodeId(0), n)
    }

    pub fn contains(&self, node: &NodeId) -> bool {
        self.start <= *node && *node < self.end
    }

    /// Where `node` is in the range (0 for its start), if it is in it.
    pub fn offset(&self, node: NodeId) -> Option<usize> {
        self.contains(&node).then(|| (node.0 - self.start.0) as usize)
    }

    /// The node `offset` places after the start (not checked against the end).
    pub fn at(&self, offset: usize) -> NodeId {
        NodeId(self.start.0 + offset as u32)
    }
}

/// Stable ids as node names (what clients and stage nodes call nodes by).
impl From<std::ops::Range<u32>> for NodeRange {
    fn from(ids: std::ops::Range<u32>) -> NodeRange {
        NodeRange { start: NodeId(ids.start), end: NodeId(ids.end.max(ids.start)) }
    }
}

impl Iterator for NodeRange {
    type Item = NodeId;

    fn next(&mut self) -> Option<NodeId> {
        (self.start < self.end).then(|| {
            let n = self.start;
            self.start.0 += 1;
            n
        })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = self.end.0.saturating_sub(self.start.0) as usize;
        (n, Some(n))
    }
}

impl DoubleEndedIterator for NodeRange {
    fn next_back(&mut self) -> Option<NodeId> {
        (self.start < self.end).then(|| {
            self.end.0 -= 1;
            self.end
        })
    }
}

impl ExactSizeIterator for NodeRange {}

/// Parses the bare number (directory and certificate names: `node-3`).
impl std::str::FromStr for NodeId {
    type Err = std::num::ParseIntError;

    fn from_str(s: &str) -> Result<NodeId, Self::Err> {
        s.parse().map(NodeId)
    }
}

bare_fmt!(NodeId);
/// A protocol client: its own sequence numbers, one request in flight, one reply-cache
/// entry. The transport authenticates the *owner* (certificate `client-N`); an owner may
/// run up to [`SESSIONS_MAX`] sessions over the same connections so that one process can
/// keep many requests in flight (the frames of all of them share syscalls). Session `s`
/// of owner `N` is `N | s << SESSION_SHIFT`; session 0 is `N` itself.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ClientId(pub u64);

bare_fmt!(ClientId);

/// Parses the bare number (certificate names: `client-7`).
impl std::str::FromStr for ClientId {
    type Err = std::num::ParseIntError;

    fn from_str(s: &str) -> Result<ClientId, Self::Err> {
        s.parse().map(ClientId)
    }
}

pub const SESSION_SHIFT: u32 = 40;

/// Sessions per client identity. Bounds what one authenticated client can make a node
/// keep (reply-cache entries, pending requests are bounded separately by `clients_max`).
pub const SESSIONS_MAX: u64 = 1024;

/// Session `session` of the client identity `owner`.
pub fn session_id(owner: ClientId, session: u64) -> ClientId {
    ClientId(owner.0 | (session << SESSION_SHIFT))
}

/// The client identity (certificate) a session belongs to.
pub fn owner_of(client: ClientId) -> ClientId {
    ClientId(client.0 & ((1 << SESSION_SHIFT) - 1))
}

/// The session number within its owner.
pub fn session_of(client: ClientId) -> u64 {
    client.0 >> SESSION_SHIFT
}
number! {
    /// A view number; the primary of view `v` is `v mod N`.
    View(u64)
}

impl View {
    /// The index of this view's primary among `n` members.
    pub fn primary(self, n: usize) -> MemberIndex {
        MemberIndex((self.0 % n as u64) as u32)
    }
}
number! {
    /// A consensus instance (sequence number); each decides one value.
    Seq(u64)
}

impl Seq {
    /// The instances from this one to `last`, both included.
    pub fn through(self, last: Seq) -> impl DoubleEndedIterator<Item = Seq> + Clone {
        (self.0..=last.0).map(Seq)
    }

    /// The instances from this one up to `end`, which is left out.
    pub fn until(self, end: Seq) -> impl DoubleEndedIterator<Item = Seq> + Clone {
        (self.0..end.0).map(Seq)
    }

    /// This instance and every one after it.
    pub fn onward(self) -> impl Iterator<Item = Seq> + Clone {
        (self.0..).map(Seq)
    }

    /// Whether a checkpoint every `interval` instances falls here.
    pub fn is_multiple_of(self, interval: u64) -> bool {
        self.0.is_multiple_of(interval)
    }
}

/// Client identities from here up are reserved for nodes (and, just below,
/// the administrator's `membership::ADMIN_CLIENT`); no client may claim them.
pub const ENDORSER_OWNER_BASE: ClientId = ClientId((1 << SESSION_SHIFT) - crate::quorum::NODES_MAX as u64);

/// The client an agreed-time tick runs as (`Service::on_tick`'s `ctx.client`): no
/// client holds its keys, so no request claims it.
pub const TICK_CLIENT: ClientId = ClientId(ENDORSER_OWNER_BASE.0 - 2);
