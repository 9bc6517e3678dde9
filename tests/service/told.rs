//! Telling idem's clients what became of their payouts: a real `idem serve`
//! with a real `idem gateway` that leaves every answer unsent (each payout
//! answered 202) and returns every payment a second later, and a receiver
//! of the client's own on loopback that is down at first, then answers 503
//! to every third delivery and drops the answer of every fifth after
//! reading it. Each test asserts what a sender that lost an event, told a
//! change twice under two ids, signed it wrongly, or wrote it outside the
//! change's transaction would get wrong.

use crate::payouts::bank_on;
use crate::server::{Gateway, IDEM, Serve};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const PAYOUTS: usize = 6;

/// One delivery the receiver read: its headers (lowercase) and body.
type Delivery = (BTreeMap<String, String>, String);

/// The client's receiver on `listener`, down until `after` has passed (each
/// connection closed at once, unread: the port is kept, so no other test
/// can take it meanwhile); then every delivery it reads is kept; the third
/// of each three is answered 503, the fifth of each five is read, kept and
/// closed unanswered, the rest 204.
fn receiver(listener: TcpListener, after: Duration, got: Arc<Mutex<Vec<Delivery>>>) {
    let up = Instant::now() + after;
    std::thread::spawn(move || {
        let mut n = 0;
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            if Instant::now() < up {
                continue; // down: dropped unread
            }
            n += 1;
            let Some((headers, body)) = read_delivery(&stream) else { continue };
            got.lock().unwrap().push((headers, String::from_utf8(body).unwrap()));
            let answer: &[u8] = match n {
                k if k % 5 == 0 => continue, // read, kept, the answer lost
                k if k % 3 == 0 => {
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                }
                _ => b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n",
            };
            let _ = stream.write_all(answer);
        }
    });
}

/// One delivery read from `stream`: its headers (lowercase) and its body;
/// `None` when the body did not arrive whole.
fn read_delivery(stream: &std::net::TcpStream) -> Option<(BTreeMap<String, String>, Vec<u8>)> {
    let mut reader = BufReader::new(stream.try_clone().ok()?);
    let mut headers = BTreeMap::new();
    let mut line = String::new();
    while reader.read_line(&mut line).unwrap_or(0) > 2 {
        if let Some((name, value)) = line.trim_end().split_once(": ") {
            headers.insert(name.to_ascii_lowercase(), value.to_owned());
        }
        line.clear();
    }
    let length = headers.get("content-length").and_then(|l| l.parse().ok()).unwrap_or(0);
    let mut body = vec![0; length];
    reader.read_exact(&mut body).ok()?;
    Some((headers, body))
}

/// `idem payouts ARGS --db DB`: whether it succeeded, and its JSON lines.
fn payouts_cmd(db: &Path, args: &[&str]) -> (bool, Vec<Value>) {
    let (ok, lines, _) = crate::payouts::payouts_cmd(db, args);
    (ok, lines)
}

fn pay(s: &Serve, token: &str, key: &str) -> u16 {
    let body = r#"{"src": "A", "beneficiary": "bob", "amount": 700, "currency": "KRW"}"#;
    let req = Serve::agent()
        .post(format!("{}/v1/payouts", s.url))
        .header("Authorization", format!("Bearer {token}"))
        .header("Idempotency-Key", format!("\"{key}\""))
        .header("Content-Type", "application/json");
    crate::server::read(req.send(body)).status
}

#[test]
fn every_change_a_client_was_not_answered_reaches_it_signed_once_per_id_through_a_lossy_receiver() {
    told(false);
}

#[test]
fn on_postgres_every_change_a_client_was_not_answered_reaches_it_signed_once_per_id() {
    told(true);
}

fn told(pg: bool) {
    let Some((dir, db)) = bank_on(pg) else { return };
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let hooks = dir.path().join("hooks.json");
    let hook =
        serde_json::json!({"shop": {"url": format!("http://127.0.0.1:{port}/hooks"), "secret": SECRET}});
    std::fs::write(&hooks, hook.to_string()).unwrap();
    let gw = Gateway::start(&["--drop-answer", "100", "--returns", "100", "--return-after", "1s"]);
    let s = Serve::start(
        &db,
        &[("tok", "shop"), ("tok2", "shop2")],
        &[
            "--gateway",
            &gw.url,
            "--gateway-timeout",
            "2s",
            "--reconcile-every",
            "1s",
            "--gateway-backoff",
            "100ms",
            "--gateway-return-check",
            "1s",
            "--client-events",
            hooks.to_str().unwrap(),
            "--client-events-retry",
            "200ms",
            "--client-events-allow-private",
        ],
        &[],
    );
    let got = Arc::new(Mutex::new(Vec::new()));
    receiver(listener, Duration::from_secs(2), got.clone());
    for i in 0..PAYOUTS {
        assert_eq!(pay(&s, "tok", &format!("p{i}")), 202, "the gateway's answer is lost: 202");
    }
    // shop2 has no endpoint: its events are failed at once, for a person
    assert_eq!(pay(&s, "tok2", "q"), 202);

    // what the client was not told in an answer, from each payout's audit
    // trail: every change made by another than the request (its reconciler,
    // here: paid then returned, or found returned at once), once each payout
    // is settled for good
    let untold = || -> Option<BTreeSet<(i64, String)>> {
        let mut untold = BTreeSet::new();
        for id in 1..=PAYOUTS as i64 {
            let (ok, shown) = payouts_cmd(&db, &["show", &id.to_string()]);
            assert!(ok && shown[0]["client_id"] == "shop", "{shown:?}");
            if !["failed", "returned"].contains(&shown[0]["state"].as_str().unwrap()) {
                return None;
            }
            for e in shown[0]["events"].as_array().unwrap() {
                if e["actor"].as_str().unwrap().starts_with("reconciler:") && e["was"] != e["now"] {
                    untold.insert((id, e["now"].as_str().unwrap().to_owned()));
                }
            }
        }
        Some(untold)
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let (wanted, delivered) = loop {
        let (ok, lines) = payouts_cmd(&db, &["client-events", "--delivery", "delivered"]);
        assert!(ok);
        let done: BTreeSet<(i64, String)> = lines
            .iter()
            .map(|e| {
                (e["data"]["payout_id"].as_i64().unwrap(), e["data"]["state"].as_str().unwrap().to_owned())
            })
            .collect();
        match untold() {
            Some(wanted) if wanted == done => break (wanted, lines),
            wanted if Instant::now() > deadline => {
                panic!("untold {wanted:?}, delivered {done:?}\n{}", s.log())
            }
            _ => std::thread::sleep(Duration::from_millis(300)),
        }
    };
    assert!(wanted.len() >= PAYOUTS, "each payout was settled by its reconciler: {wanted:?}");
    let got = got.lock().unwrap().clone();
    assert_eq!(delivered.len(), wanted.len(), "{delivered:#?}");

    // what the receiver read: each change under one id, signed, whole
    let mut ids: BTreeMap<String, (i64, String)> = BTreeMap::new();
    for (headers, body) in &got {
        let id = &headers["webhook-id"];
        let t: i64 = headers["webhook-timestamp"].parse().unwrap();
        let now =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
        assert!((now - t).abs() < 300, "a stale timestamp: {t}");
        let signature = idem::payout::sign_standard(SECRET.as_bytes(), id, body.as_bytes(), t);
        assert_eq!(headers["webhook-signature"], signature, "{id}: the signature does not verify");
        let v: Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["id"], id.as_str());
        assert_eq!(v["type"], format!("payout.{}", v["data"]["state"].as_str().unwrap()));
        assert_eq!((v["data"]["amount"].as_i64(), v["data"]["currency"].as_str()), (Some(700), Some("KRW")));
        let change =
            (v["data"]["payout_id"].as_i64().unwrap(), v["data"]["state"].as_str().unwrap().to_owned());
        let first = ids.entry(id.clone()).or_insert_with(|| change.clone());
        assert_eq!(*first, change, "one id named two changes");
    }
    let changes: BTreeSet<(i64, String)> = ids.values().cloned().collect();
    assert_eq!(changes, wanted, "a change never reached the receiver");
    assert_eq!(ids.len(), wanted.len(), "a change was told under two ids");
    assert!(got.len() > ids.len(), "the receiver's 503s and lost answers made no redelivery: {}", got.len());

    // shop2's events: failed, logged, redelivered on a person's word
    let (_, failed) = payouts_cmd(&db, &["client-events", "--delivery", "failed"]);
    assert!(!failed.is_empty() && failed.iter().all(|e| e["client_id"] == "shop2"), "{failed:#?}");
    let n = failed[0]["seq"].as_i64().unwrap();
    let (ok, log) = payouts_cmd(&db, &["deliveries", &n.to_string()]);
    assert!(ok && log.len() == 1 && log[0]["outcome"].as_str().unwrap().contains("no endpoint"), "{log:#?}");
    assert!(payouts_cmd(&db, &["redeliver", &n.to_string()]).0);
    assert!(!payouts_cmd(&db, &["redeliver", "999999"]).0, "no such event: exit 1");
    let deadline = Instant::now() + Duration::from_secs(10);
    while payouts_cmd(&db, &["deliveries", &n.to_string()]).1.len() < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(payouts_cmd(&db, &["deliveries", &n.to_string()]).1.len(), 2, "redelivered once more");
    // the counts the sender keeps after each round
    let pending_none = "idem_client_events{delivery=\"pending\"} 0";
    let deadline = Instant::now() + Duration::from_secs(5);
    while !s.get("/metrics", None).body.contains(pending_none) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(200));
    }
    let metrics = s.get("/metrics", None).body;
    let failed_count = format!("idem_client_events{{delivery=\"failed\"}} {}", failed.len());
    assert!(metrics.contains(pending_none) && metrics.contains(&failed_count), "{metrics}");
}

/// A payout database from before clients were told (its audit trail
/// without the delivery columns) is brought up to date on first use, its
/// old changes told to nobody (no flood of old events), then tells anew.
#[test]
fn an_audit_trail_from_before_clients_were_told_gets_its_columns_and_no_old_event_is_sent() {
    for pg in [false, true] {
        let Some((_dir, db)) = bank_on(pg) else { continue };
        let old = "CREATE TABLE payout_event (event_id bigint PRIMARY KEY, payout_id bigint NOT NULL,
                       at text NOT NULL, actor text NOT NULL, was text NOT NULL, now text NOT NULL, why text NOT NULL);
                   INSERT INTO payout_event VALUES (1, 1, '2026-11-01T00:00:00.000000Z', 'reconciler:x',
                       'unknown', 'completed', 'paid at the gateway: completed')";
        match pg {
            true => crate::common::pg::client(db.to_str().unwrap()).batch_execute(old).unwrap(),
            false => rusqlite::Connection::open(&db).unwrap().execute_batch(old).unwrap(),
        }
        let (ok, events) = payouts_cmd(&db, &["client-events"]);
        assert!(ok && events.is_empty(), "pg {pg}: {events:?}");
        let delivery = "SELECT delivery FROM payout_event WHERE event_id = 1";
        let kept: String = match pg {
            true => crate::common::pg::client(db.to_str().unwrap()).query_one(delivery, &[]).unwrap().get(0),
            false => rusqlite::Connection::open(&db).unwrap().query_row(delivery, [], |r| r.get(0)).unwrap(),
        };
        assert_eq!(kept, "none", "pg {pg}");
    }
}

/// A client events file that would let anyone forge events, or send them
/// nowhere, is refused at start, naming the client and why.
#[test]
fn a_client_events_file_with_a_short_secret_a_bad_url_or_a_client_twice_is_refused_at_start() {
    let (dir, db) = bank_on(false).unwrap();
    let gw = Gateway::start(&[]);
    let hooks = dir.path().join("hooks.json");
    let clients = dir.path().join("clients.json");
    std::fs::write(&clients, r#"{"tok": "shop"}"#).unwrap();
    // idem serve with the file and `args`: whether it started (printed its
    // URL), and what it said on stderr
    let refused = |args: &[&str]| {
        let out = Command::new(IDEM)
            .args(["serve", "--listen", "127.0.0.1:0", "--db"])
            .arg(&db)
            .arg("--clients")
            .arg(&clients)
            .arg("--client-events")
            .arg(&hooks)
            .args(args)
            .output()
            .unwrap();
        (out.status.success() || !out.stdout.is_empty(), String::from_utf8_lossy(&out.stderr).into_owned())
    };
    for (file, why) in [
        (r#"{"shop": {"url": "http://127.0.0.1:9/h", "secret": ""}}"#, "whsec_"),
        (r#"{"shop": {"url": "http://127.0.0.1:9/h", "secret": "whsec_c2hvcnQ="}}"#, "24 to 64"),
        (
            r#"{"shop": {"url": "http://127.0.0.1:9/h", "secret": "not-base64-at-all-but-long-enough"}}"#,
            "whsec_",
        ),
        (&format!(r#"{{"shop": {{"url": "ftp://x/h", "secret": "{SECRET}"}}}}"#), "http"),
        (
            &format!(r#"{{"shop": {{"url": "http://x/h", "secret": "{SECRET}", "retries": 3}}}}"#),
            "unknown field",
        ),
        (
            &format!(
                r#"{{"shop": {{"url": "http://x/a", "secret": "{SECRET}"}}, "shop": {{"url": "http://x/b", "secret": "{SECRET}"}}}}"#
            ),
            "twice",
        ),
    ] {
        std::fs::write(&hooks, file).unwrap();
        let (ok, err) = refused(&["--gateway", &gw.url]);
        assert!(!ok && err.contains(why), "{file}: {err}");
    }
    // and without --gateway there is nothing to tell
    std::fs::write(&hooks, format!(r#"{{"shop": {{"url": "http://x/a", "secret": "{SECRET}"}}}}"#)).unwrap();
    let (ok, err) = refused(&[]);
    assert!(!ok && err.contains("needs --gateway"), "{err}");
}

/// One request a scripted receiver read: when, its headers (lowercase).
type Heard = (Instant, BTreeMap<String, String>, String);

/// A receiver on `listener` that answers its n-th request with
/// `answers[n]` (the last one again past the end); what it heard.
fn scripted(listener: TcpListener, answers: Vec<String>) -> Arc<Mutex<Vec<Heard>>> {
    let heard = Arc::new(Mutex::new(Vec::new()));
    let kept = heard.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let at = Instant::now();
            let Some((headers, body)) = read_delivery(&stream) else { continue };
            let n = {
                let mut heard = kept.lock().unwrap();
                heard.push((at, headers, String::from_utf8_lossy(&body).into_owned()));
                heard.len()
            };
            let answer = &answers[(n - 1).min(answers.len() - 1)];
            let _ = stream.write_all(answer.as_bytes());
        }
    });
    heard
}

/// A service with one payout whose answer the gateway loses: its
/// reconciler settles it, and client `shop` is told at `hook` (its entry
/// in the client events file), with `extra` arguments.
fn told_of_one(hook: Value, extra: &[&str]) -> (tempfile::TempDir, std::path::PathBuf, Gateway, Serve) {
    told_of_one_on(false, hook, extra).unwrap()
}

/// [`told_of_one`] on SQLite or (`pg`) PostgreSQL; `None` without it.
fn told_of_one_on(
    pg: bool,
    hook: Value,
    extra: &[&str],
) -> Option<(tempfile::TempDir, std::path::PathBuf, Gateway, Serve)> {
    let (dir, db) = bank_on(pg)?;
    let (gw, s) =
        serve_telling(dir.path(), &db, serde_json::json!({ "shop": hook }), &[("tok", "shop")], extra);
    assert_eq!(pay(&s, "tok", "one"), 202, "the gateway's answer is lost: 202");
    Some((dir, db, gw, s))
}

/// `idem serve` on `db` for `clients`, told of by `hooks` (the client
/// events file, written in `dir`), through a gateway that loses every
/// answer: each payout is settled by the reconciler, and its client told.
fn serve_telling(
    dir: &Path,
    db: &Path,
    hooks: Value,
    clients: &[(&str, &str)],
    extra: &[&str],
) -> (Gateway, Serve) {
    let file = dir.join("hooks.json");
    std::fs::write(&file, hooks.to_string()).unwrap();
    let gw = Gateway::start(&["--drop-answer", "100"]);
    let args = [
        &[
            "--gateway",
            &gw.url,
            "--gateway-timeout",
            "2s",
            "--reconcile-every",
            "300ms",
            "--gateway-backoff",
            "100ms",
            "--client-events",
            file.to_str().unwrap(),
            "--client-events-retry",
            "200ms",
        ][..],
        extra,
    ]
    .concat();
    let s = Serve::start(db, clients, &args, &[]);
    (gw, s)
}

/// The deliveries of the first client event, once there are `n` (or after 20 s).
fn deliveries(db: &Path, n: usize) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, events) = payouts_cmd(db, &["client-events"]);
        if let Some(e) = events.first() {
            let id = e["seq"].as_i64().unwrap().to_string();
            let (_, log) = payouts_cmd(db, &["deliveries", &id]);
            if log.len() >= n || Instant::now() > deadline {
                return log;
            }
        }
        assert!(Instant::now() < deadline, "no client event after 20 s");
        std::thread::sleep(Duration::from_millis(100));
    }
}

const NO_CONTENT: &str = "HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n";

/// A receiver that answers every delivery with a redirect to another
/// address (here a trap on loopback; in the wild a metadata address): the
/// redirect is a failed attempt, never a delivery, and nothing is sent to
/// where `Location` points. Standard Webhooks and Svix count every 3xx as
/// a failure; a sender that follows it records an event nobody received
/// and sends the `webhook-*` headers wherever a receiver says.
#[test]
fn a_redirecting_receiver_is_a_failed_delivery_and_its_location_is_never_called() {
    let trap = TcpListener::bind("127.0.0.1:0").unwrap();
    let trap_port = trap.local_addr().unwrap().port();
    trap.set_nonblocking(true).unwrap();
    let receiver = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://127.0.0.1:{}/hooks", receiver.local_addr().unwrap().port());
    let moved = format!(
        "HTTP/1.1 301 Moved Permanently\r\nLocation: http://127.0.0.1:{trap_port}/steal\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    let heard = scripted(receiver, vec![moved]);
    let hook = serde_json::json!({"url": url, "secret": SECRET});
    let (_dir, db, _gw, s) = told_of_one(hook, &["--client-events-allow-private"]);
    let log = deliveries(&db, 2);
    assert!(log.len() >= 2, "{log:#?}\n{}", s.log());
    assert!(log.iter().all(|d| d["outcome"].as_str().unwrap().contains("301")), "{log:#?}");
    let (ok, delivered) = payouts_cmd(&db, &["client-events", "--delivery", "delivered"]);
    assert!(ok && delivered.is_empty(), "a 301 was recorded delivered: {delivered:#?}");
    assert!(heard.lock().unwrap().len() >= 2);
    assert!(trap.accept().is_err(), "the sender followed the redirect to its Location");
}

/// A client's endpoint whose name resolves to an address of the inside
/// (here `localhost`; in the wild a name pointed at 169.254.169.254) is
/// refused before any connection unless the operator allows it.
#[test]
fn a_client_endpoint_that_resolves_inside_is_refused_unless_the_operator_allows_it() {
    let receiver = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://localhost:{}/hooks", receiver.local_addr().unwrap().port());
    let heard = scripted(receiver, vec![NO_CONTENT.into()]);
    let hook = serde_json::json!({"url": url, "secret": SECRET});
    let (_dir, db, _gw, s) = told_of_one(hook.clone(), &[]);
    let log = deliveries(&db, 2);
    assert!(log.len() >= 2, "{log:#?}\n{}", s.log());
    for d in &log {
        assert!(d["outcome"].as_str().unwrap().contains("inside addresses"), "{d}");
    }
    assert!(heard.lock().unwrap().is_empty(), "a connection reached the inside address");

    let (_dir, db, _gw, _s) = told_of_one(hook, &["--client-events-allow-private"]);
    let log = deliveries(&db, 1);
    assert_eq!(log[0]["outcome"], "HTTP 204", "{log:#?}");
}

/// While a client rolls its secret, each event is signed with both (two
/// signatures, space-separated, as Standard Webhooks has it): a receiver
/// on either secret verifies it. A 429 whose `Retry-After` asks for 2 s is
/// tried again no sooner, though the sender's own wait is 200 ms.
#[test]
fn a_rolled_secret_signs_with_both_and_a_429_retry_after_is_honoured() {
    const OLD: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    const NEW: &str = "whsec_C2FVsBQIhrscChlQIMV+b5sSYspob7oD";
    let receiver = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://127.0.0.1:{}/hooks", receiver.local_addr().unwrap().port());
    let busy =
        "HTTP/1.1 429 Too Many Requests\r\nRetry-After: 2\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
    let heard = scripted(receiver, vec![busy.into(), NO_CONTENT.into()]);
    let hook = serde_json::json!({"url": url, "secret": NEW, "previous_secret": OLD});
    let (_dir, db, _gw, s) = told_of_one(hook, &["--client-events-allow-private"]);
    let log = deliveries(&db, 2);
    assert_eq!(log.len(), 2, "{log:#?}\n{}", s.log());
    assert_eq!(
        (log[0]["outcome"].as_str(), log[1]["outcome"].as_str()),
        (Some("HTTP 429"), Some("HTTP 204"))
    );
    let heard = heard.lock().unwrap().clone();
    let waited = heard[1].0 - heard[0].0;
    assert!(waited >= Duration::from_millis(1900), "tried again after {waited:?}, asked 2 s");
    for (_, headers, body) in &heard {
        let (id, t) = (&headers["webhook-id"], headers["webhook-timestamp"].parse().unwrap());
        let signatures: Vec<&str> = headers["webhook-signature"].split(' ').collect();
        let expected: Vec<String> = [NEW, OLD]
            .iter()
            .map(|k| idem::payout::sign_standard(k.as_bytes(), id, body.as_bytes(), t))
            .collect();
        assert_eq!(signatures, expected, "signed with the new secret, then the old");
    }
}

/// Two deployments (or a database and its restored backup) each tell a
/// change numbered alike: the ids the clients see differ, so a receiver
/// that deduplicates by `webhook-id` drops neither; and each change keeps
/// its one id on every delivery.
#[test]
fn changes_numbered_alike_in_two_databases_are_told_under_two_ids_each_stable() {
    let mut seen = Vec::new();
    for _ in 0..2 {
        let receiver = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://127.0.0.1:{}/hooks", receiver.local_addr().unwrap().port());
        let busy = "HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
        let heard = scripted(receiver, vec![busy.into(), NO_CONTENT.into()]);
        let hook = serde_json::json!({"url": url, "secret": SECRET});
        let (_dir, db, _gw, _s) = told_of_one(hook, &["--client-events-allow-private"]);
        assert_eq!(deliveries(&db, 2).len(), 2);
        let (_, events) = payouts_cmd(&db, &["client-events"]);
        let heard = heard.lock().unwrap().clone();
        let ids: Vec<&str> = heard.iter().map(|(_, h, _)| h["webhook-id"].as_str()).collect();
        assert_eq!(ids, [events[0]["id"].as_str().unwrap(); 2], "one id on every delivery");
        seen.push((events[0]["seq"].as_i64().unwrap(), ids[0].to_owned()));
    }
    assert_eq!(seen[0].0, seen[1].0, "both databases numbered the change alike");
    assert_ne!(seen[0].1, seen[1].1, "two changes told under one id");
}

/// Every client on a lane of its own: one client's endpoint hangs (reads
/// each delivery, never answers) with a backlog of twenty events, and
/// another client's event made meanwhile still arrives within a round or
/// two; no round waits for the hung one's deadline (15 s).
#[test]
fn a_hung_endpoint_with_a_backlog_does_not_hold_another_clients_events() {
    let (dir, db) = bank_on(false).unwrap();
    let hung = TcpListener::bind("127.0.0.1:0").unwrap();
    let hung_url = format!("http://127.0.0.1:{}/hooks", hung.local_addr().unwrap().port());
    let held = Arc::new(Mutex::new(Vec::new()));
    let holding = held.clone();
    std::thread::spawn(move || {
        for stream in hung.incoming().flatten() {
            holding.lock().unwrap().push(stream); // read by nobody, answered never
        }
    });
    let prompt = TcpListener::bind("127.0.0.1:0").unwrap();
    let prompt_url = format!("http://127.0.0.1:{}/hooks", prompt.local_addr().unwrap().port());
    let heard = scripted(prompt, vec![NO_CONTENT.into()]);
    let hooks = serde_json::json!({"shop": {"url": hung_url, "secret": SECRET}, "shop2": {"url": prompt_url, "secret": SECRET}});
    let clients = [("tok", "shop"), ("tok2", "shop2")];
    let (_gw, s) = serve_telling(dir.path(), &db, hooks, &clients, &["--client-events-allow-private"]);
    for i in 0..20 {
        assert_eq!(pay(&s, "tok", &format!("backlog-{i}")), 202);
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while held.lock().unwrap().is_empty() {
        assert!(Instant::now() < deadline, "the hung endpoint was never called\n{}", s.log());
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(1500)); // the hung delivery is well under way
    let paid = Instant::now();
    assert_eq!(pay(&s, "tok2", "other"), 202);
    while heard.lock().unwrap().is_empty() {
        assert!(paid.elapsed() < Duration::from_secs(20), "the other client was never told");
        std::thread::sleep(Duration::from_millis(20));
    }
    let waited = heard.lock().unwrap()[0].0 - paid;
    eprintln!(
        "another client's event, beside a hung endpoint with a backlog of 20: told {waited:?} after its payout"
    );
    assert!(
        waited < Duration::from_secs(4),
        "the other client's event waited {waited:?} behind the hung endpoint"
    );
}

/// Waits up to 10 s for `done` to hold of what `heard` holds.
fn until_heard(heard: &Arc<Mutex<Vec<Heard>>>, done: impl Fn(&[Heard]) -> bool) -> Vec<Heard> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let now = heard.lock().unwrap().clone();
        if done(&now) || Instant::now() > deadline {
            return now;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A 410 Gone disables the client's endpoint at once: no more tries, its
/// events wait, pending; a log line, the metric, and `idem payouts
/// endpoints` say so. A person enables it, and the event goes out; after
/// the client's outage, `redeliver --since` sends it again under its id.
#[test]
fn a_410_disables_the_endpoint_until_a_person_enables_it_and_redeliver_since_sends_again() {
    gone(false);
}

#[test]
fn on_postgres_a_410_disables_the_endpoint_until_a_person_enables_it_and_redeliver_since_sends_again() {
    gone(true);
}

fn gone(pg: bool) {
    let receiver = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://127.0.0.1:{}/hooks", receiver.local_addr().unwrap().port());
    let gone = "HTTP/1.1 410 Gone\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
    let heard = scripted(receiver, vec![gone.into(), NO_CONTENT.into()]);
    let hook = serde_json::json!({"url": url, "secret": SECRET});
    let before = idem::clock::Timestamp::now().to_string();
    let Some((_dir, db, _gw, s)) = told_of_one_on(pg, hook, &["--client-events-allow-private"]) else {
        return;
    };
    let log = deliveries(&db, 1);
    assert_eq!(log[0]["outcome"], "HTTP 410", "{log:#?}");
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(heard.lock().unwrap().len(), 1, "tried again after a 410");
    let (ok, disabled) = payouts_cmd(&db, &["endpoints"]);
    assert!(ok && disabled.len() == 1 && disabled[0]["client_id"] == "shop", "{disabled:?}");
    assert!(disabled[0]["reason"].as_str().unwrap().contains("410"), "{disabled:?}");
    let (_, pending) = payouts_cmd(&db, &["client-events", "--delivery", "pending"]);
    assert_eq!(pending.len(), 1, "the event waits, pending");
    assert!(s.log_when(|l| l.contains("client_endpoint_disabled")).contains("client_endpoint_disabled"));
    assert!(s.get("/metrics", None).body.contains("idem_client_endpoints_disabled 1\n"));

    assert!(payouts_cmd(&db, &["enable", "shop"]).0);
    assert!(!payouts_cmd(&db, &["enable", "shop"]).0, "enabled twice: exit 1");
    let got = until_heard(&heard, |h| h.len() >= 2);
    assert_eq!(got.len(), 2, "not sent after the endpoint was enabled");
    assert_eq!(got[0].1["webhook-id"], got[1].1["webhook-id"]);
    assert!(payouts_cmd(&db, &["endpoints"]).1.is_empty());
    let (_, delivered) = payouts_cmd(&db, &["client-events", "--delivery", "delivered"]);
    assert_eq!(delivered.len(), 1, "{delivered:?}");

    let (ok, again) = payouts_cmd(&db, &["redeliver", "--since", &before, "--client", "shop"]);
    assert!(ok && again[0]["pending"] == 1, "{again:?}");
    let (ok, none) = payouts_cmd(&db, &["redeliver", "--since", &before, "--client", "nobody"]);
    assert!(ok && none[0]["pending"] == 0, "{none:?}");
    let got = until_heard(&heard, |h| h.len() >= 3);
    assert_eq!(got.len(), 3, "not sent again after redeliver --since");
    assert_eq!(got[2].1["webhook-id"], got[0].1["webhook-id"], "one id on every delivery");
}

/// An endpoint whose every delivery fails past `--client-events-disable-after`
/// is disabled, and tried no more.
#[test]
fn an_endpoint_failing_past_its_span_is_disabled_and_tried_no_more() {
    let receiver = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://127.0.0.1:{}/hooks", receiver.local_addr().unwrap().port());
    let broken = "HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
    let heard = scripted(receiver, vec![broken.into()]);
    let hook = serde_json::json!({"url": url, "secret": SECRET});
    let args = ["--client-events-allow-private", "--client-events-disable-after", "2s"];
    let (_dir, db, _gw, _s) = told_of_one(hook, &args);
    let deadline = Instant::now() + Duration::from_secs(15);
    let disabled = loop {
        let (_, disabled) = payouts_cmd(&db, &["endpoints"]);
        if !disabled.is_empty() || Instant::now() > deadline {
            break disabled;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(disabled.len(), 1, "never disabled");
    assert!(disabled[0]["reason"].as_str().unwrap().contains("every delivery failed since"), "{disabled:?}");
    let tries = heard.lock().unwrap().len();
    assert!(tries >= 3, "disabled after {tries} tries: the span is 2 s of failures");
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(heard.lock().unwrap().len(), tries, "tried after it was disabled");
}

/// A receiver of client events over TLS, with a certificate of its own:
/// answers 204 to each delivery it reads whole; the `webhook-id`s read.
fn tls_receiver(identity: &idem::https::Identity) -> (String, Arc<Mutex<Vec<String>>>) {
    use tokio_rustls::rustls;
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("https://127.0.0.1:{}/hooks", listener.local_addr().unwrap().port());
    let (config, heard) = (identity.server_config(), Arc::new(Mutex::new(Vec::new())));
    let kept = heard.clone();
    std::thread::spawn(move || {
        for tcp in listener.incoming().flatten() {
            let Ok(conn) = rustls::ServerConnection::new(config.clone()) else { continue };
            let mut tls = rustls::StreamOwned::new(conn, tcp);
            let mut got = Vec::new();
            let mut chunk = [0u8; 4096];
            let whole = loop {
                match tls.read(&mut chunk) {
                    Ok(0) | Err(_) => break None,
                    Ok(n) => got.extend_from_slice(&chunk[..n]),
                }
                let text = String::from_utf8_lossy(&got).into_owned();
                let Some((head, body)) = text.split_once("\r\n\r\n") else { continue };
                let length = head
                    .lines()
                    .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length: ").map(str::to_owned))
                    .and_then(|l| l.trim().parse::<usize>().ok())
                    .unwrap_or(0);
                if body.len() >= length {
                    break Some(head.to_owned());
                }
            };
            let Some(head) = whole else { continue };
            let id = head
                .lines()
                .find_map(|l| l.to_ascii_lowercase().strip_prefix("webhook-id: ").map(str::to_owned));
            kept.lock().unwrap().push(id.unwrap_or_default());
            let _ = tls.write_all(NO_CONTENT.as_bytes());
            tls.conn.send_close_notify();
            let _ = tls.flush();
        }
    });
    (url, heard)
}

/// A client event goes out over TLS to a receiver whose certificate the
/// operator trusts (`--ca-file`): delivered, under its id. Without that
/// trust, nothing is delivered and the attempt says TLS.
#[test]
fn a_client_event_goes_out_over_https_to_a_receiver_the_operator_trusts() {
    let identity = idem::https::Identity::self_signed(&["127.0.0.1".to_owned()]).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("receiver.pem");
    std::fs::write(&ca, &identity.cert_pem).unwrap();
    let (url, heard) = tls_receiver(&identity);
    let hook = serde_json::json!({"url": url, "secret": SECRET});
    let args = ["--client-events-allow-private", "--ca-file", ca.to_str().unwrap()];
    let (_dir, db, _gw, s) = told_of_one(hook.clone(), &args);
    let log = deliveries(&db, 1);
    assert_eq!(log[0]["outcome"], "HTTP 204", "{log:#?}\n{}", s.log());
    let (_, events) = payouts_cmd(&db, &["client-events", "--delivery", "delivered"]);
    assert_eq!(heard.lock().unwrap().clone(), [events[0]["id"].as_str().unwrap()]);

    let (_dir, db, _gw, _s) = told_of_one(hook, &["--client-events-allow-private"]);
    let log = deliveries(&db, 1);
    assert!(log[0]["outcome"].as_str().unwrap().contains("TLS: "), "{log:#?}");
    assert_eq!(heard.lock().unwrap().len(), 1, "a delivery went through without trust");
}
