//! Where the protocol runs for the service.
//!
//! On SQLite, one writer thread owns the write connection and folds the
//! transfers waiting in its queue into one group commit (a savepoint per
//! request, one fsync for the group), answering each only after that commit
//! returned. On PostgreSQL, a transfer runs in a task of its own on the
//! service's runtime, on a connection of the async pool, or, with
//! `--pg-batch-max` above 1, its claim and its execution go out in batches
//! with those of the transfers beside it (`store::pg_pool::batch`, one
//! statement for many claims, one for many executions): no thread waits
//! on a socket and none is handed the request.
//! On both, reader threads with connections of their own answer lookups
//! and health probes from plain reads, on a queue of their own, and settled
//! keys (replays, 422s) when the writers are busy: a read never waits
//! behind an execution's lock wait or a group commit. On SQLite a settled
//! key is read first on the thread that asks, by a reader that never waits
//! for a lock ([`Executor::settled_at_once`]); only a read that would wait
//! goes to a reader thread. On PostgreSQL,
//! writer threads with connections of their own run the payout steps.
//!
//! A transfer, once queued or spawned, runs to completion whatever happens
//! to the HTTP connection that asked for it: a client that hangs up
//! mid-request never strands a claim. A full queue is refused at once
//! (503, `busy`); so is a pool with no connection free within the busy
//! budget.

use super::health::Health;
use crate::clock::Timestamp;
use crate::policy::Policy;
use crate::protocol::Steps;
use crate::protocol::{self, Ctx, Flow, Outcome, Response};
use crate::reason::Reason;
use crate::request::{Request, ScopedKey};
use crate::store::pg_pool::Batcher;
use crate::store::{GroupWriter, Pool, Reads, Store, StoreError, Workers};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;
use tokio::sync::oneshot;

/// What a worker can be asked to do.
pub enum Job {
    Transfer {
        req: Request,
        reply: TransferReply,
    },
    /// Answer the request if its key is settled (`protocol::settled`).
    Settled {
        req: Request,
        reply: oneshot::Sender<Result<Option<Response>, StoreError>>,
    },
    Lookup {
        client_id: String,
        transfer_id: i64,
        reply: oneshot::Sender<Result<Option<String>, StoreError>>,
    },
    Ping {
        reply: oneshot::Sender<Result<(), StoreError>>,
    },
    /// Any other work on a writer's connection, outside a group commit
    /// (the payout steps); it sends its own reply.
    Run(Work),
}

/// Work for a writer's connection; it sends its own reply.
pub type Work = Box<dyn FnOnce(&mut dyn Store) + Send>;

/// The two moments of a group commit a hook can see: just before the
/// group's commit, and just after it (before any answer is handed back).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupPoint {
    BeforeCommit,
    AfterCommit,
}

/// Called by the SQLite writer at each [`GroupPoint`]. The service runs
/// with none; a test passes one that stops the writer there, to prove that
/// no answer leaves before its group's commit returned.
pub type GroupHook = Arc<dyn Fn(GroupPoint) + Send + Sync>;

/// PostgreSQL's batches so far: claims' then executions', each `[batches,
/// requests carried, microseconds out]`; and the pool connections that
/// found a batch function not idem's at its name (never called).
pub struct Batches {
    pub sizes: [[u64; 3]; 2],
    pub refused: u64,
}

pub struct Executor {
    /// PostgreSQL: where transfers run, and what they need around them.
    pool: Option<OnPool>,
    writes: Mutex<Option<SyncSender<Job>>>,
    reads: Mutex<Option<SyncSender<Job>>>,
    workers: Mutex<Vec<JoinHandle<()>>>,
    /// SQLite's readers that never wait, for [`Executor::settled_at_once`].
    at_once: Mutex<Vec<Box<dyn Reads + Send>>>,
    policy: &'static Policy,
    clock: Clock,
}

/// The service's clock, given by its caller (the binary: the wall clock, or
/// `IDEM_NOW` when set, for tests).
pub type Clock = Arc<dyn Fn() -> Timestamp + Send + Sync>;

/// One job queue shared by the workers that serve it.
type Queue = Arc<Mutex<Receiver<Job>>>;

fn queue(capacity: usize) -> (SyncSender<Job>, Queue) {
    let (tx, rx) = sync_channel(capacity);
    (tx, Arc::new(Mutex::new(rx)))
}

fn spawn(name: String, work: impl FnOnce() + Send + 'static) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new().name(name).spawn(work)
}

impl Executor {
    /// Starts the workers for `stores`, with queues of `capacity` jobs; a
    /// group commit carries at most `group_max` transfers.
    pub fn start(
        stores: Workers,
        capacity: usize,
        group_max: usize,
        policy: &'static Policy,
        clock: Clock,
        health: Arc<Health>,
        hook: Option<GroupHook>,
    ) -> std::io::Result<Self> {
        let (writes, write_jobs) = queue(capacity);
        let (reads, read_jobs) = queue(capacity);
        let (mut on_pool, mut at_once_readers) = (None, Vec::new());
        let mut workers = Vec::new();
        let readers = match stores {
            Workers::Grouped { writer, readers, at_once } => {
                at_once_readers = at_once;
                let (clock, health) = (clock.clone(), health.clone());
                workers.push(spawn("idem-writer".into(), move || {
                    write_in_groups(writer, &write_jobs, group_max.max(1), policy, &clock, &health, hook)
                })?);
                readers
            }
            Workers::Pooled { pool, unbatched, writers, readers } => {
                for (i, store) in writers.into_iter().enumerate() {
                    let (jobs, clock, health) = (write_jobs.clone(), clock.clone(), health.clone());
                    workers.push(spawn(format!("idem-store-{i}"), move || {
                        one_at_a_time(store, &jobs, policy, &clock, &health)
                    })?);
                }
                let batches =
                    (group_max > 1 && unbatched.is_none()).then(|| Arc::new(std::sync::OnceLock::new()));
                on_pool = Some(OnPool {
                    pool,
                    batches,
                    batch_max: group_max,
                    policy,
                    clock: clock.clone(),
                    health: health.clone(),
                    orphans: Arc::default(),
                    running: Arc::default(),
                });
                readers
            }
        };
        for (i, reader) in readers.into_iter().enumerate() {
            let (jobs, clock, health) = (read_jobs.clone(), clock.clone(), health.clone());
            workers.push(spawn(format!("idem-reader-{i}"), move || {
                one_at_a_time(reader, &jobs, policy, &clock, &health)
            })?);
        }
        Ok(Executor {
            pool: on_pool,
            writes: Mutex::new(Some(writes)),
            reads: Mutex::new(Some(reads)),
            workers: Mutex::new(workers),
            at_once: Mutex::new(at_once_readers),
            policy,
            clock,
        })
    }

    /// What [`Job::Settled`] answers, read on the calling thread with no
    /// hand-off to a reader thread and back (two wake-ups, most of a
    /// replay's cost), by a SQLite reader that never waits for a lock.
    /// `None` when none is free (all in use, or on PostgreSQL) or the read
    /// would have waited: then a reader thread answers, as it may wait.
    pub fn settled_at_once(&self, req: &Request) -> Option<Result<Option<Response>, StoreError>> {
        let mut reader = self.at_once.lock().unwrap_or_else(|e| e.into_inner()).pop()?;
        let ctx = Ctx { policy: self.policy, now: (self.clock)(), token: "" };
        let settled = protocol::settled(&mut reader, req, ctx);
        self.at_once.lock().unwrap_or_else(|e| e.into_inner()).push(reader);
        match settled {
            Err(StoreError::Busy) => None,
            answered => Some(answered),
        }
    }

    /// Whether a transfer's key should first be looked up by a reader
    /// ([`Job::Settled`]), so that a replay does not queue behind the
    /// writers: always on SQLite (its one writer runs group commits). On
    /// PostgreSQL the claim is one statement that answers a settled key in
    /// the same one round trip, so a look-up first would only add one to
    /// every new transfer, unless no connection of the pool is free (all in
    /// executions, perhaps in lock waits on a hot account): then a reader
    /// answers a replay at once.
    pub fn settles_first(&self) -> bool {
        self.pool.as_ref().is_none_or(|on| on.pool.saturated())
    }

    /// With batching on PostgreSQL: the batches sent so far.
    pub fn batches(&self) -> Option<Batches> {
        let batcher = self.pool.as_ref()?.batches.as_ref()?.get()?;
        let sizes = batcher.sizes().each_ref().map(|s| {
            [&s.batches, &s.carried, &s.micros].map(|n| n.load(std::sync::atomic::Ordering::Relaxed))
        });
        Some(Batches { sizes, refused: batcher.refused() })
    }

    /// Whether transfers run on a pool ([`Executor::transfer_on_pool`], on
    /// PostgreSQL) rather than as [`Job::Transfer`]s (SQLite's writer).
    pub fn runs_on_pool(&self) -> bool {
        self.pool.is_some()
    }

    /// Runs a transfer on PostgreSQL's pool, in a task of its own, so that
    /// it runs to completion even if the connection that asked goes away.
    pub async fn transfer_on_pool(&self, req: Request) -> Result<Outcome, StoreError> {
        let Some(on) = self.pool.clone() else {
            return Err(StoreError::Backend("no connection pool: transfers run as jobs".into()));
        };
        on.running.fetch_add(1, Ordering::Relaxed);
        let task = tokio::spawn(async move {
            let outcome = on.transfer(&req).await;
            report(&on.health, &outcome);
            on.running.fetch_sub(1, Ordering::Relaxed);
            outcome
        });
        task.await.unwrap_or_else(|_| Err(StoreError::Backend("a transfer's task failed".into())))
    }

    /// Queues a transfer for the writer (or the pool); `false` when full or shut.
    pub fn submit(&self, job: Job) -> bool {
        send(&self.writes, job)
    }

    /// Queues a read for the readers; `false` when full or shut.
    pub fn submit_read(&self, job: Job) -> bool {
        send(&self.reads, job)
    }

    /// Stops taking jobs and waits for every queued one, and every transfer
    /// running on the pool, to finish.
    pub fn drain(&self) {
        if let Some(on) = &self.pool {
            while on.running.load(Ordering::Relaxed) > 0 {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        self.writes.lock().unwrap_or_else(|e| e.into_inner()).take();
        self.reads.lock().unwrap_or_else(|e| e.into_inner()).take();
        let workers = std::mem::take(&mut *self.workers.lock().unwrap_or_else(|e| e.into_inner()));
        for worker in workers {
            let _ = worker.join();
        }
    }
}

fn send(queue: &Mutex<Option<SyncSender<Job>>>, job: Job) -> bool {
    let queue = queue.lock().unwrap_or_else(|e| e.into_inner());
    let Some(queue) = queue.as_ref() else { return false };
    match queue.try_send(job) {
        Ok(()) => true,
        Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => false,
    }
}

/// The next job, waiting for one; `None` when the queue is shut and empty.
fn next(jobs: &Mutex<Receiver<Job>>) -> Option<Job> {
    // the lock is held only while waiting for the next job
    jobs.lock().unwrap_or_else(|e| e.into_inner()).recv().ok()
}

fn transfer<S: Store>(
    store: &mut S,
    req: &Request,
    policy: &Policy,
    clock: &Clock,
) -> Result<Outcome, StoreError> {
    let token = protocol::fresh_token()
        .map_err(|e| StoreError::Backend(format!("no randomness for a claim token: {e}").into()))?;
    protocol::handle(store, req, Ctx { policy, now: clock(), token: &token }, &mut |_| Flow::Continue)
}

/// Whether the request answered 503 for the database: gone (a failover, a
/// restart) or a statement past its timeout (a lock wait, or a primary
/// paused under it: its commits may have reached a standby).
fn unanswered_by_the_database(outcome: &Result<Outcome, StoreError>) -> bool {
    matches!(outcome, Ok(Outcome::Respond(r)) if matches!(r.reason, Some(Reason::Unavailable | Reason::Busy)))
}

/// Claims left behind by requests that answered 503 because the database
/// went away or stopped answering (a failover, a restart, a primary paused
/// past a statement's timeout): the protocol's own release ran while it
/// was still away, or on the old primary, whose timeline is then
/// discarded. Each is released before the next transfer on the pool runs,
/// so its key does not wait out the whole lease (minutes) for an attempt
/// that is over. Safe whatever happened meanwhile: a release only
/// deletes a key still `in_progress` under this attempt's token, so a
/// claim that never reached the new primary, or an execution that did
/// commit, is left as it is.
#[derive(Default)]
struct Orphans(std::collections::VecDeque<(ScopedKey, String)>);

impl Orphans {
    /// How many are kept; past it the oldest wait for their lease.
    const MAX: usize = 4096;

    fn add(&mut self, key: ScopedKey, token: String) {
        if self.0.len() == Self::MAX {
            self.0.pop_front();
        }
        self.0.push_back((key, token));
    }
}

/// What a transfer on PostgreSQL's pool runs with.
#[derive(Clone)]
struct OnPool {
    pool: Pool,
    /// With batching on (`--pg-batch-max` above 1): the batcher, started on
    /// the service's runtime by the first transfer.
    batches: Option<Arc<std::sync::OnceLock<Batcher>>>,
    batch_max: usize,
    policy: &'static Policy,
    clock: Clock,
    health: Arc<Health>,
    /// Claims left by requests answered 503 `unavailable` or `busy` (see [`Orphans`]):
    /// released before the next transfer runs.
    orphans: Arc<Mutex<Orphans>>,
    /// Transfers running, for [`Executor::drain`].
    running: Arc<AtomicUsize>,
}

impl OnPool {
    async fn transfer(&self, req: &Request) -> Result<Outcome, StoreError> {
        if let Some(batches) = &self.batches {
            let batcher = batches.get_or_init(|| {
                // Two lanes of each kind: one sends while the other's batch is
                // out. More made smaller batches that wait on each other's
                // account locks: at 1 ms, 64 clients, 100 accounts, 4 lanes
                // gave 0.87x the one-call limit, 2 lanes 0.99x, 1 lane 0.83x
                // (benches/network.rs). A lane holds a connection only while
                // its batch is out.
                let lanes = (self.pool.max_size() / 4).clamp(1, 2);
                Batcher::start(self.pool.clone(), lanes, self.batch_max)
            });
            return self.run(&mut batcher.steps(), req).await;
        }
        let mut conn = match self.pool.get().await {
            Ok(conn) => conn,
            Err(e) => return protocol::unless_busy(Err(e), self.policy),
        };
        self.run(&mut *conn, req).await
    }

    async fn run(&self, steps: &mut impl Steps, req: &Request) -> Result<Outcome, StoreError> {
        self.release_orphans(steps).await;
        let token = protocol::fresh_token()
            .map_err(|e| StoreError::Backend(format!("no randomness for a claim token: {e}").into()))?;
        let ctx = Ctx { policy: self.policy, now: (self.clock)(), token: &token };
        let outcome = protocol::handle_steps(steps, req, ctx, &mut |_| Flow::Continue).await;
        if unanswered_by_the_database(&outcome) {
            self.orphans.lock().unwrap_or_else(|e| e.into_inner()).add(req.key.clone(), token);
        }
        outcome
    }

    /// Releases the claims of [`OnPool::orphans`] while the database takes it.
    async fn release_orphans(&self, conn: &mut impl Steps) {
        loop {
            let next = self.orphans.lock().unwrap_or_else(|e| e.into_inner()).0.pop_front();
            let Some((key, token)) = next else { return };
            if let Err(StoreError::Unavailable(_) | StoreError::Busy) = conn.release(&key, &token).await {
                // still away: later
                self.orphans.lock().unwrap_or_else(|e| e.into_inner()).0.push_front((key, token));
                return;
            }
        }
    }
}

/// Tells `health` what a write's outcome says of the database.
fn report(health: &Health, outcome: &Result<Outcome, StoreError>) {
    match outcome {
        Ok(Outcome::Respond(r)) if r.reason == Some(Reason::Unavailable) => {
            health.write_failed("the database could not take a write".into())
        }
        Err(StoreError::Unavailable(why)) => health.write_failed(why.clone()),
        Ok(_) => health.write_ok(),
        Err(_) => {}
    }
}

type TransferReply = oneshot::Sender<Result<Outcome, StoreError>>;

/// Answers `job` on the spot if it is a read or other work; a transfer is
/// handed back. A client that has gone does not take its answer: the work
/// is done anyway.
fn read_or_transfer<S: Reads>(
    store: &mut S,
    job: Job,
    policy: &Policy,
    clock: &Clock,
) -> Option<(Request, TransferReply)> {
    match job {
        Job::Transfer { req, reply } => return Some((req, reply)),
        Job::Run(work) => work(store),
        Job::Settled { req, reply } => {
            drop(reply.send(protocol::settled(store, &req, Ctx { policy, now: clock(), token: "" })))
        }
        Job::Lookup { client_id, transfer_id, reply } => {
            drop(reply.send(store.transfer_for(&client_id, transfer_id)))
        }
        Job::Ping { reply } => drop(reply.send(store.ping())),
    }
    None
}

/// A worker that runs each job on its own (PostgreSQL's payout writers, and
/// readers). Transfers go to SQLite's writer or PostgreSQL's pool; one
/// queued here anyway is run, not dropped.
fn one_at_a_time<S: Reads + ?Sized>(
    mut store: Box<S>,
    jobs: &Mutex<Receiver<Job>>,
    policy: &Policy,
    clock: &Clock,
    health: &Health,
) {
    while let Some(job) = next(jobs) {
        if let Some((req, reply)) = read_or_transfer(&mut store, job, policy, clock) {
            let outcome = transfer(&mut store, &req, policy, clock);
            report(health, &outcome);
            drop(reply.send(outcome));
        }
    }
}

/// The SQLite writer: takes every transfer waiting (up to `group_max`),
/// runs them in one group, commits once, then answers them all.
///
/// Why no answer leaves early: the answers are only handed back after
/// `Group::commit` returned, and that commit is `synchronous=FULL` in WAL,
/// so it returns once every request of the group is on disk. If the commit
/// fails, the group rolls back, nothing of it happened, and every request of
/// it is told so (503, retry). A crash before the commit loses the group and
/// answers nothing; a crash after it answers nothing, and every retry
/// replays. `tests/service/group_commit.rs` stops the writer at both points.
fn write_in_groups(
    mut store: Box<dyn GroupWriter>,
    jobs: &Mutex<Receiver<Job>>,
    group_max: usize,
    policy: &Policy,
    clock: &Clock,
    health: &Health,
    hook: Option<GroupHook>,
) {
    let at = |point| {
        if let Some(hook) = &hook {
            hook(point)
        }
    };
    while let Some(first) = next(jobs) {
        let mut group = vec![first];
        {
            let queue = jobs.lock().unwrap_or_else(|e| e.into_inner());
            while group.len() < group_max {
                match queue.try_recv() {
                    Ok(job) => group.push(job),
                    Err(_) => break,
                }
            }
        }
        // transfers join the group; anything else on the writer's queue (a
        // payout's step, a read) is run on the spot, outside it
        let transfers: Vec<_> =
            group.into_iter().filter_map(|job| read_or_transfer(&mut store, job, policy, clock)).collect();
        if transfers.is_empty() {
            continue;
        }
        let committed = store.group().and_then(|mut group| {
            let outcomes: Vec<_> =
                transfers.iter().map(|(req, _)| transfer(&mut group, req, policy, clock)).collect();
            at(GroupPoint::BeforeCommit);
            group.commit().map(|()| outcomes)
        });
        at(GroupPoint::AfterCommit);
        match committed {
            Ok(outcomes) => {
                for ((_, reply), outcome) in transfers.into_iter().zip(outcomes) {
                    report(health, &outcome);
                    drop(reply.send(outcome));
                }
            }
            Err(e) => {
                let outcome = protocol::unless_busy(Err(e), policy);
                report(health, &outcome);
                for (_, reply) in transfers {
                    drop(reply.send(outcome.clone()));
                }
            }
        }
    }
}
