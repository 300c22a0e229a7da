//! The OpenAPI document, generated from the handlers' annotations.

use spade_http::BearerAuth;
use utoipa::OpenApi;

#[derive(OpenApi)]
#[openapi(
    info(title = "SPADE gateway", description = "Edge side of SPADE: OpenAI-compatible chat completions, drafted locally and verified by the cloud model."),
    paths(crate::chat::chat_completions, crate::admin::models, crate::admin::health, crate::admin::metrics),
    components(schemas(
        spade_core::openai::ChatCompletionRequest,
        spade_core::openai::ChatCompletion,
        spade_core::openai::ChatCompletionChunk,
        spade_core::openai::Usage,
        spade_core::openai::SpadeUsage,
        spade_core::openai::ModelList,
        spade_core::ErrorBody,
        spade_core::ErrorDetail,
        crate::admin::Health,
    )),
    modifiers(&BearerAuth)
)]
pub struct ApiDoc;

/// The document as pretty JSON (what `spade-gateway openapi` prints and openapi/gateway.json holds).
pub fn document() -> String {
    ApiDoc::openapi().to_pretty_json().expect("the OpenAPI document serialises")
}
