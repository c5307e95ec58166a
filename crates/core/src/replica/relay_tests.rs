//! Issue #21, defect 7: a node's proof of its view (the NEW-VIEW that installed it) is
//! what it relays to laggards (catch_up.rs `on_status`). It must survive a restart, or a
//! cluster whose nodes restarted since their last view change can tell a laggard of the
//! view only through another view change. Both tests failed while the NEW-VIEW lived in
//! memory only (`Replica::new_view`, None after `Replica::recover`) and pass now that it
//! is persisted beside the view (`Record::NewView`).

use super::tests::{client, config, Net};
use super::*;
use crate::client::Client;

/// `config(1, 1)` in view 1 without node 3, down from the start: node 0, view 0's
/// primary, asks to leave its view, and nodes 0, 1 and 2 (a quorum) move to view 1,
/// whose primary is node 1; then they execute `ops` operations. Returns the time too.
fn view_1_without_node_3(cfg: &ClusterConfig, ops: u64) -> (Net, Client, u64) {
    let mut net = Net::new(cfg);
    let mut c = client(cfg, 7);
    net.down.insert(NodeId(3));
    let mut now = 10;
    let mut out = Outputs::default();
    net.nodes[0].suspect(View(1), &mut out);
    net.absorb(NodeId(0), out);
    net.run(now);
    let views: Vec<View> = net.nodes.iter().map(Replica::view).collect();
    assert_eq!(views, [1, 1, 1, 0].map(View));
    for i in 0..ops {
        now += 10;
        net.submit(&mut c, now, &[i as u8]);
        assert!(net.result(&mut c).is_some(), "operation {i} completes in view 1");
    }
    (net, c, now)
}

/// The NEW-VIEWs `out` relays to node `to`, and whether any left ungated.
fn new_views_to(out: &Outputs, to: NodeId) -> (Vec<View>, bool) {
    let relayed = |q: &Vec<(Peer, Message)>| -> Vec<View> {
        q.iter()
            .filter_map(|(p, m)| match m {
                Message::NewView(nv) if *p == Peer::Node(to) => Some(nv.view),
                _ => None,
            })
            .collect()
    };
    (relayed(&out.send_after_persist), !relayed(&out.send).is_empty())
}

/// Node 2 restarts twice: once with the records written when it installed view 1, once
/// from a log compacted at a stable checkpoint. Each time a STATUS from node 3 (still in
/// view 0) makes it relay NEW-VIEW(1), gated like every relay, and node 3 installs view 1
/// from it alone.
#[test]
fn a_restarted_node_relays_the_new_view_of_its_view_and_the_laggard_installs_it() {
    let cfg = config(1, 1);
    let interval = cfg.options.checkpoint_interval;
    // A fresh cluster for each: once restarted, node 2 casts no WRITE in view 1 up to its
    // vote horizon (normal.rs, `cover_vote`), and without node 3 the cluster would need
    // another view change to order more.
    for compacted in [false, true] {
        let (mut net, _, mut now) = view_1_without_node_3(&cfg, if compacted { 2 + interval } else { 2 });
        if compacted {
            assert!(net.nodes[2].stable_seq() >= Seq(interval), "node 2's log was compacted");
        }
        now += 10;
        net.restart(NodeId(2), now);
        assert_eq!(net.nodes[2].view(), View(1), "recovered into view 1");
        now += cfg.options.status_ms;
        let status = Message::Status { view: View(0), executed: Seq(0), stable: Seq(0) };
        let mut out = Outputs::default();
        net.nodes[2].step(now, Input::Message { from: Peer::Node(NodeId(3)), msg: status }, &mut out);
        let (relayed, ungated) = new_views_to(&out, NodeId(3));
        assert_eq!(relayed, vec![View(1)], "compacted: {compacted}: NEW-VIEW(1) relayed to node 3");
        assert!(!ungated, "a relay waits for the relaying node's records");
        // Node 3 (a fresh node in view 0) installs view 1 from the relay alone.
        let nv = out.send_after_persist.into_iter().find_map(|(_, m)| match m {
            m @ Message::NewView(_) => Some(m),
            _ => None,
        });
        let mut laggard = tests::node(&cfg, 3);
        let mut out = Outputs::default();
        laggard.step(now, Input::Message { from: Peer::Node(NodeId(2)), msg: nv.expect("relayed") }, &mut out);
        assert_eq!(laggard.view(), View(1));
        assert!(out.events.contains(&Event::ViewInstalled { view: View(1) }));
    }
}

/// Node 3 was down for three checkpoint intervals: it catches up by state transfer from
/// nodes 0 and 2, which restarted meanwhile; node 1, which built NEW-VIEW(1), is down. It
/// must end in view 1 with the proof, not in view 0 waiting for another view change:
/// with node 0 down next, nodes 1, 2 and 3 order a request in view 1.
#[test]
fn a_laggard_that_catches_up_by_state_transfer_ends_in_the_clusters_view() {
    let cfg = config(1, 1);
    let interval = cfg.options.checkpoint_interval;
    let (mut net, mut c, mut now) = view_1_without_node_3(&cfg, 3 * interval + 2);
    assert!(net.nodes[0].stable_seq() >= Seq(3 * interval));
    now += 10;
    net.restart(NodeId(0), now);
    net.restart(NodeId(2), now);
    net.down.insert(NodeId(1));
    net.down.remove(&NodeId(3));
    let view_changes =
        |net: &Net| net.events.iter().filter(|(_, e)| matches!(e, Event::ViewChangeStarted { .. })).count();
    let before = view_changes(&net);
    let deadline = now + 20 * cfg.options.status_ms;
    while now < deadline && (net.nodes[3].executed() < net.nodes[0].executed() || net.nodes[3].view() < View(1)) {
        now += 5;
        net.tick(now);
    }
    assert!(
        net.events.iter().any(|(n, e)| *n == NodeId(3) && matches!(e, Event::StateTransferDone { .. })),
        "node 3 caught up by state transfer"
    );
    assert_eq!(net.nodes[3].executed(), net.nodes[0].executed());
    assert_eq!(net.nodes[3].view(), View(1), "{}", net.nodes[3].status_line());
    assert!(net.events.contains(&(NodeId(3), Event::ViewInstalled { view: View(1) })));
    assert!(net.nodes[3].new_view.as_ref().is_some_and(|nv| nv.view == View(1)), "with the proof, to relay in turn");
    assert_eq!(view_changes(&net), before, "no view change since the restarts");
    // Node 3 takes part: with node 0 down, nodes 1, 2 and 3 are the quorum. Node 2
    // restarted in view 1 and casts no WRITE there up to its vote horizon (normal.rs,
    // `cover_vote`), so the request is ordered after a view change, with node 3's votes.
    net.down.remove(&NodeId(1));
    net.down.insert(NodeId(0));
    now += 10;
    net.submit(&mut c, now, b"after");
    let deadline = now + 20 * cfg.options.request_timeout_ms;
    let mut result = net.result(&mut c);
    while result.is_none() && now < deadline {
        now += 5;
        net.tick(now);
        result = net.result(&mut c);
        let retries = c.on_tick(now);
        net.send(c.id(), retries, now);
    }
    assert!(result.is_some(), "ordered with node 3's votes: {}", net.nodes[3].status_line());
    assert!(net.nodes[3].view() >= View(1));
    assert_eq!(net.nodes[3].executed(), net.nodes[1].executed());
}
