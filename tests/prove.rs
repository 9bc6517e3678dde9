//! `idem prove`: the six files, byte-identical on every run, with the
//! reviewed outputs pinned as snapshots in `snapshots/`.

use idem::harness::day;
use idem::policy::Policy;

fn engine() -> Vec<String> {
    vec![env!("CARGO_BIN_EXE_idem_api").to_string()]
}

#[test]
fn prove_is_deterministic_and_matches_the_snapshots() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let result = day::prove(a.path(), Policy::embedded(), &engine()).unwrap();
    day::prove(b.path(), Policy::embedded(), &engine()).unwrap();
    for name in day::PROVE_FILES {
        let (x, y) =
            (std::fs::read(a.path().join(name)).unwrap(), std::fs::read(b.path().join(name)).unwrap());
        assert!(x == y, "{name} differs between two runs");
    }
    assert_eq!((result.requests, result.transfers, result.keys_paid_twice), (120, 100, 0));
    assert!(result.double_paid_avoided > 0);
    assert_eq!(result.double_paid_avoided, result.v1_total - result.total_transferred);

    let mut settings = insta::Settings::clone_current();
    settings.set_snapshot_path("../snapshots");
    settings.set_prepend_module_to_snapshot(false);
    settings.bind(|| {
        for name in ["result.json", "dup_report.json", "idem_report.md"] {
            let text = std::fs::read_to_string(a.path().join(name)).unwrap();
            insta::assert_snapshot!(format!("prove_{name}"), text);
        }
    });
}

#[test]
fn prove_overwrites_its_own_outputs() {
    let dir = tempfile::tempdir().unwrap();
    day::prove(dir.path(), Policy::embedded(), &engine()).unwrap();
    let first = std::fs::read(dir.path().join("day.db")).unwrap();
    day::prove(dir.path(), Policy::embedded(), &engine()).unwrap();
    assert_eq!(std::fs::read(dir.path().join("day.db")).unwrap(), first);
}
