//! The protocol task's view of connected clients: where replies go, and which clients
//! proved themselves faulty.
//!
//! A request that arrives on client c's own TLS connection, in c's name (or one of its
//! sessions'), with a MAC that fails for this node, can only have come from c: the
//! channel authenticates c and the MAC key is c's. After [`BAD_MACS_MAX`] such requests
//! the node closes the connection and refuses c for [`BAN_MS`] (Aardvark blacklists
//! clients whose requests fail to authenticate). Otherwise a client could make every
//! node spend its time checking garbage: measured on the 2-core host, another client's
//! put p50 went from 1.5 ms to 18-23 ms while one client flooded all four nodes with
//! forged requests. Bans are per client identity, so bounded by provisioned clients.

use keel_core::message::ClientId;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::{mpsc, Notify};

/// Requests with a bad MAC one connection may send before it is closed.
pub const BAD_MACS_MAX: u64 = 64;
/// How long a client that sent them is refused.
pub const BAN_MS: u64 = 10_000;

/// Clients refused until a time (ms); shared with the accept path.
#[derive(Debug, Default)]
pub struct Bans {
    until: Mutex<HashMap<ClientId, u64>>,
}

impl Bans {
    pub fn banned(&self, id: ClientId, now: u64) -> bool {
        self.until.lock().map(|u| u.get(&id).is_some_and(|&t| now < t)).unwrap_or(false)
    }

    fn ban(&self, id: ClientId, now: u64) {
        if let Ok(mut u) = self.until.lock() {
            u.retain(|_, t| now < *t);
            u.insert(id, now + BAN_MS);
        }
    }
}

struct Conn {
    conn: u64,
    tx: mpsc::Sender<Vec<u8>>,
    close: Arc<Notify>,
    bad_macs: u64,
}

pub struct Clients {
    conns: HashMap<ClientId, Conn>,
    bans: Arc<Bans>,
}

impl Clients {
    pub fn new(bans: Arc<Bans>) -> Clients {
        Clients { conns: HashMap::new(), bans }
    }

    /// Connection `conn` of client `id` is up (a newer one replaces an older one).
    pub fn up(&mut self, id: ClientId, conn: u64, tx: mpsc::Sender<Vec<u8>>, close: Arc<Notify>) {
        self.conns.insert(id, Conn { conn, tx, close, bad_macs: 0 });
    }

    pub fn down(&mut self, id: ClientId, conn: u64) {
        if self.conns.get(&id).is_some_and(|c| c.conn == conn) {
            self.conns.remove(&id);
        }
    }

    /// Where messages for client identity `id` go.
    pub fn route(&self, id: ClientId) -> Option<&mpsc::Sender<Vec<u8>>> {
        self.conns.get(&id).map(|c| &c.tx)
    }

    /// Client identity `id` sent a request with a bad MAC on its connection. Returns true
    /// when that made it one too many: the connection is closed and the client banned.
    pub fn bad_mac(&mut self, id: ClientId, now: u64) -> bool {
        let Some(c) = self.conns.get_mut(&id) else { return false };
        c.bad_macs += 1;
        if c.bad_macs < BAD_MACS_MAX {
            return false;
        }
        c.close.notify_one();
        self.conns.remove(&id);
        self.bans.ban(id, now);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_is_banned_after_too_many_bad_macs_and_only_for_a_while() {
        let bans = Arc::new(Bans::default());
        let mut clients = Clients::new(bans.clone());
        let (tx, _rx) = mpsc::channel(1);
        let close = Arc::new(Notify::new());
        clients.up(ClientId(7), 1, tx, close.clone());
        for _ in 1..BAD_MACS_MAX {
            assert!(!clients.bad_mac(ClientId(7), 1_000));
        }
        assert!(clients.route(ClientId(7)).is_some());
        assert!(clients.bad_mac(ClientId(7), 1_000), "one too many");
        assert!(clients.route(ClientId(7)).is_none(), "disconnected");
        assert!(bans.banned(ClientId(7), 1_000) && bans.banned(ClientId(7), 1_000 + BAN_MS - 1));
        assert!(!bans.banned(ClientId(7), 1_000 + BAN_MS), "the ban ends");
        assert!(!bans.banned(ClientId(8), 1_000), "others are not affected");
        // Unknown or already gone clients: nothing to do.
        assert!(!clients.bad_mac(ClientId(9), 1_000));
        // The connection was told to close.
        assert!(futures_ready(close.notified()));
    }

    /// Whether a `Notified` future completes at once (a permit was stored).
    fn futures_ready(n: tokio::sync::futures::Notified<'_>) -> bool {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        rt.block_on(async { tokio::time::timeout(std::time::Duration::from_millis(10), n).await.is_ok() })
    }
}
