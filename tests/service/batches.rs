//! Group commit on PostgreSQL: `idem serve` sends the claims and the
//! executions of requests side by side in batches. A batch's transfers on
//! the same account apply one after the other, each deciding on what the
//! ones before it left; a transfer refused, or one the database refuses,
//! fails alone.

use crate::common::pg;
use crate::server::Serve;
use std::sync::{Arc, Barrier};

const SHOP: (&str, &str) = ("tok-batch", "shop-b");

/// A schema of its own holding `account` with `rows`; its connection string.
fn bank(server: &pg::Server, rows: &[(&str, i64)]) -> String {
    let spec = server.fresh_schema(false);
    pg::execute(
        &spec,
        "CREATE TABLE account (acct_id TEXT PRIMARY KEY, holder TEXT, balance BIGINT NOT NULL)",
    );
    for (id, balance) in rows {
        pg::execute(&spec, &format!("INSERT INTO account VALUES ('{id}', 'h', {balance})"));
    }
    spec
}

/// Posts `bodies` at once, one thread each, key `{prefix}-{i}`; their
/// statuses in order.
fn at_once(serve: &Serve, prefix: &str, bodies: &[String]) -> Vec<u16> {
    let start = Arc::new(Barrier::new(bodies.len()));
    let posts: Vec<_> = bodies
        .iter()
        .enumerate()
        .map(|(i, body)| {
            let (url, body, start) = (serve.url.clone(), body.clone(), start.clone());
            let key = format!("\"{prefix}-{i}\"");
            std::thread::spawn(move || {
                start.wait();
                let sent = Serve::agent()
                    .post(format!("{url}/v1/transfers"))
                    .header("Authorization", format!("Bearer {}", SHOP.0))
                    .header("Idempotency-Key", &key)
                    .header("Content-Type", "application/json")
                    .send(&body);
                crate::server::read(sent).status
            })
        })
        .collect();
    posts.into_iter().map(|p| p.join().unwrap()).collect()
}

/// A metric's value on `serve`'s `/metrics`.
fn metric(serve: &Serve, line: &str) -> f64 {
    let text = serve.get("/metrics", None).body;
    text.lines()
        .find_map(|l| l.strip_prefix(line)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {line} in\n{text}"))
}

/// The balances in account order, and the number of transfers.
fn ledger(spec: &str) -> (Vec<i64>, i64) {
    let mut c = pg::client(spec);
    let balances = c
        .query("SELECT balance FROM account ORDER BY acct_id", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    (balances, c.query_one("SELECT count(*) FROM transfer", &[]).unwrap().get(0))
}

fn transfer(src: &str, dst: &str, amount: i64) -> String {
    format!(r#"{{"src":"{src}","dst":"{dst}","amount":{amount},"currency":"KRW"}}"#)
}

/// Sixty transfers of 1 from an account holding 10, at once: batches carry
/// several of them, and exactly ten are paid (a batch that checked each
/// against the balance before the batch would pay them all, overdrawing).
#[test]
fn on_postgres_a_batch_decides_each_transfer_on_what_the_ones_before_it_left() {
    let Some(server) = pg::server() else { return };
    let spec = bank(server, &[("a", 10), ("b", 0)]);
    let serve =
        Serve::start(std::path::Path::new(&spec), &[SHOP], &["--pool", "8", "--pg-batch-max", "256"], &[]);
    let bodies: Vec<String> = (0..60).map(|_| transfer("a", "b", 1)).collect();
    let statuses = at_once(&serve, "drain", &bodies);
    let paid = statuses.iter().filter(|s| **s == 201).count();
    let refused = statuses.iter().filter(|s| **s == 402).count();
    assert_eq!((paid, refused), (10, 50), "{statuses:?}");
    let batches = metric(&serve, "idem_pg_batches_total{kind=\"execution\"}");
    let carried = metric(&serve, "idem_pg_batched_total{kind=\"execution\"}");
    // a refusal decided on a balance the batch-mates changed is planned again
    assert!(carried >= 60.0, "every execution goes out in a batch: {carried}");
    assert!(batches < carried, "no batch carried more than one execution: {batches} batches");
    serve.stop();
    assert_eq!(ledger(&spec), (vec![0, 10], 10));
    let mut c = pg::client(&spec);
    // every refusal is stored, to be replayed
    let stored: i64 = c
        .query_one("SELECT count(*) FROM idem_key WHERE state = 'completed' AND status = 402", &[])
        .unwrap()
        .get(0);
    assert_eq!(stored, 50);
}

/// A constraint of the team's own refuses one transfer of a batch (an
/// amount of 7): the batch is sent again one request at a time, so that
/// transfer fails alone and every other one is paid.
#[test]
fn on_postgres_a_transfer_the_database_refuses_fails_alone_not_its_batch() {
    let Some(server) = pg::server() else { return };
    let spec = bank(server, &[("a", 1_000), ("b", 1_000)]);
    let serve =
        Serve::start(std::path::Path::new(&spec), &[SHOP], &["--pool", "8", "--pg-batch-max", "256"], &[]);
    // the first request makes the engine's tables; then the team's rule
    assert_eq!(at_once(&serve, "first", &[transfer("a", "b", 1)]), [201]);
    pg::execute(&spec, "ALTER TABLE transfer ADD CONSTRAINT not_seven CHECK (amount <> 7)");
    let bodies: Vec<String> = (0..40).map(|i| transfer("a", "b", if i == 20 { 7 } else { 2 })).collect();
    let statuses = at_once(&serve, "rule", &bodies);
    for (i, status) in statuses.iter().enumerate() {
        match i {
            20 => assert!(*status >= 500, "the refused transfer answered {status}"),
            _ => assert_eq!(*status, 201, "transfer {i} failed with its batch-mate: {statuses:?}"),
        }
    }
    assert!(
        metric(&serve, "idem_pg_batches_total{kind=\"execution\"}")
            < metric(&serve, "idem_pg_batched_total{kind=\"execution\"}"),
        "no batch carried more than one execution"
    );
    serve.stop();
    assert_eq!(ledger(&spec), (vec![1_000 - 1 - 39 * 2, 1_000 + 1 + 39 * 2], 40));
    let mut c = pg::client(&spec);
    // the refused one's key was let go: nothing of it is left
    let left: i64 =
        c.query_one("SELECT count(*) FROM idem_key WHERE idem_key = 'rule-20'", &[]).unwrap().get(0);
    assert_eq!(left, 0);
}

/// A primary whose synchronous standby is gone (cut off by a partition)
/// must still stop when asked: that is how a cluster's manager demotes it
/// and heals the cluster. Every commit on it waits for the standby, and a
/// pool connection whose backend had something to commit on its way out
/// (a temporary object of the session, dropped as it ends) would hang
/// there, and the server's stop with it.
#[test]
fn on_postgres_a_primary_without_its_synchronous_standby_still_stops_under_the_batching_pool() {
    // a server of the test's own, which it may reconfigure and stop
    let Some(server) = pg::own_server().filter(|_| std::env::var_os("IDEM_PG_URL").is_none()) else {
        return;
    };
    let spec = bank(server, &[("a", 1_000), ("b", 0)]);
    let serve =
        Serve::start(std::path::Path::new(&spec), &[SHOP], &["--pool", "8", "--pg-batch-max", "256"], &[]);
    // every connection of the pool opened, each batching
    let bodies: Vec<String> = (0..32).map(|_| transfer("a", "b", 1)).collect();
    assert!(at_once(&serve, "before", &bodies).iter().all(|s| *s == 201));
    pg::execute(&spec, "ALTER SYSTEM SET synchronous_standby_names = 'gone'");
    pg::execute(&spec, "SELECT pg_reload_conf()");
    let took = server.restart_fast().unwrap();
    pg::execute(&spec, "ALTER SYSTEM RESET synchronous_standby_names");
    pg::execute(&spec, "SELECT pg_reload_conf()");
    assert!(took < pg::STOP_WAIT, "the server's stop hung for {took:?}");
    // the service reconnects and batches again
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while at_once(&serve, "after", &[transfer("a", "b", 5)]) != [201] {
        assert!(std::time::Instant::now() < deadline, "no transfer paid after the restart");
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    serve.stop();
    assert_eq!(ledger(&spec), (vec![1_000 - 37, 37], 33));
}

/// A role that may not create in the schema (the engine's tables made
/// beforehand, as by a migration) cannot make the batch's function: the
/// service says so once and pays every transfer without batches, rather
/// than refusing them.
#[test]
fn on_postgres_a_role_that_may_not_make_the_batch_function_is_served_without_batches() {
    let Some(server) = pg::server() else { return };
    let spec = bank(server, &[("a", 100), ("b", 0)]);
    let owner = Serve::start(std::path::Path::new(&spec), &[SHOP], &["--pg-batch-max", "1"], &[]);
    assert_eq!(at_once(&owner, "owner", &[transfer("a", "b", 1)]), [201]);
    owner.stop();
    let Some(as_role) = server.as_password_role(&spec, pg::PASSWORD) else { return };
    let mut c = pg::client(&spec);
    let schema: String = c.query_one("SELECT current_schema()::text", &[]).unwrap().get(0);
    let role = pg::PASSWORD_ROLE;
    c.batch_execute(&format!(
        "REVOKE CREATE ON SCHEMA {schema} FROM PUBLIC;
         GRANT USAGE ON SCHEMA {schema} TO {role};
         GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA {schema} TO {role};
         GRANT USAGE ON ALL SEQUENCES IN SCHEMA {schema} TO {role}"
    ))
    .unwrap();
    let serve =
        Serve::start(std::path::Path::new(&as_role), &[SHOP], &["--pool", "8", "--pg-batch-max", "256"], &[]);
    let bodies: Vec<String> = (0..20).map(|_| transfer("a", "b", 1)).collect();
    let statuses = at_once(&serve, "role", &bodies);
    assert!(statuses.iter().all(|s| *s == 201), "{statuses:?}");
    let log = serve.log_when(|l| l.contains("pg_batches_off"));
    assert!(log.contains(r#""event":"pg_batches_off""#), "{log}");
    serve.stop();
    assert_eq!(ledger(&spec), (vec![79, 21], 21));
}

/// The batch's function dropped while the pool's connections stay open
/// (by hand, or by a migration tool that drops what its own schema does not
/// name): each request still gets its 201, the connection that found the
/// function gone is replaced, and its successor makes the function again.
#[test]
fn on_postgres_a_batch_function_dropped_under_open_connections_is_made_again_not_answered_500() {
    let Some(server) = pg::server() else { return };
    let spec = bank(server, &[("a", 100), ("b", 0)]);
    let serve =
        Serve::start(std::path::Path::new(&spec), &[SHOP], &["--pool", "4", "--pg-batch-max", "256"], &[]);
    let warm: Vec<String> = (0..4).map(|_| transfer("a", "b", 1)).collect();
    assert_eq!(at_once(&serve, "warm", &warm), [201; 4]);
    let functions =
        "SELECT p.oid::regprocedure::text FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
                     WHERE n.nspname = current_schema() AND p.proname LIKE 'idem\\_execute\\_%'";
    let mut c = pg::client(&spec);
    let made: Vec<String> = c.query(functions, &[]).unwrap().iter().map(|r| r.get(0)).collect();
    assert_eq!(made.len(), 1, "{made:?}");
    c.batch_execute(&format!("DROP FUNCTION {}", made[0])).unwrap();
    // one at a time: each a batch of one, which has no batch-mate to go out alone with
    let statuses: Vec<u16> =
        (0..10).flat_map(|i| at_once(&serve, &format!("after-{i}"), &[transfer("a", "b", 1)])).collect();
    assert_eq!(statuses, [201; 10]);
    let again: Vec<String> = c.query(functions, &[]).unwrap().iter().map(|r| r.get(0)).collect();
    assert_eq!(again, made, "the function was not made again");
    serve.stop();
    assert_eq!(ledger(&spec), (vec![86, 14], 14));
}

/// A role that may create in the schema (every role in `public` up to
/// PostgreSQL 14) makes a function at the batch function's name first:
/// idem's own body plus a credit to its account. idem never calls it: it
/// says so (a log line, a metric), serves without batches, and the
/// planted account is never credited.
#[test]
fn on_postgres_a_function_planted_at_the_batch_functions_name_is_never_run() {
    let Some(server) = pg::server() else { return };
    let spec = bank(server, &[("a", 100), ("b", 0), ("mallory", 0)]);
    let Some(as_role) = server.as_password_role(&spec, pg::PASSWORD) else { return };
    // idem's own function, as the attacker can read it in the catalog
    let serve = Serve::start(std::path::Path::new(&spec), &[SHOP], &["--pg-batch-max", "256"], &[]);
    assert_eq!(at_once(&serve, "first", &[transfer("a", "b", 1)]), [201]);
    serve.stop();
    let mut c = pg::client(&spec);
    let found = "SELECT p.oid::regprocedure::text, pg_get_functiondef(p.oid) FROM pg_proc p
                 JOIN pg_namespace n ON n.oid = p.pronamespace
                 WHERE n.nspname = current_schema() AND p.proname LIKE 'idem\\_execute\\_%'";
    let row = c.query_one(found, &[]).unwrap();
    let (name, def): (String, String) = (row.get(0), row.get(1));
    c.batch_execute(&format!("DROP FUNCTION {name}")).unwrap();
    let planted = def.replacen(
        "\nBEGIN\n",
        "\nBEGIN\n  UPDATE account SET balance = balance + 1000000 WHERE acct_id = 'mallory';\n",
        1,
    );
    assert_ne!(planted, def);
    pg::client(&as_role).batch_execute(&planted).unwrap();

    let serve =
        Serve::start(std::path::Path::new(&spec), &[SHOP], &["--pool", "8", "--pg-batch-max", "256"], &[]);
    let bodies: Vec<String> = (0..20).map(|_| transfer("a", "b", 1)).collect();
    let statuses = at_once(&serve, "after", &bodies);
    assert!(statuses.iter().all(|s| *s == 201), "{statuses:?}");
    let mallory: i64 =
        c.query_one("SELECT balance FROM account WHERE acct_id = 'mallory'", &[]).unwrap().get(0);
    assert_eq!(mallory, 0, "the planted function ran");
    let log = serve.log_when(|l| l.contains("pg_batches_off"));
    let line = log.lines().find(|l| l.contains("pg_batches_off")).unwrap_or_else(|| panic!("{log}"));
    assert!(line.contains(&format!("owned by role {}", pg::PASSWORD_ROLE)), "{line}");
    assert_eq!(metric(&serve, "idem_pg_batches_off"), 1.0);
    serve.stop();
    assert_eq!(ledger(&spec), (vec![79, 21, 0], 21), "the planted function ran");
}

/// Another session runs `lock` in a transaction it keeps open for `held`
/// (a back-office edit, a session idle in a transaction); returns once the
/// lock is taken, with the thread that commits it.
fn hold(spec: &str, lock: &'static str, held: std::time::Duration) -> std::thread::JoinHandle<()> {
    let (locked_tx, locked) = std::sync::mpsc::channel();
    let spec = spec.to_owned();
    let foreign = std::thread::spawn(move || {
        let mut c = pg::client(&spec);
        let mut tx = c.transaction().unwrap();
        tx.query(lock, &[]).unwrap();
        locked_tx.send(()).unwrap();
        std::thread::sleep(held);
        tx.commit().unwrap();
    });
    locked.recv().unwrap();
    foreign
}

/// Another session holds one account's row (a back-office edit, a session
/// idle in a transaction) for longer than the busy budget. Transfers on
/// that account wait alone, as unbatched ones do; every other transfer,
/// batched beside them, goes through: none refused, none held past 2 s.
#[test]
fn on_postgres_a_foreign_row_lock_holds_up_only_the_transfers_on_its_account() {
    let Some(server) = pg::server() else { return };
    let mut rows: Vec<(String, i64)> = vec![("x".into(), 1_000_000)];
    rows.extend(
        (0..8).flat_map(|i| [(format!("a{i}"), 1_000_000), (format!("b{i}"), 0), (format!("c{i}"), 0)]),
    );
    let rows: Vec<(&str, i64)> = rows.iter().map(|(id, b)| (id.as_str(), *b)).collect();
    let spec = bank(server, &rows);
    let serve =
        Serve::start(std::path::Path::new(&spec), &[SHOP], &["--pool", "16", "--pg-batch-max", "256"], &[]);
    assert_eq!(at_once(&serve, "warm", &[transfer("a0", "b0", 1), transfer("x", "c0", 1)]), [201, 201]);
    let held = std::time::Duration::from_secs(6);
    let foreign = hold(&spec, "SELECT * FROM account WHERE acct_id = 'x' FOR UPDATE", held);
    let until = std::time::Instant::now() + held - std::time::Duration::from_secs(1);
    let send = |name: String, body: String| {
        let url = serve.url.clone();
        std::thread::spawn(move || {
            let mut seen = Vec::new();
            for n in 0.. {
                if std::time::Instant::now() > until {
                    break;
                }
                let began = std::time::Instant::now();
                let sent = Serve::agent()
                    .post(format!("{url}/v1/transfers"))
                    .header("Authorization", format!("Bearer {}", SHOP.0))
                    .header("Idempotency-Key", format!("\"{name}-{n}\""))
                    .header("Content-Type", "application/json")
                    .send(&body);
                seen.push((crate::server::read(sent).status, began.elapsed()));
            }
            seen
        })
    };
    // (to accounts of their own: a transfer waiting for x holds its other
    // account meanwhile, batched or not)
    let on_x: Vec<_> = (0..2).map(|i| send(format!("x{i}"), transfer("x", &format!("c{i}"), 1))).collect();
    let others: Vec<_> =
        (0..8).map(|i| send(format!("o{i}"), transfer(&format!("a{i}"), &format!("b{i}"), 1))).collect();
    let others: Vec<(u16, std::time::Duration)> =
        others.into_iter().flat_map(|t| t.join().unwrap()).collect();
    let on_x: Vec<(u16, std::time::Duration)> = on_x.into_iter().flat_map(|t| t.join().unwrap()).collect();
    foreign.join().unwrap();
    let slowest = others.iter().map(|(_, took)| *took).max().unwrap();
    let refused = others.iter().filter(|(s, _)| *s != 201).count();
    eprintln!(
        "beside a foreign lock of {held:?}: {} other transfers, {refused} not 201, slowest {slowest:?}; on the locked account: {:?}",
        others.len(),
        on_x.iter().map(|(s, t)| (*s, t.as_millis())).collect::<Vec<_>>()
    );
    assert_eq!(refused, 0, "{:?}", others.iter().filter(|(s, _)| *s != 201).collect::<Vec<_>>());
    assert!(slowest < std::time::Duration::from_secs(2), "a transfer beside the lock waited {slowest:?}");
    assert!(others.len() >= 100, "only {} other transfers in {held:?}", others.len());
    assert!(on_x.iter().all(|(s, _)| [201, 503].contains(s)), "{on_x:?}");
    assert!(
        metric(&serve, "idem_pg_batched_total{kind=\"execution\"}")
            > metric(&serve, "idem_pg_batches_total{kind=\"execution\"}"),
        "no batch carried two"
    );
    // the money: every 201 paid once, nothing else
    let paid = 2 + others.len() as i64 + on_x.iter().filter(|(s, _)| *s == 201).count() as i64;
    serve.stop();
    let (balances, transfers) = ledger(&spec);
    assert_eq!(transfers, paid);
    assert_eq!(balances.iter().sum::<i64>(), 9_000_000);
}

/// Sends transfers `from..to` on 16 connections, key `scan-{n}`, between
/// the hundred accounts `a0..a99`, each answered 201.
fn spread(serve: &Serve, from: usize, to: usize) {
    between(serve, 100, from, to);
}

/// Transfers `from..to`, each from account `n % accounts` to the next one,
/// on 16 connections; each must be paid.
fn between(serve: &Serve, accounts: usize, from: usize, to: usize) {
    let posts: Vec<_> = (0..16)
        .map(|lane| {
            let url = serve.url.clone();
            std::thread::spawn(move || {
                let agent = Serve::agent();
                for n in (from + lane..to).step_by(16) {
                    let body =
                        transfer(&format!("a{}", n % accounts), &format!("a{}", (n + 1) % accounts), 1);
                    let sent = agent
                        .post(format!("{url}/v1/transfers"))
                        .header("Authorization", format!("Bearer {}", SHOP.0))
                        .header("Idempotency-Key", &format!("\"scan-{n}\""))
                        .header("Content-Type", "application/json")
                        .send(&body);
                    assert_eq!(crate::server::read(sent).status, 201, "transfer {n}");
                }
            })
        })
        .collect();
    posts.into_iter().for_each(|p| p.join().unwrap());
}

/// The batch path reads the keys it needs by the index however the key
/// table grew since its sessions began: a plan cached while the table was
/// small (the claims' prepared statement, the batch function's
/// statements) went on scanning it whole at every batch until the next
/// ANALYZE (a new deployment's p50 went 3 → 70 ms at 700 transfers/s).
/// 20 transfers on a fresh table, then its first ANALYZE (autovacuum's, on
/// a young table, comes after 50 rows) while it holds a page, 180 more
/// transfers to cache every session's plans on it, 30 000 keys of another
/// client added behind the sessions' backs, 1 000 more transfers: the rows
/// of `idem_key` read by sequential scans, or fetched through an index
/// read whole, stay below 30 whole tables (about 400 batches each reading
/// all of it, before).
#[test]
fn on_postgres_a_key_table_grown_under_the_sessions_is_not_scanned_whole_by_every_batch() {
    let Some(server) = pg::server() else { return };
    let accounts: Vec<(String, i64)> = (0..100).map(|i| (format!("a{i}"), 1_000_000)).collect();
    let rows: Vec<(&str, i64)> = accounts.iter().map(|(id, b)| (id.as_str(), *b)).collect();
    let spec = bank(server, &rows);
    let serve = Serve::start(std::path::Path::new(&spec), &[SHOP], &["--pool", "8"], &[]);
    spread(&serve, 0, 20);
    pg::execute(&spec, "ANALYZE idem_key");
    spread(&serve, 20, 200);
    pg::execute(
        &spec,
        "INSERT INTO idem_key SELECT (jsonb_populate_record(NULL::idem_key, to_jsonb(k) \
           || jsonb_build_object('client_id', 'pad-' || g, 'transfer_id', NULL))).* \
         FROM idem_key k, generate_series(1, 150) g",
    );
    spread(&serve, 200, 1_200);
    let batches = metric(&serve, "idem_pg_batches_total{kind=\"claim\"}");
    // its sessions end, and their counts reach the statistics as they do
    serve.stop();
    std::thread::sleep(std::time::Duration::from_millis(500));
    let mut c = pg::client(&spec);
    let [read, keys]: [i64; 2] = [
        "SELECT seq_tup_read + coalesce(idx_tup_fetch, 0) FROM pg_stat_user_tables \
         WHERE schemaname = current_schema() AND relname = 'idem_key'",
        "SELECT count(*) FROM idem_key",
    ]
    .map(|q| c.query_one(q, &[]).unwrap().get(0));
    assert!(keys >= 30_000, "the table holds {keys} keys");
    assert!(
        read < 30 * keys,
        "{read} rows of idem_key ({keys}) read by sequential scans or fetched through its indexes for 1 200 transfers in {batches} claim batches"
    );
}

/// A batch takes its row locks in the same subtransaction as its writes:
/// an account locked in a subtransaction and then updated by its parent
/// carries a MultiXact as its old version's xmax, and every later look at
/// the row resolves it (a third of the server's CPU on a hot pair). 300
/// transfers on one pair, then the pair's page read raw: no version of
/// either row was left a MultiXact's.
#[test]
fn on_postgres_a_batch_leaves_its_accounts_no_multixact() {
    let Some(server) = pg::server() else { return };
    let spec = bank(server, &[("a0", 1_000_000), ("a1", 1_000_000)]);
    let serve = Serve::start(std::path::Path::new(&spec), &[SHOP], &["--pool", "8"], &[]);
    between(&serve, 2, 0, 300);
    let batches = metric(&serve, "idem_pg_batches_total{kind=\"execution\"}");
    serve.stop();
    let mut c = pg::client(&spec);
    c.batch_execute("CREATE EXTENSION IF NOT EXISTS pageinspect").unwrap();
    // HEAP_XMAX_IS_MULTI
    let [versions, multi]: [i64; 2] = [
        "SELECT count(*) FROM heap_page_items(get_raw_page('account', 0))",
        "SELECT count(*) FROM heap_page_items(get_raw_page('account', 0)) WHERE t_infomask & 4096 <> 0",
    ]
    .map(|q| c.query_one(q, &[]).unwrap().get(0));
    assert!(batches < 300.0, "300 transfers in {batches} batches: too few were batched");
    assert!(versions > 2, "only {versions} versions on the page: nothing to look at");
    assert_eq!(multi, 0, "{multi} of the {versions} versions of the pair have a MultiXact's xmax");
}

/// Another session holds the row of a key a batch still holds (an
/// operator's `SELECT … FOR UPDATE` on `idem_key`): after the batch's
/// short lock wait, that transfer is handed back to go alone, and its
/// batch-mate is paid without waiting for the foreign session. The batch
/// function called as the lanes call it, with two claims of its own.
#[test]
fn on_postgres_a_key_another_session_holds_is_handed_back_alone_and_its_batch_mate_is_paid() {
    let Some(server) = pg::server() else { return };
    let spec = bank(server, &[("a1", 100), ("a2", 0), ("a3", 100), ("a4", 0)]);
    let serve = Serve::start(std::path::Path::new(&spec), &[SHOP], &["--pool", "4"], &[]);
    assert_eq!(at_once(&serve, "warm", &[transfer("a1", "a2", 1)]), [201]);
    serve.stop();
    let mut c = pg::client(&spec);
    let function: String = c
        .query_one(
            "SELECT p.oid::regproc::text FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace \
             WHERE n.nspname = current_schema() AND p.proname LIKE 'idem_execute_%'",
            &[],
        )
        .unwrap()
        .get(0);
    c.batch_execute(
        "INSERT INTO idem_key (client_id, endpoint, idem_key, fingerprint, state, token, created_at, lease_until) \
         VALUES ('t', '/e', 'k1', 'fp', 'in_progress', 'tok1', '2026', '2999'), \
                ('t', '/e', 'k2', 'fp', 'in_progress', 'tok2', '2026', '2999')",
    )
    .unwrap();
    let foreign = hold(
        &spec,
        "SELECT * FROM idem_key WHERE idem_key = 'k1' FOR UPDATE",
        std::time::Duration::from_secs(3),
    );
    let began = std::time::Instant::now();
    let rows = c
        .query(
            &format!(
                "SELECT o_held, o_transfer IS NOT NULL, o_alone FROM {function}( \
                 '{{t,t}}', '{{/e,/e}}', '{{k1,k2}}', '{{tok1,tok2}}', '{{a1,a3}}', '{{a2,a4}}', \
                 '{{t,t}}', '{{0,0}}', '{{100,100}}', '{{t,t}}', '{{0,0}}', '{{100,100}}', '{{5,5}}', \
                 '{{KRW,KRW}}', '{{2026,2026}}', '{{201,201}}', '{{NULL,NULL}}', '{{\"}}\",\"}}\"}}', \
                 '{{\"transfer_id\":')"
            ),
            &[],
        )
        .unwrap();
    let took = began.elapsed();
    let rows: Vec<(bool, bool, bool)> = rows.iter().map(|r| (r.get(0), r.get(1), r.get(2))).collect();
    assert_eq!(rows, [(false, false, true), (true, true, false)], "(held, paid, alone) of k1 and k2");
    assert!(took < std::time::Duration::from_secs(2), "the batch waited {took:?} for the foreign lock");
    let states: Vec<String> = c
        .query("SELECT state FROM idem_key WHERE client_id = 't' ORDER BY idem_key", &[])
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(states, ["in_progress", "completed"]);
    assert_eq!(ledger(&spec).0, [99, 1, 95, 5], "only k2's transfer moved money");
    foreign.join().unwrap();
}
