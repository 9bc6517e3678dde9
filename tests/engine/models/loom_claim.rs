//! The loom model's store and race: state behind a loom `Mutex`, a
//! transaction holding the lock from `begin` to `commit` and working on a
//! copy (dropping it rolls back), like SQLite's `BEGIN IMMEDIATE`.

use idem::clock::Timestamp;
use idem::policy::Policy;
use idem::protocol::{self, Ctx, Engine, Flow, Outcome, Point, Response};
use idem::request::{AcctId, ScopedKey};
use idem::store::{
    Account, Audit, Claim, Durability, KeyRecord, KeyState, NewTransfer, PayoutTx, Store, StoreError, Stored,
    Tx,
};
use loom::sync::{Arc, Mutex, MutexGuard};
use std::collections::BTreeMap;

#[derive(Clone, Default)]
pub struct State {
    /// Each key with the transfer its completion names.
    keys: BTreeMap<ScopedKey, (KeyRecord, Option<i64>)>,
    balances: BTreeMap<AcctId, i64>,
    transfers: Vec<i64>,
}

#[derive(Clone)]
pub struct MemStore(Arc<Mutex<State>>);

struct MemTx<'a> {
    guard: MutexGuard<'a, State>,
    work: State,
}

impl Store for MemStore {
    fn begin(&mut self, _: Durability) -> Result<Box<dyn Tx + '_>, StoreError> {
        let guard = self.0.lock().unwrap();
        let work = guard.clone();
        Ok(Box::new(MemTx { guard, work }))
    }
    fn audit(&mut self) -> Result<Audit, StoreError> {
        let state = self.0.lock().unwrap();
        let named: Vec<i64> = state.keys.values().filter_map(|(_, t)| *t).collect();
        Ok(Audit {
            balances: state.balances.iter().map(|(a, b)| (a.clone(), *b)).collect(),
            transfers: state.transfers.iter().enumerate().map(|(i, a)| (i as i64 + 1, *a)).collect(),
            orphans: (1..=state.transfers.len() as i64).filter(|id| !named.contains(id)).collect(),
            hollow: 0,
            keys_in_progress: state
                .keys
                .values()
                .filter(|(r, _)| matches!(r.state, KeyState::InProgress { .. }))
                .count() as i64,
            keys_completed: state
                .keys
                .values()
                .filter(|(r, _)| matches!(r.state, KeyState::Completed(_)))
                .count() as i64,
        })
    }
}

fn same_version(a: &KeyRecord, b: &KeyRecord) -> bool {
    a.token == b.token
        && matches!(a.state, KeyState::InProgress { .. }) == matches!(b.state, KeyState::InProgress { .. })
}

impl PayoutTx for MemTx<'_> {}

impl Tx for MemTx<'_> {
    fn insert_claim(&mut self, key: &ScopedKey, claim: &Claim) -> Result<Option<KeyRecord>, StoreError> {
        if let Some((existing, _)) = self.work.keys.get(key) {
            return Ok(Some(existing.clone()));
        }
        self.work.keys.insert(key.clone(), (fresh(claim), None));
        Ok(None)
    }
    fn replace_claim(
        &mut self,
        key: &ScopedKey,
        seen: &KeyRecord,
        claim: &Claim,
    ) -> Result<bool, StoreError> {
        match self.work.keys.get_mut(key) {
            Some(entry) if same_version(&entry.0, seen) => {
                *entry = (fresh(claim), None);
                Ok(true)
            }
            _ => Ok(false),
        }
    }
    fn lock_key(&mut self, key: &ScopedKey) -> Result<Option<KeyRecord>, StoreError> {
        Ok(self.work.keys.get(key).map(|(r, _)| r.clone()))
    }
    fn complete(
        &mut self,
        key: &ScopedKey,
        token: &str,
        response: &Stored,
        _: Timestamp,
    ) -> Result<bool, StoreError> {
        match self.work.keys.get_mut(key) {
            Some((record, named)) if record.held_by(token) => {
                record.state = KeyState::Completed(response.clone());
                *named = response.transfer_id;
                Ok(true)
            }
            _ => Ok(false),
        }
    }
    fn release(&mut self, key: &ScopedKey, token: &str) -> Result<bool, StoreError> {
        let held = self.work.keys.get(key).is_some_and(|(r, _)| r.held_by(token));
        if held {
            self.work.keys.remove(key);
        }
        Ok(held)
    }
    fn lock_account(&mut self, id: &AcctId) -> Result<Option<Account>, StoreError> {
        Ok(self.work.balances.get(id).map(|b| Account { id: id.clone(), balance: *b }))
    }
    fn add_to_balance(&mut self, id: &AcctId, delta: i64) -> Result<i64, StoreError> {
        let balance = self.work.balances.get_mut(id).ok_or(StoreError::Backend("no account".into()))?;
        *balance += delta;
        assert!(*balance >= 0, "a balance went negative");
        Ok(*balance)
    }
    fn insert_transfer(&mut self, t: &NewTransfer) -> Result<i64, StoreError> {
        self.work.transfers.push(t.amount);
        Ok(self.work.transfers.len() as i64)
    }
    fn purge(&mut self, before: Timestamp, limit: u64) -> Result<u64, StoreError> {
        let mut old: Vec<(Timestamp, ScopedKey)> = self
            .work
            .keys
            .iter()
            .filter(|(_, (r, _))| r.created_at < before)
            .map(|(k, (r, _))| (r.created_at, k.clone()))
            .collect();
        old.sort();
        old.truncate(usize::try_from(limit).unwrap_or(usize::MAX));
        for (_, k) in &old {
            self.work.keys.remove(k);
        }
        Ok(old.len() as u64)
    }
    fn in_progress(&mut self) -> Result<Vec<(ScopedKey, KeyRecord)>, StoreError> {
        let open = self.work.keys.iter().filter(|(_, (r, _))| matches!(r.state, KeyState::InProgress { .. }));
        Ok(open.map(|(k, (r, _))| (k.clone(), r.clone())).collect())
    }
    fn commit(mut self: Box<Self>) -> Result<(), StoreError> {
        *self.guard = std::mem::take(&mut self.work);
        Ok(())
    }
}

fn fresh(claim: &Claim) -> KeyRecord {
    KeyRecord {
        fingerprint: claim.fingerprint.clone(),
        created_at: claim.created_at,
        token: claim.token.clone(),
        state: KeyState::InProgress { lease_until: claim.lease_until },
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
fn racer<E: Engine>(engine: &mut E, name: &str, crash: bool) -> Option<Response> {
    let policy = Policy::embedded();
    let req = engine.parse(REQUEST.as_bytes(), policy).unwrap();
    let mut faults = |p: Point| if crash && p == Point::AfterClaim { Flow::Crash } else { Flow::Continue };
    match protocol::handle(engine, &req, Ctx { policy, now: t0(), token: name }, &mut faults).unwrap() {
        Outcome::Respond(r) => Some(r),
        Outcome::Crashed(_) => None,
    }
}

/// The real engine: `crashes[i]` says whether racer i dies right after
/// winning a claim.
pub fn race(crashes: &'static [bool]) {
    race_with(crashes, |store| store)
}

/// [`race`] with each racer's engine made by `engine` over the shared store.
pub fn race_with<E: Engine + Send + 'static>(
    crashes: &'static [bool],
    engine: impl Fn(MemStore) -> E + Send + Sync + 'static,
) {
    loom::model(move || {
        let store = new_store();
        let handles: Vec<_> = crashes
            .iter()
            .enumerate()
            .map(|(i, &crash)| {
                let mut racer_engine = engine(store.clone());
                loom::thread::spawn(move || racer(&mut racer_engine, &format!("racer-{i}"), crash))
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
        match &state.keys.values().next().unwrap().0.state {
            KeyState::Completed(stored) => {
                assert_eq!((state.transfers.len(), stored.status), (1, 201));
                for r in answers.iter().flatten().filter(|r| r.replay) {
                    assert_eq!(r.body, fresh[0].body, "replay bytes");
                }
            }
            KeyState::InProgress { .. } => assert!(state.transfers.is_empty() && died == 1),
        }
        for r in answers.iter().flatten().filter(|r| r.status != 201) {
            assert_eq!((r.status, r.reason.as_ref().map(|r| r.code())), (409, Some("in_progress")));
        }
        if died == 0 {
            assert_eq!(state.transfers.len(), 1, "nobody died, so somebody paid");
        }
        let money: i64 = state.balances.values().sum();
        assert_eq!(money, 100, "money conserved");

        // After the lease, a retry finishes what a dead claimant started, and
        // nothing has been paid twice.
        let policy = Policy::embedded();
        let mut retry_engine = engine(store.clone());
        let req = retry_engine.parse(REQUEST.as_bytes(), policy).unwrap();
        let later = t0().plus_seconds(i64::from(policy.in_progress_lease_seconds));
        let retry = protocol::handle(
            &mut retry_engine,
            &req,
            Ctx { policy, now: later, token: "retry" },
            &mut |_| Flow::Continue,
        )
        .unwrap();
        assert!(matches!(retry, Outcome::Respond(Response { status: 201, .. })));
        assert_eq!(store.0.lock().unwrap().transfers.len(), 1);
    });
}
