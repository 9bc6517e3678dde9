//! `idem chaos`: a day of many concurrent clients sending their transfers
//! through a lossy network ([`proxy`]) to a real service, which is killed
//! with SIGKILL and restarted mid-day (and, on PostgreSQL, the database
//! restarted once). Then the verdict, from the database and the clients' own
//! logs: every transfer a client was told about exists; no transfer went out
//! twice; none exists that no client intended; the balances are conserved;
//! and a client whose budget ran out is listed with what the database says.
//!
//! The verdict needs nothing from the server but its `transfer` and
//! `account` tables: every intended transfer has an amount of its own, so a
//! transfer row names the intent it came from. That is what lets the same
//! verdict judge a deliberately broken server (see `tests/chaos.rs`).

use super::HarnessError as ChaosError;
use super::day::io_at;
use super::proxy::{Odds, Proxy};
use crate::client::{self, Endpoint, Verdict};
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
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

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
    /// How many times the server is killed mid-day (evenly spaced).
    pub kills: usize,
    /// Restarts the database once mid-day (PostgreSQL).
    pub restart_db: Option<Box<dyn Fn() -> Result<(), String> + Send + Sync>>,
    /// Each client's budget per transfer.
    pub budget: Duration,
    pub odds: Odds,
}

/// One intended transfer and how it ended for its client.
#[derive(Debug, Clone, Serialize)]
pub struct Intent {
    pub client: usize,
    pub key: String,
    pub src: String,
    pub dst: String,
    pub amount: i64,
    /// `done`, `refused` or `unknown`.
    pub verdict: String,
    pub attempts: u32,
    pub millis: u64,
    /// The transfer id the client was told, if any.
    pub told: Option<i64>,
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
    pub server_kills: usize,
    pub database_restarts: usize,
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
    pub unknown: Vec<Unknown>,
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
    }
}

/// A running server process and the address it printed.
struct Server {
    child: Child,
    address: SocketAddr,
}

fn start_server(serve: &[String], db: &Db, clients: &Path, log: &Path) -> Result<Server, ChaosError> {
    let (program, args) = serve.split_first().ok_or_else(|| ChaosError("empty --serve command".into()))?;
    let mut child = Command::new(program)
        .args(args)
        .arg("--db")
        .arg(db.to_arg())
        .args(["--listen", "127.0.0.1:0", "--clients"])
        .arg(clients)
        .stdout(Stdio::piped())
        .stderr(std::fs::OpenOptions::new().create(true).append(true).open(log).map_err(io_at(log))?)
        .spawn()
        .map_err(|e| ChaosError(format!("cannot start {program}: {e}")))?;
    let mut line = String::new();
    let stdout = child.stdout.take().ok_or_else(|| ChaosError("no stdout from the server".into()))?;
    BufReader::new(stdout)
        .read_line(&mut line)
        .map_err(|e| ChaosError(format!("reading the server's first line: {e}")))?;
    let address =
        line.trim().strip_prefix("http://").and_then(|a| a.parse().ok()).ok_or_else(|| {
            ChaosError(format!("the server's first line was {line:?}, not http://HOST:PORT"))
        })?;
    Ok(Server { child, address })
}

/// Every claim left in progress is released: the service that held them was
/// killed, and no money moves without its completion, so none of them has
/// moved any (the operator's `idem recover --release` once the lease is
/// known to be over).
fn release_claims(db: &Db, policy: &Policy) -> Result<usize, ChaosError> {
    let mut store = store::open(db, policy, Usage::LongLived)?;
    let later = crate::clock::Timestamp::now().plus_seconds(i64::from(policy.in_progress_lease_seconds));
    Ok(protocol::release_claims(&mut store, later, false, policy)?.len())
}

/// The day. Writes `chaos.json` and `chaos_report.md` into `config.out`.
pub fn run(config: Config, policy: &Policy) -> Result<Summary, ChaosError> {
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
    std::fs::write(&clients_file, serde_json::to_string(&map).map_err(|e| ChaosError(e.to_string()))?)
        .map_err(io_at(&clients_file))?;
    let log = config.out.join("server.log");
    let _ = std::fs::remove_file(&log);

    let mut server = start_server(&config.serve, &db, &clients_file, &log)?;
    let proxy = Proxy::start(server.address, config.seed, config.odds)
        .map_err(|e| ChaosError(format!("starting the fault proxy: {e}")))?;
    let total = config.clients * config.transfers;
    let settled = Arc::new(AtomicUsize::new(0));
    let intents = Arc::new(Mutex::new(Vec::new()));

    let workers: Vec<_> = (0..config.clients)
        .map(|c| {
            let endpoint = Endpoint { url: proxy.url(), token: tokens[c].clone() };
            let (settled, intents) = (settled.clone(), intents.clone());
            let (seed, transfers, budget) = (config.seed, config.transfers, config.budget);
            std::thread::spawn(move || {
                let mut rng = Rng::new(seed ^ (c as u64 + 1).wrapping_mul(0x9e37_79b9));
                let policy = client::Policy { budget, ..client::Policy::default() };
                for i in 0..transfers {
                    let src = rng.below(ACCOUNTS as u64) as usize;
                    let dst = (src + 1 + rng.below(ACCOUNTS as u64 - 1) as usize) % ACCOUNTS;
                    // an amount of its own names the intent in the transfer table
                    let amount = 1_000 + (c * transfers + i) as i64;
                    let key = format!("chaos-{seed}-{c}-{i}");
                    let body = serde_json::json!({"src": format!("acct-{src}"), "dst": format!("acct-{dst}"),
                                                  "amount": amount, "currency": "KRW"})
                    .to_string();
                    let report = client::send(&endpoint, &key, &body, &policy, &mut rng);
                    let (verdict, told) = match &report.verdict {
                        Verdict::Done { body, .. } => {
                            let id = serde_json::from_str::<serde_json::Value>(body)
                                .ok()
                                .and_then(|v| v["transfer_id"].as_i64());
                            ("done", id)
                        }
                        Verdict::Refused { .. } => ("refused", None),
                        Verdict::Unknown { .. } => ("unknown", None),
                    };
                    let intent = Intent {
                        client: c,
                        key,
                        src: format!("acct-{src}"),
                        dst: format!("acct-{dst}"),
                        amount,
                        verdict: verdict.into(),
                        attempts: report.attempts,
                        millis: report.took.as_millis() as u64,
                        told,
                    };
                    intents.lock().unwrap_or_else(|e| e.into_inner()).push(intent);
                    settled.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();

    // The faults of the machine room: kills evenly spaced over the day, the
    // database restart half way.
    let mut kills = 0;
    let mut database_restarts = 0;
    let mut released = 0;
    let mut stops: Vec<(usize, bool)> =
        (1..=config.kills).map(|k| (total * k / (config.kills + 1), true)).collect();
    if config.restart_db.is_some() {
        stops.push((total / 2, false));
    }
    stops.sort();
    for (at, kill) in stops {
        while settled.load(Ordering::Relaxed) < at.max(1) && workers.iter().any(|w| !w.is_finished()) {
            std::thread::sleep(Duration::from_millis(5));
        }
        if kill {
            let _ = server.child.kill(); // SIGKILL: no goodbye, claims left where they are
            let _ = server.child.wait();
            kills += 1;
            released += release_claims(&db, policy)?;
            server = start_server(&config.serve, &db, &clients_file, &log)?;
            proxy.set_upstream(server.address);
        } else if let Some(restart) = &config.restart_db {
            restart().map_err(|e| ChaosError(format!("restarting the database: {e}")))?;
            database_restarts += 1;
            released += release_claims(&db, policy)?;
        }
    }
    for w in workers {
        w.join().map_err(|_| ChaosError("a client thread panicked".into()))?;
    }
    unsafe { libc::kill(server.child.id() as i32, libc::SIGTERM) };
    let _ = server.child.wait();

    let intents = std::mem::take(&mut *intents.lock().unwrap_or_else(|e| e.into_inner()));
    let summary = verdict(&db, &intents, &accounts, &proxy, [kills, database_restarts, released], &config)?;
    drop(proxy);
    super::day::write_file(&config.out.join("chaos.json"), &super::day::to_json(&summary)?)?;
    super::day::write_file(&config.out.join("chaos_report.md"), &report(&summary))?;
    Ok(summary)
}

/// Reads the transfer table and the balances and judges the day.
fn verdict(
    db: &Db,
    intents: &[Intent],
    accounts: &[bank::Account],
    proxy: &Proxy,
    [kills, database_restarts, released]: [usize; 3],
    config: &Config,
) -> Result<Summary, ChaosError> {
    let (transfers, balances) = bank::ledger(db)?;
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
    for i in intents {
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
            database: match ids(i.amount).len() {
                0 => "not out".into(),
                1 => "went out once".into(),
                n => format!("went out {n} times"),
            },
        })
        .collect();
    // Conservation, and each balance exactly what the transfers made of it.
    let mut want: BTreeMap<String, i64> = accounts.iter().map(|a| (a.id.clone(), a.balance)).collect();
    for t in &transfers {
        *want.entry(t.src.clone()).or_insert(0) -= t.amount;
        *want.entry(t.dst.clone()).or_insert(0) += t.amount;
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
    let counts = &proxy.counts;
    let load = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
    let attempts: Vec<u32> = intents.iter().map(|i| i.attempts).collect();
    Ok(Summary {
        seed: config.seed,
        clients: config.clients,
        transfers_intended: intents.len(),
        requests_sent: load(&counts.requests),
        attempts_per_transfer_mean: (attempts.iter().sum::<u32>() as f64 / attempts.len().max(1) as f64
            * 100.0)
            .round()
            / 100.0,
        attempts_per_transfer_max: attempts.iter().copied().max().unwrap_or(0),
        requests_dropped: load(&counts.dropped_requests),
        responses_dropped: load(&counts.dropped_responses),
        responses_cut: load(&counts.cut_responses),
        requests_delayed: load(&counts.delayed),
        requests_duplicated: load(&counts.duplicated),
        requests_unreachable: load(&counts.unreachable),
        server_kills: kills,
        database_restarts,
        claims_released_after_kills: released,
        outcomes_unknown: unknown.len(),
        transfers_made: transfers.len(),
        transfers_paid_twice: paid_twice,
        transfers_lost: lost,
        transfers_unintended: unintended,
        answers_misattributed: misattributed,
        balances_conserved: balances.values().sum::<i64>() == accounts.iter().map(|a| a.balance).sum::<i64>()
            && balances == want,
        time_to_certainty_ms_p50: percentile(50),
        time_to_certainty_ms_p99: percentile(99),
        unknown,
    })
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
        ("server kills (SIGKILL) and restarts", s.server_kills as u64),
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
    if !s.unknown.is_empty() {
        md.push_str("\n| client | key | what the database says |\n|---:|---|---|\n");
        for u in &s.unknown {
            md.push_str(&format!("| {} | `{}` | {} |\n", u.client, u.key, u.database));
        }
    }
    md
}
