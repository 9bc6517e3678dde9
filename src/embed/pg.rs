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
use crate::store::Claim;
use crate::store::keys::pg_record;
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
        let tx = client.transaction().await?;
        // one lock for every idem table in this database: migrations are rare
        tx.execute("SELECT pg_advisory_xact_lock(7262617)", &[]).await?;
        tx.batch_execute(&format!("CREATE TABLE IF NOT EXISTS {} (version INTEGER NOT NULL)", self.versions))
            .await?;
        let at: i32 = tx
            .query_one(&format!("SELECT coalesce(max(version), 0) FROM {}", self.versions), &[])
            .await?
            .get(0);
        for (n, step) in self
            .migrations(crate::store::Dialect::Postgres)
            .iter()
            .enumerate()
            .skip(usize::try_from(at).unwrap_or(usize::MAX))
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
        let claim = self.claim(fingerprint)?;
        let wait = format!("{}ms", self.wait.as_millis().max(1));
        let wait = [(&wait as &(dyn ToSql + Sync), Type::TEXT)];
        // The claim waits on a racer's uncommitted claim of the same key for
        // `wait` at most (its lock_timeout); the transaction's own setting is
        // kept aside and put back for the work. `join!`, not `try_join!`:
        // the claim's own error, not a later statement's, says what happened.
        let (begun, waited, claimed, restored) = tokio::join!(
            async { if begin { c.batch_execute("BEGIN").await } else { Ok(()) } },
            c.execute_typed(WAIT_FOR_CLAIM, &wait),
            write(c, &self.pg.insert_claim, scope, key, &claim, &[]),
            c.execute_typed(WAIT_AS_BEFORE, &[]),
        );
        begun.and(waited).map_err(db)?;
        let claimed = match claimed {
            Ok(n) => n == 1,
            Err(e) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => return Ok(Err(Reply::InFlight)),
            Err(e) => return Err(db(e)),
        };
        restored.map_err(db)?;
        if claimed {
            return Ok(Ok(claim.token));
        }
        // the primary key says the key exists: its committed row decides,
        // locked without waiting (a racer taking it over is in flight)
        let who = key_args(scope, &key);
        let row = match c.query_typed(&self.pg.read_nowait, &who).await {
            Ok(rows) => rows.into_iter().next(),
            Err(e) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => return Ok(Err(Reply::InFlight)),
            Err(e) => return Err(db(e)),
        };
        let Some(row) = row else { return Ok(Err(Reply::InFlight)) }; // purged meanwhile: retry
        let existing = pg_record(&row, 0).map_err(|e| Error::Db(e.into()))?;
        let claim = match self.over(&existing, row.get(9), claim) {
            Ok(claim) => claim,
            Err(reply) => return Ok(Err(reply)),
        };
        let state = existing.state.name();
        let seen: [(&(dyn ToSql + Sync), Type); 2] = [(&existing.token, Type::TEXT), (&state, Type::TEXT)];
        Ok(match write(c, &self.pg.replace_claim, scope, key, &claim, &seen).await.map_err(db)? {
            1 => Ok(claim.token),
            _ => Err(Reply::InFlight),
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
        match completion(c, &self.pg.complete, scope, key, token, answer).await.map_err(db)? {
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
        token: &str,
        answer: &Answer,
    ) -> bool {
        let (done, committed) = tokio::join!(
            completion(c, &self.pg.complete, scope, key, token, answer),
            c.batch_execute("COMMIT"),
        );
        matches!(done, Ok(1)) && committed.is_ok()
    }

    /// Deletes up to `limit` keys past retention, oldest first; how many.
    /// Run it now and then: a key older than the retention is never
    /// replayed, only kept.
    pub async fn purge_pg<C: GenericClient + Sync>(
        &self,
        c: &C,
        limit: u64,
    ) -> Result<u64, tokio_postgres::Error> {
        let before = Timestamp::now().plus_seconds(-self.policy.retention_seconds()).to_string();
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let args: [(&(dyn ToSql + Sync), Type); 3] =
            [(&before, Type::TEXT), (&limit, Type::INT8), (&super::NO_ENDPOINT, Type::TEXT)];
        c.execute_typed(&self.pg.purge, &args).await
    }
}

/// The key's three columns, typed.
fn key_args<'a>(scope: &'a super::Scope, key: &'a &str) -> [(&'a (dyn ToSql + Sync), Type); 3] {
    [(&scope.client, Type::TEXT), (&scope.endpoint, Type::TEXT), (key, Type::TEXT)]
}

/// Runs a claim's statement (`insert_claim`, `replace_claim` with the
/// version `seen`) with its typed arguments.
async fn write<C: GenericClient + Sync>(
    c: &C,
    sql: &str,
    scope: &super::Scope,
    key: &str,
    claim: &Claim,
    seen: &[(&(dyn ToSql + Sync), Type)],
) -> Result<u64, tokio_postgres::Error> {
    let (at, lease) = (claim.created_at.to_string(), claim.lease_until.to_string());
    let mut args = key_args(scope, &key).to_vec();
    args.extend([
        (&claim.fingerprint as &(dyn ToSql + Sync), Type::TEXT),
        (&claim.token, Type::TEXT),
        (&at, Type::TEXT),
        (&lease, Type::TEXT),
    ]);
    args.extend(seen.iter().cloned());
    c.execute_typed(sql, &args).await
}

/// Runs the completion with its typed arguments: the answer, now, under
/// `token`.
async fn completion<C: GenericClient + Sync>(
    c: &C,
    sql: &str,
    scope: &super::Scope,
    key: &str,
    token: &str,
    answer: &Answer,
) -> Result<u64, tokio_postgres::Error> {
    let (status, at) = (i32::from(answer.status), Timestamp::now().to_string());
    let mut args = key_args(scope, &key).to_vec();
    args.extend([
        (&status as &(dyn ToSql + Sync), Type::INT4),
        (&None::<&str>, Type::TEXT),
        (&answer.body, Type::TEXT),
        (&None::<i64>, Type::INT8),
        (&at, Type::TEXT),
        (&token, Type::TEXT),
        (&answer.content_type, Type::TEXT),
    ]);
    c.execute_typed(sql, &args).await
}

/// Puts the claim's lock wait in force for the transaction, keeping the
/// one it had in `idem.lock_timeout` (a volatile subquery, so it runs first).
const WAIT_FOR_CLAIM: &str = "SELECT set_config('lock_timeout', $1, true) \
     FROM (SELECT set_config('idem.lock_timeout', current_setting('lock_timeout'), true)) AS kept";

/// Gives the transaction back the lock wait it had before the claim.
const WAIT_AS_BEFORE: &str = "SELECT set_config('lock_timeout', current_setting('idem.lock_timeout'), true)";
