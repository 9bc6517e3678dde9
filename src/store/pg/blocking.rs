//! tokio-postgres, blocked on: the synchronous store's connection (for
//! `idem_api`, the harness, payouts, the reconciler and the schema). It is
//! the driver the service's pool and the library await, so idem speaks to
//! PostgreSQL through one driver, connects through one function
//! (`store::reach::connect`) and reads one error type. Each connection has a
//! runtime of its own on the calling thread: its socket is driven only
//! while a statement is waited for, so nothing runs behind the caller's
//! back (and the caller must not be on an async runtime's thread).

use super::StoreError;
use super::steps::DEADLINE;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio_postgres::types::ToSql;
use tokio_postgres::{Error, Row, Statement, ToStatement};

/// A connection to PostgreSQL that is called, not awaited.
pub struct Client {
    /// Shared with whoever blocks on the engine's core over this client
    /// (`PgStore`), which borrows the client as it does.
    runtime: Arc<tokio::runtime::Runtime>,
    inner: tokio_postgres::Client,
    /// A statement outlived [`DEADLINE`]: the server stopped answering, and
    /// what the connection's transaction did is not known. It is not used
    /// again ([`Client::is_closed`]).
    stalled: AtomicBool,
}

type Params<'a> = &'a [&'a (dyn ToSql + Sync)];

impl Client {
    /// A connection to `config`'s database (each host in turn, see
    /// `store::reach::connect`); errors never quote `spec`.
    pub(in crate::store) fn connect(
        config: &tokio_postgres::Config,
        spec: &str,
    ) -> Result<Client, StoreError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| StoreError::Backend(format!("cannot start a connection's runtime: {e}").into()))?;
        let inner = runtime.block_on(super::connect(config, spec))?;
        Ok(Client { runtime: Arc::new(runtime), inner, stalled: AtomicBool::new(false) })
    }

    /// The runtime the connection is driven on, to block on what awaits it.
    pub(in crate::store) fn runtime(&self) -> Arc<tokio::runtime::Runtime> {
        self.runtime.clone()
    }

    /// Drives the connection's task for a moment, so that what the server
    /// sent while nobody was blocked on it (a close, on a restart) is read
    /// and [`Client::is_closed`] says so.
    pub(in crate::store) fn settle(&self) {
        self.runtime.block_on(async {
            for _ in 0..2 {
                tokio::task::yield_now().await;
            }
        });
    }

    /// `future`'s answer, under the client-side deadline every statement
    /// of the engine has (as rust-postgres's blocking client times out on
    /// tokio-postgres): past it, the driver's timeout error, which
    /// `connect::lost` reads as a lost connection, and the connection is
    /// stalled.
    fn block<T>(&self, future: impl Future<Output = Result<T, Error>>) -> Result<T, Error> {
        self.runtime.block_on(async {
            tokio::time::timeout(DEADLINE, future).await.unwrap_or_else(|_| {
                self.stalled.store(true, Ordering::Relaxed);
                Err(Error::__private_api_timeout())
            })
        })
    }

    /// What `statements` do on the connection, awaited to their end (the key
    /// table's runners, `store::keys::pg`, written once for every face),
    /// under the deadline.
    pub(in crate::store) fn run<'c, T, F: Future<Output = Result<T, Error>>>(
        &'c mut self,
        statements: impl FnOnce(&'c tokio_postgres::Client) -> F,
    ) -> Result<T, Error> {
        let inner = &self.inner;
        self.block(statements(inner))
    }

    pub fn query<T: ?Sized + ToStatement>(
        &mut self,
        statement: &T,
        params: Params,
    ) -> Result<Vec<Row>, Error> {
        self.block(self.inner.query(statement, params))
    }

    pub fn query_one<T: ?Sized + ToStatement>(
        &mut self,
        statement: &T,
        params: Params,
    ) -> Result<Row, Error> {
        self.block(self.inner.query_one(statement, params))
    }

    pub fn query_opt<T: ?Sized + ToStatement>(
        &mut self,
        statement: &T,
        params: Params,
    ) -> Result<Option<Row>, Error> {
        self.block(self.inner.query_opt(statement, params))
    }

    pub fn execute<T: ?Sized + ToStatement>(&mut self, statement: &T, params: Params) -> Result<u64, Error> {
        self.block(self.inner.execute(statement, params))
    }

    pub fn batch_execute(&mut self, sql: &str) -> Result<(), Error> {
        self.block(self.inner.batch_execute(sql))
    }

    pub fn prepare(&mut self, sql: &str) -> Result<Statement, Error> {
        self.block(self.inner.prepare(sql))
    }

    /// Whether the connection is known to be gone (a statement on it
    /// found it closed) or stalled past the deadline.
    pub fn is_closed(&self) -> bool {
        self.inner.is_closed() || self.stalled.load(Ordering::Relaxed)
    }

    /// A transaction: `BEGIN` now; dropped without [`Transaction::commit`],
    /// it rolls back.
    pub fn transaction(&mut self) -> Result<Transaction<'_>, Error> {
        self.batch_execute("BEGIN")?;
        Ok(Transaction { client: self, open: true })
    }
}

/// The driver's client beneath: what the engine's core awaits.
impl super::steps::Driver for Client {
    fn driver(&self) -> &tokio_postgres::Client {
        &self.inner
    }
    fn driver_mut(&mut self) -> &mut tokio_postgres::Client {
        &mut self.inner
    }
}

/// A transaction on a [`Client`]: its statements are the client's.
pub struct Transaction<'a> {
    client: &'a mut Client,
    open: bool,
}

impl Transaction<'_> {
    pub fn commit(mut self) -> Result<(), Error> {
        self.open = false;
        self.client.batch_execute("COMMIT")
    }
}

impl std::ops::Deref for Transaction<'_> {
    type Target = Client;
    fn deref(&self) -> &Client {
        self.client
    }
}

impl std::ops::DerefMut for Transaction<'_> {
    fn deref_mut(&mut self) -> &mut Client {
        self.client
    }
}

impl Drop for Transaction<'_> {
    fn drop(&mut self) {
        // on a dead or stalled connection there is nothing to roll back
        if self.open && !self.client.is_closed() {
            let _ = self.client.batch_execute("ROLLBACK");
        }
    }
}
