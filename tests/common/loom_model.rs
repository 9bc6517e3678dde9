//! The loom model's store and race: state behind a loom `Mutex`, a
//! transaction holding the lock from `begin` to `commit` and working on a
//! copy (dropping it rolls back), like SQLite's `BEGIN IMMEDIATE`.

use idem::clock::Timestamp;
use idem::policy::Policy;
use idem::protocol::{self, Ctx, Flow, Outcome, Point, Response};
use idem::request::{self, AcctId, ScopedKey};
use idem::store::{
    Account, Claim, Durability, KeyRecord, KeyState, NewTransfer, Store, StoreError, Stored, Tx,
};
use loom::sync::{Arc, Mutex, MutexGuard};
use std::collections::BTreeMap;

#[derive(Clone, Default)]
struct State {
    keys: BTreeMap<ScopedKey, KeyRecord>,
    balances: BTreeMap<AcctId, i64>,
    transfers: Vec<i64>,
}

#[derive(Clone)]
struct MemStore(Arc<Mutex<State>>);

struct MemTx<'a> {
    guard: MutexGuard<'a, State>,
    work: State,
}

impl Store for MemStore {
    type Tx<'a> = MemTx<'a>;
    fn begin(&mut self, _: Durability) -> Result<MemTx<'_>, StoreError> {
        let guard = self.0.lock().unwrap();
        let work = guard.clone();
        Ok(MemTx { guard, work })
    }
}

impl Tx for MemTx<'_> {
    fn insert_claim(&mut self, key: &ScopedKey, claim: &Claim) -> Result<Option<KeyRecord>, StoreError> {
        if let Some(existing) = self.work.keys.get(key) {
            return Ok(Some(existing.clone()));
        }
        self.replace_claim(key, claim).map(|()| None)
    }
    fn replace_claim(&mut self, key: &ScopedKey, claim: &Claim) -> Result<(), StoreError> {
        let state = KeyState::InProgress { token: claim.token.clone(), lease_until: claim.lease_until };
        self.work.keys.insert(
            key.clone(),
            KeyRecord { fingerprint: claim.fingerprint.clone(), created_at: claim.created_at, state },
        );
        Ok(())
    }
    fn key(&mut self, key: &ScopedKey) -> Result<Option<KeyRecord>, StoreError> {
        Ok(self.work.keys.get(key).cloned())
    }
    fn complete(
        &mut self,
        key: &ScopedKey,
        response: &Stored,
        _: Option<i64>,
        _: Timestamp,
    ) -> Result<(), StoreError> {
        let record = self.work.keys.get_mut(key).ok_or(StoreError::Backend("no key".into()))?;
        assert!(matches!(record.state, KeyState::InProgress { .. }), "completed a key twice");
        record.state = KeyState::Completed(response.clone());
        Ok(())
    }
    fn account(&mut self, id: &AcctId) -> Result<Option<Account>, StoreError> {
        Ok(self.work.balances.get(id).map(|b| Account { id: id.clone(), balance: *b }))
    }
    fn set_balance(&mut self, id: &AcctId, balance: i64) -> Result<(), StoreError> {
        self.work.balances.insert(id.clone(), balance);
        Ok(())
    }
    fn insert_transfer(&mut self, t: &NewTransfer) -> Result<i64, StoreError> {
        self.work.transfers.push(t.amount);
        Ok(self.work.transfers.len() as i64)
    }
    fn purge(&mut self, before: Timestamp) -> Result<u64, StoreError> {
        let n = self.work.keys.len();
        self.work.keys.retain(|_, r| r.created_at >= before);
        Ok((n - self.work.keys.len()) as u64)
    }
    fn in_progress(&mut self) -> Result<Vec<(ScopedKey, KeyRecord)>, StoreError> {
        let open = self.work.keys.iter().filter(|(_, r)| matches!(r.state, KeyState::InProgress { .. }));
        Ok(open.map(|(k, r)| (k.clone(), r.clone())).collect())
    }
    fn release(&mut self, key: &ScopedKey, token: &str) -> Result<bool, StoreError> {
        let held = matches!(self.work.keys.get(key), Some(KeyRecord { state: KeyState::InProgress { token: t, .. }, .. }) if t == token);
        if held {
            self.work.keys.remove(key);
        }
        Ok(held)
    }
    fn commit(mut self) -> Result<(), StoreError> {
        *self.guard = std::mem::take(&mut self.work);
        Ok(())
    }
}

const REQUEST: &str = r#"{"client_id":"c","endpoint":"/t","idem_key":"k","body":{"src":"A","dst":"B","amount":30,"currency":"KRW"}}"#;

fn new_store() -> MemStore {
    let mut state = State::default();
    state.balances.insert(AcctId::Text("A".into()), 100);
    state.balances.insert(AcctId::Text("B".into()), 0);
    MemStore(Arc::new(Mutex::new(state)))
}

fn t0() -> Timestamp {
    Timestamp::parse("2026-12-01T00:00:00Z").unwrap()
}

/// One racer: `Some(answer)`, or `None` if it died after its claim.
fn racer(mut store: MemStore, name: &str, crash: bool) -> Option<Response> {
    let policy = Policy::embedded();
    let req = request::parse(REQUEST.as_bytes(), policy).unwrap();
    let mut faults = |p: Point| if crash && p == Point::AfterClaim { Flow::Crash } else { Flow::Continue };
    match protocol::handle(&mut store, &req, Ctx { policy, now: t0(), token: name }, &mut faults).unwrap() {
        Outcome::Respond(r) => Some(r),
        Outcome::Crashed(_) => None,
    }
}

/// `crashes[i]`: whether racer i dies right after winning a claim.
pub fn race(crashes: &'static [bool]) {
    loom::model(move || {
        let store = new_store();
        let handles: Vec<_> = crashes
            .iter()
            .enumerate()
            .map(|(i, &crash)| {
                let store = store.clone();
                loom::thread::spawn(move || racer(store, &format!("racer-{i}"), crash))
            })
            .collect();
        let answers: Vec<Option<Response>> = handles.into_iter().map(|h| h.join().unwrap()).collect();

        let state = store.0.lock().unwrap().clone();
        let fresh: Vec<&Response> =
            answers.iter().flatten().filter(|r| r.status == 201 && !r.replay).collect();
        let died = answers.iter().filter(|a| a.is_none()).count();
        assert!(state.transfers.len() <= 1, "executed {} times", state.transfers.len());
        assert_eq!(fresh.len(), state.transfers.len(), "every execution answered 201 exactly once");
        // A dead claimant never completes: the key is completed exactly when
        // the money moved, and is otherwise still held in progress.
        match &state.keys.values().next().unwrap().state {
            KeyState::Completed(stored) => {
                assert_eq!((state.transfers.len(), stored.status), (1, 201));
                for r in answers.iter().flatten().filter(|r| r.replay) {
                    assert_eq!(r.body, fresh[0].body, "replay bytes");
                }
            }
            KeyState::InProgress { .. } => assert!(state.transfers.is_empty() && died == 1),
        }
        for r in answers.iter().flatten().filter(|r| r.status != 201) {
            assert_eq!((r.status, r.reason.as_deref()), (409, Some("in_progress")));
        }
        if died == 0 {
            assert_eq!(state.transfers.len(), 1, "nobody died, so somebody paid");
        }
        let money: i64 = state.balances.values().sum();
        assert_eq!(money, 100, "money conserved");

        // After the lease, a retry finishes what a dead claimant started, and
        // nothing has been paid twice.
        let policy = Policy::embedded();
        let req = request::parse(REQUEST.as_bytes(), policy).unwrap();
        let later = t0().plus_seconds(i64::from(policy.in_progress_lease_seconds));
        let mut store = store;
        let retry =
            protocol::handle(&mut store, &req, Ctx { policy, now: later, token: "retry" }, &mut |_| {
                Flow::Continue
            })
            .unwrap();
        assert!(matches!(retry, Outcome::Respond(Response { status: 201, .. })));
        assert_eq!(store.0.lock().unwrap().transfers.len(), 1);
    });
}
