//! The verifier client: one pooled reqwest client, timeouts on every call, bounded retries.
//!
//! A 429 is the verifier saying "later", not a failure: the client waits as its `retry-after` says
//! (seconds or an HTTP date, plus up to a fifth more, so gateways told the same second do not come
//! back together) for as long as `--busy-wait-secs` allows, without spending a retry. Retries are
//! for failures: timeouts, lost connections, 5xx; each waits a full-jitter backoff (spade-core's
//! `retry`), or longer where a 503's `retry-after` asks, and none waits past the call's deadline.
//!
//! Retrying `/verify` is safe: its randomness is keyed by (seed, position), so the same request gets
//! the same answer, and a session delta that reaches a verifier twice is refused (409), not applied
//! twice.

use std::time::{Duration, Instant, SystemTime};

use rand::Rng;
use reqwest::StatusCode;
use spade_core::grammar::GrammarConstraint;
use spade_core::protocol::{
    ModelInfo, VerifyRequest, VerifyResponse, WireDraftToken, AFFINITY_HEADER,
};
use spade_core::retry::{self, Backoff};
use spade_core::wire::{decode_response, encode_request, BINARY_CONTENT_TYPE};
use spade_core::DraftToken;
use spade_engine::round::TargetRule;
use spade_engine::speculative::{BlockVerifier, Verified, VerifyFailure};

use crate::config::Config;
use crate::state::AppState;

#[derive(Debug, Clone, thiserror::Error)]
pub enum CallError {
    /// No usable answer after the retries: connection refused, timeouts, 5xx, 429.
    #[error("{0}")]
    Unreachable(String),
    /// The verifier lost (or never had) the session: send the full context.
    #[error("the verifier asked for the full context")]
    ResendContext,
    /// A definite refusal (4xx other than 409/429) or an answer that does not parse.
    #[error("{0}")]
    Rejected(String),
}

/// One successful call with what it cost on the wire.
#[derive(Debug, Clone)]
pub struct Exchange {
    pub response: VerifyResponse,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    pub latency: Duration,
}

pub struct VerifierClient {
    http: reqwest::Client,
    base: String,
    api_key: Option<String>,
    verify_timeout: Duration,
    busy_wait: Duration,
    retries: u32,
}

const INFO_TIMEOUT: Duration = Duration::from_secs(3);

/// Waits between retries of a failed verify call: full jitter under 100 ms, 200 ms, ... up to 5 s.
const RETRY_BACKOFF: Backoff =
    Backoff { base: Duration::from_millis(100), cap: Duration::from_secs(5) };

impl VerifierClient {
    pub fn new(config: &Config) -> Result<Self, String> {
        let mut builder = reqwest::Client::builder()
            .connect_timeout(config.connect_timeout())
            .pool_idle_timeout(Duration::from_secs(90))
            .tcp_nodelay(true);
        if config.verifier_url.starts_with("https://") {
            for root in trusted_roots(config.verifier_ca.as_deref())? {
                builder = builder.add_root_certificate(root);
            }
        }
        let http = builder.build().map_err(|e| format!("building the HTTP client: {e}"))?;
        Ok(Self {
            http,
            base: config.verifier_url.trim_end_matches('/').to_string(),
            api_key: config.verifier_api_key.clone().filter(|k| !k.is_empty()),
            verify_timeout: config.verify_timeout(),
            busy_wait: config.busy_wait(),
            retries: config.verify_retries,
        })
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let builder = self.http.request(method, format!("{}{path}", self.base));
        match &self.api_key {
            Some(key) => builder.bearer_auth(key),
            None => builder,
        }
    }

    /// The verifier's model and tokenizer fingerprint (one attempt, short timeout: used by /health).
    pub async fn info(&self) -> Result<ModelInfo, CallError> {
        let response = self
            .request(reqwest::Method::GET, "/v1/info")
            .timeout(INFO_TIMEOUT)
            .send()
            .await
            .map_err(|e| CallError::Unreachable(describe(&e)))?;
        match response.status() {
            StatusCode::OK => response
                .json()
                .await
                .map_err(|e| CallError::Rejected(format!("unreadable /v1/info: {e}"))),
            StatusCode::UNAUTHORIZED => Err(CallError::Rejected(
                "the verifier refused the API key (--verifier-api-key)".into(),
            )),
            s => Err(CallError::Unreachable(format!("/v1/info answered {s}"))),
        }
    }

    /// Ends a finished generation's session: the verifier keeps its rows as a prefix cache entry or
    /// frees them (best effort: LRU eviction is the fallback). `affinity`: the conversation's key.
    pub async fn end_session(&self, id: &str, affinity: &str) {
        let sent = self
            .request(reqwest::Method::DELETE, &format!("/sessions/{id}"))
            .header(AFFINITY_HEADER, affinity)
            .timeout(INFO_TIMEOUT)
            .send()
            .await;
        if let Err(e) = sent {
            tracing::debug!("ending verifier session {id}: {}", describe(&e));
        }
    }

    /// One verify call, retried; `binary` sends and asks for the compact form of `spade_core::wire`;
    /// `affinity`: the conversation's routing key, for a load balancer in front of replicas.
    pub async fn verify(
        &self,
        request: &VerifyRequest,
        binary: bool,
        affinity: &str,
    ) -> Result<Exchange, CallError> {
        let (body, content_type) = if binary {
            (encode_request(request), BINARY_CONTENT_TYPE)
        } else {
            (
                serde_json::to_vec(request).map_err(|e| CallError::Rejected(e.to_string()))?,
                "application/json",
            )
        };
        // Waiting out 429s may take this long; each attempt has its own timeout besides.
        let patience = Instant::now() + self.busy_wait;
        let mut failures = 0;
        loop {
            let started = Instant::now();
            // What a 5xx's retry-after asks for (a loading verifier's 503 says when to come back).
            let mut asked = None;
            let sent = self
                .request(reqwest::Method::POST, "/verify")
                .header(reqwest::header::CONTENT_TYPE, content_type)
                .header(reqwest::header::ACCEPT, content_type)
                .header(AFFINITY_HEADER, affinity)
                .body(body.clone())
                .timeout(self.verify_timeout)
                .send()
                .await;
            let failed = match sent {
                Err(e) => describe(&e),
                Ok(response) => {
                    let status = response.status();
                    let retry_after = response
                        .headers()
                        .get(reqwest::header::RETRY_AFTER)
                        .and_then(|v| retry::retry_after(v.to_str().ok()?, SystemTime::now()));
                    match response.bytes().await {
                        Err(e) => describe(&e),
                        Ok(bytes) if status == StatusCode::OK => {
                            let response = if binary {
                                decode_response(&bytes).map_err(|e| e.to_string())
                            } else {
                                serde_json::from_slice(&bytes).map_err(|e| e.to_string())
                            };
                            let response = response.map_err(|e| {
                                CallError::Rejected(format!("unreadable /verify answer: {e}"))
                            })?;
                            return Ok(Exchange {
                                response,
                                bytes_sent: body.len() as u64,
                                bytes_received: bytes.len() as u64,
                                latency: started.elapsed(),
                            });
                        }
                        Ok(_) if status == StatusCode::CONFLICT => {
                            return Err(CallError::ResendContext)
                        }
                        Ok(bytes) if status == StatusCode::TOO_MANY_REQUESTS => {
                            let after = retry_after.unwrap_or(Duration::from_secs(1));
                            let wait = after.mul_f64(1.0 + rand::rng().random_range(0.0..0.2));
                            let Some(wait) = retry::within(wait, Instant::now(), patience) else {
                                return Err(CallError::Unreachable(format!(
                                    "/verify answered {status}: {}; waiting the {} s it asks would exceed --busy-wait-secs",
                                    message(&bytes),
                                    after.as_secs()
                                )));
                            };
                            tracing::debug!(
                                wait_s = wait.as_secs_f64(),
                                "verifier busy: {}",
                                message(&bytes)
                            );
                            tokio::time::sleep(wait).await;
                            continue;
                        }
                        Ok(bytes) if status.is_server_error() => {
                            asked = retry_after;
                            format!("/verify answered {status}: {}", message(&bytes))
                        }
                        Ok(bytes) if status == StatusCode::UNAUTHORIZED => {
                            return Err(CallError::Rejected(format!(
                                "the verifier refused the API key: {}",
                                message(&bytes)
                            )));
                        }
                        Ok(bytes) => {
                            return Err(CallError::Rejected(format!(
                                "/verify answered {status}: {}",
                                message(&bytes)
                            )))
                        }
                    }
                }
            };
            if failures == self.retries {
                return Err(CallError::Unreachable(failed));
            }
            let backoff = RETRY_BACKOFF.wait(failures, &mut rand::rng());
            let wait = asked.map_or(backoff, |asked| asked.max(backoff));
            // A retry may wait as long as one attempt may take; a verifier that asks for longer is
            // down for longer than this call should hang on.
            let now = Instant::now();
            let Some(wait) =
                retry::within(wait, now, now + self.verify_timeout.max(RETRY_BACKOFF.cap))
            else {
                return Err(CallError::Unreachable(format!(
                    "{failed}; it asks to retry in {} s, longer than --verify-timeout-secs",
                    wait.as_secs()
                )));
            };
            tracing::debug!(
                attempt = failures + 1,
                wait_ms = wait.as_millis() as u64,
                "retrying /verify: {failed}"
            );
            tokio::time::sleep(wait).await;
            failures += 1;
        }
    }
}

/// The roots an https verifier's certificate may chain to, besides the public ones reqwest bundles:
/// the system's trust store (where a company installs its CA) and `--verifier-ca`'s PEM file.
fn trusted_roots(ca_file: Option<&std::path::Path>) -> Result<Vec<reqwest::Certificate>, String> {
    let native = rustls_native_certs::load_native_certs();
    if !native.errors.is_empty() {
        tracing::warn!("reading the system's trust store: {:?}", native.errors);
    }
    let mut roots: Vec<_> =
        native.certs.iter().filter_map(|der| reqwest::Certificate::from_der(der).ok()).collect();
    if let Some(path) = ca_file {
        let pem =
            std::fs::read(path).map_err(|e| format!("--verifier-ca {}: {e}", path.display()))?;
        let certs = reqwest::Certificate::from_pem_bundle(&pem)
            .map_err(|e| format!("--verifier-ca {}: not PEM certificates: {e}", path.display()))?;
        if certs.is_empty() {
            return Err(format!("--verifier-ca {}: no PEM certificate in it", path.display()));
        }
        roots.extend(certs);
    }
    Ok(roots)
}

/// The `error.message` of an OpenAI-shaped body, or the body itself.
fn message(bytes: &[u8]) -> String {
    serde_json::from_slice::<spade_core::ErrorBody>(bytes)
        .map(|b| b.error.message)
        .unwrap_or_else(|_| String::from_utf8_lossy(&bytes[..bytes.len().min(200)]).into_owned())
}

fn describe(e: &reqwest::Error) -> String {
    if e.is_timeout() {
        "timed out".into()
    } else if e.is_connect() {
        // The innermost cause says which: refused, unresolvable, or a certificate not trusted
        // (`invalid peer certificate: UnknownIssuer`: see --verifier-ca).
        let mut cause: &dyn std::error::Error = e;
        while let Some(inner) = cause.source() {
            cause = inner;
        }
        format!("connection failed: {cause}")
    } else {
        e.to_string()
    }
}

/// One generation's verifier session: the loop's [`BlockVerifier`] over HTTP. Sends only the ids
/// appended since the last call, resends the full context when the verifier lost the session, and
/// frees the session when dropped.
pub struct RemoteVerifier {
    state: AppState,
    id: String,
    rule: TargetRule,
    /// Sent with every full context; the verifier's session keeps it for the calls that append.
    grammar: Option<GrammarConstraint>,
    seed: u64,
    top_logprobs: Option<u8>,
    binary: bool,
    /// The conversation's routing key ([`AFFINITY_HEADER`]).
    affinity: String,
    /// Tokens of the context the verifier's session holds; 0 sends the full context.
    synced: usize,
    /// A call was sent: the verifier may hold a session to free at the end.
    opened: bool,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    /// The prompt tokens the verifier did not recompute, from its answer to the first full context.
    pub prompt_cached_tokens: Option<u32>,
}

impl RemoteVerifier {
    pub fn new(
        state: AppState,
        rule: TargetRule,
        grammar: Option<GrammarConstraint>,
        seed: u64,
        top_logprobs: Option<u8>,
        binary: bool,
        affinity: String,
    ) -> Self {
        // 72 random bits in 12 URL-safe characters: unique enough, and short, since every call carries it.
        const ALPHABET: &[u8; 64] =
            b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
        let bits: u128 = rand::rng().random();
        let id = (0..12).map(|i| ALPHABET[(bits >> (6 * i)) as usize & 63] as char).collect();
        Self {
            state,
            id,
            rule,
            grammar,
            seed,
            top_logprobs,
            binary,
            affinity,
            synced: 0,
            opened: false,
            bytes_sent: 0,
            bytes_received: 0,
            prompt_cached_tokens: None,
        }
    }
}

#[async_trait::async_trait]
impl BlockVerifier for RemoteVerifier {
    async fn verify(
        &mut self,
        context: &[u32],
        drafts: &[DraftToken],
    ) -> Result<Verified, VerifyFailure> {
        loop {
            let request = VerifyRequest {
                session_id: Some(self.id.clone()),
                context: context[self.synced..].to_vec(),
                context_start: self.synced as u32,
                draft: drafts.iter().map(WireDraftToken::from_draft).collect(),
                sampling: self.rule.sampling,
                penalties: self.rule.penalties.clone(),
                grammar: if self.synced == 0 { self.grammar.clone() } else { None },
                seed: self.seed,
                top_logprobs: self.top_logprobs,
            };
            self.opened = true;
            let exchange =
                match self.state.verifier.verify(&request, self.binary, &self.affinity).await {
                    Err(CallError::ResendContext) if self.synced > 0 => {
                        tracing::info!("verifier lost the session; resending the full context");
                        self.synced = 0;
                        continue;
                    }
                    Err(CallError::Unreachable(e)) => return Err(VerifyFailure::Unreachable(e)),
                    Err(e) => return Err(VerifyFailure::Rejected(e.to_string())),
                    Ok(x) => x,
                };
            self.state.metrics.record_verify_latency(exchange.latency);
            self.bytes_sent += exchange.bytes_sent;
            self.bytes_received += exchange.bytes_received;
            let r = exchange.response;
            if request.context_start == 0 {
                self.prompt_cached_tokens.get_or_insert(r.cached_tokens);
            }
            let accepted = r.accepted as usize;
            if accepted > drafts.len() {
                return Err(VerifyFailure::Rejected(format!(
                    "accepted {accepted} of {} drafts",
                    drafts.len()
                )));
            }
            let mut committed: Vec<u32> = drafts[..accepted].iter().map(|d| d.token).collect();
            committed.push(r.next_token);
            let expected = context.len() + committed.len();
            if r.session_len as usize != expected {
                return Err(VerifyFailure::Rejected(format!(
                    "session length {} out of step ({expected} expected)",
                    r.session_len
                )));
            }
            self.synced = expected;
            let verifier_time = Duration::from_secs_f64(
                (r.timing.queue_ms + r.timing.forward_ms).max(0.0) / 1000.0,
            );
            return Ok(Verified {
                accepted,
                committed,
                logprobs: r.logprobs.unwrap_or_default(),
                verifier_time: Some(verifier_time),
            });
        }
    }
}

impl Drop for RemoteVerifier {
    fn drop(&mut self) {
        // The verifier holds this generation's KV cache: free it now, not at LRU eviction.
        if self.opened {
            let (state, id, affinity) = (
                self.state.clone(),
                std::mem::take(&mut self.id),
                std::mem::take(&mut self.affinity),
            );
            tokio::spawn(async move { state.verifier.end_session(&id, &affinity).await });
        }
    }
}
