//! The answers the layer gives itself (replays, refusals, problems), and
//! the handler's answer as the key stores it.

use super::Idempotency;
use crate::embed::{Answer, Reply};
use axum::body::to_bytes;
use axum::http::{HeaderName, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

/// A reply the layer gives without running the handler.
pub(super) fn answer_of(reply: Reply) -> Response {
    match reply {
        Reply::Replayed(a) | Reply::Fresh(a) => {
            let status = StatusCode::from_u16(a.status).unwrap_or(StatusCode::OK);
            let media_type = a.content_type.and_then(|t| HeaderValue::from_str(&t).ok());
            let mut r = (status, a.body).into_response();
            let h = r.headers_mut();
            // what the first answer said; JSON when it said none (or was stored before the column)
            h.insert(
                header::CONTENT_TYPE,
                media_type.unwrap_or(HeaderValue::from_static("application/json")),
            );
            h.insert("idempotent-replayed", HeaderValue::from_static("true"));
            // as the handler set them (a header that is not one now is left out)
            for (name, value) in a.headers {
                if let (Ok(name), Ok(value)) =
                    (HeaderName::from_bytes(name.as_bytes()), HeaderValue::from_str(&value))
                {
                    h.append(name, value);
                }
            }
            r
        }
        Reply::InFlight => {
            let mut r =
                problem(StatusCode::CONFLICT, "in_progress", "The key's first request is still running.");
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            r
        }
        Reply::Mismatch => problem(
            StatusCode::UNPROCESSABLE_ENTITY,
            "fingerprint_mismatch",
            "The key was used with another request body.",
        ),
    }
}

/// 503 `unavailable`: the database failed.
pub(super) fn unavailable() -> Response {
    problem(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "The database failed.")
}

/// An RFC 9457 problem.
pub fn problem(status: StatusCode, reason: &str, detail: &str) -> Response {
    let title = status.canonical_reason().unwrap_or("");
    let body = crate::reason::problem_body("about:blank", status.as_u16(), title, reason, detail);
    let mut r = (status, body).into_response();
    r.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/problem+json"));
    r
}

/// Marks a handler's response as a business answer: stored with the key
/// and replayed to its retries, whatever its status.
///
/// ```
/// use axum::http::StatusCode;
/// use axum::response::{IntoResponse, Response};
/// use idem::embed::layer::business;
///
/// // a refusal its retries must meet again, not a fresh attempt
/// fn insufficient_funds() -> Response {
///     business((StatusCode::PAYMENT_REQUIRED, r#"{"reason":"insufficient_funds"}"#).into_response())
/// }
/// assert_eq!(insufficient_funds().status(), StatusCode::PAYMENT_REQUIRED);
/// ```
pub fn business(mut response: Response) -> Response {
    response.extensions_mut().insert(Business);
    response
}

#[derive(Clone, Copy)]
pub(super) struct Business;

/// The handler's answer, read whole, and whether it is one to keep; or
/// the layer's 500 if it could not be read.
pub(super) async fn answered(
    idem: &Idempotency,
    response: Response,
) -> Result<(axum::http::response::Parts, axum::body::Bytes, bool), Response> {
    let (head, body) = response.into_parts();
    let kept = (idem.keeps)(head.status) || head.extensions.get::<Business>().is_some();
    match to_bytes(body, usize::MAX).await {
        Ok(bytes) => Ok((head, bytes, kept)),
        Err(_) => Err(problem(StatusCode::INTERNAL_SERVER_ERROR, "answer", "The answer could not be read.")),
    }
}

/// The answer the handler gave, as the key stores it: status, body, media
/// type and the headers its replays carry.
pub(super) fn to_store(idem: &Idempotency, head: &axum::http::response::Parts, bytes: &[u8]) -> Answer {
    let mut answer = Answer::new(head.status.as_u16(), bytes.to_vec());
    answer.content_type =
        head.headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).map(String::from);
    for name in &idem.replayed_headers {
        for value in head.headers.get_all(name).iter().filter_map(|v| v.to_str().ok()) {
            answer.headers.push((name.as_str().to_owned(), value.to_owned()));
        }
    }
    answer
}
