//! What coding assistants send, over real HTTP with the real binaries, Qwen2.5-Coder-0.5B drafting
//! for itself (it has the FIM tokens; SmolLM2 has none):
//! - fill-in-the-middle: llama.vim's own request shapes get well-formed llama-server answers from
//!   `/infill`, and the middle is target-only's, the same through `/infill`, `/v1/completions` with
//!   `suffix`, streamed or not;
//! - an edit with `prediction` (the file, sent back with a change) and with prompt lookup alone:
//!   the answer is target-only's, and OpenAI's prediction counts say what the prediction did.

mod real;

use real::*;
use serde_json::{json, Value};
use spade_test_support::models::{model_path, DRAFT};

const PREFIX: &str = "def fibonacci(n):\n";
const LINE: &str = "    ";
const SUFFIX: &str = "\n\nprint(fibonacci(10))\n";

async fn post_to(url: &str, path: &str, body: &Value) -> (u16, String) {
    let r = reqwest::Client::new().post(format!("{url}{path}")).json(body).send().await.unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

async fn json_at(url: &str, path: &str, body: &Value) -> Value {
    let (status, text) = post_to(url, path, body).await;
    assert_eq!(status, 200, "{path}: {text}");
    serde_json::from_str(&text).unwrap()
}

/// The `/v1/completions` middle for the gap after PREFIX + LINE, with `draft_len`.
async fn completion_middle(url: &str, draft_len: Value) -> String {
    let body = json!({"prompt": format!("{PREFIX}{LINE}"), "suffix": SUFFIX, "max_tokens": 40,
        "temperature": 0, "spade": {"draft_len": draft_len}});
    let v = json_at(url, "/v1/completions", &body).await;
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn infill_answers_llama_vims_requests_with_the_targets_middle() {
    let model = model_path(DRAFT);
    let model = model.to_str().unwrap();
    let verifier = start_verifier_on(0, &["--model", model]).await;
    let gateway = start_gateway(&verifier.url, &["--draft-model", model]).await;
    let url = &gateway.url;

    // llama.vim's requests as its source writes them (autoload/llama.vim): the warm-up with new
    // context, then a completion (its sampling: top_k 40, top_p 0.90, its own sampler list).
    let extra = json!([{"filename": "util.py", "text": "def add(a, b):\n    return a + b\n"}]);
    let warm_up = json!({"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": extra,
        "prompt": "", "n_predict": 0, "temperature": 0.0, "samplers": [], "stream": false,
        "cache_prompt": true, "t_max_prompt_ms": 1, "t_max_predict_ms": 1, "response_fields": [""]});
    assert_eq!(json_at(url, "/infill", &warm_up).await, json!({}));
    let fields = [
        "content",
        "timings/prompt_n",
        "timings/prompt_ms",
        "timings/prompt_per_token_ms",
        "timings/prompt_per_second",
        "timings/predicted_n",
        "timings/predicted_ms",
        "timings/predicted_per_token_ms",
        "timings/predicted_per_second",
        "truncated",
        "tokens_cached",
    ];
    let fim = json!({"id_slot": 0, "input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": extra,
        "prompt": LINE, "n_predict": 128, "stop": [], "n_indent": 4, "top_k": 40, "top_p": 0.90,
        "samplers": ["top_k", "top_p", "infill"], "stream": false, "cache_prompt": true,
        "t_max_prompt_ms": 500, "t_max_predict_ms": 1000, "response_fields": fields});
    let v = json_at(url, "/infill", &fim).await;
    for field in fields {
        assert!(v.get(field).is_some(), "{field} missing: {v}");
    }
    assert!(v["timings/predicted_n"].as_u64().unwrap() >= 1, "{v}");
    assert_eq!(v["truncated"], false);
    let observed = format!(
        "warm-up {{}}; completion {:?} in {} tokens",
        v["content"], v["timings/predicted_n"]
    );
    report("api", "llama.vim's /infill requests (warm-up, completion)", &observed, true);

    // Greedy: the same middle as target-only, whichever way it is asked for.
    let target_only = completion_middle(url, json!(0)).await;
    assert!(!target_only.is_empty());
    assert_eq!(completion_middle(url, json!("auto")).await, target_only);
    let greedy = json!({"input_prefix": PREFIX, "prompt": LINE, "input_suffix": SUFFIX, "n_predict": 40,
        "temperature": 0});
    let v = json_at(url, "/infill", &greedy).await;
    assert_eq!(v["content"], target_only.as_str(), "{v}");
    assert_eq!((v["stop"].as_bool(), v["tokens_predicted"].as_u64()), (Some(true), Some(40)));
    assert_eq!(v["stop_type"], "limit");
    let mut streamed = greedy.clone();
    streamed["stream"] = json!(true);
    let (status, body) = post_to(url, "/infill", &streamed).await;
    assert_eq!(status, 200);
    let events: Vec<Value> = body
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let text: String = events.iter().map(|e| e["content"].as_str().unwrap()).collect();
    assert_eq!(text, target_only);
    let last = events.last().unwrap();
    assert_eq!((last["stop"].as_bool(), last["content"].as_str()), (Some(true), Some("")));
    assert!(events[..events.len() - 1].iter().all(|e| e["stop"] == false));

    // n_indent: the middle ends before the first line indented less (the blank line after the body).
    let mut indented = greedy.clone();
    indented["n_indent"] = json!(4);
    indented["n_predict"] = json!(128);
    let v = json_at(url, "/infill", &indented).await;
    let content = v["content"].as_str().unwrap();
    assert!(content.lines().skip(1).all(|l| l.starts_with("    ")), "{content:?}");
    report(
        "api",
        "/infill greedy = /v1/completions suffix = target-only (Qwen2.5-Coder-0.5B)",
        &format!(
            "{target_only:?}; streamed the same; n_indent 4: {content:?} ({})",
            v["stop_type"]
        ),
        true,
    );
}

const FILE: &str = "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n\n\ndef spread(values):\n    return max(values) - min(values)\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edit_with_a_prediction_or_lookup_is_target_onlys_answer() {
    let model = model_path(DRAFT);
    let model = model.to_str().unwrap();
    let verifier = start_verifier_on(0, &["--model", model]).await;
    let gateway = start_gateway(&verifier.url, &["--draft-model", model]).await;
    let url = &gateway.url;
    let ask = format!("Rename the function mean to average. Reply with the whole file, nothing else.\n\n```python\n{FILE}```");
    let chat = |extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": ask}], "temperature": 0, "max_tokens": 96});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        body
    };
    let answer = |v: &Value| v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let target_only =
        json_at(url, "/v1/chat/completions", &chat(json!({"spade": {"draft_len": 0}}))).await;
    let expected = answer(&target_only);
    assert_eq!(
        target_only["usage"]["spade"]["verify_calls"],
        target_only["usage"]["completion_tokens"]
    );

    let predicted = json_at(
        url,
        "/v1/chat/completions",
        &chat(json!({"prediction": {"type": "content", "content": FILE}})),
    )
    .await;
    assert_eq!(answer(&predicted), expected);
    let usage = &predicted["usage"];
    let details = &usage["completion_tokens_details"];
    let kept = details["accepted_prediction_tokens"].as_u64().unwrap();
    assert!(kept >= 20, "{usage}");
    // Text parts, streamed: the same answer.
    let parts = json!({"prediction": {"type": "content", "content": [{"type": "text", "text": FILE}]}, "stream": true});
    let (status, body) = post_to(url, "/v1/chat/completions", &chat(parts)).await;
    assert_eq!(status, 200);
    assert_eq!(parse_sse(status, &body).text, expected);

    // A fixed length: whether `auto` prefers copies to a draft model drafting for itself turns on
    // this host's timings, and this checks that lookup's blocks are sent and verified.
    let fixed = json!({"spade": {"draft_len": 2}});
    let looked_up = json_at(url, "/v1/chat/completions", &chat(fixed)).await;
    assert_eq!(answer(&looked_up), expected);
    let lookup_usage = &looked_up["usage"];
    assert_eq!(lookup_usage["completion_tokens_details"]["accepted_prediction_tokens"], 0);
    assert!(lookup_usage["spade"]["looked_up_accepted"].as_u64().unwrap() > 0, "{lookup_usage}");
    let off =
        json_at(url, "/v1/chat/completions", &chat(json!({"spade": {"lookup": false}}))).await;
    assert_eq!(answer(&off), expected);
    assert_eq!(off["usage"]["spade"]["looked_up"], 0);

    let calls = |v: &Value| v["usage"]["spade"]["verify_calls"].as_u64().unwrap();
    let observed = format!(
        "{} tokens: verify calls target-only {}, prediction {} ({kept} prediction tokens kept, {} rejected), lookup {} ({} of {} looked-up tokens accepted), neither {}",
        target_only["usage"]["completion_tokens"], calls(&target_only), calls(&predicted),
        details["rejected_prediction_tokens"], calls(&looked_up), lookup_usage["spade"]["looked_up_accepted"],
        lookup_usage["spade"]["looked_up"], calls(&off)
    );
    report(
        "api",
        "an edit with prediction / prompt lookup = target-only (Qwen2.5-Coder-0.5B)",
        &observed,
        true,
    );
    // The draft model drafts for itself here, so it is as good as any copy: speed is measured by
    // spade-bench, with the real pair.
}
