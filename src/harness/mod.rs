//! The harness: everything that drives the engine to prove it, none of which
//! the engine needs to run. It reaches an engine only through
//! [`protocol::Engine`], so the same days, scenarios and storms judge the
//! real protocol on every store and the deliberately broken engines kept
//! under `tests/`.

pub mod chaos;
pub mod check;
pub mod day;
pub mod gateway;
pub mod hop;
pub mod proxy;
pub mod race;
pub mod scenario;

use crate::protocol::{self, Claimed, Ctx, Engine, Flow, Outcome, Point, Response};
use crate::reason::Reason;
use crate::store::StoreError;

/// An error of the harness (the day, chaos, the checks), with what it was doing.
#[derive(Debug)]
pub struct HarnessError(pub String);

impl std::fmt::Display for HarnessError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for HarnessError {}

impl From<rusqlite::Error> for HarnessError {
    fn from(e: rusqlite::Error) -> Self {
        HarnessError(format!("sqlite: {e}"))
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
            return Ok(Some(Response::refusal(
                ctx.policy.on_invalid_request,
                Reason::Invalid(e.to_string()),
            )));
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
            Err(e) => Err(Response::refusal(ctx.policy.on_invalid_request, Reason::Invalid(e.to_string()))),
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
