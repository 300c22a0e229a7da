//! OpenAI chat-completions wire types (the subset SPADE serves, plus the fields it must refuse by name).

use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::ToSchema;

mod usage;
pub use usage::{CompletionTokensDetails, PromptTokensDetails, SpadeTiming, SpadeUsage, Usage};

use crate::tools::{ToolCall, ToolCallDelta, ToolSpec};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    Developer,
    User,
    Assistant,
    Tool,
}

/// A text part of a message's content array.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ChatMessage {
    pub role: Role,
    /// May be null for an assistant message with `tool_calls`.
    #[serde(default)]
    pub content: Option<MessageContent>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// The calls an earlier assistant turn made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
    /// In a `tool` message: the call this is the result of.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

/// A chat message as the chat template sees it (content flattened to text).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Turn {
    pub role: Option<Role>,
    pub content: String,
    pub tool_calls: Vec<ToolCall>,
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
}

impl Turn {
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Self { role: Some(role), content: content.into(), ..Self::default() }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum StopSequences {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// `POST /v1/chat/completions` body. Fields SPADE cannot honour are kept so they can be refused by name.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ChatCompletionRequest {
    pub messages: Vec<ChatMessage>,
    #[serde(default)]
    pub model: Option<String>,
    #[serde(flatten)]
    pub generation: GenerationFields,
    /// Wins over `max_tokens` when both are set.
    #[serde(default)]
    pub max_completion_tokens: Option<i64>,
    #[serde(default, deserialize_with = "null_as_default")]
    pub logprobs: bool,
    #[serde(default)]
    pub top_logprobs: Option<u8>,
    /// `{"type": "text"}` (the default), `{"type": "json_object"}` (any JSON object) or
    /// `{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}`: the
    /// output is decoded under the schema's grammar, exactly as target-only decoding under it.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub response_format: Option<Value>,
    /// Functions the model may call, shown to it through its chat template; its calls come back in
    /// `message.tool_calls` (Qwen2.5 and Llama 3.1 formats are recognised).
    #[serde(default)]
    #[schema(value_type = Option<Vec<ToolSpec>>)]
    pub tools: Option<Value>,
    /// `auto`, `none` (calls are not parsed), `required` (at least one call) or
    /// `{"type": "function", "function": {"name": ...}}` (one call of that tool): forced calls are
    /// decoded under a grammar of the model's call format and the tool's parameter schema.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub tool_choice: Option<Value>,
    /// False: at most one call is returned (generation stops after the first).
    #[serde(default)]
    pub parallel_tool_calls: Option<bool>,
    /// Legacy function calling: refused by name (not silently ignored) until tools are supported.
    #[serde(default)]
    #[schema(value_type = Option<Vec<Object>>)]
    pub functions: Option<Value>,
    /// Legacy function calling: refused by name unless `"none"`.
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub function_call: Option<Value>,
}

/// The fields chat completions and (legacy) completions share: how to decode, how much, when to stop.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
pub struct GenerationFields {
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    /// Extension (vLLM, llama.cpp): keep the k most probable tokens.
    #[serde(default)]
    pub top_k: Option<u32>,
    /// Extension (vLLM, llama.cpp).
    #[serde(default)]
    pub min_p: Option<f32>,
    #[serde(default)]
    pub max_tokens: Option<i64>,
    #[serde(default)]
    pub stop: Option<StopSequences>,
    #[serde(default)]
    pub seed: Option<i64>,
    #[serde(default, deserialize_with = "null_as_default")]
    pub stream: bool,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Choices: independent generations of the prompt, 1 to 16 (choice 0 keeps `seed`).
    #[serde(default)]
    pub n: Option<u32>,
    /// Subtracted once from the logit of each token already in the completion. -2 to 2.
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    /// Subtracted from a token's logit once per occurrence in the completion. -2 to 2.
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    /// Token id (as a string) to a bias added to its logit, -100 to 100 (-100 bans the token).
    #[serde(default)]
    #[schema(value_type = Option<HashMap<String, f64>>)]
    pub logit_bias: Option<Value>,
    /// Extension (vLLM's definition): logits of tokens in the prompt or the completion are divided by
    /// it when positive, multiplied by it otherwise. > 0; 1 = off.
    #[serde(default)]
    pub repetition_penalty: Option<f32>,
    #[serde(default)]
    pub user: Option<String>,
    /// Extension: SPADE's own per-request settings.
    #[serde(default)]
    pub spade: Option<SpadeOptions>,
    /// The answer the client expects (OpenAI's predicted outputs), e.g. a file it asked to have
    /// rewritten with a small change: its tokens are proposed as drafts wherever the answer follows
    /// it, and verified like any draft, so the answer is still the model's own.
    #[serde(default)]
    pub prediction: Option<Prediction>,
}

/// OpenAI's `prediction`: `{"type": "content", "content": text or text parts}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Prediction {
    #[serde(rename = "type")]
    pub kind: String,
    pub content: MessageContent,
}

/// `POST /v1/completions` body (OpenAI's legacy completions): a raw prompt, no chat template.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    #[serde(default)]
    pub model: Option<String>,
    #[serde(flatten)]
    pub generation: GenerationFields,
    /// Return the log-probabilities of each token with this many alternatives (0 to 20).
    #[serde(default)]
    pub logprobs: Option<u8>,
    /// Put the prompt in front of the completion's text.
    #[serde(default, deserialize_with = "null_as_default")]
    pub echo: bool,
    /// Text after the completion (fill-in-the-middle): the prompt is the text before the gap and
    /// the answer its middle. Models without FIM tokens refuse it by name.
    #[serde(default)]
    pub suffix: Option<String>,
    /// Refused by name unless 1 (the server would have to rank candidates it does not return).
    #[serde(default)]
    pub best_of: Option<u32>,
}

/// A completion prompt: text, or token ids; a list of several prompts is refused by name.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

/// `null` where OpenAI accepts it for a field with a default.
fn null_as_default<'de, D: serde::Deserializer<'de>, T: Default + Deserialize<'de>>(
    d: D,
) -> Result<T, D::Error> {
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// The `spade` object of a request.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SpadeOptions {
    /// Draft tokens per verify call for this request: a number (0 = target-only decoding, one
    /// verifier pass per token; at most the gateway's `--max-draft-len` and the verifier's
    /// `--max-draft`) or `"auto"` (chosen each round from measured acceptance, draft speed, link and
    /// verifier time). Default: the gateway's `--draft-len`.
    #[serde(default)]
    pub draft_len: Option<DraftLen>,
    /// Propose drafts copied from the prompt or the answer where the answer repeats them (prompt
    /// lookup). Default: the gateway's `--prompt-lookup`.
    #[serde(default)]
    pub lookup: Option<bool>,
}

/// A draft length: `"auto"` or a fixed number of tokens per round.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(untagged)]
pub enum DraftLen {
    Fixed(u32),
    Named(DraftLenName),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum DraftLenName {
    Auto,
}

impl Default for DraftLen {
    fn default() -> Self {
        Self::AUTO
    }
}

impl DraftLen {
    pub const AUTO: Self = Self::Named(DraftLenName::Auto);

    /// The fixed length, None for `auto`.
    pub fn fixed(self) -> Option<u32> {
        match self {
            Self::Fixed(n) => Some(n),
            Self::Named(DraftLenName::Auto) => None,
        }
    }
}

impl<'de> Deserialize<'de> for DraftLen {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::{Error, Unexpected, Visitor};
        struct Expect;
        impl Visitor<'_> for Expect {
            type Value = DraftLen;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                // The request's shared fields are flattened, which loses serde's field path: name it here.
                f.write_str("spade.draft_len: a number of draft tokens or \"auto\"")
            }
            fn visit_u64<E: Error>(self, v: u64) -> Result<DraftLen, E> {
                u32::try_from(v)
                    .map(DraftLen::Fixed)
                    .map_err(|_| E::invalid_value(Unexpected::Unsigned(v), &self))
            }
            fn visit_str<E: Error>(self, v: &str) -> Result<DraftLen, E> {
                if v == "auto" {
                    Ok(DraftLen::AUTO)
                } else {
                    Err(E::invalid_value(Unexpected::Str(v), &self))
                }
            }
        }
        d.deserialize_any(Expect)
    }
}

impl std::str::FromStr for DraftLen {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::AUTO),
            n => n
                .parse()
                .map(Self::Fixed)
                .map_err(|_| format!("{s:?} is neither \"auto\" nor a number of tokens")),
        }
    }
}

impl std::fmt::Display for DraftLen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.fixed() {
            Some(n) => write!(f, "{n}"),
            None => f.write_str("auto"),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    Stop,
    Length,
    ToolCalls,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Option<Vec<u8>>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TokenLogprobContent {
    pub token: String,
    pub logprob: f32,
    pub bytes: Option<Vec<u8>>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ChoiceLogprobs {
    pub content: Vec<TokenLogprobContent>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct AssistantMessage {
    pub role: Role,
    /// Null when the answer is only tool calls.
    pub content: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct Choice {
    pub index: u32,
    pub message: AssistantMessage,
    pub logprobs: Option<ChoiceLogprobs>,
    pub finish_reason: FinishReason,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ChatCompletion {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<Choice>,
    pub usage: Usage,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_fingerprint: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
pub struct Delta {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<Role>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ChunkChoice {
    pub index: u32,
    pub delta: Delta,
    pub logprobs: Option<ChoiceLogprobs>,
    pub finish_reason: Option<FinishReason>,
}

/// One SSE `data:` payload of a streamed completion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ChatCompletionChunk {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChunkChoice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// Legacy completions' log-probabilities: parallel lists, one entry per token.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
pub struct TextLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    /// The most likely alternatives at each position, token text to log-probability.
    pub top_logprobs: Vec<std::collections::BTreeMap<String, f32>>,
    /// Where each token's text starts in `text` (echoed prompt included), in characters.
    pub text_offset: Vec<u32>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TextChoice {
    pub text: String,
    pub index: u32,
    pub logprobs: Option<TextLogprobs>,
    /// Null in a stream's chunks until the last.
    pub finish_reason: Option<FinishReason>,
}

/// A legacy completion, or one chunk of a streamed one (`object` is `text_completion` in both).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TextCompletion {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<TextChoice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ModelCard {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub owned_by: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ModelList {
    pub object: String,
    pub data: Vec<ModelCard>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_what_the_openai_sdk_sends() {
        let req: ChatCompletionRequest = serde_json::from_value(serde_json::json!({
            "model": "spade",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]}
            ],
            "stop": ["\n\n", "END"],
            "stream": true,
            "stream_options": {"include_usage": true},
            "max_completion_tokens": 16
        }))
        .unwrap();
        assert_eq!(req.messages.len(), 2);
        assert!(matches!(req.messages[1].content, Some(MessageContent::Parts(_))));
        assert_eq!(
            req.generation.stop,
            Some(StopSequences::Many(vec!["\n\n".into(), "END".into()]))
        );
        assert!(req.generation.stream_options.unwrap().include_usage);
    }

    #[test]
    fn completion_prompts_are_text_or_ids() {
        let parse = |v: serde_json::Value| serde_json::from_value::<CompletionRequest>(v).unwrap();
        assert_eq!(
            parse(serde_json::json!({"prompt": "Once", "max_tokens": 5, "echo": null})).prompt,
            Prompt::Text("Once".into())
        );
        let ids = parse(serde_json::json!({"prompt": [1, 2, 3], "logprobs": 2}));
        assert_eq!((ids.prompt, ids.logprobs), (Prompt::Tokens(vec![1, 2, 3]), Some(2)));
        assert_eq!(
            parse(serde_json::json!({"prompt": ["a", "b"]})).prompt,
            Prompt::Texts(vec!["a".into(), "b".into()])
        );
        assert_eq!(
            parse(serde_json::json!({"prompt": [[1], [2]]})).prompt,
            Prompt::TokenLists(vec![vec![1], vec![2]])
        );
        assert!(
            serde_json::from_value::<CompletionRequest>(serde_json::json!({"prompt": 3})).is_err()
        );
    }

    #[test]
    fn null_where_openai_accepts_it_and_the_spade_extension() {
        let req: ChatCompletionRequest = serde_json::from_value(serde_json::json!({
            "messages": [{"role": "user", "content": "hi"}], "stream": null, "logprobs": null, "spade": {"draft_len": "auto"}
        }))
        .unwrap();
        assert!(!req.generation.stream && !req.logprobs);
        assert_eq!(req.generation.spade.unwrap().draft_len, Some(DraftLen::AUTO));
        let fixed: SpadeOptions =
            serde_json::from_value(serde_json::json!({"draft_len": 3})).unwrap();
        assert_eq!(fixed.draft_len.and_then(DraftLen::fixed), Some(3));
        for bad in [
            serde_json::json!({"draft_len": "fast"}),
            serde_json::json!({"draft_len": -1}),
            serde_json::json!({"draftlen": 2}),
        ] {
            assert!(serde_json::from_value::<SpadeOptions>(bad.clone()).is_err(), "{bad}");
        }
        assert_eq!("auto".parse::<DraftLen>(), Ok(DraftLen::AUTO));
        assert_eq!("0".parse::<DraftLen>(), Ok(DraftLen::Fixed(0)));
        assert!("x".parse::<DraftLen>().is_err());
        assert_eq!(DraftLen::Fixed(4).to_string(), "4");
    }
}
