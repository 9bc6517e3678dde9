//! Failure modes: a crash at every boundary, a slow original overtaken by a
//! reclaimer, stale claims and their recovery, and databases the engine must
//! refuse without writing a byte.

use crate::common::*;
use idem::clock::Timestamp;
use idem::policy::Policy;
use idem::protocol::{self, Claimed, Ctx, Flow, Outcome};
use idem::store::sqlite::SqliteStore;
use rusqlite::Connection;
use std::process::Command;

const T0: &str = "2026-12-01T00:00:00Z";

fn at(seconds: i64) -> String {
    Timestamp::parse(T0).unwrap().plus_seconds(seconds).to_string()
}

fn lease() -> i64 {
    i64::from(Policy::embedded().in_progress_lease_seconds)
}

/// The key table's `(state, transfer_id)` rows.
fn keys(bank: &Bank) -> Vec<(String, Option<i64>)> {
    let conn = Connection::open(&bank.db).unwrap();
    let mut stmt = conn.prepare("SELECT state, transfer_id FROM idem_key").unwrap();
    stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).unwrap().collect::<Result<_, _>>().unwrap()
}

fn crash(bank: &Bank, text: &str, point: &str) -> std::process::Output {
    let mut cmd = bank.command(&bank.request_file(text));
    cmd.args(["--crash-at", point]).env("IDEM_NOW", at(0));
    cmd.output().unwrap()
}

#[test]
fn crash_after_claim_leaves_a_claim_and_no_money() {
    let mut rng = rng();
    let bank = Bank::new(&mut rng, 2, false);
    let before = bank.balances();
    let text = request("c", "/t", &key(&mut rng), &bank.accounts[0], &bank.accounts[1], 1);
    let out = crash(&bank, &text, "after-claim");
    assert_eq!((out.status.code(), out.stdout.is_empty()), (Some(4), true));
    assert_eq!(keys(&bank), vec![("in_progress".to_string(), None)]);
    assert_eq!((bank.balances(), bank.transfers().len()), (before.clone(), 0));
    assert_eq!(bank.send_with(&text, &[("IDEM_NOW", &at(1))]).status(), 409);
    let retry = bank.send_with(&text, &[("IDEM_NOW", &at(lease()))]);
    assert_eq!((retry.status(), retry.replay()), (201, false));
    assert_eq!(bank.balances(), vec![before[0] - 1, before[1] + 1]);
}

#[test]
fn crash_before_commit_rolls_the_money_back_and_keeps_the_claim() {
    let mut rng = rng();
    let bank = Bank::new(&mut rng, 2, false);
    let before = bank.balances();
    let text = request("c", "/t", &key(&mut rng), &bank.accounts[0], &bank.accounts[1], 1);
    let out = crash(&bank, &text, "before-commit");
    assert_eq!((out.status.code(), out.stdout.is_empty()), (Some(4), true));
    assert_eq!(keys(&bank), vec![("in_progress".to_string(), None)], "the claim commit survives");
    assert_eq!((bank.balances(), bank.transfers().len()), (before.clone(), 0), "the money did not move");
    assert_eq!(bank.send_with(&text, &[("IDEM_NOW", &at(1))]).status(), 409);
    assert_eq!(bank.send_with(&text, &[("IDEM_NOW", &at(lease()))]).status(), 201);
    assert_eq!(bank.transfers().len(), 1);
}

#[test]
fn crash_after_commit_keeps_everything_and_the_retry_replays() {
    let mut rng = rng();
    let bank = Bank::new(&mut rng, 2, false);
    let before = bank.balances();
    let text = request("c", "/t", &key(&mut rng), &bank.accounts[0], &bank.accounts[1], 1);
    let out = crash(&bank, &text, "after-commit");
    assert_eq!((out.status.code(), out.stdout.is_empty()), (Some(4), true), "no answer was given");
    assert_eq!(keys(&bank), vec![("completed".to_string(), Some(1))]);
    assert_eq!(bank.balances(), vec![before[0] - 1, before[1] + 1]);
    let retry = bank.send_with(&text, &[("IDEM_NOW", &at(1))]);
    assert_eq!(
        (retry.status(), retry.replay(), &retry.json["body"]["transfer_id"]),
        (201, true, &serde_json::json!(1))
    );
    assert_eq!(bank.transfers().len(), 1);
}

#[test]
fn the_crash_hook_is_hidden_from_help() {
    let help = Command::new(API).arg("--help").output().unwrap();
    let text = String::from_utf8(help.stdout).unwrap();
    assert!(text.contains("--crash-after-claim") && !text.contains("--crash-at"), "{text}");
}

/// A slow original and a reclaimer, in process on one file: whichever
/// executes first, money moves once and the other gets a consistent answer.
#[test]
fn a_slow_original_never_completes_alongside_its_reclaimer() {
    let policy = Policy::embedded();
    for original_executes_first in [true, false] {
        let mut rng = rng();
        let bank = Bank::new(&mut rng, 2, false);
        let text = request("c", "/t", "k", &bank.accounts[0], &bank.accounts[1], 7);
        let req = idem::request::parse(text.as_bytes(), policy).unwrap();
        let (mut slow, mut fast) =
            (SqliteStore::open(&bank.db, policy).unwrap(), SqliteStore::open(&bank.db, policy).unwrap());
        let t0 = Timestamp::parse(T0).unwrap();
        let late = t0.plus_seconds(lease());
        let original = Ctx { policy, now: t0, token: "original" };
        let reclaimer = Ctx { policy, now: late, token: "reclaimer" };
        assert_eq!(protocol::claim(&mut slow, &req, original).unwrap(), Claimed::Mine);
        // the original stalls past its lease; a retry takes the key over
        assert_eq!(protocol::claim(&mut fast, &req, reclaimer).unwrap(), Claimed::Mine);
        let run =
            |store: &mut SqliteStore, ctx| match protocol::execute(store, &req, ctx, &mut |_| Flow::Continue)
                .unwrap()
            {
                Outcome::Respond(r) => r,
                other => panic!("{other:?}"),
            };
        let (first, second) = if original_executes_first {
            let o = run(&mut slow, Ctx { now: late, ..original });
            (o, run(&mut fast, reclaimer))
        } else {
            let r = run(&mut fast, reclaimer);
            (r, run(&mut slow, Ctx { now: late, ..original }))
        };
        let answers = [(first.status, first.replay), (second.status, second.replay)];
        if original_executes_first {
            // fenced: the original no longer holds the claim and moves nothing
            assert_eq!(answers, [(409, false), (201, false)]);
        } else {
            // the original arrives after completion and gets the stored answer
            assert_eq!(answers, [(201, false), (201, true)]);
            assert_eq!(first.body, second.body);
        }
        assert_eq!(bank.transfers().len(), 1, "paid twice");
    }
}

#[test]
fn recover_lists_stale_claims_and_releases_only_those() {
    let mut rng = rng();
    let bank = Bank::new(&mut rng, 2, false);
    let (s, d) = (&bank.accounts[0], &bank.accounts[1]);
    let idem = env!("CARGO_BIN_EXE_idem");
    let dead = request("c", "/t", "dead", s, d, 1);
    let alive = request("c", "/t", "alive", s, d, 1);
    crash(&bank, &dead, "after-claim");
    let mut young = bank.command(&bank.request_file(&alive));
    young.arg("--crash-after-claim").env("IDEM_NOW", at(lease() - 10));
    young.output().unwrap();
    let recover = |args: &[&str]| {
        let out = Command::new(idem)
            .arg("recover")
            .arg("--db")
            .arg(&bank.db)
            .args(args)
            .env("IDEM_NOW", at(lease()))
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    };
    let lines = |text: String| -> Vec<(String, String)> {
        let rows = text.lines().map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap());
        rows.map(|v| (v["state"].as_str().unwrap_or("").into(), v["idem_key"].as_str().unwrap_or("").into()))
            .collect()
    };
    let pair = |state: &str, key: &str| (state.to_string(), key.to_string());
    assert_eq!(lines(recover(&[])), [pair("stale", "dead"), pair("live", "alive")]);
    let released = recover(&["--release"]);
    assert!(released.ends_with("{\"released\":1}\n"), "{released}");
    assert_eq!(lines(released)[0], pair("released", "dead"));
    assert_eq!(lines(recover(&[])), [pair("live", "alive")]);
    // the released key starts afresh at once; the live one is still held
    assert_eq!(bank.send_with(&dead, &[("IDEM_NOW", &at(lease()))]).status(), 201);
    assert_eq!(bank.send_with(&alive, &[("IDEM_NOW", &at(lease()))]).status(), 409);
    // a holder known gone: --force-live releases the live claim too, and says so
    let out = Command::new(idem)
        .args(["recover", "--release", "--force-live", "--db"])
        .arg(&bank.db)
        .env("IDEM_NOW", at(lease()))
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("1 live claim(s)"));
    assert_eq!(lines(String::from_utf8(out.stdout).unwrap())[0], pair("released", "alive"));
    assert_eq!(bank.send_with(&alive, &[("IDEM_NOW", &at(lease()))]).status(), 201);
    assert_eq!(bank.transfers().len(), 2, "each key paid once");
}

/// Runs `idem_api` on a database that must be refused: exit 5, one line on
/// stderr, no stdout, and not one byte of the file (or a WAL beside it) written.
fn assert_refused(db: &std::path::Path, want: &str) {
    let dir = tempfile::tempdir().unwrap();
    let req = dir.path().join("r.json");
    std::fs::write(&req, request("c", "/t", "k", &serde_json::json!("A"), &serde_json::json!("B"), 1))
        .unwrap();
    let before = std::fs::read(db).ok();
    let started = std::time::Instant::now();
    let assert = assert_cmd::Command::new(API).arg("--db").arg(db).arg("--request").arg(&req).assert();
    // refused at once: only a busy lock is worth waiting the busy budget for
    assert!(started.elapsed() < std::time::Duration::from_secs(2), "took {:?}", started.elapsed());
    let out = assert.code(5).stdout("").get_output().clone();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains(want) && !stderr.contains("panicked"), "{stderr}");
    assert_eq!(std::fs::read(db).ok(), before, "the file changed");
    for suffix in ["-wal", "-shm", "-journal"] {
        let mut p = db.as_os_str().to_owned();
        p.push(suffix);
        assert!(!std::path::Path::new(&p).exists(), "{suffix} created");
    }
}

#[test]
fn broken_databases_are_refused_without_writing() {
    let dir = tempfile::tempdir().unwrap();
    assert_refused(&dir.path().join("missing/dir/bank.db"), "cannot open");
    assert_refused(&dir.path().join("absent.db"), "cannot open");

    let corrupt = dir.path().join("corrupt.db");
    std::fs::write(&corrupt, b"this is not a database, just forty-odd bytes of text".repeat(100)).unwrap();
    assert_refused(&corrupt, "not a database");

    let empty_schema = dir.path().join("no_account.db");
    Connection::open(&empty_schema).unwrap().execute_batch("CREATE TABLE other (x)").unwrap();
    assert_refused(&empty_schema, "no account table");

    let newer = dir.path().join("newer.db");
    let conn = Connection::open(&newer).unwrap();
    conn.execute_batch("CREATE TABLE account (acct_id, holder, balance); PRAGMA user_version = 7;").unwrap();
    drop(conn);
    assert_refused(&newer, "schema version 7");

    let older = dir.path().join("older.db");
    let conn = Connection::open(&older).unwrap();
    conn.execute_batch(
        "CREATE TABLE account (acct_id, holder, balance);
         CREATE TABLE idem_key (client_id, idem_key, response, PRIMARY KEY (client_id, idem_key));",
    )
    .unwrap();
    drop(conn);
    assert_refused(&older, "table idem_key exists without column(s) endpoint");
}

#[test]
fn a_read_only_database_is_refused_without_writing() {
    let mut rng = rng();
    let bank = Bank::new(&mut rng, 2, false);
    // root ignores permission bits, so as root make the file immutable instead
    let root = is_root();
    let locked = if root {
        Command::new("chattr").arg("+i").arg(&bank.db).status().is_ok_and(|s| s.success())
    } else {
        let mut perms = std::fs::metadata(&bank.db).unwrap().permissions();
        perms.set_readonly(true);
        std::fs::set_permissions(&bank.db, perms).is_ok()
    };
    assert!(locked, "could not make the database read-only");
    let outcome = std::panic::catch_unwind(|| assert_refused(&bank.db, "readonly"));
    if root {
        Command::new("chattr").arg("-i").arg(&bank.db).status().unwrap();
    }
    outcome.unwrap();
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .is_ok_and(|s| s.lines().any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0")))
}

#[test]
fn whole_amounts_in_a_real_balance_column_work_and_fractions_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("real.db");
    let conn = Connection::open(&db).unwrap();
    conn.execute_batch(
        "CREATE TABLE account (acct_id TEXT PRIMARY KEY, holder TEXT, balance REAL);
         INSERT INTO account VALUES ('A', 'a', 1000.0), ('B', 'b', 0.0), ('C', 'c', 10.5);",
    )
    .unwrap();
    drop(conn);
    let run = |text: String| {
        let req = dir.path().join("r.json");
        std::fs::write(&req, text).unwrap();
        Command::new(API).arg("--db").arg(&db).arg("--request").arg(&req).output().unwrap()
    };
    let (a, b, c) = (serde_json::json!("A"), serde_json::json!("B"), serde_json::json!("C"));
    let ok = Reply::from_output(run(request("x", "/t", "k1", &a, &b, 250)));
    assert_eq!(ok.status(), 201);
    let conn = Connection::open(&db).unwrap();
    let balances: Vec<f64> = conn
        .prepare("SELECT balance FROM account ORDER BY acct_id")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(balances, vec![750.0, 250.0, 10.5]);
    let refused = run(request("x", "/t", "k2", &c, &b, 1));
    assert_eq!(refused.status.code(), Some(5));
    assert!(String::from_utf8_lossy(&refused.stderr).contains("not an integer amount"));
}

/// A lock held past the busy budget after the claim committed: the
/// execution answers 503 without moving money, and the claim is released
/// as soon as the lock is gone, instead of blocking the key for its lease.
#[test]
fn a_busy_execution_answers_503_and_frees_its_key() {
    let policy = Policy::embedded();
    let mut rng = rng();
    let bank = Bank::new(&mut rng, 2, false);
    let before = bank.balances();
    let text = request("c", "/t", "k", &bank.accounts[0], &bank.accounts[1], 7);
    let req = idem::request::parse(text.as_bytes(), policy).unwrap();
    let mut store = SqliteStore::open(&bank.db, policy).unwrap();
    let hold = std::time::Duration::from_millis(u64::from(policy.busy_timeout_ms) + 300);
    let db = bank.db.clone();
    let mut holder = None;
    // Right after the claim commits, another writer takes the lock and keeps
    // it a little longer than the budget.
    let mut faults = |p: protocol::Point| {
        if p == protocol::Point::AfterClaim {
            let (locked, wait) = std::sync::mpsc::channel();
            let db = db.clone();
            holder = Some(std::thread::spawn(move || {
                let conn = Connection::open(&db).unwrap();
                conn.execute_batch("BEGIN IMMEDIATE").unwrap();
                locked.send(()).unwrap();
                std::thread::sleep(hold);
                conn.execute_batch("COMMIT").unwrap();
            }));
            wait.recv().unwrap();
        }
        Flow::Continue
    };
    let ctx = Ctx { policy, now: Timestamp::parse(T0).unwrap(), token: "slow" };
    let outcome = protocol::handle(&mut store, &req, ctx, &mut faults).unwrap();
    holder.unwrap().join().unwrap();
    let Outcome::Respond(r) = outcome else { panic!("{outcome:?}") };
    assert_eq!((r.status, r.reason.as_ref().map(|r| r.code())), (policy.on_busy, Some("busy")));
    assert_eq!((bank.balances(), bank.transfers().len()), (before.clone(), 0));
    assert_eq!(keys(&bank), vec![], "the busy execution left its claim behind");
    let retry = bank.send_with(&text, &[("IDEM_NOW", &at(1))]);
    assert_eq!((retry.status(), retry.replay()), (201, false));
}

#[test]
fn a_database_of_schema_version_1_2_or_3_is_upgraded_and_keeps_its_keys() {
    // version 1 had neither content_type, headers nor body_bytes; version 2
    // had content_type; version 3 headers too
    let versions = [
        (1, "DROP COLUMN content_type, DROP COLUMN headers, DROP COLUMN body_bytes"),
        (2, "DROP COLUMN headers, DROP COLUMN body_bytes"),
        (3, "DROP COLUMN body_bytes"),
    ];
    for (backend, (version, drop)) in backends().into_iter().flat_map(|b| versions.map(|v| (b, v))) {
        let mut rng = rng();
        let bank = Bank::on(backend, &mut rng, 2, false);
        let text = request("c", "/v1/transfers", "k", &bank.accounts[0], &bank.accounts[1], 5);
        let first = bank.send(&text);
        assert_eq!(first.status(), 201, "{backend:?}");
        // back to the old version: the key table as idem left it then
        match backend {
            Backend::Sqlite => {
                let drops: Vec<String> =
                    drop.split(", ").map(|d| format!("ALTER TABLE idem_key {d};")).collect();
                Connection::open(&bank.db)
                    .unwrap()
                    .execute_batch(&format!("{} PRAGMA user_version = {version};", drops.concat()))
                    .unwrap()
            }
            _ => pg::execute(
                &bank.spec(),
                &format!("ALTER TABLE idem_key {drop}; COMMENT ON TABLE idem_key IS 'idem schema {version}'"),
            ),
        }
        let again = bank.send(&text);
        assert!(again.replay() && again.raw_body() == first.raw_body(), "{backend:?}: {again:?}");
        let other = request("c", "/v1/transfers", "k2", &bank.accounts[0], &bank.accounts[1], 7);
        assert_eq!(bank.send(&other).status(), 201, "{backend:?}");
        let typed = "SELECT count(*) FROM idem_key WHERE content_type IS NULL AND headers IS NULL AND body_bytes IS NULL";
        assert_eq!(bank.count(typed), 2, "{backend:?} version {version}: the columns are back");
        assert_eq!(bank.transfers().len(), 2, "{backend:?}");
    }
}
