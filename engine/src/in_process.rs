//! The speculative loop in-process ([`generate`]): a scorer session verifies each block with the same
//! rule the verifier server runs, and the committed tokens are collected. Tests and examples use it;
//! the gateway runs the same loop over HTTP.

use spade_core::grammar::{Grammar, GrammarState};
use spade_core::lookup::Proposer;
use spade_core::protocol::TokenLogprob;
use spade_core::{AcceptRule, DraftToken, Penalties, SamplingParams};

use crate::round::{Round, TargetRule};
use crate::speculative::{
    run, BlockVerifier, DraftLenSetting, Finish, Flow, LoopError, LoopParams, LoopStats, TokenSink,
    Verified, VerifyFailure, WhenUnreachable,
};
use crate::{DraftParams, Drafter, EngineError, ScoreSession, SharedGrammar};

/// Verifies in-process: one scorer session, the rule applied by [`Round::verify`] (the same code the
/// verifier server runs).
pub struct LocalVerifier<'a> {
    pub session: &'a mut dyn ScoreSession,
    pub rule: TargetRule,
    pub grammar: Option<GrammarState>,
    pub seed: u64,
    pub top_logprobs: Option<usize>,
}

#[async_trait::async_trait]
impl BlockVerifier for LocalVerifier<'_> {
    async fn verify(
        &mut self,
        context: &[u32],
        drafts: &[DraftToken],
    ) -> Result<Verified, VerifyFailure> {
        let rejected = |e: EngineError| VerifyFailure::Rejected(e.to_string());
        if let Some(grammar) = &mut self.grammar {
            grammar.sync(context).map_err(|e| rejected(e.into()))?;
        }
        let round = Round {
            context,
            drafts,
            rule: &self.rule,
            grammar: self.grammar.as_mut(),
            seed: self.seed,
            top_logprobs: self.top_logprobs,
        };
        let round = round.verify(self.session).map_err(rejected)?;
        Ok(Verified {
            accepted: round.outcome.accepted,
            committed: round.committed,
            logprobs: round.logprobs,
            verifier_time: Some(round.forward_time),
        })
    }
}

/// Collects the committed tokens.
#[derive(Debug, Default)]
pub struct Collect(pub Vec<u32>);

#[async_trait::async_trait]
impl TokenSink for Collect {
    async fn commit(&mut self, token: u32, _: Option<&TokenLogprob>) -> Result<Flow, EngineError> {
        self.0.push(token);
        Ok(Flow::Continue)
    }
}

/// In-process generation parameters: the target's sampling defines the output distribution.
#[derive(Debug, Clone)]
pub struct GenerateParams {
    pub max_new_tokens: usize,
    pub draft_len: usize,
    pub draft_ahead: bool,
    pub sampling: SamplingParams,
    pub draft_sampling: SamplingParams,
    /// Applied to both the target's and the draft's logits.
    pub penalties: Option<Penalties>,
    /// Constrains the output (everything after the prompt); masks both p and q.
    pub grammar: Option<Grammar>,
    pub seed: u64,
    pub stop_token_ids: Vec<u32>,
}

#[derive(Debug, Clone)]
pub struct Generation {
    pub tokens: Vec<u32>,
    pub finish: Finish,
    pub stats: LoopStats,
}

/// The loop in-process, on a fresh draft cache (so that a seeded run reproduces).
pub async fn generate(
    drafter: Option<&dyn Drafter>,
    target: &mut dyn ScoreSession,
    prompt: &[u32],
    params: &GenerateParams,
) -> Result<Generation, LoopError> {
    generate_proposing(drafter, target, prompt, params, None).await
}

/// [`generate`], with blocks copied from a prediction or the context where `proposer` has them.
pub async fn generate_proposing(
    drafter: Option<&dyn Drafter>,
    target: &mut dyn ScoreSession,
    prompt: &[u32],
    params: &GenerateParams,
    proposer: Option<Proposer>,
) -> Result<Generation, LoopError> {
    params.sampling.validate().map_err(EngineError::from)?;
    if let Some(drafter) = drafter {
        drafter.begin_generation(true).await;
    }
    let loop_params = LoopParams {
        max_new_tokens: params.max_new_tokens,
        draft_len: DraftLenSetting::Fixed(params.draft_len),
        draft_ahead: params.draft_ahead,
        draft: DraftParams {
            sampling: params.draft_sampling,
            penalties: params.penalties.clone(),
            grammar: params.grammar.as_ref().map(|g| SharedGrammar::new(g.start_at(prompt.len()))),
            seed: params.seed,
        },
        stop_token_ids: params.stop_token_ids.clone(),
        when_unreachable: WhenUnreachable::Fail,
        start_degraded: false,
        proposer,
    };
    let rule = TargetRule {
        sampling: params.sampling,
        penalties: params.penalties.clone(),
        accept: AcceptRule::Ratio,
    };
    let grammar = params.grammar.as_ref().map(|g| g.start_at(prompt.len()));
    let mut verifier =
        LocalVerifier { session: target, rule, grammar, seed: params.seed, top_logprobs: None };
    let mut tokens = Collect::default();
    let end = run(drafter, &mut verifier, prompt, &loop_params, &mut tokens).await;
    if let Some(drafter) = drafter {
        drafter.end_generation();
    }
    let end = end?;
    Ok(Generation { tokens: tokens.0, finish: end.finish, stats: end.stats })
}
