//! The embedded SQLite store: schema, pragmas, transactions.
//!
//! The database arrives holding only `account(acct_id, holder, balance)`;
//! the first call creates `transfer` and `idem_key` and stamps
//! `PRAGMA user_version`. Every open, not only the first, checks what the
//! engine's guarantees rest on and refuses the file otherwise: WAL (a FULL
//! commit in rollback-journal mode is not power-safe, so a file switched
//! away from WAL is switched back), a unique `acct_id` (or one transfer
//! would update every duplicate row), and no triggers on the engine's tables
//! (or a write could do more than the engine wrote).
//!
//! SQLite has one writer: `BEGIN IMMEDIATE` takes the write lock for the
//! whole transaction, so every locking read and compare-and-set of the store
//! contract holds trivially. The claim commits with `synchronous=NORMAL`
//! (no fsync) and the money-moving commit with `FULL` (see the protocol
//! module for why that is safe).

use super::{
    Account, Audit, Claim, Dialect, Durability, Failure, KeyRecord, KeyTable, NewTransfer, PAYOUT_V1_COLUMNS,
    PayoutEvent, PayoutRow, PayoutStat, PayoutState, PayoutText, Reads, Store, StoreError, Stored, Tx,
    audit_sql,
};
use crate::clock::Timestamp;
use crate::policy::Policy;
use crate::request::{AcctId, MAX_EXACT_INT, PAYOUTS, ScopedKey};
use rusqlite::config::DbConfig;
use rusqlite::types::{ToSqlOutput, Value, ValueRef};
use rusqlite::{Connection, ErrorCode, OpenFlags, OptionalExtension, Row, ToSql};
use std::path::Path;
use std::time::Duration;

mod group;
mod payouts;
mod schema;

pub use group::Group;
pub use schema::SCHEMA_VERSION;
use schema::*;

/// WAL pages between automatic checkpoints for one-request processes.
const ONE_REQUEST_CHECKPOINT_PAGES: i64 = 64;

/// Prepared statements kept per connection: more than a request runs.
const STATEMENTS_CACHED: usize = 64;

pub struct SqliteStore {
    conn: Connection,
    synchronous: Option<Durability>,
}

impl SqliteStore {
    /// Opens an existing database file (never creates one) and makes sure it
    /// is one the engine can use. For a long-lived process; a process that
    /// serves one request and exits should use [`SqliteStore::open_for_one_request`].
    pub fn open(path: &Path, policy: &Policy) -> Result<Self, StoreError> {
        let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let conn = Connection::open_with_flags(path, flags).map_err(|e| {
            StoreError::Backend(Failure::caused_by(format!("cannot open {}: {e}", path.display()), e))
        })?;
        Self::from_connection(conn, policy)
    }

    /// [`SqliteStore::open`], tuned for a process that handles one request.
    ///
    /// Checkpointing on close would cost each such process an extra fsync and
    /// a new WAL file, so it is off. But whoever opens the file first must
    /// rebuild the WAL index by reading the whole WAL, so the WAL is kept
    /// short: a checkpoint every 64 pages (about 7 transfers) measured ~20%
    /// faster per invocation than SQLite's default of 1000 (`cargo bench`).
    /// A long-lived process keeps the default: for it, rarer checkpoints mean
    /// fewer fsyncs per transfer.
    pub fn open_for_one_request(path: &Path, policy: &Policy) -> Result<Self, StoreError> {
        let store = Self::open(path, policy)?;
        store.conn.set_db_config(DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, true).map_err(backend)?;
        store
            .conn
            .pragma_update(None, "wal_autocheckpoint", ONE_REQUEST_CHECKPOINT_PAGES)
            .map_err(backend)?;
        Ok(store)
    }

    /// Wraps a connection whose database already holds `account`.
    pub fn from_connection(conn: Connection, policy: &Policy) -> Result<Self, StoreError> {
        // Defence in depth beside the trigger check below: no schema object
        // may call functions with side effects, and no SQL may corrupt the
        // file through writable_schema and the like.
        conn.set_db_config(DbConfig::SQLITE_DBCONFIG_DEFENSIVE, true).map_err(backend)?;
        conn.set_db_config(DbConfig::SQLITE_DBCONFIG_TRUSTED_SCHEMA, false).map_err(backend)?;
        conn.busy_timeout(Duration::from_millis(u64::from(policy.busy_timeout_ms))).map_err(backend)?;
        // Every statement of a request stays prepared: rusqlite's default of
        // 16 is fewer than a group commit's statements, and a statement
        // evicted is compiled again (tens of µs) on its next use.
        conn.set_prepared_statement_cache_capacity(STATEMENTS_CACHED);
        // Racing first calls can meet SQLite's deadlock-avoiding BUSY
        // (returned at once, without waiting) while one of them switches the
        // journal mode; retry within the same budget as any lock wait.
        super::retrying(policy, |e| *e == StoreError::Busy, || prepare(&conn))?;
        Ok(SqliteStore { conn, synchronous: None })
    }

    /// Checks that this connection can write, by taking the write lock and
    /// letting it go: a file, WAL or `-shm` that cannot be written (read
    /// only, immutable) would otherwise fail every transfer of a service
    /// that started as if all were well.
    pub fn check_writable(&self) -> Result<(), StoreError> {
        self.conn.execute_batch("BEGIN IMMEDIATE; ROLLBACK").map_err(|e| match backend(e) {
            StoreError::Busy => StoreError::Busy,
            other => StoreError::Schema(format!("the database cannot be written: {other}")),
        })
    }

    /// The same connection, made never to wait for a lock: a statement
    /// that would wait fails at once with [`StoreError::Busy`]. In WAL a
    /// plain read waits only in rare moments (the WAL being recovered or
    /// restarted), so such a reader can run on a thread that must not block.
    pub fn never_waiting(self) -> Result<Self, StoreError> {
        self.conn.busy_timeout(Duration::ZERO).map_err(backend)?;
        Ok(self)
    }

    /// The connection itself, for what the store has no operation for: the
    /// benches preload keys through it. Outside the store's transactions.
    pub fn connection(&self) -> &Connection {
        &self.conn
    }
}

fn backend(e: rusqlite::Error) -> StoreError {
    match e.sqlite_error_code() {
        Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked) => StoreError::Busy,
        Some(ErrorCode::DiskFull | ErrorCode::SystemIoFailure) => StoreError::Unavailable(e.to_string()),
        _ => StoreError::Backend(Failure::caused_by(e.to_string(), e)),
    }
}

impl ToSql for AcctId {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(match self {
            AcctId::Int(i) => ToSqlOutput::Borrowed(ValueRef::Integer(*i)),
            AcctId::Text(s) => ToSqlOutput::Borrowed(ValueRef::Text(s.as_bytes())),
        })
    }
}

fn acct_id(value: Value) -> Result<AcctId, StoreError> {
    match value {
        Value::Integer(i) => Ok(AcctId::Int(i)),
        Value::Text(s) => Ok(AcctId::Text(s)),
        other => Err(StoreError::Schema(format!("account id {other:?} is neither text nor integer"))),
    }
}

/// A balance as an exact integer. A `balance REAL` column holds whole
/// amounts as 900.0: those are taken exactly up to 2^53 − 1, beyond which a
/// double no longer holds every integer; anything else is refused.
fn balance(id: &AcctId, value: Value) -> Result<i64, StoreError> {
    match value {
        Value::Integer(b) => Ok(b),
        Value::Real(r) if r.fract() == 0.0 && r.abs() <= MAX_EXACT_INT as f64 => Ok(r as i64),
        other => Err(StoreError::Schema(format!(
            "balance of account {:?} is {other:?}, not an integer amount a double holds exactly",
            id.to_string()
        ))),
    }
}

impl SqliteStore {
    /// Sets the durability of the next commit (cached: a new transfer
    /// switches twice, so each pragma is compiled once).
    fn synchronous(&mut self, durability: Durability) -> Result<(), StoreError> {
        if self.synchronous != Some(durability) {
            let pragma = match durability {
                Durability::Lazy => "PRAGMA synchronous = NORMAL",
                Durability::Durable => "PRAGMA synchronous = FULL",
            };
            run(&self.conn, pragma)?;
            self.synchronous = Some(durability);
        }
        Ok(())
    }
}

/// Runs one statement of no result, compiled once per connection.
fn run(conn: &Connection, sql: &str) -> Result<(), StoreError> {
    conn.prepare_cached(sql).and_then(|mut s| s.execute([])).map(drop).map_err(backend)
}

impl Store for SqliteStore {
    fn begin(&mut self, durability: Durability) -> Result<Box<dyn Tx + '_>, StoreError> {
        self.synchronous(durability)?;
        Ok(Box::new(SqliteTx::start(&self.conn, None)?))
    }

    fn audit(&mut self) -> Result<Audit, StoreError> {
        audit(&self.conn)
    }
}

impl Reads for SqliteStore {
    fn transfer_for(&mut self, client_id: &str, transfer_id: i64) -> Result<Option<String>, StoreError> {
        completed_body(&self.conn, client_id, transfer_id)
    }

    fn ping(&mut self) -> Result<(), StoreError> {
        // One row, not a count: a probe must cost the same on any table.
        self.conn
            .query_row("SELECT 1 FROM account LIMIT 1", [], |_| Ok(()))
            .optional()
            .map(drop)
            .map_err(backend)
    }

    fn peek(&mut self, key: &ScopedKey) -> Result<Option<KeyRecord>, StoreError> {
        read_key(&self.conn, key)
    }
}

fn audit(conn: &Connection) -> Result<Audit, StoreError> {
    {
        let counted =
            |sql: &str, params: &[&dyn rusqlite::ToSql]| conn.query_row(sql, params, |r| r.get::<_, i64>(0));
        let count = |sql: &str| counted(sql, &[]).map_err(backend);
        let mut balances = Vec::new();
        let mut stmt = conn.prepare("SELECT acct_id, balance FROM account").map_err(backend)?;
        let rows = stmt.query_map([], |r| Ok((r.get::<_, Value>(0)?, r.get::<_, Value>(1)?)));
        for row in rows.and_then(|rows| rows.collect::<Result<Vec<_>, _>>()).map_err(backend)? {
            let id = acct_id(row.0)?;
            let b = balance(&id, row.1)?;
            balances.push((id, b));
        }
        balances.sort();
        let ids = |sql: &str| -> Result<Vec<(i64, i64)>, StoreError> {
            let mut stmt = conn.prepare(sql).map_err(backend)?;
            let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)));
            rows.and_then(|rows| rows.collect()).map_err(backend)
        };
        Ok(Audit {
            balances,
            transfers: ids(audit_sql::TRANSFERS)?,
            orphans: ids(audit_sql::ORPHANS)?.into_iter().map(|(id, _)| id).collect(),
            hollow: counted(audit_sql::HOLLOW, &[&PAYOUTS]).map_err(backend)?,
            keys_in_progress: count(audit_sql::IN_PROGRESS)?,
            keys_completed: count(audit_sql::COMPLETED)?,
        })
    }
}

fn completed_body(
    conn: &Connection,
    client_id: &str,
    transfer_id: i64,
) -> Result<Option<String>, StoreError> {
    conn.prepare_cached(
        "SELECT body FROM idem_key
         WHERE transfer_id = ?1 AND client_id = ?2 AND state = 'completed' AND status = 201",
    )
    .and_then(|mut s| s.query_row((transfer_id, client_id), |r| r.get(0)).optional())
    .map_err(backend)
}

/// The engine's key table and its statements.
fn keys() -> &'static KeyTable {
    static KEYS: std::sync::OnceLock<KeyTable> = std::sync::OnceLock::new();
    KEYS.get_or_init(|| KeyTable::new("idem_key", Dialect::Sqlite))
}

fn read_key(conn: &Connection, key: &ScopedKey) -> Result<Option<KeyRecord>, StoreError> {
    Ok(key_sql::read(conn, keys(), who(key)).map_err(backend)?.map(|(record, _)| record))
}

/// A transaction of its own (`BEGIN IMMEDIATE` … `COMMIT`), or, inside a
/// [`Group`], a savepoint. Dropped without [`Tx::commit`], it rolls back.
pub struct SqliteTx<'a> {
    conn: &'a Connection,
    open: bool,
    /// Inside a group (then a savepoint): the claim the group holds
    /// unwritten (`group::Held`), and what this savepoint does to it if it
    /// commits.
    held: Option<&'a std::cell::RefCell<Option<group::Held>>>,
    staged: Option<group::Staged>,
}

impl<'a> SqliteTx<'a> {
    /// A transaction of its own, or a savepoint of the group that holds `held`.
    fn start(
        conn: &'a Connection,
        held: Option<&'a std::cell::RefCell<Option<group::Held>>>,
    ) -> Result<Self, StoreError> {
        // IMMEDIATE takes the write lock now, so a claim never starts as a
        // reader and fails to upgrade later: it waits (busy_timeout) or fails.
        run(conn, if held.is_some() { "SAVEPOINT request" } else { "BEGIN IMMEDIATE" })?;
        Ok(SqliteTx { conn, open: true, held, staged: None })
    }
}

impl Drop for SqliteTx<'_> {
    fn drop(&mut self) {
        if self.open {
            let _ = match self.held.is_some() {
                true => {
                    run(self.conn, "ROLLBACK TO request").and_then(|()| run(self.conn, "RELEASE request"))
                }
                false => run(self.conn, "ROLLBACK"),
            };
        }
    }
}

use super::keys::sqlite::{self as key_sql, record as record_at};
use super::keys::{NOTHING_KEPT, who};

impl Tx for SqliteTx<'_> {
    fn insert_claim(&mut self, key: &ScopedKey, claim: &Claim) -> Result<Option<KeyRecord>, StoreError> {
        if self.held.is_some() {
            return self.hold_claim(key, claim);
        }
        let inserted = key_sql::insert_claim(self.conn, keys(), who(key), claim).map_err(backend)?;
        match inserted {
            true => Ok(None),
            // The primary key is the arbiter: nothing inserted means the key exists.
            false => read_key(self.conn, key)?
                .map(Some)
                .ok_or_else(|| StoreError::Backend("claim neither inserted nor found".into())),
        }
    }

    fn replace_claim(
        &mut self,
        key: &ScopedKey,
        seen: &KeyRecord,
        claim: &Claim,
    ) -> Result<bool, StoreError> {
        self.write_held()?;
        key_sql::replace_claim(self.conn, keys(), who(key), seen, claim).map_err(backend)
    }

    fn lock_key(&mut self, key: &ScopedKey) -> Result<Option<KeyRecord>, StoreError> {
        if let Some(claim) = self.holding(key, None) {
            return Ok(Some(group::in_progress(claim)));
        }
        self.write_held()?;
        read_key(self.conn, key) // the transaction already holds the write lock
    }

    fn complete(
        &mut self,
        key: &ScopedKey,
        token: &str,
        response: &Stored,
        at: Timestamp,
    ) -> Result<bool, StoreError> {
        if let Some(claim) = self.holding(key, Some(token)) {
            let done = key_sql::insert_completed(self.conn, keys(), who(key), &claim, response, at);
            self.staged = Some(group::Staged::Written);
            return done.map_err(backend);
        }
        self.write_held()?;
        // the engine's answers are JSON: no media type of their own
        key_sql::complete(self.conn, keys(), who(key), token, response, NOTHING_KEPT, at).map_err(backend)
    }

    fn release(&mut self, key: &ScopedKey, token: &str) -> Result<bool, StoreError> {
        if self.holding(key, Some(token)).is_some() {
            self.staged = Some(group::Staged::Written); // never written: nothing to delete
            return Ok(true);
        }
        self.write_held()?;
        key_sql::release(self.conn, keys(), who(key), token).map_err(backend)
    }

    fn lock_account(&mut self, id: &AcctId) -> Result<Option<Account>, StoreError> {
        let row: Option<(Value, Value)> = self
            .conn
            .prepare_cached("SELECT acct_id, balance FROM account WHERE acct_id = ?1")
            .and_then(|mut s| s.query_row([id], |r| Ok((r.get(0)?, r.get(1)?))).optional())
            .map_err(backend)?;
        let Some((stored_id, stored_balance)) = row else {
            return Ok(None);
        };
        let id = acct_id(stored_id)?;
        let balance = balance(&id, stored_balance)?;
        Ok(Some(Account { id, balance }))
    }

    fn add_to_balance(&mut self, id: &AcctId, delta: i64) -> Result<i64, StoreError> {
        let rows: Vec<Value> = self
            .conn
            .prepare_cached(
                "UPDATE account SET balance = balance + ?2
                 WHERE acct_id = ?1 AND balance + ?2 >= 0 RETURNING balance",
            )
            .and_then(|mut s| s.query_map((id, delta), |r| r.get(0))?.collect())
            .map_err(backend)?;
        match <[Value; 1]>::try_from(rows) {
            Ok([value]) => balance(id, value),
            Err(rows) => Err(StoreError::Schema(format!(
                "a balance update of account {:?} changed {} rows, not 1",
                id.to_string(),
                rows.len()
            ))),
        }
    }

    fn insert_transfer(&mut self, t: &NewTransfer) -> Result<i64, StoreError> {
        self.conn
            .prepare_cached(
                "INSERT INTO transfer (src, dst, amount, currency, created_at)
                 VALUES (?1, ?2, ?3, ?4, ?5) RETURNING transfer_id",
            )
            .and_then(|mut s| {
                s.query_row((t.src, t.dst, t.amount, t.currency, t.created_at.to_string()), |r| r.get(0))
            })
            .map_err(backend)
    }

    fn purge(&mut self, before: Timestamp, limit: u64) -> Result<u64, StoreError> {
        self.write_held()?;
        key_sql::purge(self.conn, keys(), before, limit, PAYOUTS).map_err(backend)
    }

    fn in_progress(&mut self) -> Result<Vec<(ScopedKey, KeyRecord)>, StoreError> {
        self.write_held()?;
        let mut stmt = self.conn.prepare_cached(&keys().in_progress).map_err(backend)?;
        let rows = stmt.query_map([], |r| {
            let key = ScopedKey { client_id: r.get(9)?, endpoint: r.get(10)?, idem_key: r.get(11)? };
            Ok((key, record_at(r, 0)?))
        });
        rows.and_then(|rows| rows.collect()).map_err(backend)
    }

    fn commit(mut self: Box<Self>) -> Result<(), StoreError> {
        // A commit that fails leaves the transaction open: the drop rolls it back.
        run(self.conn, if self.held.is_some() { "RELEASE request" } else { "COMMIT" })?;
        self.open = false;
        self.settle_held();
        Ok(())
    }
}
