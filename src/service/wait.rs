//! `Prefer: wait=N` (RFC 7240) on a retry that meets its key in flight:
//! instead of 409 at once, the retry waits up to N seconds (at most
//! [`MAX_WAIT`]) for the original's final answer and returns it, as any
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

/// The longest a retry waits, whatever it prefers: a few of the original's
/// usual runs, well inside a client's own timeout.
pub(super) const MAX_WAIT: Duration = Duration::from_secs(10);

/// The header a waited answer carries.
pub(super) const APPLIED: (&str, &str) = ("preference-applied", "wait");

/// How long the request prefers to wait (`Prefer: wait=N`, N seconds,
/// capped at [`MAX_WAIT`]); `None` without the preference. A preference
/// this server does not understand, or a malformed value, is ignored, as
/// RFC 7240 asks.
pub(super) fn preferred(headers: &HeaderMap) -> Option<Duration> {
    let values = headers.get_all("prefer").iter().filter_map(|v| v.to_str().ok());
    let wait = values.flat_map(|v| v.split(',')).find_map(|preference| {
        let token = preference.split(';').next()?;
        let (name, value) = token.split_once('=')?;
        if !name.trim().eq_ignore_ascii_case("wait") {
            return None;
        }
        let value = value.trim().trim_matches('"');
        value.bytes().all(|b| b.is_ascii_digit()).then(|| value.parse::<u64>().ok()).flatten()
    })?;
    Some(Duration::from_secs(wait).min(MAX_WAIT))
}

/// Whether `answer` is the one a retry gets while its original runs.
pub(super) fn in_flight(answer: &Response) -> bool {
    answer.reason == Some(crate::reason::Reason::InProgress)
}

/// The key's final answer (a replay, or 422 for another body) once it has
/// one, read now and then for `wait` at most; `None` if it has none by
/// then.
pub(super) async fn settled_within(app: &App, req: &Request, wait: Duration) -> Option<Response> {
    let until = tokio::time::Instant::now() + wait;
    let mut pause = Duration::from_millis(10);
    loop {
        let now = tokio::time::Instant::now();
        if now >= until {
            return None;
        }
        tokio::time::sleep(pause.min(until - now)).await;
        pause = (pause * 2).min(Duration::from_millis(250));
        let (reply, answer) = oneshot::channel();
        if !app.executor.submit_read(Job::Settled { req: req.clone(), reply }) {
            continue;
        }
        if let Ok(Ok(Some(settled))) = answer.await {
            return Some(settled);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hyper::header::HeaderValue;

    fn prefer(values: &[&str]) -> Option<Duration> {
        let mut headers = HeaderMap::new();
        for v in values {
            headers.append("prefer", HeaderValue::from_str(v).unwrap());
        }
        preferred(&headers)
    }

    #[test]
    fn the_wait_is_read_as_rfc_7240_writes_it_and_capped() {
        assert_eq!(prefer(&["wait=3"]), Some(Duration::from_secs(3)));
        assert_eq!(prefer(&["respond-async, WAIT = 2"]), Some(Duration::from_secs(2)));
        assert_eq!(prefer(&["handling=lenient", "wait=\"4\"; foo=bar"]), Some(Duration::from_secs(4)));
        assert_eq!(prefer(&["wait=3600"]), Some(MAX_WAIT));
        assert_eq!(prefer(&["wait=0"]), Some(Duration::ZERO));
        for ignored in ["wait", "wait=-1", "wait=1.5", "wait=soon", "waiting=3", "return=minimal"] {
            assert_eq!(prefer(&[ignored]), None, "{ignored}");
        }
        assert_eq!(prefer(&[]), None);
    }
}
