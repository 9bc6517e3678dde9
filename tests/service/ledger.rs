//! `examples/ledger.rs`, a service of its own schema made idempotent by
//! `idem::embed::layer`, judged by `idem check --url` as anyone's service
//! is: every property passes, under the open profile and under one that
//! declares the layer's choices.

use crate::common::pg;
use std::io::BufRead;
use std::process::{Command, Stdio};

const PEERS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/peers");

/// `target/release/examples/ledger`, which `cargo test` builds beside the
/// tests (`cargo test --test service` alone does not: after a change to the
/// example or the layer, build it with `cargo build --release --example ledger`).
fn example() -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().join("examples").join("ledger")
}

/// Runs the example on `db` and `idem check --url` on it, under the open
/// profile and the one declaring the layer's choices.
fn check_the_ledger(db: &str) {
    let dir = tempfile::tempdir().unwrap();
    let clients = dir.path().join("clients.json");
    std::fs::write(&clients, r#"{"tok-1": "shop-1", "tok-2": "shop-2", "tok-1b": "shop-1"}"#).unwrap();
    let mut child = Command::new(example())
        .args(["--db", db, "--clients"])
        .arg(&clients)
        .args(["--accounts", "A=1000000000,B=0,D=800"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut url = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap()).read_line(&mut url).unwrap();
    let check = |profile: &str| {
        Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(["check", "--url", url.trim(), "--token", "tok-1", "--token", "tok-2", "--token", "tok-1b"])
            .args(["--profile", &format!("{PEERS}/{profile}"), "--seed", "3"])
            .output()
            .unwrap()
    };
    let open = check("service.json");
    let declared = check("layer-declared.json");
    child.kill().unwrap();
    child.wait().unwrap();
    for out in [open, declared] {
        let text = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(0), "{db}:\n{text}{}", String::from_utf8_lossy(&out.stderr));
        assert!(text.contains("15 passed, 0 failed"), "{db}:\n{text}");
    }
}

#[test]
fn the_example_ledger_passes_idem_check_through_the_layer_on_postgres() {
    let Some(server) = pg::server() else { return };
    check_the_ledger(&server.fresh_schema(false));
}

#[test]
fn the_example_ledger_passes_idem_check_through_the_layer_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    check_the_ledger(&dir.path().join("ledger.db").display().to_string());
}
