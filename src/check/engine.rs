//! `idem check --engine`: a program of the lab's command-line contract,
//! judged on SQLite databases this module builds, each with its own random
//! accounts, balances, amounts and keys.
//!
//! What the lab fixes is judged as fixed: 201 for a new transfer with a
//! `transfer_id` (of any JSON type), 409 `in_progress`, 422 for another
//! body, 400 for a malformed request (its key not consumed), a replay with
//! the first status, `replay: true` and the raw text of `body` (and of
//! `status`, `reason`) unchanged, whatever the spacing of the envelope. What
//! it leaves open (the reason of a 400, the status of a business refusal)
//! comes from a [`Profile`], or else any stable 4xx is accepted.

pub use super::lab::{BrokenDatabase, Engine, Profile, Unparseable, command};

use super::CheckError;
use super::lab::{
    Answer, Bank, ENDPOINT, Envelope, Setting, expect_named_row, reordered, request, run_nonce,
};
use super::{Property, Trace, model, short};
use crate::rng::Rng;
use rusqlite::Connection;
use serde_json::Value;

/// Whether `status` is a refusal of the right class: the profile's status,
/// or without one any 4xx. Refusals are judged on fresh keys only, where a
/// 409 or a 422 cannot mean "in flight" or "another body": the lab names
/// no status for them, so each is a correct choice.
fn refusal_ok(status: i64, wanted: Option<u16>) -> bool {
    match wanted {
        Some(w) => status == i64::from(w),
        None => (400..500).contains(&status),
    }
}

fn expect_fresh(t: &mut Trace, answer: &Answer) -> Option<Envelope> {
    let e = answer.answered().cloned();
    let ok = e.as_ref().is_some_and(|e| e.fresh_201() && e.transfer_id().is_some());
    t.expect(ok, || "wanted 201, replay false, a transfer_id in the body, exit 0".into());
    e.filter(|_| ok)
}

fn fresh_transfer(t: &mut Trace, s: &Setting) -> Result<(), CheckError> {
    let first = s.bank.send(t, &s.request(&s.key, s.amount), &[])?;
    if let Some(e) = expect_fresh(t, &first) {
        expect_named_row(t, &e, &s.bank.ledger()?.1, s.amount);
    }
    s.bank.expect_ledger(t, &s.bank.moved(s.amount), 1)
}

fn replay_after_other_money_moved(t: &mut Trace, s: &Setting, reorder: bool) -> Result<(), CheckError> {
    let first = s.bank.send(t, &s.request(&s.key, s.amount), &[])?;
    let first = expect_fresh(t, &first);
    // money moves between the first answer and the retry: a replay rebuilt
    // from the ledger now cannot look like the first
    let other = s.bank.send(t, &s.request(&format!("{}-other", s.key), 7), &[])?;
    expect_fresh(t, &other);
    let text = match reorder {
        false => s.request(&s.key, s.amount),
        true => reordered(&s.client, ENDPOINT, &s.key, &s.a, &s.b, &s.amount.to_string()),
    };
    let again = s.bank.send(t, &text, &[])?;
    if let (Some(first), Some(again)) = (&first, again.answered()) {
        t.expect(again.replays(first), || {
            format!(
                "wanted the first answer replayed: status {}, replay true, body {}; got status {}, replay {}, body {}",
                first.raw_status,
                short(&first.raw_body),
                again.raw_status,
                again.replay,
                short(&again.raw_body)
            )
        });
    } else {
        t.expect(false, || "the retry did not answer an envelope with exit 0".into());
    }
    s.bank.expect_ledger(t, &s.bank.moved(s.amount + 7), 2)
}

fn mismatch(engine: &Engine, t: &mut Trace, s: &Setting) -> Result<(), CheckError> {
    s.bank.send(t, &s.request(&s.key, s.amount), &[])?;
    let other = s.bank.send(t, &s.request(&s.key, s.amount + 1), &[])?;
    let e = other.answered();
    t.expect(e.is_some_and(|e| e.status == 422 && !e.replay), || "wanted 422, replay false".into());
    if let (Some(e), Some(reason)) = (e, &engine.profile.mismatch_reason) {
        t.expect(e.reason.as_ref() == Some(reason), || {
            format!("the profile's mismatch reason is {reason:?}")
        });
    }
    s.bank.expect_ledger(t, &s.bank.moved(s.amount), 1)
}

fn crash_after_claim(engine: &Engine, t: &mut Trace, s: &Setting) -> Result<(), CheckError> {
    let crashed = s.bank.send(t, &s.request(&s.key, s.amount), &["--crash-after-claim"])?;
    t.expect(engine.profile.crashed(&crashed), || match engine.profile.crash_answers {
        Some(true) => "a crash must exit non-zero and answer no success".into(),
        Some(false) => "a crash must exit non-zero and answer nothing (the profile's)".into(),
        None => "a crash must exit non-zero, and answer nothing or no success".into(),
    });
    s.bank.expect_ledger(t, &s.bank.balances, 0)?;
    let retry = s.bank.send(t, &s.request(&s.key, s.amount), &[])?;
    t.expect(
        retry
            .answered()
            .is_some_and(|e| e.status == 409 && !e.replay && e.reason.as_deref() == Some("in_progress")),
        || "wanted 409 with reason in_progress".into(),
    );
    s.bank.expect_ledger(t, &s.bank.balances, 0)
}

/// Amounts that are no integer at all, in JSON: each must be a 400 that
/// leaves its key free.
const MALFORMED: [&str; 5] = ["-5", "1.5", "true", "null", "[1]"];
/// Amounts the lab does not forbid in words: each is a 400 (its key left
/// free) or a transfer of the amount as the engine reads it, unless the
/// profile declares which.
const OPEN: [(&str, i64); 3] = [("0", 0), ("1e3", 1000), ("\"100\"", 100)];
/// Amounts a careful engine may read as well-formed but unaffordable: a
/// 400 or a stored refusal.
const AMBIGUOUS: [&str; 2] = ["9007199254740992", "100000000000000000000000000000"];

fn malformed(engine: &Engine, t: &mut Trace, s: &Setting) -> Result<(), CheckError> {
    let p = &engine.profile;
    let invalid = |e: &Envelope| {
        e.status == 400
            && !e.replay
            && p.invalid_reason_prefix
                .as_ref()
                .is_none_or(|x| e.reason.as_deref().unwrap_or("").starts_with(x))
    };
    let (mut moved, mut rows) = (0, 0);
    let open = [p.amount_zero_valid, p.amount_exponent_valid, p.amount_digit_string_valid];
    let cases = MALFORMED.iter().map(|a| (*a, None, Some(false)));
    let cases = cases.chain(OPEN.iter().zip(open).map(|((a, v), declared)| (*a, Some(*v), declared)));
    for (n, (amount, value, declared)) in cases.chain(AMBIGUOUS.iter().map(|a| (*a, None, None))).enumerate()
    {
        let key = format!("{}-{n}", s.key);
        let answer = s.bank.send(t, &request(&s.client, ENDPOINT, &key, &s.a, &s.b, amount), &[])?;
        let e = answer.answered();
        let was_400 = e.is_some_and(invalid);
        let made = e.filter(|e| e.fresh_201());
        match (value, declared) {
            // no integer: a 400
            (None, Some(false)) => t.expect(was_400, || {
                format!("amount {amount} is not a positive integer: wanted 400{}", reason_note(engine))
            }),
            // an open form: as declared, or a 400 or a transfer of its value
            (Some(v), declared) => {
                t.expect(super::as_declared(declared, made.is_some(), was_400), || match declared {
                    Some(valid) => format!("amount {amount}: the profile says valid = {valid}"),
                    None => format!("amount {amount}: wanted a 400, or 201 moving {v}"),
                })
            }
            _ => t.expect(
                was_400 || e.is_some_and(|e| refusal_ok(e.status, p.insufficient_funds_status)),
                || format!("amount {amount} is beyond any balance: wanted 400 or a refusal"),
            ),
        };
        if let (Some(v), Some(_)) = (value, made) {
            moved += v;
            rows += 1;
        }
        if was_400 {
            // the key is free: the good request under it is new
            let good = s.bank.send(t, &s.request(&key, 1), &[])?;
            t.expect(good.answered().is_some_and(Envelope::fresh_201), || "the 400 consumed its key".into());
            moved += 1;
            rows += 1;
        }
    }
    for text in ["{not json", r#"{"client_id":"c","endpoint":"/e","idem_key":"k"}"#] {
        let answer = s.bank.send(t, text, &[])?;
        let answered = answer.answered().is_some_and(invalid);
        let exit_3 = answer.code == Some(3) && answer.envelope.is_none();
        let ok =
            super::as_declared(p.unparseable_request.map(|u| u == Unparseable::Answer400), answered, exit_3);
        t.expect(ok, || format!("wanted 400 with exit 0{}, or exit 3 unanswered", reason_note(engine)));
    }
    s.bank.expect_ledger(t, &s.bank.moved(moved), rows)
}

fn reason_note(engine: &Engine) -> String {
    engine
        .profile
        .invalid_reason_prefix
        .as_ref()
        .map_or(String::new(), |p| format!(", a reason starting {p:?}"))
}

fn refusals_stored(engine: &Engine, t: &mut Trace, s: &Setting) -> Result<(), CheckError> {
    let p = &engine.profile;
    let ghost = format!("ghost-{}", run_nonce());
    let cases = [
        (
            request(&s.client, ENDPOINT, &s.key, &ghost, &s.b, "1"),
            p.unknown_account_status,
            "unknown account",
        ),
        (
            s.request(&format!("{}-2", s.key), s.bank.balances[0] + 1),
            p.insufficient_funds_status,
            "insufficient funds",
        ),
    ];
    for (text, wanted, what) in cases {
        let first = s.bank.send(t, &text, &[])?;
        let refused = |e: &Envelope| refusal_ok(e.status, wanted) && !e.replay;
        let ok = first.answered().is_some_and(refused);
        t.expect(ok, || match wanted {
            Some(w) => format!("{what}: wanted {w} (the profile's)"),
            None => format!("{what}: wanted a 4xx refusal, replay false"),
        });
        // money moves between, so a refusal rebuilt from the ledger differs
        s.bank.send(t, &s.request(&format!("{}-{what}", s.key), 3), &[])?;
        let again = s.bank.send(t, &text, &[])?;
        let Some((first, again)) = first.answered().filter(|_| ok).zip(again.answered()) else { continue };
        // stored: replayed as it was; not stored: the same refusal, evaluated again
        let (stored, evaluated) = (again.replays(first), refused(again) && again.status == first.status);
        super::expect_refused_again(t, p.refusals_stored, stored, evaluated, what);
    }
    s.bank.expect_ledger(t, &s.bank.moved(6), 2)
}

fn scoped(t: &mut Trace, s: &Setting) -> Result<(), CheckError> {
    let one = s.bank.send(t, &s.request(&s.key, s.amount), &[])?;
    let others = [
        (
            request(
                &format!("{}-other", s.client),
                ENDPOINT,
                &s.key,
                &s.a,
                &s.b,
                &(s.amount + 1).to_string(),
            ),
            "client",
        ),
        (request(&s.client, "/v1/other", &s.key, &s.a, &s.b, &(s.amount + 2).to_string()), "endpoint"),
    ];
    let first = expect_fresh(t, &one);
    for (text, what) in others {
        let two = s.bank.send(t, &text, &[])?;
        let e = two.answered();
        t.expect(e.is_some_and(Envelope::fresh_201), || {
            format!("another {what}'s use of the key answered as if it were the first's")
        });
        if let (Some(first), Some(e)) = (&first, e) {
            t.expect(e.transfer_id() != first.transfer_id(), || format!("two {what}s share a transfer"));
        }
    }
    s.bank.expect_ledger(t, &s.bank.moved(3 * s.amount + 3), 3)
}

/// `at` written with a UTC offset of `hours`, as a client there would.
fn at_offset(at: crate::clock::Timestamp, hours: i64) -> String {
    let local = at.plus_seconds(hours * 3600).to_string();
    let sign = if hours < 0 { '-' } else { '+' };
    format!("{}{sign}{:02}:00", local.trim_end_matches('Z'), hours.abs())
}

fn purge(t: &mut Trace, s: &Setting) -> Result<(), CheckError> {
    use crate::clock::Timestamp;
    let early = format!("{}-early", s.key);
    let t1 = Timestamp::now();
    s.bank.send(t, &s.request(&early, 5), &[])?;
    std::thread::sleep(std::time::Duration::from_millis(2100));
    let t2 = Timestamp::now();
    s.bank.send(t, &s.request(&s.key, 6), &[])?;
    let t3 = Timestamp::now();
    // text order and time order disagree on each cut: +09:00 reads later
    // than it is, -09:00 earlier
    let cuts = [
        (at_offset(t1.plus_seconds(-3600), 9), 0, "an hour before both keys, written in +09:00"),
        (at_offset(t2.plus_millis(-500), -9), 1, "between the two keys, written in -09:00"),
        (at_offset(t3.plus_seconds(3600), 9), 1, "an hour after the second key, written in +09:00"),
    ];
    for (cut, want, what) in cuts {
        let out = s.bank.run(&["--purge-before".as_ref(), cut.as_ref()])?;
        t.step(format!("purge-before {cut} ({what}) -> {}", out.short()));
        let purged =
            serde_json::from_str::<Value>(out.stdout.trim()).ok().and_then(|v| v.get("purged")?.as_i64());
        t.expect(out.code == Some(0) && purged == Some(want), || {
            format!("wanted exit 0 and {{\"purged\": {want}}}")
        });
    }
    for key in [&early, &s.key] {
        let again = s.bank.send(t, &s.request(key, 7), &[])?;
        t.expect(again.answered().is_some_and(Envelope::fresh_201), || {
            "a purged key must be new again".into()
        });
    }
    s.bank.expect_ledger(t, &s.bank.moved(25), 4)
}

fn race_one_key(t: &mut Trace, s: &Setting) -> Result<(), CheckError> {
    const ROUNDS: usize = 6;
    for round in 0..ROUNDS {
        let text = s.request(&format!("{}-{round}", s.key), 1);
        let answers = s.bank.race(&vec![text; 5])?;
        let fresh: Vec<&Envelope> =
            answers.iter().filter_map(Answer::answered).filter(|e| e.fresh_201()).collect();
        t.step(format!(
            "round {round}: 5 processes at once on one key -> {}",
            answers.iter().map(|a| a.status().to_string()).collect::<Vec<_>>().join(", ")
        ));
        for a in answers.iter().filter(|a| a.answered().is_none()) {
            t.expect(false, || format!("a process did not answer: {}", a.short()));
        }
        t.expect(fresh.len() == 1, || format!("{} processes executed the same key", fresh.len()));
        if let Some(first) = fresh.first() {
            for e in answers.iter().filter_map(Answer::answered).filter(|e| !e.fresh_201()) {
                let ok = (e.status == 409 && e.reason.as_deref() == Some("in_progress")) || e.replays(first);
                t.expect(ok, || {
                    format!("an answer was neither 409 in_progress nor the replay: {}", short(&e.raw_body))
                });
            }
        }
    }
    s.bank.expect_ledger(t, &s.bank.moved(ROUNDS as i64), ROUNDS)
}

fn hot_account(t: &mut Trace, s: &Setting) -> Result<(), CheckError> {
    let texts: Vec<String> = (0..8).map(|p| s.request(&format!("{}-{p}", s.key), 7)).collect();
    let answers = s.bank.race(&texts)?;
    let ok = answers.iter().filter(|a| a.answered().is_some_and(Envelope::fresh_201)).count();
    t.step(format!("8 processes at once, 8 keys, one source account -> {ok} answered 201"));
    for a in answers.iter().filter(|a| a.answered().is_none()) {
        t.expect(false, || format!("a process did not answer: {}", a.short()));
    }
    let (balances, rows) = s.bank.ledger()?;
    t.expect(rows.len() == ok, || format!("{} transfers, {ok} answered 201", rows.len()));
    let want = s.bank.moved(7 * rows.len() as i64);
    t.expect(balances == want, || format!("balances {balances:?}, wanted {want:?}: an update was lost"));
    Ok(())
}

fn hostile(engine: &Engine, t: &mut Trace, s: &Setting) -> Result<(), CheckError> {
    let missing = s.bank.path("missing.json");
    let folder = s.bank.path("");
    for (path, what) in [(&missing, "a missing request file"), (&folder, "a directory as the request")] {
        let out = s.bank.run(&["--request".as_ref(), path.as_os_str()])?;
        t.step(format!("{what} -> {}", out.short()));
        t.expect(out.code == Some(3), || "wanted exit 3".into());
    }
    let broken = Bank::new(&engine.command, &mut Rng::new(engine.seed), 2)?;
    Connection::open(&broken.db)
        .and_then(|c| c.execute_batch("DROP TABLE account"))
        .map_err(|e| e.to_string())?;
    let out = broken.run(&["--request".as_ref(), broken.file(&s.request(&s.key, 1))?.as_os_str()])?;
    t.step(format!("a database without account -> {}", out.short()));
    let failed = out.code != Some(0) && out.envelope.is_none();
    let answered = out.answered().is_some_and(|e| e.status >= 400);
    let ok = super::as_declared(
        engine.profile.broken_database.map(|b| b == BrokenDatabase::Fail),
        failed,
        answered,
    );
    t.expect(ok, || "wanted a clean failure (non-zero, no answer) or an answer that is no success".into());
    Ok(())
}

macro_rules! property {
    ($name:expr, $contract:expr, $salt:expr, |$e:ident, $t:ident, $s:ident| $body:expr) => {
        Property {
            name: $name,
            contract: $contract,
            judge: |$e: &Engine, $t: &mut Trace| -> Result<(), CheckError> {
                let ($s, _) = Setting::new($e, $salt)?;
                let _ = &$e;
                $body
            },
        }
    };
}

/// The properties of the lab's contract, each with the sentence it rests on.
pub static PROPERTIES: [Property<Engine>; 13] = [
    property!(
        "a new key moves the money once and answers 201",
        "lab, notes: if it was newly executed, it is status 201 and replay false, and body holds a transfer_id",
        1,
        |e, t, s| fresh_transfer(t, &s)
    ),
    property!(
        "a retry replays the first answer byte for byte, even after other money moved",
        "lab step 6: the status is the same as the first response, replay is true, and the body must not differ by a single character; replay is not recomputing",
        2,
        |e, t, s| replay_after_other_money_moved(t, &s, false)
    ),
    property!(
        "a retry with members reordered and re-spaced replays",
        "lab step 4: the same body with only the field order different is the same request (RFC 8785: key sorting and whitespace removal)",
        3,
        |e, t, s| replay_after_other_money_moved(t, &s, true)
    ),
    property!(
        "the same key with another amount is 422 and moves nothing",
        "lab step 4: reject with 422 when the same key comes with a different body",
        4,
        |e, t, s| mismatch(e, t, &s)
    ),
    property!(
        "a retry after a crash after the claim is 409 in_progress and moves nothing",
        "lab step 5: --crash-after-claim must claim only and end with a nonzero code without a transfer (whether it prints a failure first is open: profile crash_answers); a retry of an in-progress key is 409 with the reason in_progress",
        5,
        |e, t, s| crash_after_claim(e, t, &s)
    ),
    property!(
        "a malformed request is 400 and does not consume its key",
        "lab notes, request JSON: \"amount\": integer; DESIGN §1: a malformed request (an amount that is no integer, not JSON, a missing field) is 400 and its key not consumed. Open (profile): 0, 1e3 and \"100\" as amounts; a file that is not a request answered 400 or exit 3 (the lab's exit for a file that cannot be read)",
        6,
        |e, t, s| malformed(e, t, &s)
    ),
    property!(
        "unknown accounts and insufficient funds are refused, and a retry gets that refusal again",
        "lab step 6: a retry of a completed key replays the stored response (whether a refusal completes its key is open: profile refusals_stored); the refusal's 4xx is the implementation's (profile)",
        7,
        |e, t, s| refusals_stored(e, t, &s)
    ),
    property!(
        "keys are scoped by (client_id, endpoint, idem_key)",
        "lab step 7: widen the key scope to (client_id, endpoint, idem_key); another client's or endpoint's use of one key string is its own request",
        8,
        |e, t, s| scoped(t, &s)
    ),
    property!(
        "purge deletes exactly the keys created before the cut, read as an instant",
        "lab step 7: --purge-before <RFC 3339 instant> deletes keys older than that and prints {\"purged\": N}; after purge the same request is new",
        9,
        |e, t, s| purge(t, &s)
    ),
    property!(
        "processes released together on one key pay once, and every one answers",
        "lab step 5: the grader sends two retries that arrive at the same moment; exactly one of the two must be newly executed",
        10,
        |e, t, s| race_one_key(t, &s)
    ),
    property!(
        "a burst on one hot account loses no update, and every process answers",
        "lab notes (locking): BEGIN IMMEDIATE where writing is certain, PRAGMA busy_timeout for waiting; the execution contract: one JSON answer, exit 0",
        11,
        |e, t, s| hot_account(t, &s)
    ),
    property!(
        "hostile inputs: unreadable files exit 3, a broken database is no success",
        "execution contract: if the request file cannot be read, the exit code is 3; a database that cannot be used is a failure (non-zero, no answer) or an answer that is no success (open: profile broken_database)",
        12,
        |e, t, s| hostile(e, t, &s)
    ),
    property!(
        "random days agree with a plain model of the contract (shrunk on failure)",
        "all of the above at once: every answer, the transfer table and the balances after each step of a random day",
        13,
        |e, t, s| model::random_days(e, t, &s)
    ),
];
