//! Random days of a few clients, keys and accounts through an engine, each
//! answer judged against a plain model of the contract: a map from scoped
//! key to the first body and the first answer, and the balances. A failing
//! day is shrunk, one step at a time, to the shortest day that still fails.

use super::CheckError;
use super::lab::{Answer, Bank, Engine, Envelope, Profile, Setting, expect_named_row, reordered, request};
use super::{Trace, short};
use crate::rng::Rng;
use std::collections::BTreeMap;

/// One step: a request by client `client` under key `key` moving `amount`
/// from account `src` to `dst`, sent plainly, reordered, or crashed after
/// its claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Op {
    client: u8,
    key: u8,
    src: usize,
    dst: usize,
    amount: i64,
    style: Style,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Style {
    Plain,
    Reordered,
    CrashAfterClaim,
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
        style: style(rng),
    }
}

fn style(rng: &mut Rng) -> Style {
    match rng.below(5) {
        0 => Style::Reordered,
        4 => Style::CrashAfterClaim,
        _ => Style::Plain,
    }
}

/// More than three accounts hold together (each under 1 000 000): a
/// request no source can pay.
const UNPAYABLE: i64 = 5_000_000;

/// Beside what the dice bring, every day holds, each at a random place
/// under keys of its own (3 to 7: the dice use 0 to 2): a request from an
/// account that does not exist, and its crash; one its source cannot pay;
/// a crash after the claim, retried at once; and a transfer, other money
/// from the same source, the transfer's retry reordered, its key under
/// another amount and under an account that does not exist, and its crash.
/// So a verdict on what one of them judges does not hang on the seed.
fn cover(rng: &mut Rng, day: &mut Vec<Op>, accounts: usize) {
    let (src, dst) = (rng.below(accounts as u64) as usize, rng.below(accounts as u64 - 1) as usize);
    let dst = (src + 1 + dst) % accounts;
    let unknown =
        Op { client: rng.below(2) as u8, key: 3, src: accounts, dst, amount: 100, style: Style::Plain };
    let unpayable = Op { key: 4, src, amount: UNPAYABLE, ..unknown };
    let crash = Op { key: 5, src, style: Style::CrashAfterClaim, ..unknown };
    let pay = Op { key: 6, src, ..unknown };
    let crashed = |op: Op| Op { style: Style::CrashAfterClaim, ..op };
    let blocks = [
        vec![unknown, crashed(unknown)],
        vec![unpayable],
        vec![crash, Op { style: Style::Plain, ..crash }],
        vec![
            pay,
            Op { key: 7, ..pay },
            Op { style: Style::Reordered, ..pay },
            Op { amount: 101, ..pay },
            Op { src: accounts, ..pay },
            crashed(pay),
        ],
    ];
    for ops in blocks {
        let at = rng.below(day.len() as u64 + 1) as usize;
        day.splice(at..at, ops);
    }
}

/// The engine's random days; the first that fails is shrunk and reported.
pub fn random_days(engine: &Engine, t: &mut Trace, setting: &Setting) -> Result<(), CheckError> {
    let mut rng = Rng::new(engine.seed ^ 0x5eed);
    let choices = Choices::settle(engine, setting, &mut rng)?;
    for _ in 0..engine.days {
        // half the steps retry an earlier one, as clients do, in another
        // style; a crashed request is retried at once, as its client would,
        // so every day that crashes also judges what a crash left behind
        let mut day: Vec<Op> = Vec::new();
        while day.len() < 10 {
            let op = match day.len() {
                n if n > 0 && rng.below(2) == 0 => {
                    Op { style: style(&mut rng), ..day[rng.below(n as u64) as usize] }
                }
                _ => random_op(&mut rng, 3),
            };
            day.push(op);
            if op.style == Style::CrashAfterClaim {
                day.push(Op { style: Style::Plain, ..op });
            }
        }
        cover(&mut rng, &mut day, 3);
        let seed = rng.next_u64();
        if let (Some(at), steps) = run_day(engine, &choices, setting, &day, seed)? {
            day.truncate(at + 1);
            let (day, steps) = shrink(engine, &choices, setting, day, seed, steps)?;
            t.step(format!("(shrunk to {} step(s))", day.len()));
            for step in steps {
                t.step(step);
            }
            t.expect(false, || "the day above disagrees with the model".into());
            return Ok(());
        }
    }
    Ok(())
}

/// The choices the lab leaves open that change what a day's key holds, as
/// the profile declares them or, where it is silent, as the engine shows
/// them on a bank of its own before the days. A day then judges every
/// answer by one rule: no answer is read two ways, and an engine that
/// changes its mind mid-day fails.
#[derive(Debug, Clone, Copy)]
struct Choices {
    /// Whether a refusal completes its key: of an unknown account, of funds.
    stored: [bool; 2],
    /// Whether an unknown account is refused before the key is looked at.
    accounts_first: bool,
    /// Whether `--crash-after-claim` on a used key crashes (else it answers).
    crash_on_used: bool,
}

impl Choices {
    fn settle(engine: &Engine, setting: &Setting, rng: &mut Rng) -> Result<Choices, CheckError> {
        let p = &engine.profile;
        let bank = Bank::new(&engine.command, rng, 3)?;
        let mut t = Trace::default();
        let client = format!("{}-choices", setting.client);
        let (a, b) = (bank.ids[0].as_str(), bank.ids[1].as_str());
        let mut send = |key: &str, src: &str, amount: i64, extra: &[&str]| {
            let text = request(&client, super::lab::ENDPOINT, key, src, b, &amount.to_string());
            bank.send(&mut t, &text, extra)
        };
        let mut replays = |key: &str, src: &str, amount: i64| -> Result<bool, CheckError> {
            let (first, again) = (send(key, src, amount, &[])?, send(key, src, amount, &[])?);
            Ok(matches!((first.answered(), again.answered()), (Some(f), Some(g)) if g.replays(f)))
        };
        let stored = [
            p.refusals_stored.map_or_else(|| replays("unknown", "nobody", 100), Ok)?,
            p.refusals_stored.map_or_else(|| replays("unpayable", a, UNPAYABLE), Ok)?,
        ];
        // a used key, for the two choices that need one (if either is open)
        let undeclared = p.accounts_before_claim.is_none() || p.crash_on_used_key.is_none();
        let paid = if undeclared { Some(send("paid", a, 100, &[])?) } else { None };
        let accounts_first = match p.accounts_before_claim {
            Some(d) => d,
            None => {
                let other = send("paid", "nobody", 100, &[])?;
                paid.as_ref().and_then(Answer::answered).is_some_and(|e| e.fresh_201())
                    && other.answered().is_some_and(|e| {
                        refusal(e, p.unknown_account_status) && !matches!(e.status, 409 | 422)
                    })
            }
        };
        let crash_on_used = match p.crash_on_used_key {
            Some(d) => d,
            None => p.crashed(&send("paid", a, 100, &["--crash-after-claim"])?),
        };
        Ok(Choices { stored, accounts_first, crash_on_used })
    }
}

/// Removes steps while the day still fails; returns the shortest failing
/// day and its steps.
fn shrink(
    engine: &Engine,
    choices: &Choices,
    setting: &Setting,
    mut day: Vec<Op>,
    seed: u64,
    mut steps: Vec<String>,
) -> Result<(Vec<Op>, Vec<String>), CheckError> {
    let mut i = day.len();
    while i > 0 {
        i -= 1;
        let mut shorter = day.clone();
        shorter.remove(i);
        if let (Some(at), fewer) = run_day(engine, choices, setting, &shorter, seed)? {
            shorter.truncate(at + 1);
            (day, steps) = (shorter, fewer);
            i = i.min(day.len());
        }
    }
    Ok((day, steps))
}

/// What a key holds in the model: its first body, and its first answer
/// (`None` while a crashed claim holds it).
type Held = ((usize, usize, i64), Option<Envelope>);

/// The contract as a plain model: the balances, what each key holds, and
/// the choices the engine declared or showed.
struct Model<'a> {
    balances: Vec<i64>,
    keys: BTreeMap<(u8, u8), Held>,
    transfers: usize,
    accounts: usize,
    profile: &'a Profile,
    choices: Choices,
}

/// Runs one day on a fresh bank up to its first failing step; returns that
/// step's index, if one failed, and the steps taken.
fn run_day(
    engine: &Engine,
    choices: &Choices,
    setting: &Setting,
    day: &[Op],
    seed: u64,
) -> Result<(Option<usize>, Vec<String>), CheckError> {
    let mut rng = Rng::new(seed);
    let bank = Bank::new(&engine.command, &mut rng, 3)?;
    let mut model = Model {
        balances: bank.balances.clone(),
        keys: BTreeMap::new(),
        transfers: 0,
        accounts: bank.ids.len(),
        profile: &engine.profile,
        choices: *choices,
    };
    let mut t = Trace::default();
    let id = |i: usize| bank.ids.get(i).cloned().unwrap_or_else(|| format!("nobody-{}", bank.ids.len()));
    for (i, op) in day.iter().enumerate() {
        let client = format!("{}-day-{}", setting.client, op.client);
        let key = format!("{}-day-{}", setting.key, op.key);
        let (src, dst, amount) = (id(op.src), id(op.dst), op.amount.to_string());
        let text = match op.style {
            Style::Reordered => reordered(&client, super::lab::ENDPOINT, &key, &src, &dst, &amount),
            _ => request(&client, super::lab::ENDPOINT, &key, &src, &dst, &amount),
        };
        let crash = op.style == Style::CrashAfterClaim;
        let answer = bank.send(&mut t, &text, if crash { &["--crash-after-claim"] } else { &[] })?;
        model.judge(&mut t, op, &answer);
        let (now, rows) = bank.ledger()?;
        if let Some(e) = answer.answered().filter(|e| e.fresh_201() && !crash) {
            expect_named_row(&mut t, e, &rows, op.amount);
        }
        t.expect(now == model.balances && rows.len() == model.transfers, || {
            format!(
                "the ledger is {now:?} with {} transfers; the model says {:?} with {}",
                rows.len(),
                model.balances,
                model.transfers
            )
        });
        if t.failures > 0 {
            // what follows cannot undo the failure: the day ends here
            return Ok((Some(i), t.steps));
        }
    }
    Ok((None, t.steps))
}

impl Model<'_> {
    /// Judges `answer` to `op` and moves the model on.
    fn judge(&mut self, t: &mut Trace, op: &Op, answer: &Answer) {
        let crash = op.style == Style::CrashAfterClaim;
        let e = answer.answered();
        let body = (op.src, op.dst, op.amount);
        let k = (op.client, op.key);
        if op.src >= self.accounts && self.choices.accounts_first {
            // refused before the key is looked at: whatever it holds stays
            let ok = e.is_some_and(|e| refusal(e, self.profile.unknown_account_status))
                || (crash && self.profile.crashed(answer));
            t.expect(ok, || "an unknown account, looked up before the claim (accounts_before_claim): wanted a refusal, replay false".into());
            return;
        }
        // a refusal that is not stored left its key free
        let held = self.keys.get(&k).cloned().filter(|(first, answer)| {
            !answer.as_ref().is_some_and(is_refusal)
                || self.choices.stored[usize::from(first.0 < self.accounts)]
        });
        match held {
            None => self.first_use(t, op, answer),
            Some(_) if crash && self.choices.crash_on_used => {
                t.expect(self.profile.crashed(answer), || {
                    "--crash-after-claim on a used key: wanted a crash (crash_on_used_key, declared or shown first)".into()
                });
            }
            Some((first, None)) => {
                let wanted = self.profile.in_flight_mismatch_status;
                let ok = match first == body {
                    true => {
                        e.is_some_and(|e| e.status == 409 && e.reason.as_deref() == Some("in_progress"))
                            || (crash && self.profile.crashed(answer))
                    }
                    false => e.is_some_and(|e| {
                        wanted.map_or(matches!(e.status, 409 | 422), |w| e.status == i64::from(w))
                    }),
                };
                t.expect(ok, || match (first == body, wanted) {
                    (true, _) => "a retry of a claimed key: wanted 409 in_progress".into(),
                    (false, Some(w)) => {
                        format!("another body under a key in flight: wanted {w} (the profile's)")
                    }
                    (false, None) => "another body under a key in flight: wanted 409 or 422".into(),
                });
            }
            Some((first, Some(done))) => self.settled(t, first == body, e, &done),
        }
    }

    /// A retry of a settled key: the first answer replayed, or 422 for another body.
    fn settled(&self, t: &mut Trace, same: bool, e: Option<&Envelope>, first: &Envelope) {
        match same {
            true => t.expect(e.is_some_and(|e| e.replays(first)), || {
                format!("a retry of a completed key: wanted {} replayed as it was", short(&first.raw_body))
            }),
            false => t.expect(e.is_some_and(|e| e.status == 422), || {
                "another body under a used key: wanted 422".into()
            }),
        };
    }

    /// A key's first use (or a use after a refusal that left it free).
    fn first_use(&mut self, t: &mut Trace, op: &Op, answer: &Answer) {
        let body = (op.src, op.dst, op.amount);
        if op.style == Style::CrashAfterClaim {
            t.expect(self.profile.crashed(answer), || {
                "a crash after the claim ended as the lab and the profile do not say".into()
            });
            self.keys.insert((op.client, op.key), (body, None));
            return;
        }
        let e = answer.answered();
        let (ok, wanted) =
            first_use(e, op, self.accounts, &mut self.balances, &mut self.transfers, self.profile);
        t.expect(ok, || format!("a new key: wanted {wanted}"));
        self.keys.insert((op.client, op.key), (body, e.cloned()));
    }
}

/// Whether a key's first answer was a refusal: any 4xx (a first answer is
/// never "in flight" or "another body").
fn is_refusal(e: &Envelope) -> bool {
    (400..500).contains(&e.status)
}

/// A key's first use, not crashed: the model moves the money if it may
/// (`balances`, `transfers`); whether the answer `e` is what it wants, and
/// what that is.
fn first_use(
    e: Option<&Envelope>,
    op: &Op,
    accounts: usize,
    balances: &mut [i64],
    transfers: &mut usize,
    p: &Profile,
) -> (bool, &'static str) {
    if op.src >= accounts {
        (e.is_some_and(|e| refusal(e, p.unknown_account_status)), "a refusal, replay false (unknown account)")
    } else if balances[op.src] < op.amount {
        (
            e.is_some_and(|e| refusal(e, p.insufficient_funds_status)),
            "a refusal, replay false (insufficient funds)",
        )
    } else {
        balances[op.src] -= op.amount;
        balances[op.dst] += op.amount;
        *transfers += 1;
        (e.is_some_and(|e| e.fresh_201()), "201, replay false")
    }
}

/// A refusal of the right class (see `engine::refusal_ok`), not a replay.
fn refusal(e: &Envelope, wanted: Option<u16>) -> bool {
    !e.replay && wanted.map_or((400..500).contains(&e.status), |w| e.status == i64::from(w))
}
