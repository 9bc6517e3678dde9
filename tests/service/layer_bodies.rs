//! The requests real APIs take, behind the layer: bodies of any kind (an
//! empty POST, a form, bytes), a route whose clients do not all send keys
//! yet, and a handler that never ends. Each test asserts what a layer that
//! took only JSON, refused every keyless request, or waited on a handler
//! for ever gets wrong.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Router, routing::post};
use idem::check::http::{Http, exchange};
use idem::embed::Keys;
use idem::embed::layer::{Idempotency, IdempotencyLayer, Tx};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

async fn listen(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    address
}

/// `POST target` with the key and the media type given (each left out when
/// `None`), and `body`.
fn post_to(
    address: SocketAddr,
    target: &str,
    key: Option<&str>,
    media_type: Option<&str>,
    body: &[u8],
) -> Http {
    let mut head = format!("POST {target} HTTP/1.1\r\nHost: x\r\nX-Client: c1\r\n");
    if let Some(key) = key {
        head.push_str(&format!("Idempotency-Key: {key}\r\n"));
    }
    if let Some(media_type) = media_type {
        head.push_str(&format!("Content-Type: {media_type}\r\n"));
    }
    head.push_str(&format!("Content-Length: {}\r\nConnection: close\r\n\r\n", body.len()));
    let mut request = head.into_bytes();
    request.extend_from_slice(body);
    exchange(address, &request).unwrap()
}

fn replayed(h: &Http) -> bool {
    h.headers.iter().any(|(name, value)| name.eq_ignore_ascii_case("idempotent-replayed") && value == "true")
}

fn reason(h: &Http) -> String {
    serde_json::from_str::<serde_json::Value>(&h.body)
        .ok()
        .and_then(|v| Some(v.get("reason")?.as_str()?.to_owned()))
        .unwrap_or_default()
}

/// A row in `orders` per run, written through the request's transaction
/// (SQLite or PostgreSQL); its id is the answer. With `hang` set, a body
/// of `stuck` then waits for ever, as an outside call with no timeout
/// does, holding its transaction.
async fn order(State(hang): State<Arc<AtomicBool>>, tx: Tx, body: Bytes) -> Response {
    let status =
        if body.as_ref() == b"fail" { StatusCode::INTERNAL_SERVER_ERROR } else { StatusCode::CREATED };
    let len = i64::try_from(body.len()).unwrap();
    let id: i64 = if let Some(c) = tx.sqlite().await {
        c.execute("INSERT INTO orders (len) VALUES (?1)", [len]).unwrap();
        let id = c.last_insert_rowid();
        if hang.load(Ordering::SeqCst) && body.as_ref() == b"stuck" {
            std::future::pending::<()>().await;
        }
        id
    } else {
        let c = tx.client().await.unwrap();
        let id =
            c.query_one("INSERT INTO orders (len) VALUES ($1) RETURNING id", &[&len]).await.unwrap().get(0);
        if hang.load(Ordering::SeqCst) && body.as_ref() == b"stuck" {
            std::future::pending::<()>().await;
        }
        id
    };
    (status, format!(r#"{{"order":{id}}}"#)).into_response()
}

/// The orders route behind `idem` at `/orders`, and behind the same state
/// with its key optional at `/open`.
async fn serve(idem: Idempotency, hang: Arc<AtomicBool>) -> SocketAddr {
    let app = Router::new()
        .route("/orders", post(order).route_layer(IdempotencyLayer::new(idem.clone())))
        .route("/open", post(order).route_layer(IdempotencyLayer::new(idem.key_optional())))
        .with_state(hang);
    listen(app).await
}

/// On a SQLite file: the layer, and the orders table.
fn on_sqlite(rt: &tokio::runtime::Runtime, dir: &tempfile::TempDir) -> (Idempotency, String) {
    let db = dir.path().join("bodies.db").display().to_string();
    rusqlite::Connection::open(&db)
        .unwrap()
        .execute_batch("CREATE TABLE orders (id INTEGER PRIMARY KEY, len INTEGER)")
        .unwrap();
    let idem =
        rt.block_on(Idempotency::connect(&db, Keys::new("b_").unwrap(), 1, |_| Some("c1".into()))).unwrap();
    (idem, db)
}

fn orders_on_sqlite(db: &str) -> i64 {
    rusqlite::Connection::open(db)
        .unwrap()
        .query_row("SELECT count(*) FROM orders", [], |r| r.get(0))
        .unwrap()
}

#[test]
fn any_body_is_one_request_by_its_media_type_and_bytes_and_json_canonically() {
    let (rt, dir) = (runtime(), tempfile::tempdir().unwrap());
    let (idem, db) = on_sqlite(&rt, &dir);
    let address = rt.block_on(serve(idem.clone(), Arc::default()));
    let send = |key: &str, media_type: Option<&str>, body: &[u8]| {
        post_to(address, "/orders", Some(key), media_type, body)
    };

    // an empty POST (a cancel, a capture): run once, then replayed
    let cancel = send("\"empty\"", None, b"");
    let again = send("\"empty\"", None, b"");
    assert_eq!(
        (cancel.status, again.status, replayed(&again), again.body == cancel.body),
        (201, 201, true, true),
        "{cancel:?} {again:?}"
    );
    assert_eq!(send("\"empty\"", None, b"x").status, 422, "another body under the key");

    // a form: its bytes are the request (reordered fields are another one)
    let form = Some("application/x-www-form-urlencoded");
    let paid = send("\"form\"", form, b"amount=500&to=bob");
    assert_eq!(paid.status, 201, "{paid:?}");
    assert!(replayed(&send("\"form\"", form, b"amount=500&to=bob")));
    assert_eq!(send("\"form\"", form, b"amount=900&to=bob").status, 422);
    // the same bytes declared as another type are another request
    assert_eq!(send("\"form\"", Some("text/plain"), b"amount=500&to=bob").status, 422);

    // bytes that are not text: kept as sent, one byte apart is another request
    let bytes = Some("application/octet-stream");
    assert_eq!(send("\"bytes\"", bytes, b"\x00\xff\x10").status, 201);
    assert!(replayed(&send("\"bytes\"", bytes, b"\x00\xff\x10")));
    assert_eq!(send("\"bytes\"", bytes, b"\x00\xfe\x10").status, 422);

    // JSON, however declared (curl -d calls it a form), is read canonically
    let json = send("\"json\"", form, br#"{"amount":500,"to":"bob"}"#);
    let respaced = send("\"json\"", Some("application/json"), br#"{ "to": "bob", "amount": 500 }"#);
    assert_eq!((json.status, replayed(&respaced)), (201, true), "{respaced:?}");
    // a body declared JSON that is not is refused, and its key left free
    let bad = send("\"bad\"", Some("application/json; charset=utf-8"), b"amount=500");
    assert_eq!((bad.status, reason(&bad).as_str()), (400, "invalid_request"), "{bad:?}");
    assert_eq!(send("\"bad\"", form, b"amount=500").status, 201, "the key stayed free");

    assert_eq!(orders_on_sqlite(&db), 5, "empty, form, bytes, json, bad's form: each once");
    assert_eq!(idem.counts().fresh, 5);
}

#[test]
fn a_route_whose_key_is_optional_runs_a_keyless_request_unprotected_and_counts_it() {
    let (rt, dir) = (runtime(), tempfile::tempdir().unwrap());
    let (idem, db) = on_sqlite(&rt, &dir);
    let address = rt.block_on(serve(idem.clone(), Arc::default()));

    // where keys are required, none is 400 and nothing runs
    let required = post_to(address, "/orders", None, None, b"{}");
    assert_eq!((required.status, reason(&required).as_str()), (400, "missing_idempotency_key"));
    assert_eq!(orders_on_sqlite(&db), 0);
    // where it is optional, a keyless request runs, each time it is sent
    let first = post_to(address, "/open", None, None, b"{}");
    let second = post_to(address, "/open", None, None, b"{}");
    assert_eq!((first.status, second.status, replayed(&second)), (201, 201, false), "{second:?}");
    assert_ne!(first.body, second.body, "unprotected: the second ran again");
    // its writes commit only with an answer kept, as a keyed request's do
    assert_eq!(post_to(address, "/open", None, None, b"fail").status, 500);
    assert_eq!(orders_on_sqlite(&db), 2, "the 500's write rolled back");
    // a key sent is honoured there, and a malformed one is still refused
    let keyed = post_to(address, "/open", Some("\"k1\""), None, b"{}");
    assert!(keyed.status == 201 && replayed(&post_to(address, "/open", Some("\"k1\""), None, b"{}")));
    assert_eq!(post_to(address, "/open", Some("\"a\", \"b\""), None, b"{}").status, 400);
    assert_eq!(orders_on_sqlite(&db), 3);
    let counts = idem.counts();
    assert_eq!((counts.unkeyed, counts.fresh, counts.replayed), (3, 1, 1), "{counts:?}");
}

/// The layer refuses a request first sent longer ago than its keys are
/// kept (`Repeatability-First-Sent`), running nothing, and reads no other
/// date than an HTTP-date.
#[test]
fn the_layer_refuses_a_request_first_sent_past_retention_and_runs_nothing() {
    let (rt, dir) = (runtime(), tempfile::tempdir().unwrap());
    let (idem, db) = on_sqlite(&rt, &dir);
    let address = rt.block_on(serve(idem, Arc::default()));
    let with_first_sent = |key: &str, value: &str| {
        let body = b"{}";
        let request = format!(
            "POST /orders HTTP/1.1\r\nHost: x\r\nIdempotency-Key: {key}\r\nRepeatability-First-Sent: {value}\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{}",
            body.len(),
            std::str::from_utf8(body).unwrap()
        );
        exchange(address, request.as_bytes()).unwrap()
    };
    let old = with_first_sent("\"old\"", "Sun, 06 Nov 1994 08:49:37 GMT");
    assert_eq!((old.status, reason(&old).as_str()), (412, "first_sent_too_long_ago"), "{old:?}");
    let bad = with_first_sent("\"bad\"", "1994-11-06");
    assert_eq!((bad.status, reason(&bad).as_str()), (400, "invalid_first_sent"), "{bad:?}");
    let now = idem::clock::to_http_date(time::OffsetDateTime::now_utc());
    assert_eq!(with_first_sent("\"now\"", &now).status, 201);
    assert_eq!(orders_on_sqlite(&db), 1, "only the request sent now ran");
}

/// A handler that never ends (`stuck`) while five other keys arrive behind
/// it: the other five are answered at once after the bound, the stuck one
/// is 503 `handler_timed_out`, its write rolled back and its key free.
fn a_stuck_handler_is_stopped(rt: &tokio::runtime::Runtime, idem: Idempotency, count: impl Fn() -> i64) {
    let hang = Arc::new(AtomicBool::new(true));
    let mut idem = idem;
    idem.max_run = Duration::from_millis(400);
    idem.max_wait = Duration::from_secs(3);
    let address = rt.block_on(serve(idem.clone(), hang.clone()));
    let started = Instant::now();
    let stuck = std::thread::spawn(move || post_to(address, "/orders", Some("\"stuck\""), None, b"stuck"));
    std::thread::sleep(Duration::from_millis(100));
    let others: Vec<_> = (0..5)
        .map(|i| {
            std::thread::spawn(move || post_to(address, "/orders", Some(&format!("\"o{i}\"")), None, b"{}"))
        })
        .collect();
    let others: Vec<Http> = others.into_iter().map(|t| t.join().unwrap()).collect();
    let stuck = stuck.join().unwrap();
    let took = started.elapsed();
    assert!(others.iter().all(|h| h.status == 201), "{others:?}");
    assert_eq!((stuck.status, reason(&stuck).as_str()), (503, "handler_timed_out"), "{stuck:?}");
    assert!(took < Duration::from_secs(2), "the others waited {took:?}");
    assert_eq!(count(), 5, "the stuck run's write rolled back");
    hang.store(false, Ordering::SeqCst);
    let retry = post_to(address, "/orders", Some("\"stuck\""), None, b"stuck");
    assert_eq!((retry.status, replayed(&retry)), (201, false), "its key was left free: {retry:?}");
    assert_eq!(count(), 6);
    assert_eq!(idem.counts().timed_out, 1);
}

#[test]
fn sqlite_a_handler_past_its_bound_is_rolled_back_and_holds_no_other_request() {
    let (rt, dir) = (runtime(), tempfile::tempdir().unwrap());
    let (idem, db) = on_sqlite(&rt, &dir);
    a_stuck_handler_is_stopped(&rt, idem, || orders_on_sqlite(&db));
}

#[test]
fn postgres_a_handler_past_its_bound_is_rolled_back_and_holds_no_other_request() {
    let Some(server) = crate::common::pg::server() else { return };
    let spec = server.fresh_schema(false);
    let mut admin = postgres::Client::connect(&spec, postgres::NoTls).unwrap();
    admin.batch_execute("CREATE TABLE orders (id bigserial PRIMARY KEY, len bigint)").unwrap();
    // one connection: a stuck handler that kept it would hold every other request
    let rt = runtime();
    let idem =
        rt.block_on(Idempotency::connect(&spec, Keys::new("b_").unwrap(), 1, |_| Some("c1".into()))).unwrap();
    a_stuck_handler_is_stopped(&rt, idem, move || {
        let mut c = postgres::Client::connect(&spec, postgres::NoTls).unwrap();
        c.query_one("SELECT count(*) FROM orders", &[]).unwrap().get(0)
    });
}

/// `tools/pg-local url`'s form, `postgres://user@localhost/db?host=/socket/dir`:
/// sqlx and tokio-postgres both read it as the socket directory (sqlx
/// takes no libpq `key=value` string, which `tools/pg-local start` prints).
#[test]
fn the_local_databases_url_is_one_sqlx_and_tokio_postgres_both_take() {
    use std::str::FromStr;
    let url = "postgres://postgres@localhost/postgres?host=/work/target/pg/sock";
    let sqlx = sqlx::postgres::PgConnectOptions::from_str(url).unwrap();
    let unix = std::path::PathBuf::from("/work/target/pg/sock");
    assert_eq!((sqlx.get_socket(), sqlx.get_database()), (Some(&unix), Some("postgres")));
    let tokio = tokio_postgres::Config::from_str(url).unwrap();
    assert!(
        tokio.get_hosts().iter().any(|h| *h == tokio_postgres::config::Host::Unix(unix.clone())),
        "{:?}",
        tokio.get_hosts()
    );
    assert!(sqlx::postgres::PgConnectOptions::from_str("host=/work/target/pg/sock user=postgres").is_err());
}

/// Keys past retention are purged by the layer's own state, on each store
/// it runs on, and on a schedule; keys within retention are kept.
#[test]
fn the_layer_purges_keys_past_retention_on_every_store_and_on_a_schedule() {
    let (rt, dir) = (runtime(), tempfile::tempdir().unwrap());
    let file = dir.path().join("purge.db");
    let db = file.display().to_string();
    rusqlite::Connection::open(&db)
        .unwrap()
        .execute_batch("CREATE TABLE orders (id INTEGER PRIMARY KEY, len INTEGER)")
        .unwrap();
    let who = |_: &axum::http::HeaderMap| Some("c1".to_owned());
    let kept = |db: &str, table: &str| -> i64 {
        rusqlite::Connection::open(db)
            .unwrap()
            .query_row(&format!("SELECT count(*) FROM {table}"), [], |r| r.get(0))
            .unwrap()
    };
    // three keys under a retention of 0 hours (past at once), three under 72
    let (gone, young) = rt.block_on(async {
        let gone =
            Idempotency::connect(&db, Keys::new("gone_").unwrap().retention_hours(0), 1, who).await.unwrap();
        let young = Idempotency::connect(&db, Keys::new("young_").unwrap(), 1, who).await.unwrap();
        (gone, young)
    });
    for (idem, keys) in [(&gone, 4), (&young, 3)] {
        let address = rt.block_on(serve(idem.clone(), Arc::default()));
        for k in 0..keys {
            assert_eq!(post_to(address, "/orders", Some(&format!("\"{k}\"")), None, b"{}").status, 201);
        }
    }
    assert_eq!((kept(&db, "gone_idem_keys"), kept(&db, "young_idem_keys")), (4, 3));
    assert_eq!(rt.block_on(gone.purge(1)).unwrap(), 1, "at most the limit");
    assert_eq!(rt.block_on(young.purge(100)).unwrap(), 0, "within retention: kept");
    // on a schedule: its first round purges the other three, a batch of one at a time
    // spawned on the runtime the state's connections live on
    let purging = {
        let _in = rt.enter();
        gone.purge_every(Duration::from_secs(3600), 1)
    };
    let until = Instant::now() + Duration::from_secs(5);
    while kept(&db, "gone_idem_keys") > 0 && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20));
    }
    purging.abort();
    assert_eq!((kept(&db, "gone_idem_keys"), kept(&db, "young_idem_keys")), (0, 3));

    // on the application's sqlx pool, and on PostgreSQL
    let pool = rt.block_on(sqlx::SqlitePool::connect(&format!("sqlite://{db}"))).unwrap();
    let on_sqlx = rt
        .block_on(Idempotency::on_sqlx_sqlite(pool, Keys::new("young_").unwrap().retention_hours(0), who))
        .unwrap();
    assert_eq!(rt.block_on(on_sqlx.purge(100)).unwrap(), 3);
    let Some(server) = crate::common::pg::server() else { return };
    let spec = server.fresh_schema(false);
    postgres::Client::connect(&spec, postgres::NoTls)
        .unwrap()
        .batch_execute("CREATE TABLE orders (id bigserial PRIMARY KEY, len bigint)")
        .unwrap();
    let on_pg = rt
        .block_on(Idempotency::connect(&spec, Keys::new("p_").unwrap().retention_hours(0), 1, who))
        .unwrap();
    let address = rt.block_on(serve(on_pg.clone(), Arc::default()));
    assert_eq!(post_to(address, "/orders", Some("\"a\""), None, b"{}").status, 201);
    assert_eq!(rt.block_on(on_pg.purge(100)).unwrap(), 1);
}
