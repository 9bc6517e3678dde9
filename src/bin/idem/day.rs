//! The day and its parts (`prove`, `gen`, `dup-report`, `replay`), and
//! the scenarios.

use crate::common::{Failure, db, emit, make_parent, own_engine};
use idem::harness::day;
use idem::harness::files::{open_existing, to_json};
use idem::policy::Policy;
use idem::store::Db;
use std::path::PathBuf;

/// The day: gen, dup-report and replay into DIR, plus policy.json and idem_report.md.
///
/// The same-instant requests are also raced as real engine processes on
/// a copy of the day: the idem_api next to this binary, or `idem api`.
#[derive(clap::Args, Debug)]
pub struct Prove {
    #[arg(long, default_value = "out")]
    out: PathBuf,
    /// The engine command to race with (the lab's --db/--request contract).
    #[arg(long, value_name = "CMD")]
    engine: Option<String>,
    /// Replay the day into this empty PostgreSQL database instead of DIR/day.db.
    #[arg(long, value_name = "POSTGRES_URL", value_parser = db)]
    db: Option<Db>,
}

pub fn prove(Prove { out, engine, db }: Prove, policy: &Policy) -> Result<(), Failure> {
    let engine = match engine {
        Some(cmd) => cmd.split_whitespace().map(String::from).collect(),
        None => own_engine()?,
    };
    let r = day::prove(&out, policy, &engine, db.as_ref())?;
    say!(
        "{} requests: {} created, {} replayed, {} rejected; {} transfers; \
         blocked {} KRW of double payment; keys paid twice: {}",
        r.requests,
        r.created,
        r.replayed,
        r.rejected,
        r.transfers,
        r.double_paid_avoided,
        r.keys_paid_twice
    );
    for name in day::PROVE_FILES.iter().filter(|n| db.is_none() || **n != "day.db") {
        say!("wrote {}", out.join(name).display());
    }
    if db.is_some() {
        say!("the day's tables are in the --db database");
    }
    Ok(())
}

/// Write idem.db: 8 accounts, 120 logged requests (100 keys), the naive transfers.
#[derive(clap::Args, Debug)]
pub struct Gen {
    #[arg(long, default_value = "out/idem.db")]
    out: PathBuf,
}

pub fn gen_(Gen { out }: Gen) -> Result<(), Failure> {
    make_parent(&out)?;
    day::generate_at(&out)?;
    say!("wrote {}", out.display());
    Ok(())
}

/// Count the transfers the naive system made twice (dup_report.json).
#[derive(clap::Args, Debug)]
pub struct DupReport {
    #[arg(long, default_value = "out/idem.db")]
    db: PathBuf,
    /// Where to write the report; "-" for standard output.
    #[arg(long, default_value = "out/dup_report.json")]
    out: PathBuf,
}

pub fn dup_report(DupReport { db, out }: DupReport) -> Result<(), Failure> {
    let report = day::report::dup_report(&open_existing(&db)?)?;
    emit(&out, &to_json(&report)?)
}

/// Send every logged request through the engine into a new day database (result.json).
#[derive(clap::Args, Debug)]
pub struct Replay {
    #[arg(long, default_value = "out/idem.db")]
    log: PathBuf,
    /// A SQLite file that must not exist, or an empty PostgreSQL database.
    #[arg(long, default_value = "out/day.db", value_parser = db)]
    db: Db,
    /// Where to write the result; "-" for standard output.
    #[arg(long, default_value = "out/result.json")]
    out: PathBuf,
}

pub fn replay(Replay { log, db, out }: Replay, policy: &Policy) -> Result<(), Failure> {
    if let Some(path) = db.path() {
        make_parent(path)?;
    }
    let replayed = day::replay_at(&log, &db, policy, None)?;
    emit(&out, &to_json(&replayed.result)?)
}

/// Run scenario files (scenarios/*.scn) step by step; stops at the first mismatch.
#[derive(clap::Args, Debug)]
pub struct Scenario {
    #[arg(required = true)]
    files: Vec<PathBuf>,
}

pub fn scenario(Scenario { files }: Scenario, policy: &Policy) -> Result<(), Failure> {
    use idem::harness::scenario;
    for file in files {
        let text = std::fs::read_to_string(&file)
            .map_err(|e| Failure(format!("cannot read {}: {e}", file.display())))?;
        let outcome = scenario::parse(&text).and_then(|s| scenario::run(&s, policy));
        say!("== {}", file.display());
        match outcome {
            Ok(transcript) => say!("{transcript}ok"),
            Err(failure) => {
                crate::common::say(format_args!("{}", failure.transcript));
                return Err(Failure(format!(
                    "{} line {}: {}",
                    file.display(),
                    failure.line,
                    failure.message
                )));
            }
        }
    }
    Ok(())
}
