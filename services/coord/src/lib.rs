//! coord: a ZooKeeper-compatible coordination service on Keel (UpRight §5).
//!
//! - [`coord`]: the replicated state (data tree, sessions, watches) as a [`keel::Service`];
//! - [`front`]: the ZooKeeper client port a node serves, over the node's Keel client;
//! - [`proto`] and [`jute`]: ZooKeeper's wire format;
//! - [`session_key`]: session passwords no node knows.

pub mod coord;
pub mod front;
pub mod jute;
pub mod proto;
pub mod session_key;
pub mod tree;

pub use coord::Coord;

/// The ZooKeeper release whose client protocol this speaks (what `envi` reports).
pub const ZOOKEEPER_VERSION: &str = "3.9.5";
