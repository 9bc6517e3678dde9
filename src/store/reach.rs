//! Reaching PostgreSQL, for every face of idem that does (the engine's
//! store, the service's pool, the library's layer): the connection string
//! read once, every host tried with the whole start-up bounded, the
//! network's timeouts and keepalives, errors that never quote the
//! connection string, and the one way a pool is built.

use super::StoreError;
use crate::policy::Policy;
use std::str::FromStr;
use std::time::Duration;
use tokio_postgres::NoTls;

/// How long a network that stopped answering may keep a connection: TCP
/// keepalives probe an idle one after `KEEPALIVE_IDLE`, then every
/// `KEEPALIVE_INTERVAL`, `KEEPALIVE_RETRIES` times; data sent and not
/// acknowledged for `TCP_USER_TIMEOUT` drops it. The operating system's
/// defaults (two hours idle; retransmissions for about fifteen minutes)
/// would hold a worker on a dead peer far past any client's deadline.
pub(crate) const KEEPALIVE_IDLE: Duration = Duration::from_secs(5);
pub(crate) const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(1);
pub(crate) const KEEPALIVE_RETRIES: u32 = 3;
pub(crate) const TCP_USER_TIMEOUT: Duration = Duration::from_secs(10);

/// Connects to `config`'s database, as the synchronous store (blocking on
/// it) and the service's pool both do; the connection is driven by a task
/// on the caller's runtime. The error never quotes `spec`.
///
/// A server that accepts the connection and then says nothing (paused, its
/// disk stuck) would hold the start-up forever: `connect_timeout` covers
/// only the socket's connect. So each host of `config` is tried in turn
/// with the whole start-up bounded by that timeout, and the next host is
/// tried past it. An attempt left behind ends with its socket.
pub(crate) async fn connect(
    config: &tokio_postgres::Config,
    spec: &str,
) -> Result<tokio_postgres::Client, StoreError> {
    let deadline = startup_deadline(config);
    let mut last = StoreError::Backend("--db names no host".into());
    for one in each_host(config) {
        match tokio::time::timeout(deadline, one.connect(NoTls)).await {
            Ok(Ok((client, connection))) => {
                tokio::spawn(async move {
                    // ends when the connection closes; the client sees that as errors
                    let _ = connection.await;
                });
                return Ok(client);
            }
            Ok(Err(e)) => last = redacted("cannot connect to PostgreSQL", &e, spec),
            Err(_) => last = silent(deadline),
        }
    }
    Err(last)
}

/// What a host that accepted the connection but never answered is.
pub(crate) fn silent(deadline: Duration) -> StoreError {
    StoreError::Unavailable(format!(
        "PostgreSQL accepted the connection but did not finish its start-up within {} ms (paused, or far too busy)",
        deadline.as_millis()
    ))
}

/// How long one host's whole start-up may take: the connect timeout.
pub(crate) fn startup_deadline(config: &tokio_postgres::Config) -> Duration {
    config.get_connect_timeout().copied().unwrap_or(Duration::from_secs(5))
}

/// How long making one connection may take: every host tried, each for
/// its start-up deadline.
pub(crate) fn create_deadline(config: &tokio_postgres::Config) -> Duration {
    let hosts = u32::try_from(each_host(config).len()).unwrap_or(u32::MAX);
    startup_deadline(config).saturating_mul(hosts) + Duration::from_secs(1)
}

/// A database that cannot be reached now is away: 503, not a 500.
pub(crate) fn away(e: StoreError) -> StoreError {
    match e {
        StoreError::Backend(why) => StoreError::Unavailable(why.to_string()),
        other => other,
    }
}

/// A pool (deadpool's) of `manager`'s connections: at most `size`, one
/// waited for at most `wait`, one made within `create`.
#[cfg(any(feature = "cli", feature = "axum"))]
pub(crate) fn pool<M: deadpool::managed::Manager>(
    manager: M,
    size: usize,
    wait: Duration,
    create: Duration,
) -> Result<deadpool::managed::Pool<M>, StoreError> {
    deadpool::managed::Pool::builder(manager)
        .max_size(size.max(1))
        .wait_timeout(Some(wait))
        .create_timeout(Some(create))
        .runtime(deadpool::Runtime::Tokio1)
        .build()
        .map_err(|e| StoreError::Backend(format!("cannot build the connection pool: {e}").into()))
}

/// `config` once per host it names, in its order, each with that host only
/// (and its port and address): everything else as given.
pub(crate) fn each_host(config: &tokio_postgres::Config) -> Vec<tokio_postgres::Config> {
    use tokio_postgres::config::Host;
    let (ports, addrs) = (config.get_ports(), config.get_hostaddrs());
    let mut all = Vec::new();
    for (i, host) in config.get_hosts().iter().enumerate() {
        let mut one = tokio_postgres::Config::new();
        match host {
            Host::Tcp(name) => one.host(name),
            Host::Unix(path) => one.host_path(path),
        };
        if let Some(port) = ports.get(i).or(ports.first()) {
            one.port(*port);
        }
        if let Some(addr) = addrs.get(i) {
            one.hostaddr(*addr);
        }
        if let Some(user) = config.get_user() {
            one.user(user);
        }
        if let Some(password) = config.get_password() {
            one.password(password);
        }
        if let Some(dbname) = config.get_dbname() {
            one.dbname(dbname);
        }
        if let Some(options) = config.get_options() {
            one.options(options);
        }
        if let Some(name) = config.get_application_name() {
            one.application_name(name);
        }
        if let Some(timeout) = config.get_connect_timeout() {
            one.connect_timeout(*timeout);
        }
        if let Some(timeout) = config.get_tcp_user_timeout() {
            one.tcp_user_timeout(*timeout);
        }
        if let Some(interval) = config.get_keepalives_interval() {
            one.keepalives_interval(interval);
        }
        if let Some(retries) = config.get_keepalives_retries() {
            one.keepalives_retries(retries);
        }
        one.ssl_mode(config.get_ssl_mode())
            .keepalives(config.get_keepalives())
            .keepalives_idle(config.get_keepalives_idle())
            .target_session_attrs(config.get_target_session_attrs())
            .channel_binding(config.get_channel_binding());
        all.push(one);
    }
    // no host given: the driver's own default (a local socket)
    if all.is_empty() {
        all.push(config.clone());
    }
    all
}

/// The configuration of every connection to `spec`.
pub(crate) fn configure(spec: &str, policy: &Policy) -> Result<tokio_postgres::Config, StoreError> {
    let mut config = tokio_postgres::Config::from_str(spec).map_err(|e| redacted("--db", &e, spec))?;
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(Duration::from_millis(u64::from(policy.busy_timeout_ms)));
    }
    let defaults = tokio_postgres::Config::new();
    if config.get_keepalives_idle() == defaults.get_keepalives_idle() {
        config.keepalives_idle(KEEPALIVE_IDLE);
    }
    if config.get_keepalives_interval().is_none() {
        config.keepalives_interval(KEEPALIVE_INTERVAL);
    }
    if config.get_keepalives_retries().is_none() {
        config.keepalives_retries(KEEPALIVE_RETRIES);
    }
    if config.get_tcp_user_timeout().is_none() {
        config.tcp_user_timeout(TCP_USER_TIMEOUT);
    }
    if config.get_application_name().is_none() {
        config.application_name("idem");
    }
    Ok(config)
}

/// A connection error as one line, with every trace of `spec` (and the
/// password in it) removed, in case a driver message ever echoes it.
pub(crate) fn redacted(what: &str, e: &tokio_postgres::Error, spec: &str) -> StoreError {
    let mut line = format!("{what}: {}", describe(e));
    let password = tokio_postgres::Config::from_str(spec)
        .ok()
        .and_then(|c| c.get_password().map(|p| String::from_utf8_lossy(p).into_owned()));
    for secret in password.into_iter().chain([spec.to_owned()]).filter(|s| !s.is_empty()) {
        line = line.replace(&secret, "***");
    }
    StoreError::Backend(line.into())
}

/// A driver error as one line: its kind and the server's primary message,
/// never the DETAIL (which may quote row data).
pub(crate) fn describe(e: &tokio_postgres::Error) -> String {
    let cause = match e.as_db_error() {
        Some(db) => Some(format!("{}: {}", db.severity(), db.message())),
        None => std::error::Error::source(e).map(|s| s.to_string()),
    };
    match cause {
        Some(cause) => format!("{e}: {}", cause.lines().next().unwrap_or("")),
        None => e.to_string(),
    }
}

/// What a pooled connection becomes once connected (a session set,
/// statements prepared), and whether one may go back into the pool.
#[cfg(any(feature = "cli", feature = "axum"))]
pub trait Ready: Send + Sync {
    /// The connection handed out.
    type Conn: Send;
    /// Makes a new connection ready: its session set, its statements prepared.
    fn ready(
        &self,
        client: tokio_postgres::Client,
    ) -> impl std::future::Future<Output = Result<Self::Conn, tokio_postgres::Error>> + Send;
    /// Whether `conn` may be handed out again: not closed, its state known.
    fn usable(&self, conn: &Self::Conn) -> bool;
}

/// How the [`Connector`] connects: to a connection string by
/// [`connect`], or by a maker of the application's own (the library's
/// layer: its TLS, its session settings), which spawns its connection task.
#[cfg(any(feature = "cli", feature = "axum"))]
pub(crate) enum Connect {
    Spec {
        config: Box<tokio_postgres::Config>,
        /// To say why a connection failed without quoting the connection string.
        spec: String,
    },
    Made(Box<Make>),
}

/// Makes one PostgreSQL connection the application's way.
#[cfg(any(feature = "cli", feature = "axum"))]
pub(crate) type Make = dyn Fn() -> std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<tokio_postgres::Client, StoreError>> + Send>,
    > + Send
    + Sync;

/// The one manager of idem's PostgreSQL pools (deadpool's): the service's,
/// and the library's own. It connects as `Connect` says and makes each
/// connection ready by `R`; a connection gone, or of unknown state, is
/// never handed out again.
#[cfg(any(feature = "cli", feature = "axum"))]
pub struct Connector<R> {
    connect: Connect,
    /// How long making one connection may take.
    create: Duration,
    pub(crate) ready: R,
}

#[cfg(any(feature = "cli", feature = "axum"))]
impl<R: Ready> Connector<R> {
    /// Connections to the database `spec` names, made ready by `ready`.
    pub(crate) fn with(spec: &str, policy: &Policy, ready: R) -> Result<Self, StoreError> {
        let config = configure(spec, policy)?;
        let create = create_deadline(&config);
        Ok(Connector {
            connect: Connect::Spec { config: Box::new(config), spec: spec.to_owned() },
            create,
            ready,
        })
    }

    /// Connections `make` makes, each within `create`, made ready by `ready`.
    pub(crate) fn made(make: Box<Make>, create: Duration, ready: R) -> Self {
        Connector { connect: Connect::Made(make), create, ready }
    }

    /// A pool of at most `size` connections, one waited for at most `wait`.
    pub(crate) fn pool_of(
        self,
        size: usize,
        wait: Duration,
    ) -> Result<deadpool::managed::Pool<Self>, StoreError> {
        let create = wait.max(self.create);
        pool(self, size, wait, create)
    }
}

#[cfg(any(feature = "cli", feature = "axum"))]
impl<R: Ready> deadpool::managed::Manager for Connector<R> {
    type Type = R::Conn;
    type Error = StoreError;

    async fn create(&self) -> Result<R::Conn, StoreError> {
        let (client, spec) = match &self.connect {
            Connect::Spec { config, spec } => (connect(config, spec).await.map_err(away)?, spec.as_str()),
            Connect::Made(make) => (make().await?, ""),
        };
        let ready = self.ready.ready(client).await;
        ready.map_err(|e| away(redacted("cannot configure the connection", &e, spec)))
    }

    async fn recycle(
        &self,
        conn: &mut R::Conn,
        _: &deadpool::managed::Metrics,
    ) -> deadpool::managed::RecycleResult<StoreError> {
        match self.ready.usable(conn) {
            true => Ok(()),
            false => {
                Err(deadpool::managed::RecycleError::message("the connection is closed or its state unknown"))
            }
        }
    }
}
