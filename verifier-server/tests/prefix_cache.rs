//! The prefix cache over real HTTP with the real binary and the tiny model: a conversation's turns
//! start from the rows its last turn left and get the answers a verifier without the cache gives,
//! sampled ones included; under a small budget, entries are evicted oldest first, memory stays within
//! the model plus the budget, and no call fails.

use serde_json::{json, Value};
use spade_test_support::models::tiny;
use spade_test_support::process::Server;
use spade_test_support::rss_mb;

const KEY: &str = "prefix-key";

async fn start(extra: &[&str]) -> Server {
    let tiny = tiny();
    let mut args = vec![
        "--model",
        tiny.to_str().unwrap(),
        "--api-key",
        KEY,
        "--log",
        "warn",
        "--time-passes",
        "0",
    ];
    args.extend_from_slice(extra);
    let server = Server::spawn(
        std::path::Path::new(env!("CARGO_BIN_EXE_spade-verifier")),
        "verifier-prefix",
        0,
        &args,
        &[],
    );
    server.wait_ready().await;
    server
}

/// Tokens of a made-up conversation: `n` ids from `salt`.
fn tokens(salt: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| 200 + (i * 37 + salt * 7919) % 20_000).collect()
}

/// One turn: the full context, then `calls - 1` appending calls, then the session's end. Returns each
/// answer's (accepted, next token), the first call's cached tokens, and the context it left.
async fn turn(
    client: &reqwest::Client,
    url: &str,
    session: &str,
    mut context: Vec<u32>,
    calls: usize,
    sampling: &Value,
) -> (Vec<(u64, u64)>, u64, Vec<u32>) {
    let (mut answers, mut cached, mut session_len) = (Vec::new(), 0, 0u64);
    for call in 0..calls {
        let draft: Vec<Value> = (0..3)
            .map(|i| json!({"token": 300 + i, "q": [[300 + i, 0.5], [400 + i, 0.5]]}))
            .collect();
        let body = if call == 0 {
            json!({"session_id": session, "context": context, "draft": draft, "sampling": sampling, "seed": 11})
        } else {
            json!({"session_id": session, "context": [], "context_start": session_len, "draft": draft, "sampling": sampling, "seed": 11})
        };
        let r =
            client.post(format!("{url}/verify")).bearer_auth(KEY).json(&body).send().await.unwrap();
        let status = r.status().as_u16();
        let v: Value = r.json().await.unwrap();
        assert_eq!(status, 200, "{session} call {call}: {v}");
        if call == 0 {
            cached = v["cached_tokens"].as_u64().unwrap();
        }
        session_len = v["session_len"].as_u64().unwrap();
        let (accepted, next) = (v["accepted"].as_u64().unwrap(), v["next_token"].as_u64().unwrap());
        context.extend(300..300 + accepted as u32);
        context.push(next as u32);
        answers.push((accepted, next));
    }
    let ended =
        client.delete(format!("{url}/sessions/{session}")).bearer_auth(KEY).send().await.unwrap();
    assert_eq!(ended.status().as_u16(), 204);
    (answers, cached, context)
}

async fn metric(client: &reqwest::Client, url: &str, name: &str) -> f64 {
    let text = client
        .get(format!("{url}/metrics"))
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    spade_test_support::metric_value(&text, name).unwrap_or_else(|| panic!("{name} missing"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn turns_from_the_cache_answer_as_a_verifier_without_it() {
    let (cached, cold) = (start(&[]).await, start(&["--prefix-cache", "false"]).await);
    let client = reqwest::Client::new();
    for (salt, sampling) in
        [json!({"temperature": 0.0}), json!({"temperature": 0.8, "top_p": 0.95})]
            .into_iter()
            .enumerate()
    {
        let (mut with, mut without) = (tokens(salt as u32 + 1, 120), tokens(salt as u32 + 1, 120));
        let mut last_len = 0;
        for t in 0..4 {
            let id = format!("turn-{t}-{}", sampling["temperature"]);
            let (a, hit, ctx_a) = turn(&client, &cached.url, &id, with.clone(), 3, &sampling).await;
            let (b, miss, ctx_b) =
                turn(&client, &cold.url, &id, without.clone(), 3, &sampling).await;
            assert_eq!(
                a, b,
                "turn {t} ({sampling}): answers from the cache differ from a cold prefill's"
            );
            assert_eq!(miss, 0, "no cache, nothing cached");
            if t == 0 {
                assert_eq!(hit, 0);
            } else {
                // All the last turn left but its final token, which has no row yet.
                assert_eq!(hit as usize, last_len - 1, "turn {t}: {hit} of {} cached", with.len());
            }
            last_len = ctx_a.len();
            // The next turn: this one's context and answers, then a new message.
            with = ctx_a.into_iter().chain(tokens(t + 10, 30)).collect();
            without = ctx_b.into_iter().chain(tokens(t + 10, 30)).collect();
            assert_eq!(with, without);
        }
    }
    let features = |url: String| {
        let client = client.clone();
        async move {
            let info = client.get(format!("{url}/v1/info")).bearer_auth(KEY).send().await.unwrap();
            info.json::<Value>().await.unwrap()["features"].clone()
        }
    };
    let prefix_cache = json!("prefix_cache");
    assert!(features(cached.url.clone()).await.as_array().unwrap().contains(&prefix_cache));
    assert!(!features(cold.url.clone()).await.as_array().unwrap().contains(&prefix_cache));
    let (hits, computed) = (
        metric(&client, &cached.url, "spade_prompt_tokens_cached_total").await,
        metric(&client, &cached.url, "spade_prompt_tokens_computed_total").await,
    );
    let cold_computed = metric(&client, &cold.url, "spade_prompt_tokens_computed_total").await;
    assert_eq!(
        hits + computed,
        cold_computed,
        "the same prompts, split between cached and computed"
    );
    assert!(
        computed < cold_computed / 2.0,
        "{computed} computed with the cache, {cold_computed} without"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_budget_evicts_oldest_first_and_bounds_memory() {
    // SmolLM2-135M keeps 46 KB of KV per position: 16 MiB holds ~350, a long turn of 150 positions
    // (with its spare rows) ~210, a short one of 40 ~100.
    const BUDGET_MB: usize = 16;
    let server = start(&["--cache-budget-mb", &BUDGET_MB.to_string()]).await;
    let client = reqwest::Client::new();
    let pid = server.child.id();
    let baseline = rss_mb(pid);
    let mut peak = baseline;
    let greedy = json!({"temperature": 0.0});
    let (_, _, long) = turn(&client, &server.url, "long", tokens(1, 150), 2, &greedy).await;
    let mut shorts = Vec::new();
    for s in 0..8u32 {
        let (_, _, ctx) =
            turn(&client, &server.url, &format!("short-{s}"), tokens(100 + s, 40), 2, &greedy)
                .await;
        shorts.push(ctx);
        peak = peak.max(rss_mb(pid));
        let held = metric(&client, &server.url, "spade_prefix_cache_bytes").await
            + metric(&client, &server.url, "spade_kv_cache_bytes").await;
        assert!(held <= (BUDGET_MB << 20) as f64, "{held} bytes held after short {s}");
    }
    let evicted = metric(&client, &server.url, "spade_prefix_cache_evictions_total").await;
    let entries = metric(&client, &server.url, "spade_prefix_cache_entries").await;
    println!("{evicted} entries evicted, {entries} kept; RSS {baseline:.0} -> {peak:.0} MB (budget {BUDGET_MB} MB)");
    assert!(evicted >= 6.0 && entries >= 1.0, "{evicted} evicted, {entries} kept");
    // The oldest went first: the long conversation and the first short ones are gone, the newest stays.
    let next =
        |ctx: &[u32], salt| ctx.iter().copied().chain(tokens(salt, 10)).collect::<Vec<u32>>();
    let (_, last_hit, _) =
        turn(&client, &server.url, "short-7-2", next(&shorts[7], 9), 1, &greedy).await;
    let (_, long_hit, _) = turn(&client, &server.url, "long-2", next(&long, 7), 1, &greedy).await;
    let (_, first_hit, _) =
        turn(&client, &server.url, "short-0-2", next(&shorts[0], 8), 1, &greedy).await;
    assert_eq!((long_hit, first_hit), (0, 0), "the oldest entries were evicted first");
    assert!(last_hit >= 40, "the newest entry stayed: {last_hit} cached");
    assert!(metric(&client, &server.url, "spade_verify_errors_total").await == 0.0);
    peak = peak.max(rss_mb(pid));
    // Model + budget + allocator slack.
    assert!(peak < baseline + BUDGET_MB as f64 + 100.0, "RSS {peak} MB vs baseline {baseline} MB");
}
