//! `idem serve` and its clients, in one test binary: the HTTP contract on a
//! real server, availability under hostile load, group commit, the retrying
//! client, chaos days through a lossy network, and the example service built
//! on the library's layer.

#[path = "../support/mod.rs"]
#[allow(dead_code)] // shared with the engine's suites, which also use its request helpers
mod common;
mod server;

mod abandon;
mod availability;
mod batches;
mod chaos;
mod client;
mod failover;
mod gateway;
mod group_commit;
mod layer_bodies;
mod layer_calls;
mod layer_scope;
mod layer_trips;
mod layer_wait;
mod ledger;
mod lifetime;
mod payouts;
mod serve;
mod tls;
mod told;
mod wait;
