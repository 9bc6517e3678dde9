//! Property storms: random days over a few clients, accounts and a tiny key
//! space — identical, reordered and re-spaced retries, amount-changed retries,
//! different keys with the same body, crashes at every point, races, purges,
//! bad bodies, expiries — run through the engine (SQLite, in memory) and
//! through a plain-map oracle. Every answer, every balance and the transfer
//! count must agree, and the invariants hold after every step.
//!
//! `PROPTEST_CASES` sets the number of days (256 by default; `just storm`
//! runs tens of thousands).

use crate::common::{Backend, backends, make_bank, store_with};
use crate::models::awaited::Awaited;
use crate::models::storm::{ACCOUNTS, op, run_day, run_day_on};
use idem::request::AcctId;
use proptest::prelude::*;

proptest! {
    #[test]
    fn engine_agrees_with_the_oracle_on_random_days(
        balances in prop::array::uniform::<_, ACCOUNTS>(0i64..2_000),
        ops in prop::collection::vec(op(), 1..40),
    ) {
        run_day(balances, ops)?;
    }
}

fn accounts(balances: &[i64; ACCOUNTS]) -> Vec<(AcctId, i64)> {
    balances.iter().enumerate().map(|(i, b)| (AcctId::Text(format!("acct-{i}")), *b)).collect()
}

proptest! {
    // Each PostgreSQL day makes a schema of its own: fewer, but the same days.
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn postgres_agrees_with_the_oracle_on_random_days(
        balances in prop::array::uniform::<_, ACCOUNTS>(0i64..2_000),
        ops in prop::collection::vec(op(), 1..40),
    ) {
        for backend in backends().into_iter().filter(|b| *b != Backend::Sqlite) {
            run_day_on(&mut store_with(backend, &accounts(&balances)), balances, ops.clone())?;
        }
    }
}

proptest! {
    // The conductor `idem serve` runs on PostgreSQL (async, on its pool).
    #![proptest_config(ProptestConfig::with_cases(32))]
    #[test]
    fn the_services_conductor_agrees_with_the_oracle_on_random_days(
        balances in prop::array::uniform::<_, ACCOUNTS>(0i64..2_000),
        ops in prop::collection::vec(op(), 1..40),
    ) {
        conductor_day(balances, ops, Awaited::connect)?;
    }
}

proptest! {
    // The same conductor with its claims and executions sent in batches.
    #![proptest_config(ProptestConfig::with_cases(32))]
    #[test]
    fn the_services_batches_agree_with_the_oracle_on_random_days(
        balances in prop::array::uniform::<_, ACCOUNTS>(0i64..2_000),
        ops in prop::collection::vec(op(), 1..40),
    ) {
        conductor_day(balances, ops, Awaited::batched)?;
    }
}

/// A day on the service's conductor, on a bank of its own per backend.
fn conductor_day(
    balances: [i64; ACCOUNTS],
    ops: Vec<crate::models::storm::Op>,
    engine: fn(&str) -> Awaited,
) -> Result<(), TestCaseError> {
    for backend in backends().into_iter().filter(|b| *b != Backend::Sqlite) {
        let rows: Vec<(serde_json::Value, i64)> =
            accounts(&balances).into_iter().map(|(id, b)| (serde_json::json!(id.to_string()), b)).collect();
        let dir = tempfile::tempdir().unwrap();
        let spec = make_bank(backend, dir.path(), &rows, false);
        run_day_on(&mut engine(&spec.to_string_lossy()), balances, ops.clone())?;
    }
    Ok(())
}
