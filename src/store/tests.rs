use super::*;

/// A store whose commits fail with a conflict until `conflicts` is spent.
struct Flaky {
    conflicts: u32,
    attempts: u32,
}

struct FlakyTx<'a>(&'a mut Flaky);

impl Store for Flaky {
    fn begin(&mut self, _: Durability) -> Result<Box<dyn Tx + '_>, StoreError> {
        self.attempts += 1;
        Ok(Box::new(FlakyTx(self)))
    }
    fn audit(&mut self) -> Result<Audit, StoreError> {
        Ok(Audit::default())
    }
}

impl PayoutTx for FlakyTx<'_> {}

impl Tx for FlakyTx<'_> {
    fn insert_claim(&mut self, _: &ScopedKey, _: &Claim) -> Result<Option<KeyRecord>, StoreError> {
        Ok(None)
    }
    fn replace_claim(&mut self, _: &ScopedKey, _: &KeyRecord, _: &Claim) -> Result<bool, StoreError> {
        Ok(true)
    }
    fn lock_key(&mut self, _: &ScopedKey) -> Result<Option<KeyRecord>, StoreError> {
        Ok(None)
    }
    fn complete(&mut self, _: &ScopedKey, _: &str, _: &Stored, _: Timestamp) -> Result<bool, StoreError> {
        Ok(true)
    }
    fn release(&mut self, _: &ScopedKey, _: &str) -> Result<bool, StoreError> {
        Ok(true)
    }
    fn lock_account(&mut self, _: &AcctId) -> Result<Option<Account>, StoreError> {
        Ok(None)
    }
    fn add_to_balance(&mut self, _: &AcctId, _: i64) -> Result<i64, StoreError> {
        Ok(0)
    }
    fn insert_transfer(&mut self, _: &NewTransfer) -> Result<i64, StoreError> {
        Ok(1)
    }
    fn purge(&mut self, _: Timestamp, _: u64) -> Result<u64, StoreError> {
        Ok(0)
    }
    fn in_progress(&mut self) -> Result<Vec<(ScopedKey, KeyRecord)>, StoreError> {
        Ok(Vec::new())
    }
    fn commit(self: Box<Self>) -> Result<(), StoreError> {
        match self.0.conflicts {
            0 => Ok(()),
            _ => {
                self.0.conflicts -= 1;
                Err(StoreError::Conflict)
            }
        }
    }
}

fn policy(busy_timeout_ms: u32) -> Policy {
    Policy { busy_timeout_ms, ..Policy::embedded().clone() }
}

#[test]
fn a_conflict_runs_the_work_again_until_it_commits() {
    let mut store = Flaky { conflicts: 3, attempts: 0 };
    let got = atomically(&mut store, Durability::Lazy, &policy(5_000), |_| Ok(End::Commit(7)));
    assert_eq!((got, store.attempts), (Ok(7), 4));
    // a rollback is an answer, not a conflict: one attempt
    let mut store = Flaky { conflicts: 3, attempts: 0 };
    let got = atomically(&mut store, Durability::Lazy, &policy(5_000), |_| Ok(End::Rollback(8)));
    assert_eq!((got, store.attempts), (Ok(8), 1));
}

#[test]
fn conflicts_past_the_busy_budget_are_busy_after_a_growing_pause() {
    let mut store = Flaky { conflicts: u32::MAX, attempts: 0 };
    let started = Instant::now();
    let got = atomically(&mut store, Durability::Lazy, &policy(100), |_| Ok(End::Commit(())));
    let waited = started.elapsed();
    assert_eq!(got, Err(StoreError::Busy));
    assert!(waited >= Duration::from_millis(40) && waited < Duration::from_millis(400), "{waited:?}");
    // 0.2, 0.4, 0.8 … ms doubling to 20 ms: about ten attempts in 100 ms
    assert!((5..=16).contains(&store.attempts), "{} attempts", store.attempts);
}
