//! Telling idem's own clients what became of their payouts, through the
//! audit trail as a transactional outbox: a change no answer told its
//! client (settled after a 202, returned after a 201, settled by a person)
//! is marked `pending` in the transaction that makes it. A sender takes the
//! due ones, posts each to its client's endpoint signed as Standard
//! Webhooks say (`webhook-id`, `webhook-timestamp`, `webhook-signature`:
//! HMAC-SHA256 over `id.timestamp.body` under the client's secret), and
//! tries again on anything but a 2xx, after a capped doubling wait with
//! jitter, until [`Schedule::give_up`] after the change; then it is
//! `failed`, for a person (`idem payouts redeliver`). Each change has one
//! id, the same on every delivery: receivers deduplicate by it.

use super::sign_standard;
use crate::clock::Timestamp;
use crate::policy::Policy;
use crate::store::{self, ClientEvent, Delivery, Durability, End, Store, StoreError, Take};
use serde_json::json;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

/// Where a client's events go, and the secret they are signed with.
#[derive(Clone)]
pub struct Hook {
    /// The client's endpoint (http or https).
    pub url: String,
    /// `whsec_` and the base64 of the key, as the client was given it.
    pub secret: Vec<u8>,
    /// While a rotation lasts, the secret before it: each event is signed
    /// with both (Standard Webhooks' space-separated signatures), so a
    /// receiver verifies with either while it moves to the new one.
    pub previous: Option<Vec<u8>>,
}

impl std::fmt::Debug for Hook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // never the secret
        write!(f, "Hook({})", self.url)
    }
}

/// When a delivery that failed is tried again.
#[derive(Debug, Clone, Copy)]
pub struct Schedule {
    /// The first wait; it doubles per attempt (half of it jitter)…
    pub first: Duration,
    /// …up to this.
    pub cap: Duration,
    /// No attempt is made this long after the change: the event is failed.
    pub give_up: Duration,
    /// An endpoint whose deliveries have all failed for this long is
    /// disabled until a person enables it (as Svix does, after 5 days).
    pub disable_after: Duration,
}

impl Default for Schedule {
    /// 10 s, doubling to an hour, for 3 days: about 80 attempts.
    fn default() -> Self {
        Schedule {
            first: Duration::from_secs(10),
            cap: Duration::from_secs(3600),
            give_up: Duration::from_secs(3 * 24 * 3600),
            disable_after: Duration::from_secs(5 * 24 * 3600),
        }
    }
}

impl Schedule {
    /// When event `id` is tried after its `attempts`-th failure at `now`;
    /// `None` if that is past giving up on a change made at `at`.
    pub fn next(&self, id: i64, attempts: i64, at: Timestamp, now: Timestamp) -> Option<Timestamp> {
        let doublings = u32::try_from(attempts.saturating_sub(1).clamp(0, 30)).unwrap_or(30);
        let ceiling = self.first.saturating_mul(1 << doublings).min(self.cap);
        let millis = u64::try_from(ceiling.as_millis()).unwrap_or(u64::MAX).max(1);
        // half the wait fixed, half drawn from the event and the attempt:
        // the events of a receiver that comes back are not all tried at once
        let draw = crate::rng::mix(id as u64 ^ (attempts as u64).rotate_left(32)) % millis;
        let next = now.plus_millis(i64::try_from(millis / 2 + draw / 2).unwrap_or(i64::MAX));
        let give_up = i64::try_from(self.give_up.as_millis()).unwrap_or(i64::MAX);
        (next < at.plus_millis(give_up)).then_some(next)
    }
}

/// The id a client sees: the same on every delivery of the change, and
/// no other change's, whichever database made it. The row's number alone
/// (`evt_N`) was neither: two deployments, or a database restored from a
/// backup, tell different changes as `evt_N`, and a receiver that
/// deduplicates by the id drops the second. So it is a digest of what the
/// change is and when it was made, to the microsecond: its number, the
/// client, the payout, the time, who made it and the states, none of
/// which ever changes.
pub fn event_id(e: &ClientEvent) -> String {
    use sha2::{Digest, Sha256};
    let c = &e.event;
    let change = format!(
        "idem client event 1\n{}\n{}\n{}\n{}\n{}\n{}\n{}",
        e.event_id,
        e.client_id,
        c.payout_id,
        c.at,
        c.actor,
        c.was.name(),
        c.now.name()
    );
    let digest = Sha256::digest(change.as_bytes());
    format!("evt_{}", crate::hex::lower(&digest[..16]))
}

/// What a client is sent: what changed, and where to fetch the payout as it
/// stands.
pub fn body(e: &ClientEvent) -> String {
    json!({
        "id": event_id(e),
        "type": format!("payout.{}", e.event.now.name()),
        "created_at": e.event.at.to_string(),
        "data": {
            "payout_id": e.event.payout_id,
            "previous_state": e.event.was.name(),
            "state": e.event.now.name(),
            "amount": e.amount,
            "currency": e.currency,
            "reason": e.event.why,
        },
        "links": {"payout": format!("/v1/payouts/{}", e.event.payout_id)},
    })
    .to_string()
}

/// The Standard Webhooks headers of delivering `e` at `unix` (seconds), to
/// `hook`: signed with its secret, and with the previous one too while a
/// rotation lasts.
pub fn headers(e: &ClientEvent, hook: &Hook, unix: i64) -> Vec<(&'static str, String)> {
    let id = event_id(e);
    let body = body(e);
    let signature = std::iter::once(&hook.secret)
        .chain(&hook.previous)
        .map(|secret| sign_standard(secret, &id, body.as_bytes(), unix))
        .collect::<Vec<_>>()
        .join(" ");
    vec![("webhook-id", id), ("webhook-timestamp", unix.to_string()), ("webhook-signature", signature)]
}

/// A receiver's answer: its status, and the wait its `Retry-After` asks
/// for (whole seconds), if any.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Answered {
    pub status: u16,
    pub retry_after: Option<Duration>,
}

/// Delivers one event: url, headers, body → the answer, or why none came.
pub type Post = dyn Fn(&str, &[(&'static str, String)], &str) -> Result<Answered, String> + Send + Sync;

/// The most a receiver's `Retry-After` puts an event off: past it, the
/// event is tried anyway (a receiver cannot park events for days).
const RETRY_AFTER_CAP: Duration = Duration::from_secs(3600);

/// One delivery, as the sender reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Told {
    /// The event's number (its row), as the runbook's commands take it.
    pub event_id: i64,
    /// Its id, as the client sees it ([`event_id`]).
    pub id: String,
    /// Whose it is.
    pub client_id: String,
    /// Its attempts, this one included.
    pub attempts: i64,
    /// Where it stands now.
    pub delivery: Delivery,
    /// What came of this attempt (`HTTP 204`, why no answer came).
    pub outcome: String,
    /// Why this attempt disabled its client's endpoint, if it did.
    pub disabled: Option<String>,
}

/// How long a taken event is kept from other senders: past the longest
/// delivery (whose own timeout is shorter), it is theirs to try.
const TAKEN_FOR: Duration = Duration::from_secs(120);
/// The most events one round takes, over all clients.
const ROUND: i64 = 64;

/// What one event's turn in a round came to: tried (where it stands now,
/// when it is tried next, what came of it), or put off, untried, until
/// then because its client's endpoint failed earlier in the round.
enum Turn {
    Tried(Delivery, Option<Timestamp>, String),
    PutOff(Timestamp),
    /// Answered 410 Gone: the endpoint is disabled, the event pending.
    Gone(Timestamp, String),
}

/// The most events one client's lane takes at once: a lane lasts at most
/// this many deliveries' deadlines (8 × 15 s), within [`TAKEN_FOR`].
const PER_CLIENT: i64 = 8;

/// A lane's turns, each at its time, sent back to the round that records them.
type Finished = Vec<(ClientEvent, Timestamp, Turn)>;

/// The client events sender: every client on a lane of its own. Each
/// [`Sender::round`] records what the lanes finished since the last one,
/// then takes the due events of every client whose lane is idle (at most
/// `PER_CLIENT` each, `ROUND` in all) and starts a lane for each such
/// client, which delivers them in order on a thread of its own. No round
/// waits for a lane, and no client's backlog takes another's turn: a slow,
/// hung or backlogged endpoint holds up its own client's events only.
pub struct Sender {
    hooks: Arc<HashMap<String, Hook>>,
    schedule: Schedule,
    post: Arc<Post>,
    /// Clients whose lane is out.
    busy: Arc<Mutex<HashSet<String>>>,
    finished: (mpsc::Sender<Finished>, mpsc::Receiver<Finished>),
    /// A lane's turns [`Sender::wait`] received, for the next round.
    early: Mutex<Vec<Finished>>,
}

impl Sender {
    /// Delivers to `hooks` through `post`, retrying on `schedule`. A client
    /// with no hook gets nothing: its events are failed at once, for a
    /// person to redeliver once it has one.
    pub fn new(hooks: HashMap<String, Hook>, schedule: Schedule, post: Arc<Post>) -> Sender {
        let (hooks, busy) = (Arc::new(hooks), Arc::default());
        Sender { hooks, schedule, post, busy, finished: mpsc::channel(), early: Mutex::default() }
    }

    /// Waits at most `up_to` for a lane to finish: a loop of rounds that
    /// waits here rather than sleeps records each lane's turns at once (a
    /// process stopped before they are recorded leaves their events taken,
    /// untried, for `TAKEN_FOR`).
    pub fn wait(&self, up_to: Duration) {
        if let Ok(turns) = self.finished.1.recv_timeout(up_to) {
            self.early.lock().unwrap_or_else(|e| e.into_inner()).push(turns);
        }
    }

    /// One round at `now` (`unix`, in seconds, signs): what lanes finished,
    /// each recorded in a transaction of its own, then new lanes for the
    /// idle clients' due events. Returns the deliveries recorded.
    pub fn round<S: Store + ?Sized>(
        &self,
        store: &mut S,
        now: Timestamp,
        unix: i64,
        policy: &Policy,
    ) -> Result<Vec<Told>, StoreError> {
        let told = self.record(store, policy)?;
        let busy: Vec<String> = self.busy.lock().unwrap_or_else(|e| e.into_inner()).iter().cloned().collect();
        let due = store::atomically(store, Durability::Durable, policy, |tx| {
            // a disabled endpoint's events wait, pending, for a person
            let mut skip = busy.clone();
            skip.extend(tx.disabled_endpoints()?.into_iter().map(|d| d.client_id));
            let until = now.plus_millis(TAKEN_FOR.as_millis() as i64);
            let take = Take { now, until, limit: ROUND, per_client: PER_CLIENT, busy: &skip };
            Ok(End::Commit(tx.take_client_events(&take)?))
        })?;
        let mut by_client: BTreeMap<String, Vec<ClientEvent>> = BTreeMap::new();
        for e in due {
            by_client.entry(e.client_id.clone()).or_default().push(e);
        }
        for (client, events) in by_client {
            let name = client.clone();
            self.busy.lock().unwrap_or_else(|e| e.into_inner()).insert(client.clone());
            let (hooks, post, busy) = (self.hooks.clone(), self.post.clone(), self.busy.clone());
            let (schedule, done) = (self.schedule, self.finished.0.clone());
            let lane = move || {
                let turns = one_client(events, &hooks, &schedule, now, unix, &*post);
                // its events stay taken (TAKEN_FOR) until the turns are recorded
                busy.lock().unwrap_or_else(|e| e.into_inner()).remove(&client);
                let _ = done.send(turns);
            };
            if let Err(e) = std::thread::Builder::new().name("idem-tell-lane".into()).spawn(lane) {
                // its events are taken until TAKEN_FOR, then tried again;
                // the client is not left busy for ever
                self.busy.lock().unwrap_or_else(|e| e.into_inner()).remove(&name);
                return Err(StoreError::Backend(format!("cannot start a client's lane: {e}").into()));
            }
        }
        Ok(told)
    }

    /// Records the turns of every lane that finished, each in a
    /// transaction of its own.
    fn record<S: Store + ?Sized>(&self, store: &mut S, policy: &Policy) -> Result<Vec<Told>, StoreError> {
        let mut told = Vec::new();
        let early = std::mem::take(&mut *self.early.lock().unwrap_or_else(|e| e.into_inner()));
        for turns in early.into_iter().chain(std::iter::from_fn(|| self.finished.1.try_recv().ok())) {
            for (e, at, turn) in turns {
                let reached = self.hooks.contains_key(&e.client_id);
                let span = self.schedule.disable_after;
                let disabled = store::atomically(store, Durability::Durable, policy, |tx| {
                    record_turn(tx, &e, at, &turn, reached, span).map(End::Commit)
                })?;
                let (delivery, outcome) = match turn {
                    Turn::Tried(delivery, _, outcome) => (delivery, outcome),
                    Turn::Gone(_, outcome) => (Delivery::Pending, outcome),
                    Turn::PutOff(_) => continue,
                };
                let (event_id, id, attempts) = (e.event_id, event_id(&e), e.attempts + 1);
                told.push(Told {
                    event_id,
                    id,
                    client_id: e.client_id,
                    attempts,
                    delivery,
                    outcome,
                    disabled,
                });
            }
        }
        Ok(told)
    }
}

/// Records one turn of event `e` at `at`, and where its client's endpoint
/// stands: a 410 disables it at once; a failure of an endpoint (`reached`:
/// the client has one) that has failed for `span` disables it. Returns why
/// it was disabled, if this turn did.
fn record_turn(
    tx: &mut dyn store::Tx,
    e: &ClientEvent,
    at: Timestamp,
    turn: &Turn,
    reached: bool,
    span: Duration,
) -> Result<Option<String>, StoreError> {
    let (delivery, outcome) = match turn {
        Turn::PutOff(next) => return tx.redeliver(e.event_id, *next).map(|_| None),
        Turn::Gone(next, outcome) => {
            tx.record_delivery(e.event_id, at, outcome, Delivery::Pending, Some(*next))?;
            let why = format!("{outcome}: the endpoint is gone");
            return Ok(tx.set_endpoint(&e.client_id, at, Some(&why))?.then_some(why));
        }
        Turn::Tried(delivery, next, outcome) => {
            tx.record_delivery(e.event_id, at, outcome, *delivery, *next)?;
            (*delivery, outcome)
        }
    };
    if !reached {
        return Ok(None);
    }
    let Some(since) = tx.endpoint_tried(&e.client_id, at, delivery == Delivery::Delivered)? else {
        return Ok(None);
    };
    if !at.is_at_least(i64::try_from(span.as_secs()).unwrap_or(i64::MAX), since) {
        return Ok(None);
    }
    let why = format!("{outcome}: every delivery failed since {since}");
    Ok(tx.set_endpoint(&e.client_id, at, Some(&why))?.then_some(why))
}

/// One client's events, in order, each at its own time (a lane may last
/// minutes behind a slow endpoint: the round's `now` and `unix` move on).
fn one_client(
    events: Vec<ClientEvent>,
    hooks: &HashMap<String, Hook>,
    schedule: &Schedule,
    now: Timestamp,
    unix: i64,
    post: &Post,
) -> Finished {
    let began = std::time::Instant::now();
    let mut failed_until = None;
    let mut turns = Vec::new();
    for e in events {
        let elapsed = began.elapsed();
        let now = now.plus_millis(i64::try_from(elapsed.as_millis()).unwrap_or(i64::MAX));
        let unix = unix.saturating_add(i64::try_from(elapsed.as_secs()).unwrap_or(i64::MAX));
        if let Some(next) = failed_until {
            turns.push((e, now, Turn::PutOff(next)));
            continue;
        }
        let Some(hook) = hooks.get(&e.client_id) else {
            let why = format!("no endpoint for client {:?}", e.client_id);
            turns.push((e, now, Turn::Tried(Delivery::Failed, None, why)));
            continue;
        };
        let turn = match post(&hook.url, &headers(&e, hook, unix), &body(&e)) {
            Ok(Answered { status: status @ 200..=299, .. }) => {
                Turn::Tried(Delivery::Delivered, None, format!("HTTP {status}"))
            }
            // gone for good: no more tries until a person enables it again
            Ok(Answered { status: 410, .. }) => {
                failed_until = Some(now);
                Turn::Gone(now, "HTTP 410".into())
            }
            sent => {
                let outcome = sent.as_ref().map_or_else(|why| why.clone(), |a| format!("HTTP {}", a.status));
                // a 429 or 503 that names its wait is tried no sooner (capped)
                let asked = match sent {
                    Ok(Answered { status: 429 | 503, retry_after: Some(wait) }) => wait.min(RETRY_AFTER_CAP),
                    _ => Duration::ZERO,
                };
                let asked = now.plus_millis(i64::try_from(asked.as_millis()).unwrap_or(i64::MAX));
                match schedule.next(e.event_id, e.attempts + 1, e.event.at, now).map(|next| next.max(asked)) {
                    Some(next) => {
                        failed_until = Some(next);
                        Turn::Tried(Delivery::Pending, Some(next), outcome)
                    }
                    None => Turn::Tried(Delivery::Failed, None, format!("{outcome}; given up")),
                }
            }
        };
        turns.push((e, now, turn));
    }
    turns
}

/// Posts over HTTP with a deadline for the whole exchange (the sender's
/// `post`), to the addresses `reach` allows: the answer, or why none came.
pub fn post_http(
    timeout: Duration,
    reach: crate::https::Reach,
) -> impl Fn(&str, &[(&'static str, String)], &str) -> Result<Answered, String> + Sync {
    let agent = crate::https::agent_reaching(timeout, reach);
    move |url, headers, body| {
        let mut req = agent.post(url).header("Content-Type", "application/json");
        for (name, value) in headers {
            req = req.header(*name, value);
        }
        let answer = req.send(body).map_err(|e| format!("no answer: {}", crate::https::why(url, &e)))?;
        let retry_after =
            answer.headers().get("retry-after").and_then(|v| v.to_str().ok()).and_then(retry_after);
        Ok(Answered { status: answer.status().as_u16(), retry_after })
    }
}

/// Up to `limit` client events (only those in `delivery`, if given), newest first.
pub fn client_events<S: Store + ?Sized>(
    store: &mut S,
    delivery: Option<Delivery>,
    limit: i64,
    policy: &Policy,
) -> Result<Vec<ClientEvent>, StoreError> {
    store::atomically(store, Durability::Lazy, policy, |tx| {
        Ok(End::Rollback(tx.client_events(delivery, limit)?))
    })
}

/// Client event `id`'s deliveries, oldest first: when, and what came of it.
pub fn delivery_log<S: Store + ?Sized>(
    store: &mut S,
    id: i64,
    policy: &Policy,
) -> Result<Vec<(Timestamp, String)>, StoreError> {
    store::atomically(store, Durability::Lazy, policy, |tx| Ok(End::Rollback(tx.delivery_log(id)?)))
}

/// Makes client event `id` pending again, due at `now` (a person's
/// redelivery, once the client's endpoint is back or configured); `false`
/// if there is no such event for a client.
pub fn redeliver<S: Store + ?Sized>(
    store: &mut S,
    id: i64,
    now: Timestamp,
    policy: &Policy,
) -> Result<bool, StoreError> {
    store::atomically(store, Durability::Durable, policy, |tx| {
        Ok(match tx.redeliver(id, now)? {
            true => End::Commit(true),
            false => End::Rollback(false),
        })
    })
}

/// A `Retry-After` value (RFC 9110, 10.2.3) as a wait from now: seconds,
/// or an HTTP-date (a date past is no wait).
fn retry_after(text: &str) -> Option<Duration> {
    let text = text.trim();
    if let Ok(seconds) = text.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = crate::clock::http_date(text)?;
    let wait = (at - time::OffsetDateTime::now_utc()).whole_seconds();
    Some(Duration::from_secs(u64::try_from(wait).unwrap_or(0)))
}

/// The client endpoints disabled until a person enables them.
pub fn disabled_endpoints<S: Store + ?Sized>(
    store: &mut S,
    policy: &Policy,
) -> Result<Vec<store::Disabled>, StoreError> {
    store::atomically(store, Durability::Lazy, policy, |tx| Ok(End::Rollback(tx.disabled_endpoints()?)))
}

/// Enables `client`'s endpoint again (its events pending flow at once);
/// `false` if it was not disabled.
pub fn enable<S: Store + ?Sized>(
    store: &mut S,
    client: &str,
    now: Timestamp,
    policy: &Policy,
) -> Result<bool, StoreError> {
    store::atomically(store, Durability::Durable, policy, |tx| {
        Ok(End::Commit(tx.set_endpoint(client, now, None)?))
    })
}

/// Sends again, from `now`, every event of `client` whose change was made
/// at or after `since` and that was delivered or failed (an outage the
/// client recovered from, as Svix's "recover since"); how many, each under
/// its one id.
pub fn redeliver_since<S: Store + ?Sized>(
    store: &mut S,
    client: &str,
    since: Timestamp,
    now: Timestamp,
    policy: &Policy,
) -> Result<u64, StoreError> {
    store::atomically(store, Durability::Durable, policy, |tx| {
        Ok(End::Commit(tx.redeliver_since(client, since, now)?))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retry_after_is_read_in_seconds_or_as_an_http_date() {
        assert_eq!(retry_after(" 120 "), Some(Duration::from_secs(120)));
        let in_an_hour =
            crate::clock::to_http_date(time::OffsetDateTime::now_utc() + time::Duration::hours(1));
        let wait = retry_after(&in_an_hour).unwrap().as_secs();
        assert!((3595..=3600).contains(&wait), "{in_an_hour}: {wait} s");
        assert_eq!(retry_after("Sun, 06 Nov 1994 08:49:37 GMT"), Some(Duration::ZERO), "a date past");
        assert_eq!(retry_after("soon"), None);
        assert_eq!(retry_after("-5"), None);
    }

    #[test]
    fn the_wait_doubles_to_its_cap_half_of_it_drawn_and_stops_at_giving_up() {
        let s = Schedule {
            first: Duration::from_secs(10),
            cap: Duration::from_secs(3600),
            give_up: Duration::from_secs(72 * 3600),
            disable_after: Duration::from_secs(5 * 24 * 3600),
        };
        let at = Timestamp::parse("2026-12-01T00:00:00Z").unwrap();
        let wait = |attempts: i64, now: Timestamp| s.next(7, attempts, at, now).map(|t| t.seconds_since(now));
        for (attempts, ceiling) in [(1, 10), (2, 20), (3, 40), (9, 2560), (10, 3600), (60, 3600)] {
            let w = wait(attempts, at).unwrap();
            assert!((ceiling / 2..=ceiling).contains(&w), "attempt {attempts}: {w}s, ceiling {ceiling}s");
        }
        // two events failing at one instant are not tried again at one instant
        assert_ne!(s.next(7, 12, at, at), s.next(8, 12, at, at));
        // nothing is tried 72 h after the change
        let late = at.plus_seconds(72 * 3600 - 60);
        assert_eq!(wait(40, late), None);
        assert!(wait(1, late).is_some(), "a short wait still fits");
    }
}
