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

use crate::clock::Timestamp;
use crate::ledger::Refusal;
use crate::policy::Policy;
use crate::protocol::{self, Claimed, Ctx, Response};
use crate::reason::Reason;
use crate::request::PayoutRequest;
use crate::store::{self, Durability, End, KeyState, PayoutRow, PayoutState, Store, StoreError, Stored, Tx};
use serde_json::json;
use std::time::Duration;

/// The route, and the endpoint part of a payout's key scope.
pub const PAYOUTS: &str = "/v1/payouts";

/// What a call to the gateway came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    Paid,
    /// A definitive refusal: `status` is what idem answers (402 or 422).
    Refused {
        status: u16,
        reason: String,
    },
    /// No definitive answer: why.
    Unknown(String),
}

/// What the gateway says of a downstream key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    Paid,
    Failed { reason: String },
    Pending,
    NotFound,
    Error(String),
}

/// The outside service payouts go through.
pub trait Gateway: Send + Sync {
    fn send(&self, payout: &PayoutRow) -> Call;
    fn lookup(&self, downstream_key: &str) -> Lookup;
    /// A payout younger than this may be missing from lookups.
    fn lookup_delay(&self) -> Duration;
    /// A key older than this is forgotten: sent again, it would pay again.
    fn key_window(&self) -> Duration;
}

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
    if p.state == PayoutState::Failed
        && let Some(reason) = &p.note
    {
        v["reason"] = json!(reason);
    }
    v.to_string()
}

/// The answer a payout's row gives: its stored result once settled, else
/// 202 with where to look.
pub fn answer_of(p: &PayoutRow) -> Answer {
    let response = match (p.state, p.status) {
        (PayoutState::Completed, _) => {
            Response { status: 201, replay: false, reason: None, body: to_json(p), transfer_id: None }
        }
        (PayoutState::Failed, status) => Response::refusal(
            status.unwrap_or(422),
            Reason::Other(p.note.clone().unwrap_or_else(|| "payout_refused".into())),
        ),
        (PayoutState::InProgress | PayoutState::Unknown, _) => {
            Response { status: 202, replay: false, reason: None, body: to_json(p), transfer_id: None }
        }
    };
    Answer { response, payout_id: Some(p.id) }
}

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
    // A payout already made under this key (its claim released or taken
    // over since) is the one this request asks for: never a second.
    if let Some(p) = tx.payout_of(&req.key)?
        && !ctx.now.is_at_least(ctx.policy.retention_seconds(), p.created_at)
    {
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
    tx.add_to_balance(&src.id, -p.amount)?;
    let mut row = PayoutRow {
        id: 0,
        key: req.key.clone(),
        fingerprint: req.fingerprint.clone(),
        src: src.id,
        beneficiary: p.beneficiary.clone(),
        amount: p.amount,
        currency: p.currency.clone(),
        downstream_key: format!("idem-po-{}", ctx.token),
        state: PayoutState::InProgress,
        holder: ctx.token.to_owned(),
        lease_until: ctx.now.plus_seconds(call_lease.as_secs().try_into().unwrap_or(i64::MAX)),
        created_at: ctx.now,
        updated_at: ctx.now,
        note: None,
        status: None,
    };
    row.id = tx.insert_payout(&row)?;
    Ok(End::Commit(Begun::Call(Box::new(row))))
}

/// Step 3: records what the call came to, if `row`'s holder still holds
/// the payout; returns the payout as it stands now ([`answer_of`] it).
pub fn finish<S: Store + ?Sized>(
    store: &mut S,
    row: &PayoutRow,
    call: Call,
    now: Timestamp,
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
        settle(tx, current, call.clone(), now, policy).map(End::Commit)
    })
}

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
/// released on a refusal, and the key completed with the answer once the
/// payout is settled.
fn settle(
    tx: &mut dyn Tx,
    mut p: PayoutRow,
    call: Call,
    now: Timestamp,
    policy: &Policy,
) -> Result<PayoutRow, StoreError> {
    let seen = p.holder.clone();
    match call {
        Call::Paid => {
            (p.state, p.status, p.note) = (PayoutState::Completed, Some(201), None);
        }
        Call::Refused { status, reason } => {
            tx.lock_account(&p.src)?;
            tx.add_to_balance(&p.src, p.amount)?;
            (p.state, p.status, p.note) = (PayoutState::Failed, Some(status), Some(gateway_text(&reason)));
        }
        Call::Unknown(why) => {
            // a reconciler may ask the gateway at once
            (p.state, p.note, p.lease_until) = (PayoutState::Unknown, Some(gateway_text(&why)), now);
        }
    }
    p.updated_at = now;
    if !tx.update_payout(&p, &seen)? {
        return Err(StoreError::Conflict); // the caller holds the row locked: cannot happen
    }
    // The key is this payout's while it is within retention of the payout
    // (whoever holds its claim now: a retry that took it over, or claimed
    // it again after a release); after that it may name a new request.
    if p.state.settled()
        && let Some(rec) = tx.lock_key(&p.key)?
        && rec.fingerprint == p.fingerprint
        && !rec.created_at.is_at_least(policy.retention_seconds(), p.created_at)
        && let KeyState::InProgress { .. } = rec.state
    {
        tx.complete(&p.key, &rec.token, &stored(&answer_of(&p).response), now)?;
    }
    Ok(p)
}

/// The payout `id` if `client_id` made it.
pub fn lookup<S: Store + ?Sized>(
    store: &mut S,
    client_id: &str,
    id: i64,
    policy: &Policy,
) -> Result<Option<PayoutRow>, StoreError> {
    let row = store::atomically(store, Durability::Lazy, policy, |tx| Ok(End::Rollback(tx.payout(id)?)))?;
    Ok(row.filter(|p| p.key.client_id == client_id))
}

/// One reconciler decision, as the JSON line it prints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub payout_id: i64,
    pub downstream_key: String,
    pub was: PayoutState,
    pub now: PayoutState,
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
            "decision": self.decision,
        })
        .to_string()
    }
}

/// The payouts not settled (for a person: `idem reconcile --list`).
pub fn open<S: Store + ?Sized>(
    store: &mut S,
    now: Timestamp,
    policy: &Policy,
) -> Result<Vec<PayoutRow>, StoreError> {
    store::atomically(store, Durability::Lazy, policy, |tx| Ok(End::Rollback(tx.payouts_open(now, true)?)))
}

/// The recovery job: every payout left `in_progress` past its lease, and
/// every `unknown` one, is taken (a compare-and-set on its holder, so two
/// reconcilers never work on one payout) and settled by what the gateway
/// says of its downstream key: paid → completed; failed → released;
/// pending → left; not found → sent again with the same downstream key, but
/// only after the gateway's lookup delay (it may not show yet) and inside
/// its key window (after it, a resend would pay again); otherwise left for
/// a person. `token` names this reconciler; `now` is read per payout.
pub fn reconcile<S: Store + ?Sized>(
    store: &mut S,
    gateway: &dyn Gateway,
    token: &str,
    now: &dyn Fn() -> Timestamp,
    lease: Duration,
    policy: &Policy,
) -> Result<Vec<Decision>, StoreError> {
    let due = store::atomically(store, Durability::Lazy, policy, |tx| {
        Ok(End::Rollback(tx.payouts_open(now(), false)?))
    })?;
    let seconds = |d: Duration| i64::try_from(d.as_secs()).unwrap_or(i64::MAX);
    let mut decisions = Vec::new();
    for seen in due {
        let at = now();
        let taken = store::atomically(store, Durability::Durable, policy, |tx| {
            let Some(mut p) = tx.payout(seen.id)? else { return Ok(End::Rollback(None)) };
            if p.state.settled() || p.holder != seen.holder || p.lease_until > at {
                return Ok(End::Rollback(None));
            }
            let before = std::mem::replace(&mut p.holder, token.to_owned());
            (p.lease_until, p.updated_at) = (at.plus_seconds(seconds(lease)), at);
            Ok(match tx.update_payout(&p, &before)? {
                true => End::Commit(Some(p)),
                false => End::Rollback(None),
            })
        })?;
        let Some(p) = taken else { continue }; // another reconciler has it
        let age_at_least = |d: Duration| at.is_at_least(seconds(d), p.created_at);
        let (call, decision) = match gateway.lookup(&p.downstream_key) {
            Lookup::Paid => (Call::Paid, "paid at the gateway: completed".to_owned()),
            Lookup::Failed { reason } => {
                let decision = format!("refused at the gateway ({reason}): the hold is released");
                (Call::Refused { status: 422, reason }, decision)
            }
            Lookup::Pending => (Call::Unknown("pending at the gateway".into()), "pending at the gateway: left".into()),
            Lookup::Error(why) => {
                (Call::Unknown(format!("lookup failed: {why}")), format!("the lookup failed ({why}): left"))
            }
            Lookup::NotFound if !age_at_least(gateway.lookup_delay()) => (
                Call::Unknown("not found yet, within the gateway's lookup delay".into()),
                "not found, but younger than the gateway's lookup delay: left".into(),
            ),
            Lookup::NotFound if age_at_least(gateway.key_window()) => (
                Call::Unknown(
                    "needs a person: not found at the gateway, and past its key window (a resend would pay again)"
                        .into(),
                ),
                "not found and past the gateway's key window: left for a person".into(),
            ),
            Lookup::NotFound => match gateway.send(&p) {
                Call::Unknown(why) => (
                    Call::Unknown(format!("resent: {why}")),
                    format!("not found: resent with the same key, still unknown ({why})"),
                ),
                Call::Paid => (Call::Paid, "not found: resent with the same key, paid: completed".into()),
                Call::Refused { status, reason } => {
                    let decision = format!("not found: resent with the same key, refused ({reason}): released");
                    (Call::Refused { status, reason }, decision)
                }
            },
        };
        let after = finish(store, &p, call, now(), policy)?;
        decisions.push(Decision {
            payout_id: p.id,
            downstream_key: p.downstream_key.clone(),
            was: seen.state,
            now: after.state,
            decision,
        });
    }
    Ok(decisions)
}

/// A gateway's base URL, checked before any money is held: `http://` or
/// `https://` and a host (a typo would otherwise hold each payout's money
/// as `unknown` until a reconciler with the right URL came). Without a
/// trailing `/`.
pub fn gateway_url(text: &str) -> Result<String, String> {
    let url = text.trim_end_matches('/');
    let uri: ureq::http::Uri = url.parse().map_err(|e| format!("{text:?} is not a URL: {e}"))?;
    match (uri.scheme_str(), uri.host()) {
        (Some("http" | "https"), Some(host)) if !host.is_empty() => Ok(url.to_owned()),
        _ => Err(format!("{text:?} is not an http:// or https:// URL with a host")),
    }
}

/// The gateway over HTTP: `POST {url}/payouts` with the downstream key as
/// `Idempotency-Key`, `GET {url}/payouts/{key}`.
#[derive(Clone)]
pub struct HttpGateway {
    pub url: String,
    pub token: Option<String>,
    /// Each call's whole time; past it the outcome is unknown.
    pub timeout: Duration,
    pub lookup_delay: Duration,
    pub key_window: Duration,
}

impl std::fmt::Debug for HttpGateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // never the token
        write!(f, "HttpGateway({})", self.url)
    }
}

impl HttpGateway {
    /// How long a caller holds a payout (a request's call, or a
    /// reconciler's): past it, it is presumed dead and the payout is taken.
    pub fn lease(&self) -> Duration {
        self.timeout * 2
    }

    fn agent(&self) -> ureq::Agent {
        ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(self.timeout))
            .build()
            .into()
    }

    fn authorized<B>(&self, req: ureq::RequestBuilder<B>) -> ureq::RequestBuilder<B> {
        match &self.token {
            Some(token) => req.header("Authorization", format!("Bearer {token}")),
            None => req,
        }
    }
}

/// The JSON of an answer, and its `status` and `reason` members.
fn read(response: ureq::http::Response<ureq::Body>) -> Result<(u16, serde_json::Value), String> {
    let status = response.status().as_u16();
    let text = response.into_body().read_to_string().map_err(|e| format!("answer cut: {e}"))?;
    let v = serde_json::from_str(&text).map_err(|_| format!("HTTP {status} without a JSON body"))?;
    Ok((status, v))
}

impl Gateway for HttpGateway {
    fn send(&self, p: &PayoutRow) -> Call {
        let body =
            json!({"beneficiary": p.beneficiary, "amount": p.amount, "currency": p.currency}).to_string();
        let req = self
            .agent()
            .post(format!("{}/payouts", self.url))
            .header("Idempotency-Key", &p.downstream_key)
            .header("Content-Type", "application/json");
        let answer = self.authorized(req).send(body.as_str()).map_err(|e| e.to_string()).and_then(read);
        match answer {
            Ok((201, v)) if v["status"] == "paid" => Call::Paid,
            Ok((status @ (402 | 422), v)) if v["status"] == "failed" => Call::Refused {
                status,
                reason: v["reason"].as_str().unwrap_or("payout_refused").chars().take(64).collect(),
            },
            Ok((status, v)) => Call::Unknown(format!(
                "HTTP {status} {}",
                v.get("status").or_else(|| v.get("error")).and_then(|s| s.as_str()).unwrap_or("")
            )),
            Err(why) => Call::Unknown(why),
        }
    }

    fn lookup(&self, downstream_key: &str) -> Lookup {
        let req = self.agent().get(format!("{}/payouts/{downstream_key}", self.url));
        match self.authorized(req).call().map_err(|e| e.to_string()).and_then(read) {
            Ok((200, v)) => match v["status"].as_str() {
                Some("paid") => Lookup::Paid,
                Some("pending") => Lookup::Pending,
                Some("failed") => Lookup::Failed {
                    reason: v["reason"].as_str().unwrap_or("payout_refused").chars().take(64).collect(),
                },
                other => Lookup::Error(format!("status {other:?}")),
            },
            Ok((404, _)) => Lookup::NotFound,
            Ok((status, _)) => Lookup::Error(format!("HTTP {status}")),
            Err(why) => Lookup::Error(why),
        }
    }

    fn lookup_delay(&self) -> Duration {
        self.lookup_delay
    }

    fn key_window(&self) -> Duration {
        self.key_window
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_callers_lease_outlasts_its_call_so_no_reconciler_takes_a_payout_mid_call() {
        for timeout in [Duration::from_millis(1), Duration::from_secs(10), Duration::from_secs(86_400)] {
            let gateway = HttpGateway {
                url: "http://gw".into(),
                token: None,
                timeout,
                lookup_delay: Duration::ZERO,
                key_window: Duration::ZERO,
            };
            assert!(gateway.lease() > timeout, "{timeout:?}");
        }
    }
}
