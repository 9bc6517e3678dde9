//! What the layer takes for the request a key was used for: the path the
//! client sent (under `Router::nest` too, where the handler sees it
//! stripped) and the query string, not only the body. Each test asserts
//! what a layer that scoped by the stripped path, or fingerprinted the body
//! alone, gets wrong: a request it never ran answered with another's replay.

use axum::http::StatusCode;
use axum::middleware::from_fn_with_state;
use axum::response::IntoResponse;
use axum::{Router, routing::post};
use idem::check::http::{Http, exchange};
use idem::embed::Keys;
use idem::embed::layer::{Idempotency, idempotent};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// `/v1/orders` and `/v2/orders`, each a nested router behind the layer,
/// on a SQLite file; every run of a handler is counted.
async fn serve(db: &str, runs: Arc<AtomicU64>) -> SocketAddr {
    let idem = Idempotency::connect(db, Keys::new("scope_").unwrap(), 2, |h| {
        h.get("x-client").and_then(|v| v.to_str().ok()).map(String::from)
    })
    .await
    .unwrap();
    let order = move || {
        let runs = runs.clone();
        move || {
            let runs = runs.clone();
            async move {
                let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                (StatusCode::CREATED, format!(r#"{{"order":{n}}}"#)).into_response()
            }
        }
    };
    let version = |handler| {
        Router::new()
            .route("/orders", post(handler))
            .route_layer(from_fn_with_state(idem.clone(), idempotent))
    };
    let app = Router::new().nest("/v1", version(order())).nest("/v2", version(order()));
    listen(app).await
}

/// `app` served on a loopback port of its own.
async fn listen(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    address
}

fn send(address: SocketAddr, target: &str, key: &str) -> Http {
    send_body(address, target, key, br#"{"item":"tea"}"#)
}

fn send_body(address: SocketAddr, target: &str, key: &str, body: &[u8]) -> Http {
    let mut request = format!(
        "POST {target} HTTP/1.1\r\nHost: x\r\nX-Client: c1\r\nIdempotency-Key: \"{key}\"\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    request.extend_from_slice(body);
    exchange(address, &request).unwrap()
}

/// `POST /orders` under `key`, for a router driven in process.
fn order(key: &str) -> axum::http::Request<axum::body::Body> {
    axum::http::Request::post("/orders")
        .header("idempotency-key", format!("\"{key}\""))
        .body(axum::body::Body::from(r#"{"item":"tea"}"#))
        .unwrap()
}

fn replayed(h: &Http) -> bool {
    h.headers.iter().any(|(name, value)| name.eq_ignore_ascii_case("idempotent-replayed") && value == "true")
}

#[test]
fn a_key_is_scoped_by_the_path_sent_and_bound_to_the_query() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("scope.db").display().to_string();
    let runs = Arc::new(AtomicU64::new(0));
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let address = runtime.block_on(serve(&db, runs.clone()));

    let first = send(address, "/v1/orders", "k1");
    assert_eq!((first.status, first.body.as_str(), replayed(&first)), (201, r#"{"order":1}"#, false));
    // the same key on another version's route is another operation: run, not v1's replay
    let v2 = send(address, "/v2/orders", "k1");
    assert_eq!((v2.status, replayed(&v2)), (201, false), "{v2:?}");
    // the same body under another query is another request: 422, never the first's replay
    let dry = send(address, "/v1/orders?dry_run=true", "k1");
    assert_eq!(dry.status, 422, "{dry:?}");
    // and the first request's retry still replays it
    let again = send(address, "/v1/orders", "k1");
    assert_eq!((again.status, again.body.as_str(), replayed(&again)), (201, r#"{"order":1}"#, true));
    // a query of its own is kept with the key: its retry replays
    let q = send(address, "/v1/orders?dry_run=true", "k2");
    let q_again = send(address, "/v1/orders?dry_run=true", "k2");
    assert_eq!(
        (q.status, q_again.status, replayed(&q_again), q.body == q_again.body),
        (201, 201, true, true)
    );
    assert_eq!(runs.load(Ordering::SeqCst), 3, "v1 once, v2 once, k2 once");
}

/// A request body that is not UTF-8 is refused (JSON is UTF-8), not mended
/// into text: mended, `{"item":"\xff"}` and `{"item":"\xfe"}` both read
/// `{"item":"\u{fffd}"}`, one fingerprint, and the second would be
/// answered with the first's replay instead of running or being refused.
#[test]
fn a_request_body_that_is_not_text_is_refused_and_leaves_its_key_free() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("body.db").display().to_string();
    let runs = Arc::new(AtomicU64::new(0));
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let address = runtime.block_on(serve(&db, runs.clone()));
    for body in [&b"{\"item\":\"\xff\"}"[..], b"{\"item\":\"\xfe\"}"] {
        let h = send_body(address, "/v1/orders", "k1", body);
        assert!(h.status == 400 && h.body.contains("UTF-8") && !replayed(&h), "{h:?}");
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0, "nothing ran");
    let first = send(address, "/v1/orders", "k1");
    assert_eq!((first.status, replayed(&first)), (201, false), "the key was left free: {first:?}");
}

/// A handler's answer that is not UTF-8 text is kept as it was: its replay
/// is the same bytes (a lossy conversion would give U+FFFD for each bad
/// byte), on every store, the handler run once.
#[test]
fn an_answer_that_is_not_text_is_replayed_byte_for_byte() {
    use tower::ServiceExt;
    let answer = vec![0xff_u8, 0xfe, b'{', 0x80, 0];
    let dir = tempfile::tempdir().unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let server = crate::common::pg::server();
    let spec = server.as_ref().map(|s| s.fresh_schema(false));
    runtime.block_on(async {
        let keys = || Keys::new("bytes_").unwrap();
        let file = |name: &str| dir.path().join(name).display().to_string();
        let lite =
            sqlx::sqlite::SqliteConnectOptions::new().filename(file("sqlx.db")).create_if_missing(true);
        let mut stores = vec![
            (
                "rusqlite",
                Idempotency::connect(&file("bytes.db"), keys(), 2, |_| Some("c1".into())).await.unwrap(),
            ),
            ("sqlx sqlite", {
                let pool = sqlx::SqlitePool::connect_with(lite).await.unwrap();
                Idempotency::on_sqlx_sqlite(pool, keys(), |_| Some("c1".into())).await.unwrap()
            }),
        ];
        if let Some(spec) = &spec {
            stores.push((
                "tokio-postgres",
                Idempotency::connect(spec, keys(), 2, |_| Some("c1".into())).await.unwrap(),
            ));
            let pool = sqlx::PgPool::connect_with(crate::common::pg::sqlx_options(spec)).await.unwrap();
            let idem =
                Idempotency::on_sqlx_postgres(pool, Keys::new("sqlx_bytes_").unwrap(), |_| Some("c1".into()));
            stores.push(("sqlx postgres", idem.await.unwrap()));
        }
        for (store, idem) in stores {
            let runs = Arc::new(AtomicU64::new(0));
            let (counted, body) = (runs.clone(), answer.clone());
            let handler = move || {
                counted.fetch_add(1, Ordering::SeqCst);
                let body = body.clone();
                async move { (StatusCode::CREATED, body).into_response() }
            };
            let app = Router::new()
                .route("/orders", post(handler))
                .route_layer(from_fn_with_state(idem, idempotent));
            let mut heard = Vec::new();
            for _ in 0..2 {
                let response = app.clone().oneshot(order("k1")).await.unwrap();
                let replay = response.headers().get("idempotent-replayed").is_some();
                let status = response.status().as_u16();
                let bytes = axum::body::to_bytes(response.into_body(), usize::MAX).await.unwrap();
                heard.push((status, replay, bytes.to_vec()));
            }
            assert_eq!(heard[0], (201, false, answer.clone()), "{store}");
            assert_eq!(heard[1], (201, true, answer.clone()), "{store}: the replay is the same bytes");
            assert_eq!(runs.load(Ordering::SeqCst), 1, "{store}: the handler ran once");
        }
    });
}

/// Which statuses are stored is the team's to say: by default a 404 the
/// handler answers is not kept (its writes roll back, the retry runs it
/// again); with `keep_when` accepting 4xx it is kept with its writes, and
/// the retry replays it without running the handler.
#[test]
fn the_statuses_kept_are_the_teams_to_choose() {
    use tower::ServiceExt;
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let runs = runtime.block_on(async {
        let mut runs = Vec::new();
        for (n, four_xx) in [(0, false), (1, true)] {
            let db = dir.path().join(format!("keep{n}.db")).display().to_string();
            let idem = Idempotency::connect(&db, Keys::new("keep_").unwrap(), 1, |_| Some("c1".into()))
                .await
                .unwrap();
            let idem = match four_xx {
                true => idem.keep_when(|s| s.is_success() || s.is_client_error()),
                false => idem,
            };
            let count = Arc::new(AtomicU64::new(0));
            let counted = count.clone();
            let handler = move || {
                counted.fetch_add(1, Ordering::SeqCst);
                async { (StatusCode::NOT_FOUND, r#"{"reason":"no_such_item"}"#).into_response() }
            };
            let app = Router::new()
                .route("/orders", post(handler))
                .route_layer(from_fn_with_state(idem, idempotent));
            for _ in 0..2 {
                let response = app.clone().oneshot(order("k1")).await.unwrap();
                assert_eq!(response.status(), StatusCode::NOT_FOUND);
            }
            runs.push(count.load(Ordering::SeqCst));
        }
        runs
    });
    assert_eq!(runs, [2, 1], "2xx only: the 404 ran twice; 4xx kept: once, then replayed");
}

/// The layer as a `tower::Layer`: on an axum route, and around a plain
/// `tower::Service`, the same claim, replay and refusal as the `from_fn`
/// middleware; the handler reads the key it runs under and derives the key
/// it would send a provider, the same at every run of the request.
#[test]
fn the_tower_layer_claims_replays_and_hands_the_key_to_the_handler() {
    use axum::Extension;
    use idem::embed::layer::{IdemKey, IdempotencyLayer};
    use tower::{Layer, ServiceExt};
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("tower.db").display().to_string();
    let runs = Arc::new(AtomicU64::new(0));
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let idem = runtime
        .block_on(Idempotency::connect(&db, Keys::new("tower_").unwrap(), 2, |h| {
            h.get("x-client").and_then(|v| v.to_str().ok()).map(String::from)
        }))
        .unwrap();
    let counted = runs.clone();
    let handler = move |Extension(key): Extension<IdemKey>| {
        let n = counted.fetch_add(1, Ordering::SeqCst) + 1;
        async move { (StatusCode::CREATED, format!(r#"{{"order":{n},"sent":"{}"}}"#, key.downstream("charge"))) }
    };
    let app = Router::new().route("/orders", post(handler)).route_layer(IdempotencyLayer::new(idem.clone()));
    let address = runtime.block_on(listen(app));
    let first = send(address, "/orders", "k1");
    let again = send(address, "/orders", "k1");
    let charge = IdemKey { client: "c1".into(), endpoint: "POST /orders".into(), key: "k1".into() }
        .downstream("charge");
    assert_eq!(first.body, format!(r#"{{"order":1,"sent":"{charge}"}}"#));
    assert_eq!((again.status, replayed(&again), &again.body), (201, true, &first.body));
    assert_eq!(send(address, "/orders?other=1", "k1").status, 422);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    // around a plain tower service: no router, the same protocol
    let plain = tower::service_fn(|_: axum::extract::Request| async {
        Ok::<_, std::convert::Infallible>((StatusCode::CREATED, "made").into_response())
    });
    let service = IdempotencyLayer::new(idem).layer(plain);
    let call = |key: &str| {
        let request = axum::http::Request::post("/things")
            .header("x-client", "c2")
            .header("idempotency-key", format!("\"{key}\""))
            .header("content-type", "application/json")
            .body(axum::body::Body::from("{}"))
            .unwrap();
        let response = runtime.block_on(service.clone().oneshot(request)).unwrap();
        (response.status().as_u16(), response.headers().contains_key("idempotent-replayed"))
    };
    assert_eq!((call("t1"), call("t1"), call("t2")), ((201, false), (201, true), (201, false)));
}

/// On SQLite a request holds the one connection from its claim to its
/// commit; another client queued behind a slow handler without bound (4.96 s
/// in the review). Past `max_wait` it is answered 503 `busy` with
/// `Retry-After` at once, and its retry, once the slow one is done, runs.
#[test]
fn behind_a_slow_handler_a_request_is_told_to_come_back_within_the_wait_bound() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("slow.db").display().to_string();
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let address = runtime.block_on(async {
        let mut idem =
            Idempotency::connect(&db, Keys::new("slow_").unwrap(), 1, |_| Some("c1".into())).await.unwrap();
        idem.max_wait = std::time::Duration::from_millis(300);
        let handler = |body: String| async move {
            if body.contains("slow") {
                tokio::time::sleep(std::time::Duration::from_secs(2)).await;
            }
            (StatusCode::CREATED, "{}").into_response()
        };
        listen(
            Router::new().route("/orders", post(handler)).route_layer(from_fn_with_state(idem, idempotent)),
        )
        .await
    });
    let slow = std::thread::spawn(move || {
        let body = r#"{"item":"slow"}"#;
        let request = format!(
            "POST /orders HTTP/1.1\r\nHost: x\r\nIdempotency-Key: \"s\"\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        exchange(address, request.as_bytes()).unwrap()
    });
    std::thread::sleep(std::time::Duration::from_millis(300));
    let started = std::time::Instant::now();
    let queued = send(address, "/orders", "q");
    let waited = started.elapsed();
    let retry_after = queued.headers.iter().any(|(n, v)| n.eq_ignore_ascii_case("retry-after") && v == "1");
    assert!(queued.status == 503 && queued.body.contains("busy") && retry_after, "{queued:?}");
    assert!(waited < std::time::Duration::from_secs(1), "queued {waited:?} behind the slow handler");
    assert_eq!(slow.join().unwrap().status, 201);
    assert_eq!(send(address, "/orders", "q").status, 201, "its retry runs");
}

/// A replay carries the headers the first answer set that the layer keeps:
/// `Location` by default, each value as the handler set it, and any header
/// added to `replayed_headers`; one that is not named is not replayed. On
/// both stores (the key table's `headers` column).
#[test]
fn a_replay_carries_the_location_and_the_headers_named_to_keep() {
    let dir = tempfile::tempdir().unwrap();
    let mut dbs = vec![dir.path().join("headers.db").display().to_string()];
    let server = crate::common::pg::server();
    if let Some(server) = &server {
        dbs.push(server.fresh_schema(false));
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    for db in &dbs {
        let runs = Arc::new(AtomicU64::new(0));
        let counted = runs.clone();
        let serve = |names: &'static [&'static str], prefix: &'static str| {
            let (db, counted) = (db.clone(), counted.clone());
            async move {
                let mut idem =
                    Idempotency::connect(&db, Keys::new(prefix).unwrap(), 2, |_| Some("c1".into()))
                        .await
                        .unwrap();
                idem.replayed_headers.extend(names.iter().map(|n| n.parse().unwrap()));
                let handler = move || {
                    let n = counted.fetch_add(1, Ordering::SeqCst) + 1;
                    let location = format!("/orders/{n}");
                    let headers =
                        [("location", location), ("x-trace", format!("t{n}")), ("x-kept", format!("k{n}"))];
                    async move { (StatusCode::CREATED, headers, format!(r#"{{"order":{n}}}"#)).into_response() }
                };
                let app = Router::new()
                    .route("/orders", post(handler))
                    .route_layer(from_fn_with_state(idem, idempotent));
                listen(app).await
            }
        };
        let plain = runtime.block_on(serve(&[], "hdr_"));
        let first = send(plain, "/orders", "k1");
        let again = send(plain, "/orders", "k1");
        let kept = |h: &Http, name: &str| h.header(name).map(String::from);
        assert_eq!((first.status, kept(&first, "location")), (201, Some("/orders/1".into())), "{db}");
        assert!(replayed(&again), "{db}: {again:?}");
        assert_eq!(kept(&again, "location"), Some("/orders/1".into()), "{db}: the Location was not replayed");
        assert_eq!(kept(&again, "x-trace"), None, "{db}: a header not named was replayed");
        let named = runtime.block_on(serve(&["x-kept"], "hdr2_"));
        let first = send(named, "/orders", "k1");
        let again = send(named, "/orders", "k1");
        assert!(replayed(&again) && again.body == first.body, "{db}: {again:?}");
        assert_eq!(
            (kept(&again, "location"), kept(&again, "x-kept")),
            (kept(&first, "location"), kept(&first, "x-kept")),
            "{db}"
        );
        assert_eq!(runs.load(Ordering::SeqCst), 2, "{db}: each key ran once");
    }
}

/// `who_from_parts`: the client named from what an auth layer before the
/// idempotency layer put in the request's extensions (its claims), not
/// from the headers again. Two subjects own distinct keys; a request the
/// auth layer found no subject for is 401, and consumes nothing.
#[test]
fn the_client_can_come_from_an_auth_layers_claims() {
    use axum::extract::Request;
    use axum::middleware::{Next, from_fn};
    #[derive(Clone)]
    struct Claims(String);
    async fn auth(mut request: Request, next: Next) -> axum::response::Response {
        let subject =
            request.headers().get("x-client").and_then(|v| v.to_str().ok()).map(|s| format!("sub-{s}"));
        if let Some(subject) = subject {
            request.extensions_mut().insert(Claims(subject));
        }
        next.run(request).await
    }
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("claims.db").display().to_string();
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let address = runtime.block_on(async {
        let idem = Idempotency::connect(&db, Keys::new("claims_").unwrap(), 2, |_| None)
            .await
            .unwrap()
            .who_from_parts(|parts| parts.extensions.get::<Claims>().map(|c| c.0.clone()));
        let handler = |axum::Extension(key): axum::Extension<idem::embed::layer::IdemKey>| async move {
            (StatusCode::CREATED, format!(r#"{{"client":"{}"}}"#, key.client)).into_response()
        };
        let app = Router::new()
            .route("/orders", post(handler))
            .route_layer(from_fn_with_state(idem, idempotent))
            .layer(from_fn(auth));
        listen(app).await
    });
    let one = send(address, "/orders", "k1");
    assert_eq!((one.status, one.body.as_str()), (201, r#"{"client":"sub-c1"}"#));
    let request = |client: &str| {
        let body = r#"{"item":"tea"}"#;
        format!(
            "POST /orders HTTP/1.1\r\nHost: x\r\n{client}Idempotency-Key: \"k1\"\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
    };
    let other = exchange(address, request("X-Client: c2\r\n").as_bytes()).unwrap();
    assert_eq!((other.status, other.body.as_str(), replayed(&other)), (201, r#"{"client":"sub-c2"}"#, false));
    let nobody = exchange(address, request("").as_bytes()).unwrap();
    assert_eq!(nobody.status, 401, "{nobody:?}");
    let again = send(address, "/orders", "k1");
    assert!(replayed(&again) && again.body == one.body, "{again:?}");
}

/// The application's own connections: on SQLite the one connection its
/// other routes lock too (in memory here, so a second connection of the
/// layer's would see an empty database), on PostgreSQL connections made by
/// its own function (a session setting of its own, which the handler
/// reads back). Each key runs once and replays, and the application's own
/// route sees the layer's writes on the same connection.
#[test]
fn the_layer_runs_on_the_applications_own_connections() {
    use axum::extract::State;
    use axum::routing::get;
    use idem::embed::layer::Tx;
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    // SQLite: one in-memory connection, shared
    let address = runtime.block_on(async {
        let db = rusqlite::Connection::open_in_memory().unwrap();
        db.execute_batch("CREATE TABLE orders (id INTEGER PRIMARY KEY, item TEXT)").unwrap();
        let db = Arc::new(tokio::sync::Mutex::new(db));
        let idem = Idempotency::on_sqlite(db.clone(), Keys::new("own_").unwrap(), |_| Some("c1".into()))
            .await
            .unwrap();
        let order = |tx: Tx| async move {
            let c = tx.sqlite().await.unwrap();
            c.execute("INSERT INTO orders (item) VALUES ('tea')", []).unwrap();
            (StatusCode::CREATED, format!(r#"{{"order":{}}}"#, c.last_insert_rowid())).into_response()
        };
        let count = |State(db): State<Arc<tokio::sync::Mutex<rusqlite::Connection>>>| async move {
            let n: i64 = db.lock().await.query_row("SELECT count(*) FROM orders", [], |r| r.get(0)).unwrap();
            n.to_string()
        };
        let app = Router::new()
            .route("/orders", post(order))
            .route_layer(from_fn_with_state(idem, idempotent))
            .route("/count", get(count))
            .with_state(db);
        listen(app).await
    });
    let first = send(address, "/orders", "k1");
    let again = send(address, "/orders", "k1");
    assert_eq!((first.status, first.body.as_str()), (201, r#"{"order":1}"#));
    assert!(replayed(&again) && again.body == first.body, "{again:?}");
    let count = exchange(address, b"GET /count HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    assert_eq!(count.body, "1", "the application's own route reads the layer's write");
    // PostgreSQL: the application's own way of connecting
    let Some(server) = crate::common::pg::server() else { return };
    let spec = server.fresh_schema(false);
    let made = Arc::new(AtomicU64::new(0));
    let counted = made.clone();
    let address = runtime.block_on(async move {
        let make = move || {
            let (spec, counted) = (spec.clone(), counted.clone());
            async move {
                let (client, connection) = tokio_postgres::connect(&spec, tokio_postgres::NoTls).await?;
                tokio::spawn(connection);
                client.batch_execute("SET application_name = 'the_team'").await?;
                counted.fetch_add(1, Ordering::SeqCst);
                Ok::<_, tokio_postgres::Error>(client)
            }
        };
        let idem = Idempotency::on_postgres(make, Keys::new("own_").unwrap(), 2, |_| Some("c1".into()))
            .await
            .unwrap();
        let order = |tx: Tx| async move {
            let c = tx.client().await.unwrap();
            let name: String = c.query_one("SHOW application_name", &[]).await.unwrap().get(0);
            (StatusCode::CREATED, format!(r#"{{"session":"{name}"}}"#)).into_response()
        };
        listen(Router::new().route("/orders", post(order)).route_layer(from_fn_with_state(idem, idempotent)))
            .await
    });
    let first = send(address, "/orders", "k1");
    let again = send(address, "/orders", "k1");
    assert_eq!((first.status, first.body.as_str()), (201, r#"{"session":"the_team"}"#));
    assert!(replayed(&again) && again.body == first.body, "{again:?}");
    assert!(made.load(Ordering::SeqCst) >= 1);
}

/// The layer on the pools a team already has: its deadpool-postgres pool
/// and its sqlx pools, each configured as the team's (an application name
/// of its own, which the handler reads back through the request's
/// transaction). Each key runs once and replays; the team's pool is the one
/// that served it.
#[test]
fn the_layer_runs_on_the_applications_deadpool_and_sqlx_pools() {
    use idem::embed::layer::Tx;
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    // sqlx on SQLite: a file, which the team's own query reads back
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("shop.db");
    let (address, pool) = runtime.block_on(async {
        let options = sqlx::sqlite::SqliteConnectOptions::new().filename(&file).create_if_missing(true);
        let pool = sqlx::SqlitePool::connect_with(options).await.unwrap();
        sqlx::raw_sql("CREATE TABLE orders (id INTEGER PRIMARY KEY, item TEXT)")
            .execute(&pool)
            .await
            .unwrap();
        let idem =
            Idempotency::on_sqlx_sqlite(pool.clone(), Keys::new("own_").unwrap(), |_| Some("c1".into()))
                .await
                .unwrap();
        let order = |tx: Tx| async move {
            let mut c = tx.sqlx_sqlite().await.unwrap();
            let id: i64 = sqlx::query_scalar("INSERT INTO orders (item) VALUES ('tea') RETURNING id")
                .fetch_one(&mut *c)
                .await
                .unwrap();
            (StatusCode::CREATED, format!(r#"{{"order":{id}}}"#)).into_response()
        };
        let app =
            Router::new().route("/orders", post(order)).route_layer(from_fn_with_state(idem, idempotent));
        (listen(app).await, pool)
    });
    let first = send(address, "/orders", "k1");
    let again = send(address, "/orders", "k1");
    assert_eq!((first.status, first.body.as_str()), (201, r#"{"order":1}"#));
    assert!(replayed(&again) && again.body == first.body, "{again:?}");
    let orders: i64 =
        runtime.block_on(sqlx::query_scalar("SELECT count(*) FROM orders").fetch_one(&pool)).unwrap();
    assert_eq!(orders, 1, "the team's pool sees one order");
    // PostgreSQL: the team's deadpool-postgres pool, then its sqlx pool
    let Some(server) = crate::common::pg::server() else { return };
    let spec = server.fresh_schema(false);
    // the session is the team's: its name, and the lock wait it set, which
    // the claim's own (shorter) wait must have given back to the handler
    let session = |tx: Tx| async move {
        let sql = "SELECT current_setting('application_name') || ' ' || current_setting('lock_timeout')";
        let name: String = if let Some(c) = tx.client().await {
            c.query_one(sql, &[]).await.unwrap().get(0)
        } else {
            let mut c = tx.sqlx_postgres().await.unwrap();
            sqlx::query_scalar(sql).fetch_one(&mut *c).await.unwrap()
        };
        (StatusCode::CREATED, format!(r#"{{"session":"{name}"}}"#)).into_response()
    };
    let (deadpool, sqlx_pool) = runtime.block_on(async {
        let mut config: tokio_postgres::Config = spec.parse().unwrap();
        let options = format!("{} -c lock_timeout=7s", config.get_options().unwrap_or_default());
        config.application_name("the_team_deadpool").options(&options);
        let manager = deadpool_postgres::Manager::new(config, tokio_postgres::NoTls);
        let pool = deadpool_postgres::Pool::builder(manager).max_size(2).build().unwrap();
        let idem = Idempotency::on_deadpool(pool.clone(), Keys::new("dp_").unwrap(), |_| Some("c1".into()))
            .await
            .unwrap();
        let deadpool = listen(
            Router::new().route("/orders", post(session)).route_layer(from_fn_with_state(idem, idempotent)),
        )
        .await;
        let options = crate::common::pg::sqlx_options(&spec)
            .application_name("the_team_sqlx")
            .options([("lock_timeout", "7s")]);
        let pool =
            sqlx::postgres::PgPoolOptions::new().max_connections(2).connect_with(options).await.unwrap();
        let idem = Idempotency::on_sqlx_postgres(pool, Keys::new("sx_").unwrap(), |_| Some("c1".into()))
            .await
            .unwrap();
        let sqlx_pool = listen(
            Router::new().route("/orders", post(session)).route_layer(from_fn_with_state(idem, idempotent)),
        )
        .await;
        (deadpool, sqlx_pool)
    });
    for (address, name) in [(deadpool, "the_team_deadpool"), (sqlx_pool, "the_team_sqlx")] {
        let first = send(address, "/orders", "k1");
        let again = send(address, "/orders", "k1");
        assert_eq!((first.status, first.body.clone()), (201, format!(r#"{{"session":"{name} 7s"}}"#)));
        assert!(replayed(&again) && again.body == first.body, "{again:?}");
    }
}

/// What the handler's transaction isolates on PostgreSQL: READ COMMITTED,
/// the server's default. Eight requests under eight keys refund one order,
/// each reading whether it was refunded and then writing: read then write
/// pays several refunds; the same handler locking the row first
/// (`SELECT … FOR UPDATE`) pays one. The key protects a request from its
/// own retries, not two requests from each other: docs/library.md says so.
#[test]
fn on_postgres_the_handler_runs_at_read_committed_and_must_lock_what_it_reads() {
    use idem::embed::layer::Tx;
    let Some(server) = crate::common::pg::server() else { return };
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let mut refunds = Vec::new();
    for lock in ["", " FOR UPDATE"] {
        let spec = server.fresh_schema(false);
        crate::common::pg::execute(
            &spec,
            "CREATE TABLE orders (id int PRIMARY KEY, refunded bool NOT NULL);
             CREATE TABLE refunds (order_id int NOT NULL); INSERT INTO orders VALUES (1, false)",
        );
        let address = runtime.block_on(async {
            let idem = Idempotency::connect(&spec, Keys::new("iso_").unwrap(), 8, |_| Some("c1".into())).await.unwrap();
            let refund = move |tx: Tx| async move {
                let c = tx.client().await.unwrap();
                let read = format!("SELECT refunded FROM orders WHERE id = 1{lock}");
                let refunded: bool = c.query_one(read.as_str(), &[]).await.unwrap().get(0);
                if refunded {
                    return idem::embed::layer::business((StatusCode::CONFLICT, "{}").into_response());
                }
                c.batch_execute("SELECT pg_sleep(0.05); INSERT INTO refunds VALUES (1); UPDATE orders SET refunded = true")
                    .await
                    .unwrap();
                (StatusCode::CREATED, "{}").into_response()
            };
            listen(Router::new().route("/orders", post(refund)).route_layer(from_fn_with_state(idem, idempotent)))
                .await
        });
        std::thread::scope(|s| {
            for k in 0..8 {
                s.spawn(move || send(address, "/orders", &format!("refund-{k}")));
            }
        });
        let mut c = crate::common::pg::client(&spec);
        refunds.push(c.query_one("SELECT count(*) FROM refunds", &[]).unwrap().get::<_, i64>(0));
    }
    eprintln!(
        "refunds paid for one order by 8 requests: read then write {}, locked {}",
        refunds[0], refunds[1]
    );
    assert!(
        refunds[0] > 1,
        "read then write at READ COMMITTED paid {} refunds: the race did not show",
        refunds[0]
    );
    assert_eq!(refunds[1], 1, "with the row locked, one refund");
}
