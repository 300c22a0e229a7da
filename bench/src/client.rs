//! The benchmark's client: one streamed chat completion, timed as a user would see it.
//!
//! Every request streams (`stream: true` with `stream_options.include_usage`), so time to first
//! token is measured at the client, and the usage chunk at the end carries the gateway's accounting
//! (verify calls, accepted drafts, drafting ahead, where the time went, bytes on the wire).
//!
//! The chunks are read with the benchmark's own lenient types rather than `spade_core`'s: every
//! field of `usage.spade` defaults when absent, so a gateway from before a field existed still
//! gives the figures it has.

use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context};
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::prompts::Message;

/// What to ask for.
#[derive(Debug, Clone)]
pub struct ChatRequest<'a> {
    pub messages: &'a [Message],
    pub max_tokens: u32,
    pub temperature: f64,
    pub seed: u64,
}

/// What one request returned and how long it took.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Outcome {
    pub text: String,
    pub completion_tokens: u64,
    pub accepted: u64,
    pub rejected: u64,
    pub verify_calls: u64,
    pub bytes_sent: u64,
    pub bytes_received: u64,
    pub degraded: bool,
    /// Seconds from sending the request to the first non-empty text delta (the whole request when
    /// no text came).
    pub ttft_s: f64,
    /// Seconds from sending the request to `[DONE]`.
    pub total_s: f64,
    /// The draft length the gateway ran the request with (`usage.spade.draft_len`: a number or "auto").
    pub draft_len: Option<Value>,
    /// Rounds that drafted ahead while a block was verified, and pre-drafted blocks that were sent.
    pub ahead_drafted: u64,
    pub ahead_used: u64,
    /// Where the generation's time went (`usage.spade.timing`), seconds over the whole request.
    pub timing: RoundTiming,
    /// Under `auto`: the gateway's last choice and the estimates behind it, as it sent them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub auto: Option<Value>,
}

/// `usage.spade.timing`: seconds of drafting waited for, drafting hidden under verify calls, verify
/// calls minus the verifier's own time (the link), and the verifier's own time (queue + forward).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RoundTiming {
    pub draft_s: f64,
    pub overlap_s: f64,
    pub link_s: f64,
    pub verifier_s: f64,
}

/// The parts of a `chat.completion.chunk` the benchmark reads; everything else is ignored.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct WireChunk {
    choices: Vec<WireChoice>,
    usage: Option<WireUsage>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct WireChoice {
    delta: WireDelta,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct WireDelta {
    content: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct WireUsage {
    completion_tokens: u64,
    spade: Option<WireSpade>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
struct WireSpade {
    verify_calls: u64,
    /// The draft model's tokens proposed and accepted.
    drafted: u64,
    draft_accepted: u64,
    draft_len: Option<Value>,
    ahead_drafted: u64,
    ahead_used: u64,
    timing: RoundTiming,
    auto: Option<Value>,
    bytes_sent: u64,
    bytes_received: u64,
    degraded: bool,
}

/// Splits a byte stream of Server-Sent Events into the payloads of its `data:` lines. Bytes may
/// arrive cut anywhere, even inside a UTF-8 character, so only complete lines are decoded.
#[derive(Debug, Default)]
pub struct SseDecoder {
    pending: Vec<u8>,
}

impl SseDecoder {
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.pending.extend_from_slice(bytes);
        let mut payloads = Vec::new();
        while let Some(end) = self.pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.pending.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line);
            let line = line.trim_end_matches(['\n', '\r']);
            if let Some(data) = line.strip_prefix("data:") {
                payloads.push(data.strip_prefix(' ').unwrap_or(data).to_string());
            }
        }
        payloads
    }
}

/// Folds one `data:` payload into `out`; true at `[DONE]`. An error event fails the request.
fn apply(
    payload: &str,
    out: &mut Outcome,
    usage: &mut Option<WireUsage>,
    first_text: &mut bool,
) -> anyhow::Result<bool> {
    if payload == "[DONE]" {
        return Ok(true);
    }
    let value: Value =
        serde_json::from_str(payload).with_context(|| format!("bad SSE payload {payload:?}"))?;
    if let Some(error) = value.get("error") {
        bail!("error event mid-stream: {error}");
    }
    let chunk: WireChunk =
        serde_json::from_value(value).with_context(|| format!("not a chunk: {payload:?}"))?;
    for choice in &chunk.choices {
        if let Some(text) = choice.delta.content.as_deref().filter(|t| !t.is_empty()) {
            *first_text = true;
            out.text.push_str(text);
        }
    }
    if chunk.usage.is_some() {
        *usage = chunk.usage;
    }
    Ok(false)
}

/// Sends one streamed chat completion to `base_url` (the gateway) and reads it to the end.
/// `on_text` sees every text delta as it arrives, with the seconds since the request was sent.
pub async fn stream_chat(
    client: &reqwest::Client,
    base_url: &str,
    req: &ChatRequest<'_>,
    on_text: &mut dyn FnMut(&str, f64),
) -> anyhow::Result<Outcome> {
    let body = json!({
        "model": "spade",
        "messages": req.messages,
        "max_tokens": req.max_tokens,
        "temperature": req.temperature,
        "seed": req.seed,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let started = Instant::now();
    let response = client
        .post(format!("{base_url}/v1/chat/completions"))
        .json(&body)
        .send()
        .await
        .context("sending the request")?;
    let status = response.status();
    if !status.is_success() {
        let text = response.text().await.unwrap_or_default();
        bail!("gateway answered {status}: {text}");
    }
    let mut out = Outcome::default();
    let (mut usage, mut ttft, mut done) = (None, None::<Duration>, false);
    let mut decoder = SseDecoder::default();
    let mut stream = response.bytes_stream();
    while let Some(bytes) = stream.next().await {
        let bytes = bytes.context("reading the stream")?;
        for payload in decoder.push(&bytes) {
            let (mut first_text, before) = (false, out.text.len());
            done |= apply(&payload, &mut out, &mut usage, &mut first_text)?;
            if first_text {
                let now = started.elapsed();
                ttft.get_or_insert(now);
                on_text(&out.text[before..], now.as_secs_f64());
            }
        }
    }
    out.total_s = started.elapsed().as_secs_f64();
    out.ttft_s = ttft.map_or(out.total_s, |t| t.as_secs_f64());
    if !done {
        bail!("the stream ended without [DONE]");
    }
    let usage =
        usage.ok_or_else(|| anyhow!("no usage chunk (stream_options.include_usage ignored?)"))?;
    let spade = usage.spade.ok_or_else(|| anyhow!("usage has no `spade` object"))?;
    out.completion_tokens = usage.completion_tokens;
    out.accepted = spade.draft_accepted;
    out.rejected = spade.drafted.saturating_sub(spade.draft_accepted);
    out.verify_calls = spade.verify_calls;
    out.bytes_sent = spade.bytes_sent;
    out.bytes_received = spade.bytes_received;
    out.degraded = spade.degraded;
    out.draft_len = spade.draft_len;
    out.ahead_drafted = spade.ahead_drafted;
    out.ahead_used = spade.ahead_used;
    out.timing = spade.timing;
    out.auto = spade.auto;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_payloads_survive_arbitrary_cuts() {
        let stream = "data: {\"a\":\"é\"}\r\n\n: keep-alive\n\ndata: [DONE]\n\n";
        for cut in 0..stream.len() {
            let bytes = stream.as_bytes();
            let mut d = SseDecoder::default();
            let mut got = d.push(&bytes[..cut]);
            got.extend(d.push(&bytes[cut..]));
            assert_eq!(
                got,
                vec!["{\"a\":\"é\"}".to_string(), "[DONE]".to_string()],
                "cut at {cut}"
            );
        }
    }

    fn chunk(content: Option<&str>, usage: Option<Value>) -> String {
        let choices = match content {
            Some(c) => {
                json!([{"index": 0, "delta": {"content": c}, "logprobs": null, "finish_reason": null}])
            }
            None => json!([]),
        };
        json!({"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "spade", "choices": choices, "usage": usage}).to_string()
    }

    #[test]
    fn chunks_fold_into_text_and_usage() {
        let usage = json!({"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
            "completion_tokens_details": {"accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0},
            "spade": {"verify_calls": 1, "drafted": 3, "draft_accepted": 2, "mean_tokens_per_call": 3.0, "draft_len": 2, "bytes_sent": 100, "bytes_received": 50, "degraded": false}});
        let (mut out, mut u, mut first) = (Outcome::default(), None, false);
        assert!(!apply(&chunk(Some(""), None), &mut out, &mut u, &mut first).unwrap());
        assert!(!first, "an empty delta is not the first token");
        assert!(!apply(&chunk(Some("Hi"), None), &mut out, &mut u, &mut first).unwrap());
        assert!(first);
        assert!(!apply(&chunk(None, Some(usage)), &mut out, &mut u, &mut first).unwrap());
        assert!(apply("[DONE]", &mut out, &mut u, &mut first).unwrap());
        assert_eq!(out.text, "Hi");
        let spade = u.unwrap().spade.unwrap();
        assert_eq!(spade.verify_calls, 1);
        assert_eq!(
            (spade.ahead_drafted, spade.timing),
            (0, RoundTiming::default()),
            "fields an older gateway lacks default to 0"
        );
    }

    #[test]
    fn the_new_usage_fields_are_read() {
        let usage = json!({"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14,
            "completion_tokens_details": {"accepted_prediction_tokens": 6, "rejected_prediction_tokens": 2},
            "spade": {"verify_calls": 3, "mean_tokens_per_call": 3.0, "draft_len": "auto", "ahead_drafted": 2, "ahead_used": 1,
                "timing": {"draft_s": 0.5, "overlap_s": 0.25, "link_s": 0.3, "verifier_s": 0.9},
                "auto": {"draft": 4, "p_hit": 0.6, "alpha": [0.9, 0.8]}, "bytes_sent": 10, "bytes_received": 5, "degraded": false}});
        let (mut out, mut u, mut first) = (Outcome::default(), None, false);
        apply(&chunk(None, Some(usage)), &mut out, &mut u, &mut first).unwrap();
        let spade = u.unwrap().spade.unwrap();
        assert_eq!((spade.ahead_drafted, spade.ahead_used), (2, 1));
        assert_eq!(
            spade.timing,
            RoundTiming { draft_s: 0.5, overlap_s: 0.25, link_s: 0.3, verifier_s: 0.9 }
        );
        assert_eq!(spade.draft_len, Some(json!("auto")));
        assert_eq!(spade.auto.unwrap()["draft"], 4);
    }

    #[test]
    fn an_error_event_fails_the_request() {
        let (mut out, mut u, mut first) = (Outcome::default(), None, false);
        let err = apply(r#"{"error":{"message":"verifier down"}}"#, &mut out, &mut u, &mut first)
            .unwrap_err();
        assert!(err.to_string().contains("verifier down"), "{err}");
        assert!(apply("not json", &mut out, &mut u, &mut first).is_err());
    }
}
