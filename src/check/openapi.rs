//! Every status a service answers is in its OpenAPI document, when it
//! publishes one (the profile's `openapi_path`): a client generated from
//! the document handles only what it lists, so a status it does not list is
//! an answer that client cannot read.

use super::http::Target;
use super::{CheckError, Trace, history};
use serde_json::Value;

/// Judged last: every method, path and status answered before it.
pub(super) fn documented(target: &Target, t: &mut Trace) -> Result<(), CheckError> {
    let Some(at) = &target.profile.openapi_path else {
        t.skip("the profile declares no openapi_path (where the service publishes its OpenAPI document)");
        return Ok(());
    };
    let answered = history::answered();
    let doc = target.get(t, at, &target.tokens[0])?;
    let paths = doc.json().get("paths").cloned().unwrap_or(Value::Null);
    if doc.status != 200 || !paths.is_object() {
        t.expect(false, || format!("GET {at}: {}, not an OpenAPI document with paths", doc.short()));
        return Ok(());
    }
    t.step(format!("{} methods, paths and statuses answered before, each looked up in {at}", answered.len()));
    for (method, path, status) in answered {
        let path = path.split('?').next().unwrap_or_default();
        match responses(&paths, &method, path) {
            None => t.expect(false, || {
                format!("{method} {path} answered {status}: the document has no such operation")
            }),
            Some(listed) => t.expect(lists(listed, status), || {
                let keys: Vec<&String> = listed.as_object().map(|o| o.keys().collect()).unwrap_or_default();
                format!("{method} {path} answered {status}, which its operation does not list ({keys:?})")
            }),
        };
    }
    Ok(())
}

/// The responses of the operation `method` at `path`, a path template of
/// the document matching it (`{name}` stands for one segment); an exact
/// path wins over a template.
fn responses<'a>(paths: &'a Value, method: &str, path: &str) -> Option<&'a Value> {
    let segments: Vec<&str> = path.split('/').collect();
    let matches = |template: &str| {
        let parts: Vec<&str> = template.split('/').collect();
        parts.len() == segments.len()
            && parts.iter().zip(&segments).all(|(p, s)| p == s || (p.starts_with('{') && p.ends_with('}')))
    };
    let item = paths.get(path).or_else(|| {
        paths.as_object()?.iter().find(|(template, _)| matches(template)).map(|(_, item)| item)
    })?;
    item.get(method.to_ascii_lowercase())?.get("responses")
}

/// Whether `responses` lists `status`: by itself, by its class (`4XX`), or
/// by `default`.
fn lists(responses: &Value, status: u16) -> bool {
    let class = format!("{}XX", status / 100);
    [status.to_string(), class.clone(), class.to_ascii_lowercase(), "default".into()]
        .iter()
        .any(|k| responses.get(k).is_some())
}
