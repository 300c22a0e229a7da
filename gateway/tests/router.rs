//! The gateway over real HTTP against the real verifier router, both with small deterministic
//! engines (tests/common): framing, stop sequences, accounting, errors and faults. The real models
//! are exercised end to end in tests/e2e.rs.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use serde_json::{json, Value};

fn client() -> reqwest::Client {
    reqwest::Client::new()
}

async fn chat(url: &str, body: Value) -> (u16, reqwest::header::HeaderMap, String) {
    let r = client().post(format!("{url}/v1/chat/completions")).json(&body).send().await.unwrap();
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    (status, headers, r.text().await.unwrap())
}

fn hello(extra: Value) -> Value {
    let mut body = json!({"model": "spade", "messages": [{"role": "user", "content": "hi"}], "temperature": 0});
    body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    body
}

/// Concatenated content, finish reason, the parsed chunks.
fn read_stream(body: &str) -> (String, Option<String>, Vec<Value>) {
    let data = sse_data(body);
    assert_eq!(data.iter().filter(|d| *d == "[DONE]").count(), 1, "exactly one [DONE]: {body}");
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "[DONE] comes last");
    let chunks: Vec<Value> = data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant", "role in the first delta");
    let mut text = String::new();
    let mut finish = None;
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        if let Some(choice) = c["choices"].get(0) {
            if let Some(t) = choice["delta"]["content"].as_str() {
                assert!(!t.contains('\u{FFFD}'), "a chunk split a character: {t:?}");
                text.push_str(t);
            }
            if let Some(f) = choice["finish_reason"].as_str() {
                finish = Some(f.to_string());
            }
        }
    }
    (text, finish, chunks)
}

#[tokio::test]
async fn greedy_stream_and_json_agree_with_the_target() {
    let scorer = fake_scorer();
    let verifier = start_verifier(scorer, &[]).await;
    let gateway = start_gateway(&verifier.url, &["--draft-len", "3"]).await;

    let (status, _, body) = chat(&gateway.url, hello(json!({}))).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["content"], SCRIPT);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let usage = &v["usage"];
    let completion = usage["completion_tokens"].as_u64().unwrap();
    assert_eq!(completion, SCRIPT.len() as u64 + 1, "script bytes plus end-of-sequence");
    assert_eq!(usage["total_tokens"].as_u64().unwrap(), usage["prompt_tokens"].as_u64().unwrap() + completion);
    let calls = usage["spade"]["verify_calls"].as_u64().unwrap();
    let accepted = usage["completion_tokens_details"]["accepted_prediction_tokens"].as_u64().unwrap();
    let rejected = usage["completion_tokens_details"]["rejected_prediction_tokens"].as_u64().unwrap();
    assert!(calls < completion, "speculation saves calls: {calls} calls for {completion} tokens");
    // Each call commits its accepted drafts plus one token; only a token after an accepted
    // end-of-sequence draft goes unused.
    assert!(completion <= accepted + calls && accepted + calls <= completion + 1, "{accepted} + {calls} vs {completion}");
    assert!(rejected > 0, "the fake draft is wrong every fourth byte");
    assert_eq!(usage["spade"]["draft_len"], 3);
    assert_eq!(usage["spade"]["degraded"], false);
    assert!(usage["spade"]["bytes_sent"].as_u64().unwrap() > 0);

    let (status, headers, body) = chat(&gateway.url, hello(json!({"stream": true}))).await;
    assert_eq!(status, 200);
    assert!(headers["content-type"].to_str().unwrap().starts_with("text/event-stream"));
    let (text, finish, chunks) = read_stream(&body);
    assert_eq!(text, SCRIPT);
    assert_eq!(finish.as_deref(), Some("stop"));
    assert!(chunks.len() > 10, "streamed incrementally, not in one piece: {} chunks", chunks.len());
    assert!(chunks.iter().all(|c| c.get("usage").is_none()), "no usage without include_usage");
}

#[tokio::test]
async fn include_usage_sends_a_final_chunk_without_choices() {
    let verifier = start_verifier(fake_scorer(), &[]).await;
    let gateway = start_gateway(&verifier.url, &[]).await;
    let (_, _, body) = chat(&gateway.url, hello(json!({"stream": true, "stream_options": {"include_usage": true}, "max_tokens": 5}))).await;
    let (text, finish, chunks) = read_stream(&body);
    assert_eq!(text, "Héll", "5 byte tokens, the é is two of them");
    assert_eq!(finish.as_deref(), Some("length"));
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 5);
    assert_eq!(chunks.iter().filter(|c| c.get("usage").is_some()).count(), 1);
}

#[tokio::test]
async fn stop_sequences_spanning_tokens_are_never_sent() {
    let verifier = start_verifier(fake_scorer(), &[]).await;
    let gateway = start_gateway(&verifier.url, &["--draft-len", "2"]).await;
    // "wörld" spans six byte tokens and several rounds; "🎉" is four bytes of one character.
    for (stop, expected) in [(json!("wörld"), "Héllo "), (json!(["xyz", "🎉"]), "Héllo wörld! "), (json!(["of the", "END"]), "Héllo wörld! 🎉 日本語 ")]
    {
        let (_, _, body) = chat(&gateway.url, hello(json!({"stream": true, "stop": stop}))).await;
        let (text, finish, _) = read_stream(&body);
        assert_eq!(text, expected, "stop {stop}");
        assert_eq!(finish.as_deref(), Some("stop"));
        let (_, _, body) = chat(&gateway.url, hello(json!({"stop": stop}))).await;
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["choices"][0]["message"]["content"], expected);
    }
}

#[tokio::test]
async fn logprobs_come_from_the_target() {
    let verifier = start_verifier(fake_scorer(), &[]).await;
    let gateway = start_gateway(&verifier.url, &[]).await;
    let (status, _, body) = chat(&gateway.url, hello(json!({"logprobs": true, "top_logprobs": 2, "max_tokens": 6}))).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let content = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 6);
    // The fake target puts logit 8 on the script byte and 0 on 256 others.
    let expected = 8.0 - (8f64.exp() + 256.0).ln();
    for entry in content {
        assert!((entry["logprob"].as_f64().unwrap() - expected).abs() < 1e-3, "{entry}");
        assert_eq!(entry["top_logprobs"].as_array().unwrap().len(), 2);
    }
    assert_eq!(content[0]["token"], "H");
}

#[tokio::test]
async fn seeded_sampling_reproduces() {
    let verifier = start_verifier(fake_scorer(), &[]).await;
    let gateway = start_gateway(&verifier.url, &[]).await;
    let body = hello(json!({"temperature": 1.0, "seed": 7, "max_tokens": 40}));
    let (_, _, a) = chat(&gateway.url, body.clone()).await;
    let (_, _, b) = chat(&gateway.url, body).await;
    let text = |s: &str| serde_json::from_str::<Value>(s).unwrap()["choices"][0]["message"]["content"].clone();
    assert_eq!(text(&a), text(&b));
}

#[tokio::test]
async fn several_choices_are_independent_generations_with_summed_usage() {
    let verifier = start_verifier(fake_scorer(), &[]).await;
    let gateway = start_gateway(&verifier.url, &["--draft-len", "3"]).await;
    let (status, _, body) = chat(&gateway.url, hello(json!({"n": 3}))).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.iter().map(|c| c["index"].as_u64().unwrap()).collect::<Vec<_>>(), vec![0, 1, 2]);
    assert!(choices.iter().all(|c| c["message"]["content"] == SCRIPT), "greedy choices are the target's answer: {v}");
    let (_, _, one) = chat(&gateway.url, hello(json!({}))).await;
    let one: Value = serde_json::from_str(&one).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], one["usage"]["completion_tokens"].as_u64().unwrap() * 3);
    assert_eq!(v["usage"]["prompt_tokens"], one["usage"]["prompt_tokens"]);
    assert_eq!(v["usage"]["spade"]["verify_calls"], one["usage"]["spade"]["verify_calls"].as_u64().unwrap() * 3);

    // Streamed: each index gets its role, its text and its finish; one usage chunk and one [DONE] at the end.
    let (_, _, body) = chat(&gateway.url, hello(json!({"n": 2, "stream": true, "stream_options": {"include_usage": true}}))).await;
    let data = sse_data(&body);
    assert_eq!(data.iter().filter(|d| *d == "[DONE]").count(), 1);
    let chunks: Vec<Value> = data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    for index in 0..2 {
        let mine: Vec<&Value> = chunks.iter().filter(|c| c["choices"].get(0).is_some_and(|ch| ch["index"] == index)).collect();
        assert_eq!(mine[0]["choices"][0]["delta"]["role"], "assistant");
        let text: String = mine.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
        assert_eq!(text, SCRIPT, "choice {index}");
        assert_eq!(mine.iter().filter(|c| !c["choices"][0]["finish_reason"].is_null()).count(), 1);
    }
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], one["usage"]["completion_tokens"].as_u64().unwrap() * 2);

    // Sampled with a seed: the choices differ from each other, and the request reproduces.
    let sampled = hello(json!({"n": 3, "temperature": 1.0, "seed": 11, "max_tokens": 40}));
    let texts = |body: &str| -> Vec<Value> {
        serde_json::from_str::<Value>(body).unwrap()["choices"].as_array().unwrap().iter().map(|c| c["message"]["content"].clone()).collect()
    };
    let (a, b) = (texts(&chat(&gateway.url, sampled.clone()).await.2), texts(&chat(&gateway.url, sampled).await.2));
    assert_eq!(a, b, "a seeded request with n = 3 reproduces");
    assert!(a[0] != a[1] && a[1] != a[2], "choices should be independent samples: {a:?}");
}

#[tokio::test]
async fn finished_generations_free_their_verifier_session() {
    let verifier = start_verifier(fake_scorer(), &[]).await;
    let gateway = start_gateway(&verifier.url, &[]).await;
    for stream in [false, true] {
        let (status, _, _) = chat(&gateway.url, hello(json!({"stream": stream, "max_tokens": 6}))).await;
        assert_eq!(status, 200);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let metrics = client().get(format!("{}/metrics", verifier.url)).bearer_auth("vkey").send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("\nspade_sessions 0\n"), "{metrics}");
}

#[tokio::test]
async fn lost_sessions_are_resent_and_the_output_is_unchanged() {
    // A zero cache budget evicts every session right after its call: each delta gets 409.
    let verifier = start_verifier(fake_scorer(), &["--cache-budget-mb", "0"]).await;
    let gateway = start_gateway(&verifier.url, &["--draft-len", "3"]).await;
    let (status, _, body) = chat(&gateway.url, hello(json!({}))).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], SCRIPT);
}

#[tokio::test]
async fn penalties_and_bias_reach_the_verifier_and_drafting_keeps_its_answer() {
    let verifier = start_verifier(fake_scorer(), &[]).await;
    let gateway = start_gateway(&verifier.url, &["--draft-len", "3"]).await;
    // The script's first byte banned: greedy decoding takes the lowest id of the tied rest (0),
    // then the script goes on from its second position.
    let ban = u32::from(SCRIPT.as_bytes()[0]).to_string();
    let mut answers = Vec::new();
    for draft_len in [0, 3] {
        let body = hello(json!({"temperature": 0, "logit_bias": {ban.clone(): -100}, "presence_penalty": 0.5, "spade": {"draft_len": draft_len}}));
        let (status, _, text) = chat(&gateway.url, body).await;
        assert_eq!(status, 200, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        answers.push(v["choices"][0]["message"]["content"].as_str().unwrap().to_string());
    }
    assert_eq!(answers[0], format!("\0{}", &SCRIPT[1..]));
    assert_eq!(answers[1], answers[0], "speculative and target-only answers differ under a bias");
}

#[tokio::test]
async fn cors_is_off_by_default_and_answers_listed_origins_only() {
    let verifier = start_verifier(fake_scorer(), &[]).await;
    let preflight = |url: &str, origin: &str| {
        client()
            .request(reqwest::Method::OPTIONS, format!("{url}/v1/chat/completions"))
            .header("origin", origin)
            .header("access-control-request-method", "POST")
            .header("access-control-request-headers", "authorization,content-type,x-stainless-os")
            .send()
    };
    let allowed = |r: &reqwest::Response| r.headers().get("access-control-allow-origin").map(|v| v.to_str().unwrap().to_string());

    let closed = start_gateway(&verifier.url, &[]).await;
    assert_eq!(allowed(&preflight(&closed.url, "https://app.example").await.unwrap()), None);

    let open = start_gateway(&verifier.url, &["--cors-allow-origin", "https://app.example,http://localhost:5173", "--api-key", "gk"]).await;
    // The preflight carries no credentials, so it is answered before authentication.
    let r = preflight(&open.url, "https://app.example").await.unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    assert_eq!(allowed(&r).as_deref(), Some("https://app.example"));
    let headers = r.headers()["access-control-allow-headers"].to_str().unwrap().to_lowercase();
    assert!(headers.contains("x-stainless-os") && headers.contains("authorization"), "{headers}");
    assert_eq!(allowed(&preflight(&open.url, "https://evil.example").await.unwrap()), None);
    // The request itself still needs the key, and its answer names the origin.
    let r = client().post(format!("{}/v1/chat/completions", open.url)).header("origin", "http://localhost:5173").json(&hello(json!({}))).send().await.unwrap();
    assert_eq!(r.status(), 401);
    let r = client()
        .post(format!("{}/v1/chat/completions", open.url))
        .header("origin", "http://localhost:5173")
        .bearer_auth("gk")
        .json(&hello(json!({"max_tokens": 3})))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(allowed(&r).as_deref(), Some("http://localhost:5173"));
}

async fn complete(url: &str, body: Value) -> (u16, String) {
    let r = client().post(format!("{url}/v1/completions")).json(&body).send().await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

#[tokio::test]
async fn legacy_completions_continue_a_raw_prompt_streamed_and_not() {
    let verifier = start_verifier(fake_scorer(), &[]).await;
    let gateway = start_gateway(&verifier.url, &["--draft-len", "3"]).await;
    // The turn marker (id 1) alone: the fake target answers with its script from the start.
    let (status, body) = complete(&gateway.url, json!({"prompt": [1], "temperature": 0, "max_tokens": 100})).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!((v["object"].as_str(), v["choices"][0]["text"].as_str()), (Some("text_completion"), Some(SCRIPT)));
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(v["usage"]["prompt_tokens"], 1);

    // Streamed, echoed, with usage: the echo comes first, then the same text.
    let body = json!({"prompt": [[1]], "temperature": 0, "stream": true, "echo": true, "stream_options": {"include_usage": true}});
    let r = client().post(format!("{}/v1/completions", gateway.url)).json(&body).send().await.unwrap();
    let data = sse_data(&r.text().await.unwrap());
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    assert!(chunks.iter().all(|c| c["object"] == "text_completion"), "{chunks:?}");
    let text: String = chunks.iter().filter_map(|c| c["choices"].get(0)).filter_map(|c| c["text"].as_str()).collect();
    assert_eq!(text, format!("\u{1}{SCRIPT}"));
    assert_eq!(chunks[chunks.len() - 2]["choices"][0]["finish_reason"], "stop");
    assert_eq!(chunks.last().unwrap()["choices"], json!([]));
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], v["usage"]["completion_tokens"]);

    // A text prompt is tokenised without a template; legacy logprobs line up with the text.
    let (status, body) = complete(&gateway.url, json!({"prompt": "abc", "temperature": 0, "max_tokens": 4, "logprobs": 2})).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let choice = &v["choices"][0];
    assert_eq!(choice["text"], &SCRIPT[3..7]);
    let lp = &choice["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 4);
    assert_eq!(lp["text_offset"], json!([0, 1, 2, 3]));
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 2);
    assert!(lp["token_logprobs"][0].as_f64().unwrap() <= 0.0);
    assert_eq!(choice["finish_reason"], "length");

    let cases = [
        (json!({"prompt": "a", "suffix": "b"}), "suffix"),
        (json!({"prompt": "a", "best_of": 2}), "best_of"),
        (json!({"prompt": "a", "echo": true, "logprobs": 1}), "echo"),
        (json!({"prompt": ["a", "b"]}), "prompt"),
        (json!({"prompt": []}), "prompt"),
        (json!({"prompt": [1, 999]}), "prompt"),
        (json!({"prompt": "a", "logprobs": 21}), "logprobs"),
        (json!({"prompt": "a", "n": 0}), "n"),
        (json!({"prompt": "a", "max_tokens": 0}), "max_tokens"),
        (json!({"prompt": "a", "temperature": 9}), "temperature"),
        (json!({"prompt": "a", "max_tokens": 100000}), "prompt"),
    ];
    for (body, param) in cases {
        let (status, text) = complete(&gateway.url, body.clone()).await;
        assert_eq!(status, 400, "{body} -> {text}");
        assert_eq!(serde_json::from_str::<Value>(&text).unwrap()["error"]["param"], param, "{body} -> {text}");
    }
}

#[tokio::test]
async fn a_tool_conversation_is_accepted_and_plain_text_stays_content() {
    let verifier = start_verifier(fake_scorer(), &[]).await;
    let gateway = start_gateway(&verifier.url, &[]).await;
    let call = json!({"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\"x\": 1}"}});
    let body = json!({
        "temperature": 0,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "parallel_tool_calls": false,
        "messages": [
            {"role": "user", "content": "call f"},
            {"role": "assistant", "content": null, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "42"}
        ]
    });
    let (status, _, text) = chat(&gateway.url, body).await;
    assert_eq!(status, 200, "{text}");
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["choices"][0]["message"]["content"], SCRIPT);
    assert!(v["choices"][0]["message"].get("tool_calls").is_none(), "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
}

#[tokio::test]
async fn the_binary_wire_is_the_default_and_answers_like_json() {
    let verifier = start_verifier(fake_scorer(), &[]).await;
    let mut answers = Vec::new();
    for wire in ["binary", "json"] {
        let gateway = start_gateway(&verifier.url, &["--draft-len", "3", "--verify-wire", wire]).await;
        let (status, _, body) = chat(&gateway.url, hello(json!({}))).await;
        assert_eq!(status, 200, "{body}");
        answers.push(serde_json::from_str::<Value>(&body).unwrap());
    }
    assert_eq!(answers[0]["choices"], answers[1]["choices"]);
    let sent = |v: &Value| v["usage"]["spade"]["bytes_sent"].as_u64().unwrap() + v["usage"]["spade"]["bytes_received"].as_u64().unwrap();
    assert!(sent(&answers[0]) * 3 < sent(&answers[1]), "binary {} bytes vs JSON {}", sent(&answers[0]), sent(&answers[1]));
}

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
        (hello(json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}})), "response_format.json_schema.name"),
        (hello(json!({"tool_choice": "required"})), "tool_choice"),
        (
            hello(json!({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}})),
            "tool_choice.function.name",
        ),
        (hello(json!({"tools": {"type": "function"}})), "tools"),
        (hello(json!({"tools": [{"type": "function", "function": {"description": "no name"}}]})), "tools[0]"),
        (hello(json!({"tools": [{"type": "retrieval", "function": {"name": "f"}}]})), "tools[0].type"),
        (hello(json!({"tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]})), "tools[1].function.name"),
        (hello(json!({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"})), "tool_choice"),
        (
            hello(json!({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "f"}}})),
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
        (json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}), "messages[0].content[0].type"),
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
    let r = client().post(format!("{}/v1/chat/completions", gateway.url)).header("content-type", "application/json").body("{nope").send().await.unwrap();
    assert_eq!(r.status(), 400);
    assert_eq!(r.json::<Value>().await.unwrap()["error"]["code"], "invalid_json");
    let (status, _, _) = chat(&gateway.url, json!({"messages": "hi"})).await;
    assert_eq!(status, 400);
    let r = client().post(format!("{}/v1/chat/completions", gateway.url)).body("{}").send().await.unwrap();
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
    let (status, _, body) = chat(&gateway.url, json!({"messages": [{"role": "user", "content": "x".repeat(5000)}]})).await;
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
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["error"]["code"], "verifier_unavailable");
    let r = client().get(format!("{}/health", gateway.url)).send().await.unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(r.json::<Value>().await.unwrap()["status"], "verifier_unreachable");
}

#[tokio::test]
async fn offline_fallback_answers_from_the_draft_and_says_so() {
    let dead = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", l.local_addr().unwrap())
    };
    let gateway = start_gateway(&dead, &["--offline-fallback", "draft", "--verify-retries", "0"]).await;
    let (status, _, body) = chat(&gateway.url, hello(json!({"max_tokens": 8}))).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["usage"]["spade"]["degraded"], true);
    assert_eq!(v["usage"]["spade"]["verify_calls"], 0);
    // The fake draft's own text: wrong every fourth byte (position 11 breaks the é).
    assert_eq!(v["choices"][0]["message"]["content"], "H?\u{FFFD}ll? w");
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
    let mut response = client().post(format!("{}/v1/chat/completions", gateway.url)).json(&hello(json!({"stream": true}))).send().await.unwrap();
    // Read two chunks (role, first text), then hang up.
    response.chunk().await.unwrap();
    response.chunk().await.unwrap();
    drop(response);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let after_drop = calls.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(calls.load(Ordering::SeqCst), after_drop, "verify calls continued after the client left");
    // The whole script would have needed about 25 calls at two tokens each.
    assert!(after_drop < 10, "{after_drop} calls");
}

#[tokio::test]
async fn api_key_guards_everything_but_health() {
    let verifier = start_verifier(fake_scorer(), &[]).await;
    let gateway = start_gateway(&verifier.url, &["--api-key", "gkey"]).await;
    let (status, _, body) = chat(&gateway.url, hello(json!({}))).await;
    assert_eq!(status, 401);
    assert_eq!(serde_json::from_str::<Value>(&body).unwrap()["error"]["type"], "authentication_error");
    let r = client().post(format!("{}/v1/chat/completions", gateway.url)).bearer_auth("gkey").json(&hello(json!({"max_tokens": 2}))).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let r = client().get(format!("{}/v1/models", gateway.url)).bearer_auth("gkey").send().await.unwrap();
    assert_eq!(r.json::<Value>().await.unwrap()["data"][0]["id"], "spade");
    let r = client().get(format!("{}/health", gateway.url)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["status"], "ready");
    let r = client().get(format!("{}/metrics", gateway.url)).bearer_auth("gkey").send().await.unwrap();
    let text = r.text().await.unwrap();
    // The refused request never reached the handler.
    assert!(text.contains("spade_gateway_requests_total 1\n"), "{text}");
    assert!(text.contains("spade_gateway_verify_calls_total"));
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
