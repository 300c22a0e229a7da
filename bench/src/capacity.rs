//! The verifier's capacity: how many edges one verifier serves, batched and one call at a time.
//!
//! Running 32 real gateways would measure this machine's two cores drafting, not the verifier. So
//! the benchmark first records what real edges send: a gateway drafts a few generations through a
//! recording relay in front of the verifier, which keeps every `/verify` call (body, wire form)
//! with the time the edge took before sending it (drafting and its own work). Then N virtual edges
//! replay those calls concurrently against a fresh verifier, each with its own session ids, each
//! waiting its recorded gap before every call as a separate machine would. Verification is
//! deterministic (greedy traces), so every replayed answer must equal the recorded one; a
//! difference is reported as a losslessness failure, which makes the replay a check of batching too.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use spade_core::protocol::{VerifyRequest, VerifyResponse};
use spade_core::wire::{decode_request, decode_response, encode_request, BINARY_CONTENT_TYPE};

/// One `/verify` call as an edge sent it.
#[derive(Debug, Clone)]
pub struct RecordedCall {
    pub request: VerifyRequest,
    pub binary: bool,
    pub accept_binary: bool,
    /// Since the edge's previous answer (zero for its first call).
    pub gap: Duration,
    /// The recorded verdict: (accepted, next token).
    pub answer: (u32, u32),
}

/// The calls of one generation, in order.
pub type Trace = Vec<RecordedCall>;

#[derive(Clone)]
struct Relay {
    upstream: String,
    client: reqwest::Client,
    /// Per session id: its calls so far and when its last answer came.
    calls: Arc<Mutex<HashMap<String, (Trace, Instant)>>>,
    order: Arc<Mutex<Vec<String>>>,
}

/// A relay in front of `upstream` that records `/verify` calls; [`Recorder::traces`] gives them.
pub struct Recorder {
    relay: Relay,
    pub addr: std::net::SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Recorder {
    pub async fn start(upstream: String) -> anyhow::Result<Self> {
        let relay = Relay {
            upstream,
            client: reqwest::Client::new(),
            calls: Arc::default(),
            order: Arc::default(),
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let app = axum::Router::new().fallback(forward).with_state(relay.clone());
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = stopped.await;
                })
                .await;
        });
        Ok(Self { relay, addr, stop: Some(stop) })
    }

    /// Every recorded generation, in the order their sessions started.
    pub fn traces(&self) -> Vec<Trace> {
        let calls = self.relay.calls.lock().unwrap_or_else(|p| p.into_inner());
        let order = self.relay.order.lock().unwrap_or_else(|p| p.into_inner());
        order
            .iter()
            .filter_map(|id| calls.get(id).map(|(t, _)| t.clone()))
            .filter(|t| !t.is_empty())
            .collect()
    }
}

impl Drop for Recorder {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

fn names_binary(headers: &HeaderMap, name: header::HeaderName) -> bool {
    headers.get(name).and_then(|v| v.to_str().ok()).is_some_and(|v| v.contains(BINARY_CONTENT_TYPE))
}

async fn forward(State(relay): State<Relay>, request: Request) -> Response {
    match relay_call(&relay, request).await {
        Ok(response) => response,
        Err(e) => (StatusCode::BAD_GATEWAY, format!("recording relay: {e:#}")).into_response(),
    }
}

async fn relay_call(relay: &Relay, request: Request) -> anyhow::Result<Response> {
    let (parts, body) = request.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX).await?;
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str()).to_string();
    let verify = parts.method == axum::http::Method::POST && parts.uri.path() == "/verify";
    let sent = Instant::now();
    let mut upstream = relay
        .client
        .request(parts.method.clone(), format!("{}{path}", relay.upstream))
        .body(body.clone());
    for name in [header::CONTENT_TYPE, header::ACCEPT, header::AUTHORIZATION] {
        if let Some(v) = parts.headers.get(&name) {
            upstream = upstream.header(name, v);
        }
    }
    let answer = upstream.send().await?;
    let status = answer.status();
    // A busy verifier's 429 says when to come back: the gateway behind the relay must see it.
    let kept: Vec<_> = [header::CONTENT_TYPE, header::RETRY_AFTER]
        .into_iter()
        .filter_map(|name| Some((name.clone(), answer.headers().get(name)?.clone())))
        .collect();
    let content_type =
        kept.iter().find(|(name, _)| name == header::CONTENT_TYPE).map(|(_, v)| v.clone());
    let bytes: Bytes = answer.bytes().await?;
    if verify && status.is_success() {
        let binary = names_binary(&parts.headers, header::CONTENT_TYPE);
        let request = if binary { decode_request(&body)? } else { serde_json::from_slice(&body)? };
        let answered_binary = content_type
            .as_ref()
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.contains(BINARY_CONTENT_TYPE));
        let response: VerifyResponse = if answered_binary {
            decode_response(&bytes)?
        } else {
            serde_json::from_slice(&bytes)?
        };
        let id = request.session_id.clone().unwrap_or_default();
        let mut calls = relay.calls.lock().unwrap_or_else(|p| p.into_inner());
        let (trace, last) = calls.entry(id.clone()).or_insert_with(|| {
            relay.order.lock().unwrap_or_else(|p| p.into_inner()).push(id);
            (Vec::new(), sent)
        });
        let gap = sent.saturating_duration_since(*last);
        let accept_binary = names_binary(&parts.headers, header::ACCEPT);
        trace.push(RecordedCall {
            request,
            binary,
            accept_binary,
            gap,
            answer: (response.accepted, response.next_token),
        });
        *last = Instant::now();
    }
    let mut response = (status, bytes).into_response();
    for (name, value) in kept {
        response.headers_mut().insert(name, value);
    }
    Ok(response)
}

/// What one virtual edge saw.
#[derive(Debug, Clone, Default)]
pub struct EdgeResult {
    pub committed: usize,
    pub latencies: Vec<f64>,
    pub elapsed: Duration,
    pub mismatches: usize,
    pub busy: usize,
}

/// Replays `trace` as session `tag`-prefixed ids: waits each recorded gap, sends the call in its
/// recorded wire form, checks the verdict, and ends the session.
pub async fn replay_edge(
    client: &reqwest::Client,
    url: &str,
    key: &str,
    trace: &[RecordedCall],
    tag: &str,
) -> anyhow::Result<EdgeResult> {
    let started = Instant::now();
    let mut result = EdgeResult::default();
    let mut sessions: Vec<String> = Vec::new();
    for call in trace {
        tokio::time::sleep(call.gap).await;
        let mut request = call.request.clone();
        request.session_id = request.session_id.map(|id| format!("{tag}-{id}"));
        if let Some(id) = &request.session_id {
            if !sessions.contains(id) {
                sessions.push(id.clone());
            }
        }
        let (body, content_type) = if call.binary {
            (encode_request(&request), BINARY_CONTENT_TYPE)
        } else {
            (serde_json::to_vec(&request)?, "application/json")
        };
        let accept = if call.accept_binary { BINARY_CONTENT_TYPE } else { "application/json" };
        let response = loop {
            let t = Instant::now();
            let r = client
                .post(format!("{url}/verify"))
                .bearer_auth(key)
                .header(header::CONTENT_TYPE, content_type)
                .header(header::ACCEPT, accept)
                .body(body.clone())
                .send()
                .await?;
            if r.status() == StatusCode::TOO_MANY_REQUESTS {
                result.busy += 1;
                let after = r
                    .headers()
                    .get(header::RETRY_AFTER)
                    .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
                tokio::time::sleep(after.map_or(Duration::from_millis(50), Duration::from_secs))
                    .await;
                continue;
            }
            if !r.status().is_success() {
                bail!("verify answered {}: {}", r.status(), r.text().await.unwrap_or_default());
            }
            let binary = names_binary(r.headers(), header::CONTENT_TYPE);
            let bytes = r.bytes().await?;
            result.latencies.push(t.elapsed().as_secs_f64());
            let response: VerifyResponse =
                if binary { decode_response(&bytes)? } else { serde_json::from_slice(&bytes)? };
            break response;
        };
        result.committed += response.accepted as usize + 1;
        if (response.accepted, response.next_token) != call.answer {
            result.mismatches += 1;
        }
    }
    for id in sessions {
        client
            .delete(format!("{url}/sessions/{id}"))
            .bearer_auth(key)
            .send()
            .await
            .context("ending a session")?;
    }
    result.elapsed = started.elapsed();
    Ok(result)
}

/// One (mode, N) measurement.
#[derive(Debug, Clone, Serialize)]
pub struct CapacityPoint {
    pub mode: String,
    pub edges: usize,
    pub wall_s: f64,
    pub committed: usize,
    pub tokens_per_s: f64,
    /// Committed tokens per second of each edge's own run: median and lowest.
    pub edge_tokens_per_s_median: f64,
    pub edge_tokens_per_s_min: f64,
    pub latency_p50_ms: f64,
    pub latency_p99_ms: f64,
    pub verifier_cpu_s_per_token: f64,
    pub verifier_rss_peak_mb: f64,
    pub mismatches: usize,
    pub busy: usize,
}

/// The q-quantile of sorted values (nearest rank).
fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

impl CapacityPoint {
    pub fn of(
        mode: &str,
        edges: &[EdgeResult],
        wall: Duration,
        cpu_s: f64,
        rss_peak_mb: f64,
    ) -> Self {
        let committed: usize = edges.iter().map(|e| e.committed).sum();
        let mut latencies: Vec<f64> =
            edges.iter().flat_map(|e| e.latencies.iter().copied()).collect();
        latencies.sort_by(f64::total_cmp);
        let mut rates: Vec<f64> =
            edges.iter().map(|e| e.committed as f64 / e.elapsed.as_secs_f64().max(1e-9)).collect();
        rates.sort_by(f64::total_cmp);
        Self {
            mode: mode.to_string(),
            edges: edges.len(),
            wall_s: wall.as_secs_f64(),
            committed,
            tokens_per_s: committed as f64 / wall.as_secs_f64().max(1e-9),
            edge_tokens_per_s_median: quantile(&rates, 0.5),
            edge_tokens_per_s_min: rates.first().copied().unwrap_or(f64::NAN),
            latency_p50_ms: quantile(&latencies, 0.5) * 1e3,
            latency_p99_ms: quantile(&latencies, 0.99) * 1e3,
            verifier_cpu_s_per_token: cpu_s / committed.max(1) as f64,
            verifier_rss_peak_mb: rss_peak_mb,
            mismatches: edges.iter().map(|e| e.mismatches).sum(),
            busy: edges.iter().map(|e| e.busy).sum(),
        }
    }
}

/// The results as a markdown table, with the operator's figure: the most edges served at once with
/// every edge at `min_rate` tokens/s or more, per verifier core.
pub fn report(points: &[CapacityPoint], min_rate: f64, verifier_cores: usize) -> String {
    let mut out = String::from(
        "| mode | edges | tokens/s (all) | per edge: median / lowest | verify p50 / p99 ms | verifier CPU-s per token | verifier RSS MB | answers differing |\n|---|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for p in points {
        out.push_str(&format!(
            "| {} | {} | {:.2} | {:.2} / {:.2} | {:.0} / {:.0} | {:.3} | {:.0} | {} |\n",
            p.mode,
            p.edges,
            p.tokens_per_s,
            p.edge_tokens_per_s_median,
            p.edge_tokens_per_s_min,
            p.latency_p50_ms,
            p.latency_p99_ms,
            p.verifier_cpu_s_per_token,
            p.verifier_rss_peak_mb,
            p.mismatches
        ));
    }
    let mut modes: Vec<&str> = points.iter().map(|p| p.mode.as_str()).collect();
    modes.dedup();
    for mode in modes {
        let served = points
            .iter()
            .filter(|p| p.mode == mode && p.edge_tokens_per_s_min >= min_rate)
            .map(|p| p.edges)
            .max()
            .unwrap_or(0);
        out.push_str(&format!(
            "\n- {mode}: {served} edges at ≥ {min_rate} tokens/s each ({:.1} per verifier core)",
            served as f64 / verifier_cores.max(1) as f64
        ));
    }
    let mut counts: Vec<usize> = points.iter().map(|p| p.edges).collect();
    counts.sort_unstable();
    counts.dedup();
    for n in counts {
        let find = |m: &str| points.iter().find(|p| p.mode == m && p.edges == n);
        if let (Some(b), Some(u)) = (find("batched"), find("one at a time")) {
            if n > 1 {
                out.push_str(&format!(
                    "\n- {n} edges: batched / one at a time = {:.2}x tokens/s",
                    b.tokens_per_s / u.tokens_per_s.max(1e-9)
                ));
            }
        }
    }
    out.push('\n');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn edge(committed: usize, secs: f64, latencies: &[f64]) -> EdgeResult {
        EdgeResult {
            committed,
            latencies: latencies.to_vec(),
            elapsed: Duration::from_secs_f64(secs),
            mismatches: 0,
            busy: 0,
        }
    }

    #[test]
    fn a_point_sums_edges_and_the_report_finds_the_edges_served() {
        let one = CapacityPoint::of(
            "batched",
            &[edge(40, 2.0, &[0.1, 0.2])],
            Duration::from_secs(2),
            4.0,
            900.0,
        );
        assert_eq!((one.committed, one.tokens_per_s, one.edge_tokens_per_s_min), (40, 20.0, 20.0));
        assert!((one.verifier_cpu_s_per_token - 0.1).abs() < 1e-12);
        let two = CapacityPoint::of(
            "batched",
            &[edge(40, 4.0, &[0.1]), edge(20, 4.0, &[0.3, 0.5])],
            Duration::from_secs(4),
            6.0,
            950.0,
        );
        assert_eq!(
            (two.tokens_per_s, two.edge_tokens_per_s_min, two.latency_p99_ms),
            (15.0, 5.0, 500.0)
        );
        let slow = CapacityPoint::of(
            "one at a time",
            &[edge(40, 4.0, &[0.1]), edge(40, 8.0, &[0.3])],
            Duration::from_secs(8),
            6.0,
            950.0,
        );
        let text = report(&[one, two, slow], 10.0, 1);
        assert!(text.contains("- batched: 1 edges at ≥ 10 tokens/s each"), "{text}");
        assert!(text.contains("- one at a time: 0 edges"), "{text}");
        assert!(text.contains("- 2 edges: batched / one at a time = 1.50x tokens/s"), "{text}");
    }
}
