//! A conversation's turns over real HTTP with the real binaries (SmolLM2 drafting for itself): each
//! turn resends the whole conversation, the verifier's prefix cache starts it from the last turn's
//! rows, and the answers are target-only's without the cache, turn for turn. Then two verifier
//! replicas behind a real nginx hashing on the gateway's affinity header: every turn reaches one
//! replica, and losing it costs one re-prefill on the other, never an error or another answer.

mod real;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use real::*;
use serde_json::{json, Value};
use spade_test_support::process::free_port;

const SYSTEM: &str =
    "You are a careful coding assistant. Answer briefly, with code where it helps, \
    and explain what each change does and why. Prefer the standard library; keep functions short.";
const TURNS: [&str; 5] = [
    "Write a Python function that returns the squares of a list of numbers.",
    "Now make it skip negative numbers.",
    "Add type hints.",
    "Write one unit test for it.",
    "Rename the function to squares_of_non_negative.",
];
const MAX_TOKENS: usize = 24;

/// One turn's answer and usage.
struct Turn {
    content: String,
    prompt_tokens: u64,
    cached_tokens: u64,
    /// `usage.spade.draft_cached_tokens`: absent where the gateway did not draft.
    draft_cached_tokens: Option<u64>,
}

/// A chat whose every turn resends all the messages before it, as OpenAI clients do.
struct Conversation {
    messages: Vec<Value>,
}

impl Conversation {
    fn new() -> Self {
        Self { messages: vec![json!({"role": "system", "content": SYSTEM})] }
    }

    /// The next user turn through `gateway`; its answer joins the conversation.
    async fn turn(&mut self, gateway: &str, user: &str) -> Turn {
        self.messages.push(json!({"role": "user", "content": user}));
        let body = json!({"model": "spade", "messages": self.messages, "temperature": 0, "max_tokens": MAX_TOKENS});
        let answer = complete(gateway, &body).await;
        let usage = &answer["usage"];
        let text = content(&answer).to_string();
        self.messages.push(json!({"role": "assistant", "content": text}));
        Turn {
            content: text,
            prompt_tokens: usage["prompt_tokens"].as_u64().unwrap(),
            cached_tokens: usage["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or_else(|| panic!("no cached_tokens: {usage}")),
            draft_cached_tokens: usage["spade"]["draft_cached_tokens"].as_u64(),
        }
    }
}

/// The first `turns` turns through `gateway`.
async fn converse(gateway: &str, turns: usize) -> Vec<Turn> {
    let mut conversation = Conversation::new();
    let mut out = Vec::new();
    for user in TURNS.iter().take(turns) {
        out.push(conversation.turn(gateway, user).await);
    }
    out
}

/// Target-only decoding against a verifier without the prefix cache: today's reference answers.
async fn reference_turns(turns: usize) -> Vec<Turn> {
    let verifier = start_verifier_on(0, &["--prefix-cache", "false"]).await;
    let gateway = start_gateway(&verifier.url, &["--draft-len", "0"]).await;
    let reference = converse(&gateway.url, turns).await;
    assert!(
        reference.iter().all(|t| t.cached_tokens == 0),
        "a verifier without the prefix cache recomputes every prompt"
    );
    assert!(
        reference.iter().all(|t| t.draft_cached_tokens.is_none()),
        "target-only drafts nothing"
    );
    reference
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_turn_starts_from_the_last_and_answers_as_target_only() {
    let reference = reference_turns(TURNS.len()).await;
    let verifier = start_verifier().await;
    let gateway = start_gateway(&verifier.url, &["--draft-len", "4"]).await;
    let turns = converse(&gateway.url, TURNS.len()).await;
    for (i, (turn, want)) in turns.iter().zip(&reference).enumerate() {
        assert_eq!(
            turn.content, want.content,
            "turn {i}: speculative with the prefix cache vs target-only without it"
        );
        assert_eq!(turn.prompt_tokens, want.prompt_tokens, "turn {i}");
        println!(
            "turn {i}: {} prompt tokens, {} cached, {:?} in the draft's cache",
            turn.prompt_tokens, turn.cached_tokens, turn.draft_cached_tokens
        );
        let draft_cached = turn.draft_cached_tokens.expect("the gateway drafted");
        if i == 0 {
            assert_eq!(turn.cached_tokens, 0, "nothing is cached before the first turn");
        } else {
            // The whole previous prompt at least: its rows were kept when its generation ended.
            assert!(
                turn.cached_tokens >= turns[i - 1].prompt_tokens,
                "turn {i}: {} cached of {}",
                turn.cached_tokens,
                turn.prompt_tokens
            );
            assert!(turn.cached_tokens < turn.prompt_tokens);
            // The draft model reads each turn once too: its prefix cache holds the last turn.
            assert!(
                draft_cached >= turns[i - 1].prompt_tokens,
                "turn {i}: the draft model's cache held {draft_cached} of {}",
                turn.prompt_tokens
            );
        }
    }
    let cached = metric(&verifier.url, "spade_prompt_tokens_cached_total").await;
    let computed = metric(&verifier.url, "spade_prompt_tokens_computed_total").await;
    let sent: u64 = turns.iter().map(|t| t.prompt_tokens).sum();
    assert_eq!((cached + computed) as u64, sent, "every prompt token is either cached or computed");
    assert_eq!(cached as u64, turns.iter().map(|t| t.cached_tokens).sum::<u64>());
    assert!(metric(&verifier.url, "spade_prefix_cache_entries").await >= 1.0);
    assert_eq!(metric(&gateway.url, "spade_gateway_prompt_tokens_cached_total").await, cached);
}

/// nginx from the system (Debian's package; `.ci/run` installs it) on `port` with deploy/nginx's
/// configuration over `upstreams`, in one process (`master_process off`), so that killing it leaves
/// no worker behind.
struct Nginx {
    child: Child,
    _dir: tempdir::Dir,
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

mod tempdir {
    /// A folder removed when dropped.
    pub struct Dir(pub std::path::PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

fn nginx_binary() -> PathBuf {
    ["/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/bin/nginx"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .unwrap_or_else(|| panic!("this test needs nginx (Debian: apt-get install nginx-light, or nginx); .ci/run installs it"))
}

async fn start_nginx(port: u16, upstreams: [&str; 2]) -> Nginx {
    let dir = std::env::temp_dir().join(format!("spade-nginx-{}-{port}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // The shipped configuration, with this test's addresses, one process, and its files in `dir`.
    let shipped = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/nginx/nginx.conf"),
    )
    .unwrap();
    let d = dir.display();
    let temp_paths: String = ["client_body", "proxy", "fastcgi", "uwsgi", "scgi"]
        .iter()
        .map(|t| format!("\n    {t}_temp_path {d}/{t};"))
        .collect();
    let mut config = shipped;
    for (from, to) in [
        ("worker_processes auto;", format!("master_process off;\npid {d}/nginx.pid;")),
        ("server verifier:8081 ", format!("server {} ", upstreams[0])),
        ("server verifier-b:8081 ", format!("server {} ", upstreams[1])),
        ("listen 8081;", format!("listen 127.0.0.1:{port};")),
        ("http {", format!("http {{{temp_paths}")),
    ] {
        assert!(
            config.contains(from),
            "deploy/nginx/nginx.conf no longer has {from:?}: update this test"
        );
        config = config.replacen(from, &to, 1);
    }
    assert!(
        config.contains("hash $http_x_spade_affinity consistent;"),
        "the shipped configuration must hash on the affinity header"
    );
    let conf = dir.join("nginx.conf");
    std::fs::write(&conf, config).unwrap();
    let log = dir.join("nginx.log");
    let child = Command::new(nginx_binary())
        .args([
            "-p",
            &dir.display().to_string(),
            "-c",
            &conf.display().to_string(),
            "-g",
            "daemon off;",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("starting nginx");
    let nginx = Nginx { child, _dir: tempdir::Dir(dir) };
    let deadline = Instant::now() + Duration::from_secs(10);
    while tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_err() {
        assert!(
            Instant::now() < deadline,
            "nginx did not listen on {port}: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    nginx
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_behind_nginx_keep_a_conversation_together_and_survive_losing_it() {
    let reference = reference_turns(TURNS.len()).await;
    let (port_a, port_b) = (free_port(), free_port());
    let mut replicas = [start_verifier_on(port_a, &[]).await, start_verifier_on(port_b, &[]).await];
    let lb_port = free_port();
    let (a, b) = (format!("127.0.0.1:{port_a}"), format!("127.0.0.1:{port_b}"));
    let _nginx = start_nginx(lb_port, [&a, &b]).await;
    let gateway = start_gateway(
        &format!("http://127.0.0.1:{lb_port}"),
        &["--draft-len", "4", "--verify-retries", "2"],
    )
    .await;

    // Three turns: all reach one replica, whose cache serves the second and third.
    let mut conversation = Conversation::new();
    let mut turns = Vec::new();
    for user in &TURNS[..3] {
        turns.push(conversation.turn(&gateway.url, user).await);
    }
    let (calls_a, calls_b) = (
        metric(&replicas[0].url, "spade_verify_calls_total").await,
        metric(&replicas[1].url, "spade_verify_calls_total").await,
    );
    assert!(
        (calls_a == 0.0) != (calls_b == 0.0),
        "one conversation reached both replicas: {calls_a} and {calls_b} calls"
    );
    let (home, other) = if calls_a > 0.0 { (0, 1) } else { (1, 0) };
    let hits = metric(&replicas[home].url, "spade_prompt_tokens_cached_total").await;
    assert_eq!(
        hits as u64,
        turns[1].cached_tokens + turns[2].cached_tokens,
        "the home replica served the cache hits"
    );
    assert!(
        turns[1].cached_tokens >= turns[0].prompt_tokens
            && turns[2].cached_tokens >= turns[1].prompt_tokens
    );

    // The replica holding the conversation goes. The next turn reaches the other one (nginx moves on
    // from a refused connection), which prefills the whole conversation once; the turn after hits its cache.
    replicas[home].kill();
    for user in &TURNS[3..] {
        turns.push(conversation.turn(&gateway.url, user).await);
    }
    assert_eq!(
        turns[3].cached_tokens, 0,
        "the survivor had never seen this conversation: one re-prefill"
    );
    assert!(
        turns[4].cached_tokens >= turns[3].prompt_tokens,
        "the next turn hits the survivor's cache"
    );
    assert!(
        metric(&replicas[other].url, "spade_prompt_tokens_cached_total").await
            >= turns[3].prompt_tokens as f64
    );
    for (i, (turn, want)) in turns.iter().zip(&reference).enumerate() {
        assert_eq!(
            turn.content, want.content,
            "turn {i} (a replica lost before turn 3) vs target-only"
        );
    }
}
