//! The key table: its one shape, and the statements on it, written once.
//!
//! Every key idem keeps is a row of this shape, whoever keeps it: the
//! engine's stores (`idem_key`, beside `account` and `transfer`) and the
//! library (a table of the caller's naming, in the caller's database). The
//! statements are written here once for any table name, in PostgreSQL's
//! `$n` form; SQLite runs the same text with `?n`, which it numbers by `n`
//! too. What each must guarantee is [`super::Tx`]'s contract: the primary
//! key decides who claims, every change to an existing key is a
//! compare-and-set on the version seen.
//!
//! Beside the texts, `sqlite.rs` and `pg.rs` run them on a connection or
//! transaction the caller lends (the engine's store, the library's caller),
//! with their arguments and the reading of their rows.
//!
//! `content_type` is the stored answer's media type, which the library
//! keeps (a refusal answered as problem+json replays as one), `headers`
//! the other headers of the answer it replays (`Location` by default), a
//! JSON array of `[name, value]` pairs, and `body_bytes` the body of an
//! answer that is not UTF-8 text, as it was (`body` is then empty: a text
//! answer stays readable as text); the engine's answers are JSON with no
//! header to replay, and leave the three NULL.

use super::record::{PURGEABLE, RECORD_COLUMNS};

#[cfg(feature = "postgres")]
pub(crate) mod pg;
#[cfg(feature = "sqlite")]
pub(crate) mod sqlite;

/// What a completed key's row keeps for its replay besides the record.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Kept {
    pub content_type: Option<String>,
    /// JSON pairs
    pub headers: Option<String>,
    /// the body of an answer that is not text
    pub body_bytes: Option<Vec<u8>>,
}

/// What a claim that found its key already there meets (the primary key
/// said so): the key's committed row decides, and what it keeps besides
/// its record goes to `kept`; a row gone meanwhile (purged) is a key in
/// flight, to retry.
pub(crate) fn found(
    row: Option<(crate::store::KeyRecord, Kept)>,
    kept: &mut Kept,
) -> Result<Option<crate::store::KeyRecord>, crate::store::StoreError> {
    let (record, keeps) = row.ok_or(crate::store::StoreError::Busy)?;
    *kept = keeps;
    Ok(Some(record))
}

/// Nothing kept besides the record (the engine's answers).
pub(crate) const NOTHING_KEPT: &Kept = &Kept { content_type: None, headers: None, body_bytes: None };

/// A key as the statements bind it: client, endpoint, key.
pub(crate) type Who<'a> = [&'a str; 3];

/// The engine's scoped key, as the statements bind it.
pub(crate) fn who(key: &crate::request::ScopedKey) -> Who<'_> {
    [&key.client_id, &key.endpoint, &key.idem_key]
}

/// The claim on PostgreSQL as one statement that bounds its own lock wait:
/// inserts the claim unless the key exists, and its one row says how many
/// it inserted (`n`, 0 or 1). A racer's uncommitted claim of the same key is
/// waited on for `wait` at most (past it, `55P03`: the key in flight). The
/// subquery the insert reads its row from keeps the transaction's own lock
/// wait in `idem.lock_timeout` and puts `wait` in force (volatile, so never
/// pulled up: it runs before the insert); the target list over the count
/// puts the kept wait back once the insert has ended, whether it inserted or
/// not. A claim that waited past its bound fails whole, and its transaction
/// with it. No statement of its own sets or restores a lock wait, so the
/// team's transaction sees its own `lock_timeout` and a new key costs one
/// statement.
#[cfg(any(feature = "postgres", feature = "sqlx-postgres"))]
pub(crate) fn claim_waiting_at_most(table: &str, wait: std::time::Duration) -> String {
    let ms = wait.as_millis().clamp(1, i32::MAX as u128);
    let from = format!(
        "SELECT {CLAIM_ROW} FROM (SELECT set_config('idem.lock_timeout', current_setting('lock_timeout'), true),
                 set_config('lock_timeout', '{ms}ms', true)) AS w(kept, waits)
         WHERE w.waits IS NOT NULL"
    );
    format!(
        "WITH claimed AS ({} RETURNING 1)
         SELECT c.n, set_config('lock_timeout', current_setting('idem.lock_timeout'), true)
         FROM (SELECT count(*) AS n FROM claimed) AS c",
        insert_claim(table, &from)
    )
}

/// The claim's columns after the key, and the row a claim writes in them.
const CLAIM_COLUMNS: &str = "fingerprint, state, token, created_at, lease_until";
const CLAIM_ROW: &str = "$1, $2, $3, $4, 'in_progress', $5, $6, $7";

/// Inserts the claim `rows` (its key then [`CLAIM_COLUMNS`]) into `t`
/// unless the key exists.
fn insert_claim(t: &str, rows: &str) -> String {
    format!(
        "INSERT INTO {t} (client_id, endpoint, idem_key, {CLAIM_COLUMNS}) {rows}
         ON CONFLICT (client_id, endpoint, idem_key) DO NOTHING"
    )
}

/// The two SQL dialects the key table is written in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// SQLite: `?n` parameters.
    Sqlite,
    /// PostgreSQL: `$n` parameters.
    Postgres,
}

/// A key table's name and its statements, formatted once. Each statement's
/// parameters: the key `$1..$3`, then as its doc says.
#[derive(Debug, Clone)]
pub struct KeyTable {
    /// The table's name, as pasted into the SQL.
    pub name: String,
    /// `$4` fingerprint, `$5` token, `$6` created_at, `$7` lease_until;
    /// inserts the claim unless the key exists.
    pub insert_claim: String,
    /// The key's record (`RECORD_COLUMNS`), then `content_type`, `headers`,
    /// `body_bytes`.
    pub read: String,
    /// [`KeyTable::read`], the row locked without waiting (PostgreSQL).
    pub read_nowait: String,
    /// The claim as for `insert_claim`, only if `$8` token and `$9` state
    /// are still the version seen.
    pub replace_claim: String,
    /// `$4` status, `$5` reason, `$6` body, `$7` transfer_id, `$8`
    /// completed_at, `$10` content_type, `$11` headers, `$12` body_bytes;
    /// only if `$9` token holds it in progress.
    pub complete: String,
    /// A claim and its completion as one row, for a writer that holds the
    /// claim unwritten until it completes under the same lock (SQLite's
    /// group commit): the claim's columns as in `insert_claim` (`$4..$7`),
    /// then the completion's as in `complete`, `$8` status to `$15`
    /// body_bytes in its order.
    pub insert_completed: String,
    /// Deletes the key if `$4` token holds it in progress.
    pub release: String,
    /// Deletes up to `$2` keys created before `$1`, oldest first, never the
    /// claim of a payout (endpoint `$3`). No key parameters.
    pub purge: String,
    /// Every key in progress, its record first and then its scope, oldest
    /// first. No parameters.
    pub in_progress: String,
}

const KEY: &str = "client_id = $1 AND endpoint = $2 AND idem_key = $3";

impl KeyTable {
    /// The statements on the table `name` (a name the caller has checked:
    /// it is pasted into the SQL).
    pub fn new(name: &str, dialect: Dialect) -> KeyTable {
        let t = name;
        let table = KeyTable {
            name: name.to_owned(),
            insert_claim: insert_claim(t, &format!("VALUES ({CLAIM_ROW})")),
            read: format!("SELECT {RECORD_COLUMNS}, content_type, headers, body_bytes FROM {t} WHERE {KEY}"),
            read_nowait: format!(
                "SELECT {RECORD_COLUMNS}, content_type, headers, body_bytes FROM {t} WHERE {KEY} FOR UPDATE NOWAIT"
            ),
            replace_claim: format!(
                "UPDATE {t} SET fingerprint = $4, state = 'in_progress', token = $5,
                        created_at = $6, lease_until = $7, status = NULL, reason = NULL,
                        body = NULL, transfer_id = NULL, completed_at = NULL, content_type = NULL,
                        headers = NULL, body_bytes = NULL
                 WHERE {KEY} AND token = $8 AND state = $9"
            ),
            complete: format!(
                "UPDATE {t} SET state = 'completed', status = $4, reason = $5, body = $6,
                        transfer_id = $7, completed_at = $8, content_type = $10, headers = $11,
                        body_bytes = $12
                 WHERE {KEY} AND state = 'in_progress' AND token = $9"
            ),
            insert_completed: format!(
                "INSERT INTO {t} (client_id, endpoint, idem_key, fingerprint, state, token, created_at,
                        lease_until, status, reason, body, transfer_id, completed_at, content_type,
                        headers, body_bytes)
                 VALUES ($1, $2, $3, $4, 'completed', $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)"
            ),
            release: format!("DELETE FROM {t} WHERE {KEY} AND state = 'in_progress' AND token = $4"),
            purge: format!(
                "DELETE FROM {t} WHERE (client_id, endpoint, idem_key) IN
                   (SELECT client_id, endpoint, idem_key FROM {t}
                    WHERE created_at < $1 AND {PURGEABLE} ORDER BY created_at LIMIT $2)"
            ),
            in_progress: format!(
                "SELECT {RECORD_COLUMNS}, client_id, endpoint, idem_key FROM {t} WHERE state = 'in_progress'
                 ORDER BY created_at, client_id, endpoint, idem_key"
            ),
        };
        match dialect {
            Dialect::Postgres => table,
            Dialect::Sqlite => table.numbered_with_question_marks(),
        }
    }

    /// The same statements with `?n` for `$n` (the texts hold no other `$`).
    fn numbered_with_question_marks(self) -> KeyTable {
        let q = |s: String| s.replace('$', "?");
        KeyTable {
            name: self.name,
            insert_claim: q(self.insert_claim),
            read: q(self.read),
            read_nowait: q(self.read_nowait),
            replace_claim: q(self.replace_claim),
            complete: q(self.complete),
            insert_completed: q(self.insert_completed),
            release: q(self.release),
            purge: q(self.purge),
            in_progress: q(self.in_progress),
        }
    }

    /// Creates the table and its index on `created_at` (the purge's order)
    /// if they are not there; `index` names the index, which PostgreSQL
    /// puts in the table's schema.
    pub fn create(&self, index: &str, dialect: Dialect) -> String {
        format!(
            "{};\nCREATE INDEX IF NOT EXISTS {index} ON {} (created_at);",
            self.create_table(dialect),
            self.name
        )
    }

    /// Creates the table, without its index, if it is not there.
    pub fn create_table(&self, dialect: Dialect) -> String {
        let more = format!(
            ",\n                 headers      text,\n                 body_bytes   {}",
            bytes(dialect)
        );
        self.create_table_of(dialect, &more)
    }

    /// The same, of the shape before `headers` (`more` empty), or with the
    /// columns `more` adds after `content_type`.
    fn create_table_of(&self, dialect: Dialect, more: &str) -> String {
        // Times are RFC 3339 UTC text of fixed width; in the C collation text
        // order is time order, and the bytes are the same on both databases.
        let (time, id, rest) = match dialect {
            Dialect::Sqlite => ("TEXT", "INTEGER", " WITHOUT ROWID"),
            Dialect::Postgres => ("text COLLATE \"C\"", "bigint", ""),
        };
        format!(
            "CREATE TABLE IF NOT EXISTS {t} (
                 client_id    text NOT NULL,
                 endpoint     text NOT NULL,
                 idem_key     text NOT NULL,
                 fingerprint  text NOT NULL,
                 state        text NOT NULL CHECK (state IN ('in_progress', 'completed')),
                 token        text NOT NULL,
                 created_at   {time} NOT NULL,
                 lease_until  {time} NOT NULL,
                 status       integer,
                 reason       text,
                 body         text,
                 transfer_id  {id} UNIQUE,
                 completed_at text,
                 content_type text{more},
                 PRIMARY KEY (client_id, endpoint, idem_key),
                 -- a completed key always has its response; only a completed key has a transfer
                 CHECK ((state = 'completed') = (status IS NOT NULL AND body IS NOT NULL AND completed_at IS NOT NULL)),
                 CHECK (transfer_id IS NULL OR state = 'completed')
             ){rest}",
            t = self.name
        )
    }
}

/// A versions table (the library's `{prefix}idem_schema`): the statements
/// every store's migration runs on it, written once.
pub(crate) struct Versions<'a>(pub &'a str);

impl Versions<'_> {
    /// Creates it if it is not there.
    pub(crate) fn create(&self) -> String {
        format!("CREATE TABLE IF NOT EXISTS {} (version INTEGER NOT NULL)", self.0)
    }

    /// The version reached (0 for none).
    pub(crate) fn reached(&self) -> String {
        format!("SELECT coalesce(max(version), 0) FROM {}", self.0)
    }

    /// Records version `n` as reached.
    pub(crate) fn record(&self, n: usize) -> String {
        format!("INSERT INTO {} (version) VALUES ({n})", self.0)
    }
}

/// Serialises concurrent migrations on PostgreSQL: one advisory lock for
/// every idem table in the database (migrations are rare).
pub(crate) const MIGRATION_LOCK: &str = "SELECT pg_advisory_xact_lock(7262617)";

/// The type of a column of bytes.
pub(crate) fn bytes(dialect: Dialect) -> &'static str {
    match dialect {
        Dialect::Sqlite => "BLOB",
        Dialect::Postgres => "bytea",
    }
}

/// The versioned steps that build a caller's key table `table` (the
/// library's), in order; a database holds the first `n` of them once its
/// versions table says `n`. Version 3 is the key table's one shape: the
/// rows of versions 1 and 2, each committed with its answer, carried over
/// as completed keys, and a claim left without one (an abandoned request
/// whose transaction was committed by another) as a claim whose lease has
/// run out, which the next request takes over. Version 4 adds `headers`,
/// version 5 `body_bytes`.
pub(crate) fn migrations(table: &str, index: &str, dialect: Dialect) -> Vec<String> {
    let t = table;
    let next = KeyTable::new(&format!("{t}_v3"), dialect);
    let short = t.rsplit_once('.').map_or(t, |(_, n)| n);
    vec![
        format!(
            "CREATE TABLE {t} (
               client_id TEXT NOT NULL,
               endpoint TEXT NOT NULL,
               idem_key TEXT NOT NULL,
               fingerprint TEXT NOT NULL,
               created_at TEXT NOT NULL,
               status INTEGER,
               body TEXT,
               PRIMARY KEY (client_id, endpoint, idem_key)
             )"
        ),
        format!("ALTER TABLE {t} ADD COLUMN content_type TEXT"),
        format!(
            "{};
             INSERT INTO {n} (client_id, endpoint, idem_key, fingerprint, state, token, created_at,
                              lease_until, status, body, completed_at, content_type)
               SELECT client_id, endpoint, idem_key, fingerprint,
                      CASE WHEN status IS NULL THEN 'in_progress' ELSE 'completed' END, '',
                      created_at, created_at, status,
                      CASE WHEN status IS NULL THEN NULL ELSE coalesce(body, '') END,
                      CASE WHEN status IS NULL THEN NULL ELSE created_at END, content_type
               FROM {t};
             DROP TABLE {t};
             ALTER TABLE {n} RENAME TO {short};
             CREATE INDEX IF NOT EXISTS {index} ON {t} (created_at)",
            next.create_table_of(dialect, ""),
            n = next.name,
        ),
        format!("ALTER TABLE {t} ADD COLUMN headers TEXT"),
        format!("ALTER TABLE {t} ADD COLUMN body_bytes {}", bytes(dialect)),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlite_numbers_the_same_parameters() {
        let pg = KeyTable::new("k", Dialect::Postgres);
        let lite = KeyTable::new("k", Dialect::Sqlite);
        assert!(
            lite.complete.contains("?10") && lite.complete.contains("?9") && !lite.complete.contains('$')
        );
        assert_eq!(lite.complete.replace('?', "$"), pg.complete);
    }
}
