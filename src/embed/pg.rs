//! The library on PostgreSQL (tokio-postgres, the driver `idem serve`
//! uses): [`Keys::run_pg`].
//!
//! The claim is an `INSERT … ON CONFLICT DO NOTHING` in the caller's
//! transaction. A racing request on the same key blocks on that insert
//! until the first transaction ends, for at most [`Keys::in_flight_wait`]
//! (PostgreSQL's `lock_timeout`, set for the claim alone); past it, the
//! racer gets [`Reply::InFlight`], the draft's 409. Once the first commits,
//! a racer finds its row and replays it.

pub use tokio_postgres::{Client, Transaction};

use super::{Answer, Error, Keys, Reply};
use crate::clock::Timestamp;
use crate::store::keys::pg::{self as key_sql, WAIT_AS_BEFORE, WAIT_FOR_CLAIM};
use std::time::Duration;
use tokio_postgres::GenericClient;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};

fn db<E>(e: tokio_postgres::Error) -> Error<E> {
    Error::Db(Box::new(e))
}

impl Keys {
    /// Creates or upgrades the key table; run it at start-up. Concurrent
    /// start-ups are serialised by an advisory lock.
    pub async fn migrate_pg(&self, client: &mut Client) -> Result<(), tokio_postgres::Error> {
        key_sql::migrate(client, &self.versions, &self.migrations(crate::store::Dialect::Postgres)).await
    }

    /// How long a request waits for another transaction holding its key
    /// before it is answered [`Reply::InFlight`] (default [`IN_FLIGHT_WAIT`](super::IN_FLIGHT_WAIT)).
    pub fn in_flight_wait(mut self, wait: Duration) -> Keys {
        self.wait = wait;
        self
    }

    /// Runs `work` under the key: in one transaction, claims it, runs the
    /// work on the transaction, stores its answer and commits. A retry gets
    /// the stored answer without running the work; the key with another
    /// body gets [`Reply::Mismatch`]; while the first still runs, a retry
    /// gets [`Reply::InFlight`]. If `work` returns an error, or the future
    /// is dropped before it ends, its writes and the claim roll back and
    /// the key stays free.
    pub async fn run_pg<E, F>(
        &self,
        client: &mut Client,
        scope: &super::Scope,
        key: &str,
        body: &str,
        work: F,
    ) -> Result<Reply, Error<E>>
    where
        F: AsyncFnOnce(&Transaction<'_>) -> Result<Answer, E>,
    {
        let fingerprint = self.admit(key, body)?;
        // dropped unfinished, the transaction sends its ROLLBACK
        let tx = client.transaction().await.map_err(db)?;
        let token = match self.claim_on(&tx, false, scope, key, &fingerprint).await? {
            Ok(token) => token,
            Err(reply) => return Ok(reply),
        };
        let answer = work(&tx).await.map_err(Error::Work)?;
        self.complete_on(&tx, scope, key, &token, &answer).await?;
        tx.commit().await.map_err(db)?;
        Ok(Reply::Fresh(answer))
    }

    /// In the open transaction on `c` (opened here first when `begin`):
    /// claims the key for this request (its claim's token), or says what
    /// the key's row answers instead. After an answer the transaction is to
    /// be rolled back (it wrote nothing). A new key costs one round trip:
    /// the statements go together, typed, so none waits on a prepare. The
    /// statements are the engine's (`store::keys`).
    pub(super) async fn claim_on<C: GenericClient + Sync, E>(
        &self,
        c: &C,
        begin: bool,
        scope: &super::Scope,
        key: &str,
        fingerprint: &str,
    ) -> Result<Result<String, Reply>, Error<E>> {
        let (t, who) = (&self.pg, scope.who(key));
        let claim = self.claim(fingerprint)?;
        let wait = format!("{}ms", self.wait.as_millis().max(1));
        let wait = [(&wait as &(dyn ToSql + Sync), Type::TEXT)];
        // The claim waits on a racer's uncommitted claim of the same key for
        // `wait` at most; the transaction's own lock wait is put back for the
        // work. `join!`, not `try_join!`: the claim's own error, not a later
        // statement's, says what happened.
        let (begun, waited, claimed, restored) = tokio::join!(
            async { if begin { c.batch_execute("BEGIN").await } else { Ok(()) } },
            c.execute_typed(WAIT_FOR_CLAIM, &wait),
            key_sql::insert_claim(c, t, who, &claim),
            c.execute_typed(WAIT_AS_BEFORE, &[]),
        );
        begun.and(waited).map_err(db)?;
        let claimed = match claimed {
            Ok(claimed) => claimed,
            Err(e) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => return Ok(Err(Reply::InFlight)),
            Err(e) => return Err(db(e)),
        };
        restored.map_err(db)?;
        if claimed {
            return Ok(Ok(claim.token));
        }
        // the primary key says the key exists: its committed row decides,
        // locked without waiting (a racer taking it over is in flight)
        let row = match key_sql::read_nowait(c, t, who).await {
            Ok(Some(row)) => row,
            Ok(None) => return Ok(Err(Reply::InFlight)), // purged meanwhile: retry
            Err(e) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => return Ok(Err(Reply::InFlight)),
            Err(e) => return Err(db(e)),
        };
        let existing = key_sql::record(&row, 0).map_err(|e| Error::Db(e.into()))?;
        let claim = match self.over(&existing, row.get(9), claim) {
            Ok(claim) => claim,
            Err(reply) => return Ok(Err(reply)),
        };
        Ok(match key_sql::replace_claim(c, t, who, &existing, &claim).await.map_err(db)? {
            true => Ok(claim.token),
            false => Err(Reply::InFlight),
        })
    }

    /// In the transaction that claimed the key with `token`: stores the
    /// work's answer with it (the caller commits).
    pub(super) async fn complete_on<C: GenericClient + Sync, E>(
        &self,
        c: &C,
        scope: &super::Scope,
        key: &str,
        token: &str,
        answer: &Answer,
    ) -> Result<(), Error<E>> {
        let who = scope.who(key);
        let (stored, media) = answer.stored();
        match key_sql::complete(c, &self.pg, who, token, &stored, media, Timestamp::now())
            .await
            .map_err(db)?
        {
            true => Ok(()),
            false => Err(Error::Db("the key's claim was gone at completion".into())),
        }
    }

    /// [`Keys::complete_on`] and `COMMIT`, sent together (one round trip);
    /// whether both went through. Had the completion failed, PostgreSQL
    /// turns the `COMMIT` of the failed transaction into a rollback.
    #[cfg(feature = "axum")]
    pub(super) async fn complete_and_commit(
        &self,
        c: &Client,
        scope: &super::Scope,
        key: &str,
        token: &str,
        answer: &Answer,
    ) -> bool {
        let who = scope.who(key);
        let (stored, media) = answer.stored();
        let (done, committed) = tokio::join!(
            key_sql::complete(c, &self.pg, who, token, &stored, media, Timestamp::now()),
            c.batch_execute("COMMIT"),
        );
        matches!(done, Ok(true)) && committed.is_ok()
    }

    /// Deletes up to `limit` keys past retention, oldest first; how many.
    /// Run it now and then: a key older than the retention is never
    /// replayed, only kept.
    pub async fn purge_pg<C: GenericClient + Sync>(
        &self,
        c: &C,
        limit: u64,
    ) -> Result<u64, tokio_postgres::Error> {
        key_sql::purge(c, &self.pg, self.retained_since(), limit, super::NO_ENDPOINT).await
    }
}
