//! Real processes released together: the race as it happens in production,
//! many callers of one engine command on one database at the same instant.
//!
//! Each request file is handed to its own process of `engine` (any program
//! that speaks the lab's `--db DB --request REQ` contract). Threads wait at a
//! barrier and spawn their processes the moment it opens, so the processes
//! overlap for real; the answers come back in the order of `requests`.

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::{Arc, Barrier};

/// One process's answer: its exit code and what it printed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finished {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
}

/// Runs `engine --db db --request FILE` for every file at once, with `env`
/// set in each; returns each process's result.
pub fn release_together(
    engine: &[String],
    db: &std::ffi::OsStr,
    requests: &[PathBuf],
    env: &[(&str, String)],
) -> std::io::Result<Vec<Finished>> {
    let (program, args) =
        engine.split_first().ok_or_else(|| std::io::Error::other("empty engine command"))?;
    let barrier = Arc::new(Barrier::new(requests.len()));
    let workers: Vec<_> = requests
        .iter()
        .map(|request| {
            let mut cmd = Command::new(program);
            cmd.args(args).arg("--db").arg(db).arg("--request").arg(request);
            cmd.envs(env.iter().map(|(k, v)| (*k, v.as_str())));
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                barrier.wait();
                cmd.output()
            })
        })
        .collect();
    workers
        .into_iter()
        .map(|w| {
            let out: Output = w.join().map_err(|_| std::io::Error::other("race worker panicked"))??;
            Ok(Finished {
                code: out.status.code(),
                stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
                stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            })
        })
        .collect()
}
