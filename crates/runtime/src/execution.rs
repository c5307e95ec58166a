//! An execution node process of a cluster with separated execution (UpRight §4.2): the
//! transport, snapshots on disk and the sans-IO execution node
//! ([`keel_core::exec_node::ExecNode`]).
//!
//! ```text
//!  TLS readers ──► inbound queue ──► protocol task: step the execution node
//!      ──► replies to clients now; snapshots to the WAL thread, checkpoint hashes to
//!          the order nodes once their snapshot is durable
//! ```
//!
//! It holds no log of its own: what it executes the order nodes decided and keep until
//! the execution checkpoint after it is certified; it restarts from its newest snapshot.

use crate::clients::Clients;
use crate::committer::Committer;
use crate::config::NodeSetup;
use crate::embed::Control;
use crate::inbound;
use crate::node::{
    announce, dial_peers, drain, flush, handle, listen, now_ms, publish, Link, NodeError, INBOUND_QUEUE_MAX,
};
use crate::storage::{Storage, StorageError};
use keel_core::config::stage_node;
use keel_core::exec_node::ExecNode;
use keel_core::replica::{Input, Outputs};
use keel_core::service::Service;
use std::time::Duration;

/// How often the execution node's timers are checked.
const TICK: Duration = Duration::from_millis(5);
/// Inputs stepped before the outputs are flushed.
const STEP_BATCH_MAX: usize = 1024;

/// Runs an execution node until the process ends.
///
/// # Errors
/// Failures to open storage, restore the newest snapshot, bind or configure TLS; and a
/// storage failure while running.
pub async fn run_execution_node<S: Service + Send + 'static>(
    setup: NodeSetup,
    service: S,
    mut control: Control,
) -> Result<(), NodeError> {
    let (storage, durable) = Storage::open(&setup.data_dir, setup.fsync)?;
    let cfg = setup.cluster.clone();
    let signing = setup.secrets.signing.clone();
    let me = stage_node(setup.id);
    let mut exec = if durable.snapshots.is_empty() {
        ExecNode::new(cfg, me, signing, service)
    } else {
        ExecNode::recover(cfg, me, signing, service, durable.snapshots, &durable.records)?
    };
    tracing::info!(node = setup.id, executed = exec.executed(), "execution node started");
    let (stats, m, shared) = announce(&setup).await?;
    let (in_tx, mut in_rx) = inbound::channel(INBOUND_QUEUE_MAX);

    // The order nodes (members) and the other execution nodes; no verify stage.
    let mut peers = dial_peers(&setup, &exec.config().membership, &stats)?;
    peers.follow_stage(&exec.config().membership);
    let bans = listen(&setup, &in_tx, None, &stats).await?;
    control.started(&shared, &m);
    let (plane_in, mut plane_out) = control.take_plane();
    // One future for the whole run, not one per turn of the loop: a fresh watch
    // subscription per turn costs a waiter registration on every wake-up.
    let stopped = control.stopped();
    tokio::pin!(stopped);

    let mut clients = Clients::new(bans);
    let mut committer = Committer::start(storage, stats.clone(), m.clone()).map_err(|source| {
        NodeError::Storage(StorageError::Io { what: "start WAL thread", path: setup.data_dir.clone(), source })
    })?;
    let mut out = Outputs::default();
    let mut tick = tokio::time::interval(TICK);
    // Last state-transfer progress logged, in tenths.
    let mut transfer_logged = u64::MAX;
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        if exec.config().epoch() != peers.epoch() {
            // It executed into a new membership epoch: its order nodes from now on.
            peers.follow_stage(&exec.config().membership);
            tracing::info!(epoch = exec.config().epoch(), "execution node follows a new membership epoch");
        }
        flush(&mut committer, &mut out, &peers, &mut clients, &stats, &m)?;
        tokio::select! {
            e = committer.failed() => return Err(e.into()),
            ev = in_rx.recv() => {
                let Some(ev) = ev else { return Ok(()) };
                let link = Link { peers: &peers, stats: &stats, plane: &plane_in, m: &m };
                handle(&mut exec, ev, &mut clients, &mut out, &link);
                for _ in 0..STEP_BATCH_MAX {
                    match in_rx.try_recv() {
                        Some(ev) => handle(&mut exec, ev, &mut clients, &mut out, &link),
                        None => break,
                    }
                }
            }
            _ = tick.tick() => {
                exec.step(now_ms(), Input::Tick, &mut out);
                publish(&exec, setup.id, &m, &shared, in_rx.len(), peers.connected(), &mut transfer_logged);
            }
            (to, payload) = plane_out.next() => peers.send_plane(to, payload, &m),
            _ = &mut stopped => break,
        }
    }
    drain(&mut committer).await?;
    committer.close();
    tracing::info!(node = setup.id, "execution node stopped");
    Ok(())
}
