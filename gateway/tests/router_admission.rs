//! The gateway's bound on work over real HTTP, against the real verifier router, both with small
//! deterministic engines (tests/common): a burst past the places and the line is refused at once
//! with 429 and `retry-after`, a wait past its limit is refused, a client that hangs up while
//! waiting leaves the line, and gateways retrying a failed verifier spread their retries.

// Some of common's re-exports (the fake script) go unused in this test binary.
#[allow(unused_imports)]
mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{json, Value};

/// A verifier slow enough that a generation holds its place for a while (~25 calls of 20 ms).
async fn slow_verifier() -> Running {
    let mut scorer = fake_scorer();
    scorer.delay = |_| Duration::from_millis(20);
    start_verifier(scorer, &[]).await
}

async fn metric(url: &str, name: &str) -> f64 {
    let text = client().get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
    spade_test_support::metric_value(&text, name).unwrap_or_else(|| panic!("{name} not in {text}"))
}

/// Status, headers, body and how long the answer took.
async fn timed_chat(url: &str, body: Value) -> (u16, reqwest::header::HeaderMap, String, Duration) {
    let started = Instant::now();
    let (status, headers, text) = chat(url, body).await;
    (status, headers, text, started.elapsed())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_past_the_line_is_refused_at_once_and_the_rest_answered_identically() {
    let verifier = slow_verifier().await;
    let gateway = start_gateway(&verifier.url, &["--max-running", "1", "--max-queued", "2"]).await;
    let calls: Vec<_> = (0..12)
        .map(|_| tokio::spawn(timed_chat_owned(gateway.url.clone(), hello(json!({})))))
        .collect();
    let (mut answers, mut refusals) = (Vec::new(), Vec::new());
    for call in calls {
        let (status, headers, body, took) = call.await.unwrap();
        match status {
            200 => answers.push(serde_json::from_str::<Value>(&body).unwrap()),
            429 => refusals.push((headers, body, took)),
            other => panic!("{other}: {body}"),
        }
    }
    // One running and two waiting get through; the other nine are refused.
    assert_eq!((answers.len(), refusals.len()), (3, 9));
    let text = |v: &Value| v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    assert!(answers.iter().all(|a| text(a) == text(&answers[0])), "{answers:?}");
    for (headers, body, took) in &refusals {
        let error: Value = serde_json::from_str(body).unwrap();
        assert_eq!(error["error"]["code"], "rate_limit_exceeded", "{body}");
        assert_eq!(error["error"]["type"], "rate_limit_error", "{body}");
        let after: u64 = headers["retry-after"].to_str().unwrap().parse().unwrap();
        let after_ms: u64 = headers["retry-after-ms"].to_str().unwrap().parse().unwrap();
        assert!((1..=60).contains(&after) && after_ms >= after * 1000, "{after} {after_ms}");
        assert!(*took < Duration::from_millis(100), "a refusal took {took:?}");
    }
    let refused = "spade_gateway_requests_refused_total{reason=\"queue_full\"}";
    assert_eq!(metric(&gateway.url, refused).await, 9.0);
    assert_eq!(metric(&gateway.url, "spade_gateway_requests_queued").await, 0.0);
    assert_eq!(metric(&gateway.url, "spade_gateway_generations_running").await, 0.0);
}

async fn timed_chat_owned(
    url: String,
    body: Value,
) -> (u16, reqwest::header::HeaderMap, String, Duration) {
    timed_chat(&url, body).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_past_the_queue_timeout_is_refused() {
    let verifier = slow_verifier().await;
    let gateway = start_gateway(
        &verifier.url,
        &["--max-running", "1", "--max-queued", "4", "--queue-timeout-secs", "0.1"],
    )
    .await;
    let running = tokio::spawn(timed_chat_owned(gateway.url.clone(), hello(json!({}))));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (status, headers, body, took) = timed_chat(&gateway.url, hello(json!({}))).await;
    assert_eq!(status, 429, "{body}");
    assert!(headers.contains_key("retry-after"));
    assert!(took >= Duration::from_millis(100) && took < Duration::from_secs(2), "{took:?}");
    assert!(body.contains("--queue-timeout-secs"), "{body}");
    assert_eq!(running.await.unwrap().0, 200);
    let timeouts = "spade_gateway_requests_refused_total{reason=\"queue_timeout\"}";
    assert_eq!(metric(&gateway.url, timeouts).await, 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_while_waiting_leaves_the_line() {
    let verifier = slow_verifier().await;
    let gateway = start_gateway(&verifier.url, &["--max-running", "1", "--max-queued", "1"]).await;
    let running = tokio::spawn(timed_chat_owned(gateway.url.clone(), hello(json!({}))));
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Waits in line, then its client gives up.
    let impatient = reqwest::Client::builder().timeout(Duration::from_millis(150)).build().unwrap();
    let gave_up = impatient
        .post(format!("{}/v1/chat/completions", gateway.url))
        .json(&hello(json!({})))
        .send()
        .await;
    assert!(gave_up.is_err_and(|e| e.is_timeout()));
    // Long before the running generation ends (~25 verify calls of 20 ms).
    let left = Instant::now() + Duration::from_millis(100);
    while metric(&gateway.url, "spade_gateway_requests_queued").await > 0.0 {
        assert!(Instant::now() < left, "the abandoned request kept its place in line");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(!running.is_finished(), "the test needs the first request still running");
    // Its place is free: the next request waits and is answered instead of being refused.
    let (status, _, body, _) = timed_chat(&gateway.url, hello(json!({}))).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(running.await.unwrap().0, 200);
    let refused = "spade_gateway_requests_refused_total{reason=\"queue_full\"}";
    assert_eq!(metric(&gateway.url, refused).await, 0.0);
}

/// A verifier that knows its model (the fake verifier's `/v1/info`) but answers every `/verify`
/// with 503, as one does while it restarts; records when each gateway (told apart by its API key)
/// called.
async fn restarting_verifier(info: Value) -> (Running, Arc<Mutex<Vec<(String, Instant)>>>) {
    use axum::http::{HeaderMap, StatusCode};
    use axum::routing::{get, post};
    let calls = Arc::new(Mutex::new(Vec::new()));
    let seen = calls.clone();
    let app =
        axum::Router::new().route("/v1/info", get(move || async move { axum::Json(info) })).route(
            "/verify",
            post(move |headers: HeaderMap| async move {
                let key = headers["authorization"].to_str().unwrap().to_string();
                seen.lock().unwrap().push((key, Instant::now()));
                (StatusCode::SERVICE_UNAVAILABLE, "restarting")
            }),
        );
    (serve_app(app).await, calls)
}

/// Eight gateways whose verify calls fail together retry at spread times (full jitter), not in
/// lockstep as a fixed backoff would bring them back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateways_retry_a_failed_verifier_at_spread_times() {
    let real = start_verifier(fake_scorer(), &[]).await;
    let info: Value = client()
        .get(format!("{}/v1/info", real.url))
        .bearer_auth("vkey")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let (verifier, calls) = restarting_verifier(info).await;
    let mut gateways = Vec::new();
    for i in 0..8 {
        let key = format!("gateway-{i}");
        let args = ["--verifier-api-key", &key, "--verify-retries", "1", "--draft-len", "1"];
        gateways.push(start_gateway(&verifier.url, &args).await);
    }
    let answers: Vec<_> = gateways
        .iter()
        .map(|g| tokio::spawn(timed_chat_owned(g.url.clone(), hello(json!({})))))
        .collect();
    for answer in answers {
        let (status, _, body, _) = answer.await.unwrap();
        assert_eq!(status, 503, "{body}");
    }
    // Each gateway's wait between its failed call and its retry.
    let calls = calls.lock().unwrap().clone();
    let mut waits_ms: Vec<f64> = (0..8)
        .map(|i| {
            let key = format!("Bearer gateway-{i}");
            let times: Vec<Instant> =
                calls.iter().filter(|(k, _)| *k == key).map(|(_, t)| *t).collect();
            assert_eq!(times.len(), 2, "gateway {i}: one call and one retry");
            times[1].duration_since(times[0]).as_secs_f64() * 1e3
        })
        .collect();
    waits_ms.sort_by(f64::total_cmp);
    // Full jitter draws each wait from [0, 100 ms]: eight draws all within 20 ms of each other
    // happen about once in 10,000 runs; a fixed backoff puts them all at 100 ms.
    let spread = waits_ms[7] - waits_ms[0];
    let pass = spread > 20.0 && waits_ms[7] < 100.0 + 50.0;
    let waits: Vec<String> = waits_ms.iter().map(|w| format!("{w:.0}")).collect();
    spade_test_support::report(
        "faults",
        "verifier restarting (503) under 8 gateways: their retries spread (full jitter)",
        &format!("waits before the retry, ms: {}; spread {spread:.0} ms", waits.join(", ")),
        pass,
    );
    assert!(pass, "retry waits in ms: {waits_ms:?}");
}
