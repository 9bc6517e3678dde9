//! `idem replay`: every logged request through the engine, in `seq` order,
//! each at its logged time, into a fresh `day.db`.
//!
//! Requests logged at the same instant are run as racers do: all of them
//! claim first, then the winners execute. That is the interleaving in which a
//! lookup-then-insert engine pays twice, so the day exercises it on purpose.

use super::DayError;
use crate::clock::Timestamp;
use crate::policy::Policy;
use crate::protocol::{self, Ctx, Response};
use crate::request::{self, ScopedKey};
use crate::store::sqlite::SqliteStore;
use rusqlite::Connection;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DayResult {
    pub requests: i64,
    pub created: i64,
    pub replayed: i64,
    pub rejected: i64,
    pub transfers: i64,
    pub total_transferred: i64,
    pub v1_total: i64,
    pub double_paid_avoided: i64,
    pub rejected_by_reason: BTreeMap<String, i64>,
    /// Keys whose answers named more than one transfer_id: must be 0.
    pub keys_paid_twice: i64,
    /// Transfers no completed key points at: must be 0.
    pub transfers_without_key: i64,
    pub balance_total_before: i64,
    pub balance_total_after: i64,
}

/// What the engine answered to one logged request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub seq: i64,
    pub kind: String,
    pub status: u16,
    pub replay: bool,
    pub reason: Option<String>,
}

struct Logged {
    seq: i64,
    at: Timestamp,
    kind: String,
    raw: String,
}

/// Replays `log`'s `req_log` into `day` (a new, empty database).
pub fn replay(
    log: &Connection,
    day: Connection,
    policy: &Policy,
) -> Result<(DayResult, Vec<Answer>), DayError> {
    day.execute_batch(
        "CREATE TABLE account (acct_id TEXT PRIMARY KEY, holder TEXT NOT NULL, balance INTEGER NOT NULL)",
    )?;
    {
        let mut read = log.prepare("SELECT acct_id, holder, balance FROM account ORDER BY acct_id")?;
        let mut write = day.prepare("INSERT INTO account VALUES (?1, ?2, ?3)")?;
        let mut rows = read.query([])?;
        while let Some(r) = rows.next()? {
            write.execute((r.get::<_, String>(0)?, r.get::<_, String>(1)?, r.get::<_, i64>(2)?))?;
        }
    }
    let balance_total_before = sum(&day, "SELECT COALESCE(SUM(balance), 0) FROM account")?;
    let mut store = SqliteStore::from_connection(day, policy)?;

    let mut logged = Vec::new();
    let mut stmt = log.prepare("SELECT seq, received_at, kind, raw FROM req_log ORDER BY seq")?;
    let mut rows = stmt.query([])?;
    while let Some(r) = rows.next()? {
        let at: String = r.get(1)?;
        let at = Timestamp::parse(&at).map_err(|e| DayError(format!("req_log: {e}")))?;
        logged.push(Logged { seq: r.get(0)?, at, kind: r.get(2)?, raw: r.get(3)? });
    }

    let mut answers = Vec::new();
    let mut paid: BTreeMap<ScopedKey, BTreeSet<i64>> = BTreeMap::new();
    for group in logged.chunk_by(|a, b| a.at == b.at) {
        for (entry, response) in group.iter().zip(run_instant(&mut store, group, policy)?) {
            if let (Some(key), Some(id)) = (key_of(&entry.raw, policy), response.transfer_id()) {
                paid.entry(key).or_default().insert(id);
            }
            answers.push(Answer {
                seq: entry.seq,
                kind: entry.kind.clone(),
                status: response.status,
                replay: response.replay,
                reason: response.reason,
            });
        }
    }

    let conn = store.connection();
    let mut rejected_by_reason = BTreeMap::new();
    for a in answers.iter().filter(|a| !a.replay && a.status != 201) {
        *rejected_by_reason.entry(a.reason.clone().unwrap_or_default()).or_insert(0) += 1;
    }
    let total_transferred = sum(conn, "SELECT COALESCE(SUM(amount), 0) FROM transfer")?;
    let v1_total = sum(log, "SELECT COALESCE(SUM(amount), 0) FROM transfer_v1")?;
    let result = DayResult {
        requests: answers.len() as i64,
        created: answers.iter().filter(|a| a.status == 201 && !a.replay).count() as i64,
        replayed: answers.iter().filter(|a| a.replay).count() as i64,
        rejected: rejected_by_reason.values().sum(),
        transfers: sum(conn, "SELECT COUNT(*) FROM transfer")?,
        total_transferred,
        v1_total,
        double_paid_avoided: v1_total - total_transferred,
        rejected_by_reason,
        keys_paid_twice: paid.values().filter(|ids| ids.len() > 1).count() as i64,
        transfers_without_key: sum(
            conn,
            "SELECT COUNT(*) FROM transfer t WHERE NOT EXISTS
               (SELECT 1 FROM idem_key k WHERE k.transfer_id = t.transfer_id AND k.state = 'completed')",
        )?,
        balance_total_before,
        balance_total_after: sum(conn, "SELECT COALESCE(SUM(balance), 0) FROM account")?,
    };
    // Leave day.db as one self-contained file.
    conn.execute_batch("PRAGMA wal_checkpoint(TRUNCATE); PRAGMA journal_mode = DELETE;")?;
    Ok((result, answers))
}

/// One instant of the log, raced: every claim before any execution.
fn run_instant(
    store: &mut SqliteStore,
    group: &[Logged],
    policy: &Policy,
) -> Result<Vec<Response>, DayError> {
    let tokens: Vec<String> = group.iter().map(|e| format!("seq-{}", e.seq)).collect();
    let batch: Vec<_> = group
        .iter()
        .zip(&tokens)
        .map(|(e, token)| (e.raw.as_str(), Ctx { policy, now: e.at, token }))
        .collect();
    Ok(protocol::together(store, &batch)?)
}

fn key_of(raw: &str, policy: &Policy) -> Option<ScopedKey> {
    request::parse(raw.as_bytes(), policy).ok().map(|r| r.key)
}

fn sum(conn: &Connection, sql: &str) -> Result<i64, DayError> {
    Ok(conn.query_row(sql, [], |r| r.get(0))?)
}
