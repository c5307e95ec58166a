// Reads /zookeeper/config the way ZooKeeper's own reconfig-aware clients do:
// ZooKeeper.getConfig, then ConfigUtils.getClientConfigStr (the client connection string
// ZooKeeper.updateServerList takes). Prints "client-config: <version> <host:port,...>".
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import org.apache.zookeeper.*;
import org.apache.zookeeper.server.util.ConfigUtils;

public class ZkConfig {
    public static void main(String[] args) throws Exception {
        CountDownLatch connected = new CountDownLatch(1);
        ZooKeeper zk = new ZooKeeper(args[0], 10000, e -> {
            if (e.getState() == Watcher.Event.KeeperState.SyncConnected) connected.countDown();
        });
        if (!connected.await(30, TimeUnit.SECONDS)) throw new RuntimeException("not connected");
        byte[] data = zk.getConfig(false, null);
        System.out.println("client-config: " + ConfigUtils.getClientConfigStr(new String(data)));
        zk.close();
    }
}
