//! A storm of opposite transfers: processes released together send A→B and
//! B→A at once, on SQLite and on PostgreSQL under both isolation levels.
//! Locking the two accounts in one order whatever the direction means no
//! deadlock leaves a request unanswered, and relative balance updates mean
//! no concurrent debit is lost: the balances come out exact to the unit.

use crate::common::*;
use idem::harness::race::release_together;

const PROCESSES: usize = 8;
const ROUNDS: usize = 4;

#[test]
fn opposite_transfers_at_once_neither_deadlock_nor_lose_an_update() {
    for backend in backends() {
        let mut rng = rng();
        let bank =
            Bank::with(backend, &[(serde_json::json!("A"), 1_000_000), (serde_json::json!("B"), 1_000_000)]);
        let (a, b) = (&bank.accounts[0], &bank.accounts[1]);
        let mut want = [1_000_000i64, 1_000_000];
        for round in 0..ROUNDS {
            let mut files = Vec::new();
            for p in 0..PROCESSES {
                let amount = 1 + rng.below(1_000) as i64;
                let (src, dst, from) = if p % 2 == 0 { (a, b, 0) } else { (b, a, 1) };
                want[from] -= amount;
                want[1 - from] += amount;
                files.push(bank.request_file(&request(
                    "c",
                    "/t",
                    &format!("r{round}-p{p}"),
                    src,
                    dst,
                    amount,
                )));
            }
            let finished = release_together(&[API.into()], bank.db.as_os_str(), &files, &[]).unwrap();
            for f in finished {
                let r = Reply::from_finished(f);
                assert_eq!((r.status(), r.replay()), (201, false), "{backend:?}: {}", r.stdout);
            }
        }
        assert_eq!(bank.balances(), want, "{backend:?}: an update was lost");
        assert_eq!(bank.transfers().len(), PROCESSES * ROUNDS);
    }
}
