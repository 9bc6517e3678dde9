//! `idem check`: the harness pointed at anyone's implementation. Each
//! property builds its own database with its own random accounts, amounts
//! and keys (from `--seed`), drives the implementation, and judges every
//! answer, the transfer table and the balances against what it computed
//! itself. A failing property shows the shortest request sequence that
//! shows it: its own steps, each with the answer it got.
//!
//! Two targets: a command that speaks the lab's contract
//! (`CMD --db DB --request REQ [--crash-after-claim]`, `CMD --db DB
//! --purge-before T`), on SQLite databases this module builds; or an HTTP
//! service (`--url`), judged by the IETF draft and DESIGN §2, with the
//! choices the draft leaves open read from a [`Profile`].

use super::DayError;
use super::day::{bank, io_at};
use super::race;
use crate::rng::Rng;
use serde_json::{Value, json};
use std::path::PathBuf;
use std::process::Command;

/// One property's verdict: `Err` holds the steps that show the failure.
pub type Verdict = Result<(), Vec<String>>;

/// The steps of a property, for its failure report.
#[derive(Default)]
struct Trace(Vec<String>);

impl Trace {
    fn step(&mut self, what: impl Into<String>) {
        self.0.push(what.into());
    }
    fn fail(mut self, why: impl Into<String>) -> Verdict {
        self.0.push(format!("=> FAIL: {}", why.into()));
        Err(self.0)
    }
}

macro_rules! expect {
    ($trace:expr, $cond:expr, $($why:tt)+) => {
        if !$cond {
            return Ok($trace.fail(format!($($why)+)));
        }
    };
}

/// An answer of the lab's contract.
#[derive(Debug, Clone)]
struct Answer {
    code: Option<i32>,
    stdout: String,
    json: Value,
}

impl Answer {
    fn status(&self) -> i64 {
        self.json["status"].as_i64().unwrap_or(-1)
    }
    fn replay(&self) -> bool {
        self.json["replay"].as_bool().unwrap_or(false)
    }
    fn reason(&self) -> &str {
        self.json["reason"].as_str().unwrap_or("")
    }
    fn transfer_id(&self) -> Option<i64> {
        self.json["body"]["transfer_id"].as_i64()
    }
    fn short(&self) -> String {
        let text = self.stdout.trim();
        let text: String = text.chars().take(160).collect();
        format!("exit {:?}: {text}", self.code)
    }
}

/// A fresh bank for one property: a SQLite file with random accounts.
struct Bank {
    dir: tempfile::TempDir,
    db: PathBuf,
    ids: Vec<String>,
    balances: Vec<i64>,
    engine: Vec<String>,
    files: std::cell::Cell<u32>,
}

impl Bank {
    fn new(engine: &[String], rng: &mut Rng, tag: &str, accounts: usize) -> Result<Bank, DayError> {
        let dir = tempfile::Builder::new()
            .prefix(&format!("idem-check-{tag}-"))
            .tempdir()
            .map_err(io_at(&std::env::temp_dir()))?;
        let db = dir.path().join("bank.db");
        let salt = rng.below(1 << 20);
        let ids: Vec<String> = (0..accounts).map(|i| format!("acct-{salt:x}-{i}")).collect();
        let balances: Vec<i64> = (0..accounts).map(|_| 10_000 + rng.below(990_000) as i64).collect();
        let rows: Vec<bank::Account> = ids
            .iter()
            .zip(&balances)
            .map(|(id, b)| bank::Account { id: id.clone(), holder: "check".into(), balance: *b })
            .collect();
        bank::create(&db.to_string_lossy(), &rows)?;
        Ok(Bank { dir, db, ids, balances, engine: engine.to_vec(), files: std::cell::Cell::new(0) })
    }

    fn file(&self, text: &str) -> Result<PathBuf, DayError> {
        self.files.set(self.files.get() + 1);
        let path = self.dir.path().join(format!("req-{}.json", self.files.get()));
        std::fs::write(&path, text).map_err(io_at(&path))?;
        Ok(path)
    }

    fn run(&self, args: &[&std::ffi::OsStr]) -> Result<Answer, DayError> {
        let (program, rest) = self.engine.split_first().ok_or_else(|| DayError("empty --engine".into()))?;
        let out = Command::new(program)
            .args(rest)
            .arg("--db")
            .arg(&self.db)
            .args(args)
            .output()
            .map_err(|e| DayError(format!("cannot run {program}: {e}")))?;
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let json = serde_json::from_str(stdout.trim()).unwrap_or(Value::Null);
        Ok(Answer { code: out.status.code(), stdout, json })
    }

    fn send(&self, text: &str, extra: &[&str]) -> Result<Answer, DayError> {
        let file = self.file(text)?;
        let mut args: Vec<&std::ffi::OsStr> = vec!["--request".as_ref(), file.as_os_str()];
        args.extend(extra.iter().map(|a| std::ffi::OsStr::new(*a)));
        self.run(&args)
    }

    /// The balances now, in the order of `ids`, and the transfer rows.
    fn ledger(&self) -> Result<(Vec<i64>, Vec<bank::TransferRow>), DayError> {
        let (transfers, balances) = bank::ledger(&self.db.to_string_lossy())?;
        Ok((self.ids.iter().map(|id| balances.get(id).copied().unwrap_or(i64::MIN)).collect(), transfers))
    }
}

fn request(client: &str, key: &str, src: &str, dst: &str, amount: i64) -> String {
    json!({"client_id": client, "endpoint": "/v1/transfers", "idem_key": key,
           "body": {"src": src, "dst": dst, "amount": amount, "currency": "KRW"}})
    .to_string()
}

/// The same request with its members reordered and re-spaced.
fn reordered(client: &str, key: &str, src: &str, dst: &str, amount: i64) -> String {
    format!(
        "{{ \"body\" : {{ \"currency\":\"KRW\", \"amount\": {amount},\n \"dst\":\"{dst}\", \"src\":\"{src}\" }},\n\t\"idem_key\":\"{key}\", \"endpoint\":\"/v1/transfers\", \"client_id\":\"{client}\" }}"
    )
}

/// The properties a lab-contract engine must have, by name.
pub const ENGINE_PROPERTIES: [&str; 13] = [
    "a new key moves the money once and answers 201",
    "a retry replays the first answer byte for byte",
    "a retry with members reordered and re-spaced replays",
    "the same key with another amount is 422 and moves nothing",
    "a retry after a crash after the claim is 409 and moves nothing",
    "a malformed request is 400 and does not consume its key",
    "unknown accounts and insufficient funds are stored and replayed",
    "keys are scoped by client: one key string, two clients, two transfers",
    "purge deletes keys created before the cut, offsets read correctly",
    "processes released together on one key pay once",
    "a burst on one hot account loses no update",
    "hostile inputs: unreadable files exit 3, broken databases fail cleanly",
    "random days agree with a plain model of the contract (shrunk on failure)",
];

/// Runs every property against `engine`; returns each verdict.
pub fn check_engine(engine: &[String], seed: u64) -> Vec<(&'static str, Verdict)> {
    ENGINE_PROPERTIES
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let mut rng = Rng::new(seed ^ (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
            let verdict =
                engine_property(i, engine, &mut rng).unwrap_or_else(|e| Err(vec![format!("=> FAIL: {e}")]));
            (*name, verdict)
        })
        .collect()
}

fn key(rng: &mut Rng) -> String {
    format!("key-{:012x}", rng.next_u64() & 0xffff_ffff_ffff)
}

fn engine_property(i: usize, engine: &[String], rng: &mut Rng) -> Result<Verdict, DayError> {
    let bank = Bank::new(engine, rng, &format!("p{i}"), 3)?;
    let (a, b) = (bank.ids[0].clone(), bank.ids[1].clone());
    let amount = 1 + rng.below(bank.balances[0] as u64 / 4) as i64;
    let k = key(rng);
    let client = format!("client-{}", rng.below(1000));
    let mut t = Trace::default();
    let send = |t: &mut Trace, text: &str, extra: &[&str]| -> Result<Answer, DayError> {
        let answer = bank.send(text, extra)?;
        t.step(format!("send {}{} -> {}", short(text), extra.join(" "), answer.short()));
        Ok(answer)
    };
    let moved = |amount: i64| {
        let mut want = bank.balances.clone();
        want[0] -= amount;
        want[1] += amount;
        want
    };
    Ok(match i {
        0 => {
            let r = send(&mut t, &request(&client, &k, &a, &b, amount), &[])?;
            expect!(
                t,
                r.code == Some(0) && r.status() == 201 && !r.replay() && r.transfer_id().is_some(),
                "wanted 201, a transfer_id, replay false"
            );
            let (balances, transfers) = bank.ledger()?;
            expect!(
                t,
                transfers.len() == 1 && transfers[0].amount == amount,
                "transfer table: {} rows",
                transfers.len()
            );
            expect!(t, balances == moved(amount), "balances {balances:?}, wanted {:?}", moved(amount));
            Ok(())
        }
        1 | 2 => {
            let first = send(&mut t, &request(&client, &k, &a, &b, amount), &[])?;
            let text = if i == 1 {
                request(&client, &k, &a, &b, amount)
            } else {
                reordered(&client, &k, &a, &b, amount)
            };
            let again = send(&mut t, &text, &[])?;
            expect!(
                t,
                again.replay() && again.status() == first.status(),
                "wanted a replay of {}",
                first.status()
            );
            let same = again.stdout.replacen("\"replay\":true", "\"replay\":false", 1) == first.stdout;
            expect!(t, same, "the replay's bytes differ from the first answer");
            let (balances, transfers) = bank.ledger()?;
            expect!(t, transfers.len() == 1 && balances == moved(amount), "paid {} times", transfers.len());
            Ok(())
        }
        3 => {
            send(&mut t, &request(&client, &k, &a, &b, amount), &[])?;
            let other = send(&mut t, &request(&client, &k, &a, &b, amount + 1), &[])?;
            expect!(
                t,
                other.status() == 422 && other.reason() == "fingerprint_mismatch",
                "wanted 422 fingerprint_mismatch"
            );
            let (balances, transfers) = bank.ledger()?;
            expect!(t, transfers.len() == 1 && balances == moved(amount), "the changed amount moved money");
            Ok(())
        }
        4 => {
            let crashed = send(&mut t, &request(&client, &k, &a, &b, amount), &["--crash-after-claim"])?;
            expect!(
                t,
                crashed.code != Some(0) && crashed.stdout.trim().is_empty(),
                "a crash must exit non-zero and answer nothing"
            );
            let retry = send(&mut t, &request(&client, &k, &a, &b, amount), &[])?;
            expect!(t, retry.status() == 409 && retry.reason() == "in_progress", "wanted 409 in_progress");
            let (balances, transfers) = bank.ledger()?;
            expect!(t, transfers.is_empty() && balances == bank.balances, "money moved without an execution");
            Ok(())
        }
        5 => {
            let bad = send(&mut t, &request(&client, &k, &a, &b, 0), &[])?;
            expect!(
                t,
                bad.status() == 400 && bad.reason().starts_with("invalid_request"),
                "wanted 400 invalid_request"
            );
            let good = send(&mut t, &request(&client, &k, &a, &b, amount), &[])?;
            expect!(t, good.status() == 201 && !good.replay(), "the 400 consumed the key");
            Ok(())
        }
        6 => {
            let ghost = format!("ghost-{}", rng.below(1 << 30));
            for (text, status, reason) in [
                (request(&client, &k, &ghost, &b, 1), 404, "unknown_account"),
                (
                    request(&client, &format!("{k}-2"), &a, &b, bank.balances[0] + 1),
                    402,
                    "insufficient_funds",
                ),
            ] {
                let first = send(&mut t, &text, &[])?;
                expect!(t, first.status() == status && first.reason() == reason, "wanted {status} {reason}");
                let again = send(&mut t, &text, &[])?;
                expect!(
                    t,
                    again.status() == status && again.replay(),
                    "the refusal was not stored and replayed"
                );
            }
            let (balances, transfers) = bank.ledger()?;
            expect!(t, transfers.is_empty() && balances == bank.balances, "a refusal moved money");
            Ok(())
        }
        7 => {
            let one = send(&mut t, &request(&client, &k, &a, &b, amount), &[])?;
            let two = send(&mut t, &request(&format!("{client}-other"), &k, &a, &b, amount + 1), &[])?;
            expect!(
                t,
                two.status() == 201 && !two.replay(),
                "another client's key answered as if it were the first's"
            );
            expect!(t, two.transfer_id() != one.transfer_id(), "two clients share a transfer");
            Ok(())
        }
        8 => {
            send(&mut t, &request(&client, &k, &a, &b, amount), &[])?;
            let now = crate::clock::Timestamp::now();
            // an hour ago, as UTC; an hour ahead, written in +09:00
            let before = now.plus_seconds(-3600).to_string();
            let ahead = now.plus_seconds(3600);
            let ahead_kst = kst(ahead);
            for (cut, want) in [(before, 0), (ahead_kst, 1)] {
                let out = bank.run(&["--purge-before".as_ref(), cut.as_ref()])?;
                t.step(format!("purge-before {cut} -> {}", out.short()));
                expect!(t, out.json["purged"].as_i64() == Some(want), "wanted {{\"purged\": {want}}}");
            }
            let again = send(&mut t, &request(&client, &k, &a, &b, amount), &[])?;
            expect!(t, again.status() == 201 && !again.replay(), "a purged key must be new again");
            Ok(())
        }
        9 => {
            for round in 0..8 {
                let file = bank.file(&request(&client, &format!("{k}-{round}"), &a, &b, 1))?;
                let files = vec![file; 4];
                let finished = race::release_together(&bank.engine, &bank.db, &files, &[])
                    .map_err(|e| DayError(format!("racing {:?}: {e}", bank.engine)))?;
                let fresh = finished
                    .iter()
                    .filter(|f| f.stdout.contains("\"status\":201") && f.stdout.contains("\"replay\":false"))
                    .count();
                t.step(format!("round {round}: 4 processes at once, one request -> {fresh} fresh 201s"));
                expect!(t, fresh == 1, "{fresh} processes executed the same key");
            }
            let (_, transfers) = bank.ledger()?;
            expect!(t, transfers.len() == 8, "{} transfers for 8 keys", transfers.len());
            Ok(())
        }
        10 => {
            let files = (0..8)
                .map(|p| bank.file(&request(&client, &format!("{k}-{p}"), &a, &b, 7)))
                .collect::<Result<Vec<_>, _>>()?;
            let finished = race::release_together(&bank.engine, &bank.db, &files, &[])
                .map_err(|e| DayError(format!("racing {:?}: {e}", bank.engine)))?;
            let ok = finished.iter().filter(|f| f.stdout.contains("\"status\":201")).count();
            t.step(format!("8 processes at once, 8 keys, one source account -> {ok} answered 201"));
            let (balances, transfers) = bank.ledger()?;
            let want = moved(7 * transfers.len() as i64);
            expect!(t, transfers.len() == ok, "{} transfers, {ok} answered 201", transfers.len());
            expect!(t, balances == want, "balances {balances:?}, wanted {want:?}: an update was lost");
            Ok(())
        }
        12 => return random_days(engine, rng),
        _ => {
            let missing =
                bank.run(&["--request".as_ref(), bank.dir.path().join("missing.json").as_os_str()])?;
            t.step(format!("a missing request file -> {}", missing.short()));
            expect!(t, missing.code == Some(3), "wanted exit 3");
            let folder = bank.run(&["--request".as_ref(), bank.dir.path().as_os_str()])?;
            t.step(format!("a directory as the request -> {}", folder.short()));
            expect!(t, folder.code == Some(3), "wanted exit 3");
            let garbage = send(&mut t, "{not json", &[])?;
            expect!(t, garbage.code == Some(0) && garbage.status() == 400, "wanted 400, exit 0");
            let broken = Bank::new(engine, rng, "broken", 2)?;
            rusqlite::Connection::open(&broken.db)?.execute_batch("DROP TABLE account")?;
            let out = broken.send(&request(&client, &k, &a, &b, 1), &[])?;
            t.step(format!("a database without account -> {}", out.short()));
            expect!(
                t,
                out.code != Some(0) && out.stdout.trim().is_empty(),
                "wanted a clean failure: non-zero, nothing on stdout"
            );
            Ok(())
        }
    })
}

/// `t` written in +09:00, as a client in Seoul would.
fn kst(t: crate::clock::Timestamp) -> String {
    let local = t.plus_seconds(9 * 3600).to_string();
    format!("{}+09:00", local.trim_end_matches('Z'))
}

fn short(text: &str) -> String {
    let flat: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    let flat: String = flat.chars().take(140).collect();
    format!("{flat} ")
}

/// Prints one line per property and the failing steps; `true` if all passed.
pub fn report(results: &[(&str, Verdict)]) -> bool {
    for (name, verdict) in results {
        match verdict {
            Ok(()) => println!("PASS  {name}"),
            Err(steps) => {
                println!("FAIL  {name}");
                for step in steps {
                    println!("        {step}");
                }
            }
        }
    }
    results.iter().all(|(_, v)| v.is_ok())
}

/// What an HTTP implementation chose where the draft leaves it open.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Profile {
    /// The route that creates a transfer.
    pub path: String,
    /// Whether the key is sent as an sf-string (`"…"`) or bare.
    pub quote_key: bool,
    /// The header a replay carries (`None`: replays are not marked).
    pub replay_header: Option<String>,
    pub created_status: u16,
    pub mismatch_status: u16,
    pub in_flight_status: u16,
    pub missing_key_status: u16,
}

impl Default for Profile {
    /// DESIGN §2, idem's own choices.
    fn default() -> Self {
        Profile {
            path: "/v1/transfers".into(),
            quote_key: true,
            replay_header: Some("idempotent-replayed".into()),
            created_status: 201,
            mismatch_status: 422,
            in_flight_status: 409,
            missing_key_status: 400,
        }
    }
}

/// The service under check and how to reach it.
pub struct Target {
    pub url: String,
    /// One token, or two (for the scope property).
    pub tokens: Vec<String>,
    /// Two accounts the service holds, the first with funds to spare.
    pub src: Value,
    pub dst: Value,
    pub profile: Profile,
}

struct Http {
    status: u16,
    replayed: bool,
    body: String,
}

impl Http {
    fn short(&self) -> String {
        let body: String = self.body.chars().take(140).collect();
        format!("{}{} {body}", self.status, if self.replayed { " (replayed)" } else { "" })
    }
}

impl Target {
    fn post(&self, via: &str, token: &str, key: Option<&str>, body: &str) -> Result<Http, String> {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(std::time::Duration::from_secs(20)))
            .build()
            .into();
        let mut req = agent
            .post(format!("{}{}", via.trim_end_matches('/'), self.profile.path))
            .header("Authorization", format!("Bearer {token}"))
            .header("Content-Type", "application/json");
        if let Some(key) = key {
            let value = if self.profile.quote_key { format!("\"{key}\"") } else { key.to_owned() };
            req = req.header("Idempotency-Key", value);
        }
        let mut response = req.send(body).map_err(|e| e.to_string())?;
        let replayed = self.profile.replay_header.as_ref().is_some_and(|h| {
            response
                .headers()
                .get(h.as_str())
                .is_some_and(|v| v.to_str().is_ok_and(|v| v.eq_ignore_ascii_case("true")))
        });
        let status = response.status().as_u16();
        let body = response.body_mut().read_to_string().map_err(|e| e.to_string())?;
        Ok(Http { status, replayed, body })
    }

    fn transfer(&self, amount: i64) -> String {
        json!({"src": self.src, "dst": self.dst, "amount": amount, "currency": "KRW"}).to_string()
    }
}

/// The properties an HTTP implementation must have, by name.
pub const URL_PROPERTIES: [&str; 8] = [
    "a new key is created",
    "a retry replays the first answer byte for byte, and says so",
    "a retry with members reordered and re-spaced replays",
    "the same key with another body is refused (mismatch status)",
    "a request without a key is refused",
    "keys are scoped by client: one key string, two tokens, two transfers",
    "many connections at once with one key: one answer, the others in flight or its replay",
    "an answer lost after the commit is replayed on retry, not made again",
];

/// Runs every property against the service; returns each verdict.
pub fn check_url(target: &Target, seed: u64) -> Vec<(&'static str, Verdict)> {
    URL_PROPERTIES
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let mut rng = Rng::new(seed ^ (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
            (*name, url_property(i, target, &mut rng).unwrap_or_else(|e| Err(vec![format!("=> FAIL: {e}")])))
        })
        .collect()
}

fn url_property(i: usize, target: &Target, rng: &mut Rng) -> Result<Verdict, String> {
    let p = &target.profile;
    let token = &target.tokens[0];
    let k = format!("check-{:016x}", rng.next_u64());
    let amount = 1 + rng.below(50) as i64;
    let mut t = Trace::default();
    let post = |t: &mut Trace, token: &str, key: Option<&str>, body: &str| -> Result<Http, String> {
        let answer = target.post(&target.url, token, key, body)?;
        t.step(format!("POST key={} {} -> {}", key.unwrap_or("(none)"), short(body), answer.short()));
        Ok(answer)
    };
    let body = target.transfer(amount);
    Ok(match i {
        0 => {
            let r = post(&mut t, token, Some(&k), &body)?;
            expect!(t, r.status == p.created_status, "wanted {}", p.created_status);
            Ok(())
        }
        1 | 2 => {
            let first = post(&mut t, token, Some(&k), &body)?;
            let again_body = if i == 1 {
                body.clone()
            } else {
                format!(
                    "{{ \"currency\" : \"KRW\",\n  \"amount\": {amount}, \"dst\": {}, \"src\": {} }}",
                    target.dst, target.src
                )
            };
            let again = post(&mut t, token, Some(&k), &again_body)?;
            expect!(
                t,
                again.status == first.status && again.body == first.body,
                "the retry's answer differs from the first"
            );
            expect!(t, p.replay_header.is_none() || again.replayed, "the replay is not marked");
            expect!(t, !first.replayed, "the first answer is marked as a replay");
            Ok(())
        }
        3 => {
            post(&mut t, token, Some(&k), &body)?;
            let other = post(&mut t, token, Some(&k), &target.transfer(amount + 1))?;
            expect!(t, other.status == p.mismatch_status, "wanted {}", p.mismatch_status);
            Ok(())
        }
        4 => {
            let r = post(&mut t, token, None, &body)?;
            expect!(t, r.status == p.missing_key_status, "wanted {}", p.missing_key_status);
            Ok(())
        }
        5 => {
            let Some(other_token) = target.tokens.get(1) else {
                t.step("(one token given: pass --token twice to check the scope)");
                return Ok(Ok(()));
            };
            let one = post(&mut t, token, Some(&k), &body)?;
            let two = post(&mut t, other_token, Some(&k), &target.transfer(amount + 1))?;
            expect!(
                t,
                two.status == p.created_status && !two.replayed,
                "another client's key answered as the first's"
            );
            expect!(t, two.body != one.body, "two clients got one answer");
            Ok(())
        }
        6 => {
            let barrier = std::sync::Barrier::new(16);
            let answers: Vec<Result<Http, String>> = std::thread::scope(|scope| {
                let runs: Vec<_> = (0..16)
                    .map(|_| {
                        scope.spawn(|| {
                            barrier.wait();
                            target.post(&target.url, token, Some(&k), &body)
                        })
                    })
                    .collect();
                runs.into_iter()
                    .map(|r| r.join().unwrap_or_else(|_| Err("a thread panicked".into())))
                    .collect()
            });
            let answers: Vec<Http> = answers.into_iter().collect::<Result<_, _>>()?;
            let created: Vec<&Http> = answers.iter().filter(|a| a.status == p.created_status).collect();
            let fresh = created.iter().filter(|a| !a.replayed).count();
            t.step(format!(
                "16 connections at once, one key -> statuses {:?}, {fresh} unmarked",
                answers.iter().map(|a| a.status).collect::<Vec<_>>()
            ));
            expect!(t, !created.is_empty(), "nobody was answered {}", p.created_status);
            expect!(
                t,
                created.iter().all(|a| a.body == created[0].body),
                "the answers name more than one transfer"
            );
            expect!(
                t,
                answers.iter().all(|a| a.status == p.created_status || a.status == p.in_flight_status),
                "an answer was neither the transfer nor in flight"
            );
            expect!(t, p.replay_header.is_none() || fresh == 1, "{fresh} answers claim to be the first");
            Ok(())
        }
        _ => {
            // Through a proxy that drops every answer: the service commits,
            // the client hears nothing; then the retry, directly.
            let upstream: std::net::SocketAddr = target
                .url
                .trim_start_matches("http://")
                .trim_end_matches('/')
                .parse()
                .map_err(|_| "--url must be http://IP:PORT for the proxy property".to_string())?;
            let odds = super::proxy::Odds {
                drop_request: 0,
                drop_response: 100,
                cut_response: 0,
                delay: 0,
                duplicate: 0,
            };
            let proxy =
                super::proxy::Proxy::start(upstream, rng.next_u64(), odds).map_err(|e| e.to_string())?;
            let lost = target.post(&proxy.url(), token, Some(&k), &body);
            // what the service answered, before the proxy dropped it
            let dropped =
                proxy.counts.dropped.lock().unwrap_or_else(|e| e.into_inner()).pop().unwrap_or_default();
            let dropped = String::from_utf8_lossy(&dropped).into_owned();
            let dropped_body = dropped.split_once("\r\n\r\n").map_or("", |(_, b)| b).to_owned();
            t.step(format!(
                "POST key={k} through a proxy that drops the answer -> {}; the service had answered {}",
                lost.as_ref().map_or_else(|e| format!("no answer ({e})"), Http::short),
                short(&dropped_body)
            ));
            let retry = post(&mut t, token, Some(&k), &body)?;
            expect!(t, retry.status == p.created_status, "wanted {}", p.created_status);
            expect!(
                t,
                retry.body == dropped_body,
                "the retry was made again, not replayed: the transfer went out twice"
            );
            expect!(t, p.replay_header.is_none() || retry.replayed, "the replay is not marked");
            Ok(())
        }
    })
}

/// One step of a random day: a request by client `client` under key `key`
/// moving `amount` from account `src` to `dst`, sent plainly, reordered,
/// or crashed after its claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Op {
    client: u8,
    key: u8,
    src: usize,
    dst: usize,
    amount: i64,
    style: u8,
}

fn random_op(rng: &mut Rng, accounts: usize) -> Op {
    // now and then (== accounts) an account that does not exist
    let src = if rng.below(8) == 0 { accounts } else { rng.below(accounts as u64) as usize };
    let dst = (src + 1 + rng.below(accounts as u64 - 1) as usize) % accounts;
    Op {
        client: rng.below(2) as u8,
        key: rng.below(3) as u8,
        src,
        dst,
        amount: [100, 2_500, 900_000][rng.below(3) as usize],
        style: rng.below(5) as u8,
    }
}

/// Random days of a few clients, keys and accounts through the engine, each
/// answer judged against a plain model; a failing day is shrunk, one step
/// at a time, to the shortest day that still fails.
fn random_days(engine: &[String], rng: &mut Rng) -> Result<Verdict, DayError> {
    for _ in 0..4 {
        // half the steps retry an earlier one, as clients do, in another style
        let mut day: Vec<Op> = Vec::new();
        for _ in 0..10 {
            let op = match day.len() {
                n if n > 0 && rng.below(2) == 0 => {
                    Op { style: rng.below(5) as u8, ..day[rng.below(n as u64) as usize] }
                }
                _ => random_op(rng, 3),
            };
            day.push(op);
        }
        let seed = rng.next_u64();
        if let Err(steps) = run_day(engine, &day, seed)? {
            return Ok(Err(shrink(engine, day, seed, steps)?));
        }
    }
    Ok(Ok(()))
}

/// Removes steps while the day still fails; returns the last failure seen.
fn shrink(
    engine: &[String],
    mut day: Vec<Op>,
    seed: u64,
    mut steps: Vec<String>,
) -> Result<Vec<String>, DayError> {
    let mut i = day.len();
    while i > 0 {
        i -= 1;
        let mut shorter = day.clone();
        shorter.remove(i);
        if let Err(fewer) = run_day(engine, &shorter, seed)? {
            (day, steps) = (shorter, fewer);
            i = i.min(day.len());
        }
    }
    steps.insert(0, format!("(shrunk to {} step(s))", day.len()));
    Ok(steps)
}

/// What a request asks for: `(src, dst, amount)`.
type Intent = (usize, usize, i64);

/// Runs one day on a fresh bank and judges it against the model.
fn run_day(engine: &[String], day: &[Op], seed: u64) -> Result<Verdict, DayError> {
    let mut rng = Rng::new(seed);
    let bank = Bank::new(engine, &mut rng, "day", 3)?;
    let mut balances = bank.balances.clone();
    // per scoped key: the first body and the first answer's text, once answered
    let mut keys: std::collections::BTreeMap<(u8, u8), (Intent, Option<String>)> = Default::default();
    let mut transfers = 0;
    let mut t = Trace::default();
    let id = |i: usize| bank.ids.get(i).cloned().unwrap_or_else(|| "nobody".into());
    for op in day {
        let (client, k) = (format!("day-client-{}", op.client), format!("day-key-{}", op.key));
        let (src, dst) = (id(op.src), id(op.dst));
        let text = match op.style {
            0 => reordered(&client, &k, &src, &dst, op.amount),
            _ => request(&client, &k, &src, &dst, op.amount),
        };
        let crash = op.style == 4;
        let answer = bank.send(&text, if crash { &["--crash-after-claim"] } else { &[] })?;
        t.step(format!(
            "send {}{} -> {}",
            short(&text),
            if crash { "--crash-after-claim " } else { "" },
            answer.short()
        ));
        let body = (op.src, op.dst, op.amount);
        match keys.get(&(op.client, op.key)) {
            None if crash => {
                expect!(t, answer.code != Some(0), "a crash after the claim answered");
                keys.insert((op.client, op.key), (body, None));
            }
            None => {
                let (status, reason) = if op.src >= bank.ids.len() {
                    (404, "unknown_account")
                } else if balances[op.src] < op.amount {
                    (402, "insufficient_funds")
                } else {
                    balances[op.src] -= op.amount;
                    balances[op.dst] += op.amount;
                    transfers += 1;
                    (201, "")
                };
                expect!(
                    t,
                    answer.status() == status && !answer.replay() && answer.reason() == reason,
                    "wanted {status} {reason}"
                );
                keys.insert((op.client, op.key), (body, Some(answer.stdout.clone())));
            }
            Some((first, _)) if *first != body => {
                expect!(t, answer.status() == 422, "another body under a used key: wanted 422");
            }
            Some((_, None)) => {
                expect!(t, crash || answer.status() == 409, "a retry of a claimed key: wanted 409");
            }
            Some((_, Some(first))) => {
                let same = answer.stdout.replacen("\"replay\":true", "\"replay\":false", 1) == *first;
                expect!(
                    t,
                    answer.replay() && same,
                    "a retry of a completed key: wanted the first answer replayed byte for byte"
                );
            }
        }
        let (now, rows) = bank.ledger()?;
        expect!(
            t,
            now == balances && rows.len() == transfers,
            "the ledger is {now:?} with {} transfers; the model says {balances:?} with {transfers}",
            rows.len()
        );
    }
    Ok(Ok(()))
}
