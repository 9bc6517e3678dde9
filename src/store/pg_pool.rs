//! The PostgreSQL store as `idem serve` runs a request on it: tokio-postgres
//! connections awaited on the service's own runtime, in a deadpool pool, so
//! no thread waits on a socket. A request's steps ([`super::Steps`]) run
//! by the engine's one core (`pg::steps`), the claim and the execution one
//! statement each, as the synchronous store runs them blocking.
//!
//! Every statement has a deadline on the client side too: a server that is
//! paused rather than gone keeps acknowledging at the TCP level, so only a
//! deadline here frees the request; the connection is then dropped from the
//! pool (its state is unknown) and the answer is 503 `unavailable`.

use super::StoreError;
use super::pg::{self, PgStore, Shape};
use super::reach::{Connector, Ready};
use crate::policy::Policy;
use deadpool::managed;
use std::borrow::Cow;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio_postgres::Client;

mod batch;
pub use batch::{Batched, Batcher};
pub use pg::PgConn;
use pg::{BatchSql, Route, deadline};

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
        let sql = pg::prepare_hot(&client, &self.shape).await?;
        let batch = match self.batches {
            false => None,
            true => batch_sql(&mut client, &self.shape, &self.refused).await?,
        };
        let shape = self.shape.clone();
        let policy = Cow::Borrowed(self.policy);
        Ok(PgConn { client, sql, batch, shape, ahead: None, broken: false, policy })
    }

    fn usable(&self, conn: &PgConn) -> bool {
        pg::usable(conn)
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
    let claims = pg::claim_batch_sql(shape);
    Ok(Some(BatchSql { claims, executions }))
}
