//! The engine's tables on SQLite: the file checked (WAL, the schema
//! version, no triggers or views on the engine's tables, a unique
//! `acct_id`), and created on first use.

use super::*;

/// Bumped whenever the tables below change shape.
/// Version 2 added `idem_key.content_type`, version 3 `idem_key.headers` and
/// version 4 `idem_key.body_bytes`, the key table's one shape
/// (`store::keys`); a file of an older version is upgraded on open.
pub const SCHEMA_VERSION: i64 = 4;

/// The engine's tables besides the key table, whose shape is `store::keys`'s.
pub(super) const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS transfer (
    transfer_id INTEGER PRIMARY KEY,
    src         NOT NULL,  -- no declared type: keeps account.acct_id's own type
    dst         NOT NULL,
    amount      INTEGER NOT NULL CHECK (typeof(amount) = 'integer' AND amount > 0),
    currency    TEXT NOT NULL,
    created_at  TEXT NOT NULL
);
";

/// Everything checked on every open. Only the checks that read come first;
/// a file refused by them is left exactly as it was.
pub(super) fn prepare(conn: &Connection) -> Result<(), StoreError> {
    let v = user_version(conn)?;
    if !(0..=SCHEMA_VERSION).contains(&v) {
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
    if v < SCHEMA_VERSION {
        create_schema(conn)?;
    }
    Ok(())
}

pub(super) fn user_version(conn: &Connection) -> Result<i64, StoreError> {
    conn.pragma_query_value(None, "user_version", |r| r.get(0)).map_err(backend)
}

/// Durability rests on WAL, so a file found in another journal mode (switched
/// by hand, restored by `VACUUM INTO`) is switched back, or refused if it
/// cannot be. An in-memory database has nothing to make durable.
pub(super) fn ensure_wal(conn: &Connection) -> Result<(), StoreError> {
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
pub(super) fn check_shapes(conn: &Connection) -> Result<(), StoreError> {
    for (table, wanted) in [
        ("account", &ACCOUNT_COLUMNS[..]),
        ("transfer", &crate::store::TRANSFER_COLUMNS[..]),
        ("idem_key", &crate::store::KEY_COLUMNS[..]),
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

/// Creates the engine's tables, or upgrades those of an older version. Two
/// first calls may race here; the version re-read under the write lock
/// makes the loser a no-op.
pub(super) fn create_schema(conn: &Connection) -> Result<(), StoreError> {
    conn.execute_batch("BEGIN IMMEDIATE").map_err(backend)?;
    let created = (|| {
        if user_version(conn)? < SCHEMA_VERSION {
            conn.execute_batch(SCHEMA).map_err(backend)?;
            conn.execute_batch(&keys().create("idem_key_created_at", Dialect::Sqlite)).map_err(backend)?;
            // a table of an older version, or the file's own of the engine's shape
            let have = columns(conn, "idem_key")?;
            for (added, kind) in [("content_type", "TEXT"), ("headers", "TEXT"), ("body_bytes", "BLOB")] {
                if !have.iter().any(|c| c == added) {
                    let add = format!("ALTER TABLE idem_key ADD COLUMN {added} {kind}");
                    conn.execute_batch(&add).map_err(backend)?;
                }
            }
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
pub(super) fn check_account(conn: &Connection) -> Result<(), StoreError> {
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

pub(super) const ACCOUNT_COLUMNS: [&str; 2] = ["acct_id", "balance"];
/// The column names of `table`; empty if there is no such table.
pub(super) fn columns(conn: &Connection, table: &str) -> Result<Vec<String>, StoreError> {
    let mut stmt = conn.prepare("SELECT name FROM pragma_table_info(?1)").map_err(backend)?;
    let names = stmt.query_map([table], |r| r.get(0)).and_then(|rows| rows.collect());
    names.map_err(backend)
}
