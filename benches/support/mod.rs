//! What the benches share: a real `idem serve` as a child process, a lean
//! keep-alive HTTP/1.1 client, percentiles, and where pgbench is.
// Each bench uses part of it.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub const IDEM: &str = env!("CARGO_BIN_EXE_idem");
pub const TOKEN: &str = "tok-bench";

/// The accounts the benches' banks hold, `a0` to `a999`.
pub const ACCOUNTS: usize = 1000;

/// The `i`-th transfer of `amount`: its accounts spread over all of them.
pub fn body(i: u64, amount: i64) -> String {
    let src = i as usize % ACCOUNTS;
    let dst = (src + 1 + (i as usize / ACCOUNTS) % (ACCOUNTS - 1)) % ACCOUNTS;
    format!(r#"{{"src":"a{src}","dst":"a{dst}","amount":{amount},"currency":"KRW"}}"#)
}

/// Each phase's length: `IDEM_BENCH_SECONDS`, default 3.
pub fn seconds() -> Duration {
    Duration::from_secs_f64(
        std::env::var("IDEM_BENCH_SECONDS").ok().and_then(|s| s.parse().ok()).unwrap_or(3.0),
    )
}

pub struct Server {
    pub child: Child,
    pub address: String,
}

impl Server {
    pub fn start(db: &str, dir: &Path, extra: &[&str]) -> Server {
        Server::start_bin(IDEM, db, dir, extra)
    }

    pub fn start_bin(bin: &str, db: &str, dir: &Path, extra: &[&str]) -> Server {
        let clients = dir.join("clients.json");
        std::fs::write(&clients, format!("{{\"{TOKEN}\": \"bench\"}}")).unwrap();
        let mut child = Command::new(bin)
            .args(["serve", "--db", db, "--listen", "127.0.0.1:0", "--pool", "64", "--clients"])
            .arg(&clients)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        Server { child, address: line.trim().trim_start_matches("http://").to_owned() }
    }

    /// The server's CPU time so far (user plus system), all threads, and
    /// that of its threads named `thread` (the SQLite writer: `idem-writer`).
    pub fn cpu(&self, thread: &str) -> (Duration, Duration) {
        let ticks = |path: &Path| stat_fields(path).map_or(0, |f| f[11] + f[12]);
        let pid = self.child.id();
        let all = ticks(Path::new(&format!("/proc/{pid}/stat")));
        let mut named = 0;
        for task in std::fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().flatten() {
            let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
            if comm.trim() == thread {
                named += ticks(&task.path().join("stat"));
            }
        }
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
        (Duration::from_micros(all * 1_000_000 / hz), Duration::from_micros(named * 1_000_000 / hz))
    }

    /// The server's peak resident memory so far, in MiB.
    pub fn peak_rss_mib(&self) -> f64 {
        self.status_mib("VmHWM:")
    }

    pub fn rss_mib(&self) -> f64 {
        self.status_mib("VmRSS:")
    }

    /// A memory figure of /proc/PID/status, in MiB.
    fn status_mib(&self, field: &str) -> f64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap_or_default();
        let kib = status
            .lines()
            .find(|l| l.starts_with(field))
            .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok());
        kib.unwrap_or(0.0) / 1024.0
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

/// One keep-alive HTTP/1.1 connection, as lean as a load generator can be.
pub struct Conn {
    stream: BufReader<TcpStream>,
}

impl Conn {
    pub fn open(address: &str) -> Conn {
        let stream = TcpStream::connect(address).unwrap();
        stream.set_nodelay(true).unwrap();
        Conn { stream: BufReader::new(stream) }
    }

    /// Posts a transfer; returns (status, replayed, transfer_id).
    pub fn post(&mut self, key: &str, body: &str) -> (u16, bool, Option<i64>) {
        let request = format!(
            "POST /v1/transfers HTTP/1.1\r\nHost: b\r\nAuthorization: Bearer {TOKEN}\r\nIdempotency-Key: \"{key}\"\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        self.stream.get_mut().write_all(request.as_bytes()).unwrap();
        let (mut status, mut length, mut replayed) = (0, 0, false);
        let mut line = String::new();
        loop {
            line.clear();
            self.stream.read_line(&mut line).unwrap();
            let l = line.trim_end();
            if l.is_empty() {
                break;
            }
            if let Some(rest) = l.strip_prefix("HTTP/1.1 ") {
                status = rest[..3].parse().unwrap();
            } else if let Some((name, value)) = l.split_once(':') {
                match name.to_ascii_lowercase().as_str() {
                    "content-length" => length = value.trim().parse().unwrap(),
                    "idempotent-replayed" => replayed = true,
                    _ => {}
                }
            }
        }
        let mut body = vec![0; length];
        self.stream.read_exact(&mut body).unwrap();
        let id =
            serde_json::from_slice::<serde_json::Value>(&body).ok().and_then(|v| v["transfer_id"].as_i64());
        (status, replayed, id)
    }
}

/// The value of the metric line that starts with `name` (labels included)
/// on `address`'s `/metrics`, if it has one.
pub fn metric(address: &str, name: &str) -> Option<f64> {
    let mut stream = TcpStream::connect(address).ok()?;
    stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: b\r\nConnection: close\r\n\r\n").ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).ok()?;
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// The median of `samples` (the upper one of an even count).
pub fn median(mut samples: Vec<f64>) -> f64 {
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}

/// The numeric fields of a `/proc/…/stat` file after the command's name:
/// [0] is the state, [1] the parent, [11..15] utime, stime, cutime, cstime
/// (ticks). None if it is gone or short.
pub fn stat_fields(path: &Path) -> Option<Vec<u64>> {
    let text = std::fs::read_to_string(path).ok()?;
    let fields: Vec<u64> =
        text.rsplit_once(')')?.1.split_whitespace().map(|f| f.parse().unwrap_or(0)).collect();
    (fields.len() > 14).then_some(fields)
}

/// The `p` quantile of `sorted` microseconds, in milliseconds.
pub fn percentile(sorted: &[u32], p: f64) -> f64 {
    sorted.get(((sorted.len() as f64 - 1.0) * p) as usize).map_or(0.0, |v| f64::from(*v) / 1000.0)
}

/// pgbench, on the PATH or where Debian keeps PostgreSQL's programs.
pub fn pgbench_bin() -> Option<PathBuf> {
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .chain(
            std::fs::read_dir("/usr/lib/postgresql")
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path().join("bin")),
        )
        .map(|d| d.join("pgbench"))
        .find(|p| p.is_file())
}
