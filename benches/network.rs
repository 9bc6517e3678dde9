//! `cargo bench --bench network` (or `just bench-network`): `idem serve` on
//! a PostgreSQL that is a network hop away, against what PostgreSQL itself
//! allows for the same work in one round trip, measured in the same run.
//!
//! The hop is `idem::outside::hop`: a TCP proxy that holds every chunk, in
//! each direction, for half the round trip before passing it on (the
//! machine has no `tc netem`). At 0, 0.5, 1 and 2 ms round trip, for a hot account pair
//! (every transfer between the same two accounts) and for 100 accounts:
//! - **idem**: `idem serve --pool 64` through the proxy, 64 keep-alive HTTP
//!   connections posting new transfers; new transfers per second, p50/p99,
//!   idem's own CPU per transfer (user + system of the server process), and
//!   the statements it sent to PostgreSQL per transfer (chunks the proxy
//!   carried towards the server: one per round trip). After each run the
//!   ledger is checked: transfers = fresh 201s, money conserved.
//! - **limit**: pgbench with 64 clients through the same proxy, each
//!   transaction one call of a PL/pgSQL function that does a transfer's
//!   whole work (insert the key, lock both accounts in order, check and move
//!   the money, insert the transfer, complete the key) in one round trip.
//!
//! Needs `IDEM_BENCH_PG=<conninfo>` of an empty database (the recipe makes
//! one on a local cluster). `IDEM_BENCH_SECONDS` sets each run's length
//! (default 3; the documented run uses 8), `IDEM_BENCH_BIN` another idem
//! binary to measure (an older build, for a before/after),
//! `IDEM_BENCH_ROUND_TRIPS` the round trips to run, in ms (`1` or
//! `0,1`; default all four).

mod support;

use idem::outside::hop::Hop;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};
use support::*;

const CLIENTS: usize = 64;
/// Numbers each client's run, so that no key is used twice in one bench.
static RUNS: AtomicU64 = AtomicU64::new(0);
const ACCOUNTS: usize = 100;
const OPENING: i64 = 1_000_000_000_000;
/// Round trips to test, in milliseconds.
const ROUND_TRIPS_MS: [f64; 4] = [0.0, 0.5, 1.0, 2.0];

#[derive(Clone, Copy, PartialEq)]
enum Spread {
    HotPair,
    Accounts100,
}

impl Spread {
    fn name(self) -> &'static str {
        match self {
            Spread::HotPair => "hot pair",
            Spread::Accounts100 => "100 accounts",
        }
    }

    /// The accounts of the `i`-th transfer of a client, by a seeded draw.
    fn pair(self, rng: &mut idem::rng::Rng) -> (usize, usize) {
        match self {
            Spread::HotPair => match rng.below(2) {
                0 => (0, 1),
                _ => (1, 0),
            },
            Spread::Accounts100 => {
                let src = rng.below(ACCOUNTS as u64) as usize;
                (src, (src + 1 + rng.below(ACCOUNTS as u64 - 1) as usize) % ACCOUNTS)
            }
        }
    }
}

/// One run's figures.
struct Run {
    per_second: f64,
    p50_ms: f64,
    p99_ms: f64,
    /// idem only: CPU microseconds per transfer, and chunks sent to the
    /// server per transfer.
    cpu_us: Option<f64>,
    /// PostgreSQL's CPU microseconds per transfer (every backend's and the
    /// postmaster's), and the share of the machine's CPU busy, in %.
    pg: (Option<f64>, f64),
    sends: Option<f64>,
    /// idem with batching: the mean claims and executions a batch carried.
    batch: Option<(f64, f64)>,
}

/// `idem serve` through the hop: 64 connections post new transfers.
fn idem(bin: &str, conninfo: &str, hop: &Hop, spread: Spread, dir: &std::path::Path) -> Run {
    let db = idem::store::Db::parse(conninfo);
    let extra = std::env::var("IDEM_BENCH_SERVE_ARGS").unwrap_or_default();
    let server = Server::start_bin(bin, conninfo, dir, &extra.split_whitespace().collect::<Vec<_>>());
    // after the start: the server makes its tables
    let before = idem::store::bank::ledger(&db).unwrap().0.len();
    let barrier = Arc::new(Barrier::new(CLIENTS + 1));
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (address, barrier, stop) = (server.address.clone(), barrier.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut conn = Conn::open(&address);
                let mut rng = idem::rng::Rng::new(c as u64 + 7);
                let (mut latencies, mut fresh, mut other) = (Vec::new(), 0usize, 0usize);
                let run = RUNS.fetch_add(1, Ordering::Relaxed);
                barrier.wait();
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    let (s, d) = spread.pair(&mut rng);
                    let body = format!(r#"{{"src":"a{s}","dst":"a{d}","amount":1,"currency":"KRW"}}"#);
                    let started = Instant::now();
                    let (status, replayed, _) = conn.post(&format!("{run}-{c}-{i}"), &body);
                    latencies.push(started.elapsed().as_micros().min(u128::from(u32::MAX)) as u32);
                    match (status, replayed) {
                        (201, false) => fresh += 1,
                        _ => other += 1,
                    }
                }
                (latencies, fresh, other)
            })
        })
        .collect();
    barrier.wait();
    let (cpu_before, sends_before) = (server.cpu("").0, hop.to_server.load(Ordering::Relaxed));
    let usage = Usage::start(conninfo);
    let started = Instant::now();
    std::thread::sleep(seconds());
    let usage = usage.stop();
    stop.store(true, Ordering::Relaxed);
    let (mut latencies, mut fresh, mut other) = (Vec::new(), 0, 0);
    for w in workers {
        let (l, f, o) = w.join().unwrap();
        latencies.extend(l);
        fresh += f;
        other += o;
    }
    let elapsed = started.elapsed();
    let cpu = server.cpu("").0 - cpu_before;
    let sends = hop.to_server.load(Ordering::Relaxed) - sends_before;
    // over the whole server's life: the start's few requests are noise
    let mean = |kind: &str| {
        let carried = metric(&server.address, &format!("idem_pg_batched_total{{kind=\"{kind}\"}}"))?;
        Some(carried / metric(&server.address, &format!("idem_pg_batches_total{{kind=\"{kind}\"}}"))?)
    };
    let batch = mean("claim").zip(mean("execution"));
    if std::env::var_os("IDEM_BENCH_LANES").is_some() {
        let busy =
            |kind: &str| metric(&server.address, &format!("idem_pg_batch_seconds_total{{kind=\"{kind}\"}}"));
        eprintln!(
            "lanes out: claims {:?} s, executions {:?} s, over {elapsed:?}",
            busy("claim"),
            busy("execution")
        );
    }
    drop(server);
    assert_eq!(other, 0, "answers other than a fresh 201");
    let (transfers, balances) = idem::store::bank::ledger(&db).unwrap();
    assert_eq!(transfers.len() - before, fresh, "transfers differ from the fresh 201s");
    assert_eq!(balances.values().sum::<i64>(), ACCOUNTS as i64 * OPENING, "money not conserved");
    latencies.sort_unstable();
    Run {
        per_second: fresh as f64 / elapsed.as_secs_f64(),
        p50_ms: percentile(&latencies, 0.5),
        p99_ms: percentile(&latencies, 0.99),
        cpu_us: Some(cpu.as_secs_f64() * 1e6 / fresh.max(1) as f64),
        sends: Some(sends as f64 / fresh.max(1) as f64),
        pg: usage.per(fresh),
        batch,
    }
}

/// The function the limit calls: a transfer's whole work, in one call.
const LIMIT_SQL: &str = "
CREATE TABLE IF NOT EXISTS limit_key (client_id text, endpoint text, idem_key text, fingerprint text,
    state text, body text, transfer_id bigint, PRIMARY KEY (client_id, endpoint, idem_key));
CREATE TABLE IF NOT EXISTS limit_transfer (transfer_id bigserial PRIMARY KEY, src text, dst text,
    amount bigint, currency text, created_at text);
CREATE OR REPLACE FUNCTION limit_transfer(k text, s text, d text, amt bigint) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE id bigint; b bigint;
BEGIN
  INSERT INTO limit_key VALUES ('bench', '/v1/transfers', k, 'fp', 'in_progress', NULL, NULL);
  PERFORM 1 FROM account WHERE acct_id IN (s, d) ORDER BY acct_id FOR UPDATE;
  SELECT balance INTO b FROM account WHERE acct_id = s;
  IF b < amt THEN RAISE EXCEPTION 'insufficient funds'; END IF;
  UPDATE account SET balance = balance - amt WHERE acct_id = s;
  UPDATE account SET balance = balance + amt WHERE acct_id = d;
  INSERT INTO limit_transfer (src, dst, amount, currency, created_at)
    VALUES (s, d, amt, 'KRW', now()::text) RETURNING transfer_id INTO id;
  UPDATE limit_key SET state = 'completed', body = '{\"transfer_id\":' || id || '}', transfer_id = id
    WHERE client_id = 'bench' AND endpoint = '/v1/transfers' AND idem_key = k;
  RETURN id;
END $$;";

/// pgbench through the hop, 64 clients calling the function.
fn limit(conninfo: &str, spread: Spread, dir: &std::path::Path) -> Run {
    let pgbench = pgbench_bin().expect("pgbench (apt-get install postgresql-client)");
    let pick = match spread {
        Spread::HotPair => "\\set s random(0, 1)\n\\set d 1 - :s\n".to_owned(),
        Spread::Accounts100 => format!(
            "\\set s random(0, {last})\n\\set d (:s + random(1, {last})) % {ACCOUNTS}\n",
            last = ACCOUNTS - 1
        ),
    };
    let script = dir.join("limit.sql");
    std::fs::write(
        &script,
        format!(
            "\\set k random(1, 1000000000000000)\n{pick}\
             SELECT limit_transfer(:client_id || '-' || :k, 'a' || :s, 'a' || :d, 1);\n"
        ),
    )
    .unwrap();
    let logs = tempfile::tempdir().unwrap();
    let usage = Usage::start(conninfo);
    let out = Command::new(pgbench)
        .current_dir(logs.path())
        .args(["-n", "-l", "-f"])
        .arg(&script)
        .args(["-c", &CLIENTS.to_string(), "-j", "2", "-T", &seconds().as_secs().max(1).to_string()])
        .arg(conninfo)
        .output()
        .unwrap();
    let usage = usage.stop();
    let text = String::from_utf8_lossy(&out.stdout);
    let tps = text
        .lines()
        .find(|l| l.starts_with("tps = "))
        .and_then(|l| l.split_whitespace().nth(2)?.parse().ok());
    let Some(tps) = tps else { panic!("pgbench failed: {text}{}", String::from_utf8_lossy(&out.stderr)) };
    // per-transaction logs: client, transaction, latency in µs, …
    let mut latencies: Vec<u32> = std::fs::read_dir(logs.path())
        .unwrap()
        .flatten()
        .flat_map(|f| {
            std::fs::read_to_string(f.path())
                .unwrap_or_default()
                .lines()
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .filter_map(|l| l.split_whitespace().nth(2)?.parse().ok())
        .collect();
    latencies.sort_unstable();
    Run {
        per_second: tps,
        p50_ms: percentile(&latencies, 0.5),
        p99_ms: percentile(&latencies, 0.99),
        cpu_us: None,
        sends: None,
        // pgbench's connecting and its tail are inside the window: a little high
        pg: usage.per((tps * seconds().as_secs().max(1) as f64) as usize),
        batch: None,
    }
}

fn micros(us: Option<f64>) -> String {
    us.map_or("not local".into(), |us| format!("{us:.0}"))
}

/// PostgreSQL's CPU and the machine's over one window; PostgreSQL's only
/// when it runs on this machine (its backend's parent found in `/proc`).
struct Usage {
    postmaster: Option<u32>,
    at: (u64, u64, u64),
}

impl Usage {
    fn start(conninfo: &str) -> Usage {
        let mut client = postgres::Client::connect(conninfo, postgres::NoTls).unwrap();
        let backend: i32 = client.query_one("SELECT pg_backend_pid()", &[]).unwrap().get(0);
        let postmaster = stat(backend as u32).map(|f| f[1]);
        let postmaster = postmaster.filter(|&p| p > 1).map(|p| p as u32);
        Usage { postmaster, at: Usage::now(postmaster) }
    }

    /// (PostgreSQL's ticks, the machine's busy ticks, its total ticks).
    fn now(postmaster: Option<u32>) -> (u64, u64, u64) {
        let pg = postmaster.map_or(0, |pm| {
            let own = stat(pm).map_or(0, |f| f[11] + f[12] + f[13] + f[14]);
            let children = std::fs::read_dir("/proc").into_iter().flatten().flatten();
            own + children
                .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
                .filter_map(stat)
                .filter(|f| f[1] == u64::from(pm))
                .map(|f| f[11] + f[12])
                .sum::<u64>()
        });
        let line = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        let cpu: Vec<u64> = line
            .lines()
            .next()
            .unwrap_or("")
            .split_whitespace()
            .skip(1)
            .take(8)
            .flat_map(str::parse)
            .collect();
        let total = cpu.iter().sum::<u64>();
        // idle and iowait
        let idle = cpu.get(3).copied().unwrap_or(0) + cpu.get(4).copied().unwrap_or(0);
        (pg, total - idle, total)
    }

    fn stop(self) -> Usage {
        let now = Usage::now(self.postmaster);
        Usage { postmaster: self.postmaster, at: (now.0 - self.at.0, now.1 - self.at.1, now.2 - self.at.2) }
    }

    /// PostgreSQL's CPU µs per transfer (None when not measured) and the
    /// machine's busy share in %, of a stopped window.
    fn per(&self, transfers: usize) -> (Option<f64>, f64) {
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        let pg = self.postmaster.map(|_| self.at.0 as f64 * 1e6 / hz / transfers.max(1) as f64);
        (pg, self.at.1 as f64 * 100.0 / self.at.2.max(1) as f64)
    }
}

/// /proc/PID/stat's fields ([`stat_fields`]).
fn stat(pid: u32) -> Option<Vec<u64>> {
    stat_fields(std::path::Path::new(&format!("/proc/{pid}/stat")))
}

/// The median round trip of `SELECT 1` through the hop, in milliseconds.
fn measured_round_trip(conninfo: &str) -> f64 {
    let mut client = postgres::Client::connect(conninfo, postgres::NoTls).unwrap();
    let mut times: Vec<u32> = (0..200)
        .map(|_| {
            let started = Instant::now();
            client.simple_query("SELECT 1").unwrap();
            started.elapsed().as_micros() as u32
        })
        .collect();
    times.sort_unstable();
    percentile(&times, 0.5)
}

fn main() {
    let Ok(direct) = std::env::var("IDEM_BENCH_PG") else {
        println!("network bench: set IDEM_BENCH_PG=<conninfo of an empty database> (`just bench-network`)");
        return;
    };
    let bin = std::env::var("IDEM_BENCH_BIN").unwrap_or_else(|_| IDEM.to_owned());
    let db = idem::store::Db::parse(&direct);
    let accounts: Vec<_> = (0..ACCOUNTS)
        .map(|i| idem::store::bank::Account { id: format!("a{i}"), holder: "h".into(), balance: OPENING })
        .collect();
    idem::store::bank::create(&db, &accounts).unwrap();
    postgres::Client::connect(&direct, postgres::NoTls).unwrap().batch_execute(LIMIT_SQL).unwrap();
    let dir = tempfile::tempdir().unwrap();

    println!("idem serve on PostgreSQL across a delayed hop, {CLIENTS} connections, {:?} a run", seconds());
    println!(
        "\n| round trip (set / measured) | accounts | idem new/s | p50 / p99 ms | limit tps | p50 / p99 ms | idem / limit | idem CPU µs per transfer | idem sends per transfer | mean batch (claims / executions) | PostgreSQL CPU µs per transfer (idem / limit) | machine busy % (idem / limit) |\n\
         |---|---|---:|---|---:|---|---:|---:|---:|---|---|---|"
    );
    let round_trips: Vec<f64> = match std::env::var("IDEM_BENCH_ROUND_TRIPS") {
        Ok(list) => list.split(',').filter_map(|ms| ms.trim().parse().ok()).collect(),
        Err(_) => ROUND_TRIPS_MS.to_vec(),
    };
    for rtt_ms in round_trips {
        let (hop, conninfo) = Hop::to_postgres(&direct, Duration::from_secs_f64(rtt_ms / 1000.0)).unwrap();
        let measured = measured_round_trip(&conninfo);
        for spread in [Spread::HotPair, Spread::Accounts100] {
            let ours = idem(&bin, &conninfo, &hop, spread, dir.path());
            let bound = limit(&conninfo, spread, dir.path());
            println!(
                "| {rtt_ms} ms / {measured:.2} ms | {} | {:.0} | {:.1} / {:.1} | {:.0} | {:.1} / {:.1} | {:.2}× | {:.0} | {:.1} | {} | {} / {} | {:.0} / {:.0} |",
                spread.name(),
                ours.per_second,
                ours.p50_ms,
                ours.p99_ms,
                bound.per_second,
                bound.p50_ms,
                bound.p99_ms,
                ours.per_second / bound.per_second,
                ours.cpu_us.unwrap_or(0.0),
                ours.sends.unwrap_or(0.0),
                ours.batch.map_or("none".into(), |(c, x)| format!("{c:.1} / {x:.1}")),
                micros(ours.pg.0),
                micros(bound.pg.0),
                ours.pg.1,
                bound.pg.1,
            );
        }
    }
}
