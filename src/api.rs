//! `idem_api`: the lab's engine contract as a command. The `idem_api`
//! binary is this module's [`main`]; `idem api` runs the same, so the harness
//! can race real engine processes from one binary.
//!
//! One request file in, one JSON response out. Exit codes: 0 a response was
//! printed (whatever its status); 2 the command line does not parse; 3 the
//! request file cannot be read; 4 a simulated crash (`--crash-after-claim`);
//! 5 the database cannot be used (missing, read-only, corrupt, no `account`
//! table, another schema version).

use crate::clock::Timestamp;
use crate::policy::Policy;
use crate::protocol::{self, Ctx, Flow, Outcome, Point, Response};
use crate::reason::Reason;
use crate::request;
use crate::store::{self, Db, Usage};
use clap::{Parser, ValueEnum};
use std::ffi::OsString;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

const EXIT_REQUEST_UNREADABLE: u8 = 3;
const EXIT_CRASHED: u8 = 4;
const EXIT_DATABASE: u8 = 5;

/// Moves money exactly once per idempotency key.
///
/// Prints {"status","replay","reason","body"} and exits 0 for every status.
/// Exit 2: bad command line; 3: request file unreadable; 4: simulated crash;
/// 5: database unusable (one line on stderr).
/// IDEM_NOW=<RFC 3339> fixes the clock (for tests).
#[derive(Parser, Debug)]
#[command(name = "idem_api", version)]
struct Args {
    /// SQLite file holding at least account(acct_id, holder, balance), or a
    /// PostgreSQL connection string (postgres://…, postgresql://…, host=… dbname=…).
    #[arg(long, value_name = "DB")]
    db: String,
    /// Request JSON: {"client_id","endpoint","idem_key","body":{"src","dst","amount","currency"}}.
    #[arg(long, value_name = "FILE", required_unless_present = "purge_before")]
    request: Option<PathBuf>,
    /// Commit the claim, then exit 4 without moving money or answering.
    #[arg(long, requires = "request")]
    crash_after_claim: bool,
    /// Delete keys created before this RFC 3339 instant; prints {"purged": N}.
    #[arg(long, value_name = "RFC3339", value_parser = Timestamp::parse, conflicts_with = "request")]
    purge_before: Option<Timestamp>,
    /// Test hook: exit 4 at this point of the protocol.
    #[arg(long, hide = true, value_enum, requires = "request")]
    crash_at: Option<CrashAt>,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum CrashAt {
    AfterClaim,
    BeforeCommit,
    AfterCommit,
}

/// Runs the contract on a command line (`args[0]` is the program name).
pub fn main(args: impl IntoIterator<Item = OsString>) -> ExitCode {
    let args = Args::parse_from(args);
    let policy = Policy::embedded();
    let now = match std::env::var("IDEM_NOW") {
        Ok(text) => match Timestamp::parse(&text) {
            Ok(t) => t,
            Err(e) => return fail(2, &format!("IDEM_NOW: {e}")),
        },
        Err(_) => Timestamp::now(),
    };
    if let Some(before) = args.purge_before {
        if before > now.plus_seconds(-policy.retention_seconds()) {
            eprintln!(
                "idem_api: warning: {before} lies inside the {}-hour retention window: \
                 a retry of a purged key will pay again (`idem purge` deletes only expired keys)",
                policy.retention_hours
            );
        }
        let purged = store::open(&Db::parse(&args.db), policy, Usage::OneRequest)
            .and_then(|mut s| protocol::purge(&mut s, before, policy));
        return match purged {
            Ok(n) => print(&format!("{{\"purged\": {n}}}")),
            Err(e) => fail(EXIT_DATABASE, &e.to_string()),
        };
    }
    let Some(path) = args.request else {
        return fail(2, "--request is required");
    };
    let bytes = match read_capped(&path, policy.max_request_bytes) {
        Ok(bytes) => bytes,
        Err(e) => {
            return fail(EXIT_REQUEST_UNREADABLE, &format!("cannot read {}: {e}", path.display()));
        }
    };
    let req = match request::parse(&bytes, policy) {
        Ok(req) => req,
        Err(e) => {
            return print(
                &Response::refusal(policy.on_invalid_request, Reason::Invalid(e.to_string())).to_json(),
            );
        }
    };
    let mut store = match store::open(&Db::parse(&args.db), policy, Usage::OneRequest) {
        Ok(store) => store,
        Err(e) => return fail(EXIT_DATABASE, &e.to_string()),
    };
    let crash_at = match (args.crash_at, args.crash_after_claim) {
        (Some(CrashAt::AfterClaim), _) | (None, true) => Some(Point::AfterClaim),
        (Some(CrashAt::BeforeCommit), _) => Some(Point::BeforeCommit),
        (Some(CrashAt::AfterCommit), _) => Some(Point::AfterCommit),
        (None, false) => None,
    };
    // A real crash: no destructors, no rollback, no goodbye. Whatever SQLite
    // has not committed is gone, exactly as if the power had been cut.
    let mut faults = |p: Point| {
        if Some(p) == crash_at {
            eprintln!("idem_api: simulated crash at {p:?}");
            std::process::exit(EXIT_CRASHED.into());
        }
        Flow::Continue
    };
    let token = match protocol::fresh_token() {
        Ok(token) => token,
        Err(e) => return fail(1, &format!("no randomness for a claim token: {e}")),
    };
    match protocol::handle(&mut store, &req, Ctx { policy, now, token: &token }, &mut faults) {
        Ok(Outcome::Respond(response)) => print(&response.to_json()),
        Ok(Outcome::Crashed(p)) => fail(EXIT_CRASHED, &format!("simulated crash at {p:?}")),
        Err(e) => fail(EXIT_DATABASE, &e.to_string()),
    }
}

/// Reads at most `limit + 1` bytes, so an oversized file is refused by the
/// parser (400) without being read whole. Only a regular file is read: the
/// open does not wait for a FIFO's writer, and a device or FIFO is refused.
fn read_capped(path: &Path, limit: usize) -> std::io::Result<Vec<u8>> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path)?;
    if !file.metadata()?.is_file() {
        return Err(std::io::Error::other("not a regular file"));
    }
    let mut bytes = Vec::new();
    file.take(limit as u64 + 1).read_to_end(&mut bytes)?;
    Ok(bytes)
}

fn print(line: &str) -> ExitCode {
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{line}").and_then(|()| out.flush()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(1, &format!("cannot write the response: {e}")),
    }
}

fn fail(code: u8, message: &str) -> ExitCode {
    eprintln!("idem_api: {message}");
    ExitCode::from(code)
}
