//! Where a block lives: the disk's shape and Gnothi's slices (§3.1), generalised from
//! f + 1 of 2f + 1 replicas to u + r + 1 of the 2u + r + 1 order nodes, so a block's data
//! survives u nodes that are down and r that lie about holding it.

use serde::{Deserialize, Serialize};

/// Bytes of one stripe: a slice is every n-th stripe of the disk, so a sequential write
/// of up to a stripe goes to one preferred set in one PrepareData, and small random
/// writes still spread over every node.
pub const STRIPE_BYTES: u64 = 1 << 20;

/// The shape every node agrees on (cluster.toml's `[service_options]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Geometry {
    /// Bytes per block: the unit of versions, hashes and data placement.
    pub block_size: u32,
    /// Blocks in the export.
    pub blocks: u64,
    /// Order nodes (2u + r + 1): the number of slices.
    pub nodes: u32,
    /// Nodes a block's data is written to (u + r + 1); every node in full mode.
    pub copies: u32,
}

/// Why a geometry is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GeometryError {
    #[error("block size {0}: a power of two from 512 bytes to 1 MiB")]
    BlockSize(u64),
    #[error("size {size}: a positive multiple of the block size {block_size}, at most 2^50 bytes")]
    Size { size: u64, block_size: u32 },
    #[error("{copies} copies on {nodes} nodes")]
    Copies { copies: u32, nodes: u32 },
}

impl Geometry {
    /// # Errors
    /// A block size that is not a power of two in 512..=1 MiB, a size that is not a
    /// positive multiple of it, or more copies than nodes.
    pub fn new(size: u64, block_size: u64, nodes: u32, copies: u32) -> Result<Geometry, GeometryError> {
        if !block_size.is_power_of_two() || !(512..=1 << 20).contains(&block_size) {
            return Err(GeometryError::BlockSize(block_size));
        }
        if size == 0 || !size.is_multiple_of(block_size) || size > 1 << 50 {
            return Err(GeometryError::Size { size, block_size: block_size as u32 });
        }
        if copies == 0 || copies > nodes {
            return Err(GeometryError::Copies { copies, nodes });
        }
        Ok(Geometry { block_size: block_size as u32, blocks: size / block_size, nodes, copies })
    }

    pub fn size(&self) -> u64 {
        self.blocks * u64::from(self.block_size)
    }

    pub fn bs(&self) -> usize {
        self.block_size as usize
    }

    /// Blocks per stripe (at least one).
    pub fn stripe_blocks(&self) -> u64 {
        (STRIPE_BYTES / u64::from(self.block_size)).max(1)
    }

    /// The slice block `b` belongs to.
    pub fn slice(&self, b: u64) -> u32 {
        ((b / self.stripe_blocks()) % u64::from(self.nodes)) as u32
    }

    /// The member indices (order in the epoch) of block `b`'s preferred set: its slice's
    /// index and the `copies - 1` after it, wrapping (Gnothi's replica n to n + f).
    pub fn preferred(&self, b: u64) -> impl Iterator<Item = u32> + '_ {
        let s = self.slice(b);
        (0..self.copies).map(move |k| (s + k) % self.nodes)
    }

    /// Whether member index `index` is in block `b`'s preferred set.
    pub fn is_preferred(&self, b: u64, index: u32) -> bool {
        let s = self.slice(b);
        (index + self.nodes - s) % self.nodes < self.copies
    }

    /// The end (exclusive) of the run of blocks from `b` that share `b`'s slice, capped
    /// at `limit`.
    pub fn stripe_end(&self, b: u64, limit: u64) -> u64 {
        let sb = self.stripe_blocks();
        ((b / sb + 1) * sb).min(limit).min(self.blocks)
    }
}

/// Runs of consecutive block numbers, as given, each at most `max` long: (first, count).
pub fn runs(blocks: impl IntoIterator<Item = u64>, max: u64) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for b in blocks {
        match out.last_mut() {
            Some((f, n)) if *f + *n == b && *n < max => *n += 1,
            _ => out.push((b, 1)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_join_consecutive_blocks_up_to_a_length() {
        assert_eq!(runs([1, 2, 3, 7, 8, 10], u64::MAX), vec![(1, 3), (7, 2), (10, 1)]);
        assert_eq!(runs([1, 2, 3, 4, 5], 2), vec![(1, 2), (3, 2), (5, 1)]);
        assert!(runs([], 4).is_empty());
    }

    #[test]
    fn every_slice_has_copies_nodes_and_every_node_the_same_share() {
        let g = Geometry::new(64 << 20, 4096, 4, 3).expect("valid");
        assert_eq!(g.blocks, 16384);
        assert_eq!(g.stripe_blocks(), 256);
        let mut share = [0u64; 4];
        for b in 0..g.blocks {
            let p: Vec<u32> = g.preferred(b).collect();
            assert_eq!(p.len(), 3);
            for i in 0..4 {
                assert_eq!(g.is_preferred(b, i), p.contains(&i), "block {b} node {i}");
            }
            for i in p {
                share[i as usize] += 1;
            }
        }
        assert!(share.iter().all(|&s| s == share[0]), "{share:?}");
    }

    #[test]
    fn stripes_end_at_stripe_boundaries_and_the_disk() {
        let g = Geometry::new(3 << 20, 4096, 3, 2).expect("valid");
        assert_eq!(g.stripe_end(0, u64::MAX), 256);
        assert_eq!(g.stripe_end(255, u64::MAX), 256);
        assert_eq!(g.stripe_end(256, 300), 300);
        assert_eq!(g.stripe_end(700, u64::MAX), 768);
        assert_eq!(g.slice(0), 0);
        assert_eq!(g.slice(256), 1);
        assert_eq!(g.slice(768), 0);
    }

    #[test]
    fn bad_shapes_are_refused() {
        assert!(Geometry::new(1 << 20, 1000, 4, 3).is_err());
        assert!(Geometry::new(1 << 20, 256, 4, 3).is_err());
        assert!(Geometry::new(0, 4096, 4, 3).is_err());
        assert!(Geometry::new(4097, 4096, 4, 3).is_err());
        assert!(Geometry::new(1 << 20, 4096, 4, 5).is_err());
    }
}
