//! Plumbing both servers share, so each server crate holds only its own routes and errors:
//! request ids with tracing spans, the body limit, bearer-token checks, the JSON-body rejection,
//! the OpenAPI bearer scheme, logging setup and graceful shutdown.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::rejection::JsonRejection;
use axum::extract::DefaultBodyLimit;
use axum::http::header::AUTHORIZATION;
use axum::http::{HeaderMap, HeaderName, Request, StatusCode};
use axum::Router;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::trace::TraceLayer;
use tracing_subscriber::EnvFilter;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};

pub const REQUEST_ID: &str = "x-request-id";

/// Body limit, then an `x-request-id` (kept from the client or made up) on every request, its
/// response, and the tracing span the request is handled in.
pub fn with_common_layers(router: Router, max_body_bytes: usize) -> Router {
    let request_id = HeaderName::from_static(REQUEST_ID);
    router
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .layer(PropagateRequestIdLayer::new(request_id.clone()))
        .layer(TraceLayer::new_for_http().make_span_with(|req: &Request<_>| {
            let id = req.headers().get(REQUEST_ID).and_then(|v| v.to_str().ok()).unwrap_or("-");
            tracing::info_span!("request", id = %id, method = %req.method(), path = %req.uri().path())
        }))
        .layer(SetRequestIdLayer::new(request_id, MakeRequestUuid))
}

/// Whether the request carries `Authorization: Bearer <key>` (always true without a key). The
/// comparison takes the same time however much of the key was right.
pub fn bearer_matches(headers: &HeaderMap, key: Option<&str>) -> bool {
    let Some(key) = key else { return true };
    let presented = headers.get(AUTHORIZATION).and_then(|h| h.to_str().ok()).and_then(|h| h.strip_prefix("Bearer ")).unwrap_or("");
    spade_core::constant_time_eq(presented.as_bytes(), key.as_bytes())
}

/// Why a JSON body was refused, before the server's own error type shapes it.
pub enum BodyRejection {
    TooLarge,
    Invalid(String),
}

impl From<JsonRejection> for BodyRejection {
    fn from(rejection: JsonRejection) -> Self {
        match rejection {
            JsonRejection::BytesRejection(_) if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE => Self::TooLarge,
            other => Self::Invalid(other.body_text()),
        }
    }
}

/// Adds the `bearer` security scheme the handlers' annotations refer to.
pub struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme("bearer", SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()));
    }
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

/// A server whose model loads in the background: it stops on a signal, or when the load fails.
pub struct BackgroundLoad {
    failed: Arc<AtomicBool>,
    tx: Option<tokio::sync::oneshot::Sender<()>>,
    rx: Option<tokio::sync::oneshot::Receiver<()>>,
}

impl Default for BackgroundLoad {
    fn default() -> Self {
        let (tx, rx) = tokio::sync::oneshot::channel();
        Self { failed: Arc::new(AtomicBool::new(false)), tx: Some(tx), rx: Some(rx) }
    }
}

impl BackgroundLoad {
    /// What the loading task calls when the model cannot be loaded (once).
    pub fn failure_reporter(&mut self) -> impl FnOnce() + Send + 'static {
        let tx = self.tx.take().expect("one failure reporter per load");
        move || {
            let _ = tx.send(());
        }
    }

    /// The shutdown future for `serve`: a signal, or the load failing.
    pub fn shutdown(&mut self) -> impl Future<Output = ()> + Send + 'static {
        let rx = self.rx.take().expect("one shutdown future per load");
        let failed = self.failed.clone();
        async move {
            tokio::select! {
                _ = shutdown_signal() => {}
                Ok(()) = rx => failed.store(true, Ordering::SeqCst),
            }
        }
    }

    pub fn failed(&self) -> bool {
        self.failed.load(Ordering::SeqCst)
    }
}
