//! The gateway's optional bearer key, compared in constant time.

use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::middleware::Next;
use axum::response::Response;
use spade_core::constant_time_eq;

use crate::error::ApiError;
use crate::state::AppState;

pub async fn require_api_key(State(state): State<AppState>, request: Request, next: Next) -> Result<Response, ApiError> {
    if let Some(key) = &state.api_key {
        let presented = request
            .headers()
            .get(AUTHORIZATION)
            .and_then(|h| h.to_str().ok())
            .and_then(|h| h.strip_prefix("Bearer "))
            .unwrap_or("");
        if !constant_time_eq(presented.as_bytes(), key.as_bytes()) {
            return Err(ApiError::Unauthorized);
        }
    }
    Ok(next.run(request).await)
}
