//! The model a server loads after it starts listening, so `/health` can answer "loading" meanwhile.

use std::sync::{Arc, OnceLock};

/// Empty until the background load sets it, then fixed for the life of the server.
pub struct ModelSlot<M: ?Sized> {
    model: OnceLock<Arc<M>>,
}

impl<M: ?Sized> Default for ModelSlot<M> {
    fn default() -> Self {
        Self { model: OnceLock::new() }
    }
}

impl<M: ?Sized> ModelSlot<M> {
    /// The first model set stays: a server serves one model.
    pub fn set(&self, model: Arc<M>) {
        let _ = self.model.set(model);
    }

    pub fn get(&self) -> Option<&Arc<M>> {
        self.model.get()
    }

    pub fn is_loaded(&self) -> bool {
        self.model.get().is_some()
    }
}
