//! Why an answer is not a plain success: the reasons the protocol gives,
//! typed, and spelled as text at two boundaries only: a key table's
//! `reason` column and the answers printed (`idem_api`'s `reason`, a
//! problem's `reason` member).

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
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
    /// 400: the request is malformed; the text says how (`invalid_request: …`).
    Invalid(String),
    /// A reason read back from a key table that this build does not know.
    Other(String),
}

impl Reason {
    pub fn as_str(&self) -> &str {
        match self {
            Reason::InProgress => "in_progress",
            Reason::FingerprintMismatch => "fingerprint_mismatch",
            Reason::UnknownAccount => "unknown_account",
            Reason::InsufficientFunds => "insufficient_funds",
            Reason::BalanceOverflow => "balance_overflow",
            Reason::PayoutKeyUsed => "payout_key_used",
            Reason::Busy => "busy",
            Reason::Unavailable => "unavailable",
            Reason::Invalid(text) | Reason::Other(text) => text,
        }
    }

    /// The reason as a key table holds it.
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
            t if t == "invalid_request" || t.starts_with("invalid_request:") => Reason::Invalid(t.to_owned()),
            t => Reason::Other(t.to_owned()),
        }
    }

    /// The reason's code alone (`invalid_request` of `invalid_request: …`),
    /// for logs, which never carry the client's text.
    pub fn code(&self) -> &str {
        let text = self.as_str();
        text.split(':').next().unwrap_or(text)
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_reads_back_as_itself() {
        for r in [
            Reason::InProgress,
            Reason::FingerprintMismatch,
            Reason::UnknownAccount,
            Reason::InsufficientFunds,
            Reason::BalanceOverflow,
            Reason::PayoutKeyUsed,
            Reason::Busy,
            Reason::Unavailable,
            Reason::Invalid("invalid_request: amount must be a positive integer".into()),
            Reason::Other("a reason of another build".into()),
        ] {
            assert_eq!(Reason::parse(r.as_str()), r);
        }
        assert_eq!(Reason::Invalid("invalid_request: x: y".into()).code(), "invalid_request");
    }
}
