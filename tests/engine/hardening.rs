//! The holes a payments review found, each pinned by the behaviour it broke:
//! durability resting on WAL, a distrusted `account` table, integer ids past
//! 2^53, instants at the edges of time, FIFOs, quadratic parsing, forged
//! recovery rows, keys blocked by a failed execution, and purging.

use crate::common::*;
use idem::clock::Timestamp;
use idem::policy::Policy;
use rusqlite::Connection;
use serde_json::{Value, json};
use std::process::Command;
use std::time::{Duration, Instant};

const IDEM: &str = env!("CARGO_BIN_EXE_idem");
const T0: &str = "2026-12-01T00:00:00Z";

fn at(seconds: i64) -> String {
    Timestamp::parse(T0).unwrap().plus_seconds(seconds).to_string()
}

fn journal_mode(db: &std::path::Path) -> String {
    Connection::open(db).unwrap().query_row("PRAGMA journal_mode", [], |r| r.get(0)).unwrap()
}

/// Runs `idem_api` on `db` and `text`; returns (exit code, stdout, stderr).
fn run(db: &std::path::Path, text: &str, env: &[(&str, &str)]) -> (Option<i32>, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("r.json");
    std::fs::write(&file, text).unwrap();
    let out =
        Command::new(API).arg("--db").arg(db).arg("--request").arg(&file).envs(env.iter().copied()).output();
    let out = out.unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

fn assert_refused_with(db: &std::path::Path, text: &str, want: &str) {
    let before = std::fs::read(db).unwrap();
    let (code, stdout, stderr) = run(db, text, &[]);
    assert_eq!((code, stdout.as_str()), (Some(5), ""), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains(want) && !stderr.contains("panicked"), "{stderr}");
    assert_eq!(std::fs::read(db).unwrap(), before, "a refused file was written");
}

#[test]
fn a_database_switched_out_of_wal_is_switched_back_on_every_open() {
    let mut rng = rng();
    let bank = Bank::new(&mut rng, 2, false);
    let (s, d) = (&bank.accounts[0], &bank.accounts[1]);
    assert_eq!(bank.send(&request("c", "/t", "k1", s, d, 1)).status(), 201);
    Connection::open(&bank.db).unwrap().execute_batch("PRAGMA journal_mode = DELETE").unwrap();
    assert_eq!(journal_mode(&bank.db), "delete");
    assert_eq!(bank.send(&request("c", "/t", "k2", s, d, 1)).status(), 201);
    assert_eq!(journal_mode(&bank.db), "wal", "the money commit ran without WAL");

    // A copy restored by VACUUM INTO comes back in rollback-journal mode.
    let copy = bank.dir.path().join("restored.db");
    let conn = Connection::open(&bank.db).unwrap();
    conn.execute("VACUUM INTO ?1", [copy.to_str().unwrap()]).unwrap();
    assert_eq!(journal_mode(&copy), "delete");
    let (code, stdout, _) = run(&copy, &request("c", "/t", "k1", s, d, 1), &[]);
    assert_eq!(code, Some(0));
    assert!(stdout.contains("\"replay\":true"), "{stdout}");
    assert_eq!(journal_mode(&copy), "wal");
}

#[test]
fn an_account_table_without_a_unique_acct_id_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("dupes.db");
    Connection::open(&db)
        .unwrap()
        .execute_batch(
            "CREATE TABLE account (acct_id TEXT, holder TEXT, balance INTEGER);
             INSERT INTO account VALUES ('A', 'x', 1000), ('A', 'y', 1000), ('B', 'z', 0);",
        )
        .unwrap();
    let text = request("c", "/t", "k", &json!("A"), &json!("B"), 100);
    assert_refused_with(&db, &text, "acct_id is not unique");

    // A unique index on acct_id alone is enough; a composite one is not.
    let conn = Connection::open(&db).unwrap();
    conn.execute_batch("CREATE UNIQUE INDEX both_cols ON account (acct_id, holder)").unwrap();
    drop(conn);
    assert_refused_with(&db, &text, "acct_id is not unique");
    let conn = Connection::open(&db).unwrap();
    conn.execute_batch(
        "DELETE FROM account WHERE holder = 'y'; CREATE UNIQUE INDEX one ON account (acct_id)",
    )
    .unwrap();
    drop(conn);
    let (code, stdout, stderr) = run(&db, &text, &[]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.starts_with("{\"status\":201"), "{stdout}");

    // Dropping the uniqueness after the engine moved in is caught on the next open.
    Connection::open(&db).unwrap().execute_batch("DROP INDEX one").unwrap();
    assert_refused_with(&db, &request("c", "/t", "k2", &json!("A"), &json!("B"), 1), "acct_id is not unique");
}

#[test]
fn triggers_on_the_engines_tables_are_refused() {
    let mut rng = rng();
    let bank = Bank::new(&mut rng, 2, false);
    let (s, d) = (&bank.accounts[0], &bank.accounts[1]);
    assert_eq!(bank.send(&request("c", "/t", "k1", s, d, 1)).status(), 201);
    Connection::open(&bank.db)
        .unwrap()
        .execute_batch(
            "CREATE TABLE audit_log (x);
             CREATE TRIGGER skim AFTER UPDATE ON account BEGIN UPDATE account SET balance = balance + 1; END;",
        )
        .unwrap();
    let before = bank.balances();
    assert_refused_with(&bank.db, &request("c", "/t", "k2", s, d, 1), "trigger(s) skim");
    assert_eq!(bank.balances(), before);
}

#[test]
fn a_real_balance_column_that_cannot_hold_the_credit_exactly_rolls_back_and_frees_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("real.db");
    let max = 9_007_199_254_740_991i64; // 2^53 − 1
    Connection::open(&db)
        .unwrap()
        .execute_batch(&format!(
            "CREATE TABLE account (acct_id TEXT PRIMARY KEY, holder TEXT, balance REAL);
             INSERT INTO account VALUES ('A', 'a', 100.0), ('B', 'b', {max}.0);"
        ))
        .unwrap();
    let text = request("c", "/t", "k", &json!("A"), &json!("B"), 2);
    let (code, stdout, stderr) = run(&db, &text, &[("IDEM_NOW", T0)]);
    assert_eq!((code, stdout.as_str()), (Some(5), ""), "{stderr}");
    assert!(stderr.contains("cannot hold it exactly") || stderr.contains("double holds exactly"), "{stderr}");
    let conn = Connection::open(&db).unwrap();
    let balances: Vec<f64> = conn
        .prepare("SELECT balance FROM account ORDER BY acct_id")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(balances, [100.0, max as f64], "a rounded balance was kept");
    let transfers: i64 = conn.query_row("SELECT COUNT(*) FROM transfer", [], |r| r.get(0)).unwrap();
    let keys: i64 = conn.query_row("SELECT COUNT(*) FROM idem_key", [], |r| r.get(0)).unwrap();
    assert_eq!((transfers, keys), (0, 0), "the failed execution left its claim behind");
}

#[test]
fn integer_account_ids_beyond_2_53_are_refused_with_400() {
    let mut rng = rng();
    let bank = Bank::new(&mut rng, 2, true);
    let d = &bank.accounts[1];
    for id in [json!(9_007_199_254_740_992i64), json!(-9_007_199_254_740_993i64), json!(i64::MAX)] {
        let r = bank.send(&request("c", "/t", "k", &id, d, 1));
        assert_eq!((r.status(), r.replay()), (400, false), "{id}");
        assert!(r.reason().unwrap().contains("within ±(2^53 − 1)"), "{:?}", r.reason());
    }
    // Two such ids used to share a fingerprint, so a retry naming another
    // account replayed; at the edge of the range they stay apart (422).
    let edge = json!(9_007_199_254_740_991i64);
    let first = bank.send(&request("c", "/t", "k2", &edge, d, 1));
    assert_eq!(first.status(), 404);
    let other = bank.send(&request("c", "/t", "k2", &json!(9_007_199_254_740_990i64), d, 1));
    assert_eq!((other.status(), other.reason()), (422, Some("fingerprint_mismatch")));
}

#[test]
fn instants_at_the_edges_of_time_never_panic() {
    let mut rng = rng();
    let bank = Bank::new(&mut rng, 2, false);
    let (s, d) = (&bank.accounts[0], &bank.accounts[1]);
    for cut in ["9999-12-31T23:59:59-23:59", "0000-12-31T23:59:59Z", "0001-01-01T00:00:00+23:59"] {
        let out = Command::new(API).arg("--db").arg(&bank.db).args(["--purge-before", cut]).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{cut}: {stderr}");
        assert!(stderr.contains("RFC 3339") && !stderr.contains("panicked"), "{stderr}");
    }
    // The last instant the engine stores: the lease saturates, the retry replays.
    let end = [("IDEM_NOW", "9999-12-31T23:59:59.999999Z")];
    let text = request("c", "/t", "k", s, d, 1);
    assert_eq!(bank.send_with(&text, &end).status(), 201);
    assert!(bank.send_with(&text, &end).replay());
    for bad in ["9999-12-31T23:59:59-23:59", "+10000-01-01T00:00:00Z"] {
        let (code, _, stderr) = run(&bank.db, &text, &[("IDEM_NOW", bad)]);
        assert_eq!(code, Some(2), "IDEM_NOW={bad}: {stderr}");
        let out = Command::new(IDEM).arg("recover").arg("--db").arg(&bank.db).env("IDEM_NOW", bad).output();
        let out = out.unwrap();
        assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    }
}

#[test]
fn a_request_path_that_is_not_a_regular_file_exits_3_at_once() {
    let mut rng = rng();
    let bank = Bank::new(&mut rng, 2, false);
    let fifo = bank.dir.path().join("fifo.json");
    let path = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
    for target in [fifo.as_path(), std::path::Path::new("/dev/zero")] {
        let mut child = bank.command(target).spawn().unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break Some(status);
            }
            if Instant::now() > deadline {
                child.kill().unwrap();
                break None;
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        assert_eq!(status.and_then(|s| s.code()), Some(3), "{}", target.display());
    }
}

#[test]
fn many_members_cost_linear_time_and_echoed_names_are_clipped() {
    let policy = Policy::embedded();
    let body = |n: usize| {
        let members: Vec<String> = (0..n).map(|i| format!("\"{i:x}\":0")).collect();
        format!("{{\"x\":{{{}}}}}", members.join(","))
    };
    // the fastest of many runs: what the code costs, not what the machine's
    // other work added to it
    let fastest = |text: &str| {
        let runs = (0..25).map(|_| {
            let start = Instant::now();
            let _ = idem::request::parse(text.as_bytes(), policy);
            start.elapsed()
        });
        runs.min().unwrap_or_default()
    };
    let (small, large) = (body(700), body(7_000));
    assert!(large.len() <= policy.max_request_bytes);
    let ratio = fastest(&large).as_secs_f64() / fastest(&small).as_secs_f64();
    // linear: about 10×; the old quadratic check measured about 100×
    assert!(ratio < 40.0, "10× the members cost {ratio:.0}× the time");

    let long = "n".repeat(60_000);
    let text = format!(r#"{{"client_id":"c","endpoint":"/t","idem_key":"k","{long}":1}}"#);
    let reason = idem::request::parse(text.as_bytes(), policy).unwrap_err().to_string();
    assert!(reason.len() < 200 && reason.contains("unknown field"), "{} bytes", reason.len());
    let long = &long[..30_000];
    let dup = format!(r#"{{"{long}":1,"{long}":2}}"#);
    let reason = idem::request::parse(dup.as_bytes(), policy).unwrap_err().to_string();
    assert!(reason.len() < 200 && reason.contains("duplicate member"), "{} bytes", reason.len());
}

#[test]
fn recover_prints_json_lines_that_a_tab_or_newline_in_a_key_cannot_forge() {
    let mut rng = rng();
    let bank = Bank::new(&mut rng, 2, false);
    let (s, d) = (&bank.accounts[0], &bank.accounts[1]);
    let forged = "k\tc\t/t\tother\nstale\tc\t/t\tforged";
    // Such a key is a 400 now; a database written before that rule can
    // still hold one: a claim left behind, its key renamed to it.
    let text = request("c", "/t", "k", s, d, 1);
    let out = bank.command(&bank.request_file(&text)).arg("--crash-after-claim").env("IDEM_NOW", T0).output();
    assert_eq!(out.unwrap().status.code(), Some(4));
    let renamed = Connection::open(&bank.db).unwrap().execute("UPDATE idem_key SET idem_key = ?1", [forged]);
    assert_eq!(renamed.unwrap(), 1);
    let out = Command::new(IDEM).arg("recover").arg("--db").arg(&bank.db).env("IDEM_NOW", at(1)).output();
    let stdout = String::from_utf8(out.unwrap().stdout).unwrap();
    let rows: Vec<Value> = stdout.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(rows.len(), 1, "{stdout}");
    assert_eq!((rows[0]["state"].as_str(), rows[0]["idem_key"].as_str()), (Some("live"), Some(forged)));
}

#[test]
fn claim_tokens_are_128_random_bits() {
    let mut rng = rng();
    let bank = Bank::new(&mut rng, 2, false);
    let (s, d) = (&bank.accounts[0], &bank.accounts[1]);
    for k in ["a", "b"] {
        let mut cmd = bank.command(&bank.request_file(&request("c", "/t", k, s, d, 1)));
        cmd.arg("--crash-after-claim").env("IDEM_NOW", T0).output().unwrap();
    }
    let conn = Connection::open(&bank.db).unwrap();
    let tokens: Vec<String> = conn
        .prepare("SELECT token FROM idem_key")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(tokens.len(), 2);
    for t in &tokens {
        assert!(t.len() == 32 && t.chars().all(|c| c.is_ascii_hexdigit()), "{t}");
    }
    assert_ne!(tokens[0], tokens[1]);
}

#[test]
fn purge_before_inside_the_retention_window_warns_and_still_deletes() {
    let mut rng = rng();
    let bank = Bank::new(&mut rng, 2, false);
    let text = request("c", "/t", "k", &bank.accounts[0], &bank.accounts[1], 1);
    assert_eq!(bank.send_with(&text, &[("IDEM_NOW", &at(0))]).status(), 201);
    let purge = |cut: &str| {
        let mut cmd = Command::new(API);
        cmd.arg("--db").arg(&bank.db).args(["--purge-before", cut]).env("IDEM_NOW", at(3600));
        cmd.output().unwrap()
    };
    let out = purge(&at(10));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "{\"purged\": 1}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("warning") && stderr.contains("retention"), "{stderr}");
    let hours = i64::from(Policy::embedded().retention_hours);
    let out = purge(&at(3600 - hours * 3600));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "{\"purged\": 0}");
    assert!(out.stderr.is_empty(), "a cut outside the window warned");
}

#[test]
fn idem_purge_deletes_only_expired_keys_in_batches() {
    let mut rng = rng();
    let bank = Bank::new(&mut rng, 2, false);
    let (s, d) = (&bank.accounts[0], &bank.accounts[1]);
    let retention = Policy::embedded().retention_seconds();
    for i in 0..7 {
        let when = if i < 5 { at(i) } else { at(retention) };
        assert_eq!(
            bank.send_with(&request("c", "/t", &format!("k{i}"), s, d, 1), &[("IDEM_NOW", &when)]).status(),
            201
        );
    }
    let purge = |now: &str| {
        let mut cmd = Command::new(IDEM);
        cmd.arg("purge").arg("--db").arg(&bank.db).args(["--batch", "2"]).env("IDEM_NOW", now);
        let out = cmd.output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        serde_json::from_slice::<Value>(&out.stdout).unwrap()
    };
    // at retention + 2 s, keys 0 and 1 have expired; 2..4 are still inside
    assert_eq!(purge(&at(retention + 2)), json!({"purged": 2}));
    assert_eq!(purge(&at(retention + 10)), json!({"purged": 3}));
    assert_eq!(purge(&at(retention + 10)), json!({"purged": 0}));
    let left: i64 = Connection::open(&bank.db)
        .unwrap()
        .query_row("SELECT COUNT(*) FROM idem_key", [], |r| r.get(0))
        .unwrap();
    assert_eq!(left, 2, "a key still inside retention was purged");
}

#[test]
fn a_reader_that_went_away_ends_a_command_quietly_not_in_a_panic() {
    // the pipe's read end closed before the command writes a byte: every
    // write is EPIPE (Rust ignores SIGPIPE, so println! would panic: 101)
    for args in [&["check", "--profile-template", "url"][..], &["check", "--profile-template", "engine"][..]]
    {
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let out = Command::new(IDEM).args(args).stdout(writer).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(141), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}
