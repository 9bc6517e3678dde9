//! Scenarios: request sequences written as data, run against the engine,
//! each step checked against the expectation on its own line.
//!
//! The format is documented in `scenarios/README.md`. Beyond what each step
//! states, the runner checks after every step what must always hold: every
//! replay carries the bytes of the first answer for its key, no transfer
//! lacks a completed key, and money is conserved.

use crate::clock::Timestamp;
use crate::harness;
use crate::policy::Policy;
use crate::protocol::{Ctx, Engine, Point, Response};
use crate::request::{self, AcctId, ScopedKey};
use crate::store::Audit;
use serde_json::json;
use std::collections::{BTreeSet, HashMap};
use std::fmt::{self, Write};

const DEFAULT_START: &str = "2026-12-01T00:00:00Z";

/// What a step expects back: `=> STATUS [replay] [REASON-PREFIX]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expect {
    pub status: u16,
    pub replay: bool,
    /// `None` expects a null reason; otherwise the reason must start with it.
    pub reason: Option<String>,
}

/// One request of a `together` group: `(line number, raw request, expectation)`.
pub type Member = (usize, String, Expect);

#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    At(Timestamp),
    After(i64),
    Send { raw: String, expect: Expect },
    Crash { raw: String, point: Point },
    Together(Vec<Member>),
    Purge { before: Timestamp, purged: u64 },
    Transfers(i64),
    Balances(Vec<(AcctId, i64)>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Scenario {
    pub accounts: Vec<(AcctId, i64)>,
    /// `(line number, source line, step)`
    pub steps: Vec<(usize, String, Step)>,
}

/// A line that does not parse, or an expectation that did not hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub line: usize,
    pub message: String,
    /// The transcript up to and including the failing step.
    pub transcript: String,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}line {}: {}", self.transcript, self.line, self.message)
    }
}

fn fail(line: usize, message: impl Into<String>) -> Failure {
    Failure { line, message: message.into(), transcript: String::new() }
}

fn acct(token: &str) -> AcctId {
    token.parse().map_or_else(|_| AcctId::Text(token.to_string()), AcctId::Int)
}

fn acct_json(id: &AcctId) -> serde_json::Value {
    match id {
        AcctId::Int(i) => json!(i),
        AcctId::Text(s) => json!(s),
    }
}

fn parse_expect(line: usize, text: &str) -> Result<Expect, Failure> {
    let mut words = text.split_whitespace();
    let status =
        words.next().and_then(|w| w.parse().ok()).ok_or_else(|| fail(line, "expected `=> STATUS`"))?;
    let mut rest: Vec<&str> = words.collect();
    let replay = rest.first() == Some(&"replay");
    if replay {
        rest.remove(0);
    }
    let reason = (!rest.is_empty()).then(|| rest.join(" "));
    Ok(Expect { status, replay, reason })
}

/// `CLIENT ENDPOINT KEY SRC->DST AMOUNT [CURRENCY]` as compact request JSON.
fn parse_send(line: usize, words: &[&str]) -> Result<String, Failure> {
    let [client, endpoint, key, route, amount, rest @ ..] = words else {
        return Err(fail(line, "expected CLIENT ENDPOINT KEY SRC->DST AMOUNT [CURRENCY]"));
    };
    let (src, dst) = route.split_once("->").ok_or_else(|| fail(line, "expected SRC->DST"))?;
    let amount: i64 =
        amount.parse().map_err(|_| fail(line, format!("amount {amount:?} is not an integer")))?;
    let currency = rest.first().copied().unwrap_or("KRW");
    Ok(json!({"client_id": client, "endpoint": endpoint, "idem_key": key,
              "body": {"src": acct_json(&acct(src)), "dst": acct_json(&acct(dst)),
                       "amount": amount, "currency": currency}})
    .to_string())
}

fn parse_time(line: usize, text: &str) -> Result<Timestamp, Failure> {
    Timestamp::parse(text).map_err(|e| fail(line, e.to_string()))
}

/// A request step: `send …` or `raw {json}`, each `=> EXPECT`.
fn parse_request(line: usize, text: &str) -> Result<(String, Expect), Failure> {
    let (req, expect) = text.rsplit_once("=>").ok_or_else(|| fail(line, "expected `=> STATUS`"))?;
    let expect = parse_expect(line, expect)?;
    let raw = match req.trim().split_once(' ') {
        Some(("send", args)) => parse_send(line, &args.split_whitespace().collect::<Vec<_>>())?,
        Some(("raw", json)) => json.trim().to_string(),
        _ => return Err(fail(line, "expected `send …` or `raw …`")),
    };
    Ok((raw, expect))
}

/// Parses a scenario file's text.
pub fn parse(text: &str) -> Result<Scenario, Failure> {
    let mut accounts = Vec::new();
    let mut steps = Vec::new();
    let mut group: Option<(usize, String, Vec<Member>)> = None;
    for (i, source) in text.lines().enumerate() {
        let n = i + 1;
        let line = source.split(" #").next().unwrap_or("").trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (verb, rest) = line.split_once(' ').unwrap_or((line, ""));
        if let Some((_, _, members)) = &mut group {
            match verb {
                "end" => {
                    let (start, head, members) = group.take().unwrap_or_default();
                    if members.len() < 2 {
                        return Err(fail(start, "a `together` group needs at least two requests"));
                    }
                    steps.push((start, head, Step::Together(members)));
                }
                "send" | "raw" => {
                    let (raw, expect) = parse_request(n, line)?;
                    members.push((n, raw, expect));
                }
                _ => return Err(fail(n, "only `send`, `raw` and `end` may stand inside `together`")),
            }
            continue;
        }
        let step = match verb {
            "accounts" => {
                accounts.extend(balances(n, rest)?);
                continue;
            }
            "together" => {
                group = Some((n, line.to_string(), Vec::new()));
                continue;
            }
            "at" => Step::At(parse_time(n, rest)?),
            "after" => Step::After(parse_duration(rest).ok_or_else(|| fail(n, "expected e.g. 30s, 5m, 2h"))?),
            "send" | "raw" => {
                let (raw, expect) = parse_request(n, line)?;
                Step::Send { raw, expect }
            }
            "crash" => crash_step(n, rest)?,
            "purge" => {
                let (cut, count) =
                    rest.split_once("=>").ok_or_else(|| fail(n, "expected purge TIME => N"))?;
                let purged = count.trim().parse().map_err(|_| fail(n, "expected a count after =>"))?;
                Step::Purge { before: parse_time(n, cut.trim())?, purged }
            }
            "expect" => match rest.split_once(' ') {
                Some(("transfers", count)) => {
                    Step::Transfers(count.trim().parse().map_err(|_| fail(n, "expect transfers N"))?)
                }
                Some(("balances", pairs)) => Step::Balances(balances(n, pairs)?),
                _ => return Err(fail(n, "expect transfers N | expect balances ID=BALANCE …")),
            },
            other => return Err(fail(n, format!("unknown step {other:?}"))),
        };
        steps.push((n, line.to_string(), step));
    }
    if let Some((start, _, _)) = group {
        return Err(fail(start, "`together` without `end`"));
    }
    if accounts.is_empty() {
        return Err(fail(1, "a scenario starts with `accounts ID=BALANCE …`"));
    }
    Ok(Scenario { accounts, steps })
}

/// `ID=BALANCE …` of line `n`.
fn balances(n: usize, pairs: &str) -> Result<Vec<(AcctId, i64)>, Failure> {
    pairs
        .split_whitespace()
        .map(|pair| {
            let (id, b) = pair.split_once('=').ok_or_else(|| fail(n, "expected ID=BALANCE"))?;
            Ok((acct(id), b.parse().map_err(|_| fail(n, format!("balance {b:?}")))?))
        })
        .collect()
}

/// `crash send … POINT` of line `n`.
fn crash_step(n: usize, rest: &str) -> Result<Step, Failure> {
    let words: Vec<&str> = rest.split_whitespace().collect();
    let (point, args) = match words.split_last() {
        Some((&"after-claim", a)) => (Point::AfterClaim, a),
        Some((&"before-commit", a)) => (Point::BeforeCommit, a),
        Some((&"after-commit", a)) => (Point::AfterCommit, a),
        _ => return Err(fail(n, "crash … ends with after-claim, before-commit or after-commit")),
    };
    Ok(Step::Crash { raw: parse_send(n, args)?, point })
}

fn parse_duration(text: &str) -> Option<i64> {
    let text = text.trim();
    let (number, unit) = text.split_at(text.len().checked_sub(1)?);
    let n: i64 = number.parse().ok()?;
    n.checked_mul([("s", 1), ("m", 60), ("h", 3600)].iter().find(|(u, _)| *u == unit)?.1)
}

/// Runs a scenario on a fresh in-memory SQLite database; returns the transcript.
pub fn run(scenario: &Scenario, policy: &Policy) -> Result<String, Failure> {
    let mut store = crate::store::bank::in_memory(&scenario.accounts, policy)
        .map_err(|e| fail(0, format!("setup: {e}")))?;
    run_on(scenario, policy, &mut store)
}

/// Runs a scenario through `engine`, whose database holds exactly the
/// scenario's accounts and nothing else yet.
pub fn run_on(scenario: &Scenario, policy: &Policy, engine: &mut dyn Engine) -> Result<String, Failure> {
    let now = Timestamp::parse(DEFAULT_START).map_err(|e| fail(0, e.to_string()))?;
    let money = scenario.accounts.iter().map(|(_, b)| b).sum();
    let mut runner = Runner {
        engine,
        policy,
        now,
        first: HashMap::new(),
        money,
        forgotten: BTreeSet::new(),
        transcript: String::new(),
    };
    for (line, source, step) in &scenario.steps {
        if let Err(message) = runner.step(*line, source, step) {
            return Err(Failure { line: *line, message, transcript: runner.transcript });
        }
    }
    Ok(runner.transcript)
}

struct Runner<'a> {
    engine: &'a mut dyn Engine,
    policy: &'a Policy,
    now: Timestamp,
    /// The first (non-replay) answer per key, which every replay must repeat.
    first: HashMap<ScopedKey, Response>,
    money: i64,
    /// Transfers whose key was purged or expired: they may lack a key.
    forgotten: BTreeSet<i64>,
    transcript: String,
}

impl Runner<'_> {
    fn log(&mut self, line: usize, source: &str, got: &str) {
        let _ = writeln!(self.transcript, "{line:>4}  {source}\n      {got}");
    }

    fn step(&mut self, line: usize, source: &str, step: &Step) -> Result<(), String> {
        match step {
            Step::At(t) => self.now = *t,
            Step::After(seconds) => self.now = self.now.plus_seconds(*seconds),
            Step::Send { raw, expect } => {
                let response = self.send(raw, line, None)?.ok_or("crashed with no crash point")?;
                self.log(line, source, &response.to_json());
                self.check(raw, &response, expect)?;
            }
            Step::Crash { raw, point } => {
                let response = self.send(raw, line, Some(*point))?;
                self.log(line, source, "(crashed, no answer)");
                if response.is_some() {
                    return Err(format!("expected a crash at {point:?}, got an answer"));
                }
            }
            Step::Together(members) => {
                let answers = self.together(members)?;
                for ((n, raw, expect), response) in members.iter().zip(answers) {
                    self.log(*n, &format!("  (together) {}", short(raw)), &response.to_json());
                    self.check(raw, &response, expect).map_err(|e| format!("(line {n}) {e}"))?;
                }
            }
            Step::Purge { before, purged } => {
                let got = self.engine.purge(*before, self.policy).map_err(|e| e.to_string())?;
                self.log(line, source, &format!("{{\"purged\": {got}}}"));
                if got != *purged {
                    return Err(format!("expected {purged} purged, got {got}"));
                }
                // A purged key's next answer is a first answer again, and
                // transfers made so far may have lost their keys.
                for (_, first) in self.first.drain() {
                    self.forgotten.extend(first.transfer_id);
                }
            }
            Step::Transfers(want) => {
                let got = self.audit()?.transfers.len() as i64;
                self.log(line, source, &format!("transfers {got}"));
                if got != *want {
                    return Err(format!("expected {want} transfers, got {got}"));
                }
            }
            Step::Balances(want) => {
                let audit = self.audit()?;
                let got: Vec<(AcctId, i64)> =
                    want.iter().map(|(id, _)| (id.clone(), audit.balance(id).unwrap_or(0))).collect();
                let shown: Vec<String> = got.iter().map(|(id, b)| format!("{id}={b}")).collect();
                self.log(line, source, &format!("balances {}", shown.join(" ")));
                if got != *want {
                    return Err(format!("expected balances {want:?}, got {got:?}"));
                }
            }
        }
        self.invariants()
    }

    /// One request; `None` when it crashed at `crash`.
    fn send(&mut self, raw: &str, line: usize, crash: Option<Point>) -> Result<Option<Response>, String> {
        let token = format!("line-{line}");
        let ctx = Ctx { policy: self.policy, now: self.now, token: &token };
        harness::send(self.engine, raw, ctx, crash).map_err(|e| format!("store error: {e}"))
    }

    fn together(&mut self, members: &[Member]) -> Result<Vec<Response>, String> {
        let tokens: Vec<String> = members.iter().map(|(n, _, _)| format!("line-{n}")).collect();
        let batch: Vec<_> = members
            .iter()
            .zip(&tokens)
            .map(|((_, raw, _), token)| (raw.as_str(), Ctx { policy: self.policy, now: self.now, token }))
            .collect();
        harness::together(self.engine, &batch).map_err(|e| e.to_string())
    }

    fn check(&mut self, raw: &str, got: &Response, want: &Expect) -> Result<(), String> {
        let reason_ok = match (&want.reason, &got.reason) {
            (None, None) => true,
            (Some(w), Some(g)) => g.to_string().starts_with(&w.to_string()),
            _ => false,
        };
        if got.status != want.status || got.replay != want.replay || !reason_ok {
            return Err(format!(
                "expected {} {}{}\n      got      {}",
                want.status,
                if want.replay { "replay " } else { "" },
                want.reason.as_deref().unwrap_or("(null reason)"),
                got.to_json()
            ));
        }
        let Ok(req) = request::parse(raw.as_bytes(), self.policy) else { return Ok(()) };
        if got.replay {
            let replayed = Response { replay: false, ..got.clone() };
            // After a crash the first answer was never seen: this replay
            // becomes the reference for the ones after it.
            let first = self.first.entry(req.key).or_insert_with(|| replayed.clone());
            if replayed != *first {
                return Err(format!(
                    "replay differs from the first answer\n      first    {}",
                    first.to_json()
                ));
            }
        } else if ![self.policy.on_in_flight, self.policy.on_fingerprint_mismatch, self.policy.on_busy]
            .contains(&got.status)
        {
            // A new first answer for a known key: the old one expired.
            if let Some(old) = self.first.insert(req.key, got.clone()) {
                self.forgotten.extend(old.transfer_id);
            }
        }
        Ok(())
    }

    fn audit(&mut self) -> Result<Audit, String> {
        self.engine.audit().map_err(|e| format!("audit: {e}"))
    }

    fn invariants(&mut self) -> Result<(), String> {
        let audit = self.audit()?;
        if audit.money() != self.money {
            return Err(format!("money not conserved: {} before, {} now", self.money, audit.money()));
        }
        if let Some(id) = audit.orphans.iter().find(|id| !self.forgotten.contains(id)) {
            return Err(format!("transfer {id} has no completed key"));
        }
        if audit.hollow > 0 {
            return Err(format!("{} completed 201 key(s) without their transfer", audit.hollow));
        }
        Ok(())
    }
}

fn short(raw: &str) -> String {
    raw.chars().take(100).collect()
}
