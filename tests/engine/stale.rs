//! Two requests claimed on two connections before either executes: each
//! decides on the accounts as they stand at its execution, never on what
//! its claim saw. On SQLite the execution locks as it reads; on PostgreSQL
//! the claim reads the accounts on its way and the execution checks, under
//! its locks, that what it decided on still holds (else it reads again).

use crate::common::*;
use idem::policy::Policy;
use idem::protocol::{self, Claimed, Ctx, Flow, Outcome, Response};
use idem::store::{Db, Store, Usage};
use serde_json::{Value, json};

fn run(store: &mut dyn Store, req: &idem::request::Request, token: &str) -> Response {
    let policy = Policy::embedded();
    let ctx = Ctx { policy, now: idem::clock::Timestamp::parse("2026-12-01T00:00:00Z").unwrap(), token };
    match protocol::execute(store, req, ctx, &mut |_| Flow::Continue).unwrap() {
        Outcome::Respond(r) => r,
        other => panic!("{other:?}"),
    }
}

/// Claims `first` then `second` on two connections, executes `first`, then
/// `second`: returns both answers and the balances after.
fn interleave(
    backend: Backend,
    rows: &[(Value, i64)],
    first: String,
    second: String,
) -> (Response, Response, Vec<i64>) {
    let bank = Bank::with(backend, rows);
    let policy = Policy::embedded();
    let db = Db::parse(&bank.spec());
    let (mut one, mut two) = (
        idem::store::open(&db, policy, Usage::LongLived).unwrap(),
        idem::store::open(&db, policy, Usage::LongLived).unwrap(),
    );
    let now = idem::clock::Timestamp::parse("2026-12-01T00:00:00Z").unwrap();
    let parse = |text: String| idem::request::parse(text.as_bytes(), policy).unwrap();
    let (a, b) = (parse(first), parse(second));
    for (store, req, token) in [(&mut one, &a, "t-1"), (&mut two, &b, "t-2")] {
        let claimed = protocol::claim(store, req, Ctx { policy, now, token }).unwrap();
        assert_eq!(claimed, Claimed::Mine, "{backend:?}");
    }
    let (ra, rb) = (run(&mut one, &a, "t-1"), run(&mut two, &b, "t-2"));
    (ra, rb, bank.balances())
}

#[test]
fn a_balance_spent_after_the_claim_is_refused_at_the_execution() {
    for backend in backends() {
        let rows = [(json!("A"), 10), (json!("B"), 0), (json!("C"), 0)];
        let spend = |key: &str, dst: &str| request("c", "/t", key, &json!("A"), &json!(dst), 10);
        let (first, second, after) = interleave(backend, &rows, spend("k-1", "B"), spend("k-2", "C"));
        assert_eq!(first.status, 201, "{backend:?}: {first:?}");
        assert_eq!(
            (second.status, second.reason.as_ref().map(|r| r.code())),
            (402, Some("insufficient_funds")),
            "{backend:?}: the second spent money its claim saw but the first had taken: {second:?}"
        );
        assert_eq!(after, [0, 10, 0], "{backend:?}");
    }
}

#[test]
fn a_balance_credited_after_the_claim_is_spent_at_the_execution() {
    for backend in backends() {
        let rows = [(json!("A"), 0), (json!("B"), 10), (json!("C"), 0)];
        let fund = request("c", "/t", "k-1", &json!("B"), &json!("A"), 10);
        let spend = request("c", "/t", "k-2", &json!("A"), &json!("C"), 10);
        let (first, second, after) = interleave(backend, &rows, fund, spend);
        assert_eq!((first.status, second.status), (201, 201), "{backend:?}: {second:?}");
        assert_eq!(after, [0, 0, 10], "{backend:?}");
    }
}

#[test]
fn a_holder_whose_claim_was_taken_over_while_it_was_away_moves_no_money() {
    let policy = Policy::embedded();
    let t0 = idem::clock::Timestamp::parse("2026-12-01T00:00:00Z").unwrap();
    let later = t0.plus_seconds(i64::from(policy.in_progress_lease_seconds) + 1);
    for backend in backends() {
        for taker_first in [true, false] {
            let bank = Bank::with(backend, &[(json!("A"), 100), (json!("B"), 0)]);
            let db = Db::parse(&bank.spec());
            let mut slow = idem::store::open(&db, policy, Usage::LongLived).unwrap();
            let mut taker = idem::store::open(&db, policy, Usage::LongLived).unwrap();
            let text = request("c", "/t", "k", &json!("A"), &json!("B"), 30);
            let req = idem::request::parse(text.as_bytes(), policy).unwrap();
            let at = |now, token| Ctx { policy, now, token };
            assert_eq!(protocol::claim(&mut slow, &req, at(t0, "slow")).unwrap(), Claimed::Mine);
            // the lease runs out: a retry takes the key over
            assert_eq!(protocol::claim(&mut taker, &req, at(later, "taker")).unwrap(), Claimed::Mine);
            let execute = |store: &mut Box<dyn Store + Send>, token| match protocol::execute(
                store,
                &req,
                at(later, token),
                &mut |_| Flow::Continue,
            )
            .unwrap()
            {
                Outcome::Respond(r) => r,
                other => panic!("{other:?}"),
            };
            let (paid, late) = if taker_first {
                let paid = execute(&mut taker, "taker");
                (paid, execute(&mut slow, "slow"))
            } else {
                let late = execute(&mut slow, "slow");
                (execute(&mut taker, "taker"), late)
            };
            assert_eq!(paid.status, 201, "{backend:?}: {paid:?}");
            match taker_first {
                true => {
                    assert_eq!((late.status, late.replay, &late.body), (201, true, &paid.body), "{backend:?}")
                }
                false => assert_eq!(late.status, 409, "{backend:?}: {late:?}"),
            }
            assert_eq!(bank.balances(), [70, 30], "{backend:?}, taker first: {taker_first}");
            assert_eq!(bank.transfers().len(), 1, "{backend:?}, taker first: {taker_first}");
        }
    }
}

/// The window the batch's own check closes: the late holder decided while
/// the key was still its own, and a retry took the key over and paid
/// before the late holder's batch reached the database. That batch finds
/// the key no longer held and moves no money.
#[test]
fn on_the_services_batches_a_takeover_between_the_decision_and_the_write_pays_once() {
    use crate::models::awaited::Awaited;
    use idem::protocol::{Engine, Point};
    if !backends().contains(&Backend::Postgres) {
        return;
    }
    let policy = Policy::embedded();
    let t0 = idem::clock::Timestamp::parse("2026-12-01T00:00:00Z").unwrap();
    let later = t0.plus_seconds(i64::from(policy.in_progress_lease_seconds) + 1);
    let bank = Bank::with(Backend::Postgres, &[(json!("A"), 100), (json!("B"), 0)]);
    let (mut slow, mut taker) = (Awaited::batched(&bank.spec()), Awaited::batched(&bank.spec()));
    let text = request("c", "/t", "k", &json!("A"), &json!("B"), 30);
    let req = idem::request::parse(text.as_bytes(), policy).unwrap();
    let at = |now, token| Ctx { policy, now, token };
    assert_eq!(slow.claim(&req, at(t0, "slow")).unwrap(), Claimed::Mine);
    let mut paid = None;
    let late = slow.execute(&req, at(t0, "slow"), &mut |point| {
        if point == Point::BeforeCommit && paid.is_none() {
            // the slow holder has decided; the retry comes in on its own thread
            let taker = &mut taker;
            let answer = std::thread::scope(|s| {
                s.spawn(|| {
                    assert_eq!(taker.claim(&req, at(later, "taker")).unwrap(), Claimed::Mine);
                    taker.execute(&req, at(later, "taker"), &mut |_| Flow::Continue).unwrap()
                })
                .join()
                .unwrap()
            });
            paid = Some(answer);
        }
        Flow::Continue
    });
    let (Some(Outcome::Respond(paid)), Ok(Outcome::Respond(late))) = (paid, late) else {
        panic!("no answers")
    };
    assert_eq!(paid.status, 201, "{paid:?}");
    assert_eq!((late.status, late.replay, &late.body), (201, true, &paid.body), "{late:?}");
    assert_eq!(bank.balances(), [70, 30]);
    assert_eq!(bank.transfers().len(), 1);
}
