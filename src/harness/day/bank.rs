//! The day's bank: its accounts, created in a fresh database of either
//! store, and cleared away again. This is the harness's own setup, the part a
//! user does by hand before pointing the engine at their database.

use super::{DayError, remove_db};
use crate::policy::Policy;
use crate::store::pg;
use rusqlite::Connection;

/// An account of the day, as `idem.db` holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Account {
    pub id: String,
    pub holder: String,
    pub balance: i64,
}

/// The accounts of the day's log.
pub fn accounts(log: &Connection) -> Result<Vec<Account>, DayError> {
    let mut stmt = log.prepare("SELECT acct_id, holder, balance FROM account ORDER BY acct_id")?;
    let rows =
        stmt.query_map([], |r| Ok(Account { id: r.get(0)?, holder: r.get(1)?, balance: r.get(2)? }))?;
    Ok(rows.collect::<Result<_, _>>()?)
}

/// Creates `account` holding `accounts` in the database `spec` names: a new
/// SQLite file (which must not exist), or a PostgreSQL database (or schema)
/// with no `account` table yet.
pub fn create(spec: &str, accounts: &[Account]) -> Result<(), DayError> {
    const TABLE: &str =
        "CREATE TABLE account (acct_id TEXT PRIMARY KEY, holder TEXT NOT NULL, balance BIGINT NOT NULL)";
    if pg::is_postgres(spec) {
        let mut client = pg::client(spec, Policy::embedded())?;
        let mut tx = client.transaction().map_err(pg::pg)?;
        let taken: Option<String> = tx
            .query_one(
                "SELECT string_agg(t, ', ') FROM unnest(ARRAY['account', 'transfer', 'idem_key']) AS t
                 WHERE to_regclass(t) IS NOT NULL",
                &[],
            )
            .map_err(pg::pg)?
            .get(0);
        if let Some(tables) = taken {
            return Err(DayError(format!("the day needs an empty database, and this one has {tables}")));
        }
        tx.batch_execute(TABLE).map_err(pg::pg)?;
        for a in accounts {
            tx.execute("INSERT INTO account VALUES ($1, $2, $3)", &[&a.id, &a.holder, &a.balance])
                .map_err(pg::pg)?;
        }
        return tx.commit().map_err(|e| pg::pg(e).into());
    }
    if std::path::Path::new(spec).exists() {
        return Err(DayError(format!("{spec} exists; remove it or pick another path")));
    }
    let mut conn = Connection::open(spec)?;
    let tx = conn.transaction()?;
    tx.execute_batch(TABLE)?;
    for a in accounts {
        tx.execute("INSERT INTO account VALUES (?1, ?2, ?3)", (&a.id, &a.holder, a.balance))?;
    }
    Ok(tx.commit()?)
}

/// Leaves a finished day database self-contained: a SQLite file without its
/// WAL beside it. Nothing to do on PostgreSQL.
pub fn settle(spec: &str) -> Result<(), DayError> {
    if !pg::is_postgres(spec) {
        Connection::open(spec)?
            .execute_batch("PRAGMA wal_checkpoint(TRUNCATE); PRAGMA journal_mode = DELETE;")?;
    }
    Ok(())
}

/// Removes a scratch day: the SQLite file, or the three tables.
pub fn drop(spec: &str) -> Result<(), DayError> {
    if pg::is_postgres(spec) {
        let mut client = pg::client(spec, Policy::embedded())?;
        return client
            .batch_execute("DROP TABLE IF EXISTS idem_key, transfer, account")
            .map_err(|e| pg::pg(e).into());
    }
    remove_db(std::path::Path::new(spec))
}

/// A transfer row as the verdicts read it, ids as text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferRow {
    pub id: i64,
    pub src: String,
    pub dst: String,
    pub amount: i64,
}

/// The `transfer` table and every balance, read straight from the database
/// (not through the engine, which may be the thing under judgement).
pub fn ledger(spec: &str) -> Result<(Vec<TransferRow>, std::collections::BTreeMap<String, i64>), DayError> {
    const TRANSFERS: &str =
        "SELECT transfer_id, CAST(src AS TEXT), CAST(dst AS TEXT), amount FROM transfer ORDER BY transfer_id";
    const BALANCES: &str = "SELECT CAST(acct_id AS TEXT), CAST(balance AS BIGINT) FROM account";
    if pg::is_postgres(spec) {
        let mut client = pg::client(spec, Policy::embedded())?;
        let rows = client.query(TRANSFERS, &[]).map_err(pg::pg)?;
        let transfers =
            rows.iter().map(|r| TransferRow { id: r.get(0), src: r.get(1), dst: r.get(2), amount: r.get(3) });
        let balances =
            client.query(BALANCES, &[]).map_err(pg::pg)?.iter().map(|r| (r.get(0), r.get(1))).collect();
        return Ok((transfers.collect(), balances));
    }
    let conn = Connection::open(spec)?;
    let mut stmt = conn.prepare(TRANSFERS)?;
    let transfers = stmt
        .query_map([], |r| {
            Ok(TransferRow { id: r.get(0)?, src: r.get(1)?, dst: r.get(2)?, amount: r.get(3)? })
        })?
        .collect::<Result<_, _>>()?;
    let mut stmt = conn.prepare(BALANCES)?;
    let balances = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?.collect::<Result<_, _>>()?;
    Ok((transfers, balances))
}
