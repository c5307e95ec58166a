// Closed-loop write load generator for a ZooKeeper ensemble, run by scripts/zk-bench.
//
// N sessions (client i connects to server i mod #servers), each owning one znode
// /keel-bench/c<i> and keeping K asynchronous setData(BYTES) calls outstanding: every
// completion records its latency and issues the next call at once. Each step runs a
// warm-up, then measures for the given seconds: ops/s counts the successful completions
// inside the window, latencies are those of the completions inside the window, CPU is
// utime + stime from /proc/PID/stat of each server and of this JVM over the window, in %
// of one core (the same way `keel bench` does it), and other_cpu: the rest of the host's
// busy time over the window (/proc/stat), i.e. what other programs took from the cores.
// Sessions and znodes are created once, before the first step; a step of N clients uses
// sessions 0..N-1.
//
// Output (stdout, tab-separated): one header line starting with '#', one row per step,
// and a final line "peak_ops_per_s\t<max>".

import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.Executors;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.TimeUnit;
import java.util.concurrent.atomic.AtomicLong;

import org.apache.zookeeper.AsyncCallback;
import org.apache.zookeeper.CreateMode;
import org.apache.zookeeper.KeeperException;
import org.apache.zookeeper.Watcher;
import org.apache.zookeeper.ZooDefs;
import org.apache.zookeeper.ZooKeeper;
import org.apache.zookeeper.data.Stat;

public final class ZkBench {
    static final String ROOT = "/keel-bench";

    public static void main(String[] argv) throws Exception {
        String[] servers = null;
        int[] clients = {1, 8, 32, 64};
        int outstanding = 1;
        double duration = 10, warmup = 2;
        int size = 1024;
        String[] pids = new String[0];
        double clkTck = 100;
        for (int i = 0; i < argv.length; i++) {
            String v = i + 1 < argv.length ? argv[i + 1] : null;
            switch (argv[i]) {
                case "--servers": servers = v.split(","); i++; break;
                case "--clients": clients = Arrays.stream(v.split(",")).mapToInt(Integer::parseInt).toArray(); i++; break;
                case "--outstanding": outstanding = Integer.parseInt(v); i++; break;
                case "--duration": duration = Double.parseDouble(v); i++; break;
                case "--warmup": warmup = Double.parseDouble(v); i++; break;
                case "--size": size = Integer.parseInt(v); i++; break;
                case "--pids": pids = v.split(","); i++; break;
                case "--clk-tck": clkTck = Double.parseDouble(v); i++; break;
                default: die("unknown argument " + argv[i]);
            }
        }
        if (servers == null) die("--servers host:port,... is required");
        if (outstanding < 1 || size < 0 || duration <= 0 || warmup < 0) die("bad --outstanding/--size/--duration/--warmup");
        int maxClients = Arrays.stream(clients).max().orElse(0);
        if (maxClients < 1) die("--clients must list at least one positive count");

        byte[] data = new byte[size];
        Arrays.fill(data, (byte) 'x');
        List<Client> all = new ArrayList<>();
        ScheduledExecutorService retry = Executors.newSingleThreadScheduledExecutor(r -> {
            Thread t = new Thread(r, "retry");
            t.setDaemon(true);
            return t;
        });
        try {
            for (int i = 0; i < maxClients; i++) all.add(Client.connect(i, servers[i % servers.length], data, retry));
            ZooKeeper first = all.get(0).zk;
            try {
                first.create(ROOT, new byte[0], ZooDefs.Ids.OPEN_ACL_UNSAFE, CreateMode.PERSISTENT);
            } catch (KeeperException.NodeExistsException e) {
                // a previous run on the same ensemble
            }
            for (Client c : all) {
                try {
                    c.zk.create(c.path, data, ZooDefs.Ids.OPEN_ACL_UNSAFE, CreateMode.PERSISTENT);
                } catch (KeeperException.NodeExistsException e) {
                    c.zk.setData(c.path, data, -1);
                }
            }

            System.out.println("#target\tclients\toutstanding\tops/s\tp50_ms\tp90_ms\tp99_ms\terrors\tserver_cpu%\tclient_cpu%\tother_cpu%");
            double peak = 0;
            for (int n : clients) {
                Row r = step(all.subList(0, n), outstanding, warmup, duration, pids, clkTck);
                peak = Math.max(peak, r.opsPerS);
                System.out.println(r);
                System.out.flush();
            }
            System.out.printf("peak_ops_per_s\t%.0f%n", peak);
        } finally {
            for (Client c : all) c.zk.close(1000);
        }
    }

    static void die(String msg) {
        System.err.println("zk-bench: " + msg);
        System.exit(2);
    }

    record Row(int clients, int outstanding, double opsPerS, double p50, double p90, double p99, long errors,
               double[] serverCpu, double clientCpu, double otherCpu) {
        @Override
        public String toString() {
            StringBuilder cpu = new StringBuilder();
            for (double c : serverCpu) cpu.append(cpu.length() == 0 ? "" : "/").append(String.format("%.0f", c));
            return String.format("zk\t%d\t%d\t%.0f\t%.2f\t%.2f\t%.2f\t%d\t%s\t%.0f\t%.0f",
                    clients, outstanding, opsPerS, p50, p90, p99, errors, cpu, clientCpu, otherCpu);
        }
    }

    static Row step(List<Client> cs, int k, double warmup, double duration, String[] pids, double clkTck)
            throws InterruptedException {
        long t0 = System.nanoTime();
        long measureStart = t0 + (long) (warmup * 1e9);
        long measureEnd = measureStart + (long) (duration * 1e9);
        AtomicLong inflight = new AtomicLong((long) cs.size() * k);
        CountDownLatch drained = new CountDownLatch(1);
        Window w = new Window(measureStart, measureEnd, inflight, drained);
        for (Client c : cs) c.start(w, k);

        sleepUntil(measureStart);
        long[] before = cpuTicks(pids);
        long selfBefore = cpuTicks("self");
        long hostBefore = hostBusyTicks();
        long wallBefore = System.nanoTime();
        sleepUntil(measureEnd);
        long[] after = cpuTicks(pids);
        long selfAfter = cpuTicks("self");
        long hostAfter = hostBusyTicks();
        double wall = (System.nanoTime() - wallBefore) / 1e9;
        if (!drained.await(60, TimeUnit.SECONDS)) {
            System.err.println("zk-bench: " + inflight.get() + " calls still outstanding 60 s after the step ended");
        }

        long errors = 0;
        int total = 0;
        for (Client c : cs) {
            synchronized (c) {
                errors += c.errors;
                total += c.count;
            }
        }
        long[] lat = new long[total];
        int at = 0;
        for (Client c : cs) {
            synchronized (c) {
                System.arraycopy(c.lat, 0, lat, at, c.count);
                at += c.count;
            }
        }
        Arrays.sort(lat);
        double[] serverCpu = new double[pids.length];
        for (int i = 0; i < pids.length; i++) {
            serverCpu[i] = before[i] < 0 || after[i] < 0 ? -1 : (after[i] - before[i]) / clkTck / wall * 100;
        }
        double clientCpu = (selfAfter - selfBefore) / clkTck / wall * 100;
        double otherCpu = (hostAfter - hostBefore) / clkTck / wall * 100 - clientCpu;
        for (double c : serverCpu) otherCpu -= Math.max(c, 0);
        return new Row(cs.size(), k, total / (duration), pct(lat, 0.5), pct(lat, 0.9), pct(lat, 0.99), errors,
                serverCpu, clientCpu, Math.max(otherCpu, 0));
    }

    static double pct(long[] sorted, double p) {
        if (sorted.length == 0) return 0;
        return sorted[(int) Math.round((sorted.length - 1) * p)] / 1e6;
    }

    static void sleepUntil(long deadline) throws InterruptedException {
        for (long left; (left = deadline - System.nanoTime()) > 0; ) {
            TimeUnit.NANOSECONDS.sleep(left);
        }
    }

    static long[] cpuTicks(String[] pids) {
        long[] t = new long[pids.length];
        for (int i = 0; i < pids.length; i++) t[i] = cpuTicks(pids[i]);
        return t;
    }

    /** utime + stime of a process in clock ticks, -1 if unreadable. */
    static long cpuTicks(String pid) {
        try {
            String stat = Files.readString(Path.of("/proc", pid, "stat"), StandardCharsets.US_ASCII);
            String[] f = stat.substring(stat.lastIndexOf(") ") + 2).trim().split("\\s+");
            return Long.parseLong(f[11]) + Long.parseLong(f[12]);
        } catch (Exception e) {
            return -1;
        }
    }

    /** Busy (non-idle, non-iowait) clock ticks of the whole host, from /proc/stat; -1 if unreadable. */
    static long hostBusyTicks() {
        try {
            String cpu = Files.readAllLines(Path.of("/proc/stat")).get(0);
            String[] f = cpu.trim().split("\\s+");
            long busy = 0;
            // cpu user nice system idle iowait irq softirq steal (guest time is inside user)
            for (int i = 1; i <= 8 && i < f.length; i++) {
                if (i != 4 && i != 5) busy += Long.parseLong(f[i]);
            }
            return busy;
        } catch (Exception e) {
            return -1;
        }
    }

    /** One step's timing, shared by its clients. */
    record Window(long measureStart, long measureEnd, AtomicLong inflight, CountDownLatch drained) {
        void done() {
            if (inflight.decrementAndGet() == 0) drained.countDown();
        }
    }

    static final class Client implements AsyncCallback.StatCallback {
        final ZooKeeper zk;
        final String path;
        final byte[] data;
        final ScheduledExecutorService retry;
        volatile Window w;
        // Guarded by this; callbacks of one session run on its single event thread.
        long[] lat = new long[1 << 12];
        int count;
        long errors;

        private Client(ZooKeeper zk, String path, byte[] data, ScheduledExecutorService retry) {
            this.zk = zk;
            this.path = path;
            this.data = data;
            this.retry = retry;
        }

        static Client connect(int i, String server, byte[] data, ScheduledExecutorService retry) throws Exception {
            CountDownLatch up = new CountDownLatch(1);
            ZooKeeper zk = new ZooKeeper(server, 30_000, e -> {
                if (e.getState() == Watcher.Event.KeeperState.SyncConnected) up.countDown();
            });
            if (!up.await(30, TimeUnit.SECONDS)) {
                zk.close();
                throw new IllegalStateException("session " + i + " to " + server + " not connected within 30 s");
            }
            return new Client(zk, ROOT + "/c" + i, data, retry);
        }

        void start(Window w, int k) {
            synchronized (this) {
                count = 0;
                errors = 0;
            }
            this.w = w;
            for (int j = 0; j < k; j++) issue();
        }

        void issue() {
            zk.setData(path, data, -1, this, System.nanoTime());
        }

        @Override
        public void processResult(int rc, String path, Object ctx, Stat stat) {
            long now = System.nanoTime();
            Window w = this.w;
            if (now >= w.measureStart() && now < w.measureEnd()) {
                synchronized (this) {
                    if (rc == 0) {
                        if (count == lat.length) lat = Arrays.copyOf(lat, count * 2);
                        lat[count++] = now - (Long) ctx;
                    } else {
                        errors++;
                    }
                }
            }
            if (now >= w.measureEnd()) {
                w.done();
            } else if (rc == 0) {
                issue();
            } else {
                // Connection loss and the like: back off a little instead of spinning.
                retry.schedule(this::issue, 10, TimeUnit.MILLISECONDS);
            }
        }
    }
}
