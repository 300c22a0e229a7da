//! Wire types of llama-server's `POST /infill`, the endpoint editor plugins (llama.vim,
//! llama.vscode) complete code with. Fields llama-server takes and we do not use are accepted and
//! ignored where they cannot change the answer, and refused by name (by the gateway) where they would.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use utoipa::ToSchema;

/// `POST /infill` body.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct InfillRequest {
    /// Text before the cursor.
    #[serde(default)]
    pub input_prefix: String,
    /// Text after the cursor.
    #[serde(default)]
    pub input_suffix: String,
    /// Context from other files (or other parts of this one), oldest first.
    #[serde(default)]
    pub input_extra: Vec<InfillChunk>,
    /// Text the middle starts with (llama.vim: the cursor's line up to the cursor), after the prefix.
    #[serde(default)]
    pub prompt: String,
    /// Most tokens to generate; -1 (the default): until the end of the context.
    #[serde(default)]
    pub n_predict: Option<i64>,
    /// Default 0.8, as llama-server's.
    #[serde(default)]
    pub temperature: Option<f32>,
    /// Default 40; 0 or less keeps every token.
    #[serde(default)]
    pub top_k: Option<i64>,
    /// Default 0.95.
    #[serde(default)]
    pub top_p: Option<f32>,
    /// Default 0.05.
    #[serde(default)]
    pub min_p: Option<f32>,
    /// -1 (the default): a random seed.
    #[serde(default)]
    pub seed: Option<i64>,
    #[serde(default)]
    pub stop: Vec<String>,
    #[serde(default)]
    pub stream: bool,
    /// Once a line has ended, a line indented less than this ends the answer (without that line).
    #[serde(default)]
    pub n_indent: usize,
    /// Once this many ms have passed since the first token, the answer ends with the next line end.
    #[serde(default)]
    pub t_max_predict_ms: u64,
    /// Only these fields of the answer, `/`-separated paths such as `timings/predicted_n`, each
    /// under its path as one key.
    #[serde(default)]
    pub response_fields: Vec<String>,
    /// llama-server's repetition penalty over the last 64 tokens: only 1 (off) is taken.
    #[serde(default)]
    pub repeat_penalty: Option<f32>,
    /// llama-server's, over the last 64 tokens: only 0 is taken.
    #[serde(default)]
    pub presence_penalty: Option<f32>,
    /// llama-server's, over the last 64 tokens: only 0 is taken.
    #[serde(default)]
    pub frequency_penalty: Option<f32>,
    /// Token probabilities in the answer: only 0 is taken.
    #[serde(default)]
    pub n_probs: Option<u32>,
}

/// One chunk of `input_extra`.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct InfillChunk {
    /// Default `tmp`, as llama-server's.
    #[serde(default)]
    pub filename: Option<String>,
    #[serde(default)]
    pub text: String,
}

/// `/infill`'s answer (and, with `stop: true`, the last event of its stream), as llama-server's.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct InfillAnswer {
    pub index: u32,
    /// The middle (in a stream: the text since the last event).
    pub content: String,
    /// Always empty: the text is in `content`.
    pub tokens: Vec<u32>,
    pub id_slot: i32,
    /// True on the answer and on a stream's last event.
    pub stop: bool,
    pub model: String,
    pub tokens_predicted: u64,
    /// Prompt tokens.
    pub tokens_evaluated: u64,
    pub has_new_line: bool,
    /// Part of the prefix, suffix or extra context was cut to fit, as llama-server cuts it.
    pub truncated: bool,
    /// `eos` (the model ended the middle), `word` (a stop string), `limit` (`n_predict` or a line
    /// rule), `none` (still going).
    pub stop_type: String,
    pub stopping_word: String,
    /// Prompt tokens the verifier's prefix cache held.
    pub tokens_cached: u64,
    pub timings: InfillTimings,
}

#[derive(Debug, Clone, Default, Serialize, ToSchema)]
pub struct InfillTimings {
    /// Prompt tokens computed (not cached).
    pub prompt_n: u64,
    /// Until the first token.
    pub prompt_ms: f64,
    pub prompt_per_token_ms: f64,
    pub prompt_per_second: f64,
    pub predicted_n: u64,
    pub predicted_ms: f64,
    pub predicted_per_token_ms: f64,
    pub predicted_per_second: f64,
}

impl InfillTimings {
    pub fn new(prompt_n: u64, prompt_ms: f64, predicted_n: u64, predicted_ms: f64) -> Self {
        let per = |n: u64, ms: f64| if n > 0 { ms / n as f64 } else { 0.0 };
        let rate = |n: u64, ms: f64| if ms > 0.0 { n as f64 * 1e3 / ms } else { 0.0 };
        Self {
            prompt_n,
            prompt_ms,
            prompt_per_token_ms: per(prompt_n, prompt_ms),
            prompt_per_second: rate(prompt_n, prompt_ms),
            predicted_n,
            predicted_ms,
            predicted_per_token_ms: per(predicted_n, predicted_ms),
            predicted_per_second: rate(predicted_n, predicted_ms),
        }
    }
}

/// `response_fields`: only the values at these `/`-separated paths, each under its path as one key
/// (paths that lead nowhere are left out), as llama-server answers them. No paths: all of `answer`.
pub fn select_fields(answer: Value, paths: &[String]) -> Value {
    if paths.is_empty() {
        return answer;
    }
    let mut out = Map::new();
    for path in paths {
        let found = path.split('/').try_fold(&answer, |v, key| v.get(key));
        if let Some(value) = found {
            out.insert(path.clone(), value.clone());
        }
    }
    Value::Object(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn selected_fields_are_flattened_under_their_paths() {
        let answer = json!({"content": "x", "timings": {"predicted_n": 3}, "truncated": false});
        let paths = ["content", "timings/predicted_n", "timings/nothing", ""].map(String::from);
        assert_eq!(
            select_fields(answer.clone(), &paths),
            json!({"content": "x", "timings/predicted_n": 3})
        );
        assert_eq!(select_fields(answer.clone(), &[]), answer);
    }

    #[test]
    fn llama_vims_requests_parse_and_unknown_fields_are_ignored() {
        let fim: InfillRequest = serde_json::from_value(json!({
            "id_slot": 0, "input_prefix": "def f():\n", "input_suffix": "\n", "input_extra": [{"filename": "a.py", "text": "x = 1\n"}],
            "prompt": "    ", "n_predict": 128, "stop": [], "n_indent": 4, "top_k": 40, "top_p": 0.9,
            "samplers": ["top_k", "top_p", "infill"], "stream": false, "cache_prompt": true,
            "t_max_prompt_ms": 500, "t_max_predict_ms": 1000, "response_fields": ["content", "timings/prompt_n"],
            "model": "anything"
        }))
        .unwrap();
        assert_eq!((fim.n_indent, fim.t_max_predict_ms, fim.input_extra.len()), (4, 1000, 1));
        assert_eq!(fim.input_extra[0].filename.as_deref(), Some("a.py"));
    }
}
