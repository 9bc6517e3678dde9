//! The clients' own event receiver on a chaos day with payouts: down for
//! the day's first seconds, then slow, failing or losing its answers at
//! seeded odds. It keeps every delivery it read (the id, whether the
//! signature verified, the body), so that the day is judged on what a
//! client actually got: every change a client was not told in an answer,
//! under one id, signed.

use crate::payout::sign_standard;
use crate::rng::Rng;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The clients' events secret on a chaos day (24 bytes after `whsec_`).
pub(super) const SECRET: &str = "whsec_Y2hhb3MtZGF5LWNsaWVudC1ldmVudHMtMDE=";
/// How long the receiver is down at the start of the day.
const DOWN: Duration = Duration::from_secs(3);

/// One delivery read: its id, whether its signature verified, its body.
#[derive(Debug, Clone)]
pub(super) struct Got {
    pub id: String,
    pub signed: bool,
    pub body: String,
}

pub(super) struct Receiver {
    pub url: String,
    pub got: Arc<Mutex<Vec<Got>>>,
}

impl Receiver {
    /// Listens on a loopback port; for its first [`DOWN`] it is down, each
    /// connection closed at once, unread (the port is kept, so nothing else
    /// takes it meanwhile). Of what it reads after, the odds drawn from
    /// `seed`: 20 % kept and closed unanswered, 10 % answered 503, 10 %
    /// answered after 1.5 s, the rest 204 at once.
    pub(super) fn start(seed: u64) -> std::io::Result<Receiver> {
        let listener = TcpListener::bind("127.0.0.1:0")?;
        let port = listener.local_addr()?.port();
        let got = Arc::new(Mutex::new(Vec::new()));
        let kept = got.clone();
        let up = std::time::Instant::now() + DOWN;
        std::thread::Builder::new().name("chaos-receiver".into()).spawn(move || {
            let mut rng = Rng::new(seed ^ 0x7265_6376);
            for stream in listener.incoming().flatten() {
                if std::time::Instant::now() < up {
                    continue; // down: dropped unread
                }
                let draw = rng.below(100);
                let kept = kept.clone();
                std::thread::spawn(move || serve(stream, draw, &kept));
            }
        })?;
        Ok(Receiver { url: format!("http://127.0.0.1:{port}/events"), got })
    }

    /// Every client's events here, as the sender takes them.
    pub(super) fn hooks(&self, clients: usize) -> std::collections::HashMap<String, crate::payout::Hook> {
        let hook =
            crate::payout::Hook { url: self.url.clone(), secret: SECRET.as_bytes().to_vec(), previous: None };
        (0..clients).map(|c| (format!("chaos-{c}"), hook.clone())).collect()
    }

    /// Writes the servers' client events file: every client's events here.
    pub(super) fn hooks_file(&self, clients: usize, file: &Path) -> std::io::Result<()> {
        let hooks: serde_json::Map<String, serde_json::Value> = (0..clients)
            .map(|c| (format!("chaos-{c}"), serde_json::json!({"url": self.url, "secret": SECRET})))
            .collect();
        std::fs::write(file, serde_json::Value::Object(hooks).to_string())
    }

    /// Everything read so far.
    pub(super) fn got(&self) -> Vec<Got> {
        self.got.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// One connection: reads the delivery, keeps it, answers as `draw` says.
fn serve(mut stream: std::net::TcpStream, draw: u64, kept: &Mutex<Vec<Got>>) {
    let Ok(read) = stream.try_clone() else { return };
    let mut reader = BufReader::new(read);
    let mut headers = std::collections::BTreeMap::new();
    let mut line = String::new();
    while reader.read_line(&mut line).unwrap_or(0) > 2 {
        if let Some((name, value)) = line.trim_end().split_once(':') {
            headers.insert(name.to_ascii_lowercase(), value.trim().to_owned());
        }
        line.clear();
    }
    let length = headers.get("content-length").and_then(|l| l.parse().ok()).unwrap_or(0);
    let mut body = vec![0; length];
    if reader.read_exact(&mut body).is_err() {
        return;
    }
    let field = |name: &str| headers.get(name).cloned().unwrap_or_default();
    let (id, t) = (field("webhook-id"), field("webhook-timestamp").parse().unwrap_or(0));
    let signed = sign_standard(SECRET.as_bytes(), &id, &body, t) == field("webhook-signature");
    let body = String::from_utf8_lossy(&body).into_owned();
    kept.lock().unwrap_or_else(|e| e.into_inner()).push(Got { id, signed, body });
    let answer: &[u8] = match draw {
        0..20 => return, // kept, the answer lost
        20..30 => b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
        30..40 => {
            std::thread::sleep(Duration::from_millis(1500));
            b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n"
        }
        _ => b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n",
    };
    let _ = stream.write_all(answer);
}
