//! The answers the layer gives itself: replays, refusals, problems.

use crate::embed::Reply;
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
