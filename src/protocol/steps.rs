//! The one conductor of claim → work → complete, [`conduct`], on
//! [`KeySteps`]: every front runs a key through it. The engine's request
//! ([`handle_steps`]) is its claim and the execution as the work, on the
//! service's PostgreSQL pool awaited and on a store that is called through
//! [`Blocking`] (blocked on with [`now`]); the library's is the caller's
//! work and the completion in the caller's transaction.

use super::*;
use crate::store::{Blocking, KeySteps, Steps};
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

/// Claims `key` for `ctx.token` on a body with `fingerprint`, runs `work`
/// under the claim, and lets the claim go if the work failed; or, when the
/// key is another attempt's, the decision that answers instead (nothing
/// runs). The work completes the key itself, in the transaction that does
/// the work.
pub async fn conduct<S, T, X>(
    steps: &mut S,
    key: &ScopedKey,
    fingerprint: &str,
    accounts: Option<[&AcctId; 2]>,
    ctx: Ctx<'_>,
    work: impl AsyncFnOnce(&mut S) -> Result<T, X>,
) -> Result<Result<T, Decision>, X>
where
    S: KeySteps + ?Sized,
    X: From<StoreError>,
{
    if let Some(decision) = claim_as(steps, key, fingerprint, accounts, ctx).await? {
        return Ok(Err(decision));
    }
    let done = work(steps).await;
    if done.is_err() {
        // The work could not run to its end (a lock held past the budget, a
        // database error, the caller's own error) and wrote nothing: free
        // the key now rather than leave it answering 409 for the whole
        // lease. Best effort: if this fails too, or the process dies first,
        // the lease frees it.
        let _ = steps.release(key, ctx.token).await;
    }
    done.map(Ok)
}

/// The claim: `None` if the key is `ctx.token`'s now (new, or taken over
/// by a compare-and-set on the version decided on, so it needs no lock held
/// since the read), else the decision that answers for it. A lost
/// compare-and-set means another attempt got there first, or the old holder
/// is still executing: the key is in flight.
pub async fn claim_as<S: KeySteps + ?Sized>(
    steps: &mut S,
    key: &ScopedKey,
    fingerprint: &str,
    accounts: Option<[&AcctId; 2]>,
    ctx: Ctx<'_>,
) -> Result<Option<Decision>, StoreError> {
    let claim = fresh_claim(fingerprint, ctx);
    let Some(existing) = steps.claim(key, &claim, accounts).await? else { return Ok(None) };
    let claim = match after_claim(&existing, claim, ctx) {
        Ok(claim) => claim,
        Err(decision) => return Ok(Some(decision)),
    };
    Ok(match steps.replace_claim(key, &existing, &claim).await? {
        true => None,
        false => Some(Decision::InProgress),
    })
}

/// A request on [`Steps`]: claim, then the execution as the work, with
/// the fault hooks at each [`Point`]; a busy store becomes an unstored 503.
pub async fn handle_steps<S: Steps + ?Sized>(
    steps: &mut S,
    req: &Request,
    ctx: Ctx<'_>,
    faults: &mut impl FnMut(Point) -> Flow,
) -> Result<Outcome, StoreError> {
    let accounts = [&req.transfer.src, &req.transfer.dst];
    let conducted = conduct(steps, &req.key, &req.fingerprint, Some(accounts), ctx, async |steps| {
        if faults(Point::AfterClaim) == Flow::Crash {
            return Ok(Outcome::Crashed(Point::AfterClaim));
        }
        execute_steps(steps, req, ctx, faults).await
    })
    .await;
    let outcome = conducted.map(|done| done.unwrap_or_else(|d| Outcome::Respond(answer(d, ctx.policy))));
    unless_busy(outcome, ctx.policy)
}

/// Step 2 on [`Steps`]: under the claim held by `ctx.token`, move the money
/// and complete the key in one durable transaction.
pub async fn execute_steps<S: Steps + ?Sized>(
    steps: &mut S,
    req: &Request,
    ctx: Ctx<'_>,
    faults: &mut impl FnMut(Point) -> Flow,
) -> Result<Outcome, StoreError> {
    let mut lost = None;
    let mut plan = |seen: &Seen| plan(seen, req, ctx, &mut lost);
    let mut crash = || faults(Point::BeforeCommit) == Flow::Crash;
    let executed = steps.execute(execution(req, ctx), &mut plan, &mut crash).await?;
    let answer = match committed(executed, lost, ctx) {
        Ok(answer) => answer,
        Err(outcome) => return Ok(outcome),
    };
    if faults(Point::AfterCommit) == Flow::Crash {
        return Ok(Outcome::Crashed(Point::AfterCommit));
    }
    Ok(Outcome::Respond(answer))
}

/// Runs `future` to its end on this thread: how a synchronous face runs the
/// conductor. On a store that is called ([`Blocking`]) every step is done
/// when first polled, so it never parks.
pub fn now<F: Future>(future: F) -> F::Output {
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut future = pin!(future);
    loop {
        match future.as_mut().poll(&mut cx) {
            Poll::Ready(output) => return output,
            Poll::Pending => std::thread::park(),
        }
    }
}

/// A store that is called, as the conductor's steps.
pub(super) fn blocking<'a, S: Store + ?Sized>(store: &'a mut S, ctx: &Ctx<'a>) -> Blocking<'a, S> {
    Blocking::new(store, ctx.policy)
}
