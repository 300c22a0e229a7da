//! `/health`, `/v1/models`, `/metrics`.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use serde::Serialize;
use spade_core::openai::{ModelCard, ModelList};
use spade_core::ErrorBody;
use spade_http::Json;
use utoipa::ToSchema;

use crate::state::{AppState, VerifierStatus};

#[derive(Debug, Serialize, ToSchema)]
pub struct Health {
    /// `ready`, `loading` (draft model), `verifier_unreachable` or `verifier_mismatch`.
    pub status: String,
    /// The draft model's name, once loaded.
    pub draft_model: Option<String>,
    /// The verifier's model, when it answered.
    pub verifier_model: Option<String>,
    /// Why the gateway is not ready, if it is not.
    pub detail: Option<String>,
}

/// Readiness: 200 when the draft model is loaded and the verifier answers `/v1/info` with the draft
/// model's vocabulary; 503 otherwise (with the reason).
#[utoipa::path(get, path = "/health", responses(
    (status = 200, description = "Ready", body = Health),
    (status = 503, description = "Not ready: draft model loading, verifier unreachable or with another vocabulary", body = Health),
))]
pub async fn health(State(state): State<AppState>) -> impl IntoResponse {
    let draft_model = state.model().ok().map(|m| m.meta().name.clone());
    let (status, verifier_model, detail) = match state.check_verifier().await {
        _ if draft_model.is_none() => {
            ("loading", None, Some("the draft model is loading".to_string()))
        }
        VerifierStatus::Ready(info) => ("ready", Some(info.model), None),
        VerifierStatus::Unreachable(e) => ("verifier_unreachable", None, Some(e)),
        VerifierStatus::Mismatch(e) => ("verifier_mismatch", None, Some(e)),
    };
    let code = if status == "ready" { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    (code, Json(Health { status: status.into(), draft_model, verifier_model, detail }))
}

/// The one model this gateway serves.
#[utoipa::path(get, path = "/v1/models", responses(
    (status = 200, description = "Models", body = ModelList),
    (status = 401, description = "Missing or wrong API key (when the gateway has one)", body = ErrorBody),
), security((), ("bearer" = [])))]
pub async fn models(State(state): State<AppState>) -> Json<ModelList> {
    let card = ModelCard {
        id: state.settings.model_name.clone(),
        object: "model".into(),
        created: state.started,
        owned_by: "spade".into(),
    };
    Json(ModelList { object: "list".into(), data: vec![card] })
}

/// Prometheus metrics (text exposition format).
#[utoipa::path(get, path = "/metrics", responses(
    (status = 200, description = "Prometheus text format", body = String, content_type = "text/plain"),
    (status = 401, description = "Missing or wrong API key (when the gateway has one)", body = ErrorBody),
), security((), ("bearer" = [])))]
pub async fn metrics(State(state): State<AppState>) -> impl IntoResponse {
    spade_http::prometheus(
        state
            .metrics
            .render(state.draft_model.get().map(|m| m.context_rows()), &state.auto_choice()),
    )
}
