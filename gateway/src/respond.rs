//! Shapes generation events into OpenAI answers: one `chat.completion`, or SSE chunks framed exactly
//! like OpenAI's (role first, content deltas, a finish chunk, an optional usage chunk with
//! `choices: []`, then `data: [DONE]` once; an error mid-stream is one `data: {"error": ...}` event
//! and the end of the stream).

use std::convert::Infallible;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use futures::{Stream, StreamExt};
use rand::Rng;
use spade_core::openai::{
    AssistantMessage, ChatCompletion, ChatCompletionChunk, Choice, ChoiceLogprobs, ChunkChoice, CompletionTokensDetails, Delta, FinishReason, Role, SpadeUsage,
    TokenLogprobContent, Usage,
};
use tokio::sync::mpsc;

use crate::error::ApiError;
use crate::generation::Event;
use crate::metrics::GenerationRecord;

/// What every chunk of one answer shares.
#[derive(Debug, Clone)]
pub struct Meta {
    id: String,
    created: u64,
    model: String,
    prompt_tokens: usize,
    logprobs: bool,
}

impl Meta {
    pub fn new(model: &str, prompt_tokens: usize, logprobs: bool) -> Self {
        Self {
            id: format!("chatcmpl-{:024x}", rand::rng().random::<u128>() >> 32),
            created: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
            model: model.to_string(),
            prompt_tokens,
            logprobs,
        }
    }

    fn usage(&self, r: &GenerationRecord) -> Usage {
        let completion = r.completion_tokens as u32;
        Usage {
            prompt_tokens: self.prompt_tokens as u32,
            completion_tokens: completion,
            total_tokens: self.prompt_tokens as u32 + completion,
            completion_tokens_details: CompletionTokensDetails {
                accepted_prediction_tokens: r.accepted as u32,
                rejected_prediction_tokens: (r.drafted - r.accepted) as u32,
            },
            spade: Some(SpadeUsage {
                verify_calls: r.verify_calls as u32,
                mean_tokens_per_call: if r.verify_calls == 0 { 0.0 } else { r.completion_tokens as f64 / r.verify_calls as f64 },
                draft_len: r.draft_len,
                ahead_drafted: r.ahead_drafted as u32,
                ahead_used: r.ahead_used as u32,
                timing: r.timing.clone(),
                auto: r.auto.clone(),
                bytes_sent: r.bytes_sent,
                bytes_received: r.bytes_received,
                degraded: r.degraded,
            }),
        }
    }

    fn logprobs(&self, content: Vec<TokenLogprobContent>) -> Option<ChoiceLogprobs> {
        self.logprobs.then_some(ChoiceLogprobs { content })
    }

    fn chunk(&self, choices: Vec<ChunkChoice>, usage: Option<Usage>) -> ChatCompletionChunk {
        ChatCompletionChunk { id: self.id.clone(), object: "chat.completion.chunk".into(), created: self.created, model: self.model.clone(), choices, usage }
    }

    fn delta(&self, delta: Delta, logprobs: Option<ChoiceLogprobs>, finish_reason: Option<FinishReason>) -> ChatCompletionChunk {
        self.chunk(vec![ChunkChoice { index: 0, delta, logprobs, finish_reason }], None)
    }
}

/// Collects a whole generation into one `chat.completion`. A failure midway fails the request.
pub async fn collect(meta: Meta, first: Event, mut rx: mpsc::Receiver<Event>) -> Result<ChatCompletion, ApiError> {
    let mut content = String::new();
    let mut logprobs = Vec::new();
    let mut next = Some(first);
    loop {
        let event = match next.take() {
            Some(e) => Some(e),
            None => rx.recv().await,
        };
        match event {
            Some(Event::Text { text, logprobs: lp }) => {
                content.push_str(&text);
                logprobs.extend(lp);
            }
            Some(Event::Finished { finish, record }) => {
                return Ok(ChatCompletion {
                    id: meta.id.clone(),
                    object: "chat.completion".into(),
                    created: meta.created,
                    model: meta.model.clone(),
                    choices: vec![Choice {
                        index: 0,
                        message: AssistantMessage { role: Role::Assistant, content },
                        logprobs: meta.logprobs(logprobs),
                        finish_reason: finish,
                    }],
                    usage: meta.usage(&record),
                    system_fingerprint: None,
                })
            }
            Some(Event::Failed(e)) => return Err(e),
            None => return Err(ApiError::Internal("the generation ended without a result".into())),
        }
    }
}

fn data(value: &impl serde::Serialize) -> SseEvent {
    SseEvent::default().data(serde_json::to_string(value).unwrap_or_else(|e| format!("{{\"error\":{{\"message\":\"{e}\"}}}}")))
}

/// Streams a generation as SSE. Dropping the stream (client gone) drops `rx`, which stops the loop.
pub fn stream(
    meta: Meta,
    first: Event,
    rx: mpsc::Receiver<Event>,
    include_usage: bool,
    keep_alive: Duration,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let role = meta.delta(Delta { role: Some(Role::Assistant), content: Some(String::new()) }, None, None);
    let head = futures::stream::iter([data(&role)]);
    let body = futures::stream::unfold(Some((Some(first), rx)), move |state| {
        let meta = meta.clone();
        async move {
            let (pending, mut rx) = state?;
            let event = match pending {
                Some(e) => Some(e),
                None => rx.recv().await,
            };
            let events = match event {
                Some(Event::Text { text, logprobs }) => {
                    let chunk = meta.delta(Delta { role: None, content: Some(text) }, meta.logprobs(logprobs), None);
                    return Some((vec![data(&chunk)], Some((None, rx))));
                }
                Some(Event::Finished { finish, record }) => {
                    let mut events = vec![data(&meta.delta(Delta::default(), None, Some(finish)))];
                    if include_usage {
                        events.push(data(&meta.chunk(Vec::new(), Some(meta.usage(&record)))));
                    }
                    events.push(SseEvent::default().data("[DONE]"));
                    events
                }
                Some(Event::Failed(e)) => vec![data(&e.body())],
                None => vec![data(&ApiError::Internal("the generation ended without a result".into()).body())],
            };
            Some((events, None))
        }
    })
    .flat_map(futures::stream::iter);
    Sse::new(head.chain(body).map(Ok)).keep_alive(KeepAlive::new().interval(keep_alive))
}
