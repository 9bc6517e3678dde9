//! `idem transfer`: one transfer over HTTP through the retrying client.

use crate::common::{Failure, account_id, secret, seed_or_clock};
use idem::client::{self, Verdict};
use idem::clock;
use idem::policy::Policy;
use std::path::PathBuf;
use std::process::ExitCode;

/// Send one transfer over HTTP, retrying until a final answer or the budget runs out.
///
/// One key for every attempt (new, given, or kept in --key-file, written
/// and synced before the first attempt so a crashed client resumes with
/// it); exponential backoff with full jitter; retries timeouts, lost
/// connections, 409, 429, 503 and other 5xx (after a 429's or 503's
/// Retry-After). Once an attempt may have reached the server, only the
/// transfer's own stored answer is final (2xx, or a 402/404/422 naming a
/// stored reason); any other refusal then means the outcome is unknown.
/// Exit 0: the transfer exists (its JSON on stdout). Exit 4: refused for
/// good (the problem on stdout). Exit 75: outcome unknown, retry with the
/// same key. Exit 1: the key or key file cannot be used, or the token
/// file cannot be read. Exit 2: usage.
#[derive(clap::Args, Debug)]
pub struct Transfer {
    /// The service's base URL, e.g. http://127.0.0.1:8080. Repeat it for
    /// several instances of one service: each retry goes to the next.
    #[arg(long, required = true)]
    url: Vec<String>,
    /// Bearer token (visible to other users in the process list: prefer --token-file or IDEM_TOKEN).
    #[arg(long, env = "IDEM_TOKEN", hide_env_values = true, conflicts_with = "token_file")]
    token: Option<String>,
    /// A file holding the bearer token (its first line).
    #[arg(long, value_name = "FILE")]
    token_file: Option<PathBuf>,
    /// Source account (an integer id if it parses as one).
    #[arg(long)]
    src: String,
    /// Destination account.
    #[arg(long)]
    dst: String,
    /// In the currency's smallest unit.
    #[arg(long, value_parser = clap::value_parser!(i64).range(1..))]
    amount: i64,
    #[arg(long, default_value = "KRW")]
    currency: String,
    /// The idempotency key: 1 to 255 printable ASCII characters (default: a new UUID, or the one in --key-file).
    #[arg(long, conflicts_with = "key_file")]
    key: Option<String>,
    /// Keep the key in this file: read it if present, else publish a new one there first.
    #[arg(long)]
    key_file: Option<PathBuf>,
    /// The whole time allowed, attempts and pauses: e.g. 30s, 500ms, 2m.
    #[arg(long, default_value = "30s", value_parser = clock::parse_duration)]
    budget: std::time::Duration,
}

pub fn transfer(args: Transfer, policy: &Policy) -> Result<ExitCode, Failure> {
    let token = secret(args.token, args.token_file.as_deref(), "--token or --token-file (or IDEM_TOKEN)")?;
    let key = match (args.key, args.key_file) {
        (Some(key), _) => {
            client::check_key(&key, policy.max_field_chars).map_err(|e| Failure(format!("--key: {e}")))?;
            key
        }
        (None, Some(file)) => client::key_in_file(&file, policy.max_field_chars)
            .map_err(|e| Failure(format!("{}: {e}", file.display())))?,
        (None, None) => client::new_key().map_err(|e| Failure(format!("no randomness for a key: {e}")))?,
    };
    let body = serde_json::json!({"src": account_id(args.src), "dst": account_id(args.dst),
                                  "amount": args.amount, "currency": args.currency});
    eprintln!("idem: key {key}");
    let retry = client::Policy { budget: args.budget, ..client::Policy::default() };
    let endpoints: Vec<client::Endpoint> =
        args.url.into_iter().map(|url| client::Endpoint { url, token: token.clone() }).collect();
    let mut rng = idem::rng::Rng::new(seed_or_clock(None));
    let report = client::send(&endpoints, &key, &body.to_string(), &retry, &mut rng);
    let (attempts, took) = (report.attempts(), report.took.as_secs_f64());
    Ok(match report.verdict {
        Verdict::Done { body, .. } => {
            say!("{body}");
            ExitCode::SUCCESS
        }
        Verdict::Refused { status, body } => {
            say!("{body}");
            eprintln!("idem: refused for good with {status} after {attempts} attempt(s); not retried");
            ExitCode::from(4)
        }
        Verdict::Unknown { last } => {
            eprintln!(
                "idem: outcome unknown after {attempts} attempt(s) in {took:.1}s (last: {last}); \
                 retry with key {key}: the transfer goes out at most once under it"
            );
            ExitCode::from(75)
        }
    })
}
