//! The person the recovery job hands a payout to: what they see (`idem
//! payouts list`, `show`) and the one thing they do, settle it by what they
//! found out at the provider (`idem payouts settle`), in one transaction
//! with an audit row.

use super::{Call, settle};
use crate::clock::Timestamp;
use crate::policy::Policy;
use crate::store::{
    self, Durability, End, PayoutEvent, PayoutRow, PayoutStat, PayoutState, Store, StoreError,
};

/// What a person found out at the provider.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finding {
    /// It was paid; the provider's reference for it.
    Paid { reference: String },
    /// It was not paid and will not be: the hold goes back to `src`.
    Failed,
}

/// Settles payout `id` by hand, as `who` found out, for `why`. Refused
/// (`Ok(Err(why not))`) if there is no such payout, if it is settled, or
/// while a request or a reconciler holds it (its lease not over): an
/// `unknown` payout waiting for its next look is held by nobody.
pub fn settle_by_hand<S: Store + ?Sized>(
    store: &mut S,
    id: i64,
    finding: &Finding,
    why: &str,
    who: &str,
    now: Timestamp,
    policy: &Policy,
) -> Result<Result<PayoutRow, String>, StoreError> {
    let person = format!("person:{who}");
    store::atomically(store, Durability::Durable, policy, |tx| {
        let Some(seen) = tx.peek_payout(id)? else {
            return Ok(End::Rollback(Err(format!("no payout {id}"))));
        };
        // the key before the payout, in the order every writer locks them
        tx.lock_key(&seen.key)?;
        let Some(mut p) = tx.payout(id)? else { return Ok(End::Rollback(Err(format!("no payout {id}")))) };
        if p.state.settled() {
            return Ok(End::Rollback(Err(format!("payout {id} is settled already: {}", p.state.name()))));
        }
        if p.state != PayoutState::NeedsAttention && p.holder != super::WAITING && p.lease_until > now {
            return Ok(End::Rollback(Err(format!(
                "payout {id} is {} and held by {} until {}: settle it once that is over",
                p.state.name(),
                p.holder,
                p.lease_until
            ))));
        }
        let before = std::mem::replace(&mut p.holder, person.clone());
        if !tx.update_payout(&p, &before)? {
            return Err(StoreError::Conflict);
        }
        let call = match finding {
            Finding::Paid { reference } => Call::Paid(Some(reference.clone())),
            Finding::Failed => Call::Refused { status: 422, reason: why.to_owned() },
        };
        let settled = settle(tx, p, call, now, now)?;
        // the person's own words, beside the transition settle recorded
        tx.insert_payout_event(
            &PayoutEvent {
                payout_id: id,
                at: now,
                actor: person.clone(),
                was: settled.state,
                now: settled.state,
                why: format!("settled by hand: {why}"),
            },
            false,
        )?;
        Ok(End::Commit(Ok(settled)))
    })
}

/// Up to `limit` payouts in `state`, oldest first; without a state, every
/// payout not settled.
pub fn listed<S: Store + ?Sized>(
    store: &mut S,
    state: Option<PayoutState>,
    limit: i64,
    policy: &Policy,
) -> Result<Vec<PayoutRow>, StoreError> {
    store::atomically(store, Durability::Lazy, policy, |tx| {
        Ok(End::Rollback(match state {
            Some(state) => tx.payouts_in(state, limit)?,
            None => tx
                .payouts_open(Timestamp::now(), true)?
                .into_iter()
                .take(usize::try_from(limit).unwrap_or(0))
                .collect(),
        }))
    })
}

/// Payout `id` and its audit trail, oldest first.
pub fn events<S: Store + ?Sized>(
    store: &mut S,
    id: i64,
    policy: &Policy,
) -> Result<Option<(PayoutRow, Vec<PayoutEvent>)>, StoreError> {
    store::atomically(store, Durability::Lazy, policy, |tx| {
        let Some(p) = tx.peek_payout(id)? else { return Ok(End::Rollback(None)) };
        Ok(End::Rollback(Some((p, tx.payout_events(id)?))))
    })
}

/// How many payouts are in each state, the oldest of each, and their sends.
pub fn stats<S: Store + ?Sized>(store: &mut S, policy: &Policy) -> Result<Vec<PayoutStat>, StoreError> {
    store::atomically(store, Durability::Lazy, policy, |tx| Ok(End::Rollback(tx.payout_stats()?)))
}

/// Up to `limit` provider events that moved no money and need a person.
pub fn stray_events<S: Store + ?Sized>(
    store: &mut S,
    limit: i64,
    policy: &Policy,
) -> Result<Vec<crate::store::GatewayEventRow>, StoreError> {
    store::atomically(store, Durability::Lazy, policy, |tx| {
        Ok(End::Rollback(tx.gateway_events_for_a_person(limit)?))
    })
}
