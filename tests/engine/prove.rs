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
    let result = day::prove(a.path(), Policy::embedded(), &engine(), None).unwrap();
    day::prove(b.path(), Policy::embedded(), &engine(), None).unwrap();
    for name in day::PROVE_FILES {
        let (x, y) =
            (std::fs::read(a.path().join(name)).unwrap(), std::fs::read(b.path().join(name)).unwrap());
        assert!(x == y, "{name} differs between two runs");
    }
    assert_eq!((result.requests, result.transfers, result.keys_paid_twice), (120, 100, 0));
    assert!(result.double_paid_avoided > 0);
    assert_eq!(result.double_paid_avoided, result.v1_total - result.total_transferred);

    let mut settings = insta::Settings::clone_current();
    settings.set_snapshot_path("../../snapshots");
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
    day::prove(dir.path(), Policy::embedded(), &engine(), None).unwrap();
    let first = std::fs::read(dir.path().join("day.db")).unwrap();
    day::prove(dir.path(), Policy::embedded(), &engine(), None).unwrap();
    assert_eq!(std::fs::read(dir.path().join("day.db")).unwrap(), first);
}

/// The counts of `result.json` are those of the lab's seq-order replay:
/// checked here by an independent one, each `req_log` row in `seq` order
/// through its own `idem_api` process at its logged time.
#[test]
fn result_json_counts_equal_an_independent_seq_order_replay() {
    let dir = tempfile::tempdir().unwrap();
    let result = day::prove(dir.path(), Policy::embedded(), &engine(), None).unwrap();
    let log = rusqlite::Connection::open(dir.path().join("idem.db")).unwrap();
    let bank = dir.path().join("independent.db");
    let accounts: Vec<(String, String, i64)> = log
        .prepare("SELECT acct_id, holder, balance FROM account")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let conn = rusqlite::Connection::open(&bank).unwrap();
    conn.execute_batch("CREATE TABLE account (acct_id TEXT PRIMARY KEY, holder TEXT, balance INTEGER)")
        .unwrap();
    for a in &accounts {
        conn.execute("INSERT INTO account VALUES (?1, ?2, ?3)", (&a.0, &a.1, a.2)).unwrap();
    }
    let rows: Vec<(String, String)> = log
        .prepare("SELECT received_at, raw FROM req_log ORDER BY seq")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let (mut created, mut replayed, mut rejected) = (0, 0, 0);
    for (at, raw) in &rows {
        let file = dir.path().join("req.json");
        std::fs::write(&file, raw).unwrap();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_idem_api"))
            .arg("--db")
            .arg(&bank)
            .arg("--request")
            .arg(&file)
            .env("IDEM_NOW", at)
            .output()
            .unwrap();
        let answer: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        match (answer["status"].as_i64(), answer["replay"].as_bool()) {
            (_, Some(true)) => replayed += 1,
            (Some(201), _) => created += 1,
            _ => rejected += 1,
        }
    }
    assert_eq!(
        (result.requests, result.created, result.replayed, result.rejected),
        (rows.len() as i64, created, replayed, rejected)
    );
    let transfers: i64 = conn.query_row("SELECT COUNT(*) FROM transfer", [], |r| r.get(0)).unwrap();
    assert_eq!(result.transfers, transfers);
}

/// `req_log` keeps the raw text and carries what parses out of it as columns.
#[test]
fn req_log_carries_the_parsed_transfer_beside_the_raw_text() {
    let dir = tempfile::tempdir().unwrap();
    day::generate_at(&dir.path().join("idem.db")).unwrap();
    let log = rusqlite::Connection::open(dir.path().join("idem.db")).unwrap();
    let rows: Vec<(String, String, String, i64, String)> = log
        .prepare("SELECT raw, src, dst, amount, currency FROM req_log ORDER BY seq")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    assert_eq!(rows.len(), 120);
    for (raw, src, dst, amount, currency) in rows {
        let v: serde_json::Value = serde_json::from_str(&raw).unwrap();
        let body = &v["body"];
        assert_eq!((body["src"].as_str(), body["dst"].as_str()), (Some(src.as_str()), Some(dst.as_str())));
        assert_eq!(
            (body["amount"].as_i64(), body["currency"].as_str()),
            (Some(amount), Some(currency.as_str()))
        );
    }
    // and NULL where the raw text does not parse
    let log_one = |seq: i64, raw: &str| {
        log.execute(day::traffic::LOG_REQUEST, (seq, "t", "c", "/t", "k", "test", raw)).unwrap();
        let row: (Option<String>, Option<String>, Option<i64>, Option<String>) = log
            .query_row("SELECT src, dst, amount, currency FROM req_log WHERE seq = ?1", [seq], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
            })
            .unwrap();
        row
    };
    assert_eq!(log_one(1000, "{not json"), (None, None, None, None));
    assert_eq!(log_one(1001, r#"{"body":{"amount":"100"}}"#), (None, None, None, None));
}

/// The day on PostgreSQL: the same `result.json` and report as on SQLite,
/// the same-instant race raced there too; and never into a used database.
#[test]
fn prove_on_postgres_writes_the_same_result_as_on_sqlite() {
    let Some(server) = crate::common::pg::server() else { return };
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    day::prove(a.path(), Policy::embedded(), &engine(), None).unwrap();
    let spec = server.fresh_schema(false);
    day::prove(b.path(), Policy::embedded(), &engine(), Some(&idem::store::Db::parse(&spec))).unwrap();
    for name in ["result.json", "dup_report.json", "idem_report.md", "policy.json"] {
        let (x, y) =
            (std::fs::read(a.path().join(name)).unwrap(), std::fs::read(b.path().join(name)).unwrap());
        assert!(x == y, "{name} differs between SQLite and PostgreSQL");
    }
    let again = day::prove(b.path(), Policy::embedded(), &engine(), Some(&idem::store::Db::parse(&spec)))
        .unwrap_err();
    assert!(again.to_string().contains("needs an empty database"), "{again}");
}
