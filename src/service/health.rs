//! What `/healthz` says, and why it is cheap. A probe of the database
//! (`SELECT 1`-class, on a reader) runs at most once per [`PROBE_EVERY`],
//! whatever the number of callers: a flood of health checks costs HTTP
//! parsing and nothing on the store's queues. Between probes the last
//! verdict is answered.
//!
//! A database that answers reads may still refuse writes (a full disk, a
//! standby): the store workers report each write's outcome, and while the
//! last write failed as unavailable, and for at most [`WRITE_ERROR_HOLD`]
//! after it, the service is unhealthy. The hold ends on its own so that a
//! load balancer which stopped sending writes on our word lets one through
//! again to find out.

use std::sync::Mutex;
use std::time::{Duration, Instant};

pub const PROBE_EVERY: Duration = Duration::from_secs(1);
pub const WRITE_ERROR_HOLD: Duration = Duration::from_secs(10);

#[derive(Default)]
pub struct Health {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// When the last probe ended, and what it found.
    probed: Option<(Instant, Result<(), String>)>,
    probing: bool,
    /// The last write's failure, if the last write failed as unavailable.
    write_error: Option<(Instant, String)>,
}

impl Health {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a new probe is due; if so, the caller runs it and reports it
    /// with [`Health::probed`] (only one caller at a time is told to).
    pub fn probe_due(&self) -> bool {
        let mut state = self.state();
        let fresh = state.probed.as_ref().is_some_and(|(at, _)| at.elapsed() < PROBE_EVERY);
        if fresh || state.probing {
            return false;
        }
        state.probing = true;
        true
    }

    pub fn probed(&self, result: Result<(), String>) {
        let mut state = self.state();
        state.probed = Some((Instant::now(), result));
        state.probing = false;
    }

    /// A write reached the database and was answered.
    pub fn write_ok(&self) {
        let mut state = self.state();
        if state.write_error.is_some() {
            state.write_error = None;
        }
    }

    /// A write failed because the database cannot take writes now.
    pub fn write_failed(&self, why: String) {
        self.state().write_error = Some((Instant::now(), why));
    }

    /// `Ok`, or what is wrong.
    pub fn verdict(&self) -> Result<(), String> {
        let state = self.state();
        if let Some((at, why)) = &state.write_error
            && at.elapsed() < WRITE_ERROR_HOLD
        {
            return Err(format!("the last write failed: {why}"));
        }
        match &state.probed {
            Some((_, result)) => result.clone(),
            None => Err("not probed yet".into()),
        }
    }
}
