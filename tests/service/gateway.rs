//! `idem gateway`, the outside service payouts go through: a real process on
//! loopback, spoken to over HTTP, its ledger read from its own file. Each
//! test asserts what a gateway that paid twice, lost a payout or forgot too
//! early would get wrong.

use crate::server::{Gateway, IDEM};
use std::process::Command;
use std::time::{Duration, Instant};

const BODY: &str = r#"{"beneficiary":"acct-7","amount":500,"currency":"KRW"}"#;

#[test]
fn a_retried_payout_is_paid_once_and_every_retry_gets_its_state() {
    let gw = Gateway::start(&["--limit", "1000"]);
    let (status, first) = gw.pay("p-1", BODY, None).unwrap();
    assert_eq!((status, first["status"].as_str()), (201, Some("paid")));
    // the same payout spelled in another order is the same payout
    let again = gw.pay("p-1", r#"{"currency":"KRW","amount":500,"beneficiary":"acct-7"}"#, None).unwrap();
    assert_eq!(again, (201, first.clone()));
    // another payout under the key is refused and pays nothing
    let other = gw.pay("p-1", r#"{"beneficiary":"acct-7","amount":501,"currency":"KRW"}"#, None).unwrap();
    assert_eq!((other.0, other.1["error"].as_str()), (400, Some("idempotency_key_reused")));
    // definitive refusals are recorded and replayed as they were
    let closed = r#"{"beneficiary":"closed-9","amount":5,"currency":"KRW"}"#;
    let refused = gw.pay("p-2", closed, None).unwrap();
    assert_eq!((refused.0, refused.1["reason"].as_str()), (402, Some("account_closed")));
    assert_eq!(gw.pay("p-2", closed, None).unwrap(), refused);
    let big = gw.pay("p-3", r#"{"beneficiary":"acct-7","amount":1001,"currency":"KRW"}"#, None).unwrap();
    assert_eq!((big.0, big.1["reason"].as_str()), (422, Some("amount_over_limit")));
    // a malformed request records nothing and leaves its key free
    for bad in [r#"{"beneficiary":"a","amount":5.5,"currency":"KRW"}"#, r#"{"amount":5}"#, "nope", "[]"] {
        assert_eq!(gw.pay("p-4", bad, None).unwrap().0, 400, "{bad}");
    }
    assert_eq!(gw.pay("p-4", BODY, None).unwrap().0, 201);
    assert_eq!(gw.look("p-1"), (200, first));
    assert_eq!(gw.look("p-9").0, 404);
    assert_eq!(
        gw.ledger(),
        [
            ("p-1".into(), 500, "paid".into()),
            ("p-2".into(), 5, "failed".into()),
            ("p-3".into(), 1001, "failed".into()),
            ("p-4".into(), 500, "paid".into()),
        ]
    );
}

#[test]
fn faults_lose_or_garble_answers_never_the_ledger() {
    // recorded, then closed unanswered: the caller cannot tell it was paid
    let dropped = Gateway::start(&["--drop-answer", "100"]);
    assert_eq!(dropped.pay("d-1", BODY, None), None);
    assert_eq!(dropped.look("d-1").1["status"], "paid");
    assert_eq!(dropped.pay("d-1", BODY, None), None, "every answer is dropped, retries' too");
    assert_eq!(dropped.ledger(), [("d-1".into(), 500, "paid".into())]);
    // recorded, then 500
    let erring = Gateway::start(&["--error-5xx", "100"]);
    assert_eq!(erring.pay("e-1", BODY, None).unwrap().0, 500);
    assert_eq!(erring.look("e-1").1["status"], "paid");
    assert_eq!(erring.ledger(), [("e-1".into(), 500, "paid".into())]);
    // never arrived: nothing recorded, the lookup finds nothing
    let losing = Gateway::start(&["--lose-request", "100"]);
    assert_eq!(losing.pay("l-1", BODY, None), None);
    assert_eq!(losing.look("l-1").0, 404);
    assert!(losing.ledger().is_empty());
    // a seeded mix is the same mix on every run
    let fates = |seed: &str| {
        let gw = Gateway::start(&["--seed", seed, "--drop-answer", "30", "--error-5xx", "30"]);
        (0..40).map(|i| gw.pay(&format!("m-{i}"), BODY, None).map(|(s, _)| s)).collect::<Vec<_>>()
    };
    let first = fates("7");
    assert_eq!(first, fates("7"));
    assert!(first.contains(&None) && first.contains(&Some(500)) && first.contains(&Some(201)), "{first:?}");
}

#[test]
fn a_slow_payout_is_pending_until_it_settles() {
    let gw = Gateway::start(&["--slow", "100", "--slow-for", "1500ms"]);
    let started = Instant::now();
    std::thread::scope(|s| {
        let first = s.spawn(|| gw.pay("s-1", BODY, None));
        std::thread::sleep(Duration::from_millis(400));
        assert_eq!(gw.look("s-1").1["status"], "pending");
        let retry = gw.pay("s-1", BODY, None).unwrap();
        assert_eq!((retry.0, retry.1["status"].as_str()), (409, Some("pending")));
        let (status, answer) = first.join().unwrap().unwrap();
        assert_eq!((status, answer["status"].as_str()), (201, Some("paid")));
    });
    assert!(started.elapsed() >= Duration::from_millis(1500));
    assert_eq!(gw.look("s-1").1["status"], "paid");
    assert_eq!(gw.ledger(), [("s-1".into(), 500, "paid".into())]);
}

#[test]
fn lookups_lag_and_a_key_past_its_window_pays_again() {
    let gw = Gateway::start(&["--lookup-delay", "600ms", "--key-window", "2s"]);
    assert_eq!(gw.pay("w-1", BODY, None).unwrap().0, 201);
    // eventual consistency: paid, yet not found at first
    assert_eq!(gw.look("w-1").0, 404);
    std::thread::sleep(Duration::from_millis(700));
    assert_eq!(gw.look("w-1").1["status"], "paid");
    // inside the window a retry is a replay; past it, the key is new again
    assert_eq!(gw.pay("w-1", BODY, None).unwrap().0, 201);
    assert_eq!(gw.ledger().len(), 1);
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(gw.look("w-1").0, 404, "a forgotten key is not found");
    assert_eq!(gw.pay("w-1", BODY, None).unwrap().0, 201);
    assert_eq!(gw.ledger(), [("w-1".into(), 500, "paid".into()), ("w-1".into(), 500, "paid".into())]);
}

#[test]
fn a_gateway_with_a_token_refuses_other_callers_before_recording() {
    let gw = Gateway::start(&["--token", "s3cret"]);
    assert_eq!(gw.pay("t-1", BODY, None).unwrap().0, 401);
    assert_eq!(gw.pay("t-1", BODY, Some("wrong")).unwrap().0, 401);
    assert!(gw.ledger().is_empty());
    assert_eq!(gw.pay("t-1", BODY, Some("s3cret")).unwrap().0, 201);
    // bad arguments are a usage error, not a half-started gateway
    let out = Command::new(IDEM)
        .args(["gateway", "--db", "/nonexistent/dir/g.db", "--listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1), "{}", String::from_utf8_lossy(&out.stderr));
    let out = Command::new(IDEM)
        .args(["gateway", "--db", "g.db", "--drop-answer", "60", "--error-5xx", "60"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("more than 100"));
}
