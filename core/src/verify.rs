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

/// How a verifier decides which drafts to accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum AcceptRule {
    /// Accept x_i with probability min(1, p_i(x_i)/q_i(x_i)) ([`verify_block`]): needs the target's
    /// distributions and the draft's q.
    #[default]
    Ratio,
    /// Accept x_i while it equals the target's own sample after the same prefix ([`verify_match`]):
    /// needs only the target's tokens, so any serving engine can verify; a draft is then accepted
    /// with probability sum(p*q) instead of sum(min(p, q)).
    Match,
}

impl AcceptRule {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ratio => "ratio",
            Self::Match => "match",
        }
    }
}

impl std::fmt::Display for AcceptRule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for AcceptRule {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "ratio" => Ok(Self::Ratio),
            "match" => Ok(Self::Match),
            _ => Err(format!("unknown rule {s:?}: ratio or match")),
        }
    }
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

/// The target's own token at each of a block's d+1 positions under the match rule: a draw from
/// p_i with randomness keyed by (seed, absolute position) alone, the draw target-only sampling makes
/// at that position (the ratio rule's bonus draw too). Independent across positions, and independent
/// of what was drafted, so a seeded answer does not depend on the draft.
pub fn target_samples(p: &[SparseDist], seed: u64, first_position: u64) -> Vec<u32> {
    p.iter()
        .enumerate()
        .map(|(i, p)| p.sample(rng_for(Stream::Verify, seed, first_position + i as u64).random()))
        .collect()
}

/// A seed for an engine's sampler at one absolute position (31 bits: every engine's seed field takes
/// it), keyed like [`target_samples`], so that an engine's draw at a position is independent of
/// every other position's.
pub fn position_seed(seed: u64, position: u64) -> u32 {
    (rng_for(Stream::Verify, seed, position).random::<u64>() >> 33) as u32
}

/// The match rule: the target's own tokens y_0..y_d after the context and each drafted prefix
/// (its argmax under greedy decoding, its samples otherwise). Commit y_0, and y_i while
/// y_{i-1} = x_i: each committed token is then the target's own choice given exactly the committed
/// prefix. `target_tokens` has d+1 entries, or fewer when asked for one at a time: y_0..y_k
/// suffices where y_k is the first that differs from its draft.
pub fn verify_match(target_tokens: &[u32], drafts: &[u32]) -> Result<BlockOutcome, VerifyError> {
    let accepted = drafts.iter().zip(target_tokens).take_while(|(d, t)| d == t).count();
    if target_tokens.len() > drafts.len() + 1 || accepted == target_tokens.len() {
        return Err(VerifyError::LengthMismatch {
            expected: drafts.len() + 1,
            got: target_tokens.len(),
        });
    }
    let next_kind = if accepted == drafts.len() { NextKind::Bonus } else { NextKind::Correction };
    Ok(BlockOutcome { accepted, next_token: target_tokens[accepted], next_kind })
}
