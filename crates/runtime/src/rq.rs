//! An RQ node process of a cluster with a separate request-quorum stage (UpRight §4.1):
//! the transport and the sans-IO RQ node ([`keel_core::rq_node::RqNode`]).
//!
//! ```text
//!  TLS readers ──► inbound queue ──► protocol task: step the RQ node
//!      ──► endorsements to the order nodes and RQ peers, operation bytes on request
//! ```
//!
//! Nothing goes to disk but the epoch certificates it followed: order nodes hold every
//! byte of a value before they vote for it, so an RQ node restarts without requests
//! (rq_node.rs explains why that is safe), in the newest epoch it knew.

use crate::clients::Clients;
use crate::config::NodeSetup;
use crate::embed::Control;
use crate::inbound;
use crate::node::{
    announce, dial_peers, handle, listen, now_ms, publish, record_events, Link, NodeError, Peers, INBOUND_QUEUE_MAX,
};
use crate::transport::{node_frame, offer, TransportStats};
use keel_core::codec;
use keel_core::config::stage_node;
use keel_core::message::owner_of;
use keel_core::replica::{Input, Outputs, Peer};
use keel_core::rq_node::RqNode;
use std::time::Duration;

/// How often the RQ node's timers are checked.
const TICK: Duration = Duration::from_millis(5);
/// Inputs stepped before the outputs are flushed.
const STEP_BATCH_MAX: usize = 1024;

/// Runs an RQ node until the process ends.
///
/// # Errors
/// Failures to bind or configure TLS.
pub async fn run_rq_node(setup: NodeSetup, mut control: Control) -> Result<(), NodeError> {
    let cfg = setup.cluster.clone();
    let mut rq =
        RqNode::new(cfg.clone(), stage_node(setup.id), setup.secrets.signing.clone(), setup.secrets.mac_secret);
    if let Some(certs) = crate::epochs::load(&setup.data_dir) {
        if let Err(e) = rq.follow(certs) {
            tracing::warn!(error = %e, "the kept epoch certificates do not follow the cluster file; asking the nodes");
        }
    }
    tracing::info!(node = setup.id, epoch = rq.epoch(), "RQ node started");
    let (stats, m, shared) = announce(&setup).await?;
    let (in_tx, mut in_rx) = inbound::channel(INBOUND_QUEUE_MAX);
    // The order nodes (members) and the other RQ nodes.
    let mut peers = dial_peers(&setup, &cfg.membership, &stats)?;
    peers.follow_stage(&cfg.membership);
    let bans = listen(&setup, &in_tx, None, &stats).await?;
    control.started(&shared, &m);
    let (plane_in, mut plane_out) = control.take_plane();
    // One future for the whole run, not one per turn of the loop: a fresh watch
    // subscription per turn costs a waiter registration on every wake-up.
    let stopped = control.stopped();
    tokio::pin!(stopped);
    let mut clients = Clients::new(bans);
    let mut out = Outputs::default();
    let mut tick = tokio::time::interval(TICK);
    // Last state-transfer progress logged (an RQ node transfers none): publish's.
    let mut transfer_logged = u64::MAX;
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        if rq.epoch() != peers.epoch() {
            // It followed the order nodes' epoch certificates: their members from now on.
            peers.follow_stage(&rq.config().membership);
            tracing::info!(epoch = rq.epoch(), "RQ node follows a new membership epoch");
            // Kept across a restart (before it endorses for the new members: a node that
            // restarts follows at least as far).
            let frame = codec::encode(&keel_core::message::Message::EpochCerts(rq.epoch_certs().to_vec()));
            crate::storage::write_atomic(&setup.data_dir, crate::epochs::FILE, &frame)?;
        }
        send(&mut out, &peers, &mut clients, &stats);
        record_events(&mut out, &mut clients, &m);
        tokio::select! {
            ev = in_rx.recv() => {
                let Some(ev) = ev else { return Ok(()) };
                let link = Link { peers: &peers, stats: &stats, plane: &plane_in, m: &m };
                handle(&mut rq, ev, &mut clients, &mut out, &link);
                for _ in 0..STEP_BATCH_MAX {
                    match in_rx.try_recv() {
                        Some(ev) => handle(&mut rq, ev, &mut clients, &mut out, &link),
                        None => break,
                    }
                }
            }
            _ = tick.tick() => {
                rq.step(now_ms(), Input::Tick, &mut out);
                publish(&rq, setup.id, &m, &shared, in_rx.len(), peers.connected(), &mut transfer_logged);
            }
            (to, payload) = plane_out.next() => peers.send_plane(to, payload, &m),
            _ = &mut stopped => {
                tracing::info!(node = setup.id, "RQ node stopped");
                return Ok(());
            }
        }
    }
}

/// Sends what the step(s) produced: an RQ node persists nothing, so nothing waits.
fn send(out: &mut Outputs, peers: &Peers, clients: &mut Clients, stats: &TransportStats) {
    let gated = std::mem::take(&mut out.send_after_persist);
    for (to, msg) in out.send.drain(..).chain(gated) {
        match to {
            Peer::Node(j) => {
                if let Some(tx) = peers.route(j) {
                    offer(tx, node_frame(peers.epoch(), &msg), stats);
                }
            }
            Peer::Client(c) => {
                if let Some(tx) = clients.route(owner_of(c)) {
                    offer(tx, codec::encode(&msg), stats);
                }
            }
        }
    }
}
