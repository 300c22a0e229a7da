//! What chat completions and (legacy) completions share: validating the decoding fields, sizing the
//! generation against the context and the verifier, and answering with it as JSON or SSE.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use rand::Rng;
use serde_json::Value;
use spade_core::grammar::{Grammar, GrammarConstraint};
use spade_core::limits::MAX_TOP_LOGPROBS;
use spade_core::lookup::Proposer;
use spade_core::openai::{DraftLen, GenerationFields, MessageContent, Prediction, StopSequences};
use spade_core::protocol::{FEATURE_BINARY, FEATURE_GRAMMAR, FEATURE_LOGPROBS, FEATURE_PENALTIES};
use spade_core::rng::choice_seed;
use spade_core::{AcceptRule, ErrorBody, Penalties, SamplingError, SamplingParams};
use spade_engine::speculative::DraftLenSetting;
use spade_engine::{EdgeModel, EngineError};
use spade_http::{Json, RequestError};
use tokio::sync::mpsc;

use crate::admission::Ticket;
use crate::config::{OfflineFallback, VerifyWire};
use crate::error::ApiError;
use crate::generation::{self, Constraint, Event, Job};
use crate::respond::{self, Shape};
use crate::state::AppState;

const MAX_STOPS: usize = 16;
/// Most choices (`n`) one request may ask for: each is a generation of its own.
const MAX_CHOICES: u32 = 16;
/// The draft length of a seeded sampled request whose draft length is `auto` (a fixed one keeps it
/// reproducible; 4 is the usual fixed choice).
const SEEDED_DRAFT_LEN: usize = 4;

/// The error answers of both generation endpoints, documented once (OpenAPI only).
#[derive(utoipa::IntoResponses)]
#[allow(dead_code)]
pub enum GenerationErrors {
    /// Invalid or unsupported parameter (named in `error.param`), or prompt too long (`code: context_length_exceeded`)
    #[response(status = 400)]
    Invalid(ErrorBody),
    /// Missing or wrong API key (when the gateway has one)
    #[response(status = 401)]
    Unauthorized(ErrorBody),
    /// Body over the size limit
    #[response(status = 413)]
    TooLarge(ErrorBody),
    /// The gateway is at capacity: its line of waiting requests is full (`--max-queued`), or no place
    /// freed in `--queue-timeout-secs` (`code: rate_limit_exceeded`; retry as `retry-after` says)
    #[response(status = 429, headers(
        ("retry-after" = u64, description = "Seconds to wait before retrying"),
        ("retry-after-ms" = u64, description = "The same, in milliseconds, spread between clients"),
    ))]
    Overloaded(ErrorBody),
    /// The verifier answered with an error, or its vocabulary differs from the draft model's
    #[response(status = 502)]
    Verifier(ErrorBody),
    /// Draft model loading, or verifier unreachable (`x-should-retry: false`)
    #[response(status = 503)]
    Unavailable(ErrorBody),
}

/// Validated decoding fields; the prompt is not encoded yet.
#[derive(Debug, Clone)]
pub struct Decoding {
    pub sampling: SamplingParams,
    /// Checked against the vocabulary, and given the prompt's length, in [`job`].
    pub penalties: Penalties,
    pub max_tokens: Option<usize>,
    /// Which field set `max_tokens`, for error messages.
    pub max_tokens_param: &'static str,
    pub stops: Vec<String>,
    pub seed: Option<u64>,
    pub stream: bool,
    pub include_usage: bool,
    pub top_logprobs: Option<u8>,
    /// `spade.draft_len`, where the request sets it.
    pub draft_len: Option<DraftLen>,
    /// `spade.lookup`, where the request sets it.
    pub lookup: Option<bool>,
    /// The text of `prediction`, where the request has one.
    pub prediction: Option<String>,
    /// Choices: independent generations of the same prompt.
    pub n: u32,
    /// The grammar the output must follow, compiled in [`job`].
    pub grammar: Option<OutputGrammar>,
}

/// A grammar document (llguidance's format) and the request field that asked for it.
#[derive(Debug, Clone)]
pub struct OutputGrammar {
    pub document: Value,
    pub param: &'static str,
}

pub(crate) fn refuse(param: &str, message: &str) -> ApiError {
    RequestError::Invalid {
        message: message.to_string(),
        param: Some(param.to_string()),
        code: Some("unsupported_parameter"),
    }
    .into()
}

fn invalid_sampling(e: SamplingError) -> ApiError {
    RequestError::Invalid { message: e.to_string(), param: e.param(None), code: None }.into()
}

/// `max_tokens` is `(field name, value)`: the API's own field wins over the shared `max_tokens`.
pub fn decoding(
    g: GenerationFields,
    max_tokens: Option<(&'static str, i64)>,
    top_logprobs: Option<u8>,
) -> Result<Decoding, ApiError> {
    let n = g.n.unwrap_or(1);
    if !(1..=MAX_CHOICES).contains(&n) {
        return Err(ApiError::invalid(
            "n",
            format!("n must be between 1 and {MAX_CHOICES} (got {n})"),
        ));
    }
    let penalties = Penalties {
        presence_penalty: g.presence_penalty.unwrap_or(0.0),
        frequency_penalty: g.frequency_penalty.unwrap_or(0.0),
        repetition_penalty: g.repetition_penalty.unwrap_or(1.0),
        logit_bias: logit_bias(g.logit_bias.as_ref())?,
        prompt_len: 0,
    };
    let sampling = SamplingParams::with_defaults(g.temperature, g.top_p, g.top_k, g.min_p);
    sampling.validate().map_err(invalid_sampling)?;
    // Out-of-vocabulary biases are checked once the model is known (`job`).
    penalties.validate(u32::MAX).map_err(invalid_sampling)?;
    let (name, max) = match (max_tokens, g.max_tokens) {
        (Some((name, m)), _) => (name, Some(m)),
        (None, m) => ("max_tokens", m),
    };
    let max_tokens = match max {
        Some(m) if m < 1 => {
            return Err(ApiError::invalid(name, format!("{name} must be at least 1 (got {m})")))
        }
        Some(m) => Some(usize::try_from(m).unwrap_or(usize::MAX)),
        None => None,
    };
    let stops = match g.stop {
        None => Vec::new(),
        Some(StopSequences::One(s)) => vec![s],
        Some(StopSequences::Many(v)) => v,
    };
    if stops.len() > MAX_STOPS {
        return Err(ApiError::invalid("stop", format!("at most {MAX_STOPS} stop sequences")));
    }
    if !g.stream && g.stream_options.is_some() {
        return Err(ApiError::invalid(
            "stream_options",
            "stream_options is only allowed when stream is true",
        ));
    }
    Ok(Decoding {
        sampling,
        penalties,
        max_tokens,
        max_tokens_param: name,
        stops,
        seed: g.seed.map(|s| s as u64),
        stream: g.stream,
        include_usage: g.stream_options.is_some_and(|o| o.include_usage),
        top_logprobs,
        draft_len: g.spade.as_ref().and_then(|s| s.draft_len),
        lookup: g.spade.as_ref().and_then(|s| s.lookup),
        prediction: g.prediction.map(prediction_text).transpose()?,
        n,
        grammar: None,
    })
}

/// The text of OpenAI's `prediction` (`type: content`; a string or text parts).
fn prediction_text(p: Prediction) -> Result<String, ApiError> {
    if p.kind != "content" {
        return Err(ApiError::invalid("prediction.type", "prediction.type must be \"content\""));
    }
    match p.content {
        MessageContent::Text(text) => Ok(text),
        MessageContent::Parts(parts) => parts
            .into_iter()
            .map(|part| match (part.kind.as_str(), part.text) {
                ("text", Some(text)) => Ok(text),
                _ => Err(ApiError::invalid("prediction.content", "prediction parts must be text")),
            })
            .collect(),
    }
}

/// `n` alternatives per token, checked against the limit; `param` names the field.
pub fn top_logprobs(n: Option<u8>, param: &str) -> Result<Option<u8>, ApiError> {
    match n {
        Some(n) if n > MAX_TOP_LOGPROBS => Err(ApiError::invalid(
            param,
            format!("{param} must be between 0 and {MAX_TOP_LOGPROBS}"),
        )),
        n => Ok(n),
    }
}

/// OpenAI's `logit_bias`: an object from token ids (as strings) to numbers, or null.
fn logit_bias(value: Option<&Value>) -> Result<BTreeMap<u32, f32>, ApiError> {
    let Some(object) = value.filter(|v| !v.is_null()) else {
        return Ok(BTreeMap::new());
    };
    let object = object.as_object().ok_or_else(|| {
        ApiError::invalid("logit_bias", "logit_bias must be an object mapping token ids to biases")
    })?;
    let mut bias = BTreeMap::new();
    for (key, value) in object {
        let token = key.parse::<u32>().map_err(|_| {
            ApiError::invalid("logit_bias", format!("logit_bias key {key:?} is not a token id"))
        })?;
        let value = value.as_f64().ok_or_else(|| {
            ApiError::invalid("logit_bias", format!("logit_bias[{key:?}] must be a number"))
        })?;
        bias.insert(token, value as f32);
    }
    Ok(bias)
}

/// The first penalty field a request set, to name in an error.
fn penalty_param(p: &Penalties) -> &'static str {
    if p.presence_penalty != 0.0 {
        "presence_penalty"
    } else if p.frequency_penalty != 0.0 {
        "frequency_penalty"
    } else if p.repetition_penalty != 1.0 {
        "repetition_penalty"
    } else {
        "logit_bias"
    }
}

/// Sizes the generation of `prompt` against the context window, the verifier's limits and features.
/// `prompt_param` names the request field a too-long prompt came from.
pub async fn job(
    state: &AppState,
    decoding: &Decoding,
    prompt: Vec<u32>,
    prompt_param: &str,
) -> Result<Job, ApiError> {
    let model = state.model()?.clone();
    // Padding ids are no tokens (and may lie past the verifier's rows).
    decoding.penalties.validate(model.meta().text_tokens).map_err(invalid_sampling)?;
    let max_draft_len = state.settings.max_draft_len;
    let (max_context, max_draft, verify, binary, proposal_cap, rule) = match state
        .verifier_info()
        .await
    {
        Ok(info) => {
            let lacks = |feature| !info.features.iter().any(|f| f == feature);
            // An engine applies grammars and penalties only to what it generates; our drafts reach
            // it as prompt.
            let why = match &info.engine {
                Some(engine) => format!("this one verifies on a serving engine ({engine}), which cannot apply them to drafted tokens"),
                None => "this one does not: upgrade it".to_string(),
            };
            if !decoding.penalties.is_noop() && lacks(FEATURE_PENALTIES) {
                let message = format!("penalties and logit_bias need a verifier that applies them (feature \"penalties\" in its /v1/info); {why}");
                return Err(refuse(penalty_param(&decoding.penalties), &message));
            }
            if let Some(grammar) = decoding.grammar.as_ref().filter(|_| lacks(FEATURE_GRAMMAR)) {
                let message = format!("constrained output needs a verifier that applies grammars (feature \"grammar\" in its /v1/info); {why}");
                return Err(refuse(grammar.param, &message));
            }
            if decoding.top_logprobs.is_some() && lacks(FEATURE_LOGPROBS) {
                let message = format!("logprobs need a verifier that returns the target's log-probabilities (feature \"logprobs\" in its /v1/info); {why}");
                return Err(refuse("logprobs", &message));
            }
            let binary = state.settings.verify_wire == VerifyWire::Binary && !lacks(FEATURE_BINARY);
            (
                info.max_context.min(model.meta().max_context) as usize,
                max_draft_len.min(info.max_draft as usize),
                true,
                binary,
                info.max_draft as usize,
                Some(info.rule),
            )
        }
        Err(ApiError::VerifierUnavailable(e))
            if state.settings.fallback == OfflineFallback::Draft =>
        {
            tracing::warn!("verifier unreachable ({e}); answering with the draft model alone");
            (model.meta().max_context as usize, max_draft_len, false, false, 0, None)
        }
        Err(e) => return Err(e),
    };
    // Under the ratio rule which tokens a sampled generation commits depends on what was drafted;
    // under the match rule it does not (randomness keyed by position alone).
    let reproducible = decoding.seed.is_some()
        && !decoding.sampling.is_greedy()
        && rule != Some(AcceptRule::Match);
    let draft_len = match decoding.draft_len.unwrap_or(state.settings.draft_len).fixed() {
        Some(n) if n as usize > max_draft && decoding.draft_len.is_some() => {
            return Err(ApiError::invalid(
                "spade.draft_len",
                format!("spade.draft_len is {n}; at most {max_draft} here (or \"auto\")"),
            ));
        }
        Some(n) => DraftLenSetting::Fixed(n as usize),
        // Which tokens a sampled generation commits depends on what was drafted, and `auto` chooses
        // from measured times: a seeded request drafts a fixed length so that it reproduces.
        None if reproducible => DraftLenSetting::Fixed(SEEDED_DRAFT_LEN.min(max_draft)),
        None => DraftLenSetting::Auto {
            max: max_draft,
            seed: state.draft_estimates.clone(),
            block_end: state.settings.draft_block_end,
        },
    };
    let too_long = |message: String| {
        ApiError::from(RequestError::Invalid {
            message,
            param: Some(prompt_param.into()),
            code: Some("context_length_exceeded"),
        })
    };
    if prompt.len() >= max_context {
        return Err(too_long(format!(
            "the prompt is {} tokens; the model's context is {max_context}",
            prompt.len()
        )));
    }
    let room = max_context - prompt.len();
    let cap = state.settings.max_completion_tokens;
    if let (Some(m), Some(cap)) = (decoding.max_tokens, cap) {
        if m > cap {
            let param = decoding.max_tokens_param;
            return Err(ApiError::invalid(
                param,
                format!("{param} is {m}; this gateway allows at most {cap}"),
            ));
        }
    }
    if let Some(m) = decoding.max_tokens.filter(|&m| m > room) {
        return Err(too_long(format!("the prompt ({} tokens) plus max_tokens ({m}) exceeds the model's context of {max_context}", prompt.len())));
    }
    let penalties =
        Some(Penalties { prompt_len: prompt.len() as u32, ..decoding.penalties.clone() })
            .filter(|p| !p.is_noop());
    // Copied drafts where the verifier checks them, unless the request sends no drafts at all.
    let lookup = decoding.lookup.unwrap_or(state.settings.prompt_lookup);
    let proposer = match &decoding.prediction {
        _ if !verify || draft_len.max() == 0 => None,
        Some(text) => {
            Some(Proposer::new(model.encode_text(text, false).await?, lookup, proposal_cap))
        }
        None => Some(Proposer::new(Vec::new(), lookup, proposal_cap)),
    }
    .filter(Proposer::is_active);
    let grammar = match &decoding.grammar {
        Some(g) => Some(constraint(model, g, prompt.len()).await?),
        None => None,
    };
    Ok(Job {
        penalties,
        max_tokens: decoding.max_tokens.unwrap_or(room.min(cap.unwrap_or(usize::MAX))),
        sampling: decoding.sampling,
        seed: decoding.seed.unwrap_or_else(|| rand::rng().random()),
        stops: decoding.stops.clone(),
        top_logprobs: decoding.top_logprobs,
        draft_len,
        verify,
        reproducible,
        tool_calls: None,
        binary,
        grammar,
        affinity: spade_core::affinity::prompt_key(&prompt),
        line_rules: None,
        proposer,
        rule,
        prompt,
    })
}

/// Compiles the output's grammar against the draft model's vocabulary (the verifier compiles the
/// same document against the identical target vocabulary): a bad schema is a 400 naming its field.
async fn constraint(
    model: Arc<dyn EdgeModel>,
    grammar: &OutputGrammar,
    start: usize,
) -> Result<Constraint, ApiError> {
    let wire = GrammarConstraint { grammar: grammar.document.clone(), start: start as u32 };
    let document = wire.grammar.clone();
    // The first use builds the vocabulary's token trie: blocking work.
    let compiled = tokio::task::spawn_blocking(move || -> Result<Grammar, EngineError> {
        Ok(model.vocabulary()?.compile(&document)?)
    })
    .await
    .map_err(|e| ApiError::Internal(format!("compiling the grammar: {e}")))?;
    match compiled {
        Ok(compiled) => Ok(Constraint { wire, compiled }),
        Err(EngineError::Grammar(e)) => Err(RequestError::Invalid {
            message: e.to_string(),
            param: Some(grammar.param.to_string()),
            code: Some("invalid_grammar"),
        }
        .into()),
        Err(e) => Err(refuse(
            grammar.param,
            &format!("constrained output is not available with this draft model: {e}"),
        )),
    }
}

/// Runs the request's `n` generations (choice i seeded with [`choice_seed`]) and answers in `shape`:
/// one JSON object, or SSE when `decoding.stream`. The choices run at the same time, except for a seeded
/// sampled request: its choices run one after another, each from a fresh draft cache, so that it
/// reproduces (see `Drafter::begin_generation`). `ticket`: the request's places, freed when its last
/// generation ends.
pub async fn answer(
    state: &AppState,
    decoding: &Decoding,
    job: Job,
    shape: Shape,
    ticket: Ticket,
) -> Result<Response, ApiError> {
    let meta = respond::Meta::new(
        &state.settings.model_name,
        job.prompt.len(),
        decoding.top_logprobs.is_some(),
        shape,
        decoding.n as usize,
    );
    let events = start(state, decoding, job, ticket).await?;
    if decoding.stream {
        Ok(respond::stream(meta, events, decoding.include_usage, state.settings.keep_alive)
            .into_response())
    } else {
        respond::collect(meta, events).await.map(|c| Json(c).into_response())
    }
}

/// Starts the request's `n` generations (see [`answer`]) and waits for the first event of each
/// that has started, so that a failure before any output gets a real status code: their events,
/// tagged by choice.
pub async fn start(
    state: &AppState,
    decoding: &Decoding,
    job: Job,
    ticket: Ticket,
) -> Result<respond::Events, ApiError> {
    let one_by_one = job.reproducible && decoding.n > 1;
    let ticket = Arc::new(ticket);
    let (mut runs, mut receivers) = (Vec::new(), Vec::new());
    for index in 0..decoding.n {
        let (tx, rx) = mpsc::channel(64);
        let (state, job, ticket) = (
            state.clone(),
            Job { seed: choice_seed(job.seed, index), ..job.clone() },
            ticket.clone(),
        );
        runs.push(async move {
            generation::run(state, job, tx).await;
            drop(ticket);
        });
        receivers.push(rx);
    }
    drop(ticket);
    if one_by_one {
        tokio::spawn(async move {
            for run in runs {
                run.await;
            }
        });
    } else {
        for run in runs {
            tokio::spawn(run);
        }
    }
    // Wait for the first event of each choice that has started, so a failure before any output gets
    // a real status code (dropping the receivers stops the generations).
    let mut tagged = Vec::with_capacity(receivers.len());
    for (index, mut rx) in (0..).zip(receivers) {
        let first = if index == 0 || !one_by_one {
            let first = rx.recv().await.ok_or_else(|| {
                ApiError::Internal("the generation ended without a result".into())
            })?;
            if let Event::Failed(e) = first {
                return Err(e);
            }
            Some(first)
        } else {
            None
        };
        let rest =
            futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|e| (e, rx)) });
        tagged.push(futures::stream::iter(first).chain(rest).map(move |e| (index, e)).boxed());
    }
    Ok(futures::stream::select_all(tagged).boxed())
}
