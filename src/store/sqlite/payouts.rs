//! The payout tables on SQLite: their rows, and the payout half of a
//! transaction.

use super::*;
use crate::store::{ClientEvent, ClientEventStats, ClientEventText, Delivery, PayoutTx};

/// The payout tables in SQLite's words (created on first use, by payouts
/// only, so a database that never pays out holds exactly the lab's tables): `src` keeps the account id's own
/// type (an integer or a text, as `account` does), an amount must be an integer.
fn payout_schema() -> String {
    crate::store::payout_schema()
        .replace("{id}", "INTEGER")
        .replace("{src}", "")
        .replace("{amount}", "typeof(amount) = 'integer'")
        .replace("{time}", "text")
}

const PAYOUT_COLUMNS: &str =
    "payout_id, client_id, endpoint, idem_key, fingerprint, src, beneficiary, amount,
    currency, downstream_key, state, holder, lease_until, created_at, updated_at, note, status,
    sends, attempts, provider_id";

const EVENT_COLUMNS: &str = "payout_id, at, actor, was, now, why";

fn payout_event(r: &Row) -> rusqlite::Result<Result<PayoutEvent, StoreError>> {
    let (at, was, now): (String, String, String) = (r.get(1)?, r.get(3)?, r.get(4)?);
    Ok((|| {
        Ok(PayoutEvent {
            payout_id: r.get(0).map_err(backend)?,
            at: Timestamp::parse(&at)
                .map_err(|e| StoreError::Backend(format!("corrupt payout event: {e}").into()))?,
            actor: r.get(2).map_err(backend)?,
            was: PayoutState::parse(&was)?,
            now: PayoutState::parse(&now)?,
            why: r.get(5).map_err(backend)?,
        })
    })())
}

fn payout_row(r: &Row) -> rusqlite::Result<Result<PayoutRow, StoreError>> {
    let src = match acct_id(r.get(5)?) {
        Ok(src) => src,
        Err(e) => return Ok(Err(e)),
    };
    let text = PayoutText {
        id: r.get(0)?,
        key: ScopedKey { client_id: r.get(1)?, endpoint: r.get(2)?, idem_key: r.get(3)? },
        fingerprint: r.get(4)?,
        src,
        beneficiary: r.get(6)?,
        amount: r.get(7)?,
        currency: r.get(8)?,
        downstream_key: r.get(9)?,
        state: r.get(10)?,
        holder: r.get(11)?,
        lease_until: r.get(12)?,
        created_at: r.get(13)?,
        updated_at: r.get(14)?,
        note: r.get(15)?,
        status: r.get(16)?,
        sends: r.get(17)?,
        attempts: r.get(18)?,
        provider_id: r.get(19)?,
    };
    Ok(text.decode())
}

impl SqliteTx<'_> {
    fn client_events_where(
        &self,
        condition: &str,
        params: &[&dyn ToSql],
    ) -> Result<Vec<ClientEvent>, StoreError> {
        let sql = format!("SELECT {} WHERE {condition}", crate::store::CLIENT_EVENT_COLUMNS);
        let mut stmt = self.conn.prepare_cached(&sql).map_err(backend)?;
        let rows: Vec<ClientEventText> = stmt
            .query_map(params, |r| {
                Ok(ClientEventText {
                    event_id: r.get(0)?,
                    client_id: r.get(1)?,
                    payout_id: r.get(2)?,
                    at: r.get(3)?,
                    actor: r.get(4)?,
                    was: r.get(5)?,
                    now: r.get(6)?,
                    why: r.get(7)?,
                    amount: r.get(8)?,
                    currency: r.get(9)?,
                    delivery: r.get(10)?,
                    attempts: r.get(11)?,
                    next_at: r.get(12)?,
                    delivered_at: r.get(13)?,
                })
            })
            .and_then(|rows| rows.collect())
            .map_err(backend)?;
        rows.into_iter().map(ClientEventText::decode).collect()
    }

    fn payouts_where(&self, condition: &str, params: &[&dyn ToSql]) -> Result<Vec<PayoutRow>, StoreError> {
        let sql = format!("SELECT {PAYOUT_COLUMNS} FROM payout WHERE {condition}");
        let mut stmt = self.conn.prepare_cached(&sql).map_err(backend)?;
        let rows: Vec<Result<PayoutRow, StoreError>> =
            stmt.query_map(params, payout_row).and_then(|rows| rows.collect()).map_err(backend)?;
        rows.into_iter().collect()
    }
}

impl PayoutTx for SqliteTx<'_> {
    fn ensure_payouts(&mut self) -> Result<(), StoreError> {
        let table: Option<String> = self
            .conn
            .query_row("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'payout'", [], |r| {
                r.get(0)
            })
            .optional()
            .map_err(backend)?;
        // A first version's table cannot take the new states (its CHECK) or
        // the new columns: rebuilt, rows copied, in this transaction.
        let migrate = table.is_some_and(|sql| !sql.contains("needs_attention"));
        // an audit trail from before clients were told gets the delivery columns
        let events: Option<String> = self
            .conn
            .query_row(
                "SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'payout_event'",
                [],
                |r| r.get(0),
            )
            .optional()
            .map_err(backend)?;
        if events.is_some_and(|sql| !sql.contains("delivery")) {
            for column in crate::store::DELIVERY_COLUMNS {
                let column = column.replace("{time}", "text");
                self.conn
                    .execute_batch(&format!("ALTER TABLE payout_event ADD COLUMN {column}"))
                    .map_err(backend)?;
            }
        }
        let sql = match migrate {
            true => format!(
                "ALTER TABLE payout RENAME TO payout_v1; DROP INDEX IF EXISTS payout_key; DROP INDEX IF EXISTS payout_open;
                 {schema}
                 INSERT INTO payout ({PAYOUT_V1_COLUMNS}) SELECT {PAYOUT_V1_COLUMNS} FROM payout_v1;
                 DROP TABLE payout_v1;",
                schema = payout_schema()
            ),
            false => payout_schema(),
        };
        self.conn.execute_batch(&sql).map_err(backend)
    }

    fn insert_payout(&mut self, p: &PayoutRow) -> Result<i64, StoreError> {
        self.conn
            .prepare_cached(
                "INSERT INTO payout (client_id, endpoint, idem_key, fingerprint, src, beneficiary, amount, currency,
                                     downstream_key, state, holder, lease_until, created_at, updated_at, note,
                                     sends, attempts, provider_id)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?13, ?14, ?15, ?16, ?17)
                 RETURNING payout_id",
            )
            .and_then(|mut s| {
                s.query_row(
                    rusqlite::params![
                        p.key.client_id,
                        p.key.endpoint,
                        p.key.idem_key,
                        p.fingerprint,
                        p.src,
                        p.beneficiary,
                        p.amount,
                        p.currency,
                        p.downstream_key,
                        p.state.name(),
                        p.holder,
                        p.lease_until.to_string(),
                        p.created_at.to_string(),
                        p.note,
                        p.sends,
                        p.attempts,
                        p.provider_id,
                    ],
                    |r| r.get(0),
                )
            })
            .map_err(backend)
    }

    fn payout_of(&mut self, key: &ScopedKey) -> Result<Option<PayoutRow>, StoreError> {
        let rows = self.payouts_where(
            "client_id = ?1 AND endpoint = ?2 AND idem_key = ?3 ORDER BY payout_id DESC LIMIT 1",
            &[&key.client_id, &key.endpoint, &key.idem_key],
        )?;
        Ok(rows.into_iter().next())
    }

    fn payout(&mut self, id: i64) -> Result<Option<PayoutRow>, StoreError> {
        Ok(self.payouts_where("payout_id = ?1", &[&id])?.into_iter().next())
    }

    fn update_payout(&mut self, p: &PayoutRow, seen_holder: &str) -> Result<bool, StoreError> {
        self.conn
            .prepare_cached(
                "UPDATE payout SET state = ?2, holder = ?3, lease_until = ?4, updated_at = ?5, note = ?6, status = ?8,
                                  sends = ?9, attempts = ?10, provider_id = ?11
                 WHERE payout_id = ?1 AND holder = ?7",
            )
            .and_then(|mut s| {
                s.execute(rusqlite::params![
                    p.id,
                    p.state.name(),
                    p.holder,
                    p.lease_until.to_string(),
                    p.updated_at.to_string(),
                    p.note,
                    seen_holder,
                    p.status,
                    p.sends,
                    p.attempts,
                    p.provider_id,
                ])
            })
            .map(|n| n == 1)
            .map_err(backend)
    }

    fn payouts_open(&mut self, now: Timestamp, all: bool) -> Result<Vec<PayoutRow>, StoreError> {
        let now = now.to_string();
        self.payouts_where(
            "state IN ('in_progress', 'unknown', 'needs_attention')
             AND (?2 OR (state <> 'needs_attention' AND lease_until <= ?1)) ORDER BY created_at, payout_id",
            &[&now, &all],
        )
    }

    fn payouts_paid_due(
        &mut self,
        checked_before: Timestamp,
        paid_since: Timestamp,
        limit: i64,
    ) -> Result<Vec<PayoutRow>, StoreError> {
        self.payouts_where(
            "state = 'completed' AND lease_until <= ?1 AND updated_at >= ?2 ORDER BY updated_at, payout_id LIMIT ?3",
            &[&checked_before.to_string(), &paid_since.to_string(), &limit],
        )
    }

    fn payout_stats(&mut self) -> Result<Vec<PayoutStat>, StoreError> {
        let mut stmt = self.conn.prepare_cached(crate::store::PAYOUT_STATS).map_err(backend)?;
        let rows: Vec<(String, i64, String, i64, i64)> = stmt
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)))
            .and_then(|rows| rows.collect())
            .map_err(backend)?;
        rows.iter().map(|(s, n, o, sends, most)| crate::store::payout_stat(s, *n, o, *sends, *most)).collect()
    }

    fn gateway_events_for_a_person(
        &mut self,
        limit: i64,
    ) -> Result<Vec<crate::store::GatewayEventRow>, StoreError> {
        let sql = format!("{}?1", crate::store::EVENTS_FOR_A_PERSON);
        let mut stmt = self.conn.prepare_cached(&sql).map_err(backend)?;
        let rows = stmt.query_map([limit], |r| {
            Ok(crate::store::GatewayEventRow {
                event_id: r.get(0)?,
                received_at: r.get(1)?,
                kind: r.get(2)?,
                downstream_key: r.get(3)?,
                outcome: r.get(4)?,
            })
        });
        rows.and_then(|rows| rows.collect()).map_err(backend)
    }

    fn payout_by_downstream_key(&mut self, key: &str) -> Result<Option<PayoutRow>, StoreError> {
        Ok(self.payouts_where("downstream_key = ?1", &[&key])?.into_iter().next())
    }

    fn insert_gateway_event(
        &mut self,
        event_id: &str,
        at: Timestamp,
        kind: &str,
        downstream_key: &str,
        outcome: &str,
    ) -> Result<bool, StoreError> {
        self.conn
            .prepare_cached(
                "INSERT INTO gateway_event (event_id, received_at, kind, downstream_key, outcome)
                 VALUES (?1, ?2, ?3, ?4, ?5) ON CONFLICT (event_id) DO NOTHING",
            )
            .and_then(|mut s| s.execute((event_id, at.to_string(), kind, downstream_key, outcome)))
            .map(|n| n == 1)
            .map_err(backend)
    }

    fn payouts_in(&mut self, state: PayoutState, limit: i64) -> Result<Vec<PayoutRow>, StoreError> {
        self.payouts_where("state = ?1 ORDER BY created_at, payout_id LIMIT ?2", &[&state.name(), &limit])
    }

    fn insert_payout_event(&mut self, e: &PayoutEvent, tell: bool) -> Result<(), StoreError> {
        let at = e.at.to_string();
        let (delivery, next_at) = if tell { ("pending", Some(&at)) } else { ("none", None) };
        self.conn
            .prepare_cached(&format!(
                "INSERT INTO payout_event ({EVENT_COLUMNS}, delivery, next_at) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)"
            ))
            .and_then(|mut s| {
                s.execute(rusqlite::params![e.payout_id, at, e.actor, e.was.name(), e.now.name(), e.why, delivery, next_at])
            })
            .map(|_| ())
            .map_err(backend)
    }

    fn take_client_events(&mut self, take: &crate::store::Take<'_>) -> Result<Vec<ClientEvent>, StoreError> {
        let busy = serde_json::to_string(take.busy).map_err(|e| StoreError::Backend(e.to_string().into()))?;
        let due = self.client_events_where(
            &format!(
                "e.event_id IN ({}) ORDER BY e.next_at, e.event_id LIMIT ?2",
                crate::store::due_by_client("?1", "SELECT value FROM json_each(?3)", "?4")
            ),
            &[&take.now.to_string(), &take.limit, &busy, &take.per_client],
        )?;
        let until = take.until;
        let mut take = self
            .conn
            .prepare_cached("UPDATE payout_event SET next_at = ?2 WHERE event_id = ?1")
            .map_err(backend)?;
        for e in &due {
            take.execute((e.event_id, until.to_string())).map_err(backend)?;
        }
        Ok(due)
    }

    fn record_delivery(
        &mut self,
        id: i64,
        at: Timestamp,
        outcome: &str,
        delivery: Delivery,
        next_at: Option<Timestamp>,
    ) -> Result<(), StoreError> {
        let at = at.to_string();
        let delivered = (delivery == Delivery::Delivered).then_some(&at);
        self.conn
            .prepare_cached(
                "UPDATE payout_event SET delivery = ?2, attempts = attempts + 1, next_at = ?3,
                        delivered_at = COALESCE(?4, delivered_at)
                 WHERE event_id = ?1",
            )
            .and_then(|mut s| s.execute((id, delivery.name(), next_at.map(|t| t.to_string()), delivered)))
            .map_err(backend)?;
        self.conn
            .prepare_cached("INSERT INTO delivery_attempt (event_id, at, outcome) VALUES (?1, ?2, ?3)")
            .and_then(|mut s| s.execute((id, &at, outcome)))
            .map(|_| ())
            .map_err(backend)
    }

    fn client_events(
        &mut self,
        delivery: Option<Delivery>,
        limit: i64,
    ) -> Result<Vec<ClientEvent>, StoreError> {
        match delivery {
            Some(d) => self.client_events_where(
                "e.delivery = ?1 ORDER BY e.event_id DESC LIMIT ?2",
                &[&d.name(), &limit],
            ),
            None => {
                self.client_events_where("e.delivery <> 'none' ORDER BY e.event_id DESC LIMIT ?1", &[&limit])
            }
        }
    }

    fn delivery_log(&mut self, id: i64) -> Result<Vec<(Timestamp, String)>, StoreError> {
        let mut stmt = self
            .conn
            .prepare_cached(
                "SELECT at, outcome FROM delivery_attempt WHERE event_id = ?1 ORDER BY attempt_id",
            )
            .map_err(backend)?;
        let rows: Vec<(String, String)> = stmt
            .query_map([id], |r| Ok((r.get(0)?, r.get(1)?)))
            .and_then(|rows| rows.collect())
            .map_err(backend)?;
        rows.into_iter().map(|(at, outcome)| Ok((crate::store::event_time(&at)?, outcome))).collect()
    }

    fn redeliver(&mut self, id: i64, now: Timestamp) -> Result<bool, StoreError> {
        self.conn
            .prepare_cached("UPDATE payout_event SET delivery = 'pending', next_at = ?2 WHERE event_id = ?1 AND delivery <> 'none'")
            .and_then(|mut s| s.execute((id, now.to_string())))
            .map(|n| n == 1)
            .map_err(backend)
    }

    fn endpoint_tried(
        &mut self,
        client: &str,
        at: Timestamp,
        ok: bool,
    ) -> Result<Option<Timestamp>, StoreError> {
        if ok {
            self.conn.execute(crate::store::DELIVERED, [client]).map_err(backend)?;
            return Ok(None);
        }
        let since: String = self
            .conn
            .query_row(crate::store::FAILED, (client, at.to_string()), |r| r.get(0))
            .map_err(backend)?;
        crate::store::event_time(&since).map(Some)
    }

    fn set_endpoint(&mut self, client: &str, at: Timestamp, why: Option<&str>) -> Result<bool, StoreError> {
        let changed = match why {
            Some(why) => self.conn.execute(crate::store::DISABLE, (client, at.to_string(), why)),
            None => self.conn.execute(crate::store::ENABLE, [client]),
        };
        changed.map(|n| n == 1).map_err(backend)
    }

    fn disabled_endpoints(&mut self) -> Result<Vec<crate::store::Disabled>, StoreError> {
        let mut stmt = self.conn.prepare_cached(crate::store::DISABLED).map_err(backend)?;
        let rows: Vec<(String, String, String)> = stmt
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
            .and_then(Iterator::collect)
            .map_err(backend)?;
        rows.into_iter()
            .map(|(client_id, at, why)| {
                Ok(crate::store::Disabled { client_id, since: crate::store::event_time(&at)?, why })
            })
            .collect()
    }

    fn redeliver_since(&mut self, client: &str, since: Timestamp, now: Timestamp) -> Result<u64, StoreError> {
        self.conn
            .execute(crate::store::REDELIVER_SINCE, (client, since.to_string(), now.to_string()))
            .map(|n| n as u64)
            .map_err(backend)
    }

    fn client_event_stats(&mut self) -> Result<ClientEventStats, StoreError> {
        let (pending, oldest, failed): (i64, Option<String>, i64) = self
            .conn
            .query_row(
                "SELECT COUNT(*) FILTER (WHERE delivery = 'pending'), MIN(at) FILTER (WHERE delivery = 'pending'),
                        COUNT(*) FILTER (WHERE delivery = 'failed')
                 FROM payout_event WHERE delivery IN ('pending', 'failed')",
                [],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .map_err(backend)?;
        let oldest_pending = oldest.map(|t| crate::store::event_time(&t)).transpose()?;
        Ok(ClientEventStats { pending, oldest_pending, failed })
    }

    fn payout_events(&mut self, payout_id: i64) -> Result<Vec<PayoutEvent>, StoreError> {
        let sql = format!("SELECT {EVENT_COLUMNS} FROM payout_event WHERE payout_id = ?1 ORDER BY event_id");
        let mut stmt = self.conn.prepare_cached(&sql).map_err(backend)?;
        let rows: Vec<Result<PayoutEvent, StoreError>> =
            stmt.query_map([payout_id], payout_event).and_then(|rows| rows.collect()).map_err(backend)?;
        rows.into_iter().collect()
    }
}
