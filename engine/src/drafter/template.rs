//! The draft model as the gateway's edge model: chat templates, tokenizing and decoding.

use either::Either;
use indexmap::IndexMap;
use mistralrs::core::MessageContent;
use spade_core::grammar::Vocabulary;

use super::MistralDrafter;
use crate::{EngineError, Role, ToolSpec, Turn};

/// A turn as chat templates read it: `role` and `content`, plus `tool_calls` (arguments as JSON
/// objects, as Hugging Face templates expect), `tool_call_id` and `name` where set.
pub(super) fn template_message(turn: &Turn) -> IndexMap<String, MessageContent> {
    // Chat templates know no `developer`: it is OpenAI's newer name for the system prompt.
    let role = match turn.role.unwrap_or(Role::User) {
        Role::System | Role::Developer => "system",
        Role::User => "user",
        Role::Assistant => "assistant",
        Role::Tool => "tool",
    };
    let mut m = IndexMap::from([
        ("role".to_string(), Either::Left(role.to_string())),
        ("content".to_string(), Either::Left(turn.content.clone())),
    ]);
    if !turn.tool_calls.is_empty() {
        let calls = turn
            .tool_calls
            .iter()
            .map(|c| {
                let arguments = serde_json::from_str(&c.function.arguments)
                    .unwrap_or_else(|_| serde_json::Value::String(c.function.arguments.clone()));
                IndexMap::from([
                    ("id".to_string(), serde_json::Value::String(c.id.clone())),
                    ("type".to_string(), serde_json::Value::String("function".into())),
                    (
                        "function".to_string(),
                        serde_json::json!({"name": c.function.name, "arguments": arguments}),
                    ),
                ])
            })
            .collect();
        m.insert("tool_calls".into(), Either::Right(calls));
    }
    for (key, value) in [("tool_call_id", &turn.tool_call_id), ("name", &turn.name)] {
        if let Some(v) = value {
            m.insert(key.into(), Either::Left(v.clone()));
        }
    }
    m
}

#[async_trait::async_trait]
impl crate::EdgeModel for MistralDrafter {
    async fn encode_conversation(
        &self,
        turns: &[Turn],
        tools: &[ToolSpec],
    ) -> Result<Vec<u32>, EngineError> {
        self.apply_chat_template(turns, tools).await
    }

    fn decode(&self, tokens: &[u32]) -> Result<String, EngineError> {
        self.tokenizer
            .decode(tokens, true)
            .map_err(|e| EngineError::Drafter(format!("decoding: {e}")))
    }

    async fn encode_text(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, EngineError> {
        let runner = self.runner.read().await;
        let tokenized = runner
            .model
            .tokenize(Either::Right(text.to_string()), None, add_special_tokens, false, None)
            .await;
        tokenized.map_err(|e| EngineError::Drafter(e.to_string()))
    }

    fn decode_all(&self, tokens: &[u32]) -> Result<String, EngineError> {
        self.tokenizer
            .decode(tokens, false)
            .map_err(|e| EngineError::Drafter(format!("decoding: {e}")))
    }

    fn vocabulary(&self) -> Result<&Vocabulary, EngineError> {
        self.vocabulary.get(&self.meta)
    }

    fn token_piece(&self, id: u32) -> Option<String> {
        self.tokenizer.id_to_token(id)
    }
}
