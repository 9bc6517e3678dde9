//! The key table's statements run on a SQLite connection the caller lends,
//! inside the write transaction the caller holds (`BEGIN IMMEDIATE`).

use super::{Kept, KeyTable, Who};
use crate::clock::Timestamp;
use crate::store::{Claim, KeyRecord, KeyRow, Stored};
use rusqlite::{Connection, OptionalExtension, Row, ToSql};

/// The record of a key row whose `RECORD_COLUMNS` start at column `at`.
pub(crate) fn record(r: &Row, at: usize) -> rusqlite::Result<KeyRecord> {
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
    // a row idem cannot have written
    row.decode().map_err(|e| rusqlite::Error::InvalidColumnName(format!("corrupt key row: {e}")))
}

/// The key's record and what its answer keeps besides, if the key exists.
pub(crate) fn read(conn: &Connection, t: &KeyTable, who: Who) -> rusqlite::Result<Option<(KeyRecord, Kept)>> {
    let kept = |r: &Row| -> rusqlite::Result<Kept> {
        Ok(Kept { content_type: r.get(9)?, headers: r.get(10)?, body_bytes: r.get(11)? })
    };
    conn.prepare_cached(&t.read)?.query_row(who, |r| Ok((record(r, 0)?, kept(r)?))).optional()
}

/// Inserts `claim` unless the key exists (`false`: it does).
pub(crate) fn insert_claim(
    conn: &Connection,
    t: &KeyTable,
    who: Who,
    claim: &Claim,
) -> rusqlite::Result<bool> {
    write_claim(conn, &t.insert_claim, who, claim, &[])
}

/// Writes `claim` over the key only if it is still the version `seen`.
pub(crate) fn replace_claim(
    conn: &Connection,
    t: &KeyTable,
    who: Who,
    seen: &KeyRecord,
    claim: &Claim,
) -> rusqlite::Result<bool> {
    write_claim(conn, &t.replace_claim, who, claim, &[&seen.token, &seen.state.name()])
}

fn write_claim(
    conn: &Connection,
    sql: &str,
    who: Who,
    claim: &Claim,
    seen: &[&dyn ToSql],
) -> rusqlite::Result<bool> {
    let (at, lease) = (claim.created_at.to_string(), claim.lease_until.to_string());
    let mut args: Vec<&dyn ToSql> =
        vec![&who[0], &who[1], &who[2], &claim.fingerprint, &claim.token, &at, &lease];
    args.extend_from_slice(seen);
    Ok(conn.prepare_cached(sql)?.execute(args.as_slice())? == 1)
}

/// Completes the key with `answer` (and what it keeps besides) at `at`,
/// only if `token` still holds it in progress.
pub(crate) fn complete(
    conn: &Connection,
    t: &KeyTable,
    who: Who,
    token: &str,
    answer: &Stored,
    kept: &Kept,
    at: Timestamp,
) -> rusqlite::Result<bool> {
    let reason = answer.reason.as_ref().map(ToString::to_string);
    let done = conn.prepare_cached(&t.complete)?.execute(rusqlite::params![
        who[0],
        who[1],
        who[2],
        answer.status,
        reason,
        answer.body,
        answer.transfer_id,
        at.to_string(),
        token,
        kept.content_type,
        kept.headers,
        kept.body_bytes,
    ])?;
    Ok(done == 1)
}

/// Inserts the key claimed by `claim` already completed with `answer` at
/// `at` (see [`KeyTable::insert_completed`]).
pub(crate) fn insert_completed(
    conn: &Connection,
    t: &KeyTable,
    who: Who,
    claim: &Claim,
    answer: &Stored,
    at: Timestamp,
) -> rusqlite::Result<bool> {
    let reason = answer.reason.as_ref().map(ToString::to_string);
    let inserted = conn.prepare_cached(&t.insert_completed)?.execute(rusqlite::params![
        who[0],
        who[1],
        who[2],
        claim.fingerprint,
        claim.token,
        claim.created_at.to_string(),
        claim.lease_until.to_string(),
        answer.status,
        reason,
        answer.body,
        answer.transfer_id,
        at.to_string(),
        None::<String>, // the engine's answers: nothing kept besides the record
        None::<String>,
        None::<Vec<u8>>,
    ])?;
    Ok(inserted == 1)
}

/// Deletes the key if `token` still holds it in progress.
pub(crate) fn release(conn: &Connection, t: &KeyTable, who: Who, token: &str) -> rusqlite::Result<bool> {
    Ok(conn.prepare_cached(&t.release)?.execute((who[0], who[1], who[2], token))? == 1)
}

/// Deletes up to `limit` keys created before `before`, oldest first,
/// sparing the claims in progress of `spared` (the engine's payouts).
pub(crate) fn purge(
    conn: &Connection,
    t: &KeyTable,
    before: Timestamp,
    limit: u64,
    spared: &str,
) -> rusqlite::Result<u64> {
    let limit = i64::try_from(limit).unwrap_or(i64::MAX);
    Ok(conn.prepare_cached(&t.purge)?.execute((before.to_string(), limit, spared))? as u64)
}

/// Runs the steps of `steps` that the table `versions` does not record yet,
/// each in a write transaction of its own with its version.
pub(crate) fn migrate(conn: &Connection, versions: &str, steps: &[String]) -> rusqlite::Result<()> {
    let versions = super::Versions(versions);
    conn.execute_batch(&versions.create())?;
    let at: i64 = conn.query_row(&versions.reached(), [], |r| r.get(0))?;
    for (n, step) in steps.iter().enumerate().skip(usize::try_from(at).unwrap_or(usize::MAX)) {
        let done =
            conn.execute_batch(&format!("BEGIN IMMEDIATE; {step}; {}; COMMIT;", versions.record(n + 1)));
        if done.is_err() && !conn.is_autocommit() {
            // a step that failed leaves its transaction open: end it
            let _ = conn.execute_batch("ROLLBACK");
        }
        done?;
    }
    Ok(())
}
