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
        assert_eq!(stdout.lines().filter(|l| l.starts_with("PASS  ")).count(), 13, "{stdout}");
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

/// Starts a server command (`idem serve` or a peer) on a fresh bank; returns
/// its URL and the child.
fn serve(program: &[&str], dir: &std::path::Path) -> (String, std::process::Child) {
    use std::io::BufRead;
    let db = dir.join("bank.db");
    let conn = rusqlite::Connection::open(&db).unwrap();
    conn.execute_batch(
        "CREATE TABLE account (acct_id TEXT PRIMARY KEY, holder TEXT, balance INTEGER);
         INSERT INTO account VALUES ('A', 'a', 1000000000), ('B', 'b', 0);",
    )
    .unwrap();
    let clients = dir.join("clients.json");
    std::fs::write(&clients, r#"{"tok-1": "shop-1", "tok-2": "shop-2"}"#).unwrap();
    let mut child = Command::new(program[0])
        .args(&program[1..])
        .arg("--db")
        .arg(&db)
        .args(["--listen", "127.0.0.1:0", "--clients"])
        .arg(&clients)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    (line.trim().to_owned(), child)
}

fn check_url(url: &str) -> (Option<i32>, Vec<String>, String) {
    let out = Command::new(IDEM)
        .args(["check", "--url", url, "--token", "tok-1", "--token", "tok-2", "--seed", "5"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let failed = stdout.lines().filter_map(|l| l.strip_prefix("FAIL  ")).map(String::from).collect();
    (out.status.code(), failed, stdout)
}

#[test]
fn check_url_passes_idem_serve_and_catches_a_server_that_keeps_no_keys() {
    let dir = tempfile::tempdir().unwrap();
    let (url, mut idem) = serve(&[IDEM, "serve"], dir.path());
    let (code, failed, stdout) = check_url(&url);
    idem.kill().unwrap();
    assert_eq!((code, failed.len()), (Some(0), 0), "{stdout}");

    let naive_dir = tempfile::tempdir().unwrap();
    let naive = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/peers/naive_server.py");
    let (url, mut child) = serve(&["python3", naive], naive_dir.path());
    let (code, failed, stdout) = check_url(&url);
    child.kill().unwrap();
    assert_eq!(code, Some(1), "{stdout}");
    for property in [
        "a retry replays the first answer byte for byte, and says so",
        "an answer lost after the commit is replayed on retry, not made again",
        "many connections at once with one key: one answer, the others in flight or its replay",
    ] {
        assert!(failed.iter().any(|f| f == property), "{property}: {stdout}");
    }
}
