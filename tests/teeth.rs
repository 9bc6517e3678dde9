//! Teeth: each classic mistake of this lab, switched on in turn, must turn
//! the suite red. Runs with `cargo test --release --features teeth --test teeth`
//! (CI does). For each broken variant it runs every scenario and a property
//! storm, and prints which of them caught it.
#![cfg(feature = "teeth")]

mod common;

use common::loom_model::race;
use common::storm::{ACCOUNTS, op, run_day};
use idem::policy::Policy;
use idem::teeth::{self, Broken};
use proptest::prelude::*;
use proptest::test_runner::{Config, FileFailurePersistence, RngAlgorithm, TestRng, TestRunner};
use std::path::Path;

fn failing_scenarios() -> Vec<String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios");
    let mut files: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
    files.retain(|p| p.extension().is_some_and(|e| e == "scn"));
    files.sort();
    files
        .iter()
        .filter(|f| {
            let scenario = idem::scenario::parse(&std::fs::read_to_string(f).unwrap()).unwrap();
            idem::scenario::run(&scenario, Policy::embedded()).is_err()
        })
        .map(|f| f.file_stem().unwrap().to_string_lossy().into_owned())
        .collect()
}

/// The storm's verdict: `Some(minimal failing day)` if it caught the engine.
///
/// The runner is seeded, so the same days are tried on every run, and every
/// day that broke an engine is saved to `tests/storm.proptest-regressions`,
/// which the storm (`tests/storm.rs`) replays first against the real engine
/// on every `cargo test`.
fn storm_catches(cases: u32) -> Option<String> {
    let persistence = FileFailurePersistence::Direct("tests/storm.proptest-regressions");
    let config = Config { cases, failure_persistence: Some(Box::new(persistence)), ..Config::default() };
    let mut runner = TestRunner::new_with_rng(config, TestRng::deterministic_rng(RngAlgorithm::ChaCha));
    let strategy = (prop::array::uniform::<_, ACCOUNTS>(0i64..2_000), prop::collection::vec(op(), 1..40));
    runner.run(&strategy, |(balances, ops)| run_day(balances, ops)).err().map(|e| e.to_string())
}

/// Whether the loom model (two racers, then two with one dying) panics.
fn loom_catches() -> bool {
    let quiet = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let caught = std::panic::catch_unwind(|| race(&[false, false])).is_err()
        || std::panic::catch_unwind(|| race(&[true, false])).is_err();
    std::panic::set_hook(quiet);
    caught
}

#[test]
fn every_broken_engine_is_caught() {
    teeth::set(None);
    assert_eq!(failing_scenarios(), Vec::<String>::new(), "the real engine must pass");
    assert_eq!(storm_catches(64), None, "the real engine must pass");
    assert!(!loom_catches(), "the real engine must pass");

    let mut caught = 0;
    let mut table =
        String::from("| broken variant | scenarios that fail | storm | loom |\n|---|---|---|---|\n");
    for variant in Broken::ALL {
        teeth::set(Some(variant));
        let scenarios = failing_scenarios();
        let storm = storm_catches(2_000);
        let loom = loom_catches();
        teeth::set(None);
        if !scenarios.is_empty() || storm.is_some() || loom {
            caught += 1;
        }
        let word = |hit: bool| if hit { "caught" } else { "missed" };
        table.push_str(&format!(
            "| {variant:?} | {} ({}) | {} | {} |\n",
            scenarios.len(),
            scenarios.join(", "),
            word(storm.is_some()),
            word(loom)
        ));
        if let Some(counterexample) = storm {
            eprintln!("{variant:?}: storm counterexample:\n{counterexample}\n");
        }
    }
    println!("{table}\ncaught {caught} / {}", Broken::ALL.len());
    assert_eq!(caught, Broken::ALL.len(), "{table}");
}
