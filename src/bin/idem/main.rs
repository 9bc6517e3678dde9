//! `idem`: the service, its client and operator commands, and the harness
//! that proves the engine. `main` parses the command line and hands each
//! command to its own module; each prints its own output.
//!
//! Exit codes: 0 success; 1 a failure, one line on stderr; 2 usage.
//! Besides: `serve` 5 when the database cannot be used (as `idem_api`);
//! `transfer` 4 refused for good and 75 outcome unknown; `api` those of
//! `idem_api`.

#![forbid(unsafe_code)]

/// `println!` for the commands' output, through [`common::say`]: a reader
/// that went away (`idem keys list | head`) ends the process quietly
/// instead of a panic (Rust ignores SIGPIPE, so `println!` would panic).
macro_rules! say {
    ($($arg:tt)*) => { $crate::common::say(format_args!("{}\n", format_args!($($arg)*))) };
}

mod api_edge;
mod chaos;
mod check;
mod common;
mod day;
mod gateway;
mod keys;
mod payouts;
mod serve;
mod transfer;

use clap::{Parser, Subcommand};
use common::Failure;
use idem::policy::Policy;
use std::process::ExitCode;

/// Moves money exactly once per idempotency key, and proves it.
///
/// `prove` replays a day of traffic with retries and shows nothing went out
/// twice; `serve` is the protocol over HTTP, `transfer` its retrying client;
/// `recover`, `purge`, `reconcile` and `payouts` are the operator's;
/// `check` judges another implementation of the same job; `chaos`,
/// `scenario` and `gateway` are the harness's.
#[derive(Parser, Debug)]
#[command(name = "idem", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Trust the PEM certificates in FILE, instead of the bundled Mozilla
    /// roots, for every https:// call (gateway, client events, transfer);
    /// for a private CA beside the public ones, a file holding both.
    #[arg(long, global = true, env = "IDEM_CA_FILE", value_name = "FILE")]
    ca_file: Option<std::path::PathBuf>,
}

#[derive(Subcommand, Debug)]
enum Command {
    Prove(day::Prove),
    Gen(day::Gen),
    DupReport(day::DupReport),
    Replay(day::Replay),
    Scenario(day::Scenario),
    Recover(keys::Recover),
    Purge(keys::Purge),
    Serve(serve::Serve),
    Reconcile(payouts::Reconcile),
    Payouts(payouts::Payouts),
    Gateway(gateway::Gateway),
    Transfer(transfer::Transfer),
    Chaos(chaos::Chaos),
    Check(check::Check),
    /// The idem_api contract itself (`idem api --db DB --request REQ`).
    #[command(hide = true)]
    Api {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<std::ffi::OsString>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(file) = &cli.ca_file
        && let Err(e) = idem::https::trust(file)
    {
        eprintln!("idem: --ca-file: {e}");
        return ExitCode::from(2);
    }
    match run(cli.command, Policy::embedded()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("idem: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(command: Command, policy: &'static Policy) -> Result<ExitCode, Failure> {
    let done = |()| ExitCode::SUCCESS;
    match command {
        Command::Prove(args) => day::prove(args, policy).map(done),
        Command::Gen(args) => day::gen_(args).map(done),
        Command::DupReport(args) => day::dup_report(args).map(done),
        Command::Replay(args) => day::replay(args, policy).map(done),
        Command::Scenario(args) => day::scenario(args, policy).map(done),
        Command::Recover(args) => keys::recover(args, policy).map(done),
        Command::Purge(args) => keys::purge(args, policy).map(done),
        Command::Serve(args) => serve::serve(args, policy),
        Command::Reconcile(args) => payouts::reconcile(args, policy).map(done),
        Command::Payouts(args) => payouts::payouts(args, policy).map(done),
        Command::Gateway(args) => gateway::gateway(args).map(done),
        Command::Transfer(args) => transfer::transfer(args, policy),
        Command::Chaos(args) => chaos::chaos(args, policy).map(done),
        Command::Check(args) => check::check(args).map(done),
        Command::Api { args } => Ok(api_edge::main(std::iter::once("idem_api".into()).chain(args))),
    }
}
