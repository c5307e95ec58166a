//! `keel admin`: membership changes, signed with the admin key `keel init` wrote
//! (BFT-SMaRt §II-C3; core/src/membership.rs).
//!
//! ```text
//!   keel admin add-node --dir D [--listen A --metrics A]   creates D/node-<id>, asks the
//!       cluster to add it, writes its join file; then: keel node --config D/node-<id>/node.toml
//!   keel admin remove-node --dir D ID                       the node stops by itself
//!   keel admin set-faults --dir D --u U --r R               same nodes, other (u, r)
//! ```
//! The operation names the epoch it applies to. The tool starts from epoch 0 and, when
//! the cluster answers that it is at another epoch, signs again for that one.

use clap::{Args, Subcommand};
use keel_core::membership::{decode_result, AdminError, AdminOp, Change, Membership};
use keel_runtime::client::KeelClient;
use keel_runtime::config::{admin_setup, new_node_dir, node_dirs, provision_clients, write_join_file, NodeFile};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

#[derive(Args, Debug)]
pub struct AdminArgs {
    #[command(subcommand)]
    command: AdminCommand,
}

#[derive(Subcommand, Debug)]
enum AdminCommand {
    /// Create a node directory and add the node to the running cluster.
    AddNode {
        /// The directory `keel init` wrote (holds admin.key and ca.key).
        #[arg(long)]
        dir: PathBuf,
        /// Where the new node listens (default: the port after the highest one in use).
        #[arg(long)]
        listen: Option<SocketAddr>,
        /// Where it serves /metrics and /status (default: the port after that).
        #[arg(long)]
        metrics: Option<SocketAddr>,
    },
    /// Remove a node (by id) from the running cluster.
    RemoveNode {
        #[arg(long)]
        dir: PathBuf,
        id: u32,
    },
    /// Tolerate other faults with the same nodes (refused unless the node count allows).
    SetFaults {
        #[arg(long)]
        dir: PathBuf,
        /// Faults tolerated while staying up.
        #[arg(long)]
        u: u32,
        /// Of those, arbitrary (Byzantine) ones tolerated while staying right.
        #[arg(long)]
        r: u32,
    },
}

/// How long one attempt may take (an epoch change includes a checkpoint).
const OP_TIMEOUT: Duration = Duration::from_secs(20);
/// Attempts at naming the right epoch.
const ATTEMPTS: usize = 5;

pub fn run(a: AdminArgs) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run_command(a.command)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The block service places data by member index and (u, r): a membership change
/// would move every slice under it. Refused until it re-places data (issue #24).
fn refuse_for_block(dir: &std::path::Path) -> Result<(), String> {
    let service =
        node_dirs(dir).values().next().and_then(|d| NodeFile::load(&d.join("node.toml")).ok()).map(|s| s.service);
    if service.as_deref() == Some("block") {
        return Err(
            "the block service does not support membership changes yet: its data is placed by member index and (u, r)"
                .into(),
        );
    }
    Ok(())
}

async fn run_command(command: AdminCommand) -> Result<(), String> {
    match command {
        AdminCommand::AddNode { dir, listen, metrics } => {
            refuse_for_block(&dir)?;
            let dirs = node_dirs(&dir);
            let id = dirs.keys().next_back().map_or(0, |top| top + 1);
            // Ports after the highest any node uses.
            let mut top_port = 0;
            let mut host = std::net::IpAddr::from([127, 0, 0, 1]);
            for d in dirs.values() {
                let s = NodeFile::load(&d.join("node.toml")).map_err(|e| e.to_string())?;
                top_port = top_port.max(s.listen.port()).max(s.metrics.port());
                host = s.listen.ip();
            }
            let listen = listen.unwrap_or(SocketAddr::new(host, top_port + 1));
            let metrics = metrics.unwrap_or(SocketAddr::new(host, top_port + 2));
            let (ndir, member) = new_node_dir(&dir, id, listen, metrics).map_err(|e| e.to_string())?;
            let m = match submit(&dir, Change::Add(member)).await {
                Ok(m) => m,
                Err(e) => {
                    // Nothing joined: leave no directory that looks like a member.
                    let _ = std::fs::remove_dir_all(&ndir);
                    return Err(e);
                }
            };
            write_join_file(&ndir, &m).map_err(|e| e.to_string())?;
            let clients = provision_clients(&dir, id).map_err(|e| e.to_string())?;
            println!("node {id} added: epoch {} with nodes {:?}", m.epoch, ids(&m));
            println!("{clients} client files now hold a key for node {id} (clients started from now on use it)");
            println!("start it with: keel node --config {}", ndir.join("node.toml").display());
            Ok(())
        }
        AdminCommand::SetFaults { dir, u, r } => {
            refuse_for_block(&dir)?;
            let m = submit(&dir, Change::Faults { u, r }).await?;
            println!("epoch {}: u = {}, r = {} with nodes {:?}", m.epoch, m.u, m.r, ids(&m));
            Ok(())
        }
        AdminCommand::RemoveNode { dir, id } => {
            refuse_for_block(&dir)?;
            let m = submit(&dir, Change::Remove(id)).await?;
            println!("node {id} removed: epoch {} with nodes {:?}", m.epoch, ids(&m));
            Ok(())
        }
    }
}

fn ids(m: &Membership) -> Vec<u32> {
    m.members.iter().map(|x| x.id).collect()
}

/// Signs `change` for the cluster's epoch and has it ordered; returns the membership it
/// produced.
async fn submit(dir: &std::path::Path, change: Change) -> Result<Membership, String> {
    let (setup, key) = admin_setup(dir).map_err(|e| e.to_string())?;
    let client = KeelClient::connect(setup).map_err(|e| e.to_string())?;
    let mut epoch = 0;
    for _ in 0..ATTEMPTS {
        let op = AdminOp::sign(&key, epoch, change.clone()).encode();
        let bytes = client.invoke(op, OP_TIMEOUT).await.map_err(|e| format!("the cluster did not answer: {e}"))?;
        match decode_result(&bytes) {
            Some(Ok(m)) => return Ok(m),
            Some(Err(AdminError::WrongEpoch { current, .. })) => epoch = current,
            Some(Err(AdminError::ChangeInProgress)) => tokio::time::sleep(Duration::from_millis(200)).await,
            Some(Err(e)) => return Err(format!("refused: {e}")),
            None => return Err("the answer is not an admin result".into()),
        }
    }
    Err(format!("the epoch kept changing under {ATTEMPTS} attempts; try again"))
}
