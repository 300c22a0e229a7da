//! spade-http: the server kit both SPADE servers build on, so each server crate holds only its own
//! routes, state and errors.
//!
//! - [`app`]: the skeleton around a server's routes: the probes (`/health`, `/health/live`,
//!   `/health/ready`) open, `/metrics` open on request, the rest behind the bearer key
//!   ([`auth`]), OpenAI-shaped 404/405, request ids with tracing spans, the body limit.
//! - [`cors`]: opt-in CORS for browser clients.
//! - [`error`]: the OpenAI-shaped error response, the errors of the request itself, the JSON extractor.
//! - [`args`]: the shared flags, flattened into each server's `Config`.
//! - [`model`]: the slot the background-loaded model lands in.
//! - [`openapi`]: the parts of the OpenAPI documents both servers share.
//! - [`serve`]: `main`'s first steps, logging, serving with graceful shutdown while the model loads.

pub mod args;
pub mod auth;
pub mod cors;
pub mod error;
pub mod model;
pub mod openapi;
pub mod serve;

use axum::extract::DefaultBodyLimit;
use axum::http::{header, HeaderName, Request};
use axum::response::IntoResponse;
use axum::routing::MethodRouter;
use axum::Router;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::TraceLayer;

pub use args::{Command, EnvNames, HttpSettings, ServerArgs, ServerProfile};
pub use auth::BearerAuth;
pub use error::{ErrorResponse, Json, RequestError};
pub use model::ModelSlot;
pub use serve::{run, serve, shutdown_signal, start};

pub const REQUEST_ID: &str = "x-request-id";

/// A server's probes, open to all (orchestrators and load balancers carry no API key).
pub struct Probes {
    /// `/health/live`: 503 only when the process cannot recover by itself (restart it).
    pub live: MethodRouter,
    /// `/health/ready` and `/health`: 200 when the server can answer requests now.
    pub ready: MethodRouter,
}

/// A server's routes inside the shared skeleton: the probes open to all; `metrics` at `/metrics`,
/// open with `--metrics-public` and behind the bearer key otherwise; `protected` behind the key;
/// OpenAI-shaped errors for unknown routes and methods; the common layers.
pub fn app(
    probes: Probes,
    metrics: MethodRouter,
    protected: Router,
    http: &HttpSettings,
) -> Router {
    let open = Router::new()
        .route("/health", probes.ready.clone())
        .route("/health/ready", probes.ready)
        .route("/health/live", probes.live);
    let (open, protected) = if http.metrics_public {
        (open.route("/metrics", metrics), protected)
    } else {
        (open, protected.route("/metrics", metrics))
    };
    let app = open
        .merge(auth::require_bearer(protected, http.api_key.as_deref()))
        .fallback(error::not_found)
        .method_not_allowed_fallback(error::method_not_allowed);
    with_common_layers(app, http.max_body_bytes)
}

/// Body limit, then an `x-request-id` (kept from the client or made up) on every request, its
/// response, and the tracing span the request is handled in.
pub fn with_common_layers(router: Router, max_body_bytes: usize) -> Router {
    let request_id = HeaderName::from_static(REQUEST_ID);
    router
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .layer(PropagateRequestIdLayer::new(request_id.clone()))
        .layer(TraceLayer::new_for_http().make_span_with(|req: &Request<_>| {
            let id = req.headers().get(REQUEST_ID).and_then(|v| v.to_str().ok()).unwrap_or("-");
            tracing::info_span!("request", id = %id, method = %req.method(), path = %req.uri().path())
        }))
        .layer(SetRequestIdLayer::new(request_id, MakeRequestUuid))
}

/// `/health/live`'s answer on either server.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct Liveness {
    /// `live`, or what stopped (the verifier: `scoring_stopped`).
    pub status: String,
    pub detail: Option<String>,
}

/// A `/metrics` answer: Prometheus text (rendered with spade-core's `metrics`).
pub fn prometheus(text: String) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text)
}
