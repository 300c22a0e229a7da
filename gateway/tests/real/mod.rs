//! Real processes for end-to-end tests: spade-verifier and spade-gateway as children on loopback
//! with the tiny real model, plus the client calls the tests share.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use spade_engine::speculative::{generate, GenerateParams};
use spade_engine::{CandleScorer, EdgeModel, MistralDrafter, ModelSource, Scorer};

pub const KEY: &str = "e2e-key";

pub fn tiny() -> PathBuf {
    let dir = std::env::var_os("SPADE_MODELS_DIR").map(PathBuf::from).unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models"));
    let p = dir.join("SmolLM2-135M-Instruct-Q4_1.gguf");
    assert!(p.is_file(), "{} is missing: run scripts/fetch-models.sh", p.display());
    p
}

fn verifier_bin() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_BIN_EXE_spade-gateway")).with_file_name("spade-verifier");
    assert!(p.is_file(), "{} is missing: run `cargo build --workspace` (or the README's test command)", p.display());
    p
}

pub struct Proc {
    pub child: Child,
    pub url: String,
    pub port: u16,
    /// Where stderr goes (logs), when captured.
    pub log: Option<PathBuf>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn rss_mb(&self) -> f64 {
        std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default()
            .lines()
            .find(|l| l.starts_with("VmRSS:"))
            .and_then(|l| l.split_whitespace().nth(1)?.parse::<f64>().ok())
            .map_or(0.0, |kb| kb / 1024.0)
    }

    pub fn log_text(&self) -> String {
        self.log.as_ref().map(|p| std::fs::read_to_string(p).unwrap_or_default()).unwrap_or_default()
    }
}

/// The default flags that `extra` does not set itself (clap refuses a flag given twice).
fn defaults<'a>(extra: &[&str], flags: &[(&'a str, &'a str)]) -> Vec<&'a str> {
    flags.iter().filter(|(f, _)| !extra.contains(f)).flat_map(|(f, v)| [*f, *v]).collect()
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

pub async fn health(url: &str) -> (u16, Value) {
    match reqwest::Client::new().get(format!("{url}/health")).timeout(Duration::from_secs(10)).send().await {
        Ok(r) => (r.status().as_u16(), r.json().await.unwrap_or(Value::Null)),
        Err(_) => (0, Value::Null),
    }
}

pub async fn wait_ready(url: &str, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(180);
    while health(url).await.0 != 200 {
        assert!(Instant::now() < deadline, "{what} did not become ready");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Both output streams go to one file (tracing writes to stdout, panics to stderr).
fn log_sink(path: &std::path::Path) -> Stdio {
    let file = std::fs::OpenOptions::new().create(true).append(true).open(path).unwrap();
    Stdio::from(file)
}

fn log_file(name: &str, port: u16) -> PathBuf {
    std::env::temp_dir().join(format!("spade-test-{name}-{port}.log"))
}

/// A verifier on `port` (0 = a free one), ready.
pub async fn start_verifier_on(port: u16, extra: &[&str]) -> Proc {
    let port = if port == 0 { free_port() } else { port };
    let log = log_file("verifier", port);
    let _ = std::fs::remove_file(&log);
    let child = Command::new(verifier_bin())
        .args(["--model", tiny().to_str().unwrap(), "--port", &port.to_string()])
        .args(defaults(extra, &[("--log", "warn")]))
        .args(extra)
        .env("SPADE_VERIFIER_API_KEY", KEY)
        .stdout(log_sink(&log))
        .stderr(log_sink(&log))
        .spawn()
        .expect("spawn spade-verifier");
    let p = Proc { child, url: format!("http://127.0.0.1:{port}"), port, log: Some(log) };
    wait_ready(&p.url, "spade-verifier").await;
    p
}

pub async fn start_verifier() -> Proc {
    start_verifier_on(0, &[]).await
}

/// A gateway drafting with the tiny model; waits for /health unless `wait` is false.
pub async fn spawn_gateway(verifier: &str, extra: &[&str], wait: bool) -> Proc {
    let port = free_port();
    let log = log_file("gateway", port);
    let _ = std::fs::remove_file(&log);
    let child = Command::new(env!("CARGO_BIN_EXE_spade-gateway"))
        .args(["--draft-model", tiny().to_str().unwrap(), "--verifier-url", verifier, "--port", &port.to_string()])
        .args(defaults(extra, &[("--log", "warn"), ("--verify-retries", "1"), ("--connect-timeout-secs", "2")]))
        .args(extra)
        .env("SPADE_VERIFIER_API_KEY", KEY)
        .stdout(log_sink(&log))
        .stderr(log_sink(&log))
        .spawn()
        .expect("spawn spade-gateway");
    let p = Proc { child, url: format!("http://127.0.0.1:{port}"), port, log: Some(log) };
    if wait {
        wait_ready(&p.url, "spade-gateway").await;
    }
    p
}

pub async fn start_gateway(verifier: &str, extra: &[&str]) -> Proc {
    spawn_gateway(verifier, extra, true).await
}

pub fn request(prompt: &str, max_tokens: usize, extra: Value) -> Value {
    let mut body = json!({"model": "spade", "messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": max_tokens});
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

/// Status and parsed body of a non-streamed call.
pub async fn post(url: &str, body: &Value) -> (u16, Value) {
    let r = reqwest::Client::new().post(format!("{url}/v1/chat/completions")).json(body).send().await.unwrap();
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
    let mut s = Streamed { status, text: String::new(), finish: None, end: Err(Value::Null), usage: None };
    for data in body.split("\n\n").filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: "))) {
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
    let r = reqwest::Client::new().post(format!("{url}/v1/chat/completions")).json(body).send().await.unwrap();
    let status = r.status().as_u16();
    parse_sse(status, &r.text().await.unwrap())
}

/// Target-only greedy decoding in-process, through the same chat template and tokenizer.
pub async fn reference(prompts: &[&str], max_tokens: usize) -> Vec<String> {
    let source = ModelSource::parse(tiny().to_str().unwrap()).unwrap();
    let edge = MistralDrafter::load(&source, Default::default()).await.unwrap();
    let scorer = CandleScorer::load(&tiny()).unwrap();
    let mut out = Vec::new();
    for prompt in prompts {
        let ids = edge.encode_chat(&[("user".into(), prompt.to_string())]).await.unwrap();
        let params = GenerateParams {
            max_new_tokens: max_tokens,
            draft_len: 0,
            sampling: spade_core::SamplingParams::greedy(),
            draft_sampling: spade_core::SamplingParams::greedy(),
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
    let text = reqwest::Client::new().get(format!("{url}/metrics")).bearer_auth(KEY).send().await.unwrap().text().await.unwrap();
    text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok()).unwrap_or_else(|| panic!("{name} missing"))
}

pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * q).round() as usize]
}

/// Appends one observed case to the reliability report (scripts/reliability.sh renders it).
pub fn report(area: &str, case: &str, observed: &str, pass: bool) {
    eprintln!("[{}] {area}: {case}: {observed}", if pass { "PASS" } else { "FAIL" });
    if let Some(path) = std::env::var_os("SPADE_RELIABILITY_REPORT") {
        use std::io::Write;
        let line = json!({"area": area, "case": case, "observed": observed, "pass": pass});
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(path).unwrap();
        writeln!(f, "{line}").unwrap();
    }
}
