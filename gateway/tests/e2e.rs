//! The real binaries with a real model over real HTTP: spade-verifier and spade-gateway as child
//! processes (SmolLM2 drafting for itself), compared with target-only greedy decoding in-process.
//! Streamed and non-streamed answers, stop sequences across chunks, the verifier killed mid-stream
//! (error event, or the degraded path), and a client hanging up.

mod real;

use std::time::{Duration, Instant};

use real::*;
use serde_json::{json, Value};

const PROMPTS: [&str; 3] = [
    "Write one sentence about the sea.",
    "List three colours.",
    "What is 12 times 12? Explain briefly.",
];
const MAX_TOKENS: usize = 40;

fn req(prompt: &str, extra: Value) -> Value {
    request(prompt, MAX_TOKENS, extra)
}

async fn verify_calls(verifier: &str) -> u64 {
    metric(verifier, "spade_verify_calls_total").await as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_and_plain_answers_equal_target_only_greedy() {
    let expected = reference(&PROMPTS, MAX_TOKENS).await;
    let verifier = start_verifier().await;
    let gateway = start_gateway(&verifier.url, &["--draft-len", "4"]).await;
    for (prompt, expected) in PROMPTS.iter().zip(&expected) {
        let plain = complete(&gateway.url, &req(prompt, json!({}))).await;
        assert_eq!(
            plain["choices"][0]["message"]["content"].as_str().unwrap(),
            expected,
            "non-streamed vs target-only: {prompt}"
        );
        let spade = &plain["usage"]["spade"];
        assert!(
            spade["verify_calls"].as_u64().unwrap()
                < plain["usage"]["completion_tokens"].as_u64().unwrap(),
            "{spade}"
        );
        let streamed = stream(&gateway.url, &req(prompt, json!({"stream": true}))).await;
        assert_eq!(&streamed.text, expected, "streamed vs target-only: {prompt}");
        assert_eq!(streamed.finish.as_deref(), plain["choices"][0]["finish_reason"].as_str());
        assert_eq!(streamed.end, Ok(()));
    }

    // The default, `auto` with draft-ahead, and per-request lengths (0 = target-only) give the same text.
    let auto = start_gateway(&verifier.url, &[]).await;
    for (prompt, expected) in PROMPTS.iter().zip(&expected) {
        for draft_len in [json!("auto"), json!(0), json!(2)] {
            let plain =
                complete(&auto.url, &req(prompt, json!({"spade": {"draft_len": draft_len}}))).await;
            assert_eq!(content(&plain), expected, "draft_len {draft_len}: {prompt}");
            assert_eq!(plain["usage"]["spade"]["draft_len"], draft_len, "{plain}");
        }
    }

    // Sampling with the API defaults (temperature 1, no truncation): the draft's q is capped, so
    // each call stays small on the wire.
    let sampled =
        complete(&gateway.url, &req(PROMPTS[1], json!({"temperature": 1.0, "seed": 3}))).await;
    let spade = &sampled["usage"]["spade"];
    let per_call = spade["bytes_sent"].as_u64().unwrap() / spade["verify_calls"].as_u64().unwrap();
    assert!(per_call < 8 * 1024, "{per_call} bytes per verify call: {spade}");

    // A stop sequence from the middle of the answer, spanning several tokens and so several chunks.
    let text = &expected[0];
    let words: Vec<&str> = text.split(' ').collect();
    assert!(words.len() > 5, "the reference answer is too short to cut: {text:?}");
    let stop = format!("{} {}", words[3], words[4]);
    let cut = &text[..text.find(&stop).unwrap()];
    let streamed =
        stream(&gateway.url, &req(PROMPTS[0], json!({"stream": true, "stop": [stop.clone()]})))
            .await;
    assert_eq!(streamed.text, cut, "stop {stop:?}");
    assert_eq!(streamed.finish.as_deref(), Some("stop"));
    let plain = complete(&gateway.url, &req(PROMPTS[0], json!({"stop": stop}))).await;
    assert_eq!(plain["choices"][0]["message"]["content"].as_str().unwrap(), cut);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn penalties_and_bias_over_http_equal_target_only_greedy_under_them() {
    let verifier = start_verifier().await;
    let gateway = start_gateway(&verifier.url, &["--draft-len", "4"]).await;
    // " the" (a frequent word) banned, and repetition discouraged.
    let the = reqwest::Client::new()
        .post(format!("{}/tokenize", gateway.url))
        .json(&json!({"prompt": " the", "add_special_tokens": false}))
        .send()
        .await
        .unwrap();
    let bias = the.json::<Value>().await.unwrap()["tokens"][0].as_u64().unwrap() as u32;
    let penalties = spade_core::Penalties {
        presence_penalty: 0.6,
        frequency_penalty: 0.4,
        repetition_penalty: 1.2,
        logit_bias: [(bias, -100.0)].into(),
        prompt_len: 0,
    };
    let expected = reference_with(&PROMPTS, MAX_TOKENS, Some(penalties)).await;
    assert_ne!(
        expected,
        reference(&PROMPTS, MAX_TOKENS).await,
        "the penalties should change the answers"
    );
    let extra = json!({"presence_penalty": 0.6, "frequency_penalty": 0.4, "repetition_penalty": 1.2, "logit_bias": {bias.to_string(): -100}});
    for (prompt, expected) in PROMPTS.iter().zip(&expected) {
        let plain = complete(&gateway.url, &req(prompt, extra.clone())).await;
        assert_eq!(content(&plain), expected, "non-streamed: {prompt}");
        let mut streamed_extra = extra.clone();
        streamed_extra["stream"] = json!(true);
        streamed_extra["spade"] = json!({"draft_len": "auto"});
        let streamed = stream(&gateway.url, &req(prompt, streamed_extra)).await;
        assert_eq!(&streamed.text, expected, "streamed, auto: {prompt}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn structured_outputs_over_http_equal_target_only_greedy_under_the_schema() {
    let schema = json!({
        "type": "object",
        "properties": {"answer": {"type": "integer"}, "sure": {"type": "boolean"}},
        "required": ["answer", "sure"],
        "additionalProperties": false,
    });
    let prompts = ["What is 12 times 12? Answer in JSON.", "How many legs has a spider?"];
    let grammar = spade_core::grammar::GrammarConstraint::json_schema(schema.clone(), 0).grammar;
    let expected = reference_constrained(&prompts, MAX_TOKENS, &grammar).await;
    assert_ne!(
        expected,
        reference(&prompts, MAX_TOKENS).await,
        "the schema should change the answers"
    );
    let verifier = start_verifier().await;
    let gateway = start_gateway(&verifier.url, &["--draft-len", "4"]).await;
    let format = json!({"type": "json_schema", "json_schema": {"name": "reply", "strict": true, "schema": schema}});
    for (prompt, expected) in prompts.iter().zip(&expected) {
        let plain = complete(&gateway.url, &req(prompt, json!({"response_format": format}))).await;
        assert_eq!(content(&plain), expected, "non-streamed: {prompt}");
        let streamed = stream(
            &gateway.url,
            &req(
                prompt,
                json!({"response_format": format, "stream": true, "spade": {"draft_len": "auto"}}),
            ),
        )
        .await;
        assert_eq!(&streamed.text, expected, "streamed, auto: {prompt}");
        if plain["choices"][0]["finish_reason"] == "stop" {
            let v: Value =
                serde_json::from_str(expected).unwrap_or_else(|e| panic!("{expected:?}: {e}"));
            assert!(
                v["answer"].is_i64() && v["sure"].is_boolean() && v.as_object().unwrap().len() == 2,
                "{v}"
            );
        }
    }
    // A schema llguidance cannot compile is a named 400, before anything runs.
    let bad = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}});
    let (status, v) = post(&gateway.url, &req(prompts[0], json!({"response_format": bad}))).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(
        (v["error"]["param"].as_str(), v["error"]["code"].as_str()),
        (Some("response_format"), Some("invalid_grammar")),
        "{v}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_target_with_padding_rows_the_draft_lacks_is_accepted_and_answers_as_target_only() {
    // SmolLM2 padded with 64 unused rows, as llama.cpp pads Qwen2.5's larger models.
    let padded =
        spade_test_support::models::padded_copy(&spade_test_support::models::tiny(), 64, 0);
    let verifier = start_verifier_on(0, &["--model", padded.to_str().unwrap()]).await;
    let gateway = start_gateway(&verifier.url, &["--draft-len", "4"]).await;
    let expected = reference(&PROMPTS[..1], MAX_TOKENS).await;
    let plain = complete(&gateway.url, &req(PROMPTS[0], json!({}))).await;
    assert_eq!(content(&plain), expected[0]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn legacy_completions_equal_target_only_greedy_on_the_raw_prompt() {
    const RAW: [&str; 2] = ["The sea is", "def fibonacci(n):"];
    let expected = reference_raw(&RAW, MAX_TOKENS).await;
    assert!(
        expected.iter().all(|e| e.len() > 20),
        "the references are too short to compare: {expected:?}"
    );
    let verifier = start_verifier().await;
    let gateway = start_gateway(&verifier.url, &["--draft-len", "4"]).await;
    let client = reqwest::Client::new();
    for (prompt, expected) in RAW.iter().zip(&expected) {
        let body = json!({"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0});
        let r = client
            .post(format!("{}/v1/completions", gateway.url))
            .json(&body)
            .send()
            .await
            .unwrap();
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["choices"][0]["text"].as_str(), Some(expected.as_str()), "{prompt}: {v}");
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let text = client
            .post(format!("{}/v1/completions", gateway.url))
            .json(&streamed)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let pieces: String = text
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .filter_map(|d| {
                serde_json::from_str::<Value>(d).unwrap()["choices"][0]["text"]
                    .as_str()
                    .map(str::to_string)
            })
            .collect();
        assert_eq!(&pieces, expected, "streamed: {prompt}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seeded_choices_are_distinct_and_reproduce() {
    let verifier = start_verifier().await;
    let gateway = start_gateway(&verifier.url, &[]).await;
    let body = req(PROMPTS[0], json!({"n": 3, "temperature": 1.0, "seed": 5}));
    let texts = |v: &Value| -> Vec<String> {
        v["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["message"]["content"].as_str().unwrap().to_string())
            .collect()
    };
    let a = texts(&complete(&gateway.url, &body).await);
    let b = texts(&complete(&gateway.url, &body).await);
    assert_eq!(a, b, "a seeded request with n = 3 reproduces");
    assert!(a[0] != a[1] && a[1] != a[2] && a[0] != a[2], "choices are independent samples: {a:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_stops_verify_calls() {
    let verifier = start_verifier().await;
    let gateway = start_gateway(&verifier.url, &["--draft-len", "1"]).await;
    let body =
        req("Tell me a long story about a dragon.", json!({"stream": true, "max_tokens": 400}));
    let mut r = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", gateway.url))
        .json(&body)
        .send()
        .await
        .unwrap();
    let mut seen = 0;
    while seen < 4 {
        r.chunk().await.unwrap().expect("stream ended early");
        seen += 1;
    }
    drop(r);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = verify_calls(&verifier.url).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let later = verify_calls(&verifier.url).await;
    report(
        "faults",
        "client disconnects mid-stream",
        &format!("verify calls {after} at +0.5 s, {later} at +2.5 s"),
        later == after,
    );
    assert_eq!(later, after, "verify calls went on after the client left");
    assert!(after < 100, "{after} calls: the generation was not cut short");
    // The draft engine survived the abandoned draft: the next request is served normally.
    let plain = complete(&gateway.url, &req(PROMPTS[1], json!({"max_tokens": 8}))).await;
    assert_eq!(plain["usage"]["completion_tokens"], 8, "{plain}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verifier_killed_mid_stream_ends_with_an_error_or_degrades() {
    for fallback in ["off", "draft"] {
        let mut verifier = start_verifier().await;
        let gateway = start_gateway(&verifier.url, &["--offline-fallback", fallback]).await;
        let body = req(
            "Tell me a long story about a dragon.",
            json!({"stream": true, "max_tokens": 64, "stream_options": {"include_usage": true}}),
        );
        let mut r = reqwest::Client::new()
            .post(format!("{}/v1/chat/completions", gateway.url))
            .json(&body)
            .send()
            .await
            .unwrap();
        let mut text = String::from_utf8(r.chunk().await.unwrap().unwrap().to_vec()).unwrap();
        verifier.child.kill().unwrap();
        verifier.child.wait().unwrap();
        let started = Instant::now();
        while let Some(chunk) = tokio::time::timeout(Duration::from_secs(60), r.chunk())
            .await
            .expect("the stream hung")
            .unwrap()
        {
            text.push_str(&String::from_utf8_lossy(&chunk));
        }
        assert!(started.elapsed() < Duration::from_secs(120));
        let data: Vec<&str> = text
            .split("\n\n")
            .filter_map(|e| e.lines().find_map(|l| l.strip_prefix("data: ")))
            .collect();
        let last = data.last().copied().unwrap_or("");
        let pass = if fallback == "off" {
            let last: Value = serde_json::from_str(last).unwrap_or(Value::Null);
            last["error"]["code"] == "verifier_unavailable" && !data.contains(&"[DONE]")
        } else {
            let usage: Value = data
                .len()
                .checked_sub(2)
                .and_then(|i| serde_json::from_str(data[i]).ok())
                .unwrap_or(Value::Null);
            last == "[DONE]" && usage["usage"]["spade"]["degraded"] == true
        };
        let case = format!("verifier killed mid-stream, --offline-fallback {fallback}");
        report(
            "faults",
            &case,
            &format!(
                "stream ended {} ms after the kill with: {}",
                started.elapsed().as_millis(),
                last.chars().take(160).collect::<String>()
            ),
            pass,
        );
        assert!(pass, "{text}");
    }
}

/// `spade.draft_len` per request: 0 is target-only (one verify call per token), a number is used as is,
/// `auto` starts from the verifier's own pass times and reports its choice; out-of-range and malformed
/// values are refused by name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_request_draft_len_is_honoured_and_checked() {
    let verifier = start_verifier_on(0, &["--max-draft", "6"]).await;
    let gateway = start_gateway(&verifier.url, &["--max-draft-len", "8"]).await;
    // The verifier timed blocks of 1..=7 rows (--max-draft 6 caps the default 9); before any request the
    // gateway's cost model is their least-squares line, which passes through their mean at 4 rows
    // (unless its intercept came out negative and was clamped to 0).
    let info: Value = reqwest::Client::new()
        .get(format!("{}/v1/info", verifier.url))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let pass_s: Vec<f64> =
        info["pass_ms"].as_array().unwrap().iter().map(|ms| ms.as_f64().unwrap() / 1e3).collect();
    assert!(pass_s.len() == 7 && pass_s.iter().all(|&s| s > 0.0 && s < 10.0), "{info}");
    let (a, b) = (
        metric(&gateway.url, "spade_gateway_auto_verify_base_seconds").await,
        metric(&gateway.url, "spade_gateway_auto_verify_row_seconds").await,
    );
    let mean = pass_s.iter().sum::<f64>() / 7.0;
    assert!(a == 0.0 || (a + 4.0 * b - mean).abs() < 1e-6, "a {a}, b {b}, pass times {pass_s:?}");
    assert!((b - 0.008).abs() > 1e-9, "b is still the prior: {b}");
    let ask = |draft_len: Value| {
        req(PROMPTS[0], json!({"max_tokens": 24, "spade": {"draft_len": draft_len}}))
    };
    let target_only = complete(&gateway.url, &ask(json!(0))).await;
    let spade = &target_only["usage"]["spade"];
    assert_eq!(spade["verify_calls"], target_only["usage"]["completion_tokens"], "{spade}");
    assert_eq!(target_only["usage"]["completion_tokens_details"]["accepted_prediction_tokens"], 0);
    let fixed = complete(&gateway.url, &ask(json!(3))).await;
    assert_eq!(content(&fixed), content(&target_only));
    assert!(
        fixed["usage"]["spade"]["verify_calls"].as_u64() < spade["verify_calls"].as_u64(),
        "{}",
        fixed["usage"]
    );
    let auto = complete(&gateway.url, &ask(json!("auto"))).await;
    assert_eq!(content(&auto), content(&target_only));
    let choice = &auto["usage"]["spade"]["auto"];
    assert!(
        choice["draft"].as_u64().is_some_and(|d| d <= 6) && choice["rtt_s"].is_number(),
        "{choice}"
    );
    // The verifier's --max-draft 6 caps what a request may ask, below the gateway's --max-draft-len 8.
    for bad in [json!(7), json!(-1), json!("fast"), json!(2.5)] {
        let (status, body) = post(&gateway.url, &ask(bad.clone())).await;
        assert_eq!(status, 400, "{bad}: {body}");
        assert!(
            body["error"]["message"].as_str().unwrap_or_default().contains("draft_len"),
            "{bad}: {body}"
        );
    }
    let (_, body) = post(&gateway.url, &ask(json!(7))).await;
    assert_eq!(body["error"]["param"], "spade.draft_len", "{body}");
}

/// A gateway drafting more tokens per call than the verifier accepts is not ready, and says why,
/// instead of failing every request with the verifier's 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn draft_len_over_the_verifiers_max_draft_is_not_ready() {
    let verifier = start_verifier_on(0, &["--max-draft", "2"]).await;
    let gateway = spawn_gateway(&verifier.url, &["--draft-len", "4"], false).await;
    let deadline = Instant::now() + Duration::from_secs(180);
    let (status, body) = loop {
        let (status, body) = health(&gateway.url).await;
        if status != 0 && body["status"] != "loading" {
            break (status, body);
        }
        assert!(Instant::now() < deadline, "the gateway never finished loading: {body}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["status"], "verifier_mismatch", "{body}");
    let detail = body["detail"].as_str().unwrap_or_default();
    assert!(
        detail.contains("--draft-len")
            && detail.contains("--max-draft")
            && detail.contains("at most 2"),
        "{detail}"
    );
    // Within the limit, the same pair is ready.
    let fitting = start_gateway(&verifier.url, &["--draft-len", "2"]).await;
    assert_eq!(health(&fitting.url).await.0, 200);
}

/// vLLM's `/tokenize` and `/detokenize` with the real tokenizer: chat messages count exactly the
/// completion's prompt tokens, a prompt round-trips, and bad input gets a named 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_and_detokenize_match_the_model() {
    let verifier = start_verifier().await;
    let gateway = start_gateway(&verifier.url, &[]).await;
    let call = |path: &str, body: Value| {
        let url = format!("{}{path}", gateway.url);
        async move {
            let r = reqwest::Client::new().post(url).json(&body).send().await.unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    let messages = json!([{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPTS[2]}]);
    let (status, counted) =
        call("/tokenize", json!({"model": "spade", "messages": messages})).await;
    assert_eq!(status, 200, "{counted}");
    let answer =
        complete(&gateway.url, &json!({"messages": messages, "max_tokens": 2, "temperature": 0}))
            .await;
    assert_eq!(
        counted["count"], answer["usage"]["prompt_tokens"],
        "{counted} vs {}",
        answer["usage"]
    );
    assert!(counted["max_model_len"].as_u64().is_some_and(|n| n >= 2048), "{counted}");
    assert!(counted.get("token_strs").is_none(), "{counted}");

    let text = "Héllo wörld: fn main() { println!(\"🎉\"); }";
    let (status, tokens) =
        call("/tokenize", json!({"prompt": text, "return_token_strs": true})).await;
    assert_eq!(status, 200, "{tokens}");
    let ids = tokens["tokens"].as_array().unwrap();
    assert_eq!(tokens["count"].as_u64(), Some(ids.len() as u64));
    assert!(ids.len() > 5 && ids.len() < text.len(), "{tokens}");
    assert_eq!(tokens["token_strs"].as_array().map(Vec::len), Some(ids.len()), "{tokens}");
    let (status, back) = call("/detokenize", json!({"tokens": ids})).await;
    assert_eq!((status, back["prompt"].as_str()), (200, Some(text)), "{back}");
    // Special tokens are kept: the chat prompt's text shows the template's markers.
    let (_, chat_text) = call("/detokenize", json!({"tokens": counted["tokens"]})).await;
    assert!(
        chat_text["prompt"]
            .as_str()
            .is_some_and(|t| t.contains("<|im_start|>") && t.contains(PROMPTS[2])),
        "{chat_text}"
    );

    for (path, body, param) in [
        ("/tokenize", json!({}), "prompt"),
        ("/tokenize", json!({"prompt": "a", "messages": messages}), "messages"),
        ("/tokenize", json!({"messages": []}), "messages"),
        (
            "/tokenize",
            json!({"messages": messages, "add_generation_prompt": false}),
            "add_generation_prompt",
        ),
        ("/detokenize", json!({"tokens": [1, -5]}), "tokens"),
        ("/detokenize", json!({"tokens": [10_000_000]}), "tokens"),
    ] {
        let (status, error) = call(path, body.clone()).await;
        assert_eq!(
            (status, &error["error"]["param"]),
            (400, &json!(param)),
            "{path} {body}: {error}"
        );
    }
}
