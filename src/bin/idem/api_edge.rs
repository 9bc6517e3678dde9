//! The edge of the lab's contract (`idem_api`, and `idem api`): the
//! environment read, the answer printed, the process ended. Shared by both
//! binaries, so the one contract has one edge.

use idem::api::{EXIT_CRASHED, Edge, Said};
use idem::clock::Timestamp;
use std::ffi::OsString;
use std::io::Write;
use std::process::ExitCode;

/// Runs `idem::api` on `args` (`args[0]` is the program name) and says
/// what it returns.
pub fn main(args: impl IntoIterator<Item = OsString>) -> ExitCode {
    let now = match std::env::var("IDEM_NOW") {
        Ok(text) => match Timestamp::parse(&text) {
            Ok(t) => Some(t),
            Err(e) => return say(Said { stderr: vec![format!("IDEM_NOW: {e}")], code: 2, stdout: None }),
        },
        Err(_) => None,
    };
    // the gateway of a payout (--gateway https://…) is trusted by Mozilla's
    // roots, or by the certificates of IDEM_CA_FILE alone
    if let Some(file) = std::env::var_os("IDEM_CA_FILE")
        && let Err(e) = idem::https::trust(std::path::Path::new(&file))
    {
        return say(Said { stderr: vec![format!("IDEM_CA_FILE: {e}")], code: 2, stdout: None });
    }
    match idem::api::run(args, Edge { now, crash }) {
        Ok(said) => say(said),
        Err(usage) => usage.exit(),
    }
}

/// A real crash: no destructors, no rollback, no goodbye. Whatever the
/// database has not committed is gone, exactly as if the power had been cut.
fn crash(why: &str) -> ! {
    eprintln!("idem_api: {why}");
    std::process::exit(EXIT_CRASHED.into())
}

fn say(said: Said) -> ExitCode {
    for line in &said.stderr {
        eprintln!("idem_api: {line}");
    }
    if let Some(line) = said.stdout {
        let mut out = std::io::stdout().lock();
        if let Err(e) = writeln!(out, "{line}").and_then(|()| out.flush()) {
            eprintln!("idem_api: cannot write the response: {e}");
            return ExitCode::FAILURE;
        }
    }
    ExitCode::from(said.code)
}
