//! A bank to run the engine on: an `account` table with given rows, created
//! in a fresh database of either kind, read back, and cleared away again.
//! This is the setup a user does by hand before pointing the engine at their
//! database; the day (`idem prove`), `idem chaos`, the benches and the tests
//! build theirs with it.

use super::{Db, Failure, Reads, StoreError, pg};
use crate::policy::Policy;
use crate::request::AcctId;
use rusqlite::Connection;
use std::collections::BTreeMap;
use std::path::Path;

/// An account as a bank is made of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Account {
    pub id: String,
    pub holder: String,
    pub balance: i64,
}

/// A transfer row as the verdicts read it, ids as text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferRow {
    pub id: i64,
    pub src: String,
    pub dst: String,
    pub amount: i64,
}

fn sqlite(e: rusqlite::Error) -> StoreError {
    StoreError::Backend(Failure::caused_by(format!("sqlite: {e}"), e))
}

/// The `account` table, in the one text both databases take: the lab's
/// `account(acct_id, holder, balance)`, the balance an integer of 64 bits.
pub const ACCOUNT: &str =
    "CREATE TABLE account (acct_id TEXT PRIMARY KEY, holder TEXT NOT NULL, balance BIGINT NOT NULL)";

/// The same table with `acct_id` of no declared type, so that each id
/// keeps the type it was written with: a lab database may hold integer
/// ids, and the scenarios hold both kinds (SQLite only).
const ACCOUNT_ANY_ID: &str =
    "CREATE TABLE account (acct_id PRIMARY KEY, holder TEXT NOT NULL, balance BIGINT NOT NULL)";

/// An in-memory SQLite bank holding `accounts` and nothing else, for the
/// scenarios and the storms; each id keeps its type (an integer id stays
/// an integer).
pub fn in_memory(accounts: &[(AcctId, i64)], policy: &Policy) -> Result<Box<dyn Reads + Send>, StoreError> {
    let conn = Connection::open_in_memory().map_err(sqlite)?;
    conn.execute_batch(ACCOUNT_ANY_ID).map_err(sqlite)?;
    for (id, balance) in accounts {
        conn.execute("INSERT INTO account VALUES (?1, 'bank', ?2)", (id, balance)).map_err(sqlite)?;
    }
    Ok(Box::new(super::sqlite::SqliteStore::from_connection(conn, policy)?))
}

/// Creates `account` holding `accounts` in `db`: a new SQLite file (which
/// must not exist), or a PostgreSQL database (or schema) with no `account`,
/// `transfer`, `idem_key` or `payout` yet.
pub fn create(db: &Db, accounts: &[Account]) -> Result<(), StoreError> {
    match db {
        Db::Postgres(spec) => {
            let mut client = pg::client(spec, Policy::embedded())?;
            let mut tx = client.transaction().map_err(pg::pg)?;
            let taken: Option<String> = tx
                .query_one(
                    "SELECT string_agg(t, ', ') FROM unnest(ARRAY['account', 'transfer', 'idem_key', 'payout']) AS t
                     WHERE to_regclass(t) IS NOT NULL",
                    &[],
                )
                .map_err(pg::pg)?
                .get(0);
            if let Some(tables) = taken {
                return Err(StoreError::Schema(format!(
                    "the bank needs an empty database, and this one has {tables}"
                )));
            }
            tx.batch_execute(ACCOUNT).map_err(pg::pg)?;
            for a in accounts {
                tx.execute("INSERT INTO account VALUES ($1, $2, $3)", &[&a.id, &a.holder, &a.balance])
                    .map_err(pg::pg)?;
            }
            tx.commit().map_err(pg::pg)
        }
        Db::Sqlite(path) => {
            if path.exists() {
                return Err(StoreError::Schema(format!(
                    "{} exists; remove it or pick another path",
                    path.display()
                )));
            }
            let mut conn = Connection::open(path).map_err(sqlite)?;
            let tx = conn.transaction().map_err(sqlite)?;
            tx.execute_batch(ACCOUNT).map_err(sqlite)?;
            for a in accounts {
                tx.execute("INSERT INTO account VALUES (?1, ?2, ?3)", (&a.id, &a.holder, a.balance))
                    .map_err(sqlite)?;
            }
            tx.commit().map_err(sqlite)
        }
    }
}

/// Leaves a finished SQLite bank self-contained: the file without its WAL
/// beside it. Nothing to do on PostgreSQL.
pub fn settle(db: &Db) -> Result<(), StoreError> {
    match db {
        Db::Sqlite(path) => Connection::open(path)
            .and_then(|c| c.execute_batch("PRAGMA wal_checkpoint(TRUNCATE); PRAGMA journal_mode = DELETE;"))
            .map_err(sqlite),
        Db::Postgres(_) => Ok(()),
    }
}

/// Removes a bank: the SQLite file and its companions, or the tables.
pub fn drop(db: &Db) -> Result<(), StoreError> {
    match db {
        Db::Postgres(spec) => pg::client(spec, Policy::embedded())?
            .batch_execute("DROP TABLE IF EXISTS payout, idem_key, transfer, account")
            .map_err(pg::pg),
        Db::Sqlite(path) => remove_files(path),
    }
}

/// A second bank's place beside `db`'s: on PostgreSQL the schema
/// `idem_{name}` of the same database (created if absent), on SQLite the
/// file `{name}.db` in the same directory. `name` is lowercase letters and
/// underscores.
pub fn beside(db: &Db, name: &str) -> Result<Db, StoreError> {
    if name.is_empty() || !name.bytes().all(|b| b.is_ascii_lowercase() || b == b'_') {
        return Err(StoreError::Schema(format!("{name:?} cannot name a bank beside another")));
    }
    match db {
        Db::Postgres(spec) => {
            pg::client(spec, Policy::embedded())?
                .batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS idem_{name}"))
                .map_err(pg::pg)?;
            Ok(db.in_schema(&format!("idem_{name}")))
        }
        Db::Sqlite(path) => Ok(Db::Sqlite(path.with_file_name(format!("{name}.db")))),
    }
}

/// Removes the schema [`beside`] made on PostgreSQL, with all it holds. A
/// SQLite file beside is left for a person to look at.
pub fn remove_beside(db: &Db, name: &str) -> Result<(), StoreError> {
    match db {
        Db::Postgres(spec) if name.bytes().all(|b| b.is_ascii_lowercase() || b == b'_') => {
            pg::client(spec, Policy::embedded())?
                .batch_execute(&format!("DROP SCHEMA IF EXISTS idem_{name} CASCADE"))
                .map_err(pg::pg)
        }
        _ => Ok(()),
    }
}

/// Removes a SQLite database and its WAL companions, if present.
pub fn remove_files(path: &Path) -> Result<(), StoreError> {
    for suffix in ["", "-wal", "-shm", "-journal"] {
        let mut p = path.as_os_str().to_owned();
        p.push(suffix);
        match std::fs::remove_file(&p) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(StoreError::Backend(Failure::caused_by(
                    format!("{}: {e}", Path::new(&p).display()),
                    e,
                )));
            }
            _ => {}
        }
    }
    Ok(())
}

/// The `transfer` table and every balance, read straight from the database
/// (not through the engine, which may be the thing under judgement).
pub fn ledger(db: &Db) -> Result<(Vec<TransferRow>, BTreeMap<String, i64>), StoreError> {
    const TRANSFERS: &str =
        "SELECT transfer_id, CAST(src AS TEXT), CAST(dst AS TEXT), amount FROM transfer ORDER BY transfer_id";
    const BALANCES: &str = "SELECT CAST(acct_id AS TEXT), CAST(balance AS BIGINT) FROM account";
    match db {
        Db::Postgres(spec) => {
            let mut client = pg::client(spec, Policy::embedded())?;
            let rows = client.query(TRANSFERS, &[]).map_err(pg::pg)?;
            let transfers = rows.iter().map(|r| TransferRow {
                id: r.get(0),
                src: r.get(1),
                dst: r.get(2),
                amount: r.get(3),
            });
            let balances =
                client.query(BALANCES, &[]).map_err(pg::pg)?.iter().map(|r| (r.get(0), r.get(1))).collect();
            Ok((transfers.collect(), balances))
        }
        Db::Sqlite(path) => {
            let conn = Connection::open(path).map_err(sqlite)?;
            let read = || -> rusqlite::Result<_> {
                let mut stmt = conn.prepare(TRANSFERS)?;
                let transfers = stmt
                    .query_map([], |r| {
                        Ok(TransferRow { id: r.get(0)?, src: r.get(1)?, dst: r.get(2)?, amount: r.get(3)? })
                    })?
                    .collect::<Result<_, _>>()?;
                let mut stmt = conn.prepare(BALANCES)?;
                let balances =
                    stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?.collect::<Result<_, _>>()?;
                Ok((transfers, balances))
            };
            read().map_err(sqlite)
        }
    }
}

/// One row of idem's `payout` table, read straight from the database.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PayoutLine {
    pub id: i64,
    pub src: String,
    pub amount: i64,
    pub state: String,
    pub downstream_key: String,
    pub note: Option<String>,
    /// Sends to the gateway.
    pub sends: i64,
}

/// Every payout, oldest first; none if the table was never created.
pub fn payouts(db: &Db) -> Result<Vec<PayoutLine>, StoreError> {
    const SQL: &str = "SELECT payout_id, CAST(src AS TEXT), amount, state, downstream_key, note,
                              CAST(sends AS BIGINT) FROM payout ORDER BY payout_id";
    match db {
        Db::Postgres(spec) => {
            let mut client = pg::client(spec, Policy::embedded())?;
            let exists: bool =
                client.query_one("SELECT to_regclass('payout') IS NOT NULL", &[]).map_err(pg::pg)?.get(0);
            if !exists {
                return Ok(Vec::new());
            }
            let rows = client.query(SQL, &[]).map_err(pg::pg)?;
            Ok(rows
                .iter()
                .map(|r| PayoutLine {
                    id: r.get(0),
                    src: r.get(1),
                    amount: r.get(2),
                    state: r.get(3),
                    downstream_key: r.get(4),
                    note: r.get(5),
                    sends: r.get(6),
                })
                .collect())
        }
        Db::Sqlite(path) => {
            let conn = Connection::open(path).map_err(sqlite)?;
            let read = || -> rusqlite::Result<Vec<PayoutLine>> {
                let exists: bool = conn.query_row(
                    "SELECT EXISTS (SELECT 1 FROM sqlite_schema WHERE type = 'table' AND name = 'payout')",
                    [],
                    |r| r.get(0),
                )?;
                if !exists {
                    return Ok(Vec::new());
                }
                let mut stmt = conn.prepare(SQL)?;
                let rows = stmt.query_map([], |r| {
                    Ok(PayoutLine {
                        id: r.get(0)?,
                        src: r.get(1)?,
                        amount: r.get(2)?,
                        state: r.get(3)?,
                        downstream_key: r.get(4)?,
                        note: r.get(5)?,
                        sends: r.get(6)?,
                    })
                })?;
                rows.collect()
            };
            read().map_err(sqlite)
        }
    }
}
