//! The client's half of exactly once: one key from the first attempt to the
//! last, retries with exponential backoff and full jitter under one overall
//! deadline, and, when the deadline passes without an answer, the honest
//! verdict: the outcome is unknown, retry with the same key.
//!
//! What is retried: a timeout, a connection error, a cut answer, 202 (a
//! payout under way: the same key asks again where it stands), 409 (the
//! first attempt is still running), 429 and 503 (after their `Retry-After`)
//! and any other 5xx. What is final depends on what came before. Until an
//! attempt may have reached the server, any other 4xx is the server's final
//! word. After that, only the request's own stored answer is final: a 2xx,
//! a replayed refusal (`Idempotent-Replayed: true`), or a 402/404/422
//! problem whose `reason` is one the protocol stores. Any
//! other refusal (a rotated token's 401, a gateway's 400) says nothing about
//! the attempt whose answer was lost, so the verdict is "unknown".

use crate::rng::Rng;
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

/// How a client retries.
#[derive(Debug, Clone)]
pub struct Policy {
    /// Everything, attempts and pauses, ends by this much after the start.
    pub budget: Duration,
    /// The pause before the second attempt is drawn below twice this; each
    /// later pause's bound doubles…
    pub base_backoff: Duration,
    /// …up to this.
    pub max_backoff: Duration,
    /// No single attempt waits longer than this (nor past the budget).
    pub attempt_timeout: Duration,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            budget: Duration::from_secs(30),
            base_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_secs(2),
            attempt_timeout: Duration::from_secs(5),
        }
    }
}

/// Where and as whom to send.
#[derive(Debug, Clone)]
pub struct Endpoint {
    /// The service's base URL, `http://host:port`.
    pub url: String,
    pub token: String,
}

/// How a transfer ended, as far as the client can tell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// 2xx: the transfer exists; `body` is the server's answer.
    Done { status: u16, body: String, replayed: bool },
    /// The server's final word: the transfer did not and will not go out
    /// under this key.
    Refused { status: u16, body: String },
    /// No final answer: the transfer may or may not have gone out.
    /// Retrying with the same key will tell.
    Unknown { last: String },
}

/// What happened, attempt by attempt.
#[derive(Debug, Clone)]
pub struct Report {
    pub key: String,
    pub verdict: Verdict,
    /// From the first attempt to the verdict.
    pub took: Duration,
    /// Each attempt that was sent or tried, in order.
    pub tries: Vec<Try>,
}

impl Report {
    pub fn attempts(&self) -> u32 {
        self.tries.len() as u32
    }
}

/// One attempt: when it left, when it ended, and the status if an answer came.
#[derive(Debug, Clone, Copy)]
pub struct Try {
    /// Which of the endpoints it went to.
    pub endpoint: usize,
    pub sent: Instant,
    pub ended: Instant,
    pub status: Option<u16>,
    pub replayed: bool,
}

/// A fresh key: a random (version 4) UUID.
pub fn new_key() -> Result<String, getrandom::Error> {
    let mut b = [0u8; 16];
    getrandom::fill(&mut b)?;
    Ok(crate::rng::uuid(b, 4))
}

/// Checks that `key` can be sent as an `Idempotency-Key` sf-string: 1 to
/// `max_chars` characters of printable ASCII. Anything else could never be
/// sent, so it is refused before the first attempt rather than retried.
pub fn check_key(key: &str, max_chars: usize) -> Result<(), String> {
    if key.is_empty() {
        return Err("the key is empty".into());
    }
    if let Some(c) = key.chars().find(|c| !(' '..='~').contains(c)) {
        return Err(format!("the key holds {c:?}: only printable ASCII can be sent in Idempotency-Key"));
    }
    if key.len() > max_chars {
        return Err(format!("the key is {} characters long; at most {max_chars} are accepted", key.len()));
    }
    Ok(())
}

/// `key` as an sf-string (RFC 9651 §3.3.3): quoted, with `"` and `\`
/// escaped. Call [`check_key`] first: nothing else is representable.
pub fn sf_string(key: &str) -> String {
    let mut out = String::with_capacity(key.len() + 2);
    out.push('"');
    for c in key.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

/// Why a key file could not give a key.
#[derive(Debug)]
pub enum KeyFileError {
    Io(std::io::Error),
    /// The file exists but does not hold a usable key.
    Unusable(String),
}

impl std::fmt::Display for KeyFileError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeyFileError::Io(e) => write!(f, "{e}"),
            KeyFileError::Unusable(why) => f.write_str(why),
        }
    }
}

impl std::error::Error for KeyFileError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            KeyFileError::Io(e) => Some(e),
            KeyFileError::Unusable(_) => None,
        }
    }
}

impl From<std::io::Error> for KeyFileError {
    fn from(e: std::io::Error) -> Self {
        KeyFileError::Io(e)
    }
}

/// The key kept in `path`, or a new one published there, durably, before
/// anything is sent, so that a client that crashes resumes with it.
///
/// Many runs may start at once on one file: each writes its candidate to a
/// temporary file of its own (a random name, created exclusively), then
/// publishes it under `path` only if nothing is there yet (`renameat2`
/// with `RENAME_NOREPLACE`, or `link`), syncs the directory, and reads the
/// file back. Whoever published first wins, and every run sends the key the
/// file holds: the file never names a key that some run did not send, nor
/// a run a key the file does not hold.
pub fn key_in_file(path: &Path, max_chars: usize) -> Result<String, KeyFileError> {
    if let Some(key) = read_key(path, max_chars)? {
        return Ok(key);
    }
    // The parent of a bare file name is "": the directory is the current one.
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let candidate = new_key().map_err(|e| std::io::Error::other(format!("no randomness for a key: {e}")))?;
    let mut tmp = tempfile::Builder::new().prefix(".idem-key-").tempfile_in(dir)?;
    writeln!(tmp, "{candidate}")?;
    tmp.as_file().sync_all()?;
    match tmp.persist_noclobber(path) {
        Ok(_) => {}
        // another run published first: its key is the one
        Err(e) if e.error.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e.error.into()),
    }
    std::fs::File::open(dir)?.sync_all()?;
    read_key(path, max_chars)?
        .ok_or_else(|| KeyFileError::Unusable("the key file vanished as it was written".into()))
}

/// The key in `path`; `None` if there is no such file.
fn read_key(path: &Path, max_chars: usize) -> Result<Option<String>, KeyFileError> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let key = text.strip_suffix('\n').unwrap_or(&text);
    let key = key.strip_suffix('\r').unwrap_or(key);
    if key.is_empty() {
        return Err(KeyFileError::Unusable(
            "the file holds no key; remove it to start a new transfer".into(),
        ));
    }
    check_key(key, max_chars).map_err(KeyFileError::Unusable)?;
    Ok(Some(key.to_owned()))
}

/// What one attempt brought back.
enum Attempt {
    Answer {
        status: u16,
        body: String,
        replayed: bool,
        /// `Retry-After`, in whole seconds.
        retry_after: Option<u64>,
    },
    /// The connection was never made: nothing was sent.
    Unsent(String),
    /// No answer after the request may have left: a timeout, a reset, a
    /// cut body.
    Lost(String),
}

/// One try, with the key and the time the transfer was first sent (OASIS
/// Repeatable Requests: a try that arrives after its key may be gone is
/// refused 412, never paid again).
fn attempt(
    endpoint: &Endpoint,
    route: &str,
    key: &str,
    first_sent: &str,
    body: &str,
    timeout: Duration,
) -> Attempt {
    let sent = crate::https::agent(timeout)
        .post(format!("{}{route}", endpoint.url.trim_end_matches('/')))
        .header("Authorization", format!("Bearer {}", endpoint.token))
        .header("Idempotency-Key", sf_string(key))
        .header("Repeatability-First-Sent", first_sent)
        .header("Content-Type", "application/json")
        .send(body);
    match sent {
        Ok(mut response) => {
            let status = response.status().as_u16();
            let header = |name: &str| response.headers().get(name).and_then(|v| v.to_str().ok());
            let replayed = header("idempotent-replayed") == Some("true");
            let retry_after = header("retry-after").and_then(|v| v.trim().parse().ok());
            match response.body_mut().read_to_string() {
                Ok(body) => Attempt::Answer { status, body, replayed, retry_after },
                Err(e) => Attempt::Lost(format!("answer cut short: {e}")),
            }
        }
        // a handshake refused sent nothing
        Err(e) if crate::https::is_tls(&e) => Attempt::Unsent(crate::https::why(&endpoint.url, &e)),
        Err(e @ (ureq::Error::HostNotFound | ureq::Error::ConnectionFailed | ureq::Error::BadUri(_))) => {
            Attempt::Unsent(e.to_string())
        }
        Err(ureq::Error::Timeout(t @ (ureq::Timeout::Resolve | ureq::Timeout::Connect))) => {
            Attempt::Unsent(format!("timeout: {t}"))
        }
        Err(ureq::Error::Io(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
            Attempt::Unsent(e.to_string())
        }
        Err(e) => Attempt::Lost(e.to_string()),
    }
}

/// The reasons of the answers the protocol stores for a key: a refusal
/// with one of them is this transfer's own final answer (or, for a
/// mismatch, another body's hold on the key), whichever attempt it answers.
const STORED_REASONS: [&str; 4] =
    ["unknown_account", "insufficient_funds", "balance_overflow", "fingerprint_mismatch"];

/// Whether a 4xx is the transfer's own final answer.
fn is_stored_refusal(status: u16, body: &str) -> bool {
    matches!(status, 402 | 404 | 422)
        && serde_json::from_str::<serde_json::Value>(body)
            .ok()
            .and_then(|v| v.get("reason")?.as_str().map(|r| STORED_REASONS.contains(&r)))
            .unwrap_or(false)
}

/// Sends the transfer `body` under `key` until a final answer or the end of
/// the budget; sleeps a random pause in `[0, min(max, base · 2^n))` between
/// attempts (full jitter), at least a 429's or 503's `Retry-After`, never
/// past the deadline. Several endpoints (instances of one service) are tried
/// in turn, the next one after each failure, always with the same key.
pub fn send(endpoints: &[Endpoint], key: &str, body: &str, policy: &Policy, rng: &mut Rng) -> Report {
    send_to(endpoints, "/v1/transfers", key, body, policy, rng)
}

/// [`send`] to another route of the same service (`/v1/payouts`).
pub fn send_to(
    endpoints: &[Endpoint],
    route: &str,
    key: &str,
    body: &str,
    policy: &Policy,
    rng: &mut Rng,
) -> Report {
    let started = Instant::now();
    let first_sent = crate::clock::to_http_date(time::OffsetDateTime::now_utc());
    let deadline = started + policy.budget;
    let mut tries: Vec<Try> = Vec::new();
    // Whether some attempt may have reached the server: from then on only
    // the transfer's own stored answer is final.
    let mut reached = false;
    let mut last = String::from("no attempt fitted in the budget");
    let report =
        |verdict, tries: Vec<Try>| Report { key: key.into(), verdict, took: started.elapsed(), tries };
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || endpoints.is_empty() {
            return report(Verdict::Unknown { last }, tries);
        }
        let endpoint = tries.len() % endpoints.len();
        let mut at_least = Duration::ZERO;
        let sent = Instant::now();
        let answer =
            attempt(&endpoints[endpoint], route, key, &first_sent, body, policy.attempt_timeout.min(left));
        let (status, replayed) = match &answer {
            Attempt::Answer { status, replayed, .. } => (Some(*status), *replayed),
            _ => (None, false),
        };
        tries.push(Try { endpoint, sent, ended: Instant::now(), status, replayed });
        last = match answer {
            Attempt::Answer { status, body, replayed, .. }
                if (200..300).contains(&status) && status != 202 =>
            {
                return report(Verdict::Done { status, body, replayed }, tries);
            }
            Attempt::Answer { status, body, replayed, .. }
                if (400..500).contains(&status) && !matches!(status, 409 | 429) =>
            {
                return report(refused(status, body, reached && !replayed), tries);
            }
            Attempt::Answer { status, retry_after, .. } => {
                if matches!(status, 202 | 429 | 503) {
                    at_least = Duration::from_secs(retry_after.unwrap_or(0));
                }
                reached = true;
                format!("HTTP {status}")
            }
            Attempt::Unsent(why) => why,
            Attempt::Lost(why) => {
                reached = true;
                why
            }
        };
        let cap = policy.base_backoff.saturating_mul(1 << tries.len().min(20)).min(policy.max_backoff);
        let pause = Duration::from_micros(rng.below(cap.as_micros().max(1) as u64)).max(at_least);
        let left = deadline.saturating_duration_since(Instant::now());
        if at_least >= left {
            last = format!("{last}; Retry-After {} s is past the budget", at_least.as_secs());
            return report(Verdict::Unknown { last }, tries);
        }
        std::thread::sleep(pause.min(left));
    }
}

/// A 4xx other than 409 and 429: refused for good, unless an earlier
/// attempt may have gone through (`doubt`) and this refusal is not the
/// transfer's own stored one, which then says nothing of what became of it.
fn refused(status: u16, body: String, doubt: bool) -> Verdict {
    if !doubt || is_stored_refusal(status, &body) {
        return Verdict::Refused { status, body };
    }
    let last = format!(
        "HTTP {status} {}: this refusal does not say what became of an earlier attempt, \
         which may have gone through",
        body.chars().take(200).collect::<String>()
    );
    Verdict::Unknown { last }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_version_4_uuids_and_differ() {
        let (a, b) = (new_key().unwrap(), new_key().unwrap());
        assert_ne!(a, b);
        for k in [&a, &b] {
            let parts: Vec<&str> = k.split('-').collect();
            assert_eq!(parts.iter().map(|p| p.len()).collect::<Vec<_>>(), [8, 4, 4, 4, 12], "{k}");
            assert!(parts[2].starts_with('4') && "89ab".contains(&parts[3][..1]), "{k}");
        }
    }

    #[test]
    fn a_key_file_is_written_once_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("transfer.key");
        let first = key_in_file(&path, 255).unwrap();
        assert_eq!(key_in_file(&path, 255).unwrap(), first);
        assert_eq!(std::fs::read_to_string(&path).unwrap().trim(), first);
    }

    #[test]
    fn an_unreachable_service_is_an_unknown_outcome_within_the_budget() {
        // a port nobody listens on: every attempt fails at once
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        drop(listener);
        let policy = Policy { budget: Duration::from_millis(300), ..Policy::default() };
        let endpoint = Endpoint { url, token: "t".into() };
        let report = send(&[endpoint], "k", "{}", &policy, &mut Rng::new(7));
        assert!(matches!(report.verdict, Verdict::Unknown { .. }), "{report:?}");
        assert!(report.attempts() > 1 && report.took < Duration::from_millis(600), "{report:?}");
    }
}
