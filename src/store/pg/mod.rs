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
    Account, Audit, CREATED_HEAD, Claim, Dialect, Durability, Executed, Execution, KeyRecord, KeyState,
    KeyTable, NewTransfer, PayoutEvent, PayoutRow, PayoutStat, PayoutState, PayoutText, Plan, Premise, Reads,
    Seen, Store, StoreError, Stored, Tx, audit_sql,
};
use crate::clock::Timestamp;
use crate::policy::Policy;
use crate::reason::Reason;
use crate::request::{AcctId, MAX_EXACT_INT, PAYOUTS, ScopedKey};
use crate::store::keys::{NOTHING_KEPT, pg as key_sql, who};
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Row, Statement};

mod batch;
mod blocking;
mod connect;
mod payouts;
mod schema;
mod statements;
pub(in crate::store) mod steps;

pub(in crate::store) use crate::store::reach::*;
pub use blocking::{Client, Transaction};
pub(in crate::store) use connect::*;
pub(in crate::store) use schema::SCHEMA_LOCK;
use schema::*;
pub use steps::PgConn;
pub(in crate::store) use steps::{Route, deadline, prepare_hot, steps_of_route, usable};

/// The engine's key table and its statements.
fn keys() -> &'static KeyTable {
    static KEYS: std::sync::OnceLock<KeyTable> = std::sync::OnceLock::new();
    KEYS.get_or_init(|| KeyTable::new("idem_key", Dialect::Postgres))
}
pub(in crate::store) use batch::*;
pub(in crate::store) use statements::*;

/// The synchronous store: one connection whose request steps are the
/// engine's steps (`steps`), blocked on; the rest (transactions begun by
/// hand, payouts, reads, the schema) are statements on the same
/// connection, blocked on as well.
pub struct PgStore {
    core: PgConn<Client>,
    /// The statements of transactions begun by hand ([`Tx`]).
    sql: Statements,
    /// To reconnect after the server went away (restarted, failed over).
    spec: String,
}

impl PgStore {
    /// How this database's `account.acct_id` is typed.
    pub(super) fn shape(&self) -> &Shape {
        &self.core.shape
    }

    /// Connects to the database `spec` names and makes sure it is one the
    /// engine can use. The error never quotes `spec`.
    pub fn connect(spec: &str, policy: &Policy) -> Result<Self, StoreError> {
        let mut client = session(spec, policy)?;
        let shape = prepare_schema(&mut client)?;
        Self::on(client, shape, spec, policy.clone())
    }

    /// The store on `client`, a session of `spec`'s database of `shape`:
    /// the core's statements and the rest prepared on it.
    fn on(mut client: Client, shape: Shape, spec: &str, policy: Policy) -> Result<Self, StoreError> {
        let sql = Statements::prepare(&mut client, &shape).map_err(pg)?;
        let hot = client.run(|c| prepare_hot(c, &shape)).map_err(pg)?;
        let policy = std::borrow::Cow::Owned(policy);
        let core = PgConn { client, sql: hot, batch: None, shape, ahead: None, broken: false, policy };
        Ok(PgStore { core, sql, spec: spec.to_owned() })
    }

    /// The one dead-connection policy (`steps`): a connection that is not
    /// usable is replaced before the next step runs. The transaction it was
    /// in is lost, and the protocol treats that as any failed transaction.
    fn revive(&mut self) -> Result<(), StoreError> {
        // the connection's task reads only while it is blocked on: let it
        // see what the server sent since (a restart closes the socket)
        self.core.client.settle();
        if !usable(&self.core) || self.core.client.is_closed() {
            let client =
                session(&self.spec, &self.core.policy).map_err(|e| StoreError::Unavailable(e.to_string()))?;
            let (shape, policy) = (self.core.shape.clone(), self.core.policy.clone().into_owned());
            *self = Self::on(client, shape, &self.spec, policy)?;
        }
        Ok(())
    }

    /// Runs `statements` on the connection (revived), outside the core.
    fn plain<R>(
        &mut self,
        statements: impl FnOnce(&mut Client, &Hot) -> Result<R, tokio_postgres::Error>,
    ) -> Result<R, StoreError> {
        self.revive()?;
        statements(&mut self.core.client, &self.core.sql).map_err(pg)
    }

    /// Blocks on `step`, one of the core's, on the connection (revived).
    fn step<'s, F: std::future::Future>(
        &'s mut self,
        step: impl FnOnce(&'s mut PgConn<Client>) -> F,
    ) -> Result<F::Output, StoreError> {
        self.revive()?;
        let runtime = self.core.client.runtime();
        Ok(runtime.block_on(step(&mut self.core)))
    }
}

impl Store for PgStore {
    /// The core's claim: one statement, one round trip: the insert, the
    /// existing record if there was one, and the execution's accounts,
    /// committed lazily. Conflicts are retried within the busy budget of
    /// the policy the store was connected with.
    fn claim(
        &mut self,
        key: &ScopedKey,
        claim: &Claim,
        accounts: Option<[&AcctId; 2]>,
        _: &Policy,
    ) -> Result<Option<KeyRecord>, StoreError> {
        self.step(|core| steps::claim(core, key, claim, accounts))?
    }

    /// The core's execution: decides on what the claim read (or, after a
    /// conflict, on a fresh plain read) and writes the plan in one statement
    /// that checks it under the locks it takes: no lock is held across a
    /// round trip.
    fn execute(
        &mut self,
        x: Execution,
        plan: &mut dyn FnMut(&Seen) -> Plan,
        crash: &mut dyn FnMut() -> bool,
        _: &Policy,
    ) -> Result<Executed, StoreError> {
        let (mut plan, mut crash) = (plan, crash);
        self.step(|core| steps::execute(core, x, &mut plan, &mut crash))?
    }

    /// The core's takeover.
    fn replace_claim(
        &mut self,
        key: &ScopedKey,
        seen: &KeyRecord,
        claim: &Claim,
        _: &Policy,
    ) -> Result<bool, StoreError> {
        self.step(|core| steps::replace_claim(core, key, seen, claim))?
    }

    /// The core's release.
    fn release(&mut self, key: &ScopedKey, token: &str, _: &Policy) -> Result<bool, StoreError> {
        self.step(|core| core.release_once(key, token))?
    }

    fn begin(&mut self, durability: Durability) -> Result<Box<dyn Tx + '_>, StoreError> {
        let setting = match durability {
            Durability::Lazy => "BEGIN; SET LOCAL synchronous_commit = off",
            Durability::Durable => "BEGIN",
        };
        self.plain(|c, _| c.batch_execute(setting))?;
        let core = &mut self.core;
        let (client, shape, hot, sql) = (&mut core.client, &core.shape, &core.sql, &self.sql);
        Ok(Box::new(PgTx { client, shape, hot, sql, open: true }))
    }

    fn audit(&mut self) -> Result<Audit, StoreError> {
        self.revive()?;
        let (c, shape) = (&mut self.core.client, &self.core.shape);
        let mut balances = Vec::new();
        for row in c.query("SELECT acct_id::text, balance::text FROM account", &[]).map_err(pg)? {
            let id = shape.id(row.get(0))?;
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
        let row = self.plain(|c, _| {
            c.query_opt(
                "SELECT body FROM idem_key
                 WHERE transfer_id = $1 AND client_id = $2 AND state = 'completed' AND status = 201",
                &[&transfer_id, &client_id],
            )
        })?;
        Ok(row.map(|r| r.get(0)))
    }

    fn ping(&mut self) -> Result<(), StoreError> {
        self.plain(|c, _| c.batch_execute("SELECT 1"))
    }

    fn peek(&mut self, key: &ScopedKey) -> Result<Option<KeyRecord>, StoreError> {
        let row =
            self.plain(|c, hot| c.query_opt(&hot.read_key, &[&key.client_id, &key.endpoint, &key.idem_key]))?;
        row.as_ref().map(record).transpose()
    }
}

/// A transaction begun by hand (`BEGIN` with its settings in one round
/// trip); dropped without [`Tx::commit`], it rolls back.
pub struct PgTx<'a> {
    client: &'a mut Client,
    shape: &'a Shape,
    hot: &'a Hot,
    sql: &'a Statements,
    open: bool,
}

impl Drop for PgTx<'_> {
    fn drop(&mut self) {
        // On a dead or stalled connection there is nothing to roll back
        // (the server ends the transaction with the session).
        if self.open && !self.client.is_closed() {
            let _ = self.client.batch_execute("ROLLBACK");
        }
    }
}

impl PgTx<'_> {
    fn key_row(&mut self, statement: &Statement, key: &ScopedKey) -> Result<Option<KeyRecord>, StoreError> {
        let row =
            self.client.query_opt(statement, &[&key.client_id, &key.endpoint, &key.idem_key]).map_err(pg)?;
        row.as_ref().map(record).transpose()
    }
}

impl Tx for PgTx<'_> {
    fn insert_claim(&mut self, key: &ScopedKey, claim: &Claim) -> Result<Option<KeyRecord>, StoreError> {
        if self.client.run(|c| key_sql::insert_claim(c, keys(), who(key), claim)).map_err(pg)? {
            return Ok(None);
        }
        // The primary key is the arbiter. If the row it saw is gone already
        // (purged in between), run the claim again.
        let read_key = &self.hot.read_key;
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
            .query_opt(&self.hot.lock_key_nowait, &[&key.client_id, &key.endpoint, &key.idem_key])
        {
            Ok(Some(_)) => {}
            Ok(None) => return Ok(false),
            // The row is locked: its execution is running. The transaction
            // is aborted by the error; the caller ends it without another
            // statement.
            Err(e) if e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) => return Ok(false),
            Err(e) => return Err(pg(e)),
        }
        self.client.run(|c| key_sql::replace_claim(c, keys(), who(key), seen, claim)).map_err(pg)
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
        // the engine's answers are JSON: no media type of their own
        let complete = |c| key_sql::complete(c, keys(), who(key), token, response, NOTHING_KEPT, at);
        self.client.run(complete).map_err(pg)
    }

    fn release(&mut self, key: &ScopedKey, token: &str) -> Result<bool, StoreError> {
        let n = self
            .client
            .execute(&self.hot.release, &[&key.client_id, &key.endpoint, &key.idem_key, &token])
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
        self.client.run(|c| key_sql::purge(c, keys(), before, limit, PAYOUTS)).map_err(pg)
    }

    fn in_progress(&mut self) -> Result<Vec<(ScopedKey, KeyRecord)>, StoreError> {
        let rows = self.client.query(&keys().in_progress, &[]).map_err(pg)?;
        rows.iter()
            .map(|r| {
                let key = ScopedKey { client_id: r.get(9), endpoint: r.get(10), idem_key: r.get(11) };
                Ok((key, record(r)?))
            })
            .collect()
    }

    fn commit(mut self: Box<Self>) -> Result<(), StoreError> {
        self.open = false;
        self.client.batch_execute("COMMIT").map_err(pg)
    }
}
