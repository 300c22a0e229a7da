//! Both servers in-process over real loopback HTTP, with spade-test-support's byte-level fake models
//! (the gateway drafting with `FakeEdge`, the real spade-verifier router scoring with the fake target).

#![allow(dead_code)]

use std::sync::Arc;

use clap::Parser;
pub use spade_test_support::fake::bytes::{scorer as fake_scorer, FakeEdge, SCRIPT};
pub use spade_test_support::fake::FakeScorer;

pub struct Running {
    pub url: String,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// `app` on a free loopback port.
pub async fn serve_app(app: axum::Router) -> Running {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let task = tokio::spawn(async move {
        let _ = spade_http::serve(listener, app, std::future::pending()).await;
    });
    Running { url, task }
}

pub async fn start_verifier(scorer: FakeScorer, extra: &[&str]) -> Running {
    let mut args = vec!["spade-verifier", "--model", "fake.gguf", "--api-key", "vkey"];
    args.extend_from_slice(extra);
    let verifier =
        Arc::new(spade_verifier::Verifier::new(&spade_verifier::Config::parse_from(args)));
    verifier.load_model(Arc::new(scorer), Default::default()).expect("scoring thread");
    serve_app(spade_verifier::router(verifier)).await
}

pub async fn start_gateway(verifier_url: &str, extra: &[&str]) -> Running {
    let mut args = vec!["spade-gateway", "--draft-model", "fake", "--verifier-url", verifier_url];
    if !extra.contains(&"--verifier-api-key") {
        args.extend(["--verifier-api-key", "vkey"]);
    }
    args.extend_from_slice(extra);
    let gateway =
        Arc::new(spade_gateway::Gateway::new(&spade_gateway::Config::parse_from(args)).unwrap());
    gateway.draft_model.set(FakeEdge::new());
    serve_app(spade_gateway::router(gateway)).await
}

/// Parses an SSE body into its `data:` payloads.
pub fn sse_data(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|event| {
            event.lines().find_map(|l| l.strip_prefix("data: ")).map(str::to_string)
        })
        .collect()
}

/// A plain HTTP client.
pub fn client() -> reqwest::Client {
    reqwest::Client::new()
}

/// Status, headers and body of a chat completion call.
pub async fn chat(url: &str, body: serde_json::Value) -> (u16, reqwest::header::HeaderMap, String) {
    let r = client().post(format!("{url}/v1/chat/completions")).json(&body).send().await.unwrap();
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    (status, headers, r.text().await.unwrap())
}

/// A greedy "hi" request with `extra`'s fields added.
pub fn hello(extra: serde_json::Value) -> serde_json::Value {
    let mut body = serde_json::json!({"model": "spade", "messages": [{"role": "user", "content": "hi"}], "temperature": 0});
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}
