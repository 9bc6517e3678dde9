//! `idem check --url`: an HTTP service, judged by
//! draft-ietf-httpapi-idempotency-key-header, with what the draft leaves
//! open read from a [`Profile`] (left open there, every choice passes).
//!
//! The check speaks HTTP/1.1 itself, one request per connection, so that it
//! controls every byte: it sends two `Authorization` headers or a key in
//! both spellings, releases racing requests by their last byte at one
//! instant (the window is open whatever the service's speed), and reads an
//! answer as HTTP says (a chunked body is decoded, not compared raw).

pub use super::http::{Profile, Target};

use super::CheckError;
use super::bodies::{others, respaced};
use super::http::{Http, exchange, parse_answer, transfer_body};
use super::races::{attach, release, retry_after};
use super::{Property, Trace, short};
use crate::outside::proxy::{Odds, Proxy};
use serde_json::{Value, json};
use std::net::SocketAddr;

fn created(target: &Target, t: &mut Trace, h: &Http) -> bool {
    t.expect(target.made(h) && !target.replayed(h), || {
        format!("wanted {}, not marked as a replay", target.made_status())
    })
}

fn new_key(target: &Target, t: &mut Trace) -> Result<(), CheckError> {
    let k = target.key(1);
    let first = target.post(t, Some(&target.tokens[0]), Some(&k), &target.transfer(3))?;
    created(target, t, &first);
    Ok(())
}

fn replay(target: &Target, t: &mut Trace, reorder: bool) -> Result<(), CheckError> {
    let k = target.key(2 + u64::from(reorder));
    let token = Some(target.tokens[0].as_str());
    let amount = 4;
    let first = target.post(t, token, Some(&k), &target.transfer(amount))?;
    created(target, t, &first);
    // other money moves in between: a body rebuilt from the ledger differs
    target.post(t, token, Some(&format!("{k}-other")), &target.transfer(1))?;
    let body = match reorder {
        false => target.transfer(amount),
        true => respaced(&target.transfer(amount)),
    };
    let again = target.post(t, token, Some(&k), &body)?;
    t.expect(again.status == first.status && again.body == first.body, || {
        "the retry's answer differs from the first".into()
    });
    t.expect(target.profile.replay_header.is_none() || target.replayed(&again), || {
        "the replay is not marked".into()
    });
    Ok(())
}

fn mismatch(target: &Target, t: &mut Trace) -> Result<(), CheckError> {
    let k = target.key(4);
    let token = Some(target.tokens[0].as_str());
    let first = target.transfer(5);
    let answer = target.post(t, token, Some(&k), &first)?;
    let want = target.profile.mismatch_status;
    // the amount one more: a body the service takes, so the key alone refuses it
    let more = target.transfer(6);
    let other = target.post(t, token, Some(&k), &more)?;
    t.expect(other.status == want, || format!("another amount: wanted {want}"));
    // Every other leaf in turn, and the accounts swapped: a body the service
    // may also refuse as malformed (a currency it does not take), but never
    // one answered with the first's replay nor made.
    for (what, body) in others(target, &first).into_iter().filter(|(_, body)| *body != more) {
        let other = target.post(t, token, Some(&k), &body)?;
        let refused = (400..500).contains(&other.status) && !target.replays(&other, &answer);
        t.expect(refused, || {
            format!("{what} changed: answered {} as the same request (wanted {want}, or a 4xx)", other.status)
        });
    }
    Ok(())
}

/// A request first sent 30 days ago (past any key's retention) under a new
/// key: 412, and nothing done (the key, sent again as a request first sent
/// now, makes a transfer then, not a replay); a malformed date: 400.
fn first_sent(target: &Target, t: &mut Trace) -> Result<(), CheckError> {
    if !target.profile.first_sent {
        t.skip("the profile does not declare Repeatability-First-Sent (first_sent)");
        return Ok(());
    }
    let k = target.key(17);
    let auth = ("Authorization", format!("Bearer {}", target.tokens[0]));
    let idem = ("Idempotency-Key", target.key_header(&k));
    let long_ago = crate::clock::to_http_date(time::OffsetDateTime::now_utc() - time::Duration::days(30));
    let old = target.send(
        t,
        &[auth.clone(), idem.clone(), ("Repeatability-First-Sent", long_ago)],
        &target.transfer(9),
    )?;
    t.expect(old.status == 412, || format!("first sent 30 days ago: wanted 412, got {}", old.short()));
    let bad = target.send(
        t,
        &[auth.clone(), idem.clone(), ("Repeatability-First-Sent", "yesterday".into())],
        &target.transfer(9),
    )?;
    t.expect(bad.status == 400, || {
        format!("a first-sent date that is no HTTP-date: wanted 400, got {}", bad.short())
    });
    let now = crate::clock::to_http_date(time::OffsetDateTime::now_utc());
    let fresh = target.send(t, &[auth, idem, ("Repeatability-First-Sent", now)], &target.transfer(9))?;
    t.expect(target.made(&fresh) && !target.replayed(&fresh), || {
        format!(
            "the key, first sent now: wanted a transfer made, not a replay (was the refused one run?): {}",
            fresh.short()
        )
    });
    Ok(())
}

fn missing_key(target: &Target, t: &mut Trace) -> Result<(), CheckError> {
    let r = target.post(t, Some(&target.tokens[0]), None, &target.transfer(7))?;
    let want = target.profile.missing_key_status;
    t.expect(r.status == want, || format!("wanted {want}: a transfer without a key must not be processed"));
    Ok(())
}

fn key_forms(target: &Target, t: &mut Trace) -> Result<(), CheckError> {
    let both = target.profile.both_key_forms;
    if both == Some(false) {
        t.skip("the profile says the service takes one spelling of a key");
        return Ok(());
    }
    let k = target.key(5);
    let auth = ("Authorization", format!("Bearer {}", target.tokens[0]));
    let first =
        target.send(t, &[auth.clone(), ("Idempotency-Key", format!("\"{k}\""))], &target.transfer(8))?;
    created(target, t, &first);
    let bare = target.send(t, &[auth, ("Idempotency-Key", k)], &target.transfer(8))?;
    // a bare key is no sf-string: refusing it is the draft's, a second transfer is not
    let refused = both.is_none() && (400..500).contains(&bare.status);
    t.expect(target.replays(&bare, &first) || refused, || {
        "the key as an sf-string and bare are two keys".into()
    });
    Ok(())
}

fn scoped(target: &Target, t: &mut Trace) -> Result<(), CheckError> {
    let (distinct, same) = target.clients();
    let Some((a, b)) = distinct else {
        t.skip("give two --token of distinct clients to check the scope");
        return Ok(());
    };
    if target.profile.clients.is_none() {
        t.step("(no clients map in the profile: the tokens are taken for distinct clients)");
    }
    let k = target.key(6);
    let one = target.post(t, Some(a), Some(&k), &target.transfer(9))?;
    let two = target.post(t, Some(b), Some(&k), &target.transfer(10))?;
    if matches!(two.status, 403 | 404) && !target.replayed(&two) {
        // the accounts are the first client's: a service may hide another
        // client's resource; that refusal is the second client's own answer
        t.step(format!("the second client was refused the first's accounts ({})", two.status));
    } else {
        created(target, t, &two);
    }
    t.expect(two.body != one.body, || "two clients got one answer".into());
    if let Some((c, d)) = same {
        let k = target.key(7);
        let first = target.post(t, Some(c), Some(&k), &target.transfer(11))?;
        let again = target.post(t, Some(d), Some(&k), &target.transfer(11))?;
        t.expect(target.replays(&again, &first), || "two tokens of one client are two scopes".into());
    }
    Ok(())
}

/// Sixteen requests on one key, released by their last byte at one instant.
fn race(target: &Target, t: &mut Trace) -> Result<(), CheckError> {
    let p = &target.profile;
    let answers = release(target, &target.key(8), 12, &[])?;
    let created: Vec<&Http> = answers.iter().filter(|a| target.made(a)).collect();
    let fresh = created.iter().filter(|a| !target.replayed(a)).count();
    t.step(format!(
        "16 requests on one key, released at once -> statuses {:?}, {fresh} unmarked",
        answers.iter().map(|a| a.status).collect::<Vec<_>>()
    ));
    t.expect(!created.is_empty(), || format!("nobody was answered {}", target.made_status()));
    t.expect(created.iter().all(|a| a.body == created[0].body), || {
        "the answers name more than one transfer".into()
    });
    t.expect(answers.iter().all(|a| target.made(a) || a.status == p.in_flight_status), || {
        "an answer was neither the transfer nor in flight".into()
    });
    t.expect(p.replay_header.is_none() || fresh == 1, || format!("{fresh} answers claim to be the first"));
    Ok(())
}

/// Through a proxy that drops every answer: the service commits, the client
/// hears nothing; then the retry, directly.
fn lost_answer(target: &Target, t: &mut Trace) -> Result<(), CheckError> {
    let k = target.key(9);
    let no_answers = Odds { drop_request: 0, drop_response: 100, cut_response: 0, delay: 0, duplicate: 0 };
    let proxy =
        Proxy::start(target.address, target.seed, no_answers).map_err(CheckError::io("starting a proxy"))?;
    let via: SocketAddr = proxy.url().trim_start_matches("http://").parse().map_err(|_| "proxy address")?;
    let request = target.post_bytes(
        &[
            ("Authorization", format!("Bearer {}", target.tokens[0])),
            ("Idempotency-Key", target.key_header(&k)),
        ],
        &target.transfer(13),
    );
    let lost = exchange(via, &request);
    let dropped = proxy.counts.dropped.lock().unwrap_or_else(|e| e.into_inner()).pop().unwrap_or_default();
    let sent = parse_answer(&dropped).unwrap_or_default();
    t.step(format!(
        "POST key={k} through a proxy that drops the answer -> {}; the service had answered {}",
        lost.as_ref().map_or_else(|e| format!("no answer ({e})"), Http::short),
        sent.short()
    ));
    // a request never made has nothing to replay: no verdict on a 404 twice
    t.expect(target.made(&sent), || {
        format!("the request was not made ({}): nothing to replay", sent.short())
    });
    let retry = target.post(t, Some(&target.tokens[0]), Some(&k), &target.transfer(13))?;
    t.expect(retry.status == sent.status && retry.body == sent.body, || {
        "the retry was made again, not replayed: the transfer went out twice".into()
    });
    t.expect(target.profile.replay_header.is_none() || target.replayed(&retry), || {
        "the replay is not marked".into()
    });
    Ok(())
}

fn invalid_keeps_key(target: &Target, t: &mut Trace) -> Result<(), CheckError> {
    let k = target.key(10);
    let token = Some(target.tokens[0].as_str());
    let bad = match (&target.profile.invalid_body, &target.profile.body) {
        (Some(bad), _) => bad.to_string(),
        (None, None) => transfer_body(&target.src, &target.dst, 0),
        (None, Some(_)) => {
            t.skip("the profile's body is its own: give its invalid_body, a body the service refuses");
            return Ok(());
        }
    };
    let refused = target.post(t, token, Some(&k), &bad)?;
    let want = target.profile.invalid_status;
    let ok = want.map_or((400..500).contains(&refused.status), |w| refused.status == w);
    t.expect(ok, || format!("a malformed body: wanted {}", want.map_or("a 4xx".into(), |w| w.to_string())));
    let good = target.post(t, token, Some(&k), &target.transfer(14))?;
    t.expect(target.made(&good) && !target.replayed(&good), || "the refused request consumed its key".into());
    Ok(())
}

fn refusal_stored(target: &Target, t: &mut Trace) -> Result<(), CheckError> {
    if !target.money() {
        t.skip("the profile's body names no {src} and {dst}: no unknown account to be refused");
        return Ok(());
    }
    let k = target.key(11);
    let token = Some(target.tokens[0].as_str());
    let ghost = target.body(&format!("ghost-{k}").into(), &target.dst, 1);
    let first = target.post(t, token, Some(&k), &ghost)?;
    let p = &target.profile;
    // a fresh key: no 4xx there can mean "in flight" or "another body"
    let ok = p.unknown_account_status.map_or((400..500).contains(&first.status), |w| first.status == w);
    t.expect(ok, || "an unknown account: wanted a 4xx refusal".into());
    let between = target.post(t, token, Some(&format!("{k}-other")), &target.transfer(1))?;
    t.expect(target.made(&between), || "a transfer from the funded account was not made".into());
    let again = target.post(t, token, Some(&k), &ghost)?;
    // stored: replayed; not stored: the same refusal, evaluated again
    let stored = target.replays(&again, &first);
    let evaluated = again.status == first.status && !target.replayed(&again);
    super::expect_refused_again(t, p.refusals_stored, stored, evaluated, "an unknown account");
    Ok(())
}

fn auth_first(target: &Target, t: &mut Trace) -> Result<(), CheckError> {
    let want = target.profile.unauthorized_status;
    let refused = |h: &Http| want.map_or(h.status == 401 || h.status == 403, |w| h.status == w);
    let want = want.map_or("401 or 403".into(), |w| w.to_string());
    let nobody = ("Authorization", "Bearer not-a-token-of-anyone".to_owned());
    let r = target.send(t, &[nobody.clone(), ("Idempotency-Key", "\"\"".into())], "{")?;
    t.expect(refused(&r), || format!("a bad token with a bad key and body: wanted {want} before any 400"));
    let k = target.key(12);
    let r = target.send(t, &[nobody, ("Idempotency-Key", target.key_header(&k))], &target.transfer(15))?;
    t.expect(refused(&r), || format!("a bad token with a valid key: wanted {want}"));
    let r = target.send(t, &[], &target.transfer(15))?;
    t.expect(refused(&r), || format!("no token and no key: wanted {want} before the missing key's 400"));
    let good = target.post(t, Some(&target.tokens[0]), Some(&k), &target.transfer(16))?;
    t.expect(target.made(&good) && !target.replayed(&good), || {
        "a request refused for its token consumed or read its key".into()
    });
    let twice = target.send(
        t,
        &[
            ("Authorization", format!("Bearer {}", target.tokens[0])),
            ("Authorization", format!("Bearer {}", target.tokens.last().cloned().unwrap_or_default())),
            ("Idempotency-Key", target.key_header(&target.key(13))),
        ],
        &target.transfer(17),
    )?;
    t.expect(refused(&twice), || format!("two Authorization headers: wanted {want}"));
    Ok(())
}

fn get_across_clients(target: &Target, t: &mut Trace) -> Result<(), CheckError> {
    let (Some(path), (Some((a, b)), _)) = (&target.profile.get_path, target.clients()) else {
        t.skip("needs the profile's get_path and two --token of distinct clients");
        return Ok(());
    };
    let k = target.key(14);
    let made = target.post(t, Some(a), Some(&k), &target.transfer(18))?;
    let Some(id) = target.created_id(&made) else {
        t.skip(format!(
            "the created answer has no id at the profile's id_pointer {}",
            target.profile.id_pointer
        ));
        return Ok(());
    };
    let path = path.replace("{id}", &id);
    let own = target.get(t, &path, a)?;
    t.expect(own.status == 200, || "the owner cannot read its transfer".into());
    let other = target.get(t, &path, b)?;
    let shown = target.created_id(&other).is_some_and(|shown| shown == id);
    t.expect((400..500).contains(&other.status) && !shown, || "another client read the transfer".into());
    Ok(())
}

/// Error answers the other properties provoke, each checked as RFC 9457
/// asks, and for what a body must never show.
fn error_bodies(target: &Target, t: &mut Trace) -> Result<(), CheckError> {
    let token = Some(target.tokens[0].as_str());
    let k = target.key(15);
    let mut errors = vec![
        target.post(t, token, None, &target.transfer(1))?,
        target.post(t, None, Some(&k), &target.transfer(1))?,
        target.post(t, token, Some(&format!("{k}-a")), "{\"src\": ")?,
        target.post(t, token, Some(&format!("{k}-b")), "[1, 2, 3]")?,
        target.post(
            t,
            token,
            Some(&format!("{k}-c")),
            &json!({"src": target.src, "dst": target.dst, "amount": "1e999", "currency": "KRW"}).to_string(),
        )?,
        target.post(
            t,
            token,
            Some(&format!("{k}-d")),
            &json!({"src": [target.src], "dst": {"x": 1}, "amount": 1, "currency": "KRW"}).to_string(),
        )?,
    ];
    errors.retain(|h| h.status >= 400);
    for h in &errors {
        let shown = std::iter::once(h.body.as_str()).chain(h.headers.iter().map(|(_, v)| v.as_str()));
        if let Some(leak) = shown.filter_map(super::leak::leak).next() {
            t.expect(false, || {
                format!("an error answer shows the service's internals ({leak:?}): {}", short(&h.body))
            });
        }
        if target.profile.problem_json {
            let p = h.json();
            let ok = h.header("content-type").is_some_and(|c| c.starts_with("application/problem+json"))
                && p.get("status").and_then(Value::as_u64) == Some(u64::from(h.status));
            t.expect(ok, || format!("a {} is not application/problem+json with its status", h.status));
        }
    }
    Ok(())
}

/// Twice as many transfers as the drain account can pay, all at once, each
/// with its own key: exactly half may succeed.
fn no_lost_update(target: &Target, t: &mut Trace) -> Result<(), CheckError> {
    let Some(drain) = target.profile.drain.as_ref().filter(|_| target.money()) else {
        t.skip("needs the profile's drain (an account of known balance that nothing else uses), and a body that names {src} and {dst}");
        return Ok(());
    };
    const PAY: i64 = 8;
    let amount = drain.balance / PAY;
    if amount < 1 {
        return Err(format!("the drain account's balance must be at least {PAY}").into());
    }
    let body = target.body(&drain.src, &drain.dst, amount);
    let k = target.key(16);
    let requests: Vec<Vec<u8>> = (0..2 * PAY)
        .map(|i| {
            target.post_bytes(
                &[
                    ("Authorization", format!("Bearer {}", target.tokens[0])),
                    ("Idempotency-Key", target.key_header(&format!("{k}-{i}"))),
                ],
                &body,
            )
        })
        .collect();
    let barrier = std::sync::Barrier::new(requests.len());
    let answers: Vec<Result<Http, CheckError>> = std::thread::scope(|scope| {
        let runs: Vec<_> = requests
            .iter()
            .map(|r| {
                let barrier = &barrier;
                scope.spawn(move || {
                    barrier.wait();
                    exchange(target.address, r)
                })
            })
            .collect();
        runs.into_iter().map(|r| r.join().unwrap_or_else(|_| Err("a thread panicked".into()))).collect()
    });
    let answers: Vec<Http> = answers.into_iter().collect::<Result<_, _>>()?;
    let paid = answers.iter().filter(|a| target.made(a)).count() as i64;
    t.step(format!(
        "{} transfers of {amount} at once from an account holding {} -> {paid} paid",
        2 * PAY,
        drain.balance
    ));
    t.expect(paid >= 1, || {
        format!("none of {} transfers the drain could pay was made (is it spent? give a fresh one)", 2 * PAY)
    });
    if paid >= 1 {
        // what was paid goes back, so that the drain serves the next run too
        let back = target.body(&drain.dst, &drain.src, paid * amount);
        let returned = target.post(t, Some(&target.tokens[0]), Some(&format!("{k}-back")), &back)?;
        t.expect(target.made(&returned), || "what the drain paid could not be sent back".into());
    }
    t.expect(paid <= PAY, || {
        format!("{paid} transfers of {amount} were paid from {}: updates were lost", drain.balance)
    });
    Ok(())
}

macro_rules! property {
    ($name:expr, $contract:expr, $judge:expr) => {
        Property { name: $name, contract: $contract, judge: $judge }
    };
}

/// The properties an HTTP implementation must have, each with its sentence.
pub static PROPERTIES: [Property<Target>; 21] = [
    property!(
        "a new key is created",
        "draft §2: the first request with a key is processed as usual (any 2xx; profile created_status)",
        new_key
    ),
    property!(
        "a retry replays the first answer byte for byte (marked, if the profile names a replay header), even after other money moved",
        "draft §2.6: a retry of a completed request returns the stored response (the draft names no replay header: profile replay_header declares one)",
        |t, tr| replay(t, tr, false)
    ),
    property!(
        "a retry with members reordered and re-spaced replays",
        "draft §2.4: the fingerprint is of the request payload, not its bytes (DESIGN §2: RFC 8785)",
        |t, tr| replay(t, tr, true)
    ),
    property!(
        "the same key with another body is refused (mismatch status)",
        "draft §2.7: reusing a key with a different payload SHOULD be 422 (profile mismatch_status)",
        mismatch
    ),
    property!(
        "a request without a key is refused",
        "draft §2.7: a missing Idempotency-Key on an endpoint that requires one SHOULD be 400 (profile missing_key_status)",
        missing_key
    ),
    property!(
        "the key's sf-string and bare spellings are one key, or the bare one is refused",
        "draft §2.1: the key is an sf-string; a bare value either is the same key or is refused, never a second transfer (profile both_key_forms)",
        key_forms
    ),
    property!(
        "keys are scoped by client: distinct clients own distinct keys, one client's tokens share them",
        "draft §2.2: keys are unique per client (DESIGN §2: the client comes from the token's owner)",
        scoped
    ),
    property!(
        "requests on one key released at one instant: one transfer, the others in flight or its replay",
        "draft §2.7: a request while the first is in flight SHOULD be 409 (profile in_flight_status)",
        race
    ),
    property!(
        "an in-flight answer carries Retry-After, if the profile declares it, on 409s provoked on purpose",
        "draft §2.7: a request while the first is in flight SHOULD be 409; Retry-After (RFC 9110 §10.2.3) is judged only if the profile declares in_flight_retry_after, on in-flight answers the check provokes in up to 8 races",
        retry_after
    ),
    property!(
        "a retry that prefers to wait gets the original's answer, not in-flight, if the profile declares it",
        "RFC 7240 Prefer: wait=N: sixteen requests on one key, each with Prefer: wait=10, released at once: none may be answered in flight, every answer is the one transfer (judged only if the profile declares prefer_wait; not exercised unless an answer carries Preference-Applied: wait)",
        attach
    ),
    property!(
        "an answer lost after the commit is replayed on retry, not made again",
        "draft §1: the retry of a request whose answer was lost must not repeat its effect",
        lost_answer
    ),
    property!(
        "a client that hangs up leaves no key held past the lease and nothing paid twice",
        "draft §2.7 and §1: a request in flight is answered 409 until it ends, and a retry must not repeat its effect; a key is not held past the service's lease (profile lease_seconds) because its client walked away",
        super::walk::hang_ups
    ),
    property!(
        "a malformed request is refused and does not consume its key",
        "draft §2.7: a request the server rejects must be corrected before a retry, so the rejection does not complete the key; its status is any 4xx (profile invalid_status)",
        invalid_keeps_key
    ),
    property!(
        "a business refusal is refused again on its retry",
        "draft §2.6: a stored response, whatever its status, is returned as stored; whether a refusal is stored is the implementation's (profile refusals_stored): stored, the retry replays it, else it gets the same refusal again",
        refusal_stored
    ),
    property!(
        "authentication comes first: a bad, missing or doubled token is refused before the key is read",
        "draft §6: keys are scoped by who the client is, so who it is is known before a key is read (a refusal there consumes nothing); 401 or 403 (profile unauthorized_status); Authorization is a singleton (RFC 9110 §11.6.2)",
        auth_first
    ),
    property!(
        "a transfer is read by its own client only",
        "draft §2.2 and §6: keys and what they made belong to their client; checked at the profile's get_path (200 to its owner, a 4xx to another)",
        get_across_clients
    ),
    property!(
        "errors show no internals (and are problem+json, if the profile says so)",
        "draft §6 (security): no leak of the server's internals; RFC 9457 problem details only if the profile declares problem_json (the draft's examples use them, its text does not ask)",
        error_bodies
    ),
    property!(
        "concurrent transfers on one account lose no update",
        "DESIGN §1: balances move by guarded updates; no more is paid than the account holds",
        no_lost_update
    ),
    property!(
        "a request first sent past the keys' retention is refused (412), if the profile declares it",
        "OASIS Repeatable Requests: a request whose Repeatability-First-Sent is older than the server tracks is 412 and not run, a malformed one 400 (judged only if the profile declares first_sent)",
        first_sent
    ),
    property!(
        "the same key on a second operation is that operation's own request, if the profile declares one",
        "draft §2.2: a key is unique per client and resource (DESIGN §2: per client, endpoint and key); the profile's second_operation sent with a transfer's key is made (a 2xx, neither the transfer's answer nor marked a replay), its retry replays it, and the transfer's retry still replays the transfer",
        super::operations::second_operation
    ),
    // last: it judges the answers every property before it was given
    property!(
        "every status answered is listed in the service's OpenAPI document, if the profile names one",
        "OpenAPI 3 (Responses Object): an operation's responses list what it answers, by status, class or default; judged only if the profile declares openapi_path, on every method, path and status the check was answered before",
        super::openapi::documented
    ),
];
