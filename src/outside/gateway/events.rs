//! What the gateway tells afterwards: signed events (`payout.paid`,
//! `payout.failed`, `payout.returned`) pushed to the endpoint registered
//! with `POST /webhook_endpoints`, with their own faults (lost, duplicated,
//! reordered), and paid payouts returned later.

use super::*;

/// `POST /webhook_endpoints` `{"url", "secret"}`: where events go from now on.
pub(super) async fn register(gw: &Gateway, req: Request<Incoming>) -> Reply {
    let Ok(body) = Limited::new(req.into_body(), MAX_BODY).collect().await.map(|b| b.to_bytes()) else {
        return error(StatusCode::BAD_REQUEST, "invalid_request", "body unreadable or over 16 KiB");
    };
    let v: Value = serde_json::from_slice(&body).unwrap_or_default();
    let (Some(url), Some(secret)) = (v["url"].as_str(), v["secret"].as_str()) else {
        return error(StatusCode::BAD_REQUEST, "invalid_request", "give url and secret");
    };
    *gw.webhook.lock().unwrap_or_else(|e| e.into_inner()) =
        Some((url.to_owned(), secret.as_bytes().to_vec()));
    reply(StatusCode::CREATED, &json!({"url": url}))
}

/// Returns a paid payout `return_after` from now: the money comes back.
pub(super) fn return_later(gw: Arc<Gateway>, id: i64) {
    tokio::spawn(async move {
        tokio::time::sleep(gw.options.return_after).await;
        let returned = gw.conn().query_row(
            &format!(
                "UPDATE payout SET status = 'returned', reason = 'bank_return', settled_ms = ?2
                 WHERE id = ?1 AND status = 'paid' RETURNING {COLUMNS}"
            ),
            params![id, now_ms()],
            payout,
        );
        if let Ok(p) = returned {
            emit(&gw, &p);
        }
    });
}

/// Sends the event of `p`'s state to the registered endpoint, signed, after
/// a random delay (so events may arrive out of order); some are lost, some
/// sent twice. A delivery that fails is tried twice more.
pub(super) fn emit(gw: &Arc<Gateway>, p: &Payout) {
    let Some((url, secret)) = gw.webhook.lock().unwrap_or_else(|e| e.into_inner()).clone() else { return };
    if gw.draw(gw.options.faults.event_loss) {
        return;
    }
    let copies = if gw.draw(gw.options.faults.event_dup) { 2 } else { 1 };
    let body = json!({"id": format!("evt_{}_{}", p.id, p.status), "type": format!("payout.{}", p.status), "data": p.json()})
        .to_string();
    for _ in 0..copies {
        let delay = Duration::from_millis(gw.rng.lock().unwrap_or_else(|e| e.into_inner()).below(300));
        let (url, secret, body) = (url.clone(), secret.clone(), body.clone());
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let _ = tokio::task::spawn_blocking(move || deliver(&url, &secret, &body)).await;
        });
    }
}

pub(super) fn deliver(url: &str, secret: &[u8], body: &str) {
    let agent = crate::https::agent(Duration::from_secs(2));
    for attempt in 0..3 {
        let t = crate::clock::unix_now();
        let sent = agent
            .post(format!("{}/v1/gateway-events", url.trim_end_matches('/')))
            .header("Idem-Signature", crate::payout::sign(secret, body.as_bytes(), t))
            .header("Content-Type", "application/json")
            .send(body);
        if sent.is_ok_and(|r| r.status().is_success()) {
            return;
        }
        std::thread::sleep(Duration::from_millis(200 * (attempt + 1)));
    }
}
