pub(crate) mod embedding_gemma;
pub(crate) mod inputs_processor;
mod layers;
pub(crate) mod qwen3_embedding;

pub use layers::{Dense, DenseActivation, Normalize, Pooling};
