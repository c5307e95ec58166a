//! Keel's runtime driver: real files, sockets and clocks around the sans-IO cores.

pub mod backup;
pub mod client;
pub mod clients;
pub mod committer;
pub mod config;
mod driver;
pub mod embed;
mod epochs;
pub mod execution;
pub mod faults;
pub mod inbound;
mod links;
pub mod lockfile;
pub mod metrics;
pub mod node;
pub mod provision;
pub mod rq;
pub mod snapshots;
pub mod storage;
pub mod tls;
pub mod transport;
