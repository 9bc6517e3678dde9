//! `idem chaos`: a day of many concurrent clients sending their transfers
//! through a lossy network ([`crate::outside::proxy`]) to a real service, which is killed
//! with SIGKILL and restarted mid-day (and, on PostgreSQL, the database
//! restarted once, or a replicated one's primary killed: a failover). With
//! several instances, each client tries them in turn. Then the verdict, from the database and the clients' own
//! logs: every transfer a client was told about exists; no transfer went out
//! twice; none exists that no client intended; the balances are conserved;
//! and a client whose budget ran out is listed with what the database says.
//!
//! The verdict needs nothing from the server but its `transfer` and
//! `account` tables: every intended transfer has an amount of its own, so a
//! transfer row names the intent it came from. That is what lets the same
//! verdict judge a deliberately broken server (see `tests/chaos.rs`).

use super::HarnessError;
use super::files::io_at;
use crate::client::{self, Endpoint, Verdict};
use crate::outside::proxy::{Odds, Proxy};
use crate::policy::Policy;
use crate::protocol;
use crate::rng::Rng;
use crate::store::{self, Usage};
use crate::store::{Db, bank};
use serde::Serialize;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// An action of the machine room, run from the day's own thread.
pub type Command = Box<dyn Fn() -> Result<(), String> + Send + Sync>;

const ACCOUNTS: usize = 6;
const OPENING_BALANCE: i64 = 1_000_000_000;

pub struct Config {
    pub out: PathBuf,
    pub seed: u64,
    /// The database: a PostgreSQL connection string to an empty database,
    /// or `None` for a new SQLite file in `out`.
    pub db: Option<Db>,
    pub clients: usize,
    /// Transfers per client.
    pub transfers: usize,
    /// The server command; `--db DB --listen ADDR --clients FILE` are appended.
    pub serve: Vec<String>,
    /// How many servers run at once on the one database, each behind a
    /// fault proxy of its own; each client tries them in turn.
    pub instances: usize,
    /// How many times the server is killed mid-day (evenly spaced); only
    /// with one instance, since the claims of the killed one are released
    /// by the operator's `idem recover`, which cannot tell them from the
    /// live ones' claims. `None`: 2 with one instance, else none.
    pub kills: Option<usize>,
    /// Restarts the database once mid-day (PostgreSQL).
    pub restart_db: Option<Command>,
    /// Kills a replicated database's primary this many times, evenly spaced
    /// over the day: `failover[0]` returns once the primary is dead,
    /// `failover[1]` once the cluster is whole again.
    pub failovers: usize,
    pub failover: Option<[Command; 2]>,
    /// With a gateway command (`idem gateway` and its faults; `--db` and
    /// `--listen` are appended), every fourth intent of each client is a
    /// payout through it, and the servers reconcile every second.
    pub gateway: Option<Vec<String>>,
    /// Each client's budget per transfer.
    pub budget: Duration,
    /// Each client's pause between two transfers (a day long enough for
    /// several failovers).
    pub think: Duration,
    pub odds: Odds,
}

/// One intended transfer and how it ended for its client.
#[derive(Debug, Clone, Serialize)]
pub struct Intent {
    pub client: usize,
    /// `transfer` or `payout`.
    pub kind: &'static str,
    pub key: String,
    pub src: String,
    /// The destination account, or a payout's beneficiary.
    pub dst: String,
    pub amount: i64,
    /// `done`, `refused` or `unknown`.
    pub verdict: String,
    pub attempts: u32,
    pub millis: u64,
    /// The transfer (or payout) id the client was told, if any.
    pub told: Option<i64>,
    #[serde(skip)]
    pub tries: Vec<client::Try>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Unknown {
    pub client: usize,
    pub key: String,
    /// What the database says: `went out once`, `not out`, `went out N times`.
    pub database: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct Summary {
    pub seed: u64,
    pub clients: usize,
    pub transfers_intended: usize,
    pub requests_sent: u64,
    pub attempts_per_transfer_mean: f64,
    pub attempts_per_transfer_max: u32,
    pub requests_dropped: u64,
    pub responses_dropped: u64,
    pub responses_cut: u64,
    pub requests_delayed: u64,
    pub requests_duplicated: u64,
    pub requests_unreachable: u64,
    pub instances: usize,
    /// Requests each instance's proxy received.
    pub requests_per_instance: Vec<u64>,
    pub server_kills: usize,
    pub database_restarts: usize,
    /// One entry per failover of the database's primary.
    pub failovers: Vec<Failover>,
    /// Failovers not run because every client had finished (a longer day
    /// fits more: each failover waits for the cluster to be whole again).
    pub failovers_not_run: usize,
    pub claims_released_after_kills: usize,
    pub outcomes_unknown: usize,
    pub transfers_made: usize,
    /// Intended transfers that went out more than once (counted per extra).
    pub transfers_paid_twice: usize,
    /// Transfers a client was told about (2xx) that are not in the database.
    pub transfers_lost: usize,
    /// Transfers in the database that no client intended.
    pub transfers_unintended: usize,
    /// 2xx answers naming a transfer other than the one intended.
    pub answers_misattributed: usize,
    pub balances_conserved: bool,
    pub time_to_certainty_ms_p50: u64,
    pub time_to_certainty_ms_p99: u64,
    /// Keys still claimed at the end of the day: each blocks its key's
    /// retries until its lease runs out.
    pub keys_left_claimed: usize,
    pub unknown: Vec<Unknown>,
    /// The payouts' verdict, on a day with payouts.
    pub payouts: Option<PayoutVerdict>,
}

/// What became of the payouts, from idem's `payout` table and the gateway's
/// own ledger, after the day and a final reconciliation.
#[derive(Debug, Clone, Default, Serialize)]
pub struct PayoutVerdict {
    pub intended: usize,
    pub completed: usize,
    pub failed: usize,
    /// Paid, then the money came back (learnt by an event or a lookup) and
    /// was credited back.
    pub returned: usize,
    /// Payouts the gateway returned after it paid them.
    pub returned_at_gateway: usize,
    /// Sends to the gateway per payout: the median and the most.
    pub sends_median: i64,
    pub sends_max: i64,
    /// Intents for which idem made more than one payout row (each with its
    /// own downstream key: a second payout).
    pub made_twice: usize,
    /// Downstream keys the gateway paid more than once.
    pub paid_twice_at_gateway: usize,
    /// Gateway payouts under a key no idem payout holds.
    pub at_gateway_without_intent: usize,
    /// Payouts a client was told were made (201) that the gateway did not pay.
    pub told_but_not_paid: usize,
    /// idem says completed, the gateway did not pay; or the gateway paid and
    /// idem says failed.
    pub disagreements: usize,
    /// Payouts not settled after the final reconciliation, each with why.
    pub left_for_a_person: Vec<String>,
    /// Of those, the ones that say no reason a person is needed.
    pub left_without_reason: usize,
    /// Rows of the gateway's ledger (one per downstream key it saw).
    pub gateway_ledger_rows: usize,
    /// Payouts settled by a reconciliation (the services' own, or the
    /// final one) rather than by the request that made them.
    pub settled_by_reconciliation: usize,
}

impl PayoutVerdict {
    fn exactly_once(&self) -> bool {
        self.made_twice == 0
            && self.paid_twice_at_gateway == 0
            && self.at_gateway_without_intent == 0
            && self.told_but_not_paid == 0
            && self.disagreements == 0
            && self.left_without_reason == 0
            && self.sends_max <= crate::payout::Limits::default().max_sends
    }
}

/// What one failover cost the clients, from their own attempts.
#[derive(Debug, Clone, Serialize)]
pub struct Failover {
    /// When the primary was killed, from the start of the day.
    pub at_ms: u64,
    /// From the kill to the end of the first attempt sent after it that
    /// made a new transfer; `None` if none did before the next failover.
    pub writes_resumed_ms: Option<u64>,
    /// Attempts answered 503 between the kill and the resumption.
    pub answered_503: usize,
    pub answered_409: usize,
    /// Attempts without an answer meanwhile (the fault proxy's too).
    pub unanswered: usize,
    /// Attempts in flight when the primary died whose transfer was
    /// committed all the same: answered 503, then replayed to a retry.
    pub acks_lost_found_by_retry: usize,
}

impl Summary {
    /// Whether nothing went out twice, nothing acknowledged was lost, and the
    /// money adds up.
    pub fn exactly_once(&self) -> bool {
        self.transfers_paid_twice == 0
            && self.transfers_lost == 0
            && self.transfers_unintended == 0
            && self.answers_misattributed == 0
            && self.balances_conserved
            && self.payouts.as_ref().is_none_or(PayoutVerdict::exactly_once)
    }

    /// Exactly once, no key left blocked by a claim nobody will finish, and
    /// every payout settled but those left for a person with a reason.
    pub fn passed(&self) -> bool {
        self.exactly_once() && self.keys_left_claimed == 0
    }
}

/// A running server process and the address it printed.
struct Server {
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
fn claims_left(db: &Db, policy: &Policy) -> Result<usize, HarnessError> {
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
const EVENTS_SECRET: &str = "chaos-events-secret";

impl GatewayProcess {
    /// Registers `server` as where the gateway's events go (the server
    /// itself, not its fault proxy: events have faults of their own).
    fn send_events_to(&self, server: SocketAddr) -> Result<(), HarnessError> {
        let body =
            serde_json::json!({"url": format!("http://{server}"), "secret": EVENTS_SECRET}).to_string();
        let agent: ureq::Agent = ureq::Agent::config_builder().http_status_as_error(false).build().into();
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

/// A running `idem gateway` and its ledger file.
struct GatewayProcess {
    child: Child,
    url: String,
    ledger: PathBuf,
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
    let log = out.join("gateway.log");
    let mut child = std::process::Command::new(program)
        .args(args)
        .arg("--db")
        .arg(&ledger)
        .args(["--listen", "127.0.0.1:0"])
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
    if !url.starts_with("http://") {
        return Err(HarnessError::Stopped(format!("the gateway's first line was {line:?}, not its URL")));
    }
    Ok(GatewayProcess { child, url, ledger })
}

/// After the day: reconciles until every payout is settled or left for a
/// person (a gateway still settling a slow payout is waited for, up to
/// 30 s), then judges the payouts against the gateway's own ledger.
fn settle_payouts(
    db: &Db,
    gateway: GatewayProcess,
    intents: &[Intent],
    log: &Path,
    policy: &Policy,
) -> Result<PayoutVerdict, HarnessError> {
    use crate::payout::{self, HttpGateway};
    let http = HttpGateway {
        url: gateway.url.clone(),
        token: None,
        timeout: Duration::from_secs(2),
        // the day's reconciliations run ahead of the clock: no waits, and
        // every paid payout looked up for a return once more
        limits: payout::Limits {
            backoff: Duration::ZERO,
            return_check: Duration::from_millis(1),
            ..payout::Limits::default()
        },
    };
    let mut store = store::open(db, policy, Usage::LongLived)?;
    payout::prepare(&mut *store, policy)?;
    // Every server is stopped: no call is in flight, so the leases they
    // took can be treated as over.
    let ahead = || crate::clock::Timestamp::now().plus_seconds(60);
    let deadline = Instant::now() + Duration::from_secs(30);
    // the gateway's returns come a second or two after a payout is paid
    std::thread::sleep(Duration::from_secs(3));
    let settles = |d: &payout::Decision| d.now.settled();
    let log = std::fs::read_to_string(log).unwrap_or_default();
    let settled_before = log
        .lines()
        .filter(|l| l.contains(r#""event":"reconcile""#))
        .filter(|l| l.contains(r#""now":"completed""#) || l.contains(r#""now":"failed""#))
        .count();
    let mut settled_at_the_end = 0;
    loop {
        let decisions = payout::reconcile(&mut *store, &http, &ahead, policy)?;
        settled_at_the_end += decisions.iter().filter(|d| settles(d)).count();
        let open = payout::open(&mut *store, ahead(), policy)?;
        let for_a_person =
            |p: &store::PayoutRow| p.note.as_deref().is_some_and(|n| n.starts_with("needs a person"));
        if open.iter().all(for_a_person) || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    let rows = bank::payouts(db)?;
    let conn = crate::outside::gateway::open(&gateway.ledger)?;
    let paid = crate::outside::gateway::ledger(&conn)?;
    drop(gateway);
    let mut v = PayoutVerdict {
        intended: intents.iter().filter(|i| i.kind == "payout").count(),
        ..PayoutVerdict::default()
    };
    let by_amount: BTreeMap<i64, &Intent> =
        intents.iter().filter(|i| i.kind == "payout").map(|i| (i.amount, i)).collect();
    let mut rows_per_intent: BTreeMap<i64, usize> = BTreeMap::new();
    for r in &rows {
        *rows_per_intent.entry(r.amount).or_default() += 1;
        let at_gateway: Vec<_> = paid.iter().filter(|g| g.key == r.downstream_key).collect();
        let gateway_paid = at_gateway.iter().any(|g| g.status == "paid");
        let gateway_returned = at_gateway.iter().any(|g| g.status == "returned");
        match r.state.as_str() {
            "completed" => v.completed += 1,
            "failed" => v.failed += 1,
            "returned" => v.returned += 1,
            _ => {
                let note = r.note.as_deref().unwrap_or("no note");
                v.left_without_reason += usize::from(!note.starts_with("needs a person"));
                v.left_for_a_person.push(format!("payout {} ({}): {note}", r.id, r.state));
            }
        }
        // settled, idem and the gateway agree: paid is completed; returned is
        // returned (or failed, if idem never saw it paid); else failed
        let agrees = match r.state.as_str() {
            "completed" => gateway_paid,
            "returned" => gateway_returned,
            "failed" => !gateway_paid,
            _ => true,
        };
        v.disagreements += usize::from(!agrees);
        if let Some(i) = by_amount.get(&r.amount)
            && i.verdict == "done"
            && !(gateway_paid || gateway_returned)
        {
            v.told_but_not_paid += 1;
        }
    }
    v.made_twice = rows_per_intent.values().map(|n| n.saturating_sub(1)).sum::<usize>()
        + rows.iter().filter(|r| !by_amount.contains_key(&r.amount)).count();
    let mut per_key: BTreeMap<&str, usize> = BTreeMap::new();
    for g in paid.iter().filter(|g| g.status == "paid") {
        *per_key.entry(g.key.as_str()).or_default() += 1;
    }
    v.paid_twice_at_gateway = per_key.values().filter(|n| **n > 1).count();
    v.at_gateway_without_intent =
        paid.iter().filter(|g| !rows.iter().any(|r| r.downstream_key == g.key)).count();
    v.gateway_ledger_rows = paid.len();
    v.returned_at_gateway = paid.iter().filter(|g| g.status == "returned").count();
    let mut sends: Vec<i64> = rows.iter().map(|r| r.sends).collect();
    sends.sort_unstable();
    v.sends_median = sends.get(sends.len() / 2).copied().unwrap_or(0);
    v.sends_max = sends.last().copied().unwrap_or(0);
    v.settled_by_reconciliation = settled_before + settled_at_the_end;
    Ok(v)
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

/// The day. Writes `chaos.json` and `chaos_report.md` into `config.out`.
pub fn run(config: Config, policy: &Policy) -> Result<Summary, HarnessError> {
    std::fs::create_dir_all(&config.out).map_err(io_at(&config.out))?;
    let db = match &config.db {
        Some(db) => db.clone(),
        None => {
            let file = config.out.join("chaos.db");
            bank::remove_files(&file)?;
            Db::Sqlite(file)
        }
    };
    let accounts: Vec<bank::Account> = (0..ACCOUNTS)
        .map(|i| bank::Account {
            id: format!("acct-{i}"),
            holder: format!("holder {i}"),
            balance: OPENING_BALANCE,
        })
        .collect();
    bank::create(&db, &accounts)?;
    let clients_file = config.out.join("clients.json");
    let tokens: Vec<String> = (0..config.clients).map(|c| format!("tok-chaos-{}-{c}", config.seed)).collect();
    let map: BTreeMap<&str, String> =
        tokens.iter().enumerate().map(|(c, t)| (t.as_str(), format!("chaos-{c}"))).collect();
    std::fs::write(&clients_file, serde_json::to_string(&map)?).map_err(io_at(&clients_file))?;
    let log = config.out.join("server.log");
    let _ = std::fs::remove_file(&log);

    if config.instances == 0 {
        return Err(HarnessError::Stopped("no instances to run".into()));
    }
    let planned_kills = config.kills.unwrap_or(if config.instances == 1 { 2 } else { 0 });
    if config.instances > 1 && planned_kills > 0 {
        return Err(HarnessError::Stopped(
            "server kills need one instance: the claims a killed server leaves are released by \
             `idem recover`, which cannot tell them from the live instances' claims"
                .into(),
        ));
    }
    let gateway = match &config.gateway {
        Some(command) => Some(start_gateway(command, &config.out)?),
        None => None,
    };
    let extra: Vec<String> = match &gateway {
        Some(gw) => [
            "--gateway",
            &gw.url,
            "--gateway-timeout",
            "1s",
            "--reconcile-every",
            "1s",
            "--gateway-events-secret",
            EVENTS_SECRET,
        ]
        .map(String::from)
        .to_vec(),
        None => Vec::new(),
    };
    let payouts = gateway.is_some();
    let mut servers = Vec::new();
    let mut proxies = Vec::new();
    for i in 0..config.instances {
        let server = start_server(&config.serve, &db, &clients_file, &log, &extra)?;
        let proxy = Proxy::start(server.address, config.seed.wrapping_add(i as u64), config.odds)
            .map_err(HarnessError::io("starting the fault proxy"))?;
        servers.push(server);
        proxies.push(proxy);
    }
    if let (Some(gw), Some(first)) = (&gateway, servers.first()) {
        gw.send_events_to(first.address)?;
    }
    let total = config.clients * config.transfers;
    let settled = Arc::new(AtomicUsize::new(0));
    let intents = Arc::new(Mutex::new(Vec::new()));
    let day_started = Instant::now();

    let workers: Vec<_> = (0..config.clients)
        .map(|c| {
            // client c starts on instance c and moves on to the next after a failure
            let endpoints: Vec<Endpoint> = (0..proxies.len())
                .map(|i| Endpoint { url: proxies[(c + i) % proxies.len()].url(), token: tokens[c].clone() })
                .collect();
            let (settled, intents) = (settled.clone(), intents.clone());
            let (seed, transfers, budget, think) =
                (config.seed, config.transfers, config.budget, config.think);
            std::thread::spawn(move || {
                let mut rng = Rng::new(seed ^ (c as u64 + 1).wrapping_mul(0x9e37_79b9));
                let policy = client::Policy { budget, ..client::Policy::default() };
                for i in 0..transfers {
                    let src = rng.below(ACCOUNTS as u64) as usize;
                    let dst = (src + 1 + rng.below(ACCOUNTS as u64 - 1) as usize) % ACCOUNTS;
                    // an amount of its own names the intent in the transfer table
                    let amount = 1_000 + (c * transfers + i) as i64;
                    let key = format!("chaos-{seed}-{c}-{i}");
                    let payout = payouts && i % 4 == 3;
                    let (kind, route, dst, id_member) = match payout {
                        true => ("payout", "/v1/payouts", format!("ben-{c}-{i}"), "payout_id"),
                        false => ("transfer", "/v1/transfers", format!("acct-{dst}"), "transfer_id"),
                    };
                    let body = match payout {
                        true => serde_json::json!({"src": format!("acct-{src}"), "beneficiary": dst,
                                                   "amount": amount, "currency": "KRW"}),
                        false => serde_json::json!({"src": format!("acct-{src}"), "dst": dst,
                                                    "amount": amount, "currency": "KRW"}),
                    }
                    .to_string();
                    let report = client::send_to(&endpoints, route, &key, &body, &policy, &mut rng);
                    let (verdict, told) = match &report.verdict {
                        Verdict::Done { body, .. } => {
                            let id = serde_json::from_str::<serde_json::Value>(body)
                                .ok()
                                .and_then(|v| v[id_member].as_i64());
                            ("done", id)
                        }
                        Verdict::Refused { .. } => ("refused", None),
                        Verdict::Unknown { .. } => ("unknown", None),
                    };
                    let intent = Intent {
                        client: c,
                        kind,
                        key,
                        src: format!("acct-{src}"),
                        dst,
                        amount,
                        verdict: verdict.into(),
                        attempts: report.attempts(),
                        millis: report.took.as_millis() as u64,
                        told,
                        tries: report.tries,
                    };
                    intents.lock().unwrap_or_else(|e| e.into_inner()).push(intent);
                    settled.fetch_add(1, Ordering::Relaxed);
                    std::thread::sleep(think);
                }
            })
        })
        .collect();

    // The faults of the machine room, evenly spaced over the day: server
    // kills, failovers, and the database restart half way.
    #[derive(PartialEq, Eq, PartialOrd, Ord)]
    enum Fault {
        Kill,
        Failover,
        RestartDb,
    }
    let mut kills = 0;
    let mut database_restarts = 0;
    let mut released = 0;
    let mut failed_over = Vec::new();
    let mut failovers_not_run = 0;
    let spaced = |n: usize, fault: fn() -> Fault| (1..=n).map(move |k| (total * k / (n + 1), fault()));
    let mut faults: Vec<(usize, Fault)> = spaced(planned_kills, || Fault::Kill)
        .chain(spaced(if config.failover.is_some() { config.failovers } else { 0 }, || Fault::Failover))
        .chain(spaced(usize::from(config.restart_db.is_some()), || Fault::RestartDb))
        .collect();
    faults.sort();
    for (at, fault) in faults {
        while settled.load(Ordering::Relaxed) < at.max(1) && workers.iter().any(|w| !w.is_finished()) {
            std::thread::sleep(Duration::from_millis(5));
        }
        match (fault, &config.restart_db, &config.failover) {
            (Fault::Kill, _, _) => {
                let server = &mut servers[kills % config.instances];
                let _ = server.child.kill(); // SIGKILL: no goodbye, claims left where they are
                let _ = server.child.wait();
                released += release_claims(&db, policy)?;
                *server = start_server(&config.serve, &db, &clients_file, &log, &extra)?;
                proxies[kills % config.instances].set_upstream(server.address);
                if let Some(gw) = gateway.as_ref().filter(|_| kills % config.instances == 0) {
                    gw.send_events_to(server.address)?;
                }
                kills += 1;
            }
            (Fault::RestartDb, Some(restart), _) => {
                restart().map_err(|e| HarnessError::Stopped(format!("restarting the database: {e}")))?;
                database_restarts += 1;
                released += release_claims(&db, policy)?;
            }
            // No release here: the services themselves must free what the
            // failover interrupted, or the verdict counts the keys blocked.
            // a failover after the last transfer would measure nothing
            (Fault::Failover, _, Some(_)) if workers.iter().all(|w| w.is_finished()) => {
                failovers_not_run += 1
            }
            (Fault::Failover, _, Some([kill, heal])) => {
                kill().map_err(|e| HarnessError::Stopped(format!("killing the primary: {e}")))?;
                failed_over.push(Instant::now());
                heal().map_err(|e| HarnessError::Stopped(format!("after the failover: {e}")))?;
            }
            _ => {}
        }
    }
    for w in workers {
        w.join().map_err(|_| HarnessError::Stopped("a client thread panicked".into()))?;
    }
    let day_ended = Instant::now();
    for server in &mut servers {
        // SAFETY: kill(2) takes plain integers; the pid is our own child's,
        // not yet waited for, so it cannot name another process.
        unsafe { libc::kill(server.child.id() as i32, libc::SIGTERM) };
        let _ = server.child.wait();
    }

    let intents = std::mem::take(&mut *intents.lock().unwrap_or_else(|e| e.into_inner()));
    let payout_verdict = match gateway {
        Some(gw) => Some(settle_payouts(&db, gw, &intents, &log, policy)?),
        None => None,
    };
    let failovers = failover_figures(&intents, &failed_over, day_started, day_ended);
    let claimed = claims_left(&db, policy)?;
    let summary =
        verdict(&db, &intents, &accounts, &proxies, [kills, database_restarts, released, claimed], &config)?;
    let summary = Summary { failovers, failovers_not_run, payouts: payout_verdict, ..summary };
    drop(proxies);
    super::files::write_file(&config.out.join("chaos.json"), &super::files::to_json(&summary)?)?;
    super::files::write_file(&config.out.join("chaos_report.md"), &report(&summary))?;
    Ok(summary)
}

/// Reads the transfer table and the balances and judges the day.
fn verdict(
    db: &Db,
    intents: &[Intent],
    accounts: &[bank::Account],
    proxies: &[Proxy],
    [kills, database_restarts, released, claimed]: [usize; 4],
    config: &Config,
) -> Result<Summary, HarnessError> {
    let (transfers, balances) = bank::ledger(db)?;
    let payouts = bank::payouts(db)?;
    let by_amount: BTreeMap<i64, &Intent> = intents.iter().map(|i| (i.amount, i)).collect();
    let mut made: BTreeMap<i64, Vec<i64>> = BTreeMap::new(); // amount → transfer ids
    let mut unintended = 0;
    for t in &transfers {
        match by_amount.get(&t.amount) {
            Some(i) if i.src == t.src && i.dst == t.dst => made.entry(t.amount).or_default().push(t.id),
            _ => unintended += 1,
        }
    }
    let ids = |amount: i64| made.get(&amount).map_or(&[][..], Vec::as_slice);
    let paid_twice = made.values().map(|v| v.len().saturating_sub(1)).sum();
    let mut lost = 0;
    let mut misattributed = 0;
    for i in intents.iter().filter(|i| i.kind == "transfer") {
        if let Some(told) = i.told {
            match transfers.iter().find(|t| t.id == told) {
                None => lost += 1,
                Some(t) if t.amount != i.amount => misattributed += 1,
                Some(_) => {}
            }
        }
    }
    let unknown: Vec<Unknown> = intents
        .iter()
        .filter(|i| i.verdict == "unknown")
        .map(|i| Unknown {
            client: i.client,
            key: i.key.clone(),
            database: match (i.kind, ids(i.amount).len()) {
                ("payout", _) => {
                    let states: Vec<&str> =
                        payouts.iter().filter(|p| p.amount == i.amount).map(|p| p.state.as_str()).collect();
                    match states.as_slice() {
                        [] => "no payout".into(),
                        [state] => format!("one payout, {state}"),
                        many => format!("{} payouts: {}", many.len(), many.join(", ")),
                    }
                }
                (_, 0) => "not out".into(),
                (_, 1) => "went out once".into(),
                (_, n) => format!("went out {n} times"),
            },
        })
        .collect();
    // Conservation, and each balance exactly what the transfers made of it.
    let mut want: BTreeMap<String, i64> = accounts.iter().map(|a| (a.id.clone(), a.balance)).collect();
    for t in &transfers {
        *want.entry(t.src.clone()).or_insert(0) -= t.amount;
        *want.entry(t.dst.clone()).or_insert(0) += t.amount;
    }
    // a payout's money left its account unless the gateway refused it:
    // paid out, or held while not settled
    let gone = |p: &&bank::PayoutLine| p.state != "failed" && p.state != "returned";
    let out: i64 = payouts.iter().filter(gone).map(|p| p.amount).sum();
    for p in payouts.iter().filter(gone) {
        *want.entry(p.src.clone()).or_insert(0) -= p.amount;
    }
    let mut certainty: Vec<u64> =
        intents.iter().filter(|i| i.verdict != "unknown").map(|i| i.millis).collect();
    certainty.sort_unstable();
    let percentile = |p: usize| {
        certainty
            .get((certainty.len() * p / 100).min(certainty.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    };
    let load = |count: fn(&crate::outside::proxy::Counts) -> &std::sync::atomic::AtomicU64| {
        proxies.iter().map(|p| count(&p.counts).load(Ordering::Relaxed)).sum::<u64>()
    };
    let attempts: Vec<u32> = intents.iter().map(|i| i.attempts).collect();
    Ok(Summary {
        seed: config.seed,
        clients: config.clients,
        transfers_intended: intents.iter().filter(|i| i.kind == "transfer").count(),
        requests_sent: load(|c| &c.requests),
        attempts_per_transfer_mean: (attempts.iter().sum::<u32>() as f64 / attempts.len().max(1) as f64
            * 100.0)
            .round()
            / 100.0,
        attempts_per_transfer_max: attempts.iter().copied().max().unwrap_or(0),
        requests_dropped: load(|c| &c.dropped_requests),
        responses_dropped: load(|c| &c.dropped_responses),
        responses_cut: load(|c| &c.cut_responses),
        requests_delayed: load(|c| &c.delayed),
        requests_duplicated: load(|c| &c.duplicated),
        requests_unreachable: load(|c| &c.unreachable),
        instances: config.instances,
        requests_per_instance: proxies.iter().map(|p| p.counts.requests.load(Ordering::Relaxed)).collect(),
        server_kills: kills,
        database_restarts,
        failovers: Vec::new(),
        failovers_not_run: 0,
        claims_released_after_kills: released,
        outcomes_unknown: unknown.len(),
        transfers_made: transfers.len(),
        transfers_paid_twice: paid_twice,
        transfers_lost: lost,
        transfers_unintended: unintended,
        answers_misattributed: misattributed,
        balances_conserved: balances.values().sum::<i64>() + out
            == accounts.iter().map(|a| a.balance).sum::<i64>()
            && balances == want,
        time_to_certainty_ms_p50: percentile(50),
        time_to_certainty_ms_p99: percentile(99),
        keys_left_claimed: claimed,
        unknown,
        payouts: None,
    })
}

/// Each failover's cost, read from the clients' attempts: the window from
/// the kill to the first new transfer made by an attempt sent after it.
fn failover_figures(
    intents: &[Intent],
    kills: &[Instant],
    day_started: Instant,
    day_ended: Instant,
) -> Vec<Failover> {
    let tries = || intents.iter().flat_map(|i| i.tries.iter());
    kills
        .iter()
        .enumerate()
        .map(|(k, &killed)| {
            let next = kills.get(k + 1).copied().unwrap_or(day_ended);
            let resumed = tries()
                .filter(|t| t.sent >= killed && t.ended < next && !t.replayed)
                .filter(|t| t.status.is_some_and(|s| (200..300).contains(&s)))
                .map(|t| t.ended)
                .min();
            let until = resumed.unwrap_or(next);
            let meanwhile = |status: Option<u16>| {
                tries().filter(|t| t.ended >= killed && t.ended <= until && t.status == status).count()
            };
            let acks_lost = intents
                .iter()
                .filter(|i| i.tries.last().is_some_and(|t| t.replayed))
                .filter(|i| {
                    i.tries.iter().any(|t| t.sent < killed && t.ended >= killed && t.status == Some(503))
                })
                .count();
            Failover {
                at_ms: killed.duration_since(day_started).as_millis() as u64,
                writes_resumed_ms: resumed.map(|r| r.duration_since(killed).as_millis() as u64),
                answered_503: meanwhile(Some(503)),
                answered_409: meanwhile(Some(409)),
                unanswered: meanwhile(None),
                acks_lost_found_by_retry: acks_lost,
            }
        })
        .collect()
}

fn report(s: &Summary) -> String {
    let verdict = if s.exactly_once() { "**Exactly once.**" } else { "**NOT exactly once.**" };
    let mut md = format!(
        "# idem chaos: seed {}\n\n{verdict} {} clients intended {} transfers; {} went out. \
         Paid twice: {}. Lost (a client was told, the database has none): {}. Made with no intent behind them: {}. \
         Answers naming another transfer: {}. Balances conserved: {}.\n\n",
        s.seed,
        s.clients,
        s.transfers_intended,
        s.transfers_made,
        s.transfers_paid_twice,
        s.transfers_lost,
        s.transfers_unintended,
        s.answers_misattributed,
        s.balances_conserved
    );
    md.push_str("| what the network and the machine room did | count |\n|---|---:|\n");
    for (what, n) in [
        ("requests sent through the proxy", s.requests_sent),
        ("requests dropped before the server", s.requests_dropped),
        ("answers dropped after the server committed", s.responses_dropped),
        ("answers cut in half", s.responses_cut),
        ("requests delayed", s.requests_delayed),
        ("requests delivered twice at once", s.requests_duplicated),
        ("requests that found the server down", s.requests_unreachable),
        ("instances of the server", s.instances as u64),
        ("server kills (SIGKILL) and restarts", s.server_kills as u64),
        ("failovers (the primary SIGKILLed)", s.failovers.len() as u64),
        ("database restarts", s.database_restarts as u64),
        ("claims of the killed released (idem recover --release)", s.claims_released_after_kills as u64),
    ] {
        md.push_str(&format!("| {what} | {n} |\n"));
    }
    md.push_str(&format!(
        "\nAttempts per transfer: {} on average, {} at most. Time to certainty: p50 {} ms, p99 {} ms. \
         Outcomes unknown when the budget ran out: {}.\n",
        s.attempts_per_transfer_mean,
        s.attempts_per_transfer_max,
        s.time_to_certainty_ms_p50,
        s.time_to_certainty_ms_p99,
        s.outcomes_unknown
    ));
    md.push_str(&format!(
        "Keys still claimed at the end of the day (each blocking its retries until its lease ends): {}.\n",
        s.keys_left_claimed
    ));
    if let Some(p) = &s.payouts {
        md.push_str(&format!(
            "\n**Payouts** ({}): {} intended, {} completed, {} failed (the gateway refused: the hold released), \
             {} returned after they were paid (credited back; {} returned at the gateway). Sends per payout: \
             median {}, most {}. Made twice: {}. Paid twice at the gateway: {}. Paid at the gateway with no idem intent: {}. \
             A client told paid, the gateway did not pay: {}. idem and the gateway disagree: {}. \
             Rows in the gateway's ledger: {}. Settled by a reconciliation, not by their request: {}.\n",
            if p.exactly_once() { "exactly once" } else { "NOT exactly once" },
            p.intended,
            p.completed,
            p.failed,
            p.returned,
            p.returned_at_gateway,
            p.sends_median,
            p.sends_max,
            p.made_twice,
            p.paid_twice_at_gateway,
            p.at_gateway_without_intent,
            p.told_but_not_paid,
            p.disagreements,
            p.gateway_ledger_rows,
            p.settled_by_reconciliation
        ));
        for why in &p.left_for_a_person {
            md.push_str(&format!("- left for a person: {why}\n"));
        }
    }
    if s.failovers_not_run > 0 {
        md.push_str(&format!(
            "Failovers not run because every client had finished first: {} (more --transfers make a longer day).\n",
            s.failovers_not_run
        ));
    }
    if !s.failovers.is_empty() {
        md.push_str(
            "\n| failover at | writes resumed after | answered 503 | answered 409 | unanswered | \
             commits whose answer was lost, found by the retry |\n|---:|---:|---:|---:|---:|---:|\n",
        );
        for f in &s.failovers {
            let resumed = f.writes_resumed_ms.map_or("not before the next".into(), |ms| format!("{ms} ms"));
            md.push_str(&format!(
                "| {} ms | {resumed} | {} | {} | {} | {} |\n",
                f.at_ms, f.answered_503, f.answered_409, f.unanswered, f.acks_lost_found_by_retry
            ));
        }
    }
    if !s.unknown.is_empty() {
        md.push_str("\n| client | key | what the database says |\n|---:|---|---|\n");
        for u in &s.unknown {
            md.push_str(&format!("| {} | `{}` | {} |\n", u.client, u.key, u.database));
        }
    }
    md
}
