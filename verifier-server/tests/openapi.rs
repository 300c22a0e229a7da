//! openapi/verifier.json is generated from the code; this fails when the two drift apart.
//! Regenerate with: cargo run -p spade-verifier -- openapi > openapi/verifier.json

use utoipa::OpenApi;

#[test]
fn checked_in_document_matches_the_code() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../openapi/verifier.json");
    let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
    let generated = spade_http::openapi::document(spade_verifier::openapi::ApiDoc::openapi());
    assert!(
        checked_in.trim_end() == generated.trim_end(),
        "{} is stale: run `cargo run -p spade-verifier -- openapi > openapi/verifier.json`",
        path.display()
    );
    for route in ["/verify", "/health", "/v1/info", "/metrics"] {
        assert!(generated.contains(&format!("\"{route}\"")), "{route} missing from the document");
    }
}
