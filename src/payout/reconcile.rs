//! The recovery job: every payout left `in_progress` past its lease, and
//! every `unknown` one whose wait is over, is taken (a compare-and-set on
//! its holder, so two reconcilers never work on one payout) and settled by
//! what the gateway says of its downstream key. Pending or no answer: looked
//! at again after a capped, jittered, doubling wait. Not found: sent again
//! with the same key, only past the gateway's lookup delay, inside its key
//! window less the margin, and at most `max_sends` times. An answer no
//! resend can fix goes to a person (`needs_attention`), at once. A payout
//! whose result cannot be stored is set aside for a person with why, and
//! the run goes on with the rest.

use super::{Call, Gateway, Lookup, credit_back, record, take};
use crate::clock::Timestamp;
use crate::policy::Policy;
use crate::provider::{Next, judge, resent, seed};
use crate::store::{self, Durability, End, PayoutRow, PayoutState, Store, StoreError};
use serde_json::json;
use std::time::Duration;

/// One reconciler decision, as the JSON line it prints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub payout_id: i64,
    pub downstream_key: String,
    pub was: PayoutState,
    pub now: PayoutState,
    pub sends: i64,
    /// What was done and why.
    pub decision: String,
}

impl Decision {
    pub fn to_json(&self) -> String {
        json!({
            "payout_id": self.payout_id,
            "downstream_key": self.downstream_key,
            "was": self.was.name(),
            "now": self.now.name(),
            "sends": self.sends,
            "decision": self.decision,
        })
        .to_string()
    }
}

fn seconds(d: Duration) -> i64 {
    i64::try_from(d.as_secs()).unwrap_or(i64::MAX)
}

/// One pass over the payouts due, by a reconciler of its own (a fresh
/// token), each payout held for the gateway's lease; `now` is read per
/// payout. Open payouts come first, and again whenever one falls due
/// during the return checks: a long run of lookups for returns never keeps
/// an `unknown` payout waiting.
pub fn reconcile<S: Store + ?Sized>(
    store: &mut S,
    gateway: &dyn Gateway,
    now: &dyn Fn() -> Timestamp,
    policy: &Policy,
) -> Result<Vec<Decision>, StoreError> {
    let token = crate::protocol::fresh_token()
        .map_err(|e| StoreError::Backend(format!("no randomness for a reconciler's token: {e}").into()))?;
    let token = &*format!("reconciler:{token}");
    let mut decisions = Vec::new();
    // bounded: a payout whose next look is drawn at once could otherwise
    // interrupt the return checks round after round
    for round in 0..ROUNDS {
        let opened = open(store, gateway, token, now, policy)?;
        if round > 0 && opened.is_empty() {
            break; // what fell due was not this reconciler's to take: the next pass
        }
        decisions.extend(opened);
        let (back, open_due) = returns(store, gateway, token, now, policy)?;
        decisions.extend(back);
        if !open_due {
            break;
        }
    }
    Ok(decisions)
}

/// The most times one pass goes back to the open payouts.
const ROUNDS: usize = 16;

/// The open payouts due now: each taken, asked about, and recorded.
fn open<S: Store + ?Sized>(
    store: &mut S,
    gateway: &dyn Gateway,
    token: &str,
    now: &dyn Fn() -> Timestamp,
    policy: &Policy,
) -> Result<Vec<Decision>, StoreError> {
    let lease = gateway.lease();
    let due = store::atomically(store, Durability::Lazy, policy, |tx| {
        Ok(End::Rollback(tx.payouts_open(now(), false)?))
    })?;
    let mut decisions = Vec::new();
    for seen in due {
        let at = now();
        let Some(p) = take(store, &seen, token, at, lease, policy, |p| p.attempts += 1)? else {
            continue; // another reconciler has it, or it moved on
        };
        let (call, decision) = ask(store, gateway, &p, at, lease, token, policy)?;
        let wait = gateway.limits().wait(p.attempts, seed(&p.downstream_key));
        let next_look = now().plus_millis(i64::try_from(wait.as_millis()).unwrap_or(i64::MAX));
        let (after, decision) = match record(store, &p, call, now(), next_look, policy) {
            Ok(after) => (after, decision),
            // Availability is the run's problem, not this payout's: stop.
            Err(e @ (StoreError::Unavailable(_) | StoreError::Busy)) => return Err(e),
            Err(e) => {
                // set aside for a person, with why: one payout must not stop the others
                let aside = Call::Terminal(format!("the result could not be stored: {e}"));
                match record(store, &p, aside, now(), now(), policy) {
                    Ok(after) => {
                        (after, format!("{decision}; its result could not be stored ({e}): set aside"))
                    }
                    Err(again) => {
                        let why = format!(
                            "{decision}; its result could not be stored ({e}), nor set aside ({again})"
                        );
                        (p.clone(), why)
                    }
                }
            }
        };
        decisions.push(Decision {
            payout_id: p.id,
            downstream_key: p.downstream_key.clone(),
            was: seen.state,
            now: after.state,
            sends: after.sends,
            decision,
        });
    }
    Ok(decisions)
}

/// Looks up the payouts paid within the return window, each as often as
/// its age says ([`Limits::return_bands`](super::Limits::return_bands)),
/// and credits back each whose money came back. Only returns are
/// decisions; a payout still paid is checked again later.
fn returns<S: Store + ?Sized>(
    store: &mut S,
    gateway: &dyn Gateway,
    token: &str,
    now: &dyn Fn() -> Timestamp,
    policy: &Policy,
) -> Result<(Vec<Decision>, bool), StoreError> {
    let (limits, lease) = (gateway.limits(), gateway.lease());
    if limits.return_window.is_zero() {
        return Ok((Vec::new(), false));
    }
    let at = now();
    // a payout is due by the spacing of the youngest band its age fits in:
    // the bands' spacings grow with their ages, so the union of each
    // band's due payouts is exactly those
    let mut due: Vec<PayoutRow> = Vec::new();
    for (age, every) in limits.return_bands() {
        let (checked_before, paid_since) = (at.plus_seconds(-seconds(every)), at.plus_seconds(-seconds(age)));
        let band = store::atomically(store, Durability::Lazy, policy, |tx| {
            Ok(End::Rollback(tx.payouts_paid_due(checked_before, paid_since, 1000)?))
        })?;
        due.extend(band.into_iter().filter(|p| !due.iter().any(|d| d.id == p.id)).collect::<Vec<_>>());
    }
    due.sort_by_key(|p| (p.updated_at, p.id));
    let mut decisions = Vec::new();
    for seen in due {
        let open_due = store::atomically(store, Durability::Lazy, policy, |tx| {
            Ok(End::Rollback(!tx.payouts_open(now(), false)?.is_empty()))
        })?;
        if open_due {
            return Ok((decisions, true)); // the rest are still due: the next round checks them
        }
        let Some(p) = take(store, &seen, token, now(), lease, policy, |_| {})? else { continue };
        let Lookup::Failed { reason } = gateway.lookup(&p) else { continue };
        let back = store::atomically(store, Durability::Durable, policy, |tx| {
            tx.lock_key(&p.key)?;
            match tx.payout(p.id)? {
                Some(current) if current.holder == token && current.state == PayoutState::Completed => {
                    credit_back(tx, current, &reason, now()).map(|p| End::Commit(Some(p)))
                }
                _ => Ok(End::Rollback(None)),
            }
        });
        let decision = match &back {
            Ok(Some(_)) => format!("came back after it was paid ({reason}): credited back to its account"),
            Ok(None) => continue, // settled otherwise meanwhile (an event)
            Err(e @ (StoreError::Unavailable(_) | StoreError::Busy)) => return Err(e.clone()),
            Err(e) => format!(
                "came back after it was paid ({reason}), but the credit could not be stored ({e}): left"
            ),
        };
        decisions.push(Decision {
            payout_id: p.id,
            downstream_key: p.downstream_key.clone(),
            was: PayoutState::Completed,
            now: back.ok().flatten().map_or(PayoutState::Completed, |p| p.state),
            sends: p.sends,
            decision,
        });
    }
    Ok((decisions, false))
}

/// Asks the gateway about `p` (held by `token`), and sends it again if it
/// never arrived and may still be sent: what to record, and why.
fn ask<S: Store + ?Sized>(
    store: &mut S,
    gateway: &dyn Gateway,
    p: &PayoutRow,
    at: Timestamp,
    lease: Duration,
    token: &str,
    policy: &Policy,
) -> Result<(Call, String), StoreError> {
    let older_than = |d: Duration| at.is_at_least(seconds(d), p.created_at);
    Ok(match judge(gateway.lookup(p), older_than, p.sends, gateway.limits(), lease) {
        Next::Record(call, why) => (call, why),
        Next::Resend => {
            // counted before it is sent: a send is never lost from the count
            let Some(p) = take(store, p, token, at, lease, policy, |p| p.sends += 1)? else {
                return Ok((Call::Unknown("taken by another".into()), "taken by another: left".into()));
            };
            resent(gateway.send(&p))
        }
    })
}
