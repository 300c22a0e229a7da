//! Command line and environment: the one place configuration is read.

use clap::Parser;
use spade_core::batching::PassLimits;
use spade_core::limits::DEFAULT_MAX_DRAFT;
use spade_core::serving_engine::EngineKind;
use spade_core::AcceptRule;
use spade_http::{Command, ServerArgs};

#[derive(Debug, Clone, Parser)]
#[command(
    name = "spade-verifier",
    version,
    about = "SPADE cloud verifier: scores draft blocks with the large model"
)]
pub struct Config {
    /// Target model: a local GGUF file (llama or qwen2 architecture), or `owner/repo:file.gguf` on the
    /// Hugging Face hub where a network exists. With --engine: a GGUF of the model the engine serves,
    /// read for its vocabulary and metadata only (its weights are not loaded).
    #[arg(long, env = "SPADE_VERIFIER_MODEL")]
    pub model: Option<String>,

    /// How drafts are judged: `ratio` accepts with probability min(1, p/q) (the target's
    /// distributions and the draft's q); `match` accepts a draft while it equals the target's own
    /// sample after the same prefix (exact as well; a seeded answer then does not depend on the
    /// drafts, and a draft is accepted with probability sum(p*q) instead of sum(min(p, q))).
    /// Default: `ratio`, and `match` with --engine (the only rule an engine can apply).
    #[arg(long, env = "SPADE_VERIFIER_RULE")]
    pub rule: Option<AcceptRule>,

    /// Verify on a serving engine at this URL (llama-server, vLLM, SGLang) instead of loading
    /// --model: each block asks the engine for one sampled token per position (the match rule).
    /// The engine's prefix cache holds the KV; grammars, penalties and log-probabilities are not
    /// offered (see docs/design.md).
    #[arg(long, env = "SPADE_VERIFIER_ENGINE")]
    pub engine: Option<String>,

    /// The engine's API: `llama-server`, `vllm` (its OpenAI server) or `sglang` (its native
    /// `/generate`).
    #[arg(long, env = "SPADE_VERIFIER_ENGINE_KIND", default_value = "llama-server")]
    pub engine_kind: EngineKind,

    /// Bearer token for the engine.
    #[arg(long, env = "SPADE_VERIFIER_ENGINE_API_KEY", hide_env_values = true)]
    pub engine_api_key: Option<String>,

    /// The model name the engine serves (vLLM's `model` field).
    #[arg(long, env = "SPADE_VERIFIER_ENGINE_MODEL")]
    pub engine_model: Option<String>,

    /// How a block's positions are asked of the engine: `parallel` (all at once: one engine step
    /// per block, each engine sequence computing the tokens it lacks; right for GPUs) or
    /// `sequential` (one after another up to the first difference: the engine computes only the
    /// committed tokens; right for a compute-bound CPU engine).
    #[arg(long, env = "SPADE_VERIFIER_ENGINE_CALLS", default_value = "parallel")]
    pub engine_calls: crate::engine::EngineCalls,

    /// Seconds one engine call may take.
    #[arg(long, env = "SPADE_VERIFIER_ENGINE_TIMEOUT_SECS", default_value_t = 60)]
    pub engine_timeout_secs: u64,

    /// Memory for KV caches, in MiB: live sessions' and the prefix cache's. Beyond it the prefix
    /// cache's least recently used entries are evicted first, then idle sessions, least recently used
    /// first.
    #[arg(long, env = "SPADE_VERIFIER_CACHE_BUDGET_MB", default_value_t = 2048)]
    pub cache_budget_mb: usize,

    /// Keep a finished session's KV rows (within --cache-budget-mb) for later sessions whose context
    /// starts with the same tokens, such as a conversation's next turn, which then prefill only
    /// what is new. `false` frees them when the session ends.
    #[arg(long, env = "SPADE_VERIFIER_PREFIX_CACHE", action = clap::ArgAction::Set, default_value_t = true)]
    pub prefix_cache: bool,

    /// Verify calls allowed to wait beyond those a pass holds; more are answered 429 with retry-after.
    #[arg(long, env = "SPADE_VERIFIER_QUEUE_SIZE", default_value_t = 64)]
    pub queue_size: usize,

    /// Most sessions' calls scored together in one forward pass (continuous batching); 1 scores one
    /// call at a time.
    #[arg(long, env = "SPADE_VERIFIER_MAX_BATCH_SESSIONS", default_value_t = 16)]
    pub max_batch_sessions: usize,

    /// Most positions in one forward pass, all sessions together; at least twice the larger of
    /// --max-draft + 1 and --prefill-chunk.
    #[arg(long, env = "SPADE_VERIFIER_MAX_BATCH_ROWS", default_value_t = 96)]
    pub max_batch_rows: usize,

    /// Most prompt positions one session's prefill adds to a pass while other calls wait, so a long
    /// prompt delays their blocks by a bounded amount.
    #[arg(long, env = "SPADE_VERIFIER_PREFILL_CHUNK", default_value_t = 16)]
    pub prefill_chunk: usize,

    /// Seconds of scoring that may wait before a call bringing a prompt (more than one prefill
    /// chunk of new positions) is answered 429 `verifier_busy` with a retry-after, so the calls
    /// taken finish in about this time instead of timing out in a long queue. Decode blocks of
    /// running generations are always taken. 0 takes every call.
    #[arg(long, env = "SPADE_VERIFIER_MAX_BACKLOG_SECS", default_value_t = 20.0)]
    pub max_backlog_secs: f64,

    /// Compute threads for the model (default: all cores).
    #[arg(long, env = "SPADE_VERIFIER_THREADS")]
    pub threads: Option<usize>,

    /// Most draft tokens one call may carry (reported in /v1/info: gateways drafting more are not ready).
    #[arg(long, env = "SPADE_VERIFIER_MAX_DRAFT", default_value_t = DEFAULT_MAX_DRAFT)]
    pub max_draft: usize,

    /// At start-up, time one forward pass of each block size up to this many rows (a block of d drafts
    /// has d + 1; at most --max-draft + 1) and report the times in /v1/info (`pass_ms`), where gateways
    /// start their `auto` draft length's cost model; they are updated as calls are served. Three sweeps
    /// over the sizes after a 64-token context: 8 s for the default on one CPU core with a 1.5B model,
    /// and more for a larger model (its time per row). 0 times none.
    #[arg(long, env = "SPADE_VERIFIER_TIME_PASSES", default_value_t = 9)]
    pub time_passes: usize,

    // Binding anything but loopback requires --api-key (see `check`).
    #[command(flatten)]
    pub server: ServerArgs<VerifierFlags>,

    #[command(subcommand)]
    pub command: Option<Command>,
}

spade_http::server_profile!(
    VerifierFlags,
    "SPADE_VERIFIER",
    port = "8081",
    max_body_bytes = "8388608"
);

impl Config {
    /// Refuses settings that would expose an unauthenticated verifier or cannot work.
    pub fn check(&self) -> Result<(), String> {
        if self.model.is_none() {
            return Err("--model (or SPADE_VERIFIER_MODEL) is required: a GGUF file or owner/repo:file.gguf".into());
        }
        if !self.server.host.is_loopback() && self.server.api_key().is_none() {
            return Err(format!("refusing to bind {} without --api-key (SPADE_VERIFIER_API_KEY): the verifier would be open to anyone", self.server.host));
        }
        if !(self.max_backlog_secs >= 0.0 && self.max_backlog_secs.is_finite()) {
            return Err("--max-backlog-secs must be a number of seconds, 0 or more".into());
        }
        if self.engine.is_some() && self.rule == Some(AcceptRule::Ratio) {
            return Err("--rule ratio needs the target's distributions: with --engine only --rule match works".into());
        }
        if self.max_draft == 0 {
            return Err("--max-draft must be at least 1".into());
        }
        self.pass_limits()
            .check(self.max_draft + 1)
            .map_err(|e| format!("--max-batch-sessions, --max-batch-rows, --prefill-chunk: {e}"))
    }

    /// The rule drafts are judged by.
    pub fn accept_rule(&self) -> AcceptRule {
        match (self.rule, &self.engine) {
            (Some(rule), _) => rule,
            (None, Some(_)) => AcceptRule::Match,
            (None, None) => AcceptRule::Ratio,
        }
    }

    /// Block sizes timed at start-up: `1..=` this.
    pub fn timed_rows(&self) -> usize {
        self.time_passes.min(self.max_draft.saturating_add(1))
    }

    pub fn pass_limits(&self) -> PassLimits {
        PassLimits {
            max_rows: self.max_batch_rows,
            max_sessions: self.max_batch_sessions,
            prefill_chunk: self.prefill_chunk,
        }
    }
}
