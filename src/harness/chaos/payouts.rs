//! The payouts of a chaos day, judged against the gateway's own ledger
//! after a last reconciliation.

use super::HarnessError;
use super::clients::{Ending, Intent, Kind};
use super::receiver::Receiver;
use super::room::GatewayProcess;
use crate::clock::Timestamp;
use crate::outside::gateway::Payout;
use crate::payout::{self, HttpGateway};
use crate::policy::Policy;
use crate::store::{self, Db, Delivery, Usage, bank};
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};

/// What became of the payouts, from idem's `payout` table and the gateway's
/// own ledger, after the day and a final reconciliation.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PayoutVerdict {
    pub intended: usize,
    pub completed: usize,
    pub failed: usize,
    /// Paid, then the money came back (learnt by an event or a lookup) and
    /// was credited back.
    pub returned: usize,
    /// Payouts the gateway returned after it paid them.
    pub returned_at_gateway: usize,
    /// Sends to the gateway per payout: the median and the most.
    pub sends_median: i64,
    pub sends_max: i64,
    /// Intents for which idem made more than one payout row (each with its
    /// own downstream key: a second payout).
    pub made_twice: usize,
    /// Downstream keys the gateway paid more than once.
    pub paid_twice_at_gateway: usize,
    /// Gateway payouts under a key no idem payout holds.
    pub at_gateway_without_intent: usize,
    /// Payouts a client was told were made (201) that the gateway did not pay.
    pub told_but_not_paid: usize,
    /// idem says completed, the gateway did not pay; or the gateway paid and
    /// idem says failed.
    pub disagreements: usize,
    /// Payouts not settled after the final reconciliation, each with why.
    pub left_for_a_person: Vec<String>,
    /// Of those, the ones that say no reason a person is needed.
    pub left_without_reason: usize,
    /// Rows of the gateway's ledger (one per downstream key it saw).
    pub gateway_ledger_rows: usize,
    /// Payouts settled by a reconciliation (the services' own, or the
    /// final one) rather than by the request that made them.
    pub settled_by_reconciliation: usize,
    /// The events that tell clients what became of their payouts.
    pub told: ToldVerdict,
}

/// What the clients' receiver got, against each payout's audit trail.
#[derive(Debug, Clone, Default, Serialize)]
pub struct ToldVerdict {
    /// Changes no answer told a client (made by a reconciler, a provider's
    /// event or a person), from the audit trails.
    pub changes: usize,
    /// Of those, the ones the receiver got.
    pub received: usize,
    /// Deliveries the receiver read in all (a lost answer is sent again).
    pub deliveries: usize,
    /// Attempts per delivered event, as the sender counted them: the median
    /// and the most.
    pub attempts_median: i64,
    pub attempts_max: i64,
    /// Changes the receiver got under more than one id, and ids that named
    /// more than one change.
    pub told_twice: usize,
    /// Deliveries whose signature did not verify.
    pub unsigned: usize,
    /// Events left failed, for a person.
    pub left_failed: usize,
}

impl ToldVerdict {
    pub(super) fn whole(&self) -> bool {
        self.received == self.changes && self.told_twice == 0 && self.unsigned == 0 && self.left_failed == 0
    }
}

impl PayoutVerdict {
    pub(super) fn exactly_once(&self) -> bool {
        self.made_twice == 0
            && self.paid_twice_at_gateway == 0
            && self.at_gateway_without_intent == 0
            && self.told_but_not_paid == 0
            && self.disagreements == 0
            && self.left_without_reason == 0
            && self.sends_max <= crate::payout::Limits::default().max_sends
            && self.told.whole()
    }
}

/// After the day: reconciles until every payout is settled or left for a
/// person (a gateway still settling a slow payout is waited for, up to
/// 30 s), then judges the payouts against the gateway's own ledger.
pub(super) fn settle_payouts(
    db: &Db,
    gateway: GatewayProcess,
    (receiver, clients): (&Receiver, usize),
    intents: &[Intent],
    log: &Path,
    policy: &Policy,
) -> Result<PayoutVerdict, HarnessError> {
    let log = std::fs::read_to_string(log).unwrap_or_default();
    let settled_before = log
        .lines()
        .filter(|l| l.contains(r#""event":"reconcile""#))
        .filter(|l| l.contains(r#""now":"completed""#) || l.contains(r#""now":"failed""#))
        .count();
    let settled_at_the_end = reconcile_to_the_end(db, &gateway.url, policy)?;
    let rows = bank::payouts(db)?;
    let paid = crate::outside::gateway::ledger(&crate::outside::gateway::open(&gateway.ledger)?)?;
    drop(gateway);
    let mut v = judge(intents, &rows, &paid);
    v.settled_by_reconciliation = settled_before + settled_at_the_end;
    v.told = tell_to_the_end(db, receiver, clients, &rows, policy)?;
    Ok(v)
}

/// The changes no answer told a client, as each payout's audit trail says:
/// those made by a reconciler, a provider's event or a person.
fn untold(
    store: &mut dyn store::Store,
    rows: &[bank::PayoutLine],
    policy: &Policy,
) -> Result<BTreeSet<(i64, &'static str, &'static str)>, HarnessError> {
    let mut changes = BTreeSet::new();
    for r in rows {
        let Some((_, events)) = payout::events(store, r.id, policy)? else { continue };
        for e in events.iter().filter(|e| e.was != e.now) {
            if ["reconciler:", "event:", "person:"].iter().any(|by| e.actor.starts_with(by)) {
                changes.insert((e.payout_id, e.was.name(), e.now.name()));
            }
        }
    }
    Ok(changes)
}

/// After the last reconciliation: delivers the events still pending (the
/// servers, and their senders, are stopped) until none is, or 30 s have
/// passed, then judges what the receiver got against the audit trails.
fn tell_to_the_end(
    db: &Db,
    receiver: &Receiver,
    clients: usize,
    rows: &[bank::PayoutLine],
    policy: &Policy,
) -> Result<ToldVerdict, HarnessError> {
    let mut store = store::open(db, policy, Usage::LongLived)?;
    let hooks = receiver.hooks(clients);
    let schedule = payout::Schedule {
        first: Duration::from_millis(100),
        cap: Duration::from_secs(1),
        ..Default::default()
    };
    // the receiver is on loopback
    let post = payout::post_http(Duration::from_secs(5), crate::https::Reach::Any);
    let sender = payout::Sender::new(hooks, schedule, std::sync::Arc::new(post));
    let deadline = Instant::now() + Duration::from_secs(30);
    let pending =
        |store: &mut dyn store::Store| payout::client_events(store, Some(Delivery::Pending), 1, policy);
    while !pending(&mut *store)?.is_empty() && Instant::now() < deadline {
        let unix = crate::clock::unix_now();
        // on the final reconciliation's clock, which ran ahead: its changes are due
        let ahead = Timestamp::now().plus_seconds(60);
        sender.round(&mut *store, ahead, unix, policy)?;
        sender.wait(Duration::from_millis(100));
    }
    let changes = untold(&mut *store, rows, policy)?;
    let got = receiver.got();
    let mut ids: BTreeMap<&str, BTreeSet<(i64, String, String)>> = BTreeMap::new();
    for g in &got {
        let v: serde_json::Value = serde_json::from_str(&g.body).unwrap_or_default();
        let d = &v["data"];
        let change = (
            d["payout_id"].as_i64().unwrap_or(0),
            d["previous_state"].as_str().unwrap_or("").to_owned(),
            d["state"].as_str().unwrap_or("").to_owned(),
        );
        ids.entry(g.id.as_str()).or_default().insert(change);
    }
    let mut per_change: BTreeMap<&(i64, String, String), usize> = BTreeMap::new();
    for named in ids.values() {
        for change in named {
            *per_change.entry(change).or_default() += 1;
        }
    }
    let received = changes
        .iter()
        .filter(|(p, was, now)| per_change.contains_key(&(*p, was.to_string(), now.to_string())))
        .count();
    let mut attempts: Vec<i64> =
        payout::client_events(&mut *store, Some(Delivery::Delivered), i64::MAX, policy)?
            .iter()
            .map(|e| e.attempts)
            .collect();
    attempts.sort_unstable();
    Ok(ToldVerdict {
        changes: changes.len(),
        received,
        deliveries: got.len(),
        attempts_median: attempts.get(attempts.len() / 2).copied().unwrap_or(0),
        attempts_max: attempts.last().copied().unwrap_or(0),
        told_twice: per_change.values().filter(|n| **n > 1).count()
            + ids.values().filter(|c| c.len() > 1).count(),
        unsigned: got.iter().filter(|g| !g.signed).count(),
        left_failed: payout::client_events(&mut *store, Some(Delivery::Failed), i64::MAX, policy)?.len(),
    })
}

/// Reconciles until every payout is settled or waits for a person, or 30 s
/// have passed; returns how many it settled.
fn reconcile_to_the_end(db: &Db, url: &str, policy: &Policy) -> Result<usize, HarnessError> {
    let http = HttpGateway {
        url: url.to_owned(),
        token: None,
        timeout: Duration::from_secs(2),
        // the day's reconciliations run ahead of the clock: no waits, and
        // every paid payout looked up for a return once more
        limits: payout::Limits {
            backoff: Duration::ZERO,
            return_check: Duration::from_millis(1),
            ..payout::Limits::default()
        },
    };
    let mut store = store::open(db, policy, Usage::LongLived)?;
    payout::prepare(&mut *store, policy)?;
    // Every server is stopped: no call is in flight, so the leases they
    // took can be treated as over.
    let ahead = || Timestamp::now().plus_seconds(60);
    let deadline = Instant::now() + Duration::from_secs(30);
    // the gateway's returns come a second or two after a payout is paid
    std::thread::sleep(Duration::from_secs(3));
    let mut settled = 0;
    loop {
        let decisions = payout::reconcile(&mut *store, &http, &ahead, policy)?;
        settled += decisions.iter().filter(|d| d.now.settled()).count();
        let open = payout::open(&mut *store, ahead(), policy)?;
        let for_a_person =
            |p: &store::PayoutRow| p.note.as_deref().is_some_and(|n| n.starts_with("needs a person"));
        if open.iter().all(for_a_person) || Instant::now() > deadline {
            return Ok(settled);
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// idem's payout rows against the gateway's ledger.
fn judge(intents: &[Intent], rows: &[bank::PayoutLine], paid: &[Payout]) -> PayoutVerdict {
    let payouts = || intents.iter().filter(|i| i.kind == Kind::Payout);
    let mut v = PayoutVerdict { intended: payouts().count(), ..PayoutVerdict::default() };
    let by_amount: BTreeMap<i64, &Intent> = payouts().map(|i| (i.amount, i)).collect();
    let mut rows_per_intent: BTreeMap<i64, usize> = BTreeMap::new();
    for r in rows {
        *rows_per_intent.entry(r.amount).or_default() += 1;
        let at_gateway: Vec<_> = paid.iter().filter(|g| g.key == r.downstream_key).collect();
        let gateway_paid = at_gateway.iter().any(|g| g.status == "paid");
        let gateway_returned = at_gateway.iter().any(|g| g.status == "returned");
        match r.state.as_str() {
            "completed" => v.completed += 1,
            "failed" => v.failed += 1,
            "returned" => v.returned += 1,
            _ => {
                let note = r.note.as_deref().unwrap_or("no note");
                v.left_without_reason += usize::from(!note.starts_with("needs a person"));
                v.left_for_a_person.push(format!("payout {} ({}): {note}", r.id, r.state));
            }
        }
        // settled, idem and the gateway agree: paid is completed; returned is
        // returned (or failed, if idem never saw it paid); else failed
        let agrees = match r.state.as_str() {
            "completed" => gateway_paid,
            "returned" => gateway_returned,
            "failed" => !gateway_paid,
            _ => true,
        };
        v.disagreements += usize::from(!agrees);
        let told = by_amount.get(&r.amount).is_some_and(|i| i.verdict == Ending::Done);
        v.told_but_not_paid += usize::from(told && !(gateway_paid || gateway_returned));
    }
    v.made_twice = rows_per_intent.values().map(|n| n.saturating_sub(1)).sum::<usize>()
        + rows.iter().filter(|r| !by_amount.contains_key(&r.amount)).count();
    let mut per_key: BTreeMap<&str, usize> = BTreeMap::new();
    for g in paid.iter().filter(|g| g.status == "paid") {
        *per_key.entry(g.key.as_str()).or_default() += 1;
    }
    v.paid_twice_at_gateway = per_key.values().filter(|n| **n > 1).count();
    v.at_gateway_without_intent =
        paid.iter().filter(|g| !rows.iter().any(|r| r.downstream_key == g.key)).count();
    v.gateway_ledger_rows = paid.len();
    v.returned_at_gateway = paid.iter().filter(|g| g.status == "returned").count();
    let mut sends: Vec<i64> = rows.iter().map(|r| r.sends).collect();
    sends.sort_unstable();
    v.sends_median = sends.get(sends.len() / 2).copied().unwrap_or(0);
    v.sends_max = sends.last().copied().unwrap_or(0);
    v
}
