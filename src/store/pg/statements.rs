//! A transfer in two statements, each its own round trip: the claim
//! (which also reads what the decision needs) and the execution (which
//! locks, checks the decision's premises and writes). Their SQL, their
//! arguments and the reading of their rows, shared by the synchronous
//! store and the service's pool (`pg_pool.rs`).

use super::*;

/// A claim just inserted, and the accounts read in the same statement: the
/// execution under it decides on these, without a round trip of its own.
pub(in crate::store) struct Ahead {
    pub(super) key: ScopedKey,
    pub(super) ids: [AcctId; 2],
    pub(super) seen: Seen,
}

/// How `account.acct_id` is typed: ids are bound as text and cast to it.
#[derive(Debug, Clone)]
pub(in crate::store) struct Shape {
    /// The column's type as SQL spells it (`text`, `bigint`, …).
    pub(super) acct_type: String,
    /// Whether that type is an integer type (else a string type).
    pub(super) int_ids: bool,
    /// The schema `idem_key` is in, quoted: where idem's own function lives.
    pub(super) schema: String,
    /// The schemas the session finds the tables in, quoted, in order: the
    /// search path idem's function runs with (never its caller's).
    pub(super) path: String,
}

/// The statements of the synchronous store's transactions begun by hand
/// ([`Tx`]), prepared once per connection; the core's are [`Hot`].
pub(super) struct Statements {
    pub(super) lock_key: Statement,
    pub(super) lock_account: Statement,
    pub(super) add_to_balance: Statement,
    pub(super) insert_transfer: Statement,
}

/// The statements of a request's steps, as the synchronous store and the
/// service's asynchronous connections (`pg_pool.rs`) both prepare them.
pub(in crate::store) struct Hot {
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
    pub(in crate::store) fn texts(shape: &Shape) -> [String; 7] {
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
            keys().read.clone(),
            format!("SELECT 1 FROM idem_key WHERE {KEY_WHERE} FOR UPDATE NOWAIT"),
            keys().replace_claim.clone(),
            keys().release.clone(),
        ]
    }

    pub(in crate::store) fn of(prepared: [Statement; 7]) -> Hot {
        let [claim, seen, execute, read_key, lock_key_nowait, replace_claim, release] = prepared;
        Hot { claim, seen, execute, read_key, lock_key_nowait, replace_claim, release }
    }
}

impl Statements {
    pub(super) fn prepare(client: &mut Client, shape: &Shape) -> Result<Self, tokio_postgres::Error> {
        let t = &shape.acct_type;
        let mut p = |sql: &str| client.prepare(sql);
        Ok(Statements {
            lock_key: p(&format!("SELECT {KEY_COLUMNS} FROM idem_key WHERE {KEY_WHERE} FOR UPDATE"))?,
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
pub(super) fn execute_sql(shape: &Shape) -> String {
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
    pub(super) fn bind(&self, id: &AcctId) -> Option<String> {
        match (id, self.int_ids) {
            (AcctId::Int(i), _) => Some(i.to_string()),
            (AcctId::Text(s), true) => s.trim().parse::<i64>().ok().map(|i| i.to_string()),
            (AcctId::Text(s), false) => Some(s.clone()),
        }
    }

    /// An id as read back from the column (as text).
    pub(super) fn id(&self, text: String) -> Result<AcctId, StoreError> {
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
pub(super) fn balance(id: &AcctId, text: &str) -> Result<i64, StoreError> {
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

pub(in crate::store) fn record(row: &Row) -> Result<KeyRecord, StoreError> {
    record_at(row, 0)
}

/// The key's record from the columns of [`KEY_COLUMNS`] starting at `at`.
pub(super) fn record_at(row: &Row, at: usize) -> Result<KeyRecord, StoreError> {
    crate::store::keys::pg::record(row, at)
}

/// The key (columns 1..=9, if there is one) and the accounts `[src, dst]`
/// (columns 10..=13, id and balance as text) of a claim or seen row.
pub(in crate::store) fn seen_of(row: &Row, shape: &Shape) -> Result<Seen, StoreError> {
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
pub(in crate::store) struct ClaimArgs<'a> {
    pub(super) key: &'a ScopedKey,
    pub(super) claim: &'a Claim,
    pub(super) created_at: String,
    pub(super) lease_until: String,
    pub(super) accounts: [Option<String>; 2],
}

impl<'a> ClaimArgs<'a> {
    pub(in crate::store) fn new(
        shape: &Shape,
        key: &'a ScopedKey,
        claim: &'a Claim,
        accounts: Option<[&AcctId; 2]>,
    ) -> Self {
        let accounts = accounts.map(|ids| ids.map(|id| shape.bind(id))).unwrap_or_default();
        let (created_at, lease_until) = (claim.created_at.to_string(), claim.lease_until.to_string());
        ClaimArgs { key, claim, created_at, lease_until, accounts }
    }

    pub(in crate::store) fn params(&self) -> [&(dyn ToSql + Sync); 9] {
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
pub(in crate::store) enum ClaimRow {
    /// Inserted (or, sent again after a lost connection, found under this
    /// attempt's own token): ours, with the accounts as read.
    Mine([Option<Account>; 2]),
    /// The key existed before the statement began.
    Existing(KeyRecord),
    /// Inserted by a racer after the statement's snapshot: read it again.
    Raced,
}

pub(in crate::store) fn claim_row(row: &Row, shape: &Shape, claim: &Claim) -> Result<ClaimRow, StoreError> {
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
    pub(in crate::store) fn new(
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
    pub(in crate::store) fn for_execution(ahead: Option<Ahead>, x: &Execution) -> Option<Seen> {
        ahead
            .filter(|a| a.key == *x.key && a.ids.iter().eq(x.accounts))
            .filter(|a| a.seen.key.as_ref().is_some_and(|k| k.token == x.token))
            .map(|a| a.seen)
    }
}

/// The arguments of the seen statement.
pub(in crate::store) fn seen_args(shape: &Shape, x: &Execution) -> [Option<String>; 2] {
    x.accounts.map(|id| shape.bind(id))
}

/// The arguments of the execution statement, as it binds them (see
/// [`execute_sql`]), or `None` for a plan that writes nothing.
pub(in crate::store) struct PlanArgs<'a> {
    pub(super) x: &'a Execution<'a>,
    pub(super) accounts: [Option<String>; 2],
    pub(super) bounds: [(bool, i64, i64); 2],
    pub(super) amount: i64,
    pub(super) currency: &'a str,
    pub(super) at: String,
    pub(super) status: i32,
    pub(super) reason: Option<String>,
    pub(super) body: &'a str,
}

impl<'a> PlanArgs<'a> {
    pub(in crate::store) fn new(shape: &Shape, x: &'a Execution<'a>, plan: &'a Plan) -> Option<Self> {
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

    pub(in crate::store) fn params(&self) -> [&(dyn ToSql + Sync); 19] {
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
pub(in crate::store) fn plan_row(row: &Row, shape: &Shape, plan: &Plan) -> Result<Stored, StoreError> {
    let (held, premises_hold, inexact): (bool, bool, Option<String>) = (row.get(0), row.get(1), row.get(2));
    if let Some(id) = inexact {
        return Err(crate::store::inexact(&shape.id(id)?));
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
