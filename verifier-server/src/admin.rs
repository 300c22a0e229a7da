//! The probes (`/health/live`, `/health/ready` = `/health`), `/v1/info`, `/metrics`.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use serde::Serialize;
use spade_core::protocol::{
    ModelInfo, FEATURE_BINARY, FEATURE_GRAMMAR, FEATURE_LOGPROBS, FEATURE_PENALTIES,
    FEATURE_PREFIX_CACHE,
};
use spade_core::ErrorBody;
use spade_http::{Json, Liveness};
use utoipa::ToSchema;

use crate::error::ApiError;
use crate::state::AppState;

#[derive(Debug, Serialize, ToSchema)]
pub struct Health {
    /// `ready`; not ready: `loading`, `scoring_stopped` (the scoring thread died: restart) or
    /// `engine_unavailable` (--engine unreachable, failing, or serving another vocabulary).
    pub status: String,
    pub model: String,
    /// Why not ready, where known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// Readiness (also at `/health`): 200 once the model is loaded and its scoring thread runs, 503
/// before and after.
#[utoipa::path(get, path = "/health/ready", responses(
    (status = 200, description = "Ready", body = Health),
    (status = 503, description = "Model still loading, or the scoring thread stopped", body = Health),
))]
pub async fn ready(State(state): State<AppState>) -> impl IntoResponse {
    let mut detail = None;
    let status = match (state.target_model.get(), state.engine.get()) {
        (Some(target), _) if !target.batcher.is_running() => "scoring_stopped",
        (Some(_), _) => "ready",
        (None, Some(engine)) => {
            detail = engine.health().await;
            if detail.is_some() {
                "engine_unavailable"
            } else {
                "ready"
            }
        }
        (None, None) => "loading",
    };
    let code = if status == "ready" { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (code, Json(Health { status: status.into(), model: state.model_id.clone(), detail }))
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
    let meta = state.meta()?;
    let target = state.target_model.get();
    let features: &[&str] = match target {
        Some(_) => &[FEATURE_PENALTIES, FEATURE_GRAMMAR, FEATURE_LOGPROBS, FEATURE_BINARY],
        None => &[FEATURE_BINARY],
    };
    Ok(Json(ModelInfo {
        model: state.model_id.clone(),
        vocab_size: meta.vocab_size,
        tokenizer_fingerprint: meta.tokenizer_fingerprint,
        max_context: meta.max_context,
        max_draft: u32::try_from(state.limits.max_draft).unwrap_or(u32::MAX),
        max_top_logprobs: state.limits.max_top_logprobs,
        features: features
            .iter()
            .copied()
            .chain(
                (target.is_some() && state.sessions.prefix_cache()).then_some(FEATURE_PREFIX_CACHE),
            )
            .map(String::from)
            .collect(),
        pass_ms: target.map(|t| t.batcher.load.pass_ms()).unwrap_or_default(),
        rule: state.accept,
        engine: state.engine.get().map(|e| e.kind.as_str().to_string()),
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
