//! Where the layer's requests run: a connection of one of the stores,
//! whose write transaction a request holds from its claim to its commit.
//! Each store's key steps are the library's (`embed::pg`, `embed::sqlite`,
//! `embed::sqlx`); this is only which of them a connection takes.

use super::Answer;
use crate::embed::Keys;
#[cfg(feature = "sqlx-sqlite")]
use crate::embed::sqlx::OnSqlxLite;
#[cfg(feature = "sqlx-postgres")]
use crate::embed::sqlx::OnSqlxPg;
use crate::request::{AcctId, ScopedKey};
use crate::store::keys::Kept;
use crate::store::{Claim, KeyRecord, KeySteps, StoreError};
use std::sync::Arc;
#[cfg(feature = "postgres")]
use {crate::embed::pg::OnPg, tokio_postgres::Client};
#[cfg(feature = "sqlite")]
use {crate::embed::sqlite::OnSqlite, tokio::sync::Mutex, tokio::sync::OwnedMutexGuard};

/// A PostgreSQL connection lent from a deadpool pool (the layer's own, or
/// the application's): its client, and how it is let go of with its
/// transaction open (closed, never returned to the pool).
#[cfg(feature = "postgres")]
pub(super) trait Lease: Send + Sync {
    fn client(&self) -> &Client;
    fn discard(self: Box<Self>);
}

#[cfg(feature = "postgres")]
impl<M> Lease for deadpool::managed::Object<M>
where
    M: deadpool::managed::Manager,
    M::Type: std::ops::Deref<Target = Client> + Send + Sync,
{
    fn client(&self) -> &Client {
        self
    }

    fn discard(self: Box<Self>) {
        drop(deadpool::managed::Object::take(*self));
    }
}

/// Lends a PostgreSQL connection, or `None` when none is to be had.
#[cfg(feature = "postgres")]
pub(super) type Lender =
    dyn Fn() -> std::pin::Pin<Box<dyn Future<Output = Option<Box<dyn Lease>>> + Send>> + Send + Sync;

/// Where the layer's connections come from.
#[derive(Clone)]
pub(super) enum Store {
    #[cfg(feature = "postgres")]
    Pg(Arc<Lender>),
    #[cfg(feature = "sqlite")]
    Sqlite(Arc<Mutex<rusqlite::Connection>>),
    /// The pool: a request's transaction is begun on it as it is lent.
    #[cfg(feature = "sqlx-postgres")]
    SqlxPg(sqlx::PgPool),
    /// The pool, and the layer's line for SQLite's one writer: requests
    /// wait in it in turn (SQLite's own busy wait lets a waiter lose to
    /// later ones, past any bound, while a slow handler holds the lock).
    #[cfg(feature = "sqlx-sqlite")]
    SqlxLite(sqlx::SqlitePool, Arc<tokio::sync::Mutex<()>>),
}

impl Store {
    /// A connection (on sqlx, its transaction begun), or `None` if the
    /// database failed.
    pub(super) async fn connection(&self) -> Option<Conn> {
        Some(match self {
            #[cfg(feature = "postgres")]
            Store::Pg(lend) => Conn::Pg(Some(lend().await?)),
            #[cfg(feature = "sqlite")]
            Store::Sqlite(conn) => Conn::Sqlite(conn.clone().lock_owned().await),
            #[cfg(feature = "sqlx-postgres")]
            Store::SqlxPg(pool) => Conn::SqlxPg(Some(pool.begin().await.ok()?)),
            #[cfg(feature = "sqlx-sqlite")]
            Store::SqlxLite(pool, line) => {
                let turn = line.clone().lock_owned().await;
                Conn::SqlxLite(Some(OnSqlxLite::begin(pool).await.ok()?), turn)
            }
        })
    }

    /// The key's committed row, by a plain read on a connection taken for
    /// it alone; `None` if there is none, or no answer could be had. A
    /// PostgreSQL claim is seen only once its transaction commits. On SQLite
    /// a request waits its turn for the one writer instead, so it never
    /// meets a key in flight, and nothing is read.
    // on SQLite alone, there is nothing to read
    #[cfg_attr(not(any(feature = "postgres", feature = "sqlx-postgres")), allow(unused_variables))]
    pub(super) async fn peek(&self, keys: &Keys, key: &ScopedKey) -> Option<(KeyRecord, Kept)> {
        match self {
            #[cfg(feature = "postgres")]
            Store::Pg(lend) => {
                let lease = lend().await?;
                let row =
                    crate::store::keys::pg::read(lease.client(), &keys.pg, crate::store::keys::who(key));
                let row = row.await.ok()??;
                let record = crate::store::keys::pg::record(&row, 0).ok()?;
                Some((record, crate::store::keys::pg::kept(&row)))
            }
            #[cfg(feature = "sqlx-postgres")]
            Store::SqlxPg(pool) => OnSqlxPg::peek(pool, keys, key).await.ok()?,
            #[allow(unreachable_patterns)] // SQLite's requests queue for the writer
            _ => None,
        }
    }
}

pub(super) enum Conn {
    // `None` only once discarded
    #[cfg(feature = "postgres")]
    Pg(Option<Box<dyn Lease>>),
    #[cfg(feature = "sqlite")]
    Sqlite(OwnedMutexGuard<rusqlite::Connection>),
    // sqlx's own transaction, begun with the connection; `None` once ended
    #[cfg(feature = "sqlx-postgres")]
    SqlxPg(Option<sqlx::Transaction<'static, sqlx::Postgres>>),
    // and the request's turn in the writers' line, held (never read) to its end
    #[cfg(feature = "sqlx-sqlite")]
    SqlxLite(
        Option<sqlx::Transaction<'static, sqlx::Sqlite>>,
        #[allow(dead_code)] tokio::sync::OwnedMutexGuard<()>,
    ),
}

/// A connection whose write transaction a request holds. Dropped with the
/// transaction still open (a handler that panicked, a runtime shutting
/// down), it ends it: SQLite rolls back at once; a tokio-postgres
/// connection is closed, never returned to its pool, and the server rolls
/// its transaction back as it goes; sqlx's transaction rolls back before
/// its connection is used again. No connection is used mid-transaction by
/// another request.
pub(super) struct Held {
    pub(super) conn: Conn,
    pub(super) keys: Arc<Keys>,
    /// The media type and headers stored with the answer of the key's
    /// row, if the claim found one.
    pub(super) kept: Kept,
    /// Whether the transaction may still be open: set until a COMMIT or
    /// ROLLBACK went through.
    pub(super) open: bool,
    /// The outside call the request may declare, and the one it declared.
    pub(super) call: Slot,
}

impl Drop for Held {
    fn drop(&mut self) {
        if !self.open {
            return;
        }
        match &mut self.conn {
            #[cfg(feature = "postgres")]
            Conn::Pg(c) => drop(c.take().map(Lease::discard)),
            #[cfg(feature = "sqlite")]
            Conn::Sqlite(c) => {
                let _ = c.execute_batch("ROLLBACK");
            }
            // sqlx's transaction, dropped with the connection, rolls back
            #[cfg(feature = "sqlx-postgres")]
            Conn::SqlxPg(_) => {}
            #[cfg(feature = "sqlx-sqlite")]
            Conn::SqlxLite(..) => {}
        }
    }
}

/// Runs `$body` with `$on`, the key steps of `$held`'s connection (the
/// transaction begun by the claim when `$begin`), and gives back what the
/// claim found of the key's row.
macro_rules! on_conn {
    ($held:expr, $begin:expr, |$on:ident| $body:expr) => {{
        let Held { conn, keys, .. } = $held;
        match conn {
            #[cfg(feature = "postgres")]
            Conn::Pg(Some(c)) => {
                let mut $on = OnPg::new(c.client(), keys, $begin);
                let done = $body;
                (done, $on.kept)
            }
            #[cfg(feature = "postgres")]
            Conn::Pg(None) => (Err(crate::embed::gone()), Kept::default()),
            #[cfg(feature = "sqlite")]
            Conn::Sqlite(c) => {
                let mut $on = OnSqlite::new(c, &keys.sqlite, $begin);
                let done = $body;
                (done, $on.kept)
            }
            // begun with the connection
            #[cfg(feature = "sqlx-postgres")]
            Conn::SqlxPg(tx) => {
                let mut $on = OnSqlxPg::new(tx, keys);
                let done = $body;
                (done, $on.kept)
            }
            #[cfg(feature = "sqlx-sqlite")]
            Conn::SqlxLite(tx, _) => {
                let mut $on = OnSqlxLite::new(tx, keys);
                let done = $body;
                (done, $on.kept)
            }
        }
    }};
}

impl Held {
    /// A connection's transaction, not begun yet.
    pub(super) fn new(conn: Conn, keys: Arc<Keys>) -> Held {
        Held { conn, keys, kept: Kept::default(), open: true, call: Default::default() }
    }

    /// The key steps' claim, `BEGIN` sent with it (one round trip on
    /// tokio-postgres).
    pub(super) async fn claim(
        &mut self,
        key: &ScopedKey,
        claim: &Claim,
        accounts: Option<[&AcctId; 2]>,
    ) -> Result<Option<KeyRecord>, StoreError> {
        let claimed;
        (claimed, self.kept) = on_conn!(self, true, |on| on.claim(key, claim, accounts).await);
        claimed
    }

    pub(super) async fn replace_claim(
        &mut self,
        key: &ScopedKey,
        seen: &KeyRecord,
        claim: &Claim,
    ) -> Result<bool, StoreError> {
        on_conn!(self, false, |on| on.replace_claim(key, seen, claim).await).0
    }

    /// Stores `answer` with the key `token` claimed and commits (in one
    /// round trip on tokio-postgres); whether it committed (`false`: it
    /// may have, or not).
    pub(super) async fn complete_and_commit(
        &mut self,
        key: &ScopedKey,
        token: &str,
        answer: &Answer,
    ) -> bool {
        let (committed, _) =
            on_conn!(self, false, |on| Ok::<_, StoreError>(on.complete_and_commit(key, token, answer).await));
        self.open = !matches!(committed, Ok(true));
        !self.open
    }

    /// Begins a transaction with no key in it (a request the layer lets
    /// through unprotected): what the claim would have begun (on sqlx the
    /// connection came with it begun).
    pub(super) async fn begin(&mut self) -> bool {
        match &mut self.conn {
            #[cfg(feature = "postgres")]
            Conn::Pg(c) => match c {
                Some(c) => c.client().batch_execute("BEGIN").await.is_ok(),
                None => false,
            },
            #[cfg(feature = "sqlite")]
            Conn::Sqlite(c) => c.execute_batch("BEGIN IMMEDIATE").is_ok(),
            #[cfg(feature = "sqlx-postgres")]
            Conn::SqlxPg(tx) => tx.is_some(),
            #[cfg(feature = "sqlx-sqlite")]
            Conn::SqlxLite(tx, _) => tx.is_some(),
        }
    }

    /// Commits the transaction; whether it committed (`false`: it may
    /// have, or not).
    pub(super) async fn commit(&mut self) -> bool {
        self.end(true).await
    }

    /// Rolls the transaction back; if that fails, dropping `self` ends it.
    // `&mut self` throughout: a SQLite connection is not `Sync`, so a
    // shared borrow of one held across an await would make the
    // middleware's future not `Send`
    pub(super) async fn rollback(&mut self) {
        if self.open {
            self.end(false).await;
        }
    }

    /// Ends the transaction with a commit or a rollback; whether it ended so.
    async fn end(&mut self, commit: bool) -> bool {
        let done = match &mut self.conn {
            #[cfg(feature = "postgres")]
            Conn::Pg(c) => match c {
                Some(c) => c.client().batch_execute(if commit { "COMMIT" } else { "ROLLBACK" }).await.is_ok(),
                None => false,
            },
            #[cfg(feature = "sqlite")]
            Conn::Sqlite(c) => c.execute_batch(if commit { "COMMIT" } else { "ROLLBACK" }).is_ok(),
            #[cfg(feature = "sqlx-postgres")]
            Conn::SqlxPg(tx) => match (tx.take(), commit) {
                (Some(tx), true) => tx.commit().await.is_ok(),
                (Some(tx), false) => tx.rollback().await.is_ok(),
                (None, _) => !commit,
            },
            #[cfg(feature = "sqlx-sqlite")]
            Conn::SqlxLite(tx, _) => match (tx.take(), commit) {
                (Some(tx), true) => tx.commit().await.is_ok(),
                (Some(tx), false) => tx.rollback().await.is_ok(),
                (None, _) => !commit,
            },
        };
        self.open = !done;
        done
    }
}

/// The call a request may declare: the key it runs under (with the
/// layer's `Outside`), and the call it declared.
#[derive(Default)]
pub(super) struct Slot {
    pub(super) claim: Option<(ScopedKey, String, std::time::Duration)>,
    pub(super) called: Option<crate::provider::Intent>,
}

impl Slot {
    /// Lets the request under `key` (claimed by `token`) declare a call,
    /// if the layer has a provider.
    pub(super) fn open(&mut self, idem: &super::Idempotency, key: &ScopedKey, token: &str) {
        if let Some(outside) = &idem.outside {
            self.claim = Some((key.clone(), token.to_owned(), outside.lease()));
        }
    }
}
