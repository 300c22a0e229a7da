//! The OpenAPI document, generated from the handlers' annotations.

use spade_http::BearerAuth;
use utoipa::OpenApi;

#[derive(OpenApi)]
#[openapi(
    info(title = "SPADE verifier", description = "Cloud side of SPADE: judges draft blocks with the large model."),
    paths(crate::verify::verify, crate::verify::end_session, crate::admin::health, crate::admin::info, crate::admin::metrics),
    components(schemas(
        spade_core::protocol::VerifyRequest,
        spade_core::protocol::VerifyResponse,
        spade_core::protocol::WireDraftToken,
        spade_core::protocol::TokenLogprob,
        spade_core::protocol::VerifyTiming,
        spade_core::protocol::ModelInfo,
        spade_core::SamplingParams,
        spade_core::NextKind,
        spade_core::ErrorBody,
        spade_core::ErrorDetail,
        crate::admin::Health,
    )),
    modifiers(&BearerAuth)
)]
pub struct ApiDoc;

/// The document as pretty JSON (what `spade-verifier openapi` prints and openapi/verifier.json holds).
pub fn document() -> String {
    ApiDoc::openapi().to_pretty_json().expect("the OpenAPI document serialises")
}
