//! Where payouts go, and the budget of payouts waiting on the gateway:
//! the payout routes' own state, kept in the service's [`super::app::App`].

use super::executor::Clock;
use crate::payout::HttpGateway;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Where payouts go, and how many may wait on the gateway at once.
pub struct Desk {
    pub gateway: Arc<HttpGateway>,
    pub clock: Clock,
    pub(super) budget: Budget,
    /// What provider events may be signed with (the current secret, and
    /// the previous one while a rotation lasts); none: the route is not served.
    pub(super) events_secrets: Vec<Vec<u8>>,
    /// Events being read and applied at once: a body is unauthenticated
    /// until read whole, so stalled uploads may hold this few connections
    /// and bytes (the permit is kept until the event is applied).
    pub(super) event_reads: tokio::sync::Semaphore,
}

/// How many event bodies are read at once; more are answered 503 at once.
const EVENT_READS: usize = 8;

impl Desk {
    /// At most `in_flight` payouts at once (waiting on a slow gateway never
    /// takes a transfer's slot), and at most a quarter of them (one at
    /// least) of any one client.
    pub fn new(gateway: HttpGateway, clock: Clock, in_flight: usize, events_secrets: Vec<Vec<u8>>) -> Desk {
        let budget =
            Budget { total: in_flight, per_client: in_flight.div_ceil(4).max(1), held: Mutex::default() };
        let event_reads = tokio::sync::Semaphore::new(EVENT_READS);
        Desk { gateway: Arc::new(gateway), clock, budget, events_secrets, event_reads }
    }
}

pub(super) struct Budget {
    total: usize,
    per_client: usize,
    /// In flight: in all, and per client.
    held: Mutex<(usize, HashMap<String, usize>)>,
}

/// One payout's place in the budget, given back when dropped.
pub(super) struct Slot<'a> {
    budget: &'a Budget,
    client: String,
}

impl Budget {
    pub(super) fn take(&self, client: &str) -> Option<Slot<'_>> {
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        let mine = held.1.get(client).copied().unwrap_or(0);
        if held.0 >= self.total || mine >= self.per_client {
            return None;
        }
        held.0 += 1;
        held.1.insert(client.to_owned(), mine + 1);
        Some(Slot { budget: self, client: client.to_owned() })
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        let mut held = self.budget.held.lock().unwrap_or_else(|e| e.into_inner());
        held.0 = held.0.saturating_sub(1);
        if let Some(n) = held.1.get_mut(&self.client) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                held.1.remove(&self.client);
            }
        }
    }
}
