//! The library on the application's own sqlx pools (features
//! `sqlx-postgres`, `sqlx-sqlite`): the key table's statements, the same
//! texts as every other store's (`store::keys`), run on a connection of a
//! `PgPool` or a `SqlitePool` in the transaction the handler writes in.
//!
//! The transaction is sqlx's own (`Pool::begin_with`), so a handler that
//! begins one on the connection gets a savepoint, and a transaction
//! dropped unfinished (a handler that panicked) is rolled back by sqlx
//! before its connection is used again. sqlx sends one statement a round
//! trip (it does not pipeline): a new key costs `BEGIN`, the claim (on
//! PostgreSQL bounding its own lock wait, `keys::claim_waiting_at_most`),
//! the completion and `COMMIT`: four round trips and four statements, two
//! more than the bare handler's `BEGIN` and `COMMIT`.

use super::{Answer, Keys, gone};
use crate::clock::Timestamp;
use crate::request::{AcctId, ScopedKey};
use crate::store::keys::{self, Kept, KeyTable, Versions};
use crate::store::{Claim, Failure, KeyRecord, KeyRow, KeySteps, StoreError};
use sqlx::{AssertSqlSafe, Transaction};

/// A lock wait past its bound is the key in flight; anything else failed.
fn failed(e: sqlx::Error) -> StoreError {
    match &e {
        // PostgreSQL's lock_not_available: the claim waited past its bound
        sqlx::Error::Database(d) if d.code().as_deref() == Some("55P03") => StoreError::Busy,
        _ => StoreError::Backend(Failure::caused_by("the key table", e)),
    }
}

/// The key steps, the completion and the migration on one sqlx database:
/// the same code for both, but for how each begins its transaction and
/// reads a key another transaction may hold.
macro_rules! on_sqlx {
    ($db:ty, $lent:ident) => {
        /// A transaction on a connection of the application's pool, as the
        /// conductor's key steps (`None` once committed or rolled back).
        pub(crate) struct $lent<'c> {
            tx: &'c mut Option<Transaction<'static, $db>>,
            table: &'c KeyTable,
            /// The claim's statement ([`Self::claim_sql`]).
            claim: &'c str,
            /// The media type and headers stored with the answer of the
            /// key's row, if the claim found one.
            pub(crate) kept: Kept,
        }

        impl<'c> $lent<'c> {
            pub(crate) fn new(tx: &'c mut Option<Transaction<'static, $db>>, keys: &'c Keys) -> Self {
                $lent { tx, table: Self::table(keys), claim: Self::claim_sql(keys), kept: Kept::default() }
            }

            /// Stores `answer` with the key `token` claimed and commits;
            /// whether it committed (`false`: it may have, or not).
            pub(crate) async fn complete_and_commit(
                &mut self,
                key: &ScopedKey,
                token: &str,
                answer: &Answer,
            ) -> bool {
                let (stored, kept) = answer.stored();
                let who = keys::who(key);
                let reason = stored.reason.as_ref().map(ToString::to_string);
                let Some(conn) = self.tx.as_deref_mut() else { return false };
                let done = sqlx::query::<$db>(AssertSqlSafe(&*self.table.complete))
                    .bind(who[0])
                    .bind(who[1])
                    .bind(who[2])
                    .bind(i32::from(stored.status))
                    .bind(reason)
                    .bind(&stored.body)
                    .bind(stored.transfer_id)
                    .bind(Timestamp::now().to_string())
                    .bind(token)
                    .bind(kept.content_type)
                    .bind(kept.headers)
                    .bind(kept.body_bytes)
                    .execute(&mut *conn)
                    .await;
                match (done, self.tx.take()) {
                    (Ok(d), Some(tx)) if d.rows_affected() == 1 => tx.commit().await.is_ok(),
                    _ => false,
                }
            }

            /// `claim` on `key` as `sql` binds it: the key, then the claim.
            fn bind_claim<'q>(
                sql: &'q str,
                key: &'q ScopedKey,
                claim: &'q Claim,
            ) -> sqlx::query::Query<'q, $db, <$db as sqlx::Database>::Arguments> {
                let who = keys::who(key);
                sqlx::query::<$db>(AssertSqlSafe(sql))
                    .bind(who[0])
                    .bind(who[1])
                    .bind(who[2])
                    .bind(&claim.fingerprint)
                    .bind(&claim.token)
                    .bind(claim.created_at.to_string())
                    .bind(claim.lease_until.to_string())
            }

            /// Writes `claim` over the version `seen` of `key`; whether it did.
            async fn write_claim(
                &mut self,
                key: &ScopedKey,
                claim: &Claim,
                seen: &KeyRecord,
            ) -> Result<bool, StoreError> {
                let q = Self::bind_claim(&self.table.replace_claim, key, claim)
                    .bind(&seen.token)
                    .bind(seen.state.name());
                Ok(q.execute(self.tx.as_deref_mut().ok_or_else(gone)?).await.map_err(failed)?.rows_affected()
                    == 1)
            }

            /// The key's row by `sql` (the record, `content_type`, `headers`).
            async fn read(
                &mut self,
                sql: &str,
                key: &ScopedKey,
            ) -> Result<Option<(KeyRecord, Kept)>, StoreError> {
                use sqlx::Row;
                let who = keys::who(key);
                let row = sqlx::query::<$db>(AssertSqlSafe(sql)).bind(who[0]).bind(who[1]).bind(who[2]);
                let Some(r) =
                    row.fetch_optional(self.tx.as_deref_mut().ok_or_else(gone)?).await.map_err(failed)?
                else {
                    return Ok(None);
                };
                let get = |e: sqlx::Error| StoreError::Backend(Failure::caused_by("a key row", e));
                let status: Option<i32> = r.try_get(5).map_err(get)?;
                let record = KeyRow {
                    fingerprint: r.try_get(0).map_err(get)?,
                    created_at: r.try_get(1).map_err(get)?,
                    token: r.try_get(2).map_err(get)?,
                    state: r.try_get(3).map_err(get)?,
                    lease_until: r.try_get(4).map_err(get)?,
                    status: status.map(i64::from),
                    reason: r.try_get(6).map_err(get)?,
                    body: r.try_get(7).map_err(get)?,
                    transfer_id: r.try_get(8).map_err(get)?,
                }
                .decode()?;
                let kept = Kept {
                    content_type: r.try_get(9).map_err(get)?,
                    headers: r.try_get(10).map_err(get)?,
                    body_bytes: r.try_get(11).map_err(get)?,
                };
                Ok(Some((record, kept)))
            }
        }

        impl KeySteps for $lent<'_> {
            async fn claim(
                &mut self,
                key: &ScopedKey,
                claim: &Claim,
                _: Option<[&AcctId; 2]>,
            ) -> Result<Option<KeyRecord>, StoreError> {
                let conn = self.tx.as_deref_mut().ok_or_else(gone)?;
                if Self::insert_claim(conn, Self::bind_claim(self.claim, key, claim)).await? {
                    return Ok(None);
                }
                let row = self.read(Self::read_sql(self.table), key).await?;
                keys::found(row, &mut self.kept)
            }

            async fn replace_claim(
                &mut self,
                key: &ScopedKey,
                seen: &KeyRecord,
                claim: &Claim,
            ) -> Result<bool, StoreError> {
                self.write_claim(key, claim, seen).await
            }

            /// Nothing to delete: the claim goes with the transaction's
            /// rollback, which the layer runs.
            async fn release(&mut self, _: &ScopedKey, _: &str) -> Result<bool, StoreError> {
                Ok(false)
            }
        }
    };
}

#[cfg(all(feature = "sqlx-sqlite", feature = "axum"))]
pub(crate) use lite::OnSqlxLite;
#[cfg(all(feature = "sqlx-postgres", feature = "axum"))]
pub(crate) use pg::OnSqlxPg;

#[cfg(feature = "sqlx-postgres")]
mod pg {
    use super::*;
    use crate::store::keys::MIGRATION_LOCK;
    use sqlx::PgConnection;

    on_sqlx!(sqlx::Postgres, OnSqlxPg);

    impl OnSqlxPg<'_> {
        fn table(keys: &Keys) -> &KeyTable {
            &keys.pg
        }

        /// The claim, bounding its own lock wait, one statement, one round
        /// trip (`keys::claim_waiting_at_most`).
        fn claim_sql(keys: &Keys) -> &str {
            &keys.pg_claim
        }

        /// Runs the claim `q`; whether it inserted.
        async fn insert_claim(
            conn: &mut PgConnection,
            q: sqlx::query::Query<'_, sqlx::Postgres, sqlx::postgres::PgArguments>,
        ) -> Result<bool, StoreError> {
            use sqlx::Row;
            let row = q.fetch_one(conn).await.map_err(failed)?;
            let n: i64 =
                row.try_get(0).map_err(|e| StoreError::Backend(Failure::caused_by("a claim's row", e)))?;
            Ok(n == 1)
        }

        /// The key's committed row, a plain read in a transaction of its own
        /// on a connection of `pool` (rolled back as it ends).
        #[cfg(feature = "axum")]
        pub(crate) async fn peek(
            pool: &sqlx::PgPool,
            keys: &Keys,
            key: &ScopedKey,
        ) -> Result<Option<(KeyRecord, Kept)>, StoreError> {
            let mut tx = Some(pool.begin().await.map_err(failed)?);
            let mut lent = OnSqlxPg::new(&mut tx, keys);
            let read = &lent.table.read;
            lent.read(read, key).await
        }

        /// Locked without waiting: a racer taking it over is in flight.
        fn read_sql(t: &KeyTable) -> &str {
            &t.read_nowait
        }
    }

    impl Keys {
        /// Creates or upgrades the key table through `pool`; the layer's
        /// `Idempotency::on_sqlx_postgres` (feature `axum`) runs it at
        /// start-up. Concurrent start-ups are serialised by an
        /// advisory lock.
        pub async fn migrate_sqlx_postgres(&self, pool: &sqlx::PgPool) -> Result<(), sqlx::Error> {
            use sqlx::Row;
            let (mut tx, versions) = (pool.begin().await?, Versions(&self.versions));
            sqlx::raw_sql(MIGRATION_LOCK).execute(&mut *tx).await?;
            sqlx::raw_sql(AssertSqlSafe(versions.create())).execute(&mut *tx).await?;
            let at: i32 =
                sqlx::query(AssertSqlSafe(versions.reached())).fetch_one(&mut *tx).await?.try_get(0)?;
            let steps = self.migrations(crate::store::Dialect::Postgres);
            for (n, step) in steps.iter().enumerate().skip(usize::try_from(at).unwrap_or(usize::MAX)) {
                sqlx::raw_sql(AssertSqlSafe(&**step)).execute(&mut *tx).await?;
                sqlx::raw_sql(AssertSqlSafe(versions.record(n + 1))).execute(&mut *tx).await?;
            }
            tx.commit().await
        }

        /// Deletes up to `limit` keys past retention, oldest first; how many.
        pub async fn purge_sqlx_postgres(&self, pool: &sqlx::PgPool, limit: u64) -> Result<u64, sqlx::Error> {
            let limit = i64::try_from(limit).unwrap_or(i64::MAX);
            let purge = sqlx::query(AssertSqlSafe(&*self.pg.purge)).bind(self.retained_since().to_string());
            let done = purge.bind(limit).bind(super::super::NO_ENDPOINT).execute(pool).await?;
            Ok(done.rows_affected())
        }
    }
}

#[cfg(feature = "sqlx-sqlite")]
mod lite {
    use super::*;
    use sqlx::SqliteConnection;

    on_sqlx!(sqlx::Sqlite, OnSqlxLite);

    impl OnSqlxLite<'_> {
        fn table(keys: &Keys) -> &KeyTable {
            &keys.sqlite
        }

        /// A transaction on a connection of `pool` that holds SQLite's
        /// write lock before any read, so no read is upgraded and a racer
        /// on the key waits for the first to end, then replays it.
        pub(crate) async fn begin(
            pool: &sqlx::SqlitePool,
        ) -> Result<Transaction<'static, sqlx::Sqlite>, sqlx::Error> {
            pool.begin_with("BEGIN IMMEDIATE").await
        }

        fn claim_sql(keys: &Keys) -> &str {
            &keys.sqlite.insert_claim
        }

        /// Runs the claim `q`; whether it inserted.
        async fn insert_claim(
            conn: &mut SqliteConnection,
            q: sqlx::query::Query<'_, sqlx::Sqlite, sqlx::sqlite::SqliteArguments>,
        ) -> Result<bool, StoreError> {
            Ok(q.execute(conn).await.map_err(failed)?.rows_affected() == 1)
        }

        fn read_sql(t: &KeyTable) -> &str {
            &t.read
        }
    }

    impl Keys {
        /// Creates or upgrades the key table through `pool`, each step in a
        /// write transaction of its own with its version (sqlx's: one that
        /// fails, or whose future is dropped, rolls back); the layer's
        /// `Idempotency::on_sqlx_sqlite` (feature `axum`) runs it at
        /// start-up.
        pub async fn migrate_sqlx_sqlite(&self, pool: &sqlx::SqlitePool) -> Result<(), sqlx::Error> {
            use sqlx::Row;
            let versions = Versions(&self.versions);
            sqlx::raw_sql(AssertSqlSafe(versions.create())).execute(pool).await?;
            let steps = self.migrations(crate::store::Dialect::Sqlite);
            loop {
                let mut tx = pool.begin_with("BEGIN IMMEDIATE").await?;
                let at: i64 =
                    sqlx::query(AssertSqlSafe(versions.reached())).fetch_one(&mut *tx).await?.try_get(0)?;
                let Some((at, step)) = usize::try_from(at).ok().and_then(|at| Some((at, steps.get(at)?)))
                else {
                    return tx.commit().await;
                };
                sqlx::raw_sql(AssertSqlSafe(format!("{step}; {}", versions.record(at + 1))))
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await?;
            }
        }

        /// Deletes up to `limit` keys past retention, oldest first; how many.
        pub async fn purge_sqlx_sqlite(
            &self,
            pool: &sqlx::SqlitePool,
            limit: u64,
        ) -> Result<u64, sqlx::Error> {
            let limit = i64::try_from(limit).unwrap_or(i64::MAX);
            let purge =
                sqlx::query(AssertSqlSafe(&*self.sqlite.purge)).bind(self.retained_since().to_string());
            let done = purge.bind(limit).bind(super::super::NO_ENDPOINT).execute(pool).await?;
            Ok(done.rows_affected())
        }
    }
}
