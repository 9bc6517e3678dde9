//! `Prefer: wait=N` (RFC 7240) on the library's layer, on PostgreSQL (the
//! team's tokio-postgres connections, and its sqlx pool): a retry that
//! meets its key in flight, its first still in the handler's transaction,
//! waits for the first's answer and returns it (`Preference-Applied:
//! wait`), holding no connection while it waits: on a pool of two, with
//! the first holding one and five retries waiting, a request under another
//! key is answered at once. Without the header, 409 at once; past N, 409.
//! (On SQLite a request waits its turn for the one writer, and never meets
//! a key in flight.)

use axum::extract::State;
use axum::http::StatusCode;
use axum::middleware::from_fn_with_state;
use axum::response::IntoResponse;
use axum::{Router, routing::post};
use idem::check::http::{Http, exchange};
use idem::embed::Keys;
use idem::embed::layer::{Idempotency, Tx, idempotent};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// How long the handler keeps its transaction open before it answers.
const SLOW: Duration = Duration::from_millis(1500);

fn send(address: SocketAddr, key: &str, prefer: Option<&str>) -> (Http, Duration) {
    let prefer = prefer.map_or(String::new(), |p| format!("Prefer: {p}\r\n"));
    let body = r#"{"item":"tea"}"#;
    let request = format!(
        "POST /orders HTTP/1.1\r\nHost: x\r\nX-Client: c1\r\nIdempotency-Key: \"{key}\"\r\n{prefer}\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let begun = Instant::now();
    let answer = exchange(address, request.as_bytes()).unwrap();
    (answer, begun.elapsed())
}

fn header<'h>(h: &'h Http, name: &str) -> Option<&'h str> {
    h.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
}

/// An order, written in the layer's transaction; the first of each key is
/// slow (its transaction open for [`SLOW`]).
async fn order(State(slow): State<&'static str>, tx: Tx) -> axum::response::Response {
    let id: i64 = match tx.client().await {
        Some(c) => {
            c.query_one("INSERT INTO orders (item) VALUES ('tea') RETURNING id", &[]).await.unwrap().get(0)
        }
        None => {
            let mut c = tx.sqlx_postgres().await.unwrap();
            sqlx::query_scalar("INSERT INTO orders (item) VALUES ('tea') RETURNING id")
                .fetch_one(&mut *c)
                .await
                .unwrap()
        }
    };
    if id == 1 {
        tokio::time::sleep(SLOW).await;
    }
    (StatusCode::CREATED, format!(r#"{{"order":{id},"on":"{slow}"}}"#)).into_response()
}

#[test]
fn on_postgres_a_retry_that_prefers_to_wait_gets_the_firsts_answer_and_holds_no_connection() {
    let Some(server) = crate::common::pg::server() else { return };
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    for face in ["tokio-postgres", "sqlx"] {
        let spec = server.fresh_schema(false);
        crate::common::pg::execute(&spec, "CREATE TABLE orders (id BIGSERIAL PRIMARY KEY, item TEXT)");
        let address = runtime.block_on(async {
            let who = |_: &axum::http::HeaderMap| Some("c1".to_owned());
            let keys = Keys::new("wait_").unwrap();
            let idem = match face {
                "sqlx" => {
                    let options = crate::common::pg::sqlx_options(&spec);
                    let pool = sqlx::postgres::PgPoolOptions::new()
                        .max_connections(2)
                        .connect_with(options)
                        .await
                        .unwrap();
                    Idempotency::on_sqlx_postgres(pool, keys, who).await.unwrap()
                }
                _ => Idempotency::connect(&spec, keys, 2, who).await.unwrap(),
            };
            let app = Router::new()
                .route("/orders", post(order))
                .route_layer(from_fn_with_state(idem, idempotent))
                .with_state(if face == "sqlx" { "sqlx" } else { "tokio-postgres" });
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let address = listener.local_addr().unwrap();
            tokio::spawn(async move { axum::serve(listener, app).await });
            address
        });
        let t0 = Instant::now();
        std::thread::scope(|s| {
            let first = s.spawn(|| send(address, "k-1", None));
            std::thread::sleep(Duration::from_millis(300));
            let (plain, took) = send(address, "k-1", None);
            assert_eq!(plain.status, 409, "{face}: {plain:?}");
            assert!(took < Duration::from_millis(700), "{face}: a retry without Prefer took {took:?}");
            let waiters: Vec<_> = (0..5).map(|_| s.spawn(|| send(address, "k-1", Some("wait=5")))).collect();
            std::thread::sleep(Duration::from_millis(200));
            // the first holds one of two connections; five retries wait: one
            // that held a connection would leave none for another key
            let (other, took) = send(address, "k-other", None);
            assert_eq!(other.status, 201, "{face}: {other:?}");
            assert!(
                took < Duration::from_millis(700),
                "{face}: another key waited {took:?} behind the waiters"
            );
            let (short, took) = send(address, "k-1", Some("wait=0"));
            assert_eq!(
                (short.status, header(&short, "preference-applied")),
                (409, None),
                "{face}: {short:?}"
            );
            assert!(took < Duration::from_millis(700), "{face}: wait=0 took {took:?}");
            let (first, first_took) = first.join().unwrap();
            assert_eq!(first.status, 201, "{face}: {first:?}");
            for waiter in waiters {
                let (waited, _) = waiter.join().unwrap();
                assert_eq!((waited.status, &waited.body), (201, &first.body), "{face}");
                assert_eq!(header(&waited, "preference-applied"), Some("wait"), "{face}");
                assert_eq!(header(&waited, "idempotent-replayed"), Some("true"), "{face}");
            }
            eprintln!(
                "{face}: the first answered at {} ms; five waiters got its answer by {} ms",
                first_took.as_millis(),
                t0.elapsed().as_millis()
            );
        });
        let orders = crate::common::pg::client(&spec).query_one("SELECT COUNT(*) FROM orders", &[]).unwrap();
        assert_eq!(orders.get::<_, i64>(0), 2, "{face}: one order for k-1, one for k-other");
    }
}
