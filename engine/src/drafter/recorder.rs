//! Our sampler inside mistral.rs: the logits processor that draws each drafted token from q,
//! and the completion request that runs it.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use mistralrs::core::{Constraint, NormalRequest, RequestMessage, Response};
use mistralrs::CustomLogitsProcessor;
use rand::Rng;
use spade_core::rng::{rng_for, Stream};
use spade_core::{confidence, distribution, DraftToken, History};
use tokio::sync::mpsc::UnboundedSender;

use crate::{DraftMessage, DraftParams, Drawn, KeepDrafting};

pub(super) fn new_request(
    messages: RequestMessage,
    max_len: usize,
    response: tokio::sync::mpsc::Sender<Response>,
    id: usize,
    processor: Option<Arc<dyn CustomLogitsProcessor>>,
) -> NormalRequest {
    NormalRequest {
        messages,
        // Temperature 0, not `deterministic()`'s None (which mistral.rs reads as 1.0): our processor
        // forces the token, and at 0 mistral.rs takes it by argmax instead of a softmax, a top-k sort
        // and a weighted draw over the whole vocabulary at every step.
        sampling_params: mistralrs::SamplingParams {
            max_len: Some(max_len),
            temperature: Some(0.0),
            ..mistralrs::SamplingParams::deterministic()
        },
        response,
        return_logprobs: false,
        is_streaming: false,
        id,
        constraint: Constraint::None,
        suffix: None,
        tools: None,
        tool_choice: None,
        logits_processors: processor.map(|p| vec![p]),
        return_raw_logits: false,
        web_search_options: None,
        model_id: None,
        truncate_sequence: false,
    }
}

/// Our sampler, run by mistral.rs at every step of one round.
pub(super) struct Recorder {
    /// Length of the committed context: the first drafted token's position.
    pub(super) start: usize,
    /// [`ModelMeta::text_tokens`]: ids from here on are padding.
    pub(super) text_tokens: usize,
    pub(super) n: usize,
    pub(super) params: DraftParams,
    /// The penalties' counts, grown by each token this round draws (None without penalties).
    pub(super) history: Option<std::sync::Mutex<History>>,
    /// The committed context and this round's tokens so far, what the grammar's mask follows (None
    /// without a grammar).
    pub(super) grammar_context: Option<std::sync::Mutex<Vec<u32>>>,
    /// Where each drawn token goes; closed when its [`DraftStream`] is dropped.
    pub(super) tokens: UnboundedSender<DraftMessage>,
    /// An end-of-sequence token of the draft model: forced once nobody wants more, so mistral.rs ends
    /// the request at this step instead of running the block out.
    pub(super) cancel_with: Option<u32>,
    /// Asked after each token sent: whether the block goes on.
    pub(super) keep: Option<std::sync::Mutex<KeepDrafting>>,
    /// The block has ended (`keep` said so): nobody wants more.
    pub(super) ended: AtomicBool,
    pub(super) steps: AtomicUsize,
    /// The drafter's count of context positions cached and computed.
    pub(super) rows: Arc<CacheCounts>,
    /// [`context_key`] of the committed context this round drafts after.
    pub(super) context_key: u64,
}

/// What the drafter's rounds found in mistral.rs's prefix cache: context positions cached and
/// computed in all, and how much of the contexts rounds lately started from was cached.
#[derive(Default)]
pub(super) struct CacheCounts {
    pub(super) cached: AtomicU64,
    pub(super) computed: AtomicU64,
    /// (context key, positions cached), newest last, at most [`CacheCounts::RECENT`].
    recent: Mutex<VecDeque<(u64, usize)>>,
}

impl CacheCounts {
    /// Rounds remembered: more than the generations that start at once.
    const RECENT: usize = 64;

    fn record(&self, context_key: u64, cached: usize, computed: usize) {
        self.cached.fetch_add(cached as u64, Ordering::Relaxed);
        self.computed.fetch_add(computed as u64, Ordering::Relaxed);
        let mut recent = self.recent.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if recent.len() == Self::RECENT {
            recent.pop_front();
        }
        recent.push_back((context_key, cached));
    }

    /// Positions cached when a round last started from the context keyed `context_key`.
    pub(super) fn cached_for(&self, context_key: u64) -> Option<usize> {
        let recent = self.recent.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        recent.iter().rev().find(|(key, _)| *key == context_key).map(|&(_, cached)| cached)
    }
}

/// A context's key for [`CacheCounts`] (in-process only).
pub(super) fn context_key(tokens: &[u32]) -> u64 {
    let mut h = std::hash::DefaultHasher::new();
    std::hash::Hash::hash(tokens, &mut h);
    std::hash::Hasher::finish(&h)
}

impl CustomLogitsProcessor for Recorder {
    fn apply(
        &self,
        logits: &candle_core::Tensor,
        context: &[u32],
    ) -> candle_core::Result<candle_core::Tensor> {
        // mistral.rs passes only the uncached suffix as context on a prefix-cache hit, so the position
        // comes from counting our own steps, not from the context's length; and the first step's
        // context is what the round computed.
        let step = self.steps.fetch_add(1, Ordering::SeqCst);
        if step == 0 {
            let computed = context.len().min(self.start);
            self.rows.record(self.context_key, self.start - computed, computed);
        }
        let position = self.start + step;
        let vocab = logits.dim(0)?;
        let force = |token: u32| {
            let mut forced = vec![f32::NEG_INFINITY; vocab];
            forced[token as usize] = 0.0;
            candle_core::Tensor::from_vec(forced, vocab, logits.device())
        };
        if let (true, Some(end)) =
            (self.tokens.is_closed() || self.ended.load(Ordering::SeqCst), self.cancel_with)
        {
            return force(end);
        }
        let mut logits_vec: Vec<f32> = logits.to_dtype(candle_core::DType::F32)?.to_vec1()?;
        // Padding rows are no text, and may lie past the target's own rows.
        logits_vec.iter_mut().skip(self.text_tokens).for_each(|l| *l = f32::NEG_INFINITY);
        let mut history = self
            .history
            .as_ref()
            .map(|h| h.lock().unwrap_or_else(|poisoned| poisoned.into_inner()));
        if let Some(history) = &history {
            history.apply(&mut logits_vec);
        }
        let mut grammar_context = self
            .grammar_context
            .as_ref()
            .map(|c| c.lock().unwrap_or_else(|poisoned| poisoned.into_inner()));
        if let (Some(grammar), Some(context)) = (&self.params.grammar, &grammar_context) {
            if !grammar.mask(context, &mut logits_vec) {
                tracing::debug!(
                    position,
                    "the draft's grammar state cannot follow its context; drafting unconstrained"
                );
            }
        }
        // Drawn from the quantised q, so the q sent (compact on the wire) is exactly the one drawn from.
        let q = distribution(&logits_vec, &self.params.sampling)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?
            .quantized();
        let token = q.sample(rng_for(Stream::Draft, self.params.seed, position as u64).random());
        if let Some(history) = &mut history {
            history.push(token);
        }
        if let Some(context) = &mut grammar_context {
            context.push(token);
        }
        // mistral.rs runs exactly `n` steps (max_len); a step beyond would be its bug, not a draft.
        if step < self.n && !self.ended.load(Ordering::SeqCst) {
            // A closed channel means the stream was dropped: the token is simply not wanted.
            let confidence = confidence(&logits_vec, &q, token);
            let _ = self.tokens.send(DraftMessage::Token(Drawn {
                token: DraftToken { token, q },
                confidence,
                at: std::time::Instant::now(),
            }));
            let keep = self.keep.as_ref().is_none_or(|keep| {
                keep.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).ask(confidence)
            });
            if !keep {
                // The block ends with this token: the stream ends now, and mistral.rs ends the request at
                // this step (its own last token is then the end token, which has no KV row either way).
                self.ended.store(true, Ordering::SeqCst);
                let _ = self.tokens.send(DraftMessage::End(Ok(())));
                if let Some(end) = self.cancel_with {
                    return force(end);
                }
            }
        }
        force(token)
    }
}
