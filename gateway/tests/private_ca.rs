//! A verifier behind a private CA: the real gateway talks https to a TLS listener whose certificate
//! a CA made here (rcgen) signed, and which forwards to a real verifier. With `--verifier-ca` naming
//! that CA the gateway is ready and answers as target-only decoding does; without it the gateway
//! refuses the certificate (the CA is in no trust store) and says it is not ready. Each case is
//! reported (tests/real `report`); scripts/reliability.sh renders the report.

mod real;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use real::*;
use serde_json::{json, Value};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio_rustls::rustls::{crypto, ServerConfig};
use tokio_rustls::TlsAcceptor;

const PROMPT: &str = "Write one sentence about the sea.";
const MAX_TOKENS: usize = 8;

/// A fresh CA (its certificate as PEM) and a server certificate it signed for `localhost` and
/// 127.0.0.1, with the server's key.
fn private_ca() -> (String, ServerConfig) {
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(DnType::CommonName, "SPADE test private CA");
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_key = KeyPair::generate().unwrap();
    let ca_pem = ca.self_signed(&ca_key).unwrap().pem();
    let issuer = Issuer::new(ca, ca_key);

    let mut server = CertificateParams::new(vec!["localhost".into(), "127.0.0.1".into()]).unwrap();
    server.distinguished_name.push(DnType::CommonName, "localhost");
    server.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    server.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    let server_key = KeyPair::generate().unwrap();
    let server_cert = server.signed_by(&server_key, &issuer).unwrap();

    // rustls is built with both ring and aws-lc-rs here, so it has no default provider: name one.
    let config = ServerConfig::builder_with_provider(Arc::new(crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![server_cert.der().clone()],
            PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(server_key.serialize_der())),
        )
        .unwrap();
    (ca_pem, config)
}

/// What the TLS listener saw: handshakes completed, and why the others failed.
#[derive(Default)]
struct Handshakes {
    completed: usize,
    failed: Vec<String>,
}

/// A TLS listener on loopback that terminates TLS and forwards the bytes both ways to `backend`
/// (plain HTTP): an https verifier as a reverse proxy in front of it would be.
async fn tls_front(config: ServerConfig, backend: SocketAddr) -> (u16, Arc<Mutex<Handshakes>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let acceptor = TlsAcceptor::from(Arc::new(config));
    let seen = Arc::new(Mutex::new(Handshakes::default()));
    let record = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else { continue };
            let (acceptor, record) = (acceptor.clone(), record.clone());
            tokio::spawn(async move {
                let mut tls = match acceptor.accept(tcp).await {
                    Ok(tls) => tls,
                    Err(e) => {
                        record.lock().unwrap().failed.push(e.to_string());
                        return;
                    }
                };
                record.lock().unwrap().completed += 1;
                if let Ok(mut plain) = TcpStream::connect(backend).await {
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
                }
            });
        }
    });
    (port, seen)
}

/// The CA's PEM in a file of its own, removed when dropped.
struct TempFile(PathBuf);

impl TempFile {
    fn new(name: &str, contents: &str) -> Self {
        let path = std::env::temp_dir().join(format!("spade-test-{}-{name}", std::process::id()));
        std::fs::write(&path, contents).unwrap();
        Self(path)
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn private_ca_verifier_over_https() {
    let (ca_pem, server_config) = private_ca();
    let ca_file = TempFile::new("private-ca.pem", &ca_pem);
    let verifier = start_verifier().await;
    let (tls_port, seen) =
        tls_front(server_config, SocketAddr::from(([127, 0, 0, 1], verifier.port))).await;
    let https = format!("https://localhost:{tls_port}");
    let expected = reference(&[PROMPT], MAX_TOKENS).await.remove(0);

    // With --verifier-ca: ready, and the answer is target-only's, verified through the TLS listener.
    let gateway =
        spawn_gateway(&https, &["--verifier-ca", ca_file.0.to_str().unwrap()], false).await;
    let (status, body) = wait_loaded(&gateway.url).await;
    let ready = status == 200 && body["status"] == "ready";
    let (code, answer) = if ready {
        post(&gateway.url, &request(PROMPT, MAX_TOKENS, json!({}))).await
    } else {
        (0, Value::Null)
    };
    let text = content(&answer).to_string();
    let completed = seen.lock().unwrap().completed;
    let pass = ready && code == 200 && text == expected && completed > 0;
    report(
        "security",
        "private-CA verifier over https: with --verifier-ca",
        &format!(
            "/health {status} {}; completion {code} {text:?} (target-only {expected:?}); TLS handshakes completed: {completed}",
            body["status"]
        ),
        pass,
    );
    assert!(pass, "{body}; {answer}; gateway log:\n{}", gateway.log_text());
    drop(gateway);

    // Without it: the certificate chains to no root the gateway trusts (the gateway's TLS client
    // says so to the listener with an `unknown_ca` alert), so it is not ready, and a request is
    // refused at once.
    let refused_before = seen.lock().unwrap().failed.len();
    let gateway = spawn_gateway(&https, &[], false).await;
    let (status, body) = wait_loaded(&gateway.url).await;
    let detail = body["detail"].as_str().unwrap_or_default().to_string();
    let started = Instant::now();
    let response = reqwest::Client::new()
        .post(format!("{}/v1/chat/completions", gateway.url))
        .json(&request(PROMPT, MAX_TOKENS, json!({})))
        .timeout(Duration::from_secs(30))
        .send()
        .await;
    let elapsed = started.elapsed();
    let code = response.as_ref().map_or(0, |r| r.status().as_u16());
    let refusals = seen.lock().unwrap().failed[refused_before..].to_vec();
    let pass = status == 503
        && body["status"] == "verifier_unreachable"
        && code == 503
        && elapsed < Duration::from_secs(10)
        && detail.contains("certificate")
        && refusals.iter().any(|e| e.contains("UnknownCA"));
    report(
        "security",
        "private-CA verifier over https: without --verifier-ca",
        &format!(
            "/health {status} {} ({detail:?}); a request {code} in {} ms; TLS handshakes refused: {} ({:?})",
            body["status"],
            elapsed.as_millis(),
            refusals.len(),
            refusals.first().map(String::as_str).unwrap_or_default(),
        ),
        pass,
    );
    assert!(pass, "{body}; gateway log:\n{}", gateway.log_text());
}
