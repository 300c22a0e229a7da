//! spade-delay-proxy: a TCP proxy that emulates an edge–cloud link on loopback.
//!
//! Put it between the gateway and the verifier (point the gateway's verifier address at `--listen`)
//! to give their calls a real round-trip time without `tc netem`, which this kernel lacks. See
//! `spade_delay_proxy::link` for the model.

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use spade_delay_proxy::{run_proxy, LinkConfig};
use tokio::net::TcpListener;
use tracing_subscriber::EnvFilter;

#[derive(Debug, Parser)]
#[command(
    name = "spade-delay-proxy",
    version,
    about = "TCP proxy that delays traffic like an edge-cloud link (userspace stand-in for tc netem)",
    after_help = "Each direction adds RTT/2 plus jitter to every chunk, in order; bandwidth is unlimited. \
                  A \"lost\" chunk is not dropped: it is delayed by max(200 ms, 2*RTT), the cost of a TCP \
                  retransmission timeout."
)]
struct Args {
    /// Address to listen on, e.g. 127.0.0.1:9081.
    #[arg(long, env = "SPADE_PROXY_LISTEN")]
    listen: String,

    /// Where to relay each connection, HOST:PORT.
    #[arg(long, env = "SPADE_PROXY_UPSTREAM")]
    upstream: String,

    /// Round-trip time in milliseconds; each direction adds half.
    #[arg(long, env = "SPADE_PROXY_RTT_MS")]
    rtt_ms: u64,

    /// Extra one-way delay per chunk, drawn uniformly from [0, N] milliseconds.
    #[arg(long, env = "SPADE_PROXY_JITTER_MS", default_value_t = 0)]
    jitter_ms: u64,

    /// Percentage of chunks that pay a retransmission timeout, max(200 ms, 2*RTT).
    #[arg(long, env = "SPADE_PROXY_LOSS_PCT", default_value_t = 0.0, value_parser = percentage)]
    loss_pct: f64,

    /// Seed for jitter and loss, so a run repeats (default: random, logged at start).
    #[arg(long, env = "SPADE_PROXY_SEED")]
    seed: Option<u64>,

    /// Log filter (tracing-subscriber syntax), e.g. `info` or `spade_delay_proxy=debug` for every connection.
    #[arg(long, env = "SPADE_PROXY_LOG", default_value = "info")]
    log: String,
}

fn percentage(s: &str) -> Result<f64, String> {
    let p: f64 = s.parse().map_err(|e| format!("{e}"))?;
    if (0.0..=100.0).contains(&p) {
        Ok(p)
    } else {
        Err(format!("{p} is not a percentage in [0, 100]"))
    }
}

impl Args {
    fn link(&self) -> LinkConfig {
        LinkConfig {
            rtt: Duration::from_millis(self.rtt_ms),
            jitter: Duration::from_millis(self.jitter_ms),
            loss: self.loss_pct / 100.0,
            seed: self.seed,
        }
    }
}

/// Ctrl-C, or SIGTERM where there is one (as `docker stop` sends).
async fn stop_requested() {
    #[cfg(unix)]
    if let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
    {
        tokio::select! { _ = tokio::signal::ctrl_c() => {}, _ = term.recv() => {} }
        return;
    }
    let _ = tokio::signal::ctrl_c().await;
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let filter = EnvFilter::try_new(&args.log).unwrap_or_else(|_| EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(filter).init();
    let listener = match TcpListener::bind(&args.listen).await {
        Ok(l) => l,
        Err(e) => {
            tracing::error!("cannot bind {}: {e}", args.listen);
            return ExitCode::from(1);
        }
    };
    match run_proxy(listener, args.upstream.clone(), args.link(), stop_requested()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            ExitCode::from(2)
        }
    }
}
