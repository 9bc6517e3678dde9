//! The HTTP front: routes, authentication, the `Idempotency-Key` header,
//! limits, and the mapping of the protocol's answers to statuses and
//! problem+json bodies (RFC 9457). It decides nothing about keys: every
//! transfer goes through the same protocol as `idem_api`, in the same key
//! space, scoped by `(client id from the token, route path, key)`.

pub use super::app::{App, TRANSFERS, internal};
use super::app::{
    BODY_TIMEOUT, Note, Reply, authenticate, busy, failed, invalid, problem, respond, store_error, text,
    unauthorized,
};
use super::executor::Job;
use super::problems;
use crate::clock::Timestamp;
use crate::payout::PAYOUTS;
use crate::protocol::Outcome;
use crate::request::{self, ScopedKey};
use http_body_util::{BodyExt, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::header::{self, HeaderMap, HeaderValue};
use hyper::{Method, Request, StatusCode};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

const OPENAPI: &str = include_str!("openapi.json");
/// How much of a refused request's body is read away before answering.
const DRAIN_BYTES: usize = 1 << 20;
/// How long a refused request's body may take to be read away.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(2);

/// Answers one request, counts it and logs it.
pub async fn handle(app: Arc<App>, req: Request<Incoming>) -> Reply {
    let started = Instant::now();
    app.metrics.started();
    let (method, path) = (req.method().clone(), req.uri().path().to_owned());
    let route = route_of(&path);
    let mut note = Note::default();
    let reply = dispatch(&app, req, &mut note).await;
    let took = started.elapsed();
    app.metrics.finished(route, reply.status().as_u16(), note.replay, took);
    log(&app, &method, &path, &reply, &note, took);
    reply
}

fn route_of(path: &str) -> &'static str {
    match path {
        TRANSFERS => TRANSFERS,
        "/healthz" => "/healthz",
        "/metrics" => "/metrics",
        "/openapi.json" => "/openapi.json",
        p if p.starts_with("/v1/transfers/") => "/v1/transfers/{id}",
        PAYOUTS => PAYOUTS,
        "/v1/gateway-events" => "/v1/gateway-events",
        p if p.starts_with("/v1/payouts/") => "/v1/payouts/{id}",
        _ => "other",
    }
}

/// One JSON line per request. The key is logged as a keyed hash, and the
/// reason as its code alone: a log is read by more people than the
/// database, and neither may carry what the client wrote.
fn log(app: &App, method: &Method, path: &str, reply: &Reply, note: &Note, took: Duration) {
    use std::fmt::Write;
    let mut line = String::with_capacity(256);
    let text = |s: &str| serde_json::Value::from(s).to_string();
    let _ = write!(
        line,
        r#"{{"ts":"{}","method":{},"path":{}"#,
        Timestamp::now(),
        text(method.as_str()),
        text(&path.chars().take(200).collect::<String>())
    );
    if let Some(client) = &note.client {
        let _ = write!(line, r#","client":{}"#, text(client));
        if let Some(key) = &note.key {
            let _ = write!(line, r#","key_tag":"{}""#, app.log.key_tag(client, key));
        }
    }
    let _ = write!(line, r#","status":{},"replay":{}"#, reply.status().as_u16(), note.replay);
    if let Some(reason) = &note.reason {
        let _ = write!(line, r#","reason":{}"#, text(reason.split(':').next().unwrap_or(reason)));
    }
    if let Some(error) = &note.error {
        let _ = write!(line, r#","error":{}"#, text(error));
    }
    let _ = write!(line, r#","latency_ms":{}}}"#, (took.as_secs_f64() * 1e6).round() / 1e3);
    app.log.line(line);
}

async fn dispatch(app: &Arc<App>, req: Request<Incoming>, note: &mut Note) -> Reply {
    let path = req.uri().path().to_owned();
    // HEAD is GET without the body; hyper leaves the body out.
    let method = match req.method() {
        &Method::HEAD => Method::GET,
        other => other.clone(),
    };
    match (&method, path.as_str()) {
        (&Method::GET, "/healthz") => health(app, note).await,
        (&Method::GET, "/metrics") => text(
            StatusCode::OK,
            "text/plain; version=0.0.4",
            app.metrics.render(app.log.dropped(), app.executor.batches()),
        ),
        (&Method::GET, "/openapi.json") => text(StatusCode::OK, "application/json", OPENAPI.to_owned()),
        (&Method::GET, "/problems") => text(StatusCode::OK, HTML, problems::page(None).unwrap_or_default()),
        (&Method::GET, p) if p.starts_with("/problems/") => {
            match problems::page(Some(&p["/problems/".len()..])) {
                Some(page) => text(StatusCode::OK, HTML, page),
                None => problem(StatusCode::NOT_FOUND, "not_found", "No such problem type.", note),
            }
        }
        (&Method::POST, TRANSFERS) => transfer(app, req, note).await,
        (&Method::POST, PAYOUTS) => transfer(app, req, note).await,
        (&Method::POST, "/v1/gateway-events") => super::payouts::event(app, req, note).await,
        (&Method::GET, p) if p.starts_with("/v1/payouts/") => {
            super::payouts::lookup(app, req.headers(), &p["/v1/payouts/".len()..], note).await
        }
        (&Method::GET, p) if p.starts_with("/v1/transfers/") => {
            lookup(app, req.headers(), &p[14..], note).await
        }
        (_, "/healthz" | "/metrics" | "/openapi.json" | "/problems") => not_allowed("GET, HEAD", note),
        (_, p) if p.starts_with("/problems/") => not_allowed("GET, HEAD", note),
        (_, TRANSFERS | PAYOUTS | "/v1/gateway-events") => not_allowed("POST", note),
        (_, p) if p.starts_with("/v1/transfers/") || p.starts_with("/v1/payouts/") => {
            not_allowed("GET, HEAD", note)
        }
        _ => problem(StatusCode::NOT_FOUND, "not_found", "No such resource.", note),
    }
}

/// Answers a transfer after reading away what is left of its body (up to a
/// bound): closing a connection with unread bytes makes the kernel reset it,
/// and the client may never see the answer that explains the refusal.
async fn transfer(app: &Arc<App>, req: Request<Incoming>, note: &mut Note) -> Reply {
    let (parts, body) = req.into_parts();
    let mut body = Some(body);
    let reply = refuse_or_transfer(app, Request::from_parts(parts, ()), &mut body, note).await;
    if let Some(rest) = body {
        drain(rest).await;
    }
    reply
}

/// Reads a refused body away frame by frame, keeping none of it, up to
/// [`DRAIN_BYTES`] and [`DRAIN_TIMEOUT`]; past either the connection is
/// closed instead. Nothing is buffered, so a crowd of unauthenticated
/// uploads costs the server no memory.
async fn drain(mut body: Incoming) {
    let mut left = DRAIN_BYTES;
    let _ = tokio::time::timeout(DRAIN_TIMEOUT, async {
        while let Some(Ok(frame)) = body.frame().await {
            let n = frame.data_ref().map_or(0, |d| d.len());
            if n >= left {
                return;
            }
            left -= n;
        }
    })
    .await;
}

async fn refuse_or_transfer(
    app: &Arc<App>,
    req: Request<()>,
    body: &mut Option<Incoming>,
    note: &mut Note,
) -> Reply {
    let payouts = req.uri().path() == PAYOUTS;
    let wait = super::wait::preferred(req.headers());
    let (client, key, body) = match read_request(app, req, body, note).await {
        Ok(read) => read,
        Err(reply) => return reply,
    };
    if payouts {
        let scoped = ScopedKey { client_id: client, endpoint: PAYOUTS.into(), idem_key: key };
        return super::payouts::make(app, scoped, &body, note).await;
    }
    let scoped = ScopedKey { client_id: client, endpoint: TRANSFERS.into(), idem_key: key };
    let parsed = match request::parse_body(scoped, &body, app.policy) {
        Ok(parsed) => parsed,
        Err(e) => return invalid(&e.reason(), note),
    };
    let Ok(permit) = app.in_flight.try_acquire() else { return busy(app, note) };
    if app.executor.settles_first()
        && let Some(reply) = settled(app, &parsed, note).await
    {
        return reply;
    }
    let again = wait.map(|_| parsed.clone());
    let Some(mut outcome) = run(app, parsed).await else { return busy(app, note) };
    let waits = match (&outcome, wait, again) {
        (Ok(Ok(Outcome::Respond(a))), Some(wait), Some(req)) if super::wait::in_flight(a) => {
            Some((wait, req))
        }
        _ => None,
    };
    if let Some((wait, req)) = waits {
        // a waiter holds nothing: no place among the requests in flight either
        drop(permit);
        if let Some(settled) = super::wait::settled_within(app, &req, wait).await {
            let mut reply = respond(settled, note);
            let (name, value) = super::wait::APPLIED;
            reply.headers_mut().insert(name, HeaderValue::from_static(value));
            return reply;
        }
        let Ok(_permit) = app.in_flight.try_acquire() else { return busy(app, note) };
        match run(app, req).await {
            Some(ran) => outcome = ran,
            None => return busy(app, note),
        }
    }
    match outcome {
        Ok(Ok(Outcome::Respond(answer))) => respond(answer, note),
        Ok(Ok(Outcome::Crashed(_))) | Err(_) => failed(note),
        Ok(Err(e)) => store_error(app, &e, note),
    }
}

/// The answer to a settled key (a replay, another body) from a read,
/// without queueing behind the writer's group commits; `None` when the key
/// is not settled.
async fn settled(app: &Arc<App>, parsed: &crate::request::Request, note: &mut Note) -> Option<Reply> {
    let settled = match app.executor.settled_at_once(parsed) {
        Some(settled) => Ok(settled),
        None => {
            let (reply, answer) = oneshot::channel();
            if !app.executor.submit_read(Job::Settled { req: parsed.clone(), reply }) {
                return Some(busy(app, note));
            }
            answer.await
        }
    };
    match settled {
        Ok(Ok(Some(settled))) => Some(respond(settled, note)),
        Ok(Ok(None)) => None,
        Ok(Err(e)) => Some(store_error(app, &e, note)),
        Err(_) => Some(failed(note)),
    }
}

/// `parsed` run once, on the pool or by the writer; `None` if the writer's
/// queue is full.
async fn run(
    app: &Arc<App>,
    parsed: crate::request::Request,
) -> Option<Result<Result<Outcome, crate::store::StoreError>, oneshot::error::RecvError>> {
    match app.executor.runs_on_pool() {
        true => Some(Ok(app.executor.transfer_on_pool(parsed).await)),
        false => {
            let (reply, answer) = oneshot::channel();
            if !app.executor.submit(Job::Transfer { req: parsed, reply }) {
                return None;
            }
            Some(answer.await)
        }
    }
}

/// A POST's client, key and body, or the answer that refuses it: 401, 415,
/// 413, 400 for the key, 408 for a body too slow.
async fn read_request(
    app: &App,
    req: Request<()>,
    body: &mut Option<Incoming>,
    note: &mut Note,
) -> Result<(String, String, Bytes), Reply> {
    let Some(client) = authenticate(app, req.headers()) else { return Err(unauthorized(note)) };
    note.client = Some(client.clone());
    if !is_json(req.headers()) {
        return Err(problem(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "The body must be application/json.",
            note,
        ));
    }
    let limit = app.policy.max_request_bytes;
    let too_large = || format!("The body must be at most {limit} bytes.");
    let declared =
        req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(problem(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large", &too_large(), note));
    }
    let key = match request::idempotency_key(header_values(req.headers()), app.policy.max_field_chars) {
        Ok(key) => key,
        Err((reason, detail)) => return Err(problem(StatusCode::BAD_REQUEST, reason, &detail, note)),
    };
    note.key = Some(key.clone());
    let sent = req.headers().get_all(request::FIRST_SENT).iter().map(HeaderValue::as_bytes);
    if let Err((status, reason, detail)) =
        request::first_sent(sent, time::OffsetDateTime::now_utc(), app.policy.retention_seconds())
    {
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_REQUEST);
        return Err(problem(status, reason, &detail, note));
    }
    let Some(incoming) = body.take() else { return Err(failed(note)) };
    match tokio::time::timeout(BODY_TIMEOUT, Limited::new(incoming, limit).collect()).await {
        Err(_) => Err(problem(
            StatusCode::REQUEST_TIMEOUT,
            "request_timeout",
            "The body did not arrive in time.",
            note,
        )),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            Err(problem(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large", &too_large(), note))
        }
        Ok(Err(_)) => {
            Err(problem(StatusCode::BAD_REQUEST, "invalid_request", "The body could not be read.", note))
        }
        Ok(Ok(body)) => Ok((client, key, body.to_bytes())),
    }
}

/// Whether the request says its body is JSON (`application/json`, any
/// parameters, or a `+json` type).
fn is_json(headers: &HeaderMap) -> bool {
    headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(request::is_json)
}

/// The `Idempotency-Key` header's values, as [`request::idempotency_key`] reads them.
pub fn header_values(headers: &HeaderMap) -> impl Iterator<Item = &[u8]> {
    headers.get_all("idempotency-key").iter().map(HeaderValue::as_bytes)
}

async fn lookup(app: &App, headers: &HeaderMap, id: &str, note: &mut Note) -> Reply {
    let Some(client) = authenticate(app, headers) else { return unauthorized(note) };
    note.client = Some(client.clone());
    let not_found = |note: &mut Note| problem(StatusCode::NOT_FOUND, "not_found", "No such transfer.", note);
    let Ok(transfer_id) = id.parse::<i64>() else { return not_found(note) };
    let (reply, answer) = oneshot::channel();
    if !app.executor.submit_read(Job::Lookup { client_id: client, transfer_id, reply }) {
        return busy(app, note);
    }
    match answer.await {
        Ok(Ok(Some(body))) => text(StatusCode::OK, "application/json", body),
        Ok(Ok(None)) => not_found(note),
        Ok(Err(e)) => store_error(app, &e, note),
        Err(_) => failed(note),
    }
}

/// `/healthz`: the last probe's verdict, a new probe at most once per
/// second (see [`Health`]), and the last write's failure if it failed.
async fn health(app: &App, note: &mut Note) -> Reply {
    if app.health.probe_due() {
        let (reply, answer) = oneshot::channel();
        let probed = match app.executor.submit_read(Job::Ping { reply }) {
            false => Err("the readers' queue is full".to_owned()),
            true => match answer.await {
                Ok(result) => result.map_err(|e| e.to_string()),
                Err(_) => Err("the reader stopped".to_owned()),
            },
        };
        app.health.probed(probed);
    }
    match app.health.verdict() {
        Ok(()) => text(StatusCode::OK, "application/json", r#"{"status":"ok"}"#.into()),
        Err(why) => {
            note.error = Some(why);
            let mut reply = problem(
                StatusCode::SERVICE_UNAVAILABLE,
                "unhealthy",
                "The database does not answer, or cannot take writes.",
                note,
            );
            reply.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            reply
        }
    }
}

fn not_allowed(allow: &'static str, note: &mut Note) -> Reply {
    let mut reply = problem(
        StatusCode::METHOD_NOT_ALLOWED,
        "method_not_allowed",
        &format!("This resource answers {allow} only."),
        note,
    );
    reply.headers_mut().insert(header::ALLOW, HeaderValue::from_static(allow));
    reply
}

const HTML: &str = "text/html; charset=utf-8";
