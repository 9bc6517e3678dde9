//! idem as a library: an idempotency key claimed, used and completed inside
//! the caller's own database transaction.
//!
//! Libraries that keep the key's record beside the handler's work (a cache,
//! a table written after the handler commits) pay twice when the process
//! dies between the handler's commit and the record's write: the retry finds
//! no record and runs the side effect again. Here the key's claim, the
//! caller's own writes and the stored answer commit in **one** transaction,
//! so either all three happened or none did.
//!
//! ```
//! use idem::embed::{Answer, Keys, Reply, Scope};
//! use idem::embed::sqlite::{Connection, Transaction};
//!
//! let mut db = Connection::open_in_memory()?;
//! db.execute_batch("CREATE TABLE orders (id INTEGER PRIMARY KEY, item TEXT)")?;
//! let keys = Keys::new("app_")?;
//! keys.migrate_sqlite(&db)?;
//!
//! let scope = Scope::new("client-7", "POST /orders");
//! let body = r#"{"item": "tea"}"#;
//! let order = |tx: &Transaction<'_>| -> Result<Answer, idem::embed::sqlite::DbError> {
//!     tx.execute("INSERT INTO orders (item) VALUES ('tea')", [])?;
//!     Ok(Answer::new(201, format!(r#"{{"order":{}}}"#, tx.last_insert_rowid())))
//! };
//! let first = keys.run_sqlite(&mut db, &scope, "k-1", body, order)?;
//! let again = keys.run_sqlite(&mut db, &scope, "k-1", r#"{ "item":"tea" }"#, order)?;
//! assert_eq!(first, Reply::Fresh(Answer::new(201, r#"{"order":1}"#)));
//! assert_eq!(again, Reply::Replayed(Answer::new(201, r#"{"order":1}"#)));
//! let orders: i64 = db.query_row("SELECT count(*) FROM orders", [], |r| r.get(0))?;
//! assert_eq!(orders, 1);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! What a retry meets is decided by [`crate::protocol::decide`], the same
//! function the service and `idem_api` use: the stored answer replayed byte
//! for byte, another body refused, a key past retention new again. The
//! fingerprint is the service's: SHA-256 of the body's RFC 8785 canonical
//! JSON, so reordered members and re-spaced text are the same request.
#![warn(missing_docs)]

use crate::canonical::{Json, fingerprint};
use crate::clock::Timestamp;
use crate::policy::Policy;
use crate::protocol::{Ctx, Decision, fresh_token};
use crate::request::ScopedKey;
#[cfg(any(
    feature = "sqlite",
    feature = "postgres",
    feature = "sqlx-postgres",
    feature = "sqlx-sqlite"
))]
use crate::store::KeyTable;
use crate::store::keys::Kept;
use crate::store::{Dialect, StoreError};
use std::fmt;

#[cfg(all(
    feature = "axum",
    any(feature = "postgres", feature = "sqlite", feature = "sqlx-postgres", feature = "sqlx-sqlite")
))]
pub mod layer;
#[cfg(feature = "postgres")]
pub mod pg;
#[cfg(feature = "sqlite")]
pub mod sqlite;
#[cfg(any(feature = "sqlx-postgres", feature = "sqlx-sqlite"))]
mod sqlx;

/// How long a request waits, by default, for another transaction that
/// holds its key before it is answered as in flight (on PostgreSQL; on
/// SQLite the writer is one at a time, and nothing waits).
pub const IN_FLIGHT_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

/// The purge spares the claims in progress of one endpoint (the engine's
/// payouts, whose gateway may have paid); the library has none to spare.
const NO_ENDPOINT: &str = "";

/// Whose key it is: the client, and the operation the key is for. Two
/// scopes never share a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scope {
    /// Who sent the request, as the caller authenticated it (never a value
    /// the request body can choose).
    pub client: String,
    /// The operation, such as `POST /v1/transfers`.
    pub endpoint: String,
}

impl Scope {
    /// A scope of `client` and `endpoint`.
    pub fn new(client: impl Into<String>, endpoint: impl Into<String>) -> Scope {
        Scope { client: client.into(), endpoint: endpoint.into() }
    }

    /// `key` in this scope, as the engine scopes its keys.
    fn key(&self, key: &str) -> ScopedKey {
        ScopedKey {
            client_id: self.client.clone(),
            endpoint: self.endpoint.clone(),
            idem_key: key.to_owned(),
        }
    }
}

/// The answer the caller's work gave: stored with the key, and what every
/// retry of the same request gets back, byte for byte.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// The HTTP status (a business refusal, a 4xx, is an answer too).
    pub status: u16,
    /// The body, as the first request was answered: any bytes (a body that
    /// is UTF-8 text is kept as text, readable in the key table).
    pub body: Vec<u8>,
    /// The body's media type, when the work said one: a replay carries it
    /// as the first answer did (a stored refusal stays problem+json).
    pub content_type: Option<String>,
    /// Other headers a replay carries as the first answer did, in order
    /// (`Location`, say): name and value.
    pub headers: Vec<(String, String)>,
}

impl Answer {
    /// An answer of `status` with `body` (text, or any bytes).
    ///
    /// ```
    /// use idem::embed::Answer;
    /// assert_eq!(Answer::new(201, r#"{"order":7}"#).text(), Some(r#"{"order":7}"#));
    /// assert_eq!(Answer::new(200, vec![0xff, 0xfe]).text(), None);
    /// ```
    pub fn new(status: u16, body: impl Into<Vec<u8>>) -> Answer {
        Answer { status, body: body.into(), content_type: None, headers: Vec::new() }
    }

    /// The body, if it is UTF-8 text.
    pub fn text(&self) -> Option<&str> {
        std::str::from_utf8(&self.body).ok()
    }

    /// The answer as the key table stores it, and what its row keeps
    /// besides: the media type, the other headers (JSON), and the body
    /// itself when it is not text (`body` is then empty).
    fn stored(&self) -> (crate::store::Stored, Kept) {
        let (body, body_bytes) = match self.text() {
            Some(text) => (text.to_owned(), None),
            None => (String::new(), Some(self.body.clone())),
        };
        let stored = crate::store::Stored { status: self.status, reason: None, body, transfer_id: None };
        let headers = (!self.headers.is_empty()).then(|| serde_json::json!(self.headers).to_string());
        (stored, Kept { content_type: self.content_type.clone(), headers, body_bytes })
    }

    /// The same answer, with one more header for its replays to carry.
    ///
    /// ```
    /// use idem::embed::Answer;
    /// let made = Answer::new(201, r#"{"order":7}"#).header("Location", "/orders/7");
    /// assert_eq!(made.headers, [("Location".to_owned(), "/orders/7".to_owned())]);
    /// ```
    pub fn header(mut self, name: impl Into<String>, value: impl Into<String>) -> Answer {
        self.headers.push((name.into(), value.into()));
        self
    }

    /// The same answer, with the body's media type.
    pub fn content_type(mut self, media_type: impl Into<String>) -> Answer {
        self.content_type = Some(media_type.into());
        self
    }
}

/// What a request under a key got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// The work ran now, and its answer committed with the key.
    Fresh(Answer),
    /// The key's stored answer: the work had run before.
    Replayed(Answer),
    /// The key's first request is still running (409 in the draft).
    InFlight,
    /// The key was used for another request body (422 in the draft).
    Mismatch,
}

/// Why a request under a key got no [`Reply`]. Nothing was committed.
#[derive(Debug)]
pub enum Error<E> {
    /// The caller's work failed: its writes and the key's claim rolled back,
    /// and the key is free for a retry.
    Work(E),
    /// The request body is not JSON (it cannot be fingerprinted), or was
    /// declared JSON and is not.
    Body(String),
    /// The key is empty or longer than 255 characters.
    Key,
    /// The database failed.
    Db(Box<dyn std::error::Error + Send + Sync>),
}

impl<E: fmt::Display> fmt::Display for Error<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Work(e) => write!(f, "the work failed and was rolled back: {e}"),
            Error::Body(e) => write!(f, "the request body is not JSON: {e}"),
            Error::Key => write!(f, "an idempotency key is 1 to 255 characters"),
            Error::Db(e) => write!(f, "the database failed: {e}"),
        }
    }
}

impl<E: fmt::Debug + fmt::Display> std::error::Error for Error<E> {}

/// The request's transaction was let go of (committed, rolled back or
/// lost): nothing is left to run a key's step in.
fn gone() -> StoreError {
    StoreError::Backend("the request's transaction was lost".into())
}

/// Why a run under a key stopped short of an answer: the store (a key
/// in flight is [`StoreError::Busy`]), or the caller's work.
enum Stop<E> {
    Store(StoreError),
    Work(E),
}

impl<E> From<StoreError> for Stop<E> {
    fn from(e: StoreError) -> Stop<E> {
        Stop::Store(e)
    }
}

/// The key table's place in the caller's database, and how long a key is
/// kept. One value serves every request; it holds no connection.
///
/// The table has the shape of the key table `idem serve` and `idem_api`
/// keep (`store::keys`), and is read and written by the same statements.
#[derive(Debug, Clone)]
pub struct Keys {
    /// `{prefix}idem_keys`
    table: String,
    /// the index on `created_at`, named in the table's schema
    index: String,
    versions: String,
    policy: Policy,
    #[cfg(any(feature = "sqlite", feature = "sqlx-sqlite"))]
    sqlite: KeyTable,
    #[cfg(any(feature = "postgres", feature = "sqlx-postgres"))]
    pg: KeyTable,
    /// The claim with its own lock wait, one statement
    /// (`keys::claim_waiting_at_most`).
    #[cfg(any(feature = "postgres", feature = "sqlx-postgres"))]
    pg_claim: String,
}

/// Why a table prefix was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadPrefix(pub String);

impl fmt::Display for BadPrefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "table prefix {:?}: letters, digits and `_`, optionally after `schema.`", self.0)
    }
}

impl std::error::Error for BadPrefix {}

impl Keys {
    /// Keys kept in the table `{prefix}idem_keys` (its migrations recorded
    /// in `{prefix}idem_schema`). The prefix may name a PostgreSQL schema:
    /// `"billing."`, `"billing.app_"`.
    ///
    /// ```
    /// use idem::embed::Keys;
    /// assert_eq!(Keys::new("app_")?.table(), "app_idem_keys");
    /// assert_eq!(Keys::new("billing.")?.table(), "billing.idem_keys");
    /// assert!(Keys::new("app; DROP TABLE orders; --").is_err()); // pasted into SQL: refused
    /// # Ok::<(), idem::embed::BadPrefix>(())
    /// ```
    pub fn new(prefix: &str) -> Result<Keys, BadPrefix> {
        let (schema, name) = prefix.rsplit_once('.').map_or((None, prefix), |(s, n)| (Some(s), n));
        let word = |s: &str| s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        let ok = word(name) && schema.is_none_or(|s| !s.is_empty() && word(s) && !s.contains('.'));
        if !ok || prefix.len() > 40 {
            return Err(BadPrefix(prefix.to_owned()));
        }
        let table = format!("{prefix}idem_keys");
        #[cfg(any(feature = "postgres", feature = "sqlx-postgres"))]
        let pg = KeyTable::new(&table, Dialect::Postgres);
        Ok(Keys {
            #[cfg(any(feature = "sqlite", feature = "sqlx-sqlite"))]
            sqlite: KeyTable::new(&table, Dialect::Sqlite),
            #[cfg(any(feature = "postgres", feature = "sqlx-postgres"))]
            pg_claim: crate::store::keys::claim_waiting_at_most(&table, IN_FLIGHT_WAIT),
            #[cfg(any(feature = "postgres", feature = "sqlx-postgres"))]
            pg,
            table,
            index: format!("{name}idem_keys_created_at"),
            versions: format!("{prefix}idem_schema"),
            policy: Policy::embedded().clone(),
        })
    }

    /// How long a request waits for another transaction holding its key
    /// before it is answered [`Reply::InFlight`] (default [`IN_FLIGHT_WAIT`]).
    #[cfg(any(feature = "postgres", feature = "sqlx-postgres"))]
    pub fn in_flight_wait(mut self, wait: std::time::Duration) -> Keys {
        self.pg_claim = crate::store::keys::claim_waiting_at_most(&self.table, wait);
        self
    }

    /// Keeps keys for `hours` (the default is the published policy's 72).
    /// A key older than that is forgotten: its request is new again.
    pub fn retention_hours(mut self, hours: u32) -> Keys {
        self.policy.retention_hours = hours;
        self
    }

    /// The key table's name, as the caller's SQL would write it.
    pub fn table(&self) -> &str {
        &self.table
    }

    /// The body's fingerprint, or why it has none; and the key, checked.
    fn admit<E>(&self, key: &str, body: &str) -> Result<String, Error<E>> {
        self.check_key(key)?;
        let json = Json::parse(body).map_err(|e| Error::Body(e.to_string()))?;
        Ok(fingerprint(&json))
    }

    fn check_key<E>(&self, key: &str) -> Result<(), Error<E>> {
        match key.is_empty() || key.chars().count() > self.policy.max_field_chars {
            true => Err(Error::Key),
            false => Ok(()),
        }
    }

    /// The fingerprint of a request body of any kind, or why it has none;
    /// and the key, checked. A body that is JSON (declared so, or sent
    /// without saying: `curl -d` calls JSON a form) is fingerprinted as
    /// [`Keys::admit`] does, canonically, so a re-spaced or reordered retry is
    /// the same request; a body declared JSON that is not is refused. Any
    /// other body (empty, a form, bytes) is fingerprinted over its media
    /// type and its bytes exactly: another type or another byte is another
    /// request.
    fn admit_body<E>(&self, key: &str, media_type: Option<&str>, bytes: &[u8]) -> Result<String, Error<E>> {
        let declared_json = media_type.is_some_and(crate::request::is_json);
        match std::str::from_utf8(bytes) {
            Ok(text) if declared_json || Json::parse(text).is_ok() => self.admit(key, text),
            Err(_) if declared_json => Err(Error::Body("a JSON body is UTF-8 text (RFC 8259)".into())),
            _ => {
                self.check_key(key)?;
                use sha2::{Digest, Sha256};
                let media_type = media_type.unwrap_or("").trim().to_ascii_lowercase();
                let digest = Sha256::new()
                    .chain_update("idem body\0")
                    .chain_update(media_type)
                    .chain_update("\0")
                    .chain_update(bytes)
                    .finalize();
                Ok(crate::hex::lower(&digest))
            }
        }
    }

    /// A fresh claim token.
    fn token<E>() -> Result<String, Error<E>> {
        fresh_token().map_err(|e| Error::Db(e.to_string().into()))
    }

    /// The protocol's context for a claim by `token`, now.
    fn ctx<'a>(&'a self, token: &'a str) -> Ctx<'a> {
        Ctx { policy: &self.policy, now: Timestamp::now(), token }
    }

    /// The reply a decision on the key's row gives without running the work
    /// (a replay carries what its row `kept` with it).
    fn decided(decision: Decision, kept: Kept) -> Reply {
        match decision {
            Decision::Replay(s) => {
                // written by `Answer::stored`; a row of another hand's that is
                // not a list of pairs replays with none
                let headers = kept.headers.and_then(|h| serde_json::from_str(&h).ok()).unwrap_or_default();
                let body = kept.body_bytes.unwrap_or_else(|| s.body.into_bytes());
                Reply::Replayed(Answer { status: s.status, body, content_type: kept.content_type, headers })
            }
            Decision::Mismatch => Reply::Mismatch,
            Decision::InProgress | Decision::TakeOver | Decision::Expired => Reply::InFlight,
        }
    }

    /// The reply of a run `protocol::conduct` conducted: the work's answer,
    /// or the decision that answered instead (a replay carries what was
    /// `kept` with it), or why there is none.
    fn reply<E>(conducted: Result<Result<Answer, Decision>, Stop<E>>, kept: Kept) -> Result<Reply, Error<E>> {
        match conducted {
            Ok(Ok(answer)) => Ok(Reply::Fresh(answer)),
            Ok(Err(decision)) => Ok(Self::decided(decision, kept)),
            // the claim waited past its bound on a racer's claim of the key
            Err(Stop::Store(StoreError::Busy)) => Ok(Reply::InFlight),
            Err(Stop::Store(e)) => Err(Error::Db(Box::new(e))),
            Err(Stop::Work(e)) => Err(Error::Work(e)),
        }
    }

    /// The instant before which a key is past retention.
    fn retained_since(&self) -> Timestamp {
        Timestamp::now().plus_seconds(-self.policy.retention_seconds())
    }

    /// The versioned steps that build the key table (`store::keys::migrations`).
    fn migrations(&self, dialect: Dialect) -> Vec<String> {
        let mut steps = crate::store::keys::migrations(&self.table, &self.index, dialect);
        steps.push(self.calls_table(dialect));
        steps
    }

    /// `{prefix}idem_calls`: the outside calls a handler declared
    /// (`layer::Outside`), one a key at most, each with the downstream key
    /// its provider sees on every send. Times are Unix milliseconds.
    fn calls_table(&self, dialect: Dialect) -> String {
        let id = match dialect {
            Dialect::Sqlite => "INTEGER PRIMARY KEY",
            Dialect::Postgres => "BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY",
        };
        let name = self.index.trim_end_matches("idem_keys_created_at");
        format!(
            "CREATE TABLE {t} (
               id {id},
               client_id TEXT NOT NULL,
               endpoint TEXT NOT NULL,
               idem_key TEXT NOT NULL,
               key_token TEXT NOT NULL,
               downstream_key TEXT NOT NULL UNIQUE,
               intent TEXT NOT NULL,
               state TEXT NOT NULL,
               holder TEXT NOT NULL,
               lease_until BIGINT NOT NULL,
               sends BIGINT NOT NULL,
               attempts BIGINT NOT NULL,
               note TEXT NOT NULL,
               created_at BIGINT NOT NULL,
               updated_at BIGINT NOT NULL,
               UNIQUE (client_id, endpoint, idem_key)
             );
             CREATE INDEX {name}idem_calls_due ON {t} (lease_until) WHERE state IN ('in_progress', 'unknown')",
            t = self.calls()
        )
    }

    /// The calls table's name, as the caller's SQL would write it.
    pub fn calls(&self) -> String {
        format!("{}idem_calls", self.table.trim_end_matches("idem_keys"))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_prefix_is_words_with_at_most_one_schema() {
        for good in ["", "app_", "billing.", "billing.app_"] {
            assert!(super::Keys::new(good).is_ok(), "{good:?}");
        }
        for bad in ["a;DROP TABLE x;", "a b", ".x", "a.b.c", "\"q\""] {
            assert!(super::Keys::new(bad).is_err(), "{bad:?}");
        }
    }
}
