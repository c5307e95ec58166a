//! coord's watches, judged from the history and the push streams the clients accepted
//! (the checks are listed in the crate doc).
//!
//! What the checks stand on:
//! - A client accepts a push event only once r + 1 nodes sent it alike, and delivers its
//!   events in the order of their numbers, which is decided order (the simulator checks
//!   both). Events may be lost (a full queue, a restart): the client is then told of a
//!   gap. So a client's stream is a subsequence of what coord pushed it, in order, with
//!   every loss marked.
//! - Ordered commands are linearizable: an op that returned before another was invoked
//!   ran first. A reply's zxid (a write's, a failed write's, an addWatch's, a session's)
//!   is the state's zxid when it ran; a read's is 0 and says nothing. So the zxid a
//!   watching read saw, R, lies between the largest zxid answered before it was invoked
//!   (and its stat's zxids) and the smallest zxid answered by an op invoked after it
//!   returned (less one if that op was a transaction).
//! - A transaction the history knows (an answered op that changed the state: its reply's
//!   zxid is the transaction's) changed exactly what that op changes. Transactions the
//!   history does not know (ops without an answer, session expiries at ticks) are not
//!   judged.
//! - Watches are never removed here (no removeWatches), and `/q` and `/e`, the only
//!   paths with child watches, are never deleted: a NODE_DELETED event is a data or
//!   persistent watch's.
//! - No transaction makes two changes that fire one persistent watch with the same kind
//!   and path (coord, like ZooKeeper, fires per change, so a multi creating two
//!   children of a persistently watched znode would send that session two equal
//!   events): persistent watches sit on `/q` (one sequential create per transaction),
//!   one `/p` path (single ops) and, recursively, `/e` (NODE_CHILDREN_CHANGED, which a
//!   session's end fires once per ephemeral, does not reach recursive watches). So an
//!   event twice is an error.

use crate::{decoded, multi_results, persistent_session, Stats};
use keel_coord::coord::{Command, Push, Reply};
use keel_coord::jute::Reader;
use keel_coord::proto::{err, event, Request, Stat};
use keel_coord::tree::split;
use keel_core::client::Pushed;
use keel_sim::HistoryEntry;
use std::collections::{BTreeMap, BTreeSet};

/// A history entry, decoded: the entry, its command, its answer (when and what).
type Entry<'a> = (&'a HistoryEntry, Command, Option<(u64, Reply)>);

/// A change one transaction made, as the history knows it.
#[derive(Debug)]
enum Change {
    Created(String),
    Deleted(String),
    Data(String),
    /// A sequential create without an answer: its name is this prefix and ten digits.
    CreatedSequential(String),
    /// closeSession or expiry: the session's ephemerals (all under `/e`, which ones the
    /// history does not say exactly) went.
    SessionEnd,
}

/// A transaction the history knows.
struct Transaction {
    /// The history entry that made it.
    entry: usize,
    changes: Vec<Change>,
}

/// What a watch is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Class {
    /// One-shot, set by getData or exists.
    Data,
    /// One-shot, set by getChildren.
    Child,
    /// addWatch mode 0.
    Persistent,
    /// addWatch mode 1: the path and everything under it.
    Recursive,
}

/// One watch a session set (or may have set: a request without an answer).
#[derive(Debug)]
struct Watch {
    session: i64,
    client: u64,
    class: Class,
    path: String,
    /// Bounds on the zxid of the state the registering request ran on: `lo <= R <=
    /// hi` (`hi` is `i64::MAX` when unknown).
    lo: i64,
    hi: i64,
    /// The request answered, so the watch was surely set.
    set: bool,
    invoke: u64,
}

/// One item of a client's push stream.
#[derive(Debug)]
enum Item {
    Watch { session: i64, zxid: i64, kind: i32, path: String },
    Expired(i64),
    Gap,
}

/// `path` lies under `root` or is it.
fn within(path: &str, root: &str) -> bool {
    path == root || root == "/" || path.strip_prefix(root).is_some_and(|rest| rest.starts_with('/'))
}

/// Whether a watch of `class` on `watched` is fired with an event `kind` on `path`.
fn covers(class: Class, watched: &str, kind: i32, path: &str) -> bool {
    let node = matches!(kind, event::NODE_CREATED | event::NODE_DELETED | event::NODE_DATA_CHANGED);
    match class {
        Class::Data => node && path == watched,
        Class::Child => path == watched && matches!(kind, event::NODE_CHILDREN_CHANGED | event::NODE_DELETED),
        Class::Persistent => path == watched && (node || kind == event::NODE_CHILDREN_CHANGED),
        Class::Recursive => node && within(path, watched),
    }
}

/// The events `change` fires (watched or not): (kind, path). A closed session's
/// ephemerals are not known by name: None.
fn events_of(change: &Change) -> Option<Vec<(i32, String)>> {
    let with_parent =
        |kind: i32, p: &str| vec![(kind, p.to_string()), (event::NODE_CHILDREN_CHANGED, split(p).0.into())];
    Some(match change {
        Change::Created(p) => with_parent(event::NODE_CREATED, p),
        Change::Deleted(p) => with_parent(event::NODE_DELETED, p),
        Change::Data(p) => vec![(event::NODE_DATA_CHANGED, p.clone())],
        Change::CreatedSequential(_) | Change::SessionEnd => return None,
    })
}

/// Whether a transaction with `change` may fire event `kind` on `path`.
fn may_fire(change: &Change, kind: i32, path: &str) -> bool {
    match events_of(change) {
        Some(events) => events.iter().any(|(k, p)| *k == kind && p == path),
        None => match change {
            Change::CreatedSequential(prefix) => {
                let named = |p: &str| {
                    p.strip_prefix(prefix.as_str())
                        .is_some_and(|n| n.len() == 10 && n.bytes().all(|b| b.is_ascii_digit()))
                };
                (kind == event::NODE_CREATED && named(path))
                    || (kind == event::NODE_CHILDREN_CHANGED && path == split(prefix).0)
            }
            _ => {
                (kind == event::NODE_DELETED && path.starts_with("/e/"))
                    || (kind == event::NODE_CHILDREN_CHANGED && path == "/e")
            }
        },
    }
}

/// The changes transactions the history does not know may have made: those of the
/// writes and closes without an answer, and a session's end (by expiry at a tick).
fn unknown_changes(entries: &[Entry]) -> Vec<Change> {
    let mut out = vec![Change::SessionEnd];
    let add = |request: &Request, out: &mut Vec<Change>| match request {
        Request::Create { path, flags: 2 | 3, .. } => out.push(Change::CreatedSequential(path.clone())),
        Request::Create { path, .. } => out.push(Change::Created(path.clone())),
        Request::SetData { path, .. } => out.push(Change::Data(path.clone())),
        Request::Delete { path, .. } => out.push(Change::Deleted(path.clone())),
        _ => {}
    };
    for (_, command, ret) in entries {
        match (command, ret) {
            (Command::Op { request: Request::Multi(ops), .. }, None) => ops.iter().for_each(|op| add(op, &mut out)),
            (Command::Op { request, .. }, None) => add(request, &mut out),
            _ => {}
        }
    }
    out
}

/// Judges the watches (see the crate doc); counts into `stats`.
pub(crate) fn check(
    history: &[HistoryEntry],
    pushes: &BTreeMap<u64, Vec<(u64, Pushed)>>,
    stats: &mut Stats,
) -> Result<(), String> {
    let entries: Vec<Entry> = history.iter().map(|h| decoded(h).map(|(c, r)| (h, c, r))).collect::<Result<_, _>>()?;
    let transactions = transactions(&entries)?;
    let watches = watches(&entries, &transactions)?;
    stats.one_shot_watches =
        watches.iter().filter(|w| w.set && matches!(w.class, Class::Data | Class::Child)).count() as u64;
    stats.persistent_watches =
        watches.iter().filter(|w| w.set && !matches!(w.class, Class::Data | Class::Child)).count() as u64;
    let streams = streams(pushes, stats)?;
    let owners: BTreeMap<i64, u64> = entries
        .iter()
        .filter_map(|(h, _, ret)| match ret {
            Some((_, Reply::Session { id, .. })) => Some((*id, h.client)),
            _ => None,
        })
        .collect();
    check_streams(&streams, &owners)?;
    check_changes(&streams, &transactions, &unknown_changes(&entries), stats)?;
    check_set_before(&streams, &watches, stats)?;
    check_owed(&streams, &watches, &transactions, stats)
}

/// The transactions the history knows, by zxid.
fn transactions(entries: &[Entry]) -> Result<BTreeMap<i64, Transaction>, String> {
    let mut out: BTreeMap<i64, Transaction> = BTreeMap::new();
    for (i, (_, command, ret)) in entries.iter().enumerate() {
        let (zxid, changes) = match (command, ret) {
            (Command::Connect { .. }, Some((_, Reply::Session { zxid, .. }))) => (*zxid, Vec::new()),
            (Command::Close { .. }, Some((_, Reply::Op { zxid, err: err::OK, .. }))) => {
                (*zxid, vec![Change::SessionEnd])
            }
            (Command::Op { request, .. }, Some((_, Reply::Op { zxid, err: err::OK, body }))) => match request {
                Request::Create { .. } => {
                    let name = Reader::new(body).string().map_err(|e| format!("a create's name: {e}"))?;
                    (*zxid, vec![Change::Created(name)])
                }
                Request::SetData { path, .. } => (*zxid, vec![Change::Data(path.clone())]),
                Request::Delete { path, .. } => (*zxid, vec![Change::Deleted(path.clone())]),
                // A multi that applied (every op OK) is a transaction, even of checks only.
                Request::Multi(ops) if !ops.is_empty() => {
                    if !multi_results(body, ops)?.iter().all(|(e, _)| *e == err::OK) {
                        continue;
                    }
                    let changes = ops
                        .iter()
                        .filter_map(|op| match op {
                            // The workload's multis create no sequential znodes.
                            Request::Create { path, .. } => Some(Change::Created(path.clone())),
                            Request::SetData { path, .. } => Some(Change::Data(path.clone())),
                            Request::Delete { path, .. } => Some(Change::Deleted(path.clone())),
                            _ => None,
                        })
                        .collect();
                    (*zxid, changes)
                }
                _ => continue,
            },
            _ => continue,
        };
        if out.insert(zxid, Transaction { entry: i, changes }).is_some() {
            return Err(format!("two answered transactions have zxid {zxid}"));
        }
    }
    Ok(out)
}

/// What answered entry `i` says of the zxids of the states around it: (the state's
/// zxid after it ran, the largest zxid a state before it ran can have: one less if it
/// was a transaction).
fn zxid_of(i: usize, ret: &Option<(u64, Reply)>, transactions: &BTreeMap<i64, Transaction>) -> Option<(i64, i64)> {
    let zxid = match ret {
        Some((_, Reply::Session { zxid, .. })) => *zxid,
        // Reads answer 0: nothing known.
        Some((_, Reply::Op { zxid, .. })) if *zxid > 0 => *zxid,
        _ => return None,
    };
    let made = transactions.get(&zxid).is_some_and(|t| t.entry == i);
    Some((zxid, if made { zxid - 1 } else { zxid }))
}

/// Every watch the history's requests set or may have set, with bounds on the zxid each
/// ran on.
fn watches(entries: &[Entry], transactions: &BTreeMap<i64, Transaction>) -> Result<Vec<Watch>, String> {
    let zxids: Vec<Option<(i64, i64)>> =
        entries.iter().enumerate().map(|(i, (_, _, r))| zxid_of(i, r, transactions)).collect();
    let mut out = Vec::new();
    for (i, (h, command, ret)) in entries.iter().enumerate() {
        let Command::Op { session, request } = command else { continue };
        let (class, path) = match request {
            Request::GetData { path, watch: true } | Request::Exists { path, watch: true } => (Class::Data, path),
            Request::GetChildren { path, watch: true, .. } => (Class::Child, path),
            Request::AddWatch { path, mode: 0 } => (Class::Persistent, path),
            Request::AddWatch { path, mode: 1 } => (Class::Recursive, path),
            _ => continue,
        };
        let returned = ret.as_ref().map(|(t, _)| *t);
        // Bounds from the ops ordered before it and after it in real time (the same
        // client's ops follow one another).
        let (mut lo, mut hi) = (0, i64::MAX);
        for (j, (e, _, r)) in entries.iter().enumerate() {
            let Some((after, before)) = zxids[j] else { continue };
            let e_returned = r.as_ref().map(|(t, _)| *t);
            let same = e.client == h.client;
            if e_returned.is_some_and(|t| t < h.invoke || (same && j < i)) {
                lo = lo.max(after);
            }
            if returned.is_some_and(|t| t < e.invoke || (same && j > i)) {
                hi = hi.min(before);
            }
        }
        // addWatch and every ordered watching read answer the zxid they ran at (which
        // must lie within the bounds); the bounds also hold a reply that does not.
        if let Some((_, Reply::Op { zxid, .. })) = ret {
            if *zxid > 0 {
                (lo, hi) = (lo.max(*zxid), hi.min(*zxid));
            }
        }
        let set = match (request, ret) {
            (_, None) => false,
            (Request::AddWatch { .. }, Some((_, Reply::Op { err: err::OK, .. }))) => true,
            (Request::GetData { .. }, Some((_, Reply::Op { err: err::OK, body, .. }))) => {
                let mut r = Reader::new(body);
                let stat = r.buffer().and_then(|_| Stat::read(&mut r)).map_err(|e| format!("getData's stat: {e}"))?;
                lo = lo.max(stat.mzxid).max(stat.pzxid);
                true
            }
            (Request::Exists { .. }, Some((_, Reply::Op { err: err::OK, body, .. }))) => {
                let stat = Stat::read(&mut Reader::new(body)).map_err(|e| format!("exists' stat: {e}"))?;
                lo = lo.max(stat.mzxid).max(stat.pzxid);
                true
            }
            // exists sets its watch on a znode that is not there too.
            (Request::Exists { .. }, Some((_, Reply::Op { err: err::NO_NODE, .. }))) => true,
            (Request::GetChildren { .. }, Some((_, Reply::Op { err: err::OK, .. }))) => true,
            // Refused, or a read that found nothing: no watch.
            _ => continue,
        };
        if lo > hi {
            return Err(format!(
                "a watching request invoked at {} ms ran at a zxid in {lo}..={hi}: its answer's zxids and those of \
                 the ops before and after it disagree",
                h.invoke
            ));
        }
        out.push(Watch {
            session: *session,
            client: h.client,
            class,
            path: path.clone(),
            lo,
            hi,
            set,
            invoke: h.invoke,
        });
    }
    Ok(out)
}

/// Each client's push stream, decoded.
fn streams(pushes: &BTreeMap<u64, Vec<(u64, Pushed)>>, stats: &mut Stats) -> Result<BTreeMap<u64, Vec<Item>>, String> {
    let mut out = BTreeMap::new();
    for (client, items) in pushes {
        let mut stream = Vec::with_capacity(items.len());
        for (_, pushed) in items {
            stream.push(match pushed {
                Pushed::Gap { .. } => {
                    stats.push_gaps += 1;
                    Item::Gap
                }
                Pushed::Event { seq, event } => match Push::decode(event) {
                    Some(Push::Watch { session, zxid, kind, path }) => {
                        stats.watch_events += 1;
                        Item::Watch { session, zxid, kind, path }
                    }
                    Some(Push::Expired { session }) => Item::Expired(session),
                    None => return Err(format!("client {client} accepted push {seq}, which is no coord push")),
                },
            });
        }
        out.insert(*client, stream);
    }
    Ok(out)
}

/// A client's events come in zxid order, none twice (see the module doc for why twice
/// is wrong here), each for a session of its own.
fn check_streams(streams: &BTreeMap<u64, Vec<Item>>, owners: &BTreeMap<i64, u64>) -> Result<(), String> {
    for (client, stream) in streams {
        let mut last = i64::MIN;
        let mut seen = BTreeSet::new();
        for item in stream {
            let Item::Watch { session, zxid, kind, path } = item else { continue };
            if *zxid < last {
                return Err(format!("client {client} got a watch event at zxid {zxid} after one at zxid {last}"));
            }
            last = *zxid;
            if !seen.insert((*session, *zxid, *kind, path.clone())) {
                return Err(format!("session {session:#x} got event {kind} on {path} at zxid {zxid} twice"));
            }
            if let Some(owner) = owners.get(session).filter(|o| *o != client) {
                return Err(format!("client {client} got an event of session {session:#x}, client {owner}'s"));
            }
        }
    }
    Ok(())
}

/// An event whose zxid is a transaction the history knows names a change it made; one
/// at another zxid names a change a transaction the history does not know may have
/// made (`unknown`).
fn check_changes(
    streams: &BTreeMap<u64, Vec<Item>>,
    transactions: &BTreeMap<i64, Transaction>,
    unknown: &[Change],
    stats: &mut Stats,
) -> Result<(), String> {
    for stream in streams.values() {
        for item in stream {
            let Item::Watch { session, zxid, kind, path } = item else { continue };
            let Some(t) = transactions.get(zxid) else {
                stats.events_at_unknown_zxids += 1;
                if !unknown.iter().any(|c| may_fire(c, *kind, path)) {
                    return Err(format!(
                        "session {session:#x} got event {kind} on {path} at zxid {zxid}, a transaction the history \
                         does not know, and neither an op without an answer nor a session's end makes that change"
                    ));
                }
                continue;
            };
            stats.events_against_changes += 1;
            if !t.changes.iter().any(|c| may_fire(c, *kind, path)) {
                return Err(format!(
                    "session {session:#x} got event {kind} on {path} at zxid {zxid}, but that transaction made {:?}",
                    t.changes
                ));
            }
        }
    }
    Ok(())
}

/// Every event is for a watch its session set before the change: a one-shot watch
/// fires once, so between two events of one watch (its class and path) the session set
/// it again; a persistent one needs only to have been set before.
fn check_set_before(streams: &BTreeMap<u64, Vec<Item>>, watches: &[Watch], stats: &mut Stats) -> Result<(), String> {
    // Per session, watch class and path: the zxids of its events, ascending.
    let mut events: BTreeMap<(i64, Class, String), Vec<i64>> = BTreeMap::new();
    for stream in streams.values() {
        for item in stream {
            let Item::Watch { session, zxid, kind, path } = item else { continue };
            if persistent_session(*session) {
                let explained = watches.iter().any(|w| {
                    w.session == *session
                        && matches!(w.class, Class::Persistent | Class::Recursive)
                        && covers(w.class, &w.path, *kind, path)
                        && w.lo < *zxid
                });
                if !explained {
                    return Err(format!(
                        "session {session:#x} got event {kind} on {path} at zxid {zxid}, for no addWatch it made before"
                    ));
                }
                continue;
            }
            let class = if *kind == event::NODE_CHILDREN_CHANGED { Class::Child } else { Class::Data };
            events.entry((*session, class, path.clone())).or_default().push(*zxid);
        }
    }
    for ((session, class, path), mut zxids) in events {
        zxids.sort_unstable();
        let mut candidates: Vec<&Watch> =
            watches.iter().filter(|w| w.session == session && w.class == class && w.path == path).collect();
        let mut previous = i64::MIN;
        for zxid in zxids {
            // The watch it used up ran after the previous event (which used up every
            // earlier one) and before this change. Of those that may have, take the one
            // whose bound ends first (a greedy matching, optimal for these intervals).
            let pick = candidates
                .iter()
                .enumerate()
                .filter(|(_, w)| w.lo < zxid && w.hi >= previous)
                .min_by_key(|(_, w)| w.hi)
                .map(|(i, _)| i);
            let Some(i) = pick else {
                let prev = if previous == i64::MIN { "none".to_string() } else { previous.to_string() };
                return Err(format!(
                    "session {session:#x} got a {class:?} watch event on {path} at zxid {zxid} (its previous one: {prev}), \
                     but set no such watch after the previous event and before the change: a one-shot watch fired \
                     twice, or for a change made before it was set"
                ));
            };
            candidates.remove(i);
            stats.one_shot_events += 1;
            previous = zxid;
        }
    }
    Ok(())
}

/// A watch set, a later change it fires for, and the client's stream intact past that
/// change: the event is there. "Intact past": a later event (zxid above the change's)
/// came, with no gap and no end of the session before it; since the stream is in
/// decided order, the owed event would have come before it.
fn check_owed(
    streams: &BTreeMap<u64, Vec<Item>>,
    watches: &[Watch],
    transactions: &BTreeMap<i64, Transaction>,
    stats: &mut Stats,
) -> Result<(), String> {
    let empty = Vec::new();
    for w in watches.iter().filter(|w| w.set) {
        let stream = streams.get(&w.client).unwrap_or(&empty);
        // The events `t` owes this watch: (kind, path); None if unknown.
        let owed = |t: &Transaction| -> Option<Vec<(i32, String)>> {
            let mut out = Vec::new();
            for c in &t.changes {
                out.extend(events_of(c)?.into_iter().filter(|(k, p)| covers(w.class, &w.path, *k, p)));
            }
            Some(out)
        };
        // Transactions ordered after the watch was set: zxid above `hi`.
        let mut later = transactions.range(w.hi.saturating_add(1)..);
        // The stream before its first event past `zxid`, if that event came with no gap
        // and no end of the session before it.
        let intact_until = |zxid: i64| -> Option<&[Item]> {
            let end = stream.iter().position(|i| matches!(i, Item::Watch { zxid: z, .. } if *z > zxid))?;
            let before = &stream[..end];
            let broken =
                before.iter().any(|i| matches!(i, Item::Gap) || matches!(i, Item::Expired(s) if *s == w.session));
            (!broken).then_some(before)
        };
        let has = |before: &[Item], ok: &dyn Fn(i32, &str, i64) -> bool| {
            before.iter().any(|i| matches!(i, Item::Watch { session, zxid, kind, path } if *session == w.session && ok(*kind, path, *zxid)))
        };
        match w.class {
            Class::Data | Class::Child => {
                // The first later change known to fire it (one of unknown effect may fire
                // it first: its event is then earlier still, which the check allows).
                let Some((&zxid, _)) = later.find(|(_, t)| owed(t).is_some_and(|o| !o.is_empty())) else {
                    continue;
                };
                let Some(before) = intact_until(zxid) else { continue };
                stats.owed_events += 1;
                if !has(before, &|k, p, z| covers(w.class, &w.path, k, p) && z > w.lo && z <= zxid) {
                    return Err(format!(
                        "session {:#x} set a {:?} watch on {} (invoked at {} ms) and the transaction at zxid {zxid} \
                         fires it, but no event came, though later ones did",
                        w.session, w.class, w.path, w.invoke
                    ));
                }
            }
            Class::Persistent | Class::Recursive => {
                for (zxid, t) in later {
                    let Some(events) = owed(t) else { continue };
                    if events.is_empty() {
                        continue;
                    }
                    let Some(before) = intact_until(*zxid) else { continue };
                    for (kind, path) in events {
                        stats.owed_events += 1;
                        if !has(before, &|k, p, z| k == kind && p == path && z == *zxid) {
                            return Err(format!(
                                "session {:#x} set a {:?} watch on {} (invoked at {} ms); the transaction at zxid \
                                 {zxid} owes it event {kind} on {path}, but none came, though later ones did",
                                w.session, w.class, w.path, w.invoke
                            ));
                        }
                    }
                }
            }
        }
    }
    Ok(())
}
