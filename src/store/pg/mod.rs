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

pub(in crate::store) use crate::store::reach::*;
pub use blocking::{Client, Transaction};
pub(in crate::store) use connect::*;
pub(in crate::store) use schema::SCHEMA_LOCK;
use schema::*;

/// The engine's key table and its statements.
fn keys() -> &'static KeyTable {
    static KEYS: std::sync::OnceLock<KeyTable> = std::sync::OnceLock::new();
    KEYS.get_or_init(|| KeyTable::new("idem_key", Dialect::Postgres))
}
pub(in crate::store) use batch::*;
pub(in crate::store) use statements::*;

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
        read: impl Fn(&mut Self) -> Result<R, tokio_postgres::Error>,
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
