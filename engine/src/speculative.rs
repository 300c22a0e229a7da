//! The speculative loop: draft a block, verify it, commit at least one token per round, repeat until a
//! stop token, the sink says stop, or the token budget runs out.
//!
//! One loop serves the in-process runner (tests, examples) and the gateway. They differ only in how a
//! block is verified ([`BlockVerifier`]: in-process over a scorer session, or over HTTP) and in what
//! happens to committed tokens ([`TokenSink`]: collected, or decoded and streamed). Cancellation is by
//! dropping the future: every await point is a draft or a verify call that may be abandoned.

use std::time::{Duration, Instant};

use spade_core::draft_control::{BlockKind, DraftChoice};
use spade_core::grammar::{Grammar, GrammarState};
use spade_core::protocol::TokenLogprob;
use spade_core::{DraftToken, Penalties, SamplingParams};

pub use crate::drafting::DraftLength;
use crate::drafting::{observation, Block, Drafted, Pacing};
use crate::round::{Round, TargetRule};
use crate::{DraftParams, Drafter, EngineError, ScoreSession, SharedGrammar};

/// Verifies a drafted block proposed after `context` (prompt and committed tokens).
#[async_trait::async_trait]
pub trait BlockVerifier: Send {
    async fn verify(&mut self, context: &[u32], drafts: &[DraftToken]) -> Result<Verified, VerifyFailure>;
}

/// What one verified block commits.
#[derive(Debug, Clone, PartialEq)]
pub struct Verified {
    pub accepted: usize,
    /// The accepted drafts followed by the correction or bonus token.
    pub committed: Vec<u32>,
    /// Target log-probabilities of the committed tokens; empty unless asked for.
    pub logprobs: Vec<TokenLogprob>,
    /// The verifier's own time for the call (queue and forward pass), where it reports one.
    pub verifier_time: Option<Duration>,
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum VerifyFailure {
    /// No usable answer after the verifier's own retries: the loop may go on with the draft alone.
    #[error("{0}")]
    Unreachable(String),
    /// A definite refusal or an answer that cannot be used.
    #[error("{0}")]
    Rejected(String),
}

/// Receives each committed token, in order.
#[async_trait::async_trait]
pub trait TokenSink: Send {
    async fn commit(&mut self, token: u32, logprob: Option<&TokenLogprob>) -> Result<Flow, EngineError>;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Continue,
    /// The sink has what it needs (a stop sequence completed).
    Stop,
}

/// What the loop does when the verifier cannot be reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WhenUnreachable {
    Fail,
    /// Go on with the draft model alone; the output is then the draft's, flagged as degraded.
    DraftAlone,
}

#[derive(Debug, Clone)]
pub struct LoopParams {
    pub max_new_tokens: usize,
    /// Draft tokens per round: fixed (0 = target-only decoding) or chosen online.
    pub draft_len: DraftLength,
    /// Keep drafting the optimistic continuation while a block is verified (see [`run`]).
    pub draft_ahead: bool,
    /// How the draft samples its q (any choice is lossless).
    pub draft: DraftParams,
    pub stop_token_ids: Vec<u32>,
    pub when_unreachable: WhenUnreachable,
    /// Start on the draft model alone (the verifier was already known to be down).
    pub start_degraded: bool,
}

/// Tokens per draft call once the draft model answers alone: it is not waiting on anyone.
pub const DEGRADED_BLOCK: usize = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// A stop token was committed (it is the last token).
    StopToken,
    /// The sink asked to stop.
    Sink,
    /// The token budget ran out.
    Length,
}

#[derive(Debug, Clone, Default)]
pub struct LoopStats {
    /// Verified blocks (target forward passes).
    pub target_calls: usize,
    pub drafted: usize,
    pub accepted: usize,
    /// accepted_at[i]: blocks in which draft position i was accepted; drafted_at[i]: blocks that drafted it.
    pub accepted_at: Vec<usize>,
    pub drafted_at: Vec<usize>,
    pub committed: usize,
    /// Drafting the loop waited for (not hidden under a verify call).
    pub draft_time: Duration,
    /// Drafting done while a verify call was in flight.
    pub overlap_time: Duration,
    /// Verify calls, end to end.
    pub verify_time: Duration,
    /// The part of `verify_time` the verifier reports as its own (queue and forward pass); the rest is
    /// the link.
    pub verifier_time: Duration,
    /// Rounds that drafted ahead, and how many of those blocks were then sent.
    pub ahead_drafted: usize,
    pub ahead_used: usize,
    /// The adaptive draft length's last choice and its inputs (None for a fixed length).
    pub choice: Option<DraftChoice>,
    /// The draft model answered alone for at least part of the generation.
    pub degraded: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum LoopError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Verifier(#[from] VerifyFailure),
}

#[derive(Debug, Clone)]
pub struct LoopEnd {
    pub finish: Finish,
    pub stats: LoopStats,
}

/// Runs one generation after `prompt`. Without a drafter (or with a draft length of 0) this is plain
/// target decoding through the same verifier: the reference the speculative output is compared with.
///
/// The first block is always verified empty: the verifier prefills the prompt and commits the first
/// token while the draft model prefills the same prompt, so the two prefills overlap instead of adding
/// up, and the first token is committed as soon as the verifier has it.
///
/// Draft-ahead: while a block is verified, the draft keeps drafting as if every draft will be
/// accepted: a guess for the token the verifier will add, then the next block. When all drafts are
/// accepted and the guess equals the verifier's token, that block was drafted on exactly the committed
/// prefix and is sent at once; otherwise it is dropped. Draft randomness is keyed by position, so the
/// block is the one drafting afterwards would have drawn: the output is unchanged (docs/design.md).
pub async fn run(
    drafter: Option<&dyn Drafter>,
    verifier: &mut dyn BlockVerifier,
    prompt: &[u32],
    params: &LoopParams,
    sink: &mut dyn TokenSink,
) -> Result<LoopEnd, LoopError> {
    let stats = LoopStats { degraded: params.start_degraded, ..Default::default() };
    let mut state = Loop { seq: prompt.to_vec(), stats, params, sink, can_draft_alone: drafter.is_some() };
    let mut pacing = Pacing::new(&params.draft_len, params.draft_ahead);
    let drafting = drafter.filter(|_| params.draft_len.max() > 0);
    // Drafted during the last verify call, for the current prefix; and whether that was the first
    // call, during which the draft model also processed the prompt before the block's first token.
    let mut ahead: Option<Block> = None;
    let mut ahead_processed_prompt = false;
    let mut first = true;
    while state.stats.committed < params.max_new_tokens {
        let remaining = params.max_new_tokens - state.stats.committed;
        let drafter = match (drafter, drafting) {
            (Some(drafter), _) if state.stats.degraded => match state.draft_alone_round(drafter, remaining).await? {
                Some(finish) => return Ok(state.end(finish, &pacing)),
                None => continue,
            },
            (_, drafter) => drafter,
        };
        // A block commits at most d + 1 tokens: never draft past the budget.
        let from_ahead = ahead.is_some();
        let kind = if from_ahead { BlockKind::Ahead } else { BlockKind::Serial };
        let d = match drafter {
            Some(_) if !first => pacing.choose(kind).min(remaining - 1),
            _ => 0,
        };
        // What `auto` modelled for this round (the block may draft up to `d`).
        let chosen = pacing.choice().map_or(d, |c| c.draft.min(d));
        let round_started = Instant::now();
        let start_includes_prompt = from_ahead && std::mem::take(&mut ahead_processed_prompt);
        let block = match (drafter, ahead.take()) {
            (Some(_), Some(pre)) => Some(pre.without_guess(d)),
            (Some(drafter), None) if d > 0 => Some(Block::start(drafter, &state.seq, d, false, &params.draft, &pacing).await?),
            _ => None,
        };
        let drafted = match block {
            Some(block) => block.complete().await?,
            None => Drafted::default(),
        };
        let (drafts, timing) = (&drafted.tokens, drafted.timing);
        // A pre-drafted block counts as used when it sends drafts (an `auto` length of 0 sends none).
        state.stats.ahead_used += usize::from(from_ahead && !drafts.is_empty());
        state.stats.draft_time += round_started.elapsed();

        // Draft ahead during the call: a guess for the token after the block, then the next block. When
        // the next block is to be empty (`auto` chose 0), the guess alone still probes the draft's acceptance.
        // Not while other generations draft: drafting that may be thrown away must not delay theirs.
        let after = remaining.saturating_sub(drafts.len() + 1);
        let next_d = if after > 1 { pacing.choose(BlockKind::Ahead).min(after - 1) } else { 0 };
        let mut context = Vec::new();
        let mut next = match drafter {
            Some(drafter)
                if params.draft_ahead && after > 1 && (next_d > 0 || pacing.probe()) && !ends_with_stop(drafts, params) && !drafter.others_drafting() =>
            {
                context.extend_from_slice(&state.seq);
                context.extend(drafts.iter().map(|t| t.token));
                Some(Block::start(drafter, &context, next_d, true, &params.draft, &pacing).await?)
            }
            _ => None,
        };
        let call_started = Instant::now();
        let verified = {
            let call = verifier.verify(&state.seq, drafts);
            match (next.as_mut(), drafter) {
                (Some(next), _) => next.pull_while(call).await,
                // Without draft-ahead, the first call still overlaps the draft's prefill.
                (None, Some(drafter)) if first => {
                    let (verified, warmed) = tokio::join!(call, drafter.prefill(&state.seq, &params.draft));
                    // A failed prefill only costs speed; the next draft call reports a real failure.
                    if let Err(e) = warmed {
                        tracing::debug!("draft prefill failed: {e}");
                    }
                    verified
                }
                _ => call.await,
            }
        };
        let latency = call_started.elapsed();
        let first_call = std::mem::replace(&mut first, false);
        let verified = match state.check(verified, drafts)? {
            Some(verified) => verified,
            None => continue,
        };
        state.stats.verify_time += latency;
        state.stats.verifier_time += verified.verifier_time.unwrap_or_default().min(latency);
        let all_accepted = verified.accepted == drafts.len();
        let mut guess_matched = None;
        if let Some(mut next) = next {
            state.stats.ahead_drafted += 1;
            state.stats.overlap_time += next.busy.min(latency);
            let bonus = verified.committed.last().copied();
            // A probe (nothing drafted after its guess) is not worth waiting for.
            let guess = match (all_accepted, next_d > 0) {
                (false, _) => None,
                (true, true) => next.guess().await,
                (true, false) => next.drawn_guess(),
            };
            if let Some(guess) = guess {
                let matched = Some(guess) == bonus;
                guess_matched = Some(matched);
                if matched {
                    ahead = Some(next);
                    ahead_processed_prompt = first_call;
                }
            }
        }
        // The first call prefills the prompt: its time says nothing about a block's cost per round,
        // nor does the start of the block drafted ahead during it (~1 s of the draft's prompt here).
        if !first_call {
            let mut round = observation(&drafted, verified.accepted, latency, verified.verifier_time, guess_matched);
            if start_includes_prompt {
                round.draft_start = Duration::ZERO;
            }
            pacing.observe(&round);
        } else if let Some(verifier_time) = verified.verifier_time {
            pacing.observe_link(latency, verifier_time);
        }
        // One line per round (`--log spade_engine=debug`): what auto chose, on which cost model, and what came of it.
        let model = pacing.choice();
        tracing::debug!(
            chosen,
            cap = d,
            model_draft_ahead = model.as_ref().map(|c| c.draft_ahead),
            first_call,
            model_verify_a_ms = model.as_ref().map(|c| (c.verify_a_s * 1e3).round()),
            model_verify_b_ms = model.as_ref().map(|c| (c.verify_b_s * 1e3).round()),
            model_alpha0 = model.as_ref().and_then(|c| c.alpha.first().map(|a| (a * 100.0).round() / 100.0)),
            model_acceptance = model.as_ref().map(|c| (c.acceptance * 100.0).round() / 100.0),
            drafted = drafts.len(),
            accepted = verified.accepted,
            from_ahead,
            guess_matched,
            draft_start_ms = timing.start.as_millis() as u64,
            draft_step_ms = timing.step.as_millis() as u64,
            call_ms = latency.as_millis() as u64,
            verifier_ms = verified.verifier_time.unwrap_or_default().as_millis() as u64,
            "round"
        );
        if let Some(finish) = state.commit_block(drafts, &verified).await? {
            return Ok(state.end(finish, &pacing));
        }
    }
    Ok(state.end(Finish::Length, &pacing))
}

/// A block ending in a stop token ends the generation if it is all accepted: nothing to draft after it.
fn ends_with_stop(drafts: &[DraftToken], params: &LoopParams) -> bool {
    drafts.last().is_some_and(|d| params.stop_token_ids.contains(&d.token))
}

struct Loop<'a> {
    seq: Vec<u32>,
    stats: LoopStats,
    params: &'a LoopParams,
    sink: &'a mut dyn TokenSink,
    can_draft_alone: bool,
}

impl Loop<'_> {
    /// A verify call's outcome, checked. None when the verifier is unreachable and the loop goes on
    /// with the draft model alone.
    fn check(&mut self, verified: Result<Verified, VerifyFailure>, drafts: &[DraftToken]) -> Result<Option<Verified>, LoopError> {
        let verified = match verified {
            Ok(v) => v,
            Err(VerifyFailure::Unreachable(e)) if self.params.when_unreachable == WhenUnreachable::DraftAlone && self.can_draft_alone => {
                tracing::warn!("verifier unreachable ({e}); continuing with the draft model alone");
                self.stats.degraded = true;
                return Ok(None);
            }
            Err(e) => return Err(e.into()),
        };
        if verified.accepted > drafts.len() || verified.committed.len() != verified.accepted + 1 {
            return Err(VerifyFailure::Rejected(format!(
                "{} committed tokens for {} accepted of {} drafts",
                verified.committed.len(),
                verified.accepted,
                drafts.len()
            ))
            .into());
        }
        Ok(Some(verified))
    }

    /// Counts a verified block and commits what it commits. Some(finish) when the generation is over.
    async fn commit_block(&mut self, drafts: &[DraftToken], verified: &Verified) -> Result<Option<Finish>, LoopError> {
        self.stats.target_calls += 1;
        self.stats.drafted += drafts.len();
        self.stats.accepted += verified.accepted;
        if self.stats.drafted_at.len() < drafts.len() {
            self.stats.drafted_at.resize(drafts.len(), 0);
            self.stats.accepted_at.resize(drafts.len(), 0);
        }
        for i in 0..drafts.len() {
            self.stats.drafted_at[i] += 1;
            self.stats.accepted_at[i] += usize::from(i < verified.accepted);
        }
        self.commit_all(&verified.committed, &verified.logprobs).await
    }

    async fn draft_alone_round(&mut self, drafter: &dyn Drafter, remaining: usize) -> Result<Option<Finish>, LoopError> {
        let d = DEGRADED_BLOCK.max(self.params.draft_len.max()).min(remaining);
        let started = Instant::now();
        let drafts = drafter.draft(&self.seq, d, &self.params.draft).await?;
        self.stats.draft_time += started.elapsed();
        if drafts.is_empty() {
            return Err(EngineError::Drafter("the draft model proposed nothing".into()).into());
        }
        let tokens: Vec<u32> = drafts.iter().map(|d| d.token).collect();
        self.commit_all(&tokens, &[]).await
    }

    async fn commit_all(&mut self, tokens: &[u32], logprobs: &[TokenLogprob]) -> Result<Option<Finish>, LoopError> {
        for (i, &token) in tokens.iter().enumerate() {
            self.seq.push(token);
            self.stats.committed += 1;
            let flow = self.sink.commit(token, logprobs.get(i)).await?;
            if self.params.stop_token_ids.contains(&token) {
                return Ok(Some(Finish::StopToken));
            }
            if flow == Flow::Stop {
                return Ok(Some(Finish::Sink));
            }
            if self.stats.committed == self.params.max_new_tokens {
                return Ok(Some(Finish::Length));
            }
        }
        Ok(None)
    }

    fn end(mut self, finish: Finish, pacing: &Pacing) -> LoopEnd {
        self.stats.choice = pacing.choice();
        LoopEnd { finish, stats: self.stats }
    }
}

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
    async fn verify(&mut self, context: &[u32], drafts: &[DraftToken]) -> Result<Verified, VerifyFailure> {
        let rejected = |e: EngineError| VerifyFailure::Rejected(e.to_string());
        if let Some(grammar) = &mut self.grammar {
            grammar.sync(context).map_err(|e| rejected(e.into()))?;
        }
        let round = Round { context, drafts, rule: &self.rule, grammar: self.grammar.as_mut(), seed: self.seed, top_logprobs: self.top_logprobs };
        let round = round.verify(self.session).map_err(rejected)?;
        Ok(Verified { accepted: round.outcome.accepted, committed: round.committed, logprobs: round.logprobs, verifier_time: Some(round.forward_time) })
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
pub async fn generate(drafter: Option<&dyn Drafter>, target: &mut dyn ScoreSession, prompt: &[u32], params: &GenerateParams) -> Result<Generation, LoopError> {
    params.sampling.validate().map_err(EngineError::from)?;
    if let Some(drafter) = drafter {
        drafter.begin_generation(true).await;
    }
    let loop_params = LoopParams {
        max_new_tokens: params.max_new_tokens,
        draft_len: DraftLength::Fixed(params.draft_len),
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
    };
    let rule = TargetRule { sampling: params.sampling, penalties: params.penalties.clone() };
    let grammar = params.grammar.as_ref().map(|g| g.start_at(prompt.len()));
    let mut verifier = LocalVerifier { session: target, rule, grammar, seed: params.seed, top_logprobs: None };
    let mut tokens = Collect::default();
    let end = run(drafter, &mut verifier, prompt, &loop_params, &mut tokens).await;
    if let Some(drafter) = drafter {
        drafter.end_generation();
    }
    let end = end?;
    Ok(Generation { tokens: tokens.0, finish: end.finish, stats: end.stats })
}

#[cfg(test)]
mod tests {
    //! The loop's own control flow, with a scripted drafter and verifier (model behaviour is covered by
    //! the real-model tests in tests/).
    use super::*;
    use crate::ModelMeta;
    use spade_core::SparseDist;

    /// Proposes ascending ids from the context length on: drafts at position i are always `i`.
    struct Counting(ModelMeta);

    #[async_trait::async_trait]
    impl Drafter for Counting {
        fn meta(&self) -> &ModelMeta {
            &self.0
        }
        async fn draft(&self, committed: &[u32], n: usize, _: &DraftParams) -> Result<Vec<DraftToken>, EngineError> {
            let start = committed.len() as u32;
            Ok((start..start + n as u32).map(|t| DraftToken { token: t, q: SparseDist::new(vec![(t, 1.0)], None).unwrap() }).collect())
        }
    }

    /// Accepts `accept` drafts per block and commits position + `offset` as the next token (an offset
    /// of 0 agrees with [`Counting`]); fails every call after the first `ok_calls`.
    struct Scripted {
        accept: usize,
        offset: u32,
        ok_calls: usize,
        calls: usize,
        blocks: Vec<usize>,
    }

    fn scripted(accept: usize, ok_calls: usize) -> Scripted {
        Scripted { accept, offset: 1000, ok_calls, calls: 0, blocks: Vec::new() }
    }

    #[async_trait::async_trait]
    impl BlockVerifier for Scripted {
        async fn verify(&mut self, context: &[u32], drafts: &[DraftToken]) -> Result<Verified, VerifyFailure> {
            self.calls += 1;
            if self.calls > self.ok_calls {
                return Err(VerifyFailure::Unreachable("down".into()));
            }
            self.blocks.push(drafts.len());
            let accepted = self.accept.min(drafts.len());
            let mut committed: Vec<u32> = drafts[..accepted].iter().map(|d| d.token).collect();
            committed.push((context.len() + accepted) as u32 + self.offset);
            Ok(Verified { accepted, committed, logprobs: Vec::new(), verifier_time: None })
        }
    }

    fn meta() -> ModelMeta {
        ModelMeta {
            name: "counting".into(),
            architecture: "test".into(),
            vocab_size: 5000,
            stop_token_ids: vec![4999],
            tokenizer_fingerprint: String::new(),
            text_tokens: 5000,
            max_context: 4096,
            chat_template: None,
        }
    }

    fn params(max_new_tokens: usize, draft_len: usize, when_unreachable: WhenUnreachable) -> LoopParams {
        let draft = DraftParams { sampling: SamplingParams::greedy(), ..DraftParams::default() };
        LoopParams {
            max_new_tokens,
            draft_len: DraftLength::Fixed(draft_len),
            draft_ahead: false,
            draft,
            stop_token_ids: vec![4999],
            when_unreachable,
            start_degraded: false,
        }
    }

    #[tokio::test]
    async fn the_first_block_is_empty_and_no_block_drafts_past_the_budget() {
        let drafter = Counting(meta());
        let mut verifier = scripted(10, usize::MAX);
        let mut out = Collect::default();
        let end = run(Some(&drafter), &mut verifier, &[1, 2, 3], &params(10, 4, WhenUnreachable::Fail), &mut out).await.unwrap();
        assert_eq!(end.finish, Finish::Length);
        assert_eq!(out.0.len(), 10);
        // 1 (empty block) + 5 (4 drafts + bonus) + 4 (3 drafts, the budget's last token as bonus).
        assert_eq!(verifier.blocks, vec![0, 4, 3]);
        assert_eq!(end.stats.committed, 10);
        assert_eq!((end.stats.drafted, end.stats.accepted, end.stats.target_calls), (7, 7, 3));
    }

    #[tokio::test]
    async fn an_unreachable_verifier_fails_or_hands_over_to_the_draft() {
        let drafter = Counting(meta());
        let mut verifier = scripted(0, 2);
        let end = run(Some(&drafter), &mut verifier, &[1], &params(40, 2, WhenUnreachable::Fail), &mut Collect::default()).await;
        assert!(matches!(end, Err(LoopError::Verifier(VerifyFailure::Unreachable(_)))));

        let mut verifier = scripted(0, 2);
        let mut out = Collect::default();
        let end = run(Some(&drafter), &mut verifier, &[1], &params(40, 2, WhenUnreachable::DraftAlone), &mut out).await.unwrap();
        assert!(end.stats.degraded);
        assert_eq!((end.finish, out.0.len(), end.stats.target_calls), (Finish::Length, 40, 2));
        // After the two verified tokens, the draft's own tokens: position i drafts i.
        assert_eq!(out.0[2..6], [3, 4, 5, 6]);
    }

    #[tokio::test]
    async fn a_stop_token_ends_the_generation() {
        let drafter = Counting(meta());
        let mut verifier = scripted(10, usize::MAX);
        let mut out = Collect::default();
        // Position 4999 drafts the stop token 4999.
        let prompt: Vec<u32> = (0..4990).collect();
        let end = run(Some(&drafter), &mut verifier, &prompt, &params(100, 4, WhenUnreachable::Fail), &mut out).await.unwrap();
        assert_eq!(end.finish, Finish::StopToken);
        assert_eq!(out.0.last(), Some(&4999));
    }

    /// Drafting ahead changes which blocks are drafted when, never what is committed: a block drafted
    /// ahead is sent only when the verifier confirmed the prefix it was drafted on.
    #[tokio::test]
    async fn draft_ahead_sends_only_confirmed_blocks_and_commits_the_same_tokens() {
        let drafter = Counting(meta());
        // (accepted per block, bonus offset, every block drafted ahead should be used): with one
        // accepted of four, only the block after the empty first one (all of its zero drafts accepted).
        for (accept, offset, used) in [(10, 0, true), (10, 1000, false), (1, 0, false)] {
            let run_with = |ahead: bool| {
                let drafter = &drafter;
                async move {
                    let mut verifier = Scripted { offset, ..scripted(accept, usize::MAX) };
                    let mut out = Collect::default();
                    let params = LoopParams { draft_ahead: ahead, ..params(30, 4, WhenUnreachable::Fail) };
                    let end = run(Some(drafter), &mut verifier, &[1, 2, 3], &params, &mut out).await.unwrap();
                    (out.0, verifier.blocks, end.stats)
                }
            };
            let (plain, plain_blocks, plain_stats) = run_with(false).await;
            let (ahead, ahead_blocks, stats) = run_with(true).await;
            assert_eq!(ahead, plain, "accept {accept}, offset {offset}");
            assert_eq!(ahead_blocks, plain_blocks, "accept {accept}, offset {offset}");
            assert_eq!((plain_stats.ahead_drafted, plain_stats.ahead_used), (0, 0));
            assert!(stats.ahead_drafted > 0);
            // Every block after the first was drafted ahead when the verifier agrees; none otherwise.
            let expected_used = match (used, offset) {
                (true, _) => stats.target_calls - 1,
                (false, 0) => 1,
                (false, _) => 0,
            };
            assert_eq!(stats.ahead_used, expected_used, "accept {accept}, offset {offset}: {stats:?}");
        }
    }

    /// [`Counting`] on a drafter that other generations keep busy.
    struct Crowded(Counting);

    #[async_trait::async_trait]
    impl Drafter for Crowded {
        fn meta(&self) -> &ModelMeta {
            self.0.meta()
        }
        async fn draft(&self, committed: &[u32], n: usize, params: &DraftParams) -> Result<Vec<DraftToken>, EngineError> {
            self.0.draft(committed, n, params).await
        }
        fn others_drafting(&self) -> bool {
            true
        }
    }

    #[tokio::test]
    async fn no_drafting_ahead_while_other_generations_draft() {
        let params = LoopParams { draft_ahead: true, ..params(30, 4, WhenUnreachable::Fail) };
        let (mut alone, mut crowded) = (scripted(10, usize::MAX), scripted(10, usize::MAX));
        let (mut alone_out, mut crowded_out) = (Collect::default(), Collect::default());
        let alone_end = run(Some(&Counting(meta())), &mut alone, &[1, 2, 3], &params, &mut alone_out).await.unwrap();
        let crowded_end = run(Some(&Crowded(Counting(meta()))), &mut crowded, &[1, 2, 3], &params, &mut crowded_out).await.unwrap();
        assert!(alone_end.stats.ahead_drafted > 0);
        assert_eq!(crowded_end.stats.ahead_drafted, 0);
        assert_eq!((crowded_out.0, crowded.blocks), (alone_out.0, alone.blocks));
    }
}
