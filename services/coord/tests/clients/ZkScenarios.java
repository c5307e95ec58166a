// The Apache ZooKeeper Java client (3.9.x, unmodified, from Maven Central) against a
// Keel coord cluster. usage: java ZkScenarios HOSTS PIDS
// PIDS are the processes of the nodes HOSTS lists, in the same order (the test started
// them): the node one client is connected to is killed with -9 to check that the
// session and a watch move to another node (setWatches fires what changed meanwhile).
// Exit 0 only if every check held.
import java.nio.charset.StandardCharsets;
import java.util.*;
import java.util.concurrent.*;
import org.apache.zookeeper.*;
import org.apache.zookeeper.data.*;

public class ZkScenarios {
    static final String R = "/java-" + ProcessHandle.current().pid() + "-" + System.currentTimeMillis();

    static void check(boolean ok, String what) {
        if (!ok) throw new AssertionError(what);
    }

    static ZooKeeper connect(String hosts, Watcher w) throws Exception {
        CountDownLatch up = new CountDownLatch(1);
        ZooKeeper zk = new ZooKeeper(hosts, 10000, e -> {
            if (e.getState() == Watcher.Event.KeeperState.SyncConnected && e.getType() == Watcher.Event.EventType.None) up.countDown();
            if (w != null) w.process(e);
        });
        check(up.await(30, TimeUnit.SECONDS), "connected to " + hosts);
        return zk;
    }

    static byte[] b(String s) { return s.getBytes(StandardCharsets.UTF_8); }

    /// A client whose node was killed sees ConnectionLoss for what it had in flight and
    /// retries once it reconnected elsewhere (what every ZooKeeper application does).
    static <T> T retry(Callable<T> call) throws Exception {
        for (int attempt = 0; ; attempt++) {
            try {
                return call.call();
            } catch (KeeperException.ConnectionLossException e) {
                if (attempt == 20) throw e;
                Thread.sleep(500);
            }
        }
    }

    /// ZooKeeper's reads are sequentially consistent, not linearizable: a session sees
    /// another session's completed write only after its own server has applied it, which
    /// sync guarantees. Every cross-session read below syncs first, as an application
    /// must (with coord's local reads a lagging node answers exactly as ZooKeeper would).
    static void syncFirst(ZooKeeper zk, String path) throws Exception {
        CountDownLatch done = new CountDownLatch(1);
        int[] rc = {-1};
        zk.sync(path, (code, p, ctx) -> { rc[0] = code; done.countDown(); }, null);
        check(done.await(30, TimeUnit.SECONDS), "sync " + path + " answered");
        // A connection loss surfaces as its exception, so retry() can wait it out.
        if (rc[0] != 0) throw KeeperException.create(KeeperException.Code.get(rc[0]), path);
    }

    public static void main(String[] args) throws Exception {
        String hosts = args[0];
        String[] list = hosts.split(",");
        String[] pids = args[1].split(",");
        List<String> reversed = new ArrayList<>(Arrays.asList(list));
        Collections.reverse(reversed);
        ZooKeeper zk = connect(hosts, null);
        ZooKeeper other = connect(String.join(",", reversed), null);
        List<ACL> open = ZooDefs.Ids.OPEN_ACL_UNSAFE;

        // Every create mode, create2's Stat, sequential numbering.
        zk.create(R, b("root"), open, CreateMode.PERSISTENT);
        Stat st = new Stat();
        zk.create(R + "/p", b("x"), open, CreateMode.PERSISTENT, st);
        check(st.getVersion() == 0 && st.getDataLength() == 1 && st.getCzxid() > 0, "create2 stat " + st);
        String s0 = zk.create(R + "/s-", new byte[0], open, CreateMode.PERSISTENT_SEQUENTIAL);
        String s1 = zk.create(R + "/s-", new byte[0], open, CreateMode.EPHEMERAL_SEQUENTIAL);
        check(s0.equals(R + "/s-0000000001") && s1.equals(R + "/s-0000000002"), "sequential " + s0 + " " + s1);
        zk.create(R + "/e", new byte[0], open, CreateMode.EPHEMERAL);
        zk.create(R + "/c", new byte[0], open, CreateMode.CONTAINER);
        zk.create(R + "/t", new byte[0], open, CreateMode.PERSISTENT_WITH_TTL, null, 60000);
        try {
            zk.create(R + "/e/child", new byte[0], open, CreateMode.PERSISTENT);
            check(false, "a child of an ephemeral");
        } catch (KeeperException.NoChildrenForEphemeralsException expected) { }
        Stat parent = new Stat();
        List<String> kids = zk.getChildren(R, false, parent);
        check(kids.size() == 6 && parent.getNumChildren() == 6, "getChildren2 " + kids + " " + parent);
        check(zk.getAllChildrenNumber(R) == 6, "getAllChildrenNumber");
        List<String> mine = zk.getEphemerals(R);
        Collections.sort(mine);
        check(mine.equals(Arrays.asList(R + "/e", s1)), "getEphemerals " + mine);

        // A container goes once its last child does; a TTL node once its TTL passed
        // without a change (both at the cluster's agreed-time ticks, as ZooKeeper's
        // container manager does them on its own schedule).
        zk.create(R + "/box", new byte[0], open, CreateMode.CONTAINER);
        zk.create(R + "/box/item", new byte[0], open, CreateMode.PERSISTENT);
        zk.create(R + "/short", new byte[0], open, CreateMode.PERSISTENT_WITH_TTL, null, 1000);
        zk.delete(R + "/box/item", -1);
        for (String gone : new String[] {R + "/box", R + "/short"}) {
            long until = System.currentTimeMillis() + 20000;
            while (zk.exists(gone, false) != null) {
                check(System.currentTimeMillis() < until, gone + " still there after 20 s");
                Thread.sleep(200);
            }
        }
        check(zk.exists(R + "/c", false) != null, "a container that never had a child stays");
        check(zk.exists(R + "/t", false) != null, "a TTL node within its TTL stays");

        // Versions, exists, delete, sync.
        zk.setData(R + "/p", b("y"), 0);
        try { zk.setData(R + "/p", b("z"), 0); check(false, "stale version"); } catch (KeeperException.BadVersionException expected) { }
        check(zk.exists(R + "/nope", false) == null, "exists on a missing node");
        try { zk.delete(R, -1); check(false, "deleted a parent"); } catch (KeeperException.NotEmptyException expected) { }
        CountDownLatch synced = new CountDownLatch(1);
        zk.sync(R, (rc, path, ctx) -> synced.countDown(), null);
        check(synced.await(10, TimeUnit.SECONDS), "sync");

        // multi: all or nothing, with each op's result; multiRead.
        try {
            zk.multi(Arrays.asList(Op.create(R + "/m", new byte[0], open, CreateMode.PERSISTENT), Op.check(R + "/p", 7), Op.delete(R + "/p", -1)));
            check(false, "a failed multi succeeded");
        } catch (KeeperException.BadVersionException e) {
            List<OpResult> rs = e.getResults();
            check(((OpResult.ErrorResult) rs.get(0)).getErr() == 0, "ops before: OK");
            check(((OpResult.ErrorResult) rs.get(1)).getErr() == KeeperException.Code.BADVERSION.intValue(), "the failing op");
            check(((OpResult.ErrorResult) rs.get(2)).getErr() == KeeperException.Code.RUNTIMEINCONSISTENCY.intValue(), "ops after");
        }
        check(zk.exists(R + "/m", false) == null, "nothing of a failed multi");
        List<OpResult> ok = zk.multi(Arrays.asList(Op.create(R + "/m", new byte[0], open, CreateMode.PERSISTENT), Op.setData(R + "/p", b("w"), -1)));
        check(ok.get(0) instanceof OpResult.CreateResult && ok.get(1) instanceof OpResult.SetDataResult, "multi results " + ok);
        List<OpResult> reads = zk.multi(Arrays.asList(Op.getData(R + "/p"), Op.getChildren(R + "/m"), Op.getData(R + "/none")));
        check(new String(((OpResult.GetDataResult) reads.get(0)).getData(), StandardCharsets.UTF_8).equals("w"), "multiRead data");
        check(((OpResult.ErrorResult) reads.get(2)).getErr() == KeeperException.Code.NONODE.intValue(), "multiRead error");

        // ACLs: digest, enforced for another session; getACL/setACL with versions.
        zk.addAuthInfo("digest", b("alice:secret"));
        zk.create(R + "/private", b("s"), ZooDefs.Ids.CREATOR_ALL_ACL, CreateMode.PERSISTENT);
        syncFirst(other, R);
        try { other.getData(R + "/private", false, null); check(false, "read without auth"); } catch (KeeperException.NoAuthException expected) { }
        Stat aclStat = new Stat();
        List<ACL> acl = zk.getACL(R + "/private", aclStat);
        check(acl.size() == 1 && acl.get(0).getId().getScheme().equals("digest"), "getACL " + acl);
        zk.setACL(R + "/private", open, aclStat.getAversion());
        syncFirst(other, R);
        check(new String(other.getData(R + "/private", false, null), StandardCharsets.UTF_8).equals("s"), "readable after setACL");

        // Watches of each kind.
        BlockingQueue<WatchedEvent> events = new LinkedBlockingQueue<>();
        zk.getData(R + "/p", events::add, null);
        zk.getChildren(R + "/m", events::add);
        zk.exists(R + "/later", events::add);
        other.setData(R + "/p", b("v"), -1);
        other.create(R + "/m/kid", new byte[0], open, CreateMode.PERSISTENT);
        other.create(R + "/later", new byte[0], open, CreateMode.PERSISTENT);
        Set<String> seen = new HashSet<>();
        for (int i = 0; i < 3; i++) {
            WatchedEvent e = events.poll(10, TimeUnit.SECONDS);
            check(e != null, "watch event " + i + " of 3, seen " + seen);
            seen.add(e.getType() + " " + e.getPath());
        }
        check(seen.equals(new HashSet<>(Arrays.asList("NodeDataChanged " + R + "/p", "NodeChildrenChanged " + R + "/m", "NodeCreated " + R + "/later"))), "events " + seen);
        BlockingQueue<WatchedEvent> persistent = new LinkedBlockingQueue<>();
        zk.addWatch(R + "/tree", persistent::add, AddWatchMode.PERSISTENT_RECURSIVE);
        other.create(R + "/tree", new byte[0], open, CreateMode.PERSISTENT);
        other.create(R + "/tree/a", new byte[0], open, CreateMode.PERSISTENT);
        other.setData(R + "/tree/a", b("1"), -1);
        for (String want : new String[] {"NodeCreated " + R + "/tree", "NodeCreated " + R + "/tree/a", "NodeDataChanged " + R + "/tree/a"}) {
            WatchedEvent e = persistent.poll(10, TimeUnit.SECONDS);
            check(e != null && (e.getType() + " " + e.getPath()).equals(want), "persistent recursive: wanted " + want + ", got " + e);
        }
        zk.removeAllWatches(R + "/tree", Watcher.WatcherType.Any, false);
        // Removed means silent: a change under it fires nothing (the client itself may
        // tell the watcher of the removal).
        other.create(R + "/tree/a/b", new byte[0], open, CreateMode.PERSISTENT);
        for (WatchedEvent e; (e = persistent.poll(1, TimeUnit.SECONDS)) != null; ) {
            check(e.getType() != Watcher.Event.EventType.NodeCreated, "an event after removeWatches: " + e);
        }
        // getAllChildrenNumber counts every descendant, not just the children.
        syncFirst(zk, R);
        check(zk.getAllChildrenNumber(R + "/tree") == 2, "getAllChildrenNumber of a nested tree");
        // A persistent (not recursive) watch: the node's own changes and its child list,
        // every time.
        BlockingQueue<WatchedEvent> plain = new LinkedBlockingQueue<>();
        zk.addWatch(R + "/pw", plain::add, AddWatchMode.PERSISTENT);
        other.create(R + "/pw", new byte[0], open, CreateMode.PERSISTENT);
        other.setData(R + "/pw", b("1"), -1);
        other.setData(R + "/pw", b("2"), -1);
        other.create(R + "/pw/x", new byte[0], open, CreateMode.PERSISTENT);
        other.setData(R + "/pw/x", b("not watched"), -1);
        for (String want : new String[] {"NodeCreated", "NodeDataChanged", "NodeDataChanged", "NodeChildrenChanged"}) {
            WatchedEvent e = plain.poll(10, TimeUnit.SECONDS);
            check(e != null && e.getType().toString().equals(want) && e.getPath().equals(R + "/pw"), "persistent: wanted " + want + ", got " + e);
        }
        check(plain.poll(1, TimeUnit.SECONDS) == null, "a persistent watch fired for a child's data");
        zk.removeAllWatches(R + "/pw", Watcher.WatcherType.Any, false);
        // ip ACLs: this client connects from 127.0.0.1.
        zk.create(R + "/ip-local", b("l"), Collections.singletonList(new ACL(ZooDefs.Perms.ALL, new Id("ip", "127.0.0.0/8"))), CreateMode.PERSISTENT);
        zk.create(R + "/ip-far", b("f"), Collections.singletonList(new ACL(ZooDefs.Perms.ALL, new Id("ip", "10.9.9.9"))), CreateMode.PERSISTENT);
        syncFirst(other, R);
        check(new String(other.getData(R + "/ip-local", false, null), StandardCharsets.UTF_8).equals("l"), "ip ACL that matches");
        try { other.getData(R + "/ip-far", false, null); check(false, "read past an ip ACL"); } catch (KeeperException.NoAuthException expected) { }

        // The client's node dies: the session moves, and setWatches fires what changed.
        BlockingQueue<WatchedEvent> moved = new LinkedBlockingQueue<>();
        BlockingQueue<Watcher.Event.KeeperState> states = new LinkedBlockingQueue<>();
        ZooKeeper mover = connect(hosts, e -> { if (e.getType() == Watcher.Event.EventType.None) states.add(e.getState()); });
        mover.create(R + "/mover-eph", new byte[0], open, CreateMode.EPHEMERAL);
        mover.getData(R + "/p", moved::add, null);
        // A persistent watch live at the move makes the client re-register with setWatches2.
        BlockingQueue<WatchedEvent> movedPersistent = new LinkedBlockingQueue<>();
        mover.addWatch(R + "/pm", movedPersistent::add, AddWatchMode.PERSISTENT);
        long session = mover.getSessionId();
        // toString names the server: "... remoteserver:localhost/127.0.0.1:PORT ..."
        String where = mover.toString();
        long killPid = -1;
        for (int i = 0; i < list.length; i++) {
            if (where.contains(":" + list[i].split(":")[1] + " ")) killPid = Long.parseLong(pids[i]);
        }
        check(killPid > 0, "which node the client is on: " + where);
        System.out.println("killing the client's node, pid " + killPid);
        ProcessHandle.of(killPid).ifPresent(ProcessHandle::destroyForcibly);
        retry(() -> other.setData(R + "/p", b("while-away"), -1));
        Watcher.Event.KeeperState s;
        boolean disconnected = false;
        do {
            s = states.poll(30, TimeUnit.SECONDS);
            check(s != null, "reconnected");
            check(s != Watcher.Event.KeeperState.Expired, "the session expired");
            disconnected |= s == Watcher.Event.KeeperState.Disconnected;
        } while (!(disconnected && s == Watcher.Event.KeeperState.SyncConnected));
        check(mover.getSessionId() == session, "same session");
        // Every watcher also hears the connection's states (Disconnected, SyncConnected).
        WatchedEvent missed;
        do {
            missed = moved.poll(15, TimeUnit.SECONDS);
        } while (missed != null && missed.getType() == Watcher.Event.EventType.None);
        check(missed != null && missed.getType() == Watcher.Event.EventType.NodeDataChanged, "setWatches fired the change made meanwhile: " + missed);
        // The persistent watch still holds on the new node (ZooKeeper does not replay what
        // such a watch missed; a change after the move fires it).
        retry(() -> {
            try { return other.create(R + "/pm", new byte[0], open, CreateMode.PERSISTENT); }
            catch (KeeperException.NodeExistsException lostReply) { return R + "/pm"; }
        });
        WatchedEvent created;
        do {
            created = movedPersistent.poll(15, TimeUnit.SECONDS);
        } while (created != null && created.getType() == Watcher.Event.EventType.None);
        check(created != null && created.getType() == Watcher.Event.EventType.NodeCreated && created.getPath().equals(R + "/pm"), "the persistent watch after the move: " + created);
        retry(() -> { syncFirst(other, R); return null; });
        check(retry(() -> other.exists(R + "/mover-eph", false)) != null, "the ephemeral stayed");
        mover.close();
        retry(() -> { syncFirst(other, R); return null; });
        check(retry(() -> other.exists(R + "/mover-eph", false)) == null, "closeSession took the ephemeral");
        zk.close();
        other.close();
        System.out.println("all Java client scenarios passed");
    }
}
