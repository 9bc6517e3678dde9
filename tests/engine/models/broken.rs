//! Deliberately broken engines: each a classic mistake of this lab, written
//! as an engine of its own and driven through the same seam
//! ([`protocol::Engine`]) as the real one, so the production protocol carries
//! no switch for them. `tests/engine/teeth.rs` demands that the scenarios, the storm
//! or the loom model catch every one.

use idem::clock::Timestamp;
use idem::policy::Policy;
use idem::protocol::{self, Claimed, Ctx, Engine, Flow, Outcome, Point, Response};
use idem::request::{self, AcctId, Request, RequestError, ScopedKey};
use idem::store::{
    self, Account, Audit, Claim, Durability, End, KeyRecord, NewTransfer, PayoutTx, Store, StoreError,
    Stored, Tx,
};
use sha2::{Digest, Sha256};

/// The mistakes, as the lab names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mistake {
    /// Look the key up, then insert it later: racers both pass.
    LookupThenInsert,
    /// Write the key as completed before the money moves.
    CompletedBeforeExecute,
    /// Fingerprint the raw request text, not its canonical form.
    RawFingerprint,
    /// Rebuild the replayed body instead of returning the stored bytes.
    RecomputedReplay,
    /// Key by `idem_key` alone, not `(client_id, endpoint, idem_key)`.
    GlobalScope,
    /// Purge every key, whatever the cut.
    PurgeIgnoresCut,
    /// Lock the accounts in the request's order (source first), not in one
    /// fixed order: A→B racing B→A deadlocks where writers run side by side.
    AccountsInRequestOrder,
}

impl Mistake {
    pub const ALL: [Mistake; 7] = [
        Mistake::LookupThenInsert,
        Mistake::CompletedBeforeExecute,
        Mistake::RawFingerprint,
        Mistake::RecomputedReplay,
        Mistake::GlobalScope,
        Mistake::PurgeIgnoresCut,
        Mistake::AccountsInRequestOrder,
    ];
}

/// The real protocol over `store`, but for one `mistake`.
pub struct Broken<S> {
    pub store: S,
    pub mistake: Mistake,
}

impl<S: Store> Broken<S> {
    /// Writes a claim of `ctx.token` over whatever the key holds: no fence.
    fn overwrite_claim(&mut self, req: &Request, ctx: Ctx) -> Result<(), StoreError> {
        let claim = Claim {
            fingerprint: req.fingerprint.clone(),
            token: ctx.token.to_owned(),
            created_at: ctx.now,
            lease_until: ctx.now,
        };
        store::atomically(&mut self.store, Durability::Lazy, ctx.policy, |tx| {
            if let Some(seen) = tx.insert_claim(&req.key, &claim)? {
                tx.replace_claim(&req.key, &seen, &claim)?;
            }
            Ok(End::Commit(()))
        })
    }
}

impl<S: Store> Engine for Broken<S> {
    /// The protocol's order (claim, execute if ours, release if the
    /// execution failed), on this engine's own steps.
    fn handle(
        &mut self,
        req: &Request,
        ctx: Ctx,
        faults: &mut dyn FnMut(Point) -> Flow,
    ) -> Result<Outcome, StoreError> {
        let outcome = match self.claim(req, ctx) {
            Ok(Claimed::Answer(response)) => Ok(Outcome::Respond(response)),
            Ok(Claimed::Mine) if faults(Point::AfterClaim) == Flow::Crash => {
                Ok(Outcome::Crashed(Point::AfterClaim))
            }
            Ok(Claimed::Mine) => self.execute(req, ctx, faults).inspect_err(|_| drop(self.release(req, ctx))),
            Err(e) => Err(e),
        };
        protocol::unless_busy(outcome, ctx.policy)
    }

    fn parse(&self, raw: &[u8], policy: &Policy) -> Result<Request, RequestError> {
        let mut req = request::parse(raw, policy)?;
        match self.mistake {
            Mistake::RawFingerprint => {
                req.fingerprint = Sha256::digest(raw).iter().map(|b| format!("{b:02x}")).collect()
            }
            Mistake::GlobalScope => (req.key.client_id, req.key.endpoint) = (String::new(), String::new()),
            _ => {}
        }
        Ok(req)
    }

    fn claim(&mut self, req: &Request, ctx: Ctx) -> Result<Claimed, StoreError> {
        match self.mistake {
            Mistake::LookupThenInsert => {
                let existing = store::atomically(&mut self.store, Durability::Lazy, ctx.policy, |tx| {
                    tx.lock_key(&req.key).map(End::Rollback)
                })?;
                Ok(match existing {
                    // the insert comes later, with the money
                    None => Claimed::Mine,
                    Some(rec) => Claimed::Answer(protocol::answer(
                        protocol::decide(&rec, &req.fingerprint, ctx.now, ctx.policy),
                        ctx.policy,
                    )),
                })
            }
            Mistake::CompletedBeforeExecute => {
                let claimed = protocol::claim(&mut self.store, req, ctx)?;
                if claimed == Claimed::Mine {
                    let done = Stored { status: 201, reason: None, body: "{}".into(), transfer_id: None };
                    store::atomically(&mut self.store, Durability::Lazy, ctx.policy, |tx| {
                        tx.complete(&req.key, ctx.token, &done, ctx.now).map(End::Commit)
                    })?;
                }
                Ok(claimed)
            }
            Mistake::RecomputedReplay => Ok(match protocol::claim(&mut self.store, req, ctx)? {
                Claimed::Answer(r) if r.replay => {
                    let rebuilt = serde_json::from_str::<serde_json::Value>(&r.body).map(|v| v.to_string());
                    Claimed::Answer(Response { body: rebuilt.unwrap_or(r.body), ..r })
                }
                other => other,
            }),
            _ => protocol::claim(&mut self.store, req, ctx),
        }
    }

    fn execute(
        &mut self,
        req: &Request,
        ctx: Ctx,
        faults: &mut dyn FnMut(Point) -> Flow,
    ) -> Result<Outcome, StoreError> {
        if matches!(self.mistake, Mistake::LookupThenInsert | Mistake::CompletedBeforeExecute) {
            self.overwrite_claim(req, ctx)?;
        }
        if self.mistake == Mistake::AccountsInRequestOrder {
            let src = req.transfer.src.clone();
            return protocol::execute(&mut SourceFirst { store: &mut self.store, src }, req, ctx, faults);
        }
        protocol::execute(&mut self.store, req, ctx, faults)
    }

    fn release(&mut self, req: &Request, ctx: Ctx) -> Result<bool, StoreError> {
        protocol::release(&mut self.store, &req.key, ctx)
    }

    fn purge(&mut self, before: Timestamp, policy: &Policy) -> Result<u64, StoreError> {
        let before = match self.mistake {
            Mistake::PurgeIgnoresCut => Timestamp::parse("9999-12-31T23:59:59Z").unwrap_or(before),
            _ => before,
        };
        protocol::purge(&mut self.store, before, policy)
    }

    fn audit(&mut self) -> Result<Audit, StoreError> {
        self.store.audit()
    }
}

/// A store whose transactions lock the account `src` before any other.
struct SourceFirst<'a, S> {
    store: &'a mut S,
    src: AcctId,
}

struct SourceFirstTx<'a> {
    inner: Box<dyn Tx + 'a>,
    src: AcctId,
}

impl<S: Store> Store for SourceFirst<'_, S> {
    fn begin(&mut self, durability: Durability) -> Result<Box<dyn Tx + '_>, StoreError> {
        Ok(Box::new(SourceFirstTx { inner: self.store.begin(durability)?, src: self.src.clone() }))
    }
    fn audit(&mut self) -> Result<Audit, StoreError> {
        self.store.audit()
    }
}

impl PayoutTx for SourceFirstTx<'_> {}

impl Tx for SourceFirstTx<'_> {
    fn insert_claim(&mut self, key: &ScopedKey, claim: &Claim) -> Result<Option<KeyRecord>, StoreError> {
        self.inner.insert_claim(key, claim)
    }
    fn replace_claim(
        &mut self,
        key: &ScopedKey,
        seen: &KeyRecord,
        claim: &Claim,
    ) -> Result<bool, StoreError> {
        self.inner.replace_claim(key, seen, claim)
    }
    fn lock_key(&mut self, key: &ScopedKey) -> Result<Option<KeyRecord>, StoreError> {
        self.inner.lock_key(key)
    }
    fn complete(
        &mut self,
        key: &ScopedKey,
        token: &str,
        response: &Stored,
        at: Timestamp,
    ) -> Result<bool, StoreError> {
        self.inner.complete(key, token, response, at)
    }
    fn release(&mut self, key: &ScopedKey, token: &str) -> Result<bool, StoreError> {
        self.inner.release(key, token)
    }
    fn lock_account(&mut self, id: &AcctId) -> Result<Option<Account>, StoreError> {
        self.inner.lock_account(&self.src)?;
        self.inner.lock_account(id)
    }
    fn add_to_balance(&mut self, id: &AcctId, delta: i64) -> Result<i64, StoreError> {
        self.inner.add_to_balance(id, delta)
    }
    fn insert_transfer(&mut self, t: &NewTransfer) -> Result<i64, StoreError> {
        self.inner.insert_transfer(t)
    }
    fn purge(&mut self, before: Timestamp, limit: u64) -> Result<u64, StoreError> {
        self.inner.purge(before, limit)
    }
    fn in_progress(&mut self) -> Result<Vec<(ScopedKey, KeyRecord)>, StoreError> {
        self.inner.in_progress()
    }
    fn commit(self: Box<Self>) -> Result<(), StoreError> {
        self.inner.commit()
    }
}
