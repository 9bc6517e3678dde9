//! The target of `idem check --engine`: a program of the lab's command-line
//! contract, run on SQLite banks this module builds (each with its own
//! random accounts, balances, amounts and keys), its answers parsed as the
//! contract fixes them, and the ledger read straight from the file.

use super::CheckError;
use super::{Trace, short};
use crate::harness::race;
use crate::rng::Rng;
use rusqlite::Connection;
use serde_json::Value;
use serde_json::value::RawValue;
use std::path::{Path, PathBuf};
use std::process::Command;

/// What an engine chose where the lab leaves it open. Every field is
/// optional: left out (`null`), every correct choice passes; declared, the
/// check holds the engine to it on every step. It tightens, never rescues.
#[derive(Debug, Clone, Default, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct Profile {
    /// The status of a transfer from or to an account that does not exist
    /// (open: any 4xx but 409 and 422).
    pub unknown_account_status: Option<u16>,
    /// The status of a transfer larger than the source's balance (open: any
    /// 4xx but 409 and 422).
    pub insufficient_funds_status: Option<u16>,
    /// Whether a refusal (unknown account, insufficient funds) completes its
    /// key and is replayed (`true`), or leaves the key free so that a retry
    /// is evaluated again (`false`).
    pub refusals_stored: Option<bool>,
    /// What every 400's reason starts with.
    pub invalid_reason_prefix: Option<String>,
    /// The reason of a 422.
    pub mismatch_reason: Option<String>,
    /// The status of another body under a key whose first request is still
    /// in flight: 409 (the draft: in flight is checked first) or 422.
    pub in_flight_mismatch_status: Option<u16>,
    /// Whether an amount of `0` is a transfer of nothing (`true`) or a 400.
    pub amount_zero_valid: Option<bool>,
    /// Whether `1e3` is the amount 1000 (`true`, as JavaScript reads JSON)
    /// or a 400.
    pub amount_exponent_valid: Option<bool>,
    /// Whether `"100"`, a string of digits, is the amount 100 (`true`) or a 400.
    pub amount_digit_string_valid: Option<bool>,
    /// A request file that is not a request (not JSON, fields missing):
    /// answered 400 with exit 0, or exit 3 unanswered (the lab's exit for a
    /// file that cannot be read).
    pub unparseable_request: Option<Unparseable>,
    /// A database that cannot be used (no `account` table): a failure
    /// (non-zero exit, no answer), or an answer that is not a success.
    pub broken_database: Option<BrokenDatabase>,
    /// How `--crash-after-claim` ends (the lab fixes a non-zero exit and no
    /// transfer): silently (`false`), or with an answer that is no success
    /// printed first (`true`).
    pub crash_answers: Option<bool>,
    /// What `--crash-after-claim` does to a key already claimed or
    /// completed, where there is no claim to crash after (the lab is
    /// silent): answers as any retry (`false`), or crashes as
    /// `crash_answers` says, with nothing moved (`true`).
    pub crash_on_used_key: Option<bool>,
    /// Whether the accounts are looked up before the key is claimed
    /// (`true`: an unknown account is refused with the key untouched,
    /// whatever the key holds or the crash switch says) or after (`false`:
    /// a used key answers as a used key, a crash switch claims first).
    pub accounts_before_claim: Option<bool>,
}

impl Profile {
    /// Whether `answer` is a crash as the lab asks and the profile declared:
    /// a non-zero exit, and no answer or one that is no success.
    pub fn crashed(&self, answer: &Answer) -> bool {
        let told = answer.envelope.as_ref().is_some_and(|e| e.status >= 400);
        answer.code != Some(0) && super::as_declared(self.crash_answers, told, answer.envelope.is_none())
    }
}

/// How a request file that is not a request is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
pub enum Unparseable {
    /// `{"status": 400, …}`, exit 0.
    #[serde(rename = "answer_400")]
    Answer400,
    /// Exit 3, nothing on stdout.
    #[serde(rename = "exit_3")]
    Exit3,
}

/// How a database that cannot be used is reported.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BrokenDatabase {
    /// A non-zero exit, nothing on stdout.
    Fail,
    /// An answer (exit 0) whose status is not a success.
    Answer,
}

/// The engine under check: its command (program and arguments) and profile.
pub struct Engine {
    pub command: Vec<String>,
    pub profile: Profile,
    pub seed: u64,
    /// How many random days the model judges (each about twenty-five steps).
    pub days: u32,
}

/// One answer of the lab's contract, parsed.
#[derive(Debug, Clone)]
pub struct Answer {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    /// The envelope, when stdout is one JSON object holding the four members.
    pub envelope: Option<Envelope>,
}

/// `{"status", "replay", "reason", "body"}`, each member also as the raw
/// text it was printed as: "byte for byte" is judged on those.
#[derive(Debug, Clone, PartialEq)]
pub struct Envelope {
    pub status: i64,
    pub replay: bool,
    pub reason: Option<String>,
    pub body: Value,
    pub raw_status: String,
    pub raw_reason: String,
    pub raw_body: String,
}

impl Envelope {
    pub fn parse(text: &str) -> Option<Envelope> {
        #[derive(serde::Deserialize)]
        struct Raw<'a> {
            #[serde(borrow)]
            status: &'a RawValue,
            #[serde(borrow)]
            replay: &'a RawValue,
            #[serde(borrow)]
            reason: &'a RawValue,
            #[serde(borrow)]
            body: &'a RawValue,
        }
        let raw: Raw = serde_json::from_str(text.trim()).ok()?;
        Some(Envelope {
            status: serde_json::from_str(raw.status.get()).ok()?,
            replay: serde_json::from_str(raw.replay.get()).ok()?,
            reason: serde_json::from_str(raw.reason.get()).ok()?,
            body: serde_json::from_str(raw.body.get()).ok()?,
            raw_status: raw.status.get().to_owned(),
            raw_reason: raw.reason.get().to_owned(),
            raw_body: raw.body.get().to_owned(),
        })
    }

    /// The transfer id the body names, as text (ids may be numbers or strings).
    pub fn transfer_id(&self) -> Option<String> {
        match self.body.get("transfer_id")? {
            Value::Null => None,
            Value::String(s) => Some(s.clone()),
            other => Some(other.to_string()),
        }
    }

    /// Whether `self` replays `first`: marked, and its status, reason and
    /// body the same text.
    pub fn replays(&self, first: &Envelope) -> bool {
        self.replay
            && self.raw_status == first.raw_status
            && self.raw_reason == first.raw_reason
            && self.raw_body == first.raw_body
    }

    pub fn fresh_201(&self) -> bool {
        self.status == 201 && !self.replay
    }
}

impl Answer {
    pub fn status(&self) -> i64 {
        self.envelope.as_ref().map_or(-1, |e| e.status)
    }

    /// An envelope printed with exit 0, as every answer must be.
    pub fn answered(&self) -> Option<&Envelope> {
        self.envelope.as_ref().filter(|_| self.code == Some(0))
    }

    pub fn short(&self) -> String {
        let err = match self.stderr.trim() {
            "" => String::new(),
            e => format!(" (stderr: {})", short(e)),
        };
        format!("exit {:?}: {}{err}", self.code, short(&self.stdout))
    }
}

/// A transfer row, ids as text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    pub id: String,
    pub amount: i64,
}

/// Expects a fresh 201 to name its own transfer: a row with the answered
/// `transfer_id` and the amount sent (the lab: "body holds a transfer_id").
pub fn expect_named_row(t: &mut Trace, e: &Envelope, rows: &[Row], amount: i64) {
    let id = e.transfer_id().unwrap_or_default();
    t.expect(rows.iter().any(|r| r.id == id && r.amount == amount), || {
        format!("no transfer row with the answered transfer_id {id} and amount {amount}")
    });
}

/// A fresh bank: a SQLite file holding only `account`, with random ids and
/// balances.
pub struct Bank {
    dir: tempfile::TempDir,
    pub db: PathBuf,
    pub ids: Vec<String>,
    pub balances: Vec<i64>,
    pub command: Vec<String>,
    files: std::cell::Cell<u32>,
}

impl Bank {
    pub fn new(command: &[String], rng: &mut Rng, accounts: usize) -> Result<Bank, CheckError> {
        let dir = tempfile::Builder::new()
            .prefix("idem-check-")
            .tempdir()
            .map_err(CheckError::io("a directory for the bank"))?;
        let db = dir.path().join("bank.db");
        let salt = rng.below(1 << 20);
        let ids: Vec<String> = (0..accounts).map(|i| format!("acct-{salt:x}-{i}")).collect();
        let balances: Vec<i64> = (0..accounts).map(|_| 10_000 + rng.below(990_000) as i64).collect();
        let conn = Connection::open(&db)?;
        conn.execute_batch(crate::store::bank::ACCOUNT)?;
        for (id, balance) in ids.iter().zip(&balances) {
            conn.execute("INSERT INTO account VALUES (?1, 'check', ?2)", (id, balance))?;
        }
        Ok(Bank { dir, db, ids, balances, command: command.to_vec(), files: std::cell::Cell::new(0) })
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn file(&self, text: &str) -> Result<PathBuf, CheckError> {
        self.files.set(self.files.get() + 1);
        let path = self.path(&format!("req-{}.json", self.files.get()));
        std::fs::write(&path, text).map_err(CheckError::io(path.display().to_string()))?;
        Ok(path)
    }

    /// Runs the engine with `--db` and `args`.
    pub fn run(&self, args: &[&std::ffi::OsStr]) -> Result<Answer, CheckError> {
        let (program, rest) = self.command.split_first().ok_or("empty --engine")?;
        let out = Command::new(program)
            .args(rest)
            .arg("--db")
            .arg(&self.db)
            .args(args)
            .output()
            .map_err(CheckError::io(format!("cannot run {program}")))?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let envelope = Envelope::parse(&stdout);
        Ok(Answer {
            code: out.status.code(),
            stdout,
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            envelope,
        })
    }

    /// Sends the request `text` (with extra flags), as a step of `t`.
    pub fn send(&self, t: &mut Trace, text: &str, extra: &[&str]) -> Result<Answer, CheckError> {
        let file = self.file(text)?;
        let mut args: Vec<&std::ffi::OsStr> = vec!["--request".as_ref(), file.as_os_str()];
        args.extend(extra.iter().map(std::ffi::OsStr::new));
        let answer = self.run(&args)?;
        t.step(format!(
            "send {} {}-> {}",
            short(text),
            extra.iter().map(|e| format!("{e} ")).collect::<String>(),
            answer.short()
        ));
        Ok(answer)
    }

    /// Processes released together, one per request text.
    pub fn race(&self, texts: &[String]) -> Result<Vec<Answer>, CheckError> {
        let files = texts.iter().map(|t| self.file(t)).collect::<Result<Vec<_>, _>>()?;
        let finished = race::release_together(&self.command, self.db.as_os_str(), &files, &[])
            .map_err(CheckError::io("racing"))?;
        Ok(finished
            .into_iter()
            .map(|f| Answer {
                code: f.code,
                envelope: Envelope::parse(&f.stdout),
                stdout: f.stdout,
                stderr: f.stderr,
            })
            .collect())
    }

    /// The balances now, in the order of `ids`, and the transfer rows, read
    /// straight from the file (never through the engine under judgement).
    pub fn ledger(&self) -> Result<(Vec<i64>, Vec<Row>), CheckError> {
        let conn = Connection::open(&self.db)?;
        let read = || -> rusqlite::Result<(Vec<i64>, Vec<Row>)> {
            let mut balances = Vec::new();
            for id in &self.ids {
                balances.push(conn.query_row(
                    "SELECT balance FROM account WHERE acct_id = ?1",
                    [id],
                    |r| r.get(0),
                )?);
            }
            let has_transfer: bool = conn.query_row(
                "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'transfer')",
                [],
                |r| r.get(0),
            )?;
            let mut rows = Vec::new();
            if has_transfer {
                let mut stmt = conn.prepare("SELECT CAST(transfer_id AS TEXT), amount FROM transfer")?;
                rows = stmt
                    .query_map([], |r| Ok(Row { id: r.get(0)?, amount: r.get(1)? }))?
                    .collect::<Result<_, _>>()?;
            }
            Ok((balances, rows))
        };
        Ok(read()?)
    }

    /// The opening balances with `amount` moved from account 0 to account 1.
    pub fn moved(&self, amount: i64) -> Vec<i64> {
        let mut want = self.balances.clone();
        want[0] -= amount;
        want[1] += amount;
        want
    }

    /// Checks the ledger: balances as `want`, `transfers` rows.
    pub fn expect_ledger(&self, t: &mut Trace, want: &[i64], transfers: usize) -> Result<(), CheckError> {
        let (balances, rows) = self.ledger()?;
        t.expect(balances == want && rows.len() == transfers, || {
            format!(
                "the ledger holds {} transfer(s) and balances {balances:?}; wanted {transfers} and {want:?}",
                rows.len()
            )
        });
        Ok(())
    }
}

pub fn request(client: &str, endpoint: &str, key: &str, src: &str, dst: &str, amount: &str) -> String {
    let q = |s: &str| Value::from(s).to_string();
    format!(
        r#"{{"client_id":{},"endpoint":{},"idem_key":{},"body":{{"src":{},"dst":{},"amount":{amount},"currency":"KRW"}}}}"#,
        q(client),
        q(endpoint),
        q(key),
        q(src),
        q(dst)
    )
}

/// The same request with its members reordered and re-spaced.
pub fn reordered(client: &str, endpoint: &str, key: &str, src: &str, dst: &str, amount: &str) -> String {
    let q = |s: &str| Value::from(s).to_string();
    format!(
        "{{ \"body\" : {{ \"currency\":\"KRW\", \"amount\": {amount},\n \"dst\":{}, \"src\":{} }},\n\t\"idem_key\":{}, \"endpoint\":{}, \"client_id\":{} }}",
        q(dst),
        q(src),
        q(key),
        q(endpoint),
        q(client)
    )
}

pub const ENDPOINT: &str = "/v1/transfers";

/// One property's setting: a fresh bank, two accounts, an amount, a key, a
/// client, all random.
pub struct Setting {
    pub bank: Bank,
    pub a: String,
    pub b: String,
    pub amount: i64,
    pub key: String,
    pub client: String,
}

impl Setting {
    pub(super) fn new(engine: &Engine, salt: u64) -> Result<(Setting, Rng), CheckError> {
        let mut rng = Rng::new(engine.seed ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let bank = Bank::new(&engine.command, &mut rng, 3)?;
        let (a, b) = (bank.ids[0].clone(), bank.ids[1].clone());
        let amount = 1 + rng.below(bank.balances[0] as u64 / 4) as i64;
        // keys are fresh per run, not per seed: a rerun never meets its own keys
        let key = format!("key-{:012x}-{:08x}", rng.next_u64() & 0xffff_ffff_ffff, run_nonce());
        let client = format!("client-{}", rng.below(1000));
        Ok((Setting { bank, a, b, amount, key, client }, rng))
    }

    pub(super) fn request(&self, key: &str, amount: i64) -> String {
        request(&self.client, ENDPOINT, key, &self.a, &self.b, &amount.to_string())
    }
}

/// A number drawn once per process, mixed into every key.
pub fn run_nonce() -> u32 {
    static NONCE: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *NONCE.get_or_init(|| {
        let mut b = [0u8; 4];
        let _ = getrandom::fill(&mut b);
        u32::from_le_bytes(b)
    })
}

/// Splits `--engine`'s text as a shell would (quotes and backslashes), so a
/// path with a space can be given quoted; `extra` (`--engine-arg`) follows.
pub fn command(text: &str, extra: &[String]) -> Result<Vec<String>, CheckError> {
    let mut words = shlex::split(text).ok_or_else(|| format!("--engine {text:?}: unbalanced quotes"))?;
    words.extend(extra.iter().cloned());
    if words.is_empty() {
        return Err("--engine is empty".into());
    }
    Ok(words)
}

/// The database of a bank, for the model.
pub fn db_of(bank: &Bank) -> &Path {
    &bank.db
}
