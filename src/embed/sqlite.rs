//! The library on SQLite (rusqlite): [`Keys::run_sqlite`].
//!
//! The transaction is `BEGIN IMMEDIATE`: it takes SQLite's one write lock
//! before it reads the key, so a racing request on the same key waits for
//! the first to commit and then replays it (SQLite never shows it a claim in
//! flight).

pub use rusqlite::{Connection, Error as DbError, Transaction};

use super::{Answer, Error, Keys, Reply, Row};
use crate::clock::Timestamp;
use rusqlite::{OptionalExtension, TransactionBehavior, params};

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
        for (n, step) in
            self.migrations("TEXT").iter().enumerate().skip(usize::try_from(at).unwrap_or(usize::MAX))
        {
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
        if let Some(reply) = self.claim_sqlite(&tx, scope, key, &fingerprint)? {
            return Ok(reply);
        }
        let answer = work(&tx).map_err(Error::Work)?;
        self.complete_sqlite(&tx, scope, key, &answer)?;
        tx.commit().map_err(db)?;
        Ok(Reply::Fresh(answer))
    }

    /// In the open write transaction on `conn`: claims the key for this
    /// request (`None`), or says what the key's row answers instead.
    pub(super) fn claim_sqlite<E>(
        &self,
        conn: &Connection,
        scope: &super::Scope,
        key: &str,
        fingerprint: &str,
    ) -> Result<Option<Reply>, Error<E>> {
        let now = Timestamp::now();
        let who = params![scope.client, scope.endpoint, key];
        let row = conn
            .query_row(
                &format!(
                    "SELECT fingerprint, created_at, status, body, content_type FROM {} \
                     WHERE client_id = ?1 AND endpoint = ?2 AND idem_key = ?3",
                    self.table
                ),
                who,
                |r| {
                    let status: Option<u16> = r.get(2)?;
                    let body: Option<String> = r.get(3)?;
                    let content_type: Option<String> = r.get(4)?;
                    Ok(Row {
                        fingerprint: r.get(0)?,
                        created_at: r.get(1)?,
                        answer: status
                            .map(|s| Answer { content_type, ..Answer::new(s, body.unwrap_or_default()) }),
                    })
                },
            )
            .optional()
            .map_err(db)?;
        if let Some(row) = row
            && let Some(reply) = self.judge(row, fingerprint, now).map_err(|e| Error::Db(e.into()))?
        {
            return Ok(Some(reply));
        }
        // new, or past retention: the row is this request's from here
        conn.execute(
            &format!(
                "INSERT OR REPLACE INTO {} (client_id, endpoint, idem_key, fingerprint, created_at) \
                 VALUES (?1, ?2, ?3, ?4, ?5)",
                self.table
            ),
            params![scope.client, scope.endpoint, key, fingerprint, now.to_string()],
        )
        .map_err(db)?;
        Ok(None)
    }

    /// In the transaction that claimed the key: stores the work's answer
    /// with it (the caller commits).
    pub(super) fn complete_sqlite<E>(
        &self,
        conn: &Connection,
        scope: &super::Scope,
        key: &str,
        answer: &Answer,
    ) -> Result<(), Error<E>> {
        conn.execute(
            &format!(
                "UPDATE {} SET status = ?4, body = ?5, content_type = ?6 \
                 WHERE client_id = ?1 AND endpoint = ?2 AND idem_key = ?3",
                self.table
            ),
            params![scope.client, scope.endpoint, key, answer.status, answer.body, answer.content_type],
        )
        .map_err(db)?;
        Ok(())
    }
}
