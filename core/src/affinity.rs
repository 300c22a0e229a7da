//! The routing key of a conversation: what a load balancer in front of several verifier replicas
//! hashes on ([`crate::protocol::AFFINITY_HEADER`]) so that every turn of a conversation reaches the
//! replica whose prefix cache holds it.
//!
//! The key must stay the same as the conversation grows, and differ between conversations. A chat
//! resends every earlier message each turn, so the key is taken from what no later turn changes: the
//! tools and the messages up to and including the first user message. A raw prompt has no messages:
//! its first [`PROMPT_KEY_TOKENS`] tokens stand for it. The per-generation session id is no use here,
//! since each turn is a new generation.
//!
//! The hash is FNV-1a (64 bits), written out so that every build and version of the gateway computes
//! the same key for the same conversation. It only spreads load: nothing depends on it being secret.

use crate::openai::{Role, Turn};
use crate::tools::ToolSpec;

/// Tokens of a raw prompt (`/v1/completions`) the key covers.
pub const PROMPT_KEY_TOKENS: usize = 64;

/// The key of a chat: its tools and its messages through the first user message.
pub fn chat_key(turns: &[Turn], tools: &[ToolSpec]) -> String {
    let mut h = Fnv::default();
    for tool in tools {
        h.write(serde_json::to_string(tool).unwrap_or_default().as_bytes());
        h.separator();
    }
    let opening =
        turns.iter().position(|t| t.role == Some(Role::User)).map_or(turns.len(), |i| i + 1);
    for turn in &turns[..opening] {
        h.write(
            turn.role
                .map(|r| serde_json::to_string(&r).unwrap_or_default())
                .unwrap_or_default()
                .as_bytes(),
        );
        h.separator();
        h.write(turn.content.as_bytes());
        h.separator();
        h.write(serde_json::to_string(&turn.tool_calls).unwrap_or_default().as_bytes());
        h.separator();
        for s in [&turn.name, &turn.tool_call_id] {
            h.write(s.as_deref().unwrap_or("").as_bytes());
            h.separator();
        }
    }
    h.hex()
}

/// The key of a raw prompt's token ids: its first [`PROMPT_KEY_TOKENS`].
pub fn prompt_key(prompt: &[u32]) -> String {
    let mut h = Fnv::default();
    for t in &prompt[..prompt.len().min(PROMPT_KEY_TOKENS)] {
        h.write(&t.to_le_bytes());
    }
    h.hex()
}

struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }

    /// Ends a field, so that ("ab", "c") and ("a", "bc") differ.
    fn separator(&mut self) {
        self.write(&[0xff]);
    }

    fn hex(&self) -> String {
        format!("{:016x}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(n: usize) -> Vec<Turn> {
        let mut turns = vec![
            Turn::new(Role::System, "You are a coding agent."),
            Turn::new(Role::User, "Fix the bug in parse()."),
        ];
        for i in 0..n {
            turns.push(Turn::new(Role::Assistant, format!("answer {i}")));
            turns.push(Turn::new(Role::User, format!("follow-up {i}")));
        }
        turns
    }

    #[test]
    fn a_conversation_keeps_its_key_as_it_grows() {
        let key = chat_key(&chat(0), &[]);
        assert_eq!(key.len(), 16);
        assert!(key.chars().all(|c| c.is_ascii_hexdigit()));
        for n in 1..5 {
            assert_eq!(chat_key(&chat(n), &[]), key, "turn {n}");
        }
    }

    #[test]
    fn other_conversations_get_other_keys() {
        let key = chat_key(&chat(2), &[]);
        let mut other = chat(2);
        other[1].content = "Fix the bug in render().".into();
        assert_ne!(chat_key(&other, &[]), key, "another first question");
        let mut system = chat(2);
        system[0].content = "You are a reviewer.".into();
        assert_ne!(chat_key(&system, &[]), key, "another system prompt");
        let tool: ToolSpec = serde_json::from_str(
            r#"{"type":"function","function":{"name":"read_file","parameters":{"type":"object"}}}"#,
        )
        .unwrap();
        assert_ne!(chat_key(&chat(2), &[tool]), key, "tools");
        // Field boundaries count: moving text between fields changes the key.
        let a = [Turn::new(Role::User, "ab")];
        let mut b = [Turn::new(Role::User, "a")];
        b[0].name = Some("b".into());
        assert_ne!(chat_key(&a, &[]), chat_key(&b, &[]));
    }

    #[test]
    fn a_prompt_is_keyed_by_its_first_tokens() {
        let long: Vec<u32> = (0..200).collect();
        assert_eq!(prompt_key(&long[..PROMPT_KEY_TOKENS]), prompt_key(&long));
        assert_ne!(prompt_key(&long[..10]), prompt_key(&long));
        // The published FNV-1a test vector: the empty input hashes to the offset basis.
        assert_eq!(prompt_key(&[]), "cbf29ce484222325");
    }
}
