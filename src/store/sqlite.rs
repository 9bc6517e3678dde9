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
    Account, Audit, Claim, Durability, Failure, KeyRecord, KeyRow, NewTransfer, PAYOUT_V1_COLUMNS, PURGEABLE,
    PayoutEvent, PayoutRow, PayoutStat, PayoutState, PayoutText, RECORD_COLUMNS, Reads, Store, StoreError,
    Stored, Tx, audit_sql,
};
use crate::clock::Timestamp;
use crate::policy::Policy;
use crate::reason::Reason;
use crate::request::{AcctId, MAX_EXACT_INT, PAYOUTS, ScopedKey};
use rusqlite::config::DbConfig;
use rusqlite::types::{ToSqlOutput, Value, ValueRef};
use rusqlite::{Connection, ErrorCode, OpenFlags, OptionalExtension, Row, ToSql};
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

/// Created on first use by payouts only, so a database that never pays out
/// holds exactly the lab's tables.
/// The payout tables in SQLite's words: `src` keeps the account id's own
/// type (an integer or a text, as `account` does), an amount must be an integer.
fn payout_schema() -> String {
    super::PAYOUT_SCHEMA
        .replace("{id}", "INTEGER")
        .replace("{src}", "")
        .replace("{amount}", "typeof(amount) = 'integer'")
        .replace("{time}", "text")
}

const PAYOUT_COLUMNS: &str =
    "payout_id, client_id, endpoint, idem_key, fingerprint, src, beneficiary, amount,
    currency, downstream_key, state, holder, lease_until, created_at, updated_at, note, status,
    sends, attempts, provider_id";

const EVENT_COLUMNS: &str = "payout_id, at, actor, was, now, why";

fn payout_event(r: &Row) -> rusqlite::Result<Result<PayoutEvent, StoreError>> {
    let (at, was, now): (String, String, String) = (r.get(1)?, r.get(3)?, r.get(4)?);
    Ok((|| {
        Ok(PayoutEvent {
            payout_id: r.get(0).map_err(backend)?,
            at: Timestamp::parse(&at)
                .map_err(|e| StoreError::Backend(format!("corrupt payout event: {e}").into()))?,
            actor: r.get(2).map_err(backend)?,
            was: PayoutState::parse(&was)?,
            now: PayoutState::parse(&now)?,
            why: r.get(5).map_err(backend)?,
        })
    })())
}

fn payout_row(r: &Row) -> rusqlite::Result<Result<PayoutRow, StoreError>> {
    let src = match acct_id(r.get(5)?) {
        Ok(src) => src,
        Err(e) => return Ok(Err(e)),
    };
    let text = PayoutText {
        id: r.get(0)?,
        key: ScopedKey { client_id: r.get(1)?, endpoint: r.get(2)?, idem_key: r.get(3)? },
        fingerprint: r.get(4)?,
        src,
        beneficiary: r.get(6)?,
        amount: r.get(7)?,
        currency: r.get(8)?,
        downstream_key: r.get(9)?,
        state: r.get(10)?,
        holder: r.get(11)?,
        lease_until: r.get(12)?,
        created_at: r.get(13)?,
        updated_at: r.get(14)?,
        note: r.get(15)?,
        status: r.get(16)?,
        sends: r.get(17)?,
        attempts: r.get(18)?,
        provider_id: r.get(19)?,
    };
    Ok(text.decode())
}

impl SqliteTx<'_> {
    fn payouts_where(&self, condition: &str, params: &[&dyn ToSql]) -> Result<Vec<PayoutRow>, StoreError> {
        let sql = format!("SELECT {PAYOUT_COLUMNS} FROM payout WHERE {condition}");
        let mut stmt = self.conn.prepare_cached(&sql).map_err(backend)?;
        let rows: Vec<Result<PayoutRow, StoreError>> =
            stmt.query_map(params, payout_row).and_then(|rows| rows.collect()).map_err(backend)?;
        rows.into_iter().collect()
    }
}

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

    /// The connection, for read-only inspection by the harness.
    pub fn connection(&self) -> &Connection {
        &self.conn
    }
}

/// Everything checked on every open. Only the checks that read come first;
/// a file refused by them is left exactly as it was.
fn prepare(conn: &Connection) -> Result<(), StoreError> {
    let v = user_version(conn)?;
    if v != 0 && v != SCHEMA_VERSION {
        return Err(StoreError::Schema(format!(
            "database has schema version {v}; this idem understands version {SCHEMA_VERSION}"
        )));
    }
    if columns(conn, "account")?.is_empty() {
        return Err(StoreError::Schema("database has no account table".into()));
    }
    if v == 0 {
        check_shapes(conn)?;
    }
    check_account(conn)?;
    ensure_wal(conn)?;
    if v == 0 {
        create_schema(conn)?;
    }
    Ok(())
}

fn user_version(conn: &Connection) -> Result<i64, StoreError> {
    conn.pragma_query_value(None, "user_version", |r| r.get(0)).map_err(backend)
}

/// Durability rests on WAL, so a file found in another journal mode (switched
/// by hand, restored by `VACUUM INTO`) is switched back, or refused if it
/// cannot be. An in-memory database has nothing to make durable.
fn ensure_wal(conn: &Connection) -> Result<(), StoreError> {
    if conn.path().is_none_or(str::is_empty) {
        return Ok(()); // in memory: nothing to make durable, and no WAL to have
    }
    let mode: String = conn.pragma_query_value(None, "journal_mode", |r| r.get(0)).map_err(backend)?;
    if mode.eq_ignore_ascii_case("wal") {
        return Ok(());
    }
    let mode: String =
        conn.pragma_update_and_check(None, "journal_mode", "WAL", |r| r.get(0)).map_err(backend)?;
    match mode.eq_ignore_ascii_case("wal") {
        true => Ok(()),
        false => Err(StoreError::Schema(format!(
            "database is in journal_mode={mode} and cannot be switched to WAL, which durability needs"
        ))),
    }
}

/// A file the engine has not stamped yet may hold `transfer`/`idem_key`
/// tables of its own; the engine extends it only if they have its shape.
fn check_shapes(conn: &Connection) -> Result<(), StoreError> {
    for (table, wanted) in [
        ("account", &ACCOUNT_COLUMNS[..]),
        ("transfer", &super::TRANSFER_COLUMNS[..]),
        ("idem_key", &super::KEY_COLUMNS[..]),
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
    Ok(())
}

/// Creates the engine's tables. Two first calls may race here; the version
/// re-read under the write lock makes the loser a no-op.
fn create_schema(conn: &Connection) -> Result<(), StoreError> {
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

/// The account table must be a table whose `acct_id` is unique, and no
/// trigger may act on the engine's tables.
fn check_account(conn: &Connection) -> Result<(), StoreError> {
    let (is_table, unique, triggers): (bool, bool, Option<String>) = conn
        .query_row(
            "SELECT
               EXISTS (SELECT 1 FROM sqlite_schema WHERE type = 'table' AND name = 'account' COLLATE NOCASE),
               (EXISTS (SELECT 1 FROM pragma_table_info('account') WHERE name = 'acct_id' AND pk = 1)
                AND (SELECT COUNT(*) FROM pragma_table_info('account') WHERE pk > 0) = 1)
               OR EXISTS (SELECT 1 FROM pragma_index_list('account') AS il
                          WHERE il.\"unique\" AND NOT il.partial
                            AND (SELECT group_concat(name) FROM pragma_index_info(il.name)) = 'acct_id'),
               (SELECT group_concat(name, ', ') FROM sqlite_schema
                WHERE type = 'trigger' AND lower(tbl_name) IN ('account', 'transfer', 'idem_key'))",
            [],
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .map_err(backend)?;
    if !is_table {
        return Err(StoreError::Schema("account is not a table".into()));
    }
    if !unique {
        return Err(StoreError::Schema(
            "account.acct_id is not unique (no PRIMARY KEY or UNIQUE index on it alone): \
             one transfer could move the balance of several rows"
                .into(),
        ));
    }
    match triggers {
        Some(names) => Err(StoreError::Schema(format!(
            "trigger(s) {names} act on the engine's tables: a transfer must write exactly what the engine writes"
        ))),
        None => Ok(()),
    }
}

const ACCOUNT_COLUMNS: [&str; 2] = ["acct_id", "balance"];
/// The column names of `table`; empty if there is no such table.
fn columns(conn: &Connection, table: &str) -> Result<Vec<String>, StoreError> {
    let mut stmt = conn.prepare("SELECT name FROM pragma_table_info(?1)").map_err(backend)?;
    let names = stmt.query_map([table], |r| r.get(0)).and_then(|rows| rows.collect());
    names.map_err(backend)
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

/// Runs one statement of no result, compiled once per connection.
fn run(conn: &Connection, sql: &str) -> Result<(), StoreError> {
    conn.prepare_cached(sql).and_then(|mut s| s.execute([])).map(drop).map_err(backend)
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

impl super::GroupWriter for SqliteStore {
    fn group(&mut self) -> Result<Box<dyn super::GroupTx + '_>, StoreError> {
        Ok(Box::new(SqliteStore::group(self)?))
    }
}

impl super::GroupTx for Group<'_> {
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

impl Store for SqliteStore {
    fn begin(&mut self, durability: Durability) -> Result<Box<dyn Tx + '_>, StoreError> {
        self.synchronous(durability)?;
        Ok(Box::new(SqliteTx::start(&self.conn, false)?))
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

fn read_key(conn: &Connection, key: &ScopedKey) -> Result<Option<KeyRecord>, StoreError> {
    let sql = format!("SELECT {RECORD_COLUMNS} FROM idem_key WHERE {KEY_WHERE}");
    conn.prepare_cached(&sql)
        .and_then(|mut s| {
            s.query_row((&key.client_id, &key.endpoint, &key.idem_key), |r| record_at(r, 0)).optional()
        })
        .map_err(backend)
}

/// A transaction of its own (`BEGIN IMMEDIATE` … `COMMIT`), or, inside a
/// [`Group`], a savepoint. Dropped without [`Tx::commit`], it rolls back.
pub struct SqliteTx<'a> {
    conn: &'a Connection,
    savepoint: bool,
    open: bool,
}

impl<'a> SqliteTx<'a> {
    fn start(conn: &'a Connection, savepoint: bool) -> Result<Self, StoreError> {
        // IMMEDIATE takes the write lock now, so a claim never starts as a
        // reader and fails to upgrade later: it waits (busy_timeout) or fails.
        run(conn, if savepoint { "SAVEPOINT request" } else { "BEGIN IMMEDIATE" })?;
        Ok(SqliteTx { conn, savepoint, open: true })
    }
}

impl Drop for SqliteTx<'_> {
    fn drop(&mut self) {
        if self.open {
            let _ = match self.savepoint {
                true => {
                    run(self.conn, "ROLLBACK TO request").and_then(|()| run(self.conn, "RELEASE request"))
                }
                false => run(self.conn, "ROLLBACK"),
            };
        }
    }
}

/// A key row whose [`RECORD_COLUMNS`] start at column `at`.
fn record_at(r: &Row, at: usize) -> rusqlite::Result<KeyRecord> {
    let row = KeyRow {
        fingerprint: r.get(at)?,
        created_at: r.get(at + 1)?,
        token: r.get(at + 2)?,
        state: r.get(at + 3)?,
        lease_until: r.get(at + 4)?,
        status: r.get(at + 5)?,
        reason: r.get(at + 6)?,
        body: r.get(at + 7)?,
        transfer_id: r.get(at + 8)?,
    };
    row.decode().map_err(|e| corrupt("row", e.to_string()))
}

/// A key row the engine cannot have written.
fn corrupt(column: &str, why: String) -> rusqlite::Error {
    rusqlite::Error::InvalidColumnName(format!("corrupt idem_key.{column}: {why}"))
}

const KEY_WHERE: &str = "client_id = ?1 AND endpoint = ?2 AND idem_key = ?3";

impl SqliteTx<'_> {
    /// Runs `sql` with the key as ?1..?3, the claim as ?4..?7 and, for a
    /// compare-and-set, the `(token, state)` seen as ?8, ?9.
    fn write_claim(
        &mut self,
        sql: &str,
        key: &ScopedKey,
        claim: &Claim,
        seen: Option<(&str, &str)>,
    ) -> rusqlite::Result<usize> {
        let (created_at, lease_until) = (claim.created_at.to_string(), claim.lease_until.to_string());
        let mut params: Vec<&dyn ToSql> =
            vec![&key.client_id, &key.endpoint, &key.idem_key, &claim.fingerprint, &claim.token];
        params.extend([&created_at as &dyn ToSql, &lease_until]);
        if let Some((token, state)) = &seen {
            params.extend([token as &dyn ToSql, state]);
        }
        self.conn.prepare_cached(sql)?.execute(params.as_slice())
    }
}

impl Tx for SqliteTx<'_> {
    fn insert_claim(&mut self, key: &ScopedKey, claim: &Claim) -> Result<Option<KeyRecord>, StoreError> {
        let inserted = self
            .write_claim(
                "INSERT INTO idem_key (client_id, endpoint, idem_key, fingerprint, state, token, created_at, lease_until)
                 VALUES (?1, ?2, ?3, ?4, 'in_progress', ?5, ?6, ?7)
                 ON CONFLICT (client_id, endpoint, idem_key) DO NOTHING",
                key,
                claim,
                None,
            )
            .map_err(backend)?;
        match inserted {
            1 => Ok(None),
            // The primary key is the arbiter: nothing inserted means the key exists.
            _ => read_key(self.conn, key)?
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
        let state = seen.state.name();
        let sql = format!(
            "UPDATE idem_key SET fingerprint = ?4, state = 'in_progress', token = ?5,
                    created_at = ?6, lease_until = ?7, status = NULL, reason = NULL,
                    body = NULL, transfer_id = NULL, completed_at = NULL
             WHERE {KEY_WHERE} AND token = ?8 AND state = ?9"
        );
        self.write_claim(&sql, key, claim, Some((&seen.token, state))).map(|n| n == 1).map_err(backend)
    }

    fn lock_key(&mut self, key: &ScopedKey) -> Result<Option<KeyRecord>, StoreError> {
        read_key(self.conn, key) // the transaction already holds the write lock
    }

    fn complete(
        &mut self,
        key: &ScopedKey,
        token: &str,
        response: &Stored,
        at: Timestamp,
    ) -> Result<bool, StoreError> {
        let sql = format!(
            "UPDATE idem_key SET state = 'completed', status = ?4, reason = ?5, body = ?6,
                    transfer_id = ?7, completed_at = ?8
             WHERE {KEY_WHERE} AND state = 'in_progress' AND token = ?9"
        );
        self.conn
            .prepare_cached(&sql)
            .and_then(|mut s| {
                s.execute((
                    &key.client_id,
                    &key.endpoint,
                    &key.idem_key,
                    response.status,
                    response.reason.as_ref().map(Reason::to_string),
                    &response.body,
                    response.transfer_id,
                    at.to_string(),
                    token,
                ))
            })
            .map(|n| n == 1)
            .map_err(backend)
    }

    fn release(&mut self, key: &ScopedKey, token: &str) -> Result<bool, StoreError> {
        let sql = format!("DELETE FROM idem_key WHERE {KEY_WHERE} AND state = 'in_progress' AND token = ?4");
        self.conn
            .prepare_cached(&sql)
            .and_then(|mut s| s.execute((&key.client_id, &key.endpoint, &key.idem_key, token)))
            .map(|n| n == 1)
            .map_err(backend)
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
        // SQLite numbers ?N by N, but $N by first appearance
        let sql = format!(
            "DELETE FROM idem_key WHERE (client_id, endpoint, idem_key) IN
               (SELECT client_id, endpoint, idem_key FROM idem_key
                WHERE created_at < ?1 AND {PURGEABLE} ORDER BY created_at LIMIT ?2)",
        );
        self.conn
            .prepare_cached(&sql.replace('$', "?"))
            .and_then(|mut s| {
                s.execute((before.to_string(), i64::try_from(limit).unwrap_or(i64::MAX), PAYOUTS))
            })
            .map(|n| n as u64)
            .map_err(backend)
    }

    fn in_progress(&mut self) -> Result<Vec<(ScopedKey, KeyRecord)>, StoreError> {
        let sql = format!(
            "SELECT client_id, endpoint, idem_key, {RECORD_COLUMNS} FROM idem_key WHERE state = 'in_progress'
             ORDER BY created_at, client_id, endpoint, idem_key"
        );
        let mut stmt = self.conn.prepare_cached(&sql).map_err(backend)?;
        let rows = stmt.query_map([], |r| {
            let key = ScopedKey { client_id: r.get(0)?, endpoint: r.get(1)?, idem_key: r.get(2)? };
            Ok((key, record_at(r, 3)?))
        });
        rows.and_then(|rows| rows.collect()).map_err(backend)
    }

    fn ensure_payouts(&mut self) -> Result<(), StoreError> {
        let table: Option<String> = self
            .conn
            .query_row("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'payout'", [], |r| {
                r.get(0)
            })
            .optional()
            .map_err(backend)?;
        // A first version's table cannot take the new states (its CHECK) or
        // the new columns: rebuilt, rows copied, in this transaction.
        let migrate = table.is_some_and(|sql| !sql.contains("needs_attention"));
        let sql = match migrate {
            true => format!(
                "ALTER TABLE payout RENAME TO payout_v1; DROP INDEX IF EXISTS payout_key; DROP INDEX IF EXISTS payout_open;
                 {schema}
                 INSERT INTO payout ({PAYOUT_V1_COLUMNS}) SELECT {PAYOUT_V1_COLUMNS} FROM payout_v1;
                 DROP TABLE payout_v1;",
                schema = payout_schema()
            ),
            false => payout_schema(),
        };
        self.conn.execute_batch(&sql).map_err(backend)
    }

    fn insert_payout(&mut self, p: &PayoutRow) -> Result<i64, StoreError> {
        self.conn
            .prepare_cached(
                "INSERT INTO payout (client_id, endpoint, idem_key, fingerprint, src, beneficiary, amount, currency,
                                     downstream_key, state, holder, lease_until, created_at, updated_at, note,
                                     sends, attempts, provider_id)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?13, ?14, ?15, ?16, ?17)
                 RETURNING payout_id",
            )
            .and_then(|mut s| {
                s.query_row(
                    rusqlite::params![
                        p.key.client_id,
                        p.key.endpoint,
                        p.key.idem_key,
                        p.fingerprint,
                        p.src,
                        p.beneficiary,
                        p.amount,
                        p.currency,
                        p.downstream_key,
                        p.state.name(),
                        p.holder,
                        p.lease_until.to_string(),
                        p.created_at.to_string(),
                        p.note,
                        p.sends,
                        p.attempts,
                        p.provider_id,
                    ],
                    |r| r.get(0),
                )
            })
            .map_err(backend)
    }

    fn payout_of(&mut self, key: &ScopedKey) -> Result<Option<PayoutRow>, StoreError> {
        let rows = self.payouts_where(
            "client_id = ?1 AND endpoint = ?2 AND idem_key = ?3 ORDER BY payout_id DESC LIMIT 1",
            &[&key.client_id, &key.endpoint, &key.idem_key],
        )?;
        Ok(rows.into_iter().next())
    }

    fn payout(&mut self, id: i64) -> Result<Option<PayoutRow>, StoreError> {
        Ok(self.payouts_where("payout_id = ?1", &[&id])?.into_iter().next())
    }

    fn update_payout(&mut self, p: &PayoutRow, seen_holder: &str) -> Result<bool, StoreError> {
        self.conn
            .prepare_cached(
                "UPDATE payout SET state = ?2, holder = ?3, lease_until = ?4, updated_at = ?5, note = ?6, status = ?8,
                                  sends = ?9, attempts = ?10, provider_id = ?11
                 WHERE payout_id = ?1 AND holder = ?7",
            )
            .and_then(|mut s| {
                s.execute(rusqlite::params![
                    p.id,
                    p.state.name(),
                    p.holder,
                    p.lease_until.to_string(),
                    p.updated_at.to_string(),
                    p.note,
                    seen_holder,
                    p.status,
                    p.sends,
                    p.attempts,
                    p.provider_id,
                ])
            })
            .map(|n| n == 1)
            .map_err(backend)
    }

    fn payouts_open(&mut self, now: Timestamp, all: bool) -> Result<Vec<PayoutRow>, StoreError> {
        let now = now.to_string();
        self.payouts_where(
            "state IN ('in_progress', 'unknown', 'needs_attention')
             AND (?2 OR (state <> 'needs_attention' AND lease_until <= ?1)) ORDER BY created_at, payout_id",
            &[&now, &all],
        )
    }

    fn payouts_paid_due(
        &mut self,
        checked_before: Timestamp,
        paid_since: Timestamp,
        limit: i64,
    ) -> Result<Vec<PayoutRow>, StoreError> {
        self.payouts_where(
            "state = 'completed' AND lease_until <= ?1 AND updated_at >= ?2 ORDER BY updated_at, payout_id LIMIT ?3",
            &[&checked_before.to_string(), &paid_since.to_string(), &limit],
        )
    }

    fn payout_stats(&mut self) -> Result<Vec<PayoutStat>, StoreError> {
        let mut stmt = self.conn.prepare_cached(super::PAYOUT_STATS).map_err(backend)?;
        let rows: Vec<(String, i64, String, i64, i64)> = stmt
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)))
            .and_then(|rows| rows.collect())
            .map_err(backend)?;
        rows.iter().map(|(s, n, o, sends, most)| super::payout_stat(s, *n, o, *sends, *most)).collect()
    }

    fn gateway_events_for_a_person(&mut self, limit: i64) -> Result<Vec<super::GatewayEventRow>, StoreError> {
        let sql = format!("{}?1", super::EVENTS_FOR_A_PERSON);
        let mut stmt = self.conn.prepare_cached(&sql).map_err(backend)?;
        let rows = stmt.query_map([limit], |r| {
            Ok(super::GatewayEventRow {
                event_id: r.get(0)?,
                received_at: r.get(1)?,
                kind: r.get(2)?,
                downstream_key: r.get(3)?,
                outcome: r.get(4)?,
            })
        });
        rows.and_then(|rows| rows.collect()).map_err(backend)
    }

    fn payout_by_downstream_key(&mut self, key: &str) -> Result<Option<PayoutRow>, StoreError> {
        Ok(self.payouts_where("downstream_key = ?1", &[&key])?.into_iter().next())
    }

    fn insert_gateway_event(
        &mut self,
        event_id: &str,
        at: Timestamp,
        kind: &str,
        downstream_key: &str,
        outcome: &str,
    ) -> Result<bool, StoreError> {
        self.conn
            .prepare_cached(
                "INSERT INTO gateway_event (event_id, received_at, kind, downstream_key, outcome)
                 VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT (event_id) DO NOTHING",
            )
            .and_then(|mut s| s.execute((event_id, at.to_string(), kind, downstream_key, outcome)))
            .map(|n| n == 1)
            .map_err(backend)
    }

    fn payouts_in(&mut self, state: PayoutState, limit: i64) -> Result<Vec<PayoutRow>, StoreError> {
        self.payouts_where("state = ?1 ORDER BY created_at, payout_id LIMIT ?2", &[&state.name(), &limit])
    }

    fn insert_payout_event(&mut self, e: &PayoutEvent) -> Result<(), StoreError> {
        self.conn
            .prepare_cached(&format!(
                "INSERT INTO payout_event ({EVENT_COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6)"
            ))
            .and_then(|mut s| {
                s.execute(rusqlite::params![
                    e.payout_id,
                    e.at.to_string(),
                    e.actor,
                    e.was.name(),
                    e.now.name(),
                    e.why
                ])
            })
            .map(|_| ())
            .map_err(backend)
    }

    fn payout_events(&mut self, payout_id: i64) -> Result<Vec<PayoutEvent>, StoreError> {
        let sql = format!("SELECT {EVENT_COLUMNS} FROM payout_event WHERE payout_id = ?1 ORDER BY event_id");
        let mut stmt = self.conn.prepare_cached(&sql).map_err(backend)?;
        let rows: Vec<Result<PayoutEvent, StoreError>> =
            stmt.query_map([payout_id], payout_event).and_then(|rows| rows.collect()).map_err(backend)?;
        rows.into_iter().collect()
    }

    fn commit(mut self: Box<Self>) -> Result<(), StoreError> {
        // A commit that fails leaves the transaction open: the drop rolls it back.
        run(self.conn, if self.savepoint { "RELEASE request" } else { "COMMIT" })?;
        self.open = false;
        Ok(())
    }
}
