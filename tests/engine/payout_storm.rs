//! The storm, for payouts: random days of payouts through a model gateway
//! that pays, refuses, loses the request or drops its answer, with the
//! process dying after the intent (before or after the gateway got the
//! call), reconciliations and the clock moving, run through the real
//! protocol (`payout::begin`, `finish`, `reconcile`) on every store. After
//! every step: the money adds up (balances + held + paid out), no key has
//! two payouts, idem and the gateway agree on every settled payout, every
//! gateway payout has its idem intent, and a settled answer is final and
//! replayed byte for byte. At the end, a reconciliation settles everything
//! and the gateway has paid exactly what idem says it did.

use crate::common::{Backend, backends, store_with};
use idem::clock::Timestamp;
use idem::payout::{self, Begun, Call, Gateway, Limits, Lookup};
use idem::policy::Policy;
use idem::protocol::Ctx;
use idem::request::{AcctId, Payout, PayoutRequest, ScopedKey};
use idem::store::{self, Durability, End, PayoutRow, PayoutState, Store};
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

const OPENING: i64 = 1_000;
const LEASE: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fate {
    Pay,
    Refuse,
    /// The request never reaches the gateway.
    Lose,
    /// The gateway pays, the answer is lost.
    Drop,
}

#[derive(Debug, Clone)]
enum Op {
    Pay {
        client: u8,
        key: u8,
        amount: i64,
        fate: Fate,
    },
    /// The process dies after the intent; the call reached the gateway (and
    /// was paid) or not.
    Crash {
        client: u8,
        key: u8,
        amount: i64,
        reached: bool,
    },
    /// A reconciliation; `fate` is what any resend meets.
    Reconcile {
        fate: Fate,
    },
    Wait(i64),
}

fn op() -> impl Strategy<Value = Op> {
    let fate = prop::sample::select(vec![Fate::Pay, Fate::Refuse, Fate::Lose, Fate::Drop]);
    let amount = prop::sample::select(vec![100i64, 250, 700]);
    prop_oneof![
        6 => (0..2u8, 0..3u8, amount.clone(), fate.clone())
            .prop_map(|(client, key, amount, fate)| Op::Pay { client, key, amount, fate }),
        2 => (0..2u8, 0..3u8, amount, any::<bool>())
            .prop_map(|(client, key, amount, reached)| Op::Crash { client, key, amount, reached }),
        2 => fate.prop_map(|fate| Op::Reconcile { fate }),
        2 => prop::sample::select(vec![1i64, 30, 61, 600]).prop_map(Op::Wait),
    ]
}

/// The outside service, in memory: one outcome per key, as a provider
/// deduplicates by its idempotency key.
struct ModelGateway {
    ledger: Mutex<BTreeMap<String, bool>>, // key → paid (true) or refused (false)
    fate: Mutex<Fate>,
    /// Lookups fail (a 503) while this is set.
    down: Mutex<bool>,
    limits: Limits,
}

impl ModelGateway {
    fn answer(paid: bool) -> Call {
        match paid {
            true => Call::Paid(None),
            false => Call::Refused { status: 402, reason: "account_closed".into() },
        }
    }
}

impl Gateway for ModelGateway {
    fn send(&self, p: &PayoutRow) -> Call {
        let fate = *self.fate.lock().unwrap();
        let mut ledger = self.ledger.lock().unwrap();
        if fate == Fate::Lose {
            return Call::Unknown("lost on the way".into());
        }
        let paid = *ledger.entry(p.downstream_key.clone()).or_insert(fate != Fate::Refuse);
        match fate {
            Fate::Drop => Call::Unknown("answer lost".into()),
            _ => Self::answer(paid),
        }
    }

    fn lookup(&self, p: &PayoutRow) -> Lookup {
        if *self.down.lock().unwrap() {
            return Lookup::Error("HTTP 503".into());
        }
        match self.ledger.lock().unwrap().get(&p.downstream_key) {
            Some(true) => Lookup::Paid(None),
            Some(false) => Lookup::Failed { reason: "account_closed".into() },
            None => Lookup::NotFound,
        }
    }

    fn limits(&self) -> &Limits {
        &self.limits
    }
    fn lease(&self) -> Duration {
        LEASE
    }
}

fn request(client: u8, key: u8, amount: i64) -> PayoutRequest {
    let body = format!(r#"{{"src":"acct-0","beneficiary":"bob","amount":{amount},"currency":"KRW"}}"#);
    let key = ScopedKey {
        client_id: format!("client-{client}"),
        endpoint: payout::PAYOUTS.into(),
        idem_key: format!("k{key}"),
    };
    let req = idem::request::parse_payout(key, body.as_bytes(), Policy::embedded()).unwrap();
    assert_eq!(
        req.payout,
        Payout {
            src: AcctId::Text("acct-0".into()),
            beneficiary: "bob".into(),
            amount,
            currency: "KRW".into()
        }
    );
    req
}

/// Every payout row (ids are dense: nothing deletes a payout).
fn rows(store: &mut dyn Store, policy: &Policy) -> Vec<PayoutRow> {
    store::atomically(store, Durability::Lazy, policy, |tx| {
        let mut all = Vec::new();
        while let Some(p) = tx.payout(all.len() as i64 + 1)? {
            all.push(p);
        }
        Ok(End::Rollback(all))
    })
    .unwrap()
}

/// A settled answer: its status and its reason and body as text.
type Settled = (u16, String);

struct Day<'a> {
    store: &'a mut dyn Store,
    gateway: ModelGateway,
    start: Timestamp,
    now: i64,
    tokens: u64,
    /// The amount each key was first sent with, and its settled answer.
    keys: BTreeMap<(u8, u8), (i64, Option<Settled>)>,
}

impl Day<'_> {
    fn ctx_token(&mut self) -> String {
        self.tokens += 1;
        format!("t{}", self.tokens)
    }

    fn now(&self) -> Timestamp {
        self.start.plus_seconds(self.now)
    }

    /// Checks one answer to `(client, key)` sent with `amount`.
    fn check(
        &mut self,
        client: u8,
        key: u8,
        amount: i64,
        answer: payout::Answer,
    ) -> Result<(), TestCaseError> {
        let r = answer.response;
        let (first_amount, settled) = self.keys.entry((client, key)).or_insert((amount, None)).clone();
        if first_amount != amount {
            prop_assert_eq!(r.status, 422, "another body under the key: {:?}", r);
            return Ok(());
        }
        let text = format!("{:?}|{}", r.reason, r.body);
        match (r.status, settled) {
            (201 | 402, Some((status, first))) => {
                prop_assert_eq!((r.status, &text), (status, &first), "a settled answer changed");
            }
            (201 | 402, None) => {
                self.keys.insert((client, key), (amount, Some((r.status, text))));
            }
            (202, None) => {}
            (status, settled) => {
                return Err(TestCaseError::fail(format!("answer {status} {r:?} after {settled:?}")));
            }
        }
        Ok(())
    }

    fn begin(&mut self, client: u8, key: u8, amount: i64) -> Result<Option<Box<PayoutRow>>, TestCaseError> {
        let policy = Policy::embedded();
        let token = self.ctx_token();
        let ctx = Ctx { policy, now: self.now(), token: &token };
        match payout::begin(&mut *self.store, &request(client, key, amount), ctx, LEASE).unwrap() {
            Begun::Answer(answer) => self.check(client, key, amount, answer).map(|()| None),
            Begun::Call(row) => {
                self.keys.entry((client, key)).or_insert((amount, None));
                Ok(Some(row))
            }
        }
    }

    /// Step 3 now: records `call` for `row`; the payout as it stands.
    fn finish(&mut self, row: &PayoutRow, call: Call) -> PayoutRow {
        let now = self.now();
        payout::finish(&mut *self.store, row, call, now, Policy::embedded()).unwrap()
    }

    fn reconcile(&mut self, fate: Fate, ahead: i64) {
        *self.gateway.fate.lock().unwrap() = fate;
        let now = self.start.plus_seconds(self.now + ahead);
        payout::reconcile(&mut *self.store, &self.gateway, &|| now, Policy::embedded()).unwrap();
    }

    /// The invariants, from idem's tables and the gateway's ledger.
    fn invariants(&mut self, after: &Op) -> Result<(), TestCaseError> {
        let policy = Policy::embedded();
        let rows = rows(&mut *self.store, policy);
        let audit = self.store.audit().unwrap();
        let out: i64 = rows
            .iter()
            .filter(|p| !matches!(p.state, PayoutState::Failed | PayoutState::Returned))
            .map(|p| p.amount)
            .sum();
        prop_assert_eq!(audit.money() + out, OPENING * 2, "money after {:?}: {:?}", after, rows);
        let mut per_key = BTreeMap::new();
        for p in &rows {
            *per_key.entry(p.key.clone()).or_insert(0) += 1;
        }
        prop_assert!(
            per_key.values().all(|n| *n == 1),
            "a key with two payouts after {:?}: {:?}",
            after,
            rows
        );
        let ledger = self.gateway.ledger.lock().unwrap().clone();
        for p in &rows {
            match (p.state, ledger.get(&p.downstream_key)) {
                (PayoutState::Completed, Some(true)) | (PayoutState::Failed, Some(false)) => {}
                (PayoutState::InProgress | PayoutState::Unknown | PayoutState::NeedsAttention, _) => {}
                (state, at_gateway) => {
                    return Err(TestCaseError::fail(format!(
                        "idem says {state:?}, the gateway {at_gateway:?}, after {after:?}"
                    )));
                }
            }
        }
        for key in ledger.keys() {
            prop_assert!(
                rows.iter().any(|p| &p.downstream_key == key),
                "a gateway payout with no intent: {}",
                key
            );
        }
        Ok(())
    }
}

fn run(store: &mut dyn Store, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let policy = Policy::embedded();
    let mut day = day_on(store);
    for op in &ops {
        match op {
            Op::Pay { client, key, amount, fate } => {
                if let Some(row) = day.begin(*client, *key, *amount)? {
                    *day.gateway.fate.lock().unwrap() = *fate;
                    let call = day.gateway.send(&row);
                    let after = day.finish(&row, call);
                    day.check(*client, *key, *amount, payout::answer_of(&after))?;
                }
            }
            Op::Crash { client, key, amount, reached } => {
                if let Some(row) = day.begin(*client, *key, *amount)?
                    && *reached
                {
                    *day.gateway.fate.lock().unwrap() = Fate::Pay;
                    day.gateway.send(&row);
                }
            }
            Op::Reconcile { fate } => day.reconcile(*fate, 0),
            Op::Wait(seconds) => day.now += seconds,
        }
        day.invariants(op)?;
    }
    // The end of the day: every lease over, every resend answered.
    day.reconcile(Fate::Pay, LEASE.as_secs() as i64 + 1);
    let end = Op::Reconcile { fate: Fate::Pay };
    day.invariants(&end)?;
    let rows = rows(&mut *day.store, policy);
    prop_assert!(rows.iter().all(|p| p.state.settled()), "left unsettled: {:?}", rows);
    let paid = day.gateway.ledger.lock().unwrap().values().filter(|paid| **paid).count();
    prop_assert_eq!(paid, rows.iter().filter(|p| p.state == PayoutState::Completed).count());
    // and a retry of every key now gets its settled answer, the same as before
    let keys: Vec<((u8, u8), i64)> = day.keys.iter().map(|(k, (amount, _))| (*k, *amount)).collect();
    for ((client, key), amount) in keys {
        let row = day.begin(client, key, amount)?;
        prop_assert!(row.is_none(), "a settled key made a second payout");
    }
    Ok(())
}

fn accounts() -> Vec<(AcctId, i64)> {
    vec![(AcctId::Text("acct-0".into()), OPENING), (AcctId::Text("acct-1".into()), OPENING)]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]
    #[test]
    fn payouts_agree_with_the_gateway_on_random_days(ops in prop::collection::vec(op(), 1..30)) {
        let mut store = store_with(Backend::Sqlite, &accounts());
        run(&mut *store, ops)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn on_postgres_payouts_agree_with_the_gateway_on_random_days(ops in prop::collection::vec(op(), 1..30)) {
        for backend in backends().into_iter().filter(|b| *b != Backend::Sqlite) {
            let mut store = store_with(backend, &accounts());
            run(&mut *store, ops.clone())?;
        }
    }
}

/// A day on `store`, its payout table made, the model gateway paying.
fn day_on(store: &mut dyn Store) -> Day<'_> {
    payout::prepare(store, Policy::embedded()).unwrap();
    Day {
        store,
        gateway: ModelGateway {
            ledger: Mutex::default(),
            fate: Mutex::new(Fate::Pay),
            down: Mutex::new(false),
            // the day's own clock moves in steps: a wait is the step's business
            limits: Limits { backoff: Duration::ZERO, max_sends: i64::MAX, ..Limits::default() },
        },
        start: Timestamp::parse("2026-12-01T00:00:00Z").unwrap(),
        now: 0,
        tokens: 0,
        keys: BTreeMap::new(),
    }
}

#[test]
fn a_settled_payout_is_final_even_to_a_second_result_from_its_own_holder() {
    for backend in backends() {
        let mut store = store_with(backend, &accounts());
        let mut day = day_on(&mut *store);
        let row = day.begin(0, 0, 250).unwrap().expect("a new key calls the gateway");
        let paid = day.finish(&row, Call::Paid(None));
        assert_eq!(paid.state, PayoutState::Completed);
        // the same holder, a late and contrary result: nothing may change
        let refused = Call::Refused { status: 402, reason: "account_closed".into() };
        let again = day.finish(&row, refused);
        assert_eq!(again, paid, "{backend:?}: a settled payout changed");
        let money = day.store.audit().unwrap().money();
        assert_eq!(money + 250, OPENING * 2, "{backend:?}: the hold was released after the payout was paid");
    }
}

/// One request under `(client, key)` at the day's time: its answer, or
/// `None` if it called the gateway (the payout it made is then abandoned).
fn answer(day: &mut Day<'_>, client: u8, key: u8, amount: i64) -> Option<payout::Answer> {
    let token = day.ctx_token();
    let ctx = Ctx { policy: Policy::embedded(), now: day.now(), token: &token };
    match payout::begin(&mut *day.store, &request(client, key, amount), ctx, LEASE).unwrap() {
        Begun::Answer(answer) => Some(answer),
        Begun::Call(_) => None,
    }
}

#[test]
fn a_key_never_pays_twice_however_long_its_payout_stays_unknown() {
    // The review's repro: the gateway pays, the answer is lost, its lookup
    // fails for days; the client sends the same key and body at +73 h.
    let policy = Policy::embedded();
    for backend in backends() {
        let mut store = store_with(backend, &accounts());
        let mut day = day_on(&mut *store);
        let first = day.begin(0, 0, 100).unwrap().unwrap();
        day.gateway.ledger.lock().unwrap().insert(first.downstream_key.clone(), true);
        day.finish(&first, Call::Unknown("answer lost".into()));
        *day.gateway.down.lock().unwrap() = true;
        for hours in [1, 25, 73] {
            day.now = hours * 3600;
            day.reconcile(Fate::Pay, 0);
            // the operator's purge at its default, each time
            let now = day.now();
            idem::protocol::purge_expired(&mut *day.store, now, 100, policy).unwrap();
            let claims = idem::protocol::open_claims(&mut *day.store, now, policy).unwrap();
            assert!(
                claims.iter().any(|c| c.key == first.key),
                "{backend:?} +{hours} h: an open payout's claim was purged"
            );
            let retry = answer(&mut day, 0, 0, 100)
                .unwrap_or_else(|| panic!("{backend:?}: at +{hours} h the key made a second payout"));
            assert_eq!(
                (retry.response.status, retry.payout_id),
                (202, Some(first.id)),
                "{backend:?} +{hours} h"
            );
            // another body under the key is not a new payout either
            let other = answer(&mut day, 0, 0, 250).expect("another body made a payout");
            assert_eq!(other.response.status, 422, "{backend:?} +{hours} h: {other:?}");
        }
        assert_eq!(rows(&mut *day.store, policy).len(), 1, "{backend:?}");
        // the lookup answers again: the payout is settled, and its key answers with it
        *day.gateway.down.lock().unwrap() = false;
        day.reconcile(Fate::Pay, 0);
        let retry = answer(&mut day, 0, 0, 100).expect("a settled key called the gateway");
        assert_eq!((retry.response.status, retry.payout_id), (201, Some(first.id)), "{backend:?}");
        // retention after it settled, the key is spent: 409, never a new payout
        day.now += policy.retention_seconds() + 1;
        let now = day.now();
        idem::protocol::purge_expired(&mut *day.store, now, 100, policy).unwrap();
        for amount in [100, 250] {
            let spent = answer(&mut day, 0, 0, amount).expect("a spent key made a new payout");
            assert_eq!(spent.response.status, 409, "{backend:?}: {spent:?}");
            assert_eq!(spent.response.reason, Some(idem::reason::Reason::PayoutKeyUsed), "{backend:?}");
        }
        assert_eq!(rows(&mut *day.store, policy).len(), 1, "{backend:?}");
        assert_eq!(day.gateway.ledger.lock().unwrap().len(), 1, "{backend:?}: paid twice at the gateway");
    }
}

#[test]
fn a_payout_of_the_whole_balance_goes_out_and_one_unit_more_is_refused() {
    for backend in backends() {
        let mut store = store_with(backend, &accounts());
        let mut day = day_on(&mut *store);
        let ctx = Ctx { policy: Policy::embedded(), now: day.now(), token: "t-over" };
        let Begun::Answer(over) =
            payout::begin(&mut *day.store, &request(0, 1, OPENING + 1), ctx, LEASE).unwrap()
        else {
            panic!("{backend:?}: a payout over the balance called the gateway")
        };
        assert_eq!(over.response.reason.map(|r| r.to_string()), Some("insufficient_funds".into()));
        let row = day.begin(0, 0, OPENING).unwrap().expect("the whole balance may go out");
        assert_eq!(day.finish(&row, Call::Paid(None)).state, PayoutState::Completed, "{backend:?}");
        assert_eq!(
            day.store.audit().unwrap().money(),
            OPENING,
            "{backend:?}: acct-0 emptied, acct-1 untouched"
        );
    }
}

#[test]
fn a_retry_of_a_new_body_in_flight_under_a_key_past_retention_is_409_not_the_old_payout() {
    let retention = Policy::embedded().retention_seconds();
    for backend in backends() {
        let mut store = store_with(backend, &accounts());
        let mut day = day_on(&mut *store);
        let old = day.begin(0, 0, 100).unwrap().unwrap();
        day.finish(&old, Call::Paid(None));
        // past retention, another body claims the key and its process dies
        // before the intent
        day.now += retention + 3600;
        let (key, new_body) = (request(0, 0, 250).key, request(0, 0, 250));
        let ctx = Ctx { policy: Policy::embedded(), now: day.now(), token: "t-died" };
        assert_eq!(
            idem::protocol::claim_key(&mut *day.store, &key, &new_body.fingerprint, ctx).unwrap(),
            idem::protocol::Claimed::Mine
        );
        // its retry: in flight, and nothing of the old payout's
        let ctx = Ctx { policy: Policy::embedded(), now: day.now(), token: "t-retry" };
        let Begun::Answer(retry) = payout::begin(&mut *day.store, &new_body, ctx, LEASE).unwrap() else {
            panic!("{backend:?}: a key held by another request called the gateway")
        };
        assert_eq!((retry.response.status, retry.payout_id), (409, None), "{backend:?}: {retry:?}");
    }
}

#[test]
fn a_gateway_text_with_control_characters_is_stored_clean_and_bounded() {
    for backend in backends() {
        let mut store = store_with(backend, &accounts());
        let mut day = day_on(&mut *store);
        let row = day.begin(0, 0, 250).unwrap().expect("a new key calls the gateway");
        // PostgreSQL refuses a NUL in text: stored as it came, the refusal
        // failed, and with it every reconciliation that met this payout
        let reason = format!("account_closed\u{0}\r\n{}", "x".repeat(1_000));
        let refused = day.finish(&row, Call::Refused { status: 402, reason });
        assert_eq!(refused.state, PayoutState::Failed, "{backend:?}");
        let note = refused.note.expect("the refusal's reason");
        assert!(note.starts_with("account_closed\u{fffd}\u{fffd}\u{fffd}x"), "{backend:?}: {note:?}");
        assert_eq!(note.chars().count(), 200, "{backend:?}");
        let money = day.store.audit().unwrap().money();
        assert_eq!(money, OPENING * 2, "{backend:?}: the refused payout's hold was not released");
    }
}

/// A gateway whose every answer is set per test.
struct Scripted {
    send: Mutex<Call>,
    lookup: Mutex<Lookup>,
    sends: Mutex<usize>,
    /// The payouts looked up, in order.
    looked: Mutex<Vec<i64>>,
    limits: Limits,
}

impl Gateway for Scripted {
    fn send(&self, _: &PayoutRow) -> Call {
        *self.sends.lock().unwrap() += 1;
        self.send.lock().unwrap().clone()
    }
    fn lookup(&self, p: &PayoutRow) -> Lookup {
        self.looked.lock().unwrap().push(p.id);
        self.lookup.lock().unwrap().clone()
    }
    fn limits(&self) -> &Limits {
        &self.limits
    }
    fn lease(&self) -> Duration {
        LEASE
    }
}

fn scripted(send: Call, lookup: Lookup) -> Scripted {
    let limits = Limits {
        backoff: Duration::from_secs(10),
        backoff_cap: Duration::from_secs(60),
        max_sends: 4,
        ..Limits::default()
    };
    Scripted {
        send: Mutex::new(send),
        lookup: Mutex::new(lookup),
        sends: Mutex::new(0),
        looked: Mutex::default(),
        limits,
    }
}

/// Reconciles with `gateway` once a minute for `minutes` of the day's clock.
fn reconcile_for(day: &mut Day<'_>, gateway: &Scripted, minutes: i64) -> Vec<payout::Decision> {
    let mut all = Vec::new();
    for _ in 0..minutes {
        day.now += 60;
        let now = day.now();
        all.extend(payout::reconcile(&mut *day.store, gateway, &|| now, Policy::embedded()).unwrap());
    }
    all
}

#[test]
fn a_payout_never_found_is_sent_at_most_max_sends_times_with_a_growing_wait_then_waits_for_a_person() {
    for backend in backends() {
        let mut store = store_with(backend, &accounts());
        let mut day = day_on(&mut *store);
        let row = day.begin(0, 0, 100).unwrap().unwrap();
        day.finish(&row, Call::Unknown("lost on the way".into()));
        let gateway = scripted(Call::Unknown("lost again".into()), Lookup::NotFound);
        // a day of reconciling once a minute: before, a resend every run (1 440)
        let decisions = reconcile_for(&mut day, &gateway, 24 * 60);
        assert_eq!(*gateway.sends.lock().unwrap(), 3, "{backend:?}: 4 sends in all, the request's own first");
        let last = decisions.last().unwrap();
        assert_eq!((last.now, last.sends), (PayoutState::NeedsAttention, 4), "{backend:?}: {decisions:?}");
        assert!(decisions.len() <= 6, "{backend:?}: looked at {} times: no backoff", decisions.len());
        let p = &rows(&mut *day.store, Policy::embedded())[0];
        assert!(p.note.as_deref().unwrap().contains("after 4 sends"), "{backend:?}: {p:?}");
        assert_eq!(
            day.store.audit().unwrap().money() + 100,
            OPENING * 2,
            "{backend:?}: the money stays held"
        );
    }
}

/// Review N7: 100 slow return checks (0.2 s each) kept an `unknown` payout
/// waiting about 20 s on a 1 s loop. A payout that falls due while returns
/// are checked is looked at before the checks go on.
#[test]
fn a_payout_falling_due_during_return_checks_is_looked_at_before_they_go_on() {
    for backend in backends() {
        let mut store = store_with(backend, &accounts());
        let mut day = day_on(&mut *store);
        for key in 0..30 {
            let row = day.begin(0, key, 10).unwrap().unwrap();
            day.finish(&row, Call::Paid(None));
        }
        let row = day.begin(0, 99, 10).unwrap().unwrap();
        let unknown = day.finish(&row, Call::Unknown("timeout".into())).id;
        let mut gateway = scripted(Call::Unknown("lost".into()), Lookup::Paid(None));
        gateway.limits.return_check = Duration::from_secs(3600);
        // a clock a second further at each reading; the unknown payout's
        // next look 10 s after the pass starts, the 30 paid ones due for a
        // return check from its start
        let start = day.now().plus_seconds(2 * 3600);
        let policy = Policy::embedded();
        store::atomically(&mut *day.store, Durability::Durable, policy, |tx| {
            let mut p = tx.payout(unknown)?.unwrap();
            let holder = p.holder.clone();
            p.lease_until = start.plus_seconds(10);
            assert!(tx.update_payout(&p, &holder)?);
            Ok(End::Commit(()))
        })
        .unwrap();
        let ticks = std::cell::Cell::new(0);
        let now = || {
            ticks.set(ticks.get() + 1);
            start.plus_seconds(ticks.get())
        };
        let decisions = payout::reconcile(&mut *day.store, &gateway, &now, policy).unwrap();
        let looked = gateway.looked.lock().unwrap().clone();
        let at = looked.iter().position(|&id| id == unknown);
        assert!(
            at.is_some_and(|at| at < 20),
            "{backend:?}: the unknown payout was looked up at {at:?} of {}",
            looked.len()
        );
        assert!(decisions.iter().any(|d| d.payout_id == unknown && d.now == PayoutState::Completed));
        assert_eq!(looked.len(), 31, "{backend:?}: every return checked once, in the same pass");
    }
}

/// Review N9: an `unknown` payout waiting for its next look (49 minutes
/// ahead in the review's run) is held by nobody, and is exactly the case a
/// person is called for: they may settle it at once.
#[test]
fn a_person_settles_an_unknown_payout_while_it_waits_for_its_next_look() {
    for backend in backends() {
        let mut store = store_with(backend, &accounts());
        let mut day = day_on(&mut *store);
        let row = day.begin(0, 0, 100).unwrap().unwrap();
        day.finish(&row, Call::Unknown("timeout".into()));
        let gateway = scripted(Call::Unknown("lost again".into()), Lookup::Error("HTTP 503".into()));
        let looked = reconcile_for(&mut day, &gateway, 1);
        assert_eq!(looked.iter().map(|d| d.now).collect::<Vec<_>>(), [PayoutState::Unknown], "{backend:?}");
        let p = rows(&mut *day.store, Policy::embedded()).remove(0);
        assert!(p.lease_until > day.now(), "{backend:?}: the next look is ahead: {p:?}");
        let (now, policy) = (day.now(), Policy::embedded());
        let found = payout::Finding::Failed;
        let settled = payout::settle_by_hand(&mut *day.store, p.id, &found, "never sent", "kim", now, policy);
        let settled = settled.unwrap().unwrap_or_else(|why| panic!("{backend:?}: refused: {why}"));
        assert_eq!(settled.state, PayoutState::Failed, "{backend:?}");
        assert_eq!(day.store.audit().unwrap().money(), OPENING * 2, "{backend:?}: the hold is back");
    }
}

#[test]
fn an_answer_no_resend_can_fix_goes_to_a_person_at_once_and_is_never_sent_again() {
    for backend in backends() {
        let mut store = store_with(backend, &accounts());
        let mut day = day_on(&mut *store);
        // the request's own call: a 401 (idem's token is wrong) is no refusal of the payout
        let row = day.begin(0, 0, 100).unwrap().unwrap();
        let p = day.finish(&row, payout::classify_send(401, r#"{"error":"unauthorized"}"#, &row));
        assert_eq!(p.state, PayoutState::NeedsAttention, "{backend:?}");
        assert_eq!(
            payout::answer_of(&p).response.status,
            202,
            "{backend:?}: the money is held, the outcome open"
        );
        // a lookup that finds another amount under the key: never taken for paid
        let other = day.begin(0, 1, 250).unwrap().unwrap();
        day.finish(&other, Call::Unknown("timeout".into()));
        let mismatch = payout::classify_lookup(200, r#"{"status":"paid","amount":2500}"#, &other);
        let gateway = scripted(Call::Paid(None), mismatch);
        let decisions = reconcile_for(&mut day, &gateway, 120);
        assert_eq!(decisions.len(), 1, "{backend:?}: {decisions:?}");
        assert_eq!(decisions[0].now, PayoutState::NeedsAttention, "{backend:?}");
        assert_eq!(*gateway.sends.lock().unwrap(), 0, "{backend:?}");
        assert_eq!(day.store.audit().unwrap().money() + 350, OPENING * 2, "{backend:?}");
    }
}

#[test]
fn a_payout_whose_result_cannot_be_stored_is_set_aside_and_the_run_settles_the_rest() {
    for backend in backends() {
        let dir = tempfile::tempdir().unwrap();
        let rows_ = [(serde_json::json!("acct-0"), OPENING), (serde_json::json!("acct-1"), OPENING)];
        let spec = crate::common::make_bank(backend, dir.path(), &rows_, false);
        let db = idem::store::Db::parse(spec.to_str().unwrap());
        let policy = Policy::embedded();
        let mut store = idem::store::open(&db, policy, idem::store::Usage::LongLived).unwrap();
        let mut day = day_on(&mut *store);
        let first = day.begin(0, 0, 100).unwrap().unwrap(); // from acct-0
        day.finish(&first, Call::Unknown("timeout".into()));
        let body = r#"{"src":"acct-1","beneficiary":"bob","amount":100,"currency":"KRW"}"#;
        let key = ScopedKey {
            client_id: "client-1".into(),
            endpoint: payout::PAYOUTS.into(),
            idem_key: "k".into(),
        };
        let req = idem::request::parse_payout(key, body.as_bytes(), policy).unwrap();
        let ctx = Ctx { policy, now: day.now(), token: "t-second" };
        let Begun::Call(second) = payout::begin(&mut *day.store, &req, ctx, LEASE).unwrap() else { panic!() };
        day.finish(&second, Call::Unknown("timeout".into()));
        // acct-0 is closed by hand: releasing the first payout's hold cannot be written
        let sql = "DELETE FROM account WHERE acct_id = 'acct-0'";
        match backend {
            Backend::Sqlite => drop(rusqlite::Connection::open(&spec).unwrap().execute(sql, []).unwrap()),
            _ => drop(crate::common::pg::client(spec.to_str().unwrap()).execute(sql, &[]).unwrap()),
        }
        let refused = scripted(Call::Paid(None), Lookup::Failed { reason: "account_closed".into() });
        let decisions = reconcile_for(&mut day, &refused, 1);
        let states: Vec<PayoutState> = decisions.iter().map(|d| d.now).collect();
        assert_eq!(states, [PayoutState::NeedsAttention, PayoutState::Failed], "{backend:?}: {decisions:?}");
        assert!(decisions[0].decision.contains("set aside"), "{backend:?}: {decisions:?}");
        assert_eq!(day.store.audit().unwrap().money(), OPENING, "{backend:?}: acct-1's hold is back");
    }
}

#[test]
fn a_first_version_payout_table_is_migrated_with_its_rows() {
    for backend in backends() {
        let dir = tempfile::tempdir().unwrap();
        let rows_ = [(serde_json::json!("acct-0"), OPENING)];
        let spec = crate::common::make_bank(backend, dir.path(), &rows_, false);
        // the table as the first version made it, with one unknown payout
        let (v1, row) = (
            "CREATE TABLE payout (payout_id {id} PRIMARY KEY, client_id TEXT NOT NULL, endpoint TEXT NOT NULL,
                 idem_key TEXT NOT NULL, fingerprint TEXT NOT NULL, src TEXT NOT NULL, beneficiary TEXT NOT NULL,
                 amount BIGINT NOT NULL CHECK (amount > 0), currency TEXT NOT NULL, downstream_key TEXT NOT NULL UNIQUE,
                 state TEXT NOT NULL CHECK (state IN ('in_progress', 'completed', 'failed', 'unknown')),
                 holder TEXT NOT NULL, lease_until TEXT NOT NULL, created_at TEXT NOT NULL, updated_at TEXT NOT NULL,
                 note TEXT, status INTEGER, CHECK ((state IN ('completed', 'failed')) = (status IS NOT NULL)))",
            "INSERT INTO payout VALUES (7, 'c', '/v1/payouts', 'k', 'f', 'acct-0', 'bob', 100, 'KRW',
                 'idem-po-0123', 'unknown', 'h', '2026-12-01T00:00:00Z', '2026-12-01T00:00:00Z',
                 '2026-12-01T00:00:00Z', 'timeout', NULL)",
        );
        match backend {
            Backend::Sqlite => {
                let v1 = v1.replace("{id}", "INTEGER");
                rusqlite::Connection::open(&spec).unwrap().execute_batch(&format!("{v1}; {row}")).unwrap()
            }
            _ => {
                let v1 = v1.replace("{id}", "bigint GENERATED BY DEFAULT AS IDENTITY");
                crate::common::pg::client(spec.to_str().unwrap())
                    .batch_execute(&format!("{v1}; {row}"))
                    .unwrap()
            }
        }
        let db = idem::store::Db::parse(spec.to_str().unwrap());
        let policy = Policy::embedded();
        let mut store = idem::store::open(&db, policy, idem::store::Usage::LongLived).unwrap();
        for _ in 0..2 {
            payout::prepare(&mut *store, policy).unwrap(); // and again: a no-op
        }
        let p =
            store::atomically(&mut *store, Durability::Lazy, policy, |tx| Ok(End::Rollback(tx.payout(7)?)))
                .unwrap()
                .unwrap();
        assert_eq!(
            (p.state, p.downstream_key.as_str(), p.sends),
            (PayoutState::Unknown, "idem-po-0123", 0),
            "{backend:?}"
        );
        // the new state is now storable
        let gateway = scripted(Call::Paid(None), Lookup::Terminal("on_hold".into()));
        let now = Timestamp::parse("2026-12-01T01:00:00Z").unwrap();
        let d = payout::reconcile(&mut *store, &gateway, &|| now, policy).unwrap();
        assert_eq!(d[0].now, PayoutState::NeedsAttention, "{backend:?}: {d:?}");
    }
}

#[test]
fn a_paid_payout_whose_money_comes_back_is_credited_back_once_and_its_post_still_replays_201() {
    let policy = Policy::embedded();
    for backend in backends() {
        let mut store = store_with(backend, &accounts());
        let mut day = day_on(&mut *store);
        let row = day.begin(0, 0, 100).unwrap().unwrap();
        day.finish(&row, Call::Paid(Some("po_1".into())));
        let first = answer(&mut day, 0, 0, 100).unwrap().response;
        assert_eq!(first.status, 201, "{backend:?}");
        // the bank returns it two days later; the reconciler learns it by a lookup
        let gateway =
            scripted(Call::Paid(None), Lookup::Failed { reason: "returned: account_closed".into() });
        *gateway.lookup.lock().unwrap() = Lookup::Paid(None);
        let quiet = reconcile_for(&mut day, &gateway, 7 * 60); // still paid: no decision
        assert!(quiet.is_empty(), "{backend:?}: {quiet:?}");
        *gateway.lookup.lock().unwrap() = Lookup::Failed { reason: "returned: account_closed".into() };
        day.now += 36 * 3600;
        let back = reconcile_for(&mut day, &gateway, 1);
        assert_eq!(back.len(), 1, "{backend:?}: {back:?}");
        assert_eq!(
            (back[0].was, back[0].now),
            (PayoutState::Completed, PayoutState::Returned),
            "{backend:?}"
        );
        assert_eq!(day.store.audit().unwrap().money(), OPENING * 2, "{backend:?}: credited back");
        // once: later runs, and the window's end, change nothing
        day.now += 7 * 3600;
        assert!(reconcile_for(&mut day, &gateway, 1).is_empty(), "{backend:?}");
        assert_eq!(day.store.audit().unwrap().money(), OPENING * 2, "{backend:?}");
        // the POST replays what it answered; GET shows the return
        let again = answer(&mut day, 0, 0, 100).unwrap().response;
        assert_eq!((again.status, &again.body), (201, &first.body), "{backend:?}");
        let p = &rows(&mut *day.store, policy)[0];
        let shown: serde_json::Value = serde_json::from_str(&payout::to_json(p)).unwrap();
        assert_eq!(
            (shown["state"].as_str(), shown["reason"].as_str()),
            (Some("returned"), Some("returned: account_closed"))
        );
        let (_, events) = payout::events(&mut *day.store, p.id, policy).unwrap().unwrap();
        let last = events.last().unwrap();
        assert_eq!(
            (last.was, last.now),
            (PayoutState::Completed, PayoutState::Returned),
            "{backend:?}: {events:?}"
        );
    }
}

/// A paid payout is looked up for returns for the 45-day window, the
/// lookups spaced by its age: every 6 h to 3 days, daily to 14 days,
/// every 3 days after. The reconciler runs hourly for 50 days: 33 lookups,
/// where one every 6 h would be 180, and none past the window.
#[test]
fn return_lookups_are_spaced_by_the_payouts_age_over_the_window() {
    for backend in backends() {
        let mut store = store_with(backend, &accounts());
        let mut day = day_on(&mut *store);
        let row = day.begin(0, 0, 100).unwrap().unwrap();
        day.finish(&row, Call::Paid(None));
        let gateway = scripted(Call::Paid(None), Lookup::Paid(None));
        let paid = day.now;
        let mut at_hours = Vec::new();
        for _ in 0..50 * 24 {
            day.now += 3600;
            let before = gateway.looked.lock().unwrap().len();
            let now = day.now();
            payout::reconcile(&mut *day.store, &gateway, &|| now, Policy::embedded()).unwrap();
            if gateway.looked.lock().unwrap().len() > before {
                at_hours.push((day.now - paid) / 3600);
            }
        }
        let within = |from: i64, to: i64| at_hours.iter().filter(|h| (from..to).contains(*h)).count();
        assert_eq!(
            (within(0, 73), within(73, 337), within(337, 1081), within(1081, 1201)),
            (12, 11, 10, 0),
            "{backend:?}: lookups at hours {at_hours:?}"
        );
    }
}

#[test]
fn a_payout_paid_before_the_return_window_is_not_looked_up_again() {
    for backend in backends() {
        let mut store = store_with(backend, &accounts());
        let mut day = day_on(&mut *store);
        let row = day.begin(0, 0, 100).unwrap().unwrap();
        day.finish(&row, Call::Paid(None));
        day.now += 46 * 24 * 3600; // past the 45-day window
        let gateway = scripted(Call::Paid(None), Lookup::Failed { reason: "returned".into() });
        assert!(reconcile_for(&mut day, &gateway, 1).is_empty(), "{backend:?}");
        assert_eq!(day.store.audit().unwrap().money() + 100, OPENING * 2, "{backend:?}");
    }
}
