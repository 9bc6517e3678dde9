//! `idem serve`: the protocol behind HTTP, following
//! draft-ietf-httpapi-idempotency-key-header. A thin async edge (tokio and
//! hyper) around the protocol, which runs to completion in [`executor`]
//! (SQLite's writer thread, or PostgreSQL's async pool), detached from the
//! connection that asked.
//!
//! The first line on stdout names the bound address (`http://HOST:PORT`);
//! one JSON line per request goes to stderr. SIGTERM or Ctrl-C stops
//! accepting, lets the requests in flight finish, waits for the workers to
//! drain, and exits 0: no claim is left behind by a shutdown.

mod app;
mod desk;
pub mod executor;
pub mod health;
pub mod http;
pub mod log;
pub mod metrics;
mod payouts;
pub mod problems;
mod tell;
mod wait;

pub use tell::load_hooks;

use crate::policy::Policy;
use crate::store::Db;
use crate::store::StoreError;
use executor::{Clock, Executor};
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use std::collections::HashMap;
use std::future::Future;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// How long a client may take to send its request headers.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// The most a connection buffers of what it reads: the request head must
/// fit in it (431 otherwise), and a body is read through it frame by frame.
/// hyper's default grows to 400 KiB under a fast sender, which two thousand
/// uploading connections turn into most of a gigabyte.
const READ_BUFFER_BYTES: usize = 16 * 1024;
/// How often the client events sender looks for events due.
const TELL_EVERY: Duration = Duration::from_secs(1);
/// How long a shutdown waits for the requests in flight.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);
/// The longest pause after a failed accept (descriptors exhausted): the
/// failure repeats at once until something is closed, so retrying at once
/// would burn a core and starve the requests that could free one.
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

#[derive(Debug, Clone)]
pub struct Options {
    pub db: crate::store::Db,
    /// Bearer token → client id.
    pub clients: HashMap<String, String>,
    /// Connections to PostgreSQL that run transfers (an async pool), and as
    /// many writer threads for payouts when a gateway is set; SQLite has
    /// one writer. Two readers serve reads on either.
    pub pool: usize,
    /// Transfers answered at once; more get 503 at once.
    pub max_in_flight: usize,
    /// Connections served at once; more wait in the kernel's backlog.
    pub max_connections: usize,
    /// SQLite: the most transfers one group commit carries (1: a commit each).
    pub group_max: usize,
    /// PostgreSQL: the most requests one batch of claims, or of
    /// executions, carries; 1 sends each request's statements alone.
    pub pg_batch_max: usize,
    /// The secret that keys the logged key tags (`None`: a random one).
    pub log_secret: Option<Vec<u8>>,
    /// Where payouts go (`None`: `/v1/payouts` is not served).
    pub gateway: Option<crate::payout::HttpGateway>,
    /// How often the service reconciles payouts left unknown or stranded.
    pub reconcile_every: Duration,
    /// Payouts answered at once (a quarter of them per client); more get
    /// 503 at once. Apart from `max_in_flight`: a slow gateway never takes
    /// a transfer's slot.
    pub max_payouts_in_flight: usize,
    /// The secret provider events are signed with (`None`: no events route).
    pub events_secret: Option<Vec<u8>>,
    /// The secret before it, taken too while a rotation lasts.
    pub events_secret_previous: Option<Vec<u8>>,
    /// Where each client is told what became of its payouts (`None`: no
    /// sender runs, and the events wait, pending, for one).
    pub client_hooks: Option<HashMap<String, crate::payout::Hook>>,
    /// When a client event that was not delivered is tried again.
    pub client_events_schedule: crate::payout::Schedule,
    /// Which addresses client endpoints may resolve to (public only, by
    /// default: a client's name that points inside is refused).
    pub client_events_reach: crate::https::Reach,
}

/// Why the service could not start (or stop cleanly).
#[derive(Debug)]
pub enum ServeError {
    /// The database cannot be used (`idem serve` exits 5, as `idem_api`).
    Database(StoreError),
    Other(String),
}

impl std::fmt::Display for ServeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ServeError::Database(e) => write!(f, "{e}"),
            ServeError::Other(why) => f.write_str(why),
        }
    }
}

impl std::error::Error for ServeError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ServeError::Database(e) => Some(e),
            ServeError::Other(_) => None,
        }
    }
}

impl From<StoreError> for ServeError {
    fn from(e: StoreError) -> Self {
        ServeError::Database(e)
    }
}

/// Reads the clients file: a JSON object mapping each bearer token to its
/// client id. A token listed twice is refused, naming its second line (not
/// the token): which client it should stand for is a guess.
pub fn load_clients(path: &Path, policy: &Policy) -> Result<HashMap<String, String>, ServeError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ServeError::Other(format!("cannot read the clients file {}: {e}", path.display())))?;
    let pairs = parse_pairs::<String>(&text).map_err(|e| {
        ServeError::Other(format!("{}: not a JSON object of token → client id ({e})", path.display()))
    })?;
    if pairs.is_empty() {
        return Err(ServeError::Other(format!("{}: no clients", path.display())));
    }
    let mut clients = HashMap::new();
    for (n, (token, client)) in pairs.into_iter().enumerate() {
        if token.trim().is_empty() || token.contains(|c: char| c.is_whitespace() || c.is_control()) {
            return Err(ServeError::Other(format!(
                "{}: a token is empty or holds white space",
                path.display()
            )));
        }
        if client.is_empty()
            || client.chars().count() > policy.max_field_chars
            || client.contains(char::is_control)
        {
            return Err(ServeError::Other(format!(
                "{}: client ids must be 1 to {} characters, none of them a control character",
                path.display(),
                policy.max_field_chars
            )));
        }
        if clients.insert(token, client).is_some() {
            return Err(ServeError::Other(format!(
                "{}:{}: this entry's token is listed earlier in the file too; each token must stand for one client",
                path.display(),
                key_lines(&text).get(n).copied().unwrap_or(0)
            )));
        }
    }
    Ok(clients)
}

/// The members of a JSON object of strings, in file order, duplicates kept.
fn parse_pairs<V: serde::de::DeserializeOwned>(text: &str) -> Result<Vec<(String, V)>, serde_json::Error> {
    struct Pairs<V>(std::marker::PhantomData<V>);
    impl<'de, V: serde::Deserialize<'de>> serde::de::Visitor<'de> for Pairs<V> {
        type Value = Vec<(String, V)>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("an object")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut pairs = Vec::new();
            while let Some(pair) = map.next_entry()? {
                pairs.push(pair);
            }
            Ok(pairs)
        }
    }
    let mut de = serde_json::Deserializer::from_str(text);
    let pairs = serde::Deserializer::deserialize_map(&mut de, Pairs(std::marker::PhantomData))?;
    de.end()?;
    Ok(pairs)
}

/// The line of each member name of a JSON object whose values are strings:
/// at depth one, string literals alternate name, value.
fn key_lines(text: &str) -> Vec<usize> {
    let (mut lines, mut line, mut depth, mut strings) = (Vec::new(), 1, 0, 0);
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        match c {
            '\n' => line += 1,
            '{' | '[' => depth += 1,
            '}' | ']' => depth -= 1,
            '"' => {
                if depth == 1 && strings % 2 == 0 {
                    lines.push(line);
                }
                strings += 1;
                while let Some(c) = chars.next() {
                    match c {
                        '\\' => drop(chars.next()),
                        '"' => break,
                        '\n' => line += 1,
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    lines
}

/// Asks glibc's allocator to keep freed memory rather than hand it back
/// after every burst: each trim of a thread's heap is an `madvise` whose
/// TLB shootdown interrupts the other core, and under load that cost more
/// CPU than the SQLite writer's statements (perf, issue 22). The peak RSS
/// is what a burst needs anyway (measured by the bench).
#[allow(unsafe_code)] // mallopt: no safe equivalent in std
fn keep_freed_memory() {
    // SAFETY: mallopt only sets allocator parameters.
    unsafe {
        libc::mallopt(libc::M_TRIM_THRESHOLD, 64 << 20);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 4 << 20);
    }
}

/// Raises the soft limit on open descriptors to the hard one (as servers
/// do) and returns it: the default `--max-connections` is sized from it.
#[allow(unsafe_code)] // getrlimit/setrlimit: no safe equivalent in std
pub fn descriptor_limit() -> u64 {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit and setrlimit only read and write `limit`.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return 1024;
        }
        if limit.rlim_cur < limit.rlim_max {
            let raised = libc::rlimit { rlim_cur: limit.rlim_max, rlim_max: limit.rlim_max };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                limit.rlim_cur = limit.rlim_max;
            }
        }
    }
    limit.rlim_cur
}

/// Connections served at once by default: the descriptor limit, less what
/// the database connections, the log and the process itself keep open.
pub fn default_max_connections(descriptors: u64) -> usize {
    usize::try_from(descriptors.saturating_sub(64).max(16)).unwrap_or(usize::MAX).min(1 << 20)
}

/// The recovery job of payouts, on a connection of its own, every `every`:
/// each decision is a log line. A process that dies mid-run leaves the
/// payouts it took to the next run, once their lease is over.
fn reconcile_in_background(
    mut store: Box<dyn crate::store::Store + Send>,
    gateway: crate::payout::HttpGateway,
    every: Duration,
    policy: &'static Policy,
    clock: Clock,
    app: Arc<http::App>,
) -> std::io::Result<()> {
    std::thread::Builder::new().name("idem-reconcile".into()).spawn(move || {
        if let Ok(stats) = crate::payout::stats(&mut *store, policy) {
            app.metrics.payouts_counted(clock(), stats);
        }
        loop {
            std::thread::sleep(every);
            let line = |fields| log_line(&app, &clock, "reconcile", fields);
            match crate::payout::reconcile(&mut *store, &gateway, &*clock, policy) {
                Ok(decisions) => {
                    for d in decisions {
                        line(serde_json::from_str(&d.to_json()).unwrap_or_default());
                    }
                }
                Err(e) => line(serde_json::json!({"error": e.to_string()})),
            }
            if let Ok(stats) = crate::payout::stats(&mut *store, policy) {
                app.metrics.payouts_counted(clock(), stats);
            }
        }
    })?;
    Ok(())
}

/// What the operator must see of how the service runs: batches asked for
/// and off (a log line with why, once, and `idem_pg_batches_off`: correct
/// without them, only slower), and every TLS handshake refused on a call
/// out (a log line each; `idem_outbound_tls_failures_total` counts them).
fn tell_the_operator(app: &Arc<http::App>, clock: &Clock, unbatched: Option<String>) {
    if let Some(why) = unbatched {
        log_line(app, clock, "pg_batches_off", serde_json::json!({"reason": why}));
        app.metrics.batches_off();
    }
    let (seen, at) = (Arc::downgrade(app), clock.clone());
    crate::https::on_tls_failure(move |host, why| {
        if let Some(app) = seen.upgrade() {
            log_line(&app, &at, "outbound_tls_failed", serde_json::json!({"host": host, "error": why}));
        }
    });
}

/// A background job's log line: the time, the `event`, then `fields`'
/// members.
fn log_line(app: &http::App, clock: &Clock, event: &str, fields: serde_json::Value) {
    let mut v = serde_json::json!({"ts": clock().to_string(), "event": event});
    if let (Some(v), serde_json::Value::Object(fields)) = (v.as_object_mut(), fields) {
        v.extend(fields);
    }
    app.log.line(v.to_string());
}

/// The fewest bytes of key an events secret may give (the Standard
/// Webhooks bounds are 24 to 64): an empty one (a template's unset
/// variable) would let anyone sign events that credit money back.
pub const MIN_EVENTS_SECRET: usize = 24;
/// The most bytes of key a `whsec_` secret may give.
pub(crate) const MAX_EVENTS_KEY: usize = 64;

/// A secret is usable if it gives a key of 24 bytes or more: `whsec_` and
/// the base64 of 24 to 64 bytes (Standard Webhooks), or taken as it is
/// (Stripe's `whsec_` secrets are not base64), at least 24 bytes long.
fn events_secret_usable(secret: &[u8]) -> Result<(), ServeError> {
    let (bytes, fits) = match crate::payout::whsec_key(secret) {
        Some(key) => (key.len(), (MIN_EVENTS_SECRET..=MAX_EVENTS_KEY).contains(&key.len())),
        None => (secret.len(), secret.len() >= MIN_EVENTS_SECRET),
    };
    if !fits {
        return Err(ServeError::Other(format!(
            "the gateway events secret gives a key of {bytes} bytes; at least {MIN_EVENTS_SECRET} are needed, and at most {MAX_EVENTS_KEY} after whsec_ (an empty or short secret lets anyone sign events)"
        )));
    }
    Ok(())
}

/// A service whose stores are open and whose workers run, ready to serve.
pub struct Service {
    app: Arc<http::App>,
    max_connections: usize,
}

/// The events secrets, the current one first, each checked usable.
fn events_secrets(options: &Options) -> Result<Vec<Vec<u8>>, ServeError> {
    if options.events_secret_previous.is_some() && options.events_secret.is_none() {
        return Err(ServeError::Other("a previous events secret needs the current one beside it".into()));
    }
    let secrets: Vec<Vec<u8>> =
        options.events_secret.iter().chain(&options.events_secret_previous).cloned().collect();
    for secret in &secrets {
        events_secret_usable(secret)?;
    }
    Ok(secrets)
}

impl Service {
    /// Opens the stores and starts the workers and the log writer (logs go
    /// to `log_sink`); nothing listens yet.
    pub fn start(
        options: Options,
        log_sink: Box<dyn std::io::Write + Send>,
        policy: &'static Policy,
        clock: Clock,
        hook: Option<executor::GroupHook>,
    ) -> Result<Service, ServeError> {
        let events_secrets = events_secrets(&options)?;
        keep_freed_memory();
        let (db, pool, batches) = (&options.db, options.pool, options.pg_batch_max > 1);
        let stores = crate::store::Workers::open(db, pool, batches, options.gateway.is_some(), policy)?;
        let unbatched = stores.unbatched().map(str::to_owned);
        let group_max = if let Db::Postgres(_) = db { options.pg_batch_max } else { options.group_max };
        let health = Arc::new(health::Health::default());
        let capacity = options.max_in_flight.max(1) * 2;
        let executor =
            Executor::start(stores, capacity, group_max, policy, clock.clone(), health.clone(), hook)
                .map_err(|e| ServeError::Other(format!("cannot start the store workers: {e}")))?;
        let log = log::Log::start(log_sink, options.log_secret)
            .map_err(|e| ServeError::Other(format!("cannot start the log writer: {e}")))?;
        let payout_store = || -> Result<_, ServeError> {
            let mut store = crate::store::open(&options.db, policy, crate::store::Usage::LongLived)?;
            crate::payout::prepare(&mut *store, policy)?;
            Ok(store)
        };
        let reconciler = options.gateway.as_ref().map(|_| payout_store()).transpose()?;
        let sender = match (&options.gateway, options.client_hooks) {
            (Some(_), Some(hooks)) => Some((payout_store()?, hooks)),
            _ => None,
        };
        let app = Arc::new(http::App::new(
            options.clients,
            executor,
            health,
            log,
            policy,
            options.max_in_flight.max(1),
            options.gateway.clone().map(|g| {
                desk::Desk::new(
                    g,
                    clock.clone(),
                    options.max_payouts_in_flight.max(1),
                    events_secrets.clone(),
                )
            }),
        ));
        tell_the_operator(&app, &clock, unbatched);
        if let (Some(store), Some(gateway)) = (reconciler, options.gateway) {
            reconcile_in_background(
                store,
                gateway,
                options.reconcile_every,
                policy,
                clock.clone(),
                app.clone(),
            )
            .map_err(|e| ServeError::Other(format!("cannot start the reconciler: {e}")))?;
        }
        if let Some((store, hooks)) = sender {
            let sender = tell::sender(hooks, options.client_events_schedule, options.client_events_reach);
            tell::tell_in_background(store, sender, TELL_EVERY, policy, clock, app.clone())
                .map_err(|e| ServeError::Other(format!("cannot start the client events sender: {e}")))?;
        }
        Ok(Service { app, max_connections: options.max_connections.max(1) })
    }

    /// Serves `listener` until `shutdown` resolves, then lets the requests
    /// in flight finish and the workers drain.
    pub fn run(
        self,
        listener: std::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> Result<(), ServeError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .map_err(|e| ServeError::Other(format!("cannot start the runtime: {e}")))?;
        listener.set_nonblocking(true).map_err(|e| ServeError::Other(format!("listener: {e}")))?;
        let served = runtime.block_on(async {
            let listener = tokio::net::TcpListener::from_std(listener)
                .map_err(|e| ServeError::Other(format!("listener: {e}")))?;
            serve(listener, self.app.clone(), self.max_connections, shutdown).await;
            Ok(())
        });
        // Every connection is closed and every request task has ended (or
        // the grace period has): let the workers finish what was queued.
        self.app.executor.drain();
        self.app.log.flush(Duration::from_secs(1));
        served
    }
}

async fn serve(
    listener: tokio::net::TcpListener,
    app: Arc<http::App>,
    max_connections: usize,
    shutdown: impl Future<Output = ()>,
) {
    let graceful = GracefulShutdown::new();
    let connections = Arc::new(tokio::sync::Semaphore::new(max_connections));
    let mut stop = std::pin::pin!(shutdown);
    let mut backoff = Duration::ZERO;
    loop {
        // At the cap, stop accepting: new connections wait in the backlog.
        let permit = tokio::select! {
            permit = connections.clone().acquire_owned() => permit,
            () = &mut stop => break,
        };
        let Ok(permit) = permit else { break };
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut stop => break,
        };
        let stream = match accepted {
            Ok((stream, _)) => {
                backoff = Duration::ZERO;
                stream
            }
            Err(e) => {
                backoff = (backoff * 2).clamp(Duration::from_millis(5), ACCEPT_BACKOFF_MAX);
                app.accept_failed(&e);
                tokio::select! {
                    () = tokio::time::sleep(backoff) => continue,
                    () = &mut stop => break,
                }
            }
        };
        let handler = app.clone();
        let service = service_fn(move |req| {
            // The request runs as a task of its own: a client that hangs up
            // drops the connection, not the request, which still ends, is
            // logged and is counted.
            let task = tokio::spawn(http::handle(handler.clone(), req));
            async move { Ok::<_, std::convert::Infallible>(task.await.unwrap_or_else(|_| http::internal())) }
        });
        let connection = hyper::server::conn::http1::Builder::new()
            .timer(TokioTimer::new())
            .header_read_timeout(HEADER_TIMEOUT)
            .max_buf_size(READ_BUFFER_BYTES)
            .serve_connection(TokioIo::new(stream), service);
        let connection = graceful.watch(connection);
        let app = app.clone();
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                app.connection_failed(&e);
            }
            drop(permit);
        });
    }
    drop(listener); // stop accepting at once
    let deadline = tokio::time::Instant::now() + SHUTDOWN_GRACE;
    let _ = tokio::time::timeout_at(deadline, graceful.shutdown()).await;
    // Requests whose client hung up run on without a connection.
    while app.metrics.in_flight() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Resolves on SIGTERM or Ctrl-C.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = ctrl_c => {},
                _ = term.recv() => {},
            }
        }
        Err(_) => {
            let _ = ctrl_c.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn member_names_are_found_on_their_lines() {
        let text = "{\n  \"a\": \"x\",\n  \"b\\\"\": \"y\\n{\",\n\n  \"c\": \"z\"}";
        assert_eq!(key_lines(text), vec![2, 3, 5]);
        assert_eq!(parse_pairs::<String>(text).unwrap().len(), 3);
        let twice = "{\"t\": \"a\",\n \"t\": \"b\"}";
        assert_eq!(
            parse_pairs::<String>(twice).unwrap(),
            vec![("t".into(), "a".into()), ("t".into(), "b".into())]
        );
        assert!(parse_pairs::<String>("{\"t\": 1}").is_err() && parse_pairs::<String>("{} x").is_err());
    }
}
