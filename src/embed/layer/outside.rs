//! A handler's call to a provider, split as idem's own payouts are
//! (`crate::provider`): the intent commits with the key, the handler's
//! writes and its answer (202, say) in the request's transaction; the call
//! is made with no transaction open and no connection held; its result,
//! the team's own writes for it ([`Outside::new`]'s `settle`) and the
//! key's final answer commit in a second short transaction. An outcome
//! not known leaves the key answering what the handler answered, until the
//! recovery job ([`Idempotency::recover`]) asks the provider by the
//! downstream key and settles it, resends it when the provider never got
//! it, or hands it to a person ([`Idempotency::open_calls`],
//! [`Idempotency::settle_by_hand`]). What the job does with each answer is
//! [`crate::provider::judge`], the rule `idem serve`'s reconciler keeps.

use super::answer::{answered, to_store};
use super::calls::{Cell, Sql, Val};
use super::conn::Held;
use super::{Idempotency, Tx};
use crate::embed::{Answer, Reply};
use crate::provider::{Call, Intent, Limits, Lookup, Provider};
use crate::store::StoreError;
use axum::response::Response;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::Mutex;

type Boxed<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What a call came to, for the team's `settle`: paid, or refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Paid; the provider's own id for it, if it gave one.
    Paid(Option<String>),
    /// Refused for good: `status` is what the provider's refusal maps to
    /// (402 or 422), `reason` the provider's word.
    Refused {
        /// The status a refusal answers with.
        status: u16,
        /// The provider's reason.
        reason: String,
    },
}

/// A call that came to an [`Outcome`]: what the team's `settle` gets.
#[derive(Debug, Clone, PartialEq)]
pub struct Settled {
    /// The call, as the handler declared it.
    pub intent: Intent,
    /// What it came to.
    pub outcome: Outcome,
}

/// The provider as the layer holds it: [`Provider`] with its futures boxed.
pub(super) trait Dyn: Send + Sync {
    fn send<'a>(&'a self, intent: &'a Intent) -> Boxed<'a, Call>;
    fn lookup<'a>(&'a self, intent: &'a Intent) -> Boxed<'a, Lookup>;
}

impl<P: Provider> Dyn for P {
    fn send<'a>(&'a self, intent: &'a Intent) -> Boxed<'a, Call> {
        Box::pin(Provider::send(self, intent))
    }
    fn lookup<'a>(&'a self, intent: &'a Intent) -> Boxed<'a, Lookup> {
        Box::pin(Provider::lookup(self, intent))
    }
}

type SettleFn = dyn Fn(Tx, Settled) -> Boxed<'static, Response> + Send + Sync;

/// The routes' provider, what a call's result writes, and the limits the
/// recovery job keeps to: put it on the layer's state with
/// [`Idempotency::outside`]; a handler then declares its call with
/// [`Tx::call`].
pub struct Outside {
    pub(super) provider: Box<dyn Dyn>,
    settle: Box<SettleFn>,
    /// What the recovery job keeps to: the provider's lookup delay and key
    /// window, the most sends, the waits between looks.
    pub limits: Limits,
    /// How long a send or a lookup may take; past it the outcome is
    /// unknown. Default 10 s.
    pub call_timeout: Duration,
    pub(super) counters: [AtomicU64; 5],
}

/// How the calls behind a state ended, so far ([`Idempotency::call_counts`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CallCounts {
    /// Sends made (first sends and resends).
    pub sent: u64,
    /// Calls settled paid.
    pub paid: u64,
    /// Calls settled refused.
    pub refused: u64,
    /// Results recorded as unknown, for the recovery job.
    pub unknown: u64,
    /// Calls handed to a person.
    pub for_a_person: u64,
}

impl Outside {
    /// `provider`, and `settle`: what a call's result writes, in the
    /// second transaction, and the key's final answer (what the client's
    /// retries replay from then on). It gets the call and its outcome, and
    /// a [`Tx`] on that transaction: a refusal releases what the handler
    /// held, a payment marks it paid. Its answer is stored as a handler's
    /// is (2xx, or one marked [`super::business`]); any other answer rolls
    /// the result back, and the recovery job settles the call later.
    pub fn new<P, F, Fut>(provider: P, settle: F) -> Outside
    where
        P: Provider,
        F: Fn(Tx, Settled) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Response> + Send + 'static,
    {
        Outside {
            provider: Box::new(provider),
            settle: Box::new(move |tx, settled| Box::pin(settle(tx, settled))),
            limits: Limits::default(),
            call_timeout: Duration::from_secs(10),
            counters: Default::default(),
        }
    }

    /// The same, with the recovery job's limits.
    pub fn limits(mut self, limits: Limits) -> Outside {
        self.limits = limits;
        self
    }

    /// The same, with the bound on each send and lookup.
    pub fn call_timeout(mut self, timeout: Duration) -> Outside {
        self.call_timeout = timeout;
        self
    }

    /// How long a caller (a request, or the recovery job) holds a call:
    /// past it, it is presumed dead and the job takes the call over.
    pub(super) fn lease(&self) -> Duration {
        self.call_timeout.saturating_mul(2).saturating_add(Duration::from_secs(1))
    }

    pub(super) fn count(&self, what: usize) {
        self.counters[what].fetch_add(1, Ordering::Relaxed);
    }
}

/// The counters behind [`CallCounts`], by index.
pub(super) const SENT: usize = 0;
pub(super) const PAID: usize = 1;
pub(super) const REFUSED: usize = 2;
pub(super) const UNKNOWN: usize = 3;
pub(super) const FOR_A_PERSON: usize = 4;

pub(super) use crate::clock::{millis as ms, unix_millis as now_ms};

/// Why [`Tx::call`] declared no call.
#[derive(Debug)]
pub enum CallError {
    /// The route's layer has no [`Outside`], or the request runs without a key.
    NoProvider,
    /// The request declared a call already: one call a key.
    Twice,
    /// A call under this key was made before (its key forgotten since, its
    /// call not): it is not made again.
    Made,
    /// The database failed.
    Db(StoreError),
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CallError::NoProvider => write!(f, "the route's idempotency layer has no Outside, or no key"),
            CallError::Twice => write!(f, "a request declares one outside call at most"),
            CallError::Made => write!(f, "a call under this key was made before"),
            CallError::Db(e) => write!(f, "the database failed: {e}"),
        }
    }
}

impl std::error::Error for CallError {}

impl Tx {
    /// Declares the request's call to the layer's provider: `body` is what
    /// the call is (amount, beneficiary, …, as the provider's client needs
    /// it). It is written in the request's transaction, so it commits with
    /// the handler's writes and its answer, or not at all; the layer then
    /// makes the call, outside any transaction, and the call's result
    /// settles the key ([`Outside::new`]). Returns the call with the
    /// downstream key its provider sees on every send. The handler answers
    /// what the client gets until the result is known (202 and where to
    /// look, say).
    pub async fn call(&self, body: serde_json::Value) -> Result<Intent, CallError> {
        let mut slot = self.0.lock().await;
        let held = slot.as_mut().ok_or(CallError::Db(crate::embed::gone()))?;
        let Some((key, token, lease)) = held.call.claim.clone() else { return Err(CallError::NoProvider) };
        if held.call.called.is_some() {
            return Err(CallError::Twice);
        }
        let downstream_key = crate::provider::downstream_key(&token);
        let (at, t) = (now_ms(), held.keys.calls());
        let sql = Sql::new(format!(
            "INSERT INTO {t} (client_id, endpoint, idem_key, key_token, downstream_key, intent, state, holder,
                              lease_until, sends, attempts, note, created_at, updated_at)
             VALUES ($1, $2, $3, $4, $5, $6, 'in_progress', $4, $7, 1, 0, '', $8, $8)
             ON CONFLICT (client_id, endpoint, idem_key) DO NOTHING RETURNING id"
        ));
        let vals = [
            Val::T(key.client_id),
            Val::T(key.endpoint),
            Val::T(key.idem_key),
            Val::T(token),
            Val::T(downstream_key.clone()),
            Val::T(body.to_string()),
            Val::I(at.saturating_add(ms(lease))),
            Val::I(at),
        ];
        let rows = held.query(&sql, &vals, &[true]).await.map_err(CallError::Db)?;
        let Some(id) = rows.first().and_then(|r| r.first()).map(Cell::int) else {
            return Err(CallError::Made);
        };
        let intent = Intent { id, downstream_key, body, sends: 0 };
        held.call.called = Some(intent.clone());
        Ok(intent)
    }
}

/// After the intent committed: the call, with nothing held, then its
/// result. The answer is the result's if it settled the key now, else
/// `provisional` (what the handler answered, and the key replays).
pub(super) async fn call(idem: &Idempotency, intent: Intent, token: &str, provisional: Response) -> Response {
    let Some(outside) = &idem.outside else { return provisional };
    outside.count(SENT);
    let call =
        bounded(outside, outside.provider.send(&intent), || Call::Unknown("no answer in time".into())).await;
    if idem.crash_after_call {
        // the fault point (`faults_from_env`): the provider was called, its
        // result is not recorded; the recovery job must find out
        std::process::abort();
    }
    match record(idem, outside, intent.id, token, call, now_ms()).await {
        Ok(Recorded::Settled(answer, _)) => {
            let mut r = super::answer::answer_of(Reply::Fresh(answer));
            r.headers_mut().remove("idempotent-replayed");
            r
        }
        Ok(Recorded::Left(_) | Recorded::Taken) => provisional,
        Err(e) => {
            tracing::warn!(target: "idem", call = intent.id, error = %e, "a call's result was not recorded; the recovery job will");
            provisional
        }
    }
}

pub(super) async fn bounded<T>(outside: &Outside, work: Boxed<'_, T>, late: impl FnOnce() -> T) -> T {
    tokio::time::timeout(outside.call_timeout, work).await.unwrap_or_else(|_| late())
}

/// A connection's transaction, begun.
pub(super) async fn begun(idem: &Idempotency) -> Result<Held, StoreError> {
    let conn = idem.connection().await.map_err(|_| StoreError::Busy)?;
    let mut held = Held::new(conn, idem.keys.clone());
    match held.begin().await {
        true => Ok(held),
        false => Err(StoreError::Backend("the transaction could not begin".into())),
    }
}

/// What the calls table's rows are read as, in [`COLUMNS`]' order.
pub(super) const COLUMNS: &str =
    "id, client_id, endpoint, idem_key, key_token, downstream_key, intent, state, holder,
                       sends, attempts, note, created_at";
pub(super) const INTS: [bool; 13] =
    [true, false, false, false, false, false, false, false, false, true, true, false, true];

/// A call's row.
#[derive(Debug, Clone)]
pub struct CallRow {
    /// The call, as its provider gets it.
    pub intent: Intent,
    /// Whose key it was made under.
    pub client: String,
    /// The operation the key was for.
    pub endpoint: String,
    /// The client's key.
    pub key: String,
    pub(super) key_token: String,
    /// `in_progress`, `unknown`, `needs_attention`, `completed` or `failed`.
    pub state: String,
    pub(super) holder: String,
    /// The attempts of the recovery job.
    pub attempts: i64,
    /// Why it stands where it does.
    pub note: String,
    /// When the call was declared (Unix milliseconds).
    pub created_at: i64,
}

impl CallRow {
    pub(super) fn read(row: Vec<Cell>) -> CallRow {
        let mut c = row.into_iter();
        let mut next = || c.next().unwrap_or(Cell::T(String::new()));
        let id = next().int();
        let (client, endpoint, key, key_token, downstream_key) =
            (next().text(), next().text(), next().text(), next().text(), next().text());
        let body = serde_json::from_str(&next().text()).unwrap_or(serde_json::Value::Null);
        let (state, holder, sends, attempts, note, created_at) =
            (next().text(), next().text(), next().int(), next().int(), next().text(), next().int());
        CallRow {
            intent: Intent { id, downstream_key, body, sends },
            client,
            endpoint,
            key,
            key_token,
            state,
            holder,
            attempts,
            note,
            created_at,
        }
    }
}

/// Records what call `id` came to, if `holder` still holds it: in one
/// transaction, its state, the team's `settle` writes and the key's final
/// answer once it is paid or refused.
pub(super) async fn record(
    idem: &Idempotency,
    outside: &Outside,
    id: i64,
    holder: &str,
    call: Call,
    next_look: i64,
) -> Result<Recorded, StoreError> {
    let (state, note, outcome) = match &call {
        Call::Paid(paid) => ("completed", String::new(), Some(Outcome::Paid(paid.clone()))),
        Call::Refused { status, reason } => {
            ("failed", reason.clone(), Some(Outcome::Refused { status: *status, reason: reason.clone() }))
        }
        Call::Unknown(why) => ("unknown", why.clone(), None),
        Call::Terminal(why) => ("needs_attention", why.clone(), None),
    };
    let at = now_ms();
    let mut held = begun(idem).await?;
    let t = idem.keys.calls();
    let sql = Sql::new(format!(
        "UPDATE {t} SET state = $2, holder = '', note = $3, lease_until = $4, updated_at = $5
         WHERE id = $1 AND holder = $6 AND state NOT IN ('completed', 'failed') RETURNING {COLUMNS}"
    ));
    let look = if state == "unknown" { next_look } else { at };
    let vals =
        [Val::I(id), Val::T(state.into()), Val::T(note), Val::I(look), Val::I(at), Val::T(holder.into())];
    let Some(row) = held.query(&sql, &vals, &INTS).await?.pop() else {
        held.rollback().await;
        return Ok(Recorded::Taken);
    };
    let row = CallRow::read(row);
    let Some(outcome) = outcome else {
        outside.count(if state == "unknown" { UNKNOWN } else { FOR_A_PERSON });
        return match held.commit().await {
            true => Ok(Recorded::Left(state)),
            false => Err(StoreError::Backend("the call's state may not have committed".into())),
        };
    };
    let paid = matches!(outcome, Outcome::Paid(_));
    let answer = settled(idem, outside, held, row, outcome).await?;
    outside.count(if paid { PAID } else { REFUSED });
    Ok(Recorded::Settled(answer, state))
}

/// What [`record`] did.
pub(super) enum Recorded {
    /// Paid or refused: the key's final answer, and the call's state.
    Settled(Answer, &'static str),
    /// Unknown, or for a person: the call's state.
    Left(&'static str),
    /// Another settled it, or took it over: nothing.
    Taken,
}

/// The team's `settle` on `held`'s transaction, then the key's final
/// answer, committed.
async fn settled(
    idem: &Idempotency,
    outside: &Outside,
    held: Held,
    row: CallRow,
    outcome: Outcome,
) -> Result<Answer, StoreError> {
    let tx = Tx(Arc::new(Mutex::new(Some(held))));
    // a task of its own: a settle that panics ends it alone, its writes rolled
    // back below, and never the request's task nor the recovery job's
    let mut settling =
        tokio::spawn((outside.settle)(tx.clone(), Settled { intent: row.intent.clone(), outcome }));
    let response = match tokio::time::timeout(idem.max_run, &mut settling).await {
        Ok(Ok(response)) => response,
        Ok(Err(_)) => {
            if let Some(mut held) = tx.0.lock().await.take() {
                held.rollback().await;
            }
            return Err(StoreError::Backend("the call's settle panicked".into()));
        }
        Err(_) => {
            settling.abort();
            drop(tx.0.try_lock().ok().and_then(|mut slot| slot.take()));
            return Err(StoreError::Backend("the call's settle ran past its bound".into()));
        }
    };
    let answered = answered(idem, response).await;
    let Some(mut held) = tx.0.lock().await.take() else { return Err(crate::embed::gone()) };
    let (head, bytes) = match answered {
        Ok((head, bytes, true)) => (head, bytes),
        _ => {
            held.rollback().await;
            return Err(StoreError::Backend("the call's settle gave no answer to keep".into()));
        }
    };
    let answer = to_store(idem, &head, &bytes);
    let (stored, kept) = answer.stored();
    let keys = idem.keys.table();
    let sql = Sql::new(format!(
        "UPDATE {keys} SET status = $1, reason = NULL, body = $2, content_type = $3, headers = $4,
                body_bytes = $5
         WHERE client_id = $6 AND endpoint = $7 AND idem_key = $8 AND token = $9 AND state = 'completed'"
    ));
    let vals = [
        Val::I32(i32::from(stored.status)),
        Val::T(stored.body),
        Val::OptT(kept.content_type),
        Val::OptT(kept.headers),
        Val::OptB(kept.body_bytes),
        Val::T(row.client),
        Val::T(row.endpoint),
        Val::T(row.key),
        Val::T(row.key_token),
    ];
    // a key forgotten since (past retention) keeps nothing to answer
    held.exec(&sql, &vals).await?;
    match held.commit().await {
        true => Ok(answer),
        false => Err(StoreError::Backend("the call's result may not have committed".into())),
    }
}
