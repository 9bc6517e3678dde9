//! What `/metrics` exposes, in the Prometheus text format: requests by
//! route and status, replays, requests in flight, and a latency histogram.

use crate::clock::Timestamp;
use crate::store::{ClientEventStats, PayoutStat, PayoutState};
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the latency buckets, in seconds.
const BUCKETS: [f64; 12] = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5];

#[derive(Default)]
pub struct Metrics {
    /// `(route, status)` → count.
    requests: Mutex<BTreeMap<(&'static str, u16), u64>>,
    replays: AtomicU64,
    in_flight: AtomicI64,
    accept_errors: AtomicU64,
    /// Provider events that moved no money and wait for a person.
    events_for_a_person: AtomicU64,
    /// One count per bucket, then the overflow (+Inf).
    latency: [AtomicU64; BUCKETS.len() + 1],
    latency_sum_micros: AtomicU64,
    /// The payouts as the reconciler last counted them, and when.
    payouts: Mutex<Option<(Timestamp, Vec<PayoutStat>)>>,
    /// The client events as the sender last counted them, and when.
    client_events: Mutex<Option<(Timestamp, ClientEventStats, usize)>>,
    /// Deliveries of client events that got no 2xx.
    deliveries_failed: AtomicU64,
    /// PostgreSQL batches were asked for and are off (the log says why).
    pg_batches_off: std::sync::atomic::AtomicBool,
}

impl Metrics {
    pub fn in_flight(&self) -> i64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    pub fn accept_failed(&self) {
        self.accept_errors.fetch_add(1, Ordering::Relaxed);
    }

    /// A provider event recorded as needing a person (not a duplicate).
    pub fn event_for_a_person(&self) {
        self.events_for_a_person.fetch_add(1, Ordering::Relaxed);
    }

    /// PostgreSQL's batches were asked for and could not be had.
    pub fn batches_off(&self) {
        self.pg_batches_off.store(true, Ordering::Relaxed);
    }

    pub fn started(&self) {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
    }

    /// A request answered (`route = "malformed"`: one hyper answered itself,
    /// which was never started).
    pub fn finished(&self, route: &'static str, status: u16, replay: bool, took: Duration) {
        if route != "malformed" {
            self.in_flight.fetch_sub(1, Ordering::Relaxed);
        }
        if let Ok(mut requests) = self.requests.lock() {
            *requests.entry((route, status)).or_insert(0) += 1;
        }
        if replay {
            self.replays.fetch_add(1, Ordering::Relaxed);
        }
        let seconds = took.as_secs_f64();
        let bucket = BUCKETS.iter().position(|b| seconds <= *b).unwrap_or(BUCKETS.len());
        self.latency[bucket].fetch_add(1, Ordering::Relaxed);
        self.latency_sum_micros.fetch_add(took.as_micros() as u64, Ordering::Relaxed);
    }

    /// The payouts per state, counted at `at` (by the reconciler, after each run).
    pub fn payouts_counted(&self, at: Timestamp, stats: Vec<PayoutStat>) {
        if let Ok(mut payouts) = self.payouts.lock() {
            *payouts = Some((at, stats));
        }
    }

    /// The client events, counted at `at` (by the sender, after each round),
    /// and the round's deliveries that got no 2xx.
    /// The client events as the sender counted them at `at`, its failed
    /// deliveries since, and the endpoints disabled for a person.
    pub fn client_events_counted(
        &self,
        at: Timestamp,
        stats: ClientEventStats,
        failed: u64,
        disabled: usize,
    ) {
        self.deliveries_failed.fetch_add(failed, Ordering::Relaxed);
        if let Ok(mut counted) = self.client_events.lock() {
            *counted = Some((at, stats, disabled));
        }
    }

    fn render_client_events(&self, out: &mut String) {
        let Ok(counted) = self.client_events.lock() else { return };
        let Some((at, stats, disabled)) = counted.as_ref() else { return };
        let age = stats.oldest_pending.map_or(0, |t| at.seconds_since(t).max(0));
        let _ = write!(
            out,
            "# HELP idem_client_events Payout events for clients not delivered: pending, or failed (for a person).\n\
             # TYPE idem_client_events gauge\n\
             idem_client_events{{delivery=\"pending\"}} {}\nidem_client_events{{delivery=\"failed\"}} {}\n\
             # HELP idem_client_event_oldest_pending_seconds Age of the oldest pending client event (0: none).\n\
             # TYPE idem_client_event_oldest_pending_seconds gauge\n\
             idem_client_event_oldest_pending_seconds {age}\n\
             # HELP idem_client_event_deliveries_failed_total Deliveries of client events that got no 2xx.\n\
             # TYPE idem_client_event_deliveries_failed_total counter\n\
             idem_client_event_deliveries_failed_total {}\n\
             # HELP idem_client_endpoints_disabled Client endpoints disabled until a person enables them (a 410, or \
             failing past --client-events-disable-after); their events wait, pending.\n\
             # TYPE idem_client_endpoints_disabled gauge\nidem_client_endpoints_disabled {disabled}\n",
            stats.pending,
            stats.failed,
            self.deliveries_failed.load(Ordering::Relaxed)
        );
    }

    fn render_payouts(&self, out: &mut String) {
        let Ok(payouts) = self.payouts.lock() else { return };
        let Some((at, stats)) = payouts.as_ref() else { return };
        let of = |state: PayoutState| stats.iter().find(|s| s.state == state);
        out.push_str("# HELP idem_payouts Payouts per state, as the reconciler last counted them.\n# TYPE idem_payouts gauge\n");
        for state in PayoutState::ALL {
            let _ = writeln!(
                out,
                "idem_payouts{{state=\"{}\"}} {}",
                state.name(),
                of(state).map_or(0, |s| s.count)
            );
        }
        out.push_str(
            "# HELP idem_payout_oldest_age_seconds Age of the oldest payout still waiting, per state (0: none).\n\
             # TYPE idem_payout_oldest_age_seconds gauge\n",
        );
        for state in [PayoutState::InProgress, PayoutState::Unknown, PayoutState::NeedsAttention] {
            let age = of(state).map_or(0, |s| at.seconds_since(s.oldest).max(0));
            let _ = writeln!(out, "idem_payout_oldest_age_seconds{{state=\"{}\"}} {age}", state.name());
        }
        out.push_str(
            "# HELP idem_payout_sends Sends to the gateway of the payouts in a state: in all, and the most of one.\n\
             # TYPE idem_payout_sends gauge\n",
        );
        for s in stats {
            let _ = writeln!(out, "idem_payout_sends{{state=\"{}\",of=\"all\"}} {}", s.state.name(), s.sends);
            let _ = writeln!(
                out,
                "idem_payout_sends{{state=\"{}\",of=\"most\"}} {}",
                s.state.name(),
                s.most_sends
            );
        }
    }

    /// The Prometheus text exposition; `log_dropped` is the log's count of
    /// lines dropped.
    pub fn render(&self, log_dropped: u64, batches: Option<super::executor::Batches>) -> String {
        let mut out = String::new();
        out.push_str("# HELP idem_requests_total HTTP requests answered, by route and status.\n");
        out.push_str("# TYPE idem_requests_total counter\n");
        if let Ok(requests) = self.requests.lock() {
            for ((route, status), n) in requests.iter() {
                let _ = writeln!(out, "idem_requests_total{{route=\"{route}\",status=\"{status}\"}} {n}");
            }
        }
        let _ = write!(
            out,
            "# HELP idem_replays_total Answers replayed from a completed key.\n# TYPE idem_replays_total counter\n\
             idem_replays_total {}\n\
             # HELP idem_requests_in_flight Requests being answered now.\n# TYPE idem_requests_in_flight gauge\n\
             idem_requests_in_flight {}\n",
            self.replays.load(Ordering::Relaxed),
            self.in_flight.load(Ordering::Relaxed),
        );
        let _ = write!(
            out,
            "# HELP idem_log_lines_dropped_total Log lines dropped because the log's sink did not keep up.\n\
             # TYPE idem_log_lines_dropped_total counter\nidem_log_lines_dropped_total {log_dropped}\n\
             # HELP idem_accept_errors_total Connections the listener failed to accept (e.g. descriptors exhausted).\n\
             # TYPE idem_accept_errors_total counter\nidem_accept_errors_total {}\n\
             # HELP idem_gateway_events_for_a_person_total Provider events that moved no money and wait for a \
             person (idem payouts strays): no payout of idem's, another amount, paid after released.\n\
             # TYPE idem_gateway_events_for_a_person_total counter\nidem_gateway_events_for_a_person_total {}\n",
            self.accept_errors.load(Ordering::Relaxed),
            self.events_for_a_person.load(Ordering::Relaxed),
        );
        out.push_str(
            "# HELP idem_request_duration_seconds Time to answer a request.\n\
             # TYPE idem_request_duration_seconds histogram\n",
        );
        let mut cumulative = 0;
        for (i, count) in self.latency.iter().enumerate() {
            cumulative += count.load(Ordering::Relaxed);
            let le = BUCKETS.get(i).map_or("+Inf".to_string(), |b| b.to_string());
            let _ = writeln!(out, "idem_request_duration_seconds_bucket{{le=\"{le}\"}} {cumulative}");
        }
        let sum = self.latency_sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = write!(
            out,
            "idem_request_duration_seconds_sum {sum}\nidem_request_duration_seconds_count {cumulative}\n"
        );
        self.render_payouts(&mut out);
        self.render_client_events(&mut out);
        render_tls(&mut out);
        if let Some(batches) = batches {
            render_batches(&mut out, batches);
        }
        if self.pg_batches_off.load(Ordering::Relaxed) {
            out.push_str(
                "# HELP idem_pg_batches_off PostgreSQL batches were asked for and are off (the log line pg_batches_off \
                 says why: a batch function not idem's, a role that may not create one).\n\
                 # TYPE idem_pg_batches_off gauge\nidem_pg_batches_off 1\n",
            );
        }
        out
    }
}

/// PostgreSQL's batches (`--pg-batch-max` above 1): claims' and executions'
/// `[batches, requests carried, microseconds out]`. Carried over batches is
/// the mean batch; seconds out over the run's seconds, the lanes' use.
/// Calls out (gateway, client events) whose TLS handshake failed.
fn render_tls(out: &mut String) {
    let _ = write!(
        out,
        "# HELP idem_outbound_tls_failures_total Calls out whose TLS handshake failed (a certificate not trusted, \
         a name that does not match); each is a log line outbound_tls_failed.\n\
         # TYPE idem_outbound_tls_failures_total counter\nidem_outbound_tls_failures_total {}\n",
        crate::https::tls_failures()
    );
}

fn render_batches(out: &mut String, batches: super::executor::Batches) {
    let [claims, executions] = batches.sizes;
    let _ = write!(
        out,
        "# HELP idem_pg_batches_total Batches sent to PostgreSQL, by kind.\n\
         # TYPE idem_pg_batches_total counter\n\
         idem_pg_batches_total{{kind=\"claim\"}} {}\n\
         idem_pg_batches_total{{kind=\"execution\"}} {}\n\
         # HELP idem_pg_batched_total Requests' statements the batches carried, by kind.\n\
         # TYPE idem_pg_batched_total counter\n\
         idem_pg_batched_total{{kind=\"claim\"}} {}\n\
         idem_pg_batched_total{{kind=\"execution\"}} {}\n\
         # HELP idem_pg_batch_seconds_total Time the batches were out (a connection, the round trip, the \
         database's work), summed over the lanes.\n\
         # TYPE idem_pg_batch_seconds_total counter\n\
         idem_pg_batch_seconds_total{{kind=\"claim\"}} {}\n\
         idem_pg_batch_seconds_total{{kind=\"execution\"}} {}\n",
        claims[0],
        executions[0],
        claims[1],
        executions[1],
        claims[2] as f64 / 1e6,
        executions[2] as f64 / 1e6,
    );
    let _ = write!(
        out,
        "# HELP idem_pg_batch_function_refused_total Pool connections that found a batch function not idem's at \
         its name: never called, their requests sent alone.\n\
         # TYPE idem_pg_batch_function_refused_total counter\nidem_pg_batch_function_refused_total {}\n",
        batches.refused
    );
}
