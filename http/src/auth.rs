//! Bearer-token authentication, one implementation for both servers.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header::AUTHORIZATION;
use axum::http::HeaderMap;
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::Router;
use subtle::ConstantTimeEq;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};

use crate::error::RequestError;

/// Requires `Authorization: Bearer <key>` on every route of `router`; without a key, leaves it open.
pub fn require_bearer<S: Clone + Send + Sync + 'static>(
    router: Router<S>,
    key: Option<&str>,
) -> Router<S> {
    match key.filter(|k| !k.is_empty()) {
        Some(key) => {
            router.route_layer(middleware::from_fn_with_state(Arc::<str>::from(key), check))
        }
        None => router,
    }
}

async fn check(
    State(key): State<Arc<str>>,
    request: Request,
    next: Next,
) -> Result<Response, RequestError> {
    if !bearer_matches(request.headers(), &key) {
        return Err(RequestError::Unauthorized);
    }
    Ok(next.run(request).await)
}

/// Whether the request carries `Authorization: Bearer <key>`. The comparison takes the same time
/// however much of the key was right (only a wrong length is told apart sooner).
fn bearer_matches(headers: &HeaderMap, key: &str) -> bool {
    let presented = headers
        .get(AUTHORIZATION)
        .and_then(|h| h.to_str().ok())
        .and_then(|h| h.strip_prefix("Bearer "))
        .unwrap_or("");
    bool::from(presented.as_bytes().ct_eq(key.as_bytes()))
}

/// Adds the `bearer` security scheme the handlers' annotations refer to.
pub struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(AUTHORIZATION, value.parse().unwrap());
        h
    }

    #[test]
    fn only_the_exact_bearer_key_matches() {
        assert!(bearer_matches(&headers("Bearer secret"), "secret"));
        for wrong in [
            "Bearer secreT",
            "Bearer secret2",
            "Bearer ",
            "bearer secret",
            "secret",
            "Basic secret",
        ] {
            assert!(!bearer_matches(&headers(wrong), "secret"), "{wrong}");
        }
        assert!(!bearer_matches(&HeaderMap::new(), "secret"));
    }
}
