//! spade-core: the pure logic of SPADE. No I/O, no models, no HTTP.
//!
//! - [`affinity`]: a conversation's routing key, stable across its turns, for load balancers in front of verifier replicas.
//! - [`sampling`]: logits -> the explicit distribution a token is drawn from (temperature, top-k/p, min-p).
//! - [`penalties`]: presence, frequency and repetition penalties and logit bias, from the tokens so far.
//! - [`dist`]: sparse distributions, shared by the draft's q and the target's p.
//! - [`verify`]: the speculative-sampling rule, general and greedy.
//! - [`rng`]: randomness keyed by (seed, position), so verification is reproducible and idempotent.
//! - [`grammar`]: constrained decoding: a grammar's token masks, advanced over the output so far.
//! - [`tools`]: tool-calling wire types and the parser that finds calls in a model's text.
//! - [`fim`]: fill-in-the-middle prompts (llama.cpp's `/infill` layout) and an editor's line rules.
//! - [`text`]: UTF-8-safe incremental detokenisation and stop sequences across chunk boundaries.
//! - [`draft_control`]: how many tokens to draft per round, from online estimates of acceptance, link and compute times,
//!   and the record of each round that the speculative loop logs.
//! - [`lookup`]: drafts copied from a prediction (predicted outputs) or from the context (prompt lookup).
//! - [`prefix_index`]: which cached token sequence shares the longest prefix with a new one (hash-chained blocks).
//! - [`pass_times`]: a forward pass's time by rows, learnt as each size's own time times a pace all share.
//! - [`retry`]: backoff with full jitter and `Retry-After` (seconds or a date), within the caller's deadline.
//! - [`limits`]: the protocol's limits (draft length, `top_logprobs`, session ids), written once.
//! - [`metrics`]: Prometheus rendering both servers use.
//! - [`fastmath`]: a vectorisable `e^x` for the per-vocabulary and per-score loops.
//! - [`wire`]: the compact binary form of `/verify`.
//! - [`openai`], [`vllm`], [`llama_server`], [`protocol`], [`error`]: wire types of the public API
//!   (OpenAI's, vLLM's `/tokenize` and `/detokenize`, llama-server's `/infill`), of `/verify`, and the
//!   error body.

pub mod affinity;
pub mod batching;
pub mod dist;
pub mod draft_control;
pub mod error;
pub mod fastmath;
pub mod fim;
pub mod grammar;
pub mod limits;
pub mod llama_server;
pub mod lookup;
pub mod metrics;
pub mod openai;
pub mod pass_times;
pub mod penalties;
pub mod prefix_index;
pub mod protocol;
pub mod retry;
pub mod rng;
pub mod sampling;
pub mod serving_engine;
pub mod text;
pub mod tools;
pub mod verify;
pub mod vllm;
pub mod wire;

pub use dist::{DistError, SparseDist};
pub use error::{ErrorBody, ErrorDetail};
pub use metrics::Histogram;
pub use penalties::{History, Penalties};
pub use sampling::{confidence, distribution, SamplingError, SamplingParams};
pub use text::{IncrementalDecoder, StopMatcher, StopStep};
pub use verify::{
    position_seed, target_samples, verify_block, verify_match, AcceptRule, BlockOutcome,
    DraftToken, NextKind, VerifyError,
};
