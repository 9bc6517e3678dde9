//! Group commit on PostgreSQL: the claims of requests side by side go out
//! as one statement, and so do their executions (`pg::batch` has the SQL).
//!
//! A request does not hold a connection: its claim and its execution are
//! queued, and a few lanes of each kind take everything queued (up to the
//! batch's bound), send it on a connection of the pool, and hand each
//! request its own row. Nothing waits to fill a batch: a lane sends what is
//! there as soon as it is free, so at low load a batch is one request and
//! costs what the single statement does; under load, requests that arrive
//! while every lane is out form the next batches. The rest of a request
//! (a re-read after a stale premise, a takeover, a release) runs on a
//! connection it takes only then.
//!
//! A batch that the database refused as a whole for a reason of its own
//! (a constraint a team added, an overflow) is sent again one request at a
//! time, so that the one transfer it was about fails alone. A batch that
//! met a conflict, a lock wait past the budget or a lost connection gives
//! each request that error, as its own statement would have.
//! A batch whose function was dropped since its connection was made ran
//! nothing: its requests go out alone, and the connection is replaced.

use super::{PgConn, Pool, Pooled, Route, deadline};
use crate::policy::Policy;
use crate::store::StoreError;
use crate::store::pg::{Ahead, ClaimArgs, ClaimItem, Claims, PlanArgs, PlanItem, Plans, Shape};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use tokio::sync::{Mutex, mpsc, oneshot};
use tokio_postgres::Row;
use tokio_postgres::error::SqlState;

/// What a request gets from its batch.
enum Answer {
    /// Its row.
    Row(Row),
    /// Send it alone (its batch failed for a reason one of them gave).
    Alone,
    Failed(StoreError),
}

struct Job<I> {
    item: I,
    reply: oneshot::Sender<Answer>,
}

type Queue<I> = mpsc::UnboundedSender<Job<I>>;

/// Sends the requests' claims and executions in batches; see the module.
pub struct Batcher {
    claims: Queue<ClaimItem>,
    executions: Queue<PlanItem>,
    pool: Pool,
    shape: Shape,
    policy: &'static Policy,
    sizes: Arc<[Sizes; 2]>,
}

/// Of one kind of batch: how many went out, how many requests they
/// carried, and how long they were out (microseconds, summed over lanes).
#[derive(Default, Debug)]
pub struct Sizes {
    pub batches: AtomicU64,
    pub carried: AtomicU64,
    pub micros: AtomicU64,
}

impl Batcher {
    /// Starts `lanes` lanes of each kind on the current runtime, each
    /// sending at most `max` requests' statements at once, on connections
    /// of `pool` (made with [`super::Manager::batching`]). The lanes end
    /// when the batcher is dropped.
    pub fn start(pool: Pool, lanes: usize, max: usize) -> Batcher {
        let ready = &pool.0.manager().ready;
        let (shape, policy) = (ready.shape.clone(), ready.policy);
        let sizes = Arc::new(<[Sizes; 2]>::default());
        let claims = lanes_of(&pool, lanes, max, &sizes, 0);
        let executions = lanes_of(&pool, lanes, max, &sizes, 1);
        Batcher { claims, executions, pool, shape, policy, sizes }
    }

    /// A request's steps, its statements sent in batches.
    pub fn steps(&self) -> Batched<'_> {
        Batched { batcher: self, conn: None, ahead: None }
    }

    /// The claims' batches, then the executions'.
    pub fn sizes(&self) -> &[Sizes; 2] {
        &self.sizes
    }

    /// Connections that found a batch function not idem's at its name
    /// (their requests go out alone).
    pub fn refused(&self) -> u64 {
        self.pool.0.manager().ready.refused.load(Ordering::Relaxed)
    }
}

/// A kind of statement that goes out in batches.
trait Item: Sized + Send + 'static {
    /// The batch's rows; `None` from a connection without the batch's
    /// statements (`super::batch_sql`), or whose function is gone: its
    /// requests go out alone.
    fn send(
        conn: &mut PgConn,
        items: Vec<Self>,
    ) -> impl Future<Output = Result<Option<Vec<Row>>, StoreError>> + Send;

    /// Whether the batch handed this row's request back to go alone.
    fn alone(_row: &Row) -> bool {
        false
    }
}

impl Item for ClaimItem {
    async fn send(conn: &mut PgConn, items: Vec<Self>) -> Result<Option<Vec<Row>>, StoreError> {
        let Some(sql) = &conn.batch else { return Ok(None) };
        let claims = Claims::of(items);
        deadline(&mut conn.broken, conn.client.query_typed(&sql.claims, &claims.params())).await.map(Some)
    }
}

impl Item for PlanItem {
    async fn send(conn: &mut PgConn, items: Vec<Self>) -> Result<Option<Vec<Row>>, StoreError> {
        let Some(sql) = &conn.batch else { return Ok(None) };
        let plans = Plans::of(items);
        let sent = async {
            match conn.client.query(&sql.executions, &plans.params()).await {
                // The batch's function was dropped under this connection (it
                // ran nothing): its requests go out alone, and the pool
                // replaces it with one that makes the function again.
                Err(e) if e.code() == Some(&SqlState::UNDEFINED_FUNCTION) => Ok(None),
                other => other.map(Some),
            }
        };
        let rows = deadline(&mut conn.broken, sent).await?;
        conn.broken |= rows.is_none();
        Ok(rows)
    }

    /// Its key or an account is locked by another session: it waits for
    /// it alone, holding up no batch-mate.
    fn alone(row: &Row) -> bool {
        row.try_get::<_, bool>(5).unwrap_or(false)
    }
}

/// Spawns `lanes` lanes on one queue, counted in `sizes[kind]`, and
/// returns the queue.
fn lanes_of<I: Item>(
    pool: &Pool,
    lanes: usize,
    max: usize,
    sizes: &Arc<[Sizes; 2]>,
    kind: usize,
) -> Queue<I> {
    let (queue, jobs) = mpsc::unbounded_channel();
    let jobs = Arc::new(Mutex::new(jobs));
    for _ in 0..lanes.max(1) {
        let (jobs, pool, sizes) = (jobs.clone(), pool.clone(), sizes.clone());
        tokio::spawn(lane(jobs, pool, max.max(1), sizes, kind));
    }
    queue
}

/// Takes everything queued (at most `max`), sends it, answers each job;
/// again, until the queue is closed.
async fn lane<I: Item>(
    jobs: Arc<Mutex<mpsc::UnboundedReceiver<Job<I>>>>,
    pool: Pool,
    max: usize,
    sizes: Arc<[Sizes; 2]>,
    kind: usize,
) {
    loop {
        let batch = {
            let mut jobs = jobs.lock().await;
            let Some(first) = jobs.recv().await else { return };
            let mut batch = vec![first];
            while batch.len() < max {
                match jobs.try_recv() {
                    Ok(job) => batch.push(job),
                    Err(_) => break,
                }
            }
            batch
        };
        let (items, replies): (Vec<I>, Vec<_>) = batch.into_iter().map(|j| (j.item, j.reply)).unzip();
        let n = items.len();
        let began = std::time::Instant::now();
        let sent = async {
            let mut conn = pool.get().await?;
            I::send(&mut conn, items).await
        }
        .await;
        let sizes = &sizes[kind];
        sizes.batches.fetch_add(1, Ordering::Relaxed);
        sizes.carried.fetch_add(n as u64, Ordering::Relaxed);
        sizes.micros.fetch_add(began.elapsed().as_micros() as u64, Ordering::Relaxed);
        let answers: Vec<Answer> = match sent {
            Ok(Some(rows)) if rows.len() == n => rows
                .into_iter()
                .map(|row| if I::alone(&row) { Answer::Alone } else { Answer::Row(row) })
                .collect(),
            Ok(None) => (0..n).map(|_| Answer::Alone).collect(),
            Ok(Some(rows)) => {
                let wrong = format!("a batch of {n} answered {} rows", rows.len());
                (0..n).map(|_| Answer::Failed(StoreError::Backend(wrong.clone().into()))).collect()
            }
            Err(StoreError::Backend(_)) if n > 1 => (0..n).map(|_| Answer::Alone).collect(),
            Err(e) => (0..n).map(|_| Answer::Failed(e.clone())).collect(),
        };
        for (reply, answer) in replies.into_iter().zip(answers) {
            // a request that is gone has nothing to be told
            let _ = reply.send(answer);
        }
    }
}

/// Queues `item` and waits for its answer.
async fn through<I>(queue: &Queue<I>, item: I) -> Answer {
    let (reply, answer) = oneshot::channel();
    if queue.send(Job { item, reply }).is_err() {
        return Answer::Failed(StoreError::Unavailable("the service is stopping".into()));
    }
    answer.await.unwrap_or_else(|_| Answer::Failed(StoreError::Backend("a batch's lane ended".into())))
}

/// A request's steps on a [`Batcher`]: the claim and the execution go out
/// in batches; the rest on a connection taken when needed, and given back
/// before the request waits for a batch again: a request holding one while
/// it waits for a lane that waits for one could starve the lanes.
pub struct Batched<'a> {
    batcher: &'a Batcher,
    conn: Option<Pooled>,
    ahead: Option<Ahead>,
}

impl Route for Batched<'_> {
    fn shape(&self) -> &Shape {
        &self.batcher.shape
    }

    type Client = tokio_postgres::Client;

    fn policy(&self) -> &Policy {
        self.batcher.policy
    }

    fn ahead(&mut self) -> &mut Option<Ahead> {
        &mut self.ahead
    }

    async fn claim_row(&mut self, args: &ClaimArgs<'_>) -> Result<Row, StoreError> {
        self.conn = None;
        match through(&self.batcher.claims, args.item()).await {
            Answer::Row(row) => Ok(row),
            Answer::Alone => self.conn().await?.claim_row(args).await,
            Answer::Failed(e) => Err(e),
        }
    }

    async fn execute_row(&mut self, args: &PlanArgs<'_>) -> Result<Row, StoreError> {
        self.conn = None;
        match through(&self.batcher.executions, args.item()).await {
            Answer::Row(row) => Ok(row),
            Answer::Alone => self.conn().await?.execute_row(args).await,
            Answer::Failed(e) => Err(e),
        }
    }

    async fn conn(&mut self) -> Result<&mut PgConn, StoreError> {
        if self.conn.is_none() {
            self.conn = Some(self.batcher.pool.get().await?);
        }
        self.conn.as_deref_mut().ok_or_else(|| StoreError::Backend("no connection".into()))
    }
}

crate::store::pg::steps_of_route!(Batched<'_>);
