//! The core's modules form layers, not a knot (issue #22): `ids` and `quorum` at the
//! bottom, the shared vocabulary (`step`, `keys`, `message`, `membership`) above them, and
//! the stages (`replica`, `exec_node`, `rq_node`) on top, depending on the vocabulary and
//! never the vocabulary on them. This test reads the sources and fails on any cycle
//! among top-level modules, naming it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Top-level module → the top-level modules its non-test code names as `crate::m`.
fn module_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut stack = vec![src.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("readable source directory") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                stack.push(path);
                continue;
            }
            let rel = path.strip_prefix(src).expect("under src").to_string_lossy().into_owned();
            let Some(module) = rel.trim_end_matches(".rs").split('/').next().map(str::to_owned) else { continue };
            if module == "lib" || !rel.ends_with(".rs") || rel.ends_with("tests.rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).expect("readable source");
            // Unit tests may reach anywhere; the layering is about what ships.
            let code = text.split("#[cfg(test)]").next().unwrap_or_default();
            let deps = graph.entry(module.clone()).or_default();
            for (i, _) in code.match_indices("crate::") {
                let name: String = code[i + 7..]
                    .chars()
                    .take_while(|c| c.is_ascii_lowercase() || *c == '_' || c.is_ascii_digit())
                    .collect();
                if !name.is_empty() && name != module {
                    deps.insert(name);
                }
            }
        }
    }
    graph
}

/// A cycle through `graph`, if there is one (depth-first search).
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|n| n == node) {
            let mut cycle = path[at..].to_vec();
            cycle.push(node.to_owned());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        path.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten().filter(|n| graph.contains_key(*n)) {
            if let Some(cycle) = visit(next, graph, path, done) {
                return Some(cycle);
            }
        }
        path.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph.keys().find_map(|start| visit(start, graph, &mut Vec::new(), &mut done))
}

#[test]
fn core_modules_import_each_other_without_a_cycle() {
    let graph = module_graph(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    assert!(graph.len() > 20, "read the sources: {:?}", graph.keys());
    assert!(graph["replica"].contains("step"), "the stages depend on the vocabulary");
    if let Some(cycle) = find_cycle(&graph) {
        panic!("import cycle among core modules: {}", cycle.join(" -> "));
    }
}

#[test]
fn a_cycle_is_found_and_named() {
    // The check itself can fail: the knot before issue #22 (membership took a constant
    // from replica, replica takes membership).
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    graph.entry("membership".into()).or_default().insert("replica".into());
    graph.entry("replica".into()).or_default().insert("membership".into());
    graph.entry("ids".into()).or_default();
    let cycle = find_cycle(&graph).expect("a cycle");
    assert_eq!(cycle.first(), cycle.last());
    assert!(cycle.contains(&"replica".to_owned()) && cycle.contains(&"membership".to_owned()));
}
