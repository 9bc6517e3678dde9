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
//! back. All SQL lives below this module.

pub mod bank;
mod db;
pub mod pg;
pub mod pg_pool;
pub mod sqlite;
pub mod workers;

pub use db::Db;
pub use pg_pool::{Pool, Pooled};
pub use workers::{GroupTx, GroupWriter, Workers};

use crate::clock::Timestamp;
use crate::policy::Policy;
use crate::reason::Reason;
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

/// A response as stored at completion; `body` is the exact JSON text sent,
/// `transfer_id` the transfer it made, if any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    pub status: u16,
    pub reason: Option<Reason>,
    pub body: String,
    pub transfer_id: Option<i64>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyState {
    InProgress { lease_until: Timestamp },
    Completed(Stored),
}

impl KeyState {
    /// The state as the key tables spell it.
    pub fn name(&self) -> &'static str {
        match self {
            KeyState::InProgress { .. } => "in_progress",
            KeyState::Completed(_) => "completed",
        }
    }
}

/// The keys a purge may delete, besides their age: never the claim of a
/// payout (`in_progress` while its payout is open: the gateway may have
/// paid under it). Both stores speak it, with the payouts' endpoint
/// ([`PAYOUTS`](crate::request::PAYOUTS)) bound as its third parameter.
pub(crate) const PURGEABLE: &str = "NOT (state = 'in_progress' AND endpoint = $3)";

/// The queries of [`Store::audit`], in SQL both stores speak.
pub(crate) mod audit_sql {
    pub const TRANSFERS: &str = "SELECT transfer_id, amount FROM transfer ORDER BY transfer_id";
    pub const ORPHANS: &str = "SELECT transfer_id, amount FROM transfer t WHERE NOT EXISTS
           (SELECT 1 FROM idem_key k WHERE k.transfer_id = t.transfer_id AND k.state = 'completed')
         ORDER BY transfer_id";
    /// The payouts' endpoint is bound as `$1`: a payout's 201 names no transfer.
    pub const HOLLOW: &str = "SELECT COUNT(*) FROM idem_key WHERE state = 'completed' AND status = 201
           AND endpoint <> $1 AND (transfer_id IS NULL OR transfer_id NOT IN (SELECT transfer_id FROM transfer))";
    pub const IN_PROGRESS: &str = "SELECT COUNT(*) FROM idem_key WHERE state = 'in_progress'";
    pub const COMPLETED: &str = "SELECT COUNT(*) FROM idem_key WHERE state = 'completed'";
}

/// The columns an existing `transfer` table must have for a store to use it.
pub(crate) const TRANSFER_COLUMNS: [&str; 6] =
    ["transfer_id", "src", "dst", "amount", "currency", "created_at"];

/// The columns an existing `idem_key` table must have for a store to use it.
pub(crate) const KEY_COLUMNS: [&str; 13] = [
    "client_id",
    "endpoint",
    "idem_key",
    "fingerprint",
    "state",
    "token",
    "created_at",
    "lease_until",
    "status",
    "reason",
    "body",
    "transfer_id",
    "completed_at",
];

/// The columns a key's record is read from, in this order, on every store.
pub(crate) const RECORD_COLUMNS: &str =
    "fingerprint, created_at, token, state, lease_until, status, reason, body, transfer_id";

/// A key's row as a store reads it, columns of [`RECORD_COLUMNS`] in order,
/// before it is checked: each store fills one, [`KeyRow::decode`] reads it.
pub(crate) struct KeyRow {
    pub fingerprint: String,
    pub created_at: String,
    pub token: String,
    pub state: String,
    pub lease_until: String,
    pub status: Option<i64>,
    pub reason: Option<String>,
    pub body: Option<String>,
    pub transfer_id: Option<i64>,
}

impl KeyRow {
    /// The record, or why the row is not one the engine can have written.
    pub fn decode(self) -> Result<KeyRecord, StoreError> {
        let corrupt = |why: String| StoreError::Backend(format!("corrupt idem_key row: {why}").into());
        let time = |text: &str| Timestamp::parse(text).map_err(|e| corrupt(e.to_string()));
        let state = match (self.state.as_str(), self.status, self.body) {
            ("in_progress", _, _) => KeyState::InProgress { lease_until: time(&self.lease_until)? },
            ("completed", Some(status), Some(body)) => KeyState::Completed(Stored {
                status: u16::try_from(status).map_err(|_| corrupt(format!("status {status}")))?,
                reason: self.reason.as_deref().map(Reason::parse),
                body,
                transfer_id: self.transfer_id,
            }),
            (other, ..) => return Err(corrupt(format!("state {other:?} without its response"))),
        };
        Ok(KeyRecord {
            fingerprint: self.fingerprint,
            created_at: time(&self.created_at)?,
            token: self.token,
            state,
        })
    }
}

/// A key's row. `token` and `state` together name one version of it: the
/// attempt that claimed it, before or after completing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRecord {
    pub fingerprint: String,
    pub created_at: Timestamp,
    pub token: String,
    pub state: KeyState,
}

impl KeyRecord {
    /// Whether the attempt holding `token` holds this key in progress.
    pub fn held_by(&self, token: &str) -> bool {
        self.token == token && matches!(self.state, KeyState::InProgress { .. })
    }
}

/// A fresh `in_progress` claim on a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub fingerprint: String,
    /// Unique to the claiming attempt; only its holder may complete the key.
    pub token: String,
    pub created_at: Timestamp,
    pub lease_until: Timestamp,
}

/// An account as the ledger sees it; `id` is `acct_id` as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Account {
    pub id: AcctId,
    pub balance: i64,
}

/// What a decision about an account's row rests on: the row absent, or its
/// balance within `lo..=hi`. A store that reads before it locks (PostgreSQL)
/// writes only if every premise still holds under the lock; one that locks
/// as it reads has them hold by construction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Premise {
    Absent,
    Between { lo: i64, hi: i64 },
}

impl Premise {
    /// Any balance, as long as the row exists.
    pub const PRESENT: Premise = Premise::Between { lo: i64::MIN, hi: i64::MAX };

    pub fn holds(self, account: Option<&Account>) -> bool {
        match (self, account) {
            (Premise::Absent, None) => true,
            (Premise::Between { lo, hi }, Some(a)) => (lo..=hi).contains(&a.balance),
            _ => false,
        }
    }
}

/// One execution: the claim it runs under and the accounts it decides on.
#[derive(Debug, Clone, Copy)]
pub struct Execution<'a> {
    pub key: &'a ScopedKey,
    /// The claim's token: only its holder may complete the key.
    pub token: &'a str,
    /// `[src, dst]`, as the request names them.
    pub accounts: [&'a AcctId; 2],
    pub at: Timestamp,
}

/// What an execution decides on: the key, and the accounts `[src, dst]`
/// (`None`: no such row), as they stand.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    pub key: Option<KeyRecord>,
    pub accounts: [Option<Account>; 2],
}

/// The head of a 201's body, before the id of the transfer it names.
pub const CREATED_HEAD: &str = r#"{"transfer_id":"#;

/// A transfer an execution makes, and the 201 that will name it: the body
/// is [`CREATED_HEAD`], the new `transfer_id`, then `body_tail`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Payment {
    pub amount: i64,
    pub currency: String,
    pub body_tail: String,
}

impl Payment {
    /// The answer stored once the transfer exists as `transfer_id`.
    pub fn answer(&self, transfer_id: i64) -> Stored {
        let body = format!("{CREATED_HEAD}{transfer_id}{}", self.body_tail);
        Stored { status: 201, reason: None, body, transfer_id: Some(transfer_id) }
    }
}

/// What an execution writes, as the protocol planned it from a [`Seen`]:
/// nothing, or the key's completion with a refusal, or with a transfer.
/// `premises` (for `[src, dst]`) are what the plan rests on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    Nothing,
    Refuse { answer: Stored, premises: [Premise; 2] },
    Pay { payment: Payment, premises: [Premise; 2] },
}

/// How an execution ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Executed {
    /// The plan was [`Plan::Nothing`]: nothing written.
    Nothing,
    /// The hook asked for a crash before the commit: nothing written.
    Crashed,
    /// Committed: the key completed with this answer.
    Completed(Stored),
}

/// A transfer row to insert; `src`/`dst` are the stored account ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewTransfer<'a> {
    pub src: &'a AcctId,
    pub dst: &'a AcctId,
    pub amount: i64,
    pub currency: &'a str,
    pub created_at: Timestamp,
}

/// Where a payout stands (the transitions are `src/payout/`'s, listed in
/// `docs/payouts.md`). The money is held (debited from `src`) while it is
/// `InProgress` (a call to the gateway may be under way), `Unknown` (a call
/// ended without a definitive answer: looked up and resent with backoff) or
/// `NeedsAttention` (an answer no resend can fix: a person settles it).
/// `Completed`: the gateway paid. `Failed`: it refused for good, the hold
/// went back to `src`. `Returned`: paid, then the money came back (a bank
/// return, a reversal), credited back to `src`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum PayoutState {
    InProgress,
    Unknown,
    NeedsAttention,
    Completed,
    Failed,
    Returned,
}

impl PayoutState {
    pub const ALL: [PayoutState; 6] = [
        PayoutState::InProgress,
        PayoutState::Unknown,
        PayoutState::NeedsAttention,
        PayoutState::Completed,
        PayoutState::Failed,
        PayoutState::Returned,
    ];

    pub fn name(self) -> &'static str {
        match self {
            PayoutState::InProgress => "in_progress",
            PayoutState::Unknown => "unknown",
            PayoutState::NeedsAttention => "needs_attention",
            PayoutState::Completed => "completed",
            PayoutState::Failed => "failed",
            PayoutState::Returned => "returned",
        }
    }

    pub fn parse(text: &str) -> Result<PayoutState, StoreError> {
        PayoutState::ALL
            .into_iter()
            .find(|s| s.name() == text)
            .ok_or_else(|| StoreError::Backend(format!("corrupt payout row: state {text:?}").into()))
    }

    /// Whether the outcome is known: the hold was paid out or went back.
    pub fn settled(self) -> bool {
        matches!(self, PayoutState::Completed | PayoutState::Failed | PayoutState::Returned)
    }
}

/// A payout's row: the intent and where it stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PayoutRow {
    pub id: i64,
    /// The idempotency key it was made under, and the request's fingerprint.
    pub key: ScopedKey,
    pub fingerprint: String,
    pub src: AcctId,
    pub beneficiary: String,
    pub amount: i64,
    pub currency: String,
    /// The key the gateway sees: derived from this row, never the client's.
    pub downstream_key: String,
    pub state: PayoutState,
    /// Who may call the gateway for it now (a request, or a reconciler)…
    pub holder: String,
    /// …until then; for an `Unknown` payout, when it is next looked at.
    pub lease_until: Timestamp,
    pub created_at: Timestamp,
    pub updated_at: Timestamp,
    /// The last thing learnt: the gateway's reason, or why it is unknown.
    pub note: Option<String>,
    /// The HTTP status of the settled answer (201, or the refusal's).
    pub status: Option<u16>,
    /// How many times it was sent to the gateway (counted before each send).
    pub sends: i64,
    /// How many times a reconciler took it (its backoff grows with them).
    pub attempts: i64,
    /// The provider's own id for the payout, once known.
    pub provider_id: Option<String>,
}

/// A payout's row as a store reads it, before it is checked: each store
/// fills one, [`PayoutText::decode`] reads it.
pub(crate) struct PayoutText {
    pub id: i64,
    pub key: ScopedKey,
    pub fingerprint: String,
    pub src: AcctId,
    pub beneficiary: String,
    pub amount: i64,
    pub currency: String,
    pub downstream_key: String,
    pub state: String,
    pub holder: String,
    pub lease_until: String,
    pub created_at: String,
    pub updated_at: String,
    pub note: Option<String>,
    pub status: Option<i64>,
    pub sends: i64,
    pub attempts: i64,
    pub provider_id: Option<String>,
}

impl PayoutText {
    pub fn decode(self) -> Result<PayoutRow, StoreError> {
        let corrupt = |why: String| StoreError::Backend(format!("corrupt payout row: {why}").into());
        let time = |text: &str| Timestamp::parse(text).map_err(|e| corrupt(e.to_string()));
        Ok(PayoutRow {
            id: self.id,
            key: self.key,
            fingerprint: self.fingerprint,
            src: self.src,
            beneficiary: self.beneficiary,
            amount: self.amount,
            currency: self.currency,
            downstream_key: self.downstream_key,
            state: PayoutState::parse(&self.state)?,
            holder: self.holder,
            lease_until: time(&self.lease_until)?,
            created_at: time(&self.created_at)?,
            updated_at: time(&self.updated_at)?,
            note: self.note,
            status: self
                .status
                .map(|s| u16::try_from(s).map_err(|_| corrupt(format!("status {s}"))))
                .transpose()?,
            sends: self.sends,
            attempts: self.attempts,
            provider_id: self.provider_id,
        })
    }
}

/// A provider event as `gateway_event` keeps it: its id, when it came, its
/// type, the downstream key it names, and what it did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatewayEventRow {
    pub event_id: String,
    pub received_at: String,
    pub kind: String,
    pub downstream_key: String,
    pub outcome: String,
}

/// The events a person must look at, in SQL both stores speak.
pub(crate) const EVENTS_FOR_A_PERSON: &str = "SELECT event_id, received_at, kind, downstream_key, outcome
     FROM gateway_event WHERE outcome LIKE 'needs a person%' ORDER BY received_at, event_id LIMIT ";

/// The payouts in one state, for the metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PayoutStat {
    pub state: PayoutState,
    pub count: i64,
    pub oldest: Timestamp,
    pub sends: i64,
    pub most_sends: i64,
}

/// [`PayoutStat`]s, in SQL both stores speak.
pub(crate) const PAYOUT_STATS: &str =
    "SELECT state, COUNT(*), MIN(created_at), CAST(SUM(sends) AS BIGINT), CAST(MAX(sends) AS BIGINT)
     FROM payout GROUP BY state ORDER BY state";

pub(crate) fn payout_stat(
    state: &str,
    count: i64,
    oldest: &str,
    sends: i64,
    most_sends: i64,
) -> Result<PayoutStat, StoreError> {
    let oldest = Timestamp::parse(oldest)
        .map_err(|e| StoreError::Backend(format!("corrupt payout row: {e}").into()))?;
    Ok(PayoutStat { state: PayoutState::parse(state)?, count, oldest, sends, most_sends })
}

/// One change of a payout's state, as its audit trail keeps it: who, when,
/// from what to what, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PayoutEvent {
    pub payout_id: i64,
    pub at: Timestamp,
    pub actor: String,
    pub was: PayoutState,
    pub now: PayoutState,
    pub why: String,
}

/// The payout tables, in SQL both stores speak but for the key column and
/// the types each store fills in (`{id}`: the payout id's type and default;
/// `{src}`: the account id's type; `{time}`: a timestamp's text type).
pub(crate) const PAYOUT_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS payout (
    payout_id      {id} PRIMARY KEY,
    client_id      text NOT NULL,
    endpoint       text NOT NULL,
    idem_key       text NOT NULL,
    fingerprint    text NOT NULL,
    src            {src} NOT NULL,
    beneficiary    text NOT NULL,
    amount         bigint NOT NULL CHECK ({amount} AND amount > 0),
    currency       text NOT NULL,
    downstream_key text NOT NULL UNIQUE,
    state          text NOT NULL CHECK (state IN ('in_progress', 'unknown', 'needs_attention', 'completed', 'failed', 'returned')),
    holder         text NOT NULL,
    lease_until    {time} NOT NULL,
    created_at     {time} NOT NULL,
    updated_at     {time} NOT NULL,
    note           text,
    status         integer,
    sends          integer NOT NULL DEFAULT 0,
    attempts       integer NOT NULL DEFAULT 0,
    provider_id    text,
    CHECK ((state IN ('completed', 'failed', 'returned')) = (status IS NOT NULL)));
CREATE INDEX IF NOT EXISTS payout_key ON payout (client_id, endpoint, idem_key);
CREATE INDEX IF NOT EXISTS payout_open ON payout (state, lease_until);
CREATE TABLE IF NOT EXISTS payout_event (
    event_id  {id} PRIMARY KEY,
    payout_id bigint NOT NULL,
    at        {time} NOT NULL,
    actor     text NOT NULL,
    was       text NOT NULL,
    now       text NOT NULL,
    why       text NOT NULL);
CREATE INDEX IF NOT EXISTS payout_event_of ON payout_event (payout_id, event_id);
CREATE TABLE IF NOT EXISTS gateway_event (
    event_id       text PRIMARY KEY,
    received_at    {time} NOT NULL,
    kind           text NOT NULL,
    downstream_key text NOT NULL,
    outcome        text NOT NULL);
";

/// The columns of `payout` before its second version (no `needs_attention`
/// nor `returned`, no sends, attempts or provider id): what a migration copies.
pub(crate) const PAYOUT_V1_COLUMNS: &str =
    "payout_id, client_id, endpoint, idem_key, fingerprint, src, beneficiary,
    amount, currency, downstream_key, state, holder, lease_until, created_at, updated_at, note, status";

/// Everything the harness reads back to judge a run: the ledger and how it
/// ties to the keys. Read-only, for tests, `idem prove` and `idem check`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Audit {
    /// Every account, ordered by id.
    pub balances: Vec<(AcctId, i64)>,
    /// `(transfer_id, amount)` of every transfer, ordered by id.
    pub transfers: Vec<(i64, i64)>,
    /// Transfers that no completed key names (money moved without a key).
    pub orphans: Vec<i64>,
    /// Completed keys whose 201 names a transfer that does not exist.
    pub hollow: i64,
    pub keys_in_progress: i64,
    pub keys_completed: i64,
}

impl Audit {
    pub fn money(&self) -> i64 {
        self.balances.iter().map(|(_, b)| b).sum()
    }

    pub fn balance(&self, id: &AcctId) -> Option<i64> {
        self.balances.iter().find(|(a, _)| a == id).map(|(_, b)| *b)
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
pub fn open(db: &Db, policy: &Policy, usage: Usage) -> Result<Box<dyn Store + Send>, StoreError> {
    Ok(match (db, usage) {
        (Db::Postgres(spec), _) => Box::new(pg::PgStore::connect(spec, policy)?),
        (Db::Sqlite(path), Usage::OneRequest) => {
            Box::new(sqlite::SqliteStore::open_for_one_request(path, policy)?)
        }
        (Db::Sqlite(path), Usage::LongLived) => Box::new(sqlite::SqliteStore::open(path, policy)?),
    })
}

pub trait Tx {
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
    fn commit(self: Box<Self>) -> Result<(), StoreError>;

    // Payouts. A store without them (the models under `tests/`) says so.

    /// Creates the `payout` table if it is not there.
    fn ensure_payouts(&mut self) -> Result<(), StoreError> {
        Err(no_payouts())
    }
    /// Inserts a payout (its `id` is ignored) and returns its id.
    fn insert_payout(&mut self, _row: &PayoutRow) -> Result<i64, StoreError> {
        Err(no_payouts())
    }
    /// The newest payout made under `key`, locked.
    fn payout_of(&mut self, _key: &ScopedKey) -> Result<Option<PayoutRow>, StoreError> {
        Err(no_payouts())
    }
    /// The payout `id`, locked.
    fn payout(&mut self, _id: i64) -> Result<Option<PayoutRow>, StoreError> {
        Err(no_payouts())
    }
    /// The payout `id` as last committed, not locked (a plain read).
    fn peek_payout(&mut self, id: i64) -> Result<Option<PayoutRow>, StoreError> {
        self.payout(id)
    }
    /// Writes `row`'s state, holder, lease, note, status, sends, attempts and
    /// provider id only if its holder is still `seen_holder`; `false` if
    /// another took it.
    fn update_payout(&mut self, _row: &PayoutRow, _seen_holder: &str) -> Result<bool, StoreError> {
        Err(no_payouts())
    }
    /// Payouts `in_progress` or `unknown` whose lease has run out at `now`,
    /// oldest first; with `all`, every payout not settled.
    fn payouts_open(&mut self, _now: Timestamp, _all: bool) -> Result<Vec<PayoutRow>, StoreError> {
        Err(no_payouts())
    }
    /// Up to `limit` completed payouts paid at or after `paid_since` and
    /// last checked (their lease) at or before `checked_before`, oldest first.
    fn payouts_paid_due(
        &mut self,
        _checked_before: Timestamp,
        _paid_since: Timestamp,
        _limit: i64,
    ) -> Result<Vec<PayoutRow>, StoreError> {
        Err(no_payouts())
    }
    /// The payout the gateway knows by `downstream_key`, as last committed,
    /// not locked (whoever writes it locks its key, then [`Tx::payout`]).
    fn payout_by_downstream_key(&mut self, _key: &str) -> Result<Option<PayoutRow>, StoreError> {
        Err(no_payouts())
    }
    /// Records a provider event once: `false` if its id was recorded before.
    fn insert_gateway_event(
        &mut self,
        _event_id: &str,
        _at: Timestamp,
        _kind: &str,
        _downstream_key: &str,
        _outcome: &str,
    ) -> Result<bool, StoreError> {
        Err(no_payouts())
    }
    /// Per state: how many payouts, the oldest's creation, their sends in
    /// all and the most of one.
    fn payout_stats(&mut self) -> Result<Vec<PayoutStat>, StoreError> {
        Err(no_payouts())
    }
    /// Up to `limit` provider events that moved no money and need a person
    /// (no payout of ours, another amount), oldest first.
    fn gateway_events_for_a_person(&mut self, _limit: i64) -> Result<Vec<GatewayEventRow>, StoreError> {
        Err(no_payouts())
    }
    /// Up to `limit` payouts in `state`, oldest first.
    fn payouts_in(&mut self, _state: PayoutState, _limit: i64) -> Result<Vec<PayoutRow>, StoreError> {
        Err(no_payouts())
    }
    /// Appends to a payout's audit trail.
    fn insert_payout_event(&mut self, _event: &PayoutEvent) -> Result<(), StoreError> {
        Err(no_payouts())
    }
    /// A payout's audit trail, oldest first.
    fn payout_events(&mut self, _payout_id: i64) -> Result<Vec<PayoutEvent>, StoreError> {
        Err(no_payouts())
    }
}

fn no_payouts() -> StoreError {
    StoreError::Schema("this store keeps no payouts".into())
}

/// How a unit of work ends: commit what it wrote, or roll it back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End<R> {
    Commit(R),
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
mod tests {
    use super::*;

    /// A store whose commits fail with a conflict until `conflicts` is spent.
    struct Flaky {
        conflicts: u32,
        attempts: u32,
    }

    struct FlakyTx<'a>(&'a mut Flaky);

    impl Store for Flaky {
        fn begin(&mut self, _: Durability) -> Result<Box<dyn Tx + '_>, StoreError> {
            self.attempts += 1;
            Ok(Box::new(FlakyTx(self)))
        }
        fn audit(&mut self) -> Result<Audit, StoreError> {
            Ok(Audit::default())
        }
    }

    impl Tx for FlakyTx<'_> {
        fn insert_claim(&mut self, _: &ScopedKey, _: &Claim) -> Result<Option<KeyRecord>, StoreError> {
            Ok(None)
        }
        fn replace_claim(&mut self, _: &ScopedKey, _: &KeyRecord, _: &Claim) -> Result<bool, StoreError> {
            Ok(true)
        }
        fn lock_key(&mut self, _: &ScopedKey) -> Result<Option<KeyRecord>, StoreError> {
            Ok(None)
        }
        fn complete(&mut self, _: &ScopedKey, _: &str, _: &Stored, _: Timestamp) -> Result<bool, StoreError> {
            Ok(true)
        }
        fn release(&mut self, _: &ScopedKey, _: &str) -> Result<bool, StoreError> {
            Ok(true)
        }
        fn lock_account(&mut self, _: &AcctId) -> Result<Option<Account>, StoreError> {
            Ok(None)
        }
        fn add_to_balance(&mut self, _: &AcctId, _: i64) -> Result<i64, StoreError> {
            Ok(0)
        }
        fn insert_transfer(&mut self, _: &NewTransfer) -> Result<i64, StoreError> {
            Ok(1)
        }
        fn purge(&mut self, _: Timestamp, _: u64) -> Result<u64, StoreError> {
            Ok(0)
        }
        fn in_progress(&mut self) -> Result<Vec<(ScopedKey, KeyRecord)>, StoreError> {
            Ok(Vec::new())
        }
        fn commit(self: Box<Self>) -> Result<(), StoreError> {
            match self.0.conflicts {
                0 => Ok(()),
                _ => {
                    self.0.conflicts -= 1;
                    Err(StoreError::Conflict)
                }
            }
        }
    }

    fn policy(busy_timeout_ms: u32) -> Policy {
        Policy { busy_timeout_ms, ..Policy::embedded().clone() }
    }

    #[test]
    fn a_conflict_runs_the_work_again_until_it_commits() {
        let mut store = Flaky { conflicts: 3, attempts: 0 };
        let got = atomically(&mut store, Durability::Lazy, &policy(5_000), |_| Ok(End::Commit(7)));
        assert_eq!((got, store.attempts), (Ok(7), 4));
        // a rollback is an answer, not a conflict: one attempt
        let mut store = Flaky { conflicts: 3, attempts: 0 };
        let got = atomically(&mut store, Durability::Lazy, &policy(5_000), |_| Ok(End::Rollback(8)));
        assert_eq!((got, store.attempts), (Ok(8), 1));
    }

    #[test]
    fn conflicts_past_the_busy_budget_are_busy_after_a_growing_pause() {
        let mut store = Flaky { conflicts: u32::MAX, attempts: 0 };
        let started = Instant::now();
        let got = atomically(&mut store, Durability::Lazy, &policy(100), |_| Ok(End::Commit(())));
        let waited = started.elapsed();
        assert_eq!(got, Err(StoreError::Busy));
        assert!(waited >= Duration::from_millis(40) && waited < Duration::from_millis(400), "{waited:?}");
        // 0.2, 0.4, 0.8 … ms doubling to 20 ms: about ten attempts in 100 ms
        assert!((5..=16).contains(&store.attempts), "{} attempts", store.attempts);
    }
}
