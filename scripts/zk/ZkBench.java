// Closed-loop load on a ZooKeeper-protocol service through the Apache ZooKeeper Java
// client: CLIENTS sessions, each keeping OUTSTANDING asynchronous operations in flight
// on a znode of its own, WRITE_PERCENT of them setData and the rest getData, VALUE
// bytes each (UpRight Fig. 10's mixes). Prints one line:
//   ops_per_s p50_ms p99_ms ops errors cpu_s
// (cpu_s: this load generator's own CPU time over the whole run, warm-up included).
// usage: java ZkBench HOSTS CLIENTS OUTSTANDING WRITE_PERCENT VALUE WARMUP_S DURATION_S
import java.util.*;
import java.util.concurrent.*;
import java.util.concurrent.atomic.*;
import org.apache.zookeeper.*;
import org.apache.zookeeper.data.Stat;

public class ZkBench {
    static final class Recorder {
        long[] samples = new long[1 << 16];
        int n;
        synchronized void add(long micros) {
            if (n == samples.length) samples = Arrays.copyOf(samples, n * 2);
            samples[n++] = micros;
        }
    }

    public static void main(String[] a) throws Exception {
        String hosts = a[0];
        int clients = Integer.parseInt(a[1]), outstanding = Integer.parseInt(a[2]);
        int writePercent = Integer.parseInt(a[3]), value = Integer.parseInt(a[4]);
        long warmupNs = Long.parseLong(a[5]) * 1_000_000_000L, durationNs = Long.parseLong(a[6]) * 1_000_000_000L;
        byte[] data = new byte[value];
        new Random(1).nextBytes(data);
        String root = "/bench-" + ProcessHandle.current().pid();
        List<ZooKeeper> sessions = new ArrayList<>();
        for (int c = 0; c < clients; c++) {
            CountDownLatch up = new CountDownLatch(1);
            ZooKeeper zk = new ZooKeeper(hosts, 30000, e -> { if (e.getState() == Watcher.Event.KeeperState.SyncConnected) up.countDown(); });
            if (!up.await(60, TimeUnit.SECONDS)) throw new IllegalStateException("client " + c + " did not connect");
            sessions.add(zk);
        }
        ZooKeeper first = sessions.get(0);
        first.create(root, new byte[0], ZooDefs.Ids.OPEN_ACL_UNSAFE, CreateMode.PERSISTENT);
        for (int c = 0; c < clients; c++) {
            first.create(root + "/c" + c, data, ZooDefs.Ids.OPEN_ACL_UNSAFE, CreateMode.PERSISTENT);
        }
        Recorder recorder = new Recorder();
        AtomicLong errors = new AtomicLong();
        long start = System.nanoTime();
        long measureFrom = start + warmupNs, end = measureFrom + durationNs;
        AtomicBoolean stop = new AtomicBoolean();
        CountDownLatch done = new CountDownLatch(clients * outstanding);
        for (int c = 0; c < clients; c++) {
            ZooKeeper zk = sessions.get(c);
            String path = root + "/c" + c;
            Random rng = new Random(c);
            for (int k = 0; k < outstanding; k++) {
                new Object() {
                    void next() {
                        long now = System.nanoTime();
                        if (now >= end) { done.countDown(); return; }
                        boolean write;
                        synchronized (rng) { write = rng.nextInt(100) < writePercent; }
                        if (write) {
                            zk.setData(path, data, -1, (rc, p, ctx, stat) -> finish(rc, now), null);
                        } else {
                            zk.getData(path, false, (rc, p, ctx, d, stat) -> finish(rc, now), null);
                        }
                    }
                    void finish(int rc, long sent) {
                        long now = System.nanoTime();
                        if (rc != 0) errors.incrementAndGet();
                        else if (sent >= measureFrom && now < end) recorder.add((now - sent) / 1000);
                        next();
                    }
                }.next();
            }
        }
        done.await(warmupNs / 1_000_000_000L + durationNs / 1_000_000_000L + 120, TimeUnit.SECONDS);
        long[] s = Arrays.copyOf(recorder.samples, recorder.n);
        Arrays.sort(s);
        double seconds = durationNs / 1e9;
        double p50 = s.length == 0 ? 0 : s[s.length / 2] / 1000.0, p99 = s.length == 0 ? 0 : s[(int) (s.length * 0.99)] / 1000.0;
        double cpu = ((com.sun.management.OperatingSystemMXBean) java.lang.management.ManagementFactory.getOperatingSystemMXBean()).getProcessCpuTime() / 1e9;
        System.out.printf(Locale.ROOT, "%.0f %.2f %.2f %d %d %.2f%n", s.length / seconds, p50, p99, s.length, errors.get(), cpu);
        try { first.delete(root, -1); } catch (Exception ignored) { }
        for (ZooKeeper zk : sessions) zk.close();
    }
}
