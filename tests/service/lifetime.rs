//! The key's lifetime, published and kept: `openapi.json` says how long a
//! key is kept, and a request first sent longer ago than that
//! (`Repeatability-First-Sent`, OASIS Repeatable Requests) is refused 412
//! and never run again, where without the header it would be paid a
//! second time as a new request.

use crate::common::*;
use crate::server::{Serve, body, openapi};

const SHOP: (&str, &str) = ("tok-shop-7f3a", "shop-1");
const TOKEN: Option<&str> = Some(SHOP.0);

fn http_date(ago: time::Duration) -> String {
    idem::clock::to_http_date(time::OffsetDateTime::now_utc() - ago)
}

#[test]
fn a_request_first_sent_past_retention_is_412_and_runs_nothing_and_the_lifetime_is_published() {
    // published: the retention the service keeps, and the margin, on each idempotent operation
    let retention = idem::policy::Policy::embedded().retention_seconds();
    for path in ["/v1/transfers", "/v1/payouts"] {
        let lifetime = &openapi()["paths"][path]["post"]["x-idempotency-key-lifetime"];
        assert_eq!(lifetime["retention_seconds"].as_i64(), Some(retention), "{path}");
        assert_eq!(
            lifetime["first_sent_margin_seconds"].as_i64(),
            Some(idem::request::FIRST_SENT_MARGIN_SECONDS)
        );
    }
    for backend in backends() {
        let mut rng = rng();
        let bank = Bank::on(backend, &mut rng, 2, false);
        let before = bank.balances();
        let (s, d) = (&bank.accounts[0], &bank.accounts[1]);
        let serve = Serve::start(&bank.db, &[SHOP], &[], &[]);
        let first_sent = |ago| [("Repeatability-First-Sent", http_date(ago))];
        let send = |key: &str, ago: time::Duration| {
            let sent = first_sent(ago);
            serve.post_with(TOKEN, Some(key), &[(sent[0].0, &sent[0].1)], &body(s, d, 40))
        };
        // five days ago, under a key the service no longer has: refused, nothing moves
        let old = send("\"k-old\"", time::Duration::days(5));
        assert_eq!(
            (old.status, old.reason().as_deref()),
            (412, Some("first_sent_too_long_ago")),
            "{backend:?}: {}",
            old.body
        );
        // just inside the retention less its margin: still run
        let near = send(
            "\"k-near\"",
            time::Duration::seconds(retention - idem::request::FIRST_SENT_MARGIN_SECONDS - 60),
        );
        assert_eq!(near.status, 201, "{backend:?}: {}", near.body);
        // an hour ago: run once, its retry (the same date) replayed
        let fresh = send("\"k-1\"", time::Duration::hours(1));
        let again = send("\"k-1\"", time::Duration::hours(1));
        assert_eq!(
            (fresh.status, again.status, again.header("idempotent-replayed")),
            (201, 201, Some("true"))
        );
        // not a date, or sent twice: 400, nothing run
        for bad in [
            &[("Repeatability-First-Sent", "yesterday")][..],
            &[
                ("Repeatability-First-Sent", "Sun, 06 Nov 1994 08:49:37 GMT"),
                ("Repeatability-First-Sent", "Sun, 06 Nov 1994 08:49:37 GMT"),
            ],
        ] {
            let h = serve.post_with(TOKEN, Some("\"k-bad\""), bad, &body(s, d, 40));
            assert_eq!(
                (h.status, h.reason().as_deref()),
                (400, Some("invalid_first_sent")),
                "{backend:?}: {}",
                h.body
            );
        }
        assert_eq!(
            bank.balances(),
            vec![before[0] - 80, before[1] + 80],
            "{backend:?}: near and k-1, each once"
        );
        assert_eq!(bank.transfers().len(), 2);
    }
}

/// A 64-bit integer key, as a browser that adds keys itself sends one
/// (Firefox 135+: "a unique 64-bit key"), bare or as an sf-string: one key,
/// taken like any other; a negative one and the largest are keys too.
#[test]
fn a_64_bit_integer_key_bare_or_quoted_is_one_key() {
    let mut rng = rng();
    let bank = Bank::on(Backend::Sqlite, &mut rng, 2, false);
    let (s, d) = (&bank.accounts[0], &bank.accounts[1]);
    let serve = Serve::start(&bank.db, &[SHOP], &[], &[]);
    for (n, key) in ["9223372036854775807", "-42", "1733562000123456789"].into_iter().enumerate() {
        let amount = 10 + i64::try_from(n).unwrap();
        let bare = serve.post(TOKEN, Some(key), &body(s, d, amount));
        let quoted = serve.post(TOKEN, Some(&format!("\"{key}\"")), &body(s, d, amount));
        assert_eq!((bare.status, quoted.status), (201, 201), "{key}: {} {}", bare.body, quoted.body);
        assert_eq!(
            (quoted.header("idempotent-replayed"), quoted.body == bare.body),
            (Some("true"), true),
            "{key}"
        );
    }
    assert_eq!(bank.transfers().len(), 3);
}
