//! The target model: KV-cached scoring of appended positions on candle's quantized kernels.

mod attention;
mod model;
mod qweight;

use std::path::Path;
use std::sync::Arc;

use spade_core::grammar::Vocabulary;

use crate::gguf::{GgufFile, LazyVocabulary, ModelMeta, ModelSource};
use crate::{BatchJob, EngineError, Logits, ScoreSession, Scorer};
pub use model::KvCache;
use model::{Part, Transformer};

/// A llama/qwen2 GGUF model loaded for scoring.
pub struct CandleScorer {
    model: Arc<Transformer>,
    meta: ModelMeta,
    vocabulary: LazyVocabulary,
}

impl CandleScorer {
    /// Loads a local GGUF file, or a hub file (`owner/repo:file.gguf`) where a network exists. Blocking.
    pub fn load_source(source: &ModelSource) -> Result<Self, EngineError> {
        Self::load(&source.resolve()?)
    }

    pub fn load(path: &Path) -> Result<Self, EngineError> {
        if !path.is_file() {
            return Err(EngineError::ModelNotFound(path.display().to_string()));
        }
        let mut gguf = GgufFile::open(path)?;
        let meta = gguf.meta()?;
        let model = Transformer::load(&mut gguf)?;
        let width = model.vocab_size() as u32;
        let meta =
            ModelMeta { vocab_size: width, text_tokens: meta.text_tokens.min(width), ..meta };
        Ok(Self { model: Arc::new(model), meta, vocabulary: LazyVocabulary::new(path) })
    }

    /// The model's facts, without going through the `Scorer` trait.
    pub fn meta_ref(&self) -> &ModelMeta {
        &self.meta
    }

    /// Bytes of KV cache one context position costs.
    pub fn kv_bytes_per_token(&self) -> usize {
        self.model.kv_bytes_per_token()
    }
}

impl Scorer for CandleScorer {
    fn meta(&self) -> &ModelMeta {
        &self.meta
    }

    fn new_session(&self) -> Box<dyn ScoreSession> {
        Box::new(CandleSession {
            cache: self.model.new_cache(),
            model: self.model.clone(),
            tokens: Vec::new(),
            meta: self.meta.clone(),
        })
    }

    fn vocabulary(&self) -> Result<&Vocabulary, EngineError> {
        self.vocabulary.get(&self.meta)
    }

    fn score_batch(&self, jobs: &mut [BatchJob<'_>]) -> Vec<Result<Option<Logits>, EngineError>> {
        let mut results: Vec<Result<Option<Logits>, EngineError>> = Vec::with_capacity(jobs.len());
        // (index, session, new tokens, logit rows) of the jobs that join the pass.
        let mut joined: Vec<(usize, &mut CandleSession, &[u32], usize)> = Vec::new();
        for (i, job) in jobs.iter_mut().enumerate() {
            let step = job.finishes().and_then(|finishes| {
                let session =
                    job.session.as_any_mut().and_then(|s| s.downcast_mut::<CandleSession>());
                let session = session.ok_or_else(|| {
                    EngineError::InvalidRequest("a session of another scorer".into())
                })?;
                if !Arc::ptr_eq(&session.model, &self.model) {
                    return Err(EngineError::InvalidRequest("a session of another model".into()));
                }
                let keep = session.begin(job.tokens, job.logit_rows)?;
                Ok((
                    session,
                    &job.tokens[keep..keep + job.rows],
                    if finishes { job.logit_rows } else { 0 },
                ))
            });
            match step {
                Ok((session, new, n)) => {
                    joined.push((i, session, new, n));
                    results.push(Ok(None));
                }
                Err(e) => results.push(Err(e)),
            }
        }
        let logit_rows: Vec<usize> = joined.iter().map(|j| j.3).collect();
        let mut parts: Vec<Part<'_>> = joined
            .iter_mut()
            .map(|(_, s, new, _)| Part { cache: &mut s.cache, tokens: new })
            .collect();
        let logits = self.model.forward_batch(&mut parts, &logit_rows);
        drop(parts);
        for ((i, session, new, n), logits) in joined.into_iter().zip(logits) {
            session.tokens.extend_from_slice(new);
            if n > 0 {
                results[i] = Ok(Some(logits));
            }
        }
        results
    }
}

/// One context's KV cache. The cache is keyed by the token ids it holds: scoring a sequence reuses the
/// longest common prefix and recomputes the rest, so a rejected draft's rows are dropped by the next call.
pub struct CandleSession {
    model: Arc<Transformer>,
    cache: KvCache,
    tokens: Vec<u32>,
    meta: ModelMeta,
}

impl CandleSession {
    /// Checks a scoring request and drops the cached rows past what `tokens` shares with them (and
    /// the `logit_rows` last, which are recomputed for their logits); returns the positions kept.
    fn begin(&mut self, tokens: &[u32], logit_rows: usize) -> Result<usize, EngineError> {
        if logit_rows == 0 || logit_rows > tokens.len() {
            return Err(EngineError::InvalidRequest(format!(
                "asked for {logit_rows} logit rows of a {}-token sequence",
                tokens.len()
            )));
        }
        if tokens.len() > self.meta.max_context as usize {
            return Err(EngineError::ContextTooLong {
                len: tokens.len(),
                max: self.meta.max_context as usize,
            });
        }
        if let Some(&token) = tokens.iter().find(|&&t| t >= self.meta.vocab_size) {
            return Err(EngineError::TokenOutOfVocab { token, vocab_size: self.meta.vocab_size });
        }
        let keep = tokens.len() - self.rows_to_score(tokens, logit_rows);
        self.truncate(keep);
        Ok(keep)
    }
}

impl ScoreSession for CandleSession {
    fn score(&mut self, tokens: &[u32], logit_rows: usize) -> Result<Vec<Vec<f32>>, EngineError> {
        let keep = self.begin(tokens, logit_rows)?;
        let logits = self.model.forward(&mut self.cache, &tokens[keep..], logit_rows);
        self.tokens.extend_from_slice(&tokens[keep..]);
        Ok(logits)
    }

    fn as_any_mut(&mut self) -> Option<&mut dyn std::any::Any> {
        Some(self)
    }

    fn cached_tokens(&self) -> &[u32] {
        &self.tokens
    }

    fn text_tokens(&self) -> usize {
        self.meta.text_tokens as usize
    }

    fn truncate(&mut self, len: usize) {
        self.model.truncate(&mut self.cache, len);
        self.tokens.truncate(len);
    }

    fn memory_bytes(&self) -> usize {
        self.cache.bytes()
    }

    fn fork(&self, len: usize) -> Option<Box<dyn ScoreSession>> {
        let len = len.min(self.tokens.len());
        let cache = self.model.copy_prefix(&self.cache, len);
        Some(Box::new(CandleSession {
            model: self.model.clone(),
            cache,
            tokens: self.tokens[..len].to_vec(),
            meta: self.meta.clone(),
        }))
    }
}
