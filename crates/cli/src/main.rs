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

#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's start-up options, through its documented `malloc_conf` symbol (read at the
/// first allocation; tikv-jemalloc-sys names it with its `_rjem_` prefix).
/// `background_thread:true`: a jemalloc thread gives freed memory back to the system on
/// jemalloc's decay schedule even while the process is idle. Without it, pages go back
/// only when the process allocates again, so a block node idle after a restart (the
/// restore, a state transfer) stayed at 285-313 MB resident where it settles at 68-78 MB
/// with it (2 GiB of 512-byte blocks).
#[export_name = "_rjem_malloc_conf"]
static MALLOC_CONF: Option<&'static std::ffi::c_char> = Some(&JEMALLOC_OPTIONS[0]);
static JEMALLOC_OPTIONS: [std::ffi::c_char; 23] = c_chars(b"background_thread:true\0");

/// A byte string as C characters (signed on some targets), at compile time.
const fn c_chars<const N: usize>(bytes: &[u8; N]) -> [std::ffi::c_char; N] {
    let mut out = [0; N];
    let mut i = 0;
    while i < N {
        out[i] = bytes[i] as std::ffi::c_char;
        i += 1;
    }
    out
}

#[derive(Parser)]
#[command(name = "keel", version, about = "Keel: Byzantine-fault-tolerant replication that stays up and right")]
struct Cli {
    /// Log lines as text, or as one JSON object per line (for log collectors). Logs go
    /// to standard error; RUST_LOG sets the filter.
    #[arg(long, global = true, value_enum, env = "KEEL_LOG_FORMAT", default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum LogFormat {
    Text,
    Json,
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
    // A one-shot command writing into a closed pipe (`keel kv scan p | head -1`) ends
    // quietly, as other Unix tools do, instead of panicking in println!. Servers keep
    // Rust's default (SIGPIPE ignored): a peer closing a socket must never kill a node.
    if !matches!(cli.command, Command::Node(_) | Command::Up(_) | Command::CoordShim(_)) {
        // SAFETY: restoring SIGPIPE's default disposition before any thread exists.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    // Servers log what an operator needs (start-up, listening, view changes, catch-up)
    // at INFO; one-shot commands only warnings, so their output stays theirs. RUST_LOG
    // overrides both. Colour only on a terminal: node logs go to files.
    //
    // The block service's metadata store (fjall) logs its own housekeeping at INFO, and
    // warns for each table file already gone with its dropped keyspace's folder (it
    // removes the folder before the tables' own clean-up runs: nothing is lost, the
    // store is a copy wiped at every start); both stay below what an operator sees.
    let default = match cli.command {
        Command::Node(_) | Command::Up(_) | Command::CoordShim(_) => {
            "info,fjall=warn,lsm_tree=warn,lsm_tree::table::inner=error"
        }
        _ => "warn,lsm_tree::table::inner=error",
    };
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| default.into());
    let logs = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    if cli.log_format == LogFormat::Json {
        // The nodes `keel up` starts log the same way. Set before any thread exists.
        std::env::set_var("KEEL_LOG_FORMAT", "json");
    }
    match cli.log_format {
        LogFormat::Json => logs.json().init(),
        LogFormat::Text => logs.with_ansi(std::io::stderr().is_terminal()).init(),
    }
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

/// Every command and argument without help text, and every help text that points at
/// files a user of the binary does not have (`../shared/`, ARCHITECTURE sections).
#[cfg(test)]
fn help_gaps(cmd: &clap::Command, path: &str, gaps: &mut Vec<String>) {
    let here = if path.is_empty() { cmd.get_name().to_string() } else { format!("{path} {}", cmd.get_name()) };
    let texts = |t: Option<&clap::builder::StyledStr>| t.map(|s| s.to_string());
    match texts(cmd.get_about()).or_else(|| texts(cmd.get_long_about())) {
        None => gaps.push(format!("`{here}` has no description")),
        Some(t) => check_text(&here, &t, gaps),
    }
    for arg in cmd.get_arguments() {
        let id = arg.get_id().as_str();
        if id == "help" || id == "version" {
            continue;
        }
        match texts(arg.get_help()).or_else(|| texts(arg.get_long_help())) {
            None => gaps.push(format!("`{here}` argument {id} has no help")),
            Some(t) => check_text(&format!("{here} {id}"), &t, gaps),
        }
    }
    for sub in cmd.get_subcommands() {
        if sub.get_name() != "help" {
            help_gaps(sub, &here, gaps);
        }
    }
}

#[cfg(test)]
fn check_text(at: &str, text: &str, gaps: &mut Vec<String>) {
    for bad in ["../shared", "ARCHITECTURE §", "§"] {
        if text.contains(bad) {
            gaps.push(format!("`{at}` help points at {bad:?}, which a user of the binary does not have"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    /// Issue #25: every `keel … --help` has text for every command and argument.
    #[test]
    fn every_command_and_argument_has_help() {
        Cli::command().debug_assert();
        let mut gaps = Vec::new();
        help_gaps(&Cli::command(), "", &mut gaps);
        assert!(gaps.is_empty(), "{} gaps:\n{}", gaps.len(), gaps.join("\n"));
        // `init --service` names every service this binary runs.
        let init = Cli::command().find_subcommand("init").cloned().expect("init");
        let service = init.get_arguments().find(|a| a.get_id() == "service").and_then(|a| a.get_help().cloned());
        let service = service.map(|h| h.to_string()).unwrap_or_default();
        for s in services::SERVICES {
            assert!(service.contains(s.name), "`init --service` help does not name {}: {service}", s.name);
        }
    }

    /// The walk catches what it looks for: a command with an undocumented argument, a
    /// subcommand without a description, and a help text that points at ../shared.
    #[test]
    fn the_help_walk_finds_gaps() {
        let broken = clap::Command::new("broken")
            .about("fine")
            .arg(clap::Arg::new("bare").long("bare"))
            .subcommand(clap::Command::new("silent"))
            .subcommand(clap::Command::new("pointer").about("see ../shared/ARCHITECTURE.md"));
        let mut gaps = Vec::new();
        help_gaps(&broken, "", &mut gaps);
        assert!(gaps.iter().any(|g| g.contains("argument bare has no help")), "{gaps:?}");
        assert!(gaps.iter().any(|g| g.contains("`broken silent` has no description")), "{gaps:?}");
        assert!(gaps.iter().any(|g| g.contains("points at \"../shared\"")), "{gaps:?}");
    }
}
