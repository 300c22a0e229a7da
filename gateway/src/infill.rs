//! Fill-in-the-middle: llama-server's `POST /infill` (what llama.vim and llama.vscode send), and the
//! FIM prompt `/v1/completions` builds for `suffix`. The middle is generated like any completion:
//! drafted here, verified by the target, exactly the target's.

use std::convert::Infallible;
use std::time::Duration;

use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde_json::Value;
use spade_core::fim::{self, ExtraChunk, FimTokens, InfillBudget, InfillParts};
use spade_core::llama_server::{select_fields, InfillAnswer, InfillRequest, InfillTimings};
use spade_core::openai::{GenerationFields, StopSequences};
use spade_engine::EdgeModel;
use spade_http::Json;

use crate::error::ApiError;
use crate::generation::{Ending, Event, LineRules};
use crate::request::{self, refuse, GenerationErrors};
use crate::respond::Events;
use crate::state::AppState;

/// llama-server's default batch, which its `/infill` fits the prefix and suffix to.
const BATCH: usize = 2048;

/// The model's FIM tokens, or a 400 naming `param`.
fn fim_tokens(model: &dyn EdgeModel, param: &str) -> Result<FimTokens, ApiError> {
    model.meta().fim.ok_or_else(|| {
        refuse(
            param,
            &format!(
                "fill-in-the-middle needs a model with FIM tokens (such as Qwen2.5-Coder); {} has none",
                model.meta().name
            ),
        )
    })
}

/// `/v1/completions` with `suffix`: the FIM prompt around the gap after `prefix`.
pub async fn middle_of(
    model: &dyn EdgeModel,
    prefix: Vec<u32>,
    suffix: &str,
) -> Result<Vec<u32>, ApiError> {
    let fim = fim_tokens(model, "suffix")?;
    let parts = InfillParts {
        prefix,
        suffix: model.encode_text(suffix, false).await?,
        ..Default::default()
    };
    Ok(fim::infill_prompt(&fim, &parts, None).0)
}

/// Fill in the middle (llama-server's `/infill`).
///
/// The middle between `input_prefix` (+ `prompt`) and `input_suffix`, after the repository context
/// of `input_extra`, in llama-server's shape, so that llama.vim and llama.vscode work unchanged; the
/// prompt is laid out and cut to fit as llama-server does (`truncated`). Sampling defaults are
/// llama-server's (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05); `n_indent` and
/// `t_max_predict_ms` end the answer at a line as there. `samplers` is ignored: the answer is always
/// the target's distribution under these settings (llama-server's `infill` sampler is not applied);
/// so are `cache_prompt` (caching is automatic and exact), `id_slot` and `t_max_prompt_ms`.
/// llama-server's penalties (over its last 64 tokens) and `n_probs` are refused by name.
/// `stream: true`: `data: {...}` events of new `content`, the last one `stop: true` with the
/// whole answer's fields (no `[DONE]`, as llama-server).
#[utoipa::path(
    post,
    path = "/infill",
    request_body = InfillRequest,
    responses(
        (status = 200, description = "The middle (`stream: false`), or a stream of events (`stream: true`)",
            content((InfillAnswer = "application/json"), (InfillAnswer = "text/event-stream"))),
        GenerationErrors,
    ),
    security((), ("bearer" = []))
)]
pub async fn infill(
    State(state): State<AppState>,
    Json(req): Json<InfillRequest>,
) -> Result<Response, ApiError> {
    state.metrics.record_request();
    let ticket = state.admission.admit(1).await?;
    let prepared = prepare(&state, &req);
    let (decoding, job, truncated) =
        prepared.await.inspect_err(|_| state.metrics.record_failure())?;
    let answer = Answer {
        model: state.settings.model_name.clone(),
        prompt_tokens: job.prompt.len() as u64,
        truncated,
        fields: req.response_fields,
        warm_up: req.n_predict == Some(0),
    };
    let events = request::start(&state, &decoding, job, ticket).await?;
    if req.stream {
        Ok(answer.stream(events).into_response())
    } else {
        answer.collect(events).await.map(|v| Json(v).into_response())
    }
}

async fn prepare(
    state: &AppState,
    req: &InfillRequest,
) -> Result<(request::Decoding, crate::generation::Job, bool), ApiError> {
    for (param, set) in [
        ("repeat_penalty", req.repeat_penalty.is_some_and(|p| p != 1.0)),
        ("presence_penalty", req.presence_penalty.is_some_and(|p| p != 0.0)),
        ("frequency_penalty", req.frequency_penalty.is_some_and(|p| p != 0.0)),
    ] {
        if set {
            return Err(refuse(param, "llama-server's penalties count its last 64 tokens, which the verifier does not: use /v1/completions with suffix and OpenAI's penalties"));
        }
    }
    if req.n_probs.is_some_and(|n| n > 0) {
        return Err(refuse("n_probs", "token probabilities are not returned by /infill: use /v1/completions with suffix and logprobs"));
    }
    let model = state.model()?.clone();
    let fim = fim_tokens(model.as_ref(), "input_prefix")?;
    let encode = |text: String| {
        let model = model.clone();
        async move { model.encode_text(&text, false).await }
    };
    let mut extra = Vec::with_capacity(req.input_extra.len());
    for chunk in &req.input_extra {
        let header = match fim.file_sep {
            Some(_) => format!("{}\n", chunk.filename.as_deref().unwrap_or("tmp")),
            None => fim::SNIPPET_SEPARATOR.to_string(),
        };
        extra.push(ExtraChunk {
            header: encode(header).await?,
            text: encode(chunk.text.clone()).await?,
        });
    }
    let parts = InfillParts {
        prefix: encode(req.input_prefix.clone()).await?,
        prompt: encode(req.prompt.clone()).await?,
        suffix: encode(req.input_suffix.clone()).await?,
        extra,
        repo_line: encode(fim::REPO_LINE.into()).await?,
        file_line: encode(fim::FILE_LINE.into()).await?,
    };
    // n_predict 0 (llama.vim's warm-up with new context): the prompt is processed, through a
    // one-token generation whose token is not returned, so that the verifier's cache holds it.
    let n_predict = req.n_predict.filter(|&n| n >= 0).map(|n| n.max(1));
    let budget = InfillBudget {
        batch: BATCH,
        context: model.meta().max_context as usize,
        max_tokens: n_predict.unwrap_or(0) as usize,
    };
    let (prompt, truncated) = fim::infill_prompt(&fim, &parts, Some(budget));
    let fields = GenerationFields {
        temperature: Some(req.temperature.unwrap_or(0.8)),
        top_k: Some(req.top_k.unwrap_or(40)).filter(|&k| k > 0).map(|k| k as u32),
        top_p: Some(req.top_p.unwrap_or(0.95)),
        min_p: Some(req.min_p.unwrap_or(0.05)),
        stop: (!req.stop.is_empty()).then(|| StopSequences::Many(req.stop.clone())),
        seed: req.seed.filter(|&s| s >= 0),
        stream: req.stream,
        ..Default::default()
    };
    let decoding = request::decoding(fields, n_predict.map(|n| ("n_predict", n)), None)?;
    let rules = (req.n_indent > 0 || req.t_max_predict_ms > 0).then_some(LineRules {
        n_indent: req.n_indent,
        time_limit: (req.t_max_predict_ms > 0).then(|| Duration::from_millis(req.t_max_predict_ms)),
    });
    let job = request::job(state, &decoding, prompt, "input_prefix").await?;
    Ok((decoding, crate::generation::Job { line_rules: rules, ..job }, truncated))
}

/// What every event of one answer shares.
struct Answer {
    model: String,
    prompt_tokens: u64,
    truncated: bool,
    fields: Vec<String>,
    /// `n_predict: 0`: the generated token is not returned.
    warm_up: bool,
}

impl Answer {
    fn event(&self, content: String) -> InfillAnswer {
        InfillAnswer {
            index: 0,
            content: if self.warm_up { String::new() } else { content },
            tokens: Vec::new(),
            id_slot: 0,
            stop: false,
            model: self.model.clone(),
            tokens_predicted: 0,
            tokens_evaluated: self.prompt_tokens,
            has_new_line: false,
            truncated: self.truncated,
            stop_type: "none".into(),
            stopping_word: String::new(),
            tokens_cached: 0,
            timings: InfillTimings::default(),
        }
    }

    /// The last event's fields, from the generation's end; `text`: the whole middle.
    fn last(
        &self,
        content: String,
        text: &str,
        ending: Ending,
        record: &crate::metrics::GenerationRecord,
    ) -> InfillAnswer {
        let cached = record.prompt_cached_tokens.unwrap_or(0);
        let prompt_ms = record.ttft.unwrap_or_default().as_secs_f64() * 1e3;
        let predicted_ms = record.duration.as_secs_f64() * 1e3 - prompt_ms;
        InfillAnswer {
            stop: true,
            tokens_predicted: if self.warm_up { 0 } else { record.completion_tokens },
            has_new_line: text.contains('\n') && !self.warm_up,
            stop_type: match ending {
                Ending::Token | Ending::ToolCall => "eos",
                Ending::Sequence => "word",
                Ending::LineRule | Ending::Length => "limit",
            }
            .into(),
            tokens_cached: cached,
            timings: InfillTimings::new(
                self.prompt_tokens.saturating_sub(cached),
                prompt_ms,
                record.completion_tokens,
                predicted_ms.max(0.0),
            ),
            ..self.event(content)
        }
    }

    fn shaped(&self, answer: &InfillAnswer) -> Value {
        let value = serde_json::to_value(answer).unwrap_or(Value::Null);
        select_fields(value, &self.fields)
    }

    async fn collect(self, mut events: Events) -> Result<Value, ApiError> {
        let mut text = String::new();
        while let Some((_, event)) = events.next().await {
            match event {
                Event::Text { text: t, .. } => text.push_str(&t),
                Event::ToolCall(_) => {}
                Event::Failed(e) => return Err(e),
                Event::Finished { ending, record, .. } => {
                    let last = self.last(text.clone(), &text, ending, &record);
                    return Ok(self.shaped(&last));
                }
            }
        }
        Err(ApiError::Internal("the generation ended without a result".into()))
    }

    fn stream(self, events: Events) -> impl IntoResponse {
        let mut text = String::new();
        let sse = events.map(move |(_, event)| {
            let data = match event {
                Event::Text { text: t, .. } => {
                    text.push_str(&t);
                    self.shaped(&self.event(t))
                }
                Event::ToolCall(_) => return None,
                Event::Failed(e) => serde_json::to_value(e.body()).unwrap_or(Value::Null),
                Event::Finished { ending, record, .. } => {
                    self.shaped(&self.last(String::new(), &text, ending, &record))
                }
            };
            Some(Ok::<_, Infallible>(SseEvent::default().data(data.to_string())))
        });
        Sse::new(sse.filter_map(futures::future::ready)).keep_alive(KeepAlive::default())
    }
}
