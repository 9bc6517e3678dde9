//! `idem chaos`: a day of clients through a lossy network to real servers
//! that are killed, failed over and restarted.

use crate::common::{Failure, db, own_path, seed_or_clock};
use idem::clock;
use idem::harness::chaos::{self, Summary};
use idem::policy::Policy;
use idem::store::Db;
use std::os::fd::AsFd;
use std::path::PathBuf;

/// A day of concurrent clients through a lossy network to a real idem serve, killed mid-day.
///
/// Each client sends its own transfers with the retrying client, through
/// a fault-injecting proxy (dropped requests and answers, cut answers,
/// delays, duplicates); the server is SIGKILLed and restarted --kills
/// times (and the database restarted by --restart-db). With --instances
/// N, N servers share the database and each client tries them in turn;
/// --failover N runs N faults of a replicated PostgreSQL (--fault: its
/// primary killed or paused, its synchronous standby killed, its etcd's
/// quorum lost, a switchover, the primary partitioned; mix: each in turn), and the clients go on
/// until the last is repaired. The verdict, from the database and the clients'
/// logs, goes to DIR/chaos.json and DIR/chaos_report.md; exit 1 if
/// anything went out twice or was lost, or a key was left claimed.
#[derive(clap::Args, Debug)]
pub struct Chaos {
    #[arg(long, default_value = "out/chaos")]
    out: PathBuf,
    /// Seeds the fault plan and the clients (default: the clock; printed).
    #[arg(long)]
    seed: Option<u64>,
    /// An empty PostgreSQL database (default: a new SQLite file in DIR).
    #[arg(long, value_parser = db)]
    db: Option<Db>,
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u16).range(1..=512))]
    clients: u16,
    /// Transfers per client.
    #[arg(long, default_value_t = 25, value_parser = clap::value_parser!(u32).range(1..))]
    transfers: u32,
    /// Server kills (default: 2 with one instance, else 0).
    #[arg(long)]
    kills: Option<u16>,
    /// Servers running at once on the one database.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=16))]
    instances: u16,
    /// How many faults of the replicated database (--fault), spaced over
    /// the day; the day lasts until the last is repaired.
    #[arg(long, default_value_t = 0)]
    failover: u16,
    /// Which fault: kill, pause, standby, etcd, switchover, partition, or mix (each in turn).
    #[arg(
        long,
        default_value = "kill",
        value_parser = ["kill", "pause", "standby", "etcd", "switchover", "partition", "mix"]
    )]
    fault: String,
    /// Puts a fault in place and returns; `{fault}` is replaced by its kind.
    #[arg(long, value_name = "CMD", default_value = "tools/pg-ha inject {fault}")]
    failover_cmd: String,
    /// Then runs until the cluster is whole again (a primary, every node replicating).
    #[arg(long, value_name = "CMD", default_value = "tools/pg-ha repair")]
    heal_cmd: String,
    /// With --failover: prints which node is the primary (`none` if no
    /// node takes writes), sampled twice a second for the timeline.
    #[arg(long, value_name = "CMD", default_value = "tools/pg-ha primary-node")]
    primary_cmd: String,
    /// The server command (default: this binary's `serve`); --db, --listen, --clients are appended.
    #[arg(long, value_name = "CMD")]
    serve: Option<String>,
    /// A command that restarts the database once, half way (e.g. `tools/pg-local restart`).
    #[arg(long, value_name = "CMD")]
    restart_db: Option<String>,
    /// Each client's time budget per transfer.
    #[arg(long, default_value = "20s", value_parser = clock::parse_duration)]
    budget: std::time::Duration,
    /// Each client's pause between two transfers, to stretch the day.
    #[arg(long, default_value = "0ms", value_parser = clock::parse_duration)]
    think: std::time::Duration,
    /// Every fourth intent is a payout through an `idem gateway` that
    /// loses 5% of requests, drops 10% of answers, answers 5% with 500
    /// and is slow on 5% (2 s, past idem's 1 s timeout); the verdict
    /// reads its ledger too.
    #[arg(long)]
    payouts: bool,
}

/// The faults `--payouts` sets on its `idem gateway`, as its flags.
const GATEWAY_FAULTS: [&str; 20] = [
    "--lose-request",
    "5",
    "--drop-answer",
    "10",
    "--error-5xx",
    "5",
    "--slow",
    "5",
    "--refuse-4xx",
    "3",
    "--poison",
    "3",
    "--returns",
    "10",
    "--return-after",
    "1s",
    "--event-loss",
    "10",
    "--event-dup",
    "20",
];

pub fn chaos(args: Chaos, policy: &Policy) -> Result<(), Failure> {
    let seed = seed_or_clock(args.seed);
    let me = own_path()?.to_string_lossy().into_owned();
    let serve = match args.serve {
        Some(cmd) => cmd.split_whitespace().map(String::from).collect(),
        None => vec![me.clone(), "serve".into()],
    };
    let gateway = args.payouts.then(|| {
        let head =
            [me.as_str(), "gateway", "--slow-for", "2s", "--seed", &seed.to_string()].map(String::from);
        head.into_iter().chain(GATEWAY_FAULTS.map(String::from)).collect()
    });
    let failovers = usize::from(args.failover);
    let config = chaos::Config {
        out: args.out.clone(),
        seed,
        db: args.db,
        clients: usize::from(args.clients),
        transfers: args.transfers as usize,
        serve,
        instances: usize::from(args.instances),
        kills: args.kills.map(usize::from),
        restart_db: args.restart_db.map(shell),
        failovers,
        faults: db_faults(&args.fault, &args.failover_cmd, &args.heal_cmd),
        primary: (failovers > 0).then(|| probe(args.primary_cmd)),
        budget: args.budget,
        think: args.think,
        odds: idem::outside::proxy::Odds::default(),
        gateway,
    };
    let s = chaos::run(config, policy)?;
    print_summary(seed, &s);
    say!("wrote {}", args.out.join("chaos.json").display());
    say!("wrote {}", args.out.join("chaos_report.md").display());
    if !s.exactly_once() {
        return Err(Failure("NOT exactly once: see chaos_report.md".into()));
    }
    if !s.passed() {
        return Err(Failure(format!("{} keys left claimed: see chaos_report.md", s.keys_left_claimed)));
    }
    Ok(())
}

/// The faults `--fault` names, each with its commands.
fn db_faults(fault: &str, inject: &str, repair: &str) -> Vec<chaos::DbFault> {
    chaos::DB_FAULTS
        .iter()
        .filter(|(kind, _)| fault == "mix" || fault == *kind)
        .map(|(kind, label)| chaos::DbFault {
            kind: label,
            inject: shell(inject.replace("{fault}", kind)),
            repair: shell(repair.to_owned()),
        })
        .collect()
}

/// A command run by `sh -c` whose first line of output is the answer; a
/// failure is `none`.
fn probe(cmd: String) -> chaos::Probe {
    Box::new(move || match std::process::Command::new("sh").args(["-c", &cmd]).output() {
        Ok(out) if out.status.success() => {
            String::from_utf8_lossy(&out.stdout).lines().next().unwrap_or("none").trim().to_owned()
        }
        _ => "none".into(),
    })
}

/// A command run by `sh -c`; its output goes to stderr, since stdout is
/// the day's summary.
fn shell(cmd: String) -> chaos::Command {
    Box::new(move || {
        let stdout = std::io::stderr().as_fd().try_clone_to_owned().map_err(|e| e.to_string())?;
        match std::process::Command::new("sh").args(["-c", &cmd]).stdout(stdout).status() {
            Ok(s) if s.success() => Ok(()),
            other => Err(format!("{cmd}: {other:?}")),
        }
    })
}

fn print_summary(seed: u64, s: &Summary) {
    say!(
        "seed {seed}: {} transfers intended, {} made; paid twice {}, lost {}, unintended {}; \
         {} requests, {} dropped, {} answers dropped, {} cut, {} duplicated; {} kills, {} faults of the database \
         ({} not run: the day had ended); {} unknown, {} keys left claimed",
        s.transfers_intended,
        s.transfers_made,
        s.transfers_paid_twice,
        s.transfers_lost,
        s.transfers_unintended,
        s.requests_sent,
        s.requests_dropped,
        s.responses_dropped,
        s.responses_cut,
        s.requests_duplicated,
        s.server_kills,
        s.failovers.len(),
        s.failovers_not_run,
        s.outcomes_unknown,
        s.keys_left_claimed
    );
    for f in &s.failovers {
        say!(
            "{} at {} ms: writes stopped for {}, {} answered 503, {} commits whose answer was lost found by the retry",
            f.kind,
            f.at_ms,
            f.writes_unavailable_ms.map_or("(not resumed before the next)".into(), |ms| format!("{ms} ms")),
            f.answered_503,
            f.acks_lost_found_by_retry
        );
    }
    if let Some(p) = &s.payouts {
        say!(
            "payouts: {} intended, {} completed, {} failed, {} returned after paid ({} at the gateway), \
             {} left for a person; sends per payout median {} max {}; made twice {}, \
             paid twice at the gateway {}, at the gateway without an intent {}, told paid but not paid {}, \
             disagreements {}; {} settled by a reconciliation",
            p.intended,
            p.completed,
            p.failed,
            p.returned,
            p.returned_at_gateway,
            p.left_for_a_person.len(),
            p.sends_median,
            p.sends_max,
            p.made_twice,
            p.paid_twice_at_gateway,
            p.at_gateway_without_intent,
            p.told_but_not_paid,
            p.disagreements,
            p.settled_by_reconciliation
        );
    }
}
