//! `/health`, `/v1/info`, `/metrics`.

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use serde::Serialize;
use spade_core::protocol::ModelInfo;
use spade_core::ErrorBody;
use utoipa::ToSchema;

use crate::error::{ApiError, Json};
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
    let ready = state.is_ready();
    let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    let body = Health { status: if ready { "ready" } else { "loading" }.into(), model: state.model_id.clone() };
    (status, Json(body))
}

/// The model gateways must match: vocabulary size and tokenizer fingerprint.
#[utoipa::path(get, path = "/v1/info", responses(
    (status = 200, description = "Model facts", body = ModelInfo),
    (status = 401, description = "Missing or wrong bearer token", body = ErrorBody),
    (status = 503, description = "Model still loading", body = ErrorBody),
), security(("bearer" = [])))]
pub async fn info(State(state): State<AppState>) -> Result<Json<ModelInfo>, ApiError> {
    let meta = state.scorer()?.meta().clone();
    Ok(Json(ModelInfo {
        model: state.model_id.clone(),
        vocab_size: meta.vocab_size,
        tokenizer_fingerprint: meta.tokenizer_fingerprint,
        max_context: meta.max_context,
    }))
}

/// Prometheus metrics (text exposition format).
#[utoipa::path(get, path = "/metrics", responses(
    (status = 200, description = "Prometheus text format", body = String, content_type = "text/plain"),
    (status = 401, description = "Missing or wrong bearer token", body = ErrorBody),
), security(("bearer" = [])))]
pub async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    let (sessions, bytes) = state.sessions.usage();
    let text = state.metrics.render(sessions, bytes, state.admission.waiting(), state.is_ready());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text)
}

pub async fn not_found() -> ApiError {
    ApiError::NotFound
}

pub async fn method_not_allowed() -> ApiError {
    ApiError::MethodNotAllowed
}
