//! A call to a provider idem does not own (a payment gateway, a bank, a
//! card network), the way both of idem's faces make one: `idem serve`'s
//! payouts (`payout`) and the library's layer (`embed::layer::Outside`).
//!
//! One local transaction cannot make an outside call exactly once, so the
//! call is three steps, and no transaction is open across the call: the
//! intent (with the downstream key the provider sees, the same on every
//! send), the call, and its result. An outcome not known is looked up by
//! that key later, by a recovery job; what the job does with what the
//! provider says is decided here, once, for both faces: [`judge`] (look
//! again, resend with the same key, or hand to a person), with the waits
//! of [`Limits::wait`].

use sha2::{Digest, Sha256};
use std::time::Duration;

/// What a send to the gateway came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    /// Paid; the provider's own id for it, if it gave one.
    Paid(Option<String>),
    /// A definitive refusal: `status` is what idem answers (402 or 422).
    Refused {
        /// What idem answers the client.
        status: u16,
        /// The provider's reason.
        reason: String,
    },
    /// No definitive answer (a timeout, a reset, a 5xx, a 429, pending):
    /// looked up, and resent within the limits.
    Unknown(String),
    /// An answer no resend can fix (400, 401, 403, a key misused, a payout
    /// that is not the one sent): never resent, a person settles it.
    Terminal(String),
}

/// What the gateway says of a downstream key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// Paid; the provider's own id for it, if it gave one.
    Paid(Option<String>),
    /// Accepted, not final yet: asked again later.
    Pending,
    /// Refused, canceled, or paid and then returned: the money is back.
    Failed {
        /// The provider's reason.
        reason: String,
    },
    /// The gateway's own typed "no payout under this key".
    NotFound,
    /// No answer to go by: asked again later.
    Error(String),
    /// An answer no lookup will change: for a person.
    Terminal(String),
}

/// What a reconciler keeps to when it resends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// A payout younger than this may be missing from lookups.
    pub lookup_delay: Duration,
    /// A key older than this is forgotten: sent again, it would pay again.
    pub key_window: Duration,
    /// Kept short of the key window: clocks disagree, and a lookup and a
    /// send take time.
    pub key_margin: Duration,
    /// At most this many sends of one payout (the first included); then a
    /// person settles it.
    pub max_sends: i64,
    /// The first wait before a payout is looked at again…
    pub backoff: Duration,
    /// …doubling per look up to this.
    pub backoff_cap: Duration,
    /// A paid payout is looked up again for this long after it was paid
    /// (money can come back: a bank return, a reversal; Wise documents
    /// bounce-backs weeks later, PayPal returns an unclaimed payout after
    /// 30 days); zero: never.
    pub return_window: Duration,
    /// How often in a payout's first 3 days; further apart after
    /// ([`Limits::return_bands`]).
    pub return_check: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            lookup_delay: Duration::ZERO,
            key_window: Duration::from_secs(24 * 3600),
            key_margin: Duration::from_secs(3600),
            max_sends: 5,
            backoff: Duration::from_secs(30),
            backoff_cap: Duration::from_secs(3600),
            return_window: Duration::from_secs(45 * 24 * 3600),
            return_check: Duration::from_secs(6 * 3600),
        }
    }
}

impl Limits {
    /// How often a paid payout is looked up for a return, by its age (the
    /// oldest age each spacing lasts to, and the spacing): every
    /// `return_check` for its first 3 days, 4 times as far apart to 14
    /// days, 12 times to the end of the window. With the defaults (6 h, 45
    /// days): 6 h, 1 day, 3 days, about 33 lookups a payout, where one
    /// every 6 h would be 180.
    pub fn return_bands(&self) -> Vec<(Duration, Duration)> {
        let day = Duration::from_secs(24 * 3600);
        [(3 * day, 1), (14 * day, 4), (self.return_window, 12)]
            .into_iter()
            .map(|(age, k)| (age.min(self.return_window), self.return_check.saturating_mul(k)))
            .filter(|(age, _)| !age.is_zero())
            .collect()
    }

    /// The wait before the `attempt`-th look (1 for the first), capped
    /// exponential with full jitter (AWS's "full jitter": uniform between
    /// zero and the capped doubling), the draw fixed by `seed` so that one
    /// payout's waits are reproducible and different payouts' are spread.
    pub fn wait(&self, attempt: i64, seed: u64) -> Duration {
        let doublings = u32::try_from(attempt.saturating_sub(1).clamp(0, 30)).unwrap_or(30);
        let ceiling = self.backoff.saturating_mul(1 << doublings).min(self.backoff_cap);
        let millis = u64::try_from(ceiling.as_millis()).unwrap_or(u64::MAX);
        let draw = crate::rng::mix(seed ^ u64::try_from(attempt).unwrap_or(0));
        Duration::from_millis(draw % millis.saturating_add(1))
    }
}

/// What the recovery job does next with a call whose outcome it asked the
/// provider about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// Record this outcome, for this reason.
    Record(Call, String),
    /// The provider never got it, and it may still be sent: send it again
    /// with the same downstream key, counted before it goes ([`resent`]
    /// says what the send came to).
    Resend,
}

/// What a lookup of a call means, the one rule both faces keep: paid,
/// refused, pending and failed lookups are recorded as they are; a call
/// the provider has not seen is resent only once it is past the
/// provider's lookup delay (younger, it may be in flight), fewer than
/// `max_sends` times, and early enough in the provider's key window that
/// a resend sent at the end of `lease` still lands inside it; otherwise a
/// person settles it. `older_than(d)`: whether the call was first made at
/// least `d` ago; `sends`: how many times it was sent so far.
pub fn judge(
    lookup: Lookup,
    older_than: impl Fn(Duration) -> bool,
    sends: i64,
    limits: &Limits,
    lease: Duration,
) -> Next {
    let resend_until = limits.key_window.saturating_sub(limits.key_margin).saturating_sub(lease);
    match lookup {
        Lookup::Paid(id) => Next::Record(Call::Paid(id), "paid at the gateway: completed".to_owned()),
        Lookup::Failed { reason } => {
            let decision = format!("refused at the gateway ({reason}): the hold is released");
            Next::Record(Call::Refused { status: 422, reason }, decision)
        }
        Lookup::Pending => Next::Record(
            Call::Unknown("pending at the gateway".into()),
            "pending at the gateway: left".into(),
        ),
        Lookup::Error(why) => Next::Record(
            Call::Unknown(format!("lookup failed: {why}")),
            format!("the lookup failed ({why}): left"),
        ),
        Lookup::Terminal(why) => Next::Record(
            Call::Terminal(format!("the lookup's answer: {why}")),
            format!("the lookup's answer needs a person ({why})"),
        ),
        Lookup::NotFound if !older_than(limits.lookup_delay) => Next::Record(
            Call::Unknown("not found yet, within the gateway's lookup delay".into()),
            "not found, but younger than the gateway's lookup delay: left".into(),
        ),
        Lookup::NotFound if sends >= limits.max_sends => Next::Record(
            Call::Terminal(format!("not found at the gateway after {sends} sends")),
            format!("not found after {sends} sends, the most allowed: left for a person"),
        ),
        Lookup::NotFound if older_than(resend_until) => Next::Record(
            Call::Terminal(
                "not found at the gateway, and too near or past its key window (a resend could pay again)"
                    .into(),
            ),
            "not found, too near or past the gateway's key window: left for a person".into(),
        ),
        Lookup::NotFound => Next::Resend,
    }
}

/// What a resend ([`Next::Resend`]) came to, as the outcome to record and
/// why.
pub fn resent(call: Call) -> (Call, String) {
    match call {
        Call::Unknown(why) => (
            Call::Unknown(format!("resent: {why}")),
            format!("not found: resent with the same key, still unknown ({why})"),
        ),
        Call::Paid(id) => (Call::Paid(id), "not found: resent with the same key, paid: completed".into()),
        Call::Refused { status, reason } => {
            let decision = format!("not found: resent with the same key, refused ({reason}): released");
            (Call::Refused { status, reason }, decision)
        }
        Call::Terminal(why) => (
            Call::Terminal(format!("resent: {why}")),
            format!("not found: resent, an answer no resend can fix ({why}): left for a person"),
        ),
    }
}

/// The key the provider sees for the call a claim token makes: a UUID
/// (version 8, RFC 9562), as providers ask (Wise wants one; Razorpay allows
/// 4-36 characters). Derived from idem's token, never from the client's
/// key: two clients' keys may collide, two claim tokens may not.
pub fn downstream_key(token: &str) -> String {
    let digest = Sha256::digest(format!("idem payout {token}").as_bytes());
    crate::rng::uuid(digest[..16].try_into().unwrap_or([0; 16]), 8)
}

/// A call's own seed for its waits' jitter.
pub fn seed(downstream_key: &str) -> u64 {
    downstream_key
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

/// A call a handler declared (`embed::layer::Tx::call`), as its provider
/// gets it on every send and lookup.
#[derive(Debug, Clone, PartialEq)]
pub struct Intent {
    /// The call's row in the calls table.
    pub id: i64,
    /// The key the provider sees: the same on every send, by any process.
    pub downstream_key: String,
    /// What the handler declared the call is (amount, beneficiary, …).
    pub body: serde_json::Value,
    /// How many times it was sent before this send (0 on the first).
    pub sends: i64,
}

/// A provider the team's handlers call (Stripe, a bank, a card network):
/// its send under the intent's downstream key, and its lookup by that key.
/// Neither runs inside a transaction. Each returns what the provider's
/// answer means ([`Call`], [`Lookup`]): a timeout, a reset, a 5xx or an
/// answer not read whole is [`Call::Unknown`], never a refusal.
///
/// ```
/// use idem::provider::{Call, Intent, Lookup, Provider};
///
/// struct Bank; // the team's client of its provider
/// impl Provider for Bank {
///     async fn send(&self, intent: &Intent) -> Call {
///         // POST with `Idempotency-Key: intent.downstream_key`, then classify
///         Call::Paid(Some(format!("bank-{}", intent.id)))
///     }
///     async fn lookup(&self, intent: &Intent) -> Lookup {
///         Lookup::Paid(Some(format!("bank-{}", intent.id)))
///     }
/// }
/// ```
pub trait Provider: Send + Sync + 'static {
    /// Sends `intent` under its downstream key.
    fn send(&self, intent: &Intent) -> impl Future<Output = Call> + Send;
    /// What the provider says of `intent`'s downstream key.
    fn lookup(&self, intent: &Intent) -> impl Future<Output = Lookup> + Send;
}
