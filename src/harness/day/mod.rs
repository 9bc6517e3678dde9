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
use crate::store::{Db, bank};
use std::path::Path;

/// An I/O error that names the path it happened on: "No such file or
/// directory" alone leaves the reader guessing which file.
pub fn io_at(path: &Path) -> impl FnOnce(std::io::Error) -> HarnessError + '_ {
    move |e| HarnessError(format!("{}: {e}", path.display()))
}

impl From<crate::store::StoreError> for HarnessError {
    fn from(e: crate::store::StoreError) -> Self {
        HarnessError(format!("store: {e}"))
    }
}

/// Writes `text` plus a final newline, replacing the file atomically: the
/// text goes to a temporary file of its own beside `path` (a name no other
/// writer shares), which is then renamed over it.
pub fn write_file(path: &Path, text: &str) -> Result<(), HarnessError> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let mut tmp = tempfile::NamedTempFile::new_in(dir).map_err(io_at(dir))?;
    std::io::Write::write_all(&mut tmp, format!("{}\n", text.trim_end()).as_bytes())
        .map_err(io_at(tmp.path()))?;
    tmp.persist(path).map_err(|e| io_at(path)(e.error))?;
    Ok(())
}

/// The files `prove` writes, in the order it writes them.
pub const PROVE_FILES: [&str; 6] =
    ["idem.db", "dup_report.json", "day.db", "result.json", "policy.json", "idem_report.md"];

/// Creates `idem.db` at `path`; refuses to touch an existing file.
pub fn generate_at(path: &Path) -> Result<(), HarnessError> {
    if path.exists() {
        return Err(HarnessError(format!("{} exists; remove it or pick another path", path.display())));
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

/// Opens a database that must already exist (never creates an empty one).
pub fn open_existing(path: &Path) -> Result<rusqlite::Connection, HarnessError> {
    use rusqlite::OpenFlags;
    rusqlite::Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_WRITE)
        .map_err(|e| HarnessError(format!("cannot open {}: {e}", path.display())))
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
    let scratch = match db {
        Some(db) => {
            bank::execute(db, "CREATE SCHEMA IF NOT EXISTS idem_race")?;
            db.in_schema("idem_race")
        }
        None => Db::Sqlite(dir.join("race.db")),
    };
    let racing = replay::Racing { engine: engine.to_vec(), scratch };
    let replayed = replay_at(&log_path, day, policy, Some(&racing));
    if let Some(db) = db {
        bank::execute(db, "DROP SCHEMA IF EXISTS idem_race CASCADE")?;
    }
    let day = replayed?;
    write_file(&dir.join("result.json"), &to_json(&day.result)?)?;
    write_file(&dir.join("policy.json"), crate::policy::TEXT)?;
    write_file(&dir.join("idem_report.md"), &report::markdown(&dup, &day, policy)?)?;
    Ok(day.result)
}

/// Pretty JSON for the files people read.
pub fn to_json<T: serde::Serialize>(value: &T) -> Result<String, HarnessError> {
    serde_json::to_string_pretty(value).map_err(|e| HarnessError(e.to_string()))
}
