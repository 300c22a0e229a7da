//! The request and answer shapes of serving engines asked for one sampled token: what the verifier
//! sends to llama-server, vLLM or SGLang under the match rule ([`crate::verify_match`]). No I/O.
//!
//! Each position of a block is one prompt (the context and the drafts before it) and one sampled
//! token, with its own seed ([`crate::position_seed`]). The engine applies the sampling itself:
//! only the fields named here are sent, each set explicitly, so that no engine default (llama-server
//! samples with top-k 40, top-p 0.95 and min-p 0.05 unless told otherwise) changes the answer.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::sampling::SamplingParams;

/// Which engine's API the verifier speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EngineKind {
    /// llama.cpp's server: `POST /completion` with a token-id prompt, `return_tokens`.
    LlamaServer,
    /// vLLM's OpenAI server: `POST /v1/completions` with a token-id prompt, `return_token_ids`.
    Vllm,
    /// SGLang's native `POST /generate`: every position of a block in one request, one seed each.
    Sglang,
}

impl EngineKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::LlamaServer => "llama-server",
            Self::Vllm => "vllm",
            Self::Sglang => "sglang",
        }
    }

    /// The path one-token generations are posted to.
    pub fn generate_path(self) -> &'static str {
        match self {
            Self::LlamaServer => "/completion",
            Self::Vllm => "/v1/completions",
            Self::Sglang => "/generate",
        }
    }

    /// Whether one request carries all positions of a block, each with its own seed; otherwise one
    /// request per position, sent concurrently (vLLM's OpenAI server takes one seed per request).
    pub fn batches_positions(self) -> bool {
        self == Self::Sglang
    }

    /// The body asking for one token after each of `prompts`, the i-th seeded `seeds[i]`
    /// (`prompts.len()` must be 1 unless [`Self::batches_positions`]). `model`: the name vLLM
    /// serves the model under.
    pub fn request(
        self,
        prompts: &[Vec<u32>],
        sampling: &SamplingParams,
        seeds: &[u32],
        model: Option<&str>,
    ) -> Value {
        let t = if sampling.is_greedy() { 0.0 } else { sampling.temperature };
        match self {
            Self::LlamaServer => json!({
                "prompt": prompts[0],
                "n_predict": 1,
                "temperature": t,
                "top_k": sampling.top_k,
                "top_p": sampling.top_p,
                "min_p": sampling.min_p,
                // Only these, in SPADE's order (temperature first); penalties, DRY, XTC and the
                // rest stay out of the chain.
                "samplers": ["temperature", "top_k", "top_p", "min_p"],
                "seed": seeds[0],
                "cache_prompt": true,
                "return_tokens": true,
                "n_probs": 0,
            }),
            Self::Vllm => json!({
                "model": model.unwrap_or_default(),
                "prompt": prompts[0],
                "max_tokens": 1,
                "temperature": t,
                "top_k": if sampling.top_k == 0 { -1 } else { sampling.top_k as i64 },
                "top_p": sampling.top_p,
                "min_p": sampling.min_p,
                "repetition_penalty": 1.0,
                "presence_penalty": 0.0,
                "frequency_penalty": 0.0,
                "seed": seeds[0],
                "return_token_ids": true,
                "skip_special_tokens": false,
            }),
            Self::Sglang => {
                let params: Vec<Value> = seeds
                    .iter()
                    .map(|&seed| {
                        json!({
                            "max_new_tokens": 1,
                            "temperature": t,
                            "top_k": if sampling.top_k == 0 { -1 } else { sampling.top_k as i64 },
                            "top_p": sampling.top_p,
                            "min_p": sampling.min_p,
                            "sampling_seed": seed,
                            "skip_special_tokens": false,
                        })
                    })
                    .collect();
                json!({ "input_ids": prompts, "sampling_params": params })
            }
        }
    }

    /// The sampled token of each prompt, in order, from the engine's answer to [`Self::request`].
    pub fn sampled_tokens(self, answer: &Value) -> Result<Vec<u32>, String> {
        let first_id = |v: Option<&Value>, field: &str| {
            v.and_then(Value::as_array)
                .and_then(|a| a.first())
                .and_then(Value::as_u64)
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| format!("the engine's answer has no token in `{field}`"))
        };
        match self {
            Self::LlamaServer => Ok(vec![first_id(answer.get("tokens"), "tokens")?]),
            Self::Vllm => {
                let choice = answer.pointer("/choices/0");
                Ok(vec![first_id(choice.and_then(|c| c.get("token_ids")), "choices[0].token_ids")?])
            }
            Self::Sglang => {
                let items = match answer {
                    Value::Array(items) => items.iter().collect(),
                    one => vec![one],
                };
                items
                    .into_iter()
                    .map(|item| first_id(item.get("output_ids"), "output_ids"))
                    .collect()
            }
        }
    }
}

impl std::str::FromStr for EngineKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "llama-server" => Ok(Self::LlamaServer),
            "vllm" => Ok(Self::Vllm),
            "sglang" => Ok(Self::Sglang),
            _ => Err(format!("unknown engine kind {s:?}: llama-server, vllm or sglang")),
        }
    }
}

/// Up to `n` ids, spread over the vocabulary, whose text is plain enough to predict from the GGUF
/// token list alone (printable ASCII, with byte-level BPE's `Ġ`/SentencePiece's `▁` for a space),
/// with that text: an engine serving the same tokenizer detokenizes each to exactly it.
pub fn probe_tokens(tokens: &[String], n: usize) -> Vec<(u32, String)> {
    let plain = |t: &str| -> Option<String> {
        let text: String = t.chars().map(|c| if c == 'Ġ' || c == '▁' { ' ' } else { c }).collect();
        let printable = text.chars().all(|c| c.is_ascii_graphic() || c == ' ');
        (printable && text.trim().len() >= 2 && !text.starts_with('<')).then_some(text)
    };
    let step = (tokens.len() / n.max(1)).max(1);
    let mut out = Vec::new();
    let mut id = 0;
    while id < tokens.len() && out.len() < n {
        // The first plain token at or after each step.
        if let Some((i, text)) =
            tokens[id..].iter().enumerate().find_map(|(i, t)| plain(t).map(|text| (id + i, text)))
        {
            out.push((i as u32, text));
            id = i + step;
        } else {
            break;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_server_gets_every_sampler_field_set() {
        let s = SamplingParams { temperature: 0.7, top_p: 0.9, top_k: 0, min_p: 0.0 };
        let body = EngineKind::LlamaServer.request(&[vec![1, 2, 3]], &s, &[7], None);
        assert_eq!(body["prompt"], json!([1, 2, 3]));
        assert_eq!(body["n_predict"], 1);
        assert_eq!(body["seed"], 7);
        assert_eq!(body["samplers"], json!(["temperature", "top_k", "top_p", "min_p"]));
        assert!((body["temperature"].as_f64().unwrap() - 0.7).abs() < 1e-6);
        let greedy =
            EngineKind::LlamaServer.request(&[vec![1]], &SamplingParams::greedy(), &[1], None);
        assert_eq!(greedy["temperature"], 0.0);
    }

    #[test]
    fn vllm_and_sglang_shapes() {
        let s = SamplingParams::default();
        let body = EngineKind::Vllm.request(&[vec![4, 5]], &s, &[9], Some("m"));
        assert_eq!((body["model"].as_str(), body["top_k"].as_i64()), (Some("m"), Some(-1)));
        assert_eq!(body["return_token_ids"], true);
        let body = EngineKind::Sglang.request(&[vec![1], vec![1, 2]], &s, &[3, 4], None);
        assert_eq!(body["input_ids"], json!([[1], [1, 2]]));
        assert_eq!(body["sampling_params"][1]["sampling_seed"], 4);
    }

    #[test]
    fn answers_are_read_or_refused_by_name() {
        let llama = json!({"content": "x", "tokens": [151645], "stop": true});
        assert_eq!(EngineKind::LlamaServer.sampled_tokens(&llama), Ok(vec![151645]));
        let vllm = json!({"choices": [{"text": "x", "token_ids": [42]}]});
        assert_eq!(EngineKind::Vllm.sampled_tokens(&vllm), Ok(vec![42]));
        let sglang = json!([{"output_ids": [1]}, {"output_ids": [2]}]);
        assert_eq!(EngineKind::Sglang.sampled_tokens(&sglang), Ok(vec![1, 2]));
        let err = EngineKind::LlamaServer.sampled_tokens(&json!({"content": "x"})).unwrap_err();
        assert!(err.contains("tokens"), "{err}");
    }

    #[test]
    fn probes_are_plain_tokens_spread_over_the_list() {
        let tokens: Vec<String> = ["<|endoftext|>", "Ġthe", "é", "ab", "x", "Ġfoo", "▁bar", "Ċ"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let probes = probe_tokens(&tokens, 8);
        assert_eq!(
            probes,
            vec![(1, " the".into()), (3, "ab".into()), (5, " foo".into()), (6, " bar".into())]
        );
        assert_eq!(probe_tokens(&tokens, 2).len(), 2);
    }
}
