//! Parsing and validating a request file into typed values.
//!
//! Every 400 reason is born here, before the key is claimed, so a bad request
//! never consumes its key. The schema is strict: unknown fields are rejected
//! rather than ignored, because a field the engine ignores is a field the
//! fingerprint would still cover, and a client that sends `"memo"` expecting
//! it to matter deserves to hear that it does not.

use crate::canonical::{Json, clip, fingerprint};
use crate::policy::Policy;
use crate::reason::Reason;
use std::fmt;

/// Whether a media type (a `Content-Type` value) is JSON's:
/// `application/json`, or a `+json` suffix (RFC 6839), whatever its
/// parameters.
///
/// ```
/// use idem::request::is_json;
/// assert!(is_json("application/json; charset=utf-8") && is_json("application/problem+json"));
/// assert!(!is_json("text/plain") && !is_json("application/x-www-form-urlencoded"));
/// ```
pub fn is_json(media_type: &str) -> bool {
    let essence = media_type.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    essence == "application/json" || (essence.starts_with("application/") && essence.ends_with("+json"))
}

mod first_sent;
mod prefer;
pub use first_sent::{FIRST_SENT, FIRST_SENT_MARGIN_SECONDS, first_sent};
#[cfg(any(feature = "postgres", feature = "axum"))]
pub use prefer::within;
pub use prefer::{MAX_PREFER_WAIT, prefer_wait};

/// 2^53 − 1: the largest integer that every JSON parser, RFC 8785 and a
/// double-precision column keep exact. Amounts and integer account ids
/// beyond it would round, and two different ids could share a fingerprint.
pub const MAX_EXACT_INT: i64 = 9_007_199_254_740_991;

/// The identity of a key: `(client_id, endpoint, idem_key)`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ScopedKey {
    /// Who sent it (the authenticated client).
    pub client_id: String,
    /// The operation (`POST /v1/transfers`).
    pub endpoint: String,
    /// The client's own key.
    pub idem_key: String,
}

/// An account id exactly as the client sent it; matched against
/// `account.acct_id` with the same SQL type (text or integer).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AcctId {
    /// An integer id (`"src": 1`).
    Int(i64),
    /// A text id (`"src": "A"`).
    Text(String),
}

impl fmt::Display for AcctId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AcctId::Int(i) => write!(f, "{i}"),
            AcctId::Text(s) => f.write_str(s),
        }
    }
}

impl AcctId {
    /// The id as JSON, as the client spelled it.
    pub fn to_json(&self) -> Json {
        match self {
            AcctId::Int(i) => Json::Int(*i),
            AcctId::Text(s) => Json::String(s.clone()),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
/// A transfer of `amount` from `src` to `dst`.
pub struct Transfer {
    /// The account debited.
    pub src: AcctId,
    /// The account credited.
    pub dst: AcctId,
    /// In the currency's smallest unit; 1..=policy.max_amount.
    pub amount: i64,
    /// An ISO 4217 code the policy lists.
    pub currency: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
/// A transfer request, parsed: its key, the transfer, and its fingerprint.
pub struct Request {
    /// The key, scoped.
    pub key: ScopedKey,
    /// What the body asks for.
    pub transfer: Transfer,
    /// SHA-256 hex of the RFC 8785 form of `body`.
    pub fingerprint: String,
}

/// A payout: money leaves `src` for a beneficiary outside, through a
/// gateway.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Payout {
    /// The account the money leaves.
    pub src: AcctId,
    /// Who it goes to, as the gateway names them.
    pub beneficiary: String,
    /// In the currency's smallest unit.
    pub amount: i64,
    /// An ISO 4217 code the policy lists.
    pub currency: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
/// A payout request, parsed: its key, the payout, and its fingerprint.
pub struct PayoutRequest {
    /// The key, scoped.
    pub key: ScopedKey,
    /// What the body asks for.
    pub payout: Payout,
    /// SHA-256 hex of the RFC 8785 form of the body.
    pub fingerprint: String,
}

/// Why a request is malformed. `Display` is the `reason` of the 400 response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RequestError {
    /// The body is over the policy's limit.
    TooLarge {
        /// The limit, in bytes.
        limit: usize,
    },
    /// The body is not UTF-8.
    NotUtf8,
    /// The body is not JSON: the parser's words.
    NotJson(String),
    /// This part is not a JSON object.
    NotObject(&'static str),
    /// This field is missing.
    Missing(&'static str),
    /// A field the request does not have.
    UnknownField(String),
    /// A field of the wrong JSON type.
    WrongType {
        /// The field.
        field: &'static str,
        /// The type it must have.
        expected: &'static str,
    },
    /// This field is an empty string.
    Empty(&'static str),
    /// A field longer than the policy allows.
    TooLong {
        /// The field.
        field: &'static str,
        /// The limit, in characters.
        limit: usize,
    },
    /// A control character (NUL, a line break, …): no store keeps a NUL,
    /// and none belongs in an id, a key or a name.
    Control(&'static str),
    /// The amount is not an integer in `1..=max`.
    Amount {
        /// The largest amount the policy allows.
        max: i64,
    },
    /// `src` and `dst` are the same account.
    SameAccount,
    /// A currency the policy does not list.
    Currency(String),
}

impl RequestError {
    /// The refusal this error is: `invalid_request`, with its detail.
    pub fn reason(&self) -> Reason {
        Reason::invalid(Detail(self).to_string())
    }
}

/// What is wrong, without the reason's code.
struct Detail<'a>(&'a RequestError);

impl fmt::Display for RequestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", crate::reason::INVALID_REQUEST, Detail(self))
    }
}

impl fmt::Display for Detail<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use RequestError as E;
        match self.0 {
            E::TooLarge { limit } => write!(f, "request is larger than {limit} bytes"),
            E::NotUtf8 => write!(f, "request is not valid UTF-8"),
            E::NotJson(why) => write!(f, "request is not valid JSON ({why})"),
            E::NotObject(what) => write!(f, "{what} must be a JSON object"),
            E::Missing(field) => write!(f, "missing field {field}"),
            E::UnknownField(field) => write!(f, "unknown field {field}"),
            E::WrongType { field, expected } => write!(f, "{field} must be {expected}"),
            E::Empty(field) => write!(f, "{field} must not be empty"),
            E::TooLong { field, limit } => {
                write!(f, "{field} must be at most {limit} characters")
            }
            E::Control(field) => write!(f, "{field} must not contain control characters"),
            E::Amount { max } => {
                write!(f, "amount must be a positive integer no greater than {max}")
            }
            E::SameAccount => write!(f, "src and dst must be different accounts"),
            E::Currency(c) => write!(f, "unsupported currency {c:?}"),
        }
    }
}

impl std::error::Error for RequestError {}

/// The endpoint of payouts (`POST /v1/payouts`): its keys make payouts,
/// and the store keeps their open claims from the purge.
pub const PAYOUTS: &str = "/v1/payouts";

const TOP: [&str; 4] = ["client_id", "endpoint", "idem_key", "body"];
const BODY: [&str; 4] = ["src", "dst", "amount", "currency"];

/// Parses and validates the raw bytes of a request file.
pub fn parse(bytes: &[u8], policy: &Policy) -> Result<Request, RequestError> {
    let json = json(bytes, policy)?;
    only_fields(&json, "request", &TOP, "")?;
    let key = envelope_key(&json, policy)?;
    let body = json.get("body").ok_or(RequestError::Missing("body"))?;
    transfer_request(key, body, &IN_REQUEST, policy)
}

/// The key a request file names: (client_id, endpoint, idem_key).
fn envelope_key(json: &Json, policy: &Policy) -> Result<ScopedKey, RequestError> {
    let limit = policy.max_field_chars;
    Ok(ScopedKey {
        client_id: text_field(json, "client_id", limit)?,
        endpoint: text_field(json, "endpoint", limit)?,
        idem_key: text_field(json, "idem_key", limit)?,
    })
}

/// Parses and validates a transfer sent over HTTP: `bytes` is the body, the
/// transfer object alone; `key` comes from the caller's token, the route and
/// the `Idempotency-Key` header. The same rules and the same fingerprint as
/// a request file, so either front replays the other.
pub fn parse_body(key: ScopedKey, bytes: &[u8], policy: &Policy) -> Result<Request, RequestError> {
    transfer_request(key, &json(bytes, policy)?, &ON_ITS_OWN, policy)
}

const PAYOUT_BODY: [&str; 4] = ["src", "beneficiary", "amount", "currency"];

/// Parses and validates a payout sent over HTTP (`POST /v1/payouts`), by the
/// same rules as a transfer: strict members, exact integer amounts, the
/// policy's currencies, and a fingerprint of the RFC 8785 form.
pub fn parse_payout(key: ScopedKey, bytes: &[u8], policy: &Policy) -> Result<PayoutRequest, RequestError> {
    payout_request(key, &json(bytes, policy)?, &ON_ITS_OWN, policy)
}

/// Parses and validates a payout request file (`idem_api --gateway`): the
/// lab's envelope around a payout body. The same fingerprint as over HTTP,
/// so either front replays the other.
pub fn parse_payout_file(bytes: &[u8], policy: &Policy) -> Result<PayoutRequest, RequestError> {
    let json = json(bytes, policy)?;
    only_fields(&json, "request", &TOP, "")?;
    let body = json.get("body").ok_or(RequestError::Missing("body"))?;
    payout_request(envelope_key(&json, policy)?, body, &IN_REQUEST, policy)
}

fn payout_request(
    key: ScopedKey,
    body: &Json,
    names: &Names,
    policy: &Policy,
) -> Result<PayoutRequest, RequestError> {
    only_fields(body, names.object, &PAYOUT_BODY, names.prefix)?;
    let limit = policy.max_field_chars;
    let payout = Payout {
        src: acct_field(body, names.src, "src", limit)?,
        beneficiary: text_field(body, "beneficiary", limit).map_err(|e| renamed(e, names.beneficiary))?,
        amount: amount_field(body, names, policy)?,
        currency: currency_field(body, names, policy)?,
    };
    Ok(PayoutRequest { key, payout, fingerprint: fingerprint(body) })
}

/// `e`, a text field's error, naming the field as `name`.
fn renamed(e: RequestError, name: &'static str) -> RequestError {
    match e {
        RequestError::Missing(_) => RequestError::Missing(name),
        RequestError::WrongType { .. } => RequestError::WrongType { field: name, expected: "a string" },
        RequestError::Empty(_) => RequestError::Empty(name),
        RequestError::TooLong { limit, .. } => RequestError::TooLong { field: name, limit },
        RequestError::Control(_) => RequestError::Control(name),
        other => other,
    }
}

/// `amount`: an exact integer in 1..=the policy's maximum.
fn amount_field(body: &Json, names: &Names, policy: &Policy) -> Result<i64, RequestError> {
    match body.get("amount") {
        None => Err(RequestError::Missing(names.amount)),
        Some(Json::Int(a)) if (1..=policy.max_amount).contains(a) => Ok(*a),
        Some(_) => Err(RequestError::Amount { max: policy.max_amount }),
    }
}

/// `currency`: one of the policy's.
fn currency_field(body: &Json, names: &Names, policy: &Policy) -> Result<String, RequestError> {
    let currency = text_field(body, "currency", policy.max_field_chars).map_err(|e| match e {
        RequestError::Missing(_) => RequestError::Missing(names.currency),
        _ => RequestError::WrongType { field: names.currency, expected: "a string" },
    })?;
    match policy.currencies.contains(&currency) {
        true => Ok(currency),
        false => Err(RequestError::Currency(clip(&currency))),
    }
}

fn json(bytes: &[u8], policy: &Policy) -> Result<Json, RequestError> {
    if bytes.len() > policy.max_request_bytes {
        return Err(RequestError::TooLarge { limit: policy.max_request_bytes });
    }
    let text = std::str::from_utf8(bytes).map_err(|_| RequestError::NotUtf8)?;
    Json::parse(text).map_err(|e| RequestError::NotJson(e.to_string()))
}

/// How reasons name the transfer's fields: inside a request file, or alone.
struct Names {
    object: &'static str,
    prefix: &'static str,
    src: &'static str,
    dst: &'static str,
    amount: &'static str,
    currency: &'static str,
    beneficiary: &'static str,
}

const IN_REQUEST: Names = Names {
    object: "body",
    prefix: "body.",
    src: "body.src",
    dst: "body.dst",
    amount: "body.amount",
    currency: "body.currency",
    beneficiary: "body.beneficiary",
};

const ON_ITS_OWN: Names = Names {
    object: "body",
    prefix: "",
    src: "src",
    dst: "dst",
    amount: "amount",
    currency: "currency",
    beneficiary: "beneficiary",
};

fn transfer_request(
    key: ScopedKey,
    body: &Json,
    names: &Names,
    policy: &Policy,
) -> Result<Request, RequestError> {
    only_fields(body, names.object, &BODY, names.prefix)?;
    let limit = policy.max_field_chars;
    let transfer = Transfer {
        src: acct_field(body, names.src, "src", limit)?,
        dst: acct_field(body, names.dst, "dst", limit)?,
        amount: amount_field(body, names, policy)?,
        currency: currency_field(body, names, policy)?,
    };
    if transfer.src == transfer.dst {
        return Err(RequestError::SameAccount);
    }
    Ok(Request { key, transfer, fingerprint: fingerprint(body) })
}

fn only_fields(json: &Json, what: &'static str, allowed: &[&str], prefix: &str) -> Result<(), RequestError> {
    let Json::Object(members) = json else {
        return Err(RequestError::NotObject(what));
    };
    match members.iter().find(|(k, _)| !allowed.contains(&k.as_str())) {
        Some((k, _)) => Err(RequestError::UnknownField(format!("{prefix}{:?}", clip(k)))),
        None => Ok(()),
    }
}

fn text_field(json: &Json, field: &'static str, limit: usize) -> Result<String, RequestError> {
    match json.get(field) {
        None => Err(RequestError::Missing(field)),
        Some(Json::String(s)) => checked_text(s, field, limit),
        Some(_) => Err(RequestError::WrongType { field, expected: "a string" }),
    }
}

fn checked_text(s: &str, field: &'static str, limit: usize) -> Result<String, RequestError> {
    if s.is_empty() {
        Err(RequestError::Empty(field))
    } else if s.chars().count() > limit {
        Err(RequestError::TooLong { field, limit })
    } else if s.chars().any(char::is_control) {
        Err(RequestError::Control(field))
    } else {
        Ok(s.to_owned())
    }
}

fn acct_field(body: &Json, field: &'static str, name: &str, limit: usize) -> Result<AcctId, RequestError> {
    match body.get(name) {
        None => Err(RequestError::Missing(field)),
        Some(Json::Int(i)) if i.unsigned_abs() <= MAX_EXACT_INT as u64 => Ok(AcctId::Int(*i)),
        Some(Json::Int(_)) => {
            Err(RequestError::WrongType { field, expected: "a string or an integer within ±(2^53 − 1)" })
        }
        Some(Json::String(s)) => checked_text(s, field, limit).map(AcctId::Text),
        Some(_) => Err(RequestError::WrongType { field, expected: "a string or an integer" }),
    }
}

/// The `Idempotency-Key` header, from its values (each field line's bytes):
/// an sf-string (RFC 9651), or, as Stripe's clients send it, a bare value of
/// visible ASCII without quotes (a UUID may start with a digit, which no
/// sf-token does). One value, not empty, at most `limit` characters; an
/// sf-string takes no parameters. A refusal is its reason
/// (`missing_idempotency_key`, `invalid_idempotency_key`) and its detail.
///
/// ```
/// use idem::request::idempotency_key;
/// assert_eq!(idempotency_key([&b"\"k-1\""[..]], 255), Ok("k-1".to_owned()));
/// assert_eq!(idempotency_key([&b"8e03978e-40d5"[..]], 255), Ok("8e03978e-40d5".to_owned()));
/// assert_eq!(idempotency_key([], 255).unwrap_err().0, "missing_idempotency_key");
/// assert_eq!(idempotency_key([&b"\"a\""[..], b"\"b\""], 255).unwrap_err().0, "invalid_idempotency_key");
/// ```
pub fn idempotency_key<'a>(
    values: impl IntoIterator<Item = &'a [u8]>,
    limit: usize,
) -> Result<String, (&'static str, String)> {
    let mut values = values.into_iter();
    let value = match (values.next(), values.next()) {
        (Some(value), None) => value,
        (None, _) => {
            return Err(("missing_idempotency_key", "An Idempotency-Key header is required.".into()));
        }
        _ => return Err(invalid_key("The Idempotency-Key header must appear once.")),
    };
    // what a header value's to_str() takes: visible ASCII, spaces and tabs
    let visible = value.iter().all(|&b| b == b'\t' || (0x20..0x7f).contains(&b));
    let Some(text) = std::str::from_utf8(value).ok().filter(|_| visible).map(str::trim) else {
        return Err(invalid_key("The key must be visible ASCII."));
    };
    let key = match sfv::Parser::new(text).parse::<sfv::Item>() {
        Ok(sfv::Item { bare_item: sfv::BareItem::String(s), params }) if params.is_empty() => {
            s.as_str().to_owned()
        }
        _ if !text.is_empty() && text.bytes().all(|b| (0x21..=0x7e).contains(&b) && b != b'"') => {
            text.to_owned()
        }
        _ => {
            return Err(invalid_key(
                "The key must be an sf-string (\"…\") or a bare value of visible ASCII.",
            ));
        }
    };
    if key.is_empty() {
        return Err(invalid_key("The key must not be empty."));
    }
    if key.chars().count() > limit {
        return Err(invalid_key(&format!("The key must be at most {limit} characters.")));
    }
    Ok(key)
}

fn invalid_key(detail: &str) -> (&'static str, String) {
    ("invalid_idempotency_key", detail.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reason(text: &str) -> String {
        parse(text.as_bytes(), Policy::embedded()).unwrap_err().to_string()
    }

    const OK: &str = r#"{"client_id":"c","endpoint":"/t","idem_key":"k","body":{"src":"A","dst":"B","amount":5,"currency":"KRW"}}"#;

    #[test]
    fn the_key_header_is_one_sf_string_or_one_bare_visible_value() {
        let key = |v: &[u8]| idempotency_key([v], 8);
        assert_eq!(key(b"\t \"a b\" "), Ok("a b".into()), "trimmed, an sf-string may hold a space");
        assert_eq!(key(b"3f-uuid"), Ok("3f-uuid".into()));
        let refused = |v: &[u8]| key(v).unwrap_err().0;
        for bad in
            [&b"caf\xc3\xa9"[..], b"a\x01", b"\"k\";p=1", b"\"\"", b"a b", b"\"123456789\"", b"", b"\"a"]
        {
            assert_eq!(refused(bad), "invalid_idempotency_key", "{}", String::from_utf8_lossy(bad));
        }
        assert_eq!(idempotency_key([&b"12345678"[..]], 8), Ok("12345678".into()), "the limit itself");
    }

    #[test]
    fn a_good_request_parses() {
        let r = parse(OK.as_bytes(), Policy::embedded()).unwrap();
        assert_eq!(r.transfer.amount, 5);
        assert_eq!(r.transfer.src, AcctId::Text("A".into()));
    }

    #[test]
    fn integer_account_ids_stay_integers() {
        let r = parse(OK.replace("\"A\"", "7").as_bytes(), Policy::embedded()).unwrap();
        assert_eq!(r.transfer.src, AcctId::Int(7));
    }

    #[test]
    fn each_malformation_has_its_own_reason() {
        let cases = [
            (OK.replace("5,", "0,"), "amount must be a positive integer"),
            (OK.replace("5,", "-5,"), "amount must be a positive integer"),
            (OK.replace("5,", "1.0,"), "amount must be a positive integer"),
            (OK.replace("5,", "1e3,"), "amount must be a positive integer"),
            (OK.replace("5,", "\"5\","), "amount must be a positive integer"),
            (OK.replace("5,", "9007199254740992,"), "no greater than 9007199254740991"),
            (OK.replace("5,", "99999999999999999999,"), "amount must be a positive integer"),
            (OK.replace("\"B\"", "\"A\""), "src and dst must be different"),
            (OK.replace("KRW", "USD"), "unsupported currency \"USD\""),
            (OK.replace("\"k\"", "\"\""), "idem_key must not be empty"),
            (OK.replace("\"k\"", &format!("\"{}\"", "k".repeat(256))), "idem_key must be at most 255"),
            (OK.replace("\"k\"", "7"), "idem_key must be a string"),
            (OK.replace("\"k\"", "\"k\\u0000\""), "idem_key must not contain control characters"),
            (OK.replace("\"c\"", "\"c\\n\""), "client_id must not contain control characters"),
            (OK.replace("\"A\"", "\"A\\u007f\""), "body.src must not contain control characters"),
            (OK.replace("\"client_id\":\"c\",", ""), "missing field client_id"),
            (OK.replace("\"src\":\"A\",", ""), "missing field body.src"),
            (OK.replace(",\"currency\":\"KRW\"", ""), "missing field body.currency"),
            (OK.replace("\"src\":\"A\"", "\"src\":true"), "body.src must be a string or an integer"),
            (OK.replace("\"amount\":5", "\"amount\":5,\"memo\":1"), "unknown field body.\"memo\""),
            (OK.replace("\"amount\":5", "\"amount\":1,\"amount\":5"), "duplicate member \"amount\""),
            (OK.replace("{\"src", "[{\"src").replace("}}", "}]}"), "body must be a JSON object"),
            ("[]".into(), "request must be a JSON object"),
            ("{".into(), "not valid JSON"),
        ];
        for (text, want) in cases {
            let got = reason(&text);
            assert!(got.starts_with("invalid_request: ") && got.contains(want), "{text}\n => {got}");
        }
    }

    #[test]
    fn a_payout_file_and_a_payout_body_have_one_fingerprint_and_the_file_names_its_fields() {
        const PAYOUT: &str = r#"{"src":"A","beneficiary":"bob","amount":5,"currency":"KRW"}"#;
        let file = format!(r#"{{"client_id":"c","endpoint":"/v1/payouts","idem_key":"k","body":{PAYOUT}}}"#);
        let from_file = parse_payout_file(file.as_bytes(), Policy::embedded()).unwrap();
        let key = from_file.key.clone();
        let from_http = parse_payout(key, PAYOUT.as_bytes(), Policy::embedded()).unwrap();
        assert_eq!(from_file, from_http);
        let reason =
            |text: String| parse_payout_file(text.as_bytes(), Policy::embedded()).unwrap_err().to_string();
        let cases = [
            (file.replace("\"bob\"", "\"\""), "body.beneficiary must not be empty"),
            (file.replace("\"bob\"", "7"), "body.beneficiary must be a string"),
            (file.replace("\"beneficiary\":\"bob\",", ""), "missing field body.beneficiary"),
            (file.replace("\"beneficiary\"", "\"dst\""), "unknown field body.\"dst\""),
            (file.replace("5,", "0,"), "amount must be a positive integer"),
            (file.replace("KRW", "USD"), "unsupported currency \"USD\""),
        ];
        for (text, want) in cases {
            let got = reason(text.clone());
            assert!(got.starts_with("invalid_request: ") && got.contains(want), "{text}\n => {got}");
        }
    }

    #[test]
    fn a_request_of_exactly_the_size_limit_is_accepted() {
        let limit = Policy::embedded().max_request_bytes;
        let exact = format!("{OK}{}", " ".repeat(limit - OK.len()));
        assert_eq!(exact.len(), limit);
        assert!(parse(exact.as_bytes(), Policy::embedded()).is_ok());
        assert!(parse(format!("{exact} ").as_bytes(), Policy::embedded()).is_err());
    }

    #[test]
    fn invalid_utf8_and_oversize_are_rejected_before_parsing() {
        let mut bad = OK.as_bytes().to_vec();
        bad[20] = 0xff;
        assert_eq!(parse(&bad, Policy::embedded()).unwrap_err(), RequestError::NotUtf8);
        let big = vec![b' '; Policy::embedded().max_request_bytes + 1];
        assert!(matches!(parse(&big, Policy::embedded()), Err(RequestError::TooLarge { .. })));
    }
}
