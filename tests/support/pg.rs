//! A throwaway PostgreSQL server for the tests, from the machine's own
//! binaries: `initdb` into a temporary directory, a server listening only on
//! a unix socket there, run as the `postgres` user when the tests run as
//! root. One server per test binary, started on first use; each test gets a
//! schema of its own. A test that restarts PostgreSQL does it to a server of
//! its own ([`own_server`]), so the shared one never cuts the connections of
//! the tests running beside it. `IDEM_PG_URL` points the tests at an
//! existing server instead (then nothing is restarted).
//!
//! The server is a child of a thread that lives as long as the test process
//! and asks the kernel to kill it when that thread goes (PR_SET_PDEATHSIG):
//! a test run that ends, passes, fails or is killed leaves no server behind.
//! With `IDEM_REQUIRE_TOOLS=1` (CI), a machine without PostgreSQL fails the
//! tests that need it instead of skipping them.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// A role that must give its password, for the tests of secrets.
pub const PASSWORD_ROLE: &str = "pwuser";
pub const PASSWORD: &str = "s3cret-Passw0rd-for-idem";

pub struct Server {
    /// libpq key/value connection string without a schema, or IDEM_PG_URL.
    base: String,
    /// Asks the thread that owns the server to stop it with a signal and
    /// start it again; it answers how long the stop took. None if external.
    ctl: Option<Mutex<Sender<Stop>>>,
    socket_dir: Option<PathBuf>,
}

/// A signal to stop the server with, and where to say how long it took.
type Stop = (i32, Sender<Duration>);

static SERVER: OnceLock<Option<Server>> = OnceLock::new();

/// How long a stop may take before the server is killed instead.
pub const STOP_WAIT: Duration = Duration::from_secs(30);
static SCHEMAS: AtomicU64 = AtomicU64::new(0);

/// The server, started on first use; `None` when PostgreSQL is not installed
/// and the tools are not required.
pub fn server() -> Option<&'static Server> {
    SERVER.get_or_init(start).as_ref()
}

/// A server nobody else uses, for a test that restarts it; it lives as long
/// as the test process. `None` as for [`server`].
pub fn own_server() -> Option<&'static Server> {
    start().map(|s| &*Box::leak(Box::new(s)))
}

fn required() -> bool {
    std::env::var_os("IDEM_REQUIRE_TOOLS").is_some()
}

/// The directory holding `initdb`, `postgres` and `pg_ctl`.
fn bin_dir() -> Option<PathBuf> {
    let on_path =
        std::env::var_os("PATH").into_iter().flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>());
    let debian = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join("bin"));
    let mut debian: Vec<PathBuf> = debian.collect();
    debian.sort(); // the newest version last
    on_path
        .chain(debian.into_iter().rev())
        .find(|d| d.join("initdb").is_file() && d.join("postgres").is_file())
}

/// uid and gid of the `postgres` user, when running as root.
fn postgres_user() -> Option<(u32, u32)> {
    if unsafe { libc::geteuid() } != 0 {
        return None;
    }
    let name = std::ffi::CString::new("postgres").unwrap();
    let pw = unsafe { libc::getpwnam(name.as_ptr()) };
    assert!(!pw.is_null(), "running as root, but there is no postgres user to run the server as");
    Some(unsafe { ((*pw).pw_uid, (*pw).pw_gid) })
}

/// A command that runs as `user` (when given), and is killed with SIGKILL
/// when the thread that spawns it ends.
fn as_user(program: &Path, user: Option<(u32, u32)>, die_with_parent: bool) -> Command {
    let mut cmd = Command::new(program);
    unsafe {
        cmd.pre_exec(move || {
            if let Some((uid, gid)) = user
                && (libc::setgid(gid) != 0 || libc::setuid(uid) != 0)
            {
                return Err(std::io::Error::last_os_error());
            }
            // after setuid, which clears it
            if die_with_parent && libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd
}

fn start() -> Option<Server> {
    if let Ok(url) = std::env::var("IDEM_PG_URL") {
        return Some(Server { base: url, ctl: None, socket_dir: None });
    }
    let Some(bin) = bin_dir() else {
        assert!(!required(), "PostgreSQL (initdb, postgres) is not installed and IDEM_REQUIRE_TOOLS is set");
        eprintln!("PostgreSQL is not installed: its half of the suite is skipped (CI installs it)");
        return None;
    };
    let user = postgres_user();
    remove_stale_servers();
    let root = tempfile::Builder::new().prefix("idem-pg-").tempdir().unwrap().keep();
    let (data, sock) = (root.join("data"), root.join("sock"));
    std::fs::create_dir_all(&sock).unwrap();
    if let Some((uid, gid)) = user {
        for dir in [&root, &sock] {
            std::os::unix::fs::chown(dir, Some(uid), Some(gid)).unwrap();
        }
    }
    let out = as_user(&bin.join("initdb"), user, false)
        .args([
            "-D",
            data.to_str().unwrap(),
            "-U",
            "postgres",
            "--auth=trust",
            "--no-sync",
            "-E",
            "UTF8",
            "--locale=C",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "initdb failed: {}", String::from_utf8_lossy(&out.stderr));
    std::fs::write(
        data.join("pg_hba.conf"),
        format!("local all {PASSWORD_ROLE} scram-sha-256\nlocal all all trust\n"),
    )
    .unwrap();
    if let Some((uid, gid)) = user {
        std::os::unix::fs::chown(data.join("pg_hba.conf"), Some(uid), Some(gid)).unwrap();
    }

    let spawn = {
        let (bin, data, sock) = (bin.clone(), data.clone(), sock.clone());
        move || -> Child {
            as_user(&bin.join("postgres"), user, true)
                .args(["-D", data.to_str().unwrap(), "-k", sock.to_str().unwrap(), "-p", "5432"])
                .args(["-c", "listen_addresses=", "-c", "max_connections=300", "-c", "shared_buffers=32MB"])
                .stdout(std::process::Stdio::null())
                .stderr(std::fs::File::create(data.parent().unwrap().join("server.log")).unwrap())
                .spawn()
                .unwrap()
        }
    };
    let base = format!("host={} port=5432 user=postgres dbname=postgres", sock.display());
    let (ctl, requests) = channel::<Stop>();
    let (ready, started) = channel();
    let probe = base.clone();
    // The owner thread: it never ends while the process lives, so the
    // server's parent-death signal fires exactly when the process goes.
    std::thread::spawn(move || {
        let mut child = spawn();
        wait_ready(&probe);
        ready.send(()).unwrap();
        for (signal, done) in requests {
            let asked = Instant::now();
            unsafe { libc::kill(child.id() as i32, signal) };
            // a shutdown that hangs is ended the hard way after a while, and
            // reported as having taken that long
            while child.try_wait().unwrap().is_none() {
                if asked.elapsed() > STOP_WAIT {
                    unsafe { libc::kill(child.id() as i32, libc::SIGQUIT) };
                    child.wait().unwrap();
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let took = asked.elapsed();
            child = spawn();
            wait_ready(&probe);
            let _ = done.send(took);
        }
    });
    started.recv_timeout(Duration::from_secs(60)).expect("PostgreSQL did not start");
    let mut admin = postgres::Client::connect(&base, postgres::NoTls).unwrap();
    admin.batch_execute(&format!("CREATE ROLE {PASSWORD_ROLE} LOGIN PASSWORD '{PASSWORD}'")).unwrap();
    Some(Server { base, ctl: Some(Mutex::new(ctl)), socket_dir: Some(sock) })
}

/// Deletes the directories of earlier runs whose server is gone (the
/// directory outlives its server, which dies with its test process).
fn remove_stale_servers() {
    let tmp = std::env::temp_dir();
    for entry in std::fs::read_dir(&tmp).into_iter().flatten().flatten() {
        let path = entry.path();
        let ours = path.file_name().is_some_and(|n| n.to_string_lossy().starts_with("idem-pg-"));
        let old = entry
            .metadata()
            .and_then(|m| m.modified())
            .is_ok_and(|t| t.elapsed().unwrap_or_default() > Duration::from_secs(60));
        let pid = std::fs::read_to_string(path.join("data/postmaster.pid"))
            .ok()
            .and_then(|t| t.lines().next()?.trim().parse::<i32>().ok());
        let alive = pid.is_some_and(|pid| unsafe { libc::kill(pid, 0) } == 0);
        if ours && old && !alive {
            let _ = std::fs::remove_dir_all(&path);
        }
    }
}

fn wait_ready(conninfo: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while postgres::Client::connect(conninfo, postgres::NoTls).is_err() {
        assert!(Instant::now() < deadline, "PostgreSQL did not come up");
        std::thread::sleep(Duration::from_millis(50));
    }
}

impl Server {
    /// A new empty schema; returns the connection string that works in it,
    /// under SERIALIZABLE when `serializable`.
    pub fn fresh_schema(&self, serializable: bool) -> String {
        let schema = format!("t{}_{}", std::process::id(), SCHEMAS.fetch_add(1, Ordering::Relaxed));
        let mut admin = postgres::Client::connect(&self.base, postgres::NoTls).unwrap();
        admin
            .batch_execute(&format!("CREATE SCHEMA {schema}; GRANT ALL ON SCHEMA {schema} TO PUBLIC"))
            .unwrap();
        let mut options = format!("-c search_path={schema}");
        if serializable {
            options.push_str(" -c default_transaction_isolation=serializable");
        }
        match self.base.starts_with("postgres") {
            true => {
                let sep = if self.base.contains('?') { '&' } else { '?' };
                format!("{}{sep}options={}", self.base, options.replace(' ', "%20").replace('=', "%3D"))
            }
            false => format!("{} options='{options}'", self.base),
        }
    }

    /// The same connection string, logging in as the password role.
    pub fn as_password_role(&self, spec: &str, password: &str) -> Option<String> {
        self.socket_dir.as_ref()?;
        Some(spec.replace("user=postgres", &format!("user={PASSWORD_ROLE} password={password}")))
    }

    /// Kills the server the hard way (`pg_ctl stop -m immediate`: no
    /// checkpoint, WAL replay on start) and starts it again; `false` when
    /// the server is not ours to restart.
    pub fn restart_immediate(&self) -> bool {
        self.restart(libc::SIGQUIT).is_some()
    }

    /// Stops the server as a cluster's manager does to demote it (`pg_ctl
    /// stop -m fast`: every backend told to end, a checkpoint) and starts it
    /// again; how long the stop took, [`STOP_WAIT`] or more when it hung
    /// (it is then killed), `None` when the server is not ours.
    #[allow(dead_code)] // the engine's suites restart only the hard way
    pub fn restart_fast(&self) -> Option<Duration> {
        self.restart(libc::SIGINT)
    }

    fn restart(&self, signal: i32) -> Option<Duration> {
        let ctl = self.ctl.as_ref()?;
        let (done, wait) = channel();
        ctl.lock().unwrap().send((signal, done)).unwrap();
        Some(wait.recv_timeout(Duration::from_secs(120)).expect("PostgreSQL did not restart"))
    }
}

/// Runs `sql` in the schema `spec` names.
pub fn execute(spec: &str, sql: &str) {
    let mut client = postgres::Client::connect(spec, postgres::NoTls).unwrap();
    client.batch_execute(sql).unwrap();
}

/// A client in the schema `spec` names.
pub fn client(spec: &str) -> postgres::Client {
    postgres::Client::connect(spec, postgres::NoTls).unwrap()
}

/// The database `spec` names (libpq's `key=value` or a URL) as a URL
/// sqlx takes: its host or socket, port, role, password, database and `-c`
/// settings (a fresh schema's `search_path`).
#[allow(dead_code)] // the engine's suites lend no sqlx pool
pub fn sqlx_url(spec: &str) -> String {
    use tokio_postgres::config::Host;
    let config: tokio_postgres::Config = spec.parse().unwrap();
    let escape = |s: &str| {
        s.bytes()
            .map(|b| match b.is_ascii_alphanumeric() || b"-_.".contains(&b) {
                true => (b as char).to_string(),
                false => format!("%{b:02X}"),
            })
            .collect::<String>()
    };
    let mut query = vec![];
    match &config.get_hosts()[0] {
        Host::Tcp(name) => query.push(format!("host={}", escape(name))),
        Host::Unix(dir) => query.push(format!("host={}", escape(&dir.display().to_string()))),
    }
    if let Some(port) = config.get_ports().first() {
        query.push(format!("port={port}"));
    }
    if let Some(user) = config.get_user() {
        query.push(format!("user={}", escape(user)));
    }
    if let Some(password) = config.get_password() {
        query.push(format!("password={}", escape(&String::from_utf8_lossy(password))));
    }
    if let Some(options) = config.get_options() {
        query.push(format!("options={}", escape(options)));
    }
    format!("postgres:///{}?{}", escape(config.get_dbname().unwrap_or("postgres")), query.join("&"))
}

/// [`sqlx_url`], as a sqlx pool's options.
#[allow(dead_code)] // the engine's suites lend no sqlx pool
pub fn sqlx_options(spec: &str) -> sqlx::postgres::PgConnectOptions {
    sqlx_url(spec).parse().unwrap()
}
