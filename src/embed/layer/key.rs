//! The key a request runs under, as the handler reads it.

/// The key a claimed request runs under, for the handler:
/// `axum::Extension<IdemKey>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdemKey {
    /// The client, as the `who` function named it.
    pub client: String,
    /// The method and the path the client sent (`POST /v1/orders`).
    pub endpoint: String,
    /// The `Idempotency-Key` the client sent.
    pub key: String,
}

impl IdemKey {
    /// A key for a call the handler makes outside (a payment provider's own
    /// `Idempotency-Key`): the same at every run of this request (a retry
    /// after a panic or a crash runs the handler again), another for another
    /// client, endpoint, key or `purpose`. 64 hex digits.
    ///
    /// ```
    /// use idem::embed::layer::IdemKey;
    /// let k = IdemKey { client: "c1".into(), endpoint: "POST /orders".into(), key: "k-1".into() };
    /// assert_eq!(k.downstream("charge"), k.clone().downstream("charge"));
    /// assert_ne!(k.downstream("charge"), k.downstream("refund"));
    /// ```
    pub fn downstream(&self, purpose: &str) -> String {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        // each part length-prefixed: no two tuples spell the same bytes
        for part in [&self.client, &self.endpoint, &self.key, purpose] {
            h.update((part.len() as u64).to_be_bytes());
            h.update(part);
        }
        crate::hex::lower(&h.finalize())
    }
}
