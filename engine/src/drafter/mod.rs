//! The edge drafter on mistral.rs.
//!
//! Each round is one mistral.rs completion request over the committed token ids. Our own sampler runs
//! inside a mistral.rs logits processor: it computes q with spade-core, draws the token from exactly
//! that q, records both, and returns logits that leave mistral.rs's argmax no other choice. The
//! engine's reported logprobs are never used.
//!
//! Consecutive rounds of a generation reuse each other's KV rows through mistral.rs's prefix cache.
//! We build against mistral.rs 0.8.1 with fixes to that cache and its engine (patches/README.md):
//! entries keyed only by tokens that have KV rows, a request that is a prefix of an entry served from
//! it, entries holding only their rows and copied on a hit instead of overwritten in place, eviction
//! on CPU by count and by bytes (`DrafterOptions::cache_budget_bytes`), no thread left behind by a
//! dropped engine, and batching of KV buffers of different capacities. The token embeddings stay
//! quantized.

use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use either::Either;
use mistralrs::core::TokenizationRequest;
use mistralrs::core::{
    AutoDeviceMapParams, DefaultSchedulerMethod, DeviceMapSetting, GGUFLoaderBuilder,
    GGUFSpecificConfig, MistralRsBuilder, ModelDType, NormalRequest, Pipeline, Request,
    RequestMessage, Response, SchedulerConfig, TokenSource,
};
use mistralrs::{CustomLogitsProcessor, Model, Tool};
use spade_core::DraftToken;
use tokio::sync::RwLock;

use crate::gguf::{read_meta, LazyVocabulary, ModelMeta, ModelSource};
use crate::{
    release_freed_memory, ContextRows, DraftMessage, DraftParams, DraftStream, Drafter,
    EngineError, KeepDrafting, Role, ToolSpec, Turn,
};

mod recorder;
mod template;

use recorder::{context_key, new_request, CacheCounts, Recorder};
use template::template_message;

#[derive(Debug, Clone)]
pub struct DrafterOptions {
    /// Sequences mistral.rs batches into one step. 1 by default: on CPU, batching concurrent
    /// generations' rounds made 8 concurrent 24-token streams 17x slower in aggregate (0.89 vs
    /// 14.9 tokens/s, SmolLM2 stack); one round at a time is short, so queued rounds wait little.
    pub max_concurrent: usize,
    /// Bytes of KV rows the prefix cache keeps, beyond which its oldest entries are evicted (None: no
    /// limit). The cache is bounded by entry count too; this bounds what long contexts make those
    /// entries weigh. The bound is mistral.rs's, so it is process-wide: the last drafter loaded sets it.
    pub cache_budget_bytes: Option<usize>,
}

impl Default for DrafterOptions {
    fn default() -> Self {
        Self { max_concurrent: 1, cache_budget_bytes: Some(256 << 20) }
    }
}

/// Finished rounds the prefix cache keeps: each running generation needs its last one, so up to
/// this many generations interleave without re-prefilling (each entry holds its context's KV rows,
/// 24 KB a token for Qwen 0.5B; `DrafterOptions::cache_budget_bytes` bounds their sum).
const CACHED_ROUNDS: usize = 32;

struct Runner {
    model: Model,
    rounds: AtomicUsize,
    /// The dropped engine's thread frees its cache asynchronously: trim once more on the next round.
    trim_pending: AtomicBool,
}

pub struct MistralDrafter {
    meta: ModelMeta,
    tokenizer: Arc<tokenizers::Tokenizer>,
    pipeline: Arc<tokio::sync::Mutex<dyn Pipeline>>,
    runner: RwLock<Runner>,
    options: DrafterOptions,
    /// Generations between begin_generation and end_generation.
    active: AtomicUsize,
    /// Draft streams alive: blocks someone is still drafting or waiting to draft.
    drafting: Arc<AtomicUsize>,
    /// Context positions rounds took from the prefix cache, and computed ([`Drafter::context_rows`]).
    rows: Arc<CacheCounts>,
    vocabulary: LazyVocabulary,
}

impl MistralDrafter {
    /// Loads a GGUF model (local path, or hub file where a network exists) with F32 activations.
    pub async fn load(source: &ModelSource, options: DrafterOptions) -> Result<Self, EngineError> {
        let resolved = source.clone();
        let path = tokio::task::spawn_blocking(move || resolved.resolve())
            .await
            .map_err(|e| EngineError::Drafter(e.to_string()))??;
        let meta = read_meta(&path)?;
        // mistral.rs's GGUF loader wants the directory and the file name apart.
        let dir = path
            .parent()
            .map(|d| d.display().to_string())
            .filter(|d| !d.is_empty())
            .unwrap_or_else(|| ".".into());
        let file = path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
        let pipeline = tokio::task::spawn_blocking(move || {
            let loader = GGUFLoaderBuilder::new(
                None,
                None,
                dir,
                vec![file],
                GGUFSpecificConfig { topology: None },
                false,
                None,
            )
            .build();
            loader.load_model_from_hf(
                None,
                TokenSource::None,
                &ModelDType::F32,
                &candle_core::Device::Cpu,
                true,
                DeviceMapSetting::Auto(AutoDeviceMapParams::default_text()),
                None,
                None,
            )
        })
        .await
        .map_err(|e| EngineError::Drafter(e.to_string()))?
        .map_err(|e| EngineError::Drafter(format!("loading the draft model: {e}")))?;
        let pipeline: Arc<tokio::sync::Mutex<dyn Pipeline>> = pipeline;
        mistralrs::core::set_prefix_cache_max_bytes(
            options.cache_budget_bytes.unwrap_or(usize::MAX),
        );
        let tokenizer = pipeline
            .lock()
            .await
            .tokenizer()
            .ok_or_else(|| EngineError::Drafter("the draft model has no tokenizer".into()))?;
        let model = build_runner(&pipeline, options.max_concurrent).await?;
        // Loading copied every tensor through temporary buffers (~the model's size again).
        release_freed_memory();
        let runner = RwLock::new(Runner {
            model,
            rounds: AtomicUsize::new(0),
            trim_pending: AtomicBool::new(false),
        });
        Ok(Self {
            meta,
            tokenizer,
            pipeline,
            runner,
            options,
            active: Default::default(),
            drafting: Default::default(),
            rows: Default::default(),
            vocabulary: LazyVocabulary::new(&path),
        })
    }

    /// The chat template applied to `(role, content)` messages, with the assistant turn opened.
    pub async fn encode_chat(&self, messages: &[(Role, String)]) -> Result<Vec<u32>, EngineError> {
        let turns: Vec<Turn> =
            messages.iter().map(|(role, content)| Turn::new(*role, content.clone())).collect();
        <Self as crate::EdgeModel>::encode_conversation(self, &turns, &[]).await
    }

    /// mistral.rs renders the template (tools included); the turns go in as the maps templates read.
    async fn apply_chat_template(
        &self,
        turns: &[Turn],
        tools: &[ToolSpec],
    ) -> Result<Vec<u32>, EngineError> {
        let messages = turns.iter().map(template_message).collect();
        let tools = tools
            .iter()
            .map(|t| serde_json::to_value(t).and_then(serde_json::from_value::<Tool>))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| EngineError::InvalidRequest(format!("tools: {e}")))?;
        let (tx, mut rx) = tokio::sync::mpsc::channel(1);
        let request = TokenizationRequest {
            text: Either::Left(messages),
            tools: (!tools.is_empty()).then_some(tools),
            add_special_tokens: false,
            add_generation_prompt: true,
            enable_thinking: None,
            reasoning_effort: None,
            response: tx,
        };
        let runner = self.runner.read().await;
        let sender = runner
            .model
            .inner()
            .get_sender(None)
            .map_err(|e| EngineError::Drafter(e.to_string()))?;
        sender
            .send(Request::Tokenize(request))
            .await
            .map_err(|e| EngineError::Drafter(e.to_string()))?;
        match rx.recv().await {
            Some(Ok(ids)) => Ok(ids),
            Some(Err(e)) => {
                Err(EngineError::InvalidRequest(format!("applying the chat template: {e}")))
            }
            None => {
                Err(EngineError::Drafter("the draft engine dropped a tokenization request".into()))
            }
        }
    }

    pub async fn decode(&self, tokens: &[u32]) -> Result<String, EngineError> {
        <Self as crate::EdgeModel>::decode(self, tokens)
    }

    /// mistral.rs's own logits at every position of `tokens` (`return_raw_logits`). Raw requests bypass
    /// the prefix cache and re-prefill everything: for cross-checking the scorer, not for serving.
    pub async fn raw_logits(&self, tokens: &[u32]) -> Result<Vec<Vec<f32>>, EngineError> {
        let (tx, mut rx) = tokio::sync::mpsc::channel(2);
        let runner = self.runner.read().await;
        let request = NormalRequest {
            return_raw_logits: true,
            ..new_request(
                RequestMessage::CompletionTokens(tokens.to_vec()),
                1,
                tx,
                runner.model.inner().next_request_id(),
                None,
            )
        };
        let sender = runner
            .model
            .inner()
            .get_sender(None)
            .map_err(|e| EngineError::Drafter(e.to_string()))?;
        sender
            .send(Request::Normal(Box::new(request)))
            .await
            .map_err(|e| EngineError::Drafter(e.to_string()))?;
        match rx.recv().await {
            Some(Response::Raw { logits_chunks, .. }) => {
                let mut rows = Vec::new();
                for chunk in logits_chunks {
                    let chunk = chunk.to_dtype(candle_core::DType::F32)?;
                    let chunk = if chunk.rank() == 3 { chunk.squeeze(0)? } else { chunk };
                    rows.extend(chunk.to_vec2::<f32>()?);
                }
                Ok(rows)
            }
            Some(Response::InternalError(e)) | Some(Response::ValidationError(e)) => {
                Err(EngineError::Drafter(e.to_string()))
            }
            _ => Err(EngineError::Drafter("no raw logits came back".into())),
        }
    }

    /// Starts a new engine on the loaded pipeline (an empty prefix cache), unless this one never drafted.
    async fn fresh_engine(&self) {
        if self.runner.read().await.rounds.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut runner = self.runner.write().await;
        if runner.rounds.load(Ordering::Relaxed) > 0 {
            tracing::debug!(
                rounds = runner.rounds.load(Ordering::Relaxed),
                "rebuilding the draft engine to drop its prefix cache"
            );
            match build_runner(&self.pipeline, self.options.max_concurrent).await {
                Ok(model) => {
                    runner.model = model;
                    runner.rounds = AtomicUsize::new(0);
                    runner.trim_pending = AtomicBool::new(true);
                    release_freed_memory();
                }
                // Keep drafting on the old engine; the next round tries again.
                Err(e) => tracing::warn!("{e}"),
            }
        }
    }
}

/// mistral.rs's builder panics (`try_lock().unwrap()` on the pipeline) when an engine thread, such as
/// the one being replaced finishing its last step, holds the pipeline at that moment. So: wait until
/// the pipeline is free, build in a task, and retry the rare race that is still lost.
async fn build_runner(
    pipeline: &Arc<tokio::sync::Mutex<dyn Pipeline>>,
    max_concurrent: usize,
) -> Result<Model, EngineError> {
    let method =
        DefaultSchedulerMethod::Fixed(NonZeroUsize::new(max_concurrent.max(1)).expect("non-zero"));
    for attempt in 0..12u32 {
        drop(pipeline.lock().await);
        let builder = MistralRsBuilder::new(
            pipeline.clone(),
            SchedulerConfig::DefaultScheduler { method: method.clone() },
            false,
            None,
        )
        .with_prefix_cache_n(CACHED_ROUNDS);
        match tokio::spawn(async move { builder.build().await }).await {
            Ok(runner) => return Ok(Model::new(runner)),
            Err(e) if e.is_panic() => {
                tracing::debug!(
                    attempt,
                    "the pipeline was busy while building the draft engine; retrying"
                );
                tokio::time::sleep(std::time::Duration::from_millis(5 << attempt.min(6))).await;
            }
            Err(e) => return Err(EngineError::Drafter(format!("building the draft engine: {e}"))),
        }
    }
    Err(EngineError::Drafter("building the draft engine: the pipeline stayed busy".into()))
}

#[async_trait::async_trait]
impl Drafter for MistralDrafter {
    fn meta(&self) -> &ModelMeta {
        &self.meta
    }

    /// A KV row served from the prefix cache can differ in the last float bits from one computed by a
    /// fresh prefill, so drafts depend slightly on what ran before. Harmless for losslessness (q is
    /// whatever we computed), but a seeded request should draft, and so answer, the same every time:
    /// `fresh` starts it from an empty cache. Rebuilding the engine on the loaded pipeline takes
    /// milliseconds.
    ///
    /// Only when asked and no other generation is running: under concurrent load a reset would throw
    /// away every other generation's cache.
    async fn begin_generation(&self, fresh: bool) {
        if self.active.fetch_add(1, Ordering::SeqCst) == 0 && fresh {
            self.fresh_engine().await;
        }
    }

    fn end_generation(&self) {
        let _ = self.active.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
    }

    async fn draft(
        &self,
        committed: &[u32],
        n: usize,
        params: &DraftParams,
    ) -> Result<Vec<DraftToken>, EngineError> {
        self.draft_stream(committed, n, params, None).await?.collect().await
    }

    async fn draft_stream<'a>(
        &'a self,
        committed: &[u32],
        n: usize,
        params: &DraftParams,
        keep: Option<KeepDrafting>,
    ) -> Result<DraftStream<'a>, EngineError> {
        if n == 0 {
            return Ok(DraftStream::ready(Vec::new(), None));
        }
        if committed.is_empty() {
            return Err(EngineError::InvalidRequest("cannot draft after an empty context".into()));
        }
        // The engine must not be rebuilt under a running request: the stream holds a read lock (only
        // a rebuild takes the write lock, so generations drafting at once do not wait on each other).
        let runner = self.runner.read().await;
        runner.rounds.fetch_add(1, Ordering::Relaxed);
        if runner.trim_pending.swap(false, Ordering::Relaxed) {
            release_freed_memory();
        }
        let stop_token_ids = self.meta.stop_token_ids.clone();
        let cancel_with = stop_token_ids.first().copied();
        let (tokens, stream) = DraftStream::channel(n, stop_token_ids);
        let history =
            params.penalties.as_ref().map(|p| std::sync::Mutex::new(p.history(committed)));
        let grammar_context =
            params.grammar.as_ref().map(|_| std::sync::Mutex::new(committed.to_vec()));
        let recorder = Arc::new(Recorder {
            start: committed.len(),
            text_tokens: self.meta.text_tokens as usize,
            n,
            params: params.clone(),
            history,
            grammar_context,
            tokens: tokens.clone(),
            cancel_with,
            keep: keep.map(std::sync::Mutex::new),
            ended: AtomicBool::new(false),
            steps: Default::default(),
            rows: self.rows.clone(),
            context_key: context_key(committed),
        });
        let (tx, mut rx) = tokio::sync::mpsc::channel(2);
        let request = new_request(
            RequestMessage::CompletionTokens(committed.to_vec()),
            n,
            tx,
            runner.model.inner().next_request_id(),
            Some(recorder as Arc<dyn CustomLogitsProcessor>),
        );
        let sender = runner
            .model
            .inner()
            .get_sender(None)
            .map_err(|e| EngineError::Drafter(e.to_string()))?;
        sender
            .send(Request::Normal(Box::new(request)))
            .await
            .map_err(|e| EngineError::Drafter(e.to_string()))?;
        // mistral.rs's engine thread panics when a response cannot be delivered, so the receiver
        // must outlive the request even if the stream is dropped (a client hanging up, a block no
        // longer wanted): a task drains it to the end and then ends the stream.
        tokio::spawn(async move {
            let mut result = Ok(());
            while let Some(response) = rx.recv().await {
                match response {
                    Response::CompletionDone(_) => break,
                    Response::InternalError(e) | Response::ValidationError(e) => {
                        result = Err(EngineError::Drafter(e.to_string()))
                    }
                    Response::CompletionModelError(e, _) | Response::ModelError(e, _) => {
                        result = Err(EngineError::Drafter(e))
                    }
                    _ => continue,
                }
            }
            let _ = tokens.send(DraftMessage::End(result));
        });
        Ok(stream.holding(Box::new((runner, Alive::count(&self.drafting)))))
    }

    fn others_drafting(&self) -> bool {
        self.drafting.load(Ordering::SeqCst) > 0
    }

    fn context_rows(&self) -> ContextRows {
        ContextRows {
            cached: self.rows.cached.load(Ordering::Relaxed),
            computed: self.rows.computed.load(Ordering::Relaxed),
        }
    }

    fn cached_context(&self, context: &[u32]) -> Option<usize> {
        self.rows.cached_for(context_key(context))
    }
}

/// Counts a draft stream as alive until it is dropped.
struct Alive(Arc<AtomicUsize>);

impl Alive {
    fn count(counter: &Arc<AtomicUsize>) -> Self {
        counter.fetch_add(1, Ordering::SeqCst);
        Self(counter.clone())
    }
}

impl Drop for Alive {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}
