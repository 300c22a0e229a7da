//! openapi/gateway.json is generated from the code; this fails when the two drift apart.
//! Regenerate with: cargo run -p spade-gateway -- openapi > openapi/gateway.json

use utoipa::OpenApi;

#[test]
fn checked_in_document_matches_the_code() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../openapi/gateway.json");
    let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
    let generated = spade_http::openapi::document(spade_gateway::openapi::ApiDoc::openapi());
    assert!(
        checked_in.trim_end() == generated.trim_end(),
        "{} is stale: run `cargo run -p spade-gateway -- openapi > openapi/gateway.json`",
        path.display()
    );
    let doc: serde_json::Value = serde_json::from_str(&generated).unwrap();
    for route in ["/v1/chat/completions", "/v1/models", "/health", "/metrics"] {
        assert!(doc["paths"].get(route).is_some(), "{route} missing from the document");
    }
    let chat = &doc["paths"]["/v1/chat/completions"]["post"]["responses"];
    for media in ["application/json", "text/event-stream"] {
        assert!(chat["200"]["content"].get(media).is_some(), "200 lacks {media}");
    }
    for status in ["400", "401", "413", "502", "503"] {
        assert_eq!(
            chat[status]["content"]["application/json"]["schema"]["$ref"],
            "#/components/schemas/ErrorBody",
            "{status}"
        );
    }
}
