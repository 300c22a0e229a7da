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

use axum::routing::{get, post};
use axum::{middleware, Router};

pub use chat::{validate, ValidChat};
pub use config::{Config, OfflineFallback};
pub use error::ApiError;
pub use state::{AppState, Gateway};

pub use spade_http::shutdown_signal;

pub fn router(state: AppState) -> Router {
    let protected = Router::new()
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/models", get(admin::models))
        .route("/metrics", get(admin::metrics))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth::require_api_key));
    let max_body = state.settings.max_body_bytes;
    let app = Router::new()
        .route("/health", get(admin::health))
        .merge(protected)
        .fallback(admin::not_found)
        .method_not_allowed_fallback(admin::method_not_allowed)
        .with_state(state);
    spade_http::with_common_layers(app, max_body)
}

/// Serves until `shutdown` resolves, then finishes the requests in flight.
pub async fn serve(listener: tokio::net::TcpListener, state: AppState, shutdown: impl Future<Output = ()> + Send + 'static) -> std::io::Result<()> {
    axum::serve(listener, router(state)).with_graceful_shutdown(shutdown).await
}
