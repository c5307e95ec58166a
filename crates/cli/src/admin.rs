//! `keel admin`: membership changes, signed with the admin key `keel init` wrote
//! (BFT-SMaRt §II-C3; core/src/membership.rs).
//!
//! ```text
//!   keel admin add-node --dir D [--listen A --metrics A]   creates D/node-<id>, asks the
//!       cluster to add it, writes its join file; then: keel node --config D/node-<id>/node.toml
//!   keel admin remove-node --dir D ID                       the node stops by itself
//!   keel admin set-faults --dir D --u U --r R               same nodes, other (u, r)
//!   keel admin backup --dir D --out FILE                   the newest certified checkpoint
//! ```
//! The operation names the epoch it applies to. The tool starts from epoch 0 and, when
//! the cluster answers that it is at another epoch, signs again for that one.

use clap::{Args, Subcommand};
use keel_core::ids::NodeId;
use keel_core::membership::{decode_result, AdminError, AdminOp, Change, Membership};
use keel_runtime::client::KeelClient;
use keel_runtime::config::{write_join_file, NodeFile};
use keel_runtime::provision::{admin_setup, new_node_dir_with, node_dirs, provision_clients, write_bundle};
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
        #[arg(long, env = "KEEL_DIR")]
        dir: PathBuf,
        /// Where the new node listens (default: the port after the highest one in use).
        #[arg(long)]
        listen: Option<SocketAddr>,
        /// Where it serves /metrics and /status (default: the port after that).
        #[arg(long)]
        metrics: Option<SocketAddr>,
        /// Services with their own client port (coord, block): where the new node's
        /// front end listens (default: the port after the metrics port).
        #[arg(long)]
        front_end: Option<SocketAddr>,
    },
    /// Remove a node (by id) from the running cluster.
    RemoveNode {
        /// The directory `keel init` wrote (holds admin.key).
        #[arg(long, env = "KEEL_DIR")]
        dir: PathBuf,
        /// The node's stable id (its node-<ID> directory).
        id: u32,
    },
    /// The current membership as the running nodes report it: epoch, members (stable
    /// ids), and per node directory its addresses and whether it answers.
    Members {
        /// The directory `keel init` wrote.
        #[arg(long, env = "KEEL_DIR")]
        dir: PathBuf,
        /// Output: a table (text) or one JSON object (json).
        #[arg(short, long, value_enum, default_value_t = crate::cluster::StatusOutput::Text)]
        output: crate::cluster::StatusOutput,
    },
    /// Save the cluster's state to a file: the first certified checkpoint that holds
    /// every write acknowledged before the command started (restore it into a new
    /// cluster with `keel init --restore FILE`).
    Backup {
        /// The directory `keel init` wrote (holds ca.key, for the administrator's client
        /// identity: nodes serve checkpoints to no one else).
        #[arg(long, env = "KEEL_DIR")]
        dir: PathBuf,
        /// The file to write (replaced only once the new backup is complete and synced).
        #[arg(long, short = 'o')]
        out: PathBuf,
        /// Give up after this many seconds without a complete checkpoint (1 to 86400).
        #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=86_400))]
        timeout: u64,
    },
    /// Tolerate other faults with the same nodes (refused unless the node count allows).
    SetFaults {
        /// The directory `keel init` wrote (holds admin.key).
        #[arg(long, env = "KEEL_DIR")]
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
        AdminCommand::AddNode { dir, listen, metrics, front_end } => {
            refuse_for_block(&dir)?;
            let dirs = node_dirs(&dir);
            let id = dirs.keys().next_back().map_or(0, |top| top.0 + 1);
            // Ports after the highest any node uses.
            let mut top_port = 0;
            let mut host = std::net::IpAddr::from([127, 0, 0, 1]);
            let in_use = addresses_in_use(&dir)?;
            let mut has_front_end = false;
            for d in dirs.values() {
                let s = NodeFile::load(&d.join("node.toml")).map_err(|e| e.to_string())?;
                host = s.listen.ip();
                has_front_end |= s.front_end.is_some();
            }
            for (addr, _) in &in_use {
                top_port = top_port.max(addr.port());
            }
            let next =
                |p: u16| p.checked_add(1).ok_or("no port left above the ones in use: give --listen and --metrics");
            let listen = match listen {
                Some(a) => a,
                None => SocketAddr::new(host, next(top_port)?),
            };
            let metrics = match metrics {
                Some(a) => a,
                None => SocketAddr::new(host, next(listen.port().max(top_port + 1))?),
            };
            // The service's client port, for services whose nodes have one.
            let front_end = match (has_front_end, front_end) {
                (false, Some(_)) => return Err("--front-end: this cluster's service has no client port".into()),
                (false, None) => None,
                (true, Some(a)) => Some(a),
                (true, None) => Some(SocketAddr::new(host, next(metrics.port().max(top_port + 2))?)),
            };
            if listen == metrics || front_end.is_some_and(|f| f == listen || f == metrics) {
                return Err(format!(
                    "--listen, --metrics and --front-end must differ: {listen}, {metrics}, {front_end:?}"
                ));
            }
            for (flag, addr) in [("--listen", Some(listen)), ("--metrics", Some(metrics)), ("--front-end", front_end)] {
                let Some(addr) = addr else { continue };
                if let Some((_, who)) = in_use.iter().find(|(a, _)| a.port() == addr.port() && same_host(*a, addr)) {
                    return Err(format!("{flag} {addr} is already {who}"));
                }
            }
            let (ndir, member) =
                new_node_dir_with(&dir, NodeId(id), listen, metrics, front_end).map_err(|e| e.to_string())?;
            let m = match submit(&dir, Change::Add(member)).await {
                Ok(m) => m,
                Err(e) => {
                    // Nothing joined: leave no directory that looks like a member.
                    let _ = std::fs::remove_dir_all(&ndir);
                    return Err(e);
                }
            };
            write_join_file(&ndir, &m).map_err(|e| e.to_string())?;
            let clients = provision_clients(&dir, NodeId(id)).map_err(|e| e.to_string())?;
            println!("node {id} added: epoch {} with nodes {:?}", m.epoch, ids(&m));
            println!(
                "{clients} client files (the nodes' front ends' included) now hold a key for node {id}: clients \
                 started from now on use it, and a running front end once its node restarts"
            );
            let bundle = write_bundle(&dir, NodeId(id), &listen.ip().to_string()).map_err(|e| e.to_string())?;
            if let Some(f) = front_end {
                println!("its clients' port (the service's front end): {f}");
            }
            println!("start it with: keel node --config {}", ndir.join("node.toml").display());
            println!(
                "on another machine: copy {} there and run keel node --config node-{id}/node.toml in it",
                bundle.display()
            );
            Ok(())
        }
        AdminCommand::Backup { dir, out, timeout } => backup(&dir, &out, Duration::from_secs(timeout)).await,
        AdminCommand::Members { dir, output } => members(&dir, output == crate::cluster::StatusOutput::Json),
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

/// Every address the nodes of `dir` use (listen, metrics, client port), with whose it
/// is; a removed node's addresses are free again.
fn addresses_in_use(dir: &std::path::Path) -> Result<Vec<(SocketAddr, String)>, String> {
    let mut used = Vec::new();
    for (id, d) in node_dirs(dir) {
        let s = NodeFile::load(&d.join("node.toml")).map_err(|e| e.to_string())?;
        if s.data_dir.join(keel_runtime::node::REMOVED_FILE).exists() {
            continue;
        }
        used.push((s.listen, format!("node {id}'s listen address")));
        used.push((s.metrics, format!("node {id}'s metrics address")));
        if let Some(fe) = &s.front_end {
            used.push((fe.listen, format!("node {id}'s client port")));
        }
    }
    Ok(used)
}

/// Whether two listen addresses would clash: the same IP, or either the wildcard.
fn same_host(a: SocketAddr, b: SocketAddr) -> bool {
    a.ip() == b.ip() || a.ip().is_unspecified() || b.ip().is_unspecified()
}

/// `keel admin members`: the membership the running nodes report (the highest epoch any
/// of them is in), and what each node directory is.
fn members(dir: &std::path::Path, json: bool) -> Result<(), String> {
    let dirs = node_dirs(dir);
    if dirs.is_empty() {
        return Err(format!("{} holds no cluster", dir.display()));
    }
    let mut rows = Vec::new();
    let mut current: Option<keel_runtime::metrics::Status> = None;
    for (id, d) in &dirs {
        let s = NodeFile::load(&d.join("node.toml")).map_err(|e| e.to_string())?;
        let removed = std::fs::read_to_string(s.data_dir.join(keel_runtime::node::REMOVED_FILE)).ok();
        let state = match removed {
            Some(why) => format!("removed ({})", why.trim()),
            None => match keel_runtime::metrics::fetch_status(s.metrics, Duration::from_secs(2)) {
                Ok(st) => {
                    let state = format!("up (epoch {}, view {})", st.epoch, st.view);
                    if !s.rq_only() && current.as_ref().is_none_or(|c| st.epoch > c.epoch) {
                        current = Some(st);
                    }
                    state
                }
                Err(e) => format!("down ({e})"),
            },
        };
        rows.push((*id, s.listen, s.metrics, state));
    }
    let Some(current) = current else {
        return Err("no node answered: the membership is unknown (is the cluster running?)".into());
    };
    if json {
        let nodes: Vec<_> = rows
            .iter()
            .map(|(id, listen, metrics, state)| {
                serde_json::json!({
                    "node": id,
                    "member": current.members.contains(&id.0),
                    "listen": listen.to_string(),
                    "metrics": metrics.to_string(),
                    "state": state,
                })
            })
            .collect();
        let out = serde_json::json!({ "epoch": current.epoch, "members": current.members, "nodes": nodes });
        println!("{out}");
        return Ok(());
    }
    let list = current.members.iter().map(u32::to_string).collect::<Vec<_>>().join(" ");
    println!("epoch {}: members {list} (quorum {})", current.epoch, current.quorum);
    println!("node\tmember\tlisten\tmetrics\tstate");
    for (id, listen, metrics, state) in rows {
        let member = if current.members.contains(&id.0) { "yes" } else { "no" };
        println!("{id}\t{member}\t{listen}\t{metrics}\t{state}");
    }
    Ok(())
}

/// `keel admin backup`: fetches the newest certified checkpoint (every chunk checked
/// against the root its certificate signs) and writes it to `out`.
async fn backup(dir: &std::path::Path, out: &std::path::Path, timeout: Duration) -> Result<(), String> {
    let service = node_dirs(dir)
        .values()
        .find_map(|d| NodeFile::load(&d.join("node.toml")).ok())
        .map(|s| s.service)
        .ok_or_else(|| format!("{} holds no cluster", dir.display()))?;
    if service == "block" {
        // Gnothi keeps block data off the ordering path, in each node's own storage: a
        // checkpoint holds the block map, not the blocks.
        return Err("the block service's data is not in its checkpoints (Gnothi keeps blocks off the ordering \
                    path): back the disk up through NBD instead, e.g. nbdcopy nbd://HOST:PORT disk.img"
            .into());
    }
    let cluster_path = dir.join("cluster.toml");
    let cluster = keel_runtime::config::ClusterFile::load(&cluster_path).map_err(|e| e.to_string())?;
    let cfg =
        cluster.cluster_config(&cluster_path, keel_core::config::Options::production()).map_err(|e| e.to_string())?;
    let certifiers = match cfg.separated() {
        true => keel_core::backup::Certifiers::Executors {
            holders: cfg.exec_ids().map(keel_core::ids::NodeId).collect(),
            signers: cfg.executors(),
            keys: cfg.stages.executors.clone(),
            quorum: cfg.quorums.exec_checkpoint_quorum(),
        },
        false => keel_core::backup::Certifiers::Members,
    };
    let by_executors = cfg.separated();
    let (setup, _) = admin_setup(dir).map_err(|e| e.to_string())?;
    let (membership, epochs_dir) = (setup.membership.clone(), setup.epochs_dir.clone());
    let client = KeelClient::connect(setup).map_err(|e| e.to_string())?;
    let bar = indicatif::ProgressBar::new(0).with_style(
        indicatif::ProgressStyle::with_template("checkpoint {prefix}: [{bar:30}] {pos}/{len} chunks")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let interval = Some(cfg.options.checkpoint_interval);
    let fetched =
        keel_runtime::backup::fetch(&client, membership, epochs_dir.as_deref(), certifiers, interval, timeout, |p| {
            bar.set_prefix(p.seq.to_string());
            bar.set_length(p.total as u64);
            bar.set_position(p.held as u64);
        })
        .await;
    bar.finish_and_clear();
    let fetched = fetched.map_err(|e| e.to_string())?;
    let header = keel_runtime::backup::write(out, &service, &fetched, by_executors).map_err(|e| e.to_string())?;
    println!(
        "backed up the {service} state after instance {} (epoch {}, {} bytes in {} chunks, certified by {} nodes) to {}",
        header.proof.seq,
        header.membership.epoch,
        header.len,
        header.chunks,
        header.proof.sigs.len(),
        out.display()
    );
    if fetched.refused > 0 {
        println!("{} answers from nodes did not check out and were refused (a faulty node?)", fetched.refused);
    }
    println!(
        "restore it into a new cluster with: keel init --service {service} --restore {} --dir NEW_DIR",
        out.display()
    );
    Ok(())
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
