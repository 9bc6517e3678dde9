//! `idem serve`: the protocol behind HTTP, following
//! draft-ietf-httpapi-idempotency-key-header. A thin async edge (tokio and
//! hyper) around the synchronous protocol, which runs to completion on the
//! store workers of [`executor`], detached from the connection that asked.
//!
//! The first line on stdout names the bound address (`http://HOST:PORT`);
//! one JSON line per request goes to stderr. SIGTERM or Ctrl-C stops
//! accepting, lets the requests in flight finish, waits for the workers to
//! drain, and exits 0: no claim is left behind by a shutdown.

pub mod executor;
pub mod http;
pub mod metrics;

use crate::clock::Timestamp;
use crate::policy::Policy;
use crate::store::StoreError;
use executor::{Clock, Executor};
use hyper::service::service_fn;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// How long a client may take to send its request headers.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a shutdown waits for the requests in flight.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

#[derive(Debug, Clone)]
pub struct Options {
    pub db: String,
    pub listen: String,
    pub clients: PathBuf,
    /// Connections to PostgreSQL (each with a worker thread); SQLite has one
    /// writer and two readers.
    pub pool: usize,
    /// Transfers answered at once; more get 503 at once.
    pub max_in_flight: usize,
    /// SQLite: the most transfers one group commit carries (1: a commit each).
    pub group_max: usize,
}

/// Why the service could not start (or stop cleanly).
#[derive(Debug)]
pub struct ServeError(pub String);

impl std::fmt::Display for ServeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<StoreError> for ServeError {
    fn from(e: StoreError) -> Self {
        ServeError(e.to_string())
    }
}

impl From<std::io::Error> for ServeError {
    fn from(e: std::io::Error) -> Self {
        ServeError(e.to_string())
    }
}

/// Reads the clients file: a JSON object mapping each bearer token to its
/// client id.
pub fn load_clients(path: &std::path::Path, policy: &Policy) -> Result<HashMap<String, String>, ServeError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ServeError(format!("cannot read the clients file {}: {e}", path.display())))?;
    let clients: HashMap<String, String> = serde_json::from_str(&text).map_err(|e| {
        ServeError(format!("{}: not a JSON object of token → client id ({e})", path.display()))
    })?;
    if clients.is_empty() {
        return Err(ServeError(format!("{}: no clients", path.display())));
    }
    for (token, client) in &clients {
        if token.trim().is_empty() || token.trim() != token || token.contains(char::is_whitespace) {
            return Err(ServeError(format!("{}: a token is empty or holds white space", path.display())));
        }
        if client.is_empty() || client.chars().count() > policy.max_field_chars {
            return Err(ServeError(format!(
                "{}: client ids must be 1 to {} characters",
                path.display(),
                policy.max_field_chars
            )));
        }
    }
    Ok(clients)
}

/// Runs the service until SIGTERM or Ctrl-C.
pub fn run(options: Options, policy: &'static Policy, clock: Clock) -> Result<(), ServeError> {
    let clients = load_clients(&options.clients, policy)?;
    let stores = executor::Stores::open(&options.db, options.pool, policy)?;
    let executor =
        Executor::start(stores, options.max_in_flight.max(1) * 2, options.group_max, policy, clock)?;
    let app = Arc::new(http::App::new(clients, executor, policy, options.max_in_flight.max(1)));
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let served = runtime.block_on(serve(&options.listen, app.clone()));
    // Every connection is closed: let the workers finish what was queued.
    app.executor.drain();
    served
}

async fn serve(listen: &str, app: Arc<http::App>) -> Result<(), ServeError> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| ServeError(format!("cannot listen on {listen}: {e}")))?;
    let address = listener.local_addr()?;
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "http://{address}")?;
        out.flush()?;
    }
    let graceful = GracefulShutdown::new();
    let mut stop = std::pin::pin!(shutdown_signal());
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let app = app.clone();
                let service = service_fn(move |req| {
                    let app = app.clone();
                    async move { Ok::<_, std::convert::Infallible>(http::handle(&app, req).await) }
                });
                let connection = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(HEADER_TIMEOUT)
                    .serve_connection(TokioIo::new(stream), service);
                let connection = graceful.watch(connection);
                tokio::spawn(async move {
                    let _ = connection.await;
                });
            }
            () = &mut stop => break,
        }
    }
    drop(listener); // stop accepting at once
    let _ = tokio::time::timeout(SHUTDOWN_GRACE, graceful.shutdown()).await;
    Ok(())
}

async fn shutdown_signal() {
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

/// The clock of the service: `IDEM_NOW` when set (for tests), else the wall
/// clock. A malformed `IDEM_NOW` is refused at start.
pub fn clock_from_env() -> Result<Clock, ServeError> {
    match std::env::var("IDEM_NOW") {
        Ok(text) => {
            let fixed = Timestamp::parse(&text).map_err(|e| ServeError(format!("IDEM_NOW: {e}")))?;
            Ok(Arc::new(move || fixed))
        }
        Err(_) => Ok(Arc::new(Timestamp::now)),
    }
}
