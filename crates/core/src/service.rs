//! The interface between Keel and a replicated application (ARCHITECTURE §9).
//!
//! A service must be deterministic: the same requests with the same contexts, from the
//! same snapshot, produce the same replies and the same next snapshot on every node. It
//! must use `ctx.time` and `ctx.seed` instead of the local clock and randomness.

use crate::message::{ClientId, Seq};

/// What execution tells the service about the request it runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExecCtx {
    /// The consensus instance that decided the request.
    pub seq: Seq,
    /// Agreed time (ms): the primary's proposal, made monotonic across instances.
    pub time: u64,
    /// Agreed pseudo-random seed of the instance, mixed with the request's position.
    pub seed: u64,
    pub client: ClientId,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("snapshot cannot be restored: {0}")]
pub struct RestoreError(pub String);

pub trait Service {
    /// Runs one ordered request and returns the reply bytes.
    fn execute(&mut self, request: &[u8], ctx: &ExecCtx) -> Vec<u8>;

    /// A deterministic serialization of the whole state: equal states give equal bytes.
    fn snapshot(&self) -> Vec<u8>;

    /// Replaces the state with a snapshot taken by [`Service::snapshot`] on some node.
    ///
    /// # Errors
    /// If the bytes are not a snapshot of this service; the state is then unchanged.
    fn restore(&mut self, snapshot: &[u8]) -> Result<(), RestoreError>;
}
