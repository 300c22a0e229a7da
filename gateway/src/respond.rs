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
    AssistantMessage, ChatCompletion, ChatCompletionChunk, Choice, ChoiceLogprobs, ChunkChoice,
    CompletionTokensDetails, Delta, FinishReason, PromptTokensDetails, Role, SpadeTiming,
    SpadeUsage, TextChoice, TextCompletion, TextLogprobs, TokenLogprobContent, Usage,
};
use spade_core::tools::{FunctionCallDelta, ToolCall, ToolCallDelta};

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
    /// Characters of text sent so far per choice, echo included (legacy `text_offset`).
    offsets: Vec<u32>,
    /// Tool calls streamed so far per choice.
    calls: Vec<u32>,
}

impl Meta {
    pub fn new(
        model: &str,
        prompt_tokens: usize,
        logprobs: bool,
        shape: Shape,
        choices: usize,
    ) -> Self {
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
            offsets: vec![0; choices],
            calls: vec![0; choices],
        }
    }

    /// Usage of all the request's choices: the prompt counted once, the rest summed.
    fn usage(&self, records: &[GenerationRecord]) -> Usage {
        let sum = |f: fn(&GenerationRecord) -> u64| records.iter().map(f).sum::<u64>();
        let (completion, calls) = (sum(|r| r.completion_tokens), sum(|r| r.verify_calls));
        let (drafted, accepted) = (sum(|r| r.drafted), sum(|r| r.accepted));
        let timing = |f: fn(&SpadeTiming) -> f64| records.iter().map(|r| f(&r.timing)).sum::<f64>();
        let first = records.first();
        Usage {
            prompt_tokens: self.prompt_tokens as u32,
            completion_tokens: completion as u32,
            total_tokens: (self.prompt_tokens as u64 + completion) as u32,
            // The prompt is counted once: the first choice's cache hit.
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: first
                    .and_then(|r| r.prompt_cached_tokens)
                    .unwrap_or(0)
                    .min(self.prompt_tokens as u64) as u32,
            },
            completion_tokens_details: CompletionTokensDetails {
                accepted_prediction_tokens: sum(|r| r.predicted_accepted) as u32,
                // As OpenAI counts them: the prediction's tokens the answer did not keep.
                rejected_prediction_tokens: sum(|r| {
                    r.prediction_tokens.saturating_sub(r.predicted_accepted)
                }) as u32,
            },
            spade: Some(SpadeUsage {
                verify_calls: calls as u32,
                mean_tokens_per_call: if calls == 0 {
                    0.0
                } else {
                    completion as f64 / calls as f64
                },
                draft_len: first.map(|r| r.draft_len).unwrap_or_default(),
                rule: first.and_then(|r| r.rule).filter(|_| calls > 0),
                ahead_drafted: sum(|r| r.ahead_drafted) as u32,
                ahead_used: sum(|r| r.ahead_used) as u32,
                timing: SpadeTiming {
                    draft_s: timing(|t| t.draft_s),
                    overlap_s: timing(|t| t.overlap_s),
                    link_s: timing(|t| t.link_s),
                    verifier_s: timing(|t| t.verifier_s),
                },
                auto: first.and_then(|r| r.auto.clone()),
                bytes_sent: sum(|r| r.bytes_sent),
                bytes_received: sum(|r| r.bytes_received),
                degraded: records.iter().any(|r| r.degraded),
                drafted: drafted as u32,
                draft_accepted: accepted as u32,
                looked_up: sum(|r| r.looked_up) as u32,
                looked_up_accepted: sum(|r| r.looked_up_accepted) as u32,
                draft_cached_tokens: first.and_then(|r| r.draft_cached_tokens).map(|n| n as u32),
            }),
        }
    }

    /// Legacy log-probabilities of choice `index`'s tokens, advancing its text offset over `text`.
    fn text_logprobs(
        &mut self,
        index: u32,
        content: &[TokenLogprobContent],
        text: &str,
    ) -> Option<TextLogprobs> {
        let offset = &mut self.offsets[index as usize];
        let start = *offset;
        *offset += text.chars().count() as u32;
        if !self.logprobs {
            return None;
        }
        let mut out = TextLogprobs::default();
        let mut at = start;
        for c in content {
            out.tokens.push(c.token.clone());
            out.token_logprobs.push(c.logprob);
            out.top_logprobs
                .push(c.top_logprobs.iter().map(|t| (t.token.clone(), t.logprob)).collect());
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
        let chunk = TextCompletion {
            id: self.id.clone(),
            object: "text_completion".into(),
            created: self.created,
            model: self.model.clone(),
            choices,
            usage,
        };
        serde_json::to_value(chunk).unwrap_or_default()
    }

    /// The chunks before any generated text, for every choice: the role (chat), the echoed prompt (text).
    fn head(&mut self) -> Vec<Value> {
        let n = self.offsets.len() as u32;
        match self.shape.clone() {
            Shape::Chat => (0..n)
                .map(|index| {
                    let delta = Delta {
                        role: Some(Role::Assistant),
                        content: Some(String::new()),
                        tool_calls: None,
                    };
                    self.chat_chunk(
                        vec![ChunkChoice { index, delta, logprobs: None, finish_reason: None }],
                        None,
                    )
                })
                .collect(),
            Shape::Text { echo: Some(echo) } if !echo.is_empty() => (0..n)
                .map(|index| {
                    self.offsets[index as usize] = echo.chars().count() as u32;
                    self.text_chunk(
                        vec![TextChoice {
                            text: echo.clone(),
                            index,
                            logprobs: None,
                            finish_reason: None,
                        }],
                        None,
                    )
                })
                .collect(),
            Shape::Text { .. } => Vec::new(),
        }
    }

    fn text(&mut self, index: u32, text: String, logprobs: Vec<TokenLogprobContent>) -> Value {
        match self.shape {
            Shape::Chat => {
                let logprobs = self.logprobs.then_some(ChoiceLogprobs { content: logprobs });
                self.chat_chunk(
                    vec![ChunkChoice {
                        index,
                        delta: Delta { content: Some(text), ..Delta::default() },
                        logprobs,
                        finish_reason: None,
                    }],
                    None,
                )
            }
            Shape::Text { .. } => {
                let logprobs = self.text_logprobs(index, &logprobs, &text);
                self.text_chunk(
                    vec![TextChoice { text, index, logprobs, finish_reason: None }],
                    None,
                )
            }
        }
    }

    /// A call as OpenAI streams one: id, type and name with empty arguments, then the arguments.
    fn tool_call(&mut self, index: u32, call: ToolCall) -> Vec<Value> {
        let position = &mut self.calls[index as usize];
        let (at, delta) = (*position, |call: ToolCallDelta| Delta {
            tool_calls: Some(vec![call]),
            ..Delta::default()
        });
        *position += 1;
        let head = ToolCallDelta {
            index: at,
            id: Some(call.id),
            kind: Some(call.kind),
            function: FunctionCallDelta {
                name: Some(call.function.name),
                arguments: Some(String::new()),
            },
        };
        let arguments = ToolCallDelta {
            index: at,
            id: None,
            kind: None,
            function: FunctionCallDelta { name: None, arguments: Some(call.function.arguments) },
        };
        [head, arguments]
            .into_iter()
            .map(|d| {
                self.chat_chunk(
                    vec![ChunkChoice {
                        index,
                        delta: delta(d),
                        logprobs: None,
                        finish_reason: None,
                    }],
                    None,
                )
            })
            .collect()
    }

    fn finish(&self, index: u32, finish: FinishReason) -> Value {
        match self.shape {
            Shape::Chat => self.chat_chunk(
                vec![ChunkChoice {
                    index,
                    delta: Delta::default(),
                    logprobs: None,
                    finish_reason: Some(finish),
                }],
                None,
            ),
            Shape::Text { .. } => self.text_chunk(
                vec![TextChoice {
                    text: String::new(),
                    index,
                    logprobs: None,
                    finish_reason: Some(finish),
                }],
                None,
            ),
        }
    }

    fn usage_chunk(&self, records: &[GenerationRecord]) -> Value {
        match self.shape {
            Shape::Chat => self.chat_chunk(Vec::new(), Some(self.usage(records))),
            Shape::Text { .. } => self.text_chunk(Vec::new(), Some(self.usage(records))),
        }
    }

    /// The whole answer in one object.
    fn whole(mut self, choices: Vec<Collected>) -> Value {
        let records: Vec<GenerationRecord> = choices.iter().map(|c| c.record.clone()).collect();
        let usage = self.usage(&records);
        match self.shape.clone() {
            Shape::Chat => {
                let choices = choices
                    .into_iter()
                    .zip(0..)
                    .map(|(c, index)| Choice {
                        index,
                        message: AssistantMessage {
                            role: Role::Assistant,
                            // OpenAI sends null content beside tool calls when there is no text.
                            content: (c.calls.is_empty() || !c.content.trim().is_empty())
                                .then_some(c.content),
                            tool_calls: (!c.calls.is_empty()).then_some(c.calls),
                        },
                        logprobs: self.logprobs.then_some(ChoiceLogprobs { content: c.logprobs }),
                        finish_reason: c.finish,
                    })
                    .collect();
                let completion = ChatCompletion {
                    id: self.id.clone(),
                    object: "chat.completion".into(),
                    created: self.created,
                    model: self.model.clone(),
                    choices,
                    usage,
                    system_fingerprint: None,
                };
                serde_json::to_value(completion)
            }
            Shape::Text { echo } => {
                let echo = echo.unwrap_or_default();
                let mut out = Vec::with_capacity(choices.len());
                for (c, index) in choices.into_iter().zip(0..) {
                    self.offsets[index as usize] = echo.chars().count() as u32;
                    let logprobs = self.text_logprobs(index, &c.logprobs, &c.content);
                    out.push(TextChoice {
                        text: echo.clone() + &c.content,
                        index,
                        logprobs,
                        finish_reason: Some(c.finish),
                    });
                }
                let completion = TextCompletion {
                    id: self.id.clone(),
                    object: "text_completion".into(),
                    created: self.created,
                    model: self.model.clone(),
                    choices: out,
                    usage: Some(usage),
                };
                serde_json::to_value(completion)
            }
        }
        .unwrap_or_default()
    }
}

/// One choice, generated to the end.
struct Collected {
    content: String,
    calls: Vec<ToolCall>,
    logprobs: Vec<TokenLogprobContent>,
    finish: FinishReason,
    record: GenerationRecord,
}

/// The events of all of a request's generations, tagged with their choice index.
pub type Events = futures::stream::BoxStream<'static, (u32, Event)>;

/// Collects every choice to its end into one answer object. A failure in any fails the request.
pub async fn collect(meta: Meta, mut events: Events) -> Result<Value, ApiError> {
    let n = meta.offsets.len();
    let mut text = vec![(String::new(), Vec::new(), Vec::new()); n];
    let mut done: Vec<Option<Collected>> = (0..n).map(|_| None).collect();
    while done.iter().any(Option::is_none) {
        match events.next().await {
            Some((i, Event::Text { text: t, logprobs })) => {
                text[i as usize].0.push_str(&t);
                text[i as usize].1.extend(logprobs);
            }
            Some((i, Event::ToolCall(call))) => text[i as usize].2.push(call),
            Some((i, Event::Finished { finish, record, .. })) => {
                let (content, logprobs, calls) = std::mem::take(&mut text[i as usize]);
                done[i as usize] =
                    Some(Collected { content, calls, logprobs, finish, record: *record });
            }
            Some((_, Event::Failed(e))) => return Err(e),
            None => return Err(ApiError::Internal("a generation ended without a result".into())),
        }
    }
    Ok(meta.whole(done.into_iter().flatten().collect()))
}

fn data(value: &impl serde::Serialize) -> SseEvent {
    SseEvent::default().data(
        serde_json::to_string(value)
            .unwrap_or_else(|e| format!("{{\"error\":{{\"message\":\"{e}\"}}}}")),
    )
}

/// Streams every choice's chunks as SSE, interleaved as they come; the usage (when asked) and
/// `[DONE]` once all have finished. Dropping the stream (client gone) drops every generation's
/// receiver, which stops them.
pub fn stream(
    mut meta: Meta,
    events: Events,
    include_usage: bool,
    keep_alive: Duration,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let head = futures::stream::iter(meta.head().iter().map(data).collect::<Vec<_>>());
    let records: Vec<Option<GenerationRecord>> = vec![None; meta.offsets.len()];
    let body = futures::stream::unfold(Some((meta, events, records)), move |state| async move {
        let (mut meta, mut events, mut records) = state?;
        let out = match events.next().await {
            Some((i, Event::Text { text, logprobs })) => vec![data(&meta.text(i, text, logprobs))],
            Some((i, Event::ToolCall(call))) => meta.tool_call(i, call).iter().map(data).collect(),
            Some((i, Event::Finished { finish, record, .. })) => {
                records[i as usize] = Some(*record);
                let mut out = vec![data(&meta.finish(i, finish))];
                if records.iter().all(Option::is_some) {
                    let records: Vec<GenerationRecord> = records.into_iter().flatten().collect();
                    if include_usage {
                        out.push(data(&meta.usage_chunk(&records)));
                    }
                    out.push(SseEvent::default().data("[DONE]"));
                    return Some((out, None));
                }
                out
            }
            Some((_, Event::Failed(e))) => return Some((vec![data(&e.body())], None)),
            None => {
                return Some((
                    vec![data(
                        &ApiError::Internal("a generation ended without a result".into()).body(),
                    )],
                    None,
                ))
            }
        };
        Some((out, Some((meta, events, records))))
    })
    .flat_map(futures::stream::iter);
    Sse::new(head.chain(body).map(Ok)).keep_alive(KeepAlive::new().interval(keep_alive))
}
