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
//! verdict judge a deliberately broken server (see `tests/service/chaos.rs`).

mod clients;
mod payouts;
mod receiver;
mod report;
mod room;
mod timeline;
mod verdict;

pub use clients::{Ending, Intent, Kind};
pub use payouts::PayoutVerdict;
pub use verdict::{DB_FAULTS, Failover, Summary, Unknown};

use super::HarnessError;
use super::files::{io_at, to_json, write_file};
use crate::outside::proxy::Odds;
use crate::policy::Policy;
use crate::store::{Db, bank};
use clients::Clients;
use room::Room;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use verdict::Tally;

/// An action of the machine room, run from the day's own thread.
pub type Command = Box<dyn Fn() -> Result<(), String> + Send + Sync>;

/// Which node is the replicated database's primary now (`none`: no node
/// takes writes): sampled twice a second for the timeline.
pub type Probe = Box<dyn Fn() -> String + Send>;

/// A fault of a replicated database: `inject` returns once it is in place,
/// `repair` once the cluster is whole again. `kind` names it in the
/// report and on the timeline (`verdict::DB_FAULTS`).
pub struct DbFault {
    pub kind: &'static str,
    pub inject: Command,
    pub repair: Command,
}

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
    /// Faults of a replicated database, this many, spaced over the day,
    /// each once the cluster is whole again after the last and the clients
    /// have each ended an intent since; fault `k` is `faults[k % len]`.
    /// While some are left, the clients go on past `transfers`: the day
    /// lasts as long as its faults need.
    pub failovers: usize,
    pub faults: Vec<DbFault>,
    pub primary: Option<Probe>,
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

/// The day. Writes `chaos.json` and `chaos_report.md` into `config.out`.
pub fn run(mut config: Config, policy: &Policy) -> Result<Summary, HarnessError> {
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
    std::fs::create_dir_all(&config.out).map_err(io_at(&config.out))?;
    let (db, accounts) = open_bank(&config)?;
    let (clients_file, tokens) = write_clients(&config)?;
    let mut room = Room::open(&config, &db, clients_file)?;
    let day_started = Instant::now();
    let sampler = config.primary.take().map(Sampler::start);
    let urls: Vec<String> = room.proxies.iter().map(|p| p.url()).collect();
    let faults_left = config.failovers > 0 && !config.faults.is_empty();
    let clients = Clients::start(&config, &urls, &tokens, room.gateway.is_some(), faults_left);
    let tally = machine_room(&config, &mut room, &clients, planned_kills, policy);
    clients.more.store(false, Ordering::Relaxed);
    let tally = tally?;
    for w in clients.workers {
        w.join().map_err(|_| HarnessError::Stopped("a client thread panicked".into()))?;
    }
    let day_ended = Instant::now();
    let primaries: Vec<(f64, String)> = sampler
        .map(Sampler::stop)
        .unwrap_or_default()
        .into_iter()
        .map(|(at, node)| (at.saturating_duration_since(day_started).as_secs_f64(), node))
        .collect();
    room.stop_servers();

    let intents = std::mem::take(&mut *clients.intents.lock().unwrap_or_else(|e| e.into_inner()));
    let payout_verdict = match (room.gateway.take(), room.receiver.take()) {
        (Some(gw), Some(receiver)) => {
            let told = (&receiver, config.clients);
            Some(payouts::settle_payouts(&db, gw, told, &intents, &room.log, policy)?)
        }
        _ => None,
    };
    let day = (day_started, day_ended);
    let summary = verdict::verdict(&db, &intents, &accounts, &room.proxies, &tally, &config, day)?;
    let summary =
        Summary { keys_left_claimed: room::claims_left(&db, policy)?, payouts: payout_verdict, ..summary };
    drop(room);
    write_file(&config.out.join("chaos.json"), &to_json(&summary)?)?;
    let marks: Vec<(f64, &str)> = tally
        .marks
        .iter()
        .map(|(at, what)| (at.saturating_duration_since(day_started).as_secs_f64(), *what))
        .collect();
    let series = timeline::series(&intents, day_started, day_ended);
    write_file(&config.out.join("chaos_timeline.svg"), &timeline::svg(&series, &marks, &primaries))?;
    write_file(&config.out.join("chaos_report.md"), &report::report(&summary))?;
    Ok(summary)
}

/// Samples a probe twice a second on a thread of its own until stopped.
struct Sampler {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<Vec<(Instant, String)>>,
}

impl Sampler {
    fn start(probe: Probe) -> Sampler {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let done = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut samples = Vec::new();
            while !done.load(Ordering::Relaxed) {
                let at = Instant::now();
                samples.push((at, probe()));
                std::thread::sleep(Duration::from_millis(500).saturating_sub(at.elapsed()));
            }
            samples
        });
        Sampler { stop, thread }
    }

    fn stop(self) -> Vec<(Instant, String)> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().unwrap_or_default()
    }
}

/// The day's bank: `config.db`, or a new SQLite file in `config.out`.
fn open_bank(config: &Config) -> Result<(Db, Vec<bank::Account>), HarnessError> {
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
    Ok((db, accounts))
}

/// The servers' clients file, a token per client; and the tokens.
fn write_clients(config: &Config) -> Result<(PathBuf, Vec<String>), HarnessError> {
    let file = config.out.join("clients.json");
    let tokens: Vec<String> = (0..config.clients).map(|c| format!("tok-chaos-{}-{c}", config.seed)).collect();
    let map: BTreeMap<&str, String> =
        tokens.iter().enumerate().map(|(c, t)| (t.as_str(), format!("chaos-{c}"))).collect();
    std::fs::write(&file, serde_json::to_string(&map)?).map_err(io_at(&file))?;
    Ok((file, tokens))
}

/// The faults of the machine room, evenly spaced over the day (by the
/// intents ended so far): server kills, failovers, and the database
/// restart half way.
fn machine_room(
    config: &Config,
    room: &mut Room,
    clients: &Clients,
    planned_kills: usize,
    policy: &Policy,
) -> Result<Tally, HarnessError> {
    #[derive(PartialEq, Eq, PartialOrd, Ord)]
    enum Fault {
        Kill,
        Failover,
        RestartDb,
    }
    let total = config.clients * config.transfers;
    let spaced = |n: usize, fault: fn() -> Fault| (1..=n).map(move |k| (total * k / (n + 1), fault()));
    let db_faults = if config.faults.is_empty() { 0 } else { config.failovers };
    let mut faults: Vec<(usize, Fault)> = spaced(planned_kills, || Fault::Kill)
        .chain(spaced(db_faults, || Fault::Failover))
        .chain(spaced(usize::from(config.restart_db.is_some()), || Fault::RestartDb))
        .collect();
    faults.sort();
    let mut tally =
        Tally { kills: 0, database_restarts: 0, released: 0, failovers_not_run: 0, marks: Vec::new() };
    let (mut db_faults_run, mut not_before) = (0, 0);
    for (at, fault) in faults {
        while clients.settled.load(Ordering::Relaxed) < at.max(not_before).max(1) && !clients.finished() {
            std::thread::sleep(Duration::from_millis(5));
        }
        let db_fault = config.faults.get(db_faults_run % config.faults.len().max(1));
        match (fault, &config.restart_db, db_fault) {
            (Fault::Kill, _, _) => {
                tally.marks.push((Instant::now(), verdict::SERVER_KILLED));
                tally.released += room.kill(tally.kills % config.instances, policy)?;
                tally.kills += 1;
            }
            (Fault::RestartDb, Some(restart), _) => {
                tally.marks.push((Instant::now(), verdict::DATABASE_RESTARTED));
                restart().map_err(|e| HarnessError::Stopped(format!("restarting the database: {e}")))?;
                tally.database_restarts += 1;
                tally.released += room.release_claims(policy)?;
            }
            // No release here: the services themselves must free what the
            // failover interrupted, or the verdict counts the keys blocked.
            // A failover after the last transfer would measure nothing.
            (Fault::Failover, _, Some(_)) if clients.finished() => tally.failovers_not_run += 1,
            (Fault::Failover, _, Some(f)) => {
                // marked as it begins: a switchover's disruption is inside it
                let kind = f.kind;
                tally.marks.push((Instant::now(), kind));
                (f.inject)().map_err(|e| HarnessError::Stopped(format!("{kind}: {e}")))?;
                (f.repair)().map_err(|e| HarnessError::Stopped(format!("after {kind}: {e}")))?;
                db_faults_run += 1;
                // the next fault after some traffic on the whole cluster:
                // an intent ended by each client
                not_before = clients.settled.load(Ordering::Relaxed) + config.clients;
            }
            _ => {}
        }
    }
    Ok(tally)
}
