//! The suite passes a service that keeps the contract, and catches each way of breaking
//! it: a local clock, a hash map's order, a snapshot that forgets, a read-only answer
//! that differs, a conflict declaration that is too small.

use keel_core::service::{ConcurrentService, Conflicts, ExecCtx, Item, ReadCtx, RestoreError, Service};
use keel_testkit::{Conformance, Failure};
use rand::Rng;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

/// Registers: `set K V`, `get K`, `add K` (a counter), `sum`, `ticks` (how many ran). What each
/// broken variant changes is named by `Flaw`.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Flaw {
    None,
    /// Replies carry the local clock.
    LocalClock,
    /// The snapshot iterates a HashMap (a random order per instance).
    HashOrder,
    /// The snapshot leaves out the tick count.
    ForgetsTicks,
    /// `get` read-only answers from a stale copy.
    StaleRead,
    /// `sum` declares only its first key, yet reads every key.
    UnderDeclared,
    /// A tick expires by the local clock.
    TickOnLocalClock,
}

struct Registers {
    flaw: Flaw,
    state: Arc<Mutex<State>>,
}

#[derive(Default, Clone, serde::Serialize, serde::Deserialize)]
struct State {
    map: BTreeMap<String, i64>,
    ticks: u64,
    /// What `get` answered read-only last (the stale copy of `Flaw::StaleRead`).
    #[serde(skip)]
    stale: BTreeMap<String, i64>,
}

impl Registers {
    fn new(flaw: Flaw) -> Registers {
        Registers { flaw, state: Arc::default() }
    }

    fn apply(&self, op: &[u8], ctx: &ExecCtx) -> Vec<u8> {
        let text = String::from_utf8_lossy(op).into_owned();
        let mut s = self.state.lock().expect("lock");
        let reply = match text.split(' ').collect::<Vec<_>>()[..] {
            ["set", k, v] => match v.parse() {
                Ok(v) => {
                    s.map.insert(k.into(), v);
                    "ok".to_string()
                }
                Err(_) => "error: not a number".into(),
            },
            ["get", k] => s.map.get(k).map_or("none".into(), |v| v.to_string()),
            ["add", k] => {
                let v = s.map.entry(k.into()).or_default();
                *v += 1;
                v.to_string()
            }
            ["sum"] => s.map.values().sum::<i64>().to_string(),
            ["ticks"] => s.ticks.to_string(),
            _ => "error: unknown".into(),
        };
        if self.flaw == Flaw::LocalClock {
            let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
            return format!("{reply} at {nanos}").into_bytes();
        }
        let _ = ctx;
        reply.into_bytes()
    }
}

impl ConcurrentService for Registers {
    fn execute_shared(&self, op: &[u8], ctx: &ExecCtx) -> Vec<u8> {
        self.apply(op, ctx)
    }
}

impl Service for Registers {
    fn execute(&mut self, op: &[u8], ctx: &ExecCtx) -> Vec<u8> {
        self.apply(op, ctx)
    }

    fn conflicts(&self, op: &[u8]) -> Conflicts {
        let text = String::from_utf8_lossy(op).into_owned();
        match text.split(' ').collect::<Vec<_>>()[..] {
            ["set" | "add", k, ..] => Conflicts::write(Item::Key(k.as_bytes().to_vec())),
            ["get", k] => Conflicts::read(Item::Key(k.as_bytes().to_vec())),
            ["sum"] if self.flaw == Flaw::UnderDeclared => Conflicts::read(Item::Key(b"a".to_vec())),
            ["sum"] => Conflicts::read(Item::Prefix(Vec::new())),
            _ => Conflicts::none(),
        }
    }

    fn concurrent(&self) -> Option<Arc<dyn ConcurrentService>> {
        Some(Arc::new(Registers { flaw: self.flaw, state: self.state.clone() }))
    }

    fn execute_read_only(&self, op: &[u8], _ctx: &ReadCtx) -> Option<Vec<u8>> {
        let text = String::from_utf8_lossy(op).into_owned();
        let ["get", k] = text.split(' ').collect::<Vec<_>>()[..] else { return None };
        let mut s = self.state.lock().expect("lock");
        let answer = if self.flaw == Flaw::StaleRead { s.stale.get(k).copied() } else { s.map.get(k).copied() };
        s.stale = s.map.clone();
        Some(answer.map_or("none".into(), |v| v.to_string()).into_bytes())
    }

    fn on_tick(&mut self, ctx: &ExecCtx) {
        let mut s = self.state.lock().expect("lock");
        s.ticks += 1;
        if self.flaw == Flaw::TickOnLocalClock {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
            s.ticks += (now % 7) as u64;
        }
        let _ = ctx;
    }

    fn snapshot(&self) -> Vec<u8> {
        let s = self.state.lock().expect("lock");
        match self.flaw {
            Flaw::HashOrder => {
                let map: HashMap<&String, &i64> = s.map.iter().collect();
                let pairs: Vec<(&String, &i64)> = map.into_iter().collect();
                postcard::to_allocvec(&(pairs, s.ticks)).unwrap_or_default()
            }
            Flaw::ForgetsTicks => postcard::to_allocvec(&(&s.map, 0u64)).unwrap_or_default(),
            _ => postcard::to_allocvec(&(&s.map, s.ticks)).unwrap_or_default(),
        }
    }

    fn restore(&mut self, snapshot: &[u8]) -> Result<(), RestoreError> {
        let (map, ticks): (BTreeMap<String, i64>, u64) = if self.flaw == Flaw::HashOrder {
            let (pairs, ticks): (Vec<(String, i64)>, u64) =
                postcard::from_bytes(snapshot).map_err(|e| RestoreError(e.to_string()))?;
            (pairs.into_iter().collect(), ticks)
        } else {
            postcard::from_bytes(snapshot).map_err(|e| RestoreError(e.to_string()))?
        };
        let mut s = self.state.lock().expect("lock");
        s.map = map;
        s.ticks = if self.flaw == Flaw::ForgetsTicks { 0 } else { ticks };
        Ok(())
    }
}

fn suite(flaw: Flaw) -> Result<(), Failure> {
    Conformance::new(move || Registers::new(flaw))
        .workload(|rng, _client| {
            // Thirty keys: enough that a hash map's order differs between two maps.
            let k = ["a", "b", "c", "d"][rng.gen_range(0..4)].to_string() + &rng.gen_range(0..8).to_string();
            match rng.gen_range(0..10) {
                0..=2 => format!("set {k} {}", rng.gen_range(-5..50)),
                3..=5 => format!("get {k}"),
                6..=7 => format!("add {k}"),
                8 => ["sum", "ticks"][rng.gen_range(0..2)].to_string(),
                _ => "set x not-a-number".to_string(),
            }
            .into_bytes()
        })
        .tick_ms(50)
        .run()
}

#[test]
fn a_service_that_keeps_the_contract_passes() {
    assert_eq!(suite(Flaw::None), Ok(()));
}

#[test]
fn a_reply_from_the_local_clock_is_caught() {
    assert!(matches!(suite(Flaw::LocalClock), Err(Failure::Nondeterministic { .. })), "{:?}", suite(Flaw::LocalClock));
}

#[test]
fn a_snapshot_in_hash_map_order_is_caught() {
    assert!(matches!(suite(Flaw::HashOrder), Err(Failure::Nondeterministic { .. })), "{:?}", suite(Flaw::HashOrder));
}

#[test]
fn a_tick_by_the_local_clock_is_caught() {
    let got = suite(Flaw::TickOnLocalClock);
    assert!(matches!(got, Err(Failure::Nondeterministic { .. })), "{got:?}");
}

#[test]
fn a_snapshot_that_forgets_state_is_caught() {
    let got = suite(Flaw::ForgetsTicks);
    assert!(matches!(got, Err(Failure::Snapshot { .. })), "{got:?}");
}

#[test]
fn a_read_only_answer_that_differs_from_execution_is_caught() {
    let got = suite(Flaw::StaleRead);
    assert!(matches!(got, Err(Failure::ReadOnly { .. })), "{got:?}");
}

#[test]
fn an_under_declared_conflict_is_caught() {
    let got = suite(Flaw::UnderDeclared);
    assert!(matches!(got, Err(Failure::Conflicts { .. })), "{got:?}");
}
