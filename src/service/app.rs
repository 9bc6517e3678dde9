//! What every route answers with: the service's shared state ([`App`]),
//! who the caller is, and the protocol's answers as HTTP (statuses,
//! problem+json bodies after RFC 9457, `Location`, `Retry-After`). The
//! transfer routes (`http.rs`) and the payout routes (`payouts.rs`) both
//! build on it; neither on the other's.

use super::desk::Desk;
use super::executor::{Executor, Job};
use super::health::Health;
use super::log::Log;
use super::metrics::Metrics;
use super::problems;
use crate::clock::Timestamp;
use crate::policy::Policy;
use crate::protocol::Response as Answer;
use crate::reason::Reason;
use crate::store::StoreError;
use http_body_util::Full;
use hyper::body::Bytes;
use hyper::header::{self, HeaderMap, HeaderValue};
use hyper::{Response, StatusCode};
use serde_json::json;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{Semaphore, oneshot};

/// How long a client may take to send a request's body (transfers,
/// payouts and provider events alike).
pub(super) const BODY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

pub const TRANSFERS: &str = "/v1/transfers";

pub struct App {
    /// SHA-256 of each bearer token → its client id. Looking tokens up by
    /// their digest keeps the lookup's timing unrelated to how much of a
    /// guessed token is right.
    clients: HashMap<[u8; 32], String>,
    pub executor: Executor,
    pub metrics: Metrics,
    pub log: Log,
    pub(super) health: Arc<Health>,
    pub(super) policy: &'static Policy,
    pub(super) in_flight: Semaphore,
    /// Where payouts go; `None`: no payouts.
    pub(super) payouts: Option<Desk>,
}

impl App {
    pub fn new(
        clients: HashMap<String, String>,
        executor: Executor,
        health: Arc<Health>,
        log: Log,
        policy: &'static Policy,
        max_in_flight: usize,
        payouts: Option<Desk>,
    ) -> Self {
        let clients = clients.into_iter().map(|(token, client)| (digest(token.as_bytes()), client)).collect();
        App {
            clients,
            executor,
            metrics: Metrics::default(),
            log,
            health,
            policy,
            in_flight: Semaphore::new(max_in_flight),
            payouts,
        }
    }

    /// An accept that failed (descriptors exhausted): counted and logged;
    /// the accept loop backs off.
    pub fn accept_failed(&self, e: &std::io::Error) {
        self.metrics.accept_failed();
        self.log.line(
            json!({"ts": Timestamp::now().to_string(), "event": "accept_failed", "error": e.to_string()})
                .to_string(),
        );
    }

    /// A connection that ended in error. hyper answers a request it cannot
    /// parse (400, 414, 431) itself, before any route runs: such answers are
    /// counted and logged here, as `route="malformed"`.
    pub fn connection_failed(&self, e: &hyper::Error) {
        let status = match () {
            _ if e.is_parse_too_large() => 431,
            _ if e.is_parse() => 400,
            _ => return,
        };
        self.metrics.finished("malformed", status, false, Duration::ZERO);
        self.log.line(
            json!({"ts": Timestamp::now().to_string(), "route": "malformed", "status": status,
                   "reason": "malformed_request", "error": e.to_string()})
            .to_string(),
        );
    }
}

fn digest(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

pub(super) type Reply = Response<Full<Bytes>>;

/// What the log line says of a request besides its status.
#[derive(Default)]
pub(super) struct Note {
    pub client: Option<String>,
    pub key: Option<String>,
    pub replay: bool,
    pub reason: Option<String>,
    /// A store error behind a 5xx, for the operator (never in a response).
    pub error: Option<String>,
}

/// The caller's client id, from `Authorization: Bearer <token>`.
pub(super) fn authenticate(app: &App, headers: &HeaderMap) -> Option<String> {
    // Authorization is a singleton: two of them is no credential at all.
    let mut values = headers.get_all(header::AUTHORIZATION).iter();
    let (Some(value), None) = (values.next(), values.next()) else { return None };
    let value = value.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    app.clients.get(&digest(token.trim().as_bytes())).cloned()
}

pub(super) fn unauthorized(note: &mut Note) -> Reply {
    let mut reply = problem(
        StatusCode::UNAUTHORIZED,
        "unauthorized",
        "A valid bearer token is required (Authorization: Bearer <token>).",
        note,
    );
    reply.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    reply
}

/// Runs `work` on a writer's connection; `None` if the queue is full or the
/// worker went away.
pub(super) async fn on_writer<R: Send + 'static>(
    app: &App,
    work: impl FnOnce(&mut dyn crate::store::Store) -> R + Send + 'static,
) -> Option<R> {
    let (reply, answer) = oneshot::channel();
    let job = Job::Run(Box::new(move |store| drop(reply.send(work(store)))));
    if !app.executor.submit(job) {
        return None;
    }
    answer.await.ok()
}

/// The protocol's answer as HTTP: a 201 with the stored bytes and its
/// `Location`, or a problem; a replay says so in `Idempotent-Replayed`.
pub(super) fn respond(answer: Answer, note: &mut Note) -> Reply {
    note.replay = answer.replay;
    let mut reply = match (answer.status, answer.transfer_id) {
        (201, Some(id)) => {
            let mut reply = Response::new(Full::new(Bytes::from(answer.body)));
            *reply.status_mut() = StatusCode::CREATED;
            let headers = reply.headers_mut();
            headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
            if let Ok(location) = HeaderValue::from_str(&format!("{TRANSFERS}/{id}")) {
                headers.insert(header::LOCATION, location);
            }
            reply
        }
        (status, _) => {
            let Some(reason) = answer.reason else { return failed(note) };
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            let mut reply = problem(status, reason.code(), detail_of(&reason), note);
            if matches!(status, StatusCode::CONFLICT | StatusCode::SERVICE_UNAVAILABLE) {
                reply.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            reply
        }
    };
    if answer.replay {
        reply.headers_mut().insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    reply
}

fn detail_of(reason: &Reason) -> &str {
    match reason {
        Reason::InProgress => "A request with this key is being processed; retry shortly.",
        Reason::FingerprintMismatch => "This key was used with a different request body.",
        Reason::UnknownAccount => "The source or destination account does not exist.",
        Reason::InsufficientFunds => "The source account's balance is below the amount.",
        Reason::BalanceOverflow => "The destination account cannot hold the amount.",
        Reason::PayoutKeyUsed => {
            "This key made a payout whose answer is no longer kept; a key never makes a second payout: use a new key for a new payout."
        }
        Reason::Busy => "The service is busy; retry shortly.",
        Reason::Unavailable => "The database cannot take requests now; retry shortly with the same key.",
        Reason::Invalid { detail, .. } => detail,
        // a gateway's refusal, in its words
        Reason::Other(text) => text,
    }
}

/// A malformed request's 400: its code as the reason, what is wrong as the detail.
pub(super) fn invalid(reason: &Reason, note: &mut Note) -> Reply {
    problem(StatusCode::BAD_REQUEST, reason.code(), reason.detail().unwrap_or_default(), note)
}

pub(super) fn busy(app: &App, note: &mut Note) -> Reply {
    let answer = Answer::refusal(app.policy.on_busy, Reason::Busy);
    respond(answer, note)
}

/// A store error as an answer: a database that is unavailable or busy is a
/// 503 the client retries; anything else a 500. The error's text goes to
/// the log only: a response never carries database text.
pub(super) fn store_error(app: &App, e: &StoreError, note: &mut Note) -> Reply {
    note.error = Some(e.to_string());
    match e {
        StoreError::Busy => respond(Answer::refusal(app.policy.on_busy, Reason::Busy), note),
        StoreError::Unavailable(_) => respond(Answer::refusal(app.policy.on_busy, Reason::Unavailable), note),
        _ => failed(note),
    }
}

pub(super) fn failed(note: &mut Note) -> Reply {
    problem(StatusCode::INTERNAL_SERVER_ERROR, "internal_error", "The request could not be completed.", note)
}

/// The answer of a request task that did not end (it panicked).
pub fn internal() -> Reply {
    failed(&mut Note::default())
}

pub(super) fn text(status: StatusCode, content_type: &'static str, body: String) -> Reply {
    let mut reply = Response::new(Full::new(Bytes::from(body)));
    *reply.status_mut() = status;
    reply.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    reply
}

/// An RFC 9457 problem with the `reason` extension member `idem_api` uses;
/// its `type` and its `Link` name the reason's page (see [`problems`]).
pub(super) fn problem(status: StatusCode, reason: &str, detail: &str, note: &mut Note) -> Reply {
    note.reason.get_or_insert_with(|| reason.to_owned());
    let uri = problems::uri(reason);
    let title = status.canonical_reason().unwrap_or("Error");
    let body = crate::reason::problem_body(&uri, status.as_u16(), title, reason, detail);
    let mut reply = text(status, "application/problem+json", body);
    if let Ok(link) = HeaderValue::from_str(&format!("<{uri}>; rel=\"describedby\"")) {
        reply.headers_mut().insert(header::LINK, link);
    }
    reply
}
