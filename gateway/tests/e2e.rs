//! The real binaries with a real model over real HTTP: spade-verifier and spade-gateway as child
//! processes (SmolLM2 drafting for itself), compared with target-only greedy decoding in-process.
//! Streamed and non-streamed answers, stop sequences across chunks, the verifier killed mid-stream
//! (error event, or the degraded path), and a client hanging up.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use spade_engine::speculative::{generate, GenerateParams};
use spade_engine::{CandleScorer, EdgeModel, MistralDrafter, ModelSource, Scorer};

const KEY: &str = "e2e-key";
const PROMPTS: [&str; 3] = ["Write one sentence about the sea.", "List three colours.", "What is 12 times 12? Explain briefly."];
const MAX_TOKENS: usize = 40;

fn tiny() -> PathBuf {
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

struct Proc {
    child: Child,
    url: String,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

async fn wait_ready(url: &str, what: &str) {
    let client = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        if let Ok(r) = client.get(format!("{url}/health")).send().await {
            if r.status() == 200 {
                return;
            }
        }
        assert!(Instant::now() < deadline, "{what} did not become ready");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

async fn start_verifier() -> Proc {
    let port = free_port();
    let child = Command::new(verifier_bin())
        .args(["--model", tiny().to_str().unwrap(), "--port", &port.to_string(), "--api-key", KEY, "--log", "warn"])
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn spade-verifier");
    let p = Proc { child, url: format!("http://127.0.0.1:{port}") };
    wait_ready(&p.url, "spade-verifier").await;
    p
}

async fn start_gateway(verifier: &str, extra: &[&str]) -> Proc {
    let port = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_spade-gateway"))
        .args(["--draft-model", tiny().to_str().unwrap(), "--verifier-url", verifier, "--port", &port.to_string(), "--log", "warn"])
        .args(["--verify-retries", "1", "--connect-timeout-secs", "2"])
        .args(extra)
        .env("SPADE_VERIFIER_API_KEY", KEY)
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn spade-gateway");
    let p = Proc { child, url: format!("http://127.0.0.1:{port}") };
    wait_ready(&p.url, "spade-gateway").await;
    p
}

fn request(prompt: &str, extra: Value) -> Value {
    let mut body = json!({"model": "spade", "messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": MAX_TOKENS});
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

async fn complete(url: &str, body: &Value) -> Value {
    let r = reqwest::Client::new().post(format!("{url}/v1/chat/completions")).json(body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    r.json().await.unwrap()
}

/// The streamed text, the finish reason, and whether `[DONE]` ended it (or the error event).
async fn stream(url: &str, body: &Value) -> (String, Option<String>, Result<(), Value>) {
    let r = reqwest::Client::new().post(format!("{url}/v1/chat/completions")).json(body).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    let (mut content, mut finish, mut end) = (String::new(), None, Err(Value::Null));
    for data in text.split("\n\n").filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: "))) {
        if data == "[DONE]" {
            end = Ok(());
            continue;
        }
        let v: Value = serde_json::from_str(data).unwrap();
        if v.get("error").is_some() {
            end = Err(v);
            continue;
        }
        if let Some(t) = v["choices"][0]["delta"]["content"].as_str() {
            content.push_str(t);
        }
        if let Some(f) = v["choices"][0]["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
    }
    (content, finish, end)
}

/// Target-only greedy decoding in-process, through the same chat template and tokenizer.
async fn reference(prompts: &[&str]) -> Vec<String> {
    let source = ModelSource::parse(tiny().to_str().unwrap()).unwrap();
    let edge = MistralDrafter::load(&source, Default::default()).await.unwrap();
    let scorer = CandleScorer::load(&tiny()).unwrap();
    let mut out = Vec::new();
    for prompt in prompts {
        let ids = edge.encode_chat(&[("user".into(), prompt.to_string())]).await.unwrap();
        let params = GenerateParams {
            max_new_tokens: MAX_TOKENS,
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

async fn verify_calls(verifier: &str) -> u64 {
    let text = reqwest::Client::new().get(format!("{verifier}/metrics")).bearer_auth(KEY).send().await.unwrap().text().await.unwrap();
    text.lines().find_map(|l| l.strip_prefix("spade_verify_calls_total ")).unwrap().parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_and_plain_answers_equal_target_only_greedy() {
    let expected = reference(&PROMPTS).await;
    let verifier = start_verifier().await;
    let gateway = start_gateway(&verifier.url, &["--draft-len", "4"]).await;
    for (prompt, expected) in PROMPTS.iter().zip(&expected) {
        let plain = complete(&gateway.url, &request(prompt, json!({}))).await;
        assert_eq!(plain["choices"][0]["message"]["content"].as_str().unwrap(), expected, "non-streamed vs target-only: {prompt}");
        let spade = &plain["usage"]["spade"];
        assert!(spade["verify_calls"].as_u64().unwrap() < plain["usage"]["completion_tokens"].as_u64().unwrap(), "{spade}");
        let (streamed, finish, end) = stream(&gateway.url, &request(prompt, json!({"stream": true}))).await;
        assert_eq!(&streamed, expected, "streamed vs target-only: {prompt}");
        assert_eq!(finish.as_deref(), plain["choices"][0]["finish_reason"].as_str());
        assert_eq!(end, Ok(()));
    }

    // Sampling with the API defaults (temperature 1, no truncation): the draft's q is capped, so
    // each call stays small on the wire.
    let sampled = complete(&gateway.url, &request(PROMPTS[1], json!({"temperature": 1.0, "seed": 3}))).await;
    let spade = &sampled["usage"]["spade"];
    let per_call = spade["bytes_sent"].as_u64().unwrap() / spade["verify_calls"].as_u64().unwrap();
    assert!(per_call < 8 * 1024, "{per_call} bytes per verify call: {spade}");

    // A stop sequence from the middle of the answer, spanning several tokens and so several chunks.
    let text = &expected[0];
    let words: Vec<&str> = text.split(' ').collect();
    assert!(words.len() > 5, "the reference answer is too short to cut: {text:?}");
    let stop = format!("{} {}", words[3], words[4]);
    let cut = &text[..text.find(&stop).unwrap()];
    let (streamed, finish, _) = stream(&gateway.url, &request(PROMPTS[0], json!({"stream": true, "stop": [stop.clone()]}))).await;
    assert_eq!(streamed, cut, "stop {stop:?}");
    assert_eq!(finish.as_deref(), Some("stop"));
    let plain = complete(&gateway.url, &request(PROMPTS[0], json!({"stop": stop}))).await;
    assert_eq!(plain["choices"][0]["message"]["content"].as_str().unwrap(), cut);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_stops_verify_calls() {
    let verifier = start_verifier().await;
    let gateway = start_gateway(&verifier.url, &["--draft-len", "1"]).await;
    let body = request("Tell me a long story about a dragon.", json!({"stream": true, "max_tokens": 400}));
    let mut r = reqwest::Client::new().post(format!("{}/v1/chat/completions", gateway.url)).json(&body).send().await.unwrap();
    let mut seen = 0;
    while seen < 4 {
        r.chunk().await.unwrap().expect("stream ended early");
        seen += 1;
    }
    drop(r);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = verify_calls(&verifier.url).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(verify_calls(&verifier.url).await, after, "verify calls went on after the client left");
    assert!(after < 100, "{after} calls: the generation was not cut short");
    // The draft engine survived the abandoned draft: the next request is served normally.
    let plain = complete(&gateway.url, &request(PROMPTS[1], json!({"max_tokens": 8}))).await;
    assert_eq!(plain["usage"]["completion_tokens"], 8, "{plain}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verifier_killed_mid_stream_ends_with_an_error_or_degrades() {
    for fallback in ["off", "draft"] {
        let mut verifier = start_verifier().await;
        let gateway = start_gateway(&verifier.url, &["--offline-fallback", fallback]).await;
        let body = request("Tell me a long story about a dragon.", json!({"stream": true, "max_tokens": 120, "stream_options": {"include_usage": true}}));
        let mut r = reqwest::Client::new().post(format!("{}/v1/chat/completions", gateway.url)).json(&body).send().await.unwrap();
        let mut text = String::from_utf8(r.chunk().await.unwrap().unwrap().to_vec()).unwrap();
        verifier.child.kill().unwrap();
        verifier.child.wait().unwrap();
        let started = Instant::now();
        while let Some(chunk) = tokio::time::timeout(Duration::from_secs(60), r.chunk()).await.expect("the stream hung").unwrap() {
            text.push_str(&String::from_utf8_lossy(&chunk));
        }
        assert!(started.elapsed() < Duration::from_secs(60));
        let data: Vec<&str> = text.split("\n\n").filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: "))).collect();
        if fallback == "off" {
            let last: Value = serde_json::from_str(data.last().unwrap()).unwrap();
            assert_eq!(last["error"]["code"], "verifier_unavailable", "{text}");
            assert!(!data.contains(&"[DONE]"));
        } else {
            assert_eq!(data.last(), Some(&"[DONE]"), "{text}");
            let usage: Value = serde_json::from_str(data[data.len() - 2]).unwrap();
            assert_eq!(usage["usage"]["spade"]["degraded"], true, "{usage}");
        }
    }
}
