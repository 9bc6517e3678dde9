//! The service's conductor as an [`Engine`]: a request run by
//! `protocol::handle_steps` (its claim and execution alone, for the staged
//! races, by `protocol::claim_as` and `protocol::execute_steps`) on a
//! connection of the service's async pool (`store::pg_pool`), each
//! step awaited on a runtime of its own, so the storm's random days judge
//! the conductor `idem serve` runs on PostgreSQL, crash points included.
//! Release, purge and the audit run on the synchronous store beside it.
//! [`Awaited::batched`] sends the claims and executions in batches, as
//! `idem serve` does with `--pg-batch-max` above 1 (a day's requests come one
//! at a time, so each batch carries one: this judges the batch's SQL).

use idem::clock::Timestamp;
use idem::policy::Policy;
use idem::protocol::{self, Claimed, Ctx, Engine, Flow, Outcome, Point};
use idem::request::Request;
use idem::store::pg::PgStore;
use idem::store::pg_pool::{Batcher, Manager, Pool};
use idem::store::{Audit, StoreError};

pub struct Awaited {
    runtime: tokio::runtime::Runtime,
    pool: Pool,
    store: PgStore,
    batcher: Option<Batcher>,
}

impl Awaited {
    /// On the PostgreSQL database `spec` (its accounts made already).
    pub fn connect(spec: &str) -> Awaited {
        let policy = Policy::embedded();
        let store = PgStore::connect(spec, policy).unwrap();
        let pool = Manager::new(spec, &store, policy).unwrap().pool(1).unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        Awaited { runtime, pool, store, batcher: None }
    }

    /// The same, its claims and executions sent in batches.
    pub fn batched(spec: &str) -> Awaited {
        let policy = Policy::embedded();
        let store = PgStore::connect(spec, policy).unwrap();
        let pool = Manager::new(spec, &store, policy).unwrap().batching().pool(3).unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        let batcher = Some(runtime.block_on(async { Batcher::start(pool.clone(), 1, 16) }));
        Awaited { runtime, pool, store, batcher }
    }
}

/// Runs `step` on `engine`'s steps: the batcher's, or a pool connection.
macro_rules! on_steps {
    ($engine:expr, |$steps:ident| $step:expr) => {{
        let engine = &mut *$engine;
        engine.runtime.block_on(async {
            match &engine.batcher {
                Some(batcher) => {
                    let $steps = &mut batcher.steps();
                    $step.await
                }
                None => {
                    let mut conn = engine.pool.get().await?;
                    let $steps = &mut *conn;
                    $step.await
                }
            }
        })
    }};
}

impl Engine for Awaited {
    /// `idem serve`'s own conductor on the pool, as it runs a request.
    fn handle(
        &mut self,
        req: &Request,
        ctx: Ctx,
        faults: &mut dyn FnMut(Point) -> Flow,
    ) -> Result<Outcome, StoreError> {
        let handled: Result<Outcome, StoreError> =
            on_steps!(self, |steps| protocol::handle_steps(steps, req, ctx, &mut |p| faults(p)));
        protocol::unless_busy(handled, ctx.policy)
    }

    fn claim(&mut self, req: &Request, ctx: Ctx) -> Result<Claimed, StoreError> {
        let accounts = [&req.transfer.src, &req.transfer.dst];
        let decided = on_steps!(self, |steps| protocol::claim_as(
            steps,
            &req.key,
            &req.fingerprint,
            Some(accounts),
            ctx
        ))?;
        Ok(decided.map_or(Claimed::Mine, |d| Claimed::Answer(protocol::answer(d, ctx.policy))))
    }

    fn execute(
        &mut self,
        req: &Request,
        ctx: Ctx,
        faults: &mut dyn FnMut(Point) -> Flow,
    ) -> Result<Outcome, StoreError> {
        on_steps!(self, |steps| protocol::execute_steps(steps, req, ctx, &mut |p| faults(p)))
    }

    fn release(&mut self, req: &Request, ctx: Ctx) -> Result<bool, StoreError> {
        protocol::release(&mut self.store, &req.key, ctx)
    }

    fn purge(&mut self, before: Timestamp, policy: &Policy) -> Result<u64, StoreError> {
        protocol::purge(&mut self.store, before, policy)
    }

    fn audit(&mut self) -> Result<Audit, StoreError> {
        idem::store::Store::audit(&mut self.store)
    }
}
