use std::process::ExitCode;
use std::sync::Arc;

use clap::Parser;
use spade_engine::drafter::DrafterOptions;
use spade_engine::{MistralDrafter, ModelSource};
use spade_gateway::config::Command;
use spade_gateway::state::VerifierStatus;
use spade_gateway::{openapi, serve, shutdown_signal, Config, Gateway};
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> ExitCode {
    let config = Config::parse();
    if let Some(Command::Openapi) = config.command {
        println!("{}", openapi::document());
        return ExitCode::SUCCESS;
    }
    let filter = EnvFilter::try_new(&config.log).unwrap_or_else(|_| EnvFilter::new("info"));
    if config.log_json {
        tracing_subscriber::fmt().with_env_filter(filter).json().init();
    } else {
        tracing_subscriber::fmt().with_env_filter(filter).init();
    }
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
    let options = DrafterOptions { max_concurrent: config.max_concurrent, ..DrafterOptions::default() };
    let (failed_tx, failed_rx) = tokio::sync::oneshot::channel::<()>();
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
                let _ = failed_tx.send(());
            }
        }
    });
    let load_failed = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = load_failed.clone();
    let shutdown = async move {
        tokio::select! {
            _ = shutdown_signal() => {}
            Ok(()) = failed_rx => flag.store(true, std::sync::atomic::Ordering::SeqCst),
        }
    };
    if let Err(e) = serve(listener, state, shutdown).await {
        tracing::error!("server error: {e}");
        return ExitCode::from(1);
    }
    if load_failed.load(std::sync::atomic::Ordering::SeqCst) { ExitCode::from(1) } else { ExitCode::SUCCESS }
}

fn drafter_vocab(drafter: &MistralDrafter) -> u32 {
    use spade_engine::Drafter;
    drafter.meta().vocab_size
}
