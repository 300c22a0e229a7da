//! `/health`, `/v1/info`, `/metrics`.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use serde::Serialize;
use spade_core::protocol::{
    ModelInfo, FEATURE_BINARY, FEATURE_GRAMMAR, FEATURE_PENALTIES, FEATURE_PREFIX_CACHE,
};
use spade_core::ErrorBody;
use spade_http::Json;
use utoipa::ToSchema;

use crate::error::ApiError;
use crate::state::AppState;

#[derive(Debug, Serialize, ToSchema)]
pub struct Health {
    /// `ready` or `loading`.
    pub status: String,
    pub model: String,
}

/// Readiness: 200 once the model is loaded, 503 before.
#[utoipa::path(get, path = "/health", responses(
    (status = 200, description = "Ready", body = Health),
    (status = 503, description = "Model still loading", body = Health),
))]
pub async fn health(State(state): State<AppState>) -> impl IntoResponse {
    let ready = state.target_model.is_loaded();
    let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    let body = Health {
        status: if ready { "ready" } else { "loading" }.into(),
        model: state.model_id.clone(),
    };
    (status, Json(body))
}

/// The model gateways must match (vocabulary size and tokenizer fingerprint) and the limits their
/// calls must respect (context, draft length, `top_logprobs`).
#[utoipa::path(get, path = "/v1/info", responses(
    (status = 200, description = "Model facts", body = ModelInfo),
    (status = 401, description = "Missing or wrong bearer token", body = ErrorBody),
    (status = 503, description = "Model still loading", body = ErrorBody),
), security(("bearer" = [])))]
pub async fn info(State(state): State<AppState>) -> Result<Json<ModelInfo>, ApiError> {
    let target = state.target()?;
    let meta = target.scorer.meta().clone();
    Ok(Json(ModelInfo {
        model: state.model_id.clone(),
        vocab_size: meta.vocab_size,
        tokenizer_fingerprint: meta.tokenizer_fingerprint,
        max_context: meta.max_context,
        max_draft: u32::try_from(state.limits.max_draft).unwrap_or(u32::MAX),
        max_top_logprobs: state.limits.max_top_logprobs,
        features: [FEATURE_PENALTIES, FEATURE_GRAMMAR, FEATURE_BINARY]
            .into_iter()
            .chain(state.sessions.prefix_cache().then_some(FEATURE_PREFIX_CACHE))
            .map(String::from)
            .collect(),
        pass_ms: target.batcher.load.pass_ms(),
    }))
}

/// Prometheus metrics (text exposition format).
#[utoipa::path(get, path = "/metrics", responses(
    (status = 200, description = "Prometheus text format", body = String, content_type = "text/plain"),
    (status = 401, description = "Missing or wrong bearer token", body = ErrorBody),
), security(("bearer" = [])))]
pub async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    let store = state.sessions.usage();
    let (backlog_secs, in_line) = state
        .target()
        .map_or((0.0, 0), |t| (t.batcher.load.backlog_seconds(), t.batcher.prompts_in_line()));
    spade_http::prometheus(state.metrics.render(
        store,
        state.admission.held(),
        backlog_secs,
        in_line,
        state.target_model.is_loaded(),
    ))
}
