//! The speculative loop, in-process: draft d tokens, score them in one target pass, apply the rule,
//! commit at least one token per round, repeat until a stop token or the token budget.

use std::time::{Duration, Instant};

use spade_core::SamplingParams;

use crate::drafter::DraftParams;
use crate::round::verify_round;
use crate::{Drafter, EngineError, ScoreSession};

#[derive(Debug, Clone)]
pub struct GenerateParams {
    pub max_new_tokens: usize,
    /// Draft tokens per round; 0 = target-only decoding.
    pub draft_len: usize,
    /// Defines the target's p: the output's distribution.
    pub sampling: SamplingParams,
    /// How the draft samples its q (any choice is lossless).
    pub draft_sampling: SamplingParams,
    pub seed: u64,
    pub stop_token_ids: Vec<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    Stop,
    Length,
}

#[derive(Debug, Clone, Default)]
pub struct LoopStats {
    /// Target forward passes (one per round).
    pub target_calls: usize,
    pub drafted: usize,
    pub accepted: usize,
    /// accepted_at[i]: rounds in which draft position i was accepted; drafted_at[i]: rounds that drafted it.
    pub accepted_at: Vec<usize>,
    pub drafted_at: Vec<usize>,
    pub draft_time: Duration,
    pub target_time: Duration,
}

#[derive(Debug, Clone)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub finish: Finish,
    pub stats: LoopStats,
}

/// Generates after `prompt`. With `draft_len` 0 (or no drafter) this is plain target decoding through
/// the same scorer, which is the reference the speculative output is compared with.
pub async fn generate(
    drafter: Option<&dyn Drafter>,
    target: &mut dyn ScoreSession,
    prompt: &[u32],
    params: &GenerateParams,
) -> Result<Generation, EngineError> {
    params.sampling.validate()?;
    if let Some(drafter) = drafter {
        drafter.begin_generation(true).await;
    }
    let result = run_loop(drafter, target, prompt, params).await;
    if let Some(drafter) = drafter {
        drafter.end_generation();
    }
    result
}

async fn run_loop(drafter: Option<&dyn Drafter>, target: &mut dyn ScoreSession, prompt: &[u32], params: &GenerateParams) -> Result<Generation, EngineError> {
    let mut seq = prompt.to_vec();
    let mut out = Vec::new();
    let mut stats = LoopStats::default();
    let draft_params = DraftParams { sampling: params.draft_sampling, seed: params.seed };
    while out.len() < params.max_new_tokens {
        // A round commits at most d + 1 tokens: never draft past the budget.
        let remaining = params.max_new_tokens - out.len();
        let d = if drafter.is_some() { params.draft_len.min(remaining - 1) } else { 0 };
        let t0 = Instant::now();
        let drafts = match drafter {
            Some(drafter) if d > 0 => drafter.draft(&seq, d, &draft_params).await?,
            _ => Vec::new(),
        };
        stats.draft_time += t0.elapsed();

        let t1 = Instant::now();
        let round = verify_round(target, &seq, &drafts, &params.sampling, params.seed, None)?;
        stats.target_time += t1.elapsed();
        stats.target_calls += 1;
        let outcome = round.outcome;
        stats.drafted += drafts.len();
        stats.accepted += outcome.accepted;
        if stats.drafted_at.len() < drafts.len() {
            stats.drafted_at.resize(drafts.len(), 0);
            stats.accepted_at.resize(drafts.len(), 0);
        }
        for i in 0..drafts.len() {
            stats.drafted_at[i] += 1;
            stats.accepted_at[i] += usize::from(i < outcome.accepted);
        }
        for token in round.committed {
            seq.push(token);
            out.push(token);
            if params.stop_token_ids.contains(&token) {
                return Ok(Generation { tokens: out, finish: Finish::Stop, stats });
            }
            if out.len() == params.max_new_tokens {
                break;
            }
        }
    }
    Ok(Generation { tokens: out, finish: Finish::Length, stats })
}
