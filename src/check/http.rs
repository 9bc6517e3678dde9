//! The target of `idem check --url`: an HTTP service, reached over plain
//! TCP (or through a fault proxy), its answers parsed as HTTP/1.1 (chunked
//! bodies too), and what the implementation chose where the draft leaves
//! it open (its [`Profile`]).

use super::CheckError;
use super::{Trace, short};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

/// What a service chose where the draft leaves it open. The defaults judge
/// only what the draft says (its SHOULDs: 400 without a key, 422 for another
/// body, 409 in flight); a field left open (`null`, `false`) passes every
/// choice, and a field declared holds the service to it.
#[derive(Debug, Clone, serde::Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct Profile {
    /// The route that creates a transfer.
    pub path: String,
    /// The body of the API's own shape, as a JSON template: a string that
    /// is exactly `"{src}"`, `"{dst}"` or `"{amount}"` becomes that value
    /// (the amount a number), and one that holds them has them written in;
    /// `null`: the lab's transfer, `{"src", "dst", "amount", "currency"}`.
    /// Without both `{src}` and `{dst}` the body moves no money between
    /// accounts the check can name: the properties that need that
    /// (refusals, the drain) are skipped, and the lifecycle ones judge keys
    /// and replays without counting the money.
    pub body: Option<Value>,
    /// A JSON pointer (RFC 6901) to the created resource's id in a 2xx
    /// answer, which `get_path`'s `{id}` stands for.
    pub id_pointer: String,
    /// A body the service refuses as malformed (`null`: with the lab's
    /// transfer, an amount of 0; with a `body` template, the property is
    /// skipped).
    pub invalid_body: Option<Value>,
    /// Whether the key is sent as an sf-string (`"…"`) or bare.
    pub quote_key: bool,
    /// Whether the sf-string and the bare spelling of a key are one key
    /// (`true`), or the profile's spelling is the only one (`false`: not
    /// checked); `null`: the other spelling either replays or is refused.
    pub both_key_forms: Option<bool>,
    /// The header (valued `true`) a replay carries and a first answer does
    /// not; `null`: open, a replay is known by its status and bytes.
    pub replay_header: Option<String>,
    /// The status of a transfer made; `null`: any 2xx.
    pub created_status: Option<u16>,
    pub mismatch_status: u16,
    pub in_flight_status: u16,
    /// Whether an in-flight answer must carry `Retry-After` (the draft does
    /// not ask for it).
    pub in_flight_retry_after: bool,
    /// Whether the service reads `Repeatability-First-Sent` (OASIS
    /// Repeatable Requests): a request first sent longer ago than its keys
    /// are kept is 412 and runs nothing, a malformed date 400 (the draft
    /// names neither: judged only when declared).
    pub first_sent: bool,
    /// Whether the service honours `Prefer: wait=N` (RFC 7240) on a retry
    /// whose key is in flight: it waits for the original's answer instead
    /// of answering in flight (the draft asks 409: judged only when
    /// declared).
    pub prefer_wait: bool,
    pub missing_key_status: u16,
    /// The status of a malformed body; `null`: any 4xx.
    pub invalid_status: Option<u16>,
    /// The status of a missing, unknown or doubled token; `null`: 401 or 403.
    pub unauthorized_status: Option<u16>,
    pub unknown_account_status: Option<u16>,
    /// Whether a refusal completes its key and is replayed (`true`), or a
    /// retry is evaluated again (`false`); `null`: either (the draft does not say).
    pub refusals_stored: Option<bool>,
    /// Whether errors must be `application/problem+json` (RFC 9457; the
    /// draft's examples use it, its text does not ask for it).
    pub problem_json: bool,
    /// A transfer's own resource, `{id}` standing for its `transfer_id`
    /// (`null`: the service has none to check).
    pub get_path: Option<String>,
    /// Token → client id, for the tokens given: which are one client.
    /// Without it, each token is taken for a client of its own.
    pub clients: Option<BTreeMap<String, String>>,
    /// An account of known balance that nothing else uses, to catch lost
    /// updates by draining it (spent by the check: give a fresh one).
    pub drain: Option<Drain>,
    /// How long, in seconds, a key may stay in flight after its client
    /// walked away (the service's lease on an unfinished request); `null`:
    /// the service has none (the lab's choice: a key whose request died
    /// stays in flight for good), and a key left so is counted, not failed.
    pub lease_seconds: Option<u64>,
    /// How long, in seconds, the service may take to exit after SIGTERM
    /// (`--serve` only): it answers the requests it accepted meanwhile.
    pub shutdown_seconds: u64,
    /// The environment, `NAME=VALUE`, that turns on the service's fault
    /// point between a handler's writes and their commit (`--serve` only;
    /// idem's layer: `IDEM_FAULT=crash-before-commit`); `null`: it has
    /// none, and the property that needs it is skipped.
    pub crash_before_commit_env: Option<String>,
    /// Where the service publishes its OpenAPI document (3.x, JSON), read
    /// with GET; every status the check is answered must be listed for its
    /// operation there. `null`: not checked.
    pub openapi_path: Option<String>,
    /// A second operation that takes keys too (a deposit, a refund,
    /// another resource's create); `null`: not checked.
    pub second_operation: Option<Operation>,
}

/// A route of the API besides the transfer's, which takes a key of its own.
#[derive(Debug, Clone, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct Operation {
    /// Its route (POST).
    pub path: String,
    /// Its body, a template as the profile's `body` is.
    pub body: Value,
}

#[derive(Debug, Clone, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct Drain {
    pub src: Value,
    pub dst: Value,
    pub balance: i64,
}

impl Default for Profile {
    fn default() -> Self {
        Profile {
            path: "/v1/transfers".into(),
            body: None,
            id_pointer: "/transfer_id".into(),
            invalid_body: None,
            quote_key: true,
            both_key_forms: None,
            replay_header: None,
            created_status: None,
            mismatch_status: 422,
            in_flight_status: 409,
            in_flight_retry_after: false,
            first_sent: false,
            prefer_wait: false,
            missing_key_status: 400,
            invalid_status: None,
            unauthorized_status: None,
            unknown_account_status: None,
            refusals_stored: None,
            problem_json: false,
            get_path: None,
            clients: None,
            drain: None,
            lease_seconds: Some(30),
            second_operation: None,
            openapi_path: None,
            shutdown_seconds: 30,
            crash_before_commit_env: None,
        }
    }
}

/// The service under check and how to reach it.
pub struct Target {
    pub address: SocketAddr,
    /// The `Host` header: the URL's host and port.
    pub host: String,
    pub tokens: Vec<String>,
    /// Two accounts the service holds, the first with funds to spare.
    pub src: Value,
    pub dst: Value,
    pub profile: Profile,
    pub seed: u64,
    /// The service's process, when the check started it (`--serve`).
    pub process: Option<super::process::Process>,
}

impl Target {
    /// A fresh key: from the seed, and a number of this run, so a rerun with
    /// the same seed never meets the keys of the run before.
    pub fn key(&self, salt: u64) -> String {
        let mut rng = crate::rng::Rng::new(self.seed ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        format!("check-{:012x}-{:08x}", rng.next_u64() & 0xffff_ffff_ffff, super::lab::run_nonce())
    }

    /// Reads `http://HOST:PORT` (a name is resolved, `localhost` too).
    pub fn new(
        url: &str,
        tokens: Vec<String>,
        src: Value,
        dst: Value,
        profile: Profile,
        seed: u64,
    ) -> Result<Target, CheckError> {
        let host = url
            .strip_prefix("http://")
            .ok_or_else(|| format!("--url {url:?}: only http://HOST:PORT is supported"))?
            .trim_end_matches('/')
            .to_owned();
        if host.contains('/') {
            return Err(format!(
                "--url {url:?}: give the service's root; the route comes from the profile's path"
            )
            .into());
        }
        let address = host
            .to_socket_addrs()
            .map_err(|e| format!("--url {url:?}: {e}"))?
            .next()
            .ok_or_else(|| format!("--url {url:?}: the name resolves to no address"))?;
        if tokens.is_empty() {
            return Err("--url needs --token".into());
        }
        Ok(Target { address, host, tokens, src, dst, profile, seed, process: None })
    }

    pub(super) fn transfer(&self, amount: i64) -> String {
        self.body(&self.src, &self.dst, amount)
    }

    /// A request's body moving `amount` from `src` to `dst`: the profile's
    /// template filled in, or the lab's transfer.
    pub(super) fn body(&self, src: &Value, dst: &Value, amount: i64) -> String {
        match &self.profile.body {
            Some(template) => fill(template, src, dst, amount).to_string(),
            None => transfer_body(src, dst, amount),
        }
    }

    /// Whether a body names the accounts it moves money between (the lab's
    /// transfer, or a template with `{src}` and `{dst}`).
    pub(super) fn money(&self) -> bool {
        self.profile.body.as_ref().is_none_or(|b| {
            let text = b.to_string();
            text.contains("{src}") && text.contains("{dst}")
        })
    }

    /// The created resource's id in a 2xx answer, at the profile's pointer.
    pub(super) fn created_id(&self, h: &Http) -> Option<String> {
        match h.json().pointer(&self.profile.id_pointer)? {
            Value::String(s) => Some(s.clone()),
            Value::Null => None,
            v => Some(v.to_string()),
        }
    }

    pub(super) fn key_header(&self, key: &str) -> String {
        match self.profile.quote_key {
            true => format!("\"{key}\""),
            false => key.to_owned(),
        }
    }

    /// The request bytes of a POST to the profile's path.
    pub(super) fn post_bytes(&self, headers: &[(&str, String)], body: &str) -> Vec<u8> {
        self.post_bytes_to(&self.profile.path, headers, body)
    }

    /// [`Target::post_bytes`] to `path`.
    pub(super) fn post_bytes_to(&self, path: &str, headers: &[(&str, String)], body: &str) -> Vec<u8> {
        let mut head =
            format!("POST {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\n", self.host);
        for (name, value) in headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str(&format!("Content-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()));
        head.into_bytes()
    }

    /// POST with `token` and `key` (either may be absent).
    pub(super) fn post(
        &self,
        t: &mut Trace,
        token: Option<&str>,
        key: Option<&str>,
        body: &str,
    ) -> Result<Http, CheckError> {
        let mut headers = Vec::new();
        if let Some(token) = token {
            headers.push(("Authorization", format!("Bearer {token}")));
        }
        if let Some(key) = key {
            headers.push(("Idempotency-Key", self.key_header(key)));
        }
        self.send(t, &headers, body)
    }

    pub(super) fn send(
        &self,
        t: &mut Trace,
        headers: &[(&str, String)],
        body: &str,
    ) -> Result<Http, CheckError> {
        let answer = exchange(self.address, &self.post_bytes(headers, body))?;
        let shown: Vec<String> = headers.iter().map(|(n, v)| format!("{n}: {}", short(v))).collect();
        t.step(format!("POST [{}] {} -> {}", shown.join("; "), short(body), answer.short()));
        Ok(answer)
    }

    pub(super) fn get(&self, t: &mut Trace, path: &str, token: &str) -> Result<Http, CheckError> {
        let bytes = format!(
            "GET {path} HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n",
            self.host
        );
        let answer = exchange(self.address, bytes.as_bytes())?;
        t.step(format!("GET {path} as {token} -> {}", answer.short()));
        Ok(answer)
    }

    /// Whether `h` is a transfer made (not whether it was made just now).
    pub(super) fn made(&self, h: &Http) -> bool {
        self.profile.created_status.map_or((200..300).contains(&h.status), |s| h.status == s)
    }

    /// What a made transfer's status must be, in words.
    pub(super) fn made_status(&self) -> String {
        self.profile.created_status.map_or("a 2xx".into(), |s| s.to_string())
    }

    pub(super) fn replayed(&self, h: &Http) -> bool {
        self.profile
            .replay_header
            .as_ref()
            .is_some_and(|name| h.header(name).is_some_and(|v| v.eq_ignore_ascii_case("true")))
    }

    /// Whether `again` replays `first`: the same status and body, marked
    /// if the profile says replays are.
    pub(super) fn replays(&self, again: &Http, first: &Http) -> bool {
        again.status == first.status
            && again.body == first.body
            && (self.profile.replay_header.is_none() || self.replayed(again))
    }

    /// Two tokens of distinct clients, and two of one client, if the
    /// profile says which tokens are whose.
    pub(super) fn clients(&self) -> (Option<TokenPair<'_>>, Option<TokenPair<'_>>) {
        let owner = |tok: &String| self.profile.clients.as_ref().and_then(|m| m.get(tok)).cloned();
        let mut distinct = None;
        let mut same = None;
        for (i, a) in self.tokens.iter().enumerate() {
            for b in &self.tokens[i + 1..] {
                match (self.profile.clients.is_some(), owner(a), owner(b)) {
                    (false, _, _) => distinct = distinct.or(Some((a.as_str(), b.as_str()))),
                    (true, Some(x), Some(y)) if x != y => {
                        distinct = distinct.or(Some((a.as_str(), b.as_str())))
                    }
                    (true, Some(_), Some(_)) => same = same.or(Some((a.as_str(), b.as_str()))),
                    _ => {}
                }
            }
        }
        (distinct, same)
    }
}

/// `template` with `{src}`, `{dst}` and `{amount}` filled in: a string
/// that is exactly one becomes its value, one that holds one has it
/// written in (an id that is a string, as it is; any other as JSON).
pub(super) fn fill(template: &Value, src: &Value, dst: &Value, amount: i64) -> Value {
    let text = |v: &Value| v.as_str().map_or(v.to_string(), String::from);
    match template {
        Value::String(s) => match s.as_str() {
            "{src}" => src.clone(),
            "{dst}" => dst.clone(),
            "{amount}" => json!(amount),
            _ => Value::String(
                s.replace("{src}", &text(src))
                    .replace("{dst}", &text(dst))
                    .replace("{amount}", &amount.to_string()),
            ),
        },
        Value::Array(items) => Value::Array(items.iter().map(|v| fill(v, src, dst, amount)).collect()),
        Value::Object(members) => {
            Value::Object(members.iter().map(|(k, v)| (k.clone(), fill(v, src, dst, amount))).collect())
        }
        other => other.clone(),
    }
}

/// The body of a transfer of `amount` KRW from `src` to `dst`.
pub(super) fn transfer_body(src: &Value, dst: &Value, amount: i64) -> String {
    json!({"src": src, "dst": dst, "amount": amount, "currency": "KRW"}).to_string()
}

/// Two bearer tokens.
type TokenPair<'a> = (&'a str, &'a str);

/// One HTTP answer, its body decoded.
#[derive(Debug, Clone, Default)]
pub struct Http {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Http {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    pub(super) fn short(&self) -> String {
        format!("{} {}", self.status, short(&self.body))
    }

    pub(super) fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or(Value::Null)
    }
}

/// Sends `request` on a new connection and reads the answer to its end.
pub fn exchange(address: SocketAddr, request: &[u8]) -> Result<Http, CheckError> {
    exchange_within(address, request, Duration::from_secs(30))
}

/// [`exchange`], giving up on an answer not come within `wait`, as a
/// client's timeout does.
pub(super) fn exchange_within(
    address: SocketAddr,
    request: &[u8],
    wait: Duration,
) -> Result<Http, CheckError> {
    let (mut stream, op) = begun(address, request, request.len(), wait)?;
    let answer = read_answer(&mut stream);
    ended(op, &answer);
    answer
}

/// A new connection that has sent the first `upto` bytes of `request`,
/// answers awaited for `wait` at most, and the request's operation in the
/// history (a connection or a send that failed is recorded as ended).
pub(super) fn begun(
    address: SocketAddr,
    request: &[u8],
    upto: usize,
    wait: Duration,
) -> Result<(TcpStream, super::history::Op), CheckError> {
    let op = super::history::invoke(request);
    let sent = (|| {
        let mut stream = TcpStream::connect_timeout(&address, Duration::from_secs(5))
            .map_err(CheckError::io("connect"))?;
        stream.set_read_timeout(Some(wait)).map_err(CheckError::io("set a timeout"))?;
        stream.write_all(&request[..upto]).map_err(CheckError::io("send"))?;
        Ok(stream)
    })();
    match sent {
        Ok(stream) => Ok((stream, op)),
        Err(e) => {
            op.failed(&e);
            Err(e)
        }
    }
}

/// Records in the history how the operation `op` ended.
pub(super) fn ended(op: super::history::Op, answer: &Result<Http, CheckError>) {
    match answer {
        Ok(h) => op.ok(
            h.status,
            h.body.as_bytes(),
            ["idempotent-replayed", "retry-after", "location"].map(|n| h.header(n)),
        ),
        Err(e) => op.failed(e),
    }
}

pub(super) fn read_answer(stream: &mut TcpStream) -> Result<Http, CheckError> {
    let mut bytes = Vec::new();
    match stream.read_to_end(&mut bytes) {
        Ok(_) => {}
        // a reset after a whole answer still leaves the answer
        Err(_) if !bytes.is_empty() => {}
        Err(e) => return Err(CheckError::Io { doing: "reading the answer".into(), source: e }),
    }
    parse_answer(&bytes)
        .ok_or_else(|| format!("not an HTTP answer: {}", short(&String::from_utf8_lossy(&bytes))).into())
}

/// An HTTP/1.1 answer from its bytes: the body by `Content-Length`, by
/// chunked transfer coding, or to the end.
pub fn parse_answer(bytes: &[u8]) -> Option<Http> {
    let end = bytes.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&bytes[..end]).ok()?;
    let mut lines = head.split("\r\n");
    let status = lines.next()?.split_whitespace().nth(1)?.parse().ok()?;
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_owned(), v.trim().to_owned()))
        .collect();
    let find =
        |name: &str| headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str());
    let rest = &bytes[end + 4..];
    let body = if find("transfer-encoding").is_some_and(|v| v.to_ascii_lowercase().contains("chunked")) {
        dechunk(rest)?
    } else if let Some(length) = find("content-length").and_then(|v| v.parse::<usize>().ok()) {
        rest.get(..length)?.to_vec()
    } else {
        rest.to_vec()
    };
    Some(Http { status, headers, body: String::from_utf8_lossy(&body).into_owned() })
}

pub(super) fn dechunk(mut rest: &[u8]) -> Option<Vec<u8>> {
    let mut body = Vec::new();
    loop {
        let line_end = rest.windows(2).position(|w| w == b"\r\n")?;
        let size_text = std::str::from_utf8(&rest[..line_end]).ok()?;
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        rest = &rest[line_end + 2..];
        if size == 0 {
            return Some(body);
        }
        body.extend_from_slice(rest.get(..size)?);
        rest = rest.get(size + 2..)?;
    }
}
