//! The harness: the proofs of idem, none of which the engine needs to run.
//! The day, the scenarios and the storms reach an engine only through
//! [`protocol::Engine`], so they judge the real protocol on every store and
//! the deliberately broken engines kept under `tests/` alike; the races run
//! real `idem_api` processes; chaos runs real `idem serve` processes and
//! judges them from the database's tables (and, for the claims a killed
//! server left, through the store's transactions).

pub mod chaos;
pub mod day;
pub mod files;
pub mod race;
pub mod scenario;

use crate::protocol::{self, Claimed, Ctx, Engine, Flow, Outcome, Point, Response};
use crate::store::StoreError;

/// Why the harness stopped, with its cause.
#[derive(Debug)]
pub enum HarnessError {
    /// A file the harness reads or writes, or a process it starts: what it
    /// was doing, and the system's error.
    Io { doing: String, source: std::io::Error },
    /// A SQLite file the harness reads or writes itself (the day's log, a
    /// gateway's ledger).
    Sqlite(rusqlite::Error),
    /// The engine's store, under the day or chaos.
    Store(StoreError),
    /// A report the harness writes as JSON.
    Json(serde_json::Error),
    /// What the harness found that stops it (a setup it refuses, a server
    /// that did not start, a crash nobody asked for), in its own words.
    Stopped(String),
}

impl HarnessError {
    /// An `Io` error's constructor for `map_err`, saying what was being done.
    pub fn io(doing: impl Into<String>) -> impl FnOnce(std::io::Error) -> HarnessError {
        let doing = doing.into();
        move |source| HarnessError::Io { doing, source }
    }
}

impl std::fmt::Display for HarnessError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HarnessError::Io { doing, source } => write!(f, "{doing}: {source}"),
            HarnessError::Sqlite(e) => write!(f, "sqlite: {e}"),
            HarnessError::Store(e) => write!(f, "store: {e}"),
            HarnessError::Json(e) => write!(f, "json: {e}"),
            HarnessError::Stopped(why) => f.write_str(why),
        }
    }
}

impl std::error::Error for HarnessError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            HarnessError::Io { source, .. } => Some(source),
            HarnessError::Sqlite(e) => Some(e),
            HarnessError::Store(e) => Some(e),
            HarnessError::Json(e) => Some(e),
            HarnessError::Stopped(_) => None,
        }
    }
}

impl From<rusqlite::Error> for HarnessError {
    fn from(e: rusqlite::Error) -> Self {
        HarnessError::Sqlite(e)
    }
}

impl From<StoreError> for HarnessError {
    fn from(e: StoreError) -> Self {
        HarnessError::Store(e)
    }
}

impl From<serde_json::Error> for HarnessError {
    fn from(e: serde_json::Error) -> Self {
        HarnessError::Json(e)
    }
}

/// One raw request through `engine`: a malformed one gets its 400, a crash
/// at `crash` gets `None`.
pub fn send<E: Engine + ?Sized>(
    engine: &mut E,
    raw: &str,
    ctx: Ctx,
    crash: Option<Point>,
) -> Result<Option<Response>, StoreError> {
    let req = match engine.parse(raw.as_bytes(), ctx.policy) {
        Ok(req) => req,
        Err(e) => {
            return Ok(Some(Response::refusal(ctx.policy.on_invalid_request, e.reason())));
        }
    };
    let mut faults = |p: Point| if Some(p) == crash { Flow::Crash } else { Flow::Continue };
    Ok(match protocol::handle(engine, &req, ctx, &mut faults)? {
        Outcome::Respond(response) => Some(response),
        Outcome::Crashed(_) => None,
    })
}

/// Requests that arrive in the same instant, interleaved as racers at their
/// worst: every claim lands before any execution starts. This is the
/// schedule in which a lookup-then-insert engine pays twice. Each request is
/// raw text with its context; a malformed one gets its 400 in its place.
pub fn together<E: Engine + ?Sized>(
    engine: &mut E,
    batch: &[(&str, Ctx)],
) -> Result<Vec<Response>, StoreError> {
    let mut staged = Vec::new();
    for (raw, ctx) in batch {
        staged.push(match engine.parse(raw.as_bytes(), ctx.policy) {
            Err(e) => Err(Response::refusal(ctx.policy.on_invalid_request, e.reason())),
            Ok(req) => {
                let claimed = engine.claim(&req, *ctx);
                Ok((req, claimed))
            }
        });
    }
    let mut responses = Vec::new();
    for ((_, ctx), stage) in batch.iter().zip(staged) {
        let outcome = match stage {
            Err(refusal) => Ok(Outcome::Respond(refusal)),
            Ok((_, Ok(Claimed::Answer(response)))) => Ok(Outcome::Respond(response)),
            Ok((req, Ok(Claimed::Mine))) => engine.execute(&req, *ctx, &mut |_| Flow::Continue),
            Ok((_, Err(e))) => Err(e),
        };
        responses.push(match protocol::unless_busy(outcome, ctx.policy)? {
            Outcome::Respond(response) => response,
            Outcome::Crashed(p) => {
                return Err(StoreError::Backend(format!("crashed at {p:?} unasked").into()));
            }
        });
    }
    Ok(responses)
}
