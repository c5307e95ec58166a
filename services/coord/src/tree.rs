//! The data tree: znodes by path, with ZooKeeper's Stat bookkeeping and path rules.
//! Deterministic by construction (ordered maps only, times and zxids given by the caller).
//!
//! Two things beside the nodes, neither part of the state:
//! - what changed since the last checkpoint, so that a checkpoint of a large tree
//!   serializes only the segments (keel-core `segments.rs`) holding a changed path;
//! - while a multi runs, how to take its changes back (an undo journal: a failed multi
//!   used to restore a copy of the whole tree, 100 ms per multi at 100k znodes).

use crate::proto::{err, Acl, Stat, CONFIG_PATH};
use keel_core::chunk::Piece;
use keel_core::segments::{self, Segment, Split};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

/// What kind of node a create made: it decides when the node goes away by itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Kind {
    Persistent,
    /// Deleted with its session (`Stat::ephemeral_owner`).
    Ephemeral,
    /// Deleted at a tick once it had a child and has none left.
    Container,
    /// Deleted at a tick once it has no children and was not written for `ttl` ms.
    Ttl(i64),
}

#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ZNode {
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
    pub acl: Vec<Acl>,
    /// As ZooKeeper keeps it: `cversion` counts the children ever created (what a
    /// sequential create numbers from); [`ZNode::wire_stat`] is what clients see.
    pub stat: Stat,
    pub kind: Kind,
    /// Child names (not paths), sorted: getChildren answers in this order. Not in the
    /// snapshot: it follows from the paths (rebuilt when a tree is read back), and
    /// serializing it made a directory of a million children a 10 MB entry rewritten at
    /// every checkpoint after any create or delete in it.
    #[serde(skip)]
    pub children: BTreeSet<String>,
}

impl ZNode {
    /// The Stat a client sees. ZooKeeper stores creates in cversion and reports
    /// changes: every create has had a delete except for the children still there
    /// (`DataNode.copyStat`), so a delete moves the reported cversion but not the next
    /// sequential number, and the root starts at -1 with `/zookeeper` under it.
    pub fn wire_stat(&self) -> Stat {
        let children = self.children.len() as i32;
        let cversion = self.stat.cversion.wrapping_mul(2).wrapping_sub(children);
        Stat { cversion, num_children: children, ..self.stat }
    }

    pub fn new(data: Vec<u8>, acl: Vec<Acl>, kind: Kind, owner: i64, zxid: i64, time: i64) -> ZNode {
        ZNode {
            stat: Stat {
                czxid: zxid,
                mzxid: zxid,
                ctime: time,
                mtime: time,
                ephemeral_owner: owner,
                data_length: data.len() as i32,
                pzxid: zxid,
                ..Stat::default()
            },
            data,
            acl,
            kind,
            children: BTreeSet::new(),
        }
    }
}

/// The tree: every path that exists, root included. Serializes as its node map; two
/// trees are equal if their nodes are (what changed since a checkpoint, and a running
/// multi's journal, are bookkeeping).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
#[serde(from = "Stored")]
pub struct Tree {
    nodes: BTreeMap<String, ZNode>,
    #[serde(skip)]
    changes: Changes,
    #[serde(skip)]
    journal: Option<Vec<Undo>>,
}

impl PartialEq for Tree {
    fn eq(&self, other: &Tree) -> bool {
        self.nodes == other.nodes
    }
}

impl Eq for Tree {}

/// What a tree is read back from: its nodes, children still to be linked.
#[derive(serde::Deserialize)]
struct Stored {
    nodes: BTreeMap<String, ZNode>,
}

impl From<Stored> for Tree {
    fn from(stored: Stored) -> Tree {
        let mut nodes = stored.nodes;
        let links: Vec<(String, String)> = nodes
            .keys()
            .filter(|p| *p != "/")
            .map(|p| {
                let (parent, name) = split(p);
                (parent.to_string(), name.to_string())
            })
            .collect();
        for node in nodes.values_mut() {
            node.children.clear();
        }
        // A node whose parent is missing is kept, unlinked (a snapshot is only restored
        // once Q nodes vouched for its root, so this is a bug's trace, not an attack).
        for (parent, name) in links {
            if let Some(p) = nodes.get_mut(&parent) {
                p.children.insert(name);
            }
        }
        Tree { nodes, changes: Changes::default(), journal: None }
    }
}

/// The split of the tree's entries into snapshot segments (keel-core `segments.rs`).
const SEGMENT_DOMAIN: &str = "keel/coord-segment";

/// Past this many bytes of tracked paths (about path bytes + 64 per path) between two
/// checkpoints the tracking is dropped, and the next checkpoint is whole.
const TRACKED_BYTES_MAX: usize = 64 << 20;

/// The segments of the last checkpoint and the paths written since.
#[derive(Clone, Debug)]
struct Changes {
    target: usize,
    cached: Option<Arc<Vec<Segment<String>>>>,
    written: BTreeSet<String>,
    tracked: usize,
}

impl Default for Changes {
    fn default() -> Changes {
        Changes { target: segments::SEGMENT_TARGET, cached: None, written: BTreeSet::new(), tracked: 0 }
    }
}

impl Changes {
    fn note(&mut self, path: &str) {
        // With nothing cached the next checkpoint cuts everything anyway.
        if self.cached.is_none() || self.written.contains(path) {
            return;
        }
        self.tracked += path.len() + 64;
        if self.tracked > TRACKED_BYTES_MAX {
            self.forget();
            return;
        }
        self.written.insert(path.to_string());
    }

    fn forget(&mut self) {
        self.cached = None;
        self.written.clear();
        self.tracked = 0;
    }
}

/// How to take one change of a running multi back.
#[derive(Clone, Debug)]
enum Undo {
    /// `path` was created; its parent's Stat was `parent`.
    Inserted { path: String, parent: Stat },
    /// `node` was removed from `path`; its parent's Stat was `parent`.
    Removed { path: String, node: ZNode, parent: Stat },
    /// The node at `path` had this data, ACL and Stat (its children did not change).
    Changed { path: String, data: Vec<u8>, acl: Vec<Acl>, stat: Stat },
}

/// A path a rolled-back multi touched, and its node's (kind, ephemeral owner) before the
/// rollback and after it: what the indexes kept beside the tree must follow.
pub struct Touched {
    pub path: String,
    pub undone: Option<(Kind, i64)>,
    pub restored: Option<(Kind, i64)>,
}

impl Default for Tree {
    /// `/`, `/zookeeper`, `/zookeeper/quota` and `/zookeeper/config`, as a ZooKeeper
    /// server starts with.
    fn default() -> Tree {
        let mut t = Tree { nodes: BTreeMap::new(), changes: Changes::default(), journal: None };
        t.nodes.insert("/".into(), ZNode::new(Vec::new(), Acl::open(), Kind::Persistent, 0, 0, 0));
        for path in ["/zookeeper", "/zookeeper/quota", CONFIG_PATH] {
            t.insert(path, ZNode::new(Vec::new(), Acl::open(), Kind::Persistent, 0, 0, 0), 0);
        }
        // ZooKeeper builds these without counting them as creates (root: cversion -1).
        for node in t.nodes.values_mut() {
            node.stat.cversion = 0;
        }
        // The configuration node is read-only to clients, and its aversion starts at -1.
        if let Some(config) = t.nodes.get_mut(CONFIG_PATH) {
            config.acl = vec![Acl { perms: crate::proto::perm::READ, scheme: "world".into(), id: "anyone".into() }];
            config.stat.aversion = -1;
        }
        t
    }
}

impl Tree {
    pub fn get(&self, path: &str) -> Option<&ZNode> {
        self.nodes.get(path)
    }

    /// The node at `path`, to change its data, ACL or Stat (not its children: those
    /// follow [`Tree::insert`] and [`Tree::remove`]).
    pub fn get_mut(&mut self, path: &str) -> Option<&mut ZNode> {
        let node = self.nodes.get_mut(path)?;
        self.changes.note(path);
        if let Some(journal) = &mut self.journal {
            let (data, acl, stat) = (node.data.clone(), node.acl.clone(), node.stat);
            journal.push(Undo::Changed { path: path.to_string(), data, acl, stat });
        }
        Some(node)
    }

    /// Adds `node` at `path` under its existing parent, whose child version, child
    /// count and pzxid move.
    pub fn insert(&mut self, path: &str, node: ZNode, zxid: i64) {
        let (parent, name) = split(path);
        if let Some(p) = self.nodes.get_mut(parent) {
            if let Some(journal) = &mut self.journal {
                journal.push(Undo::Inserted { path: path.to_string(), parent: p.stat });
            }
            p.children.insert(name.to_string());
            p.stat.cversion = p.stat.cversion.wrapping_add(1); // a Java int, as ZooKeeper's
            p.stat.num_children = p.children.len() as i32;
            p.stat.pzxid = zxid;
            self.changes.note(parent);
        }
        self.changes.note(path);
        self.nodes.insert(path.to_string(), node);
    }

    /// Removes the node at `path` (which has no children).
    pub fn remove(&mut self, path: &str, zxid: i64) -> Option<ZNode> {
        let node = self.nodes.remove(path)?;
        self.changes.note(path);
        let (parent, name) = split(path);
        if let Some(p) = self.nodes.get_mut(parent) {
            if let Some(journal) = &mut self.journal {
                journal.push(Undo::Removed { path: path.to_string(), node: node.clone(), parent: p.stat });
            }
            p.children.remove(name);
            p.stat.num_children = p.children.len() as i32;
            p.stat.pzxid = zxid;
            self.changes.note(parent);
        }
        Some(node)
    }

    /// Starts journaling changes, so that [`Tree::rollback`] can take them back.
    pub fn begin(&mut self) {
        self.journal = Some(Vec::new());
    }

    /// Keeps the changes since [`Tree::begin`].
    pub fn commit(&mut self) {
        self.journal = None;
    }

    /// Takes back every change since [`Tree::begin`], newest first, and says which paths
    /// it touched and what stood there before and after.
    pub fn rollback(&mut self) -> Vec<Touched> {
        let journal = self.journal.take().unwrap_or_default();
        let key = |n: &ZNode| (n.kind, n.stat.ephemeral_owner);
        let mut touched: BTreeMap<String, Option<(Kind, i64)>> = BTreeMap::new();
        for undo in journal.into_iter().rev() {
            let path = match &undo {
                Undo::Inserted { path, .. } | Undo::Removed { path, .. } | Undo::Changed { path, .. } => path.clone(),
            };
            // The state before the rollback is the state before the first undo that
            // touched the path (undos run newest first).
            let now = self.nodes.get(&path).map(key);
            // Every path an undo touches was noted when the change it undoes was made.
            touched.entry(path.clone()).or_insert(now);
            match undo {
                Undo::Inserted { path, parent } => {
                    self.nodes.remove(&path);
                    let (parent_path, name) = split(&path);
                    if let Some(p) = self.nodes.get_mut(parent_path) {
                        p.children.remove(name);
                        p.stat = parent;
                    }
                }
                Undo::Removed { path, node, parent } => {
                    let (parent_path, name) = split(&path);
                    if let Some(p) = self.nodes.get_mut(parent_path) {
                        p.children.insert(name.to_string());
                        p.stat = parent;
                    }
                    self.nodes.insert(path, node);
                }
                Undo::Changed { path, data, acl, stat } => {
                    if let Some(n) = self.nodes.get_mut(&path) {
                        (n.data, n.acl, n.stat) = (data, acl, stat);
                    }
                }
            }
        }
        touched
            .into_iter()
            .map(|(path, undone)| {
                let restored = self.nodes.get(&path).map(key);
                Touched { path, undone, restored }
            })
            .collect()
    }

    /// The tree's snapshot after its length prefix, as pieces: segments that hold no
    /// path written since the last call are the pieces that call returned.
    pub fn pieces(&mut self) -> Vec<Arc<Piece>> {
        let split = Split { domain: SEGMENT_DOMAIN, target: self.changes.target };
        let nodes = &self.nodes;
        let built = segments::build(
            split,
            self.changes.cached.as_deref().map(Vec::as_slice),
            &self.changes.written,
            |lo, hi| nodes.range::<str, _>((lo, hi)).map(|(path, node)| (path.as_str(), (path, node))),
        );
        let pieces = built.iter().map(|s| s.piece.clone()).collect();
        self.changes.forget();
        self.changes.cached = Some(Arc::new(built));
        pieces
    }

    /// Segments of about `bytes` (tests and the simulator use small ones so that small
    /// trees span many). Segment boundaries enter the checkpoint root: every node of a
    /// cluster must use the same.
    pub fn set_segment_target(&mut self, bytes: usize) {
        self.changes.target = bytes.max(1);
        self.changes.forget();
    }

    pub fn segment_target(&self) -> usize {
        self.changes.target
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Every node below `path` (not itself).
    pub fn descendants(&self, path: &str) -> usize {
        let prefix = if path == "/" { "/".to_string() } else { format!("{path}/") };
        self.nodes
            .range(prefix.clone()..)
            .take_while(|(p, _)| p.starts_with(&prefix))
            .filter(|(p, _)| *p != "/")
            .count()
    }
}

/// (parent path, last name) of a valid path other than `/`.
pub fn split(path: &str) -> (&str, &str) {
    match path.rfind('/') {
        Some(0) => ("/", &path[1..]),
        Some(i) => (&path[..i], &path[i + 1..]),
        None => ("/", path),
    }
}

/// ZooKeeper's path rules (`PathUtils.validatePath`): absolute, no empty, `.` or `..`
/// segment, no trailing slash except the root's, no control or reserved characters.
/// `sequential` allows the trailing slash a sequential create appends a number to.
pub fn validate(path: &str, sequential: bool) -> Result<(), i32> {
    let checked = if sequential { format!("{path}1") } else { path.to_string() };
    if !checked.starts_with('/') {
        return Err(err::BAD_ARGUMENTS);
    }
    if checked == "/" {
        return Ok(());
    }
    if checked.ends_with('/') {
        return Err(err::BAD_ARGUMENTS);
    }
    for segment in checked[1..].split('/') {
        if segment.is_empty() || segment == "." || segment == ".." {
            return Err(err::BAD_ARGUMENTS);
        }
    }
    let bad = |c: char| {
        c == '\u{0}'
            || ('\u{1}'..='\u{1f}').contains(&c)
            || ('\u{7f}'..='\u{9f}').contains(&c)
            || ('\u{e000}'..='\u{f8ff}').contains(&c)
            || ('\u{fff0}'..='\u{ffff}').contains(&c)
    };
    if checked.chars().any(bad) {
        return Err(err::BAD_ARGUMENTS);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_follow_zookeepers_rules() {
        for ok in ["/", "/a", "/a/b", "/a.b", "/zookeeper"] {
            assert_eq!(validate(ok, false), Ok(()), "{ok}");
        }
        for bad in ["", "a", "/a/", "//a", "/a//b", "/./a", "/a/..", "/a\u{0}", "/a\u{1}b"] {
            assert_eq!(validate(bad, false), Err(err::BAD_ARGUMENTS), "{bad:?}");
        }
        assert_eq!(validate("/lock/", true), Ok(()), "a sequential prefix may end in /");
        assert_eq!(split("/a"), ("/", "a"));
        assert_eq!(split("/a/b/c"), ("/a/b", "c"));
    }

    #[test]
    fn inserting_and_removing_moves_the_parents_bookkeeping() {
        let mut t = Tree::default();
        // As a fresh ZooKeeper server reports them.
        assert_eq!(t.get("/").expect("root").wire_stat().cversion, -1);
        assert_eq!(t.get("/zookeeper").expect("zookeeper").wire_stat().cversion, -2);
        t.insert("/a", ZNode::new(b"x".to_vec(), Acl::open(), Kind::Persistent, 0, 7, 100), 7);
        let root = t.get("/").expect("root").wire_stat();
        assert_eq!((root.cversion, root.num_children, root.pzxid), (0, 2, 7));
        t.insert("/a/b", ZNode::new(Vec::new(), Acl::open(), Kind::Persistent, 0, 8, 100), 8);
        assert_eq!(t.descendants("/a"), 1);
        assert_eq!(t.descendants("/"), 5);
        t.remove("/a/b", 9);
        let a = t.get("/a").expect("a");
        assert_eq!((a.wire_stat().cversion, a.wire_stat().num_children, a.stat.pzxid), (2, 0, 9));
        assert_eq!(a.stat.cversion, 1, "a delete does not move the sequence counter");
    }
}

#[cfg(test)]
mod wrap_tests {
    use super::*;

    #[test]
    fn counters_wrap_like_java_ints_instead_of_panicking() {
        let mut t = Tree::default();
        if let Some(root) = t.get_mut("/") {
            root.stat.cversion = i32::MAX;
        }
        t.insert("/x", ZNode::new(Vec::new(), Acl::open(), Kind::Persistent, 0, 1, 1), 1);
        let root = t.get("/").expect("root");
        assert_eq!(root.stat.cversion, i32::MIN);
        let _ = root.wire_stat();
    }
}
