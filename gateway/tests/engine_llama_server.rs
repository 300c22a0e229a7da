//! Verification on a real serving engine: llama.cpp's `llama-server` (built from the registry's
//! llama.cpp source, serving the same GGUF), `spade-verifier --engine` over it, a gateway in front,
//! the Qwen2.5-Coder pair (0.5B drafting for 1.5B). Under the match rule:
//! - greedy answers are llama-server's own greedy generations, streamed or not;
//! - a seeded sampled answer is llama-server's own sampling with the same per-position seeds,
//!   whatever the draft length;
//! - the first drafted position follows llama-server's own distribution (chi-square);
//! - what an engine cannot apply to drafts is refused by name.

mod real;

use futures::StreamExt;
use real::*;
use serde_json::{json, Value};
use spade_core::position_seed;
use spade_test_support::chi_square_critical;
use spade_test_support::models::{llama_server, model_path, DRAFT, TARGET};

const PROMPTS: [&str; 12] = [
    "def fibonacci(n):",
    "import numpy as np\n\ndef normalize(v):",
    "// Rust: sum the even numbers of a slice\nfn sum_even(xs: &[i64]) -> i64 {",
    "SELECT name, COUNT(*) FROM orders",
    "The three laws of thermodynamics are",
    "class Stack:\n    def __init__(self):",
    "#include <stdio.h>\n\nint main(void) {",
    "Once upon a time, in a small village,",
    "const debounce = (fn, ms) => {",
    "# Binary search in Python\ndef binary_search(xs, target):",
    "Q: What is the capital of France?\nA:",
    "fn main() {\n    let v = vec![3, 1, 2];",
];

struct Stack {
    engine: Server,
    verifier: Server,
    gateway: Server,
}

/// llama-server on the target, the verifier over it, a gateway. `sequential` calls go to one slot,
/// where llama-server computes every token alone after the prompt, as its own generation does:
/// the same numerics, so the same tokens. `parallel` calls need a slot per position (one KV pool
/// shared by 6 slots), where a token's logits depend slightly on the other slots' cells: the answer
/// is then the engine's up to near-ties in its own numerics.
async fn stack(engine_calls: &str) -> Stack {
    let (target, draft) = (model_path(TARGET), model_path(DRAFT));
    let slots: &[&str] = match engine_calls {
        "sequential" => &["-np", "1", "-ub", "1"],
        _ => &["-np", "6", "-kvu"],
    };
    let mut args = vec!["-m", target.to_str().unwrap(), "-c", "4096", "--poll", "0"];
    args.extend_from_slice(slots);
    let engine = Server::spawn(&llama_server(), "llama-server", 0, &args, &[]);
    engine.wait_ready().await;
    let verifier = start_verifier_on(
        0,
        &[
            "--engine",
            &engine.url,
            "--engine-calls",
            engine_calls,
            "--model",
            target.to_str().unwrap(),
        ],
    )
    .await;
    let gateway = start_gateway(&verifier.url, &["--draft-model", draft.to_str().unwrap()]).await;
    Stack { engine, verifier, gateway }
}

async fn post_json(url: &str, body: &Value) -> (u16, Value) {
    let r = reqwest::Client::new().post(url).bearer_auth(KEY).json(body).send().await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

async fn ids(gateway: &str, prompt: &str) -> Vec<u64> {
    let (_, v) = post_json(&format!("{gateway}/tokenize"), &json!({"prompt": prompt})).await;
    v["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect()
}

/// llama-server's own generation after `prompt` ids: `n` tokens, token by token, each seeded as the
/// match rule seeds its position (greedy when `temperature` is 0). Stops after an end token.
async fn engine_tokens(
    engine: &str,
    prompt: &[u64],
    n: usize,
    temperature: f64,
    seed: u64,
) -> Vec<u64> {
    let mut ids = prompt.to_vec();
    let mut out = Vec::new();
    for _ in 0..n {
        let body = json!({"prompt": ids, "n_predict": 1, "temperature": temperature, "top_k": 0,
            "top_p": 1.0, "min_p": 0.0, "samplers": ["temperature", "top_k", "top_p", "min_p"],
            "seed": position_seed(seed, ids.len() as u64), "cache_prompt": true, "return_tokens": true});
        let (status, v) = post_json(&format!("{engine}/completion"), &body).await;
        assert_eq!(status, 200, "{v}");
        let token = v["tokens"][0].as_u64().unwrap();
        out.push(token);
        ids.push(token);
        if v["stop_type"] == "eos" || v["stop_type"] == "word" {
            break;
        }
    }
    out
}

async fn detokenize(engine: &str, tokens: &[u64]) -> String {
    let (_, v) = post_json(&format!("{engine}/detokenize"), &json!({"tokens": tokens})).await;
    v["content"].as_str().unwrap().to_string()
}

async fn completion(gateway: &str, body: Value) -> Value {
    let (status, v) = post_json(&format!("{gateway}/v1/completions"), &body).await;
    assert_eq!(status, 200, "{v}");
    v
}

fn text(v: &Value) -> String {
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_answers_are_llama_servers_own() {
    let s = stack("sequential").await;
    let info = get_json(&format!("{}/v1/info", s.verifier.url)).await;
    assert_eq!(
        (info["rule"].as_str(), info["engine"].as_str()),
        (Some("match"), Some("llama-server"))
    );
    assert_eq!(info["features"], json!(["binary"]));

    let mut same = 0;
    for prompt in PROMPTS {
        let prompt_ids = ids(&s.gateway.url, prompt).await;
        let reference = engine_tokens(&s.engine.url, &prompt_ids, 24, 0.0, 0).await;
        let reference = detokenize(&s.engine.url, &reference).await;
        let v = completion(
            &s.gateway.url,
            json!({"prompt": prompt, "max_tokens": 24, "temperature": 0}),
        )
        .await;
        assert_eq!(v["usage"]["spade"]["rule"], "match", "{v}");
        let ours = text(&v);
        if ours == reference {
            same += 1;
        } else {
            println!("differs on {prompt:?}:\n  ours   {ours:?}\n  engine {reference:?}");
        }
    }
    println!("greedy over llama-server: {same} of {} identical", PROMPTS.len());
    assert!(same >= 11, "{same} of 12 identical to llama-server's own greedy generation");

    // Streamed = non-streamed.
    let body = json!({"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0});
    let whole = text(&completion(&s.gateway.url, body.clone()).await);
    let mut streamed_body = body;
    streamed_body["stream"] = json!(true);
    let r = reqwest::Client::new()
        .post(format!("{}/v1/completions", s.gateway.url))
        .json(&streamed_body)
        .send()
        .await
        .unwrap();
    let sse = r.text().await.unwrap();
    let streamed: String = sse
        .split("\n\n")
        .filter_map(|e| e.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter_map(|v| v["choices"][0]["text"].as_str().map(str::to_string))
        .collect();
    assert_eq!(streamed, whole);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seeded_sample_is_the_engines_own_whatever_the_draft_length() {
    let s = stack("sequential").await;
    let prompt = "Write a haiku about the sea:";
    let prompt_ids = ids(&s.gateway.url, prompt).await;
    let seed = 11;
    let reference = engine_tokens(&s.engine.url, &prompt_ids, 16, 0.8, seed).await;
    let reference = detokenize(&s.engine.url, &reference).await;
    for draft_len in [json!(0), json!(2), json!(4), json!("auto")] {
        let body = json!({"prompt": prompt, "max_tokens": 16, "temperature": 0.8, "seed": seed,
            "spade": {"draft_len": draft_len}});
        let v = completion(&s.gateway.url, body).await;
        assert_eq!(text(&v), reference, "draft_len {draft_len}: {v}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_drafted_position_follows_the_engines_distribution() {
    let s = stack("sequential").await;
    let prompt_ids = ids(&s.gateway.url, "My favourite colour is").await;
    // llama-server's own distribution after the prompt at T = 1.5, truncated to the k likeliest
    // tokens, k chosen where the k-th and the next are well apart in its log-probabilities (a
    // near-tie could swap between calls with the engine's numerics). Its post-sampling
    // probabilities then give the law the first committed token must follow.
    let url = format!("{}/completion", s.engine.url);
    let body = |extra: Value| {
        let mut body = json!({"prompt": prompt_ids, "n_predict": 1, "temperature": 1.5,
            "samplers": ["temperature", "top_k", "top_p", "min_p"], "top_p": 1.0, "min_p": 0.0,
            "return_tokens": true, "cache_prompt": true});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        body
    };
    let (_, v) = post_json(&url, &body(json!({"top_k": 0, "n_probs": 8}))).await;
    let logprobs: Vec<f64> = v["completion_probabilities"][0]["top_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["logprob"].as_f64().unwrap())
        .collect();
    let k = (2..logprobs.len()).find(|&k| logprobs[k - 1] - logprobs[k] > 0.3).expect("a gap");
    let (_, v) =
        post_json(&url, &body(json!({"top_k": k, "n_probs": k, "post_sampling_probs": true})))
            .await;
    let top: Vec<(u64, f64)> = v["completion_probabilities"][0]["top_probs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| (p["id"].as_u64().unwrap(), p["prob"].as_f64().unwrap()))
        .collect();
    assert_eq!(top.len(), k, "{v}");
    let covered: f64 = top.iter().map(|t| t.1).sum();
    assert!((covered - 1.0).abs() < 1e-3, "the top {k} cover {covered}");
    let draft = top[0].0;

    // Blocks of two drafts (the likeliest token, then any), seeds 0..N: the first committed token.
    const N: u64 = 400;
    let verify = format!("{}/verify", s.verifier.url);
    let calls = (0..N).map(|seed| {
        let body = json!({"context": prompt_ids, "draft": [{"token": draft, "q": [[draft, 1.0]]},
            {"token": 13, "q": [[13, 1.0]]}], "seed": seed,
            "sampling": {"temperature": 1.5, "top_p": 1.0, "top_k": k, "min_p": 0.0}});
        let verify = verify.clone();
        async move {
            let (status, v) = post_json(&verify, &body).await;
            assert_eq!(status, 200, "{v}");
            if v["accepted"].as_u64().unwrap() > 0 {
                draft
            } else {
                v["next_token"].as_u64().unwrap()
            }
        }
    });
    let firsts: Vec<u64> = futures::stream::iter(calls).buffered(4).collect().await;
    let mut stat = 0.0;
    for (id, p) in &top {
        let observed = firsts.iter().filter(|&&t| t == *id).count() as f64;
        let expected = p * N as f64;
        stat += (observed - expected).powi(2) / expected;
    }
    let outside = firsts.iter().filter(|t| !top.iter().any(|(id, _)| id == *t)).count();
    let df = k - 1;
    println!("first position over llama-server: chi-square {stat:.2} (df {df}), top {top:?}");
    assert_eq!(outside, 0, "tokens outside the engine's top-k were committed");
    assert!(
        stat < chi_square_critical(df),
        "chi-square {stat:.2} >= {:.2}",
        chi_square_critical(df)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_an_engine_cannot_apply_is_refused_by_name() {
    let s = stack("parallel").await;
    let chat = |extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        body
    };
    let schema =
        json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}});
    for (extra, param) in [
        (json!({"response_format": schema}), "response_format"),
        (json!({"presence_penalty": 0.5}), "presence_penalty"),
        (json!({"logprobs": true}), "logprobs"),
    ] {
        let (status, v) =
            post_json(&format!("{}/v1/chat/completions", s.gateway.url), &chat(extra)).await;
        assert_eq!(status, 400, "{v}");
        assert_eq!(v["error"]["param"], param, "{v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains("serving engine (llama-server)"), "{message}");
    }
    // The verifier refuses them too, to a client that asks it directly.
    let body = json!({"context": [1, 2], "sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0},
        "top_logprobs": 2});
    let (status, v) = post_json(&format!("{}/verify", s.verifier.url), &body).await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("top_logprobs")), "{v}");
}
