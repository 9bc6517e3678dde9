//! The rows of the key and transfer tables as the protocol reads and writes
//! them, and the SQL both stores speak about them.

use super::StoreError;
use crate::clock::Timestamp;
use crate::reason::Reason;
use crate::request::{AcctId, ScopedKey};

/// A response as stored at completion; `body` is the exact JSON text sent,
/// `transfer_id` the transfer it made, if any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    /// The HTTP status.
    pub status: u16,
    /// Why it is not a plain success, if it is not.
    pub reason: Option<Reason>,
    /// The exact JSON text sent.
    pub body: String,
    /// The transfer it made, if any.
    pub transfer_id: Option<i64>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
/// Where a key stands.
pub enum KeyState {
    /// Claimed; the claim may be taken over once `lease_until` has passed.
    InProgress {
        /// When the claim's lease runs out.
        lease_until: Timestamp,
    },
    /// Completed with this answer.
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
    pub(crate) const TRANSFERS: &str = "SELECT transfer_id, amount FROM transfer ORDER BY transfer_id";
    pub(crate) const ORPHANS: &str = "SELECT transfer_id, amount FROM transfer t WHERE NOT EXISTS
           (SELECT 1 FROM idem_key k WHERE k.transfer_id = t.transfer_id AND k.state = 'completed')
         ORDER BY transfer_id";
    /// The payouts' endpoint is bound as `$1`: a payout's 201 names no transfer.
    pub(crate) const HOLLOW: &str = "SELECT COUNT(*) FROM idem_key WHERE state = 'completed' AND status = 201
           AND endpoint <> $1 AND (transfer_id IS NULL OR transfer_id NOT IN (SELECT transfer_id FROM transfer))";
    pub(crate) const IN_PROGRESS: &str = "SELECT COUNT(*) FROM idem_key WHERE state = 'in_progress'";
    pub(crate) const COMPLETED: &str = "SELECT COUNT(*) FROM idem_key WHERE state = 'completed'";
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
    pub(crate) fn decode(self) -> Result<KeyRecord, StoreError> {
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
    /// SHA-256 hex of the RFC 8785 form of the first request's body.
    pub fingerprint: String,
    /// When the key was claimed (its retention counts from here).
    pub created_at: Timestamp,
    /// The claiming attempt's token.
    pub token: String,
    /// In progress, or completed with its answer.
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
    /// The fingerprint of the request claiming it.
    pub fingerprint: String,
    /// Unique to the claiming attempt; only its holder may complete the key.
    pub token: String,
    /// When it is claimed.
    pub created_at: Timestamp,
    /// Until when the claim blocks a retry.
    pub lease_until: Timestamp,
}

/// An account as the ledger sees it; `id` is `acct_id` as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Account {
    /// `acct_id` as stored.
    pub id: AcctId,
    /// In the currency's smallest unit.
    pub balance: i64,
}

/// What a decision about an account's row rests on: the row absent, or its
/// balance within `lo..=hi`. A store that reads before it locks (PostgreSQL)
/// writes only if every premise still holds under the lock; one that locks
/// as it reads has them hold by construction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Premise {
    /// The row does not exist.
    Absent,
    /// The row exists with a balance in `lo..=hi`.
    Between {
        /// The lowest balance the premise allows.
        lo: i64,
        /// The highest.
        hi: i64,
    },
}

impl Premise {
    /// Any balance, as long as the row exists.
    pub const PRESENT: Premise = Premise::Between { lo: i64::MIN, hi: i64::MAX };

    /// Whether `account` (`None`: no row) is as this premise says.
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
    /// The key it completes.
    pub key: &'a ScopedKey,
    /// The claim's token: only its holder may complete the key.
    pub token: &'a str,
    /// `[src, dst]`, as the request names them.
    pub accounts: [&'a AcctId; 2],
    /// The time of the execution.
    pub at: Timestamp,
}

/// What an execution decides on: the key, and the accounts `[src, dst]`
/// (`None`: no such row), as they stand.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seen {
    /// The key's record, if it exists.
    pub key: Option<KeyRecord>,
    /// `[src, dst]`; `None`: no such row.
    pub accounts: [Option<Account>; 2],
}

/// The head of a 201's body, before the id of the transfer it names.
pub const CREATED_HEAD: &str = r#"{"transfer_id":"#;

/// A transfer an execution makes, and the 201 that will name it: the body
/// is [`CREATED_HEAD`], the new `transfer_id`, then `body_tail`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Payment {
    /// In the currency's smallest unit.
    pub amount: i64,
    /// An ISO 4217 code.
    pub currency: String,
    /// The 201's body after the transfer's id.
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
    /// Write nothing (the key is not this attempt's any more).
    Nothing,
    /// Complete the key with a refusal.
    Refuse {
        /// The refusal, stored with the key.
        answer: Stored,
        /// What the refusal rests on, for `[src, dst]`.
        premises: [Premise; 2],
    },
    /// Make the transfer and complete the key with its 201.
    Pay {
        /// The transfer, and the 201 that will name it.
        payment: Payment,
        /// What the payment rests on, for `[src, dst]`.
        premises: [Premise; 2],
    },
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
    /// The account debited.
    pub src: &'a AcctId,
    /// The account credited.
    pub dst: &'a AcctId,
    /// In the currency's smallest unit.
    pub amount: i64,
    /// An ISO 4217 code.
    pub currency: &'a str,
    /// When it was made.
    pub created_at: Timestamp,
}

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
    /// Keys still claimed.
    pub keys_in_progress: i64,
    /// Keys completed.
    pub keys_completed: i64,
}

impl Audit {
    /// All the money there is: the sum of every balance.
    pub fn money(&self) -> i64 {
        self.balances.iter().map(|(_, b)| b).sum()
    }

    /// The balance of account `id`, if it exists.
    pub fn balance(&self, id: &AcctId) -> Option<i64> {
        self.balances.iter().find(|(a, _)| a == id).map(|(_, b)| *b)
    }
}
