//! What both servers' OpenAPI documents share: the error body and the bearer scheme.

use utoipa::OpenApi;

use crate::auth::BearerAuth;

#[derive(OpenApi)]
#[openapi(components(schemas(spade_core::ErrorBody, spade_core::ErrorDetail)), modifiers(&BearerAuth))]
struct Shared;

/// A server's own document (title, paths, schemas) with the shared parts, as pretty JSON: what
/// `spade-gateway openapi` and `spade-verifier openapi` print and openapi/ holds.
pub fn document(own: utoipa::openapi::OpenApi) -> String {
    own.merge_from(Shared::openapi()).to_pretty_json().expect("the OpenAPI document serialises")
}
