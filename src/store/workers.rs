//! The connections `idem serve` runs on, by the shape of their work, so
//! that nothing above the store names a database (deadpool's `Manager` is
//! the model). On SQLite: one writer that carries many transfers in one
//! group commit, and readers beside it. On PostgreSQL: a pool of async
//! connections for transfers, one statement a step; synchronous writers
//! for the payout steps; and readers.

use super::pg::PgStore;
use super::pg_pool::{Manager, Pool};
use super::sqlite::SqliteStore;
use super::{Db, Reads, Store, StoreError};
use crate::policy::Policy;

/// Reader connections beside the writers.
const READERS: usize = 2;

/// SQLite readers that answer a settled key on the thread that asks: one
/// per runtime worker (tokio's default, one a core).
fn at_once() -> usize {
    std::thread::available_parallelism().map_or(2, usize::from)
}

/// The connections the service runs on.
pub enum Workers {
    /// One writer that commits transfers in groups, and readers: with a
    /// thread each, and `at_once`, which never wait for a lock (a read
    /// that would is handed to a reader thread) and so can be run on the
    /// thread that asks, with no hand-off.
    Grouped {
        writer: Box<dyn GroupWriter>,
        readers: Vec<Box<dyn Reads + Send>>,
        at_once: Vec<Box<dyn Reads + Send>>,
    },
    /// Transfers run on `pool`, awaited, in batches if asked and not
    /// `unbatched` (why they cannot be); `writers` (payouts only) and
    /// `readers` are synchronous connections with a thread each.
    Pooled {
        pool: Pool,
        unbatched: Option<String>,
        writers: Vec<Box<dyn Reads + Send>>,
        readers: Vec<Box<dyn Reads + Send>>,
    },
}

/// A writer that carries many requests in one transaction, committed once
/// for all of them (one fsync).
pub trait GroupWriter: Reads + Send {
    /// Opens a group: every request run on it commits with it, or not at all.
    fn group(&mut self) -> Result<Box<dyn GroupTx + '_>, StoreError>;
}

/// An open group; dropping it without [`GroupTx::commit`] rolls it back.
pub trait GroupTx: Store {
    fn commit(self: Box<Self>) -> Result<(), StoreError>;
}

impl Workers {
    /// Why transfers will not go out in batches though asked, if so.
    pub fn unbatched(&self) -> Option<&str> {
        match self {
            Workers::Pooled { unbatched, .. } => unbatched.as_deref(),
            Workers::Grouped { .. } => None,
        }
    }

    /// Opens what `db` needs: a writer on SQLite (checked writable); on
    /// PostgreSQL a pool of `pool` connections for transfers (made to run
    /// batches when `batches`, if the batch's function can be made) and,
    /// when `payouts` are served, `pool` writers for them; and readers
    /// beside them.
    pub fn open(
        db: &Db,
        pool: usize,
        batches: bool,
        payouts: bool,
        policy: &'static Policy,
    ) -> Result<Workers, StoreError> {
        match db {
            Db::Postgres(spec) => {
                let connect = |n| {
                    (0..n)
                        .map(|_| PgStore::connect(spec, policy).map(|s| Box::new(s) as Box<dyn Reads + Send>))
                        .collect::<Result<Vec<_>, _>>()
                };
                // the first reader has made and checked the schema the pool's
                // connections use, and the batch's function
                let mut first = PgStore::connect(spec, policy)?;
                let manager = Manager::new(spec, &first, policy)?;
                let unbatched = match batches {
                    true => first.make_batch_function().err().map(|e| format!("the batch's function: {e}")),
                    false => None,
                };
                let pool_of = match batches && unbatched.is_none() {
                    true => manager.batching().pool(pool)?,
                    false => manager.pool(pool)?,
                };
                let mut readers = connect(READERS - 1)?;
                readers.insert(0, Box::new(first));
                let writers = connect(if payouts { pool.max(1) } else { 0 })?;
                Ok(Workers::Pooled { pool: pool_of, unbatched, writers, readers })
            }
            Db::Sqlite(path) => {
                let writer = SqliteStore::open(path, policy)?;
                writer.check_writable()?;
                let readers = (0..READERS)
                    .map(|_| SqliteStore::open(path, policy).map(|s| Box::new(s) as Box<dyn Reads + Send>))
                    .collect::<Result<_, _>>()?;
                let at_once = (0..at_once())
                    .map(|_| {
                        let reader = SqliteStore::open(path, policy)?.never_waiting()?;
                        Ok(Box::new(reader) as Box<dyn Reads + Send>)
                    })
                    .collect::<Result<_, StoreError>>()?;
                Ok(Workers::Grouped { writer: Box::new(writer), readers, at_once })
            }
        }
    }
}
