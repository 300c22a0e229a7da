//! Deterministic models for router tests (only: every other test runs real models).
//!
//! [`FakeScorer`] scores with a rule the test chooses. [`bytes`] is a small world for the gateway's
//! tests: a byte-level "model" whose target continues every prompt with [`bytes::SCRIPT`] and whose
//! draft gets every fourth byte wrong, so rounds see both acceptances and rejections.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use spade_engine::{EngineError, ModelMeta, ScoreSession, Scorer};

/// A target model whose logits after a prefix are `logits(prefix)`; counts its calls, can be slow,
/// and can start failing after some calls.
pub struct FakeScorer {
    meta: ModelMeta,
    logits: fn(&[u32]) -> Vec<f32>,
    /// How long scoring `tokens` takes.
    pub delay: fn(&[u32]) -> Duration,
    /// Scoring calls from this many on fail.
    pub fail_after: Option<usize>,
    pub calls: Arc<AtomicUsize>,
}

impl FakeScorer {
    pub fn new(meta: ModelMeta, logits: fn(&[u32]) -> Vec<f32>) -> Self {
        Self {
            meta,
            logits,
            delay: |_| Duration::ZERO,
            fail_after: None,
            calls: Arc::new(AtomicUsize::new(0)),
        }
    }
}

/// The facts of a fake model with this vocabulary; the first stop token is the last id.
pub fn meta(name: &str, vocab_size: u32, max_context: u32) -> ModelMeta {
    ModelMeta {
        name: name.into(),
        architecture: "fake".into(),
        vocab_size,
        stop_token_ids: vec![vocab_size - 1],
        tokenizer_fingerprint: "f".repeat(64),
        text_tokens: vocab_size,
        max_context,
        chat_template: None,
        fim: None,
    }
}

struct FakeSession {
    tokens: Vec<u32>,
    logits: fn(&[u32]) -> Vec<f32>,
    delay: fn(&[u32]) -> Duration,
    fail_after: Option<usize>,
    calls: Arc<AtomicUsize>,
}

impl ScoreSession for FakeSession {
    fn score(&mut self, tokens: &[u32], logit_rows: usize) -> Result<Vec<Vec<f32>>, EngineError> {
        if logit_rows == 0 || logit_rows > tokens.len() {
            return Err(EngineError::InvalidRequest(format!(
                "{logit_rows} logits asked of {} tokens",
                tokens.len()
            )));
        }
        let call = self.calls.fetch_add(1, Ordering::SeqCst);
        std::thread::sleep((self.delay)(tokens));
        if self.fail_after.is_some_and(|n| call >= n) {
            return Err(EngineError::Drafter("scorer failure injected by the test".into()));
        }
        self.tokens = tokens.to_vec();
        Ok((tokens.len() - logit_rows..tokens.len())
            .map(|end| (self.logits)(&tokens[..=end]))
            .collect())
    }
    fn cached_tokens(&self) -> &[u32] {
        &self.tokens
    }
    fn truncate(&mut self, len: usize) {
        self.tokens.truncate(len);
    }
    fn memory_bytes(&self) -> usize {
        self.tokens.len() * 1000
    }
}

impl Scorer for FakeScorer {
    fn meta(&self) -> &ModelMeta {
        &self.meta
    }
    fn new_session(&self) -> Box<dyn ScoreSession> {
        Box::new(FakeSession {
            tokens: Vec::new(),
            logits: self.logits,
            delay: self.delay,
            fail_after: self.fail_after,
            calls: self.calls.clone(),
        })
    }
}

pub mod bytes {
    //! One token per byte (multi-byte characters included), plus end-of-sequence and a turn marker.

    use std::sync::Arc;

    use spade_core::{DraftToken, SparseDist};
    use spade_engine::{
        DraftParams, Drafter, EdgeModel, EngineError, ModelMeta, Role, ToolSpec, Turn,
    };

    use super::FakeScorer;

    pub const SCRIPT: &str = "Héllo wörld! 🎉 日本語 END of the script.";
    pub const EOS: u32 = 256;
    pub const VOCAB: u32 = 257;
    /// Ends every encoded prompt: the target's script starts after the last one.
    const TURN: u32 = 1;

    pub fn meta() -> ModelMeta {
        super::meta("fake-bytes", VOCAB, 512)
    }

    /// The script token at this many tokens after the turn marker (EOS past its end).
    fn script_at(tokens: &[u32]) -> u32 {
        let start = tokens.iter().rposition(|&t| t == TURN).map_or(0, |i| i + 1);
        SCRIPT.as_bytes().get(tokens.len() - start).map_or(EOS, |&b| b as u32)
    }

    /// The target: the script's next byte far ahead (logit 8, the rest 0).
    pub fn scorer() -> FakeScorer {
        FakeScorer::new(meta(), |tokens| {
            let mut row = vec![0.0; VOCAB as usize];
            row[script_at(tokens) as usize] = 8.0;
            row
        })
    }

    /// The draft: the script, but every fourth byte wrong.
    pub struct FakeEdge {
        meta: ModelMeta,
    }

    impl FakeEdge {
        pub fn new() -> Arc<Self> {
            Arc::new(Self { meta: meta() })
        }
    }

    #[async_trait::async_trait]
    impl Drafter for FakeEdge {
        fn meta(&self) -> &ModelMeta {
            &self.meta
        }

        async fn draft(
            &self,
            committed: &[u32],
            n: usize,
            _params: &DraftParams,
        ) -> Result<Vec<DraftToken>, EngineError> {
            let mut seq = committed.to_vec();
            let mut out = Vec::new();
            for _ in 0..n {
                let right = script_at(&seq);
                let token = if seq.len() % 4 == 3 && right != EOS { b'?' as u32 } else { right };
                out.push(DraftToken {
                    token,
                    q: SparseDist::new(vec![(token, 1.0)], Some(VOCAB)).unwrap(),
                });
                seq.push(token);
                if token == EOS {
                    break;
                }
            }
            Ok(out)
        }
    }

    #[async_trait::async_trait]
    impl EdgeModel for FakeEdge {
        async fn encode_conversation(
            &self,
            turns: &[Turn],
            _tools: &[ToolSpec],
        ) -> Result<Vec<u32>, EngineError> {
            let mut ids: Vec<u32> = turns
                .iter()
                .flat_map(|t| {
                    format!(
                        "{}: {}\n",
                        format!("{:?}", t.role.unwrap_or(Role::User)).to_lowercase(),
                        t.content
                    )
                    .into_bytes()
                })
                .map(u32::from)
                .collect();
            ids.push(TURN);
            Ok(ids)
        }

        fn decode(&self, tokens: &[u32]) -> Result<String, EngineError> {
            let bytes: Vec<u8> = tokens.iter().filter(|&&t| t < 256).map(|&t| t as u8).collect();
            Ok(String::from_utf8_lossy(&bytes).into_owned())
        }

        async fn encode_text(
            &self,
            text: &str,
            _add_special_tokens: bool,
        ) -> Result<Vec<u32>, EngineError> {
            Ok(text.bytes().map(u32::from).collect())
        }

        fn decode_all(&self, tokens: &[u32]) -> Result<String, EngineError> {
            let bytes: Vec<u8> = tokens
                .iter()
                .flat_map(|&t| if t < 256 { vec![t as u8] } else { b"<eos>".to_vec() })
                .collect();
            Ok(String::from_utf8_lossy(&bytes).into_owned())
        }

        fn token_piece(&self, id: u32) -> Option<String> {
            (id < VOCAB).then(|| if id < 256 { format!("<0x{id:02X}>") } else { "<eos>".into() })
        }
    }
}
