//! Group commit on SQLite: the writer folds the transfers waiting in its
//! queue into one transaction with one fsync, and answers each only after
//! that commit returned. Killed (the `IDEM_CRASH_AT` hook, an immediate
//! `_exit`) just after the group's commit, it has answered nothing and every
//! transfer of the group is on disk, replayed on retry; killed just before,
//! it has answered nothing and nothing moved.

mod common;

use common::serve::{Serve, body};
use common::*;

const CLIENT: (&str, &str) = ("tok-g", "shop-g");
const REQUESTS: usize = 16;

/// Sends `REQUESTS` transfers at once to a server armed to die at `point`;
/// returns how many got any answer at all.
fn crash_at(bank: &Bank, point: &str) -> usize {
    let serve = Serve::start(&bank.db, &[CLIENT], &[], &[("IDEM_CRASH_AT", point)]);
    let text = body(&bank.accounts[0], &bank.accounts[1], 1);
    let answered = std::thread::scope(|scope| {
        let sent: Vec<_> = (0..REQUESTS)
            .map(|i| {
                let (url, text) = (serve.url.clone(), text.clone());
                scope.spawn(move || {
                    Serve::agent()
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
    });
    assert_eq!(serve.stop(), Some(4), "the server should have died at {point}");
    answered
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
fn killed_after_the_group_commit_it_answered_nothing_and_the_group_is_on_disk() {
    let mut rng = rng();
    let bank = Bank::on(Backend::Sqlite, &mut rng, 2, false);
    let before = bank.balances();
    assert_eq!(crash_at(&bank, "after-group-commit"), 0, "an answer left before its commit returned");
    let group = bank.transfers().len();
    assert!(group >= 1, "the committed group is missing");
    assert_eq!(bank.count("SELECT COUNT(*) FROM idem_key WHERE state = 'completed'"), group as i64);
    assert_eq!(bank.count("SELECT COUNT(*) FROM idem_key WHERE state = 'in_progress'"), 0);
    assert_eq!(bank.balances(), vec![before[0] - group as i64, before[1] + group as i64]);
    assert_eq!(retry_all(&bank), (group, REQUESTS - group), "the group's keys replay, the rest are new");
    assert_eq!(bank.transfers().len(), REQUESTS);
}

#[test]
fn killed_before_the_group_commit_it_answered_nothing_and_nothing_moved() {
    let mut rng = rng();
    let bank = Bank::on(Backend::Sqlite, &mut rng, 2, false);
    let before = bank.balances();
    assert_eq!(crash_at(&bank, "before-group-commit"), 0);
    assert_eq!(bank.transfers().len(), 0);
    assert_eq!(bank.count("SELECT COUNT(*) FROM idem_key"), 0, "a claim of the lost group survived");
    assert_eq!(bank.balances(), before);
    assert_eq!(retry_all(&bank), (0, REQUESTS));
}

#[test]
fn a_group_dropped_without_its_commit_rolls_back_every_request_and_the_next_group_works() {
    use idem::protocol::{self, Ctx, Flow, Outcome};
    let mut rng = rng();
    let bank = Bank::on(Backend::Sqlite, &mut rng, 2, false);
    let before = bank.balances();
    let policy = idem::policy::Policy::embedded();
    let now = idem::clock::Timestamp::parse("2026-12-01T00:00:00Z").unwrap();
    let mut store = idem::store::sqlite::SqliteStore::open(&bank.db, policy).unwrap();
    let (s, d) = (&bank.accounts[0], &bank.accounts[1]);
    let send = |group: &mut idem::store::sqlite::Group<'_>, key: &str| {
        let text = request("shop-g", "/v1/transfers", key, s, d, 3);
        let req = idem::request::parse(text.as_bytes(), policy).unwrap();
        let ctx = Ctx { policy, now, token: key };
        match protocol::handle(group, &req, ctx, &mut |_| Flow::Continue).unwrap() {
            Outcome::Respond(r) => r.status,
            Outcome::Crashed(_) => unreachable!("nothing asked it to stop"),
        }
    };
    // a group whose commit never comes (the commit failed, or the writer unwound)
    let mut lost = store.group().unwrap();
    assert_eq!(send(&mut lost, "lost"), 201);
    let inside = idem::store::Store::audit(&mut lost).unwrap();
    assert_eq!(inside.transfers.len(), 1, "the group cannot read its own transfer");
    drop(lost);
    let audit = idem::store::Store::audit(&mut store).unwrap();
    assert!(audit.transfers.is_empty(), "the dropped group's transfer survived: {audit:?}");
    assert_eq!(bank.balances(), before);
    // the connection is out of the dropped group: the next one begins and commits
    let mut next = store.group().expect("the dropped group left its transaction open");
    assert_eq!(send(&mut next, "lost"), 201, "the dropped group's key was kept");
    next.commit().unwrap();
    assert_eq!(bank.transfers().len(), 1);
    assert_eq!(bank.balances(), vec![before[0] - 3, before[1] + 3]);
}
