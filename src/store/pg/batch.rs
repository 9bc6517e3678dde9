//! Many requests' claims in one statement, and many executions in one
//! call: the service's group commit on PostgreSQL (`pg_pool::batch` runs
//! them). A batch is one transaction, so it costs one round trip, one
//! backend wake-up and one WAL flush however many transfers it carries;
//! what each transfer decides and writes is still its own.
//!
//! A claim's row is the single claim's row ([`claim_row`] reads it), one
//! per request in the batch's order. An execution's row is the single
//! execution's row ([`plan_row`] reads it): the function below runs every
//! transfer of the batch in its order, each checking its own premises on
//! the balances its batch-mates before it left (a hot pair's transfers
//! apply one after the other within the call), and writing only if all of
//! them hold. A refusal or a stale premise is that transfer's row; no
//! transfer's outcome fails its batch-mates.

use super::*;
use tokio_postgres::types::Type;

/// The claim of many keys: [`Hot::texts`]' claim over arrays, `$1..$9`
/// each one column of the batch. The inserts go in key order, so two
/// batches that share keys (a retry racing its original) take the keys'
/// index locks in the same order and never wait on each other in a cycle;
/// a key inserted is this attempt's only if the row holds its own token
/// (a batch may carry one key twice).
pub(in crate::store) fn claim_batch_sql(shape: &Shape) -> String {
    let t = &shape.acct_type;
    let record = KEY_COLUMNS.split(", ").map(|c| format!("k.{c}")).collect::<Vec<_>>().join(", ");
    format!(
        "WITH lazy AS MATERIALIZED (SELECT set_config('synchronous_commit', 'off', true)),
              w AS MATERIALIZED (
                SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[],
                                     $6::text[], $7::text[], $8::text[], $9::text[])
                         WITH ORDINALITY AS w (c, e, k, fp, tok, cat, lu, s, d, n)),
              mine AS (
                INSERT INTO idem_key (client_id, endpoint, idem_key, fingerprint, state, token, created_at, lease_until)
                SELECT c, e, k, fp, 'in_progress', tok, cat, lu FROM w ORDER BY c, e, k
                ON CONFLICT (client_id, endpoint, idem_key) DO NOTHING
                RETURNING token)
         SELECT EXISTS (SELECT FROM mine WHERE mine.token = w.tok), {record},
                s.acct_id::text, s.balance::text, d.acct_id::text, d.balance::text
         FROM lazy CROSS JOIN w
         LEFT JOIN idem_key k ON k.client_id = w.c AND k.endpoint = w.e AND k.idem_key = w.k
         LEFT JOIN account s ON s.acct_id = w.s::text::{t}
         LEFT JOIN account d ON d.acct_id = w.d::text::{t}
         ORDER BY w.n"
    )
}

/// The function that runs a batch of executions: [`BatchFunction::name`],
/// a function of the database's own (in the schema `idem_key` is in),
/// made once by the first connection that finds it missing.
///
/// idem runs only code it made: the function is called by its schema-
/// qualified name, runs with its own search path (the schemas the tables
/// were found in, then `pg_temp`), and before a connection prepares its
/// call, the function at that name must be owned by idem's role or the
/// tables' owner and hold this very text ([`BatchFunction::TRUST`]). A
/// role that may create in the schema (every role in `public`, up to
/// PostgreSQL 14) and made one of that name first is not called: batches
/// are off, with a log line and a metric, and requests go out alone.
///
/// Not a temporary one: a session's temporary objects are dropped as its
/// backend exits, in a transaction whose commit waits for the synchronous
/// standby. On a primary cut off from its standbys, every backend of the
/// pool then hung on its way out, and the server's own shutdown with them,
/// so the cluster's manager could never demote it and the cluster never
/// healed. A function of the database's own is written once, not at every
/// connection's end. Its name carries a digest of its text: each binary
/// calls its own version, and versions side by side never replace each
/// other's.
///
/// It first locks every key the batch still holds (in key order), then
/// every account it touches (in ascending order, as a single execution
/// does), so batches side by side never wait on each other in a cycle.
/// Then, transfer by transfer in the batch's order, [`execute_sql`]'s
/// checks, and the money moved only if they all hold: each transfer sees
/// the balances the ones before it left. The transfers paid are inserted,
/// and the keys completed, after the loop, one statement each for the
/// batch; their ids are drawn from the table's own sequence in the loop
/// (a table whose id draws from none fails every batch, which then goes
/// out a request at a time).
pub(in crate::store) struct BatchFunction {
    /// The schema, `.idem_execute_` and 16 hex digits of its text's SHA-256.
    pub name: String,
    /// `CREATE FUNCTION` of it.
    pub create: String,
    /// Its call; each row reads as the single execution's, then whether
    /// that transfer was handed back to go alone.
    pub call: String,
    /// Its name and argument types, for `to_regprocedure`.
    signature: String,
    /// Its body as PostgreSQL keeps it (`pg_proc.prosrc`).
    body: String,
}

/// How long a batch waits for the locks it needs before it takes only
/// what is free: longer than another batch of idem's holds them (the
/// function's work for a full batch and its commit), far shorter than a
/// foreign session's hold, which would otherwise stall the batch, its
/// lane and every transfer queued behind it.
pub(in crate::store) const BATCH_LOCK_WAIT: &str = "50ms";

/// What is at the batch function's name.
pub(in crate::store) enum Found {
    Missing,
    Ours,
    /// Not idem's (why): never called.
    Foreign(String),
}

impl BatchFunction {
    const ARGS: &str = "text[], text[], text[], text[], text[], text[], bool[], bigint[], bigint[], bool[], \
                        bigint[], bigint[], bigint[], text[], text[], int[], text[], text[], text";

    /// The function at [`BatchFunction::signature`], if any: `$1` the
    /// signature, `$2` the body. Its owner must be idem's role or the
    /// tables' owner (a role that could rewrite the tables anyway), its
    /// text this one.
    pub(in crate::store) const TRUST: &str =
        "SELECT p.proowner IN (c.relowner, (SELECT r.oid FROM pg_roles r WHERE r.rolname = current_user)),
                p.prosrc = $2, pg_get_userbyid(p.proowner)::text
         FROM pg_class c, pg_proc p
         WHERE c.oid = to_regclass('idem_key') AND p.oid = to_regprocedure($1)";

    pub(in crate::store) fn of(shape: &Shape) -> BatchFunction {
        use sha2::{Digest, Sha256};
        let text = include_str!("batch_execute.sql")
            .replace("{t}", &shape.acct_type)
            .replace("{wait}", BATCH_LOCK_WAIT)
            .replace("{schema}", &shape.path);
        let digest = Sha256::digest(text.as_bytes());
        let name = format!("{}.idem_execute_{}", shape.schema, crate::hex::lower(&digest[..8]));
        let call = format!(
            "SELECT o_held, o_premises, o_inexact, o_transfer, o_done, o_alone
             FROM {name}($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[],
               $7::bool[], $8::bigint[], $9::bigint[], $10::bool[], $11::bigint[], $12::bigint[],
               $13::bigint[], $14::text[], $15::text[], $16::int[], $17::text[], $18::text[], $19::text)"
        );
        let body = text.split("$body$").nth(1).unwrap_or_default().to_owned();
        let signature = format!("{name}({})", Self::ARGS);
        BatchFunction { create: text.replace("{name}", &name), name, call, signature, body }
    }

    /// [`BatchFunction::TRUST`]'s arguments.
    pub(in crate::store) fn trust_args(&self) -> [&(dyn ToSql + Sync); 2] {
        [&self.signature, &self.body]
    }

    /// What [`BatchFunction::TRUST`]'s row says.
    pub(in crate::store) fn found(&self, row: Option<&Row>) -> Found {
        let Some(row) = row else { return Found::Missing };
        let (owner_ok, text_ok, owner): (bool, bool, String) = (row.get(0), row.get(1), row.get(2));
        match (owner_ok, text_ok) {
            (true, true) => Found::Ours,
            (false, _) => Found::Foreign(format!(
                "{} is owned by role {owner}, neither idem's nor the tables' owner: not idem's code, never called",
                self.name
            )),
            (true, false) => {
                Found::Foreign(format!("{} holds another text than idem's: never called", self.name))
            }
        }
    }
}

impl PgStore {
    /// Makes the batch's function (`BatchFunction`) unless it is there,
    /// under the schema's lock as the tables are: the service does it once
    /// as it starts, and runs without batches if it cannot (a role that may
    /// not create in the schema).
    /// A function at its name that is not idem's (`Found::Foreign`) is
    /// an error: batches stay off.
    pub fn make_batch_function(&mut self) -> Result<(), StoreError> {
        let function = BatchFunction::of(&self.core.shape);
        let mut tx = self.core.client.transaction().map_err(pg)?;
        tx.execute("SELECT pg_advisory_xact_lock($1)", &[&SCHEMA_LOCK]).map_err(pg)?;
        let row = tx.query_opt(BatchFunction::TRUST, &function.trust_args()).map_err(pg)?;
        match function.found(row.as_ref()) {
            Found::Ours => {}
            Found::Missing => tx.batch_execute(&function.create).map_err(pg)?,
            Found::Foreign(why) => return Err(StoreError::Schema(why)),
        }
        tx.commit().map_err(pg)
    }
}

/// The statements of a batch on each connection of a batching pool: the
/// executions' call prepared; the claims' text, sent typed and unprepared
/// (`query_typed`: one round trip, as a prepared one) so that it is planned
/// at each batch. A plan cached while `idem_key` was small scans it whole,
/// and goes on doing so as it grows, until autovacuum's first ANALYZE.
pub(in crate::store) struct BatchSql {
    pub(in crate::store) claims: String,
    pub(in crate::store) executions: Statement,
}

/// One request's claim, owned, to travel to the task that sends its batch.
pub(in crate::store) struct ClaimItem {
    text: [String; 7],
    accounts: [Option<String>; 2],
}

impl ClaimArgs<'_> {
    pub(in crate::store) fn item(&self) -> ClaimItem {
        let (k, c) = (self.key, self.claim);
        let text = [
            &k.client_id,
            &k.endpoint,
            &k.idem_key,
            &c.fingerprint,
            &c.token,
            &self.created_at,
            &self.lease_until,
        ]
        .map(String::clone);
        ClaimItem { text, accounts: self.accounts.clone() }
    }
}

/// A batch of claims as [`claim_batch_sql`] binds it, a column each.
pub(in crate::store) struct Claims {
    text: [Vec<String>; 7],
    accounts: [Vec<Option<String>>; 2],
}

impl Claims {
    pub(in crate::store) fn of(items: Vec<ClaimItem>) -> Claims {
        let mut claims = Claims { text: Default::default(), accounts: Default::default() };
        for item in items {
            for (column, value) in claims.text.iter_mut().zip(item.text) {
                column.push(value);
            }
            for (column, value) in claims.accounts.iter_mut().zip(item.accounts) {
                column.push(value);
            }
        }
        claims
    }

    /// The columns, each a `text[]`.
    pub(in crate::store) fn params(&self) -> [(&(dyn ToSql + Sync), Type); 9] {
        let [c, e, k, fp, tok, cat, lu] = &self.text;
        let [s, d] = &self.accounts;
        let texts: [&(dyn ToSql + Sync); 9] = [c, e, k, fp, tok, cat, lu, s, d];
        texts.map(|column| (column, Type::TEXT_ARRAY))
    }
}

/// One request's execution, owned, to travel to the task that sends its
/// batch: the single execution's arguments ([`PlanArgs`]).
pub(in crate::store) struct PlanItem {
    key: [String; 4],
    accounts: [Option<String>; 2],
    bounds: [(bool, i64, i64); 2],
    amount: i64,
    currency: String,
    at: String,
    status: i32,
    reason: Option<String>,
    body: String,
}

impl PlanArgs<'_> {
    pub(in crate::store) fn item(&self) -> PlanItem {
        let k = self.x.key;
        PlanItem {
            key: [&k.client_id, &k.endpoint, &k.idem_key, self.x.token].map(|s| s.to_owned()),
            accounts: self.accounts.clone(),
            bounds: self.bounds,
            amount: self.amount,
            currency: self.currency.to_owned(),
            at: self.at.clone(),
            status: self.status,
            reason: self.reason.clone(),
            body: self.body.to_owned(),
        }
    }
}

/// A batch of executions as [`BatchFunction::call`] binds it, a column each.
#[derive(Default)]
pub(in crate::store) struct Plans {
    key: [Vec<String>; 4],
    accounts: [Vec<Option<String>>; 2],
    on: [Vec<bool>; 2],
    lo: [Vec<i64>; 2],
    hi: [Vec<i64>; 2],
    amount: Vec<i64>,
    currency: Vec<String>,
    at: Vec<String>,
    status: Vec<i32>,
    reason: Vec<Option<String>>,
    body: Vec<String>,
}

impl Plans {
    pub(in crate::store) fn of(items: Vec<PlanItem>) -> Plans {
        let mut plans = Plans::default();
        for item in items {
            for (column, value) in plans.key.iter_mut().zip(item.key) {
                column.push(value);
            }
            for (column, value) in plans.accounts.iter_mut().zip(item.accounts) {
                column.push(value);
            }
            for (i, (on, lo, hi)) in item.bounds.into_iter().enumerate() {
                plans.on[i].push(on);
                plans.lo[i].push(lo);
                plans.hi[i].push(hi);
            }
            plans.amount.push(item.amount);
            plans.currency.push(item.currency);
            plans.at.push(item.at);
            plans.status.push(item.status);
            plans.reason.push(item.reason);
            plans.body.push(item.body);
        }
        plans
    }

    pub(in crate::store) fn params(&self) -> [&(dyn ToSql + Sync); 19] {
        let [c, e, k, tok] = &self.key;
        let [src, dst] = &self.accounts;
        [
            c,
            e,
            k,
            tok,
            src,
            dst,
            &self.on[0],
            &self.lo[0],
            &self.hi[0],
            &self.on[1],
            &self.lo[1],
            &self.hi[1],
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
