//! RFC 8785 (JCS) canonical JSON and the request fingerprint.
//!
//! Two bodies that differ only in member order, white space or number
//! spelling (`4.50` vs `4.5`) canonicalise to the same bytes, so they get the
//! same fingerprint; any difference in a value changes it. Parsing rejects
//! duplicate member names: `{"amount":1,"amount":100}` has no single meaning,
//! and reading it as either one would let a client smuggle a second amount past
//! the fingerprint.

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};
use sha2::{Digest, Sha256};
use std::collections::HashSet;
use std::fmt;

/// How much of a client's own text a reason echoes back.
const ECHO_CHARS: usize = 64;

/// A client's text as a reason may quote it: at most [`ECHO_CHARS`]
/// characters. It lives here, below the request parser, because the
/// canonical parser quotes a duplicate member's name too.
pub(crate) fn clip(text: &str) -> String {
    match text.char_indices().nth(ECHO_CHARS) {
        Some((cut, _)) => format!("{}…", &text[..cut]),
        None => text.to_owned(),
    }
}

/// A parsed JSON value that keeps what canonicalisation needs and no more.
#[derive(Debug, Clone, PartialEq)]
pub enum Json {
    /// JSON `null`.
    Null,
    /// `true` or `false`.
    Bool(bool),
    /// An integer token that fits `i64`; kept exact for amounts and ids.
    Int(i64),
    /// Every other number (fractions, exponents, integers beyond `i64`).
    Float(f64),
    /// A string, unescaped.
    String(String),
    /// An array, in order.
    Array(Vec<Json>),
    /// Members in document order; names are unique (enforced when parsing).
    Object(Vec<(String, Json)>),
}

impl Json {
    /// Parses JSON text, rejecting duplicate member names and lone surrogates.
    /// Nesting deeper than serde_json's limit (128) is an error, not a crash.
    pub fn parse(text: &str) -> Result<Json, serde_json::Error> {
        serde_json::from_str(text)
    }

    /// The member `name` of an object, if this is one and has it.
    pub fn get(&self, name: &str) -> Option<&Json> {
        match self {
            Json::Object(members) => members.iter().find(|(k, _)| k == name).map(|(_, v)| v),
            _ => None,
        }
    }

    /// RFC 8785 canonical text of this value.
    pub fn canonical(&self) -> String {
        let mut out = String::new();
        write_canonical(self, &mut out);
        out
    }
}

/// SHA-256 (lower-case hex) of the canonical form: the request fingerprint.
pub fn fingerprint(body: &Json) -> String {
    crate::hex::lower(&Sha256::digest(body.canonical().as_bytes()))
}

fn write_canonical(value: &Json, out: &mut String) {
    match value {
        Json::Null => out.push_str("null"),
        Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        // JCS numbers are IEEE doubles; an i64 beyond 2^53 is rounded like any
        // other implementation would round it.
        Json::Int(i) => out.push_str(&es6_number(*i as f64)),
        Json::Float(f) => out.push_str(&es6_number(*f)),
        Json::String(s) => write_string(s, out),
        Json::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(item, out);
            }
            out.push(']');
        }
        Json::Object(members) => {
            let mut sorted: Vec<&(String, Json)> = members.iter().collect();
            // RFC 8785 §3.2.3: order by UTF-16 code units, not by UTF-8 bytes
            // or chars (they disagree above U+FFFF).
            sorted.sort_by(|(a, _), (b, _)| a.encode_utf16().cmp(b.encode_utf16()));
            out.push('{');
            for (i, (name, item)) in sorted.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_string(name, out);
                out.push(':');
                write_canonical(item, out);
            }
            out.push('}');
        }
    }
}

/// JSON string escaping as ECMAScript's JSON.stringify does it, which is what
/// RFC 8785 §3.2.2.2 requires: `"` `\` and control characters only, with the
/// short forms where they exist and lower-case `\u00xx` otherwise.
fn write_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c < ' ' => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// ECMAScript Number::toString for a finite double (RFC 8785 §3.2.2.3).
fn es6_number(x: f64) -> String {
    if x == 0.0 {
        return "0".into(); // also -0
    }
    if x.is_sign_negative() {
        return format!("-{}", es6_number(-x));
    }
    // Rust's `{:e}` gives the fewest digits that round-trip. ECMAScript wants,
    // among digit strings of that length, the one nearest to x (ties to
    // even); Rust's exact formatting rounds that way, so prefer it whenever it
    // still round-trips.
    let shortest = format!("{x:e}");
    let k = shortest.split('e').next().map_or(1, |m| m.chars().filter(char::is_ascii_digit).count());
    let nearest = format!("{x:.*e}", k.saturating_sub(1));
    let sci = if nearest.parse::<f64>() == Ok(x) { nearest } else { shortest };
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let digits: String = mantissa.chars().filter(|c| c.is_ascii_digit()).collect();
    let k = digits.len() as i32;
    let n = exp.parse::<i32>().unwrap_or(0) + 1; // value = 0.digits × 10^n
    if k <= n && n <= 21 {
        format!("{digits}{}", "0".repeat((n - k) as usize))
    } else if 0 < n && n <= 21 {
        format!("{}.{}", &digits[..n as usize], &digits[n as usize..])
    } else if -6 < n && n <= 0 {
        format!("0.{}{digits}", "0".repeat((-n) as usize))
    } else {
        let exponent = n - 1;
        let sign = if exponent.is_negative() { '-' } else { '+' };
        let (first, rest) = digits.split_at(1);
        let dot = if rest.is_empty() { "" } else { "." };
        format!("{first}{dot}{rest}e{sign}{}", exponent.abs())
    }
}

impl<'de> Deserialize<'de> for Json {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(JsonVisitor)
    }
}

struct JsonVisitor;

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = Json;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_unit<E>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }
    fn visit_bool<E>(self, b: bool) -> Result<Json, E> {
        Ok(Json::Bool(b))
    }
    fn visit_i64<E>(self, i: i64) -> Result<Json, E> {
        Ok(Json::Int(i))
    }
    fn visit_u64<E>(self, u: u64) -> Result<Json, E> {
        Ok(i64::try_from(u).map_or(Json::Float(u as f64), Json::Int))
    }
    fn visit_f64<E>(self, f: f64) -> Result<Json, E> {
        Ok(Json::Float(f))
    }
    fn visit_str<E>(self, s: &str) -> Result<Json, E> {
        Ok(Json::String(s.to_owned()))
    }
    fn visit_string<E>(self, s: String) -> Result<Json, E> {
        Ok(Json::String(s))
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Json::Array(items))
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
        let mut members: Vec<(String, Json)> = Vec::new();
        // A set, not a scan of `members`: 7 000 members must cost 7 000 steps.
        let mut names = HashSet::new();
        while let Some(name) = map.next_key::<String>()? {
            if !names.insert(name.clone()) {
                return Err(de::Error::custom(format!("duplicate member {:?}", clip(&name))));
            }
            let value = map.next_value()?;
            members.push((name, value));
        }
        Ok(Json::Object(members))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(text: &str) -> String {
        Json::parse(text).unwrap().canonical()
    }

    #[test]
    fn rfc8785_section_3_2_2_sample() {
        let input = r#"{
          "numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
          "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
          "literals": [null, true, false]
        }"#;
        let expected = "{\"literals\":[null,true,false],\"numbers\":[333333333.3333333,1e+30,4.5,0.002,1e-27],\"string\":\"\u{20ac}$\\u000f\\nA'B\\\"\\\\\\\\\\\"/\"}";
        assert_eq!(canon(input), expected);
    }

    #[test]
    fn the_edges_of_escaping_and_of_plain_notation() {
        // U+001F is the last escaped character; the space is the first plain one
        assert_eq!(canon("\"\\u001f \\u0020!\""), "\"\\u001f  !\"");
        // ECMAScript writes 1e-6 in plain notation and 1e-7 in exponent notation
        assert_eq!(canon("[0.000001, 0.0000001, 1e21, 1e20]"), "[0.000001,1e-7,1e+21,100000000000000000000]");
        // a fraction below 1 keeps its leading zero
        assert_eq!(canon("[0.5, 0.25, 1.5]"), "[0.5,0.25,1.5]");
    }

    #[test]
    fn rfc8785_section_3_2_3_sorts_by_utf16_code_units() {
        let input = r#"{"\u20ac":"Euro Sign","\r":"Carriage Return","\ufb33":"Hebrew Letter Dalet With Dagesh","1":"One","\ud83d\ude00":"Emoji: Grinning Face","\u0080":"Control","\u00f6":"Latin Small Letter O With Diaeresis"}"#;
        let names: Vec<String> = match Json::parse(&canon(input)).unwrap() {
            Json::Object(m) => m.into_iter().map(|(k, _)| k).collect(),
            _ => unreachable!(),
        };
        let expected = ["\r", "1", "\u{80}", "\u{f6}", "\u{20ac}", "\u{1f600}", "\u{fb33}"];
        assert_eq!(names, expected);
        // UTF-8 byte order would put U+1F600 last; JCS puts it before U+FB33.
        let mut by_bytes = expected.to_vec();
        by_bytes.sort();
        assert_ne!(by_bytes, expected);
    }

    #[test]
    fn rfc8785_appendix_b_numbers() {
        let table = [
            (0x0000000000000000_u64, "0"),
            (0x8000000000000000, "0"),
            (0x0000000000000001, "5e-324"),
            (0x8000000000000001, "-5e-324"),
            (0x7fefffffffffffff, "1.7976931348623157e+308"),
            (0xffefffffffffffff, "-1.7976931348623157e+308"),
            (0x4340000000000000, "9007199254740992"),
            (0xc340000000000000, "-9007199254740992"),
            (0x4430000000000000, "295147905179352830000"),
            (0x44b52d02c7e14af5, "9.999999999999997e+22"),
            (0x44b52d02c7e14af6, "1e+23"),
            (0x44b52d02c7e14af7, "1.0000000000000001e+23"),
            (0x444b1ae4d6e2ef4e, "999999999999999700000"),
            (0x444b1ae4d6e2ef4f, "999999999999999900000"),
            (0x444b1ae4d6e2ef50, "1e+21"),
            (0x3eb0c6f7a0b5ed8c, "9.999999999999997e-7"),
            (0x3eb0c6f7a0b5ed8d, "0.000001"),
            (0x41b3de4355555553, "333333333.3333332"),
            (0x41b3de4355555554, "333333333.33333325"),
            (0x41b3de4355555555, "333333333.3333333"),
            (0x41b3de4355555556, "333333333.3333334"),
            (0x41b3de4355555557, "333333333.33333343"),
            (0xbecbf647612f3696, "-0.0000033333333333333333"),
            (0x43143ff3c1cb0959, "1424953923781206.2"),
        ];
        for (bits, expected) in table {
            assert_eq!(es6_number(f64::from_bits(bits)), expected, "{bits:016x}");
        }
    }

    #[test]
    fn order_whitespace_and_number_spelling_do_not_change_the_fingerprint() {
        let a = Json::parse(r#"{"src":"A1","dst":"A2","amount":100,"currency":"KRW"}"#).unwrap();
        let b =
            Json::parse("{ \"currency\" : \"KRW\",\n \"amount\": 1.00e2, \"dst\":\"A2\",\"src\":\"A1\" }")
                .unwrap();
        assert_eq!(fingerprint(&a), fingerprint(&b));
        let c = Json::parse(r#"{"src":"A1","dst":"A2","amount":101,"currency":"KRW"}"#).unwrap();
        assert_ne!(fingerprint(&a), fingerprint(&c));
        assert_eq!(fingerprint(&a).len(), 64);
    }

    #[test]
    fn control_characters_escape_in_lower_case_hex() {
        assert_eq!(canon(r#""\u001F\u007f\u2028""#), "\"\\u001f\u{7f}\u{2028}\"");
    }

    #[test]
    fn duplicate_members_are_rejected_at_any_depth() {
        assert!(Json::parse(r#"{"amount":1,"amount":100}"#).is_err());
        assert!(Json::parse(r#"{"a":{"b":1,"b":1}}"#).is_err());
        assert!(Json::parse(r#"{"a":1,"b":1}"#).is_ok());
    }

    #[test]
    fn deep_nesting_is_an_error_not_a_stack_overflow() {
        let deep = "[".repeat(100_000) + &"]".repeat(100_000);
        assert!(Json::parse(&deep).is_err());
    }
}
