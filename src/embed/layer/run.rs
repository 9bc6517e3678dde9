//! A request's run behind the layer, from its connection to its answer:
//! under its key (claim, handler, stored answer, one commit), or without
//! one on a route whose key is optional; each bounded in time, counted and
//! traced.

use super::answer::{answer_of, answered, to_store, unavailable};
use super::conn::Held;
use super::{Idempotency, OnSlot, Stop, Tx, problem};
use crate::clock::Timestamp;
use crate::embed::{Keys, Reply};
use crate::protocol::{Decision, conduct, decide};
use crate::request::ScopedKey;
use crate::store::StoreError;
use crate::store::keys::Kept;
use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::sync::Mutex;

/// How the layer's requests ended, counted since its state was made
/// ([`Idempotency::counts`]): what a team exports as metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Ran under a new key, their answers stored with it.
    pub fresh: u64,
    /// Answered with a key's stored answer, the handler not run.
    pub replayed: u64,
    /// Refused by the key: in flight (409) or used with another request (422).
    pub refused: u64,
    /// Ran without a key, unprotected, on a route whose key is optional.
    pub unkeyed: u64,
    /// Stopped past [`Idempotency::max_run`]: rolled back, the key free, 503.
    pub timed_out: u64,
}

/// The counters behind [`Counts`], shared by every clone of the state.
#[derive(Debug, Default)]
pub(super) struct Counters([AtomicU64; 5]);

#[derive(Clone, Copy)]
enum Ended {
    Fresh,
    Replayed,
    Refused,
    Unkeyed,
    TimedOut,
}

impl Counters {
    fn add(&self, ended: Ended) {
        self.0[ended as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn counts(&self) -> Counts {
        let n = |e: Ended| self.0[e as usize].load(Ordering::Relaxed);
        Counts {
            fresh: n(Ended::Fresh),
            replayed: n(Ended::Replayed),
            refused: n(Ended::Refused),
            unkeyed: n(Ended::Unkeyed),
            timed_out: n(Ended::TimedOut),
        }
    }
}

/// 503 for a handler stopped past its bound.
fn timed_out(idem: &Idempotency) -> Response {
    idem.counters.add(Ended::TimedOut);
    let why = format!(
        "The handler ran past its bound of {} ms: nothing it did was kept, and the key is free.",
        idem.max_run.as_millis()
    );
    let mut r = problem(StatusCode::SERVICE_UNAVAILABLE, "handler_timed_out", &why);
    r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    r
}

/// Claims the key, runs the handler in the claim's transaction, stores its
/// answer and commits: `protocol::conduct`, with the handler as the work.
/// A request that meets its key in flight and prefers to wait (`Prefer:
/// wait=N`, RFC 7240) waits for the first's answer instead of 409: it reads
/// the key's committed row now and then on a connection taken for each
/// read, holding none between; once the first commits, its answer is this
/// one's (`Preference-Applied: wait`). If none comes within N, the request
/// runs once more as without waiting: 409 if the first still runs, or the
/// request itself if the first let its key go.
pub(super) async fn keyed<Fut: Future<Output = Response>>(
    idem: Idempotency,
    key: ScopedKey,
    fingerprint: String,
    request: Request,
    next: impl FnOnce(Request) -> Fut,
) -> Response {
    let wait = crate::request::prefer_wait(
        request.headers().get_all("prefer").iter().filter_map(|v| v.to_str().ok()),
    );
    let mut work = Some((request, next));
    let wait = match (once(&idem, &key, &fingerprint, &mut work).await, wait) {
        (Ran::Answered(answer), _) => return answer,
        (Ran::InFlight, None) => return in_flight(&idem),
        (Ran::InFlight, Some(wait)) => wait,
    };
    let settled = crate::request::within(wait, || async {
        let (record, kept) = idem.store.peek(&idem.keys, &key).await?;
        match decide(&record, &fingerprint, Timestamp::now(), &idem.keys.policy) {
            d @ (Decision::Replay(_) | Decision::Mismatch) => Some(Keys::decided(d, kept)),
            _ => None,
        }
    });
    if let Some(reply) = settled.await {
        idem.counters.add(match reply {
            Reply::Mismatch => Ended::Refused,
            _ => Ended::Replayed,
        });
        let mut answer = answer_of(reply);
        answer.headers_mut().insert("preference-applied", HeaderValue::from_static("wait"));
        return answer;
    }
    match once(&idem, &key, &fingerprint, &mut work).await {
        Ran::Answered(answer) => answer,
        Ran::InFlight => in_flight(&idem),
    }
}

/// What one conducted run gave: an answer, or the key in flight (not yet
/// answered: the caller may wait).
enum Ran {
    Answered(Response),
    InFlight,
}

/// 409 for a key in flight, counted.
fn in_flight(idem: &Idempotency) -> Response {
    idem.counters.add(Ended::Refused);
    answer_of(Reply::InFlight)
}

/// One conducted run: the handler runs for at most
/// [`Idempotency::max_run`]; past it, it is dropped, its transaction ended
/// (a PostgreSQL connection closed, so a statement it left running ends
/// with it) and the key left free. A handler stopped late may have left a
/// statement running, or a task of its own holding the transaction: its
/// transaction is dropped unfinished (`Held`'s drop ends it), never waited
/// for. `work` is taken only if the handler runs.
async fn once<Fut: Future<Output = Response>>(
    idem: &Idempotency,
    key: &ScopedKey,
    fingerprint: &str,
    work: &mut Option<(Request, impl FnOnce(Request) -> Fut)>,
) -> Ran {
    let conn = match idem.connection().await {
        Ok(conn) => conn,
        Err(answer) => return Ran::Answered(answer),
    };
    let Ok(token) = Keys::token::<()>() else { return Ran::Answered(unavailable()) };
    let mut held = Held::new(conn, idem.keys.clone());
    held.call.open(idem, key, &token);
    let tx = Tx(Arc::new(Mutex::new(Some(held))));
    let ctx = idem.keys.ctx(&token);
    let mut late = false;
    let conducted = conduct(&mut OnSlot(tx.clone()), key, fingerprint, None, ctx, async |slot| {
        let Some((mut request, next)) = work.take() else { return Err(Stop::Work(unavailable())) };
        request.extensions_mut().insert(slot.0.clone());
        let Ok(response) = tokio::time::timeout(idem.max_run, next(request)).await else {
            late = true;
            return Err(Stop::Work(timed_out(idem)));
        };
        let (head, bytes, kept) = answered(idem, response).await.map_err(Stop::Work)?;
        if !kept {
            // not an answer to keep: the handler's writes go with the claim
            return Err(Stop::Work(Response::from_parts(head, Body::from(bytes))));
        }
        let answer = to_store(idem, &head, &bytes);
        if idem.crash_before_commit {
            // the fault point (`faults_from_env`): the handler's writes and
            // the key's claim are uncommitted, and end with the process
            std::process::abort();
        }
        if !slot.complete_and_commit(key, &token, &answer).await {
            // whether it committed is unknown: the retry replays it or runs it
            let why = "Whether it was done is unknown: retry.";
            return Err(Stop::Work(problem(StatusCode::SERVICE_UNAVAILABLE, "unknown", why)));
        }
        Ok(Response::from_parts(head, Body::from(bytes)))
    })
    .await;
    if late {
        drop(tx.0.try_lock().ok().and_then(|mut slot| slot.take()));
        let Err(Stop::Work(response)) = conducted else { return Ran::Answered(unavailable()) };
        return Ran::Answered(response);
    }
    let Some(mut held) = tx.0.lock().await.take() else {
        return Ran::Answered(problem(
            StatusCode::INTERNAL_SERVER_ERROR,
            "lost",
            "The transaction was lost.",
        ));
    };
    // whatever did not commit rolls back: a decision, a failure, an answer not kept
    held.rollback().await;
    if matches!(conducted, Ok(Err(Decision::InProgress)) | Err(Stop::Store(StoreError::Busy))) {
        return Ran::InFlight;
    }
    let kept = std::mem::take(&mut held.kept);
    let called = held.call.called.take().filter(|_| matches!(conducted, Ok(Ok(_))));
    drop(held); // the connection goes back before any outside call
    let response = counted(idem, conducted, kept);
    Ran::Answered(match called {
        // the intent committed with the key: the call, then its result
        Some(intent) => super::outside::call(idem, intent, &token, response).await,
        None => response,
    })
}

/// The answer a conducted run gives, counted.
fn counted(
    idem: &Idempotency,
    conducted: Result<Result<Response, Decision>, Stop<Response>>,
    kept: Kept,
) -> Response {
    match conducted {
        Ok(Ok(response)) => {
            idem.counters.add(Ended::Fresh);
            response
        }
        Err(Stop::Work(response)) => response,
        Ok(Err(decision)) => {
            let reply = Keys::decided(decision, kept);
            idem.counters.add(match reply {
                Reply::Replayed(_) | Reply::Fresh(_) => Ended::Replayed,
                Reply::InFlight | Reply::Mismatch => Ended::Refused,
            });
            answer_of(reply)
        }
        // a key in flight (`Busy`) is `once`'s to answer, after any wait
        Err(Stop::Store(_)) => unavailable(),
    }
}

/// Runs the handler without a key (a route whose key is optional, a
/// request that sent none): in a transaction of its own, committed if its
/// answer is one the layer keeps and rolled back otherwise, bounded as a
/// keyed run is. Nothing protects it from running twice: counted
/// ([`Counts::unkeyed`]) and logged, so that a team sees how many of its
/// clients still send no key.
pub(super) async fn unkeyed<Fut: Future<Output = Response>>(
    idem: Idempotency,
    client: String,
    mut request: Request,
    next: impl FnOnce(Request) -> Fut,
) -> Response {
    idem.counters.add(Ended::Unkeyed);
    tracing::info!(target: "idem", %client, method = %request.method(), path = %request.uri().path(), "a request without an idempotency key ran unprotected");
    let conn = match idem.connection().await {
        Ok(conn) => conn,
        Err(answer) => return answer,
    };
    let mut held = Held::new(conn, idem.keys.clone());
    if !held.begin().await {
        return unavailable();
    }
    let tx = Tx(Arc::new(Mutex::new(Some(held))));
    request.extensions_mut().insert(tx.clone());
    let Ok(response) = tokio::time::timeout(idem.max_run, next(request)).await else {
        drop(tx.0.try_lock().ok().and_then(|mut slot| slot.take()));
        return timed_out(&idem);
    };
    let answer = answered(&idem, response).await;
    let Some(mut held) = tx.0.lock().await.take() else {
        return problem(StatusCode::INTERNAL_SERVER_ERROR, "lost", "The transaction was lost.");
    };
    match answer {
        Ok((head, bytes, true)) => match held.commit().await {
            true => Response::from_parts(head, Body::from(bytes)),
            false => {
                let why = "Whether it was done is unknown.";
                problem(StatusCode::SERVICE_UNAVAILABLE, "unknown", why)
            }
        },
        Ok((head, bytes, false)) => {
            held.rollback().await;
            Response::from_parts(head, Body::from(bytes))
        }
        Err(response) => {
            held.rollback().await;
            response
        }
    }
}
