//! A loom model of the claim race, over the real protocol code.
//!
//! The store (tests/engine/models/loom_claim.rs) keeps its state behind a loom
//! `Mutex`: a transaction holds the lock from `begin` to `commit`, as SQLite's
//! `BEGIN IMMEDIATE` holds the write lock. loom runs every interleaving of two
//! or three racers on one key, some dying right after their claim, and the
//! asserts after the joins must hold in all of them: at most one execution,
//! the others 409 or the replay, a dead claim never completed without its
//! execution, and a retry after the lease finishing the job exactly once. The
//! SQLite claim itself is raced with real processes in tests/engine/api.rs and
//! tests/engine/races.rs.

use crate::models::loom_claim::race;

#[test]
fn two_racers_one_key() {
    race(&[false, false]);
}

#[test]
fn three_racers_one_key() {
    race(&[false, false, false]);
}

#[test]
fn two_racers_one_dies_after_its_claim() {
    race(&[true, false]);
}

#[test]
fn three_racers_one_dies_after_its_claim() {
    race(&[false, true, false]);
}
