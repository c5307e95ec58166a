//! Who may hold a session: honest clients move their sessions now and then (as a client
//! does when its node dies), and a lying front end (a Byzantine node's, which sees every
//! ordered command and knows every session id) tries to take them, keep them alive and
//! act for them.
//!
//! In the simulator each client stands for a front end. Honest ones attach their own
//! session again with a new password (a move: the proof signed with the password they
//! hold) and then touch it, which confirms the move and retires the old password; the
//! retired password is then handed to the liar, as a node a client once connected
//! through would have seen it. The liar ([`is_liar`]) runs the workload with a session
//! of its own like the others, but a quarter of its ops are lies: it attaches other
//! clients' sessions with guessed passwords, with retired ones and with honest attaches
//! replayed as its own, touches every session it knows, and writes and closes through
//! sessions that are not its own.
//!
//! The check: none of the lies succeeds (an attach of another's session is refused; an
//! op or close answers SESSION_MOVED or SESSION_EXPIRED), and no client is ever told its
//! own session moved (only the liar could have moved it). What a liar's touches would
//! do if they counted (keep a dead client's session alive) is not visible here: the
//! history holds no agreed times. `services/coord/tests/service.rs` checks that.

use crate::decoded;
use keel_coord::coord::{Command, Reply};
use keel_coord::proto::{err, Request};
use keel_coord::session_key::{SessionSecret, Verifier, PASSWORD_LEN};
use keel_sim::HistoryEntry;
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use std::collections::{BTreeMap, BTreeSet};

/// The clients that lie: one in eight (the simulator's ids start at 1000, so with two
/// clients or more there is one).
pub fn is_liar(client: u64) -> bool {
    client % 8 == 1
}

/// The share of the liar's ops that are lies.
const LIES: f64 = 0.25;
/// Honest attaches the liar keeps to replay.
const REPLAYS_KEPT: usize = 8;
/// Retired passwords the liar keeps.
const LEAKS_KEPT: usize = 32;

/// Passwords and moves, for honest clients and the liar.
#[derive(Default)]
pub(crate) struct Keys {
    /// The password each honest client holds for its session.
    held: BTreeMap<u64, SessionSecret>,
    /// The password an outstanding connect or attach will give the client.
    offered: BTreeMap<u64, SessionSecret>,
    /// Clients whose last move is not yet confirmed: the password it replaced.
    moving: BTreeMap<u64, SessionSecret>,
    /// Retired passwords, by session: the liar saw them.
    leaked: Vec<(i64, SessionSecret)>,
    /// Attaches, by session, as ordered (the liar sees them).
    attaches: Vec<(i64, Command)>,
    /// Liars whose op in flight is a lie (its answer teaches the workload nothing).
    lying: BTreeSet<u64>,
}

fn drawn(rng: &mut ChaCha8Rng) -> SessionSecret {
    SessionSecret::from_bytes(rng.gen::<[u8; PASSWORD_LEN]>())
}

impl Keys {
    /// The verifier of a new session's password.
    pub(crate) fn connect(&mut self, rng: &mut ChaCha8Rng, client: u64) -> Verifier {
        let secret = drawn(rng);
        let verifier = secret.verifier();
        self.offered.insert(client, secret);
        verifier
    }

    /// An honest client's next op if it has a move to confirm or makes one now.
    pub(crate) fn move_op(&mut self, rng: &mut ChaCha8Rng, client: u64, session: i64) -> Option<Command> {
        if self.moving.contains_key(&client) {
            return Some(Command::Touch { sessions: vec![session] });
        }
        if !rng.gen_bool(0.02) {
            return None;
        }
        let held = self.held.get(&client)?;
        let next = drawn(rng);
        let verifier = next.verifier();
        let proof = held.prove(session, client, &verifier);
        self.offered.insert(client, next);
        let attach = Command::Attach { session, proof, next: verifier, timeout: 6_000, ip: "10.0.0.1".into() };
        self.attaches.push((session, attach.clone()));
        if self.attaches.len() > REPLAYS_KEPT {
            self.attaches.remove(0);
        }
        Some(attach)
    }

    /// A lie by `liar` against the sessions of others (`sessions`: client → session),
    /// now and then. `value`: a fresh value, should it write.
    pub(crate) fn lie(
        &mut self,
        rng: &mut ChaCha8Rng,
        liar: u64,
        sessions: &BTreeMap<u64, i64>,
        value: Vec<u8>,
    ) -> Option<Command> {
        let victims: Vec<i64> = sessions.iter().filter(|(c, _)| **c != liar).map(|(_, s)| *s).collect();
        if !is_liar(liar) || victims.is_empty() || !rng.gen_bool(LIES) {
            return None;
        }
        self.lying.insert(liar);
        Some(self.lie_against(rng, liar, victims, value))
    }

    fn lie_against(&self, rng: &mut ChaCha8Rng, liar: u64, victims: Vec<i64>, value: Vec<u8>) -> Command {
        let victim = victims[rng.gen_range(0..victims.len())];
        let replays: Vec<&Command> =
            self.attaches.iter().filter(|(s, _)| victims.contains(s)).map(|(_, attach)| attach).collect();
        let leaked: Vec<&(i64, SessionSecret)> = self.leaked.iter().filter(|(s, _)| victims.contains(s)).collect();
        match rng.gen_range(0..6) {
            0 => Command::Touch { sessions: victims },
            // Replays and retired passwords of others' sessions only: one of its own
            // refused would end its own session in the workload's eyes.
            1 if !replays.is_empty() => replays[rng.gen_range(0..replays.len())].clone(),
            2 if !leaked.is_empty() => {
                let (session, secret) = leaked[rng.gen_range(0..leaked.len())];
                let next = drawn(rng).verifier();
                let proof = secret.prove(*session, liar, &next);
                Command::Attach { session: *session, proof, next, timeout: 6_000, ip: "10.6.6.6".into() }
            }
            3 => Command::Op {
                session: victim,
                request: Request::SetData { path: "/p0".into(), data: value, version: -1 },
            },
            4 => Command::Close { session: victim },
            _ => {
                let next = drawn(rng).verifier();
                let proof = drawn(rng).prove(victim, liar, &next);
                Command::Attach { session: victim, proof, next, timeout: 6_000, ip: "10.6.6.6".into() }
            }
        }
    }

    /// A client's command answered; false if it was a lie, which the workload must not
    /// learn from.
    pub(crate) fn observe(&mut self, client: u64, command: &Command, reply: &Reply) -> bool {
        if self.lying.remove(&client) {
            return false;
        }
        match (command, reply) {
            (Command::Connect { .. }, Reply::Session { .. }) => {
                self.moving.remove(&client);
                if let Some(secret) = self.offered.remove(&client) {
                    self.held.insert(client, secret);
                }
            }
            (Command::Attach { .. }, Reply::Session { .. }) => {
                if let (Some(new), Some(old)) = (self.offered.remove(&client), self.held.remove(&client)) {
                    self.held.insert(client, new);
                    self.moving.insert(client, old);
                }
            }
            (Command::Touch { sessions }, Reply::Done) => {
                if let (Some(old), Some(&session)) = (self.moving.remove(&client), sessions.first()) {
                    self.leaked.push((session, old));
                    if self.leaked.len() > LEAKS_KEPT {
                        self.leaked.remove(0);
                    }
                }
            }
            (_, Reply::Refused { err: e } | Reply::Op { err: e, .. })
                if *e == err::SESSION_EXPIRED || *e == err::SESSION_MOVED =>
            {
                self.held.remove(&client);
                self.moving.remove(&client);
            }
            _ => {}
        }
        true
    }
}

/// A command, named without its bytes (proofs, data).
fn brief(command: &Command) -> String {
    match command {
        Command::Op { request, .. } => format!("an op (opcode {})", request.opcode()),
        Command::Attach { .. } => "an attach".into(),
        Command::Close { .. } => "a close".into(),
        Command::Auth { .. } => "an auth".into(),
        Command::Touch { .. } => "a touch".into(),
        _ => "a command".into(),
    }
}

/// A reply, named without its body.
fn brief_reply(reply: &Reply) -> String {
    match reply {
        Reply::Op { zxid, err, .. } => format!("an op reply (zxid {zxid}, error {err})"),
        Reply::Session { id, .. } => format!("session {id}"),
        other => format!("{other:?}"),
    }
}

/// The one session a command acts for, if it names one.
pub(crate) fn target(command: &Command) -> Option<i64> {
    match command {
        Command::Attach { session, .. }
        | Command::Op { session, .. }
        | Command::Ops { session, .. }
        | Command::Close { session }
        | Command::Auth { session, .. } => Some(*session),
        _ => None,
    }
}

/// No client acts for a session it was not given (see the module comment). Returns
/// (the liar's lies answered, honest moves answered).
pub(crate) fn check(history: &[HistoryEntry]) -> Result<(u64, u64), String> {
    // Each session's creator (a session id is made once).
    let mut creator: BTreeMap<i64, u64> = BTreeMap::new();
    for h in history {
        if let (Command::Connect { .. }, Some((_, Reply::Session { id, .. }))) = decoded(h)? {
            creator.insert(id, h.client);
        }
    }
    let (mut lies, mut moves) = (0, 0);
    for h in history {
        let (command, ret) = decoded(h)?;
        let Some((_, reply)) = ret else { continue };
        if let Some(session) = target(&command).filter(|s| creator.get(s) != Some(&h.client)) {
            let refused = match (&command, &reply) {
                (_, Reply::Refused { .. }) => true,
                (Command::Op { .. } | Command::Close { .. }, Reply::Op { err: e, .. }) => {
                    *e == err::SESSION_MOVED || *e == err::SESSION_EXPIRED
                }
                _ => false,
            };
            if !refused {
                return Err(format!(
                    "sessions: client {} was answered {} for {} of session {session}, whose password it was never \
                     given",
                    h.client,
                    brief_reply(&reply),
                    brief(&command)
                ));
            }
            lies += 1;
            continue;
        }
        if matches!((&command, &reply), (Command::Attach { .. }, Reply::Session { .. })) {
            moves += 1;
        }
        if let Reply::Refused { err: err::SESSION_MOVED } | Reply::Op { err: err::SESSION_MOVED, .. } = reply {
            return Err(format!(
                "sessions: client {}'s own session moved away from it (only the lying front end tries to take \
                 one), answering its {}",
                h.client,
                brief(&command)
            ));
        }
    }
    Ok((lies, moves))
}
