//! `keel coord-shim`: ZooKeeper's client protocol on a local port, Keel's to the cluster.
//!
//! An unmodified ZooKeeper client connected straight to a node trusts that node's front
//! end. Through the shim it trusts no single node: the shim is a Keel client of its own
//! identity, so every reply it forwards is one r + 1 nodes sent alike (reads are quorum
//! reads), watch events count once r + 1 nodes pushed them, a gap in them drops the
//! connection (the client re-syncs with setWatches), and its session heartbeats are
//! ordered commands from its own authenticated identity: no single lying node can expire
//! an honest client's session, keep a dead client's lock, or feed it a wrong read.

use clap::Args;
use keel_runtime::client::KeelClient;
use keel_runtime::config::ClientFile;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Args)]
pub struct CoordShimArgs {
    /// The cluster directory `keel init --service coord` wrote.
    #[arg(long, env = "KEEL_DIR", default_value = ".keel/demo")]
    dir: PathBuf,
    /// Where ZooKeeper clients connect.
    #[arg(long, default_value = "127.0.0.1:2181")]
    listen: SocketAddr,
    /// The client identity (client-N) to use; by default the first free one.
    #[arg(long)]
    client: Option<u64>,
}

pub fn run(a: CoordShimArgs) -> ExitCode {
    let (id, _identity) = match crate::identity::claim(&a.dir, a.client) {
        Ok(claimed) => claimed,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let setup = match ClientFile::load(&a.dir.join(format!("client-{id}")).join("client.toml")) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let r = setup.quorums.r();
    let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        let client = match KeelClient::connect_sessions(setup, keel_coord::front::CLIENT_SESSIONS) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::FAILURE;
            }
        };
        let listener = match tokio::net::TcpListener::bind(a.listen).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!("error: {}: {e}", a.listen);
                return ExitCode::FAILURE;
            }
        };
        eprintln!(
            "coord-shim: ZooKeeper clients on {} (client identity {id}); every answer is one {} node{} sent alike",
            a.listen,
            r + 1,
            if r == 0 { "" } else { "s" }
        );
        let stop = async {
            let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) else {
                return std::future::pending().await;
            };
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        };
        let options = keel_coord::front::Options::default();
        keel_coord::front::serve_client(client, keel_coord::front::Role::Shim, listener, options, stop).await;
        eprintln!("coord-shim: stopped");
        ExitCode::SUCCESS
    })
}
