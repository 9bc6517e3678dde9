//! Several `idem serve` on a replicated PostgreSQL that fails over: a real
//! cluster from `tools/pg-ha` (Patroni and etcd from the distribution's
//! packages: a primary and two standbys in strict synchronous mode, a
//! commit acknowledged only once a standby has it), three services on its
//! multi-host connection string, and the primary killed with SIGKILL
//! mid-load.
//!
//! Needs `patroni` and `etcd`; without them the test is skipped, unless
//! `IDEM_REQUIRE_TOOLS` is set (CI), where it fails.

use crate::server::Serve;
use idem::store::Db;
use idem::store::bank::{self, Account};
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const HA: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tools/pg-ha");

struct Cluster {
    root: tempfile::TempDir,
    port: u16,
    conninfo: String,
}

impl Cluster {
    fn start() -> Option<Cluster> {
        let installed = Command::new("sh")
            .args(["-c", "command -v patroni && command -v etcd"])
            .output()
            .is_ok_and(|o| o.status.success());
        if !installed {
            assert!(
                std::env::var_os("IDEM_REQUIRE_TOOLS").is_none(),
                "Patroni and etcd are not installed and IDEM_REQUIRE_TOOLS is set"
            );
            eprintln!("skipped: Patroni and etcd are not installed");
            return None;
        }
        let root = tempfile::tempdir().unwrap();
        let mut cluster = Cluster { root, port: free_ports(60), conninfo: String::new() };
        cluster.conninfo = cluster.ha(&["start"]);
        assert!(cluster.conninfo.contains("target_session_attrs=read-write"), "{}", cluster.conninfo);
        Some(cluster)
    }

    /// Runs `tools/pg-ha ARGS` on this cluster; its standard output.
    fn ha(&self, args: &[&str]) -> String {
        let out = Command::new(HA)
            .args(args)
            .env("PG_HA_ROOT", self.root.path())
            .env("PG_HA_PORT", self.port.to_string())
            .output()
            .unwrap();
        if !out.status.success() {
            let status = Command::new(HA)
                .arg("status")
                .env("PG_HA_ROOT", self.root.path())
                .env("PG_HA_PORT", self.port.to_string())
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default();
            let logs: String = (1..=3)
                .map(|n| {
                    let log = std::fs::read_to_string(self.root.path().join(format!("node{n}.log")))
                        .unwrap_or_default();
                    let tail: Vec<&str> = log.lines().rev().take(8).collect();
                    format!("node{n}.log:\n{}\n", tail.into_iter().rev().collect::<Vec<_>>().join("\n"))
                })
                .collect();
            panic!(
                "tools/pg-ha {args:?}: {}{}\n{status}\n{logs}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        String::from_utf8(out.stdout).unwrap().trim().to_owned()
    }

    /// A connection to the primary. Right after a failover the cluster may
    /// have none for a moment (the old primary rejoining, a leader race):
    /// wait for one, as a client would.
    fn client(&self) -> postgres::Client {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match postgres::Client::connect(&self.conninfo, postgres::NoTls) {
                Ok(client) => return client,
                Err(e) if Instant::now() < deadline => {
                    eprintln!("no primary yet ({e}); waiting");
                    std::thread::sleep(Duration::from_millis(200));
                }
                Err(e) => panic!("no primary for 30 s: {e}"),
            }
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new(HA)
            .arg("destroy")
            .env("PG_HA_ROOT", self.root.path())
            .env("PG_HA_PORT", self.port.to_string())
            .status();
    }
}

/// The first of `n` consecutive loopback ports that are free now, all below
/// the kernel's ephemeral range: the cluster's nodes bind them again on
/// every restart, and a port from inside the range can meanwhile be handed
/// to any outgoing connection (CI once lost a node to "Address already in
/// use" on a restart that way).
fn free_ports(n: u16) -> u16 {
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap_or_default();
    let low = range.split_whitespace().next().and_then(|p| p.parse::<u16>().ok()).unwrap_or(32_768);
    let span = u64::from(low.saturating_sub(10_000 + n).max(1));
    let nanos =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    let seed = u64::from(std::process::id()) * 7919 + u64::from(nanos);
    (0..200u64)
        .map(|i| 10_000 + ((seed + i * 104_729) % span) as u16)
        .find(|base| (0..n).all(|k| std::net::TcpListener::bind(("127.0.0.1", base + k)).is_ok()))
        .expect("no free ports")
}

/// What one client saw of one transfer.
#[derive(Debug, Clone)]
struct Final {
    status: u16,
    replay: bool,
    transfer_id: Option<i64>,
    amount: i64,
    src: String,
    dst: String,
    /// When the attempt that got this answer was sent.
    sent: Instant,
    /// Whether an earlier attempt of the same key got no answer or a 503.
    after_a_failure: bool,
}

#[derive(Default)]
struct Seen {
    unavailable: AtomicUsize,
    in_progress: AtomicUsize,
    no_answer: AtomicUsize,
    other: Mutex<Vec<String>>,
}

/// The final status, the answer's JSON, whether it was a replay, when the
/// answered attempt was sent, and whether an earlier attempt failed.
type Answer = (u16, serde_json::Value, bool, Instant, bool);

/// One `POST /v1/transfers` of `body` under `key`, as the shop's client.
fn post(
    agent: &ureq::Agent,
    url: &str,
    key: &str,
    body: &str,
) -> Result<ureq::http::Response<ureq::Body>, ureq::Error> {
    agent
        .post(format!("{url}/v1/transfers"))
        .header("Authorization", "Bearer tok")
        .header("Idempotency-Key", format!("\"{key}\""))
        .header("Content-Type", "application/json")
        .send(body)
}

/// Sends one transfer until it has a final answer, trying the instances in
/// turn: another one after a failure, the same key every time.
/// A client that gives up on an attempt after `timeout` and takes every
/// status as an answer.
fn agent(timeout: Duration) -> ureq::Agent {
    ureq::Agent::config_builder().http_status_as_error(false).timeout_global(Some(timeout)).build().into()
}

fn send_until_final(urls: &[String], first: usize, key: &str, body: &str, seen: &Seen) -> Option<Answer> {
    let agent = agent(Duration::from_secs(10));
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut failed = false;
    for attempt in 0.. {
        if Instant::now() > deadline {
            return None;
        }
        let url = &urls[(first + attempt) % urls.len()];
        let sent = Instant::now();
        match post(&agent, url, key, body) {
            Ok(mut response) => {
                let status = response.status().as_u16();
                let replay = response.headers().get("idempotent-replayed").is_some_and(|v| v == "true");
                let text = response.body_mut().read_to_string().unwrap_or_default();
                match status {
                    201 | 402 | 404 => {
                        return Some((
                            status,
                            serde_json::from_str(&text).unwrap_or_default(),
                            replay,
                            sent,
                            failed,
                        ));
                    }
                    503 => drop(seen.unavailable.fetch_add(1, Ordering::Relaxed)),
                    409 => drop(seen.in_progress.fetch_add(1, Ordering::Relaxed)),
                    _ => seen.other.lock().unwrap().push(format!("{status} {text}")),
                }
            }
            Err(_) => drop(seen.no_answer.fetch_add(1, Ordering::Relaxed)),
        }
        failed = true;
        std::thread::sleep(Duration::from_millis(50 + 50 * (attempt as u64 % 4)));
    }
    None
}

fn transfers_table(client: &mut postgres::Client) -> BTreeMap<i64, (String, String, i64)> {
    client
        .query("SELECT transfer_id, src::text, dst::text, amount FROM transfer", &[])
        .unwrap()
        .iter()
        .map(|r| (r.get::<_, i64>(0), (r.get(1), r.get(2), r.get(3))))
        .collect()
}

#[test]
#[ignore = "long suite: cargo test --release -- --ignored"]
fn three_services_lose_nothing_acknowledged_when_the_primary_is_killed_an_etcd_member_gone() {
    let _heavy = crate::server::heavy();
    let Some(cluster) = Cluster::start() else { return };
    const START: i64 = 1_000_000;
    let accounts: Vec<Account> =
        (0..8).map(|i| Account { id: format!("a{i}"), holder: format!("h{i}"), balance: START }).collect();
    bank::create(&Db::parse(&cluster.conninfo), &accounts).unwrap();
    let services: Vec<Serve> = (0..3)
        .map(|_| Serve::start(Path::new(&cluster.conninfo), &[("tok", "shop")], &["--pool", "4"], &[]))
        .collect();
    let urls: Vec<String> = services.iter().map(|s| s.url.clone()).collect();

    // Phase 1: six clients, 40 transfers each, the primary killed a third of the way in.
    let seen = Arc::new(Seen::default());
    let finals: Arc<Mutex<BTreeMap<String, Final>>> = Arc::default();
    let done = Arc::new(AtomicUsize::new(0));
    let clients: Vec<_> = (0..6)
        .map(|c| {
            let (urls, seen, finals, done) = (urls.clone(), seen.clone(), finals.clone(), done.clone());
            std::thread::spawn(move || {
                for i in 0..40u64 {
                    let (src, dst) = ((c + i) % 8, (c + i * 3 + 1) % 8);
                    let dst = if dst == src { (dst + 1) % 8 } else { dst };
                    let amount = 1 + (c * 131 + i * 17) as i64 % 500;
                    let key = format!("c{c}-t{i}");
                    let body =
                        format!(r#"{{"src":"a{src}","dst":"a{dst}","amount":{amount},"currency":"KRW"}}"#);
                    let (status, answer, replay, sent, after_a_failure) =
                        send_until_final(&urls, c as usize, &key, &body, &seen).unwrap_or_else(|| {
                            panic!("{key}: no final answer in 120 s (a key left blocked?)")
                        });
                    // a client's pace, not a benchmark's: the kill must land mid-run
                    // (a transfer takes a few milliseconds; the kill, longer)
                    std::thread::sleep(Duration::from_millis(50));
                    let transfer_id = answer["transfer_id"].as_i64();
                    let f = Final {
                        status,
                        replay,
                        transfer_id,
                        amount,
                        src: format!("a{src}"),
                        dst: format!("a{dst}"),
                        sent,
                        after_a_failure,
                    };
                    finals.lock().unwrap().insert(key, f);
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    while done.load(Ordering::Relaxed) < 80 {
        std::thread::sleep(Duration::from_millis(20));
    }
    // one of etcd's three members lost first (the first Patroni tries): a
    // quorum is left, so the loss must change nothing, the failover included
    cluster.ha(&["stop-etcd", "1"]);
    let killed = cluster.ha(&["kill-primary"]);
    let killed_at = Instant::now();
    for client in clients {
        client.join().unwrap();
    }
    let finals = finals.lock().unwrap().clone();
    assert!(
        seen.other.lock().unwrap().is_empty(),
        "answers that are neither final nor retryable: {:?}",
        seen.other
    );

    // The verdict, read on the new primary.
    let mut db = cluster.client();
    let table = transfers_table(&mut db);
    let acknowledged: Vec<&Final> = finals.values().filter(|f| f.status == 201).collect();
    assert_eq!(finals.len(), 240);
    assert_eq!(acknowledged.len(), 240, "every transfer is payable: {finals:?}");
    for f in &acknowledged {
        let id = f.transfer_id.expect("a 201 names its transfer");
        assert_eq!(
            table.get(&id),
            Some(&(f.src.clone(), f.dst.clone(), f.amount)),
            "acknowledged transfer {id} lost"
        );
    }
    assert_eq!(table.len(), acknowledged.len(), "transfers nobody was told about, or paid twice");
    let mut want: BTreeMap<String, i64> = accounts.iter().map(|a| (a.id.clone(), START)).collect();
    for f in &acknowledged {
        *want.get_mut(&f.src).unwrap() -= f.amount;
        *want.get_mut(&f.dst).unwrap() += f.amount;
    }
    let have: BTreeMap<String, i64> = db
        .query("SELECT acct_id::text, balance FROM account", &[])
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(have, want, "balances");
    let blocked: i64 =
        db.query_one("SELECT count(*) FROM idem_key WHERE state = 'in_progress'", &[]).unwrap().get(0);
    assert_eq!(blocked, 0, "keys left claimed");
    let resumed = acknowledged
        .iter()
        .filter(|f| f.sent > killed_at && !f.replay)
        .map(|f| f.sent.duration_since(killed_at))
        .min()
        .expect("writes resumed");
    let lost_acks = acknowledged.iter().filter(|f| f.after_a_failure && f.replay).count();
    eprintln!(
        "failover (node {killed} killed): writes resumed after {:.1} s; meanwhile {} answers 503, {} 409, {} attempts unanswered; {} commits whose answer was lost were found by the retry",
        resumed.as_secs_f64(),
        seen.unavailable.load(Ordering::Relaxed),
        seen.in_progress.load(Ordering::Relaxed),
        seen.no_answer.load(Ordering::Relaxed),
        lost_acks,
    );

    // Phase 2: a claim left by a request that met the failover is released
    // on the new primary, not left to block its key for the whole lease.
    cluster.ha(&["rejoin", &killed]);
    cluster.ha(&["wait-settled", "180"]);
    let mut holder = cluster.client();
    let mut lock = holder.transaction().unwrap();
    lock.query("SELECT balance FROM account WHERE acct_id = 'a0' FOR UPDATE", &[]).unwrap();
    let body = r#"{"src":"a0","dst":"a1","amount":7,"currency":"KRW"}"#;
    let first = {
        let url = urls[0].clone();
        std::thread::spawn(move || post(&Serve::agent(), &url, "held", body).map(|r| r.status().as_u16()))
    };
    // the claim commits and streams to the standbys; the execution waits on a0
    let claimed = Instant::now();
    let mut reader = cluster.client();
    while reader.query("SELECT 1 FROM idem_key WHERE idem_key = 'held'", &[]).unwrap().is_empty() {
        assert!(claimed.elapsed() < Duration::from_secs(3), "the claim never committed");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(500));
    cluster.ha(&["kill-primary"]);
    drop(lock);
    // The execution met the dead connection: 503, or, when the service's own
    // retry reached the new primary within the request's budget, its 201.
    let first = first.join().unwrap().ok();
    assert!(matches!(first, Some(503 | 201)), "an execution on a dead connection: {first:?}");
    cluster.ha(&["wait-primary", "60"]);
    let retried = Instant::now();
    let seen = Seen::default();
    let (status, ..) = send_until_final(&urls[..1], 0, "held", body, &seen).expect("the key is blocked");
    assert_eq!(status, 201);
    assert!(
        retried.elapsed() < Duration::from_secs(20),
        "the key waited {:.1} s: its claim was left for the lease",
        retried.elapsed().as_secs_f64()
    );
    drop(services);
}

/// Both standbys lost: under `synchronous_mode_strict` the primary cannot
/// have a commit replicated, so a transfer must not be acknowledged (its
/// commit waits; the client hears nothing or a 503, and so does every
/// retry); once a standby is back, the waiting commit completes and the
/// retry gets the transfer, made once.
#[test]
#[ignore = "long suite: cargo test --release -- --ignored"]
fn with_every_standby_gone_no_transfer_is_acknowledged_and_one_back_pays_it_once() {
    let _heavy = crate::server::heavy();
    let Some(cluster) = Cluster::start() else { return };
    let accounts: Vec<Account> =
        (0..2).map(|i| Account { id: format!("a{i}"), holder: format!("h{i}"), balance: 1_000 }).collect();
    bank::create(&Db::parse(&cluster.conninfo), &accounts).unwrap();
    let serve = Serve::start(Path::new(&cluster.conninfo), &[("tok", "shop")], &["--pool", "4"], &[]);
    let body = r#"{"src":"a0","dst":"a1","amount":7,"currency":"KRW"}"#;
    let primary: u16 = cluster.ha(&["primary"]).trim().parse().unwrap();
    for n in (1..=3).filter(|n| cluster.port + n != primary) {
        cluster.ha(&["kill-node", &n.to_string()]);
    }
    // for 20 s, attempt after attempt under one key: never a 201
    let agent = agent(Duration::from_secs(4));
    let until = Instant::now() + Duration::from_secs(20);
    let mut heard = Vec::new();
    while Instant::now() < until {
        heard.push(post(&agent, &serve.url, "lonely", body).map(|r| r.status().as_u16()).ok());
        std::thread::sleep(Duration::from_millis(500));
    }
    assert!(!heard.contains(&Some(201)), "acknowledged with no standby: {heard:?}");
    for n in (1..=3).filter(|n| cluster.port + n != primary) {
        cluster.ha(&["rejoin", &n.to_string()]);
    }
    let seen = Seen::default();
    let (status, answer, ..) = send_until_final(std::slice::from_ref(&serve.url), 0, "lonely", body, &seen)
        .expect("no final answer in 120 s once the standbys were back");
    assert_eq!(status, 201, "{answer}");
    let table = transfers_table(&mut cluster.client());
    assert_eq!(table.values().filter(|(_, _, amount)| *amount == 7).count(), 1, "{table:?}");
    eprintln!("with no standby, {} attempts heard: {heard:?}; then one transfer", heard.len());
}

/// The one thing synchronous replication does not promise: a commit that
/// was waiting for its standby when the primary died is in the old
/// primary's WAL (committed there) and absent from the new one. Its client
/// was never told it succeeded, so its retry must pay it, once, on the new
/// primary; and the old primary, rejoining, drops it (pg_rewind).
#[test]
#[ignore = "long suite: cargo test --release -- --ignored"]
fn a_commit_still_waiting_for_its_standby_when_the_primary_died_is_paid_once_by_its_retry() {
    let _heavy = crate::server::heavy();
    let Some(cluster) = Cluster::start() else { return };
    let accounts: Vec<Account> = ["a0", "a1"]
        .iter()
        .map(|id| Account { id: (*id).into(), holder: "h".into(), balance: 1_000 })
        .collect();
    bank::create(&Db::parse(&cluster.conninfo), &accounts).unwrap();
    let serve = Serve::start(Path::new(&cluster.conninfo), &[("tok", "shop")], &["--pool", "2"], &[]);
    let primary: u16 = cluster.ha(&["primary"]).parse().unwrap();
    let old = primary - cluster.port;
    let sync = cluster.ha(&["sync-standby"]);
    let other = (1..=3u16).map(|n| n.to_string()).find(|n| *n != old.to_string() && *n != sync).unwrap();
    // The primary's Patroni is frozen first, so that etcd keeps naming
    // `sync` as the synchronous standby: a Patroni that sees its standbys
    // gone records that it has none (`/sync` without one), and then no
    // node may promote once the primary dies. Whether it did so before the
    // kill below was a race (lost in CI under load, and in 1 of 3 runs
    // alone). The scenario is the primary dying while a commit waits for
    // its standby; what its Patroni would have written meanwhile is not.
    cluster.ha(&["freeze-patroni", &old.to_string()]);
    // both standbys die: under strict synchronous mode the primary can
    // commit locally but never acknowledge
    cluster.ha(&["kill-node", &sync]);
    cluster.ha(&["kill-node", &other]);
    let at_old = format!("host=127.0.0.1 port={primary} user=postgres dbname=postgres");
    let mut old_db = postgres::Client::connect(&at_old, postgres::NoTls).unwrap();
    let gone = Instant::now();
    while old_db.query_one("SELECT count(*) FROM pg_stat_replication", &[]).unwrap().get::<_, i64>(0) > 0 {
        assert!(gone.elapsed() < Duration::from_secs(30), "the standbys did not stop");
        std::thread::sleep(Duration::from_millis(100));
    }
    let body = r#"{"src":"a0","dst":"a1","amount":300,"currency":"KRW"}"#;
    let url = serve.url.clone();
    let first =
        std::thread::spawn(move || post(&Serve::agent(), &url, "waiting", body).map(|r| r.status().as_u16()));
    // the execution's commit (the only commit of idem's that waits for a
    // standby: a claim's does not) is written to the old primary's WAL and waits
    // there for a standby (PostgreSQL shows it to nobody until the wait
    // ends; a restart of that node alone would replay it as committed)
    let waiting = Instant::now();
    loop {
        let syncrep: i64 = old_db
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep' AND application_name = 'idem'",
                &[],
            )
            .unwrap()
            .get(0);
        if syncrep >= 1 {
            break;
        }
        assert!(waiting.elapsed() < Duration::from_secs(20), "the commit never waited for its standby");
        std::thread::sleep(Duration::from_millis(50));
    }
    drop(old_db);
    cluster.ha(&["kill-primary"]);
    assert_eq!(
        first.join().unwrap().ok(),
        Some(503),
        "never acknowledged: the connection died under the commit"
    );
    // the standby the primary waited for takes over; the other follows it
    cluster.ha(&["rejoin", &sync]);
    cluster.ha(&["rejoin", &other]);
    cluster.ha(&["wait-primary", "120"]);
    let seen = Seen::default();
    let (status, answer, replay, ..) =
        send_until_final(std::slice::from_ref(&serve.url), 0, "waiting", body, &seen)
            .expect("the retry is answered");
    assert_eq!((status, replay), (201, false), "the retry pays, as a first time: {answer}");
    let mut db = cluster.client();
    let table = transfers_table(&mut db);
    assert_eq!(table.len(), 1, "paid once on the new primary: {table:?}");
    let have: Vec<(String, i64)> = db
        .query("SELECT acct_id::text, balance FROM account ORDER BY acct_id", &[])
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(have, [("a0".to_string(), 700), ("a1".to_string(), 1_300)]);
    // the old primary rejoins as a standby, its lone commit rewound away
    cluster.ha(&["rejoin", &old.to_string()]);
    cluster.ha(&["wait-settled", "180"]);
    let at_old = format!("host=127.0.0.1 port={primary} user=postgres dbname=postgres");
    let mut rejoined = postgres::Client::connect(&at_old, postgres::NoTls).unwrap();
    let in_recovery: bool = rejoined.query_one("SELECT pg_is_in_recovery()", &[]).unwrap().get(0);
    assert!(in_recovery, "the old primary is a standby now");
    assert_eq!(transfers_table(&mut rejoined), table, "the old primary holds the new timeline's history");
    drop(serve);
}

/// A primary paused past its leader key's TTL, a standby promoted, the
/// old one thawed: it must demote itself, and nothing the new primary
/// acknowledged may be lost. With Patroni on etcd's v3 API this failed in
/// 3 of 5 runs (Patroni 3.0.2 renews its leader key with an unconditional
/// put: the woken node wrote the key over the new leader's, the new
/// primary demoted itself, and its acknowledged commits were gone);
/// `tools/pg-ha` now runs Patroni on the v2 API, whose renewal is a
/// compare-and-swap, and a three-member etcd: 10 of 10 runs passed.
#[test]
#[ignore = "long suite: cargo test --release -- --ignored"]
fn a_running_service_moves_to_the_new_primary_while_the_old_one_is_paused_and_loses_nothing() {
    // The review's repro: a primary frozen with SIGSTOP for 40 s; a standby
    // took writes 12 s in, yet the running service answered nothing until
    // the old node thawed (its connections, and every new one, waited on a
    // server that accepts and never answers).
    let _heavy = crate::server::heavy();
    let Some(cluster) = Cluster::start() else { return };
    const START: i64 = 1_000_000;
    let accounts: Vec<Account> =
        (0..4).map(|i| Account { id: format!("a{i}"), holder: format!("h{i}"), balance: START }).collect();
    bank::create(&Db::parse(&cluster.conninfo), &accounts).unwrap();
    let serve = Serve::start(Path::new(&cluster.conninfo), &[("tok", "shop")], &["--pool", "2"], &[]);
    let urls = std::slice::from_ref(&serve.url);
    let seen = Seen::default();
    let body = |i: i64| {
        format!(r#"{{"src":"a{}","dst":"a{}","amount":{},"currency":"KRW"}}"#, i % 4, (i + 1) % 4, 100 + i)
    };
    let mut acked = Vec::new();
    for i in 0..3 {
        let (status, answer, ..) =
            send_until_final(urls, 0, &format!("before-{i}"), &body(i), &seen).unwrap();
        assert_eq!(status, 201, "{answer}");
        acked.push((answer["transfer_id"].as_i64().unwrap(), 100 + i));
    }
    let old = cluster.ha(&["pause-primary"]);
    let paused = Instant::now();
    // while it stays paused, transfers keep coming; each is answered by the new primary
    let mut resumed = None;
    for i in 3..8 {
        let (status, answer, ..) = send_until_final(urls, 0, &format!("during-{i}"), &body(i), &seen)
            .unwrap_or_else(|| panic!("transfer {i} unanswered for 120 s with the old primary paused"));
        assert_eq!(status, 201, "{answer}");
        acked.push((answer["transfer_id"].as_i64().unwrap(), 100 + i));
        resumed.get_or_insert(paused.elapsed());
    }
    let resumed = resumed.unwrap();
    eprintln!(
        "writes resumed {resumed:?} after the pause, the old primary still paused ({:?} in all)",
        paused.elapsed()
    );
    assert!(resumed < Duration::from_secs(45), "writes resumed only {resumed:?} after the pause");
    // thawed, the old primary finds its leader key gone, demotes itself and follows
    cluster.ha(&["resume", &old]);
    cluster.ha(&["wait-settled", "180"]);
    let mut db = cluster.client();
    let table = transfers_table(&mut db);
    // what each node holds, for the failure's message
    let nodes: Vec<String> = (1..=3u16)
        .map(|n| {
            let at = format!(
                "host=127.0.0.1 port={} user=postgres dbname=postgres connect_timeout=5",
                cluster.port + n
            );
            match postgres::Client::connect(&at, postgres::NoTls) {
                Ok(mut c) => {
                    let standby: bool = c.query_one("SELECT pg_is_in_recovery()", &[]).unwrap().get(0);
                    format!(
                        "node{n} standby={standby} transfers={:?}",
                        transfers_table(&mut c).keys().collect::<Vec<_>>()
                    )
                }
                Err(e) => format!("node{n}: {e}"),
            }
        })
        .collect();
    for (id, amount) in &acked {
        assert_eq!(
            table.get(id).map(|t| t.2),
            Some(*amount),
            "acknowledged transfer {id} lost: acked {acked:?}\n{}\n{}",
            nodes.join("\n"),
            cluster.ha(&["status"])
        );
    }
    assert_eq!(table.len(), acked.len(), "a transfer nobody was told of: {table:?}");
    let total: i64 = db.query_one("SELECT sum(balance)::bigint FROM account", &[]).unwrap().get(0);
    assert_eq!(total, 4 * START);
    let port = cluster.port + old.parse::<u16>().unwrap();
    let at_old = format!("host=127.0.0.1 port={port} user=postgres dbname=postgres connect_timeout=5");
    let mut rejoined = postgres::Client::connect(&at_old, postgres::NoTls).unwrap();
    let in_recovery: bool = rejoined.query_one("SELECT pg_is_in_recovery()", &[]).unwrap().get(0);
    assert!(in_recovery, "the old primary is a standby after its pause");
    drop(serve);
}

#[test]
#[ignore = "long suite: cargo test --release -- --ignored"]
fn idem_chaos_over_three_instances_through_every_fault_of_the_database_pays_every_transfer_exactly_once() {
    let _heavy = crate::server::heavy();
    let Some(cluster) = Cluster::start() else { return };
    let out = tempfile::tempdir().unwrap();
    let run = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["chaos", "--instances", "3", "--fault", "mix", "--failover", "6", "--clients", "16"])
        .args(["--transfers", "15", "--seed", "20261203", "--budget", "30s"])
        .args(["--failover-cmd", &format!("{HA} inject {{fault}}"), "--heal-cmd", &format!("{HA} repair")])
        .args(["--primary-cmd", &format!("{HA} primary-node")])
        .arg("--db")
        .arg(&cluster.conninfo)
        .arg("--out")
        .arg(out.path())
        .env("PG_HA_ROOT", cluster.root.path())
        .env("PG_HA_PORT", cluster.port.to_string())
        .env("PG_HA_HOLD", "6")
        .output()
        .unwrap();
    let report = std::fs::read_to_string(out.path().join("chaos_report.md")).unwrap_or_default();
    eprintln!("{}{}\n{report}", String::from_utf8_lossy(&run.stdout), String::from_utf8_lossy(&run.stderr));
    assert!(run.status.success(), "idem chaos failed");
    let s: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("chaos.json")).unwrap()).unwrap();
    for (what, want) in [
        ("transfers_paid_twice", 0),
        ("transfers_lost", 0),
        ("transfers_unintended", 0),
        ("keys_left_claimed", 0),
    ] {
        assert_eq!(s[what], want, "{what}");
    }
    assert_eq!(s["balances_conserved"], true);
    // the day lasted as long as its faults needed: past the 240 planned
    assert!(s["transfers_intended"].as_u64().unwrap() > 240, "{s}");
    let faults = s["failovers"].as_array().unwrap();
    let kinds: Vec<&str> = faults.iter().map(|f| f["kind"].as_str().unwrap()).collect();
    let want: Vec<&str> = idem::harness::chaos::DB_FAULTS.iter().map(|(_, label)| *label).collect();
    assert_eq!(kinds, want, "each fault once, in turn");
    for f in faults {
        let kind = f["kind"].as_str().unwrap();
        let stopped =
            f["writes_unavailable_ms"].as_u64().unwrap_or_else(|| panic!("{kind}: writes never resumed"));
        assert!(stopped < 40_000, "{kind}: writes stopped for {stopped} ms");
        assert_eq!((f["lost"].as_u64(), f["paid_twice"].as_u64()), (Some(0), Some(0)), "{kind}");
        assert!(f["acknowledged"].as_u64().unwrap() > 0, "{kind}: the day went on after it");
    }
    // the primary gone, paused or without a quorum stopped writes for
    // seconds, with clients sending all along
    for f in faults.iter().filter(|f| {
        ["primary killed", "primary paused", "etcd quorum lost", "primary partitioned"]
            .contains(&f["kind"].as_str().unwrap())
    }) {
        assert!(f["writes_unavailable_ms"].as_u64().unwrap() > 2_000, "{f}");
        assert!(f["answered_503"].as_u64().unwrap() + f["unanswered"].as_u64().unwrap() > 0, "{f}");
    }
    // the picture shades the primary's node, and it moved
    let svg = std::fs::read_to_string(out.path().join("chaos_timeline.svg")).unwrap();
    let nodes =
        ["node1", "node2", "node3"].iter().filter(|n| svg.contains(&format!("<title>{n}</title>"))).count();
    assert!(nodes >= 2, "the primary moved between nodes on the timeline");
    // the cluster is whole again, every faulted node a standby
    cluster.ha(&["wait-settled", "60"]);
}
