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

use super::{Answer, Error, Keys, Reply, Row};
use crate::clock::Timestamp;
use std::time::Duration;
use tokio_postgres::GenericClient;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};

fn db<E>(e: tokio_postgres::Error) -> Error<E> {
    Error::Db(Box::new(e))
}

/// The key table's statements, written once for its name.
#[derive(Debug, Clone)]
pub(super) struct Sql {
    claim: String,
    read: String,
    renew: String,
    complete: String,
}

impl Sql {
    pub(super) fn new(table: &str) -> Sql {
        const KEY: &str = "client_id = $1 AND endpoint = $2 AND idem_key = $3";
        Sql {
            claim: format!(
                "INSERT INTO {table} (client_id, endpoint, idem_key, fingerprint, created_at) \
                 VALUES ($1, $2, $3, $4, $5) ON CONFLICT DO NOTHING"
            ),
            read: format!(
                "SELECT fingerprint, created_at, status, body, content_type FROM {table} \
                 WHERE {KEY} FOR UPDATE NOWAIT"
            ),
            renew: format!(
                "UPDATE {table} SET fingerprint = $4, created_at = $5, status = NULL, body = NULL, \
                 content_type = NULL WHERE {KEY}"
            ),
            complete: format!("UPDATE {table} SET status = $4, body = $5, content_type = $6 WHERE {KEY}"),
        }
    }
}

impl Keys {
    /// Creates or upgrades the key table; run it at start-up. Concurrent
    /// start-ups are serialised by an advisory lock.
    pub async fn migrate_pg(&self, client: &mut Client) -> Result<(), tokio_postgres::Error> {
        let tx = client.transaction().await?;
        // one lock for every idem table in this database: migrations are rare
        tx.execute("SELECT pg_advisory_xact_lock(7262617)", &[]).await?;
        tx.batch_execute(&format!("CREATE TABLE IF NOT EXISTS {} (version INTEGER NOT NULL)", self.versions))
            .await?;
        let at: i32 = tx
            .query_one(&format!("SELECT coalesce(max(version), 0) FROM {}", self.versions), &[])
            .await?
            .get(0);
        for (n, step) in
            self.migrations("TEXT").iter().enumerate().skip(usize::try_from(at).unwrap_or(usize::MAX))
        {
            tx.batch_execute(step).await?;
            let version = i32::try_from(n + 1).unwrap_or(i32::MAX);
            tx.execute(&format!("INSERT INTO {} (version) VALUES ($1)", self.versions), &[&version]).await?;
        }
        tx.commit().await
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
        if let Some(reply) = self.claim_on(&tx, false, scope, key, &fingerprint).await? {
            return Ok(reply);
        }
        let answer = work(&tx).await.map_err(Error::Work)?;
        self.complete_on(&tx, scope, key, &answer).await?;
        tx.commit().await.map_err(db)?;
        Ok(Reply::Fresh(answer))
    }

    /// In the open transaction on `c` (opened here first when `begin`):
    /// claims the key for this request (`None`), or says what the key's
    /// row answers instead. After an answer the transaction is to be rolled
    /// back (it wrote nothing). A new key costs one round trip: the
    /// statements go together, typed, so none waits on a prepare.
    pub(super) async fn claim_on<C: GenericClient + Sync, E>(
        &self,
        c: &C,
        begin: bool,
        scope: &super::Scope,
        key: &str,
        fingerprint: &str,
    ) -> Result<Option<Reply>, Error<E>> {
        let now = Timestamp::now();
        let at = now.to_string();
        let wait = format!("{}ms", self.wait.as_millis().max(1));
        let who: [(&(dyn ToSql + Sync), Type); 5] = [
            (&scope.client, Type::TEXT),
            (&scope.endpoint, Type::TEXT),
            (&key, Type::TEXT),
            (&fingerprint, Type::TEXT),
            (&at, Type::TEXT),
        ];
        // The claim waits on a racer's uncommitted claim of the same key for
        // `wait` at most (its lock_timeout); the transaction's own setting is
        // kept aside and put back for the work. `join!`, not `try_join!`:
        // the claim's own error, not a later statement's, says what happened.
        let wait = [(&wait as &(dyn ToSql + Sync), Type::TEXT)];
        let (begun, waited, claimed, restored) = tokio::join!(
            async { if begin { c.batch_execute("BEGIN").await } else { Ok(()) } },
            c.execute_typed(WAIT_FOR_CLAIM, &wait),
            c.execute_typed(&self.sql.claim, &who),
            c.execute_typed(WAIT_AS_BEFORE, &[]),
        );
        begun.and(waited).map_err(db)?;
        let claimed = match claimed {
            Ok(n) => n == 1,
            Err(e) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => return Ok(Some(Reply::InFlight)),
            Err(e) => return Err(db(e)),
        };
        restored.map_err(db)?;
        if !claimed && let Some(reply) = self.existing(c, &who, fingerprint, now).await? {
            return Ok(Some(reply));
        }
        Ok(None)
    }

    /// In the transaction that claimed the key: stores the work's answer
    /// with it (the caller commits).
    pub(super) async fn complete_on<C: GenericClient + Sync, E>(
        &self,
        c: &C,
        scope: &super::Scope,
        key: &str,
        answer: &Answer,
    ) -> Result<(), Error<E>> {
        let status = i32::from(answer.status);
        let done = c.execute_typed(&self.sql.complete, &completion(scope, &key, &status, answer)).await;
        match done.map_err(db)? {
            1 => Ok(()),
            _ => Err(Error::Db("the key's claim was gone at completion".into())),
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
        answer: &Answer,
    ) -> bool {
        let status = i32::from(answer.status);
        let args = completion(scope, &key, &status, answer);
        let (done, committed) =
            tokio::join!(c.execute_typed(&self.sql.complete, &args), c.batch_execute("COMMIT"),);
        matches!(done, Ok(1)) && committed.is_ok()
    }

    /// The key's committed row, judged: `None` when it is past retention,
    /// and then it is this request's claim. The row is locked without
    /// waiting: a racer renewing it is in flight.
    async fn existing<C: GenericClient + Sync, E>(
        &self,
        tx: &C,
        who: &[(&(dyn ToSql + Sync), Type); 5],
        fingerprint: &str,
        now: Timestamp,
    ) -> Result<Option<Reply>, Error<E>> {
        let r = match tx.query_typed(&self.sql.read, &who[..3]).await {
            Ok(rows) => match rows.into_iter().next() {
                Some(r) => r,
                None => return Ok(Some(Reply::InFlight)), // purged meanwhile: retry
            },
            Err(e) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => return Ok(Some(Reply::InFlight)),
            Err(e) => return Err(db(e)),
        };
        let status: Option<i32> = r.get(2);
        let body: Option<String> = r.get(3);
        let row = Row {
            fingerprint: r.get(0),
            created_at: r.get(1),
            answer: status.map(|s| Answer {
                content_type: r.get(4),
                ..Answer::new(u16::try_from(s).unwrap_or(500), body.unwrap_or_default())
            }),
        };
        if let Some(reply) = self.judge(row, fingerprint, now).map_err(|e| Error::Db(e.into()))? {
            return Ok(Some(reply));
        }
        tx.execute_typed(&self.sql.renew, who).await.map_err(db)?;
        Ok(None)
    }
}

/// Puts the claim's lock wait in force for the transaction, keeping the
/// one it had in `idem.lock_timeout` (a volatile subquery, so it runs first).
const WAIT_FOR_CLAIM: &str = "SELECT set_config('lock_timeout', $1, true) \
     FROM (SELECT set_config('idem.lock_timeout', current_setting('lock_timeout'), true)) AS kept";

/// Gives the transaction back the lock wait it had before the claim.
const WAIT_AS_BEFORE: &str = "SELECT set_config('lock_timeout', current_setting('idem.lock_timeout'), true)";

/// The completion's arguments, typed: the scope, the key, the answer.
fn completion<'a>(
    scope: &'a super::Scope,
    key: &'a &str,
    status: &'a i32,
    answer: &'a Answer,
) -> [(&'a (dyn ToSql + Sync), Type); 6] {
    [
        (&scope.client, Type::TEXT),
        (&scope.endpoint, Type::TEXT),
        (key, Type::TEXT),
        (status, Type::INT4),
        (&answer.body, Type::TEXT),
        (&answer.content_type, Type::TEXT),
    ]
}
