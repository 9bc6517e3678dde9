//! A network hop between idem and PostgreSQL: a TCP proxy on loopback that
//! holds every chunk, in each direction, for half a round trip before
//! passing it on, and counts the chunks it carries to the server (one per
//! round trip a client takes) and the SQL statements in them. The machines
//! here have no `tc netem`; this
//! puts a database "another zone away" on one machine, for the network
//! bench and for tests whose windows a real network opens.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Where the proxy forwards to.
#[derive(Clone)]
pub enum Upstream {
    Unix(PathBuf),
    Tcp(String),
}

impl Upstream {
    fn connect(&self) -> std::io::Result<Box<dyn Stream>> {
        Ok(match self {
            Upstream::Unix(path) => Box::new(UnixStream::connect(path)?),
            Upstream::Tcp(address) => {
                let s = TcpStream::connect(address)?;
                s.set_nodelay(true)?;
                Box::new(s)
            }
        })
    }
}

trait Stream: Read + Write + Send {
    fn split(&self) -> std::io::Result<Box<dyn Stream>>;
    fn close(&self);
}

impl Stream for TcpStream {
    fn split(&self) -> std::io::Result<Box<dyn Stream>> {
        Ok(Box::new(self.try_clone()?))
    }
    fn close(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }
}

impl Stream for UnixStream {
    fn split(&self) -> std::io::Result<Box<dyn Stream>> {
        Ok(Box::new(self.try_clone()?))
    }
    fn close(&self) {
        let _ = self.shutdown(Shutdown::Both);
    }
}

/// The network hop: a proxy on loopback that delays each direction by
/// half the round trip, and counts the chunks it carries to the server.
pub struct Hop {
    pub port: u16,
    /// Chunks carried towards the server so far.
    pub to_server: Arc<AtomicU64>,
    /// SQL statements sent to the server so far, as its
    /// `log_statement = all` would list them one by one: each Execute of
    /// the extended protocol, each statement of a simple query.
    pub statements: Arc<AtomicU64>,
}

/// Counts the statements in what a PostgreSQL client sends (its
/// frontend messages, read as the chunks come).
#[derive(Default)]
struct Statements {
    /// the startup message is sent (it and SSL/GSS requests have no type byte)
    started: bool,
    unread: Vec<u8>,
}

impl Statements {
    fn read(&mut self, chunk: &[u8]) -> u64 {
        self.unread.extend_from_slice(chunk);
        let (mut at, mut n) = (0, 0);
        loop {
            let typed = usize::from(self.started);
            let Some(len) = self.unread.get(at + typed..at + typed + 4) else { break };
            let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize;
            let Some(body) = self.unread.get(at + typed + 4..(at + typed + len).max(at + typed + 4)) else {
                break;
            };
            match (self.started, self.unread[at]) {
                // SSLRequest and GSSENCRequest: the real startup follows
                (false, _) => self.started = !matches!(body.get(..4), Some([4, 210, 22, 47 | 48])),
                (true, b'E') => n += 1,
                (true, b'Q') => {
                    let text = String::from_utf8_lossy(body);
                    let statements = text
                        .split(';')
                        .filter(|s| !s.trim_matches(|c: char| c == '\0' || c.is_whitespace()).is_empty());
                    n += statements.count() as u64;
                }
                _ => {}
            }
            at += typed + len;
        }
        self.unread.drain(..at);
        n
    }
}

impl Hop {
    /// Starts a hop to `upstream` that adds `round_trip` to every round trip.
    pub fn start(upstream: Upstream, round_trip: Duration) -> std::io::Result<Hop> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let port = listener.local_addr()?.port();
        let (to_server, statements) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
        let counters = (to_server.clone(), statements.clone());
        let one_way = round_trip / 2;
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let _ = client.set_nodelay(true);
                let Ok(server) = upstream.connect() else { continue };
                let (Ok(client_back), Ok(server_back)) = (client.try_clone(), server.split()) else {
                    continue;
                };
                let counters = counters.clone();
                std::thread::spawn(move || pump(Box::new(client), server, one_way, Some(counters)));
                std::thread::spawn(move || pump(server_back, Box::new(client_back), one_way, None));
            }
        });
        Ok(Hop { port, to_server, statements })
    }

    /// A hop in front of the PostgreSQL server `spec` names, and the
    /// connection string (key=value form) that reaches it through the hop:
    /// the same user, database, password and options.
    pub fn to_postgres(spec: &str, round_trip: Duration) -> Result<(Hop, String), String> {
        let config =
            tokio_postgres::Config::from_str(spec).map_err(|e| format!("not a connection string: {e}"))?;
        let port = config.get_ports().first().copied().unwrap_or(5432);
        let upstream = match config.get_hosts().first() {
            Some(tokio_postgres::config::Host::Unix(dir)) => {
                Upstream::Unix(dir.join(format!(".s.PGSQL.{port}")))
            }
            Some(tokio_postgres::config::Host::Tcp(host)) => Upstream::Tcp(format!("{host}:{port}")),
            None => Upstream::Unix(PathBuf::from(format!("/var/run/postgresql/.s.PGSQL.{port}"))),
        };
        let hop = Hop::start(upstream, round_trip).map_err(|e| format!("cannot start the hop: {e}"))?;
        let quote = |v: &str| format!("'{}'", v.replace('\\', "\\\\").replace('\'', "\\'"));
        let mut through = format!("host=127.0.0.1 port={}", hop.port);
        for (key, value) in [
            ("user", config.get_user().map(str::to_owned)),
            ("dbname", config.get_dbname().map(str::to_owned)),
            ("password", config.get_password().map(|p| String::from_utf8_lossy(p).into_owned())),
            ("options", config.get_options().map(str::to_owned)),
        ] {
            if let Some(value) = value {
                through.push_str(&format!(" {key}={}", quote(&value)));
            }
        }
        Ok((hop, through))
    }
}

/// Chunks and statements carried to the server.
type Counters = (Arc<AtomicU64>, Arc<AtomicU64>);

/// Passes what `from` sends on to `to`, each chunk `delay` after it was
/// read. A request/response protocol has one chunk in flight per
/// direction, so holding the next read until this one is written adds
/// nothing.
#[allow(unsafe_code)] // prctl: no safe equivalent in std
fn pump(mut from: Box<dyn Stream>, mut to: Box<dyn Stream>, delay: Duration, count: Option<Counters>) {
    // A sleep of a quarter millisecond must not become a third of one.
    // SAFETY: PR_SET_TIMERSLACK takes a plain integer and changes only this thread.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1u64) };
    let (mut buf, mut statements) = (vec![0; 64 * 1024], Statements::default());
    while let Ok(n @ 1..) = from.read(&mut buf) {
        let due = Instant::now() + delay;
        if let Some((chunks, sent)) = &count {
            chunks.fetch_add(1, Ordering::Relaxed);
            sent.fetch_add(statements.read(&buf[..n]), Ordering::Relaxed);
        }
        let wait = due.saturating_duration_since(Instant::now());
        if !wait.is_zero() {
            std::thread::sleep(wait);
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    from.close();
    to.close();
}
