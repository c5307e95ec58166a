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

use crate::config::NodeSetup;
use crate::driver::{drive, Env, Hosted};
use crate::embed::Control;
use crate::node::NodeError;
use crate::storage::Storage;
use keel_core::config::stage_node;
use keel_core::exec_node::ExecNode;
use keel_core::service::Service;

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
    let me = stage_node(setup.id.0);
    let exec = if durable.snapshots.is_empty() {
        ExecNode::new(cfg, me, signing, service)
    } else {
        ExecNode::recover(cfg, me, signing, service, durable.snapshots, &durable.records)?
    };
    tracing::info!(node = setup.id.0, executed = exec.executed().0, "execution node started");
    // The order nodes (members) and the other execution nodes; no verify stage.
    let membership = exec.config().membership.clone();
    let env = Env::open(setup, &mut control, &membership, Some(storage), |_, _| None).await?;
    drive(ExecHost { exec }, env, control).await
}

/// An execution node as the driver hosts it.
struct ExecHost<S> {
    exec: ExecNode<S>,
}

impl<S: Service + Send + 'static> Hosted for ExecHost<S> {
    type Core = ExecNode<S>;
    const NAME: &'static str = "execution node";

    fn core(&self) -> &ExecNode<S> {
        &self.exec
    }

    fn core_mut(&mut self) -> &mut ExecNode<S> {
        &mut self.exec
    }

    fn before_flush(&mut self, env: &mut Env) -> Result<(), NodeError> {
        if self.exec.config().epoch() != env.peers.epoch() {
            // It executed into a new membership epoch: its order nodes from now on.
            env.peers.follow_stage(&self.exec.config().membership);
            tracing::info!(epoch = self.exec.config().epoch(), "execution node follows a new membership epoch");
        }
        Ok(())
    }
}
