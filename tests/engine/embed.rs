//! The library face (`idem::embed`) on both stores, each test asserting
//! what a key table written beside the work (not in its transaction) gets
//! wrong: the caller's writes and the key commit together or not at all.

use crate::common::pg;
use idem::embed::{Answer, Error, Keys, Reply, Scope};

/// The caller's own schema: nothing of idem's `account`.
const LEDGER: &str = "CREATE TABLE wallet (owner TEXT PRIMARY KEY, cents BIGINT NOT NULL);
                      INSERT INTO wallet VALUES ('ann', 1000), ('bob', 0);
                      CREATE TABLE movement (id INTEGER PRIMARY KEY, cents BIGINT NOT NULL)";

fn sqlite() -> (idem::embed::sqlite::Connection, Keys) {
    let db = idem::embed::sqlite::Connection::open_in_memory().unwrap();
    db.execute_batch(LEDGER).unwrap();
    let keys = Keys::new("shop_").unwrap();
    keys.migrate_sqlite(&db).unwrap();
    keys.migrate_sqlite(&db).unwrap(); // a second start-up changes nothing
    (db, keys)
}

/// The refusal of a payment ann cannot make: a stored business answer, in
/// a media type of its own that its replays must keep.
fn funds_refusal() -> Answer {
    Answer::new(402, r#"{"refused":"funds"}"#).content_type("application/problem+json")
}

/// Pays `cents` from ann to bob, refusing (a stored business answer) what
/// ann cannot pay, failing (an error) a payment of 13.
fn pay_sqlite(cents: i64) -> impl Fn(&rusqlite::Transaction<'_>) -> Result<Answer, String> {
    move |tx| {
        if cents == 13 {
            tx.execute("UPDATE wallet SET cents = cents - 13 WHERE owner = 'ann'", []).unwrap();
            return Err("unlucky".into());
        }
        let moved = tx
            .execute("UPDATE wallet SET cents = cents - ?1 WHERE owner = 'ann' AND cents >= ?1", [cents])
            .map_err(|e| e.to_string())?;
        if moved == 0 {
            return Ok(funds_refusal());
        }
        tx.execute("UPDATE wallet SET cents = cents + ?1 WHERE owner = 'bob'", [cents])
            .map_err(|e| e.to_string())?;
        tx.execute("INSERT INTO movement (cents) VALUES (?1)", [cents]).map_err(|e| e.to_string())?;
        Ok(Answer::new(201, format!(r#"{{"movement":{},"cents":{cents}}}"#, tx.last_insert_rowid()))
            .content_type("application/json"))
    }
}

fn ann_bob_sqlite(db: &rusqlite::Connection) -> (i64, i64, i64) {
    db.query_row(
        "SELECT (SELECT cents FROM wallet WHERE owner='ann'), (SELECT cents FROM wallet WHERE owner='bob'), \
         (SELECT count(*) FROM movement)",
        [],
        |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
    )
    .unwrap()
}

#[test]
fn sqlite_a_retry_replays_and_another_body_is_refused() {
    let (mut db, keys) = sqlite();
    let me = Scope::new("c1", "POST /pay");
    let first = keys.run_sqlite(&mut db, &me, "k1", r#"{"cents":100}"#, pay_sqlite(100)).unwrap();
    let Reply::Fresh(answer) = &first else { panic!("{first:?}") };
    // reordered, re-spaced, the same request: the stored bytes, the work not run again
    let again = keys.run_sqlite(&mut db, &me, "k1", r#"{ "cents" : 100 }"#, pay_sqlite(100)).unwrap();
    assert_eq!(again, Reply::Replayed(answer.clone()));
    let other = keys.run_sqlite(&mut db, &me, "k1", r#"{"cents":200}"#, pay_sqlite(200)).unwrap();
    assert_eq!(other, Reply::Mismatch);
    // another client's k1 is its own key
    let theirs =
        keys.run_sqlite(&mut db, &Scope::new("c2", "POST /pay"), "k1", r#"{"cents":100}"#, pay_sqlite(100));
    assert!(matches!(theirs, Ok(Reply::Fresh(_))));
    assert_eq!(ann_bob_sqlite(&db), (800, 200, 2));
}

#[test]
fn sqlite_a_failed_work_rolls_back_with_its_claim_and_a_refusal_is_stored() {
    let (mut db, keys) = sqlite();
    let me = Scope::new("c1", "POST /pay");
    let failed = keys.run_sqlite(&mut db, &me, "k", r#"{"cents":13}"#, pay_sqlite(13));
    assert!(matches!(failed, Err(Error::Work(ref e)) if e == "unlucky"), "{failed:?}");
    assert_eq!(ann_bob_sqlite(&db), (1000, 0, 0), "the failed work's write rolled back");
    // the key is free: the same key, another body, runs
    let ok = keys.run_sqlite(&mut db, &me, "k", r#"{"cents":5}"#, pay_sqlite(5)).unwrap();
    assert!(matches!(ok, Reply::Fresh(ref a) if a.status == 201), "{ok:?}");
    let refused = keys.run_sqlite(&mut db, &me, "poor", r#"{"cents":5000}"#, pay_sqlite(5000)).unwrap();
    assert_eq!(refused, Reply::Fresh(funds_refusal()));
    // money arrives; the retry still gets the stored refusal, not a payment
    db.execute("UPDATE wallet SET cents = 99999 WHERE owner = 'ann'", []).unwrap();
    let again = keys.run_sqlite(&mut db, &me, "poor", r#"{"cents":5000}"#, pay_sqlite(5000)).unwrap();
    assert_eq!(again, Reply::Replayed(funds_refusal()));
    assert!(matches!(keys.run_sqlite(&mut db, &me, "", "{}", pay_sqlite(1)), Err(Error::Key)));
    assert!(matches!(keys.run_sqlite(&mut db, &me, "x", "{nope", pay_sqlite(1)), Err(Error::Body(_))));
}

/// A key table as versions 1 and 2 of the library left it, with a completed
/// key (`old`) and a claim committed without its answer (`stuck`, what a
/// request abandoned mid-transaction left behind before the layer ended
/// its transactions).
const VERSION_1: &str = "
    CREATE TABLE shop_idem_schema (version INTEGER NOT NULL);
    INSERT INTO shop_idem_schema VALUES (1);
    CREATE TABLE shop_idem_keys (client_id TEXT NOT NULL, endpoint TEXT NOT NULL, idem_key TEXT NOT NULL,
        fingerprint TEXT NOT NULL, created_at TEXT NOT NULL, status INTEGER, body TEXT,
        PRIMARY KEY (client_id, endpoint, idem_key));
    INSERT INTO shop_idem_keys VALUES
        ('c1', 'POST /pay', 'old', '{old}', '{now}', 201, '{\"movement\":7}'),
        ('c1', 'POST /pay', 'stuck', '{stuck}', '{now}', NULL, NULL)";

/// [`VERSION_1`], with the fingerprints of `{"cents":1}` and `{"cents":2}`.
fn version_1() -> String {
    let fp = |body: &str| idem::canonical::fingerprint(&idem::canonical::Json::parse(body).unwrap());
    VERSION_1
        .replace("{old}", &fp(r#"{"cents":1}"#))
        .replace("{stuck}", &fp(r#"{"cents":2}"#))
        .replace("{now}", &idem::clock::Timestamp::now().to_string())
}

#[test]
fn sqlite_a_key_table_of_version_1_is_upgraded_to_the_engines_shape() {
    let db = idem::embed::sqlite::Connection::open_in_memory().unwrap();
    db.execute_batch(LEDGER).unwrap();
    db.execute_batch(&version_1()).unwrap();
    let mut db = db;
    let keys = Keys::new("shop_").unwrap();
    keys.migrate_sqlite(&db).unwrap();
    keys.migrate_sqlite(&db).unwrap(); // a second start-up changes nothing
    let me = Scope::new("c1", "POST /pay");
    // the completed key replays, as JSON (it was stored before the media type)
    let again = keys.run_sqlite(&mut db, &me, "old", r#"{"cents":1}"#, pay_sqlite(1)).unwrap();
    assert_eq!(again, Reply::Replayed(Answer::new(201, r#"{"movement":7}"#)));
    // the answerless claim is free: its retry pays, once
    let stuck = keys.run_sqlite(&mut db, &me, "stuck", r#"{"cents":2}"#, pay_sqlite(2)).unwrap();
    assert!(matches!(stuck, Reply::Fresh(Answer { status: 201, .. })), "{stuck:?}");
    let next = keys.run_sqlite(&mut db, &me, "stuck", r#"{"cents":2}"#, pay_sqlite(2)).unwrap();
    assert!(matches!(next, Reply::Replayed(Answer { content_type: Some(_), .. })), "{next:?}");
    assert_eq!(ann_bob_sqlite(&db), (998, 2, 1));
    let (state, versions): (String, i64) = db
        .query_row(
            "SELECT (SELECT group_concat(state) FROM shop_idem_keys), (SELECT max(version) FROM shop_idem_schema)",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!((state.as_str(), versions), ("completed,completed", 6));
    // version 6: the outside calls' table, empty
    let calls: i64 = db.query_row("SELECT count(*) FROM shop_idem_calls", [], |r| r.get(0)).unwrap();
    assert_eq!(calls, 0);
    // version 4's `headers`: an answer's Location is replayed with it
    let located = |tx: &idem::embed::sqlite::Transaction<'_>| {
        pay_sqlite(3)(tx).map(|a| a.header("Location", "/movements/9"))
    };
    let first = keys.run_sqlite(&mut db, &me, "located", r#"{"cents":3}"#, located).unwrap();
    let again = keys.run_sqlite(&mut db, &me, "located", r#"{"cents":3}"#, located).unwrap();
    let (Reply::Fresh(first), Reply::Replayed(again)) = (first, again) else {
        panic!("fresh, then replayed")
    };
    assert_eq!(again, first);
    assert_eq!(again.headers, [("Location".to_owned(), "/movements/9".to_owned())]);
}

#[test]
fn sqlite_a_key_past_retention_is_new_again() {
    let (mut db, keys) = sqlite();
    let me = Scope::new("c1", "POST /pay");
    keys.run_sqlite(&mut db, &me, "old", r#"{"cents":1}"#, pay_sqlite(1)).unwrap();
    db.execute(&format!("UPDATE {} SET created_at = '2020-01-01T00:00:00Z'", keys.table()), []).unwrap();
    let later = keys.run_sqlite(&mut db, &me, "old", r#"{"cents":2}"#, pay_sqlite(2)).unwrap();
    assert!(matches!(later, Reply::Fresh(ref a) if a.text().unwrap().contains(r#""cents":2"#)), "{later:?}");
}

#[test]
fn sqlite_racing_connections_on_one_key_pay_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shop.db");
    let keys = {
        let db = rusqlite::Connection::open(&path).unwrap();
        db.execute_batch(&format!("PRAGMA journal_mode=WAL; {LEDGER}")).unwrap();
        let keys = Keys::new("").unwrap();
        keys.migrate_sqlite(&db).unwrap();
        keys
    };
    let replies: Vec<Reply> = std::thread::scope(|s| {
        let runs: Vec<_> = (0..8)
            .map(|_| {
                s.spawn(|| {
                    let mut db = rusqlite::Connection::open(&path).unwrap();
                    db.busy_timeout(std::time::Duration::from_secs(10)).unwrap();
                    keys.run_sqlite(
                        &mut db,
                        &Scope::new("c", "POST /pay"),
                        "race",
                        r#"{"cents":7}"#,
                        pay_sqlite(7),
                    )
                    .unwrap()
                })
            })
            .collect();
        runs.into_iter().map(|r| r.join().unwrap()).collect()
    });
    assert_eq!(replies.iter().filter(|r| matches!(r, Reply::Fresh(_))).count(), 1, "{replies:?}");
    assert!(replies.iter().all(|r| matches!(r, Reply::Fresh(_) | Reply::Replayed(_))), "{replies:?}");
    assert_eq!(ann_bob_sqlite(&rusqlite::Connection::open(&path).unwrap()), (993, 7, 1));
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap()
}

async fn pg_client(spec: &str) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(spec, tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(conn);
    client
}

async fn pay_pg(tx: &tokio_postgres::Transaction<'_>, cents: i64) -> Result<Answer, String> {
    let e = |e: tokio_postgres::Error| e.to_string();
    if cents == 13 {
        tx.execute("UPDATE wallet SET cents = cents - 13 WHERE owner = 'ann'", &[]).await.map_err(e)?;
        return Err("unlucky".into());
    }
    let moved = tx
        .execute("UPDATE wallet SET cents = cents - $1 WHERE owner = 'ann' AND cents >= $1", &[&cents])
        .await
        .map_err(e)?;
    if moved == 0 {
        return Ok(funds_refusal());
    }
    tx.execute("UPDATE wallet SET cents = cents + $1 WHERE owner = 'bob'", &[&cents]).await.map_err(e)?;
    let id: i32 = tx
        .query_one(
            "INSERT INTO movement (id, cents) VALUES ((SELECT count(*) + 1 FROM movement), $1) RETURNING id",
            &[&cents],
        )
        .await
        .map_err(e)?
        .get(0);
    Ok(Answer::new(201, format!(r#"{{"movement":{id},"cents":{cents}}}"#)).content_type("application/json"))
}

async fn ann_bob_pg(client: &tokio_postgres::Client) -> (i64, i64, i64) {
    let r = client
        .query_one(
            "SELECT (SELECT cents FROM wallet WHERE owner='ann'), (SELECT cents FROM wallet WHERE owner='bob'), \
             (SELECT count(*) FROM movement)",
            &[],
        )
        .await
        .unwrap();
    (r.get(0), r.get(1), r.get(2))
}

#[test]
fn postgres_replays_refuses_rolls_back_and_pays_a_race_once() {
    let Some(server) = pg::server() else { return };
    let spec = server.fresh_schema(false);
    runtime().block_on(async {
        let mut c = pg_client(&spec).await;
        c.batch_execute(LEDGER).await.unwrap();
        let keys = Keys::new("shop_").unwrap();
        keys.migrate_pg(&mut c).await.unwrap();
        keys.migrate_pg(&mut c).await.unwrap();
        let me = Scope::new("c1", "POST /pay");
        let first =
            keys.run_pg(&mut c, &me, "k1", r#"{"cents":100}"#, async |tx| pay_pg(tx, 100).await).await;
        let Ok(Reply::Fresh(answer)) = first else { panic!("{first:?}") };
        let again =
            keys.run_pg(&mut c, &me, "k1", r#"{ "cents": 100 }"#, async |tx| pay_pg(tx, 100).await).await;
        assert_eq!(again.unwrap(), Reply::Replayed(answer));
        let other = keys.run_pg(&mut c, &me, "k1", r#"{"cents":9}"#, async |tx| pay_pg(tx, 9).await).await;
        assert_eq!(other.unwrap(), Reply::Mismatch);
        let failed = keys.run_pg(&mut c, &me, "k2", r#"{"cents":13}"#, async |tx| pay_pg(tx, 13).await).await;
        assert!(matches!(failed, Err(Error::Work(_))), "{failed:?}");
        let freed = keys.run_pg(&mut c, &me, "k2", r#"{"cents":3}"#, async |tx| pay_pg(tx, 3).await).await;
        assert!(matches!(freed, Ok(Reply::Fresh(_))), "{freed:?}");
        assert_eq!(ann_bob_pg(&c).await, (897, 103, 2));

        // eight connections on one key, the work slow enough to overlap:
        // one pays, the others replay it or are told it is in flight
        let keys = &keys.in_flight_wait(std::time::Duration::from_millis(50));
        let mut clients = Vec::new();
        for _ in 0..8 {
            clients.push(pg_client(&spec).await);
        }
        let runs = clients.iter_mut().map(|c| {
            keys.run_pg(c, &me, "race", r#"{"cents":7}"#, async |tx| {
                tokio::time::sleep(std::time::Duration::from_millis(300)).await;
                pay_pg(tx, 7).await
            })
        });
        let replies: Vec<Reply> = futures_join(runs).await.into_iter().map(Result::unwrap).collect();
        assert_eq!(replies.iter().filter(|r| matches!(r, Reply::Fresh(_))).count(), 1, "{replies:?}");
        assert!(replies.contains(&Reply::InFlight), "{replies:?}");
        assert_eq!(ann_bob_pg(&c).await, (890, 110, 3));
        let late = keys.run_pg(&mut c, &me, "race", r#"{"cents":7}"#, async |tx| pay_pg(tx, 7).await).await;
        assert!(matches!(late, Ok(Reply::Replayed(_))), "{late:?}");
    });
}

/// Runs the futures at once and collects their outputs in order.
async fn futures_join<F: std::future::Future>(futures: impl Iterator<Item = F>) -> Vec<F::Output> {
    let mut running: Vec<_> = futures.map(|f| Some(Box::pin(f))).collect();
    let mut out: Vec<Option<F::Output>> = running.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        for (slot, done) in running.iter_mut().zip(out.iter_mut()) {
            if let Some(f) = slot
                && let std::task::Poll::Ready(v) = f.as_mut().poll(cx)
            {
                *done = Some(v);
                *slot = None;
            }
        }
        match running.iter().all(Option::is_none) {
            true => std::task::Poll::Ready(()),
            false => std::task::Poll::Pending,
        }
    })
    .await;
    out.into_iter().flatten().collect()
}

/// The common library design, for comparison: the work commits in its own
/// transaction and the key's record is written after it. `crash` stops
/// the attempt between the two, as a kill would.
fn record_after_commit(db: &mut rusqlite::Connection, key: &str, cents: i64, crash: bool) -> Option<String> {
    db.execute_batch("CREATE TABLE IF NOT EXISTS beside (k TEXT PRIMARY KEY, answer TEXT)").unwrap();
    let seen: Option<String> =
        db.query_row("SELECT answer FROM beside WHERE k = ?1", [key], |r| r.get(0)).ok();
    if seen.is_some() {
        return seen;
    }
    let tx = db.transaction().unwrap();
    let answer = pay_sqlite(cents)(&tx).unwrap();
    tx.commit().unwrap();
    if crash {
        return None;
    }
    let body = answer.text().unwrap().to_owned();
    db.execute("INSERT INTO beside VALUES (?1, ?2)", [key, &body]).unwrap();
    Some(body)
}

#[test]
fn a_crash_after_the_commit_pays_twice_beside_the_work_and_once_inside_it() {
    const KEYS: i64 = 20;
    // beside: each key's first attempt dies after its commit, the retry pays again
    let (mut db, _) = sqlite();
    for k in 0..KEYS {
        assert_eq!(record_after_commit(&mut db, &format!("k{k}"), 1, true), None);
        assert!(record_after_commit(&mut db, &format!("k{k}"), 1, false).is_some());
    }
    let (_, _, beside) = ann_bob_sqlite(&db);
    // inside: the only place an attempt can die is before the one commit
    // (a panic in the work stands for the kill), and then nothing of it stays
    let (mut db, keys) = sqlite();
    let me = Scope::new("c", "POST /pay");
    for k in 0..KEYS {
        let key = format!("k{k}");
        let died = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            keys.run_sqlite(&mut db, &me, &key, r#"{"cents":1}"#, |tx| -> Result<Answer, String> {
                pay_sqlite(1)(tx)?;
                panic!("killed before the commit")
            })
        }));
        assert!(died.is_err());
        let retry = keys.run_sqlite(&mut db, &me, &key, r#"{"cents":1}"#, pay_sqlite(1)).unwrap();
        assert!(matches!(retry, Reply::Fresh(_)), "{retry:?}");
        let again = keys.run_sqlite(&mut db, &me, &key, r#"{"cents":1}"#, pay_sqlite(1)).unwrap();
        assert!(matches!(again, Reply::Replayed(_)), "{again:?}");
    }
    let (_, _, inside) = ann_bob_sqlite(&db);
    eprintln!("{KEYS} keys, each attempt killed once: beside the work {beside} payments, inside it {inside}");
    assert_eq!((beside, inside), (2 * KEYS, KEYS));
}

#[test]
fn postgres_a_key_table_of_version_1_is_upgraded_to_the_engines_shape() {
    let Some(server) = pg::server() else { return };
    let spec = server.fresh_schema(false);
    runtime().block_on(async {
        let mut c = pg_client(&spec).await;
        c.batch_execute(LEDGER).await.unwrap();
        c.batch_execute(&version_1()).await.unwrap();
        let keys = Keys::new("shop_").unwrap();
        keys.migrate_pg(&mut c).await.unwrap();
        keys.migrate_pg(&mut c).await.unwrap();
        let me = Scope::new("c1", "POST /pay");
        let again = keys.run_pg(&mut c, &me, "old", r#"{"cents":1}"#, async |tx| pay_pg(tx, 1).await).await;
        assert_eq!(again.unwrap(), Reply::Replayed(Answer::new(201, r#"{"movement":7}"#)));
        let stuck = keys.run_pg(&mut c, &me, "stuck", r#"{"cents":2}"#, async |tx| pay_pg(tx, 2).await).await;
        assert!(matches!(stuck, Ok(Reply::Fresh(Answer { status: 201, .. }))), "{stuck:?}");
        assert_eq!(ann_bob_pg(&c).await, (998, 2, 1));
        let states = "SELECT string_agg(state, ',') FROM shop_idem_keys";
        assert_eq!(c.query_one(states, &[]).await.unwrap().get::<_, String>(0), "completed,completed");
        // past retention, both go
        c.batch_execute("UPDATE shop_idem_keys SET created_at = '2020-01-01T00:00:00Z'").await.unwrap();
        assert_eq!(keys.purge_pg(&c, 100).await.unwrap(), 2);
    });
}

#[test]
fn sqlite_the_purge_deletes_only_keys_past_retention() {
    let (mut db, keys) = sqlite();
    let me = Scope::new("c1", "POST /pay");
    for k in ["a", "b", "c"] {
        keys.run_sqlite(&mut db, &me, k, r#"{"cents":1}"#, pay_sqlite(1)).unwrap();
    }
    let old =
        format!("UPDATE {} SET created_at = '2020-01-01T00:00:00Z' WHERE idem_key <> 'c'", keys.table());
    db.execute(&old, []).unwrap();
    assert_eq!(keys.purge_sqlite(&db, 1).unwrap(), 1, "a limit of one");
    assert_eq!(keys.purge_sqlite(&db, 100).unwrap(), 1);
    assert_eq!(keys.purge_sqlite(&db, 100).unwrap(), 0);
    // the kept key still replays; a purged one is new again
    assert!(matches!(
        keys.run_sqlite(&mut db, &me, "c", r#"{"cents":1}"#, pay_sqlite(1)),
        Ok(Reply::Replayed(_))
    ));
    assert!(matches!(
        keys.run_sqlite(&mut db, &me, "a", r#"{"cents":1}"#, pay_sqlite(1)),
        Ok(Reply::Fresh(_))
    ));
}
