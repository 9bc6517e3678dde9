//! What the library's layer costs on PostgreSQL in round trips and in
//! statements, counted by the network hop (`idem::outside::hop`, which
//! counts the chunks sent to the server, one per round trip a client waits
//! out, and the statements in them, as `log_statement = all` lists them),
//! against a bare handler doing the same writes in its own BEGIN … COMMIT,
//! in the same run. The layer sends its claim with the BEGIN and its
//! completion with the COMMIT, typed (no prepare): a new key costs no round
//! trip more than the bare handler. On a sqlx pool, which sends one
//! statement a round trip, the claim and the completion are two more. On
//! both, the claim bounds its own lock wait: two statements more than the
//! bare handler's, none to set or restore `lock_timeout`. The draft's
//! budget, asserted here, is two of each.

use crate::common::pg;
use axum::extract::State;
use axum::http::StatusCode;
use axum::middleware::from_fn_with_state;
use axum::response::{IntoResponse, Response};
use axum::{Router, routing::post};
use idem::embed::Keys;
use idem::embed::layer::{Idempotency, Tx, idempotent};
use idem::outside::hop::Hop;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tower::ServiceExt;

const REQUESTS: u64 = 40;

/// The handler's writes, on a client whose transaction is open.
async fn pay(c: &tokio_postgres::Client) -> Response {
    let debit = c.execute("UPDATE wallet SET cents = cents - 1 WHERE id = 1", &[]).await;
    let moved = c.query_one("INSERT INTO moves (cents) VALUES (1) RETURNING id", &[]).await;
    match (debit, moved) {
        (Ok(1), Ok(row)) => {
            (StatusCode::CREATED, format!(r#"{{"move":{}}}"#, row.get::<_, i64>(0))).into_response()
        }
        _ => StatusCode::SERVICE_UNAVAILABLE.into_response(),
    }
}

async fn bare(State(c): State<Arc<tokio_postgres::Client>>) -> Response {
    if c.batch_execute("BEGIN").await.is_err() {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    let answer = pay(&c).await;
    match c.batch_execute("COMMIT").await {
        Ok(()) => answer,
        Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
    }
}

async fn layered(tx: Tx) -> Response {
    if let Some(c) = tx.client().await {
        return pay(&c).await;
    }
    match tx.sqlx_postgres().await {
        Some(mut c) => pay_sqlx(&mut c).await,
        None => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

/// [`pay`] on a sqlx connection.
async fn pay_sqlx(c: &mut sqlx::PgConnection) -> Response {
    let debit = sqlx::query("UPDATE wallet SET cents = cents - 1 WHERE id = 1").execute(&mut *c).await;
    let moved: Result<i64, _> =
        sqlx::query_scalar("INSERT INTO moves (cents) VALUES (1) RETURNING id").fetch_one(&mut *c).await;
    match (debit, moved) {
        (Ok(d), Ok(id)) if d.rows_affected() == 1 => {
            (StatusCode::CREATED, format!(r#"{{"move":{id}}}"#)).into_response()
        }
        _ => StatusCode::SERVICE_UNAVAILABLE.into_response(),
    }
}

/// [`bare`] on a sqlx pool: its own transaction.
async fn bare_sqlx(State(pool): State<sqlx::PgPool>) -> Response {
    let Ok(mut tx) = pool.begin().await else { return StatusCode::SERVICE_UNAVAILABLE.into_response() };
    let answer = pay_sqlx(&mut tx).await;
    match tx.commit().await {
        Ok(()) => answer,
        Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
    }
}

/// Round trips and statements per request through `app`, each request
/// under a new key.
async fn trips(app: &Router, hop: &Hop, tag: &str) -> [f64; 2] {
    let send = |i: u64| {
        let request = axum::http::Request::post("/pay")
            .header("x-client", "shop")
            .header("idempotency-key", format!("\"{tag}-{i}\""))
            .body(axum::body::Body::from(r#"{"cents":1}"#))
            .unwrap();
        app.clone().oneshot(request)
    };
    // What a request sends after its answer (sqlx pings a connection it
    // takes back, in a task of its own) is let through before each count:
    // else the warm-up's lands inside the window, or the last's outside.
    let settled = || async {
        tokio::time::sleep(Duration::from_millis(50)).await;
        [&hop.to_server, &hop.statements].map(|n| n.load(Ordering::Relaxed))
    };
    // the connection is made, and warm, before counting
    assert_eq!(send(u64::MAX).await.unwrap().status(), StatusCode::CREATED, "{tag}");
    let before = settled().await;
    for i in 0..REQUESTS {
        assert_eq!(send(i).await.unwrap().status(), StatusCode::CREATED, "{tag}");
    }
    let after = settled().await;
    [0, 1].map(|i| (after[i] - before[i]) as f64 / REQUESTS as f64)
}

#[test]
fn the_layer_costs_at_most_two_round_trips_and_two_statements_over_the_bare_handler_on_postgres() {
    within_two(false, "tokio-postgres");
}

#[test]
fn on_a_sqlx_pool_the_layer_costs_at_most_two_round_trips_and_two_statements_over_the_bare_handler() {
    within_two(true, "sqlx");
}

fn within_two(on_sqlx: bool, face: &str) {
    let ([bare_trips, bare_statements], [layer_trips, layer_statements]) = counted(on_sqlx);
    eprintln!(
        "{face}, a request: bare handler {bare_trips:.2} round trips and {bare_statements:.2} statements, \
         through the layer {layer_trips:.2} and {layer_statements:.2}"
    );
    assert!(layer_trips <= bare_trips + 2.0, "the layer: {layer_trips:.2} round trips, bare {bare_trips:.2}");
    assert!(
        layer_statements <= bare_statements + 2.0,
        "the layer: {layer_statements:.2} statements, bare {bare_statements:.2}"
    );
}

/// Round trips a request, bare and through the layer, on tokio-postgres or
/// (`on_sqlx`) on sqlx pools, and statements; all 0 without a PostgreSQL
/// to run on.
fn counted(on_sqlx: bool) -> ([f64; 2], [f64; 2]) {
    let Some(server) = pg::server() else { return ([0.0; 2], [0.0; 2]) };
    let spec = server.fresh_schema(false);
    pg::execute(
        &spec,
        "CREATE TABLE wallet (id BIGINT PRIMARY KEY, cents BIGINT NOT NULL);
         INSERT INTO wallet VALUES (1, 1000000000);
         CREATE TABLE moves (id BIGSERIAL PRIMARY KEY, cents BIGINT NOT NULL)",
    );
    // one thread: what one request sends is written before the hop reads it
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let (hop, through) = Hop::to_postgres(&spec, Duration::ZERO).unwrap();
        let who = |h: &axum::http::HeaderMap| h.get("x-client").map(|_| "shop".to_owned());
        let keys = Keys::new("trips_").unwrap();
        let (bare_app, idem) = if on_sqlx {
            let options = pg::sqlx_options(&through);
            let pool =
                || sqlx::postgres::PgPoolOptions::new().max_connections(1).connect_with(options.clone());
            let bare_app = Router::new().route("/pay", post(bare_sqlx)).with_state(pool().await.unwrap());
            (bare_app, Idempotency::on_sqlx_postgres(pool().await.unwrap(), keys, who).await.unwrap())
        } else {
            let (client, connection) =
                tokio_postgres::connect(&through, tokio_postgres::NoTls).await.unwrap();
            tokio::spawn(connection);
            let bare_app = Router::new().route("/pay", post(bare)).with_state(Arc::new(client));
            (bare_app, Idempotency::connect(&through, keys, 1, who).await.unwrap())
        };
        let layer_app =
            Router::new().route("/pay", post(layered)).route_layer(from_fn_with_state(idem, idempotent));
        (trips(&bare_app, &hop, "bare").await, trips(&layer_app, &hop, "layer").await)
    })
}
