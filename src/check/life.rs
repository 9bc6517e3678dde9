//! `idem check --serve CMD`: the check starts the service itself, on a
//! fresh bank of its own, and judges what only its process can show: a
//! SIGKILL at a random moment under load, then a restart; a SIGTERM under
//! load. Through both, every key's retry must execute once or replay
//! what was answered before (no double payment, no key held past the
//! lease), and a shutdown must answer every request it accepted.
//!
//! The bank is a SQLite file with the lab's `account` table (accounts `A`,
//! rich; `B`, empty; `D`, the drain of the `--url` properties; `K` and
//! `T`, one for each property here), and the clients a JSON file of token
//! → client id (`tok-1` and `tok-1b` of `shop-1`, `tok-2` of `shop-2`).
//! CMD is run in a process group of its own (a wrapper script's children
//! get the signals too), its output kept in the check's directory.

use super::http::{Drain, Http, Profile, Target, begun, ended, exchange, exchange_within, read_answer};
use super::process::Process;
use super::walk::{InFlight, headers, holds_all, is_final, lease, paid_once, retried, stayed};
use super::{CheckError, Property, Trace, history};
use crate::rng::Rng;
use serde_json::json;
use std::io::Write;
use std::net::TcpStream;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The accounts the check's bank holds, and their balances.
const ACCOUNTS: [(&str, i64); 7] =
    [("A", 1_000_000_000), ("B", 0), ("D", 800), ("K", PAID), ("T", PAID), ("F", PAID), ("P", PAID)];
/// The tokens the check's clients file holds, and whose they are.
const CLIENTS: [(&str, &str); 3] = [("tok-1", "shop-1"), ("tok-2", "shop-2"), ("tok-1b", "shop-1")];
/// Keys a property sends, each of an amount 1, 2, … [`KEYS`].
const KEYS: i64 = 24;
/// What those keys pay together: the balance of each property's account.
const PAID: i64 = KEYS * (KEYS + 1) / 2;
/// Connections sending the load at once.
const LANES: usize = 4;
/// How long a client waits for an answer before it gives up.
const WAIT: Duration = Duration::from_secs(30);
/// The same, in the pause: the process stays stopped longer than this.
const PAUSED_WAIT: Duration = Duration::from_secs(1);
const PAUSE: Duration = Duration::from_millis(2_500);
/// Runs of the kill property at most, until one kill lands mid-request.
const ATTEMPTS: u32 = 3;

/// Starts `command` on a fresh bank, with `{db}`, `{clients}`, `{listen}`,
/// `{port}` and `{dir}` in its words replaced (none of them: `--db {db}
/// --listen {listen} --clients {clients}` are appended, `idem serve`'s
/// flags); returns the target, with the profile's clients and drain the
/// bank's own.
pub fn start(command: &str, mut profile: Profile, seed: u64) -> Result<Target, CheckError> {
    let words = shlex::split(command).ok_or_else(|| format!("--serve {command:?}: unbalanced quotes"))?;
    if words.is_empty() {
        return Err("--serve: the command is empty".into());
    }
    let dir = tempfile::Builder::new()
        .prefix("idem-check-serve-")
        .tempdir()
        .map_err(CheckError::io("a directory for the service"))?;
    let db = dir.path().join("bank.db");
    let conn = rusqlite::Connection::open(&db)?;
    conn.execute_batch(crate::store::bank::ACCOUNT)?;
    for (id, balance) in ACCOUNTS {
        conn.execute("INSERT INTO account VALUES (?1, 'check', ?2)", (id, balance))?;
    }
    drop(conn);
    let clients = dir.path().join("clients.json");
    let map: serde_json::Map<String, serde_json::Value> =
        CLIENTS.iter().map(|(t, c)| (t.to_string(), json!(c))).collect();
    std::fs::write(&clients, serde_json::Value::Object(map).to_string())
        .map_err(CheckError::io("writing the clients file"))?;
    let port = service_port()?;
    let listen = format!("127.0.0.1:{port}");
    let fill = |w: &str| {
        let dir = dir.path().display().to_string();
        w.replace("{db}", &db.display().to_string())
            .replace("{clients}", &clients.display().to_string())
            .replace("{listen}", &listen)
            .replace("{port}", &port.to_string())
            .replace("{dir}", &dir)
    };
    let placed =
        words.iter().any(|w| ["{db}", "{clients}", "{listen}", "{port}"].iter().any(|p| w.contains(p)));
    let mut command: Vec<String> = words.iter().map(|w| fill(w)).collect();
    if !placed {
        command.extend(["--db", "{db}", "--listen", "{listen}", "--clients", "{clients}"].map(fill));
    }
    profile.clients = Some(CLIENTS.iter().map(|(t, c)| (t.to_string(), c.to_string())).collect());
    profile.drain = Some(Drain { src: json!("D"), dst: json!("B"), balance: 800 });
    let tokens = CLIENTS.iter().map(|(t, _)| t.to_string()).collect();
    let mut target = Target::new(&format!("http://{listen}"), tokens, json!("A"), json!("B"), profile, seed)?;
    let process = Process {
        command,
        child: Mutex::new(None),
        log: dir.path().join("service.log"),
        address: target.address,
        _dir: dir,
    };
    process.spawn()?;
    target.process = Some(process);
    Ok(target)
}

/// A port free now for the service, kept across its restarts: one below
/// the kernel's ephemeral range, so that no socket bound to port 0
/// meanwhile (another check's, a test's server, an outgoing connection)
/// is given it while the service is down or still starting. A port from
/// port 0 was: two checks side by side were handed the same one, and one
/// check judged the other's service. Ports at random, tried until one
/// binds; port 0's if the range cannot be read.
fn service_port() -> Result<u16, CheckError> {
    use std::hash::{BuildHasher, Hasher};
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap_or_default();
    let low = range.split_whitespace().next().and_then(|p| p.parse::<u16>().ok()).unwrap_or(0);
    if low > 10_000 {
        let mut random = std::collections::hash_map::RandomState::new().build_hasher();
        for attempt in 0..64_u64 {
            random.write_u64(attempt);
            let port = 10_000 + (random.finish() % u64::from(low - 10_000)) as u16;
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                return Ok(port);
            }
        }
    }
    let any = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr());
    Ok(any.map_err(CheckError::io("finding a free port"))?.port())
}

/// The process the check started, or a SKIP saying it has none.
fn process<'a>(target: &'a Target, t: &mut Trace) -> Option<&'a Process> {
    if target.process.is_none() {
        t.skip("needs --serve: the check starts the service to stop it");
    }
    target.process.as_ref()
}

/// Two transfers sent one by one before the load: how long one request
/// takes here. With accounts to name, they are `drain`'s whole balance
/// paid out and back (it must hold it, to count the money after);
/// without, two plain transfers.
fn timed(target: &Target, t: &mut Trace, drain: &Drain, salt: u64) -> Result<Duration, CheckError> {
    let begun = Instant::now();
    if !target.money() {
        t.step("(the profile's body names no {src} and {dst}: keys and replays are judged, the money is not counted)");
        for n in 1..=2 {
            let body = target.body(&drain.src, &drain.dst, 1);
            let made = target.post(t, Some(&target.tokens[0]), Some(&target.key(salt + n)), &body)?;
            t.expect(target.made(&made), || "a transfer before the load was not made".into());
        }
    } else if !holds_all(target, t, drain, salt)? {
        return Err(format!(
            "the account {} does not hold its balance: the check's bank was changed",
            drain.src
        )
        .into());
    }
    Ok(begun.elapsed() / 2)
}

/// The keys of one property: `KEYS` keys, key `i` paying `i` from `src`.
fn keys(target: &Target, salt: u64) -> Vec<(String, i64)> {
    (1..=KEYS).map(|i| (target.key(salt + i as u64), i)).collect()
}

/// Sends `keys` from `drain` on [`LANES`] connections at once, one request
/// each, and runs `stop` after `delay` or once `answers` answers are back,
/// whichever comes first; each key's answer, if one came within `wait`.
fn under_load(
    target: &Target,
    keys: &[(String, i64)],
    drain: &Drain,
    [delay, wait]: [Duration; 2],
    answers: usize,
    stop: impl FnOnce(),
) -> Vec<Option<Http>> {
    let answered = AtomicUsize::new(0);
    let lanes = keys.len().div_ceil(LANES);
    std::thread::scope(|s| {
        let runs: Vec<_> = keys
            .chunks(lanes)
            .map(|chunk| {
                let answered = &answered;
                s.spawn(move || {
                    let sent = chunk.iter().map(|(k, amount)| {
                        let body = target.body(&drain.src, &drain.dst, *amount);
                        let request = target.post_bytes(&headers(target, k), &body);
                        let got = exchange_within(target.address, &request, wait).ok();
                        answered.fetch_add(1, Ordering::SeqCst);
                        got
                    });
                    sent.collect::<Vec<_>>()
                })
            })
            .collect();
        let until = Instant::now() + delay;
        while answered.load(Ordering::SeqCst) < answers.min(keys.len()) && Instant::now() < until {
            std::thread::yield_now();
        }
        stop();
        runs.into_iter().flat_map(|r| r.join().unwrap_or_default()).collect()
    })
}

/// After the restart: each key retried until final within the lease, made
/// (the account holds what all of them pay), its earlier final answer
/// replayed, and the money counted (each key paid once); whether it was
/// (not when a declared no-lease left keys in flight).
fn settle(
    target: &Target,
    t: &mut Trace,
    keys: &[(String, i64)],
    before: &[Option<Http>],
    drain: &Drain,
    salt: u64,
) -> Result<bool, CheckError> {
    let (lease, required) = lease(target);
    let deadline = Instant::now() + lease;
    let mut settled = true;
    let (mut met, mut stuck, mut made) = (InFlight::default(), 0, 0);
    for ((k, amount), first) in keys.iter().zip(before) {
        let body = target.body(&drain.src, &drain.dst, *amount);
        let Some(last) = retried(target, &headers(target, k), &body, deadline, &mut met) else {
            stuck += 1;
            settled &= t.expect(!required, || {
                format!(
                    "key {k} is still in flight {}s after the restart (the profile's lease_seconds)",
                    lease.as_secs()
                )
            });
            continue;
        };
        made += if target.made(&last) { *amount } else { 0 };
        t.expect(target.made(&last), || {
            format!("key {k} of {amount}: wanted a transfer made, got {}", last.short())
        });
        if let Some(first) = first.as_ref().filter(|f| is_final(target, f)) {
            t.expect(target.replays(&last, first), || match last.body == first.body {
                true => format!("key {k}: its answer after the restart is not marked as a replay"),
                false => {
                    format!("key {k}: answered {} before, {} after the restart", first.short(), last.short())
                }
            });
        }
    }
    met.judge(target, t);
    stayed(t, stuck, required);
    if !settled {
        t.step("(keys left in flight: the money moved is not counted)");
        return Ok(false);
    }
    if target.money() {
        paid_once(target, t, drain, made, salt)?;
    }
    Ok(true)
}

/// Rounds of [`LANES`] transfers at once, each ended by a SIGKILL at a
/// random moment within two requests' time and a restart; then every key
/// settled. A run whose kills all landed after every answer was back is
/// run again on fresh keys, its kills in a window half as long, up to
/// [`ATTEMPTS`] times: an empty PASS is the last resort, and says so.
fn killed(target: &Target, t: &mut Trace) -> Result<(), CheckError> {
    let Some(process) = process(target, t) else { return Ok(()) };
    let mut rng = Rng::new(target.seed ^ 0x6b69_6c6c);
    let drain = Drain { src: json!("K"), dst: json!("B"), balance: PAID };
    let unit = timed(target, t, &drain, 400)?;
    let mut window = unit * 2;
    for attempt in 0..ATTEMPTS {
        if attempt > 0 {
            window /= 2;
        }
        let salt = 1_000 * u64::from(attempt);
        if killed_once(target, t, (process, &drain), &mut rng, window, salt)? || !t.passing() {
            return Ok(());
        }
    }
    t.note(format!(
        "not exercised: in {ATTEMPTS} runs, down to a window of {} µs, every round was answered whole before its kill",
        window.as_micros()
    ));
    Ok(())
}

/// One run of [`killed`]: its rounds, each killed within `window` of its
/// own start, then its keys settled; whether it ended the property (a
/// kill landed mid-request, or the drain was left uncounted).
fn killed_once(
    target: &Target,
    t: &mut Trace,
    (process, drain): (&Process, &Drain),
    rng: &mut Rng,
    window: Duration,
    salt: u64,
) -> Result<bool, CheckError> {
    let keys = keys(target, 500 + salt);
    let (mut before, mut answered, mut restarts) = (Vec::new(), Vec::new(), Duration::ZERO);
    let (rounds, mut landed) = (keys.len().div_ceil(LANES), 0);
    for (r, round) in keys.chunks(LANES).enumerate() {
        // each round's kill timed from its own start, in a stratum of its
        // own of the window: the early ones land mid-request
        let stratum = (r as f64 + rng.below(1_000) as f64 / 1_000.0) / rounds as f64;
        let mut got =
            under_load(target, round, drain, [window.mul_f64(stratum), WAIT], round.len(), || process.kill());
        answered.push(got.iter().filter(|a| a.is_some()).count());
        landed += usize::from(answered[r] < round.len());
        before.append(&mut got);
        restarts = restarts.max(process.spawn()?);
        // warmed, as before the first round: a cold start's first answers are slow
        let warm = target.post_bytes(
            &headers(target, &target.key(900 + salt + r as u64)),
            &target.body(&json!("A"), &drain.dst, 1),
        );
        let _ = exchange(target.address, &warm);
    }
    t.step(format!(
        "{KEYS} transfers, {LANES} at once, each round ended by SIGKILL within {} µs and a restart (at most {} ms): answered before the kill {answered:?}",
        window.as_micros(),
        restarts.as_millis()
    ));
    if landed > 0 {
        t.note(format!("exercised: {landed} of {rounds} kills landed with requests unanswered"));
    }
    let counted = settle(target, t, &keys, &before, drain, 400 + salt)?;
    // a run whose money was not counted leaves the drain short: no other run
    Ok(landed > 0 || !counted)
}

/// Requests from `drain` whose head and all but the last byte of the body
/// are sent: the service has accepted each, and is reading it.
fn half_sent(
    target: &Target,
    keys: &[(String, i64)],
    drain: &Drain,
) -> Result<Vec<(TcpStream, u8, history::Op)>, CheckError> {
    keys.iter()
        .map(|(k, amount)| {
            let body = target.body(&drain.src, &drain.dst, *amount);
            let request = target.post_bytes(&headers(target, k), &body);
            let (s, op) = begun(target.address, &request, request.len() - 1, WAIT)?;
            Ok((s, request[request.len() - 1], op))
        })
        .collect()
}

/// SIGTERM under load, with four requests being read: the service must
/// answer them and exit within the profile's shutdown_seconds; after a
/// restart every key is settled.
fn terminated(target: &Target, t: &mut Trace) -> Result<(), CheckError> {
    let Some(process) = process(target, t) else { return Ok(()) };
    let mut rng = Rng::new(target.seed ^ 0x7465_726d);
    let drain = Drain { src: json!("T"), dst: json!("B"), balance: PAID };
    let unit = timed(target, t, &drain, 410)?;
    let keys = keys(target, 600);
    let (reading, loaded) = keys.split_at(4);
    let mut open = half_sent(target, reading, &drain)?;
    std::thread::sleep(Duration::from_millis(300));
    // within the time the load takes, sent one request a lane at a time
    let lanes = loaded.len().div_ceil(LANES) as u32;
    let delay = (unit * lanes).mul_f64(rng.below(1_000) as f64 / 1_000.0);
    let mut late = Vec::new();
    let mut loads = under_load(target, loaded, &drain, [delay, WAIT], loaded.len(), || {
        process.signal(libc::SIGTERM);
        std::thread::sleep(Duration::from_millis(50));
        // the last bytes of the requests the service was reading
        for (mut s, last, op) in open.drain(..) {
            // read within WAIT: begun set the connection's timeout
            let answer =
                s.write_all(&[last]).map_err(CheckError::io("send")).and_then(|()| read_answer(&mut s));
            ended(op, &answer);
            late.push(answer);
        }
    });
    let shutdown = Duration::from_secs(target.profile.shutdown_seconds);
    let exited = process.exited(shutdown);
    t.step(format!(
        "4 requests being read, {} on {LANES} connections; SIGTERM after {} µs; the 4 read: {:?}; exit: {}",
        loaded.len(),
        delay.as_micros(),
        late.iter().map(|a| a.as_ref().map_or("no answer".into(), Http::short)).collect::<Vec<_>>(),
        exited.map_or("none".into(), |s| s.to_string())
    ));
    for ((k, _), answer) in reading.iter().zip(&late) {
        t.expect(answer.is_ok(), || {
            format!("key {k}: a request the service was reading at SIGTERM got no answer")
        });
    }
    if exited.is_none() {
        t.expect(false, || {
            format!("still running {}s after SIGTERM (the profile's shutdown_seconds)", shutdown.as_secs())
        });
        process.kill();
    }
    process.spawn()?;
    let mut before: Vec<Option<Http>> = late.into_iter().map(Result::ok).collect();
    before.append(&mut loads);
    settle(target, t, &keys, &before, &drain, 410)?;
    Ok(())
}

/// How many keys are sent to a service whose fault point is on.
const CRASHES: usize = 3;

/// The service's own fault point (declared in the profile): started with
/// it on, each of [`CRASHES`] keys is sent once and the service must end
/// between the handler's writes and their commit, unanswered; restarted
/// without it, every key is settled and the money counted, so a handler
/// whose writes committed apart from the key (through a pool of its own)
/// shows as a key paid twice.
fn crashed(target: &Target, t: &mut Trace) -> Result<(), CheckError> {
    let Some(process) = process(target, t) else { return Ok(()) };
    let Some(assign) = target.profile.crash_before_commit_env.clone() else {
        t.skip("the profile declares no fault point (crash_before_commit_env)");
        return Ok(());
    };
    let Some((name, value)) = assign.split_once('=') else {
        return Err(format!("the profile's crash_before_commit_env {assign:?} is not NAME=VALUE").into());
    };
    let drain = Drain { src: json!("F"), dst: json!("B"), balance: PAID };
    let keys = keys(target, 700);
    let mut before = vec![None; keys.len()];
    let mut ended = 0;
    for (i, (k, amount)) in keys[..CRASHES].iter().enumerate() {
        process.kill();
        process.spawn_with(Some((name, value)))?;
        let body = target.body(&drain.src, &drain.dst, *amount);
        let got = exchange(target.address, &target.post_bytes(&headers(target, k), &body)).ok();
        let exited = process.exited(Duration::from_secs(10));
        ended += usize::from(got.is_none() && exited.is_some());
        t.expect(got.is_none(), || {
            format!(
                "key {k}: the declared fault point did not fire (answered {})",
                got.as_ref().map_or(String::new(), Http::short)
            )
        });
        before[i] = got;
    }
    process.kill();
    process.spawn()?;
    t.step(format!(
        "{CRASHES} keys, each sent to the service started with {assign}: ended unanswered before its commit {ended}/{CRASHES}; restarted without it"
    ));
    // the money counted under keys of its own (the keys sent are 701..=724)
    settle(target, t, &keys, &before, &drain, 420)?;
    Ok(())
}

/// Transfers under load; at a random moment within two requests' time, and
/// before half the load's answers are back, the service is stopped (SIGSTOP) for longer than its clients wait, so they
/// give up on what it had read, and resumed (SIGCONT): what it read before
/// the pause runs as it resumes, while every key is retried at once. Then
/// every key settled and paid once.
fn paused(target: &Target, t: &mut Trace) -> Result<(), CheckError> {
    let Some(process) = process(target, t) else { return Ok(()) };
    let mut rng = Rng::new(target.seed ^ 0x7061_7573);
    let drain = Drain { src: json!("P"), dst: json!("B"), balance: PAID };
    let unit = timed(target, t, &drain, 430)?;
    let keys = keys(target, 800);
    let delay = unit.mul_f64(rng.below(2_000) as f64 / 1_000.0);
    // and before half the answers are back: a service faster under load
    // than its first requests was otherwise often done before the pause
    let answers = rng.below(KEYS as u64 / 2) as usize;
    let mut retries = Vec::new();
    let before = under_load(target, &keys, &drain, [delay, PAUSED_WAIT], answers, || {
        process.signal(libc::SIGSTOP);
        std::thread::sleep(PAUSE);
        process.signal(libc::SIGCONT);
        retries = under_load(target, &keys, &drain, [WAIT, WAIT], keys.len(), || {});
    });
    let gave_up = before.iter().filter(|a| a.is_none()).count();
    let statuses: Vec<u16> = retries.iter().map(|r| r.as_ref().map_or(0, |r| r.status)).collect();
    t.step(format!(
        "{KEYS} transfers, {LANES} at once, the service stopped within {} µs or at answer {answers} for {} ms: {gave_up} requests given up after {} ms; every key retried as it resumed -> {statuses:?}",
        2 * unit.as_micros(),
        PAUSE.as_millis(),
        PAUSED_WAIT.as_millis()
    ));
    t.note(match gave_up {
        0 => "not exercised: every request was answered before the pause".into(),
        n => format!(
            "exercised: {n} of {KEYS} requests given up in the pause, every key retried as it resumed"
        ),
    });
    // a key's first final answer, before the pause or as it resumed, is what its later retries replay
    let first: Vec<Option<Http>> = before
        .into_iter()
        .zip(retries)
        .map(|(b, r)| b.filter(|b| is_final(target, b)).or(r.filter(|r| is_final(target, r))))
        .collect();
    settle(target, t, &keys, &first, &drain, 430)?;
    Ok(())
}

/// The properties that need the service's process (`--serve`).
pub static PROPERTIES: [Property<Target>; 4] = [
    Property {
        name: "a service killed under load and restarted pays every key once and replays what it answered",
        contract: "draft §1 and §2.6: the retry of a request must not repeat its effect, and a completed request's response is stored, so a crash (SIGKILL at a random moment) loses no answer given and holds no key past the lease (profile lease_seconds)",
        judge: killed,
    },
    Property {
        name: "a service stopped (SIGTERM) under load answers what it accepted, exits, and loses nothing",
        contract: "RFC 9110 §9.2.2 and draft §2.6: a request accepted is answered or left undone, never half-done; a shutdown ends within the profile's shutdown_seconds, and after a restart every key replays or runs once",
        judge: terminated,
    },
    Property {
        name: "a service crashed between a handler's writes and their commit pays the key once",
        contract: "draft §2.6: the retry of a request must not repeat its effect; a handler's writes commit with its key's completion or not at all (the service's own fault point, declared in the profile's crash_before_commit_env)",
        judge: crashed,
    },
    Property {
        name: "a service paused (SIGSTOP) past its clients' timeout under load, then resumed, pays every key once",
        contract: "draft §1 and §2.7: a request its client gave up on may still run when its process resumes; a retry meets it in flight or replays it, never runs it twice, and every key ends once",
        judge: paused,
    },
];

#[cfg(test)]
mod tests {
    /// The service's port is one no socket bound to port 0 can be given
    /// meanwhile: below the kernel's ephemeral range, and free.
    #[test]
    fn the_services_port_is_below_the_ephemeral_range() {
        let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range").unwrap();
        let low: u16 = range.split_whitespace().next().unwrap().parse().unwrap();
        let ports: Vec<u16> = (0..20).map(|_| super::service_port().unwrap()).collect();
        assert!(ports.iter().all(|p| (10_000..low).contains(p)), "{ports:?}, ephemeral from {low}");
        assert!(ports.windows(2).any(|w| w[0] != w[1]), "always the same port: {ports:?}");
    }
}
