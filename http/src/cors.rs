//! Opt-in CORS for browser clients (`--cors-allow-origin`).
//!
//! Preflight requests are answered before authentication (browsers send them without credentials);
//! the actual request still needs the API key when the gateway has one.

use std::time::Duration;

use axum::http::{header, HeaderName, HeaderValue, Method};
use tower_http::cors::{AllowHeaders, AllowOrigin, CorsLayer};

/// The layer for these origins: None for an empty list; an error names an origin that is not one.
pub fn layer(origins: &[String]) -> Result<Option<CorsLayer>, String> {
    if origins.is_empty() {
        return Ok(None);
    }
    let allow = if origins.iter().any(|o| o == "*") {
        if origins.len() > 1 {
            return Err("--cors-allow-origin: `*` allows every origin; give it alone".into());
        }
        AllowOrigin::any()
    } else {
        let mut values = Vec::with_capacity(origins.len());
        for origin in origins {
            let valid = (origin.starts_with("http://") || origin.starts_with("https://"))
                && !origin.ends_with('/');
            let value = HeaderValue::from_str(origin).ok().filter(|_| valid);
            values.push(value.ok_or_else(|| format!("--cors-allow-origin {origin:?} is not an origin (scheme://host[:port], no path)"))?);
        }
        AllowOrigin::list(values)
    };
    Ok(Some(
        CorsLayer::new()
            .allow_origin(allow)
            .allow_methods([Method::GET, Method::POST])
            // SDKs send headers of their own (the OpenAI SDKs' x-stainless-*): allow what is asked.
            .allow_headers(AllowHeaders::mirror_request())
            .expose_headers([HeaderName::from_static(crate::REQUEST_ID), header::RETRY_AFTER])
            .max_age(Duration::from_secs(3600)),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_are_checked() {
        assert!(layer(&[]).unwrap().is_none());
        assert!(layer(&["*".into()]).unwrap().is_some());
        assert!(layer(&["https://app.example.com".into(), "http://localhost:5173".into()])
            .unwrap()
            .is_some());
        for bad in [
            vec!["*".to_string(), "https://a.example".into()],
            vec!["app.example.com".into()],
            vec!["https://a.example/".into()],
        ] {
            assert!(layer(&bad).is_err(), "{bad:?}");
        }
    }
}
