//! `idem serve`: the protocol over HTTP.

use crate::common::{Failure, announce, bind, db, fixed_now};
use crate::payouts::GatewayArgs;
use idem::clock::{self, Timestamp};
use idem::policy::Policy;
use idem::service::{self, ServeError};
use idem::store::Db;
use std::path::PathBuf;
use std::process::ExitCode;

/// Serve the protocol over HTTP (draft-ietf-httpapi-idempotency-key-header).
///
/// POST /v1/transfers with `Authorization: Bearer TOKEN` and an
/// `Idempotency-Key` header; GET /v1/transfers/{id}, /healthz, /metrics,
/// /openapi.json. Prints `http://HOST:PORT` first; logs one JSON line per
/// request on stderr (never waiting for it: lines a full stderr cannot
/// take are dropped and counted in /metrics); SIGTERM or Ctrl-C drains
/// and exits 0. IDEM_LOG_SECRET keys the logged key tags (default: a
/// random secret per process). IDEM_NOW=<RFC 3339> fixes the clock (for
/// tests).
#[derive(clap::Args, Debug)]
pub struct Serve {
    /// SQLite file or PostgreSQL connection string, the same key space as idem_api (or IDEM_DB, which keeps a password out of the process list).
    #[arg(long, env = "IDEM_DB", hide_env_values = true, value_parser = db)]
    db: Db,
    /// Address to listen on; port 0 picks a free one.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: String,
    /// JSON object mapping each bearer token to its client id.
    #[arg(long, value_name = "FILE")]
    clients: PathBuf,
    /// Connections to PostgreSQL (SQLite always uses one writer).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=256))]
    pool: u16,
    /// Transfers answered at once; more get 503 busy at once.
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u32).range(1..))]
    max_in_flight: u32,
    /// Connections served at once; more wait in the kernel's backlog (default: sized to the descriptor limit).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    max_connections: Option<u32>,
    /// SQLite: the most transfers one group commit (one fsync) carries; 1 commits each alone.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=65536))]
    group_max: u32,
    /// PostgreSQL: the most transfers one batch carries (their claims in one
    /// statement, their executions in one call of a function idem makes in
    /// the schema); 1 sends each transfer's statements alone.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=65536))]
    pg_batch_max: u32,
    /// With --gateway: POST /v1/payouts pays out through it (see docs/payouts.md).
    #[command(flatten)]
    gateway: GatewayArgs,
    /// How often payouts left unknown or stranded are reconciled (with --gateway).
    #[arg(long, default_value = "30s", value_parser = clock::parse_positive_duration)]
    reconcile_every: std::time::Duration,
    /// Payouts answered at once, apart from --max-in-flight (a quarter of
    /// them per client); more get 503 busy at once.
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..))]
    max_payouts_in_flight: u32,
    /// With --gateway: POST /v1/gateway-events takes the provider's events
    /// signed with this secret (HMAC-SHA256; see docs/payouts.md).
    #[arg(long, env = "IDEM_GATEWAY_EVENTS_SECRET", hide_env_values = true)]
    gateway_events_secret: Option<String>,
    /// The events secret before the current one, taken too while a
    /// rotation lasts: set the new one, keep the old one here until the
    /// provider signs with the new one only, then drop it.
    #[arg(long, env = "IDEM_GATEWAY_EVENTS_SECRET_PREVIOUS", hide_env_values = true)]
    gateway_events_secret_previous: Option<String>,
    /// With --gateway: tell each client what became of its payouts (settled
    /// after a 202, returned after a 201, settled by a person) by signed
    /// events to its endpoint. A JSON object of client id → {"url":
    /// "https://…", "secret": "whsec_<base64 of 24-64 bytes>"} (see
    /// docs/payouts.md). Without it the events wait, pending.
    #[arg(long, value_name = "FILE")]
    client_events: Option<PathBuf>,
    /// The first wait before a client event that was not delivered is sent
    /// again; it doubles per attempt up to an hour.
    #[arg(long, default_value = "10s", value_parser = clock::parse_positive_duration)]
    client_events_retry: std::time::Duration,
    /// A client event is sent again for this long after the change, then
    /// left failed for a person (`idem payouts redeliver`).
    #[arg(long, default_value = "72h", value_parser = clock::parse_positive_duration)]
    client_events_give_up: std::time::Duration,
    /// Let client endpoints resolve to addresses of the inside (loopback,
    /// private, link-local, as cloud metadata services are): by default a
    /// delivery to one is refused before any connection is made.
    #[arg(long)]
    client_events_allow_private: bool,
    /// A client endpoint whose every delivery has failed for this long is
    /// disabled until a person enables it (`idem payouts enable CLIENT`);
    /// a 410 Gone disables it at once.
    #[arg(long, default_value = "5d", value_parser = clock::parse_positive_duration)]
    client_events_disable_after: std::time::Duration,
}

pub fn serve(args: Serve, policy: &'static Policy) -> Result<ExitCode, Failure> {
    let Serve { db, listen, clients, pool, max_in_flight, max_connections, group_max, pg_batch_max, .. } =
        args;
    let max_connections = max_connections
        .map_or_else(|| service::default_max_connections(service::descriptor_limit()), |n| n as usize);
    let gateway = args.gateway.http();
    if args.client_events.is_some() && gateway.is_none() {
        return Err(Failure("--client-events tells clients of payouts: it needs --gateway".into()));
    }
    let options = service::Options {
        db,
        clients: service::load_clients(&clients, policy).map_err(|e| Failure(e.to_string()))?,
        pool: usize::from(pool),
        max_in_flight: max_in_flight as usize,
        max_connections,
        group_max: group_max as usize,
        pg_batch_max: pg_batch_max as usize,
        log_secret: std::env::var_os("IDEM_LOG_SECRET").map(|s| s.into_encoded_bytes()),
        gateway,
        reconcile_every: args.reconcile_every,
        max_payouts_in_flight: args.max_payouts_in_flight as usize,
        events_secret: args.gateway_events_secret.map(String::into_bytes),
        events_secret_previous: args.gateway_events_secret_previous.map(String::into_bytes),
        client_hooks: args
            .client_events
            .map(|f| service::load_hooks(&f))
            .transpose()
            .map_err(|e| Failure(e.to_string()))?,
        client_events_schedule: idem::payout::Schedule {
            first: args.client_events_retry,
            give_up: args.client_events_give_up,
            disable_after: args.client_events_disable_after,
            ..Default::default()
        },
        client_events_reach: match args.client_events_allow_private {
            true => idem::https::Reach::Any,
            false => idem::https::Reach::Public,
        },
    };
    let clock: service::executor::Clock = match fixed_now()? {
        Some(fixed) => std::sync::Arc::new(move || fixed),
        None => std::sync::Arc::new(Timestamp::now),
    };
    let (listener, address) = bind(&listen)?;
    let service = match service::Service::start(options, Box::new(std::io::stderr()), policy, clock, None) {
        Ok(service) => service,
        // as idem_api: a database that cannot be used is exit 5
        Err(e @ ServeError::Database(_)) => {
            eprintln!("idem: {e}");
            return Ok(ExitCode::from(5));
        }
        Err(e) => return Err(Failure(e.to_string())),
    };
    // The first line names the bound address once the stores are open: a
    // client that reads it can send at once.
    announce("http", address)?;
    service.run(listener, service::shutdown_signal()).map_err(|e| Failure(e.to_string()))?;
    Ok(ExitCode::SUCCESS)
}
