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
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use either::Either;
use indexmap::IndexMap;
use mistralrs::core::{
    AutoDeviceMapParams, Constraint, DefaultSchedulerMethod, DeviceMapSetting, GGUFLoaderBuilder, GGUFSpecificConfig, MistralRsBuilder, ModelDType,
    NormalRequest, Pipeline, Request, RequestMessage, Response, SchedulerConfig, TokenSource,
};
use mistralrs::core::{MessageContent, TokenizationRequest};
use mistralrs::{CustomLogitsProcessor, Model, Tool};
use rand::Rng;
use spade_core::grammar::Vocabulary;
use spade_core::rng::{rng_for, Stream};
use spade_core::{confidence, distribution, DraftToken, History};
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::RwLock;

use crate::gguf::{read_meta, LazyVocabulary, ModelMeta, ModelSource};
use crate::{release_freed_memory, ContextRows, DraftMessage, DraftParams, DraftStream, Drafter, Drawn, EngineError, KeepDrafting, Role, ToolSpec, Turn};

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
    rows: Arc<[AtomicU64; 2]>,
    vocabulary: LazyVocabulary,
}

impl MistralDrafter {
    /// Loads a GGUF model (local path, or hub file where a network exists) with F32 activations.
    pub async fn load(source: &ModelSource, options: DrafterOptions) -> Result<Self, EngineError> {
        let resolved = source.clone();
        let path = tokio::task::spawn_blocking(move || resolved.resolve()).await.map_err(|e| EngineError::Drafter(e.to_string()))??;
        let meta = read_meta(&path)?;
        // mistral.rs's GGUF loader wants the directory and the file name apart.
        let dir = path.parent().map(|d| d.display().to_string()).filter(|d| !d.is_empty()).unwrap_or_else(|| ".".into());
        let file = path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
        let pipeline = tokio::task::spawn_blocking(move || {
            let loader = GGUFLoaderBuilder::new(None, None, dir, vec![file], GGUFSpecificConfig { topology: None }, false, None).build();
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
        mistralrs::core::set_prefix_cache_max_bytes(options.cache_budget_bytes.unwrap_or(usize::MAX));
        let tokenizer = pipeline.lock().await.tokenizer().ok_or_else(|| EngineError::Drafter("the draft model has no tokenizer".into()))?;
        let model = build_runner(&pipeline, options.max_concurrent).await?;
        // Loading copied every tensor through temporary buffers (~the model's size again).
        release_freed_memory();
        let runner = RwLock::new(Runner { model, rounds: AtomicUsize::new(0), trim_pending: AtomicBool::new(false) });
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
        let turns: Vec<Turn> = messages.iter().map(|(role, content)| Turn::new(*role, content.clone())).collect();
        <Self as crate::EdgeModel>::encode_conversation(self, &turns, &[]).await
    }

    /// mistral.rs renders the template (tools included); the turns go in as the maps templates read.
    async fn apply_chat_template(&self, turns: &[Turn], tools: &[ToolSpec]) -> Result<Vec<u32>, EngineError> {
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
        let sender = runner.model.inner().get_sender(None).map_err(|e| EngineError::Drafter(e.to_string()))?;
        sender.send(Request::Tokenize(request)).await.map_err(|e| EngineError::Drafter(e.to_string()))?;
        match rx.recv().await {
            Some(Ok(ids)) => Ok(ids),
            Some(Err(e)) => Err(EngineError::InvalidRequest(format!("applying the chat template: {e}"))),
            None => Err(EngineError::Drafter("the draft engine dropped a tokenization request".into())),
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
            ..new_request(RequestMessage::CompletionTokens(tokens.to_vec()), 1, tx, runner.model.inner().next_request_id(), None)
        };
        let sender = runner.model.inner().get_sender(None).map_err(|e| EngineError::Drafter(e.to_string()))?;
        sender.send(Request::Normal(Box::new(request))).await.map_err(|e| EngineError::Drafter(e.to_string()))?;
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
            Some(Response::InternalError(e)) | Some(Response::ValidationError(e)) => Err(EngineError::Drafter(e.to_string())),
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
            tracing::debug!(rounds = runner.rounds.load(Ordering::Relaxed), "rebuilding the draft engine to drop its prefix cache");
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
async fn build_runner(pipeline: &Arc<tokio::sync::Mutex<dyn Pipeline>>, max_concurrent: usize) -> Result<Model, EngineError> {
    let method = DefaultSchedulerMethod::Fixed(NonZeroUsize::new(max_concurrent.max(1)).expect("non-zero"));
    for attempt in 0..12u32 {
        drop(pipeline.lock().await);
        let builder = MistralRsBuilder::new(pipeline.clone(), SchedulerConfig::DefaultScheduler { method: method.clone() }, false, None)
            .with_prefix_cache_n(CACHED_ROUNDS);
        match tokio::spawn(async move { builder.build().await }).await {
            Ok(runner) => return Ok(Model::new(runner)),
            Err(e) if e.is_panic() => {
                tracing::debug!(attempt, "the pipeline was busy while building the draft engine; retrying");
                tokio::time::sleep(std::time::Duration::from_millis(5 << attempt.min(6))).await;
            }
            Err(e) => return Err(EngineError::Drafter(format!("building the draft engine: {e}"))),
        }
    }
    Err(EngineError::Drafter("building the draft engine: the pipeline stayed busy".into()))
}

fn new_request(
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
        sampling_params: mistralrs::SamplingParams { max_len: Some(max_len), temperature: Some(0.0), ..mistralrs::SamplingParams::deterministic() },
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
struct Recorder {
    /// Length of the committed context: the first drafted token's position.
    start: usize,
    /// [`ModelMeta::text_tokens`]: ids from here on are padding.
    text_tokens: usize,
    n: usize,
    params: DraftParams,
    /// The penalties' counts, grown by each token this round draws (None without penalties).
    history: Option<std::sync::Mutex<History>>,
    /// The committed context and this round's tokens so far, what the grammar's mask follows (None
    /// without a grammar).
    grammar_context: Option<std::sync::Mutex<Vec<u32>>>,
    /// Where each drawn token goes; closed when its [`DraftStream`] is dropped.
    tokens: UnboundedSender<DraftMessage>,
    /// An end-of-sequence token of the draft model: forced once nobody wants more, so mistral.rs ends
    /// the request at this step instead of running the block out.
    cancel_with: Option<u32>,
    /// Asked after each token sent: whether the block goes on.
    keep: Option<std::sync::Mutex<KeepDrafting>>,
    /// The block has ended (`keep` said so): nobody wants more.
    ended: AtomicBool,
    steps: AtomicUsize,
    /// The drafter's count of context positions cached and computed.
    rows: Arc<[AtomicU64; 2]>,
}

impl CustomLogitsProcessor for Recorder {
    fn apply(&self, logits: &candle_core::Tensor, context: &[u32]) -> candle_core::Result<candle_core::Tensor> {
        // mistral.rs passes only the uncached suffix as context on a prefix-cache hit, so the position
        // comes from counting our own steps, not from the context's length; and the first step's
        // context is what the round computed.
        let step = self.steps.fetch_add(1, Ordering::SeqCst);
        if step == 0 {
            let computed = context.len().min(self.start);
            self.rows[0].fetch_add((self.start - computed) as u64, Ordering::Relaxed);
            self.rows[1].fetch_add(computed as u64, Ordering::Relaxed);
        }
        let position = self.start + step;
        let vocab = logits.dim(0)?;
        let force = |token: u32| {
            let mut forced = vec![f32::NEG_INFINITY; vocab];
            forced[token as usize] = 0.0;
            candle_core::Tensor::from_vec(forced, vocab, logits.device())
        };
        if let (true, Some(end)) = (self.tokens.is_closed() || self.ended.load(Ordering::SeqCst), self.cancel_with) {
            return force(end);
        }
        let mut logits_vec: Vec<f32> = logits.to_dtype(candle_core::DType::F32)?.to_vec1()?;
        // Padding rows are no text, and may lie past the target's own rows.
        logits_vec.iter_mut().skip(self.text_tokens).for_each(|l| *l = f32::NEG_INFINITY);
        let mut history = self.history.as_ref().map(|h| h.lock().unwrap_or_else(|poisoned| poisoned.into_inner()));
        if let Some(history) = &history {
            history.apply(&mut logits_vec);
        }
        let mut grammar_context = self.grammar_context.as_ref().map(|c| c.lock().unwrap_or_else(|poisoned| poisoned.into_inner()));
        if let (Some(grammar), Some(context)) = (&self.params.grammar, &grammar_context) {
            if !grammar.mask(context, &mut logits_vec) {
                tracing::debug!(position, "the draft's grammar state cannot follow its context; drafting unconstrained");
            }
        }
        // Drawn from the quantised q, so the q sent (compact on the wire) is exactly the one drawn from.
        let q = distribution(&logits_vec, &self.params.sampling).map_err(|e| candle_core::Error::Msg(e.to_string()))?.quantized();
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
            let _ = self.tokens.send(DraftMessage::Token(Drawn { token: DraftToken { token, q }, confidence, at: std::time::Instant::now() }));
            let keep = self.keep.as_ref().is_none_or(|keep| keep.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).ask(confidence));
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

    async fn draft(&self, committed: &[u32], n: usize, params: &DraftParams) -> Result<Vec<DraftToken>, EngineError> {
        self.draft_stream(committed, n, params, None).await?.collect().await
    }

    async fn draft_stream<'a>(&'a self, committed: &[u32], n: usize, params: &DraftParams, keep: Option<KeepDrafting>) -> Result<DraftStream<'a>, EngineError> {
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
        let history = params.penalties.as_ref().map(|p| std::sync::Mutex::new(p.history(committed)));
        let grammar_context = params.grammar.as_ref().map(|_| std::sync::Mutex::new(committed.to_vec()));
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
        });
        let (tx, mut rx) = tokio::sync::mpsc::channel(2);
        let request = new_request(
            RequestMessage::CompletionTokens(committed.to_vec()),
            n,
            tx,
            runner.model.inner().next_request_id(),
            Some(recorder as Arc<dyn CustomLogitsProcessor>),
        );
        let sender = runner.model.inner().get_sender(None).map_err(|e| EngineError::Drafter(e.to_string()))?;
        sender.send(Request::Normal(Box::new(request))).await.map_err(|e| EngineError::Drafter(e.to_string()))?;
        // mistral.rs's engine thread panics when a response cannot be delivered, so the receiver
        // must outlive the request even if the stream is dropped (a client hanging up, a block no
        // longer wanted): a task drains it to the end and then ends the stream.
        tokio::spawn(async move {
            let mut result = Ok(());
            while let Some(response) = rx.recv().await {
                match response {
                    Response::CompletionDone(_) => break,
                    Response::InternalError(e) | Response::ValidationError(e) => result = Err(EngineError::Drafter(e.to_string())),
                    Response::CompletionModelError(e, _) | Response::ModelError(e, _) => result = Err(EngineError::Drafter(e)),
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
        ContextRows { cached: self.rows[0].load(Ordering::Relaxed), computed: self.rows[1].load(Ordering::Relaxed) }
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

/// A turn as chat templates read it: `role` and `content`, plus `tool_calls` (arguments as JSON
/// objects, as Hugging Face templates expect), `tool_call_id` and `name` where set.
fn template_message(turn: &Turn) -> IndexMap<String, MessageContent> {
    // Chat templates know no `developer`: it is OpenAI's newer name for the system prompt.
    let role = match turn.role.unwrap_or(Role::User) {
        Role::System | Role::Developer => "system",
        Role::User => "user",
        Role::Assistant => "assistant",
        Role::Tool => "tool",
    };
    let mut m = IndexMap::from([("role".to_string(), Either::Left(role.to_string())), ("content".to_string(), Either::Left(turn.content.clone()))]);
    if !turn.tool_calls.is_empty() {
        let calls = turn
            .tool_calls
            .iter()
            .map(|c| {
                let arguments = serde_json::from_str(&c.function.arguments).unwrap_or_else(|_| serde_json::Value::String(c.function.arguments.clone()));
                IndexMap::from([
                    ("id".to_string(), serde_json::Value::String(c.id.clone())),
                    ("type".to_string(), serde_json::Value::String("function".into())),
                    ("function".to_string(), serde_json::json!({"name": c.function.name, "arguments": arguments})),
                ])
            })
            .collect();
        m.insert("tool_calls".into(), Either::Right(calls));
    }
    for (key, value) in [("tool_call_id", &turn.tool_call_id), ("name", &turn.name)] {
        if let Some(v) = value {
            m.insert(key.into(), Either::Left(v.clone()));
        }
    }
    m
}

#[async_trait::async_trait]
impl crate::EdgeModel for MistralDrafter {
    async fn encode_conversation(&self, turns: &[Turn], tools: &[ToolSpec]) -> Result<Vec<u32>, EngineError> {
        self.apply_chat_template(turns, tools).await
    }

    fn decode(&self, tokens: &[u32]) -> Result<String, EngineError> {
        self.tokenizer.decode(tokens, true).map_err(|e| EngineError::Drafter(format!("decoding: {e}")))
    }

    async fn encode_text(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, EngineError> {
        let runner = self.runner.read().await;
        let tokenized = runner.model.tokenize(Either::Right(text.to_string()), None, add_special_tokens, false, None).await;
        tokenized.map_err(|e| EngineError::Drafter(e.to_string()))
    }

    fn decode_all(&self, tokens: &[u32]) -> Result<String, EngineError> {
        self.tokenizer.decode(tokens, false).map_err(|e| EngineError::Drafter(format!("decoding: {e}")))
    }

    fn vocabulary(&self) -> Result<&Vocabulary, EngineError> {
        self.vocabulary.get(&self.meta)
    }

    fn token_piece(&self, id: u32) -> Option<String> {
        self.tokenizer.id_to_token(id)
    }
}
