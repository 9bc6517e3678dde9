//! The gateway a payout goes through, as idem sees it: the [`Gateway`]
//! trait, the limits a resend keeps to, and the HTTP client with the one
//! table that classifies every answer (`docs/payouts.md` prints it).

pub use crate::provider::{Call, Limits, Lookup};
use crate::store::PayoutRow;
use serde_json::{Value, json};
use std::time::Duration;

/// The outside service payouts go through.
pub trait Gateway: Send + Sync {
    fn send(&self, payout: &PayoutRow) -> Call;
    /// What the gateway says of `payout`'s downstream key, checked against
    /// the payout (amount, currency, beneficiary).
    fn lookup(&self, payout: &PayoutRow) -> Lookup;
    fn limits(&self) -> &Limits;
    /// How long a caller holds a payout (a request's call, or a
    /// reconciler's lookup and send): past it, it is presumed dead and the
    /// payout is taken. Longer than any one call may take.
    fn lease(&self) -> Duration;
}

/// A gateway's base URL, checked before any money is held: `http://` or
/// `https://` and a host (a typo would otherwise hold each payout's money
/// as `unknown` until a reconciler with the right URL came). Without a
/// trailing `/`.
pub fn gateway_url(text: &str) -> Result<String, String> {
    let url = text.trim_end_matches('/');
    let uri: ureq::http::Uri = url.parse().map_err(|e| format!("{text:?} is not a URL: {e}"))?;
    match (uri.scheme_str(), uri.host()) {
        (Some("http" | "https"), Some(host)) if !host.is_empty() => Ok(url.to_owned()),
        _ => Err(format!("{text:?} is not an http:// or https:// URL with a host")),
    }
}

/// The gateway over HTTP: `POST {url}/payouts` with the downstream key as
/// `Idempotency-Key`, `GET {url}/payouts/{key}`.
#[derive(Clone)]
pub struct HttpGateway {
    pub url: String,
    pub token: Option<String>,
    /// Each call's whole time; past it the outcome is unknown.
    pub timeout: Duration,
    pub limits: Limits,
}

impl std::fmt::Debug for HttpGateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // never the token
        write!(f, "HttpGateway({})", self.url)
    }
}

impl HttpGateway {
    fn agent(&self) -> ureq::Agent {
        crate::https::agent(self.timeout)
    }

    fn authorized<B>(&self, req: ureq::RequestBuilder<B>) -> ureq::RequestBuilder<B> {
        match &self.token {
            Some(token) => req.header("Authorization", format!("Bearer {token}")),
            None => req,
        }
    }
}

/// An answer's status and body; `Err` when none came whole.
fn read(response: ureq::http::Response<ureq::Body>) -> Result<(u16, String), String> {
    let status = response.status().as_u16();
    let text = response.into_body().read_to_string().map_err(|e| format!("answer cut: {e}"))?;
    Ok((status, text))
}

/// The most of a gateway's word (a reason, a state) idem quotes.
const WORD_CHARS: usize = 64;

fn word<'a>(v: &'a Value, member: &str) -> Option<&'a str> {
    v.get(member)?.as_str()
}

fn quoted(text: &str) -> String {
    text.chars().take(WORD_CHARS).collect()
}

/// A status whose request may succeed if sent again unchanged.
fn transient(status: u16) -> bool {
    matches!(status, 408 | 409 | 425 | 429) || status >= 500
}

/// What a send's answer for `p` means. The table, in order:
/// 2xx `paid` → paid, unless it names another amount, currency or
/// beneficiary than `p`'s (→ terminal: a person looks); 402/422 `failed` →
/// refused; 2xx `pending` or 409 →
/// unknown (accepted, look it up); 408, 425, 429, 5xx, a body that is not
/// JSON on them → unknown; every other 4xx (400, 401, 403, 404, a key
/// misused) → terminal; anything else → unknown.
pub fn classify_send(status: u16, body: &str, p: &PayoutRow) -> Call {
    let v: Option<Value> = serde_json::from_str(body).ok();
    let state = v.as_ref().and_then(|v| word(v, "status"));
    let why = || {
        let code = v.as_ref().and_then(|v| word(v, "error").or_else(|| word(v, "status"))).unwrap_or("");
        quoted(&format!("HTTP {status} {code}"))
    };
    match (status, state) {
        (200..=299, Some("paid")) => match v.as_ref().and_then(|v| another(v, p)) {
            Some(member) => Call::Terminal(format!("the gateway paid another {member} than was sent")),
            None => Call::Paid(v.as_ref().and_then(|v| word(v, "id")).map(quoted)),
        },
        (402 | 422, Some("failed")) => Call::Refused {
            status,
            reason: quoted(v.as_ref().and_then(|v| word(v, "reason")).unwrap_or("payout_refused")),
        },
        (200..=299, _) => Call::Unknown(why()),
        (s, _) if transient(s) => Call::Unknown(why()),
        (400..=499, _) => Call::Terminal(why()),
        _ => Call::Unknown(why()),
    }
}

/// Provider states that are not final: the money is neither paid nor back
/// yet (PayPal's `UNCLAIMED` for up to 30 days and `ONHOLD`, Stripe's
/// `in_transit`, Wise's `processing`): looked at again, never a person's.
const NOT_FINAL: [&str; 8] =
    ["pending", "in_transit", "processing", "scheduled", "unclaimed", "on_hold", "onhold", "held"];

/// Provider states that mean the money came back or never left.
const CAME_BACK: [&str; 8] = [
    "canceled",
    "cancelled",
    "returned",
    "reversed",
    "refunded",
    "bounced_back",
    "funds_refunded",
    "charged_back",
];

/// What a lookup's answer means for `p`. 200 `paid` whose amount, currency
/// and beneficiary are `p`'s → paid (any of them different → terminal);
/// a state not final (`NOT_FINAL`: `pending`, `unclaimed`, `on_hold`, …)
/// → pending; `failed` and the states of money back (`CAME_BACK`) →
/// failed; another state → terminal (states in any case); 404 with the
/// gateway's typed `{"error": "not_found"}` → not found (a bare 404 may be
/// a wrong URL: an error); 408, 429, 5xx → error; other 4xx → terminal.
pub fn classify_lookup(status: u16, body: &str, p: &PayoutRow) -> Lookup {
    let v: Option<Value> = serde_json::from_str(body).ok();
    let Some(v) = v else {
        return match status {
            s if transient(s) || s == 404 || s < 400 => {
                Lookup::Error(format!("HTTP {status} without a JSON body"))
            }
            s => Lookup::Terminal(format!("HTTP {s} without a JSON body")),
        };
    };
    match status {
        200 => {}
        404 if word(&v, "error") == Some("not_found") => return Lookup::NotFound,
        s if transient(s) || s == 404 || s < 400 => return Lookup::Error(quoted(&format!("HTTP {s}"))),
        s => return Lookup::Terminal(quoted(&format!("HTTP {s} {}", word(&v, "error").unwrap_or("")))),
    }
    if let Some(member) = another(&v, p) {
        return Lookup::Terminal(format!("the gateway's payout under this key has another {member}"));
    }
    let reason = || quoted(word(&v, "reason").unwrap_or("payout_refused"));
    let Some(state) = word(&v, "status").map(str::to_ascii_lowercase) else {
        return Lookup::Error("HTTP 200 without a status".into());
    };
    match state.as_str() {
        "paid" => Lookup::Paid(word(&v, "id").map(quoted)),
        "failed" => Lookup::Failed { reason: reason() },
        s if NOT_FINAL.contains(&s) => Lookup::Pending,
        s if CAME_BACK.contains(&s) => Lookup::Failed { reason: quoted(&format!("{s}: {}", reason())) },
        other => Lookup::Terminal(quoted(&format!("a state idem does not know: {other}"))),
    }
}

/// Which of amount, currency and beneficiary the gateway's answer names
/// otherwise than `p` (a member it leaves out is no difference).
fn another(v: &Value, p: &PayoutRow) -> Option<&'static str> {
    [
        ("amount", v.get("amount").is_some_and(|a| a != &json!(p.amount))),
        ("currency", v.get("currency").is_some_and(|c| c != &json!(p.currency))),
        ("beneficiary", v.get("beneficiary").is_some_and(|b| b != &json!(p.beneficiary))),
    ]
    .into_iter()
    .find_map(|(member, differs)| differs.then_some(member))
}

impl Gateway for HttpGateway {
    fn send(&self, p: &PayoutRow) -> Call {
        let body =
            json!({"beneficiary": p.beneficiary, "amount": p.amount, "currency": p.currency}).to_string();
        let req = self
            .agent()
            .post(format!("{}/payouts", self.url))
            .header("Idempotency-Key", &p.downstream_key)
            .header("Content-Type", "application/json");
        let sent = self.authorized(req).send(body.as_str());
        match sent.map_err(|e| crate::https::why(&self.url, &e)).and_then(read) {
            Ok((status, text)) => classify_send(status, &text, p),
            Err(why) => Call::Unknown(why),
        }
    }

    fn lookup(&self, p: &PayoutRow) -> Lookup {
        let req = self.agent().get(format!("{}/payouts/{}", self.url, p.downstream_key));
        match self.authorized(req).call().map_err(|e| crate::https::why(&self.url, &e)).and_then(read) {
            Ok((status, text)) => classify_lookup(status, &text, p),
            Err(why) => Lookup::Error(why),
        }
    }

    fn limits(&self) -> &Limits {
        &self.limits
    }

    fn lease(&self) -> Duration {
        self.timeout * 2
    }
}

/// `idem serve`'s gateway as a provider of the library's layer
/// (`embed::layer::Outside`): the intent's body names the payout as a
/// `POST /v1/payouts` does (`beneficiary`, `amount`, `currency`, and
/// `src`), and the one table above classifies every answer. Its blocking
/// client runs on the runtime's blocking threads.
impl crate::provider::Provider for HttpGateway {
    async fn send(&self, intent: &crate::provider::Intent) -> Call {
        let Some(p) = as_payout(intent) else {
            return Call::Terminal("the intent names no payout (beneficiary, amount, currency)".into());
        };
        let gateway = self.clone();
        tokio::task::spawn_blocking(move || Gateway::send(&gateway, &p))
            .await
            .unwrap_or_else(|e| Call::Unknown(format!("the send's thread failed: {e}")))
    }

    async fn lookup(&self, intent: &crate::provider::Intent) -> Lookup {
        let Some(p) = as_payout(intent) else {
            return Lookup::Terminal("the intent names no payout (beneficiary, amount, currency)".into());
        };
        let gateway = self.clone();
        tokio::task::spawn_blocking(move || Gateway::lookup(&gateway, &p))
            .await
            .unwrap_or_else(|e| Lookup::Error(format!("the lookup's thread failed: {e}")))
    }
}

/// The payout an intent's body names, as the gateway's client reads one.
fn as_payout(intent: &crate::provider::Intent) -> Option<PayoutRow> {
    let b = &intent.body;
    let now = crate::clock::Timestamp::now();
    Some(PayoutRow {
        id: intent.id,
        key: crate::request::ScopedKey {
            client_id: String::new(),
            endpoint: String::new(),
            idem_key: String::new(),
        },
        fingerprint: String::new(),
        src: crate::request::AcctId::Text(b.get("src").and_then(Value::as_str).unwrap_or("").to_owned()),
        beneficiary: b.get("beneficiary")?.as_str()?.to_owned(),
        amount: b.get("amount")?.as_i64()?,
        currency: b.get("currency")?.as_str()?.to_owned(),
        downstream_key: intent.downstream_key.clone(),
        state: crate::store::PayoutState::InProgress,
        holder: String::new(),
        lease_until: now,
        created_at: now,
        updated_at: now,
        note: None,
        status: None,
        sends: intent.sends,
        attempts: 0,
        provider_id: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::Timestamp;
    use crate::request::{AcctId, ScopedKey};
    use crate::store::PayoutState;

    fn row() -> PayoutRow {
        let t = Timestamp::parse("2026-12-01T00:00:00Z").unwrap();
        PayoutRow {
            id: 1,
            key: ScopedKey { client_id: "c".into(), endpoint: "/v1/payouts".into(), idem_key: "k".into() },
            fingerprint: "f".into(),
            src: AcctId::Int(1),
            beneficiary: "bob".into(),
            amount: 250,
            currency: "KRW".into(),
            downstream_key: "d".into(),
            state: PayoutState::Unknown,
            holder: "h".into(),
            lease_until: t,
            created_at: t,
            updated_at: t,
            note: None,
            status: None,
            sends: 1,
            attempts: 0,
            provider_id: None,
        }
    }

    #[test]
    fn every_send_answer_has_its_class() {
        let p = row();
        let classify_send = |status, body| classify_send(status, body, &p);
        let terminal = |c: &Call| matches!(c, Call::Terminal(_));
        let unknown = |c: &Call| matches!(c, Call::Unknown(_));
        assert_eq!(classify_send(201, r#"{"status":"paid","id":"po_9"}"#), Call::Paid(Some("po_9".into())));
        let echoed = r#"{"status":"paid","id":"po_9","amount":250,"currency":"KRW","beneficiary":"bob"}"#;
        assert_eq!(classify_send(201, echoed), Call::Paid(Some("po_9".into())));
        assert_eq!(
            classify_send(402, r#"{"status":"failed","reason":"account_closed"}"#),
            Call::Refused { status: 402, reason: "account_closed".into() }
        );
        for (status, body) in [
            (409, r#"{"status":"pending"}"#),
            (202, r#"{"status":"pending"}"#),
            (429, r#"{"error":"rate_limited"}"#),
            (500, "<html>"),
            (503, ""),
            (408, ""),
            (201, "not json"),
            (422, r#"{"error":"validation"}"#), // a 422 without failed is no refusal, and not ours to fix
        ] {
            let call = classify_send(status, body);
            let want = if status == 422 { terminal(&call) } else { unknown(&call) };
            assert!(want, "{status} {body}: {call:?}");
        }
        for (status, body) in [
            (400, r#"{"error":"idempotency_key_reused"}"#),
            (400, r#"{"error":"invalid_request"}"#),
            (401, r#"{"error":"unauthorized"}"#),
            (403, ""),
            (404, r#"{"error":"not_found"}"#),
            (413, ""),
            // paid, but not what was sent: no "paid" to tell the client
            (201, r#"{"status":"paid","amount":251}"#),
            (200, r#"{"status":"paid","currency":"USD"}"#),
            (201, r#"{"status":"paid","beneficiary":"eve"}"#),
        ] {
            assert!(terminal(&classify_send(status, body)), "{status} {body}");
        }
    }

    #[test]
    fn every_lookup_answer_has_its_class() {
        let p = row();
        let paid = r#"{"status":"paid","id":"po_1","amount":250,"currency":"KRW","beneficiary":"bob"}"#;
        assert_eq!(classify_lookup(200, paid, &p), Lookup::Paid(Some("po_1".into())));
        assert_eq!(classify_lookup(200, r#"{"status":"pending"}"#, &p), Lookup::Pending);
        // not final: looked at again, never sent to a person (PayPal writes them in capitals)
        for state in ["UNCLAIMED", "ONHOLD", "on_hold", "in_transit", "processing"] {
            let body = format!(r#"{{"status":"{state}"}}"#);
            assert_eq!(classify_lookup(200, &body, &p), Lookup::Pending, "{state}");
        }
        for state in
            ["failed", "canceled", "returned", "reversed", "RETURNED", "bounced_back", "funds_refunded"]
        {
            let body = format!(r#"{{"status":"{state}","reason":"bank_return"}}"#);
            assert!(matches!(classify_lookup(200, &body, &p), Lookup::Failed { .. }), "{state}");
        }
        assert_eq!(classify_lookup(404, r#"{"error":"not_found"}"#, &p), Lookup::NotFound);
        // a bare 404 (a wrong URL, a proxy) is no "never heard of it"
        for (status, body) in
            [(404, ""), (404, "<html>"), (404, r#"{"error":"no_such_route"}"#), (503, ""), (429, "{}")]
        {
            assert!(matches!(classify_lookup(status, body, &p), Lookup::Error(_)), "{status} {body}");
        }
        for (status, body) in [
            (200, r#"{"status":"paid","amount":251}"#),
            (200, r#"{"status":"paid","currency":"USD"}"#),
            (200, r#"{"status":"paid","beneficiary":"eve"}"#),
            (200, r#"{"status":"requires_review"}"#),
            (401, r#"{"error":"unauthorized"}"#),
            (403, ""),
        ] {
            assert!(matches!(classify_lookup(status, body, &p), Lookup::Terminal(_)), "{status} {body}");
        }
    }

    #[test]
    fn the_backoff_doubles_to_its_cap_and_is_jittered_below_it() {
        let limits = Limits {
            backoff: Duration::from_secs(10),
            backoff_cap: Duration::from_secs(60),
            ..Limits::default()
        };
        for attempt in 1..=12 {
            let ceiling = Duration::from_secs((10u64 << (attempt - 1).min(3)).min(60));
            let waits: Vec<Duration> = (0..200).map(|seed| limits.wait(attempt, seed)).collect();
            assert!(waits.iter().all(|w| *w <= ceiling), "attempt {attempt}");
            assert!(waits.iter().any(|w| *w > ceiling / 2), "attempt {attempt}: no spread");
            assert!(waits.iter().any(|w| *w < ceiling / 2), "attempt {attempt}: no jitter");
        }
        assert_eq!(limits.wait(3, 7), limits.wait(3, 7), "a payout's wait is reproducible");
    }

    #[test]
    fn a_callers_lease_outlasts_its_call_so_no_reconciler_takes_a_payout_mid_call() {
        for timeout in [Duration::from_millis(1), Duration::from_secs(10), Duration::from_secs(86_400)] {
            let gateway =
                HttpGateway { url: "http://gw".into(), token: None, timeout, limits: Limits::default() };
            assert!(gateway.lease() > timeout, "{timeout:?}");
        }
    }
}
