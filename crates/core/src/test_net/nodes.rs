//! The nodes of a [`super::TestNet`] of one kind (order or stage), kept by stable id.
//!
//! Two ways in, because the tests read nodes two ways: `nodes[&id]` is the node with
//! stable id `id` (what membership changes need: ids are never reused, removed nodes
//! leave gaps), and `nodes[i]` is the `i`-th node in stable-id order, as the `Vec`s the
//! single-epoch tests were written for. Without removals the two agree for order nodes
//! (stable ids 0..n); for stage nodes `stage[0]` is the first stage node.

use crate::ids::NodeId;
use std::collections::BTreeMap;
use std::ops::{Deref, DerefMut, Index, IndexMut};

pub(crate) struct Nodes<T>(BTreeMap<NodeId, T>);

impl<T> Nodes<T> {
    pub(crate) fn new(nodes: impl IntoIterator<Item = (NodeId, T)>) -> Nodes<T> {
        Nodes(nodes.into_iter().collect())
    }

    /// The nodes in stable-id order (as a `Vec`'s `iter`; `by_id` gives the ids too).
    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> {
        self.0.values()
    }

    pub(crate) fn by_id(&self) -> impl Iterator<Item = (&NodeId, &T)> {
        self.0.iter()
    }
}

impl<T> Deref for Nodes<T> {
    type Target = BTreeMap<NodeId, T>;
    fn deref(&self) -> &BTreeMap<NodeId, T> {
        &self.0
    }
}

impl<T> DerefMut for Nodes<T> {
    fn deref_mut(&mut self) -> &mut BTreeMap<NodeId, T> {
        &mut self.0
    }
}

impl<T> Index<usize> for Nodes<T> {
    type Output = T;
    fn index(&self, i: usize) -> &T {
        self.0.values().nth(i).unwrap_or_else(|| panic!("no node at position {i} of {}", self.0.len()))
    }
}

impl<T> IndexMut<usize> for Nodes<T> {
    fn index_mut(&mut self, i: usize) -> &mut T {
        let len = self.0.len();
        self.0.values_mut().nth(i).unwrap_or_else(|| panic!("no node at position {i} of {len}"))
    }
}

impl<T> Index<&NodeId> for Nodes<T> {
    type Output = T;
    fn index(&self, id: &NodeId) -> &T {
        self.0.get(id).unwrap_or_else(|| panic!("no node with stable id {id}"))
    }
}

impl<T> IndexMut<&NodeId> for Nodes<T> {
    fn index_mut(&mut self, id: &NodeId) -> &mut T {
        self.0.get_mut(id).unwrap_or_else(|| panic!("no node with stable id {id}"))
    }
}

impl<'a, T> IntoIterator for &'a Nodes<T> {
    type Item = &'a T;
    type IntoIter = std::collections::btree_map::Values<'a, NodeId, T>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.values()
    }
}
