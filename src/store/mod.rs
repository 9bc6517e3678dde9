//! What the protocol needs from storage, in the protocol's own words.
//!
//! A store hands out write transactions that exclude every other writer
//! (SQLite's `BEGIN IMMEDIATE`, a mutex in the loom model, row locks in
//! PostgreSQL). Inside one, the protocol claims keys, reads and moves money
//! and completes keys; nothing is visible to anyone else until `commit`, and
//! dropping a transaction rolls it back. All SQL lives below this module.

pub mod sqlite;

use crate::clock::Timestamp;
use crate::request::{AcctId, ScopedKey};
use std::fmt;

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
    /// Another writer held the lock for longer than the busy budget.
    Busy,
    /// The database is not one the engine can use (no account table, a
    /// schema of another version, a balance that is not an integer).
    Schema(String),
    /// Anything else the backend reported: I/O, corruption, read-only file.
    Backend(String),
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Busy => f.write_str("database is busy: lock wait exceeded busy_timeout_ms"),
            StoreError::Schema(why) | StoreError::Backend(why) => f.write_str(why),
        }
    }
}

impl std::error::Error for StoreError {}

/// A response as stored at completion; `body` is the exact JSON text sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    pub status: u16,
    pub reason: Option<String>,
    pub body: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyState {
    InProgress { token: String, lease_until: Timestamp },
    Completed(Stored),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyRecord {
    pub fingerprint: String,
    pub created_at: Timestamp,
    pub state: KeyState,
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

/// A transfer row to insert; `src`/`dst` are the stored account ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewTransfer<'a> {
    pub src: &'a AcctId,
    pub dst: &'a AcctId,
    pub amount: i64,
    pub currency: &'a str,
    pub created_at: Timestamp,
}

pub trait Store {
    type Tx<'a>: Tx
    where
        Self: 'a;

    /// Starts a transaction that excludes all other writers until it ends.
    fn begin(&mut self, durability: Durability) -> Result<Self::Tx<'_>, StoreError>;
}

pub trait Tx {
    /// Inserts the claim. If the key already exists — the primary key says
    /// so, never an earlier lookup — returns its record and changes nothing.
    fn insert_claim(&mut self, key: &ScopedKey, claim: &Claim) -> Result<Option<KeyRecord>, StoreError>;
    /// Overwrites an existing key with a fresh claim (stale lease, expired key).
    fn replace_claim(&mut self, key: &ScopedKey, claim: &Claim) -> Result<(), StoreError>;
    fn key(&mut self, key: &ScopedKey) -> Result<Option<KeyRecord>, StoreError>;
    /// Marks the key completed with its response and, if any, its transfer.
    fn complete(
        &mut self,
        key: &ScopedKey,
        response: &Stored,
        transfer_id: Option<i64>,
        at: Timestamp,
    ) -> Result<(), StoreError>;
    fn account(&mut self, id: &AcctId) -> Result<Option<Account>, StoreError>;
    fn set_balance(&mut self, id: &AcctId, balance: i64) -> Result<(), StoreError>;
    /// Inserts a transfer and returns its `transfer_id`.
    fn insert_transfer(&mut self, transfer: &NewTransfer) -> Result<i64, StoreError>;
    /// Deletes every key created before `before`; returns how many.
    fn purge(&mut self, before: Timestamp) -> Result<u64, StoreError>;
    /// Every key still `in_progress`, oldest first.
    fn in_progress(&mut self) -> Result<Vec<(ScopedKey, KeyRecord)>, StoreError>;
    /// Deletes the key if it is still in progress under `token`.
    fn release(&mut self, key: &ScopedKey, token: &str) -> Result<bool, StoreError>;
    fn commit(self) -> Result<(), StoreError>;
}
