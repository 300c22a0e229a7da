//! OpenAI-shaped errors: the response every failure of either server becomes, and the errors the kit
//! raises itself (bad JSON, body too large, bad key, unknown route, invalid parameter). Each server's
//! own error enum wraps [`RequestError`] and renders its other variants through [`ErrorResponse`].

use axum::extract::rejection::JsonRejection;
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use spade_core::ErrorBody;

/// A status, the `{"error": {...}}` body, and any headers that go with them.
#[derive(Debug, Clone)]
pub struct ErrorResponse {
    pub status: StatusCode,
    pub body: ErrorBody,
    headers: HeaderMap,
}

impl ErrorResponse {
    /// `kind` is OpenAI's error `type`: `invalid_request_error`, `authentication_error`,
    /// `rate_limit_error` or `server_error`.
    pub fn new(status: StatusCode, kind: &str, message: impl Into<String>) -> Self {
        Self { status, body: ErrorBody::new(kind, message), headers: HeaderMap::new() }
    }

    /// A 5xx `server_error`.
    pub fn server(status: StatusCode, message: impl Into<String>) -> Self {
        Self::new(status, "server_error", message)
    }

    pub fn with_code(mut self, code: impl Into<String>) -> Self {
        self.body.error.code = Some(code.into());
        self
    }

    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.body.error.param = Some(param.into());
        self
    }

    pub fn with_header(mut self, name: HeaderName, value: HeaderValue) -> Self {
        self.headers.insert(name, value);
        self
    }
}

impl IntoResponse for ErrorResponse {
    fn into_response(self) -> Response {
        (self.status, self.headers, axum::Json(self.body)).into_response()
    }
}

/// What is wrong with the request itself, whichever server it reached.
#[derive(Debug, Clone, thiserror::Error)]
pub enum RequestError {
    /// A parameter the server refuses, named in `param` where there is one.
    #[error("{message}")]
    Invalid { message: String, param: Option<String>, code: Option<&'static str> },
    #[error("invalid JSON body: {0}")]
    Json(String),
    #[error("request body too large")]
    TooLarge,
    #[error("missing or invalid API key")]
    Unauthorized,
    #[error("not found")]
    NotFound,
    #[error("method not allowed")]
    MethodNotAllowed,
}

impl RequestError {
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Invalid { message: message.into(), param: Some(param.into()), code: None }
    }

    pub fn response(&self) -> ErrorResponse {
        let invalid = |status, code: &str| {
            ErrorResponse::new(status, "invalid_request_error", self.to_string()).with_code(code)
        };
        match self {
            Self::Invalid { param, code, .. } => {
                let mut response = ErrorResponse::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_request_error",
                    self.to_string(),
                );
                response.body.error.param = param.clone();
                response.body.error.code = code.map(str::to_string);
                response
            }
            Self::Json(_) => invalid(StatusCode::BAD_REQUEST, "invalid_json"),
            Self::TooLarge => invalid(StatusCode::PAYLOAD_TOO_LARGE, "request_too_large"),
            Self::Unauthorized => ErrorResponse::new(
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                self.to_string(),
            )
            .with_code("invalid_api_key"),
            Self::NotFound => invalid(StatusCode::NOT_FOUND, "not_found"),
            Self::MethodNotAllowed => invalid(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed"),
        }
    }
}

impl IntoResponse for RequestError {
    fn into_response(self) -> Response {
        self.response().into_response()
    }
}

impl From<JsonRejection> for RequestError {
    fn from(rejection: JsonRejection) -> Self {
        match rejection {
            JsonRejection::BytesRejection(_)
                if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE =>
            {
                Self::TooLarge
            }
            other => Self::Json(other.body_text()),
        }
    }
}

/// `axum::Json`, with rejections rendered as OpenAI-shaped errors.
#[derive(Debug, Clone, Copy, Default, axum::extract::FromRequest)]
#[from_request(via(axum::Json), rejection(RequestError))]
pub struct Json<T>(pub T);

impl<T: serde::Serialize> IntoResponse for Json<T> {
    fn into_response(self) -> Response {
        axum::Json(self.0).into_response()
    }
}

/// The fallback for unknown routes.
pub async fn not_found() -> RequestError {
    RequestError::NotFound
}

/// The fallback for known routes called with another method.
pub async fn method_not_allowed() -> RequestError {
    RequestError::MethodNotAllowed
}
