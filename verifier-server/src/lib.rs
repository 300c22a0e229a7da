//! spade-verifier: the cloud `/verify` service.
//!
//! Handlers are thin: validation and the round itself live in `verify`, scoring in spade-engine, the
//! rule in spade-core. `serve` takes its listener and shutdown signal from the caller, so tests bind
//! port 0 and stop it when they like.

mod admin;
mod admission;
mod auth;
pub mod config;
mod error;
mod metrics;
pub mod openapi;
mod sessions;
mod state;
mod verify;

use std::future::Future;

use axum::routing::{delete, get, post};
use axum::{middleware, Router};

pub use config::Config;
pub use error::ApiError;
pub use state::{AppState, Verifier};

pub use spade_http::shutdown_signal;

pub fn router(state: AppState) -> Router {
    let protected = Router::new()
        .route("/verify", post(verify::verify))
        .route("/sessions/{id}", delete(verify::end_session))
        .route("/v1/info", get(admin::info))
        .route("/metrics", get(admin::metrics))
        .route_layer(middleware::from_fn_with_state(state.clone(), auth::require_api_key));
    let max_body = state.limits.max_body_bytes;
    let app = Router::new()
        .route("/health", get(admin::health))
        .merge(protected)
        .fallback(admin::not_found)
        .method_not_allowed_fallback(admin::method_not_allowed)
        .with_state(state);
    spade_http::with_common_layers(app, max_body)
}

/// Serves until `shutdown` resolves, then finishes the calls in flight.
pub async fn serve(listener: tokio::net::TcpListener, state: AppState, shutdown: impl Future<Output = ()> + Send + 'static) -> std::io::Result<()> {
    axum::serve(listener, router(state)).with_graceful_shutdown(shutdown).await
}
