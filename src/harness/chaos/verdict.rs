//! The verdict of a chaos day, read from the database and the clients' own
//! logs: nothing out twice, nothing acknowledged lost, nothing unintended,
//! the money conserved; and what each failover cost the clients.

use super::clients::{Ending, Intent, Kind};
use super::payouts::PayoutVerdict;
use super::{Config, HarnessError};
use crate::outside::proxy::{Counts, Proxy};
use crate::store::{Db, bank};
use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

#[derive(Debug, Clone, Serialize)]
pub struct Unknown {
    pub client: usize,
    pub key: String,
    /// What the database says: `went out once`, `not out`, `went out N times`.
    pub database: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub seed: u64,
    pub clients: usize,
    pub transfers_intended: usize,
    pub requests_sent: u64,
    pub attempts_per_transfer_mean: f64,
    pub attempts_per_transfer_max: u32,
    pub requests_dropped: u64,
    pub responses_dropped: u64,
    pub responses_cut: u64,
    pub requests_delayed: u64,
    pub requests_duplicated: u64,
    pub requests_unreachable: u64,
    pub instances: usize,
    /// Requests each instance's proxy received.
    pub requests_per_instance: Vec<u64>,
    pub server_kills: usize,
    pub database_restarts: usize,
    /// One entry per failover of the database's primary.
    pub failovers: Vec<Failover>,
    /// Failovers not run because every client had finished (a longer day
    /// fits more: each failover waits for the cluster to be whole again).
    pub failovers_not_run: usize,
    pub claims_released_after_kills: usize,
    pub outcomes_unknown: usize,
    pub transfers_made: usize,
    /// Intended transfers that went out more than once (counted per extra).
    pub transfers_paid_twice: usize,
    /// Transfers a client was told about (2xx) that are not in the database.
    pub transfers_lost: usize,
    /// Transfers in the database that no client intended.
    pub transfers_unintended: usize,
    /// 2xx answers naming a transfer other than the one intended.
    pub answers_misattributed: usize,
    pub balances_conserved: bool,
    pub time_to_certainty_ms_p50: u64,
    pub time_to_certainty_ms_p99: u64,
    /// Keys still claimed at the end of the day: each blocks its key's
    /// retries until its lease runs out.
    pub keys_left_claimed: usize,
    pub unknown: Vec<Unknown>,
    /// The payouts' verdict, on a day with payouts.
    pub payouts: Option<PayoutVerdict>,
}

/// What one fault of the database cost the clients, from their own
/// attempts; the intents counted are those whose last attempt ended
/// between this fault and the next.
#[derive(Debug, Clone, Serialize)]
pub struct Failover {
    /// Which fault (`DB_FAULTS`' words).
    pub kind: String,
    /// When the fault began, from the start of the day.
    pub at_ms: u64,
    /// How long writes stopped: the longest stretch, from this fault's
    /// start to the next, without a new transfer made (from the end of the
    /// attempt that made the last one to the end of the one that made the
    /// next), counted from the last made before the fault; `None` if none
    /// was made before the next fault. With many clients a healthy day's
    /// stretches are milliseconds; the fault's is its window.
    pub writes_unavailable_ms: Option<u64>,
    /// Attempts that ended within that stretch: answered 503, 409, none.
    pub answered_503: usize,
    pub answered_409: usize,
    /// Attempts without an answer meanwhile (the fault proxy's too).
    pub unanswered: usize,
    /// Attempts in flight when the primary died whose transfer was
    /// committed all the same: answered 503, then replayed to a retry.
    pub acks_lost_found_by_retry: usize,
    /// Intents acknowledged (2xx), ended unknown, acknowledged but not in
    /// the database, and gone out more than once.
    pub acknowledged: usize,
    pub unknown: usize,
    pub lost: usize,
    pub paid_twice: usize,
}

impl Summary {
    /// Whether nothing went out twice, nothing acknowledged was lost, and the
    /// money adds up.
    pub fn exactly_once(&self) -> bool {
        self.transfers_paid_twice == 0
            && self.transfers_lost == 0
            && self.transfers_unintended == 0
            && self.answers_misattributed == 0
            && self.balances_conserved
            && self.payouts.as_ref().is_none_or(PayoutVerdict::exactly_once)
    }

    /// Exactly once, no key left blocked by a claim nobody will finish, and
    /// every payout settled but those left for a person with a reason.
    pub fn passed(&self) -> bool {
        self.exactly_once() && self.keys_left_claimed == 0
    }
}

/// What the machine room did, for the summary.
pub(super) struct Tally {
    pub kills: usize,
    pub database_restarts: usize,
    pub released: usize,
    pub failovers_not_run: usize,
    /// Each fault as it began, and what it was: the timeline's marks.
    pub marks: Vec<(Instant, &'static str)>,
}

/// The machine room's own faults' marks.
pub(super) const SERVER_KILLED: &str = "server killed";
pub(super) const DATABASE_RESTARTED: &str = "database restarted";

/// The faults of a replicated database (`tools/pg-ha inject KIND`), by
/// kind: what the report and the timeline call each.
pub const DB_FAULTS: [(&str, &str); 6] = [
    ("kill", "primary killed"),
    ("pause", "primary paused"),
    ("standby", "sync standby killed"),
    ("etcd", "etcd quorum lost"),
    ("switchover", "switchover"),
    ("partition", "primary partitioned"),
];

impl Tally {
    /// When each fault of the database began, and which it was.
    pub(super) fn db_faults(&self) -> Vec<(Instant, &'static str)> {
        let ours = [SERVER_KILLED, DATABASE_RESTARTED];
        self.marks.iter().filter(|(_, what)| !ours.contains(what)).copied().collect()
    }
}

/// Reads the transfer table and the balances and judges the day.
pub(super) fn verdict(
    db: &Db,
    intents: &[Intent],
    accounts: &[bank::Account],
    proxies: &[Proxy],
    tally: &Tally,
    config: &Config,
    day: (Instant, Instant),
) -> Result<Summary, HarnessError> {
    let (transfers, balances) = bank::ledger(db)?;
    let payouts = bank::payouts(db)?;
    let (made, unintended) = made_of(intents, &transfers);
    // looked up once per intent, more than once per day: by id, not by scan
    let by_id: BTreeMap<i64, &bank::TransferRow> = transfers.iter().map(|t| (t.id, t)).collect();
    let lost = |i: &Intent| i.kind == Kind::Transfer && i.told.is_some_and(|t| !by_id.contains_key(&t));
    let twice = |i: &Intent| made.get(&i.amount).is_some_and(|v| v.len() > 1);
    let failovers = failover_figures(intents, &tally.db_faults(), day, (&lost, &twice));
    let unknown: Vec<Unknown> = intents
        .iter()
        .filter(|i| i.verdict == Ending::Unknown)
        .map(|i| Unknown {
            client: i.client,
            key: i.key.clone(),
            database: what_the_database_says(i, &made, &payouts),
        })
        .collect();
    let (p50, p99) = time_to_certainty(intents);
    let load = |count: fn(&Counts) -> &AtomicU64| {
        proxies.iter().map(|p| count(&p.counts).load(Ordering::Relaxed)).sum::<u64>()
    };
    let attempts: Vec<u32> = intents.iter().map(|i| i.attempts).collect();
    let mean = attempts.iter().sum::<u32>() as f64 / attempts.len().max(1) as f64;
    Ok(Summary {
        seed: config.seed,
        clients: config.clients,
        transfers_intended: intents.iter().filter(|i| i.kind == Kind::Transfer).count(),
        requests_sent: load(|c| &c.requests),
        attempts_per_transfer_mean: (mean * 100.0).round() / 100.0,
        attempts_per_transfer_max: attempts.iter().copied().max().unwrap_or(0),
        requests_dropped: load(|c| &c.dropped_requests),
        responses_dropped: load(|c| &c.dropped_responses),
        responses_cut: load(|c| &c.cut_responses),
        requests_delayed: load(|c| &c.delayed),
        requests_duplicated: load(|c| &c.duplicated),
        requests_unreachable: load(|c| &c.unreachable),
        instances: config.instances,
        requests_per_instance: proxies.iter().map(|p| p.counts.requests.load(Ordering::Relaxed)).collect(),
        server_kills: tally.kills,
        database_restarts: tally.database_restarts,
        failovers,
        failovers_not_run: tally.failovers_not_run,
        claims_released_after_kills: tally.released,
        outcomes_unknown: unknown.len(),
        transfers_made: transfers.len(),
        transfers_paid_twice: made.values().map(|v| v.len().saturating_sub(1)).sum(),
        transfers_lost: intents.iter().filter(|i| lost(i)).count(),
        transfers_unintended: unintended,
        answers_misattributed: misattributed(intents, &by_id),
        balances_conserved: conserved(accounts, &transfers, &payouts, &balances),
        time_to_certainty_ms_p50: p50,
        time_to_certainty_ms_p99: p99,
        keys_left_claimed: 0,
        unknown,
        payouts: None,
    })
}

/// The median and the 99th percentile of how long a client took to know,
/// over the intents whose client came to know.
fn time_to_certainty(intents: &[Intent]) -> (u64, u64) {
    let mut certainty: Vec<u64> =
        intents.iter().filter(|i| i.verdict != Ending::Unknown).map(|i| i.millis).collect();
    certainty.sort_unstable();
    let percentile = |p: usize| {
        certainty
            .get((certainty.len() * p / 100).min(certainty.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    };
    (percentile(50), percentile(99))
}

/// The transfers each intent made (by its amount: the ids), and how many
/// transfers no intent made.
fn made_of(intents: &[Intent], transfers: &[bank::TransferRow]) -> (BTreeMap<i64, Vec<i64>>, usize) {
    let by_amount: BTreeMap<i64, &Intent> = intents.iter().map(|i| (i.amount, i)).collect();
    let mut made: BTreeMap<i64, Vec<i64>> = BTreeMap::new();
    let mut unintended = 0;
    for t in transfers {
        match by_amount.get(&t.amount) {
            Some(i) if i.src == t.src && i.dst == t.dst => made.entry(t.amount).or_default().push(t.id),
            _ => unintended += 1,
        }
    }
    (made, unintended)
}

/// Answers that named another intent's transfer.
fn misattributed(intents: &[Intent], by_id: &BTreeMap<i64, &bank::TransferRow>) -> usize {
    let named = |i: &&Intent| i.told.and_then(|told| by_id.get(&told));
    intents
        .iter()
        .filter(|i| i.kind == Kind::Transfer)
        .filter(|i| named(i).is_some_and(|t| t.amount != i.amount))
        .count()
}

/// For an intent whose client never knew: what the database says of it.
fn what_the_database_says(
    i: &Intent,
    made: &BTreeMap<i64, Vec<i64>>,
    payouts: &[bank::PayoutLine],
) -> String {
    if i.kind == Kind::Payout {
        let states: Vec<&str> =
            payouts.iter().filter(|p| p.amount == i.amount).map(|p| p.state.as_str()).collect();
        return match states.as_slice() {
            [] => "no payout".into(),
            [state] => format!("one payout, {state}"),
            many => format!("{} payouts: {}", many.len(), many.join(", ")),
        };
    }
    match made.get(&i.amount).map_or(0, Vec::len) {
        0 => "not out".into(),
        1 => "went out once".into(),
        n => format!("went out {n} times"),
    }
}

/// Conservation, and each balance exactly what the transfers made of it: a
/// payout's money left its account unless the gateway refused it (paid
/// out, or held while not settled).
fn conserved(
    accounts: &[bank::Account],
    transfers: &[bank::TransferRow],
    payouts: &[bank::PayoutLine],
    balances: &BTreeMap<String, i64>,
) -> bool {
    let mut want: BTreeMap<String, i64> = accounts.iter().map(|a| (a.id.clone(), a.balance)).collect();
    for t in transfers {
        *want.entry(t.src.clone()).or_insert(0) -= t.amount;
        *want.entry(t.dst.clone()).or_insert(0) += t.amount;
    }
    let gone = |p: &&bank::PayoutLine| p.state != "failed" && p.state != "returned";
    let out: i64 = payouts.iter().filter(gone).map(|p| p.amount).sum();
    for p in payouts.iter().filter(gone) {
        *want.entry(p.src.clone()).or_insert(0) -= p.amount;
    }
    balances.values().sum::<i64>() + out == accounts.iter().map(|a| a.balance).sum::<i64>()
        && *balances == want
}

/// What the database says of an intent.
type Judge<'a> = dyn Fn(&Intent) -> bool + 'a;

/// Each fault's cost, read from the clients' attempts: the longest stretch
/// without a transfer made before the next fault, the attempts that ended
/// within it, and the intents that ended before the next fault, judged by
/// `lost` and `twice` (acknowledged but missing, gone out more than once).
fn failover_figures(
    intents: &[Intent],
    faults: &[(Instant, &'static str)],
    (day_started, day_ended): (Instant, Instant),
    (lost, twice): (&Judge, &Judge),
) -> Vec<Failover> {
    let tries = || intents.iter().flat_map(|i| i.tries.iter());
    let mut made: Vec<Instant> = tries()
        .filter(|t| !t.replayed && t.status.is_some_and(|s| (200..300).contains(&s)))
        .map(|t| t.ended)
        .collect();
    made.sort_unstable();
    faults
        .iter()
        .enumerate()
        .map(|(k, &(began, kind))| {
            let next = faults.get(k + 1).map_or(day_ended, |f| f.0);
            let last_before = made.iter().rev().find(|&&m| m <= began).copied().unwrap_or(began);
            let after: Vec<Instant> = made.iter().copied().filter(|&m| m > began && m < next).collect();
            // the longest stretch without a transfer made
            let stretch = std::iter::once(last_before)
                .chain(after.iter().copied())
                .zip(after.iter().copied())
                .max_by_key(|(from, to)| to.duration_since(*from));
            let (from, until) = stretch.unwrap_or((began, next));
            let meanwhile = |status: Option<u16>| {
                tries().filter(|t| t.ended >= from && t.ended <= until && t.status == status).count()
            };
            let acks_lost = intents
                .iter()
                .filter(|i| i.tries.last().is_some_and(|t| t.replayed))
                .filter(|i| {
                    i.tries.iter().any(|t| t.sent < began && t.ended >= began && t.status == Some(503))
                })
                .count();
            let ended_here: Vec<&Intent> = intents
                .iter()
                .filter(|i| i.tries.last().is_some_and(|t| t.ended >= began && t.ended < next))
                .collect();
            let count = |f: &dyn Fn(&Intent) -> bool| ended_here.iter().filter(|i| f(i)).count();
            Failover {
                kind: kind.to_owned(),
                at_ms: began.duration_since(day_started).as_millis() as u64,
                writes_unavailable_ms: stretch.map(|(from, to)| to.duration_since(from).as_millis() as u64),
                answered_503: meanwhile(Some(503)),
                answered_409: meanwhile(Some(409)),
                unanswered: meanwhile(None),
                acks_lost_found_by_retry: acks_lost,
                acknowledged: count(&|i| i.verdict == Ending::Done),
                unknown: count(&|i| i.verdict == Ending::Unknown),
                lost: count(lost),
                paid_twice: count(twice),
            }
        })
        .collect()
}
