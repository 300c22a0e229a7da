//! Verification on a serving engine (`--engine URL`): the match rule over the engine's own samples.
//!
//! For a block x_1..x_d after context c, one sampled token is asked for after each of c, c+x_1, …,
//! c+x_1..x_d, each seeded by its absolute position ([`position_seed`]); the drafts are accepted while
//! they equal the engine's tokens ([`verify_match`]). The engine keeps the KV (its prefix cache); the
//! verifier keeps each session's token ids, so gateways speak the same `/verify` protocol as to the
//! verifier's own model.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::Value;
use spade_core::serving_engine::{probe_tokens, EngineKind};
use spade_core::{position_seed, verify_match, BlockOutcome, SamplingParams};
use spade_engine::ModelMeta;

use crate::config::Config;
use crate::error::ApiError;

/// Most sessions whose ids are kept; past it the least recently used go (their gateways resend).
const MAX_SESSIONS: usize = 4096;
/// Tokens compared with the engine's detokenizer at start-up ([`EngineBackend::check`]).
pub const PROBES: usize = 48;
/// Probe tokens a `/health` check asks about.
const HEALTH_PROBES: usize = 4;
/// How long a `/health` check's answer is reused: probes from every gateway and the orchestrator then
/// cost the engine a few calls per interval, not a few per probe.
pub const HEALTH_TTL: Duration = Duration::from_secs(2);

/// How a block's positions are asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineCalls {
    /// All at once (one call per position, concurrently, or one batched call): one engine step
    /// per block, but each of the engine's sequences computes the tokens it lacks. Right for GPUs,
    /// where a batch costs about what one sequence does.
    Parallel,
    /// One after another, stopping at the first draft the engine does not sample: the engine
    /// computes only the committed tokens, at one call each. Right for a compute-bound engine
    /// (CPU), where the parallel form's extra tokens cost their full price.
    Sequential,
}

impl std::str::FromStr for EngineCalls {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "parallel" => Ok(Self::Parallel),
            "sequential" => Ok(Self::Sequential),
            _ => Err(format!("unknown engine call order {s:?}: parallel or sequential")),
        }
    }
}

/// The engine, how to reach it, and the served model's facts (from `--model`'s GGUF metadata).
pub struct EngineBackend {
    client: reqwest::Client,
    url: String,
    pub kind: EngineKind,
    api_key: Option<String>,
    model: Option<String>,
    pub meta: ModelMeta,
    calls: EngineCalls,
    probes: Vec<(u32, String)>,
    sessions: Mutex<HashMap<String, (Vec<u32>, Instant)>>,
    /// The last `/health` check: when, and its answer. Held across a check, so concurrent probes
    /// wait for one check instead of each making their own.
    last_health: tokio::sync::Mutex<Option<(Instant, Option<String>)>>,
}

impl EngineBackend {
    /// The engine `--engine` names, serving the model whose facts and token list are given.
    pub fn new(config: &Config, meta: ModelMeta, tokens: &[String]) -> Result<Self, String> {
        let url = config.engine.as_deref().ok_or("--engine is not set")?;
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(config.engine_timeout_secs))
            .connect_timeout(Duration::from_secs(5))
            .build()
            .map_err(|e| format!("cannot build the engine client: {e}"))?;
        let probes = probe_tokens(&tokens[..(meta.text_tokens as usize).min(tokens.len())], PROBES);
        Ok(Self {
            client,
            url: url.trim_end_matches('/').to_string(),
            kind: config.engine_kind,
            api_key: config.engine_api_key.clone(),
            model: config.engine_model.clone(),
            meta,
            calls: config.engine_calls,
            probes,
            sessions: Mutex::default(),
            last_health: tokio::sync::Mutex::default(),
        })
    }

    async fn post(&self, path: &str, body: &Value) -> Result<Value, ApiError> {
        let mut call = self.client.post(format!("{}{path}", self.url)).json(body);
        if let Some(key) = &self.api_key {
            call = call.bearer_auth(key);
        }
        let failed = |e: reqwest::Error| ApiError::Engine(format!("{path}: {e}"));
        let answer = call.send().await.map_err(failed)?;
        let status = answer.status();
        if !status.is_success() {
            let text = answer.text().await.unwrap_or_default();
            let text: String = text.chars().take(300).collect();
            return Err(ApiError::Engine(format!("{path} answered {status}: {text}")));
        }
        answer.json().await.map_err(failed)
    }

    /// The engine's token after each of `prompts`, the i-th drawn with `seeds[i]`: concurrent calls,
    /// or one call where the engine takes a seed per prompt.
    async fn sample(
        &self,
        prompts: Vec<Vec<u32>>,
        sampling: &SamplingParams,
        seeds: Vec<u32>,
    ) -> Result<Vec<u32>, ApiError> {
        let (kind, model) = (self.kind, self.model.as_deref());
        let path = kind.generate_path();
        let read = |answer: Value| kind.sampled_tokens(&answer).map_err(ApiError::Engine);
        if kind.batches_positions() {
            let body = kind.request(&prompts, sampling, &seeds, model);
            return read(self.post(path, &body).await?);
        }
        let calls = prompts.iter().zip(&seeds).map(|(prompt, &seed)| {
            let body = kind.request(std::slice::from_ref(prompt), sampling, &[seed], model);
            async move { read(self.post(path, &body).await?) }
        });
        let answers = futures::future::join_all(calls).await;
        answers.into_iter().map(|a| a.map(|t| t[0])).collect()
    }

    /// One round of the match rule: the engine's token after the context and after each drafted
    /// prefix, committed while they agree with the drafts.
    pub async fn judge(
        &self,
        context: &[u32],
        drafts: &[u32],
        sampling: &SamplingParams,
        seed: u64,
    ) -> Result<BlockOutcome, ApiError> {
        let start = context.len() as u64;
        if self.calls == EngineCalls::Sequential {
            // One position at a time, stopping at the first difference: the engine computes only
            // the committed tokens (its cache holds the rest), one call each.
            let mut prompt = context.to_vec();
            let mut tokens = Vec::with_capacity(drafts.len() + 1);
            for i in 0..=drafts.len() {
                let seeds = vec![position_seed(seed, start + i as u64)];
                let token = self.sample(vec![prompt.clone()], sampling, seeds).await?[0];
                self.check_token(token)?;
                tokens.push(token);
                match drafts.get(i) {
                    Some(&x) if x == token => prompt.push(x),
                    _ => break,
                }
            }
            return verify_match(&tokens, drafts).map_err(|e| ApiError::Engine(e.to_string()));
        }
        let prompts: Vec<Vec<u32>> = (0..=drafts.len())
            .map(|i| context.iter().chain(&drafts[..i]).copied().collect())
            .collect();
        let seeds = (0..=drafts.len() as u64).map(|i| position_seed(seed, start + i)).collect();
        let tokens = self.sample(prompts, sampling, seeds).await?;
        tokens.iter().try_for_each(|&t| self.check_token(t))?;
        verify_match(&tokens, drafts).map_err(|e| ApiError::Engine(e.to_string()))
    }

    fn check_token(&self, token: u32) -> Result<(), ApiError> {
        if token >= self.meta.vocab_size {
            return Err(ApiError::Engine(format!(
                "the engine answered token {token}, outside the vocabulary of {}",
                self.meta.vocab_size
            )));
        }
        Ok(())
    }

    /// Why the engine does not serve `--model`'s vocabulary, or cannot be reached; None when it does:
    /// its detokenizer spells the probe tokens as the GGUF does, and (llama-server) its vocabulary
    /// has as many tokens.
    /// `probes`: how many of the probe tokens to ask about (all at start-up, a few on `/health`:
    /// [`health`](Self::health)).
    pub async fn check(&self, probes: usize) -> Option<String> {
        if self.kind == EngineKind::Sglang {
            // SGLang's native API has no detokenizer to ask; its generate call is the check.
            return self
                .post(
                    "/generate",
                    &self.kind.request(&[vec![0]], &SamplingParams::greedy(), &[0], None),
                )
                .await
                .err()
                .map(|e| e.to_string());
        }
        if self.kind == EngineKind::LlamaServer {
            let n_vocab = match self.get("/v1/models").await {
                Ok(models) => models.pointer("/data/0/meta/n_vocab").and_then(Value::as_u64),
                Err(e) => return Some(e.to_string()),
            };
            let ours = self.meta.vocab_size as u64;
            if let Some(n) = n_vocab
                .filter(|&n| n.abs_diff(ours) > u64::from(spade_core::protocol::MAX_VOCAB_PADDING))
            {
                return Some(format!("the engine's vocabulary has {n} tokens, --model's {ours}: not the same tokenizer"));
            }
        }
        for (id, text) in self.probes.iter().take(probes) {
            let body = match self.kind {
                EngineKind::Vllm => serde_json::json!({"model": self.model, "tokens": [id]}),
                _ => serde_json::json!({"tokens": [id]}),
            };
            let answer = match self.post("/detokenize", &body).await {
                Ok(a) => a,
                Err(e) => return Some(e.to_string()),
            };
            let field = if self.kind == EngineKind::Vllm { "prompt" } else { "content" };
            let theirs = answer.get(field).and_then(Value::as_str).unwrap_or_default();
            if theirs != text {
                return Some(format!("the engine spells token {id} {theirs:?}, --model's vocabulary {text:?}: not the same tokenizer"));
            }
        }
        None
    }

    /// [`check`](Self::check) with a few probe tokens, for `/health`; an answer younger than
    /// [`HEALTH_TTL`] is reused.
    pub async fn health(&self) -> Option<String> {
        let mut last = self.last_health.lock().await;
        if let Some((_, answer)) = last.as_ref().filter(|(at, _)| at.elapsed() < HEALTH_TTL) {
            return answer.clone();
        }
        let answer = self.check(HEALTH_PROBES).await;
        *last = Some((Instant::now(), answer.clone()));
        answer
    }

    /// The most tokens one prompt may hold on the engine (llama-server's per-slot `n_ctx`, vLLM's
    /// `max_model_len`), where it says.
    pub async fn context_limit(&self) -> Option<u32> {
        let (path, field) = match self.kind {
            EngineKind::LlamaServer => ("/props", "/default_generation_settings/n_ctx"),
            EngineKind::Vllm => ("/v1/models", "/data/0/max_model_len"),
            EngineKind::Sglang => return None,
        };
        let value = self.get(path).await.ok()?;
        value.pointer(field).and_then(Value::as_u64).and_then(|n| u32::try_from(n).ok())
    }

    async fn get(&self, path: &str) -> Result<Value, ApiError> {
        let mut call = self.client.get(format!("{}{path}", self.url));
        if let Some(key) = &self.api_key {
            call = call.bearer_auth(key);
        }
        let failed = |e: reqwest::Error| ApiError::Engine(format!("{path}: {e}"));
        call.send()
            .await
            .and_then(|r| r.error_for_status())
            .map_err(failed)?
            .json()
            .await
            .map_err(failed)
    }

    /// The ids a session holds (its next call's `context_start` must not pass their end).
    pub fn session(&self, id: &str) -> Option<Vec<u32>> {
        let mut sessions = self.sessions.lock().unwrap_or_else(|p| p.into_inner());
        sessions.get_mut(id).map(|(ids, used)| {
            *used = Instant::now();
            ids.clone()
        })
    }

    pub fn keep_session(&self, id: &str, committed: Vec<u32>) {
        let mut sessions = self.sessions.lock().unwrap_or_else(|p| p.into_inner());
        if sessions.len() >= MAX_SESSIONS && !sessions.contains_key(id) {
            let oldest = sessions.iter().min_by_key(|(_, (_, used))| *used).map(|(k, _)| k.clone());
            oldest.map(|k| sessions.remove(&k));
        }
        sessions.insert(id.to_string(), (committed, Instant::now()));
    }

    pub fn end_session(&self, id: &str) -> bool {
        self.sessions.lock().unwrap_or_else(|p| p.into_inner()).remove(id).is_some()
    }
}
