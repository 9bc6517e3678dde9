//! The PostgreSQL store as `idem serve` runs a request on it: tokio-postgres
//! connections awaited on the service's own runtime, in a deadpool pool, so
//! no thread waits on a socket. A request's steps ([`super::Steps`]) run
//! here, the claim and the execution one statement each; the statements,
//! their arguments and the reading of their rows are the synchronous
//! store's (`pg.rs`), which still runs everything else (payouts, reads,
//! the schema).
//!
//! Every statement has a deadline on the client side too: a server that is
//! paused rather than gone keeps acknowledging at the TCP level, so only a
//! deadline here frees the request; the connection is then dropped from the
//! pool (its state is unknown) and the answer is 503 `unavailable`.

use super::pg::{self, Ahead, ClaimArgs, ClaimRow, Hot, PgStore, PlanArgs, Shape};
use super::reach::{Connector, Ready};
use super::{Backoff, Claim, Executed, Execution, KeyRecord, Plan, Seen, StoreError};
use super::{KeySteps, Steps};
use crate::policy::Policy;
use crate::request::{AcctId, ScopedKey};
use deadpool::managed;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio_postgres::error::SqlState;
use tokio_postgres::{Client, Row};

mod batch;
use batch::BatchSql;
pub use batch::{Batched, Batcher};

/// The pool the service takes a connection from for each transfer.
#[derive(Clone)]
pub struct Pool(managed::Pool<Manager>);

/// A connection taken from the [`Pool`]; it goes back when dropped.
pub type Pooled = managed::Object<Manager>;

impl Pool {
    /// A connection, waited for at most the busy budget (then `Busy`); if
    /// none could be made, the database's error (`Unavailable` when it is
    /// away).
    pub async fn get(&self) -> Result<Pooled, StoreError> {
        self.0.get().await.map_err(|e| match e {
            managed::PoolError::Timeout(_) => StoreError::Busy,
            managed::PoolError::Backend(e) => e,
            e => StoreError::Backend(format!("connection pool: {e}").into()),
        })
    }

    /// The most connections it makes.
    pub fn max_size(&self) -> usize {
        self.0.status().max_size
    }

    /// Whether every connection is taken and no more may be made.
    pub fn saturated(&self) -> bool {
        let status = self.0.status();
        status.available == 0 && status.size >= status.max_size
    }
}

/// Makes and keeps the pool's connections (`reach::Connector`).
pub type Manager = Connector<Prepared>;

/// Makes a pool connection ready for a request's steps: the session set,
/// the statements prepared.
pub struct Prepared {
    shape: Shape,
    policy: &'static Policy,
    /// Whether the connections also run batches ([`Batcher`]).
    batches: bool,
    /// Connections that found a batch function not idem's at its name.
    pub(crate) refused: AtomicU64,
}

impl Manager {
    /// The connections of `store`'s database: `store` (synchronous, already
    /// connected) has made and checked the schema and knows its shape.
    pub fn new(spec: &str, store: &PgStore, policy: &'static Policy) -> Result<Manager, StoreError> {
        let ready =
            Prepared { shape: store.shape().clone(), policy, batches: false, refused: AtomicU64::new(0) };
        Connector::with(spec, policy, ready)
    }

    /// The same, whose connections also run [`Batcher`]'s batches (the
    /// first of them to find the batch's function missing makes it:
    /// `pg::BatchFunction`).
    pub fn batching(mut self) -> Manager {
        self.ready.batches = true;
        self
    }

    /// A pool of at most `size` connections; a request waits for one at
    /// most the busy budget (then 503 `busy`).
    pub fn pool(self, size: usize) -> Result<Pool, StoreError> {
        let wait = Duration::from_millis(u64::from(self.ready.policy.busy_timeout_ms));
        self.pool_of(size, wait).map(Pool)
    }
}

impl Ready for Prepared {
    type Conn = PgConn;

    async fn ready(&self, mut client: Client) -> Result<PgConn, tokio_postgres::Error> {
        client.batch_execute(&pg::session_sql(self.policy)).await?;
        let mut prepared = Vec::new();
        for sql in Hot::texts(&self.shape) {
            prepared.push(client.prepare(&sql).await?);
        }
        let sql =
            Hot::of(prepared.try_into().unwrap_or_else(|_| unreachable!("seven texts, seven statements")));
        let batch = match self.batches {
            false => None,
            true => batch_sql(&mut client, &self.shape, &self.refused).await?,
        };
        let shape = self.shape.clone();
        Ok(PgConn { client, sql, batch, shape, ahead: None, broken: false, policy: self.policy })
    }

    fn usable(&self, conn: &PgConn) -> bool {
        !(conn.broken || conn.client.is_closed())
    }
}

/// A batching connection's statements. The service made the batch's
/// function as it started (`PgStore::make_batch_function`); one dropped
/// since is made again, under the schema's lock, and where the role may
/// not, `None`: the connection's requests then go out alone. So too when
/// the function at its name is not idem's (`pg::Found::Foreign`): it is
/// never called, and `refused` counts it.
async fn batch_sql(
    client: &mut Client,
    shape: &Shape,
    refused: &AtomicU64,
) -> Result<Option<BatchSql>, tokio_postgres::Error> {
    let function = pg::BatchFunction::of(shape);
    let row = client.query_opt(pg::BatchFunction::TRUST, &function.trust_args()).await?;
    match function.found(row.as_ref()) {
        pg::Found::Ours => {}
        pg::Found::Missing => {
            let tx = client.transaction().await?;
            tx.execute("SELECT pg_advisory_xact_lock($1)", &[&pg::SCHEMA_LOCK]).await?;
            // a refusal rolls the transaction back as it is dropped
            if tx.batch_execute(&function.create).await.is_err() {
                return Ok(None);
            }
            tx.commit().await?;
        }
        pg::Found::Foreign(_) => {
            refused.fetch_add(1, Ordering::Relaxed);
            return Ok(None);
        }
    }
    let executions = client.prepare(&function.call).await?;
    let claims = client.prepare(&pg::claim_batch_sql(shape)).await?;
    Ok(Some(BatchSql { claims, executions }))
}

/// One connection of the pool.
pub struct PgConn {
    client: Client,
    sql: Hot,
    /// With [`Manager::batching`]: the statements of a batch (see
    /// [`batch_sql`]).
    batch: Option<BatchSql>,
    shape: Shape,
    /// What the last claim read on its way, for the execution under it.
    ahead: Option<Ahead>,
    /// A statement outlived its deadline: the pool drops this connection.
    broken: bool,
    policy: &'static Policy,
}

/// How long the client waits for any one statement: longer than the server
/// lets it run, so a deadline here means the server stopped answering.
const DEADLINE: Duration = Duration::from_millis(pg::STATEMENT_TIMEOUT_MS as u64 + 1_000);

/// `statement`'s answer, or [`StoreError::Unavailable`] past the deadline
/// (and `broken` set: the pool then drops the connection).
async fn deadline<T>(
    broken: &mut bool,
    statement: impl Future<Output = Result<T, tokio_postgres::Error>>,
) -> Result<T, StoreError> {
    match tokio::time::timeout(DEADLINE, statement).await {
        Ok(answer) => answer.map_err(pg::pg),
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
/// with other requests' ([`Batched`]). The steps around them, the same
/// whichever way they travel, are written once over it.
trait Route {
    fn shape(&self) -> &Shape;
    fn policy(&self) -> &'static Policy;
    /// What the last claim read on its way, for the execution under it.
    fn ahead(&mut self) -> &mut Option<Ahead>;
    /// The claim statement's row.
    async fn claim_row(&mut self, args: &ClaimArgs<'_>) -> Result<Row, StoreError>;
    /// The execution statement's row.
    async fn execute_row(&mut self, args: &PlanArgs<'_>) -> Result<Row, StoreError>;
    /// A connection for the rest: re-reads, takeovers, releases.
    async fn conn(&mut self) -> Result<&mut PgConn, StoreError>;
}

impl Route for PgConn {
    fn shape(&self) -> &Shape {
        &self.shape
    }

    fn policy(&self) -> &'static Policy {
        self.policy
    }

    fn ahead(&mut self) -> &mut Option<Ahead> {
        &mut self.ahead
    }

    async fn claim_row(&mut self, args: &ClaimArgs<'_>) -> Result<Row, StoreError> {
        deadline(&mut self.broken, self.client.query_one(&self.sql.claim, &args.params())).await
    }

    async fn execute_row(&mut self, args: &PlanArgs<'_>) -> Result<Row, StoreError> {
        deadline(&mut self.broken, self.client.query_one(&self.sql.execute, &args.params())).await
    }

    async fn conn(&mut self) -> Result<&mut PgConn, StoreError> {
        Ok(self)
    }
}

impl PgConn {
    /// The key, committed by a racer after the claim statement's snapshot.
    async fn read_raced(&mut self, key: &ScopedKey) -> Result<KeyRecord, StoreError> {
        let k: [&(dyn tokio_postgres::types::ToSql + Sync); 3] =
            [&key.client_id, &key.endpoint, &key.idem_key];
        let row = deadline(&mut self.broken, self.client.query_opt(&self.sql.read_key, &k)).await?;
        row.as_ref().map(pg::record).transpose()?.ok_or(StoreError::Conflict)
    }

    /// What an execution decides on, read afresh (plain reads, no lock).
    async fn read_seen(&mut self, x: &Execution<'_>) -> Result<Seen, StoreError> {
        let ([src, dst], k) = (pg::seen_args(&self.shape, x), x.key);
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 5] =
            [&k.client_id, &k.endpoint, &k.idem_key, &src, &dst];
        let read = self.client.query_one(&self.sql.seen, &params);
        pg::seen_of(&deadline(&mut self.broken, read).await?, &self.shape)
    }

    /// One takeover: the row locked `NOWAIT`, then the compare-and-set.
    async fn replace_once(
        &mut self,
        key: &ScopedKey,
        seen: &KeyRecord,
        claim: &Claim,
    ) -> Result<bool, StoreError> {
        let state = seen.state.name();
        let tx = self.client.transaction().await.map_err(pg::pg)?;
        tx.batch_execute("SET LOCAL synchronous_commit = off").await.map_err(pg::pg)?;
        match tx.query_opt(&self.sql.lock_key_nowait, &[&key.client_id, &key.endpoint, &key.idem_key]).await {
            Ok(Some(_)) => {}
            Ok(None) => return Ok(false),
            // locked: its execution is running, so the key is in flight
            Err(e) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => return Ok(false),
            Err(e) => return Err(pg::pg(e)),
        }
        // the claim's own arguments, then the version seen
        let claimed = ClaimArgs::new(&self.shape, key, claim, None);
        let [c0, c1, c2, c3, c4, c5, c6, ..] = claimed.params();
        let params = [c0, c1, c2, c3, c4, c5, c6, &seen.token, &state];
        let replaced = tx.execute(&self.sql.replace_claim, &params).await.map_err(pg::pg)?;
        tx.commit().await.map_err(pg::pg)?;
        Ok(replaced == 1)
    }

    async fn release_once(&mut self, key: &ScopedKey, token: &str) -> Result<bool, StoreError> {
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 4] =
            [&key.client_id, &key.endpoint, &key.idem_key, &token];
        let release = self.client.execute(&self.sql.release, &params);
        Ok(deadline(&mut self.broken, release).await? == 1)
    }
}

/// One claim statement: `Ok(Err(accounts))` if the key is ours now.
async fn claim_once(
    route: &mut impl Route,
    key: &ScopedKey,
    claim: &Claim,
    args: &ClaimArgs<'_>,
) -> Result<Result<KeyRecord, [Option<super::Account>; 2]>, StoreError> {
    let row = route.claim_row(args).await?;
    match pg::claim_row(&row, route.shape(), claim)? {
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
    pg::plan_row(&row, route.shape(), &planned).map(Executed::Completed)
}

async fn claim(
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

async fn replace_claim(
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

async fn execute(
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
        impl KeySteps for $t {
            async fn claim(
                &mut self,
                key: &ScopedKey,
                claim: &Claim,
                accounts: Option<[&AcctId; 2]>,
            ) -> Result<Option<KeyRecord>, StoreError> {
                self::claim(self, key, claim, accounts).await
            }

            async fn replace_claim(
                &mut self,
                key: &ScopedKey,
                seen: &KeyRecord,
                claim: &Claim,
            ) -> Result<bool, StoreError> {
                self::replace_claim(self, key, seen, claim).await
            }

            async fn release(&mut self, key: &ScopedKey, token: &str) -> Result<bool, StoreError> {
                self.conn().await?.release_once(key, token).await
            }
        }

        impl Steps for $t {
            async fn execute(
                &mut self,
                x: Execution<'_>,
                plan: &mut impl FnMut(&Seen) -> Plan,
                crash: &mut impl FnMut() -> bool,
            ) -> Result<Executed, StoreError> {
                self::execute(self, x, plan, crash).await
            }
        }
    )*};
}
steps_of_route!(PgConn, Batched<'_>);
