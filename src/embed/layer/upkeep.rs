//! The key table's upkeep on whichever store the layer runs: keys past
//! retention deleted, now or on a schedule of the service's runtime.

use super::Idempotency;
use super::conn::Store;
use std::time::Duration;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl Idempotency {
    /// Deletes up to `limit` keys past retention, oldest first, on the
    /// layer's store (one of its connections); how many. A key past
    /// retention is never replayed, only kept: see [`Idempotency::purge_every`].
    pub async fn purge(&self, limit: u64) -> Result<u64, BoxError> {
        let keys = &self.keys;
        Ok(match &self.store {
            #[cfg(feature = "postgres")]
            Store::Pg(lend) => {
                let lease = lend().await.ok_or("no connection came from the pool")?;
                keys.purge_pg(lease.client(), limit).await?
            }
            #[cfg(feature = "sqlite")]
            Store::Sqlite(conn) => keys.purge_sqlite(&*conn.lock().await, limit)?,
            #[cfg(feature = "sqlx-postgres")]
            Store::SqlxPg(pool) => keys.purge_sqlx_postgres(pool, limit).await?,
            // in the writers' line, as the layer's requests write
            #[cfg(feature = "sqlx-sqlite")]
            Store::SqlxLite(pool, line) => {
                let _turn = line.lock().await;
                keys.purge_sqlx_sqlite(pool, limit).await?
            }
        })
    }

    /// Purges on a schedule, as a task of the service's runtime (abort the
    /// handle, or let the runtime end, to stop it): every `every`, keys past
    /// retention are deleted in batches of `batch` (each its own short
    /// transaction, so no request waits behind a long delete) until none is
    /// left. A failure is logged (`tracing`, target `idem`) and the next
    /// round tries again.
    ///
    /// ```no_run
    /// # use idem::embed::{Keys, layer::Idempotency};
    /// # async fn setup(idem: Idempotency) {
    /// let purging = idem.purge_every(std::time::Duration::from_secs(3600), 1000);
    /// # }
    /// ```
    pub fn purge_every(&self, every: Duration, batch: u64) -> tokio::task::JoinHandle<()> {
        let idem = self.clone();
        let batch = batch.max(1);
        tokio::spawn(async move {
            loop {
                loop {
                    match idem.purge(batch).await {
                        Ok(n) if n == batch => continue,
                        Ok(n) => tracing::debug!(target: "idem", purged = n, "keys past retention purged"),
                        Err(e) => {
                            tracing::warn!(target: "idem", error = %e, "the purge failed; the next round tries again")
                        }
                    }
                    break;
                }
                tokio::time::sleep(every).await;
            }
        })
    }
}
