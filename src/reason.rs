//! Why an answer is not a plain success: the reasons the protocol gives,
//! typed, and spelled as text at two boundaries only: a key table's
//! `reason` column and the answers printed (`idem_api`'s `reason`, a
//! problem's `reason` member).

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
/// Why an answer is not a plain success: the `reason` of a response, and of a problem+json.
pub enum Reason {
    /// 409: the key's first request is still running.
    InProgress,
    /// 422: the key was used with another body.
    FingerprintMismatch,
    /// A stored refusal: `src` or `dst` is not an account.
    UnknownAccount,
    /// A stored refusal: `src` holds less than the amount.
    InsufficientFunds,
    /// A stored refusal: the credit would overflow `dst`'s balance.
    BalanceOverflow,
    /// 409: the key made a payout whose answer is no longer kept; a key
    /// never makes a second payout. Nothing stored.
    PayoutKeyUsed,
    /// 503: a lock was held past the busy budget; nothing stored.
    Busy,
    /// 503: the database could not take the request; nothing stored.
    Unavailable,
    /// 400: the request is malformed: its code ([`INVALID_REQUEST`]) and
    /// what is wrong, in words for the client.
    Invalid {
        /// The machine-readable code.
        code: &'static str,
        /// What is wrong, in words for the client.
        detail: String,
    },
    /// Any other reason, as text: a payout's refusal in the gateway's words
    /// (`account_closed`), or a reason a key table holds that this build
    /// does not know.
    Other(String),
}

/// The code of a malformed request's reason.
pub const INVALID_REQUEST: &str = "invalid_request";

impl Reason {
    /// A malformed request, `detail` saying how.
    pub fn invalid(detail: impl Into<String>) -> Reason {
        Reason::Invalid { code: INVALID_REQUEST, detail: detail.into() }
    }

    /// The reason's code: `invalid_request` of a malformed request, for
    /// logs and problem bodies, which never carry the client's text.
    pub fn code(&self) -> &str {
        match self {
            Reason::InProgress => "in_progress",
            Reason::FingerprintMismatch => "fingerprint_mismatch",
            Reason::UnknownAccount => "unknown_account",
            Reason::InsufficientFunds => "insufficient_funds",
            Reason::BalanceOverflow => "balance_overflow",
            Reason::PayoutKeyUsed => "payout_key_used",
            Reason::Busy => "busy",
            Reason::Unavailable => "unavailable",
            Reason::Invalid { code, .. } => code,
            Reason::Other(text) => text,
        }
    }

    /// What a malformed request got wrong.
    pub fn detail(&self) -> Option<&str> {
        match self {
            Reason::Invalid { detail, .. } => Some(detail),
            _ => None,
        }
    }

    /// The reason as a key table holds it (its [`Display`](fmt::Display)).
    pub fn parse(text: &str) -> Reason {
        match text {
            "in_progress" => Reason::InProgress,
            "fingerprint_mismatch" => Reason::FingerprintMismatch,
            "unknown_account" => Reason::UnknownAccount,
            "insufficient_funds" => Reason::InsufficientFunds,
            "balance_overflow" => Reason::BalanceOverflow,
            "payout_key_used" => Reason::PayoutKeyUsed,
            "busy" => Reason::Busy,
            "unavailable" => Reason::Unavailable,
            INVALID_REQUEST => Reason::invalid(""),
            t => match t.strip_prefix(INVALID_REQUEST).and_then(|rest| rest.strip_prefix(": ")) {
                Some(detail) => Reason::invalid(detail),
                None => Reason::Other(t.to_owned()),
            },
        }
    }
}

/// The text the lab's answer and a key table carry: the code, and for a
/// malformed request `code: detail`.
impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reason::Invalid { code, detail } if !detail.is_empty() => write!(f, "{code}: {detail}"),
            other => f.write_str(other.code()),
        }
    }
}

/// One of each reason the protocol gives, for the tests that must cover
/// them all.
/// An RFC 9457 problem's body, with the `reason` extension member
/// `idem_api` uses: the service's (`type` its page) and the library
/// layer's (`about:blank`: a team's service has no such pages).
pub fn problem_body(type_uri: &str, status: u16, title: &str, reason: &str, detail: &str) -> String {
    serde_json::json!({
        "type": type_uri,
        "title": title,
        "status": status,
        "detail": detail,
        "reason": reason,
    })
    .to_string()
}

#[cfg(test)]
pub(crate) fn examples() -> Vec<Reason> {
    // no wildcard: a new reason does not compile until it is listed below
    let _listed = |r: &Reason| match r {
        Reason::InProgress
        | Reason::FingerprintMismatch
        | Reason::UnknownAccount
        | Reason::InsufficientFunds
        | Reason::BalanceOverflow
        | Reason::PayoutKeyUsed
        | Reason::Busy
        | Reason::Unavailable
        | Reason::Invalid { .. }
        | Reason::Other(_) => (),
    };
    vec![
        Reason::InProgress,
        Reason::FingerprintMismatch,
        Reason::UnknownAccount,
        Reason::InsufficientFunds,
        Reason::BalanceOverflow,
        Reason::PayoutKeyUsed,
        Reason::Busy,
        Reason::Unavailable,
        Reason::invalid("amount must be a positive integer"),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_reads_back_as_itself() {
        let others = [Reason::invalid(""), Reason::Other("a reason of another build".into())];
        for r in examples().into_iter().chain(others) {
            assert_eq!(Reason::parse(&r.to_string()), r);
        }
        let r = Reason::parse("invalid_request: x: y");
        assert_eq!(
            (r.code(), r.detail(), r.to_string().as_str()),
            ("invalid_request", Some("x: y"), "invalid_request: x: y")
        );
        assert_eq!(Reason::parse("invalid_requests").code(), "invalid_requests");
    }
}
