//! What every handler shares.

use std::sync::{Arc, OnceLock};

use spade_engine::Scorer;

use crate::admission::Admission;
use crate::config::Config;
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::sessions::SessionStore;

#[derive(Debug, Clone)]
pub struct Limits {
    pub max_draft: usize,
    pub max_top_logprobs: usize,
    pub max_body_bytes: usize,
    pub max_session_id_len: usize,
}

pub struct Verifier {
    /// Set once the model has loaded; until then /health is 503 and /verify answers not_ready.
    scorer: OnceLock<Arc<dyn Scorer>>,
    pub model_id: String,
    pub sessions: SessionStore,
    pub admission: Admission,
    pub metrics: Metrics,
    pub limits: Limits,
    pub api_key: Option<String>,
}

pub type AppState = Arc<Verifier>;

impl Verifier {
    pub fn new(config: &Config) -> Self {
        Self {
            scorer: OnceLock::new(),
            model_id: config.model.clone().unwrap_or_default(),
            sessions: SessionStore::new(config.cache_budget_mb * 1024 * 1024),
            admission: Admission::new(config.workers, config.queue_size),
            metrics: Metrics::default(),
            limits: Limits { max_draft: config.max_draft, max_top_logprobs: 20, max_body_bytes: config.max_body_bytes, max_session_id_len: 256 },
            api_key: config.api_key.clone().filter(|k| !k.is_empty()),
        }
    }

    pub fn set_scorer(&self, scorer: Arc<dyn Scorer>) {
        let _ = self.scorer.set(scorer);
    }

    pub fn scorer(&self) -> Result<&Arc<dyn Scorer>, ApiError> {
        self.scorer.get().ok_or(ApiError::NotReady)
    }

    pub fn is_ready(&self) -> bool {
        self.scorer.get().is_some()
    }
}
