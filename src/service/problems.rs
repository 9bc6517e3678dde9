//! The problem types `idem serve` answers with, each documented at its own
//! URI: a problem's `type` is `/problems/{reason}`, served here as a page
//! that says what happened and what the client should do, and every
//! problem carries `Link: </problems/{reason}>; rel="describedby"`
//! (draft-ietf-httpapi-idempotency-key-header asks for a link to
//! documentation on its 400 and 422).
//!
//! The `type` is a relative reference, resolved against the request's URI
//! (RFC 9457 §3.1.1): the service does not know the name its clients reach
//! it by, and a `Host` header is the client's word, not the service's.

/// One problem type: its reason (the last segment of its URI), a title,
/// and what it means for the client.
pub struct Problem {
    pub reason: &'static str,
    pub title: &'static str,
    pub doc: &'static str,
}

/// The problem type of a reason this table does not name (a payout
/// refused in the gateway's own words).
pub const REFUSED: &str = "refused";

/// Every problem type, in the order the page lists them.
pub const PROBLEMS: [Problem; 22] = [
    Problem {
        reason: "invalid_request",
        title: "Malformed request",
        doc: "The body is not the JSON this endpoint takes: not JSON, a member missing, unknown, of the wrong type \
              or out of range (an amount must be a positive integer in the currency's smallest unit). `detail` says \
              which. Nothing was done and the key was not used: fix the body and send it again.",
    },
    Problem {
        reason: "missing_idempotency_key",
        title: "Idempotency-Key required",
        doc: "A POST that moves money needs an `Idempotency-Key` header: a new unique key (a UUID) for each \
              operation, and the same key for every retry of it.",
    },
    Problem {
        reason: "first_sent_too_long_ago",
        title: "First sent before the key's retention",
        doc: "The request's `Repeatability-First-Sent` is older than the keys' retention less its margin (both in \
              `openapi.json`, `x-idempotency-key-lifetime`): its key may be gone, so it is not run again, and \
              nothing was done now. Find out whether the first try was done (`GET` the resource, or ask) before \
              sending it again under a new key.",
    },
    Problem {
        reason: "invalid_first_sent",
        title: "Malformed Repeatability-First-Sent",
        doc: "`Repeatability-First-Sent` must appear once, as an HTTP-date (`Sun, 06 Nov 1994 08:49:37 GMT`): \
              the time the request was first sent, the same on every retry. Nothing was done.",
    },
    Problem {
        reason: "invalid_idempotency_key",
        title: "Idempotency-Key unusable",
        doc: "The `Idempotency-Key` header must appear once and be an sf-string (RFC 9651) or a bare value of \
              visible ASCII, 1 to 255 characters. `detail` says what was wrong. Nothing was done.",
    },
    Problem {
        reason: "unauthorized",
        title: "Bearer token required",
        doc: "Send `Authorization: Bearer TOKEN` with a token the service knows. Keys are scoped per client: the \
              token decides whose keys a request is checked against.",
    },
    Problem {
        reason: "not_found",
        title: "Not found",
        doc: "No such resource, or no such transfer or payout of this client.",
    },
    Problem {
        reason: "method_not_allowed",
        title: "Method not allowed",
        doc: "This resource does not take this method; `Allow` names the ones it does.",
    },
    Problem {
        reason: "request_timeout",
        title: "Body too slow",
        doc: "The body did not arrive in time. Nothing was done: send it again with the same key.",
    },
    Problem {
        reason: "in_progress",
        title: "Request with this key in progress",
        doc: "Another request with this key is still being processed. Wait `Retry-After` seconds and send the same \
              request with the same key: it gets the first request's answer, and the money moves at most once.",
    },
    Problem {
        reason: "payout_key_used",
        title: "Key already made a payout",
        doc: "This key made a payout whose answer is no longer kept (past retention). A key never makes a second \
              payout: `Location` names the payout it made; use a new key for a new payout.",
    },
    Problem {
        reason: "payload_too_large",
        title: "Body too large",
        doc: "The body is larger than the service takes (`detail` says how large it may be). Nothing was done.",
    },
    Problem {
        reason: "unsupported_media_type",
        title: "Body must be JSON",
        doc: "Send the body as `Content-Type: application/json`. Nothing was done.",
    },
    Problem {
        reason: "fingerprint_mismatch",
        title: "Key used with another body",
        doc: "This key was first used with another request body (compared by its RFC 8785 canonical form, so \
              member order and spacing do not matter). A key names one operation: use a new key for a new \
              request. Nothing was done.",
    },
    Problem {
        reason: "unknown_account",
        title: "Unknown account",
        doc: "The source or destination account does not exist. This answer is stored under the key: a retry \
              with the same key gets it again.",
    },
    Problem {
        reason: "insufficient_funds",
        title: "Insufficient funds",
        doc: "The source account's balance is below the amount. This answer is stored under the key: a retry \
              with the same key gets it again, whatever the balance is by then; use a new key to try again.",
    },
    Problem {
        reason: "balance_overflow",
        title: "Balance would overflow",
        doc: "The destination account cannot hold the amount. This answer is stored under the key.",
    },
    Problem {
        reason: "busy",
        title: "Busy",
        doc: "The service is at its limit of requests in flight, or a lock was held past its budget. Nothing was \
              stored: retry after `Retry-After` with the same key.",
    },
    Problem {
        reason: "unavailable",
        title: "Database unavailable",
        doc: "The database cannot take the request now (restarting, failing over, unreachable). The request may \
              or may not have been carried out: retry after `Retry-After` with the same key, which answers it \
              either way and moves the money at most once.",
    },
    Problem {
        reason: "unhealthy",
        title: "Unhealthy",
        doc: "`/healthz`: the database does not answer or cannot take writes.",
    },
    Problem {
        reason: "internal_error",
        title: "Internal error",
        doc: "The request could not be completed. Retry with the same key: it moves the money at most once.",
    },
    Problem {
        reason: REFUSED,
        title: "Refused",
        doc: "Refused for a reason not listed here: for a payout, the gateway's own code (`account_closed`, \
              `amount_over_limit`, …) in `reason`, and the held money went back to the account. This answer is \
              stored under the key.",
    },
];

/// The problem type of `reason`: its own, or [`REFUSED`].
pub fn of(reason: &str) -> &'static Problem {
    PROBLEMS.iter().find(|p| p.reason == reason).unwrap_or(&PROBLEMS[PROBLEMS.len() - 1])
}

/// The URI of `reason`'s problem type.
pub fn uri(reason: &str) -> String {
    format!("/problems/{}", of(reason).reason)
}

/// The page of one problem type, or of all of them (`None`), as HTML.
pub fn page(reason: Option<&str>) -> Option<String> {
    let chosen: Vec<&Problem> = match reason {
        Some(r) => vec![PROBLEMS.iter().find(|p| p.reason == r)?],
        None => PROBLEMS.iter().collect(),
    };
    let mut html = String::from(
        "<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>idem serve: problem types</title></head><body>\n",
    );
    for p in chosen {
        html.push_str(&format!(
            "<section id=\"{0}\"><h2>{1}</h2><p><code>type: /problems/{0}</code>, <code>reason: {0}</code></p><p>{2}</p></section>\n",
            p.reason,
            p.title,
            code_spans(p.doc)
        ));
    }
    html.push_str("</body></html>\n");
    Some(html)
}

/// `text` with its `code` spans as HTML (the table holds no `<`, `>` or `&`).
fn code_spans(text: &str) -> String {
    text.split('`')
        .enumerate()
        .map(|(i, part)| if i % 2 == 1 { format!("<code>{part}</code>") } else { part.into() })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_of_the_protocol_has_its_own_page() {
        for r in crate::reason::examples() {
            assert_eq!(of(r.code()).reason, r.code(), "{r:?} has no problem type of its own");
            assert!(page(Some(r.code())).is_some_and(|p| p.contains(&format!("/problems/{}", r.code()))));
        }
        assert_eq!(uri("account_closed"), "/problems/refused");
        assert_eq!(page(Some("account_closed")), None);
        for p in &PROBLEMS {
            assert!(!p.doc.contains(['<', '>', '&']), "{} would need escaping", p.reason);
        }
    }
}
