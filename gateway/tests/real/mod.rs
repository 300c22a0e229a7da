//! Real processes for end-to-end tests: spade-verifier and spade-gateway as children on loopback
//! with the tiny real model, plus the client calls the tests share.

#![allow(dead_code, unused_imports)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use spade_engine::speculative::{generate, GenerateParams};
use spade_engine::{CandleScorer, EdgeModel, MistralDrafter, ModelSource, Role, Scorer};
pub use spade_test_support::models::tiny;
use spade_test_support::process::unless_given;
pub use spade_test_support::process::{free_port, Server};
pub use spade_test_support::report;

pub const KEY: &str = "e2e-key";

/// Built next to the gateway: the test command builds the whole workspace.
fn verifier_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_spade-gateway")).with_file_name("spade-verifier")
}

/// Status and body of `/health` (0 where nothing answers).
pub async fn health(url: &str) -> (u16, Value) {
    match reqwest::Client::new()
        .get(format!("{url}/health"))
        .timeout(Duration::from_secs(10))
        .send()
        .await
    {
        Ok(r) => (r.status().as_u16(), r.json().await.unwrap_or(Value::Null)),
        Err(_) => (0, Value::Null),
    }
}

/// Waits until the gateway's draft model is loaded (whatever the verifier's state): /health's answer.
pub async fn wait_loaded(url: &str) -> (u16, Value) {
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let (status, body) = health(url).await;
        if status != 0 && body["status"] != "loading" {
            return (status, body);
        }
        assert!(Instant::now() < deadline, "the gateway never finished loading");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A verifier (with the tiny model unless `extra` names one) on `port` (0 = a free one), not waited for.
pub fn spawn_verifier_on(port: u16, extra: &[&str]) -> Server {
    let tiny = tiny();
    let mut args = unless_given(extra, &[("--model", tiny.to_str().unwrap()), ("--log", "warn")]);
    args.extend_from_slice(extra);
    Server::spawn(&verifier_bin(), "verifier", port, &args, &[("SPADE_VERIFIER_API_KEY", KEY)])
}

/// A verifier on `port` (0 = a free one), ready.
pub async fn start_verifier_on(port: u16, extra: &[&str]) -> Server {
    let verifier = spawn_verifier_on(port, extra);
    verifier.wait_ready().await;
    verifier
}

pub async fn start_verifier() -> Server {
    start_verifier_on(0, &[]).await
}

/// A gateway drafting with the tiny model unless `extra` names one; waits for /health unless `wait` is false.
pub async fn spawn_gateway(verifier: &str, extra: &[&str], wait: bool) -> Server {
    let tiny = tiny();
    let mut args = vec!["--verifier-url", verifier];
    let defaults = [
        ("--draft-model", tiny.to_str().unwrap()),
        ("--log", "warn"),
        ("--verify-retries", "1"),
        ("--connect-timeout-secs", "2"),
    ];
    args.extend(unless_given(extra, &defaults));
    args.extend_from_slice(extra);
    let gateway = Server::spawn(
        PathBuf::from(env!("CARGO_BIN_EXE_spade-gateway")).as_path(),
        "gateway",
        0,
        &args,
        &[("SPADE_VERIFIER_API_KEY", KEY)],
    );
    if wait {
        gateway.wait_ready().await;
    }
    gateway
}

pub async fn start_gateway(verifier: &str, extra: &[&str]) -> Server {
    spawn_gateway(verifier, extra, true).await
}

pub fn request(prompt: &str, max_tokens: usize, extra: Value) -> Value {
    let mut body = json!({"model": "spade", "messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": max_tokens});
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

/// Status and parsed body of a non-streamed call.
pub async fn post(url: &str, body: &Value) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(format!("{url}/v1/chat/completions"))
        .json(body)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

pub async fn complete(url: &str, body: &Value) -> Value {
    let (status, v) = post(url, body).await;
    assert_eq!(status, 200, "{v}");
    v
}

pub fn content(v: &Value) -> &str {
    v["choices"][0]["message"]["content"].as_str().unwrap_or_default()
}

/// What a stream delivered: text, finish reason, and `Ok` if `[DONE]` ended it or the error event.
pub struct Streamed {
    pub status: u16,
    pub text: String,
    pub finish: Option<String>,
    pub end: Result<(), Value>,
    pub usage: Option<Value>,
}

pub fn parse_sse(status: u16, body: &str) -> Streamed {
    let mut s =
        Streamed { status, text: String::new(), finish: None, end: Err(Value::Null), usage: None };
    for data in body.split("\n\n").filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: ")))
    {
        if data == "[DONE]" {
            s.end = Ok(());
            continue;
        }
        let v: Value = serde_json::from_str(data).unwrap();
        if v.get("error").is_some() {
            s.end = Err(v);
            continue;
        }
        if let Some(t) = v["choices"][0]["delta"]["content"].as_str() {
            s.text.push_str(t);
        }
        if let Some(f) = v["choices"][0]["finish_reason"].as_str() {
            s.finish = Some(f.to_string());
        }
        if v.get("usage").is_some_and(|u| !u.is_null()) {
            s.usage = Some(v["usage"].clone());
        }
    }
    s
}

pub async fn stream(url: &str, body: &Value) -> Streamed {
    let r = reqwest::Client::new()
        .post(format!("{url}/v1/chat/completions"))
        .json(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    parse_sse(status, &r.text().await.unwrap())
}

/// Target-only greedy decoding in-process, through the same chat template and tokenizer.
pub async fn reference(prompts: &[&str], max_tokens: usize) -> Vec<String> {
    reference_with(prompts, max_tokens, None).await
}

/// [`reference`] under penalties and logit bias (their `prompt_len` is set per prompt).
pub async fn reference_with(
    prompts: &[&str],
    max_tokens: usize,
    penalties: Option<spade_core::Penalties>,
) -> Vec<String> {
    reference_of(prompts, max_tokens, penalties, None, false).await
}

/// [`reference`] with the output held to a grammar document (llguidance's format).
pub async fn reference_constrained(
    prompts: &[&str],
    max_tokens: usize,
    grammar: &serde_json::Value,
) -> Vec<String> {
    reference_of(prompts, max_tokens, None, Some(grammar), false).await
}

/// [`reference`] for raw prompts (`/v1/completions`): no chat template, the tokenizer's special tokens.
pub async fn reference_raw(prompts: &[&str], max_tokens: usize) -> Vec<String> {
    reference_of(prompts, max_tokens, None, None, true).await
}

async fn reference_of(
    prompts: &[&str],
    max_tokens: usize,
    penalties: Option<spade_core::Penalties>,
    grammar: Option<&serde_json::Value>,
    raw: bool,
) -> Vec<String> {
    let source = ModelSource::Local(tiny());
    let edge = MistralDrafter::load(&source, Default::default()).await.unwrap();
    let scorer = CandleScorer::load(&tiny()).unwrap();
    let mut out = Vec::new();
    for prompt in prompts {
        let ids = if raw {
            EdgeModel::encode_text(&edge, prompt, true).await.unwrap()
        } else {
            edge.encode_chat(&[(Role::User, prompt.to_string())]).await.unwrap()
        };
        let params = GenerateParams {
            max_new_tokens: max_tokens,
            draft_len: 0,
            draft_ahead: false,
            sampling: spade_core::SamplingParams::greedy(),
            draft_sampling: spade_core::SamplingParams::greedy(),
            penalties: penalties
                .clone()
                .map(|p| spade_core::Penalties { prompt_len: ids.len() as u32, ..p }),
            grammar: grammar.map(|g| scorer.vocabulary().unwrap().compile(g).unwrap()),
            seed: 0,
            stop_token_ids: scorer.meta().stop_token_ids.clone(),
        };
        let mut session = scorer.new_session();
        let generation = generate(None, session.as_mut(), &ids, &params).await.unwrap();
        out.push(EdgeModel::decode(&edge, &generation.tokens).unwrap());
    }
    out
}

/// One counter from a server's /metrics.
pub async fn metric(url: &str, name: &str) -> f64 {
    let text = reqwest::Client::new()
        .get(format!("{url}/metrics"))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    spade_test_support::metric_value(&text, name).unwrap_or_else(|| panic!("{name} missing"))
}

pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * q).round() as usize]
}

/// `GET url` with the tests' bearer key, parsed.
pub async fn get_json(url: &str) -> Value {
    let r = reqwest::Client::new().get(url).bearer_auth(KEY).send().await.unwrap();
    r.json().await.unwrap()
}
