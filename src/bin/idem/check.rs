//! `idem check`: the contract judged on anyone's implementation.

use crate::common::{Failure, account_id, seed_or_clock};
use idem::check::{self, engine as lab, url as http};
use idem::harness::files::io_at;
use std::path::PathBuf;

/// Judge any implementation of the same job: one line per property, PASS, FAIL or SKIP.
///
/// --engine "CMD …": a program of the lab's contract (CMD --db DB
/// --request REQ [--crash-after-claim], CMD --db DB --purge-before T),
/// run on databases this check builds with its own random accounts,
/// amounts and keys. CMD is split as a shell would (quote a path with a
/// space); --engine-arg adds one argument as it is.
///
/// --url URL --token T [--token T2]: an HTTP service, judged by the IETF
/// draft and DESIGN §2.
///
/// --serve CMD: an HTTP service the check starts itself, on a fresh bank
/// of its own (a SQLite file with the lab's `account` table) and a
/// clients file, judged as --url is and, besides, through a SIGKILL under
/// load and a restart, and a SIGTERM under load. In CMD, {db}, {clients},
/// {listen} (127.0.0.1:PORT), {port} and {dir} are replaced; with none of
/// them, `--db {db} --listen {listen} --clients {clients}` is appended.
///
/// --profile FILE: what the implementation chose where the contract
/// leaves it open (JSON; see docs/check.md). Without one, idem's choices
/// for --url, and for --engine every correct choice passes; a choice the
/// profile declares is held to. --profile-template engine|url prints a
/// profile with every field and its default.
/// Each FAIL names the sentence of the contract it rests on and shows
/// the steps. Exit 1 on any failure; --seed reproduces a run's plan
/// (its keys are fresh each run).
#[derive(clap::Args, Debug)]
pub struct Check {
    #[arg(
        long,
        value_name = "CMD",
        required_unless_present_any = ["url", "serve", "profile_template"],
        conflicts_with_all = ["url", "serve"]
    )]
    engine: Option<String>,
    /// One more argument for the engine, taken as it is (repeatable).
    #[arg(long, value_name = "ARG", requires = "engine", allow_hyphen_values = true)]
    engine_arg: Vec<String>,
    #[arg(long, conflicts_with = "serve")]
    url: Option<String>,
    #[arg(long, value_name = "CMD")]
    serve: Option<String>,
    /// Bearer token(s): two of distinct clients check the scope.
    #[arg(long, requires = "url")]
    token: Vec<String>,
    /// Two accounts the service holds, the first with funds to spare.
    #[arg(long, default_value = "A", requires = "url")]
    src: String,
    #[arg(long, default_value = "B", requires = "url")]
    dst: String,
    #[arg(long)]
    profile: Option<PathBuf>,
    /// Print a profile with every field and its default, for TARGET (engine or url), and exit.
    #[arg(long, value_name = "TARGET", value_parser = ["engine", "url"], conflicts_with_all = ["engine", "url", "serve", "profile"])]
    profile_template: Option<String>,
    #[arg(long)]
    seed: Option<u64>,
    /// How many random days the engine's model judges (more find rarer
    /// mistakes; one is a quick look).
    #[arg(long, default_value_t = 4, requires = "engine", value_parser = clap::value_parser!(u32).range(1..=1000))]
    days: u32,
    /// Judge only the properties whose name contains TEXT (repeatable), to
    /// rerun a failure alone.
    #[arg(long, value_name = "TEXT")]
    only: Vec<String>,
    /// Write every HTTP request the check makes, and how it ended, to FILE
    /// as JSON lines (invoke, then ok, info or fail; docs/check.md), for an
    /// outside checker to read. For --url and --serve.
    #[arg(long, value_name = "FILE", conflicts_with = "engine")]
    history: Option<PathBuf>,
}

pub fn check(
    Check {
        engine,
        engine_arg,
        url,
        serve,
        token,
        src,
        dst,
        profile,
        profile_template,
        seed,
        days,
        only,
        history,
    }: Check,
) -> Result<(), Failure> {
    if let Some(target) = profile_template {
        let template = match target.as_str() {
            "url" => serde_json::to_string_pretty(&http::Profile::default()),
            _ => serde_json::to_string_pretty(&lab::Profile::default()),
        };
        say!("{}", template.map_err(|e| Failure(e.to_string()))?);
        return Ok(());
    }
    let seed = seed_or_clock(seed);
    if let Some(file) = &history {
        check::history::record_to(file).map_err(io_at(file))?;
    }
    let passed = match (engine, url) {
        (None, None) if serve.is_some() => {
            let serve = serve.unwrap_or_default();
            say!("idem check --serve {serve:?} --seed {seed}");
            let target = check::life::start(&serve, read_profile(profile)?, seed)?;
            report(&check::judge(http::PROPERTIES.iter().chain(&check::life::PROPERTIES), &target, &only))?
        }
        (Some(engine), _) => {
            let command = lab::command(&engine, &engine_arg)?;
            say!("idem check --engine {engine:?} --seed {seed}");
            let target = lab::Engine { command, profile: read_profile(profile)?, seed, days };
            report(&check::judge(&lab::PROPERTIES, &target, &only))?
        }
        (None, Some(url)) => {
            say!("idem check --url {url} --seed {seed}");
            let (src, dst) = (account_id(src), account_id(dst));
            let target = http::Target::new(&url, token, src, dst, read_profile(profile)?, seed)?;
            report(&check::judge(&http::PROPERTIES, &target, &only))?
        }
        (None, None) => return Err(Failure("give --engine, --url or --serve".into())),
    };
    match passed {
        true => Ok(()),
        false => Err(Failure(format!("a property failed (rerun with --seed {seed})"))),
    }
}

fn read_profile<P: serde::de::DeserializeOwned + Default>(file: Option<PathBuf>) -> Result<P, Failure> {
    let Some(file) = file else { return Ok(P::default()) };
    let text = std::fs::read_to_string(&file).map_err(io_at(&file))?;
    serde_json::from_str(&text).map_err(|e| Failure(format!("{}: {e}", file.display())))
}

/// Prints one line per property (and a failure's steps); whether all
/// passed. No property at all (an `--only` that matches none) is an error.
fn report<T: ?Sized>(results: &[(&check::Property<T>, check::Verdict)]) -> Result<bool, Failure> {
    if results.is_empty() {
        return Err(Failure("--only: no property's name contains that text".into()));
    }
    crate::common::say(format_args!("{}", check::report(results)));
    Ok(results.iter().all(|(_, v)| !v.failed()))
}
