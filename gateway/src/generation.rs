//! One generation: draft on the edge, verify in the cloud, stream what is committed.
//!
//! Runs as its own task and reports through a bounded channel. When the client goes away the
//! receiver is dropped: the loop notices before every draft and while a verify call is in flight
//! (the call is cancelled), so no further verify call is made for that request.

use std::time::Instant;

use rand::Rng;
use spade_core::openai::{FinishReason, TokenLogprobContent, TopLogprob};
use spade_core::protocol::{TokenLogprob, VerifyRequest, WireDraftToken};
use spade_core::{DraftToken, IncrementalDecoder, SamplingParams, StopMatcher};
use spade_engine::{DraftParams, EdgeModel};
use tokio::sync::mpsc;

use crate::config::OfflineFallback;
use crate::error::ApiError;
use crate::metrics::GenerationRecord;
use crate::state::AppState;
use crate::verifier::CallError;

/// Tokens per draft call when the draft model answers alone.
const DEGRADED_BLOCK: usize = 16;

/// A validated request, ready to run.
#[derive(Debug, Clone)]
pub struct Job {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub seed: u64,
    pub stops: Vec<String>,
    /// Some(n): return each token's logprob with n alternatives.
    pub top_logprobs: Option<u8>,
    /// False when the verifier was already known to be down and the fallback is on.
    pub verify: bool,
    /// A seeded sampled request: worth a fresh draft cache so that it reproduces.
    pub reproducible: bool,
}

#[derive(Debug)]
pub enum Event {
    Text { text: String, logprobs: Vec<TokenLogprobContent> },
    Finished { finish: FinishReason, record: GenerationRecord },
    Failed(ApiError),
}

pub async fn run(state: AppState, job: Job, events: mpsc::Sender<Event>) {
    let started = Instant::now();
    let mut run = Run::new(&state, job, events, started);
    match run.generate().await {
        Ok(Some(finish)) => {
            run.record.duration = started.elapsed();
            state.metrics.record_generation(&run.record);
            let _ = run.events.send(Event::Finished { finish, record: std::mem::take(&mut run.record) }).await;
        }
        Ok(None) => tracing::info!(tokens = run.record.completion_tokens, "client went away; generation stopped"),
        Err(e) => {
            tracing::warn!("generation failed: {e}");
            state.metrics.record_failure();
            let _ = run.events.send(Event::Failed(e)).await;
        }
    }
}

struct Run<'a> {
    state: &'a AppState,
    job: Job,
    events: mpsc::Sender<Event>,
    started: Instant,
    seq: Vec<u32>,
    /// Tokens of `seq` the verifier's session holds; 0 sends the full context.
    synced: usize,
    session_id: String,
    /// A verify call was sent: the verifier may hold a session to free at the end.
    session_opened: bool,
    decoder: IncrementalDecoder,
    stops: StopMatcher,
    /// Logprobs of tokens whose text is not sent yet.
    pending_logprobs: Vec<TokenLogprobContent>,
    record: GenerationRecord,
    /// The model whose generation began, told when this run ends however it ends.
    began: Option<std::sync::Arc<dyn EdgeModel>>,
}

/// Returned by the loop's steps when the client disconnected: stop quietly.
struct Gone;

impl<'a> Run<'a> {
    fn new(state: &'a AppState, job: Job, events: mpsc::Sender<Event>, started: Instant) -> Self {
        let session_id = format!("gw-{:032x}", rand::rng().random::<u128>());
        let record = GenerationRecord { degraded: !job.verify, ..Default::default() };
        let stops = StopMatcher::new(job.stops.clone());
        let seq = job.prompt.clone();
        Self {
            state,
            job,
            events,
            started,
            seq,
            synced: 0,
            session_id,
            session_opened: false,
            decoder: IncrementalDecoder::new(),
            stops,
            pending_logprobs: Vec::new(),
            record,
            began: None,
        }
    }

    /// Some(finish) when done, None when the client went away.
    async fn generate(&mut self) -> Result<Option<FinishReason>, ApiError> {
        let model = self.state.model()?.clone();
        // Seeded sampling should reproduce: start it on a fresh draft cache (see Drafter).
        model.begin_generation(self.job.reproducible).await;
        self.began = Some(model.clone());
        let draft_params = DraftParams { sampling: self.job.sampling.for_draft(self.state.settings.draft_top_k), seed: self.job.seed };
        while self.produced() < self.job.max_tokens {
            if self.events.is_closed() {
                return Ok(None);
            }
            // A round commits at most d + 1 tokens: never draft past the budget.
            let remaining = self.job.max_tokens - self.produced();
            let d = if self.record.degraded {
                // Drafting alone: long blocks, since each draft call re-prefills what mistral.rs's
                // prefix cache cannot match (a context that ends inside a cached entry).
                DEGRADED_BLOCK.max(self.state.settings.draft_len).min(remaining)
            } else {
                self.state.settings.draft_len.min(remaining - 1)
            };
            let drafts = match d {
                0 => Vec::new(),
                _ => tokio::select! {
                    drafts = model.draft(&self.seq, d, &draft_params) => drafts?,
                    _ = self.events.closed() => return Ok(None),
                },
            };
            let (committed, logprobs) = if self.record.degraded {
                if drafts.is_empty() {
                    return Err(ApiError::Internal("the draft model proposed nothing".into()));
                }
                (drafts.iter().map(|d| d.token).collect(), Vec::new())
            } else {
                match self.verify(&drafts).await {
                    Ok(round) => round,
                    Err(Ok(Gone)) => return Ok(None),
                    Err(Err(CallError::Unreachable(e))) if self.state.settings.fallback == OfflineFallback::Draft => {
                        tracing::warn!("verifier unreachable ({e}); continuing with the draft model alone");
                        self.record.degraded = true;
                        continue;
                    }
                    Err(Err(CallError::Unreachable(e))) => return Err(ApiError::VerifierUnavailable(e)),
                    Err(Err(e)) => return Err(ApiError::VerifierFailed(e.to_string())),
                }
            };
            for (i, &token) in committed.iter().enumerate() {
                self.seq.push(token);
                self.record.completion_tokens += 1;
                if model.meta().stop_token_ids.contains(&token) {
                    return self.finish(model.as_ref(), FinishReason::Stop).await;
                }
                if let Some(lp) = logprobs.get(i) {
                    self.pending_logprobs.push(self.logprob_content(model.as_ref(), lp)?);
                }
                let text = self.decoder.push(token, |ids| model.decode(ids))?;
                let step = self.stops.push(text.as_deref().unwrap_or(""));
                self.send_text(step.emit).await?;
                if step.stopped {
                    return Ok(Some(FinishReason::Stop));
                }
                if self.produced() == self.job.max_tokens {
                    break;
                }
            }
        }
        self.finish(model.as_ref(), FinishReason::Length).await
    }

    fn produced(&self) -> usize {
        self.record.completion_tokens as usize
    }

    /// Flushes held-back text and ends (with `stop` after all if that text completes a stop sequence).
    async fn finish(&mut self, model: &dyn EdgeModel, finish: FinishReason) -> Result<Option<FinishReason>, ApiError> {
        let tail = self.decoder.finish(|ids| model.decode(ids))?;
        let mut step = self.stops.push(&tail);
        if !step.stopped {
            step.emit.push_str(&self.stops.finish());
        }
        self.send_text(step.emit).await?;
        Ok(Some(if step.stopped { FinishReason::Stop } else { finish }))
    }

    /// One verify call (resending the full context if the verifier lost the session). The error
    /// is `Ok(Gone)` when the client disconnected during the call.
    async fn verify(&mut self, drafts: &[DraftToken]) -> Result<(Vec<u32>, Vec<TokenLogprob>), Result<Gone, CallError>> {
        loop {
            let request = VerifyRequest {
                session_id: Some(self.session_id.clone()),
                context: self.seq[self.synced..].to_vec(),
                context_start: self.synced as u32,
                draft: drafts.iter().map(WireDraftToken::from_draft).collect(),
                sampling: self.job.sampling,
                seed: self.job.seed,
                top_logprobs: self.job.top_logprobs,
            };
            self.session_opened = true;
            let result = tokio::select! {
                r = self.state.verifier.verify(&request) => r,
                _ = self.events.closed() => return Err(Ok(Gone)),
            };
            let exchange = match result {
                Err(CallError::ResendContext) if self.synced > 0 => {
                    tracing::info!("verifier lost the session; resending the full context");
                    self.synced = 0;
                    continue;
                }
                Err(e) => return Err(Err(e)),
                Ok(x) => x,
            };
            self.state.metrics.record_verify_latency(exchange.latency);
            let r = exchange.response;
            let accepted = r.accepted as usize;
            if accepted > drafts.len() {
                return Err(Err(CallError::Rejected(format!("accepted {accepted} of {} drafts", drafts.len()))));
            }
            let mut committed: Vec<u32> = drafts[..accepted].iter().map(|d| d.token).collect();
            committed.push(r.next_token);
            if r.session_len as usize != self.seq.len() + committed.len() {
                return Err(Err(CallError::Rejected(format!("session length {} out of step ({} expected)", r.session_len, self.seq.len() + committed.len()))));
            }
            self.synced = r.session_len as usize;
            self.record.verify_calls += 1;
            self.record.drafted += drafts.len() as u64;
            self.record.accepted += accepted as u64;
            self.record.bytes_sent += exchange.bytes_sent;
            self.record.bytes_received += exchange.bytes_received;
            return Ok((committed, r.logprobs.unwrap_or_default()));
        }
    }

    async fn send_text(&mut self, text: String) -> Result<(), ApiError> {
        if text.is_empty() {
            return Ok(());
        }
        if self.record.ttft.is_none() {
            self.record.ttft = Some(self.started.elapsed());
        }
        let logprobs = std::mem::take(&mut self.pending_logprobs);
        // A closed channel means the client left; the loop checks for that before the next round.
        let _ = self.events.send(Event::Text { text, logprobs }).await;
        Ok(())
    }

    fn logprob_content(&self, model: &dyn EdgeModel, lp: &TokenLogprob) -> Result<TokenLogprobContent, ApiError> {
        let piece = |t: u32| -> Result<String, ApiError> { Ok(model.decode(&[t])?) };
        let token = piece(lp.token)?;
        let top = lp
            .top
            .iter()
            .map(|&(t, logprob)| Ok(TopLogprob { bytes: Some(piece(t)?.into_bytes()), token: piece(t)?, logprob }))
            .collect::<Result<_, ApiError>>()?;
        Ok(TokenLogprobContent { bytes: Some(token.clone().into_bytes()), token, logprob: lp.logprob, top_logprobs: top })
    }
}

impl Drop for Run<'_> {
    fn drop(&mut self) {
        if let Some(model) = self.began.take() {
            model.end_generation();
        }
        // The verifier holds this generation's KV cache: free it now, not at LRU eviction.
        if self.session_opened {
            let (state, id) = (self.state.clone(), std::mem::take(&mut self.session_id));
            tokio::spawn(async move { state.verifier.end_session(&id).await });
        }
    }
}
