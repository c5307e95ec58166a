//! Membership changes through whole epochs, on the test network (`test_net.rs`), which
//! routes by stable id and keeps epochs apart as the drivers do (each node admits what it
//! is sent, `Node::admit`): a message reaches a node of the sender's epoch; a STATUS from
//! an earlier epoch is answered with epoch certificates. The simulator adds faults.

use super::tests::{config_rq, secrets, Log};
use super::*;
use crate::crypto::SigningKey;
use crate::membership::{AdminError, AdminOp, AdminResult, Change, Member, Membership, ADMIN_CLIENT};
use crate::message::ReplyBody;
use crate::test_net::TestNet;
use std::ops::{Deref, DerefMut};

/// The test network with the clock these tests keep: [`EpochNet::run`] delivers until
/// quiet and ticks every 5 ms. Instrumented, for the signed statements it keeps.
struct EpochNet {
    net: TestNet<Log>,
    now: u64,
}

impl Deref for EpochNet {
    type Target = TestNet<Log>;
    fn deref(&self) -> &TestNet<Log> {
        &self.net
    }
}

impl DerefMut for EpochNet {
    fn deref_mut(&mut self) -> &mut TestNet<Log> {
        &mut self.net
    }
}

impl EpochNet {
    fn new(cfg: &ClusterConfig) -> EpochNet {
        let nodes =
            (0..cfg.n() as u32).map(|i| Replica::new(cfg.clone(), NodeId(i), secrets(i), Log::default())).collect();
        EpochNet { net: TestNet::of(nodes, Vec::new()).instrumented(), now: 10 }
    }

    /// Starts an ordered operation on client core `c`.
    fn invoke(&mut self, c: ClientId, op: Vec<u8>) -> u64 {
        let now = self.now;
        self.net.invoke(c, op, now)
    }

    fn tick(&mut self) {
        self.now += 5;
        let now = self.now;
        self.net.tick_clients(now);
        self.net.tick_nodes(now);
    }

    fn run(&mut self, ms: u64) {
        let end = self.now + ms;
        while self.now < end {
            let now = self.now;
            self.net.deliver_all(now);
            self.tick();
        }
    }

    /// The membership the newest node runs (what a client would learn).
    fn membership(&self) -> Membership {
        self.nodes.values().max_by_key(|n| n.epoch()).map(|n| n.config().membership.clone()).expect("nodes")
    }

    /// A client request MAC'd for every node, sent to every current node.
    fn submit(&mut self, client: ClientId, seq: u64, op: Vec<u8>) {
        let membership = self.membership();
        let mut req = Request::new(client, seq, op.into());
        let statement = req.statement();
        // One entry per stable id, as the client core builds it.
        req.auth = (0..=membership.highest_id)
            .map(|id| client_mac_key(&secrets(id).mac_secret, client).mac(&statement))
            .collect();
        // Straight to every node, cut off or not (the test's own hand, not the network).
        let ids: Vec<NodeId> = self.nodes.keys().copied().collect();
        let now = self.now;
        for id in ids {
            let msg = Message::Request(req.clone());
            self.net.step(id, now, Input::Message { from: Peer::Client(client), msg });
        }
    }

    /// A result at least `weak` nodes vouched for (in full, or by digest: large results
    /// come in full from one designated node).
    fn result(&self, client: ClientId, seq: u64, weak: usize) -> Option<Vec<u8>> {
        let mine = || self.replies.iter().filter(|(_, _, r)| r.client == client && r.seq == seq);
        mine().find_map(|(_, _, r)| {
            let ReplyBody::Full(body) = &r.body else { return None };
            let digest = r.body.result_digest();
            let who: BTreeSet<NodeId> =
                mine().filter(|(_, _, x)| x.body.result_digest() == digest).map(|(f, _, _)| *f).collect();
            (who.len() >= weak).then(|| body.clone())
        })
    }

    /// Submits an admin op with seven client requests right behind it (clients 8 to 14,
    /// sequence `seq`): with four requests a batch, the admin op's batch is followed by a
    /// full one, proposed at once, so an instance past the epoch's end is in flight when
    /// the epoch ends.
    fn admin(&mut self, key: &SigningKey, seq: u64, epoch: u64, change: Change) -> AdminResult {
        let op = AdminOp::sign(key, epoch, change).encode();
        self.submit(ADMIN_CLIENT, seq, op);
        for client in BEHIND.map(ClientId) {
            self.submit(client, seq, vec![client.0 as u8, seq as u8]);
        }
        self.run(300);
        let bytes = self.result(ADMIN_CLIENT, seq, 2).expect("the admin op was answered");
        postcard::from_bytes(&bytes).expect("an admin result")
    }

    /// Client 7's requests `seqs`, one at a time, each answered by r + 1 nodes.
    fn puts(&mut self, seqs: std::ops::RangeInclusive<u64>, what: &str) {
        for seq in seqs {
            self.submit(ClientId(7), seq, vec![seq as u8]);
            self.run(50);
            assert!(self.result(ClientId(7), seq, 2).is_some(), "put {seq} {what}");
        }
    }

    /// Clients 8 to 14 resend their request `seq` (as the client core does on a
    /// timeout) until it is answered.
    fn retransmit_behind_admin(&mut self, seq: u64) {
        for client in BEHIND.map(ClientId) {
            let op = vec![client.0 as u8, seq as u8];
            for _ in 0..5 {
                if self.result(client, seq, 2).is_some() {
                    break;
                }
                self.submit(client, seq, op.clone());
                self.run(200);
            }
            assert!(self.result(client, seq, 2).is_some(), "client {client} request {seq} answered");
        }
    }

    fn states(&self) -> BTreeMap<NodeId, (u64, Seq, usize)> {
        self.nodes.by_id().map(|(id, n)| (*id, (n.epoch(), n.executed(), n.service().0.len()))).collect()
    }
}

use std::collections::BTreeSet;

/// The clients whose requests follow each admin op.
const BEHIND: std::ops::RangeInclusive<u64> = 8..=14;

fn new_member(id: u32) -> Member {
    Member { id, key: secrets(id).signing.public(), addr: String::new() }
}

#[test]
fn a_node_is_added_then_another_removed_and_the_service_carries_on() {
    let admin = SigningKey::from_seed([77; 32]);
    let cfg = config_rq(1, 1).with_admin_key(admin.public());
    let mut net = EpochNet::new(&cfg);
    net.puts(1..=5, "before any change");

    // Add node 4: the four nodes end epoch 0 at the same instance and start epoch 1.
    let m1 = net.admin(&admin, 1, 0, Change::Add(new_member(4))).expect("add accepted");
    assert_eq!((m1.epoch, m1.n()), (1, 5));
    assert!(net.decided[&0] > m1.since, "an instance past the end of epoch 0 was decided: {:?}", net.decided);
    let joiner = Replica::new(cfg.next_epoch(m1.clone()).expect("valid"), NodeId(4), secrets(4), Log::default());
    assert!(!joiner.has_base(), "a joiner has no state yet");
    net.nodes.insert(NodeId(4), joiner);
    net.run(2_000);
    let states = net.states();
    assert!(states.values().all(|(e, _, _)| *e == 1), "every node runs epoch 1: {states:?}");
    // Requests that were in flight behind the admin op, decided past the epoch's end
    // in epoch 0 and forgotten with it: the nodes carried them into epoch 1, so they
    // executed without their clients retransmitting.
    for client in BEHIND.map(ClientId) {
        assert!(net.result(client, 1, 2).is_some(), "request of client {client} carried into epoch 1");
    }
    net.retransmit_behind_admin(1);
    assert!(
        net.nodes[&NodeId(4)].has_base(),
        "the joiner installed the epoch's base: {}",
        net.nodes[&NodeId(4)].status_line()
    );
    assert!(net.nodes[&NodeId(4)].stable_seq() >= m1.since);
    assert!(net.nodes.values().all(|n| n.config().quorums.order_quorum() == 4));

    // The five nodes order requests; the joiner executes them like the others.
    net.puts(6..=12, "in epoch 1");
    net.run(500);
    let states = net.states();
    assert!(states.values().all(|s| *s == states[&NodeId(0)]), "same state everywhere: {states:?}");
    assert_eq!(states[&NodeId(4)].2, 12 + 7, "the joiner's service holds every put, once (the admin op is not one)");

    // A stale operation (for epoch 0) is refused by every node alike.
    assert_eq!(net.admin(&admin, 2, 0, Change::Remove(3)), Err(AdminError::WrongEpoch { current: 1, got: 0 }));
    // Remove node 1: the others renumber, node 1 stops.
    let m2 = net.admin(&admin, 3, 1, Change::Remove(1)).expect("remove accepted");
    assert_eq!(m2.members.iter().map(|m| m.id).collect::<Vec<_>>(), vec![0, 2, 3, 4]);
    net.run(1_000);
    net.retransmit_behind_admin(2);
    net.retransmit_behind_admin(3);
    assert_eq!(net.removed, [1].map(NodeId).to_vec());
    assert!(!net.nodes.contains_key(&NodeId(1)));
    assert_eq!(net.nodes[&NodeId(4)].index(), MemberIndex(3), "node 4 is index 3 in epoch 2");
    net.puts(13..=20, "in epoch 2");
    net.run(500);
    let states = net.states();
    assert!(states.values().all(|s| *s == states[&NodeId(0)] && s.0 == 2), "same state everywhere: {states:?}");
    assert_eq!(states[&NodeId(0)].2, 20 + 3 * 7, "every put executed once");
}

#[test]
fn a_node_that_missed_the_change_jumps_by_certificates_and_catches_up() {
    let admin = SigningKey::from_seed([77; 32]);
    let cfg = config_rq(1, 1).with_admin_key(admin.public());
    let mut net = EpochNet::new(&cfg);
    net.cut.insert(NodeId(3));
    net.submit(ClientId(7), 1, vec![1]);
    net.run(50);
    let m1 = net.admin(&admin, 1, 0, Change::Add(new_member(4))).expect("add accepted");
    net.nodes.insert(
        NodeId(4),
        Replica::new(cfg.next_epoch(m1.clone()).expect("valid"), NodeId(4), secrets(4), Log::default()),
    );
    net.run(1_000);
    net.retransmit_behind_admin(1);
    // Epoch 1 runs on nodes 0, 1, 2 and the joiner (Q = 4 of 5) while node 3 is away.
    net.puts(2..=9, "without node 3");
    assert_eq!(net.nodes[&NodeId(3)].epoch(), 0);
    net.cut.clear();
    net.run(2_000);
    assert_eq!(net.jumps, [3].map(NodeId).to_vec(), "node 3 left epoch 0 on the certificates");
    net.submit(ClientId(7), 10, vec![10]);
    net.run(500);
    let states = net.states();
    assert!(states.values().all(|s| *s == states[&NodeId(0)] && s.0 == 1), "node 3 caught up: {states:?}");
    assert_eq!(net.nodes[&NodeId(3)].epoch_certs.len(), 1);
    // A certificate chain that does not start at a node's epoch, or is forged, moves
    // nothing.
    let mut fresh = Replica::new(cfg.clone(), NodeId(2), secrets(2), Log::default());
    let mut cert = net.nodes[&NodeId(0)].epoch_certs_after(0).remove(0);
    cert.proof.sigs.truncate(2);
    let mut out = Outputs::default();
    fresh.step(1, Input::Message { from: Peer::Node(NodeId(0)), msg: Message::EpochCerts(vec![cert]) }, &mut out);
    assert!(out.events.iter().any(|e| matches!(e, Event::Rejected { .. })));
    assert!(!fresh.epoch_ended() && fresh.jump.is_none());
}

/// A client core that knows only epoch 0 follows an add and a removal through the
/// certificates nodes give it, and keeps completing operations.
#[test]
fn a_client_follows_membership_changes_by_certificates() {
    let admin = SigningKey::from_seed([77; 32]);
    let cfg = config_rq(1, 1).with_admin_key(admin.public());
    let mut net = EpochNet::new(&cfg);
    let id = 20;
    let keys = (0..4).map(|i| client_mac_key(&secrets(i).mac_secret, ClientId(id))).collect();
    let client = crate::client::Client::new(ClientId(id), cfg.quorums, keys, 100, 1)
        .with_auth(cfg.auth)
        .with_membership(cfg.membership.clone());
    net.clients.insert(ClientId(id), client);
    let put = |net: &mut EpochNet, what: &str| {
        let seq = net.invoke(ClientId(id), vec![1]);
        net.run(1_000);
        assert!(net.completed.contains_key(&(ClientId(id), seq)), "{what}: operation {seq} completed");
    };
    put(&mut net, "epoch 0");
    let m1 = net.admin(&admin, 1, 0, Change::Add(new_member(4))).expect("add");
    net.nodes
        .insert(NodeId(4), Replica::new(cfg.next_epoch(m1).expect("valid"), NodeId(4), secrets(4), Log::default()));
    net.run(1_000);
    net.retransmit_behind_admin(1);
    put(&mut net, "epoch 1");
    assert_eq!(net.clients[&ClientId(id)].membership().epoch, 1, "the client learned epoch 1");
    assert_eq!(net.clients[&ClientId(id)].members(), [0, 1, 2, 3, 4].map(NodeId).to_vec());
    let m2 = net.admin(&admin, 2, 1, Change::Remove(0)).expect("remove");
    assert_eq!(m2.members.iter().map(|m| m.id).collect::<Vec<_>>(), vec![1, 2, 3, 4]);
    net.run(1_000);
    net.retransmit_behind_admin(2);
    put(&mut net, "epoch 2 (the old primary is gone)");
    put(&mut net, "epoch 2 again");
    assert_eq!(net.clients[&ClientId(id)].membership().epoch, 2);
    assert_eq!(net.clients[&ClientId(id)].members(), [1, 2, 3, 4].map(NodeId).to_vec());
    // Certificates that do not lead on from what the client knows change nothing.
    let stale = net.nodes[&NodeId(1)].epoch_certs_after(0);
    assert!(!net.clients.get_mut(&ClientId(id)).expect("client").on_epoch_certs(stale));
}

#[test]
fn forged_and_unsafe_admin_operations_change_nothing() {
    let admin = SigningKey::from_seed([77; 32]);
    let cfg = config_rq(1, 1).with_admin_key(admin.public());
    let mut net = EpochNet::new(&cfg);
    let mallory = SigningKey::from_seed([66; 32]);
    assert_eq!(net.admin(&mallory, 1, 0, Change::Remove(3)), Err(AdminError::BadSignature));
    assert!(matches!(net.admin(&admin, 2, 0, Change::Remove(3)), Err(AdminError::Quorums(_))));
    net.run(500);
    assert!(net.states().values().all(|(e, _, _)| *e == 0));
    assert!(net.jumps.is_empty() && net.removed.is_empty());
    // Without an admin key nothing can change the membership.
    let mut plain = EpochNet::new(&config_rq(1, 1));
    assert_eq!(plain.admin(&admin, 1, 0, Change::Add(new_member(4))), Err(AdminError::NoAdminKey));
}

#[test]
fn a_node_restarting_between_epochs_recovers_in_the_right_one() {
    let admin = SigningKey::from_seed([77; 32]);
    let cfg = config_rq(1, 1).with_admin_key(admin.public());
    let mut net = EpochNet::new(&cfg);
    net.submit(ClientId(7), 1, vec![1]);
    net.run(50);
    let m1 = net.admin(&admin, 1, 0, Change::Faults { u: 1, r: 0 }).expect("accepted");
    net.run(500);
    let node = &net.nodes[&NodeId(2)];
    assert_eq!((node.epoch(), node.config().quorums.byzantine()), (1, false));
    // What the node has on disk at the end of epoch 0, before and after it compacted its
    // log for epoch 1.
    let snapshot = (m1.since, node.stable_chunks.clone().expect("base"));
    let stable = Record::Stable(node.stable.clone());
    let before = Durable { snapshots: vec![snapshot.clone()], records: vec![stable.clone()] };
    assert_eq!(before.membership(), None, "recovers in epoch 0 (the file's) and ends it again");
    let after = Durable { snapshots: vec![snapshot], records: node.durable_records() };
    assert_eq!(after.membership().map(|m| m.epoch), Some(1));
    assert_eq!(Durable::default().membership(), None);
}

/// Issue #21 defect 1: a NEW-VIEW signed in an earlier epoch must not install in a later
/// one, even when the change kept every signer's index and key (a `set-faults` change).
/// On ce084db statements named no epoch: node 2 installed view 1 from epoch 0's NEW-VIEW
/// replayed byte for byte by node 1 (view 1's primary), with epoch 0's floor.
#[test]
fn a_new_view_or_write_from_an_earlier_epoch_is_refused_after_a_set_faults_change() {
    let admin = SigningKey::from_seed([77; 32]);
    let cfg = config_rq(1, 1).with_admin_key(admin.public());
    let mut net = EpochNet::new(&cfg);
    net.puts(1..=2, "before the view change");
    // Node 0 (view 0's primary) is cut off: the others move to view 1.
    net.cut.insert(NodeId(0));
    net.submit(ClientId(7), 3, vec![3]);
    net.run(3_000);
    assert!(net.nodes[&NodeId(1)].view() >= View(1), "a view change in epoch 0");
    net.cut.clear();
    net.run(1_000);
    let m1 = net.admin(&admin, 1, 0, Change::Faults { u: 1, r: 1 }).expect("accepted");
    net.run(500);
    net.retransmit_behind_admin(1);
    assert_eq!(m1.epoch, 1);
    assert!(net.nodes.values().all(|n| n.epoch() == 1 && n.view() == View(0)), "epoch 1 starts at view 0");
    let old: Vec<(NodeId, Message)> =
        net.signed.iter().filter(|(_, epoch, _)| *epoch == 0).map(|(f, _, m)| (*f, m.clone())).collect();
    let new_view = old.iter().find(|(_, m)| matches!(m, Message::NewView(nv) if nv.view >= View(1))).cloned();
    let (from, new_view) = new_view.expect("epoch 0 had a NEW-VIEW");
    // The primary of that view replays it in epoch 1 (same index, same key).
    let mut out = Outputs::default();
    let now = net.now;
    let target = net.nodes.get_mut(&NodeId(2)).expect("node 2");
    target.step(now, Input::Message { from: Peer::Node(from), msg: new_view }, &mut out);
    assert_eq!(target.view(), View(0), "an old epoch's NEW-VIEW installed a view");
    assert!(out.events.iter().any(|e| matches!(e, Event::Rejected { kind: "new-view", .. })), "{:?}", out.events);
    // No WRITE of epoch 0 carries a valid signature in epoch 1, whatever its instance:
    // none can count towards a certificate of the new epoch (the verify stage and the
    // protocol task make the same check, `verify::write_signed`).
    let checker = net.nodes[&NodeId(2)].verifier();
    let writes: Vec<(NodeId, Message)> =
        old.into_iter().filter(|(f, m)| *f != NodeId(2) && matches!(m, Message::Write(_))).collect();
    assert!(!writes.is_empty(), "epoch 0 had WRITEs");
    for (from, m) in writes {
        assert!(!checker.check(from, &m), "an epoch 0 WRITE is valid in epoch 1: {m:?}");
    }
    // While the same WRITEs were valid in epoch 0 (the check can pass).
    let (from, m) = net
        .signed
        .iter()
        .find(|(f, e, m)| *f != NodeId(2) && *e == 0 && matches!(m, Message::Write(_)))
        .map(|(f, _, m)| (*f, m.clone()))
        .expect("a write");
    let epoch0 = Replica::new(cfg.clone(), NodeId(2), secrets(2), Log::default());
    assert!(epoch0.verifier().check(from, &m));
}

/// `keel admin backup`'s fetch (backup.rs), served by the nodes to the administrator's
/// session like a peer's state transfer.
mod backup {
    use super::*;
    use crate::backup::{Certifiers, CheckpointFetch, Fetched};

    const ADMIN: ClientId = ADMIN_CLIENT;

    /// Runs `fetch` against the nodes until it finishes (or `ms` pass). `tamper`
    /// rewrites what one node sends it (a lying node). Returns the checkpoint and the
    /// answers the fetch refused.
    fn run_fetch(
        net: &mut EpochNet,
        fetch: &mut CheckpointFetch,
        ms: u64,
        tamper: &mut dyn FnMut(u32, Message) -> Message,
    ) -> Option<Fetched> {
        let end = net.now + ms;
        let mut outbox = fetch.on_tick(net.now);
        while net.now < end {
            let mut inbox = Vec::new();
            let now = net.now;
            for (to, msg) in std::mem::take(&mut outbox) {
                let Some(node) = net.nodes.get_mut(&to) else { continue };
                let mut out = Outputs::default();
                node.step(now, Input::Message { from: Peer::Client(ADMIN), msg }, &mut out);
                for (peer, m) in out.send.iter().chain(&out.send_after_persist) {
                    if *peer == Peer::Client(ADMIN) {
                        inbox.push((to, tamper(to.0, m.clone())));
                    }
                }
            }
            for (from, msg) in inbox {
                outbox.extend(fetch.on_message(net.now, from, msg).unwrap_or_default());
            }
            if let Some(done) = fetch.finished() {
                return Some(done);
            }
            if outbox.is_empty() {
                net.tick();
                outbox = fetch.on_tick(net.now);
            }
        }
        None
    }

    /// The service state a node held after `seq`, as its own snapshot would give it.
    fn log_after(state: &Fetched) -> Log {
        let bytes = state.state.to_bytes().expect("in memory");
        let (seq, service) = crate::exec::snapshot_service_state(&bytes).expect("an executor snapshot");
        assert_eq!(seq, state.proof.seq);
        let mut log = Log::default();
        log.restore(service).expect("the service's bytes");
        log
    }

    #[test]
    fn the_administrator_fetches_a_certified_checkpoint_and_a_lying_node_cannot_change_it() {
        let admin = SigningKey::from_seed([77; 32]);
        let cfg = config_rq(1, 1).with_admin_key(admin.public());
        let mut net = EpochNet::new(&cfg);
        let genesis = cfg.membership.clone();
        let mut fetch = CheckpointFetch::new(ADMIN, genesis.clone(), Certifiers::Members, 20);
        // No checkpoint yet: nothing to fetch, and no node sends anything made up.
        assert!(run_fetch(&mut net, &mut fetch, 200, &mut |_, m| m).is_none());
        assert!(fetch.progress().is_none());

        net.puts(1..=20, "before the backup");
        net.run(200);
        let stable = net.nodes[&NodeId(0)].stable_seq();
        assert!(stable >= Seq(16), "two checkpoints taken: {stable}");
        // Node 2 lies about every chunk, and forges a certificate for another root.
        let mut lies = 0;
        let mut liar = |from: u32, m: Message| match (from, m) {
            (2, Message::Chunk { seq, index, mut data }) => {
                lies += 1;
                data.push(1);
                Message::Chunk { seq, index, data }
            }
            (2, Message::StableCert(mut p)) => {
                p.seq += 8;
                p.root = Digest::default();
                Message::StableCert(p)
            }
            (_, m) => m,
        };
        let got = run_fetch(&mut net, &mut fetch, 2_000, &mut liar).expect("the checkpoint arrived");
        assert!(lies > 0, "node 2 was asked for chunks");
        assert!(fetch.refused() > 0, "its chunks and certificate were refused");
        assert_eq!(got.proof.seq, stable);
        assert_eq!(got.state.root, got.proof.root);
        assert_eq!(got.membership, genesis);
        // What a correct node held at that instance: the first `stable` puts.
        let log = log_after(&got);
        assert_eq!(log.0.len() as u64, stable.min(Seq(20)).0, "{:?}", log.0);
        assert_eq!(log.0, net.nodes[&NodeId(1)].service().0[..log.0.len()].to_vec());
    }

    #[test]
    fn a_fetch_with_a_barrier_passes_over_checkpoints_from_before_it() {
        let cfg = config_rq(1, 1);
        let mut net = EpochNet::new(&cfg);
        net.puts(1..=20, "before the barrier");
        net.run(200);
        let stable = net.nodes[&NodeId(0)].stable_seq();
        assert!(stable < Seq(20), "the newest checkpoint ({stable}) is from before put 20");
        // Client 7's put 20 is the barrier: the backup must hold it.
        let mut fetch =
            CheckpointFetch::new(ADMIN, cfg.membership.clone(), Certifiers::Members, 20).with_barrier(ClientId(7), 20);
        assert!(run_fetch(&mut net, &mut fetch, 500, &mut |_, m| m).is_none());
        assert!(fetch.passed_over(), "the checkpoint at {stable} was fetched and found short");
        net.puts(21..=30, "after the barrier");
        net.run(200);
        let got = run_fetch(&mut net, &mut fetch, 2_000, &mut |_, m| m).expect("a checkpoint past the barrier");
        assert!(got.proof.seq > stable);
        let log = log_after(&got);
        assert!(log.0.contains(&vec![20]), "the state holds put 20: {:?}", log.0);
        // Without the barrier the first one would have done.
        let mut plain = CheckpointFetch::new(ADMIN, cfg.membership.clone(), Certifiers::Members, 20);
        assert!(run_fetch(&mut net, &mut plain, 500, &mut |_, m| m).is_some());
    }

    #[test]
    fn a_fetch_that_knows_an_older_membership_follows_the_epoch_certificates() {
        let admin = SigningKey::from_seed([77; 32]);
        let cfg = config_rq(1, 1).with_admin_key(admin.public());
        let mut net = EpochNet::new(&cfg);
        net.puts(1..=3, "epoch 0");
        let m1 = net.admin(&admin, 1, 0, Change::Add(new_member(4))).expect("add");
        net.nodes.insert(
            NodeId(4),
            Replica::new(cfg.next_epoch(m1.clone()).expect("valid"), NodeId(4), secrets(4), Log::default()),
        );
        net.run(1_000);
        net.retransmit_behind_admin(1);
        let m2 = net.admin(&admin, 2, 1, Change::Remove(0)).expect("remove");
        net.run(1_000);
        net.retransmit_behind_admin(2);
        net.puts(4..=30, "epoch 2");
        net.run(300);
        let stable = net.nodes[&NodeId(1)].stable_seq();
        assert!(stable > m2.since, "a checkpoint of epoch 2: {stable} > {}", m2.since);

        // Knows epoch 0 only, whose members were 0..=3 (node 0 is gone now).
        let mut fetch = CheckpointFetch::new(ADMIN, cfg.membership.clone(), Certifiers::Members, 20);
        let got = run_fetch(&mut net, &mut fetch, 3_000, &mut |_, m| m).expect("the checkpoint arrived");
        assert_eq!(fetch.membership().epoch, 2, "followed two epochs");
        assert_eq!(got.membership.digest(), m2.digest());
        assert!(got.proof.seq >= stable);
        assert_eq!(got.state.root, got.proof.root);
        assert_eq!(fetch.refused(), 0);
    }

    #[test]
    fn a_certificate_without_a_quorum_is_refused() {
        let cfg = config_rq(1, 1);
        let mut net = EpochNet::new(&cfg);
        net.puts(1..=10, "before");
        net.run(200);
        // Every node cuts its certificate to one signature short of the quorum.
        let q = cfg.quorums.order_quorum();
        let mut short = |_: u32, m: Message| match m {
            Message::StableCert(mut p) => {
                p.sigs.truncate(q - 1);
                Message::StableCert(p)
            }
            m => m,
        };
        let mut fetch = CheckpointFetch::new(ADMIN, cfg.membership.clone(), Certifiers::Members, 20);
        assert!(run_fetch(&mut net, &mut fetch, 500, &mut short).is_none());
        assert!(fetch.progress().is_none(), "nothing adopted");
        assert!(fetch.refused() > 0);
    }
}
