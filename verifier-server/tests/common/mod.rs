//! The verifier's router in-process (`tower::ServiceExt::oneshot`), with a small deterministic scorer,
//! for the router tests.

#![allow(dead_code)]

pub use std::sync::Arc;
pub use std::time::Duration;

pub use axum::body::Body;
pub use axum::http::{header, Request, StatusCode};
pub use clap::Parser;
pub use serde_json::{json, Value};
pub use spade_test_support::fake::{meta, FakeScorer};
pub use spade_verifier::{router, Config, Verifier};
pub use tower::ServiceExt;

pub const VOCAB: u32 = 32;
pub const SLOW_TOKEN: u32 = 30;
/// A context starting with it makes the scorer panic, as a bug in a real one would: the scoring
/// thread dies.
pub const PANIC_TOKEN: u32 = 31;

pub fn next_of(t: u32) -> u32 {
    (t * 7 + 1) % VOCAB
}

/// Logits peak at (7 * last token + 1) % 32 and fall off linearly; a context starting with
/// SLOW_TOKEN takes 300 ms, one starting with PANIC_TOKEN panics.
pub fn scorer() -> FakeScorer {
    let mut scorer = FakeScorer::new(meta("fake", VOCAB, 64), |tokens| {
        assert_ne!(tokens[0], PANIC_TOKEN, "the scorer fails");
        let next = next_of(*tokens.last().unwrap());
        (0..VOCAB).map(|j| -((j as f32 - next as f32).abs())).collect()
    });
    scorer.delay =
        |tokens| if tokens[0] == SLOW_TOKEN { Duration::from_millis(300) } else { Duration::ZERO };
    scorer
}

pub fn state(extra: &[&str], ready: bool) -> Arc<Verifier> {
    let mut args = vec!["spade-verifier", "--model", "fake.gguf", "--api-key", "sekret"];
    args.extend_from_slice(extra);
    let verifier = Arc::new(Verifier::new(&Config::parse_from(args)));
    if ready {
        verifier.load_model(Arc::new(scorer()), Default::default()).unwrap();
    }
    verifier
}

pub async fn call(
    state: &Arc<Verifier>,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: Option<String>,
) -> (StatusCode, Value, axum::http::HeaderMap) {
    let mut req = Request::builder().method(method).uri(path);
    if let Some(k) = key {
        req = req.header(header::AUTHORIZATION, format!("Bearer {k}"));
    }
    let req = match body {
        Some(b) => {
            req.header(header::CONTENT_TYPE, "application/json").body(Body::from(b)).unwrap()
        }
        None => req.body(Body::empty()).unwrap(),
    };
    let resp = router(state.clone()).oneshot(req).await.unwrap();
    let (status, headers) = (resp.status(), resp.headers().clone());
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX).await.unwrap();
    let value = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()));
    (status, value, headers)
}

pub async fn verify(state: &Arc<Verifier>, body: Value) -> (StatusCode, Value) {
    let (s, v, _) = call(state, "POST", "/verify", Some("sekret"), Some(body.to_string())).await;
    (s, v)
}

pub fn greedy(context: &[u32], drafts: &[u32]) -> Value {
    json!({
        "context": context,
        "draft": drafts.iter().map(|&t| json!({"token": t, "q": [[t, 1.0]]})).collect::<Vec<_>>(),
        "sampling": {"temperature": 0.0},
    })
}

/// An error body in OpenAI's shape, with the expected type, param and code.
pub fn assert_error(v: &Value, kind: &str, param: Option<&str>, code: Option<&str>) {
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert_eq!(e["type"], kind, "{v}");
    assert_eq!(e["param"].as_str(), param, "{v}");
    assert_eq!(e["code"].as_str(), code, "{v}");
}

pub async fn probe(state: &Arc<Verifier>, path: &str) -> (StatusCode, Option<String>) {
    let (s, v, _) = call(state, "GET", path, None, None).await;
    (s, v["status"].as_str().map(String::from))
}
