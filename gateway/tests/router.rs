//! The gateway over real HTTP against the real verifier router, both with small deterministic
//! engines (tests/common): framing, stop sequences, accounting, sampling and the wire. Refused
//! requests, faults and auth are in tests/router_errors.rs; the real models are exercised end to
//! end in tests/e2e.rs.

mod common;

use std::time::Duration;

use common::*;
use serde_json::{json, Value};

/// Concatenated content, finish reason, the parsed chunks.
fn read_stream(body: &str) -> (String, Option<String>, Vec<Value>) {
    let data = sse_data(body);
    assert_eq!(data.iter().filter(|d| *d == "[DONE]").count(), 1, "exactly one [DONE]: {body}");
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"), "[DONE] comes last");
    let chunks: Vec<Value> =
        data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
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
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        usage["prompt_tokens"].as_u64().unwrap() + completion
    );
    let calls = usage["spade"]["verify_calls"].as_u64().unwrap();
    let spade = |field: &str| usage["spade"][field].as_u64().unwrap();
    // Drafts from the model and from prompt lookup; no `prediction`, so OpenAI's counts are 0.
    let accepted = spade("draft_accepted") + spade("looked_up_accepted");
    let rejected = spade("drafted") - spade("draft_accepted");
    let details = &usage["completion_tokens_details"];
    assert_eq!(
        (
            details["accepted_prediction_tokens"].as_u64(),
            details["rejected_prediction_tokens"].as_u64()
        ),
        (Some(0), Some(0))
    );
    assert!(calls < completion, "speculation saves calls: {calls} calls for {completion} tokens");
    // Each call commits its accepted drafts plus one token; only a token after an accepted
    // end-of-sequence draft goes unused.
    assert!(
        completion <= accepted + calls && accepted + calls <= completion + 1,
        "{accepted} + {calls} vs {completion}"
    );
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
    let (_, _, body) = chat(
        &gateway.url,
        hello(json!({"stream": true, "stream_options": {"include_usage": true}, "max_tokens": 5})),
    )
    .await;
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
    for (stop, expected) in [
        (json!("wörld"), "Héllo "),
        (json!(["xyz", "🎉"]), "Héllo wörld! "),
        (json!(["of the", "END"]), "Héllo wörld! 🎉 日本語 "),
    ] {
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
    let (status, _, body) =
        chat(&gateway.url, hello(json!({"logprobs": true, "top_logprobs": 2, "max_tokens": 6})))
            .await;
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
    let text = |s: &str| {
        serde_json::from_str::<Value>(s).unwrap()["choices"][0]["message"]["content"].clone()
    };
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
    assert_eq!(
        choices.iter().map(|c| c["index"].as_u64().unwrap()).collect::<Vec<_>>(),
        vec![0, 1, 2]
    );
    assert!(
        choices.iter().all(|c| c["message"]["content"] == SCRIPT),
        "greedy choices are the target's answer: {v}"
    );
    let (_, _, one) = chat(&gateway.url, hello(json!({}))).await;
    let one: Value = serde_json::from_str(&one).unwrap();
    assert_eq!(
        v["usage"]["completion_tokens"],
        one["usage"]["completion_tokens"].as_u64().unwrap() * 3
    );
    assert_eq!(v["usage"]["prompt_tokens"], one["usage"]["prompt_tokens"]);
    assert_eq!(
        v["usage"]["spade"]["verify_calls"],
        one["usage"]["spade"]["verify_calls"].as_u64().unwrap() * 3
    );

    // Streamed: each index gets its role, its text and its finish; one usage chunk and one [DONE] at the end.
    let (_, _, body) = chat(
        &gateway.url,
        hello(json!({"n": 2, "stream": true, "stream_options": {"include_usage": true}})),
    )
    .await;
    let data = sse_data(&body);
    assert_eq!(data.iter().filter(|d| *d == "[DONE]").count(), 1);
    let chunks: Vec<Value> =
        data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    for index in 0..2 {
        let mine: Vec<&Value> = chunks
            .iter()
            .filter(|c| c["choices"].get(0).is_some_and(|ch| ch["index"] == index))
            .collect();
        assert_eq!(mine[0]["choices"][0]["delta"]["role"], "assistant");
        let text: String =
            mine.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
        assert_eq!(text, SCRIPT, "choice {index}");
        assert_eq!(mine.iter().filter(|c| !c["choices"][0]["finish_reason"].is_null()).count(), 1);
    }
    assert_eq!(
        chunks.last().unwrap()["usage"]["completion_tokens"],
        one["usage"]["completion_tokens"].as_u64().unwrap() * 2
    );

    // Sampled with a seed: the choices differ from each other, and the request reproduces.
    let sampled = hello(json!({"n": 3, "temperature": 1.0, "seed": 11, "max_tokens": 40}));
    let texts = |body: &str| -> Vec<Value> {
        serde_json::from_str::<Value>(body).unwrap()["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["message"]["content"].clone())
            .collect()
    };
    let (a, b) = (
        texts(&chat(&gateway.url, sampled.clone()).await.2),
        texts(&chat(&gateway.url, sampled).await.2),
    );
    assert_eq!(a, b, "a seeded request with n = 3 reproduces");
    assert!(a[0] != a[1] && a[1] != a[2], "choices should be independent samples: {a:?}");
}

#[tokio::test]
async fn finished_generations_free_their_verifier_session() {
    let verifier = start_verifier(fake_scorer(), &[]).await;
    let gateway = start_gateway(&verifier.url, &[]).await;
    for stream in [false, true] {
        let (status, _, _) =
            chat(&gateway.url, hello(json!({"stream": stream, "max_tokens": 6}))).await;
        assert_eq!(status, 200);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let metrics = client()
        .get(format!("{}/metrics", verifier.url))
        .bearer_auth("vkey")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
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
        let body = hello(
            json!({"temperature": 0, "logit_bias": {ban.clone(): -100}, "presence_penalty": 0.5, "spade": {"draft_len": draft_len}}),
        );
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
    let allowed = |r: &reqwest::Response| {
        r.headers().get("access-control-allow-origin").map(|v| v.to_str().unwrap().to_string())
    };

    let closed = start_gateway(&verifier.url, &[]).await;
    assert_eq!(allowed(&preflight(&closed.url, "https://app.example").await.unwrap()), None);

    let open = start_gateway(
        &verifier.url,
        &["--cors-allow-origin", "https://app.example,http://localhost:5173", "--api-key", "gk"],
    )
    .await;
    // The preflight carries no credentials, so it is answered before authentication.
    let r = preflight(&open.url, "https://app.example").await.unwrap();
    assert!(r.status().is_success(), "{}", r.status());
    assert_eq!(allowed(&r).as_deref(), Some("https://app.example"));
    let headers = r.headers()["access-control-allow-headers"].to_str().unwrap().to_lowercase();
    assert!(headers.contains("x-stainless-os") && headers.contains("authorization"), "{headers}");
    assert_eq!(allowed(&preflight(&open.url, "https://evil.example").await.unwrap()), None);
    // The request itself still needs the key, and its answer names the origin.
    let r = client()
        .post(format!("{}/v1/chat/completions", open.url))
        .header("origin", "http://localhost:5173")
        .json(&hello(json!({})))
        .send()
        .await
        .unwrap();
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
    let (status, body) =
        complete(&gateway.url, json!({"prompt": [1], "temperature": 0, "max_tokens": 100})).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        (v["object"].as_str(), v["choices"][0]["text"].as_str()),
        (Some("text_completion"), Some(SCRIPT))
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(v["usage"]["prompt_tokens"], 1);

    // Streamed, echoed, with usage: the echo comes first, then the same text.
    let body = json!({"prompt": [[1]], "temperature": 0, "stream": true, "echo": true, "stream_options": {"include_usage": true}});
    let r =
        client().post(format!("{}/v1/completions", gateway.url)).json(&body).send().await.unwrap();
    let data = sse_data(&r.text().await.unwrap());
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> =
        data[..data.len() - 1].iter().map(|d| serde_json::from_str(d).unwrap()).collect();
    assert!(chunks.iter().all(|c| c["object"] == "text_completion"), "{chunks:?}");
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0))
        .filter_map(|c| c["text"].as_str())
        .collect();
    assert_eq!(text, format!("\u{1}{SCRIPT}"));
    assert_eq!(chunks[chunks.len() - 2]["choices"][0]["finish_reason"], "stop");
    assert_eq!(chunks.last().unwrap()["choices"], json!([]));
    assert_eq!(
        chunks.last().unwrap()["usage"]["completion_tokens"],
        v["usage"]["completion_tokens"]
    );

    // A text prompt is tokenised without a template; legacy logprobs line up with the text.
    let (status, body) = complete(
        &gateway.url,
        json!({"prompt": "abc", "temperature": 0, "max_tokens": 4, "logprobs": 2}),
    )
    .await;
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
        assert_eq!(
            serde_json::from_str::<Value>(&text).unwrap()["error"]["param"],
            param,
            "{body} -> {text}"
        );
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
        let gateway =
            start_gateway(&verifier.url, &["--draft-len", "3", "--verify-wire", wire]).await;
        let (status, _, body) = chat(&gateway.url, hello(json!({}))).await;
        assert_eq!(status, 200, "{body}");
        answers.push(serde_json::from_str::<Value>(&body).unwrap());
    }
    assert_eq!(answers[0]["choices"], answers[1]["choices"]);
    let sent = |v: &Value| {
        v["usage"]["spade"]["bytes_sent"].as_u64().unwrap()
            + v["usage"]["spade"]["bytes_received"].as_u64().unwrap()
    };
    assert!(
        sent(&answers[0]) * 3 < sent(&answers[1]),
        "binary {} bytes vs JSON {}",
        sent(&answers[0]),
        sent(&answers[1])
    );
}
