//! One generation: the engine's speculative loop, verified over HTTP, with the committed tokens turned
//! into streamed text (incremental detokenisation, stop sequences, logprobs).
//!
//! Runs as its own task and reports through a bounded channel. When the client goes away the receiver
//! is dropped and the loop future with it, cancelling the draft or verify call in flight, so no further
//! verify call is made for that request.

use std::sync::Arc;
use std::time::Instant;

use rand::Rng;
use spade_core::fim::LineLimits;
use spade_core::grammar::{Grammar, GrammarConstraint};
use spade_core::lookup::Proposer;
use spade_core::openai::{FinishReason, SpadeTiming, TokenLogprobContent, TopLogprob};
use spade_core::protocol::TokenLogprob;
use spade_core::tools::{FunctionCall, ToolCall, ToolCallParser, ToolOutput};
use spade_core::{AcceptRule, IncrementalDecoder, Penalties, SamplingParams, StopMatcher};
use spade_engine::round::TargetRule;
use spade_engine::speculative::{
    self, DraftLenSetting, Finish, Flow, LoopError, LoopParams, TokenSink, VerifyFailure,
    WhenUnreachable,
};
use spade_engine::{DraftParams, EdgeModel, EngineError, SharedGrammar};
use tokio::sync::mpsc;

use crate::config::OfflineFallback;
use crate::error::ApiError;
use crate::metrics::GenerationRecord;
use crate::state::AppState;
use crate::verifier::RemoteVerifier;

/// A validated request, ready to run.
#[derive(Debug, Clone)]
pub struct Job {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Applied to the target's and the draft's logits; None when they would change nothing.
    pub penalties: Option<Penalties>,
    pub seed: u64,
    pub stops: Vec<String>,
    /// Some(n): return each token's logprob with n alternatives.
    pub top_logprobs: Option<u8>,
    pub draft_len: DraftLenSetting,
    /// False when the verifier was already known to be down and the fallback is on.
    pub verify: bool,
    /// A seeded sampled request: worth a fresh draft cache so that it reproduces.
    pub reproducible: bool,
    /// Parse tool calls out of the text (a chat request with tools); None: all text is content.
    pub tool_calls: Option<ToolCalls>,
    /// Verify calls in the compact binary form (the verifier offers it and `--verify-wire binary`).
    pub binary: bool,
    /// The grammar the output follows (structured outputs); None: free text.
    pub grammar: Option<Constraint>,
    /// The conversation's routing key, sent to the verifier in spade-core's `AFFINITY_HEADER` (see
    /// spade-core's `affinity`), so that a load balancer keeps its turns on one replica.
    pub affinity: String,
    /// An editor's line rules (`/infill`'s `n_indent`, `t_max_predict_ms`); None: none.
    pub line_rules: Option<LineRules>,
    /// Drafts copied from the request's `prediction` or the context; None: the draft model's only.
    pub proposer: Option<Proposer>,
    /// The verifier's rule; None when it was known to be down (the draft model answers alone).
    pub rule: Option<AcceptRule>,
}

/// llama-server's line rules for an editor completion (spade-core's `fim::LineLimits`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LineRules {
    pub n_indent: usize,
    /// Counted from the first token: past it, the answer ends with the next line end.
    pub time_limit: Option<std::time::Duration>,
}

/// Why the text ended, finer than [`FinishReason`] (llama-server's `stop_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// The model's end token.
    Token,
    /// A stop sequence.
    Sequence,
    /// A line rule ([`LineRules`]).
    LineRule,
    /// The token budget.
    Length,
    /// A tool call under `parallel_tool_calls: false`.
    ToolCall,
}

/// A grammar as the verifier is sent it, and compiled for the draft.
#[derive(Clone)]
pub struct Constraint {
    pub wire: GrammarConstraint,
    pub compiled: Grammar,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint").field("wire", &self.wire).finish_non_exhaustive()
    }
}

/// How a request's tool calls are found and handed over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCalls {
    /// `parallel_tool_calls`: false ends the generation after the first call.
    pub parallel: bool,
    /// The request's tools: a call without `<tool_call>` markers must name one.
    pub names: Vec<String>,
}

#[derive(Debug)]
pub enum Event {
    Text {
        text: String,
        logprobs: Vec<TokenLogprobContent>,
    },
    /// A complete call found in the text (Qwen's or Llama 3.1's format).
    ToolCall(ToolCall),
    Finished {
        finish: FinishReason,
        ending: Ending,
        record: Box<GenerationRecord>,
    },
    Failed(ApiError),
}

pub async fn run(state: AppState, job: Job, events: mpsc::Sender<Event>) {
    let started = Instant::now();
    let closed = events.clone();
    let generation = generate(&state, &job, events.clone(), started);
    let outcome = tokio::select! {
        outcome = generation => outcome,
        _ = closed.closed() => {
            tracing::info!("client went away; generation stopped");
            return;
        }
    };
    match outcome {
        Ok((finish, ending, mut record)) => {
            record.duration = started.elapsed();
            state.metrics.record_generation(&record);
            let _ = events.send(Event::Finished { finish, ending, record: Box::new(record) }).await;
        }
        Err(e) => {
            tracing::warn!("generation failed: {e}");
            state.metrics.record_failure();
            let _ = events.send(Event::Failed(e)).await;
        }
    }
}

async fn generate(
    state: &AppState,
    job: &Job,
    events: mpsc::Sender<Event>,
    started: Instant,
) -> Result<(FinishReason, Ending, GenerationRecord), ApiError> {
    let model = state.model()?.clone();
    // Seeded sampling should reproduce: start it on a fresh draft cache (see Drafter).
    model.begin_generation(job.reproducible).await;
    let _end = EndsGeneration(model.clone());
    let params = LoopParams {
        max_new_tokens: job.max_tokens,
        draft_len: job.draft_len.clone(),
        draft_ahead: state.settings.draft_ahead,
        draft: DraftParams {
            // Under the match rule a draft is accepted when the target samples it: most often for
            // the draft's most likely token.
            sampling: match job.rule {
                Some(AcceptRule::Match) => SamplingParams::greedy(),
                _ => job.sampling.for_draft(state.settings.draft_top_k),
            },
            penalties: job.penalties.clone(),
            grammar: job
                .grammar
                .as_ref()
                .map(|g| SharedGrammar::new(g.compiled.start_at(g.wire.start as usize))),
            seed: job.seed,
        },
        stop_token_ids: model.meta().stop_token_ids.clone(),
        when_unreachable: match state.settings.fallback {
            OfflineFallback::Draft => WhenUnreachable::DraftAlone,
            OfflineFallback::Off => WhenUnreachable::Fail,
        },
        start_degraded: !job.verify,
        proposer: job.proposer.clone(),
    };
    let rule = TargetRule {
        sampling: job.sampling,
        penalties: job.penalties.clone(),
        accept: job.rule.unwrap_or_default(),
    };
    let grammar = job.grammar.as_ref().map(|g| g.wire.clone());
    let mut remote = RemoteVerifier::new(
        state.clone(),
        rule,
        grammar,
        job.seed,
        job.top_logprobs,
        job.binary,
        job.affinity.clone(),
    );
    let mut output = Output::new(model.clone(), job, events, started);
    let end =
        speculative::run(Some(model.as_ref()), &mut remote, &job.prompt, &params, &mut output)
            .await
            .map_err(|e| match e {
                LoopError::Engine(e) => ApiError::from(e),
                LoopError::Verifier(VerifyFailure::Unreachable(e)) => {
                    ApiError::VerifierUnavailable(e)
                }
                LoopError::Verifier(VerifyFailure::Rejected(e)) => ApiError::VerifierFailed(e),
            })?;
    let (finish, ending) = match end.finish {
        // The sink stops at a stop sequence or a line rule, or after the one call
        // `parallel_tool_calls: false` allows.
        Finish::Sink if output.calls > 0 => (FinishReason::ToolCalls, Ending::ToolCall),
        Finish::Sink => (FinishReason::Stop, output.ending.unwrap_or(Ending::Sequence)),
        Finish::StopToken => output.finish(FinishReason::Stop, Ending::Token).await?,
        Finish::Length => output.finish(FinishReason::Length, Ending::Length).await?,
    };
    let stats = end.stats;
    let record = GenerationRecord {
        completion_tokens: stats.committed as u64,
        verify_calls: stats.target_calls as u64,
        drafted: stats.drafted as u64,
        accepted: stats.accepted as u64,
        bytes_sent: remote.bytes_sent,
        bytes_received: remote.bytes_received,
        prompt_tokens: job.prompt.len() as u64,
        prompt_cached_tokens: remote.prompt_cached_tokens.map(u64::from),
        draft_cached_tokens: (params.draft_len.max() > 0)
            .then(|| model.cached_context(&job.prompt))
            .flatten()
            .map(|n| n as u64),
        degraded: stats.degraded,
        prediction_tokens: job.proposer.as_ref().map_or(0, |p| p.prediction_len() as u64),
        predicted: stats.predicted as u64,
        predicted_accepted: stats.predicted_accepted as u64,
        looked_up: stats.looked_up as u64,
        looked_up_accepted: stats.looked_up_accepted as u64,
        ttft: output.ttft,
        duration: Default::default(),
        draft_len: job.draft_len.label(),
        rule: job.rule,
        ahead_drafted: stats.ahead_drafted as u64,
        ahead_used: stats.ahead_used as u64,
        timing: SpadeTiming {
            draft_s: stats.draft_time.as_secs_f64(),
            overlap_s: stats.overlap_time.as_secs_f64(),
            link_s: stats.verify_time.saturating_sub(stats.verifier_time).as_secs_f64(),
            verifier_s: stats.verifier_time.as_secs_f64(),
        },
        auto: stats.choice,
    };
    Ok((finish, ending, record))
}

/// Tells the draft model that the generation ended, however it ends (finished, failed, abandoned).
struct EndsGeneration(Arc<dyn EdgeModel>);

impl Drop for EndsGeneration {
    fn drop(&mut self) {
        self.0.end_generation();
    }
}

/// Committed tokens to streamed text: detokenised incrementally, cut at stop sequences, with logprobs,
/// and tool calls taken out of it when the request has tools.
struct Output {
    model: Arc<dyn EdgeModel>,
    decoder: IncrementalDecoder,
    stops: StopMatcher,
    /// Present when the request has tools.
    parser: Option<ToolCallParser>,
    /// `parallel_tool_calls: false`: the first call ends the generation.
    single_call: bool,
    /// Tool calls handed over so far.
    calls: usize,
    /// Logprobs of tokens whose text is not sent yet.
    pending_logprobs: Vec<TokenLogprobContent>,
    events: mpsc::Sender<Event>,
    started: Instant,
    ttft: Option<std::time::Duration>,
    /// The line rules and their time limit, where the request has them.
    lines: Option<(LineLimits, Option<std::time::Duration>)>,
    /// When the first token was committed (the line rules' time limit counts from it).
    first_token: Option<Instant>,
    /// Why the sink stopped the generation, when it did.
    ending: Option<Ending>,
}

impl Output {
    fn new(
        model: Arc<dyn EdgeModel>,
        job: &Job,
        events: mpsc::Sender<Event>,
        started: Instant,
    ) -> Self {
        let stops = StopMatcher::new(job.stops.clone());
        let tools = job.tool_calls.clone();
        let single_call = tools.as_ref().is_some_and(|t| !t.parallel);
        let parser = tools.map(|t| ToolCallParser::new(t.names));
        Self {
            model,
            decoder: IncrementalDecoder::new(),
            stops,
            parser,
            single_call,
            calls: 0,
            pending_logprobs: Vec::new(),
            events,
            started,
            ttft: None,
            lines: job.line_rules.map(|r| (LineLimits::new(r.n_indent), r.time_limit)),
            first_token: None,
            ending: None,
        }
    }

    /// Flushes held-back text and ends (with `stop` after all if that text completes a stop sequence).
    async fn finish(
        &mut self,
        finish: FinishReason,
        ending: Ending,
    ) -> Result<(FinishReason, Ending), ApiError> {
        let model = self.model.clone();
        let tail = self.decoder.finish(|ids| model.decode(ids))?;
        let mut step = self.stops.push(&tail);
        if !step.stopped {
            step.emit.push_str(&self.stops.finish());
        }
        let (mut text, limited) = self.apply_line_rules(step.emit);
        if !limited {
            text.extend(self.lines.as_mut().map(|(l, _)| l.finish()));
        }
        self.send_text(text).await;
        let held = self.parser.as_mut().map(ToolCallParser::finish).unwrap_or_default();
        self.send(held).await;
        Ok(match (self.calls, step.stopped, limited) {
            (1.., _, _) => (FinishReason::ToolCalls, Ending::ToolCall),
            (0, true, _) => (FinishReason::Stop, Ending::Sequence),
            (0, false, true) => (FinishReason::Stop, Ending::LineRule),
            (0, false, false) => (finish, ending),
        })
    }

    /// `text` through the line rules, if the request has them: what to send, and whether they end
    /// the answer here.
    fn apply_line_rules(&mut self, text: String) -> (String, bool) {
        let Some((limits, time_limit)) = self.lines.as_mut() else {
            return (text, false);
        };
        let late = match (time_limit, self.first_token) {
            (Some(limit), Some(first)) => first.elapsed() > *limit,
            _ => false,
        };
        let step = limits.push(&text, late);
        (step.emit, step.stopped)
    }

    /// Sends text on, through the tool-call parser when there is one. Returns whether generation
    /// should stop (a call made under `parallel_tool_calls: false`).
    async fn send_text(&mut self, text: String) -> bool {
        let outputs = match &mut self.parser {
            Some(parser) => parser.push(&text),
            None => vec![ToolOutput::Text(text)],
        };
        self.send(outputs).await
    }

    async fn send(&mut self, outputs: Vec<ToolOutput>) -> bool {
        for output in outputs {
            let event = match output {
                ToolOutput::Text(text) if text.is_empty() => continue,
                ToolOutput::Text(text) => {
                    Event::Text { text, logprobs: std::mem::take(&mut self.pending_logprobs) }
                }
                ToolOutput::Call { name, arguments } => {
                    if self.calls > 0 && self.single_call {
                        continue;
                    }
                    self.calls += 1;
                    let id = format!("call_{:024x}", rand::rng().random::<u128>() >> 32);
                    Event::ToolCall(ToolCall {
                        id,
                        kind: "function".into(),
                        function: FunctionCall { name, arguments },
                    })
                }
            };
            self.ttft.get_or_insert_with(|| self.started.elapsed());
            // A closed channel means the client left; the generation is dropped right after.
            let _ = self.events.send(event).await;
        }
        self.calls > 0 && self.single_call
    }

    fn logprob_content(&self, lp: &TokenLogprob) -> Result<TokenLogprobContent, EngineError> {
        let piece = |t: u32| self.model.decode(&[t]);
        let token = piece(lp.token)?;
        let top = lp
            .top
            .iter()
            .map(|&(t, logprob)| {
                Ok(TopLogprob { bytes: Some(piece(t)?.into_bytes()), token: piece(t)?, logprob })
            })
            .collect::<Result<_, EngineError>>()?;
        Ok(TokenLogprobContent {
            bytes: Some(token.clone().into_bytes()),
            token,
            logprob: lp.logprob,
            top_logprobs: top,
        })
    }
}

#[async_trait::async_trait]
impl TokenSink for Output {
    async fn commit(
        &mut self,
        token: u32,
        logprob: Option<&TokenLogprob>,
    ) -> Result<Flow, EngineError> {
        // A stop token ends the generation without text of its own (the loop stops after it).
        if self.model.meta().stop_token_ids.contains(&token) {
            return Ok(Flow::Continue);
        }
        if let Some(lp) = logprob {
            let content = self.logprob_content(lp)?;
            self.pending_logprobs.push(content);
        }
        self.first_token.get_or_insert_with(Instant::now);
        let model = self.model.clone();
        let text = self.decoder.push(token, |ids| model.decode(ids))?;
        let step = self.stops.push(text.as_deref().unwrap_or(""));
        let (text, limited) = self.apply_line_rules(step.emit);
        let called = self.send_text(text).await;
        if step.stopped {
            self.ending = Some(Ending::Sequence);
        } else if limited {
            self.ending = Some(Ending::LineRule);
        }
        Ok(if step.stopped || limited || called { Flow::Stop } else { Flow::Continue })
    }
}
