//! What every handler shares.

use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use spade_core::draft_control::{BlockEnd, DraftChoice, DraftController, Estimates};
use spade_core::limits::MAX_TOP_LOGPROBS;
use spade_core::openai::DraftLen;
use spade_core::protocol::{vocabulary_mismatch, ModelInfo};
use spade_engine::EdgeModel;
use spade_http::{HttpSettings, ModelSlot};

use crate::admission::Admission;
use crate::config::{Config, OfflineFallback, VerifyWire};
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::verifier::{CallError, VerifierClient};

#[derive(Debug, Clone)]
pub struct Settings {
    /// The default of requests that do not set `spade.draft_len`.
    pub draft_len: DraftLen,
    /// Cap of `auto` and of a request's fixed length (with the verifier's `max_draft`).
    pub max_draft_len: usize,
    pub draft_ahead: bool,
    /// `--prompt-lookup`: the default of `spade.lookup`.
    pub prompt_lookup: bool,
    /// Where `auto` ends a block.
    pub draft_block_end: BlockEnd,
    pub draft_top_k: u32,
    pub max_completion_tokens: Option<usize>,
    pub fallback: OfflineFallback,
    pub model_name: String,
    pub keep_alive: Duration,
    pub verify_wire: VerifyWire,
    /// `--cors-allow-origin`: empty for none.
    pub cors_allow_origin: Vec<String>,
}

pub struct Gateway {
    /// Set once the draft model has loaded; until then /health is 503 and completions answer not_ready.
    pub draft_model: ModelSlot<dyn EdgeModel>,
    pub verifier: VerifierClient,
    /// The verifier's answer to /v1/info once its vocabulary was seen to match the draft's.
    verifier_info: RwLock<Option<ModelInfo>>,
    pub settings: Settings,
    /// What `auto` draft lengths have learned about acceptance, the draft, the link and the verifier:
    /// each generation starts from it and feeds it back.
    pub draft_estimates: Arc<Mutex<Estimates>>,
    pub metrics: Metrics,
    /// The bound on generations running and requests waiting.
    pub admission: Admission,
    pub http: HttpSettings,
    pub started: u64,
}

pub type AppState = Arc<Gateway>;

/// Where the verifier stands, as /health reports it.
#[derive(Debug, Clone)]
pub enum VerifierStatus {
    Ready(ModelInfo),
    Unreachable(String),
    Mismatch(String),
}

impl Gateway {
    pub fn new(config: &Config) -> Result<Self, String> {
        Ok(Self {
            draft_model: ModelSlot::default(),
            verifier: VerifierClient::new(config)?,
            verifier_info: RwLock::new(None),
            settings: Settings {
                draft_len: config.draft_len,
                max_draft_len: config.max_draft_len,
                draft_ahead: config.draft_ahead,
                prompt_lookup: config.prompt_lookup,
                draft_block_end: config.draft_block_end.into(),
                draft_top_k: config.draft_top_k,
                max_completion_tokens: config.max_completion_tokens,
                fallback: config.offline_fallback,
                model_name: config.model_name.clone(),
                keep_alive: Duration::from_secs(config.keep_alive_secs),
                cors_allow_origin: config.cors_allow_origin.clone(),
                verify_wire: config.verify_wire,
            },
            draft_estimates: Arc::default(),
            metrics: Metrics::default(),
            admission: Admission::new(
                config.max_running,
                config.max_queued,
                config.queue_timeout(),
            ),
            http: config.server.http(),
            started: SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()),
        })
    }

    pub fn model(&self) -> Result<&Arc<dyn EdgeModel>, ApiError> {
        self.draft_model.get().ok_or(ApiError::NotReady)
    }

    /// Asks the verifier now and checks its limits against this gateway's settings and its
    /// vocabulary against the draft model's.
    pub async fn check_verifier(&self) -> VerifierStatus {
        let info = match self.verifier.info().await {
            Ok(info) => info,
            Err(CallError::Rejected(e)) => return VerifierStatus::Mismatch(e),
            Err(e) => return VerifierStatus::Unreachable(e.to_string()),
        };
        if let Some(problem) = self.exceeded_limit(&info) {
            return VerifierStatus::Mismatch(problem);
        }
        if let Some(model) = self.draft_model.get() {
            let draft = model.meta();
            if let Some(why) = vocabulary_mismatch(
                &draft.tokenizer_fingerprint,
                draft.vocab_size,
                &info.tokenizer_fingerprint,
                info.vocab_size,
            ) {
                return VerifierStatus::Mismatch(format!(
                    "the verifier's model {} cannot be drafted for by {}: {why}",
                    info.model, draft.name
                ));
            }
            *self.verifier_info.write().unwrap_or_else(|p| p.into_inner()) = Some(info.clone());
            let pass_s: Vec<f64> = info.pass_ms.iter().map(|ms| ms / 1e3).collect();
            if self
                .draft_estimates
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .seed_verifier_passes(&pass_s)
                > 0
            {
                // What `--draft-len auto` starts from, so its choices can be explained from the log.
                tracing::info!(pass_ms = ?info.pass_ms, "draft-length model seeded with the verifier's pass times");
            }
        }
        VerifierStatus::Ready(info)
    }

    /// Which of the verifier's limits this gateway's settings or requests would break, if any: each
    /// would otherwise show up per request, as the verifier's 400 turned into a 502.
    fn exceeded_limit(&self, info: &ModelInfo) -> Option<String> {
        if let Some(draft_len) = self.settings.draft_len.fixed().filter(|&n| n > info.max_draft) {
            return Some(format!(
                "this gateway drafts {draft_len} tokens per verify call (--draft-len) but the verifier accepts at most {} (its --max-draft): lower --draft-len or raise --max-draft",
                info.max_draft
            ));
        }
        if info.max_top_logprobs < MAX_TOP_LOGPROBS {
            return Some(format!("the verifier serves at most {} top_logprobs; this gateway accepts up to {MAX_TOP_LOGPROBS}", info.max_top_logprobs));
        }
        None
    }

    /// What a generation with an `auto` draft length would start from now.
    pub fn auto_choice(&self) -> DraftChoice {
        let known_max = self
            .verifier_info
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .map(|i| i.max_draft as usize);
        let max = self.settings.max_draft_len.min(known_max.unwrap_or(usize::MAX));
        let estimates = self.draft_estimates.lock().unwrap_or_else(|p| p.into_inner()).clone();
        DraftController::new(max, self.settings.draft_ahead, estimates).choice()
    }

    /// The verifier's info, checked once and then remembered (a restarted verifier with another
    /// model is caught by its own validation: ids outside its vocabulary are refused).
    pub async fn verifier_info(&self) -> Result<ModelInfo, ApiError> {
        if let Some(info) = self.verifier_info.read().unwrap_or_else(|p| p.into_inner()).clone() {
            return Ok(info);
        }
        match self.check_verifier().await {
            VerifierStatus::Ready(info) => Ok(info),
            VerifierStatus::Unreachable(e) => Err(ApiError::VerifierUnavailable(e)),
            VerifierStatus::Mismatch(e) => Err(ApiError::VerifierFailed(e)),
        }
    }
}
