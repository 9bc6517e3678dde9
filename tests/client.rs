//! `idem transfer`, the retrying client, on the real binary against a real
//! `idem serve`: one key from the first attempt to the last, kept in a file
//! before anything is sent; a final 4xx is not retried; a budget that runs
//! out says "outcome unknown, retry with key K", never "failed".

mod common;

use common::serve::{IDEM, Serve};
use common::*;
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
