//! Secrets stay secret: no error of the engine quotes the connection string
//! or its password. A wrong password, an unreachable server and a malformed
//! URL each give exit 5 and one clear line that names neither.

use crate::common::*;
use std::process::Command;

fn refused(db: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let req = dir.path().join("r.json");
    let text = request("c", "/t", "k", &serde_json::json!("A"), &serde_json::json!("B"), 1);
    std::fs::write(&req, text).unwrap();
    let out = Command::new(API).args(["--db", db, "--request"]).arg(&req).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!((out.status.code(), out.stdout.is_empty()), (Some(5), true), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    stderr
}

#[test]
fn a_wrong_password_gives_one_line_without_the_password_or_the_connection_string() {
    let Some(server) = pg::server() else { return };
    let spec = server.fresh_schema(false);
    pg::execute(&spec, "CREATE TABLE account (acct_id text PRIMARY KEY, holder text, balance bigint)");
    let Some(wrong) = server.as_password_role(&spec, "Wr0ng-Secret-Value") else { return };
    let line = refused(&wrong);
    assert!(line.contains("password authentication failed"), "{line}");
    for secret in ["Wr0ng-Secret-Value", &wrong, "host="] {
        assert!(!line.contains(secret), "{line}");
    }
    // the right password gets through the same door
    let right = server.as_password_role(&spec, pg::PASSWORD).unwrap();
    assert!(postgres::Client::connect(&right, postgres::NoTls).is_ok());
}

#[test]
fn unreachable_servers_and_malformed_urls_name_no_secret() {
    let cases = [
        "postgresql://alice:Hunter2-Secret@127.0.0.1:1/bank?connect_timeout=2",
        "postgres://alice:Hunter2-Secret@127.0.0.1:notaport/bank",
        "host=/nonexistent/socket/dir user=alice password=Hunter2-Secret dbname=bank",
        "postgresql://alice:Hunter2-Secret@/bank?host=/nonexistent&sslmode=bogus",
    ];
    for db in cases {
        let line = refused(db);
        assert!(!line.contains("Hunter2-Secret") && !line.contains("alice"), "{db}: {line}");
        assert!(line.contains("PostgreSQL") || line.contains("connection string"), "{db}: {line}");
    }
}
