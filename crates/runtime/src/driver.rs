//! The one loop every node process runs, whatever stage it hosts (issue #22):
//!
//! ```text
//!  TLS readers ──► inbound queue ──► step the core for every queued input (a batch)
//!      ──► flush: send what needs no disk, hand records + gated messages to the WAL
//!          thread (a stage without a log sends everything at once)
//!  plus: timers (Input::Tick every TICK), the node plane's outbound queue, the stage's
//!        own background input, the stop signal
//!  a durability barrier (Outputs::barrier): wait until the WAL thread drained, then
//!        step Input::Drained, before anything else
//! ```
//!
//! What differs by stage lives in its [`Hosted`] implementation: `node.rs` (an order
//! node, co-located or apart: the verify stage, the checkpoint thread, following its
//! epochs, fault injection), `execution.rs` and `rq.rs` (following a new epoch's peers). Before
//! this there were three copies of the loop, one per stage.

use crate::clients::Clients;
use crate::committer::Committer;
use crate::config::NodeSetup;
use crate::embed::Control;
use crate::inbound::{self, InboundRx, InboundTx};
use crate::metrics::{Metrics, Shared};
use crate::node::{
    announce, dial_peers, drain, flush, handle, listen, now_ms, publish, Link, NodeError, Peers, VerifyQueues,
};
use crate::storage::{Storage, StorageError};
use crate::transport::TransportStats;
use keel_core::membership::Membership;
use keel_core::node::Node;
use keel_core::replica::{Input, Outputs};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

/// Inputs queued for the protocol task.
pub(crate) const INBOUND_QUEUE_MAX: usize = 16384;
/// Inputs stepped before one flush (one group commit).
const STEP_BATCH_MAX: usize = 1024;
/// How often the core's timers are checked.
const TICK: Duration = Duration::from_millis(5);

/// A stage as the driver hosts it: its core and what it does around the core's steps.
/// Every hook has a default that does nothing, which is what most stages want.
pub(crate) trait Hosted {
    type Core: Node;

    /// How logs name it ("node", "execution node", "RQ node").
    const NAME: &'static str;

    fn core(&self) -> &Self::Core;

    fn core_mut(&mut self) -> &mut Self::Core;

    /// Before a turn's outputs leave: follow a new epoch's peers, hand checkpoints to
    /// their thread, hold back proposals under fault injection.
    fn before_flush(&mut self, _env: &mut Env) -> Result<(), NodeError> {
        Ok(())
    }

    /// A batch of inbound inputs is about to be stepped.
    fn begin_batch(&mut self) {}

    /// The batch was stepped.
    fn end_batch(&mut self, _out: &mut Outputs) {}

    /// The next input from the stage's own background work (the order node's
    /// checkpoint thread). Never resolves by default.
    fn background(&mut self) -> impl Future<Output = Result<Input, NodeError>> {
        std::future::pending()
    }

    /// Whether the node stops at `now` (a removed order node, once it lingered).
    fn leaving(&self, _now: u64) -> bool {
        false
    }
}

/// What the loop drives a core with: the node's setup, its connections, its clients,
/// its log (if the stage keeps one) and the outputs of the steps not yet flushed.
pub(crate) struct Env {
    pub(crate) setup: NodeSetup,
    pub(crate) stats: Arc<TransportStats>,
    pub(crate) m: Metrics,
    shared: Arc<Shared>,
    pub(crate) peers: Peers,
    clients: Clients,
    /// The WAL thread; None for a stage that persists nothing (an RQ node).
    pub(crate) committer: Option<Committer>,
    in_rx: InboundRx,
    /// Held for the whole run (the loop ends when the inbound queue closes, which it
    /// must not do while the node runs, whatever the listener's tasks do).
    _in_tx: InboundTx,
    pub(crate) out: Outputs,
}

impl Env {
    /// What every node process does before its loop: serves `/metrics`, dials its
    /// peers (those of `membership`, plus the fixed stage nodes), listens for nodes and
    /// clients (through the verify stage `verify` starts, if it starts one) and starts
    /// the WAL thread on `storage`.
    pub(crate) async fn open(
        setup: NodeSetup,
        control: &mut Control,
        membership: &Membership,
        storage: Option<Storage>,
        verify: impl FnOnce(&InboundTx, &Arc<TransportStats>) -> Option<VerifyQueues>,
    ) -> Result<Env, NodeError> {
        let (stats, m, shared) = announce(&setup).await?;
        let (in_tx, in_rx) = inbound::channel(INBOUND_QUEUE_MAX);
        let mut peers = dial_peers(&setup, membership, &stats)?;
        if setup.executes_only() || setup.rq_only() {
            // Its core names order nodes by stable id, and it follows their epochs.
            peers.follow_stage(membership);
        }
        let verify = verify(&in_tx, &stats);
        let bans = listen(&setup, &in_tx, verify, &stats).await?;
        control.started(&shared, &m);
        let committer = match storage {
            Some(storage) => Some(Committer::start(storage, stats.clone(), m.clone()).map_err(|source| {
                NodeError::Storage(StorageError::Io { what: "start WAL thread", path: setup.data_dir.clone(), source })
            })?),
            None => None,
        };
        Ok(Env {
            setup,
            stats,
            m,
            shared,
            peers,
            clients: Clients::new(bans),
            committer,
            in_rx,
            _in_tx: in_tx,
            out: Outputs::default(),
        })
    }

    /// Waits until everything handed to the WAL thread is durable and sent.
    pub(crate) async fn drain(&mut self) -> Result<(), NodeError> {
        match self.committer.as_mut() {
            Some(c) => drain(c).await,
            None => Ok(()),
        }
    }
}

/// Resolves when the WAL thread failed (never without one).
async fn failed(committer: Option<&mut Committer>) -> StorageError {
    match committer {
        Some(c) => c.failed().await,
        None => std::future::pending().await,
    }
}

/// Runs `host` until `control` says stop, the inbound queue closes, the stage leaves or
/// something fails; then waits until what the node handed to its log is durable.
pub(crate) async fn drive<H: Hosted>(mut host: H, mut env: Env, mut control: Control) -> Result<(), NodeError> {
    let (plane_in, mut plane_out) = control.take_plane();
    // One future for the whole run, not one per turn of the loop: a fresh watch
    // subscription per turn costs a waiter registration on every wake-up.
    let stopped = control.stopped();
    tokio::pin!(stopped);
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    // Last state-transfer progress logged, in tenths.
    let mut transfer_logged = u64::MAX;
    loop {
        host.before_flush(&mut env)?;
        let Env { committer, out, peers, clients, stats, m, .. } = &mut env;
        if flush(committer.as_mut(), out, peers, clients, stats, m)? {
            // A durability barrier (`Outputs::barrier`): the core is stepped again only
            // once everything it persisted is durable and everything it gated is out,
            // and with nothing else first (inputs wait in the inbound queue). An order
            // node goes on to its next membership epoch behind two of them.
            env.drain().await?;
            host.core_mut().step(now_ms(), Input::Drained, &mut env.out);
            continue;
        }
        tokio::select! {
            e = failed(env.committer.as_mut()) => return Err(e.into()),
            ev = env.in_rx.recv() => {
                let Some(ev) = ev else { return Ok(()) };
                host.begin_batch();
                let link = Link { peers: &env.peers, stats: &env.stats, plane: &plane_in, m: &env.m };
                handle(host.core_mut(), ev, &mut env.clients, &mut env.out, &link);
                for _ in 0..STEP_BATCH_MAX {
                    match env.in_rx.try_recv() {
                        Some(ev) => handle(host.core_mut(), ev, &mut env.clients, &mut env.out, &link),
                        None => break,
                    }
                }
                host.end_batch(&mut env.out);
            }
            input = host.background() => host.core_mut().step(now_ms(), input?, &mut env.out),
            _ = tick.tick() => {
                if host.leaving(now_ms()) {
                    break;
                }
                host.core_mut().step(now_ms(), Input::Tick, &mut env.out);
                let (inbound, connected) = (env.in_rx.len(), env.peers.connected());
                publish(host.core(), env.setup.id, &env.m, &env.shared, inbound, connected, &mut transfer_logged);
            }
            (to, payload) = plane_out.next() => env.peers.send_plane(to.0, payload, &env.m),
            // Steps happen in the arms above and their outputs are flushed at the top of
            // the loop: nothing is pending here.
            _ = &mut stopped => break,
        }
    }
    env.drain().await?;
    if let Some(c) = env.committer.take() {
        c.close();
    }
    tracing::info!(node = env.setup.id.0, "{} stopped", H::NAME);
    Ok(())
}
