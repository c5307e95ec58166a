//! The `keel` binary.

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
    /// Run the deterministic simulator over many seeds and check safety and liveness.
    Sim(sim::SimArgs),
}

fn main() -> ExitCode {
    match Cli::parse().command {
        Command::Sim(args) => sim::run(args),
    }
}
