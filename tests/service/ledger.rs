//! `examples/ledger.rs`, a service of its own schema made idempotent by
//! `idem::embed::layer`, judged by `idem check --url` as anyone's service
//! is: every property passes, under the open profile and under one that
//! declares the layer's choices.

use crate::common::pg;
use std::io::BufRead;
use std::process::{Command, Stdio};

const PEERS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/peers");

/// `target/release/examples/ledger`, which `cargo test` builds beside the
/// tests (`cargo test --test service` alone does not: after a change to the
/// example or the layer, build it with `cargo build --release --example ledger`).
fn example() -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().join("examples").join("ledger")
}

/// Runs the example on `db` (with `more` arguments) and `idem check --url`
/// on it, under the open profile and the one declaring the layer's choices.
fn check_the_ledger(db: &str, more: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let clients = dir.path().join("clients.json");
    std::fs::write(&clients, r#"{"tok-1": "shop-1", "tok-2": "shop-2", "tok-1b": "shop-1"}"#).unwrap();
    let mut child = Command::new(example())
        .args(["--db", db, "--clients"])
        .arg(&clients)
        .args(["--accounts", "A=1000000000,B=0,D=800"])
        .args(more)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut url = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut url).unwrap();
    let check = |profile: &str| {
        Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(["check", "--url", url.trim(), "--token", "tok-1", "--token", "tok-2", "--token", "tok-1b"])
            .args(["--profile", &format!("{PEERS}/{profile}"), "--seed", "3"])
            .output()
            .unwrap()
    };
    let open = check("service.json");
    let declared = check("layer-declared.json");
    child.kill().unwrap();
    child.wait().unwrap();
    for out in [open, declared] {
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(0), "{db}:\n{text}{}", String::from_utf8_lossy(&out.stderr));
        // every property passes; Retry-After may be a SKIP (the open
        // profile does not ask for it; a race may provoke no 409), and the
        // first-sent date is one under the open profile (the declared one
        // declares it: the layer reads it)
        let passed = text.lines().filter(|l| l.starts_with("PASS  ")).count();
        let skipped = text
            .lines()
            .filter(|l| {
                l.starts_with("SKIP  an in-flight answer carries Retry-After")
                    || l.starts_with("SKIP  a request first sent past")
            })
            .count();
        assert!(passed + skipped == 18 && text.contains(" 0 failed"), "{db}:\n{text}");
    }
}

#[test]
fn the_example_ledger_passes_idem_check_through_the_layer_on_postgres() {
    let Some(server) = pg::server() else { return };
    check_the_ledger(&server.fresh_schema(false), &[]);
}

#[test]
fn the_example_ledger_passes_idem_check_through_the_layer_on_its_own_sqlx_pool() {
    let Some(server) = pg::server() else { return };
    check_the_ledger(&pg::sqlx_url(&server.fresh_schema(false)), &["--pool", "sqlx"]);
}

#[test]
fn the_example_ledger_passes_idem_check_through_the_layer_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    check_the_ledger(&dir.path().join("ledger.db").display().to_string(), &[]);
}

/// The example on `db` in `mode` (`inside` or `beside`), its URL and process.
fn start(
    db: &std::path::Path,
    clients: &std::path::Path,
    mode: &str,
    die: bool,
) -> (String, std::process::Child) {
    let mut child = Command::new(example())
        .arg("--db")
        .arg(db)
        .arg("--clients")
        .arg(clients)
        .args(["--accounts", "A=1000000,B=0", "--keys", mode])
        .args(die.then_some("--die-after-writes"))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut url = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut url).unwrap();
    (url.trim().trim_start_matches("http://").to_owned(), child)
}

/// POSTs a transfer of 5 under `key`; the answer's status, if one came.
fn post(address: &str, key: &str) -> Option<u16> {
    send(address, key, r#"{"src":"A","dst":"B","amount":5,"currency":"KRW"}"#).map(|h| h.status)
}

/// POSTs `body` under `key` as client tok-1; the answer, if one came.
fn send(address: &str, key: &str, body: &str) -> Option<idem::check::http::Http> {
    let request = format!(
        "POST /v1/transfers HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tok-1\r\nIdempotency-Key: \"{key}\"\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    idem::check::http::exchange(address.parse().unwrap(), request.as_bytes()).ok()
}

#[test]
fn a_stored_refusal_is_replayed_in_the_media_type_it_was_answered_in() {
    let dir = tempfile::tempdir().unwrap();
    let clients = dir.path().join("clients.json");
    std::fs::write(&clients, r#"{"tok-1": "shop-1"}"#).unwrap();
    let (address, mut child) = start(&dir.path().join("ledger.db"), &clients, "inside", false);
    let unknown = r#"{"src":"nobody","dst":"B","amount":5,"currency":"KRW"}"#;
    let first = send(&address, "refused-1", unknown).unwrap();
    let again = send(&address, "refused-1", unknown).unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!((first.status, again.status, again.body.as_str()), (404, 404, first.body.as_str()));
    assert_eq!(again.header("idempotent-replayed"), Some("true"), "{:?}", again.headers);
    for answer in [&first, &again] {
        assert_eq!(answer.header("content-type"), Some("application/problem+json"), "{:?}", answer.headers);
    }
}

#[test]
fn killed_after_the_writes_the_record_beside_the_work_pays_twice_and_the_layer_once() {
    const KEYS: i64 = 5;
    let mut moves = Vec::new();
    for mode in ["beside", "inside"] {
        let dir = tempfile::tempdir().unwrap();
        let clients = dir.path().join("clients.json");
        std::fs::write(&clients, r#"{"tok-1": "shop-1"}"#).unwrap();
        let db = dir.path().join("ledger.db");
        for k in 0..KEYS {
            let key = format!("{mode}-{k}");
            // the first attempt: the process dies after the writes, the client hears nothing
            let (address, mut dying) = start(&db, &clients, mode, true);
            assert_eq!(post(&address, &key), None, "{mode}: the dying attempt answered");
            assert_eq!(dying.wait().unwrap().code(), Some(9), "{mode}");
            // the retry, on a restarted service, and a second retry
            let (address, mut child) = start(&db, &clients, mode, false);
            assert_eq!(post(&address, &key), Some(201), "{mode}: the retry");
            assert_eq!(post(&address, &key), Some(201), "{mode}: the second retry");
            child.kill().unwrap();
            child.wait().unwrap();
        }
        let conn = rusqlite::Connection::open(&db).unwrap();
        let n: i64 = conn.query_row("SELECT count(*) FROM ledger_moves", [], |r| r.get(0)).unwrap();
        let paid: i64 =
            conn.query_row("SELECT cents FROM ledger_wallets WHERE name = 'B'", [], |r| r.get(0)).unwrap();
        eprintln!(
            "{mode}: {KEYS} keys, each first attempt killed after its writes: {n} transfers, {paid} paid"
        );
        moves.push((n, paid));
    }
    assert_eq!(moves, [(2 * KEYS, 10 * KEYS), (KEYS, 5 * KEYS)]);
}

/// The example killed (SIGKILL) at random instants while clients send
/// transfers under 2 000 keys (most of them new when sent), restarted each time, then every key retried
/// until it answers: each key paid exactly once, its answer naming its own
/// move, and the wallets holding what the moves say.
fn kill_storm(db: &std::path::Path) -> (i64, i64) {
    const KEYS: u64 = 2_000;
    let dir = tempfile::tempdir().unwrap();
    let clients = dir.path().join("clients.json");
    std::fs::write(&clients, r#"{"tok-1": "shop-1"}"#).unwrap();
    let amount = |k: u64| 1 + k % 50;
    let body = |k: u64| format!(r#"{{"src":"A","dst":"B","amount":{},"currency":"KRW"}}"#, amount(k));
    let mut rng = idem::rng::Rng::new(0x6b11);
    for round in 0..8 {
        let (address, mut child) = start(db, &clients, "inside", false);
        let stop = std::sync::atomic::AtomicBool::new(false);
        std::thread::scope(|s| {
            for c in 0..4u64 {
                let (address, stop, body) = (&address, &stop, &body);
                s.spawn(move || {
                    let mut rng = idem::rng::Rng::new(round * 10 + c);
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let k = rng.below(KEYS);
                        let _ = send(address, &format!("kill-{k}"), &body(k));
                    }
                });
            }
            std::thread::sleep(std::time::Duration::from_millis(100 + rng.below(300)));
            child.kill().unwrap(); // SIGKILL: no goodbye, transactions open
            child.wait().unwrap();
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
        });
    }
    let (address, child) = start(db, &clients, "inside", false);
    let mut child = Killed(child); // killed even if an assertion below fails
    let mut named = std::collections::BTreeSet::new();
    for k in 0..KEYS {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let answer = loop {
            match send(&address, &format!("kill-{k}"), &body(k)) {
                Some(a) if a.status != 409 => break a,
                _ if std::time::Instant::now() > deadline => panic!("kill-{k} never answered"),
                _ => std::thread::sleep(std::time::Duration::from_millis(50)),
            }
        };
        assert_eq!(answer.status, 201, "kill-{k}: {}", answer.body);
        let json: serde_json::Value = serde_json::from_str(&answer.body).unwrap_or_default();
        assert_eq!(json["amount"], amount(k), "kill-{k}: {}", answer.body);
        assert!(named.insert(json["transfer_id"].as_i64().unwrap()), "kill-{k} names another key's move");
    }
    child.0.kill().unwrap();
    child.0.wait().unwrap();
    let paid = (0..KEYS).map(amount).sum::<u64>() as i64;
    (named.len() as i64, paid)
}

/// A child process killed when dropped.
struct Killed(std::process::Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The moves and what B holds, on either store.
fn moves_and_b(db: &std::path::Path) -> (i64, i64, i64) {
    let sql = "SELECT (SELECT count(*) FROM ledger_moves), (SELECT sum(cents) FROM ledger_moves)::bigint, \
               (SELECT cents FROM ledger_wallets WHERE name = 'B')";
    match db.to_str().is_some_and(|s| s.contains("host=")) {
        true => {
            let r = pg::client(db.to_str().unwrap()).query_one(sql, &[]).unwrap();
            (r.get(0), r.get(1), r.get(2))
        }
        false => rusqlite::Connection::open(db)
            .unwrap()
            .query_row(&sql.replace("::bigint", ""), [], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .unwrap(),
    }
}

#[test]
fn killed_at_random_the_example_on_sqlite_pays_every_key_once() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("ledger.db");
    let (keys, paid) = kill_storm(&db);
    assert_eq!(moves_and_b(&db), (keys, paid, paid));
}

#[test]
fn killed_at_random_the_example_on_postgres_pays_every_key_once() {
    let Some(server) = pg::server() else { return };
    let db = std::path::PathBuf::from(server.fresh_schema(false));
    let (keys, paid) = kill_storm(&db);
    assert_eq!(moves_and_b(&db), (keys, paid, paid));
}
