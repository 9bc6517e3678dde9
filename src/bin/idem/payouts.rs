//! Payouts as an operator handles them: the gateway they go to, the
//! reconciler (`reconcile`) and the runbook's commands (`payouts`).

use crate::common::{Failure, db, fixed_now, now};
use idem::clock::{self, Timestamp};
use idem::payout;
use idem::policy::Policy;
use idem::store::{self, Db, Usage};
use serde_json::json;

/// Where payouts go.
#[derive(clap::Args, Debug)]
pub struct GatewayArgs {
    /// The gateway's base URL (POST /payouts, GET /payouts/{key}), e.g. one `idem gateway`.
    #[arg(long, value_name = "URL", value_parser = idem::payout::gateway_url)]
    gateway: Option<String>,
    /// Bearer token for the gateway (or IDEM_GATEWAY_TOKEN).
    #[arg(long, env = "IDEM_GATEWAY_TOKEN", hide_env_values = true)]
    gateway_token: Option<String>,
    /// Each call's whole time; past it the payout's outcome is unknown.
    #[arg(long, default_value = "10s", value_parser = clock::parse_positive_duration)]
    gateway_timeout: std::time::Duration,
    /// The gateway's lookups may miss a payout younger than this.
    #[arg(long, default_value = "0ms", value_parser = clock::parse_duration)]
    gateway_lookup_delay: std::time::Duration,
    /// The gateway forgets a key after this (Stripe: 24h; Toss Payments: 15d).
    #[arg(long, default_value = "24h", value_parser = clock::parse_duration)]
    gateway_key_window: std::time::Duration,
    /// A resend stays this far inside the key window (clock skew; the call's
    /// own time is kept on top of it).
    #[arg(long, default_value = "1h", value_parser = clock::parse_duration)]
    gateway_key_margin: std::time::Duration,
    /// At most this many sends of one payout, the first included; then it
    /// waits for a person (`idem payouts`).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(i64).range(1..=1000))]
    gateway_max_sends: i64,
    /// The first wait before an unknown payout is looked at again; it
    /// doubles per look (with full jitter) up to --gateway-backoff-cap.
    #[arg(long, default_value = "30s", value_parser = clock::parse_duration)]
    gateway_backoff: std::time::Duration,
    #[arg(long, default_value = "1h", value_parser = clock::parse_duration)]
    gateway_backoff_cap: std::time::Duration,
    /// A paid payout is looked up again for this long after it was paid, to
    /// learn of money that came back (returned, reversed; bounce-backs come
    /// weeks later, PayPal returns unclaimed payouts after 30 days); 0s: never.
    #[arg(long, default_value = "45d", value_parser = clock::parse_duration)]
    gateway_return_window: std::time::Duration,
    /// How often a paid payout is looked up in its first 3 days; 4 times as
    /// far apart to 14 days, 12 times after.
    #[arg(long, default_value = "6h", value_parser = clock::parse_positive_duration)]
    gateway_return_check: std::time::Duration,
}

impl GatewayArgs {
    pub fn http(self) -> Option<idem::payout::HttpGateway> {
        Some(idem::payout::HttpGateway {
            url: self.gateway?,
            token: self.gateway_token,
            timeout: self.gateway_timeout,
            limits: idem::payout::Limits {
                lookup_delay: self.gateway_lookup_delay,
                key_window: self.gateway_key_window,
                key_margin: self.gateway_key_margin,
                max_sends: self.gateway_max_sends,
                backoff: self.gateway_backoff,
                backoff_cap: self.gateway_backoff_cap,
                return_window: self.gateway_return_window,
                return_check: self.gateway_return_check,
            },
        })
    }
}

/// Settle payouts left unknown (or stranded in progress past their lease) by asking the gateway.
///
/// Each is looked up by its downstream key: paid → completed (the answer
/// the client would have got is stored); failed → the hold goes back to
/// its account; pending → left; not found → sent again with the same key,
/// only after the gateway's lookup delay and inside its key window, else
/// left for a person. One JSON line per decision. Two reconcilers at once
/// never work on one payout. --list prints the payouts not settled.
#[derive(clap::Args, Debug)]
pub struct Reconcile {
    /// SQLite file or PostgreSQL connection string (or IDEM_DB).
    #[arg(long, env = "IDEM_DB", hide_env_values = true, value_parser = db)]
    db: Db,
    #[command(flatten)]
    gateway: GatewayArgs,
    /// Only list the payouts not settled, one JSON line each; change nothing.
    #[arg(long)]
    list: bool,
}

pub fn reconcile(Reconcile { db, gateway, list }: Reconcile, policy: &Policy) -> Result<(), Failure> {
    let mut store = store::open(&db, policy, Usage::LongLived)?;
    payout::prepare(&mut *store, policy)?;
    if list {
        for p in payout::open(&mut *store, now()?, policy)? {
            say!(
                "{}",
                json!({"payout_id": p.id, "downstream_key": p.downstream_key, "state": p.state.name(),
                       "amount": p.amount, "created_at": p.created_at.to_string(), "note": p.note})
            );
        }
        return Ok(());
    }
    let gateway = gateway.http().ok_or_else(|| Failure("give --gateway URL (or --list)".into()))?;
    let fixed = fixed_now()?;
    let clock = move || fixed.unwrap_or_else(Timestamp::now);
    for d in payout::reconcile(&mut *store, &gateway, &clock, policy)? {
        say!("{}", d.to_json());
    }
    Ok(())
}

/// The payouts a person settles: list them, show one with its audit
/// trail, settle one by what the provider says (docs/payouts.md, the runbook).
#[derive(clap::Args, Debug)]
pub struct Payouts {
    #[command(subcommand)]
    action: Action,
}

#[derive(clap::Subcommand, Debug)]
enum Action {
    /// One JSON line per payout: by default every one not settled, oldest first.
    List {
        #[arg(long, env = "IDEM_DB", hide_env_values = true, value_parser = db)]
        db: Db,
        /// Only payouts in this state (in_progress, unknown, needs_attention,
        /// completed, failed, returned).
        #[arg(long, value_parser = payout_state)]
        state: Option<idem::store::PayoutState>,
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(i64).range(1..))]
        limit: i64,
    },
    /// Provider events that moved no money and need a person (for no payout
    /// of ours, or with another amount or currency), one JSON line each.
    Strays {
        #[arg(long, env = "IDEM_DB", hide_env_values = true, value_parser = db)]
        db: Db,
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(i64).range(1..))]
        limit: i64,
    },
    /// One payout and its audit trail (who changed its state, when, why), as JSON.
    Show {
        #[arg(long, env = "IDEM_DB", hide_env_values = true, value_parser = db)]
        db: Db,
        id: i64,
    },
    /// Settle a payout that is not settled by what the provider says: paid
    /// (with the provider's reference) or failed (the hold goes back to its
    /// account). One transaction with an audit row. Refused while a request
    /// or a reconciler holds the payout, and for a settled one (exit 1).
    Settle {
        #[arg(long, env = "IDEM_DB", hide_env_values = true, value_parser = db)]
        db: Db,
        id: i64,
        /// The provider paid it.
        #[arg(long, conflicts_with = "failed", requires = "reference")]
        paid: bool,
        /// The provider's reference for the payment.
        #[arg(long, requires = "paid")]
        reference: Option<String>,
        /// It was not paid and will not be.
        #[arg(long, required_unless_present = "paid")]
        failed: bool,
        /// Why: kept in the audit trail (and, for --failed, the client's reason).
        #[arg(long)]
        reason: String,
        /// Who settles it (default: $USER).
        #[arg(long, env = "USER", default_value = "operator")]
        by: String,
    },
    /// The events that tell clients what became of their payouts, newest
    /// first, one JSON line each: what changed, and how far delivering it went.
    ClientEvents {
        #[arg(long, env = "IDEM_DB", hide_env_values = true, value_parser = db)]
        db: Db,
        /// Only events pending, delivered or failed.
        #[arg(long, value_parser = delivery)]
        delivery: Option<idem::store::Delivery>,
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(i64).range(1..))]
        limit: i64,
    },
    /// One client event's delivery log: each attempt, when, and what came of it.
    Deliveries {
        #[arg(long, env = "IDEM_DB", hide_env_values = true, value_parser = db)]
        db: Db,
        /// The event's number (`seq` in `idem payouts client-events`).
        id: i64,
    },
    /// Deliver a client event again, now (one failed, once the client's
    /// endpoint is back; or one delivered, that the client lost): the same
    /// id, so the client's deduplication holds. Exit 1 if there is no such event.
    ///
    /// With --since T --client C instead: every event of client C whose
    /// change was made at or after T and that was delivered or failed
    /// (after the client's outage), each under its one id.
    Redeliver {
        #[arg(long, env = "IDEM_DB", hide_env_values = true, value_parser = db)]
        db: Db,
        /// The event's number (`seq` in `idem payouts client-events`).
        #[arg(required_unless_present = "since", conflicts_with = "since")]
        id: Option<i64>,
        /// An RFC 3339 instant: the changes made at or after it.
        #[arg(long, requires = "client", value_parser = instant)]
        since: Option<Timestamp>,
        /// With --since: whose events.
        #[arg(long, requires = "since")]
        client: Option<String>,
    },
    /// The client endpoints disabled until a person enables them (a 410
    /// Gone, or every delivery failed past --client-events-disable-after),
    /// one JSON line each: the client, since when, why.
    Endpoints {
        #[arg(long, env = "IDEM_DB", hide_env_values = true, value_parser = db)]
        db: Db,
    },
    /// Enables a client's endpoint again: its pending events go out at once.
    /// Exit 1 if it was not disabled.
    Enable {
        #[arg(long, env = "IDEM_DB", hide_env_values = true, value_parser = db)]
        db: Db,
        client: String,
    },
}

fn instant(text: &str) -> Result<Timestamp, String> {
    Timestamp::parse(text).map_err(|e| e.to_string())
}

/// `idem payouts redeliver`, `endpoints` and `enable`: a person's hand on
/// the client events.
fn endpoints(action: Action, store: &mut dyn idem::store::Store, policy: &Policy) -> Result<(), Failure> {
    match action {
        Action::Redeliver { id: Some(id), .. } => {
            if !payout::redeliver(store, id, now()?, policy)? {
                return Err(Failure(format!("no client event numbered {id}")));
            }
            say!("{}", json!({"seq": id, "delivery": "pending"}));
        }
        Action::Redeliver { since: Some(since), client: Some(client), .. } => {
            let n = payout::redeliver_since(store, &client, since, now()?, policy)?;
            say!("{}", json!({"client_id": client, "since": since.to_string(), "pending": n}));
        }
        Action::Endpoints { .. } => {
            for d in payout::disabled_endpoints(store, policy)? {
                say!(
                    "{}",
                    json!({"client_id": d.client_id, "disabled_at": d.since.to_string(), "reason": d.why})
                );
            }
        }
        Action::Enable { client, .. } => {
            if !payout::enable(store, &client, now()?, policy)? {
                return Err(Failure(format!("client {client:?}'s endpoint is not disabled")));
            }
            say!("{}", json!({"client_id": client, "enabled": true}));
        }
        _ => return Err(Failure("not a client events action".into())),
    }
    Ok(())
}

fn delivery(text: &str) -> Result<idem::store::Delivery, String> {
    idem::store::Delivery::parse(text).map_err(|_| "one of pending, delivered, failed".to_owned())
}

fn payout_state(text: &str) -> Result<idem::store::PayoutState, String> {
    idem::store::PayoutState::parse(text).map_err(|_| {
        let names: Vec<&str> = idem::store::PayoutState::ALL.iter().map(|s| s.name()).collect();
        format!("one of {}", names.join(", "))
    })
}

/// A payout as `idem payouts` prints it: everything a person needs.
fn payout_line(p: &idem::store::PayoutRow) -> serde_json::Value {
    let mut v: serde_json::Value = serde_json::from_str(&idem::payout::to_json(p)).unwrap_or_default();
    v["client_id"] = json!(p.key.client_id);
    v["idem_key"] = json!(p.key.idem_key);
    v["downstream_key"] = json!(p.downstream_key);
    v["sends"] = json!(p.sends);
    v["attempts"] = json!(p.attempts);
    v["updated_at"] = json!(p.updated_at.to_string());
    v["next_look"] = json!(p.lease_until.to_string());
    v["holder"] = json!(p.holder);
    v["note"] = json!(p.note);
    v
}

/// A client event as `idem payouts client-events` prints it: the body its
/// client is sent, then its number (`seq`, which the other commands take)
/// and where its delivery stands.
fn client_event_line(e: &idem::store::ClientEvent) -> serde_json::Value {
    let mut v: serde_json::Value = serde_json::from_str(&payout::event_body(e)).unwrap_or_default();
    v["seq"] = json!(e.event_id);
    v["client_id"] = json!(e.client_id);
    v["delivery"] = json!(e.delivery.name());
    v["attempts"] = json!(e.attempts);
    let next_at = e.next_at.filter(|_| e.delivery == idem::store::Delivery::Pending);
    v["next_at"] = json!(next_at.map(|t| t.to_string()));
    v["delivered_at"] = json!(e.delivered_at.map(|t| t.to_string()));
    v
}

pub fn payouts(Payouts { action }: Payouts, policy: &Policy) -> Result<(), Failure> {
    let open = |db: &Db| -> Result<Box<dyn idem::store::Store>, Failure> {
        let mut store = store::open(db, policy, Usage::LongLived)?;
        payout::prepare(&mut *store, policy)?;
        Ok(store)
    };
    match action {
        Action::List { db, state, limit } => {
            for p in payout::listed(&mut *open(&db)?, state, limit, policy)? {
                say!("{}", payout_line(&p));
            }
        }
        Action::Strays { db, limit } => {
            for e in payout::stray_events(&mut *open(&db)?, limit, policy)? {
                say!(
                    "{}",
                    json!({"event_id": e.event_id, "received_at": e.received_at, "type": e.kind,
                           "downstream_key": e.downstream_key, "outcome": e.outcome})
                );
            }
        }
        Action::Show { db, id } => {
            let Some((p, events)) = payout::events(&mut *open(&db)?, id, policy)? else {
                return Err(Failure(format!("no payout {id}")));
            };
            let mut v = payout_line(&p);
            v["events"] = events
                .iter()
                .map(|e| json!({"at": e.at.to_string(), "actor": e.actor, "was": e.was.name(), "now": e.now.name(), "why": e.why}))
                .collect();
            say!("{v}");
        }
        Action::Settle { db, id, paid, reference, failed: _, reason, by } => {
            let finding = match (paid, reference) {
                (true, Some(reference)) => payout::Finding::Paid { reference },
                _ => payout::Finding::Failed,
            };
            match payout::settle_by_hand(&mut *open(&db)?, id, &finding, &reason, &by, now()?, policy)? {
                Ok(p) => say!("{}", payout_line(&p)),
                Err(why) => return Err(Failure(why)),
            }
        }
        Action::ClientEvents { db, delivery, limit } => {
            for e in payout::client_events(&mut *open(&db)?, delivery, limit, policy)? {
                say!("{}", client_event_line(&e));
            }
        }
        Action::Deliveries { db, id } => {
            for (at, outcome) in payout::delivery_log(&mut *open(&db)?, id, policy)? {
                say!("{}", json!({"seq": id, "at": at.to_string(), "outcome": outcome}));
            }
        }
        Action::Redeliver { ref db, .. } | Action::Endpoints { ref db } | Action::Enable { ref db, .. } => {
            let mut store = open(db)?;
            endpoints(action, &mut *store, policy)?;
        }
    }
    Ok(())
}
