//! policy.json and the engine must agree: each published number is checked
//! against what the real binary does, reading the file from disk (not the
//! copy compiled in), so editing one without the other turns this red.

use crate::common::*;
use idem::clock::Timestamp;
use serde_json::{Value, json};

fn policy() -> Value {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../policy.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn num(p: &Value, field: &str) -> i64 {
    p[field].as_i64().unwrap_or_else(|| panic!("policy.json: {field}"))
}

const EP: &str = "/v1/transfers";
const T0: &str = "2026-12-01T00:00:00Z";

fn at(seconds: i64) -> String {
    Timestamp::parse(T0).unwrap().plus_seconds(seconds).to_string()
}

/// `policy.json` may promise only what the engine reads: every field on
/// disk survives a round trip through the engine's `Policy` with its value.
#[test]
fn every_policy_field_is_one_the_engine_reads() {
    let p = policy();
    let parsed: idem::policy::Policy = serde_json::from_value(p.clone()).unwrap();
    assert_eq!(serde_json::to_value(&parsed).unwrap(), p);
    let mut extra = p.clone();
    extra["max_retries"] = json!(3);
    assert!(serde_json::from_value::<idem::policy::Policy>(extra).is_err(), "an unread field was accepted");
}

#[test]
fn statuses_are_the_published_ones() {
    let p = policy();
    let mut rng = rng();
    let bank = Bank::new(&mut rng, 2, false);
    let (s, d) = (&bank.accounts[0], &bank.accounts[1]);
    let first = request("c", EP, "k", s, d, 1);
    assert_eq!(bank.send(&first).status(), 201);
    assert_eq!(bank.send(&request("c", EP, "k", s, d, 2)).status(), num(&p, "on_fingerprint_mismatch"));
    assert_eq!(bank.send("{}").status(), num(&p, "on_invalid_request"));
    let ghost = json!("nobody");
    assert_eq!(bank.send(&request("c", EP, "k2", s, &ghost, 1)).status(), num(&p, "on_unknown_account"));
    assert_eq!(
        bank.send(&request("c", EP, "k3", s, d, i64::from(u32::MAX))).status(),
        num(&p, "on_insufficient_funds")
    );
    let crash = bank
        .command(&bank.request_file(&request("c", EP, "k4", s, d, 1)))
        .arg("--crash-after-claim")
        .output()
        .unwrap();
    assert!(!crash.status.success());
    assert_eq!(bank.send(&request("c", EP, "k4", s, d, 1)).status(), num(&p, "on_in_flight"));
}

#[test]
fn scope_is_the_published_fields() {
    let p = policy();
    assert_eq!(p["scope"], json!(["client_id", "endpoint", "idem_key"]));
    let mut rng = rng();
    let bank = Bank::new(&mut rng, 2, false);
    let (s, d) = (&bank.accounts[0], &bank.accounts[1]);
    // changing any one scope field makes a new key
    for (c, e, k) in [("c", EP, "k"), ("c2", EP, "k"), ("c", "/e2", "k"), ("c", EP, "k2")] {
        let r = bank.send(&request(c, e, k, s, d, 1));
        assert_eq!((r.status(), r.replay()), (201, false), "{c} {e} {k}");
    }
}

#[test]
fn keys_expire_after_retention_hours() {
    let retention = num(&policy(), "retention_hours") * 3600;
    let mut rng = rng();
    let bank = Bank::new(&mut rng, 2, false);
    let text = request("c", EP, "k", &bank.accounts[0], &bank.accounts[1], 1);
    assert_eq!(bank.send_with(&text, &[("IDEM_NOW", &at(0))]).status(), 201);
    let inside = bank.send_with(&text, &[("IDEM_NOW", &at(retention - 1))]);
    assert!(inside.replay(), "still retained one second before the end");
    let after = bank.send_with(&text, &[("IDEM_NOW", &at(retention))]);
    assert_eq!((after.status(), after.replay()), (201, false), "expired at retention");
    assert_eq!(bank.transfers().len(), 2);
}

#[test]
fn a_dead_claim_blocks_its_key_for_the_lease_then_is_taken_over() {
    let lease = num(&policy(), "in_progress_lease_seconds");
    let mut rng = rng();
    let bank = Bank::new(&mut rng, 2, false);
    let text = request("c", EP, "k", &bank.accounts[0], &bank.accounts[1], 1);
    let crash = bank
        .command(&bank.request_file(&text))
        .arg("--crash-after-claim")
        .env("IDEM_NOW", at(0))
        .output()
        .unwrap();
    assert!(!crash.status.success());
    assert_eq!(bank.send_with(&text, &[("IDEM_NOW", &at(lease - 1))]).status(), 409);
    let taken = bank.send_with(&text, &[("IDEM_NOW", &at(lease))]);
    assert_eq!((taken.status(), taken.replay()), (201, false));
    assert_eq!(bank.transfers().len(), 1);
}

#[test]
fn limits_are_the_published_ones() {
    let p = policy();
    let mut rng = rng();
    let bank = Bank::new(&mut rng, 2, false);
    let (s, d) = (&bank.accounts[0], &bank.accounts[1]);
    let max_amount = num(&p, "max_amount");
    let over = bank.send(&request("c", EP, "k", s, d, max_amount + 1));
    assert!(over.reason().unwrap().contains(&format!("no greater than {max_amount}")));
    let max_chars = num(&p, "max_field_chars") as usize;
    assert_eq!(bank.send(&request("c", EP, &"k".repeat(max_chars + 1), s, d, 1)).status(), 400);
    assert_eq!(bank.send(&request("c", EP, &"k".repeat(max_chars), s, d, 1)).status(), 201);
    let max_bytes = num(&p, "max_request_bytes") as usize;
    let text = request("c", EP, "pad", s, d, 1);
    let padded = format!("{text}{}", " ".repeat(max_bytes - text.len()));
    assert_eq!(bank.send(&padded).status(), 201);
    let r = bank.send(&format!("{padded} "));
    assert!(r.reason().unwrap().contains(&format!("larger than {max_bytes} bytes")));
    for c in p["currencies"].as_array().unwrap() {
        let r = bank.send(&request("c", EP, "k-cur", s, d, 1).replace("\"KRW\"", &c.to_string()));
        assert_eq!(r.status(), 201, "{c}");
    }
}

#[test]
fn a_lock_held_past_busy_timeout_answers_503_and_consumes_nothing() {
    let p = policy();
    let mut rng = rng();
    let bank = Bank::new(&mut rng, 2, false);
    let text = request("c", EP, "k", &bank.accounts[0], &bank.accounts[1], 1);
    assert_eq!(
        bank.send(&request("c", EP, "warm-up", &bank.accounts[0], &bank.accounts[1], 1)).status(),
        201
    );
    let before = bank.balances();
    let holder = rusqlite::Connection::open(&bank.db).unwrap();
    holder.execute_batch("BEGIN IMMEDIATE").unwrap();
    let started = std::time::Instant::now();
    let r = bank.send(&text);
    let waited = started.elapsed().as_millis() as i64;
    holder.execute_batch("ROLLBACK").unwrap();
    assert_eq!((r.status(), r.reason()), (num(&p, "on_busy"), Some("busy")));
    assert!(waited >= num(&p, "busy_timeout_ms"), "gave up after {waited} ms");
    assert_eq!(bank.balances(), before);
    assert_eq!((bank.send(&text).status(), bank.transfers().len()), (201, 2), "busy consumed the key");
}
