//! idem makes a money transfer go out exactly once, however often a client
//! retries it.
//!
//! A request carries an idempotency key scoped by `(client_id, endpoint,
//! idem_key)`. The engine claims the key before any money moves, completes it
//! in the same transaction that moves the money, and stores the response so a
//! retry gets the same bytes back. Claim → work → complete is conducted
//! once (`protocol::conduct`), what a retry meets is decided once
//! ([`protocol`]), and the key table is written once (`store::keys`):
//! `idem_api`, `idem serve` and the library run every key through them,
//! each over steps of its own store (`store::KeySteps`).
//!
//! # Layout
//!
//! Read [`protocol`] first: every answer a retry can meet is decided there.
//!
//! - The engine: [`protocol`] (claim → execute → complete; replay; 409; 422;
//!   settled keys), [`ledger`] (whether a transfer may go out, pure),
//!   [`request`] (parsing and every 400), [`canonical`] (RFC 8785 and the
//!   fingerprint), [`reason`] (why an answer is not a plain success),
//!   [`policy`], [`clock`], [`rng`].
//! - Storage: [`store`], idem's tables and all their SQL: the contract
//!   (`Store`, `Tx`, `Reads`, `KeySteps`, `Steps`), its rows, the key table's one shape
//!   and statements (`store::keys`), and its two backends (`store::sqlite`,
//!   `store::pg` with the service's async pool).
//! - The library: [`embed`] (a caller's own work made idempotent in the
//!   caller's own transaction, on SQLite or PostgreSQL, and an axum layer),
//!   conducted by [`protocol`] over the caller's transaction and stored
//!   through `store::keys`.
//! - The binaries' modules, with feature `cli` only (so not on docs.rs):
//!   `payout` (payouts through an outside gateway: the conductor, the
//!   gateway's answer table, the reconciler, the runbook, provider events);
//!   the fronts `api` (the lab's command-line contract, `idem_api`),
//!   `service` (`idem serve`: the protocol over HTTP) and `client` (the
//!   retrying client, `idem transfer`); `check`, the checker of other
//!   people's implementations (`idem check --engine`, `--url`); `harness`,
//!   the proofs of idem (the day behind `idem prove`, scenarios, races,
//!   `idem chaos`); `outside`, stand-ins for the world outside (a payout
//!   gateway with seeded faults, a lossy network, a slow hop).
//!
//! The binaries (`src/bin/`) parse the command line, read the environment,
//! print, and choose the exit code; nothing in the library does.
//!
//! # Features
//!
//! - `cli` (default): the binaries' modules and both stores; everything
//!   above but the engine's core and [`embed`] needs it.
//! - `sqlite`, `postgres`: [`embed`]'s stores (`embed::sqlite`, `embed::pg`).
//! - `axum` (default): `embed::layer`, the middleware, over the stores on.
//!
//! The crate is `idem-keys` on crates.io (`idem` there is an unrelated
//! crate); in code it is `idem`. A service that embeds it on PostgreSQL
//! takes the library alone, no binaries:
//! `idem-keys = { version = "0.1", default-features = false, features = ["postgres", "axum"] }`.

// No unsafe code, but where a function says why it needs some (four calls
// into libc that std has no safe form of: mallopt, get/setrlimit, prctl's
// timer slack, kill with SIGTERM), and there every unsafe block says why it
// is sound (a `// SAFETY:` comment); an unsafe fn's body is no unsafe block
// by default. A `pub` item is reachable from the crate's root, or says how
// far it reaches.
//
// `missing_docs` is on for the library a team embeds, the build without
// `cli` (docs.rs's, and CI's clippy under each library feature, where a
// warning fails): every public item there says what it is. The binaries'
// modules (`cli`) are not held to it: their users are the binaries.
// Without `cli`, the stores' shared SQL and row types have no store to use
// them: dead code in that build only.
#![cfg_attr(not(feature = "cli"), allow(dead_code))]
// docs.rs (nightly) marks each item with the features it needs
#![cfg_attr(docsrs, feature(doc_cfg))]
#![cfg_attr(not(feature = "cli"), warn(missing_docs))]
#![deny(unsafe_code, clippy::undocumented_unsafe_blocks, unsafe_op_in_unsafe_fn, unreachable_pub)]

pub mod canonical;
pub mod clock;
pub mod hex;
pub mod ledger;
pub mod policy;
pub mod protocol;
pub mod provider;
pub mod reason;
pub mod request;
pub mod rng;
pub mod store;

// the library face: the key in the caller's own transaction
pub mod embed;

// the binaries' modules (feature `cli`, on by default)
#[cfg(feature = "cli")]
pub mod api;
#[cfg(feature = "cli")]
pub mod check;
#[cfg(feature = "cli")]
pub mod client;
#[cfg(feature = "cli")]
pub mod harness;
#[cfg(feature = "cli")]
pub mod https;
#[cfg(feature = "cli")]
pub mod outside;
#[cfg(feature = "cli")]
pub mod payout;
#[cfg(feature = "cli")]
pub mod service;
