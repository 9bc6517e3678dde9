//! `cargo bench --bench idem` (or `just bench`): medians and ratios, every
//! comparison measured in the same run on the same machine.
//!
//! 1. the disk's own limit: the fsync rate, since a durable commit cannot beat it;
//! 2. `idem_api` per invocation, process start included (new, replay, 409,
//!    422), against the lab's Python approach (`bench/baseline_idem_api.py`,
//!    run with the interpreter binary itself), and its peak memory;
//! 3. in process on a file database with production durability: new
//!    transfers and replays per second;
//! 4. contention: threads on one key and on distinct keys;
//! 5. growth: one request and one purge as the key table grows 10^3 → 10^6.
//!
//! `IDEM_BENCH_QUICK=1` shrinks the sample counts and stops growth at 10^5.

use idem::clock::Timestamp;
use idem::policy::Policy;
use idem::protocol::{self, Ctx, Flow, Outcome};
use idem::request::{self, Request};
use idem::store::sqlite::SqliteStore;
use rusqlite::Connection;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

const API: &str = env!("CARGO_BIN_EXE_idem_api");
/// 71 hours before the in-process clock (2026-12-01T00:00:00Z).
const PRELOAD_START: &str = "2026-11-28T01:00:00Z";

fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

fn quick() -> bool {
    std::env::var("IDEM_BENCH_QUICK").is_ok()
}

fn n(full: usize) -> usize {
    if quick() { (full / 5).max(10) } else { full }
}

fn bank(dir: &Path, name: &str) -> PathBuf {
    let db = dir.join(name);
    let conn = Connection::open(&db).unwrap();
    conn.execute_batch(
        "CREATE TABLE account (acct_id TEXT PRIMARY KEY, holder TEXT, balance INTEGER);
         INSERT INTO account VALUES ('A', 'a', 9000000000000000), ('B', 'b', 0);",
    )
    .unwrap();
    db
}

fn request_text(key: &str, amount: i64) -> String {
    format!(
        r#"{{"client_id":"bench","endpoint":"/v1/transfers","idem_key":"{key}","body":{{"src":"A","dst":"B","amount":{amount},"currency":"KRW"}}}}"#
    )
}

fn write_requests(dir: &Path, prefix: &str, count: usize, amount: i64) -> Vec<PathBuf> {
    (0..count)
        .map(|i| {
            let path = dir.join(format!("{prefix}-{i}.json"));
            std::fs::write(&path, request_text(&format!("{prefix}-{i}"), amount)).unwrap();
            path
        })
        .collect()
}

/// Wall time in microseconds of `program… --db db --request file`; checks the answer.
fn invoke(program: &[&str], db: &Path, file: &Path, want: &str) -> f64 {
    let start = Instant::now();
    let out = Command::new(program[0])
        .args(&program[1..])
        .arg("--db")
        .arg(db)
        .arg("--request")
        .arg(file)
        .output()
        .unwrap();
    let micros = start.elapsed().as_secs_f64() * 1e6;
    let stdout = String::from_utf8_lossy(&out.stdout).replace(' ', "");
    assert!(stdout.contains(want), "{program:?}: expected {want}, got {stdout}");
    micros
}

/// Peak resident set of the largest child waited for so far, in KiB.
fn children_max_rss_kib() -> i64 {
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes into the struct we own; RUSAGE_CHILDREN is valid.
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage) };
    usage.ru_maxrss
}

/// The peak RSS line: exact when no Python child ran (getrusage reports the
/// largest child), otherwise measured by a separate idem_api run first.
fn children_max_rss_kib_before_python(py: &Option<String>) -> String {
    let kib = children_max_rss_kib();
    match py {
        None => format!("{:.1} MiB (getrusage over all idem_api children).", kib as f64 / 1024.0),
        Some(_) => format!(
            "{:.1} MiB measured before the Python runs (getrusage, largest child).",
            PEAK_BEFORE_PYTHON.load(std::sync::atomic::Ordering::Relaxed) as f64 / 1024.0
        ),
    }
}

static PEAK_BEFORE_PYTHON: std::sync::atomic::AtomicI64 = std::sync::atomic::AtomicI64::new(0);

fn python() -> Option<String> {
    let out = Command::new("python3")
        .args(["-c", "import os, sys; print(os.path.realpath(sys.executable))"])
        .output()
        .ok()?;
    out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Writes one 4 KiB page into a preallocated file and waits for the disk:
/// the floor under a durable commit. SQLite's WAL, once grown, is rewritten
/// in place from its start after each checkpoint, so the probe overwrites in
/// place too (cycling over 4 MiB) instead of growing the file.
fn fsync_once(file: &mut std::fs::File) -> f64 {
    use std::io::{Seek, SeekFrom};
    const SPAN: u64 = 4 << 20;
    let at = file.stream_position().unwrap() % SPAN;
    if file.metadata().unwrap().len() < SPAN {
        file.set_len(SPAN).unwrap();
        file.sync_all().unwrap();
    }
    file.seek(SeekFrom::Start(at)).unwrap();
    timed(|| {
        file.write_all(&[7u8; 4096]).unwrap();
        file.sync_data().unwrap();
    })
}

fn timed(f: impl FnOnce()) -> f64 {
    let start = Instant::now();
    f();
    start.elapsed().as_secs_f64() * 1e6
}

fn fsync_per_second(dir: &Path) -> (f64, f64) {
    let mut file = std::fs::File::create(dir.join("fsync.bin")).unwrap();
    let m = median((0..n(500)).map(|_| fsync_once(&mut file)).collect());
    (m, 1e6 / m)
}

struct InProcess {
    store: SqliteStore,
    now: Timestamp,
    counter: u64,
}

impl InProcess {
    fn open(db: &Path) -> Self {
        InProcess {
            store: SqliteStore::open(db, Policy::embedded()).unwrap(),
            now: Timestamp::parse("2026-12-01T00:00:00Z").unwrap(),
            counter: 0,
        }
    }
    fn send(&mut self, req: &Request) -> (u16, bool) {
        self.counter += 1;
        let token = format!("bench-{}", self.counter);
        let ctx = Ctx { policy: Policy::embedded(), now: self.now, token: &token };
        match protocol::handle(&mut self.store, req, ctx, &mut |_| Flow::Continue).unwrap() {
            Outcome::Respond(r) => (r.status, r.replay),
            other => panic!("{other:?}"),
        }
    }
}

fn parsed(key: &str) -> Request {
    request::parse(request_text(key, 1).as_bytes(), Policy::embedded()).unwrap()
}

/// Per-request median (µs) of sending `reqs` in order, each answered `want`.
fn run_in_process(p: &mut InProcess, reqs: &[Request], want: (u16, bool)) -> f64 {
    median(reqs.iter().map(|r| timed(|| assert_eq!(p.send(r), want))).collect())
}

fn main() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    println!(
        "idem benchmark ({}), {} cores",
        if quick() { "quick" } else { "full" },
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );

    // 1. The physical limit.
    let (fsync_us, fsync_rate) = fsync_per_second(dir);
    println!(
        "\n## The disk\n\n| measure | median |\n|---|---:|\n| overwrite 4 KiB + fdatasync | {fsync_us:.0} µs ({fsync_rate:.0}/s) |"
    );

    // 2. Per invocation, process start included. idem_api and the Python
    // peer alternate within each round, so a burst of machine noise lands on
    // both sides of every ratio.
    let count = n(200);
    let db = bank(dir, "api.db");
    let new_files = write_requests(dir, "new", count, 1);
    let stuck = write_requests(dir, "stuck", 1, 1);
    let _ = Command::new(API)
        .arg("--db")
        .arg(&db)
        .arg("--request")
        .arg(&stuck[0])
        .arg("--crash-after-claim")
        .output();
    let baseline = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/..")).join("bench/baseline_idem_api.py");
    let pdb = bank(dir, "python.db");
    let py_count = n(60);
    let py_files = write_requests(dir, "py", py_count, 1);
    // Peak memory first, while every child so far has been an idem_api.
    for f in new_files.iter().take(5) {
        invoke(&[API], &db, f, "\"status\":201");
        invoke(&[API], &db, f, "\"replay\":true");
    }
    PEAK_BEFORE_PYTHON.store(children_max_rss_kib(), std::sync::atomic::Ordering::Relaxed);
    let py = python();
    let new_files = write_requests(dir, "fresh", count, 1);
    // the same keys with another amount
    let mismatched: Vec<PathBuf> = (0..count)
        .map(|i| {
            let path = dir.join(format!("mismatch-{i}.json"));
            std::fs::write(&path, request_text(&format!("fresh-{i}"), 2)).unwrap();
            path
        })
        .collect();
    let (mut ours, mut theirs) = (vec![Vec::new(); 4], vec![Vec::new(); 2]);
    let mut floor = Vec::new();
    for i in 0..count {
        floor.push(timed(|| assert!(Command::new("true").status().unwrap().success())));
        ours[0].push(invoke(&[API], &db, &new_files[i], "\"status\":201,\"replay\":false"));
        ours[1].push(invoke(&[API], &db, &new_files[i], "\"replay\":true"));
        ours[2].push(invoke(&[API], &db, &stuck[0], "\"status\":409"));
        ours[3].push(invoke(&[API], &db, &mismatched[i], "\"status\":422"));
        if let (Some(py), true) = (&py, i * py_count % count < py_count && i * py_count / count < py_count) {
            let f = &py_files[i * py_count / count];
            let prog = [py.as_str(), baseline.to_str().unwrap()];
            theirs[0].push(invoke(&prog, &pdb, f, "\"status\":201,\"replay\":false"));
            theirs[1].push(invoke(&prog, &pdb, f, "\"replay\":true"));
        }
    }
    let peak_kib = children_max_rss_kib_before_python(&py);
    println!("\n## `idem_api` per invocation, process start included ({count} runs each)\n");
    println!("| request | idem_api | Python baseline | ratio |\n|---|---:|---:|---:|");
    let names = ["new transfer (201)", "replay", "in progress (409)", "fingerprint mismatch (422)"];
    for (k, name) in names.iter().enumerate() {
        let o = median(ours[k].clone());
        match theirs.get(k).filter(|t| !t.is_empty()) {
            Some(t) => {
                let t = median(t.clone());
                println!("| {name} | {:.2} ms | {:.2} ms | **{:.1}×** |", o / 1e3, t / 1e3, t / o)
            }
            None => println!("| {name} | {:.2} ms | — | — |", o / 1e3),
        }
    }
    println!("| (floor: start and wait for `true`) | {:.2} ms | | |", median(floor) / 1e3);
    println!("\nPeak memory of one process: {peak_kib}");
    if let Some(py) = &py {
        println!("Baseline: `{py} bench/baseline_idem_api.py` ({} runs each).", theirs[0].len());
    }

    // 3. In process, production durability (WAL; claim NORMAL, execution
    // FULL). The disk's fsync rate drifts on a shared machine, so fsyncs and
    // transfers alternate in small batches and each side takes its median.
    let db = bank(dir, "inproc.db");
    let mut p = InProcess::open(&db);
    let count = n(2_000);
    let reqs: Vec<Request> = (0..count).map(|i| parsed(&format!("in-{i}"))).collect();
    let mut sync_file = std::fs::File::create(dir.join("fsync-interleaved.bin")).unwrap();
    let (mut syncs, mut news) = (Vec::new(), Vec::new());
    for batch in reqs.chunks(20) {
        syncs.extend((0..batch.len()).map(|_| fsync_once(&mut sync_file)));
        news.extend(batch.iter().map(|r| timed(|| assert_eq!(p.send(r), (201, false)))));
    }
    let (sync_med, new_med) = (median(syncs), median(news));
    let rep_med = run_in_process(&mut p, &reqs, (201, true));
    println!("\n## In process, file database, production durability ({count} requests)\n");
    println!("| measure | median | per second (from the median) | ratio |\n|---|---:|---:|---:|");
    println!(
        "| overwrite 4 KiB + fdatasync, interleaved with the transfers | {sync_med:.0} µs | {:.0} | |",
        1e6 / sync_med
    );
    println!(
        "| new transfer | {new_med:.0} µs | {:.0} | **{:.0}%** of the fsync rate |",
        1e6 / new_med,
        100.0 * sync_med / new_med
    );
    println!(
        "| replay | {rep_med:.1} µs | {:.0} | **{:.1}×** the new-transfer rate |",
        1e6 / rep_med,
        new_med / rep_med
    );
    let (new_rate, rep_rate) = (1e6 / new_med, 1e6 / rep_med);

    // 4. Contention: threads, each with its own connection, on one file.
    let threads = 4;
    let per_thread = n(500);
    println!("\n## Contention: {threads} threads × {per_thread} requests, one file\n");
    println!("| workload | total throughput | vs one thread |\n|---|---:|---:|");
    for (name, same_key) in
        [("distinct keys (all new)", false), ("one key (1 transfer, the rest replays)", true)]
    {
        let db = bank(dir, &format!("contention-{same_key}.db"));
        InProcess::open(&db); // create the schema before the race
        let started = Instant::now();
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let db = db.clone();
                std::thread::spawn(move || {
                    let mut p = InProcess::open(&db);
                    for i in 0..per_thread {
                        let key = if same_key { "hot".to_string() } else { format!("t{t}-{i}") };
                        let (status, _) = p.send(&parsed(&key));
                        assert!(status == 201 || status == 409, "{status}");
                    }
                })
            })
            .collect();
        handles.into_iter().for_each(|h| h.join().unwrap());
        let rate = (threads * per_thread) as f64 / started.elapsed().as_secs_f64();
        let single = if same_key { rep_rate } else { new_rate };
        println!("| {name} | {rate:.0}/s | {:.2}× |", rate / single);
        let conn = Connection::open(&db).unwrap();
        let transfers: i64 = conn.query_row("SELECT COUNT(*) FROM transfer", [], |r| r.get(0)).unwrap();
        assert_eq!(transfers as usize, if same_key { 1 } else { threads * per_thread });
    }

    // 5. Growth of the key table.
    println!("\n## Growth: cost of one request and one purge as the key table grows\n");
    println!(
        "| keys | new transfer | replay | purge 1000 oldest | new vs 10^3 |\n|---:|---:|---:|---:|---:|"
    );
    let sizes: &[usize] =
        if quick() { &[1_000, 10_000, 100_000] } else { &[1_000, 10_000, 100_000, 1_000_000] };
    let mut first_new = None;
    for &size in sizes {
        let db = bank(dir, &format!("growth-{size}.db"));
        let mut p = InProcess::open(&db);
        preload(p.store.connection(), size);
        let probes = n(500);
        let fresh: Vec<Request> = (0..probes).map(|i| parsed(&format!("probe-{i}"))).collect();
        let old: Vec<Request> = (0..probes).map(|i| parsed(&format!("pre-{}", (i * 7919) % size))).collect();
        let new_med = run_in_process(&mut p, &fresh, (201, false));
        let rep_med = run_in_process(&mut p, &old, (201, true));
        let start = Instant::now();
        let purged = protocol::purge(
            &mut p.store,
            Timestamp::parse(PRELOAD_START).unwrap().plus_seconds(250),
            Policy::embedded(),
        )
        .unwrap();
        let purge_ms = start.elapsed().as_secs_f64() * 1e3;
        assert_eq!(purged, 1000);
        let base = *first_new.get_or_insert(new_med);
        println!(
            "| {size} | {new_med:.0} µs | {rep_med:.1} µs | {purge_ms:.2} ms | {:.2}× |",
            new_med / base
        );
        if size == *sizes.last().unwrap() {
            println!("\nQuery plans at {size} keys:\n");
            for sql in [
                "SELECT fingerprint FROM idem_key WHERE client_id = 'c' AND endpoint = 'e' AND idem_key = 'k'",
                "DELETE FROM idem_key WHERE created_at < '2026-11-28'",
                "SELECT balance FROM account WHERE acct_id = 'A'",
            ] {
                let plan: Vec<String> = p
                    .store
                    .connection()
                    .prepare(&format!("EXPLAIN QUERY PLAN {sql}"))
                    .unwrap()
                    .query_map([], |r| r.get::<_, String>(3))
                    .unwrap()
                    .collect::<Result<_, _>>()
                    .unwrap();
                println!("- `{sql}`: {}", plan.join("; "));
            }
        }
    }
}

/// `size` completed keys, four a second from 71 hours before the bench clock
/// (all within retention), as if from real traffic.
fn preload(conn: &Connection, size: usize) {
    conn.execute_batch("BEGIN").unwrap();
    let start = Timestamp::parse(PRELOAD_START).unwrap();
    {
        let mut stmt = conn
            .prepare(
                "INSERT INTO idem_key (client_id, endpoint, idem_key, fingerprint, state, token, created_at,
                                       lease_until, status, reason, body, completed_at)
                 VALUES ('bench', '/v1/transfers', ?1, ?2, 'completed', 't', ?3, ?3, 201, NULL, ?4, ?3)",
            )
            .unwrap();
        let fp = parsed("x").fingerprint;
        for i in 0..size {
            let at = start.plus_millis(i as i64 * 250).to_string();
            let body = format!(
                r#"{{"transfer_id":{i},"src":"A","dst":"B","amount":1,"currency":"KRW","created_at":"{at}"}}"#
            );
            stmt.execute((format!("pre-{i}"), &fp, &at, body)).unwrap();
        }
    }
    conn.execute_batch("COMMIT").unwrap();
}
