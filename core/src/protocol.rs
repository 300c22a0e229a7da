//! Wire types of the verifier's `POST /verify` and `GET /v1/info`.
//!
//! Stateless protocol: a call carries either the full context or a session id with the ids appended
//! since that session's last call plus the resulting total length, so a verifier that lost the session
//! answers `resend_context` instead of guessing.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::dist::{DistError, SparseDist};
use crate::grammar::GrammarConstraint;
use crate::penalties::Penalties;
use crate::sampling::SamplingParams;
use crate::verify::{AcceptRule, DraftToken, NextKind};

/// One drafted token and the exact distribution it was drawn from, `[[token, prob], ...]` on q's support.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct WireDraftToken {
    pub token: u32,
    #[schema(value_type = Vec<Vec<f64>>)]
    pub q: Vec<(u32, f32)>,
}

impl WireDraftToken {
    pub fn from_draft(d: &DraftToken) -> Self {
        Self { token: d.token, q: d.q.entries().to_vec() }
    }

    pub fn to_draft(&self, vocab_size: u32) -> Result<DraftToken, DistError> {
        Ok(DraftToken { token: self.token, q: SparseDist::new(self.q.clone(), Some(vocab_size))? })
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct VerifyRequest {
    /// Names a cached context on the verifier; omit for a one-off call.
    #[serde(default)]
    pub session_id: Option<String>,
    /// Context ids starting at position `context_start`: the whole context when `context_start` is 0,
    /// else the ids appended since the session's last call.
    pub context: Vec<u32>,
    #[serde(default)]
    pub context_start: u32,
    /// Draft tokens to judge, in order (may be empty: then only the next token is produced).
    #[serde(default)]
    pub draft: Vec<WireDraftToken>,
    pub sampling: SamplingParams,
    /// Penalties and logit bias applied to the target's logits before `sampling`, counted over the
    /// context and the earlier drafts of this block. Omit for none (needs the verifier's
    /// `penalties` feature).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub penalties: Option<Penalties>,
    /// Constrains the output to a grammar (needs the verifier's `grammar` feature). Sent with the
    /// full context (`context_start` 0), kept by the session for the calls that only append: a
    /// session created without one is unconstrained.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grammar: Option<GrammarConstraint>,
    /// Seeds the per-position randomness; the same request always gets the same answer.
    #[serde(default)]
    pub seed: u64,
    /// Return the target's log-probability of each committed token, with this many top alternatives
    /// (0 to 20, `limits::MAX_TOP_LOGPROBS`). Omit for none.
    #[serde(default)]
    pub top_logprobs: Option<u8>,
}

/// A committed token's log-probability under the target (natural log), with the top alternatives.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    /// `[[token, logprob], ...]`, most likely first.
    #[schema(value_type = Vec<Vec<f64>>)]
    pub top: Vec<(u32, f32)>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct VerifyTiming {
    pub queue_ms: f64,
    pub forward_ms: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct VerifyResponse {
    /// How many draft tokens were accepted.
    pub accepted: u32,
    /// The token after the accepted drafts.
    pub next_token: u32,
    pub next_kind: NextKind,
    /// Whether `next_token` (or an accepted draft) is an end-of-sequence token of the target.
    pub eos: bool,
    /// Tokens the session now holds (context + accepted drafts + next token): the next call's
    /// `context_start` when it only appends.
    pub session_len: u32,
    /// On a call with the full context (`context_start` 0): its leading tokens whose KV rows the
    /// verifier already held (its prefix cache, or the session's own rows) and did not recompute.
    /// 0 on calls that append.
    #[serde(default)]
    pub cached_tokens: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<Vec<TokenLogprob>>,
    pub timing: VerifyTiming,
}

/// What a gateway checks before trusting a verifier.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct ModelInfo {
    pub model: String,
    pub vocab_size: u32,
    /// sha256 of the token list without its trailing padding: gateways refuse a verifier whose
    /// fingerprint differs ([`vocabulary_mismatch`]).
    pub tokenizer_fingerprint: String,
    /// Most tokens of context plus draft one call may hold.
    pub max_context: u32,
    /// Most draft tokens one call may carry (`--max-draft`): a gateway drafting more is not ready.
    pub max_draft: u32,
    /// Most `top_logprobs` one call may ask for.
    pub max_top_logprobs: u8,
    /// Optional parts of the protocol this verifier implements ([`FEATURE_PENALTIES`],
    /// [`FEATURE_GRAMMAR`], [`FEATURE_LOGPROBS`], [`FEATURE_PREFIX_CACHE`], [`FEATURE_BINARY`]); a gateway
    /// refuses requests that need one its verifier lacks.
    #[serde(default)]
    pub features: Vec<String>,
    /// The verifier's own time for a forward pass of one call's block, in milliseconds: entry `i` for
    /// `i + 1` rows (a block of `i` drafts), timed at start-up and updated as it serves
    /// ([`crate::batching::PassTimes`]). Gateways start their `auto` draft length's cost model from it.
    /// Empty from a verifier that does not time its passes.
    #[serde(default)]
    pub pass_ms: Vec<f64>,
    /// How drafts are judged. Under `match` a gateway drafts the draft model's most likely token at
    /// every temperature (the chance sum(p*q) that the target samples a draft is largest for a point
    /// mass) and sends no q.
    #[serde(default)]
    pub rule: AcceptRule,
    /// What scores the drafts: `model` (the verifier's own model) or the serving engine's kind
    /// (`llama-server`, `vllm`, `sglang`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<String>,
}

/// Most rows by which a draft's and a target's logits may differ: padding rows past their shared
/// tokens (Qwen2.5-Coder's 0.5B has 151,936, its 7B and 32B 152,064), as llama.cpp allows.
pub const MAX_VOCAB_PADDING: u32 = 128;

/// Why a draft model cannot draft for a target, or None when it can: the same tokens (fingerprints
/// of each token list without its trailing padding) and logits at most [`MAX_VOCAB_PADDING`] rows
/// apart in width.
pub fn vocabulary_mismatch(
    draft_fingerprint: &str,
    draft_width: u32,
    target_fingerprint: &str,
    target_width: u32,
) -> Option<String> {
    let short = |f: &str| f.chars().take(12).collect::<String>();
    if draft_fingerprint != target_fingerprint {
        return Some(format!(
            "the token lists differ (tokenizer fingerprint {} for the draft, {} for the target); speculative decoding needs one shared tokenizer",
            short(draft_fingerprint),
            short(target_fingerprint)
        ));
    }
    if draft_width.abs_diff(target_width) > MAX_VOCAB_PADDING {
        return Some(format!(
            "the draft's logits are {draft_width} rows wide and the target's {target_width}: the same tokens, but more than {MAX_VOCAB_PADDING} rows of padding apart"
        ));
    }
    None
}

/// `VerifyRequest::penalties` is honoured.
pub const FEATURE_PENALTIES: &str = "penalties";

/// `VerifyRequest::grammar` is honoured.
pub const FEATURE_GRAMMAR: &str = "grammar";

/// Finished sessions' KV rows are kept and reused by later sessions sharing their prefix
/// ([`VerifyResponse::cached_tokens`] says how many a call reused).
pub const FEATURE_PREFIX_CACHE: &str = "prefix_cache";

/// The HTTP header a gateway sends on each call of a conversation: a key stable across the
/// conversation's turns, for a load balancer to hash on so that its turns reach the verifier replica
/// that holds its prefix.
pub const AFFINITY_HEADER: &str = "x-spade-affinity";

/// `VerifyRequest::top_logprobs` is honoured.
pub const FEATURE_LOGPROBS: &str = "logprobs";

/// `/verify` takes and gives the binary form of [`crate::wire`].
pub const FEATURE_BINARY: &str = "binary";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_may_differ_by_padding_rows_only() {
        let (a, b) = ("a".repeat(64), "b".repeat(64));
        assert_eq!(vocabulary_mismatch(&a, 151_936, &a, 151_936), None);
        assert_eq!(
            vocabulary_mismatch(&a, 151_936, &a, 152_064),
            None,
            "Qwen2.5-Coder 0.5B drafting for its 7B"
        );
        assert_eq!(vocabulary_mismatch(&a, 152_064, &a, 151_936), None);
        let wide = vocabulary_mismatch(&a, 151_936, &a, 152_065).unwrap();
        assert!(
            wide.contains("151936") && wide.contains("152065") && wide.contains("128"),
            "{wide}"
        );
        let other = vocabulary_mismatch(&a, 151_936, &b, 151_936).unwrap();
        assert!(other.contains("aaaaaaaaaaaa") && other.contains("bbbbbbbbbbbb"), "{other}");
    }
}
