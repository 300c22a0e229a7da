//! The real binary with the real tiny model over real HTTP: /verify equals spade-core's rule applied
//! to the scorer's logits, repeated calls agree, sessions append, and 16 concurrent sessions under
//! load are batched, stay within the cache budget and get the answers they get alone.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use spade_core::protocol::WireDraftToken;
use spade_core::{distribution, verify_block, DraftToken, SamplingParams};
use spade_engine::{CandleScorer, Scorer};
use spade_test_support::models::tiny;
use spade_test_support::process::Server;
use spade_test_support::rss_mb;

const KEY: &str = "e2e-key";

async fn start(extra: &[&str]) -> Server {
    let tiny = tiny();
    let mut args = vec!["--model", tiny.to_str().unwrap(), "--api-key", KEY, "--log", "warn"];
    args.extend_from_slice(extra);
    let server = Server::spawn(
        std::path::Path::new(env!("CARGO_BIN_EXE_spade-verifier")),
        "verifier-e2e",
        0,
        &args,
        &[],
    );
    server.wait_ready().await;
    server
}

async fn post(client: &reqwest::Client, url: &str, body: &Value) -> (u16, Value) {
    let r = client
        .post(format!("{url}/verify"))
        .bearer_auth(KEY)
        .json(body)
        .send()
        .await
        .expect("send");
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_equals_the_rule_on_the_scorers_logits() {
    let server = start(&[]).await;
    let client = reqwest::Client::new();
    let scorer = CandleScorer::load(&tiny()).unwrap();
    let context: Vec<u32> = vec![1, 4093, 314, 3575, 282, 4649, 314, 216];
    let sampling = SamplingParams { temperature: 0.9, top_k: 40, ..SamplingParams::default() };
    // Drafts from a deliberately different q: a flat distribution over a few tokens.
    let q =
        spade_core::SparseDist::new(vec![(284, 0.25), (253, 0.25), (30, 0.25), (28, 0.25)], None)
            .unwrap();
    let drafts: Vec<DraftToken> =
        [284, 253, 30].iter().map(|&t| DraftToken { token: t, q: q.clone() }).collect();
    let body = json!({
        "context": context,
        "draft": drafts.iter().map(WireDraftToken::from_draft).collect::<Vec<_>>(),
        "sampling": sampling,
        "seed": 99,
        "top_logprobs": 3,
    });
    let mut tokens = context.clone();
    tokens.extend(drafts.iter().map(|d| d.token));
    for seed in [99u64, 5, 6, 7] {
        let mut body = body.clone();
        body["seed"] = json!(seed);
        let (status, got) = post(&client, &server.url, &body).await;
        assert_eq!(status, 200, "{got}");
        let logits = scorer.new_session().score(&tokens, drafts.len() + 1).unwrap();
        let p: Vec<_> = logits.iter().map(|l| distribution(l, &sampling).unwrap()).collect();
        let want = verify_block(&p, &drafts, seed, context.len() as u64).unwrap();
        assert_eq!(got["accepted"].as_u64(), Some(want.accepted as u64), "seed {seed}");
        assert_eq!(got["next_token"].as_u64(), Some(want.next_token as u64), "seed {seed}");
        let (_, again) = post(&client, &server.url, &body).await;
        assert_eq!(
            (&again["accepted"], &again["next_token"]),
            (&got["accepted"], &got["next_token"]),
            "a repeated call must agree"
        );
        let lp = got["logprobs"].as_array().unwrap();
        assert_eq!(lp.len(), want.accepted + 1);
        assert!(lp.iter().all(|x| x["logprob"].as_f64().unwrap() <= 0.0));
    }
    // /v1/info matches the scorer's own facts.
    let info: Value = client
        .get(format!("{}/v1/info", server.url))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        info["tokenizer_fingerprint"].as_str(),
        Some(scorer.meta().tokenizer_fingerprint.as_str())
    );
    assert_eq!(info["vocab_size"].as_u64(), Some(scorer.meta().vocab_size as u64));
    // Blocks of 1..=9 rows were timed at start-up (--time-passes 9 by default).
    let pass_ms = info["pass_ms"].as_array().expect("pass_ms");
    assert!(
        pass_ms.len() == 9
            && pass_ms.iter().all(|ms| ms.as_f64().is_some_and(|ms| ms > 0.0 && ms < 10_000.0)),
        "{info}"
    );
}

/// With more scoring waiting than --max-backlog-secs, a new prompt gets 429 `verifier_busy` with a
/// retry-after, while a running session's decode block is still taken and answered before the long
/// prompt ahead of it finishes; once the backlog drains the prompts turned away are taken in the
/// order they were first turned away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_verifier_turns_prompts_away_and_keeps_decoding() {
    let server = start(&["--max-backlog-secs", "0.001"]).await;
    let client = reqwest::Client::new();
    let prompt =
        |n: u32, s: u32| -> Vec<u32> { (0..n).map(|i| 200 + (i * 37 + s * 101) % 20000).collect() };
    let call = |session: &str, context: Vec<u32>, start: u64, draft: Vec<WireDraftToken>| json!({"session_id": session, "context": context, "context_start": start, "draft": draft, "sampling": SamplingParams::default(), "seed": 1});
    // A first call measures what a row costs.
    let (status, warm) =
        post(&client, &server.url, &call("running", prompt(24, 0), 0, vec![])).await;
    assert_eq!(status, 200, "{warm}");
    let running_len = warm["session_len"].as_u64().unwrap();

    let long = {
        let (client, url, body) =
            (client.clone(), server.url.clone(), call("long", prompt(800, 1), 0, vec![]));
        tokio::spawn(async move { post(&client, &url, &body).await })
    };
    let backlog = || async {
        let text = client
            .get(format!("{}/metrics", server.url))
            .bearer_auth(KEY)
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix("spade_verify_backlog_seconds "))
            .unwrap()
            .parse::<f64>()
            .unwrap()
    };
    let waited = Instant::now();
    while backlog().await <= 0.0 {
        assert!(
            !long.is_finished() && waited.elapsed() < Duration::from_secs(30),
            "the long prompt never showed in the backlog"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    let r = client
        .post(format!("{}/verify", server.url))
        .bearer_auth(KEY)
        .json(&call("newcomer", prompt(100, 2), 0, vec![]))
        .send()
        .await
        .unwrap();
    let retry_after =
        r.headers().get("retry-after").and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    let (status, refused): (u16, Value) = (r.status().as_u16(), r.json().await.unwrap());
    assert_eq!(status, 429, "{refused}");
    assert_eq!(refused["error"]["code"], "verifier_busy", "{refused}");
    assert!(retry_after.is_some_and(|s| s >= 1), "retry-after {retry_after:?}");
    let (status, _) = post(&client, &server.url, &call("second", prompt(100, 3), 0, vec![])).await;
    assert_eq!(status, 429);
    let metrics = client
        .get(format!("{}/metrics", server.url))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(metrics.contains("spade_verify_prompts_in_line 2\n"), "{metrics}");

    let q = spade_core::SparseDist::new(vec![(284, 1.0)], None).unwrap();
    let block = vec![WireDraftToken::from_draft(&DraftToken { token: 284, q })];
    let (status, decoded) =
        post(&client, &server.url, &call("running", vec![], running_len, block)).await;
    assert_eq!(status, 200, "{decoded}");
    assert!(!long.is_finished(), "the decode block should not wait for the long prompt");

    let (status, answer) = long.await.unwrap();
    assert_eq!(status, 200, "{answer}");
    // The backlog has drained, but "second" was turned away after "newcomer": it waits its turn.
    let (status, early) =
        post(&client, &server.url, &call("second", prompt(100, 3), 0, vec![])).await;
    assert_eq!((status, &early["error"]["code"]), (429, &json!("verifier_busy")), "{early}");
    let (status, taken) =
        post(&client, &server.url, &call("newcomer", prompt(100, 2), 0, vec![])).await;
    assert_eq!(status, 200, "once the backlog drained: {taken}");
    let (status, taken) =
        post(&client, &server.url, &call("second", prompt(100, 3), 0, vec![])).await;
    assert_eq!(status, 200, "after the prompt ahead of it: {taken}");
    let metrics = client
        .get(format!("{}/metrics", server.url))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(metrics.contains("spade_verify_busy_total 3\n"), "{metrics}");
    assert!(metrics.contains("spade_verify_prompts_in_line 0\n"), "{metrics}");
    assert!(metrics.contains("spade_verify_backlog_seconds 0.000\n"), "the backlog is empty again");
}

/// 16 sessions at once, 8 calls each: every call succeeds or gets the documented 429 (queue full),
/// the caches stay within the budget and RSS within model + budget. (Eviction under a budget smaller
/// than the sessions is covered by the router tests.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_concurrent_sessions_stay_within_budget() {
    const BUDGET_MB: usize = 160;
    let server = start(&["--cache-budget-mb", &BUDGET_MB.to_string(), "--queue-size", "64"]).await;
    let pid = server.child.id();
    let baseline = rss_mb(pid);
    let started = Instant::now();
    let sampling = Arc::new(AtomicBool::new(true));
    let sampler = {
        let sampling = sampling.clone();
        tokio::spawn(async move {
            let mut peak: f64 = 0.0;
            while sampling.load(Ordering::SeqCst) {
                peak = peak.max(rss_mb(pid));
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            peak
        })
    };
    let tasks: Vec<_> = (0..16u32)
        .map(|s| tokio::spawn(run_session(server.url.clone(), format!("load-{s}"), s)))
        .collect();
    let (mut ok, mut resend, mut busy, mut lat, mut answers) = (0, 0, 0, Vec::new(), Vec::new());
    for t in tasks {
        let (o, r, b, l, a) = t.await.unwrap();
        ok += o;
        resend += r;
        busy += b;
        lat.extend(l);
        answers.push(a);
    }
    sampling.store(false, Ordering::SeqCst);
    let peak = sampler.await.unwrap().max(rss_mb(pid));
    lat.sort_by(f64::total_cmp);
    let pct = |q: f64| lat[((lat.len() - 1) as f64 * q) as usize] * 1000.0;
    println!(
        "16 sessions x 8 calls in {:.1}s: {ok} ok, {resend} resend (evicted), {busy} 429; latency p50 {:.0} ms, p99 {:.0} ms; RSS {baseline:.0} -> {peak:.0} MB (budget {BUDGET_MB} MB)",
        started.elapsed().as_secs_f64(),
        pct(0.5),
        pct(0.99)
    );
    assert_eq!(ok + resend + busy, 128);
    assert_eq!(resend, 0, "no session should be evicted under this budget");
    let metrics = reqwest::Client::new()
        .get(format!("{}/metrics", server.url))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let cache_bytes: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("spade_kv_cache_bytes "))
        .unwrap()
        .parse()
        .unwrap();
    assert!(cache_bytes <= (BUDGET_MB * 1024 * 1024) as f64, "sessions hold {cache_bytes} bytes");
    // The calls were batched, and each session's answers equal those it gets scored alone.
    let counter = |name: &str| {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .unwrap()
            .parse::<f64>()
            .unwrap()
    };
    let (passes, batched) =
        (counter("spade_verify_passes_total"), counter("spade_verify_pass_sessions_total"));
    println!(
        "{batched} session steps in {passes} passes ({:.1} sessions per pass)",
        batched / passes
    );
    assert!(
        batched > passes * 2.0,
        "concurrent calls were not batched: {batched} session steps in {passes} passes"
    );
    for (s, want) in answers.iter().enumerate() {
        let alone = run_session(server.url.clone(), format!("alone-{s}"), s as u32).await;
        assert_eq!(&alone.4, want, "session {s}: batched answers differ from those scored alone");
    }
    // Model + budget + allocator slack; a cache without a budget would hold 16 x 150 positions x 46 KB.
    assert!(peak < baseline + BUDGET_MB as f64 + 150.0, "RSS {peak} MB vs baseline {baseline} MB");
}

/// Eight greedy verify calls of one session, each appending to the last: (answered, resend, 429,
/// latencies in seconds, (accepted, next token) per answer).
async fn run_session(
    url: String,
    session: String,
    s: u32,
) -> (usize, usize, usize, Vec<f64>, Vec<(u64, u64)>) {
    let client = reqwest::Client::new();
    let (mut ok, mut resend, mut busy, mut latencies, mut answers) =
        (0, 0, 0, Vec::new(), Vec::new());
    let mut context: Vec<u32> = (0..120).map(|i| 200 + (i * 37 + s * 101) % 20000).collect();
    let mut session_len = 0u64;
    for _ in 0..8 {
        let draft: Vec<Value> =
            (0..4).map(|i| json!({"token": 300 + i, "q": [[300 + i, 1.0]]})).collect();
        let body = if session_len == 0 {
            json!({"session_id": session, "context": context, "draft": draft, "sampling": {"temperature": 0.0}})
        } else {
            json!({"session_id": session, "context": [], "context_start": session_len, "draft": draft, "sampling": {"temperature": 0.0}})
        };
        let t = Instant::now();
        let (status, v) = post(&client, &url, &body).await;
        latencies.push(t.elapsed().as_secs_f64());
        match status {
            200 => {
                ok += 1;
                session_len = v["session_len"].as_u64().unwrap();
                let (n, next) =
                    (v["accepted"].as_u64().unwrap(), v["next_token"].as_u64().unwrap());
                context.extend(300..300 + n as u32);
                context.push(next as u32);
                answers.push((n, next));
            }
            409 => {
                resend += 1;
                session_len = 0; // evicted: send the whole context next time
            }
            429 => busy += 1,
            other => panic!("unexpected status {other}: {v}"),
        }
    }
    (ok, resend, busy, latencies, answers)
}
