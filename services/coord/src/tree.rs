//! The data tree: znodes by path, with ZooKeeper's Stat bookkeeping and path rules.
//! Deterministic by construction (ordered maps only, times and zxids given by the caller).

use crate::proto::{err, Acl, Stat, CONFIG_PATH};
use std::collections::{BTreeMap, BTreeSet};

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
    /// Child names (not paths), sorted: getChildren answers in this order.
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

/// The tree: every path that exists, root included.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Tree {
    pub nodes: BTreeMap<String, ZNode>,
}

impl Default for Tree {
    /// `/`, `/zookeeper`, `/zookeeper/quota` and `/zookeeper/config`, as a ZooKeeper
    /// server starts with.
    fn default() -> Tree {
        let mut t = Tree { nodes: BTreeMap::new() };
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

    pub fn get_mut(&mut self, path: &str) -> Option<&mut ZNode> {
        self.nodes.get_mut(path)
    }

    /// Adds `node` at `path` under its existing parent, whose child version, child
    /// count and pzxid move.
    pub fn insert(&mut self, path: &str, node: ZNode, zxid: i64) {
        let (parent, name) = split(path);
        if let Some(p) = self.nodes.get_mut(parent) {
            p.children.insert(name.to_string());
            p.stat.cversion = p.stat.cversion.wrapping_add(1); // a Java int, as ZooKeeper's
            p.stat.num_children = p.children.len() as i32;
            p.stat.pzxid = zxid;
        }
        self.nodes.insert(path.to_string(), node);
    }

    /// Removes the node at `path` (which has no children).
    pub fn remove(&mut self, path: &str, zxid: i64) -> Option<ZNode> {
        let node = self.nodes.remove(path)?;
        let (parent, name) = split(path);
        if let Some(p) = self.nodes.get_mut(parent) {
            p.children.remove(name);
            p.stat.num_children = p.children.len() as i32;
            p.stat.pzxid = zxid;
        }
        Some(node)
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
