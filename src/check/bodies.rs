//! The bodies a check sends under a key it used: the same request spelled
//! otherwise (members reordered and re-spaced at every depth), and each
//! other request one change away (every leaf in turn, the accounts swapped).

use super::http::Target;
use serde_json::{Value, json};

/// The same JSON, its members in reverse order and re-spaced at every
/// depth: a fingerprint that sorts only the top level, or reads the bytes,
/// sees another body.
pub(super) fn respaced(body: &str) -> String {
    fn write(v: &Value, depth: usize, out: &mut String) {
        let pad = "  ".repeat(depth + 1);
        match v {
            Value::Object(members) => {
                out.push_str("{ ");
                for (n, (k, v)) in members.iter().rev().enumerate() {
                    if n > 0 {
                        out.push_str(&format!(",\n{pad}"));
                    }
                    out.push_str(&format!("{} : ", json!(k)));
                    write(v, depth + 1, out);
                }
                out.push_str(" }");
            }
            Value::Array(items) => {
                out.push_str("[ ");
                for (n, item) in items.iter().enumerate() {
                    if n > 0 {
                        out.push_str(" , ");
                    }
                    write(item, depth + 1, out);
                }
                out.push_str(" ]");
            }
            leaf => out.push_str(&leaf.to_string()),
        }
    }
    let Ok(value) = serde_json::from_str::<Value>(body) else { return body.to_owned() };
    let mut out = String::new();
    write(&value, 0, &mut out);
    out
}

/// Each body that differs from `body` in one leaf (a number one more, a
/// string with `-x` added, a boolean negated), named by its JSON pointer;
/// and, when it moves money, the one with source and destination swapped.
pub(super) fn others(target: &Target, body: &str) -> Vec<(String, String)> {
    fn leaves(v: &Value, at: String, out: &mut Vec<String>) {
        match v {
            Value::Object(m) => m.iter().for_each(|(k, v)| {
                leaves(v, format!("{at}/{}", k.replace('~', "~0").replace('/', "~1")), out)
            }),
            Value::Array(items) => {
                items.iter().enumerate().for_each(|(i, v)| leaves(v, format!("{at}/{i}"), out))
            }
            Value::Null => {}
            _ => out.push(at),
        }
    }
    let Ok(value) = serde_json::from_str::<Value>(body) else { return Vec::new() };
    let mut pointers = Vec::new();
    leaves(&value, String::new(), &mut pointers);
    let mut bodies: Vec<(String, String)> = pointers
        .into_iter()
        .filter_map(|at| {
            let mut other = value.clone();
            let leaf = other.pointer_mut(&at)?;
            *leaf = match leaf {
                Value::Number(n) => n
                    .as_i64()
                    .map_or_else(|| json!(n.as_f64().unwrap_or(0.0) + 1.0), |i| json!(i.saturating_add(1))),
                Value::String(s) => json!(format!("{s}-x")),
                Value::Bool(b) => json!(!*b),
                _ => return None,
            };
            Some((at, other.to_string()))
        })
        .collect();
    if target.money() {
        bodies.push(("source and destination swapped".into(), target.body(&target.dst, &target.src, 5)));
    }
    bodies
}
