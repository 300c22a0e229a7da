//! The one error body both servers return: OpenAI's `{"error":{"message","type","param","code"}}`.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ErrorDetail {
    /// Human-readable explanation.
    pub message: String,
    /// Error class, e.g. `invalid_request_error`, `authentication_error`, `rate_limit_error`, `server_error`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The request field at fault, when there is one.
    pub param: Option<String>,
    /// Machine-readable code, e.g. `context_length_exceeded`, `resend_context`.
    pub code: Option<String>,
}

impl ErrorBody {
    pub fn new(kind: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            error: ErrorDetail {
                message: message.into(),
                kind: kind.into(),
                param: None,
                code: None,
            },
        }
    }

    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.error.param = Some(param.into());
        self
    }

    pub fn with_code(mut self, code: impl Into<String>) -> Self {
        self.error.code = Some(code.into());
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serialises_in_openai_shape() {
        let body = ErrorBody::new("invalid_request_error", "bad").with_param("temperature");
        assert_eq!(
            serde_json::to_value(&body).unwrap(),
            serde_json::json!({"error": {"message": "bad", "type": "invalid_request_error", "param": "temperature", "code": null}})
        );
    }
}
