//! The connections the layer runs its requests on: its own, made from a
//! connection string, or the application's own (a SQLite connection it
//! shares, a way of making PostgreSQL connections it already has, TLS and
//! all, its deadpool-postgres pool, its sqlx pool), so that the layer opens
//! nothing beside the application's pool.

use super::{Idempotency, Store};
use crate::embed::Keys;
use axum::http::{HeaderMap, header, request::Parts};
use std::sync::Arc;
use std::time::Duration;
#[cfg(feature = "sqlite")]
use tokio::sync::Mutex;
#[cfg(feature = "postgres")]
use {
    super::conn::{Lease, Lender},
    crate::store::StoreError,
    crate::store::reach::{self, Make},
    deadpool::managed,
    std::future::Future,
    std::ops::{Deref, DerefMut},
    tokio_postgres::Client,
};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The layer's own PostgreSQL pool: idem's one pool manager
/// (`reach::Connector`) over the application's way of connecting, its
/// connections handed out as made (their session the application's) and
/// taken back only if not closed (one whose transaction a request left open
/// is never returned: `Held`'s drop).
#[cfg(feature = "postgres")]
struct AsMade;

/// A connection of the layer's own pool.
#[cfg(feature = "postgres")]
struct Own(Client);

#[cfg(feature = "postgres")]
impl Deref for Own {
    type Target = Client;
    fn deref(&self) -> &Client {
        &self.0
    }
}

#[cfg(feature = "postgres")]
impl DerefMut for Own {
    fn deref_mut(&mut self) -> &mut Client {
        &mut self.0
    }
}

#[cfg(feature = "postgres")]
impl reach::Ready for AsMade {
    type Conn = Own;

    async fn ready(&self, client: Client) -> Result<Own, tokio_postgres::Error> {
        Ok(Own(client))
    }

    fn usable(&self, conn: &Own) -> bool {
        !conn.is_closed()
    }
}

impl Idempotency {
    /// The middleware's state over `db`: a PostgreSQL connection string
    /// (libpq `key=value` or a URL; at most `connections` at once) or else a
    /// SQLite file. Builds the key table if it is not there. `who` names the
    /// client of a request from its headers, as the service authenticates it.
    /// To lend the application's own connections instead, see
    /// `Idempotency::on_postgres`, `on_deadpool`, `on_sqlite` and the
    /// `on_sqlx_*` pair (each built with its store's feature).
    // on SQLite alone, `connections` has nothing to bound: one connection
    #[cfg_attr(not(feature = "postgres"), allow(unused_variables))]
    pub async fn connect(
        db: &str,
        keys: Keys,
        connections: usize,
        who: impl Fn(&HeaderMap) -> Option<String> + Send + Sync + 'static,
    ) -> Result<Idempotency, BoxError> {
        match crate::store::Db::parse(db) {
            #[cfg(feature = "postgres")]
            crate::store::Db::Postgres(spec) => {
                let config = reach::configure(&spec, crate::policy::Policy::embedded())?;
                // a new connection may try every host, each for its start-up deadline
                let create = reach::create_deadline(&config);
                let config = Arc::new((config, spec));
                let make: Box<Make> = Box::new(move || {
                    let config = config.clone();
                    Box::pin(async move { reach::connect(&config.0, &config.1).await.map_err(reach::away) })
                });
                Idempotency::on_pool(make, create, keys, connections, who).await
            }
            #[cfg(feature = "sqlite")]
            crate::store::Db::Sqlite(path) => {
                let conn = rusqlite::Connection::open(path)?;
                conn.busy_timeout(std::time::Duration::from_secs(5))?;
                conn.pragma_update(None, "journal_mode", "WAL")?;
                Idempotency::on_sqlite(Arc::new(Mutex::new(conn)), keys, who).await
            }
            #[allow(unreachable_patterns)] // with both stores built, none is left
            _ => {
                Err("this build of idem has no store for that database (features `postgres`, `sqlite`)"
                    .into())
            }
        }
    }

    /// The middleware's state on the application's own PostgreSQL
    /// connections: `make` connects one as the application does (its TLS,
    /// its session settings) and spawns its connection task; the layer
    /// keeps at most `connections` of them in a pool of its own, and builds
    /// the key table if it is not there.
    ///
    /// ```no_run
    /// # use idem::embed::{Keys, layer::Idempotency};
    /// # async fn setup() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// let make = || async {
    ///     let (client, connection) =
    ///         tokio_postgres::connect("host=/run/postgresql dbname=app", tokio_postgres::NoTls).await?;
    ///     tokio::spawn(connection);
    ///     Ok::<_, tokio_postgres::Error>(client)
    /// };
    /// let idem = Idempotency::on_postgres(make, Keys::new("app_")?, 16, |headers| {
    ///     headers.get("x-client").and_then(|v| v.to_str().ok()).map(String::from)
    /// })
    /// .await?;
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "postgres")]
    pub async fn on_postgres<F, Fut, E>(
        make: F,
        keys: Keys,
        connections: usize,
        who: impl Fn(&HeaderMap) -> Option<String> + Send + Sync + 'static,
    ) -> Result<Idempotency, BoxError>
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Client, E>> + Send + 'static,
        E: std::fmt::Display + 'static,
    {
        // the application's own errors: the database is away, 503
        let make: Box<Make> = Box::new(move || {
            let made = make();
            Box::pin(async move { made.await.map_err(|e| StoreError::Unavailable(e.to_string())) })
        });
        Idempotency::on_pool(make, Duration::from_secs(10), keys, connections, who).await
    }

    /// A pool of at most `connections` that `make` makes, each within
    /// `create`, and the key table built on its first.
    #[cfg(feature = "postgres")]
    async fn on_pool(
        make: Box<Make>,
        create: Duration,
        keys: Keys,
        connections: usize,
        who: impl Fn(&HeaderMap) -> Option<String> + Send + Sync + 'static,
    ) -> Result<Idempotency, BoxError> {
        let wait = Duration::from_secs(5);
        let pool = reach::Connector::made(make, create, AsMade).pool_of(connections, wait)?;
        Idempotency::on_deadpool(pool, keys, who).await
    }

    /// The middleware's state on the application's own deadpool pool of
    /// PostgreSQL connections: a `deadpool_postgres::Pool` (deadpool-postgres
    /// 0.14, on deadpool 0.13), or any deadpool pool whose objects deref to
    /// a `tokio_postgres::Client`. A request holds one of its connections
    /// from its claim to its commit; one whose transaction a request left
    /// open (its handler panicked) is closed, never returned to the pool.
    /// Builds the key table if it is not there.
    ///
    /// ```no_run
    /// # use idem::embed::{Keys, layer::Idempotency};
    /// # async fn setup(pool: deadpool_postgres::Pool) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// // `pool`: the one the application's other routes use
    /// let idem = Idempotency::on_deadpool(pool.clone(), Keys::new("app_")?, |headers| {
    ///     headers.get("x-client").and_then(|v| v.to_str().ok()).map(String::from)
    /// })
    /// .await?;
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "postgres")]
    pub async fn on_deadpool<M>(
        pool: managed::Pool<M>,
        keys: Keys,
        who: impl Fn(&HeaderMap) -> Option<String> + Send + Sync + 'static,
    ) -> Result<Idempotency, BoxError>
    where
        M: managed::Manager + 'static,
        M::Type: DerefMut<Target = Client> + Send + Sync,
        M::Error: std::fmt::Display,
    {
        let mut first = pool.get().await.map_err(|e| e.to_string())?;
        keys.migrate_pg(&mut first).await?;
        drop(first);
        let lend: Arc<Lender> = Arc::new(move || {
            let pool = pool.clone();
            Box::pin(async move { Some(Box::new(pool.get().await.ok()?) as Box<dyn Lease>) })
        });
        Ok(Idempotency::with(Store::Pg(lend), keys, who))
    }

    /// The middleware's state on the application's own sqlx `PgPool`: a
    /// request holds one of its connections from its claim to its commit
    /// (the handler reaches it with [`Tx::sqlx_postgres`](super::Tx::sqlx_postgres)).
    /// Builds the key table if it is not there.
    ///
    /// ```no_run
    /// # use idem::embed::{Keys, layer::Idempotency};
    /// # async fn setup() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// let pool = sqlx::PgPool::connect("postgres:///shop").await?;
    /// let idem = Idempotency::on_sqlx_postgres(pool.clone(), Keys::new("app_")?, |headers| {
    ///     headers.get("x-client").and_then(|v| v.to_str().ok()).map(String::from)
    /// })
    /// .await?;
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "sqlx-postgres")]
    pub async fn on_sqlx_postgres(
        pool: sqlx::PgPool,
        keys: Keys,
        who: impl Fn(&HeaderMap) -> Option<String> + Send + Sync + 'static,
    ) -> Result<Idempotency, BoxError> {
        keys.migrate_sqlx_postgres(&pool).await?;
        Ok(Idempotency::with(Store::SqlxPg(pool), keys, who))
    }

    /// The middleware's state on the application's own sqlx `SqlitePool`
    /// (as `Idempotency::on_sqlx_postgres` does on PostgreSQL; the handler reaches its
    /// connection with [`Tx::sqlx_sqlite`](super::Tx::sqlx_sqlite)). Each
    /// request's transaction is `BEGIN IMMEDIATE`, SQLite's one writer: the
    /// layer's requests wait for it in turn, up to
    /// [`Idempotency::max_wait`] (writes of the application's own outside
    /// the layer wait as SQLite makes them, up to the pool's `busy_timeout`).
    ///
    /// ```
    /// # use idem::embed::{Keys, layer::Idempotency};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// let pool = sqlx::SqlitePool::connect("sqlite::memory:").await?;
    /// let idem = Idempotency::on_sqlx_sqlite(pool.clone(), Keys::new("app_")?, |_| Some("c1".into())).await?;
    /// let kept: i64 = sqlx::query_scalar("SELECT count(*) FROM app_idem_keys").fetch_one(&pool).await?;
    /// assert_eq!(kept, 0);
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "sqlx-sqlite")]
    pub async fn on_sqlx_sqlite(
        pool: sqlx::SqlitePool,
        keys: Keys,
        who: impl Fn(&HeaderMap) -> Option<String> + Send + Sync + 'static,
    ) -> Result<Idempotency, BoxError> {
        keys.migrate_sqlx_sqlite(&pool).await?;
        Ok(Idempotency::with(Store::SqlxLite(pool, Arc::default()), keys, who))
    }

    /// The middleware's state on the application's own SQLite connection,
    /// which its other routes lock too: a request holds it from its claim
    /// to its commit, so the application never sees a request's writes
    /// half done. Builds the key table if it is not there. The connection
    /// is the application's to configure (WAL, `busy_timeout`).
    ///
    /// ```
    /// # use idem::embed::{Keys, layer::Idempotency};
    /// # use std::sync::Arc;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    /// let db = Arc::new(tokio::sync::Mutex::new(rusqlite::Connection::open_in_memory()?));
    /// let idem = Idempotency::on_sqlite(db.clone(), Keys::new("app_")?, |_| Some("c1".into())).await?;
    /// // the application's own routes lock `db` as they always did
    /// let tables: i64 = db.lock().await.query_row("SELECT count(*) FROM app_idem_keys", [], |r| r.get(0))?;
    /// assert_eq!(tables, 0);
    /// # Ok(()) }
    /// ```
    #[cfg(feature = "sqlite")]
    pub async fn on_sqlite(
        conn: Arc<Mutex<rusqlite::Connection>>,
        keys: Keys,
        who: impl Fn(&HeaderMap) -> Option<String> + Send + Sync + 'static,
    ) -> Result<Idempotency, BoxError> {
        keys.migrate_sqlite(&*conn.lock().await)?;
        Ok(Idempotency::with(Store::Sqlite(conn), keys, who))
    }

    fn with(
        store: Store,
        keys: Keys,
        who: impl Fn(&HeaderMap) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        Idempotency {
            keys: Arc::new(keys),
            store,
            who: Arc::new(move |parts: &Parts| who(&parts.headers)),
            max_body: 64 * 1024,
            max_wait: Duration::from_secs(2),
            replayed_headers: vec![header::LOCATION],
            max_run: Duration::from_secs(30),
            keeps: Arc::new(|status| status.is_success()),
            key_optional: false,
            crash_before_commit: false,
            crash_after_call: false,
            outside: None,
            counters: Arc::default(),
        }
    }
}
