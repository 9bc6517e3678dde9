//! The payout routes: `POST /v1/payouts` (the intent on a writer, the
//! gateway's call on a blocking thread with no connection held, the result
//! on a writer again) under a budget of their own, and `GET
//! /v1/payouts/{id}`, a plain read on a reader.

use super::app::{
    App, BODY_TIMEOUT, Note, Reply, authenticate, busy, failed, invalid, on_writer, problem, respond,
    store_error, text, unauthorized,
};
use super::executor::Job;
use crate::payout::{self, PAYOUTS};
use crate::request::{self, ScopedKey};
use crate::store::StoreError;
use hyper::StatusCode;
use hyper::header::{self, HeaderMap, HeaderValue};
use std::sync::Arc;
use tokio::sync::oneshot;

/// `POST /v1/payouts`.
pub(super) async fn make(app: &Arc<App>, key: ScopedKey, body: &[u8], note: &mut Note) -> Reply {
    let Some(desk) = &app.payouts else {
        return problem(
            StatusCode::NOT_FOUND,
            "not_found",
            "This service makes no payouts (it was started without --gateway).",
            note,
        );
    };
    let req = match request::parse_payout(key, body, app.policy) {
        Ok(req) => req,
        Err(e) => return invalid(&e.reason(), note),
    };
    let Some(_slot) = desk.budget.take(&req.key.client_id) else { return busy(app, note) };
    let token = match crate::protocol::fresh_token() {
        Ok(token) => token,
        Err(e) => return store_error(app, &StoreError::Backend(format!("no randomness: {e}").into()), note),
    };
    // The conductor runs on a blocking thread: its steps wait on the writer,
    // its call on the gateway, and neither holds a runtime worker.
    let (app_, gateway, clock, policy) = (app.clone(), desk.gateway.clone(), desk.clock.clone(), app.policy);
    let paid = tokio::task::spawn_blocking(move || {
        let mut steps = OnWriter(app_);
        payout::pay(&mut steps, &*gateway, req, token, &*clock, policy, &mut |_| {})
    })
    .await;
    match paid {
        Ok(Ok(answer)) => respond_payout(answer, note),
        // A result not recorded leaves the payout in progress until the
        // reconciler asks the gateway; the client polls or retries.
        Ok(Err(StoreError::Busy)) => busy(app, note),
        Ok(Err(e)) => store_error(app, &e, note),
        Err(_) => failed(note),
    }
}

/// A payout's steps on the service's writer, waited for from a blocking
/// thread.
struct OnWriter(Arc<App>);

impl payout::Steps for OnWriter {
    fn step<R: Send + 'static>(
        &mut self,
        work: impl FnOnce(&mut dyn crate::store::Store) -> Result<R, StoreError> + Send + 'static,
    ) -> Result<R, StoreError> {
        let handle = tokio::runtime::Handle::current();
        // the writer's queue is closed (draining) or full: nothing was done
        handle.block_on(on_writer(&self.0, work)).unwrap_or(Err(StoreError::Busy))
    }
}

/// A payout's answer: 201 with the payout, 202 with where to poll, or a
/// problem; `Location` names the payout.
fn respond_payout(answer: payout::Answer, note: &mut Note) -> Reply {
    let payout::Answer { response, payout_id } = answer;
    let mut reply = match response.status {
        201 | 202 => {
            note.replay = response.replay;
            let status = if response.status == 201 { StatusCode::CREATED } else { StatusCode::ACCEPTED };
            let mut reply = text(status, "application/json", response.body.clone());
            if response.replay {
                reply.headers_mut().insert("idempotent-replayed", HeaderValue::from_static("true"));
            }
            if response.status == 202 {
                reply.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            reply
        }
        _ => respond(response, note),
    };
    if let Some(location) = payout_id.and_then(|id| HeaderValue::from_str(&format!("{PAYOUTS}/{id}")).ok()) {
        reply.headers_mut().insert(header::LOCATION, location);
    }
    reply
}

/// `GET /v1/payouts/{id}`: where a payout of the caller stands, read on a
/// reader (never queued behind the writer, never a lock).
pub(super) async fn lookup(app: &App, headers: &HeaderMap, id: &str, note: &mut Note) -> Reply {
    let Some(client) = authenticate(app, headers) else { return unauthorized(note) };
    note.client = Some(client.clone());
    let not_found = |note: &mut Note| problem(StatusCode::NOT_FOUND, "not_found", "No such payout.", note);
    let (Some(_), Ok(id)) = (&app.payouts, id.parse::<i64>()) else { return not_found(note) };
    let policy = app.policy;
    let (reply, answer) = oneshot::channel();
    let job = Job::Run(Box::new(move |store| drop(reply.send(payout::lookup(store, &client, id, policy)))));
    if !app.executor.submit_read(job) {
        return busy(app, note);
    }
    match answer.await {
        Ok(Ok(Some(p))) => text(StatusCode::OK, "application/json", payout::to_json(&p)),
        Ok(Ok(None)) => not_found(note),
        Ok(Err(e)) => store_error(app, &e, note),
        Err(_) => failed(note),
    }
}

/// The most an event's body may hold.
pub(super) const MAX_EVENT_BODY: usize = 64 * 1024;

/// The longest an event's body may pause between two chunks: a provider
/// sends a few kilobytes at once, a stranger trickles.
const EVENT_GAP: std::time::Duration = std::time::Duration::from_secs(1);

/// Why an event's body was not read.
enum Unread {
    Slow,
    Unreadable,
    /// The byte budget is spent (`Desk::event_bytes`).
    Full,
}

/// Reads an event's body within [`BODY_TIMEOUT`] in all and [`EVENT_GAP`]
/// between chunks, at most [`MAX_EVENT_BODY`] bytes, each chunk taking its
/// bytes of `budget` as it arrives; the bytes are held by the permit
/// returned, until the event is applied.
async fn read_event<'b>(
    mut body: hyper::body::Incoming,
    budget: &'b tokio::sync::Semaphore,
) -> Result<(Vec<u8>, Option<tokio::sync::SemaphorePermit<'b>>), Unread> {
    use http_body_util::BodyExt;
    let deadline = tokio::time::Instant::now() + BODY_TIMEOUT;
    let (mut bytes, mut held) = (Vec::new(), None::<tokio::sync::SemaphorePermit<'b>>);
    loop {
        let wait = EVENT_GAP.min(deadline.saturating_duration_since(tokio::time::Instant::now()));
        let frame = match tokio::time::timeout(wait, body.frame()).await {
            Err(_) => return Err(Unread::Slow),
            Ok(None) => return Ok((bytes, held)),
            Ok(Some(Err(_))) => return Err(Unread::Unreadable),
            Ok(Some(Ok(frame))) => frame,
        };
        let Ok(data) = frame.into_data() else { continue };
        if bytes.len() + data.len() > MAX_EVENT_BODY {
            return Err(Unread::Unreadable);
        }
        let n = u32::try_from(data.len()).map_err(|_| Unread::Unreadable)?;
        let permit = budget.try_acquire_many(n).map_err(|_| Unread::Full)?;
        match held.as_mut() {
            Some(held) => held.merge(permit),
            None => held = Some(permit),
        }
        bytes.extend_from_slice(&data);
    }
}

/// `POST /v1/gateway-events`: a provider's signed event, applied once by
/// its id on a writer. 200 with what it did (a duplicate too, so the
/// provider stops resending); 401 unsigned or stale; 400 not an event.
pub(super) async fn event(app: &App, req: hyper::Request<hyper::body::Incoming>, note: &mut Note) -> Reply {
    let Some(desk) = app.payouts.as_ref().filter(|d| !d.events_secrets.is_empty()) else {
        return problem(StatusCode::NOT_FOUND, "not_found", "No such resource.", note);
    };
    let (secrets, unix) = (&desk.events_secrets, crate::clock::unix_now());
    // the header first: an unsigned or stale event is refused before its
    // unauthenticated body is waited for
    let header = |name: &str| req.headers().get(name).and_then(|v| v.to_str().ok());
    let standard = payout::STANDARD_HEADERS.map(header);
    let read = match standard.iter().any(Option::is_some) {
        true => payout::Signature::read_standard(standard, unix),
        false => payout::Signature::read(header(payout::SIGNATURE_HEADER), unix),
    };
    let signature = match read {
        Ok(signature) => signature,
        Err(refused) => return refused_event(refused, note),
    };
    let (body, _held) = match read_event(req.into_body(), &desk.event_bytes).await {
        Ok(read) => read,
        Err(Unread::Full) => return busy(app, note),
        Err(Unread::Slow) => {
            let why = "The body did not arrive in time (10 s in all, 1 s between chunks).";
            return problem(StatusCode::REQUEST_TIMEOUT, "request_timeout", why, note);
        }
        Err(Unread::Unreadable) => {
            let why = "The body is unreadable or over 64 KiB.";
            return problem(StatusCode::BAD_REQUEST, "invalid_request", why, note);
        }
    };
    let event = match signature
        .check_any(secrets, &body)
        .and_then(|()| payout::Event::parse(&body, signature.id()))
    {
        Ok(event) => event,
        Err(refused) => return refused_event(refused, note),
    };
    let clock = desk.clock.clone();
    let policy = app.policy;
    let applied = {
        let event = event.clone();
        on_writer(app, move |store| payout::apply_event(store, &event, clock(), policy)).await
    };
    let (duplicate, outcome) = match applied {
        Some(Ok(Some(outcome))) => (false, outcome),
        Some(Ok(None)) => (true, "seen before: nothing more done".to_owned()),
        Some(Err(e)) => return store_error(app, &e, note),
        None => return busy(app, note),
    };
    if !duplicate && outcome.starts_with(payout::FOR_A_PERSON) {
        // the request's log line carries why, the metric alerts
        app.metrics.event_for_a_person();
        note.reason = Some(outcome.clone());
    }
    let body = serde_json::json!({"event_id": event.id, "duplicate": duplicate, "outcome": outcome});
    text(StatusCode::OK, "application/json", body.to_string())
}

fn refused_event(refused: payout::Refused, note: &mut Note) -> Reply {
    match refused {
        payout::Refused::Unsigned(why) => problem(StatusCode::UNAUTHORIZED, "unauthorized", why, note),
        payout::Refused::Malformed(why) => problem(StatusCode::BAD_REQUEST, "invalid_request", &why, note),
    }
}
