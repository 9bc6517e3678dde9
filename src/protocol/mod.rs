//! The idempotency protocol: claim → execute → complete, replay, conflict.
//!
//! This is the file to read first. Everything a retry can meet is decided
//! here, once, for every store:
//!
//! 1. **Claim** (a short write transaction): INSERT the scoped key as
//!    `in_progress` with a fresh token. If the key exists, the primary key
//!    says so — there is no lookup before the insert for two racers to both
//!    pass — and [`decide`] reads the existing record: replay, 422, 409, or
//!    take over a claim whose lease ran out (or a key past retention), by a
//!    compare-and-set on the version it saw.
//! 2. **Execute** (a second, durable write transaction): `plan` decides on
//!    the key and the accounts as the store saw them (fencing: a claim no
//!    longer ours, say a slow original whose lease was taken over, writes
//!    nothing), the ledger says whether the money moves and what that rests
//!    on, and the store writes the plan, the money and the exact response
//!    with the key's completion, all or nothing. A store that locks as it
//!    reads (SQLite) writes it as planned; one that reads first and writes
//!    in one statement (PostgreSQL, one round trip a step) writes it only if
//!    the claim is still ours and the ledger's premises still hold under
//!    its locks, and else reads again and plans again.
//! 3. **Replay**: a completed key answers with its stored bytes; only
//!    `replay` differs from the first response.
//!
//! [`conduct`] is the one conductor of claim → work → complete, for every
//! front: [`handle_steps`] runs a request through it on the service's
//! PostgreSQL pool, and [`handle`] on a store that is called (`idem_api`,
//! `idem serve` on SQLite, the harness), blocking on the same code; the
//! library (`embed`) runs its caller's work through it.
//!
//! The claim commit is [`Durability::Lazy`]: a claim lost in a power cut
//! moved no money, and the retry simply claims again. The execution commit
//! is durable; in SQLite's WAL it carries the earlier claim frames to disk
//! with it, and on PostgreSQL the claim's WAL record is flushed by the
//! execution's commit record after it. One fsync per transfer is enough.

use crate::clock::Timestamp;
use crate::ledger::{self, Refusal};
use crate::policy::Policy;
use crate::reason::Reason;
use crate::request::{self, AcctId, Request, RequestError, ScopedKey, Transfer};
use crate::store::{
    self, Audit, Claim, Durability, End, Executed, Execution, KeyRecord, KeyState, Payment, Plan, Reads,
    Seen, Store, StoreError, Stored,
};

mod steps;
mod upkeep;

pub use crate::store::{KeySteps, Steps};
pub use steps::{claim_as, conduct, execute_steps, handle_steps, now};
pub use upkeep::{OpenClaim, open_claims, purge, purge_expired, release_claims};

/// One response, as printed: `{"status","replay","reason","body"}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// The HTTP status.
    pub status: u16,
    /// Whether this is a stored answer given again.
    pub replay: bool,
    /// Why the answer is not a plain success, if it is not.
    pub reason: Option<Reason>,
    /// Raw JSON text of `body`; `null` when there is none.
    pub body: String,
    /// The transfer this answer names, if any.
    pub transfer_id: Option<i64>,
}

impl Response {
    /// A response that is never stored (400, 409, 422, 503).
    pub fn refusal(status: u16, reason: Reason) -> Self {
        Response { status, replay: false, reason: Some(reason), body: "null".into(), transfer_id: None }
    }

    /// The answer a stored response gives: the first time, or as a replay.
    pub fn from_stored(stored: Stored, replay: bool) -> Self {
        let Stored { status, reason, body, transfer_id } = stored;
        Response { status, replay, reason, body, transfer_id }
    }

    /// The one serialisation of a response. The stored body is pasted in as
    /// bytes, never re-serialised, so a replay is identical but for `replay`.
    pub fn to_json(&self) -> String {
        let reason = match &self.reason {
            Some(r) => serde_json::Value::from(r.to_string()).to_string(),
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
    /// The key is completed with this request's body: its stored answer, again.
    Replay(Stored),
    /// The key was used with another body: 422, nothing stored.
    Mismatch,
    /// The key's first request is still running: 409, nothing stored.
    InProgress,
    /// The claim's holder is presumed dead: take the key over, keep its age.
    TakeOver,
    /// Past retention the key is forgotten: this request is new.
    Expired,
}

/// The pure core: no I/O, no clock but the one passed in.
pub fn decide(existing: &KeyRecord, fingerprint: &str, now: Timestamp, policy: &Policy) -> Decision {
    if now.is_at_least(policy.retention_seconds(), existing.created_at) {
        return Decision::Expired;
    }
    if existing.fingerprint != fingerprint {
        return Decision::Mismatch;
    }
    match &existing.state {
        KeyState::Completed(stored) => Decision::Replay(stored.clone()),
        KeyState::InProgress { lease_until } if now < *lease_until => Decision::InProgress,
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
    /// Go on.
    Continue,
    /// Stop here: open transactions roll back, nothing is answered.
    Crash,
}

#[derive(Debug, Clone, PartialEq, Eq)]
/// How a request ended.
pub enum Outcome {
    /// It was answered.
    Respond(Response),
    /// A fault hook stopped it at this point: nothing was answered.
    Crashed(Point),
}

/// Everything about one call that is not the request: the clock, the
/// attempt's unique claim token, the policy.
#[derive(Debug, Clone, Copy)]
pub struct Ctx<'a> {
    /// The published rules.
    pub policy: &'a Policy,
    /// The time the request is handled at.
    pub now: Timestamp,
    /// The attempt's claim token: unique to it, so only it may complete the key.
    pub token: &'a str,
}

/// A fresh claim token: 128 bits, so no two attempts share one, whether
/// they run in many processes or in one service. The process draws 128
/// random bits once; each token is the first half and a bijective mix of
/// the second half plus a counter, so tokens of one process never repeat,
/// tokens of two processes differ by their random halves, and a busy
/// service makes no system call for them.
pub fn fresh_token() -> Result<String, getrandom::Error> {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU64, Ordering};
    static SEED: OnceLock<(u64, u64)> = OnceLock::new();
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let (high, low) = match SEED.get() {
        Some(seed) => *seed,
        None => {
            let mut bits = [0u8; 16];
            getrandom::fill(&mut bits)?;
            let (a, b) = bits.split_at(8);
            let drawn = (
                u64::from_le_bytes(a.try_into().unwrap_or_default()),
                u64::from_le_bytes(b.try_into().unwrap_or_default()),
            );
            *SEED.get_or_init(|| drawn)
        }
    };
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    Ok(format!("{high:016x}{:016x}", crate::rng::mix(low.wrapping_add(n))))
}

/// The result of the claim step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claimed {
    /// The key is ours (new, or taken over): go on to [`execute`].
    Mine,
    /// The key belongs to another attempt; this is the answer.
    Answer(Response),
}

/// The steps of the protocol as one engine. Every store is one (below); the
/// seam lets the harness drive, through the same calls, the deliberately
/// broken engines kept under `tests/`, so it can prove it catches them.
pub trait Engine {
    /// Parses a request's bytes (the lab's request file).
    fn parse(&self, raw: &[u8], policy: &Policy) -> Result<Request, RequestError> {
        request::parse(raw, policy)
    }
    /// A whole request: claim, execute if the claim is ours, release a
    /// claim whose execution failed; a busy store is an unstored 503.
    fn handle(
        &mut self,
        req: &Request,
        ctx: Ctx,
        faults: &mut dyn FnMut(Point) -> Flow,
    ) -> Result<Outcome, StoreError>;
    /// The claim alone (the harness stages racers' claims before any runs).
    fn claim(&mut self, req: &Request, ctx: Ctx) -> Result<Claimed, StoreError>;
    /// The execution alone, under a claim [`Engine::claim`] made.
    fn execute(
        &mut self,
        req: &Request,
        ctx: Ctx,
        faults: &mut dyn FnMut(Point) -> Flow,
    ) -> Result<Outcome, StoreError>;
    /// Lets go of the key if this attempt's claim still holds it in progress.
    fn release(&mut self, req: &Request, ctx: Ctx) -> Result<bool, StoreError>;
    /// Deletes keys created before `before` (past retention); how many.
    fn purge(&mut self, before: Timestamp, policy: &Policy) -> Result<u64, StoreError>;
    /// What the harness reads back to judge a run.
    fn audit(&mut self) -> Result<Audit, StoreError>;
}

/// A store is an engine through the one conductor ([`conduct`]).
impl<S: Store> Engine for S {
    fn handle(
        &mut self,
        req: &Request,
        ctx: Ctx,
        faults: &mut dyn FnMut(Point) -> Flow,
    ) -> Result<Outcome, StoreError> {
        now(handle_steps(&mut steps::blocking(self, &ctx), req, ctx, &mut |p| faults(p)))
    }
    fn claim(&mut self, req: &Request, ctx: Ctx) -> Result<Claimed, StoreError> {
        claim(self, req, ctx)
    }
    fn execute(
        &mut self,
        req: &Request,
        ctx: Ctx,
        faults: &mut dyn FnMut(Point) -> Flow,
    ) -> Result<Outcome, StoreError> {
        execute(self, req, ctx, faults)
    }
    fn release(&mut self, req: &Request, ctx: Ctx) -> Result<bool, StoreError> {
        release(self, &req.key, ctx)
    }
    fn purge(&mut self, before: Timestamp, policy: &Policy) -> Result<u64, StoreError> {
        purge(self, before, policy)
    }
    fn audit(&mut self) -> Result<Audit, StoreError> {
        Store::audit(self)
    }
}

/// Handles one validated request on `engine` ([`Engine::handle`]).
pub fn handle<E: Engine + ?Sized>(
    engine: &mut E,
    req: &Request,
    ctx: Ctx,
    faults: &mut dyn FnMut(Point) -> Flow,
) -> Result<Outcome, StoreError> {
    engine.handle(req, ctx, faults)
}

/// Turns a lock wait that ran out of budget, or a database that cannot be
/// reached or written, into an unstored 503: the client retries with the
/// same key and finds whatever did commit.
pub fn unless_busy(outcome: Result<Outcome, StoreError>, policy: &Policy) -> Result<Outcome, StoreError> {
    match outcome {
        Err(StoreError::Busy) => Ok(Outcome::Respond(Response::refusal(policy.on_busy, Reason::Busy))),
        Err(StoreError::Unavailable(_)) => {
            Ok(Outcome::Respond(Response::refusal(policy.on_busy, Reason::Unavailable)))
        }
        other => other,
    }
}

/// The answer to a request whose key is settled, from a plain read: no
/// claim, no write lock, no wait. Only a completed key within retention is
/// settled (a replay), or a key within retention under another body (422;
/// an expired key is not: it is claimed afresh); `None` sends
/// the request on to [`claim`]. A completed key changes only when it is
/// purged or expires, so a read a moment old answers as the claim would
/// have; and since nothing is claimed here, nothing can be paid by it.
pub fn settled<S: Reads + ?Sized>(
    store: &mut S,
    req: &Request,
    ctx: Ctx,
) -> Result<Option<Response>, StoreError> {
    let Some(existing) = store.peek(&req.key)? else { return Ok(None) };
    Ok(match decide(&existing, &req.fingerprint, ctx.now, ctx.policy) {
        d @ (Decision::Replay(_) | Decision::Mismatch) => Some(answer(d, ctx.policy)),
        Decision::InProgress | Decision::TakeOver | Decision::Expired => None,
    })
}

/// Step 1: claim the key for `ctx.token`, or say why not.
pub fn claim<S: Store + ?Sized>(store: &mut S, req: &Request, ctx: Ctx) -> Result<Claimed, StoreError> {
    let accounts = [&req.transfer.src, &req.transfer.dst];
    claim_for(store, &req.key, &req.fingerprint, Some(accounts), ctx)
}

/// [`claim`] for any request under `key` whose body has `fingerprint`.
pub fn claim_key<S: Store + ?Sized>(
    store: &mut S,
    key: &ScopedKey,
    fingerprint: &str,
    ctx: Ctx,
) -> Result<Claimed, StoreError> {
    claim_for(store, key, fingerprint, None, ctx)
}

/// [`claim_key`], telling the store which accounts the execution will
/// decide on (a store across a network reads them on the way).
fn claim_for<S: Store + ?Sized>(
    store: &mut S,
    key: &ScopedKey,
    fingerprint: &str,
    accounts: Option<[&AcctId; 2]>,
    ctx: Ctx,
) -> Result<Claimed, StoreError> {
    let decided = now(claim_as(&mut steps::blocking(store, &ctx), key, fingerprint, accounts, ctx))?;
    Ok(decided.map_or(Claimed::Mine, |d| Claimed::Answer(answer(d, ctx.policy))))
}

/// A fresh claim for `ctx.token` on a body with `fingerprint`.
fn fresh_claim(fingerprint: &str, ctx: Ctx) -> Claim {
    Claim {
        fingerprint: fingerprint.to_owned(),
        token: ctx.token.to_owned(),
        created_at: ctx.now,
        lease_until: ctx.now.plus_seconds(i64::from(ctx.policy.in_progress_lease_seconds)),
    }
}

/// What a claim that found `existing` does: take it over with the claim
/// returned (a compare-and-set on the version decided on, so it needs no
/// lock held since the read: `false` from the store means another attempt
/// got there first, or the old holder is still executing, and the key is in
/// flight, 409 in progress), or answer as the decision returned says,
/// without executing.
fn after_claim(existing: &KeyRecord, claim: Claim, ctx: Ctx) -> Result<Claim, Decision> {
    let created_at = match decide(existing, &claim.fingerprint, ctx.now, ctx.policy) {
        // A taken-over key keeps its age: retention counts from the first claim.
        Decision::TakeOver => existing.created_at,
        Decision::Expired => ctx.now,
        other => return Err(other),
    };
    Ok(Claim { created_at, ..claim })
}

/// Step 2: under the claim held by `ctx.token`, move the money and complete
/// the key in one durable transaction.
pub fn execute<S: Store + ?Sized>(
    store: &mut S,
    req: &Request,
    ctx: Ctx,
    faults: &mut dyn FnMut(Point) -> Flow,
) -> Result<Outcome, StoreError> {
    now(execute_steps(&mut steps::blocking(store, &ctx), req, ctx, &mut |p| faults(p)))
}

/// The answer of an execution that committed, or the outcome of one that
/// wrote nothing (its claim was lost: `lost` says the answer) or crashed.
fn committed(executed: Executed, lost: Option<Response>, ctx: Ctx) -> Result<Response, Outcome> {
    match executed {
        Executed::Completed(answer) => Ok(Response::from_stored(answer, false)),
        Executed::Crashed => Err(Outcome::Crashed(Point::BeforeCommit)),
        Executed::Nothing => Err(Outcome::Respond(lost.unwrap_or_else(|| in_progress(ctx.policy)))),
    }
}

fn execution<'a>(req: &'a Request, ctx: Ctx<'a>) -> Execution<'a> {
    let t = &req.transfer;
    Execution { key: &req.key, token: ctx.token, accounts: [&t.src, &t.dst], at: ctx.now }
}

/// What the execution writes, decided on what it `seen`: nothing if the
/// claim is no longer ours (the answer for that goes into `lost`), else
/// the key's completion with the ledger's verdict.
fn plan(seen: &Seen, req: &Request, ctx: Ctx, lost: &mut Option<Response>) -> Plan {
    let held = seen.key.as_ref().is_some_and(|rec| rec.held_by(ctx.token));
    if !held {
        // We lost the claim while we were away (lease taken over, key
        // purged): whoever holds the key now decides the answer; money is
        // never moved under a claim that is not ours.
        *lost = Some(lost_claim(seen.key.clone(), req, ctx));
        return Plan::Nothing;
    }
    let t = &req.transfer;
    let [src, dst] = &seen.accounts;
    let verdict = ledger::decide(src.as_ref(), dst.as_ref(), t.amount);
    match verdict.outcome {
        Ok(()) => Plan::Pay { payment: payment(t, ctx.now), premises: verdict.premises },
        Err(refusal) => Plan::Refuse { answer: refused(refusal, ctx.policy), premises: verdict.premises },
    }
}

/// The answer of an attempt that found its claim gone at execution.
fn lost_claim(held: Option<KeyRecord>, req: &Request, ctx: Ctx) -> Response {
    match held.map(|rec| decide(&rec, &req.fingerprint, ctx.now, ctx.policy)) {
        Some(d @ (Decision::Replay(_) | Decision::Mismatch)) => answer(d, ctx.policy),
        _ => in_progress(ctx.policy),
    }
}

/// Deletes the key if `ctx.token` still holds it in progress.
pub fn release<S: Store + ?Sized>(store: &mut S, key: &ScopedKey, ctx: Ctx) -> Result<bool, StoreError> {
    store.release(key, ctx.token, ctx.policy)
}

/// The answer a decision gives without executing.
pub fn answer(decision: Decision, policy: &Policy) -> Response {
    match decision {
        Decision::Replay(stored) => Response::from_stored(stored, true),
        Decision::Mismatch => Response::refusal(policy.on_fingerprint_mismatch, Reason::FingerprintMismatch),
        Decision::InProgress | Decision::TakeOver | Decision::Expired => in_progress(policy),
    }
}

pub(crate) fn in_progress(policy: &Policy) -> Response {
    Response::refusal(policy.on_in_flight, Reason::InProgress)
}

/// The transfer `t` makes at `now`, and its 201's body after the id.
fn payment(t: &Transfer, now: Timestamp) -> Payment {
    let id = |a: &AcctId| match a {
        AcctId::Int(i) => i.to_string(),
        AcctId::Text(s) => serde_json::Value::from(s.as_str()).to_string(),
    };
    let body_tail = format!(
        r#","src":{},"dst":{},"amount":{},"currency":{},"created_at":"{now}"}}"#,
        id(&t.src),
        id(&t.dst),
        t.amount,
        serde_json::Value::from(t.currency.as_str()),
    );
    Payment { amount: t.amount, currency: t.currency.clone(), body_tail }
}

/// A refusal of the ledger's, as stored and replayed.
pub(crate) fn refused(refusal: Refusal, policy: &Policy) -> Stored {
    let status = match refusal {
        Refusal::UnknownAccount => policy.on_unknown_account,
        Refusal::InsufficientFunds | Refusal::BalanceOverflow => policy.on_insufficient_funds,
        Refusal::SameAccount => policy.on_invalid_request,
    };
    Stored { status, reason: Some(refusal.reason()), body: "null".into(), transfer_id: None }
}

#[cfg(test)]
mod tests;
