//! The gateway's optional bearer key, compared in constant time.

use crate::error::ApiError;
use crate::state::AppState;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;

pub async fn require_api_key(State(state): State<AppState>, request: Request, next: Next) -> Result<Response, ApiError> {
    if !spade_http::bearer_matches(request.headers(), state.api_key.as_deref()) {
        return Err(ApiError::Unauthorized);
    }
    Ok(next.run(request).await)
}
