//! The services this binary runs, by the name `keel init --service` writes into
//! cluster.toml and `keel node` reads back. One table: a name that is not in it is an
//! error wherever it appears (issue #22: `keel node` used to run KV for any unknown name).

use keel_runtime::config::NodeSetup;
use keel_runtime::embed::Control;
use keel_runtime::node::NodeError;

/// A service this binary runs.
pub struct ServiceInfo {
    pub name: &'static str,
    /// The agreed-time tick `keel init` configures for it (`Service::on_tick`).
    pub tick_ms: Option<u64>,
}

/// In the order `--help` and errors list them.
pub const SERVICES: [ServiceInfo; 2] = [
    // The replicated key-value store (`keel kv`). Watch leases end at the next tick, also
    // while no client writes.
    ServiceInfo { name: "kv", tick_ms: Some(1_000) },
    // Empty requests: the microbenchmark service.
    ServiceInfo { name: "null", tick_ms: None },
];

/// The names, for messages: "kv, null".
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

/// Runs the node `setup` describes with its service until `control` stops it; an unknown
/// name is an error before anything starts.
pub async fn run(setup: NodeSetup, control: Control) -> Result<(), String> {
    let result: Result<(), NodeError> = match setup.service.as_str() {
        "kv" => keel_runtime::node::run_controlled(setup, keel_kv::Kv::new, control).await,
        "null" => keel_runtime::node::run_controlled(setup, || keel_null::Null, control).await,
        other => {
            return Err(format!(
                "unknown service {other:?} in the cluster configuration; this binary runs: {}",
                names()
            ))
        }
    };
    result.map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_listed_service_is_known_and_nothing_else() {
        assert!(known("kv") && known("null"));
        assert!(!known("zookeeper") && !known("") && !known("KV"));
        assert_eq!(names(), "kv, null");
    }
}
