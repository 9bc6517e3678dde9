//! `protocol::settled`, the plain read that answers a settled key without a
//! claim or a write lock, on every store: it answers only a completed key
//! (the stored bytes, as a replay) and a key under another body (422); a new,
//! in-flight or expired key goes on to the claim; and it never moves money.

use crate::common::*;
use idem::policy::Policy;
use idem::protocol::{self, Claimed, Ctx, Flow, Outcome};
use idem::store::Reads;
use serde_json::json;

fn check<S: Reads>(store: &mut S, backend: Backend) {
    let policy = Policy::embedded();
    let now = idem::clock::Timestamp::parse("2026-12-01T00:00:00Z").unwrap();
    let ctx = |token| Ctx { policy, now, token };
    let parse = |amount| {
        let text = request("shop-1", "/v1/transfers", "k-1", &json!("A"), &json!("B"), amount);
        idem::request::parse(text.as_bytes(), policy).unwrap()
    };
    let (req, other) = (parse(10), parse(11));

    assert_eq!(protocol::settled(store, &req, ctx("")).unwrap(), None, "{backend:?}: a new key");
    assert!(matches!(protocol::claim(store, &req, ctx("t-1")).unwrap(), Claimed::Mine));
    assert_eq!(protocol::settled(store, &req, ctx("")).unwrap(), None, "{backend:?}: a key in flight");
    let in_flight_mismatch = protocol::settled(store, &other, ctx("")).unwrap().expect("422 in flight");
    assert_eq!(in_flight_mismatch.status, 422, "{backend:?}");
    let lease_over = now.plus_seconds(i64::from(policy.in_progress_lease_seconds) + 1);
    let stale = protocol::settled(store, &req, Ctx { policy, now: lease_over, token: "" }).unwrap();
    assert_eq!(stale, None, "{backend:?}: a claim past its lease goes on to be taken over");

    let Outcome::Respond(first) =
        protocol::execute(store, &req, ctx("t-1"), &mut |_| Flow::Continue).unwrap()
    else {
        panic!("{backend:?}: the execution stopped")
    };
    assert_eq!(first.status, 201, "{backend:?}: {first:?}");
    let replay = protocol::settled(store, &req, ctx("")).unwrap().expect("a completed key is settled");
    assert_eq!((replay.status, replay.replay, &replay.body), (201, true, &first.body), "{backend:?}");
    let mismatch = protocol::settled(store, &other, ctx("")).unwrap().expect("another body is settled");
    assert_eq!(
        (mismatch.status, mismatch.reason.as_ref().map(|r| r.code())),
        (422, Some("fingerprint_mismatch"))
    );

    let later = now.plus_seconds(policy.retention_seconds() + 1);
    let expired = protocol::settled(store, &req, Ctx { policy, now: later, token: "" }).unwrap();
    assert_eq!(expired, None, "{backend:?}: a key past retention goes on to a fresh claim");

    let audit = store.audit().unwrap();
    assert_eq!(audit.transfers.len(), 1, "{backend:?}: a read moved money");
    assert_eq!(audit.balance(&idem::request::AcctId::Text("A".into())), Some(90));
}

#[test]
fn settled_answers_completed_keys_and_mismatches_and_nothing_else_on_every_store() {
    let rows = [(json!("A"), 100), (json!("B"), 0)];
    for backend in backends() {
        let dir = tempfile::tempdir().unwrap();
        let spec = make_bank(backend, dir.path(), &rows, false);
        let policy = Policy::embedded();
        match backend {
            Backend::Sqlite => {
                check(&mut idem::store::sqlite::SqliteStore::open(&spec, policy).unwrap(), backend)
            }
            _ => check(
                &mut idem::store::pg::PgStore::connect(&spec.to_string_lossy(), policy).unwrap(),
                backend,
            ),
        }
    }
}
