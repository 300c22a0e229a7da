//! The OpenAPI document, generated from the handlers' annotations; spade-http adds the shared parts.

use spade_core::llama_server::{InfillAnswer, InfillChunk, InfillRequest, InfillTimings};
use spade_core::openai::{
    ChatCompletion, ChatCompletionChunk, ChatCompletionRequest, CompletionRequest, ModelList,
    SpadeUsage, TextCompletion, Usage,
};
use spade_core::vllm::{DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse};
use utoipa::OpenApi;

use spade_http::Liveness;

use crate::admin::Health;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "SPADE gateway",
        description = "Edge side of SPADE: OpenAI-compatible chat completions and completions, and llama-server's /infill, drafted locally and verified by the cloud model."
    ),
    paths(
        crate::chat::chat_completions,
        crate::completions::completions,
        crate::infill::infill,
        crate::tokenize::tokenize,
        crate::tokenize::detokenize,
        crate::admin::models,
        crate::admin::ready,
        crate::admin::live,
        crate::admin::metrics
    ),
    components(schemas(
        ChatCompletionRequest,
        ChatCompletion,
        ChatCompletionChunk,
        CompletionRequest,
        TextCompletion,
        InfillRequest,
        InfillChunk,
        InfillAnswer,
        InfillTimings,
        Usage,
        SpadeUsage,
        ModelList,
        Health,
        Liveness,
        TokenizeRequest,
        TokenizeResponse,
        DetokenizeRequest,
        DetokenizeResponse
    ))
)]
pub struct ApiDoc;
