//! One verification round on the target: score context + drafts in one pass, apply the rule.
//! Shared by the in-process loop and the verifier server, so both decide identically.

use std::time::{Duration, Instant};

use spade_core::grammar::GrammarState;
use spade_core::protocol::TokenLogprob;
use spade_core::{
    distribution, target_samples, verify_block, verify_match, AcceptRule, BlockOutcome, DraftToken,
    Penalties, SamplingParams, SparseDist,
};

use crate::{EngineError, ScoreSession};

#[derive(Debug, Clone)]
pub struct RoundResult {
    pub outcome: BlockOutcome,
    /// Accepted drafts followed by the correction or bonus token.
    pub committed: Vec<u32>,
    /// Target log-probabilities (natural log, temperature 1, before penalties and truncation) of the committed
    /// tokens, with the `top_logprobs` most likely alternatives; empty unless asked for.
    pub logprobs: Vec<TokenLogprob>,
    pub forward_time: Duration,
}

/// How the target's logits become the distribution every committed token follows.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TargetRule {
    pub sampling: SamplingParams,
    /// None when they would change nothing.
    pub penalties: Option<Penalties>,
    /// How drafts are judged against those distributions.
    pub accept: AcceptRule,
}

impl TargetRule {
    /// The target's distributions at the block's d+1 positions: position i sees the context and
    /// drafts `..i` as its history, exactly what target-only decoding would have seen there.
    fn distributions(
        &self,
        logits: &[Vec<f32>],
        context: &[u32],
        drafts: &[u32],
    ) -> Result<Vec<SparseDist>, EngineError> {
        let Some(penalties) = &self.penalties else {
            return Ok(logits
                .iter()
                .map(|l| distribution(l, &self.sampling))
                .collect::<Result<_, _>>()?);
        };
        let mut history = penalties.history(context);
        let mut p = Vec::with_capacity(logits.len());
        for (i, row) in logits.iter().enumerate() {
            let mut row = row.clone();
            history.apply(&mut row);
            p.push(distribution(&row, &self.sampling)?);
            if let Some(&token) = drafts.get(i) {
                history.push(token);
            }
        }
        Ok(p)
    }
}

/// One verification round's inputs: the committed context, the drafted block with its q, and how
/// the target decides.
pub struct Round<'a> {
    pub context: &'a [u32],
    pub drafts: &'a [DraftToken],
    pub rule: &'a TargetRule,
    /// The output's grammar, brought to the end of `context`.
    pub grammar: Option<&'a mut GrammarState>,
    pub seed: u64,
    pub top_logprobs: Option<usize>,
}

/// A round's logits, however they were scored.
pub struct ScoredBlock {
    /// `[drafts + 1][vocab]`: the last rows of [`Round::tokens`].
    pub logits: Vec<Vec<f32>>,
    /// The session's [`ScoreSession::text_tokens`].
    pub text_tokens: usize,
    pub forward_time: Duration,
}

impl Round<'_> {
    /// Scores `context + drafts` (reusing the session's cache) and applies the speculative-sampling
    /// rule with randomness keyed by `(seed, position)`: the same inputs always give the same result.
    pub fn verify(self, session: &mut dyn ScoreSession) -> Result<RoundResult, EngineError> {
        let tokens = self.tokens()?;
        let started = Instant::now();
        let logits = session.score(&tokens, self.drafts.len() + 1)?;
        self.judge(ScoredBlock {
            logits,
            text_tokens: session.text_tokens(),
            forward_time: started.elapsed(),
        })
    }

    /// The sequence a round scores, context then drafts; its last `drafts.len() + 1` positions need
    /// logits. Scored by [`Self::verify`], or by a batched pass that then calls [`Self::judge`].
    pub fn tokens(&self) -> Result<Vec<u32>, EngineError> {
        if self.context.is_empty() {
            return Err(EngineError::InvalidRequest("the context is empty".into()));
        }
        Ok(self.context.iter().copied().chain(self.drafts.iter().map(|d| d.token)).collect())
    }

    /// The rule applied to the scored block. With a grammar, each row of logits is first masked with
    /// the grammar's state after the drafts before it, as target-only decoding under that grammar
    /// would.
    pub fn judge(self, scored: ScoredBlock) -> Result<RoundResult, EngineError> {
        let Round { context, drafts, rule, grammar, seed, top_logprobs } = self;
        let ScoredBlock { mut logits, text_tokens, forward_time } = scored;
        if logits.len() != drafts.len() + 1 {
            return Err(EngineError::InvalidRequest(format!(
                "{} logit rows for {} drafts",
                logits.len(),
                drafts.len()
            )));
        }
        let draft_tokens: Vec<u32> = drafts.iter().map(|d| d.token).collect();
        // Padding rows are no text: masked in every mode (log-probabilities included), so a target
        // paired with a draft that lacks them answers exactly as it does alone.
        for row in &mut logits {
            row.iter_mut().skip(text_tokens).for_each(|l| *l = f32::NEG_INFINITY);
        }
        let p = match grammar {
            Some(grammar) => {
                let mut masked = logits.clone();
                grammar.mask_block(&mut masked, &draft_tokens)?;
                rule.distributions(&masked, context, &draft_tokens)?
            }
            None => rule.distributions(&logits, context, &draft_tokens)?,
        };
        let position = context.len() as u64;
        // Under greedy decoding every p is a point mass: its sample is the argmax, whatever the rule.
        let outcome = if rule.accept == AcceptRule::Ratio && !rule.sampling.is_greedy() {
            verify_block(&p, drafts, seed, position)?
        } else {
            verify_match(&target_samples(&p, seed, position), &draft_tokens)?
        };
        let committed = outcome.committed(&draft_tokens);
        let logprobs = match top_logprobs {
            Some(n) => {
                committed.iter().zip(&logits).map(|(&t, l)| token_logprob(l, t, n)).collect()
            }
            None => Vec::new(),
        };
        Ok(RoundResult { outcome, committed, logprobs, forward_time })
    }
}

fn token_logprob(logits: &[f32], token: u32, top: usize) -> TokenLogprob {
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let log_z = logits.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln() + max;
    let lp = |t: u32| (logits[t as usize] as f64 - log_z) as f32;
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    let k = top.min(order.len());
    if k > 0 {
        order.select_nth_unstable_by(k - 1, |&a, &b| {
            logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b))
        });
        order.truncate(k);
        order.sort_by(|&a, &b| logits[b as usize].total_cmp(&logits[a as usize]).then(a.cmp(&b)));
    } else {
        order.clear();
    }
    TokenLogprob { token, logprob: lp(token), top: order.into_iter().map(|t| (t, lp(t))).collect() }
}
