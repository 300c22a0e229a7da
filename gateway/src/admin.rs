//! The probes (`/health/live`, `/health/ready` = `/health`), `/v1/models`, `/metrics`.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::IntoResponse;
use serde::Serialize;
use spade_core::openai::{ModelCard, ModelList};
use spade_core::ErrorBody;
use spade_http::{Json, Liveness};
use utoipa::ToSchema;

use crate::config::OfflineFallback;
use crate::state::{AppState, VerifierStatus};

#[derive(Debug, Serialize, ToSchema)]
pub struct Health {
    /// `ready`; `degraded` (ready, but the verifier is unreachable and `--offline-fallback draft`
    /// answers with the draft model alone); or, not ready, `loading` (draft model),
    /// `verifier_unreachable` or `verifier_mismatch`.
    pub status: String,
    /// How requests are answered now: `speculative` (drafted here, verified by the verifier) or
    /// `draft_only` (the offline fallback); None when not ready.
    pub serving: Option<String>,
    /// The draft model's name, once loaded.
    pub draft_model: Option<String>,
    /// The verifier's model, when it answered.
    pub verifier_model: Option<String>,
    /// Why the gateway is not ready or degraded, if it is.
    pub detail: Option<String>,
}

/// Readiness (also at `/health`): 200 when the gateway can answer: the draft model is loaded and the
/// verifier answers `/v1/info` with the draft model's vocabulary, or the verifier is unreachable and
/// the offline fallback answers; 503 otherwise (with the reason).
#[utoipa::path(get, path = "/health/ready", responses(
    (status = 200, description = "Ready (`serving` says how)", body = Health),
    (status = 503, description = "Not ready: draft model loading, verifier unreachable (without the offline fallback) or with another vocabulary", body = Health),
))]
pub async fn ready(State(state): State<AppState>) -> impl IntoResponse {
    let draft_model = state.model().ok().map(|m| m.meta().name.clone());
    let fallback = state.settings.fallback == OfflineFallback::Draft;
    let (status, serving, verifier_model, detail) = match state.check_verifier().await {
        _ if draft_model.is_none() => {
            ("loading", None, None, Some("the draft model is loading".to_string()))
        }
        VerifierStatus::Ready(info) => ("ready", Some("speculative"), Some(info.model), None),
        VerifierStatus::Unreachable(e) if fallback => (
            "degraded",
            Some("draft_only"),
            None,
            Some(format!("the verifier is unreachable ({e}); answering with the draft model alone (--offline-fallback draft)")),
        ),
        VerifierStatus::Unreachable(e) => ("verifier_unreachable", None, None, Some(e)),
        VerifierStatus::Mismatch(e) => ("verifier_mismatch", None, None, Some(e)),
    };
    let code = if serving.is_some() { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
    let serving = serving.map(String::from);
    (code, Json(Health { status: status.into(), serving, draft_model, verifier_model, detail }))
}

/// Liveness: 200 while the gateway serves HTTP. Nothing the gateway waits for (the draft model
/// loading, an unreachable verifier) is cured by restarting it, so this never says 503.
#[utoipa::path(get, path = "/health/live", responses(
    (status = 200, description = "Live", body = Liveness),
))]
pub async fn live() -> Json<Liveness> {
    Json(Liveness { status: "live".into(), detail: None })
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
    let mut text = state
        .metrics
        .render(state.draft_model.get().map(|m| m.context_rows()), &state.auto_choice());
    state.admission.render(&mut text);
    spade_http::prometheus(text)
}
