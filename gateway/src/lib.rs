//! spade-gateway: the edge server. OpenAI-compatible `/v1/chat/completions`, drafted by a local model,
//! verified block by block by `spade-verifier`, streamed back as SSE.
//!
//! Handlers are thin: `chat` validates and starts a `generation` (the draft/verify loop), `respond`
//! shapes its events into OpenAI JSON or SSE, `verifier` is the HTTP client of the cloud side.
//! `serve` takes its listener and shutdown signal from the caller, so tests bind port 0.

mod admin;
mod auth;
mod chat;
pub mod config;
mod error;
mod generation;
mod metrics;
pub mod openapi;
mod respond;
pub mod state;
mod verifier;

use std::future::Future;
use std::time::Duration;

use axum::extract::DefaultBodyLimit;
use axum::http::{HeaderName, Request};
use axum::routing::{get, post};
use axum::{middleware, Router};
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::TraceLayer;

pub use chat::{validate, ValidChat};
pub use config::{Config, OfflineFallback};
pub use error::ApiError;
pub use state::{AppState, Gateway};

const REQUEST_ID: &str = "x-request-id";

pub fn router(state: AppState) -> Router {
    let protected = Router::new()
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/models", get(admin::models))
        .route("/metrics", get(admin::metrics))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth::require_api_key));
    let request_id = HeaderName::from_static(REQUEST_ID);
    Router::new()
        .route("/health", get(admin::health))
        .merge(protected)
        .fallback(admin::not_found)
        .method_not_allowed_fallback(admin::method_not_allowed)
        .layer(DefaultBodyLimit::max(state.settings.max_body_bytes))
        .layer(PropagateRequestIdLayer::new(request_id.clone()))
        .layer(TraceLayer::new_for_http().make_span_with(|req: &Request<_>| {
            let id = req.headers().get(REQUEST_ID).and_then(|v| v.to_str().ok()).unwrap_or("-");
            tracing::info_span!("request", id = %id, method = %req.method(), path = %req.uri().path())
        }))
        .layer(SetRequestIdLayer::new(request_id, MakeRequestUuid))
        .with_state(state)
}

/// Serves until `shutdown` resolves, then finishes the requests in flight.
pub async fn serve(listener: tokio::net::TcpListener, state: AppState, shutdown: impl Future<Output = ()> + Send + 'static) -> std::io::Result<()> {
    axum::serve(listener, router(state)).with_graceful_shutdown(shutdown).await
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
    tracing::info!("shutting down: finishing requests in flight");
    tokio::time::sleep(Duration::from_millis(10)).await;
}
