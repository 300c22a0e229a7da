//! `POST /v1/chat/completions`: validate, encode, start the generation, answer as JSON or SSE.

use axum::extract::State;
use axum::response::Response;
use serde_json::Value;
use spade_core::grammar::{response_format_grammar, GrammarConstraint};
use spade_core::openai::{
    ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, ChatMessage, MessageContent, Role,
    Turn,
};
use spade_core::tools::{forced_calls_grammar, CallFormat, ToolSpec};
use spade_http::Json;

use crate::error::ApiError;
use crate::generation::{Job, ToolCalls};
use crate::request::{self, refuse, Decoding, GenerationErrors, OutputGrammar};
use crate::respond::Shape;
use crate::state::AppState;

/// A request that passed validation; the prompt is not encoded yet.
#[derive(Debug, Clone)]
pub struct ValidChat {
    pub turns: Vec<Turn>,
    /// Shown to the model by its chat template.
    pub tools: Vec<ToolSpec>,
    /// How the answer's tool calls are parsed; None: not at all (no tools, or `tool_choice: none`).
    pub tool_calls: Option<ToolCalls>,
    pub decoding: Decoding,
}

/// Chat messages as turns for the chat template, or the named reason they cannot be.
pub(crate) fn chat_messages(input: &[ChatMessage]) -> Result<Vec<Turn>, ApiError> {
    if input.is_empty() {
        return Err(ApiError::invalid("messages", "messages must contain at least one message"));
    }
    let mut turns: Vec<Turn> = Vec::with_capacity(input.len());
    for (i, m) in input.iter().enumerate() {
        let calls = m.tool_calls.clone().unwrap_or_default();
        if !calls.is_empty() && m.role != Role::Assistant {
            return Err(ApiError::invalid(
                format!("messages[{i}].tool_calls"),
                "only assistant messages carry tool_calls",
            ));
        }
        let content = match &m.content {
            Some(MessageContent::Text(t)) => t.clone(),
            Some(MessageContent::Parts(parts)) => {
                let mut text = String::new();
                for (j, part) in parts.iter().enumerate() {
                    match (part.kind.as_str(), &part.text) {
                        ("text", Some(t)) => text.push_str(t),
                        ("text", None) => {
                            return Err(ApiError::invalid(
                                format!("messages[{i}].content[{j}].text"),
                                "a text part needs `text`",
                            ))
                        }
                        (kind, _) => {
                            return Err(refuse(
                                &format!("messages[{i}].content[{j}].type"),
                                &format!(
                                "content parts of type {kind:?} are not supported; only \"text\""
                            ),
                            ))
                        }
                    }
                }
                text
            }
            None if !calls.is_empty() => String::new(),
            None => return Err(ApiError::invalid(
                format!("messages[{i}].content"),
                "every message needs content (an assistant message with tool_calls may have none)",
            )),
        };
        let mut turn = Turn {
            role: Some(m.role),
            content,
            tool_calls: calls,
            tool_call_id: m.tool_call_id.clone(),
            name: m.name.clone(),
        };
        if m.role == Role::Tool {
            let id = m.tool_call_id.as_deref().ok_or_else(|| {
                ApiError::invalid(
                    format!("messages[{i}].tool_call_id"),
                    "a tool message needs the tool_call_id it answers",
                )
            })?;
            // Templates that name the function a result came from (Llama 3.1) find it by the call's id.
            let called = turns.iter().flat_map(|t| &t.tool_calls).find(|c| c.id == id);
            turn.name = turn.name.or_else(|| called.map(|c| c.function.name.clone()));
        }
        turns.push(turn);
    }
    Ok(turns)
}

/// `tools`, each named in errors by its index.
pub(crate) fn tool_specs(tools: Option<&Value>) -> Result<Vec<ToolSpec>, ApiError> {
    let Some(tools) = tools.filter(|t| !t.is_null()) else { return Ok(Vec::new()) };
    let list = tools.as_array().ok_or_else(|| {
        ApiError::invalid(
            "tools",
            "tools must be an array of {\"type\": \"function\", \"function\": {...}}",
        )
    })?;
    let mut specs = Vec::with_capacity(list.len());
    for (i, tool) in list.iter().enumerate() {
        let spec: ToolSpec = serde_json::from_value(tool.clone())
            .map_err(|e| ApiError::invalid(format!("tools[{i}]"), format!("not a tool: {e}")))?;
        if spec.kind != "function" {
            return Err(refuse(
                &format!("tools[{i}].type"),
                "only tools of type \"function\" are supported",
            ));
        }
        if spec.function.name.is_empty()
            || specs.iter().any(|s: &ToolSpec| s.function.name == spec.function.name)
        {
            return Err(ApiError::invalid(
                format!("tools[{i}].function.name"),
                "every tool needs a name of its own",
            ));
        }
        specs.push(spec);
    }
    Ok(specs)
}

/// `format` is how the model writes tool calls: what a forced call (`tool_choice` `required` or
/// named) is held to.
pub fn validate(req: ChatCompletionRequest, format: CallFormat) -> Result<ValidChat, ApiError> {
    let turns = chat_messages(&req.messages)?;
    let shaped = req
        .response_format
        .as_ref()
        .map(response_format_grammar)
        .transpose()
        .map_err(|(param, message)| ApiError::invalid(param, message))?;
    let mut grammar =
        shaped.flatten().map(|document| OutputGrammar { document, param: "response_format" });
    if req
        .functions
        .as_ref()
        .is_some_and(|f| !f.is_null() && f.as_array().is_none_or(|a| !a.is_empty()))
    {
        return Err(refuse(
            "functions",
            "functions (legacy function calling) are not supported: use tools",
        ));
    }
    if req.function_call.as_ref().is_some_and(|c| !c.is_null() && c.as_str() != Some("none")) {
        return Err(refuse(
            "function_call",
            "function_call (legacy function calling) is not supported: use tool_choice",
        ));
    }
    let tools = tool_specs(req.tools.as_ref())?;
    let choice = req.tool_choice.as_ref().filter(|c| !c.is_null());
    let parallel = req.parallel_tool_calls.unwrap_or(true);
    let calls_of = |tools: &[ToolSpec]| ToolCalls {
        parallel,
        names: tools.iter().map(|t| t.function.name.clone()).collect(),
    };
    // A forced call: the output is held to a grammar of the model's call format.
    let mut force = |tools: &[ToolSpec], parallel: bool| {
        if grammar.is_some() {
            return Err(refuse(
                "tool_choice",
                "a forced tool_choice and a response_format cannot both shape the output",
            ));
        }
        let lark = forced_calls_grammar(tools, format, parallel);
        grammar = Some(OutputGrammar {
            document: GrammarConstraint::lark(lark, 0).grammar,
            param: "tool_choice",
        });
        Ok(Some(ToolCalls { parallel, ..calls_of(tools) }))
    };
    let tool_calls = match choice.map(|c| c.as_str()) {
        None | Some(Some("auto")) if !tools.is_empty() => Some(calls_of(&tools)),
        None | Some(Some("auto")) | Some(Some("none")) => None,
        Some(Some("required")) if tools.is_empty() => return Err(ApiError::invalid("tool_choice", "tool_choice \"required\" needs tools")),
        Some(Some("required")) => force(&tools, parallel)?,
        Some(_) if choice.is_some_and(|c| c.get("function").is_some()) => {
            let name = choice.and_then(|c| c.pointer("/function/name")).and_then(Value::as_str).unwrap_or_default();
            let Some(tool) = tools.iter().find(|t| t.function.name == name) else {
                return Err(ApiError::invalid("tool_choice.function.name", format!("tool_choice names {name:?}, which is not one of the request's tools")));
            };
            force(std::slice::from_ref(tool), false)?
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "tool_choice",
                "tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}",
            ))
        }
    };
    let top_logprobs = match (req.logprobs, req.top_logprobs) {
        (false, Some(_)) => {
            return Err(ApiError::invalid("top_logprobs", "top_logprobs needs logprobs: true"))
        }
        (true, n) => request::top_logprobs(Some(n.unwrap_or(0)), "top_logprobs")?,
        (false, None) => None,
    };
    let max_tokens = req.max_completion_tokens.map(|m| ("max_completion_tokens", m));
    Ok(ValidChat {
        turns,
        tools,
        tool_calls,
        decoding: Decoding {
            grammar,
            ..request::decoding(req.generation, max_tokens, top_logprobs)?
        },
    })
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
pub async fn chat_completions(
    State(state): State<AppState>,
    Json(req): Json<ChatCompletionRequest>,
) -> Result<Response, ApiError> {
    state.metrics.record_request();
    let ticket = state.admission.admit(req.generation.n.unwrap_or(1)).await?;
    // Failures after the generation starts are counted by the generation itself.
    let prepared = async {
        let format = CallFormat::of_template(state.model()?.meta().chat_template.as_deref());
        let valid = validate(req, format)?;
        let prompt = state.model()?.encode_conversation(&valid.turns, &valid.tools).await?;
        let affinity = spade_core::affinity::chat_key(&valid.turns, &valid.tools);
        let job = Job {
            tool_calls: valid.tool_calls.clone(),
            affinity,
            ..request::job(&state, &valid.decoding, prompt, "messages").await?
        };
        Ok::<_, ApiError>((valid, job))
    };
    let (valid, job) = prepared.await.inspect_err(|_| state.metrics.record_failure())?;
    request::answer(&state, &valid.decoding, job, Shape::Chat, ticket).await
}
