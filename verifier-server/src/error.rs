//! The verifier's one error type, rendered as OpenAI-shaped bodies. What is wrong with the request
//! itself is spade-http's `RequestError`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use spade_core::grammar::GrammarError;
use spade_engine::EngineError;
use spade_http::{ErrorResponse, RequestError};

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error(transparent)]
    Request(#[from] RequestError),
    #[error("session {0:?} is unknown or shorter than context_start: resend the full context (context_start = 0)")]
    ResendContext(String),
    #[error("the verify queue is full; retry after {0} s")]
    QueueFull(u64),
    #[error("the verifier is busy: {backlog_secs:.0} s of scoring are waiting (over --max-backlog-secs); retry after {retry_after} s")]
    Busy { retry_after: u64, backlog_secs: f64 },
    #[error("the model is still loading")]
    NotReady,
    #[error("internal error: {0}")]
    Internal(String),
    /// The serving engine (`--engine`) failed or could not be reached.
    #[error("the serving engine failed: {0}")]
    Engine(String),
}

impl ApiError {
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        RequestError::invalid(param, message).into()
    }
}

impl From<&ApiError> for ErrorResponse {
    fn from(e: &ApiError) -> Self {
        let message = e.to_string();
        match e {
            ApiError::Request(e) => e.response(),
            ApiError::ResendContext(_) => {
                ErrorResponse::new(StatusCode::CONFLICT, "invalid_request_error", message)
                    .with_code("resend_context")
                    .with_param("context_start")
            }
            ApiError::QueueFull(secs) => {
                ErrorResponse::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message)
                    .with_code("queue_full")
                    .with_header(header::RETRY_AFTER, HeaderValue::from(*secs))
            }
            ApiError::Busy { retry_after, .. } => {
                ErrorResponse::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message)
                    .with_code("verifier_busy")
                    .with_header(header::RETRY_AFTER, HeaderValue::from(*retry_after))
            }
            ApiError::NotReady => ErrorResponse::server(StatusCode::SERVICE_UNAVAILABLE, message)
                .with_code("not_ready"),
            ApiError::Internal(_) => {
                ErrorResponse::server(StatusCode::INTERNAL_SERVER_ERROR, message)
            }
            ApiError::Engine(_) => {
                ErrorResponse::server(StatusCode::BAD_GATEWAY, message).with_code("engine_failed")
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        ErrorResponse::from(&self).into_response()
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        let invalid = |param: Option<&str>, code| {
            RequestError::Invalid { message: e.to_string(), param: param.map(str::to_string), code }
                .into()
        };
        match &e {
            EngineError::ContextTooLong { .. } => {
                invalid(Some("context"), Some("context_length_exceeded"))
            }
            EngineError::Grammar(GrammarError::Invalid(_)) => {
                invalid(Some("grammar"), Some("invalid_grammar"))
            }
            EngineError::Grammar(GrammarError::Violated { .. }) => {
                invalid(Some("context"), Some("grammar_violated"))
            }
            EngineError::TokenOutOfVocab { .. }
            | EngineError::InvalidRequest(_)
            | EngineError::Sampling(_)
            | EngineError::Verify(_) => invalid(None, None),
            other => Self::Internal(other.to_string()),
        }
    }
}
