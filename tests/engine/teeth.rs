//! Teeth: each classic mistake of this lab, written as a broken engine of its
//! own (`tests/engine/models/broken.rs`), must turn the harness red. For each one it
//! runs every scenario, a property storm and the loom model, and prints which
//! of them caught it (`cargo test --release --test engine teeth:: -- --nocapture`).

use crate::models::broken::{Broken, Mistake};
use crate::models::loom_claim::{race, race_with};
use crate::models::loom_rows::race_rows;
use crate::models::storm::{ACCOUNTS, op, run_day, run_day_on};
use idem::harness::scenario;
use idem::policy::Policy;
use idem::request::AcctId;
use idem::store::bank::in_memory as sqlite_bank;
use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence, RngAlgorithm, TestRng, TestRunner};
use std::path::Path;

fn scenarios() -> Vec<(String, scenario::Scenario)> {
    let dir = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/..")).join("scenarios");
    let mut files: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.retain(|p| p.extension().is_some_and(|e| e == "scn"));
    files.sort();
    let parsed = files.iter().map(|f| {
        let name = f.file_stem().unwrap().to_string_lossy().into_owned();
        (name, scenario::parse(&std::fs::read_to_string(f).unwrap()).unwrap())
    });
    parsed.collect()
}

/// The scenarios that fail on the engine (`None`: the real one).
fn failing_scenarios(mistake: Option<Mistake>) -> Vec<String> {
    let policy = Policy::embedded();
    let all = scenarios();
    assert!(all.len() >= 15, "only {} scenarios", all.len());
    all.into_iter()
        .filter(|(_, s)| {
            let store = sqlite_bank(&s.accounts, policy).unwrap();
            match mistake {
                None => scenario::run(s, policy).is_err(),
                Some(mistake) => scenario::run_on(s, policy, &mut Broken { store, mistake }).is_err(),
            }
        })
        .map(|(name, _)| name)
        .collect()
}

/// The storm's verdict: `Some(minimal failing day)` if it caught the engine.
///
/// The runner is seeded, so the same days are tried on every run, and every
/// day that broke an engine is saved to `tests/engine/storm.proptest-regressions`,
/// which the storm (`tests/engine/storm.rs`) replays first against the real engine
/// on every `cargo test`.
fn storm_catches(mistake: Option<Mistake>, cases: u32) -> Option<String> {
    let persistence = FileFailurePersistence::Direct(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/engine/storm.proptest-regressions"
    ));
    let config = Config { cases, failure_persistence: Some(Box::new(persistence)), ..Config::default() };
    let mut runner = TestRunner::new_with_rng(config, TestRng::deterministic_rng(RngAlgorithm::ChaCha));
    let strategy = (prop::array::uniform::<_, ACCOUNTS>(0i64..2_000), prop::collection::vec(op(), 1..40));
    let verdict = runner.run(&strategy, |(balances, ops)| match mistake {
        None => run_day(balances, ops),
        Some(mistake) => {
            let accounts: Vec<(AcctId, i64)> =
                balances.iter().enumerate().map(|(i, b)| (AcctId::Text(format!("acct-{i}")), *b)).collect();
            let store = sqlite_bank(&accounts, Policy::embedded()).unwrap();
            run_day_on(&mut Broken { store, mistake }, balances, ops)
        }
    });
    verdict.err().map(|e| e.to_string())
}

/// Whether the loom model (two racers, then two with one dying) panics.
fn loom_catches(mistake: Option<Mistake>) -> bool {
    let quiet = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let run = |crashes: &'static [bool]| match mistake {
        None => std::panic::catch_unwind(|| race(crashes)).is_err(),
        Some(mistake) => {
            std::panic::catch_unwind(|| race_with(crashes, move |store| Broken { store, mistake })).is_err()
        }
    };
    let caught = run(&[false, false]) || run(&[true, false]);
    std::panic::set_hook(quiet);
    caught
}

/// Whether the row-lock model (one key raced; opposite transfers) fails.
/// A deadlock makes loom abort the process rather than unwind, so the model
/// runs in a child process: this test binary, filtered to [`row_locks_probe`].
fn row_locks_catch(mistake: Option<Mistake>) -> bool {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["teeth::row_locks_probe", "--exact", "--quiet", "--test-threads=1"])
        .env("IDEM_ROW_LOCKS_PROBE", mistake.map_or("real".into(), |m| format!("{m:?}")))
        .output()
        .unwrap();
    !out.status.success()
}

/// Runs the row-lock model on the engine `IDEM_ROW_LOCKS_PROBE` names; a
/// no-op without it (so a plain `cargo test` passes through).
#[test]
fn row_locks_probe() {
    let Ok(name) = std::env::var("IDEM_ROW_LOCKS_PROBE") else { return };
    let mistake = Mistake::ALL.into_iter().find(|m| format!("{m:?}") == name);
    for racers in [&[("k", "A", "B", 30), ("k", "A", "B", 30)], &[("k1", "A", "B", 30), ("k2", "B", "A", 20)]]
    {
        match mistake {
            None => race_rows(racers, |store| store),
            Some(mistake) => race_rows(racers, move |store| Broken { store, mistake }),
        }
    }
}

#[test]
fn every_broken_engine_is_caught() {
    assert_eq!(failing_scenarios(None), Vec::<String>::new(), "the real engine must pass");
    assert_eq!(storm_catches(None, 64), None, "the real engine must pass");
    assert!(!loom_catches(None), "the real engine must pass");
    assert!(!row_locks_catch(None), "the real engine must pass");

    let mut caught = 0;
    let mut table = String::from(
        "| broken engine | scenarios that fail | storm | loom | loom, row locks |\n|---|---|---|---|---|\n",
    );
    for mistake in Mistake::ALL {
        let scenarios = failing_scenarios(Some(mistake));
        let storm = storm_catches(Some(mistake), 2_000);
        let loom = loom_catches(Some(mistake));
        let rows = row_locks_catch(Some(mistake));
        if !scenarios.is_empty() || storm.is_some() || loom || rows {
            caught += 1;
        }
        let word = |hit: bool| if hit { "caught" } else { "missed" };
        table.push_str(&format!(
            "| {mistake:?} | {} ({}) | {} | {} | {} |\n",
            scenarios.len(),
            scenarios.join(", "),
            word(storm.is_some()),
            word(loom),
            word(rows)
        ));
        if let Some(counterexample) = storm {
            eprintln!("{mistake:?}: storm counterexample:\n{counterexample}\n");
        }
    }
    println!("{table}\ncaught {caught} / {}", Mistake::ALL.len());
    assert_eq!(caught, Mistake::ALL.len(), "{table}");
}
