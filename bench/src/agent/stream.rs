//! One turn as the agent's client sees it: a streamed chat completion, timed, with the usage chunk's
//! prompt-cache figures; and the verifier's prompt counters around it.
//!
//! [`crate::client`] times the same way but sends no `tools` and reads no prompt-cache fields, so the
//! agent benchmark has its own reader. Usage is read as loose JSON: a field the gateway does not send
//! (one from before the prefix cache) is `None`, not 0, so a missing figure is never reported as a
//! cache that held nothing.

use std::time::Instant;

use anyhow::{anyhow, bail, Context};
use futures::StreamExt;
use serde_json::Value;

use crate::client::SseDecoder;

/// What one turn returned and how long it took.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reply {
    pub text: String,
    pub usage: UsageFigures,
    /// Seconds from sending the request to the first chunk with content (the whole request when no
    /// chunk had any).
    pub ttft_s: f64,
    pub total_s: f64,
}

/// The usage chunk's figures the benchmark reports.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct UsageFigures {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// `prompt_tokens_details.cached_tokens`: the target's prompt tokens not recomputed.
    pub cached_tokens: Option<u64>,
    pub verify_calls: u64,
    pub degraded: bool,
}

impl UsageFigures {
    pub fn from_usage(usage: &Value) -> Self {
        let number = |path: &str| usage.pointer(path).and_then(Value::as_u64);
        Self {
            prompt_tokens: number("/prompt_tokens").unwrap_or(0),
            completion_tokens: number("/completion_tokens").unwrap_or(0),
            cached_tokens: number("/prompt_tokens_details/cached_tokens"),
            verify_calls: number("/spade/verify_calls").unwrap_or(0),
            degraded: usage.pointer("/spade/degraded").and_then(Value::as_bool).unwrap_or(false),
        }
    }
}

/// A stream being read: the text so far, the usage chunk once it came, and whether `[DONE]` did.
#[derive(Debug, Default)]
struct Folded {
    text: String,
    usage: Option<Value>,
    done: bool,
}

/// Folds one `data:` payload in; true when it carried content (for the time to first token). An
/// error event fails the turn.
fn fold(payload: &str, into: &mut Folded) -> anyhow::Result<bool> {
    if payload == "[DONE]" {
        into.done = true;
        return Ok(false);
    }
    let chunk: Value =
        serde_json::from_str(payload).with_context(|| format!("bad SSE payload {payload:?}"))?;
    if let Some(error) = chunk.get("error") {
        bail!("error event mid-stream: {error}");
    }
    let mut content = false;
    for choice in chunk["choices"].as_array().into_iter().flatten() {
        if let Some(text) =
            choice.pointer("/delta/content").and_then(Value::as_str).filter(|t| !t.is_empty())
        {
            into.text.push_str(text);
            content = true;
        }
    }
    if let Some(usage) = chunk.get("usage").filter(|u| !u.is_null()) {
        into.usage = Some(usage.clone());
    }
    Ok(content)
}

/// Sends one turn (`body`, from [`super::conversation::Conversation::request_body`]) to the gateway
/// at `base_url` and reads the stream to its end.
pub async fn stream_turn(
    client: &reqwest::Client,
    base_url: &str,
    body: &Value,
) -> anyhow::Result<Reply> {
    let started = Instant::now();
    let response = client
        .post(format!("{base_url}/v1/chat/completions"))
        .json(body)
        .send()
        .await
        .context("sending the request")?;
    let status = response.status();
    if !status.is_success() {
        bail!("gateway answered {status}: {}", response.text().await.unwrap_or_default());
    }
    let (mut folded, mut decoder, mut ttft) = (Folded::default(), SseDecoder::default(), None);
    let mut stream = response.bytes_stream();
    while let Some(bytes) = stream.next().await {
        for payload in decoder.push(&bytes.context("reading the stream")?) {
            if fold(&payload, &mut folded)? {
                ttft.get_or_insert(started.elapsed().as_secs_f64());
            }
        }
    }
    let total_s = started.elapsed().as_secs_f64();
    if !folded.done {
        bail!("the stream ended without [DONE]");
    }
    let usage = folded
        .usage
        .ok_or_else(|| anyhow!("no usage chunk (stream_options.include_usage ignored?)"))?;
    Ok(Reply {
        text: folded.text,
        usage: UsageFigures::from_usage(&usage),
        ttft_s: ttft.unwrap_or(total_s),
        total_s,
    })
}

/// The verifier's counters of prompt positions computed and found cached.
pub const PROMPT_COMPUTED: [&str; 1] = ["spade_prompt_tokens_computed_total"];
pub const PROMPT_CACHED: [&str; 1] = ["spade_prompt_tokens_cached_total"];
/// The gateway's counter of context positions its draft model computed (its rounds' prefills).
pub const DRAFT_COMPUTED: [&str; 1] = ["spade_gateway_draft_context_tokens_computed_total"];

/// The value of the first of `names` that has an unlabelled sample in a Prometheus text
/// exposition; `None` when none has (an older verifier: the figure is then unknown, not 0).
pub fn counter(metrics: &str, names: &[&str]) -> Option<f64> {
    names.iter().find_map(|name| {
        metrics.lines().filter(|l| !l.starts_with('#')).find_map(|line| {
            let (sample, value) = line.trim().split_once(char::is_whitespace)?;
            (sample == *name).then(|| value.split_whitespace().next()?.parse().ok()).flatten()
        })
    })
}

/// `after - before` where both scrapes had the counter.
pub fn delta(before: Option<f64>, after: Option<f64>) -> Option<f64> {
    Some(after? - before?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chunk(content: Option<&str>, usage: Value) -> String {
        let choices = content.map_or(
            json!([]),
            |c| json!([{"index": 0, "delta": {"content": c}, "finish_reason": null}]),
        );
        json!({"object": "chat.completion.chunk", "choices": choices, "usage": usage}).to_string()
    }

    #[test]
    fn a_stream_folds_into_text_usage_and_done() {
        let mut f = Folded::default();
        assert!(
            !fold(&chunk(Some(""), Value::Null), &mut f).unwrap(),
            "an empty delta is not content"
        );
        assert!(!fold(&json!({"choices": [{"delta": {"role": "assistant"}}]}).to_string(), &mut f)
            .unwrap());
        assert!(fold(&chunk(Some("def "), Value::Null), &mut f).unwrap());
        assert!(fold(&chunk(Some("remove"), Value::Null), &mut f).unwrap());
        assert!(!fold(&chunk(None, json!({"prompt_tokens": 9})), &mut f).unwrap());
        assert!(!f.done);
        fold("[DONE]", &mut f).unwrap();
        assert_eq!(
            (f.text.as_str(), f.done, f.usage.clone()),
            ("def remove", true, Some(json!({"prompt_tokens": 9})))
        );
        assert!(fold(r#"{"error": {"message": "verifier down"}}"#, &mut f)
            .unwrap_err()
            .to_string()
            .contains("verifier down"));
        assert!(fold("not json", &mut f).is_err());
    }

    #[test]
    fn usage_reads_the_cache_fields_and_leaves_missing_ones_unknown() {
        let usage = json!({"prompt_tokens": 2100, "completion_tokens": 48, "total_tokens": 2148,
            "prompt_tokens_details": {"cached_tokens": 1990},
            "spade": {"verify_calls": 20, "degraded": false}});
        let u = UsageFigures::from_usage(&usage);
        assert_eq!(
            (u.prompt_tokens, u.completion_tokens, u.cached_tokens, u.verify_calls),
            (2100, 48, Some(1990), 20)
        );
        let old = UsageFigures::from_usage(
            &json!({"prompt_tokens": 10, "completion_tokens": 2, "spade": {"verify_calls": 1, "degraded": true}}),
        );
        assert_eq!((old.cached_tokens, old.degraded), (None, true));
    }

    #[test]
    fn counters_are_read_by_the_first_name_present() {
        let text = "# HELP spade_prompt_tokens_computed_total x\n# TYPE spade_prompt_tokens_computed_total counter\n\
                    spade_prompt_tokens_computed_total 1234\nspade_prompt_tokens_cached_total 0\n\
                    spade_prompt_tokens_computed_total_extra 9\nspade_verify_calls_total{mode=\"x\"} 3\n";
        assert_eq!(counter(text, &PROMPT_COMPUTED), Some(1234.0));
        assert_eq!(counter(text, &PROMPT_CACHED), Some(0.0));
        assert_eq!(counter("a 1\nb 2\n", &["c", "b", "a"]), Some(2.0), "the first name present");
        assert_eq!(counter("spade_verify_calls_total 3\n", &PROMPT_COMPUTED), None);
        assert_eq!(delta(Some(10.0), Some(25.0)), Some(15.0));
        assert_eq!(delta(None, Some(25.0)), None);
    }
}
