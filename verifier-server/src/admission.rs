//! A bounded, fair queue in front of the workers: callers wait in FIFO order for a permit, and
//! beyond `max_waiting` waiting callers the answer is 429 instead of unbounded memory.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::ApiError;

pub struct Admission {
    workers: Arc<Semaphore>,
    waiting: AtomicUsize,
    max_waiting: usize,
}

impl Admission {
    pub fn new(workers: usize, max_waiting: usize) -> Self {
        Self { workers: Arc::new(Semaphore::new(workers)), waiting: AtomicUsize::new(0), max_waiting }
    }

    /// A worker permit and how long the call waited for it.
    pub async fn admit(&self) -> Result<(OwnedSemaphorePermit, Duration), ApiError> {
        if let Ok(permit) = self.workers.clone().try_acquire_owned() {
            return Ok((permit, Duration::ZERO));
        }
        if self.waiting.fetch_add(1, Ordering::SeqCst) >= self.max_waiting {
            self.waiting.fetch_sub(1, Ordering::SeqCst);
            return Err(ApiError::QueueFull(1));
        }
        // Decrements even when the caller goes away while waiting.
        let _waiting = WaitingGuard(&self.waiting);
        let started = Instant::now();
        let permit = self.workers.clone().acquire_owned().await;
        let permit = permit.map_err(|_| ApiError::Internal("the worker pool is closed".into()))?;
        Ok((permit, started.elapsed()))
    }

    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::SeqCst)
    }
}

struct WaitingGuard<'a>(&'a AtomicUsize);

impl Drop for WaitingGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}
