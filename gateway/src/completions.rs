//! `POST /v1/completions` (OpenAI's legacy completions): a raw prompt, text or token ids, continued
//! without a chat template. The same generation as chat completions; only the shapes differ.

use axum::extract::State;
use axum::response::Response;
use spade_core::openai::{CompletionRequest, Prompt, TextCompletion};
use spade_http::Json;

use crate::error::ApiError;
use crate::infill;
use crate::request::{self, refuse, GenerationErrors};
use crate::respond::Shape;
use crate::state::AppState;

/// The one prompt of a request, if it has exactly one.
fn single_prompt(prompt: Prompt) -> Result<Prompt, ApiError> {
    let several =
        || refuse("prompt", "one prompt per request: send several requests for several prompts");
    match prompt {
        Prompt::Texts(mut v) if v.len() == 1 => Ok(Prompt::Text(v.remove(0))),
        Prompt::TokenLists(mut v) if v.len() == 1 => Ok(Prompt::Tokens(v.remove(0))),
        Prompt::Texts(_) | Prompt::TokenLists(_) => Err(several()),
        one => Ok(one),
    }
}

/// Create a completion.
///
/// Continues `prompt` (text, encoded with the tokenizer's special tokens, or token ids) with no
/// chat template: drafted by the edge model, verified by the cloud model, exactly the cloud model's
/// output (greedy: token for token; sampled: its distribution). `echo` puts the prompt's text first;
/// `logprobs` (0 to 20) returns the target's log-probabilities in the legacy shape. With
/// `stream: true`, `text_completion` chunks over SSE ending in `data: [DONE]`. With `suffix`, the
/// prompt is the text before a gap and `suffix` the text after it: the answer is the middle
/// (fill-in-the-middle, for models with FIM tokens such as Qwen2.5-Coder; 400 naming `suffix`
/// for others).
#[utoipa::path(
    post,
    path = "/v1/completions",
    request_body = CompletionRequest,
    responses(
        (status = 200, description = "The completion (`stream: false`), or a stream of chunks (`stream: true`)",
            content(
                (TextCompletion = "application/json"),
                (TextCompletion = "text/event-stream"),
            )),
        GenerationErrors,
    ),
    security((), ("bearer" = []))
)]
pub async fn completions(
    State(state): State<AppState>,
    Json(req): Json<CompletionRequest>,
) -> Result<Response, ApiError> {
    state.metrics.record_request();
    let ticket = state.admission.admit(req.generation.n.unwrap_or(1)).await?;
    let prepared = async {
        let suffix = req.suffix.filter(|s| !s.is_empty());
        if suffix.is_some() && req.echo {
            return Err(refuse("echo", "echo with suffix is not supported"));
        }
        if req.best_of.is_some_and(|n| n != 1) {
            return Err(refuse("best_of", "only best_of = 1 is supported"));
        }
        if req.echo && req.logprobs.is_some() {
            return Err(refuse("echo", "echo with logprobs is not supported (the prompt's log-probabilities are not computed)"));
        }
        let top_logprobs = request::top_logprobs(req.logprobs, "logprobs")?;
        let decoding = request::decoding(req.generation, None, top_logprobs)?;
        let model = state.model()?.clone();
        let (prompt, text) = match single_prompt(req.prompt)? {
            // A fill-in-the-middle prefix: the FIM tokens stand where special tokens would.
            Prompt::Text(text) if suffix.is_some() => {
                (model.encode_text(&text, false).await?, text)
            }
            Prompt::Text(text) => (model.encode_text(&text, true).await?, text),
            Prompt::Tokens(ids) => {
                let vocab = model.meta().vocab_size;
                if let Some(i) = ids.iter().position(|&t| t >= vocab) {
                    return Err(ApiError::invalid(
                        "prompt",
                        format!(
                            "prompt[{i}] is {}: outside the vocabulary of {vocab} tokens",
                            ids[i]
                        ),
                    ));
                }
                let text = if req.echo { model.decode_all(&ids)? } else { String::new() };
                (ids, text)
            }
            Prompt::Texts(_) | Prompt::TokenLists(_) => {
                unreachable!("single_prompt returns one prompt")
            }
        };
        let prompt = match suffix {
            Some(suffix) => infill::middle_of(model.as_ref(), prompt, &suffix).await?,
            None => prompt,
        };
        if prompt.is_empty() {
            return Err(ApiError::invalid("prompt", "the prompt is empty"));
        }
        let job = request::job(&state, &decoding, prompt, "prompt").await?;
        Ok((decoding, job, req.echo.then_some(text)))
    };
    let (decoding, job, echo) = prepared.await.inspect_err(|_| state.metrics.record_failure())?;
    request::answer(&state, &decoding, job, Shape::Text { echo }, ticket).await
}
