//! A small deterministic engine for router tests: a byte-level "model" whose target continues every
//! prompt with SCRIPT (multi-byte characters included, one byte per token), and a draft that gets
//! every fourth byte wrong, so rounds see both acceptances and rejections. The verifier is the real
//! spade-verifier router over real loopback HTTP, with a fake scorer.

#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use spade_core::{DraftToken, SparseDist};
use spade_engine::{DraftParams, Drafter, EdgeModel, EngineError, ModelMeta, ScoreSession, Scorer};

pub const SCRIPT: &str = "Héllo wörld! 🎉 日本語 END of the script.";
pub const EOS: u32 = 256;
pub const VOCAB: u32 = 257;
/// Ends every encoded prompt: the target's script starts after the last one.
const TURN: u32 = 1;

pub fn meta() -> ModelMeta {
    ModelMeta {
        name: "fake-bytes".into(),
        architecture: "fake".into(),
        vocab_size: VOCAB,
        stop_token_ids: vec![EOS],
        tokenizer_fingerprint: "b".repeat(64),
        max_context: 512,
        chat_template: None,
    }
}

/// The script token at this many tokens after the turn marker (EOS past its end).
fn script_at(tokens: &[u32]) -> u32 {
    let start = tokens.iter().rposition(|&t| t == TURN).map_or(0, |i| i + 1);
    SCRIPT.as_bytes().get(tokens.len() - start).map_or(EOS, |&b| b as u32)
}

pub struct FakeEdge {
    meta: ModelMeta,
}

impl FakeEdge {
    pub fn new() -> Arc<Self> {
        Arc::new(Self { meta: meta() })
    }
}

#[async_trait::async_trait]
impl Drafter for FakeEdge {
    fn meta(&self) -> &ModelMeta {
        &self.meta
    }

    async fn draft(&self, committed: &[u32], n: usize, _params: &DraftParams) -> Result<Vec<DraftToken>, EngineError> {
        let mut seq = committed.to_vec();
        let mut out = Vec::new();
        for _ in 0..n {
            let right = script_at(&seq);
            let token = if seq.len() % 4 == 3 && right != EOS { b'?' as u32 } else { right };
            out.push(DraftToken { token, q: SparseDist::new(vec![(token, 1.0)], Some(VOCAB)).unwrap() });
            seq.push(token);
            if token == EOS {
                break;
            }
        }
        Ok(out)
    }
}

#[async_trait::async_trait]
impl EdgeModel for FakeEdge {
    async fn encode_chat(&self, messages: &[(String, String)]) -> Result<Vec<u32>, EngineError> {
        let mut ids: Vec<u32> = messages.iter().flat_map(|(r, c)| format!("{r}: {c}\n").into_bytes()).map(u32::from).collect();
        ids.push(TURN);
        Ok(ids)
    }

    fn decode(&self, tokens: &[u32]) -> Result<String, EngineError> {
        let bytes: Vec<u8> = tokens.iter().filter(|&&t| t < 256).map(|&t| t as u8).collect();
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}

/// Scores with the script's next byte far ahead (logit 8, the rest 0); counts calls; can be slow or
/// start failing after some calls.
pub struct FakeScorer {
    meta: ModelMeta,
    pub calls: Arc<AtomicUsize>,
    pub delay: Duration,
    pub fail_after: Option<usize>,
}

impl FakeScorer {
    pub fn new() -> Self {
        Self { meta: meta(), calls: Arc::new(AtomicUsize::new(0)), delay: Duration::ZERO, fail_after: None }
    }
}

struct FakeSession {
    tokens: Vec<u32>,
    calls: Arc<AtomicUsize>,
    delay: Duration,
    fail_after: Option<usize>,
}

impl ScoreSession for FakeSession {
    fn score(&mut self, tokens: &[u32], n_logits: usize) -> Result<Vec<Vec<f32>>, EngineError> {
        let call = self.calls.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep(self.delay);
        if self.fail_after.is_some_and(|n| call >= n) {
            return Err(EngineError::Drafter("scorer failure injected by the test".into()));
        }
        self.tokens = tokens.to_vec();
        Ok((tokens.len() - n_logits..tokens.len())
            .map(|end| {
                let mut row = vec![0.0; VOCAB as usize];
                row[script_at(&tokens[..=end]) as usize] = 8.0;
                row
            })
            .collect())
    }
    fn cached_tokens(&self) -> &[u32] {
        &self.tokens
    }
    fn truncate(&mut self, len: usize) {
        self.tokens.truncate(len);
    }
    fn memory_bytes(&self) -> usize {
        self.tokens.len() * 1000
    }
}

impl Scorer for FakeScorer {
    fn meta(&self) -> &ModelMeta {
        &self.meta
    }
    fn new_session(&self) -> Box<dyn ScoreSession> {
        Box::new(FakeSession { tokens: Vec::new(), calls: self.calls.clone(), delay: self.delay, fail_after: self.fail_after })
    }
}

pub struct Running {
    pub url: String,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn listen() -> (tokio::net::TcpListener, String) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    (listener, url)
}

pub async fn start_verifier(scorer: FakeScorer, extra: &[&str]) -> Running {
    let mut args = vec!["spade-verifier", "--model", "fake.gguf", "--api-key", "vkey"];
    args.extend_from_slice(extra);
    let verifier = Arc::new(spade_verifier::Verifier::new(&spade_verifier::Config::parse_from(args)));
    verifier.set_scorer(Arc::new(scorer));
    let (listener, url) = listen().await;
    let task = tokio::spawn(async move {
        let _ = spade_verifier::serve(listener, verifier, std::future::pending()).await;
    });
    Running { url, task }
}

pub async fn start_gateway(verifier_url: &str, extra: &[&str]) -> Running {
    let mut args = vec!["spade-gateway", "--draft-model", "fake", "--verifier-url", verifier_url];
    if !extra.contains(&"--verifier-api-key") {
        args.extend(["--verifier-api-key", "vkey"]);
    }
    args.extend_from_slice(extra);
    let gateway = Arc::new(spade_gateway::Gateway::new(&spade_gateway::Config::parse_from(args)).unwrap());
    gateway.set_model(FakeEdge::new());
    let (listener, url) = listen().await;
    let task = tokio::spawn(async move {
        let _ = spade_gateway::serve(listener, gateway, std::future::pending()).await;
    });
    Running { url, task }
}

/// Parses an SSE body into its `data:` payloads.
pub fn sse_data(body: &str) -> Vec<String> {
    body.split("\n\n").filter_map(|event| event.lines().find_map(|l| l.strip_prefix("data: ")).map(str::to_string)).collect()
}
