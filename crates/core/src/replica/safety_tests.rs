//! The safety holes issue #21's adversarial review claimed, each as a replica-level
//! scenario: messages are routed by hand, so a test can lose exactly the message, and
//! crash a node at exactly the step, that the claim needs. Each test failed on the code
//! the review read (ce084db) and passes now.

use super::tests::{config, node, request, Log};
use super::*;
use crate::crypto::Digest;

/// Messages one step of `from` sent to `to`: `plain` ones leave at once, gated ones
/// (`send_after_persist`) only once the step's records are durable.
fn sent(out: &Outputs, to: NodeId, gated: bool) -> Vec<Message> {
    let queue = if gated { &out.send_after_persist } else { &out.send };
    queue.iter().filter(|(p, _)| *p == Peer::Node(to)).map(|(_, m)| m.clone()).collect()
}

fn records(out: &Outputs) -> Vec<Record> {
    out.persist
        .iter()
        .filter_map(|p| match p {
            Persist::Record(r) => Some(r.clone()),
            _ => None,
        })
        .chain(out.persist_lazy.iter().cloned())
        .collect()
}

fn decided(out: &Outputs, seq: Seq) -> Option<Digest> {
    out.events.iter().find_map(|e| match e {
        Event::Decided { seq: s, digest } if *s == seq => Some(*digest),
        _ => None,
    })
}

/// Steps `node` with every message in `msgs` from `from`, into one `Outputs`.
fn feed(node: &mut Replica<Log>, now: u64, from: NodeId, msgs: Vec<Message>, out: &mut Outputs) {
    for msg in msgs {
        node.step(now, Input::Message { from: Peer::Node(from), msg }, out);
    }
}

/// Defect 2 (r = 0): a new primary that crashes in the step that installs its view must
/// not be able to lead that view a second time with other proposals.
///
/// CFT, n = 3, Q = 2. Node 1 becomes primary of view 1 and proposes X for instance 1.
/// It crashes before its View record is durable; only messages that left before the
/// fsync are out. Recovered, it builds another NEW-VIEW(1) and proposes Y for the same
/// instance. On ce084db the PROPOSE of X left at once, node 0 kept it as an early
/// proposal and voted for it once the second NEW-VIEW(1) arrived, nodes 1 and 2 decided
/// Y, and the view change to view 2 (two same-view certificates, the tie going to the
/// lower id) re-proposed X: node 0 decided X where the others had decided Y.
#[test]
fn a_primary_that_crashes_while_installing_its_view_cannot_lead_it_twice() {
    crash_while_installing_a_view(config(1, 0));
}

/// The scenario's checks fail with the PROPOSEs ungated again (as on ce084db).
#[cfg(feature = "mutations")]
#[test]
#[should_panic(expected = "view 2 chose another value for instance 1")]
fn with_proposals_before_the_view_is_durable_a_value_is_decided_twice() {
    let mut cfg = config(1, 0);
    cfg.quorums = cfg.quorums.with_mutation(Some(crate::quorum::Mutation::ProposeBeforeViewDurable));
    crash_while_installing_a_view(cfg);
}

/// Node `i` of `cfg` recovered at `now` from a disk holding `records` (no snapshot).
fn recovered(cfg: &ClusterConfig, i: u32, records: Vec<Record>, now: u64, out: &mut Outputs) -> Replica<Log> {
    let durable = Durable { snapshots: vec![], records };
    Replica::recover(cfg.clone(), NodeId(i), tests::secrets(i), Log::default(), durable, now, out).expect("recovers")
}

fn crash_while_installing_a_view(cfg: ClusterConfig) {
    let x = request(&cfg, 7, b"x");
    let y = request(&cfg, 8, b"y");
    // Node 0 restarted as view 0's primary: it asks to leave view 0 (recovery.rs).
    let mut n0_out = Outputs::default();
    let mut n0 = recovered(&cfg, 0, Vec::new(), 10, &mut n0_out);
    let mut n1 = node(&cfg, 1);
    let mut n2 = node(&cfg, 2);
    let mut n1_durable = Vec::new();
    // Client 7's request reaches node 1 only.
    let mut out = Outputs::default();
    n1.step(10, Input::Message { from: Peer::Client(ClientId(7)), msg: Message::Request(x) }, &mut out);
    n1_durable.extend(records(&out));
    // Everybody follows node 0's STOP and commits to view 1.
    let stop0 = sent(&n0_out, NodeId(1), false);
    let mut o1 = Outputs::default();
    feed(&mut n1, 20, NodeId(0), stop0.clone(), &mut o1);
    n1_durable.extend(records(&o1));
    let mut o2 = Outputs::default();
    feed(&mut n2, 20, NodeId(0), sent(&n0_out, NodeId(2), false), &mut o2);
    let mut o0 = Outputs::default();
    feed(&mut n0, 20, NodeId(1), sent(&o1, NodeId(0), false), &mut o0);
    feed(&mut n0, 20, NodeId(2), sent(&o2, NodeId(0), false), &mut o0);
    let vc0: Vec<Message> = sent(&o0, NodeId(1), true);
    let vc2: Vec<Message> = sent(&o2, NodeId(1), true);
    assert!(vc0.iter().chain(&vc2).all(|m| matches!(m, Message::ViewChange(_))) && !vc0.is_empty() && !vc2.is_empty());
    // Node 0's VIEW-CHANGE completes node 1's quorum: it installs view 1 and proposes X.
    let mut install = Outputs::default();
    feed(&mut n1, 30, NodeId(0), vc0.clone(), &mut install);
    assert_eq!(n1.view(), View(1));
    let proposes = |msgs: Vec<Message>| msgs.iter().filter(|m| matches!(m, Message::Propose { .. })).count();
    if cfg.quorums.mutation().is_none() {
        assert_eq!(
            proposes(sent(&install, NodeId(0), false)),
            0,
            "a PROPOSE of view 1 left before the view was durable"
        );
        assert_eq!(proposes(sent(&install, NodeId(0), true)), 1, "it waits for the View record");
    }
    // Node 1 crashes before that step's records are durable: what left at once reaches
    // node 0 (node 2's copies are lost), the gated messages never leave.
    let mut o0 = Outputs::default();
    feed(&mut n0, 31, NodeId(1), sent(&install, NodeId(0), false), &mut o0);
    let mut out = Outputs::default();
    let mut n1 = recovered(&cfg, 1, n1_durable, 40, &mut out);
    // Recovered, node 1 gets client 8's request and the VIEW-CHANGEs (resent).
    n1.step(40, Input::Message { from: Peer::Client(ClientId(8)), msg: Message::Request(y) }, &mut out);
    feed(&mut n1, 41, NodeId(2), vc2, &mut out);
    feed(&mut n1, 41, NodeId(0), vc0, &mut out);
    assert_eq!(n1.view(), View(1), "leads view 1 again");
    let n1_second = out;
    // Node 2 hears everything; node 0 hears everything but node 2's ACCEPTs.
    let all = |out: &Outputs, to| [sent(out, to, false), sent(out, to, true)].concat();
    let mut o2 = Outputs::default();
    feed(&mut n2, 42, NodeId(1), all(&n1_second, NodeId(2)), &mut o2);
    let mut o0 = Outputs::default();
    feed(&mut n0, 42, NodeId(1), all(&n1_second, NodeId(0)), &mut o0);
    let mut o1 = Outputs::default();
    feed(&mut n1, 43, NodeId(2), all(&o2, NodeId(1)), &mut o1);
    feed(&mut n1, 43, NodeId(0), all(&o0, NodeId(1)), &mut o1);
    feed(&mut n2, 43, NodeId(0), all(&o0, NodeId(2)), &mut o2);
    let first = [decided(&n1_second, Seq(1)), decided(&o1, Seq(1)), decided(&o2, Seq(1))].into_iter().flatten().next();
    let first = first.expect("instance 1 decided by nodes 1 and 2");
    if let Some(d) = decided(&o0, Seq(1)) {
        assert_eq!(d, first);
    }
    // Once a peer voted in view 1, node 1's record of it is durable: proposals leave at
    // once again, in parallel with the primary's own fsync.
    let mut o1 = Outputs::default();
    n1.step(
        44,
        Input::Message { from: Peer::Client(ClientId(9)), msg: Message::Request(request(&cfg, 9, b"z")) },
        &mut o1,
    );
    assert!(
        sent(&o1, NodeId(2), false).iter().any(|m| matches!(m, Message::Propose { view: View(1), .. })),
        "{:?}",
        o1.send
    );
    // Node 1 goes down; nodes 0 and 2 move to view 2, whose primary is node 2.
    let mut o0 = Outputs::default();
    let mut o2 = Outputs::default();
    n0.step(50, Input::Message { from: Peer::Node(NodeId(2)), msg: Message::Stop { view: View(2) } }, &mut o0);
    n2.step(50, Input::Message { from: Peer::Node(NodeId(0)), msg: Message::Stop { view: View(2) } }, &mut o2);
    let period = cfg.options.retransmit_ms;
    let mut accepts: std::collections::BTreeMap<(View, Digest), std::collections::BTreeSet<u32>> = Default::default();
    for round in 0..6 {
        let now = 60 + round * period;
        let (to0, to2) = (all(&o2, NodeId(0)), all(&o0, NodeId(2)));
        o0 = Outputs::default();
        o2 = Outputs::default();
        feed(&mut n0, now, NodeId(2), to0, &mut o0);
        feed(&mut n2, now, NodeId(0), to2, &mut o2);
        n0.step(now, Input::Tick, &mut o0);
        n2.step(now, Input::Tick, &mut o2);
        for (who, out) in [(0u32, &o0), (2, &o2)] {
            if let Some(d) = decided(out, Seq(1)) {
                assert_eq!(d, first, "node {who} decided another value for instance 1");
            }
            for (_, m) in out.send.iter().chain(&out.send_after_persist) {
                if let Message::Accept { view, seq: Seq(1), digest } = m {
                    accepts.entry((*view, *digest)).or_default().insert(who);
                }
            }
        }
    }
    // A value is chosen once Q nodes accept it in one view: a laggard (node 1 back from
    // its crash) would decide it from those ACCEPTs.
    for ((view, digest), who) in &accepts {
        assert!(*digest == first || who.len() < 2, "view {view} chose another value for instance 1: {who:?}");
    }
    assert_eq!(n0.view(), View(2));
    assert_eq!(n0.log.get(&Seq(1)).and_then(|s| s.decided), Some(first), "node 0 learns the value that was decided");
}

/// Defect 4: a node whose disk was wiped must not vote as if new. CFT, n = 3: X is decided
/// by nodes 0 and 1 (node 2 missed it) and acknowledged; node 1 loses its disk and
/// restarts; node 0 goes down. On ce084db node 1 voted at once: nodes 1 and 2 changed
/// view without X and decided another value for instance 1. Rejoining, node 1 casts no
/// vote until node 0 is back and it caught up past everything it may have voted for.
#[test]
fn a_wiped_node_rejoins_without_voting_until_it_caught_up() {
    wiped_node_scenario(config(1, 0));
}

#[cfg(feature = "mutations")]
#[test]
#[should_panic(expected = "decided another value for instance 1")]
fn a_wiped_node_that_votes_at_once_loses_an_acknowledged_write() {
    let mut cfg = config(1, 0);
    cfg.quorums = cfg.quorums.with_mutation(Some(crate::quorum::Mutation::WipedNodeVotes));
    wiped_node_scenario(cfg);
}

fn wiped_node_scenario(cfg: ClusterConfig) {
    use super::tests::{client, Net};
    let mut net = Net::new(&cfg);
    let mut c = client(&cfg, 7);
    net.down.insert(NodeId(2));
    net.submit(&mut c, 10, b"x");
    assert!(net.result(&mut c).is_some(), "X acknowledged");
    let x = net.nodes[0].log.get(&Seq(1)).and_then(|s| s.decided).expect("decided at node 0");
    // Node 1 loses its disk and restarts; node 0 goes down; node 2 is back.
    net.down.remove(&NodeId(2));
    net.down.insert(NodeId(0));
    let mut out = Outputs::default();
    net.nodes[1] =
        Replica::rejoin(cfg.clone(), NodeId(1), tests::secrets(1), Log::default(), 20, &mut out).expect("empty");
    net.absorb(NodeId(1), out);
    let check = |net: &Net| {
        for (n, e) in &net.events {
            if let Event::Decided { seq: Seq(1), digest } = e {
                assert_eq!(*digest, x, "node {n} decided another value for instance 1");
            }
        }
    };
    let mut other = client(&cfg, 8);
    let timeout = cfg.options.request_timeout_ms;
    let mut now = 20;
    net.submit(&mut other, now, b"y");
    while now < 20 + 20 * timeout {
        now += 5;
        // Its retransmissions bring the request to nodes 1 and 2 (with r = 0 the first
        // transmission went to node 0 alone, which is down).
        let retransmitted = other.on_tick(now);
        net.send(other.id(), retransmitted, now);
        net.tick(now);
        check(&net);
    }
    assert!(net.nodes[1].rejoining(), "no bounds without node 0: Q others must answer");
    // Node 0 is back: the cluster runs, node 1 learns its bounds, catches up and rejoins.
    net.down.remove(&NodeId(0));
    let mut k = 0u8;
    let mut done = false;
    while (net.nodes[1].rejoining() || !done) && now < 20 + 400 * timeout {
        now += 5;
        net.tick(now);
        check(&net);
        for (n, to, reply) in std::mem::take(&mut net.replies) {
            if to == c.id() {
                c.on_reply(n, reply);
            } else if to == other.id() {
                done |= other.on_reply(n, reply).is_some();
            }
        }
        for cl in [&mut c, &mut other] {
            for (n, m) in cl.on_tick(now) {
                net.post(Peer::Client(cl.id()), n, m);
            }
        }
        if !c.busy() {
            k = k.wrapping_add(1);
            net.submit(&mut c, now, &[k]);
        }
    }
    let state = |n: &Replica<Log>| (n.view(), n.executed(), n.stable.seq, n.rejoin_bounds());
    let states: Vec<_> = net.nodes.iter().map(state).collect();
    assert!(!net.nodes[1].rejoining(), "node 1 rejoined: (view, executed, stable, bounds) {states:?}");
    assert!(net.events.iter().any(|(n, e)| *n == NodeId(1) && matches!(e, Event::Rejoined { .. })));
    let log = |n: usize| net.nodes[n].service().0.clone();
    assert_eq!(log(1).first().map(Vec::as_slice), Some(&b"x"[..]), "X is the first operation everywhere");
    // Every node executed the same operations, in the same order, as far as it got.
    let common = (0..3).map(|n| log(n).len()).min().unwrap_or(0);
    assert!(common > 1, "the cluster went on");
    for n in 0..3 {
        assert_eq!(log(n)[..common], log(0)[..common], "node {n}");
    }
}

/// Found by the simulator's crashes before a sync (seed 101 at (1, 0)): a retransmitted
/// checkpoint vote left at once, before the snapshot it vouches for was durable; a crash
/// then lost the snapshot while the vote made the checkpoint stable, and no node could
/// serve the state. Retransmissions are gated like the first sending.
#[test]
fn a_retransmitted_checkpoint_vote_waits_for_its_snapshot_to_be_durable() {
    let cfg = config(1, 1);
    let mut n = node(&cfg, 0);
    let (root, membership) = (Digest([1; 32]), cfg.membership.digest());
    let sig =
        tests::secrets(0).signing.sign(&crate::message::checkpoint_statement(Seq(8), &root, &membership, NodeId(0)));
    n.checkpoint_votes.entry(Seq(8)).or_default().insert(MemberIndex(0), (root, membership, sig));
    let mut out = Outputs::default();
    n.retransmit_checkpoint_votes(&mut out);
    let votes = |q: &Vec<(Peer, Message)>| q.iter().filter(|(_, m)| matches!(m, Message::Checkpoint(_))).count();
    assert_eq!(votes(&out.send), 0, "a vote left before its snapshot was durable");
    assert_eq!(votes(&out.send_after_persist), 3);
}

/// A BFT node sends its WRITE without waiting for the Accepted record behind it (the
/// record joins the next flush); only a vote horizon, written once per `window`
/// instances, must be durable first. Here node 1's Accepted record for instance 2 is lost
/// in a crash after its WRITE left, and an equivocating primary (two copies of node 0)
/// proposes another value for instance 2 in the same view: the recovered node must not
/// sign a WRITE for it, or two certificates of one view could name different values and
/// a view change could pick the one that was not decided.
#[test]
fn a_restarted_node_does_not_vote_twice_where_its_accepted_record_was_lost() {
    lost_accepted_record_scenario(config(1, 1));
}

/// The abstaining node of the scenario above is missing from every quorum of instance 2
/// in view 0: once the instance has stayed undecided for as long as a request waits
/// before its primary is suspected, the node asks for view 1, where it may vote again
/// (normal.rs, `on_abstention_timeout`). Without that, two restarted nodes and a node
/// down could leave instances undecided for good (session 28's simulator run).
#[test]
fn a_node_that_abstains_on_an_undecided_instance_asks_for_the_next_view() {
    let cfg = config(1, 1);
    let (mut n1, at) = lost_accepted_record_scenario(cfg.clone());
    let stops = |out: &Outputs| out.send.iter().filter(|(_, m)| *m == Message::Stop { view: View(1) }).count();
    let wait = 2 * cfg.options.request_timeout_ms;
    assert_eq!(stops(&tests::step_tick(&mut n1, at + wait - 1)), 0, "too early");
    assert_eq!(stops(&tests::step_tick(&mut n1, at + wait)), 3, "a STOP to each other node");
}

#[cfg(feature = "mutations")]
#[test]
#[should_panic(expected = "a STOP to each other node")]
fn an_abstaining_node_that_never_asks_for_a_view_change_is_caught() {
    let mut cfg = config(1, 1);
    cfg.quorums = cfg.quorums.with_mutation(Some(crate::quorum::Mutation::AbstainSilently));
    let (mut n1, at) = lost_accepted_record_scenario(cfg.clone());
    let stops = tests::step_tick(&mut n1, at + 2 * cfg.options.request_timeout_ms)
        .send
        .iter()
        .filter(|(_, m)| *m == Message::Stop { view: View(1) })
        .count();
    assert_eq!(stops, 3, "a STOP to each other node");
}

#[cfg(feature = "mutations")]
#[test]
#[should_panic(expected = "signed a second WRITE for instance 2")]
fn a_restarted_node_that_ignores_its_vote_horizon_votes_twice() {
    let mut cfg = config(1, 1);
    cfg.quorums = cfg.quorums.with_mutation(Some(crate::quorum::Mutation::VoteAfterRestart));
    lost_accepted_record_scenario(cfg);
}

/// Returns the recovered node 1, abstaining on instance 2 since the time returned.
fn lost_accepted_record_scenario(cfg: ClusterConfig) -> (Replica<Log>, u64) {
    // The equivocating primary: two copies of node 0 that agree on instance 1 and
    // propose X and Y for instance 2.
    let proposals = |op: &[u8]| {
        let mut p = node(&cfg, 0);
        let first = tests::step(&mut p, 10, Peer::Client(ClientId(7)), Message::Request(request(&cfg, 7, b"one")));
        let mut second = tests::step(&mut p, 11, Peer::Client(ClientId(8)), Message::Request(request(&cfg, 8, op)));
        let tick = tests::step_tick(&mut p, 40);
        second.send.extend(tick.send);
        let propose = |out: &Outputs, seq: Seq| {
            out.send
                .iter()
                .chain(&out.send_after_persist)
                .find_map(|(to, m)| match m {
                    Message::Propose { seq: s, .. } if *to == Peer::Node(NodeId(1)) && *s == seq => Some(m.clone()),
                    _ => None,
                })
                .unwrap_or_else(|| panic!("node 0 proposes instance {seq}"))
        };
        (propose(&first, Seq(1)), propose(&second, Seq(2)))
    };
    let (one, x) = proposals(b"x");
    let (one_again, y) = proposals(b"y");
    assert_eq!(one, one_again);
    let writes = |out: &Outputs| -> Vec<crate::message::Write> {
        out.send
            .iter()
            .chain(&out.send_after_persist)
            .filter_map(|(to, m)| match m {
                Message::Write(w) if *to == Peer::Node(NodeId(2)) => Some(w.clone()),
                _ => None,
            })
            .collect()
    };
    let eager = |out: &Outputs| -> Vec<Record> {
        out.persist
            .iter()
            .filter_map(|p| match p {
                Persist::Record(r) => Some(r.clone()),
                _ => None,
            })
            .collect()
    };
    let mut n1 = node(&cfg, 1);
    // Instance 1: the first WRITE of the view needs a horizon record; the flush that
    // makes it durable takes the lazy Accepted record along.
    let o = tests::step(&mut n1, 12, Peer::Node(NodeId(0)), one);
    assert_eq!(writes(&o).len(), 1);
    assert!(eager(&o).iter().any(|r| matches!(r, Record::VoteHorizon { view: View(0), .. })), "{:?}", o.persist);
    assert!(!eager(&o).iter().any(|r| matches!(r, Record::Accepted { .. })), "Accepted is not waited for");
    let durable = records(&o);
    // Instance 2 (X): within the horizon, so the step persists nothing eagerly and the
    // driver sends the WRITE at once.
    let o = tests::step(&mut n1, 41, Peer::Node(NodeId(0)), x);
    let first = writes(&o);
    assert_eq!(first.len(), 1);
    assert!(eager(&o).is_empty(), "no record to wait for: {:?}", o.persist);
    // Node 1 crashes before the next flush: its Accepted record for instance 2 is lost.
    let mut out = Outputs::default();
    let mut n1 = recovered(&cfg, 1, durable, 50, &mut out);
    assert_eq!(n1.view(), View(0));
    let o = tests::step(&mut n1, 51, Peer::Node(NodeId(0)), y);
    for w in writes(&o) {
        assert!(w.seq != Seq(2) || w.digest == first[0].digest, "node 1 signed a second WRITE for instance 2: {w:?}");
    }
    assert!(n1.log.get(&Seq(2)).is_some_and(|s| s.value.is_none()), "it keeps the body without voting");
    (n1, 51)
}
