//! Payouts: money that leaves through a gateway idem does not own.
//!
//! One local transaction cannot make an outside call exactly once, so a
//! payout is three steps, and no transaction (nor a pooled connection) is
//! held across the call:
//!
//! 1. **Intent** (after the key's claim, one durable transaction): debit
//!    `src` into a hold and insert the payout row `in_progress`, with the
//!    key the gateway will see: `idem-po-<claim token>`, derived from this
//!    row and never from the client's key, stored with it, so that every
//!    later call for this payout, by any process, uses the same one.
//! 2. **Call** the gateway, no transaction open.
//! 3. **Result** (one durable transaction): `completed` (201, stored on the
//!    key and replayed), `failed` (the gateway's definitive refusal: the
//!    hold goes back to `src`, the refusal is stored and replayed), or
//!    `unknown` (a timeout, a reset, a 5xx: nothing is released, the client
//!    gets 202 and a `Location` to poll).
//!
//! `unknown` is never final: the money is held until [`reconcile`] asks the
//! gateway by the downstream key and settles the row. While a payout is not
//! settled its key stays claimed, and any retry of it is answered 202 from
//! the row: a retry never makes a second payout, nor calls the gateway
//! with another key. Each write to a payout row is a compare-and-set on its
//! `holder` (the request that made it, or the reconciler that took it after
//! its lease ran out), so a late result never overwrites a newer one.

mod events;
mod gateway;
mod person;
mod reconcile;
mod tell;

pub use events::{
    Event, FOR_A_PERSON, Refused, SIGNATURE_HEADER, STANDARD_HEADERS, Signature, apply as apply_event, sign,
    sign_standard, verify, whsec_key,
};
pub use gateway::{Call, Gateway, HttpGateway, Limits, Lookup, classify_lookup, classify_send, gateway_url};
pub use person::{Finding, events, listed, settle_by_hand, stats, stray_events};
pub use reconcile::{Decision, reconcile};
pub use tell::{
    Answered, Hook, Post, Schedule, Sender, Told, body as event_body, client_events, delivery_log,
    disabled_endpoints, enable, event_id, headers as event_headers, post_http, redeliver, redeliver_since,
};

use crate::clock::Timestamp;
use crate::ledger::Refusal;
use crate::policy::Policy;
use crate::protocol::{self, Claimed, Ctx, Response};
use crate::reason::Reason;
use crate::request::PayoutRequest;
use crate::store::{
    self, Durability, End, KeyState, PayoutEvent, PayoutRow, PayoutState, Store, StoreError, Stored, Tx,
};
use serde_json::json;
use std::time::Duration;

/// The route, and the endpoint part of a payout's key scope.
pub use crate::request::PAYOUTS;

/// A payout's answer, and the payout it names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub response: Response,
    pub payout_id: Option<i64>,
}

impl Answer {
    fn plain(response: Response) -> Self {
        Answer { response, payout_id: None }
    }
}

/// What [`begin`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Begun {
    Answer(Answer),
    /// The intent is committed: call the gateway for this payout, then [`finish`].
    Call(Box<PayoutRow>),
}

/// The payout as JSON: what a 201, a 202 and `GET /v1/payouts/{id}` carry.
pub fn to_json(p: &PayoutRow) -> String {
    let mut v = json!({
        "payout_id": p.id,
        "src": match &p.src {
            crate::request::AcctId::Int(i) => json!(i),
            crate::request::AcctId::Text(s) => json!(s),
        },
        "beneficiary": p.beneficiary,
        "amount": p.amount,
        "currency": p.currency,
        "state": p.state.name(),
        "created_at": p.created_at.to_string(),
    });
    if let Some(id) = &p.provider_id {
        v["provider_id"] = json!(id);
    }
    // a refusal's and a return's reason are the client's to see; why a
    // payout waits for a person is the operator's
    if matches!(p.state, PayoutState::Failed | PayoutState::Returned)
        && let Some(reason) = &p.note
    {
        v["reason"] = json!(reason);
    }
    if p.state == PayoutState::Returned {
        v["returned_at"] = json!(p.updated_at.to_string());
    }
    v.to_string()
}

/// The answer a payout's row gives: its stored result once settled, else
/// 202 with where to look.
pub fn answer_of(p: &PayoutRow) -> Answer {
    let created =
        |p| Response { status: 201, replay: false, reason: None, body: to_json(p), transfer_id: None };
    let response = match (p.state, p.status) {
        (PayoutState::Completed | PayoutState::Returned, _) => created(p),
        (PayoutState::Failed, status) => Response::refusal(
            status.unwrap_or(422),
            Reason::Other(p.note.clone().unwrap_or_else(|| "payout_refused".into())),
        ),
        (PayoutState::InProgress | PayoutState::Unknown | PayoutState::NeedsAttention, _) => {
            Response { status: 202, ..created(p) }
        }
    };
    Answer { response, payout_id: Some(p.id) }
}

pub use crate::provider::downstream_key;

fn stored(response: &Response) -> Stored {
    Stored {
        status: response.status,
        reason: response.reason.clone(),
        body: response.body.clone(),
        transfer_id: None,
    }
}

/// Creates the `payout` table if it is not there (once, at start).
pub fn prepare<S: Store + ?Sized>(store: &mut S, policy: &Policy) -> Result<(), StoreError> {
    store::atomically(store, Durability::Durable, policy, |tx| tx.ensure_payouts().map(End::Commit))
}

/// Steps 0 and 1: claim the key, then record the intent and hold the money;
/// or answer at once (a replay, 409/422, a payout already made under the
/// key, a refusal of `src`).
pub fn begin<S: Store + ?Sized>(
    store: &mut S,
    req: &PayoutRequest,
    ctx: Ctx,
    call_lease: Duration,
) -> Result<Begun, StoreError> {
    match protocol::claim_key(store, &req.key, &req.fingerprint, ctx)? {
        Claimed::Answer(response) if response.reason == Some(Reason::InProgress) => {
            // The key's payout is under way or unknown: say where it stands.
            let made = store::atomically(store, Durability::Lazy, ctx.policy, |tx| {
                Ok(End::Rollback(tx.payout_of(&req.key)?))
            })?;
            Ok(Begun::Answer(match made {
                Some(p) if p.fingerprint == req.fingerprint => answer_of(&p),
                _ => Answer::plain(response),
            }))
        }
        Claimed::Answer(response) => {
            // a replayed 201 names its payout as the first answer did
            let payout_id = match response.status {
                201 => serde_json::from_str::<serde_json::Value>(&response.body)
                    .ok()
                    .and_then(|v| v.get("payout_id")?.as_i64()),
                _ => None,
            };
            Ok(Begun::Answer(Answer { response, payout_id }))
        }
        Claimed::Mine => {
            let begun = store::atomically(store, Durability::Durable, ctx.policy, |tx| {
                intent(tx, req, ctx, call_lease)
            });
            if begun.is_err() {
                // nothing was held or recorded: free the key now (best effort; else its lease does)
                let _ = protocol::release(store, &req.key, ctx);
            }
            begun
        }
    }
}

fn intent(
    tx: &mut dyn Tx,
    req: &PayoutRequest,
    ctx: Ctx,
    call_lease: Duration,
) -> Result<End<Begun>, StoreError> {
    let held = tx.lock_key(&req.key)?;
    if !held.as_ref().is_some_and(|rec| rec.held_by(ctx.token)) {
        return Ok(End::Rollback(Begun::Answer(Answer::plain(protocol::in_progress(ctx.policy)))));
    }
    // A key never makes a second payout. Its payout, however old, answers
    // for it while it is open (the gateway may have paid: only a lookup can
    // tell) and for retention after it settled; after that the key is spent.
    // The key's record is no guide: it may have expired, been purged or been
    // claimed again by another body since.
    if let Some(p) = tx.payout_of(&req.key)? {
        if p.state.settled() && ctx.now.is_at_least(ctx.policy.retention_seconds(), p.updated_at) {
            tx.release(&req.key, ctx.token)?;
            let used = Response::refusal(409, Reason::PayoutKeyUsed);
            return Ok(End::Commit(Begun::Answer(Answer { response: used, payout_id: Some(p.id) })));
        }
        if p.fingerprint != req.fingerprint {
            tx.release(&req.key, ctx.token)?;
            let mismatch = Response::refusal(ctx.policy.on_fingerprint_mismatch, Reason::FingerprintMismatch);
            return Ok(End::Commit(Begun::Answer(Answer::plain(mismatch))));
        }
        let answer = answer_of(&p);
        if p.state.settled() {
            tx.complete(&req.key, ctx.token, &stored(&answer.response), ctx.now)?;
            return Ok(End::Commit(Begun::Answer(answer)));
        }
        return Ok(End::Rollback(Begun::Answer(answer))); // the key stays claimed until it settles
    }
    let refuse = |tx: &mut dyn Tx, refusal: Refusal| -> Result<End<Begun>, StoreError> {
        let stored = protocol::refused(refusal, ctx.policy);
        tx.complete(&req.key, ctx.token, &stored, ctx.now)?;
        Ok(End::Commit(Begun::Answer(Answer::plain(Response::from_stored(stored, false)))))
    };
    let p = &req.payout;
    let Some(src) = tx.lock_account(&p.src)? else { return refuse(tx, Refusal::UnknownAccount) };
    if src.balance < p.amount {
        return refuse(tx, Refusal::InsufficientFunds);
    }
    shift(tx, &src.id, -p.amount)?;
    let mut row = PayoutRow {
        id: 0,
        key: req.key.clone(),
        fingerprint: req.fingerprint.clone(),
        src: src.id,
        beneficiary: p.beneficiary.clone(),
        amount: p.amount,
        currency: p.currency.clone(),
        downstream_key: downstream_key(ctx.token),
        state: PayoutState::InProgress,
        holder: ctx.token.to_owned(),
        lease_until: ctx.now.plus_seconds(call_lease.as_secs().try_into().unwrap_or(i64::MAX)),
        created_at: ctx.now,
        updated_at: ctx.now,
        note: None,
        status: None,
        // counted before the call: the request sends it next
        sends: 1,
        attempts: 0,
        provider_id: None,
    };
    row.id = tx.insert_payout(&row)?;
    Ok(End::Commit(Begun::Call(Box::new(row))))
}

/// Where a front may stop a payout on purpose, to prove that what it left
/// is recovered: after the intent is committed, after the gateway's call,
/// after the result is committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Boundary {
    AfterIntent,
    AfterCall,
    AfterResult,
}

/// How a front reaches its database for one step of a payout: on a
/// writer's thread (`idem serve`), or by opening it for the step (`idem_api`,
/// which holds no connection across the call). Each step is its own
/// transaction; nothing is held between them.
pub trait Steps {
    fn step<R: Send + 'static>(
        &mut self,
        work: impl FnOnce(&mut dyn Store) -> Result<R, StoreError> + Send + 'static,
    ) -> Result<R, StoreError>;
}

/// A payout, start to end, the one way both fronts make it: claim and
/// intent (a step), the gateway's call with nothing held, the result (a
/// step). `stop` sees each [`Boundary`] (a front's crash points). A result
/// that cannot be written leaves the payout in progress, its money held,
/// until a reconciler settles it, and is answered 202.
pub fn pay(
    steps: &mut impl Steps,
    gateway: &dyn Gateway,
    req: PayoutRequest,
    token: String,
    now: &(dyn Fn() -> Timestamp + Send + Sync),
    policy: &'static Policy,
    stop: &mut dyn FnMut(Boundary),
) -> Result<Answer, StoreError> {
    let (at, lease) = (now(), gateway.lease());
    let begun = steps.step(move |store| begin(store, &req, Ctx { policy, now: at, token: &token }, lease))?;
    let row = match begun {
        Begun::Answer(answer) => return Ok(answer),
        Begun::Call(row) => row,
    };
    stop(Boundary::AfterIntent);
    let call = gateway.send(&row);
    stop(Boundary::AfterCall);
    let at = now();
    let held = (*row).clone();
    match steps.step(move |store| finish(store, &row, call, at, policy)) {
        Ok(p) => {
            stop(Boundary::AfterResult);
            Ok(answer_of(&p))
        }
        // The payout exists and its money is held, whatever the call did: the
        // answer is where it stands (202), never an error that says nothing
        // was done. A reconciler records the result.
        Err(_) => Ok(answer_of(&held)),
    }
}

/// Step 3: records what the request's call came to, if `row`'s holder
/// still holds the payout; returns the payout as it stands now
/// ([`answer_of`] it). An unknown outcome may be looked up at once.
pub fn finish<S: Store + ?Sized>(
    store: &mut S,
    row: &PayoutRow,
    call: Call,
    now: Timestamp,
    policy: &Policy,
) -> Result<PayoutRow, StoreError> {
    record(store, row, call, now, now, policy)
}

/// [`finish`], with the time an unknown outcome is next looked at.
fn record<S: Store + ?Sized>(
    store: &mut S,
    row: &PayoutRow,
    call: Call,
    now: Timestamp,
    next_look: Timestamp,
    policy: &Policy,
) -> Result<PayoutRow, StoreError> {
    store::atomically(store, Durability::Durable, policy, |tx| {
        // the key before the payout, in the order the intent locks them
        tx.lock_key(&row.key)?;
        let Some(current) = tx.payout(row.id)? else {
            return Err(StoreError::Backend(format!("payout {} vanished", row.id).into()));
        };
        if current.holder != row.holder || current.state.settled() {
            return Ok(End::Rollback(current));
        }
        settle(tx, current, call.clone(), now, next_look).map(End::Commit)
    })
}

/// Takes `seen` for `token` (a compare-and-set on its holder: nobody else
/// took it since, and its lease is over unless `token` holds it), holds it
/// for `lease` and applies `change`, in one durable transaction. `None` if
/// it is settled, needs a person, or another has it.
fn take<S: Store + ?Sized>(
    store: &mut S,
    seen: &PayoutRow,
    token: &str,
    at: Timestamp,
    lease: Duration,
    policy: &Policy,
    change: impl Fn(&mut PayoutRow),
) -> Result<Option<PayoutRow>, StoreError> {
    let lease = i64::try_from(lease.as_millis()).unwrap_or(i64::MAX);
    store::atomically(store, Durability::Durable, policy, |tx| {
        let Some(mut p) = tx.payout(seen.id)? else { return Ok(End::Rollback(None)) };
        let open = matches!(p.state, PayoutState::InProgress | PayoutState::Unknown);
        let paid = p.state == PayoutState::Completed && seen.state == PayoutState::Completed;
        if !(open || paid) || p.holder != seen.holder || (open && p.holder != token && p.lease_until > at) {
            return Ok(End::Rollback(None));
        }
        if paid && p.lease_until != seen.lease_until {
            return Ok(End::Rollback(None)); // another reconciler checked it since
        }
        let before = std::mem::replace(&mut p.holder, token.to_owned());
        match paid {
            // a paid payout keeps its time of payment; its lease is when it was checked
            true => p.lease_until = at,
            false => (p.lease_until, p.updated_at) = (at.plus_millis(lease), at),
        }
        change(&mut p);
        Ok(match tx.update_payout(&p, &before)? {
            true => End::Commit(Some(p)),
            false => End::Rollback(None),
        })
    })
}

/// The holder of an `unknown` payout that no call is out for: it waits for
/// its next look.
pub(crate) const WAITING: &str = "";

/// The most of a gateway's text a payout keeps.
const GATEWAY_TEXT_CHARS: usize = 200;

/// A gateway's text as a payout stores and shows it: its control characters
/// replaced (PostgreSQL keeps no NUL, and a line break has no place in a
/// reason) and at most [`GATEWAY_TEXT_CHARS`] characters. The other side's
/// answer is data: one unwritable text must not stop the payout, nor the
/// reconciliation of every payout behind it.
fn gateway_text(text: &str) -> String {
    text.chars().take(GATEWAY_TEXT_CHARS).map(|c| if c.is_control() { '\u{fffd}' } else { c }).collect()
}

/// Writes a result into a payout its caller holds: the state, the hold
/// released on a refusal, an audit row, and the key completed with the
/// answer once the payout is settled.
fn settle(
    tx: &mut dyn Tx,
    mut p: PayoutRow,
    call: Call,
    now: Timestamp,
    next_look: Timestamp,
) -> Result<PayoutRow, StoreError> {
    let (seen, was) = (p.holder.clone(), p.state);
    let what = match call {
        Call::Paid(provider_id) => {
            (p.state, p.status, p.note) = (PayoutState::Completed, Some(201), None);
            p.provider_id = provider_id.map(|id| gateway_text(&id)).or(p.provider_id);
            p.lease_until = now; // for a paid payout: when it was last checked for a return
            "paid".to_owned()
        }
        Call::Refused { status, reason } => {
            shift(tx, &p.src, p.amount)?;
            (p.state, p.status, p.note) = (PayoutState::Failed, Some(status), Some(gateway_text(&reason)));
            format!("refused ({status}): the hold is released")
        }
        Call::Unknown(why) => {
            (p.state, p.note, p.lease_until) = (PayoutState::Unknown, Some(gateway_text(&why)), next_look);
            // nobody holds it until its next look (the lease is now that
            // time): a person may settle it meanwhile
            p.holder = WAITING.to_owned();
            "no definitive answer".to_owned()
        }
        Call::Terminal(why) => {
            (p.state, p.note) =
                (PayoutState::NeedsAttention, Some(gateway_text(&format!("needs a person: {why}"))));
            "an answer no resend can fix: for a person".to_owned()
        }
    };
    p.updated_at = now;
    if !tx.update_payout(&p, &seen)? {
        return Err(StoreError::Conflict); // the caller holds the row locked: cannot happen
    }
    if p.state != was {
        let why = match &p.note {
            Some(note) => format!("{what}: {note}"),
            None => what,
        };
        // the request that made the payout answers with what it came to;
        // a change by anyone else (a reconciler, a provider's event, a
        // person) reaches the client only as an event
        let tell = p.downstream_key != downstream_key(&seen);
        tx.insert_payout_event(
            &PayoutEvent { payout_id: p.id, at: now, actor: seen, was, now: p.state, why },
            tell,
        )?;
    }
    // The key is this payout's while it is open (whoever holds its claim
    // now: a retry that took it over, or claimed it again after a release
    // or past retention): no other payout is made under it meanwhile.
    if p.state.settled()
        && let Some(rec) = tx.lock_key(&p.key)?
        && rec.fingerprint == p.fingerprint
        && let KeyState::InProgress { .. } = rec.state
    {
        tx.complete(&p.key, &rec.token, &stored(&answer_of(&p).response), now)?;
    }
    Ok(p)
}

/// A paid payout whose money came back (a bank return, a reversal, a
/// failure after `paid`): credits `src` back, in the transaction of the
/// caller, who holds the payout. The key keeps its stored 201: the POST
/// replays what was answered; `GET` shows the return.
fn credit_back(
    tx: &mut dyn Tx,
    mut p: PayoutRow,
    why: &str,
    now: Timestamp,
) -> Result<PayoutRow, StoreError> {
    if p.state != PayoutState::Completed {
        return Ok(p);
    }
    shift(tx, &p.src, p.amount)?;
    let seen = p.holder.clone();
    (p.state, p.note, p.updated_at) = (PayoutState::Returned, Some(gateway_text(why)), now);
    if !tx.update_payout(&p, &seen)? {
        return Err(StoreError::Conflict);
    }
    let why = format!("returned after it was paid: {}", gateway_text(why));
    // the client was answered 201: the money back reaches it only as an event
    let back = PayoutEvent {
        payout_id: p.id,
        at: now,
        actor: seen,
        was: PayoutState::Completed,
        now: PayoutState::Returned,
        why,
    };
    tx.insert_payout_event(&back, true)?;
    Ok(p)
}

/// Moves `delta` into account `id` (a hold, its release, a credit back),
/// locked, with the transfers' guard: the stored balance after must be
/// exactly the one computed, or nothing is written.
fn shift(tx: &mut dyn Tx, id: &crate::request::AcctId, delta: i64) -> Result<(), StoreError> {
    let Some(account) = tx.lock_account(id)? else {
        return Err(StoreError::Backend(format!("account {:?} is gone", id.to_string()).into()));
    };
    match tx.add_to_balance(id, delta)? {
        got if Some(got) == account.balance.checked_add(delta) => Ok(()),
        _ => Err(store::inexact(id)),
    }
}

/// The payout `id` if `client_id` made it.
pub fn lookup<S: Store + ?Sized>(
    store: &mut S,
    client_id: &str,
    id: i64,
    policy: &Policy,
) -> Result<Option<PayoutRow>, StoreError> {
    let row =
        store::atomically(store, Durability::Lazy, policy, |tx| Ok(End::Rollback(tx.peek_payout(id)?)))?;
    Ok(row.filter(|p| p.key.client_id == client_id))
}

/// The payouts not settled (for a person: `idem payouts list`).
pub fn open<S: Store + ?Sized>(
    store: &mut S,
    now: Timestamp,
    policy: &Policy,
) -> Result<Vec<PayoutRow>, StoreError> {
    store::atomically(store, Durability::Lazy, policy, |tx| Ok(End::Rollback(tx.payouts_open(now, true)?)))
}
