//! Instants as the engine stores and compares them.
//!
//! Every time the engine writes is RFC 3339 UTC with exactly six fractional
//! digits (`2026-12-02T09:00:00.000000Z`), so text order is time order and the
//! key table can be purged with a plain `<` on an indexed column. The engine
//! never reads the wall clock itself: callers pass `now` in.

use std::fmt;
use time::format_description::well_known::Rfc3339;
use time::macros::datetime;
use time::{Duration, OffsetDateTime, UtcOffset};

/// The range of instants the engine stores: years 1 to 9999, whose text
/// form is fixed-width, so text order stays time order.
const MIN: OffsetDateTime = datetime!(0001-01-01 00:00:00 UTC);
const MAX: OffsetDateTime = datetime!(9999-12-31 23:59:59.999_999 UTC);

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
        // An offset can carry 9999-12-31T23:59:59-23:59 past year 9999 in
        // UTC: checked, never a panic.
        let bad = || BadTimestamp(text.to_string());
        let t = OffsetDateTime::parse(&norm, &Rfc3339).map_err(|_| bad())?;
        let t = Self::truncated(t.checked_to_offset(UtcOffset::UTC).ok_or_else(bad)?);
        match (MIN..=MAX).contains(&t.0) {
            true => Ok(t),
            false => Err(bad()),
        }
    }

    /// This instant plus `seconds`, saturating at years 1 and 9999.
    pub fn plus_seconds(self, seconds: i64) -> Self {
        self.plus_millis(seconds.saturating_mul(1000))
    }

    /// This instant plus `millis`, saturating at years 1 and 9999.
    pub fn plus_millis(self, millis: i64) -> Self {
        let t = self.0.checked_add(Duration::milliseconds(millis));
        Self(t.unwrap_or(if millis < 0 { MIN } else { MAX }).clamp(MIN, MAX))
    }

    /// Whether this instant is at least `seconds` after `earlier`. Exact,
    /// where adding to `earlier` would saturate at the end of the range.
    pub fn is_at_least(self, seconds: i64, after: Timestamp) -> bool {
        self.0 - after.0 >= Duration::seconds(seconds)
    }

    /// Whole seconds from `earlier` to this (negative if it is later).
    pub fn seconds_since(self, earlier: Timestamp) -> i64 {
        (self.0 - earlier.0).whole_seconds()
    }

    fn truncated(t: OffsetDateTime) -> Self {
        let micros = t.microsecond();
        Self(t.replace_nanosecond(micros * 1_000).unwrap_or(t))
    }
}

impl fmt::Display for Timestamp {
    /// `YYYY-MM-DDTHH:MM:SS.ffffffZ`, written digit by digit: every claim
    /// and completion formats three of these, and `write!`'s machinery was
    /// a tenth of the SQLite writer's time (perf, issue 22).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let t = self.0;
        let year = match u32::try_from(t.year()) {
            Ok(year) if year <= 9999 => year,
            // outside four digits (never a wall clock): the general path
            _ => {
                return write!(
                    f,
                    "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:06}Z",
                    t.year(),
                    u8::from(t.month()),
                    t.day(),
                    t.hour(),
                    t.minute(),
                    t.second(),
                    t.microsecond()
                );
            }
        };
        let mut out = *b"0000-00-00T00:00:00.000000Z";
        let mut put = |at: usize, width: usize, mut n: u32| {
            for i in (at..at + width).rev() {
                out[i] = b'0' + (n % 10) as u8;
                n /= 10;
            }
        };
        put(0, 4, year);
        put(5, 2, u32::from(u8::from(t.month())));
        put(8, 2, u32::from(t.day()));
        put(11, 2, u32::from(t.hour()));
        put(14, 2, u32::from(t.minute()));
        put(17, 2, u32::from(t.second()));
        put(20, 6, t.microsecond());
        // only ASCII digits and separators were written
        f.write_str(std::str::from_utf8(&out).map_err(|_| fmt::Error)?)
    }
}

/// An HTTP-date (RFC 9110, 5.6.7) in its one form a sender may send,
/// IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`); `None` for anything else.
///
/// ```
/// let at = idem::clock::http_date("Sun, 06 Nov 1994 08:49:37 GMT").unwrap();
/// assert_eq!(at.unix_timestamp(), 784111777);
/// assert!(idem::clock::http_date("1994-11-06T08:49:37Z").is_none());
/// ```
pub fn http_date(text: &str) -> Option<OffsetDateTime> {
    Some(time::PrimitiveDateTime::parse(text.trim(), IMF_FIXDATE).ok()?.assume_utc())
}

/// `at` as an HTTP-date ([`http_date`] reads it back).
///
/// ```
/// let at = time::macros::datetime!(1994-11-06 08:49:37 UTC);
/// assert_eq!(idem::clock::to_http_date(at), "Sun, 06 Nov 1994 08:49:37 GMT");
/// ```
pub fn to_http_date(at: OffsetDateTime) -> String {
    at.to_offset(UtcOffset::UTC).format(IMF_FIXDATE).unwrap_or_default()
}

const IMF_FIXDATE: &[time::format_description::BorrowedFormatItem<'static>] = time::macros::format_description!(
    "[weekday repr:short], [day] [month repr:short] [year] [hour]:[minute]:[second] GMT"
);

/// Whole seconds since the Unix epoch, by the machine's clock (what
/// signatures carry; 0 on a clock set before 1970).
pub fn unix_now() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}

/// Milliseconds since the Unix epoch, by the machine's clock (0 on a clock
/// set before 1970).
pub fn unix_millis() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, millis)
}

/// `d` in whole milliseconds, saturating.
pub fn millis(d: std::time::Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// `30s`, `500ms`, `2m`, `1h`, `15d`, or a number of seconds.
pub fn parse_duration(text: &str) -> Result<std::time::Duration, String> {
    let text = text.trim();
    let split = text.find(|c: char| !c.is_ascii_digit()).unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let n: u64 = number.parse().map_err(|_| format!("{text:?} is not a duration like 30s, 500ms or 2m"))?;
    let millis = match unit {
        "ms" => n,
        "" | "s" => n.saturating_mul(1000),
        "m" => n.saturating_mul(60_000),
        "h" => n.saturating_mul(3_600_000),
        "d" => n.saturating_mul(86_400_000),
        _ => return Err(format!("{text:?} is not a duration like 30s, 500ms or 2m")),
    };
    Ok(std::time::Duration::from_millis(millis))
}

/// [`parse_duration`], more than zero: for a timeout or an interval, where
/// zero would fail every call or spin.
pub fn parse_positive_duration(text: &str) -> Result<std::time::Duration, String> {
    match parse_duration(text)? {
        d if d.is_zero() => Err(format!("{text:?} must be more than zero")),
        d => Ok(d),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_documented_and_a_timeout_is_more_than_zero() {
        let ms = |t: &str| parse_duration(t).map(|d| d.as_millis());
        assert_eq!(
            (ms("30s"), ms("500ms"), ms("2m"), ms("1h"), ms("15d")),
            (Ok(30_000), Ok(500), Ok(120_000), Ok(3_600_000), Ok(1_296_000_000))
        );
        assert_eq!((ms("7"), ms("0ms")), (Ok(7_000), Ok(0)));
        assert!(ms("1.5s").is_err() && ms("s").is_err() && ms("10 s").is_err() && ms("-1s").is_err());
        assert!(parse_positive_duration("0s").is_err() && parse_positive_duration("0ms").is_err());
        assert_eq!(parse_positive_duration("1ms"), Ok(std::time::Duration::from_millis(1)));
    }

    #[test]
    fn formats_fixed_width_utc() {
        let t = Timestamp::parse("2026-12-02T18:00:00.5+09:00").unwrap();
        assert_eq!(t.to_string(), "2026-12-02T09:00:00.500000Z");
    }

    #[test]
    fn digit_by_digit_is_what_the_formatter_writes() {
        let reference = |t: &Timestamp| {
            let t = t.0;
            format!(
                "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:06}Z",
                t.year(),
                u8::from(t.month()),
                t.day(),
                t.hour(),
                t.minute(),
                t.second(),
                t.microsecond()
            )
        };
        for start in ["0001-01-01T00:00:00Z", "0999-12-31T23:59:59.999999Z", "2026-12-02T09:00:00.000001Z"] {
            let mut t = Timestamp::parse(start).unwrap();
            for _ in 0..2000 {
                assert_eq!(t.to_string(), reference(&t));
                t = t.plus_millis(987_654_321_987);
            }
        }
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

    #[test]
    fn instants_at_the_edges_of_the_range_never_panic() {
        for text in ["9999-12-31T23:59:59-23:59", "0001-01-01T00:00:00+23:59", "10000-01-01T00:00:00Z"] {
            assert!(Timestamp::parse(text).is_err(), "{text}");
        }
        let max = Timestamp::parse("9999-12-31T23:59:59.999999999Z").unwrap();
        assert_eq!(max.to_string(), "9999-12-31T23:59:59.999999Z");
        assert_eq!((max.plus_seconds(300), max.plus_seconds(i64::MAX)), (max, max));
        let min = Timestamp::parse("0001-01-01T00:00:00+00:00").unwrap();
        assert_eq!((min.plus_seconds(-1), min.plus_millis(i64::MIN)), (min, min));
        // saturating, not wrapping back to the start: a lease never ends before it began
        assert!(max.plus_seconds(-1) < max && min.plus_seconds(1) > min);
    }

    proptest::proptest! {
        #[test]
        fn any_instant_shifted_by_any_amount_stays_in_range_and_in_order(
            year in 1i32..=9999, day in 1u16..=365, second in 0u32..86_400, nanos in 0u32..1_000_000_000,
            offset_minutes in -1439i32..=1439, shift in proptest::num::i64::ANY,
        ) {
            let date = time::Date::from_ordinal_date(year, day).unwrap();
            let sign = if offset_minutes < 0 { '-' } else { '+' };
            let text = format!(
                "{date}T{:02}:{:02}:{:02}.{nanos:09}{sign}{:02}:{:02}",
                second / 3600, second / 60 % 60, second % 60,
                offset_minutes.abs() / 60, offset_minutes.abs() % 60
            );
            if let Ok(t) = Timestamp::parse(&text) {
                let shifted = t.plus_seconds(shift);
                let (min, max) = (Timestamp(MIN), Timestamp(MAX));
                proptest::prop_assert!(min <= shifted && shifted <= max);
                let in_order = if shift >= 0 { shifted >= t } else { shifted <= t };
                proptest::prop_assert!(in_order, "{} shifted by {} is {}", t, shift, shifted);
                proptest::prop_assert_eq!(Timestamp::parse(&shifted.to_string()), Ok(shifted));
            }
        }

        #[test]
        fn arbitrary_text_never_panics(text in "\\PC{0,40}") {
            let _ = Timestamp::parse(&text);
        }
    }
}
