//! The day: a realistic log of one day's transfer requests, the damage the
//! naive system did with it, and the engine replaying it.
//!
//! `traffic` writes `idem.db` (accounts, the gateway's `req_log`, the naive
//! system's `transfer_v1`); `dup_report` measures what went out twice;
//! `replay` sends every logged request through the engine into `day.db`;
//! `report` writes `idem_report.md` from those numbers. Everything is
//! deterministic: same inputs, same bytes. The SQL here reads and writes the
//! harness's own tables; the engine's tables are reached only through the
//! store.

pub mod replay;
pub mod report;
pub mod traffic;

use super::HarnessError;
use super::files::{io_at, open_existing, to_json, write_file};
use crate::store::{Db, bank};
use std::path::Path;

/// The files `prove` writes, in the order it writes them.
pub const PROVE_FILES: [&str; 6] =
    ["idem.db", "dup_report.json", "day.db", "result.json", "policy.json", "idem_report.md"];

/// Creates `idem.db` at `path`; refuses to touch an existing file.
pub fn generate_at(path: &Path) -> Result<(), HarnessError> {
    if path.exists() {
        return Err(HarnessError::Stopped(format!(
            "{} exists; remove it or pick another path",
            path.display()
        )));
    }
    let mut conn = rusqlite::Connection::open(path)?;
    traffic::generate(&mut conn)
}

/// Replays the log at `log_path` into a new day database: a SQLite file
/// that must not exist, or an empty PostgreSQL database.
pub fn replay_at(
    log_path: &Path,
    day: &Db,
    policy: &crate::policy::Policy,
    racing: Option<&replay::Racing>,
) -> Result<replay::Replayed, HarnessError> {
    let log = open_existing(log_path)?;
    replay::replay(&log, day, policy, racing)
}

/// The whole day into `dir`: the files of [`PROVE_FILES`], from scratch.
/// `engine` is the `idem_api` command that races the same-instant requests
/// as real processes (see [`replay`]). With `db`, an empty PostgreSQL
/// database, the day is replayed there instead of into `day.db`.
pub fn prove(
    dir: &Path,
    policy: &crate::policy::Policy,
    engine: &[String],
    db: Option<&Db>,
) -> Result<replay::DayResult, HarnessError> {
    std::fs::create_dir_all(dir).map_err(io_at(dir))?;
    for name in PROVE_FILES {
        bank::remove_files(&dir.join(name))?;
    }
    let log_path = dir.join("idem.db");
    generate_at(&log_path)?;
    let dup = report::dup_report(&open_existing(&log_path)?)?;
    write_file(&dir.join("dup_report.json"), &to_json(&dup)?)?;
    let day_file = Db::Sqlite(dir.join("day.db"));
    let day = db.unwrap_or(&day_file);
    // The race runs on a scratch copy beside the day: a file, or a schema.
    let racing = replay::Racing { engine: engine.to_vec(), scratch: bank::beside(day, "race")? };
    let replayed = replay_at(&log_path, day, policy, Some(&racing));
    bank::remove_beside(day, "race")?;
    let day = replayed?;
    write_file(&dir.join("result.json"), &to_json(&day.result)?)?;
    write_file(&dir.join("policy.json"), crate::policy::TEXT)?;
    write_file(&dir.join("idem_report.md"), &report::markdown(&dup, &day, policy)?)?;
    Ok(day.result)
}
