//! The client's half of exactly once: one key from the first attempt to the
//! last, retries with exponential backoff and full jitter under one overall
//! deadline, and, when the deadline passes without an answer, the honest
//! verdict: the outcome is unknown, retry with the same key.
//!
//! What is retried: a timeout, a connection error, a cut answer, 409 (the
//! first attempt is still running), 503 and any other 5xx. What is not: any
//! other 4xx, which is the server's final word on this request. A 2xx is done.

use crate::rng::Rng;
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

/// How a client retries.
#[derive(Debug, Clone)]
pub struct Policy {
    /// Everything, attempts and pauses, ends by this much after the start.
    pub budget: Duration,
    /// The first pause's upper bound; each retry doubles it…
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
    /// A 4xx other than 409: the server's final word, not worth retrying.
    Refused { status: u16, body: String },
    /// The budget ran out without a final answer: the transfer may or may
    /// not have gone out. Retrying with the same key will tell.
    Unknown { last: String },
}

/// What happened, attempt by attempt.
#[derive(Debug, Clone)]
pub struct Report {
    pub key: String,
    pub verdict: Verdict,
    pub attempts: u32,
    /// From the first attempt to the verdict.
    pub took: Duration,
}

/// A fresh key: a random (version 4) UUID.
pub fn new_key() -> Result<String, getrandom::Error> {
    let mut b = [0u8; 16];
    getrandom::fill(&mut b)?;
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    Ok(format!("{}-{}-{}-{}-{}", &hex[..8], &hex[8..12], &hex[12..16], &hex[16..20], &hex[20..]))
}

/// The key kept in `path`, or a new one written there (and synced) before
/// anything is sent, so that a client that crashes resumes with it.
pub fn key_in_file(path: &Path) -> std::io::Result<String> {
    match std::fs::read_to_string(path) {
        Ok(text) if !text.trim().is_empty() => return Ok(text.trim().to_owned()),
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let key = new_key().map_err(|e| std::io::Error::other(e.to_string()))?;
    let tmp = path.with_extension("tmp");
    let mut file = std::fs::File::create(&tmp)?;
    writeln!(file, "{key}")?;
    file.sync_all()?;
    std::fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(key)
}

/// What one attempt brought back.
enum Attempt {
    Answer {
        status: u16,
        body: String,
        replayed: bool,
    },
    /// No answer: a timeout, a refused or reset connection, a cut body.
    Lost(String),
}

fn attempt(endpoint: &Endpoint, key: &str, body: &str, timeout: Duration) -> Attempt {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(timeout))
        .build()
        .into();
    let sent = agent
        .post(format!("{}/v1/transfers", endpoint.url.trim_end_matches('/')))
        .header("Authorization", format!("Bearer {}", endpoint.token))
        .header("Idempotency-Key", format!("\"{key}\""))
        .header("Content-Type", "application/json")
        .send(body);
    match sent {
        Ok(mut response) => {
            let status = response.status().as_u16();
            let replayed = response.headers().get("idempotent-replayed").is_some_and(|v| v == "true");
            match response.body_mut().read_to_string() {
                Ok(body) => Attempt::Answer { status, body, replayed },
                Err(e) => Attempt::Lost(format!("answer cut short: {e}")),
            }
        }
        Err(e) => Attempt::Lost(e.to_string()),
    }
}

/// Sends the transfer `body` under `key` until a final answer or the end of
/// the budget; sleeps a random pause in `[0, min(max, base · 2^n))` between
/// attempts (full jitter), never past the deadline.
pub fn send(endpoint: &Endpoint, key: &str, body: &str, policy: &Policy, rng: &mut Rng) -> Report {
    let started = Instant::now();
    let deadline = started + policy.budget;
    let mut attempts = 0;
    let mut last = String::from("no attempt fitted in the budget");
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Report {
                key: key.into(),
                verdict: Verdict::Unknown { last },
                attempts,
                took: started.elapsed(),
            };
        }
        attempts += 1;
        last = match attempt(endpoint, key, body, policy.attempt_timeout.min(left)) {
            Attempt::Answer { status, body, replayed } if (200..300).contains(&status) => {
                let verdict = Verdict::Done { status, body, replayed };
                return Report { key: key.into(), verdict, attempts, took: started.elapsed() };
            }
            Attempt::Answer { status, body, .. } if (400..500).contains(&status) && status != 409 => {
                let verdict = Verdict::Refused { status, body };
                return Report { key: key.into(), verdict, attempts, took: started.elapsed() };
            }
            Attempt::Answer { status, .. } => format!("HTTP {status}"),
            Attempt::Lost(why) => why,
        };
        let cap = policy.base_backoff.saturating_mul(1 << attempts.min(20)).min(policy.max_backoff);
        let pause = Duration::from_micros(rng.below(cap.as_micros().max(1) as u64));
        std::thread::sleep(pause.min(deadline.saturating_duration_since(Instant::now())));
    }
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
        let first = key_in_file(&path).unwrap();
        assert_eq!(key_in_file(&path).unwrap(), first);
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
        let report = send(&endpoint, "k", "{}", &policy, &mut Rng::new(7));
        assert!(matches!(report.verdict, Verdict::Unknown { .. }), "{report:?}");
        assert!(report.attempts > 1 && report.took < Duration::from_millis(600), "{report:?}");
    }
}
