//! Starting and stopping a server: the first steps of `main`, logging, serving with graceful
//! shutdown, and the model loaded in the background while the server already answers.

use std::future::Future;
use std::net::SocketAddr;
use std::ops::ControlFlow;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use tracing_subscriber::EnvFilter;
use utoipa::openapi::OpenApi;

use crate::args::{Command, ServerArgs, ServerProfile};

/// What every server's `main` does first: `openapi` prints the document and stops (exit 0);
/// otherwise logging starts, and a configuration that failed its check stops the server (exit 2).
pub fn start<P: ServerProfile>(
    args: &ServerArgs<P>,
    command: Option<&Command>,
    openapi: fn() -> OpenApi,
    check: Result<(), String>,
) -> ControlFlow<ExitCode> {
    if let Some(Command::Openapi) = command {
        println!("{}", crate::openapi::document(openapi()));
        return ControlFlow::Break(ExitCode::SUCCESS);
    }
    init_logging(&args.log, args.log_json);
    if let Err(e) = check {
        tracing::error!("{e}");
        return ControlFlow::Break(ExitCode::from(2));
    }
    ControlFlow::Continue(())
}

/// Text or JSON log lines, filtered like `RUST_LOG` (an invalid filter falls back to `info`).
pub fn init_logging(filter: &str, json: bool) {
    let filter = EnvFilter::try_new(filter).unwrap_or_else(|_| EnvFilter::new("info"));
    if json {
        tracing_subscriber::fmt().with_env_filter(filter).json().init();
    } else {
        tracing_subscriber::fmt().with_env_filter(filter).init();
    }
}

/// Serves `app` on `addr` at once, so `/health` answers while `load` runs in the background, and
/// stops on SIGINT/SIGTERM or as soon as `load` fails (its error is logged). Exit code 0 after a
/// signal, 1 when binding, serving or loading failed.
pub async fn run(
    addr: SocketAddr,
    app: Router,
    load: impl Future<Output = Result<(), String>> + Send + 'static,
) -> ExitCode {
    let listener = match tokio::net::TcpListener::bind(addr).await {
        Ok(l) => l,
        Err(e) => {
            tracing::error!("cannot bind {addr}: {e}");
            return ExitCode::from(1);
        }
    };
    tracing::info!(%addr, "listening; loading the model");
    let (failed_tx, failed_rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        if let Err(e) = load.await {
            tracing::error!("{e}");
            let _ = failed_tx.send(());
        }
    });
    let load_failed = Arc::new(AtomicBool::new(false));
    let flag = load_failed.clone();
    let shutdown = async move {
        tokio::select! {
            _ = shutdown_signal() => {}
            Ok(()) = failed_rx => flag.store(true, Ordering::SeqCst),
        }
    };
    if let Err(e) = serve(listener, app, shutdown).await {
        tracing::error!("server error: {e}");
        return ExitCode::from(1);
    }
    if load_failed.load(Ordering::SeqCst) {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

/// Serves until `shutdown` resolves, then finishes the requests in flight. The listener and the
/// signal come from the caller, so tests bind port 0 and stop the server when they like.
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await
}

/// Resolves on SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
    tracing::info!("shutting down: finishing requests in flight");
    // Leave a moment for the log line before connections close.
    tokio::time::sleep(Duration::from_millis(10)).await;
}
