//! The key table's statements run on a tokio-postgres client or
//! transaction the caller lends, each typed (one round trip, no prepare).

use super::{Kept, KeyTable, Who};
use crate::clock::Timestamp;
use crate::store::{Claim, KeyRecord, KeyRow, StoreError, Stored};
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{GenericClient, Row};

/// A typed argument.
type Arg<'a> = (&'a (dyn ToSql + Sync), Type);

/// The record of a key row whose `RECORD_COLUMNS` start at column `at`.
pub(crate) fn record(row: &Row, at: usize) -> Result<KeyRecord, StoreError> {
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

fn who_args<'a>(who: &'a Who<'a>) -> Vec<Arg<'a>> {
    who.iter().map(|w| (w as &(dyn ToSql + Sync), Type::TEXT)).collect()
}

/// What a key's row read by `read` or `read_nowait` keeps besides its record.
pub(crate) fn kept(row: &Row) -> Kept {
    Kept { content_type: row.get(9), headers: row.get(10), body_bytes: row.get(11) }
}

/// The key's row (its record, then what [`kept`] reads), locked without
/// waiting: `Err` with `LOCK_NOT_AVAILABLE` when another transaction holds it.
pub(crate) async fn read_nowait<C: GenericClient + Sync>(
    c: &C,
    t: &KeyTable,
    who: Who<'_>,
) -> Result<Option<Row>, tokio_postgres::Error> {
    Ok(c.query_typed(&t.read_nowait, &who_args(&who)).await?.into_iter().next())
}

/// The key's committed row (its record, then what [`kept`] reads), a
/// plain read: no lock taken, none waited for.
pub(crate) async fn read<C: GenericClient + Sync>(
    c: &C,
    t: &KeyTable,
    who: Who<'_>,
) -> Result<Option<Row>, tokio_postgres::Error> {
    Ok(c.query_typed(&t.read, &who_args(&who)).await?.into_iter().next())
}

/// Inserts `claim` unless the key exists (`false`: it does).
pub(crate) async fn insert_claim<C: GenericClient + Sync>(
    c: &C,
    t: &KeyTable,
    who: Who<'_>,
    claim: &Claim,
) -> Result<bool, tokio_postgres::Error> {
    write_claim(c, &t.insert_claim, who, claim, None).await
}

/// Writes `claim` over the key only if it is still the version `seen`.
pub(crate) async fn replace_claim<C: GenericClient + Sync>(
    c: &C,
    t: &KeyTable,
    who: Who<'_>,
    seen: &KeyRecord,
    claim: &Claim,
) -> Result<bool, tokio_postgres::Error> {
    write_claim(c, &t.replace_claim, who, claim, Some(seen)).await
}

/// Inserts `claim` unless the key exists, by `sql`
/// (`keys::claim_waiting_at_most`), which says how many it inserted.
pub(crate) async fn claim_waiting<C: GenericClient + Sync>(
    c: &C,
    sql: &str,
    who: Who<'_>,
    claim: &Claim,
) -> Result<bool, tokio_postgres::Error> {
    let (at, lease) = (claim.created_at.to_string(), claim.lease_until.to_string());
    let row = c.query_typed(sql, &claim_args(&who, claim, [&at, &lease], None)).await?;
    Ok(row.first().map(|r| r.try_get::<_, i64>(0)).transpose()? == Some(1))
}

async fn write_claim<C: GenericClient + Sync>(
    c: &C,
    sql: &str,
    who: Who<'_>,
    claim: &Claim,
    seen: Option<&KeyRecord>,
) -> Result<bool, tokio_postgres::Error> {
    let (at, lease) = (claim.created_at.to_string(), claim.lease_until.to_string());
    let state = seen.map(|s| s.state.name());
    let seen = seen.zip(state.as_ref());
    Ok(c.execute_typed(sql, &claim_args(&who, claim, [&at, &lease], seen)).await? == 1)
}

/// A claim's parameters: the key, the claim (its times as `times`), and the
/// version `seen` it replaces, if any.
fn claim_args<'a>(
    who: &'a Who<'a>,
    claim: &'a Claim,
    [at, lease]: [&'a String; 2],
    seen: Option<(&'a KeyRecord, &'a &'static str)>,
) -> Vec<Arg<'a>> {
    let mut args = who_args(who);
    args.extend([
        (&claim.fingerprint as &(dyn ToSql + Sync), Type::TEXT),
        (&claim.token, Type::TEXT),
        (at, Type::TEXT),
        (lease, Type::TEXT),
    ]);
    if let Some((seen, state)) = seen {
        args.extend([(&seen.token as &(dyn ToSql + Sync), Type::TEXT), (state, Type::TEXT)]);
    }
    args
}

/// Completes the key with `answer` (and what it keeps besides) at `at`,
/// only if `token` still holds it in progress.
pub(crate) async fn complete<C: GenericClient + Sync>(
    c: &C,
    t: &KeyTable,
    who: Who<'_>,
    token: &str,
    answer: &Stored,
    kept: &Kept,
    at: Timestamp,
) -> Result<bool, tokio_postgres::Error> {
    let (status, at) = (i32::from(answer.status), at.to_string());
    let reason = answer.reason.as_ref().map(ToString::to_string);
    let mut args = who_args(&who);
    args.extend([
        (&status as &(dyn ToSql + Sync), Type::INT4),
        (&reason, Type::TEXT),
        (&answer.body, Type::TEXT),
        (&answer.transfer_id, Type::INT8),
        (&at, Type::TEXT),
        (&token, Type::TEXT),
        (&kept.content_type, Type::TEXT),
        (&kept.headers, Type::TEXT),
        (&kept.body_bytes, Type::BYTEA),
    ]);
    Ok(c.execute_typed(&t.complete, &args).await? == 1)
}

/// Deletes up to `limit` keys created before `before`, oldest first,
/// sparing the claims in progress of `spared` (the engine's payouts).
pub(crate) async fn purge<C: GenericClient + Sync>(
    c: &C,
    t: &KeyTable,
    before: Timestamp,
    limit: u64,
    spared: &str,
) -> Result<u64, tokio_postgres::Error> {
    let (before, limit) = (before.to_string(), i64::try_from(limit).unwrap_or(i64::MAX));
    let args: [Arg; 3] = [(&before, Type::TEXT), (&limit, Type::INT8), (&spared, Type::TEXT)];
    c.execute_typed(&t.purge, &args).await
}

/// Runs the steps of `steps` that the table `versions` does not record yet,
/// in one transaction; concurrent start-ups are serialised by an advisory
/// lock, one for every idem table in the database (migrations are rare).
pub(crate) async fn migrate(
    client: &mut tokio_postgres::Client,
    versions: &str,
    steps: &[String],
) -> Result<(), tokio_postgres::Error> {
    let (tx, versions) = (client.transaction().await?, super::Versions(versions));
    tx.batch_execute(super::MIGRATION_LOCK).await?;
    tx.batch_execute(&versions.create()).await?;
    let at: i32 = tx.query_one(&versions.reached(), &[]).await?.get(0);
    for (n, step) in steps.iter().enumerate().skip(usize::try_from(at).unwrap_or(usize::MAX)) {
        tx.batch_execute(step).await?;
        tx.batch_execute(&versions.record(n + 1)).await?;
    }
    tx.commit().await
}
