//! The target model: KV-cached scoring of appended positions on candle's quantized kernels.

mod model;
mod qweight;

use std::path::Path;
use std::sync::Arc;

use spade_core::grammar::Vocabulary;

use crate::gguf::{GgufFile, LazyVocabulary, ModelMeta, ModelSource};
use crate::{EngineError, ScoreSession, Scorer};
pub use model::KvCache;
use model::Transformer;

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
        let meta = ModelMeta { vocab_size: width, text_tokens: meta.text_tokens.min(width), ..meta };
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
        Box::new(CandleSession { cache: self.model.new_cache(), model: self.model.clone(), tokens: Vec::new(), meta: self.meta.clone() })
    }

    fn vocabulary(&self) -> Result<&Vocabulary, EngineError> {
        self.vocabulary.get(&self.meta)
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

impl ScoreSession for CandleSession {
    fn score(&mut self, tokens: &[u32], n_logits: usize) -> Result<Vec<Vec<f32>>, EngineError> {
        if n_logits == 0 || n_logits > tokens.len() {
            return Err(EngineError::InvalidRequest(format!("asked for {n_logits} logit rows of a {}-token sequence", tokens.len())));
        }
        if tokens.len() > self.meta.max_context as usize {
            return Err(EngineError::ContextTooLong { len: tokens.len(), max: self.meta.max_context as usize });
        }
        if let Some(&token) = tokens.iter().find(|&&t| t >= self.meta.vocab_size) {
            return Err(EngineError::TokenOutOfVocab { token, vocab_size: self.meta.vocab_size });
        }
        let common = self.tokens.iter().zip(tokens).take_while(|(a, b)| a == b).count();
        let keep = common.min(tokens.len() - n_logits);
        self.truncate(keep);
        let logits = self.model.forward(&mut self.cache, &tokens[keep..], n_logits);
        self.tokens.extend_from_slice(&tokens[keep..]);
        Ok(logits)
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
}
