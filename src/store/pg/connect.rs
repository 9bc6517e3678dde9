//! The engine's connections to PostgreSQL (reached by `store::reach`): the
//! session's timeouts, and the driver's errors as the store's.

use super::*;

/// A connection configured for the engine: lock waits end at the busy
/// budget (and become 503s), and the money commit is durable even if the
/// server's default says otherwise.
pub(super) fn session(spec: &str, policy: &Policy) -> Result<Client, StoreError> {
    let mut client = client(spec, policy)?;
    client
        .batch_execute(&session_sql(policy))
        .map_err(|e| redacted("cannot configure the session", &e, spec))?;
    Ok(client)
}

/// What every connection that runs requests sets first.
pub(in crate::store) fn session_sql(policy: &Policy) -> String {
    format!(
        "SET lock_timeout = {}; SET statement_timeout = {STATEMENT_TIMEOUT_MS}; SET synchronous_commit = on",
        policy.busy_timeout_ms
    )
}

/// The longest any one statement may run on the server: every statement of
/// a request takes milliseconds, and its lock waits end at the busy budget.
pub(in crate::store) const STATEMENT_TIMEOUT_MS: u32 = 15_000;

/// A plain connection to the database `spec` names, with a connect timeout
/// of the busy budget and the network timeouts above, each unless `spec`
/// sets its own. The error never quotes `spec`.
pub(in crate::store) fn client(spec: &str, policy: &Policy) -> Result<Client, StoreError> {
    Client::connect(&configure(spec, policy)?, spec)
}

/// A driver error as a store error: transient ones by kind, the rest as one
/// line without row data.
pub(in crate::store) fn pg(e: tokio_postgres::Error) -> StoreError {
    match e.code() {
        Some(c) if *c == SqlState::T_R_SERIALIZATION_FAILURE || *c == SqlState::T_R_DEADLOCK_DETECTED => {
            StoreError::Conflict
        }
        Some(c) if *c == SqlState::LOCK_NOT_AVAILABLE || *c == SqlState::QUERY_CANCELED => StoreError::Busy,
        _ if lost(&e) => StoreError::Unavailable(format!("PostgreSQL: {}", describe(&e))),
        _ => StoreError::Backend(format!("PostgreSQL: {}", describe(&e)).into()),
    }
}

/// Whether `e` is the driver's timeout, which the blocking client gives
/// when a statement outlives its deadline (the driver has no other way to
/// say so: its kinds are private).
fn timed_out(e: &tokio_postgres::Error) -> bool {
    e.to_string() == tokio_postgres::Error::__private_api_timeout().to_string()
}

/// Whether `e` says this connection cannot go on: the server went away (a
/// restart, a failover, a killed backend: 57P, 08), is out of resources
/// (53: disk full, memory, connections), or is a standby that cannot write
/// (25006). Nothing of the transaction is known to have committed but what
/// a retry will find; the next transaction runs on a new connection.
pub(in crate::store) fn lost(e: &tokio_postgres::Error) -> bool {
    match e.code() {
        Some(c) => {
            let c = c.code();
            c.starts_with("57P") || c.starts_with("08") || c.starts_with("53") || c == "25006"
        }
        None => {
            e.is_closed()
                || std::error::Error::source(e).is_some_and(|s| s.is::<std::io::Error>())
                || timed_out(e)
        }
    }
}
