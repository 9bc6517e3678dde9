//! The library on SQLite (rusqlite): [`Keys::run_sqlite`].
//!
//! The transaction is `BEGIN IMMEDIATE`: it takes SQLite's one write lock
//! before it reads the key, so a racing request on the same key waits for
//! the first to commit and then replays it (SQLite never shows it a claim in
//! flight).

pub use rusqlite::{Connection, Error as DbError, Transaction};

use super::{Answer, Error, Keys, Reply};
use crate::clock::Timestamp;
use crate::store::keys::sqlite as key_sql;
use rusqlite::TransactionBehavior;

fn db<E>(e: rusqlite::Error) -> Error<E> {
    Error::Db(Box::new(e))
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
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(db)?;
        let token = match self.claim_sqlite(&tx, scope, key, &fingerprint)? {
            Ok(token) => token,
            Err(reply) => return Ok(reply),
        };
        let answer = work(&tx).map_err(Error::Work)?;
        self.complete_sqlite(&tx, scope, key, &token, &answer)?;
        tx.commit().map_err(db)?;
        Ok(Reply::Fresh(answer))
    }

    /// In the open write transaction on `conn`: claims the key for this
    /// request (its claim's token), or says what the key's row answers
    /// instead. The statements are the engine's (`store::keys`).
    pub(super) fn claim_sqlite<E>(
        &self,
        conn: &Connection,
        scope: &super::Scope,
        key: &str,
        fingerprint: &str,
    ) -> Result<Result<String, Reply>, Error<E>> {
        let (t, who) = (&self.sqlite, scope.who(key));
        let claim = self.claim(fingerprint)?;
        if key_sql::insert_claim(conn, t, who, &claim).map_err(db)? {
            return Ok(Ok(claim.token));
        }
        // the primary key says the key exists: its committed row decides
        let Some((existing, content_type)) = key_sql::read(conn, t, who).map_err(db)? else {
            return Ok(Err(Reply::InFlight)); // purged meanwhile: retry
        };
        let claim = match self.over(&existing, content_type, claim) {
            Ok(claim) => claim,
            Err(reply) => return Ok(Err(reply)),
        };
        Ok(match key_sql::replace_claim(conn, t, who, &existing, &claim).map_err(db)? {
            true => Ok(claim.token),
            false => Err(Reply::InFlight),
        })
    }

    /// In the transaction that claimed the key with `token`: stores the
    /// work's answer with it (the caller commits).
    pub(super) fn complete_sqlite<E>(
        &self,
        conn: &Connection,
        scope: &super::Scope,
        key: &str,
        token: &str,
        answer: &Answer,
    ) -> Result<(), Error<E>> {
        let who = scope.who(key);
        let (stored, media) = answer.stored();
        match key_sql::complete(conn, &self.sqlite, who, token, &stored, media, Timestamp::now())
            .map_err(db)?
        {
            true => Ok(()),
            false => Err(Error::Db("the key's claim was gone at completion".into())),
        }
    }

    /// Deletes up to `limit` keys past retention, oldest first; how many.
    /// Run it now and then: a key older than the retention is never
    /// replayed, only kept.
    pub fn purge_sqlite(&self, conn: &Connection, limit: u64) -> rusqlite::Result<u64> {
        key_sql::purge(conn, &self.sqlite, self.retained_since(), limit, super::NO_ENDPOINT)
    }
}
