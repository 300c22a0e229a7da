//! Opt-in (`SPADE_TEST_VLLM=1`, run by `bench/engine-vllm-cpu.sh`, which installs vLLM, converts the
//! model and serves it at `SPADE_VLLM_URL` as `target`): `spade-verifier --engine --engine-kind vllm`
//! over a real vLLM, a gateway in front. Greedy answers must be vLLM's own greedy generations of the
//! same prompt ids (at least 11 of 12). CI does not run it (vLLM's CPU venv is ~6 GB).

mod real;

use real::*;
use serde_json::{json, Value};

const PROMPTS: [&str; 12] = [
    "def fibonacci(n):",
    "The capital of France is",
    "import os\n\ndef list_files(path):",
    "Once upon a time,",
    "SELECT * FROM users WHERE",
    "The three primary colours are",
    "class Point:\n    def __init__(self, x, y):",
    "To make a cup of tea,",
    "for i in range(10):",
    "My favourite food is",
    "fn main() {",
    "Water boils at",
];

async fn post_json(url: &str, body: &Value) -> Value {
    let r = reqwest::Client::new().post(url).bearer_auth(KEY).json(body).send().await.unwrap();
    let status = r.status().as_u16();
    let v: Value = r.json().await.unwrap_or(Value::Null);
    assert_eq!(status, 200, "{url}: {v}");
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_answers_are_vllms_own() {
    if std::env::var("SPADE_TEST_VLLM").as_deref() != Ok("1") {
        println!("skipped: set SPADE_TEST_VLLM=1 (bench/engine-vllm-cpu.sh does)");
        return;
    }
    let engine = std::env::var("SPADE_VLLM_URL").expect("SPADE_VLLM_URL");
    let target = std::env::var("SPADE_VLLM_TARGET_GGUF").expect("SPADE_VLLM_TARGET_GGUF");
    let draft = std::env::var("SPADE_VLLM_DRAFT_GGUF").expect("SPADE_VLLM_DRAFT_GGUF");
    let args = [
        "--engine",
        &engine,
        "--engine-kind",
        "vllm",
        "--engine-model",
        "target",
        "--model",
        &target,
    ];
    let verifier = start_verifier_on(0, &args).await;
    let gateway = start_gateway(&verifier.url, &["--draft-model", &draft]).await;
    let mut same = 0;
    for prompt in PROMPTS {
        let ids = post_json(&format!("{}/tokenize", gateway.url), &json!({"prompt": prompt})).await;
        let own = post_json(
            &format!("{engine}/v1/completions"),
            &json!({"model": "target", "prompt": ids["tokens"], "max_tokens": 24, "temperature": 0}),
        )
        .await;
        let ours = post_json(
            &format!("{}/v1/completions", gateway.url),
            &json!({"prompt": prompt, "max_tokens": 24, "temperature": 0}),
        )
        .await;
        let (own, ours) = (&own["choices"][0]["text"], &ours["choices"][0]["text"]);
        if own == ours {
            same += 1;
        } else {
            println!("differs on {prompt:?}:\n  ours {ours}\n  vLLM {own}");
        }
    }
    println!("greedy over vLLM: {same} of {} identical", PROMPTS.len());
    assert!(same >= 11, "{same} of 12 identical to vLLM's own greedy generation");
}
