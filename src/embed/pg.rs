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

use super::{Answer, Error, Keys, Reply, Stop};
use crate::clock::Timestamp;
use crate::protocol::conduct;
use crate::request::{AcctId, ScopedKey};
use crate::store::keys::pg as key_sql;
use crate::store::keys::{self, Kept, KeyTable};
use crate::store::{Claim, Failure, KeyRecord, KeySteps, StoreError};
use tokio_postgres::GenericClient;
use tokio_postgres::error::SqlState;

fn db<E>(e: tokio_postgres::Error) -> Error<E> {
    Error::Db(Box::new(e))
}

/// A lock wait past its bound is the key in flight; anything else failed.
fn failed(e: tokio_postgres::Error) -> StoreError {
    match e.code() {
        Some(&SqlState::LOCK_NOT_AVAILABLE) => StoreError::Busy,
        _ => StoreError::Backend(Failure::caused_by("the key table", e)),
    }
}

/// A PostgreSQL client the caller lends, its transaction open (or opened
/// by the claim, with `begin`), as the conductor's key steps: the claim is
/// written in the caller's transaction and never committed alone.
pub(super) struct OnPg<'c, C> {
    pub(super) c: &'c C,
    table: &'c KeyTable,
    /// the claim, waiting on a racer's uncommitted claim of the key for
    /// [`Keys::in_flight_wait`] at most
    claim: &'c str,
    /// `BEGIN` first, sent with the claim
    begin: bool,
    /// The media type and headers stored with the answer of the key's
    /// row, if the claim found one.
    pub(super) kept: Kept,
}

impl<'c, C: GenericClient + Sync> OnPg<'c, C> {
    pub(super) fn new(c: &'c C, keys: &'c Keys, begin: bool) -> Self {
        OnPg { c, table: &keys.pg, claim: &keys.pg_claim, begin, kept: Kept::default() }
    }

    /// [`OnPg::complete`] and `COMMIT`, sent together (one round trip);
    /// whether both went through. Had the completion failed, PostgreSQL
    /// turns the `COMMIT` of the failed transaction into a rollback.
    #[cfg(feature = "axum")]
    pub(super) async fn complete_and_commit(
        &mut self,
        key: &ScopedKey,
        token: &str,
        answer: &Answer,
    ) -> bool {
        let (done, committed) =
            tokio::join!(self.complete(key, token, answer), self.c.batch_execute("COMMIT"));
        done.is_ok() && committed.is_ok()
    }

    /// Stores `answer` with the key `token` claimed (the caller commits).
    pub(super) async fn complete(
        &self,
        key: &ScopedKey,
        token: &str,
        answer: &Answer,
    ) -> Result<(), StoreError> {
        let (stored, kept) = answer.stored();
        let who = keys::who(key);
        match key_sql::complete(self.c, self.table, who, token, &stored, &kept, Timestamp::now()).await {
            Ok(true) => Ok(()),
            Ok(false) => Err(StoreError::Backend("the key's claim was gone at completion".into())),
            Err(e) => Err(failed(e)),
        }
    }
}

impl<C: GenericClient + Sync> KeySteps for OnPg<'_, C> {
    /// A new key costs one round trip: the claim goes with the `BEGIN`,
    /// typed, so it waits on no prepare; it bounds its own lock wait
    /// (`keys::claim_waiting_at_most`).
    async fn claim(
        &mut self,
        key: &ScopedKey,
        claim: &Claim,
        _: Option<[&AcctId; 2]>,
    ) -> Result<Option<KeyRecord>, StoreError> {
        let (c, t, who) = (self.c, self.table, keys::who(key));
        // `join!`, not `try_join!`: the claim's own error, not the BEGIN's
        // reply, says what happened.
        let (begun, claimed) = tokio::join!(
            async { if self.begin { c.batch_execute("BEGIN").await } else { Ok(()) } },
            key_sql::claim_waiting(c, self.claim, who, claim),
        );
        begun.map_err(failed)?;
        let claimed = claimed.map_err(failed)?;
        if claimed {
            return Ok(None);
        }
        // locked without waiting: a racer taking it over is in flight
        let row = key_sql::read_nowait(c, t, who).await.map_err(failed)?;
        let row = row.map(|row| key_sql::record(&row, 0).map(|record| (record, key_sql::kept(&row))));
        keys::found(row.transpose()?, &mut self.kept)
    }

    async fn replace_claim(
        &mut self,
        key: &ScopedKey,
        seen: &KeyRecord,
        claim: &Claim,
    ) -> Result<bool, StoreError> {
        key_sql::replace_claim(self.c, self.table, keys::who(key), seen, claim).await.map_err(failed)
    }

    /// Nothing to delete: the claim goes with the transaction's rollback,
    /// which its owner runs (a dropped transaction rolls back).
    async fn release(&mut self, _: &ScopedKey, _: &str) -> Result<bool, StoreError> {
        Ok(false)
    }
}

impl Keys {
    /// Creates or upgrades the key table; run it at start-up. Concurrent
    /// start-ups are serialised by an advisory lock.
    pub async fn migrate_pg(&self, client: &mut Client) -> Result<(), tokio_postgres::Error> {
        key_sql::migrate(client, &self.versions, &self.migrations(crate::store::Dialect::Postgres)).await
    }

    /// Runs `work` under the key: in one transaction, claims it, runs the
    /// work on the transaction, stores its answer and commits. A retry gets
    /// the stored answer without running the work; the key with another
    /// body gets [`Reply::Mismatch`]; while the first still runs, a retry
    /// gets [`Reply::InFlight`]. If `work` returns an error, or the future
    /// is dropped before it ends, its writes and the claim roll back and
    /// the key stays free.
    ///
    /// ```no_run
    /// use idem::embed::{Answer, Keys, Reply, Scope};
    /// # async fn shop() -> Result<(), Box<dyn std::error::Error>> {
    /// let (mut client, connection) =
    ///     tokio_postgres::connect("host=/run/postgresql dbname=shop", tokio_postgres::NoTls).await?;
    /// tokio::spawn(connection);
    /// let keys = Keys::new("shop_")?;
    /// keys.migrate_pg(&mut client).await?; // at start-up
    ///
    /// let scope = Scope::new("client-7", "POST /orders");
    /// let reply = keys
    ///     .run_pg(&mut client, &scope, "k-1", r#"{"item":"tea"}"#, async |tx| {
    ///         let row = tx.query_one("INSERT INTO orders (item) VALUES ('tea') RETURNING id", &[]).await?;
    ///         let id: i64 = row.get(0);
    ///         Ok::<_, tokio_postgres::Error>(Answer::new(201, format!(r#"{{"order":{id}}}"#)))
    ///     })
    ///     .await?;
    /// match reply {
    ///     Reply::Fresh(a) | Reply::Replayed(a) => println!("{} {:?}", a.status, a.text()),
    ///     Reply::InFlight => println!("409: the first request still runs"),
    ///     Reply::Mismatch => println!("422: the key with another body"),
    /// }
    /// keys.purge_pg(&client, 1000).await?; // now and then
    /// # Ok(()) }
    /// ```
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
        let (key, token) = (scope.key(key), Self::token()?);
        // dropped unfinished, the transaction sends its ROLLBACK
        let tx = client.transaction().await.map_err(db)?;
        let mut lent = OnPg::new(&tx, self, false);
        let conducted = conduct(&mut lent, &key, &fingerprint, None, self.ctx(&token), async |lent| {
            let answer = work(lent.c).await.map_err(Stop::Work)?;
            lent.complete(&key, &token, &answer).await?;
            Ok(answer)
        })
        .await;
        let reply = Self::reply(conducted, std::mem::take(&mut lent.kept))?;
        // anything but a fresh answer wrote nothing: the dropped transaction rolls back
        if let Reply::Fresh(_) = reply {
            tx.commit().await.map_err(db)?;
        }
        Ok(reply)
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
