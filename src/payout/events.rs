//! Provider events (`POST /v1/gateway-events`): what a payout provider
//! pushes when a payout is paid, fails, or comes back after it was paid.
//! Each is signed one of two ways: HMAC-SHA256 over `"{t}.{body}"`, header
//! `Idem-Signature: t=<unix seconds>,v1=<hex>`, as Stripe signs webhooks;
//! or as the Standard Webhooks specification says, HMAC-SHA256 over
//! `"{id}.{t}.{body}"` under the secret's bytes (base64 after `whsec_`),
//! headers `webhook-id`, `webhook-timestamp` and `webhook-signature:
//! v1,<base64> [v1,<base64>…]`. Each is refused when stale, compared in
//! constant time, and applied once by its id, in one transaction with the
//! payout's change and its audit row.

use super::{Call, credit_back, gateway_text, settle};
use crate::clock::Timestamp;
use crate::policy::Policy;
use crate::store::{self, Durability, End, PayoutState, Store, StoreError};
use hmac::{Hmac, KeyInit, Mac};
use serde_json::Value;
use sha2::Sha256;

/// How far an event's signed time may be from ours.
pub(crate) const TOLERANCE_SECONDS: i64 = 300;

/// The header that carries the signature.
pub const SIGNATURE_HEADER: &str = "idem-signature";

/// Why an event was not taken.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refused {
    /// No signature, a wrong one, or a stale time: 401.
    Unsigned(&'static str),
    /// A body that is not an event: 400.
    Malformed(String),
}

/// The Standard Webhooks headers: the event's id, its time, its signatures.
pub const STANDARD_HEADERS: [&str; 3] = ["webhook-id", "webhook-timestamp", "webhook-signature"];

/// A signature header read, its time checked, before the body is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Signature {
    t: i64,
    tags: Vec<Vec<u8>>,
    /// Standard Webhooks' `webhook-id`, which the signature covers and
    /// which is the event's id; `None`: signed as Stripe signs.
    id: Option<String>,
}

impl Signature {
    /// Reads `header` (`t=…,v1=…`) and checks its time against `now` (Unix
    /// seconds): what can be refused without reading an unauthenticated
    /// body. Several `v1=` may come: a provider rolling its secret signs
    /// with the old and the new one for a while.
    pub fn read(header: Option<&str>, now: i64) -> Result<Signature, Refused> {
        let header = header.ok_or(Refused::Unsigned("no Idem-Signature header"))?;
        let (mut t, mut tags) = (None, Vec::new());
        for part in header.split(',') {
            match part.trim().split_once('=') {
                Some(("t", value)) => t = value.parse::<i64>().ok(),
                Some(("v1", value)) => tags.extend(hex(value)),
                _ => {}
            }
        }
        let Some(t) = t.filter(|_| !tags.is_empty()) else {
            return Err(Refused::Unsigned("Idem-Signature needs t= and v1="));
        };
        fresh(t, now)?;
        Ok(Signature { t, tags, id: None })
    }

    /// Reads the Standard Webhooks headers (`[webhook-id,
    /// webhook-timestamp, webhook-signature]`) and checks the time, as
    /// [`Signature::read`]; several space-separated `v1,` signatures may
    /// come (a secret being rolled), any other version is passed over.
    pub fn read_standard(headers: [Option<&str>; 3], now: i64) -> Result<Signature, Refused> {
        use base64::Engine;
        let [Some(id), Some(t), Some(signatures)] = headers else {
            return Err(Refused::Unsigned(
                "webhook-id, webhook-timestamp and webhook-signature come together",
            ));
        };
        let t =
            t.trim().parse::<i64>().map_err(|_| Refused::Unsigned("webhook-timestamp is no Unix time"))?;
        let tags: Vec<Vec<u8>> = signatures
            .split(' ')
            .filter_map(|s| s.strip_prefix("v1,"))
            .filter_map(|b64| base64::engine::general_purpose::STANDARD.decode(b64).ok())
            .collect();
        let fits = !id.is_empty() && id.len() <= 255 && !id.chars().any(char::is_control);
        if tags.is_empty() || !fits {
            return Err(Refused::Unsigned("webhook-signature needs a v1, signature, webhook-id an id"));
        }
        fresh(t, now)?;
        Ok(Signature { t, tags, id: Some(id.to_owned()) })
    }

    /// The event's id the signature covers (Standard Webhooks' `webhook-id`).
    pub fn id(&self) -> Option<&str> {
        self.id.as_deref()
    }

    /// Whether any of the tags signs `body` with any of `secrets` (the
    /// current one, and the previous one while idem's side rotates it).
    pub fn check_any(&self, secrets: &[Vec<u8>], body: &[u8]) -> Result<(), Refused> {
        let mut refused = Refused::Unsigned("no secret");
        for secret in secrets {
            match self.check(secret, body) {
                Ok(()) => return Ok(()),
                Err(why) => refused = why,
            }
        }
        Err(refused)
    }

    /// Whether any of the tags signs `body` with `secret`.
    pub fn check(&self, secret: &[u8], body: &[u8]) -> Result<(), Refused> {
        let mac = match &self.id {
            None => mac(secret, &format!("{}.", self.t), body),
            Some(id) => mac(&standard_key(secret), &format!("{id}.{}.", self.t), body),
        };
        let mac = mac.ok_or(Refused::Unsigned("no secret"))?;
        // each comparison in constant time; which one matched is not secret
        if self.tags.iter().any(|tag| mac.clone().verify_slice(tag).is_ok()) {
            Ok(())
        } else {
            Err(Refused::Unsigned("the signature does not match"))
        }
    }
}

/// Checks `header` against `body` signed with `secret`, at `now` (Unix
/// seconds): [`Signature::read`], then [`Signature::check`].
pub fn verify(secret: &[u8], header: Option<&str>, body: &[u8], now: i64) -> Result<(), Refused> {
    Signature::read(header, now)?.check(secret, body)
}

/// Whether `t` is within [`TOLERANCE_SECONDS`] of `now`.
fn fresh(t: i64, now: i64) -> Result<(), Refused> {
    match (now - t).abs() > TOLERANCE_SECONDS {
        true => Err(Refused::Unsigned("the signature's time is more than 5 minutes from ours")),
        false => Ok(()),
    }
}

/// The signature header for `body` at `t` (the provider's side, and tests').
pub fn sign(secret: &[u8], body: &[u8], t: i64) -> String {
    let tag =
        mac(secret, &format!("{t}."), body).map(|m| m.finalize().into_bytes().to_vec()).unwrap_or_default();
    let tag = crate::hex::lower(&tag);
    format!("t={t},v1={tag}")
}

/// Standard Webhooks' `webhook-signature` for event `id`'s `body` at `t`
/// (the provider's side, and tests').
pub fn sign_standard(secret: &[u8], id: &str, body: &[u8], t: i64) -> String {
    use base64::Engine;
    let mac = mac(&standard_key(secret), &format!("{id}.{t}."), body);
    let tag = mac.map(|m| m.finalize().into_bytes().to_vec()).unwrap_or_default();
    format!("v1,{}", base64::engine::general_purpose::STANDARD.encode(tag))
}

/// A Standard Webhooks key: the base64 after `whsec_`, else the bytes as
/// they are (a secret given raw).
fn standard_key(secret: &[u8]) -> Vec<u8> {
    whsec_key(secret).unwrap_or_else(|| secret.to_vec())
}

/// The key a `whsec_` secret gives (the base64 after the prefix); `None`
/// for a secret without the prefix or whose rest is not base64.
pub fn whsec_key(secret: &[u8]) -> Option<Vec<u8>> {
    use base64::Engine;
    secret.strip_prefix(b"whsec_").and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
}

/// HMAC-SHA256 under `secret` over `prefix` then `body` (HMAC takes a key
/// of any length, so `None` does not happen).
fn mac(secret: &[u8], prefix: &str, body: &[u8]) -> Option<Hmac<Sha256>> {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).ok()?;
    mac.update(prefix.as_bytes());
    mac.update(body);
    Some(mac)
}

fn hex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len()).step_by(2).map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok()).collect()
}

/// One provider event: `{"id", "type", "data": {"key", "id", "amount",
/// "currency", "reason"}}`, `key` being the downstream key idem sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub id: String,
    pub kind: String,
    pub downstream_key: String,
    pub provider_id: Option<String>,
    pub amount: Option<i64>,
    pub currency: Option<String>,
    pub reason: Option<String>,
}

impl Event {
    /// The event in `body`; its id is the one the signature covers
    /// (`signed_id`: Standard Webhooks' `webhook-id`, each message's own),
    /// or else the body's `id`.
    pub fn parse(body: &[u8], signed_id: Option<&str>) -> Result<Event, Refused> {
        let bad = |why: &str| Refused::Malformed(why.to_owned());
        let v: Value = serde_json::from_slice(body).map_err(|_| bad("the body is not JSON"))?;
        let text = |v: &Value, member: &str| v.get(member).and_then(Value::as_str).map(str::to_owned);
        let data = v.get("data").ok_or_else(|| bad("no data"))?;
        let event = Event {
            id: signed_id.map(str::to_owned).or_else(|| text(&v, "id")).ok_or_else(|| bad("no id"))?,
            kind: text(&v, "type").ok_or_else(|| bad("no type"))?,
            downstream_key: text(data, "key").ok_or_else(|| bad("no data.key"))?,
            provider_id: text(data, "id"),
            amount: data.get("amount").and_then(Value::as_i64),
            currency: text(data, "currency"),
            reason: text(data, "reason"),
        };
        let fits = |s: &str| !s.is_empty() && s.len() <= 255 && !s.chars().any(char::is_control);
        if !fits(&event.id) || !fits(&event.kind) || !fits(&event.downstream_key) {
            return Err(bad("id, type and data.key must be 1-255 characters without control characters"));
        }
        Ok(event)
    }
}

/// How the outcome of an event that needs a person begins (what `idem
/// payouts strays` lists and the service counts).
pub const FOR_A_PERSON: &str = "needs a person";

/// Applies `event` once: `Ok(None)` if its id was seen before, else what
/// it did. An event for no payout of idem's, or with another amount or
/// currency, changes no money: it is recorded as needing a person (and an
/// open payout it names goes to one).
pub fn apply<S: Store + ?Sized>(
    store: &mut S,
    event: &Event,
    now: Timestamp,
    policy: &Policy,
) -> Result<Option<String>, StoreError> {
    let actor = format!("event:{}", gateway_text(&event.id));
    store::atomically(store, Durability::Durable, policy, |tx| {
        let outcome = match tx.payout_by_downstream_key(&event.downstream_key)? {
            None => format!("{FOR_A_PERSON}: no payout under this key"),
            Some(seen) => {
                // the key before the payout, in the order every writer locks them
                tx.lock_key(&seen.key)?;
                let Some(mut p) = tx.payout(seen.id)? else { return Err(StoreError::Conflict) };
                let mismatch = event.amount.is_some_and(|a| a != p.amount)
                    || event.currency.as_ref().is_some_and(|c| *c != p.currency);
                let reason = gateway_text(event.reason.as_deref().unwrap_or(&event.kind));
                let open = !p.state.settled();
                let call = match (event.kind.as_str(), p.state) {
                    _ if mismatch && open => {
                        Some(Call::Terminal("an event with another amount or currency".into()))
                    }
                    _ if mismatch => None,
                    ("payout.paid", _) if open => Some(Call::Paid(event.provider_id.clone())),
                    ("payout.failed" | "payout.canceled", _) if open => {
                        Some(Call::Refused { status: 422, reason: reason.clone() })
                    }
                    ("payout.returned" | "payout.reversed", _) if open => {
                        Some(Call::Refused { status: 422, reason: format!("{}: {reason}", event.kind) })
                    }
                    _ => None,
                };
                let back = matches!(
                    (event.kind.as_str(), p.state),
                    ("payout.failed" | "payout.returned" | "payout.reversed", PayoutState::Completed)
                ) && !mismatch;
                if call.is_some() || back {
                    let before = std::mem::replace(&mut p.holder, actor.clone());
                    if !tx.update_payout(&p, &before)? {
                        return Err(StoreError::Conflict);
                    }
                }
                let id = p.id;
                match (call, back) {
                    (Some(call), _) => {
                        format!("payout {id}: {}", settle(tx, p, call, now, now)?.state.name())
                    }
                    (None, true) => {
                        let why = format!("{}: {reason}", event.kind);
                        format!("payout {id}: {}", credit_back(tx, p, &why, now)?.state.name())
                    }
                    (None, false) => unchanged(event, &p, mismatch),
                }
            }
        };
        let fresh = tx.insert_gateway_event(&event.id, now, &event.kind, &event.downstream_key, &outcome)?;
        Ok(match fresh {
            true => End::Commit(Some(outcome)),
            false => End::Rollback(None), // seen before: what it did stands, this changes nothing
        })
    })
}

/// What an event that changes nothing says: a person's when it contradicts
/// idem's record (another amount or currency; paid, for a payout idem
/// failed and released for another reason than a return: a refusal, a
/// cancel, so the money is out twice), else nothing to do (a late `paid`
/// after a return merely reorders).
fn unchanged(event: &Event, p: &crate::store::PayoutRow, mismatch: bool) -> String {
    let (id, state) = (p.id, p.state.name());
    if mismatch {
        format!("{FOR_A_PERSON}: payout {id} is {state} and the event's amount or currency differs")
    } else if event.kind == "payout.paid" && p.state == PayoutState::Failed && !came_back(p) {
        format!("{FOR_A_PERSON}: payout {id} is failed (its hold released) and the provider says it paid")
    } else {
        format!("payout {id} is {state}: nothing to do")
    }
}

/// Whether a failed payout failed because its money came back after it was
/// paid (an event or a lookup said returned or reversed).
fn came_back(p: &crate::store::PayoutRow) -> bool {
    let note = p.note.as_deref().unwrap_or("");
    ["payout.returned", "payout.reversed", "returned", "reversed"].iter().any(|k| note.starts_with(k))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Standard Webhooks specification's own example (its secret,
    /// message id, time and payload; the signature it gives, which Python's
    /// hmac and base64 give too), then what must be refused.
    #[test]
    fn a_standard_webhooks_signature_is_the_specifications_and_holds_only_for_its_message() {
        let (secret, id, t) =
            (&b"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"[..], "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330);
        let body = br#"{"test": 2432232314}"#;
        let signed = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";
        assert_eq!(sign_standard(secret, id, body, t), signed);
        let read = |id: &str, sigs: &str, now: i64| {
            Signature::read_standard([Some(id), Some(&t.to_string()), Some(sigs)], now)
        };
        let ok = read(id, signed, t + 10).unwrap();
        assert_eq!((ok.check(secret, body), ok.id()), (Ok(()), Some(id)));
        // a rolled secret: the old signature and the new, space-separated, any version else passed over
        let both = format!("v2,abc v1,AAAA {signed}");
        assert_eq!(read(id, &both, t).unwrap().check(secret, body), Ok(()));
        assert!(read(id, signed, t).unwrap().check(secret, br#"{"test": 2432232315}"#).is_err());
        assert!(read("msg_other", signed, t).unwrap().check(secret, body).is_err(), "the id is signed too");
        assert!(read(id, signed, t).unwrap().check(b"whsec_AAAAAAAAAAAAAAAAAAAAAAAA", body).is_err());
        assert!(read(id, signed, t + TOLERANCE_SECONDS + 1).is_err(), "stale");
        assert!(read(id, "v2,abc", t).is_err(), "no v1 signature");
        assert!(Signature::read_standard([Some(id), None, Some(signed)], t).is_err(), "no timestamp");
    }

    /// idem's two secrets mid-rotation: the current one, the previous one.
    const ROTATED: [&[u8]; 2] =
        [b"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", b"whsec_cHJldmlvdXMtc2VjcmV0LW9mLXRoZS1zaG9w"];

    /// The vector suite, both formats: each case and its verdict, checked
    /// against idem's two secrets mid-rotation (the current and the
    /// previous). A body, a time and an id, signed as a provider signs.
    #[test]
    fn the_vector_suite_both_formats() {
        let (new, old) = (ROTATED[0], ROTATED[1]);
        let secrets = ROTATED.map(<[u8]>::to_vec);
        let (id, body, now) =
            ("msg_2Lq", &br#"{"type":"payout.paid","data":{"key":"k"}}"#[..], 1_800_000_000_i64);
        let tampered = br#"{"type":"payout.paid","data":{"key":"K"}}"#;
        let ours = sign_standard(new, id, body, now);
        let theirs = sign_standard(b"whsec_d3Jvbmctc2VjcmV0LW9mLWFub3RoZXI=", id, body, now);
        let truncated = &ours[..ours.len() - 6];
        let standard = |t: i64, sigs: Option<&str>, body: &[u8]| {
            let t = t.to_string();
            Signature::read_standard([Some(id), Some(t.as_str()), sigs], now)
                .and_then(|s| s.check_any(&secrets, body))
        };
        let stripe = |header: Option<&str>, body: &[u8]| {
            Signature::read(header, now).and_then(|s| s.check_any(&secrets, body))
        };
        let stripe_ours = sign(new, body, now);
        let stripe_tag =
            |secret: &[u8], t: i64| sign(secret, body, t).split_once(",v1=").unwrap().1.to_owned();
        let cases: Vec<(&str, Result<(), Refused>, bool)> = vec![
            ("valid", standard(now, Some(&ours), body), true),
            (
                "valid, the previous secret",
                standard(now, Some(&sign_standard(old, id, body, now)), body),
                true,
            ),
            ("several, one valid", standard(now, Some(&format!("{theirs} v1,AAAA {ours}")), body), true),
            ("tampered body", standard(now, Some(&ours), tampered), false),
            ("wrong secret", standard(now, Some(&theirs), body), false),
            (
                "stale by 301 s",
                standard(now - 301, Some(&sign_standard(new, id, body, now - 301)), body),
                false,
            ),
            (
                "future by 301 s",
                standard(now + 301, Some(&sign_standard(new, id, body, now + 301)), body),
                false,
            ),
            ("missing headers", standard(now, None, body), false),
            ("an empty v1, signature", standard(now, Some("v1,"), body), false),
            ("a truncated signature", standard(now, Some(truncated), body), false),
            ("Idem-Signature valid", stripe(Some(&stripe_ours), body), true),
            (
                "Idem-Signature, several, one valid",
                stripe(Some(&format!("t={now},v1=00ff,v1={}", stripe_tag(new, now))), body),
                true,
            ),
            ("Idem-Signature tampered body", stripe(Some(&stripe_ours), tampered), false),
            (
                "Idem-Signature stale by 301 s",
                stripe(Some(&format!("t={},v1={}", now - 301, stripe_tag(new, now - 301))), body),
                false,
            ),
            (
                "Idem-Signature future by 301 s",
                stripe(Some(&format!("t={},v1={}", now + 301, stripe_tag(new, now + 301))), body),
                false,
            ),
            ("Idem-Signature missing", stripe(None, body), false),
            ("Idem-Signature empty v1=", stripe(Some(&format!("t={now},v1=")), body), false),
            ("Idem-Signature truncated", stripe(Some(&stripe_ours[..stripe_ours.len() - 4]), body), false),
        ];
        for (case, verdict, valid) in cases {
            assert_eq!(verdict.is_ok(), valid, "{case}: {verdict:?}");
        }
    }

    #[test]
    fn a_signature_holds_only_for_its_body_its_secret_and_its_time() {
        let (secret, body, t) = (b"whsec", br#"{"id":"evt_1"}"#, 1_700_000_000);
        let header = sign(secret, body, t);
        assert_eq!(verify(secret, Some(&header), body, t + 10), Ok(()));
        assert!(verify(secret, Some(&header), br#"{"id":"evt_2"}"#, t).is_err(), "another body");
        assert!(verify(b"other", Some(&header), body, t).is_err(), "another secret");
        assert!(verify(secret, Some(&header), body, t + TOLERANCE_SECONDS + 1).is_err(), "stale");
        assert!(verify(secret, None, body, t).is_err());
        assert!(verify(secret, Some("t=1700000000,v1=zz"), body, t).is_err());
        let forged = header.replace("v1=", "v1=00");
        assert!(verify(secret, Some(&forged), body, t).is_err());
        // a secret being rolled: the old one's tag and the new one's, either order
        let old = sign(b"old", body, t);
        let old_tag = old.split_once(",v1=").unwrap().1;
        assert_eq!(verify(secret, Some(&format!("{header},v1={old_tag}")), body, t), Ok(()));
        let new_tag = header.split_once(",v1=").unwrap().1;
        assert_eq!(verify(secret, Some(&format!("{old},v1={new_tag}")), body, t), Ok(()));
        assert!(verify(secret, Some(&format!("{old},v1={old_tag}")), body, t).is_err());
    }

    #[test]
    fn an_event_needs_its_id_type_and_key() {
        let ok = br#"{"id":"evt_1","type":"payout.returned","data":{"key":"k","amount":5,"currency":"KRW"}}"#;
        assert_eq!(Event::parse(ok, None).unwrap().amount, Some(5));
        for bad in [
            &b"nope"[..],
            br#"{"type":"payout.paid","data":{"key":"k"}}"#,
            br#"{"id":"e","type":"t"}"#,
            br#"{"id":"e\u0000","type":"t","data":{"key":"k"}}"#,
        ] {
            assert!(Event::parse(bad, None).is_err(), "{}", String::from_utf8_lossy(bad));
        }
    }
}
