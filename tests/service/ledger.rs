//! `examples/ledger.rs`, a service of its own schema made idempotent by
//! `idem::embed::layer`, judged by `idem check --url` as anyone's service
//! is: every property passes, under the open profile and under one that
//! declares the layer's choices.

use crate::common::pg;
use std::io::BufRead;
use std::process::{Command, Stdio};

const PEERS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/peers");

/// `target/release/examples/ledger`, which `cargo test` builds beside the tests.
fn example() -> std::path::PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().join("examples").join("ledger")
}

#[test]
fn the_example_ledger_passes_idem_check_through_the_layer() {
    let Some(server) = pg::server() else { return };
    let spec = server.fresh_schema(false);
    let dir = tempfile::tempdir().unwrap();
    let clients = dir.path().join("clients.json");
    std::fs::write(&clients, r#"{"tok-1": "shop-1", "tok-2": "shop-2", "tok-1b": "shop-1"}"#).unwrap();
    let mut child = Command::new(example())
        .args(["--db", &spec, "--clients"])
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
        assert_eq!(out.status.code(), Some(0), "{text}{}", String::from_utf8_lossy(&out.stderr));
        assert!(text.contains("0 failed"), "{text}");
    }
}
