//! What both servers' OpenAPI documents share: the error body, the bearer scheme and `/health`.

use utoipa::OpenApi;

use crate::auth::BearerAuth;

#[derive(OpenApi)]
#[openapi(components(schemas(spade_core::ErrorBody, spade_core::ErrorDetail)), modifiers(&BearerAuth))]
struct Shared;

/// A server's own document (title, paths, schemas) with the shared parts, as pretty JSON: what
/// `spade-gateway openapi` and `spade-verifier openapi` print and openapi/ holds.
pub fn document(mut own: utoipa::openapi::OpenApi) -> String {
    // `/health` is routed to the readiness handler too (see `app`): the same operation, its own id.
    if let Some(mut ready) = own.paths.paths.get("/health/ready").cloned() {
        if let Some(get) = ready.get.as_mut() {
            get.operation_id = Some("health".into());
            get.summary = Some("Readiness, as /health/ready.".into());
        }
        own.paths.paths.insert("/health".into(), ready);
    }
    own.merge_from(Shared::openapi()).to_pretty_json().expect("the OpenAPI document serialises")
}
