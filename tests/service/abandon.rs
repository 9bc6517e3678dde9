//! The library's layer under an abandonment storm, on both stores: clients
//! that hang up before their body is sent, while their handler runs or
//! while it waits for a row lock, and handlers that panic after their
//! writes. Afterwards every key is retried until it answers: each must
//! have paid exactly once (never twice, never stuck at 409), every answer a
//! client heard must be the one its retry replays, and the requests that
//! did not hang up must have met nothing but 201 and 409 (no 503 left
//! behind by someone else's abandoned transaction). The same storm runs on
//! the application's own sqlx pools (PostgreSQL and SQLite), and, less the
//! panics, against `idem serve` on PostgreSQL.

use crate::common::pg;
use crate::server::Serve;
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::from_fn_with_state;
use axum::response::{IntoResponse, Response};
use axum::{Router, routing::post};
use idem::embed::Keys;
use idem::embed::layer::{Idempotency, Tx, idempotent};
use idem::rng::Rng;
use std::collections::{BTreeMap, HashMap};
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const WALLETS: i64 = 4;
const OPENING: i64 = 1_000_000;
const KEYS: u64 = 500;
const ATTEMPTS: u64 = 3_000;
const CLIENTS: u64 = 12;

/// The caller's own tables (nothing of idem's): wallets, and one row per
/// execution of a key's request.
const SCHEMA: &str = "CREATE TABLE wallet (id BIGINT PRIMARY KEY, cents BIGINT NOT NULL);
                      CREATE TABLE moves (id {serial}, key TEXT NOT NULL, cents BIGINT NOT NULL)";

#[test]
fn sqlite_an_abandonment_storm_pays_every_key_once_and_strands_none() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("storm.db");
    let conn = rusqlite::Connection::open(&path).unwrap();
    conn.execute_batch(&SCHEMA.replace("{serial}", "INTEGER PRIMARY KEY")).unwrap();
    for w in 0..WALLETS {
        conn.execute("INSERT INTO wallet VALUES (?1, ?2)", [w, OPENING]).unwrap();
    }
    drop(conn);
    let runtime = runtime();
    let moves = storm(&Target::layer(runtime.block_on(serve(&path.display().to_string()))));
    let conn = rusqlite::Connection::open(&path).unwrap();
    let mut select = conn.prepare("SELECT key, id, cents FROM moves").unwrap();
    let rows = select.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)));
    let rows: Vec<_> = rows.unwrap().map(Result::unwrap).collect();
    drop(select);
    let total: i64 = conn.query_row("SELECT sum(cents) FROM wallet", [], |r| r.get(0)).unwrap();
    judge(moves, rows, total, WALLETS * OPENING, "move");
}

#[test]
fn sqlx_sqlite_an_abandonment_storm_pays_every_key_once_and_strands_none() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("storm.db");
    let runtime = runtime();
    let (moves, rows, total) = runtime.block_on(async {
        use sqlx::sqlite::{SqliteConnectOptions, SqlitePool};
        let options = SqliteConnectOptions::new().filename(&path).create_if_missing(true);
        let options = options.journal_mode(sqlx::sqlite::SqliteJournalMode::Wal);
        let pool = SqlitePool::connect_with(options).await.unwrap();
        sqlx::raw_sql(sqlx::AssertSqlSafe(SCHEMA.replace("{serial}", "INTEGER PRIMARY KEY")))
            .execute(&pool)
            .await
            .unwrap();
        for w in 0..WALLETS {
            sqlx::query("INSERT INTO wallet VALUES (?1, ?2)")
                .bind(w)
                .bind(OPENING)
                .execute(&pool)
                .await
                .unwrap();
        }
        let idem =
            Idempotency::on_sqlx_sqlite(pool.clone(), Keys::new("storm_").unwrap(), client).await.unwrap();
        let address = serve_on(idem).await;
        let moves = tokio::task::spawn_blocking(move || storm(&Target::layer(address))).await.unwrap();
        let rows: Vec<(String, i64, i64)> =
            sqlx::query_as("SELECT key, id, cents FROM moves").fetch_all(&pool).await.unwrap();
        let total: i64 = sqlx::query_scalar("SELECT sum(cents) FROM wallet").fetch_one(&pool).await.unwrap();
        (moves, rows, total)
    });
    judge(moves, rows, total, WALLETS * OPENING, "move");
}

#[test]
fn sqlx_postgres_an_abandonment_storm_pays_every_key_once_and_strands_none() {
    storm_on_postgres(true);
}

#[test]
fn postgres_an_abandonment_storm_pays_every_key_once_and_strands_none() {
    storm_on_postgres(false);
}

/// The storm on PostgreSQL, through the layer on connections of its own
/// or on the application's sqlx pool.
fn storm_on_postgres(on_sqlx: bool) {
    let Some(server) = pg::server() else { return };
    let spec = server.fresh_schema(false);
    pg::execute(&spec, &SCHEMA.replace("{serial}", "BIGSERIAL PRIMARY KEY"));
    for w in 0..WALLETS {
        pg::execute(&spec, &format!("INSERT INTO wallet VALUES ({w}, {OPENING})"));
    }
    let runtime = runtime();
    let moves = runtime.block_on(async {
        let keys = Keys::new("storm_").unwrap();
        let idem = match on_sqlx {
            true => {
                let pool = sqlx::postgres::PgPoolOptions::new().max_connections(8);
                let pool = pool.connect_with(pg::sqlx_options(&spec)).await.unwrap();
                Idempotency::on_sqlx_postgres(pool, keys, client).await.unwrap()
            }
            false => Idempotency::connect(&spec, keys, 8, client).await.unwrap(),
        };
        let address = serve_on(idem).await;
        tokio::task::spawn_blocking(move || storm(&Target::layer(address))).await.unwrap()
    });
    let mut c = pg::client(&spec);
    let rows = c.query("SELECT key, id, cents FROM moves", &[]).unwrap();
    let rows = rows.iter().map(|r| (r.get(0), r.get(1), r.get(2))).collect();
    let total: i64 = c.query_one("SELECT sum(cents)::bigint FROM wallet", &[]).unwrap().get(0);
    judge(moves, rows, total, WALLETS * OPENING, "move");
}

#[test]
fn idem_serve_on_postgres_through_an_abandonment_storm_pays_every_key_once() {
    let Some(server) = pg::server() else { return };
    let spec = server.fresh_schema(false);
    pg::execute(
        &spec,
        "CREATE TABLE account (acct_id TEXT PRIMARY KEY, holder TEXT, balance BIGINT NOT NULL)",
    );
    for w in 0..WALLETS {
        pg::execute(&spec, &format!("INSERT INTO account VALUES ('w{w}', 'h', {OPENING})"));
    }
    let serve = Serve::start(std::path::Path::new(&spec), &[("tok-storm", "shop")], &["--pool", "8"], &[]);
    let address = serve.url.trim_start_matches("http://").parse().unwrap();
    let moves = storm(&Target {
        address,
        path: "/v1/transfers",
        auth: "Authorization: Bearer tok-storm",
        body: |cents, wallet| {
            let dst = (wallet + 1) % WALLETS;
            format!(r#"{{"src":"w{wallet}","dst":"w{dst}","amount":{cents},"currency":"KRW"}}"#)
        },
        panics: false,
    });
    serve.stop();
    let mut c = pg::client(&spec);
    // a transfer whose key did not complete with it would be listed under no key
    let sql = "SELECT coalesce(k.idem_key, 'no key'), t.transfer_id, t.amount
               FROM transfer t LEFT JOIN idem_key k ON k.transfer_id = t.transfer_id";
    let rows = c.query(sql, &[]).unwrap();
    let rows = rows.iter().map(|r| (r.get(0), r.get(1), 0)).collect();
    let total: i64 = c.query_one("SELECT sum(balance)::bigint FROM account", &[]).unwrap().get(0);
    judge(moves, rows, total, WALLETS * OPENING, "transfer_id");
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

/// What the storm heard, per key: every answer a client read to its end.
type Heard = BTreeMap<String, Vec<(u16, String)>>;

/// Where the storm's requests go, and how a key's request looks there.
struct Target {
    address: SocketAddr,
    path: &'static str,
    /// The header line that names the client.
    auth: &'static str,
    /// The body of a key's request: its amount and its wallet.
    body: fn(i64, i64) -> String,
    /// Whether the handler panics when asked (the layer's test handler).
    panics: bool,
}

impl Target {
    /// The layer's test service at `address`.
    fn layer(address: SocketAddr) -> Target {
        Target {
            address,
            path: "/pay",
            auth: "X-Client: shop",
            body: |cents, _| format!(r#"{{"cents":{cents}}}"#),
            panics: true,
        }
    }
}

/// Runs the storm against `target`, then retries every key until it
/// answers; returns what was heard, and fails on a stuck key.
fn storm(target: &Target) -> Heard {
    let heard: Arc<Mutex<Heard>> = Arc::default();
    std::thread::scope(|s| {
        for c in 0..CLIENTS {
            let heard = heard.clone();
            s.spawn(move || {
                let mut rng = Rng::new(0x5eed_0000 + c);
                for _ in 0..ATTEMPTS / CLIENTS {
                    let key = format!("k-{}", rng.below(KEYS));
                    if let Some(answer) = attempt(target, &key, &mut rng) {
                        heard.lock().unwrap().entry(key).or_default().push(answer);
                    }
                }
            });
        }
    });
    let mut heard = Arc::into_inner(heard).unwrap().into_inner().unwrap();
    for k in 0..KEYS {
        let key = format!("k-{k}");
        let deadline = Instant::now() + Duration::from_secs(10);
        let last = loop {
            let answer = send(target, &key, Mode::Whole).expect("a retry is answered");
            if answer.0 != 409 || Instant::now() > deadline {
                break answer;
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        assert_ne!(last.0, 409, "{key} is stuck in progress 10 s after the storm");
        heard.entry(key).or_default().push(last);
    }
    heard
}

/// Every key paid once, every 201 heard the same as the key's last answer
/// (a replay of it) and naming its payment (the body's `field`), no answer
/// but 201 and 409, and the wallets holding `expected` less the moves'
/// cents.
fn judge(heard: Heard, moves: Vec<(String, i64, i64)>, total: i64, expected: i64, field: &str) {
    let mut paid: HashMap<&str, Vec<i64>> = HashMap::new();
    for (key, id, _) in &moves {
        paid.entry(key).or_default().push(*id);
    }
    let twice: Vec<_> = paid.iter().filter(|(_, ids)| ids.len() > 1).collect();
    assert!(twice.is_empty(), "keys paid more than once: {twice:?}");
    for (key, answers) in &heard {
        let last = answers.last().unwrap();
        assert_eq!(last.0, 201, "{key}: {last:?}");
        let odd: Vec<_> = answers.iter().filter(|(s, _)| ![201, 409].contains(s)).collect();
        assert!(odd.is_empty(), "{key}: answers other than 201 and 409: {odd:?}");
        let id = paid.get(key.as_str()).map_or(-1, |ids| ids[0]);
        let named = serde_json::from_str::<serde_json::Value>(&last.1).ok().and_then(|v| v[field].as_i64());
        assert_eq!(named, Some(id), "{key}: the answer names its payment: {}", last.1);
        for answer in answers.iter().filter(|(s, _)| *s == 201) {
            assert_eq!(answer, last, "{key}: a 201 heard differs from its replay");
        }
    }
    assert_eq!(paid.len() as u64, KEYS, "every key paid");
    let heard_201 = heard.values().flatten().filter(|(s, _)| *s == 201).count();
    let heard_409 = heard.values().flatten().filter(|(s, _)| *s == 409).count();
    eprintln!(
        "abandonment storm: {ATTEMPTS} attempts on {KEYS} keys, then one retry each: {} moves, \
         {heard_201} answers 201 and {heard_409} answers 409 heard, none else",
        moves.len()
    );
    let debited: i64 = moves.iter().map(|(_, _, cents)| cents).sum();
    assert_eq!(total, expected - debited, "the wallets hold what the moves say");
}

/// The client a request names.
fn client(h: &HeaderMap) -> Option<String> {
    h.get("x-client").and_then(|v| v.to_str().ok()).map(String::from)
}

/// The layer on `db` over [`pay`], served on loopback.
async fn serve(db: &str) -> SocketAddr {
    serve_on(Idempotency::connect(db, Keys::new("storm_").unwrap(), 8, client).await.unwrap()).await
}

/// The layer on `idem`'s store over [`pay`], served on loopback.
async fn serve_on(idem: Idempotency) -> SocketAddr {
    let app = Router::new().route("/pay", post(pay)).route_layer(from_fn_with_state(idem, idempotent));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    address
}

/// Debits `cents` from the key's wallet and records the move, then waits
/// `x-sleep-ms` holding the wallet's row (others queue on it), then
/// panics if `x-panic` says so, else answers the move's id.
async fn pay(tx: Tx, headers: HeaderMap, body: String) -> Response {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    let key = header("idempotency-key").trim_matches('"').to_owned();
    let cents: i64 = body.trim_start_matches(r#"{"cents":"#).trim_end_matches('}').parse().unwrap();
    let wallet = wallet(&key);
    let (debit, record) = (
        "UPDATE wallet SET cents = cents - $2 WHERE id = $1",
        "INSERT INTO moves (key, cents) VALUES ($1, $2) RETURNING id",
    );
    let on_pg = if let Some(c) = tx.client().await {
        c.execute(debit, &[&wallet, &cents]).await.unwrap();
        Some(c.query_one(record, &[&key, &cents]).await.unwrap().get(0))
    } else if let Some(mut c) = tx.sqlx_postgres().await {
        sqlx::query(debit).bind(wallet).bind(cents).execute(&mut *c).await.unwrap();
        Some(sqlx::query_scalar(record).bind(&key).bind(cents).fetch_one(&mut *c).await.unwrap())
    } else {
        None
    };
    // SQLite numbers `?n` as written (it would number `$n` by first use)
    let (debit, record) = (debit.replace('$', "?"), record.replace('$', "?"));
    let (debit, record) = (sqlx::AssertSqlSafe(debit), sqlx::AssertSqlSafe(record));
    let id: i64 = if let Some(id) = on_pg {
        id
    } else if let Some(c) = tx.sqlite().await {
        c.execute(&debit.0, [wallet, cents]).unwrap();
        c.query_row(&record.0, rusqlite::params![key, cents], |r| r.get(0)).unwrap()
    } else {
        let mut c = tx.sqlx_sqlite().await.unwrap();
        sqlx::query(debit).bind(wallet).bind(cents).execute(&mut *c).await.unwrap();
        sqlx::query_scalar(record).bind(&key).bind(cents).fetch_one(&mut *c).await.unwrap()
    };
    tokio::time::sleep(Duration::from_millis(header("x-sleep-ms").parse().unwrap_or(0))).await;
    assert!(header("x-panic").is_empty(), "the handler panics after its writes");
    (StatusCode::CREATED, format!(r#"{{"move":{id}}}"#)).into_response()
}

/// The wallet a key's request pays from.
fn wallet(key: &str) -> i64 {
    i64::from(key.bytes().map(u32::from).sum::<u32>()) % WALLETS
}

/// How a client sends its request.
#[derive(Clone, Copy)]
enum Mode {
    /// Hangs up after half the body.
    HalfBody,
    /// Sends it all, hangs up after this many ms, answered or not.
    HangUp(u64),
    /// Asks the handler to panic after its writes.
    Panic,
    /// Sends it all and reads the answer.
    Whole,
}

/// One attempt of a random kind; the answer, if it was read.
fn attempt(target: &Target, key: &str, rng: &mut Rng) -> Option<(u16, String)> {
    let mode = match rng.below(100) {
        0..15 => Mode::HalfBody,
        15..55 => Mode::HangUp(rng.below(12)),
        55..63 if target.panics => Mode::Panic,
        _ => Mode::Whole,
    };
    let answer = send(target, key, mode);
    if matches!(mode, Mode::Panic) {
        // the panic's own answer, when the key was claimed: 500, nothing kept
        let status = answer.map(|(status, _)| status);
        assert!(
            matches!(status, None | Some(500 | 201 | 409)),
            "{key}: a panicking handler answered {status:?}"
        );
        return None;
    }
    answer
}

/// Sends `key`'s request (always the same body for a key) as `mode` says,
/// the handler holding its row 0 to 5 ms; the status and body read back.
fn send(target: &Target, key: &str, mode: Mode) -> Option<(u16, String)> {
    let cents = 1 + key.bytes().map(i64::from).sum::<i64>() % 97;
    let body = (target.body)(cents, wallet(key));
    let sleep_ms = idem::rng::mix(cents as u64) % 6;
    let panic = if matches!(mode, Mode::Panic) { "x-panic: 1\r\n" } else { "" };
    let head = format!(
        "POST {} HTTP/1.1\r\nHost: x\r\n{}\r\nIdempotency-Key: \"{key}\"\r\n\
         X-Sleep-Ms: {sleep_ms}\r\n{panic}Content-Type: application/json\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n",
        target.path,
        target.auth,
        body.len()
    );
    let mut stream = TcpStream::connect(target.address).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(30))).ok()?;
    match mode {
        Mode::HalfBody => {
            let _ = stream.write_all(format!("{head}{}", &body[..body.len() / 2]).as_bytes());
            return None;
        }
        Mode::HangUp(ms) => {
            let _ = stream.write_all(format!("{head}{body}").as_bytes());
            std::thread::sleep(Duration::from_millis(ms));
            let _ = stream.shutdown(Shutdown::Both);
            return None;
        }
        Mode::Panic | Mode::Whole => stream.write_all(format!("{head}{body}").as_bytes()).ok()?,
    }
    let mut text = String::new();
    stream.read_to_string(&mut text).ok()?;
    let status = text.get(9..12)?.parse().ok()?;
    let (_, body) = text.split_once("\r\n\r\n")?;
    Some((status, body.to_owned()))
}
