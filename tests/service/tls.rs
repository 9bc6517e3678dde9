//! Calling out over TLS, as every real provider and client endpoint is
//! reached: a real `idem serve` paying out through a real `idem gateway`
//! that serves HTTPS with a certificate of its own. Each test asserts what
//! a build without TLS (every https payout left `unknown`, the money held),
//! or one that hid an untrusted certificate, would get wrong.

use crate::payouts::bank_on;
use crate::server::{Gateway, IDEM, Serve, read};
use std::process::Command;

fn payout(key: &str, serve: &Serve, amount: i64) -> crate::server::Http {
    let body = serde_json::json!({"src": "A", "beneficiary": "bob", "amount": amount, "currency": "KRW"});
    let req = Serve::agent()
        .post(format!("{}/v1/payouts", serve.url))
        .header("Authorization", "Bearer tok")
        .header("Idempotency-Key", format!("\"{key}\""))
        .header("Content-Type", "application/json");
    read(req.send(body.to_string()))
}

#[test]
fn a_payout_goes_out_over_https_once_and_its_retry_replays_it() {
    over_https(false);
}

#[test]
fn on_postgres_a_payout_goes_out_over_https_once_and_its_retry_replays_it() {
    over_https(true);
}

fn over_https(pg: bool) {
    let Some((_dir, db)) = bank_on(pg) else { return };
    let (gw, ca) = Gateway::start_tls(&[]);
    assert!(gw.url.starts_with("https://"), "{}", gw.url);
    let args = ["--gateway", &gw.url, "--gateway-timeout", "5s", "--reconcile-every", "1h"];
    let s = Serve::start(&db, &[("tok", "shop")], &args, &[("IDEM_CA_FILE", ca.to_str().unwrap())]);
    let first = payout("tls-1", &s, 700);
    assert_eq!(first.status, 201, "{}\n{}", first.body, s.log());
    assert_eq!(first.json()["state"], "completed");
    let again = payout("tls-1", &s, 700);
    assert_eq!((again.status, &again.body), (201, &first.body));
    let paid = gw.ledger();
    assert_eq!(paid.len(), 1, "{paid:?}");
    assert_eq!((paid[0].1, paid[0].2.as_str()), (700, "paid"));
    let metrics = s.get("/metrics", None).body;
    assert!(metrics.contains("idem_outbound_tls_failures_total 0\n"), "{metrics}");
}

/// A gateway whose certificate idem does not trust: nothing is paid, the
/// payout is held `unknown` (never guessed), and the operator is told: a
/// log line naming the host, and the metric.
#[test]
fn a_certificate_idem_does_not_trust_is_logged_and_counted_never_a_silent_hold() {
    let Some((_dir, db)) = bank_on(false) else { return };
    let (gw, ca) = Gateway::start_tls(&[]);
    let args = ["--gateway", &gw.url, "--gateway-timeout", "5s", "--reconcile-every", "1h"];
    let s = Serve::start(&db, &[("tok", "shop")], &args, &[]);
    let held = payout("tls-2", &s, 300);
    assert_eq!(held.status, 202, "{}", held.body);
    assert_eq!(held.json()["state"], "unknown");
    assert!(gw.ledger().is_empty(), "nothing reached the gateway: {:?}", gw.ledger());
    let metrics = s.get("/metrics", None).body;
    assert!(metrics.contains("idem_outbound_tls_failures_total 1\n"), "{metrics}");
    let host = gw.url.trim_start_matches("https://");
    let log = s.log_when(|l| l.contains("outbound_tls_failed"));
    let line = log.lines().find(|l| l.contains("outbound_tls_failed")).unwrap_or_else(|| panic!("{log}"));
    let line: serde_json::Value = serde_json::from_str(line).unwrap();
    assert_eq!(line["host"], host);
    assert!(line["error"].as_str().unwrap().starts_with("TLS: "), "{line}");

    // the recovery job, given the certificate, finds it never arrived
    // and sends it under its one downstream key
    let out = Command::new(IDEM)
        .args(["reconcile", "--gateway", &gw.url, "--db"])
        .arg(&db)
        .env("IDEM_CA_FILE", ca.to_str().unwrap())
        .env("IDEM_NOW", idem::clock::Timestamp::now().plus_seconds(3600).to_string())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let paid = gw.ledger();
    assert_eq!(paid.len(), 1, "{paid:?}\n{}", String::from_utf8_lossy(&out.stdout));
    assert_eq!((paid[0].1, paid[0].2.as_str()), (300, "paid"));
}

/// `--ca-file` that names no certificate stops the command at once with one
/// line, before it calls anything.
#[test]
fn a_ca_file_without_a_certificate_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("ca.pem");
    std::fs::write(&bad, "-----BEGIN NOTHING-----\n").unwrap();
    let out = Command::new(IDEM)
        .args(["--ca-file"])
        .arg(&bad)
        .args(["reconcile", "--gateway", "https://127.0.0.1:9", "--db"])
        .arg(dir.path().join("x.db"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("--ca-file") && err.contains("ca.pem"), "{err}");
}
