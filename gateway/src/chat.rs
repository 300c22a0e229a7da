//! `POST /v1/chat/completions`: validate, encode, start the generation, answer as JSON or SSE.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use rand::Rng;
use serde_json::Value;
use spade_core::limits::MAX_TOP_LOGPROBS;
use spade_core::openai::{ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, ChatMessage, DraftLen, MessageContent, Role, StopSequences};
use spade_core::protocol::FEATURE_PENALTIES;
use spade_core::{ErrorBody, Penalties, SamplingParams};
use spade_engine::speculative::DraftLength;
use spade_http::{Json, RequestError};
use std::collections::BTreeMap;
use tokio::sync::mpsc;

use crate::config::OfflineFallback;
use crate::error::ApiError;
use crate::generation::{self, Event, Job};
use crate::respond;
use crate::state::AppState;

const MAX_STOPS: usize = 16;

/// A request that passed validation; the prompt is not encoded yet.
#[derive(Debug, Clone)]
pub struct ValidChat {
    pub messages: Vec<(Role, String)>,
    pub sampling: SamplingParams,
    pub max_tokens: Option<usize>,
    /// Which field set `max_tokens`, for error messages.
    pub max_tokens_param: &'static str,
    pub stops: Vec<String>,
    pub seed: Option<u64>,
    pub stream: bool,
    pub include_usage: bool,
    pub top_logprobs: Option<u8>,
    /// `spade.draft_len`, where the request sets it.
    pub draft_len: Option<DraftLen>,
    /// Checked against the vocabulary, and given the prompt's length, once the prompt is encoded.
    pub penalties: Penalties,
}

pub(crate) fn refuse(param: &str, message: &str) -> ApiError {
    RequestError::Invalid { message: message.to_string(), param: Some(param.to_string()), code: Some("unsupported_parameter") }.into()
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
    if req.n.is_some_and(|n| n != 1) {
        return Err(refuse("n", "only n = 1 is supported: send several requests for several choices"));
    }
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
    let penalties = Penalties {
        presence_penalty: req.presence_penalty.unwrap_or(0.0),
        frequency_penalty: req.frequency_penalty.unwrap_or(0.0),
        repetition_penalty: req.repetition_penalty.unwrap_or(1.0),
        logit_bias: logit_bias(req.logit_bias.as_ref())?,
        prompt_len: 0,
    };
    let sampling = SamplingParams::with_defaults(req.temperature, req.top_p, req.top_k, req.min_p);
    sampling.validate().map_err(|e| RequestError::Invalid { message: e.to_string(), param: e.param(None), code: None })?;
    // Out-of-vocabulary biases are checked once the model is known (`prepare`).
    penalties.validate(u32::MAX).map_err(|e| RequestError::Invalid { message: e.to_string(), param: e.param(None), code: None })?;
    let (name, max) = match (req.max_completion_tokens, req.max_tokens) {
        (Some(m), _) => ("max_completion_tokens", Some(m)),
        (None, m) => ("max_tokens", m),
    };
    let max_tokens = match max {
        Some(m) if m < 1 => return Err(ApiError::invalid(name, format!("{name} must be at least 1 (got {m})"))),
        Some(m) => Some(usize::try_from(m).unwrap_or(usize::MAX)),
        None => None,
    };
    let stops = match req.stop {
        None => Vec::new(),
        Some(StopSequences::One(s)) => vec![s],
        Some(StopSequences::Many(v)) => v,
    };
    if stops.len() > MAX_STOPS {
        return Err(ApiError::invalid("stop", format!("at most {MAX_STOPS} stop sequences")));
    }
    if !req.stream && req.stream_options.is_some() {
        return Err(ApiError::invalid("stream_options", "stream_options is only allowed when stream is true"));
    }
    let top_logprobs = match (req.logprobs, req.top_logprobs) {
        (false, Some(_)) => return Err(ApiError::invalid("top_logprobs", "top_logprobs needs logprobs: true")),
        (true, Some(n)) if n > MAX_TOP_LOGPROBS => {
            return Err(ApiError::invalid("top_logprobs", format!("top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}")))
        }
        (true, n) => Some(n.unwrap_or(0)),
        (false, None) => None,
    };
    Ok(ValidChat {
        messages,
        sampling,
        max_tokens,
        max_tokens_param: name,
        stops,
        seed: req.seed.map(|s| s as u64),
        stream: req.stream,
        include_usage: req.stream_options.is_some_and(|o| o.include_usage),
        top_logprobs,
        draft_len: req.spade.and_then(|s| s.draft_len),
        penalties,
    })
}

/// OpenAI's `logit_bias`: an object from token ids (as strings) to numbers, or null.
fn logit_bias(value: Option<&Value>) -> Result<BTreeMap<u32, f32>, ApiError> {
    let Some(object) = value.filter(|v| !v.is_null()) else {
        return Ok(BTreeMap::new());
    };
    let object = object.as_object().ok_or_else(|| ApiError::invalid("logit_bias", "logit_bias must be an object mapping token ids to biases"))?;
    let mut bias = BTreeMap::new();
    for (key, value) in object {
        let token = key.parse::<u32>().map_err(|_| ApiError::invalid("logit_bias", format!("logit_bias key {key:?} is not a token id")))?;
        let value = value.as_f64().ok_or_else(|| ApiError::invalid("logit_bias", format!("logit_bias[{key:?}] must be a number")))?;
        bias.insert(token, value as f32);
    }
    Ok(bias)
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
        (status = 400, description = "Invalid or unsupported parameter (named in `error.param`), or prompt too long (`code: context_length_exceeded`)", body = ErrorBody),
        (status = 401, description = "Missing or wrong API key (when the gateway has one)", body = ErrorBody),
        (status = 413, description = "Body over the size limit", body = ErrorBody),
        (status = 502, description = "The verifier answered with an error, or its vocabulary differs from the draft model's", body = ErrorBody),
        (status = 503, description = "Draft model loading, or verifier unreachable (`x-should-retry: false`)", body = ErrorBody),
    ),
    security((), ("bearer" = []))
)]
pub async fn chat_completions(State(state): State<AppState>, Json(req): Json<ChatCompletionRequest>) -> Result<Response, ApiError> {
    state.metrics.record_request();
    // Failures after the generation starts are counted by the generation itself.
    let (valid, job) = prepare(&state, req).await.inspect_err(|_| state.metrics.record_failure())?;
    let meta = respond::Meta::new(&state.settings.model_name, job.prompt.len(), valid.top_logprobs.is_some());
    let (tx, mut rx) = mpsc::channel(64);
    tokio::spawn(generation::run(state.clone(), job, tx));
    // Wait for the first event, so a failure before any output gets a real status code.
    let first = rx.recv().await.ok_or_else(|| ApiError::Internal("the generation ended without a result".into()))?;
    if let Event::Failed(e) = first {
        return Err(e);
    }
    if valid.stream {
        Ok(respond::stream(meta, first, rx, valid.include_usage, state.settings.keep_alive).into_response())
    } else {
        respond::collect(meta, first, rx).await.map(|c| Json(c).into_response())
    }
}

/// Validates, encodes the prompt and sizes the token budget against the context window.
async fn prepare(state: &AppState, req: ChatCompletionRequest) -> Result<(ValidChat, Job), ApiError> {
    let valid = validate(req)?;
    let model = state.model()?.clone();
    valid.penalties.validate(model.meta().vocab_size).map_err(|e| RequestError::Invalid { message: e.to_string(), param: e.param(None), code: None })?;
    let prompt = model.encode_chat(&valid.messages).await?;
    let max_draft_len = state.settings.max_draft_len;
    let (max_context, max_draft, verify) = match state.verifier_info().await {
        Ok(info) => {
            if !valid.penalties.is_noop() && !info.features.iter().any(|f| f == FEATURE_PENALTIES) {
                return Err(refuse(
                    "logit_bias",
                    "penalties and logit_bias need a verifier that applies them (feature \"penalties\" in its /v1/info); this one does not: upgrade it",
                ));
            }
            (info.max_context.min(model.meta().max_context) as usize, max_draft_len.min(info.max_draft as usize), true)
        }
        Err(ApiError::VerifierUnavailable(e)) if state.settings.fallback == OfflineFallback::Draft => {
            tracing::warn!("verifier unreachable ({e}); answering with the draft model alone");
            (model.meta().max_context as usize, max_draft_len, false)
        }
        Err(e) => return Err(e),
    };
    let draft_len = match valid.draft_len.unwrap_or(state.settings.draft_len).fixed() {
        Some(n) if n as usize > max_draft && valid.draft_len.is_some() => {
            return Err(ApiError::invalid("spade.draft_len", format!("spade.draft_len is {n}; at most {max_draft} here (or \"auto\")")));
        }
        Some(n) => DraftLength::Fixed(n as usize),
        None => DraftLength::Auto { max: max_draft, seed: state.draft_estimates.clone() },
    };
    let too_long = |message: String| ApiError::from(RequestError::Invalid { message, param: Some("messages".into()), code: Some("context_length_exceeded") });
    if prompt.len() >= max_context {
        return Err(too_long(format!("the prompt is {} tokens; the model's context is {max_context}", prompt.len())));
    }
    let room = max_context - prompt.len();
    let cap = state.settings.max_completion_tokens;
    if let (Some(m), Some(cap)) = (valid.max_tokens, cap) {
        if m > cap {
            let param = valid.max_tokens_param;
            return Err(ApiError::invalid(param, format!("{param} is {m}; this gateway allows at most {cap}")));
        }
    }
    if let Some(m) = valid.max_tokens.filter(|&m| m > room) {
        return Err(too_long(format!("the prompt ({} tokens) plus max_tokens ({m}) exceeds the model's context of {max_context}", prompt.len())));
    }
    let penalties = Some(Penalties { prompt_len: prompt.len() as u32, ..valid.penalties.clone() }).filter(|p| !p.is_noop());
    let job = Job {
        prompt,
        penalties,
        max_tokens: valid.max_tokens.unwrap_or(room.min(cap.unwrap_or(usize::MAX))),
        sampling: valid.sampling,

        seed: valid.seed.unwrap_or_else(|| rand::rng().random()),
        stops: valid.stops.clone(),
        top_logprobs: valid.top_logprobs,
        draft_len,
        verify,
        reproducible: valid.seed.is_some() && !valid.sampling.is_greedy(),
    };
    Ok((valid, job))
}
