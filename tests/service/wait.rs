//! `Prefer: wait=N` (RFC 7240) on a retry whose key is in flight: the retry
//! waits for the original's final answer and returns it as a replay
//! (`Preference-Applied: wait`); past N, 409 as without the preference;
//! without it, 409 at once as before. Originals held in flight the way the
//! real world holds them: by another session's row lock (PostgreSQL), and
//! by another instance that claimed the key and finishes it later (every
//! store: the claim and its completion are written into the database by
//! hand, as that instance would).

use crate::common::*;
use crate::server::{Http, Serve, body};
use serde_json::json;
use std::time::{Duration, Instant};

const SHOP: (&str, &str) = ("tok-shop-7f3a", "shop-1");
const TOKEN: Option<&str> = Some(SHOP.0);

fn send(serve: &Serve, key: &str, prefer: Option<&str>, body: &str) -> (Http, Duration) {
    let begun = Instant::now();
    let headers: Vec<(&str, &str)> = prefer.map(|p| ("Prefer", p)).into_iter().collect();
    let answer = serve.post_with(TOKEN, Some(key), &headers, body);
    (answer, begun.elapsed())
}

/// Another instance's claim of `key` for the body `k-probe` was sent with.
fn claimed_elsewhere(bank: &Bank, key: &str) {
    let (when, lease) = (idem::clock::Timestamp::now(), idem::clock::Timestamp::now().plus_seconds(60));
    bank.execute(&format!(
        "INSERT INTO idem_key (client_id, endpoint, idem_key, fingerprint, state, token, created_at, lease_until)
         SELECT client_id, endpoint, '{key}', fingerprint, 'in_progress', 'another-instance', '{when}', '{lease}'
         FROM idem_key WHERE idem_key = 'k-probe'"
    ));
}

/// That instance finishing it: `k-probe`'s answer stored under `key`.
fn finished_elsewhere(bank: &Bank, key: &str) {
    let probe =
        |column: &str| format!("{column} = (SELECT {column} FROM idem_key WHERE idem_key = 'k-probe')");
    let columns = ["status", "reason", "body", "completed_at"].map(probe).join(", ");
    bank.execute(&format!("UPDATE idem_key SET state = 'completed', {columns} WHERE idem_key = '{key}'"));
}

#[test]
fn a_retry_that_prefers_to_wait_gets_the_originals_answer_when_another_sessions_lock_lets_it_finish() {
    if !backends().contains(&Backend::Postgres) {
        return;
    }
    let bank = Bank::with(Backend::Postgres, &[(json!("A"), 1000), (json!("B"), 0)]);
    let serve = Serve::start(&bank.db, &[SHOP], &[], &[]);
    let pay = body(&json!("A"), &json!("B"), 40);
    // another session holds A's row: a back-office edit, open for a while
    let mut foreign = pg::client(&bank.spec());
    let mut edit = foreign.transaction().unwrap();
    edit.execute("SELECT 1 FROM account WHERE acct_id = 'A' FOR UPDATE", &[]).unwrap();
    let t0 = Instant::now();
    let original = std::thread::scope(|s| {
        let original = s.spawn(|| send(&serve, "\"k-1\"", None, &pay));
        std::thread::sleep(Duration::from_millis(400));
        // without the preference: 409 at once, as before
        let (plain, took) = send(&serve, "\"k-1\"", None, &pay);
        assert_eq!((plain.status, plain.header("preference-applied")), (409, None), "{}", plain.body);
        assert!(took < Duration::from_millis(900), "a retry without Prefer waited {took:?}");
        // a wait shorter than the original's: 409 once it is over
        let (short, took) = send(&serve, "\"k-1\"", Some("wait=1"), &pay);
        assert_eq!((short.status, short.header("preference-applied")), (409, None), "{}", short.body);
        assert!(took >= Duration::from_millis(950), "the wait of 1 s ended after {took:?}");
        // a wait long enough: the original's own answer, once the lock is let go
        let waiter = s.spawn(|| (t0.elapsed(), send(&serve, "\"k-1\"", Some("wait=10"), &pay)));
        std::thread::sleep(Duration::from_millis(600));
        let released = t0.elapsed();
        edit.rollback().unwrap();
        let (asked, (waited, took)) = waiter.join().unwrap();
        let (original, _) = original.join().unwrap();
        eprintln!(
            "timeline: original sent at 0 ms, waiter at {} ms, lock let go at {} ms, waiter answered at {} ms",
            asked.as_millis(),
            released.as_millis(),
            (asked + took).as_millis()
        );
        assert_eq!(original.status, 201, "{}", original.body);
        assert_eq!((waited.status, waited.body.as_str()), (201, original.body.as_str()));
        assert_eq!(waited.header("idempotent-replayed"), Some("true"));
        assert_eq!(waited.header("preference-applied"), Some("wait"));
        assert_eq!(waited.header("location"), original.header("location"));
        assert!(asked + took >= released, "the waiter answered before the original could finish");
        assert!(
            asked + took < released + Duration::from_secs(2),
            "the waiter answered {took:?} after asking"
        );
        original
    });
    assert_eq!(bank.balances(), [960, 40], "paid once: {}", original.body);
    assert_eq!(bank.count("SELECT COUNT(*) FROM transfer"), 1);
}

#[test]
fn a_retry_that_prefers_to_wait_gets_the_answer_another_instance_stores_on_every_store() {
    for backend in backends() {
        let bank = Bank::with(backend, &[(json!("A"), 10), (json!("B"), 0)]);
        let serve = Serve::start(&bank.db, &[SHOP], &[], &[]);
        // more than A holds: a refusal, which the key stores and replays
        let pay = body(&json!("A"), &json!("B"), 40);
        let (probe, _) = send(&serve, "\"k-probe\"", None, &pay);
        assert_eq!(probe.status, 402, "{backend:?}: {}", probe.body);
        // another instance claims k-1 for the same body, and finishes it 700 ms later
        claimed_elsewhere(&bank, "k-1");
        let (not_yet, took) = send(&serve, "\"k-1\"", Some("wait=0"), &pay);
        assert_eq!(not_yet.status, 409, "{backend:?}: wait=0 is no wait: {}", not_yet.body);
        assert!(took < Duration::from_millis(900), "{backend:?}: {took:?}");
        let (waited, took) = std::thread::scope(|s| {
            let waiter = s.spawn(|| send(&serve, "\"k-1\"", Some("wait=5"), &pay));
            std::thread::sleep(Duration::from_millis(700));
            finished_elsewhere(&bank, "k-1");
            waiter.join().unwrap()
        });
        assert_eq!((waited.status, waited.body.as_str()), (402, probe.body.as_str()), "{backend:?}");
        assert_eq!(waited.header("preference-applied"), Some("wait"), "{backend:?}");
        assert_eq!(waited.header("idempotent-replayed"), Some("true"), "{backend:?}");
        assert!(
            (Duration::from_millis(650)..Duration::from_millis(2500)).contains(&took),
            "{backend:?}: answered after {took:?}"
        );
        assert_eq!(bank.balances(), [10, 0], "{backend:?}");
    }
}

/// Two thousand retries wait on one key at once: the service's memory and
/// its database connections stay bounded (a waiter holds no connection and
/// no place among the requests in flight: a new transfer still goes through
/// during the storm), and every waiter gets the answer once it is stored.
#[test]
fn a_storm_of_waiters_holds_no_connection_and_little_memory() {
    let waiters = 2000.min(crate::server::more_descriptors().saturating_sub(300) as usize / 2);
    let stores = [Backend::Sqlite, Backend::Postgres];
    for backend in stores.into_iter().filter(|b| backends().contains(b)) {
        let bank = Bank::with(backend, &[(json!("A"), 10), (json!("B"), 0), (json!("C"), 100)]);
        // named, so that the service's own sessions can be counted
        let name = format!("idem-storm-{}", std::process::id());
        let db = match backend {
            Backend::Sqlite => bank.db.clone(),
            _ if bank.spec().starts_with("postgres") => {
                format!("{}&application_name={name}", bank.spec()).into()
            }
            _ => format!("{} application_name={name}", bank.spec()).into(),
        };
        // 256 places: a waiter's first run takes one for its claim, and on
        // this shared machine a few hundred may overlap (a run of the whole
        // suite once had 2 of 2000 answered 503 at 64); still far fewer than
        // the waiters
        let serve = Serve::start(&db, &[SHOP], &["--max-in-flight", "256"], &[]);
        let pay = body(&json!("A"), &json!("B"), 40);
        let (probe, _) = send(&serve, "\"k-probe\"", None, &pay);
        assert_eq!(probe.status, 402, "{backend:?}: {}", probe.body);
        claimed_elsewhere(&bank, "k-1");
        let (_, rss_before) = serve.cpu_and_peak_rss();
        let (answers, sessions, other) = std::thread::scope(|s| {
            // arriving over two seconds: a burst of thousands at one instant
            // would meet --max-in-flight on its first run, before any wait
            let all: Vec<_> = (0..waiters)
                .map(|_| {
                    std::thread::sleep(Duration::from_micros(1000));
                    std::thread::Builder::new()
                        .stack_size(128 << 10)
                        .spawn_scoped(s, || send(&serve, "\"k-1\"", Some("wait=10"), &pay).0)
                        .unwrap()
                })
                .collect();
            std::thread::sleep(Duration::from_secs(1));
            let sessions = match backend {
                Backend::Sqlite => 0,
                _ => bank.count(&format!(
                    "SELECT COUNT(*) FROM pg_stat_activity WHERE application_name = '{name}'"
                )),
            };
            // more than the requests in flight may be, yet a new transfer goes through
            let (other, _) = send(&serve, "\"k-other\"", None, &body(&json!("C"), &json!("B"), 5));
            finished_elsewhere(&bank, "k-1");
            (all.into_iter().map(|w| w.join().unwrap()).collect::<Vec<_>>(), sessions, other)
        });
        let (_, rss_after) = serve.cpu_and_peak_rss();
        let grew = rss_after.saturating_sub(rss_before);
        eprintln!(
            "{backend:?}: {waiters} waiters; peak RSS {} -> {} MiB (+{} KiB a waiter); {sessions} database sessions during the storm",
            rss_before >> 20,
            rss_after >> 20,
            (grew >> 10) / waiters as u64
        );
        let waited =
            answers.iter().filter(|a| a.status == 402 && a.header("preference-applied") == Some("wait"));
        assert_eq!(waited.count(), waiters, "{backend:?}: {:?}", answers.iter().find(|a| a.status != 402));
        assert!(answers.iter().all(|a| a.body == probe.body), "{backend:?}");
        assert_eq!(other.status, 201, "{backend:?}: a transfer during the storm: {}", other.body);
        assert!(grew < 96 << 20, "{backend:?}: the storm grew the service by {} MiB", grew >> 20);
        assert!(sessions <= 24, "{backend:?}: {sessions} database sessions during the storm");
    }
}
