//! The speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023).
//!
//! For each drafted token x_i drawn from q_i: accept with probability min(1, p_i(x_i) / q_i(x_i)); at the
//! first rejection emit a token from norm(max(0, p_i - q_i)) and stop; if all d are accepted emit a bonus
//! token from p_{d+1}. Every committed token is then distributed exactly as the target's p.

use rand::Rng;
use serde::{Deserialize, Serialize};
use thiserror::Error;
use utoipa::ToSchema;

use crate::dist::SparseDist;
use crate::rng::{rng_for, Stream};

/// A drafted token and the exact distribution it was drawn from.
#[derive(Debug, Clone, PartialEq)]
pub struct DraftToken {
    pub token: u32,
    pub q: SparseDist,
}

/// Why the token after the accepted drafts was emitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum NextKind {
    /// Draft `accepted` was rejected; this token replaces it.
    Correction,
    /// Every draft was accepted; this token comes from the target's distribution after them.
    Bonus,
}

/// What one verification round commits: `drafts[..accepted]` followed by `next_token`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockOutcome {
    pub accepted: usize,
    pub next_token: u32,
    pub next_kind: NextKind,
}

impl BlockOutcome {
    /// The committed tokens, given the drafted ones.
    pub fn committed(&self, drafts: &[u32]) -> Vec<u32> {
        let mut out = drafts[..self.accepted].to_vec();
        out.push(self.next_token);
        out
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum VerifyError {
    #[error("expected {expected} target distributions (one per draft token plus one), got {got}")]
    LengthMismatch { expected: usize, got: usize },
    #[error("draft token {index} ({token}) has probability 0 under its own q")]
    OutsideSupport { index: usize, token: u32 },
}

/// Applies the rule to a block. `p` holds the target distributions at the d+1 positions after the
/// context; `first_position` is the absolute position of the first draft token (seeds the randomness).
pub fn verify_block(
    p: &[SparseDist],
    drafts: &[DraftToken],
    seed: u64,
    first_position: u64,
) -> Result<BlockOutcome, VerifyError> {
    if p.len() != drafts.len() + 1 {
        return Err(VerifyError::LengthMismatch { expected: drafts.len() + 1, got: p.len() });
    }
    if let Some((index, d)) = drafts.iter().enumerate().find(|(_, d)| d.q.prob(d.token) <= 0.0) {
        return Err(VerifyError::OutsideSupport { index, token: d.token });
    }
    for (i, draft) in drafts.iter().enumerate() {
        let mut rng = rng_for(Stream::Verify, seed, first_position + i as u64);
        let (px, qx) = (p[i].prob(draft.token), draft.q.prob(draft.token));
        // u < px / qx, without dividing.
        if rng.random::<f64>() * qx < px {
            continue;
        }
        let next_token = sample_residual(&p[i], &draft.q, rng.random());
        return Ok(BlockOutcome { accepted: i, next_token, next_kind: NextKind::Correction });
    }
    let d = drafts.len();
    let u = rng_for(Stream::Verify, seed, first_position + d as u64).random();
    Ok(BlockOutcome { accepted: d, next_token: p[d].sample(u), next_kind: NextKind::Bonus })
}

/// Samples from norm(max(0, p - q)). Only p's support can carry residual mass.
fn sample_residual(p: &SparseDist, q: &SparseDist, u: f64) -> u32 {
    let residual: Vec<(u32, f64)> = p
        .entries()
        .iter()
        .map(|&(t, _)| (t, (p.prob(t) - q.prob(t)).max(0.0)))
        .filter(|&(_, w)| w > 0.0)
        .collect();
    let total: f64 = residual.iter().map(|&(_, w)| w).sum();
    if residual.is_empty() || total <= 0.0 {
        // Only reachable through rounding when p and q agree to ~1e-16: then p itself is the residual.
        return p.sample(u);
    }
    let target = u * total;
    let mut acc = 0.0;
    for &(t, w) in &residual {
        acc += w;
        if target < acc {
            return t;
        }
    }
    residual[residual.len() - 1].0
}

/// Greedy verification: accept while the draft equals the target's argmax; the next token is the
/// target's argmax at the first mismatch (or after the block). `target_argmax` has d+1 entries.
pub fn verify_greedy(target_argmax: &[u32], drafts: &[u32]) -> Result<BlockOutcome, VerifyError> {
    if target_argmax.len() != drafts.len() + 1 {
        return Err(VerifyError::LengthMismatch {
            expected: drafts.len() + 1,
            got: target_argmax.len(),
        });
    }
    let accepted = drafts.iter().zip(target_argmax).take_while(|(d, t)| d == t).count();
    let next_kind = if accepted == drafts.len() { NextKind::Bonus } else { NextKind::Correction };
    Ok(BlockOutcome { accepted, next_token: target_argmax[accepted], next_kind })
}
