//! `cargo bench --bench serve` (or `just bench-serve`): a real `idem serve`
//! on loopback under a load generator in this file (keep-alive HTTP/1.1
//! connections, one thread each), at 1, 8, 64 and 256 connections, and the
//! limits measured in the same run.
//!
//! For each connection count: new transfers per second with p50 / p99 /
//! max latency, replays per second, and a realistic mix (10% retries, 1%
//! retries with the amount changed). After every run the database is
//! checked: transfers must equal the distinct keys that got a fresh 201, and
//! the balances must be conserved; a fast wrong answer fails the bench.
//!
//! Limits: the disk's fsync rate; on PostgreSQL (`IDEM_BENCH_PG=<conninfo>`
//! of an empty database, or `just bench-serve-pg`), pgbench running the
//! same two transactions (claim, then the fenced execution) at the same
//! client counts. Then: peak RSS of the server, growth (request cost with
//! 10^4 and `IDEM_BENCH_KEYS` keys, default 10^6), the retention purge's
//! longest batch, and with `IDEM_BENCH_SOAK=<seconds>` a memory soak.
//! `IDEM_BENCH_SECONDS` sets each phase's length (default 3).
//!
//! Two other modes instead of the tables: `IDEM_BENCH_BASELINE=<another
//! idem>` holds this build against that one ([`before_and_after`]), and
//! `IDEM_BENCH_FLOOR=1` (`just bench-floor`) measures what any server on
//! this HTTP stack spends per request here ([`floor`]).

mod support;

use rusqlite::Connection;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};
use support::*;

const CONNECTIONS: [usize; 4] = [1, 8, 64, 256];

#[derive(Clone, Copy, PartialEq)]
enum Phase {
    New,
    Replay,
    /// 89% new, 10% a retry of a completed key, 1% that retry with another amount.
    Mix,
    /// A new key with amount 0: refused (400) by the front before any store
    /// is reached, so its cost is the floor under every request's.
    Refused,
}

#[derive(Default)]
struct Tally {
    latencies_us: Vec<u32>,
    /// Of them, those of the requests answered as replays.
    replay_latencies_us: Vec<u32>,
    fresh: Vec<String>,
    replays: u64,
    mismatches: u64,
    other: Vec<u16>,
}

/// `connections` threads hammer the server for `seconds()`; returns the
/// merged tally and the elapsed time.
fn load(
    address: &str,
    connections: usize,
    phase: Phase,
    run: &str,
    completed: &[Vec<String>],
) -> (Tally, Duration) {
    let barrier = Arc::new(Barrier::new(connections + 1));
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..connections)
        .map(|c| {
            let (address, barrier, stop, run) =
                (address.to_owned(), barrier.clone(), stop.clone(), run.to_owned());
            let done: Vec<String> = completed.get(c).cloned().unwrap_or_default();
            std::thread::spawn(move || {
                let mut conn = Conn::open(&address);
                let mut tally = Tally::default();
                let mut rng = idem::rng::Rng::new(c as u64 + 1);
                barrier.wait();
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    i += 1;
                    let roll = rng.below(100);
                    let old = (!done.is_empty()).then(|| &done[rng.below(done.len() as u64) as usize]);
                    let (key, amount) = match (phase, old) {
                        (Phase::Replay, Some(k)) => (k.clone(), 1),
                        (Phase::Mix, Some(k)) if roll < 10 => (k.clone(), 1),
                        (Phase::Mix, Some(k)) if roll < 11 => (k.clone(), 2),
                        _ if phase == Phase::Refused => (format!("{run}-{c}-{i}"), 0),
                        _ => (format!("{run}-{c}-{i}"), 1),
                    };
                    let n = key.bytes().fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)));
                    let started = Instant::now();
                    let (status, replayed, _) = conn.post(&key, &body(n, amount));
                    let took = started.elapsed().as_micros().min(u128::from(u32::MAX)) as u32;
                    tally.latencies_us.push(took);
                    match (status, replayed) {
                        (201, false) => tally.fresh.push(key),
                        (201, true) => {
                            tally.replays += 1;
                            tally.replay_latencies_us.push(took);
                        }
                        (422, _) => tally.mismatches += 1,
                        (400, _) if phase == Phase::Refused => {}
                        (s, _) => tally.other.push(s),
                    }
                }
                tally
            })
        })
        .collect();
    barrier.wait();
    let started = Instant::now();
    std::thread::sleep(seconds());
    stop.store(true, Ordering::Relaxed);
    let mut all = Tally::default();
    for w in workers {
        let t = w.join().unwrap();
        all.latencies_us.extend(t.latencies_us);
        all.replay_latencies_us.extend(t.replay_latencies_us);
        all.fresh.extend(t.fresh);
        all.replays += t.replays;
        all.mismatches += t.mismatches;
        all.other.extend(t.other);
    }
    (all, started.elapsed())
}

/// The fresh keys of each connection (`<run>-<connection>-<n>`), for it to replay.
fn by_connection(fresh: &[String], connections: usize) -> Vec<Vec<String>> {
    (0..connections)
        .map(|c| fresh.iter().filter(|k| k.split('-').nth(1) == Some(&c.to_string())).cloned().collect())
        .collect()
}

/// The database's verdict: distinct fresh 201s = transfers, money conserved.
fn verify(db: &str, fresh_total: usize) {
    let (transfers, balances) = idem::store::bank::ledger(&idem::store::Db::parse(db)).unwrap();
    assert_eq!(transfers.len(), fresh_total, "transfers differ from the distinct keys answered 201");
    assert_eq!(balances.values().sum::<i64>(), ACCOUNTS as i64 * 1_000_000_000_000, "money not conserved");
}

fn accounts() -> Vec<idem::store::bank::Account> {
    (0..ACCOUNTS)
        .map(|i| idem::store::bank::Account {
            id: format!("a{i}"),
            holder: "h".into(),
            balance: 1_000_000_000_000,
        })
        .collect()
}

/// The load table for one store; returns the new-transfer rates by connections.
fn serve_table(name: &str, db: &str, dir: &Path) -> Vec<(usize, f64, f64)> {
    idem::store::bank::create(&idem::store::Db::parse(db), &accounts()).unwrap();
    let server = Server::start(db, dir, &[]);
    println!("\n## idem serve on {name}\n");
    println!(
        "| connections | new/s | p50 | p99 | max | replays/s | mix/s (10% retries, 1% changed) | checked |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---|");
    let mut fresh_total = 0;
    let mut rates = Vec::new();
    let mut cpu_rows = Vec::new();
    for connections in CONNECTIONS {
        // the server's own CPU per request, the load generator's excluded
        let per_request = |before: (Duration, Duration), after: (Duration, Duration), n: usize| {
            let us = |d: Duration| d.as_secs_f64() * 1e6 / n.max(1) as f64;
            (us(after.0 - before.0), us(after.1 - before.1))
        };
        let cpu0 = server.cpu("idem-writer");
        let (new, took) = load(&server.address, connections, Phase::New, &format!("new{connections}"), &[]);
        let cpu_new = per_request(cpu0, server.cpu("idem-writer"), new.latencies_us.len());
        assert!(new.other.is_empty(), "unexpected answers {:?}", &new.other[..new.other.len().min(5)]);
        fresh_total += new.fresh.len();
        let mut lat = new.latencies_us.clone();
        lat.sort_unstable();
        let new_rate = new.fresh.len() as f64 / took.as_secs_f64();
        // each connection replays keys it made
        let per = by_connection(&new.fresh, connections);
        let cpu1 = server.cpu("idem-writer");
        let (replay, took_r) = load(&server.address, connections, Phase::Replay, "unused", &per);
        let replay_rate = replay.replays as f64 / took_r.as_secs_f64();
        let cpu2 = server.cpu("idem-writer");
        let cpu_replay = per_request(cpu1, cpu2, replay.latencies_us.len());
        let (mix, took_m) =
            load(&server.address, connections, Phase::Mix, &format!("mix{connections}"), &per);
        let cpu_mix = per_request(cpu2, server.cpu("idem-writer"), mix.latencies_us.len());
        fresh_total += mix.fresh.len();
        let mix_rate = mix.latencies_us.len() as f64 / took_m.as_secs_f64();
        cpu_rows.push(format!(
            "| {connections} | {:.1} | {:.1} | {:.1} | {:.1} |",
            cpu_new.0, cpu_new.1, cpu_replay.0, cpu_mix.0
        ));
        verify(db, fresh_total);
        println!(
            "| {connections} | {new_rate:.0} | {:.2} ms | {:.2} ms | {:.1} ms | {replay_rate:.0} | {mix_rate:.0} | {} transfers = distinct fresh 201s, money conserved |",
            percentile(&lat, 0.5),
            percentile(&lat, 0.99),
            percentile(&lat, 1.0),
            fresh_total
        );
        rates.push((connections, new_rate, replay_rate));
        if connections == 256 {
            println!(
                "\nPeak RSS of the server after the 256-connection run: {:.1} MiB.",
                server.peak_rss_mib()
            );
        }
    }
    println!(
        "\nThe server's own CPU (user + system, all its threads; the load generator excluded), µs per request:\n"
    );
    println!("| connections | new transfer | of it, the SQLite writer thread | replay | mix |");
    println!("|---:|---:|---:|---:|---:|");
    for row in cpu_rows {
        println!("{row}");
    }
    if let Some(soak) = std::env::var("IDEM_BENCH_SOAK").ok().and_then(|s| s.parse::<u64>().ok()) {
        println!("\nSoak: 64 connections of the mix for {soak} s:");
        let (mut samples, mut requests) = (Vec::new(), 0);
        let until = Instant::now() + Duration::from_secs(soak);
        let mut n = 0;
        while Instant::now() < until {
            n += 1;
            let (mix, _) = load(&server.address, 64, Phase::Mix, &format!("soak{n}"), &[]);
            fresh_total += mix.fresh.len();
            requests += mix.latencies_us.len();
            samples.push(server.rss_mib());
        }
        verify(db, fresh_total);
        // Flat means the last tenth of the soak holds no more than the first.
        let tenth = samples.len().div_ceil(10).max(1);
        let peak = |s: &[f64]| s.iter().copied().fold(0.0, f64::max);
        let (first, last) = (peak(&samples[..tenth]), peak(&samples[samples.len() - tenth..]));
        let shown: Vec<String> = samples.iter().step_by(tenth).map(|m| format!("{m:.1}")).collect();
        println!("RSS MiB, every tenth of the soak: {}", shown.join(" → "));
        println!(
            "{requests} requests; peak RSS in the first tenth {first:.1} MiB, in the last {last:.1} MiB \
             ({:+.2} MiB per million requests; target: flat).",
            (last - first) / (requests as f64 / 1e6)
        );
    }
    rates
}

/// The disk's own limit: overwrite 4 KiB and fdatasync, as a reused WAL does.
fn fsync_rate(dir: &Path) -> f64 {
    let file = std::fs::File::create(dir.join("fsync.bin")).unwrap();
    let block = vec![7u8; 4096];
    let mut times = Vec::new();
    let until = Instant::now() + Duration::from_secs(2);
    while Instant::now() < until {
        let started = Instant::now();
        use std::os::unix::fs::FileExt;
        file.write_all_at(&block, 0).unwrap();
        file.sync_data().unwrap();
        times.push(started.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    1.0 / times[times.len() / 2]
}

/// pgbench running the same two transactions as a transfer at `clients`.
fn pgbench(conninfo: &str, clients: usize, dir: &Path) -> Option<f64> {
    let bin = pgbench_bin()?;
    let script = dir.join("transfer.sql");
    std::fs::write(
        &script,
        "\\set k random(1, 2000000000)\n\\set src random(0, 999)\n\\set dst (:src + 1) % 1000\n\
         BEGIN;\nSET LOCAL synchronous_commit = off;\n\
         INSERT INTO idem_key (client_id, endpoint, idem_key, fingerprint, state, token, created_at, lease_until)\n\
           VALUES ('pgbench', '/v1/transfers', :client_id || '-' || :k, 'fp', 'in_progress', 't' || :k, '2026', '2026')\n\
           ON CONFLICT DO NOTHING;\nCOMMIT;\n\
         BEGIN;\n\
         SELECT state FROM idem_key WHERE client_id = 'pgbench' AND endpoint = '/v1/transfers' AND idem_key = :client_id || '-' || :k FOR UPDATE;\n\
         SELECT balance FROM account WHERE acct_id = 'a' || least(:src, :dst) FOR UPDATE;\n\
         SELECT balance FROM account WHERE acct_id = 'a' || greatest(:src, :dst) FOR UPDATE;\n\
         INSERT INTO transfer (src, dst, amount, currency, created_at) VALUES ('a' || :src, 'a' || :dst, 1, 'KRW', '2026') RETURNING transfer_id AS tid \\gset\n\
         UPDATE account SET balance = balance - 1 WHERE acct_id = 'a' || :src AND balance >= 1;\n\
         UPDATE account SET balance = balance + 1 WHERE acct_id = 'a' || :dst;\n\
         UPDATE idem_key SET state = 'completed', status = 201, body = '{}', transfer_id = :tid, completed_at = '2026'\n\
           WHERE client_id = 'pgbench' AND endpoint = '/v1/transfers' AND idem_key = :client_id || '-' || :k AND token = 't' || :k;\n\
         COMMIT;\n",
    )
    .unwrap();
    let threads = clients.min(2).to_string();
    let out = Command::new(bin)
        .args(["-n", "-f"])
        .arg(&script)
        .args(["-c", &clients.to_string(), "-j", &threads, "-T", &seconds().as_secs().max(1).to_string()])
        .arg(conninfo)
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines().find(|l| l.starts_with("tps = ")).and_then(|l| l.split_whitespace().nth(2)?.parse().ok())
}

/// Request cost (fresh transfer, in process, production durability) with
/// `keys` keys already in the table; and the longest purge batch.
fn growth(dir: &Path, keys: usize) -> (f64, f64) {
    use idem::policy::Policy;
    use idem::protocol::{self, Ctx, Flow};
    let db = dir.join(format!("growth-{keys}.db"));
    let spec = db.to_string_lossy().into_owned();
    idem::store::bank::create(&idem::store::Db::parse(&spec), &accounts()).unwrap();
    let policy = Policy::embedded();
    let mut store = idem::store::sqlite::SqliteStore::open(&db, policy).unwrap();
    {
        let conn = Connection::open(&db).unwrap();
        conn.execute_batch("BEGIN").unwrap();
        let mut insert = conn
            .prepare(
                "INSERT INTO idem_key (client_id, endpoint, idem_key, fingerprint, state, token, created_at,
                                       lease_until, status, reason, body, transfer_id, completed_at)
                 VALUES ('c', '/v1/transfers', ?1, 'fp', 'completed', 't', ?2, ?2, 201, NULL, '{}', NULL, ?2)",
            )
            .unwrap();
        for i in 0..keys {
            // the first half is past retention, the rest inside it
            let at = if i < keys / 2 { "2026-11-01T00:00:00.000000Z" } else { "2026-11-30T00:00:00.000000Z" };
            insert.execute((format!("pre-{i:09}"), at)).unwrap();
        }
        drop(insert);
        conn.execute_batch("COMMIT").unwrap();
    }
    let now = idem::clock::Timestamp::parse("2026-12-01T00:00:00Z").unwrap();
    let mut times = Vec::new();
    for i in 0..300 {
        let text = format!(
            r#"{{"client_id":"c","endpoint":"/v1/transfers","idem_key":"probe-{i}","body":{}}}"#,
            body(i, 1)
        );
        let req = idem::request::parse(text.as_bytes(), policy).unwrap();
        let started = Instant::now();
        protocol::handle(&mut store, &req, Ctx { policy, now, token: &format!("t{i}") }, &mut |_| {
            Flow::Continue
        })
        .unwrap();
        times.push(started.elapsed().as_secs_f64() * 1e6);
    }
    times.sort_by(f64::total_cmp);
    // the operator's purge: batches of 500, each timed
    let cut = now.plus_seconds(-policy.retention_seconds());
    let mut longest: f64 = 0.0;
    loop {
        let started = Instant::now();
        let n = idem::store::atomically(&mut store, idem::store::Durability::Durable, policy, |tx| {
            tx.purge(cut, 500).map(idem::store::End::Commit)
        })
        .unwrap();
        longest = longest.max(started.elapsed().as_secs_f64() * 1e3);
        if n < 500 {
            break;
        }
    }
    (times[times.len() / 2], longest)
}

fn main() {
    if std::env::args().nth(1).as_deref() == Some("serve") {
        return bare_server();
    }
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    println!(
        "idem serve benchmark: {} cores, {} s per phase",
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        seconds().as_secs_f64()
    );
    if let Ok(baseline) = std::env::var("IDEM_BENCH_BASELINE") {
        return before_and_after(&baseline, dir);
    }
    if std::env::var_os("IDEM_BENCH_FLOOR").is_some() {
        return floor(dir);
    }
    let fsync = fsync_rate(dir);
    println!("\nThe disk: overwrite 4 KiB + fdatasync, median: {fsync:.0}/s.");

    let sqlite = dir.join("serve.db").to_string_lossy().into_owned();
    let rates = serve_table("SQLite (group commit)", &sqlite, dir);
    let single = rates[0].1;
    // The same store without group commit, in the same run: one commit, one
    // fsync, per transfer.
    let alone = dir.join("alone.db").to_string_lossy().into_owned();
    idem::store::bank::create(&idem::store::Db::parse(&alone), &accounts()).unwrap();
    let server = Server::start(&alone, dir, &["--group-max", "1"]);
    let (tally, took) = load(&server.address, 64, Phase::New, "alone", &[]);
    drop(server);
    verify(&alone, tally.fresh.len());
    let alone_rate = tally.fresh.len() as f64 / took.as_secs_f64();
    println!("\nWithout group commit (--group-max 1), 64 connections: {alone_rate:.0} new/s.");
    println!("\n| ratio | value | target |\n|---|---:|---|");
    let at64 = rates.iter().find(|r| r.0 == 64).map_or(0.0, |r| r.1);
    println!("| new/s at 64 connections ÷ fsync rate | {:.2}× | ≥ 4× |", at64 / fsync);
    println!("| new/s at 64 connections ÷ the same without group commit | {:.2}× | |", at64 / alone_rate);
    let best_replay = rates.iter().map(|r| r.2).fold(0.0, f64::max);
    println!("| best replays/s ÷ new/s at 1 connection | {:.1}× | ≥ 20× |", best_replay / single);

    if let Ok(pg) = std::env::var("IDEM_BENCH_PG") {
        let pg_rates = serve_table("PostgreSQL", &pg, dir);
        println!(
            "\n| clients | idem serve new/s | pgbench, same transactions, tps | ratio | target |\n|---:|---:|---:|---:|---|"
        );
        for clients in [8, 64] {
            let ours = pg_rates.iter().find(|r| r.0 == clients).map_or(0.0, |r| r.1);
            match pgbench(&pg, clients, dir) {
                Some(tps) => {
                    println!("| {clients} | {ours:.0} | {tps:.0} | {:.0}% | ≥ 75% |", 100.0 * ours / tps)
                }
                None => println!("| {clients} | {ours:.0} | (pgbench not found) | | |"),
            }
        }
    }

    let big: usize = std::env::var("IDEM_BENCH_KEYS").ok().and_then(|s| s.parse().ok()).unwrap_or(1_000_000);
    let (small_us, small_purge) = growth(dir, 10_000);
    let (big_us, big_purge) = growth(dir, big);
    println!(
        "\n| keys in the table | new transfer, in process | longest purge batch (500 keys) |\n|---:|---:|---:|"
    );
    println!("| 10^4 | {small_us:.0} µs | {small_purge:.1} ms |");
    println!(
        "| {big} | {big_us:.0} µs ({:.2}× of 10^4; target ≤ 1.5×) | {big_purge:.1} ms (target ≤ 50 ms) |",
        big_us / small_us
    );
}

/// `IDEM_BENCH_BASELINE=<another idem binary>`: instead of the tables,
/// this build against that one, in the same run, alternating five rounds of
/// each at 1 and 64 connections (new transfers, replays of them, requests
/// refused before the store, then the mix, whose retries' latency shows
/// what a replay waits for beside new transfers), each on a fresh database;
/// medians and their ratio. A change that must not slow a transfer is held
/// to this.
fn before_and_after(baseline: &str, dir: &Path) {
    println!("\n## This build against {baseline}, medians of 5 alternating rounds\n");
    println!("| connections | | baseline | this build | ratio |\n|---:|---|---:|---:|---:|");
    const MEASURES: [&str; 8] = [
        "new transfers/s",
        "replays/s",
        "in the mix (10% retries): retries' p50 ms",
        "in the mix: retries' p99 ms",
        "server CPU µs per new transfer",
        "of it, the writer thread's",
        "server CPU µs per replay",
        "server CPU µs per request refused before the store (400)",
    ];
    for connections in [1, 64] {
        // [side][measure] -> one sample per round
        let mut samples: [[Vec<f64>; 8]; 2] = Default::default();
        for round in 0..5 {
            for (side, bin) in [baseline, IDEM].into_iter().enumerate() {
                let db =
                    dir.join(format!("ab-{connections}-{round}-{side}.db")).to_string_lossy().into_owned();
                idem::store::bank::create(&idem::store::Db::parse(&db), &accounts()).unwrap();
                let server = Server::start_bin(bin, &db, dir, &[]);
                let run = format!("ab{connections}x{round}x{side}");
                let cpu0 = server.cpu("idem-writer");
                let (new, took) = load(&server.address, connections, Phase::New, &run, &[]);
                let cpu1 = server.cpu("idem-writer");
                let per = by_connection(&new.fresh, connections);
                let (replay, took_r) = load(&server.address, connections, Phase::Replay, "unused", &per);
                let cpu2 = server.cpu("idem-writer");
                let (refused, _) =
                    load(&server.address, connections, Phase::Refused, &format!("{run}r"), &[]);
                let cpu3 = server.cpu("idem-writer");
                let (mix, _) = load(&server.address, connections, Phase::Mix, &format!("{run}m"), &per);
                drop(server);
                verify(&db, new.fresh.len() + mix.fresh.len());
                let us = |d: Duration, n: usize| d.as_secs_f64() * 1e6 / n.max(1) as f64;
                let (n, r) = (new.latencies_us.len(), replay.latencies_us.len());
                let mut waits = mix.replay_latencies_us.clone();
                waits.sort_unstable();
                let measured = [
                    new.fresh.len() as f64 / took.as_secs_f64(),
                    replay.replays as f64 / took_r.as_secs_f64(),
                    percentile(&waits, 0.5),
                    percentile(&waits, 0.99),
                    us(cpu1.0 - cpu0.0, n),
                    us(cpu1.1 - cpu0.1, n),
                    us(cpu2.0 - cpu1.0, r),
                    us(cpu3.0 - cpu2.0, refused.latencies_us.len()),
                ];
                for (m, value) in measured.into_iter().enumerate() {
                    samples[side][m].push(value);
                }
            }
        }
        for (m, name) in MEASURES.iter().enumerate() {
            let (b, t) = (median(samples[0][m].clone()), median(samples[1][m].clone()));
            println!("| {connections} | {name} | {b:.2} | {t:.2} | {:.2}× |", t / b);
        }
    }
}

/// `IDEM_BENCH_FLOOR=1`: what any server on this HTTP stack spends per
/// request on this machine under this load generator: this bench's own
/// binary as a bare hyper server (no store, no checks: it reads the body
/// and answers 201 with a transfer-sized body), against idem refusing the
/// same request before its store (400) and idem paying it, alternating five
/// rounds of each at 64 connections; medians.
fn floor(dir: &Path) {
    let bare = std::env::current_exe().unwrap().to_string_lossy().into_owned();
    println!("\n## The floor under a request, 64 connections, medians of 5 alternating rounds\n");
    println!("| server | what it does | requests/s | server CPU µs per request |\n|---|---|---:|---:|");
    let mut samples: [Vec<(f64, f64)>; 3] = Default::default();
    for round in 0..5 {
        for (side, (bin, phase)) in
            [(bare.as_str(), Phase::New), (IDEM, Phase::Refused), (IDEM, Phase::New)].into_iter().enumerate()
        {
            let db = dir.join(format!("floor-{round}-{side}.db")).to_string_lossy().into_owned();
            idem::store::bank::create(&idem::store::Db::parse(&db), &accounts()).unwrap();
            let server = Server::start_bin(bin, &db, dir, &[]);
            let cpu0 = server.cpu("idem-writer");
            let (tally, took) = load(&server.address, 64, phase, &format!("floor{round}x{side}"), &[]);
            let cpu1 = server.cpu("idem-writer");
            let n = tally.latencies_us.len();
            samples[side].push((
                n as f64 / took.as_secs_f64(),
                (cpu1.0 - cpu0.0).as_secs_f64() * 1e6 / n.max(1) as f64,
            ));
        }
    }
    let what = [
        ("bare hyper (this bench's binary)", "reads the body, answers 201"),
        ("idem serve", "refuses the body (amount 0) before the store: 400"),
        ("idem serve", "pays a new transfer: 201"),
    ];
    for (side, (server, does)) in what.into_iter().enumerate() {
        let (rates, cpus): (Vec<f64>, Vec<f64>) = samples[side].iter().copied().unzip();
        println!("| {server} | {does} | {:.0} | {:.1} |", median(rates), median(cpus));
    }
}

/// The bare server of [`floor`]: hyper's HTTP/1.1 on tokio's default
/// runtime, as `idem serve` runs it, with nothing behind it. Prints its
/// address as `idem serve` does.
fn bare_server() {
    use http_body_util::{BodyExt, Full};
    use hyper::body::{Bytes, Incoming};
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        println!("http://{}", listener.local_addr().unwrap());
        let answer = Bytes::from_static(
            br#"{"transfer_id":1,"src":"a1","dst":"a2","amount":1,"currency":"KRW","created_at":"2026-12-06T05:56:12.726793Z"}"#,
        );
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let answer = answer.clone();
            let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
                let answer = answer.clone();
                async move {
                    let _ = req.into_body().collect().await;
                    let mut response = hyper::Response::new(Full::new(answer));
                    *response.status_mut() = hyper::StatusCode::CREATED;
                    response.headers_mut().insert("content-type", "application/json".parse().unwrap());
                    Ok::<_, std::convert::Infallible>(response)
                }
            });
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service),
            );
        }
    });
}
