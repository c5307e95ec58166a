//! Restart from durable state: the latest snapshot plus the write-ahead log.
//!
//! The rebuilt node keeps every promise it made before the crash: it re-enters the highest
//! view it installed (or the view change it committed to), remembers the proposal it
//! accepted for each instance of that view and every prepared certificate, and re-executes
//! the decided values above its snapshot. Whatever it misses it learns from peers. It
//! keeps the NEW-VIEW of its view too: the proof it relays to peers in lower views.

use super::{NodeSecrets, Outputs, Replica};
use crate::config::ClusterConfig;
use crate::exec::Chunked;
use crate::membership::Membership;
use crate::message::{Cert, Seq};
use crate::service::{RestoreError, Service};
use crate::wal::Record;

/// What a node finds on its disk at start.
#[derive(Clone, Debug, Default)]
pub struct Durable {
    /// Every completely persisted snapshot, by the checkpoint it belongs to, in the
    /// chunks it was written as (its root depends on them).
    pub snapshots: Vec<(Seq, Chunked)>,
    /// The log's records, in order, up to its last whole record.
    pub records: Vec<Record>,
}

impl Durable {
    /// The membership a node restarting from this state runs, when it is not the
    /// configuration file's: the one its epoch certificates lead to (replica/epoch.rs).
    /// A node that stopped between the end of an epoch and the start of the next has no
    /// certificate for the next yet: it recovers in the old epoch and ends it again.
    pub fn membership(&self) -> Option<Membership> {
        self.records.iter().rev().find_map(|r| match r {
            Record::Epoch(certs) => certs.last().map(|c| c.next.clone()),
            _ => None,
        })
    }
}

impl<S: Service> Replica<S> {
    /// Rebuilds a node from its snapshot (if any) and its log records, in log order.
    ///
    /// # Errors
    /// If the snapshot does not restore (the node must then be re-imaged from peers).
    pub fn recover(
        cfg: ClusterConfig,
        id: crate::message::NodeId,
        secrets: NodeSecrets,
        service: S,
        durable: Durable,
        now: u64,
        out: &mut Outputs,
    ) -> Result<Replica<S>, RestoreError> {
        let mut r = Replica::new(cfg, id, secrets, service);
        let index = r.id;
        r.now = now;
        let Durable { mut snapshots, records } = durable;
        snapshots.sort_by_key(|(seq, _)| *seq);
        let mut snapshot_seq: Seq = Seq(0);
        if let Some((seq, chunked)) = snapshots.last() {
            snapshot_seq =
                r.exec.restore_chunked(chunked).map_err(|e| RestoreError(format!("snapshot at {seq}: {}", e.0)))?;
        }
        for (seq, chunked) in snapshots {
            if seq > Seq(0) {
                r.own_checkpoints.insert(seq, chunked);
            }
        }
        // Pass 1: positions that later records are interpreted against.
        let mut proof: Option<&crate::message::NewView> = None;
        for rec in &records {
            match rec {
                Record::NewView(nv) if proof.is_none_or(|p| nv.view >= p.view) => proof = Some(nv),
                Record::View { view, floor } if *view >= r.view => {
                    r.view = *view;
                    r.floor = *floor;
                }
                Record::ViewChangeSent { view } if r.vc_target.is_none_or(|t| *view > t) => r.vc_target = Some(*view),
                Record::Stable(p) if p.seq > r.stable.seq => r.stable = p.clone(),
                Record::Epoch(certs) => r.epoch_certs = certs.clone(),
                Record::Rejoining { bounds } => r.rejoin = Some(super::rejoin::Rejoin::with_bounds(*bounds)),
                Record::Rejoined => r.rejoin = None,
                Record::VoteHorizon { view, seq } if r.vote_horizon.is_none_or(|h| (*view, *seq) > h) => {
                    r.vote_horizon = Some((*view, *seq));
                }
                _ => {}
            }
        }
        // The proof of the view recovered into, to relay to laggards (catch_up.rs). Written
        // before its View record, so it is here whenever that record is; from our own
        // disk, so not checked again.
        r.new_view = proof.filter(|nv| nv.view == r.view).cloned();
        // WRITEs may have left for instances up to the horizon without their Accepted
        // records (normal.rs, `cover_vote`): in that view, no vote up to it.
        r.abstain = r.vote_horizon;
        if r.vc_target.is_some_and(|t| t <= r.view) {
            r.vc_target = None;
        }
        if let Some(t) = r.vc_target {
            r.stop_sent = t;
            r.stops[index.index()] = t;
            r.view_change_timeout.restart(now);
        }
        // Pass 2: per-instance state above the stable checkpoint.
        let view = r.view;
        let low = r.stable.seq;
        let byzantine = r.byzantine_mode();
        for rec in records {
            match rec {
                Record::Accepted { view: v, seq, value } if seq > low => {
                    let slot = r.log.entry(seq).or_default();
                    if !byzantine && slot.cert.as_ref().is_none_or(|c| c.view <= v) {
                        // CFT: the accepted proposal is the certificate (Paxos).
                        slot.cert = Some(Cert { view: v, seq, value: value.clone(), writes: Vec::new() });
                    }
                    let d = value.digest();
                    if v == view {
                        slot.enter_view(view);
                        slot.accept_sent |= !byzantine;
                        slot.value = Some((value, d));
                        if r.cfg.primary(view) == index {
                            r.next_propose = r.next_propose.max(seq + 1);
                        }
                    } else if v < view {
                        // A body a later NEW-VIEW may name by digest (`Slot::earlier`).
                        slot.keep_earlier(v, value, d);
                    }
                }
                Record::Prepared(cert) if cert.seq > low => {
                    let slot = r.log.entry(cert.seq).or_default();
                    if cert.view == view {
                        slot.enter_view(view);
                        slot.accept_sent = true;
                    }
                    if slot.cert.as_ref().is_none_or(|c| c.view <= cert.view) {
                        slot.cert = Some(cert);
                    }
                }
                Record::Decided { seq, digest } if seq > low => {
                    r.log.entry(seq).or_default().decided = Some(digest);
                }
                Record::DecidedValue { seq, value } if seq > low => {
                    r.log.entry(seq).or_default().decided_value = Some(value);
                }
                Record::ExecStable(proof) if r.cfg.separated() => r.recover_exec_stable(proof),
                _ => {}
            }
        }
        r.log.retain(|seq, _| *seq <= low + r.cfg.options.log_max());
        for slot in r.log.values_mut() {
            let Some(d) = slot.decided else { continue };
            if slot.decided_value.as_ref().is_some_and(|v| v.digest() != d) {
                slot.decided_value = None;
            }
            if slot.decided_value.is_none() {
                let from_value = slot.value.as_ref().filter(|(_, x)| *x == d).map(|(v, _)| v.clone());
                let from_cert = slot.cert.as_ref().filter(|c| c.digest() == d).map(|c| c.value.clone());
                slot.decided_value = from_value.or(from_cert);
            }
        }
        for slot in r.log.values() {
            if let Some((v, _)) = &slot.value {
                r.time_proposed = r.time_proposed.max(v.time);
            }
        }
        r.next_propose = r.next_propose.max(r.floor + 1).max(r.stable.seq + 1);
        if r.stable.seq > Seq(0) {
            r.stable_chunks = r.own_checkpoints.remove(&r.stable.seq).filter(|c| c.root == r.stable.root);
            if snapshot_seq < r.stable.seq {
                // The log below the stable checkpoint is gone: fetch the state, reusing
                // what our own older snapshot has.
                let held = r.own_checkpoints.range(..r.stable.seq).next_back().map(|(_, c)| c.clone());
                r.start_transfer(held.into_iter().collect(), out);
            }
        }
        r.own_checkpoints.retain(|s, _| *s > r.stable.seq);
        // Vote again for our checkpoints above the stable one: the votes sent before the
        // crash may be lost, and without them the checkpoint may never become stable.
        let stable_seq = r.stable.seq;
        for (&seq, c) in r.own_checkpoints.iter().filter(|(s, _)| **s > stable_seq) {
            let Some(m) = crate::exec::snapshot_membership(c) else { continue };
            let membership = m.digest();
            let sig = r.secrets.signing.sign(&crate::message::checkpoint_statement(
                seq,
                &c.root,
                &membership,
                r.signer_name(),
            ));
            r.checkpoint_votes.entry(seq).or_default().insert(index, (c.root, membership, sig));
        }
        if r.vc_target.is_none() && r.cfg.primary(r.view) == index && r.cfg.n() > 1 {
            // Our PROPOSEs left before their records were durable: we cannot know what we
            // proposed in this view, so we never propose in it again and ask to leave it
            // (the others follow a STOP from the primary itself at once).
            r.proposals_closed = Some(r.view);
            let next = r.view + 1;
            r.suspect(next, out);
        }
        r.maybe_execute(out);
        r.invariants();
        Ok(r)
    }
}
