//! The embedded SQLite store: schema, pragmas, transactions.
//!
//! The database arrives holding only `account(acct_id, holder, balance)`;
//! the first call creates `transfer` and `idem_key` and stamps
//! `PRAGMA user_version`, so every later call checks one integer instead of
//! the schema. WAL lets readers run beside the single writer, and the claim
//! commits with `synchronous=NORMAL` (no fsync) while the money-moving commit
//! uses `FULL` (see the protocol module for why that is safe).

use super::{Account, Claim, Durability, KeyRecord, KeyState, NewTransfer, Store, StoreError, Stored, Tx};
use crate::clock::Timestamp;
use crate::policy::Policy;
use crate::request::{AcctId, ScopedKey};
use rusqlite::config::DbConfig;
use rusqlite::types::{ToSqlOutput, Value, ValueRef};
use rusqlite::{Connection, ErrorCode, OpenFlags, OptionalExtension, ToSql, TransactionBehavior};
use std::path::Path;
use std::time::Duration;

/// WAL pages between automatic checkpoints for one-request processes.
const ONE_REQUEST_CHECKPOINT_PAGES: i64 = 64;

/// Bumped whenever the tables below change shape.
pub const SCHEMA_VERSION: i64 = 1;

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS transfer (
    transfer_id INTEGER PRIMARY KEY,
    src         NOT NULL,  -- no declared type: keeps account.acct_id's own type
    dst         NOT NULL,
    amount      INTEGER NOT NULL CHECK (typeof(amount) = 'integer' AND amount > 0),
    currency    TEXT NOT NULL,
    created_at  TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS idem_key (
    client_id    TEXT NOT NULL,
    endpoint     TEXT NOT NULL,
    idem_key     TEXT NOT NULL,
    fingerprint  TEXT NOT NULL,
    state        TEXT NOT NULL CHECK (state IN ('in_progress', 'completed')),
    token        TEXT NOT NULL,
    created_at   TEXT NOT NULL,
    lease_until  TEXT NOT NULL,
    status       INTEGER,
    reason       TEXT,
    body         TEXT,
    transfer_id  INTEGER UNIQUE,
    completed_at TEXT,
    PRIMARY KEY (client_id, endpoint, idem_key),
    -- a completed key always has its response; only a completed key has a transfer
    CHECK ((state = 'completed') = (status IS NOT NULL AND body IS NOT NULL AND completed_at IS NOT NULL)),
    CHECK (transfer_id IS NULL OR state = 'completed')
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS idem_key_created_at ON idem_key (created_at);
";

pub struct SqliteStore {
    conn: Connection,
    synchronous: Option<Durability>,
}

impl SqliteStore {
    /// Opens an existing database file (never creates one) and makes sure it
    /// has the engine's tables. For a long-lived process; a process that
    /// serves one request and exits should use [`SqliteStore::open_for_one_request`].
    pub fn open(path: &Path, policy: &Policy) -> Result<Self, StoreError> {
        let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let conn = Connection::open_with_flags(path, flags)
            .map_err(|e| StoreError::Backend(format!("cannot open {}: {e}", path.display())))?;
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
        conn.busy_timeout(Duration::from_millis(u64::from(policy.busy_timeout_ms))).map_err(backend)?;
        if user_version(&conn)? != SCHEMA_VERSION {
            // Racing first calls can meet SQLite's deadlock-avoiding BUSY
            // (returned at once, without waiting) while one of them switches
            // the journal mode; retry within the same budget as any lock wait.
            let budget = std::time::Instant::now() + Duration::from_millis(u64::from(policy.busy_timeout_ms));
            let mut pause_ms = 1;
            while let Err(e) = create_schema(&conn) {
                if e != StoreError::Busy || std::time::Instant::now() >= budget {
                    return Err(e);
                }
                std::thread::sleep(Duration::from_millis(pause_ms));
                pause_ms = (pause_ms * 2).min(50);
            }
        }
        Ok(SqliteStore { conn, synchronous: None })
    }

    /// The connection, for read-only inspection by the harness.
    pub fn connection(&self) -> &Connection {
        &self.conn
    }
}

fn user_version(conn: &Connection) -> Result<i64, StoreError> {
    conn.pragma_query_value(None, "user_version", |r| r.get(0)).map_err(backend)
}

/// Checks, before writing anything, that the file is one the engine may
/// extend: version 0, an `account` table, and no `transfer`/`idem_key` tables
/// of another shape. Then switches to WAL and creates what is missing.
fn create_schema(conn: &Connection) -> Result<(), StoreError> {
    let v = user_version(conn)?;
    if v == SCHEMA_VERSION {
        return Ok(()); // another first call got here first
    }
    if v != 0 {
        return Err(StoreError::Schema(format!(
            "database has schema version {v}; this idem understands version {SCHEMA_VERSION}"
        )));
    }
    if columns(conn, "account")?.is_empty() {
        return Err(StoreError::Schema("database has no account table".into()));
    }
    for (table, wanted) in [
        ("account", &ACCOUNT_COLUMNS[..]),
        ("transfer", &TRANSFER_COLUMNS[..]),
        ("idem_key", &KEY_COLUMNS[..]),
    ] {
        let have = columns(conn, table)?;
        let missing: Vec<&str> =
            wanted.iter().copied().filter(|c| !have.is_empty() && !have.iter().any(|h| h == c)).collect();
        if !missing.is_empty() {
            return Err(StoreError::Schema(format!(
                "table {table} exists without column(s) {}: not a schema this idem can use",
                missing.join(", ")
            )));
        }
    }
    let _mode: String =
        conn.pragma_update_and_check(None, "journal_mode", "WAL", |r| r.get(0)).map_err(backend)?;
    // Two first calls may race here; the version re-read under the write
    // lock makes the loser a no-op.
    conn.execute_batch("BEGIN IMMEDIATE").map_err(backend)?;
    let created = (|| {
        if user_version(conn)? == 0 {
            conn.execute_batch(SCHEMA).map_err(backend)?;
            conn.pragma_update(None, "user_version", SCHEMA_VERSION).map_err(backend)?;
        }
        conn.execute_batch("COMMIT").map_err(backend)
    })();
    if created.is_err() {
        let _ = conn.execute_batch("ROLLBACK");
    }
    created
}

const ACCOUNT_COLUMNS: [&str; 2] = ["acct_id", "balance"];
const TRANSFER_COLUMNS: [&str; 6] = ["transfer_id", "src", "dst", "amount", "currency", "created_at"];
const KEY_COLUMNS: [&str; 13] = [
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

/// The column names of `table`; empty if there is no such table.
fn columns(conn: &Connection, table: &str) -> Result<Vec<String>, StoreError> {
    let mut stmt = conn.prepare("SELECT name FROM pragma_table_info(?1)").map_err(backend)?;
    let names = stmt.query_map([table], |r| r.get(0)).and_then(|rows| rows.collect());
    names.map_err(backend)
}

fn backend(e: rusqlite::Error) -> StoreError {
    match e.sqlite_error_code() {
        Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked) => StoreError::Busy,
        _ => StoreError::Backend(e.to_string()),
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

impl Store for SqliteStore {
    type Tx<'a> = SqliteTx<'a>;

    fn begin(&mut self, durability: Durability) -> Result<SqliteTx<'_>, StoreError> {
        if self.synchronous != Some(durability) {
            let pragma = match durability {
                Durability::Lazy => "PRAGMA synchronous = NORMAL",
                Durability::Durable => "PRAGMA synchronous = FULL",
            };
            // Cached: a new transfer switches twice, so compile each once.
            self.conn.prepare_cached(pragma).and_then(|mut s| s.execute([])).map_err(backend)?;
            self.synchronous = Some(durability);
        }
        // IMMEDIATE takes the write lock now, so a claim never starts as a
        // reader and fails to upgrade later: it waits (busy_timeout) or fails.
        let tx = self.conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(backend)?;
        Ok(SqliteTx { tx })
    }
}

pub struct SqliteTx<'a> {
    tx: rusqlite::Transaction<'a>,
}

const KEY_WHERE: &str = "client_id = ?1 AND endpoint = ?2 AND idem_key = ?3";

impl SqliteTx<'_> {
    /// Runs `sql` with the key as ?1..?3 and the claim as ?4..?7.
    fn write_claim(&mut self, sql: &str, key: &ScopedKey, claim: &Claim) -> rusqlite::Result<usize> {
        self.tx.prepare_cached(sql)?.execute((
            &key.client_id,
            &key.endpoint,
            &key.idem_key,
            &claim.fingerprint,
            &claim.token,
            claim.created_at.to_string(),
            claim.lease_until.to_string(),
        ))
    }
}

impl Tx for SqliteTx<'_> {
    fn insert_claim(&mut self, key: &ScopedKey, claim: &Claim) -> Result<Option<KeyRecord>, StoreError> {
        let inserted = self.write_claim(
            "INSERT INTO idem_key (client_id, endpoint, idem_key, fingerprint, state, token, created_at, lease_until)
             VALUES (?1, ?2, ?3, ?4, 'in_progress', ?5, ?6, ?7)",
            key,
            claim,
        );
        match inserted {
            Ok(_) => Ok(None),
            // The primary key is the arbiter: a violation means the key exists.
            Err(e) if e.sqlite_error_code() == Some(ErrorCode::ConstraintViolation) => self
                .key(key)?
                .map(Some)
                .ok_or_else(|| StoreError::Backend(format!("claim rejected by a constraint: {e}"))),
            Err(e) => Err(backend(e)),
        }
    }

    fn replace_claim(&mut self, key: &ScopedKey, claim: &Claim) -> Result<(), StoreError> {
        let sql = format!(
            "UPDATE idem_key SET fingerprint = ?4, state = 'in_progress', token = ?5,
                    created_at = ?6, lease_until = ?7, status = NULL, reason = NULL,
                    body = NULL, transfer_id = NULL, completed_at = NULL
             WHERE {KEY_WHERE}"
        );
        self.write_claim(&sql, key, claim).map(drop).map_err(backend)
    }

    fn key(&mut self, key: &ScopedKey) -> Result<Option<KeyRecord>, StoreError> {
        let sql = format!(
            "SELECT fingerprint, state, token, created_at, lease_until, status, reason, body
             FROM idem_key WHERE {KEY_WHERE}"
        );
        type Row = (String, String, String, String, String, Option<u16>, Option<String>, Option<String>);
        let row: Option<Row> = self
            .tx
            .prepare_cached(&sql)
            .and_then(|mut s| {
                s.query_row((&key.client_id, &key.endpoint, &key.idem_key), |r| {
                    Ok((
                        r.get(0)?,
                        r.get(1)?,
                        r.get(2)?,
                        r.get(3)?,
                        r.get(4)?,
                        r.get(5)?,
                        r.get(6)?,
                        r.get(7)?,
                    ))
                })
                .optional()
            })
            .map_err(backend)?;
        let Some((fingerprint, state, token, created_at, lease_until, status, reason, body)) = row else {
            return Ok(None);
        };
        let corrupt = || StoreError::Backend(format!("corrupt idem_key row for {key:?}"));
        let time = |t: &str| Timestamp::parse(t).map_err(|_| corrupt());
        let state = match (state.as_str(), status, body) {
            ("in_progress", _, _) => KeyState::InProgress { token, lease_until: time(&lease_until)? },
            ("completed", Some(status), Some(body)) => KeyState::Completed(Stored { status, reason, body }),
            _ => return Err(corrupt()),
        };
        Ok(Some(KeyRecord { fingerprint, created_at: time(&created_at)?, state }))
    }

    fn complete(
        &mut self,
        key: &ScopedKey,
        response: &Stored,
        transfer_id: Option<i64>,
        at: Timestamp,
    ) -> Result<(), StoreError> {
        let sql = format!(
            "UPDATE idem_key SET state = 'completed', status = ?4, reason = ?5, body = ?6,
                    transfer_id = ?7, completed_at = ?8
             WHERE {KEY_WHERE} AND state = 'in_progress'"
        );
        let changed = self
            .tx
            .prepare_cached(&sql)
            .and_then(|mut s| {
                s.execute((
                    &key.client_id,
                    &key.endpoint,
                    &key.idem_key,
                    response.status,
                    &response.reason,
                    &response.body,
                    transfer_id,
                    at.to_string(),
                ))
            })
            .map_err(backend)?;
        match changed {
            1 => Ok(()),
            _ => Err(StoreError::Backend(format!("completed a key that was not in progress: {key:?}"))),
        }
    }

    fn account(&mut self, id: &AcctId) -> Result<Option<Account>, StoreError> {
        let row: Option<(Value, Value)> = self
            .tx
            .prepare_cached("SELECT acct_id, balance FROM account WHERE acct_id = ?1 LIMIT 1")
            .and_then(|mut s| s.query_row([id], |r| Ok((r.get(0)?, r.get(1)?))).optional())
            .map_err(backend)?;
        let Some((stored_id, balance)) = row else {
            return Ok(None);
        };
        let id = match stored_id {
            Value::Integer(i) => AcctId::Int(i),
            Value::Text(s) => AcctId::Text(s),
            other => {
                return Err(StoreError::Schema(format!("account id {other:?} is neither text nor integer")));
            }
        };
        match balance {
            Value::Integer(balance) => Ok(Some(Account { id, balance })),
            // A `balance REAL` column holds whole amounts as 900.0; take them
            // exactly, refuse anything with a fraction.
            Value::Real(r) if r.fract() == 0.0 && r.abs() <= 9_007_199_254_740_991.0 => {
                Ok(Some(Account { id, balance: r as i64 }))
            }
            other => Err(StoreError::Schema(format!(
                "balance of account {id:?} is {other:?}, not an integer amount"
            ))),
        }
    }

    fn set_balance(&mut self, id: &AcctId, balance: i64) -> Result<(), StoreError> {
        self.tx
            .prepare_cached("UPDATE account SET balance = ?2 WHERE acct_id = ?1")
            .and_then(|mut s| s.execute((id, balance)))
            .map(drop)
            .map_err(backend)
    }

    fn insert_transfer(&mut self, t: &NewTransfer) -> Result<i64, StoreError> {
        self.tx
            .prepare_cached(
                "INSERT INTO transfer (src, dst, amount, currency, created_at)
                 VALUES (?1, ?2, ?3, ?4, ?5) RETURNING transfer_id",
            )
            .and_then(|mut s| {
                s.query_row((t.src, t.dst, t.amount, t.currency, t.created_at.to_string()), |r| r.get(0))
            })
            .map_err(backend)
    }

    fn purge(&mut self, before: Timestamp) -> Result<u64, StoreError> {
        self.tx
            .prepare_cached("DELETE FROM idem_key WHERE created_at < ?1")
            .and_then(|mut s| s.execute([before.to_string()]))
            .map(|n| n as u64)
            .map_err(backend)
    }

    fn in_progress(&mut self) -> Result<Vec<(ScopedKey, KeyRecord)>, StoreError> {
        let keys: Vec<ScopedKey> = self
            .tx
            .prepare_cached(
                "SELECT client_id, endpoint, idem_key FROM idem_key
                 WHERE state = 'in_progress' ORDER BY created_at, client_id, endpoint, idem_key",
            )
            .and_then(|mut s| {
                s.query_map([], |r| {
                    Ok(ScopedKey { client_id: r.get(0)?, endpoint: r.get(1)?, idem_key: r.get(2)? })
                })?
                .collect()
            })
            .map_err(backend)?;
        let mut claims = Vec::new();
        for key in keys {
            if let Some(record) = self.key(&key)? {
                claims.push((key, record));
            }
        }
        Ok(claims)
    }

    fn release(&mut self, key: &ScopedKey, token: &str) -> Result<bool, StoreError> {
        let sql = format!("DELETE FROM idem_key WHERE {KEY_WHERE} AND state = 'in_progress' AND token = ?4");
        self.tx
            .prepare_cached(&sql)
            .and_then(|mut s| s.execute((&key.client_id, &key.endpoint, &key.idem_key, token)))
            .map(|n| n == 1)
            .map_err(backend)
    }

    fn commit(self) -> Result<(), StoreError> {
        self.tx.commit().map_err(backend)
    }
}
