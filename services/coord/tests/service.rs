//! The coordination service driven directly (as every node's executor drives it):
//! ZooKeeper's semantics for each operation, sessions, watches and ACLs.

use keel_coord::coord::{digest_id, Command, Push, Reply};
use keel_coord::jute::{Reader, Writer};
use keel_coord::proto::{err, event, op, perm, Acl, Request, Stat};
use keel_coord::session_key::SessionSecret;
use keel_coord::Coord;
use keel_core::ids::ClientId;
use keel_core::ids::Seq;
use keel_core::service::{ExecCtx, ReadCtx, Service};

/// Front end A's client (a session of identity 2000) and front end B's.
const FE_A: u64 = 2000 << 10;
const FE_B: u64 = 2001 << 10;
/// Two more front ends (other nodes').
const FE_C: u64 = 2002 << 10;
const FE_D: u64 = 2003 << 10;

/// A session secret drawn from `n` (a front end draws them at random).
fn secret(n: u8) -> SessionSecret {
    SessionSecret::from_bytes([n; 16])
}

/// Connect as a front end would, with `secret` as the client's password.
fn connect_with(secret: &SessionSecret, pinned: bool) -> Command {
    Command::Connect { timeout: 6_000, ip: "::1".into(), pinned, verifier: secret.verifier() }
}

/// Attach as front end `from` would, for a client that shows `shown` and will hold
/// `next`.
fn attach_with(from: u64, session: i64, shown: &SessionSecret, next: &SessionSecret) -> Command {
    let next = next.verifier();
    let proof = shown.prove(session, from, &next);
    Command::Attach { session, proof, next, timeout: 6_000, ip: "::1".into() }
}

struct World {
    coord: Coord,
    time: u64,
    seq: u64,
    pushes: Vec<(u64, Push)>,
}

impl World {
    fn new() -> World {
        World { coord: Coord::new(), time: 1_000, seq: 0, pushes: Vec::new() }
    }

    fn run(&mut self, from: u64, command: Command) -> Reply {
        self.seq += 1;
        let ctx = ExecCtx::new(Seq(self.seq), self.time, self.seq * 7919, ClientId(from));
        let reply = self.coord.execute(&command.encode(), &ctx);
        for (to, bytes) in ctx.take_pushes() {
            self.pushes.push((to.0, Push::decode(&bytes).expect("a push the service wrote")));
        }
        Reply::decode(&reply).expect("a reply the service wrote")
    }

    fn tick(&mut self, to: u64) {
        self.time = to;
        self.seq += 1;
        let ctx = ExecCtx::new(Seq(self.seq), self.time, self.seq, keel_core::ids::TICK_CLIENT);
        self.coord.on_tick(&ctx);
        for (to, bytes) in ctx.take_pushes() {
            self.pushes.push((to.0, Push::decode(&bytes).expect("a push")));
        }
    }

    fn connect(&mut self, from: u64) -> i64 {
        let verifier = secret(1).verifier();
        match self.run(from, Command::Connect { timeout: 6_000, ip: "127.0.0.1".into(), pinned: false, verifier }) {
            Reply::Session { id, timeout, .. } => {
                assert_eq!(timeout, 6_000);
                id
            }
            other => panic!("no session: {other:?}"),
        }
    }

    fn op(&mut self, session: i64, request: Request) -> (i32, Vec<u8>) {
        match self.run(FE_A, Command::Op { session, request }) {
            Reply::Op { err, body, .. } => (err, body),
            other => panic!("not an op reply: {other:?}"),
        }
    }

    fn create(&mut self, session: i64, path: &str, flags: i32) -> Result<String, i32> {
        let request = Request::Create {
            opcode: op::CREATE,
            path: path.into(),
            data: b"d".to_vec(),
            acl: Acl::open(),
            flags,
            ttl: -1,
        };
        match self.op(session, request) {
            (0, body) => Ok(Reader::new(&body).string().expect("a path")),
            (e, _) => Err(e),
        }
    }

    fn stat(&mut self, session: i64, path: &str) -> Option<Stat> {
        match self.op(session, Request::Exists { path: path.into(), watch: false }) {
            (0, body) => Some(Stat::read(&mut Reader::new(&body)).expect("a stat")),
            (e, _) => {
                assert_eq!(e, err::NO_NODE);
                None
            }
        }
    }

    fn children(&mut self, session: i64, path: &str) -> Vec<String> {
        let (e, body) = self.op(session, Request::GetChildren { path: path.into(), watch: false, two: false });
        assert_eq!(e, err::OK);
        Reader::new(&body).strings().expect("names")
    }

    fn watch_events(&mut self) -> Vec<(i64, i32, String)> {
        std::mem::take(&mut self.pushes)
            .into_iter()
            .filter_map(|(_, p)| match p {
                Push::Watch { session, kind, path, .. } => Some((session, kind, path)),
                Push::Expired { .. } => None,
            })
            .collect()
    }
}

#[test]
fn create_get_set_delete_with_versions_and_stats() {
    let mut w = World::new();
    let s = w.connect(FE_A);
    assert_eq!(w.create(s, "/app", 0), Ok("/app".into()));
    assert_eq!(w.create(s, "/app", 0), Err(err::NODE_EXISTS));
    assert_eq!(w.create(s, "/missing/child", 0), Err(err::NO_NODE));
    assert_eq!(w.create(s, "bad", 0), Err(err::BAD_ARGUMENTS));
    let created = w.stat(s, "/app").expect("exists");
    assert_eq!((created.version, created.data_length, created.ctime), (0, 1, 1_000));
    let set = |version| Request::SetData { path: "/app".into(), data: b"two".to_vec(), version };
    assert_eq!(w.op(s, set(5)).0, err::BAD_VERSION);
    assert_eq!(w.op(s, set(0)).0, err::OK);
    let after = w.stat(s, "/app").expect("exists");
    assert_eq!(after.version, 1);
    assert!(after.mzxid > created.mzxid, "a write moves mzxid");
    let (e, body) = w.op(s, Request::GetData { path: "/app".into(), watch: false });
    assert_eq!(e, err::OK);
    assert_eq!(Reader::new(&body).buffer().expect("data"), b"two");
    w.create(s, "/app/x", 0).expect("child");
    assert_eq!(w.op(s, Request::Delete { path: "/app".into(), version: -1 }).0, err::NOT_EMPTY);
    assert_eq!(w.op(s, Request::Delete { path: "/app/x".into(), version: 3 }).0, err::BAD_VERSION);
    assert_eq!(w.op(s, Request::Delete { path: "/app/x".into(), version: 0 }).0, err::OK);
    assert_eq!(w.op(s, Request::Delete { path: "/zookeeper".into(), version: -1 }).0, err::BAD_ARGUMENTS);
    assert_eq!(w.children(s, "/"), vec!["app".to_string(), "zookeeper".to_string()]);
}

#[test]
fn sequential_names_come_from_the_parents_child_version() {
    let mut w = World::new();
    let s = w.connect(FE_A);
    w.create(s, "/q", 0).expect("parent");
    assert_eq!(w.create(s, "/q/item-", 2), Ok("/q/item-0000000000".into()));
    assert_eq!(w.create(s, "/q/item-", 2), Ok("/q/item-0000000001".into()));
    w.op(s, Request::Delete { path: "/q/item-0000000000".into(), version: -1 });
    // The number counts creates, not deletes (ZooKeeper's differential test showed
    // it): the next is 2, while the reported cversion counts the delete too.
    assert_eq!(w.create(s, "/q/item-", 3), Ok("/q/item-0000000002".into()));
    assert_eq!(w.stat(s, "/q").expect("q").cversion, 4);
}

#[test]
fn ephemerals_go_with_their_session_on_close_and_on_expiry_and_watches_fire() {
    let mut w = World::new();
    let a = w.connect(FE_A);
    let b = w.connect(FE_B);
    w.create(a, "/locks", 0).expect("parent");
    assert_eq!(w.create(a, "/locks/a", 1), Ok("/locks/a".into()));
    assert_eq!(w.create(a, "/locks/a/child", 0), Err(err::NO_CHILDREN_FOR_EPHEMERALS));
    // b watches the lock node and the parent's children.
    match w.run(FE_B, Command::Op { session: b, request: Request::Exists { path: "/locks/a".into(), watch: true } }) {
        Reply::Op { err: 0, .. } => {}
        other => panic!("{other:?}"),
    }
    w.run(
        FE_B,
        Command::Op { session: b, request: Request::GetChildren { path: "/locks".into(), watch: true, two: false } },
    );
    w.watch_events();
    assert!(matches!(w.run(FE_A, Command::Close { session: a }), Reply::Op { err: 0, .. }));
    let reader = w.connect(FE_A);
    assert_eq!(w.stat(reader, "/locks/a"), None, "the ephemeral went with its session");
    let events = w.watch_events();
    assert!(events.contains(&(b, event::NODE_DELETED, "/locks/a".into())), "{events:?}");
    assert!(events.contains(&(b, event::NODE_CHILDREN_CHANGED, "/locks".into())), "{events:?}");
    // One-shot: a second change fires nothing.
    let c = w.connect(FE_A);
    w.create(c, "/locks/c", 1).expect("ephemeral");
    assert!(w.watch_events().is_empty());
    // Expiry: c is not touched; b is. Ticks every 500 ms for longer than the timeout.
    for _ in 0..14 {
        w.run(FE_B, Command::Touch { sessions: vec![b] });
        w.run(FE_A, Command::Touch { sessions: vec![reader] });
        // A front end cannot keep another's session alive.
        w.run(FE_B, Command::Touch { sessions: vec![c] });
        w.tick(w.time + 500);
    }
    assert_eq!(w.coord.sessions(), 2, "c expired, b and reader live");
    let expired: Vec<i64> =
        w.pushes.iter().filter_map(|(_, p)| matches!(p, Push::Expired { .. }).then_some(0)).collect();
    assert_eq!(expired.len(), 1);
    assert!(matches!(
        w.run(FE_A, Command::Op { session: c, request: Request::Sync { path: "/".into() } }),
        Reply::Op { err: err::SESSION_EXPIRED, .. }
    ));
}

#[test]
fn a_failed_multi_changes_nothing_and_reports_each_op() {
    let mut w = World::new();
    let s = w.connect(FE_A);
    let create = |path: &str| Request::Create {
        opcode: op::CREATE,
        path: path.into(),
        data: Vec::new(),
        acl: Acl::open(),
        flags: 0,
        ttl: -1,
    };
    let zxid = w.coord.zxid();
    let (e, body) = w.op(
        s,
        Request::Multi(vec![create("/m1"), Request::Check { path: "/nope".into(), version: -1 }, create("/m2")]),
    );
    assert_eq!(e, err::OK);
    let mut r = Reader::new(&body);
    let mut codes = Vec::new();
    loop {
        let (kind, done, code) = (r.int().unwrap(), r.bool().unwrap(), r.int().unwrap());
        if done {
            break;
        }
        assert_eq!(kind, op::ERROR);
        assert_eq!(r.int().unwrap(), code);
        codes.push(code);
    }
    assert_eq!(codes, vec![err::OK, err::NO_NODE, err::RUNTIME_INCONSISTENCY]);
    assert_eq!(w.stat(s, "/m1"), None, "nothing of a failed multi stays");
    assert_eq!(w.coord.zxid(), zxid);
    let (e, _) = w.op(s, Request::Multi(vec![create("/m1"), create("/m1/x")]));
    assert_eq!(e, err::OK);
    let (a, b) = (w.stat(s, "/m1").expect("m1"), w.stat(s, "/m1/x").expect("x"));
    assert_eq!(a.czxid, b.czxid, "one transaction, one zxid");
}

#[test]
fn digest_acls_are_enforced() {
    let mut w = World::new();
    let owner = w.connect(FE_A);
    let other = w.connect(FE_A);
    assert!(matches!(
        w.run(FE_A, Command::Auth { session: owner, scheme: "digest".into(), auth: b"alice:secret".to_vec() }),
        Reply::Op { err: 0, .. }
    ));
    let acl = vec![Acl { perms: perm::ALL, scheme: "auth".into(), id: String::new() }];
    let request =
        Request::Create { opcode: op::CREATE, path: "/private".into(), data: b"x".to_vec(), acl, flags: 0, ttl: -1 };
    assert_eq!(w.op(owner, request).0, err::OK);
    assert_eq!(w.op(owner, Request::GetData { path: "/private".into(), watch: false }).0, err::OK);
    assert_eq!(w.op(other, Request::GetData { path: "/private".into(), watch: false }).0, err::NO_AUTH);
    assert_eq!(
        w.op(other, Request::SetData { path: "/private".into(), data: Vec::new(), version: -1 }).0,
        err::NO_AUTH
    );
    // "auth" without an authenticated id is an invalid ACL.
    let acl = vec![Acl { perms: perm::ALL, scheme: "auth".into(), id: String::new() }];
    let request = Request::Create { opcode: op::CREATE, path: "/p2".into(), data: Vec::new(), acl, flags: 0, ttl: -1 };
    assert_eq!(w.op(other, request).0, err::INVALID_ACL);
    // ip ACLs match the session's address.
    let acl = vec![Acl { perms: perm::READ, scheme: "ip".into(), id: "10.0.0.0/8".into() }];
    let request = Request::Create { opcode: op::CREATE, path: "/ip".into(), data: Vec::new(), acl, flags: 0, ttl: -1 };
    assert_eq!(w.op(other, request).0, err::OK);
    assert_eq!(w.op(other, Request::GetData { path: "/ip".into(), watch: false }).0, err::NO_AUTH);
}

#[test]
fn the_digest_scheme_matches_zookeepers_known_value() {
    // ZooKeeper's DigestAuthenticationProvider.generateDigest("super:test").
    assert_eq!(digest_id("super:test"), "super:D/InIHSb7yEEbrWz8b9l71RjZJU=");
}

#[test]
fn reads_answered_without_ordering_equal_ordered_ones_and_sessions_are_owned() {
    let mut w = World::new();
    let s = w.connect(FE_A);
    w.create(s, "/r", 0).expect("created");
    let read = Command::Op { session: s, request: Request::GetData { path: "/r".into(), watch: false } };
    let ctx = ReadCtx { client: ClientId(FE_A), executed: Seq(1), time: 0 };
    let unordered = w.coord.execute_read_only(&read.encode(), &ctx).expect("read-only");
    let ordered = match w.run(FE_A, read.clone()) {
        r @ Reply::Op { .. } => r,
        other => panic!("{other:?}"),
    };
    assert_eq!(Reply::decode(&unordered), Some(ordered));
    // A watch is state: such a read is ordered.
    let watched = Command::Op { session: s, request: Request::GetData { path: "/r".into(), watch: true } };
    assert_eq!(w.coord.execute_read_only(&watched.encode(), &ctx), None);
    // Another front end may not act for the session before it attaches.
    assert!(matches!(
        w.run(FE_B, Command::Op { session: s, request: Request::Sync { path: "/".into() } }),
        Reply::Op { err: err::SESSION_MOVED, .. }
    ));
    let verifier = secret(2).verifier();
    match w.run(FE_A, Command::Connect { timeout: 1, ip: "::1".into(), pinned: false, verifier }) {
        Reply::Session { timeout, .. } => assert_eq!(timeout, 4_000, "clamped to the minimum"),
        other => panic!("{other:?}"),
    }
    // Nor attach it without its password.
    assert_eq!(w.run(FE_B, attach_with(FE_B, s, &secret(9), &secret(3))), Reply::Refused { err: err::SESSION_EXPIRED });
    let garbage = Command::Attach { session: s, proof: vec![0; 64], next: [0; 32], timeout: 6_000, ip: "::1".into() };
    assert_eq!(w.run(FE_B, garbage), Reply::Refused { err: err::SESSION_EXPIRED });
}

#[test]
fn set_watches_fires_what_changed_since_the_clients_zxid() {
    let mut w = World::new();
    let s = w.connect(FE_A);
    w.create(s, "/a", 0).expect("a");
    w.create(s, "/b", 0).expect("b");
    let seen = w.coord.zxid();
    w.op(s, Request::SetData { path: "/a".into(), data: b"new".to_vec(), version: -1 });
    w.watch_events();
    w.op(
        s,
        Request::SetWatches {
            relative_zxid: seen,
            data: vec!["/a".into(), "/b".into(), "/gone".into()],
            exist: vec!["/b".into(), "/later".into()],
            child: vec!["/".into()],
            persistent: Vec::new(),
            recursive: Vec::new(),
        },
    );
    let events = w.watch_events();
    assert!(events.contains(&(s, event::NODE_DATA_CHANGED, "/a".into())));
    assert!(events.contains(&(s, event::NODE_DELETED, "/gone".into())));
    assert!(events.contains(&(s, event::NODE_CREATED, "/b".into())));
    assert!(!events.iter().any(|(_, _, p)| p == "/" || p == "/later"), "{events:?}");
    // /later was registered: creating it fires.
    w.create(s, "/later", 0).expect("later");
    assert!(w.watch_events().contains(&(s, event::NODE_CREATED, "/later".into())));
}

#[test]
fn persistent_recursive_watches_see_every_change_below() {
    let mut w = World::new();
    let s = w.connect(FE_A);
    assert_eq!(w.op(s, Request::AddWatch { path: "/tree".into(), mode: 1 }).0, err::OK);
    w.create(s, "/tree", 0).expect("tree");
    w.create(s, "/tree/a", 0).expect("a");
    w.op(s, Request::SetData { path: "/tree/a".into(), data: Vec::new(), version: -1 });
    w.create(s, "/tree/a/b", 0).expect("b");
    let events = w.watch_events();
    assert_eq!(
        events,
        vec![
            (s, event::NODE_CREATED, "/tree".into()),
            (s, event::NODE_CREATED, "/tree/a".into()),
            (s, event::NODE_DATA_CHANGED, "/tree/a".into()),
            (s, event::NODE_CREATED, "/tree/a/b".into()),
        ]
    );
    assert_eq!(w.op(s, Request::RemoveWatches { path: "/tree".into(), kind: 5 }).0, err::OK);
    assert_eq!(w.op(s, Request::RemoveWatches { path: "/tree".into(), kind: 5 }).0, err::NO_WATCHER);
    w.create(s, "/tree/c", 0).expect("c");
    assert!(w.watch_events().is_empty());
}

#[test]
fn containers_and_ttl_nodes_go_at_ticks() {
    let mut w = World::new();
    let s = w.connect(FE_A);
    let container = Request::Create {
        opcode: op::CREATE_CONTAINER,
        path: "/c".into(),
        data: Vec::new(),
        acl: Acl::open(),
        flags: 4,
        ttl: -1,
    };
    assert_eq!(w.op(s, container).0, err::OK);
    let ttl = Request::Create {
        opcode: op::CREATE_TTL,
        path: "/t".into(),
        data: Vec::new(),
        acl: Acl::open(),
        flags: 5,
        ttl: 2_000,
    };
    assert_eq!(w.op(s, ttl).0, err::OK);
    let no_ttl = Request::Create {
        opcode: op::CREATE_TTL,
        path: "/t2".into(),
        data: Vec::new(),
        acl: Acl::open(),
        flags: 5,
        ttl: 0,
    };
    assert_eq!(w.op(s, no_ttl).0, err::BAD_ARGUMENTS);
    w.run(FE_A, Command::Touch { sessions: vec![s] });
    w.tick(1_500);
    assert!(w.stat(s, "/c").is_some(), "a container that never had a child stays");
    w.create(s, "/c/x", 0).expect("child");
    w.op(s, Request::Delete { path: "/c/x".into(), version: -1 });
    w.tick(2_000);
    assert!(w.stat(s, "/c").is_none(), "an emptied container goes");
    assert!(w.stat(s, "/t").is_some());
    w.run(FE_A, Command::Touch { sessions: vec![s] });
    w.tick(3_500);
    assert!(w.stat(s, "/t").is_none(), "a TTL node not written for its TTL goes");
}

#[test]
fn snapshots_restore_to_an_equal_state() {
    let mut w = World::new();
    let s = w.connect(FE_A);
    w.create(s, "/x", 1).expect("ephemeral");
    w.op(s, Request::AddWatch { path: "/".into(), mode: 1 });
    let mut copy = Coord::new();
    copy.restore(&w.coord.snapshot()).expect("restores");
    assert_eq!(copy.snapshot(), w.coord.snapshot());
    assert_eq!(copy.digest(), w.coord.digest());
    let mut junk = Coord::new();
    assert!(junk.restore(b"\xff\xff\xff").is_err());
    // Another build's snapshot (its format stamp differs) is refused by name, not misread.
    let mut other = w.coord.snapshot();
    other[0] = other[0].wrapping_add(1);
    let e = Coord::new().restore(&other).expect_err("another format");
    assert!(e.0.contains("coord snapshot of format"), "{e}");
}

#[test]
fn garbage_commands_get_a_marshalling_error() {
    let mut coord = Coord::new();
    let ctx = ExecCtx::new(Seq(1), 1, 1, ClientId(FE_A));
    let reply = Reply::decode(&coord.execute(b"\xff\x00garbage", &ctx));
    assert!(matches!(reply, Some(Reply::Op { err: err::MARSHALLING_ERROR, .. })));
    let _ = Writer::new();
}

#[test]
fn a_local_view_reads_the_state_its_services_execute_and_clones_share_it() {
    use keel_coord::coord::LocalView;
    let view = LocalView::new();
    let shared = view.clone();
    let mut service = view.service();
    assert!(shared.views(&service), "a clone of the view reads the service's state");
    let ctx = ExecCtx::new(Seq(1), 1_000, 7, ClientId(FE_A));
    let session = match Reply::decode(&service.execute(&connect_with(&secret(1), false).encode(), &ctx)) {
        Some(Reply::Session { id, .. }) => id,
        other => panic!("{other:?}"),
    };
    assert_eq!(shared.zxid(), 1, "the view sees the session's transaction");
    let reply = shared.read(session, ClientId(FE_A), Request::Exists { path: "/zookeeper".into(), watch: false });
    assert!(matches!(reply, Some(Reply::Op { err: 0, .. })), "{reply:?}");
    assert_eq!(shared.read(session, ClientId(FE_A), Request::Sync { path: "/".into() }), None, "not a read");
    // A deep copy of the service is not the view's.
    assert!(!shared.views(&service.clone()));
}

#[test]
fn a_batch_runs_each_sessions_commands_in_order_and_refuses_nesting() {
    let mut w = World::new();
    let a = w.connect(FE_A);
    let b = w.connect(FE_A);
    let create = |path: &str| Request::Create {
        opcode: op::CREATE,
        path: path.into(),
        data: b"d".to_vec(),
        acl: Acl::open(),
        flags: 0,
        ttl: -1,
    };
    let batch = Command::Batch(vec![
        Command::Ops { session: a, requests: vec![create("/x"), Request::Exists { path: "/x".into(), watch: true }] },
        Command::Op { session: b, request: create("/x") },
        Command::Batch(Vec::new()),
        Command::Op { session: 424242, request: create("/y") },
    ]);
    let replies = match w.run(FE_A, batch) {
        Reply::Batch(r) => r,
        other => panic!("{other:?}"),
    };
    assert!(
        matches!(&replies[0], Reply::Ops(r) if matches!(r[..], [Reply::Op { err: 0, .. }, Reply::Op { err: 0, .. }]))
    );
    assert!(matches!(replies[1], Reply::Op { err: err::NODE_EXISTS, .. }), "b's create comes after a's");
    assert!(matches!(replies[2], Reply::Refused { err: err::BAD_ARGUMENTS }));
    assert!(matches!(replies[3], Reply::Op { err: err::SESSION_EXPIRED, .. }));
    w.watch_events();
    w.op(b, Request::SetData { path: "/x".into(), data: Vec::new(), version: -1 });
    assert_eq!(
        w.watch_events(),
        vec![(a, event::NODE_DATA_CHANGED, "/x".to_string())],
        "the watch set inside the batch"
    );
}

#[test]
fn a_pinned_session_stays_with_its_creator_even_against_its_password() {
    let mut w = World::new();
    let shim = secret(1);
    let session = match w.run(FE_A, connect_with(&shim, true)) {
        Reply::Session { id, .. } => id,
        other => panic!("{other:?}"),
    };
    // Even a front end shown the password (the shim's secret leaked) cannot take it.
    let taken = w.run(FE_B, attach_with(FE_B, session, &shim, &secret(2)));
    assert_eq!(taken, Reply::Refused { err: err::SESSION_MOVED });
    // Its creator may come back to it (a restarted shim of the same identity).
    let back = w.run(FE_A | (3 << 40), attach_with(FE_A, session, &shim, &secret(3)));
    assert!(matches!(back, Reply::Session { id, .. } if id == session), "{back:?}");
    // Unpinned sessions move between front ends, as ZooKeeper clients need.
    let free = match w.run(FE_A, connect_with(&secret(4), false)) {
        Reply::Session { id, .. } => id,
        other => panic!("{other:?}"),
    };
    let moved = w.run(FE_B, attach_with(FE_B, free, &secret(4), &secret(5)));
    assert!(matches!(moved, Reply::Session { .. }), "{moved:?}");
}

/// A Byzantine node's front end knows every session id and sees every ordered command,
/// but only the front ends a client connected through see its password.
#[test]
fn no_front_end_takes_or_keeps_alive_a_session_whose_password_it_was_not_shown() {
    let mut w = World::new();
    let (k0, k1, k2) = (secret(10), secret(11), secret(12));
    let s = match w.run(FE_A, connect_with(&k0, false)) {
        Reply::Session { id, .. } => id,
        other => panic!("{other:?}"),
    };
    w.create(s, "/lock", 1).expect("ephemeral");
    // FE_B guesses.
    assert_eq!(
        w.run(FE_B, attach_with(FE_B, s, &secret(99), &secret(98))),
        Reply::Refused { err: err::SESSION_EXPIRED }
    );
    // The client moves to FE_C (its node died), showing k0; FE_C hands it k1.
    let to_c = attach_with(FE_C, s, &k0, &k1);
    assert!(matches!(w.run(FE_C, to_c.clone()), Reply::Session { .. }));
    // FE_B replays FE_C's ordered command as its own: it names FE_C, not FE_B.
    assert_eq!(w.run(FE_B, to_c), Reply::Refused { err: err::SESSION_EXPIRED });
    // FE_C heard from the client after the handshake: its touch retires k0, so FE_A,
    // which saw k0, cannot follow the client.
    w.run(FE_C, Command::Touch { sessions: vec![s] });
    assert_eq!(w.run(FE_A, attach_with(FE_A, s, &k0, &secret(97))), Reply::Refused { err: err::SESSION_EXPIRED });
    // The client's own password still works anywhere.
    assert!(matches!(w.run(FE_D, attach_with(FE_D, s, &k1, &k2)), Reply::Session { .. }));
    // The client goes silent. FE_B keeps touching the session, as FE_A (its first front
    // end) does: neither holds it, so it expires a timeout after FE_D's attach.
    let attached = w.time;
    while w.time < attached + 6_000 {
        w.run(FE_B, Command::Touch { sessions: vec![s] });
        w.run(FE_A, Command::Touch { sessions: vec![s] });
        w.tick(w.time + 500);
    }
    w.tick(w.time + 500);
    assert_eq!(w.coord.sessions(), 0, "touches of front ends that do not hold a session keep nothing alive");
    let other = w.connect(FE_A);
    assert!(w.stat(other, "/lock").is_none(), "its ephemeral went with it");
}

/// A move is confirmed only once the client spoke through its new front end, so a
/// client whose ConnectResponse was lost comes back with the password it holds.
#[test]
fn a_client_that_missed_its_new_password_attaches_with_the_old_one() {
    let mut w = World::new();
    let (k0, k1, k2, k3) = (secret(20), secret(21), secret(22), secret(23));
    let s = match w.run(FE_A, connect_with(&k0, false)) {
        Reply::Session { id, .. } => id,
        other => panic!("{other:?}"),
    };
    // FE_C ordered the attach, then died before its reply reached the client.
    assert!(matches!(w.run(FE_C, attach_with(FE_C, s, &k0, &k1)), Reply::Session { .. }));
    // The client tries FE_D with k0: still good, and FE_D hands it k2.
    assert!(matches!(w.run(FE_D, attach_with(FE_D, s, &k0, &k2)), Reply::Session { .. }));
    // This time it got k2 but moved on before FE_D heard from it: k2 attaches, and once
    // it has, k0 is gone (the client showed it received a later password).
    assert!(matches!(w.run(FE_B, attach_with(FE_B, s, &k2, &k3)), Reply::Session { .. }));
    assert_eq!(w.run(FE_A, attach_with(FE_A, s, &k0, &secret(96))), Reply::Refused { err: err::SESSION_EXPIRED });
    assert_eq!(w.run(FE_C, attach_with(FE_C, s, &k1, &secret(95))), Reply::Refused { err: err::SESSION_EXPIRED });
    // k2 still attaches (k3 may have been lost too) until FE_B confirms k3.
    w.run(FE_B, Command::Touch { sessions: vec![s] });
    assert_eq!(w.run(FE_D, attach_with(FE_D, s, &k2, &secret(94))), Reply::Refused { err: err::SESSION_EXPIRED });
    assert!(matches!(w.run(FE_A, attach_with(FE_A, s, &k3, &secret(93))), Reply::Session { .. }));
}

#[test]
fn after_an_outage_sessions_get_a_whole_timeout_again_instead_of_expiring_at_once() {
    let mut w = World::new();
    let s = w.connect(FE_A);
    w.create(s, "/leader", 1).expect("ephemeral");
    // Ticks every 500 ms while the cluster is up: the session is touched, it lives.
    for t in [1_500, 2_000, 2_500] {
        w.run(FE_A, Command::Touch { sessions: vec![s] });
        w.tick(t);
    }
    // The cluster is down for a minute: no tick, no touch. The first tick after it must
    // not expire a client that could not reach anyone.
    w.tick(62_500);
    assert_eq!(w.coord.sessions(), 1, "the session survived the outage");
    assert!(w.stat(s, "/leader").is_some());
    // But a client that does not come back within its timeout is expired as usual.
    for _ in 0..11 {
        w.tick(w.time + 500);
    }
    assert_eq!(w.coord.sessions(), 1, "not before its timeout");
    w.tick(w.time + 500);
    w.tick(w.time + 500);
    assert_eq!(w.coord.sessions(), 0, "expired a timeout after the outage");
}

#[test]
fn batched_reads_are_answered_read_only_and_a_batch_stays_within_its_reply_budget() {
    use keel_coord::coord::{BATCH_REPLY_MAX, RETRY_ALONE};
    let mut w = World::new();
    let s = w.connect(FE_A);
    let big = vec![7u8; 200 * 1024];
    let create =
        Request::Create { opcode: op::CREATE, path: "/big".into(), data: big, acl: Acl::open(), flags: 0, ttl: -1 };
    assert_eq!(w.op(s, create).0, err::OK);
    let read = || Command::Op { session: s, request: Request::GetData { path: "/big".into(), watch: false } };
    let batch = Command::Batch((0..5).map(|_| read()).collect());
    let ctx = ReadCtx { client: ClientId(FE_A), executed: Seq(1), time: 0 };
    let unordered = Reply::decode(&w.coord.execute_read_only(&batch.encode(), &ctx).expect("a read-only batch"));
    let ordered = w.run(FE_A, batch);
    assert_eq!(unordered.as_ref(), Some(&ordered), "read-only answers equal ordered ones");
    let Reply::Batch(replies) = ordered else { panic!("{ordered:?}") };
    // 200 KiB each: two fit in the 512 KiB budget, the rest are sent back to retry alone.
    let answered = replies.iter().filter(|r| matches!(r, Reply::Op { err: 0, .. })).count();
    assert_eq!(answered, BATCH_REPLY_MAX / (200 * 1024));
    assert!(replies[answered..].iter().all(|r| *r == Reply::Refused { err: RETRY_ALONE }));
    // A read whose reply would take the batch past the budget waits, however little
    // came before it: 200 KiB and then 1,000,000 bytes would break Keel's 1 MiB bound.
    let huge = vec![9u8; 1_000_000];
    let create =
        Request::Create { opcode: op::CREATE, path: "/huge".into(), data: huge, acl: Acl::open(), flags: 0, ttl: -1 };
    assert_eq!(w.op(s, create).0, err::OK);
    let huge_read = Command::Op { session: s, request: Request::GetData { path: "/huge".into(), watch: false } };
    let pair = Command::Batch(vec![read(), huge_read.clone()]);
    let unordered = w.coord.execute_read_only(&pair.encode(), &ctx).expect("a read-only batch");
    assert!(unordered.len() <= keel_core::codec::OP_BYTES_MAX, "{} bytes", unordered.len());
    let Some(Reply::Batch(replies)) = Reply::decode(&unordered) else { panic!("a batch reply") };
    assert!(matches!(replies[0], Reply::Op { err: 0, .. }));
    assert_eq!(replies[1], Reply::Refused { err: RETRY_ALONE });
    // Alone, it is answered (it is the first).
    let alone = w.coord.execute_read_only(&Command::Batch(vec![huge_read]).encode(), &ctx).expect("read-only");
    assert!(matches!(Reply::decode(&alone), Some(Reply::Batch(r)) if matches!(r[0], Reply::Op { err: 0, .. })));
    // A batch with a write in it is not read-only.
    let mixed = Command::Batch(vec![read(), Command::Op { session: s, request: Request::Sync { path: "/".into() } }]);
    assert_eq!(w.coord.execute_read_only(&mixed.encode(), &ctx), None);
}

/// A front end sends a session's writes with the reads after them as one `Ops`: the
/// reads see the writes, and those past the reply budget (counted across a group
/// commit's whole batch) come back `RETRY_ALONE`, to be sent again after it.
#[test]
fn reads_after_writes_in_one_ops_see_them_within_the_reply_budget() {
    use keel_coord::coord::RETRY_ALONE;
    let mut w = World::new();
    let s = w.connect(FE_A);
    let big = |p: &str| Request::Create {
        opcode: op::CREATE,
        path: p.into(),
        data: vec![1u8; 200 * 1024],
        acl: Acl::open(),
        flags: 0,
        ttl: -1,
    };
    let get = |p: &str| Request::GetData { path: p.into(), watch: false };
    let set = Request::SetData { path: "/big".into(), data: vec![2u8; 200 * 1024], version: -1 };
    let exists = Request::Exists { path: "/big".into(), watch: false };
    let ops =
        Command::Ops { session: s, requests: vec![big("/big"), set, get("/big"), get("/big"), get("/big"), exists] };
    let Reply::Ops(replies) = w.run(FE_A, ops) else { panic!("an Ops reply") };
    assert_eq!(replies.len(), 6);
    assert!(replies[..2].iter().all(|r| matches!(r, Reply::Op { err: 0, .. })), "{:?}", &replies[..2]);
    for r in &replies[2..4] {
        let Reply::Op { err: 0, body, .. } = r else { panic!("a read answered: {r:?}") };
        let data = Reader::new(body).buffer().expect("data");
        assert!(data.iter().all(|b| *b == 2), "the read sees the setData before it");
    }
    assert_eq!(replies[4], Reply::Refused { err: RETRY_ALONE }, "past 512 KiB");
    // A small read after a refused one would fit, but it is refused too: answered here it
    // would come from an older state than the refused read, answered later, alone.
    assert_eq!(replies[5], Reply::Refused { err: RETRY_ALONE }, "after a refused read");
    // Two sessions' Ops in one group commit share the budget.
    let t = w.connect(FE_A);
    let one = |session| Command::Ops {
        session,
        requests: vec![Request::Sync { path: "/".into() }, get("/big"), get("/big")],
    };
    let Reply::Batch(replies) = w.run(FE_A, Command::Batch(vec![one(s), one(t)])) else { panic!("a batch") };
    let refused = |r: &Reply| match r {
        Reply::Ops(rs) => rs.iter().filter(|r| **r == Reply::Refused { err: RETRY_ALONE }).count(),
        other => panic!("{other:?}"),
    };
    assert_eq!((refused(&replies[0]), refused(&replies[1])), (0, 2), "{replies:?}");
    assert!(w.run(FE_A, Command::Batch(vec![one(s), one(t)])).encode().len() <= keel_core::codec::OP_BYTES_MAX);
}

/// With quorum reads a front end also sends the reads queued before a write in its
/// `Ops`: they see the state before it. A read refused for room refuses everything
/// after it unexecuted, writes included, so the front end can send the rest again in
/// order: a write run here after a read answered later would reorder the session.
#[test]
fn reads_before_a_write_in_one_ops_and_a_refused_one_holds_back_the_write() {
    use keel_coord::coord::RETRY_ALONE;
    let mut w = World::new();
    let s = w.connect(FE_A);
    let create = Request::Create {
        opcode: op::CREATE,
        path: "/big".into(),
        data: vec![1u8; 200 * 1024],
        acl: Acl::open(),
        flags: 0,
        ttl: -1,
    };
    assert_eq!(w.op(s, create).0, err::OK);
    let get = || Request::GetData { path: "/big".into(), watch: false };
    let set = |b: u8| Request::SetData { path: "/big".into(), data: vec![b; 200 * 1024], version: -1 };
    let data = |r: &Reply| match r {
        Reply::Op { err: 0, body, .. } => Reader::new(body).buffer().expect("data")[0],
        other => panic!("a read answered: {other:?}"),
    };
    // Room for all: the read before the write sees 1, the one after it 2.
    let Reply::Ops(replies) = w.run(FE_A, Command::Ops { session: s, requests: vec![get(), set(2), get()] }) else {
        panic!("an Ops reply")
    };
    assert_eq!((data(&replies[0]), data(&replies[2])), (1, 2));
    // The third read has no room: it, the write after it and the read after that are
    // refused, and the write did not happen.
    let requests = vec![get(), get(), get(), set(3), get()];
    let Reply::Ops(replies) = w.run(FE_A, Command::Ops { session: s, requests }) else { panic!("an Ops reply") };
    assert_eq!((data(&replies[0]), data(&replies[1])), (2, 2));
    assert!(replies[2..].iter().all(|r| *r == Reply::Refused { err: RETRY_ALONE }), "{:?}", &replies[2..]);
    let (e, body) = w.op(s, get());
    assert_eq!((e, Reader::new(&body).buffer().expect("data")[0]), (err::OK, 2), "setData 3 was not executed");
}

/// `/zookeeper/config` lists the front ends that announce themselves, as a ZooKeeper
/// ensemble's dynamic configuration; it changes (and its data watch fires) when one
/// comes or goes, and one front end cannot take another's entry while it is fresh.
#[test]
fn zookeeper_config_lists_the_announced_front_ends_and_follows_them() {
    let mut w = World::new();
    let s = w.connect(FE_A);
    let config = |w: &mut World| match w.op(s, Request::GetData { path: "/zookeeper/config".into(), watch: true }) {
        (0, body) => String::from_utf8(Reader::new(&body).buffer().expect("data")).expect("text"),
        (e, _) => panic!("getData /zookeeper/config: {e}"),
    };
    assert_eq!(config(&mut w), "", "nothing announced yet");
    assert_eq!(w.run(FE_A, announce(0, "127.0.0.1:2181")), Reply::Done);
    assert_eq!(w.run(FE_B, announce(1, "10.0.0.2:2182")), Reply::Done);
    let text = config(&mut w);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], "server.0=127.0.0.1:7100:7104:participant;127.0.0.1:2181");
    assert_eq!(lines[1], "server.1=10.0.0.2:7100:7104:participant;10.0.0.2:2182");
    assert!(lines[2].starts_with("version="), "{text}");
    let watched =
        w.pushes.iter().filter(|(_, p)| matches!(p, Push::Watch { path, .. } if path == "/zookeeper/config")).count();
    assert!(watched >= 1, "the data watch fired on the change: {:?}", w.pushes);
    // A repeat changes nothing; another identity cannot take node 0 while it is fresh.
    let before = w.stat(s, "/zookeeper/config").expect("stat").mzxid;
    assert_eq!(w.run(FE_A, announce(0, "127.0.0.1:2181")), Reply::Done);
    assert_eq!(w.stat(s, "/zookeeper/config").expect("stat").mzxid, before, "a repeat is not a change");
    assert_eq!(w.run(FE_B, announce(0, "10.6.6.6:2181")), Reply::Refused { err: err::NO_AUTH });
    assert_eq!(w.run(FE_A, announce(2, "not an address")), Reply::Refused { err: err::BAD_ARGUMENTS });
    // Node 1 stops announcing (removed, or down): it leaves the list at a tick past the
    // expiry; node 0 announces every 5 s. (Time moves by ticks: a jump would read as an
    // outage, after which every entry starts afresh.)
    let last = w.time;
    let mut t = w.time;
    while t < last + keel_coord::coord::SERVER_EXPIRE_MS {
        assert!(config(&mut w).contains("server.1="), "node 1 listed until its entry expires (at {t})");
        t += 1_000;
        w.tick(t);
        w.run(FE_A, Command::Touch { sessions: vec![s] });
        if t.is_multiple_of(5_000) {
            assert_eq!(w.run(FE_A, announce(0, "127.0.0.1:2181")), Reply::Done);
        }
    }
    let text = config(&mut w);
    assert!(text.starts_with("server.0=127.0.0.1:7100:7104:participant;127.0.0.1:2181\nversion="), "{text}");
    // Ports that ZooKeeper's own parser refuses are refused here.
    let same = Command::Announce { node: 3, addr: "127.0.0.1:2181".into(), peer_port: 7100, metrics_port: 7100 };
    assert_eq!(w.run(FE_A, same), Reply::Refused { err: err::BAD_ARGUMENTS });
    // Any identity may announce, so the list is bounded: past it, new ids are refused.
    for node in 10..(10 + keel_coord::coord::SERVERS_MAX as u32) {
        w.run(FE_B, announce(node, "10.0.0.9:2181"));
    }
    assert_eq!(w.run(FE_B, announce(100_000, "10.0.0.9:2181")), Reply::Refused { err: err::BAD_ARGUMENTS });
    let listed = config(&mut w).lines().filter(|l| l.starts_with("server.")).count();
    assert_eq!(listed, keel_coord::coord::SERVERS_MAX, "bounded");
    // Clients cannot write it.
    let set = Request::SetData { path: "/zookeeper/config".into(), data: b"x".to_vec(), version: -1 };
    assert_eq!(w.op(s, set).0, err::NO_AUTH);
}

/// Node `node`'s front end announcing client address `addr` (peer port 7100, metrics
/// 7104).
fn announce(node: u32, addr: &str) -> Command {
    Command::Announce { node, addr: addr.into(), peer_port: 7100, metrics_port: 7104 }
}

#[test]
fn a_watched_read_names_the_zxid_it_was_ordered_at_and_a_plain_read_none() {
    // A front end holds a session's watch events until the replies executed before
    // them are written: it needs the watched read's place in the zxid order. Plain reads
    // stay at 0, equal to their read-only answers from nodes at other zxids.
    let mut w = World::new();
    let s = w.connect(FE_A);
    w.create(s, "/z", 0).expect("created");
    let after_create = match w.op(s, Request::Sync { path: "/".into() }) {
        (err::OK, _) => w.coord.zxid(),
        other => panic!("{other:?}"),
    };
    let requests = vec![
        Request::GetData { path: "/z".into(), watch: true },
        Request::GetData { path: "/z".into(), watch: false },
        Request::Exists { path: "/none".into(), watch: true },
    ];
    let Reply::Ops(replies) = w.run(FE_A, Command::Ops { session: s, requests }) else { panic!("not Ops") };
    let zxids: Vec<i64> = replies.iter().map(|r| if let Reply::Op { zxid, .. } = r { *zxid } else { -1 }).collect();
    assert!(after_create > 0);
    assert_eq!(zxids, [after_create, 0, after_create]);
}

#[test]
fn a_session_holds_at_most_its_bound_of_watches_however_it_registers_them() {
    use keel_coord::coord::WATCHES_PER_SESSION_MAX;
    let mut w = World::new();
    let s = w.connect(FE_A);
    let other = w.connect(FE_A);
    let add = |w: &mut World, session: i64, path: String| w.op(session, Request::AddWatch { path, mode: 0 }).0;
    for i in 0..WATCHES_PER_SESSION_MAX {
        assert_eq!(add(&mut w, s, format!("/w{i}")), err::OK);
    }
    // The same watch again is no new one; a new one is refused, with ZooKeeper's code.
    assert_eq!(add(&mut w, s, "/w0".into()), err::OK);
    assert_eq!(add(&mut w, s, "/one-more".into()), err::QUOTA_EXCEEDED);
    // setWatches and watched reads register nothing past the bound either.
    let paths: Vec<String> = (0..50).map(|i| format!("/set{i}")).collect();
    w.op(
        s,
        Request::SetWatches {
            relative_zxid: w.coord.zxid(),
            data: Vec::new(),
            exist: paths.clone(),
            child: Vec::new(),
            persistent: paths.clone(),
            recursive: paths,
        },
    );
    assert_eq!(w.op(s, Request::Exists { path: "/read".into(), watch: true }).0, err::NO_NODE);
    assert_eq!(w.create(other, "/read", 0), Ok("/read".into()));
    assert_eq!(w.create(other, "/set0", 0), Ok("/set0".into()));
    assert!(w.watch_events().iter().all(|(session, _, _)| *session != s), "no watch past the bound fired");
    // Other sessions are not limited by this one; removing a watch makes room.
    assert_eq!(add(&mut w, other, "/one-more".into()), err::OK);
    assert_eq!(w.op(s, Request::RemoveWatches { path: "/w1".into(), kind: 4 }).0, err::OK);
    assert_eq!(add(&mut w, s, "/one-more".into()), err::OK);
}
