//! Reaching PostgreSQL: the connection string read once, every host
//! tried with the whole start-up bounded, the session's timeouts and
//! keepalives, and errors that never quote the connection string.

use super::*;

/// A connection configured for the engine: lock waits end at the busy
/// budget (and become 503s), and the money commit is durable even if the
/// server's default says otherwise.
pub(super) fn session(spec: &str, policy: &Policy) -> Result<Client, StoreError> {
    let mut client = client(spec, policy)?;
    client
        .batch_execute(&session_sql(policy))
        .map_err(|e| redacted("cannot configure the session", &e, spec))?;
    Ok(client)
}

/// What every connection that runs requests sets first.
pub(in crate::store) fn session_sql(policy: &Policy) -> String {
    format!(
        "SET lock_timeout = {}; SET statement_timeout = {STATEMENT_TIMEOUT_MS}; SET synchronous_commit = on",
        policy.busy_timeout_ms
    )
}

/// How long a network that stopped answering may keep a connection: TCP
/// keepalives probe an idle one after `KEEPALIVE_IDLE`, then every
/// `KEEPALIVE_INTERVAL`, `KEEPALIVE_RETRIES` times; data sent and not
/// acknowledged for `TCP_USER_TIMEOUT` drops it. The operating system's
/// defaults (two hours idle; retransmissions for about fifteen minutes)
/// would hold a worker on a dead peer far past any client's deadline.
pub(super) const KEEPALIVE_IDLE: Duration = Duration::from_secs(5);
pub(super) const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(1);
pub(super) const KEEPALIVE_RETRIES: u32 = 3;
pub(super) const TCP_USER_TIMEOUT: Duration = Duration::from_secs(10);

/// The longest any one statement may run on the server: every statement of
/// a request takes milliseconds, and its lock waits end at the busy budget.
pub(in crate::store) const STATEMENT_TIMEOUT_MS: u32 = 15_000;

/// A plain connection to the database `spec` names, with a connect timeout
/// of the busy budget and the network timeouts above, each unless `spec`
/// sets its own. The error never quotes `spec`.
///
/// A server that accepts the connection and then says nothing (paused, its
/// disk stuck) would hold the start-up forever: `connect_timeout` covers
/// only the socket's connect. So each host of `spec` is tried in turn with
/// the whole start-up bounded by that timeout, and the next host is tried
/// past it. An attempt left behind ends with its socket.
pub(in crate::store) fn client(spec: &str, policy: &Policy) -> Result<Client, StoreError> {
    let config = configure(spec, policy)?;
    let deadline = startup_deadline(&config);
    let mut last = None;
    for one in each_host(&config) {
        let (sent, answer) = std::sync::mpsc::channel();
        let attempt = std::thread::Builder::new()
            .name("idem-pg-connect".into())
            .spawn(move || drop(sent.send(Config::from(one).connect(NoTls))));
        if let Err(e) = attempt {
            return Err(StoreError::Backend(format!("cannot start a connection attempt: {e}").into()));
        }
        last = Some(match answer.recv_timeout(deadline) {
            Ok(Ok(client)) => return Ok(client),
            Ok(Err(e)) => redacted("cannot connect to PostgreSQL", &e, spec),
            Err(_) => silent(deadline),
        });
    }
    Err(last.unwrap_or_else(|| StoreError::Backend("--db names no host".into())))
}

/// What a host that accepted the connection but never answered is.
pub(in crate::store) fn silent(deadline: Duration) -> StoreError {
    StoreError::Unavailable(format!(
        "PostgreSQL accepted the connection but did not finish its start-up within {} ms (paused, or far too busy)",
        deadline.as_millis()
    ))
}

/// How long one host's whole start-up may take: the connect timeout.
pub(in crate::store) fn startup_deadline(config: &tokio_postgres::Config) -> Duration {
    config.get_connect_timeout().copied().unwrap_or(Duration::from_secs(5))
}

/// `config` once per host it names, in its order, each with that host only
/// (and its port and address): everything else as given.
pub(in crate::store) fn each_host(config: &tokio_postgres::Config) -> Vec<tokio_postgres::Config> {
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

/// The configuration of [`client`], for either driver.
pub(in crate::store) fn configure(spec: &str, policy: &Policy) -> Result<tokio_postgres::Config, StoreError> {
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
    config.application_name("idem");
    Ok(config)
}

/// A connection error as one line, with every trace of `spec` (and the
/// password in it) removed, in case a driver message ever echoes it.
pub(in crate::store) fn redacted(what: &str, e: &postgres::Error, spec: &str) -> StoreError {
    let mut line = format!("{what}: {}", describe(e));
    let password = Config::from_str(spec)
        .ok()
        .and_then(|c| c.get_password().map(|p| String::from_utf8_lossy(p).into_owned()));
    for secret in password.into_iter().chain([spec.to_owned()]).filter(|s| !s.is_empty()) {
        line = line.replace(&secret, "***");
    }
    StoreError::Backend(line.into())
}

/// A driver error as one line: its kind and the server's primary message,
/// never the DETAIL (which may quote row data).
pub(super) fn describe(e: &postgres::Error) -> String {
    let cause = match e.as_db_error() {
        Some(db) => Some(format!("{}: {}", db.severity(), db.message())),
        None => std::error::Error::source(e).map(|s| s.to_string()),
    };
    match cause {
        Some(cause) => format!("{e}: {}", cause.lines().next().unwrap_or("")),
        None => e.to_string(),
    }
}

/// A driver error as a store error: transient ones by kind, the rest as one
/// line without row data.
pub(in crate::store) fn pg(e: postgres::Error) -> StoreError {
    match e.code() {
        Some(c) if *c == SqlState::T_R_SERIALIZATION_FAILURE || *c == SqlState::T_R_DEADLOCK_DETECTED => {
            StoreError::Conflict
        }
        Some(c) if *c == SqlState::LOCK_NOT_AVAILABLE || *c == SqlState::QUERY_CANCELED => StoreError::Busy,
        _ if lost(&e) => StoreError::Unavailable(format!("PostgreSQL: {}", describe(&e))),
        _ => StoreError::Backend(format!("PostgreSQL: {}", describe(&e)).into()),
    }
}

/// Whether `e` says this connection cannot go on: the server went away (a
/// restart, a failover, a killed backend: 57P, 08), is out of resources
/// (53: disk full, memory, connections), or is a standby that cannot write
/// (25006). Nothing of the transaction is known to have committed but what
/// a retry will find; the next transaction runs on a new connection.
pub(in crate::store) fn lost(e: &postgres::Error) -> bool {
    match e.code() {
        Some(c) => {
            let c = c.code();
            c.starts_with("57P") || c.starts_with("08") || c.starts_with("53") || c == "25006"
        }
        None => e.is_closed() || std::error::Error::source(e).is_some_and(|s| s.is::<std::io::Error>()),
    }
}
