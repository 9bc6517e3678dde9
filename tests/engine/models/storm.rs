//! The storm machinery: random days, a plain-map oracle, and the loop that
//! runs a day through the engine and the oracle side by side.

use idem::clock::Timestamp;
use idem::harness;
use idem::policy::Policy;
use idem::protocol::{Ctx, Engine, Point, Response};
use idem::request::{AcctId, ScopedKey};
use idem::store::bank::in_memory as sqlite_bank;
use proptest::prelude::*;
use std::collections::BTreeMap;

pub const ACCOUNTS: usize = 3;
const GHOST: usize = 3; // an account id that does not exist

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Style {
    Compact,
    Reordered,
    Respaced,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Send {
    pub client: u8,
    key: u8,
    src: usize,
    dst: usize,
    amount: i64,
    style: Style,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Send(Send),
    Crash(Send, Point),
    Together(Vec<Send>),
    /// A malformed body under a real key: must not consume it.
    Bad {
        client: u8,
        key: u8,
        amount: &'static str,
    },
    Wait(i64),
    /// Purge keys older than `now - seconds`.
    Purge(i64),
}

fn send() -> impl Strategy<Value = Send> {
    (0..2u8, 0..3u8, 0..=GHOST, 0..ACCOUNTS, prop::sample::select(vec![100i64, 250, 700]), 0..3u8).prop_map(
        |(client, key, src, dst, amount, style)| Send {
            client,
            key,
            src,
            dst,
            amount,
            style: [Style::Compact, Style::Reordered, Style::Respaced][style as usize],
        },
    )
}

pub fn op() -> impl Strategy<Value = Op> {
    let point = prop::sample::select(vec![Point::AfterClaim, Point::BeforeCommit, Point::AfterCommit]);
    prop_oneof![
        6 => send().prop_map(Op::Send),
        2 => (send(), point).prop_map(|(s, p)| Op::Crash(s, p)),
        2 => prop::collection::vec(send(), 2..=3).prop_map(Op::Together),
        1 => (0..2u8, 0..3u8, prop::sample::select(vec!["0", "-5", "1.5", "1e3", "\"100\"", "99999999999999999999"]))
            .prop_map(|(client, key, amount)| Op::Bad { client, key, amount }),
        2 => prop::sample::select(vec![1i64, 60, 299, 300, 3600, 71 * 3600, 72 * 3600]).prop_map(Op::Wait),
        1 => prop::sample::select(vec![0i64, 60, 3600, 72 * 3600]).prop_map(Op::Purge),
    ]
}

fn acct(i: usize) -> String {
    format!("acct-{i}")
}

fn key_of(client: u8, key: u8) -> ScopedKey {
    ScopedKey {
        client_id: format!("client-{client}"),
        endpoint: "/v1/transfers".into(),
        idem_key: format!("k{key}"),
    }
}

fn raw(s: &Send) -> String {
    let k = key_of(s.client, s.key);
    let (c, e, i, src, dst, a) = (k.client_id, k.endpoint, k.idem_key, acct(s.src), acct(s.dst), s.amount);
    match s.style {
        Style::Compact => format!(
            r#"{{"client_id":"{c}","endpoint":"{e}","idem_key":"{i}","body":{{"src":"{src}","dst":"{dst}","amount":{a},"currency":"KRW"}}}}"#
        ),
        Style::Reordered => format!(
            r#"{{"body":{{"currency":"KRW","amount":{a},"dst":"{dst}","src":"{src}"}},"idem_key":"{i}","endpoint":"{e}","client_id":"{c}"}}"#
        ),
        Style::Respaced => format!(
            "{{ \"client_id\" : \"{c}\",\n\t\"endpoint\":\"{e}\" , \"idem_key\": \"{i}\",\n \"body\": {{ \"src\": \"{src}\", \"dst\": \"{dst}\", \"amount\": {a}, \"currency\": \"KRW\" }} }}"
        ),
    }
}

/// What the oracle knows of a key.
#[derive(Debug, Clone)]
struct KeyModel {
    body: (usize, usize, i64),
    created: i64,
    lease_until: Option<i64>, // Some while in progress
    answer: Option<(u16, Option<String>)>,
    transfer: bool,
}

/// The oracle: a map of keys, the balances, and the rules written plainly.
struct Oracle {
    now: i64,
    keys: BTreeMap<ScopedKey, KeyModel>,
    balances: [i64; ACCOUNTS],
    transfers: i64,
    /// Transfers whose key was purged or expired.
    forgotten: i64,
    lease: i64,
    retention: i64,
}

/// The oracle's verdict on one request.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Expect {
    Answer(u16, bool, Option<String>),
    /// Executes under a fresh claim (the answer is the execution's).
    Execute,
}

impl Oracle {
    fn claim(&mut self, s: &Send) -> Expect {
        let k = key_of(s.client, s.key);
        let body = (s.src, s.dst, s.amount);
        if s.src == s.dst {
            return Expect::Answer(
                400,
                false,
                Some("invalid_request: src and dst must be different accounts".into()),
            );
        }
        let fresh = KeyModel {
            body,
            created: self.now,
            lease_until: Some(self.now + self.lease),
            answer: None,
            transfer: false,
        };
        match self.keys.get_mut(&k) {
            None => {
                self.keys.insert(k, fresh);
                Expect::Execute
            }
            Some(m) if m.created + self.retention <= self.now => {
                self.forgotten += i64::from(m.transfer);
                *m = fresh;
                Expect::Execute
            }
            Some(m) if m.body != body => Expect::Answer(422, false, Some("fingerprint_mismatch".into())),
            Some(KeyModel { answer: Some((status, reason)), .. }) => {
                Expect::Answer(*status, true, reason.clone())
            }
            Some(m) if m.lease_until.is_some_and(|l| self.now < l) => {
                Expect::Answer(409, false, Some("in_progress".into()))
            }
            Some(m) => {
                m.lease_until = Some(self.now + self.lease);
                Expect::Execute
            }
        }
    }

    /// Executes a claimed request; returns the first answer.
    fn execute(&mut self, s: &Send) -> (u16, Option<String>) {
        let (status, reason) = if s.src == GHOST {
            (404, Some("unknown_account".to_string()))
        } else if self.balances[s.src] < s.amount {
            (402, Some("insufficient_funds".to_string()))
        } else {
            self.balances[s.src] -= s.amount;
            self.balances[s.dst] += s.amount;
            self.transfers += 1;
            (201, None)
        };
        let m = self.keys.get_mut(&key_of(s.client, s.key)).expect("claimed");
        m.lease_until = None;
        m.answer = Some((status, reason.clone()));
        m.transfer = status == 201;
        (status, reason)
    }

    fn purge(&mut self, cut: i64) -> u64 {
        let before = self.keys.len();
        let mut forgotten = 0;
        self.keys.retain(|_, m| {
            let keep = m.created >= cut;
            forgotten += i64::from(!keep && m.transfer);
            keep
        });
        self.forgotten += forgotten;
        (before - self.keys.len()) as u64
    }
}

struct Run<'e> {
    engine: &'e mut dyn Engine,
    start: Timestamp,
    /// The first answer seen per key (reset when the key is forgotten).
    first: BTreeMap<ScopedKey, Response>,
    tokens: u64,
}

impl Run<'_> {
    fn now(&self, oracle: &Oracle) -> Timestamp {
        self.start.plus_seconds(oracle.now)
    }

    fn token(&mut self) -> String {
        self.tokens += 1;
        format!("t{}", self.tokens)
    }
}

fn check_answer(
    engine: &mut Run,
    s: &Send,
    got: &Response,
    want: (u16, bool, Option<String>),
) -> Result<(), TestCaseError> {
    let reason = got.reason.as_ref().map(|r| r.to_string());
    prop_assert_eq!((got.status, got.replay, reason), want.clone(), "request {:?}", s);
    let k = key_of(s.client, s.key);
    if got.replay {
        let reference = engine.first.entry(k).or_insert_with(|| Response { replay: false, ..got.clone() });
        prop_assert_eq!(&reference.body, &got.body, "replay bytes differ for {:?}", s);
        prop_assert_eq!(reference.status, got.status);
    } else if ![409, 422, 400].contains(&got.status) {
        engine.first.insert(k, got.clone());
    }
    if got.status == 201 && !got.replay {
        let body: serde_json::Value = serde_json::from_str(&got.body).unwrap();
        prop_assert_eq!(&body["amount"], &serde_json::json!(s.amount));
        prop_assert_eq!(&body["src"], &serde_json::json!(acct(s.src)));
    }
    Ok(())
}

/// A day on the real engine over a fresh in-memory SQLite database.
pub fn run_day(balances: [i64; ACCOUNTS], ops: Vec<Op>) -> Result<(), TestCaseError> {
    let accounts: Vec<(AcctId, i64)> =
        balances.iter().enumerate().map(|(i, b)| (AcctId::Text(acct(i)), *b)).collect();
    let mut store = sqlite_bank(&accounts, Policy::embedded()).unwrap();
    run_day_on(&mut store, balances, ops)
}

/// A day through `engine`, whose database holds exactly the accounts
/// `acct-0..` with `balances`, against the oracle.
pub fn run_day_on(
    engine: &mut dyn Engine,
    balances: [i64; ACCOUNTS],
    ops: Vec<Op>,
) -> Result<(), TestCaseError> {
    let policy = Policy::embedded();
    let mut engine = Run {
        engine,
        start: Timestamp::parse("2026-12-01T00:00:00Z").unwrap(),
        first: BTreeMap::new(),
        tokens: 0,
    };
    let mut oracle = Oracle {
        now: 0,
        keys: BTreeMap::new(),
        balances,
        transfers: 0,
        forgotten: 0,
        lease: i64::from(policy.in_progress_lease_seconds),
        retention: policy.retention_seconds(),
    };
    let total: i64 = balances.iter().sum();

    for op in &ops {
        let now = engine.now(&oracle);
        match op {
            Op::Send(s) => {
                let token = engine.token();
                let got = harness::send(engine.engine, &raw(s), Ctx { policy, now, token: &token }, None)
                    .unwrap()
                    .ok_or_else(|| TestCaseError::fail("crashed unasked"))?;
                let want = match oracle.claim(s) {
                    Expect::Answer(status, replay, reason) => (status, replay, reason),
                    Expect::Execute => {
                        let (status, reason) = oracle.execute(s);
                        (status, false, reason)
                    }
                };
                check_answer(&mut engine, s, &got, want)?;
            }
            Op::Crash(s, point) => {
                let token = engine.token();
                let got =
                    harness::send(engine.engine, &raw(s), Ctx { policy, now, token: &token }, Some(*point))
                        .unwrap();
                match (oracle.claim(s), got) {
                    (Expect::Answer(status, replay, reason), Some(r)) => {
                        check_answer(&mut engine, s, &r, (status, replay, reason))?
                    }
                    (Expect::Execute, None) => {
                        if *point == Point::AfterCommit {
                            oracle.execute(s);
                            engine.first.remove(&key_of(s.client, s.key));
                        }
                    }
                    (want, got) => {
                        return Err(TestCaseError::fail(format!(
                            "{s:?} {point:?}: oracle {want:?}, engine {got:?}"
                        )));
                    }
                }
            }
            Op::Together(sends) => {
                let tokens: Vec<String> = sends.iter().map(|_| engine.token()).collect();
                let raws: Vec<String> = sends.iter().map(raw).collect();
                let batch: Vec<_> = raws
                    .iter()
                    .zip(&tokens)
                    .map(|(r, token)| (r.as_str(), Ctx { policy, now, token }))
                    .collect();
                let answers = harness::together(engine.engine, &batch).unwrap();
                let verdicts: Vec<Expect> = sends.iter().map(|s| oracle.claim(s)).collect();
                for ((s, got), verdict) in sends.iter().zip(answers).zip(verdicts) {
                    let want = match verdict {
                        Expect::Answer(status, replay, reason) => (status, replay, reason),
                        Expect::Execute => {
                            let (status, reason) = oracle.execute(s);
                            (status, false, reason)
                        }
                    };
                    check_answer(&mut engine, s, &got, want)?;
                }
            }
            Op::Bad { client, key, amount } => {
                let k = key_of(*client, *key);
                let text = format!(
                    r#"{{"client_id":"{}","endpoint":"{}","idem_key":"{}","body":{{"src":"acct-0","dst":"acct-1","amount":{amount},"currency":"KRW"}}}}"#,
                    k.client_id, k.endpoint, k.idem_key
                );
                // Through the engine like any request: refused, and the key
                // stays as it was (the oracle's next verdicts check that).
                let token = engine.token();
                let got = harness::send(engine.engine, &text, Ctx { policy, now, token: &token }, None)
                    .unwrap()
                    .ok_or_else(|| TestCaseError::fail("crashed unasked"))?;
                prop_assert_eq!(got.status, 400, "amount {}: {:?}", amount, got);
                prop_assert!(
                    got.reason
                        .as_ref()
                        .map(|r| r.to_string())
                        .is_some_and(|r| r.starts_with("invalid_request: amount must be")),
                    "amount {}: {:?}",
                    amount,
                    got
                );
            }
            Op::Wait(seconds) => oracle.now += seconds,
            Op::Purge(back) => {
                let cut = oracle.now - back;
                let got = engine.engine.purge(engine.start.plus_seconds(cut), policy).unwrap();
                let want = oracle.purge(cut);
                prop_assert_eq!(got, want, "purge before now-{}", back);
                let forgotten: Vec<ScopedKey> =
                    engine.first.keys().filter(|k| !oracle.keys.contains_key(*k)).cloned().collect();
                for k in forgotten {
                    engine.first.remove(&k);
                }
            }
        }
        let audit = engine.engine.audit().unwrap();
        let got_balances: Vec<i64> =
            (0..ACCOUNTS).map(|i| audit.balance(&AcctId::Text(acct(i))).unwrap_or(i64::MIN)).collect();
        prop_assert_eq!(&got_balances[..], &oracle.balances[..], "balances after {:?}", op);
        prop_assert_eq!(audit.money(), total, "money not conserved");
        prop_assert_eq!(audit.transfers.len() as i64, oracle.transfers, "transfers after {:?}", op);
        prop_assert_eq!(audit.orphans.len() as i64, oracle.forgotten, "transfers without a completed key");
        prop_assert_eq!(audit.hollow, 0, "a completed 201 key without its transfer");
    }
    Ok(())
}
