//! The services this binary runs, by the name `keel init --service` writes into
//! cluster.toml and `keel node` reads back. One table: a name that is not in it is an
//! error wherever it appears (issue #22: `keel node` used to run KV for any unknown name).

use keel_core::ids::NodeId;
use keel_core::service::Service as _;
use keel_runtime::config::NodeSetup;
use keel_runtime::embed::{Control, NodeBuilder};
use keel_runtime::node::NodeError;
use tokio::sync::watch;

/// A service this binary runs.
pub struct ServiceInfo {
    pub name: &'static str,
    /// The agreed-time tick `keel init` configures for it (`Service::on_tick`).
    pub tick_ms: Option<u64>,
    /// Whether its nodes open a port of the service's own protocol (`[front_end]`).
    pub front_end: bool,
    /// Its simulator model (`keel sim --service NAME`): a workload with its own
    /// linearizability check, run for one seed. None: not modelled yet.
    pub sim: Option<fn(&keel_sim::SimOptions) -> keel_sim::SeedReport>,
    /// Checks a state from a backup restores (`keel init --restore`). None: its
    /// checkpoints do not hold its data, so a backup of it is not a backup.
    pub check_state: Option<CheckState>,
    /// Its nodes stay the same and all run every stage: no `--layout` apart and no
    /// membership changes (block: its slices are by member index).
    pub fixed_cluster: bool,
}

/// Restores a state into an empty service, to see that it can.
pub type CheckState = fn(&[u8]) -> Result<(), keel_core::service::RestoreError>;

/// In the order `--help` and errors list them.
pub const SERVICES: [ServiceInfo; 4] = [
    // The replicated key-value store (`keel kv`). Watch leases end at the next tick, also
    // while no client writes.
    ServiceInfo {
        name: "kv",
        tick_ms: Some(1_000),
        front_end: false,
        sim: Some(keel_kv_sim::run_kv_seed),
        check_state: Some(|s| keel_kv::Kv::new().restore(s)),
        fixed_cluster: false,
    },
    // Empty requests: the microbenchmark service.
    ServiceInfo {
        name: "null",
        tick_ms: None,
        front_end: false,
        sim: None,
        check_state: Some(|s| keel_null::Null.restore(s)),
        fixed_cluster: false,
    },
    // ZooKeeper-compatible coordination: sessions expire at ticks (half a second of
    // granularity against timeouts of 4 to 40 s); each node serves ZooKeeper clients.
    ServiceInfo {
        name: "coord",
        tick_ms: Some(500),
        front_end: true,
        sim: Some(keel_coord_sim::run_coord_seed),
        check_state: Some(|s| keel_coord::Coord::new().restore(s)),
        fixed_cluster: false,
    },
    // Gnothi's block store: each node serves the export over NBD.
    // Its checkpoints hold the block map; the blocks live in each node's own storage.
    // Idle front ends' epochs end at ticks (`service_options.epoch_idle_s`).
    ServiceInfo {
        name: "block",
        tick_ms: Some(1_000),
        front_end: true,
        sim: Some(keel_block_sim::run_block_seed),
        check_state: None,
        fixed_cluster: true,
    },
];

/// The names, for messages: "kv, null, coord, block".
pub fn names() -> String {
    SERVICES.iter().map(|s| s.name).collect::<Vec<_>>().join(", ")
}

/// Whether `name` is a service this binary can run.
pub fn known(name: &str) -> bool {
    SERVICES.iter().any(|s| s.name == name)
}

/// The tick service `name` asks for.
pub fn tick_ms(name: &str) -> Option<u64> {
    SERVICES.iter().find(|s| s.name == name).and_then(|s| s.tick_ms)
}

/// Whether service `name` runs on a fixed, co-located cluster only.
pub fn fixed_cluster(name: &str) -> bool {
    SERVICES.iter().any(|s| s.name == name && s.fixed_cluster)
}

/// The simulator model of service `name`, or why there is none.
pub fn sim_model(name: &str) -> Result<fn(&keel_sim::SimOptions) -> keel_sim::SeedReport, String> {
    let modelled = || SERVICES.iter().filter(|s| s.sim.is_some()).map(|s| s.name).collect::<Vec<_>>().join(", ");
    match SERVICES.iter().find(|s| s.name == name) {
        None => Err(format!("unknown --service {name:?}; this binary runs: {}", names())),
        Some(ServiceInfo { sim: Some(run), .. }) => Ok(*run),
        Some(_) => Err(format!("the {name} service has no simulator model yet; modelled: {}", modelled())),
    }
}

/// Whether `state` (from a backup) restores into service `name`.
///
/// # Errors
/// It does not, or the service cannot be restored from a backup.
pub fn check_state(name: &str, state: &[u8]) -> Result<(), String> {
    match SERVICES.iter().find(|s| s.name == name) {
        None => Err(format!("unknown service {name:?}; this binary runs: {}", names())),
        Some(ServiceInfo { check_state: None, .. }) => {
            Err(format!("the {name} service keeps its data outside its checkpoints: it cannot be restored from one"))
        }
        Some(ServiceInfo { check_state: Some(check), .. }) => {
            check(state).map_err(|e| format!("the state does not restore into the {name} service: {}", e.0))
        }
    }
}

/// Whether service `name` opens a front end on its nodes.
pub fn front_end(name: &str) -> bool {
    SERVICES.iter().any(|s| s.name == name && s.front_end)
}

/// Runs the node `setup` describes with its service until `stop` turns true (or its
/// sender goes); an unknown name is an error before anything starts.
pub async fn run(setup: NodeSetup, stop: watch::Receiver<bool>) -> Result<(), String> {
    let result: Result<(), NodeError> = match setup.service.as_str() {
        "kv" => keel_runtime::node::run_controlled(setup, keel_kv::Kv::new, Control::stop_on(stop)).await,
        "null" => keel_runtime::node::run_controlled(setup, || keel_null::Null, Control::stop_on(stop)).await,
        "coord" => run_coord(setup, stop).await,
        "block" => run_block(setup, stop).await,
        other => {
            return Err(format!(
                "unknown service {other:?} in the cluster configuration; this binary runs: {}",
                names()
            ))
        }
    };
    result.map_err(|e| e.to_string())
}

/// Resolves once `stop` turns true or its sender goes.
async fn stopped(mut stop: watch::Receiver<bool>) {
    while !*stop.borrow_and_update() {
        if stop.changed().await.is_err() {
            return;
        }
    }
}

/// coord: the node with its ZooKeeper port, where the node's `[front_end]` says. A node
/// without one (an order node when stages run apart) runs the service alone.
async fn run_coord(setup: NodeSetup, stop: watch::Receiver<bool>) -> Result<(), NodeError> {
    let Some(fe) = setup.front_end.clone() else {
        return keel_runtime::node::run_controlled(setup, keel_coord::Coord::new, Control::stop_on(stop)).await;
    };
    let id = setup.id;
    let options = keel_coord::front::Options::from_settings(&fe.options).map_err(NodeError::Runtime)?;
    let view = keel_coord::coord::LocalView::new();
    let listener = tokio::net::TcpListener::bind(fe.listen)
        .await
        .map_err(|e| NodeError::Runtime(format!("ZooKeeper port {}: {e}", fe.listen)))?;
    let local = view.clone();
    let node = NodeBuilder::new(setup, move || view.service())
        .client(fe.client)
        .client_sessions(keel_coord::front::CLIENT_SESSIONS)
        .front_end(move |front| keel_coord::front::serve(front, listener, options, local))
        .start()
        .await?;
    tracing::info!(node = id.0, zookeeper = %fe.listen, "serving ZooKeeper clients");
    eprintln!("node {id}: ZooKeeper clients on {}", fe.listen);
    node.run_until(stopped(stop)).await
}

/// block: the node with its NBD port. Its data lives under the node's data directory
/// (`block/`), beside the WAL; its settings come from cluster.toml.
async fn run_block(setup: NodeSetup, stop: watch::Receiver<bool>) -> Result<(), NodeError> {
    use keel_block::front::{self, Mode};
    use keel_block::local::Local;
    use keel_block::meta::Meta;
    use keel_block::{BlockService, Geometry, Settings};
    use std::sync::{Arc, RwLock};
    let settings = Settings::from_map(&setup.service_options).map_err(NodeError::Runtime)?;
    if setup.executes_only() || setup.rq_only() || !setup.executors.is_empty() {
        return Err(NodeError::Runtime("the block service runs on co-located clusters only (no --layout)".into()));
    }
    let Some(fe) = setup.front_end.clone() else {
        return Err(NodeError::Runtime(
            "a block node needs [front_end] in node.toml (keel init --service block writes it)".into(),
        ));
    };
    let membership = setup.joined.clone().unwrap_or_else(|| setup.cluster.membership.clone());
    let members: Vec<keel_core::ids::NodeId> = membership.members.iter().map(|m| NodeId(m.id)).collect();
    let Some(index) = members.iter().position(|&m| m == setup.id) else {
        return Err(NodeError::Runtime(format!("node {} is not a member", setup.id)));
    };
    let quorums = &setup.cluster.quorums;
    let nodes = members.len() as u32;
    let copies = match settings.mode {
        Mode::Gnothi => (quorums.u() + quorums.r() + 1).min(nodes),
        Mode::Full => nodes,
    };
    let geometry = Geometry::new(settings.size, settings.block_size, nodes, copies)
        .map_err(|e| NodeError::Runtime(e.to_string()))?;
    let sync = setup.fsync != keel_runtime::storage::FsyncPolicy::Never;
    let opening = std::time::Instant::now();
    let local = Local::open(&setup.data_dir.join("block"), geometry, setup.id, index as u32, settings.reserve, sync)
        .and_then(Local::sync_in_background)
        .map_err(|e| NodeError::Runtime(format!("block data in {}: {e}", setup.data_dir.display())))?;
    let local = Arc::new(local);
    // The agreed metadata in its own store beside the data: wiped here, rebuilt by the
    // node's restore and WAL replay (`meta_store.rs`).
    let meta_dir = setup.data_dir.join("block").join("meta");
    let meta = Meta::on_disk(geometry, &meta_dir).map_err(|e| NodeError::Runtime(format!("block metadata: {e}")))?;
    let meta = Arc::new(RwLock::new(meta));
    // With the node's own start line (`node started`: storage_ms, recover_ms), where a
    // restart's time goes.
    tracing::info!(
        node = setup.id.0,
        open_ms = opening.elapsed().as_millis() as u64,
        "block: data and its logs opened"
    );
    let options = keel_block::tls::FrontOptions::from_settings(&fe.options, &fe.dir).map_err(NodeError::Runtime)?;
    let tls = match &options.tls {
        Some(files) => Some(keel_block::tls::acceptor(&setup.ca_pem, files).map_err(NodeError::Runtime)?),
        None => None,
    };
    let listener = tokio::net::TcpListener::bind(fe.listen)
        .await
        .map_err(|e| NodeError::Runtime(format!("NBD port {}: {e}", fe.listen)))?;
    let id = setup.id;
    let (service_meta, service_local) = (meta.clone(), local.clone());
    let stats = Arc::new(front::FrontStats { prepare_acks: front::AckTimes::new(&members), ..Default::default() });
    let recovery = keel_block::recovery::Recovery::new(settings.recovery_mbps);
    let report = Arc::new(keel_block::report::BlockReport {
        local: local.clone(),
        front: stats.clone(),
        recovery: recovery.clone(),
    });
    let idle_ms = settings.epoch_idle_s.saturating_mul(1000);
    let service = move || BlockService::with_local(service_meta.clone(), service_local.clone()).with_idle_ms(idle_ms);
    let node = NodeBuilder::new(setup, service)
        .client(fe.client)
        .client_sessions(front::CLIENT_SESSIONS)
        .node_plane(|_, _| true)
        .report(report)
        .front_end(move |front_end| {
            front::serve(front_end, listener, local, meta, members, settings.mode, stats, recovery, tls)
        })
        .start()
        .await?;
    let scheme = if options.tls.is_some() { "nbds" } else { "nbd" };
    tracing::info!(node = id.0, nbd = %fe.listen, tls = options.tls.is_some(), "serving NBD clients");
    eprintln!("node {id}: NBD clients on {scheme}://{}", fe.listen);
    node.run_until(stopped(stop)).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `keel sim --service`: KV's and coord's models run; a service without one, or an
    /// unknown name, is an error that says which services are modelled or exist.
    #[test]
    fn the_simulator_finds_a_model_by_service_name() {
        assert!(sim_model("kv").is_ok() && sim_model("coord").is_ok() && sim_model("block").is_ok());
        let none = sim_model("null").err().unwrap_or_default();
        assert_eq!(none, "the null service has no simulator model yet; modelled: kv, coord, block");
        let unknown = sim_model("zookeeper").err().unwrap_or_default();
        assert!(unknown.starts_with("unknown --service \"zookeeper\""), "{unknown}");
    }

    #[test]
    fn every_listed_service_is_known_and_nothing_else() {
        assert!(known("kv") && known("null") && known("coord") && known("block"));
        assert!(!known("zookeeper") && !known("") && !known("KV"));
        assert_eq!(names(), "kv, null, coord, block");
        assert!(front_end("coord") && !front_end("kv") && !front_end("nope"));
    }
}
