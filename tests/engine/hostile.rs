//! Hostile input: arbitrary bytes and arbitrary JSON as request files never
//! panic, never move money and never consume a key; each documented kind of
//! bad input gets its own 400 reason; no client can reach another's key.

use crate::common::*;
use idem::policy::Policy;
use idem::request;
use proptest::prelude::*;
use serde_json::{Value, json};

fn arb_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_filter("finite", |f| f.is_finite()).prop_map(Value::from),
        ".{0,12}".prop_map(Value::from),
    ];
    leaf.prop_recursive(4, 32, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::from),
            prop::collection::btree_map("[a-z_]{1,9}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

const FIELDS: [&str; 8] = ["client_id", "endpoint", "idem_key", "body", "src", "dst", "amount", "currency"];

const GOOD: &str = r#"{"client_id":"c","endpoint":"/t","idem_key":"k","body":{"src":"A","dst":"B","amount":5,"currency":"KRW"}}"#;

/// A valid request with a few bytes overwritten, inserted or deleted, most
/// of them bytes that mean something to JSON: nearly-valid input, where a
/// parser's edge cases live (arbitrary bytes are rarely JSON at all).
fn mutated_request() -> impl Strategy<Value = Vec<u8>> {
    let byte = prop_oneof![any::<u8>(), prop::sample::select(b"{}[]\",:\\0123456789.-+eE \t\n".to_vec())];
    prop::collection::vec((any::<prop::sample::Index>(), 0..3u8, byte), 1..6).prop_map(|edits| {
        let mut bytes = GOOD.as_bytes().to_vec();
        for (at, edit, byte) in edits {
            let i = at.index(bytes.len() + 1);
            match edit {
                0 if i < bytes.len() => bytes[i] = byte,
                1 => bytes.insert(i, byte),
                _ if i < bytes.len() => drop(bytes.remove(i)),
                _ => {}
            }
        }
        bytes
    })
}

proptest! {
    #[test]
    fn mutated_requests_never_panic_and_every_refusal_names_its_reason(bytes in mutated_request()) {
        match request::parse(&bytes, Policy::embedded()) {
            Err(e) => prop_assert!(e.to_string().starts_with("invalid_request: ")),
            // what still parses is a request the rules accept
            Ok(r) => prop_assert!(r.transfer.amount >= 1 && r.transfer.src != r.transfer.dst && r.transfer.currency == "KRW"),
        }
    }

    /// A valid request with one field (top level or body) replaced by any JSON
    /// value: accepted only if that value is itself valid for the field.
    #[test]
    fn any_value_in_any_field_is_validated(field in 0..FIELDS.len(), value in arb_json()) {
        let mut req = json!({"client_id": "c", "endpoint": "/t", "idem_key": "k",
                             "body": {"src": "A", "dst": "B", "amount": 5, "currency": "KRW"}});
        let name = FIELDS[field];
        if field < 4 { req[name] = value.clone() } else { req["body"][name] = value.clone() }
        match request::parse(req.to_string().as_bytes(), Policy::embedded()) {
            Ok(r) => {
                let ok = match name {
                    "client_id" | "endpoint" | "idem_key" => value.as_str().is_some_and(|s| !s.is_empty() && s.chars().count() <= 255),
                    "amount" => value.as_i64().is_some_and(|a| a >= 1 && a <= Policy::embedded().max_amount) && r.transfer.amount == value.as_i64().unwrap(),
                    "currency" => value == json!("KRW"),
                    "src" | "dst" => value.is_i64() || value.as_str().is_some_and(|s| !s.is_empty() && s != if name == "src" { "B" } else { "A" }),
                    _ => value.is_object(),
                };
                prop_assert!(ok, "accepted {} = {}", name, value);
            }
            Err(e) => prop_assert!(e.to_string().starts_with("invalid_request: ")),
        }
    }
}

#[test]
fn each_hostile_file_gets_a_specific_400_and_the_database_is_untouched() {
    let mut rng = rng();
    let bank = Bank::new(&mut rng, 2, false);
    let before = std::fs::read(&bank.db).unwrap();
    let (s, d) = (&bank.accounts[0], &bank.accounts[1]);
    let good = request("c", "/t", "k", s, d, 5);
    let with_amount = |a: &str| good.replace("\"amount\":5", &format!("\"amount\":{a}"));
    let max = Policy::embedded().max_request_bytes;
    let too_large = format!("larger than {max} bytes");
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (b"\xff\xfe{\"client_id\":1}".to_vec(), "not valid UTF-8"),
        (format!("{good}{}", " ".repeat(max)).into_bytes(), too_large.as_str()),
        (vec![b'x'; 5 * max], "larger than"),
        (format!("{}{}", "[".repeat(20_000), "]".repeat(20_000)).into_bytes(), "recursion limit"),
        (
            format!(
                r#"{{"client_id":"c","endpoint":"/t","idem_key":"k","body":{}1{}}}"#,
                "{\"a\":".repeat(200),
                "}".repeat(200)
            )
            .into_bytes(),
            "recursion limit",
        ),
        (with_amount("9223372036854775808").into_bytes(), "amount must be a positive integer"),
        (with_amount("99999999999999999999999").into_bytes(), "amount must be a positive integer"),
        (with_amount("-1").into_bytes(), "amount must be a positive integer"),
        (with_amount("1.0").into_bytes(), "amount must be a positive integer"),
        (with_amount("1e3").into_bytes(), "amount must be a positive integer"),
        (with_amount("\"100\"").into_bytes(), "amount must be a positive integer"),
        (with_amount("1e400").into_bytes(), "not valid JSON"),
        (with_amount("NaN").into_bytes(), "not valid JSON"),
        (good.replace("\"k\"", "\"\"").into_bytes(), "idem_key must not be empty"),
        (
            good.replace("\"k\"", &format!("\"{}\"", "키".repeat(256))).into_bytes(),
            "idem_key must be at most 255 characters",
        ),
        (
            good.replace("\"amount\":5", "\"amount\":1,\"amount\":100").into_bytes(),
            "duplicate member \"amount\"",
        ),
        (
            good.replace("\"client_id\":\"c\"", "\"client_id\":\"c\",\"client_id\":\"d\"").into_bytes(),
            "duplicate member \"client_id\"",
        ),
        (good.replace("\"k\"", "\"\\ud800\"").into_bytes(), "not valid JSON"),
        (format!("\u{feff}{good}").into_bytes(), "not valid JSON"),
        (Vec::new(), "not valid JSON"),
        (b"null".to_vec(), "request must be a JSON object"),
    ];
    for (bytes, want) in &cases {
        let mut cmd = bank.command(&bank.dir.path().join("hostile.json"));
        std::fs::write(bank.dir.path().join("hostile.json"), bytes).unwrap();
        let r = Reply::from_output(cmd.output().unwrap());
        assert_eq!((r.status(), r.replay(), &r.json["body"]), (400, false, &Value::Null), "{want}");
        assert!(r.reason().unwrap().contains(want), "want {want:?}, got {:?}", r.reason());
    }
    assert_eq!(std::fs::read(&bank.db).unwrap(), before, "a refused request wrote to the database");
    // a 255-character key (multi-byte) is fine, and the key was never consumed by the refusals
    let ok = bank.send(&good.replace("\"k\"", &format!("\"{}\"", "키".repeat(255))));
    assert_eq!(ok.status(), 201);
    assert_eq!(bank.send(&good).status(), 201);
}

#[test]
fn sql_in_ids_is_data_and_no_client_reaches_another_clients_key() {
    let mut rng = rng();
    let bank = Bank::new(&mut rng, 2, false);
    let before = bank.balances();
    let (s, d) = (&bank.accounts[0], &bank.accounts[1]);
    let evil = "x'); DELETE FROM account; DROP TABLE idem_key; --";
    let alice = bank.send(&request("alice", "/t", evil, s, d, 3));
    assert_eq!(alice.status(), 201);
    let ghost = json!(format!("{evil}' OR '1'='1"));
    assert_eq!(bank.send(&request(evil, "/t", "k", s, &ghost, 3)).reason(), Some("unknown_account"));
    // mallory tries alice's key with other scope strings: a new key each time, never alice's answer
    for (client, endpoint) in [("mallory", "/t"), ("alice ", "/t"), ("alice", "/t "), ("ALICE", "/t")] {
        let r = bank.send(&request(client, endpoint, evil, s, d, 4));
        assert_eq!((r.status(), r.replay()), (201, false), "{client:?} {endpoint:?}");
        assert_ne!(r.raw_body(), alice.raw_body());
    }
    // a control character is no scope at all: 400, nothing stored
    let nul = bank.send(&request("alice\u{0}", "/t", evil, s, d, 4));
    assert_eq!(nul.status(), 400);
    assert_eq!(nul.reason(), Some("invalid_request: client_id must not contain control characters"));
    let again = bank.send(&request("alice", "/t", evil, s, d, 3));
    assert_eq!((again.replay(), again.raw_body()), (true, alice.raw_body()));
    assert_eq!(bank.balances(), vec![before[0] - 19, before[1] + 19]);
    assert_eq!(bank.transfers().len(), 5);
}

#[test]
fn control_characters_in_any_field_are_a_400_on_every_store_and_store_nothing() {
    for backend in backends() {
        let mut rng = rng();
        let bank = Bank::on(backend, &mut rng, 2, false);
        let before = bank.balances();
        let (s, d) = (&bank.accounts[0], &bank.accounts[1]);
        let nul = json!("acct\u{0}");
        let requests = [
            request("c\u{0}", "/t", "k", s, d, 3),
            request("c", "/t\u{0}", "k", s, d, 3),
            request("c", "/t", "k\u{0}", s, d, 3),
            request("c", "/t", "k\n", s, d, 3),
            request("c", "/t", "k", s, &nul, 3),
        ];
        for text in requests {
            let r = bank.send(&text);
            assert_eq!(r.status(), 400, "{backend:?}: {text}");
            assert!(
                r.reason().unwrap().ends_with("must not contain control characters"),
                "{backend:?}: {r:?}"
            );
        }
        assert_eq!(bank.balances(), before, "{backend:?}");
        // the key of the last one was not consumed
        let r = bank.send(&request("c", "/t", "k", s, d, 3));
        assert_eq!((r.status(), r.replay()), (201, false), "{backend:?}");
    }
}
