//! `POST /verify`: judge a draft block against the target model.

use axum::body::Bytes;
use axum::extract::{FromRequest, Path, Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use spade_core::grammar::GrammarConstraint;
use spade_core::protocol::{VerifyRequest, VerifyResponse, VerifyTiming};
use spade_core::wire::{decode_request, encode_response, BINARY_CONTENT_TYPE};
use spade_core::{AcceptRule, DraftToken, ErrorBody};
use spade_engine::round::{Round, ScoredBlock, TargetRule};
use spade_engine::{EngineError, ModelMeta};
use spade_http::{Json, RequestError};

use crate::batcher::Scored;
use crate::engine::EngineBackend;
use crate::error::ApiError;
use crate::state::{AppState, Limits};

/// A request that passed validation: every id inside the vocabulary, every q a distribution.
struct ValidVerify {
    session_id: Option<String>,
    context: Vec<u32>,
    context_start: usize,
    drafts: Vec<DraftToken>,
    rule: TargetRule,
    grammar: Option<GrammarConstraint>,
    seed: u64,
    top_logprobs: Option<usize>,
}

fn validate(
    req: VerifyRequest,
    meta: &ModelMeta,
    limits: &Limits,
) -> Result<ValidVerify, ApiError> {
    req.sampling.validate().map_err(|e| RequestError::Invalid {
        message: e.to_string(),
        param: e.param(Some("sampling")),
        code: None,
    })?;
    if let Some(penalties) = &req.penalties {
        penalties.validate(meta.vocab_size).map_err(|e| RequestError::Invalid {
            message: e.to_string(),
            param: e.param(Some("penalties")),
            code: None,
        })?;
    }
    if let Some(id) = &req.session_id {
        if id.is_empty() || id.len() > limits.max_session_id_len {
            return Err(ApiError::invalid(
                "session_id",
                format!("session_id must be 1 to {} bytes", limits.max_session_id_len),
            ));
        }
    }
    if req.context_start > 0 && req.session_id.is_none() {
        return Err(ApiError::invalid("context_start", "context_start > 0 needs a session_id"));
    }
    if req.draft.len() > limits.max_draft {
        return Err(ApiError::invalid(
            "draft",
            format!("{} draft tokens; at most {} per call", req.draft.len(), limits.max_draft),
        ));
    }
    if req.top_logprobs.is_some_and(|n| n > limits.max_top_logprobs) {
        return Err(ApiError::invalid(
            "top_logprobs",
            format!("top_logprobs must be between 0 and {}", limits.max_top_logprobs),
        ));
    }
    if let Some(&t) = req.context.iter().find(|&&t| t >= meta.vocab_size) {
        return Err(ApiError::invalid(
            "context",
            format!("token id {t} is outside the vocabulary of {} tokens", meta.vocab_size),
        ));
    }
    let total = req.context_start as usize + req.context.len() + req.draft.len();
    if total > meta.max_context as usize {
        return Err(RequestError::Invalid {
            message: format!(
                "context plus draft is {total} tokens; the model's maximum is {}",
                meta.max_context
            ),
            param: Some("context".into()),
            code: Some("context_length_exceeded"),
        }
        .into());
    }
    if req.context_start == 0 && req.context.is_empty() {
        return Err(ApiError::invalid("context", "the context is empty"));
    }
    if let Some(grammar) = &req.grammar {
        if req.context_start > 0 {
            return Err(ApiError::invalid(
                "grammar",
                "a grammar comes with the full context (context_start 0); the session keeps it",
            ));
        }
        if grammar.start as usize > req.context.len() {
            return Err(ApiError::invalid(
                "grammar.start",
                format!(
                    "grammar.start {} is past the context's {} tokens",
                    grammar.start,
                    req.context.len()
                ),
            ));
        }
    }
    let mut drafts = Vec::with_capacity(req.draft.len());
    for (i, d) in req.draft.iter().enumerate() {
        if d.token >= meta.vocab_size {
            return Err(ApiError::invalid(
                format!("draft[{i}].token"),
                format!("token id {} is outside the vocabulary", d.token),
            ));
        }
        let draft = d
            .to_draft(meta.vocab_size)
            .map_err(|e| ApiError::invalid(format!("draft[{i}].q"), e.to_string()))?;
        if draft.q.prob(draft.token) <= 0.0 {
            return Err(ApiError::invalid(
                format!("draft[{i}].token"),
                format!("draft token {} has probability 0 under its own q", draft.token),
            ));
        }
        drafts.push(draft);
    }
    Ok(ValidVerify {
        session_id: req.session_id,
        context: req.context,
        context_start: req.context_start as usize,
        drafts,
        rule: TargetRule {
            sampling: req.sampling,
            penalties: req.penalties.filter(|p| !p.is_noop()),
            accept: AcceptRule::Ratio,
        },
        grammar: req.grammar,
        seed: req.seed,
        top_logprobs: req.top_logprobs.map(usize::from),
    })
}

/// A `/verify` body in JSON or in the binary form (`Content-Type: application/x-spade-verify`), and
/// whether the caller takes a binary answer (`Accept` names that type).
pub struct VerifyBody {
    request: VerifyRequest,
    binary_reply: bool,
}

impl<S: Send + Sync> FromRequest<S> for VerifyBody {
    type Rejection = RequestError;

    async fn from_request(req: Request, state: &S) -> Result<Self, RequestError> {
        let names_binary = |headers: &header::HeaderMap, name| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.contains(BINARY_CONTENT_TYPE))
        };
        let (binary, binary_reply) = (
            names_binary(req.headers(), header::CONTENT_TYPE),
            names_binary(req.headers(), header::ACCEPT),
        );
        let request = if binary {
            let bytes = Bytes::from_request(req, state).await.map_err(|e| match e.status() {
                StatusCode::PAYLOAD_TOO_LARGE => RequestError::TooLarge,
                _ => RequestError::Json(e.body_text()),
            })?;
            decode_request(&bytes).map_err(|e| RequestError::Invalid {
                message: format!("invalid binary body: {e}"),
                param: None,
                code: Some("invalid_binary"),
            })?
        } else {
            Json::<VerifyRequest>::from_request(req, state).await?.0
        };
        Ok(Self { request, binary_reply })
    }
}

/// The verdict, in the form the caller asked for.
pub enum VerifyReply {
    Json(VerifyResponse),
    Binary(Vec<u8>),
}

impl IntoResponse for VerifyReply {
    fn into_response(self) -> Response {
        match self {
            Self::Json(r) => Json(r).into_response(),
            Self::Binary(bytes) => {
                ([(header::CONTENT_TYPE, BINARY_CONTENT_TYPE)], bytes).into_response()
            }
        }
    }
}

/// Judge a block of draft tokens.
///
/// Scores the context plus the drafts in one target forward pass, accepts each draft with
/// probability min(1, p/q), and returns the correction (first rejection, drawn from
/// norm(max(0, p - q))) or the bonus token. Deterministic: the same request gets the same answer.
/// Takes and gives JSON, or the compact binary form (`application/x-spade-verify`, documented in
/// spade-core's `wire` module): send it as the content type to be read, accept it to be answered in it.
#[utoipa::path(
    post,
    path = "/verify",
    request_body(content(
        (VerifyRequest = "application/json"),
        (Vec<u8> = "application/x-spade-verify"),
    )),
    responses(
        (status = 200, description = "The verdict", content(
            (VerifyResponse = "application/json"),
            (Vec<u8> = "application/x-spade-verify"),
        )),
        (status = 400, description = "Invalid request (bad JSON, ids outside the vocabulary, q not a distribution, context too long)", body = ErrorBody),
        (status = 401, description = "Missing or wrong bearer token", body = ErrorBody),
        (status = 409, description = "Session unknown or shorter than context_start: resend the full context", body = ErrorBody),
        (status = 413, description = "Body over the size limit", body = ErrorBody),
        (status = 429, description = "Queue full (code queue_full), or a prompt while the backlog is over --max-backlog-secs (code verifier_busy); see retry-after", body = ErrorBody),
        (status = 503, description = "Model still loading", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn verify(
    State(state): State<AppState>,
    body: VerifyBody,
) -> Result<VerifyReply, ApiError> {
    let result = handle(&state, body.request).await;
    match &result {
        Err(ApiError::QueueFull(_)) => state.metrics.record_queue_full(),
        Err(ApiError::Busy { .. }) => state.metrics.record_busy(),
        Err(_) => state.metrics.record_error(),
        Ok(_) => {}
    }
    result.map(|r| {
        if body.binary_reply {
            VerifyReply::Binary(encode_response(&r))
        } else {
            VerifyReply::Json(r)
        }
    })
}

async fn handle(state: &AppState, req: VerifyRequest) -> Result<VerifyResponse, ApiError> {
    if let Some(engine) = state.engine.get() {
        return on_engine(state, engine, req).await;
    }
    let target = state.target()?.clone();
    let meta = target.scorer.meta().clone();
    let mut valid = validate(req, &meta, &state.limits)?;
    valid.rule.accept = state.accept;
    let _admitted = state.admission.admit()?;

    // A delta needs an existing session; only a full context may create one, from the longest
    // prefix of it the prefix cache holds.
    let session = match &valid.session_id {
        Some(id) if valid.context_start > 0 => {
            state.sessions.get(id).ok_or_else(|| ApiError::ResendContext(id.clone()))?
        }
        id => state.sessions.open(id.as_deref(), &valid.context, || target.scorer.new_session()),
    };
    let guard = session.lock_owned().await;
    if valid.context_start > guard.committed.len() {
        return Err(ApiError::ResendContext(valid.session_id.unwrap_or_default()));
    }
    // Non-empty: validation refused an empty full context, and a delta starts after committed ids.
    let mut context = guard.committed[..valid.context_start].to_vec();
    context.extend_from_slice(&valid.context);

    let ValidVerify {
        drafts, rule, grammar, seed, top_logprobs, session_id, context_start, ..
    } = valid;
    let drafted = drafts.len();
    let tokens = Round {
        context: &context,
        drafts: &drafts,
        rule: &rule,
        grammar: None,
        seed,
        top_logprobs,
    }
    .tokens()?;
    let joining =
        target.batcher.admit(session_id.as_deref(), guard.score.as_ref(), &tokens, drafted + 1)?;
    // The context's leading rows the session already holds are not recomputed.
    let cached_tokens = if context_start == 0 {
        (tokens.len() - guard.score.rows_to_score(&tokens, drafted + 1)).min(context.len())
    } else {
        0
    };
    // The grammar is brought to the context before scoring, so a bad one costs no forward pass. A full
    // context starts the session over, with its grammar or none; only grammar work needs the blocking pool.
    let grammar = grammar.filter(|_| context_start == 0);
    let (guard, context) = if grammar.is_none() && (context_start == 0 || guard.grammar.is_none()) {
        let mut guard = guard;
        guard.grammar = None;
        (guard, context)
    } else {
        let scorer = target.scorer.clone();
        blocking(move || {
            let mut guard = guard;
            if let Some(g) = grammar {
                let vocabulary = scorer.vocabulary().map_err(|e| {
                    EngineError::InvalidRequest(format!(
                        "grammars are not available with this model: {e}"
                    ))
                })?;
                guard.grammar = Some(vocabulary.compile(&g.grammar)?.start_at(g.start as usize));
            }
            if let Some(state) = &mut guard.grammar {
                state.sync(&context)?;
            }
            Ok((guard, context))
        })
        .await?
    };

    let scored = target.batcher.score(joining, guard, tokens, drafted + 1).await?;
    let Scored { session: guard, logits, queued, forward } = scored;
    let logits = logits?;
    let (mut guard, round) = blocking(move || {
        let mut guard = guard;
        let block =
            ScoredBlock { logits, text_tokens: guard.score.text_tokens(), forward_time: forward };
        let round = Round {
            context: &context,
            drafts: &drafts,
            rule: &rule,
            grammar: guard.grammar.as_mut(),
            seed,
            top_logprobs,
        }
        .judge(block);
        Ok((guard, round.map(|r| (context, r))))
    })
    .await?;
    let (context, round) = round?;

    // Keep the accepted rows; the rejected drafts' rows would only be dropped by the next call.
    let context_len = context.len();
    let keep = context_len + round.outcome.accepted;
    guard.score.truncate(keep);
    guard.committed = context;
    guard.committed.extend_from_slice(&round.committed);
    let session_len = guard.committed.len() as u32;
    let bytes = guard.bytes();
    drop(guard);
    if let Some(id) = &session_id {
        state.metrics.record_evictions(state.sessions.update_size(id, bytes));
    }
    if context_start == 0 {
        state.metrics.record_prompt(cached_tokens, context_len - cached_tokens);
    }
    state.metrics.record_verify(
        drafted,
        round.outcome.accepted,
        round.committed.len(),
        round.forward_time,
        queued,
    );
    tracing::debug!(
        drafted,
        accepted = round.outcome.accepted,
        forward_ms = round.forward_time.as_secs_f64() * 1e3,
        "verified"
    );

    Ok(VerifyResponse {
        accepted: round.outcome.accepted as u32,
        next_token: round.outcome.next_token,
        next_kind: round.outcome.next_kind,
        eos: round.committed.iter().any(|t| meta.stop_token_ids.contains(t)),
        session_len,
        cached_tokens: cached_tokens as u32,
        logprobs: top_logprobs.map(|_| round.logprobs),
        timing: VerifyTiming {
            queue_ms: queued.as_secs_f64() * 1e3,
            forward_ms: round.forward_time.as_secs_f64() * 1e3,
        },
    })
}

/// A round on the serving engine (`--engine`): the match rule over its samples. What an engine
/// cannot apply to drafts it sees as prompt (grammars, penalties) or does not return (the target's
/// log-probabilities) is refused by name.
async fn on_engine(
    state: &AppState,
    engine: &EngineBackend,
    req: VerifyRequest,
) -> Result<VerifyResponse, ApiError> {
    let unsupported = |param: &str, what: &str| {
        ApiError::invalid(param, format!("{what} are not available from a verifier on a serving engine (--engine): the engine applies them only to what it generates"))
    };
    if req.grammar.is_some() {
        return Err(unsupported("grammar", "grammars"));
    }
    if req.penalties.as_ref().is_some_and(|p| !p.is_noop()) {
        return Err(unsupported("penalties", "penalties and logit biases"));
    }
    if req.top_logprobs.is_some() {
        return Err(unsupported("top_logprobs", "log-probabilities"));
    }
    let valid = validate(req, &engine.meta, &state.limits)?;
    let _admitted = state.admission.admit()?;
    let mut context = match &valid.session_id {
        Some(id) if valid.context_start > 0 => {
            let mut held = engine.session(id).ok_or_else(|| ApiError::ResendContext(id.clone()))?;
            if valid.context_start > held.len() {
                return Err(ApiError::ResendContext(id.clone()));
            }
            held.truncate(valid.context_start);
            held
        }
        _ => Vec::new(),
    };
    context.extend_from_slice(&valid.context);
    let drafts: Vec<u32> = valid.drafts.iter().map(|d| d.token).collect();
    let started = std::time::Instant::now();
    let outcome = engine.judge(&context, &drafts, &valid.rule.sampling, valid.seed).await?;
    let forward = started.elapsed();
    let committed = outcome.committed(&drafts);
    let eos = committed.iter().any(|t| engine.meta.stop_token_ids.contains(t));
    context.extend_from_slice(&committed);
    let session_len = context.len() as u32;
    if let Some(id) = &valid.session_id {
        engine.keep_session(id, context);
    }
    state.metrics.record_verify(
        drafts.len(),
        outcome.accepted,
        committed.len(),
        forward,
        Default::default(),
    );
    Ok(VerifyResponse {
        accepted: outcome.accepted as u32,
        next_token: outcome.next_token,
        next_kind: outcome.next_kind,
        eos,
        session_len,
        cached_tokens: 0,
        logprobs: None,
        timing: VerifyTiming { queue_ms: 0.0, forward_ms: forward.as_secs_f64() * 1e3 },
    })
}

/// Runs CPU work (grammar compilation, the rule over 150k-entry rows) off the async threads.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, EngineError> + Send + 'static,
) -> Result<T, ApiError> {
    let result = tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| ApiError::Internal(format!("scoring task failed: {e}")))?;
    Ok(result?)
}

/// End a session. Gateways call this when a generation ends. Its KV rows join the prefix cache, for
/// later sessions whose context starts with the same tokens (with `--prefix-cache false`, or when
/// too short to be worth it, they are freed now), within `--cache-budget-mb`.
#[utoipa::path(
    delete,
    path = "/sessions/{id}",
    params(("id" = String, Path, description = "The session_id the gateway used")),
    responses(
        (status = 204, description = "Session ended: its rows cached or freed"),
        (status = 401, description = "Missing or wrong bearer token", body = ErrorBody),
        (status = 404, description = "No such session (already ended or evicted)", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn end_session(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    if let Some(engine) = state.engine.get() {
        return if engine.end_session(&id) {
            Ok(StatusCode::NO_CONTENT)
        } else {
            Err(RequestError::NotFound.into())
        };
    }
    let evicted = state.sessions.end(&id).ok_or(RequestError::NotFound)?;
    state.metrics.record_evictions(evicted);
    Ok(StatusCode::NO_CONTENT)
}
