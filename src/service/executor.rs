//! Where the synchronous protocol runs for the service: worker threads that
//! each own one store connection (one for SQLite, whose writes are serial
//! anyway; a bounded pool for PostgreSQL), fed by one bounded queue.
//!
//! A job, once queued, runs to completion whatever happens to the HTTP
//! connection that asked for it: a client that hangs up mid-request never
//! strands a claim. A full queue is refused at once (503, `busy`).

use crate::clock::Timestamp;
use crate::policy::Policy;
use crate::protocol::{self, Ctx, Flow, Outcome};
use crate::request::Request;
use crate::store::{Store, StoreError};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use tokio::sync::oneshot;

/// What a worker can be asked to do.
pub enum Job {
    Transfer { req: Request, reply: oneshot::Sender<Result<Outcome, StoreError>> },
    Lookup { client_id: String, transfer_id: i64, reply: oneshot::Sender<Result<Option<String>, StoreError>> },
    Ping { reply: oneshot::Sender<Result<(), StoreError>> },
}

pub struct Executor {
    queue: Mutex<Option<SyncSender<Job>>>,
    workers: Mutex<Vec<JoinHandle<()>>>,
}

/// The service's clock: the wall clock, or `IDEM_NOW` when set (for tests).
pub type Clock = Arc<dyn Fn() -> Timestamp + Send + Sync>;

impl Executor {
    /// One worker per store in `stores`, sharing a queue of `capacity` jobs.
    pub fn start(
        stores: Vec<Box<dyn Store + Send>>,
        capacity: usize,
        policy: &'static Policy,
        clock: Clock,
    ) -> std::io::Result<Self> {
        let (queue, jobs) = sync_channel(capacity);
        let jobs = Arc::new(Mutex::new(jobs));
        let workers = stores
            .into_iter()
            .enumerate()
            .map(|(i, store)| {
                let (jobs, clock) = (jobs.clone(), clock.clone());
                std::thread::Builder::new()
                    .name(format!("idem-store-{i}"))
                    .spawn(move || work(store, &jobs, policy, &clock))
            })
            .collect::<std::io::Result<_>>()?;
        Ok(Executor { queue: Mutex::new(Some(queue)), workers: Mutex::new(workers) })
    }

    /// Queues `job`; `false` when the queue is full (or shut).
    pub fn submit(&self, job: Job) -> bool {
        let queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        let Some(queue) = queue.as_ref() else { return false };
        match queue.try_send(job) {
            Ok(()) => true,
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => false,
        }
    }

    /// Stops taking jobs and waits for every queued one to finish.
    pub fn drain(&self) {
        self.queue.lock().unwrap_or_else(|e| e.into_inner()).take();
        let workers = std::mem::take(&mut *self.workers.lock().unwrap_or_else(|e| e.into_inner()));
        for worker in workers {
            let _ = worker.join();
        }
    }
}

fn work(mut store: Box<dyn Store + Send>, jobs: &Mutex<Receiver<Job>>, policy: &Policy, clock: &Clock) {
    loop {
        // The lock is held only while waiting for the next job.
        let job = match jobs.lock() {
            Ok(jobs) => jobs.recv(),
            Err(poisoned) => poisoned.into_inner().recv(),
        };
        let Ok(job) = job else { return };
        match job {
            Job::Transfer { req, reply } => {
                let outcome = protocol::fresh_token()
                    .map_err(|e| StoreError::Backend(format!("no randomness for a claim token: {e}")))
                    .and_then(|token| {
                        let ctx = Ctx { policy, now: clock(), token: &token };
                        protocol::handle(&mut store, &req, ctx, &mut |_| Flow::Continue)
                    });
                let _ = reply.send(outcome); // the client may have gone: the work is done anyway
            }
            Job::Lookup { client_id, transfer_id, reply } => {
                let _ = reply.send(store.transfer_for(&client_id, transfer_id));
            }
            Job::Ping { reply } => {
                let _ = reply.send(store.ping());
            }
        }
    }
}
