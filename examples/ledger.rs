//! A small ledger service of its own (its own tables and names), made
//! idempotent by `idem::embed::layer` with one line of setup, so that
//! `idem check --url` can judge it. `POST /v1/transfers` takes the body
//! `idem serve` takes: `{"src", "dst", "amount", "currency": "KRW"}`.
//!
//!   cargo run --release --example ledger -- --db 'host=/tmp dbname=app' \
//!       --clients clients.json --accounts A=1000000,B=0
//!
//! The first line on stdout is the URL, printed once it listens.

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

#[derive(Parser)]
struct Args {
    /// PostgreSQL connection string (libpq key=value or a URL).
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
}

const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS ledger_wallets (
                        name TEXT PRIMARY KEY, cents BIGINT NOT NULL CHECK (cents >= 0));
                      CREATE TABLE IF NOT EXISTS ledger_moves (
                        id BIGSERIAL PRIMARY KEY, src TEXT NOT NULL, dst TEXT NOT NULL,
                        cents BIGINT NOT NULL, at TIMESTAMPTZ NOT NULL DEFAULT now(),
                        client TEXT NOT NULL, answer TEXT)";

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    let args = Args::parse();
    let tokens: HashMap<String, String> = serde_json::from_slice(&std::fs::read(&args.clients)?)?;
    let tokens = std::sync::Arc::new(tokens);
    let known = tokens.clone();
    let who = move |headers: &HeaderMap| caller(&known, headers);
    let idem = Idempotency::connect(&args.db, Keys::new("ledger_")?, 16, who).await?;
    let reader = open_wallets(&args.db, &args.accounts).await?;
    let app = Router::new()
        .route("/v1/transfers", post(transfer))
        .route_layer(from_fn_with_state(idem, idempotent))
        .route("/v1/transfers/{id}", get(read_transfer))
        .with_state((std::sync::Arc::new(reader), tokens));
    let listener = tokio::net::TcpListener::bind(&args.listen).await?;
    println!("http://{}", listener.local_addr()?);
    axum::serve(listener, app).await?;
    Ok(())
}

/// The client a request's one `Authorization: Bearer` token names.
fn caller(tokens: &HashMap<String, String>, headers: &HeaderMap) -> Option<String> {
    let mut values = headers.get_all("authorization").iter();
    let (Some(value), None) = (values.next(), values.next()) else { return None };
    let token = value.to_str().ok()?.strip_prefix("Bearer ")?;
    tokens.get(token.trim()).cloned()
}

type Reader = (std::sync::Arc<tokio_postgres::Client>, std::sync::Arc<HashMap<String, String>>);

/// `GET /v1/transfers/{id}`: the transfer, to the client that made it only.
async fn read_transfer(
    State((db, tokens)): State<Reader>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let Some(client) = caller(&tokens, &headers) else {
        return problem(StatusCode::UNAUTHORIZED, "unauthorized", "Who the client is was not said.");
    };
    let id: i64 = id.parse().unwrap_or(-1);
    let row =
        db.query_opt("SELECT answer FROM ledger_moves WHERE id = $1 AND client = $2", &[&id, &client]).await;
    match row {
        Ok(Some(r)) => {
            (StatusCode::OK, [("content-type", "application/json")], r.get::<_, String>(0)).into_response()
        }
        Ok(None) => problem(StatusCode::NOT_FOUND, "not_found", "No such transfer of yours."),
        Err(_) => problem(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "The database failed."),
    }
}

async fn open_wallets(
    db: &str,
    accounts: &str,
) -> Result<tokio_postgres::Client, Box<dyn std::error::Error + Send + Sync>> {
    let (client, conn) = tokio_postgres::connect(db, tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    client.batch_execute(SCHEMA).await?;
    for pair in accounts.split(',').filter(|p| !p.is_empty()) {
        let (name, cents) = pair.split_once('=').ok_or(format!("--accounts: {pair:?} is not NAME=CENTS"))?;
        let cents: i64 = cents.parse().map_err(|_| format!("--accounts: {cents:?} is not a whole number"))?;
        client
            .execute("INSERT INTO ledger_wallets VALUES ($1, $2) ON CONFLICT DO NOTHING", &[&name, &cents])
            .await?;
    }
    Ok(client)
}

/// A wallet's name as the body gives it: a string, or a whole number.
fn wallet(v: &Value) -> Option<String> {
    match v {
        Value::String(s) if !s.is_empty() && s.len() <= 255 => Some(s.clone()),
        Value::Number(n) if n.is_i64() => Some(n.to_string()),
        _ => None,
    }
}

/// The transfer, or why the body is none (a 400: not stored, the key stays free).
fn read(body: &str) -> Result<(String, String, i64, Value), &'static str> {
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
        Some(a) if a > 0 && a < (1 << 53) => Ok((src, dst, a, v)),
        _ => Err("amount is a positive whole number"),
    }
}

async fn transfer(tx: Tx, Extension(Caller(client)): Extension<Caller>, body: String) -> Response {
    let (src, dst, cents, v) = match read(&body) {
        Ok(t) => t,
        Err(why) => return problem(StatusCode::BAD_REQUEST, "invalid_request", why),
    };
    let c = tx.client().await;
    let failed = |_| problem(StatusCode::SERVICE_UNAVAILABLE, "unavailable", "The database failed.");
    // both wallets locked in one order, so two opposite transfers cannot deadlock
    let held = match c
        .query(
            "SELECT name, cents FROM ledger_wallets WHERE name IN ($1, $2) ORDER BY name FOR UPDATE",
            &[&src, &dst],
        )
        .await
    {
        Ok(rows) => rows,
        Err(e) => return failed(e),
    };
    if held.len() != 2 {
        return business(problem(StatusCode::NOT_FOUND, "unknown_account", "No such wallet."));
    }
    let have: i64 = held.iter().find(|r| r.get::<_, String>(0) == src).map_or(0, |r| r.get(1));
    if have < cents {
        return business(problem(StatusCode::PAYMENT_REQUIRED, "insufficient_funds", "Not enough in src."));
    }
    let moved = async {
        c.execute("UPDATE ledger_wallets SET cents = cents - $2 WHERE name = $1", &[&src, &cents]).await?;
        c.execute("UPDATE ledger_wallets SET cents = cents + $2 WHERE name = $1", &[&dst, &cents]).await?;
        let row = c
            .query_one(
                "INSERT INTO ledger_moves (src, dst, cents, client) VALUES ($1, $2, $3, $4) \
                 RETURNING id, to_char(at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"')",
                &[&src, &dst, &cents, &client],
            )
            .await?;
        let (id, at): (i64, String) = (row.get(0), row.get(1));
        let out = json!({"transfer_id": id, "src": v["src"], "dst": v["dst"], "amount": cents,
                         "currency": "KRW", "created_at": at, "balance_after": have - cents})
        .to_string();
        c.execute("UPDATE ledger_moves SET answer = $2 WHERE id = $1", &[&id, &out]).await?;
        Ok::<_, tokio_postgres::Error>(out)
    };
    match moved.await {
        Ok(out) => (StatusCode::CREATED, [("content-type", "application/json")], out).into_response(),
        Err(e) => failed(e),
    }
}
