//! `cargo bench --bench layer`: what `idem::embed::layer` costs over a bare
//! axum handler doing the same writes, in the same run.
//!
//! Both routes pay a transfer between two wallets of a SQLite file (WAL,
//! SQLite's default durability): read both balances, two updates, one
//! insert, one commit. The bare route opens and commits the transaction
//! itself; the layered one gets it from the layer, which also parses the
//! key, fingerprints the body, claims the key and stores the answer in it.
//! Requests go through the router in process (no sockets), one at a time,
//! each with a fresh key, on a current-thread runtime, so the thread's CPU
//! time (`/proc/thread-self/schedstat`) is the request's. Rounds alternate
//! bare and layered; medians over rounds; `IDEM_BENCH_QUICK=1` shortens it.

use axum::body::Body;
use axum::extract::State;
use axum::http::{Request, StatusCode};
use axum::middleware::from_fn_with_state;
use axum::response::{IntoResponse, Response};
use axum::{Router, routing::post};
use idem::embed::Keys;
use idem::embed::layer::{Idempotency, Tx, idempotent};
use std::sync::Arc;
use std::time::Instant;
use tokio::sync::Mutex;
use tower::ServiceExt;

const WALLETS: &str = "CREATE TABLE IF NOT EXISTS wallet (name TEXT PRIMARY KEY, cents INTEGER NOT NULL);
                       INSERT OR IGNORE INTO wallet VALUES ('a', 1000000000000), ('b', 0);
                       CREATE TABLE IF NOT EXISTS moves (id INTEGER PRIMARY KEY, cents INTEGER NOT NULL)";

/// The handler's writes, on a connection with a write transaction open.
fn pay(c: &rusqlite::Connection) -> Response {
    let run = || -> rusqlite::Result<i64> {
        let balance =
            |n: &str| c.query_row("SELECT cents FROM wallet WHERE name = ?1", [n], |r| r.get::<_, i64>(0));
        let (have, _) = (balance("a")?, balance("b")?);
        c.execute("UPDATE wallet SET cents = cents - 1 WHERE name = 'a'", [])?;
        c.execute("UPDATE wallet SET cents = cents + 1 WHERE name = 'b'", [])?;
        c.execute("INSERT INTO moves (cents) VALUES (1)", [])?;
        Ok(have - 1)
    };
    match run() {
        Ok(left) => (StatusCode::CREATED, format!(r#"{{"id":{},"left":{left}}}"#, c.last_insert_rowid()))
            .into_response(),
        Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
    }
}

async fn bare(State(db): State<Arc<Mutex<rusqlite::Connection>>>, _body: String) -> Response {
    let c = db.lock().await;
    if c.execute_batch("BEGIN IMMEDIATE").is_err() {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    let r = pay(&c);
    match c.execute_batch(if r.status().is_success() { "COMMIT" } else { "ROLLBACK" }) {
        Ok(()) => r,
        Err(_) => StatusCode::SERVICE_UNAVAILABLE.into_response(),
    }
}

async fn layered(tx: Tx, _body: String) -> Response {
    match tx.sqlite().await {
        Some(c) => pay(&c),
        None => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

/// This thread's CPU time so far, in µs.
fn cpu_us() -> f64 {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap_or_default();
    text.split_whitespace().next().and_then(|ns| ns.parse::<f64>().ok()).unwrap_or(0.0) / 1000.0
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `n` requests through `app`, each with a fresh key: (CPU µs, wall µs) per request.
async fn round(app: &Router, n: usize, tag: &str) -> (f64, f64) {
    let (cpu, wall) = (cpu_us(), Instant::now());
    for i in 0..n {
        let request = Request::post("/pay")
            .header("authorization", "Bearer t")
            .header("idempotency-key", format!("\"{tag}-{i}\""))
            .header("content-type", "application/json")
            .body(Body::from(r#"{"src":"a","dst":"b","amount":1,"currency":"KRW"}"#))
            .unwrap_or_default();
        let answer = app.clone().oneshot(request).await.map(|r| r.status());
        assert_eq!(answer.ok(), Some(StatusCode::CREATED), "{tag}");
    }
    ((cpu_us() - cpu) / n as f64, wall.elapsed().as_secs_f64() * 1e6 / n as f64)
}

fn main() {
    let quick = std::env::var("IDEM_BENCH_QUICK").is_ok();
    let (rounds, n) = if quick { (3, 100) } else { (9, 400) };
    let dir = tempfile::tempdir().expect("a temporary directory");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("a runtime");
    rt.block_on(async {
        let open = |name: &str| {
            let c = rusqlite::Connection::open(dir.path().join(name)).expect("open");
            c.pragma_update(None, "journal_mode", "WAL").expect("WAL");
            c.execute_batch(WALLETS).expect("wallets");
            c
        };
        let bare_app =
            Router::new().route("/pay", post(bare)).with_state(Arc::new(Mutex::new(open("bare.db"))));
        drop(open("layer.db"));
        let db = dir.path().join("layer.db").display().to_string();
        let who = |h: &axum::http::HeaderMap| h.get("authorization").map(|_| "client".to_owned());
        let idem = Idempotency::connect(&db, Keys::new("").expect("prefix"), 1, who).await.expect("layer");
        let layer_app =
            Router::new().route("/pay", post(layered)).route_layer(from_fn_with_state(idem, idempotent));
        let (mut bare_cpu, mut bare_wall, mut layer_cpu, mut layer_wall) = (vec![], vec![], vec![], vec![]);
        for r in 0..rounds {
            let (c, w) = round(&bare_app, n, &format!("bare{r}")).await;
            bare_cpu.push(c);
            bare_wall.push(w);
            let (c, w) = round(&layer_app, n, &format!("layer{r}")).await;
            layer_cpu.push(c);
            layer_wall.push(w);
        }
        let (bc, bw, lc, lw) = (median(bare_cpu), median(bare_wall), median(layer_cpu), median(layer_wall));
        println!("{rounds} rounds of {n} requests each, alternating; medians per request");
        println!("| route | CPU µs | wall µs | requests/s |");
        println!("|---|---:|---:|---:|");
        println!("| bare handler, same writes | {bc:.1} | {bw:.1} | {:.0} |", 1e6 / bw);
        println!("| through idem::embed::layer | {lc:.1} | {lw:.1} | {:.0} |", 1e6 / lw);
        println!(
            "layer / bare: CPU {:.2}x (+{:.1} µs), throughput {:.2}x",
            lc / bc,
            lc - bc,
            (1e6 / lw) / (1e6 / bw)
        );
    });
}
