//! The middleware as a `tower::Layer`: the same [`guard`](super::idempotent)
//! around an inner `tower::Service` instead of axum's `Next`.

use super::{Idempotency, guard};
use axum::extract::Request;
use axum::response::Response;

/// The middleware as a `tower::Layer`, for axum's `route_layer` or around
/// any `tower::Service` of axum's requests whose errors are `Infallible`:
///
/// ```no_run
/// use axum::{Router, routing::post};
/// use idem::embed::{Keys, layer::{Idempotency, IdempotencyLayer}};
/// # async fn pay() {}
/// # async fn setup() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let idem = Idempotency::connect("shop.db", Keys::new("app_")?, 1, |h| {
///     h.get("x-client").and_then(|v| v.to_str().ok()).map(String::from)
/// }).await?;
/// let app: Router = Router::new().route("/v1/payments", post(pay)).route_layer(IdempotencyLayer::new(idem));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct IdempotencyLayer {
    idem: Idempotency,
}

impl IdempotencyLayer {
    /// The layer over `idem`'s keys and connections.
    pub fn new(idem: Idempotency) -> IdempotencyLayer {
        IdempotencyLayer { idem }
    }
}

impl<S> tower_layer::Layer<S> for IdempotencyLayer {
    type Service = IdempotentService<S>;

    fn layer(&self, inner: S) -> IdempotentService<S> {
        IdempotentService { idem: self.idem.clone(), inner }
    }
}

/// A service behind [`IdempotencyLayer`].
#[derive(Clone)]
pub struct IdempotentService<S> {
    idem: Idempotency,
    inner: S,
}

impl<S> tower_service::Service<Request> for IdempotentService<S>
where
    S: tower_service::Service<Request, Response = Response, Error = std::convert::Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = std::convert::Infallible;
    type Future = std::pin::Pin<Box<dyn std::future::Future<Output = Result<Response, Self::Error>> + Send>>;

    // Ready at once: each request calls a clone of the inner service, and
    // waits for that clone's readiness itself.
    fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request) -> Self::Future {
        let (idem, mut inner) = (self.idem.clone(), self.inner.clone());
        Box::pin(async move {
            let next = move |request| async move {
                let Ok(()) = std::future::poll_fn(|cx| inner.poll_ready(cx)).await;
                let Ok(response) = inner.call(request).await;
                response
            };
            Ok(guard(idem, request, next).await)
        })
    }
}
