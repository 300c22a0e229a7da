//! The gateway over real HTTP against the real verifier router, both with small deterministic
//! engines (tests/common): requests refused with the parameter named, limits, faults of the
//! verifier, client disconnects, API keys and health. Generation itself is in tests/router.rs.

// Some of common's re-exports (the fake script) go unused in this test binary.
#[allow(unused_imports)]
mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use serde_json::{json, Value};

#[tokio::test]
async fn bad_requests_name_the_parameter() {
    let verifier = start_verifier(fake_scorer(), &[]).await;
    let gateway = start_gateway(&verifier.url, &[]).await;
    let cases = [
        (json!({"messages": []}), "messages"),
        (hello(json!({"n": 0})), "n"),
        (hello(json!({"n": 17})), "n"),
        (hello(json!({"presence_penalty": 2.5})), "presence_penalty"),
        (hello(json!({"frequency_penalty": -3})), "frequency_penalty"),
        (hello(json!({"repetition_penalty": 0})), "repetition_penalty"),
        (hello(json!({"logit_bias": {"x": 10}})), "logit_bias"),
        (hello(json!({"logit_bias": {"50": 101}})), "logit_bias"),
        (hello(json!({"logit_bias": {"50": "high"}})), "logit_bias"),
        (hello(json!({"logit_bias": {"257": 1}})), "logit_bias"),
        (hello(json!({"logit_bias": [1, 2]})), "logit_bias"),
        // The fake draft model has no vocabulary to compile grammars against: refused by name.
        (hello(json!({"response_format": {"type": "json_object"}})), "response_format"),
        (hello(json!({"response_format": {"type": "yaml"}})), "response_format.type"),
        (
            hello(
                json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}),
            ),
            "response_format.json_schema.name",
        ),
        (hello(json!({"tool_choice": "required"})), "tool_choice"),
        (
            hello(
                json!({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}),
            ),
            "tool_choice.function.name",
        ),
        (hello(json!({"tools": {"type": "function"}})), "tools"),
        (
            hello(json!({"tools": [{"type": "function", "function": {"description": "no name"}}]})),
            "tools[0]",
        ),
        (
            hello(json!({"tools": [{"type": "retrieval", "function": {"name": "f"}}]})),
            "tools[0].type",
        ),
        (
            hello(
                json!({"tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]}),
            ),
            "tools[1].function.name",
        ),
        (
            hello(
                json!({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}),
            ),
            "tool_choice",
        ),
        (
            hello(
                json!({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "f"}}}),
            ),
            "tool_choice",
        ),
        (hello(json!({"tool_choice": "sometimes"})), "tool_choice"),
        (hello(json!({"functions": [{"name": "f", "parameters": {}}]})), "functions"),
        (hello(json!({"function_call": "auto"})), "function_call"),
        (hello(json!({"temperature": 2.5})), "temperature"),
        (hello(json!({"top_p": 0})), "top_p"),
        (hello(json!({"max_tokens": 0})), "max_tokens"),
        (hello(json!({"max_completion_tokens": -3})), "max_completion_tokens"),
        (hello(json!({"max_tokens": 100000})), "messages"),
        (hello(json!({"top_logprobs": 3})), "top_logprobs"),
        (hello(json!({"logprobs": true, "top_logprobs": 21})), "top_logprobs"),
        (hello(json!({"stream_options": {"include_usage": true}})), "stream_options"),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            "messages[0].content[0].type",
        ),
        (json!({"messages": [{"role": "user"}]}), "messages[0].content"),
        (json!({"messages": [{"role": "tool", "content": "x"}]}), "messages[0].tool_call_id"),
        (
            json!({"messages": [{"role": "user", "content": "x", "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}),
            "messages[0].tool_calls",
        ),
        (json!({"messages": [{"role": "assistant", "content": null}]}), "messages[0].content"),
    ];
    for (body, param) in cases {
        let (status, _, text) = chat(&gateway.url, body.clone()).await;
        assert_eq!(status, 400, "{body} -> {text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["error"]["param"], param, "{body} -> {text}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()));
    }
    // Not JSON, wrong types, wrong content type, unknown route, wrong method.
    let r = client()
        .post(format!("{}/v1/chat/completions", gateway.url))
        .header("content-type", "application/json")
        .body("{nope")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["code"], "invalid_json");
    let (status, _, _) = chat(&gateway.url, json!({"messages": "hi"})).await;
    assert_eq!(status, 400);
    let r = client()
        .post(format!("{}/v1/chat/completions", gateway.url))
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let r = client().get(format!("{}/v1/nothing", gateway.url)).send().await.unwrap();
    assert_eq!(r.status(), 404);
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["code"], "not_found");
    let r = client().get(format!("{}/v1/chat/completions", gateway.url)).send().await.unwrap();
    assert_eq!(r.status(), 405);
}

#[tokio::test]
async fn the_completion_token_cap_refuses_and_bounds() {
    let verifier = start_verifier(fake_scorer(), &[]).await;
    let gateway = start_gateway(&verifier.url, &["--max-completion-tokens", "4"]).await;
    let (status, _, body) = chat(&gateway.url, hello(json!({"max_tokens": 5}))).await;
    assert_eq!(status, 400);
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["error"]["param"], "max_tokens");
    let (_, _, body) = chat(&gateway.url, hello(json!({}))).await;
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 4);
    assert_eq!(v["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn oversized_bodies_get_413() {
    let verifier = start_verifier(fake_scorer(), &[]).await;
    let gateway = start_gateway(&verifier.url, &["--max-body-bytes", "1000"]).await;
    let (status, _, body) =
        chat(&gateway.url, json!({"messages": [{"role": "user", "content": "x".repeat(5000)}]}))
            .await;
    assert_eq!(status, 413, "{body}");
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["error"]["code"], "request_too_large");
}

#[tokio::test]
async fn verifier_down_gives_503_without_retry_and_health_says_why() {
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let gateway = start_gateway(&dead, &["--verify-retries", "0"]).await;
    let (status, headers, body) = chat(&gateway.url, hello(json!({"stream": true}))).await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(headers["x-should-retry"], "false");
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["error"]["code"],
        "verifier_unavailable"
    );
    for probe in ["/health", "/health/ready"] {
        let (status, v) = get_json(&format!("{}{probe}", gateway.url)).await;
        assert_eq!(
            (status, &v["status"], &v["serving"]),
            (503, &json!("verifier_unreachable"), &Value::Null)
        );
    }
    // Restarting the gateway would not bring the verifier back: it stays live.
    assert_eq!(get_json(&format!("{}/health/live", gateway.url)).await.0, 200);
}

async fn get_json(url: &str) -> (u16, Value) {
    let r = client().get(url).send().await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

#[tokio::test]
async fn offline_fallback_answers_from_the_draft_and_says_so() {
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let gateway =
        start_gateway(&dead, &["--offline-fallback", "draft", "--verify-retries", "0"]).await;
    let (status, _, body) = chat(&gateway.url, hello(json!({"max_tokens": 8}))).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["usage"]["spade"]["degraded"], true);
    assert_eq!(v["usage"]["spade"]["verify_calls"], 0);
    // The fake draft's own text: wrong every fourth byte (position 11 breaks the é).
    assert_eq!(v["choices"][0]["message"]["content"], "H?\u{FFFD}ll? w");
    // It can answer, so it is ready, and says how.
    for probe in ["/health", "/health/ready"] {
        let (status, v) = get_json(&format!("{}{probe}", gateway.url)).await;
        assert_eq!(
            (status, &v["status"], &v["serving"]),
            (200, &json!("degraded"), &json!("draft_only")),
            "{v}"
        );
        assert!(v["detail"].as_str().unwrap().contains("unreachable"), "{v}");
    }
}

#[tokio::test]
async fn verifier_failing_mid_stream_ends_the_stream_with_an_error_event() {
    let mut scorer = fake_scorer();
    scorer.fail_after = Some(3);
    let verifier = start_verifier(scorer, &[]).await;
    let gateway = start_gateway(&verifier.url, &["--verify-retries", "1"]).await;
    let started = std::time::Instant::now();
    let (status, _, body) = chat(&gateway.url, hello(json!({"stream": true}))).await;
    assert_eq!(status, 200);
    let data = sse_data(&body);
    assert!(!data.iter().any(|d| d == "[DONE]"), "no [DONE] after a failure: {body}");
    let last: Value = serde_json::from_str(data.last().unwrap()).unwrap();
    // 500s are retried, then reported as the verifier being unavailable.
    assert_eq!(last["error"]["code"], "verifier_unavailable", "{last}");
    assert!(data.len() >= 3, "text streamed before the failure");
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[tokio::test]
async fn client_disconnect_stops_verify_calls() {
    let mut scorer = fake_scorer();
    scorer.delay = |_| Duration::from_millis(100);
    let calls = scorer.calls.clone();
    let verifier = start_verifier(scorer, &[]).await;
    let gateway = start_gateway(&verifier.url, &["--draft-len", "1"]).await;
    let mut response = client()
        .post(format!("{}/v1/chat/completions", gateway.url))
        .json(&hello(json!({"stream": true})))
        .send()
        .await
        .unwrap();
    // Read two chunks (role, first text), then hang up.
    response.chunk().await.unwrap();
    response.chunk().await.unwrap();
    drop(response);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after_drop = calls.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(
        calls.load(Ordering::SeqCst),
        after_drop,
        "verify calls continued after the client left"
    );
    // The whole script would have needed about 25 calls at two tokens each.
    assert!(after_drop < 10, "{after_drop} calls");
}

#[tokio::test]
async fn api_key_guards_everything_but_health() {
    let verifier = start_verifier(fake_scorer(), &[]).await;
    let gateway = start_gateway(&verifier.url, &["--api-key", "gkey"]).await;
    let (status, _, body) = chat(&gateway.url, hello(json!({}))).await;
    assert_eq!(status, 401);
    assert_eq!(
        serde_json::from_str::<Value>(&body).unwrap()["error"]["type"],
        "authentication_error"
    );
    let r = client()
        .post(format!("{}/v1/chat/completions", gateway.url))
        .bearer_auth("gkey")
        .json(&hello(json!({"max_tokens": 2})))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = client()
        .get(format!("{}/v1/models", gateway.url))
        .bearer_auth("gkey")
        .send()
        .await
        .unwrap();
    assert_eq!(r.json::<Value>().await.unwrap()["data"][0]["id"], "spade");
    for probe in ["/health", "/health/ready"] {
        let (status, v) = get_json(&format!("{}{probe}", gateway.url)).await;
        assert_eq!(
            (status, &v["status"], &v["serving"]),
            (200, &json!("ready"), &json!("speculative"))
        );
    }
    assert_eq!(get_json(&format!("{}/health/live", gateway.url)).await.0, 200);
    let r = client().get(format!("{}/metrics", gateway.url)).send().await.unwrap();
    assert_eq!(r.status(), 401, "metrics need the key without --metrics-public");
    let r =
        client().get(format!("{}/metrics", gateway.url)).bearer_auth("gkey").send().await.unwrap();
    let text = r.text().await.unwrap();
    // The refused request never reached the handler.
    assert!(text.contains("spade_gateway_requests_total 1\n"), "{text}");
    assert!(text.contains("spade_gateway_verify_calls_total"));
}

#[tokio::test]
async fn fill_in_the_middle_without_fim_tokens_is_refused_by_name() {
    let verifier = start_verifier(fake_scorer(), &[]).await;
    let gateway = start_gateway(&verifier.url, &[]).await;
    for (path, body, param) in [
        ("/v1/completions", json!({"prompt": "def f(", "suffix": ")"}), "suffix"),
        ("/infill", json!({"input_prefix": "def f(", "input_suffix": ")"}), "input_prefix"),
        ("/infill", json!({"input_prefix": "x", "repeat_penalty": 1.1}), "repeat_penalty"),
        ("/infill", json!({"input_prefix": "x", "n_probs": 3}), "n_probs"),
    ] {
        let r = client().post(format!("{}{path}", gateway.url)).json(&body).send().await.unwrap();
        assert_eq!(r.status(), 400, "{path} {body}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["param"], param, "{v}");
    }
}

#[tokio::test]
async fn metrics_public_opens_only_the_metrics() {
    let verifier = start_verifier(fake_scorer(), &[]).await;
    let gateway = start_gateway(&verifier.url, &["--api-key", "gkey", "--metrics-public"]).await;
    let r = client().get(format!("{}/metrics", gateway.url)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.text().await.unwrap().contains("spade_gateway_requests_total 0\n"));
    assert_eq!(chat(&gateway.url, hello(json!({}))).await.0, 401);
}

#[tokio::test]
async fn wrong_verifier_key_is_a_502_not_a_hang() {
    let verifier = start_verifier(fake_scorer(), &[]).await;
    let gateway = start_gateway(&verifier.url, &["--verifier-api-key", "wrong"]).await;
    let (status, headers, body) = chat(&gateway.url, hello(json!({}))).await;
    assert_eq!(status, 502, "{body}");
    assert_eq!(headers["x-should-retry"], "false");
}

#[tokio::test]
async fn health_refuses_a_draft_len_over_the_verifiers_max_draft() {
    let verifier = start_verifier(fake_scorer(), &["--max-draft", "2"]).await;
    let gateway = start_gateway(&verifier.url, &["--draft-len", "4"]).await;
    let r = client().get(format!("{}/health", gateway.url)).send().await.unwrap();
    assert_eq!(r.status(), 503);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["status"], "verifier_mismatch", "{body}");
    assert!(body["detail"].as_str().unwrap().contains("at most 2 (its --max-draft)"), "{body}");
    // A chat request says the same, as a 502 from the gateway rather than a 400 per verify call.
    let (status, _, body) = chat(&gateway.url, hello(json!({}))).await;
    assert_eq!(status, 502, "{body}");
    assert!(body.contains("--max-draft"), "{body}");
}
