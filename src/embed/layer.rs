//! The `Idempotency-Key` middleware for axum (feature `axum`), on
//! PostgreSQL or SQLite, on connections of its own or the application's
//! (a deadpool-postgres pool, a sqlx pool): the key's claim, the handler's
//! writes and the stored answer commit in one transaction, which the
//! handler reaches through the [`Tx`] extractor (`Tx::client` on
//! tokio-postgres, `Tx::sqlite` on rusqlite, `Tx::sqlx_postgres` and
//! `Tx::sqlx_sqlite` on sqlx). It is [`idempotent`] for axum's
//! `from_fn_with_state`, and [`IdempotencyLayer`] as a `tower::Layer`; the
//! handler reads the key it runs under as `Extension<`[`IdemKey`]`>`.
//!
//! On SQLite the layer holds one connection, and a request holds it from
//! its claim to its commit: SQLite takes one writer at a time anyway, and
//! a request waiting for it waits without holding a thread.
//!
//! ```no_run
//! use axum::{Router, routing::post, middleware::from_fn_with_state};
//! use idem::embed::{Keys, layer::{Idempotency, Tx, idempotent}};
//!
//! async fn pay(tx: Tx, body: String) -> axum::response::Response {
//!     let c = tx.client().await.expect("on PostgreSQL");
//!     c.execute("INSERT INTO payments (body) VALUES ($1)", &[&body]).await.unwrap();
//!     (axum::http::StatusCode::CREATED, "{\"paid\":true}").into_response()
//! }
//! # use axum::response::IntoResponse;
//! # async fn setup() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let keys = Keys::new("app_")?;
//! let idem = Idempotency::connect("host=/run/postgresql dbname=app", keys, 16, |headers| {
//!     headers.get("x-client").and_then(|v| v.to_str().ok()).map(String::from)
//! }).await?;
//! let app: Router = Router::new()
//!     .route("/v1/payments", post(pay))
//!     .route_layer(from_fn_with_state(idem.clone(), idempotent));
//! # Ok(()) }
//! ```
//!
//! What the layer answers itself, as problem+json (RFC 9457): 401 when the
//! caller's `client` function names nobody, 400 for a missing or malformed
//! key or a body that is not JSON, 413 for a body past the limit, 409 (with
//! `Retry-After`) while the key's first request runs, 422 for the key with
//! another body or query string, 503 when no connection is to be had. A key
//! is scoped by the client, the method and the path the client sent (the
//! whole path under `Router::nest`). A replay is the
//! stored status and body with `Idempotent-Replayed: true`.
//!
//! Which answers are stored: 2xx (or what [`Idempotency::keep_when`] says),
//! and any response the handler marks as a business answer with
//! [`business`] (a refusal such as insufficient funds: its retry gets the
//! same refusal), their bodies as they were, text or not. Anything else (a 400 for a malformed
//! request, a 5xx) rolls back the handler's writes with the claim, and the
//! key stays free for the corrected request.

use super::{Answer, Keys, Scope, Stop, gone};
use crate::request::{AcctId, ScopedKey};
use crate::store::{Claim, KeyRecord, KeySteps, StoreError};
use axum::body::{Body, to_bytes};
use axum::extract::{OriginalUri, Request, State};
use axum::http::{HeaderName, HeaderValue, StatusCode, header, request::Parts};
use axum::middleware::Next;
use axum::response::Response;
use std::sync::Arc;

mod answer;
mod calls;
mod conn;
mod key;
mod lend;
mod outside;
mod recover;
mod run;
mod service;
mod tx;
mod upkeep;
use answer::unavailable;
pub use answer::{business, problem};
use conn::Store;
pub use key::IdemKey;
pub use outside::{CallCounts, CallError, CallRow, Outcome, Outside, Settled};
pub use recover::Recovered;
pub use run::Counts;
pub use service::{IdempotencyLayer, IdempotentService};
pub use tx::Tx;
#[cfg(feature = "postgres")]
pub use tx::TxClient;
#[cfg(feature = "sqlite")]
pub use tx::TxSqlite;
#[cfg(feature = "sqlx-sqlite")]
pub use tx::TxSqlxLite;
#[cfg(feature = "sqlx-postgres")]
pub use tx::TxSqlxPg;

/// Who the client is, from the request's head: its headers, or what an
/// auth layer before this one put in its extensions (`None`: 401).
type WhoIs = dyn Fn(&Parts) -> Option<String> + Send + Sync;

/// The middleware's state: where keys live, the connections, and who the
/// client is. Cheap to clone.
#[derive(Clone)]
pub struct Idempotency {
    keys: Arc<Keys>,
    store: Store,
    who: Arc<WhoIs>,
    /// The largest request body read, in bytes.
    pub max_body: usize,
    /// How long a request waits for a connection (SQLite's one, or one of
    /// the pool's) before it is answered 503 `busy` with `Retry-After`:
    /// behind a slow handler, a client learns at once to come back rather
    /// than queueing without bound. Default 2 s.
    pub max_wait: std::time::Duration,
    /// The headers of a stored answer that its replays carry besides
    /// `Content-Type`, each value as the handler set it. Default:
    /// `Location` (a created resource's address).
    pub replayed_headers: Vec<HeaderName>,
    /// How long a handler may run before it is stopped: its writes rolled
    /// back, its key left free, 503 `handler_timed_out` with `Retry-After`
    /// answered, and its connection (on SQLite the one the others wait
    /// for) let go. Shorter than the key's lease, so a stopped run never
    /// outlives its claim. Default 30 s.
    pub max_run: std::time::Duration,
    /// Which statuses of the handler's answers are stored with the key
    /// (and replayed), besides those marked [`business`]: 2xx by default.
    keeps: Arc<dyn Fn(StatusCode) -> bool + Send + Sync>,
    /// A request without a key runs unprotected instead of 400.
    key_optional: bool,
    /// The fault point, for a checker: the process aborts after a keyed
    /// handler's writes, before their commit.
    crash_before_commit: bool,
    /// The fault point past a provider's call: the process aborts after
    /// the call, before its result is recorded.
    crash_after_call: bool,
    /// The provider the routes' handlers call ([`Tx::call`]).
    outside: Option<Arc<Outside>>,
    counters: Arc<run::Counters>,
}

impl Idempotency {
    /// The same state, naming the client from the request's whole head
    /// instead of its headers alone: the claims an auth layer before this
    /// one put in the request's extensions, say (`None`: 401).
    ///
    /// ```no_run
    /// # use idem::embed::{Keys, layer::Idempotency};
    /// #[derive(Clone)]
    /// struct Claims { subject: String } // what the team's auth layer inserts
    /// # async fn setup() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// let idem = Idempotency::connect("shop.db", Keys::new("app_")?, 1, |_| None)
    ///     .await?
    ///     .who_from_parts(|parts| parts.extensions.get::<Claims>().map(|c| c.subject.clone()));
    /// # Ok(()) }
    /// ```
    pub fn who_from_parts(mut self, who: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static) -> Self {
        self.who = Arc::new(who);
        self
    }

    /// The same state, storing the handler's answers whose status `keep`
    /// accepts (and those marked [`business`]); the default keeps 2xx. An
    /// answer not kept rolls back with the claim, and the key stays free.
    ///
    /// ```no_run
    /// # use idem::embed::{Keys, layer::Idempotency};
    /// # async fn setup() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// // a 4xx refusal is an answer too: its retry gets the same refusal
    /// let idem = Idempotency::connect("shop.db", Keys::new("app_")?, 1, |_| Some("c1".into()))
    ///     .await?
    ///     .keep_when(|status| status.is_success() || status.is_client_error());
    /// # Ok(()) }
    /// ```
    pub fn keep_when(mut self, keep: impl Fn(StatusCode) -> bool + Send + Sync + 'static) -> Self {
        self.keeps = Arc::new(keep);
        self
    }

    /// The same state, letting a request that sends no `Idempotency-Key`
    /// through instead of answering 400: its handler runs in a transaction
    /// of its own, unprotected (a retry of it runs again), and is counted
    /// ([`Counts::unkeyed`]) and logged (`tracing`, target `idem`). For the
    /// routes of a live API whose clients do not all send keys yet: put the
    /// layer of this state on those routes alone. A key sent malformed is
    /// still 400. A handler that reads `Extension<IdemKey>` reads it as an
    /// `Option` there.
    pub fn key_optional(mut self) -> Self {
        self.key_optional = true;
        self
    }

    /// The same state, with the layer's fault point on when the
    /// environment says so: with `IDEM_FAULT=crash-before-commit`, the
    /// process aborts (as a SIGKILL would end it) after a keyed handler's
    /// writes and answer, before their commit. A checker that starts the
    /// service with it (`idem check --serve`, a profile's
    /// `crash_before_commit_env`) then retries the key on a restarted
    /// service: a handler that wrote through `Tx` ran once, one that wrote
    /// through a pool of its own is seen running twice. Call it in the
    /// builds a checker runs; without the variable it does nothing.
    pub fn faults_from_env(mut self) -> Self {
        let fault = std::env::var_os("IDEM_FAULT");
        self.crash_before_commit = fault.as_ref().is_some_and(|v| v == "crash-before-commit");
        self.crash_after_call = fault.is_some_and(|v| v == "crash-after-call");
        self
    }

    /// How the requests behind this state ended, so far.
    pub fn counts(&self) -> Counts {
        self.counters.counts()
    }

    /// A connection, or the answer when none is to be had: 503 `busy`
    /// past [`Idempotency::max_wait`], 503 `unavailable` if the database
    /// failed.
    async fn connection(&self) -> Result<conn::Conn, Response> {
        match tokio::time::timeout(self.max_wait, self.store.connection()).await {
            Ok(Some(conn)) => Ok(conn),
            Ok(None) => Err(unavailable()),
            Err(_) => {
                let mut r =
                    problem(StatusCode::SERVICE_UNAVAILABLE, "busy", "No connection came free in time.");
                r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
                Err(r)
            }
        }
    }
}

/// The request's transaction, as the conductor's key steps
/// (`protocol::conduct`): each step takes the transaction from the slot
/// the handler reaches it through, and puts it back.
struct OnSlot(Tx);

impl KeySteps for OnSlot {
    async fn claim(
        &mut self,
        key: &ScopedKey,
        claim: &Claim,
        accounts: Option<[&AcctId; 2]>,
    ) -> Result<Option<KeyRecord>, StoreError> {
        let mut slot = self.0.0.lock().await;
        slot.as_mut().ok_or_else(gone)?.claim(key, claim, accounts).await
    }

    async fn replace_claim(
        &mut self,
        key: &ScopedKey,
        seen: &KeyRecord,
        claim: &Claim,
    ) -> Result<bool, StoreError> {
        let mut slot = self.0.0.lock().await;
        slot.as_mut().ok_or_else(gone)?.replace_claim(key, seen, claim).await
    }

    /// Nothing to delete: the claim goes with the transaction's rollback,
    /// which the layer runs once the conductor is done.
    async fn release(&mut self, _: &ScopedKey, _: &str) -> Result<bool, StoreError> {
        Ok(false)
    }
}

impl OnSlot {
    /// Stores `answer` with the key `token` claimed and commits; whether
    /// it committed (`false`: it may have, or not).
    async fn complete_and_commit(&self, key: &ScopedKey, token: &str, answer: &Answer) -> bool {
        let mut slot = self.0.0.lock().await;
        match slot.as_mut() {
            Some(held) => held.complete_and_commit(key, token, answer).await,
            None => false,
        }
    }
}

/// Who the client of a claimed request is (as the `who` function said), for
/// the handler: `axum::Extension<Caller>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller(pub String);

/// The middleware (use it with `axum::middleware::from_fn_with_state`, or
/// as a `tower::Layer`: [`IdempotencyLayer`]).
pub async fn idempotent(State(idem): State<Idempotency>, request: Request, next: Next) -> Response {
    guard(idem, request, move |r| next.run(r)).await
}

/// The middleware around `next` (what runs the handler).
async fn guard<F, Fut>(idem: Idempotency, request: Request, next: F) -> Response
where
    F: FnOnce(Request) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Response> + Send + 'static,
{
    let (mut parts, body) = request.into_parts();
    let Some(client) = (idem.who)(&parts) else {
        return problem(StatusCode::UNAUTHORIZED, "unauthorized", "Who the client is was not said.");
    };
    let key = match crate::request::idempotency_key(
        parts.headers.get_all("idempotency-key").iter().map(HeaderValue::as_bytes),
        255,
    ) {
        Ok(key) => Some(key),
        Err(("missing_idempotency_key", _)) if idem.key_optional => None,
        Err((reason, detail)) => return problem(StatusCode::BAD_REQUEST, reason, &detail),
    };
    let sent = parts.headers.get_all(crate::request::FIRST_SENT).iter().map(HeaderValue::as_bytes);
    let retention = idem.keys.policy.retention_seconds();
    if let Err((status, reason, detail)) =
        crate::request::first_sent(sent, time::OffsetDateTime::now_utc(), retention)
    {
        return problem(StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST), reason, &detail);
    }
    let Ok(bytes) = to_bytes(body, idem.max_body).await else {
        return problem(StatusCode::PAYLOAD_TOO_LARGE, "too_large", "The body is past the limit.");
    };
    parts.extensions.insert(Caller(client.clone()));
    let Some(key) = key else {
        let request = Request::from_parts(parts, Body::from(bytes));
        return finished(tokio::spawn(run::unkeyed(idem, client, request, next)).await);
    };
    // any body: JSON canonically, anything else by its media type and bytes
    // exactly (never mended into text: two bodies that differ only in bytes
    // that are not UTF-8 would share a fingerprint)
    let media_type = parts.headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok());
    let fingerprint = match idem.keys.admit_body::<String>(&key, media_type, &bytes) {
        Ok(f) => f,
        Err(e) => return problem(StatusCode::BAD_REQUEST, "invalid_request", &e.to_string()),
    };
    // The request as the client sent it: under `Router::nest` the handler's
    // URI has the prefix stripped, so `/v1/orders` and `/v2/orders` would
    // share their keys. The query is part of the request: the key used
    // under another query is another request (422), never the first's replay.
    let sent = parts.extensions.get::<OriginalUri>().map_or(&parts.uri, |o| &o.0).clone();
    let fingerprint = match sent.query() {
        Some(query) => with_query(&fingerprint, query),
        None => fingerprint,
    };
    let scope = Scope::new(client, format!("{} {}", parts.method, sent.path()));
    let (client, endpoint) = (scope.client.clone(), scope.endpoint.clone());
    parts.extensions.insert(IdemKey { client, endpoint, key: key.clone() });
    // From the claim on, the request runs to its end in a task of its own:
    // a client that hangs up, or a timeout layer that drops this future,
    // leaves the handler to finish and its answer to be stored, so the
    // retry replays it (Stripe's and brandur's choice: a started request
    // finishes). A handler that panics ends its task: its writes and its
    // claim roll back (`Held`'s drop), and the retry runs it afresh.
    let request = Request::from_parts(parts, Body::from(bytes));
    let span = tracing::info_span!(target: "idem", "idempotent", client = %scope.client, endpoint = %scope.endpoint, key = %key, status = tracing::field::Empty, replayed = tracing::field::Empty);
    let run = tracing::Instrument::instrument(
        run::keyed(idem, scope.key(&key), fingerprint, request, next),
        span.clone(),
    );
    let response = finished(tokio::spawn(run).await);
    span.record("status", response.status().as_u16());
    span.record("replayed", response.headers().contains_key("idempotent-replayed"));
    response
}

/// The answer of a request's task: a handler that panicked ended it, and
/// its writes and claim rolled back with its transaction.
fn finished(task: Result<Response, tokio::task::JoinError>) -> Response {
    task.unwrap_or_else(|_| {
        problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            "handler_failed",
            "The handler failed; nothing it did was kept, and the key is free.",
        )
    })
}

/// The fingerprint of a body sent under `query`. A request without a query
/// keeps its body's fingerprint alone, as keys stored before the query
/// counted were fingerprinted.
fn with_query(fingerprint: &str, query: &str) -> String {
    use sha2::{Digest, Sha256};
    let digest = Sha256::new().chain_update(fingerprint).chain_update("?").chain_update(query).finalize();
    crate::hex::lower(&digest)
}
