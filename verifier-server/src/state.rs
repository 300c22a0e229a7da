//! What every handler shares.

use std::sync::Arc;

use spade_core::batching::{PassLimits, PassTimes};
use spade_core::limits::{MAX_SESSION_ID_LEN, MAX_TOP_LOGPROBS};
use spade_core::AcceptRule;
use spade_engine::Scorer;
use spade_http::{HttpSettings, ModelSlot};

use crate::admission::Admission;
use crate::batcher::Batcher;
use crate::config::Config;
use crate::engine::EngineBackend;
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::sessions::SessionStore;

/// What one call may ask for; `/v1/info` reports them, so gateways can check their settings.
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_draft: usize,
    pub max_top_logprobs: u8,
    pub max_session_id_len: usize,
}

/// The loaded model and the thread that runs its forward passes.
pub struct Target {
    pub scorer: Arc<dyn Scorer>,
    pub batcher: Batcher,
}

pub struct Verifier {
    /// Set once the model has loaded; until then /health is 503 and /verify answers not_ready.
    pub target_model: ModelSlot<Target>,
    /// With --engine: the serving engine that samples instead (set once its vocabulary is checked).
    pub engine: ModelSlot<EngineBackend>,
    pub accept: AcceptRule,
    pub model_id: String,
    pub sessions: SessionStore,
    pub admission: Admission,
    pub metrics: Arc<Metrics>,
    pub pass_limits: PassLimits,
    pub max_backlog_secs: f64,
    pub limits: Limits,
    pub http: HttpSettings,
}

pub type AppState = Arc<Verifier>;

impl Verifier {
    pub fn new(config: &Config) -> Self {
        Self {
            target_model: ModelSlot::default(),
            engine: ModelSlot::default(),
            accept: config.accept_rule(),
            model_id: config.model.clone().unwrap_or_default(),
            sessions: SessionStore::new(config.cache_budget_mb * 1024 * 1024, config.prefix_cache),
            admission: Admission::new(config.max_batch_sessions + config.queue_size),
            metrics: Arc::default(),
            pass_limits: config.pass_limits(),
            max_backlog_secs: config.max_backlog_secs,
            limits: Limits {
                max_draft: config.max_draft,
                max_top_logprobs: MAX_TOP_LOGPROBS,
                max_session_id_len: MAX_SESSION_ID_LEN,
            },
            http: config.server.http(),
        }
    }

    /// Serves `scorer` from now on, starting its scoring thread; `pass_times`: its blocks timed at start-up.
    pub fn load_model(
        &self,
        scorer: Arc<dyn Scorer>,
        pass_times: PassTimes,
    ) -> std::io::Result<()> {
        let batcher = Batcher::start(
            scorer.clone(),
            self.pass_limits,
            self.max_backlog_secs,
            self.metrics.clone(),
            pass_times,
        )?;
        self.target_model.set(Arc::new(Target { scorer, batcher }));
        Ok(())
    }

    /// The served model's facts, from whichever backend scores.
    pub fn meta(&self) -> Result<spade_engine::ModelMeta, ApiError> {
        match (self.target_model.get(), self.engine.get()) {
            (Some(target), _) => Ok(target.scorer.meta().clone()),
            (None, Some(engine)) => Ok(engine.meta.clone()),
            (None, None) => Err(ApiError::NotReady),
        }
    }

    pub fn target(&self) -> Result<&Arc<Target>, ApiError> {
        self.target_model.get().ok_or(ApiError::NotReady)
    }

    pub fn scorer(&self) -> Result<&Arc<dyn Scorer>, ApiError> {
        self.target().map(|t| &t.scorer)
    }
}
