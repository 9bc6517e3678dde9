//! What every command shares: the one-line failure, the clock, this
//! program's own path, the seed, secrets, and where output goes.

use idem::clock::Timestamp;
use idem::harness::HarnessError;
use idem::harness::files::{io_at, write_file};
use idem::store::Db;
use std::path::{Path, PathBuf};

/// Why a command failed: one line on stderr, exit 1.
#[derive(Debug)]
pub struct Failure(pub String);

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<HarnessError> for Failure {
    fn from(e: HarnessError) -> Self {
        Failure(e.to_string())
    }
}

impl From<idem::check::CheckError> for Failure {
    fn from(e: idem::check::CheckError) -> Self {
        Failure(e.to_string())
    }
}

impl From<idem::store::StoreError> for Failure {
    fn from(e: idem::store::StoreError) -> Self {
        Failure(format!("store: {e}"))
    }
}

/// `--db`: a SQLite path or a PostgreSQL connection string.
pub fn db(text: &str) -> Result<Db, String> {
    Ok(Db::parse(text))
}

/// `IDEM_NOW`, the instant tests fix the clock at; `None` for the wall
/// clock. The only place this binary reads it.
pub fn fixed_now() -> Result<Option<Timestamp>, Failure> {
    match std::env::var("IDEM_NOW") {
        Ok(text) => Timestamp::parse(&text).map(Some).map_err(|e| Failure(format!("IDEM_NOW: {e}"))),
        Err(_) => Ok(None),
    }
}

/// The wall clock, or `IDEM_NOW` when set (for tests).
pub fn now() -> Result<Timestamp, Failure> {
    Ok(fixed_now()?.unwrap_or_else(Timestamp::now))
}

/// The seed given, or one from the wall clock (which the command prints,
/// so the run can be repeated).
pub fn seed_or_clock(seed: Option<u64>) -> u64 {
    seed.unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
    })
}

pub fn own_path() -> Result<PathBuf, Failure> {
    std::env::current_exe().map_err(|e| Failure(format!("cannot find this program's own path: {e}")))
}

/// The engine to race: the `idem_api` built next to this binary, or this
/// binary's own `api` command (the same code) when only `idem` was built.
pub fn own_engine() -> Result<Vec<String>, Failure> {
    let me = own_path()?;
    let sibling = me.with_file_name("idem_api");
    Ok(match sibling.is_file() {
        true => vec![sibling.to_string_lossy().into_owned()],
        false => vec![me.to_string_lossy().into_owned(), "api".into()],
    })
}

/// A secret given inline (or by its environment variable) or in a file
/// (its first line), so that it need not appear in the process list.
pub fn secret(inline: Option<String>, file: Option<&Path>, what: &str) -> Result<String, Failure> {
    match (inline, file) {
        (Some(value), _) => Ok(value),
        (None, Some(file)) => {
            let text = std::fs::read_to_string(file).map_err(io_at(file))?;
            let value = text.lines().next().unwrap_or("").trim();
            match value.is_empty() {
                true => Err(Failure(format!("{}: the file is empty", file.display()))),
                false => Ok(value.to_owned()),
            }
        }
        (None, None) => Err(Failure(format!("give {what}"))),
    }
}

/// An account id as the service takes it: an integer if it parses as one.
pub fn account_id(text: String) -> serde_json::Value {
    text.parse::<i64>().map_or_else(|_| serde_json::json!(text), |i| serde_json::json!(i))
}

pub fn make_parent(path: &Path) -> Result<(), Failure> {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => {
            std::fs::create_dir_all(dir).map_err(|e| io_at(dir)(e).into())
        }
        _ => Ok(()),
    }
}

/// Writes to standard output. A closed pipe (the reader went away) ends
/// the process with 141, as a death by SIGPIPE reads to a shell; another
/// failure to write ends it with 1 and the reason.
pub fn say(text: std::fmt::Arguments<'_>) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_fmt(text).and_then(|()| out.flush()) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(141),
        Err(e) => {
            eprintln!("idem: cannot write to standard output: {e}");
            std::process::exit(1);
        }
    }
}

/// Writes `json` to `out` ("-": standard output) and says where it went.
pub fn emit(out: &Path, json: &str) -> Result<(), Failure> {
    if out.as_os_str() == "-" {
        say!("{json}");
    } else {
        make_parent(out)?;
        write_file(out, json)?;
        say!("wrote {}", out.display());
    }
    Ok(())
}

/// The first line of a server: the address it listens on, once it can be
/// used (port 0 picks one).
/// Nobody reading it is no reason to stop serving.
pub fn announce(scheme: &str, address: impl std::fmt::Display) -> Result<(), Failure> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{scheme}://{address}").and_then(|()| out.flush());
    Ok(())
}

/// Binds `listen`, naming it if that fails.
pub fn bind(listen: &str) -> Result<(std::net::TcpListener, std::net::SocketAddr), Failure> {
    let cannot = |e: std::io::Error| Failure(format!("cannot listen on {listen}: {e}"));
    let listener = std::net::TcpListener::bind(listen).map_err(cannot)?;
    let address = listener.local_addr().map_err(cannot)?;
    Ok((listener, address))
}
