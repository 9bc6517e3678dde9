//! Instants as the engine stores and compares them.
//!
//! Every time the engine writes is RFC 3339 UTC with exactly six fractional
//! digits (`2026-12-02T09:00:00.000000Z`), so text order is time order and the
//! key table can be purged with a plain `<` on an indexed column. The engine
//! never reads the wall clock itself: callers pass `now` in.

use std::fmt;
use time::format_description::well_known::Rfc3339;
use time::{Duration, OffsetDateTime, UtcOffset};

/// A UTC instant with microsecond precision.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(OffsetDateTime);

/// An RFC 3339 string that does not parse, or lies outside years 1..=9999.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadTimestamp(pub String);

impl fmt::Display for BadTimestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} is not an RFC 3339 timestamp (e.g. 2026-12-02T09:00:00Z)", self.0)
    }
}

impl std::error::Error for BadTimestamp {}

impl Timestamp {
    /// The wall clock, truncated to whole microseconds.
    pub fn now() -> Self {
        Self::truncated(OffsetDateTime::now_utc())
    }

    /// Parses an RFC 3339 instant (any offset, any fractional precision).
    /// Also accepted, because clients send them: a space instead of `T`, a
    /// lower-case `z`, and no offset at all, which is read as UTC (what
    /// Python's `datetime.utcnow().isoformat()` prints).
    pub fn parse(text: &str) -> Result<Self, BadTimestamp> {
        let mut norm: Vec<char> = text.trim().chars().collect();
        if norm.len() > 10 && matches!(norm[10], ' ' | 't') {
            norm[10] = 'T';
        }
        if norm.last() == Some(&'z') {
            norm.pop();
            norm.push('Z');
        }
        let has_offset = norm.len() > 19 && norm[19..].iter().any(|c| matches!(c, 'Z' | '+' | '-'));
        if norm.len() >= 19 && !has_offset {
            norm.push('Z');
        }
        let norm: String = norm.into_iter().collect();
        let t = OffsetDateTime::parse(&norm, &Rfc3339)
            .map_err(|_| BadTimestamp(text.to_string()))?
            .to_offset(UtcOffset::UTC);
        if !(1..=9999).contains(&t.year()) {
            return Err(BadTimestamp(text.to_string()));
        }
        Ok(Self::truncated(t))
    }

    /// This instant plus `seconds`, saturating at the representable range.
    pub fn plus_seconds(self, seconds: i64) -> Self {
        self.plus_millis(seconds.saturating_mul(1000))
    }

    /// This instant plus `millis`, saturating at the representable range.
    pub fn plus_millis(self, millis: i64) -> Self {
        Self(self.0.checked_add(Duration::milliseconds(millis)).unwrap_or(self.0))
    }

    fn truncated(t: OffsetDateTime) -> Self {
        let micros = t.microsecond();
        Self(t.replace_nanosecond(micros * 1_000).unwrap_or(t))
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = self.0;
        write!(
            f,
            "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:06}Z",
            t.year(),
            u8::from(t.month()),
            t.day(),
            t.hour(),
            t.minute(),
            t.second(),
            t.microsecond()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_fixed_width_utc() {
        let t = Timestamp::parse("2026-12-02T18:00:00.5+09:00").unwrap();
        assert_eq!(t.to_string(), "2026-12-02T09:00:00.500000Z");
    }

    #[test]
    fn text_order_is_time_order() {
        let a = Timestamp::parse("2026-12-02T09:00:00.999999Z").unwrap();
        let b = a.plus_seconds(1);
        assert!(a < b && a.to_string() < b.to_string());
    }

    #[test]
    fn accepts_what_clients_send() {
        let want = "2026-12-02T09:00:00.250000Z";
        for text in [
            "2026-12-02T09:00:00.25Z",
            "2026-12-02 09:00:00.25z",
            "2026-12-02T09:00:00.25",
            "2026-12-02T18:00:00.25+09:00",
        ] {
            assert_eq!(Timestamp::parse(text).unwrap().to_string(), want, "{text}");
        }
    }

    #[test]
    fn rejects_non_rfc3339() {
        for bad in [
            "",
            "yesterday",
            "2026-12-02",
            "2026-13-01T00:00:00Z",
            "2026-02-30T00:00:00Z",
            "2026-12-02T25:00:00",
            "2026-12-02T09:00Z",
        ] {
            assert!(Timestamp::parse(bad).is_err(), "{bad}");
        }
    }
}
