//! The speculative loop: draft a block, verify it, commit at least one token per round, repeat until a
//! stop token, the sink says stop, or the token budget runs out.
//!
//! One loop serves the in-process runner (tests, examples) and the gateway. They differ only in how a
//! block is verified ([`BlockVerifier`]: in-process over a scorer session, or over HTTP) and in what
//! happens to committed tokens ([`TokenSink`]: collected, or decoded and streamed). Cancellation is by
//! dropping the future: every await point is a draft or a verify call that may be abandoned.

use std::time::{Duration, Instant};

use spade_core::draft_control::{BlockKind, DraftChoice, RoundRecord};
use spade_core::lookup::{Proposal, Proposer, Source};
use spade_core::protocol::TokenLogprob;
use spade_core::{DraftToken, SparseDist};

pub use crate::drafting::DraftLenSetting;
use crate::drafting::{
    alongside, finish_reading, observation, reading, with_prefill, Block, Drafted, Pacing, Reading,
};
pub use crate::in_process::{
    generate, generate_proposing, Collect, GenerateParams, Generation, LocalVerifier,
};
use crate::{DraftParams, Drafter, EngineError};

/// Verifies a drafted block proposed after `context` (prompt and committed tokens).
#[async_trait::async_trait]
pub trait BlockVerifier: Send {
    async fn verify(
        &mut self,
        context: &[u32],
        drafts: &[DraftToken],
    ) -> Result<Verified, VerifyFailure>;
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
    async fn commit(
        &mut self,
        token: u32,
        logprob: Option<&TokenLogprob>,
    ) -> Result<Flow, EngineError>;
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
    pub draft_len: DraftLenSetting,
    /// Keep drafting the optimistic continuation while a block is verified (see [`run`]).
    pub draft_ahead: bool,
    /// How the draft samples its q (any choice is lossless).
    pub draft: DraftParams,
    pub stop_token_ids: Vec<u32>,
    pub when_unreachable: WhenUnreachable,
    /// Start on the draft model alone (the verifier was already known to be down).
    pub start_degraded: bool,
    /// Blocks copied from a prediction or from the context (spade-core's `lookup`), sent instead
    /// of the draft model's whenever it has one; None: the draft model only.
    pub proposer: Option<Proposer>,
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
    /// Tokens proposed from the request's prediction, and how many of them were accepted.
    pub predicted: usize,
    pub predicted_accepted: usize,
    /// Tokens proposed by prompt lookup, and how many of them were accepted.
    pub looked_up: usize,
    pub looked_up_accepted: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum LoopError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Verifier(#[from] VerifyFailure),
}

/// What a round of a copied block came to: None where the verifier was unreachable and the loop
/// goes on with the draft model alone, else whether the generation ended.
struct ProposalRound {
    latency: Duration,
    verifier_time: Option<Duration>,
    outcome: Option<Option<Finish>>,
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
    let mut state =
        Loop { seq: prompt.to_vec(), stats, params, sink, can_draft_alone: drafter.is_some() };
    let mut pacing = Pacing::new(&params.draft_len, params.draft_ahead);
    let drafting = drafter.filter(|_| params.draft_len.max() > 0);
    // Drafted during the last verify call, for the current prefix; and whether that was the first
    // call, during which the draft model also processed the prompt before the block's first token.
    let mut ahead: Option<Block> = None;
    let mut ahead_processed_prompt = false;
    let mut first = true;
    let mut proposer = params.proposer.clone().filter(Proposer::is_active);
    // The last round's proposals, and where the tokens its round committed start.
    let (mut proposed, mut proposed_at) = (Vec::<Proposal>::new(), prompt.len());
    // The draft model reading copied tokens, begun in a copied round and not yet done.
    let mut reading: Option<Reading> = None;
    while state.stats.committed < params.max_new_tokens {
        let remaining = params.max_new_tokens - state.stats.committed;
        let drafter = match (drafter, drafting) {
            (Some(drafter), _) if state.stats.degraded => {
                finish_reading(&mut reading).await;
                match state.draft_alone_round(drafter, remaining).await? {
                    Some(finish) => return Ok(state.end(finish, &pacing)),
                    None => continue,
                }
            }
            (_, drafter) => drafter,
        };
        // A block copied from the prediction or the context costs no drafting: send it where the
        // cost model says it beats the draft model's round. Every proposal learns from what its round
        // commits, whether it was sent or not.
        if let Some(proposer) = proposer.as_mut() {
            for proposal in &proposed {
                proposer.observe(proposal, &state.seq[proposed_at..]);
            }
            proposed = proposer.propose(&state.seq, prompt.len(), remaining - 1);
            proposed_at = state.seq.len();
            let best = proposed
                .iter()
                .filter_map(|p| {
                    let expected = proposer.expected_tokens(p);
                    pacing.copied_block(&expected, ahead.is_some()).map(|b| (p, b))
                })
                .max_by(|(_, a), (_, b)| a.worth.total_cmp(&b.worth));
            if let Some((proposal, block)) = best {
                tracing::debug!(
                    source = ?proposal.source,
                    aligned = proposal.aligned,
                    proposed = proposal.tokens.len(),
                    sent = block.len,
                    worth = block.worth,
                    ahead_ready = ahead.is_some(),
                    "copied block"
                );
                let proposal = proposal.first(block.len);
                ahead = None;
                let first_call = std::mem::replace(&mut first, false);
                let round = state
                    .proposal_round(verifier, drafter, &proposal, first_call, &mut reading)
                    .await?;
                let Some(finish) = round.outcome else { continue };
                if let (false, Some(verifier_time)) = (first_call, round.verifier_time) {
                    pacing.observe_block_call(
                        proposal.tokens.len() + 1,
                        round.latency,
                        verifier_time,
                    );
                }
                match finish {
                    Some(finish) => return Ok(state.end(finish, &pacing)),
                    None => continue,
                }
            }
        }
        // The model's round starts from what the draft model has read (its own drafts would queue
        // behind the reading anyway).
        finish_reading(&mut reading).await;
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
            (Some(drafter), None) if d > 0 => {
                Some(Block::start(drafter, &state.seq, d, false, &params.draft, &pacing).await?)
            }
            _ => None,
        };
        let drafted = match block {
            Some(block) => block.complete().await?,
            None => Drafted::default(),
        };
        let drafts = &drafted.tokens;
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
                if params.draft_ahead
                    && after > 1
                    && (next_d > 0 || pacing.probe())
                    && !ends_with_stop(drafts, params)
                    && !drafter.others_drafting() =>
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
            match next.as_mut() {
                Some(next) => next.pull_while(call).await,
                // Without draft-ahead, the first call still overlaps the draft's prefill.
                None => {
                    with_prefill(call, drafter.filter(|_| first), &state.seq, &params.draft).await
                }
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
        // Committed before the guess drafted ahead is awaited: on the first call the guess comes
        // after the draft model's reading of the prompt, which must not hold up the first token.
        let finish = state.commit_block(drafts, &verified).await?;
        let mut guess_matched = None;
        if let Some(mut next) = next {
            state.stats.ahead_drafted += 1;
            state.stats.overlap_time += next.busy.min(latency);
            let bonus = verified.committed.last().copied();
            // A probe (nothing drafted after its guess) is not worth waiting for, nor is any guess
            // once the generation is over.
            let guess = match (all_accepted, next_d > 0 && finish.is_none()) {
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
        let mut round = observation(
            &drafted,
            verified.accepted,
            latency,
            verified.verifier_time,
            guess_matched,
        );
        if start_includes_prompt {
            round.draft_start = Duration::ZERO;
        }
        if !first_call {
            pacing.observe(&round);
        } else if let Some(verifier_time) = verified.verifier_time {
            pacing.observe_link(latency, verifier_time);
        }
        // One record per round (`--log spade_engine=debug`; the form: `RoundRecord`'s docs): what was
        // chosen, on which cost model, and what came of it, as the draft-length controller was fed it.
        let record = RoundRecord {
            first_call,
            from_ahead,
            draft_ahead: params.draft_ahead,
            max_draft: params.draft_len.max(),
            remaining,
            chosen,
            cap: d,
            model: pacing.choice(),
            ..RoundRecord::from_observation(&round)
        };
        tracing::debug!(target: RoundRecord::LOG_TARGET, round = %record);
        if let Some(finish) = finish {
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

impl<'a> Loop<'a> {
    /// A verify call's outcome, checked. None when the verifier is unreachable and the loop goes on
    /// with the draft model alone.
    fn check(
        &mut self,
        verified: Result<Verified, VerifyFailure>,
        drafts: &[DraftToken],
    ) -> Result<Option<Verified>, LoopError> {
        let verified = match verified {
            Ok(v) => v,
            Err(VerifyFailure::Unreachable(e))
                if self.params.when_unreachable == WhenUnreachable::DraftAlone
                    && self.can_draft_alone =>
            {
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
    async fn commit_block(
        &mut self,
        drafts: &[DraftToken],
        verified: &Verified,
    ) -> Result<Option<Finish>, LoopError> {
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

    /// One round of a copied block: verified like a drafted one, with q a point mass on each token
    /// (the rule then accepts a token with the target's own probability of it: still lossless).
    async fn proposal_round(
        &mut self,
        verifier: &mut dyn BlockVerifier,
        drafter: Option<&'a dyn Drafter>,
        proposal: &Proposal,
        first_call: bool,
        reading: &mut Option<Reading<'a>>,
    ) -> Result<ProposalRound, LoopError> {
        let drafts: Vec<DraftToken> = proposal
            .tokens
            .iter()
            .map(|&token| DraftToken { token, q: SparseDist::point(token) })
            .collect();
        // While the verifier checks the block, the draft model reads the context and the block (the
        // edge is idle otherwise), so a later model round starts from its cache instead of first
        // catching up on every copied token: on a long copied answer that catch-up stalled the loop
        // for a minute. On the first call it reads the prompt alongside the verifier's prefill. A
        // reading that outlasts the call goes on while the next copied round is verified (the next
        // model round waits for it); one at a time, so a later reading takes up all the tokens
        // copied meanwhile. Not while other generations draft: their rounds must not wait for it.
        if let Some(drafter) =
            drafter.filter(|d| reading.is_none() && (first_call || !d.others_drafting()))
        {
            let context = match first_call {
                true => self.seq.clone(),
                false => [&self.seq[..], &proposal.tokens].concat(),
            };
            *reading = Some(self::reading(drafter, context, &self.params.draft));
        }
        let started = Instant::now();
        let verified = alongside(verifier.verify(&self.seq, &drafts), reading).await;
        let latency = started.elapsed();
        let mut round = ProposalRound { latency, verifier_time: None, outcome: None };
        let Some(verified) = self.check(verified, &drafts)? else {
            return Ok(round);
        };
        round.verifier_time = verified.verifier_time;
        self.stats.verify_time += latency;
        self.stats.verifier_time += verified.verifier_time.unwrap_or_default().min(latency);
        self.stats.target_calls += 1;
        let (proposed, accepted) = match proposal.source {
            Source::Prediction => (&mut self.stats.predicted, &mut self.stats.predicted_accepted),
            Source::Lookup => (&mut self.stats.looked_up, &mut self.stats.looked_up_accepted),
        };
        *proposed += drafts.len();
        *accepted += verified.accepted;
        let finish = self.commit_all(&verified.committed, &verified.logprobs).await?;
        round.outcome = Some(finish);
        Ok(round)
    }

    async fn draft_alone_round(
        &mut self,
        drafter: &dyn Drafter,
        remaining: usize,
    ) -> Result<Option<Finish>, LoopError> {
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

    async fn commit_all(
        &mut self,
        tokens: &[u32],
        logprobs: &[TokenLogprob],
    ) -> Result<Option<Finish>, LoopError> {
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

#[cfg(test)]
mod tests;
