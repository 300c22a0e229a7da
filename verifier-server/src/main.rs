use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use spade_engine::{CandleScorer, ModelSource};
use spade_verifier::config::Command;
use spade_verifier::{openapi, serve, Config, Verifier};

#[tokio::main]
async fn main() -> ExitCode {
    let config = Config::parse();
    if let Some(Command::Openapi) = config.command {
        println!("{}", openapi::document());
        return ExitCode::SUCCESS;
    }
    spade_http::init_logging(&config.log, config.log_json);
    if let Err(e) = config.check() {
        tracing::error!("{e}");
        return ExitCode::from(2);
    }
    if let Some(n) = config.threads {
        if let Err(e) = spade_engine::set_compute_threads(n) {
            tracing::warn!("could not set {n} compute threads: {e}");
        }
    }
    let state = Arc::new(Verifier::new(&config));
    let listener = match tokio::net::TcpListener::bind(config.addr()).await {
        Ok(l) => l,
        Err(e) => {
            tracing::error!("cannot bind {}: {e}", config.addr());
            return ExitCode::from(1);
        }
    };
    tracing::info!(addr = %config.addr(), auth = state.api_key.is_some(), "listening; loading the model");

    // Load in the background: /health answers 503 until the model is ready.
    let model = config.model.clone().unwrap_or_default();
    let mut load = spade_http::BackgroundLoad::default();
    let report_failure = load.failure_reporter();
    let loading = state.clone();
    tokio::task::spawn_blocking(move || match ModelSource::parse(&model).and_then(|source| CandleScorer::load_source(&source)) {
        Ok(scorer) => {
            tracing::info!(model = %model, vocab = scorer.meta_ref().vocab_size, "model loaded; ready");
            loading.set_scorer(Arc::new(scorer));
        }
        Err(e) => {
            tracing::error!("cannot load {model}: {e}");
            report_failure();
        }
    });
    let shutdown = load.shutdown();
    if let Err(e) = serve(listener, state, shutdown).await {
        tracing::error!("server error: {e}");
        return ExitCode::from(1);
    }
    if load.failed() {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}
