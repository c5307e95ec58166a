//! The `keel` binary.

mod admin;
mod bench;
mod block;
mod cluster;
mod coord_shim;
mod identity;
mod kv;
mod services;
mod sim;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "keel", version, about = "Keel: Byzantine-fault-tolerant replication that stays up and right")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Write configs, keys and certificates for a local cluster.
    Init(cluster::InitArgs),
    /// Run every node of a local cluster as child processes (Ctrl-C stops them).
    Up(cluster::UpArgs),
    /// Run one node.
    Node(cluster::NodeArgs),
    /// Per node: view, primary, executed and stable sequence, lag, connected peers.
    Status(cluster::StatusArgs),
    /// The KV service's client: put, get, del, cas, scan, watch.
    Kv(kv::KvArgs),
    /// The block service: its export and each node's recovery, reserve and bad copies.
    Block(block::BlockArgs),
    /// ZooKeeper's protocol on a local port for unmodified clients, with no single node
    /// trusted (a coord cluster's BFT client).
    CoordShim(coord_shim::CoordShimArgs),
    /// Closed-loop benchmark against a running cluster.
    Bench(bench::BenchArgs),
    /// Run the deterministic simulator over many seeds and check safety and liveness.
    Sim(sim::SimArgs),
    /// Membership changes: add-node, remove-node (signed with the admin key).
    Admin(admin::AdminArgs),
}

/// `--auth NAME` (init, sim): one of [`keel_core::config::Auth::NAMES`].
pub(crate) fn parse_auth(name: &str) -> Result<keel_core::config::Auth, String> {
    keel_core::config::Auth::from_name(name)
        .ok_or_else(|| format!("must be one of {}", keel_core::config::Auth::NAMES.join(", ")))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Servers log what an operator needs (start-up, listening, view changes, catch-up)
    // at INFO; one-shot commands only warnings, so their output stays theirs. RUST_LOG
    // overrides both. Colour only on a terminal: node logs go to files.
    let default = match cli.command {
        Command::Node(_) | Command::Up(_) | Command::CoordShim(_) => "info",
        _ => "warn",
    };
    use std::io::IsTerminal;
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default.into()))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    match cli.command {
        Command::Init(a) => cluster::run_init(a),
        Command::Up(a) => cluster::run_up(a),
        Command::Node(a) => cluster::run_node(a),
        Command::Status(a) => cluster::run_status(a),
        Command::Kv(a) => kv::run(a),
        Command::CoordShim(a) => coord_shim::run(a),
        Command::Block(a) => block::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Sim(args) => sim::run(args),
        Command::Admin(a) => admin::run(a),
    }
}
