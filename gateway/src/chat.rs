//! `POST /v1/chat/completions`: validate, encode, start the generation, answer as JSON or SSE.

use axum::extract::State;
use axum::response::Response;
use spade_core::openai::{ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, ChatMessage, MessageContent, Role};
use spade_http::Json;

use crate::error::ApiError;
use crate::request::{self, refuse, Decoding, GenerationErrors};
use crate::respond::Shape;
use crate::state::AppState;

/// A request that passed validation; the prompt is not encoded yet.
#[derive(Debug, Clone)]
pub struct ValidChat {
    pub messages: Vec<(Role, String)>,
    pub decoding: Decoding,
}

/// Chat messages as `(role, text)` pairs for the chat template, or the named reason they cannot be.
pub(crate) fn chat_messages(input: &[ChatMessage]) -> Result<Vec<(Role, String)>, ApiError> {
    if input.is_empty() {
        return Err(ApiError::invalid("messages", "messages must contain at least one message"));
    }
    let mut messages = Vec::with_capacity(input.len());
    for (i, m) in input.iter().enumerate() {
        if m.role == Role::Tool {
            return Err(refuse(&format!("messages[{i}].role"), "tool messages are not supported (SPADE does not support tools)"));
        }
        let content = match &m.content {
            Some(MessageContent::Text(t)) => t.clone(),
            Some(MessageContent::Parts(parts)) => {
                let mut text = String::new();
                for (j, part) in parts.iter().enumerate() {
                    match (part.kind.as_str(), &part.text) {
                        ("text", Some(t)) => text.push_str(t),
                        ("text", None) => return Err(ApiError::invalid(format!("messages[{i}].content[{j}].text"), "a text part needs `text`")),
                        (kind, _) => {
                            return Err(refuse(
                                &format!("messages[{i}].content[{j}].type"),
                                &format!("content parts of type {kind:?} are not supported; only \"text\""),
                            ))
                        }
                    }
                }
                text
            }
            None => return Err(ApiError::invalid(format!("messages[{i}].content"), "every message needs content")),
        };
        messages.push((m.role, content));
    }
    Ok(messages)
}

pub fn validate(req: ChatCompletionRequest) -> Result<ValidChat, ApiError> {
    let messages = chat_messages(&req.messages)?;
    if let Some(format) = req.response_format.as_ref().filter(|f| !f.is_null()) {
        if format.get("type").and_then(|t| t.as_str()) != Some("text") {
            return Err(refuse("response_format", "only response_format {\"type\": \"text\"} is supported (no JSON mode or schemas)"));
        }
    }
    if req.tools.as_ref().is_some_and(|t| !t.is_null() && t.as_array().is_none_or(|a| !a.is_empty())) {
        return Err(refuse("tools", "tools are not supported"));
    }
    if req.tool_choice.as_ref().is_some_and(|c| !c.is_null() && c.as_str() != Some("none")) {
        return Err(refuse("tool_choice", "tool_choice is not supported (only \"none\")"));
    }
    if req.functions.as_ref().is_some_and(|f| !f.is_null() && f.as_array().is_none_or(|a| !a.is_empty())) {
        return Err(refuse("functions", "functions (legacy function calling) are not supported"));
    }
    if req.function_call.as_ref().is_some_and(|c| !c.is_null() && c.as_str() != Some("none")) {
        return Err(refuse("function_call", "function_call is not supported (only \"none\")"));
    }
    let top_logprobs = match (req.logprobs, req.top_logprobs) {
        (false, Some(_)) => return Err(ApiError::invalid("top_logprobs", "top_logprobs needs logprobs: true")),
        (true, n) => request::top_logprobs(Some(n.unwrap_or(0)), "top_logprobs")?,
        (false, None) => None,
    };
    let max_tokens = req.max_completion_tokens.map(|m| ("max_completion_tokens", m));
    Ok(ValidChat { messages, decoding: request::decoding(req.generation, max_tokens, top_logprobs)? })
}

/// Create a chat completion.
///
/// Drafts with the edge model, verifies every block with the cloud model, and returns the cloud
/// model's output: identical to it token for token under greedy decoding (temperature 0), and with
/// its distribution under sampling. With `stream: true` the answer is a `text/event-stream` of
/// `chat.completion.chunk` objects ending in `data: [DONE]`; an error during the stream arrives as a
/// `data: {"error": {...}}` event, after which the stream ends.
#[utoipa::path(
    post,
    path = "/v1/chat/completions",
    request_body = ChatCompletionRequest,
    responses(
        (status = 200, description = "The completion (`stream: false`), or a stream of chunks (`stream: true`)",
            content(
                (ChatCompletion = "application/json"),
                (ChatCompletionChunk = "text/event-stream"),
            )),
        GenerationErrors,
    ),
    security((), ("bearer" = []))
)]
pub async fn chat_completions(State(state): State<AppState>, Json(req): Json<ChatCompletionRequest>) -> Result<Response, ApiError> {
    state.metrics.record_request();
    // Failures after the generation starts are counted by the generation itself.
    let prepared = async {
        let valid = validate(req)?;
        let prompt = state.model()?.encode_chat(&valid.messages).await?;
        let job = request::job(&state, &valid.decoding, prompt, "messages").await?;
        Ok::<_, ApiError>((valid, job))
    };
    let (valid, job) = prepared.await.inspect_err(|_| state.metrics.record_failure())?;
    request::answer(&state, &valid.decoding, job, Shape::Chat).await
}
