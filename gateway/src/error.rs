//! The gateway's one error type, rendered as OpenAI-shaped bodies (and as the `error` event of a
//! stream that fails midway). What is wrong with the request itself is spade-http's `RequestError`.

use axum::http::{HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use spade_core::ErrorBody;
use spade_engine::EngineError;
use spade_http::{ErrorResponse, RequestError};

#[derive(Debug, Clone, thiserror::Error)]
pub enum ApiError {
    #[error(transparent)]
    Request(#[from] RequestError),
    #[error("the draft model is still loading")]
    NotReady,
    /// The verifier could not be reached (after retries). Retrying at once would only pay for the
    /// same failure again.
    #[error("the verifier is unavailable: {0}")]
    VerifierUnavailable(String),
    /// The verifier answered, but with something the gateway cannot use.
    #[error("the verifier failed: {0}")]
    VerifierFailed(String),
    #[error("internal error: {0}")]
    Internal(String),
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.response().into_response()
    }
}

impl ApiError {
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        RequestError::invalid(param, message).into()
    }

    pub fn body(&self) -> ErrorBody {
        self.response().body
    }

    fn response(&self) -> ErrorResponse {
        // The OpenAI SDKs retry 5xx on their own; where that would only repeat a paid failure, say no.
        let no_retry = |r: ErrorResponse| {
            r.with_header(
                HeaderName::from_static("x-should-retry"),
                HeaderValue::from_static("false"),
            )
        };
        let message = self.to_string();
        match self {
            Self::Request(e) => e.response(),
            Self::VerifierUnavailable(_) => no_retry(
                ErrorResponse::server(StatusCode::SERVICE_UNAVAILABLE, message)
                    .with_code("verifier_unavailable"),
            ),
            Self::VerifierFailed(_) => no_retry(
                ErrorResponse::server(StatusCode::BAD_GATEWAY, message).with_code("verifier_error"),
            ),
            Self::NotReady => ErrorResponse::server(StatusCode::SERVICE_UNAVAILABLE, message)
                .with_code("not_ready"),
            Self::Internal(_) => ErrorResponse::server(StatusCode::INTERNAL_SERVER_ERROR, message),
        }
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::InvalidRequest(_) | EngineError::Sampling(_) => {
                RequestError::Invalid { message: e.to_string(), param: None, code: None }.into()
            }
            other => Self::Internal(other.to_string()),
        }
    }
}
