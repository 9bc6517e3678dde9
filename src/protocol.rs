//! The idempotency protocol: claim → execute → complete, replay, conflict.
//!
//! This is the file to read first. Everything a retry can meet is decided
//! here, once, for every store:
//!
//! 1. **Claim** (a short write transaction): INSERT the scoped key as
//!    `in_progress` with a fresh token. If the key exists, the primary key
//!    says so — there is no lookup before the insert for two racers to both
//!    pass — and [`decide`] reads the existing record: replay, 422, 409, or
//!    take over a claim whose lease ran out (or a key past retention).
//! 2. **Execute** (a second, durable write transaction): check the claim is
//!    still ours (fencing: a slow original whose lease was taken over must
//!    not complete too), move the money, and store the exact response with
//!    the key's completion. All or nothing.
//! 3. **Replay**: a completed key answers with its stored bytes; only
//!    `replay` differs from the first response.
//!
//! The claim commit is [`Durability::Lazy`]: a claim lost in a power cut
//! moved no money, and the retry simply claims again. The execution commit
//! is durable, and in SQLite's WAL it carries the earlier claim frames to disk
//! with it, so one fsync per transfer is enough.

use crate::clock::Timestamp;
use crate::ledger::{self, Refusal};
use crate::policy::Policy;
use crate::request::{self, AcctId, Request, ScopedKey, Transfer};
use crate::store::{Claim, Durability, KeyRecord, KeyState, Store, StoreError, Stored, Tx};
use crate::teeth::{self, Broken};

/// One response, as printed: `{"status","replay","reason","body"}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub replay: bool,
    pub reason: Option<String>,
    /// Raw JSON text of `body`; `null` when there is none.
    pub body: String,
}

impl Response {
    /// A response that is never stored (400, 409, 422, 503).
    pub fn refusal(status: u16, reason: impl Into<String>) -> Self {
        Response { status, replay: false, reason: Some(reason.into()), body: "null".into() }
    }

    fn replay_of(stored: Stored) -> Self {
        Response { status: stored.status, replay: true, reason: stored.reason, body: stored.body }
    }

    /// The `transfer_id` in the body, if this answer names a transfer.
    pub fn transfer_id(&self) -> Option<i64> {
        serde_json::from_str::<serde_json::Value>(&self.body).ok()?.get("transfer_id")?.as_i64()
    }

    /// The one serialisation of a response. The stored body is pasted in as
    /// bytes, never re-serialised, so a replay is identical but for `replay`.
    pub fn to_json(&self) -> String {
        let reason = match &self.reason {
            Some(r) => serde_json::Value::from(r.as_str()).to_string(),
            None => "null".into(),
        };
        format!(
            r#"{{"status":{},"replay":{},"reason":{},"body":{}}}"#,
            self.status, self.replay, reason, self.body
        )
    }
}

/// What an existing key means for an incoming request with `fingerprint`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    Replay(Stored),
    Mismatch,
    InProgress,
    /// The claim's holder is presumed dead: take the key over, keep its age.
    TakeOver,
    /// Past retention the key is forgotten: this request is new.
    Expired,
}

/// The pure core: no I/O, no clock but the one passed in.
pub fn decide(existing: &KeyRecord, fingerprint: &str, now: Timestamp, policy: &Policy) -> Decision {
    if existing.created_at.plus_seconds(policy.retention_seconds()) <= now {
        return Decision::Expired;
    }
    if existing.fingerprint != fingerprint {
        return Decision::Mismatch;
    }
    match &existing.state {
        KeyState::Completed(stored) => Decision::Replay(stored.clone()),
        KeyState::InProgress { lease_until, .. } if now < *lease_until => Decision::InProgress,
        KeyState::InProgress { .. } => Decision::TakeOver,
    }
}

/// The points where a test can stop the process to simulate a crash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Point {
    /// The claim is committed; nothing else has happened.
    AfterClaim,
    /// The money has moved and the key is completed, uncommitted.
    BeforeCommit,
    /// Committed, response not yet delivered.
    AfterCommit,
}

/// What a fault hook asks for at a [`Point`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Continue,
    /// Stop here: open transactions roll back, nothing is answered.
    Crash,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Respond(Response),
    Crashed(Point),
}

/// Everything about one call that is not the request: the clock, the
/// attempt's unique claim token, the policy.
#[derive(Debug, Clone, Copy)]
pub struct Ctx<'a> {
    pub policy: &'a Policy,
    pub now: Timestamp,
    pub token: &'a str,
}

/// Handles one validated request: [`claim`], then [`execute`] if the claim
/// is ours. A busy store becomes an unstored 503.
pub fn handle<S: Store>(
    store: &mut S,
    req: &Request,
    ctx: Ctx,
    faults: &mut dyn FnMut(Point) -> Flow,
) -> Result<Outcome, StoreError> {
    let outcome = claim(store, req, ctx).and_then(|claimed| match claimed {
        Claimed::Answer(response) => Ok(Outcome::Respond(response)),
        Claimed::Mine if faults(Point::AfterClaim) == Flow::Crash => Ok(Outcome::Crashed(Point::AfterClaim)),
        Claimed::Mine => execute(store, req, ctx, faults),
    });
    unless_busy(outcome, ctx.policy)
}

/// Turns a lock wait that ran out of budget into an unstored 503.
pub fn unless_busy(outcome: Result<Outcome, StoreError>, policy: &Policy) -> Result<Outcome, StoreError> {
    match outcome {
        Err(StoreError::Busy) => Ok(Outcome::Respond(Response::refusal(policy.on_busy, "busy"))),
        other => other,
    }
}

/// The result of the claim step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claimed {
    /// The key is ours (new, or taken over): go on to [`execute`].
    Mine,
    /// The key belongs to another attempt; this is the answer.
    Answer(Response),
}

/// Step 1: claim the key for `ctx.token`, or say why not.
pub fn claim<S: Store>(store: &mut S, req: &Request, ctx: Ctx) -> Result<Claimed, StoreError> {
    let mut claim = Claim {
        fingerprint: req.fingerprint.clone(),
        token: ctx.token.to_owned(),
        created_at: ctx.now,
        lease_until: ctx.now.plus_seconds(i64::from(ctx.policy.in_progress_lease_seconds)),
    };
    let mut tx = store.begin(Durability::Lazy)?;
    if teeth::is(Broken::LookupThenInsert) {
        return match tx.key(&req.key)? {
            Some(existing) => Ok(Claimed::Answer(answer(
                decide(&existing, &req.fingerprint, ctx.now, ctx.policy),
                ctx.policy,
            ))),
            None => Ok(Claimed::Mine), // the insert comes later, with the money
        };
    }
    if let Some(existing) = tx.insert_claim(&req.key, &claim)? {
        match decide(&existing, &req.fingerprint, ctx.now, ctx.policy) {
            Decision::TakeOver => claim.created_at = existing.created_at,
            Decision::Expired => {}
            other => return Ok(Claimed::Answer(answer(other, ctx.policy))),
        }
        tx.replace_claim(&req.key, &claim)?;
    }
    if teeth::is(Broken::CompletedBeforeExecute) {
        let done = Stored { status: 201, reason: None, body: "{}".into() };
        tx.complete(&req.key, &done, None, ctx.now)?;
    }
    tx.commit()?;
    Ok(Claimed::Mine)
}

/// Step 2: under the claim held by `ctx.token`, move the money and complete
/// the key in one durable transaction.
pub fn execute<S: Store>(
    store: &mut S,
    req: &Request,
    ctx: Ctx,
    faults: &mut dyn FnMut(Point) -> Flow,
) -> Result<Outcome, StoreError> {
    let mut tx = store.begin(Durability::Durable)?;
    if teeth::is(Broken::LookupThenInsert) || teeth::is(Broken::CompletedBeforeExecute) {
        // No fence: whatever the key holds now, this attempt writes over it.
        let claim = Claim {
            fingerprint: req.fingerprint.clone(),
            token: ctx.token.to_owned(),
            created_at: ctx.now,
            lease_until: ctx.now,
        };
        if tx.insert_claim(&req.key, &claim)?.is_some() {
            tx.replace_claim(&req.key, &claim)?;
        }
    }
    match tx.key(&req.key)? {
        Some(KeyRecord { state: KeyState::InProgress { token, .. }, .. }) if token == ctx.token => {}
        // We lost the claim while we were away (lease taken over, key
        // purged): whoever holds the key now decides the answer; money is
        // never moved under a claim that is not ours.
        lost => {
            let decision = lost.map(|rec| decide(&rec, &req.fingerprint, ctx.now, ctx.policy));
            let response = match decision {
                Some(d @ (Decision::Replay(_) | Decision::Mismatch)) => answer(d, ctx.policy),
                _ => in_progress(ctx.policy),
            };
            return Ok(Outcome::Respond(response));
        }
    }
    let (stored, transfer_id) = match ledger::transfer(&mut tx, &req.transfer, ctx.now)? {
        Ok(id) => (created(id, &req.transfer, ctx.now), Some(id)),
        Err(refusal) => (refused(refusal, ctx.policy), None),
    };
    tx.complete(&req.key, &stored, transfer_id, ctx.now)?;
    if faults(Point::BeforeCommit) == Flow::Crash {
        return Ok(Outcome::Crashed(Point::BeforeCommit));
    }
    tx.commit()?;
    if faults(Point::AfterCommit) == Flow::Crash {
        return Ok(Outcome::Crashed(Point::AfterCommit));
    }
    Ok(Outcome::Respond(Response {
        status: stored.status,
        replay: false,
        reason: stored.reason,
        body: stored.body,
    }))
}

/// Requests that arrive in the same instant, interleaved as racers at their
/// worst: every claim lands before any execution starts. This is the
/// schedule in which a lookup-then-insert engine pays twice. Each request is
/// raw text with its context; a malformed one gets its 400 in its place.
pub fn together<S: Store>(store: &mut S, batch: &[(&str, Ctx)]) -> Result<Vec<Response>, StoreError> {
    let staged: Vec<_> = batch
        .iter()
        .map(|(raw, ctx)| match request::parse(raw.as_bytes(), ctx.policy) {
            Err(e) => Err(Response::refusal(ctx.policy.on_invalid_request, e.to_string())),
            Ok(req) => {
                let claimed = claim(store, &req, *ctx);
                Ok((req, claimed))
            }
        })
        .collect();
    let mut responses = Vec::new();
    for ((_, ctx), stage) in batch.iter().zip(staged) {
        let outcome = match stage {
            Err(refusal) => Ok(Outcome::Respond(refusal)),
            Ok((req, claimed)) => claimed.and_then(|c| match c {
                Claimed::Answer(response) => Ok(Outcome::Respond(response)),
                Claimed::Mine => execute(store, &req, *ctx, &mut |_| Flow::Continue),
            }),
        };
        responses.push(match unless_busy(outcome, ctx.policy)? {
            Outcome::Respond(response) => response,
            Outcome::Crashed(p) => return Err(StoreError::Backend(format!("crashed at {p:?} unasked"))),
        });
    }
    Ok(responses)
}

/// Deletes every key created before `before`; returns how many.
pub fn purge<S: Store>(store: &mut S, before: Timestamp) -> Result<u64, StoreError> {
    let mut tx = store.begin(Durability::Durable)?;
    let before = match teeth::is(Broken::PurgeIgnoresCut) {
        true => Timestamp::parse("9999-12-31T23:59:59Z").unwrap_or(before),
        false => before,
    };
    let purged = tx.purge(before)?;
    tx.commit()?;
    Ok(purged)
}

/// A claim still `in_progress`: its holder is executing now, or died.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenClaim {
    pub key: ScopedKey,
    pub created_at: Timestamp,
    pub lease_until: Timestamp,
    /// The lease has run out: the holder is presumed dead.
    pub stale: bool,
}

/// Every claim still in progress at `now`, oldest first.
pub fn open_claims<S: Store>(store: &mut S, now: Timestamp) -> Result<Vec<OpenClaim>, StoreError> {
    let mut tx = store.begin(Durability::Lazy)?;
    let claims = tx.in_progress()?;
    Ok(claims
        .into_iter()
        .filter_map(|(key, rec)| match rec.state {
            KeyState::InProgress { lease_until, .. } => {
                Some(OpenClaim { key, created_at: rec.created_at, lease_until, stale: lease_until <= now })
            }
            KeyState::Completed(_) => None,
        })
        .collect())
}

/// Deletes the stale claims (lease run out) and returns their keys. Safe:
/// money moves only in the transaction that completes a key, so an
/// in-progress key has moved none, and its next request starts afresh.
pub fn release_stale<S: Store>(store: &mut S, now: Timestamp) -> Result<Vec<ScopedKey>, StoreError> {
    let mut tx = store.begin(Durability::Durable)?;
    let mut released = Vec::new();
    for (key, rec) in tx.in_progress()? {
        if let KeyState::InProgress { token, lease_until } = rec.state
            && lease_until <= now
            && tx.release(&key, &token)?
        {
            released.push(key);
        }
    }
    tx.commit()?;
    Ok(released)
}

fn answer(decision: Decision, policy: &Policy) -> Response {
    match decision {
        Decision::Replay(stored) if teeth::is(Broken::RecomputedReplay) => {
            let rebuilt = serde_json::from_str::<serde_json::Value>(&stored.body).map(|v| v.to_string());
            Response::replay_of(Stored { body: rebuilt.unwrap_or(stored.body), ..stored })
        }
        Decision::Replay(stored) => Response::replay_of(stored),
        Decision::Mismatch => Response::refusal(policy.on_fingerprint_mismatch, "fingerprint_mismatch"),
        Decision::InProgress | Decision::TakeOver | Decision::Expired => in_progress(policy),
    }
}

fn in_progress(policy: &Policy) -> Response {
    Response::refusal(policy.on_in_flight, "in_progress")
}

fn created(transfer_id: i64, t: &Transfer, now: Timestamp) -> Stored {
    let id = |a: &AcctId| match a {
        AcctId::Int(i) => i.to_string(),
        AcctId::Text(s) => serde_json::Value::from(s.as_str()).to_string(),
    };
    let body = format!(
        r#"{{"transfer_id":{transfer_id},"src":{},"dst":{},"amount":{},"currency":{},"created_at":"{now}"}}"#,
        id(&t.src),
        id(&t.dst),
        t.amount,
        serde_json::Value::from(t.currency.as_str()),
    );
    Stored { status: 201, reason: None, body }
}

fn refused(refusal: Refusal, policy: &Policy) -> Stored {
    let status = match refusal {
        Refusal::UnknownAccount => policy.on_unknown_account,
        Refusal::InsufficientFunds | Refusal::BalanceOverflow => policy.on_insufficient_funds,
        Refusal::SameAccount => policy.on_invalid_request,
    };
    Stored { status, reason: Some(refusal.reason().to_owned()), body: "null".into() }
}
