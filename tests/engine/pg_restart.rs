//! PostgreSQL killed and restarted mid-traffic (`pg_ctl restart -m
//! immediate`: no checkpoint, WAL replay on start). Clients keep sending and
//! retry each key with the same body until they get a definitive answer.
//! Afterwards no transfer a client was told about (201) is missing, no key
//! paid twice, and the balances are exact. The server is one of the test's
//! own: a restart of the shared one would cut the other tests' connections.

use crate::common::*;
use std::collections::BTreeMap;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const CLIENTS: usize = 4;
const T0: &str = "2026-12-01T00:00:00Z";
const KEYS_PER_CLIENT: usize = 15;

#[test]
fn an_immediate_restart_mid_traffic_loses_no_acknowledged_transfer_and_pays_nothing_twice() {
    let Some(server) = pg::own_server() else { return };
    let mut rng = rng();
    let bank = Bank::on_server(server, &mut rng, 4);
    let before = bank.balances();
    let amounts: Vec<i64> = (0..CLIENTS * KEYS_PER_CLIENT).map(|_| 1 + rng.below(500) as i64).collect();
    let files = ring_requests(&bank, "restart", &amounts);
    let restarted = Arc::new(AtomicBool::new(false));
    let lease = i64::from(idem::policy::Policy::embedded().in_progress_lease_seconds);
    let after = idem::clock::Timestamp::parse(T0).unwrap().plus_seconds(lease).to_string();
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (db, files, restarted, after) =
                (bank.db.clone(), files.clone(), restarted.clone(), after.clone());
            std::thread::spawn(move || {
                let mut acknowledged = BTreeMap::new();
                let mut failures_seen = 0;
                for (i, file) in files.iter().enumerate().skip(c * KEYS_PER_CLIENT).take(KEYS_PER_CLIENT) {
                    let deadline = Instant::now() + Duration::from_secs(60);
                    loop {
                        // A claim whose process the restart cut off blocks its key
                        // until the lease: after the restart the clients' clock is
                        // past it, as a patient client's would be.
                        let now = if restarted.load(Ordering::Relaxed) { after.as_str() } else { T0 };
                        let mut cmd = std::process::Command::new(API);
                        cmd.arg("--db").arg(&db).arg("--request").arg(file).env("IDEM_NOW", now);
                        let out = cmd.output().unwrap();
                        let answer: Option<serde_json::Value> = serde_json::from_slice(&out.stdout).ok();
                        match answer.as_ref().and_then(|a| a["status"].as_i64()) {
                            Some(201) => {
                                let id = answer.unwrap()["body"]["transfer_id"].as_i64().unwrap();
                                acknowledged.insert(i, id);
                                break;
                            }
                            // the server is down (exit 5) or the key in flight: try again
                            _ => failures_seen += 1,
                        }
                        assert!(
                            Instant::now() < deadline,
                            "key {i} never settled: {}",
                            String::from_utf8_lossy(&out.stderr)
                        );
                        std::thread::sleep(Duration::from_millis(20));
                    }
                    // keep traffic going across the restart
                    if !restarted.load(Ordering::Relaxed) {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                }
                (acknowledged, failures_seen)
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    assert!(server.restart_immediate() || std::env::var_os("IDEM_PG_URL").is_some(), "could not restart");
    restarted.store(true, Ordering::Relaxed);
    let stuck = bank.count("SELECT COUNT(*) FROM idem_key WHERE state = 'in_progress'");
    eprintln!("after the restart: {stuck} claim(s) left by requests it cut off");
    let mut acknowledged = BTreeMap::new();
    let mut failures = 0;
    for c in clients {
        let (acks, seen) = c.join().unwrap();
        acknowledged.extend(acks);
        failures += seen;
    }
    eprintln!(
        "{} keys acknowledged; {failures} attempts failed or met a claim in flight",
        acknowledged.len()
    );
    assert_eq!(acknowledged.len(), amounts.len());
    // every acknowledged transfer is there, once, under the id the client saw
    let ids: Vec<i64> = {
        let mut c = pg::client(&bank.spec());
        c.query("SELECT transfer_id FROM transfer ORDER BY transfer_id", &[])
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect()
    };
    let mut told: Vec<i64> = acknowledged.values().copied().collect();
    told.sort();
    assert_eq!(
        ids, told,
        "a transfer a client was told about is missing, or one nobody was told about exists"
    );
    assert_eq!(bank.balances(), ring_balances(&before, &amounts, 0..amounts.len()));
}

/// The engine's one dead-connection policy on the synchronous store: a
/// session the server ended between two requests (a killed backend, as a
/// failover or an operator's `pg_terminate_backend` ends it) is found and
/// replaced before the next request's first step, which then runs as if
/// nothing had happened: no 503 for a request that came after the loss.
#[test]
fn a_session_ended_between_two_requests_is_replaced_before_the_next_one_runs() {
    use idem::protocol::{self, Ctx, Flow, Outcome};
    use serde_json::json;
    if !backends().contains(&Backend::Postgres) {
        return;
    }
    let bank = Bank::with(Backend::Postgres, &[(json!("A"), 100), (json!("B"), 0)]);
    let policy = idem::policy::Policy::embedded();
    // named, so that only its session is ended: other tests share the server
    let name = format!("idem-ended-{}", std::process::id());
    let spec = match bank.spec().starts_with("postgres") {
        true => format!("{}&application_name={name}", bank.spec()),
        false => format!("{} application_name={name}", bank.spec()),
    };
    let db = idem::store::Db::parse(&spec);
    let mut store = idem::store::open(&db, policy, idem::store::Usage::LongLived).unwrap();
    let now = idem::clock::Timestamp::parse(T0).unwrap();
    let send = |store: &mut Box<dyn idem::store::Store + Send>, key: &str| {
        let text = request("c", "/t", key, &json!("A"), &json!("B"), 10);
        let req = idem::request::parse(text.as_bytes(), policy).unwrap();
        let ctx = Ctx { policy, now, token: key };
        match protocol::handle(store, &req, ctx, &mut |_| Flow::Continue) {
            Ok(Outcome::Respond(r)) => r.status,
            other => panic!("{key}: {other:?}"),
        }
    };
    assert_eq!(send(&mut store, "k-1"), 201);
    let ended = bank.count(&format!(
        "SELECT COUNT(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = '{name}'"
    ));
    assert!(ended >= 1, "the store's session was not found to end");
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(send(&mut store, "k-2"), 201, "the request after the loss was not run on a new session");
    assert_eq!(bank.balances(), [80, 20]);
}

/// A server that stops answering in the middle of a transaction begun by
/// hand (its backend stopped with SIGSTOP: no `statement_timeout` can fire
/// there) is given up by the client within its deadline, as a lost
/// connection (the caller's 503), and the next transaction runs on a new
/// session. Without the client-side deadline the statement waits for ever.
#[test]
fn a_server_that_stops_answering_mid_transaction_is_given_up_within_the_deadline() {
    use idem::request::AcctId;
    use idem::store::{Durability, StoreError};
    use serde_json::json;
    if !backends().contains(&Backend::Postgres) {
        return;
    }
    let bank = Bank::with(Backend::Postgres, &[(json!("A"), 100), (json!("B"), 0)]);
    let name = format!("idem-stalled-{}", std::process::id());
    let spec = match bank.spec().starts_with("postgres") {
        true => format!("{}&application_name={name}", bank.spec()),
        false => format!("{} application_name={name}", bank.spec()),
    };
    let policy = idem::policy::Policy::embedded();
    let mut store =
        idem::store::open(&idem::store::Db::parse(&spec), policy, idem::store::Usage::LongLived).unwrap();
    let pid = bank.count(&format!(
        "SELECT COALESCE(MAX(pid), 0)::bigint FROM pg_stat_activity WHERE application_name = '{name}'"
    ));
    assert!(pid > 0, "the store's session was not found");
    let signal = |s: &str| Command::new("kill").args([s, &pid.to_string()]).status().unwrap();
    let a = AcctId::Text("A".into());
    let (given_up, took) = {
        let mut tx = store.begin(Durability::Durable).unwrap();
        assert!(signal("-STOP").success(), "cannot stop the backend {pid}");
        let begun = Instant::now();
        // the test's own guard: a statement that never ends would hang it
        let (done, wait) = std::sync::mpsc::channel();
        let guard = std::thread::spawn(move || {
            if wait.recv_timeout(Duration::from_secs(40)).is_err() {
                let _ = Command::new("kill").args(["-CONT", &pid.to_string()]).status();
            }
        });
        let got = tx.lock_account(&a);
        let took = begun.elapsed();
        let _ = done.send(());
        guard.join().unwrap();
        (got, took)
    };
    signal("-CONT");
    assert!(
        matches!(given_up, Err(StoreError::Unavailable(_))),
        "a stalled server: wanted Unavailable, got {given_up:?} after {took:?}"
    );
    assert!(took < Duration::from_secs(20), "given up only after {took:?}");
    let mut tx = store.begin(Durability::Durable).expect("the next transaction on a new session");
    let balance = tx.lock_account(&a).unwrap().map(|acct| acct.balance);
    assert_eq!(balance, Some(100));
}
