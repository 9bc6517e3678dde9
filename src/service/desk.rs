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
    /// Bytes of event bodies being read and applied at once, across
    /// connections. A body is unauthenticated until read whole, so what a
    /// stranger may hold is bytes, never turns: each chunk takes its bytes
    /// as it arrives (kept until the event is applied), and stalled uploads
    /// hold only the few bytes they sent.
    pub(super) event_bytes: tokio::sync::Semaphore,
}

/// The bytes [`Desk::event_bytes`] bounds: 64 whole events of the most an
/// event may hold (4 MiB); past it, an event is answered 503 at once.
pub(super) const EVENT_BYTES: usize = 64 * super::payouts::MAX_EVENT_BODY;

impl Desk {
    /// At most `in_flight` payouts at once (waiting on a slow gateway never
    /// takes a transfer's slot), and at most a quarter of them (one at
    /// least) of any one client.
    pub fn new(gateway: HttpGateway, clock: Clock, in_flight: usize, events_secrets: Vec<Vec<u8>>) -> Desk {
        let budget =
            Budget { total: in_flight, per_client: in_flight.div_ceil(4).max(1), held: Mutex::default() };
        let event_bytes = tokio::sync::Semaphore::new(EVENT_BYTES);
        Desk { gateway: Arc::new(gateway), clock, budget, events_secrets, event_bytes }
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
