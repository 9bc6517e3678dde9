//! Shared fixtures: a fresh database holding only `account`, with random
//! accounts and balances, and a way to drive the real `idem_api` binary.

pub mod pg;

use idem::rng::Rng;
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

/// Where a bank's tables live: the conformance suite runs on each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
    /// PostgreSQL with `default_transaction_isolation = serializable`, as
    /// CockroachDB runs every transaction.
    PostgresSerializable,
}

/// SQLite, and PostgreSQL under both isolation levels when a server is
/// available (always in CI). `IDEM_BACKENDS=sqlite,postgres,serializable`
/// picks some (the mutation runs test one store at a time).
pub fn backends() -> Vec<Backend> {
    let wanted = std::env::var("IDEM_BACKENDS").unwrap_or_else(|_| "sqlite,postgres,serializable".into());
    let mut all = Vec::new();
    for (name, backend) in [
        ("sqlite", Backend::Sqlite),
        ("postgres", Backend::Postgres),
        ("serializable", Backend::PostgresSerializable),
    ] {
        if wanted.split(',').any(|w| w.trim() == name)
            && (backend == Backend::Sqlite || pg::server().is_some())
        {
            all.push(backend);
        }
    }
    all
}

pub struct Bank {
    pub dir: tempfile::TempDir,
    /// The `--db` argument: a SQLite file, or a PostgreSQL connection string.
    pub db: PathBuf,
    pub backend: Backend,
    /// Account ids as JSON values (strings or integers, as the table has them).
    pub accounts: Vec<Value>,
    requests: std::cell::Cell<u32>,
}

impl Bank {
    /// `n` accounts on SQLite with random ids (text, or integer when
    /// `int_ids`) and random balances in 1_000..1_000_000.
    pub fn new(rng: &mut Rng, n: usize, int_ids: bool) -> Bank {
        Bank::on(Backend::Sqlite, rng, n, int_ids)
    }

    /// [`Bank::new`] on `backend`.
    pub fn on(backend: Backend, rng: &mut Rng, n: usize, int_ids: bool) -> Bank {
        Bank::with(backend, &random_rows(rng, n, int_ids))
    }

    /// A bank on `backend` holding exactly `rows` (ids all text or all integers).
    pub fn with(backend: Backend, rows: &[(Value, i64)]) -> Bank {
        let dir = tempfile::tempdir().unwrap();
        let int_ids = rows.first().is_some_and(|(id, _)| id.is_i64());
        let db = make_bank(backend, dir.path(), rows, int_ids);
        Bank::holding(dir, db, backend, rows)
    }

    /// [`Bank::on`] PostgreSQL, on `server` rather than the shared one.
    pub fn on_server(server: &pg::Server, rng: &mut Rng, n: usize) -> Bank {
        let rows = random_rows(rng, n, false);
        let db = PathBuf::from(server.fresh_schema(false));
        postgres_bank(&db.to_string_lossy(), &rows, false);
        Bank::holding(tempfile::tempdir().unwrap(), db, Backend::Postgres, &rows)
    }

    /// The bank whose database `db` was made holding `rows`.
    fn holding(dir: tempfile::TempDir, db: PathBuf, backend: Backend, rows: &[(Value, i64)]) -> Bank {
        let accounts = rows.iter().map(|(id, _)| id.clone()).collect();
        Bank { dir, db, backend, accounts, requests: std::cell::Cell::new(0) }
    }

    pub fn spec(&self) -> String {
        self.db.to_string_lossy().into_owned()
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

    /// The balance of each account, in the order of `accounts`.
    pub fn balances(&self) -> Vec<i64> {
        let ids: Vec<String> = self.accounts.iter().map(id_text).collect();
        match self.backend {
            Backend::Sqlite => {
                let conn = Connection::open(&self.db).unwrap();
                let mut stmt =
                    conn.prepare("SELECT balance FROM account WHERE CAST(acct_id AS TEXT) = ?1").unwrap();
                ids.iter().map(|id| stmt.query_row([id], |r| r.get(0)).unwrap()).collect()
            }
            _ => {
                let mut c = pg::client(&self.spec());
                let sql = "SELECT balance::bigint FROM account WHERE acct_id::text = $1";
                ids.iter().map(|id| c.query_one(sql, &[id]).unwrap().get(0)).collect()
            }
        }
    }

    pub fn balance(&self, account: usize) -> i64 {
        self.balances()[account]
    }

    /// `(src, dst, amount, currency)` of every transfer row, as JSON values.
    pub fn transfers(&self) -> Vec<(Value, Value, i64, String)> {
        let sql = "SELECT CAST(src AS TEXT), CAST(dst AS TEXT), amount, currency FROM transfer ORDER BY transfer_id";
        let rows: Vec<(String, String, i64, String)> = match self.backend {
            Backend::Sqlite => {
                let conn = Connection::open(&self.db).unwrap();
                let Ok(mut stmt) = conn.prepare(sql) else {
                    return Vec::new(); // the engine has not created the table yet
                };
                stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
                    .unwrap()
                    .collect::<Result<_, _>>()
                    .unwrap()
            }
            _ => match pg::client(&self.spec()).query(sql, &[]) {
                Ok(rows) => rows.iter().map(|r| (r.get(0), r.get(1), r.get(2), r.get(3))).collect(),
                Err(_) => return Vec::new(),
            },
        };
        let int_ids = self.accounts.first().is_some_and(Value::is_i64);
        let as_json = |s: String| if int_ids { json!(s.parse::<i64>().unwrap()) } else { json!(s) };
        rows.into_iter().map(|(s, d, a, c)| (as_json(s), as_json(d), a, c)).collect()
    }

    /// One integer from `sql`, which must read the same on both backends.
    /// Runs `sql` on the bank's database, as another session would.
    #[allow(dead_code)] // the service's suites use it, the engine's do not
    pub fn execute(&self, sql: &str) {
        match self.backend {
            Backend::Sqlite => {
                let c = Connection::open(&self.db).unwrap();
                c.busy_timeout(std::time::Duration::from_secs(5)).unwrap();
                c.execute_batch(sql).unwrap();
            }
            _ => pg::client(&self.spec()).batch_execute(sql).unwrap(),
        }
    }

    pub fn count(&self, sql: &str) -> i64 {
        match self.backend {
            Backend::Sqlite => Connection::open(&self.db).unwrap().query_row(sql, [], |r| r.get(0)).unwrap(),
            _ => pg::client(&self.spec()).query_one(sql, &[]).unwrap().get(0),
        }
    }
}

/// `n` accounts with random ids (text, or integer when `int_ids`) and
/// random balances in 1_000..1_000_000.
fn random_rows(rng: &mut Rng, n: usize, int_ids: bool) -> Vec<(Value, i64)> {
    let base = rng.below(1_000_000) as i64;
    let ids: Vec<Value> = (0..n as i64)
        .map(|i| match int_ids {
            true => json!(base + i * 7),
            false => json!(format!("acct-{:x}-{i}", rng.next_u64() % 65536)),
        })
        .collect();
    ids.into_iter().map(|id| (id, 1_000 + rng.below(999_000) as i64)).collect()
}

fn id_text(id: &Value) -> String {
    match id {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Creates the account table with `rows` on `backend`; returns the `--db` argument.
pub fn make_bank(backend: Backend, dir: &Path, rows: &[(Value, i64)], int_ids: bool) -> PathBuf {
    let ty = if int_ids { "INTEGER" } else { "TEXT" };
    let create = format!("CREATE TABLE account (acct_id {ty} PRIMARY KEY, holder TEXT, balance BIGINT)");
    match backend {
        Backend::Sqlite => {
            let db = dir.join("bank.db");
            let conn = Connection::open(&db).unwrap();
            conn.execute_batch(&create).unwrap();
            for (i, (id, balance)) in rows.iter().enumerate() {
                let sql_id: rusqlite::types::Value = match id {
                    Value::String(s) => s.clone().into(),
                    v => v.as_i64().unwrap().into(),
                };
                conn.execute(
                    "INSERT INTO account VALUES (?1, ?2, ?3)",
                    (sql_id, format!("holder {i}"), balance),
                )
                .unwrap();
            }
            db
        }
        _ => {
            let server = pg::server().expect("a PostgreSQL backend without a server");
            let spec = server.fresh_schema(backend == Backend::PostgresSerializable);
            postgres_bank(&spec, rows, int_ids);
            PathBuf::from(spec)
        }
    }
}

/// The account table with `rows` in the PostgreSQL schema `spec` names.
fn postgres_bank(spec: &str, rows: &[(Value, i64)], int_ids: bool) {
    let ty = if int_ids { "BIGINT" } else { "TEXT" };
    let mut c = pg::client(spec);
    c.batch_execute(&format!("CREATE TABLE account (acct_id {ty} PRIMARY KEY, holder TEXT, balance BIGINT)"))
        .unwrap();
    for (i, (id, balance)) in rows.iter().enumerate() {
        c.execute(
            &format!("INSERT INTO account VALUES ($1::text::{}, $2, $3)", ty.to_lowercase()),
            &[&id_text(id), &format!("holder {i}"), balance],
        )
        .unwrap();
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
    amounts.iter().enumerate().map(|(i, amount)| ring_request(bank, prefix, i, *amount)).collect()
}

/// The `i`th request of [`ring_requests`].
pub fn ring_request(bank: &Bank, prefix: &str, i: usize, amount: i64) -> PathBuf {
    let n = bank.accounts.len();
    let (s, d) = (&bank.accounts[i % n], &bank.accounts[(i + 1) % n]);
    bank.request_file(&request("c", "/t", &format!("{prefix}-{i}"), s, d, amount))
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

/// A store on `backend` holding exactly `accounts`, as the in-process
/// harness (scenarios, storms) drives it.
pub fn store_with(
    backend: Backend,
    accounts: &[(idem::request::AcctId, i64)],
) -> Box<dyn idem::store::Store + Send> {
    use idem::request::AcctId;
    let policy = idem::policy::Policy::embedded();
    if backend == Backend::Sqlite {
        return Box::new(idem::store::bank::in_memory(accounts, policy).unwrap());
    }
    let rows: Vec<(Value, i64)> = accounts
        .iter()
        .map(|(id, b)| {
            (
                match id {
                    AcctId::Int(i) => json!(i),
                    AcctId::Text(s) => json!(s),
                },
                *b,
            )
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let spec = make_bank(backend, dir.path(), &rows, rows.first().is_some_and(|(id, _)| id.is_i64()));
    Box::new(idem::store::pg::PgStore::connect(&spec.to_string_lossy(), policy).unwrap())
}
