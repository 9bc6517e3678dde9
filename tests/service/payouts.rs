//! Payouts through an outside gateway (`POST /v1/payouts`, `idem_api
//! --gateway`, `idem reconcile`): a real `idem serve` or `idem_api` and a
//! real `idem gateway`, each a process on loopback, their databases read
//! directly. Each test asserts
//! what an implementation that paid twice, lost the money it held, called
//! the gateway under a second key, or guessed an outcome would get wrong.

use crate::server::{Gateway, Http, IDEM, Serve, documented, read};
use idem::store::Db;
use idem::store::bank::{self, Account};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const START: i64 = 100_000;

/// A bank of two accounts, A and B, each holding [`START`], in a new SQLite
/// file or (`pg`) a new PostgreSQL schema, whose connection string stands
/// where the file's path would; `None` when PostgreSQL is not here.
pub(crate) fn bank_on(pg: bool) -> Option<(tempfile::TempDir, PathBuf)> {
    let dir = tempfile::tempdir().unwrap();
    let db = match pg {
        true => PathBuf::from(crate::common::pg::server()?.fresh_schema(false)),
        false => dir.path().join("bank.db"),
    };
    let accounts: Vec<Account> = ["A", "B"]
        .iter()
        .map(|id| Account { id: (*id).into(), holder: "h".into(), balance: START })
        .collect();
    bank::create(&parse(&db), &accounts).unwrap();
    Some((dir, db))
}

fn bank() -> (tempfile::TempDir, PathBuf) {
    bank_on(false).unwrap()
}

fn parse(db: &Path) -> Db {
    Db::parse(db.to_str().unwrap())
}

fn serve(db: &Path, gateway: &str, extra: &[&str]) -> Serve {
    let timeout: &[&str] =
        if extra.contains(&"--gateway-timeout") { &[] } else { &["--gateway-timeout", "5s"] };
    let args = [&["--gateway", gateway, "--reconcile-every", "1h"][..], timeout, extra].concat();
    Serve::start(db, &[("tok", "shop")], &args, &[])
}

/// `POST /v1/payouts` as client `shop`.
fn post(url: &str, key: &str, body: &str) -> Http {
    let req = Serve::agent()
        .post(format!("{url}/v1/payouts"))
        .header("Authorization", "Bearer tok")
        .header("Idempotency-Key", format!("\"{key}\""))
        .header("Content-Type", "application/json");
    read(req.send(body))
}

fn pay(serve: &Serve, key: &str, body: &str) -> Http {
    documented("post", "/v1/payouts", post(&serve.url, key, body))
}

/// [`pay`] on a thread of its own, for a payout that will wait.
fn pay_meanwhile(serve: &Serve, key: &str, body: String) -> std::thread::JoinHandle<Http> {
    let (url, key) = (serve.url.clone(), key.to_owned());
    std::thread::spawn(move || post(&url, &key, &body))
}

fn payout(beneficiary: &str, amount: i64) -> String {
    serde_json::json!({"src": "A", "beneficiary": beneficiary, "amount": amount, "currency": "KRW"})
        .to_string()
}

fn balance(db: &Path, id: &str) -> i64 {
    bank::ledger(&parse(db)).unwrap().1[id]
}

/// (payout_id, state, downstream_key) of every payout row.
fn payouts(db: &Path) -> Vec<(i64, String, String)> {
    const SQL: &str = "SELECT payout_id, state, downstream_key FROM payout ORDER BY payout_id";
    if let Db::Postgres(_) = parse(db) {
        let mut client = crate::common::pg::client(db.to_str().unwrap());
        return client.query(SQL, &[]).unwrap().iter().map(|r| (r.get(0), r.get(1), r.get(2))).collect();
    }
    let conn = rusqlite::Connection::open(db).unwrap();
    let mut stmt = conn.prepare(SQL).unwrap();
    stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?))).unwrap().map(Result::unwrap).collect()
}

/// `idem reconcile` once: its decisions.
fn reconcile(db: &Path, gateway: &str, args: &[&str], now: Option<&str>) -> Vec<Value> {
    let mut cmd = Command::new(IDEM);
    cmd.args(["reconcile", "--gateway", gateway, "--db"]).arg(db).args(args);
    if let Some(now) = now {
        cmd.env("IDEM_NOW", now);
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8(out.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// An RFC 3339 instant `ahead` from now.
fn later(ahead: Duration) -> String {
    idem::clock::Timestamp::now().plus_seconds(ahead.as_secs() as i64).to_string()
}

#[test]
fn a_payout_is_paid_once_its_retries_replay_it_and_a_refusal_releases_the_hold() {
    paid_once(false);
}

#[test]
fn on_postgres_a_payout_is_paid_once_its_retries_replay_it_and_a_refusal_releases_the_hold() {
    paid_once(true);
}

fn paid_once(pg: bool) {
    let Some((_dir, db)) = bank_on(pg) else { return };
    let gw = Gateway::start(&["--limit", "50000"]);
    let s = serve(&db, &gw.url, &[]);
    let first = pay(&s, "p-1", &payout("bob", 700));
    assert_eq!(first.status, 201, "{}", first.body);
    assert_eq!(first.json()["state"], "completed");
    let id = first.json()["payout_id"].as_i64().unwrap();
    assert_eq!(first.header("location"), Some(format!("/v1/payouts/{id}").as_str()));
    // the same body, spelled otherwise: the same bytes, not a second payout
    let again = pay(&s, "p-1", r#"{"currency":"KRW","amount":700,"beneficiary":"bob","src":"A"}"#);
    assert_eq!((again.status, &again.body), (201, &first.body));
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.header("location"), first.header("location"));
    assert_eq!(pay(&s, "p-1", &payout("bob", 701)).status, 422);
    // the scope is per route: the same key on transfers is another key
    assert_eq!(gw.ledger().len(), 1);
    assert_eq!(balance(&db, "A"), START - 700);

    // definitive refusals: the hold goes back, the refusal is replayed
    let closed = pay(&s, "p-2", &payout("closed-carol", 300));
    assert_eq!((closed.status, closed.reason().as_deref()), (402, Some("account_closed")), "{}", closed.body);
    let over = pay(&s, "p-3", &payout("dave", 60_000));
    assert_eq!((over.status, over.reason().as_deref()), (422, Some("amount_over_limit")), "{}", over.body);
    assert_eq!(balance(&db, "A"), START - 700, "a refused payout's hold was not released");
    let closed_again = pay(&s, "p-2", &payout("closed-carol", 300));
    assert_eq!((closed_again.status, closed_again.header("idempotent-replayed")), (402, Some("true")));
    // the refused payout, read back: failed, with the gateway's reason
    let (failed_id, ..) = payouts(&db).into_iter().find(|(_, state, _)| state == "failed").unwrap();
    let refused = s.get(&format!("/v1/payouts/{failed_id}"), Some("tok")).json();
    assert_eq!(
        (refused["state"].as_str(), refused["reason"].as_str()),
        (Some("failed"), Some("account_closed"))
    );
    assert_eq!(first.json().get("reason"), None, "a paid payout has no reason");
    assert_eq!(gw.ledger().len(), 3, "a refusal was sent twice");
    // refusals of idem's own: no call at all
    assert_eq!(pay(&s, "p-4", &payout("erin", START)).reason().as_deref(), Some("insufficient_funds"));
    let ghost = r#"{"src":"ghost","beneficiary":"f","amount":1,"currency":"KRW"}"#;
    assert_eq!(pay(&s, "p-5", ghost).status, 404);
    assert_eq!(pay(&s, "p-6", r#"{"src":"A","amount":1,"currency":"KRW"}"#).status, 400);
    assert_eq!(gw.ledger().len(), 3);
    let got = s.get(&format!("/v1/payouts/{id}"), Some("tok"));
    assert_eq!((got.status, got.json()["state"].as_str()), (200, Some("completed")));
    assert_eq!(s.get(&format!("/v1/payouts/{id}"), Some("nope")).status, 401);
    // each was told in its own answer: no client event waits to tell it again
    let (ok, events, _) = payouts_cmd(&db, &["client-events"]);
    assert!(ok && events.is_empty(), "{events:#?}");
}

#[test]
fn an_answer_lost_after_the_gateway_paid_is_202_until_the_reconciler_asks_and_settles_it() {
    answer_lost(false);
}

#[test]
fn on_postgres_an_answer_lost_after_the_gateway_paid_is_202_until_the_reconciler_settles_it() {
    answer_lost(true);
}

fn answer_lost(pg: bool) {
    let Some((_dir, db)) = bank_on(pg) else { return };
    let gw = Gateway::start(&["--drop-answer", "100"]);
    let s = serve(&db, &gw.url, &[]);
    let first = pay(&s, "p-lost", &payout("bob", 900));
    assert_eq!(first.status, 202, "an unanswered call is not a failure: {}", first.body);
    assert_eq!(first.json()["state"], "unknown");
    let location = first.header("location").unwrap().to_owned();
    // every retry says where it stands, and calls nobody
    for _ in 0..3 {
        let retry = pay(&s, "p-lost", &payout("bob", 900));
        assert_eq!(
            (retry.status, retry.header("location")),
            (202, Some(location.as_str())),
            "{}",
            retry.body
        );
    }
    assert_eq!(gw.ledger().len(), 1, "a retry called the gateway again");
    assert_eq!(balance(&db, "A"), START - 900, "the money is held while unknown");
    let [(id, state, downstream)] = &payouts(&db)[..] else { panic!() };
    assert_eq!(state, "unknown");
    assert_eq!(gw.ledger()[0].0, *downstream, "the gateway saw idem's downstream key");
    assert!(!downstream.contains("p-lost"), "the client's key leaked downstream: {downstream}");

    let decisions = reconcile(&db, &gw.url, &[], None);
    assert_eq!(decisions.len(), 1, "{decisions:?}");
    assert_eq!(
        (decisions[0]["payout_id"].as_i64(), decisions[0]["now"].as_str()),
        (Some(*id), Some("completed"))
    );
    let settled = pay(&s, "p-lost", &payout("bob", 900));
    assert_eq!(
        (settled.status, settled.json()["state"].as_str()),
        (201, Some("completed")),
        "{}",
        settled.body
    );
    assert_eq!(settled.body, pay(&s, "p-lost", &payout("bob", 900)).body);
    assert_eq!(s.get(&location, Some("tok")).json()["state"], "completed");
    assert_eq!(reconcile(&db, &gw.url, &[], None).len(), 0, "nothing left to reconcile");
    assert_eq!((gw.ledger().len(), balance(&db, "A")), (1, START - 900));
}

/// `idem payouts ARGS --db DB`: its exit status and its JSON lines.
pub(crate) fn payouts_cmd(db: &Path, args: &[&str]) -> (bool, Vec<Value>, String) {
    let out = Command::new(IDEM).arg("payouts").args(args).arg("--db").arg(db).output().unwrap();
    let lines =
        String::from_utf8(out.stdout).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    (out.status.success(), lines, String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn a_request_lost_before_the_gateway_is_resent_with_its_key_only_past_the_lookup_delay_and_inside_the_window()
{
    let (_dir, db) = bank();
    let lossy = Gateway::start(&["--lose-request", "100"]);
    let s = serve(&db, &lossy.url, &[]);
    assert_eq!(pay(&s, "p-a", &payout("bob", 100)).status, 202);
    assert_eq!(pay(&s, "p-b", &payout("bob", 200)).status, 202);
    assert!(lossy.ledger().is_empty());
    let gw = Gateway::start(&[]);
    let url = &gw.url;
    let delay = ["--gateway-lookup-delay", "10m"];
    // not found, but the gateway may not show it yet: a resend now could be a second payout
    let early = reconcile(&db, url, &delay, None);
    assert!(early.iter().all(|d| d["now"] == "unknown"), "{early:?}");
    assert!(early[0]["decision"].as_str().unwrap().contains("lookup delay"), "{early:?}");
    assert!(gw.ledger().is_empty(), "resent within the lookup delay");
    // past the delay, inside the window less its margin and the call's time:
    // resent once, with the same key (after the lease the run above took)
    let resent = reconcile(&db, url, &delay, Some(&later(Duration::from_secs(3 * 3600))));
    assert!(resent.len() == 2 && resent.iter().all(|d| d["now"] == "completed"), "{resent:?}");
    assert!(resent.iter().all(|d| d["sends"] == 2), "the first send and one resend: {resent:?}");
    let keys: Vec<String> = payouts(&db).into_iter().map(|p| p.2).collect();
    let paid: Vec<String> = gw.ledger().into_iter().map(|p| p.0).collect();
    assert_eq!(paid, keys);
    assert!(keys.iter().all(|k| k.len() == 36 && k.as_bytes()[14] == b'8'), "a UUID v8 per payout: {keys:?}");
    assert_eq!(pay(&s, "p-b", &payout("bob", 200)).status, 201);
    assert_eq!(balance(&db, "A"), START - 300);
}

#[test]
fn a_payout_inside_its_key_windows_margin_goes_to_a_person_who_settles_it_once() {
    let (_dir, db) = bank();
    let lossy = Gateway::start(&["--lose-request", "100"]);
    let s = serve(&db, &lossy.url, &[]);
    assert_eq!(pay(&s, "p-a", &payout("bob", 100)).status, 202);
    assert_eq!(pay(&s, "p-b", &payout("bob", 200)).status, 202);
    // within the window but inside its margin (a clock 50 min behind the
    // gateway's, or a slow lookup and send, would land past it): a person
    let window = ["--gateway-key-window", "1h", "--gateway-key-margin", "15m"];
    let near = reconcile(&db, &lossy.url, &window, Some(&later(Duration::from_secs(50 * 60))));
    assert!(near.len() == 2 && near.iter().all(|d| d["now"] == "needs_attention"), "{near:?}");
    assert!(lossy.ledger().is_empty(), "resent inside the key window's margin");
    // nobody resends it now, however often the reconciler runs
    let gw = Gateway::start(&[]);
    assert!(reconcile(&db, &gw.url, &[], Some(&later(Duration::from_secs(7200)))).is_empty());
    let (ok, listed, _) = payouts_cmd(&db, &["list", "--state", "needs_attention"]);
    assert!(ok && listed.len() == 2, "{listed:?}");
    assert!(listed.iter().all(|p| p["note"].as_str().unwrap().starts_with("needs a person")), "{listed:?}");
    assert_eq!(pay(&s, "p-a", &payout("bob", 100)).json()["state"], "needs_attention");
    // the person finds p-a paid at the provider by hand, p-b never sent
    let (a, b) = (listed[0]["payout_id"].to_string(), listed[1]["payout_id"].to_string());
    let settle = |id: &str, how: &[&str]| payouts_cmd(&db, &[&["settle", id][..], how].concat());
    let (ok, done, err) =
        settle(&a, &["--paid", "--reference", "po_77", "--reason", "paid by phone", "--by", "kim"]);
    assert!(ok && done[0]["state"] == "completed" && done[0]["provider_id"] == "po_77", "{done:?} {err}");
    let (ok, done, err) = settle(&b, &["--failed", "--reason", "never reached the provider"]);
    assert!(ok && done[0]["state"] == "failed", "{done:?} {err}");
    // once only: a second settlement is refused and changes nothing
    let (ok, _, err) = settle(&a, &["--failed", "--reason", "again"]);
    assert!(!ok && err.contains("settled already"), "{err}");
    assert_eq!(balance(&db, "A"), START - 100, "p-a paid out, p-b's hold back");
    // the clients' retries now get the settled answers
    assert_eq!(pay(&s, "p-a", &payout("bob", 100)).status, 201);
    let refused = pay(&s, "p-b", &payout("bob", 200));
    assert_eq!(
        (refused.status, refused.json()["reason"].as_str().map(String::from)),
        (422, Some("never reached the provider".into()))
    );
    // and the audit trail says who did what, when and why
    let (ok, shown, _) = payouts_cmd(&db, &["show", &a]);
    let events = shown[0]["events"].as_array().unwrap();
    let trail: Vec<(&str, &str)> =
        events.iter().map(|e| (e["was"].as_str().unwrap(), e["now"].as_str().unwrap())).collect();
    assert!(
        ok && trail
            == [
                ("in_progress", "unknown"),
                ("unknown", "needs_attention"),
                ("needs_attention", "completed"),
                ("completed", "completed")
            ],
        "{events:?}"
    );
    assert!(
        events
            .iter()
            .any(|e| e["actor"] == "person:kim" && e["why"].as_str().unwrap().contains("paid by phone")),
        "{events:?}"
    );
    // a payout held by a live request or reconciler is not a person's to settle
    let slow = Gateway::start(&["--slow", "100", "--slow-for", "3s"]);
    let s2 = serve(&db, &slow.url, &["--gateway-timeout", "10s"]);
    let waiting = pay_meanwhile(&s2, "p-c", payout("bob", 50));
    std::thread::sleep(Duration::from_millis(700));
    let c = payouts(&db).last().unwrap().0.to_string();
    let (ok, _, err) = settle(&c, &["--failed", "--reason", "impatient"]);
    assert!(!ok && err.contains("held by"), "{err}");
    assert_eq!(waiting.join().unwrap().status, 201);
}

#[test]
fn two_reconcilers_at_once_never_work_on_one_payout() {
    let (_dir, db) = bank();
    let lossy = Gateway::start(&["--lose-request", "100"]);
    let s = serve(&db, &lossy.url, &[]);
    for i in 0..12 {
        assert_eq!(pay(&s, &format!("p-{i}"), &payout("bob", 10 + i)).status, 202);
    }
    let gw = Gateway::start(&["--slow", "100", "--slow-for", "200ms"]);
    let runs: Vec<_> = (0..2)
        .map(|_| {
            let (db, url) = (db.clone(), gw.url.clone());
            std::thread::spawn(move || reconcile(&db, &url, &[], None))
        })
        .collect();
    let decisions: Vec<Vec<Value>> = runs.into_iter().map(|r| r.join().unwrap()).collect();
    let mut ids: Vec<i64> = decisions.iter().flatten().map(|d| d["payout_id"].as_i64().unwrap()).collect();
    ids.sort_unstable();
    let before = ids.len();
    ids.dedup();
    assert_eq!(before, ids.len(), "a payout was worked on by both: {decisions:?}");
    assert_eq!(ids.len(), 12, "{decisions:?}");
    let ledger = gw.ledger();
    assert_eq!(ledger.len(), 12, "{ledger:?}");
    assert_eq!(balance(&db, "A"), START - (10..22).sum::<i64>());
}

#[test]
fn a_service_killed_during_the_call_leaves_a_held_intent_that_its_retry_and_the_reconciler_settle_once() {
    killed_during_the_call(false);
}

#[test]
fn on_postgres_a_service_killed_during_the_call_leaves_a_held_intent_settled_once() {
    killed_during_the_call(true);
}

fn killed_during_the_call(pg: bool) {
    let Some((_dir, db)) = bank_on(pg) else { return };
    // a gateway that takes the request and never answers: the call is in
    // flight when the service dies
    let hole = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let hole_url = format!("http://{}", hole.local_addr().unwrap());
    let held = std::thread::spawn(move || hole.accept().map(|(stream, _)| stream));
    let s = serve(&db, &hole_url, &["--gateway-timeout", "60s"]);
    let _call = pay_meanwhile(&s, "p-kill", payout("bob", 450));
    let _in_flight = held.join().unwrap().unwrap();
    assert_eq!(payouts(&db).len(), 1, "the intent is committed before the call");
    let pid = s.pid();
    unsafe { libc::kill(pid, libc::SIGKILL) };
    drop(s);
    assert_eq!(balance(&db, "A"), START - 450, "the hold survives the kill");

    let gw = Gateway::start(&[]);
    let s = serve(&db, &gw.url, &[]);
    let retry = pay(&s, "p-kill", &payout("bob", 450));
    assert_eq!((retry.status, retry.json()["state"].as_str()), (202, Some("in_progress")), "{}", retry.body);
    assert!(gw.ledger().is_empty(), "the retry called the gateway: the dead call may have gone through");
    // inside the call's lease nobody else touches it
    assert!(reconcile(&db, &gw.url, &[], None).is_empty());
    let decisions = reconcile(&db, &gw.url, &[], Some(&later(Duration::from_secs(600))));
    assert_eq!(decisions.len(), 1, "{decisions:?}");
    assert_eq!(decisions[0]["now"], "completed");
    assert_eq!(pay(&s, "p-kill", &payout("bob", 450)).status, 201);
    assert_eq!((gw.ledger().len(), balance(&db, "A")), (1, START - 450));
}

#[test]
fn a_slow_gateway_holds_no_database_connection_transfers_go_on() {
    let (_dir, db) = bank();
    let gw = Gateway::start(&["--slow", "100", "--slow-for", "3s"]);
    let s = serve(&db, &gw.url, &[]);
    let slow = pay_meanwhile(&s, "p-slow", payout("bob", 5));
    let deadline = Instant::now() + Duration::from_secs(2);
    while payouts(&db).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let started = Instant::now();
    for i in 0..20 {
        let t = s.post(
            Some("tok"),
            Some(&format!("\"t-{i}\"")),
            r#"{"src":"B","dst":"A","amount":1,"currency":"KRW"}"#,
        );
        assert_eq!(t.status, 201, "{}", t.body);
    }
    let took = started.elapsed();
    assert!(took < Duration::from_millis(1500), "20 transfers took {took:?} behind a slow payout");
    assert!(!slow.is_finished(), "the payout was not slow");
    assert_eq!(slow.join().unwrap().status, 201);
}

#[test]
fn payouts_waiting_on_a_slow_gateway_take_no_transfers_slot_and_one_client_cannot_take_them_all() {
    let (_dir, db) = bank();
    let gw = Gateway::start(&["--slow", "100", "--slow-for", "3s"]);
    let args = [
        "--gateway",
        &gw.url,
        "--gateway-timeout",
        "10s",
        "--reconcile-every",
        "1h",
        "--max-in-flight",
        "4",
        "--max-payouts-in-flight",
        "8",
    ];
    let s = Serve::start(&db, &[("tok", "shop"), ("tok2", "other")], &args, &[]);
    // the shop sends 6 payouts at once: a quarter of the budget (2) wait on
    // the gateway, the rest are refused at once, nothing stored for them
    let waiting: Vec<_> =
        (0..6).map(|i| pay_meanwhile(&s, &format!("p-{i}"), payout("bob", 10 + i))).collect();
    let deadline = Instant::now() + Duration::from_secs(3);
    while payouts(&db).len() < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(300));
    // meanwhile every transfer of another client goes through (its budget is 4)
    for i in 0..12 {
        let t = s.post(
            Some("tok2"),
            Some(&format!("\"t-{i}\"")),
            r#"{"src":"B","dst":"A","amount":1,"currency":"KRW"}"#,
        );
        assert_eq!(t.status, 201, "transfer {i} behind the shop's payouts: {}", t.body);
    }
    // and another client's payout is not refused for the shop's
    let theirs = Serve::agent()
        .post(format!("{}/v1/payouts", s.url))
        .header("Authorization", "Bearer tok2")
        .header("Idempotency-Key", "\"q-1\"")
        .header("Content-Type", "application/json");
    let theirs = std::thread::spawn(move || read(theirs.send(payout("carol", 7))));
    let answers: Vec<u16> = waiting.into_iter().map(|w| w.join().unwrap().status).collect();
    let (paid, busy) =
        (answers.iter().filter(|s| **s == 201).count(), answers.iter().filter(|s| **s == 503).count());
    assert_eq!((paid, busy), (2, 4), "{answers:?}");
    assert_eq!(theirs.join().unwrap().status, 201);
    assert_eq!(payouts(&db).len(), 3, "a refused payout stored nothing");
}

#[test]
fn a_service_killed_after_the_gateway_accepted_is_settled_by_the_lookup_not_a_second_call() {
    killed_after_the_gateway_accepted(false);
}

#[test]
fn on_postgres_a_service_killed_after_the_gateway_accepted_is_settled_by_the_lookup() {
    killed_after_the_gateway_accepted(true);
}

/// The gateway has the payout (pending, paid 2 s later) when the service
/// dies; the new service's reconciler finds it paid by the lookup.
fn killed_after_the_gateway_accepted(pg: bool) {
    let Some((_dir, db)) = bank_on(pg) else { return };
    let gw = Gateway::start(&["--slow", "100", "--slow-for", "2s"]);
    let s = serve(&db, &gw.url, &["--gateway-timeout", "60s"]);
    let _call = pay_meanwhile(&s, "p-accepted", payout("bob", 320));
    let deadline = Instant::now() + Duration::from_secs(5);
    while gw.ledger().is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(gw.ledger()[0].2, "pending", "the gateway has accepted the payout");
    unsafe { libc::kill(s.pid(), libc::SIGKILL) };
    drop(s);
    std::thread::sleep(Duration::from_millis(2200)); // the gateway pays meanwhile
    let s = serve(&db, &gw.url, &[]);
    let retry = pay(&s, "p-accepted", &payout("bob", 320));
    assert_eq!(retry.status, 202, "{}", retry.body);
    let decisions = reconcile(&db, &gw.url, &[], Some(&later(Duration::from_secs(600))));
    assert_eq!(decisions.len(), 1, "{decisions:?}");
    assert!(decisions[0]["decision"].as_str().unwrap().starts_with("paid at the gateway"), "{decisions:?}");
    let paid = pay(&s, "p-accepted", &payout("bob", 320));
    assert_eq!((paid.status, paid.json()["state"].as_str()), (201, Some("completed")));
    assert_eq!(gw.ledger().len(), 1, "a second payout at the gateway");
    assert_eq!(balance(&db, "A"), START - 320);
    // and after the result: a service killed after it answered replays it
    unsafe { libc::kill(s.pid(), libc::SIGKILL) };
    drop(s);
    let s = serve(&db, &gw.url, &[]);
    let again = pay(&s, "p-accepted", &payout("bob", 320));
    assert_eq!(
        (again.status, &again.body, again.header("idempotent-replayed")),
        (201, &paid.body, Some("true"))
    );
}

/// `idem_api --gateway`: one payout request file through the lab's CLI;
/// its exit code and, on 0, the JSON it printed.
fn api_pay(db: &Path, gateway: &str, key: &str, body: &str, crash_at: Option<&str>) -> (i32, Value) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("request.json");
    let request =
        format!(r#"{{"client_id":"shop","endpoint":"/v1/payouts","idem_key":"{key}","body":{body}}}"#);
    std::fs::write(&file, request).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_idem_api"));
    cmd.arg("--db").arg(db).arg("--request").arg(&file).args(["--gateway", gateway]);
    match crash_at {
        // the lab's own flag, for the boundary it names
        Some("after-claim") => _ = cmd.arg("--crash-after-claim"),
        Some(point) => _ = cmd.args(["--crash-at", point]),
        None => {}
    }
    let out = cmd.output().unwrap();
    let json = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    (out.status.code().unwrap_or(-1), json)
}

#[test]
fn idem_api_pays_out_once_replays_it_and_holds_the_money_while_the_outcome_is_unknown() {
    api_paid_once(false);
}

#[test]
fn on_postgres_idem_api_pays_out_once_and_holds_the_money_while_unknown() {
    api_paid_once(true);
}

fn api_paid_once(pg: bool) {
    let Some((_dir, db)) = bank_on(pg) else { return };
    let gw = Gateway::start(&[]);
    let (code, first) = api_pay(&db, &gw.url, "p-1", &payout("bob", 700), None);
    assert_eq!((code, first["status"].as_i64()), (0, Some(201)), "{first}");
    assert_eq!(
        (first["replay"].as_bool(), first["body"]["state"].as_str()),
        (Some(false), Some("completed"))
    );
    let spelled_otherwise = r#"{"currency":"KRW","amount":700,"beneficiary":"bob","src":"A"}"#;
    let (_, again) = api_pay(&db, &gw.url, "p-1", spelled_otherwise, None);
    assert_eq!((again["status"].as_i64(), again["replay"].as_bool()), (Some(201), Some(true)));
    assert_eq!(again["body"], first["body"], "a replay is the first answer");
    assert_eq!(api_pay(&db, &gw.url, "p-1", &payout("bob", 701), None).1["status"], 422);
    // a transfer's body is not a payout: 400, nothing consumed
    let transfer = r#"{"src":"A","dst":"B","amount":5,"currency":"KRW"}"#;
    assert_eq!(api_pay(&db, &gw.url, "p-2", transfer, None).1["status"], 400);
    // the gateway's refusal: the hold goes back, the refusal is replayed
    let (_, closed) = api_pay(&db, &gw.url, "p-2", &payout("closed-carol", 300), None);
    assert_eq!((closed["status"].as_i64(), closed["reason"].as_str()), (Some(402), Some("account_closed")));
    assert_eq!(api_pay(&db, &gw.url, "p-2", &payout("closed-carol", 300), None).1["replay"], true);
    assert_eq!((gw.ledger().len(), balance(&db, "A")), (2, START - 700));
    // the same key over HTTP is the same key: the service replays the CLI's answer
    let s = serve(&db, &gw.url, &[]);
    let http = pay(&s, "p-1", &payout("bob", 700));
    assert_eq!((http.status, http.json()), (201, first["body"].clone()));
    assert_eq!(http.header("idempotent-replayed"), Some("true"));
    drop(s);

    // the gateway pays and its answer is lost: not a failure, the money stays held
    let lossy = Gateway::start(&["--drop-answer", "100"]);
    let (_, unknown) = api_pay(&db, &lossy.url, "p-3", &payout("dave", 900), None);
    assert_eq!((unknown["status"].as_i64(), unknown["body"]["state"].as_str()), (Some(202), Some("unknown")));
    let (_, retry) = api_pay(&db, &lossy.url, "p-3", &payout("dave", 900), None);
    assert_eq!(retry["status"], 202, "{retry}");
    assert_eq!(lossy.ledger().len(), 1, "a retry called the gateway again");
    assert_eq!(balance(&db, "A"), START - 700 - 900, "the money is held while unknown");
    let decisions = reconcile(&db, &lossy.url, &[], None);
    assert_eq!(decisions.len(), 1, "{decisions:?}");
    let (_, settled) = api_pay(&db, &lossy.url, "p-3", &payout("dave", 900), None);
    assert_eq!(
        (settled["status"].as_i64(), settled["body"]["state"].as_str()),
        (Some(201), Some("completed"))
    );
    assert_eq!((lossy.ledger().len(), balance(&db, "A")), (1, START - 700 - 900));
}

#[test]
fn idem_api_killed_at_each_boundary_of_a_payout_pays_it_out_once() {
    api_killed(false);
}

#[test]
fn on_postgres_idem_api_killed_at_each_boundary_of_a_payout_pays_it_out_once() {
    api_killed(true);
}

fn api_killed(pg: bool) {
    let Some((_dir, db)) = bank_on(pg) else { return };
    let gw = Gateway::start(&[]);
    let key_of = |point: &str| format!("p-{point}");
    let mut paid = 0;
    for (point, amount) in
        [("after-claim", 100), ("after-intent", 200), ("after-call", 300), ("after-commit", 400)]
    {
        let (code, _) = api_pay(&db, &gw.url, &key_of(point), &payout("bob", amount), Some(point));
        assert_eq!(code, 4, "{point}: not crashed");
        let (_, retry) = api_pay(&db, &gw.url, &key_of(point), &payout("bob", amount), None);
        match point {
            // claimed, nothing held: the retry waits for the claim's lease
            "after-claim" => assert_eq!(
                (retry["status"].as_i64(), retry["reason"].as_str()),
                (Some(409), Some("in_progress"))
            ),
            // held, the gateway not (or not knowingly) called: where it stands, no call
            "after-intent" | "after-call" => {
                assert_eq!(
                    (retry["status"].as_i64(), retry["body"]["state"].as_str()),
                    (Some(202), Some("in_progress")),
                    "{point}: {retry}"
                );
                paid += amount;
            }
            _ => {
                assert_eq!(
                    (retry["status"].as_i64(), retry["replay"].as_bool()),
                    (Some(201), Some(true)),
                    "{point}: {retry}"
                );
                paid += amount;
            }
        }
    }
    assert_eq!(balance(&db, "A"), START - paid, "held or paid, each once");
    assert_eq!(gw.ledger().len(), 2, "the gateway was called after the call and after the commit only");
    // past the lease of the dead processes' calls, the reconciler asks the gateway
    let decisions = reconcile(&db, &gw.url, &[], Some(&later(Duration::from_secs(600))));
    assert_eq!(decisions.len(), 2, "{decisions:?}");
    for point in ["after-intent", "after-call"] {
        let amount = if point == "after-intent" { 200 } else { 300 };
        let (_, settled) = api_pay(&db, &gw.url, &key_of(point), &payout("bob", amount), None);
        assert_eq!(
            (settled["status"].as_i64(), settled["body"]["state"].as_str()),
            (Some(201), Some("completed")),
            "{point}: {settled}"
        );
    }
    let mut ledger: Vec<i64> = gw.ledger().iter().map(|(_, amount, _)| *amount).collect();
    ledger.sort();
    assert_eq!(ledger, [200, 300, 400], "each payout out once, none for the claim alone");
    assert_eq!(balance(&db, "A"), START - paid);
}

#[test]
fn a_gateway_url_that_cannot_be_called_is_refused_before_any_money_is_held() {
    let (_dir, db) = bank();
    for url in ["gw.example.com", "ftp://gw.example.com", "http://", "http://:80", "not a url"] {
        let (code, _) = api_pay(&db, url, "p-1", &payout("bob", 700), None);
        assert_eq!(code, 2, "{url:?} was taken");
        let out = Command::new(IDEM).args(["reconcile", "--gateway", url, "--db"]).arg(&db).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "idem reconcile took {url:?}");
    }
    let conn = rusqlite::Connection::open(&db).unwrap();
    let a: i64 = conn.query_row("SELECT balance FROM account WHERE acct_id = 'A'", [], |r| r.get(0)).unwrap();
    assert_eq!(a, START, "money held for a gateway that cannot be called");
    let tables: i64 = conn
        .query_row("SELECT COUNT(*) FROM sqlite_master WHERE name IN ('idem_key', 'payout')", [], |r| {
            r.get(0)
        })
        .unwrap();
    assert_eq!(tables, 0, "the database was touched");
}

/// A provider event, signed with `secret` at `t` (Unix seconds; `None`: now).
fn event(s: &Serve, secret: &[u8], body: &serde_json::Value, t: Option<i64>) -> Http {
    let body = body.to_string();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
    let signature = idem::payout::sign(secret, body.as_bytes(), t.unwrap_or(now));
    let req = Serve::agent()
        .post(format!("{}/v1/gateway-events", s.url))
        .header("Idem-Signature", signature)
        .header("Content-Type", "application/json");
    read(req.send(body.as_str()))
}

fn payout_event(id: &str, kind: &str, key: &str, amount: i64) -> serde_json::Value {
    serde_json::json!({"id": id, "type": kind, "data": {"key": key, "id": "po_9", "amount": amount, "currency": "KRW", "reason": "bank_return"}})
}

#[test]
fn provider_events_are_signed_applied_once_and_credit_a_return_back() {
    provider_events(false);
}

#[test]
fn on_postgres_provider_events_are_signed_applied_once_and_credit_a_return_back() {
    provider_events(true);
}

/// Review: idem took a 255-character beneficiary that its own gateway
/// refused (over 200 bytes), so every such payout went to a person. The
/// longest beneficiary idem takes (255 characters, 765 bytes here) is paid.
#[test]
fn the_longest_beneficiary_idem_takes_is_paid_through_its_gateway() {
    let (_dir, db) = bank();
    let gw = Gateway::start(&[]);
    let s = serve(&db, &gw.url, &[]);
    let paid = pay(&s, "p-long", &payout(&"가".repeat(255), 10));
    assert_eq!((paid.status, paid.json()["state"].as_str()), (201, Some("completed")), "{}", paid.body);
    let longer = post(&s.url, "p-longer", &payout(&"가".repeat(256), 10));
    assert_eq!(longer.status, 400, "{}", longer.body);
}

/// An empty secret (a template's unset variable) would let anyone sign a
/// `payout.returned` and be credited: `idem serve` refuses to start on one,
/// from the flag or the environment, and on a short one.
#[test]
fn an_empty_or_short_events_secret_refuses_to_start() {
    let (dir, db) = bank();
    let clients = dir.path().join("clients.json");
    std::fs::write(&clients, r#"{"tok": "shop"}"#).unwrap();
    // empty, short, and a whsec_ secret whose base64 gives 18 bytes of key
    let short_key = "whsec_AAAAAAAAAAAAAAAAAAAAAAAA";
    for (flag, env) in
        [(Some(""), None), (None, Some("")), (Some("short-secret"), None), (Some(short_key), None)]
    {
        let mut cmd = Command::new(IDEM);
        cmd.arg("serve").arg("--db").arg(&db).arg("--clients").arg(&clients);
        cmd.args(["--listen", "127.0.0.1:0", "--gateway", "http://127.0.0.1:9"]);
        if let Some(secret) = flag {
            cmd.args(["--gateway-events-secret", secret]);
        }
        if let Some(secret) = env {
            cmd.env("IDEM_GATEWAY_EVENTS_SECRET", secret);
        }
        let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break Some(status);
            }
            if Instant::now() > deadline {
                child.kill().unwrap();
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let err = std::io::read_to_string(child.stderr.take().unwrap()).unwrap();
        assert!(
            status.and_then(|s| s.code()) == Some(1)
                && err.lines().count() == 1
                && err.contains("events secret"),
            "{flag:?} {env:?}: started or failed otherwise ({status:?}): {err}"
        );
    }
    // a rotation's previous secret: short, or without a current one beside it
    for args in [
        &[
            "--gateway-events-secret",
            "whsec_test_0123456789abcdef",
            "--gateway-events-secret-previous",
            "short",
        ][..],
        &["--gateway-events-secret-previous", "whsec_test_0123456789abcdef"],
    ] {
        let out = Command::new(IDEM)
            .arg("serve")
            .arg("--db")
            .arg(&db)
            .arg("--clients")
            .arg(&clients)
            .args(["--listen", "127.0.0.1:0", "--gateway", "http://127.0.0.1:9"])
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.code() == Some(1) && err.contains("events secret"), "{args:?}: {err}");
    }
}

/// An event's body is unauthenticated until read whole (review N4: 40
/// stalled uploads held a transfer 20 s behind `--max-connections 32`):
/// an unsigned or stale event is refused on its header alone, a few bodies
/// are read at once, each within a deadline, and a transfer goes through.
#[test]
fn stalled_event_uploads_hold_no_transfer_up() {
    use std::io::{Read, Write};
    let (_dir, db) = bank();
    let gw = Gateway::start(&[]);
    let args = ["--gateway-events-secret", "whsec_test_0123456789abcdef", "--max-connections", "32"];
    let s = serve(&db, &gw.url, &args);
    let address = s.url.strip_prefix("http://").unwrap().to_owned();
    let upload = |signature: &str| {
        let mut c = std::net::TcpStream::connect(&address).unwrap();
        let head = format!(
            "POST /v1/gateway-events HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{signature}Content-Length: 60000\r\n\r\n{{\"id\":"
        );
        c.write_all(head.as_bytes()).unwrap();
        c
    };
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let _stalled: Vec<_> = (0..40).map(|_| upload(&format!("Idem-Signature: t={now},v1=00\r\n"))).collect();
    std::thread::sleep(Duration::from_millis(300));
    let started = Instant::now();
    let t = s.post(Some("tok"), Some("\"t-1\""), r#"{"src":"B","dst":"A","amount":1,"currency":"KRW"}"#);
    assert_eq!(t.status, 201, "{}", t.body);
    assert!(started.elapsed() < Duration::from_secs(2), "a transfer waited {:?}", started.elapsed());
    for signature in [String::new(), format!("Idem-Signature: t={},v1=00\r\n", now - 3600)] {
        let mut c = upload(&signature);
        c.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let mut status = [0u8; 12];
        c.read_exact(&mut status).unwrap();
        assert_eq!(&status, b"HTTP/1.1 401", "{signature:?}");
    }
}

/// Strangers hold open uploads that carry a fresh but fake signature (it
/// cannot be checked before the body): 64 of them, each stalled after its
/// first bytes. A genuine provider event beside them is still answered,
/// within a second: they hold the few bytes they sent, not turns. (With
/// eight turns for bodies, eight such uploads shut out every event.)
#[test]
fn stalled_uploads_with_fresh_fake_signatures_leave_genuine_events_answered() {
    use std::io::Write;
    let (_dir, _db, _gw, s, _paid, key) = paid_one_taking_events(false).unwrap();
    let secret = EVENTS_SECRET.as_bytes();
    let address = s.url.strip_prefix("http://").unwrap().to_owned();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    let stalled: Vec<_> = (0..64)
        .map(|_| {
            let mut c = std::net::TcpStream::connect(&address).unwrap();
            let head = format!(
                "POST /v1/gateway-events HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nIdem-Signature: t={now},v1=00\r\nContent-Length: 60000\r\n\r\n{{\"id\":"
            );
            c.write_all(head.as_bytes()).unwrap();
            c
        })
        .collect();
    std::thread::sleep(Duration::from_millis(300));
    for i in 0..3 {
        let started = Instant::now();
        let genuine = event(&s, secret, &payout_event(&format!("evt_g{i}"), "payout.paid", &key, 700), None);
        assert_eq!(genuine.status, 200, "{}", genuine.body);
        assert!(started.elapsed() < Duration::from_secs(1), "a genuine event waited {:?}", started.elapsed());
    }
    drop(stalled);
}

const EVENTS_SECRET: &str = "whsec_test_0123456789abcdef";

/// A service taking provider events signed with [`EVENTS_SECRET`], one
/// payout paid: its answer and its downstream key. `None` without PostgreSQL.
type Taking = (tempfile::TempDir, PathBuf, Gateway, Serve, Http, String);

fn paid_one_taking_events(pg: bool) -> Option<Taking> {
    let (dir, db) = bank_on(pg)?;
    let gw = Gateway::start(&[]);
    let s = serve(&db, &gw.url, &["--gateway-events-secret", EVENTS_SECRET]);
    let paid = pay(&s, "p-1", &payout("bob", 700));
    assert_eq!(paid.status, 201);
    let key = payouts(&db)[0].2.clone();
    Some((dir, db, gw, s, paid, key))
}

fn provider_events(pg: bool) {
    let Some((_dir, db, _gw, s, paid, key)) = paid_one_taking_events(pg) else { return };
    let secret = EVENTS_SECRET.as_bytes();
    // unsigned, forged, stale, or for another body: refused, nothing changes
    let returned = payout_event("evt_1", "payout.returned", &key, 700);
    assert_eq!(event(&s, b"wrong", &returned, None).status, 401);
    assert_eq!(event(&s, secret, &returned, Some(1_000_000_000)).status, 401, "a stale signature");
    let unsigned =
        read(Serve::agent().post(format!("{}/v1/gateway-events", s.url)).send(returned.to_string().as_str()));
    assert_eq!(unsigned.status, 401);
    assert_eq!(balance(&db, "A"), START - 700);
    // the return: credited back once, however often the event comes
    let first = event(&s, secret, &returned, None);
    assert_eq!((first.status, first.json()["duplicate"].as_bool()), (200, Some(false)), "{}", first.body);
    for _ in 0..2 {
        assert_eq!(event(&s, secret, &returned, None).json()["duplicate"], true);
    }
    assert_eq!(balance(&db, "A"), START, "the return was credited back once");
    let other_id = payout_event("evt_2", "payout.reversed", &key, 700);
    assert!(event(&s, secret, &other_id, None).json()["outcome"].as_str().unwrap().contains("nothing to do"));
    assert_eq!(balance(&db, "A"), START, "a second event of the same return credited again");
    // the POST replays its 201; GET shows the return
    let again = pay(&s, "p-1", &payout("bob", 700));
    assert_eq!((again.status, &again.body), (201, &paid.body));
    let shown = read(
        Serve::agent()
            .get(format!("{}{}", s.url, paid.header("location").unwrap()))
            .header("Authorization", "Bearer tok")
            .call(),
    );
    assert_eq!(shown.json()["state"], "returned", "{}", shown.body);
    // an event for no payout, or with another amount, moves no money: a person's
    let stray = event(&s, secret, &payout_event("evt_3", "payout.returned", "no-such-key", 700), None);
    assert!(stray.json()["outcome"].as_str().unwrap().starts_with("needs a person"), "{}", stray.body);
    assert_eq!(pay(&s, "p-2", &payout("bob", 300)).status, 201);
    let key2 = payouts(&db)[1].2.clone();
    let wrong = event(&s, secret, &payout_event("evt_4", "payout.returned", &key2, 3000), None);
    assert!(wrong.json()["outcome"].as_str().unwrap().starts_with("needs a person"), "{}", wrong.body);
    // both wait in the person's queue
    let (ok, strays, _) = payouts_cmd(&db, &["strays"]);
    let ids: Vec<&str> = strays.iter().map(|e| e["event_id"].as_str().unwrap()).collect();
    assert!(ok && ids == ["evt_3", "evt_4"], "{strays:?}");
    assert_eq!(balance(&db, "A"), START - 300);
    // reordered: a payout whose answer was lost is returned, then its paid event arrives
    let lossy = Gateway::start(&["--drop-answer", "100"]);
    let s2 = serve(&db, &lossy.url, &["--gateway-events-secret", "whsec_test_0123456789abcdef"]);
    assert_eq!(pay(&s2, "p-3", &payout("bob", 50)).status, 202);
    let key3 = payouts(&db)[2].2.clone();
    event(&s2, secret, &payout_event("evt_5", "payout.returned", &key3, 50), None);
    event(&s2, secret, &payout_event("evt_6", "payout.paid", &key3, 50), None);
    assert_eq!(payouts(&db)[2].1, "failed", "the money came back: paid-then-returned is not paid");
    assert_eq!(balance(&db, "A"), START - 300, "p-3's hold released once");
    assert!(!stray_ids(&db).contains(&"evt_6".to_owned()), "a reordered paid is no contradiction");
    // refused, its hold released; then the provider says it paid: the money is
    // out twice, and that is a person's (it was "nothing to do")
    pay(&s, "p-4", &payout("closed-bob", 40));
    let (key4, state4) = (payouts(&db)[3].2.clone(), payouts(&db)[3].1.clone());
    assert_eq!((state4.as_str(), balance(&db, "A")), ("failed", START - 300), "refused, released");
    let late = event(&s, secret, &payout_event("evt_7", "payout.paid", &key4, 40), None);
    assert!(late.json()["outcome"].as_str().unwrap().starts_with("needs a person"), "{}", late.body);
    assert_eq!(stray_ids(&db), ["evt_3", "evt_4", "evt_7"]);
    // counted for an alert, each once: a duplicate delivery is not counted again
    event(&s, secret, &payout_event("evt_7", "payout.paid", &key4, 40), None);
    let metrics = read(Serve::agent().get(format!("{}/metrics", s.url)).call()).body;
    assert!(metrics.contains("\nidem_gateway_events_for_a_person_total 3\n"), "{metrics}");
}

fn stray_ids(db: &Path) -> Vec<String> {
    let (ok, strays, err) = payouts_cmd(db, &["strays"]);
    assert!(ok, "{err}");
    strays.iter().map(|e| e["event_id"].as_str().unwrap().to_owned()).collect()
}

#[test]
fn the_metrics_count_payouts_per_state_their_oldest_age_and_their_sends() {
    let (_dir, db) = bank();
    let lossy = Gateway::start(&["--lose-request", "100"]);
    let s = Serve::start(
        &db,
        &[("tok", "shop")],
        &["--gateway", &lossy.url, "--gateway-timeout", "2s", "--reconcile-every", "400ms"],
        &[],
    );
    assert_eq!(pay(&s, "p-1", &payout("bob", 10)).status, 202);
    assert_eq!(pay(&s, "p-2", &payout("bob", 20)).status, 202);
    // the reconciler runs, resends each once (lost again), and counts
    let deadline = Instant::now() + Duration::from_secs(10);
    let metrics = loop {
        let text = read(Serve::agent().get(format!("{}/metrics", s.url)).call()).body;
        if text.contains("idem_payout_sends{state=\"unknown\",of=\"most\"} 2") || Instant::now() > deadline {
            break text;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    for line in [
        "idem_payouts{state=\"unknown\"} 2",
        "idem_payouts{state=\"completed\"} 0",
        "idem_payout_sends{state=\"unknown\",of=\"all\"} 4",
        "idem_payout_sends{state=\"unknown\",of=\"most\"} 2",
    ] {
        assert!(metrics.contains(line), "{line} missing:\n{metrics}");
    }
    assert!(metrics.contains("idem_payout_oldest_age_seconds{state=\"unknown\"} "), "{metrics}");
}

/// A provider that signs as the Standard Webhooks specification says
/// (`webhook-id`, `webhook-timestamp`, `webhook-signature: v1,<base64>`,
/// a `whsec_` secret whose base64 is the key): its return is credited back
/// once, the message's id being the event's (its body has none), a
/// redelivery of the same message changes nothing, and a forged, stale or
/// half-signed one is refused 401 with nothing changed.
#[test]
fn a_standard_webhooks_event_is_verified_and_applied_once() {
    let (_dir, db) = bank();
    let gw = Gateway::start(&[]);
    // idem's side mid-rotation: the new secret, and the previous one beside it
    let (secret, previous) =
        ("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "whsec_cHJldmlvdXMtc2VjcmV0LW9mLXRoZS1zaG9w");
    let s = serve(
        &db,
        &gw.url,
        &["--gateway-events-secret", secret, "--gateway-events-secret-previous", previous],
    );
    assert_eq!(pay(&s, "p-std", &payout("bob", 300)).status, 201);
    let key = payouts(&db)[0].2.clone();
    let body = serde_json::json!({"type": "payout.returned", "data": {"key": key, "id": "po_9", "amount": 300, "currency": "KRW", "reason": "bounced_back"}}).to_string();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
    let send = |id: &str, t: i64, signature: Option<String>| {
        let mut req = Serve::agent()
            .post(format!("{}/v1/gateway-events", s.url))
            .header("webhook-id", id)
            .header("webhook-timestamp", t.to_string().as_str());
        if let Some(signature) = signature {
            req = req.header("webhook-signature", signature.as_str());
        }
        read(req.header("Content-Type", "application/json").send(body.as_str()))
    };
    let sign = |id: &str, t: i64, secret: &str| {
        Some(idem::payout::sign_standard(secret.as_bytes(), id, body.as_bytes(), t))
    };
    assert_eq!(
        send("msg_1", now, sign("msg_1", now, "whsec_AAAAAAAAAAAAAAAAAAAAAAAA")).status,
        401,
        "another secret"
    );
    assert_eq!(send("msg_1", now - 3600, sign("msg_1", now - 3600, secret)).status, 401, "stale");
    assert_eq!(send("msg_1", now, sign("msg_2", now, secret)).status, 401, "signed for another message");
    assert_eq!(send("msg_1", now, None).status, 401, "no signature");
    assert_eq!(balance(&db, "A"), START - 300, "a refused event changed money");
    // signed with the previous secret, still taken while the rotation lasts
    let first = send("msg_1", now, sign("msg_1", now, previous));
    assert_eq!((first.status, first.json()["duplicate"].as_bool()), (200, Some(false)), "{}", first.body);
    let again = send("msg_1", now, sign("msg_1", now, secret));
    assert_eq!(again.json()["duplicate"], true, "{}", again.body);
    assert_eq!(balance(&db, "A"), START, "the return was credited back once");
}
