//! Command line and environment: the one place configuration is read.

use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use spade_core::draft_control::BlockEnd;
use spade_core::openai::DraftLen;
use spade_http::{Command, ServerArgs};

spade_http::server_profile!(
    GatewayFlags,
    "SPADE_GATEWAY",
    port = "8080",
    max_body_bytes = "4194304"
);

#[derive(Debug, Clone, Parser)]
#[command(
    name = "spade-gateway",
    version,
    about = "SPADE edge gateway: OpenAI-compatible chat completions, drafted locally, verified in the cloud"
)]
pub struct Config {
    #[command(flatten)]
    pub server: ServerArgs<GatewayFlags>,

    #[command(subcommand)]
    pub command: Option<Command>,

    /// Draft model: a local GGUF file, or `owner/repo:file.gguf` on the Hugging Face hub where a
    /// network exists. Must share the verifier model's tokenizer.
    #[arg(long, env = "SPADE_GATEWAY_DRAFT_MODEL")]
    pub draft_model: Option<String>,

    /// Base URL of the verifier (`spade-verifier`).
    #[arg(long, env = "SPADE_GATEWAY_VERIFIER_URL", default_value = "http://127.0.0.1:8081")]
    pub verifier_url: String,

    /// PEM file of certificate authorities to trust for an https verifier, besides the system's
    /// trust store and the bundled public roots: a verifier behind a private (company) CA.
    #[arg(long, env = "SPADE_GATEWAY_VERIFIER_CA")]
    pub verifier_ca: Option<PathBuf>,

    /// Bearer token for the verifier.
    #[arg(long, env = "SPADE_VERIFIER_API_KEY", hide_env_values = true)]
    pub verifier_api_key: Option<String>,

    /// Draft tokens per verify call: `auto` chooses each round from measured acceptance, draft speed,
    /// link round trip and verifier time (up to --max-draft-len); a number fixes it; 0 sends no drafts
    /// (target-only decoding through the verifier). Requests may override it (`spade.draft_len`).
    /// A fixed length must not exceed the verifier's --max-draft: /health reports not ready otherwise.
    #[arg(long, env = "SPADE_GATEWAY_DRAFT_LEN", default_value = "auto")]
    pub draft_len: DraftLen,

    /// Propose blocks copied from the prompt or the answer where the answer's last tokens occur
    /// there before (prompt lookup): free to draft, verified like the draft model's, sent where
    /// the round-time model says a copy beats the draft model's block, up to the verifier's
    /// --max-draft tokens. Requests may turn it off (`spade.lookup`).
    #[arg(long, env = "SPADE_GATEWAY_PROMPT_LOOKUP", default_value_t = true, action = clap::ArgAction::Set)]
    pub prompt_lookup: bool,

    /// Most draft tokens per verify call under `auto` and in a request's `spade.draft_len` (also
    /// capped by the verifier's --max-draft).
    #[arg(long, env = "SPADE_GATEWAY_MAX_DRAFT_LEN", default_value_t = 8)]
    pub max_draft_len: usize,

    /// Keep drafting the likely continuation while a block is being verified, and send it at once
    /// when the verifier's answer confirms it (exactly lossless either way).
    #[arg(long, env = "SPADE_GATEWAY_DRAFT_AHEAD", default_value_t = true, action = clap::ArgAction::Set)]
    pub draft_ahead: bool,

    /// Under `auto`, where a block ends: where the draft's confidence in the tokens drafted so far says
    /// drafting on would commit fewer tokens per second, before or past the chosen length up to
    /// --max-draft-len (`confidence`); the same but never past the chosen length (`early`); or at the
    /// chosen length (`length`). docs/design.md, "Adaptive draft length".
    #[arg(long, env = "SPADE_GATEWAY_DRAFT_BLOCK_END", value_enum, default_value_t = DraftBlockEnd::Confidence)]
    pub draft_block_end: DraftBlockEnd,

    /// Most tokens in a sampled draft distribution q (sent with every draft token). 0 keeps the
    /// request's own truncation, which can mean the whole vocabulary: megabytes per call.
    #[arg(long, env = "SPADE_GATEWAY_DRAFT_TOP_K", default_value_t = 32)]
    pub draft_top_k: u32,

    /// Most completion tokens one request may ask for (`max_tokens`/`max_completion_tokens`; larger
    /// asks get 400) and the budget of requests that do not say. Default: the rest of the context.
    #[arg(long, env = "SPADE_GATEWAY_MAX_COMPLETION_TOKENS")]
    pub max_completion_tokens: Option<usize>,

    /// What to do when the verifier is unreachable: `off` fails the request with 503; `draft`
    /// continues with the draft model alone and marks the response `spade.degraded: true`.
    #[arg(long, env = "SPADE_GATEWAY_OFFLINE_FALLBACK", value_enum, default_value_t = OfflineFallback::Off)]
    pub offline_fallback: OfflineFallback,

    /// Seconds to open a connection to the verifier.
    #[arg(long, env = "SPADE_GATEWAY_CONNECT_TIMEOUT_SECS", default_value_t = 5.0)]
    pub connect_timeout_secs: f64,

    /// Seconds one verify call may take (queueing on the verifier included) before it is retried.
    #[arg(long, env = "SPADE_GATEWAY_VERIFY_TIMEOUT_SECS", default_value_t = 60.0)]
    pub verify_timeout_secs: f64,

    /// Seconds one verify call waits out a busy verifier's 429s (as their retry-after says) before
    /// its request fails; a verifier that answers 429 is alive, so this may be longer than
    /// --verify-timeout-secs.
    #[arg(long, env = "SPADE_GATEWAY_BUSY_WAIT_SECS", default_value_t = 300.0)]
    pub busy_wait_secs: f64,

    /// Retries of a failed verify call (connection errors, timeouts, 5xx; a 429 is waited out
    /// instead, see --busy-wait-secs). `/verify` is idempotent: a retry gets the same answer.
    #[arg(long, env = "SPADE_GATEWAY_VERIFY_RETRIES", default_value_t = 2)]
    pub verify_retries: u32,

    /// The model id clients see in `/v1/models` and responses.
    #[arg(long, env = "SPADE_GATEWAY_MODEL_NAME", default_value = "spade")]
    pub model_name: String,

    /// MiB of KV rows the draft model's prefix cache keeps (each generation's next round continues
    /// from its last one); beyond it the oldest entries are evicted. The cache also keeps at most 32
    /// entries; this bounds what long contexts make them weigh. 0: no limit.
    #[arg(long, env = "SPADE_GATEWAY_DRAFT_CACHE_MB", default_value_t = 256)]
    pub draft_cache_mb: usize,

    /// Generations' draft rounds the draft engine batches into one step. 1: on CPU, mistral.rs's
    /// batching was 17x slower in aggregate than running the short rounds one after another.
    #[arg(long, env = "SPADE_GATEWAY_MAX_CONCURRENT", default_value_t = 1)]
    pub max_concurrent: usize,

    /// Generations running at once (a request with `n` choices takes `n` places). All share the one
    /// draft engine: past a few, more only divide its speed (32 concurrent streams finished at about
    /// one stream's rate in all), while a few let drafting overlap other generations' verify calls.
    #[arg(long, env = "SPADE_GATEWAY_MAX_RUNNING", default_value_t = 4)]
    pub max_running: u32,

    /// Requests that wait for a place, first come, first served; one more is refused at once with
    /// 429 and `retry-after` (the OpenAI SDKs retry it by themselves). 0: refuse whenever all places
    /// are taken.
    #[arg(long, env = "SPADE_GATEWAY_MAX_QUEUED", default_value_t = 32)]
    pub max_queued: usize,

    /// Seconds a request waits for a place before it is refused with 429.
    #[arg(long, env = "SPADE_GATEWAY_QUEUE_TIMEOUT_SECS", default_value_t = 120.0)]
    pub queue_timeout_secs: f64,

    /// Seconds between SSE keep-alive comments on a quiet stream.
    #[arg(long, env = "SPADE_GATEWAY_KEEP_ALIVE_SECS", default_value_t = 10)]
    pub keep_alive_secs: u64,

    /// How verify calls travel: `binary` (compact, when the verifier offers it; JSON otherwise) or
    /// `json` (readable, for debugging).
    #[arg(long, env = "SPADE_GATEWAY_VERIFY_WIRE", value_enum, default_value_t = VerifyWire::Binary)]
    pub verify_wire: VerifyWire,

    /// Browser origins allowed to call the gateway (CORS), comma-separated, e.g.
    /// `https://app.example.com`; `*` allows any. None by default: browsers get no CORS headers.
    #[arg(long, env = "SPADE_GATEWAY_CORS_ALLOW_ORIGIN", value_delimiter = ',')]
    pub cors_allow_origin: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum VerifyWire {
    Binary,
    Json,
}

/// Where `auto` ends a block ([`BlockEnd`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DraftBlockEnd {
    Length,
    Early,
    Confidence,
}

impl From<DraftBlockEnd> for BlockEnd {
    fn from(end: DraftBlockEnd) -> Self {
        match end {
            DraftBlockEnd::Length => Self::Length,
            DraftBlockEnd::Early => Self::Early,
            DraftBlockEnd::Confidence => Self::Confidence,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OfflineFallback {
    Off,
    Draft,
}

impl Config {
    pub fn busy_wait(&self) -> Duration {
        Duration::from_secs_f64(self.busy_wait_secs)
    }

    pub fn verify_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.verify_timeout_secs)
    }

    pub fn queue_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.queue_timeout_secs)
    }

    pub fn connect_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.connect_timeout_secs)
    }

    /// Refuses settings that cannot work.
    pub fn check(&self) -> Result<(), String> {
        if self.draft_model.is_none() {
            return Err("--draft-model (or SPADE_GATEWAY_DRAFT_MODEL) is required: a GGUF file or owner/repo:file.gguf".into());
        }
        if !(self.verifier_url.starts_with("http://") || self.verifier_url.starts_with("https://"))
        {
            return Err(format!(
                "--verifier-url {:?} must start with http:// or https://",
                self.verifier_url
            ));
        }
        let positive = |x: f64| x.is_finite() && x > 0.0;
        if !positive(self.connect_timeout_secs)
            || !positive(self.verify_timeout_secs)
            || !positive(self.queue_timeout_secs)
        {
            return Err("timeouts must be positive numbers of seconds".into());
        }
        if !(self.busy_wait_secs.is_finite() && self.busy_wait_secs >= 0.0) {
            return Err("--busy-wait-secs must be a number of seconds, 0 or more".into());
        }
        if let Some(n) = self.draft_len.fixed().filter(|&n| n as usize > self.max_draft_len) {
            return Err(format!("--draft-len {n} is above --max-draft-len {}", self.max_draft_len));
        }
        if self.max_concurrent == 0
            || self.max_running == 0
            || self.keep_alive_secs == 0
            || self.max_completion_tokens == Some(0)
        {
            return Err("--max-concurrent, --max-running, --keep-alive-secs and --max-completion-tokens must be at least 1".into());
        }
        spade_http::cors::layer(&self.cors_allow_origin)?;
        Ok(())
    }

    /// Where the settings are risky but legal: said once at start.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        if !self.server.host.is_loopback() && self.server.api_key().is_none() {
            out.push(format!("binding {} without --api-key: anyone who can reach it can spend your verifier's time", self.server.host));
        }
        if self.verifier_url.starts_with("http://") && !is_local_url(&self.verifier_url) {
            out.push("the verifier URL is plain http to another host: prompts and the API key travel unencrypted (use https or a TLS proxy)".into());
        }
        out
    }
}

fn is_local_url(url: &str) -> bool {
    let host = url.trim_start_matches("http://").split(['/', ':']).next().unwrap_or("");
    host == "localhost" || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}
