use std::ops::ControlFlow;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use spade_core::batching::PassTimes;
use spade_engine::{CandleScorer, ModelSource};
use spade_verifier::engine::EngineBackend;
use spade_verifier::openapi::ApiDoc;
use spade_verifier::{router, Config, Verifier};
use utoipa::OpenApi;

#[tokio::main]
async fn main() -> ExitCode {
    let config = Config::parse();
    if let ControlFlow::Break(code) =
        spade_http::start(&config.server, config.command.as_ref(), ApiDoc::openapi, config.check())
    {
        return code;
    }
    if let Some(n) = config.threads {
        if let Err(e) = spade_engine::set_compute_threads(n) {
            tracing::warn!("could not set {n} compute threads: {e}");
        }
    }
    let state = Arc::new(Verifier::new(&config));
    tracing::info!(
        auth = state.http.api_key.is_some(),
        max_draft = config.max_draft,
        "verifier starting"
    );
    // /health answers 503 until the model is loaded.
    let model = config.model.clone().unwrap_or_default();
    let loading = match config.engine.clone() {
        Some(url) => Box::pin(connect(url, model, config.clone(), state.clone()))
            as std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), String>> + Send>>,
        None => Box::pin(load(model, config.timed_rows(), state.clone())),
    };
    spade_http::run(config.server.addr(), router(state), loading).await
}

/// With --engine: reads the served model's vocabulary from --model's GGUF metadata and waits until
/// the engine answers with that vocabulary (an engine may still be loading when we start).
async fn connect(
    url: String,
    model: String,
    config: Config,
    state: Arc<Verifier>,
) -> Result<(), String> {
    let source = ModelSource::parse(&model).map_err(|e| format!("cannot read {model}: {e}"))?;
    let (meta, tokens) = tokio::task::spawn_blocking(move || {
        let path = source.resolve()?;
        spade_engine::read_tokens(&path)
    })
    .await
    .map_err(|e| format!("the reading task failed: {e}"))?
    .map_err(|e| format!("cannot read {model}: {e}"))?;
    let mut engine = EngineBackend::new(&config, meta, &tokens)?;
    let mut waited = 0;
    while let Some(why) = engine.check(spade_verifier::engine::PROBES).await {
        // A different vocabulary will not change by waiting; an engine still loading will.
        if why.contains("not the same tokenizer") {
            return Err(format!("the engine at {url} cannot verify for {model}: {why}"));
        }
        if waited % 10 == 0 {
            tracing::info!(url = %url, "waiting for the engine: {why}");
        }
        waited += 1;
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
    if let Some(n) = engine.context_limit().await {
        engine.meta.max_context = engine.meta.max_context.min(n);
    }
    tracing::info!(url = %url, kind = config.engine_kind.as_str(), max_context = engine.meta.max_context, "engine checked; ready (rule match)");
    state.engine.set(Arc::new(engine));
    Ok(())
}

/// Loads on a blocking thread, then times blocks of `1..=timed_rows` rows: reading and preparing the
/// weights and scoring are CPU and disk work.
async fn load(model: String, timed_rows: usize, state: Arc<Verifier>) -> Result<(), String> {
    let source = ModelSource::parse(&model).map_err(|e| format!("cannot load {model}: {e}"))?;
    let (scorer, pass_times) = tokio::task::spawn_blocking(move || {
        let scorer =
            CandleScorer::load_source(&source).map_err(|e| format!("cannot load {model}: {e}"))?;
        tracing::info!(model = %model, vocab = scorer.meta_ref().vocab_size, "model loaded");
        // Without the times gateways start from their priors: worth a warning, not a verifier that will not start.
        let times = spade_engine::time_passes(&scorer, timed_rows).unwrap_or_else(|e| {
            tracing::warn!("could not time forward passes, /v1/info will report none: {e}");
            Vec::new()
        });
        Ok::<_, String>((scorer, PassTimes::new(&times)))
    })
    .await
    .map_err(|e| format!("the loading task failed: {e}"))??;
    let pass_ms: Vec<u64> = pass_times.milliseconds().iter().map(|ms| ms.round() as u64).collect();
    tracing::info!(?pass_ms, "passes of 1, 2, … rows timed; ready");
    state
        .load_model(Arc::new(scorer), pass_times)
        .map_err(|e| format!("cannot start the scoring thread: {e}"))
}
