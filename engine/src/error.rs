use thiserror::Error;

/// Everything that can go wrong in the model seam.
#[derive(Debug, Error)]
pub enum EngineError {
    #[error("model file not found: {0}")]
    ModelNotFound(String),
    #[error("cannot load model {path}: {message}")]
    Load { path: String, message: String },
    #[error("unsupported model: {0}")]
    Unsupported(String),
    #[error("draft and target vocabularies differ: {0}")]
    VocabMismatch(String),
    #[error("token id {token} is outside the vocabulary of {vocab_size} tokens")]
    TokenOutOfVocab { token: u32, vocab_size: u32 },
    #[error("context of {len} tokens exceeds the model's maximum of {max}")]
    ContextTooLong { len: usize, max: usize },
    #[error("invalid scoring request: {0}")]
    InvalidRequest(String),
    #[error("sampling: {0}")]
    Sampling(#[from] spade_core::SamplingError),
    #[error("verification: {0}")]
    Verify(#[from] spade_core::VerifyError),
    #[error("{0}")]
    Grammar(#[from] spade_core::grammar::GrammarError),
    #[error("drafter: {0}")]
    Drafter(String),
    #[error("tensor: {0}")]
    Tensor(#[from] candle_core::Error),
}

impl EngineError {
    pub(crate) fn load(path: &std::path::Path, e: impl std::fmt::Display) -> Self {
        Self::Load { path: path.display().to_string(), message: e.to_string() }
    }
}
