//! Shapes generation events into OpenAI answers: one `chat.completion` or `text_completion`, or SSE
//! chunks framed exactly like OpenAI's (for chat the role first; content deltas; a finish chunk; an
//! optional usage chunk with `choices: []`; then `data: [DONE]` once). An error mid-stream is one
//! `data: {"error": ...}` event and the end of the stream.

use std::convert::Infallible;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use futures::{Stream, StreamExt};
use rand::Rng;
use serde_json::Value;
use spade_core::openai::{
    AssistantMessage, ChatCompletion, ChatCompletionChunk, Choice, ChoiceLogprobs, ChunkChoice, CompletionTokensDetails, Delta, FinishReason, Role, SpadeUsage,
    TextChoice, TextCompletion, TextLogprobs, TokenLogprobContent, Usage,
};
use tokio::sync::mpsc;

use crate::error::ApiError;
use crate::generation::Event;
use crate::metrics::GenerationRecord;

/// Which API the answer is for.
#[derive(Debug, Clone)]
pub enum Shape {
    /// `/v1/chat/completions`: `chat.completion` and `chat.completion.chunk` objects.
    Chat,
    /// `/v1/completions`: `text_completion` objects; `echo` is the prompt's text put first.
    Text { echo: Option<String> },
}

/// What every chunk of one answer shares, and where the text stands (for legacy `text_offset`).
#[derive(Debug, Clone)]
pub struct Meta {
    id: String,
    created: u64,
    model: String,
    prompt_tokens: usize,
    logprobs: bool,
    shape: Shape,
    /// Characters of text sent so far, echo included.
    offset: u32,
}

impl Meta {
    pub fn new(model: &str, prompt_tokens: usize, logprobs: bool, shape: Shape) -> Self {
        let prefix = match shape {
            Shape::Chat => "chatcmpl",
            Shape::Text { .. } => "cmpl",
        };
        Self {
            id: format!("{prefix}-{:024x}", rand::rng().random::<u128>() >> 32),
            created: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
            model: model.to_string(),
            prompt_tokens,
            logprobs,
            shape,
            offset: 0,
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

    /// Legacy log-probabilities of these tokens, advancing the text offset over `text`.
    fn text_logprobs(&mut self, content: &[TokenLogprobContent], text: &str) -> Option<TextLogprobs> {
        let start = self.offset;
        self.offset += text.chars().count() as u32;
        if !self.logprobs {
            return None;
        }
        let mut out = TextLogprobs::default();
        let mut at = start;
        for c in content {
            out.tokens.push(c.token.clone());
            out.token_logprobs.push(c.logprob);
            out.top_logprobs.push(c.top_logprobs.iter().map(|t| (t.token.clone(), t.logprob)).collect());
            out.text_offset.push(at);
            at += c.token.chars().count() as u32;
        }
        Some(out)
    }

    fn chat_chunk(&self, choices: Vec<ChunkChoice>, usage: Option<Usage>) -> Value {
        let chunk = ChatCompletionChunk {
            id: self.id.clone(),
            object: "chat.completion.chunk".into(),
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        };
        serde_json::to_value(chunk).unwrap_or_default()
    }

    fn text_chunk(&self, choices: Vec<TextChoice>, usage: Option<Usage>) -> Value {
        let chunk = TextCompletion { id: self.id.clone(), object: "text_completion".into(), created: self.created, model: self.model.clone(), choices, usage };
        serde_json::to_value(chunk).unwrap_or_default()
    }

    /// The chunks before any generated text: the role (chat), the echoed prompt (text).
    fn head(&mut self) -> Vec<Value> {
        match self.shape.clone() {
            Shape::Chat => {
                let delta = Delta { role: Some(Role::Assistant), content: Some(String::new()) };
                vec![self.chat_chunk(vec![ChunkChoice { index: 0, delta, logprobs: None, finish_reason: None }], None)]
            }
            Shape::Text { echo: Some(echo) } if !echo.is_empty() => {
                self.offset += echo.chars().count() as u32;
                vec![self.text_chunk(vec![TextChoice { text: echo, index: 0, logprobs: None, finish_reason: None }], None)]
            }
            Shape::Text { .. } => Vec::new(),
        }
    }

    fn text(&mut self, text: String, logprobs: Vec<TokenLogprobContent>) -> Value {
        match self.shape {
            Shape::Chat => {
                let logprobs = self.logprobs.then_some(ChoiceLogprobs { content: logprobs });
                self.chat_chunk(vec![ChunkChoice { index: 0, delta: Delta { role: None, content: Some(text) }, logprobs, finish_reason: None }], None)
            }
            Shape::Text { .. } => {
                let logprobs = self.text_logprobs(&logprobs, &text);
                self.text_chunk(vec![TextChoice { text, index: 0, logprobs, finish_reason: None }], None)
            }
        }
    }

    fn finish(&self, finish: FinishReason) -> Value {
        match self.shape {
            Shape::Chat => self.chat_chunk(vec![ChunkChoice { index: 0, delta: Delta::default(), logprobs: None, finish_reason: Some(finish) }], None),
            Shape::Text { .. } => self.text_chunk(vec![TextChoice { text: String::new(), index: 0, logprobs: None, finish_reason: Some(finish) }], None),
        }
    }

    fn usage_chunk(&self, record: &GenerationRecord) -> Value {
        match self.shape {
            Shape::Chat => self.chat_chunk(Vec::new(), Some(self.usage(record))),
            Shape::Text { .. } => self.text_chunk(Vec::new(), Some(self.usage(record))),
        }
    }

    /// The whole answer in one object.
    fn whole(mut self, content: String, logprobs: Vec<TokenLogprobContent>, finish: FinishReason, record: &GenerationRecord) -> Value {
        let usage = self.usage(record);
        match self.shape.clone() {
            Shape::Chat => serde_json::to_value(ChatCompletion {
                id: self.id.clone(),
                object: "chat.completion".into(),
                created: self.created,
                model: self.model.clone(),
                choices: vec![Choice {
                    index: 0,
                    message: AssistantMessage { role: Role::Assistant, content },
                    logprobs: self.logprobs.then_some(ChoiceLogprobs { content: logprobs }),
                    finish_reason: finish,
                }],
                usage,
                system_fingerprint: None,
            }),
            Shape::Text { echo } => {
                let echo = echo.unwrap_or_default();
                self.offset = echo.chars().count() as u32;
                let lp = self.text_logprobs(&logprobs, &content);
                let choice = TextChoice { text: echo + &content, index: 0, logprobs: lp, finish_reason: Some(finish) };
                serde_json::to_value(TextCompletion {
                    id: self.id.clone(),
                    object: "text_completion".into(),
                    created: self.created,
                    model: self.model.clone(),
                    choices: vec![choice],
                    usage: Some(usage),
                })
            }
        }
        .unwrap_or_default()
    }
}

/// Collects a whole generation into one answer object. A failure midway fails the request.
pub async fn collect(meta: Meta, first: Event, mut rx: mpsc::Receiver<Event>) -> Result<Value, ApiError> {
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
            Some(Event::Finished { finish, record }) => return Ok(meta.whole(content, logprobs, finish, &record)),
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
    mut meta: Meta,
    first: Event,
    rx: mpsc::Receiver<Event>,
    include_usage: bool,
    keep_alive: Duration,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let head = futures::stream::iter(meta.head().iter().map(data).collect::<Vec<_>>());
    let body = futures::stream::unfold(Some((meta, Some(first), rx)), move |state| async move {
        let (mut meta, pending, mut rx) = state?;
        let event = match pending {
            Some(e) => Some(e),
            None => rx.recv().await,
        };
        let events = match event {
            Some(Event::Text { text, logprobs }) => {
                let chunk = meta.text(text, logprobs);
                return Some((vec![data(&chunk)], Some((meta, None, rx))));
            }
            Some(Event::Finished { finish, record }) => {
                let mut events = vec![data(&meta.finish(finish))];
                if include_usage {
                    events.push(data(&meta.usage_chunk(&record)));
                }
                events.push(SseEvent::default().data("[DONE]"));
                events
            }
            Some(Event::Failed(e)) => vec![data(&e.body())],
            None => vec![data(&ApiError::Internal("the generation ended without a result".into()).body())],
        };
        Some((events, None))
    })
    .flat_map(futures::stream::iter);
    Sse::new(head.chain(body).map(Ok)).keep_alive(KeepAlive::new().interval(keep_alive))
}
