//! Keel: a replicated service that stays up through `u` failures and stays right
//! through `r` of them being arbitrary (Byzantine), in one library.
//!
//! You write a deterministic [`Service`]; Keel orders requests among its nodes and runs
//! them on every node in the same order (UpRight's (u, r) agreement with checkpoints,
//! view changes, state transfer and a write-ahead log). A program embeds nodes with
//! [`NodeBuilder`]; clients call [`KeelClient::invoke`] and count a reply once `r + 1`
//! nodes agree on it.
//!
//! ```text
//!   provision(dir, InitOptions { u, r, .. })   keys, certificates, data directories
//!        │                                      (or NodeFile::load: what `keel init` wrote)
//!        ▼
//!   NodeBuilder::new(setup, MyService::default)
//!        .client(identity)                      the node's in-process client
//!        .front_end(|fe| async move { .. })     a listener of the service's own
//!        .start().await ──► NodeHandle { status(), events(), client(), shutdown() }
//! ```
//!
//! A service's nodes may also talk beside the protocol, unordered, over the nodes' TLS
//! connections ([`NodeBuilder::node_plane`], [`NodePlane`]): only peers of the node's
//! epoch are heard, and only what the service's check accepts reaches it.
//!
//! Beyond request and reply, a service may ask for agreed-time ticks
//! ([`Service::on_tick`], `InitOptions::tick_ms`): every node runs them at the same
//! point of the decided sequence, so leases and session expiry need no client. It may
//! push events to clients ([`ExecCtx::push`]), answer reads without ordering
//! ([`Service::execute_read_only`]) and run conflict-free requests in parallel
//! ([`Service::conflicts`]).
//!
//! `examples/presence.rs` is a whole program: a service with ticks and a front end on
//! four nodes in one process, a client, a shutdown and a restart from disk.
//!
//! The layers below stay reachable: [`core`] is the sans-IO protocol (what the
//! simulator drives), [`runtime`] the tokio driver.

pub use keel_core::client::Pushed;
pub use keel_core::ids::{ClientId, NodeId, Seq, View, TICK_CLIENT};
pub use keel_core::quorum::{Quorums, ReadConsistency};
pub use keel_core::service::{ConcurrentService, Conflicts, ExecCtx, Frozen, Item, ReadCtx, RestoreError, Service};
pub use keel_runtime::client::{BlockingClient, InvokeError, KeelClient, PushReceiver};
pub use keel_runtime::config::{ClientFile, ClientSetup, NodeFile, NodeSetup};
pub use keel_runtime::embed::{
    load, provision, FrontEnd, NodeBuilder, NodeEvent, NodeHandle, NodePlane, PlaneError, PlaneSender, Provisioned,
};
pub use keel_runtime::metrics::{ServiceReport, Status};
pub use keel_runtime::node::NodeError;
pub use keel_runtime::provision::{free_ports, InitOptions};
pub use keel_runtime::storage::FsyncPolicy;

/// The sans-IO protocol cores: replica, execution and RQ nodes, client, quorums.
pub mod core {
    pub use keel_core::*;
}

/// The tokio driver: transport, storage, node assembly, client.
pub mod runtime {
    pub use keel_runtime::*;
}
