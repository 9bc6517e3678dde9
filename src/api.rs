//! `idem_api`: the lab's engine contract as a command. The `idem_api`
//! binary is this module's [`main`]; `idem api` runs the same, so the harness
//! can race real engine processes from one binary.
//!
//! One request file in, one JSON response out. Exit codes: 0 a response was
//! printed (whatever its status); 2 the command line does not parse; 3 the
//! request file cannot be read; 4 a simulated crash (`--crash-after-claim`);
//! 5 the database cannot be used (missing, read-only, corrupt, no `account`
//! table, another schema version).
//!
//! With `--gateway` the request is a payout (see [`crate::payout`]): the
//! same three steps as `POST /v1/payouts`, and no database connection is
//! kept across the gateway's call.

use crate::clock::Timestamp;
use crate::payout::{self, HttpGateway};
use crate::policy::Policy;
use crate::protocol::{self, Claimed, Ctx, Flow, Outcome, Point, Response};
use crate::reason::Reason;
use crate::request;
use crate::store::{self, Db, Usage};
use clap::{Parser, ValueEnum};
use std::ffi::OsString;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

const EXIT_REQUEST_UNREADABLE: u8 = 3;
const EXIT_CRASHED: u8 = 4;
const EXIT_DATABASE: u8 = 5;

/// Moves money exactly once per idempotency key.
///
/// Prints {"status","replay","reason","body"} and exits 0 for every status.
/// Exit 2: bad command line; 3: request file unreadable; 4: simulated crash;
/// 5: database unusable (one line on stderr).
/// IDEM_NOW=<RFC 3339> fixes the clock (for tests).
///
/// With --gateway URL the request's body is a payout,
/// {"src","beneficiary","amount","currency"}: 201 paid, 402/422 refused by
/// the gateway (the money goes back), 202 not known yet (the money stays
/// held until `idem reconcile` asks the gateway; a retry answers 202 again
/// and never calls twice).
#[derive(Parser, Debug)]
#[command(name = "idem_api", version)]
struct Args {
    /// SQLite file holding at least account(acct_id, holder, balance), or a
    /// PostgreSQL connection string (postgres://…, postgresql://…, host=… dbname=…).
    #[arg(long, value_name = "DB")]
    db: String,
    /// Request JSON: {"client_id","endpoint","idem_key","body":{"src","dst","amount","currency"}};
    /// with --gateway the body is {"src","beneficiary","amount","currency"}.
    #[arg(long, value_name = "FILE", required_unless_present = "purge_before")]
    request: Option<PathBuf>,
    /// Commit the claim, then exit 4 without moving money or answering.
    #[arg(long, requires = "request")]
    crash_after_claim: bool,
    /// Delete keys created before this RFC 3339 instant; prints {"purged": N}.
    #[arg(long, value_name = "RFC3339", value_parser = Timestamp::parse, conflicts_with = "request")]
    purge_before: Option<Timestamp>,
    /// Pay out through this gateway (POST /payouts, as `idem serve --gateway`):
    /// the request's body is a payout.
    #[arg(long, value_name = "URL", requires = "request", value_parser = payout::gateway_url)]
    gateway: Option<String>,
    /// Bearer token for the gateway (or IDEM_GATEWAY_TOKEN).
    #[arg(long, env = "IDEM_GATEWAY_TOKEN", hide_env_values = true)]
    gateway_token: Option<String>,
    /// The gateway call's whole time; past it the payout's outcome is unknown (202).
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = crate::clock::parse_positive_duration)]
    gateway_timeout: Duration,
    /// Test hook: exit 4 at this point of the protocol.
    #[arg(long, hide = true, value_enum, requires = "request")]
    crash_at: Option<CrashAt>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum CrashAt {
    AfterClaim,
    BeforeCommit,
    AfterCommit,
    /// A payout's intent is committed; the gateway is not called.
    AfterIntent,
    /// The gateway was called; its result is not recorded.
    AfterCall,
}

/// Runs the contract on a command line (`args[0]` is the program name).
pub fn main(args: impl IntoIterator<Item = OsString>) -> ExitCode {
    let args = Args::parse_from(args);
    let policy = Policy::embedded();
    let fixed = match std::env::var("IDEM_NOW") {
        Ok(text) => match Timestamp::parse(&text) {
            Ok(t) => Some(t),
            Err(e) => return fail(2, &format!("IDEM_NOW: {e}")),
        },
        Err(_) => None,
    };
    let now = fixed.unwrap_or_else(Timestamp::now);
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
    let token = match protocol::fresh_token() {
        Ok(token) => token,
        Err(e) => return fail(1, &format!("no randomness for a claim token: {e}")),
    };
    let ctx = Ctx { policy, now, token: &token };
    if let Some(url) = args.gateway {
        let gateway = HttpGateway {
            url,
            token: args.gateway_token,
            timeout: args.gateway_timeout,
            // a reconciler's concern, not a request's
            limits: crate::payout::Limits::default(),
        };
        let crash_at = args.crash_at.or(args.crash_after_claim.then_some(CrashAt::AfterClaim));
        return pay_out(&Db::parse(&args.db), &bytes, &gateway, ctx, fixed, crash_at);
    }
    if matches!(args.crash_at, Some(CrashAt::AfterIntent | CrashAt::AfterCall)) {
        return fail(2, "--crash-at after-intent and after-call are points of a payout (--gateway)");
    }
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
        (Some(CrashAt::AfterIntent | CrashAt::AfterCall), _) | (None, false) => None,
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
    match protocol::handle(&mut store, &req, ctx, &mut faults) {
        Ok(Outcome::Respond(response)) => print(&response.to_json()),
        Ok(Outcome::Crashed(p)) => fail(EXIT_CRASHED, &format!("simulated crash at {p:?}")),
        Err(e) => fail(EXIT_DATABASE, &e.to_string()),
    }
}

/// A payout: claim and intent, the gateway's call with no connection open,
/// the result. A crash, or a result that cannot be recorded, leaves the
/// payout in progress with its money held: a retry answers 202 from its
/// row, and `idem reconcile` settles it by asking the gateway.
fn pay_out(
    db: &Db,
    bytes: &[u8],
    gateway: &HttpGateway,
    ctx: Ctx,
    fixed: Option<Timestamp>,
    crash_at: Option<CrashAt>,
) -> ExitCode {
    let req = match request::parse_payout_file(bytes, ctx.policy) {
        Ok(req) => req,
        Err(e) => {
            let refusal = Response::refusal(ctx.policy.on_invalid_request, Reason::Invalid(e.to_string()));
            return print(&refusal.to_json());
        }
    };
    let crash = |at: CrashAt| {
        if crash_at == Some(at) {
            eprintln!("idem_api: simulated crash at {at:?}");
            std::process::exit(EXIT_CRASHED.into());
        }
    };
    // The payout table first (created on first use); and, to crash after
    // the claim alone, the claim (the intent's step takes it otherwise).
    let prepared = store::open(db, ctx.policy, Usage::OneRequest).and_then(|mut store| {
        payout::prepare(&mut store, ctx.policy)?;
        if crash_at == Some(CrashAt::AfterClaim)
            && protocol::claim_key(&mut store, &req.key, &req.fingerprint, ctx)? == Claimed::Mine
        {
            crash(CrashAt::AfterClaim);
        }
        Ok(())
    });
    if let Err(e) = prepared {
        return fail(EXIT_DATABASE, &e.to_string());
    }
    let now = move || fixed.unwrap_or_else(Timestamp::now);
    let mut stop = |b: payout::Boundary| match b {
        payout::Boundary::AfterIntent => crash(CrashAt::AfterIntent),
        // for a payout, the last moment before the result's commit is after the call
        payout::Boundary::AfterCall => {
            crash(CrashAt::AfterCall);
            crash(CrashAt::BeforeCommit);
        }
        payout::Boundary::AfterResult => crash(CrashAt::AfterCommit),
    };
    // the steps outlive this call's borrow: idem_api's policy is the embedded one
    let policy = crate::policy::Policy::embedded();
    let mut steps = Opened { db: db.clone(), policy };
    match payout::pay(&mut steps, gateway, req, ctx.token.to_owned(), &now, policy, &mut stop) {
        Ok(answer) => print(&answer.response.to_json()),
        Err(e) => fail(EXIT_DATABASE, &e.to_string()),
    }
}

/// A payout's steps for a process that serves one request: the database is
/// opened for each step and closed after it, so no connection waits on the
/// gateway.
struct Opened {
    db: Db,
    policy: &'static crate::policy::Policy,
}

impl payout::Steps for Opened {
    fn step<R: Send + 'static>(
        &mut self,
        work: impl FnOnce(&mut dyn store::Store) -> Result<R, store::StoreError> + Send + 'static,
    ) -> Result<R, store::StoreError> {
        let mut store = store::open(&self.db, self.policy, Usage::OneRequest)?;
        work(&mut *store)
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
