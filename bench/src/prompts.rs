//! The benchmark prompts: one JSON object a line in `bench/prompts.jsonl` (see `bench/PROMPTS.md`).
//!
//! Acceptance rates of speculative decoding differ a lot by kind of text (code and summaries copy
//! more from their context than chat does), so every prompt carries a category to report by.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The prompt set shipped with this crate, relative to the repository root (where `scripts/bench.sh`
/// runs the benchmark). Not a compile-time absolute path: a binary from a shared target folder may
/// have been built in another checkout.
pub const PROMPTS_PATH: &str = "bench/prompts.jsonl";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Category {
    Code,
    Chat,
    Summarization,
    Qa,
}

impl Category {
    pub const ALL: [Category; 4] =
        [Category::Code, Category::Chat, Category::Summarization, Category::Qa];
}

/// A chat message, as the OpenAI chat API takes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Prompt {
    pub id: String,
    pub category: Category,
    pub messages: Vec<Message>,
    pub max_tokens: u32,
}

#[derive(Debug, thiserror::Error)]
pub enum PromptsError {
    #[error("cannot read {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path}:{line}: {source}")]
    Parse { path: PathBuf, line: usize, source: serde_json::Error },
    #[error("{path}:{line}: {problem}")]
    Invalid { path: PathBuf, line: usize, problem: String },
}

/// Reads a JSON-lines prompt file (blank lines allowed), refusing repeated ids, prompts without
/// messages and a `max_tokens` of 0.
pub fn load_prompts(path: impl AsRef<Path>) -> Result<Vec<Prompt>, PromptsError> {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path)
        .map_err(|source| PromptsError::Read { path: path.into(), source })?;
    let mut ids = HashSet::new();
    let mut prompts = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let line_no = i + 1;
        let prompt: Prompt = serde_json::from_str(line).map_err(|source| PromptsError::Parse {
            path: path.into(),
            line: line_no,
            source,
        })?;
        let problem = if !ids.insert(prompt.id.clone()) {
            Some(format!("id {:?} appears twice", prompt.id))
        } else if prompt.messages.is_empty() {
            Some("no messages".to_string())
        } else if prompt.max_tokens == 0 {
            Some("max_tokens is 0".to_string())
        } else {
            None
        };
        if let Some(problem) = problem {
            return Err(PromptsError::Invalid { path: path.into(), line: line_no, problem });
        }
        prompts.push(prompt);
    }
    Ok(prompts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_prompts_cover_every_category() {
        let prompts = load_prompts(concat!(env!("CARGO_MANIFEST_DIR"), "/prompts.jsonl")).unwrap();
        assert!(prompts.len() >= 36, "{} prompts", prompts.len());
        for category in Category::ALL {
            let n = prompts
                .iter()
                .filter(|p| p.category == category && p.max_tokens < crate::plan::LONG_MIN_TOKENS)
                .count();
            assert!(n >= 9, "{category:?}: {n} short prompts");
        }
        let long = prompts.iter().filter(|p| p.max_tokens >= crate::plan::LONG_MIN_TOKENS).count();
        assert!(long >= 2, "{long} long prompts");
        let ids: HashSet<&str> = prompts.iter().map(|p| p.id.as_str()).collect();
        assert_eq!(ids.len(), prompts.len(), "ids repeat");
        for p in &prompts {
            let words: usize =
                p.messages.iter().map(|m| m.content.split_whitespace().count()).sum();
            assert!(words <= 130, "{}: {words} words", p.id);
            assert!(p.messages.iter().all(|m| m.role == "user" || m.role == "system"), "{}", p.id);
        }
    }

    #[test]
    fn a_repeated_id_is_refused_with_its_line() {
        let dir = std::env::temp_dir().join(format!("spade-bench-prompts-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("dup.jsonl");
        let line = r#"{"id":"a","category":"qa","messages":[{"role":"user","content":"hi"}],"max_tokens":8}"#;
        std::fs::write(&path, format!("{line}\n\n{line}\n")).unwrap();
        let err = load_prompts(&path).unwrap_err();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(matches!(err, PromptsError::Invalid { line: 3, .. }), "{err}");
    }
}
