//! `idem gen`: one day of transfer requests as the gateway logged them.
//!
//! 100 distinct scoped keys arrive 120 times. The 20 extra arrivals are what
//! real clients do: identical retries after a timeout, retries whose JSON was
//! re-serialised (members reordered, white space changed), a client bug that
//! retried with a different amount, a pair that arrived in the same instant,
//! and one key string that two different clients happened to choose. The
//! naive system (`transfer_v1`) made one transfer per arrival.

use super::HarnessError;
use crate::clock::Timestamp;
use crate::rng::Rng;
use rusqlite::{Connection, params};

pub const ACCOUNTS: usize = 8;
pub const UNIQUE_KEYS: usize = 100;
pub const ENDPOINT: &str = "/v1/transfers";
const CLIENTS: [&str; 4] = ["shop-seoul", "shop-busan", "payroll", "mobile-app"];
const HOLDERS: [&str; ACCOUNTS] = ["Kim", "Lee", "Park", "Choi", "Jung", "Kang", "Cho", "Yoon"];
const OPENING_BALANCE: i64 = 50_000_000;
const DAY_START: &str = "2026-11-30T00:00:00Z";

/// How a logged arrival relates to the first arrival of its key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    First,
    Retry,
    Reordered,
    Respaced,
    AmountChanged,
    SameInstant,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::First => "first",
            Kind::Retry => "retry",
            Kind::Reordered => "retry_reordered",
            Kind::Respaced => "retry_respaced",
            Kind::AmountChanged => "retry_amount_changed",
            Kind::SameInstant => "retry_same_instant",
        }
    }
}

/// 19 of the 20 extra arrivals, in the order they are assigned to keys;
/// the 20th sends key 0 a third time.
const EXTRA: [(Kind, usize); 5] = [
    (Kind::Retry, 11),
    (Kind::Reordered, 3),
    (Kind::Respaced, 3),
    (Kind::AmountChanged, 1),
    (Kind::SameInstant, 1),
];

struct Arrival {
    at_ms: i64,
    client: &'static str,
    key: String,
    src: usize,
    dst: usize,
    amount: i64,
    kind: Kind,
}

/// The account id of account number `i` (0-based).
pub fn acct_id(i: usize) -> String {
    format!("ACC-{:03}", i + 1)
}

fn uuid(rng: &mut Rng) -> String {
    let (a, b) = (rng.next_u64(), rng.next_u64());
    format!(
        "{:08x}-{:04x}-4{:03x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xfff,
        0x8000 | (b >> 48) & 0x3fff,
        b & 0xffff_ffff_ffff
    )
}

/// The raw request text a client sent: compact, reordered or pretty-printed.
fn raw(a: &Arrival, style: Kind) -> String {
    let (src, dst) = (acct_id(a.src), acct_id(a.dst));
    let (client, key, amount) = (a.client, &a.key, a.amount);
    match style {
        Kind::Reordered => format!(
            r#"{{"idem_key":"{key}","body":{{"currency":"KRW","amount":{amount},"dst":"{dst}","src":"{src}"}},"endpoint":"{ENDPOINT}","client_id":"{client}"}}"#
        ),
        Kind::Respaced => format!(
            "{{\n  \"client_id\": \"{client}\",\n  \"endpoint\": \"{ENDPOINT}\",\n  \"idem_key\": \"{key}\",\n  \"body\": {{\n    \"src\": \"{src}\",\n    \"dst\": \"{dst}\",\n    \"amount\": {amount},\n    \"currency\": \"KRW\"\n  }}\n}}"
        ),
        _ => format!(
            r#"{{"client_id":"{client}","endpoint":"{ENDPOINT}","idem_key":"{key}","body":{{"src":"{src}","dst":"{dst}","amount":{amount},"currency":"KRW"}}}}"#
        ),
    }
}

fn arrivals(rng: &mut Rng) -> Vec<Arrival> {
    let mut firsts: Vec<Arrival> = (0..UNIQUE_KEYS)
        .map(|_| {
            let src = rng.below(ACCOUNTS as u64) as usize;
            let dst = (src + 1 + rng.below(ACCOUNTS as u64 - 1) as usize) % ACCOUNTS;
            Arrival {
                // business hours, 09:00 to 18:00 UTC
                at_ms: 9 * 3_600_000 + rng.below(9 * 3_600_000) as i64,
                client: CLIENTS[rng.below(CLIENTS.len() as u64) as usize],
                key: uuid(rng),
                src,
                dst,
                amount: (1 + rng.below(5_000) as i64) * 100,
                kind: Kind::First,
            }
        })
        .collect();
    firsts.sort_by_key(|a| a.at_ms);
    // Two clients that happened to pick the same key string: a distinct key
    // under the scope, a collision under a global one.
    let shared = firsts[10].key.clone();
    firsts[60].key = shared;
    firsts[60].client = if firsts[10].client == CLIENTS[0] { CLIENTS[1] } else { CLIENTS[0] };

    let mut extra = Vec::new();
    let mut target = 0;
    for (kind, count) in EXTRA {
        for _ in 0..count {
            // every 5th key gets a retry; key 10 (the shared string) is among them
            let first = &firsts[target * 5];
            let delay_ms = match kind {
                Kind::SameInstant => 0,
                _ => 1_000 + rng.below(59_000) as i64,
            };
            let amount = match kind {
                Kind::AmountChanged => first.amount + 1_000,
                _ => first.amount,
            };
            extra.push(Arrival {
                at_ms: first.at_ms + delay_ms,
                key: first.key.clone(),
                amount,
                kind,
                ..*first
            });
            target += 1;
        }
    }
    // A key sent three times: a second identical retry of key 0.
    let first = &firsts[0];
    extra.push(Arrival { at_ms: first.at_ms + 120_000, key: first.key.clone(), kind: Kind::Retry, ..*first });
    let mut all: Vec<Arrival> = firsts.into_iter().chain(extra).collect();
    // stable: a same-instant retry stays after its original
    all.sort_by_key(|a| a.at_ms);
    all
}

/// Logs one arrival: `(seq, received_at, client_id, endpoint, idem_key,
/// kind, raw)`; the transfer's fields are parsed out of `raw` by SQLite,
/// NULL where it does not parse.
pub const LOG_REQUEST: &str = "INSERT INTO req_log VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7,
     CASE WHEN json_valid(?7) THEN json_extract(?7, '$.body.src') END,
     CASE WHEN json_valid(?7) THEN json_extract(?7, '$.body.dst') END,
     CASE WHEN json_valid(?7) AND json_type(?7, '$.body.amount') = 'integer'
          THEN json_extract(?7, '$.body.amount') END,
     CASE WHEN json_valid(?7) THEN json_extract(?7, '$.body.currency') END)";

/// Creates `idem.db` at `conn` (an empty database).
pub fn generate(conn: &mut Connection) -> Result<(), HarnessError> {
    let tx = conn.transaction()?;
    tx.execute_batch(crate::store::bank::ACCOUNT)?;
    tx.execute_batch(
        "-- raw is what the gateway received; src..currency are parsed from it
         -- (NULL where it does not parse) so the log can be analysed in SQL
         CREATE TABLE req_log (
             seq INTEGER PRIMARY KEY, received_at TEXT NOT NULL,
             client_id TEXT NOT NULL, endpoint TEXT NOT NULL, idem_key TEXT NOT NULL,
             kind TEXT NOT NULL, raw TEXT NOT NULL,
             src, dst, amount INTEGER, currency TEXT);
         CREATE TABLE transfer_v1 (
             transfer_id INTEGER PRIMARY KEY, seq INTEGER NOT NULL REFERENCES req_log(seq),
             client_id TEXT NOT NULL, endpoint TEXT NOT NULL, idem_key TEXT NOT NULL,
             src TEXT NOT NULL, dst TEXT NOT NULL, amount INTEGER NOT NULL,
             currency TEXT NOT NULL, created_at TEXT NOT NULL);",
    )?;
    for (i, holder) in HOLDERS.iter().enumerate() {
        tx.execute("INSERT INTO account VALUES (?1, ?2, ?3)", params![acct_id(i), holder, OPENING_BALANCE])?;
    }
    let start = Timestamp::parse(DAY_START).map_err(|e| HarnessError::Stopped(e.to_string()))?;
    let mut rng = Rng::new(0x1de3_2026_1130);
    for (i, a) in arrivals(&mut rng).iter().enumerate() {
        let seq = i as i64 + 1;
        let at = start.plus_millis(a.at_ms).to_string();
        tx.execute(
            LOG_REQUEST,
            params![seq, at, a.client, ENDPOINT, a.key, a.kind.as_str(), raw(a, a.kind)],
        )?;
        // The naive system: every arrival is a new transfer.
        tx.execute(
            "INSERT INTO transfer_v1 (seq, client_id, endpoint, idem_key, src, dst, amount, currency, created_at)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, 'KRW', ?8)",
            params![seq, a.client, ENDPOINT, a.key, acct_id(a.src), acct_id(a.dst), a.amount, at],
        )?;
    }
    tx.commit()?;
    Ok(())
}
