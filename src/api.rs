//! `idem_api`: the lab's engine contract as a command. The `idem_api`
//! binary runs this module's [`run`] and says what it returns; `idem api`
//! runs the same, so the harness can race real engine processes from one
//! binary. The environment, the printing and the exit are the binaries'.
//!
//! One request file in, one JSON response out. Exit codes: 0 a response was
//! printed (whatever its status); 1 the response could not be written, or
//! no randomness for a claim token; 2 the command line (or `IDEM_NOW`) does
//! not parse; 3 the request file cannot be read; 4 a simulated crash
//! (`--crash-after-claim`); 5 the database cannot be used (missing,
//! read-only, corrupt, no `account` table, another schema version).
//!
//! With `--gateway` the request is a payout (see [`crate::payout`]): the
//! same three steps as `POST /v1/payouts`, and no database connection is
//! kept across the gateway's call.

use crate::clock::Timestamp;
use crate::payout::{self, HttpGateway};
use crate::policy::Policy;
use crate::protocol::{self, Claimed, Ctx, Flow, Outcome, Point, Response};
use crate::request;
use crate::store::{self, Db, Usage};
use clap::{Parser, ValueEnum};
use std::ffi::OsString;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The exit code of a simulated crash.
pub const EXIT_CRASHED: u8 = 4;
const EXIT_REQUEST_UNREADABLE: u8 = 3;
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

/// What the process is given from outside: the clock tests fix (`IDEM_NOW`),
/// and how to crash (the binary's: exit at once, no destructors, no
/// rollback, exactly as if the power had been cut).
pub struct Edge {
    pub now: Option<Timestamp>,
    pub crash: fn(&str) -> !,
}

/// What the process says: a line for stdout (the response), lines for
/// stderr, and its exit code.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Said {
    pub stdout: Option<String>,
    pub stderr: Vec<String>,
    pub code: u8,
}

impl Said {
    fn answer(line: String) -> Said {
        Said { stdout: Some(line), ..Said::default() }
    }

    fn fail(code: u8, message: impl Into<String>) -> Said {
        Said { stderr: vec![message.into()], code, ..Said::default() }
    }
}

/// Runs the contract on a command line (`args[0]` is the program name);
/// a command line that does not parse is clap's error, for the binary to
/// print (exit 2, or 0 for --help).
pub fn run(args: impl IntoIterator<Item = OsString>, edge: Edge) -> Result<Said, clap::Error> {
    let args = Args::try_parse_from(args)?;
    let policy = Policy::embedded();
    let now = edge.now.unwrap_or_else(Timestamp::now);
    let db = Db::parse(&args.db);
    if let Some(before) = args.purge_before {
        return Ok(purge(&db, before, now, policy));
    }
    let Some(path) = args.request else {
        return Ok(Said::fail(2, "--request is required"));
    };
    let bytes = match read_capped(&path, policy.max_request_bytes) {
        Ok(bytes) => bytes,
        Err(e) => {
            return Ok(Said::fail(EXIT_REQUEST_UNREADABLE, format!("cannot read {}: {e}", path.display())));
        }
    };
    let token = match protocol::fresh_token() {
        Ok(token) => token,
        Err(e) => return Ok(Said::fail(1, format!("no randomness for a claim token: {e}"))),
    };
    let ctx = Ctx { policy, now, token: &token };
    let crash_at = args.crash_at.or(args.crash_after_claim.then_some(CrashAt::AfterClaim));
    let crash = Crash { at: crash_at, edge: &edge };
    Ok(match args.gateway {
        Some(url) => {
            // the limits are a reconciler's concern, not a request's
            let limits = crate::payout::Limits::default();
            let gateway =
                HttpGateway { url, token: args.gateway_token, timeout: args.gateway_timeout, limits };
            pay_out(&db, &bytes, &gateway, ctx, crash)
        }
        None => transfer(&db, &bytes, ctx, crash),
    })
}

/// Where to crash, and how.
struct Crash<'a> {
    at: Option<CrashAt>,
    edge: &'a Edge,
}

impl Crash<'_> {
    fn here(&self, at: CrashAt) {
        if self.at == Some(at) {
            (self.edge.crash)(&format!("simulated crash at {at:?}"));
        }
    }
}

fn purge(db: &Db, before: Timestamp, now: Timestamp, policy: &'static Policy) -> Said {
    let purged =
        store::open(db, policy, Usage::OneRequest).and_then(|mut s| protocol::purge(&mut s, before, policy));
    let mut said = match purged {
        Ok(n) => Said::answer(format!("{{\"purged\": {n}}}")),
        Err(e) => Said::fail(EXIT_DATABASE, e.to_string()),
    };
    if before > now.plus_seconds(-policy.retention_seconds()) {
        said.stderr.insert(
            0,
            format!(
                "warning: {before} lies inside the {}-hour retention window: \
             a retry of a purged key will pay again (`idem purge` deletes only expired keys)",
                policy.retention_hours
            ),
        );
    }
    said
}

fn transfer(db: &Db, bytes: &[u8], ctx: Ctx, crash: Crash) -> Said {
    let policy = ctx.policy;
    if matches!(crash.at, Some(CrashAt::AfterIntent | CrashAt::AfterCall)) {
        return Said::fail(2, "--crash-at after-intent and after-call are points of a payout (--gateway)");
    }
    let req = match request::parse(bytes, policy) {
        Ok(req) => req,
        Err(e) => return Said::answer(Response::refusal(policy.on_invalid_request, e.reason()).to_json()),
    };
    let mut store = match store::open(db, policy, Usage::OneRequest) {
        Ok(store) => store,
        Err(e) => return Said::fail(EXIT_DATABASE, e.to_string()),
    };
    let point = |at: CrashAt| match at {
        CrashAt::AfterClaim => Some(Point::AfterClaim),
        CrashAt::BeforeCommit => Some(Point::BeforeCommit),
        CrashAt::AfterCommit => Some(Point::AfterCommit),
        CrashAt::AfterIntent | CrashAt::AfterCall => None,
    };
    let crash_at = crash.at.and_then(point);
    let mut faults = |p: Point| {
        if Some(p) == crash_at {
            (crash.edge.crash)(&format!("simulated crash at {p:?}"));
        }
        Flow::Continue
    };
    match protocol::handle(&mut store, &req, ctx, &mut faults) {
        Ok(Outcome::Respond(response)) => Said::answer(response.to_json()),
        Ok(Outcome::Crashed(p)) => Said::fail(EXIT_CRASHED, format!("simulated crash at {p:?}")),
        Err(e) => Said::fail(EXIT_DATABASE, e.to_string()),
    }
}

/// A payout: claim and intent, the gateway's call with no connection open,
/// the result. A crash, or a result that cannot be recorded, leaves the
/// payout in progress with its money held: a retry answers 202 from its
/// row, and `idem reconcile` settles it by asking the gateway.
fn pay_out(db: &Db, bytes: &[u8], gateway: &HttpGateway, ctx: Ctx, crash: Crash) -> Said {
    let req = match request::parse_payout_file(bytes, ctx.policy) {
        Ok(req) => req,
        Err(e) => {
            return Said::answer(Response::refusal(ctx.policy.on_invalid_request, e.reason()).to_json());
        }
    };
    // The payout table first (created on first use); and, to crash after
    // the claim alone, the claim (the intent's step takes it otherwise).
    let prepared = store::open(db, ctx.policy, Usage::OneRequest).and_then(|mut store| {
        payout::prepare(&mut store, ctx.policy)?;
        if crash.at == Some(CrashAt::AfterClaim)
            && protocol::claim_key(&mut store, &req.key, &req.fingerprint, ctx)? == Claimed::Mine
        {
            crash.here(CrashAt::AfterClaim);
        }
        Ok(())
    });
    if let Err(e) = prepared {
        return Said::fail(EXIT_DATABASE, e.to_string());
    }
    let fixed = crash.edge.now;
    let now = move || fixed.unwrap_or_else(Timestamp::now);
    let mut stop = |b: payout::Boundary| match b {
        payout::Boundary::AfterIntent => crash.here(CrashAt::AfterIntent),
        // for a payout, the last moment before the result's commit is after the call
        payout::Boundary::AfterCall => {
            crash.here(CrashAt::AfterCall);
            crash.here(CrashAt::BeforeCommit);
        }
        payout::Boundary::AfterResult => crash.here(CrashAt::AfterCommit),
    };
    // the steps outlive this call's borrow: idem_api's policy is the embedded one
    let policy = crate::policy::Policy::embedded();
    let mut steps = Opened { db: db.clone(), policy };
    match payout::pay(&mut steps, gateway, req, ctx.token.to_owned(), &now, policy, &mut stop) {
        Ok(answer) => Said::answer(answer.response.to_json()),
        Err(e) => Said::fail(EXIT_DATABASE, e.to_string()),
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
