//! A fault-injecting HTTP proxy: the lossy network between clients and the
//! service, driven by a seeded plan. It is HTTP-aware, so it knows where a
//! request and an answer end, and can lose exactly the things that make
//! exactly-once hard: the request before the server sees it, the answer
//! after the server committed, half an answer; it can also delay a request,
//! and deliver it twice.
//!
//! One request per connection: the proxy asks the service to close after
//! answering (`Connection: close`) and passes that on, so no client reuses
//! a connection the proxy has cut.

use crate::rng::Rng;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What the network does to one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    Pass,
    /// The request never reaches the service.
    DropRequest,
    /// The service answers (and has committed); the answer never arrives.
    DropResponse,
    /// Half the answer arrives, then the connection closes.
    CutResponse,
    /// The request arrives late.
    Delay(Duration),
    /// The request arrives twice, both copies at once; one answer returns.
    Duplicate,
}

/// The odds of each fault, in percent; the rest pass.
#[derive(Debug, Clone, Copy)]
pub struct Odds {
    pub drop_request: u64,
    pub drop_response: u64,
    pub cut_response: u64,
    pub delay: u64,
    pub duplicate: u64,
}

impl Default for Odds {
    fn default() -> Self {
        Odds { drop_request: 5, drop_response: 10, cut_response: 5, delay: 10, duplicate: 5 }
    }
}

/// What the proxy did, by fault.
#[derive(Debug, Default)]
pub struct Counts {
    pub requests: AtomicU64,
    pub dropped_requests: AtomicU64,
    pub dropped_responses: AtomicU64,
    pub cut_responses: AtomicU64,
    pub delayed: AtomicU64,
    pub duplicated: AtomicU64,
    /// Requests that could not reach the service at all (it was down).
    pub unreachable: AtomicU64,
    /// The answers dropped after the service committed, as the service sent
    /// them: what a retry must replay.
    pub dropped: Mutex<Vec<Vec<u8>>>,
}

pub struct Proxy {
    address: SocketAddr,
    upstream: Arc<Mutex<SocketAddr>>,
    pub counts: Arc<Counts>,
    stop: Arc<AtomicBool>,
}

impl Proxy {
    /// Listens on 127.0.0.1 (a free port) and forwards to `upstream`,
    /// deciding each request's fate from `seed` and `odds`.
    pub fn start(upstream: SocketAddr, seed: u64, odds: Odds) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let address = listener.local_addr()?;
        let upstream = Arc::new(Mutex::new(upstream));
        let counts = Arc::new(Counts::default());
        let stop = Arc::new(AtomicBool::new(false));
        let plan = Arc::new(Mutex::new(Rng::new(seed)));
        let (up, c, s) = (upstream.clone(), counts.clone(), stop.clone());
        std::thread::Builder::new().name("idem-proxy".into()).spawn(move || {
            for client in listener.incoming() {
                if s.load(Ordering::Relaxed) {
                    return;
                }
                let Ok(client) = client else { continue };
                let fault = decide(&mut plan.lock().unwrap_or_else(|e| e.into_inner()), odds);
                let target = *up.lock().unwrap_or_else(|e| e.into_inner());
                let counts = c.clone();
                std::thread::spawn(move || relay(client, target, fault, &counts));
            }
        })?;
        Ok(Proxy { address, upstream, counts, stop })
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.address)
    }

    /// Points the proxy at a restarted service.
    pub fn set_upstream(&self, upstream: SocketAddr) {
        *self.upstream.lock().unwrap_or_else(|e| e.into_inner()) = upstream;
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = TcpStream::connect(self.address); // wake the accept loop
    }
}

fn decide(rng: &mut Rng, odds: Odds) -> Fault {
    let roll = rng.below(100);
    let mut edge = 0;
    for (chance, fault) in [
        (odds.drop_request, Fault::DropRequest),
        (odds.drop_response, Fault::DropResponse),
        (odds.cut_response, Fault::CutResponse),
        (odds.delay, Fault::Delay(Duration::from_millis(1 + rng.below(200)))),
        (odds.duplicate, Fault::Duplicate),
    ] {
        edge += chance;
        if roll < edge {
            return fault;
        }
    }
    Fault::Pass
}

/// Reads one HTTP request: its head up to the blank line, then
/// Content-Length bytes of body. Rewrites it to ask for `Connection: close`.
fn read_request(stream: &mut TcpStream) -> std::io::Result<Vec<u8>> {
    let mut data = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(at) = data.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        if data.len() > 1 << 20 {
            return Err(std::io::Error::other("request head too large"));
        }
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            return Err(std::io::Error::other("closed before a whole request"));
        }
        data.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&data[..head_end]).into_owned();
    let length = head
        .lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(name, _)| name.trim().eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse::<usize>().ok())
        .unwrap_or(0);
    while data.len() < head_end + length {
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            return Err(std::io::Error::other("closed before a whole body"));
        }
        data.extend_from_slice(&chunk[..n]);
    }
    let lines: Vec<&str> = head
        .trim_end()
        .split("\r\n")
        .filter(|l| !l.to_ascii_lowercase().starts_with("connection:"))
        .collect();
    let mut rewritten = format!("{}\r\nConnection: close\r\n\r\n", lines.join("\r\n")).into_bytes();
    rewritten.extend_from_slice(&data[head_end..head_end + length]);
    Ok(rewritten)
}

/// Sends `request` to `target` and reads the whole answer (the service
/// closes after it).
fn exchange(target: SocketAddr, request: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut upstream = TcpStream::connect_timeout(&target, Duration::from_secs(2))?;
    upstream.set_read_timeout(Some(Duration::from_secs(30)))?;
    upstream.write_all(request)?;
    let mut answer = Vec::new();
    upstream.read_to_end(&mut answer)?;
    Ok(answer)
}

fn relay(mut client: TcpStream, target: SocketAddr, fault: Fault, counts: &Counts) {
    let _ = client.set_read_timeout(Some(Duration::from_secs(30)));
    let Ok(request) = read_request(&mut client) else { return };
    counts.requests.fetch_add(1, Ordering::Relaxed);
    let answer = match fault {
        Fault::DropRequest => {
            counts.dropped_requests.fetch_add(1, Ordering::Relaxed);
            let _ = client.shutdown(Shutdown::Both);
            return;
        }
        Fault::Delay(pause) => {
            counts.delayed.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(pause);
            exchange(target, &request)
        }
        Fault::Duplicate => {
            counts.duplicated.fetch_add(1, Ordering::Relaxed);
            let copy = request.clone();
            let twin = std::thread::spawn(move || exchange(target, &copy));
            let answer = exchange(target, &request);
            let _ = twin.join();
            answer
        }
        Fault::Pass | Fault::DropResponse | Fault::CutResponse => exchange(target, &request),
    };
    let Ok(answer) = answer else {
        counts.unreachable.fetch_add(1, Ordering::Relaxed);
        let _ = client.shutdown(Shutdown::Both);
        return;
    };
    match fault {
        Fault::DropResponse => {
            counts.dropped_responses.fetch_add(1, Ordering::Relaxed);
            counts.dropped.lock().unwrap_or_else(|e| e.into_inner()).push(answer);
        }
        Fault::CutResponse => {
            counts.cut_responses.fetch_add(1, Ordering::Relaxed);
            let _ = client.write_all(&answer[..answer.len() / 2]);
        }
        _ => {
            let _ = client.write_all(&answer);
        }
    }
    let _ = client.shutdown(Shutdown::Both);
}
