//! Clients that walk away: a request whose client hangs up at a random
//! moment must leave its key as any request does, finished or free, never
//! held past the service's lease, and never paid twice (the hang-up defect
//! of idem's own library before the key's one home: writes committed, the
//! key held for 72 h, then a second payment).

use super::http::{Http, Target, exchange};
use super::{CheckError, Trace};
use crate::rng::Rng;
use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// How many keys the clients walk away from one at a time.
const KEYS: i64 = 12;
/// How many more are sent at one instant on the same accounts, so that all
/// but the first wait for another's locks, and walked away from there.
const WAITING: i64 = 6;

/// Each of [`KEYS`] requests is cut at a random moment (before its last
/// byte, just after it, or a few milliseconds later), and [`WAITING`] more
/// in a lock wait; then each key is retried as its client would, until an
/// answer that is final, within the profile's lease; a final answer must
/// replay. With the profile's drain, the money moved is counted: each key
/// paid once.
pub(super) fn hang_ups(target: &Target, t: &mut Trace) -> Result<(), CheckError> {
    let p = &target.profile;
    let mut rng = Rng::new(target.seed ^ 0x4a6e_6775);
    let all = KEYS + WAITING;
    let drain = match p.drain.as_ref().filter(|d| d.balance >= all * (all + 1) / 2 && target.money()) {
        Some(d) if holds_all(target, t, d, 300)? => Some(d),
        Some(_) => {
            t.step("(the drain no longer holds its balance, spent by an earlier run: the money moved is not counted)");
            None
        }
        None => None,
    };
    let body = |amount: i64| match drain {
        Some(d) => target.body(&d.src, &d.dst, amount),
        None => target.transfer(amount),
    };
    let keys: Vec<(String, i64)> = (1..=all).map(|i| (target.key(200 + i as u64), i)).collect();
    let requests: Vec<Vec<u8>> =
        keys.iter().map(|(k, a)| target.post_bytes(&headers(target, k), &body(*a))).collect();
    let cuts = one_at_a_time(target, &requests[..KEYS as usize], &mut rng)?;
    t.step(format!(
        "{KEYS} requests, each client gone: {} before the last byte, {} just after it, {} within 20 ms",
        cuts[0], cuts[1], cuts[2]
    ));
    let gone = together(target, &requests[KEYS as usize..], &mut rng)?;
    t.step(format!(
        "{WAITING} more sent at one instant on the same accounts, waiting for each other's locks, \
         each client gone {gone} ms later"
    ));
    let (lease, required) = lease(target);
    let deadline = Instant::now() + lease;
    let (mut met, mut stuck, mut made) = (InFlight::default(), 0, 0);
    for (k, amount) in &keys {
        let Some(last) = retried(target, &headers(target, k), &body(*amount), deadline, &mut met) else {
            stuck += 1;
            t.expect(!required, || {
                format!(
                    "key {k} is still in flight {}s after its client hung up (the profile's lease_seconds)",
                    lease.as_secs()
                )
            });
            continue;
        };
        made += if target.made(&last) { *amount } else { 0 };
        t.expect(target.made(&last), || {
            format!("key {k}: its final answer is no transfer made: {}", last.short())
        });
        let again = exchange(target.address, &target.post_bytes(&headers(target, k), &body(*amount)))?;
        t.expect(target.replays(&again, &last), || {
            format!("key {k}: the retry after a final answer {} got {}", last.short(), again.short())
        });
    }
    met.judge(target, t);
    stayed(t, stuck, required);
    match drain {
        Some(d) => paid_once(target, t, d, made, 300),
        None => {
            t.step("(no drain in the profile, too small, or a body that names no {src} and {dst}: the money moved is not counted)");
            Ok(())
        }
    }
}

/// Sends each request on a connection of its own and walks away at a
/// random moment; how many were cut before their last byte, just after it,
/// and a few milliseconds later.
fn one_at_a_time(target: &Target, requests: &[Vec<u8>], rng: &mut Rng) -> Result<[usize; 3], CheckError> {
    let mut cuts = [0; 3];
    for request in requests {
        let cut = rng.below(3) as usize;
        cuts[cut] += 1;
        let mut s = connect(target)?;
        let sent = if cut == 0 { &request[..request.len() - 1] } else { &request[..] };
        s.write_all(sent).map_err(CheckError::io("send"))?;
        if cut == 2 {
            std::thread::sleep(Duration::from_millis(rng.below(20)));
        }
    }
    Ok(cuts)
}

/// Sends the requests whole, together, on connections opened beforehand,
/// and walks away from all of them a random few milliseconds later (how
/// many): on the same accounts, all but one are then waiting for locks.
fn together(target: &Target, requests: &[Vec<u8>], rng: &mut Rng) -> Result<u64, CheckError> {
    let mut open = Vec::new();
    for _ in requests {
        open.push(connect(target)?);
    }
    for (s, r) in open.iter_mut().zip(requests) {
        s.write_all(r).map_err(CheckError::io("send"))?;
    }
    let gone = rng.below(5);
    std::thread::sleep(Duration::from_millis(gone));
    Ok(gone)
}

fn connect(target: &Target) -> Result<TcpStream, CheckError> {
    TcpStream::connect_timeout(&target.address, Duration::from_secs(5)).map_err(CheckError::io("connect"))
}

/// The first token's `Authorization` and key `k`'s `Idempotency-Key`.
pub(super) fn headers(target: &Target, k: &str) -> [(&'static str, String); 2] {
    [("Authorization", format!("Bearer {}", target.tokens[0])), ("Idempotency-Key", target.key_header(k))]
}

/// How long a property waits for its keys to settle, and whether a key
/// still in flight then fails it: the profile's lease; or, when it declares
/// none (`lease_seconds: null`, the lab's choice: a key whose request died
/// stays in flight for good, a client can never finish it), [`NO_LEASE_WAIT`],
/// after which a key still in flight is counted and said, never failed.
/// Safety (nothing paid twice, every answer given replayed) is judged either way.
pub(super) fn lease(target: &Target) -> (Duration, bool) {
    match target.profile.lease_seconds {
        Some(seconds) => (Duration::from_secs(seconds), true),
        None => (NO_LEASE_WAIT, false),
    }
}

/// How long keys are given to settle when the profile declares no lease.
pub(super) const NO_LEASE_WAIT: Duration = Duration::from_secs(5);

/// Says how many keys stayed in flight when the profile allows it.
pub(super) fn stayed(t: &mut Trace, stuck: usize, required: bool) {
    if stuck > 0 && !required {
        t.note(format!(
            "{stuck} keys stayed in flight: the profile declares no lease (lease_seconds: null), so they are \
             counted, not failed; the money moved is counted on the keys that ended"
        ));
    }
}

/// The in-flight answers a property's retries met, and how many of them
/// came without `Retry-After`.
#[derive(Debug, Default)]
pub(super) struct InFlight {
    pub seen: usize,
    pub bare: usize,
}

impl InFlight {
    /// Says what was met and, when the profile declares `Retry-After` on
    /// in-flight answers, holds every one of them to it: judged wherever
    /// the check meets one, not only in the races made for it.
    pub(super) fn judge(&self, target: &Target, t: &mut Trace) {
        if self.seen == 0 {
            return;
        }
        t.step(format!(
            "{} in-flight answers met while retrying, {} without Retry-After",
            self.seen, self.bare
        ));
        if target.profile.in_flight_retry_after {
            let bare = self.bare;
            t.expect(bare == 0, || format!("{bare} in-flight answers without Retry-After (declared)"));
        }
    }
}

/// Sends the request until an answer that is final (not in flight, not a
/// 5xx or 429, not a lost connection), as a client retries; `None` if none
/// came before `deadline`. Each in-flight answer is counted in `met`.
pub(super) fn retried(
    target: &Target,
    headers: &[(&str, String)],
    body: &str,
    deadline: Instant,
    met: &mut InFlight,
) -> Option<Http> {
    let request = target.post_bytes(headers, body);
    loop {
        match exchange(target.address, &request) {
            Ok(h) if is_final(target, &h) => return Some(h),
            Ok(h) if h.status == target.profile.in_flight_status => {
                met.seen += 1;
                met.bare += usize::from(h.header("retry-after").is_none());
            }
            _ => {}
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Whether `h` ends its key's story: not in flight, not busy (429), not a
/// 5xx (a lost connection is no answer at all).
pub(super) fn is_final(target: &Target, h: &Http) -> bool {
    h.status != target.profile.in_flight_status && h.status != 429 && h.status < 500
}

/// One transfer from `src` to `dst` of `amount` under a fresh key `n`.
fn send(
    target: &Target,
    t: &mut Trace,
    n: u64,
    (src, dst): (&serde_json::Value, &serde_json::Value),
    amount: i64,
) -> Result<Http, CheckError> {
    let body = target.body(src, dst, amount);
    target.post(t, Some(&target.tokens[0]), Some(&target.key(n)), &body)
}

/// Whether the drain holds its whole balance (it can pay it, and is paid
/// it back), so that the money of the walked-away keys can be counted.
/// Its keys are fresh keys `salt + 1` and `salt + 2`.
pub(super) fn holds_all(
    target: &Target,
    t: &mut Trace,
    d: &super::http::Drain,
    salt: u64,
) -> Result<bool, CheckError> {
    if !target.made(&send(target, t, salt + 1, (&d.src, &d.dst), d.balance)?) {
        return Ok(false);
    }
    let back = send(target, t, salt + 2, (&d.dst, &d.src), d.balance)?;
    t.expect(target.made(&back), || "the drain's balance could not be put back".into());
    Ok(target.made(&back))
}

/// The drain paid `moved` to its destination through the walked-away keys:
/// the check sends it back, then asks the drain for its whole balance (made
/// only if nothing was paid twice) and puts that back too. Its keys are
/// fresh keys `salt + 3` to `salt + 5`.
pub(super) fn paid_once(
    target: &Target,
    t: &mut Trace,
    d: &super::http::Drain,
    moved: i64,
    salt: u64,
) -> Result<(), CheckError> {
    let back = send(target, t, salt + 3, (&d.dst, &d.src), moved)?;
    t.expect(target.made(&back), || format!("the {moved} the drain paid could not be sent back"));
    let whole = target.made(&send(target, t, salt + 4, (&d.src, &d.dst), d.balance)?);
    t.expect(whole, || {
        format!("the drain no longer holds its {}: a key was paid twice, or an update was lost", d.balance)
    });
    if whole {
        let again = send(target, t, salt + 5, (&d.dst, &d.src), d.balance)?;
        t.expect(target.made(&again), || "the drain's balance could not be put back".into());
    }
    Ok(())
}
