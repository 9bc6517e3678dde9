//! The library on SQLite (rusqlite): [`Keys::run_sqlite`].
//!
//! The transaction is `BEGIN IMMEDIATE`: it takes SQLite's one write lock
//! before it reads the key, so a racing request on the same key waits for
//! the first to commit and then replays it (SQLite never shows it a claim in
//! flight).

pub use rusqlite::{Connection, Error as DbError, Transaction};

use super::{Answer, Error, Keys, Reply, Stop};
use crate::clock::Timestamp;
use crate::protocol::{conduct, now};
use crate::request::{AcctId, ScopedKey};
use crate::store::keys::{self, Kept, sqlite as key_sql};
use crate::store::{Claim, Failure, KeyRecord, KeySteps, KeyTable, StoreError};
use rusqlite::TransactionBehavior;
use std::ops::Deref;

fn db<E>(e: rusqlite::Error) -> Error<E> {
    Error::Db(Box::new(e))
}

fn failed(e: rusqlite::Error) -> StoreError {
    StoreError::Backend(Failure::caused_by("the key table", e))
}

/// A SQLite connection the caller lends, its write transaction open (or
/// opened by the claim, with `begin`), as the conductor's key steps: the
/// claim is written in the caller's transaction and never committed alone.
pub(super) struct OnSqlite<'c, C> {
    pub(super) conn: &'c mut C,
    table: &'c KeyTable,
    /// `BEGIN IMMEDIATE` first: SQLite's write lock before any read, so no
    /// read is upgraded
    begin: bool,
    /// The media type and headers stored with the answer of the key's
    /// row, if the claim found one.
    pub(super) kept: Kept,
}

impl<'c, C: Deref<Target = Connection>> OnSqlite<'c, C> {
    pub(super) fn new(conn: &'c mut C, table: &'c KeyTable, begin: bool) -> Self {
        OnSqlite { conn, table, begin, kept: Kept::default() }
    }

    /// Stores `answer` with the key `token` claimed (the caller commits).
    pub(super) fn complete(&self, key: &ScopedKey, token: &str, answer: &Answer) -> Result<(), StoreError> {
        let (stored, kept) = answer.stored();
        let who = keys::who(key);
        match key_sql::complete(self.conn, self.table, who, token, &stored, &kept, Timestamp::now()) {
            Ok(true) => Ok(()),
            Ok(false) => Err(StoreError::Backend("the key's claim was gone at completion".into())),
            Err(e) => Err(failed(e)),
        }
    }
}

impl<C: Deref<Target = Connection>> OnSqlite<'_, C> {
    /// [`OnSqlite::complete`] and `COMMIT`; whether both went through.
    // `&mut self`: a shared borrow of a SQLite connection, which is not
    // `Sync`, would make the layer's future not `Send`
    #[cfg(feature = "axum")]
    pub(super) async fn complete_and_commit(
        &mut self,
        key: &ScopedKey,
        token: &str,
        answer: &Answer,
    ) -> bool {
        self.complete(key, token, answer).is_ok() && self.conn.execute_batch("COMMIT").is_ok()
    }
}

impl<C: Deref<Target = Connection>> KeySteps for OnSqlite<'_, C> {
    async fn claim(
        &mut self,
        key: &ScopedKey,
        claim: &Claim,
        _: Option<[&AcctId; 2]>,
    ) -> Result<Option<KeyRecord>, StoreError> {
        if self.begin {
            self.conn.execute_batch("BEGIN IMMEDIATE").map_err(failed)?;
        }
        let who = keys::who(key);
        if key_sql::insert_claim(self.conn, self.table, who, claim).map_err(failed)? {
            return Ok(None);
        }
        keys::found(key_sql::read(self.conn, self.table, who).map_err(failed)?, &mut self.kept)
    }

    async fn replace_claim(
        &mut self,
        key: &ScopedKey,
        seen: &KeyRecord,
        claim: &Claim,
    ) -> Result<bool, StoreError> {
        key_sql::replace_claim(self.conn, self.table, keys::who(key), seen, claim).map_err(failed)
    }

    /// Nothing to delete: the claim goes with the transaction's rollback,
    /// which its owner runs (a dropped transaction rolls back).
    async fn release(&mut self, _: &ScopedKey, _: &str) -> Result<bool, StoreError> {
        Ok(false)
    }
}

impl Keys {
    /// Creates or upgrades the key table in `conn`'s database; run it at
    /// start-up (it is a no-op on a database already at this version).
    pub fn migrate_sqlite(&self, conn: &Connection) -> rusqlite::Result<()> {
        key_sql::migrate(conn, &self.versions, &self.migrations(crate::store::Dialect::Sqlite))
    }

    /// Runs `work` under the key: in one transaction, claims it, runs the
    /// work on the transaction, stores its answer and commits. A retry gets
    /// the stored answer without running the work; the key with another
    /// body gets [`Reply::Mismatch`]. If `work` returns an error, its writes
    /// and the claim roll back and the key stays free.
    pub fn run_sqlite<E, F>(
        &self,
        conn: &mut Connection,
        scope: &super::Scope,
        key: &str,
        body: &str,
        work: F,
    ) -> Result<Reply, Error<E>>
    where
        F: FnOnce(&Transaction<'_>) -> Result<Answer, E>,
    {
        let fingerprint = self.admit(key, body)?;
        let (key, token) = (scope.key(key), Self::token()?);
        let mut tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(db)?;
        let mut lent = OnSqlite::new(&mut tx, &self.sqlite, false);
        // the conductor's steps are done when first polled: nothing parks
        let conducted = now(conduct(&mut lent, &key, &fingerprint, None, self.ctx(&token), async |lent| {
            let answer = work(lent.conn).map_err(Stop::Work)?;
            lent.complete(&key, &token, &answer)?;
            Ok(answer)
        }));
        let reply = Self::reply(conducted, std::mem::take(&mut lent.kept))?;
        // anything but a fresh answer wrote nothing: the dropped transaction rolls back
        if let Reply::Fresh(_) = reply {
            tx.commit().map_err(db)?;
        }
        Ok(reply)
    }

    /// Deletes up to `limit` keys past retention, oldest first; how many.
    /// Run it now and then: a key older than the retention is never
    /// replayed, only kept.
    ///
    /// ```
    /// use idem::embed::Keys;
    /// let db = idem::embed::sqlite::Connection::open_in_memory()?;
    /// let keys = Keys::new("app_")?.retention_hours(24);
    /// keys.migrate_sqlite(&db)?;
    /// assert_eq!(keys.purge_sqlite(&db, 1000)?, 0); // nothing a day old yet
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn purge_sqlite(&self, conn: &Connection, limit: u64) -> rusqlite::Result<u64> {
        key_sql::purge(conn, &self.sqlite, self.retained_since(), limit, super::NO_ENDPOINT)
    }
}
