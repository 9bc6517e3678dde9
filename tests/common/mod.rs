//! Shared fixtures: a fresh database holding only `account`, with random
//! accounts and balances, and a way to drive the real `idem_api` binary.
#![allow(dead_code)] // each test file uses a different part

pub mod broken;
pub mod loom_model;
pub mod storm;

use idem::harness::day::traffic::Rng;
use rusqlite::Connection;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub const API: &str = env!("CARGO_BIN_EXE_idem_api");

/// A seed that differs per run and is printed, so a failure can be replayed
/// with `IDEM_SEED=<n> cargo test`.
pub fn rng() -> Rng {
    let seed = std::env::var("IDEM_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
    });
    eprintln!("IDEM_SEED={seed}");
    Rng::new(seed)
}

pub struct Bank {
    pub dir: tempfile::TempDir,
    pub db: PathBuf,
    /// Account ids as JSON values (strings or integers, as the table has them).
    pub accounts: Vec<Value>,
    requests: std::cell::Cell<u32>,
}

impl Bank {
    /// `n` accounts with random ids (text, or integer when `int_ids`) and
    /// random balances in 1_000..1_000_000.
    pub fn new(rng: &mut Rng, n: usize, int_ids: bool) -> Bank {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("bank.db");
        let conn = Connection::open(&db).unwrap();
        let ty = if int_ids { "INTEGER" } else { "TEXT" };
        conn.execute_batch(&format!(
            "CREATE TABLE account (acct_id {ty} PRIMARY KEY, holder TEXT, balance INTEGER)"
        ))
        .unwrap();
        let base = rng.below(1_000_000) as i64;
        let mut accounts = Vec::new();
        for i in 0..n as i64 {
            let id = if int_ids {
                json!(base + i * 7)
            } else {
                json!(format!("acct-{:x}-{i}", rng.next_u64() % 65536))
            };
            let balance = 1_000 + rng.below(999_000) as i64;
            let sql_id: rusqlite::types::Value = match &id {
                Value::String(s) => s.clone().into(),
                v => v.as_i64().unwrap().into(),
            };
            conn.execute("INSERT INTO account VALUES (?1, ?2, ?3)", (sql_id, format!("holder {i}"), balance))
                .unwrap();
            accounts.push(id);
        }
        Bank { dir, db, accounts, requests: std::cell::Cell::new(0) }
    }

    /// A bank over a database the caller built in `dir`.
    pub fn at(dir: tempfile::TempDir, db: PathBuf) -> Bank {
        let conn = Connection::open(&db).unwrap();
        let mut stmt = conn.prepare("SELECT acct_id FROM account ORDER BY rowid").unwrap();
        let accounts = stmt
            .query_map([], |r| {
                Ok(match r.get::<_, rusqlite::types::Value>(0)? {
                    rusqlite::types::Value::Integer(i) => json!(i),
                    rusqlite::types::Value::Text(s) => json!(s),
                    other => panic!("unexpected acct id {other:?}"),
                })
            })
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        drop(stmt);
        Bank { dir, db, accounts, requests: std::cell::Cell::new(0) }
    }

    /// Writes `text` to a new request file and returns its path.
    pub fn request_file(&self, text: &str) -> PathBuf {
        self.requests.set(self.requests.get() + 1);
        let path = self.dir.path().join(format!("req-{}.json", self.requests.get()));
        std::fs::write(&path, text).unwrap();
        path
    }

    pub fn command(&self, request: &Path) -> Command {
        let mut cmd = Command::new(API);
        cmd.arg("--db").arg(&self.db).arg("--request").arg(request);
        cmd
    }

    /// Runs `idem_api` on `text`; asserts exit 0 and one JSON object on stdout.
    pub fn send(&self, text: &str) -> Reply {
        self.send_with(text, &[])
    }

    pub fn send_with(&self, text: &str, env: &[(&str, &str)]) -> Reply {
        let mut cmd = self.command(&self.request_file(text));
        cmd.envs(env.iter().copied());
        Reply::from_output(cmd.output().unwrap())
    }

    pub fn balances(&self) -> Vec<i64> {
        let conn = Connection::open(&self.db).unwrap();
        let mut stmt = conn.prepare("SELECT balance FROM account ORDER BY rowid").unwrap();
        stmt.query_map([], |r| r.get(0)).unwrap().collect::<Result<_, _>>().unwrap()
    }

    pub fn balance(&self, account: usize) -> i64 {
        self.balances()[account]
    }

    /// `(src, dst, amount, currency)` of every transfer row, as JSON values.
    pub fn transfers(&self) -> Vec<(Value, Value, i64, String)> {
        let conn = Connection::open(&self.db).unwrap();
        let Ok(mut stmt) =
            conn.prepare("SELECT src, dst, amount, currency FROM transfer ORDER BY transfer_id")
        else {
            return Vec::new(); // the engine has not created the table yet
        };
        let as_json = |v: rusqlite::types::Value| match v {
            rusqlite::types::Value::Integer(i) => json!(i),
            rusqlite::types::Value::Text(s) => json!(s),
            other => panic!("unexpected acct id {other:?}"),
        };
        stmt.query_map([], |r| Ok((as_json(r.get(0)?), as_json(r.get(1)?), r.get(2)?, r.get(3)?)))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap()
    }
}

/// A request's JSON text, compact, in the documented member order.
pub fn request(client: &str, endpoint: &str, key: &str, src: &Value, dst: &Value, amount: i64) -> String {
    json!({"client_id": client, "endpoint": endpoint, "idem_key": key,
           "body": {"src": src, "dst": dst, "amount": amount, "currency": "KRW"}})
    .to_string()
}

/// Request files that pay around a ring of accounts: key `{prefix}-{i}`
/// moves `amounts[i]` from account `i % n` to account `(i + 1) % n`.
pub fn ring_requests(bank: &Bank, prefix: &str, amounts: &[i64]) -> Vec<PathBuf> {
    let n = bank.accounts.len();
    let files = amounts.iter().enumerate().map(|(i, amount)| {
        let (s, d) = (&bank.accounts[i % n], &bank.accounts[(i + 1) % n]);
        bank.request_file(&request("c", "/t", &format!("{prefix}-{i}"), s, d, *amount))
    });
    files.collect()
}

/// The balances after each ring key in `paid` moved its amount exactly once.
pub fn ring_balances(before: &[i64], amounts: &[i64], paid: impl IntoIterator<Item = usize>) -> Vec<i64> {
    let mut want = before.to_vec();
    for i in paid {
        want[i % before.len()] -= amounts[i];
        want[(i + 1) % before.len()] += amounts[i];
    }
    want
}

/// A fresh random key string.
pub fn key(rng: &mut Rng) -> String {
    format!("key-{:016x}", rng.next_u64())
}

#[derive(Debug)]
pub struct Reply {
    pub stdout: String,
    pub json: Value,
}

impl Reply {
    pub fn from_output(out: Output) -> Reply {
        let stdout = String::from_utf8(out.stdout).unwrap();
        Reply::checked(out.status.code(), stdout, &String::from_utf8_lossy(&out.stderr))
    }

    pub fn from_finished(f: idem::harness::race::Finished) -> Reply {
        Reply::checked(f.code, f.stdout, &f.stderr)
    }

    fn checked(code: Option<i32>, stdout: String, stderr: &str) -> Reply {
        assert_eq!(code, Some(0), "idem_api exited {code:?}: {stdout}{stderr}");
        assert_eq!(stdout.lines().count(), 1, "one JSON line: {stdout:?}");
        let json: Value = serde_json::from_str(&stdout).unwrap();
        let keys: Vec<&str> = json.as_object().unwrap().keys().map(String::as_str).collect();
        let mut want = vec!["body", "reason", "replay", "status"];
        want.sort();
        assert_eq!(keys, want, "response members");
        Reply { stdout, json }
    }

    pub fn status(&self) -> i64 {
        self.json["status"].as_i64().unwrap()
    }
    pub fn replay(&self) -> bool {
        self.json["replay"].as_bool().unwrap()
    }
    pub fn reason(&self) -> Option<&str> {
        self.json["reason"].as_str()
    }
    /// The exact bytes of `body` in the printed line.
    pub fn raw_body(&self) -> &str {
        let start = self.stdout.find(r#""body":"#).unwrap() + 7;
        self.stdout.trim_end()[start..].strip_suffix('}').unwrap()
    }
}
