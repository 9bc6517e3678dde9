//! The keys an operator looks after: those past retention (purged), and
//! claims left in progress by a process that died (listed, released).

use super::*;

/// Deletes every key created before `before`; returns how many. This is the
/// lab's `--purge-before`: it deletes what it is told, in one transaction.
pub fn purge<S: Store + ?Sized>(
    store: &mut S,
    before: Timestamp,
    policy: &Policy,
) -> Result<u64, StoreError> {
    store::atomically(store, Durability::Durable, policy, |tx| tx.purge(before, u64::MAX).map(End::Commit))
}

/// The operator's purge: deletes only keys past retention at `now`, `batch`
/// keys per transaction so that no transaction holds the write lock for
/// long. Returns how many.
pub fn purge_expired<S: Store + ?Sized>(
    store: &mut S,
    now: Timestamp,
    batch: u64,
    policy: &Policy,
) -> Result<u64, StoreError> {
    let cut = now.plus_seconds(-policy.retention_seconds());
    let mut purged = 0;
    loop {
        let n = store::atomically(store, Durability::Durable, policy, |tx| {
            tx.purge(cut, batch).map(End::Commit)
        })?;
        purged += n;
        if n < batch {
            return Ok(purged);
        }
    }
}

/// A claim still `in_progress`: its holder is executing now, or died.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenClaim {
    /// The key claimed.
    pub key: ScopedKey,
    /// When it was claimed.
    pub created_at: Timestamp,
    /// When its lease runs out.
    pub lease_until: Timestamp,
    /// The lease has run out: the holder is presumed dead.
    pub stale: bool,
}

/// Every claim still in progress at `now`, oldest first.
pub fn open_claims<S: Store + ?Sized>(
    store: &mut S,
    now: Timestamp,
    policy: &Policy,
) -> Result<Vec<OpenClaim>, StoreError> {
    let claims =
        store::atomically(store, Durability::Lazy, policy, |tx| tx.in_progress().map(End::Rollback))?;
    Ok(claims
        .into_iter()
        .filter_map(|(key, rec)| match rec.state {
            KeyState::InProgress { lease_until } => {
                Some(OpenClaim { key, created_at: rec.created_at, lease_until, stale: lease_until <= now })
            }
            KeyState::Completed(_) => None,
        })
        .collect())
}

/// Deletes the stale claims (lease run out), or with `live` every claim in
/// progress, and returns their keys. Safe for money either way: money moves
/// only in the transaction that completes a key, and only under the claim
/// it holds (fencing), so a released claim has moved none, and its holder,
/// if it still runs, finds its claim gone, moves nothing and answers 409.
/// Releasing a live claim is for holders known gone (a killed backend, a
/// server that died after answering): its next request starts afresh.
pub fn release_claims<S: Store + ?Sized>(
    store: &mut S,
    now: Timestamp,
    live: bool,
    policy: &Policy,
) -> Result<Vec<ScopedKey>, StoreError> {
    store::atomically(store, Durability::Durable, policy, |tx| {
        let mut released = Vec::new();
        for (key, rec) in tx.in_progress()? {
            if let KeyState::InProgress { lease_until } = rec.state
                && (live || lease_until <= now)
                && tx.release(&key, &rec.token)?
            {
                released.push(key);
            }
        }
        Ok(End::Commit(released))
    })
}
