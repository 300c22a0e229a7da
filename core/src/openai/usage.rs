//! `usage`: OpenAI's token accounting and SPADE's extension object on it.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::DraftLen;
use crate::draft_control;

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
pub struct CompletionTokensDetails {
    /// Tokens of the request's `prediction` that the answer kept (0 without one).
    pub accepted_prediction_tokens: u32,
    /// Tokens of the request's `prediction` the answer did not keep (0 without one).
    pub rejected_prediction_tokens: u32,
}

/// SPADE's own accounting, an extension object on `usage`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
pub struct SpadeUsage {
    pub verify_calls: u32,
    pub mean_tokens_per_call: f64,
    /// The draft length this request ran with: a number, or `"auto"`.
    pub draft_len: DraftLen,
    /// The rule the verifier judged the drafts by (`ratio` or `match`); absent where no call reached it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<crate::AcceptRule>,
    /// Rounds that drafted ahead while a block was verified, and how many of those blocks were sent
    /// (the verifier's answer confirmed the continuation they were drafted on).
    pub ahead_drafted: u32,
    pub ahead_used: u32,
    pub timing: SpadeTiming,
    /// Under `auto`: the last choice and the estimates it was made from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto: Option<draft_control::DraftChoice>,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    /// True when the verifier was unreachable and the draft model answered alone.
    pub degraded: bool,
    /// Tokens the draft model proposed, and how many of them the target accepted
    /// (`completion_tokens_details` counts the request's `prediction`, as OpenAI's).
    pub drafted: u32,
    pub draft_accepted: u32,
    /// Tokens proposed by prompt lookup (copied from the prompt or the answer), and accepted.
    pub looked_up: u32,
    pub looked_up_accepted: u32,
    /// Prompt tokens the draft model did not recompute: its prefix cache held them from an earlier
    /// request when it started on the prompt (`prompt_tokens_details.cached_tokens` is the
    /// target's). Absent where the draft model did not draft.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draft_cached_tokens: Option<u32>,
}

/// Where a generation's time went, in seconds.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
pub struct SpadeTiming {
    /// Drafting the generation waited for.
    pub draft_s: f64,
    /// Drafting hidden under verify calls (draft-ahead).
    pub overlap_s: f64,
    /// Verify calls minus the verifier's own time: the link, both ways.
    pub link_s: f64,
    /// The verifier's own time (queue and forward passes), as it reports it.
    pub verifier_s: f64,
}

/// OpenAI's breakdown of the prompt tokens.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
pub struct PromptTokensDetails {
    /// Prompt tokens the target model did not recompute: its prefix cache held them from an earlier
    /// request (a conversation's earlier turns).
    pub cached_tokens: u32,
}

#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize, ToSchema)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    #[serde(default)]
    pub prompt_tokens_details: PromptTokensDetails,
    pub completion_tokens_details: CompletionTokensDetails,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spade: Option<SpadeUsage>,
}
