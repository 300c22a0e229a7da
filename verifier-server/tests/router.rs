//! Router tests: every status code and error path of the verifier, in-process, with a small
//! deterministic scorer (the real model is exercised in tests/e2e.rs).

mod common;

use common::*;

#[tokio::test]
async fn health_reflects_loading() {
    let loading = state(&[], false);
    for path in ["/health", "/health/ready"] {
        assert_eq!(
            probe(&loading, path).await,
            (StatusCode::SERVICE_UNAVAILABLE, Some("loading".into()))
        );
    }
    assert_eq!(probe(&loading, "/health/live").await, (StatusCode::OK, Some("live".into())));
    let (s, _) = verify(&loading, greedy(&[1], &[])).await;
    assert_eq!(s, StatusCode::SERVICE_UNAVAILABLE);
    let ready = state(&[], true);
    for path in ["/health", "/health/ready"] {
        assert_eq!(probe(&ready, path).await, (StatusCode::OK, Some("ready".into())));
    }
    assert_eq!(probe(&ready, "/health/live").await, (StatusCode::OK, Some("live".into())));
}

#[tokio::test]
async fn a_dead_scoring_thread_is_neither_live_nor_ready() {
    let st = state(&[], true);
    let (s, _) = verify(&st, greedy(&[PANIC_TOKEN, 1], &[2])).await;
    assert_eq!(s, StatusCode::INTERNAL_SERVER_ERROR);
    // The thread is unwinding; the probes see it gone as soon as it has.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while probe(&st, "/health/live").await.0 == StatusCode::OK {
        assert!(std::time::Instant::now() < deadline, "/health/live stayed 200");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let stopped = (StatusCode::SERVICE_UNAVAILABLE, Some("scoring_stopped".to_string()));
    for path in ["/health/live", "/health/ready", "/health"] {
        assert_eq!(probe(&st, path).await, stopped, "{path}");
    }
    // Calls fail fast and say why instead of hanging.
    let (s, v) = verify(&st, greedy(&[1], &[8])).await;
    assert_eq!(s, StatusCode::INTERNAL_SERVER_ERROR, "{v}");
}

#[tokio::test]
async fn metrics_are_public_only_when_asked() {
    let private = state(&[], true);
    assert_eq!(call(&private, "GET", "/metrics", None, None).await.0, StatusCode::UNAUTHORIZED);
    let public = state(&["--metrics-public"], true);
    let (s, v, _) = call(&public, "GET", "/metrics", None, None).await;
    assert_eq!(s, StatusCode::OK);
    assert!(v.as_str().is_some_and(|t| t.contains("spade_ready 1")), "{v}");
    // Everything else still needs the key.
    assert_eq!(call(&public, "GET", "/v1/info", None, None).await.0, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn greedy_block_is_judged_and_repeatable() {
    let st = state(&[], true);
    // After 1 the target wants 8, then 25, then 16; the third draft is wrong.
    let body = greedy(&[3, 1], &[8, 25, 5]);
    let (s, v) = verify(&st, body.clone()).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        (v["accepted"].as_u64(), v["next_token"].as_u64(), v["next_kind"].as_str()),
        (Some(2), Some(16), Some("correction"))
    );
    assert_eq!(v["session_len"], 5);
    assert_eq!(verify(&st, body).await.1["next_token"], v["next_token"]);
    // All accepted: bonus.
    let (_, v) = verify(&st, greedy(&[1], &[8, 25])).await;
    assert_eq!(
        (v["accepted"].as_u64(), v["next_token"].as_u64(), v["next_kind"].as_str()),
        (Some(2), Some(16), Some("bonus"))
    );
    // Logprobs come from the target and name the committed tokens.
    let mut body = greedy(&[1], &[8]);
    body["top_logprobs"] = json!(2);
    let (_, v) = verify(&st, body).await;
    let lp = v["logprobs"].as_array().unwrap();
    assert_eq!(lp.len(), 2);
    assert_eq!(lp[0]["token"], 8);
    assert_eq!(lp[0]["top"][0][0], 8);
}

#[tokio::test]
async fn penalties_count_earlier_drafts_as_target_only_decoding_counts_committed_tokens() {
    let st = state(&[], true);
    // From 0 the target walks the cycle 1, 8, 25, 16, 17, 24, 9, 0 and back to 1. With a presence
    // penalty of 2 on the completion, 1 (and 0) lose to 2 after the cycle: the peak is 1 above its neighbours.
    let cycle = [1, 8, 25, 16, 17, 24, 9, 0];
    let penalties = json!({"presence_penalty": 2.0, "prompt_len": 1});
    let mut block = greedy(&[0], &cycle);
    block["penalties"] = penalties.clone();
    let (s, v) = verify(&st, block).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!(
        (v["accepted"].as_u64(), v["next_token"].as_u64(), v["next_kind"].as_str()),
        (Some(8), Some(2), Some("bonus"))
    );
    let mut one_by_one = greedy(&[[0].as_slice(), &cycle].concat(), &[]);
    one_by_one["penalties"] = penalties;
    assert_eq!(verify(&st, one_by_one).await.1["next_token"], 2);
    assert_eq!(
        verify(&st, greedy(&[0], &cycle)).await.1["next_token"],
        1,
        "without penalties the cycle goes on"
    );
    // A bias moves the argmax; ids outside the vocabulary and bad values are named.
    let mut biased = greedy(&[3, 1], &[]);
    biased["penalties"] = json!({"logit_bias": {"9": 1.5}});
    assert_eq!(verify(&st, biased).await.1["next_token"], 9);
    for (penalties, param) in [
        (json!({"logit_bias": {"32": 1}}), "penalties.logit_bias"),
        (json!({"frequency_penalty": 9}), "penalties.frequency_penalty"),
    ] {
        let mut body = greedy(&[1], &[]);
        body["penalties"] = penalties;
        let (s, v) = verify(&st, body).await;
        assert_eq!(s, StatusCode::BAD_REQUEST);
        assert_error(&v, "invalid_request_error", Some(param), None);
    }
}

#[tokio::test]
async fn the_binary_form_gets_the_same_verdict_in_fewer_bytes() {
    let st = state(&[], true);
    let json_body = greedy(&[3, 1], &[8, 25, 5]);
    let (_, json_answer) = verify(&st, json_body.clone()).await;
    let request: spade_core::protocol::VerifyRequest =
        serde_json::from_value(json_body.clone()).unwrap();
    let bytes = spade_core::wire::encode_request(&request);
    assert!(
        bytes.len() * 4 < json_body.to_string().len(),
        "{} binary bytes vs {} JSON",
        bytes.len(),
        json_body.to_string().len()
    );
    let post = |body: Vec<u8>, accept: &'static str| {
        let st = st.clone();
        async move {
            let req = Request::post("/verify")
                .header("authorization", "Bearer sekret")
                .header("content-type", spade_core::wire::BINARY_CONTENT_TYPE)
                .header("accept", accept)
                .body(Body::from(body))
                .unwrap();
            let response = router(st).oneshot(req).await.unwrap();
            let (status, kind) = (
                response.status(),
                response.headers().get("content-type").map(|v| v.to_str().unwrap().to_string()),
            );
            (status, kind, axum::body::to_bytes(response.into_body(), usize::MAX).await.unwrap())
        }
    };
    let (status, kind, body) = post(bytes.clone(), spade_core::wire::BINARY_CONTENT_TYPE).await;
    assert_eq!(
        (status, kind.as_deref()),
        (StatusCode::OK, Some(spade_core::wire::BINARY_CONTENT_TYPE))
    );
    let answer = spade_core::wire::decode_response(&body).unwrap();
    assert_eq!((answer.accepted, answer.next_token), (2, 16));
    assert_eq!(json!(answer.accepted), json_answer["accepted"]);
    // Binary in, JSON out when the caller does not accept binary.
    let (_, kind, body) = post(bytes, "application/json").await;
    assert_eq!(kind.as_deref(), Some("application/json"));
    assert_eq!(serde_json::from_slice::<Value>(&body).unwrap()["next_token"], 16);
    // A broken binary body is an OpenAI-shaped 400.
    let (status, _, body) = post(vec![1, 0, 5], spade_core::wire::BINARY_CONTENT_TYPE).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_error(
        &serde_json::from_slice(&body).unwrap(),
        "invalid_request_error",
        None,
        Some("invalid_binary"),
    );
}

#[tokio::test]
async fn sampled_calls_are_deterministic_per_seed() {
    let st = state(&[], true);
    let body = json!({
        "context": [4, 9],
        "draft": [{"token": 3, "q": [[3, 0.5], [0, 0.5]]}, {"token": 12, "q": [[12, 1.0]]}],
        "sampling": {"temperature": 1.0, "top_p": 0.9},
        "seed": 11
    });
    let first = verify(&st, body.clone()).await;
    assert_eq!(first.0, StatusCode::OK, "{}", first.1);
    for _ in 0..5 {
        let again = verify(&st, body.clone()).await.1;
        assert_eq!(
            (&again["accepted"], &again["next_token"]),
            (&first.1["accepted"], &first.1["next_token"])
        );
    }
}

#[tokio::test]
async fn malformed_bodies_are_400_in_openai_shape() {
    let st = state(&[], true);
    let (s, v, _) = call(&st, "POST", "/verify", Some("sekret"), Some("{not json".into())).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_error(&v, "invalid_request_error", None, Some("invalid_json"));
    let (s, v) = verify(&st, json!({"context": "abc", "sampling": {}})).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_error(&v, "invalid_request_error", None, Some("invalid_json"));
    let (s, v) = verify(&st, json!({"context": [1], "sampling": {}, "surprise": 1})).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "unknown fields are refused: {v}");
    let (s, _) = verify(&st, json!({"sampling": {}})).await;
    assert_eq!(s, StatusCode::BAD_REQUEST, "context is required");
}

#[tokio::test]
async fn invalid_fields_name_their_param() {
    let st = state(&[], true);
    let cases = [
        (
            json!({"context": [1], "draft": [{"token": 2, "q": [[2, 0.5], [3, 0.4]]}], "sampling": {}}),
            "draft[0].q",
        ),
        (
            json!({"context": [1], "draft": [{"token": 2, "q": [[2, -0.5], [3, 1.5]]}], "sampling": {}}),
            "draft[0].q",
        ),
        (
            json!({"context": [1], "draft": [{"token": 2, "q": [[2, 0.5], [2, 0.5]]}], "sampling": {}}),
            "draft[0].q",
        ),
        (
            json!({"context": [1], "draft": [{"token": 2, "q": [[3, 1.0]]}], "sampling": {}}),
            "draft[0].token",
        ),
        (
            json!({"context": [1], "draft": [{"token": 99, "q": [[99, 1.0]]}], "sampling": {}}),
            "draft[0].token",
        ),
        (
            json!({"context": [1], "draft": [{"token": 2, "q": [[40, 1.0]]}], "sampling": {}}),
            "draft[0].q",
        ),
        (json!({"context": [1, 32], "sampling": {}}), "context"),
        (json!({"context": [], "sampling": {}}), "context"),
        (json!({"context": [1], "sampling": {"temperature": 3.0}}), "sampling.temperature"),
        (json!({"context": [1], "sampling": {"top_p": 0.0}}), "sampling.top_p"),
        (json!({"context": [1], "sampling": {}, "top_logprobs": 50}), "top_logprobs"),
        (json!({"context": [1], "sampling": {}, "context_start": 3}), "context_start"),
        (json!({"context": [1], "sampling": {}, "session_id": ""}), "session_id"),
        (greedy(&[1], &[1; 40]), "draft"),
    ];
    for (body, param) in cases {
        let (s, v) = verify(&st, body.clone()).await;
        assert_eq!(s, StatusCode::BAD_REQUEST, "{body} -> {v}");
        assert_error(&v, "invalid_request_error", Some(param), None);
    }
    let (s, v) = verify(&st, greedy(&[1; 62], &[1, 2, 3])).await;
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert_error(&v, "invalid_request_error", Some("context"), Some("context_length_exceeded"));
}

#[tokio::test]
async fn authentication_is_required_except_for_health() {
    let st = state(&[], true);
    for key in [None, Some("wrong"), Some("sekre"), Some("sekret2")] {
        let (s, v, _) =
            call(&st, "POST", "/verify", key, Some(greedy(&[1], &[]).to_string())).await;
        assert_eq!(s, StatusCode::UNAUTHORIZED, "{key:?}");
        assert_error(&v, "authentication_error", None, Some("invalid_api_key"));
        assert_eq!(call(&st, "GET", "/v1/info", key, None).await.0, StatusCode::UNAUTHORIZED);
        assert_eq!(call(&st, "GET", "/metrics", key, None).await.0, StatusCode::UNAUTHORIZED);
    }
    assert_eq!(call(&st, "GET", "/health", None, None).await.0, StatusCode::OK);
    let (s, v, _) = call(&st, "GET", "/v1/info", Some("sekret"), None).await;
    assert_eq!((s, v["vocab_size"].as_u64()), (StatusCode::OK, Some(VOCAB as u64)));
    // The limits a gateway must respect, so it can check its settings before it is ready.
    assert_eq!(
        (v["max_draft"].as_u64(), v["max_top_logprobs"].as_u64(), v["max_context"].as_u64()),
        (Some(32), Some(20), Some(64))
    );
    assert_eq!(
        v["features"],
        json!(["penalties", "grammar", "logprobs", "binary", "prefix_cache"])
    );
    let (_, v, _) = call(
        &state(&["--max-draft", "2", "--prefix-cache", "false"], true),
        "GET",
        "/v1/info",
        Some("sekret"),
        None,
    )
    .await;
    assert_eq!(v["max_draft"].as_u64(), Some(2));
    assert_eq!(v["features"], json!(["penalties", "grammar", "logprobs", "binary"]));
    assert_eq!(v["rule"], "ratio");
    let matching = state(&["--rule", "match"], true);
    let (_, v, _) = call(&matching, "GET", "/v1/info", Some("sekret"), None).await;
    assert_eq!(v["rule"], "match");
}

#[tokio::test]
async fn sessions_append_and_ask_for_a_resend_when_lost() {
    let st = state(&[], true);
    let mut body = greedy(&[3, 1], &[8, 25]);
    body["session_id"] = json!("s1");
    let (_, v) = verify(&st, body).await;
    assert_eq!(v["session_len"], 5); // 3 1 8 25 16
                                     // Only the new drafts: the verifier already holds the context.
    let mut next = greedy(&[], &[next_of(16)]);
    next["session_id"] = json!("s1");
    next["context_start"] = json!(5);
    let (s, v) = verify(&st, next).await;
    assert_eq!(s, StatusCode::OK, "{v}");
    assert_eq!((v["accepted"].as_u64(), v["session_len"].as_u64()), (Some(1), Some(7)));
    // Ahead of what the session holds, or an unknown session: resend.
    for (id, start) in [("s1", 9), ("nobody", 2)] {
        let mut lost = greedy(&[], &[]);
        lost["session_id"] = json!(id);
        lost["context_start"] = json!(start);
        let (s, v) = verify(&st, lost).await;
        assert_eq!(s, StatusCode::CONFLICT);
        assert_error(&v, "invalid_request_error", Some("context_start"), Some("resend_context"));
    }
    // The unknown session was not created by asking.
    let (_, text, _) = call(&st, "GET", "/metrics", Some("sekret"), None).await;
    assert!(text.as_str().unwrap().contains("\nspade_sessions 1\n"), "{text}");
    // Rolling back (context_start inside the session) replaces the tail.
    let mut rollback = greedy(&[2], &[]);
    rollback["session_id"] = json!("s1");
    rollback["context_start"] = json!(1);
    let (_, v) = verify(&st, rollback).await;
    assert_eq!(
        (v["next_token"].as_u64(), v["session_len"].as_u64()),
        (Some(next_of(2) as u64), Some(3))
    );
}

#[tokio::test]
async fn sessions_beyond_the_budget_are_evicted_oldest_first() {
    // 1 MiB budget; the fake charges 1000 bytes per cached token.
    let st = state(&["--cache-budget-mb", "1"], true);
    for i in 0..30 {
        let mut body = greedy(&[1; 40], &[]);
        body["session_id"] = json!(format!("s{i}"));
        assert_eq!(verify(&st, body).await.0, StatusCode::OK);
    }
    let mut old = greedy(&[], &[]);
    old["session_id"] = json!("s0");
    old["context_start"] = json!(41);
    assert_eq!(verify(&st, old).await.0, StatusCode::CONFLICT, "the oldest session should be gone");
    let mut recent = greedy(&[], &[]);
    recent["session_id"] = json!("s29");
    recent["context_start"] = json!(41);
    assert_eq!(verify(&st, recent).await.0, StatusCode::OK);
    let (_, text, _) = call(&st, "GET", "/metrics", Some("sekret"), None).await;
    assert!(text.as_str().unwrap().contains("spade_sessions_evicted_total"));
}

#[tokio::test]
async fn oversized_bodies_are_413() {
    let st = state(&["--max-body-bytes", "1024"], true);
    let (s, v) = verify(&st, greedy(&[1; 600], &[])).await;
    assert_eq!(s, StatusCode::PAYLOAD_TOO_LARGE);
    assert_error(&v, "invalid_request_error", None, Some("request_too_large"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_full_queue_answers_429_with_retry_after() {
    let st = state(&["--queue-size", "0", "--max-batch-sessions", "1"], true);
    let slow = {
        let st = st.clone();
        tokio::spawn(async move { verify(&st, greedy(&[SLOW_TOKEN], &[])).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let (s, v, headers) =
        call(&st, "POST", "/verify", Some("sekret"), Some(greedy(&[1], &[]).to_string())).await;
    assert_eq!(s, StatusCode::TOO_MANY_REQUESTS);
    assert_error(&v, "rate_limit_error", None, Some("queue_full"));
    assert!(headers.get(header::RETRY_AFTER).is_some());
    assert_eq!(slow.await.unwrap().0, StatusCode::OK);
    let (_, text, _) = call(&st, "GET", "/metrics", Some("sekret"), None).await;
    assert!(text.as_str().unwrap().contains("spade_verify_queue_full_total 1"));
}

/// Calls arriving while a pass runs are scored together in the next one, and each gets the answer
/// it gets alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn calls_arriving_during_a_pass_share_the_next_one() {
    let st = state(&[], true);
    let slow = {
        let st = st.clone();
        tokio::spawn(async move { verify(&st, greedy(&[SLOW_TOKEN], &[])).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    let bodies: Vec<Value> = (1..4).map(|t| greedy(&[t, t + 1], &[next_of(t + 1), 5])).collect();
    let calls: Vec<_> = bodies
        .iter()
        .map(|b| (st.clone(), b.clone()))
        .map(|(st, b)| tokio::spawn(async move { verify(&st, b).await }))
        .collect();
    let mut batched = Vec::new();
    for call in calls {
        batched.push(call.await.unwrap());
    }
    assert_eq!(slow.await.unwrap().0, StatusCode::OK);
    let alone = state(&[], true);
    for (body, (status, answer)) in bodies.iter().zip(batched) {
        assert_eq!(status, StatusCode::OK, "{answer}");
        let (_, want) = verify(&alone, body.clone()).await;
        assert_eq!(answer["accepted"], want["accepted"]);
        assert_eq!(answer["next_token"], want["next_token"]);
    }
    let (_, text, _) = call(&st, "GET", "/metrics", Some("sekret"), None).await;
    let text = text.as_str().unwrap();
    assert!(
        text.contains("spade_verify_passes_total 2")
            && text.contains("spade_verify_pass_sessions_total 4"),
        "{text}"
    );
}

#[tokio::test]
async fn unknown_routes_and_methods_are_openai_shaped() {
    let st = state(&[], true);
    let (s, v, _) = call(&st, "GET", "/nope", Some("sekret"), None).await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert_error(&v, "invalid_request_error", None, Some("not_found"));
    let (s, v, _) = call(&st, "GET", "/verify", Some("sekret"), None).await;
    assert_eq!(s, StatusCode::METHOD_NOT_ALLOWED);
    assert_error(&v, "invalid_request_error", None, Some("method_not_allowed"));
}

#[tokio::test]
async fn metrics_count_calls_and_acceptance() {
    let st = state(&[], true);
    verify(&st, greedy(&[3, 1], &[8, 25, 5])).await;
    let (s, text, headers) = call(&st, "GET", "/metrics", Some("sekret"), None).await;
    assert_eq!(s, StatusCode::OK);
    assert!(headers[header::CONTENT_TYPE].to_str().unwrap().starts_with("text/plain"));
    let text = text.as_str().unwrap().to_string();
    for line in [
        "spade_verify_calls_total 1",
        "spade_spec_decode_num_draft_tokens_total 3",
        "spade_spec_decode_num_accepted_tokens_total 2",
        "spade_spec_decode_num_accepted_tokens_per_pos{position=\"2\"} 0",
        "spade_verify_forward_seconds_count 1",
        "spade_ready 1",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
}

#[tokio::test]
async fn ended_sessions_too_short_to_cache_are_freed() {
    let st = state(&[], true);
    let mut body = greedy(&[3, 1], &[8]);
    body["session_id"] = json!("done-soon");
    assert_eq!(verify(&st, body).await.0, StatusCode::OK);
    assert_eq!(st.sessions.usage().sessions, 1);
    let (s, _, _) = call(&st, "DELETE", "/sessions/done-soon", None, None).await;
    assert_eq!(s, StatusCode::UNAUTHORIZED);
    let (s, _, _) = call(&st, "DELETE", "/sessions/done-soon", Some("sekret"), None).await;
    assert_eq!(s, StatusCode::NO_CONTENT);
    // Two tokens: less than one 16-token block, not worth a prefix cache entry.
    assert_eq!((st.sessions.usage().sessions, st.sessions.usage().cache_entries), (0, 0));
    let (s, v, _) = call(&st, "DELETE", "/sessions/done-soon", Some("sekret"), None).await;
    assert_eq!((s, v["error"]["code"].as_str()), (StatusCode::NOT_FOUND, Some("not_found")));
}
