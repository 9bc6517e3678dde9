//! `Prefer: wait=N` (RFC 7240): how long a retry that meets its key in
//! flight would rather wait for the original's answer than be told 409.

use std::time::Duration;

/// The longest a retry waits, whatever it prefers: a few of an original's
/// usual runs, well inside a client's own timeout.
pub const MAX_PREFER_WAIT: Duration = Duration::from_secs(10);

/// How long the `Prefer` header `values` ask to wait (`wait=N`, N seconds,
/// capped at [`MAX_PREFER_WAIT`]); `None` without the preference. A
/// preference not understood, or a malformed value, is ignored, as RFC 7240
/// asks.
pub fn prefer_wait<'a>(values: impl Iterator<Item = &'a str>) -> Option<Duration> {
    let wait = values.flat_map(|v| v.split(',')).find_map(|preference| {
        let token = preference.split(';').next()?;
        let (name, value) = token.split_once('=')?;
        if !name.trim().eq_ignore_ascii_case("wait") {
            return None;
        }
        let value = value.trim().trim_matches('"');
        value.bytes().all(|b| b.is_ascii_digit()).then(|| value.parse::<u64>().ok()).flatten()
    })?;
    Some(Duration::from_secs(wait).min(MAX_PREFER_WAIT))
}

/// What `look` finds, looked for now and then within `wait` (10 ms apart
/// at first, backing off to 250 ms); `None` if it found nothing by then.
/// The waiter holds nothing between looks.
#[cfg(any(feature = "postgres", feature = "axum"))]
pub async fn within<T, F: Future<Output = Option<T>>>(
    wait: Duration,
    mut look: impl FnMut() -> F,
) -> Option<T> {
    let until = tokio::time::Instant::now() + wait;
    let mut pause = Duration::from_millis(10);
    loop {
        let now = tokio::time::Instant::now();
        if now >= until {
            return None;
        }
        tokio::time::sleep(pause.min(until - now)).await;
        pause = (pause * 2).min(Duration::from_millis(250));
        if let Some(found) = look().await {
            return Some(found);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wait_is_read_as_rfc_7240_writes_it_and_capped() {
        let prefer = |values: &[&str]| prefer_wait(values.iter().copied());
        assert_eq!(prefer(&["wait=3"]), Some(Duration::from_secs(3)));
        assert_eq!(prefer(&["respond-async, WAIT = 2"]), Some(Duration::from_secs(2)));
        assert_eq!(prefer(&["handling=lenient", "wait=\"4\"; foo=bar"]), Some(Duration::from_secs(4)));
        assert_eq!(prefer(&["wait=3600"]), Some(MAX_PREFER_WAIT));
        assert_eq!(prefer(&["wait=0"]), Some(Duration::ZERO));
        for ignored in ["wait", "wait=-1", "wait=1.5", "wait=soon", "waiting=3", "return=minimal"] {
            assert_eq!(prefer(&[ignored]), None, "{ignored}");
        }
        assert_eq!(prefer(&[]), None);
    }
}
