//! The gateway's one error type, rendered as OpenAI-shaped bodies (and as the `error` event of a
//! stream that fails midway). What is wrong with the request itself is spade-http's `RequestError`.

use std::time::Duration;

use axum::http::{header, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use rand::Rng;
use spade_core::ErrorBody;
use spade_engine::EngineError;
use spade_http::{ErrorResponse, RequestError};

use crate::admission::Refusal;

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
    /// The gateway's line was full, or a place did not free in time (see `admission`).
    #[error("{}", overloaded_message(*why, *retry_after))]
    Overloaded { why: Refusal, retry_after: Duration },
    #[error("internal error: {0}")]
    Internal(String),
}

fn overloaded_message(why: Refusal, retry_after: Duration) -> String {
    let what = match why {
        Refusal::QueueFull => "the gateway is at capacity and its line is full (--max-queued)",
        Refusal::QueueTimeout => "no place freed while the request waited (--queue-timeout-secs)",
    };
    format!("{what}; retry after {} s", retry_after.as_secs_f64().ceil())
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
            Self::Overloaded { retry_after, .. } => {
                // retry-after-ms (read first by the OpenAI SDKs) spreads the refused clients' returns.
                let spread = retry_after.mul_f64(rand::rng().random_range(1.0..1.5));
                ErrorResponse::new(StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", message)
                    .with_code("rate_limit_exceeded")
                    .with_header(
                        header::RETRY_AFTER,
                        HeaderValue::from(retry_after.as_secs_f64().ceil() as u64),
                    )
                    .with_header(
                        HeaderName::from_static("retry-after-ms"),
                        HeaderValue::from(spread.as_millis() as u64),
                    )
            }
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
