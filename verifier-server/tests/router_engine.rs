//! Router tests of a verifier on a serving engine (`--engine`), against a stand-in engine that
//! answers the few calls under test (the real engines are exercised in the gateway's engine tests).

mod common;

use common::*;

/// With --engine, `/health` checks the engine (its vocabulary size and how it spells a few tokens) but
/// reuses a check younger than HEALTH_TTL, so frequent probes do not each cost the engine calls; an
/// engine with another tokenizer makes the verifier unready, naming why.
#[tokio::test]
async fn engine_health_is_checked_then_reused_for_a_while() {
    use spade_verifier::engine::{EngineBackend, HEALTH_TTL};
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    // A stand-in for llama-server's two endpoints the check uses, counting the calls. Its
    // detokenizer spells token i as "t{i}".
    let calls = Arc::new(AtomicUsize::new(0));
    let (models, detokenize) = (calls.clone(), calls.clone());
    let engine = axum::Router::new()
        .route(
            "/v1/models",
            axum::routing::get(move || async move {
                models.fetch_add(1, SeqCst);
                axum::Json(json!({"data": [{"meta": {"n_vocab": VOCAB}}]}))
            }),
        )
        .route(
            "/detokenize",
            axum::routing::post(move |axum::Json(body): axum::Json<Value>| async move {
                detokenize.fetch_add(1, SeqCst);
                axum::Json(json!({"content": format!("t{}", body["tokens"][0])}))
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, engine).await });

    let with_engine = |spelling: fn(u32) -> String| {
        let args = ["--engine", url.as_str(), "--engine-kind", "llama-server"];
        let st = state(&args, false);
        let mut argv = vec!["spade-verifier", "--model", "fake.gguf"];
        argv.extend_from_slice(&args);
        let tokens: Vec<String> = (0..VOCAB).map(spelling).collect();
        let backend =
            EngineBackend::new(&Config::parse_from(argv), meta("fake", VOCAB, 64), &tokens);
        st.engine.set(Arc::new(backend.unwrap()));
        st
    };
    let health = |st: Arc<Verifier>| async move { call(&st, "GET", "/health", None, None).await };

    let st = with_engine(|i| format!("t{i}"));
    let (status, body, _) = health(st.clone()).await;
    assert_eq!((status, body["status"].as_str()), (StatusCode::OK, Some("ready")), "{body}");
    let per_check = calls.load(SeqCst);
    assert!(per_check >= 2, "one vocabulary call and at least one spelling: {per_check}");
    for _ in 0..5 {
        assert_eq!(health(st.clone()).await.0, StatusCode::OK);
    }
    assert_eq!(calls.load(SeqCst), per_check, "probes within HEALTH_TTL reuse the check");
    tokio::time::sleep(HEALTH_TTL).await;
    assert_eq!(health(st.clone()).await.0, StatusCode::OK);
    assert_eq!(calls.load(SeqCst), 2 * per_check, "an older check is made again");

    let other = with_engine(|i| format!("other{i}"));
    let (status, body, _) = health(other).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(body["status"], "engine_unavailable");
    assert!(body["detail"].as_str().unwrap().contains("not the same tokenizer"), "{body}");
}
