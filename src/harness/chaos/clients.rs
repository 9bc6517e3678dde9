//! The clients of a chaos day: each sends its own intents, one after the
//! other, through the retrying client and the fault proxies, and keeps what
//! became of each.

use super::{ACCOUNTS, Config};
use crate::client::{self, Endpoint, Verdict};
use crate::rng::Rng;
use serde::Serialize;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

/// What an intent moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// Between two accounts (`POST /v1/transfers`).
    Transfer,
    /// Out through the gateway (`POST /v1/payouts`).
    Payout,
}

/// How an intent ended for its client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Ending {
    /// A 2xx: it was made.
    Done,
    /// Refused for good (a stored refusal).
    Refused,
    /// The budget ran out before the client knew.
    Unknown,
}

/// One intended transfer (or payout) and how it ended for its client.
#[derive(Debug, Clone, Serialize)]
pub struct Intent {
    pub client: usize,
    pub kind: Kind,
    pub key: String,
    pub src: String,
    /// The destination account, or a payout's beneficiary.
    pub dst: String,
    pub amount: i64,
    pub verdict: Ending,
    pub attempts: u32,
    pub millis: u64,
    /// The transfer (or payout) id the client was told, if any.
    pub told: Option<i64>,
    #[serde(skip)]
    pub tries: Vec<client::Try>,
}

/// The clients at work: their threads, how many intents have ended, and
/// the intents so far.
pub(super) struct Clients {
    pub workers: Vec<JoinHandle<()>>,
    pub settled: Arc<AtomicUsize>,
    pub intents: Arc<Mutex<Vec<Intent>>>,
    /// While set, the clients go on past their `transfers`: the machine
    /// room has faults left, and the day lasts as long as they need.
    pub more: Arc<AtomicBool>,
}

impl Clients {
    /// Starts `config.clients` clients; client `c` (token `tokens[c]`)
    /// starts on instance `c` of `urls` and moves on to the next after a
    /// failure. With `payouts`, every fourth intent is a payout.
    pub(super) fn start(
        config: &Config,
        urls: &[String],
        tokens: &[String],
        payouts: bool,
        more: bool,
    ) -> Clients {
        let settled = Arc::new(AtomicUsize::new(0));
        let intents = Arc::new(Mutex::new(Vec::new()));
        let more = Arc::new(AtomicBool::new(more));
        let workers = (0..config.clients)
            .map(|c| {
                let endpoints: Vec<Endpoint> = (0..urls.len())
                    .map(|i| Endpoint { url: urls[(c + i) % urls.len()].clone(), token: tokens[c].clone() })
                    .collect();
                let (settled, intents, more) = (settled.clone(), intents.clone(), more.clone());
                let (seed, transfers, budget, think, clients) =
                    (config.seed, config.transfers, config.budget, config.think, config.clients);
                std::thread::spawn(move || {
                    let mut rng = Rng::new(seed ^ (c as u64 + 1).wrapping_mul(0x9e37_79b9));
                    let retry = client::Policy { budget, ..client::Policy::default() };
                    let mut i = 0;
                    while i < transfers || more.load(Ordering::Relaxed) {
                        let kind = if payouts && i % 4 == 3 { Kind::Payout } else { Kind::Transfer };
                        let intent = one(&endpoints, (seed, c, i, clients), kind, &retry, &mut rng);
                        i += 1;
                        intents.lock().unwrap_or_else(|e| e.into_inner()).push(intent);
                        settled.fetch_add(1, Ordering::Relaxed);
                        std::thread::sleep(think);
                    }
                })
            })
            .collect();
        Clients { workers, settled, intents, more }
    }

    /// Whether every client has ended all its intents.
    pub(super) fn finished(&self) -> bool {
        self.workers.iter().all(|w| w.is_finished())
    }
}

/// Client `c`'s intent `i` (of `clients` clients), sent until it ends.
fn one(
    endpoints: &[Endpoint],
    (seed, c, i, clients): (u64, usize, usize, usize),
    kind: Kind,
    retry: &client::Policy,
    rng: &mut Rng,
) -> Intent {
    let src = rng.below(ACCOUNTS as u64) as usize;
    let dst = (src + 1 + rng.below(ACCOUNTS as u64 - 1) as usize) % ACCOUNTS;
    // an amount of its own names the intent in the transfer table
    let amount = 1_000 + (i * clients + c) as i64;
    let key = format!("chaos-{seed}-{c}-{i}");
    let src = format!("acct-{src}");
    let (route, dst, id_member, body) = match kind {
        Kind::Payout => {
            let beneficiary = format!("ben-{c}-{i}");
            let body = serde_json::json!({"src": src, "beneficiary": beneficiary, "amount": amount, "currency": "KRW"});
            ("/v1/payouts", beneficiary, "payout_id", body)
        }
        Kind::Transfer => {
            let dst = format!("acct-{dst}");
            let body = serde_json::json!({"src": src, "dst": dst, "amount": amount, "currency": "KRW"});
            ("/v1/transfers", dst, "transfer_id", body)
        }
    };
    let report = client::send_to(endpoints, route, &key, &body.to_string(), retry, rng);
    let (verdict, told) = match &report.verdict {
        Verdict::Done { body, .. } => {
            let id = serde_json::from_str::<serde_json::Value>(body).ok().and_then(|v| v[id_member].as_i64());
            (Ending::Done, id)
        }
        Verdict::Refused { .. } => (Ending::Refused, None),
        Verdict::Unknown { .. } => (Ending::Unknown, None),
    };
    Intent {
        client: c,
        kind,
        key,
        src,
        dst,
        amount,
        verdict,
        attempts: report.attempts(),
        millis: report.took.as_millis() as u64,
        told,
        tries: report.tries,
    }
}
