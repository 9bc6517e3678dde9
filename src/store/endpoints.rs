//! The client events sender's own SQL: which due events a round takes
//! ([`Take`]), and where each client's endpoint stands: since
//! when its deliveries fail (the streak a success ends), and whether it is
//! disabled until a person enables it again: at once on a 410 Gone, or
//! once it has failed for the configured span (5 days by default, as Svix).
//! One row per client that ever failed, in `client_endpoint`; the SQL is
//! both stores', written with SQLite's `?N` (PostgreSQL's `$N` by [`dollars`]).

/// The table, in [`super::PAYOUT_SCHEMA`]'s words (`{time}`).
pub(crate) const ENDPOINT_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS client_endpoint (
    client_id     text PRIMARY KEY,
    failing_since {time},
    disabled_at   {time},
    disabled_why  text);
";

/// A failed delivery at `?2` to client `?1`: starts its streak unless one
/// runs; its start.
pub(crate) const FAILED: &str = "INSERT INTO client_endpoint (client_id, failing_since) VALUES (?1, ?2)
     ON CONFLICT (client_id) DO UPDATE SET failing_since = COALESCE(client_endpoint.failing_since, excluded.failing_since)
     RETURNING failing_since";

/// A delivery to client `?1` taken: its streak is over.
pub(crate) const DELIVERED: &str = "UPDATE client_endpoint SET failing_since = NULL WHERE client_id = ?1";

/// Disables client `?1`'s endpoint at `?2` for why `?3`, unless it is
/// already: one row if it was not.
pub(crate) const DISABLE: &str = "INSERT INTO client_endpoint (client_id, disabled_at, disabled_why) VALUES (?1, ?2, ?3)
     ON CONFLICT (client_id) DO UPDATE SET disabled_at = excluded.disabled_at, disabled_why = excluded.disabled_why
     WHERE client_endpoint.disabled_at IS NULL";

/// Enables client `?1`'s endpoint again, its streak forgotten: one row if
/// it was disabled.
pub(crate) const ENABLE: &str =
    "UPDATE client_endpoint SET disabled_at = NULL, disabled_why = NULL, failing_since = NULL
     WHERE client_id = ?1 AND disabled_at IS NOT NULL";

/// The disabled endpoints: client, since when, why.
pub(crate) const DISABLED: &str = "SELECT client_id, disabled_at, disabled_why FROM client_endpoint
     WHERE disabled_at IS NOT NULL ORDER BY client_id";

/// Makes client `?1`'s events of changes at or after `?2` that were
/// delivered or failed pending again, due at `?3` (a client's outage
/// recovered: Svix's "recover since"); how many.
pub(crate) const REDELIVER_SINCE: &str = "UPDATE payout_event SET delivery = 'pending', next_at = ?3
     WHERE at >= ?2 AND delivery IN ('delivered', 'failed')
       AND payout_id IN (SELECT payout_id FROM payout WHERE client_id = ?1)";

/// `sql` in PostgreSQL's placeholders.
pub(crate) fn dollars(sql: &str) -> String {
    sql.replace('?', "$")
}

/// A disabled endpoint, as `DISABLED` reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Disabled {
    /// Whose endpoint.
    pub client_id: String,
    /// Disabled since.
    pub since: crate::clock::Timestamp,
    /// Why, in words.
    pub why: String,
}

/// Which due client events a sender takes: those due at `now`, at most
/// `per_client` of each client and `limit` in all, none of a client in
/// `busy` (its lane is still out), each until `until`.
pub struct Take<'a> {
    /// Due at.
    pub now: crate::clock::Timestamp,
    /// Taken until.
    pub until: crate::clock::Timestamp,
    /// The most in all.
    pub limit: i64,
    /// The most of one client.
    pub per_client: i64,
    /// The clients none is taken of.
    pub busy: &'a [String],
}

/// The ids of the due client events a [`Take`] names, for both stores,
/// given how each spells the time `now`, the set of `busy` clients and the
/// number `per_client` of each client.
pub(crate) fn due_by_client(now: &str, busy: &str, per_client: &str) -> String {
    format!(
        "SELECT w.event_id FROM (
           SELECT d.event_id, ROW_NUMBER() OVER (PARTITION BY q.client_id ORDER BY d.next_at, d.event_id) AS n
           FROM payout_event d JOIN payout q ON q.payout_id = d.payout_id
           WHERE d.delivery = 'pending' AND d.next_at <= {now} AND NOT q.client_id IN ({busy})) w
         WHERE w.n <= {per_client}"
    )
}
