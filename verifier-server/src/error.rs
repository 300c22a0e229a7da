//! The verifier's one error type, rendered as OpenAI-shaped bodies.

use axum::extract::rejection::JsonRejection;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use spade_core::ErrorBody;
use spade_engine::EngineError;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{message}")]
    Invalid { message: String, param: Option<String>, code: Option<&'static str> },
    #[error("invalid JSON body: {0}")]
    Json(String),
    #[error("request body too large")]
    TooLarge,
    #[error("missing or invalid API key")]
    Unauthorized,
    #[error("session {0:?} is unknown or shorter than context_start: resend the full context (context_start = 0)")]
    ResendContext(String),
    #[error("the verify queue is full; retry after {0} s")]
    QueueFull(u64),
    #[error("the model is still loading")]
    NotReady,
    #[error("not found")]
    NotFound,
    #[error("method not allowed")]
    MethodNotAllowed,
    #[error("internal error: {0}")]
    Internal(String),
}

impl ApiError {
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Invalid { message: message.into(), param: Some(param.into()), code: None }
    }

    fn status(&self) -> StatusCode {
        match self {
            Self::Invalid { .. } | Self::Json(_) => StatusCode::BAD_REQUEST,
            Self::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::ResendContext(_) => StatusCode::CONFLICT,
            Self::QueueFull(_) => StatusCode::TOO_MANY_REQUESTS,
            Self::NotReady => StatusCode::SERVICE_UNAVAILABLE,
            Self::NotFound => StatusCode::NOT_FOUND,
            Self::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    pub fn body(&self) -> ErrorBody {
        let (kind, code, param) = match self {
            Self::Invalid { param, code, .. } => ("invalid_request_error", *code, param.clone()),
            Self::Json(_) => ("invalid_request_error", Some("invalid_json"), None),
            Self::TooLarge => ("invalid_request_error", Some("request_too_large"), None),
            Self::Unauthorized => ("authentication_error", Some("invalid_api_key"), None),
            Self::ResendContext(_) => ("invalid_request_error", Some("resend_context"), Some("context_start".into())),
            Self::QueueFull(_) => ("rate_limit_error", Some("queue_full"), None),
            Self::NotReady => ("server_error", Some("not_ready"), None),
            Self::NotFound => ("invalid_request_error", Some("not_found"), None),
            Self::MethodNotAllowed => ("invalid_request_error", Some("method_not_allowed"), None),
            Self::Internal(_) => ("server_error", None, None),
        };
        let mut body = ErrorBody::new(kind, self.to_string());
        body.error.code = code.map(str::to_string);
        body.error.param = param;
        body
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status(), axum::Json(self.body())).into_response();
        if let Self::QueueFull(secs) = self {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> Self {
        match spade_http::BodyRejection::from(rejection) {
            spade_http::BodyRejection::TooLarge => Self::TooLarge,
            spade_http::BodyRejection::Invalid(message) => Self::Json(message),
        }
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::ContextTooLong { .. } => {
                Self::Invalid { message: e.to_string(), param: Some("context".into()), code: Some("context_length_exceeded") }
            }
            EngineError::TokenOutOfVocab { .. } | EngineError::InvalidRequest(_) | EngineError::Sampling(_) | EngineError::Verify(_) => {
                Self::Invalid { message: e.to_string(), param: None, code: None }
            }
            other => Self::Internal(other.to_string()),
        }
    }
}

/// `axum::Json`, with rejections rendered as OpenAI-shaped errors.
#[derive(Debug, Clone, Copy, Default, axum::extract::FromRequest)]
#[from_request(via(axum::Json), rejection(ApiError))]
pub struct Json<T>(pub T);

impl<T: serde::Serialize> IntoResponse for Json<T> {
    fn into_response(self) -> Response {
        axum::Json(self.0).into_response()
    }
}
