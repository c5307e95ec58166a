//! Identities and positions: nodes, clients and their sessions, views and instances.
//! The lowest layer every other module names things with.

/// Index of an order node, `0..N`.
pub type NodeId = u32;
/// A protocol client: its own sequence numbers, one request in flight, one reply-cache
/// entry. The transport authenticates the *owner* (certificate `client-N`); an owner may
/// run up to [`SESSIONS_MAX`] sessions over the same connections so that one process can
/// keep many requests in flight (the frames of all of them share syscalls). Session `s`
/// of owner `N` is `N | s << SESSION_SHIFT`; session 0 is `N` itself.
pub type ClientId = u64;

pub const SESSION_SHIFT: u32 = 40;

/// Sessions per client identity. Bounds what one authenticated client can make a node
/// keep (reply-cache entries, pending requests are bounded separately by `clients_max`).
pub const SESSIONS_MAX: u64 = 1024;

/// Session `session` of the client identity `owner`.
pub fn session_id(owner: ClientId, session: u64) -> ClientId {
    owner | (session << SESSION_SHIFT)
}

/// The client identity (certificate) a session belongs to.
pub fn owner_of(client: ClientId) -> ClientId {
    client & ((1 << SESSION_SHIFT) - 1)
}

/// The session number within its owner.
pub fn session_of(client: ClientId) -> u64 {
    client >> SESSION_SHIFT
}
/// A view number; the primary of view `v` is `v mod N`.
pub type View = u64;
/// A consensus instance (sequence number); each decides one value.
pub type Seq = u64;

/// Client identities from here up are reserved for nodes (and, just below,
/// the administrator's `membership::ADMIN_CLIENT`); no client may claim them.
pub const ENDORSER_OWNER_BASE: ClientId = (1 << SESSION_SHIFT) - crate::quorum::NODES_MAX as u64;

/// The client an agreed-time tick runs as (`Service::on_tick`'s `ctx.client`): no
/// client holds its keys, so no request claims it.
pub const TICK_CLIENT: ClientId = ENDORSER_OWNER_BASE - 2;
