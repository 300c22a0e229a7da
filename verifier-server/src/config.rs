//! Command line and environment: the one place configuration is read.

use std::net::{IpAddr, SocketAddr};

use clap::{Parser, Subcommand};

#[derive(Debug, Clone, Parser)]
#[command(name = "spade-verifier", version, about = "SPADE cloud verifier: scores draft blocks with the large model")]
pub struct Config {
    #[command(subcommand)]
    pub command: Option<Command>,

    /// Target model: a local GGUF file (llama or qwen2 architecture), or `owner/repo:file.gguf` on the
    /// Hugging Face hub where a network exists.
    #[arg(long, env = "SPADE_VERIFIER_MODEL")]
    pub model: Option<String>,

    /// Address to bind. Binding anything but loopback requires --api-key.
    #[arg(long, env = "SPADE_VERIFIER_HOST", default_value = "127.0.0.1")]
    pub host: IpAddr,

    #[arg(long, env = "SPADE_VERIFIER_PORT", default_value_t = 8081)]
    pub port: u16,

    /// Bearer token every call except /health must present.
    #[arg(long, env = "SPADE_VERIFIER_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,

    /// Memory for per-session KV caches, in MiB; least recently used sessions are evicted beyond it.
    #[arg(long, env = "SPADE_VERIFIER_CACHE_BUDGET_MB", default_value_t = 2048)]
    pub cache_budget_mb: usize,

    /// Verify calls allowed to wait for a worker; more are answered 429 with retry-after.
    #[arg(long, env = "SPADE_VERIFIER_QUEUE_SIZE", default_value_t = 64)]
    pub queue_size: usize,

    /// Verify calls scored at once (each forward pass already uses every thread).
    #[arg(long, env = "SPADE_VERIFIER_WORKERS", default_value_t = 1)]
    pub workers: usize,

    /// Compute threads for the model (default: all cores).
    #[arg(long, env = "SPADE_VERIFIER_THREADS")]
    pub threads: Option<usize>,

    /// Largest accepted request body, in bytes.
    #[arg(long, env = "SPADE_VERIFIER_MAX_BODY_BYTES", default_value_t = 8 * 1024 * 1024)]
    pub max_body_bytes: usize,

    /// Most draft tokens one call may carry.
    #[arg(long, env = "SPADE_VERIFIER_MAX_DRAFT", default_value_t = 32)]
    pub max_draft: usize,

    /// Log filter (tracing-subscriber syntax), e.g. `info` or `spade_verifier=debug`.
    #[arg(long, env = "SPADE_VERIFIER_LOG", default_value = "info")]
    pub log: String,

    /// Log as JSON lines.
    #[arg(long, env = "SPADE_VERIFIER_LOG_JSON")]
    pub log_json: bool,
}

#[derive(Debug, Clone, Subcommand)]
pub enum Command {
    /// Print the OpenAPI document and exit.
    Openapi,
}

impl Config {
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::new(self.host, self.port)
    }

    /// Refuses settings that would expose an unauthenticated verifier or cannot work.
    pub fn check(&self) -> Result<(), String> {
        if self.model.is_none() {
            return Err("--model (or SPADE_VERIFIER_MODEL) is required: a GGUF file or owner/repo:file.gguf".into());
        }
        if !self.host.is_loopback() && self.api_key.as_deref().is_none_or(str::is_empty) {
            return Err(format!("refusing to bind {} without --api-key (SPADE_VERIFIER_API_KEY): the verifier would be open to anyone", self.host));
        }
        if self.workers == 0 || self.max_draft == 0 {
            return Err("--workers and --max-draft must be at least 1".into());
        }
        Ok(())
    }
}
