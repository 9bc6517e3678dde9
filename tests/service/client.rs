//! `idem transfer`, the retrying client, on the real binary against a real
//! `idem serve`: one key from the first attempt to the last, kept in a file
//! before anything is sent; a final 4xx is not retried; a budget that runs
//! out says "outcome unknown, retry with key K", never "failed".

use crate::common::*;
use crate::server::{IDEM, Serve};
use std::process::{Command, Output};

fn transfer(url: &str, token: &str, args: &[&str]) -> Output {
    Command::new(IDEM).args(["transfer", "--url", url, "--token", token]).args(args).output().unwrap()
}

#[test]
fn a_key_file_makes_a_resumed_client_replay_instead_of_paying_again() {
    let mut rng = rng();
    let bank = Bank::on(Backend::Sqlite, &mut rng, 2, false);
    let (s, d) = (bank.accounts[0].as_str().unwrap(), bank.accounts[1].as_str().unwrap());
    let key_file = bank.dir.path().join("t.key");
    let args = ["--src", s, "--dst", d, "--amount", "42", "--key-file", key_file.to_str().unwrap()];

    // nobody listens yet: the outcome is unknown, and the key is on disk already
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead_url = format!("http://{}", dead.local_addr().unwrap());
    drop(dead);
    let out = transfer(&dead_url, "tok", &[&args[..], &["--budget", "300ms"]].concat());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(75), "{stderr}");
    let key = std::fs::read_to_string(&key_file).unwrap().trim().to_owned();
    assert!(
        stderr.contains("outcome unknown") && stderr.contains(&format!("retry with key {key}")),
        "{stderr}"
    );
    assert!(!stderr.contains("failed"), "{stderr}");

    let serve = Serve::start(&bank.db, &[("tok", "shop-1")], &[], &[]);
    let first = transfer(&serve.url, "tok", &args);
    assert_eq!(first.status.code(), Some(0), "{}", String::from_utf8_lossy(&first.stderr));
    let again = transfer(&serve.url, "tok", &args);
    assert_eq!(again.status.code(), Some(0));
    assert_eq!(first.stdout, again.stdout, "the resumed client paid again");
    assert_eq!(bank.transfers().len(), 1);
}

#[test]
fn a_final_refusal_is_not_retried_and_exits_4() {
    let mut rng = rng();
    let bank = Bank::on(Backend::Sqlite, &mut rng, 2, false);
    let serve = Serve::start(&bank.db, &[("tok", "shop-1")], &[], &[]);
    let d = bank.accounts[1].as_str().unwrap();
    let out = transfer(&serve.url, "tok", &["--src", "ghost", "--dst", d, "--amount", "1", "--key", "k-404"]);
    assert_eq!(out.status.code(), Some(4));
    let problem: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(problem["reason"], "unknown_account");
    assert!(String::from_utf8_lossy(&out.stderr).contains("after 1 attempt(s)"));
    let wrong_token = transfer(&serve.url, "nope", &["--src", "a", "--dst", "b", "--amount", "1"]);
    assert_eq!(wrong_token.status.code(), Some(4));
}

#[test]
fn a_retry_in_flight_is_waited_out_with_backoff() {
    let mut rng = rng();
    let bank = Bank::on(Backend::Sqlite, &mut rng, 2, false);
    let (s, d) = (bank.accounts[0].as_str().unwrap(), bank.accounts[1].as_str().unwrap());
    let serve = Serve::start(&bank.db, &[("tok", "shop-1")], &[], &[]);
    // hold the write lock for a moment: the first attempt waits, a second would 409
    let conn = rusqlite::Connection::open(&bank.db).unwrap();
    conn.execute_batch("BEGIN IMMEDIATE").unwrap();
    let release = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(500));
        conn.execute_batch("COMMIT").unwrap();
    });
    let out = transfer(&serve.url, "tok", &["--src", s, "--dst", d, "--amount", "3", "--key", "k"]);
    release.join().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(bank.transfers().len(), 1);
}

/// Runs `idem transfer` with `args`; returns (exit code, stdout, the key it
/// said it sent on stderr, stderr).
fn run(url: &str, args: &[String]) -> (Option<i32>, String, Option<String>, String) {
    let out =
        Command::new(IDEM).args(["transfer", "--url", url, "--token", "tok"]).args(args).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let key = stderr.lines().find_map(|l| l.strip_prefix("idem: key ")).map(String::from);
    (out.status.code(), String::from_utf8_lossy(&out.stdout).into_owned(), key, stderr)
}

#[test]
fn twenty_runs_on_key_files_that_differ_only_in_extension_each_send_the_key_their_file_holds() {
    let mut rng = rng();
    let bank = Bank::on(Backend::Sqlite, &mut rng, 2, false);
    let (s, d) = (bank.accounts[0].as_str().unwrap(), bank.accounts[1].as_str().unwrap());
    let serve = Serve::start(&bank.db, &[("tok", "shop-1")], &[], &[]);
    let keys = bank.dir.path().join("keys");
    std::fs::create_dir(&keys).unwrap();
    let args = |n: usize| -> Vec<String> {
        let file = keys.join(format!("order.{n}"));
        ["--src", s, "--dst", d, "--amount", &n.to_string(), "--key-file", file.to_str().unwrap()]
            .map(String::from)
            .to_vec()
    };
    let barrier = std::sync::Barrier::new(20);
    let firsts: Vec<_> = std::thread::scope(|scope| {
        let runs: Vec<_> = (1..=20)
            .map(|n| {
                let (barrier, args) = (&barrier, args(n));
                let url = serve.url.clone();
                scope.spawn(move || {
                    barrier.wait();
                    run(&url, &args)
                })
            })
            .collect();
        runs.into_iter().map(|r| r.join().unwrap()).collect()
    });
    for (n, (code, stdout, key, stderr)) in (1..=20).zip(&firsts) {
        assert_eq!(*code, Some(0), "order.{n}: {stderr}");
        let held = std::fs::read_to_string(keys.join(format!("order.{n}"))).unwrap();
        assert_eq!(Some(held.trim_end()), key.as_deref(), "order.{n} holds a key its run did not send");
        // a rerun with the same file, as docs/service.md says, replays
        let (code, again, _, stderr) = run(&serve.url, &args(n));
        assert_eq!((code, &again), (Some(0), stdout), "order.{n}: the rerun paid again: {stderr}");
    }
    assert_eq!(bank.transfers().len(), 20);
    // no temporary file is left beside the keys
    assert_eq!(std::fs::read_dir(&keys).unwrap().count(), 20);
}

#[test]
fn twenty_runs_on_one_key_file_all_send_one_key_and_pay_once() {
    let mut rng = rng();
    let bank = Bank::on(Backend::Sqlite, &mut rng, 2, false);
    let (s, d) = (bank.accounts[0].as_str().unwrap(), bank.accounts[1].as_str().unwrap());
    let serve = Serve::start(&bank.db, &[("tok", "shop-1")], &[], &[]);
    let file = bank.dir.path().join("order.key");
    let args: Vec<String> = ["--src", s, "--dst", d, "--amount", "9", "--key-file", file.to_str().unwrap()]
        .map(String::from)
        .to_vec();
    let barrier = std::sync::Barrier::new(20);
    let runs: Vec<_> = std::thread::scope(|scope| {
        let runs: Vec<_> = (0..20)
            .map(|_| {
                scope.spawn(|| {
                    barrier.wait();
                    run(&serve.url, &args)
                })
            })
            .collect();
        runs.into_iter().map(|r| r.join().unwrap()).collect()
    });
    let held = std::fs::read_to_string(&file).unwrap();
    for (code, stdout, key, stderr) in &runs {
        assert_eq!(*code, Some(0), "{stderr}");
        assert_eq!(key.as_deref(), Some(held.trim_end()), "{stderr}");
        assert_eq!(stdout, &runs[0].1, "two runs of one key got two answers");
    }
    assert_eq!(bank.transfers().len(), 1);
}

/// A front that stands where a gateway would: the first request goes to
/// `upstream` and its answer is read and thrown away (lost after the
/// commit); each later request gets the next of `then`, or, when `then`
/// has run out, is passed through to `upstream`.
fn front(upstream: &str, then: Vec<&'static str>) -> (String, std::thread::JoinHandle<()>) {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let upstream = upstream.trim_start_matches("http://").to_owned();
    let handle = std::thread::spawn(move || {
        let mut scripted = then.into_iter();
        for (n, stream) in listener.incoming().enumerate() {
            let mut stream = stream.unwrap();
            let request = read_request(&mut stream);
            let pass = |stream: Option<&mut std::net::TcpStream>| {
                let mut up = std::net::TcpStream::connect(&upstream).unwrap();
                up.write_all(&request).unwrap();
                let mut answer = Vec::new();
                up.read_to_end(&mut answer).unwrap();
                if let Some(stream) = stream {
                    stream.write_all(&answer).unwrap();
                }
            };
            if n == 0 {
                pass(None);
                continue;
            }
            match scripted.next() {
                Some(answer) => stream.write_all(answer.as_bytes()).unwrap(),
                None => {
                    pass(Some(&mut stream));
                    return;
                }
            }
        }
    });
    (url, handle)
}

/// One HTTP/1.1 request with a Content-Length body, as the client sends it.
fn read_request(stream: &mut std::net::TcpStream) -> Vec<u8> {
    use std::io::Read;
    let mut request = Vec::new();
    let mut byte = [0u8; 1];
    while !request.ends_with(b"\r\n\r\n") && stream.read(&mut byte).unwrap() == 1 {
        request.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&request).to_ascii_lowercase();
    let length: usize =
        head.lines().find_map(|l| l.strip_prefix("content-length:")).map_or(0, |v| v.trim().parse().unwrap());
    let mut body = vec![0u8; length];
    stream.read_exact(&mut body).unwrap();
    // the client keeps the connection open; ask the upstream to close it
    let head = String::from_utf8_lossy(&request).replacen("\r\n\r\n", "\r\nConnection: close\r\n\r\n", 1);
    [head.into_bytes(), body].concat()
}

const ROTATED: &str = "HTTP/1.1 401 Unauthorized\r\ncontent-type: application/problem+json\r\ncontent-length: 20\r\nconnection: close\r\n\r\n{\"reason\":\"expired\"}";
const LIMITED: &str =
    "HTTP/1.1 429 Too Many Requests\r\nretry-after: 1\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";

#[test]
fn a_refusal_after_a_lost_answer_is_an_unknown_outcome_not_a_final_one() {
    let mut rng = rng();
    let bank = Bank::on(Backend::Sqlite, &mut rng, 2, false);
    let (s, d) = (bank.accounts[0].as_str().unwrap(), bank.accounts[1].as_str().unwrap());
    let serve = Serve::start(&bank.db, &[("tok", "shop-1")], &[], &[]);
    // the first answer is lost after the commit; the retry meets a rotated token
    let (url, gateway) = front(&serve.url, vec![ROTATED]);
    let args: Vec<String> =
        ["--src", s, "--dst", d, "--amount", "5", "--key", "k-401"].map(String::from).to_vec();
    let (code, stdout, _, stderr) = run(&url, &args);
    assert_eq!(
        code,
        Some(75),
        "a 401 after a lost answer is not the transfer's final word: {stdout} {stderr}"
    );
    assert!(stderr.contains("retry with key k-401") && stderr.contains("HTTP 401"), "{stderr}");
    assert_eq!(bank.transfers().len(), 1, "the lost attempt went out");
    // the caller does as told: the same key, the service reached directly
    let (code, _, _, stderr) = run(&serve.url, &args);
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(bank.transfers().len(), 1, "paid twice");
    drop(gateway);
}

#[test]
fn a_429_is_retried_after_its_retry_after() {
    let mut rng = rng();
    let bank = Bank::on(Backend::Sqlite, &mut rng, 2, false);
    let (s, d) = (bank.accounts[0].as_str().unwrap(), bank.accounts[1].as_str().unwrap());
    let serve = Serve::start(&bank.db, &[("tok", "shop-1")], &[], &[]);
    let (url, gateway) = front(&serve.url, vec![LIMITED]);
    let args: Vec<String> =
        ["--src", s, "--dst", d, "--amount", "5", "--key", "k-429"].map(String::from).to_vec();
    let started = std::time::Instant::now();
    let (code, stdout, _, stderr) = run(&url, &args);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(started.elapsed() >= std::time::Duration::from_secs(1), "Retry-After: 1 was not honoured");
    let t: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(t["amount"], 5);
    assert_eq!(bank.transfers().len(), 1, "paid twice");
    gateway.join().unwrap();
}

#[test]
fn keys_are_sent_as_escaped_sf_strings_and_unsendable_ones_are_refused_at_once() {
    let mut rng = rng();
    let bank = Bank::on(Backend::Sqlite, &mut rng, 2, false);
    let (s, d) = (bank.accounts[0].as_str().unwrap(), bank.accounts[1].as_str().unwrap());
    let serve = Serve::start(&bank.db, &[("tok", "shop-1")], &[], &[]);
    let quoted: Vec<String> =
        ["--src", s, "--dst", d, "--amount", "6", "--key", r#"x"y\z"#].map(String::from).to_vec();
    let (code, first, _, stderr) = run(&serve.url, &quoted);
    assert_eq!(code, Some(0), "{stderr}");
    // the service holds the key as given: the same key, spelled by hand, replays
    let again = serve.post(
        Some("tok"),
        Some(r#""x\"y\\z""#),
        &crate::server::body(&bank.accounts[0], &bank.accounts[1], 6),
    );
    assert_eq!((again.status, again.body.as_str()), (201, first.trim_end()));
    assert_eq!(again.header("idempotent-replayed"), Some("true"));

    let file = bank.dir.path().join("broken.key");
    std::fs::write(&file, "two\nlines\n").unwrap();
    for extra in [
        vec!["--key-file".to_string(), file.to_string_lossy().into_owned()],
        vec!["--key".into(), "tab\there".into()],
        vec!["--key".into(), String::new()],
    ] {
        let args: Vec<String> = ["--src", s, "--dst", d, "--amount", "7", "--budget", "20s"]
            .map(String::from)
            .into_iter()
            .chain(extra.clone())
            .collect();
        let started = std::time::Instant::now();
        let (code, _, _, stderr) = run(&serve.url, &args);
        assert_eq!(code, Some(1), "{extra:?}: {stderr}");
        assert!(started.elapsed() < std::time::Duration::from_secs(5), "{extra:?} was retried");
        assert!(stderr.lines().count() == 1 && stderr.contains("key"), "{extra:?}: {stderr}");
    }
    assert_eq!(bank.transfers().len(), 1);
    let posts = |log: &str| log.lines().filter(|l| l.contains("\"POST\"")).count();
    let log = serve.log_when(|log| posts(log) >= 2);
    assert_eq!(posts(&log), 2, "{log}");
}

const UNAVAILABLE: &str =
    "HTTP/1.1 503 Service Unavailable\r\nretry-after: 0\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";

#[test]
fn with_several_urls_each_retry_goes_to_the_next_instance_with_the_same_key() {
    let mut rng = rng();
    let bank = Bank::on(Backend::Sqlite, &mut rng, 2, false);
    let (s, d) = (bank.accounts[0].as_str().unwrap(), bank.accounts[1].as_str().unwrap());
    let serve = Serve::start(&bank.db, &[("tok", "shop-1")], &[], &[]);
    // the first instance commits and loses the answer, then answers only 503
    let (sick, _front) = front(&serve.url, vec![UNAVAILABLE; 100]);
    let args = ["--src", s, "--dst", d, "--amount", "9", "--key", "k-two", "--budget", "3s"];
    let alone =
        Command::new(IDEM).args(["transfer", "--url", &sick, "--token", "tok"]).args(args).output().unwrap();
    assert_eq!(alone.status.code(), Some(75), "one sick instance: the outcome stays unknown");
    let both = Command::new(IDEM)
        .args(["transfer", "--url", &sick, "--url", &serve.url, "--token", "tok"])
        .args(args)
        .output()
        .unwrap();
    assert_eq!(both.status.code(), Some(0), "{}", String::from_utf8_lossy(&both.stderr));
    let t: serde_json::Value = serde_json::from_slice(&both.stdout).unwrap();
    assert_eq!(t["amount"], 9);
    assert_eq!(bank.transfers().len(), 1, "paid twice");
}

/// `idem transfer` says when the transfer was first sent, the same on
/// every try (OASIS Repeatable Requests), so that a try arriving after its
/// key may be gone is refused (412) instead of paid again.
#[test]
fn every_try_of_one_transfer_says_when_it_was_first_sent() {
    use std::io::Write;
    let mut rng = rng();
    let bank = Bank::on(Backend::Sqlite, &mut rng, 2, false);
    let (s, d) = (bank.accounts[0].as_str().unwrap(), bank.accounts[1].as_str().unwrap());
    let serve = Serve::start(&bank.db, &[("tok", "shop-1")], &[], &[]);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let upstream = serve.url.trim_start_matches("http://").to_owned();
    let recorder = std::thread::spawn(move || {
        let mut seen = Vec::new();
        for (n, stream) in listener.incoming().enumerate() {
            let mut stream = stream.unwrap();
            let request = read_request(&mut stream);
            let head = String::from_utf8_lossy(&request).into_owned();
            let first_sent = head.lines().find_map(|l| {
                let (name, value) = l.split_once(':')?;
                name.eq_ignore_ascii_case("repeatability-first-sent").then(|| value.trim().to_owned())
            });
            seen.push(first_sent);
            if n < 2 {
                let busy = "HTTP/1.1 503 Service Unavailable\r\nretry-after: 0\r\ncontent-length: 0\r\nconnection: close\r\n\r\n";
                stream.write_all(busy.as_bytes()).unwrap();
                continue;
            }
            let mut up = std::net::TcpStream::connect(&upstream).unwrap();
            up.write_all(&request).unwrap();
            std::io::copy(&mut up, &mut stream).unwrap();
            return seen;
        }
        seen
    });
    let args: Vec<String> =
        ["--src", s, "--dst", d, "--amount", "5", "--key", "k-fs"].map(String::from).to_vec();
    let (code, _, _, stderr) = run(&url, &args);
    assert_eq!(code, Some(0), "{stderr}");
    let seen = recorder.join().unwrap();
    assert_eq!(seen.len(), 3, "{seen:?}");
    let first = seen[0].clone().expect("the first try says when it was sent");
    assert!(seen.iter().all(|s| s.as_deref() == Some(first.as_str())), "one date on every try: {seen:?}");
    let at = idem::clock::http_date(&first).expect("an HTTP-date");
    let age = time::OffsetDateTime::now_utc() - at;
    assert!(age >= time::Duration::ZERO && age < time::Duration::minutes(1), "{first}: {age}");
    assert_eq!(bank.transfers().len(), 1);
}
