//! A minimal transfer endpoint behind axum-idempotent (crates.io), for
//! `idem check --url` only: the same surface as `idem serve` (--db, --listen,
//! --clients; the first line printed is the URL), an in-memory ledger with
//! accounts A and B, and the layer set up as its README says (direct key
//! mode, the key required, a moka session store, the session layer outside
//! it). The library keys its cache by session; a session is found by cookie,
//! so each token is given a session of its own (a cookie made from the
//! token) before the layer looks: that is the key's scope by client.
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum_idempotent::{IdempotentLayer, IdempotentOptions};
use ruts::store::moka::MokaStore;
use ruts::{CookieOptions, SessionLayer};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tower_cookies::CookieManagerLayer;

const COOKIE: &str = "session";

struct Ledger {
    balances: HashMap<String, i64>,
    next_id: i64,
}

type Shared = Arc<Mutex<Ledger>>;

fn args() -> Result<(String, HashMap<String, String>), String> {
    let mut listen = "127.0.0.1:0".to_string();
    let mut clients = None;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--listen" => listen = value,
            "--clients" => clients = Some(value),
            "--db" => {} // the ledger is in memory
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    let path = clients.ok_or("--clients is required")?;
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{path}: {e}"))?;
    let clients = serde_json::from_str(&text).map_err(|e| format!("{path}: {e}"))?;
    Ok((listen, clients))
}

/// The caller's token when exactly one `Authorization: Bearer` names a client.
fn token(headers: &HeaderMap, clients: &HashMap<String, String>) -> Option<String> {
    let mut all = headers.get_all(header::AUTHORIZATION).iter();
    let (Some(one), None) = (all.next(), all.next()) else { return None };
    let token = one.to_str().ok()?.strip_prefix("Bearer ")?;
    clients.contains_key(token).then(|| token.to_string())
}

fn refuse(status: StatusCode, reason: &str) -> Response {
    (status, axum::Json(json!({ "reason": reason }))).into_response()
}

/// Outside the session layer: a known token's requests carry its client's
/// session cookie (the client's id hashed to ruts's 16-byte session id), any
/// other is refused before it reaches the cache. The layer caches only for a
/// request whose session has an id, which the cookie gives.
async fn authenticate(
    State(clients): State<Arc<HashMap<String, String>>>,
    mut req: Request,
    next: Next,
) -> Response {
    let Some(token) = token(req.headers(), &clients) else {
        return refuse(StatusCode::UNAUTHORIZED, "unauthorized");
    };
    let digest = Sha256::digest(clients[&token].as_bytes());
    // ruts reads a session id as 22 characters of url-safe base64
    let id = base64_url(&digest[..16]);
    req.headers_mut().remove(header::COOKIE);
    let cookie = HeaderValue::from_str(&format!("{COOKIE}={id}")).expect("ascii");
    req.headers_mut().insert(header::COOKIE, cookie);
    next.run(req).await
}

fn base64_url(bytes: &[u8]) -> String {
    const ABC: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk.iter().fold(0u32, |n, &b| n << 8 | b as u32) << (8 * (3 - chunk.len()));
        for i in 0..=chunk.len() {
            out.push(ABC[(n >> (18 - 6 * i) & 63) as usize] as char);
        }
    }
    out
}

async fn transfer(State(ledger): State<Shared>, body: axum::body::Bytes) -> Response {
    let Ok(t) = serde_json::from_slice::<Value>(&body) else {
        return refuse(StatusCode::BAD_REQUEST, "invalid_request");
    };
    let (src, dst) = (t["src"].as_str().unwrap_or(""), t["dst"].as_str().unwrap_or(""));
    let mut l = ledger.lock().unwrap();
    if !l.balances.contains_key(src) || !l.balances.contains_key(dst) {
        return refuse(StatusCode::NOT_FOUND, "unknown_account");
    }
    let amount = t["amount"].as_i64().filter(|a| *a >= 1 && t["amount"].is_i64());
    let (Some(amount), true) = (amount, src != dst && t["currency"] == "KRW") else {
        return refuse(StatusCode::BAD_REQUEST, "invalid_request");
    };
    *l.balances.get_mut(src).unwrap() -= amount;
    *l.balances.get_mut(dst).unwrap() += amount;
    let id = l.next_id;
    l.next_id += 1;
    let made = json!({"transfer_id": id, "src": src, "dst": dst, "amount": amount, "currency": "KRW"});
    (StatusCode::CREATED, axum::Json(made)).into_response()
}

#[tokio::main]
async fn main() {
    let (listen, clients) = args().unwrap_or_else(|e| {
        eprintln!("axum-idempotent-peer: {e}");
        std::process::exit(2)
    });
    let ledger = Arc::new(Mutex::new(Ledger {
        balances: HashMap::from([("A".into(), 1_000_000_000_000), ("B".into(), 0)]),
        next_id: 1,
    }));
    let options = IdempotentOptions::default()
        .use_idempotency_key_header(Some("Idempotency-Key"), true)
        .expire_after(24 * 60 * 60);
    let store = Arc::new(MokaStore::builder().build());
    let app = Router::new()
        .route("/v1/transfers", post(transfer))
        .with_state(ledger)
        .layer(IdempotentLayer::<MokaStore>::new(options))
        .layer(SessionLayer::new(store).with_cookie_options(CookieOptions::build().name(COOKIE)))
        .layer(CookieManagerLayer::new())
        .layer(middleware::from_fn_with_state(Arc::new(clients), authenticate));
    let listener = tokio::net::TcpListener::bind(&listen).await.unwrap_or_else(|e| {
        eprintln!("axum-idempotent-peer: {listen}: {e}");
        std::process::exit(2)
    });
    println!("http://{}", listener.local_addr().unwrap());
    axum::serve(listener, app).await.unwrap();
}
