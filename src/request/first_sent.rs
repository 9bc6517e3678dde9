//! `Repeatability-First-Sent` (OASIS Repeatable Requests): a request first
//! sent longer ago than its key is kept is refused, never run again.

/// The header of OASIS Repeatable Requests a client sends, the same, with
/// every try of one request: when it was first sent (an HTTP-date).
pub const FIRST_SENT: &str = "repeatability-first-sent";

/// How far short of the key's retention a first-sent date is refused: the
/// client's clock and the server's disagree, and a retry takes time to
/// arrive. Published in `openapi.json` with the retention.
pub const FIRST_SENT_MARGIN_SECONDS: i64 = 3600;

/// Whether a request first sent when its `Repeatability-First-Sent`
/// `values` say may still be answered under its key, `now`, when keys are
/// kept for `retention_seconds`: yes when it sent none, or was first sent
/// less than the retention less [`FIRST_SENT_MARGIN_SECONDS`] ago; else
/// 412 `first_sent_too_long_ago` (its key may be gone, and running it again
/// could do it twice: nothing is done), or 400 `invalid_first_sent` for a
/// value that is not one HTTP-date.
///
/// ```
/// use idem::request::first_sent;
/// let now = idem::clock::http_date("Mon, 07 Dec 2026 12:00:00 GMT").unwrap();
/// let three_days = 72 * 3600;
/// assert_eq!(first_sent([], now, three_days), Ok(()));
/// assert_eq!(first_sent([&b"Sun, 06 Dec 2026 12:00:00 GMT"[..]], now, three_days), Ok(()));
/// assert_eq!(first_sent([&b"Wed, 02 Dec 2026 12:00:00 GMT"[..]], now, three_days).unwrap_err().0, 412);
/// assert_eq!(first_sent([&b"yesterday"[..]], now, three_days).unwrap_err().0, 400);
/// ```
pub fn first_sent<'a>(
    values: impl IntoIterator<Item = &'a [u8]>,
    now: time::OffsetDateTime,
    retention_seconds: i64,
) -> Result<(), (u16, &'static str, String)> {
    let mut values = values.into_iter();
    let value = match (values.next(), values.next()) {
        (None, _) => return Ok(()),
        (Some(value), None) => value,
        _ => return Err((400, "invalid_first_sent", "Repeatability-First-Sent must appear once.".into())),
    };
    let Some(sent) = std::str::from_utf8(value).ok().and_then(crate::clock::http_date) else {
        let why = "Repeatability-First-Sent must be an HTTP-date, such as `Sun, 06 Nov 1994 08:49:37 GMT`.";
        return Err((400, "invalid_first_sent", why.into()));
    };
    let window = retention_seconds.saturating_sub(FIRST_SENT_MARGIN_SECONDS);
    match (now - sent).whole_seconds() > window {
        false => Ok(()),
        true => Err((
            412,
            "first_sent_too_long_ago",
            format!(
                "The request was first sent {} hours ago; keys are kept {} hours (less {} s for clocks), so this \
                 one may be gone and the request is not run again. Check whether it was done (GET it) before \
                 sending it under a new key.",
                (now - sent).whole_hours(),
                retention_seconds / 3600,
                FIRST_SENT_MARGIN_SECONDS
            ),
        )),
    }
}
