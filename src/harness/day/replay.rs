//! `idem replay`: every logged request through the engine, one at a time in
//! `seq` order, each at its logged time, into a fresh day database (a SQLite
//! `day.db`, or an empty PostgreSQL database), as the lab says ("send all of
//! req_log in seq order and count the results").
//!
//! In that order the second of two requests logged at the same instant finds
//! the first completed and replays it. The race they really were is shown
//! apart, and by real processes: a copy of the day as it stood just before
//! the pair (the log's earlier requests replayed into a scratch database) is
//! raced by engine processes released together ([`Racing`]). That outcome
//! goes into its own line of the report; the counts of `result.json` are the
//! seq-order replay's.

use super::HarnessError;
use crate::clock::Timestamp;
use crate::harness::files::io_at;
use crate::harness::{self, race};
use crate::policy::Policy;
use crate::protocol::Ctx;
use crate::request::{self, ScopedKey};
use crate::store::{self, Store, Usage};
use crate::store::{Db, bank};
use rusqlite::Connection;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};

/// How to race the same-instant requests: the engine command (the lab's
/// contract) and a scratch database (SQLite path or PostgreSQL connection
/// string) for the copy of the day it races on.
#[derive(Debug, Clone)]
pub struct Racing {
    pub engine: Vec<String>,
    pub scratch: Db,
}

/// What the racing processes did on the copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RaceOutcome {
    pub seqs: Vec<i64>,
    /// `(status, replay)` of each process's answer, in `seq` order.
    pub answers: Vec<(u16, bool)>,
    /// Transfers the racers made between them: exactly one is right.
    pub transfers: i64,
}

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

/// Everything one replay produced.
pub struct Replayed {
    pub result: DayResult,
    pub answers: Vec<Answer>,
    pub race: Option<RaceOutcome>,
}

/// Replays `log`'s `req_log` into the empty day database `day` names.
pub fn replay(
    log: &Connection,
    day: &Db,
    policy: &Policy,
    racing: Option<&Racing>,
) -> Result<Replayed, HarnessError> {
    let accounts = accounts(log)?;
    bank::create(day, &accounts)?;
    let mut store = store::open(day, policy, Usage::LongLived)?;
    let balance_total_before = store.audit()?.money();

    let mut logged = Vec::new();
    let mut stmt = log.prepare("SELECT seq, received_at, kind, raw FROM req_log ORDER BY seq")?;
    let mut rows = stmt.query([])?;
    while let Some(r) = rows.next()? {
        let at: String = r.get(1)?;
        let at = Timestamp::parse(&at).map_err(|e| HarnessError::Stopped(format!("req_log: {e}")))?;
        logged.push(Logged { seq: r.get(0)?, at, kind: r.get(2)?, raw: r.get(3)? });
    }

    let mut race = None;
    let mut answers = Vec::new();
    let mut paid: BTreeMap<ScopedKey, BTreeSet<i64>> = BTreeMap::new();
    for (i, entry) in logged.iter().enumerate() {
        let instant: Vec<&Logged> = logged[i..].iter().take_while(|e| e.at == entry.at).collect();
        if let (Some(racing), None, true) = (racing, &race, instant.len() > 1) {
            race = Some(race_on_a_copy(&logged[..i], &instant, &accounts, racing, policy)?);
        }
        let token = format!("seq-{}", entry.seq);
        let ctx = Ctx { policy, now: entry.at, token: &token };
        let response = harness::send(&mut store, &entry.raw, ctx, None)?
            .ok_or_else(|| HarnessError::Stopped(format!("seq {} crashed unasked", entry.seq)))?;
        if let (Some(key), Some(id)) = (key_of(&entry.raw, policy), response.transfer_id) {
            paid.entry(key).or_default().insert(id);
        }
        answers.push(Answer {
            seq: entry.seq,
            kind: entry.kind.clone(),
            status: response.status,
            replay: response.replay,
            reason: response.reason.map(|r| r.to_string()),
        });
    }
    let audit = store.audit()?;
    let mut rejected_by_reason = BTreeMap::new();
    for a in answers.iter().filter(|a| !a.replay && a.status != 201) {
        *rejected_by_reason.entry(a.reason.clone().unwrap_or_default()).or_insert(0) += 1;
    }
    let total_transferred = audit.transfers.iter().map(|(_, amount)| amount).sum();
    let v1_total = log.query_row("SELECT COALESCE(SUM(amount), 0) FROM transfer_v1", [], |r| r.get(0))?;
    let result = DayResult {
        requests: answers.len() as i64,
        created: answers.iter().filter(|a| a.status == 201 && !a.replay).count() as i64,
        replayed: answers.iter().filter(|a| a.replay).count() as i64,
        rejected: rejected_by_reason.values().sum(),
        transfers: audit.transfers.len() as i64,
        total_transferred,
        v1_total,
        double_paid_avoided: v1_total - total_transferred,
        rejected_by_reason,
        keys_paid_twice: paid.values().filter(|ids| ids.len() > 1).count() as i64,
        transfers_without_key: audit.orphans.len() as i64,
        balance_total_before,
        balance_total_after: audit.money(),
    };
    drop(store);
    bank::settle(day)?;
    Ok(Replayed { result, answers, race })
}

/// Builds a copy of the day as it stood before `instant` (the `earlier`
/// requests replayed into `racing.scratch`) and sends the requests of that
/// instant to the copy as processes released together.
fn race_on_a_copy(
    earlier: &[Logged],
    instant: &[&Logged],
    accounts: &[bank::Account],
    racing: &Racing,
    policy: &Policy,
) -> Result<RaceOutcome, HarnessError> {
    bank::drop(&racing.scratch)?;
    bank::create(&racing.scratch, accounts)?;
    let mut copy = store::open(&racing.scratch, policy, Usage::LongLived)?;
    for e in earlier {
        let token = format!("seq-{}", e.seq);
        harness::send(&mut copy, &e.raw, Ctx { policy, now: e.at, token: &token }, None)?;
    }
    let before = copy.audit()?.transfers.len() as i64;
    drop(copy);
    // The request files live in a directory of this race alone: two days
    // proved at once (tests run in parallel threads of one process) must
    // never share, or remove, each other's files.
    let dir =
        tempfile::Builder::new().prefix("idem-race-").tempdir().map_err(io_at(&std::env::temp_dir()))?;
    let mut files = Vec::new();
    for e in instant {
        let file = dir.path().join(format!("seq-{}.json", e.seq));
        std::fs::write(&file, &e.raw).map_err(io_at(&file))?;
        files.push(file);
    }
    let now = instant[0].at.to_string();
    let finished =
        race::release_together(&racing.engine, &racing.scratch.to_arg(), &files, &[("IDEM_NOW", now)]);
    dir.close().map_err(io_at(&std::env::temp_dir()))?;
    let mut answers = Vec::new();
    for f in finished.map_err(|e| HarnessError::Stopped(format!("racing {:?}: {e}", racing.engine)))? {
        let answer = serde_json::from_str::<serde_json::Value>(&f.stdout)
            .ok()
            .and_then(|v| Some((u16::try_from(v["status"].as_u64()?).ok()?, v["replay"].as_bool()?)))
            .ok_or_else(|| {
                HarnessError::Stopped(format!(
                    "a racing process answered {:?} (exit {:?}): {}",
                    f.stdout,
                    f.code,
                    f.stderr.trim()
                ))
            })?;
        answers.push(answer);
    }
    let transfers =
        store::open(&racing.scratch, policy, Usage::LongLived)?.audit()?.transfers.len() as i64 - before;
    bank::drop(&racing.scratch)?;
    Ok(RaceOutcome { seqs: instant.iter().map(|e| e.seq).collect(), answers, transfers })
}

/// The accounts of the day's log.
fn accounts(log: &Connection) -> Result<Vec<bank::Account>, HarnessError> {
    let mut stmt = log.prepare("SELECT acct_id, holder, balance FROM account ORDER BY acct_id")?;
    let rows =
        stmt.query_map([], |r| Ok(bank::Account { id: r.get(0)?, holder: r.get(1)?, balance: r.get(2)? }))?;
    Ok(rows.collect::<Result<_, _>>()?)
}

fn key_of(raw: &str, policy: &Policy) -> Option<ScopedKey> {
    request::parse(raw.as_bytes(), policy).ok().map(|r| r.key)
}
