//! A bound on the calls the verifier holds: those being scored and those waiting for a pass. Beyond
//! it the answer is 429 with retry-after instead of unbounded memory and latency.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::error::ApiError;

pub struct Admission {
    held: Arc<AtomicUsize>,
    max_held: usize,
}

/// One admitted call; dropping it (answered, failed or abandoned) frees its place.
pub struct Admitted(Arc<AtomicUsize>);

impl Drop for Admitted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Admission {
    pub fn new(max_held: usize) -> Self {
        Self { held: Arc::new(AtomicUsize::new(0)), max_held }
    }

    pub fn admit(&self) -> Result<Admitted, ApiError> {
        let admitted = self.held.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
            (n < self.max_held).then_some(n + 1)
        });
        match admitted {
            Ok(_) => Ok(Admitted(self.held.clone())),
            Err(_) => Err(ApiError::QueueFull(1)),
        }
    }

    /// Calls held now (scored or waiting).
    pub fn held(&self) -> usize {
        self.held.load(Ordering::SeqCst)
    }
}
