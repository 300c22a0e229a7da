//! `POST /tokenize` and `POST /detokenize` in vLLM's shape, with the draft model's tokenizer (the
//! verifier's is the same: `/health` checks the fingerprints).

use axum::extract::State;
use spade_core::vllm::{DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse};
use spade_core::ErrorBody;
use spade_http::Json;

use crate::chat::{chat_messages, tool_specs};
use crate::error::ApiError;
use crate::request::refuse;
use crate::state::AppState;

/// Token ids of a `prompt` (no chat template), or of chat `messages` exactly as a chat completion
/// would send them to the model (the template applied, the assistant turn opened): `count` is then
/// the completion's `usage.prompt_tokens`.
#[utoipa::path(post, path = "/tokenize", request_body = TokenizeRequest, responses(
    (status = 200, description = "The token ids", body = TokenizeResponse),
    (status = 400, description = "Neither or both of `prompt` and `messages`, or an unsupported option (named in `error.param`)", body = ErrorBody),
    (status = 401, description = "Missing or wrong API key (when the gateway has one)", body = ErrorBody),
    (status = 503, description = "The draft model is loading", body = ErrorBody),
), security((), ("bearer" = [])))]
pub async fn tokenize(
    State(state): State<AppState>,
    Json(req): Json<TokenizeRequest>,
) -> Result<Json<TokenizeResponse>, ApiError> {
    let model = state.model()?.clone();
    let tokens = match (&req.prompt, &req.messages) {
        (Some(prompt), None) => {
            model.encode_text(prompt, req.add_special_tokens.unwrap_or(true)).await?
        }
        (None, Some(messages)) => {
            if req.add_generation_prompt == Some(false) {
                return Err(refuse("add_generation_prompt", "only add_generation_prompt: true is supported (the assistant turn is always opened)"));
            }
            if req.add_special_tokens == Some(true) {
                return Err(refuse("add_special_tokens", "with messages the chat template places special tokens: add_special_tokens must be false"));
            }
            model
                .encode_conversation(&chat_messages(messages)?, &tool_specs(req.tools.as_ref())?)
                .await?
        }
        (Some(_), Some(_)) => {
            return Err(ApiError::invalid("messages", "give either prompt or messages, not both"))
        }
        (None, None) => {
            return Err(ApiError::invalid("prompt", "give a prompt (text) or messages (chat)"))
        }
    };
    let token_strs = req
        .return_token_strs
        .unwrap_or(false)
        .then(|| tokens.iter().map(|&t| model.token_piece(t).unwrap_or_default()).collect());
    Ok(Json(TokenizeResponse {
        count: tokens.len(),
        max_model_len: model.meta().max_context,
        tokens,
        token_strs,
    }))
}

/// The text of token ids, special tokens included.
#[utoipa::path(post, path = "/detokenize", request_body = DetokenizeRequest, responses(
    (status = 200, description = "The text", body = DetokenizeResponse),
    (status = 400, description = "An id outside the vocabulary (`param: tokens`)", body = ErrorBody),
    (status = 401, description = "Missing or wrong API key (when the gateway has one)", body = ErrorBody),
    (status = 503, description = "The draft model is loading", body = ErrorBody),
), security((), ("bearer" = [])))]
pub async fn detokenize(
    State(state): State<AppState>,
    Json(req): Json<DetokenizeRequest>,
) -> Result<Json<DetokenizeResponse>, ApiError> {
    let model = state.model()?.clone();
    let vocab = model.meta().vocab_size;
    let mut ids = Vec::with_capacity(req.tokens.len());
    for (i, &t) in req.tokens.iter().enumerate() {
        match u32::try_from(t).ok().filter(|&id| id < vocab && model.token_piece(id).is_some()) {
            Some(id) => ids.push(id),
            None => {
                return Err(ApiError::invalid(
                    "tokens",
                    format!("tokens[{i}] is {t}: not an id of this model's vocabulary"),
                ))
            }
        }
    }
    Ok(Json(DetokenizeResponse { prompt: model.decode_all(&ids)? }))
}
