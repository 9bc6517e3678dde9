//! The engine's suites, in one test binary: the lab's contract on the real
//! `idem_api`, the scenarios, the storm against the oracle, races, kills,
//! crashes, durability under strace, hostile input, the loom models, the
//! day (`prove`), the library face (`idem::embed`), and the teeth that prove the suite catches broken
//! engines. Most run on every store (SQLite, PostgreSQL, PostgreSQL under
//! SERIALIZABLE). One binary instead of one per file: the shared support
//! (`tests/support`) is compiled and linked once.

#[path = "../support/mod.rs"]
mod common;
mod models;

mod api;
mod durability;
mod embed;
mod failures;
mod hardening;
mod hostile;
mod kill;
mod loom_claim;
mod loom_rows;
mod opposite;
mod payout_storm;
mod pg_restart;
mod policy;
mod prove;
mod races;
mod scenarios;
mod secrets;
mod settled;
mod stale;
mod storm;
mod teeth;
