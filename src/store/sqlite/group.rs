//! The group commit: many requests in one transaction, one fsync for all
//! of them, each in a savepoint of its own (see `service::executor`).

use super::*;
use std::cell::RefCell;

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
        Ok(Group { conn: &self.conn, open: true, held: RefCell::default() })
    }
}

/// The requests of one group commit; see [`SqliteStore::group`].
pub struct Group<'c> {
    conn: &'c Connection,
    open: bool,
    held: RefCell<Option<Held>>,
}

/// A claim the group holds and has not written. Its execution runs in the
/// same transaction under the writer's own lock, where no one else can see
/// the key in between: so the key is written once, already completed
/// (`KeyTable::insert_completed`), and not read back under the lock. A claim
/// left without its execution (a request that failed between the two) is
/// written by the next key statement of the group, or before its commit:
/// the group commits the rows it would have written claim by claim.
pub(super) struct Held {
    key: ScopedKey,
    claim: Claim,
}

impl Held {
    /// Writes the claim as the claim it is, in progress.
    fn write(&self, conn: &Connection) -> Result<(), StoreError> {
        key_sql::insert_claim(conn, keys(), who(&self.key), &self.claim).map_err(backend).map(drop)
    }
}

/// What a request's savepoint does to the group's held claim if it commits.
pub(super) enum Staged {
    /// Holds this claim (the claim's savepoint found the key free).
    Claimed(Held),
    /// Lets it go: written (completed, or written as it was), or released.
    Written,
}

/// The record of a key under `claim`, in progress.
pub(super) fn in_progress(claim: Claim) -> KeyRecord {
    let state = crate::store::KeyState::InProgress { lease_until: claim.lease_until };
    KeyRecord { fingerprint: claim.fingerprint, created_at: claim.created_at, token: claim.token, state }
}

impl SqliteTx<'_> {
    /// The claim step inside a group: the key's committed row answers if it
    /// has one; otherwise the claim is held, unwritten, from this
    /// savepoint's commit on.
    pub(super) fn hold_claim(
        &mut self,
        key: &ScopedKey,
        claim: &Claim,
    ) -> Result<Option<KeyRecord>, StoreError> {
        self.write_held()?; // another request's, left without its execution
        if let Some(found) = read_key(self.conn, key)? {
            return Ok(Some(found));
        }
        self.staged = Some(Staged::Claimed(Held { key: key.clone(), claim: claim.clone() }));
        Ok(None)
    }

    /// The claim the group holds on `key` (by `token`, if given), unless
    /// this savepoint has let it go already.
    pub(super) fn holding(&self, key: &ScopedKey, token: Option<&str>) -> Option<Claim> {
        let held = self.held?.borrow();
        let held = held.as_ref().filter(|_| self.staged.is_none())?;
        let mine = held.key == *key && token.is_none_or(|t| t == held.claim.token);
        mine.then(|| held.claim.clone())
    }

    /// Writes the group's held claim as the claim it is, before a statement
    /// that reads or writes keys other than through it.
    pub(super) fn write_held(&mut self) -> Result<(), StoreError> {
        let Some(held) = self.held.filter(|_| self.staged.is_none()) else { return Ok(()) };
        if let Some(claim) = held.borrow().as_ref() {
            claim.write(self.conn)?;
            self.staged = Some(Staged::Written);
        }
        Ok(())
    }

    /// After this savepoint's commit: what it staged becomes the group's.
    pub(super) fn settle_held(&mut self) {
        if let (Some(held), Some(staged)) = (self.held, self.staged.take()) {
            *held.borrow_mut() = match staged {
                Staged::Claimed(claim) => Some(claim),
                Staged::Written => None,
            };
        }
    }
}

impl Group<'_> {
    pub fn commit(mut self) -> Result<(), StoreError> {
        if let Some(claim) = self.held.take() {
            claim.write(self.conn)?;
        }
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
        Ok(Box::new(SqliteTx::start(self.conn, Some(&self.held))?))
    }
    fn audit(&mut self) -> Result<Audit, StoreError> {
        audit(self.conn)
    }
}
