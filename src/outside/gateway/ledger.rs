//! The gateway's own books: a SQLite file with one row per payout it made
//! (a key sent again after its window makes a second row), each decision
//! committed before it is answered.

use super::*;

pub(super) const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS payout (
    id          INTEGER PRIMARY KEY,
    idem_key    TEXT    NOT NULL,
    fingerprint TEXT    NOT NULL,
    beneficiary TEXT    NOT NULL,
    amount      INTEGER NOT NULL CHECK (amount > 0),
    currency    TEXT    NOT NULL,
    status      TEXT    NOT NULL CHECK (status IN ('pending', 'paid', 'failed', 'returned')),
    reason      TEXT,
    created_ms  INTEGER NOT NULL,
    settled_ms  INTEGER
);
CREATE INDEX IF NOT EXISTS payout_key ON payout (idem_key, created_ms);
";

/// One row of the ledger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Payout {
    pub id: i64,
    pub key: String,
    pub beneficiary: String,
    pub amount: i64,
    pub currency: String,
    pub status: String,
    pub reason: Option<String>,
    pub created_ms: i64,
}

impl Payout {
    pub(super) fn json(&self) -> Value {
        let mut v = json!({
            "id": format!("po_{}", self.id),
            "key": self.key,
            "status": self.status,
            "beneficiary": self.beneficiary,
            "amount": self.amount,
            "currency": self.currency,
        });
        if let Some(reason) = &self.reason {
            v["reason"] = json!(reason);
        }
        v
    }
}

/// Opens (creating if needed) a gateway ledger.
pub fn open(path: &Path) -> rusqlite::Result<Connection> {
    let conn = Connection::open(path)?;
    conn.busy_timeout(Duration::from_secs(5))?;
    conn.pragma_update(None, "journal_mode", "WAL")?;
    conn.pragma_update(None, "synchronous", "FULL")?;
    conn.execute_batch(SCHEMA)?;
    Ok(conn)
}

/// Every payout in the ledger, in the order they were made.
pub fn ledger(conn: &Connection) -> rusqlite::Result<Vec<Payout>> {
    let mut stmt = conn.prepare(&format!("SELECT {COLUMNS} FROM payout ORDER BY id"))?;
    let rows = stmt.query_map([], payout)?.collect::<Result<Vec<_>, _>>()?;
    Ok(rows)
}

pub(super) const COLUMNS: &str = "id, idem_key, beneficiary, amount, currency, status, reason, created_ms";

pub(super) fn payout(row: &rusqlite::Row) -> rusqlite::Result<Payout> {
    Ok(Payout {
        id: row.get(0)?,
        key: row.get(1)?,
        beneficiary: row.get(2)?,
        amount: row.get(3)?,
        currency: row.get(4)?,
        status: row.get(5)?,
        reason: row.get(6)?,
        created_ms: row.get(7)?,
    })
}

pub(super) use crate::clock::{millis, unix_millis as now_ms};

pub(super) enum Recorded {
    /// The key's payout, and whether this request made it.
    Payout(Payout, bool),
    OtherBody,
}

/// Finds the key's payout inside the window, or records a new one: settled
/// at once, or `pending` when it is to be slow.
pub(super) fn record(
    conn: &mut Connection,
    options: &Options,
    key: &str,
    fingerprint: &str,
    (beneficiary, amount, currency): (&str, i64, &str),
    refusal: Option<&str>,
    fate: Fate,
) -> rusqlite::Result<Recorded> {
    let tx = conn.transaction_with_behavior(rusqlite::TransactionBehavior::Immediate)?;
    if let Some((p, seen)) = Gateway::current(&tx, key, options.key_window)? {
        return Ok(if seen == fingerprint { Recorded::Payout(p, false) } else { Recorded::OtherBody });
    }
    let status = match (fate, refusal) {
        (Fate::Slow, _) => "pending",
        (_, None) => "paid",
        (_, Some(_)) => "failed",
    };
    let reason = if status == "failed" { refusal } else { None };
    let now = now_ms();
    let id = tx.query_row(
        "INSERT INTO payout (idem_key, fingerprint, beneficiary, amount, currency, status, reason, created_ms, settled_ms)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, CASE WHEN ?6 = 'pending' THEN NULL ELSE ?8 END) RETURNING id",
        params![key, fingerprint, beneficiary, amount, currency, status, reason, now],
        |row| row.get::<_, i64>(0),
    )?;
    let p = Payout {
        id,
        key: key.to_owned(),
        beneficiary: beneficiary.to_owned(),
        amount,
        currency: currency.to_owned(),
        status: status.to_owned(),
        reason: reason.map(str::to_owned),
        created_ms: now,
    };
    tx.commit()?;
    Ok(Recorded::Payout(p, true))
}

/// Settles a pending payout (paid, or failed with `refusal`).
pub(super) fn settle(conn: &Connection, id: i64, refusal: Option<&str>) -> rusqlite::Result<Payout> {
    let status = if refusal.is_some() { "failed" } else { "paid" };
    conn.query_row(
        &format!(
            "UPDATE payout SET status = ?2, reason = ?3, settled_ms = ?4
             WHERE id = ?1 AND status = 'pending' RETURNING {COLUMNS}"
        ),
        params![id, status, refusal, now_ms()],
        payout,
    )
}
