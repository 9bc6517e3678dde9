//! Races across real processes: K `idem_api` processes on one database
//! (SQLite, and PostgreSQL under both isolation levels), released together,
//! sending overlapping keys in different orders. Afterwards every key has
//! paid at most once, every 201 for a key names the same transfer, and the
//! balances are what paying each key once gives.

use crate::common::*;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Barrier};

const PROCESSES: usize = 8;
const KEYS: usize = 12;

#[test]
fn processes_racing_on_overlapping_keys_pay_each_key_once() {
    for backend in backends() {
        race_on(backend);
    }
}

fn race_on(backend: Backend) {
    let mut rng = rng();
    let bank = Bank::on(backend, &mut rng, 3, false);
    let before = bank.balances();
    let amounts: Vec<i64> = (0..KEYS).map(|_| 1 + rng.below(50) as i64).collect();
    let files = ring_requests(&bank, "race", &amounts);
    let barrier = Arc::new(Barrier::new(PROCESSES));
    let workers: Vec<_> = (0..PROCESSES)
        .map(|p| {
            let order: Vec<usize> = (0..KEYS).map(|i| (i * (p + 1) + p) % KEYS).collect();
            let (files, db, barrier) = (files.clone(), bank.db.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                order
                    .into_iter()
                    .map(|i| {
                        let out = std::process::Command::new(API)
                            .arg("--db")
                            .arg(&db)
                            .arg("--request")
                            .arg(&files[i])
                            .output()
                            .unwrap();
                        (i, Reply::from_output(out))
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let replies: Vec<(usize, Reply)> = workers.into_iter().flat_map(|w| w.join().unwrap()).collect();

    let mut ids: BTreeMap<usize, BTreeSet<i64>> = BTreeMap::new();
    let mut fresh: BTreeMap<usize, usize> = BTreeMap::new();
    for (i, r) in &replies {
        match (r.status(), r.replay(), r.reason()) {
            (201, replay, None) => {
                ids.entry(*i).or_default().insert(r.json["body"]["transfer_id"].as_i64().unwrap());
                *fresh.entry(*i).or_default() += usize::from(!replay);
            }
            (409, false, Some("in_progress")) => {}
            other => panic!("key {i}: unexpected {other:?}"),
        }
    }
    assert!(ids.values().all(|s| s.len() == 1), "a key named two transfers: {ids:?}");
    assert!(fresh.values().all(|n| *n == 1), "a key executed twice: {fresh:?}");
    assert_eq!(bank.transfers().len(), ids.len());
    let want = ring_balances(&before, &amounts, ids.keys().copied());
    assert_eq!(bank.balances(), want);
    assert_eq!(want.iter().sum::<i64>(), before.iter().sum::<i64>());
    // the last process to touch each key saw it completed, or a retry now does
    for (i, file) in files.iter().enumerate() {
        let r = Reply::from_output(bank.command(file).output().unwrap());
        assert_eq!(r.status(), 201, "key {i}");
    }
    assert_eq!(bank.transfers().len(), KEYS);
}
