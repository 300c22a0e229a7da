use std::ops::ControlFlow;
use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use spade_engine::drafter::DrafterOptions;
use spade_engine::{Drafter, MistralDrafter, ModelSource};
use spade_gateway::openapi::ApiDoc;
use spade_gateway::state::VerifierStatus;
use spade_gateway::{router, Config, Gateway};
use utoipa::OpenApi;

#[tokio::main]
async fn main() -> ExitCode {
    let config = Config::parse();
    if let ControlFlow::Break(code) =
        spade_http::start(&config.server, config.command.as_ref(), ApiDoc::openapi, config.check())
    {
        return code;
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
    tracing::info!(verifier = %config.verifier_url, draft_len = %config.draft_len, "gateway starting");
    // /health answers 503 until the draft model is loaded and the verifier matches.
    spade_http::run(config.server.addr(), router(state.clone()), load(config, state)).await
}

async fn load(config: Config, state: Arc<Gateway>) -> Result<(), String> {
    let model = config.draft_model.clone().unwrap_or_default();
    let options = DrafterOptions {
        max_concurrent: config.max_concurrent,
        cache_budget_bytes: (config.draft_cache_mb > 0).then_some(config.draft_cache_mb << 20),
    };
    let source = ModelSource::parse(&model).map_err(|e| format!("cannot load {model}: {e}"))?;
    let drafter = MistralDrafter::load(&source, options)
        .await
        .map_err(|e| format!("cannot load {model}: {e}"))?;
    tracing::info!(model = %model, vocab = drafter.meta().vocab_size, "draft model loaded");
    state.draft_model.set(Arc::new(drafter));
    match state.check_verifier().await {
        VerifierStatus::Ready(info) => {
            tracing::info!(verifier_model = %info.model, "verifier matches; ready")
        }
        VerifierStatus::Unreachable(e) => {
            tracing::warn!("verifier not reachable yet ({e}); /health says not ready until it is")
        }
        VerifierStatus::Mismatch(e) => tracing::error!("{e}"),
    }
    Ok(())
}
