//! Limits of the `/verify` protocol that both sides must agree on, written once.
//!
//! The verifier enforces them (`max_draft` is a flag whose default is here) and reports its own in
//! `GET /v1/info`; the gateway checks its settings against that report before it is ready.

/// Most alternatives per token in `top_logprobs` (the OpenAI API's own limit).
pub const MAX_TOP_LOGPROBS: u8 = 20;

/// Most draft tokens one `/verify` call may carry unless the verifier is started with another `--max-draft`.
pub const DEFAULT_MAX_DRAFT: usize = 32;

/// Longest `session_id`, in bytes.
pub const MAX_SESSION_ID_LEN: usize = 256;
