//! Runs every `scenarios/*.scn` file and snapshots its transcript into
//! `snapshots/`: the transcript holds every answer, so the snapshot pins the
//! replayed bytes across runs and releases.

use crate::common::{Backend, backends, store_with};
use std::path::Path;

#[test]
fn every_scenario_holds_and_its_answers_match_the_snapshot() {
    let dir = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/..")).join("scenarios");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "scn"))
        .collect();
    files.sort();
    assert!(files.len() >= 15, "only {} scenario files in {}", files.len(), dir.display());
    let mut settings = insta::Settings::clone_current();
    settings.set_snapshot_path("../../snapshots");
    settings.set_prepend_module_to_snapshot(false);
    settings.bind(|| {
        for file in files {
            let name = file.file_stem().unwrap().to_string_lossy().into_owned();
            let text = std::fs::read_to_string(&file).unwrap();
            let scenario = idem::harness::scenario::parse(&text).unwrap_or_else(|f| panic!("{name}: {f}"));
            let policy = idem::policy::Policy::embedded();
            let transcript = idem::harness::scenario::run(&scenario, policy)
                .unwrap_or_else(|f| panic!("scenario {name} failed:\n{f}"));
            // Every store gives the same answers, byte for byte.
            for backend in backends().into_iter().filter(|b| *b != Backend::Sqlite) {
                let mut store = store_with(backend, &scenario.accounts);
                let got = idem::harness::scenario::run_on(&scenario, policy, &mut store)
                    .unwrap_or_else(|f| panic!("scenario {name} failed on {backend:?}:\n{f}"));
                let same = renumbered(&got) == renumbered(&transcript);
                assert!(
                    same,
                    "scenario {name}: {backend:?} answered otherwise than SQLite:\n{got}\n---\n{transcript}"
                );
            }
            insta::assert_snapshot!(format!("scenario_{name}"), transcript);
        }
    });
}

#[test]
fn a_wrong_expectation_fails_with_the_line_and_both_answers() {
    let text = "accounts A=10 B=0\nsend c /t k A->B 1 => 201\nsend c /t k A->B 1 => 201\n";
    let failure = idem::harness::scenario::run(
        &idem::harness::scenario::parse(text).unwrap(),
        idem::policy::Policy::embedded(),
    )
    .unwrap_err();
    assert_eq!(failure.line, 3);
    assert!(failure.message.contains("expected 201") && failure.message.contains("\"replay\":true"));
}

#[test]
fn malformed_scenarios_are_rejected_with_their_line() {
    for (text, line) in [
        ("send c /t k A->B 1 => 201", 1),
        ("accounts A=1\nsend c /t k A->B => 201", 2),
        ("accounts A=1\ntogether\nsend c /t k A->B 1 => 201\n", 2),
        ("accounts A=1\nfrobnicate", 2),
        ("accounts A=1\nat yesterday", 2),
    ] {
        assert_eq!(idem::harness::scenario::parse(text).unwrap_err().line, line, "{text}");
    }
}

/// The transcript with transfer ids numbered by first appearance: a
/// PostgreSQL identity keeps no promise of gaplessness (a rolled-back
/// execution spends its id), SQLite's rowid does; nothing else may differ.
fn renumbered(transcript: &str) -> String {
    let mut seen: Vec<String> = Vec::new();
    let mut out = String::new();
    let mut rest = transcript;
    while let Some(at) = rest.find("\"transfer_id\":") {
        let (head, tail) = rest.split_at(at + "\"transfer_id\":".len());
        let digits: String = tail.chars().take_while(char::is_ascii_digit).collect();
        let n = seen.iter().position(|d| *d == digits).unwrap_or_else(|| {
            seen.push(digits.clone());
            seen.len() - 1
        });
        out.push_str(head);
        out.push_str(&format!("#{n}"));
        rest = &tail[digits.len()..];
    }
    out + rest
}
