//! Payouts as the store keeps them: the rows, their states, the SQL both
//! stores speak about them, and the payout half of a transaction.

use super::StoreError;
use crate::clock::Timestamp;
use crate::request::{AcctId, ScopedKey};

/// Where a payout stands (the transitions are `src/payout/`'s, listed in
/// `docs/payouts.md`). The money is held (debited from `src`) while it is
/// `InProgress` (a call to the gateway may be under way), `Unknown` (a call
/// ended without a definitive answer: looked up and resent with backoff) or
/// `NeedsAttention` (an answer no resend can fix: a person settles it).
/// `Completed`: the gateway paid. `Failed`: it refused for good, the hold
/// went back to `src`. `Returned`: paid, then the money came back (a bank
/// return, a reversal), credited back to `src`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum PayoutState {
    /// The request's own call is out.
    InProgress,
    /// Sent, its outcome not known: looked up until it is.
    Unknown,
    /// Waiting for a person (`idem payouts settle`).
    NeedsAttention,
    /// Paid.
    Completed,
    /// Not paid: the hold went back to `src`.
    Failed,
    /// Paid, then the money came back: credited back to `src`.
    Returned,
}

impl PayoutState {
    /// Every state, in the order the tables list them.
    pub const ALL: [PayoutState; 6] = [
        PayoutState::InProgress,
        PayoutState::Unknown,
        PayoutState::NeedsAttention,
        PayoutState::Completed,
        PayoutState::Failed,
        PayoutState::Returned,
    ];

    /// The state as the tables spell it.
    pub fn name(self) -> &'static str {
        match self {
            PayoutState::InProgress => "in_progress",
            PayoutState::Unknown => "unknown",
            PayoutState::NeedsAttention => "needs_attention",
            PayoutState::Completed => "completed",
            PayoutState::Failed => "failed",
            PayoutState::Returned => "returned",
        }
    }

    /// Reads a state as the tables spell it.
    pub fn parse(text: &str) -> Result<PayoutState, StoreError> {
        PayoutState::ALL
            .into_iter()
            .find(|s| s.name() == text)
            .ok_or_else(|| StoreError::Backend(format!("corrupt payout row: state {text:?}").into()))
    }

    /// Whether the outcome is known: the hold was paid out or went back.
    pub fn settled(self) -> bool {
        matches!(self, PayoutState::Completed | PayoutState::Failed | PayoutState::Returned)
    }
}

/// A payout's row: the intent and where it stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PayoutRow {
    /// The payout's id (`/v1/payouts/{id}`).
    pub id: i64,
    /// The idempotency key it was made under, and the request's fingerprint.
    pub key: ScopedKey,
    /// SHA-256 hex of the RFC 8785 form of the request's body.
    pub fingerprint: String,
    /// The account the money leaves.
    pub src: AcctId,
    /// Who it goes to, as the gateway names them.
    pub beneficiary: String,
    /// In the currency's smallest unit.
    pub amount: i64,
    /// An ISO 4217 code.
    pub currency: String,
    /// The key the gateway sees: derived from this row, never the client's.
    pub downstream_key: String,
    /// Where it stands.
    pub state: PayoutState,
    /// Who may call the gateway for it now (a request, or a reconciler)…
    pub holder: String,
    /// …until then; for an `Unknown` payout, when it is next looked at.
    pub lease_until: Timestamp,
    /// When it was made.
    pub created_at: Timestamp,
    /// When it last changed.
    pub updated_at: Timestamp,
    /// The last thing learnt: the gateway's reason, or why it is unknown.
    pub note: Option<String>,
    /// The HTTP status of the settled answer (201, or the refusal's).
    pub status: Option<u16>,
    /// How many times it was sent to the gateway (counted before each send).
    pub sends: i64,
    /// How many times a reconciler took it (its backoff grows with them).
    pub attempts: i64,
    /// The provider's own id for the payout, once known.
    pub provider_id: Option<String>,
}

/// A payout's row as a store reads it, before it is checked: each store
/// fills one, [`PayoutText::decode`] reads it.
pub(crate) struct PayoutText {
    pub id: i64,
    pub key: ScopedKey,
    pub fingerprint: String,
    pub src: AcctId,
    pub beneficiary: String,
    pub amount: i64,
    pub currency: String,
    pub downstream_key: String,
    pub state: String,
    pub holder: String,
    pub lease_until: String,
    pub created_at: String,
    pub updated_at: String,
    pub note: Option<String>,
    pub status: Option<i64>,
    pub sends: i64,
    pub attempts: i64,
    pub provider_id: Option<String>,
}

impl PayoutText {
    pub(crate) fn decode(self) -> Result<PayoutRow, StoreError> {
        let corrupt = |why: String| StoreError::Backend(format!("corrupt payout row: {why}").into());
        let time = |text: &str| Timestamp::parse(text).map_err(|e| corrupt(e.to_string()));
        Ok(PayoutRow {
            id: self.id,
            key: self.key,
            fingerprint: self.fingerprint,
            src: self.src,
            beneficiary: self.beneficiary,
            amount: self.amount,
            currency: self.currency,
            downstream_key: self.downstream_key,
            state: PayoutState::parse(&self.state)?,
            holder: self.holder,
            lease_until: time(&self.lease_until)?,
            created_at: time(&self.created_at)?,
            updated_at: time(&self.updated_at)?,
            note: self.note,
            status: self
                .status
                .map(|s| u16::try_from(s).map_err(|_| corrupt(format!("status {s}"))))
                .transpose()?,
            sends: self.sends,
            attempts: self.attempts,
            provider_id: self.provider_id,
        })
    }
}

/// A provider event as `gateway_event` keeps it: its id, when it came, its
/// type, the downstream key it names, and what it did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GatewayEventRow {
    /// The provider's id for the event.
    pub event_id: String,
    /// When it came (RFC 3339).
    pub received_at: String,
    /// Its type (`payout.paid`, `payout.returned`, …).
    pub kind: String,
    /// The downstream key it names.
    pub downstream_key: String,
    /// What it did.
    pub outcome: String,
}

/// The events a person must look at, in SQL both stores speak.
pub(crate) const EVENTS_FOR_A_PERSON: &str = "SELECT event_id, received_at, kind, downstream_key, outcome
     FROM gateway_event WHERE outcome LIKE 'needs a person%' ORDER BY received_at, event_id LIMIT ";

/// The payouts in one state, for the metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PayoutStat {
    /// The state.
    pub state: PayoutState,
    /// How many payouts are in it.
    pub count: i64,
    /// When the oldest of them was made.
    pub oldest: Timestamp,
    /// How many times they were sent, in all.
    pub sends: i64,
    /// The most times one of them was sent.
    pub most_sends: i64,
}

/// [`PayoutStat`]s, in SQL both stores speak.
pub(crate) const PAYOUT_STATS: &str =
    "SELECT state, COUNT(*), MIN(created_at), CAST(SUM(sends) AS BIGINT), CAST(MAX(sends) AS BIGINT)
     FROM payout GROUP BY state ORDER BY state";

pub(crate) fn payout_stat(
    state: &str,
    count: i64,
    oldest: &str,
    sends: i64,
    most_sends: i64,
) -> Result<PayoutStat, StoreError> {
    let oldest = Timestamp::parse(oldest)
        .map_err(|e| StoreError::Backend(format!("corrupt payout row: {e}").into()))?;
    Ok(PayoutStat { state: PayoutState::parse(state)?, count, oldest, sends, most_sends })
}

/// One change of a payout's state, as its audit trail keeps it: who, when,
/// from what to what, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PayoutEvent {
    /// The payout.
    pub payout_id: i64,
    /// When it changed.
    pub at: Timestamp,
    /// Who changed it: a request, a reconciler, a provider event, a person.
    pub actor: String,
    /// The state before.
    pub was: PayoutState,
    /// The state after.
    pub now: PayoutState,
    /// Why, in words.
    pub why: String,
}

/// The payout tables, in SQL both stores speak but for the key column and
/// the types each store fills in (`{id}`: the payout id's type and default;
/// `{src}`: the account id's type; `{time}`: a timestamp's text type).
pub(crate) const PAYOUT_SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS payout (
    payout_id      {id} PRIMARY KEY,
    client_id      text NOT NULL,
    endpoint       text NOT NULL,
    idem_key       text NOT NULL,
    fingerprint    text NOT NULL,
    src            {src} NOT NULL,
    beneficiary    text NOT NULL,
    amount         bigint NOT NULL CHECK ({amount} AND amount > 0),
    currency       text NOT NULL,
    downstream_key text NOT NULL UNIQUE,
    state          text NOT NULL CHECK (state IN ('in_progress', 'unknown', 'needs_attention', 'completed', 'failed', 'returned')),
    holder         text NOT NULL,
    lease_until    {time} NOT NULL,
    created_at     {time} NOT NULL,
    updated_at     {time} NOT NULL,
    note           text,
    status         integer,
    sends          integer NOT NULL DEFAULT 0,
    attempts       integer NOT NULL DEFAULT 0,
    provider_id    text,
    CHECK ((state IN ('completed', 'failed', 'returned')) = (status IS NOT NULL)));
CREATE INDEX IF NOT EXISTS payout_key ON payout (client_id, endpoint, idem_key);
CREATE INDEX IF NOT EXISTS payout_open ON payout (state, lease_until);
CREATE TABLE IF NOT EXISTS payout_event (
    event_id  {id} PRIMARY KEY,
    payout_id bigint NOT NULL,
    at        {time} NOT NULL,
    actor     text NOT NULL,
    was       text NOT NULL,
    now       text NOT NULL,
    why       text NOT NULL,
    {delivery});
CREATE INDEX IF NOT EXISTS payout_event_of ON payout_event (payout_id, event_id);
CREATE INDEX IF NOT EXISTS payout_event_due ON payout_event (delivery, next_at);
CREATE TABLE IF NOT EXISTS delivery_attempt (
    attempt_id {id} PRIMARY KEY,
    event_id   bigint NOT NULL,
    at         {time} NOT NULL,
    outcome    text NOT NULL);
CREATE INDEX IF NOT EXISTS delivery_attempt_of ON delivery_attempt (event_id);
CREATE TABLE IF NOT EXISTS gateway_event (
    event_id       text PRIMARY KEY,
    received_at    {time} NOT NULL,
    kind           text NOT NULL,
    downstream_key text NOT NULL,
    outcome        text NOT NULL);
";

/// The columns of `payout_event` that tell its payout's client of the
/// change (the outbox: written in the transaction of the change; `none`:
/// the change's own answer told it). `{time}` as in [`PAYOUT_SCHEMA`]; a
/// table without them gets them, one `ADD COLUMN` each.
pub(crate) const DELIVERY_COLUMNS: [&str; 4] = [
    "delivery text NOT NULL DEFAULT 'none' CHECK (delivery IN ('none', 'pending', 'delivered', 'failed'))",
    "attempts integer NOT NULL DEFAULT 0",
    "next_at {time}",
    "delivered_at {time}",
];

/// [`PAYOUT_SCHEMA`] with its delivery columns, before each store fills in
/// its types.
pub(crate) fn payout_schema() -> String {
    PAYOUT_SCHEMA.replace("{delivery}", &DELIVERY_COLUMNS.join(",\n    ")) + super::ENDPOINT_SCHEMA
}

/// Where telling a client of a change stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// Not delivered yet: tried again at its `next_at`.
    Pending,
    /// The client's endpoint answered 2xx.
    Delivered,
    /// Given up (past the schedule, or no endpoint): for a person, who may
    /// deliver it again (`idem payouts redeliver`).
    Failed,
}

impl Delivery {
    /// The state as the table spells it.
    pub fn name(self) -> &'static str {
        match self {
            Delivery::Pending => "pending",
            Delivery::Delivered => "delivered",
            Delivery::Failed => "failed",
        }
    }

    /// Reads a state as the table spells it.
    pub fn parse(text: &str) -> Result<Delivery, StoreError> {
        [Delivery::Pending, Delivery::Delivered, Delivery::Failed]
            .into_iter()
            .find(|d| d.name() == text)
            .ok_or_else(|| StoreError::Backend(format!("corrupt payout event: delivery {text:?}").into()))
    }
}

/// A change of a payout's state its client is told of, and how far telling
/// it went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientEvent {
    /// The event's id: one per change, the same on every delivery of it.
    pub event_id: i64,
    /// Whose payout it is.
    pub client_id: String,
    /// The change.
    pub event: PayoutEvent,
    /// The payout's amount, in the currency's smallest unit.
    pub amount: i64,
    /// The payout's currency (ISO 4217).
    pub currency: String,
    /// How far telling it went.
    pub delivery: Delivery,
    /// Deliveries tried.
    pub attempts: i64,
    /// When it is tried next (pending), or was last taken.
    pub next_at: Option<Timestamp>,
    /// When the client's endpoint took it.
    pub delivered_at: Option<Timestamp>,
}

/// Telling clients, counted: how many wait, since when the oldest, and how
/// many were given up.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ClientEventStats {
    /// Events not delivered yet.
    pub pending: i64,
    /// When the oldest of them happened.
    pub oldest_pending: Option<Timestamp>,
    /// Events given up, for a person.
    pub failed: i64,
}

/// What both stores select for a [`ClientEvent`], in [`ClientEventText`]'s order.
pub(crate) const CLIENT_EVENT_COLUMNS: &str =
    "e.event_id, p.client_id, e.payout_id, e.at, e.actor, e.was, e.now,
    e.why, p.amount, p.currency, e.delivery, CAST(e.attempts AS BIGINT), e.next_at, e.delivered_at
    FROM payout_event e JOIN payout p ON p.payout_id = e.payout_id";

/// A client event as a store reads it, before it is checked.
pub(crate) struct ClientEventText {
    pub event_id: i64,
    pub client_id: String,
    pub payout_id: i64,
    pub at: String,
    pub actor: String,
    pub was: String,
    pub now: String,
    pub why: String,
    pub amount: i64,
    pub currency: String,
    pub delivery: String,
    pub attempts: i64,
    pub next_at: Option<String>,
    pub delivered_at: Option<String>,
}

impl ClientEventText {
    pub(crate) fn decode(self) -> Result<ClientEvent, StoreError> {
        let time = |t: Option<String>| t.map(|t| event_time(&t)).transpose();
        Ok(ClientEvent {
            event_id: self.event_id,
            client_id: self.client_id,
            event: PayoutEvent {
                payout_id: self.payout_id,
                at: event_time(&self.at)?,
                actor: self.actor,
                was: PayoutState::parse(&self.was)?,
                now: PayoutState::parse(&self.now)?,
                why: self.why,
            },
            amount: self.amount,
            currency: self.currency,
            delivery: Delivery::parse(&self.delivery)?,
            attempts: self.attempts,
            next_at: time(self.next_at)?,
            delivered_at: time(self.delivered_at)?,
        })
    }
}

/// Reads a stored time of a client event.
pub(crate) fn event_time(text: &str) -> Result<Timestamp, StoreError> {
    Timestamp::parse(text).map_err(|e| StoreError::Backend(format!("corrupt payout event: {e}").into()))
}

/// The columns of `payout` before its second version (no `needs_attention`
/// nor `returned`, no sends, attempts or provider id): what a migration copies.
pub(crate) const PAYOUT_V1_COLUMNS: &str =
    "payout_id, client_id, endpoint, idem_key, fingerprint, src, beneficiary,
    amount, currency, downstream_key, state, holder, lease_until, created_at, updated_at, note, status";

/// The payout half of a transaction ([`Tx`](super::Tx)). A store without payouts
/// (the models under `tests/`) keeps the defaults, which say so.
pub trait PayoutTx {
    /// Creates the `payout` table if it is not there.
    fn ensure_payouts(&mut self) -> Result<(), StoreError> {
        Err(no_payouts())
    }
    /// Inserts a payout (its `id` is ignored) and returns its id.
    fn insert_payout(&mut self, _row: &PayoutRow) -> Result<i64, StoreError> {
        Err(no_payouts())
    }
    /// The newest payout made under `key`, locked.
    fn payout_of(&mut self, _key: &ScopedKey) -> Result<Option<PayoutRow>, StoreError> {
        Err(no_payouts())
    }
    /// The payout `id`, locked.
    fn payout(&mut self, _id: i64) -> Result<Option<PayoutRow>, StoreError> {
        Err(no_payouts())
    }
    /// The payout `id` as last committed, not locked (a plain read).
    fn peek_payout(&mut self, id: i64) -> Result<Option<PayoutRow>, StoreError> {
        self.payout(id)
    }
    /// Writes `row`'s state, holder, lease, note, status, sends, attempts and
    /// provider id only if its holder is still `seen_holder`; `false` if
    /// another took it.
    fn update_payout(&mut self, _row: &PayoutRow, _seen_holder: &str) -> Result<bool, StoreError> {
        Err(no_payouts())
    }
    /// Payouts `in_progress` or `unknown` whose lease has run out at `now`,
    /// oldest first; with `all`, every payout not settled.
    fn payouts_open(&mut self, _now: Timestamp, _all: bool) -> Result<Vec<PayoutRow>, StoreError> {
        Err(no_payouts())
    }
    /// Up to `limit` completed payouts paid at or after `paid_since` and
    /// last checked (their lease) at or before `checked_before`, oldest first.
    fn payouts_paid_due(
        &mut self,
        _checked_before: Timestamp,
        _paid_since: Timestamp,
        _limit: i64,
    ) -> Result<Vec<PayoutRow>, StoreError> {
        Err(no_payouts())
    }
    /// The payout the gateway knows by `downstream_key`, as last committed,
    /// not locked (whoever writes it locks its key, then [`PayoutTx::payout`]).
    fn payout_by_downstream_key(&mut self, _key: &str) -> Result<Option<PayoutRow>, StoreError> {
        Err(no_payouts())
    }
    /// Records a provider event once: `false` if its id was recorded before.
    fn insert_gateway_event(
        &mut self,
        _event_id: &str,
        _at: Timestamp,
        _kind: &str,
        _downstream_key: &str,
        _outcome: &str,
    ) -> Result<bool, StoreError> {
        Err(no_payouts())
    }
    /// Per state: how many payouts, the oldest's creation, their sends in
    /// all and the most of one.
    fn payout_stats(&mut self) -> Result<Vec<PayoutStat>, StoreError> {
        Err(no_payouts())
    }
    /// Up to `limit` provider events that moved no money and need a person
    /// (no payout of ours, another amount), oldest first.
    fn gateway_events_for_a_person(&mut self, _limit: i64) -> Result<Vec<GatewayEventRow>, StoreError> {
        Err(no_payouts())
    }
    /// Up to `limit` payouts in `state`, oldest first.
    fn payouts_in(&mut self, _state: PayoutState, _limit: i64) -> Result<Vec<PayoutRow>, StoreError> {
        Err(no_payouts())
    }
    /// Appends to a payout's audit trail; with `tell`, its client is to be
    /// told of it (pending from its time).
    fn insert_payout_event(&mut self, _event: &PayoutEvent, _tell: bool) -> Result<(), StoreError> {
        Err(no_payouts())
    }
    /// The pending client events [`super::Take`] names, oldest first, each taken
    /// until `take.until` (no other sender tries it meanwhile).
    fn take_client_events(&mut self, _take: &super::Take<'_>) -> Result<Vec<ClientEvent>, StoreError> {
        Err(no_payouts())
    }
    /// Records one delivery of event `id` at `at` and what came of it
    /// (`outcome`, kept in its log); it is now `delivery`, tried next at
    /// `next_at` if pending.
    fn record_delivery(
        &mut self,
        _id: i64,
        _at: Timestamp,
        _outcome: &str,
        _delivery: Delivery,
        _next_at: Option<Timestamp>,
    ) -> Result<(), StoreError> {
        Err(no_payouts())
    }
    /// Up to `limit` client events (only those in `delivery`, if given), newest first.
    fn client_events(
        &mut self,
        _delivery: Option<Delivery>,
        _limit: i64,
    ) -> Result<Vec<ClientEvent>, StoreError> {
        Err(no_payouts())
    }
    /// Event `id`'s deliveries, oldest first: when, and what came of it.
    fn delivery_log(&mut self, _id: i64) -> Result<Vec<(Timestamp, String)>, StoreError> {
        Err(no_payouts())
    }
    /// Makes client event `id` pending again, due at `now`; `false` if no
    /// client is told of it.
    fn redeliver(&mut self, _id: i64, _now: Timestamp) -> Result<bool, StoreError> {
        Err(no_payouts())
    }
    /// The client events, counted.
    fn client_event_stats(&mut self) -> Result<ClientEventStats, StoreError> {
        Err(no_payouts())
    }
    /// Records a delivery to `client`'s endpoint at `at`: one taken ends its
    /// failing streak (`None`); one failed returns since when it fails.
    fn endpoint_tried(
        &mut self,
        _client: &str,
        _at: Timestamp,
        _ok: bool,
    ) -> Result<Option<Timestamp>, StoreError> {
        Err(no_payouts())
    }
    /// Disables `client`'s endpoint (`why`) or enables it (`None`); whether it changed.
    fn set_endpoint(
        &mut self,
        _client: &str,
        _at: Timestamp,
        _why: Option<&str>,
    ) -> Result<bool, StoreError> {
        Err(no_payouts())
    }
    /// The endpoints disabled until a person enables them.
    fn disabled_endpoints(&mut self) -> Result<Vec<super::Disabled>, StoreError> {
        Err(no_payouts())
    }
    /// `REDELIVER_SINCE`: `client`'s events since `since`, pending at `now`; how many.
    fn redeliver_since(
        &mut self,
        _client: &str,
        _since: Timestamp,
        _now: Timestamp,
    ) -> Result<u64, StoreError> {
        Err(no_payouts())
    }
    /// A payout's audit trail, oldest first.
    fn payout_events(&mut self, _payout_id: i64) -> Result<Vec<PayoutEvent>, StoreError> {
        Err(no_payouts())
    }
}

fn no_payouts() -> StoreError {
    StoreError::Schema("this store keeps no payouts".into())
}
