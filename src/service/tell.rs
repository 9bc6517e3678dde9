//! Telling clients what became of their payouts, from the service: the
//! file that says where each client's events go, and the sender that runs
//! beside the reconciler (`crate::payout::deliver`, one round a second).

use super::{ServeError, http::App, parse_pairs};
use crate::payout::{Hook, Schedule, Sender};
use crate::policy::Policy;
use crate::store::Store;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// A client's entry in the file.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    url: String,
    secret: String,
    /// While a rotation lasts: the secret before `secret`, signed with too.
    #[serde(default)]
    previous_secret: Option<String>,
}

/// The shortest and longest secret, in bytes after `whsec_` (the Standard
/// Webhooks specification's bounds).
const SECRET_BYTES: std::ops::RangeInclusive<usize> = super::MIN_EVENTS_SECRET..=super::MAX_EVENTS_KEY;

/// Reads the client events file: a JSON object mapping each client id to
/// `{"url": …, "secret": "whsec_…"}`, and while a rotation lasts
/// `"previous_secret": "whsec_…"` (each event is then signed with both).
/// Refused whole, naming the client, for
/// a URL that is not http(s) with a host, a secret that is not `whsec_` and
/// base64 of 24 to 64 bytes (an empty or short one lets anyone forge what
/// the client acts on), or a client listed twice.
pub fn load_hooks(path: &Path) -> Result<HashMap<String, Hook>, ServeError> {
    let file = path.display();
    let text = std::fs::read_to_string(path)
        .map_err(|e| ServeError::Other(format!("cannot read the client events file {file}: {e}")))?;
    let entries = parse_pairs::<Entry>(&text).map_err(|e| {
        ServeError::Other(format!("{file}: not a JSON object of client id → {{\"url\", \"secret\"}} ({e})"))
    })?;
    let mut hooks = HashMap::new();
    for (client, entry) in entries {
        let bad = |why: String| ServeError::Other(format!("{file}: client {client:?}: {why}"));
        let url = crate::payout::gateway_url(&entry.url).map_err(bad)?;
        for secret in std::iter::once(&entry.secret).chain(&entry.previous_secret) {
            let key = crate::payout::whsec_key(secret.as_bytes());
            if !key.is_some_and(|key| SECRET_BYTES.contains(&key.len())) {
                return Err(bad("a secret must be whsec_ and the base64 of 24 to 64 random bytes".into()));
            }
        }
        // kept as given: signing reads the key after whsec_, as receivers do
        let hook = Hook {
            url,
            secret: entry.secret.into_bytes(),
            previous: entry.previous_secret.map(String::into_bytes),
        };
        if hooks.insert(client.clone(), hook).is_some() {
            return Err(bad("listed twice".into()));
        }
    }
    Ok(hooks)
}

/// How long one delivery may take, connection to answer (Standard
/// Webhooks recommends 15 to 30 s; Svix waits 15 s).
const DELIVERY_TIMEOUT: Duration = Duration::from_secs(15);

/// The sender of `hooks`' events, retrying on `schedule`, to the addresses
/// `reach` allows.
pub(super) fn sender(hooks: HashMap<String, Hook>, schedule: Schedule, reach: crate::https::Reach) -> Sender {
    Sender::new(hooks, schedule, Arc::new(crate::payout::post_http(DELIVERY_TIMEOUT, reach)))
}

/// `sender`, on a connection of its own, a round every `every` (or as soon
/// as a client's lane finishes): a log line per delivery, the counts in
/// `/metrics` after each round.
pub(super) fn tell_in_background(
    mut store: Box<dyn Store + Send>,
    sender: Sender,
    every: Duration,
    policy: &'static Policy,
    clock: super::executor::Clock,
    app: Arc<App>,
) -> std::io::Result<()> {
    std::thread::Builder::new().name("idem-tell".into()).spawn(move || {
        loop {
            let now = clock();
            let unix = crate::clock::unix_now();
            let line = |fields| super::log_line(&app, &clock, "client_event", fields);
            let mut failed = 0;
            match sender.round(&mut *store, now, unix, policy) {
                Ok(told) => {
                    for t in &told {
                        failed += u64::from(t.delivery != crate::store::Delivery::Delivered);
                        line(serde_json::json!({
                            "id": t.id, "seq": t.event_id, "client_id": t.client_id,
                            "delivery": t.delivery.name(), "attempts": t.attempts, "outcome": t.outcome,
                        }));
                        if let Some(why) = &t.disabled {
                            let fields = serde_json::json!({"client_id": t.client_id, "reason": why});
                            super::log_line(&app, &clock, "client_endpoint_disabled", fields);
                        }
                    }
                }
                Err(e) => line(serde_json::json!({"error": e.to_string()})),
            }
            if let Ok((stats, disabled)) =
                crate::store::atomically(&mut *store, crate::store::Durability::Lazy, policy, |tx| {
                    Ok(crate::store::End::Rollback((
                        tx.client_event_stats()?,
                        tx.disabled_endpoints()?.len(),
                    )))
                })
            {
                app.metrics.client_events_counted(now, stats, failed, disabled);
            }
            sender.wait(every);
        }
    })?;
    Ok(())
}
