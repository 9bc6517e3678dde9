//! A small ledger service of its own (its own tables and names), made
//! idempotent by `idem::embed::layer` with one line of setup, so that
//! `idem check --url` can judge it. `POST /v1/transfers` takes the body
//! `idem serve` takes: `{"src", "dst", "amount", "currency": "KRW"}`;
//! `GET /v1/transfers/{id}` shows a transfer to the client that made it.
//!
//!   cargo run --release --example ledger -- --db ledger.db \
//!       --clients clients.json --accounts A=1000000,B=0
//!
//! `--db` is a SQLite file or a PostgreSQL connection string. With
//! `--pool sqlx` (a PostgreSQL URL), the layer runs on the service's own
//! sqlx pool instead of connections of its own. The first line on stdout
//! is the URL, printed once it listens.

use axum::extract::{Extension, Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::middleware::from_fn_with_state;
use axum::response::{IntoResponse, Response};
use axum::{Router, routing::get, routing::post};
use clap::Parser;
use idem::embed::Keys;
use idem::embed::layer::{Caller, Idempotency, Tx, business, idempotent, problem};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::sync::Arc;

#[derive(Parser)]
struct Args {
    /// A SQLite file, or a PostgreSQL connection string (libpq key=value or a URL).
    #[arg(long)]
    db: String,
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    /// A JSON file: bearer token -> client id.
    #[arg(long)]
    clients: std::path::PathBuf,
    /// Wallets to open if absent, NAME=CENTS,… (balances of wallets that
    /// exist are left as they are).
    #[arg(long, default_value = "")]
    accounts: String,
    /// Where the key's record is kept: `inside` the transfer's transaction
    /// (the layer), or `beside` it, written after its commit (the common
    /// library design; SQLite only, for the comparison).
    #[arg(long, default_value = "inside", value_parser = ["inside", "beside"])]
    keys: String,
    /// Exit (status 9) right after a transfer's writes, before answering:
    /// inside, before the commit; beside, between the commit and the key's
    /// record. For the pays-twice comparison.
    #[arg(long)]
    die_after_writes: bool,
    /// Whose connections the layer runs on: its `own`, made from `--db`, or
    /// the service's `sqlx` pool (`--db` a PostgreSQL URL).
    #[arg(long, default_value = "own", value_parser = ["own", "sqlx"])]
    pool: String,
    /// Where the handler writes a transfer: through the layer's `tx` (its
    /// writes commit with the key), or, the mistake a checker must catch,
    /// through a `pool` connection of the service's own (PostgreSQL: each
    /// statement commits apart from the key). With `IDEM_FAULT=crash-before-commit`
    /// in the environment the layer's fault point is on (`faults_from_env`).
    #[arg(long, default_value = "tx", value_parser = ["tx", "pool"])]
    writes: String,
}

/// The ledger's own tables; `{serial}` and `{now}` are each dialect's.
const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS ledger_wallets (
                        name TEXT PRIMARY KEY, cents BIGINT NOT NULL CHECK (cents >= 0));
                      CREATE TABLE IF NOT EXISTS ledger_moves (
                        id {serial}, src TEXT NOT NULL, dst TEXT NOT NULL, cents BIGINT NOT NULL,
                        client TEXT NOT NULL, answer TEXT)";

type Error = Box<dyn std::error::Error + Send + Sync>;

#[tokio::main]
async fn main() -> Result<(), Error> {
    let args = Args::parse();
    let tokens: Arc<HashMap<String, String>> =
        Arc::new(serde_json::from_slice(&std::fs::read(&args.clients)?)?);
    let known = tokens.clone();
    let who = move |h: &HeaderMap| caller(&known, h);
    // the tables first: the sqlx pool's check of them is the layer's first request
    let reader = Reader::open(&args.db, &args.accounts).await?;
    let keys = Keys::new("ledger_")?;
    let idem = match args.pool.as_str() {
        "sqlx" => {
            let pool = sqlx::postgres::PgPoolOptions::new().max_connections(16).connect(&args.db).await?;
            Idempotency::on_sqlx_postgres(pool, keys, who).await?
        }
        _ => Idempotency::connect(&args.db, keys, 16, who).await?,
    };
    let idem = idem.faults_from_env();
    let pool = match (args.writes.as_str(), idem::store::Db::parse(&args.db)) {
        ("pool", idem::store::Db::Postgres(spec)) => {
            let (client, conn) = tokio_postgres::connect(&spec, tokio_postgres::NoTls).await?;
            tokio::spawn(conn);
            Some(Arc::new(client))
        }
        ("pool", _) => return Err("--writes pool runs on PostgreSQL".into()),
        _ => None,
    };
    let app = match args.keys.as_str() {
        "beside" => Router::new().route("/v1/transfers", post(transfer_beside)),
        _ => Router::new()
            .route("/v1/transfers", post(transfer))
            .route_layer(from_fn_with_state(idem, idempotent)),
    };
    let app = app.route("/v1/transfers/{id}", get(read_transfer)).with_state(Shared {
        db: Arc::new(reader),
        tokens,
        die: args.die_after_writes,
        pool,
    });
    let listener = tokio::net::TcpListener::bind(&args.listen).await?;
    println!("http://{}", listener.local_addr()?);
    // SIGTERM (or Ctrl-C) stops taking connections and lets the requests
    // being read or run finish: a deploy's stop never drops an accepted one
    axum::serve(listener, app).with_graceful_shutdown(stopped()).await?;
    Ok(())
}

/// Resolves on SIGTERM or Ctrl-C.
async fn stopped() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => drop(term.recv().await),
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = term => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

/// The client a request's one `Authorization: Bearer` token names.
fn caller(tokens: &HashMap<String, String>, headers: &HeaderMap) -> Option<String> {
    let mut values = headers.get_all("authorization").iter();
    let (Some(value), None) = (values.next(), values.next()) else { return None };
    let token = value.to_str().ok()?.strip_prefix("Bearer ")?;
    tokens.get(token.trim()).cloned()
}

/// A connection for reads outside any key (the GET route), which also
/// made the tables and opened the wallets.
enum Reader {
    Pg(tokio_postgres::Client),
    Sqlite(tokio::sync::Mutex<rusqlite::Connection>),
}

impl Reader {
    async fn open(db: &str, accounts: &str) -> Result<Reader, Error> {
        let mut wallets = Vec::new();
        for pair in accounts.split(',').filter(|p| !p.is_empty()) {
            let (name, cents) =
                pair.split_once('=').ok_or(format!("--accounts: {pair:?} is not NAME=CENTS"))?;
            let cents: i64 =
                cents.parse().map_err(|_| format!("--accounts: {cents:?} is not a whole number"))?;
            wallets.push((name.to_owned(), cents));
        }
        let open = "INSERT INTO ledger_wallets VALUES ($1, $2) ON CONFLICT DO NOTHING";
        match idem::store::Db::parse(db) {
            idem::store::Db::Postgres(spec) => {
                let (client, conn) = tokio_postgres::connect(&spec, tokio_postgres::NoTls).await?;
                tokio::spawn(conn);
                client.batch_execute(&SCHEMA.replace("{serial}", "BIGSERIAL PRIMARY KEY")).await?;
                for (name, cents) in &wallets {
                    client.execute(open, &[name, cents]).await?;
                }
                Ok(Reader::Pg(client))
            }
            idem::store::Db::Sqlite(path) => {
                let conn = rusqlite::Connection::open(path)?;
                conn.busy_timeout(std::time::Duration::from_secs(5))?;
                conn.execute_batch(&SCHEMA.replace("{serial}", "INTEGER PRIMARY KEY AUTOINCREMENT"))?;
                for (name, cents) in &wallets {
                    conn.execute(&open.replace('$', "?"), rusqlite::params![name, cents])?;
                }
                Ok(Reader::Sqlite(tokio::sync::Mutex::new(conn)))
            }
        }
    }

    /// A move's stored answer, if `client` made it.
    async fn answer(&self, id: i64, client: &str) -> Result<Option<String>, Error> {
        let sql = "SELECT answer FROM ledger_moves WHERE id = $1 AND client = $2";
        Ok(match self {
            Reader::Pg(c) => c.query_opt(sql, &[&id, &client]).await?.map(|r| r.get(0)),
            Reader::Sqlite(c) => {
                use rusqlite::OptionalExtension;
                let c = c.lock().await;
                c.query_row(&sql.replace('$', "?"), rusqlite::params![id, client], |r| r.get(0)).optional()?
            }
        })
    }
}

#[derive(Clone)]
struct Shared {
    db: Arc<Reader>,
    tokens: Arc<HashMap<String, String>>,
    die: bool,
    /// `--writes pool`: the connection the handler writes through instead of its `Tx`
    pool: Option<Arc<tokio_postgres::Client>>,
}

async fn read_transfer(
    State(Shared { db, tokens, .. }): State<Shared>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let Some(client) = caller(&tokens, &headers) else {
        return problem(StatusCode::UNAUTHORIZED, "unauthorized", "Who the client is was not said.");
    };
    match db.answer(id.parse().unwrap_or(-1), &client).await {
        Ok(Some(body)) => (StatusCode::OK, [("content-type", "application/json")], body).into_response(),
        Ok(None) => problem(StatusCode::NOT_FOUND, "not_found", "No such transfer of yours."),
        Err(_) => problem(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "The database failed."),
    }
}

/// A wallet's name as the body gives it: a string, or a whole number.
fn wallet(v: &Value) -> Option<String> {
    match v {
        Value::String(s) if !s.is_empty() && s.len() <= 255 => Some(s.clone()),
        Value::Number(n) if n.is_i64() => Some(n.to_string()),
        _ => None,
    }
}

/// A transfer, read from the body.
struct Move {
    src: String,
    dst: String,
    cents: i64,
    client: String,
    body: Value,
}

/// The transfer, or why the body is none (a 400: not stored, the key stays free).
fn read(body: &str, client: String) -> Result<Move, &'static str> {
    let v: Value = serde_json::from_str(body).map_err(|_| "the body is not JSON")?;
    let fields = v.as_object().ok_or("the body is not an object")?;
    if fields.len() != 4 || fields.get("currency") != Some(&json!("KRW")) {
        return Err("the body holds src, dst, amount and currency KRW, and nothing else");
    }
    let (src, dst) = match (fields.get("src").and_then(wallet), fields.get("dst").and_then(wallet)) {
        (Some(s), Some(d)) if s != d => (s, d),
        _ => return Err("src and dst are two wallets"),
    };
    match fields.get("amount").and_then(Value::as_i64) {
        Some(cents) if cents > 0 && cents < (1 << 53) => Ok(Move { src, dst, cents, client, body: v }),
        _ => Err("amount is a positive whole number"),
    }
}

/// What a move came to.
enum Done {
    /// The wallets' balances before it (src's), and the new move's id.
    Moved {
        have: i64,
        id: i64,
    },
    Unknown,
    Poor,
}

/// The answer a move's outcome gets, and the text stored with the move.
fn answer_of(m: &Move, done: Done) -> (Response, Option<String>) {
    match done {
        Done::Unknown => {
            (business(problem(StatusCode::NOT_FOUND, "unknown_account", "No such wallet.")), None)
        }
        Done::Poor => {
            let r = problem(StatusCode::PAYMENT_REQUIRED, "insufficient_funds", "Not enough in src.");
            (business(r), None)
        }
        Done::Moved { have, id } => {
            let out =
                json!({"transfer_id": id, "src": m.body["src"], "dst": m.body["dst"], "amount": m.cents,
                             "currency": "KRW", "balance_after": have - m.cents})
                .to_string();
            let r =
                (StatusCode::CREATED, [("content-type", "application/json")], out.clone()).into_response();
            (r, Some(out))
        }
    }
}

async fn transfer(
    State(app): State<Shared>,
    tx: Tx,
    Extension(Caller(client)): Extension<Caller>,
    body: String,
) -> Response {
    let m = match read(&body, client) {
        Ok(m) => m,
        Err(why) => return problem(StatusCode::BAD_REQUEST, "invalid_request", why),
    };
    let done = if let Some(c) = &app.pool {
        // the mistake: autocommitted apart from the key the layer completes
        move_pg(c, &m).await.map_err(|e| e.to_string())
    } else if let Some(c) = tx.client().await {
        move_pg(&c, &m).await.map_err(|e| e.to_string())
    } else if let Some(c) = tx.sqlite().await {
        move_sqlite(&c, &m).map_err(|e| e.to_string())
    } else if let Some(mut c) = tx.sqlx_postgres().await {
        move_sqlx(&mut c, &m).await.map_err(|e| e.to_string())
    } else {
        Err("no transaction".to_owned())
    };
    if app.die {
        // the layer has not committed: the writes go with the process
        std::process::exit(9);
    }
    match done {
        Ok(done) => answer_of(&m, done).0,
        Err(_) => problem(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "The database failed."),
    }
}

/// The common library design, for comparison: the key looked up first,
/// the transfer committed in its own transaction, and the key's record
/// written after it.
async fn transfer_beside(State(app): State<Shared>, headers: HeaderMap, body: String) -> Response {
    let Some(client) = caller(&app.tokens, &headers) else {
        return problem(StatusCode::UNAUTHORIZED, "unauthorized", "Who the client is was not said.");
    };
    let key = match idem::request::idempotency_key(
        headers.get_all("idempotency-key").iter().map(|v| v.as_bytes()),
        255,
    ) {
        Ok(key) => key,
        Err((reason, detail)) => return problem(StatusCode::BAD_REQUEST, reason, &detail),
    };
    let Reader::Sqlite(db) = &*app.db else {
        return problem(StatusCode::NOT_IMPLEMENTED, "sqlite_only", "--keys beside runs on SQLite.");
    };
    let c = db.lock().await;
    match beside(&c, &client, &key, &body, app.die) {
        Ok((status, answer)) => (status, [("content-type", "application/json")], answer).into_response(),
        Err(_) => problem(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "The database failed."),
    }
}

fn beside(
    c: &rusqlite::Connection,
    client: &str,
    key: &str,
    body: &str,
    die: bool,
) -> rusqlite::Result<(StatusCode, String)> {
    use rusqlite::{OptionalExtension, params};
    c.execute_batch("CREATE TABLE IF NOT EXISTS beside_keys (client TEXT, key TEXT, status INTEGER, answer TEXT, PRIMARY KEY (client, key))")?;
    let seen: Option<(u16, String)> = c
        .query_row(
            "SELECT status, answer FROM beside_keys WHERE client = ?1 AND key = ?2",
            params![client, key],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .optional()?;
    if let Some((status, answer)) = seen {
        return Ok((StatusCode::from_u16(status).unwrap_or(StatusCode::OK), answer));
    }
    let Ok(m) = read(body, client.to_owned()) else {
        return Ok((StatusCode::BAD_REQUEST, r#"{"reason":"invalid_request"}"#.into()));
    };
    c.execute_batch("BEGIN IMMEDIATE")?;
    let done = move_sqlite(c, &m);
    c.execute_batch(if done.is_ok() { "COMMIT" } else { "ROLLBACK" })?;
    if die {
        // committed, and the key's record not yet written
        std::process::exit(9);
    }
    let (response, stored) = answer_of(&m, done?);
    let (status, answer) = (response.status(), stored.unwrap_or_default());
    c.execute(
        "INSERT INTO beside_keys VALUES (?1, ?2, ?3, ?4)",
        params![client, key, status.as_u16(), answer],
    )?;
    Ok((status, answer))
}

async fn move_pg(c: &tokio_postgres::Client, m: &Move) -> Result<Done, tokio_postgres::Error> {
    // both wallets locked in one order, so two opposite transfers cannot deadlock
    let held = c
        .query(
            "SELECT name, cents FROM ledger_wallets WHERE name IN ($1, $2) ORDER BY name FOR UPDATE",
            &[&m.src, &m.dst],
        )
        .await?;
    if held.len() != 2 {
        return Ok(Done::Unknown);
    }
    let have: i64 = held.iter().find(|r| r.get::<_, String>(0) == m.src).map_or(0, |r| r.get(1));
    if have < m.cents {
        return Ok(Done::Poor);
    }
    c.execute("UPDATE ledger_wallets SET cents = cents - $2 WHERE name = $1", &[&m.src, &m.cents]).await?;
    c.execute("UPDATE ledger_wallets SET cents = cents + $2 WHERE name = $1", &[&m.dst, &m.cents]).await?;
    let id: i64 = c
        .query_one(
            "INSERT INTO ledger_moves (src, dst, cents, client) VALUES ($1, $2, $3, $4) RETURNING id",
            &[&m.src, &m.dst, &m.cents, &m.client],
        )
        .await?
        .get(0);
    let done = Done::Moved { have, id };
    let stored = answer_of(m, Done::Moved { have, id }).1;
    c.execute("UPDATE ledger_moves SET answer = $2 WHERE id = $1", &[&id, &stored]).await?;
    Ok(done)
}

/// [`move_pg`] on the service's sqlx pool.
async fn move_sqlx(c: &mut sqlx::PgConnection, m: &Move) -> Result<Done, sqlx::Error> {
    let held: Vec<(String, i64)> = sqlx::query_as(
        "SELECT name, cents FROM ledger_wallets WHERE name IN ($1, $2) ORDER BY name FOR UPDATE",
    )
    .bind(&m.src)
    .bind(&m.dst)
    .fetch_all(&mut *c)
    .await?;
    if held.len() != 2 {
        return Ok(Done::Unknown);
    }
    let have = held.iter().find(|(name, _)| *name == m.src).map_or(0, |(_, cents)| *cents);
    if have < m.cents {
        return Ok(Done::Poor);
    }
    for (sql, name) in [
        ("UPDATE ledger_wallets SET cents = cents - $2 WHERE name = $1", &m.src),
        ("UPDATE ledger_wallets SET cents = cents + $2 WHERE name = $1", &m.dst),
    ] {
        sqlx::query(sql).bind(name).bind(m.cents).execute(&mut *c).await?;
    }
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO ledger_moves (src, dst, cents, client) VALUES ($1, $2, $3, $4) RETURNING id",
    )
    .bind(&m.src)
    .bind(&m.dst)
    .bind(m.cents)
    .bind(&m.client)
    .fetch_one(&mut *c)
    .await?;
    let stored = answer_of(m, Done::Moved { have, id }).1;
    sqlx::query("UPDATE ledger_moves SET answer = $2 WHERE id = $1")
        .bind(id)
        .bind(stored)
        .execute(&mut *c)
        .await?;
    Ok(Done::Moved { have, id })
}

fn move_sqlite(c: &rusqlite::Connection, m: &Move) -> rusqlite::Result<Done> {
    use rusqlite::{OptionalExtension, params};
    // the layer's BEGIN IMMEDIATE holds SQLite's write lock already
    let balance = |name: &str| {
        c.query_row("SELECT cents FROM ledger_wallets WHERE name = ?1", [name], |r| r.get::<_, i64>(0))
            .optional()
    };
    let (Some(have), Some(_)) = (balance(&m.src)?, balance(&m.dst)?) else { return Ok(Done::Unknown) };
    if have < m.cents {
        return Ok(Done::Poor);
    }
    c.execute("UPDATE ledger_wallets SET cents = cents - ?2 WHERE name = ?1", params![m.src, m.cents])?;
    c.execute("UPDATE ledger_wallets SET cents = cents + ?2 WHERE name = ?1", params![m.dst, m.cents])?;
    c.execute(
        "INSERT INTO ledger_moves (src, dst, cents, client) VALUES (?1, ?2, ?3, ?4)",
        params![m.src, m.dst, m.cents, m.client],
    )?;
    let id = c.last_insert_rowid();
    let stored = answer_of(m, Done::Moved { have, id }).1;
    c.execute("UPDATE ledger_moves SET answer = ?2 WHERE id = ?1", params![id, stored])?;
    Ok(Done::Moved { have, id })
}
