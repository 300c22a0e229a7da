use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use spade_engine::drafter::DrafterOptions;
use spade_engine::{MistralDrafter, ModelSource};
use spade_gateway::config::Command;
use spade_gateway::state::VerifierStatus;
use spade_gateway::{openapi, serve, Config, Gateway};

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
    for warning in config.warnings() {
        tracing::warn!("{warning}");
    }
    let state = match Gateway::new(&config) {
        Ok(g) => Arc::new(g),
        Err(e) => {
            tracing::error!("{e}");
            return ExitCode::from(2);
        }
    };
    let listener = match tokio::net::TcpListener::bind(config.addr()).await {
        Ok(l) => l,
        Err(e) => {
            tracing::error!("cannot bind {}: {e}", config.addr());
            return ExitCode::from(1);
        }
    };
    tracing::info!(addr = %config.addr(), verifier = %config.verifier_url, draft_len = config.draft_len, "listening; loading the draft model");

    // Load in the background: /health answers 503 until the model is ready and the verifier matches.
    let model = config.draft_model.clone().unwrap_or_default();
    let options = DrafterOptions {
        max_concurrent: config.max_concurrent,
        cache_budget_bytes: (config.draft_cache_mb > 0).then(|| config.draft_cache_mb << 20),
        ..DrafterOptions::default()
    };
    let mut load = spade_http::BackgroundLoad::default();
    let report_failure = load.failure_reporter();
    let loading = state.clone();
    tokio::spawn(async move {
        let loaded = match ModelSource::parse(&model) {
            Ok(source) => MistralDrafter::load(&source, options).await,
            Err(e) => Err(e),
        };
        match loaded {
            Ok(drafter) => {
                tracing::info!(model = %model, vocab = drafter_vocab(&drafter), "draft model loaded");
                loading.set_model(Arc::new(drafter));
                match loading.check_verifier().await {
                    VerifierStatus::Ready(info) => tracing::info!(verifier_model = %info.model, "verifier matches; ready"),
                    VerifierStatus::Unreachable(e) => tracing::warn!("verifier not reachable yet ({e}); /health says not ready until it is"),
                    VerifierStatus::Mismatch(e) => tracing::error!("{e}"),
                }
            }
            Err(e) => {
                tracing::error!("cannot load {model}: {e}");
                report_failure();
            }
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

fn drafter_vocab(drafter: &MistralDrafter) -> u32 {
    use spade_engine::Drafter;
    drafter.meta().vocab_size
}
