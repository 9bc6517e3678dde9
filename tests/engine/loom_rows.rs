//! The protocol over per-row locks (`tests/engine/models/loom_rows.rs`), as
//! PostgreSQL runs it: the key row, then the accounts in order, each held to
//! commit. loom tries every interleaving: racers on one key execute it once,
//! and opposite transfers on two keys neither deadlock nor lose money.

use crate::models::loom_rows::race_rows;

#[test]
fn racers_on_one_key_under_row_locks_execute_it_once() {
    race_rows(&[("k", "A", "B", 30), ("k", "A", "B", 30)], |store| store);
}

#[test]
fn opposite_transfers_under_row_locks_neither_deadlock_nor_lose_money() {
    race_rows(&[("k1", "A", "B", 30), ("k2", "B", "A", 20)], |store| store);
}
