//! The group commit: many requests in one transaction, one fsync for all
//! of them, each in a savepoint of its own (see `service::executor`).

use super::*;

impl SqliteStore {
    /// Opens one durable transaction for a group of requests (group commit):
    /// each transaction a request begins in it is a savepoint, and
    /// [`Group::commit`] makes all of them durable with one fsync. Nothing a
    /// request of the group wrote is on disk, so nothing of it may be
    /// answered, before that commit returns; a group that is dropped rolls
    /// every request of it back.
    pub fn group(&mut self) -> Result<Group<'_>, StoreError> {
        self.synchronous(Durability::Durable)?;
        run(&self.conn, "BEGIN IMMEDIATE")?;
        Ok(Group { conn: &self.conn, open: true })
    }
}

/// The requests of one group commit; see [`SqliteStore::group`].
pub struct Group<'c> {
    conn: &'c Connection,
    open: bool,
}

impl Group<'_> {
    pub fn commit(mut self) -> Result<(), StoreError> {
        run(self.conn, "COMMIT")?; // on failure the drop rolls the group back
        self.open = false;
        Ok(())
    }
}

impl crate::store::GroupWriter for SqliteStore {
    fn group(&mut self) -> Result<Box<dyn crate::store::GroupTx + '_>, StoreError> {
        Ok(Box::new(SqliteStore::group(self)?))
    }
}

impl crate::store::GroupTx for Group<'_> {
    fn commit(self: Box<Self>) -> Result<(), StoreError> {
        Group::commit(*self)
    }
}

impl Drop for Group<'_> {
    fn drop(&mut self) {
        if self.open {
            let _ = run(self.conn, "ROLLBACK");
        }
    }
}

impl Store for Group<'_> {
    fn begin(&mut self, _: Durability) -> Result<Box<dyn Tx + '_>, StoreError> {
        // durable with the group's commit, whatever the request asked
        Ok(Box::new(SqliteTx::start(self.conn, true)?))
    }
    fn audit(&mut self) -> Result<Audit, StoreError> {
        audit(self.conn)
    }
}
