//! idem makes a money transfer go out exactly once, however often a client
//! retries it.
//!
//! A request carries an idempotency key scoped by `(client_id, endpoint,
//! idem_key)`. The engine claims the key before any money moves, completes it
//! in the same transaction that moves the money, and stores the response so a
//! retry gets the same bytes back. The `idem_api` binary is the lab's
//! contract; the `idem` binary is the harness that generates a day of traffic
//! and proves nothing was paid twice.
//!
//! The engine:

// Every unsafe block says why it is sound (a `// SAFETY:` comment), and an
// unsafe fn's body is no unsafe block by default.
#![deny(clippy::undocumented_unsafe_blocks, unsafe_op_in_unsafe_fn)]

pub mod canonical; // RFC 8785 canonical JSON and the SHA-256 fingerprint
pub mod clock; // RFC 3339 instants in one sortable text form
pub mod ledger; // whether a transfer may go out, and the balances that decision rests on
pub mod payout; // payouts through an outside gateway: intent, call, result; reconcile
pub mod policy; // policy.json, embedded: every number the engine enforces
pub mod protocol; // claim → execute → complete, replay, conflict; the core
pub mod reason; // why an answer is not a plain success, typed
pub mod request; // request parsing and validation; every 400 reason
pub mod rng; // a seeded SplitMix64, the same on every machine
pub mod store; // the store contract and its backends; all SQL lives here

// Its fronts:
pub mod api; // the lab's command-line contract (the idem_api binary)
pub mod client; // the retrying client: one key, backoff with jitter, a deadline
pub mod service; // idem serve: the same protocol behind HTTP

// Around it:
pub mod check; // idem check: the contract judged on anyone's implementation
pub mod harness; // the day, scenarios, races and chaos that prove idem
pub mod outside; // stand-ins for the outside world: a payout gateway, a lossy network, a slow hop
