//! `cargo bench --bench layer_pg` (or `just bench-layer-pg`): what
//! `idem::embed::layer` costs a team's axum service on PostgreSQL under
//! load, against a bare handler doing the same writes, in the same run.
//!
//! An orders service, as a team writes one: `POST /orders` inserts an
//! order in a transaction on the team's own pool of 10 and answers 201 with
//! its id. The bare route begins and commits the transaction itself; the
//! layered one gets it from the layer (claim, the handler's insert,
//! completion, commit). Both faces a team uses: a sqlx `PgPool` and a
//! deadpool-postgres pool (tokio-postgres); each route has its own pool.
//! The service runs on a two-worker runtime on loopback; 64 keep-alive
//! HTTP connections post new orders, each under a new key, for
//! `IDEM_BENCH_SECONDS` (default 3) a round. Rounds alternate bare and
//! layered (`IDEM_BENCH_ROUNDS`, default 5); medians over rounds of
//! orders/s, p99, the service's CPU per order (its runtime's threads) and
//! PostgreSQL's (every `postgres` process on the machine), and the ratio
//! layer/bare. After each round the orders table holds one order per 201.
//!
//! Needs `IDEM_BENCH_PG=<conninfo>` of an empty database (the recipe makes
//! one on a local cluster).

use axum::extract::State;
use axum::http::StatusCode;
use axum::middleware::from_fn_with_state;
use axum::response::{IntoResponse, Response};
use axum::{Router, routing::post};
use idem::embed::Keys;
use idem::embed::layer::{Idempotency, Tx, idempotent};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

const CLIENTS: usize = 64;
const POOL: usize = 10;
const INSERT: &str = "INSERT INTO orders (item, cents) VALUES ('book', 1200) RETURNING id";
/// Numbers the keys, so that none is used twice in one bench.
static KEYS: AtomicU64 = AtomicU64::new(0);

fn created(id: i64) -> Response {
    (StatusCode::CREATED, [("content-type", "application/json")], format!(r#"{{"order":{id}}}"#))
        .into_response()
}

fn unavailable() -> Response {
    StatusCode::SERVICE_UNAVAILABLE.into_response()
}

async fn bare_sqlx(State(pool): State<sqlx::PgPool>, _body: String) -> Response {
    let Ok(mut tx) = pool.begin().await else { return unavailable() };
    let Ok(id) = sqlx::query_scalar::<_, i64>(INSERT).fetch_one(&mut *tx).await else { return unavailable() };
    match tx.commit().await {
        Ok(()) => created(id),
        Err(_) => unavailable(),
    }
}

async fn bare_deadpool(State(pool): State<deadpool_postgres::Pool>, _body: String) -> Response {
    let Ok(mut c) = pool.get().await else { return unavailable() };
    let Ok(tx) = c.transaction().await else { return unavailable() };
    let Ok(row) = tx.query_one(INSERT, &[]).await else { return unavailable() };
    match tx.commit().await {
        Ok(()) => created(row.get(0)),
        Err(_) => unavailable(),
    }
}

async fn layered(tx: Tx, _body: String) -> Response {
    if let Some(c) = tx.client().await {
        return match c.query_one(INSERT, &[]).await {
            Ok(row) => created(row.get(0)),
            Err(_) => unavailable(),
        };
    }
    let Some(mut c) = tx.sqlx_postgres().await else {
        return StatusCode::INTERNAL_SERVER_ERROR.into_response();
    };
    match sqlx::query_scalar::<_, i64>(INSERT).fetch_one(&mut *c).await {
        Ok(id) => created(id),
        Err(_) => unavailable(),
    }
}

/// Posts one order on a keep-alive connection; its status.
fn send(stream: &mut BufReader<TcpStream>, key: u64) -> u16 {
    let body = r#"{"item":"book","cents":1200}"#;
    let request = format!(
        "POST /orders HTTP/1.1\r\nHost: b\r\nX-Client: shop\r\nIdempotency-Key: \"o-{key}\"\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    if stream.get_mut().write_all(request.as_bytes()).is_err() {
        return 0;
    }
    let (mut status, mut length, mut line) = (0, 0, String::new());
    loop {
        line.clear();
        if stream.read_line(&mut line).unwrap_or(0) == 0 {
            return 0;
        }
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some(rest) = l.strip_prefix("HTTP/1.1 ") {
            status = rest.get(..3).and_then(|s| s.parse().ok()).unwrap_or(0);
        } else if let Some((name, value)) = l.split_once(':')
            && name.eq_ignore_ascii_case("content-length")
        {
            length = value.trim().parse().unwrap_or(0);
        }
    }
    let mut rest = vec![0; length];
    if stream.read_exact(&mut rest).is_err() {
        return 0;
    }
    status
}

/// User and system time, in µs, of the threads of this process whose name
/// starts with `prefix`, or of every process named `postgres`.
fn cpu_us(of: Cpu) -> f64 {
    let ticks = |stat: &str| -> u64 {
        // after the command's closing parenthesis: state is field 3, utime 14, stime 15
        let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
        let f: Vec<&str> = rest.split_whitespace().collect();
        f.get(11).and_then(|u| u.parse::<u64>().ok()).unwrap_or(0)
            + f.get(12).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0)
    };
    let (dir, name) = match of {
        Cpu::Service => ("/proc/self/task", "layer-bench"),
        Cpu::Postgres => ("/proc", "postgres"),
    };
    let mut total = 0;
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let comm = std::fs::read_to_string(entry.path().join("comm")).unwrap_or_default();
        if comm.trim_end().starts_with(name) {
            total += ticks(&std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default());
        }
    }
    // the kernel's USER_HZ is 100 on every Linux this runs on
    total as f64 * 10_000.0
}

#[derive(Clone, Copy)]
enum Cpu {
    Service,
    Postgres,
}

/// One round of load on `address`: (orders/s, p99 ms, service CPU µs an
/// order, PostgreSQL CPU µs an order, 201s).
fn round(address: SocketAddr, length: Duration) -> [f64; 5] {
    let stop = Arc::new(AtomicBool::new(false));
    let (service, postgres, start) = (cpu_us(Cpu::Service), cpu_us(Cpu::Postgres), Instant::now());
    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let stream = TcpStream::connect(address).expect("the service");
                stream.set_nodelay(true).expect("nodelay");
                let (mut stream, mut took, mut failed) = (BufReader::new(stream), Vec::new(), 0u64);
                while !stop.load(Ordering::Relaxed) {
                    let sent = Instant::now();
                    match send(&mut stream, KEYS.fetch_add(1, Ordering::Relaxed)) {
                        201 => took.push(sent.elapsed().as_micros() as u32),
                        _ => failed += 1,
                    }
                }
                (took, failed)
            })
        })
        .collect();
    std::thread::sleep(length);
    stop.store(true, Ordering::Relaxed);
    let (mut took, mut failed) = (Vec::new(), 0);
    for client in clients {
        let (t, f) = client.join().expect("a client");
        took.extend(t);
        failed += f;
    }
    let elapsed = start.elapsed().as_secs_f64();
    let n = took.len() as f64;
    assert!(failed == 0, "{failed} orders were not created");
    took.sort_unstable();
    let p99 = took.get(((n - 1.0) * 0.99) as usize).map_or(0.0, |v| f64::from(*v) / 1000.0);
    let service = (cpu_us(Cpu::Service) - service) / n;
    let postgres = (cpu_us(Cpu::Postgres) - postgres) / n;
    [n / elapsed, p99, service, postgres, n]
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Serves `app` on loopback, on `rt`.
fn serve(rt: &tokio::runtime::Runtime, app: Router) -> SocketAddr {
    rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("a port");
        let address = listener.local_addr().expect("its address");
        tokio::spawn(async move { axum::serve(listener, app).await });
        address
    })
}

/// The bare and the layered service on one face, each on its own pool.
fn apps(rt: &tokio::runtime::Runtime, spec: &str, face: &str) -> (Router, Router) {
    let who = |h: &axum::http::HeaderMap| h.get("x-client").map(|_| "shop".to_owned());
    rt.block_on(async {
        let keys = Keys::new("bench_").expect("prefix");
        if face == "sqlx" {
            let options: sqlx::postgres::PgConnectOptions =
                spec_to_url(spec).parse().expect("a URL sqlx takes");
            let pool = || {
                sqlx::postgres::PgPoolOptions::new()
                    .max_connections(POOL as u32)
                    .connect_with(options.clone())
            };
            let bare =
                Router::new().route("/orders", post(bare_sqlx)).with_state(pool().await.expect("a pool"));
            let idem =
                Idempotency::on_sqlx_postgres(pool().await.expect("a pool"), keys, who).await.expect("layer");
            let layered = Router::new()
                .route("/orders", post(layered))
                .route_layer(from_fn_with_state(idem, idempotent));
            (bare, layered)
        } else {
            let pool = || {
                let config: tokio_postgres::Config = spec.parse().expect("a connection string");
                let manager = deadpool_postgres::Manager::new(config, tokio_postgres::NoTls);
                deadpool_postgres::Pool::builder(manager).max_size(POOL).build().expect("a pool")
            };
            let bare = Router::new().route("/orders", post(bare_deadpool)).with_state(pool());
            let idem = Idempotency::on_deadpool(pool(), keys, who).await.expect("layer");
            let layered = Router::new()
                .route("/orders", post(layered))
                .route_layer(from_fn_with_state(idem, idempotent));
            (bare, layered)
        }
    })
}

/// A key=value connection string as the URL sqlx takes (host, port, user,
/// database; a socket directory goes in `host=`).
fn spec_to_url(spec: &str) -> String {
    let config: tokio_postgres::Config = spec.parse().expect("a connection string");
    let host = match config.get_hosts().first() {
        Some(tokio_postgres::config::Host::Unix(dir)) => format!("?host={}", dir.display()),
        Some(tokio_postgres::config::Host::Tcp(h)) => format!("?host={h}"),
        None => String::new(),
    };
    let port = config.get_ports().first().map_or(String::new(), |p| format!("&port={p}"));
    let user = config.get_user().unwrap_or("postgres");
    let db = config.get_dbname().unwrap_or("postgres");
    format!("postgres://{user}@localhost/{db}{host}{port}")
}

fn orders(spec: &str) -> i64 {
    let mut c = postgres::Client::connect(spec, postgres::NoTls).expect("PostgreSQL");
    c.query_one("SELECT count(*) FROM orders", &[]).expect("orders").get(0)
}

fn main() {
    let Ok(spec) = std::env::var("IDEM_BENCH_PG") else {
        eprintln!("IDEM_BENCH_PG=<conninfo of an empty database> is needed (just bench-layer-pg makes one)");
        std::process::exit(2);
    };
    let rounds: usize = std::env::var("IDEM_BENCH_ROUNDS").ok().and_then(|s| s.parse().ok()).unwrap_or(5);
    let length = Duration::from_secs_f64(
        std::env::var("IDEM_BENCH_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(3.0),
    );
    let mut c = postgres::Client::connect(&spec, postgres::NoTls).expect("PostgreSQL");
    c.batch_execute(
        "DROP TABLE IF EXISTS orders, bench_idem_keys, bench_idem_schema;
         CREATE TABLE orders (id BIGSERIAL PRIMARY KEY, item TEXT NOT NULL, cents BIGINT NOT NULL)",
    )
    .expect("the orders table");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("layer-bench")
        .enable_all()
        .build()
        .expect("a runtime");
    println!(
        "{CLIENTS} connections, pools of {POOL}, {rounds} rounds of {length:?} a route, alternating; medians"
    );
    println!("| face | route | orders/s | p99 ms | service CPU µs/order | PostgreSQL CPU µs/order |");
    println!("|---|---|---:|---:|---:|---:|");
    for face in ["sqlx", "tokio-postgres"] {
        let (bare, layered) = apps(&rt, &spec, face);
        let (bare, layered) = (serve(&rt, bare), serve(&rt, layered));
        let mut runs = [Vec::new(), Vec::new()];
        let mut ratios = Vec::new();
        for _ in 0..rounds {
            for (i, address) in [bare, layered].into_iter().enumerate() {
                let before = orders(&spec);
                let r = round(address, length);
                assert_eq!(orders(&spec) - before, r[4] as i64, "{face}: orders = 201s");
                runs[i].push(r);
            }
            let [b, l] = [&runs[0], &runs[1]].map(|v| v.last().map_or(0.0, |r| r[0]));
            ratios.push(l / b);
        }
        let mut med = [[0.0; 4]; 2];
        for (i, route) in ["bare handler", "through the layer"].iter().enumerate() {
            med[i] = [0, 1, 2, 3].map(|k| median(runs[i].iter().map(|r| r[k]).collect()));
            let [rate, p99, service, postgres] = med[i];
            println!("| {face} | {route} | {rate:.0} | {p99:.1} | {service:.0} | {postgres:.0} |");
        }
        let (lo, hi) = ratios.iter().fold((f64::MAX, 0.0f64), |(lo, hi), r| (lo.min(*r), hi.max(*r)));
        println!(
            "| {face} | layer / bare | **{:.2}×** (rounds {lo:.2}–{hi:.2}) | {:.2}× | {:.2}× | {:.2}× |",
            median(ratios.clone()),
            med[1][1] / med[0][1],
            med[1][2] / med[0][2],
            med[1][3] / med[0][3]
        );
    }
}
