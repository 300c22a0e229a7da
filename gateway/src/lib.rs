//! spade-gateway: the edge server. OpenAI-compatible `/v1/chat/completions` and `/v1/completions`, drafted by a local model,
//! verified block by block by `spade-verifier`, streamed back as SSE.
//!
//! Handlers are thin: `chat` and `completions` validate (the fields they share in `request`) and
//! start a `generation` (the draft/verify loop), `respond` shapes its events into OpenAI JSON or SSE,
//! `verifier` is the HTTP client of the cloud side, `tokenize` answers vLLM's `/tokenize` and
//! `/detokenize`, `infill` llama-server's `/infill` (fill-in-the-middle), `admission` bounds the work.
//! The server skeleton (auth, errors, flags, serving) is spade-http's.

mod admin;
mod admission;
mod chat;
mod completions;
pub mod config;
mod error;
mod generation;
mod infill;
mod metrics;
pub mod openapi;
mod request;
mod respond;
pub mod state;
mod tokenize;
mod verifier;

use axum::routing::{get, post};
use axum::Router;

pub use chat::{validate, ValidChat};
pub use config::{Config, OfflineFallback};
pub use error::ApiError;
pub use state::{AppState, Gateway};

/// The gateway's routes in spade-http's skeleton: serve it with `spade_http::serve`.
pub fn router(state: AppState) -> Router {
    let protected = Router::new()
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .route("/infill", post(infill::infill))
        .route("/v1/models", get(admin::models))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize))
        .with_state(state.clone());
    let probes = spade_http::Probes {
        live: get(admin::live),
        ready: get(admin::ready).with_state(state.clone()),
    };
    let metrics = get(admin::metrics).with_state(state.clone());
    let app = spade_http::app(probes, metrics, protected, &state.http);
    // Checked by `Config::check` at start; a layer that cannot be built here means no CORS headers.
    match spade_http::cors::layer(&state.settings.cors_allow_origin) {
        Ok(Some(cors)) => app.layer(cors),
        _ => app,
    }
}
