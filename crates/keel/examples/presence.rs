//! A presence service on a four-node BFT cluster (u = 1, r = 1), all in this process.
//!
//! Clients announce themselves for a while (`join NAME TTL_MS`); agreed-time ticks drop
//! whoever's time ran out, with no client involved (ZooKeeper's session expiry in
//! miniature); `who` lists who is here. Each node opens a front end of its own: a line
//! protocol on a TCP port, answered through the node's client, so every answer is one
//! that r + 1 nodes agreed on.
//!
//! The program starts the cluster, talks to a front end like any TCP client would,
//! watches a member expire, shuts the cluster down, starts it again from its data
//! directories, and checks that the state came back.
//!
//! ```text
//! cargo run --release --example presence
//! ```

use keel::{
    free_ports, provision, ExecCtx, FrontEnd, InitOptions, NodeBuilder, NodeHandle, Provisioned, ReadCtx, RestoreError,
    Service,
};
use std::collections::BTreeMap;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

/// Who is here, and until when (agreed time, ms).
#[derive(Default)]
struct Presence {
    until: BTreeMap<String, u64>,
}

impl Presence {
    fn who(&self) -> Vec<u8> {
        let names: Vec<&str> = self.until.keys().map(String::as_str).collect();
        names.join(" ").into_bytes()
    }
}

impl Service for Presence {
    fn execute(&mut self, request: &[u8], ctx: &ExecCtx) -> Vec<u8> {
        let text = String::from_utf8_lossy(request);
        match text.split_whitespace().collect::<Vec<_>>()[..] {
            ["join", name, ttl] => match ttl.parse::<u64>() {
                // Agreed time, never the local clock: every node computes the same expiry.
                Ok(ttl) => {
                    self.until.insert(name.to_string(), ctx.time + ttl);
                    b"ok".to_vec()
                }
                Err(_) => b"error: TTL_MS must be a number".to_vec(),
            },
            ["leave", name] => {
                self.until.remove(name);
                b"ok".to_vec()
            }
            ["who"] => self.who(),
            _ => b"error: join NAME TTL_MS | leave NAME | who".to_vec(),
        }
    }

    /// `who` changes nothing: nodes answer it without ordering it.
    fn execute_read_only(&self, request: &[u8], _ctx: &ReadCtx) -> Option<Vec<u8>> {
        (request == b"who").then(|| self.who())
    }

    /// Every node runs this at the same instance: the expiry is replicated state.
    fn on_tick(&mut self, ctx: &ExecCtx) {
        self.until.retain(|_, until| *until > ctx.time);
    }

    fn snapshot(&self) -> Vec<u8> {
        postcard::to_allocvec(&self.until).unwrap_or_default()
    }

    fn restore(&mut self, snapshot: &[u8]) -> Result<(), RestoreError> {
        self.until = postcard::from_bytes(snapshot).map_err(|e| RestoreError(e.to_string()))?;
        Ok(())
    }
}

/// The front end: one request per line, one answer per line, through the node's client.
async fn front_end(mut fe: FrontEnd, listener: TcpListener) {
    let Some(client) = fe.client().cloned() else { return };
    loop {
        let conn = tokio::select! {
            _ = fe.stopped() => return,
            conn = listener.accept() => conn,
        };
        let Ok((stream, _)) = conn else { continue };
        let client = client.clone();
        tokio::spawn(async move {
            let (read, mut write) = stream.into_split();
            let mut lines = BufReader::new(read).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let answer = match client.invoke(line.into_bytes(), Duration::from_secs(10)).await {
                    Ok(bytes) => bytes,
                    Err(e) => format!("error: {e}").into_bytes(),
                };
                if write.write_all(&[answer.as_slice(), b"\n"].concat()).await.is_err() {
                    return;
                }
            }
        });
    }
}

/// Starts every node with its front end on `ports[i]`.
async fn start(cluster: &Provisioned, ports: &[u16]) -> Result<Vec<NodeHandle>, Box<dyn std::error::Error>> {
    let mut nodes = Vec::new();
    for (i, setup) in cluster.nodes.iter().enumerate() {
        let listener = TcpListener::bind(("127.0.0.1", ports[i])).await?;
        let node = NodeBuilder::new(setup.clone(), Presence::default)
            .client(cluster.clients[i].clone())
            .front_end(move |fe| front_end(fe, listener))
            .start()
            .await?;
        nodes.push(node);
    }
    Ok(nodes)
}

/// What a front end answers to `line`: any TCP client could do this.
async fn ask(port: u16, line: &str) -> Result<String, Box<dyn std::error::Error>> {
    let stream = TcpStream::connect(("127.0.0.1", port)).await?;
    let (read, mut write) = stream.into_split();
    write.write_all(format!("{line}\n").as_bytes()).await?;
    let answer = BufReader::new(read).lines().next_line().await?.unwrap_or_default();
    println!("  node front end :{port} <- {line:<16} -> {answer}");
    Ok(answer)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let n = 4;
    // Four nodes (u = 1, r = 1) on this machine, ticking every 100 ms.
    let options = InitOptions { tick_ms: Some(100), ..InitOptions::local("presence", 1, 1)? };
    let cluster = provision(dir.path(), &options)?;
    let front = free_ports(n).ok_or("no free ports")?;
    let ports: Vec<u16> = (0..n as u16).map(|i| front + i).collect();
    println!("a 4-node cluster (u = 1, r = 1) in {}, front ends on ports {ports:?}", dir.path().display());
    let nodes = start(&cluster, &ports).await?;

    ask(ports[0], "join alice 300").await?;
    ask(ports[1], "join bob 600000").await?;
    assert_eq!(ask(ports[2], "who").await?, "alice bob");
    // No client sends anything: the primary proposes ticks, and alice's time runs out.
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(ask(ports[3], "who").await?, "bob", "ticks expired alice");
    // The in-process client: the same cluster, no TCP front end in between.
    let client = nodes[0].client().ok_or("node 0 has a client")?;
    let status = nodes[0].status();
    println!("  node 0: view {}, executed {}, stable {}", status.view, status.executed, status.stable);
    client.invoke(b"join carol 600000".to_vec(), Duration::from_secs(10)).await?;

    println!("shutting down (each node makes what it decided durable)");
    for node in nodes {
        node.shutdown().await?;
    }
    println!("starting again from the data directories");
    let nodes = start(&keel::load(dir.path())?, &ports).await?;
    assert_eq!(ask(ports[1], "who").await?, "bob carol", "the state came back from disk");
    for node in nodes {
        node.shutdown().await?;
    }
    println!("done");
    Ok(())
}
