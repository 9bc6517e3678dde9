//! The recovery job of the layer's outside calls, and a person's way in:
//! the calls left open listed, and settled by hand.

use super::Idempotency;
use super::calls::{Sql, Val};
use super::outside::{
    COLUMNS, CallCounts, CallRow, FOR_A_PERSON, INTS, Outcome, Outside, PAID, REFUSED, Recorded, SENT,
    UNKNOWN, begun, bounded, ms, now_ms, record,
};
use crate::embed::Keys;
use crate::provider::{Call, Intent, Lookup, Next, judge, resent, seed};
use crate::store::StoreError;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// One decision of the recovery job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovered {
    /// The call's row.
    pub id: i64,
    /// The key its provider sees.
    pub downstream_key: String,
    /// Its state before.
    pub was: String,
    /// Its state after.
    pub now: String,
    /// What was done and why.
    pub decision: String,
}

impl Idempotency {
    /// The same state, with a provider its handlers call ([`super::Tx::call`]).
    pub fn outside(mut self, outside: Outside) -> Self {
        self.outside = Some(Arc::new(outside));
        self
    }

    /// How the calls behind this state ended, so far.
    pub fn call_counts(&self) -> CallCounts {
        let n = |i: usize| self.outside.as_ref().map_or(0, |o| o.counters[i].load(Ordering::Relaxed));
        CallCounts {
            sent: n(SENT),
            paid: n(PAID),
            refused: n(REFUSED),
            unknown: n(UNKNOWN),
            for_a_person: n(FOR_A_PERSON),
        }
    }

    /// Reads calls by `filter` (a `WHERE` on the calls table) with `vals`.
    async fn calls_where(&self, filter: &str, vals: &[Val]) -> Result<Vec<CallRow>, StoreError> {
        let mut held = begun(self).await?;
        let sql = Sql::new(format!("SELECT {COLUMNS} FROM {} WHERE {filter}", self.keys.calls()));
        let rows = held.query(&sql, vals, &INTS).await;
        held.rollback().await;
        Ok(rows?.into_iter().map(CallRow::read).collect())
    }

    /// The calls not settled: in flight, unknown, or waiting for a person
    /// (`needs_attention`), oldest first.
    pub async fn open_calls(&self) -> Result<Vec<CallRow>, BoxError> {
        Ok(self.calls_where("state NOT IN ('completed', 'failed') ORDER BY id", &[]).await?)
    }

    /// A person's settlement of call `id` (one whose state is `unknown` or
    /// `needs_attention`), after looking at the provider: `outcome` is
    /// recorded as a provider's answer would be, with the team's `settle`
    /// writes and the key's final answer. Whether it was settled now.
    pub async fn settle_by_hand(&self, id: i64, outcome: Outcome) -> Result<bool, BoxError> {
        let outside = self.outside.as_ref().ok_or("the layer has no Outside")?;
        let filter = "id = $1 AND state IN ('unknown', 'needs_attention')";
        let Some(row) = self.calls_where(filter, &[Val::I(id)]).await?.pop() else { return Ok(false) };
        let call = match outcome {
            Outcome::Paid(paid) => Call::Paid(paid),
            Outcome::Refused { status, reason } => Call::Refused { status, reason },
        };
        Ok(matches!(record(self, outside, id, &row.holder, call, now_ms()).await?, Recorded::Settled(..)))
    }

    /// One pass of the recovery job: every call left in flight past its
    /// lease (its request died, or its result was not stored) and every
    /// unknown one whose wait is over is taken (a compare-and-set on its
    /// holder: two jobs never work on one call), its provider asked by the
    /// downstream key, and what it says recorded by
    /// [`crate::provider::judge`]: paid or refused settles the key;
    /// pending or no answer looks again after a capped, jittered, doubling
    /// wait; not found resends with the same key within the limits; the
    /// rest goes to a person. Up to 100 calls a pass.
    pub async fn recover(&self) -> Result<Vec<Recovered>, BoxError> {
        let outside = self.outside.as_ref().ok_or("the layer has no Outside")?;
        let me = format!("recovery:{}", Keys::token::<()>().map_err(|_| "no randomness for a token")?);
        let filter =
            "state IN ('in_progress', 'unknown') AND lease_until <= $1 ORDER BY lease_until LIMIT 100";
        let mut decisions = Vec::new();
        for seen in self.calls_where(filter, &[Val::I(now_ms())]).await? {
            if let Some(done) = self.recover_one(outside, &me, seen).await? {
                decisions.push(done);
            }
        }
        Ok(decisions)
    }

    /// Takes `seen` for `me` and sets `change` (more `SET` clauses) with it;
    /// whether it was taken.
    async fn take(
        &self,
        outside: &Outside,
        me: &str,
        seen: &CallRow,
        change: &str,
    ) -> Result<bool, StoreError> {
        let mut held = begun(self).await?;
        let (at, t) = (now_ms(), self.keys.calls());
        let sql = Sql::new(format!(
            "UPDATE {t} SET holder = $2, lease_until = $3, updated_at = $4{change}
             WHERE id = $1 AND holder = $5 AND state = $6 AND (lease_until <= $4 OR holder = $2)"
        ));
        let vals = [
            Val::I(seen.intent.id),
            Val::T(me.into()),
            Val::I(at.saturating_add(ms(outside.lease()))),
            Val::I(at),
            Val::T(seen.holder.clone()),
            Val::T(seen.state.clone()),
        ];
        if held.exec(&sql, &vals).await? != 1 {
            // given back whole: a connection dropped mid-transaction is closed, not pooled
            held.rollback().await;
            return Ok(false);
        }
        Ok(held.commit().await)
    }

    async fn recover_one(
        &self,
        outside: &Outside,
        me: &str,
        seen: CallRow,
    ) -> Result<Option<Recovered>, StoreError> {
        if !self.take(outside, me, &seen, ", attempts = attempts + 1").await? {
            return Ok(None); // another job has it, or it moved on
        }
        let p = &seen.intent;
        let lookup =
            bounded(outside, outside.provider.lookup(p), || Lookup::Error("no answer in time".into())).await;
        let age = now_ms().saturating_sub(seen.created_at);
        let older_than = |d: Duration| age >= ms(d);
        let (call, decision) = match judge(lookup, older_than, p.sends, &outside.limits, outside.lease()) {
            Next::Record(call, why) => (call, why),
            Next::Resend => {
                // counted before it is sent: a send is never lost from the count
                let mine = CallRow { holder: me.to_owned(), ..seen.clone() };
                if !self.take(outside, me, &mine, ", sends = sends + 1").await? {
                    return Ok(None);
                }
                outside.count(SENT);
                let again = Intent { sends: p.sends, ..p.clone() };
                resent(
                    bounded(outside, outside.provider.send(&again), || Call::Unknown("no answer".into()))
                        .await,
                )
            }
        };
        let wait = outside.limits.wait(seen.attempts.saturating_add(1), seed(&p.downstream_key));
        let next_look = now_ms().saturating_add(ms(wait));
        let (now, decision) = match record(self, outside, p.id, me, call, next_look).await {
            Ok(Recorded::Settled(_, state) | Recorded::Left(state)) => (state, decision),
            Ok(Recorded::Taken) => (seen.state.as_str(), decision),
            // availability is the pass's problem, not this call's: stop
            Err(e @ (StoreError::Busy | StoreError::Unavailable(_))) => return Err(e),
            Err(e) => {
                // set aside for a person, with why: one call must not stop the others
                let aside = Call::Terminal(format!("its result could not be stored: {e}"));
                let decision = format!("{decision}; its result could not be stored ({e}): set aside");
                match record(self, outside, p.id, me, aside, now_ms()).await? {
                    Recorded::Left(state) => (state, decision),
                    _ => (seen.state.as_str(), decision),
                }
            }
        };
        Ok(Some(Recovered {
            id: p.id,
            downstream_key: p.downstream_key.clone(),
            was: seen.state.clone(),
            now: now.to_owned(),
            decision,
        }))
    }

    /// Runs [`Idempotency::recover`] on a schedule, as a task of the
    /// service's runtime (abort the handle, or let the runtime end, to stop
    /// it): every `every`, passes until none is due. A failure is logged
    /// (`tracing`, target `idem`) and the next round tries again.
    pub fn recover_every(&self, every: Duration) -> tokio::task::JoinHandle<()> {
        let idem = self.clone();
        tokio::spawn(async move {
            loop {
                match idem.recover().await {
                    Ok(done) if done.len() >= 100 => continue,
                    Ok(done) => {
                        for d in done {
                            tracing::info!(target: "idem", call = d.id, was = %d.was, now = %d.now, decision = %d.decision, "recovery");
                        }
                    }
                    Err(e) => {
                        tracing::warn!(target: "idem", error = %e, "the recovery pass failed; the next tries again")
                    }
                }
                tokio::time::sleep(every).await;
            }
        })
    }
}
