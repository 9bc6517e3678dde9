//! The library on SQLite (rusqlite): [`Keys::run_sqlite`].
//!
//! The transaction is `BEGIN IMMEDIATE`: it takes SQLite's one write lock
//! before it reads the key, so a racing request on the same key waits for
//! the first to commit and then replays it (SQLite never shows it a claim in
//! flight).

pub use rusqlite::{Connection, Error as DbError, Transaction};

use super::{Answer, Error, Keys, Reply};
use crate::clock::Timestamp;
use crate::store::Claim;
use crate::store::keys::sqlite_record;
use rusqlite::{OptionalExtension, ToSql, TransactionBehavior, params};

fn db<E>(e: rusqlite::Error) -> Error<E> {
    Error::Db(Box::new(e))
}

impl Keys {
    /// Creates or upgrades the key table in `conn`'s database; run it at
    /// start-up (it is a no-op on a database already at this version).
    pub fn migrate_sqlite(&self, conn: &Connection) -> rusqlite::Result<()> {
        conn.execute_batch(&format!(
            "CREATE TABLE IF NOT EXISTS {} (version INTEGER NOT NULL)",
            self.versions
        ))?;
        let at: i64 =
            conn.query_row(&format!("SELECT coalesce(max(version), 0) FROM {}", self.versions), [], |r| {
                r.get(0)
            })?;
        let steps = self.migrations(crate::store::Dialect::Sqlite);
        for (n, step) in steps.iter().enumerate().skip(usize::try_from(at).unwrap_or(usize::MAX)) {
            conn.execute_batch(&format!(
                "BEGIN IMMEDIATE; {step}; INSERT INTO {} (version) VALUES ({}); COMMIT;",
                self.versions,
                n + 1
            ))?;
        }
        Ok(())
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
        let t = &self.sqlite;
        let claim = self.claim(fingerprint)?;
        let write = |sql: &str, claim: &Claim, seen: &[&dyn ToSql]| {
            let (at, lease) = (claim.created_at.to_string(), claim.lease_until.to_string());
            let mut args: Vec<&dyn ToSql> =
                vec![&scope.client, &scope.endpoint, &key, &claim.fingerprint, &claim.token, &at, &lease];
            args.extend_from_slice(seen);
            conn.prepare_cached(sql)?.execute(args.as_slice())
        };
        if write(&t.insert_claim, &claim, &[]).map_err(db)? == 1 {
            return Ok(Ok(claim.token));
        }
        // the primary key says the key exists: its committed row decides
        let read = conn.prepare_cached(&t.read).and_then(|mut s| {
            s.query_row(params![scope.client, scope.endpoint, key], |r| Ok((sqlite_record(r, 0)?, r.get(9)?)))
                .optional()
        });
        let Some((existing, content_type)) = read.map_err(db)? else {
            return Ok(Err(Reply::InFlight)); // purged meanwhile: retry
        };
        let claim = match self.over(&existing, content_type, claim) {
            Ok(claim) => claim,
            Err(reply) => return Ok(Err(reply)),
        };
        let seen: [&dyn ToSql; 2] = [&existing.token, &existing.state.name()];
        Ok(match write(&t.replace_claim, &claim, &seen).map_err(db)? {
            1 => Ok(claim.token),
            _ => Err(Reply::InFlight),
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
        let done = conn.prepare_cached(&self.sqlite.complete).and_then(|mut s| {
            s.execute(params![
                scope.client,
                scope.endpoint,
                key,
                answer.status,
                None::<&str>,
                answer.body,
                None::<i64>,
                Timestamp::now().to_string(),
                token,
                answer.content_type,
            ])
        });
        match done.map_err(db)? {
            1 => Ok(()),
            _ => Err(Error::Db("the key's claim was gone at completion".into())),
        }
    }

    /// Deletes up to `limit` keys past retention, oldest first; how many.
    /// Run it now and then: a key older than the retention is never
    /// replayed, only kept.
    pub fn purge_sqlite(&self, conn: &Connection, limit: u64) -> rusqlite::Result<u64> {
        let before = Timestamp::now().plus_seconds(-self.policy.retention_seconds()).to_string();
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let purged =
            conn.prepare_cached(&self.sqlite.purge)?.execute(params![before, limit, super::NO_ENDPOINT])?;
        Ok(purged as u64)
    }
}
