//! `idem check --history FILE`: every HTTP request the check made, as JSON
//! lines an outside checker can read (the shape of a Jepsen history: an
//! `invoke` and then one completion per operation). The format is
//! documented in docs/check.md; in short:
//!
//! - `{"type":"invoke","process":P,"time":NS,"property":…,"f":"POST",
//!   "path":…,"key":…,"client":…,"body_sha256":…}`: the request is about to
//!   be sent. `process` numbers the operation (each is on a connection of
//!   its own); `time` is nanoseconds since the check began; `key` is the
//!   `Idempotency-Key` header as sent (null without one); `client` is the
//!   first 16 hex digits of the SHA-256 of the `Authorization` header (no
//!   token is written), null without one.
//! - `{"type":"ok","process":P,"time":NS,"status":S,"answer_sha256":…,
//!   "replayed":…,"retry_after":…,"location":…}`: an answer came back, of
//!   any status; the three headers as answered, null when absent.
//! - `{"type":"info","process":P,"time":NS,"error":…}`: sent, but no
//!   answer (a reset, a timeout, an answer dropped on purpose): whether the
//!   request took effect is unknown.
//! - `{"type":"fail","process":P,"time":NS,"error":…}`: never sent (the
//!   connection could not be made): it took no effect.
//!
//! Operations run at once from several threads, so lines of different
//! processes interleave; a process's completion follows its invoke.
//!
//! With a history or without, every method, path and status answered is
//! kept for the run (`answered`), for the OpenAPI property.

use super::CheckError;
use crate::hex::lower as hex;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use std::collections::BTreeSet;
use std::fs::File;
use std::io::Write;
use std::path::Path;
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

struct Sink {
    /// unbuffered: one write a line, so a run that ends early loses none
    out: File,
    start: Instant,
    next: u64,
    property: String,
}

static SINK: OnceLock<Mutex<Sink>> = OnceLock::new();

/// Writes the history of this run to `path` (created, or emptied).
pub fn record_to(path: &Path) -> std::io::Result<()> {
    let out = File::create(path)?;
    let sink = Sink { out, start: Instant::now(), next: 0, property: String::new() };
    SINK.set(Mutex::new(sink)).map_err(|_| std::io::Error::other("a history is already being written"))
}

/// Names the property whose operations follow (properties run one at a time).
pub(super) fn property(name: &str) {
    with_sink(|s| name.clone_into(&mut s.property));
}

/// One operation: its process in the history (`None` when none is
/// written) and its method and path.
#[must_use]
pub(super) struct Op {
    process: Option<u64>,
    route: (String, String),
}

/// Every method, path and status the check was answered so far, history
/// or none (what the OpenAPI property holds to the service's document).
static ANSWERED: Mutex<BTreeSet<(String, String, u16)>> = Mutex::new(BTreeSet::new());

/// The method, path and status of every answer so far.
pub(super) fn answered() -> BTreeSet<(String, String, u16)> {
    ANSWERED.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Records `request` (its raw bytes) as invoked.
pub(super) fn invoke(request: &[u8]) -> Op {
    let head = request.split(|b| *b == b'\r').next().unwrap_or_default();
    let mut first = std::str::from_utf8(head).unwrap_or_default().split(' ');
    let route = (first.next().unwrap_or_default().to_owned(), first.next().unwrap_or_default().to_owned());
    let Some(sink) = SINK.get() else { return Op { process: None, route } };
    let mut s = sink.lock().unwrap_or_else(|e| e.into_inner());
    s.next += 1;
    let mut line = described(request);
    line["type"] = json!("invoke");
    line["process"] = json!(s.next);
    line["time"] = json!(s.start.elapsed().as_nanos() as u64);
    line["property"] = json!(s.property);
    let process = Some(s.next);
    write(&mut s, &line);
    Op { process, route }
}

impl Op {
    /// Records an answer of `status` with `body` and the headers
    /// `Idempotent-Replayed`, `Retry-After` and `Location`, as answered.
    pub(super) fn ok(self, status: u16, body: &[u8], [replayed, retry_after, location]: [Option<&str>; 3]) {
        let (method, path) = self.route.clone();
        ANSWERED.lock().unwrap_or_else(|e| e.into_inner()).insert((method, path, status));
        self.end(json!({
            "type": "ok",
            "status": status,
            "answer_sha256": hex(&Sha256::digest(body)),
            "replayed": replayed,
            "retry_after": retry_after,
            "location": location,
        }));
    }

    /// Records an operation that got no answer: never sent when its
    /// connection could not be made, else of unknown effect.
    pub(super) fn failed(self, e: &CheckError) {
        let unsent = matches!(e, CheckError::Io { doing, .. } if doing == "connect");
        self.end(json!({"type": if unsent { "fail" } else { "info" }, "error": e.to_string()}));
    }

    fn end(self, mut line: Value) {
        let Some(process) = self.process else { return };
        with_sink(|s| {
            line["process"] = json!(process);
            line["time"] = json!(s.start.elapsed().as_nanos() as u64);
            write(s, &line);
        });
    }
}

fn with_sink(f: impl FnOnce(&mut Sink)) {
    if let Some(sink) = SINK.get() {
        f(&mut sink.lock().unwrap_or_else(|e| e.into_inner()));
    }
}

fn write(s: &mut Sink, line: &Value) {
    // a history that cannot be written ends the run's history, not its verdicts
    let _ = s.out.write_all(format!("{line}\n").as_bytes());
}

/// A request's method, path, key, client and body digest, from its bytes.
fn described(request: &[u8]) -> Value {
    let end = request.windows(4).position(|w| w == b"\r\n\r\n").unwrap_or(request.len());
    let head = String::from_utf8_lossy(&request[..end]);
    let body = request.get(end + 4..).unwrap_or_default();
    let mut first = head.split("\r\n").next().unwrap_or_default().split(' ');
    let (f, path) = (first.next().unwrap_or_default(), first.next().unwrap_or_default());
    let header = |name: &str| {
        head.split("\r\n").skip(1).find_map(|l| {
            let (n, v) = l.split_once(':')?;
            n.trim().eq_ignore_ascii_case(name).then(|| v.trim().to_owned())
        })
    };
    let client = header("authorization").map(|a| hex(&Sha256::digest(a.as_bytes()))[..16].to_owned());
    json!({
        "f": f,
        "path": path,
        "key": header("idempotency-key"),
        "client": client,
        "body_sha256": hex(&Sha256::digest(body)),
    })
}
