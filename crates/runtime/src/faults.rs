//! Faults a node can be told to commit (`[faults]` in node.toml), for tests that must
//! see the cluster catch them: a slow primary (node.rs, `slow_propose_ms`) and a state
//! that silently goes wrong ([`LosesRequest`], `lose_request_after_ms`).

use keel_core::chunk::Piece;
use keel_core::service::{ConcurrentService, Conflicts, ExecCtx, Frozen, ReadCtx, RestoreError, Service};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// A service whose node, once `at` has passed, executes one request as if it were not
/// there: the state silently lacks it (a corrupted state, as a bad disk, bad memory or
/// a bug would leave it), and the reply is empty. The cluster must notice at the next
/// checkpoint (its root differs from the certified one: `Event::Divergence`) and repair
/// the node by state transfer, while the others' replies outvote its wrong one.
///
/// Requests then run one at a time ([`Service::concurrent`] is None), so the lost one
/// cannot slip through the parallel path.
pub struct LosesRequest<S> {
    inner: S,
    at: Instant,
    /// Shared by every service the node builds (one per epoch): one request in all.
    spent: Arc<AtomicBool>,
}

impl<S> LosesRequest<S> {
    pub fn new(inner: S, at: Instant, spent: Arc<AtomicBool>) -> LosesRequest<S> {
        LosesRequest { inner, at, spent }
    }
}

impl<S: Service> Service for LosesRequest<S> {
    fn execute(&mut self, request: &[u8], ctx: &ExecCtx) -> Vec<u8> {
        if Instant::now() >= self.at && !self.spent.swap(true, Ordering::SeqCst) {
            tracing::warn!(
                seq = ctx.seq.0,
                "fault injection: this request is lost from the state ([faults] lose_request_after_ms)"
            );
            return Vec::new();
        }
        self.inner.execute(request, ctx)
    }

    fn conflicts(&self, request: &[u8]) -> Conflicts {
        self.inner.conflicts(request)
    }

    fn concurrent(&self) -> Option<Arc<dyn ConcurrentService>> {
        None
    }

    fn execute_read_only(&self, request: &[u8], ctx: &ReadCtx) -> Option<Vec<u8>> {
        self.inner.execute_read_only(request, ctx)
    }

    fn on_tick(&mut self, ctx: &ExecCtx) {
        self.inner.on_tick(ctx);
    }

    fn snapshot(&self) -> Vec<u8> {
        self.inner.snapshot()
    }

    fn pieces(&self) -> Vec<Arc<Piece>> {
        self.inner.pieces()
    }

    fn freeze(&self) -> Option<Box<dyn Frozen>> {
        self.inner.freeze()
    }

    fn restore(&mut self, snapshot: &[u8]) -> Result<(), RestoreError> {
        self.inner.restore(snapshot)
    }

    fn restore_from(&mut self, state: &mut dyn std::io::Read, len: u64) -> Result<(), RestoreError> {
        self.inner.restore_from(state, len)
    }
}
