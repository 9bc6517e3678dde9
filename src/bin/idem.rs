//! `idem`: the harness around the engine. Each subcommand is a thin call
//! into `idem::day`; exit 0 on success, 1 with one line on stderr otherwise.

use clap::{Parser, Subcommand};
use idem::clock::Timestamp;
use idem::day::{self, DayError};
use idem::policy::Policy;
use idem::protocol;
use idem::store::sqlite::SqliteStore;
use std::path::PathBuf;
use std::process::ExitCode;

/// Generate a day of transfer traffic, measure what the naive system paid
/// twice, replay it through the engine, and prove nothing went out twice.
#[derive(Parser, Debug)]
#[command(version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// The day: gen, dup-report and replay into DIR, plus policy.json and idem_report.md.
    Prove {
        #[arg(long, default_value = "out")]
        out: PathBuf,
    },
    /// Write idem.db: 8 accounts, 120 logged requests (100 keys), the naive transfers.
    Gen {
        #[arg(long, default_value = "out/idem.db")]
        out: PathBuf,
    },
    /// Count the transfers the naive system made twice (dup_report.json).
    DupReport {
        #[arg(long, default_value = "out/idem.db")]
        db: PathBuf,
        /// Where to write the report; "-" for standard output.
        #[arg(long, default_value = "out/dup_report.json")]
        out: PathBuf,
    },
    /// Send every logged request through the engine into a new day.db (result.json).
    Replay {
        #[arg(long, default_value = "out/idem.db")]
        log: PathBuf,
        #[arg(long, default_value = "out/day.db")]
        db: PathBuf,
        /// Where to write the result; "-" for standard output.
        #[arg(long, default_value = "out/result.json")]
        out: PathBuf,
    },
    /// Run scenario files (scenarios/*.scn) step by step; stops at the first mismatch.
    Scenario {
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// List claims still in progress (live or stale); --release deletes the stale ones.
    ///
    /// A stale claim is one whose lease has run out: its process died before
    /// moving money, so releasing it lets the next retry start afresh.
    /// IDEM_NOW=<RFC 3339> fixes the clock.
    Recover {
        #[arg(long)]
        db: PathBuf,
        /// Delete the stale claims and print {"released": N}.
        #[arg(long)]
        release: bool,
    },
}

fn main() -> ExitCode {
    match run(Cli::parse().command, Policy::embedded()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("idem: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(command: Command, policy: &Policy) -> Result<(), DayError> {
    match command {
        Command::Gen { out } => {
            make_parent(&out)?;
            day::generate_at(&out)?;
            println!("wrote {}", out.display());
        }
        Command::DupReport { db, out } => {
            let report = day::report::dup_report(&day::open_existing(&db)?)?;
            emit(&out, &day::to_json(&report)?)?;
        }
        Command::Replay { log, db, out } => {
            make_parent(&db)?;
            let (result, _) = day::replay_at(&log, &db, policy)?;
            emit(&out, &day::to_json(&result)?)?;
        }
        Command::Scenario { files } => {
            for file in files {
                let text = std::fs::read_to_string(&file)
                    .map_err(|e| DayError(format!("cannot read {}: {e}", file.display())))?;
                let outcome = idem::scenario::parse(&text).and_then(|s| idem::scenario::run(&s, policy));
                println!("== {}", file.display());
                match outcome {
                    Ok(transcript) => println!("{transcript}ok"),
                    Err(failure) => {
                        print!("{}", failure.transcript);
                        return Err(DayError(format!(
                            "{} line {}: {}",
                            file.display(),
                            failure.line,
                            failure.message
                        )));
                    }
                }
            }
        }
        Command::Recover { db, release } => {
            let now = match std::env::var("IDEM_NOW") {
                Ok(text) => Timestamp::parse(&text).map_err(|e| DayError(format!("IDEM_NOW: {e}")))?,
                Err(_) => Timestamp::now(),
            };
            let mut store = SqliteStore::open(&db, policy)?;
            if release {
                let released = protocol::release_stale(&mut store, now)?;
                for key in &released {
                    println!("released {} {} {}", key.client_id, key.endpoint, key.idem_key);
                }
                println!("{{\"released\": {}}}", released.len());
            } else {
                println!("state\tclient_id\tendpoint\tidem_key\tcreated_at\tlease_until");
                for c in protocol::open_claims(&mut store, now)? {
                    let state = if c.stale { "stale" } else { "live" };
                    let k = &c.key;
                    println!(
                        "{state}\t{}\t{}\t{}\t{}\t{}",
                        k.client_id, k.endpoint, k.idem_key, c.created_at, c.lease_until
                    );
                }
            }
        }
        Command::Prove { out } => {
            let r = day::prove(&out, policy)?;
            println!(
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
            for name in day::PROVE_FILES {
                println!("wrote {}", out.join(name).display());
            }
        }
    }
    Ok(())
}

fn make_parent(path: &std::path::Path) -> Result<(), DayError> {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => Ok(std::fs::create_dir_all(dir)?),
        _ => Ok(()),
    }
}

fn emit(out: &std::path::Path, json: &str) -> Result<(), DayError> {
    if out.as_os_str() == "-" {
        println!("{json}");
        Ok(())
    } else {
        make_parent(out)?;
        day::write_file(out, json)?;
        println!("wrote {}", out.display());
        Ok(())
    }
}
