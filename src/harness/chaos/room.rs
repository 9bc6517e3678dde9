//! The machine room of a chaos day: the servers, each behind a fault
//! proxy of its own, the payout gateway, and what a kill leaves behind.

use super::receiver::Receiver;
use super::{Config, HarnessError};
use crate::harness::files::io_at;
use crate::outside::proxy::Proxy;
use crate::policy::Policy;
use crate::protocol;
use crate::store::{self, Db, Usage, bank};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};

/// The servers, their proxies and the gateway, and how to start a server
/// again.
pub(super) struct Room {
    pub servers: Vec<Server>,
    pub proxies: Vec<Proxy>,
    pub gateway: Option<GatewayProcess>,
    /// The clients' event receiver, on a day with payouts.
    pub receiver: Option<Receiver>,
    pub log: PathBuf,
    db: Db,
    clients: PathBuf,
    serve: Vec<String>,
    /// What every server is started with besides `--db`, `--listen`, `--clients`.
    extra: Vec<String>,
}

impl Room {
    /// Starts the gateway (if any) and `config.instances` servers on `db`,
    /// each behind its proxy; the gateway's events go to the first.
    pub(super) fn open(config: &Config, db: &Db, clients: PathBuf) -> Result<Room, HarnessError> {
        let log = config.out.join("server.log");
        let _ = std::fs::remove_file(&log);
        let gateway =
            config.gateway.as_ref().map(|command| start_gateway(command, &config.out)).transpose()?;
        // with payouts, the clients' own receiver of the events that tell them
        let receiver = match &gateway {
            Some(_) => Some(Receiver::start(config.seed).map_err(HarnessError::io("starting the receiver"))?),
            None => None,
        };
        let hooks = config.out.join("client_events.json");
        if let Some(r) = &receiver {
            r.hooks_file(config.clients, &hooks).map_err(io_at(&hooks))?;
        }
        let extra = match &gateway {
            Some(gw) => ["--gateway", &gw.url, "--gateway-timeout", "1s", "--reconcile-every", "1s"]
                .into_iter()
                .chain(["--ca-file", &gw.ca.to_string_lossy()])
                .chain(["--gateway-events-secret", EVENTS_SECRET])
                .chain(["--client-events", &hooks.to_string_lossy(), "--client-events-retry", "200ms"])
                // the clients' receiver is on loopback
                .chain(["--client-events-allow-private"])
                .map(String::from)
                .collect(),
            None => Vec::new(),
        };
        let serve = config.serve.clone();
        let mut room = Room {
            servers: Vec::new(),
            proxies: Vec::new(),
            gateway,
            receiver,
            log,
            db: db.clone(),
            clients,
            serve,
            extra,
        };
        for i in 0..config.instances {
            let server = room.start_server()?;
            let proxy = Proxy::start(server.address, config.seed.wrapping_add(i as u64), config.odds)
                .map_err(HarnessError::io("starting the fault proxy"))?;
            room.servers.push(server);
            room.proxies.push(proxy);
        }
        if let (Some(gw), Some(first)) = (&room.gateway, room.servers.first()) {
            gw.send_events_to(first.address)?;
        }
        Ok(room)
    }

    /// SIGKILLs server `i` (no goodbye: its claims stay where they are),
    /// releases the claims it left, and starts it again behind the same
    /// proxy. Returns how many claims were released.
    pub(super) fn kill(&mut self, i: usize, policy: &Policy) -> Result<usize, HarnessError> {
        let old = &mut self.servers[i];
        let _ = old.child.kill();
        let _ = old.child.wait();
        let released = release_claims(&self.db, policy)?;
        let server = self.start_server()?;
        self.proxies[i].set_upstream(server.address);
        if let Some(gw) = self.gateway.as_ref().filter(|_| i == 0) {
            gw.send_events_to(server.address)?;
        }
        self.servers[i] = server;
        Ok(released)
    }

    /// Asks every server to drain and stop (SIGTERM), and waits for it.
    #[allow(unsafe_code)] // kill(2) with SIGTERM: std's Child::kill only sends SIGKILL
    pub(super) fn stop_servers(&mut self) {
        for mut server in self.servers.drain(..) {
            // SAFETY: kill(2) takes plain integers; the pid is our own child's,
            // not yet waited for, so it cannot name another process.
            unsafe { libc::kill(server.child.id() as i32, libc::SIGTERM) };
            let _ = server.child.wait();
        }
    }

    /// Releases every claim left in progress (see [`release_claims`]).
    pub(super) fn release_claims(&self, policy: &Policy) -> Result<usize, HarnessError> {
        release_claims(&self.db, policy)
    }

    fn start_server(&self) -> Result<Server, HarnessError> {
        start_server(&self.serve, &self.db, &self.clients, &self.log, &self.extra)
    }
}

/// A running server process and the address it printed.
pub(super) struct Server {
    child: Child,
    address: SocketAddr,
}

fn start_server(
    serve: &[String],
    db: &Db,
    clients: &Path,
    log: &Path,
    extra: &[String],
) -> Result<Server, HarnessError> {
    let (program, args) =
        serve.split_first().ok_or_else(|| HarnessError::Stopped("empty --serve command".into()))?;
    let mut child = std::process::Command::new(program)
        .args(args)
        .arg("--db")
        .arg(db.to_arg())
        .args(["--listen", "127.0.0.1:0", "--clients"])
        .arg(clients)
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(std::fs::OpenOptions::new().create(true).append(true).open(log).map_err(io_at(log))?)
        .spawn()
        .map_err(HarnessError::io(format!("cannot start {program}")))?;
    let mut line = String::new();
    let stdout =
        child.stdout.take().ok_or_else(|| HarnessError::Stopped("no stdout from the server".into()))?;
    BufReader::new(stdout)
        .read_line(&mut line)
        .map_err(HarnessError::io("reading the server's first line"))?;
    let address = line.trim().strip_prefix("http://").and_then(|a| a.parse().ok()).ok_or_else(|| {
        HarnessError::Stopped(format!("the server's first line was {line:?}, not http://HOST:PORT"))
    })?;
    Ok(Server { child, address })
}

/// How many keys are claimed now, but for those of payouts not settled
/// (their key stays claimed until they are: a retry is answered 202).
pub(super) fn claims_left(db: &Db, policy: &Policy) -> Result<usize, HarnessError> {
    let mut store = store::open(db, policy, Usage::LongLived)?;
    let open: Vec<_> = match bank::payouts(db)?.is_empty() {
        true => Vec::new(),
        false => crate::payout::open(&mut *store, crate::clock::Timestamp::now(), policy)?
            .into_iter()
            .map(|p| p.key)
            .collect(),
    };
    Ok(store::atomically(&mut *store, store::Durability::Durable, policy, |tx| {
        Ok(store::End::Rollback(tx.in_progress()?.into_iter().filter(|(k, _)| !open.contains(k)).count()))
    })?)
}

/// What the gateway's events are signed with, between chaos's own processes.
const EVENTS_SECRET: &str = "chaos-day-gateway-events-secret";

impl GatewayProcess {
    /// Registers `server` as where the gateway's events go (the server
    /// itself, not its fault proxy: events have faults of their own).
    fn send_events_to(&self, server: SocketAddr) -> Result<(), HarnessError> {
        let body =
            serde_json::json!({"url": format!("http://{server}"), "secret": EVENTS_SECRET}).to_string();
        let agent = crate::https::agent(std::time::Duration::from_secs(10));
        match agent.post(format!("{}/webhook_endpoints", self.url)).send(body.as_str()) {
            Ok(r) if r.status().is_success() => Ok(()),
            Ok(r) => Err(HarnessError::Stopped(format!(
                "the gateway refused the webhook endpoint: HTTP {}",
                r.status()
            ))),
            Err(e) => Err(HarnessError::Stopped(format!("cannot register the webhook endpoint: {e}"))),
        }
    }
}

/// A running `idem gateway`, its ledger file, and the certificate it
/// serves HTTPS with.
pub(super) struct GatewayProcess {
    child: Child,
    pub url: String,
    pub ledger: PathBuf,
    pub ca: PathBuf,
}

/// A day that stops early (a fault's command failed) leaves no server
/// running behind it.
impl Drop for Room {
    fn drop(&mut self) {
        self.stop_servers();
    }
}

impl Drop for GatewayProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_gateway(command: &[String], out: &Path) -> Result<GatewayProcess, HarnessError> {
    let (program, args) =
        command.split_first().ok_or_else(|| HarnessError::Stopped("empty gateway command".into()))?;
    let ledger = out.join("gateway.db");
    bank::remove_files(&ledger)?;
    let ca = out.join("gateway-ca.pem");
    let log = out.join("gateway.log");
    let mut child = std::process::Command::new(program)
        .args(args)
        .arg("--db")
        .arg(&ledger)
        .args(["--listen", "127.0.0.1:0"])
        // over TLS, as real providers are: its certificate is trusted by
        // the servers (--ca-file) and by the harness's own reconciler
        .arg("--tls")
        .arg("--tls-cert-out")
        .arg(&ca)
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).map_err(io_at(&log))?)
        .spawn()
        .map_err(HarnessError::io(format!("cannot start {program}")))?;
    let mut line = String::new();
    let stdout =
        child.stdout.take().ok_or_else(|| HarnessError::Stopped("no stdout from the gateway".into()))?;
    BufReader::new(stdout)
        .read_line(&mut line)
        .map_err(HarnessError::io("reading the gateway's first line"))?;
    let url = line.trim().to_owned();
    if !url.starts_with("https://") {
        return Err(HarnessError::Stopped(format!("the gateway's first line was {line:?}, not its URL")));
    }
    let pem = std::fs::read(&ca).map_err(io_at(&ca))?;
    crate::https::trust_pem(&pem).map_err(|e| HarnessError::Stopped(format!("{}: {e}", ca.display())))?;
    Ok(GatewayProcess { child, url, ledger, ca })
}

/// Every claim left in progress is released: the service that held them was
/// killed, and no money moves without its completion, so none of them has
/// moved any (the operator's `idem recover --release` once the lease is
/// known to be over).
fn release_claims(db: &Db, policy: &Policy) -> Result<usize, HarnessError> {
    let mut store = store::open(db, policy, Usage::LongLived)?;
    let later = crate::clock::Timestamp::now().plus_seconds(i64::from(policy.in_progress_lease_seconds));
    Ok(protocol::release_claims(&mut store, later, false, policy)?.len())
}
