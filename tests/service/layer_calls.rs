//! A handler that pays through a provider, behind the layer: the intent
//! commits with the key and the money held, the call is made with no
//! transaction open and no connection held, its result settles the key,
//! and the recovery job finishes what a lost answer, a 5xx or a service
//! stopped between call and result left. The provider is `idem gateway`, a
//! real process on loopback whose ledger says what was really paid. Each
//! test asserts what a layer that called inside the transaction, paid
//! twice, or lost a payout gets wrong.

use crate::server::Gateway;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Router, routing::post};
use idem::check::http::{Http, exchange};
use idem::embed::Keys;
use idem::embed::layer::{Idempotency, IdempotencyLayer, Outcome, Outside, Settled, Tx, business};
use idem::payout::HttpGateway;
use idem::provider::{Call, Intent, Limits, Lookup, Provider};
use serde_json::{Value, json};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// What the handlers run on: SQLite's one connection, or PostgreSQL.
#[derive(Clone)]
enum Db {
    Lite(String),
    Pg(String),
    /// PostgreSQL through the service's own sqlx pool.
    SqlxPg(String),
}

impl Db {
    fn setup(&self) {
        let sql = "CREATE TABLE wallet (id TEXT PRIMARY KEY, balance BIGINT NOT NULL, held BIGINT NOT NULL);
                   CREATE TABLE payouts (downstream TEXT PRIMARY KEY, amount BIGINT NOT NULL, state TEXT NOT NULL);
                   CREATE TABLE orders (n BIGINT);
                   INSERT INTO wallet VALUES ('w', 100000, 0)";
        match self {
            Db::Lite(file) => rusqlite::Connection::open(file).unwrap().execute_batch(sql).unwrap(),
            Db::Pg(spec) | Db::SqlxPg(spec) => {
                postgres::Client::connect(spec, postgres::NoTls).unwrap().batch_execute(sql).unwrap()
            }
        }
    }

    /// (balance, held, paid) of the wallet, and the payouts by state.
    fn money(&self) -> (i64, i64, i64) {
        let sql = "SELECT balance, held, (SELECT CAST(coalesce(sum(amount), 0) AS BIGINT) FROM payouts WHERE state = 'paid')
                   FROM wallet";
        match self {
            Db::Lite(file) => rusqlite::Connection::open(file)
                .unwrap()
                .query_row(sql, [], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
                .unwrap(),
            Db::Pg(spec) | Db::SqlxPg(spec) => {
                let row =
                    postgres::Client::connect(spec, postgres::NoTls).unwrap().query_one(sql, &[]).unwrap();
                (row.get(0), row.get(1), row.get::<_, i64>(2))
            }
        }
    }

    async fn layer(&self, pool: usize, outside: Outside) -> Idempotency {
        let spec = match self {
            Db::Lite(file) => file.clone(),
            Db::Pg(spec) => spec.clone(),
            Db::SqlxPg(spec) => {
                let options = crate::common::pg::sqlx_options(spec);
                let pool = sqlx::postgres::PgPoolOptions::new()
                    .max_connections(u32::try_from(pool).unwrap())
                    .connect_with(options)
                    .await
                    .unwrap();
                let keys = Keys::new("c_").unwrap();
                let idem = Idempotency::on_sqlx_postgres(pool, keys, |_| Some("c1".into())).await.unwrap();
                return idem.outside(outside);
            }
        };
        Idempotency::connect(&spec, Keys::new("c_").unwrap(), pool, |_| Some("c1".into()))
            .await
            .unwrap()
            .outside(outside)
    }
}

/// Runs `sql` with `args` in the request's transaction, on whichever store
/// it is; the first column of the first row, if any.
async fn run(tx: &Tx, sql: &str, args: &[i64], text: &[&str]) -> Option<i64> {
    if let Some(c) = tx.sqlite().await {
        let mut params: Vec<&dyn rusqlite::ToSql> = args.iter().map(|a| a as &dyn rusqlite::ToSql).collect();
        params.extend(text.iter().map(|t| t as &dyn rusqlite::ToSql));
        let sql = sql.replace('$', "?");
        let mut st = c.prepare(&sql).unwrap();
        let mut rows = st.query(&params[..]).unwrap();
        return rows.next().unwrap().map(|r| r.get(0).unwrap());
    }
    if let Some(mut c) = tx.sqlx_postgres().await {
        let mut q = sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(sql.to_owned()));
        for a in args {
            q = q.bind(*a);
        }
        for t in text {
            q = q.bind(t.to_string());
        }
        return q.fetch_optional(&mut *c).await.unwrap();
    }
    let c = tx.client().await.unwrap();
    let mut params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> =
        args.iter().map(|a| a as &(dyn tokio_postgres::types::ToSql + Sync)).collect();
    params.extend(text.iter().map(|t| t as &(dyn tokio_postgres::types::ToSql + Sync)));
    c.query(sql, &params).await.unwrap().first().map(|r| r.get(0))
}

/// `POST /pay {"beneficiary", "amount", "currency"}`: the money held, the
/// call declared, 202 until its result is known.
async fn pay(tx: Tx, body: String) -> Response {
    let v: Value = serde_json::from_str(&body).unwrap();
    let amount = v["amount"].as_i64().unwrap();
    let held = run(
        &tx,
        "UPDATE wallet SET balance = balance - $1, held = held + $1 WHERE balance >= $1 RETURNING balance",
        &[amount],
        &[],
    )
    .await;
    if held.is_none() {
        return business(
            (StatusCode::PAYMENT_REQUIRED, r#"{"reason":"insufficient_funds"}"#).into_response(),
        );
    }
    let intent = tx.call(v).await.unwrap();
    run(
        &tx,
        "INSERT INTO payouts VALUES ($2, $1, 'pending') RETURNING amount",
        &[amount],
        &[&intent.downstream_key],
    )
    .await;
    (StatusCode::ACCEPTED, json!({"payout": intent.downstream_key, "state": "pending"}).to_string())
        .into_response()
}

/// The call's result: the hold paid out, or given back.
async fn settle(tx: Tx, done: Settled) -> Response {
    let (amount, dk) = (done.intent.body["amount"].as_i64().unwrap(), done.intent.downstream_key.as_str());
    match done.outcome {
        Outcome::Paid(_) => {
            run(&tx, "UPDATE wallet SET held = held - $1 RETURNING held", &[amount], &[]).await;
            run(&tx, "UPDATE payouts SET state = 'paid' WHERE downstream = $1 RETURNING amount", &[], &[dk])
                .await;
            (StatusCode::CREATED, json!({"payout": dk, "state": "paid"}).to_string()).into_response()
        }
        Outcome::Refused { reason, .. } => {
            run(
                &tx,
                "UPDATE wallet SET held = held - $1, balance = balance + $1 RETURNING held",
                &[amount],
                &[],
            )
            .await;
            run(
                &tx,
                "UPDATE payouts SET state = 'failed' WHERE downstream = $1 RETURNING amount",
                &[],
                &[dk],
            )
            .await;
            let body = json!({"payout": dk, "state": "failed", "reason": reason}).to_string();
            business((StatusCode::PAYMENT_REQUIRED, body).into_response())
        }
    }
}

/// `POST /orders`: one row, no provider.
async fn order(tx: Tx) -> Response {
    run(&tx, "INSERT INTO orders VALUES (1) RETURNING n", &[], &[]).await;
    (StatusCode::CREATED, "{}").into_response()
}

/// The mistake the split removes: the provider called inside the handler,
/// its transaction and connection held for the whole call.
async fn pay_inside(State(gateway): State<HttpGateway>, tx: Tx, body: String) -> Response {
    run(&tx, "INSERT INTO orders VALUES (2) RETURNING n", &[], &[]).await;
    let v: Value = serde_json::from_str(&body).unwrap();
    let downstream_key = format!("inside-{}", v["beneficiary"].as_str().unwrap());
    let intent = Intent { id: 0, downstream_key, body: v, sends: 0 };
    let _ = Provider::send(&gateway, &intent).await;
    (StatusCode::CREATED, "{}").into_response()
}

fn gateway(url: &str) -> HttpGateway {
    HttpGateway {
        url: url.to_owned(),
        token: None,
        timeout: Duration::from_secs(5),
        limits: Limits::default(),
    }
}

fn outside(url: &str) -> Outside {
    let limits = Limits {
        backoff: Duration::from_millis(20),
        backoff_cap: Duration::from_millis(100),
        lookup_delay: Duration::ZERO,
        ..Limits::default()
    };
    Outside::new(gateway(url), settle).limits(limits).call_timeout(Duration::from_secs(5))
}

async fn serve(idem: Idempotency, url: &str) -> SocketAddr {
    let layer = IdempotencyLayer::new(idem);
    let app = Router::new()
        .route("/pay", post(pay).route_layer(layer.clone()))
        .route("/orders", post(order).route_layer(layer.clone()))
        .route("/pay-inside", post(pay_inside).route_layer(layer))
        .with_state(gateway(url));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    address
}

fn post_to(address: SocketAddr, target: &str, key: &str, body: &str) -> Option<Http> {
    let request = format!(
        "POST {target} HTTP/1.1\r\nHost: x\r\nIdempotency-Key: {key}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    exchange(address, request.as_bytes()).ok()
}

/// 2 payouts through a provider that takes 2 s each, then 20 requests on
/// other keys: with the call split out, none of the 20 waits for the
/// provider, on 2 connections (or SQLite's one); with the call inside the
/// handler, they wait for it.
fn no_connection_is_held_during_a_call(db: Db, pool: usize) {
    db.setup();
    let gw = Gateway::start(&["--slow", "100", "--slow-for", "2s"]);
    let rt = runtime();
    let address = rt.block_on(async { serve(db.layer(pool, outside(&gw.url)).await, &gw.url).await });
    let others = |route: &'static str| {
        let slow: Vec<_> = (0..2)
            .map(|i| {
                let body = format!(r#"{{"beneficiary":"b{i}","amount":100,"currency":"KRW"}}"#);
                std::thread::spawn(move || post_to(address, route, &format!("{route}-{i}"), &body))
            })
            .collect();
        std::thread::sleep(Duration::from_millis(300));
        let start = Instant::now();
        let fast: Vec<_> = (0..20)
            .map(|i| std::thread::spawn(move || post_to(address, "/orders", &format!("{route}-o{i}"), "{}")))
            .collect();
        let statuses: Vec<u16> =
            fast.into_iter().map(|t| t.join().unwrap().map_or(0, |h| h.status)).collect();
        let took = start.elapsed();
        let slow: Vec<u16> = slow.into_iter().map(|t| t.join().unwrap().map_or(0, |h| h.status)).collect();
        (statuses, took, slow)
    };
    let (statuses, took, slow) = others("/pay");
    assert_eq!(statuses, [201; 20], "no other request waits for a connection");
    assert!(took < Duration::from_secs(1), "the 20 took {took:?} beside two 2 s calls");
    assert_eq!(slow, [201, 201], "the payouts settled when their calls returned");
    assert_eq!(db.money(), (100000 - 200, 0, 200));
    // the same load, the call made inside the handler: the others wait
    let (inside, took_inside, _) = others("/pay-inside");
    eprintln!(
        "20 requests beside two 2 s calls: split {took:?} {statuses:?}; inside {took_inside:?} {inside:?}"
    );
    let (statuses, took) = (inside, took_inside);
    assert!(
        took >= Duration::from_millis(1500) || statuses.iter().any(|s| *s != 201),
        "a call inside the transaction held the others: {took:?} {statuses:?}"
    );
}

#[test]
fn sqlite_a_provider_call_holds_no_connection() {
    let dir = tempfile::tempdir().unwrap();
    no_connection_is_held_during_a_call(Db::Lite(dir.path().join("calls.db").display().to_string()), 1);
}

#[test]
fn postgres_a_provider_call_holds_no_connection() {
    let Some(server) = crate::common::pg::server() else { return };
    no_connection_is_held_during_a_call(Db::Pg(server.fresh_schema(false)), 2);
}

/// The provider, but a quarter of the sends never come back to the
/// service once the provider answered (the provider paid or refused;
/// the service never learns): a process killed between call and result.
struct Stalling {
    gateway: HttpGateway,
    sent: Arc<AtomicUsize>,
}

impl Provider for Stalling {
    async fn send(&self, intent: &Intent) -> Call {
        let call = Provider::send(&self.gateway, intent).await;
        if self.sent.fetch_add(1, Ordering::SeqCst).is_multiple_of(4) {
            std::future::pending::<()>().await;
        }
        call
    }

    async fn lookup(&self, intent: &Intent) -> Lookup {
        Provider::lookup(&self.gateway, intent).await
    }
}

/// 40 payouts, each sent three times at once, through a provider over TLS
/// that loses requests, drops answers after paying and answers 500 after
/// paying; the service is stopped with a quarter of its calls answered by
/// the provider and not yet recorded (its runtime dropped, as a kill ends
/// a process), and started again; the recovery job runs until no call is
/// open (a person settling what it gives up on, as the provider says).
/// Every payout reaches the provider's ledger once, every key ends in one
/// final answer that its retries replay and the provider agrees with, and
/// the money is exact.
fn a_storm_pays_each_payout_once(db: Db, pool: usize) {
    db.setup();
    // over TLS, as a real provider is: its certificate trusted as an operator's `--ca-file` would
    let (gw, ca) = Gateway::start_tls(&[
        "--seed",
        "7",
        "--lose-request",
        "10",
        "--drop-answer",
        "25",
        "--error-5xx",
        "15",
    ]);
    idem::https::trust(&ca).unwrap();
    assert!(gw.url.starts_with("https://"), "{}", gw.url);
    let body = |i: usize| {
        let who = if i % 10 == 3 { "closed-x" } else { "acct" };
        format!(r#"{{"beneficiary":"{who}-{i}","amount":{},"currency":"KRW"}}"#, 100 + i)
    };
    let first = runtime();
    let sent = Arc::new(AtomicUsize::new(0));
    let stalling = Stalling { gateway: gateway(&gw.url), sent: sent.clone() };
    let short = Outside::new(stalling, settle).call_timeout(Duration::from_secs(3));
    let address = first.block_on(async { serve(db.layer(pool, short).await, &gw.url).await });
    let sends: Vec<_> = (0..40)
        .flat_map(|i| (0..3).map(move |_| i))
        .map(|i| {
            let b = body(i);
            std::thread::spawn(move || post_to(address, "/pay", &format!("k{i}"), &b))
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(3);
    while sent.load(Ordering::SeqCst) < 40 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    first.shutdown_background();
    for s in sends {
        let _ = s.join();
    }
    let second = runtime();
    let idem = second.block_on(db.layer(pool, outside(&gw.url)));
    let cut = second.block_on(idem.open_calls()).unwrap().iter().filter(|c| c.state == "in_progress").count();
    assert!(cut >= 5, "the stop left {cut} calls in flight, their results unrecorded");
    let address = second.block_on(serve(idem.clone(), &gw.url));
    for i in 0..40 {
        let _ = post_to(address, "/pay", &format!("k{i}"), &body(i));
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let open = second.block_on(idem.open_calls()).unwrap();
        if open.is_empty() {
            break;
        }
        assert!(Instant::now() < deadline, "calls left open: {open:?}");
        // a call the job gave up on (every resend lost) is a person's: they
        // look at the provider and settle it as it says
        for call in open.iter().filter(|c| c.state == "needs_attention") {
            let (status, seen) = gw.look(&call.intent.downstream_key);
            let outcome = match (status, seen["status"].as_str()) {
                (200, Some("paid")) => Outcome::Paid(None),
                _ => Outcome::Refused { status: 402, reason: "not_at_the_provider".into() },
            };
            assert!(second.block_on(idem.settle_by_hand(call.intent.id, outcome)).unwrap());
        }
        second.block_on(idem.recover()).unwrap();
        std::thread::sleep(Duration::from_millis(100));
    }
    let ledger = gw.ledger();
    let mut keys: Vec<&str> = ledger.iter().map(|(k, _, _)| k.as_str()).collect();
    keys.sort();
    let before = keys.len();
    keys.dedup();
    assert_eq!(before, keys.len(), "a downstream key paid twice: {ledger:?}");
    let paid: i64 = ledger.iter().filter(|(_, _, s)| s == "paid").map(|(_, a, _)| a).sum();
    let (balance, held, ours) = db.money();
    assert_eq!((held, ours), (0, paid), "what the provider paid is what the service recorded");
    assert_eq!(balance + paid, 100000, "money exact");
    for i in 0..40 {
        let h = post_to(address, "/pay", &format!("k{i}"), &body(i)).unwrap();
        let again = post_to(address, "/pay", &format!("k{i}"), &body(i)).unwrap();
        assert_eq!((h.status, &h.body), (again.status, &again.body), "k{i} replays one answer");
        let dk = serde_json::from_str::<Value>(&h.body).unwrap()["payout"].as_str().unwrap().to_owned();
        let at_provider = ledger.iter().find(|(k, _, _)| *k == dk).map(|(_, _, s)| s.as_str());
        match (h.status, at_provider) {
            (201, Some("paid")) => assert!(i % 10 != 3, "k{i} paid a closed account"),
            (402, Some("failed") | None) => {}
            (s, p) => panic!("k{i}: answered {s} {}, the provider says {p:?}", h.body),
        }
    }
    let counts = idem.call_counts();
    assert!(counts.paid + counts.refused > 0, "{counts:?}");
    let paid_rows = ledger.iter().filter(|(_, _, s)| s == "paid").count();
    eprintln!(
        "storm: {cut} calls left in flight by the stop (intent committed, no result); provider ledger {} rows ({paid_rows} paid, {paid} KRW), none twice; after the restart {counts:?}",
        ledger.len()
    );
}

#[test]
fn sqlite_a_storm_of_lost_answers_and_a_stop_pays_each_payout_once() {
    let dir = tempfile::tempdir().unwrap();
    a_storm_pays_each_payout_once(Db::Lite(dir.path().join("storm.db").display().to_string()), 1);
}

#[test]
fn postgres_a_storm_of_lost_answers_and_a_stop_pays_each_payout_once() {
    let Some(server) = crate::common::pg::server() else { return };
    a_storm_pays_each_payout_once(Db::Pg(server.fresh_schema(false)), 4);
}

#[test]
fn sqlx_postgres_a_provider_call_holds_no_connection() {
    let Some(server) = crate::common::pg::server() else { return };
    no_connection_is_held_during_a_call(Db::SqlxPg(server.fresh_schema(false)), 2);
}

#[test]
fn sqlx_postgres_a_storm_of_lost_answers_and_a_stop_pays_each_payout_once() {
    let Some(server) = crate::common::pg::server() else { return };
    a_storm_pays_each_payout_once(Db::SqlxPg(server.fresh_schema(false)), 4);
}

/// A provider's answer no resend can fix (403, nothing recorded) goes to a
/// person at once: the client keeps its 202, the job leaves the call alone,
/// and the person's settlement runs the team's `settle` and becomes the
/// key's answer, once.
#[test]
fn sqlite_a_call_no_resend_can_fix_waits_for_a_person_who_settles_it_once() {
    let dir = tempfile::tempdir().unwrap();
    let db = Db::Lite(dir.path().join("person.db").display().to_string());
    db.setup();
    let gw = Gateway::start(&["--refuse-4xx", "100"]);
    let rt = runtime();
    let idem = rt.block_on(db.layer(1, outside(&gw.url)));
    let address = rt.block_on(serve(idem.clone(), &gw.url));
    let body = r#"{"beneficiary":"acct-1","amount":700,"currency":"KRW"}"#;
    assert_eq!(post_to(address, "/pay", "p1", body).unwrap().status, 202);
    let open = rt.block_on(idem.open_calls()).unwrap();
    assert_eq!(open.iter().map(|c| c.state.as_str()).collect::<Vec<_>>(), ["needs_attention"]);
    assert!(rt.block_on(idem.recover()).unwrap().is_empty(), "a person's call is not the job's");
    assert_eq!(post_to(address, "/pay", "p1", body).unwrap().status, 202, "the retry meets the 202");
    assert_eq!(db.money(), (100000 - 700, 700, 0), "the money stays held");
    let refused = Outcome::Refused { status: 402, reason: "refused_by_the_bank".into() };
    assert!(rt.block_on(idem.settle_by_hand(open[0].intent.id, refused.clone())).unwrap());
    assert!(!rt.block_on(idem.settle_by_hand(open[0].intent.id, refused)).unwrap(), "settled once");
    let after = post_to(address, "/pay", "p1", body).unwrap();
    assert_eq!(after.status, 402, "{}", after.body);
    assert_eq!(db.money(), (100000, 0, 0), "the hold went back");
    assert!(gw.ledger().is_empty(), "nothing was paid");
    let counts = idem.call_counts();
    assert_eq!((counts.for_a_person, counts.refused, counts.paid), (1, 1, 0));
}

/// The team's `settle`, but it panics on an amount of 13.
async fn fragile(tx: Tx, done: Settled) -> Response {
    if done.intent.body["amount"] == 13 {
        panic!("a settle that fails");
    }
    settle(tx, done).await
}

/// A `settle` that panics rolls back alone: its request keeps its 202, the
/// recovery job survives it, sets that call aside for a person with why,
/// and settles the others of its pass.
#[test]
fn sqlite_a_settle_that_panics_is_set_aside_and_stops_nothing_else() {
    let dir = tempfile::tempdir().unwrap();
    let db = Db::Lite(dir.path().join("fragile.db").display().to_string());
    db.setup();
    let gw = Gateway::start(&[]);
    let rt = runtime();
    let short = Outside::new(gateway(&gw.url), fragile).call_timeout(Duration::from_secs(1));
    let idem = rt.block_on(db.layer(1, short));
    let address = rt.block_on(serve(idem.clone(), &gw.url));
    let body =
        |amount: i64| format!(r#"{{"beneficiary":"acct-{amount}","amount":{amount},"currency":"KRW"}}"#);
    let bad = post_to(address, "/pay", "bad", &body(13)).unwrap();
    assert_eq!(bad.status, 202, "the request keeps its answer: {}", bad.body);
    assert_eq!(post_to(address, "/pay", "good", &body(20)).unwrap().status, 201);
    // a call whose request's result was lost, beside it in the same pass
    let stopped = Outside::new(Stalling { gateway: gateway(&gw.url), sent: Arc::default() }, fragile)
        .call_timeout(Duration::from_secs(1));
    let other = runtime();
    let stopping = other.block_on(db.layer(1, stopped));
    let address2 = other.block_on(serve(stopping, &gw.url));
    std::thread::spawn(move || post_to(address2, "/pay", "lost", &body(30)));
    std::thread::sleep(Duration::from_millis(500));
    other.shutdown_background();
    std::thread::sleep(Duration::from_millis(3200)); // both leases over
    let done = rt.block_on(idem.recover()).unwrap();
    let aside: Vec<_> = done.iter().filter(|d| d.now == "needs_attention").collect();
    assert_eq!(aside.len(), 1, "{done:?}");
    assert!(aside[0].decision.contains("could not be stored"), "{done:?}");
    assert!(done.iter().any(|d| d.now == "completed"), "the pass went on: {done:?}");
    assert_eq!(db.money(), (100000 - 63, 13, 50), "13 held for a person, 20 and 30 paid");
}
