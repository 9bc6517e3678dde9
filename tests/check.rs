//! `idem check --engine`: it passes idem, passes a careful engine written in
//! Python, and fails each deliberately naive one on the property its mistake
//! breaks, showing the steps.

use std::process::Command;

const IDEM: &str = env!("CARGO_BIN_EXE_idem");
const PEER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/peers/lab_engine.py");

/// Runs the check; returns (exit code, the FAIL lines).
fn check(engine: &str) -> (Option<i32>, Vec<String>, String) {
    let out = Command::new(IDEM).args(["check", "--engine", engine, "--seed", "11"]).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let failed = stdout.lines().filter_map(|l| l.strip_prefix("FAIL  ")).map(String::from).collect();
    (out.status.code(), failed, stdout)
}

#[test]
fn idem_api_and_a_careful_python_engine_pass_every_property() {
    for engine in [env!("CARGO_BIN_EXE_idem_api").to_string(), format!("python3 {PEER}")] {
        let (code, failed, stdout) = check(&engine);
        assert_eq!((code, failed.len()), (Some(0), 0), "{engine}:\n{stdout}");
        assert_eq!(stdout.lines().filter(|l| l.starts_with("PASS  ")).count(), 12, "{stdout}");
    }
}

#[test]
fn each_naive_engine_fails_the_property_its_mistake_breaks() {
    for (mistake, property) in [
        ("lookup", "processes released together on one key pay once"),
        ("recompute", "a retry replays the first answer byte for byte"),
        ("global", "keys are scoped by client: one key string, two clients, two transfers"),
    ] {
        let (code, failed, stdout) = check(&format!("python3 {PEER} --mistake {mistake}"));
        assert_eq!(code, Some(1), "{stdout}");
        assert!(failed.iter().any(|f| f == property), "{mistake}: {stdout}");
        // the failure shows the requests that show it
        let steps = stdout.split(&format!("FAIL  {property}")).nth(1).unwrap_or("");
        assert!(
            steps
                .lines()
                .nth(1)
                .is_some_and(|l| l.trim_start().starts_with("send") || l.contains("processes")),
            "{stdout}"
        );
    }
}
