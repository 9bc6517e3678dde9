//! The contract table of DESIGN.md §1, one test per row, on the real
//! `idem_api` binary and a fresh database holding only `account`. Every
//! expectation (balances, rows, bodies) is computed here, not read back from
//! the engine.

use crate::common::*;
use serde_json::{Value, json};
use std::process::Command;

const EP: &str = "/v1/transfers";

/// Picks two distinct accounts and an amount the source can afford.
fn pick(rng: &mut idem::rng::Rng, bank: &Bank) -> (usize, usize, i64) {
    let src = rng.below(bank.accounts.len() as u64) as usize;
    let dst = (src + 1 + rng.below(bank.accounts.len() as u64 - 1) as usize) % bank.accounts.len();
    let amount = 1 + rng.below(bank.balance(src) as u64) as i64;
    (src, dst, amount)
}

#[test]
fn new_key_moves_money_once_and_answers_201_with_the_transfer() {
    for backend in backends() {
        for int_ids in [false, true] {
            let mut rng = rng();
            let n = 2 + rng.below(6) as usize;
            let bank = Bank::on(backend, &mut rng, n, int_ids);
            let before = bank.balances();
            let (src, dst, amount) = pick(&mut rng, &bank);
            let (s, d) = (&bank.accounts[src], &bank.accounts[dst]);
            let r = bank.send(&request("client-a", EP, &key(&mut rng), s, d, amount));

            assert_eq!((r.status(), r.replay(), r.reason()), (201, false, None));
            let body = &r.json["body"];
            assert!(body["transfer_id"].is_i64(), "{body}");
            assert_eq!((&body["src"], &body["dst"], &body["amount"]), (s, d, &json!(amount)));
            assert_eq!(body["currency"], "KRW");
            assert!(idem::clock::Timestamp::parse(body["created_at"].as_str().unwrap()).is_ok());

            let mut want = before.clone();
            want[src] -= amount;
            want[dst] += amount;
            assert_eq!(bank.balances(), want);
            assert_eq!(bank.transfers(), vec![(s.clone(), d.clone(), amount, "KRW".to_string())]);
        }
    }
}

#[test]
fn retry_of_a_completed_key_replays_the_first_body_byte_for_byte() {
    for backend in backends() {
        let mut rng = rng();
        let bank = Bank::on(backend, &mut rng, 4, false);
        let (src, dst, amount) = pick(&mut rng, &bank);
        let (s, d) = (&bank.accounts[src], &bank.accounts[dst]);
        let k = key(&mut rng);
        let first = bank.send(&request("c", EP, &k, s, d, amount));
        let after_first = bank.balances();
        let reordered = format!(
            "{{ \"body\" : {{\"currency\":\"KRW\",\n \"amount\":{amount}, \"dst\":{d},\"src\":{s}}}, \"idem_key\":\"{k}\", \"endpoint\":\"{EP}\",\t\"client_id\":\"c\" }}"
        );
        for text in [request("c", EP, &k, s, d, amount), reordered] {
            let again = bank.send(&text);
            assert_eq!((again.status(), again.replay(), again.reason()), (201, true, None));
            assert_eq!(again.raw_body(), first.raw_body(), "body bytes differ");
            assert_eq!(again.stdout.replace("\"replay\":true", "\"replay\":false"), first.stdout);
        }
        assert_eq!(bank.balances(), after_first, "a replay moved money");
        assert_eq!(bank.transfers().len(), 1);
    }
}

#[test]
fn retry_while_in_progress_gets_409_and_moves_nothing() {
    for backend in backends() {
        let mut rng = rng();
        let bank = Bank::on(backend, &mut rng, 3, false);
        let before = bank.balances();
        let (src, dst, amount) = pick(&mut rng, &bank);
        let text = request("c", EP, &key(&mut rng), &bank.accounts[src], &bank.accounts[dst], amount);

        let crashed = bank.command(&bank.request_file(&text)).arg("--crash-after-claim").output().unwrap();
        assert_ne!(crashed.status.code(), Some(0), "a crash must exit non-zero");
        assert!(crashed.stdout.is_empty(), "a crashed call answers nothing");
        assert_eq!(bank.balances(), before);
        assert!(bank.transfers().is_empty());

        for _ in 0..2 {
            let r = bank.send(&text);
            assert_eq!(
                (r.status(), r.replay(), r.reason(), &r.json["body"]),
                (409, false, Some("in_progress"), &Value::Null)
            );
        }
        assert_eq!(bank.balances(), before);
        assert!(bank.transfers().is_empty());
    }
}

#[test]
fn same_key_with_a_different_body_gets_422_and_is_not_stored() {
    for backend in backends() {
        let mut rng = rng();
        let bank = Bank::on(backend, &mut rng, 3, true);
        let (src, dst, amount) = pick(&mut rng, &bank);
        let (s, d) = (&bank.accounts[src], &bank.accounts[dst]);
        let k = key(&mut rng);
        let first = bank.send(&request("c", EP, &k, s, d, amount));
        let after = bank.balances();
        let changed = [
            request("c", EP, &k, s, d, amount + 1),
            request("c", EP, &k, d, s, amount),
            request("c", EP, &k, s, &bank.accounts[3 - src - dst], amount),
        ];
        for text in changed {
            let r = bank.send(&text);
            assert_eq!(
                (r.status(), r.replay(), r.reason(), &r.json["body"]),
                (422, false, Some("fingerprint_mismatch"), &Value::Null)
            );
        }
        assert_eq!(bank.balances(), after);
        assert_eq!(bank.transfers().len(), 1);
        // the key still holds the first response
        let again = bank.send(&request("c", EP, &k, s, d, amount));
        assert_eq!((again.replay(), again.raw_body()), (true, first.raw_body()));
    }
}

#[test]
fn malformed_requests_get_400_with_a_reason_and_do_not_consume_the_key() {
    for backend in backends() {
        let mut rng = rng();
        let bank = Bank::on(backend, &mut rng, 3, false);
        let before = bank.balances();
        let (src, dst, amount) = pick(&mut rng, &bank);
        let (s, d) = (&bank.accounts[src], &bank.accounts[dst]);
        let k = key(&mut rng);
        let good = request("c", EP, &k, s, d, amount);
        let body = |b: Value| json!({"client_id": "c", "endpoint": EP, "idem_key": k, "body": b}).to_string();
        let cases: Vec<(String, &str)> = vec![
            ("not json".into(), "not valid JSON"),
            ("[1,2]".into(), "request must be a JSON object"),
            (good.replace("\"client_id\":\"c\",", ""), "missing field client_id"),
            (
                good.replace(&format!("\"idem_key\":\"{k}\""), "\"idem_key\":\"\""),
                "idem_key must not be empty",
            ),
            (good.replace(&format!("\"idem_key\":\"{k}\""), "\"idem_key\":42"), "idem_key must be a string"),
            (body(json!({"src": s, "dst": d, "currency": "KRW"})), "missing field body.amount"),
            (
                body(json!({"src": s, "dst": d, "amount": 0, "currency": "KRW"})),
                "amount must be a positive integer",
            ),
            (
                body(json!({"src": s, "dst": d, "amount": -amount, "currency": "KRW"})),
                "amount must be a positive integer",
            ),
            (
                body(json!({"src": s, "dst": d, "amount": amount as f64 + 0.5, "currency": "KRW"})),
                "amount must be a positive integer",
            ),
            (
                body(json!({"src": s, "dst": d, "amount": amount.to_string(), "currency": "KRW"})),
                "amount must be a positive integer",
            ),
            (
                body(json!({"src": s, "dst": s, "amount": amount, "currency": "KRW"})),
                "src and dst must be different",
            ),
            (body(json!({"src": s, "dst": d, "amount": amount, "currency": "USD"})), "unsupported currency"),
            (
                body(json!({"src": s, "dst": d, "amount": amount, "currency": "KRW", "memo": "x"})),
                "unknown field",
            ),
            (
                body(json!({"src": null, "dst": d, "amount": amount, "currency": "KRW"})),
                "body.src must be a string or an integer",
            ),
            (body(json!("transfer")), "body must be a JSON object"),
        ];
        for (text, want) in cases {
            let r = bank.send(&text);
            assert_eq!((r.status(), r.replay(), &r.json["body"]), (400, false, &Value::Null), "{text}");
            let reason = r.reason().unwrap();
            assert!(reason.starts_with("invalid_request: ") && reason.contains(want), "{text}: {reason}");
        }
        assert_eq!(bank.balances(), before);
        let r = bank.send(&good);
        assert_eq!((r.status(), r.replay()), (201, false), "a 400 consumed the key");
    }
}

#[test]
fn unknown_account_and_insufficient_funds_are_stored_and_replayed() {
    for backend in backends() {
        let mut rng = rng();
        let bank = Bank::on(backend, &mut rng, 3, false);
        let before = bank.balances();
        let (src, dst, _) = pick(&mut rng, &bank);
        let (s, d) = (&bank.accounts[src], &bank.accounts[dst]);
        let ghost = json!(format!("ghost-{}", rng.next_u64()));
        let too_much = before[src] + 1 + rng.below(1000) as i64;
        let cases = [
            (request("c", EP, &key(&mut rng), &ghost, d, 10), 404, "unknown_account"),
            (request("c", EP, &key(&mut rng), s, &ghost, 10), 404, "unknown_account"),
            (request("c", EP, &key(&mut rng), s, d, too_much), 402, "insufficient_funds"),
        ];
        for (text, status, reason) in cases {
            let first = bank.send(&text);
            assert_eq!((first.status(), first.replay(), first.reason()), (status, false, Some(reason)));
            let again = bank.send(&text);
            assert_eq!((again.status(), again.replay(), again.reason()), (status, true, Some(reason)));
            assert_eq!(again.raw_body(), first.raw_body());
        }
        assert_eq!(bank.balances(), before);
        assert!(bank.transfers().is_empty());
        // exactly the whole balance is affordable
        let all = bank.send(&request("c", EP, &key(&mut rng), s, d, before[src]));
        assert_eq!(all.status(), 201);
        assert_eq!(bank.balance(src), 0);
    }
}

#[test]
fn keys_are_scoped_by_client_and_endpoint() {
    for backend in backends() {
        let mut rng = rng();
        let bank = Bank::on(backend, &mut rng, 2, false);
        let before = bank.balances();
        let (s, d) = (&bank.accounts[0], &bank.accounts[1]);
        let k = key(&mut rng);
        let mut ids = Vec::new();
        for (client, endpoint) in [("alice", EP), ("bob", EP), ("alice", "/v2/transfers")] {
            let r = bank.send(&request(client, endpoint, &k, s, d, 1));
            assert_eq!((r.status(), r.replay()), (201, false), "{client} {endpoint}");
            ids.push(r.json["body"]["transfer_id"].as_i64().unwrap());
        }
        let distinct: std::collections::BTreeSet<i64> = ids.iter().copied().collect();
        assert_eq!(distinct.len(), 3, "two scopes shared a transfer: {ids:?}");
        // bob's retry gets bob's response, not alice's
        let bob = bank.send(&request("bob", EP, &k, s, d, 1));
        assert_eq!((bob.replay(), bob.json["body"]["transfer_id"].as_i64()), (true, Some(ids[1])));
        // carol's other body on the same key string is her own new key, not a
        // mismatch against alice's fingerprint, and leaves alice's answer alone
        let carol = bank.send(&request("carol", EP, &k, s, d, 2));
        assert_eq!((carol.status(), carol.replay()), (201, false));
        let alice = bank.send(&request("alice", EP, &k, s, d, 1));
        assert_eq!((alice.replay(), alice.json["body"]["transfer_id"].as_i64()), (true, Some(ids[0])));
        assert_eq!(bank.balances(), vec![before[0] - 5, before[1] + 5]);
    }
}

#[test]
fn simultaneous_pair_with_the_same_key_executes_exactly_once() {
    for backend in backends() {
        let mut rng = rng();
        let bank = Bank::on(backend, &mut rng, 2, false);
        let before = bank.balances();
        let (s, d) = (&bank.accounts[0], &bank.accounts[1]);
        for round in 0..20 {
            let file = bank.request_file(&request("c", EP, &key(&mut rng), s, d, 1));
            // both released from one barrier, so the two processes truly overlap
            let finished = idem::harness::race::release_together(
                &[API.into()],
                bank.db.as_os_str(),
                &[file.clone(), file],
                &[],
            );
            let replies: Vec<Reply> = finished.unwrap().into_iter().map(Reply::from_finished).collect();
            let fresh: Vec<&Reply> = replies.iter().filter(|r| r.status() == 201 && !r.replay()).collect();
            assert_eq!(fresh.len(), 1, "round {round}: {replies:?}");
            for other in replies.iter().filter(|r| r.replay() || r.status() != 201) {
                let in_progress = (other.status(), other.reason()) == (409, Some("in_progress"));
                let replayed = other.replay() && other.raw_body() == fresh[0].raw_body();
                assert!(in_progress || replayed, "round {round}: {other:?}");
            }
            assert_eq!(bank.transfers().len(), round + 1);
        }
        assert_eq!(bank.balances(), vec![before[0] - 20, before[1] + 20]);
    }
}

#[test]
fn a_fresh_database_survives_two_first_calls_at_once() {
    for backend in backends() {
        // The very first call creates the schema and switches to WAL; racing
        // first calls must neither fail nor both pay.
        for _ in 0..30 {
            let mut rng = rng();
            let bank = Bank::on(backend, &mut rng, 2, false);
            let file = bank.request_file(&request("c", EP, "k", &bank.accounts[0], &bank.accounts[1], 1));
            let children: Vec<_> = (0..3)
                .map(|_| {
                    bank.command(&file)
                        .stdout(std::process::Stdio::piped())
                        .stderr(std::process::Stdio::piped())
                        .spawn()
                        .unwrap()
                })
                .collect();
            let fresh = children
                .into_iter()
                .map(|c| Reply::from_output(c.wait_with_output().unwrap()))
                .filter(|r| r.status() == 201 && !r.replay())
                .count();
            assert_eq!(fresh, 1);
            assert_eq!(bank.transfers().len(), 1);
        }
    }
}

#[test]
fn purge_deletes_keys_created_before_the_cut_and_only_those() {
    for backend in backends() {
        let mut rng = rng();
        let bank = Bank::on(backend, &mut rng, 2, false);
        let (s, d) = (&bank.accounts[0], &bank.accounts[1]);
        let old = 1 + rng.below(5) as usize;
        let new = 1 + rng.below(5) as usize;
        let mut old_keys = Vec::new();
        for i in 0..old + new {
            let k = key(&mut rng);
            let at = if i < old { "2026-11-01T10:00:00Z" } else { "2026-11-03T10:00:00Z" };
            assert_eq!(bank.send_with(&request("c", EP, &k, s, d, 1), &[("IDEM_NOW", at)]).status(), 201);
            if i < old { old_keys.push(k) } else { old_keys.push(String::new()) }
        }
        let purge = |cut: &str| {
            let out = Command::new(API)
                .args(["--db"])
                .arg(&bank.db)
                .args(["--purge-before", cut])
                .output()
                .unwrap();
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            serde_json::from_slice::<Value>(&out.stdout).unwrap()
        };
        assert_eq!(purge("2026-11-01T09:00:00Z"), json!({"purged": 0}));
        assert_eq!(purge("2026-11-02T19:00:00+09:00"), json!({"purged": old}));
        assert_eq!(purge("2026-11-02T10:00:00Z"), json!({"purged": 0}));
        let transfers = bank.transfers().len();
        let now = [("IDEM_NOW", "2026-11-03T11:00:00Z")];
        for k in old_keys.iter().filter(|k| !k.is_empty()) {
            let r = bank.send_with(&request("c", EP, k, s, d, 1), &now);
            assert_eq!((r.status(), r.replay()), (201, false), "a purged key is new again");
        }
        let k_new = bank.send_with(&request("c", EP, "never-purged", s, d, 1), &now);
        assert_eq!(
            bank.send_with(&request("c", EP, "never-purged", s, d, 1), &now).raw_body(),
            k_new.raw_body()
        );
        assert_eq!(bank.transfers().len(), transfers + old + 1);
    }
}

#[test]
fn unparseable_purge_instant_is_a_usage_error() {
    let mut rng = rng();
    let bank = Bank::new(&mut rng, 2, false);
    let assert = assert_cmd::Command::new(API)
        .arg("--db")
        .arg(&bank.db)
        .args(["--purge-before", "last tuesday"])
        .assert();
    let out = assert.code(2).stdout("").get_output().clone();
    assert!(String::from_utf8_lossy(&out.stderr).contains("RFC 3339"));
}

#[test]
fn unreadable_request_file_exits_3_and_touches_nothing() {
    let mut rng = rng();
    let bank = Bank::new(&mut rng, 2, false);
    let before = std::fs::read(&bank.db).unwrap();
    for path in [bank.dir.path().join("missing.json"), bank.dir.path().to_path_buf()] {
        let assert = assert_cmd::Command::from_std(bank.command(&path)).assert();
        let out = assert.code(3).stdout("").get_output().clone();
        assert!(!String::from_utf8_lossy(&out.stderr).contains("panicked"), "{}", path.display());
    }
    assert_eq!(std::fs::read(&bank.db).unwrap(), before);
}

#[test]
fn bad_command_lines_exit_2() {
    for args in [
        vec![],
        vec!["--db", "x.db"],
        vec!["--request", "r.json"],
        vec!["--db", "x", "--request", "r", "--bogus"],
    ] {
        assert_cmd::Command::new(API).args(&args).assert().code(2).stdout("");
    }
}

#[test]
fn a_credit_that_would_overflow_the_balance_is_a_stored_402() {
    for backend in backends() {
        let bank = Bank::with(backend, &[(json!("A"), 100), (json!("B"), i64::MAX - 5)]);
        let text = request("c", EP, "k", &json!("A"), &json!("B"), 10);
        let first = bank.send(&text);
        assert_eq!((first.status(), first.replay(), first.reason()), (402, false, Some("balance_overflow")));
        let again = bank.send(&text);
        assert_eq!((again.status(), again.replay(), again.reason()), (402, true, Some("balance_overflow")));
        assert_eq!(bank.balances(), vec![100, i64::MAX - 5]);
        assert!(bank.transfers().is_empty());
    }
}

#[test]
fn src_and_dst_naming_one_row_in_two_spellings_is_a_stored_400() {
    for backend in backends() {
        let bank = Bank::with(backend, &[(json!(1), 100), (json!(2), 0)]);
        let text = request("c", EP, "k", &json!(1), &json!("1"), 10);
        let first = bank.send(&text);
        let reason = Some("invalid_request: src and dst must be different accounts");
        assert_eq!((first.status(), first.replay(), first.reason()), (400, false, reason), "{backend:?}");
        // only the ledger could tell, so the answer is stored: the retry replays it
        let again = bank.send(&text);
        assert_eq!((again.status(), again.replay(), again.reason()), (400, true, reason));
        assert_eq!(bank.balances(), vec![100, 0]);
        assert!(bank.transfers().is_empty());
    }
}
