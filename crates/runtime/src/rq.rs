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

use crate::config::NodeSetup;
use crate::driver::{drive, Env, Hosted};
use crate::embed::Control;
use crate::node::NodeError;
use keel_core::codec;
use keel_core::config::stage_node;
use keel_core::rq_node::RqNode;

/// Runs an RQ node until the process ends.
///
/// # Errors
/// Failures to bind or configure TLS.
pub async fn run_rq_node(setup: NodeSetup, mut control: Control) -> Result<(), NodeError> {
    let cfg = setup.cluster.clone();
    let mut rq =
        RqNode::new(cfg.clone(), stage_node(setup.id.0), setup.secrets.signing.clone(), setup.secrets.mac_secret);
    if let Some(certs) = crate::epochs::load(&setup.data_dir) {
        if let Err(e) = rq.follow(certs) {
            tracing::warn!(error = %e, "the kept epoch certificates do not follow the cluster file; asking the nodes");
        }
    }
    tracing::info!(node = setup.id.0, epoch = rq.epoch(), "RQ node started");
    // The order nodes (members) and the other RQ nodes; no log, no verify stage.
    let env = Env::open(setup, &mut control, &cfg.membership, None, |_, _| None).await?;
    drive(RqHost { rq }, env, control).await
}

/// An RQ node as the driver hosts it.
struct RqHost {
    rq: RqNode,
}

impl Hosted for RqHost {
    type Core = RqNode;
    const NAME: &'static str = "RQ node";

    fn core(&self) -> &RqNode {
        &self.rq
    }

    fn core_mut(&mut self) -> &mut RqNode {
        &mut self.rq
    }

    fn before_flush(&mut self, env: &mut Env) -> Result<(), NodeError> {
        if self.rq.epoch() != env.peers.epoch() {
            // It followed the order nodes' epoch certificates: their members from now on.
            env.peers.follow_stage(&self.rq.config().membership);
            tracing::info!(epoch = self.rq.epoch(), "RQ node follows a new membership epoch");
            // Kept across a restart (before it endorses for the new members: a node that
            // restarts follows at least as far).
            let frame = codec::encode(&keel_core::message::Message::EpochCerts(self.rq.epoch_certs().to_vec()));
            crate::storage::write_atomic(&env.setup.data_dir, crate::epochs::FILE, &frame)?;
        }
        Ok(())
    }
}
