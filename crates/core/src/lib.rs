//! Keel's protocol cores as deterministic, sans-IO state machines.
//!
//! Nothing in this crate opens a socket, reads a clock, spawns a thread or draws a random
//! number: time arrives as an input, randomness is derived from agreed values, and every
//! effect (send, persist, reply) is an output the driver carries out. The tokio runtime
//! and the simulator drive the same code.
//!
//! One exception to "no threads": the executor's worker pool ([`parallel`]), used only
//! for services that opt into parallel execution and only with `exec_workers > 1`. It
//! cannot change an outcome: replies, contexts, the reply cache and snapshots equal those
//! of sequential execution whichever thread runs what (tested in `services/kv`).

pub mod backup;
pub mod chunk;
pub mod client;
pub mod codec;
pub mod config;
pub mod crypto;
pub mod epoch_cert;
pub mod exec;
pub mod exec_node;
pub mod ids;
pub mod keys;
pub mod membership;
pub mod message;
pub mod node;
pub mod parallel;
pub mod quorum;
pub(crate) mod read_wait;
pub mod replica;
pub mod rq_node;
pub mod segments;
pub mod service;

pub mod step;
#[cfg(test)]
mod test_net;
pub mod timeout;
pub mod transfer;
pub mod wal;
