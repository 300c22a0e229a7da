//! spade-engine: the model seam. The only crate that touches mistral.rs or candle.
//!
//! - [`Drafter`]: the edge model proposing tokens with the exact distribution each was drawn from
//!   (`MistralDrafter`, on mistral.rs, with the `drafter` feature: the verifier builds without it).
//! - [`Scorer`]: the cloud model returning logits at every appended position, KV-cached per session
//!   ([`CandleScorer`], on candle's quantized kernels).
//! - [`speculative`]: the in-process loop tying them together with spade-core's verification.

use std::sync::{Arc, Mutex};

use spade_core::grammar::{GrammarState, Vocabulary};

mod draft_stream;
#[cfg(feature = "drafter")]
pub mod drafter;
mod drafting;
mod error;
pub mod gguf;
mod in_process;
pub mod round;
pub mod scorer;
pub mod speculative;

pub use draft_stream::{DraftMessage, DraftStream, Drawn, KeepDrafting};
#[cfg(feature = "drafter")]
pub use drafter::MistralDrafter;
pub use error::EngineError;
pub use gguf::{check_same_vocabulary, read_meta, read_tokens, ModelMeta, ModelSource};
pub use scorer::CandleScorer;
pub use spade_core::openai::{Role, Turn};
pub use spade_core::tools::ToolSpec;
pub use spade_core::DraftToken;

/// Freed buffers (dropped KV caches, a dropped engine, loading's temporary copies) are large; asks
/// glibc to hand their pages back, so resident memory follows what is held.
pub fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free heap memory; it has no preconditions.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Threads for the scorer's kernels (rayon's global pool); call once, before loading a model.
pub fn set_compute_threads(n: usize) -> Result<(), String> {
    rayon::ThreadPoolBuilder::new().num_threads(n).build_global().map_err(|e| e.to_string())
}

/// How the draft samples. Any q is lossless (the verifier corrects for it); a q close to the
/// target's p is what makes drafts accepted.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DraftParams {
    pub sampling: spade_core::SamplingParams,
    /// The target's penalties and bias, applied to q from the same history (None: none).
    pub penalties: Option<spade_core::Penalties>,
    /// The target's grammar, masking q as it masks p (None: unconstrained).
    pub grammar: Option<SharedGrammar>,
    pub seed: u64,
}

/// One generation's grammar state, shared by its rounds of drafting: each brings it to its own
/// context first ([`GrammarState::sync`]), so rounds dropped or drafted ahead cannot leave it astray.
#[derive(Clone)]
pub struct SharedGrammar(Arc<Mutex<GrammarState>>);

impl SharedGrammar {
    pub fn new(state: GrammarState) -> Self {
        Self(Arc::new(Mutex::new(state)))
    }

    /// Masks the logits of the token after `context`. False, with the logits untouched, where the
    /// grammar cannot follow: q is then merely further from p, never wrong.
    pub fn mask(&self, context: &[u32], logits: &mut [f32]) -> bool {
        let mut state = self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        state.sync(context).and_then(|()| state.mask(logits)).is_ok()
    }
}

impl PartialEq for SharedGrammar {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl std::fmt::Debug for SharedGrammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SharedGrammar")
    }
}

/// The edge model: proposes up to `n` tokens after `committed`, each with its exact q.
#[async_trait::async_trait]
pub trait Drafter: Send + Sync {
    fn meta(&self) -> &ModelMeta;

    /// Called when a generation starts. A drafter whose state can leak between generations (a shared
    /// prefix cache) clears it here when `fresh` is asked for, so the same request with the same seed
    /// drafts the same tokens. Clearing costs time, so callers ask only where reproducibility matters.
    async fn begin_generation(&self, _fresh: bool) {}

    /// Called when a generation that began ends, however it ends (finished, failed, abandoned).
    fn end_generation(&self) {}

    /// May return fewer than `n` tokens (an end-of-sequence token ends the block).
    async fn draft(
        &self,
        committed: &[u32],
        n: usize,
        params: &DraftParams,
    ) -> Result<Vec<DraftToken>, EngineError>;

    /// The same tokens as [`Drafter::draft`], each handed over as soon as it is drawn, so the loop can
    /// drop drafting it is no longer interested in; `keep`, asked after each token, may end the block
    /// sooner. By default all at once.
    async fn draft_stream<'a>(
        &'a self,
        committed: &[u32],
        n: usize,
        params: &DraftParams,
        keep: Option<KeepDrafting>,
    ) -> Result<DraftStream<'a>, EngineError> {
        Ok(DraftStream::ready(self.draft(committed, n, params).await?, keep))
    }

    /// Whether blocks are being drafted (or wait to be) when the caller has none open: other
    /// generations' drafting, which drafting ahead now would delay on a drafter that runs one block at a time.
    fn others_drafting(&self) -> bool {
        false
    }

    /// Context positions the draft model's rounds found in its prefix cache, and computed, since it
    /// started: how often it reads each token of a conversation. Zeros where it does not count them.
    fn context_rows(&self) -> ContextRows {
        ContextRows::default()
    }

    /// Positions of `context` the draft model's prefix cache held when a round last started from
    /// exactly `context` (a generation's prompt: its first round). None where it does not say.
    fn cached_context(&self, _context: &[u32]) -> Option<usize> {
        None
    }

    /// Makes drafting after `context` cheap (its KV rows cached) without proposing anything. The loop
    /// runs it while the verifier prefills the same prompt. By default: a one-token draft, discarded
    /// (a prefill and one sampling step; draft randomness is keyed by position, so nothing shifts).
    async fn prefill(&self, context: &[u32], params: &DraftParams) -> Result<(), EngineError> {
        self.draft(context, 1, params).await.map(|_| ())
    }
}

/// Context positions of a drafter's rounds: taken from its prefix cache, or computed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ContextRows {
    pub cached: u64,
    pub computed: u64,
}

/// The edge model as the gateway sees it: a drafter that also owns the chat template and tokenizer.
#[async_trait::async_trait]
pub trait EdgeModel: Drafter {
    /// Chat turns through the model's chat template, with the tools shown to the model and the
    /// assistant turn opened.
    async fn encode_conversation(
        &self,
        turns: &[Turn],
        tools: &[ToolSpec],
    ) -> Result<Vec<u32>, EngineError>;
    /// Ids to text, special tokens skipped. Cheap and synchronous: called for every streamed token.
    fn decode(&self, tokens: &[u32]) -> Result<String, EngineError>;
    /// Text to ids without a chat template, with the tokenizer's special tokens (BOS) when asked.
    async fn encode_text(
        &self,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, EngineError>;
    /// Ids to text, special tokens kept.
    fn decode_all(&self, tokens: &[u32]) -> Result<String, EngineError>;
    /// The vocabulary's own string for `id` (for example `Ġthe`); None outside the vocabulary.
    fn token_piece(&self, id: u32) -> Option<String>;
    /// The vocabulary grammars are compiled against (blocking the first time: it is built lazily).
    fn vocabulary(&self) -> Result<&Vocabulary, EngineError> {
        Err(EngineError::Unsupported("this model does not support constrained decoding".into()))
    }
}

/// Logit rows, `[positions][vocab]`.
pub type Logits = Vec<Vec<f32>>;

/// The cloud model. Weights are shared; each context gets its own [`ScoreSession`].
pub trait Scorer: Send + Sync {
    fn meta(&self) -> &ModelMeta;
    fn new_session(&self) -> Box<dyn ScoreSession>;
    /// The vocabulary grammars are compiled against (blocking the first time: it is built lazily).
    fn vocabulary(&self) -> Result<&Vocabulary, EngineError> {
        Err(EngineError::Unsupported("this scorer does not support constrained decoding".into()))
    }
    /// Advances several sessions in one pass; entry i is `Some(logits)` once job i's sequence is
    /// fully scored, `None` after a partial step. Each job's result is exactly what scoring it alone
    /// gives. By default the jobs run one after another; [`CandleScorer`] runs them as one forward
    /// pass with the linear layers over every job's rows at once.
    fn score_batch(&self, jobs: &mut [BatchJob<'_>]) -> Vec<Result<Option<Logits>, EngineError>> {
        jobs.iter_mut().map(BatchJob::score_alone).collect()
    }
}

/// Context a timed pass scores after: a short prompt's worth, so attention costs what it does in a chat.
const TIMING_CONTEXT: u32 = 64;

/// Sweeps over every block size [`time_passes`] takes: the fastest of them is kept per size.
const TIMING_SWEEPS: usize = 3;

/// The time of one forward pass of each block size `1..=max_rows` on a throwaway session, each after
/// the same context with logits for every row, as a verify call's block is scored: entry `i` for
/// `i + 1` rows. The sizes are timed in [`TIMING_SWEEPS`] sweeps, each size's fastest pass kept, since
/// another process can only slow a pass: timing each size's passes one after another let one slow
/// stretch of a shared host land on one or two sizes, and 4 rows came out faster than 3, which no
/// later pass of those sizes corrected.
/// A model with a short context times fewer sizes, after a shorter context.
pub fn time_passes(
    scorer: &dyn Scorer,
    max_rows: usize,
) -> Result<Vec<std::time::Duration>, EngineError> {
    let (vocab, max_context) =
        (scorer.meta().vocab_size.clamp(1, 30_000), scorer.meta().max_context as usize);
    let max_rows = max_rows.min(max_context / 2);
    let context = (TIMING_CONTEXT as usize).min(max_context - max_rows).max(1);
    let tokens: Vec<u32> =
        (0..(context + max_rows) as u32).map(|i| (i * 7919 + 13) % vocab).collect();
    let mut session = scorer.new_session();
    // Also the first pass over the weights, which pays for faulting them in.
    session.score(&tokens[..context], 1)?;
    let mut fastest = vec![std::time::Duration::MAX; max_rows];
    for _ in 0..TIMING_SWEEPS {
        for (rows, fastest) in (1..=max_rows).zip(&mut fastest) {
            session.truncate(context);
            let started = std::time::Instant::now();
            session.score(&tokens[..context + rows], rows)?;
            *fastest = (*fastest).min(started.elapsed());
        }
    }
    Ok(fastest)
}

/// One session's share of a [`Scorer::score_batch`] pass.
pub struct BatchJob<'a> {
    pub session: &'a mut dyn ScoreSession,
    /// The whole sequence the session is being brought to, as for [`ScoreSession::score`].
    pub tokens: &'a [u32],
    pub logit_rows: usize,
    /// New positions this pass computes: all that are left ([`ScoreSession::rows_to_score`]), which
    /// finishes the job, or at most that many less `logit_rows` (a prefill chunk, no logits yet).
    pub rows: usize,
}

impl BatchJob<'_> {
    /// Whether this pass finishes the job; an error where `rows` splits the rows that need logits.
    pub fn finishes(&self) -> Result<bool, EngineError> {
        let pending = self.session.rows_to_score(self.tokens, self.logit_rows);
        match self.rows {
            r if r == pending => Ok(true),
            r if r >= 1 && r + self.logit_rows <= pending => Ok(false),
            r => Err(EngineError::InvalidRequest(format!(
                "a pass of {r} rows of the {pending} left would split the {} rows that need logits",
                self.logit_rows
            ))),
        }
    }

    fn score_alone(&mut self) -> Result<Option<Logits>, EngineError> {
        if self.finishes()? {
            return self.session.score(self.tokens, self.logit_rows).map(Some);
        }
        let end = self.tokens.len() - self.session.rows_to_score(self.tokens, self.logit_rows)
            + self.rows;
        self.session.score(&self.tokens[..end], 1).map(|_| None)
    }
}

/// A KV-cached context of the target model.
pub trait ScoreSession: Send {
    /// Logits `[logit_rows][vocab]` at the last `logit_rows` positions of `tokens` (row i predicts the token
    /// after `tokens[len - logit_rows + i]`). Reuses the cache for the longest common prefix.
    fn score(&mut self, tokens: &[u32], logit_rows: usize) -> Result<Vec<Vec<f32>>, EngineError>;
    /// The token ids whose KV rows are cached.
    fn cached_tokens(&self) -> &[u32];
    /// Ids from here on are padding rows of the logits ([`ModelMeta::text_tokens`]): never sampled.
    fn text_tokens(&self) -> usize {
        usize::MAX
    }
    /// Drops cached positions from `len` on.
    fn truncate(&mut self, len: usize);
    fn memory_bytes(&self) -> usize;
    /// Positions [`Self::score`] would compute for `tokens`: those after the longest cached prefix,
    /// and at least the `logit_rows` last ones.
    fn rows_to_score(&self, tokens: &[u32], logit_rows: usize) -> usize {
        let common = self.cached_tokens().iter().zip(tokens).take_while(|(a, b)| a == b).count();
        tokens.len() - common.min(tokens.len().saturating_sub(logit_rows))
    }
    /// The concrete session, for a scorer that batches its own sessions' passes.
    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        None
    }
    /// A new session holding a copy of this one's first `len` cached positions (a prefix cache
    /// hit that leaves the entry in place). None where the scorer cannot copy its cache.
    fn fork(&self, _len: usize) -> Option<Box<dyn ScoreSession>> {
        None
    }
}
