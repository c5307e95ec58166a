//! `keel block`: the block service as an operator sees it.

use clap::{Args, Subcommand};
use keel_runtime::config::NodeFile;
use keel_runtime::provision::node_dirs;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct BlockArgs {
    #[command(subcommand)]
    command: BlockCommand,
}

#[derive(Subcommand, Debug)]
enum BlockCommand {
    /// The export (size, block size, mode) and, per node: its NBD URL, recovery phase 2
    /// (INCOMPLETE preferred blocks, blocks re-replicated), reserve storage in use, and
    /// any node whose block data did not match the agreed hash.
    Status {
        /// A directory made by `keel init --service block`.
        #[arg(long, env = "KEEL_DIR")]
        dir: PathBuf,
    },
}

pub fn run(a: BlockArgs) -> ExitCode {
    match a.command {
        BlockCommand::Status { dir } => status(&dir),
    }
}

fn status(dir: &std::path::Path) -> ExitCode {
    let dirs = node_dirs(dir);
    let setups: Vec<_> = dirs.values().filter_map(|d| NodeFile::load(&d.join("node.toml")).ok()).collect();
    let Some(first) = setups.first() else {
        eprintln!("error: {} holds no cluster", dir.display());
        return ExitCode::from(2);
    };
    if first.service != "block" {
        eprintln!("error: {} runs the {} service, not block", dir.display(), first.service);
        return ExitCode::from(2);
    }
    match keel_block::Settings::from_map(&first.service_options) {
        Ok(s) => println!(
            "export: {} bytes in blocks of {} ({} blocks), mode {}, reserve {}% per node, recovery throttle {}, \
             idle epochs end after {} s",
            s.size,
            s.block_size,
            s.size / s.block_size.max(1),
            s.mode.name(),
            s.reserve * 100.0,
            if s.recovery_mbps == 0 { "none".to_string() } else { format!("{} MB/s", s.recovery_mbps) },
            s.epoch_idle_s
        ),
        Err(e) => {
            eprintln!("error: cluster.toml: {e}");
            return ExitCode::FAILURE;
        }
    }
    let mut all_up = true;
    for setup in &setups {
        let url = setup.front_end.as_ref().map_or("-".to_string(), |fe| {
            let tls = keel_block::tls::FrontOptions::from_settings(&fe.options, &fe.dir).is_ok_and(|o| o.tls.is_some());
            format!("{}://{}", if tls { "nbds" } else { "nbd" }, fe.listen)
        });
        match keel_runtime::metrics::fetch_status(setup.metrics, Duration::from_secs(2)) {
            Ok(s) => {
                println!("node {}: {url}", setup.id);
                for line in &s.service {
                    println!("  {}", line.trim_start_matches("block: "));
                }
            }
            Err(e) => {
                all_up = false;
                println!("node {}: {url} down ({e})", setup.id);
            }
        }
    }
    if all_up {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
