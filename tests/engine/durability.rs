//! Durability, seen from the system calls: the answer of a new transfer is
//! written to stdout only after the money commit's WAL frames are on disk
//! (fdatasync of the `-wal` file), the claim is never synced (one sync per
//! transfer, not two), and a replay writes and syncs nothing.
//!
//! SIGKILL never exercises fsync, so without this test a money commit
//! switched from durable to lazy would pass the whole suite. Runs the real
//! `idem_api` under `strace`; `.ci/run` installs strace and sets
//! `IDEM_REQUIRE_TOOLS=1`, which turns a missing strace into a failure.

use crate::common::*;
use std::process::Command;

#[derive(Debug, Clone, PartialEq, Eq)]
enum Event {
    /// A write of the WAL file.
    WalWrite,
    /// fsync or fdatasync of the WAL file.
    WalSync,
    /// A write to standard output: the answer leaving.
    Answer,
}

/// The WAL writes, WAL syncs and stdout writes of one `idem_api` run, in order.
fn traced(bank: &Bank, text: &str) -> Option<Vec<Event>> {
    if Command::new("strace").arg("-V").output().is_err() {
        assert!(
            std::env::var_os("IDEM_REQUIRE_TOOLS").is_none(),
            "strace is missing and IDEM_REQUIRE_TOOLS is set"
        );
        eprintln!("strace is not installed: durability test skipped (CI installs it)");
        return None;
    }
    let log = bank.dir.path().join("strace.txt");
    let out = Command::new("strace")
        .args(["-f", "-y", "-e", "trace=write,pwrite64,pwritev,fsync,fdatasync,sync_file_range", "-o"])
        .arg(&log)
        .arg(API)
        .arg("--db")
        .arg(&bank.db)
        .arg("--request")
        .arg(bank.request_file(text))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let wal = format!("{}-wal>", bank.db.display());
    let trace = std::fs::read_to_string(&log).unwrap();
    let events = trace.lines().filter_map(|line| {
        let call = line.split_once(' ').map_or(line, |(_, rest)| rest.trim_start());
        match call {
            c if (c.starts_with("fsync(") || c.starts_with("fdatasync(")) && c.contains(&wal) => {
                Some(Event::WalSync)
            }
            c if c.starts_with("pwrite") && c.contains(&wal) => Some(Event::WalWrite),
            c if c.starts_with("write(1<") => Some(Event::Answer),
            _ => None,
        }
    });
    Some(events.collect())
}

#[test]
fn a_new_transfer_is_answered_only_after_one_sync_of_its_commit() {
    let mut rng = rng();
    let bank = Bank::new(&mut rng, 2, false);
    let (s, d) = (&bank.accounts[0], &bank.accounts[1]);
    // the first call creates the schema; trace a steady-state transfer
    assert_eq!(bank.send(&request("c", "/t", "warm", s, d, 1)).status(), 201);
    let Some(events) = traced(&bank, &request("c", "/t", "k", s, d, 1)) else { return };
    let syncs: Vec<usize> =
        events.iter().enumerate().filter(|(_, e)| **e == Event::WalSync).map(|(i, _)| i).collect();
    let answer = events.iter().position(|e| *e == Event::Answer).expect("no answer written");
    let last_write = events.iter().rposition(|e| *e == Event::WalWrite).expect("no WAL write");
    assert_eq!(syncs.len(), 1, "one durable commit per transfer, the claim unsynced: {events:?}");
    assert!(last_write < syncs[0] && syncs[0] < answer, "answered before the commit was on disk: {events:?}");
    assert_eq!(bank.transfers().len(), 2);
}

#[test]
fn a_replay_writes_and_syncs_nothing() {
    let mut rng = rng();
    let bank = Bank::new(&mut rng, 2, false);
    let text = request("c", "/t", "k", &bank.accounts[0], &bank.accounts[1], 1);
    assert_eq!(bank.send(&text).status(), 201);
    let Some(events) = traced(&bank, &text) else { return };
    assert_eq!(events, vec![Event::Answer]);
}

/// `idem transfer --key-file order-1.key`, a bare name as docs/service.md
/// writes it: the key file is published and its directory synced before
/// the first connection is opened, so a power cut after an attempt left
/// cannot lose the key that attempt used.
#[test]
fn a_bare_key_file_name_is_durable_in_its_directory_before_the_first_attempt() {
    if Command::new("strace").arg("-V").output().is_err() {
        assert!(
            std::env::var_os("IDEM_REQUIRE_TOOLS").is_none(),
            "strace is missing and IDEM_REQUIRE_TOOLS is set"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("strace.txt");
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", dead.local_addr().unwrap());
    drop(dead);
    let out = Command::new("strace")
        .args(["-f", "-y", "-e", "trace=fsync,fdatasync,rename,renameat,renameat2,link,linkat,connect", "-o"])
        .arg(&log)
        .arg(env!("CARGO_BIN_EXE_idem"))
        .args(["transfer", "--url", &url, "--token", "t", "--src", "a", "--dst", "b", "--amount", "1"])
        .args(["--key-file", "order-1.key", "--budget", "200ms"])
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(75), "{}", String::from_utf8_lossy(&out.stderr));
    let trace = std::fs::read_to_string(&log).unwrap();
    let calls: Vec<&str> =
        trace.lines().map(|l| l.split_once(' ').map_or(l, |(_, rest)| rest.trim_start())).collect();
    let here = format!("<{}>)", dir.path().canonicalize().unwrap().display());
    let published = calls.iter().position(|c| c.starts_with("rename") || c.starts_with("link"));
    let synced = calls.iter().position(|c| c.starts_with("fsync(") && c.contains(&here));
    let connected = calls.iter().position(|c| c.starts_with("connect(") && c.contains("AF_INET"));
    assert!(
        matches!((published, synced, connected), (Some(p), Some(s), Some(c)) if p < s && s < c),
        "publish {published:?}, directory sync {synced:?}, first connect {connected:?}:\n{trace}"
    );
}
