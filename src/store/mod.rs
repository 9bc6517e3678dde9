//! What the protocol needs from storage, in the protocol's own words, and the
//! isolation each operation must give without a global writer lock.
//!
//! A store hands out transactions. The contract is written so that it holds
//! under PostgreSQL's READ COMMITTED with many writers at once, not only under
//! SQLite's single writer:
//!
//! - **The primary key decides who claims a key.** [`Tx::insert_claim`] is an
//!   insert that does nothing on conflict; only then is the existing row read.
//!   Nobody looks first and inserts later.
//! - **Every change to an existing key is a compare-and-set** on the version
//!   the protocol saw (its token and state): [`Tx::replace_claim`],
//!   [`Tx::complete`], [`Tx::release`]. A `false` means somebody else got
//!   there first; the protocol then re-reads, never overwrites.
//! - **The execution holds its key and its accounts locked.**
//!   [`Tx::lock_key`] and [`Tx::lock_account`] are locking reads held to the
//!   end of the transaction; the ledger takes the accounts in one fixed order,
//!   so A→B racing B→A waits instead of deadlocking.
//! - **Balances move by guarded relative updates** ([`Tx::add_to_balance`]):
//!   exactly one row changes or the transaction fails, and a concurrent debit
//!   is never lost to a stale absolute write.
//! - **Transient failures are retried by one runner**, [`atomically`]: a
//!   [`StoreError::Conflict`] (a serialization failure, a deadlock, a lost
//!   compare-and-set) rolls back and runs the work again within the busy
//!   budget; a lock wait past the budget is [`StoreError::Busy`].
//!
//! Nothing is visible to anyone else until commit; a dropped transaction rolls
//! back. The SQL of idem's tables lives below this module: the key table's
//! in `keys` (whoever keeps the keys, the engine or a library's caller),
//! the ledger's and the payouts' in each backend.

// the stores themselves, and what opens and runs them (feature `cli`)
#[cfg(feature = "cli")]
pub mod bank;
mod db;
mod endpoints;
pub(crate) mod keys;
mod payouts;
#[cfg(feature = "cli")]
pub mod pg;
#[cfg(feature = "cli")]
pub mod pg_pool;
#[cfg(feature = "postgres")]
pub(crate) mod reach;
mod record;
#[cfg(feature = "cli")]
pub mod sqlite;
#[cfg(feature = "cli")]
pub mod workers;

pub use db::Db;
pub(crate) use endpoints::*;
pub use endpoints::{Disabled, Take};
pub use keys::{Dialect, KeyTable};
pub use payouts::*;
#[cfg(feature = "cli")]
pub use pg_pool::{Pool, Pooled};
#[cfg(all(feature = "postgres", any(feature = "cli", feature = "axum")))]
pub use reach::{Connector, Ready};
pub use record::*;
#[cfg(feature = "cli")]
pub use workers::{GroupTx, GroupWriter, Workers};

use crate::clock::Timestamp;
use crate::policy::Policy;
use crate::request::{AcctId, ScopedKey};
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Whether a commit must reach the disk before it returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Visible and atomic, but may be lost in a power cut (not in a crash).
    Lazy,
    /// On disk when `commit` returns.
    Durable,
}

#[derive(Debug, Clone, PartialEq, Eq)]
/// Why a store could not do what was asked.
pub enum StoreError {
    /// A lock was held for longer than the busy budget, or no connection was
    /// free: nothing was written; the caller may try again later.
    Busy,
    /// Another transaction changed what this one read (a serialization
    /// failure, a deadlock, a lost compare-and-set): run the work again.
    Conflict,
    /// The database cannot take this request now: its connection was lost
    /// (a restart, a failover, a killed backend), or it cannot write (disk
    /// full, an I/O error). Whatever the request did is either committed, and
    /// a retry finds it, or gone; the caller may try again later.
    Unavailable(String),
    /// The database is not one the engine can use (no account table, a
    /// schema of another version, a balance that is not an integer).
    Schema(String),
    /// Anything else the backend reported: I/O, corruption, read-only file.
    Backend(Failure),
}

/// What a backend reported, with the error it came from when that error
/// is safe to show an operator (SQLite's and the file system's; never
/// PostgreSQL's, whose details may quote row data or the connection).
#[derive(Debug, Clone)]
pub struct Failure {
    what: String,
    source: Option<Arc<dyn std::error::Error + Send + Sync>>,
}

impl Failure {
    /// A failure `what`, caused by `source` (shown to an operator).
    pub fn caused_by(
        what: impl Into<String>,
        source: impl std::error::Error + Send + Sync + 'static,
    ) -> Failure {
        Failure { what: what.into(), source: Some(Arc::new(source)) }
    }
}

impl From<String> for Failure {
    fn from(what: String) -> Failure {
        Failure { what, source: None }
    }
}

impl From<&str> for Failure {
    fn from(what: &str) -> Failure {
        what.to_owned().into()
    }
}

/// Two failures are the same when they say the same.
impl PartialEq for Failure {
    fn eq(&self, other: &Failure) -> bool {
        self.what == other.what
    }
}

impl Eq for Failure {}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.what)
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Busy => f.write_str("database is busy: lock wait exceeded busy_timeout_ms"),
            StoreError::Conflict => f.write_str("concurrent update: retries exceeded busy_timeout_ms"),
            StoreError::Unavailable(why) => write!(f, "database unavailable: {why}"),
            StoreError::Schema(why) => f.write_str(why),
            StoreError::Backend(failure) => write!(f, "{failure}"),
        }
    }
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            StoreError::Backend(Failure { source: Some(source), .. }) => Some(source.as_ref()),
            _ => None,
        }
    }
}

/// What the protocol runs on (transactions) and the harness judges by (the
/// audit of what they left).
///
/// The two steps of a request have their own methods, so that a store
/// across a network can run each in one round trip; their defaults run
/// them as transactions of [`Tx`] calls, which is right for a store in
/// the process (SQLite, the models under `tests/`).
pub trait Store {
    /// Starts a transaction; dropping it without [`Tx::commit`] rolls back.
    fn begin(&mut self, durability: Durability) -> Result<Box<dyn Tx + '_>, StoreError>;
    /// Reads back the ledger and the keys (outside any request).
    fn audit(&mut self) -> Result<Audit, StoreError>;

    /// Inserts `claim` on `key` and commits it ([`Durability::Lazy`]),
    /// unless the key exists: then nothing is written and its committed
    /// record is returned. `accounts`, when given, are the ones an
    /// [`Store::execute`] under this claim will decide on: a store may read
    /// them on the way, to decide on without another round trip.
    fn claim(
        &mut self,
        key: &ScopedKey,
        claim: &Claim,
        accounts: Option<[&AcctId; 2]>,
        policy: &Policy,
    ) -> Result<Option<KeyRecord>, StoreError> {
        let _ = accounts;
        atomically(self, Durability::Lazy, policy, |tx| tx.insert_claim(key, claim).map(End::Commit))
    }

    /// Runs one execution, all or nothing, durably: reads the key and the
    /// accounts, asks `plan` what to write, writes it (checking, if the
    /// reads were not under lock, that the key is still held by the token
    /// and the plan's premises still hold, else it reads and plans again),
    /// asks `crash` whether to stop before the commit, and commits. A
    /// conflict runs it again within the busy budget, as [`atomically`].
    fn execute(
        &mut self,
        x: Execution,
        plan: &mut dyn FnMut(&Seen) -> Plan,
        crash: &mut dyn FnMut() -> bool,
        policy: &Policy,
    ) -> Result<Executed, StoreError> {
        atomically(self, Durability::Durable, policy, |tx| execute_locked(tx, x, plan, crash))
    }

    /// Writes `claim` over the key if it is still the version `seen`, and
    /// commits it ([`Durability::Lazy`]); whether it did.
    fn replace_claim(
        &mut self,
        key: &ScopedKey,
        seen: &KeyRecord,
        claim: &Claim,
        policy: &Policy,
    ) -> Result<bool, StoreError> {
        atomically(self, Durability::Lazy, policy, |tx| {
            Ok(match tx.replace_claim(key, seen, claim)? {
                true => End::Commit(true),
                false => End::Rollback(false),
            })
        })
    }

    /// Deletes the key if `token` still holds it in progress, and commits.
    fn release(&mut self, key: &ScopedKey, token: &str, policy: &Policy) -> Result<bool, StoreError> {
        atomically(self, Durability::Lazy, policy, |tx| tx.release(key, token).map(End::Commit))
    }
}

/// [`Store::execute`] on a transaction that locks what it reads: the key,
/// then the accounts in ascending order, so A→B racing B→A waits for the
/// other instead of deadlocking.
fn execute_locked(
    tx: &mut dyn Tx,
    x: Execution,
    plan: &mut dyn FnMut(&Seen) -> Plan,
    crash: &mut dyn FnMut() -> bool,
) -> Result<End<Executed>, StoreError> {
    let key = tx.lock_key(x.key)?;
    let [src, dst] = x.accounts;
    let src_first = src <= dst;
    let first = tx.lock_account(if src_first { src } else { dst })?;
    let second = tx.lock_account(if src_first { dst } else { src })?;
    let accounts = if src_first { [first, second] } else { [second, first] };
    let seen = Seen { key, accounts };
    let answer = match plan(&seen) {
        Plan::Nothing => return Ok(End::Rollback(Executed::Nothing)),
        Plan::Refuse { answer, .. } => answer,
        Plan::Pay { payment, .. } => {
            let [Some(src), Some(dst)] = &seen.accounts else {
                return Err(StoreError::Backend("a transfer was planned without both accounts".into()));
            };
            let id = tx.insert_transfer(&NewTransfer {
                src: &src.id,
                dst: &dst.id,
                amount: payment.amount,
                currency: &payment.currency,
                created_at: x.at,
            })?;
            for (account, delta) in [(src, -payment.amount), (dst, payment.amount)] {
                let got = tx.add_to_balance(&account.id, delta)?;
                if Some(got) != account.balance.checked_add(delta) {
                    return Err(inexact(&account.id));
                }
            }
            payment.answer(id)
        }
    };
    if !tx.complete(x.key, x.token, &answer, x.at)? {
        // Cannot happen while the key is locked; if a store lets it, roll
        // back and read the key again.
        return Err(StoreError::Conflict);
    }
    if crash() {
        return Ok(End::Rollback(Executed::Crashed));
    }
    Ok(End::Commit(Executed::Completed(answer)))
}

/// A balance the column would not store as computed (a REAL beyond 2^53):
/// the whole execution rolls back rather than lose a unit.
pub(crate) fn inexact(id: &AcctId) -> StoreError {
    StoreError::Schema(format!(
        "account {:?}: the balance after this transfer is not what was computed; the balance column cannot hold it exactly",
        id.to_string()
    ))
}

/// The plain reads the service makes outside any request, on the stores
/// it runs (SQLite and PostgreSQL); the protocol itself needs only
/// [`Store`].
pub trait Reads: Store {
    /// The stored 201 body of transfer `transfer_id`, if a key of
    /// `client_id` made it (`GET /v1/transfers/{id}`). A plain read.
    fn transfer_for(&mut self, client_id: &str, transfer_id: i64) -> Result<Option<String>, StoreError>;
    /// Checks that the database answers (`/healthz`).
    fn ping(&mut self) -> Result<(), StoreError>;
    /// The key's committed record, by a plain read outside any transaction:
    /// no lock taken, none waited for (see `protocol::settled`).
    fn peek(&mut self, key: &ScopedKey) -> Result<Option<KeyRecord>, StoreError>;
}

impl<S: Reads + ?Sized> Reads for Box<S> {
    fn transfer_for(&mut self, client_id: &str, transfer_id: i64) -> Result<Option<String>, StoreError> {
        (**self).transfer_for(client_id, transfer_id)
    }
    fn ping(&mut self) -> Result<(), StoreError> {
        (**self).ping()
    }
    fn peek(&mut self, key: &ScopedKey) -> Result<Option<KeyRecord>, StoreError> {
        (**self).peek(key)
    }
}

impl<S: Store + ?Sized> Store for Box<S> {
    fn begin(&mut self, durability: Durability) -> Result<Box<dyn Tx + '_>, StoreError> {
        (**self).begin(durability)
    }
    fn audit(&mut self) -> Result<Audit, StoreError> {
        (**self).audit()
    }
    fn claim(
        &mut self,
        key: &ScopedKey,
        claim: &Claim,
        accounts: Option<[&AcctId; 2]>,
        policy: &Policy,
    ) -> Result<Option<KeyRecord>, StoreError> {
        (**self).claim(key, claim, accounts, policy)
    }
    fn execute(
        &mut self,
        x: Execution,
        plan: &mut dyn FnMut(&Seen) -> Plan,
        crash: &mut dyn FnMut() -> bool,
        policy: &Policy,
    ) -> Result<Executed, StoreError> {
        (**self).execute(x, plan, crash, policy)
    }
    fn replace_claim(
        &mut self,
        key: &ScopedKey,
        seen: &KeyRecord,
        claim: &Claim,
        policy: &Policy,
    ) -> Result<bool, StoreError> {
        (**self).replace_claim(key, seen, claim, policy)
    }
    fn release(&mut self, key: &ScopedKey, token: &str, policy: &Policy) -> Result<bool, StoreError> {
        (**self).release(key, token, policy)
    }
}

/// A key's steps, awaited: [`Store::claim`], [`Tx::replace_claim`] and
/// [`Tx::release`] with the same guarantees. The engine's stores (through
/// [`Blocking`]), the service's PostgreSQL pool and the library's lent
/// transactions each take them; `protocol::conduct` runs them, the one
/// conductor of claim → work → complete.
pub trait KeySteps {
    /// Inserts `claim` on `key` unless the key exists, and then returns its
    /// committed record (see [`Store::claim`]).
    fn claim(
        &mut self,
        key: &ScopedKey,
        claim: &Claim,
        accounts: Option<[&AcctId; 2]>,
    ) -> impl Future<Output = Result<Option<KeyRecord>, StoreError>>;
    /// Writes `claim` over the key if it is still the version `seen`.
    fn replace_claim(
        &mut self,
        key: &ScopedKey,
        seen: &KeyRecord,
        claim: &Claim,
    ) -> impl Future<Output = Result<bool, StoreError>>;
    /// Lets go of the claim `token` holds, its work undone: the engine
    /// deletes the key if `token` still holds it in progress; a lent
    /// transaction, where the claim was never committed, rolls back.
    fn release(&mut self, key: &ScopedKey, token: &str) -> impl Future<Output = Result<bool, StoreError>>;
}

/// The engine's steps of a request: the key's, and [`Store::execute`] (one
/// round trip on the service's pool).
// No `Send` bound on the futures: a caller that blocks needs none, and the
// service's, on a concrete connection, is `Send` as its steps are.
pub trait Steps: KeySteps {
    /// Runs one transfer under `x`'s claim: reads what [`Seen`] holds, writes what `plan` decides, completes the key in the same transaction; `crash` may stop it before the commit.
    fn execute(
        &mut self,
        x: Execution<'_>,
        plan: &mut impl FnMut(&Seen) -> Plan,
        crash: &mut impl FnMut() -> bool,
    ) -> impl Future<Output = Result<Executed, StoreError>>;
}

/// A store that is called, as [`Steps`]: each step runs to its end when
/// first polled, so a synchronous caller blocks on the conductor.
pub struct Blocking<'a, S: ?Sized> {
    store: &'a mut S,
    policy: &'a Policy,
}

impl<'a, S: Store + ?Sized> Blocking<'a, S> {
    /// `store` as steps, under `policy`.
    pub fn new(store: &'a mut S, policy: &'a Policy) -> Self {
        Blocking { store, policy }
    }
}

impl<S: Store + ?Sized> KeySteps for Blocking<'_, S> {
    async fn claim(
        &mut self,
        key: &ScopedKey,
        claim: &Claim,
        accounts: Option<[&AcctId; 2]>,
    ) -> Result<Option<KeyRecord>, StoreError> {
        self.store.claim(key, claim, accounts, self.policy)
    }

    async fn replace_claim(
        &mut self,
        key: &ScopedKey,
        seen: &KeyRecord,
        claim: &Claim,
    ) -> Result<bool, StoreError> {
        self.store.replace_claim(key, seen, claim, self.policy)
    }

    async fn release(&mut self, key: &ScopedKey, token: &str) -> Result<bool, StoreError> {
        self.store.release(key, token, self.policy)
    }
}

impl<S: Store + ?Sized> Steps for Blocking<'_, S> {
    async fn execute(
        &mut self,
        x: Execution<'_>,
        plan: &mut impl FnMut(&Seen) -> Plan,
        crash: &mut impl FnMut() -> bool,
    ) -> Result<Executed, StoreError> {
        self.store.execute(x, plan, crash, self.policy)
    }
}

/// How long a process keeps its store: SQLite tunes checkpoints for each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Usage {
    /// One request, then exit (`idem_api`).
    OneRequest,
    /// Many requests (`idem serve`, the harness).
    LongLived,
}

/// Opens `db`: a PostgreSQL database, or a SQLite file, which must exist.
#[cfg(feature = "cli")]
pub fn open(db: &Db, policy: &Policy, usage: Usage) -> Result<Box<dyn Store + Send>, StoreError> {
    Ok(match (db, usage) {
        (Db::Postgres(spec), _) => Box::new(pg::PgStore::connect(spec, policy)?),
        (Db::Sqlite(path), Usage::OneRequest) => {
            Box::new(sqlite::SqliteStore::open_for_one_request(path, policy)?)
        }
        (Db::Sqlite(path), Usage::LongLived) => Box::new(sqlite::SqliteStore::open(path, policy)?),
    })
}

/// One transaction of a store: every read and write the protocol makes, and its end.
pub trait Tx: PayoutTx {
    /// Inserts the claim unless the key exists (`ON CONFLICT DO NOTHING`);
    /// if it does, returns its committed record and changes nothing. A racer
    /// whose claim is not yet committed makes this wait for its outcome.
    fn insert_claim(&mut self, key: &ScopedKey, claim: &Claim) -> Result<Option<KeyRecord>, StoreError>;
    /// Overwrites the key with a fresh claim only if it is still the version
    /// `seen` (same token, same state); `false` if it changed. Never waits on
    /// a key whose execution is running: that is `false` at once.
    fn replace_claim(&mut self, key: &ScopedKey, seen: &KeyRecord, claim: &Claim)
    -> Result<bool, StoreError>;
    /// Reads the key and locks it to the end of the transaction, so it cannot
    /// be taken over, completed or purged under the caller.
    fn lock_key(&mut self, key: &ScopedKey) -> Result<Option<KeyRecord>, StoreError>;
    /// Marks the key completed with its response (and the response's
    /// transfer, if any) only if `token` still holds it in progress; `false`
    /// otherwise.
    fn complete(
        &mut self,
        key: &ScopedKey,
        token: &str,
        response: &Stored,
        at: Timestamp,
    ) -> Result<bool, StoreError>;
    /// Deletes the key if `token` still holds it in progress.
    fn release(&mut self, key: &ScopedKey, token: &str) -> Result<bool, StoreError>;
    /// Reads an account and locks it to the end of the transaction. Callers
    /// lock several accounts in ascending [`AcctId`] order.
    fn lock_account(&mut self, id: &AcctId) -> Result<Option<Account>, StoreError>;
    /// Adds `delta` to the balance of exactly one account and returns the
    /// stored result; an error (the caller rolls back) if no row or several
    /// rows match, or if the balance would go negative.
    fn add_to_balance(&mut self, id: &AcctId, delta: i64) -> Result<i64, StoreError>;
    /// Inserts a transfer and returns its `transfer_id`.
    fn insert_transfer(&mut self, transfer: &NewTransfer) -> Result<i64, StoreError>;
    /// Deletes up to `limit` keys created before `before`, oldest first;
    /// returns how many.
    fn purge(&mut self, before: Timestamp, limit: u64) -> Result<u64, StoreError>;
    /// Every key still `in_progress`, oldest first.
    fn in_progress(&mut self) -> Result<Vec<(ScopedKey, KeyRecord)>, StoreError>;
    /// Commits what the transaction wrote.
    fn commit(self: Box<Self>) -> Result<(), StoreError>;
}

/// How a unit of work ends: commit what it wrote, or roll it back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End<R> {
    /// Commit, and return this.
    Commit(R),
    /// Roll back, and return this.
    Rollback(R),
}

/// Runs `work` in one transaction and ends it as `work` says. A
/// [`StoreError::Conflict`] rolls back and runs `work` again (see
/// [`retrying`]); any other error rolls back and is returned.
pub fn atomically<S: Store + ?Sized, R>(
    store: &mut S,
    durability: Durability,
    policy: &Policy,
    mut work: impl FnMut(&mut dyn Tx) -> Result<End<R>, StoreError>,
) -> Result<R, StoreError> {
    let attempt = || {
        let mut tx = store.begin(durability)?;
        match work(tx.as_mut())? {
            End::Commit(r) => tx.commit().map(|()| r),
            End::Rollback(r) => Ok(r),
        }
    };
    match retrying(policy, |e| *e == StoreError::Conflict, attempt) {
        Err(StoreError::Conflict) => Err(StoreError::Busy),
        other => other,
    }
}

/// Runs `attempt` until it succeeds, fails with an error that is not
/// `transient`, or `policy.busy_timeout_ms` is spent, pausing between tries
/// for 200 µs, then twice as long each time up to 20 ms. Past the budget the
/// last transient error is returned.
pub fn retrying<R>(
    policy: &Policy,
    transient: impl Fn(&StoreError) -> bool,
    mut attempt: impl FnMut() -> Result<R, StoreError>,
) -> Result<R, StoreError> {
    let mut backoff = Backoff::new(policy);
    loop {
        match attempt() {
            Err(e) if transient(&e) => match backoff.pause() {
                Some(pause) => std::thread::sleep(pause),
                None => return Err(e),
            },
            other => return other,
        }
    }
}

/// The pauses between tries of [`retrying`] (and of the service's pool):
/// 200 µs, then twice as long each time up to 20 ms, while the busy budget
/// lasts.
pub struct Backoff {
    deadline: Instant,
    pause: Duration,
}

impl Backoff {
    /// A backoff within `policy`'s busy budget.
    pub fn new(policy: &Policy) -> Backoff {
        let deadline = Instant::now() + Duration::from_millis(u64::from(policy.busy_timeout_ms));
        Backoff { deadline, pause: Duration::from_micros(200) }
    }

    /// The pause before the next try, or `None` if it would end past the
    /// budget.
    pub fn pause(&mut self) -> Option<Duration> {
        let pause = self.pause;
        if Instant::now() + pause >= self.deadline {
            return None;
        }
        self.pause = (pause * 2).min(Duration::from_millis(20));
        Some(pause)
    }
}

#[cfg(test)]
mod tests;
