//! A real `idem serve` on 127.0.0.1:0 and a real HTTP client (ureq) to
//! talk to it. Every answer a test sees is checked against the service's
//! own `/openapi.json`: a status the description does not list fails.

use serde_json::Value;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

pub const IDEM: &str = env!("CARGO_BIN_EXE_idem");

/// The tests that load the whole machine (a replicated cluster failing
/// over, a chaos day): one at a time, so that on two cores none stretches
/// the timings another one measures (a Patroni loop that overruns its
/// lease under load elects no leader at all).
pub static HEAVY: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Takes [`HEAVY`] for the rest of the calling test.
pub fn heavy() -> std::sync::MutexGuard<'static, ()> {
    HEAVY.lock().unwrap_or_else(|e| e.into_inner())
}

pub struct Serve {
    child: Option<Child>,
    pub url: String,
    pub stderr: PathBuf,
    _dir: tempfile::TempDir,
}

/// One HTTP answer.
#[derive(Debug, Clone)]
pub struct Http {
    pub status: u16,
    pub headers: BTreeMap<String, String>,
    pub body: String,
}

impl Http {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or(Value::Null)
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }
    pub fn reason(&self) -> Option<String> {
        self.json()["reason"].as_str().map(String::from)
    }
}

impl Serve {
    /// Starts `idem serve` on `db` with `clients` (token, client id) and
    /// extra arguments; waits for its first line.
    pub fn start(db: &Path, clients: &[(&str, &str)], args: &[&str], env: &[(&str, &str)]) -> Serve {
        Self::start_with(db, clients, args, |cmd| {
            cmd.envs(env.iter().copied());
        })
    }

    /// [`Serve::start`], with `configure` applied to the command last (its
    /// stderr, limits, environment).
    pub fn start_with(
        db: &Path,
        clients: &[(&str, &str)],
        args: &[&str],
        configure: impl FnOnce(&mut Command),
    ) -> Serve {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("clients.json");
        let map: BTreeMap<&str, &str> = clients.iter().copied().collect();
        std::fs::write(&file, serde_json::to_string(&map).unwrap()).unwrap();
        let stderr = dir.path().join("serve.log");
        let mut cmd = Command::new(IDEM);
        cmd.arg("serve")
            .arg("--db")
            .arg(db)
            .args(["--listen", "127.0.0.1:0", "--clients"])
            .arg(&file)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).unwrap());
        configure(&mut cmd);
        let mut child = cmd.spawn().unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        assert!(
            line.starts_with("http://127.0.0.1:"),
            "first line {line:?}; log: {}",
            std::fs::read_to_string(&stderr).unwrap_or_default()
        );
        Serve { child: Some(child), url: line.trim().to_owned(), stderr, _dir: dir }
    }

    /// Runs `idem serve` on `db` with the clients file `clients`, for a
    /// test that expects it to refuse to start: its exit and output.
    pub fn refused(db: &Path, clients: &Path) -> std::process::Output {
        Command::new(IDEM)
            .arg("serve")
            .arg("--db")
            .arg(db)
            .arg("--clients")
            .arg(clients)
            .args(["--listen", "127.0.0.1:0"])
            .output()
            .unwrap()
    }

    pub fn agent() -> ureq::Agent {
        ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(30)))
            .build()
            .into()
    }

    /// `POST /v1/transfers` with an optional bearer token and key header.
    pub fn post(&self, token: Option<&str>, key: Option<&str>, body: &str) -> Http {
        self.post_with(token, key, &[], body)
    }

    /// [`Serve::post`] with more headers.
    pub fn post_with(
        &self,
        token: Option<&str>,
        key: Option<&str>,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Http {
        let mut req = Self::agent()
            .post(format!("{}/v1/transfers", self.url))
            .header("Content-Type", "application/json");
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        if let Some(token) = token {
            req = req.header("Authorization", format!("Bearer {token}"));
        }
        if let Some(key) = key {
            req = req.header("Idempotency-Key", key);
        }
        documented("post", "/v1/transfers", read(req.send(body)))
    }

    pub fn get(&self, path: &str, token: Option<&str>) -> Http {
        let mut req = Self::agent().get(format!("{}{path}", self.url));
        if let Some(token) = token {
            req = req.header("Authorization", format!("Bearer {token}"));
        }
        let template = match path {
            p if p.starts_with("/v1/transfers/") => "/v1/transfers/{id}",
            p if p.starts_with("/v1/payouts/") => "/v1/payouts/{id}",
            p if p.starts_with("/problems/") => "/problems/{reason}",
            p => p,
        };
        documented("get", template, read(req.call()))
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().unwrap().id() as i32
    }

    /// The server's user plus system CPU time so far, and its peak RSS.
    pub fn cpu_and_peak_rss(&self) -> (std::time::Duration, u64) {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).unwrap();
        let fields: Vec<&str> = stat.rsplit_once(')').unwrap().1.split_whitespace().collect();
        let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        let kib = status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .map_or(0, |v| v.trim().trim_end_matches("kB").trim().parse().unwrap());
        (std::time::Duration::from_millis(ticks * 1000 / hz), kib * 1024)
    }

    /// SIGTERM; returns the exit code.
    pub fn stop(mut self) -> Option<i32> {
        let mut child = self.child.take().unwrap();
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        child.wait().unwrap().code()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// The log once `done` holds of it, or as it is after 5 s: lines are
    /// written by a thread of the service's own, a moment after the answer.
    pub fn log_when(&self, done: impl Fn(&str) -> bool) -> String {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let log = self.log();
            if done(&log) || std::time::Instant::now() > deadline {
                return log;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

pub fn read(result: Result<ureq::http::Response<ureq::Body>, ureq::Error>) -> Http {
    let mut response = result.unwrap();
    let headers = response
        .headers()
        .iter()
        .map(|(k, v)| (k.as_str().to_ascii_lowercase(), v.to_str().unwrap_or("").to_owned()))
        .collect();
    let status = response.status().as_u16();
    let body = response.body_mut().read_to_string().unwrap_or_default();
    Http { status, headers, body }
}

/// The service's OpenAPI description.
pub fn openapi() -> &'static Value {
    static DOC: OnceLock<Value> = OnceLock::new();
    DOC.get_or_init(|| {
        serde_json::from_str(include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../src/service/openapi.json"
        )))
        .unwrap()
    })
}

/// Fails unless `/openapi.json` documents `status` for the operation, and
/// every error is a problem+json with the members the description promises.
pub fn documented(method: &str, path: &str, http: Http) -> Http {
    let op = &openapi()["paths"][path][method];
    assert!(op.is_object(), "{method} {path} is not documented");
    assert!(
        op["responses"][http.status.to_string()].is_object(),
        "{method} {path} answered {} undocumented: {}",
        http.status,
        http.body
    );
    if http.status >= 400 {
        assert_eq!(http.header("content-type"), Some("application/problem+json"), "{}", http.body);
        let p = http.json();
        for member in ["type", "title", "detail", "reason"] {
            assert!(p[member].is_string(), "problem without {member}: {}", http.body);
        }
        assert_eq!(p["status"].as_u64(), Some(u64::from(http.status)));
        // its type is the page of its reason (or of refusals in a gateway's
        // words), documented, and linked as described-by
        let kind = p["type"].as_str().unwrap_or_default().strip_prefix("/problems/").unwrap_or_default();
        let known = openapi()["paths"]["/problems/{reason}"]["get"]["parameters"][0]["schema"]["enum"]
            .as_array()
            .is_some_and(|e| e.iter().any(|r| r == kind));
        assert!(
            known && (kind == p["reason"] || kind == "refused"),
            "problem type {}: {}",
            p["type"],
            http.body
        );
        assert_eq!(
            http.header("link"),
            Some(format!("<{}>; rel=\"describedby\"", p["type"].as_str().unwrap_or_default()).as_str())
        );
    }
    http
}

/// The compact JSON of a transfer body.
pub fn body(src: &Value, dst: &Value, amount: i64) -> String {
    serde_json::json!({"src": src, "dst": dst, "amount": amount, "currency": "KRW"}).to_string()
}

/// A running `idem gateway`, its URL and its ledger file.
pub struct Gateway {
    child: Child,
    pub url: String,
    pub db: PathBuf,
    _dir: tempfile::TempDir,
}

impl Gateway {
    pub fn start(args: &[&str]) -> Gateway {
        let dir = tempfile::tempdir().unwrap();
        let db = dir.path().join("gateway.db");
        let mut child = Command::new(IDEM)
            .arg("gateway")
            .arg("--db")
            .arg(&db)
            .args(["--listen", "127.0.0.1:0"])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let scheme = if args.contains(&"--tls") { "https" } else { "http" };
        assert!(line.starts_with(&format!("{scheme}://127.0.0.1:")), "first line {line:?}");
        Gateway { child, url: line.trim().to_owned(), db, _dir: dir }
    }

    /// [`Gateway::start`] serving HTTPS with a certificate of its own, and
    /// the file that certificate is in (for a client's `IDEM_CA_FILE`).
    pub fn start_tls(args: &[&str]) -> (Gateway, PathBuf) {
        let ca = tempfile::NamedTempFile::new().unwrap().into_temp_path().keep().unwrap();
        let ca_arg = ca.to_str().unwrap().to_owned();
        let gw = Gateway::start(&[&["--tls", "--tls-cert-out", &ca_arg][..], args].concat());
        (gw, ca)
    }

    /// `POST /payouts`: the status and JSON answer, or `None` when the
    /// connection closed unanswered.
    pub fn pay(&self, key: &str, body: &str, token: Option<&str>) -> Option<(u16, Value)> {
        let mut req = Serve::agent().post(format!("{}/payouts", self.url)).header("Idempotency-Key", key);
        if let Some(token) = token {
            req = req.header("Authorization", format!("Bearer {token}"));
        }
        let mut response = req.send(body).ok()?;
        let text = response.body_mut().read_to_string().ok()?;
        Some((response.status().as_u16(), serde_json::from_str(&text).unwrap()))
    }

    pub fn look(&self, key: &str) -> (u16, Value) {
        let mut response = Serve::agent().get(format!("{}/payouts/{key}", self.url)).call().unwrap();
        let text = response.body_mut().read_to_string().unwrap();
        (response.status().as_u16(), serde_json::from_str(&text).unwrap())
    }

    /// (key, amount, status) of every ledger row.
    pub fn ledger(&self) -> Vec<(String, i64, String)> {
        ledger(&self.db)
    }
}

pub fn ledger(db: &Path) -> Vec<(String, i64, String)> {
    let conn = idem::outside::gateway::open(db).unwrap();
    idem::outside::gateway::ledger(&conn).unwrap().into_iter().map(|p| (p.key, p.amount, p.status)).collect()
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Raises this process's soft descriptor limit to the hard one.
pub fn more_descriptors() -> u64 {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit);
        limit.rlim_cur = limit.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
    }
    limit.rlim_cur
}
