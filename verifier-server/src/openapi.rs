//! The OpenAPI document, generated from the handlers' annotations; spade-http adds the shared parts.

use spade_core::protocol::{
    ModelInfo, TokenLogprob, VerifyRequest, VerifyResponse, VerifyTiming, WireDraftToken,
};
use spade_core::{NextKind, SamplingParams};
use utoipa::OpenApi;

use spade_http::Liveness;

use crate::admin::Health;

#[derive(OpenApi)]
#[openapi(
    info(
        title = "SPADE verifier",
        description = "Cloud side of SPADE: judges draft blocks with the large model."
    ),
    paths(
        crate::verify::verify,
        crate::verify::end_session,
        crate::admin::ready,
        crate::admin::live,
        crate::admin::info,
        crate::admin::metrics
    ),
    components(schemas(
        VerifyRequest,
        VerifyResponse,
        WireDraftToken,
        TokenLogprob,
        VerifyTiming,
        ModelInfo,
        SamplingParams,
        NextKind,
        Health,
        Liveness
    ))
)]
pub struct ApiDoc;
