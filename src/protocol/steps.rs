//! The protocol on a store that is awaited rather than called (the
//! service's PostgreSQL pool): the same steps as [`super::handle`], each
//! decided by the same functions, each step one round trip.

use super::*;
use crate::store::Steps;

/// [`handle`] on [`Steps`]: the same steps, each decided by the same
/// functions, without fault hooks.
pub async fn handle_steps<S: Steps>(
    store: &mut S,
    req: &Request,
    ctx: Ctx<'_>,
) -> Result<Outcome, StoreError> {
    let outcome = match claim_steps(store, req, ctx).await {
        Ok(Claimed::Answer(response)) => Ok(Outcome::Respond(response)),
        Ok(Claimed::Mine) => match execute_steps(store, req, ctx, &mut || false).await {
            Err(e) => {
                // as in `handle`: free the key now, best effort
                let _ = store.release(&req.key, ctx.token).await;
                Err(e)
            }
            done => done,
        },
        Err(e) => Err(e),
    };
    unless_busy(outcome, ctx.policy)
}

/// [`claim`] on [`Steps`].
pub async fn claim_steps<S: Steps>(
    store: &mut S,
    req: &Request,
    ctx: Ctx<'_>,
) -> Result<Claimed, StoreError> {
    let claim = fresh_claim(&req.fingerprint, ctx);
    let accounts = [&req.transfer.src, &req.transfer.dst];
    let Some(existing) = store.claim(&req.key, &claim, accounts).await? else {
        return Ok(Claimed::Mine);
    };
    let claim = match after_claim(&existing, claim, ctx) {
        Ok(claim) => claim,
        Err(decision) => return Ok(Claimed::Answer(answer(decision, ctx.policy))),
    };
    Ok(match store.replace_claim(&req.key, &existing, &claim).await? {
        true => Claimed::Mine,
        false => Claimed::Answer(in_progress(ctx.policy)),
    })
}

/// [`execute`] on [`Steps`], asking `crash` whether to stop before the
/// write (the harness's [`Point::BeforeCommit`]).
pub async fn execute_steps<S: Steps>(
    store: &mut S,
    req: &Request,
    ctx: Ctx<'_>,
    crash: &mut (dyn FnMut() -> bool + Send),
) -> Result<Outcome, StoreError> {
    let mut lost = None;
    let mut plan = |seen: &Seen| plan(seen, req, ctx, &mut lost);
    let executed = store.execute(execution(req, ctx), &mut plan, crash).await?;
    Ok(committed(executed, lost, ctx).map_or_else(|outcome| outcome, Outcome::Respond))
}
