//! The real models the tests use, fetched by `scripts/fetch-models.sh` into `models/` (or the
//! folder `SPADE_MODELS_DIR` names).

use std::path::PathBuf;

/// SmolLM2 135M: small enough for every end-to-end test, and both stacks (mistral.rs drafting,
/// the candle scorer) run it.
pub const TINY: &str = "SmolLM2-135M-Instruct-Q4_1.gguf";
pub const DRAFT: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";
pub const TARGET: &str = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf";

/// The path of model `name`; panics with the command to run where it is missing.
pub fn model_path(name: &str) -> PathBuf {
    let dir = std::env::var_os("SPADE_MODELS_DIR").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models"));
    let path = dir.join(name);
    assert!(path.is_file(), "{} is missing: run scripts/fetch-models.sh first", path.display());
    path
}

pub fn tiny() -> PathBuf {
    model_path(TINY)
}
