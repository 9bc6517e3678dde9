//! `Prefer: wait=N` (RFC 7240) on a retry that meets its key in flight:
//! instead of 409 at once, the retry waits up to N seconds (at most
//! `request::MAX_PREFER_WAIT`) for the original's final answer and returns it, as any
//! replay, with `Preference-Applied: wait`. Without the preference nothing
//! changes.
//!
//! A waiting request holds no connection, no claim and no writer's slot:
//! it reads the key's committed record now and then (the readers' plain
//! read, `protocol::settled`), backing off from 10 ms to 250 ms, so the
//! original may finish on this instance or on any other on the same
//! database. A read the readers cannot take now (their queue full) is a
//! read skipped, not a failure. When the wait ends without a final answer
//! the request runs once more as it would have without waiting: 409 if the
//! original is still in flight, or, if the original let its key go, the
//! request itself.

use super::app::App;
use super::executor::Job;
use crate::protocol::Response;
use crate::request::Request;
use hyper::header::HeaderMap;
use std::time::Duration;
use tokio::sync::oneshot;

/// The header a waited answer carries.
pub(super) const APPLIED: (&str, &str) = ("preference-applied", "wait");

/// How long the request prefers to wait (`request::prefer_wait`).
pub(super) fn preferred(headers: &HeaderMap) -> Option<Duration> {
    crate::request::prefer_wait(headers.get_all("prefer").iter().filter_map(|v| v.to_str().ok()))
}

/// Whether `answer` is the one a retry gets while its original runs.
pub(super) fn in_flight(answer: &Response) -> bool {
    answer.reason == Some(crate::reason::Reason::InProgress)
}

/// The key's final answer (a replay, or 422 for another body) once it has
/// one, read now and then for `wait` at most; `None` if it has none by
/// then.
pub(super) async fn settled_within(app: &App, req: &Request, wait: Duration) -> Option<Response> {
    crate::request::within(wait, || {
        let (reply, answer) = oneshot::channel();
        let asked = app.executor.submit_read(Job::Settled { req: req.clone(), reply });
        async move { if asked { answer.await.ok()?.ok()? } else { None } }
    })
    .await
}
