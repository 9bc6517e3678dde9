//! A payment gateway to pay out through: the outside service idem does not
//! own, with the faults that make paying through one hard.
//!
//! Its surface is the one real providers share: `POST /payouts` with an
//! `Idempotency-Key` (a retry with the same key and body returns the
//! payout's latest state, as PayPal's and Stripe's do; another body under
//! the key is refused), and a lookup by that key, `GET /payouts/{key}` (as
//! Toss Payments' lookup by the merchant's order id), answering `pending`,
//! `paid`, `failed` or 404. Like them it forgets a key after a window
//! (Stripe: 24 h; Toss: 15 days): a key sent again after it pays again, and
//! the ledger shows it as two rows under one key.
//!
//! The ledger is a SQLite file of its own (`payout`), so a verdict can read
//! what was really paid without asking the gateway. Every decision is
//! committed before it is answered; the faults then lose or garble the
//! answer, never the ledger:
//! - lose the request: the connection closes, nothing recorded;
//! - drop the answer: recorded, then the connection closes unanswered;
//! - answer 500 after recording;
//! - be slow: recorded `pending`, settled after `slow` (longer than a
//!   client's timeout), then answered;
//! - lookups answer 404 for a payout younger than `lookup_delay`
//!   (eventual consistency).
//!
//! Business refusals are definitive and replayed: a beneficiary whose name
//! starts with `closed-` is 402 `account_closed`; an amount over the limit
//! is 422 `amount_over_limit`.
//!
//! As real providers, it can also: return a paid payout later (`returned`,
//! as a bank sends money back), refuse a request with a 403 that no resend
//! fixes (nothing recorded), answer a refusal whose reason is poison (a
//! NUL, line breaks, 2 000 characters), and push signed events (`payout.paid`,
//! `payout.failed`, `payout.returned`) to the endpoint registered with
//! `POST /webhook_endpoints`, with their own faults: lost, duplicated, and
//! reordered (each sent after a random delay).

use crate::rng::Rng;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use rusqlite::{Connection, OptionalExtension, params};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

mod events;
mod ledger;

use events::*;
use ledger::*;
pub use ledger::{Payout, ledger, open};

/// The gateway's faults, each in percent of `POST /payouts` (first sends and
/// retries alike), drawn in arrival order from the seed.
#[derive(Debug, Clone, Copy, Default)]
pub struct Faults {
    pub lose_request: u64,
    pub drop_answer: u64,
    pub error_5xx: u64,
    pub slow: u64,
    /// Answered 403, nothing recorded.
    pub refuse_4xx: u64,
    /// Refused (402) with a poisoned reason.
    pub poison: u64,
    /// Of the payouts paid, the percent returned `return_after` later.
    pub returns: u64,
    /// Of the events, the percent never sent, and the percent sent twice.
    pub event_loss: u64,
    pub event_dup: u64,
}

#[derive(Debug, Clone)]
pub struct Options {
    /// The ledger (created if absent).
    pub db: PathBuf,
    pub seed: u64,
    pub faults: Faults,
    /// How long a slow payout stays `pending`.
    pub slow_for: Duration,
    /// Lookups answer 404 for a payout younger than this.
    pub lookup_delay: Duration,
    /// A key is forgotten this long after its payout was created.
    pub key_window: Duration,
    /// Payouts above this amount are refused (422 `amount_over_limit`).
    pub limit: i64,
    /// When set, requests must carry `Authorization: Bearer <token>`.
    pub token: Option<String>,
    /// How long after it was paid a returned payout comes back.
    pub return_after: Duration,
    /// Serve HTTPS with this certificate, as real providers do (else HTTP).
    pub tls: Option<crate::https::Identity>,
}

/// The most a request body may hold.
const MAX_BODY: usize = 16 * 1024;

struct Gateway {
    options: Options,
    ledger: Mutex<Connection>,
    rng: Mutex<Rng>,
    /// Where events go, and the secret they are signed with.
    webhook: Mutex<Option<(String, Vec<u8>)>>,
}

/// What the gateway does with one payout request, drawn from the seed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    Pass,
    LoseRequest,
    DropAnswer,
    Error5xx,
    Slow,
    Refuse4xx,
    Poison,
}

impl Gateway {
    fn fate(&self) -> Fate {
        let roll = self.rng.lock().unwrap_or_else(|e| e.into_inner()).below(100);
        let f = self.options.faults;
        let mut edge = 0;
        for (odds, fate) in [
            (f.lose_request, Fate::LoseRequest),
            (f.drop_answer, Fate::DropAnswer),
            (f.error_5xx, Fate::Error5xx),
            (f.slow, Fate::Slow),
            (f.refuse_4xx, Fate::Refuse4xx),
            (f.poison, Fate::Poison),
        ] {
            edge += odds;
            if roll < edge {
                return fate;
            }
        }
        Fate::Pass
    }

    /// Whether a draw of `percent` comes up.
    fn draw(&self, percent: u64) -> bool {
        self.rng.lock().unwrap_or_else(|e| e.into_inner()).below(100) < percent
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.ledger.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The payout `key` names now: the newest one created inside the window.
    fn current(conn: &Connection, key: &str, window: Duration) -> rusqlite::Result<Option<(Payout, String)>> {
        conn.query_row(
            &format!(
                "SELECT {COLUMNS}, fingerprint FROM payout
                 WHERE idem_key = ?1 AND created_ms > ?2 ORDER BY id DESC LIMIT 1"
            ),
            params![key, now_ms().saturating_sub(millis(window))],
            |row| Ok((payout(row)?, row.get::<_, String>(8)?)),
        )
        .optional()
    }
}

/// A request the gateway cuts instead of answering.
#[derive(Debug)]
struct Cut;

impl std::fmt::Display for Cut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("connection cut by a seeded fault")
    }
}

impl std::error::Error for Cut {}

type Reply = Response<Full<Bytes>>;

fn reply(status: StatusCode, body: &Value) -> Reply {
    let mut response = Response::new(Full::new(Bytes::from(body.to_string())));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("application/json"));
    response
}

fn error(status: StatusCode, code: &str, detail: &str) -> Reply {
    reply(status, &json!({"error": code, "detail": detail}))
}

/// The answer for a payout in `status` (also what a retry gets).
fn answer(p: &Payout) -> Reply {
    let status = match (p.status.as_str(), p.reason.as_deref()) {
        ("paid", _) => StatusCode::CREATED,
        ("pending", _) => StatusCode::CONFLICT,
        (_, Some("account_closed")) | (_, Some(POISON)) => StatusCode::PAYMENT_REQUIRED,
        _ => StatusCode::UNPROCESSABLE_ENTITY,
    };
    reply(status, &p.json())
}

/// Keys are what a URL path carries unescaped: 1–255 of `A-Za-z0-9._:~-`.
fn valid_key(key: &str) -> bool {
    (1..=255).contains(&key.len())
        && key.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'~' | b'-'))
}

/// The payout a body asks for, or why it cannot be one.
fn parse_payout(body: &[u8]) -> Result<(String, i64, String, String), String> {
    let v: Value = serde_json::from_slice(body).map_err(|e| format!("body is not JSON: {e}"))?;
    let obj = v.as_object().ok_or("body must be a JSON object")?;
    if let Some(extra) = obj.keys().find(|k| !matches!(k.as_str(), "beneficiary" | "amount" | "currency")) {
        return Err(format!("unknown member {extra:?}"));
    }
    // as long as idem takes one (its policy's field limit, in characters):
    // a payout idem accepts must not go to a person for its length alone
    let limit = crate::policy::Policy::embedded().max_field_chars;
    let beneficiary = obj
        .get("beneficiary")
        .and_then(Value::as_str)
        .filter(|b| !b.is_empty() && b.chars().count() <= limit)
        .ok_or_else(|| format!("beneficiary must be a non-empty string of at most {limit} characters"))?;
    let amount = obj
        .get("amount")
        .filter(|a| a.is_i64())
        .and_then(Value::as_i64)
        .filter(|a| *a > 0)
        .ok_or("amount must be a positive integer")?;
    let currency = obj
        .get("currency")
        .and_then(Value::as_str)
        .filter(|c| c.len() == 3 && c.bytes().all(|b| b.is_ascii_uppercase()))
        .ok_or("currency must be three capital letters")?;
    // members in one order, so a retry spelled differently is the same payout
    let normal = json!({"amount": amount, "beneficiary": beneficiary, "currency": currency}).to_string();
    let fingerprint = crate::hex::lower(&Sha256::digest(normal.as_bytes()));
    Ok((beneficiary.to_owned(), amount, currency.to_owned(), fingerprint))
}

async fn handle(gw: Arc<Gateway>, req: Request<Incoming>) -> Result<Reply, Cut> {
    if let Some(token) = &gw.options.token {
        let given = req.headers().get_all(hyper::header::AUTHORIZATION).iter().collect::<Vec<_>>();
        let expected = format!("Bearer {token}");
        if given.len() != 1 || given[0].as_bytes() != expected.as_bytes() {
            return Ok(error(StatusCode::UNAUTHORIZED, "unauthorized", "a valid bearer token is required"));
        }
    }
    let path = req.uri().path().to_owned();
    match (req.method().clone(), path.as_str()) {
        (Method::GET, "/healthz") => Ok(reply(StatusCode::OK, &json!({"status": "ok"}))),
        (Method::POST, "/payouts") => pay(gw, req).await,
        (Method::POST, "/webhook_endpoints") => Ok(register(&gw, req).await),
        (Method::GET, p) if p.starts_with("/payouts/") => Ok(lookup(&gw, &p["/payouts/".len()..])),
        _ => Ok(error(StatusCode::NOT_FOUND, "no_such_route", "no such route")),
    }
}

fn lookup(gw: &Gateway, key: &str) -> Reply {
    if !valid_key(key) {
        return error(StatusCode::BAD_REQUEST, "invalid_request", "the key must be 1-255 of A-Za-z0-9._:~-");
    }
    let found = Gateway::current(&gw.conn(), key, gw.options.key_window);
    match found {
        Ok(Some((p, _))) if now_ms() - p.created_ms >= millis(gw.options.lookup_delay) => {
            reply(StatusCode::OK, &p.json())
        }
        Ok(_) => error(StatusCode::NOT_FOUND, "not_found", "no payout under this key"),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, "internal", &e.to_string()),
    }
}

/// What follows a payout's settling: its event, and perhaps its return later.
fn settled(gw: &Arc<Gateway>, p: &Payout) {
    emit(gw, p);
    if p.status == "paid" && gw.draw(gw.options.faults.returns) {
        return_later(gw.clone(), p.id);
    }
}

/// Settles a slow payout after `slow_for`, on a task of its own: a caller
/// that stops waiting must not leave the payout pending for good (a
/// provider settles it anyway).
async fn settle_slowly(gw: &Arc<Gateway>, id: i64, refusal: Option<&'static str>) -> Result<Payout, String> {
    let later = gw.clone();
    let settling = tokio::spawn(async move {
        tokio::time::sleep(later.options.slow_for).await;
        let p = settle(&later.conn(), id, refusal).map_err(|e| e.to_string())?;
        settled(&later, &p);
        Ok(p)
    });
    settling.await.map_err(|e| e.to_string())?
}

/// A payout request's key and body: the key, and the parsed body
/// (beneficiary, amount, currency, fingerprint); or the 400 to answer.
async fn read_payout(req: Request<Incoming>) -> Result<(String, (String, i64, String, String)), Reply> {
    let key = match req.headers().get("idempotency-key").map(|v| v.to_str()) {
        Some(Ok(k)) if valid_key(k) => k.to_owned(),
        _ => {
            let why = "Idempotency-Key must be 1-255 of A-Za-z0-9._:~-";
            return Err(error(StatusCode::BAD_REQUEST, "invalid_request", why));
        }
    };
    let Ok(body) = Limited::new(req.into_body(), MAX_BODY).collect().await else {
        return Err(error(StatusCode::BAD_REQUEST, "invalid_request", "body unreadable or over 16 KiB"));
    };
    match parse_payout(&body.to_bytes()) {
        Ok(p) => Ok((key, p)),
        Err(why) => Err(error(StatusCode::BAD_REQUEST, "invalid_request", &why)),
    }
}

async fn pay(gw: Arc<Gateway>, req: Request<Incoming>) -> Result<Reply, Cut> {
    let (key, (beneficiary, amount, currency, fingerprint)) = match read_payout(req).await {
        Ok(read) => read,
        Err(refusal) => return Ok(refusal),
    };
    let fate = gw.fate();
    if fate == Fate::LoseRequest {
        return Err(Cut);
    }
    if fate == Fate::Refuse4xx {
        return Ok(error(
            StatusCode::FORBIDDEN,
            "forbidden",
            "this account may not send payouts (a seeded fault)",
        ));
    }
    let refusal = if fate == Fate::Poison {
        Some(POISON)
    } else if beneficiary.starts_with("closed-") {
        Some("account_closed")
    } else if amount > gw.options.limit {
        Some("amount_over_limit")
    } else {
        None
    };
    let recorded = {
        let mut conn = gw.conn();
        record(&mut conn, &gw.options, &key, &fingerprint, (&beneficiary, amount, &currency), refusal, fate)
    };
    let (payout, fresh) = match recorded {
        Ok(Recorded::Payout(p, fresh)) => (p, fresh),
        Ok(Recorded::OtherBody) => {
            return Ok(error(
                StatusCode::BAD_REQUEST,
                "idempotency_key_reused",
                "this key was used for another payout",
            ));
        }
        Err(e) => return Ok(error(StatusCode::INTERNAL_SERVER_ERROR, "internal", &e.to_string())),
    };
    if fresh && payout.status != "pending" {
        settled(&gw, &payout);
    }
    let payout = match fresh && fate == Fate::Slow {
        true => match settle_slowly(&gw, payout.id, refusal).await {
            Ok(p) => p,
            Err(e) => return Ok(error(StatusCode::INTERNAL_SERVER_ERROR, "internal", &e)),
        },
        false => payout,
    };
    match fate {
        Fate::DropAnswer => Err(Cut),
        Fate::Error5xx => Ok(error(StatusCode::INTERNAL_SERVER_ERROR, "internal", "seeded fault")),
        _ => Ok(answer(&payout)),
    }
}

/// A refusal's reason that broke a caller once: a NUL (PostgreSQL stores
/// none), line breaks, and far more text than anyone keeps.
const POISON: &str = "account_closed\u{0}\r\nsee https://provider.example/errors/\u{1b}[31m and 2000 more characters: xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx";

/// The longest a client may take over its TLS handshake.
const HANDSHAKE: Duration = Duration::from_secs(10);

/// Serves the gateway on `listener` until the process ends. Every decision
/// is committed before its answer, so killing it loses no payout.
pub fn serve(listener: std::net::TcpListener, options: Options) -> std::io::Result<()> {
    let ledger_at = |e| std::io::Error::other(format!("the ledger {}: {e}", options.db.display()));
    let conn = open(&options.db).map_err(ledger_at)?;
    let gw = Arc::new(Gateway {
        rng: Mutex::new(Rng::new(options.seed)),
        ledger: Mutex::new(conn),
        webhook: Mutex::new(None),
        options,
    });
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    runtime.block_on(async move {
        listener.set_nonblocking(true)?;
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let tls = gw.options.tls.as_ref().map(crate::https::Identity::acceptor);
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            };
            let (gw, tls) = (gw.clone(), tls.clone());
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req| handle(gw.clone(), req));
                let http = hyper::server::conn::http1::Builder::new();
                match tls {
                    None => {
                        let _ = http.serve_connection(hyper_util::rt::TokioIo::new(stream), service).await;
                    }
                    // a client that does not trust the certificate ends
                    // here: its handshake fails, nothing was asked
                    Some(tls) => {
                        let Ok(Ok(stream)) = tokio::time::timeout(HANDSHAKE, tls.accept(stream)).await else {
                            return;
                        };
                        let _ = http.serve_connection(hyper_util::rt::TokioIo::new(stream), service).await;
                    }
                }
            });
        }
    })
}
