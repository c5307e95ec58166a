// Apache Curator (5.9, unmodified, from Maven Central): the client library most ZooKeeper
// applications build on, against a Keel coord cluster. usage: java CuratorScenarios HOSTS PIDS
// PIDS are the processes of the nodes HOSTS lists, in the same order (the test started
// them): the first node is killed with -9 while clients contend for a lock, a semaphore
// and a counter, so each recipe must stay right across a session moving to another node.
// Exit 0 only if every check held.
//
// Curator uses what plain clients seldom do: protected ephemeral-sequential names it looks
// for again after a connection loss, transactions, persistent recursive watches
// (CuratorCache), one-shot watches on many nodes at once (TreeCache), containers for lock
// parents, and its ensemble tracker, which reads /zookeeper/config and reconnects to the
// addresses it finds there.
import java.nio.charset.StandardCharsets;
import java.util.*;
import java.util.concurrent.*;
import java.util.concurrent.atomic.*;
import org.apache.curator.framework.*;
import org.apache.curator.framework.api.transaction.*;
import org.apache.curator.framework.recipes.atomic.*;
import org.apache.curator.framework.recipes.barriers.*;
import org.apache.curator.framework.recipes.cache.*;
import org.apache.curator.framework.recipes.leader.*;
import org.apache.curator.framework.recipes.locks.*;
import org.apache.curator.framework.recipes.nodes.*;
import org.apache.curator.framework.recipes.shared.*;
import org.apache.curator.retry.*;
import org.apache.zookeeper.*;
import org.apache.zookeeper.data.*;

public class CuratorScenarios {
    static final String R = "/curator-" + ProcessHandle.current().pid() + "-" + System.currentTimeMillis();

    static void check(boolean ok, String what) {
        if (!ok) throw new AssertionError(what);
    }

    static byte[] b(String s) { return s.getBytes(StandardCharsets.UTF_8); }

    static String s(byte[] b) { return new String(b, StandardCharsets.UTF_8); }

    static final List<CuratorFramework> clients = new ArrayList<>();

    /// A client whose node list starts at `first` (so the clients spread over the nodes).
    static CuratorFramework client(String[] hosts, int first) throws Exception {
        List<String> order = new ArrayList<>();
        for (int i = 0; i < hosts.length; i++) order.add(hosts[(first + i) % hosts.length]);
        CuratorFramework c = CuratorFrameworkFactory.builder()
            .connectString(String.join(",", order))
            .sessionTimeoutMs(15000)
            .connectionTimeoutMs(10000)
            .retryPolicy(new ExponentialBackoffRetry(100, 29, 2000))
            .build();
        c.start();
        check(c.blockUntilConnected(30, TimeUnit.SECONDS), "connected to " + order);
        clients.add(c);
        return c;
    }

    /// Waits for `cond`, up to `seconds`.
    static void eventually(String what, int seconds, Callable<Boolean> cond) throws Exception {
        long until = System.nanoTime() + seconds * 1_000_000_000L;
        while (!cond.call()) {
            check(System.nanoTime() < until, what + " within " + seconds + " s");
            Thread.sleep(50);
        }
    }

    /// The tree under `path` with each node's owner: what a failed check leaves to read.
    static void dump(CuratorFramework c, String path) {
        try {
            Stat st = c.checkExists().forPath(path);
            System.out.println("  " + path + (st == null ? " (gone)" : " owner 0x" + Long.toHexString(st.getEphemeralOwner())
                + " pzxid 0x" + Long.toHexString(st.getPzxid()) + " cversion " + st.getCversion()));
            if (st == null) return;
            List<String> kids = new ArrayList<>(c.getChildren().forPath(path));
            Collections.sort(kids);
            for (String k : kids) dump(c, path + "/" + k);
        } catch (Exception e) {
            System.out.println("  " + path + ": " + e);
        }
    }

    public static void main(String[] args) throws Exception {
        String[] hosts = args[0].split(",");
        String[] pids = args[1].split(",");
        CuratorFramework a = client(hosts, 0);
        CuratorFramework b = client(hosts, 1);
        CuratorFramework c = client(hosts, 2);

        // Protected ephemeral-sequential create with parents: the name carries Curator's
        // _c_<guid>- prefix and the parents exist.
        String mine = a.create().creatingParentsIfNeeded().withProtection()
            .withMode(CreateMode.EPHEMERAL_SEQUENTIAL).forPath(R + "/deep/er/node-", b("v"));
        check(mine.startsWith(R + "/deep/er/_c_") && mine.matches(".*node-\\d{10}$"), "protected name " + mine);
        check(b.checkExists().forPath(R + "/deep/er") != null, "parents created");
        check(s(b.getData().forPath(mine)).equals("v"), "protected node's data");
        System.out.println("protected ephemeral-sequential create ok: " + mine);

        // Transactions: all or nothing, results per op.
        a.create().forPath(R + "/tx", b("0"));
        List<CuratorTransactionResult> results = a.transaction().forOperations(
            a.transactionOp().create().forPath(R + "/tx/one", b("1")),
            a.transactionOp().setData().withVersion(0).forPath(R + "/tx", b("1")),
            a.transactionOp().check().withVersion(1).forPath(R + "/tx"));
        check(results.size() == 3 && results.get(0).getForPath().equals(R + "/tx/one"), "transaction results " + results);
        try {
            a.transaction().forOperations(
                a.transactionOp().create().forPath(R + "/tx/two", b("2")),
                a.transactionOp().setData().withVersion(7).forPath(R + "/tx", b("2")));
            check(false, "a transaction with a bad version failed");
        } catch (KeeperException.BadVersionException expected) {
        }
        check(b.checkExists().forPath(R + "/tx/two") == null, "the failed transaction created nothing");
        check(s(b.getData().forPath(R + "/tx")).equals("1"), "the failed transaction set nothing");
        System.out.println("transactions ok");

        // CuratorCache: a persistent recursive watch; every create, change and delete
        // under the path reaches the listener, in order per node.
        ConcurrentLinkedQueue<String> seen = new ConcurrentLinkedQueue<>();
        CountDownLatch initialized = new CountDownLatch(1);
        a.create().forPath(R + "/cache", b("root"));
        CuratorCache cache = CuratorCache.build(b, R + "/cache");
        cache.listenable().addListener(CuratorCacheListener.builder()
            .forCreates(n -> seen.add("create " + n.getPath() + " " + s(n.getData())))
            .forChanges((old, n) -> seen.add("change " + n.getPath() + " " + s(n.getData())))
            .forDeletes(old -> seen.add("delete " + old.getPath()))
            .forInitialized(initialized::countDown)
            .build());
        cache.start();
        check(initialized.await(30, TimeUnit.SECONDS), "CuratorCache initialized");
        seen.clear();
        // One change at a time, each awaited: on an event Curator reads the node again,
        // so a change made before that read is folded into the event (ZooKeeper too).
        List<String> want = new ArrayList<>();
        List<Callable<Object>> steps = List.of(
            () -> a.create().forPath(R + "/cache/x", b("1")),
            () -> a.create().forPath(R + "/cache/x/y", b("2")),
            () -> c.setData().forPath(R + "/cache/x", b("3")),
            () -> c.delete().forPath(R + "/cache/x/y"));
        List<String> events = List.of("create " + R + "/cache/x 1", "create " + R + "/cache/x/y 2",
            "change " + R + "/cache/x 3", "delete " + R + "/cache/x/y");
        for (int i = 0; i < steps.size(); i++) {
            steps.get(i).call();
            want.add(events.get(i));
            eventually("CuratorCache saw " + want + " (saw " + seen + ")", 30, () -> seen.size() >= want.size());
        }
        check(new ArrayList<>(seen).equals(want), "CuratorCache events " + seen);
        check(cache.get(R + "/cache/x").map(d -> s(d.getData())).orElse("").equals("3"), "the cache holds the data");
        cache.close();
        System.out.println("CuratorCache ok");

        // TreeCache: one-shot data and child watches on every node of a tree, set again
        // at each event.
        a.create().creatingParentsIfNeeded().forPath(R + "/tree/a/b", b("b0"));
        TreeCache tree = TreeCache.newBuilder(c, R + "/tree").build();
        CountDownLatch treeReady = new CountDownLatch(1);
        tree.getListenable().addListener((cl, e) -> {
            if (e.getType() == TreeCacheEvent.Type.INITIALIZED) treeReady.countDown();
        });
        tree.start();
        check(treeReady.await(30, TimeUnit.SECONDS), "TreeCache initialized");
        b.setData().forPath(R + "/tree/a/b", b("b1"));
        b.create().forPath(R + "/tree/a/c", b("c0"));
        b.delete().forPath(R + "/tree/a/b");
        eventually("TreeCache follows the tree", 30, () -> tree.getCurrentData(R + "/tree/a/b") == null
            && tree.getCurrentData(R + "/tree/a/c") != null
            && s(tree.getCurrentData(R + "/tree/a/c").getData()).equals("c0"));
        b.setData().forPath(R + "/tree/a/c", b("c1"));
        eventually("TreeCache sees a change after re-arming its watch", 30,
            () -> s(tree.getCurrentData(R + "/tree/a/c").getData()).equals("c1"));
        tree.close();
        System.out.println("TreeCache ok");

        // Leader latch: exactly one leader; when it leaves, another takes over.
        List<LeaderLatch> latches = new ArrayList<>();
        for (CuratorFramework x : List.of(a, b, c)) {
            LeaderLatch l = new LeaderLatch(x, R + "/leader", "p" + latches.size());
            l.start();
            latches.add(l);
        }
        eventually("one leader", 30, () -> latches.stream().filter(LeaderLatch::hasLeadership).count() == 1);
        LeaderLatch first = latches.stream().filter(LeaderLatch::hasLeadership).findFirst().orElseThrow();
        check(first.getLeader().getId().equals(first.getId()), "the leader names itself " + first.getLeader());
        first.close();
        latches.remove(first);
        eventually("a new leader", 30, () -> latches.stream().filter(LeaderLatch::hasLeadership).count() == 1);
        for (LeaderLatch l : latches) l.close();
        System.out.println("leader latch ok: " + first.getId() + " led, then another");

        // Shared count: compare-and-set on a version.
        SharedCount count = new SharedCount(a, R + "/shared", 5);
        count.start();
        VersionedValue<Integer> v0 = count.getVersionedValue();
        check(count.trySetCount(v0, 6), "first set at the version read");
        check(!count.trySetCount(v0, 7), "a second set at the old version refused");
        SharedCount other = new SharedCount(b, R + "/shared", 0);
        other.start();
        eventually("the other client sees 6", 30, () -> other.getCount() == 6);
        count.close();
        other.close();
        System.out.println("shared count ok");

        // Double barrier: no one passes enter() until all three have arrived.
        ExecutorService pool = Executors.newCachedThreadPool();
        AtomicInteger inside = new AtomicInteger();
        List<Future<Boolean>> members = new ArrayList<>();
        for (CuratorFramework x : List.of(a, b, c)) {
            members.add(pool.submit(() -> {
                DistributedDoubleBarrier barrier = new DistributedDoubleBarrier(x, R + "/barrier", 3);
                check(barrier.enter(60, TimeUnit.SECONDS), "entered the barrier");
                boolean all = inside.incrementAndGet() <= 3;
                check(barrier.leave(60, TimeUnit.SECONDS), "left the barrier");
                return all;
            }));
        }
        for (Future<Boolean> f : members) check(f.get(90, TimeUnit.SECONDS), "barrier member");
        System.out.println("double barrier ok");

        // Contention across a kill -9 of the first node: a mutex-protected counter (no
        // update lost), a semaphore of two leases (never three holders) and an atomic
        // long (optimistic increments, none lost), each from clients spread over the nodes.
        a.create().forPath(R + "/counter", b("0"));
        int workers = 4;
        int rounds = 12;
        AtomicInteger holders = new AtomicInteger();
        AtomicInteger mostHolders = new AtomicInteger();
        AtomicInteger lockedNow = new AtomicInteger();
        List<Future<Integer>> work = new ArrayList<>();
        String[] step = new String[workers];
        CountDownLatch halfway = new CountDownLatch(workers);
        for (int w = 0; w < workers; w++) {
            CuratorFramework x = client(hosts, w);
            int me = w;
            System.out.println("worker " + me + ": session 0x"
                + Long.toHexString(x.getZookeeperClient().getZooKeeper().getSessionId()));
            work.add(pool.submit(() -> {
                InterProcessMutex mutex = new InterProcessMutex(x, R + "/lock");
                InterProcessSemaphoreV2 sem = new InterProcessSemaphoreV2(x, R + "/sem", 2);
                DistributedAtomicLong along = new DistributedAtomicLong(x, R + "/along", new RetryNTimes(200, 50));
                int increments = 0;
                for (int i = 0; i < rounds; i++) {
                    if (i == rounds / 2) halfway.countDown();
                    step[me] = "round " + i + " mutex";
                    check(mutex.acquire(120, TimeUnit.SECONDS), "mutex acquired");
                    try {
                        check(lockedNow.incrementAndGet() == 1, "one mutex holder at a time");
                        int n = Integer.parseInt(s(x.getData().forPath(R + "/counter")));
                        x.setData().forPath(R + "/counter", b(Integer.toString(n + 1)));
                        lockedNow.decrementAndGet();
                    } finally {
                        mutex.release();
                    }
                    step[me] = "round " + i + " semaphore";
                    Lease lease = sem.acquire(120, TimeUnit.SECONDS);
                    if (lease == null) {
                        System.out.println("worker " + me + " got no lease; workers at " + Arrays.toString(step));
                        dump(x, R + "/sem");
                    }
                    check(lease != null, "semaphore lease");
                    try {
                        int now = holders.incrementAndGet();
                        mostHolders.accumulateAndGet(now, Math::max);
                        Thread.sleep(20);
                        holders.decrementAndGet();
                    } finally {
                        sem.returnLease(lease);
                    }
                    step[me] = "round " + i + " atomic long";
                    AtomicValue<Long> r = along.increment();
                    if (r.succeeded()) increments++;
                }
                step[me] = "done";
                return increments;
            }));
        }
        check(halfway.await(180, TimeUnit.SECONDS), "workers halfway");
        long killPid = Long.parseLong(pids[0]);
        System.out.println("killing node 0, pid " + killPid);
        ProcessHandle.of(killPid).ifPresent(ProcessHandle::destroyForcibly);
        int increments = 0;
        long until = System.nanoTime() + 240_000_000_000L;
        for (Future<Integer> f : work) {
            try {
                increments += f.get(Math.max(1, until - System.nanoTime()), TimeUnit.NANOSECONDS);
            } catch (TimeoutException e) {
                System.out.println("workers stuck at " + Arrays.toString(step));
                dump(b, R);
                throw e;
            }
        }
        int counter = Integer.parseInt(s(b.getData().forPath(R + "/counter")));
        check(counter == workers * rounds, "mutex counter " + counter + " of " + workers * rounds);
        check(mostHolders.get() >= 1 && mostHolders.get() <= 2, "semaphore holders at most 2: " + mostHolders.get());
        long along = new DistributedAtomicLong(b, R + "/along", new RetryNTimes(10, 100)).get().postValue();
        check(along == increments, "atomic long " + along + " against " + increments + " successful increments");
        System.out.println("lock, semaphore and atomic long ok across a kill -9: counter " + counter
            + ", most semaphore holders " + mostHolders.get() + ", atomic long " + along);

        // A persistent ephemeral node, recreated by Curator when someone deletes it.
        PersistentNode pn = new PersistentNode(c, CreateMode.EPHEMERAL, false, R + "/member", b("me"));
        pn.start();
        check(pn.waitForInitialCreate(30, TimeUnit.SECONDS), "persistent node created");
        a.delete().forPath(R + "/member");
        eventually("persistent node recreated", 30, () -> a.checkExists().forPath(R + "/member") != null);
        pn.close();
        eventually("persistent node gone after close", 30, () -> a.checkExists().forPath(R + "/member") == null);
        System.out.println("persistent node ok");

        // The protected ephemeral of the first client is still there (its session moved
        // if its node was the one killed), and goes when the client closes.
        check(b.checkExists().forPath(mine) != null, "a's ephemeral survived the kill");
        a.close();
        eventually("a's ephemeral gone after close", 30, () -> b.checkExists().forPath(mine) == null);

        pool.shutdownNow();
        for (CuratorFramework x : clients) if (x != a) x.close();
        System.out.println("all Curator scenarios passed");
    }
}
