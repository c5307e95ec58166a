//! Keel's protocol cores as deterministic, sans-IO state machines.
//!
//! Nothing in this crate opens a socket, reads a clock, spawns a thread or draws a random
//! number: time arrives as an input, randomness is derived from agreed values, and every
//! effect (send, persist, reply) is an output the driver carries out. The tokio runtime
//! and the simulator drive the same code.

pub mod client;
pub mod codec;
pub mod config;
pub mod crypto;
pub mod exec;
pub mod message;
pub mod quorum;
pub mod replica;
pub mod service;
pub mod wal;
