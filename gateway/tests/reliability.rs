//! Reliability and security of the real binaries on loopback (tiny real model on both sides):
//! bad input to both servers, secrets, the default bind address. Faults on the edge–cloud link,
//! concurrent load and the soaks are in tests/reliability_faults.rs. Each case is reported
//! (tests/real `report`); scripts/reliability.sh renders the report.

mod real;

use std::time::{Duration, Instant};

use real::*;
use serde_json::{json, Value};

const PROMPTS: [&str; 3] = [
    "Write one sentence about the sea.",
    "List three colours.",
    "What is 12 times 12? Explain briefly.",
];

fn raw(url: &str, path: &str, body: Vec<u8>) -> reqwest::RequestBuilder {
    reqwest::Client::new()
        .post(format!("{url}{path}"))
        .header("content-type", "application/json")
        .body(body)
}

/// Status and error body of one bad request; the case passes on the expected status with an
/// OpenAI-shaped error (and the expected `param`, when given).
async fn bad(
    area: &str,
    case: &str,
    request: reqwest::RequestBuilder,
    status: u16,
    param: Option<&str>,
) -> bool {
    let started = Instant::now();
    let response = request.timeout(Duration::from_secs(30)).send().await.unwrap();
    let got = response.status().as_u16();
    let body: Value = response.json().await.unwrap_or(Value::Null);
    let shaped = body["error"]["message"].as_str().is_some_and(|m| !m.is_empty())
        && body["error"].get("type").is_some();
    let param_ok = param.is_none_or(|p| body["error"]["param"] == p);
    let pass = got == status && shaped && param_ok;
    let observed = format!(
        "{got} {} (param {}) in {} ms",
        body["error"]["code"],
        body["error"]["param"],
        started.elapsed().as_millis()
    );
    report(area, case, &observed, pass);
    pass
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_openai_shaped_errors_from_both_servers() {
    let verifier = start_verifier().await;
    let gateway = start_gateway(&verifier.url, &["--max-body-bytes", "65536"]).await;
    let g = gateway.url.as_str();
    let chat = "/v1/chat/completions";
    let json = |v: Value| serde_json::to_vec(&v).unwrap();
    let user = |extra: Value| {
        let mut body = json!({"model": "spade", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        json(body)
    };
    let mut all = true;
    let gw = "bad input (gateway)";
    all &= bad(gw, "malformed JSON", raw(g, chat, b"{\"messages\": [".to_vec()), 400, None).await;
    all &= bad(
        gw,
        "invalid UTF-8 in the body",
        raw(g, chat, b"{\"messages\": [{\"role\": \"user\", \"content\": \"\xff\xfe\"}]}".to_vec()),
        400,
        None,
    )
    .await;
    all &= bad(
        gw,
        "wrong type (messages a string)",
        raw(g, chat, json(json!({"messages": "hi"}))),
        400,
        None,
    )
    .await;
    all &= bad(
        gw,
        "wrong type (temperature a string)",
        raw(g, chat, user(json!({"temperature": "hot"}))),
        400,
        None,
    )
    .await;
    all &= bad(
        gw,
        "NaN literal",
        raw(
            g,
            chat,
            b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"temperature\": NaN}"
                .to_vec(),
        ),
        400,
        None,
    )
    .await;
    all &= bad(
        gw,
        "number out of range (1e999)",
        raw(
            g,
            chat,
            b"{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"top_p\": 1e999}"
                .to_vec(),
        ),
        400,
        None,
    )
    .await;
    all &= bad(
        gw,
        "unknown role",
        raw(g, chat, json(json!({"messages": [{"role": "wizard", "content": "hi"}]}))),
        400,
        None,
    )
    .await;
    all &= bad(
        gw,
        "empty messages",
        raw(g, chat, json(json!({"messages": []}))),
        400,
        Some("messages"),
    )
    .await;
    all &= bad(
        gw,
        "max_tokens 0",
        raw(g, chat, user(json!({"max_tokens": 0}))),
        400,
        Some("max_tokens"),
    )
    .await;
    all &= bad(
        gw,
        "max_tokens -1",
        raw(g, chat, user(json!({"max_tokens": -1}))),
        400,
        Some("max_tokens"),
    )
    .await;
    all &= bad(
        gw,
        "max_tokens beyond the context",
        raw(g, chat, user(json!({"max_tokens": 1_000_000}))),
        400,
        Some("messages"),
    )
    .await;
    all &= bad(
        gw,
        "temperature 2.5",
        raw(g, chat, user(json!({"temperature": 2.5}))),
        400,
        Some("temperature"),
    )
    .await;
    all &= bad(
        gw,
        "temperature -1",
        raw(g, chat, user(json!({"temperature": -1}))),
        400,
        Some("temperature"),
    )
    .await;
    all &= bad(gw, "top_p 0", raw(g, chat, user(json!({"top_p": 0}))), 400, Some("top_p")).await;
    all &=
        bad(gw, "top_p 1.5", raw(g, chat, user(json!({"top_p": 1.5}))), 400, Some("top_p")).await;
    all &= bad(gw, "n 0", raw(g, chat, user(json!({"n": 0}))), 400, Some("n")).await;
    all &= bad(gw, "n 17", raw(g, chat, user(json!({"n": 17}))), 400, Some("n")).await;
    all &= bad(
        gw,
        "tools not a list",
        raw(g, chat, user(json!({"tools": {"type": "function"}}))),
        400,
        Some("tools"),
    )
    .await;
    all &= bad(
        gw,
        "prompt longer than the context",
        raw(
            g,
            chat,
            json(json!({"messages": [{"role": "user", "content": "word ".repeat(9000)}]})),
        ),
        400,
        Some("messages"),
    )
    .await;
    all &= bad(
        gw,
        "body over --max-body-bytes",
        raw(g, chat, json(json!({"messages": [{"role": "user", "content": "x".repeat(70_000)}]}))),
        413,
        None,
    )
    .await;

    let v = verifier.url.as_str();
    let verify = |body: Vec<u8>| raw(v, "/verify", body).bearer_auth(KEY);
    let ctx = json!([1, 2, 3]);
    let vf = "bad input (verifier)";
    all &= bad(vf, "malformed JSON", verify(b"{\"context\": [1,".to_vec()), 400, None).await;
    all &= bad(
        vf,
        "invalid UTF-8",
        verify(b"{\"context\": [1], \"session_id\": \"\xff\"}".to_vec()),
        400,
        None,
    )
    .await;
    all &= bad(
        vf,
        "unknown field",
        verify(json(json!({"context": ctx, "sampling": {}, "contxt": 1}))),
        400,
        None,
    )
    .await;
    all &= bad(
        vf,
        "token id outside the vocabulary",
        verify(json(json!({"context": [1, 99_999_999], "sampling": {}}))),
        400,
        Some("context"),
    )
    .await;
    all &= bad(
        vf,
        "draft token outside the vocabulary",
        verify(json(json!({"context": ctx, "sampling": {}, "draft": [{"token": 99_999_999, "q": [[99_999_999, 1.0]]}]}))),
        400,
        Some("draft[0].token"),
    )
    .await;
    all &= bad(
        vf,
        "q does not sum to 1",
        verify(json(json!({"context": ctx, "sampling": {}, "draft": [{"token": 5, "q": [[5, 0.3], [6, 0.3]]}]}))),
        400,
        Some("draft[0].q"),
    )
    .await;
    all &= bad(
        vf,
        "q with a negative probability",
        verify(json(json!({"context": ctx, "sampling": {}, "draft": [{"token": 5, "q": [[5, 1.5], [6, -0.5]]}]}))),
        400,
        Some("draft[0].q"),
    )
    .await;
    all &= bad(
        vf,
        "NaN in q",
        verify(
            b"{\"context\": [1], \"sampling\": {}, \"draft\": [{\"token\": 5, \"q\": [[5, NaN]]}]}"
                .to_vec(),
        ),
        400,
        None,
    )
    .await;
    all &= bad(
        vf,
        "temperature 3",
        verify(json(json!({"context": ctx, "sampling": {"temperature": 3}}))),
        400,
        Some("sampling.temperature"),
    )
    .await;
    all &= bad(
        vf,
        "empty context",
        verify(json(json!({"context": [], "sampling": {}}))),
        400,
        Some("context"),
    )
    .await;
    all &= bad(
        vf,
        "context longer than the model's maximum",
        verify(json(json!({"context": vec![1; 9000], "sampling": {}}))),
        400,
        Some("context"),
    )
    .await;
    all &= bad(
        vf,
        "delta for an unknown session",
        verify(json(
            json!({"session_id": "nope", "context": [1], "context_start": 5, "sampling": {}}),
        )),
        409,
        Some("context_start"),
    )
    .await;
    assert!(all, "some bad-input cases failed: see the [FAIL] lines");

    // Still serving after all that.
    let ok = complete(g, &request(PROMPTS[1], 4, json!({}))).await;
    report("bad input", "server still answers afterwards", &format!("{:?}", content(&ok)), true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_are_enforced_and_never_logged() {
    const GATEWAY_KEY: &str = "gw-secret-5d1c";
    let verifier = start_verifier_on(0, &["--log", "debug"]).await;
    let gateway = start_gateway(&verifier.url, &["--api-key", GATEWAY_KEY, "--log", "debug"]).await;
    let client = reqwest::Client::new();
    let v = &verifier.url;
    let status = |r: reqwest::Response| r.status().as_u16();
    let no_key = status(
        client
            .post(format!("{v}/verify"))
            .json(&json!({"context": [1], "sampling": {}}))
            .send()
            .await
            .unwrap(),
    );
    let wrong = status(
        client
            .post(format!("{v}/verify"))
            .bearer_auth("wrong")
            .json(&json!({"context": [1], "sampling": {}}))
            .send()
            .await
            .unwrap(),
    );
    let metrics = status(client.get(format!("{v}/metrics")).send().await.unwrap());
    let open = status(client.get(format!("{v}/health")).send().await.unwrap());
    let pass = no_key == 401 && wrong == 401 && metrics == 401 && open == 200;
    report(
        "security",
        "verifier: /verify without or with a wrong bearer token, /metrics without",
        &format!("{no_key}, {wrong}, {metrics}; /health {open}"),
        pass,
    );
    assert!(pass);

    let g = &gateway.url;
    let body = request(PROMPTS[1], 4, json!({}));
    let no_key =
        status(client.post(format!("{g}/v1/chat/completions")).json(&body).send().await.unwrap());
    let wrong = status(
        client
            .post(format!("{g}/v1/chat/completions"))
            .bearer_auth("nope")
            .json(&body)
            .send()
            .await
            .unwrap(),
    );
    let right = status(
        client
            .post(format!("{g}/v1/chat/completions"))
            .bearer_auth(GATEWAY_KEY)
            .json(&body)
            .send()
            .await
            .unwrap(),
    );
    let pass = no_key == 401 && wrong == 401 && right == 200;
    report(
        "security",
        "gateway --api-key: none, wrong, right",
        &format!("{no_key}, {wrong}, {right}"),
        pass,
    );
    assert!(pass);

    let logs = format!("{}{}", verifier.log_text(), gateway.log_text());
    let leaked = [KEY, GATEWAY_KEY].iter().filter(|k| logs.contains(*k)).count();
    let pass = leaked == 0 && logs.lines().count() > 10;
    report(
        "security",
        "no key in debug logs of either server",
        &format!("{} log lines, {leaked} keys found", logs.lines().count()),
        pass,
    );
    assert!(pass);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_binds_loopback_by_default() {
    let verifier = start_verifier().await;
    let gateway = start_gateway(&verifier.url, &[]).await;
    // /proc/net/tcp lists listening sockets as hex local addresses; 0100007F is 127.0.0.1.
    let port = format!(":{:04X}", gateway.port);
    let tables = std::fs::read_to_string("/proc/net/tcp").unwrap()
        + &std::fs::read_to_string("/proc/net/tcp6").unwrap_or_default();
    let listening: Vec<&str> = tables
        .lines()
        .filter(|l| {
            l.split_whitespace().nth(1).is_some_and(|a| a.ends_with(&port))
                && l.split_whitespace().nth(3) == Some("0A")
        })
        .collect();
    let loopback_only = !listening.is_empty()
        && listening
            .iter()
            .all(|l| l.split_whitespace().nth(1).is_some_and(|a| a.starts_with("0100007F")));
    report(
        "security",
        "gateway binds 127.0.0.1 unless told otherwise",
        &format!("{} listening socket(s), loopback only: {loopback_only}", listening.len()),
        loopback_only,
    );
    assert!(loopback_only, "{listening:?}");
}
