//! The PostgreSQL engine's one core: a request's steps (claim, execution,
//! takeover, release) as awaited functions over a connection, written once.
//! The service's pool awaits them on its runtime (`pg_pool`, one
//! connection each or in batches); the synchronous store (`PgStore`, for
//! `idem_api`, the harness and the payouts) blocks on the very same
//! functions, as rust-postgres's blocking client blocks on tokio-postgres.
//!
//! One dead-connection policy for both: every statement here runs under a
//! client-side deadline ([`DEADLINE`]); a connection that outlived it, or
//! that the driver found closed, is not [`usable`], and whoever holds it
//! (the pool as it recycles, the store before its next step) replaces it
//! before another step runs on it. The step that found it dead answers
//! [`StoreError::Unavailable`]: nothing of it is known to have committed but
//! what the client's retry will find.

use super::{Ahead, BatchSql, ClaimArgs, ClaimRow, Hot, PlanArgs, Shape};
use crate::policy::Policy;
use crate::request::{AcctId, ScopedKey};
use crate::store::{Backoff, Claim, Executed, Execution, KeyRecord, Plan, Seen, StoreError};
use std::borrow::Cow;
use std::future::Future;
use std::time::Duration;
use tokio_postgres::Row;
use tokio_postgres::error::SqlState;

/// A connection the core runs steps on: the service's pool's (`C` the
/// driver's client itself) or the synchronous store's (`C` its blocking
/// client, which derefs to the driver's).
pub struct PgConn<C = tokio_postgres::Client> {
    pub(in crate::store) client: C,
    pub(in crate::store) sql: Hot,
    /// On a batching pool's connections: the statements of a batch (see
    /// `pg_pool::batch_sql`).
    pub(in crate::store) batch: Option<BatchSql>,
    pub(in crate::store) shape: Shape,
    /// What the last claim read on its way, for the execution under it.
    pub(in crate::store) ahead: Option<Ahead>,
    /// A statement outlived its deadline: the connection is replaced.
    pub(in crate::store) broken: bool,
    pub(in crate::store) policy: Cow<'static, Policy>,
}

/// A client the core awaits statements on: the driver's, or one that holds it.
pub trait Driver {
    fn driver(&self) -> &tokio_postgres::Client;
    fn driver_mut(&mut self) -> &mut tokio_postgres::Client;
}

impl Driver for tokio_postgres::Client {
    fn driver(&self) -> &tokio_postgres::Client {
        self
    }
    fn driver_mut(&mut self) -> &mut tokio_postgres::Client {
        self
    }
}

/// Whether steps may run on `conn`: no statement outlived its deadline on
/// it and the driver has not found it closed.
pub(in crate::store) fn usable<C: Driver>(conn: &PgConn<C>) -> bool {
    !(conn.broken || conn.client.driver().is_closed())
}

/// The statements of a request's steps, prepared on `client`.
pub(in crate::store) async fn prepare_hot(
    client: &tokio_postgres::Client,
    shape: &Shape,
) -> Result<Hot, tokio_postgres::Error> {
    let mut prepared = Vec::new();
    for sql in Hot::texts(shape) {
        prepared.push(client.prepare(&sql).await?);
    }
    Ok(Hot::of(prepared.try_into().unwrap_or_else(|_| unreachable!("seven texts, seven statements"))))
}

/// How long the client waits for any one statement: longer than the server
/// lets it run, so a deadline here means the server stopped answering.
pub(in crate::store) const DEADLINE: Duration =
    Duration::from_millis(super::STATEMENT_TIMEOUT_MS as u64 + 1_000);

/// `statement`'s answer, or [`StoreError::Unavailable`] past the deadline
/// (and `broken` set: the pool then drops the connection).
pub(in crate::store) async fn deadline<T>(
    broken: &mut bool,
    statement: impl Future<Output = Result<T, tokio_postgres::Error>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout(DEADLINE, statement).await {
        Ok(answer) => answer.map_err(super::pg),
        Err(_) => {
            *broken = true;
            Err(StoreError::Unavailable(format!("PostgreSQL did not answer within {DEADLINE:?}")))
        }
    }
}

/// Waits [`Backoff`]'s next pause before a conflict is run again; past the
/// busy budget, [`StoreError::Busy`].
async fn pause(backoff: &mut Backoff) -> Result<(), StoreError> {
    match backoff.pause() {
        Some(pause) => {
            tokio::time::sleep(pause).await;
            Ok(())
        }
        None => Err(StoreError::Busy),
    }
}

/// How a request's two statements, the claim and the execution, reach
/// PostgreSQL: on the request's own connection ([`PgConn`]), or in a batch
/// with other requests' (`pg_pool::Batched`). The steps around them, the same
/// whichever way they travel, are written once over it.
pub(in crate::store) trait Route {
    /// The client of the connections it lends ([`Route::conn`]).
    type Client: Driver;
    fn shape(&self) -> &Shape;
    fn policy(&self) -> &Policy;
    /// What the last claim read on its way, for the execution under it.
    fn ahead(&mut self) -> &mut Option<Ahead>;
    /// The claim statement's row.
    async fn claim_row(&mut self, args: &ClaimArgs<'_>) -> Result<Row, StoreError>;
    /// The execution statement's row.
    async fn execute_row(&mut self, args: &PlanArgs<'_>) -> Result<Row, StoreError>;
    /// A connection for the rest: re-reads, takeovers, releases.
    async fn conn(&mut self) -> Result<&mut PgConn<Self::Client>, StoreError>;
}

impl<C: Driver> Route for PgConn<C> {
    type Client = C;

    fn shape(&self) -> &Shape {
        &self.shape
    }

    fn policy(&self) -> &Policy {
        &self.policy
    }

    fn ahead(&mut self) -> &mut Option<Ahead> {
        &mut self.ahead
    }

    async fn claim_row(&mut self, args: &ClaimArgs<'_>) -> Result<Row, StoreError> {
        deadline(&mut self.broken, self.client.driver().query_one(&self.sql.claim, &args.params())).await
    }

    async fn execute_row(&mut self, args: &PlanArgs<'_>) -> Result<Row, StoreError> {
        deadline(&mut self.broken, self.client.driver().query_one(&self.sql.execute, &args.params())).await
    }

    async fn conn(&mut self) -> Result<&mut PgConn<C>, StoreError> {
        Ok(self)
    }
}

impl<C: Driver> PgConn<C> {
    /// The key, committed by a racer after the claim statement's snapshot.
    async fn read_raced(&mut self, key: &ScopedKey) -> Result<KeyRecord, StoreError> {
        let k: [&(dyn tokio_postgres::types::ToSql + Sync); 3] =
            [&key.client_id, &key.endpoint, &key.idem_key];
        let row = deadline(&mut self.broken, self.client.driver().query_opt(&self.sql.read_key, &k)).await?;
        row.as_ref().map(super::record).transpose()?.ok_or(StoreError::Conflict)
    }

    /// What an execution decides on, read afresh (plain reads, no lock).
    async fn read_seen(&mut self, x: &Execution<'_>) -> Result<Seen, StoreError> {
        let ([src, dst], k) = (super::seen_args(&self.shape, x), x.key);
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 5] =
            [&k.client_id, &k.endpoint, &k.idem_key, &src, &dst];
        let read = self.client.driver().query_one(&self.sql.seen, &params);
        super::seen_of(&deadline(&mut self.broken, read).await?, &self.shape)
    }

    /// One takeover: the row locked `NOWAIT`, then the compare-and-set, its
    /// own transaction, all of it under one [`DEADLINE`].
    async fn replace_once(
        &mut self,
        key: &ScopedKey,
        seen: &KeyRecord,
        claim: &Claim,
    ) -> Result<bool, StoreError> {
        let takeover = takeover(self.client.driver_mut(), &self.sql, &self.shape, key, seen, claim);
        deadline(&mut self.broken, takeover).await
    }

    pub(in crate::store) async fn release_once(
        &mut self,
        key: &ScopedKey,
        token: &str,
    ) -> Result<bool, StoreError> {
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] =
            [&key.client_id, &key.endpoint, &key.idem_key, &token];
        let release = self.client.driver().execute(&self.sql.release, &params);
        Ok(deadline(&mut self.broken, release).await? == 1)
    }
}

/// [`PgConn::replace_once`]'s statements.
async fn takeover(
    client: &mut tokio_postgres::Client,
    sql: &Hot,
    shape: &Shape,
    key: &ScopedKey,
    seen: &KeyRecord,
    claim: &Claim,
) -> Result<bool, tokio_postgres::Error> {
    let state = seen.state.name();
    let tx = client.transaction().await?;
    tx.batch_execute("SET LOCAL synchronous_commit = off").await?;
    match tx.query_opt(&sql.lock_key_nowait, &[&key.client_id, &key.endpoint, &key.idem_key]).await {
        Ok(Some(_)) => {}
        Ok(None) => return Ok(false),
        // locked: its execution is running, so the key is in flight
        Err(e) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => return Ok(false),
        Err(e) => return Err(e),
    }
    // the claim's own arguments, then the version seen
    let claimed = ClaimArgs::new(shape, key, claim, None);
    let [c0, c1, c2, c3, c4, c5, c6, ..] = claimed.params();
    let params = [c0, c1, c2, c3, c4, c5, c6, &seen.token, &state];
    let replaced = tx.execute(&sql.replace_claim, &params).await?;
    tx.commit().await?;
    Ok(replaced == 1)
}

/// One claim statement: `Ok(Err(accounts))` if the key is ours now.
async fn claim_once(
    route: &mut impl Route,
    key: &ScopedKey,
    claim: &Claim,
    args: &ClaimArgs<'_>,
) -> Result<Result<KeyRecord, [Option<super::Account>; 2]>, StoreError> {
    let row = route.claim_row(args).await?;
    match super::claim_row(&row, route.shape(), claim)? {
        ClaimRow::Mine(read) => Ok(Err(read)),
        ClaimRow::Existing(rec) => Ok(Ok(rec)),
        ClaimRow::Raced => route.conn().await?.read_raced(key).await.map(Ok),
    }
}

/// One execution: decide on `seen` (or on a fresh plain read) and write
/// the plan in one statement.
async fn execute_once(
    route: &mut impl Route,
    x: &Execution<'_>,
    seen: Option<Seen>,
    plan: &mut impl FnMut(&Seen) -> Plan,
    crash: &mut impl FnMut() -> bool,
) -> Result<Executed, StoreError> {
    let seen = match seen {
        Some(seen) => seen,
        None => route.conn().await?.read_seen(x).await?,
    };
    let planned = plan(&seen);
    let Some(args) = PlanArgs::new(route.shape(), x, &planned) else { return Ok(Executed::Nothing) };
    // nothing is written yet: a crash here leaves what one before the commit does
    if crash() {
        return Ok(Executed::Crashed);
    }
    let row = route.execute_row(&args).await?;
    super::plan_row(&row, route.shape(), &planned).map(Executed::Completed)
}

pub(in crate::store) async fn claim(
    route: &mut impl Route,
    key: &ScopedKey,
    claim: &Claim,
    accounts: Option<[&AcctId; 2]>,
) -> Result<Option<KeyRecord>, StoreError> {
    *route.ahead() = None;
    let args = ClaimArgs::new(route.shape(), key, claim, accounts);
    let mut backoff = Backoff::new(route.policy());
    loop {
        match claim_once(route, key, claim, &args).await {
            Err(StoreError::Conflict) => pause(&mut backoff).await?,
            Err(e) => return Err(e),
            Ok(Ok(existing)) => return Ok(Some(existing)),
            Ok(Err(read)) => {
                *route.ahead() = accounts.map(|ids| Ahead::new(key, claim, ids, read));
                return Ok(None);
            }
        }
    }
}

pub(in crate::store) async fn replace_claim(
    route: &mut impl Route,
    key: &ScopedKey,
    seen: &KeyRecord,
    claim: &Claim,
) -> Result<bool, StoreError> {
    let mut backoff = Backoff::new(route.policy());
    loop {
        match route.conn().await?.replace_once(key, seen, claim).await {
            Err(StoreError::Conflict) => pause(&mut backoff).await?,
            other => return other,
        }
    }
}

pub(in crate::store) async fn execute(
    route: &mut impl Route,
    x: Execution<'_>,
    plan: &mut impl FnMut(&Seen) -> Plan,
    crash: &mut impl FnMut() -> bool,
) -> Result<Executed, StoreError> {
    let mut seen = Ahead::for_execution(route.ahead().take(), &x);
    let mut backoff = Backoff::new(route.policy());
    loop {
        match execute_once(route, &x, seen.take(), plan, crash).await {
            Err(StoreError::Conflict) => pause(&mut backoff).await?,
            other => return other,
        }
    }
}

/// The steps of [`Route`]s, each a thin call of the one version above.
macro_rules! steps_of_route {
    ($($t:ty),*) => {$(
        impl $crate::store::KeySteps for $t {
            async fn claim(
                &mut self,
                key: &$crate::request::ScopedKey,
                claim: &$crate::store::Claim,
                accounts: Option<[&$crate::request::AcctId; 2]>,
            ) -> Result<Option<$crate::store::KeyRecord>, $crate::store::StoreError> {
                $crate::store::pg::steps::claim(self, key, claim, accounts).await
            }

            async fn replace_claim(
                &mut self,
                key: &$crate::request::ScopedKey,
                seen: &$crate::store::KeyRecord,
                claim: &$crate::store::Claim,
            ) -> Result<bool, $crate::store::StoreError> {
                $crate::store::pg::steps::replace_claim(self, key, seen, claim).await
            }

            async fn release(&mut self, key: &$crate::request::ScopedKey, token: &str) -> Result<bool, $crate::store::StoreError> {
                $crate::store::pg::Route::conn(self).await?.release_once(key, token).await
            }
        }

        impl $crate::store::Steps for $t {
            async fn execute(
                &mut self,
                x: $crate::store::Execution<'_>,
                plan: &mut impl FnMut(&$crate::store::Seen) -> $crate::store::Plan,
                crash: &mut impl FnMut() -> bool,
            ) -> Result<$crate::store::Executed, $crate::store::StoreError> {
                $crate::store::pg::steps::execute(self, x, plan, crash).await
            }
        }
    )*};
}
pub(in crate::store) use steps_of_route;
steps_of_route!(PgConn);
