//! spade-verifier: the cloud `/verify` service.
//!
//! Handlers are thin: validation and the round itself live in `verify`, scoring in spade-engine, the
//! rule in spade-core. The server skeleton (auth, errors, flags, serving) is spade-http's.

mod admin;
mod admission;
mod batcher;
pub mod config;
pub mod engine;
mod error;
mod metrics;
pub mod openapi;
mod sessions;
mod state;
mod verify;

use axum::routing::{delete, get, post};
use axum::Router;

pub use config::Config;
pub use error::ApiError;
pub use state::{AppState, Target, Verifier};

/// The verifier's routes in spade-http's skeleton: serve it with `spade_http::serve`.
pub fn router(state: AppState) -> Router {
    let calls = Router::new()
        .route("/verify", post(verify::verify))
        .route("/sessions/{id}", delete(verify::end_session));
    let probes = spade_http::Probes {
        live: get(admin::live).with_state(state.clone()),
        ready: get(admin::ready).with_state(state.clone()),
    };
    let metrics = get(admin::metrics).with_state(state.clone());
    let protected = calls.route("/v1/info", get(admin::info)).with_state(state.clone());
    spade_http::app(probes, metrics, protected, &state.http)
}
