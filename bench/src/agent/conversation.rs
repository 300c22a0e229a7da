//! The agent benchmark's scenario: a coding agent's system prompt, its tools, and the user's turns
//! (`bench/agent-conversation.json`, compiled in so the binary runs from any folder; `--conversation`
//! reads another file of the same shape).
//!
//! Each turn's request is the whole conversation so far: the system prompt, every earlier user
//! message followed by the mode's own answer to it, then the new user message, with the same `tools`
//! every time. The answers are each mode's own (under greedy decoding they must all equal
//! target-only's), so every mode's turn k+1 starts with exactly the text its turn k saw and produced:
//! what a prefix cache can reuse.
//!
//! Tool results (a test run, a file read) arrive as pasted text in user messages rather than as
//! `tool` messages: those must answer a `tool_calls` the assistant made, and with a fixed script
//! and `tool_choice: "none"` (see [`Conversation::request_body`]) no answer carries calls.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::prompts::Message;

/// The committed scenario, relative to the repository root (for messages; the text is compiled in).
pub const CONVERSATION_PATH: &str = "bench/agent-conversation.json";
const BUILT_IN: &str = include_str!("../../agent-conversation.json");

/// Characters per Qwen token in this kind of text (code and technical English), and the chat
/// template's own tokens: Qwen2.5's tool instructions around the tool list, and each message's
/// `<|im_start|>role\n … <|im_end|>\n`. Fitted to the committed scenario with the gateway's
/// `/tokenize` (turn 1: 1,410 tokens; estimate 1,412). Only for the plan's size and time estimates:
/// the run reads the real counts from `usage.prompt_tokens`.
const CHARS_PER_TOKEN: f64 = 4.3;
const TOOL_TEMPLATE_TOKENS: u64 = 30;
const MESSAGE_TEMPLATE_TOKENS: u64 = 5;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Conversation {
    pub id: String,
    #[serde(default)]
    pub description: String,
    pub system: String,
    /// OpenAI `tools`: `{"type": "function", "function": {"name", "description", "parameters"}}`.
    pub tools: Vec<Value>,
    /// The user's messages, in order.
    pub turns: Vec<String>,
}

impl Conversation {
    /// The committed scenario.
    pub fn built_in() -> Self {
        Self::parse(BUILT_IN).unwrap_or_else(|e| panic!("{CONVERSATION_PATH}: {e}"))
    }

    /// Parses and checks a scenario: at least one turn, no empty message, tools with distinct names.
    pub fn parse(text: &str) -> Result<Self, String> {
        let conversation: Self = serde_json::from_str(text).map_err(|e| e.to_string())?;
        if conversation.turns.is_empty() || conversation.system.trim().is_empty() {
            return Err("needs a system prompt and at least one user turn".into());
        }
        if let Some(i) = conversation.turns.iter().position(|t| t.trim().is_empty()) {
            return Err(format!("turn {} is empty", i + 1));
        }
        let mut names = Vec::new();
        for (i, tool) in conversation.tools.iter().enumerate() {
            let name =
                tool.pointer("/function/name").and_then(Value::as_str).filter(|n| !n.is_empty());
            match name {
                Some(n) if tool["type"] == "function" && !names.contains(&n) => names.push(n),
                _ => {
                    return Err(format!("tools[{i}] needs type \"function\" and a name of its own"))
                }
            }
        }
        Ok(conversation)
    }

    /// The messages of the turn after `answers` (turn `answers.len() + 1`): the system prompt, each
    /// earlier user message with its answer, and the next user message. Panics past the last turn.
    pub fn messages_after(&self, answers: &[String]) -> Vec<Message> {
        let message =
            |role: &str, content: &str| Message { role: role.into(), content: content.into() };
        let mut out = vec![message("system", &self.system)];
        for (user, answer) in self.turns.iter().zip(answers) {
            out.push(message("user", user));
            out.push(message("assistant", answer));
        }
        out.push(message("user", &self.turns[answers.len()]));
        out
    }

    /// The chat completion request of one turn: greedy, streamed with the usage chunk, the tools
    /// shown to the model. `tool_choice: "none"` keeps every answer plain text (a call the model
    /// writes stays in the content), so it can go back verbatim as the next turn's assistant message,
    /// and the answers of two modes compare as text.
    pub fn request_body(&self, messages: &[Message], max_tokens: u32) -> Value {
        json!({
            "model": "spade",
            "messages": messages,
            "tools": self.tools,
            "tool_choice": "none",
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": true,
            "stream_options": {"include_usage": true},
        })
    }

    /// Rough prompt tokens of turn `turn` (0-based) when every earlier answer is `answer_tokens`
    /// long: for the plan, before any model is loaded.
    pub fn approx_prompt_tokens(&self, turn: usize, answer_tokens: u32) -> u64 {
        let tools = if self.tools.is_empty() {
            0
        } else {
            TOOL_TEMPLATE_TOKENS
                + tokens_of(&serde_json::to_string(&self.tools).unwrap_or_default())
        };
        let users: u64 = self.turns[..=turn].iter().map(|t| tokens_of(t)).sum();
        let messages = 2 * turn as u64 + 2;
        tools
            + tokens_of(&self.system)
            + users
            + turn as u64 * u64::from(answer_tokens)
            + messages * MESSAGE_TEMPLATE_TOKENS
    }
}

fn tokens_of(text: &str) -> u64 {
    (text.chars().count() as f64 / CHARS_PER_TOKEN).ceil() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answers(n: usize) -> Vec<String> {
        (1..=n).map(|i| format!("answer {i}")).collect()
    }

    #[test]
    fn the_committed_scenario_is_an_agent_session() {
        let c = Conversation::built_in();
        assert!(c.turns.len() >= 8, "at least 8 user turns");
        let names: Vec<&str> =
            c.tools.iter().filter_map(|t| t.pointer("/function/name")?.as_str()).collect();
        assert_eq!(names, ["read_file", "write_file", "run_tests"]);
        assert!(c
            .tools
            .iter()
            .all(|t| t.pointer("/function/parameters/type") == Some(&json!("object"))));
        // The first turn pastes a ~60-line module.
        let code_lines = c.turns[0].lines().count();
        assert!((55..=90).contains(&code_lines), "{code_lines} lines");
        // Sized so the last turn's prompt is over 2,000 tokens (/tokenize: 2,294 with 56-token answers).
        assert!(c.approx_prompt_tokens(c.turns.len() - 1, 48) >= 2_100);
    }

    #[test]
    fn every_turn_extends_the_previous_one() {
        let c = Conversation::built_in();
        let mut previous: Vec<Message> = Vec::new();
        for turn in 0..c.turns.len() {
            let messages = c.messages_after(&answers(turn)[..]);
            assert_eq!(messages.len(), 2 * turn + 2);
            assert_eq!(messages[0].role, "system");
            assert_eq!(
                messages.last().map(|m| (m.role.as_str(), m.content.as_str())),
                Some(("user", c.turns[turn].as_str()))
            );
            if turn > 0 {
                // The previous request, then its answer, then the new user message: nothing else changes.
                assert_eq!(messages[..previous.len()], previous[..]);
                assert_eq!(
                    (
                        messages[previous.len()].role.as_str(),
                        messages[previous.len()].content.clone()
                    ),
                    ("assistant", format!("answer {turn}"))
                );
            }
            let roles: Vec<&str> = messages[1..].iter().map(|m| m.role.as_str()).collect();
            assert!(roles
                .chunks(2)
                .all(|pair| pair[0] == "user" && pair.get(1).is_none_or(|r| *r == "assistant")));
            previous = messages;
        }
    }

    #[test]
    fn requests_are_greedy_streamed_and_carry_the_tools() {
        let c = Conversation::built_in();
        let body = c.request_body(&c.messages_after(&[]), 48);
        assert_eq!(body["temperature"], 0.0);
        assert_eq!(body["max_tokens"], 48);
        assert_eq!(body["stream"], true);
        assert_eq!(body["stream_options"]["include_usage"], true);
        assert_eq!(body["tool_choice"], "none");
        assert_eq!(body["tools"].as_array().map(Vec::len), Some(3));
        assert_eq!(body["messages"][1]["content"], c.turns[0].as_str());
    }

    #[test]
    fn prompt_estimates_grow_by_each_answer_and_message() {
        let c = Conversation::built_in();
        let sizes: Vec<u64> = (0..c.turns.len()).map(|t| c.approx_prompt_tokens(t, 48)).collect();
        assert!(sizes.windows(2).all(|w| w[1] > w[0] + 48), "{sizes:?}");
        assert!(c.approx_prompt_tokens(1, 100) > c.approx_prompt_tokens(1, 48));
    }

    #[test]
    fn malformed_scenarios_are_refused() {
        let ok = json!({"id": "x", "system": "s", "tools": [{"type": "function", "function": {"name": "a"}}], "turns": ["hi"]});
        assert!(Conversation::parse(&ok.to_string()).is_ok());
        let with = |key: &str, value: Value| {
            let mut v = ok.clone();
            v[key] = value;
            Conversation::parse(&v.to_string())
        };
        assert!(with("turns", json!([])).is_err());
        assert!(with("turns", json!(["hi", " "])).unwrap_err().contains("turn 2"));
        assert!(with("system", json!("")).is_err());
        let twice = json!([{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "a"}}]);
        assert!(with("tools", twice).unwrap_err().contains("tools[1]"));
        assert!(with("tools", json!([{"type": "retrieval"}])).is_err());
        assert!(with("extra", json!(1)).is_err(), "unknown fields are refused");
    }
}
