//! A loom model with per-row locks, as PostgreSQL gives them under READ
//! COMMITTED: no global writer lock. Each statement reads the latest
//! committed rows (plus the transaction's own writes); `lock_key` and
//! `lock_account` take a row lock held to commit or rollback, waiting while
//! another transaction holds it; a takeover's NOWAIT fails at once on a held
//! row; a claim insert waits only for a racer's uncommitted insert of the
//! same key. Writes are buffered and applied at commit. A lock-order bug
//! shows up as a deadlock (every thread waiting), a lost update as money
//! created or destroyed.

use idem::clock::Timestamp;
use idem::request::{AcctId, ScopedKey};
use idem::store::{
    Account, Audit, Claim, Durability, KeyRecord, KeyState, NewTransfer, PayoutTx, Store, StoreError, Stored,
    Tx,
};
use loom::sync::{Arc, Condvar, Mutex};
use std::collections::BTreeMap;

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum RowId {
    Key(ScopedKey),
    Account(AcctId),
}

#[derive(Clone, Default)]
pub struct Committed {
    pub keys: BTreeMap<ScopedKey, KeyRecord>,
    pub balances: BTreeMap<AcctId, i64>,
    pub transfers: Vec<i64>,
}

#[derive(Default)]
struct Db {
    committed: Committed,
    /// Which transaction holds each row lock.
    locks: BTreeMap<RowId, u64>,
    next_tx: u64,
}

#[derive(Clone)]
pub struct RowStore(Arc<(Mutex<Db>, Condvar)>);

impl RowStore {
    pub fn new(balances: &[(&str, i64)]) -> Self {
        let mut db = Db::default();
        for (id, b) in balances {
            db.committed.balances.insert(AcctId::Text((*id).into()), *b);
        }
        RowStore(Arc::new((Mutex::new(db), Condvar::new())))
    }

    pub fn committed(&self) -> Committed {
        self.0.0.lock().unwrap().committed.clone()
    }
}

struct RowTx {
    db: Arc<(Mutex<Db>, Condvar)>,
    id: u64,
    keys: BTreeMap<ScopedKey, Option<KeyRecord>>,
    balances: BTreeMap<AcctId, i64>,
    transfers: Vec<i64>,
}

impl Store for RowStore {
    fn begin(&mut self, _: Durability) -> Result<Box<dyn Tx + '_>, StoreError> {
        let mut db = self.0.0.lock().unwrap();
        db.next_tx += 1;
        let id = db.next_tx;
        drop(db);
        Ok(Box::new(RowTx {
            db: self.0.clone(),
            id,
            keys: BTreeMap::new(),
            balances: BTreeMap::new(),
            transfers: Vec::new(),
        }))
    }
    fn audit(&mut self) -> Result<Audit, StoreError> {
        let c = self.committed();
        Ok(Audit { balances: c.balances.into_iter().collect(), ..Audit::default() })
    }
}

impl RowTx {
    /// Waits until no other transaction holds `row`, then holds it.
    fn lock(&self, row: RowId) {
        let (mutex, freed) = &*self.db;
        let mut db = mutex.lock().unwrap();
        while db.locks.get(&row).is_some_and(|holder| *holder != self.id) {
            db = freed.wait(db).unwrap();
        }
        db.locks.insert(row, self.id);
    }

    /// Holds `row` if nobody else does; `false` at once otherwise (NOWAIT).
    fn try_lock(&self, row: RowId) -> bool {
        let mut db = self.db.0.lock().unwrap();
        match db.locks.get(&row) {
            Some(holder) if *holder != self.id => false,
            _ => {
                db.locks.insert(row, self.id);
                true
            }
        }
    }

    fn holds(&self, row: &RowId) -> bool {
        self.db.0.lock().unwrap().locks.get(row) == Some(&self.id)
    }

    fn unlock(&self, row: &RowId) {
        let (mutex, freed) = &*self.db;
        mutex.lock().unwrap().locks.remove(row);
        freed.notify_all();
    }

    /// The key as this transaction sees it: its own write, else committed.
    fn key(&self, key: &ScopedKey) -> Option<KeyRecord> {
        match self.keys.get(key) {
            Some(own) => own.clone(),
            None => self.db.0.lock().unwrap().committed.keys.get(key).cloned(),
        }
    }

    fn balance(&self, id: &AcctId) -> Option<i64> {
        match self.balances.get(id) {
            Some(own) => Some(*own),
            None => self.db.0.lock().unwrap().committed.balances.get(id).copied(),
        }
    }

    fn end(&self) {
        let (mutex, freed) = &*self.db;
        mutex.lock().unwrap().locks.retain(|_, holder| *holder != self.id);
        freed.notify_all();
    }
}

impl Drop for RowTx {
    fn drop(&mut self) {
        // A rollback: the buffered writes are simply forgotten. While loom
        // unwinds from a failure (a deadlock), touching its mutex would abort.
        if !std::thread::panicking() {
            self.end();
        }
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

fn same_version(a: &KeyRecord, b: &KeyRecord) -> bool {
    a.token == b.token
        && matches!(a.state, KeyState::InProgress { .. }) == matches!(b.state, KeyState::InProgress { .. })
}

impl PayoutTx for RowTx {}

impl Tx for RowTx {
    fn insert_claim(&mut self, key: &ScopedKey, claim: &Claim) -> Result<Option<KeyRecord>, StoreError> {
        if let Some(existing) = self.key(key) {
            return Ok(Some(existing)); // DO NOTHING: no lock, no wait
        }
        // Only a racer's uncommitted insert of the same key makes us wait.
        let row = RowId::Key(key.clone());
        let held_before = self.holds(&row);
        self.lock(row.clone());
        if let Some(existing) = self.key(key) {
            if !held_before {
                self.unlock(&row);
            }
            return Ok(Some(existing));
        }
        self.keys.insert(key.clone(), Some(fresh(claim)));
        Ok(None)
    }
    fn replace_claim(
        &mut self,
        key: &ScopedKey,
        seen: &KeyRecord,
        claim: &Claim,
    ) -> Result<bool, StoreError> {
        if !self.try_lock(RowId::Key(key.clone())) {
            return Ok(false);
        }
        match self.key(key) {
            Some(now) if same_version(&now, seen) => {
                self.keys.insert(key.clone(), Some(fresh(claim)));
                Ok(true)
            }
            _ => Ok(false),
        }
    }
    fn lock_key(&mut self, key: &ScopedKey) -> Result<Option<KeyRecord>, StoreError> {
        self.lock(RowId::Key(key.clone()));
        Ok(self.key(key))
    }
    fn complete(
        &mut self,
        key: &ScopedKey,
        token: &str,
        response: &Stored,
        _: Timestamp,
    ) -> Result<bool, StoreError> {
        self.lock(RowId::Key(key.clone()));
        match self.key(key) {
            Some(mut record) if record.held_by(token) => {
                record.state = KeyState::Completed(response.clone());
                self.keys.insert(key.clone(), Some(record));
                Ok(true)
            }
            _ => Ok(false),
        }
    }
    fn release(&mut self, key: &ScopedKey, token: &str) -> Result<bool, StoreError> {
        self.lock(RowId::Key(key.clone()));
        let held = self.key(key).is_some_and(|r| r.held_by(token));
        if held {
            self.keys.insert(key.clone(), None);
        }
        Ok(held)
    }
    fn lock_account(&mut self, id: &AcctId) -> Result<Option<Account>, StoreError> {
        self.lock(RowId::Account(id.clone()));
        Ok(self.balance(id).map(|balance| Account { id: id.clone(), balance }))
    }
    fn add_to_balance(&mut self, id: &AcctId, delta: i64) -> Result<i64, StoreError> {
        self.lock(RowId::Account(id.clone()));
        let balance = self.balance(id).ok_or(StoreError::Backend("no account".into()))? + delta;
        if balance < 0 {
            return Err(StoreError::Backend("a balance would go negative".into()));
        }
        self.balances.insert(id.clone(), balance);
        Ok(balance)
    }
    fn insert_transfer(&mut self, t: &NewTransfer) -> Result<i64, StoreError> {
        self.transfers.push(t.amount);
        Ok(self.transfers.len() as i64)
    }
    fn purge(&mut self, _: Timestamp, _: u64) -> Result<u64, StoreError> {
        Ok(0)
    }
    fn in_progress(&mut self) -> Result<Vec<(ScopedKey, KeyRecord)>, StoreError> {
        Ok(Vec::new())
    }
    fn commit(self: Box<Self>) -> Result<(), StoreError> {
        let mut db = self.db.0.lock().unwrap();
        for (key, record) in &self.keys {
            match record {
                Some(r) => db.committed.keys.insert(key.clone(), r.clone()),
                None => db.committed.keys.remove(key),
            };
        }
        for (id, b) in &self.balances {
            db.committed.balances.insert(id.clone(), *b);
        }
        db.committed.transfers.extend(&self.transfers);
        drop(db);
        Ok(()) // the locks go with the drop
    }
}

const START: &str = "2026-12-01T00:00:00Z";

/// Racers, each `(idem_key, src, dst, amount)`, through engines made by
/// `engine` over one row-locked store holding A=100 and B=100. Checks, in
/// every interleaving: each key executed at most once and every answer is
/// 201, its replay, or 409; money conserved; balances exactly those of the
/// keys that executed.
pub fn race_rows<E: idem::protocol::Engine + Send + 'static>(
    racers: &'static [(&'static str, &'static str, &'static str, i64)],
    engine: impl Fn(RowStore) -> E + Send + Sync + 'static,
) {
    use idem::policy::Policy;
    use idem::protocol::{self, Ctx, Flow, Outcome, Response};
    // Bounded preemptions keep the search to seconds; the bugs it is for
    // (a lock-order deadlock, a lost update) need only two.
    let mut model = loom::model::Builder::new();
    model.preemption_bound = Some(2);
    model.check(move || {
        let store = RowStore::new(&[("A", 100), ("B", 100)]);
        let handles: Vec<_> = racers
            .iter()
            .enumerate()
            .map(|(i, &(key, src, dst, amount))| {
                let mut racer = engine(store.clone());
                loom::thread::spawn(move || {
                    let policy = Policy::embedded();
                    let text = format!(
                        r#"{{"client_id":"c","endpoint":"/t","idem_key":"{key}","body":{{"src":"{src}","dst":"{dst}","amount":{amount},"currency":"KRW"}}}}"#
                    );
                    let req = racer.parse(text.as_bytes(), policy).unwrap();
                    let now = Timestamp::parse(START).unwrap();
                    let token = format!("racer-{i}");
                    match protocol::handle(&mut racer, &req, Ctx { policy, now, token: &token }, &mut |_| Flow::Continue) {
                        Ok(Outcome::Respond(r)) => r,
                        other => panic!("racer {i}: {other:?}"),
                    }
                })
            })
            .collect();
        let answers: Vec<Response> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let state = store.committed();
        let mut want = BTreeMap::from([(AcctId::Text("A".into()), 100), (AcctId::Text("B".into()), 100)]);
        let mut executed = BTreeMap::new();
        for ((key, src, dst, amount), r) in racers.iter().zip(&answers) {
            match (r.status, r.replay) {
                (201, false) => {
                    assert!(executed.insert(*key, ()).is_none(), "key {key} executed twice");
                    *want.get_mut(&AcctId::Text((*src).into())).unwrap() -= amount;
                    *want.get_mut(&AcctId::Text((*dst).into())).unwrap() += amount;
                }
                (201, true) | (409, false) => {}
                other => panic!("unexpected answer {other:?}"),
            }
        }
        assert_eq!(state.transfers.len(), executed.len(), "a transfer without a fresh 201");
        assert_eq!(state.balances, want, "balances are not those of the keys that executed");
    });
}
