//! The published policy: `policy.json` at the repository root, compiled in.
//!
//! The file is the single source of truth. The engine reads every number it
//! enforces from here, and `deny_unknown_fields` keeps the file from
//! promising anything the code does not read.

use serde::{Deserialize, Serialize};
use std::sync::LazyLock;

/// The text of `policy.json`, byte for byte (written out by `idem prove`).
pub const TEXT: &str = include_str!("../policy.json");

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
/// The published rules (`policy.json`): the key's scope, its retention, the statuses of each answer, the limits on a request.
pub struct Policy {
    /// The fields that make up a key's identity, in order.
    pub scope: Vec<String>,
    /// A key older than this is expired: the same request is new again.
    pub retention_hours: u32,
    /// The status of a key reused with another body (422).
    pub on_fingerprint_mismatch: u16,
    /// The status of a retry while the key's first request runs (409).
    pub on_in_flight: u16,
    /// How long a claim blocks its key before a retry may take it over.
    pub in_progress_lease_seconds: u32,
    /// The status of a malformed request (400).
    pub on_invalid_request: u16,
    /// The status stored for a transfer naming no such account.
    pub on_unknown_account: u16,
    /// The status stored for a transfer its source cannot cover.
    pub on_insufficient_funds: u16,
    /// The status of a request the database could not take in time (503).
    pub on_busy: u16,
    /// The currencies a transfer may be in (ISO 4217 codes).
    pub currencies: Vec<String>,
    /// 2^53 − 1: the largest integer every JSON parser (and RFC 8785) keeps exact.
    pub max_amount: i64,
    /// The most bytes a request body may have.
    pub max_request_bytes: usize,
    /// Limit on `client_id`, `endpoint`, `idem_key` and string account ids.
    pub max_field_chars: usize,
    /// How long a request waits for a lock before it is answered busy.
    pub busy_timeout_ms: u32,
}

static EMBEDDED: LazyLock<Policy> = LazyLock::new(|| {
    // policy_json_parses (below) keeps this from ever failing at run time.
    serde_json::from_str(TEXT).expect("policy.json is valid")
});

impl Policy {
    /// The policy compiled into this binary.
    pub fn embedded() -> &'static Policy {
        &EMBEDDED
    }

    /// [`Policy::retention_hours`] in seconds.
    pub fn retention_seconds(&self) -> i64 {
        i64::from(self.retention_hours) * 3600
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn policy_json_parses() {
        let p: super::Policy = serde_json::from_str(super::TEXT).unwrap();
        assert_eq!(p.scope, ["client_id", "endpoint", "idem_key"]);
    }
}
