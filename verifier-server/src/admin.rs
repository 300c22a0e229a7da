//! The probes (`/health/live`, `/health/ready` = `/health`), `/v1/info`, `/metrics`.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use serde::Serialize;
use spade_core::protocol::{
    ModelInfo, FEATURE_BINARY, FEATURE_GRAMMAR, FEATURE_PENALTIES, FEATURE_PREFIX_CACHE,
};
use spade_core::ErrorBody;
use spade_http::{Json, Liveness};
use utoipa::ToSchema;

use crate::error::ApiError;
use crate::state::AppState;

#[derive(Debug, Serialize, ToSchema)]
pub struct Health {
    /// `ready`; not ready: `loading` or `scoring_stopped` (the scoring thread died: restart).
    pub status: String,
    pub model: String,
}

/// Readiness (also at `/health`): 200 once the model is loaded and its scoring thread runs, 503
/// before and after.
#[utoipa::path(get, path = "/health/ready", responses(
    (status = 200, description = "Ready", body = Health),
    (status = 503, description = "Model still loading, or the scoring thread stopped", body = Health),
))]
pub async fn ready(State(state): State<AppState>) -> impl IntoResponse {
    let status = match state.target_model.get() {
        None => "loading",
        Some(target) if !target.batcher.is_running() => "scoring_stopped",
        Some(_) => "ready",
    };
    let code = if status == "ready" { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (code, Json(Health { status: status.into(), model: state.model_id.clone() }))
}

/// Liveness: 503 once the scoring thread has died (a panic while scoring): no call can be answered
/// again until the process restarts. Loading is live.
#[utoipa::path(get, path = "/health/live", responses(
    (status = 200, description = "Live (loading or ready)", body = Liveness),
    (status = 503, description = "The scoring thread stopped: restart the verifier", body = Liveness),
))]
pub async fn live(State(state): State<AppState>) -> impl IntoResponse {
    match state.target_model.get() {
        Some(target) if !target.batcher.is_running() => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(Liveness {
                status: "scoring_stopped".into(),
                detail: Some("the scoring thread stopped (it panicked; see the log)".into()),
            }),
        ),
        _ => (StatusCode::OK, Json(Liveness { status: "live".into(), detail: None })),
    }
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
