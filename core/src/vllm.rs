//! vLLM's `/tokenize` and `/detokenize` request and response shapes, which clients of OpenAI-compatible
//! servers use to count and inspect tokens.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::openai::ChatMessage;
use crate::tools::ToolSpec;

/// `POST /tokenize`: either a `prompt` (no chat template) or chat `messages` (through the model's chat
/// template, the assistant turn opened), not both.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
pub struct TokenizeRequest {
    #[serde(default)]
    pub model: Option<String>,
    #[serde(default)]
    pub prompt: Option<String>,
    #[serde(default)]
    pub messages: Option<Vec<ChatMessage>>,
    /// With `messages`: the tools, rendered by the chat template as a chat completion renders them.
    #[serde(default)]
    #[schema(value_type = Option<Vec<ToolSpec>>)]
    pub tools: Option<serde_json::Value>,
    /// With a `prompt`: add the tokenizer's special tokens (its BOS, where it has one). Default true.
    /// With `messages` the template places them, and only false is accepted.
    #[serde(default)]
    pub add_special_tokens: Option<bool>,
    /// With `messages`: open the assistant's turn, as a chat completion does. Only true is supported.
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
    /// Also return each token's string in the vocabulary (for example `Ġthe`).
    #[serde(default)]
    pub return_token_strs: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TokenizeResponse {
    pub count: usize,
    /// The context window of the served model, in tokens.
    pub max_model_len: u32,
    pub tokens: Vec<u32>,
    /// Present when `return_token_strs` was asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_strs: Option<Vec<String>>,
}

/// `POST /detokenize`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct DetokenizeRequest {
    #[serde(default)]
    pub model: Option<String>,
    /// Token ids of the served model's vocabulary.
    pub tokens: Vec<i64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct DetokenizeResponse {
    /// The text of the ids, special tokens included.
    pub prompt: String,
}
