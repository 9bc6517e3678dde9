//! The service's conductor as an [`Engine`]: a request run by
//! `protocol::handle_steps` (its claim and execution alone, for the staged
//! races, by `protocol::claim_as` and `protocol::execute_steps`) on a
//! connection of the service's async pool (`store::pg_pool`), each
//! step awaited on a runtime of its own, so the storm's random days judge
//! the conductor `idem serve` runs on PostgreSQL, crash points included.
//! Release, purge and the audit run on the synchronous store beside it.

use idem::clock::Timestamp;
use idem::policy::Policy;
use idem::protocol::{self, Claimed, Ctx, Engine, Flow, Outcome, Point};
use idem::request::Request;
use idem::store::pg::PgStore;
use idem::store::pg_pool::{Manager, Pool};
use idem::store::{Audit, StoreError};

pub struct Awaited {
    runtime: tokio::runtime::Runtime,
    pool: Pool,
    store: PgStore,
}

impl Awaited {
    /// On the PostgreSQL database `spec` (its accounts made already).
    pub fn connect(spec: &str) -> Awaited {
        let policy = Policy::embedded();
        let store = PgStore::connect(spec, policy).unwrap();
        let pool = Manager::new(spec, &store, policy).unwrap().pool(1).unwrap();
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        Awaited { runtime, pool, store }
    }
}

impl Engine for Awaited {
    /// `idem serve`'s own conductor on the pool, as it runs a request.
    fn handle(
        &mut self,
        req: &Request,
        ctx: Ctx,
        faults: &mut dyn FnMut(Point) -> Flow,
    ) -> Result<Outcome, StoreError> {
        self.runtime.block_on(async {
            let mut conn = match self.pool.get().await {
                Ok(conn) => conn,
                Err(e) => return protocol::unless_busy(Err(e), ctx.policy),
            };
            protocol::handle_steps(&mut *conn, req, ctx, &mut |p| faults(p)).await
        })
    }

    fn claim(&mut self, req: &Request, ctx: Ctx) -> Result<Claimed, StoreError> {
        self.runtime.block_on(async {
            let mut conn = self.pool.get().await?;
            let accounts = [&req.transfer.src, &req.transfer.dst];
            let decided =
                protocol::claim_as(&mut *conn, &req.key, &req.fingerprint, Some(accounts), ctx).await?;
            Ok(decided.map_or(Claimed::Mine, |d| Claimed::Answer(protocol::answer(d, ctx.policy))))
        })
    }

    fn execute(
        &mut self,
        req: &Request,
        ctx: Ctx,
        faults: &mut dyn FnMut(Point) -> Flow,
    ) -> Result<Outcome, StoreError> {
        self.runtime.block_on(async {
            let mut conn = self.pool.get().await?;
            protocol::execute_steps(&mut *conn, req, ctx, &mut |p| faults(p)).await
        })
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
