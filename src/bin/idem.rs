//! `idem`: the harness around the engine. Each subcommand is a thin call
//! into the library; exit 0 on success, 1 with one line on stderr otherwise.

use clap::{Parser, Subcommand};
use idem::clock::Timestamp;
use idem::harness::day::{self, DayError};
use idem::policy::Policy;
use idem::protocol;
use idem::request::ScopedKey;
use idem::store::{self, Usage};
use serde_json::json;
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
    ///
    /// The same-instant requests are also raced as real engine processes on
    /// a copy of the day: the idem_api next to this binary, or `idem api`.
    Prove {
        #[arg(long, default_value = "out")]
        out: PathBuf,
        /// The engine command to race with (the lab's --db/--request contract).
        #[arg(long, value_name = "CMD")]
        engine: Option<String>,
        /// Replay the day into this empty PostgreSQL database instead of DIR/day.db.
        #[arg(long, value_name = "POSTGRES_URL")]
        db: Option<String>,
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
    /// Send every logged request through the engine into a new day database (result.json).
    Replay {
        #[arg(long, default_value = "out/idem.db")]
        log: PathBuf,
        /// A SQLite file that must not exist, or an empty PostgreSQL database.
        #[arg(long, default_value = "out/day.db")]
        db: String,
        /// Where to write the result; "-" for standard output.
        #[arg(long, default_value = "out/result.json")]
        out: PathBuf,
    },
    /// Run scenario files (scenarios/*.scn) step by step; stops at the first mismatch.
    Scenario {
        #[arg(required = true)]
        files: Vec<PathBuf>,
    },
    /// List claims still in progress (live or stale) as JSON lines; --release deletes the stale ones.
    ///
    /// A stale claim is one whose lease has run out: its process died before
    /// moving money, so releasing it lets the next retry start afresh.
    /// IDEM_NOW=<RFC 3339> fixes the clock.
    Recover {
        /// SQLite file or PostgreSQL connection string.
        #[arg(long)]
        db: String,
        /// Delete the stale claims: a line per released key, then {"released": N}.
        #[arg(long)]
        release: bool,
    },
    /// Delete the keys past retention, in short batches; prints {"purged": N}.
    ///
    /// Unlike `idem_api --purge-before`, this never deletes a key that a
    /// retry could still need. Each batch is its own transaction, so live
    /// traffic waits for the write lock at most one batch at a time.
    /// IDEM_NOW=<RFC 3339> fixes the clock.
    Purge {
        /// SQLite file or PostgreSQL connection string.
        #[arg(long)]
        db: String,
        /// Keys deleted per transaction.
        #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u64).range(1..))]
        batch: u64,
    },
    /// Serve the protocol over HTTP (draft-ietf-httpapi-idempotency-key-header).
    ///
    /// POST /v1/transfers with `Authorization: Bearer TOKEN` and an
    /// `Idempotency-Key` header; GET /v1/transfers/{id}, /healthz, /metrics,
    /// /openapi.json. Prints `http://HOST:PORT` first; logs one JSON line per
    /// request on stderr; SIGTERM or Ctrl-C drains and exits 0.
    /// IDEM_NOW=<RFC 3339> fixes the clock (for tests).
    Serve {
        /// SQLite file or PostgreSQL connection string (the same key space as idem_api).
        #[arg(long)]
        db: String,
        /// Address to listen on; port 0 picks a free one.
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: String,
        /// JSON object mapping each bearer token to its client id.
        #[arg(long, value_name = "FILE")]
        clients: PathBuf,
        /// Connections to PostgreSQL (SQLite always uses one writer).
        #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=256))]
        pool: u16,
        /// Transfers answered at once; more get 503 busy at once.
        #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
        max_in_flight: u32,
    },
    /// The idem_api contract itself (`idem api --db DB --request REQ`).
    #[command(hide = true)]
    Api {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<std::ffi::OsString>,
    },
}

fn main() -> ExitCode {
    match run(Cli::parse().command, Policy::embedded()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("idem: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(command: Command, policy: &'static Policy) -> Result<ExitCode, DayError> {
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
            if !store::pg::is_postgres(&db) {
                make_parent(std::path::Path::new(&db))?;
            }
            let replayed = day::replay_at(&log, &db, policy, None)?;
            emit(&out, &day::to_json(&replayed.result)?)?;
        }
        Command::Scenario { files } => {
            for file in files {
                let text = std::fs::read_to_string(&file)
                    .map_err(|e| DayError(format!("cannot read {}: {e}", file.display())))?;
                let outcome = idem::harness::scenario::parse(&text)
                    .and_then(|s| idem::harness::scenario::run(&s, policy));
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
            let now = now()?;
            let mut store = store::open(&db, policy, Usage::LongLived)?;
            let line = |state: &str, k: &ScopedKey, created_at: Timestamp, lease_until: Timestamp| {
                let (created_at, lease_until) = (created_at.to_string(), lease_until.to_string());
                json!({"state": state, "client_id": k.client_id, "endpoint": k.endpoint, "idem_key": k.idem_key,
                       "created_at": created_at, "lease_until": lease_until})
            };
            let claims = protocol::open_claims(&mut store, now, policy)?;
            if release {
                let released = protocol::release_stale(&mut store, now, policy)?;
                for c in claims.iter().filter(|c| released.contains(&c.key)) {
                    println!("{}", line("released", &c.key, c.created_at, c.lease_until));
                }
                println!("{}", json!({"released": released.len()}));
            } else {
                for c in &claims {
                    println!(
                        "{}",
                        line(if c.stale { "stale" } else { "live" }, &c.key, c.created_at, c.lease_until)
                    );
                }
            }
        }
        Command::Purge { db, batch } => {
            let now = now()?;
            let mut store = store::open(&db, policy, Usage::LongLived)?;
            let purged = protocol::purge_expired(&mut store, now, batch, policy)?;
            println!("{}", json!({"purged": purged}));
        }
        Command::Serve { db, listen, clients, pool, max_in_flight } => {
            let options = idem::service::Options {
                db,
                listen,
                clients,
                pool: usize::from(pool),
                max_in_flight: max_in_flight as usize,
            };
            let clock = idem::service::clock_from_env().map_err(|e| DayError(e.to_string()))?;
            idem::service::run(options, policy, clock).map_err(|e| DayError(e.to_string()))?;
        }
        Command::Api { args } => return Ok(idem::api::main(std::iter::once("idem_api".into()).chain(args))),
        Command::Prove { out, engine, db } => {
            let engine = match engine {
                Some(cmd) => cmd.split_whitespace().map(String::from).collect(),
                None => own_engine()?,
            };
            let r = day::prove(&out, policy, &engine, db.as_deref())?;
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
            for name in day::PROVE_FILES.iter().filter(|n| db.is_none() || **n != "day.db") {
                println!("wrote {}", out.join(name).display());
            }
            if db.is_some() {
                println!("the day's tables are in the --db database");
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The wall clock, or `IDEM_NOW` when set (for tests).
fn now() -> Result<Timestamp, DayError> {
    match std::env::var("IDEM_NOW") {
        Ok(text) => Timestamp::parse(&text).map_err(|e| DayError(format!("IDEM_NOW: {e}"))),
        Err(_) => Ok(Timestamp::now()),
    }
}

/// The engine to race: the `idem_api` built next to this binary, or this
/// binary's own `api` command (the same code) when only `idem` was built.
fn own_engine() -> Result<Vec<String>, DayError> {
    let me = std::env::current_exe()?;
    let sibling = me.with_file_name("idem_api");
    Ok(match sibling.is_file() {
        true => vec![sibling.to_string_lossy().into_owned()],
        false => vec![me.to_string_lossy().into_owned(), "api".into()],
    })
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
