//! The PostgreSQL store: the same contract as SQLite, with many writers.
//!
//! The database arrives holding `account(acct_id, holder, balance)`; the
//! first connection creates `transfer` and `idem_key` (serialised by an
//! advisory lock, so racing first calls do not trip over each other) and
//! marks `idem_key` with its schema version. Every connection checks, as the
//! SQLite store does, that `acct_id` is unique and that no trigger or rule
//! acts on the engine's tables.
//!
//! Unlike SQLite, PostgreSQL runs transactions side by side, so every clause
//! of the store contract is carried by SQL here, and it holds under READ
//! COMMITTED and SERIALIZABLE alike:
//! - the claim is `INSERT … ON CONFLICT DO NOTHING`; a racer's uncommitted
//!   insert makes it wait for that racer's outcome, never pass beside it;
//! - a takeover first locks the row `FOR UPDATE NOWAIT`: a key whose
//!   execution holds the row is in flight (409 at once, never a wait); then
//!   it updates only the version seen (token and state);
//! - the execution locks the key and both accounts `FOR UPDATE` (accounts
//!   in ascending order, by the ledger) until its commit;
//! - balances move by `balance = balance + $2 … RETURNING`;
//! - serialization failures (40001) and deadlocks (40P01) are
//!   [`StoreError::Conflict`], retried by `store::atomically`; a lock wait
//!   past `lock_timeout` (the policy's `busy_timeout_ms`) is [`StoreError::Busy`].
//!
//! Durability: a claim commits with `SET LOCAL synchronous_commit = off` (a
//! claim lost in a crash moved no money; the retry claims again) and the
//! execution with it on, so a transfer costs one WAL flush; the claim's WAL
//! record precedes the execution's commit record and is flushed with it.
//!
//! No error produced here carries the connection string or its password.

use super::{
    Account, Audit, CREATED_HEAD, Claim, Durability, Executed, Execution, KeyRecord, KeyRow, KeyState,
    NewTransfer, PURGEABLE, PayoutEvent, PayoutRow, PayoutStat, PayoutState, PayoutText, Plan, Premise,
    Reads, Seen, Store, StoreError, Stored, Tx, audit_sql,
};
use crate::clock::Timestamp;
use crate::policy::Policy;
use crate::reason::Reason;
use crate::request::{AcctId, MAX_EXACT_INT, PAYOUTS, ScopedKey};
use postgres::error::SqlState;
use postgres::types::ToSql;
use postgres::{Client, Config, NoTls, Row, Statement};
use std::str::FromStr;
use std::time::Duration;

/// The comment that marks `idem_key` as this schema version.
const SCHEMA_MARK: &str = "idem schema 1";

/// Any constant: serialises schema creation across racing first calls.
const SCHEMA_LOCK: i64 = 0x1de3_5c4e_3a00_0001;

pub struct PgStore {
    client: Client,
    shape: Shape,
    sql: Statements,
    /// To reconnect after the server went away (restarted, failed over).
    spec: String,
    policy: Policy,
    /// What the last claim read on its way, for the execution under it.
    ahead: Option<Ahead>,
}

/// A claim just inserted, and the accounts read in the same statement: the
/// execution under it decides on these, without a round trip of its own.
pub(super) struct Ahead {
    key: ScopedKey,
    ids: [AcctId; 2],
    seen: Seen,
}

/// How `account.acct_id` is typed: ids are bound as text and cast to it.
#[derive(Debug, Clone)]
pub(super) struct Shape {
    /// The column's type as SQL spells it (`text`, `bigint`, …).
    acct_type: String,
    /// Whether that type is an integer type (else a string type).
    int_ids: bool,
}

/// Every statement a request runs, prepared once per connection.
struct Statements {
    hot: Hot,
    insert_claim: Statement,
    lock_key: Statement,
    complete: Statement,
    lock_account: Statement,
    add_to_balance: Statement,
    insert_transfer: Statement,
}

impl PgStore {
    /// How this database's `account.acct_id` is typed.
    pub(super) fn shape(&self) -> &Shape {
        &self.shape
    }

    /// Connects to the database `spec` names and makes sure it is one the
    /// engine can use. The error never quotes `spec`.
    pub fn connect(spec: &str, policy: &Policy) -> Result<Self, StoreError> {
        let mut client = session(spec, policy)?;
        let shape = prepare_schema(&mut client)?;
        let sql = Statements::prepare(&mut client, &shape).map_err(pg)?;
        Ok(PgStore { client, shape, sql, spec: spec.to_owned(), policy: policy.clone(), ahead: None })
    }

    /// A new connection if the old one is gone (the server restarted): the
    /// transaction it was in is lost, and the protocol treats that as any
    /// failed transaction; the next one runs on the new connection.
    fn revive(&mut self) -> Result<(), StoreError> {
        if self.client.is_closed() {
            self.reconnect()?;
        }
        Ok(())
    }

    fn reconnect(&mut self) -> Result<(), StoreError> {
        let mut client =
            session(&self.spec, &self.policy).map_err(|e| StoreError::Unavailable(e.to_string()))?;
        self.sql = Statements::prepare(&mut client, &self.shape).map_err(pg)?;
        self.client = client;
        Ok(())
    }

    /// Runs `read` on the connection, on a new one if it is found dead: a
    /// killed backend is noticed by the first statement after it, and a
    /// read is safe to run again.
    fn reading<R>(
        &mut self,
        read: impl Fn(&mut Self) -> Result<R, postgres::Error>,
    ) -> Result<R, StoreError> {
        self.revive()?;
        match read(self) {
            Err(e) if lost(&e) => {
                self.reconnect()?;
                read(self).map_err(pg)
            }
            other => other.map_err(pg),
        }
    }
}

/// A connection configured for the engine: lock waits end at the busy
/// budget (and become 503s), and the money commit is durable even if the
/// server's default says otherwise.
fn session(spec: &str, policy: &Policy) -> Result<Client, StoreError> {
    let mut client = client(spec, policy)?;
    client
        .batch_execute(&session_sql(policy))
        .map_err(|e| redacted("cannot configure the session", &e, spec))?;
    Ok(client)
}

/// What every connection that runs requests sets first.
pub(super) fn session_sql(policy: &Policy) -> String {
    format!(
        "SET lock_timeout = {}; SET statement_timeout = {STATEMENT_TIMEOUT_MS}; SET synchronous_commit = on",
        policy.busy_timeout_ms
    )
}

/// How long a network that stopped answering may keep a connection: TCP
/// keepalives probe an idle one after `KEEPALIVE_IDLE`, then every
/// `KEEPALIVE_INTERVAL`, `KEEPALIVE_RETRIES` times; data sent and not
/// acknowledged for `TCP_USER_TIMEOUT` drops it. The operating system's
/// defaults (two hours idle; retransmissions for about fifteen minutes)
/// would hold a worker on a dead peer far past any client's deadline.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(5);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(1);
const KEEPALIVE_RETRIES: u32 = 3;
const TCP_USER_TIMEOUT: Duration = Duration::from_secs(10);

/// The longest any one statement may run on the server: every statement of
/// a request takes milliseconds, and its lock waits end at the busy budget.
pub(super) const STATEMENT_TIMEOUT_MS: u32 = 15_000;

/// A plain connection to the database `spec` names, with a connect timeout
/// of the busy budget and the network timeouts above, each unless `spec`
/// sets its own. The error never quotes `spec`.
///
/// A server that accepts the connection and then says nothing (paused, its
/// disk stuck) would hold the start-up forever: `connect_timeout` covers
/// only the socket's connect. So each host of `spec` is tried in turn with
/// the whole start-up bounded by that timeout, and the next host is tried
/// past it. An attempt left behind ends with its socket.
pub(super) fn client(spec: &str, policy: &Policy) -> Result<Client, StoreError> {
    let config = configure(spec, policy)?;
    let deadline = startup_deadline(&config);
    let mut last = None;
    for one in each_host(&config) {
        let (sent, answer) = std::sync::mpsc::channel();
        let attempt = std::thread::Builder::new()
            .name("idem-pg-connect".into())
            .spawn(move || drop(sent.send(Config::from(one).connect(NoTls))));
        if let Err(e) = attempt {
            return Err(StoreError::Backend(format!("cannot start a connection attempt: {e}").into()));
        }
        last = Some(match answer.recv_timeout(deadline) {
            Ok(Ok(client)) => return Ok(client),
            Ok(Err(e)) => redacted("cannot connect to PostgreSQL", &e, spec),
            Err(_) => silent(deadline),
        });
    }
    Err(last.unwrap_or_else(|| StoreError::Backend("--db names no host".into())))
}

/// What a host that accepted the connection but never answered is.
pub(super) fn silent(deadline: Duration) -> StoreError {
    StoreError::Unavailable(format!(
        "PostgreSQL accepted the connection but did not finish its start-up within {} ms (paused, or far too busy)",
        deadline.as_millis()
    ))
}

/// How long one host's whole start-up may take: the connect timeout.
pub(super) fn startup_deadline(config: &tokio_postgres::Config) -> Duration {
    config.get_connect_timeout().copied().unwrap_or(Duration::from_secs(5))
}

/// `config` once per host it names, in its order, each with that host only
/// (and its port and address): everything else as given.
pub(super) fn each_host(config: &tokio_postgres::Config) -> Vec<tokio_postgres::Config> {
    use tokio_postgres::config::Host;
    let (ports, addrs) = (config.get_ports(), config.get_hostaddrs());
    let mut all = Vec::new();
    for (i, host) in config.get_hosts().iter().enumerate() {
        let mut one = tokio_postgres::Config::new();
        match host {
            Host::Tcp(name) => one.host(name),
            Host::Unix(path) => one.host_path(path),
        };
        if let Some(port) = ports.get(i).or(ports.first()) {
            one.port(*port);
        }
        if let Some(addr) = addrs.get(i) {
            one.hostaddr(*addr);
        }
        if let Some(user) = config.get_user() {
            one.user(user);
        }
        if let Some(password) = config.get_password() {
            one.password(password);
        }
        if let Some(dbname) = config.get_dbname() {
            one.dbname(dbname);
        }
        if let Some(options) = config.get_options() {
            one.options(options);
        }
        if let Some(name) = config.get_application_name() {
            one.application_name(name);
        }
        if let Some(timeout) = config.get_connect_timeout() {
            one.connect_timeout(*timeout);
        }
        if let Some(timeout) = config.get_tcp_user_timeout() {
            one.tcp_user_timeout(*timeout);
        }
        if let Some(interval) = config.get_keepalives_interval() {
            one.keepalives_interval(interval);
        }
        if let Some(retries) = config.get_keepalives_retries() {
            one.keepalives_retries(retries);
        }
        one.ssl_mode(config.get_ssl_mode())
            .keepalives(config.get_keepalives())
            .keepalives_idle(config.get_keepalives_idle())
            .target_session_attrs(config.get_target_session_attrs())
            .channel_binding(config.get_channel_binding());
        all.push(one);
    }
    // no host given: the driver's own default (a local socket)
    if all.is_empty() {
        all.push(config.clone());
    }
    all
}

/// The configuration of [`client`], for either driver.
pub(super) fn configure(spec: &str, policy: &Policy) -> Result<tokio_postgres::Config, StoreError> {
    let mut config = tokio_postgres::Config::from_str(spec).map_err(|e| redacted("--db", &e, spec))?;
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(Duration::from_millis(u64::from(policy.busy_timeout_ms)));
    }
    let defaults = tokio_postgres::Config::new();
    if config.get_keepalives_idle() == defaults.get_keepalives_idle() {
        config.keepalives_idle(KEEPALIVE_IDLE);
    }
    if config.get_keepalives_interval().is_none() {
        config.keepalives_interval(KEEPALIVE_INTERVAL);
    }
    if config.get_keepalives_retries().is_none() {
        config.keepalives_retries(KEEPALIVE_RETRIES);
    }
    if config.get_tcp_user_timeout().is_none() {
        config.tcp_user_timeout(TCP_USER_TIMEOUT);
    }
    config.application_name("idem");
    Ok(config)
}

/// `spec` with `search_path` set to `schema`, in the form `spec` is in.
pub(super) fn in_schema(spec: &str, schema: &str) -> String {
    let options = format!("-c search_path={schema}");
    if spec.trim_start().starts_with("postgres") {
        let sep = if spec.contains('?') { '&' } else { '?' };
        format!("{spec}{sep}options={}", options.replace(' ', "%20").replace('=', "%3D"))
    } else {
        format!("{spec} options='{options}'")
    }
}

/// A connection error as one line, with every trace of `spec` (and the
/// password in it) removed, in case a driver message ever echoes it.
pub(super) fn redacted(what: &str, e: &postgres::Error, spec: &str) -> StoreError {
    let mut line = format!("{what}: {}", describe(e));
    let password = Config::from_str(spec)
        .ok()
        .and_then(|c| c.get_password().map(|p| String::from_utf8_lossy(p).into_owned()));
    for secret in password.into_iter().chain([spec.to_owned()]).filter(|s| !s.is_empty()) {
        line = line.replace(&secret, "***");
    }
    StoreError::Backend(line.into())
}

/// A driver error as one line: its kind and the server's primary message,
/// never the DETAIL (which may quote row data).
fn describe(e: &postgres::Error) -> String {
    let cause = match e.as_db_error() {
        Some(db) => Some(format!("{}: {}", db.severity(), db.message())),
        None => std::error::Error::source(e).map(|s| s.to_string()),
    };
    match cause {
        Some(cause) => format!("{e}: {}", cause.lines().next().unwrap_or("")),
        None => e.to_string(),
    }
}

/// A driver error as a store error: transient ones by kind, the rest as one
/// line without row data.
pub(super) fn pg(e: postgres::Error) -> StoreError {
    match e.code() {
        Some(c) if *c == SqlState::T_R_SERIALIZATION_FAILURE || *c == SqlState::T_R_DEADLOCK_DETECTED => {
            StoreError::Conflict
        }
        Some(c) if *c == SqlState::LOCK_NOT_AVAILABLE || *c == SqlState::QUERY_CANCELED => StoreError::Busy,
        _ if lost(&e) => StoreError::Unavailable(format!("PostgreSQL: {}", describe(&e))),
        _ => StoreError::Backend(format!("PostgreSQL: {}", describe(&e)).into()),
    }
}

/// Whether `e` says this connection cannot go on: the server went away (a
/// restart, a failover, a killed backend: 57P, 08), is out of resources
/// (53: disk full, memory, connections), or is a standby that cannot write
/// (25006). Nothing of the transaction is known to have committed but what
/// a retry will find; the next transaction runs on a new connection.
pub(super) fn lost(e: &postgres::Error) -> bool {
    match e.code() {
        Some(c) => {
            let c = c.code();
            c.starts_with("57P") || c.starts_with("08") || c.starts_with("53") || c == "25006"
        }
        None => e.is_closed() || std::error::Error::source(e).is_some_and(|s| s.is::<std::io::Error>()),
    }
}

/// Checks the account table, creates the engine's tables if missing, and
/// returns how `acct_id` is typed.
fn prepare_schema(client: &mut Client) -> Result<Shape, StoreError> {
    let row = client
        .query_opt(
            "SELECT format_type(a.atttypid, a.atttypmod), t.typname, c.relkind::text
             FROM pg_class c
             JOIN pg_attribute a ON a.attrelid = c.oid AND a.attname = 'acct_id' AND NOT a.attisdropped
             JOIN pg_type t ON t.oid = a.atttypid
             WHERE c.oid = to_regclass('account')",
            &[],
        )
        .map_err(pg)?
        .ok_or_else(|| StoreError::Schema("database has no account table with an acct_id column".into()))?;
    let (acct_type, typname, relkind): (String, String, String) = (row.get(0), row.get(1), row.get(2));
    if !["r", "p"].contains(&relkind.as_str()) {
        return Err(StoreError::Schema("account is not a table".into()));
    }
    let int_ids = match typname.as_str() {
        "int2" | "int4" | "int8" => true,
        "text" | "varchar" | "bpchar" | "name" | "citext" => false,
        other => {
            return Err(StoreError::Schema(format!(
                "account.acct_id is of type {other}, neither text nor integer"
            )));
        }
    };
    let shape = Shape { acct_type, int_ids };
    check_account(client)?;
    let mark: Option<String> = client
        .query_one("SELECT obj_description(to_regclass('idem_key'), 'pg_class')", &[])
        .map_err(pg)?
        .get(0);
    if mark.as_deref() != Some(SCHEMA_MARK) {
        create_schema(client, &shape)?;
    }
    Ok(shape)
}

fn check_account(client: &mut Client) -> Result<(), StoreError> {
    let row = client
        .query_one(
            "SELECT
               EXISTS (SELECT 1 FROM pg_index i
                       JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
                       WHERE i.indrelid = to_regclass('account') AND i.indisunique AND i.indnkeyatts = 1
                         AND i.indpred IS NULL AND i.indexprs IS NULL AND a.attname = 'acct_id'),
               (SELECT string_agg(name, ', ' ORDER BY name) FROM (
                  SELECT tgname::text AS name FROM pg_trigger
                  WHERE NOT tgisinternal
                    AND tgrelid IN (to_regclass('account'), to_regclass('transfer'), to_regclass('idem_key'))
                  UNION ALL
                  SELECT rulename::text FROM pg_rewrite
                  WHERE ev_class IN (to_regclass('account'), to_regclass('transfer'), to_regclass('idem_key'))
                    AND rulename <> '_RETURN') AS acting)",
            &[],
        )
        .map_err(pg)?;
    if !row.get::<_, bool>(0) {
        return Err(StoreError::Schema(
            "account.acct_id is not unique (no PRIMARY KEY or UNIQUE index on it alone): \
             one transfer could move the balance of several rows"
                .into(),
        ));
    }
    match row.get::<_, Option<String>>(1) {
        Some(names) => Err(StoreError::Schema(format!(
            "trigger(s) or rule(s) {names} act on the engine's tables: a transfer must write exactly what the engine writes"
        ))),
        None => Ok(()),
    }
}

/// The columns an existing `transfer` or `idem_key` must have to be reused.
const SHAPES: [(&str, &[&str]); 2] =
    [("transfer", &super::TRANSFER_COLUMNS), ("idem_key", &super::KEY_COLUMNS)];

fn create_schema(client: &mut Client, shape: &Shape) -> Result<(), StoreError> {
    let mut tx = client.transaction().map_err(pg)?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&SCHEMA_LOCK]).map_err(pg)?;
    for (table, wanted) in SHAPES {
        let have: Vec<String> = tx
            .query(
                "SELECT attname::text FROM pg_attribute WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped",
                &[&table],
            )
            .map_err(pg)?
            .iter()
            .map(|r| r.get(0))
            .collect();
        let missing: Vec<&str> =
            wanted.iter().copied().filter(|c| !have.is_empty() && !have.iter().any(|h| h == c)).collect();
        if !missing.is_empty() {
            return Err(StoreError::Schema(format!(
                "table {table} exists without column(s) {}: not a schema this idem can use",
                missing.join(", ")
            )));
        }
    }
    let mark: Option<String> =
        tx.query_one("SELECT obj_description(to_regclass('idem_key'), 'pg_class')", &[]).map_err(pg)?.get(0);
    match mark.as_deref() {
        Some(SCHEMA_MARK) => return Ok(()), // another first call got here first
        Some(other) if !other.is_empty() => {
            return Err(StoreError::Schema(format!(
                "idem_key is marked {other:?}; this idem understands {SCHEMA_MARK:?}"
            )));
        }
        _ => {}
    }
    let t = &shape.acct_type;
    // Times are RFC 3339 UTC text of fixed width in the C collation, so text
    // order is time order, and the same bytes as on SQLite.
    tx.batch_execute(&format!(
        "CREATE TABLE IF NOT EXISTS transfer (
             transfer_id bigint GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,
             src         {t} NOT NULL,
             dst         {t} NOT NULL,
             amount      bigint NOT NULL CHECK (amount > 0),
             currency    text NOT NULL,
             created_at  text COLLATE \"C\" NOT NULL);
         CREATE TABLE IF NOT EXISTS idem_key (
             client_id    text NOT NULL,
             endpoint     text NOT NULL,
             idem_key     text NOT NULL,
             fingerprint  text NOT NULL,
             state        text NOT NULL CHECK (state IN ('in_progress', 'completed')),
             token        text NOT NULL,
             created_at   text COLLATE \"C\" NOT NULL,
             lease_until  text COLLATE \"C\" NOT NULL,
             status       integer,
             reason       text,
             body         text,
             transfer_id  bigint UNIQUE,
             completed_at text,
             PRIMARY KEY (client_id, endpoint, idem_key),
             CHECK ((state = 'completed') = (status IS NOT NULL AND body IS NOT NULL AND completed_at IS NOT NULL)),
             CHECK (transfer_id IS NULL OR state = 'completed'));
         CREATE INDEX IF NOT EXISTS idem_key_created_at ON idem_key (created_at);
         COMMENT ON TABLE idem_key IS '{SCHEMA_MARK}';"
    ))
    .map_err(pg)?;
    tx.commit().map_err(pg)
}

const KEY_COLUMNS: &str = super::RECORD_COLUMNS;

const PAYOUT_COLUMNS: &str = "payout_id, client_id, endpoint, idem_key, fingerprint, src::text, beneficiary,
    amount, currency, downstream_key, state, holder, lease_until, created_at, updated_at, note, status,
    sends::bigint, attempts::bigint, provider_id";

const EVENT_COLUMNS: &str = "payout_id, at, actor, was, now, why";

impl PgTx<'_> {
    fn payouts_where(
        &mut self,
        condition: &str,
        params: &[&(dyn postgres::types::ToSql + Sync)],
    ) -> Result<Vec<PayoutRow>, StoreError> {
        let sql = format!("SELECT {PAYOUT_COLUMNS} FROM payout WHERE {condition}");
        let rows = self.client.query(&sql, params).map_err(pg)?;
        rows.iter()
            .map(|r| {
                let status: Option<i32> = r.get(16);
                PayoutText {
                    id: r.get(0),
                    key: ScopedKey { client_id: r.get(1), endpoint: r.get(2), idem_key: r.get(3) },
                    fingerprint: r.get(4),
                    src: self.shape.id(r.get(5))?,
                    beneficiary: r.get(6),
                    amount: r.get(7),
                    currency: r.get(8),
                    downstream_key: r.get(9),
                    state: r.get(10),
                    holder: r.get(11),
                    lease_until: r.get(12),
                    created_at: r.get(13),
                    updated_at: r.get(14),
                    note: r.get(15),
                    status: status.map(i64::from),
                    sends: r.get(17),
                    attempts: r.get(18),
                    provider_id: r.get(19),
                }
                .decode()
            })
            .collect()
    }
}
const KEY_WHERE: &str = "client_id = $1 AND endpoint = $2 AND idem_key = $3";

/// The statements of a request's steps, as the synchronous store and the
/// service's asynchronous connections (`pg_pool.rs`) both prepare them.
pub(super) struct Hot {
    pub claim: Statement,
    pub seen: Statement,
    pub execute: Statement,
    pub read_key: Statement,
    pub lock_key_nowait: Statement,
    pub replace_claim: Statement,
    pub release: Statement,
}

impl Hot {
    /// The texts, in the order [`Hot::of`] takes them prepared.
    pub(super) fn texts(shape: &Shape) -> [String; 7] {
        let t = &shape.acct_type;
        let record = KEY_COLUMNS.split(", ").map(|c| format!("k.{c}")).collect::<Vec<_>>().join(", ");
        let from = |from: &str, s: u8, d: u8| {
            format!(
                "s.acct_id::text, s.balance::text, d.acct_id::text, d.balance::text
                 FROM {from}
                 LEFT JOIN idem_key k ON k.client_id = $1 AND k.endpoint = $2 AND k.idem_key = $3
                 LEFT JOIN account s ON s.acct_id = ${s}::text::{t}
                 LEFT JOIN account d ON d.acct_id = ${d}::text::{t}"
            )
        };
        [
            // The claim commits lazily (set_config is SET LOCAL for the
            // statement's own transaction); the join reads the key only if
            // it existed before the statement began.
            format!(
                "WITH lazy AS MATERIALIZED (SELECT set_config('synchronous_commit', 'off', true)),
                      mine AS (
                        INSERT INTO idem_key (client_id, endpoint, idem_key, fingerprint, state, token, created_at, lease_until)
                        VALUES ($1, $2, $3, $4, 'in_progress', $5, $6, $7)
                        ON CONFLICT (client_id, endpoint, idem_key) DO NOTHING
                        RETURNING 1)
                 SELECT EXISTS (SELECT FROM mine), {record}, {}",
                from("lazy", 8, 9)
            ),
            format!("SELECT true, {record}, {}", from("(SELECT 1) one", 4, 5)),
            execute_sql(shape),
            format!("SELECT {KEY_COLUMNS} FROM idem_key WHERE {KEY_WHERE}"),
            format!("SELECT 1 FROM idem_key WHERE {KEY_WHERE} FOR UPDATE NOWAIT"),
            format!(
                "UPDATE idem_key SET fingerprint = $4, state = 'in_progress', token = $5,
                        created_at = $6, lease_until = $7, status = NULL, reason = NULL,
                        body = NULL, transfer_id = NULL, completed_at = NULL
                 WHERE {KEY_WHERE} AND token = $8 AND state = $9"
            ),
            format!("DELETE FROM idem_key WHERE {KEY_WHERE} AND state = 'in_progress' AND token = $4"),
        ]
    }

    pub(super) fn of(prepared: [Statement; 7]) -> Hot {
        let [claim, seen, execute, read_key, lock_key_nowait, replace_claim, release] = prepared;
        Hot { claim, seen, execute, read_key, lock_key_nowait, replace_claim, release }
    }
}

impl Statements {
    fn prepare(client: &mut Client, shape: &Shape) -> Result<Self, postgres::Error> {
        let t = &shape.acct_type;
        let hot: Vec<Statement> =
            Hot::texts(shape).iter().map(|sql| client.prepare(sql)).collect::<Result<_, _>>()?;
        let hot = Hot::of(hot.try_into().unwrap_or_else(|_| unreachable!("seven texts, seven statements")));
        let mut p = |sql: &str| client.prepare(sql);
        Ok(Statements {
            hot,
            insert_claim: p(
                "INSERT INTO idem_key (client_id, endpoint, idem_key, fingerprint, state, token, created_at, lease_until)
                 VALUES ($1, $2, $3, $4, 'in_progress', $5, $6, $7)
                 ON CONFLICT (client_id, endpoint, idem_key) DO NOTHING",
            )?,
            lock_key: p(&format!("SELECT {KEY_COLUMNS} FROM idem_key WHERE {KEY_WHERE} FOR UPDATE"))?,
            complete: p(&format!(
                "UPDATE idem_key SET state = 'completed', status = $4, reason = $5, body = $6,
                        transfer_id = $7, completed_at = $8
                 WHERE {KEY_WHERE} AND state = 'in_progress' AND token = $9"
            ))?,
            lock_account: p(&format!(
                "SELECT acct_id::text, balance::text FROM account WHERE acct_id = $1::text::{t} FOR UPDATE"
            ))?,
            add_to_balance: p(&format!(
                "UPDATE account SET balance = balance + $2::bigint
                 WHERE acct_id = $1::text::{t} AND balance + $2::bigint >= 0 RETURNING balance::text"
            ))?,
            insert_transfer: p(&format!(
                "INSERT INTO transfer (src, dst, amount, currency, created_at)
                 VALUES ($1::text::{t}, $2::text::{t}, $3, $4, $5) RETURNING transfer_id"
            ))?,
        })
    }
}

/// The execution as one statement, its own transaction: lock the key if
/// `$4` still holds it, lock the accounts in ascending order, check the
/// plan's premises on them (`$7..$12`: present, lo, hi for src and dst),
/// and only if all holds move `$13` (0 for a refusal), insert the transfer
/// and complete the key, its 201 body `$19`, the new id, then `$18`. The
/// row says what held, for the caller to read again if anything did not.
fn execute_sql(shape: &Shape) -> String {
    let t = &shape.acct_type;
    format!(
        "WITH held AS MATERIALIZED (
           SELECT 1 FROM idem_key
           WHERE {KEY_WHERE} AND state = 'in_progress' AND token = $4::text
           FOR UPDATE),
         locked AS MATERIALIZED (
           SELECT acct_id, balance FROM account
           WHERE acct_id = ANY (ARRAY[$5::text::{t}, $6::text::{t}])
           ORDER BY acct_id FOR UPDATE),
         want (id, present, lo, hi, delta) AS (
           VALUES ($5::text::{t}, $7::bool, $8::bigint, $9::bigint, -$13::bigint),
                  ($6::text::{t}, $10::bool, $11::bigint, $12::bigint, $13::bigint)),
         checked AS MATERIALIZED (
           SELECT EXISTS (SELECT FROM held) AS held,
                  bool_and(CASE WHEN l.acct_id IS NULL THEN NOT w.present
                                ELSE w.present AND COALESCE(l.balance BETWEEN w.lo AND w.hi, false) END) AS premises,
                  string_agg(CASE WHEN l.acct_id IS NULL OR w.delta = 0
                                       OR NOT COALESCE(l.balance BETWEEN w.lo AND w.hi, false) THEN NULL
                                  WHEN (l.balance + w.delta)::text::numeric <> l.balance::text::numeric + w.delta
                                       THEN l.acct_id::text END, ',') AS inexact
           FROM want w LEFT JOIN locked l ON l.acct_id = w.id),
         go AS MATERIALIZED (SELECT held AND premises AND inexact IS NULL AS go FROM checked),
         moved AS (
           UPDATE account a SET balance = a.balance + w.delta FROM want w
           WHERE a.acct_id = w.id AND w.delta <> 0 AND (SELECT go FROM go)),
         made AS (
           INSERT INTO transfer (src, dst, amount, currency, created_at)
           SELECT $5::text::{t}, $6::text::{t}, $13, $14::text, $15::text FROM go WHERE go AND $13 > 0
           RETURNING transfer_id),
         done AS (
           UPDATE idem_key SET state = 'completed', status = $16::int, reason = $17::text,
                  body = CASE WHEN $13 > 0 THEN $19::text || (SELECT transfer_id FROM made) || $18::text
                              ELSE $18::text END,
                  transfer_id = (SELECT transfer_id FROM made), completed_at = $15
           WHERE {KEY_WHERE} AND state = 'in_progress' AND token = $4 AND (SELECT go FROM go)
           RETURNING 1)
         SELECT held, premises, inexact, (SELECT transfer_id FROM made), (SELECT count(*) FROM done)
         FROM checked"
    )
}

impl Shape {
    /// The text to bind for `id`, or `None` if no row of this column's type
    /// can match it (text that is not an integer, against integer ids).
    fn bind(&self, id: &AcctId) -> Option<String> {
        match (id, self.int_ids) {
            (AcctId::Int(i), _) => Some(i.to_string()),
            (AcctId::Text(s), true) => s.trim().parse::<i64>().ok().map(|i| i.to_string()),
            (AcctId::Text(s), false) => Some(s.clone()),
        }
    }

    /// An id as read back from the column (as text).
    fn id(&self, text: String) -> Result<AcctId, StoreError> {
        match self.int_ids {
            true => text
                .parse()
                .map(AcctId::Int)
                .map_err(|_| StoreError::Schema(format!("account id {text:?} is not an integer"))),
            false => Ok(AcctId::Text(text)),
        }
    }
}

/// A balance as an exact integer, from its text form: an integer, or a
/// whole number a double holds exactly (float and numeric columns).
fn balance(id: &AcctId, text: &str) -> Result<i64, StoreError> {
    if let Ok(b) = text.parse::<i64>() {
        return Ok(b);
    }
    match text.parse::<f64>() {
        Ok(r) if r.fract() == 0.0 && r.abs() <= MAX_EXACT_INT as f64 => Ok(r as i64),
        _ => Err(StoreError::Schema(format!(
            "balance of account {:?} is {text}, not an integer amount a double holds exactly",
            id.to_string()
        ))),
    }
}

pub(super) fn record(row: &Row) -> Result<KeyRecord, StoreError> {
    record_at(row, 0)
}

/// The key's record from the columns of [`KEY_COLUMNS`] starting at `at`.
fn record_at(row: &Row, at: usize) -> Result<KeyRecord, StoreError> {
    let status: Option<i32> = row.get(at + 5);
    KeyRow {
        fingerprint: row.get(at),
        created_at: row.get(at + 1),
        token: row.get(at + 2),
        state: row.get(at + 3),
        lease_until: row.get(at + 4),
        status: status.map(i64::from),
        reason: row.get(at + 6),
        body: row.get(at + 7),
        transfer_id: row.get(at + 8),
    }
    .decode()
}

/// The key (columns 1..=9, if there is one) and the accounts `[src, dst]`
/// (columns 10..=13, id and balance as text) of a claim or seen row.
pub(super) fn seen_of(row: &Row, shape: &Shape) -> Result<Seen, StoreError> {
    let key = match row.get::<_, Option<String>>(4) {
        Some(_) => Some(record_at(row, 1)?),
        None => None,
    };
    let account = |at: usize| -> Result<Option<Account>, StoreError> {
        let Some(id) = row.get::<_, Option<String>>(at) else { return Ok(None) };
        let id = shape.id(id)?;
        let Some(text) = row.get::<_, Option<String>>(at + 1) else {
            return Err(StoreError::Schema(format!("balance of account {:?} is NULL", id.to_string())));
        };
        let balance = balance(&id, &text)?;
        Ok(Some(Account { id, balance }))
    };
    Ok(Seen { key, accounts: [account(10)?, account(12)?] })
}

/// The arguments of the claim statement, as it binds them.
pub(super) struct ClaimArgs<'a> {
    key: &'a ScopedKey,
    claim: &'a Claim,
    created_at: String,
    lease_until: String,
    accounts: [Option<String>; 2],
}

impl<'a> ClaimArgs<'a> {
    pub(super) fn new(
        shape: &Shape,
        key: &'a ScopedKey,
        claim: &'a Claim,
        accounts: Option<[&AcctId; 2]>,
    ) -> Self {
        let accounts = accounts.map(|ids| ids.map(|id| shape.bind(id))).unwrap_or_default();
        let (created_at, lease_until) = (claim.created_at.to_string(), claim.lease_until.to_string());
        ClaimArgs { key, claim, created_at, lease_until, accounts }
    }

    pub(super) fn params(&self) -> [&(dyn ToSql + Sync); 9] {
        let (k, c) = (self.key, self.claim);
        [
            &k.client_id,
            &k.endpoint,
            &k.idem_key,
            &c.fingerprint,
            &c.token,
            &self.created_at,
            &self.lease_until,
            &self.accounts[0],
            &self.accounts[1],
        ]
    }
}

/// What the claim statement found.
pub(super) enum ClaimRow {
    /// Inserted (or, sent again after a lost connection, found under this
    /// attempt's own token): ours, with the accounts as read.
    Mine([Option<Account>; 2]),
    /// The key existed before the statement began.
    Existing(KeyRecord),
    /// Inserted by a racer after the statement's snapshot: read it again.
    Raced,
}

pub(super) fn claim_row(row: &Row, shape: &Shape, claim: &Claim) -> Result<ClaimRow, StoreError> {
    let seen = seen_of(row, shape)?;
    Ok(match (row.get::<_, bool>(0), seen.key) {
        (true, _) => ClaimRow::Mine(seen.accounts),
        (false, Some(rec)) if rec.token == claim.token => ClaimRow::Mine(seen.accounts),
        (false, Some(rec)) => ClaimRow::Existing(rec),
        (false, None) => ClaimRow::Raced,
    })
}

impl Ahead {
    /// What the execution under `claim`, just inserted, decides on.
    pub(super) fn new(
        key: &ScopedKey,
        claim: &Claim,
        ids: [&AcctId; 2],
        accounts: [Option<Account>; 2],
    ) -> Self {
        let record = KeyRecord {
            fingerprint: claim.fingerprint.clone(),
            created_at: claim.created_at,
            token: claim.token.clone(),
            state: KeyState::InProgress { lease_until: claim.lease_until },
        };
        Ahead { key: key.clone(), ids: ids.map(AcctId::clone), seen: Seen { key: Some(record), accounts } }
    }

    /// The seen of the claim before `x`, if `x` runs under it.
    pub(super) fn for_execution(ahead: Option<Ahead>, x: &Execution) -> Option<Seen> {
        ahead
            .filter(|a| a.key == *x.key && a.ids.iter().eq(x.accounts))
            .filter(|a| a.seen.key.as_ref().is_some_and(|k| k.token == x.token))
            .map(|a| a.seen)
    }
}

/// The arguments of the seen statement.
pub(super) fn seen_args(shape: &Shape, x: &Execution) -> [Option<String>; 2] {
    x.accounts.map(|id| shape.bind(id))
}

/// The arguments of the execution statement, as it binds them (see
/// [`execute_sql`]), or `None` for a plan that writes nothing.
pub(super) struct PlanArgs<'a> {
    x: &'a Execution<'a>,
    accounts: [Option<String>; 2],
    bounds: [(bool, i64, i64); 2],
    amount: i64,
    currency: &'a str,
    at: String,
    status: i32,
    reason: Option<String>,
    body: &'a str,
}

impl<'a> PlanArgs<'a> {
    pub(super) fn new(shape: &Shape, x: &'a Execution<'a>, plan: &'a Plan) -> Option<Self> {
        // a payment's completion stores a 201 and no reason
        let (premises, amount, currency, (status, reason), body) = match plan {
            Plan::Nothing => return None,
            Plan::Refuse { answer, premises } => {
                (premises, 0, "", (answer.status, answer.reason.as_ref()), answer.body.as_str())
            }
            Plan::Pay { payment, premises } => {
                (premises, payment.amount, payment.currency.as_str(), (201, None), payment.body_tail.as_str())
            }
        };
        let bounds = premises.map(|p| match p {
            Premise::Absent => (false, 0, 0),
            Premise::Between { lo, hi } => (true, lo, hi),
        });
        Some(PlanArgs {
            x,
            accounts: x.accounts.map(|id| shape.bind(id)),
            bounds,
            amount,
            currency,
            at: x.at.to_string(),
            status: i32::from(status),
            reason: reason.map(Reason::to_string),
            body,
        })
    }

    pub(super) fn params(&self) -> [&(dyn ToSql + Sync); 19] {
        let (k, [(s_on, s_lo, s_hi), (d_on, d_lo, d_hi)]) = (self.x.key, &self.bounds);
        [
            &k.client_id,
            &k.endpoint,
            &k.idem_key,
            &self.x.token,
            &self.accounts[0],
            &self.accounts[1],
            s_on,
            s_lo,
            s_hi,
            d_on,
            d_lo,
            d_hi,
            &self.amount,
            &self.currency,
            &self.at,
            &self.status,
            &self.reason,
            &self.body,
            &CREATED_HEAD,
        ]
    }
}

/// The answer the execution statement's `row` stored for `plan`, or why it
/// wrote nothing: [`StoreError::Conflict`] if the key or a premise changed
/// (read again and plan again).
pub(super) fn plan_row(row: &Row, shape: &Shape, plan: &Plan) -> Result<Stored, StoreError> {
    let (held, premises_hold, inexact): (bool, bool, Option<String>) = (row.get(0), row.get(1), row.get(2));
    if let Some(id) = inexact {
        return Err(super::inexact(&shape.id(id)?));
    }
    if !(held && premises_hold) {
        return Err(StoreError::Conflict);
    }
    match (plan, row.get::<_, Option<i64>>(3)) {
        (Plan::Pay { payment, .. }, Some(id)) => Ok(payment.answer(id)),
        (Plan::Refuse { answer, .. }, None) => Ok(answer.clone()),
        _ => Err(StoreError::Backend("the execution wrote a transfer other than planned".into())),
    }
}

impl PgStore {
    /// Writes `plan` in one statement, its own transaction: if the key is
    /// still held by the token and the premises hold under the locks it
    /// takes, all of it; else nothing, and a [`StoreError::Conflict`] to
    /// read and plan again.
    fn write_plan(&mut self, x: &Execution, plan: &Plan) -> Result<Stored, StoreError> {
        let Some(args) = PlanArgs::new(&self.shape, x, plan) else {
            return Err(StoreError::Backend("nothing to write".into()));
        };
        let row = self.client.query_one(&self.sql.hot.execute, &args.params()).map_err(pg)?;
        plan_row(&row, &self.shape, plan)
    }
}

impl Store for PgStore {
    /// One statement, one round trip: the insert, the existing record if
    /// there was one, and the execution's accounts, committed lazily.
    fn claim(
        &mut self,
        key: &ScopedKey,
        claim: &Claim,
        accounts: Option<[&AcctId; 2]>,
        policy: &Policy,
    ) -> Result<Option<KeyRecord>, StoreError> {
        self.ahead = None;
        let args = ClaimArgs::new(&self.shape, key, claim, accounts);
        let found = super::retrying(
            policy,
            |e| *e == StoreError::Conflict,
            || {
                // A connection found dead is replaced and the claim sent again;
                // if the first one did commit, the key is found under this
                // attempt's own token, and is ours.
                let row = self.reading(|s| s.client.query_one(&s.sql.hot.claim, &args.params()))?;
                match claim_row(&row, &self.shape, claim)? {
                    ClaimRow::Mine(read) => Ok(Err(read)),
                    ClaimRow::Existing(rec) => Ok(Ok(rec)),
                    ClaimRow::Raced => {
                        let k = [&key.client_id, &key.endpoint, &key.idem_key];
                        let row =
                            self.client.query_opt(&self.sql.hot.read_key, &[k[0], k[1], k[2]]).map_err(pg)?;
                        row.as_ref().map(record).transpose()?.map(Ok).ok_or(StoreError::Conflict)
                    }
                }
            },
        );
        match found {
            Err(StoreError::Conflict) => Err(StoreError::Busy),
            Err(e) => Err(e),
            Ok(Ok(existing)) => Ok(Some(existing)),
            Ok(Err(read)) => {
                self.ahead = accounts.map(|ids| Ahead::new(key, claim, ids, read));
                Ok(None)
            }
        }
    }

    /// Decides on what the claim read (or, after a conflict, on a fresh
    /// plain read) and writes the plan in one statement that checks it
    /// under the locks it takes: no lock is held across a round trip.
    fn execute(
        &mut self,
        x: Execution,
        plan: &mut dyn FnMut(&Seen) -> Plan,
        crash: &mut dyn FnMut() -> bool,
        policy: &Policy,
    ) -> Result<Executed, StoreError> {
        let mut ahead = Ahead::for_execution(self.ahead.take(), &x);
        let done = super::retrying(
            policy,
            |e| *e == StoreError::Conflict,
            || {
                let seen = match ahead.take() {
                    Some(seen) => seen,
                    None => {
                        self.revive()?;
                        let [src, dst] = seen_args(&self.shape, &x);
                        let k = x.key;
                        let row = self.client.query_one(
                            &self.sql.hot.seen,
                            &[&k.client_id, &k.endpoint, &k.idem_key, &src, &dst],
                        );
                        seen_of(&row.map_err(pg)?, &self.shape)?
                    }
                };
                let planned = plan(&seen);
                if planned == Plan::Nothing {
                    return Ok(Executed::Nothing);
                }
                // Nothing is written yet: a crash here leaves what a crash
                // before the commit leaves.
                if crash() {
                    return Ok(Executed::Crashed);
                }
                self.write_plan(&x, &planned).map(Executed::Completed)
            },
        );
        match done {
            Err(StoreError::Conflict) => Err(StoreError::Busy),
            other => other,
        }
    }

    fn begin(&mut self, durability: Durability) -> Result<Box<dyn Tx + '_>, StoreError> {
        // BEGIN is where a dead connection is found: nothing has run on it
        // yet, so it is replaced and the transaction starts on a new one.
        let setting = match durability {
            Durability::Lazy => "BEGIN; SET LOCAL synchronous_commit = off",
            Durability::Durable => "BEGIN",
        };
        self.reading(|s| s.client.batch_execute(setting))?;
        Ok(Box::new(PgTx { client: &mut self.client, shape: &self.shape, sql: &self.sql, open: true }))
    }

    fn audit(&mut self) -> Result<Audit, StoreError> {
        self.revive()?;
        let c = &mut self.client;
        let mut balances = Vec::new();
        for row in c.query("SELECT acct_id::text, balance::text FROM account", &[]).map_err(pg)? {
            let id = self.shape.id(row.get(0))?;
            let b = balance(&id, row.get(1))?;
            balances.push((id, b));
        }
        balances.sort();
        let pairs = |c: &mut Client, sql: &str| -> Result<Vec<(i64, i64)>, StoreError> {
            Ok(c.query(sql, &[]).map_err(pg)?.iter().map(|r| (r.get(0), r.get(1))).collect())
        };
        let count = |c: &mut Client, sql: &str, params: &[&(dyn ToSql + Sync)]| -> Result<i64, StoreError> {
            Ok(c.query_one(sql, params).map_err(pg)?.get(0))
        };
        Ok(Audit {
            balances,
            transfers: pairs(c, audit_sql::TRANSFERS)?,
            orphans: pairs(c, audit_sql::ORPHANS)?.into_iter().map(|(id, _)| id).collect(),
            hollow: count(c, audit_sql::HOLLOW, &[&PAYOUTS])?,
            keys_in_progress: count(c, audit_sql::IN_PROGRESS, &[])?,
            keys_completed: count(c, audit_sql::COMPLETED, &[])?,
        })
    }
}

impl Reads for PgStore {
    fn transfer_for(&mut self, client_id: &str, transfer_id: i64) -> Result<Option<String>, StoreError> {
        let row = self.reading(|s| {
            s.client.query_opt(
                "SELECT body FROM idem_key
                 WHERE transfer_id = $1 AND client_id = $2 AND state = 'completed' AND status = 201",
                &[&transfer_id, &client_id],
            )
        })?;
        Ok(row.map(|r| r.get(0)))
    }

    fn ping(&mut self) -> Result<(), StoreError> {
        self.reading(|s| s.client.batch_execute("SELECT 1"))
    }

    fn peek(&mut self, key: &ScopedKey) -> Result<Option<KeyRecord>, StoreError> {
        let row = self.reading(|s| {
            s.client.query_opt(&s.sql.hot.read_key, &[&key.client_id, &key.endpoint, &key.idem_key])
        })?;
        row.as_ref().map(record).transpose()
    }
}

/// A transaction begun by hand (`BEGIN` with its settings in one round
/// trip); dropped without [`Tx::commit`], it rolls back.
pub struct PgTx<'a> {
    client: &'a mut Client,
    shape: &'a Shape,
    sql: &'a Statements,
    open: bool,
}

impl Drop for PgTx<'_> {
    fn drop(&mut self) {
        if self.open {
            // On a dead connection there is nothing to roll back.
            let _ = self.client.batch_execute("ROLLBACK");
        }
    }
}

impl PgTx<'_> {
    /// Runs `statement` with the key as $1..$3, the claim as $4..$7 and, for
    /// a compare-and-set, the `(token, state)` seen as $8, $9.
    fn write_claim(
        &mut self,
        statement: &Statement,
        key: &ScopedKey,
        claim: &Claim,
        seen: Option<(&str, &str)>,
    ) -> Result<u64, StoreError> {
        let (created_at, lease_until) = (claim.created_at.to_string(), claim.lease_until.to_string());
        let mut params: Vec<&(dyn postgres::types::ToSql + Sync)> = vec![
            &key.client_id,
            &key.endpoint,
            &key.idem_key,
            &claim.fingerprint,
            &claim.token,
            &created_at,
            &lease_until,
        ];
        let seen = seen.map(|(token, state)| (token.to_owned(), state.to_owned()));
        if let Some((token, state)) = &seen {
            params.extend([token as &(dyn postgres::types::ToSql + Sync), state]);
        }
        self.client.execute(statement, &params).map_err(pg)
    }

    fn key_row(&mut self, statement: &Statement, key: &ScopedKey) -> Result<Option<KeyRecord>, StoreError> {
        let row =
            self.client.query_opt(statement, &[&key.client_id, &key.endpoint, &key.idem_key]).map_err(pg)?;
        row.as_ref().map(record).transpose()
    }
}

impl Tx for PgTx<'_> {
    fn insert_claim(&mut self, key: &ScopedKey, claim: &Claim) -> Result<Option<KeyRecord>, StoreError> {
        let insert_claim = &self.sql.insert_claim;
        if self.write_claim(insert_claim, key, claim, None)? == 1 {
            return Ok(None);
        }
        // The primary key is the arbiter. If the row it saw is gone already
        // (purged in between), run the claim again.
        let read_key = &self.sql.hot.read_key;
        self.key_row(read_key, key)?.map(Some).ok_or(StoreError::Conflict)
    }

    fn replace_claim(
        &mut self,
        key: &ScopedKey,
        seen: &KeyRecord,
        claim: &Claim,
    ) -> Result<bool, StoreError> {
        match self
            .client
            .query_opt(&self.sql.hot.lock_key_nowait, &[&key.client_id, &key.endpoint, &key.idem_key])
        {
            Ok(Some(_)) => {}
            Ok(None) => return Ok(false),
            // The row is locked: its execution is running. The transaction
            // is aborted by the error; the caller ends it without another
            // statement.
            Err(e) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => return Ok(false),
            Err(e) => return Err(pg(e)),
        }
        let replace_claim = &self.sql.hot.replace_claim;
        Ok(self.write_claim(replace_claim, key, claim, Some((&seen.token, seen.state.name())))? == 1)
    }

    fn lock_key(&mut self, key: &ScopedKey) -> Result<Option<KeyRecord>, StoreError> {
        let lock_key = &self.sql.lock_key;
        self.key_row(lock_key, key)
    }

    fn complete(
        &mut self,
        key: &ScopedKey,
        token: &str,
        response: &Stored,
        at: Timestamp,
    ) -> Result<bool, StoreError> {
        let (status, at) = (i32::from(response.status), at.to_string());
        let reason = response.reason.as_ref().map(Reason::to_string);
        let changed = self
            .client
            .execute(
                &self.sql.complete,
                &[
                    &key.client_id,
                    &key.endpoint,
                    &key.idem_key,
                    &status,
                    &reason,
                    &response.body,
                    &response.transfer_id,
                    &at,
                    &token,
                ],
            )
            .map_err(pg)?;
        Ok(changed == 1)
    }

    fn release(&mut self, key: &ScopedKey, token: &str) -> Result<bool, StoreError> {
        let n = self
            .client
            .execute(&self.sql.hot.release, &[&key.client_id, &key.endpoint, &key.idem_key, &token])
            .map_err(pg)?;
        Ok(n == 1)
    }

    fn lock_account(&mut self, id: &AcctId) -> Result<Option<Account>, StoreError> {
        let Some(bound) = self.shape.bind(id) else { return Ok(None) };
        let Some(row) = self.client.query_opt(&self.sql.lock_account, &[&bound]).map_err(pg)? else {
            return Ok(None);
        };
        let id = self.shape.id(row.get(0))?;
        let balance = balance(&id, row.get(1))?;
        Ok(Some(Account { id, balance }))
    }

    fn add_to_balance(&mut self, id: &AcctId, delta: i64) -> Result<i64, StoreError> {
        let bound = self.shape.bind(id).unwrap_or_default();
        let rows = self.client.query(&self.sql.add_to_balance, &[&bound, &delta]).map_err(pg)?;
        match rows.as_slice() {
            [row] => balance(id, row.get(0)),
            rows => Err(StoreError::Schema(format!(
                "a balance update of account {:?} changed {} rows, not 1",
                id.to_string(),
                rows.len()
            ))),
        }
    }

    fn insert_transfer(&mut self, t: &NewTransfer) -> Result<i64, StoreError> {
        let (src, dst) =
            (self.shape.bind(t.src).unwrap_or_default(), self.shape.bind(t.dst).unwrap_or_default());
        let at = t.created_at.to_string();
        let row = self
            .client
            .query_one(&self.sql.insert_transfer, &[&src, &dst, &t.amount, &t.currency, &at])
            .map_err(pg)?;
        Ok(row.get(0))
    }

    fn purge(&mut self, before: Timestamp, limit: u64) -> Result<u64, StoreError> {
        let (before, limit) = (before.to_string(), i64::try_from(limit).unwrap_or(i64::MAX));
        self.client
            .execute(
                &format!(
                    "DELETE FROM idem_key WHERE (client_id, endpoint, idem_key) IN
                   (SELECT client_id, endpoint, idem_key FROM idem_key
                    WHERE created_at < $1 AND {PURGEABLE} ORDER BY created_at LIMIT $2)",
                ),
                &[&before, &limit, &PAYOUTS],
            )
            .map_err(pg)
    }

    fn in_progress(&mut self) -> Result<Vec<(ScopedKey, KeyRecord)>, StoreError> {
        let rows = self
            .client
            .query(
                &format!(
                    "SELECT {KEY_COLUMNS}, client_id, endpoint, idem_key FROM idem_key WHERE state = 'in_progress'
                     ORDER BY created_at, client_id, endpoint, idem_key"
                ),
                &[],
            )
            .map_err(pg)?;
        rows.iter()
            .map(|r| {
                let key = ScopedKey { client_id: r.get(9), endpoint: r.get(10), idem_key: r.get(11) };
                Ok((key, record(r)?))
            })
            .collect()
    }

    fn ensure_payouts(&mut self) -> Result<(), StoreError> {
        // Created on first use by payouts only, like the other tables under
        // the schema lock, so that racing first calls do not collide.
        self.client.execute("SELECT pg_advisory_xact_lock($1)", &[&SCHEMA_LOCK]).map_err(pg)?;
        let schema = super::PAYOUT_SCHEMA
            .replace("{id}", "bigint GENERATED BY DEFAULT AS IDENTITY")
            .replace("{src}", &self.shape.acct_type)
            .replace("{amount}", "true")
            .replace("{time}", "text COLLATE \"C\"");
        // A first version's table gets the new columns, and CHECKs that
        // take the new states, in this transaction.
        let migrate = "DO $$ BEGIN
            IF NOT EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = 'payout'::regclass AND attname = 'sends') THEN
                ALTER TABLE payout
                    ADD COLUMN sends integer NOT NULL DEFAULT 0,
                    ADD COLUMN attempts integer NOT NULL DEFAULT 0,
                    ADD COLUMN provider_id text,
                    DROP CONSTRAINT IF EXISTS payout_state_check,
                    DROP CONSTRAINT IF EXISTS payout_check,
                    ADD CONSTRAINT payout_state_check CHECK (state IN
                        ('in_progress', 'unknown', 'needs_attention', 'completed', 'failed', 'returned')),
                    ADD CONSTRAINT payout_check CHECK ((state IN ('completed', 'failed', 'returned')) = (status IS NOT NULL));
            END IF;
        END $$;";
        self.client.batch_execute(&format!("{schema}\n{migrate}")).map_err(pg)
    }

    fn insert_payout(&mut self, p: &PayoutRow) -> Result<i64, StoreError> {
        let t = &self.shape.acct_type;
        let src = self.shape.bind(&p.src).unwrap_or_default();
        let (lease_until, created_at) = (p.lease_until.to_string(), p.created_at.to_string());
        let row = self
            .client
            .query_one(
                &format!(
                    "INSERT INTO payout (client_id, endpoint, idem_key, fingerprint, src, beneficiary, amount, currency,
                                         downstream_key, state, holder, lease_until, created_at, updated_at, note,
                                         sends, attempts, provider_id)
                     VALUES ($1, $2, $3, $4, $5::text::{t}, $6, $7, $8, $9, $10, $11, $12, $13, $13, $14,
                             $15::bigint, $16::bigint, $17)
                     RETURNING payout_id"
                ),
                &[
                    &p.key.client_id,
                    &p.key.endpoint,
                    &p.key.idem_key,
                    &p.fingerprint,
                    &src,
                    &p.beneficiary,
                    &p.amount,
                    &p.currency,
                    &p.downstream_key,
                    &p.state.name(),
                    &p.holder,
                    &lease_until,
                    &created_at,
                    &p.note,
                    &p.sends,
                    &p.attempts,
                    &p.provider_id,
                ],
            )
            .map_err(pg)?;
        Ok(row.get(0))
    }

    fn payout_of(&mut self, key: &ScopedKey) -> Result<Option<PayoutRow>, StoreError> {
        let rows = self.payouts_where(
            "client_id = $1 AND endpoint = $2 AND idem_key = $3 ORDER BY payout_id DESC LIMIT 1 FOR UPDATE",
            &[&key.client_id, &key.endpoint, &key.idem_key],
        )?;
        Ok(rows.into_iter().next())
    }

    fn payout(&mut self, id: i64) -> Result<Option<PayoutRow>, StoreError> {
        Ok(self.payouts_where("payout_id = $1 FOR UPDATE", &[&id])?.into_iter().next())
    }

    fn peek_payout(&mut self, id: i64) -> Result<Option<PayoutRow>, StoreError> {
        Ok(self.payouts_where("payout_id = $1", &[&id])?.into_iter().next())
    }

    fn update_payout(&mut self, p: &PayoutRow, seen_holder: &str) -> Result<bool, StoreError> {
        let (lease_until, updated_at) = (p.lease_until.to_string(), p.updated_at.to_string());
        let status = p.status.map(i32::from);
        let n = self
            .client
            .execute(
                "UPDATE payout SET state = $2, holder = $3, lease_until = $4, updated_at = $5, note = $6, status = $8,
                                   sends = $9::bigint, attempts = $10::bigint, provider_id = $11
                 WHERE payout_id = $1 AND holder = $7",
                &[
                    &p.id,
                    &p.state.name(),
                    &p.holder,
                    &lease_until,
                    &updated_at,
                    &p.note,
                    &seen_holder,
                    &status,
                    &p.sends,
                    &p.attempts,
                    &p.provider_id,
                ],
            )
            .map_err(pg)?;
        Ok(n == 1)
    }

    fn payouts_open(&mut self, now: Timestamp, all: bool) -> Result<Vec<PayoutRow>, StoreError> {
        let now = now.to_string();
        self.payouts_where(
            "state IN ('in_progress', 'unknown', 'needs_attention')
             AND ($2 OR (state <> 'needs_attention' AND lease_until <= $1)) ORDER BY created_at, payout_id",
            &[&now, &all],
        )
    }

    fn payouts_paid_due(
        &mut self,
        checked_before: Timestamp,
        paid_since: Timestamp,
        limit: i64,
    ) -> Result<Vec<PayoutRow>, StoreError> {
        self.payouts_where(
            "state = 'completed' AND lease_until <= $1 AND updated_at >= $2 ORDER BY updated_at, payout_id LIMIT $3",
            &[&checked_before.to_string(), &paid_since.to_string(), &limit],
        )
    }

    fn payout_stats(&mut self) -> Result<Vec<PayoutStat>, StoreError> {
        let rows = self.client.query(super::PAYOUT_STATS, &[]).map_err(pg)?;
        rows.iter().map(|r| super::payout_stat(r.get(0), r.get(1), r.get(2), r.get(3), r.get(4))).collect()
    }

    fn gateway_events_for_a_person(&mut self, limit: i64) -> Result<Vec<super::GatewayEventRow>, StoreError> {
        let sql = format!("{}$1", super::EVENTS_FOR_A_PERSON);
        let rows = self.client.query(&sql, &[&limit]).map_err(pg)?;
        Ok(rows
            .iter()
            .map(|r| super::GatewayEventRow {
                event_id: r.get(0),
                received_at: r.get(1),
                kind: r.get(2),
                downstream_key: r.get(3),
                outcome: r.get(4),
            })
            .collect())
    }

    fn payout_by_downstream_key(&mut self, key: &str) -> Result<Option<PayoutRow>, StoreError> {
        // not locked: the caller locks the key first, then the payout by id
        Ok(self.payouts_where("downstream_key = $1", &[&key])?.into_iter().next())
    }

    fn insert_gateway_event(
        &mut self,
        event_id: &str,
        at: Timestamp,
        kind: &str,
        downstream_key: &str,
        outcome: &str,
    ) -> Result<bool, StoreError> {
        self.client
            .execute(
                "INSERT INTO gateway_event (event_id, received_at, kind, downstream_key, outcome)
                 VALUES ($1, $2, $3, $4, $5) ON CONFLICT (event_id) DO NOTHING",
                &[&event_id, &at.to_string(), &kind, &downstream_key, &outcome],
            )
            .map(|n| n == 1)
            .map_err(pg)
    }

    fn payouts_in(&mut self, state: PayoutState, limit: i64) -> Result<Vec<PayoutRow>, StoreError> {
        self.payouts_where("state = $1 ORDER BY created_at, payout_id LIMIT $2", &[&state.name(), &limit])
    }

    fn insert_payout_event(&mut self, e: &PayoutEvent) -> Result<(), StoreError> {
        self.client
            .execute(
                &format!("INSERT INTO payout_event ({EVENT_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6)"),
                &[&e.payout_id, &e.at.to_string(), &e.actor, &e.was.name(), &e.now.name(), &e.why],
            )
            .map(|_| ())
            .map_err(pg)
    }

    fn payout_events(&mut self, payout_id: i64) -> Result<Vec<PayoutEvent>, StoreError> {
        let sql = format!("SELECT {EVENT_COLUMNS} FROM payout_event WHERE payout_id = $1 ORDER BY event_id");
        let corrupt = |why: String| StoreError::Backend(format!("corrupt payout event: {why}").into());
        let rows = self.client.query(&sql, &[&payout_id]).map_err(pg)?;
        rows.iter()
            .map(|r| {
                Ok(PayoutEvent {
                    payout_id: r.get(0),
                    at: Timestamp::parse(r.get(1)).map_err(|e| corrupt(e.to_string()))?,
                    actor: r.get(2),
                    was: PayoutState::parse(r.get(3))?,
                    now: PayoutState::parse(r.get(4))?,
                    why: r.get(5),
                })
            })
            .collect()
    }

    fn commit(mut self: Box<Self>) -> Result<(), StoreError> {
        self.open = false;
        self.client.batch_execute("COMMIT").map_err(pg)
    }
}
