//! Group commit on SQLite: the writer folds the transfers waiting in its
//! queue into one transaction with one fsync, and answers each only after
//! that commit returned. The service runs in this process with a hook that
//! stops its writer at a point of the group commit: stopped just after the
//! commit, it has answered nothing and every transfer of the group is on
//! disk, replayed on retry; stopped just before, it has answered nothing
//! and nothing moved, and once it dies there (unwinding out of the group),
//! every retry is new.

use crate::common::*;
use crate::server::{Serve, body};
use idem::service::executor::{GroupHook, GroupPoint};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

const CLIENT: (&str, &str) = ("tok-g", "shop-g");
const REQUESTS: usize = 16;

/// `idem serve` in this process, on `bank`, with `hook`; returns its URL.
fn serve_in_process(bank: &Bank, hook: Option<GroupHook>) -> String {
    let policy = idem::policy::Policy::embedded();
    let options = idem::service::Options {
        db: idem::store::Db::Sqlite(bank.db.clone()),
        clients: [(CLIENT.0.to_owned(), CLIENT.1.to_owned())].into_iter().collect(),
        pool: 1,
        max_in_flight: 1024,
        max_connections: 1024,
        group_max: 256,
        pg_batch_max: 1,
        log_secret: None,
        gateway: None,
        reconcile_every: std::time::Duration::from_secs(30),
        max_payouts_in_flight: 64,
        events_secret: None,
        events_secret_previous: None,
        client_hooks: None,
        client_events_schedule: Default::default(),
        client_events_reach: idem::https::Reach::Public,
    };
    let clock: idem::service::executor::Clock = Arc::new(idem::clock::Timestamp::now);
    let service =
        idem::service::Service::start(options, Box::new(std::io::sink()), policy, clock, hook).unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    std::thread::spawn(move || service.run(listener, std::future::pending()));
    url
}

/// A hook that stops the writer at `point` until `release` is sent, then
/// unwinds out of the group as a crash would; the sender of `stopped` is
/// told when the writer stopped.
fn stop_at(point: GroupPoint) -> (GroupHook, mpsc::Receiver<()>, mpsc::Sender<()>) {
    let (stopped_tx, stopped) = mpsc::channel();
    let (release, release_rx) = mpsc::channel::<()>();
    let (stopped_tx, release_rx) = (Mutex::new(stopped_tx), Mutex::new(release_rx));
    let hook: GroupHook = Arc::new(move |at| {
        if at == point {
            let _ = stopped_tx.lock().unwrap().send(());
            let _ = release_rx.lock().unwrap().recv();
            panic!("the writer dies at {at:?}");
        }
    });
    (hook, stopped, release)
}

/// Sends `REQUESTS` transfers at once; returns how many got any answer
/// within two seconds.
fn send_all(url: &str, bank: &Bank) -> usize {
    let text = body(&bank.accounts[0], &bank.accounts[1], 1);
    std::thread::scope(|scope| {
        let sent: Vec<_> = (0..REQUESTS)
            .map(|i| {
                let text = text.clone();
                scope.spawn(move || {
                    let agent: ureq::Agent = ureq::Agent::config_builder()
                        .timeout_global(Some(Duration::from_secs(2)))
                        .build()
                        .into();
                    agent
                        .post(format!("{url}/v1/transfers"))
                        .header("Authorization", format!("Bearer {}", CLIENT.0))
                        .header("Content-Type", "application/json")
                        .header("Idempotency-Key", format!("g-{i}"))
                        .send(text.as_str())
                        .is_ok()
                })
            })
            .collect();
        sent.into_iter().map(|h| h.join().unwrap()).filter(|ok| *ok).count()
    })
}

/// Retries every key on a healthy server; returns (replayed, fresh).
fn retry_all(bank: &Bank) -> (usize, usize) {
    let serve = Serve::start(&bank.db, &[CLIENT], &[], &[]);
    let text = body(&bank.accounts[0], &bank.accounts[1], 1);
    let answers: Vec<_> =
        (0..REQUESTS).map(|i| serve.post(Some(CLIENT.0), Some(&format!("g-{i}")), &text)).collect();
    assert!(answers.iter().all(|a| a.status == 201), "{answers:?}");
    let replayed = answers.iter().filter(|a| a.header("idempotent-replayed").is_some()).count();
    (replayed, REQUESTS - replayed)
}

#[test]
fn stopped_after_the_group_commit_it_answered_nothing_and_the_group_is_on_disk() {
    let mut rng = rng();
    let bank = Bank::on(Backend::Sqlite, &mut rng, 2, false);
    let before = bank.balances();
    let (hook, stopped, release) = stop_at(GroupPoint::AfterCommit);
    let url = serve_in_process(&bank, Some(hook));
    assert_eq!(send_all(&url, &bank), 0, "an answer left before its commit returned");
    stopped.recv_timeout(Duration::from_secs(5)).expect("the writer never reached the commit");
    let group = bank.transfers().len();
    assert!(group >= 1, "the committed group is missing");
    assert_eq!(bank.count("SELECT COUNT(*) FROM idem_key WHERE state = 'completed'"), group as i64);
    assert_eq!(bank.count("SELECT COUNT(*) FROM idem_key WHERE state = 'in_progress'"), 0);
    assert_eq!(bank.balances(), vec![before[0] - group as i64, before[1] + group as i64]);
    release.send(()).unwrap();
    assert_eq!(retry_all(&bank), (group, REQUESTS - group), "the group's keys replay, the rest are new");
    assert_eq!(bank.transfers().len(), REQUESTS);
}

#[test]
fn stopped_before_the_group_commit_it_answered_nothing_and_nothing_moved() {
    let mut rng = rng();
    let bank = Bank::on(Backend::Sqlite, &mut rng, 2, false);
    let before = bank.balances();
    let (hook, stopped, release) = stop_at(GroupPoint::BeforeCommit);
    let url = serve_in_process(&bank, Some(hook));
    assert_eq!(send_all(&url, &bank), 0);
    stopped.recv_timeout(Duration::from_secs(5)).expect("the writer never reached the commit");
    assert_eq!(bank.transfers().len(), 0);
    assert_eq!(bank.count("SELECT COUNT(*) FROM idem_key"), 0, "a claim of the uncommitted group is visible");
    assert_eq!(bank.balances(), before);
    // the writer dies inside its group: the group rolls back, its lock is free
    release.send(()).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(retry_all(&bank), (0, REQUESTS));
}

/// A transfer of 3 from `bank`'s first account to its second under `key`,
/// run by the protocol on `group` as the attempt `token`, stopped at `stop`
/// if given: its status and whether it replayed, or `None` if it stopped.
fn send(
    group: &mut idem::store::sqlite::Group<'_>,
    bank: &Bank,
    key: &str,
    token: &str,
    stop: Option<idem::protocol::Point>,
) -> Option<(u16, bool)> {
    use idem::protocol::{self, Ctx, Flow, Outcome};
    let policy = idem::policy::Policy::embedded();
    let now = idem::clock::Timestamp::parse("2026-12-01T00:00:00Z").unwrap();
    let text = request("shop-g", "/v1/transfers", key, &bank.accounts[0], &bank.accounts[1], 3);
    let req = idem::request::parse(text.as_bytes(), policy).unwrap();
    let mut faults = |p| if Some(p) == stop { Flow::Crash } else { Flow::Continue };
    match protocol::handle(group, &req, Ctx { policy, now, token }, &mut faults).unwrap() {
        Outcome::Respond(r) => Some((r.status, r.replay)),
        Outcome::Crashed(_) => None,
    }
}

#[test]
fn a_group_dropped_without_its_commit_rolls_back_every_request_and_the_next_group_works() {
    let mut rng = rng();
    let bank = Bank::on(Backend::Sqlite, &mut rng, 2, false);
    let before = bank.balances();
    let mut store =
        idem::store::sqlite::SqliteStore::open(&bank.db, idem::policy::Policy::embedded()).unwrap();
    // a group whose commit never comes (the commit failed, or the writer unwound)
    let mut lost = store.group().unwrap();
    assert_eq!(send(&mut lost, &bank, "lost", "lost", None), Some((201, false)));
    let inside = idem::store::Store::audit(&mut lost).unwrap();
    assert_eq!(inside.transfers.len(), 1, "the group cannot read its own transfer");
    drop(lost);
    let audit = idem::store::Store::audit(&mut store).unwrap();
    assert!(audit.transfers.is_empty(), "the dropped group's transfer survived: {audit:?}");
    assert_eq!(bank.balances(), before);
    // the connection is out of the dropped group: the next one begins and commits
    let mut next = store.group().expect("the dropped group left its transaction open");
    assert_eq!(
        send(&mut next, &bank, "lost", "lost", None),
        Some((201, false)),
        "the dropped group's key was kept"
    );
    next.commit().unwrap();
    assert_eq!(bank.transfers().len(), 1);
    assert_eq!(bank.balances(), vec![before[0] - 3, before[1] + 3]);
}

/// Inside a group the writer holds a claim unwritten until its execution
/// completes it, then writes the key once, completed. A claim left without
/// its execution (the request stopped after its claim, or its execution
/// rolled back) must still be on disk, in progress, once the group commits,
/// as it would be had each claim been written at once.
#[test]
fn a_group_writes_a_paid_key_once_and_keeps_every_claim_left_without_its_execution() {
    use idem::protocol::Point;
    let mut rng = rng();
    let bank = Bank::on(Backend::Sqlite, &mut rng, 2, false);
    let before = bank.balances();
    let mut store =
        idem::store::sqlite::SqliteStore::open(&bank.db, idem::policy::Policy::embedded()).unwrap();
    let send = |group: &mut idem::store::sqlite::Group<'_>, key: &str, token: &str, stop| {
        send(group, &bank, key, token, stop)
    };
    let mut group = store.group().unwrap();
    assert_eq!(send(&mut group, "left", "t1", Some(Point::AfterClaim)), None);
    assert_eq!(send(&mut group, "undone", "t2", Some(Point::BeforeCommit)), None);
    assert_eq!(send(&mut group, "left", "t3", None), Some((409, false)), "the claim left behind was lost");
    assert_eq!(send(&mut group, "undone", "t4", None), Some((409, false)));
    assert_eq!(send(&mut group, "paid", "t5", None), Some((201, false)));
    assert_eq!(send(&mut group, "paid", "t6", None), Some((201, true)));
    // the group's last request stops after its claim: only the commit can write it
    assert_eq!(send(&mut group, "last", "t7", Some(Point::AfterClaim)), None);
    group.commit().unwrap();
    let conn = rusqlite::Connection::open(&bank.db).unwrap();
    let rows: Vec<(String, String, String, bool)> = conn
        .prepare("SELECT idem_key, state, token, transfer_id IS NOT NULL FROM idem_key ORDER BY idem_key")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let row =
        |k: &str, state: &str, token: &str, paid| (k.to_owned(), state.to_owned(), token.to_owned(), paid);
    assert_eq!(
        rows,
        [
            row("last", "in_progress", "t7", false),
            row("left", "in_progress", "t1", false),
            row("paid", "completed", "t5", true),
            row("undone", "in_progress", "t2", false)
        ]
    );
    assert_eq!(bank.transfers().len(), 1);
    assert_eq!(bank.balances(), vec![before[0] - 3, before[1] + 3]);
}
